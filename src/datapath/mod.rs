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

use std::net::IpAddr;

use crate::agent::spec::PortMapping;

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
