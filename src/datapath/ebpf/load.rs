//! Loading: the object, this build's programs (pinned per build and
//! reused by a restart of the same build), the pinned maps (reused,
//! migrated or refused by `pins.rs`), the switch of every filter to this
//! build's programs, and the indexes rebuilt from the maps.

use super::*;

/// The compiled object (built by build.rs, committed in ebpf/).
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/datapath.bpf.o"));

/// Names this build's programs in the pin directory: a hash (FNV-1a) of
/// the object they come from.
pub(super) fn build_id() -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in OBJECT {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// This build's programs as an earlier start of the same build pinned
/// them, if all are there and use exactly the maps pinned now: a restart
/// of the same build then skips the verifier (~1 s for these programs).
fn pinned_programs(
    dir: &Path,
    pin_dir: &Path,
) -> Option<StdHashMap<&'static str, SchedClassifier>> {
    let maps: HashSet<u32> = PINNED
        .iter()
        .filter_map(|m| {
            Some(
                MapData::from_pin(pin_dir.join(m.name))
                    .ok()?
                    .info()
                    .ok()?
                    .id(),
            )
        })
        .collect();
    let mut out = StdHashMap::new();
    for name in PROGRAMS {
        let p = SchedClassifier::from_pin(dir.join(name)).ok()?;
        let ids = crate::datapath::pins::prog_map_ids(p.fd().ok()?.as_fd()).ok()?;
        if ids.is_empty() || !ids.iter().all(|i| maps.contains(i)) {
            return None;
        }
        out.insert(name, p);
    }
    Some(out)
}

fn is_bpffs(dir: &Path) -> bool {
    const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
    nix::sys::statfs::statfs(dir).is_ok_and(|s| s.filesystem_type().0 == BPF_FS_MAGIC)
}

/// Another handle on a pinned map (for reads without the writer's lock).
fn reopen_pin(dir: &Path, name: &str) -> Result<MapData, DatapathError> {
    MapData::from_pin(dir.join(name))
        .map_err(|e| err("re-opening a pinned map", format!("{name}: {e}")))
}

fn take<T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>>(
    bpf: &mut Ebpf,
    name: &'static str,
) -> Result<T, DatapathError> {
    let map = bpf
        .take_map(name)
        .ok_or_else(|| err("finding a map", name))?;
    T::try_from(map).map_err(|e| err("opening a map", format!("{name}: {e}")))
}

