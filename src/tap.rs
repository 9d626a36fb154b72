//! TAP devices created with the TUNSETIFF ioctl on `/dev/net/tun`.
//!
//! Every TAP is `IFF_TAP | IFF_NO_PI | IFF_VNET_HDR` with a 12-byte
//! virtio-net header (what Firecracker, Cloud Hypervisor and QEMU expect)
//! and persistent, so it outlives an agent crash together with its datapath
//! state. The agent keeps one fd per TAP for its whole life and hands out
//! duplicates of it; it never reopens a TAP by name while a VMM may hold it.
//! A TAP handed over by name gets an owner (TUNSETOWNER/TUNSETGROUP) and
//! the agent closes its fd, so the VMM can attach to the device itself.

use std::ffi::CStr;
use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;

const TUN_DEVICE: &str = "/dev/net/tun";
/// Size of `struct virtio_net_hdr_v1` without the num_buffers field.
pub const VNET_HDR_LEN: libc::c_int = 12;

const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;
/// Fail instead of attaching when a device of that name already exists.
const IFF_TUN_EXCL: libc::c_short = -0x8000; // 0x8000 as c_short
pub const TAP_FLAGS: libc::c_short = IFF_TAP | IFF_NO_PI | IFF_VNET_HDR;

const TUNSETIFF: libc::c_ulong = nix::request_code_write!(b'T', 202, size_of::<libc::c_int>()) as _;
const TUNSETPERSIST: libc::c_ulong =
    nix::request_code_write!(b'T', 203, size_of::<libc::c_int>()) as _;
const TUNSETOWNER: libc::c_ulong =
    nix::request_code_write!(b'T', 204, size_of::<libc::c_int>()) as _;
const TUNSETGROUP: libc::c_ulong =
    nix::request_code_write!(b'T', 206, size_of::<libc::c_int>()) as _;
const TUNGETIFF: libc::c_ulong = nix::request_code_read!(b'T', 210, size_of::<libc::c_uint>()) as _;
const TUNGETVNETHDRSZ: libc::c_ulong =
    nix::request_code_read!(b'T', 215, size_of::<libc::c_int>()) as _;
const TUNSETVNETHDRSZ: libc::c_ulong =
    nix::request_code_write!(b'T', 216, size_of::<libc::c_int>()) as _;

#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error("TAP name '{0}' is empty or longer than 15 bytes")]
    Name(String),
    #[error("cannot open {TUN_DEVICE}")]
    OpenTun(#[source] io::Error),
    #[error("TUNSETIFF {name}")]
    SetIff {
        name: String,
        #[source]
        source: io::Error,
    },
    #[error("TUNSETVNETHDRSZ {name}")]
    SetVnetHdr {
        name: String,
        #[source]
        source: io::Error,
    },
    #[error("TUNSETPERSIST {name}")]
    SetPersist {
        name: String,
        #[source]
        source: io::Error,
    },
    #[error("TUNSETOWNER/TUNSETGROUP {name}")]
    SetOwner {
        name: String,
        #[source]
        source: io::Error,
    },
    #[error("duplicating the fd of {name}")]
    Dup {
        name: String,
        #[source]
        source: io::Error,
    },
}

impl TapError {
    /// The errno behind the failure, if any.
    pub fn errno(&self) -> Option<i32> {
        match self {
            TapError::Name(_) => None,
            TapError::OpenTun(e) => e.raw_os_error(),
            TapError::SetIff { source, .. }
            | TapError::SetVnetHdr { source, .. }
            | TapError::SetPersist { source, .. }
            | TapError::SetOwner { source, .. }
            | TapError::Dup { source, .. } => source.raw_os_error(),
        }
    }
}

/// An open TAP device. Dropping it closes the agent's fd; the device itself
/// stays (it is persistent) until deleted over netlink.
#[derive(Debug)]
pub struct Tap {
    fd: OwnedFd,
    name: String,
}

