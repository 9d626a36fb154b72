//! Port mappings at the edge of the host: "" host addresses resolved to
//! the default, a mapping's host address checked against the node's own,
//! and a snapshot of the host's sockets for the host-port rules
//! (`alloc::mapping`).

use std::net::Ipv4Addr;

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

    /// What a new mapping's host port must pass (see `alloc::mapping`).
    pub(super) fn port_rules<'a>(&'a self, sockets: &'a SocketCheck) -> HostPortRules<'a> {
        HostPortRules {
            range: (self.d.port_low, self.d.port_high),
            allowed: &self.d.allowed_ports,
            host_socket: sockets,
        }
    }

    /// Checks each mapping's host address (a node address, loopback or the
    /// wildcard) and, when the request may claim a host port, takes a
    /// snapshot of the host's sockets, outside every lock.
    pub(super) async fn host_sockets(
        &self,
        spec: &NetworkSpec,
        existing: &[PortMapping],
    ) -> Result<Box<SocketCheck>, AgentError> {
        let specific: Vec<(usize, Ipv4Addr)> = spec
            .port_mappings
            .iter()
            .enumerate()
            .filter_map(|(i, m)| m.host_ip.parse::<Ipv4Addr>().ok().map(|a| (i, a)))
            .filter(|(_, a)| !a.is_unspecified() && !a.is_loopback())
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
        // Every wanted mapping already held by this network: nothing new
        // is claimed, no need to read the kernel's tables.
        let all_kept = spec.port_mappings.iter().all(|m| {
            existing.iter().any(|e| {
                e.protocol == m.protocol
                    && (e.host_port == m.host_port
                        || (m.host_port == 0
                            && e.container_port == m.container_port
                            && e.host_ip == m.host_ip))
            })
        });
        if all_kept {
            return Ok(Box::new(|_, _, _| None));
        }
        let table = tokio::task::spawn_blocking(HostSockets::scan)
            .await
            .map_err(|e| failed("reading the host's sockets", &e))?;
        Ok(Box::new(move |proto, ip, port| {
            table.owner(proto, ip, port).map(ToString::to_string)
        }))
    }
}
