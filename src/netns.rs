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

/// Namespace ids (RTM_NEWNSID/RTM_GETNSID, linux/net_namespace.h): the
/// node's namespace numbers each peer namespace it knows of, and an id
/// lives exactly as long as that namespace. The agent records the id of a
/// CNI attachment's namespace; when the id is gone, so is the namespace
/// (docs/cni.md, "A container gone without a DEL"). Requests on a
/// NETLINK_ROUTE socket of their own, blocking (callers run them off the
/// async workers).
pub mod nsid {
    use std::collections::BTreeSet;
    use std::io;
    use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

    const RTM_NEWNSID: u16 = 88;
    const RTM_GETNSID: u16 = 90;
    const NETNSA_NSID: u16 = 1;
    const NETNSA_FD: u16 = 3;
    const NLMSG_ERROR: u16 = 2;
    const NLMSG_DONE: u16 = 3;
    /// `NETNSA_NSID_NOT_ASSIGNED`.
    const NOT_ASSIGNED: i32 = -1;

    fn socket() -> io::Result<OwnedFd> {
        // SAFETY: plain socket(2); the result is checked before use.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_ROUTE,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a new descriptor nobody else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// A message of an answer: its type and its attributes (type, payload).
    type Msg = (u16, Vec<(u16, Vec<u8>)>);

    /// One request (`attrs`: type, payload) and every message of its
    /// answer, an error as io::Error.
    fn request(kind: u16, flags: u16, attrs: &[(u16, [u8; 4])]) -> io::Result<Vec<Msg>> {
        let sock = socket()?;
        let mut msg = vec![0u8; 20];
        for (t, v) in attrs {
            msg.extend_from_slice(&8u16.to_ne_bytes());
            msg.extend_from_slice(&t.to_ne_bytes());
            msg.extend_from_slice(v);
        }
        let len = msg.len() as u32;
        msg[0..4].copy_from_slice(&len.to_ne_bytes());
        msg[4..6].copy_from_slice(&kind.to_ne_bytes());
        msg[6..8].copy_from_slice(&(flags | libc::NLM_F_REQUEST as u16).to_ne_bytes());
        msg[8..12].copy_from_slice(&1u32.to_ne_bytes());
        // msg[16] = rtgen_family AF_UNSPEC, padded to 4.
        // SAFETY: msg is a valid buffer of msg.len() bytes; the socket is
        // connected to the kernel by default (no bind needed to send).
        let sent = unsafe { libc::send(sock.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        let dump = flags & libc::NLM_F_DUMP as u16 != 0;
        let mut out = vec![];
        let mut buf = vec![0u8; 32 * 1024];
        loop {
            // SAFETY: buf is a valid, exclusively borrowed buffer.
            let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            let mut rest = &buf[..n as usize];
            while rest.len() >= 16 {
                let len = u32::from_ne_bytes(rest[0..4].try_into().unwrap()) as usize;
                let t = u16::from_ne_bytes(rest[4..6].try_into().unwrap());
                if len < 16 || len > rest.len() {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "short netlink message",
                    ));
                }
                let body = &rest[16..len];
                match t {
                    NLMSG_DONE => return Ok(out),
                    NLMSG_ERROR => {
                        let code = i32::from_ne_bytes(body[0..4].try_into().unwrap());
                        if code != 0 {
                            return Err(io::Error::from_raw_os_error(-code));
                        }
                        return Ok(out);
                    }
                    _ => {
                        let mut list = vec![];
                        let mut a = body.get(4..).unwrap_or_default();
                        while a.len() >= 4 {
                            let alen = u16::from_ne_bytes([a[0], a[1]]) as usize;
                            let at = u16::from_ne_bytes([a[2], a[3]]) & 0x3fff;
                            if alen < 4 || alen > a.len() {
                                break;
                            }
                            list.push((at, a[4..alen].to_vec()));
                            a = &a[alen.next_multiple_of(4).min(a.len())..];
                        }
                        out.push((t, list));
                        if !dump {
                            return Ok(out);
                        }
                    }
                }
                rest = &rest[len.next_multiple_of(4).min(rest.len())..];
            }
        }
    }

    fn nsid_in(msgs: &[Msg]) -> Option<i32> {
        msgs.iter()
            .filter(|(t, _)| *t == RTM_NEWNSID)
            .flat_map(|(_, attrs)| attrs)
            .find(|(t, v)| *t == NETNSA_NSID && v.len() == 4)
            .map(|(_, v)| i32::from_ne_bytes(v[..4].try_into().unwrap()))
    }

    fn get(ns: BorrowedFd<'_>) -> io::Result<Option<i32>> {
        let fd = (ns.as_raw_fd() as u32).to_ne_bytes();
        let msgs = request(RTM_GETNSID, 0, &[(NETNSA_FD, fd)])?;
        Ok(nsid_in(&msgs).filter(|id| *id != NOT_ASSIGNED))
    }

    /// The id of namespace `ns` in the caller's namespace, assigned now if
    /// it has none yet (the kernel picks the lowest free one).
    pub fn of(ns: BorrowedFd<'_>) -> io::Result<i32> {
        if let Some(id) = get(ns)? {
            return Ok(id);
        }
        let fd = (ns.as_raw_fd() as u32).to_ne_bytes();
        match request(
            RTM_NEWNSID,
            libc::NLM_F_ACK as u16,
            &[(NETNSA_FD, fd), (NETNSA_NSID, NOT_ASSIGNED.to_ne_bytes())],
        ) {
            // EEXIST: someone assigned one in between.
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => return Err(e),
        }
        get(ns)?.ok_or_else(|| io::Error::other("the kernel assigned no namespace id"))
    }

    /// Every namespace id the caller's namespace holds now.
    pub fn live() -> io::Result<BTreeSet<i32>> {
        let msgs = request(RTM_GETNSID, libc::NLM_F_DUMP as u16, &[])?;
        Ok(msgs
            .iter()
            .filter(|(t, _)| *t == RTM_NEWNSID)
            .flat_map(|(_, attrs)| attrs)
            .filter(|(t, v)| *t == NETNSA_NSID && v.len() == 4)
            .map(|(_, v)| i32::from_ne_bytes(v[..4].try_into().unwrap()))
            .collect())
    }

    #[cfg(test)]
    mod tests {
        /// Needs root: a namespace of its own gets an id, which is listed
        /// while it lives and gone once it is.
        #[test]
        fn ids_live_as_long_as_their_namespace() {
            // SAFETY: geteuid(2) cannot fail and touches no memory.
            if unsafe { libc::geteuid() } != 0 {
                eprintln!("skipped: needs root");
                return;
            }
            let name = format!("nsidt-{}", std::process::id());
            let ip = |a: &[&str]| {
                std::process::Command::new("ip")
                    .args(a)
                    .status()
                    .unwrap()
                    .success()
            };
            assert!(ip(&["netns", "add", &name]));
            let f = std::fs::File::open(format!("/run/netns/{name}")).unwrap();
            let id = super::of(std::os::fd::AsFd::as_fd(&f));
            let again = super::of(std::os::fd::AsFd::as_fd(&f));
            let live = super::live();
            drop(f);
            assert!(ip(&["netns", "del", &name]));
            let id = id.unwrap();
            assert_eq!(again.unwrap(), id);
            assert!(live.unwrap().contains(&id));
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while super::live().unwrap().contains(&id) {
                assert!(
                    std::time::Instant::now() < deadline,
                    "nsid {id} outlived its namespace"
                );
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
    }
}
