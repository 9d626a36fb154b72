//! What the resolver and the proxy (`dns/`) ask of the core (`agent/`),
//! and the plain types both sides share. `dns/` depends on this module
//! only, never on `agent/`; the core implements [`EgressPolicy`] (for
//! `Agent`, in `agent/egress.rs`) and never imports `dns/` (the binary
//! starts the resolver and the proxy with the agent). Pure code.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

// ---- decisions

/// What the resolver does with one query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DnsDecision {
    /// Not a sandbox's address: REFUSED.
    Stranger,
    /// A sandbox without domain rules that reaches the world at large:
    /// forwarded, nothing learned (a documented choice: it could reach any
    /// address anyway, so its lookups teach nothing it could not do).
    Forward,
    /// Allowed by the sandbox's patterns: forwarded, answers learned.
    Learn { sandbox_id: String },
    /// Not allowed: REFUSED (logged and counted).
    Refuse { sandbox_id: String },
    /// The sandbox does not reach the world at large (internet access off,
    /// or a catch-all deny) and no name rule allows the name: REFUSED, so
    /// the resolver is no data channel out of an offline sandbox (every
    /// question would reach the upstream and its answer come back).
    Offline { sandbox_id: String },
}

/// What the proxy does with one connection of strict mode.
#[derive(Debug)]
pub enum ProxyDecision {
    /// Not a strict-mode sandbox's address: reset.
    Stranger,
    /// The name is allowed: dial it (an address `cidrs` allows, when no
    /// name rule allowed it), until `changed` says the sandbox's rules
    /// changed.
    Dial {
        sandbox_id: String,
        cidrs: Option<Arc<dyn AddrRules>>,
        changed: tokio::sync::watch::Receiver<()>,
    },
    /// Not allowed (or no name): reset (logged and counted).
    Refuse { sandbox_id: String },
    /// Egress rules: the name has a rule (TLS, or plain HTTP the rule
    /// lets through): intercepted, each request judged by the rule of the
    /// moment ([`EgressPolicy::egress_rule`]), until `changed` says the
    /// sandbox's entry changed.
    Intercept {
        sandbox_id: String,
        rule_host: String,
        changed: tokio::sync::watch::Receiver<()>,
    },
    /// Egress rules: plain HTTP to a rule's host that has no `plain_http`:
    /// answered 403, never spliced (its headers would go out unchecked).
    PlainRefused {
        sandbox_id: String,
        rule_host: String,
    },
    /// Egress rules: a host without a rule (or no name): spliced to the
    /// address the guest dialled, which the datapath's policy let out, as
    /// it would have gone without rules.
    Splice {
        sandbox_id: String,
        changed: tokio::sync::watch::Receiver<()>,
    },
}

/// A sandbox's CIDR rules as the proxy reads them: whether an address the
/// name resolved to may be dialled.
pub trait AddrRules: std::fmt::Debug + Send + Sync {
    fn allows(&self, ip: Ipv4Addr) -> bool;
}