fn ifreq_with(name: &str, flags: libc::c_short) -> Result<libc::ifreq, TapError> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains('\0') {
        return Err(TapError::Name(name.into()));
    }
    // SAFETY: ifreq is a plain C struct for which all-zero bytes are valid.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = src as libc::c_char;
    }
    req.ifr_ifru.ifru_flags = flags;
    Ok(req)
}

fn ioctl_ifreq(
    fd: BorrowedFd<'_>,
    request: libc::c_ulong,
    req: &mut libc::ifreq,
) -> io::Result<()> {
    // SAFETY: `req` is a valid, exclusively borrowed ifreq that outlives the
    // call, and `request` is a TUN ioctl that takes a `struct ifreq *`.
    let ret = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, req as *mut libc::ifreq) };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn ioctl_set_int(fd: BorrowedFd<'_>, request: libc::c_ulong, value: libc::c_int) -> io::Result<()> {
    // SAFETY: the TUN ioctls used here read one `int` through the pointer,
    // which points at a live local.
    let ret = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, &value as *const libc::c_int) };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn ioctl_get_int(fd: BorrowedFd<'_>, request: libc::c_ulong) -> io::Result<libc::c_int> {
    let mut value: libc::c_int = 0;
    // SAFETY: the ioctl writes one `int` through the pointer to a live local.
    let ret = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, &mut value as *mut libc::c_int) };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(value)
    }
}

/// TUNSETPERSIST, TUNSETOWNER and TUNSETGROUP take their argument by
/// value, not by pointer.
fn ioctl_set_value(
    fd: BorrowedFd<'_>,
    request: libc::c_ulong,
    value: libc::c_ulong,
) -> io::Result<()> {
    // SAFETY: these TUN ioctls read their integer argument directly; no
    // memory is passed.
    let ret = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, value) };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn open_tun() -> Result<OwnedFd, TapError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(TUN_DEVICE)
        .map(OwnedFd::from)
        .map_err(TapError::OpenTun)
}

impl Tap {
    /// Creates a new persistent TAP named `name`; fails with EBUSY/EEXIST
    /// if a device of that name exists (it is never silently adopted).
    pub fn create(name: &str) -> Result<Tap, TapError> {
        let tap = Self::attach(name, TAP_FLAGS | IFF_TUN_EXCL)?;
        ioctl_set_value(tap.fd.as_fd(), TUNSETPERSIST, 1).map_err(|source| {
            TapError::SetPersist {
                name: name.into(),
                source,
            }
        })?;
        Ok(tap)
    }

    /// Re-attaches to an existing persistent TAP of ours (after a restart).
    /// Fails with EBUSY if another process holds its single queue.
    pub fn open_existing(name: &str) -> Result<Tap, TapError> {
        Self::attach(name, TAP_FLAGS)
    }

    fn attach(name: &str, flags: libc::c_short) -> Result<Tap, TapError> {
        let mut req = ifreq_with(name, flags)?;
        let fd = open_tun()?;
        ioctl_ifreq(fd.as_fd(), TUNSETIFF, &mut req).map_err(|source| TapError::SetIff {
            name: name.into(),
            source,
        })?;
        ioctl_set_int(fd.as_fd(), TUNSETVNETHDRSZ, VNET_HDR_LEN).map_err(|source| {
            TapError::SetVnetHdr {
                name: name.into(),
                source,
            }
        })?;
        Ok(Tap {
            fd,
            name: name.into(),
        })
    }

