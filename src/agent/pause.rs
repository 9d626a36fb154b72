//! Paused sandboxes: the datapath drops packets for a network made or
//! converged with `paused` and reports the first one of each pause in a
//! ring buffer (ebpf `paused_drop`); this reader turns each report into a
//! `TrafficWhilePaused` event for the edges (a D-Bus signal, a varlink
//! `WatchNetworks` event), so an orchestrator can resume the VM.
//!
//! The ring is pinned: reports made while the agent is down are read by
//! the next start, and the kernel's consumer position means none is read
//! twice. A report is published only if its network is still paused on
//! the device it came from (a resume racing the report wins).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tracing::{debug, info};

use super::Agent;
use super::events::{Change, PausedTraffic};
use crate::datapath::WakeRing;
use crate::datapath::maps::{DP_WAKE_HOST, DP_WAKE_PORTMAP, DpWake};

impl Agent {
    /// Reads the datapath's reports for as long as the agent lives.
    pub(super) fn spawn_wake_reader(self: &Arc<Self>) {
        let Some(ring) = self.datapath.wake_ring() else {
            return;
        };
        let weak = Arc::downgrade(self);
        super::ring::follow(ring, "paused traffic", move |ring: &mut WakeRing| {
            let wakes = ring.drain();
            let Some(agent) = weak.upgrade() else {
                return false;
            };
            for (w, remote6) in wakes {
                agent.note_wake(w, remote6);
            }
            true
        });
    }

    /// One report: published if its network is (still) paused on that
    /// device and generation's address.
    fn note_wake(&self, w: DpWake, remote6: Option<std::net::Ipv6Addr>) {
        let ip = std::net::Ipv4Addr::from(w.sandbox_ip.to_ne_bytes());
        let found = self
            .views
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .find(|v| v.record.sandbox_ip == std::net::IpAddr::V4(ip) && v.tap_ifindex == w.ifindex)
            .map(|v| (v.record.sandbox_id.clone(), v.record.paused));
        let Some((sandbox_id, true)) = found else {
            debug!(sandbox_ip = %ip, ifindex = w.ifindex, "traffic report for a network no longer paused");
            return;
        };
        let traffic = PausedTraffic {
            protocol: match i32::from(w.proto) {
                libc::IPPROTO_TCP => "tcp",
                libc::IPPROTO_UDP => "udp",
                _ => "icmp",
            },
            port: u16::from_be(w.port),
            remote_ip: match remote6 {
                Some(a) => std::net::IpAddr::V6(a),
                None => std::net::IpAddr::V4(std::net::Ipv4Addr::from(w.remote_ip.to_ne_bytes())),
            },
            remote_port: u16::from_be(w.remote_port),
            via: match w.kind {
                DP_WAKE_PORTMAP => "port_mapping",
                DP_WAKE_HOST => "host",
                _ => "reply",
            },
        };
        info!(
            sandbox_id,
            protocol = traffic.protocol,
            port = traffic.port,
            remote = %traffic.remote_ip,
            remote_port = traffic.remote_port,
            via = traffic.via,
            "traffic for a paused sandbox"
        );
        crate::metrics::PAUSED_TRAFFIC_EVENTS.fetch_add(1, Ordering::Relaxed);
        self.events.publish(Change::TrafficWhilePaused {
            sandbox_id,
            traffic,
        });
    }
}
