//! One flow record: what the datapath saw (a flow's first packet, a
//! refusal) or what the reaper saw at a flow's end, as an operator reads
//! it. Pure values: the datapath's raw event is turned into this by the
//! agent (`agent/flows.rs`), the edges (varlink `WatchFlows`, cubenetctl,
//! the journal) only print it.

use std::net::IpAddr;

/// What the record is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FlowEvent {
    /// A flow's first packet, forwarded.
    Start,
    /// A flow's end (TCP closed, or expired): its totals are in `end`.
    End,
    /// A packet the datapath refused (`verdict` says why).
    Refused,
}

impl FlowEvent {
    pub fn as_str(self) -> &'static str {
        match self {
            FlowEvent::Start => "start",
            FlowEvent::End => "end",
            FlowEvent::Refused => "refused",
        }
    }
}

/// Who opened the flow, seen from the sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// The sandbox, to the world (SNAT, NAT66).
    Egress,
    /// The world, to one of the sandbox's port mappings.
    Ingress,
    /// Between the node and the sandbox: the node to the sandbox's
    /// address or a mapped port on the node, or the guest to its gateway
    /// (the agent's resolver and proxy included).
    Host,
}

impl Direction {
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Egress => "egress",
            Direction::Ingress => "ingress",
            Direction::Host => "host",
        }
    }
}

/// Why the datapath refused a packet (the per-sandbox drop reasons).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The sandbox's egress policy (a denied CIDR, no internet access).
    Policy,
    /// A name-ruled sandbox's new flow to an address its resolver never
    /// answered with.
    Unlearned,
    /// A new flow to one of the node's own addresses (not a mapping).
    NodeAddress,
    /// A source (MAC, IP) that is not the guest's.
    Spoofed,
    /// The sandbox is paused.
    Paused,
    /// A TCP segment of a connection the sandbox never opened.
    StaleTcp,
    /// No free SNAT or gateway-side port, or the sandbox's share of the
    /// node's flow table is used up.
    NoPort,
    /// No route (no uplink, a guest fragment, IPv6 off the link).
    NoRoute,
    /// A protocol the datapath does not forward.
    Unsupported,
    /// A frame the datapath could not parse.
    Malformed,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Policy => "policy",
            Reason::Unlearned => "unlearned",
            Reason::NodeAddress => "node_address",
            Reason::Spoofed => "spoofed",
            Reason::Paused => "paused",
            Reason::StaleTcp => "stale_tcp",
            Reason::NoPort => "no_port",
            Reason::NoRoute => "no_route",
            Reason::Unsupported => "unsupported",
            Reason::Malformed => "malformed",
        }
    }

    pub const ALL: [Reason; 10] = [
        Reason::Policy,
        Reason::Unlearned,
        Reason::NodeAddress,
        Reason::Spoofed,
        Reason::Paused,
        Reason::StaleTcp,
        Reason::NoPort,
        Reason::NoRoute,
        Reason::Unsupported,
        Reason::Malformed,
    ];
}

/// An address and port (0 where the protocol has none; an ICMP echo's
/// identifier on the guest's side).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Endpoint {
    pub ip: IpAddr,
    pub port: u16,
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.ip {
            IpAddr::V4(a) => write!(f, "{a}:{}", self.port),
            IpAddr::V6(a) => write!(f, "[{a}]:{}", self.port),
        }
    }
}

/// A flow's totals, in IP bytes (headers included) and packets, each way
/// as the sandbox sees it: `out` = sent by the sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Totals {
    pub bytes_out: u64,
    pub packets_out: u64,
    pub bytes_in: u64,
    pub packets_in: u64,
    pub duration_ms: u64,
}

/// One record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowRecord {
    /// Wall-clock time of the packet (Start, Refused) or of the end.
    pub time_unix_ns: u64,
    pub sandbox_id: String,
    pub event: FlowEvent,
    /// 4 or 6.
    pub family: u8,
    /// "tcp", "udp", "icmp", "icmpv6", or the protocol number.
    pub protocol: String,
    pub direction: Direction,
    /// The guest's side as the guest sees it (its own address and port).
    pub guest: Endpoint,
    /// The other side as the guest sees it (a world host; the gateway for
    /// host flows).
    pub remote: Endpoint,
    /// The node's side where the flow is translated there: the SNAT
    /// address and port, or the mapping's host address and port.
    pub node: Option<Endpoint>,
    /// None: forwarded; Some: refused, and why.
    pub refused: Option<Reason>,
    /// The DNS name the agent's resolver answered with the remote address
    /// for this sandbox, when there is one.
    pub dns_name: Option<String>,
    /// The flow's totals (End only).
    pub end: Option<Totals>,
}

impl FlowRecord {
    /// "forwarded" or "dropped".
    pub fn verdict(&self) -> &'static str {
        if self.refused.is_some() {
            "dropped"
        } else {
            "forwarded"
        }
    }
}
