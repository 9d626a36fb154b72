//! Thin, typed wrapper around `rtnetlink` (NETLINK_ROUTE) for the operations the
//! network agent needs: listing / renaming / deleting links (including batch
//! deletion by link group), creating the pool gateway device, permanent
//! neighbour entries, and a few read-only queries (addresses, routes, the
//! default uplink).
//!
//! Every kernel operation is logged with `tracing::debug!`. Errors carry the
//! action that failed plus the underlying [`rtnetlink::Error`]; use
//! [`NetlinkError::errno`] to inspect the kernel errno.
//!
//! [`Netlink::new`] runs the socket on a thread of its own (`netlink`): a
//! request to NETLINK_ROUTE does its kernel work, RTNL lock included, inside
//! the `sendmsg` of the sender, so that call must not run on the async
//! workers that serve the bus (a slow or contended RTNL would stall every
//! caller). The thread inherits, and the socket lives in, the network
//! namespace of the *thread* that calls `new`; it ends when the last handle
//! is dropped. The requests on the hot path of EnsureNetwork and
//! ReleaseNetwork also come in a blocking form (`*_now`, [`request`]) that
//! the blocking thread doing the rest of a call's kernel work sends itself,
//! instead of a hop to that thread per request.

use std::net::{IpAddr, Ipv4Addr};

use rtnetlink::Handle;
use tracing::debug;

/// Errors from netlink operations. Each variant names the action that failed.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("failed to open NETLINK_ROUTE socket")]
    Connect(#[source] std::io::Error),
    #[error("Netlink::new called outside a tokio runtime")]
    NoRuntime,
    #[error("failed to dump {what}")]
    Dump {
        what: &'static str,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("failed to dump {what}")]
    RawDump {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to get link {what}")]
    LinkGet {
        what: String,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("failed to set link {index}")]
    LinkSet {
        index: u32,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("failed to delete link {index}")]
    LinkDel {
        index: u32,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("failed to create veth {host} (peer {peer} in the container's namespace)")]
    VethAdd {
        host: String,
        peer: String,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("veth {name} vanished right after creation")]
    VethMissing { name: String },
    #[error("refusing to delete link group 0 (the default group of every link)")]
    GroupZero,
    #[error("failed to delete link group {group}")]
    GroupDel {
        group: u32,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("failed to create gateway device {name}")]
    GatewayCreate {
        name: String,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("gateway device {name} vanished right after creation")]
    GatewayMissing { name: String },
    #[error("failed to add address {addr}/{prefix_len} to link {index}")]
    AddrAdd {
        index: u32,
        addr: IpAddr,
        prefix_len: u8,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("failed to add the default route via {gateway} on link {oif}")]
    RouteAdd {
        gateway: Ipv4Addr,
        oif: u32,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("failed to add the route to {dest}/{prefix_len} on link {oif}")]
    Route6Add {
        dest: std::net::Ipv6Addr,
        prefix_len: u8,
        oif: u32,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("failed to add neighbour {ip} on link {ifindex}")]
    NeighAdd {
        ifindex: u32,
        ip: IpAddr,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("failed to delete neighbour {ip} on link {ifindex}")]
    NeighDel {
        ifindex: u32,
        ip: IpAddr,
        #[source]
        source: rtnetlink::Error,
    },
}

impl NetlinkError {
    /// The kernel errno (positive, e.g. `libc::ENODEV`) if the kernel rejected the request.
    pub fn errno(&self) -> Option<i32> {
        use std::error::Error as _;
        self.source()
            .and_then(|s| s.downcast_ref::<rtnetlink::Error>())
            .and_then(errno_of)
    }
}

/// Positive errno carried by a netlink error reply, if any.
fn errno_of(e: &rtnetlink::Error) -> Option<i32> {
    match e {
        rtnetlink::Error::NetlinkError(m) => m.code.map(|c| -c.get()),
        _ => None,
    }
}

fn is_errno(e: &rtnetlink::Error, errno: i32) -> bool {
    errno_of(e) == Some(errno)
}

mod addr;
mod link;
mod neigh;
mod raw;
mod request;
mod route;
mod watch;

pub use link::{LinkChange, LinkCounters, LinkInfo};
pub use raw::{link_counters_dump, link_dump, link_exists};
pub use watch::{
    LinkEvent, TcHook, TcRemoval, watch_addrs, watch_ipv6_addrs_and_routes, watch_links,
    watch_tc_removals,
};

/// Cheaply clonable handle to a NETLINK_ROUTE connection.
///
/// A NETLINK_ROUTE socket runs one dump at a time: a second dump started
/// while one is in progress fails with EBUSY. Every dump therefore takes
/// `dumps` first, so concurrent callers (Reconcile next to Reconcile,
/// Health next to recovery) wait instead of failing.
#[derive(Clone)]
pub struct Netlink {
    handle: Handle,
    dumps: std::sync::Arc<tokio::sync::Mutex<()>>,
    /// Blocking requests made by the calling thread (see [`request`]).
    requests: std::sync::Arc<request::Requests>,
}

impl Netlink {
    /// Opens a NETLINK_ROUTE socket served by a thread of its own (see the
    /// module documentation), in the calling thread's network namespace.
    pub fn new() -> Result<Self, NetlinkError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name("netlink".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_io()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                rt.block_on(async move {
                    match rtnetlink::new_connection() {
                        Ok((conn, handle, messages)) => {
                            let _ = tx.send(Ok(handle));
                            // The connection ends once every handle is gone
                            // *and* nobody takes unsolicited messages: kept,
                            // this receiver would keep the thread forever.
                            drop(messages);
                            conn.await;
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e));
                        }
                    }
                });
            })
            .map_err(NetlinkError::Connect)?;
        let handle = rx
            .recv()
            .map_err(|_| NetlinkError::Connect(std::io::Error::other("netlink thread died")))?
            .map_err(NetlinkError::Connect)?;
        let requests = request::Requests::new().map_err(NetlinkError::Connect)?;
        debug!("netlink connection opened");
        Ok(Self {
            handle,
            dumps: Default::default(),
            requests: std::sync::Arc::new(requests),
        })
    }
}

