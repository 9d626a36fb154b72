//! The names behind learned addresses, kept across restarts for the flow
//! log (docs/flows.md "The record"): the learned addresses themselves live
//! in the pinned `dns_learned` map and are adopted at start, but which
//! name taught each one is the agent's memory. Every answer's (sandbox
//! address, destination, name) is appended to `<state_dir>/dns-names`
//! (one write per answer, not synced: a crash of the node may lose the
//! last names, a crash of the agent none; never an address);
//! a start reads it back for the addresses it adopted and writes it anew
//! with just those, as does the reaper once it holds many more lines than
//! live names.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::net::{IpAddr, Ipv4Addr};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use tracing::warn;

/// The file's name in the state directory.
const FILE: &str = "dns-names";

pub(super) struct NameLog {
    path: PathBuf,
    out: Mutex<Option<BufWriter<File>>>,
    /// Lines appended since the file was last written anew.
    lines: AtomicU64,
}

/// A name as the log can hold it: the resolver's question, which a guest
/// chose: only names of visible ASCII without spaces (every usable host
/// name) are kept.
fn loggable(name: &str) -> bool {
    !name.is_empty() && name.len() <= 253 && name.bytes().all(|b| b.is_ascii_graphic())
}

fn open_append(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(path)
}

impl NameLog {
    pub(super) fn new(state_dir: &Path) -> NameLog {
        NameLog {
            path: state_dir.join(FILE),
            out: Mutex::new(None),
            lines: AtomicU64::new(0),
        }
    }

    /// Notes that `name`'s answer taught the sandbox at `src` the address
    /// `dst`.
    pub(super) fn append(&self, src: Ipv4Addr, dst: IpAddr, name: &str) {
        if !loggable(name) {
            return;
        }
        let mut out = self.out.lock().unwrap_or_else(|p| p.into_inner());
        if out.is_none() {
            match open_append(&self.path) {
                Ok(f) => *out = Some(BufWriter::new(f)),
                Err(e) => {
                    warn!(path = %self.path.display(), error = %e, "dns: cannot keep learned names");
                    return;
                }
            }
        }
        if let Some(w) = out.as_mut()
            && writeln!(w, "{src} {dst} {name}")
                .and_then(|()| w.flush())
                .is_ok()
        {
            self.lines.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Writes what is buffered.
    pub(super) fn flush(&self) {
        if let Some(w) = self.out.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            let _ = w.flush();
        }
    }

    /// Lines appended since the file was last written anew.
    pub(super) fn lines(&self) -> u64 {
        self.lines.load(Ordering::Relaxed)
    }

    /// The file's names, the last one of each (sandbox, destination).
    pub(super) fn load(&self) -> HashMap<(Ipv4Addr, IpAddr), String> {
        let mut names = HashMap::new();
        let Ok(f) = File::open(&self.path) else {
            return names;
        };
        for line in BufReader::new(f).lines().map_while(Result::ok) {
            let mut w = line.split(' ');
            let (Some(src), Some(dst), Some(name), None) = (w.next(), w.next(), w.next(), w.next())
            else {
                continue;
            };
            if let (Ok(src), Ok(dst)) = (src.parse(), dst.parse())
                && loggable(name)
            {
                names.insert((src, dst), name.to_owned());
            }
        }
        names
    }

    /// Writes the file anew with `names` only (a temporary file renamed
    /// over it), and appends after them from now on.
    pub(super) fn rewrite(&self, names: &[(Ipv4Addr, IpAddr, String)]) {
        let mut out = self.out.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(w) = out.as_mut() {
            let _ = w.flush();
        }
        let tmp = self.path.with_extension("new");
        let _ = std::fs::remove_file(&tmp);
        let written = (|| -> std::io::Result<()> {
            let mut w = BufWriter::new(open_append(&tmp)?);
            for (src, dst, name) in names.iter().filter(|(_, _, n)| loggable(n)) {
                writeln!(w, "{src} {dst} {name}")?;
            }
            w.flush()?;
            std::fs::rename(&tmp, &self.path)
        })();
        match written {
            Ok(()) => {
                *out = open_append(&self.path).ok().map(BufWriter::new);
                self.lines.store(0, Ordering::Relaxed);
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                warn!(path = %self.path.display(), error = %e, "dns: cannot rewrite the learned names");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_survive_a_reload_and_a_rewrite() {
        let dir = std::env::temp_dir().join(format!("cna-dns-names-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let log = NameLog::new(&dir);
        let a = Ipv4Addr::new(192, 168, 0, 9);
        let d1: IpAddr = "198.51.100.2".parse().unwrap();
        let d2: IpAddr = "2001:db8::2".parse().unwrap();
        log.append(a, d1, "www.allowed.test");
        log.append(a, d2, "v6.allowed.test");
        log.append(a, d1, "other.allowed.test");
        // A name a guest made up with a space or a newline is not kept.
        log.append(a, d2, "evil name\nx");
        log.flush();
        let names = log.load();
        assert_eq!(names.len(), 2);
        assert_eq!(
            names[&(a, d1)],
            "other.allowed.test",
            "the last answer wins"
        );
        assert_eq!(names[&(a, d2)], "v6.allowed.test");
        assert_eq!(log.lines(), 3);
        log.rewrite(&[(a, d2, "v6.allowed.test".into())]);
        assert_eq!(log.lines(), 0);
        log.append(a, d1, "again.allowed.test");
        log.flush();
        let names = log.load();
        assert_eq!(names.len(), 2);
        assert_eq!(names[&(a, d1)], "again.allowed.test");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.join(FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
