//! Versioned map layouts across upgrades and downgrades.
//!
//! Every map is pinned under its C name; its layout is (type, key size,
//! value size, max entries), listed in [`PINNED`]. A new agent compares each
//! pin left by the previous one with its own layout before it changes
//! anything ([`plan`]):
//!
//! - the same layout: the map is reused, old and new programs share it;
//! - the same type and key and value sizes, another capacity: the entries
//!   are copied into a new map;
//! - a value layout this build knows how to convert (`ct` of the builds
//!   before 32-byte flow values): the entries are converted;
//! - a map rebuilt at every start (`config`, `tap_attached`, `frags`):
//!   recreated;
//! - anything else (a newer build's layout, a changed key): **refused**
//!   before any change, so the running datapath stays as it is.
//!
//! A migrated map's old pin is renamed `<name>_old` (bpffs allows no dot
//! in a name; the programs still in the filters keep using the map), the
//! new map is created under the name and filled ([`Plan::migrate`]) before
//! the new programs go live; after the filters run the new programs, the
//! entries the old programs created meanwhile are copied too and the old
//! pin is removed ([`Plan::finish`]). An upgrade
//! interrupted between the two finds the `_old` pin at the next start and
//! migrates from it again.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};

use aya::maps::{MapData, MapType};
use tracing::{info, warn};

use super::error::DatapathError;
use super::maps::{Keep, PINNED, PinnedMap};

/// A pinned map's layout as the kernel reports it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Layout {
    pub kind: MapType,
    pub key: usize,
    pub value: usize,
    pub entries: u32,
}

impl Layout {
    fn of(m: &PinnedMap) -> Self {
        Self {
            kind: m.kind,
            key: m.key,
            value: m.value,
            entries: m.entries,
        }
    }

    fn read(path: &Path) -> io::Result<Self> {
        let info = MapData::from_pin(path)
            .and_then(|m| m.info())
            .map_err(|e| io::Error::other(crate::error_chain(&e)))?;
        Ok(Self {
            kind: info
                .map_type()
                .map_err(|e| io::Error::other(e.to_string()))?,
            key: info.key_size() as usize,
            value: info.value_size() as usize,
            entries: info.max_entries(),
        })
    }
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?}, key {} B, value {} B, {} entries",
            self.kind, self.key, self.value, self.entries
        )
    }
}

/// How an entry of an older layout becomes one of this build's: `None`
/// drops it.
type Convert = fn(&[u8], &[u8]) -> Option<(Vec<u8>, Vec<u8>)>;

fn copy(k: &[u8], v: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
    Some((k.to_vec(), v.to_vec()))
}

/// `ct` of the builds up to d04b209: 24-byte values {last_seen u64,
/// nat_port u16, kind u8, state u8, local_addr u32, gen u64}. Now: the
/// same fields with `ts_last` u32 where `local_addr` was, then `seq_last`
/// u32 and padding (32 bytes). Host flows of kind 2 (DP_CT_LOCAL) moved to
/// `hflow` and are dropped; their hosts' connections continue as new flows.
fn ct_v1(k: &[u8], v: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
    const DP_CT_LOCAL: u8 = 2;
    if v.get(10) == Some(&DP_CT_LOCAL) {
        return None;
    }
    host_nat_v1(k, v)
}

/// `host_nat` of the builds before 32-byte flow values: the same value
/// layout as [`ct_v1`] (its kind 2 is no host flow there: kept).
fn host_nat_v1(k: &[u8], v: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
    if v.len() != 24 {
        return None;
    }
    let mut out = v.to_vec();
    out[12..16].fill(0);
    out.resize(std::mem::size_of::<crate::datapath::maps::DpCtVal>(), 0);
    Some((k.to_vec(), out))
}

/// `sb_stats` of the builds before `drop_stale_tcp` (9 counters, 72
/// bytes) and before the IPv6 parts (10, 80 bytes): the counters they
/// lack are appended (0), so every total keeps its place.
fn sb_stats_older(k: &[u8], v: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
    const NOW: usize = std::mem::size_of::<crate::datapath::maps::DpSbStats>();
    if v.len() >= NOW || !v.len().is_multiple_of(8) {
        return None;
    }
    let mut out = v.to_vec();
    out.resize(NOW, 0);
    Some((k.to_vec(), out))
}

