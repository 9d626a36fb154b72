//! What CNI attachments need of the core beyond a TAP network's life: a
//! sandbox address the caller asks for (CNI's `ips` capability, podman's
//! `--ip`), the namespace id that tells a container's namespace is gone,
//! and releasing networks whose container went without a DEL (a runtime
//! that removed it while the agent was down, and never retries: podman).

use std::collections::{BTreeSet, HashMap};
use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::time::Duration;

use tracing::{info, warn};

use super::spec::{Attach, AttachRecord, Expect, NetnsId, NetworkSpec};
use super::{Agent, AgentError, Allocs};
use crate::alloc::ip::ReserveError;

/// How often the agent looks for CNI networks whose namespace is gone
/// (and once right after start): a network is released within this of
/// its namespace's end.
pub const GONE_NETNS_PERIOD: Duration = Duration::from_secs(15);

fn invalid(msg: String) -> AgentError {
    AgentError::InvalidArgument(msg)
}

/// An address in the guests' IPv6 /64 (the container's SLAAC address and
/// the fixed guest address): inside the container, not a sandbox's.
fn is_guest_ipv6(a: Ipv6Addr) -> bool {
    a.segments()[..4] == crate::types::GUEST_IPV6.segments()[..4]
}

/// How long the sockets that held a released CNI network's ports count as
/// its runtime's reservations (podman's `network reload` releases and
/// makes the network again at once, while conmon keeps the ports).
pub const RESERVATION_TTL: Duration = Duration::from_secs(60);

/// The sockets (protocol, port, socket inode) found on a released CNI
/// network's mapped ports, and when.
pub struct Reservations {
    at: std::time::Instant,
    sockets: Reserved,
}

/// (protocol, host port, socket inode) of host sockets that do not count
/// against a new mapping.
pub type Reserved = Vec<(crate::alloc::Protocol, u16, u64)>;

/// The option `sandbox_ip` (an IPv4 address) as the wire edges pass it.
pub fn parse_sandbox_ip(value: &str) -> Result<Ipv4Addr, AgentError> {
    value.parse().map_err(|_| {
        invalid(format!(
            "sandbox_ip: '{value}' is not an IPv4 address (sandbox addresses are IPv4; an IPv6 \
             one goes in sandbox_ipv6)"
        ))
    })
}

/// The option `sandbox_ipv6` (an IPv6 address) as the wire edges pass it.
pub fn parse_sandbox_ipv6(value: &str) -> Result<Ipv6Addr, AgentError> {
    value
        .parse()
        .map_err(|_| invalid(format!("sandbox_ipv6: '{value}' is not an IPv6 address")))
}

impl Agent {
    /// The sandbox address `spec` asks for, if any: `sandbox_ip`, or the
    /// IPv4 address a `sandbox_ipv6` in `ipv6_pool` carries (a sandbox's
    /// IPv6 identity follows from its IPv4 address); both given must
    /// agree. Each error names the address.
    pub(super) fn requested_address(
        &self,
        spec: &NetworkSpec,
    ) -> Result<Option<Ipv4Addr>, AgentError> {
        // The container's own interface addresses, the same in every
        // container (what a runtime read back from the result and asks
        // for again, as podman's `network reload` does): every attachment
        // has them, so they ask for no sandbox address.
        let v4 = spec.sandbox_ip.filter(|a| *a != self.d.guest_ip);
        let v6 = spec.sandbox_ipv6.filter(|a| !is_guest_ipv6(*a));
        let from6 = match v6 {
            None => None,
            Some(a6) => Some(self.ipv4_of(a6)?),
        };
        match (v4, from6, v6) {
            (Some(a), Some(b), Some(a6)) if a != b => Err(invalid(format!(
                "sandbox_ipv6: {a6} is not the IPv6 address of {a} ({}): a sandbox's IPv6 \
                 address follows from its IPv4 one",
                self.d.pool6_addr(a)
            ))),
            (a, b, _) => Ok(a.or(b)),
        }
    }

