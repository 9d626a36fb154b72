//! `cubenetctl open-tap ID... -- COMMAND...`: OpenTap for each network,
//! then exec COMMAND with the TAPs on fds 3, 4, ... in order (after `main`
//! closed the bus connection).

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, IntoRawFd, OwnedFd};

use crate::dbus::Agent;
use crate::failure::{EXIT_AGENT, Failure, Outcome, Res};

/// The fd number `open-tap` hands the first TAP to its command on.
const FIRST_TAP_FD: i32 = 3;

pub async fn run(agent: &Agent, ids: &[String], argv: Vec<String>) -> Res<Outcome> {
    let mut fds = Vec::with_capacity(ids.len());
    for id in ids {
        let fd: zbus::zvariant::OwnedFd = agent.call("OpenTap", &(id,)).await?;
        fds.push(OwnedFd::from(fd));
    }
    Ok(Outcome::Exec(fds, argv))
}

/// Puts `taps` on fds 3, 4, ... (without CLOEXEC) and execs `argv`;
/// returns only on failure, with the exit code to use.
pub fn exec_with_taps(taps: Vec<OwnedFd>, argv: &[String]) -> Failure {
    let cargs: Result<Vec<CString>, _> = argv.iter().map(|a| CString::new(a.as_bytes())).collect();
    let Ok(cargs) = cargs else {
        return Failure::usage("open-tap: an argument contains a NUL byte");
    };
    let fail = |what: String, e: &dyn std::fmt::Display| {
        Failure::new(EXIT_AGENT, format!("open-tap: {what}: {e}"))
    };
    // First out of the way (above every target, close-on-exec), so no
    // dup2 below replaces a TAP still to be placed.
    let top = FIRST_TAP_FD + taps.len() as i32;
    let mut high = Vec::with_capacity(taps.len());
    for tap in taps {
        match nix::fcntl::fcntl(tap.as_fd(), nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(top)) {
            // SAFETY: F_DUPFD_CLOEXEC returned a new fd that nothing else owns.
            Ok(fd) => high.push(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) }),
            Err(e) => return fail("duplicating a TAP fd".into(), &e),
        }
    }
    for (i, tap) in high.iter().enumerate() {
        let target = FIRST_TAP_FD + i as i32;
        // SAFETY: dup2 on a valid open fd; `target`, if open, is nothing we
        // still use (the bus connection is closed, the TAPs are above
        // `top`), and dup2 replaces it atomically. The new fd has no
        // FD_CLOEXEC, so the command inherits it.
        if unsafe { libc::dup2(tap.as_raw_fd(), target) } < 0 {
            return fail(
                format!("dup2 to fd {target}"),
                &std::io::Error::last_os_error(),
            );
        }
        // SAFETY: `target` was just made valid above and stays open until
        // the exec.
        let fd = unsafe { BorrowedFd::borrow_raw(target) };
        if let Err(e) = nix::fcntl::fcntl(
            fd,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
        ) {
            return fail(format!("clearing FD_CLOEXEC on fd {target}"), &e);
        }
    }
    // The high copies are close-on-exec; the placed ones stay.
    for fd in high {
        let _ = fd.into_raw_fd();
    }
    // Rust's runtime ignores SIGPIPE; the command should get the default back.
    // SAFETY: restoring the default disposition installs no Rust handler.
    let _ = unsafe {
        nix::sys::signal::signal(
            nix::sys::signal::Signal::SIGPIPE,
            nix::sys::signal::SigHandler::SigDfl,
        )
    };
    let err = match nix::unistd::execvp(&cargs[0], &cargs) {
        Err(e) => e,
        Ok(never) => match never {},
    };
    Failure::new(
        if err == nix::errno::Errno::ENOENT {
            127
        } else {
            126
        },
        format!("{}: {}", argv[0], err.desc()),
    )
}
