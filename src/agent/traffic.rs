//! Per-sandbox traffic: what a sandbox sent and received, from the
//! sandbox's point of view (`tx` = sent by the sandbox, `rx` = delivered
//! to it). Bytes and packets are the kernel's own counters of the
//! sandbox's TAP or veth host end (`IFLA_STATS64`, L2 frames without the
//! vnet header or FCS), read with one request per network or one dump for
//! all: the datapath pays nothing per packet for them. Their IPv6 part is
//! the datapath's own count (`sb_traffic6`, per CPU, paid by IPv6 frames
//! only). A network's device
//! is new (a TAP that carried a network is never pooled again, a veth is
//! made per attachment), so its counters start at zero at EnsureNetwork;
//! they live in the kernel with the device, so an agent restart (kill -9
//! included) keeps them.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use super::{Agent, AgentError, NetworkView, failed};
use crate::datapath::maps::{
    RATE_COUNTER_NAMES, SB_COUNTER_NAMES, SB_COUNTER_NAMES_IPV6, TRAFFIC6_NAMES,
};
use crate::metrics::{Family, Kind, Sample, Val};
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
    /// The datapath's own counters for this sandbox: drops by reason and
    /// flows opened by kind, indexed like [`SB_COUNTER_NAMES`].
    pub datapath: [u64; SB_COUNTER_NAMES.len()],
    /// The IPv6 part of each, indexed like [`SB_COUNTER_NAMES_IPV6`].
    pub datapath6: [u64; SB_COUNTER_NAMES.len()],
    /// The IPv6 part of the device's counters, counted by the datapath
    /// (indexed like [`TRAFFIC6_NAMES`]): the frames the sandbox sent and
    /// was sent over IPv6 (the rest of `tx_*`/`rx_*` is IPv4 and ARP).
    pub traffic6: [u64; TRAFFIC6_NAMES.len()],
    /// Its bandwidth limits at work (paced, dropped beyond the horizon),
    /// indexed like [`RATE_COUNTER_NAMES`].
    pub throttled: [u64; RATE_COUNTER_NAMES.len()],
    /// Queries the resolver refused for the sandbox's domain rules (since
    /// this agent started: kept in memory, not across restarts).
    pub dns_refused: u64,
    /// Requests through its egress rules sent on, and refused (403, 421,
    /// 502, ...), since this agent started.
    pub egress_requests: u64,
    pub egress_refused: u64,
}

/// What the agent itself counted for a sandbox (not the device nor the
/// datapath): in memory, since this agent started.
#[derive(Debug, Clone, Copy, Default)]
pub struct AgentCounts {
    pub dns_refused: u64,
    pub egress_requests: u64,
    pub egress_refused: u64,
}

impl Traffic {
    fn with(self, c: AgentCounts) -> Self {
        Traffic {
            dns_refused: c.dns_refused,
            egress_requests: c.egress_requests,
            egress_refused: c.egress_refused,
            ..self
        }
    }
}

impl Traffic {
    /// The device's counters turned around (the device receives what the
    /// sandbox sends).
    pub fn of_device(c: &LinkCounters, flows: u64, datapath: Option<&[u64]>) -> Self {
        Self {
            tx_bytes: c.rx_bytes,
            tx_packets: c.rx_packets,
            tx_dropped: c.rx_dropped,
            rx_bytes: c.tx_bytes,
            rx_packets: c.tx_packets,
            rx_dropped: c.tx_dropped,
            flows,
            datapath: dp_array(datapath.unwrap_or_default()),
            datapath6: dp_array(
                datapath
                    .and_then(|d| d.get(SB_COUNTER_NAMES.len()..))
                    .unwrap_or_default(),
            ),
            traffic6: dp_array(
                datapath
                    .and_then(|d| d.get(2 * SB_COUNTER_NAMES.len()..))
                    .unwrap_or_default(),
            ),
            throttled: dp_array(
                datapath
                    .and_then(|d| d.get(2 * SB_COUNTER_NAMES.len() + TRAFFIC6_NAMES.len()..))
                    .unwrap_or_default(),
            ),
            dns_refused: 0,
            egress_requests: 0,
            egress_refused: 0,
        }
    }

