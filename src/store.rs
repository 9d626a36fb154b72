//! Durable key→value store for sandbox network records.
//!
//! Keys are sandbox ids (UTF-8, 1..=128 bytes); values are opaque bytes
//! (typically ~500 bytes of JSON). The store keeps at most a few thousand
//! records, all of which are returned by [`Store::open`].
//!
//! # On-disk layout (under `dir`)
//!
//! * `journal` — append-only log of changes.
//! * `snapshot` — full state as of some sequence number.
//! * `quarantine/` — damaged files and rejected records moved aside.
//!
//! Both `journal` and `snapshot` are a sequence of framed entries:
//!
//! ```text
//! magic u32 LE (0xC0BE_0001) | len u32 LE | crc32 u32 LE (of payload) | payload[len]
//! payload = op u8 | seq u64 LE | key_len u16 LE | key | value (rest)
//! op: 1 = put, 2 = delete, 3 = snapshot header
//! ```
//!
//! The snapshot's first entry is a header (op 3) whose `seq` is the last
//! sequence number it includes and whose value is the record count (u64 LE);
//! every further entry is a put. A snapshot is written to `snapshot.tmp`,
//! fsynced, renamed over `snapshot`, and the directory is fsynced; only then
//! is the journal truncated. On load, journal entries with `seq <=` the
//! snapshot's seq are skipped, which covers a crash between the rename and
//! the truncate.
//!
//! # Why a journal with group commit
//!
//! Every acknowledged change must survive `kill -9` / power loss, so each
//! `put`/`delete` waits for `fdatasync`. Rewriting a whole file per change
//! would cost O(state) per write; an append-only journal costs O(change).
//! A single writer thread drains every request queued while the previous
//! fsync was in flight and commits them with one `write` + one `fdatasync`,
//! so N concurrent callers share one fsync instead of paying N. Periodic
//! snapshots bound the journal size so opening stays fast.
//!
//! # Damage handling
//!
//! A torn journal tail (incomplete or invalid last entry) is the normal
//! result of a crash and is silently truncated. Damage followed by valid
//! entries (or any damage in the snapshot) is not fatal: the file is copied
//! into `quarantine/`, every entry that still parses is kept, the problem is
//! reported in [`Loaded::problems`], and a fresh snapshot is written.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::sync::oneshot;

const MAGIC: u32 = 0xC0BE_0001;
const FRAME_HEADER_LEN: usize = 12;
/// op + seq + key_len.
const PAYLOAD_FIXED_LEN: usize = 1 + 8 + 2;
const OP_PUT: u8 = 1;
const OP_DELETE: u8 = 2;
const OP_HEADER: u8 = 3;

/// Maximum key length in bytes.
pub const MAX_KEY_LEN: usize = 128;
/// Maximum value length in bytes.
pub const MAX_VALUE_LEN: usize = 16 * 1024 * 1024;
const MAX_PAYLOAD_LEN: usize = PAYLOAD_FIXED_LEN + MAX_KEY_LEN + MAX_VALUE_LEN;
/// Maximum number of requests committed in one fsync batch.
const MAX_BATCH: usize = 1024;

const JOURNAL: &str = "journal";
const SNAPSHOT: &str = "snapshot";
const SNAPSHOT_TMP: &str = "snapshot.tmp";
const QUARANTINE: &str = "quarantine";

/// Errors returned by the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot create directory {path}")]
    CreateDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot open {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("store directory {path} is locked by another instance{}", holder.map(|p| format!(" (pid {p})")).unwrap_or_default())]
    Locked { path: PathBuf, holder: Option<u32> },
    #[error("journal write failed")]
    Write {
        #[source]
        source: io::Error,
    },
    #[error("journal fsync failed")]
    Sync {
        #[source]
        source: io::Error,
    },
    #[error("snapshot write failed")]
    Snapshot {
        #[source]
        source: io::Error,
    },
    #[error("cannot write quarantine file {path}")]
    Quarantine {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot start writer thread")]
    Spawn {
        #[source]
        source: io::Error,
    },
    #[error("invalid key: {reason}")]
    InvalidKey { reason: &'static str },
    #[error("value too large: {len} bytes")]
    ValueTooLarge { len: usize },
    #[error("store is closed")]
    Closed,
    #[error("store refuses writes after an earlier fsync failure")]
    Poisoned,
}

/// Records and diagnostics produced by [`Store::open`].
#[derive(Debug, Default)]
pub struct Loaded {
    pub records: BTreeMap<String, Vec<u8>>,
    /// Human-readable descriptions of damage found (and quarantined) on load.
    pub problems: Vec<String>,
}

/// Tunables for [`Store::open_with`].
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Compact when the journal exceeds `max(compact_bytes, 4 * snapshot size)`.
    pub compact_bytes: u64,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            compact_bytes: 4 * 1024 * 1024,
        }
    }
}

/// Counters since the store was opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Number of fsync batches committed.
    pub commits: u64,
    /// Number of put/delete operations committed.
    pub ops: u64,
    /// Current journal size in bytes.
    pub journal_bytes: u64,
    /// Number of snapshots written by the writer.
    pub compactions: u64,
}

#[derive(Default)]
struct Shared {
    commits: AtomicU64,
    ops: AtomicU64,
    journal_bytes: AtomicU64,
    compactions: AtomicU64,
    /// Set when the writer refuses further writes (failed fsync) until a
    /// snapshot of the committed state rebuilds the files.
    poisoned: std::sync::atomic::AtomicBool,
    /// Why the last write failed; cleared by the next one that succeeds.
    failure: std::sync::Mutex<Option<StoreFailure>>,
}

/// Why the store cannot write right now (see [`Store::failure`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreFailure {
    /// What failed ("journal write", "journal fsync", "snapshot").
    pub what: &'static str,
    /// The errno, when the kernel gave one.
    pub errno: Option<i32>,
    /// The error as text ("No space left on device (os error 28)").
    pub error: String,
    /// When writes started failing.
    pub since: SystemTime,
    /// A failed fsync: nothing is written until the committed state has
    /// been rewritten from memory (tried every [`RETRY`]).
    pub poisoned: bool,
}

/// How often a failing store tries to write again by itself.
pub const RETRY: std::time::Duration = std::time::Duration::from_secs(1);

enum Op {
    Put {
        key: String,
        value: Vec<u8>,
    },
    Delete {
        key: String,
    },
    Quarantine {
        key: String,
        value: Vec<u8>,
        reason: String,
    },
    Compact,
}

struct Request {
    op: Op,
    done: oneshot::Sender<Result<(), StoreError>>,
}

