//! The datapath's error: a leaf every room (`pins.rs`, `ebpf/`) uses, so
//! none of them imports the datapath's face (`mod.rs`) for it.

/// What failed in the datapath, and whether the agent may run on without it.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {detail}")]
pub struct DatapathError {
    pub what: &'static str,
    pub detail: String,
    /// The agent must not start (a pinned map it cannot migrate): the
    /// datapath in the kernel is left as it is. Otherwise a failed load
    /// leaves the agent running without a datapath, Health saying why.
    pub fatal: bool,
}