impl EbpfDatapath {
    /// Loads the object (re-using pinned maps), writes the config and
    /// attaches the node programs (uplink ingress, gateway-device egress).
    pub fn load(node: NodeInfo) -> Result<Self, DatapathError> {
        // Every map is pinned by name (that is what carries flows across
        // restarts), so a bpffs is required: say so instead of letting aya
        // fail on a default path.
        if let Err(e) = std::fs::create_dir_all(&node.pin_dir) {
            // Report the real cause (EROFS under a read-only /sys mount,
            // EACCES, ENOENT on sysfs without a bpffs...) with its path.
            return Err(err(
                "bpf_pin_dir",
                format!(
                    "cannot create {}: {e}{}",
                    node.pin_dir.display(),
                    if e.raw_os_error() == Some(libc::EROFS) {
                        " (read-only mount: under systemd the directory itself must be in \
                         ReadWritePaths= and exist before start, see the shipped unit)"
                    } else {
                        ""
                    }
                ),
            ));
        }
        if !is_bpffs(&node.pin_dir) {
            return Err(err(
                "bpf_pin_dir",
                format!(
                    "{} is not on a bpffs (mount -t bpf bpf /sys/fs/bpf, or set bpf_pin_dir)",
                    node.pin_dir.display()
                ),
            ));
        }
        // Every decision about the pins is taken before anything changes: a
        // layout this build cannot migrate leaves the running datapath alone.
        let plan = crate::datapath::pins::plan(&node.pin_dir)?;
        let migrated = plan.changes();
        plan.set_aside()?;
        // Until the switch below, a failure puts the old pins back (the
        // previous build can start again as if nothing happened).
        let mut undo = crate::datapath::pins::Undo::new(&plan);
        let mut loader = EbpfLoader::new();
        loader.default_map_pin_directory(&node.pin_dir);
        let mut bpf = loader
            .load(OBJECT)
            .map_err(|e| err("loading the eBPF object", crate::error_chain(&e)))?;
        let loading = std::time::Instant::now();
        let (progs, tags, reused) =
            Self::programs(&mut bpf, &node.pin_dir, plan.changes().is_empty())?;
        // The old entries, before the new programs see a packet.
        plan.migrate()?;
        let mut maps = Maps {
            config: take(&mut bpf, "config")?,
            counters: take(&mut bpf, "counters")?,
            sandboxes: take(&mut bpf, "sandboxes")?,
            by_ip: take(&mut bpf, "by_ip")?,
            portmap: take(&mut bpf, "portmap")?,
            attached: take(&mut bpf, "tap_attached")?,
            sb_stats: take(&mut bpf, "sb_stats")?,
            sb_traffic6: take(&mut bpf, "sb_traffic6")?,
            sb_share: take(&mut bpf, "sb_share")?,
            sb_rate: take(&mut bpf, "sb_rate")?,
            wake_sent: take(&mut bpf, "wake_sent")?,
            node_addrs: take(&mut bpf, "node_addrs")?,
            node_addrs6: take(&mut bpf, "node_addrs6")?,
        };
        // The node's addresses, before any program sees a packet.
        super::node_addrs::sync(
            &mut maps.node_addrs,
            &mut maps.node_addrs6,
            &node.node_addrs,
        )?;
        let wakes: aya::maps::RingBuf<MapData> = take(&mut bpf, "wakes")?;
        let flow_events: aya::maps::RingBuf<MapData> = take(&mut bpf, "flow_events")?;
        let learned = learned::Learned::<DpLearnedKey>::new(
            take(&mut bpf, "dns_learned")?,
            reopen_pin(&node.pin_dir, "dns_learned")?,
        );
        let learned6 = learned::Learned::<DpLearned6Key>::new(
            take(&mut bpf, "dns_learned6")?,
            reopen_pin(&node.pin_dir, "dns_learned6")?,
        );
        let (uplink_ip, uplink_ifindex) = node
            .uplink
            .as_ref()
            .map(|(_, i, a)| (ip_be(*a), *i))
            .unwrap_or((0, 0));
        let cfg = DpConfig {
            guest_ip: ip_be(node.guest_ip),
            gateway_ip: ip_be(node.gateway_ip),
            host_ip: ip_be(node.host_ip),
            uplink_ip,
            uplink_ifindex,
            gwdev_ifindex: node.gwdev_ifindex,
            snat_port_min: node.snat_ports.0,
            snat_port_max: node.snat_ports.1,
            guest_mac: node.guest_mac,
            gateway_mac: node.gateway_mac,
            gwdev_mac: node.gwdev_mac,
            pad: 0,
            hflow_guaranteed: node.hflow_shares.guaranteed,
            hflow_cap: node.hflow_shares.cap,
            hflow_borrow: node.hflow_shares.borrow,
            shaper_ifindex: node.shaper.as_ref().map_or(0, |s| s.1),
            shaper_peer_ifindex: node.shaper_peer.unwrap_or(0),
            flags: match (node.ipv6_link, node.uplink_ip6) {
                (false, _) => 0,
                (true, None) => crate::datapath::maps::DP_CFG_IPV6,
                (true, Some(_)) => {
                    crate::datapath::maps::DP_CFG_IPV6 | crate::datapath::maps::DP_CFG_IPV6_EGRESS
                }
            } | if node.flow_events {
                crate::datapath::maps::DP_CFG_FLOW_EVENTS
            } else {
                0
            } | if node.deny_reject {
                crate::datapath::maps::DP_CFG_REJECT
            } else {
                0
            },
            uplink_ip6: node
                .uplink_ip6
                .filter(|_| node.ipv6_link)
                .map_or([0; 16], |a| a.octets()),
            pool6: node.pool6.filter(|_| node.ipv6_link).unwrap_or([0; 12]),
            pool_mask: ip_be(node.pool_mask),
            flow_interval_ns: 1_000_000_000 / super::super::FLOW_EVENTS_PER_SEC,
            flow_burst: super::super::FLOW_EVENTS_BURST,
        };
        // The tail-called programs, before any hook runs the programs that
        // call them (an empty slot: IPv6 to the world is refused).
        {
            let mut tails: aya::maps::ProgramArray<MapData> = take(&mut bpf, "tails")?;
            for (slot, name) in super::TAILS {
                let fd = progs
                    .get(name)
                    .ok_or_else(|| err("finding a tail-called program", name))?;
                tails
                    .set(slot, fd, 0)
                    .map_err(|e| err("writing the tails map", e))?;
            }
        }
        maps.config
            .set(0, cfg, 0)
            .map_err(|e| err("writing the config map", e))?;
        let written = cfg;
        // Host access: exactly the configured uids (a pin of the last
        // start may hold others).
        {
            let mut access: HashMap<MapData, u32, u8> = take(&mut bpf, "host_access")?;
            let stale: Vec<u32> = access
                .keys()
                .flatten()
                .filter(|u| !node.host_access_uids.contains(u))
                .collect();
            for u in stale {
                let _ = access.remove(&u);
            }
            for u in &node.host_access_uids {
                access
                    .insert(u, 1, 0)
                    .map_err(|e| err("writing host_access", e))?;
            }
        }
        // The anchor's binding first (a block exists while a qdisc binds
        // it), then the block's filter: every bound TAP runs this build's
        // `from_guest` from here on. Then the node devices, each replaced
        // in place.
        let mut node_hooks = vec![
            Hook {
                device: node.anchor.0.clone(),
                ifindex: node.anchor.1,
                place: Place::Bound(node.block),
                program: "from_guest",
            },
            Hook {
                device: format!("tc block {}", node.block),
                ifindex: BLOCK_IFINDEX,
                place: Place::Block(node.block),
                program: "from_guest",
            },
            Hook {
                device: node.gwdev_name.clone(),
                ifindex: node.gwdev_ifindex,
                place: Place::Filter(TcHook::Egress),
                program: "to_sandbox_ip",
            },
            Hook {
                device: "lo".into(),
                ifindex: 1,
                place: Place::Filter(TcHook::Egress),
                program: "from_host",
            },
        ];
        if let Some((name, index, _)) = &node.uplink {
            node_hooks.push(Hook {
                device: name.clone(),
                ifindex: *index,
                place: Place::Filter(TcHook::Ingress),
                program: "from_uplink",
            });
            node_hooks.push(Hook {
                device: name.clone(),
                ifindex: *index,
                place: Place::Filter(TcHook::Egress),
                program: "to_uplink",
            });
        }
        // Last: Health's datapath line lists the hooks in this order.
        if let (Some((name, _)), Some(peer)) = (&node.shaper, &node.shaper_peer) {
            node_hooks.push(Hook {
                device: format!("{name}{SHAPER_PEER_SUFFIX}"),
                ifindex: *peer,
                place: Place::Filter(TcHook::Ingress),
                program: "from_shaper",
            });
        }
        // The per-sandbox indexes from the (possibly pinned) maps.
        let policy4 = Policies::new(
            (
                take(&mut bpf, "policy_allow")?,
                take(&mut bpf, "policy_deny")?,
            ),
            [
                "writing policy_allow (allow_out)",
                "writing policy_deny (deny_out)",
            ],
        )?;
        let policy6 = Policies::new(
            (
                take(&mut bpf, "policy6_allow")?,
                take(&mut bpf, "policy6_deny")?,
            ),
            [
                "writing policy6_allow (allow_out)",
                "writing policy6_deny (deny_out)",
            ],
        )?;
        // The switch: from here on a failure is fatal (the agent must not
        // run a half-switched datapath; the next start takes it up again).
        undo.disarm();
        let fatal = |mut e: DatapathError| {
            e.fatal = true;
            e
        };
        // Every TAP first (the anchor and the block's filter: all bound
        // TAPs at once; then those with a filter of their own), the node
        // devices after.
        for h in &node_hooks[..2] {
            install(&progs, h).map_err(fatal)?;
        }
        let TakenOver {
            own: own_filter,
            stale,
            kept,
        } = Self::take_over_taps(&progs, &mut maps.attached).map_err(fatal)?;
        for h in &node_hooks[2..] {
            install(&progs, h).map_err(fatal)?;
        }
        // The old programs run nowhere now: what they wrote meanwhile, then
        // the old maps and programs go.
        plan.finish().map_err(fatal)?;
        Self::drop_other_builds(&node.pin_dir);
        // Replies to the host's own connections to 127.x:host_port are
        // redirected into lo as fresh packets that need a route lookup:
        // the kernel treats a 127/8 destination (route_localnet) and a
        // local source address (accept_local) as martian unless allowed.
        // Only lo is changed: packets arriving on lo are local by
        // construction.
        let localnet = crate::sysctl::enable_loopback_localnet();
        let mut portmaps: StdHashMap<u32, Vec<DpPortmapKey>> = StdHashMap::new();
        for (k, v) in maps.portmap.iter().flatten() {
            portmaps.entry(v.sandbox_ip).or_default().push(k);
        }
        // New generations stay above the pinned ones (guards against a
        // clock that is not this boot's, e.g. another time namespace).
        let reopen = |name: &str| reopen_pin(&node.pin_dir, name);
        let newest = dump_flows::<u32, DpTap>(&reopen("by_ip")?)
            .unwrap_or_else(|| maps.by_ip.iter().flatten().collect())
            .into_iter()
            .map(|(_, t)| t.generation)
            .max();
        LAST_GENERATION.fetch_max(newest.unwrap_or(0), Ordering::Relaxed);
        let reaper = Reaper {
            ct6: HashMap::try_from(aya::maps::Map::LruHashMap(reopen("ct6")?))
                .map_err(|e| err("opening ct6", e))?,
            ct_rev6: HashMap::try_from(aya::maps::Map::LruHashMap(reopen("ct_rev6")?))
                .map_err(|e| err("opening ct_rev6", e))?,
            ct6_dump: reopen("ct6")?,
            ended: StdHashMap::new(),
            hseen: StdHashMap::new(),
            ct: HashMap::try_from(aya::maps::Map::LruHashMap(reopen("ct")?))
                .map_err(|e| err("opening ct", e))?,
            ct_rev: HashMap::try_from(aya::maps::Map::LruHashMap(reopen("ct_rev")?))
                .map_err(|e| err("opening ct_rev", e))?,
            attached: HashMap::try_from(aya::maps::Map::HashMap(reopen("tap_attached")?))
                .map_err(|e| err("opening tap_attached", e))?,
            by_ip: HashMap::try_from(aya::maps::Map::HashMap(reopen("by_ip")?))
                .map_err(|e| err("opening by_ip", e))?,
            by_ip_dump: reopen("by_ip")?,
            attached_dump: reopen("tap_attached")?,
            passes: 0,
            ct_dump: reopen("ct")?,
            host_nat: HashMap::try_from(aya::maps::Map::LruHashMap(reopen("host_nat")?))
                .map_err(|e| err("opening host_nat", e))?,
            host_nat_dump: reopen("host_nat")?,
            hflow: HashMap::try_from(aya::maps::Map::HashMap(reopen("hflow")?))
                .map_err(|e| err("opening hflow", e))?,
            hflow_dump: reopen("hflow")?,
            hrev: HashMap::try_from(aya::maps::Map::HashMap(reopen("hrev")?))
                .map_err(|e| err("opening hrev", e))?,
            hrev_dump: reopen("hrev")?,
            sb_share: HashMap::try_from(aya::maps::Map::HashMap(reopen("sb_share")?))
                .map_err(|e| err("opening sb_share", e))?,
            sb_share_dump: reopen("sb_share")?,
            share_pool: Array::try_from(aya::maps::Map::Array(reopen("share_pool")?))
                .map_err(|e| err("opening share_pool", e))?,
            hflow_shares: node.hflow_shares,
            sb_stats: HashMap::try_from(aya::maps::Map::HashMap(reopen("sb_stats")?))
                .map_err(|e| err("opening sb_stats", e))?,
            sb_dump: reopen("sb_stats")?,
            sb_traffic6: PerCpuHashMap::try_from(aya::maps::Map::PerCpuHashMap(reopen(
                "sb_traffic6",
            )?))
            .map_err(|e| err("opening sb_traffic6", e))?,
            traffic6_dump: reopen("sb_traffic6")?,
            sb_rate: HashMap::try_from(aya::maps::Map::HashMap(reopen("sb_rate")?))
                .map_err(|e| err("opening sb_rate", e))?,
            rate_dump: reopen("sb_rate")?,
            wake_sent: HashMap::try_from(aya::maps::Map::HashMap(reopen("wake_sent")?))
                .map_err(|e| err("opening wake_sent", e))?,
        };
        let sb_read = Mutex::new(
            HashMap::try_from(aya::maps::Map::HashMap(reopen("sb_stats")?))
                .map_err(|e| err("opening sb_stats", e))?,
        );
        let sb_read_dump = reopen("sb_stats")?;
        let traffic6_read = Mutex::new(
            PerCpuHashMap::try_from(aya::maps::Map::PerCpuHashMap(reopen("sb_traffic6")?))
                .map_err(|e| err("opening sb_traffic6", e))?,
        );
        let traffic6_read_dump = reopen("sb_traffic6")?;
        let rate_read = Mutex::new(
            HashMap::try_from(aya::maps::Map::HashMap(reopen("sb_rate")?))
                .map_err(|e| err("opening sb_rate", e))?,
        );
        let rate_read_dump = reopen("sb_rate")?;
        let attached_forget = reopen("tap_attached")?;
        let tails_read = reopen("tails")?;
        let by_ip_read_dump = reopen("by_ip")?;
        let by_ip_read = HashMap::try_from(aya::maps::Map::HashMap(reopen("by_ip")?))
            .map_err(|e| err("opening by_ip", e))?;
        let pin_ids = PINNED
            .iter()
            .map(|m| {
                let id = MapData::from_pin(node.pin_dir.join(m.name))
                    .and_then(|d| d.info())
                    .map(|i| i.id())
                    .unwrap_or(0);
                (m.name, id)
            })
            .collect();
        let names: Vec<String> = node_hooks.iter().map(Hook::to_string).collect();
        info!(
            pin_dir = %node.pin_dir.display(),
            node_programs = ?names,
            from_guest_tag = format!("{:016x}", tags["from_guest"].tag),
            own_filter = own_filter.len(),
            migrated = ?migrated,
            programs = if reused { "pinned by an earlier start of this build" } else { "loaded and verified" },
            elapsed_ms = loading.elapsed().as_millis() as u64,
            "eBPF datapath loaded"
        );
        let dp = Self {
            inner: Mutex::new(Inner {
                maps,
                policy4,
                policy6,
                portmaps,
            }),
            progs,
            reaper: Mutex::new(reaper),
            proxy_flows: HashMap::try_from(aya::maps::Map::HashMap(reopen_pin(
                &node.pin_dir,
                "hflow",
            )?))
            .map_err(|e| err("opening hflow", e))?,
            stats: Stats {
                taps: AtomicUsize::new(kept),
                own: AtomicUsize::new(own_filter.len()),
                ..Default::default()
            },
            node,
            node_hooks,
            tags,
            tails_read,
            own_filter: Mutex::new(own_filter),
            stale: Mutex::new(stale),
            block_lost: Default::default(),
            attached_forget,
            sb_read,
            sb_read_dump,
            traffic6_read,
            traffic6_read_dump,
            rate_read,
            rate_read_dump,
            shaper_root: Mutex::new(()),
            shaper_faults: Default::default(),

            learned,
            learned6,
            by_ip_read,
            by_ip_read_dump,
            migrated,
            localnet,
            config: Mutex::new(written),
            pin_ids,
            wakes: Mutex::new(Some(wakes)),
            flow_events: Mutex::new(Some(flow_events)),
            flow_ends: Mutex::new(Vec::new()),
            host_flows: Mutex::new(Vec::new()),
        };
        // Counts for Health come from the first reaper pass (2 s after start);
        // walking every flow and TAP here would delay READY.
        Ok(dp)
    }