#[cfg(test)]
mod tests {

    /// Thread ids of this process named `name`.
    fn threads_named(name: &str) -> std::collections::BTreeSet<String> {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| {
                let t = t.ok()?;
                let comm = std::fs::read_to_string(t.path().join("comm")).ok()?;
                (comm.trim() == name).then(|| t.file_name().to_string_lossy().into_owned())
            })
            .collect()
    }

    #[test]
    fn a_connection_thread_ends_with_its_last_handle() {
        // Other tests of this binary may hold connections: follow ours.
        let before = threads_named("netlink");
        let nl = super::Netlink::new().unwrap();
        let second = nl.clone();
        let ours: Vec<String> = threads_named("netlink")
            .difference(&before)
            .cloned()
            .collect();
        assert!(!ours.is_empty(), "no netlink thread was started");
        drop(nl);
        drop(second);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while ours
            .iter()
            .any(|tid| std::path::Path::new("/proc/self/task").join(tid).exists())
        {
            assert!(
                std::time::Instant::now() < deadline,
                "the netlink thread outlived its handles"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    use super::*;
    use rtnetlink::LinkVeth;
    use rtnetlink::{LinkBridge, LinkMessageBuilder};
    use std::future::Future;

    /// Runs `body` on a dedicated thread inside a fresh, empty network namespace
    /// (unshare(CLONE_NEWNET) affects only that thread), with `lo` up and a
    /// current-thread tokio runtime. The namespace dies with the thread, so cleanup
    /// happens even if the body panics; the panic is propagated via `join`.
    pub(super) fn in_netns<F, Fut>(test: &str, body: F)
    where
        F: FnOnce(Netlink) -> Fut + Send + 'static,
        Fut: Future<Output = ()>,
    {
        // (`nix::unistd::geteuid` needs nix's "user" feature, which we don't enable.)
        // SAFETY: geteuid() has no preconditions, cannot fail and touches no memory.
        let euid = unsafe { libc::geteuid() };
        if euid != 0 {
            // The tests' rule (tests/common/mod.rs): never a silent skip in CI.
            let ci =
                std::env::var_os("CI").is_some_and(|v| !v.is_empty() && v != "0" && v != "false");
            assert!(!ci, "{test} needs root; CI must run as root");
            eprintln!("SKIPPED {test}: needs root to unshare a network namespace");
            return;
        }
        let res = std::thread::spawn(move || {
            // Equivalent to `nix::sched::unshare(CloneFlags::CLONE_NEWNET)`, but via libc
            // because the daemon's nix dependency does not enable the "sched" feature.
            // SAFETY: unshare() only takes an integer flag set and affects just this thread.
            let rc = unsafe { libc::unshare(libc::CLONE_NEWNET) };
            assert_eq!(
                rc,
                0,
                "unshare(CLONE_NEWNET): {}",
                std::io::Error::last_os_error()
            );
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime");
            rt.block_on(async move {
                let nl = Netlink::new().expect("netlink socket");
                let links = nl.list_links().await.expect("list links");
                // Guard: we must be in a brand-new namespace, never the host's.
                assert_eq!(links.len(), 1, "fresh netns should only have lo: {links:?}");
                assert_eq!(links[0].name, "lo");
                nl.set_link(links[0].index, up(true)).await.expect("lo up");
                body(nl).await;
            });
        })
        .join();
        if let Err(panic) = res {
            std::panic::resume_unwind(panic);
        }
    }

    pub(super) fn up(on: bool) -> LinkChange {
        LinkChange {
            up: Some(on),
            ..Default::default()
        }
    }

    pub(super) async fn add_bridge(nl: &Netlink, name: &str, group: u32) -> u32 {
        nl.handle
            .link()
            .add(
                LinkMessageBuilder::<LinkBridge>::new(name) // created down
                    .link_group(group)
                    .build(),
            )
            .execute()
            .await
            .expect("add bridge");
        nl.link_by_name(name)
            .await
            .expect("get bridge")
            .expect("bridge exists")
            .index
    }

    pub(super) async fn add_veth(nl: &Netlink, name: &str, peer: &str) -> u32 {
        nl.handle
            .link()
            .add(LinkVeth::new(name, peer).build())
            .execute()
            .await
            .expect("add veth");
        for n in [name, peer] {
            let l = nl.link_by_name(n).await.expect("get").expect("exists");
            nl.set_link(l.index, up(true)).await.expect("veth up");
        }
        nl.link_by_name(name)
            .await
            .expect("get")
            .expect("exists")
            .index
    }
}