/// The core's decisions and bookkeeping the resolver and the proxy need,
/// by the source address of a query or connection (a sandbox's IPv4
/// address; see [`EgressPolicy::sandbox_source`]).
pub trait EgressPolicy: Send + Sync + 'static {
    // ---- where the resolver and the proxy listen

    /// The gateway device's IPv4 address, where the resolver listens.
    fn resolver_address(&self) -> Ipv4Addr;
    /// The gateway device's IPv6 address, where the node reaches
    /// sandboxes over IPv6.
    fn resolver_address6(&self) -> Option<Ipv6Addr>;
    /// The gateway device's ifindex.
    fn resolver_ifindex(&self) -> u32;
    /// How many slots the resolver and the proxy have in all.
    fn socket_caps(&self) -> Caps;

    // ---- the resolver

    /// What `dns::serve` made of the resolver's sockets, for Health.
    fn resolver_status(&self, status: Result<String, String>);
    /// Whether the upstream should be probed (no sandbox asked lately).
    fn upstream_probe_due(&self) -> bool;
    /// How the last exchange with the upstream went.
    fn upstream_outcome(&self, r: Result<(), &std::io::Error>);
    /// A query (or TCP connection) found no slot within its source's share.
    fn resolver_busy(&self);
    /// The sandbox's IPv4 address for a query's source (an IPv6 source
    /// maps to its sandbox's IPv4 address).
    fn sandbox_source(&self, from: IpAddr) -> Ipv4Addr;
    /// Whether `ip` is a sandbox's address.
    fn is_sandbox(&self, ip: Ipv4Addr) -> bool;
    /// The MTU of the link of the sandbox at `src`.
    fn dns_udp_mtu(&self, src: Ipv4Addr) -> u32;
    /// What the resolver does with the question `name` from `src`.
    fn dns_decide(&self, src: Ipv4Addr, name: &str) -> DnsDecision;
    /// Whether AAAA questions from `src` are forwarded.
    fn dns_aaaa(&self, src: Ipv4Addr) -> bool;
    /// Learns the answer's addresses for `sandbox_id` at `src` before the
    /// answer is sent.
    fn dns_learn(
        &self,
        src: Ipv4Addr,
        sandbox_id: &str,
        name: &str,
        addrs: &[(IpAddr, u32)],
    ) -> impl Future<Output = Result<(), String>> + Send;

    // ---- the proxy

    /// What `dns::proxy::serve` made of the proxy's sockets, for Health.
    fn proxy_status(&self, status: Result<String, String>);
    /// Whether the proxy serves `src` (a strict-mode sandbox).
    fn proxy_serves(&self, src: Ipv4Addr) -> bool;
    /// What to do with a connection from `src` that named `name` (in the
    /// TLS ClientHello when `tls`, else in an HTTP Host).
    fn proxy_decide(&self, src: Ipv4Addr, name: Option<&str>, tls: bool) -> ProxyDecision;
    /// The address and port the guest dialled, for the proxy's connection
    /// `local` ← `guest` (what the datapath recorded when it steered it).
    fn proxy_peer(
        &self,
        local: std::net::SocketAddr,
        guest: std::net::SocketAddr,
    ) -> Option<std::net::SocketAddr>;
    /// The rule of the moment for `host` of the sandbox `sandbox_id` at
    /// `src`; `None` when it has none (any more), or `src` is another's.
    fn egress_rule(
        &self,
        src: Ipv4Addr,
        sandbox_id: &str,
        host: &str,
    ) -> Option<crate::rules::EgressRule>;
    /// One request of `sandbox_id` through a rule went (`forwarded`) or
    /// was refused.
    fn egress_request(&self, src: Ipv4Addr, sandbox_id: &str, forwarded: bool);
    /// After the sandbox's entry changed: whether a spliced connection to
    /// `dst` may go on (the same sandbox, still served by the proxy, its
    /// policy still letting `dst` out), and the entry to watch from now on.
    fn splice_still(
        &self,
        src: Ipv4Addr,
        sandbox_id: &str,
        dst: IpAddr,
    ) -> Option<tokio::sync::watch::Receiver<()>>;
    /// Why `src` may not reach `ip` through a name, if it may not.
    fn name_target_refused(&self, src: Ipv4Addr, ip: Ipv4Addr) -> Option<&'static str>;
    /// How the proxy's last connection out went (`filtered`: refused by
    /// the service's IP filter).
    fn proxy_dialled(&self, filtered: bool);
    /// The traffic class of the sandbox at `src`, if it is limited.
    fn proxy_priority(&self, src: Ipv4Addr) -> Option<u32>;
    /// After the sandbox's entry changed: whether the proxied connection
    /// may go on, and the entry to watch from now on.
    fn proxy_still(
        &self,
        src: Ipv4Addr,
        sandbox_id: &str,
        name: &str,
        dst: Ipv4Addr,
    ) -> Option<tokio::sync::watch::Receiver<()>>;
}

// ---- socket caps

/// UDP queries forwarded at once (each on a socket of its own, waiting for
/// the upstream up to `dns::UPSTREAM_TIMEOUT`), and from one source address
/// at most (see `dns::Shares`: fewer when many sources hold slots). A query
/// that finds no slot gets SERVFAIL at once: the receive loop never waits.
pub const MAX_IN_FLIGHT: usize = 1024;

/// DNS over TCP: connections at once (each with one to the upstream while
/// a query is forwarded); per source address and idle time: see `dns`.
pub const MAX_TCP: usize = 256;

/// The proxy's connections at once, in all (fewer per sandbox when many
/// sandboxes hold connections: see `dns::Shares`).
pub const MAX_CONNS: usize = 4096;

/// How many slots the resolver and the proxy have in all: their maxima
/// ([`MAX_IN_FLIGHT`], [`MAX_TCP`], [`MAX_CONNS`]) when the
/// descriptors left after a full pool of TAPs hold them (a socket per UDP
/// query in flight, a connection and its upstream one per TCP query, a
/// connection and its server side per proxied connection), else scaled
/// down to fit, never below a floor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    pub udp: usize,
    pub tcp: usize,
    pub proxy: usize,
}

impl Caps {
    pub fn for_spare(spare_fds: u64) -> Caps {
        let full = (MAX_IN_FLIGHT + 2 * MAX_TCP + 2 * MAX_CONNS) as u64;
        let scale = |max: usize, min: usize| {
            ((max as u64 * spare_fds.min(full) / full) as usize).clamp(min, max)
        };
        Caps {
            udp: scale(MAX_IN_FLIGHT, 64),
            tcp: scale(MAX_TCP, 16),
            proxy: scale(MAX_CONNS, 64),
        }
    }
}