/// Handle to the store. `Send + Sync`; share it via `Arc`.
///
/// Dropping it (or calling [`Store::close`]) waits for queued requests to be
/// committed and stops the writer thread.
pub struct Store {
    tx: Option<mpsc::Sender<Request>>,
    handle: Option<JoinHandle<()>>,
    dir: PathBuf,
    shared: Arc<Shared>,
}

impl Store {
    /// Opens (creating if needed) the store in `dir` with default options.
    pub fn open(dir: &Path) -> Result<(Store, Loaded), StoreError> {
        Self::open_with(dir, Options::default())
    }

    /// Opens (creating if needed) the store in `dir`.
    pub fn open_with(dir: &Path, opts: Options) -> Result<(Store, Loaded), StoreError> {
        let qdir = dir.join(QUARANTINE);
        for d in [dir, qdir.as_path()] {
            fs::create_dir_all(d).map_err(|source| StoreError::CreateDir {
                path: d.to_path_buf(),
                source,
            })?;
        }

        let jpath = dir.join(JOURNAL);
        let journal = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .mode(0o600)
            .open(&jpath)
            .map_err(|source| StoreError::Open {
                path: jpath.clone(),
                source,
            })?;
        match journal.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => {
                return Err(StoreError::Locked {
                    path: dir.to_path_buf(),
                    holder: lock_holder(&journal),
                });
            }
            Err(fs::TryLockError::Error(source)) => {
                return Err(StoreError::Open {
                    path: jpath,
                    source,
                });
            }
        }

        // Records may hold secrets (egress rules' header values): files an
        // earlier build made under a looser umask become the owner's only.
        for path in [jpath.clone(), dir.join(SNAPSHOT)] {
            if let Ok(m) = fs::metadata(&path)
                && m.permissions().mode() & 0o077 != 0
                && let Err(e) = fs::set_permissions(&path, fs::Permissions::from_mode(0o600))
            {
                tracing::warn!(path = %path.display(), error = %e, "cannot make the store's file owner-only");
            }
        }

        let tmp = dir.join(SNAPSHOT_TMP);
        if let Err(e) = fs::remove_file(&tmp)
            && e.kind() != io::ErrorKind::NotFound
        {
            tracing::warn!(path = %tmp.display(), error = %e, "cannot remove stale snapshot.tmp");
        }

        let mut problems = Vec::new();
        let snap = load_snapshot(&dir.join(SNAPSHOT), &qdir, &mut problems)?;
        let mut records = snap.records;
        let mut snapshot_len = snap.len;

        let jbytes = fs::read(&jpath).map_err(|source| StoreError::Read {
            path: jpath.clone(),
            source,
        })?;
        let scan = scan(&jbytes);
        let mut last_seq = snap.seq;
        let mut skipped = 0usize;
        for e in &scan.entries {
            last_seq = last_seq.max(e.seq);
            if e.seq <= snap.seq {
                skipped += 1;
                continue;
            }
            match e.op {
                OP_PUT => {
                    records.insert(e.key.to_owned(), e.value.to_vec());
                }
                OP_DELETE => {
                    records.remove(e.key);
                }
                _ => {}
            }
        }
        let mut journal_len = jbytes.len() as u64;
        if scan.damaged {
            let path = quarantine_copy(&qdir, JOURNAL, &jbytes)?;
            tracing::warn!(
                path = %path.display(),
                kept = scan.entries.len(),
                skipped_bytes = scan.skipped_bytes,
                "journal damaged; copied to quarantine"
            );
            problems.push(format!(
                "journal damaged: {} bytes unreadable, {} entries kept; copy at {}",
                scan.skipped_bytes,
                scan.entries.len(),
                path.display()
            ));
        } else if scan.valid_end < jbytes.len() {
            tracing::info!(
                valid_bytes = scan.valid_end,
                dropped_bytes = jbytes.len() - scan.valid_end,
                "truncating torn journal tail"
            );
            journal
                .set_len(scan.valid_end as u64)
                .map_err(|source| StoreError::Write { source })?;
            journal
                .sync_data()
                .map_err(|source| StoreError::Sync { source })?;
            journal_len = scan.valid_end as u64;
        }

        if !problems.is_empty() {
            snapshot_len = write_snapshot(dir, &records, last_seq)
                .map_err(|source| StoreError::Snapshot { source })?;
            journal
                .set_len(0)
                .map_err(|source| StoreError::Write { source })?;
            journal
                .sync_data()
                .map_err(|source| StoreError::Sync { source })?;
            journal_len = 0;
        }
        // Make the journal's directory entry durable (it may have just been created).
        sync_dir(dir).map_err(|source| StoreError::Sync { source })?;

        tracing::info!(
            records = records.len(),
            journal_entries = scan.entries.len(),
            skipped_entries = skipped,
            problems = problems.len(),
            "store loaded"
        );

        let shared = Arc::new(Shared::default());
        shared.journal_bytes.store(journal_len, Ordering::Relaxed);
        let writer = Writer {
            dir: dir.to_path_buf(),
            journal,
            journal_len,
            snapshot_len,
            next_seq: last_seq + 1,
            mirror: records.clone(),
            compact_bytes: opts.compact_bytes,
            poisoned: false,
            shared: Arc::clone(&shared),
            buf: Vec::new(),
        };
        let (tx, rx) = mpsc::channel();
        let handle = std::thread::Builder::new()
            .name("store-writer".into())
            .spawn(move || writer.run(rx))
            .map_err(|source| StoreError::Spawn { source })?;