    /// (key, value) in a stable order, for every edge.
    pub fn fields(&self) -> Vec<(&'static str, u64)> {
        let mut f = vec![
            ("tx_bytes", self.tx_bytes),
            ("tx_packets", self.tx_packets),
            ("tx_dropped", self.tx_dropped),
            ("rx_bytes", self.rx_bytes),
            ("rx_packets", self.rx_packets),
            ("rx_dropped", self.rx_dropped),
            ("flows", self.flows),
        ];
        f.extend(SB_COUNTER_NAMES.iter().copied().zip(self.datapath));
        f.extend(SB_COUNTER_NAMES_IPV6.iter().copied().zip(self.datapath6));
        f.extend(TRAFFIC6_NAMES.iter().copied().zip(self.traffic6));
        f.extend(RATE_COUNTER_NAMES.iter().copied().zip(self.throttled));
        f.push(("dns_refused", self.dns_refused));
        f.push(("egress_requests", self.egress_requests));
        f.push(("egress_refused", self.egress_refused));
        f
    }

    /// The datapath's drops for this sandbox by reason (`spoofed`, ...),
    /// both families.
    pub fn drops(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        by_prefix(&self.datapath, "drop_")
    }

    /// Flows the datapath opened for this sandbox by kind (`snat`, ...),
    /// both families.
    pub fn new_flows(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        by_prefix(&self.datapath, "new_flows_")
    }

    /// The IPv6 part of [`Self::drops`] (same reasons).
    pub fn drops6(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        by_prefix(&self.datapath6, "drop_")
    }

    /// The IPv6 part of [`Self::new_flows`] (same kinds).
    pub fn new_flows6(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        by_prefix(&self.datapath6, "new_flows_")
    }
}

/// (the part after `prefix`, value) of the counters `c` (indexed like
/// [`SB_COUNTER_NAMES`]) whose name starts with `prefix`.
fn by_prefix<'a>(
    c: &'a [u64; SB_COUNTER_NAMES.len()],
    prefix: &'static str,
) -> impl Iterator<Item = (&'static str, u64)> + 'a {
    SB_COUNTER_NAMES
        .iter()
        .zip(c)
        .filter_map(move |(n, v)| n.strip_prefix(prefix).map(|r| (r, *v)))
}

fn dp_array<const N: usize>(v: &[u64]) -> [u64; N] {
    let mut a = [0; N];
    for (slot, n) in a.iter_mut().zip(v) {
        *slot = *n;
    }
    a
}

/// A network's traffic now: its device's counters (one netlink request,
/// sent by the calling thread) and the datapath's. A device that is gone
/// or no longer the network's reads zero. Blocking.
pub(super) fn read(
    nl: &crate::netlink::Netlink,
    dp: &dyn crate::datapath::Datapath,
    rec: &super::spec::NetworkRecord,
    ifindex: u32,
    counts: AgentCounts,
) -> Result<Traffic, AgentError> {
    let flows = v4(rec.sandbox_ip).map_or(0, |ip| dp.live_flows(ip));
    let none = Traffic {
        flows,
        ..Default::default()
    };
    if ifindex == 0 {
        return Ok(none.with(counts));
    }
    let link = nl
        .link_by_index_now(ifindex)
        .map_err(|e| super::failed("reading the device's counters", &e))?;
    let counters = dp.sandbox_counters(ifindex);
    Ok(match link {
        Some(l) if l.name == rec.tap_name => {
            Traffic::of_device(&l.counters, flows, counters.as_deref()).with(counts)
        }
        _ => none.with(counts),
    })
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
        let (nl, dp, rec, ifindex) = (
            self.nl.clone(),
            self.datapath.clone(),
            view.record.clone(),
            view.tap_ifindex,
        );
        let counts = self.egress.counts(rec.sandbox_ip);
        super::off_worker(move || read(&nl, &*dp, &rec, ifindex, counts)).await
    }

    /// Every network (its sandbox id) with its traffic: one
    /// `RTM_GETSTATS` dump and one batched `sb_stats` dump for all.
    pub async fn traffic_all(&self) -> Result<Vec<(Arc<str>, Traffic)>, AgentError> {
        let counters = tokio::task::spawn_blocking(crate::netlink::link_counters_dump)
            .await
            .map_err(|e| AgentError::Failed(format!("dumping the devices' counters: {e}")))?
            .map_err(|e| failed("dumping the devices' counters", &e))?;
        let dp = self.datapath.all_sandbox_counters();
        let views = self.views.read().unwrap_or_else(|p| p.into_inner());
        Ok(views
            .values()
            .map(|v| {
                let flows = v4(v.record.sandbox_ip).map_or(0, |ip| self.datapath.live_flows(ip));
                let counts = self.egress.counts(v.record.sandbox_ip);
                let t = match counters.get(&v.tap_ifindex) {
                    // An ifindex names one device for life (the kernel
                    // does not reuse them soon): no name check needed.
                    Some(c) if v.tap_ifindex != 0 => {
                        Traffic::of_device(c, flows, dp.get(&v.tap_ifindex).map(|a| &a[..]))
                    }
                    _ => Traffic {
                        flows,
                        ..Default::default()
                    },
                };
                let t = t.with(counts);
                (Arc::from(v.record.sandbox_id.as_str()), t)
            })
            .collect())
    }
}

