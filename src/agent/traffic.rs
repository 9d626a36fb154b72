//! Per-sandbox traffic: what a sandbox sent and received, from the
//! sandbox's point of view (`tx` = sent by the sandbox, `rx` = delivered
//! to it). Bytes and packets are the kernel's own counters of the
//! sandbox's TAP or veth host end (`IFLA_STATS64`, L2 frames without the
//! vnet header or FCS), read with one request per network or one dump for
//! all: the datapath pays nothing per packet for them. A network's device
//! is new (a TAP that carried a network is never pooled again, a veth is
//! made per attachment), so its counters start at zero at EnsureNetwork;
//! they live in the kernel with the device, so an agent restart (kill -9
//! included) keeps them.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};

use super::{Agent, AgentError, NetworkView, failed};
use crate::netlink::LinkCounters;

/// One network's traffic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Frames the sandbox sent into its device (also those the datapath
    /// then dropped: policy, spoofing).
    pub tx_bytes: u64,
    pub tx_packets: u64,
    /// Frames the sandbox sent that the kernel dropped at the device.
    pub tx_dropped: u64,
    /// Frames the kernel delivered to the sandbox's device.
    pub rx_bytes: u64,
    pub rx_packets: u64,
    /// Frames for the sandbox the kernel dropped at its device (its VMM
    /// did not read fast enough, or the device was down).
    pub rx_dropped: u64,
    /// Live flows (NAT'ed out, port-mapped in) as of the reaper's last
    /// pass (every 2 s).
    pub flows: u64,
}

impl Traffic {
    /// The device's counters turned around (the device receives what the
    /// sandbox sends).
    pub fn of_device(c: &LinkCounters, flows: u64) -> Self {
        Self {
            tx_bytes: c.rx_bytes,
            tx_packets: c.rx_packets,
            tx_dropped: c.rx_dropped,
            rx_bytes: c.tx_bytes,
            rx_packets: c.tx_packets,
            rx_dropped: c.tx_dropped,
            flows,
        }
    }

    /// (key, value) in a stable order, for every edge.
    pub fn fields(&self) -> [(&'static str, u64); 7] {
        [
            ("tx_bytes", self.tx_bytes),
            ("tx_packets", self.tx_packets),
            ("tx_dropped", self.tx_dropped),
            ("rx_bytes", self.rx_bytes),
            ("rx_packets", self.rx_packets),
            ("rx_dropped", self.rx_dropped),
            ("flows", self.flows),
        ]
    }
}

fn v4(ip: IpAddr) -> Option<Ipv4Addr> {
    match ip {
        IpAddr::V4(ip) => Some(ip),
        IpAddr::V6(_) => None,
    }
}

impl Agent {
    /// A network's traffic now (one netlink request). A veth gone with its
    /// container's namespace reads zero.
    pub async fn traffic(&self, view: &NetworkView) -> Result<Traffic, AgentError> {
        let flows = v4(view.record.sandbox_ip).map_or(0, |ip| self.datapath.live_flows(ip));
        if view.tap_ifindex == 0 {
            return Ok(Traffic {
                flows,
                ..Default::default()
            });
        }
        let link = self
            .nl
            .link_by_index(view.tap_ifindex)
            .await
            .map_err(|e| failed("reading the device's counters", &e))?;
        Ok(match link {
            Some(l) if l.name == view.record.tap_name => Traffic::of_device(&l.counters, flows),
            _ => Traffic {
                flows,
                ..Default::default()
            },
        })
    }

    /// Every network with its traffic: one link dump for all.
    pub async fn traffic_all(&self) -> Result<Vec<(NetworkView, Traffic)>, AgentError> {
        let links = self
            .nl
            .list_links()
            .await
            .map_err(|e| failed("dumping the devices' counters", &e))?;
        let by_index: HashMap<u32, (String, LinkCounters)> = links
            .into_iter()
            .map(|l| (l.index, (l.name, l.counters)))
            .collect();
        Ok(self
            .list()
            .into_iter()
            .map(|v| {
                let flows = v4(v.record.sandbox_ip).map_or(0, |ip| self.datapath.live_flows(ip));
                let t = match by_index.get(&v.tap_ifindex) {
                    Some((name, c)) if v.tap_ifindex != 0 && *name == v.record.tap_name => {
                        Traffic::of_device(c, flows)
                    }
                    _ => Traffic {
                        flows,
                        ..Default::default()
                    },
                };
                (v, t)
            })
            .collect())
    }
}
