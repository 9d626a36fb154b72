//! The systemd protocols the agent speaks: `sd_notify` datagrams
//! (READY=1, STATUS=, STOPPING=1, WATCHDOG=1, EXTEND_TIMEOUT_USEC=), the fd
//! store (FDSTORE=1 with the fd attached as SCM_RIGHTS, FDSTOREREMOVE=1),
//! and the fds systemd passes at start (`LISTEN_PID`/`LISTEN_FDS`/
//! `LISTEN_FDNAMES`: activation sockets and the fd store's content, parsed
//! by the `sd-notify` crate). Without `$NOTIFY_SOCKET` (not started by
//! systemd) notifications are no-ops.
//!
//! Sending is our own (sd-notify's `notify` blocks on a full queue, which
//! deadlocked the agent under load once): a notification is sent with
//! `MSG_DONTWAIT`; when systemd's queue is full (EAGAIN) it is handed, with
//! duplicates of its fds, to one background thread that retries it in
//! order, so no runtime thread ever sleeps or blocks here.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use nix::sys::socket::{ControlMessage, MsgFlags, UnixAddr, sendmsg};

fn notify_addr() -> Option<UnixAddr> {
    let path = std::env::var_os("NOTIFY_SOCKET")?;
    let bytes = path.as_encoded_bytes();
    match bytes.strip_prefix(b"@") {
        Some(name) => UnixAddr::new_abstract(name).ok(),
        None => UnixAddr::new(bytes).ok(),
    }
}

/// Whether a service manager listens for notifications.
pub fn under_service_manager() -> bool {
    std::env::var_os("NOTIFY_SOCKET").is_some()
}

/// One send attempt that never blocks.
fn send_once(addr: &UnixAddr, state: &str, fds: &[RawFd]) -> nix::Result<()> {
    let sock = UnixDatagram::unbound()
        .map_err(|e| nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)))?;
    let iov = [io::IoSlice::new(state.as_bytes())];
    let cmsgs = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &cmsgs };
    sendmsg(
        sock.as_raw_fd(),
        &iov,
        cmsgs,
        MsgFlags::MSG_DONTWAIT,
        Some(addr),
    )
    .map(|_| ())
}

/// Notifications waiting for room in systemd's queue, in order.
struct Backlog {
    queue: Mutex<Waiting>,
    wake: Condvar,
}

impl Waiting {
    /// Nothing waiting and nothing being sent.
    fn is_done(&self) -> bool {
        self.entries.is_empty() && !self.in_flight
    }
}

#[derive(Default)]
struct Waiting {
    entries: VecDeque<(String, Vec<OwnedFd>)>,
    /// The background sender owns one entry it took off the queue (its fds
    /// stay open until sent); a new notification must not overtake it.
    in_flight: bool,
}

/// How many notifications may wait; beyond that the oldest are dropped.
const BACKLOG_MAX: usize = 4096;
/// How long one waiting notification is retried.
const RETRY_FOR: Duration = Duration::from_secs(5);

static BACKLOG: std::sync::LazyLock<&'static Backlog> = std::sync::LazyLock::new(|| {
    let b: &'static Backlog = Box::leak(Box::new(Backlog {
        queue: Mutex::new(Waiting::default()),
        wake: Condvar::new(),
    }));
    std::thread::Builder::new()
        .name("sd-notify".into())
        .spawn(move || drain(b))
        .expect("spawning the notification thread");
    b
});

