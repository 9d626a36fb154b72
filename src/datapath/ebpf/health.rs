//! What the datapath tells Health: its programs and config, flow-table
//! fill, pins, loopback mappings and the uplink; each check with a case
//! that passes and one that fails (`check_cases`).

use super::*;

/// Health's `datapath`: the programs and their config (`config`: what the
/// config map holds is what this agent wrote).
fn datapath_check(what: &str, config: Result<(), String>) -> Check {
    match config {
        Ok(()) => ("datapath".into(), true, what.to_owned()),
        Err(e) => (
            "datapath".into(),
            false,
            format!("{e}: restart the agent; {what}"),
        ),
    }
}

/// Health's `datapath_pins`: every map is pinned where this agent pinned
/// it (`problems`: the ones that are not). A map whose pin is gone goes
/// with this agent's last reference: the next start would begin with
/// empty flows, learned addresses and counters.
fn pins_check(dir: &Path, problems: &[String], migrated: &[String]) -> Check {
    let mut s = if problems.is_empty() {
        format!("every map pinned in {}", dir.display())
    } else {
        format!(
            "{}: {}; a restart now would lose what they hold (flows, learned addresses, \
             counters): restart the agent only after checking what removed them",
            dir.display(),
            problems.join("; ")
        )
    };
    if !migrated.is_empty() {
        s.push_str(&format!(
            "; layout changed at this start: {}",
            migrated.join(", ")
        ));
    }
    ("datapath_pins".into(), problems.is_empty(), s)
}

fn loopback_check(localnet: &Result<(), String>) -> Check {
    (
        "datapath_loopback".to_string(),
        localnet.is_ok(),
        match localnet {
            Ok(()) => {
                "host -> 127.0.0.1:host_port mappings enabled (lo: route_localnet=1 accept_local=1)"
                    .into()
            }
            Err(e) => format!("host -> 127.0.0.1:host_port mappings unavailable: {e}"),
        },
    )
}

fn uplink_check(uplink: Option<&(String, u32, Ipv4Addr)>, ports: (u16, u16)) -> Check {
    (
        "datapath_uplink".to_string(),
        uplink.is_some(),
        match uplink {
            Some((n, _, a)) => format!("SNAT to {a} on {n}, ports {}-{}", ports.0, ports.1),
            None => "no uplink: egress and port mappings are dropped".into(),
        },
    )
}

/// Bandwidth limits: how many sandboxes have one each way; the egress ones
/// need the shaper device with the agent's HTB at its root (`root`: what
/// is there; None: no shaper device). Reconcile (an attach) puts a missing
/// root back.
fn bandwidth_check(
    shaper: Option<&str>,
    root: Option<&shaper::Root>,
    (egress, ingress): (usize, usize),
    faults: &[String],
) -> Check {
    if !faults.is_empty() {
        return (
            "bandwidth".to_string(),
            false,
            format!(
                "limits not enforced (ReconcileNetwork tries again): {}",
                faults.join(" | ")
            ),
        );
    }
    let limited = format!(
        "{egress} with an egress limit, {ingress} with an ingress limit (on their own device)"
    );
    let (ok, detail) = match (shaper, root) {
        (None, _) if egress > 0 => (
            false,
            format!("no shaper device, yet {limited}: their egress is not shaped"),
        ),
        (None, _) => (
            true,
            format!(
                "no shaper device (no uplink, or a device of its names is someone else's): egress limits are refused; {limited}"
            ),
        ),
        (Some(dev), Some(shaper::Root::Ours)) => {
            (true, format!("shaper {dev}: HTB c0be:; {limited}"))
        }
        (Some(dev), _) if egress == 0 => (true, format!("shaper {dev} ready; {limited}")),
        (Some(dev), Some(other)) => (
            false,
            format!(
                "{dev}'s root qdisc is not the agent's HTB ({other:?}): {limited}, their egress is \
                 not shaped; ReconcileNetwork puts it back"
            ),
        ),
        (Some(dev), None) => (false, format!("{dev}'s qdisc cannot be read: {limited}")),
    };
    ("bandwidth".to_string(), ok, detail)
}