    /// This build's programs: the ones an earlier start of this build
    /// pinned under `programs/<build id>` (same object, same maps: no
    /// verifier pass), else loaded and verified now and pinned there for
    /// the next start. Other builds' pins are removed once the switch is
    /// done ([`Self::drop_other_builds`]).
    pub(super) fn programs(
        bpf: &mut Ebpf,
        pin_dir: &Path,
        maps_kept: bool,
    ) -> Result<(Programs, StdHashMap<&'static str, ProgId>, bool), DatapathError> {
        let (mut progs, mut tags) = (Programs::new(), StdHashMap::new());
        let mut keep = |name: &'static str, p: &SchedClassifier| -> Result<(), DatapathError> {
            let info = p.info().map_err(|e| err("reading a program's tag", e))?;
            tags.insert(
                name,
                ProgId {
                    tag: info.tag(),
                    id: info.id(),
                },
            );
            let fd = p
                .fd()
                .map_err(|e| err("program fd", e))?
                .try_clone()
                .map_err(|e| err("program fd", e))?;
            progs.insert(name, fd);
            Ok(())
        };
        let dir = pin_dir.join("programs").join(build_id());
        if maps_kept && let Some(pinned) = pinned_programs(&dir, pin_dir) {
            for (name, p) in &pinned {
                keep(name, p)?;
            }
            debug!(dir = %dir.display(), "this build's pinned programs reused");
            return Ok((progs, tags, true));
        }
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| err("pinning the programs", e))?;
        for name in PROGRAMS {
            let p: &mut SchedClassifier = bpf
                .program_mut(name)
                .ok_or_else(|| err("finding the program", name))?
                .try_into()
                .map_err(|e| err("program type", e))?;
            p.load().map_err(|e| {
                err(
                    "loading a program",
                    format!("{name}: {}", crate::error_chain(&e)),
                )
            })?;
            p.pin(dir.join(name))
                .map_err(|e| err("pinning the programs", format!("{name}: {e}")))?;
            keep(name, p)?;
        }
        Ok((progs, tags, false))
    }

    /// Unpins the programs of other builds: nothing runs them any more
    /// (the kernel frees each with its last filter).
    pub(super) fn drop_other_builds(pin_dir: &Path) {
        let mine = build_id();
        let Ok(dirs) = std::fs::read_dir(pin_dir.join("programs")) else {
            return;
        };
        for d in dirs.flatten() {
            if d.file_name().to_string_lossy() != mine {
                let _ = std::fs::remove_dir_all(d.path());
            }
        }
    }
}