/// Which counters of a [`Traffic`] a per-sandbox family shows, by
/// direction (`None`: no direction field), appended to a scratch list
/// (no allocation per sandbox).
type Pick = dyn Fn(&Traffic, &mut Vec<(Option<&'static str>, u64)>) + Sync;

/// A per-sandbox family being filled: its label's key (`direction`,
/// `reason`, `kind`), whether it keeps only values above 0, and what it
/// shows of a [`Traffic`].
struct PerSandbox {
    field: &'static str,
    family: Family,
    sparse: bool,
    pick: &'static Pick,
}

impl Agent {
    /// Every metric family (see docs/observability.md): per sandbox from
    /// one link dump, node-wide from the agent's own state; Health's
    /// verdict as `healthy` (its kernel part is cached, see health.rs).
    pub async fn metrics(&self) -> Result<Vec<Family>, AgentError> {
        let all = self.traffic_all().await?;
        // Per sandbox; `sparse` families (drops, new flows by kind) carry
        // only the values that are not 0: most sandboxes drop nothing, and
        // a scrape at 10,000 sandboxes stays ~60,000 lines. Every family
        // is filled in one pass over the sandboxes (not one pass each).
        let per_by = |field: &'static str,
                      name: &'static str,
                      kind: Kind,
                      unit: Option<&'static str>,
                      help: &'static str,
                      sparse: bool,
                      pick: &'static Pick| PerSandbox {
            field,
            family: Family {
                name,
                kind,
                help,
                unit,
                samples: Vec::with_capacity(if sparse { 16 } else { all.len() * 2 }),
            },
            sparse,
            pick,
        };
        let per = |name, kind, unit, help, sparse, pick: &'static Pick| {
            per_by("direction", name, kind, unit, help, sparse, pick)
        };
        let mut per_sandbox = [
            per(
                "sandbox_bytes",
                Kind::Counter,
                Some("bytes"),
                "Bytes of the L2 frames a sandbox sent (direction=tx) and was delivered (rx), as its TAP or veth counts them",
                false,
                &|t, o| o.extend([(Some("tx"), t.tx_bytes), (Some("rx"), t.rx_bytes)]),
            ),
            per(
                "sandbox_packets",
                Kind::Counter,
                None,
                "Frames a sandbox sent (direction=tx) and was delivered (rx)",
                false,
                &|t, o| o.extend([(Some("tx"), t.tx_packets), (Some("rx"), t.rx_packets)]),
            ),
            per(
                "sandbox_ipv6_bytes",
                Kind::Counter,
                Some("bytes"),
                "The IPv6 part of sandbox_bytes, counted by the datapath (tx: frames the sandbox sent, dropped ones included; rx: frames it was sent); only values above 0",
                true,
                &|t, o| o.extend([(Some("tx"), t.traffic6[0]), (Some("rx"), t.traffic6[2])]),
            ),
            per(
                "sandbox_ipv6_packets",
                Kind::Counter,
                None,
                "The IPv6 part of sandbox_packets; only values above 0",
                true,
                &|t, o| o.extend([(Some("tx"), t.traffic6[1]), (Some("rx"), t.traffic6[3])]),
            ),
            per(
                "sandbox_device_drops",
                Kind::Counter,
                None,
                "Frames the kernel dropped at a sandbox's device: sent by it (tx) or meant for it (rx, its VMM did not read); only values above 0",
                true,
                &|t, o| o.extend([(Some("tx"), t.tx_dropped), (Some("rx"), t.rx_dropped)]),
            ),
            per(
                "sandbox_flows",
                Kind::Gauge,
                None,
                "Live flows of a sandbox (NAT'ed out, port-mapped in), counted every 2 s",
                false,
                &|t, o| o.extend([(None, t.flows)]),
            ),
            per_by(
                "reason",
                "sandbox_drops",
                Kind::Counter,
                None,
                "Packets of a sandbox the datapath dropped, by reason (spoofed, policy, malformed, no_route, no_port, unsupported); only values above 0",
                true,
                &|t, o| o.extend(t.drops().map(|(r, n)| (Some(r), n))),
            ),
            per_by(
                "reason",
                "sandbox_ipv6_drops",
                Kind::Counter,
                None,
                "The IPv6 part of sandbox_drops, by the same reasons; only values above 0",
                true,
                &|t, o| o.extend(t.drops6().map(|(r, n)| (Some(r), n))),
            ),
            per(
                "sandbox_dns_refused",
                Kind::Counter,
                None,
                "DNS queries of a sandbox the agent's resolver refused for its domain rules (since the agent started); only values above 0",
                true,
                &|t, o| o.extend([(None, t.dns_refused)]),
            ),
            per_by(
                "verdict",
                "sandbox_egress_requests",
                Kind::Counter,
                None,
                "Requests of a sandbox through its egress rules, by verdict (forwarded: sent on with the rule's headers; refused: 403, 421, 502); only values above 0",
                true,
                &|t, o| {
                    o.extend([
                        (Some("forwarded"), t.egress_requests),
                        (Some("refused"), t.egress_refused),
                    ])
                },
            ),
            per_by(
                "kind",
                "sandbox_new_flows",
                Kind::Counter,
                None,
                "Flows the datapath opened for a sandbox, by kind (snat: to the world, portmap: from the world, host); only values above 0",
                true,
                &|t, o| o.extend(t.new_flows().map(|(k, n)| (Some(k), n))),
            ),
            per_by(
                "kind",
                "sandbox_ipv6_new_flows",
                Kind::Counter,
                None,
                "The IPv6 part of sandbox_new_flows, by the same kinds; only values above 0",
                true,
                &|t, o| o.extend(t.new_flows6().map(|(k, n)| (Some(k), n))),
            ),
            per(
                "sandbox_shaped_packets",
                Kind::Counter,
                None,
                "Packets on the wire of a sandbox that went through its bandwidth limit's shaper, by direction (egress: to the world, ingress: from it): segments, a GSO packet counts per segment (sandbox_packets counts it once); only values above 0",
                true,
                &|t, o| {
                    o.extend([
                        (Some("egress"), t.throttled[0]),
                        (Some("ingress"), t.throttled[4]),
                    ])
                },
            ),
            per(
                "sandbox_shaped_bytes",
                Kind::Counter,
                Some("bytes"),
                "Bytes of those packets; only values above 0",
                true,
                &|t, o| {
                    o.extend([
                        (Some("egress"), t.throttled[1]),
                        (Some("ingress"), t.throttled[5]),
                    ])
                },
            ),
            per(
                "sandbox_shaper_delays",
                Kind::Counter,
                None,
                "Times a sandbox's shaper held its traffic back for the limit (HTB overlimits), by direction; only values above 0",
                true,
                &|t, o| {
                    o.extend([
                        (Some("egress"), t.throttled[2]),
                        (Some("ingress"), t.throttled[6]),
                    ])
                },
            ),
            per(
                "sandbox_rate_drops",
                Kind::Counter,
                None,
                "Packets of a sandbox its shaper dropped (its queue full), by direction; only values above 0",
                true,
                &|t, o| {
                    o.extend([
                        (Some("egress"), t.throttled[3]),
                        (Some("ingress"), t.throttled[7]),
                    ])
                },
            ),
        ];
        let mut picked = Vec::with_capacity(8);
        for (id, t) in &all {
            for p in &mut per_sandbox {
                picked.clear();
                (p.pick)(t, &mut picked);
                for &(which, n) in &picked {
                    if p.sparse && n == 0 {
                        continue;
                    }
                    p.family.samples.push(Sample {
                        object: Some(id.clone()),
                        field: which.map(|d| (p.field, d)),
                        value: Val::U(n),
                    });
                }
            }
        }
        let mut f: Vec<Family> = per_sandbox.into_iter().map(|p| p.family).collect();
        let gauge = |name, help, n: u64| Family {
            name,
            kind: Kind::Gauge,
            help,
            unit: None,
            samples: vec![Sample::node(Val::U(n))],
        };
        let (healthy, _) = self.health().await;
        let (flows, host_flows) = self.datapath.flow_counts();
        f.push(gauge("networks", "Sandbox networks", all.len() as u64));
        let (clones, paused) = self
            .views
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .fold((0u64, 0u64), |(c, p), v| {
                (
                    c + u64::from(v.record.cloned_from.is_some()),
                    p + u64::from(v.record.paused),
                )
            });
        f.push(gauge(
            "cloned_networks",
            "Sandbox networks made as clones of another (clone_of)",
            clones,
        ));
        f.push(Family {
            kind: Kind::Counter,
            ..gauge(
                "clones_restored",
                "Clones' networks opened by their first VMM (OpenTap: a snapshot restored onto them) since the agent started",
                crate::metrics::CLONES_RESTORED.load(std::sync::atomic::Ordering::Relaxed),
            )
        });
        f.push(gauge(
            "paused_networks",
            "Sandbox networks paused (EnsureNetwork paused)",
            paused,
        ));
        f.push(Family {
            kind: Kind::Counter,
            ..gauge(
                "traffic_while_paused",
                "TrafficWhilePaused events (the first packet for a paused sandbox, one per pause) since the agent started",
                crate::metrics::PAUSED_TRAFFIC_EVENTS.load(std::sync::atomic::Ordering::Relaxed),
            )
        });
        f.push(Family {
            kind: Kind::Counter,
            ..gauge(
                "networks_cloned",
                "Networks made with clone_of since the agent started",
                crate::metrics::NETWORKS_CLONED.load(std::sync::atomic::Ordering::Relaxed),
            )
        });
        f.push(Family {
            kind: Kind::Counter,
            ..gauge(
                "cni_networks_released_netns_gone",
                "CNI networks released by the agent because their container's network namespace was gone and no DEL came, since the agent started",
                crate::metrics::NETNS_GONE_RELEASED.load(std::sync::atomic::Ordering::Relaxed),
            )
        });
        f.push(gauge(
            "idle_taps",
            "Idle TAPs in the warm pool",
            u64::from(self.idle_taps()),
        ));
        f.push(gauge(
            "free_addresses",
            "Free addresses in the sandbox pool",
            u64::from(self.free_addresses()),
        ));
        f.push(gauge(
            "healthy",
            "1 when every Health check passes",
            u64::from(healthy),
        ));
        let table = |n: u64, which: &'static str| Sample {
            object: None,
            field: Some(("table", which)),
            value: Val::U(n),
        };
        f.push(Family {
            name: "flow_table_entries",
            kind: Kind::Gauge,
            help: "Entries of the datapath's flow tables (sandbox flows, host flows)",
            unit: None,
            samples: vec![table(flows, "sandbox"), table(host_flows, "host")],
        });
        f.push(Family {
            name: "flow_table_capacity",
            kind: Kind::Gauge,
            help: "Capacity of the datapath's flow tables (LRU: full tables evict live flows)",
            unit: None,
            samples: vec![
                table(crate::datapath::maps::FLOW_MAP_ENTRIES.into(), "sandbox"),
                table(crate::datapath::maps::HOST_FLOW_ENTRIES.into(), "host"),
            ],
        });
        f.push(Family {
            name: "datapath_events",
            kind: Kind::Counter,
            help: "Packets the datapath handled, by event: forwarded kinds (snat, portmap, ...) and drops (spoof_drop, policy_drop, no_port, no_route, malformed, ...), node-wide",
            unit: None,
            samples: self
                .datapath
                .counters()
                .into_iter()
                .map(|(event, n)| Sample {
                    object: None,
                    field: Some(("event", event)),
                    value: Val::U(n),
                })
                .collect(),
        });
        for (name, h, help) in [
            (
                "ensure_network_seconds",
                &crate::metrics::ENSURE_LATENCY,
                "EnsureNetwork latency in the agent, every edge",
            ),
            (
                "release_network_seconds",
                &crate::metrics::RELEASE_LATENCY,
                "ReleaseNetwork latency in the agent, every edge",
            ),
        ] {
            f.push(Family {
                name,
                kind: Kind::Histogram,
                help,
                unit: Some("seconds"),
                samples: vec![Sample::node(Val::H(h.snapshot()))],
            });
        }
        let cap = self.capacity();
        f.push(Family {
            name: "capacity",
            kind: Kind::Gauge,
            help: "The node's headroom as Capacity reports it, by resource (addresses_free, taps_creatable, host_ports_free_tcp, egress_bps_committed, ...)",
            unit: None,
            samples: cap
                .fields()
                .into_iter()
                .filter(|(k, _)| *k != "labels")
                .map(|(k, n)| Sample {
                    object: None,
                    field: Some(("resource", k)),
                    value: Val::U(n),
                })
                .collect(),
        });
        if !cap.labels.is_empty() {
            f.push(Family {
                name: "node_labels",
                kind: Kind::String,
                help: "The node's labels (config labels), as k=v,...",
                unit: None,
                samples: vec![Sample::node(Val::S(
                    cap.labels
                        .iter()
                        .map(|(k, v)| format!("{k}={v}"))
                        .collect::<Vec<_>>()
                        .join(","),
                ))],
            });
        }
        f.push(Family {
            name: "build",
            kind: Kind::String,
            help: "The agent's version",
            unit: None,
            samples: vec![Sample::node(Val::S(env!("CARGO_PKG_VERSION").into()))],
        });
        f.extend(crate::metrics::flow_families(&self.flows));
        Ok(f)
    }
}