/// `hflow` of the builds before IPv6 steering (32-byte values): the
/// IPv6 peer they lack is appended (0; no IPv6 flow of theirs went to an
/// agent socket).
fn hflow_v1(k: &[u8], v: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
    if v.len() != 32 {
        return None;
    }
    let mut out = v.to_vec();
    out.resize(std::mem::size_of::<crate::datapath::maps::DpHflowVal>(), 0);
    Some((k.to_vec(), out))
}

/// The conversions this build knows: (map, old value size, how).
const CONVERSIONS: &[(&str, usize, Convert)] = &[
    ("hflow", 32, hflow_v1),
    ("ct", 24, ct_v1),
    ("host_nat", 24, host_nat_v1),
    ("sb_stats", 72, sb_stats_older),
    ("sb_stats", 80, sb_stats_older),
    ("sb_stats", 160, sb_stats_older),
    ("ct", 32, flow_v2),
    ("ct6", 32, flow_v2),
    ("host_nat", 32, flow_v2),
];

/// `ct`, `ct6` and `host_nat` of the builds before the flow log (32-byte
/// values): the totals they lack are appended (0: the flow log counts a
/// flow's packets from the upgrade on, and its start from the first
/// packet after it).
fn flow_v2(k: &[u8], v: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
    if v.len() != 32 {
        return None;
    }
    let mut out = v.to_vec();
    out.resize(std::mem::size_of::<crate::datapath::maps::DpCtVal>(), 0);
    Some((k.to_vec(), out))
}

/// What happens to one map.
#[derive(Debug)]
enum Action {
    /// No pin, or one of this layout: the loader creates or reuses it.
    Keep,
    /// The pin is set aside as `<name>_old` and its entries are carried
    /// into a new map.
    Migrate { from: PathBuf, convert: Convert },
    /// A rebuilt map of another layout: its pin is removed.
    Recreate,
}

/// The decisions for every pinned map, taken before anything changes.
#[derive(Debug)]
pub struct Plan {
    dir: PathBuf,
    steps: Vec<(&'static PinnedMap, Action, Option<Layout>)>,
}

fn aside(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}_old"))
}

fn refused(m: &PinnedMap, path: &Path, found: Layout) -> DatapathError {
    DatapathError {
        what: "pinned map layout",
        detail: format!(
            "{} has layout ({found}); this build uses ({}) and cannot migrate it (was it \
             pinned by a newer build?). Nothing was changed: the datapath already in the \
             kernel keeps forwarding. Start the build that wrote it, or stop every sandbox \
             and remove {} to start over",
            path.display(),
            Layout::of(m),
            path.parent().unwrap_or(path).display(),
        ),
        fatal: true,
    }
}

/// Whether entries of a map of kind `found` can be copied as they are into
/// one of kind `want`: the same kind, or an LRU hash that became a plain
/// hash (`hflow`, `hrev`: no longer evicted, shared by per-sandbox shares).
fn same_kind(found: MapType, want: MapType) -> bool {
    found == want || (found == MapType::LruHash && want == MapType::Hash)
}

/// Decides, for every map, whether its pin is reused, migrated or
/// recreated; refuses (changing nothing) if one cannot be migrated.
pub fn plan(dir: &Path) -> Result<Plan, DatapathError> {
    let mut steps = vec![];
    for m in PINNED {
        let want = Layout::of(m);
        let live = dir.join(m.name);
        let old = aside(dir, m.name);
        // An `_old` pin: an earlier upgrade stopped before it finished.
        let source = if old.exists() {
            if live.exists() && Layout::read(&live).ok() != Some(want) {
                let found = Layout::read(&live).map_err(|e| read_err(&live, e))?;
                return Err(refused(m, &live, found));
            }
            Some(old)
        } else if live.exists() {
            Some(live.clone())
        } else {
            None
        };
        let Some(source) = source else {
            steps.push((m, Action::Keep, None));
            continue;
        };
        let found = Layout::read(&source).map_err(|e| read_err(&source, e))?;
        let action = if source == live && found == want {
            Action::Keep
        } else if same_kind(found.kind, want.kind)
            && found.key == want.key
            && found.value == want.value
        {
            Action::Migrate {
                from: source,
                convert: copy,
            }
        } else if let Some((_, _, convert)) = CONVERSIONS.iter().find(|(n, size, _)| {
            *n == m.name && *size == found.value && found.key == want.key && found.kind == want.kind
        }) {
            Action::Migrate {
                from: source,
                convert: *convert,
            }
        } else if m.keep == Keep::Rebuilt {
            Action::Recreate
        } else {
            return Err(refused(m, &source, found));
        };
        steps.push((m, action, Some(found)));
    }
    Ok(Plan {
        dir: dir.to_owned(),
        steps,
    })
}