    /// Adopts an fd handed back by the service manager's fd store: it must
    /// be a TAP with a 12-byte vnet header; the device's current name is
    /// read from the kernel.
    pub fn from_fd(fd: OwnedFd) -> Result<Tap, TapError> {
        let info = query_fd(fd.as_fd()).map_err(|source| TapError::SetIff {
            name: "<inherited fd>".into(),
            source,
        })?;
        if !info.is_tap_with_vnet_hdr() || info.vnet_hdr_len != VNET_HDR_LEN {
            return Err(TapError::SetIff {
                name: info.name,
                source: io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "inherited fd is not a TAP with a 12-byte vnet header",
                ),
            });
        }
        Ok(Tap {
            fd,
            name: info.name,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Who may attach to the TAP by name besides holders of CAP_NET_ADMIN
    /// (TUNSETOWNER, and TUNSETGROUP when `gid` is given; with both the
    /// kernel requires both). The kernel refuses -1 for either (EINVAL):
    /// a group, once set, stays.
    pub fn set_owner(&self, uid: u32, gid: Option<u32>) -> Result<(), TapError> {
        let err = |source| TapError::SetOwner {
            name: self.name.clone(),
            source,
        };
        ioctl_set_value(self.fd.as_fd(), TUNSETOWNER, libc::c_ulong::from(uid)).map_err(err)?;
        match gid {
            Some(gid) => {
                ioctl_set_value(self.fd.as_fd(), TUNSETGROUP, libc::c_ulong::from(gid)).map_err(err)
            }
            None => Ok(()),
        }
    }

    /// Makes the TAP non-persistent: it goes away with its last fd (undoes
    /// [`Tap::create`] when a later step fails).
    pub fn unpersist(&self) -> Result<(), TapError> {
        ioctl_set_value(self.fd.as_fd(), TUNSETPERSIST, 0).map_err(|source| TapError::SetPersist {
            name: self.name.clone(),
            source,
        })
    }

    /// Records a rename done over netlink (the fd follows the device).
    pub fn set_name(&mut self, name: String) {
        self.name = name;
    }

    /// A fresh duplicate of the agent's fd, close-on-exec.
    pub fn dup(&self) -> Result<OwnedFd, TapError> {
        self.fd.try_clone().map_err(|source| TapError::Dup {
            name: self.name.clone(),
            source,
        })
    }

    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// What TUNGETIFF / TUNGETVNETHDRSZ report for an fd: used by callers and
/// tests to check that an fd really is the TAP they asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TapFdInfo {
    pub name: String,
    pub flags: i32,
    pub vnet_hdr_len: i32,
}

impl TapFdInfo {
    pub fn is_tap_with_vnet_hdr(&self) -> bool {
        let want = i32::from(TAP_FLAGS) & 0xffff;
        self.flags & want == want
    }
}

pub fn query_fd(fd: BorrowedFd<'_>) -> io::Result<TapFdInfo> {
    let mut req = ifreq_with("x", 0).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    ioctl_ifreq(fd, TUNGETIFF, &mut req)?;
    // SAFETY: ifr_name is a NUL-terminated array filled by the kernel (the
    // kernel always terminates it within IFNAMSIZ).
    let name = unsafe { CStr::from_ptr(req.ifr_name.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: TUNGETIFF fills ifru_flags; reading a c_short from the union is
    // valid for any bit pattern.
    let flags = i32::from(unsafe { req.ifr_ifru.ifru_flags }) & 0xffff;
    let vnet_hdr_len = ioctl_get_int(fd, TUNGETVNETHDRSZ)?;
    Ok(TapFdInfo {
        name,
        flags,
        vnet_hdr_len,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_names_beyond_ifnamsiz() {
        assert!(matches!(Tap::create(""), Err(TapError::Name(_))));
        assert!(matches!(
            Tap::create("sixteen-chars-xx"),
            Err(TapError::Name(_))
        ));
    }

    #[test]
    fn ioctl_numbers_match_linux_uapi() {
        assert_eq!(TUNSETIFF, 0x4004_54ca);
        assert_eq!(TUNSETPERSIST, 0x4004_54cb);
        assert_eq!(TUNSETOWNER, 0x4004_54cc);
        assert_eq!(TUNSETGROUP, 0x4004_54ce);
        assert_eq!(TUNGETIFF, 0x8004_54d2);
        assert_eq!(TUNGETVNETHDRSZ, 0x8004_54d7);
        assert_eq!(TUNSETVNETHDRSZ, 0x4004_54d8);
    }
}