        Ok((
            Store {
                tx: Some(tx),
                handle: Some(handle),
                dir: dir.to_path_buf(),
                shared,
            },
            Loaded { records, problems },
        ))
    }

    /// Durably stores `value` under `key`.
    pub async fn put(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        validate_key(key)?;
        validate_value(&value)?;
        self.submit(Op::Put {
            key: key.to_owned(),
            value,
        })
        .await
    }

    /// Durably removes `key` (a no-op if absent, but still durable).
    pub async fn delete(&self, key: &str) -> Result<(), StoreError> {
        validate_key(key)?;
        self.submit(Op::Delete {
            key: key.to_owned(),
        })
        .await
    }

    /// Moves a record that failed the caller's validation aside: writes
    /// `value` to `quarantine/<key>-<ts>.rec` and `reason` to `.why`, fsyncs
    /// them, then durably deletes `key`.
    pub async fn quarantine_record(
        &self,
        key: &str,
        value: &[u8],
        reason: &str,
    ) -> Result<(), StoreError> {
        validate_key(key)?;
        self.submit(Op::Quarantine {
            key: key.to_owned(),
            value: value.to_vec(),
            reason: reason.to_owned(),
        })
        .await
    }

    /// Writes a snapshot now and truncates the journal.
    pub async fn compact(&self) -> Result<(), StoreError> {
        self.submit(Op::Compact).await
    }

    /// Counters shared with the writer thread.
    pub fn stats(&self) -> StoreStats {
        StoreStats {
            commits: self.shared.commits.load(Ordering::Relaxed),
            ops: self.shared.ops.load(Ordering::Relaxed),
            journal_bytes: self.shared.journal_bytes.load(Ordering::Relaxed),
            compactions: self.shared.compactions.load(Ordering::Relaxed),
        }
    }

    /// Whether the writer thread runs (a store that cannot write, see
    /// [`Store::failure`], heals itself: not a reason to restart).
    pub fn is_alive(&self) -> bool {
        self.handle.as_ref().is_some_and(|h| !h.is_finished())
    }

    /// Why writes fail now, if they do: set by a failed write, fsync or
    /// rebuild, cleared by the next write that succeeds (the writer tries
    /// by itself every [`RETRY`], so freeing space heals it without a
    /// restart or a caller).
    pub fn failure(&self) -> Option<StoreFailure> {
        self.shared
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The store's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Flushes queued requests and stops the writer thread.
    pub fn close(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        // Dropping the only sender lets the writer drain the queue and exit.
        drop(self.tx.take());
        if let Some(handle) = self.handle.take()
            && handle.join().is_err()
        {
            tracing::error!("store writer thread panicked");
        }
    }

    async fn submit(&self, op: Op) -> Result<(), StoreError> {
        let (done, rx) = oneshot::channel();
        let tx = self.tx.as_ref().ok_or(StoreError::Closed)?;
        tx.send(Request { op, done })
            .map_err(|_| StoreError::Closed)?;
        rx.await.map_err(|_| StoreError::Closed)?
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn validate_key(key: &str) -> Result<(), StoreError> {
    if key.is_empty() {
        return Err(StoreError::InvalidKey { reason: "empty" });
    }
    if key.len() > MAX_KEY_LEN {
        return Err(StoreError::InvalidKey {
            reason: "longer than 128 bytes",
        });
    }
    Ok(())
}

fn validate_value(value: &[u8]) -> Result<(), StoreError> {
    if value.len() > MAX_VALUE_LEN {
        return Err(StoreError::ValueTooLarge { len: value.len() });
    }
    Ok(())
}

/// The writer thread's state: sole owner of the journal file and the mirror.
struct Writer {
    dir: PathBuf,
    journal: File,
    journal_len: u64,
    snapshot_len: u64,
    next_seq: u64,
    mirror: BTreeMap<String, Vec<u8>>,
    compact_bytes: u64,
    poisoned: bool,
    shared: Arc<Shared>,
    buf: Vec<u8>,
}

enum Change {
    Put(String, Vec<u8>),
    Delete(String),
}

impl Writer {
    fn run(mut self, rx: mpsc::Receiver<Request>) {
        loop {
            let first = if self.failing() {
                match rx.recv_timeout(RETRY) {
                    Ok(r) => r,
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        self.heal();
                        continue;
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                }
            } else {
                match rx.recv() {
                    Ok(r) => r,
                    Err(_) => break,
                }
            };
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(req) => batch.push(req),
                    Err(_) => break,
                }
            }
            self.commit(batch);
            if !self.poisoned
                && self.journal_len > self.compact_bytes.max(self.snapshot_len.saturating_mul(4))
                && let Err(e) = self.compact()
            {
                tracing::warn!(error = %e, "compaction failed");
            }
        }
        tracing::debug!("store writer stopped");
    }

    fn failing(&self) -> bool {
        self.shared
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// Records why writes fail (the first failure's time is kept).
    fn fail(&mut self, what: &'static str, e: &io::Error) {
        let mut f = self
            .shared
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let since = f.as_ref().map_or_else(SystemTime::now, |f| f.since);
        if f.is_none() {
            tracing::error!(what, error = %e, "the store cannot write; retrying every second");
        }
        *f = Some(StoreFailure {
            what,
            errno: e.raw_os_error(),
            error: e.to_string(),
            since,
            poisoned: self.poisoned,
        });
    }

    /// A write succeeded: the store works again.
    fn succeeded(&mut self) {
        let mut f = self
            .shared
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(old) = f.take() {
            tracing::info!(
                what = old.what,
                failing_for_s = old.since.elapsed().map_or(0, |d| d.as_secs()),
                "the store writes again"
            );
        }
    }

    /// Tries to write again after a failure: a snapshot of the committed
    /// state (the mirror: only what was acknowledged) and an empty journal.
    /// After a failed fsync this is the only way back: the journal's pages
    /// are in an unknown state, the snapshot is a new file written from
    /// memory.
    fn heal(&mut self) {
        match self.rebuild() {
            Ok(()) => {
                self.poisoned = false;
                self.shared.poisoned.store(false, Ordering::Relaxed);
                self.succeeded();
            }
            Err(StoreError::Snapshot { source }) => self.fail("snapshot", &source),
            Err(StoreError::Sync { source }) => self.fail("journal fsync", &source),
            Err(StoreError::Write { source }) => self.fail("journal truncate", &source),
            Err(e) => tracing::debug!(error = %e, "store rebuild failed"),
        }
    }

    fn commit(&mut self, batch: Vec<Request>) {
        if self.poisoned {
            self.heal();
        }
        if self.poisoned {
            for req in batch {
                let _ = req.done.send(Err(StoreError::Poisoned));
            }
            return;
        }
        self.buf.clear();
        let mut pending: Vec<(oneshot::Sender<Result<(), StoreError>>, Change)> =
            Vec::with_capacity(batch.len());
        let mut compact_waiters = Vec::new();
        for Request { op, done } in batch {
            let change = match op {
                Op::Put { key, value } => Change::Put(key, value),
                Op::Delete { key } => Change::Delete(key),
                Op::Quarantine { key, value, reason } => {
                    match write_quarantine_record(&self.dir, &key, &value, &reason) {
                        Ok(path) => {
                            tracing::warn!(key = %key, path = %path.display(), reason = %reason, "record quarantined");
                            Change::Delete(key)
                        }
                        Err(e) => {
                            let _ = done.send(Err(e));
                            continue;
                        }
                    }
                }
                Op::Compact => {
                    compact_waiters.push(done);
                    continue;
                }
            };
            let seq = self.next_seq;
            self.next_seq += 1;
            match &change {
                Change::Put(k, v) => encode(&mut self.buf, OP_PUT, seq, k.as_bytes(), v),
                Change::Delete(k) => encode(&mut self.buf, OP_DELETE, seq, k.as_bytes(), &[]),
            }
            pending.push((done, change));
        }

        if !pending.is_empty() {
            self.write_batch(pending);
        }
        for done in compact_waiters {
            let _ = done.send(self.compact());
        }
    }

    fn write_batch(&mut self, pending: Vec<(oneshot::Sender<Result<(), StoreError>>, Change)>) {
        if let Err(e) = self.journal.write_all(&self.buf) {
            // Remove any partial write so later appends stay parseable.
            if let Err(te) = self.journal.set_len(self.journal_len) {
                tracing::error!(error = %te, "cannot undo partial journal write; refusing further writes");
                self.poisoned = true;
                self.shared.poisoned.store(true, Ordering::Relaxed);
            }
            tracing::error!(error = %e, ops = pending.len(), "journal write failed");
            self.fail("journal write", &e);
            for (done, _) in pending {
                let _ = done.send(Err(StoreError::Write { source: dup_io(&e) }));
            }
            return;
        }
        if let Err(e) = self.journal.sync_data() {
            // After a failed fsync the page cache state is unknown: never retry.
            self.poisoned = true;
            self.shared.poisoned.store(true, Ordering::Relaxed);
            tracing::error!(error = %e, ops = pending.len(), "journal fsync failed; refusing further writes until the committed state is rewritten");
            self.fail("journal fsync", &e);
            for (done, _) in pending {
                let _ = done.send(Err(StoreError::Sync { source: dup_io(&e) }));
            }
            return;
        }
        self.journal_len += self.buf.len() as u64;
        self.succeeded();
        self.shared
            .journal_bytes
            .store(self.journal_len, Ordering::Relaxed);
        self.shared.commits.fetch_add(1, Ordering::Relaxed);
        self.shared
            .ops
            .fetch_add(pending.len() as u64, Ordering::Relaxed);
        tracing::trace!(
            ops = pending.len(),
            bytes = self.buf.len(),
            "batch committed"
        );
        for (done, change) in pending {
            match change {
                Change::Put(k, mut v) => {
                    // Kept for snapshots: exactly its length (a record's
                    // JSON is built with up to twice its size in capacity).
                    v.shrink_to_fit();
                    self.mirror.insert(k, v);
                }
                Change::Delete(k) => {
                    self.mirror.remove(&k);
                }
            }
            let _ = done.send(Ok(()));
        }
    }

    fn compact(&mut self) -> Result<(), StoreError> {
        if self.poisoned {
            return Err(StoreError::Poisoned);
        }
        self.rebuild()
    }

    /// Writes a snapshot of the mirror and truncates the journal.
    fn rebuild(&mut self) -> Result<(), StoreError> {
        let seq = self.next_seq - 1;
        let old_journal = self.journal_len;
        let size = write_snapshot(&self.dir, &self.mirror, seq)
            .map_err(|source| StoreError::Snapshot { source })?;
        self.snapshot_len = size;
        // The snapshot is durable; journal entries are now redundant (and
        // skipped on load by seq if the truncate below is lost).
        self.journal
            .set_len(0)
            .map_err(|source| StoreError::Write { source })?;
        if let Err(source) = self.journal.sync_data() {
            self.poisoned = true;
            self.shared.poisoned.store(true, Ordering::Relaxed);
            return Err(StoreError::Sync { source });
        }
        self.journal_len = 0;
        self.shared.journal_bytes.store(0, Ordering::Relaxed);
        self.shared.compactions.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            entries = self.mirror.len(),
            snapshot_bytes = size,
            journal_bytes = old_journal,
            seq,
            "journal compacted"
        );
        Ok(())
    }
}

