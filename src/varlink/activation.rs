//! Socket activation for the varlink socket: the `LISTEN_FDS` protocol of
//! `sd_listen_fds(3)`, reduced to what the agent needs. Only the varlink
//! listening socket is taken; any other passed fds (for example TAP fds
//! coming back from the fd store) are left alone for their owners.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;

use nix::sys::socket::{
    AddressFamily, SockType, SockaddrLike, SockaddrStorage, getsockname, getsockopt, sockopt,
};

/// `SD_LISTEN_FDS_START`.
const LISTEN_FDS_START: RawFd = 3;

/// The fd name the `.socket` unit gives the varlink socket
/// (`FileDescriptorName=varlink`).
pub const FD_NAME: &str = "varlink";

/// Which passed fds to try, best first: the one named `varlink`, then all
/// of them in order. `None` if the variables are not meant for `pid`.
fn candidates(
    pid: u32,
    listen_pid: Option<&str>,
    listen_fds: Option<&str>,
    names: Option<&str>,
) -> Option<Vec<RawFd>> {
    if listen_pid?.trim().parse::<u32>().ok()? != pid {
        return None;
    }
    let n: RawFd = listen_fds?.trim().parse().ok()?;
    if n < 1 {
        return None;
    }
    let mut out: Vec<RawFd> = vec![];
    if let Some(names) = names {
        for (i, name) in names.split(':').enumerate().take(n as usize) {
            if name == FD_NAME {
                out.push(LISTEN_FDS_START + i as RawFd);
            }
        }
    }
    for fd in LISTEN_FDS_START..LISTEN_FDS_START + n {
        if !out.contains(&fd) {
            out.push(fd);
        }
    }
    Some(out)
}

/// Whether `fd` is a listening `AF_UNIX` stream socket.
fn is_unix_listener(fd: BorrowedFd<'_>) -> bool {
    let listening = getsockopt(&fd, sockopt::AcceptConn).unwrap_or(false);
    let stream = matches!(getsockopt(&fd, sockopt::SockType), Ok(SockType::Stream));
    let unix = getsockname::<SockaddrStorage>(fd.as_raw_fd())
        .ok()
        .and_then(|a| a.family())
        == Some(AddressFamily::Unix);
    listening && stream && unix
}

/// The varlink listening socket systemd passed us, if any: the fd named
/// `varlink` when `LISTEN_FDNAMES` names one, else the first passed fd that
/// is a listening unix stream socket. Marks it close-on-exec. Reads the
/// environment without consuming it; if another part of the agent takes
/// all passed fds (`systemd::take_listen_fds`), use [`listener_from`] on
/// the one named [`FD_NAME`] instead, so the fd has a single owner.
pub fn listen_fds() -> Option<UnixListener> {
    let env = |k: &str| std::env::var(k).ok();
    let fds = candidates(
        std::process::id(),
        env("LISTEN_PID").as_deref(),
        env("LISTEN_FDS").as_deref(),
        env("LISTEN_FDNAMES").as_deref(),
    )?;
    for fd in fds {
        // SAFETY: systemd passes fds LISTEN_FDS_START..+LISTEN_FDS open for
        // the lifetime of the process; the borrow only lives for the checks.
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        if nix::fcntl::fcntl(borrowed, nix::fcntl::FcntlArg::F_GETFD).is_err() {
            continue;
        }
        if !is_unix_listener(borrowed) {
            continue;
        }
        let _ = nix::fcntl::fcntl(
            borrowed,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
        );
        // SAFETY: the fd is open (F_GETFD succeeded), is a listening unix
        // socket, and this is the only place that claims the varlink socket.
        return Some(unsafe { UnixListener::from_raw_fd(fd) });
    }
    None
}

/// An already owned passed fd as the varlink listener, if it is a
/// listening unix stream socket (otherwise it is handed back).
pub fn listener_from(fd: OwnedFd) -> Result<UnixListener, OwnedFd> {
    if is_unix_listener(fd.as_fd()) {
        Ok(UnixListener::from(fd))
    } else {
        Err(fd)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_named_fd_first_and_checks_pid() {
        assert_eq!(candidates(7, Some("8"), Some("2"), None), None);
        assert_eq!(candidates(7, None, Some("2"), None), None);
        assert_eq!(candidates(7, Some("7"), Some("0"), None), None);
        assert_eq!(candidates(7, Some("7"), Some("2"), None), Some(vec![3, 4]));
        assert_eq!(
            candidates(7, Some("7"), Some("3"), Some("tap-a:varlink:tap-b")),
            Some(vec![4, 3, 5])
        );
        assert_eq!(
            candidates(7, Some("7"), Some("1"), Some("cube-network-agent.socket")),
            Some(vec![3])
        );
    }
}
