//! Resolving a network's requested port mappings to host ports: which
//! existing mappings are kept, which ports are claimed, which given back,
//! and the rules a host port must pass. The host is shared with its owner:
//! an explicit host port must lie in `host_port_range` or in
//! `allowed_host_ports`, and no new mapping (explicit or automatic) may take
//! a port on which a host socket listens or is bound. The socket check is a
//! function of the caller's (a snapshot of the kernel's tables), so this
//! stays pure.

use std::net::Ipv4Addr;

use super::{PortAllocator, PortSet, Protocol};
use crate::types::PortMapping;

/// Why a mapping cannot have its host port; `index` is its position in
/// the request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MappingError {
    #[error(
        "port_mappings[{index}]: {protocol} host port {port} is already mapped by another sandbox"
    )]
    MappedElsewhere {
        index: usize,
        protocol: Protocol,
        port: u16,
    },
    #[error("port_mappings[{index}]: {protocol} host port {port} belongs to the host: {owner}")]
    HostSocket {
        index: usize,
        protocol: Protocol,
        port: u16,
        owner: String,
    },
    #[error(
        "port_mappings[{index}]: {protocol} host port {port} is outside host_port_range {}-{} \
         and not in allowed_host_ports",
        range.0,
        range.1
    )]
    NotAllowed {
        index: usize,
        protocol: Protocol,
        port: u16,
        range: (u16, u16),
    },
    #[error(
        "port_mappings[{index}]: no free {protocol} host port left in host_port_range {}-{}",
        range.0,
        range.1
    )]
    Exhausted {
        index: usize,
        protocol: Protocol,
        range: (u16, u16),
    },
}

/// What a host port must satisfy.
pub struct HostPortRules<'a> {
    /// `host_port_range`: automatic ports come from here, explicit ones may.
    pub range: (u16, u16),
    /// `allowed_host_ports`: explicit ports allowed outside the range.
    pub allowed: &'a PortSet,
    /// The host socket owning (protocol, host ip, port), described.
    pub host_socket: &'a dyn Fn(Protocol, Ipv4Addr, u16) -> Option<String>,
}

impl HostPortRules<'_> {
    fn explicit_allowed(&self, port: u16) -> bool {
        (self.range.0..=self.range.1).contains(&port) || self.allowed.contains(port)
    }
}

/// Outcome of [`resolve_ports`].
#[derive(Debug)]
pub struct Resolved {
    /// The mappings to record, in request order.
    pub mappings: Vec<PortMapping>,
    /// Host ports claimed by this call (to give back if a later step fails).
    pub claimed: Vec<PortMapping>,
    /// Existing mappings no longer wanted (to give back on success).
    pub stale: Vec<PortMapping>,
}

/// How many automatic ports in a row may turn out to be host-owned before
/// the request is refused (each probe is a bitmap step, not a syscall).
const HOST_OWNED_PROBES: usize = 1024;

/// For each requested mapping, the index of the existing mapping it keeps,
/// or `None` when it needs a host port of its own. Explicit host ports are
/// matched first (same protocol and host port), then automatic ones (same
/// protocol, container port and host address); each existing mapping is
/// kept at most once.
pub fn reuse_plan(requested: &[PortMapping], existing: &[PortMapping]) -> Vec<Option<usize>> {
    let mut kept = vec![false; existing.len()];
    let mut plan = vec![None; requested.len()];
    for pass_explicit in [true, false] {
        for (index, req) in requested.iter().enumerate() {
            if (req.host_port != 0) != pass_explicit {
                continue;
            }
            plan[index] = existing.iter().enumerate().position(|(j, e)| {
                !kept[j]
                    && e.protocol == req.protocol
                    && if pass_explicit {
                        e.host_port == req.host_port
                    } else {
                        e.container_port == req.container_port && e.host_ip == req.host_ip
                    }
            });
            if let Some(j) = plan[index] {
                kept[j] = true;
            }
        }
    }
    plan
}

/// The requested mappings the host-port rules must look at: those that
/// need a new host port, and kept ones whose host address changed.
pub fn to_check(requested: &[PortMapping], existing: &[PortMapping]) -> Vec<usize> {
    reuse_plan(requested, existing)
        .iter()
        .enumerate()
        .filter(|(i, j)| j.is_none_or(|j| existing[j].host_ip != requested[*i].host_ip))
        .map(|(i, _)| i)
        .collect()
}

