//! Socket activation for the varlink socket: of the fds systemd passed
//! (`systemd::take_listen_fds`, the `LISTEN_FDS` protocol parsed by the
//! sd-notify crate), the listening unix stream socket becomes the varlink
//! listener; TAP fds from the fd store go to recovery.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixListener;

use nix::sys::socket::{
    AddressFamily, SockType, SockaddrLike, SockaddrStorage, getsockname, getsockopt, sockopt,
};

/// The fd name the `.socket` unit gives the varlink socket
/// (`FileDescriptorName=varlink`).
pub const FD_NAME: &str = "varlink";

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

/// An already owned passed fd as the varlink listener, if it is a
/// listening unix stream socket (otherwise it is handed back).
pub fn listener_from(fd: OwnedFd) -> Result<UnixListener, OwnedFd> {
    if is_unix_listener(fd.as_fd()) {
        Ok(UnixListener::from(fd))
    } else {
        Err(fd)
    }
}
