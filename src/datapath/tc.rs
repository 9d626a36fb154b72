//! tc over rtnetlink, one synchronous request at a time (the datapath's
//! callers run on blocking threads): clsact qdiscs, a TAP's bound to the
//! shared ingress block; bpf filters on a device hook or on the block,
//! created or **replaced in place** (the kernel swaps the program under
//! RCU: no packet sees no program); and the dumps that tell what the kernel
//! has, with each filter's program tag. aya 0.14 attaches to devices only
//! and cannot replace a filter; these requests do both.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use rtnetlink::packet_core::{
    DefaultNla, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REPLACE, NLM_F_REQUEST,
    NetlinkHeader, NetlinkMessage, NetlinkPayload, Nla,
};
use rtnetlink::packet_route::RouteNetlinkMessage;
use rtnetlink::packet_route::tc::{
    TcAttribute, TcBpfFlags, TcFilterBpfOption, TcHandle, TcHeader, TcMessage, TcOption,
};
use rtnetlink::sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

use crate::netlink::TcHook;

/// The clsact qdisc's parent and handle.
const TC_H_CLSACT: u32 = 0xFFFF_FFF1;
const CLSACT_HANDLE: u32 = 0xFFFF_0000;
/// Its ingress and egress hooks, as a filter's parent.
const HOOK_INGRESS: u32 = 0xFFFF_FFF2;
const HOOK_EGRESS: u32 = 0xFFFF_FFF3;
/// `TCA_INGRESS_BLOCK` / `TCA_EGRESS_BLOCK`: the shared blocks a clsact's
/// hooks use.
const TCA_INGRESS_BLOCK: u16 = 13;
const TCA_EGRESS_BLOCK: u16 = 14;
/// `htons(ETH_P_ALL)`, the protocol of every datapath filter.
const ETH_P_ALL_BE: u16 = (libc::ETH_P_ALL as u16).to_be();

/// Where a filter is attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    Device {
        ifindex: u32,
        hook: TcHook,
    },
    /// A shared tc block: every device whose clsact binds it runs its filters.
    Block(u32),
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Device { ifindex, hook } => write!(f, "ifindex {ifindex} {hook}"),
            Target::Block(b) => write!(f, "tc block {b}"),
        }
    }
}

impl Target {
    /// (tcm_ifindex, tcm_parent) of a filter request.
    fn header(self) -> (i32, u32) {
        match self {
            Target::Device { ifindex, hook } => (
                ifindex as i32,
                match hook {
                    TcHook::Ingress => HOOK_INGRESS,
                    TcHook::Egress => HOOK_EGRESS,
                },
            ),
            Target::Block(b) => (TcHeader::TCM_IFINDEX_MAGIC_BLOCK as i32, b),
        }
    }
}

/// A bpf filter the kernel has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filter {
    pub priority: u16,
    pub handle: u32,
    pub name: String,
    /// The program's tag (a hash of its instructions), as the kernel shows it.
    pub tag: u64,
    pub id: u32,
}

/// A NETLINK_ROUTE socket for one request at a time (a check of thousands
/// of devices asks on one socket instead of opening one per request).
pub struct Conn {
    sock: Socket,
    seq: u32,
}

impl Conn {
    pub fn new() -> io::Result<Self> {
        let mut sock = Socket::new(NETLINK_ROUTE)?;
        sock.bind_auto()?;
        sock.connect(&SocketAddr::new(0, 0))?;
        Ok(Self { sock, seq: 0 })
    }