/// Resolves requested port mappings against the ones a network already has
/// ([`reuse_plan`]). A kept mapping keeps its host port; one whose host
/// address changed is checked against the host's sockets again. On error
/// everything claimed here is given back.
pub fn resolve_ports(
    ports: &mut PortAllocator,
    requested: &[PortMapping],
    existing: &[PortMapping],
    rules: &HostPortRules<'_>,
) -> Result<Resolved, MappingError> {
    let plan = reuse_plan(requested, existing);
    let mut out: Vec<Option<PortMapping>> = vec![None; requested.len()];
    let mut claimed: Vec<PortMapping> = vec![];
    let undo = |ports: &mut PortAllocator, claimed: &[PortMapping]| {
        for m in claimed {
            ports.release(m.protocol, m.host_port);
        }
    };
    // Explicit ports first, so an automatic one cannot take a port asked
    // for by name in the same request.
    for pass_explicit in [true, false] {
        for (index, req) in requested.iter().enumerate() {
            if (req.host_port != 0) != pass_explicit {
                continue;
            }
            let host_ip: Ipv4Addr = req.host_ip.parse().unwrap_or(Ipv4Addr::UNSPECIFIED);
            let got = match plan[index] {
                Some(j) if existing[j].host_ip == req.host_ip => Ok(existing[j].host_port),
                Some(j) => {
                    host_socket_free(rules, index, req.protocol, host_ip, existing[j].host_port)
                }
                None if pass_explicit => claim_explicit(ports, rules, index, req, host_ip),
                None => claim_automatic(ports, rules, index, req.protocol, host_ip),
            };
            let host_port = match got {
                Ok(p) => p,
                Err(e) => {
                    undo(ports, &claimed);
                    return Err(e);
                }
            };
            let m = PortMapping {
                host_port,
                ..req.clone()
            };
            if plan[index].is_none() {
                claimed.push(m.clone());
            }
            out[index] = Some(m);
        }
    }
    let stale = existing
        .iter()
        .enumerate()
        .filter(|(j, _)| !plan.contains(&Some(*j)))
        .map(|(_, e)| e.clone())
        .collect();
    Ok(Resolved {
        mappings: out.into_iter().flatten().collect(),
        claimed,
        stale,
    })
}

/// `port` unless a host socket owns it for `host_ip`.
fn host_socket_free(
    rules: &HostPortRules<'_>,
    index: usize,
    protocol: Protocol,
    host_ip: Ipv4Addr,
    port: u16,
) -> Result<u16, MappingError> {
    match (rules.host_socket)(protocol, host_ip, port) {
        Some(owner) => Err(MappingError::HostSocket {
            index,
            protocol,
            port,
            owner,
        }),
        None => Ok(port),
    }
}

fn claim_explicit(
    ports: &mut PortAllocator,
    rules: &HostPortRules<'_>,
    index: usize,
    req: &PortMapping,
    host_ip: Ipv4Addr,
) -> Result<u16, MappingError> {
    let (protocol, port) = (req.protocol, req.host_port);
    if !rules.explicit_allowed(port) {
        return Err(MappingError::NotAllowed {
            index,
            protocol,
            port,
            range: rules.range,
        });
    }
    host_socket_free(rules, index, protocol, host_ip, port)?;
    ports
        .reserve(protocol, port)
        .map_err(|_| MappingError::MappedElsewhere {
            index,
            protocol,
            port,
        })?;
    Ok(port)
}

