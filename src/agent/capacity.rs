//! The node's headroom for schedulers (`Capacity` on every edge, the same
//! numbers in metrics): what is free, what is used, what limits are
//! committed. Every number is a counter the agent keeps or a reading of
//! the reaper's last pass: nothing here walks the networks or the flow
//! tables, so a call costs the same at 10,000 networks as at one.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use super::Agent;
use crate::alloc::Protocol;
use crate::datapath::maps::{FLOW_MAP_ENTRIES, HOST_FLOW_ENTRIES};

/// One `Capacity` answer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Capacity {
    pub networks: u64,
    pub addresses_free: u64,
    pub addresses_total: u64,
    /// Warm TAPs ready now, and how many more networks the node could
    /// attach (addresses and file descriptors permitting).
    pub taps_idle: u64,
    pub taps_creatable: u64,
    /// Automatic host ports (`host_port_range`) left, per protocol.
    pub host_ports_free_tcp: u64,
    pub host_ports_free_udp: u64,
    pub host_ports_total: u64,
    /// Live SNAT flows: each holds a port of the SNAT range for its remote
    /// (`snat_port_range`, ports per remote address and port).
    pub snat_flows: u64,
    pub snat_ports_per_remote: u64,
    /// The flow table (`ct`) and host-flow table (`hflow`) fill.
    pub flows: u64,
    pub flows_capacity: u64,
    pub host_flows: u64,
    pub host_flows_capacity: u64,
    /// Addresses the resolver learned for sandboxes with domain rules, and
    /// what the per-sandbox caps allow in all.
    pub learned: u64,
    pub learned_capacity: u64,
    /// Bandwidth limits committed, bits/s, against the node's totals
    /// (`node_egress_rate`/`node_ingress_rate`; 0 = not set).
    pub egress_bps_committed: u64,
    pub egress_bps_total: u64,
    pub ingress_bps_committed: u64,
    pub ingress_bps_total: u64,
    pub labels: BTreeMap<String, String>,
}

impl Capacity {
    /// (key, value) of every number, in a stable order, for every edge.
    pub fn fields(&self) -> [(&'static str, u64); 21] {
        [
            ("networks", self.networks),
            ("addresses_free", self.addresses_free),
            ("addresses_total", self.addresses_total),
            ("taps_idle", self.taps_idle),
            ("taps_creatable", self.taps_creatable),
            ("host_ports_free_tcp", self.host_ports_free_tcp),
            ("host_ports_free_udp", self.host_ports_free_udp),
            ("host_ports_total", self.host_ports_total),
            ("snat_flows", self.snat_flows),
            ("snat_ports_per_remote", self.snat_ports_per_remote),
            ("flows", self.flows),
            ("flows_capacity", self.flows_capacity),
            ("host_flows", self.host_flows),
            ("host_flows_capacity", self.host_flows_capacity),
            ("learned", self.learned),
            ("learned_capacity", self.learned_capacity),
            ("egress_bps_committed", self.egress_bps_committed),
            ("egress_bps_total", self.egress_bps_total),
            ("ingress_bps_committed", self.ingress_bps_committed),
            ("ingress_bps_total", self.ingress_bps_total),
            ("labels", self.labels.len() as u64),
        ]
    }
}

impl Agent {
    /// The node's headroom now (see the module doc).
    pub fn capacity(&self) -> Capacity {
        let (free, total, ports_tcp, ports_udp, bw) = {
            let a = self.allocs();
            (
                a.ips.free(),
                a.ips.capacity(),
                a.ports.free(Protocol::Tcp),
                a.ports.free(Protocol::Udp),
                a.bw,
            )
        };
        let networks = self.active_networks();
        let idle = self.pool.idle() as u64;
        // Each network holds its TAP's fd, the pool its idle ones.
        let fds = super::health::nofile()
            .saturating_sub(self.tap_fds_needed(0) + super::health::FD_OVERHEAD)
            .saturating_sub(u64::from(networks) + idle);
        let (flows, host_flows) = self.datapath.flow_counts();
        let (lo, hi) = self.d.snat_ports;
        Capacity {
            networks: u64::from(networks),
            addresses_free: u64::from(free),
            addresses_total: u64::from(total),
            taps_idle: idle,
            taps_creatable: u64::from(free).min(fds + idle),
            host_ports_free_tcp: u64::from(ports_tcp),
            host_ports_free_udp: u64::from(ports_udp),
            host_ports_total: u64::from(self.d.port_high - self.d.port_low) + 1,
            snat_flows: self.datapath.snat_flows(),
            snat_ports_per_remote: u64::from(hi.saturating_sub(lo)) + 1,
            flows,
            flows_capacity: u64::from(FLOW_MAP_ENTRIES),
            host_flows,
            host_flows_capacity: u64::from(HOST_FLOW_ENTRIES),
            learned: super::egress::LEARNED_TRACKED.load(Ordering::Relaxed) as u64,
            learned_capacity: (super::egress::learned_cap(total) as u64)
                .saturating_mul(u64::from(total)),
            egress_bps_committed: bw.egress_bps,
            egress_bps_total: self.d.node_egress_bps,
            ingress_bps_committed: bw.ingress_bps,
            ingress_bps_total: self.d.node_ingress_bps,
            labels: self.cfg.labels.clone(),
        }
    }
}