/// Recreates an io::Error so each waiter of a failed batch gets its own.
fn dup_io(e: &io::Error) -> io::Error {
    match e.raw_os_error() {
        Some(code) => io::Error::from_raw_os_error(code),
        None => io::Error::new(e.kind(), e.to_string()),
    }
}

fn encode(buf: &mut Vec<u8>, op: u8, seq: u64, key: &[u8], value: &[u8]) {
    let len = PAYLOAD_FIXED_LEN + key.len() + value.len();
    let start = buf.len();
    buf.reserve(FRAME_HEADER_LEN + len);
    buf.extend_from_slice(&MAGIC.to_le_bytes());
    buf.extend_from_slice(&(len as u32).to_le_bytes());
    buf.extend_from_slice(&[0; 4]); // crc placeholder
    let payload_start = buf.len();
    buf.push(op);
    buf.extend_from_slice(&seq.to_le_bytes());
    buf.extend_from_slice(&(key.len() as u16).to_le_bytes());
    buf.extend_from_slice(key);
    buf.extend_from_slice(value);
    let crc = crc32fast::hash(&buf[payload_start..]);
    buf[start + 8..start + 12].copy_from_slice(&crc.to_le_bytes());
}

#[derive(Debug)]
struct Entry<'a> {
    op: u8,
    seq: u64,
    key: &'a str,
    value: &'a [u8],
}

fn le_u16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn le_u32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn le_u64(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// Parses one complete, valid entry at `pos`; returns it and its framed size.
fn parse_at(buf: &[u8], pos: usize) -> Option<(Entry<'_>, usize)> {
    let rest = buf.get(pos..)?;
    if le_u32(rest, 0)? != MAGIC {
        return None;
    }
    let len = le_u32(rest, 4)? as usize;
    if !(PAYLOAD_FIXED_LEN..=MAX_PAYLOAD_LEN).contains(&len) {
        return None;
    }
    let crc = le_u32(rest, 8)?;
    let payload = rest.get(FRAME_HEADER_LEN..FRAME_HEADER_LEN + len)?;
    if crc32fast::hash(payload) != crc {
        return None;
    }
    let op = *payload.first()?;
    if !matches!(op, OP_PUT | OP_DELETE | OP_HEADER) {
        return None;
    }
    let seq = le_u64(payload, 1)?;
    let key_len = le_u16(payload, 9)? as usize;
    if key_len > MAX_KEY_LEN {
        return None;
    }
    let key = payload.get(PAYLOAD_FIXED_LEN..PAYLOAD_FIXED_LEN + key_len)?;
    let key = std::str::from_utf8(key).ok()?;
    let value = payload.get(PAYLOAD_FIXED_LEN + key_len..)?;
    Some((
        Entry {
            op,
            seq,
            key,
            value,
        },
        FRAME_HEADER_LEN + len,
    ))
}

/// Position of the next valid entry at or after `from`.
fn find_next(buf: &[u8], from: usize) -> Option<usize> {
    let magic = MAGIC.to_le_bytes();
    let mut i = from;
    loop {
        let off = buf.get(i..)?.windows(4).position(|w| w == magic)?;
        let p = i + off;
        if parse_at(buf, p).is_some() {
            return Some(p);
        }
        i = p + 1;
    }
}

struct Scan<'a> {
    entries: Vec<Entry<'a>>,
    /// End of the last valid entry.
    valid_end: usize,
    /// A bad region was followed by at least one valid entry.
    damaged: bool,
    /// Bytes skipped in bad regions that precede valid entries.
    skipped_bytes: usize,
}