/// The background sender: retries the oldest waiting notification until
/// systemd takes it (or RETRY_FOR passes), then the next.
/// It takes the entry off the queue and owns it (and its fds) while it
/// sends, so nothing else can close those fds under it.
fn drain(b: &'static Backlog) {
    loop {
        let (state, fds) = {
            let mut q = b.queue.lock().unwrap_or_else(|p| p.into_inner());
            while q.entries.is_empty() {
                q = b.wake.wait(q).unwrap_or_else(|p| p.into_inner());
            }
            q.in_flight = true;
            q.entries.pop_front().expect("not empty")
        };
        let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
        let deadline = Instant::now() + RETRY_FOR;
        if let Some(addr) = notify_addr() {
            loop {
                match send_once(&addr, &state, &raw) {
                    Err(nix::errno::Errno::EAGAIN) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Ok(()) => break,
                    Err(e) => {
                        tracing::warn!(
                            notification = first_line(&state),
                            error = %e,
                            "the service manager did not take a notification; dropped"
                        );
                        break;
                    }
                }
            }
        }
        // The fds are closed here, after the send.
        drop(fds);
        b.queue.lock().unwrap_or_else(|p| p.into_inner()).in_flight = false;
    }
}

fn first_line(state: &str) -> &str {
    state.lines().next().unwrap_or("")
}