    /// The IPv4 address a requested sandbox IPv6 address follows from.
    fn ipv4_of(&self, a6: Ipv6Addr) -> Result<Ipv4Addr, AgentError> {
        if !self.gateway.pool6 {
            return Err(invalid(format!(
                "sandbox_ipv6: {a6}: sandboxes have no IPv6 address on this node (ipv6_pool \
                 is not routed: IPv6 is off)"
            )));
        }
        let o = a6.octets();
        let v4 = Ipv4Addr::new(o[12], o[13], o[14], o[15]);
        if self.d.pool6_addr(v4) != a6 {
            return Err(invalid(format!(
                "sandbox_ipv6: {a6} is not in ipv6_pool ({}/96), where each sandbox's IPv6 \
                 address is the one that follows from its IPv4 address",
                self.d.pool6_addr(Ipv4Addr::UNSPECIFIED)
            )));
        }
        Ok(v4)
    }

    /// Takes the requested address `ip` for a new network, or says why
    /// not, naming it.
    pub(super) fn take_address(&self, a: &mut Allocs, ip: Ipv4Addr) -> Result<(), AgentError> {
        a.ips.reserve(ip).map_err(|e| {
            invalid(match e {
                ReserveError::OutOfPool => format!(
                    "sandbox_ip: {ip} is not in the sandbox pool {} (ask for a free address in \
                     it, or for none)",
                    self.d.pool
                ),
                ReserveError::Reserved => {
                    format!("sandbox_ip: {ip} is the pool's network, gateway or broadcast address")
                }
                ReserveError::Taken => {
                    format!("sandbox_ip: {ip} is another network's address (in use)")
                }
            })
        })
    }

    /// A converge may ask for the address the network has, never another.
    pub(super) fn check_same_address(
        &self,
        spec: &NetworkSpec,
        rec: &super::spec::NetworkRecord,
    ) -> Result<(), AgentError> {
        match self.requested_address(spec)? {
            Some(ip) if std::net::IpAddr::V4(ip) != rec.sandbox_ip => Err(invalid(format!(
                "sandbox_ip: network '{}' has {}, not {ip}; its address cannot change (release \
                 it first)",
                rec.sandbox_id, rec.sandbox_ip
            ))),
            _ => Ok(()),
        }
    }

    /// The record of `attach`: a veth's with its namespace's id in the
    /// node's namespace (assigned now if it has none), so that the agent
    /// can tell later whether the namespace still exists. Without one
    /// (the kernel refused: logged) the network is never released for
    /// that.
    pub(super) async fn attach_record(&self, attach: &Attach) -> AttachRecord {
        let mut rec = attach.record();
        if let (Attach::Veth { netns, .. }, AttachRecord::Veth { nsid, .. }) = (attach, &mut rec) {
            let fd = netns.fd.clone();
            match super::off_worker(move || crate::netns::nsid::of(std::os::fd::AsFd::as_fd(&*fd)))
                .await
            {
                Ok(id) => *nsid = Some(id),
                Err(e) => warn!(
                    netns = %netns.id,
                    error = %e,
                    "no namespace id for the container's namespace: its network is not released \
                     when the namespace goes without a DEL"
                ),
            }
        }
        rec
    }

    /// A CNI network with `mapping_wins` was released: the host sockets
    /// on its mapped ports now are ones that bound them while the mapping
    /// lived (EnsureNetwork refused any that held them before), i.e. the
    /// runtime's reservations (conmon's). The same attachment may map
    /// those ports over these very sockets (by inode) again for
    /// [`RESERVATION_TTL`]: a runtime that tears down and sets up a
    /// running container's network (podman's `network reload`). Any other
    /// socket still counts.
    pub(super) async fn note_reservations(&self, rec: &super::spec::NetworkRecord) {
        if !rec.mapping_wins || rec.port_mappings.is_empty() {
            return;
        }
        let table = super::off_worker(crate::hostsock::HostSockets::scan).await;
        let sockets: Reserved = rec
            .port_mappings
            .iter()
            .flat_map(|m| {
                table
                    .on_port(m.protocol, m.host_port)
                    .map(|s| (m.protocol, m.host_port, s.inode))
                    .collect::<Vec<_>>()
            })
            .collect();
        let mut r = self.reservations.lock().unwrap_or_else(|p| p.into_inner());
        r.retain(|_, v| v.at.elapsed() < RESERVATION_TTL);
        if !sockets.is_empty() {
            r.insert(
                rec.sandbox_id.clone(),
                Reservations {
                    at: std::time::Instant::now(),
                    sockets,
                },
            );
        }
    }

