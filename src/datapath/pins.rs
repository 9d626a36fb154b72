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

use super::DatapathError;
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
    if v.len() != 24 || v[10] == DP_CT_LOCAL {
        return None;
    }
    let mut out = v.to_vec();
    out[12..16].fill(0);
    out.resize(32, 0);
    Some((k.to_vec(), out))
}

/// The conversions this build knows: (map, old value size, how).
const CONVERSIONS: &[(&str, usize, Convert)] = &[("ct", 24, ct_v1)];

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
        } else if found.kind == want.kind && found.key == want.key && found.value == want.value {
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
                Action::Recreate => std::fs::remove_file(&live),
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

/// Copies every entry of `from` into `to` through `convert`, never over an
/// entry `to` has. (copied, dropped).
fn copy_entries(from: &Path, to: &Path, convert: Convert) -> io::Result<(usize, usize)> {
    let src = MapData::from_pin(from).map_err(|e| io::Error::other(crate::error_chain(&e)))?;
    let dst = MapData::from_pin(to).map_err(|e| io::Error::other(crate::error_chain(&e)))?;
    let (sl, dl) = (Layout::read(from)?, Layout::read(to)?);
    let (sfd, dfd) = (src.fd().as_fd(), dst.fd().as_fd());
    let (mut key, mut next) = (vec![0u8; sl.key], vec![0u8; sl.key]);
    let mut value = vec![0u8; value_bytes(sl.kind, sl.value)?];
    let per_cpu = value.len() != sl.value;
    let array = matches!(sl.kind, MapType::Array | MapType::PerCpuArray);
    let (mut copied, mut dropped) = (0, 0);
    let mut first = true;
    loop {
        let prev = if first {
            std::ptr::null()
        } else {
            key.as_ptr()
        };
        match bpf_elem(BPF_MAP_GET_NEXT_KEY, sfd, prev, next.as_mut_ptr() as u64, 0) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => break,
            Err(e) => return Err(e),
        }
        first = false;
        key.copy_from_slice(&next);
        match bpf_elem(
            BPF_MAP_LOOKUP_ELEM,
            sfd,
            key.as_ptr(),
            value.as_mut_ptr() as u64,
            0,
        ) {
            Ok(()) => {}
            // Gone since (an LRU eviction, the reaper).
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
            Err(e) => return Err(e),
        }
        if per_cpu {
            // Only arrays of equal value size are copied per CPU.
            if dl.value != sl.value {
                dropped += 1;
                continue;
            }
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

/// For the layout-migration test: the layout of a pin.
pub fn layout(path: &Path) -> io::Result<Layout> {
    Layout::read(path)
}