    /// One request; its replies (a dump's messages, nothing for an
    /// acknowledged change). An error reply becomes its errno.
    pub(super) fn request(
        &mut self,
        msg: RouteNetlinkMessage,
        flags: u16,
    ) -> io::Result<Vec<RouteNetlinkMessage>> {
        self.seq = self.seq.wrapping_add(1);
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | flags;
        header.sequence_number = self.seq;
        let mut nl = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(msg));
        nl.finalize();
        let mut buf = vec![0u8; nl.buffer_len()];
        nl.serialize(&mut buf);
        self.sock.send(&buf, 0)?;
        let dump = flags & NLM_F_DUMP == NLM_F_DUMP;
        let mut out = vec![];
        loop {
            let (data, _) = self.sock.recv_from_full()?;
            let mut at = 0;
            while at < data.len() {
                let reply = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&data[at..])
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
                let len = reply.header.length as usize;
                // A late reply to an earlier request of this socket.
                let stale = reply.header.sequence_number != self.seq;
                match reply.payload {
                    _ if stale => {}
                    NetlinkPayload::Error(e) => match e.code {
                        Some(code) => return Err(io::Error::from_raw_os_error(-code.get())),
                        None if !dump => return Ok(out),
                        None => {}
                    },
                    NetlinkPayload::Done(_) => return Ok(out),
                    NetlinkPayload::InnerMessage(m) => out.push(m),
                    _ => {}
                }
                if len == 0 {
                    break;
                }
                at += (len + 3) & !3;
            }
        }
    }

    /// How `ifindex`'s ingress hook runs filters, from a dump of its
    /// ingress filters (one short reply, whatever the number of devices:
    /// the kernel neither answers a qdisc request for one device with a
    /// clsact (it multicasts it) nor filters qdisc dumps by device, and a
    /// dump of every qdisc restarts its device walk for each reply buffer,
    /// O(devices²)). A bound hook's filters come back addressed to its
    /// block. A device without an ingress qdisc answers with an empty dump,
    /// like a hook without filters: [`Binding::NoFilter`].
    pub fn ingress_binding(&mut self, ifindex: u32) -> io::Result<Binding> {
        let m = tc_message(ifindex as i32, 0, HOOK_INGRESS, 0);
        let replies = match self.request(RouteNetlinkMessage::GetTrafficFilter(m), NLM_F_DUMP) {
            Ok(r) => r,
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOENT)) => {
                return Ok(Binding::NoQdisc);
            }
            Err(e) => return Err(e),
        };
        let mut any = false;
        for r in replies {
            if let RouteNetlinkMessage::NewTrafficFilter(m) = r {
                any = true;
                if m.header.index == TcHeader::TCM_IFINDEX_MAGIC_BLOCK as i32 {
                    return Ok(Binding::Block(m.header.parent.into()));
                }
            }
        }
        Ok(if any { Binding::Own } else { Binding::NoFilter })
    }
}

/// What a device's ingress hook is, as far as its filters tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Binding {
    /// No such device, or one without an ingress qdisc that the kernel
    /// reports as such (most answer with an empty dump: `NoFilter`).
    NoQdisc,
    /// Bound to this shared block.
    Block(u32),
    /// A qdisc with filters of its own.
    Own,
    /// No filter at all: no ingress qdisc, one bound to a block without a
    /// filter, or one of its own without one ([`clsact_qdiscs`] tells).
    NoFilter,
}

/// One request on a socket of its own.
fn request(msg: RouteNetlinkMessage, flags: u16) -> io::Result<Vec<RouteNetlinkMessage>> {
    Conn::new()?.request(msg, flags)
}

pub(super) fn tc_message(index: i32, handle: u32, parent: u32, info: u32) -> TcMessage {
    let mut m = TcMessage::default();
    m.header.index = index;
    m.header.handle = TcHandle::from(handle);
    m.header.parent = TcHandle::from(parent);
    m.header.info = info;
    m
}

/// Adds a clsact qdisc to `ifindex`, its ingress hook bound to shared block
/// `block` when given, and then its (unused) egress hook to the shared
/// block `block + 1`: a clsact's hook of its own registers a block of its
/// own, and every registration walks the kernel's list of blocks
/// (`flow_indr_dev_setup_offload`), O(devices on the node). `Ok(false)`:
/// the device has a clsact qdisc already (bound or not: see
/// [`clsact_qdiscs`]).
pub fn add_clsact(ifindex: u32, block: Option<u32>) -> io::Result<bool> {
    let mut m = tc_message(ifindex as i32, CLSACT_HANDLE, TC_H_CLSACT, 0);
    m.attributes.push(TcAttribute::Kind("clsact".into()));
    if let Some(b) = block {
        for (kind, index) in [
            (TCA_INGRESS_BLOCK, b),
            (TCA_EGRESS_BLOCK, b.wrapping_add(1)),
        ] {
            m.attributes.push(TcAttribute::Other(DefaultNla::new(
                kind,
                index.to_ne_bytes().to_vec(),
            )));
        }
    }
    match request(
        RouteNetlinkMessage::NewQueueDiscipline(m),
        NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
    ) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Deletes the clsact qdisc of `ifindex` (and every filter on it); a
/// device without one is not an error.
pub fn del_clsact(ifindex: u32) -> io::Result<()> {
    let mut m = tc_message(ifindex as i32, CLSACT_HANDLE, TC_H_CLSACT, 0);
    m.attributes.push(TcAttribute::Kind("clsact".into()));
    match request(RouteNetlinkMessage::DelQueueDiscipline(m), NLM_F_ACK) {
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOENT)) => Ok(()),
        other => other.map(|_| ()),
    }
}