    /// The reservations the attachment `id` may map over (see
    /// [`Self::note_reservations`]).
    pub(super) fn reservations_of(&self, id: &str) -> Reserved {
        let r = self.reservations.lock().unwrap_or_else(|p| p.into_inner());
        r.get(id)
            .filter(|v| v.at.elapsed() < RESERVATION_TTL)
            .map(|v| v.sockets.clone())
            .unwrap_or_default()
    }

    /// Releases every CNI network whose container's namespace is gone
    /// without a DEL: its recorded namespace id no longer exists in the
    /// node's namespace (an id lives exactly as long as its namespace), or
    /// the kernel gave that id to another namespace one of the agent's own
    /// networks lives in (so the first one's namespace had ended), and its
    /// veth is gone. A network whose namespace exists, or whose record has
    /// no id (made before ids were kept), is never touched. Returns how
    /// many were released.
    pub async fn release_gone_namespaces(&self) -> usize {
        let veths: Vec<Veth> = self
            .list()
            .into_iter()
            .filter_map(|v| match &v.record.attach {
                AttachRecord::Veth {
                    nsid: Some(n),
                    netns,
                    ..
                } => Some(Veth {
                    id: v.record.sandbox_id.clone(),
                    handle: v.record.network_handle.clone(),
                    name: v.record.tap_name.clone(),
                    ifindex: v.tap_ifindex,
                    nsid: *n,
                    netns: *netns,
                    created: v.record.created_unix,
                }),
                _ => None,
            })
            .collect();
        if veths.is_empty() {
            return 0;
        }
        let live = match super::off_worker(crate::netns::nsid::live).await {
            Ok(l) => l,
            Err(e) => {
                warn!(error = %e, "listing namespace ids failed; CNI networks are not checked");
                return 0;
            }
        };
        let mut released = 0;
        for (i, reason) in gone_namespaces(&live, &veths) {
            let v = &veths[i];
            // The namespace is gone, so is the pair; if the host end is
            // still named (the kernel is still tearing the namespace down),
            // the next pass looks again.
            if v.ifindex != 0 && self.still_named(&v.name, v.ifindex).await {
                continue;
            }
            let expect = Expect {
                network_handle: Some(v.handle.clone()),
                ..Default::default()
            };
            match self.release_if(&v.id, &expect).await {
                Ok(Some(_)) => {
                    released += 1;
                    crate::metrics::NETNS_GONE_RELEASED
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    info!(
                        sandbox_id = v.id.as_str(),
                        reason,
                        "CNI network released: its container's network namespace is gone and no \
                         DEL came"
                    );
                }
                Ok(None) | Err(AgentError::Conflict(_)) => {}
                Err(e) => warn!(
                    sandbox_id = v.id.as_str(),
                    error = %e,
                    "releasing a CNI network whose namespace is gone failed; tried again later"
                ),
            }
        }
        released
    }

    /// Runs [`Self::release_gone_namespaces`] now and every
    /// [`GONE_NETNS_PERIOD`] while the agent lives.
    pub fn spawn_gone_netns_reaper(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let Some(agent) = weak.upgrade() else { return };
                agent.release_gone_namespaces().await;
                drop(agent);
                tokio::time::sleep(GONE_NETNS_PERIOD).await;
            }
        });
    }
}

