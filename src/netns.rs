//! Network namespace fds passed by callers (CNI attachments): checked to
//! be a network namespace, and not the agent's own, before the kernel is
//! asked to create anything in them. The agent never enters one.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;

use crate::types::{NetnsFd, NetnsId};

/// A caller's namespace fd with the namespace it names (what records and
/// ownership checks compare). Whether it is a network namespace, and not
/// the node's, is [`check_foreign_netns`]'s question.
pub fn netns_fd(fd: OwnedFd) -> Result<NetnsFd, String> {
    let (dev, ino) = stat_fd(fd.as_fd())?;
    Ok(NetnsFd {
        fd: std::sync::Arc::new(fd),
        id: NetnsId { dev, ino },
    })
}

/// `NS_GET_NSTYPE` from linux/nsfs.h: `_IO(0xb7, 0x3)`.
const NS_GET_NSTYPE: libc::c_ulong = 0xb703;

/// Why a namespace fd cannot be used, or Ok.
pub fn check_foreign_netns(fd: BorrowedFd<'_>) -> Result<(), String> {
    // SAFETY: NS_GET_NSTYPE takes no argument and only reads the fd, which
    // is valid for the duration of the borrow.
    let kind = unsafe { libc::ioctl(fd.as_raw_fd(), NS_GET_NSTYPE as _) };
    if kind < 0 {
        return Err(format!(
            "not a namespace file ({})",
            std::io::Error::last_os_error()
        ));
    }
    if kind != libc::CLONE_NEWNET {
        return Err(format!(
            "a namespace of another type (0x{kind:x}), not a network namespace"
        ));
    }
    if stat_fd(fd)? == own_netns()? {
        return Err(
            "is the node's own network namespace; a container's interface must live in its own"
                .into(),
        );
    }
    Ok(())
}

/// The agent's own network namespace (device, inode), read once: a
/// process's namespace does not change under it.
fn own_netns() -> Result<(u64, u64), String> {
    static OWN: std::sync::OnceLock<Result<(u64, u64), String>> = std::sync::OnceLock::new();
    OWN.get_or_init(|| {
        std::fs::metadata("/proc/self/ns/net")
            .map(|m| (m.dev(), m.ino()))
            .map_err(|e| format!("cannot stat the agent's own namespace: {e}"))
    })
    .clone()
}

fn stat_fd(fd: BorrowedFd<'_>) -> Result<(u64, u64), String> {
    let st = nix::sys::stat::fstat(fd).map_err(|e| format!("fstat: {e}"))?;
    Ok((st.st_dev, st.st_ino))
}