fn read_err(path: &Path, e: io::Error) -> DatapathError {
    DatapathError {
        what: "pinned map layout",
        detail: format!("reading {}: {e}", path.display()),
        fatal: true,
    }
}

impl Plan {
    /// Maps whose pins will change, for the log and Health.
    pub fn changes(&self) -> Vec<String> {
        self.steps
            .iter()
            .filter_map(|(m, a, found)| {
                let found = found.map(|f| f.to_string()).unwrap_or_default();
                match a {
                    Action::Keep => None,
                    Action::Migrate { .. } => Some(format!("{} migrated (was {found})", m.name)),
                    Action::Recreate => Some(format!("{} recreated (was {found})", m.name)),
                }
            })
            .collect()
    }

    /// Moves the pins of maps to migrate aside and removes the ones to
    /// recreate, so that the loader creates this build's maps.
    pub fn set_aside(&self) -> Result<(), DatapathError> {
        for (m, action, _) in &self.steps {
            let live = self.dir.join(m.name);
            let r = match action {
                Action::Keep => Ok(()),
                Action::Migrate { from, .. } if *from == live => {
                    std::fs::rename(&live, aside(&self.dir, m.name))
                }
                Action::Migrate { .. } => Ok(()),
                Action::Recreate => {
                    let _ = std::fs::remove_file(aside(&self.dir, m.name));
                    match std::fs::remove_file(&live) {
                        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
                        r => r,
                    }
                }
            };
            r.map_err(|e| DatapathError {
                what: "pinned map layout",
                detail: format!("setting {} aside: {e}", live.display()),
                fatal: true,
            })?;
        }
        Ok(())
    }

    /// Copies (converting) the set-aside maps' entries into this build's;
    /// entries already there are kept (they are newer). Call once before
    /// the new programs go live and once after ([`Plan::finish`]).
    pub fn migrate(&self) -> Result<Vec<String>, DatapathError> {
        self.copy(true)
    }

    fn copy(&self, first: bool) -> Result<Vec<String>, DatapathError> {
        let mut done = vec![];
        for (m, action, _) in &self.steps {
            let Action::Migrate { convert, .. } = action else {
                continue;
            };
            // An array has every index: copied again it would undo what the
            // new programs counted since.
            if !first && matches!(m.kind, MapType::Array | MapType::PerCpuArray) {
                continue;
            }
            let old = aside(&self.dir, m.name);
            let live = self.dir.join(m.name);
            let n = copy_entries(&old, &live, *convert).map_err(|e| DatapathError {
                what: "migrating a pinned map",
                detail: format!("{} -> {}: {e}", old.display(), live.display()),
                fatal: true,
            })?;
            done.push(format!("{}: {} entries", m.name, n.0));
            if n.1 > 0 {
                warn!(
                    map = m.name,
                    dropped = n.1,
                    "entries of an older layout dropped"
                );
            }
        }
        Ok(done)
    }

    /// After the switch to the new programs: the entries the old ones
    /// wrote meanwhile, then the old pins go (and with the last program
    /// holding them, the old maps).
    pub fn finish(&self) -> Result<(), DatapathError> {
        let done = self.copy(false)?;
        for (m, action, _) in &self.steps {
            if matches!(action, Action::Migrate { .. }) {
                let _ = std::fs::remove_file(aside(&self.dir, m.name));
            }
        }
        if !done.is_empty() {
            info!(maps = ?done, "pinned maps migrated to this build's layout");
        }
        Ok(())
    }
}

/// Puts the set-aside pins back if dropped armed: a load that fails before
/// the switch leaves the pin directory as the previous build left it.
pub struct Undo<'a> {
    plan: &'a Plan,
    armed: bool,
}

