//! The flow log's agent side (docs/flows.md): the datapath's events (a
//! flow's first packet, a refusal) and the reaper's flow ends become
//! records with the sandbox's id, wall-clock time and the DNS name that
//! taught the address, published to the hub (`crate::flows`), which keeps,
//! streams and journals them. Every second: the ends, the datapath's lost
//! events per sandbox, the journal's "suppressed" summaries.
//!
//! The ring is pinned: events made while the agent is down are read by the
//! next start (a restart loses none but those the ring could not hold).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::Agent;
use crate::datapath::maps::{
    DP_CT_PORTMAP, DP_FD_EGRESS, DP_FD_INGRESS, DP_FE_END, DP_FE_REFUSED, DP_FE_START, DpFlowEvent,
};
use crate::datapath::{FlowEnd, FlowRing, HostFlow};
use crate::flows::{Direction, Endpoint, FlowEvent, FlowRecord, Reason, Totals};

/// A flow's end as recorded once: the sandbox, protocol, guest port, the
/// remote and its port, and the flow's start (monotonic ns).
pub(super) type EndKey = (Ipv4Addr, u8, u16, IpAddr, u16, u64);

/// Ends remembered for that (then forgotten all at once: a flow whose two
/// ends straddle the moment is recorded twice).
const ENDS_SEEN_MAX: usize = 65_536;

/// How often the ends, the lost counts and the journal's summaries are
/// taken.
const TICK: Duration = Duration::from_secs(1);

/// Monotonic ns (the datapath's clock) to wall-clock ns, as of one read
/// of both clocks.
#[derive(Clone, Copy)]
struct Clock {
    mono: u64,
    wall: u64,
}

impl Clock {
    fn now() -> Clock {
        Clock {
            mono: crate::datapath::ebpf::monotonic_ns(),
            wall: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0),
        }
    }

    fn wall_of(self, mono: u64) -> u64 {
        self.wall.saturating_sub(self.mono.saturating_sub(mono))
    }
}

fn protocol(family: u8, proto: u8) -> String {
    match i32::from(proto) {
        libc::IPPROTO_TCP => "tcp".into(),
        libc::IPPROTO_UDP => "udp".into(),
        libc::IPPROTO_ICMP => "icmp".into(),
        libc::IPPROTO_ICMPV6 if family == 6 => "icmpv6".into(),
        _ => proto.to_string(),
    }
}

fn addr(family: u8, b: &[u8; 16]) -> IpAddr {
    if family == 6 {
        IpAddr::V6(Ipv6Addr::from(*b))
    } else {
        IpAddr::V4(Ipv4Addr::new(b[0], b[1], b[2], b[3]))
    }
}

fn reason(r: u8) -> Reason {
    match r {
        2 => Reason::Unlearned,
        3 => Reason::NodeAddress,
        4 => Reason::Spoofed,
        5 => Reason::Paused,
        6 => Reason::StaleTcp,
        7 => Reason::NoPort,
        8 => Reason::NoRoute,
        9 => Reason::Unsupported,
        10 => Reason::Malformed,
        _ => Reason::Policy,
    }
}

/// The guest's fixed IPv6 address (fd63:7562:6500::6).
const GUEST6: Ipv6Addr = Ipv6Addr::new(0xfd63, 0x7562, 0x6500, 0, 0, 0, 0, 6);

/// The gateway's IPv6 address on the guests' link (fd63:7562:6500::5).
const GATEWAY6: Ipv6Addr = Ipv6Addr::new(0xfd63, 0x7562, 0x6500, 0, 0, 0, 0, 5);

/// The guest's SLAAC address: the guests' prefix with the modified EUI-64
/// of its MAC.
fn slaac(mac: [u8; 6]) -> Ipv6Addr {
    let mut a = [0u8; 16];
    a[..6].copy_from_slice(&[0xfd, 0x63, 0x75, 0x62, 0x65, 0x00]);
    a[8..11].copy_from_slice(&[mac[0] ^ 0x02, mac[1], mac[2]]);
    a[11..13].copy_from_slice(&[0xff, 0xfe]);
    a[13..].copy_from_slice(&mac[3..]);
    Ipv6Addr::from(a)
}