/// Sends one notification with `fds` attached; `Ok(false)` when there is
/// no `$NOTIFY_SOCKET`. Never blocks: behind earlier waiting notifications
/// or on a full queue, it waits in the backlog (with duplicates of `fds`).
pub fn notify_with_fds(state: &str, fds: &[BorrowedFd<'_>]) -> io::Result<bool> {
    let Some(addr) = notify_addr() else {
        return Ok(false);
    };
    let mut q = BACKLOG.queue.lock().unwrap_or_else(|p| p.into_inner());
    if q.is_done() {
        let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
        match send_once(&addr, state, &raw) {
            Ok(()) => return Ok(true),
            Err(nix::errno::Errno::EAGAIN) => {}
            Err(e) => return Err(e.into()),
        }
    }
    let owned = fds
        .iter()
        .map(|f| f.try_clone_to_owned())
        .collect::<io::Result<Vec<_>>>()?;
    if q.entries.len() >= BACKLOG_MAX
        && let Some((dropped, _fds)) = q.entries.pop_front()
    {
        tracing::warn!(
            notification = first_line(&dropped),
            waiting = BACKLOG_MAX,
            "the service manager is not reading notifications; dropped the oldest waiting one"
        );
    }
    q.entries.push_back((state.to_owned(), owned));
    BACKLOG.wake.notify_one();
    Ok(true)
}

/// Waits (up to `timeout`) until every queued notification went out; for
/// the last moments of the process, off the runtime.
pub fn flush(timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while !BACKLOG
        .queue
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .is_done()
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Sends one state notification (READY=1, STATUS=, ...); whether it was
/// sent or queued.
pub fn notify(state: &str) -> bool {
    notify_with_fds(state, &[]).unwrap_or(false)
}

/// The fd-store name of a TAP. Names must be unique per TAP so that one
/// can be removed alone; the ifindex is (the device is identified again
/// by TUNGETIFF on restart, so a rename does not matter).
pub fn tap_fd_name(ifindex: u32) -> String {
    format!("tap-{ifindex}")
}

/// Pushes a TAP fd into the service manager's fd store.
pub fn store_tap_fd(ifindex: u32, fd: BorrowedFd<'_>) -> io::Result<bool> {
    store_fd(&tap_fd_name(ifindex), fd)
}

/// Pushes an fd into the service manager's fd store under `name`.
pub fn store_fd(name: &str, fd: BorrowedFd<'_>) -> io::Result<bool> {
    notify_with_fds(&format!("FDSTORE=1\nFDNAME={name}"), &[fd])
}

/// Drops the fds named `name` from the fd store.
pub fn remove_fd(name: &str) -> bool {
    notify_with_fds(&format!("FDSTOREREMOVE=1\nFDNAME={name}"), &[]).unwrap_or(false)
}

/// The sockets the agent itself listens on for sandboxes (the resolver,
/// strict mode's proxy) are kept in the fd store under these names, so
/// that what arrives while the agent restarts waits in their queues.
pub const SOCKET_FD_NAMES: &[&str] = &[
    "dns-udp",
    "dns-tcp",
    "proxy-tls",
    "proxy-http",
    "dns-udp6",
    "dns-tcp6",
    "proxy-tls6",
    "proxy-http6",
];

/// Drops a TAP fd from the fd store (the TAP is being deleted).
pub fn remove_tap_fd(ifindex: u32) -> bool {
    remove_fd(&tap_fd_name(ifindex))
}

/// One fd passed by systemd, with its name ("unknown" when unnamed).
#[derive(Debug)]
pub struct ListenFd {
    pub fd: OwnedFd,
    pub name: String,
}

/// Takes the fds systemd passed (once; the variables are removed so child
/// processes do not inherit them). Empty when none were passed to us.
///
/// # Safety
/// Must be called before any other thread exists (it edits the process
/// environment).
pub unsafe fn take_listen_fds() -> Vec<ListenFd> {
    // SAFETY: the caller guarantees no other thread reads or writes the
    // environment.
    let passed = unsafe { sd_notify::listen_fds_with_names_and_unset_env() };
    let Ok(passed) = passed else {
        return vec![];
    };
    passed
        .map(|(raw, name)| ListenFd {
            // SAFETY: systemd passed these fds to this process (LISTEN_PID
            // matched, checked by sd-notify) and nothing else owns them.
            fd: unsafe { OwnedFd::from_raw_fd(raw) },
            name,
        })
        .collect()
}

/// The watchdog interval systemd asks for (`WatchdogSec=`), if any.
pub fn watchdog_interval() -> Option<Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    if let Ok(pid) = std::env::var("WATCHDOG_PID")
        && pid.parse::<u32>().ok() != Some(std::process::id())
    {
        return None;
    }
    (usec > 0).then(|| Duration::from_micros(usec))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notify_and_fd_store_reach_the_socket() {
        // One test touches the process environment, so keep it in one
        // place: a private notify socket standing in for systemd.
        let dir = std::env::temp_dir().join(format!("cna-notify-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("notify");
        let server = UnixDatagram::bind(&path).unwrap();
        // SAFETY: this is the only test that reads or writes NOTIFY_SOCKET.
        unsafe { std::env::set_var("NOTIFY_SOCKET", &path) };
        assert!(notify("READY=1\nSTATUS=hello"));
        let mut buf = [0u8; 256];
        let n = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1\nSTATUS=hello");

        let (a, _b) = UnixDatagram::pair().unwrap();
        let fd = OwnedFd::from(a);
        assert!(store_tap_fd(7, std::os::fd::AsFd::as_fd(&fd)).unwrap());
        let mut space = nix::cmsg_space!([RawFd; 1]);
        let mut iov = [io::IoSliceMut::new(&mut buf)];
        let msg = nix::sys::socket::recvmsg::<()>(
            server.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::empty(),
        )
        .unwrap();
        let mut got_fd = false;
        for c in msg.cmsgs().unwrap() {
            if let nix::sys::socket::ControlMessageOwned::ScmRights(fds) = c {
                got_fd = fds.len() == 1;
                for f in fds {
                    // SAFETY: we received this fd and own it now.
                    drop(unsafe { OwnedFd::from_raw_fd(f) });
                }
            }
        }
        let text = String::from_utf8_lossy(msg.iovs().next().unwrap()).into_owned();
        assert_eq!(text, "FDSTORE=1\nFDNAME=tap-7");
        assert!(got_fd, "the fd travels as SCM_RIGHTS");
        // A manager that does not read: its queue fills (EAGAIN), yet no
        // notify blocks, and everything arrives in order once it reads.
        let started = Instant::now();
        for i in 0..2000 {
            assert!(notify(&format!("X={i}")));
        }
        let took = started.elapsed();
        assert!(
            took < Duration::from_secs(2),
            "notifications blocked for {took:?}"
        );
        server
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        for i in 0..2000 {
            let n = server.recv(&mut buf).unwrap();
            assert_eq!(&buf[..n], format!("X={i}").as_bytes());
        }
        flush(Duration::from_secs(1));
        // SAFETY: as above.
        unsafe { std::env::remove_var("NOTIFY_SOCKET") };
        assert!(!notify("READY=1"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