/// A passing and a failing case of every check the datapath reports (for
/// Health's `every_check_can_fail`).
pub fn check_cases() -> Vec<(Check, Check)> {
    let up = ("up0".to_owned(), 2, Ipv4Addr::new(10, 0, 0, 2));
    vec![
        (
            datapath_check("x", Ok(())),
            datapath_check("x", Err("unreadable".into())),
        ),
        (
            flow_table_check(0, 0, 0),
            flow_table_check(FLOW_MAP_ENTRIES as usize, FLOW_MAP_ENTRIES as usize, 0),
        ),
        (
            pins_check(Path::new("/p"), &[], &[]),
            pins_check(Path::new("/p"), &["ct: missing".into()], &[]),
        ),
        (
            loopback_check(&Ok(())),
            loopback_check(&Err("EPERM".into())),
        ),
        (
            uplink_check(Some(&up), (1024, 2048)),
            uplink_check(None, (1024, 2048)),
        ),
        (
            bandwidth_check(Some("cube-shp"), Some(&shaper::Root::Ours), (2, 1), &[]),
            bandwidth_check(
                Some("cube-shp"),
                Some(&shaper::Root::Default("noqueue".into())),
                (2, 1),
                &[],
            ),
        ),
        (
            bandwidth_check(None, None, (0, 1), &[]),
            bandwidth_check(None, None, (0, 1), &["s: ingress: EPERM".into()]),
        ),
    ]
}

/// Flow-table pressure: `ct` (sandbox flows, LRU) and `hflow` (host
/// flows, shared by per-sandbox shares); past capacity live flows are evicted or new ones
/// refused, so 90 % is the warning line. Counted by the
/// reaper every 2 s.
/// `flows6` of the `flows` are NAT66's: `ct6` and `ct` are as large and
/// fill apart, so the fuller one is judged.
fn flow_table_check(flows: usize, flows6: usize, host_flows: usize) -> Check {
    let pct = |n: usize, cap: u32| n as f64 * 100.0 / f64::from(cap);
    let flows4 = flows.saturating_sub(flows6);
    let (f, h) = (
        pct(flows4.max(flows6), FLOW_MAP_ENTRIES),
        pct(host_flows, HOST_FLOW_ENTRIES),
    );
    let ok = f < 90.0 && h < 90.0;
    (
        "flow_table".to_string(),
        ok,
        format!(
            "{flows4} of {} sandbox flows over IPv4 and {flows6} over IPv6 (the fuller \
             table {f:.1} %), {host_flows} of {} host flows ({h:.1} %){}",
            FLOW_MAP_ENTRIES,
            HOST_FLOW_ENTRIES,
            if ok {
                ""
            } else {
                "; at 90 % and above new flows evict live ones: fewer flows per sandbox, or shorter timeouts"
            }
        ),
    )
}

impl EbpfDatapath {
    /// Pins that are gone or hold another map than at load.
    pub(super) fn pin_problems(&self) -> Vec<String> {
        self.pin_ids
            .iter()
            .filter_map(|(name, id)| {
                let path = self.node.pin_dir.join(name);
                match MapData::from_pin(&path).and_then(|d| d.info()) {
                    Ok(i) if i.id() == *id => None,
                    Ok(_) => Some(format!("{name}: pinned to another map than this agent's")),
                    Err(_) if !path.exists() => Some(format!("{name}: the pin is gone")),
                    Err(e) => Some(format!("{name}: {e}")),
                }
            })
            .collect()
    }