fn scan(buf: &[u8]) -> Scan<'_> {
    let mut s = Scan {
        entries: Vec::new(),
        valid_end: 0,
        damaged: false,
        skipped_bytes: 0,
    };
    let mut pos = 0;
    while pos < buf.len() {
        if let Some((entry, n)) = parse_at(buf, pos) {
            s.entries.push(entry);
            pos += n;
            s.valid_end = pos;
        } else if let Some(next) = find_next(buf, pos + 1) {
            s.damaged = true;
            s.skipped_bytes += next - pos;
            pos = next;
        } else {
            break;
        }
    }
    s
}

struct Snapshot {
    records: BTreeMap<String, Vec<u8>>,
    seq: u64,
    len: u64,
}

fn load_snapshot(
    path: &Path,
    qdir: &Path,
    problems: &mut Vec<String>,
) -> Result<Snapshot, StoreError> {
    let bytes = match fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Ok(Snapshot {
                records: BTreeMap::new(),
                seq: 0,
                len: 0,
            });
        }
        Err(source) => {
            return Err(StoreError::Read {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    let scan = scan(&bytes);
    let mut bad = scan.damaged || scan.valid_end < bytes.len();
    let mut header: Option<(u64, Option<u64>)> = None;
    let mut max_seq = 0;
    let mut records = BTreeMap::new();
    for (i, e) in scan.entries.iter().enumerate() {
        max_seq = max_seq.max(e.seq);
        match e.op {
            OP_HEADER if i == 0 => header = Some((e.seq, le_u64(e.value, 0))),
            OP_PUT => {
                records.insert(e.key.to_owned(), e.value.to_vec());
            }
            _ => bad = true,
        }
    }
    let seq = match header {
        Some((seq, count)) => {
            if count != Some(records.len() as u64) {
                bad = true;
            }
            seq
        }
        None => {
            bad = true;
            max_seq
        }
    };
    if bad {
        let qpath = quarantine_copy(qdir, SNAPSHOT, &bytes)?;
        tracing::warn!(
            path = %qpath.display(),
            kept = records.len(),
            "snapshot damaged; copied to quarantine"
        );
        problems.push(format!(
            "snapshot damaged: {} records recovered; copy at {}",
            records.len(),
            qpath.display()
        ));
    }
    Ok(Snapshot {
        records,
        seq,
        len: bytes.len() as u64,
    })
}

/// Writes a full snapshot durably; returns its size.
fn write_snapshot(dir: &Path, records: &BTreeMap<String, Vec<u8>>, seq: u64) -> io::Result<u64> {
    let size: usize = records
        .iter()
        .map(|(k, v)| FRAME_HEADER_LEN + PAYLOAD_FIXED_LEN + k.len() + v.len())
        .sum();
    let mut buf = Vec::with_capacity(size + 64);
    encode(
        &mut buf,
        OP_HEADER,
        seq,
        b"",
        &(records.len() as u64).to_le_bytes(),
    );
    for (k, v) in records {
        encode(&mut buf, OP_PUT, seq, k.as_bytes(), v);
    }
    let tmp = dir.join(SNAPSHOT_TMP);
    let written = private_create(&tmp).and_then(|mut f| {
        f.write_all(&buf)?;
        f.sync_all()
    });
    if let Err(e) = written {
        // A partial file would hold on to the space that ran out.
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    fs::rename(&tmp, dir.join(SNAPSHOT))?;
    sync_dir(dir)?;
    Ok(buf.len() as u64)
}

/// Creates (or truncates) a file only its owner reads: records may hold
/// secrets (egress rules' header values), whatever the umask.
fn private_create(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

fn unix_ts() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Creates `dir/<stem><ext>` (or `<stem>.<n><ext>` if taken) exclusively.
fn create_unique(dir: &Path, stem: &str, ext: &str) -> io::Result<(File, PathBuf)> {
    for n in 0..10_000u32 {
        let name = if n == 0 {
            format!("{stem}{ext}")
        } else {
            format!("{stem}.{n}{ext}")
        };
        let path = dir.join(name);
        match OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
        {
            Ok(f) => return Ok((f, path)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AlreadyExists,
        "no free quarantine file name",
    ))
}

fn write_durable(f: &mut File, bytes: &[u8]) -> io::Result<()> {
    f.write_all(bytes)?;
    f.sync_all()
}

/// Copies a damaged file's bytes to `quarantine/<what>-<ts>`, durably.
fn quarantine_copy(qdir: &Path, what: &str, bytes: &[u8]) -> Result<PathBuf, StoreError> {
    let stem = format!("{what}-{}", unix_ts());
    let qerr = |path: PathBuf| move |source| StoreError::Quarantine { path, source };
    let (mut f, path) = create_unique(qdir, &stem, "").map_err(qerr(qdir.join(&stem)))?;
    write_durable(&mut f, bytes).map_err(qerr(path.clone()))?;
    sync_dir(qdir).map_err(qerr(qdir.to_path_buf()))?;
    Ok(path)
}

fn sanitize_key(key: &str) -> String {
    key.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Writes `<key>-<ts>.rec` and `.why` into `dir/quarantine`, durably.
fn write_quarantine_record(
    dir: &Path,
    key: &str,
    value: &[u8],
    reason: &str,
) -> Result<PathBuf, StoreError> {
    let qdir = dir.join(QUARANTINE);
    let qerr = |path: PathBuf| move |source| StoreError::Quarantine { path, source };
    let stem = format!("{}-{}", sanitize_key(key), unix_ts());
    let (mut rec, rec_path) =
        create_unique(&qdir, &stem, ".rec").map_err(qerr(qdir.join(&stem)))?;
    write_durable(&mut rec, value).map_err(qerr(rec_path.clone()))?;
    let why_path = rec_path.with_extension("why");
    let why = format!("key: {key}\nreason: {reason}\n");
    private_create(&why_path)
        .and_then(|mut f| write_durable(&mut f, why.as_bytes()))
        .map_err(qerr(why_path))?;
    sync_dir(&qdir).map_err(qerr(qdir.clone()))?;
    Ok(rec_path)
}

/// The process holding the flock on `file`, from /proc/locks (the kernel
/// lists each lock with its holder's pid and the file's device and inode).
fn lock_holder(file: &File) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    let m = file.metadata().ok()?;
    let ino = m.ino();
    let dev = m.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let want = format!("{major:02x}:{minor:02x}:{ino}");
    // (pid, "major:minor:inode") of every flock: "1: FLOCK  ADVISORY  WRITE
    // 1234 08:01:5678 0 EOF".
    let locks: Vec<(u32, String)> = fs::read_to_string("/proc/locks")
        .ok()?
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let at = f.iter().position(|x| *x == "FLOCK")?;
            Some((f.get(at + 3)?.parse().ok()?, (*f.get(at + 4)?).to_owned()))
        })
        .collect();
    if let Some((pid, _)) = locks.iter().find(|(_, id)| *id == want) {
        return Some(*pid);
    }
    // On an overlay the kernel lists the upper layer's device: the inode
    // alone, if exactly one lock has it.
    let suffix = format!(":{ino}");
    let mut same = locks.iter().filter(|(_, id)| id.ends_with(&suffix));
    match (same.next(), same.next()) {
        (Some((pid, _)), None) => Some(*pid),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::time::{Duration, Instant};

    /// Unique temp directory removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> TempDir {
            static N: AtomicUsize = AtomicUsize::new(0);
            let n = N.fetch_add(1, Ordering::Relaxed);
            let nanos = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0);
            let p = std::env::temp_dir().join(format!(
                "store-test-{name}-{}-{n}-{nanos}",
                std::process::id()
            ));
            fs::create_dir_all(&p).unwrap();
            TempDir(p)
        }
        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn open(dir: &Path) -> (Store, Loaded) {
        Store::open(dir).unwrap()
    }

    fn reopen(dir: &Path) -> Loaded {
        let (s, l) = open(dir);
        drop(s);
        l
    }

    fn entry_len(key: &str, value: &[u8]) -> usize {
        FRAME_HEADER_LEN + PAYLOAD_FIXED_LEN + key.len() + value.len()
    }

    fn quarantine_files(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir.join(QUARANTINE))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn store_is_send_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Store>();
        assert_send_sync::<StoreError>();
    }

    #[test]
    fn encode_parse_roundtrip() {
        let mut buf = Vec::new();
        encode(&mut buf, OP_PUT, 42, b"key", b"value");
        assert_eq!(buf.len(), entry_len("key", b"value"));
        let (e, n) = parse_at(&buf, 0).unwrap();
        assert_eq!(n, buf.len());
        assert_eq!(
            (e.op, e.seq, e.key, e.value),
            (OP_PUT, 42, "key", &b"value"[..])
        );
        assert!(parse_at(&buf, 1).is_none());
        assert!(parse_at(&buf[..buf.len() - 1], 0).is_none());
    }

    #[test]
    fn scan_handles_garbage_without_panic() {
        let s = scan(&[]);
        assert!(s.entries.is_empty() && !s.damaged);
        let garbage: Vec<u8> = (0..4096u32).map(|i| (i * 7919 % 251) as u8).collect();
        let s = scan(&garbage);
        assert!(s.entries.is_empty() && !s.damaged && s.valid_end == 0);
        // A bogus frame header with a huge length followed by a valid entry.
        let mut buf = Vec::new();
        buf.extend_from_slice(&MAGIC.to_le_bytes());
        buf.extend_from_slice(&u32::MAX.to_le_bytes());
        buf.extend_from_slice(&[0; 4]);
        encode(&mut buf, OP_PUT, 1, b"k", b"v");
        let s = scan(&buf);
        assert!(s.damaged);
        assert_eq!(s.entries.len(), 1);
        assert_eq!(s.skipped_bytes, 12);
    }

    #[tokio::test]
    async fn put_then_reopen() {
        let t = TempDir::new("put");
        let (s, l) = open(t.path());
        assert!(l.records.is_empty() && l.problems.is_empty());
        s.put("sb-1", b"one".to_vec()).await.unwrap();
        s.put("sb-2", b"two".to_vec()).await.unwrap();
        assert_eq!(s.dir(), t.path());
        drop(s);
        let (s, l) = open(t.path());
        assert_eq!(
            s.stats().journal_bytes,
            (entry_len("sb-1", b"one") * 2) as u64
        );
        drop(s);
        assert!(l.problems.is_empty());
        assert_eq!(l.records.len(), 2);
        assert_eq!(l.records["sb-1"], b"one");
        assert_eq!(l.records["sb-2"], b"two");
    }

    #[tokio::test]
    async fn delete_then_reopen() {
        let t = TempDir::new("del");
        let (s, _) = open(t.path());
        s.put("a", b"1".to_vec()).await.unwrap();
        s.put("b", b"2".to_vec()).await.unwrap();
        s.delete("a").await.unwrap();
        s.delete("missing").await.unwrap();
        s.close();
        let l = reopen(t.path());
        assert_eq!(l.records.keys().collect::<Vec<_>>(), ["b"]);
    }

    #[tokio::test]
    async fn overwrite_keeps_latest() {
        let t = TempDir::new("over");
        let (s, _) = open(t.path());
        for i in 0..10u8 {
            s.put("k", vec![i; 3]).await.unwrap();
        }
        drop(s);
        let l = reopen(t.path());
        assert_eq!(l.records["k"], vec![9u8; 3]);
        assert_eq!(l.records.len(), 1);
    }

    #[tokio::test]
    async fn invalid_keys_and_values_rejected() {
        let t = TempDir::new("inval");
        let (s, _) = open(t.path());
        assert!(matches!(
            s.put("", vec![]).await,
            Err(StoreError::InvalidKey { .. })
        ));
        let long = "x".repeat(MAX_KEY_LEN + 1);
        assert!(matches!(
            s.put(&long, vec![]).await,
            Err(StoreError::InvalidKey { .. })
        ));
        assert!(matches!(
            s.delete(&long).await,
            Err(StoreError::InvalidKey { .. })
        ));
        let max = "y".repeat(MAX_KEY_LEN);
        s.put(&max, vec![1]).await.unwrap();
        drop(s);
        assert_eq!(reopen(t.path()).records[&max], vec![1]);
    }

    #[test]
    fn second_open_is_locked() {
        let t = TempDir::new("lock");
        let (s, _) = open(t.path());
        let e = Store::open(t.path()).map(|_| ()).unwrap_err();
        assert!(
            matches!(e, StoreError::Locked { holder: Some(p), .. } if p == std::process::id()),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .contains(&format!("(pid {})", std::process::id())),
            "{e}"
        );
        drop(s);
        let (_s, _) = open(t.path());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ten_thousand_records_reopen() {
        let t = TempDir::new("10k");
        let (s, _) = open(t.path());
        let s = Arc::new(s);
        let value = vec![b'x'; 500];
        let mut handles = Vec::new();
        for task in 0..16 {
            let s = Arc::clone(&s);
            let value = value.clone();
            handles.push(tokio::spawn(async move {
                for i in (task..10_000).step_by(16) {
                    s.put(&format!("sandbox-{i:05}"), value.clone())
                        .await
                        .unwrap();
                }
            }));
        }
        for h in handles {
            h.await.unwrap();
        }
        let stats = s.stats();
        assert_eq!(stats.ops, 10_000);
        drop(s);
        let start = Instant::now();
        let l = reopen(t.path());
        eprintln!("reopen of 10k records took {:?}", start.elapsed());
        assert!(l.problems.is_empty());
        assert_eq!(l.records.len(), 10_000);
        assert_eq!(l.records["sandbox-09999"], value);
    }

    #[tokio::test]
    async fn torn_tail_at_every_offset() {
        let t = TempDir::new("torn");
        let (s, _) = open(t.path());
        s.put("first", b"111".to_vec()).await.unwrap();
        s.put("second", b"222".to_vec()).await.unwrap();
        s.put("third", b"333333".to_vec()).await.unwrap();
        drop(s);
        let jpath = t.path().join(JOURNAL);
        let full = fs::read(&jpath).unwrap();
        let last = entry_len("third", b"333333");
        let start = full.len() - last;
        for cut in start..full.len() {
            fs::write(&jpath, &full[..cut]).unwrap();
            let l = reopen(t.path());
            assert!(l.problems.is_empty(), "cut {cut}: {:?}", l.problems);
            assert_eq!(l.records["first"], b"111");
            assert_eq!(l.records["second"], b"222");
            assert!(!l.records.contains_key("third"), "cut {cut}");
            assert_eq!(fs::metadata(&jpath).unwrap().len(), start as u64);
        }
        assert!(quarantine_files(t.path()).is_empty());
        // Appends after a truncated tail remain readable.
        let (s, _) = open(t.path());
        s.put("fourth", b"4".to_vec()).await.unwrap();
        drop(s);
        let l = reopen(t.path());
        assert_eq!(l.records.len(), 3);
        assert!(l.problems.is_empty());
    }

    #[tokio::test]
    async fn torn_tail_with_garbage_bytes() {
        let t = TempDir::new("garbage-tail");
        let (s, _) = open(t.path());
        s.put("a", b"1".to_vec()).await.unwrap();
        drop(s);
        let jpath = t.path().join(JOURNAL);
        let mut f = OpenOptions::new().append(true).open(&jpath).unwrap();
        f.write_all(&[0xAB; 37]).unwrap();
        drop(f);
        let l = reopen(t.path());
        assert!(l.problems.is_empty());
        assert_eq!(l.records["a"], b"1");
        assert_eq!(
            fs::metadata(&jpath).unwrap().len(),
            entry_len("a", b"1") as u64
        );
    }

    #[tokio::test]
    async fn mid_file_corruption_is_quarantined() {
        let t = TempDir::new("mid");
        let (s, _) = open(t.path());
        for i in 0..5 {
            s.put(&format!("k{i}"), format!("value-{i}").into_bytes())
                .await
                .unwrap();
        }
        drop(s);
        let jpath = t.path().join(JOURNAL);
        let mut bytes = fs::read(&jpath).unwrap();
        let e = entry_len("k0", b"value-0");
        // Flip a byte inside entry #1's value.
        bytes[e + e - 2] ^= 0xFF;
        fs::write(&jpath, &bytes).unwrap();

        let l = reopen(t.path());
        assert!(!l.problems.is_empty());
        let q = quarantine_files(t.path());
        assert_eq!(q.len(), 1, "{q:?}");
        assert!(q[0].starts_with("journal-"));
        assert_eq!(
            fs::read(t.path().join(QUARANTINE).join(&q[0])).unwrap(),
            bytes
        );
        assert!(!l.records.contains_key("k1"));
        for k in ["k0", "k2", "k3", "k4"] {
            assert!(l.records.contains_key(k), "{k} missing");
        }
        // The store was rewritten clean.
        let l2 = reopen(t.path());
        assert!(l2.problems.is_empty());
        assert_eq!(l2.records, l.records);
        assert_eq!(fs::metadata(&jpath).unwrap().len(), 0);
    }

    #[tokio::test]
    async fn corrupt_snapshot_is_quarantined() {
        let t = TempDir::new("snap");
        let (s, _) = open(t.path());
        for i in 0..5 {
            s.put(&format!("k{i}"), format!("value-{i}").into_bytes())
                .await
                .unwrap();
        }
        s.compact().await.unwrap();
        s.put("after", b"journal".to_vec()).await.unwrap();
        drop(s);
        let spath = t.path().join(SNAPSHOT);
        let mut bytes = fs::read(&spath).unwrap();
        let header = entry_len("", &[0; 8]);
        let e = entry_len("k0", b"value-0");
        // Damage record k2.
        bytes[header + 2 * e + 15] ^= 0x01;
        fs::write(&spath, &bytes).unwrap();

        let l = reopen(t.path());
        assert_eq!(l.problems.len(), 1, "{:?}", l.problems);
        let q = quarantine_files(t.path());
        assert!(q.len() == 1 && q[0].starts_with("snapshot-"), "{q:?}");
        assert!(!l.records.contains_key("k2"));
        assert_eq!(l.records.len(), 5);
        assert_eq!(l.records["after"], b"journal");
        let l2 = reopen(t.path());
        assert!(l2.problems.is_empty());
        assert_eq!(l2.records, l.records);
    }

    #[tokio::test]
    async fn truncated_snapshot_detected_by_count() {
        let t = TempDir::new("snapcount");
        let (s, _) = open(t.path());
        s.put("a", b"1".to_vec()).await.unwrap();
        s.put("b", b"2".to_vec()).await.unwrap();
        s.compact().await.unwrap();
        drop(s);
        let spath = t.path().join(SNAPSHOT);
        let bytes = fs::read(&spath).unwrap();
        fs::write(&spath, &bytes[..bytes.len() - entry_len("b", b"2")]).unwrap();
        let l = reopen(t.path());
        assert_eq!(l.problems.len(), 1);
        assert_eq!(l.records.len(), 1);
    }

    #[tokio::test]
    async fn crash_between_snapshot_rename_and_journal_truncate() {
        let t = TempDir::new("crash");
        let jpath = t.path().join(JOURNAL);
        let (s, _) = open(t.path());
        s.put("a", b"old".to_vec()).await.unwrap();
        s.put("b", b"old".to_vec()).await.unwrap();
        let old_journal = fs::read(&jpath).unwrap();
        s.delete("b").await.unwrap();
        s.put("a", b"new".to_vec()).await.unwrap();
        s.compact().await.unwrap();
        assert_eq!(s.stats().journal_bytes, 0);
        drop(s);
        assert_eq!(fs::metadata(&jpath).unwrap().len(), 0);
        // Simulate the lost truncate: stale, lower-seq entries reappear.
        fs::write(&jpath, &old_journal).unwrap();
        let l = reopen(t.path());
        assert!(l.problems.is_empty());
        assert_eq!(l.records.len(), 1);
        assert_eq!(l.records["a"], b"new");
        // New writes get higher seqs than the stale entries and survive.
        let (s, _) = open(t.path());
        s.put("c", b"c".to_vec()).await.unwrap();
        drop(s);
        let l = reopen(t.path());
        assert_eq!(l.records["a"], b"new");
        assert_eq!(l.records["c"], b"c");
        assert!(!l.records.contains_key("b"));
    }

    #[test]
    fn group_commit_shares_fsyncs() {
        let t = TempDir::new("group");
        let (s, _) = open(t.path());
        let s = Arc::new(s);
        // Current-thread runtime: all 64 tasks enqueue before any waits.
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            let handles: Vec<_> = (0..64)
                .map(|i| {
                    let s = Arc::clone(&s);
                    tokio::spawn(async move { s.put(&format!("k{i}"), vec![0; 500]).await })
                })
                .collect();
            for h in handles {
                h.await.unwrap().unwrap();
            }
        });
        let st = s.stats();
        assert_eq!(st.ops, 64);
        assert!(st.commits < 64, "{st:?}");
        drop(s);
        assert_eq!(reopen(t.path()).records.len(), 64);
    }

    #[tokio::test]
    async fn compaction_triggers_and_survives_reopen() {
        let t = TempDir::new("compact");
        let (s, _) = Store::open_with(
            t.path(),
            Options {
                compact_bytes: 4096,
            },
        )
        .unwrap();
        for i in 0..200 {
            s.put(&format!("k{}", i % 20), vec![i as u8; 100])
                .await
                .unwrap();
        }
        s.delete("k0").await.unwrap();
        let st = s.stats();
        assert!(st.compactions >= 1, "{st:?}");
        let snap_len = fs::metadata(t.path().join(SNAPSHOT)).unwrap().len();
        assert!(st.journal_bytes <= 4096.max(4 * snap_len) + 200, "{st:?}");
        drop(s);
        let l = reopen(t.path());
        assert!(l.problems.is_empty());
        assert_eq!(l.records.len(), 19);
        for j in 1..20 {
            // Last write to key k{j} was i = 180 + j.
            assert_eq!(l.records[&format!("k{j}")], vec![(180 + j) as u8; 100]);
        }
    }

    #[tokio::test]
    async fn quarantine_record_moves_value_aside() {
        let t = TempDir::new("qrec");
        let (s, _) = open(t.path());
        s.put("sb/../evil", b"{bad json".to_vec()).await.unwrap();
        s.put("good", b"{}".to_vec()).await.unwrap();
        s.quarantine_record("sb/../evil", b"{bad json", "unparseable JSON")
            .await
            .unwrap();
        s.quarantine_record("sb/../evil", b"again", "twice")
            .await
            .unwrap();
        drop(s);
        let q = quarantine_files(t.path());
        assert_eq!(q.len(), 4, "{q:?}");
        let rec = q.iter().find(|n| n.ends_with(".rec")).unwrap();
        assert!(rec.starts_with("sb_.._evil-"), "{rec}");
        let qdir = t.path().join(QUARANTINE);
        let recs: Vec<Vec<u8>> = q
            .iter()
            .filter(|n| n.ends_with(".rec"))
            .map(|n| fs::read(qdir.join(n)).unwrap())
            .collect();
        assert!(recs.contains(&b"{bad json".to_vec()));
        let why = fs::read_to_string(qdir.join(rec.replace(".rec", ".why"))).unwrap();
        assert!(why.contains("reason:"));
        let l = reopen(t.path());
        assert_eq!(l.records.keys().collect::<Vec<_>>(), ["good"]);
    }

    #[tokio::test]
    async fn closed_store_and_stats() {
        let t = TempDir::new("stats");
        let (s, _) = open(t.path());
        s.put("a", b"1".to_vec()).await.unwrap();
        let st = s.stats();
        assert_eq!((st.commits, st.ops), (1, 1));
        assert_eq!(st.journal_bytes, entry_len("a", b"1") as u64);
    }

    /// `cargo test --release -- --ignored --nocapture bench_`
    #[test]
    #[ignore]
    fn bench_latency_and_throughput() {
        let t = TempDir::new("bench");
        let (s, _) = open(t.path());
        let s = Arc::new(s);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            let value = vec![b'j'; 500];
            let mut lat = Vec::with_capacity(1000);
            for i in 0..1000 {
                let start = Instant::now();
                s.put(&format!("seq-{i}"), value.clone()).await.unwrap();
                lat.push(start.elapsed());
            }
            lat.sort();
            println!(
                "sequential put latency: p50 {:?}, p99 {:?}, max {:?}",
                lat[500], lat[990], lat[999]
            );

            let before = s.stats();
            let deadline = Instant::now() + Duration::from_secs(2);
            let handles: Vec<_> = (0..16)
                .map(|task| {
                    let s = Arc::clone(&s);
                    let value = value.clone();
                    tokio::spawn(async move {
                        let mut n = 0u64;
                        while Instant::now() < deadline {
                            s.put(&format!("c-{task}-{}", n % 500), value.clone())
                                .await
                                .unwrap();
                            n += 1;
                        }
                        n
                    })
                })
                .collect();
            let mut total = 0;
            for h in handles {
                total += h.await.unwrap();
            }
            let after = s.stats();
            println!(
                "16 concurrent putters, 2 s: {total} puts ({:.0}/s), {} fsync batches, {} compactions",
                total as f64 / 2.0,
                after.commits - before.commits,
                after.compactions - before.compactions
            );
            // Top up to 10,000 records for the reopen measurement.
            let fill: Vec<_> = (0..1000)
                .map(|i| {
                    let s = Arc::clone(&s);
                    let value = value.clone();
                    tokio::spawn(async move { s.put(&format!("fill-{i}"), value).await })
                })
                .collect();
            for h in fill {
                h.await.unwrap().unwrap();
            }
        });
        drop(s);
        let start = Instant::now();
        let (s, l) = open(t.path());
        let took = start.elapsed();
        println!(
            "reopen: {} records in {took:?} (journal {} bytes)",
            l.records.len(),
            s.stats().journal_bytes
        );
    }
}