impl<'a> Undo<'a> {
    pub fn new(plan: &'a Plan) -> Self {
        Self { plan, armed: true }
    }

    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for Undo<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        for (m, action, _) in &self.plan.steps {
            if let Action::Migrate { .. } = action {
                let live = self.plan.dir.join(m.name);
                let old = aside(&self.plan.dir, m.name);
                if old.exists() {
                    let _ = std::fs::remove_file(&live);
                    if let Err(e) = std::fs::rename(&old, &live) {
                        warn!(map = m.name, error = %e, "could not put the old pin back");
                    }
                }
            }
        }
    }
}

// ------------------------------------------------------- bpf(2) by bytes

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_NOEXIST: u64 = 1;

#[repr(C)]
struct ElemAttr {
    map_fd: u32,
    pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

fn bpf_elem(
    cmd: libc::c_long,
    fd: BorrowedFd<'_>,
    key: *const u8,
    value: u64,
    flags: u64,
) -> io::Result<()> {
    let mut attr = ElemAttr {
        map_fd: fd.as_raw_fd() as u32,
        pad: 0,
        key: key as u64,
        value,
        flags,
    };
    // SAFETY: bpf(2) with an attr whose key/value pointers (when not null)
    // point at buffers of the map's key and value sizes (the callers size
    // them from the map's info), alive for the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            &raw mut attr,
            size_of::<ElemAttr>() as u32,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The id of the program in slot `slot` of a program array (the kernel
/// answers a lookup with the id); `None`: the slot is empty.
pub(crate) fn prog_array_slot(fd: BorrowedFd<'_>, slot: u32) -> io::Result<Option<u32>> {
    let mut id = 0u32;
    // A program array's keys and values are 4 bytes each.
    match bpf_elem(
        BPF_MAP_LOOKUP_ELEM,
        fd,
        (&raw const slot).cast(),
        (&raw mut id) as u64,
        0,
    ) {
        Ok(()) => Ok(Some(id)),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Bytes of one value as the syscalls see it: per-CPU maps hold a value
/// (rounded up to 8 bytes) per possible CPU.
fn value_bytes(kind: MapType, value: usize) -> io::Result<usize> {
    if matches!(
        kind,
        MapType::PerCpuArray | MapType::PerCpuHash | MapType::LruPerCpuHash
    ) {
        let cpus = aya::util::nr_cpus().map_err(|(_, e)| e)?;
        Ok(value.div_ceil(8) * 8 * cpus)
    } else {
        Ok(value)
    }
}

/// A map's (key, value) pairs, raw bytes.
type Entries = Vec<(Vec<u8>, Vec<u8>)>;

/// Every (key, value) of the flow map `map`, a few thousand per
/// BPF_MAP_LOOKUP_BATCH call: the reaper's pass over 100k flows costs a
/// few dozen syscalls instead of two per flow (aya's iterator), so it takes
/// little CPU from the request path on a busy node. None if the kernel
/// refuses batched lookups; the caller then walks entry by entry.
pub(super) fn dump_flows<K: aya::Pod + Default, V: aya::Pod + Default>(
    map: &MapData,
) -> Option<Vec<(K, V)>> {
    let (ks, vs) = (size_of::<K>(), size_of::<V>());
    let (keys, vals, n) = batch_raw(map.fd().as_fd(), ks, vs).ok()??;
    Some(
        (0..n)
            .map(|i| {
                // SAFETY: `keys` and `vals` hold `n` entries of exactly
                // these sizes; K and V are Pod (every bit pattern valid),
                // read unaligned from the byte buffers.
                unsafe {
                    (
                        std::ptr::read_unaligned(keys[i * ks..].as_ptr().cast::<K>()),
                        std::ptr::read_unaligned(vals[i * vs..].as_ptr().cast::<V>()),
                    )
                }
            })
            .collect(),
    )
}

/// Every entry of the per-CPU hash map `map` with its CPUs' values folded
/// into one by `fold` (e.g. summed), in a few BPF_MAP_LOOKUP_BATCH calls:
/// aya's iterator costs two syscalls and an allocation per entry, ~20,000
/// syscalls for a scrape at 10,000 sandboxes. None if the kernel refuses
/// batched lookups (or the number of CPUs is unknown); the caller then
/// walks entry by entry.
pub(super) fn dump_per_cpu<K, V, T>(map: &MapData, fold: impl Fn(&[V]) -> T) -> Option<Vec<(K, T)>>
where
    K: aya::Pod + Default,
    V: aya::Pod + Default,
{
    let cpus = aya::util::nr_cpus().ok()?;
    let ks = size_of::<K>();
    // The kernel lays out one value per possible CPU, each rounded up to
    // 8 bytes.
    let stride = size_of::<V>().div_ceil(8) * 8;
    let (keys, vals, n) = batch_raw(map.fd().as_fd(), ks, stride * cpus).ok()??;
    let mut parts = Vec::with_capacity(cpus);
    Some(
        (0..n)
            .map(|i| {
                parts.clear();
                let base = i * stride * cpus;
                // SAFETY: `keys` holds `n` keys of `ks` bytes and `vals` `n`
                // values of `stride * cpus` bytes (`cpus` parts of at
                // least size_of::<V>() bytes each); K and V are Pod (every
                // bit pattern valid), read unaligned from the byte buffers.
                let key = unsafe { std::ptr::read_unaligned(keys[i * ks..].as_ptr().cast::<K>()) };
                for c in 0..cpus {
                    // SAFETY: as above.
                    parts.push(unsafe {
                        std::ptr::read_unaligned(vals[base + c * stride..].as_ptr().cast::<V>())
                    });
                }
                (key, fold(&parts))
            })
            .collect(),
    )
}

/// A map's entries as bytes: keys, values (each concatenated), how many.
pub(super) type RawEntries = (Vec<u8>, Vec<u8>, usize);

/// Every entry of a hash or array map, a few thousand per
/// BPF_MAP_LOOKUP_BATCH call (a consistent walk even while programs add
/// and evict entries): the keys and the values, each concatenated, and how
/// many. None if the kernel refuses batches for this map. Shared by the
/// migration (raw bytes) and the reaper (typed, [`dump_flows`]).
pub(super) fn batch_raw(
    fd: BorrowedFd<'_>,
    key: usize,
    value: usize,
) -> io::Result<Option<RawEntries>> {
    const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
    const CHUNK: usize = 4096;
    #[repr(C)]
    #[derive(Default)]
    struct BatchAttr {
        in_batch: u64,
        out_batch: u64,
        keys: u64,
        values: u64,
        count: u32,
        map_fd: u32,
        elem_flags: u64,
        flags: u64,
    }
    let mut keys = vec![0u8; key * CHUNK];
    let mut vals = vec![0u8; value * CHUNK];
    // Hash maps use a u32 bucket index as the batch token.
    let (mut token_in, mut token_out) = (0u32, 0u32);
    let mut first = true;
    let (mut all_keys, mut all_vals, mut count) = (vec![], vec![], 0usize);
    loop {
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { &raw const token_in as u64 },
            out_batch: &raw mut token_out as u64,
            keys: keys.as_mut_ptr() as u64,
            values: vals.as_mut_ptr() as u64,
            count: CHUNK as u32,
            map_fd: fd.as_raw_fd() as u32,
            ..Default::default()
        };
        // SAFETY: bpf(2) BPF_MAP_LOOKUP_BATCH with buffers for CHUNK keys
        // and values of the map's sizes (the caller's: from the map's info,
        // or checked by check_pins against its types; per-CPU values sized
        // for every possible CPU) and two u32 batch tokens, all alive for
        // the call; the kernel writes at most `count` entries.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_MAP_LOOKUP_BATCH,
                &raw mut attr,
                size_of::<BatchAttr>() as u32,
            )
        };
        let errno = io::Error::last_os_error();
        let n = (attr.count as usize).min(CHUNK);
        if rc == 0 || errno.raw_os_error() == Some(libc::ENOENT) {
            all_keys.extend_from_slice(&keys[..n * key]);
            all_vals.extend_from_slice(&vals[..n * value]);
            count += n;
        }
        if rc != 0 {
            return match errno.raw_os_error() {
                Some(libc::ENOENT) => Ok(Some((all_keys, all_vals, count))),
                Some(libc::EINVAL | libc::ENOTSUP | libc::EOPNOTSUPP) if first => Ok(None),
                _ => Err(errno),
            };
        }
        token_in = token_out;
        first = false;
    }
}

/// [`batch_raw`] as (key, value) pairs.
fn dump_batch(fd: BorrowedFd<'_>, key: usize, value: usize) -> io::Result<Option<Entries>> {
    Ok(batch_raw(fd, key, value)?.map(|(keys, vals, n)| {
        (0..n)
            .map(|i| {
                (
                    keys[i * key..(i + 1) * key].to_vec(),
                    vals[i * value..(i + 1) * value].to_vec(),
                )
            })
            .collect()
    }))
}

/// Every entry one by one (maps without batches: LPM tries, small).
fn dump_walk(fd: BorrowedFd<'_>, key: usize, value: usize) -> io::Result<Entries> {
    let (mut cur, mut next) = (vec![0u8; key], vec![0u8; key]);
    let mut v = vec![0u8; value];
    let mut out = vec![];
    let mut first = true;
    loop {
        let prev = if first {
            std::ptr::null()
        } else {
            cur.as_ptr()
        };
        match bpf_elem(BPF_MAP_GET_NEXT_KEY, fd, prev, next.as_mut_ptr() as u64, 0) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(out),
            Err(e) => return Err(e),
        }
        first = false;
        cur.copy_from_slice(&next);
        match bpf_elem(
            BPF_MAP_LOOKUP_ELEM,
            fd,
            cur.as_ptr(),
            v.as_mut_ptr() as u64,
            0,
        ) {
            Ok(()) => out.push((cur.clone(), v.clone())),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(e),
        }
    }
}

/// Copies every entry of `from` into `to` through `convert`, never over an
/// entry `to` has. (copied, dropped).
fn copy_entries(from: &Path, to: &Path, convert: Convert) -> io::Result<(usize, usize)> {
    let src = MapData::from_pin(from).map_err(|e| io::Error::other(crate::error_chain(&e)))?;
    let dst = MapData::from_pin(to).map_err(|e| io::Error::other(crate::error_chain(&e)))?;
    let (sl, dl) = (Layout::read(from)?, Layout::read(to)?);
    let (sfd, dfd) = (src.fd().as_fd(), dst.fd().as_fd());
    let value = value_bytes(sl.kind, sl.value)?;
    let per_cpu = value != sl.value;
    let array = matches!(sl.kind, MapType::Array | MapType::PerCpuArray);
    let entries = match dump_batch(sfd, sl.key, value)? {
        Some(e) => e,
        None => dump_walk(sfd, sl.key, value)?,
    };
    let (mut copied, mut dropped) = (0, 0);
    for (key, value) in entries {
        // Only maps of equal value size are copied per CPU.
        if per_cpu && dl.value != sl.value {
            dropped += 1;
            continue;
        }
        let Some((k, v)) = convert(&key, &value) else {
            dropped += 1;
            continue;
        };
        // Arrays have every index: the new map's zero is no newer entry.
        let flags = if array { 0 } else { BPF_NOEXIST };
        match bpf_elem(
            BPF_MAP_UPDATE_ELEM,
            dfd,
            k.as_ptr(),
            v.as_ptr() as u64,
            flags,
        ) {
            Ok(()) => copied += 1,
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            // An index beyond a smaller new array, or a full new map.
            Err(e) if matches!(e.raw_os_error(), Some(libc::E2BIG | libc::ENOSPC)) => dropped += 1,
            Err(e) => return Err(e),
        }
    }
    Ok((copied, dropped))
}

/// The ids of the maps a loaded program uses, asked through its fd
/// (aya's `ProgramInfo::map_ids` reopens the program by id, which needs
/// CAP_SYS_ADMIN: the shipped unit does not grant it).
pub fn prog_map_ids(fd: BorrowedFd<'_>) -> io::Result<Vec<u32>> {
    const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
    /// struct bpf_prog_info up to and including `map_ids` (the kernel
    /// fills what the caller's size covers).
    #[repr(C)]
    #[derive(Default)]
    struct ProgInfo {
        kind: u32,
        id: u32,
        tag: [u8; 8],
        jited_prog_len: u32,
        xlated_prog_len: u32,
        jited_prog_insns: u64,
        xlated_prog_insns: u64,
        load_time: u64,
        created_by_uid: u32,
        nr_map_ids: u32,
        map_ids: u64,
    }
    #[repr(C)]
    struct InfoAttr {
        bpf_fd: u32,
        info_len: u32,
        info: u64,
    }
    let call = |info: &mut ProgInfo| -> io::Result<()> {
        let mut attr = InfoAttr {
            bpf_fd: fd.as_raw_fd() as u32,
            info_len: size_of::<ProgInfo>() as u32,
            info: std::ptr::from_mut(info) as u64,
        };
        // SAFETY: bpf(2) BPF_OBJ_GET_INFO_BY_FD with an attr pointing at a
        // ProgInfo of the size it states, whose `map_ids` (when set) points
        // at a buffer of `nr_map_ids` u32s; all alive for the call.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_OBJ_GET_INFO_BY_FD,
                &raw mut attr,
                size_of::<InfoAttr>() as u32,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    };
    let mut info = ProgInfo::default();
    call(&mut info)?;
    let mut ids = vec![0u32; info.nr_map_ids as usize];
    let mut again = ProgInfo {
        nr_map_ids: info.nr_map_ids,
        map_ids: ids.as_mut_ptr() as u64,
        ..Default::default()
    };
    call(&mut again)?;
    ids.truncate(again.nr_map_ids.min(info.nr_map_ids) as usize);
    Ok(ids)
}

/// Deletes the entry `key` of a map with u32 keys (none there: nothing to
/// do); needs no lock of the caller's (map operations are atomic).
pub fn delete_u32(map: &MapData, key: u32) {
    const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
    let k = key.to_ne_bytes();
    let _ = bpf_elem(BPF_MAP_DELETE_ELEM, map.fd().as_fd(), k.as_ptr(), 0, 0);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::maps::DpTraffic6;
    use aya::maps::{IterableMap, PerCpuHashMap, PerCpuValues};

    /// A root-only test: skipped (said so) without root, never in CI.
    fn root(test: &str) -> bool {
        // SAFETY: geteuid(2) has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } == 0 {
            return true;
        }
        let ci = std::env::var_os("CI").is_some_and(|v| !v.is_empty() && v != "0" && v != "false");
        assert!(!ci, "{test} needs root; CI must run as root");
        eprintln!("SKIPPED {test}: needs root to create a BPF map");
        false
    }