    /// `tails` slots that do not hold this agent's program (an empty slot
    /// refuses what its program would carry: IPv6 to and from the world).
    fn tail_problems(&self) -> Vec<String> {
        use std::os::fd::AsFd;
        TAILS
            .iter()
            .filter_map(|&(slot, name)| {
                let want = self.tags.get(name).map(|p| p.id);
                match crate::datapath::pins::prog_array_slot(self.tails_read.fd().as_fd(), slot) {
                    Ok(Some(id)) if Some(id) == want => None,
                    Ok(Some(id)) => Some(format!(
                        "tails[{slot}] holds program {id}, not this agent's {name}"
                    )),
                    Ok(None) => Some(format!("tails[{slot}] ({name}) is empty")),
                    Err(e) => Some(format!("tails[{slot}] ({name}) cannot be read: {e}")),
                }
            })
            .collect()
    }

    fn bandwidth_health(&self) -> Check {
        let rates: Vec<DpRate> = self.rates().into_iter().map(|(_, r)| r).collect();
        let egress = rates.iter().filter(|r| r.out_small != 0).count();
        let ingress = rates.iter().filter(|r| r.in_shaped != 0).count();
        let root = self.node.shaper.as_ref().and_then(|(_, i)| {
            tc::Conn::new()
                .and_then(|mut c| shaper::root(&mut c, *i))
                .ok()
        });
        let faults: Vec<String> = self
            .shaper_faults
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        bandwidth_check(
            self.node.shaper.as_ref().map(|(n, _)| n.as_str()),
            root.as_ref(),
            (egress, ingress),
            &faults,
        )
    }

    pub(super) fn health_checks(&self) -> Vec<Check> {
        let inner = self.lock();
        let taps = self.stats.taps.load(Ordering::Relaxed);
        let flows = self.stats.flows.load(Ordering::Relaxed);
        let host_flows = self.stats.host_flows.load(Ordering::Relaxed);
        let counters: Vec<String> = Self::counters(&inner)
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .map(|(k, n)| format!("{k}={n}"))
            .collect();
        // What the programs read: the config this agent wrote.
        let written = *self.config.lock().unwrap_or_else(|p| p.into_inner());
        let config = match inner.maps.config.get(&0, 0) {
            Ok(c) if c == written => Ok(()),
            Ok(_) => Err("the config map holds another config than this agent wrote".to_owned()),
            Err(e) => Err(format!("the config map cannot be read: {e}")),
        };
        drop(inner);
        // And the programs the IPv6 paths tail-call.
        let config = config.and_then(|()| match self.tail_problems() {
            p if p.is_empty() => Ok(()),
            p => Err(p.join("; ")),
        });
        let what = format!(
            "eBPF: from_guest on {taps} TAPs, {}; {}; {flows} flows, {host_flows} host flows, \
             {} reaped; counters: {}",
            self.node_hooks
                .iter()
                .map(Hook::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            ipv6_mode(&written),
            self.stats.reaped.load(Ordering::Relaxed),
            if counters.is_empty() {
                "none".into()
            } else {
                counters.join(" ")
            }
        );
        vec![
            datapath_check(&what, config),
            flow_table_check(flows, self.stats.flows6.load(Ordering::Relaxed), host_flows),
            pins_check(&self.node.pin_dir, &self.pin_problems(), &self.migrated),
            loopback_check(&self.localnet),
            uplink_check(self.node.uplink.as_ref(), self.node.snat_ports),
            self.bandwidth_health(),
        ]
    }
}

/// The datapath's IPv6 mode, as the programs read it from `config`.
fn ipv6_mode(c: &crate::datapath::maps::DpConfig) -> String {
    use crate::datapath::maps::{DP_CFG_IPV6, DP_CFG_IPV6_EGRESS};
    if c.flags & DP_CFG_IPV6 == 0 {
        "ipv6=off".into()
    } else if c.flags & DP_CFG_IPV6_EGRESS != 0 {
        format!(
            "ipv6=nat66 via {} (sandboxes whose rules open IPv6)",
            std::net::Ipv6Addr::from(c.uplink_ip6)
        )
    } else {
        "ipv6=link (no egress: off-link refused, AAAA NODATA)".into()
    }
}
