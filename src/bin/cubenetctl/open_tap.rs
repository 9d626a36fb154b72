//! `cubenetctl open-tap ID -- COMMAND...`: OpenTap, then exec COMMAND with
//! the TAP on fd 3 (after `main` closed the bus connection).

use std::ffi::CString;
use std::os::fd::{AsRawFd, BorrowedFd, IntoRawFd, OwnedFd};

use crate::dbus::Agent;
use crate::failure::{EXIT_AGENT, Failure, Outcome, Res};

/// The fd number `open-tap` hands the TAP to its command on.
const TAP_FD: i32 = 3;

pub async fn run(agent: &Agent, id: &str, argv: Vec<String>) -> Res<Outcome> {
    let fd: zbus::zvariant::OwnedFd = agent.call("OpenTap", &(id,)).await?;
    Ok(Outcome::Exec(OwnedFd::from(fd), argv))
}

/// Puts `tap` on fd 3 (without CLOEXEC) and execs `argv`; returns only on
/// failure, with the exit code to use.
pub fn exec_with_tap(tap: OwnedFd, argv: &[String]) -> Failure {
    let cargs: Result<Vec<CString>, _> = argv.iter().map(|a| CString::new(a.as_bytes())).collect();
    let Ok(cargs) = cargs else {
        return Failure::usage("open-tap: an argument contains a NUL byte");
    };
    if tap.as_raw_fd() == TAP_FD {
        // Already in place: keep it open across the exec.
        let _ = tap.into_raw_fd();
    } else {
        // SAFETY: dup2 on a valid open fd; fd 3, if open, is nothing we still
        // use (the bus connection is closed), and dup2 replaces it atomically.
        let r = unsafe { libc::dup2(tap.as_raw_fd(), TAP_FD) };
        if r < 0 {
            return Failure::new(
                EXIT_AGENT,
                format!(
                    "open-tap: dup2 to fd {TAP_FD}: {}",
                    std::io::Error::last_os_error()
                ),
            );
        }
        drop(tap);
    }
    // SAFETY: fd 3 was just made valid above and stays open until the exec.
    let fd3 = unsafe { BorrowedFd::borrow_raw(TAP_FD) };
    if let Err(e) = nix::fcntl::fcntl(
        fd3,
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
    ) {
        return Failure::new(
            EXIT_AGENT,
            format!("open-tap: clearing FD_CLOEXEC on fd {TAP_FD}: {e}"),
        );
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