/// The next free port of the range that no host socket owns; host-owned
/// ones are held while probing (so they are not offered again) and given
/// back afterwards.
fn claim_automatic(
    ports: &mut PortAllocator,
    rules: &HostPortRules<'_>,
    index: usize,
    protocol: Protocol,
    host_ip: Ipv4Addr,
) -> Result<u16, MappingError> {
    let mut skipped = vec![];
    let mut result = Err(MappingError::Exhausted {
        index,
        protocol,
        range: rules.range,
    });
    while skipped.len() < HOST_OWNED_PROBES {
        let Ok(p) = ports.allocate(protocol) else {
            break;
        };
        if (rules.host_socket)(protocol, host_ip, p).is_some() {
            skipped.push(p);
            continue;
        }
        result = Ok(p);
        break;
    }
    for p in skipped {
        ports.release(protocol, p);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pm(p: Protocol, c: u16, h: u16) -> PortMapping {
        PortMapping {
            protocol: p,
            container_port: c,
            host_port: h,
            host_ip: "0.0.0.0".into(),
        }
    }

    fn no_sockets(_: Protocol, _: Ipv4Addr, _: u16) -> Option<String> {
        None
    }

    fn rules<'a>(
        range: (u16, u16),
        allowed: &'a PortSet,
        host_socket: &'a dyn Fn(Protocol, Ipv4Addr, u16) -> Option<String>,
    ) -> HostPortRules<'a> {
        HostPortRules {
            range,
            allowed,
            host_socket,
        }
    }

    #[test]
    fn allocates_and_reuses() {
        let mut ports = PortAllocator::new(100, 103, PortSet::default());
        let allowed: PortSet = "9022".parse().unwrap();
        let r = rules((100, 103), &allowed, &no_sockets);
        let req = vec![pm(Protocol::Tcp, 80, 0), pm(Protocol::Tcp, 22, 9022)];
        let res = resolve_ports(&mut ports, &req, &[], &r).unwrap();
        let (got, claimed, stale) = (res.mappings, res.claimed, res.stale);
        assert_eq!(
            got,
            vec![pm(Protocol::Tcp, 80, 100), pm(Protocol::Tcp, 22, 9022)]
        );
        assert_eq!(claimed.len(), 2);
        assert!(stale.is_empty());
        // Same request again: same ports, nothing claimed or freed.
        let res = resolve_ports(&mut ports, &req, &got, &r).unwrap();
        assert_eq!(res.mappings, got);
        assert!(res.claimed.is_empty() && res.stale.is_empty());
        // Change: drop 22, add udp 53 -> 53 claimed, 9022 stale.
        let req2 = vec![pm(Protocol::Tcp, 80, 0), pm(Protocol::Udp, 53, 0)];
        let res = resolve_ports(&mut ports, &req2, &got, &r).unwrap();
        assert_eq!(
            res.mappings,
            vec![pm(Protocol::Tcp, 80, 100), pm(Protocol::Udp, 53, 100)]
        );
        assert_eq!(res.claimed, vec![pm(Protocol::Udp, 53, 100)]);
        assert_eq!(res.stale, vec![pm(Protocol::Tcp, 22, 9022)]);
    }

    #[test]
    fn conflict_rolls_back() {
        let mut ports = PortAllocator::new(100, 101, PortSet::default());
        let allowed: PortSet = "8080".parse().unwrap();
        let r = rules((100, 101), &allowed, &no_sockets);
        ports.reserve(Protocol::Tcp, 8080).unwrap();
        let req = vec![pm(Protocol::Tcp, 1, 0), pm(Protocol::Tcp, 2, 8080)];
        let e = resolve_ports(&mut ports, &req, &[], &r).unwrap_err();
        assert!(
            matches!(e, MappingError::MappedElsewhere { index: 1, .. }),
            "{e:?}"
        );
        assert_eq!(ports.free(Protocol::Tcp), 2, "nothing stays claimed");
        let req = vec![
            pm(Protocol::Tcp, 1, 0),
            pm(Protocol::Tcp, 2, 0),
            pm(Protocol::Tcp, 3, 0),
        ];
        let e = resolve_ports(&mut ports, &req, &[], &r).unwrap_err();
        assert!(
            matches!(e, MappingError::Exhausted { index: 2, .. }),
            "{e:?}"
        );
        assert!(e.to_string().contains("100-101"), "{e}");
        assert_eq!(ports.free(Protocol::Tcp), 2);
    }

    #[test]
    fn explicit_port_takes_over_own_auto_port() {
        let mut ports = PortAllocator::new(100, 103, PortSet::default());
        let none = PortSet::default();
        let r = rules((100, 103), &none, &no_sockets);
        let existing = vec![pm(Protocol::Tcp, 80, 100)];
        ports.reserve(Protocol::Tcp, 100).unwrap();
        // Now ask for container 81 explicitly on 100, and 80 automatically.
        let req = vec![pm(Protocol::Tcp, 80, 0), pm(Protocol::Tcp, 81, 100)];
        let res = resolve_ports(&mut ports, &req, &existing, &r).unwrap();
        assert_eq!(res.mappings[1], pm(Protocol::Tcp, 81, 100));
        assert_ne!(res.mappings[0].host_port, 100);
        assert_eq!(res.claimed.len(), 1);
        assert!(res.stale.is_empty());
    }

    #[test]
    fn explicit_ports_only_in_the_range_or_allowed() {
        let mut ports = PortAllocator::new(20000, 20009, PortSet::default());
        let allowed: PortSet = "80,443".parse().unwrap();
        let r = rules((20000, 20009), &allowed, &no_sockets);
        let e = resolve_ports(&mut ports, &[pm(Protocol::Tcp, 80, 22)], &[], &r).unwrap_err();
        assert_eq!(
            e.to_string(),
            "port_mappings[0]: tcp host port 22 is outside host_port_range 20000-20009 and not \
             in allowed_host_ports"
        );
        for p in [80, 443, 20000, 20009] {
            resolve_ports(&mut ports, &[pm(Protocol::Tcp, 80, p)], &[], &r).unwrap();
        }
        assert_eq!(ports.used_count(Protocol::Tcp), 4);
    }

    #[test]
    fn what_needs_the_host_rules() {
        let existing = vec![pm(Protocol::Tcp, 80, 100)];
        // Kept as is: nothing to check.
        assert!(to_check(&[pm(Protocol::Tcp, 80, 0)], &existing).is_empty());
        assert!(to_check(&[pm(Protocol::Tcp, 81, 100)], &existing).is_empty());
        // A second mapping of the same container port needs a port of its
        // own (each existing mapping is kept once).
        assert_eq!(
            to_check(
                &[pm(Protocol::Tcp, 80, 0), pm(Protocol::Tcp, 80, 0)],
                &existing
            ),
            vec![1]
        );
        // A kept port on another address is checked again.
        let mut moved = pm(Protocol::Tcp, 80, 100);
        moved.host_ip = "127.0.0.1".into();
        assert_eq!(to_check(&[moved.clone()], &existing), vec![0]);
        let mut ports = PortAllocator::new(100, 101, PortSet::default());
        ports.reserve(Protocol::Tcp, 100).unwrap();
        let none = PortSet::default();
        let host = |_: Protocol, ip: Ipv4Addr, port: u16| {
            (ip.is_loopback() && port == 100).then(|| "a host socket on 127.0.0.1:100".to_owned())
        };
        let e = resolve_ports(
            &mut ports,
            &[moved],
            &existing,
            &rules((100, 101), &none, &host),
        )
        .unwrap_err();
        assert!(
            matches!(e, MappingError::HostSocket { port: 100, .. }),
            "{e:?}"
        );
        assert!(
            ports.is_used(Protocol::Tcp, 100),
            "the kept port stays the network's"
        );
    }

    #[test]
    fn host_sockets_are_never_taken() {
        let mut ports = PortAllocator::new(100, 104, PortSet::default());
        let none = PortSet::default();
        // The host listens on tcp 100 and 101 (any address) and 103 on
        // 127.0.0.1 only.
        let host = |proto: Protocol, ip: Ipv4Addr, port: u16| {
            let owned = proto == Protocol::Tcp
                && (port == 100
                    || port == 101
                    || (port == 103 && (ip.is_unspecified() || ip.is_loopback())));
            owned.then(|| format!("a host socket is listening on {port}"))
        };
        let r = rules((100, 104), &none, &host);
        let e = resolve_ports(&mut ports, &[pm(Protocol::Tcp, 80, 101)], &[], &r).unwrap_err();
        assert!(
            matches!(&e, MappingError::HostSocket { index: 0, port: 101, owner, .. } if owner.contains("listening on 101")),
            "{e:?}"
        );
        // Automatic ports skip the host's, and give the skipped ones back.
        let res = resolve_ports(&mut ports, &[pm(Protocol::Tcp, 80, 0)], &[], &r).unwrap();
        assert_eq!(res.mappings[0].host_port, 102);
        assert_eq!(ports.used_count(Protocol::Tcp), 1);
        // A specific node address does not collide with a loopback listener.
        let mut m = pm(Protocol::Tcp, 81, 103);
        m.host_ip = "198.51.100.1".into();
        resolve_ports(&mut ports, &[m], &[], &r).unwrap();
        // UDP is not the TCP listener's.
        resolve_ports(&mut ports, &[pm(Protocol::Udp, 53, 100)], &[], &r).unwrap();
        // Only host-owned ports left: exhausted, nothing kept.
        let mut ports = PortAllocator::new(100, 101, PortSet::default());
        let e = resolve_ports(&mut ports, &[pm(Protocol::Tcp, 80, 0)], &[], &r).unwrap_err();
        assert!(matches!(e, MappingError::Exhausted { .. }), "{e:?}");
        assert_eq!(ports.used_count(Protocol::Tcp), 0);
    }
}