/// A clsact qdisc message: (ifindex, the block its ingress hook is bound
/// to); None for any other qdisc.
fn clsact_binding(r: RouteNetlinkMessage) -> Option<(u32, Option<u32>)> {
    let RouteNetlinkMessage::NewQueueDiscipline(m) = r else {
        return None;
    };
    m.attributes
        .iter()
        .any(|a| matches!(a, TcAttribute::Kind(k) if k == "clsact"))
        .then_some(())?;
    let block = m.attributes.iter().find_map(|a| match a {
        TcAttribute::Other(nla) if nla.kind() == TCA_INGRESS_BLOCK => {
            let mut v = [0u8; 4];
            nla.emit_value(&mut v);
            Some(u32::from_ne_bytes(v))
        }
        _ => None,
    });
    Some((m.header.index as u32, block))
}

/// Every device's clsact qdisc: ifindex → the shared block its ingress
/// hook is bound to (None: a qdisc of its own). One dump for the node.
pub fn clsact_qdiscs() -> io::Result<HashMap<u32, Option<u32>>> {
    let replies = request(
        RouteNetlinkMessage::GetQueueDiscipline(TcMessage::default()),
        NLM_F_DUMP,
    )?;
    Ok(replies.into_iter().filter_map(clsact_binding).collect())
}

/// One device's clsact qdisc: None if it has none, else the block its
/// ingress hook is bound to (None inside: a qdisc of its own). See
/// [`Conn::ingress_binding`]; a hook without any filter is looked up in
/// the node's qdisc dump.
pub fn clsact_of(ifindex: u32) -> io::Result<Option<Option<u32>>> {
    Ok(match Conn::new()?.ingress_binding(ifindex)? {
        Binding::NoQdisc => None,
        Binding::Block(b) => Some(Some(b)),
        Binding::Own => Some(None),
        Binding::NoFilter => clsact_qdiscs()?.get(&ifindex).copied(),
    })
}

/// Attaches `prog` as the direct-action bpf filter `priority`/`handle` on
/// `target`, replacing in place the program of a filter already there at
/// that priority and handle (`tc filter replace`): the kernel swaps it
/// atomically, so packets never run without a program.
pub fn replace_filter(
    target: Target,
    priority: u16,
    handle: u32,
    prog: BorrowedFd<'_>,
    name: &str,
) -> io::Result<()> {
    let (index, parent) = target.header();
    let info = (u32::from(priority) << 16) | u32::from(ETH_P_ALL_BE);
    let mut m = tc_message(index, handle, parent, info);
    m.attributes.push(TcAttribute::Kind("bpf".into()));
    m.attributes.push(TcAttribute::Options(vec![
        TcOption::Bpf(TcFilterBpfOption::ProgFd(prog.as_raw_fd() as u32)),
        TcOption::Bpf(TcFilterBpfOption::ProgName(name.into())),
        TcOption::Bpf(TcFilterBpfOption::Flags(TcBpfFlags::from_bits_retain(1))),
    ]));
    request(
        RouteNetlinkMessage::NewTrafficFilter(m),
        NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
    )
    .map(|_| ())
}

/// The bpf filters on `target`. A device without a clsact qdisc (or a
/// block nobody binds) has none.
pub fn bpf_filters(target: Target) -> io::Result<Vec<Filter>> {
    let (index, parent) = target.header();
    let replies = match request(
        RouteNetlinkMessage::GetTrafficFilter(tc_message(index, 0, parent, 0)),
        NLM_F_DUMP,
    ) {
        Ok(r) => r,
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOENT)) => vec![],
        Err(e) => return Err(e),
    };
    let mut out = vec![];
    for r in replies {
        let RouteNetlinkMessage::NewTrafficFilter(m) = r else {
            continue;
        };
        if !m
            .attributes
            .iter()
            .any(|a| matches!(a, TcAttribute::Kind(k) if k == "bpf"))
        {
            continue;
        }
        let mut f = Filter {
            priority: (m.header.info >> 16) as u16,
            handle: m.header.handle.into(),
            name: String::new(),
            tag: 0,
            id: 0,
        };
        // The dump lists the chain's head (handle 0, no options) too.
        let mut options = false;
        for a in &m.attributes {
            if let TcAttribute::Options(opts) = a {
                for o in opts {
                    options = true;
                    match o {
                        TcOption::Bpf(TcFilterBpfOption::ProgName(n)) => f.name.clone_from(n),
                        TcOption::Bpf(TcFilterBpfOption::ProgTag(t)) => {
                            f.tag = u64::from_be_bytes(*t)
                        }
                        TcOption::Bpf(TcFilterBpfOption::ProgId(i)) => f.id = *i,
                        _ => {}
                    }
                }
            }
        }
        if options {
            out.push(f);
        }
    }
    Ok(out)
}