    /// The batched per-CPU dump reads what aya's entry-by-entry walk
    /// reads: every key once, each CPU's part in its place.
    #[test]
    fn per_cpu_dump_matches_the_walk() {
        if !root("per_cpu_dump_matches_the_walk") {
            return;
        }
        let cpus = aya::util::nr_cpus().unwrap();
        let mut map = PerCpuHashMap::<MapData, u32, DpTraffic6>::create(6000, 0).unwrap();
        let fd = IterableMap::map(&map).fd().as_fd().try_clone_to_owned();
        let dump = MapData::from_fd(fd.unwrap()).unwrap();
        // More than one batch (4096 entries per call).
        for i in 0..5000u32 {
            let parts: Vec<DpTraffic6> = (0..cpus as u64)
                .map(|c| DpTraffic6 {
                    tx_bytes: u64::from(i) * 10 + c,
                    tx_packets: c + 1,
                    rx_bytes: u64::from(i),
                    rx_packets: 7,
                })
                .collect();
            map.insert(i, PerCpuValues::try_from(parts).unwrap(), 0)
                .unwrap();
        }
        let mut got = dump_per_cpu(&dump, |p: &[DpTraffic6]| DpTraffic6::sum(p)).unwrap();
        got.sort_unstable_by_key(|(k, _)| *k);
        let mut want: Vec<(u32, [u64; 4])> = map
            .iter()
            .map(|e| e.unwrap())
            .map(|(k, parts)| (k, DpTraffic6::sum(parts.iter())))
            .collect();
        want.sort_unstable_by_key(|(k, _)| *k);
        assert_eq!(got.len(), 5000);
        assert_eq!(got, want);
        let n = cpus as u64;
        assert_eq!(
            got[3].1,
            [30 * n + n * (n - 1) / 2, n * (n + 1) / 2, 3 * n, 7 * n]
        );
    }
}
