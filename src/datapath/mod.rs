//! The per-sandbox datapath behind each TAP.
//!
//! The agent core calls this seam at every state change: `attach` after a
//! TAP is configured (ensure, convergence and recovery call it; it must be
//! idempotent), `detach` before the TAP goes back to the pool, `checks` for
//! Health. The eBPF implementation (proxy ARP, SNAT, port mappings, policy)
//! plugs in here; [`NoopDatapath`] is the implementation used until it
//! exists, and stays useful as the driver for hosts that route sandboxes by
//! other means.

pub mod ebpf;
pub mod maps;
pub mod tc;

use std::net::IpAddr;

use crate::agent::spec::PortMapping;
use crate::netlink::TcHook;

/// Everything the datapath needs to know about one sandbox.
#[derive(Debug, Clone)]
pub struct SandboxPath<'a> {
    pub sandbox_id: &'a str,
    pub tap_name: &'a str,
    pub tap_ifindex: u32,
    pub sandbox_ip: IpAddr,
    pub port_mappings: &'a [PortMapping],
    pub allow_internet_access: bool,
    pub allow_out: &'a [String],
    pub deny_out: &'a [String],
}

#[derive(Debug, thiserror::Error)]
#[error("{what}: {detail}")]
pub struct DatapathError {
    pub what: &'static str,
    pub detail: String,
}

/// One line of Health: (name, ok, detail).
pub type Check = (String, bool, String);

/// Priority (and handle) of every filter the datapath attaches; the kernel
/// check in recovery, Reconcile and Health looks for a `bpf` filter of this
/// priority.
pub const FILTER_PRIORITY: u16 = 1;

/// A tc filter the datapath keeps on a device: the kernel is the truth
/// (an admin or another tool may remove the clsact qdisc or the filter);
/// recovery and Reconcile compare it with this and re-attach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hook {
    pub device: String,
    pub ifindex: u32,
    pub hook: TcHook,
    pub program: &'static str,
}

impl std::fmt::Display for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} on {} {}", self.program, self.device, self.hook)
    }
}

pub trait Datapath: Send + Sync {
    /// Installs or replaces the sandbox's datapath state (idempotent).
    fn attach(&self, sandbox: &SandboxPath<'_>) -> Result<(), DatapathError>;
    /// Removes every entry of the sandbox; missing entries are not an error.
    fn detach(&self, sandbox: &SandboxPath<'_>) -> Result<(), DatapathError>;
    /// Health checks of the datapath itself.
    fn checks(&self) -> Vec<Check>;
    /// Periodic housekeeping (expired flows); called every few seconds.
    fn maintain(&self) {}
    /// Prepares a freshly created (idle) TAP off the caller's path, e.g.
    /// attaches the per-TAP program, so EnsureNetwork does not pay for it.
    fn prepare_tap(&self, _tap_name: &str, _tap_ifindex: u32) -> Result<(), DatapathError> {
        Ok(())
    }
    /// The filters this datapath keeps on node devices (uplink, lo, the
    /// gateway device).
    fn node_hooks(&self) -> Vec<Hook> {
        vec![]
    }
    /// The filter this datapath keeps on a sandbox or pool TAP, if any.
    fn tap_hook(&self, _tap_name: &str, _tap_ifindex: u32) -> Option<Hook> {
        None
    }
    /// Attaches `hook` again (clsact qdisc and filter) after the kernel
    /// lost it; idempotent.
    fn reattach(&self, _hook: &Hook) -> Result<(), DatapathError> {
        Ok(())
    }
    /// The kernel announced that a qdisc or filter on `ifindex` was removed:
    /// forget any belief that it still carries our filter, so the next
    /// attach installs it again.
    fn forget_attachment(&self, _ifindex: u32) {}
}

/// A datapath that programs nothing: TAPs, addresses, neighbour entries and
/// records are managed, packets are left to the host's own routing. Used
/// for `datapath = "none"`, and when the eBPF datapath could not be loaded
/// (then Health is not ok and says why).
#[derive(Debug)]
pub struct NoopDatapath {
    ok: bool,
    detail: String,
}

impl NoopDatapath {
    /// `datapath = "none"`, chosen by the operator.
    pub fn configured() -> Self {
        Self {
            ok: true,
            detail: "none (datapath = \"none\"): sandboxes get TAP, address and neighbour only"
                .into(),
        }
    }

    /// The eBPF datapath was configured but failed to load.
    pub fn failed(reason: &str) -> Self {
        Self {
            ok: false,
            detail: format!("eBPF datapath not loaded, sandboxes have no connectivity: {reason}"),
        }
    }
}

impl Datapath for NoopDatapath {
    fn attach(&self, _sandbox: &SandboxPath<'_>) -> Result<(), DatapathError> {
        Ok(())
    }

    fn detach(&self, _sandbox: &SandboxPath<'_>) -> Result<(), DatapathError> {
        Ok(())
    }

    fn checks(&self) -> Vec<Check> {
        vec![("datapath".into(), self.ok, self.detail.clone())]
    }
}