impl Agent {
    /// Reads the flow events and runs the flow log's ticks for as long as
    /// the agent lives.
    pub(super) fn spawn_flow_log(self: &Arc<Self>) {
        let events = self.cfg.flow_events;
        if let Some(ring) = self.datapath.flow_ring().filter(|_| events) {
            let weak = Arc::downgrade(self);
            let mut batch = Vec::new();
            super::ring::follow(ring, "flow events", move |ring: &mut FlowRing| {
                ring.drain(&mut batch);
                let Some(agent) = weak.upgrade() else {
                    return false;
                };
                let clock = Clock::now();
                for e in batch.drain(..) {
                    if let Some(rec) = agent.flow_record(&e, clock) {
                        agent.flows.publish(rec);
                    }
                }
                true
            });
        }
        // Per device: the lost count already reported, learned now, at
        // start, before any new traffic: what an earlier run lost, it
        // reported.
        let mut lost_seen: HashMap<u32, u64> = self
            .datapath
            .flow_event_counts()
            .into_iter()
            .map(|(i, _, l)| (i, l))
            .collect();
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(TICK).await;
                let Some(agent) = weak.upgrade() else { return };
                let dp = agent.datapath.clone();
                let (ends, hosts, counts) = tokio::task::spawn_blocking(move || {
                    (
                        dp.take_flow_ends(),
                        dp.take_host_flows(),
                        dp.flow_event_counts(),
                    )
                })
                .await
                .unwrap_or_default();
                // flow_events off: the reaper's are dropped too.
                if events {
                    agent.publish_ends(ends);
                    agent.publish_host_flows(hosts);
                }
                agent.note_flow_losses(&counts, &mut lost_seen);
                agent.flows.tick();
            }
        });
    }

    /// The sandbox id of a device, if a live network has it.
    fn id_of_device(&self, ifindex: u32) -> Option<String> {
        self.by_ifindex
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&ifindex)
            .cloned()
    }

    /// Whether the end `key` is new (and notes it).
    fn first_end(&self, key: EndKey) -> bool {
        let mut seen = self
            .flow_ends_seen
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if seen.len() >= ENDS_SEEN_MAX {
            seen.clear();
        }
        seen.insert(key)
    }

    /// A datapath event as a record (None: its device is no live
    /// network's, or an end already recorded).
    fn flow_record(&self, e: &DpFlowEvent, clock: Clock) -> Option<FlowRecord> {
        let sandbox_id = self.id_of_device(e.ifindex)?;
        let family = if e.family == 6 { 6 } else { 4 };
        let guest = Endpoint {
            ip: addr(family, &e.guest_ip),
            port: u16::from_be(e.guest_port),
        };
        let remote = Endpoint {
            ip: addr(family, &e.remote_ip),
            port: u16::from_be(e.remote_port),
        };
        let node = (e.node_ip != [0; 16]).then(|| Endpoint {
            ip: addr(family, &e.node_ip),
            port: u16::from_be(e.node_port),
        });
        let src = Ipv4Addr::from(e.sandbox_ip.to_ne_bytes());
        let end = (e.kind == DP_FE_END).then(|| Totals {
            bytes_out: e.bytes_out,
            packets_out: u64::from(e.pkts_out),
            bytes_in: e.bytes_in,
            packets_in: u64::from(e.pkts_in),
            duration_ms: e.ts_ns.saturating_sub(e.start_ns) / 1_000_000,
        });
        if end.is_some()
            && !self.first_end((src, e.proto, guest.port, remote.ip, remote.port, e.start_ns))
        {
            return None;
        }
        let refused = (e.kind == DP_FE_REFUSED).then(|| {
            let r = reason(e.reason);
            if r == Reason::Policy
                && e.dir == DP_FD_EGRESS
                && self.egress.refused_unlearned(src, remote.ip, &self.d.pool)
            {
                Reason::Unlearned
            } else {
                r
            }
        });
        let direction = match e.dir {
            DP_FD_EGRESS => Direction::Egress,
            DP_FD_INGRESS => Direction::Ingress,
            _ => Direction::Host,
        };
        let dns_name = (direction == Direction::Egress)
            .then(|| self.egress.learned_name(src, remote.ip))
            .flatten();
        Some(FlowRecord {
            time_unix_ns: clock.wall_of(e.ts_ns),
            sandbox_id,
            event: match e.kind {
                DP_FE_START => FlowEvent::Start,
                DP_FE_END => FlowEvent::End,
                _ => FlowEvent::Refused,
            },
            family,
            protocol: protocol(family, e.proto),
            direction,
            guest,
            remote,
            node,
            refused,
            dns_name,
            end,
        })
    }

    /// The reaper's flow ends as records: a released sandbox's flows have
    /// no live network to name them by, and are left out.
    fn publish_ends(&self, ends: Vec<FlowEnd>) {
        if ends.is_empty() {
            return;
        }
        let clock = Clock::now();
        let by_ip = self.ids_by_ip();
        let uplink4 = match &self.uplink {
            super::Uplink::Found { addr, .. } => *addr,
            super::Uplink::Missing(_) => None,
        };
        let uplink6 = *self.uplink6.read().unwrap_or_else(|p| p.into_inner());
        for end in ends {
            let Some(sandbox_id) = by_ip.get(&end.id.sandbox_ip) else {
                continue;
            };
            let key = (
                end.id.sandbox_ip,
                end.id.proto,
                end.id.guest_port,
                end.id.remote,
                end.id.remote_port,
                end.start_ns,
            );
            if !self.first_end(key) {
                continue;
            }
            let family = if end.id.remote.is_ipv6() { 6 } else { 4 };
            let guest_ip = if family == 6 {
                IpAddr::V6(if end.guest_fixed6 {
                    GUEST6
                } else {
                    slaac(self.d.guest_mac)
                })
            } else {
                IpAddr::V4(self.d.guest_ip)
            };
            let node_ip: Option<IpAddr> = if family == 6 {
                uplink6.map(IpAddr::V6)
            } else {
                uplink4.map(IpAddr::V4)
            };
            let ingress = end.kind == DP_CT_PORTMAP;
            let rec = FlowRecord {
                time_unix_ns: clock.wall_of(end.last_ns),
                sandbox_id: sandbox_id.clone(),
                event: FlowEvent::End,
                family,
                protocol: protocol(family, end.id.proto),
                direction: if ingress {
                    Direction::Ingress
                } else {
                    Direction::Egress
                },
                guest: Endpoint {
                    ip: guest_ip,
                    port: end.id.guest_port,
                },
                remote: Endpoint {
                    ip: end.id.remote,
                    port: end.id.remote_port,
                },
                node: node_ip.map(|ip| Endpoint {
                    ip,
                    port: end.node_port,
                }),
                refused: None,
                dns_name: if ingress {
                    None
                } else {
                    self.egress.learned_name(end.id.sandbox_ip, end.id.remote)
                },
                end: Some(Totals {
                    bytes_out: end.bytes_out,
                    packets_out: end.pkts_out,
                    bytes_in: end.bytes_in,
                    packets_in: end.pkts_in,
                    duration_ms: end.last_ns.saturating_sub(end.start_ns) / 1_000_000,
                }),
            };
            self.flows.publish(rec);
        }
    }

    /// The reaper's host <-> sandbox flows as records (no totals: the
    /// datapath does not count a host flow's packets).
    fn publish_host_flows(&self, flows: Vec<HostFlow>) {
        if flows.is_empty() {
            return;
        }
        let clock = Clock::now();
        let by_ip = self.ids_by_ip();
        for f in flows {
            let Some(sandbox_id) = by_ip.get(&f.sandbox_ip) else {
                continue;
            };
            let (guest, gateway, node) = if f.ipv6 {
                (
                    IpAddr::V6(GUEST6),
                    IpAddr::V6(GATEWAY6),
                    IpAddr::V6(self.d.pool6_addr(f.node)),
                )
            } else {
                (
                    IpAddr::V4(self.d.guest_ip),
                    IpAddr::V4(self.d.guest_gateway),
                    IpAddr::V4(f.node),
                )
            };
            let family = if f.ipv6 { 6 } else { 4 };
            self.flows.publish(FlowRecord {
                time_unix_ns: clock.wall_of(f.seen_ns),
                sandbox_id: sandbox_id.clone(),
                event: if f.start {
                    FlowEvent::Start
                } else {
                    FlowEvent::End
                },
                family,
                protocol: protocol(family, f.proto),
                direction: Direction::Host,
                guest: Endpoint {
                    ip: guest,
                    port: f.guest_port,
                },
                remote: Endpoint {
                    ip: gateway,
                    port: f.gw_port,
                },
                node: Some(Endpoint {
                    ip: node,
                    port: f.node_port,
                }),
                refused: None,
                dns_name: None,
                end: None,
            });
        }
    }

    /// Every live network's sandbox id by its address.
    fn ids_by_ip(&self) -> HashMap<Ipv4Addr, String> {
        self.views
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter_map(|v| match v.record.sandbox_ip {
                IpAddr::V4(ip) => Some((ip, v.record.sandbox_id.clone())),
                IpAddr::V6(_) => None,
            })
            .collect()
    }

    /// Events the datapath lost per sandbox since the last tick, told to
    /// the hub (counted, and its watchers told).
    fn note_flow_losses(&self, counts: &[(u32, u64, u64)], seen: &mut HashMap<u32, u64>) {
        let mut live = HashMap::with_capacity(counts.len());
        for &(ifindex, _sent, lost) in counts {
            let before = seen.get(&ifindex).copied();
            live.insert(ifindex, lost);
            // A device first seen: its losses so far (a start reads what
            // the ring's sandbox lost while the agent was down).
            let new = lost.saturating_sub(before.unwrap_or(0));
            if new > 0
                && let Some(id) = self.id_of_device(ifindex)
            {
                self.flows.note_lost(&id, new);
            }
        }
        *seen = live;
    }
}
