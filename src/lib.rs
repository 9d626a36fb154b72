//! cube-network-agent: node-local network agent for micro-VM sandboxes.
//!
//! Layout: `agent/` decides (ensure, release, reconcile, recover, warm
//! pool); `alloc/` is pure allocation; `tap.rs`, `netlink/` and
//! `datapath/` own kernel objects; `types.rs` holds the value types they
//! share with the core; `dns/` (the resolver and the proxy) sees the core
//! only through `policy.rs`; `store.rs` is durable state; `dbus/` is a
//! thin wire edge; `config.rs` and `systemd.rs` connect to the host.

pub mod agent;
pub mod alloc;
pub mod auth;
pub mod cni;
pub mod config;
pub mod datapath;
pub mod dbus;
pub mod dns;
pub mod flows;
pub mod hostsock;
pub mod metrics;
pub mod netlink;
pub mod netns;
pub mod policy;
pub(crate) mod random;
pub mod refusals;
pub mod rules;
pub mod store;
pub mod sysctl;
pub mod systemd;
pub mod tap;
pub mod types;
pub mod varlink;

/// An error and all its sources, joined with ": ".
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(src) = cur {
        let msg = src.to_string();
        if !s.ends_with(&msg) {
            s.push_str(": ");
            s.push_str(&msg);
        }
        cur = src.source();
    }
    s
}