/// What [`gone_namespaces`] judges of a CNI network.
#[derive(Debug, Clone)]
pub struct Veth {
    pub id: String,
    pub handle: String,
    /// The host end and its ifindex (0: adopted without one).
    pub name: String,
    pub ifindex: u32,
    pub nsid: i32,
    pub netns: Option<NetnsId>,
    pub created: u64,
}

/// Which of `veths` live in a namespace that is gone, with the reason:
/// its id is not among the node's `live` ids, or a network made later
/// (in a later second) recorded the same id for another namespace (by
/// device and inode): the kernel gives an id out again only once its
/// namespace is gone. Pure.
pub fn gone_namespaces(live: &BTreeSet<i32>, veths: &[Veth]) -> Vec<(usize, String)> {
    let mut by_id: HashMap<i32, Vec<usize>> = HashMap::new();
    for (i, v) in veths.iter().enumerate() {
        by_id.entry(v.nsid).or_default().push(i);
    }
    let mut out = vec![];
    for (i, v) in veths.iter().enumerate() {
        if !live.contains(&v.nsid) {
            out.push((
                i,
                format!(
                    "namespace id {} no longer exists in the node's namespace",
                    v.nsid
                ),
            ));
            continue;
        }
        let Some(mine) = v.netns else { continue };
        let later = by_id[&v.nsid]
            .iter()
            .map(|&j| &veths[j])
            .find(|o| o.created > v.created && o.netns.is_some_and(|other| other != mine));
        if let Some(o) = later {
            out.push((
                i,
                format!(
                    "namespace id {} was given to another namespace since ({}, network '{}')",
                    v.nsid,
                    o.netns.expect("checked"),
                    o.id
                ),
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(id: &str, nsid: i32, ino: Option<u64>, created: u64) -> Veth {
        Veth {
            id: id.into(),
            handle: "h".into(),
            name: "ctap".into(),
            ifindex: 7,
            nsid,
            netns: ino.map(|ino| NetnsId { dev: 4, ino }),
            created,
        }
    }

    /// Only a CNI attachment's mappings may win over host sockets.
    #[test]
    fn mapping_wins_is_a_veths_only() {
        let e = NetworkSpec {
            mapping_wins: true,
            ..Default::default()
        }
        .validated()
        .unwrap_err();
        assert!(e.to_string().starts_with("mapping_wins: "), "{e}");
        assert_eq!(
            parse_sandbox_ip("192.168.0.9").unwrap(),
            Ipv4Addr::new(192, 168, 0, 9)
        );
        let e = parse_sandbox_ip("fd63::1").unwrap_err().to_string();
        assert!(e.contains("'fd63::1'") && e.contains("sandbox_ipv6"), "{e}");
        assert!(
            parse_sandbox_ipv6("x")
                .unwrap_err()
                .to_string()
                .contains("'x'")
        );
    }

    #[test]
    fn a_namespace_is_gone_only_when_its_id_proves_it() {
        let live = BTreeSet::from([0, 1, 2, 3]);
        let veths = vec![
            v("alive", 0, Some(100), 1),
            v("gone", 5, Some(101), 1),
            // Id 1 given to another namespace later: "old" lived there
            // before (its namespace ended, its id was given out again);
            // "new" is alive.
            v("old", 1, Some(102), 1),
            v("new", 1, Some(103), 2),
            // Same id, different namespaces, same second: no proof.
            v("tie-a", 3, Some(105), 4),
            v("tie-b", 3, Some(106), 4),
            // Same namespace twice: never a reason.
            v("twin-a", 2, Some(104), 1),
            v("twin-b", 2, Some(104), 2),
            // No namespace recorded: only the id's absence counts.
            v("legacy", 2, None, 0),
        ];
        let gone = gone_namespaces(&live, &veths);
        let ids: Vec<&str> = gone.iter().map(|(i, _)| veths[*i].id.as_str()).collect();
        assert_eq!(ids, vec!["gone", "old"]);
        assert!(gone[0].1.contains("no longer exists"), "{}", gone[0].1);
        assert!(gone[1].1.contains("network 'new'"), "{}", gone[1].1);
    }
}
