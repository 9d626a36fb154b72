//! Port mappings at the edge of the host: "" host addresses resolved to
//! the default, a mapping's host address checked against the node's own,
//! and a snapshot of the host's sockets for the host-port rules
//! (`alloc::mapping`).

use std::net::{Ipv4Addr, Ipv6Addr};

use super::spec::{NetworkSpec, PortMapping};
use super::{Agent, AgentError, SocketCheck, failed};
use crate::alloc::mapping::HostPortRules;
use crate::hostsock::HostSockets;

impl Agent {
    /// Resolves "" host IPs to the default bind address so stored records
    /// and comparisons are explicit.
    pub(super) fn normalise(&self, mut spec: NetworkSpec) -> NetworkSpec {
        for m in &mut spec.port_mappings {
            if m.host_ip.is_empty() {
                m.host_ip = self.d.default_host_ip.to_string();
            }
        }
        spec
    }

    /// A sandbox MTU above the uplink's: the guest's full-size packets to
    /// the world could not leave the node (the kernel drops what exceeds
    /// the uplink's MTU after the redirect; nothing tells the guest).
    pub(super) fn check_mtu(&self, spec: &NetworkSpec) -> Result<(), super::AgentError> {
        let mtu = spec.mtu.unwrap_or(self.cfg.mtu);
        match &self.uplink {
            super::Uplink::Found { name, mtu: up, .. } if mtu > *up => {
                Err(super::AgentError::InvalidArgument(format!(
                    "mtu: {mtu} is above the MTU of the uplink {name} ({up}): the sandbox's \
                     full-size packets could not leave the node"
                )))
            }
            _ => Ok(()),
        }
    }

    /// What a new mapping's host port must pass (see `alloc::mapping`).
    pub(super) fn port_rules<'a>(&'a self, sockets: &'a SocketCheck) -> HostPortRules<'a> {
        HostPortRules {
            range: (self.d.port_low, self.d.port_high),
            allowed: &self.d.allowed_ports,
            host_socket: sockets,
        }
    }

    /// Checks the host address of each mapping that is new or moved (a
    /// node address, loopback or the wildcard) and, when there is one, takes
    /// a snapshot of the host's sockets, outside every lock. What counts as
    /// new is decided by the same plan `resolve_ports` follows.
    pub(super) async fn host_sockets(
        &self,
        spec: &NetworkSpec,
        existing: &[PortMapping],
        reserved: super::cni::Reserved,
    ) -> Result<Box<SocketCheck>, AgentError> {
        let checked = crate::alloc::mapping::to_check(&spec.port_mappings, existing);
        if checked.is_empty() {
            return Ok(Box::new(|_, _, _| None));
        }
        // IPv6: the datapath maps it on the uplink's address (followed
        // live), so a specific one must be that one; "::" is it too.
        let uplink6 = self.uplink6();
        for &i in &checked {
            let Ok(a) = spec.port_mappings[i].host_ip.parse::<Ipv6Addr>() else {
                continue;
            };
            if !self.ipv6_link() {
                return Err(AgentError::InvalidArgument(format!(
                    "port_mappings[{i}]: host_ip {a}: IPv6 is off on this node"
                )));
            }
            if !a.is_unspecified() && Some(a) != uplink6 {
                return Err(AgentError::InvalidArgument(format!(
                    "port_mappings[{i}]: host_ip {a} is not the node's IPv6 address mappings are on \
                     ({}; or :: for it)",
                    uplink6.map_or("the uplink has none now".to_string(), |u| {
                        format!("the uplink's, {u}")
                    })
                )));
            }
        }
        let specific: Vec<(usize, Ipv4Addr)> = checked
            .iter()
            .filter_map(|&i| {
                let a = spec.port_mappings[i].host_ip.parse::<Ipv4Addr>().ok()?;
                (!a.is_unspecified() && !a.is_loopback()).then_some((i, a))
            })
            .collect();
        if !specific.is_empty() {
            let local = self
                .nl
                .local_ipv4_addrs()
                .await
                .map_err(|e| failed("listing the node's addresses", &e))?;
            if let Some((i, a)) = specific.iter().find(|(_, a)| !local.contains(a)) {
                return Err(AgentError::InvalidArgument(format!(
                    "port_mappings[{i}]: host_ip {a} is not an address of this node \
                     (use 0.0.0.0 for every address, or one of {})",
                    local
                        .iter()
                        .map(Ipv4Addr::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
        }
        let table = tokio::task::spawn_blocking(HostSockets::scan)
            .await
            .map_err(|e| failed("reading the host's sockets", &e))?;
        // The runtime's own reservations of this attachment's ports (see
        // `agent::cni`) do not count against it.
        Ok(Box::new(move |proto, ip, port| {
            table
                .owners(proto, ip, port)
                .find(|s| !reserved.contains(&(proto, port, s.inode)))
                .map(ToString::to_string)
        }))
    }
}
