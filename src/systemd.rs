//! The systemd protocols the agent speaks, with no libsystemd dependency:
//! `sd_notify` datagrams (READY=1, STATUS=, STOPPING=1, WATCHDOG=1,
//! EXTEND_TIMEOUT_USEC=), the fd store (FDSTORE=1 with the fd attached as
//! SCM_RIGHTS, FDSTOREREMOVE=1), and the fds systemd passes at start
//! (`LISTEN_PID`/`LISTEN_FDS`/`LISTEN_FDNAMES`: activation sockets and the
//! fd store's content). Without `$NOTIFY_SOCKET` (not started by systemd)
//! notifications are no-ops.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::time::Duration;

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

/// Sends one notification, with `fds` attached; Ok(false) when there is
/// no `$NOTIFY_SOCKET`. The send never blocks: while the manager's queue is
/// full (EAGAIN) it is retried for up to `budget`, then given up.
pub fn notify_with_fds_within(
    state: &str,
    fds: &[BorrowedFd<'_>],
    budget: Duration,
) -> io::Result<bool> {
    let Some(addr) = notify_addr() else {
        return Ok(false);
    };
    let sock = UnixDatagram::unbound()?;
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let iov = [io::IoSlice::new(state.as_bytes())];
    let cmsgs = [ControlMessage::ScmRights(&raw)];
    let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &cmsgs };
    let deadline = std::time::Instant::now() + budget;
    loop {
        match sendmsg(
            sock.as_raw_fd(),
            &iov,
            cmsgs,
            MsgFlags::MSG_DONTWAIT,
            Some(&addr),
        ) {
            Ok(_) => return Ok(true),
            Err(nix::errno::Errno::EAGAIN) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// [`notify_with_fds_within`] with a short budget (fd store traffic).
pub fn notify_with_fds(state: &str, fds: &[BorrowedFd<'_>]) -> io::Result<bool> {
    notify_with_fds_within(state, fds, Duration::from_millis(100))
}

/// Sends one state notification (READY=1, STATUS=, ...), waiting up to 5 s
/// for room in the manager's queue; returns whether it was sent.
pub fn notify(state: &str) -> bool {
    notify_with_fds_within(state, &[], Duration::from_secs(5)).unwrap_or(false)
}

/// The fd-store name of a TAP. Names must be unique per TAP so that one
/// can be removed alone; the ifindex is (the device is identified again
/// by TUNGETIFF on restart, so a rename does not matter).
pub fn tap_fd_name(ifindex: u32) -> String {
    format!("tap-{ifindex}")
}

/// Pushes a TAP fd into the service manager's fd store.
pub fn store_tap_fd(ifindex: u32, fd: BorrowedFd<'_>) -> io::Result<bool> {
    notify_with_fds(
        &format!("FDSTORE=1\nFDNAME={}", tap_fd_name(ifindex)),
        &[fd],
    )
}

/// Drops a TAP fd from the fd store (the TAP is being deleted).
pub fn remove_tap_fd(ifindex: u32) -> bool {
    notify_with_fds(
        &format!("FDSTOREREMOVE=1\nFDNAME={}", tap_fd_name(ifindex)),
        &[],
    )
    .unwrap_or(false)
}

/// One fd passed by systemd, with its name ("unknown" when unnamed).
#[derive(Debug)]
pub struct ListenFd {
    pub fd: OwnedFd,
    pub name: String,
}

const SD_LISTEN_FDS_START: RawFd = 3;

/// Takes the fds systemd passed (once; the variables are removed so child
/// processes do not inherit them). Empty when none were passed to us.
pub fn take_listen_fds() -> Vec<ListenFd> {
    let pid_ok = std::env::var("LISTEN_PID")
        .ok()
        .and_then(|p| p.parse::<u32>().ok())
        .is_some_and(|p| p == std::process::id());
    let count: RawFd = std::env::var("LISTEN_FDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let names: Vec<String> = std::env::var("LISTEN_FDNAMES")
        .map(|n| n.split(':').map(str::to_owned).collect())
        .unwrap_or_default();
    // SAFETY: called at start-up, before any other thread reads or writes
    // the environment.
    unsafe {
        std::env::remove_var("LISTEN_PID");
        std::env::remove_var("LISTEN_FDS");
        std::env::remove_var("LISTEN_FDNAMES");
    }
    if !pid_ok || count <= 0 {
        return vec![];
    }
    (0..count)
        .map(|i| {
            let raw = SD_LISTEN_FDS_START + i;
            // SAFETY: systemd passed fds SD_LISTEN_FDS_START.. to this
            // process (LISTEN_PID matched) and nothing else owns them.
            let fd = unsafe { OwnedFd::from_raw_fd(raw) };
            let _ = nix::fcntl::fcntl(
                &fd,
                nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
            );
            ListenFd {
                fd,
                name: names
                    .get(i as usize)
                    .cloned()
                    .unwrap_or_else(|| "unknown".into()),
            }
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
        // SAFETY: as above.
        unsafe { std::env::remove_var("NOTIFY_SOCKET") };
        assert!(!notify("READY=1"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
