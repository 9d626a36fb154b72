//! In-process test guests on the far side of a TAP fd (TESTING.md "Guests on
//! the far side of a TAP"; recipe: /work/shared/recipes/guest/smolguest).
//!
//! * [`Guest`]: a smoltcp 0.14 stack on its own thread. It sees what every
//!   sandbox sees (`169.254.68.6/30`, gateway `169.254.68.5`, MAC
//!   `20:90:6f:fc:fc:fc`) and offers blocking, timed operations: TCP
//!   connect/send/receive, TCP banner listeners, UDP echo and exchange, ICMP
//!   ping, and raw frame injection plus a capture of every received frame.
//! * [`RawGuest`]: no stack at all, just frames in and out of the fd, for
//!   hostile traffic and proxy-ARP checks.
//!
//! The TAP carries the 12-byte virtio-net header: it is stripped on read
//! (finishing `NEEDS_CSUM` checksums, dropping GSO frames) and prepended as
//! zeros on write. Source ports are random (a fixed one hits the peer's
//! TIME_WAIT). Guests wait [`GuestConfig::start_delay`] (20 ms) before their
//! first frame: a freshly attached TAP drops the first frames and smoltcp
//! retries ARP only after 1 s.

#![allow(dead_code)]

use std::collections::VecDeque;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddrV4};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant as StdInstant};

use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::phy::{self, ChecksumCapabilities, Device, DeviceCapabilities, Medium};
use smoltcp::socket::{icmp, tcp, udp};
use smoltcp::time::Instant;
use smoltcp::wire::{
    EthernetAddress, HardwareAddress, Icmpv4Packet, Icmpv4Repr, IpAddress, IpCidr, IpEndpoint,
    Ipv4Address,
};

pub const VNET_HDR_LEN: usize = 12;
pub const GUEST_IP: Ipv4Addr = Ipv4Addr::new(169, 254, 68, 6);
pub const GATEWAY_IP: Ipv4Addr = Ipv4Addr::new(169, 254, 68, 5);
pub const GUEST_MAC: [u8; 6] = [0x20, 0x90, 0x6f, 0xfc, 0xfc, 0xfc];
pub const GATEWAY_MAC: [u8; 6] = [0x20, 0x90, 0x6f, 0xcf, 0xcf, 0xcf];
pub const BROADCAST_MAC: [u8; 6] = [0xff; 6];

const VIRTIO_NET_HDR_F_NEEDS_CSUM: u8 = 1;
/// Received frames kept for [`Guest::recv_raw_frames`]; older ones are dropped.
const CAPTURE_LIMIT: usize = 4096;
/// Listening sockets per [`Guest::tcp_listen`] port (smoltcp has no backlog).
const LISTEN_BACKLOG: usize = 4;
const TCP_BUFFER: usize = 64 * 1024;
/// UDP datagrams and ICMP echoes are re-sent this often until answered.
const RESEND: Duration = Duration::from_millis(250);

#[derive(Debug, Clone)]
pub struct GuestConfig {
    pub ip: Ipv4Addr,
    pub prefix_len: u8,
    pub gateway: Ipv4Addr,
    pub mac: [u8; 6],
    /// IP MTU (the agent's TAPs default to 1300).
    pub mtu: usize,
    /// Pause after attaching before the first frame.
    pub start_delay: Duration,
}

impl Default for GuestConfig {
    fn default() -> Self {
        GuestConfig {
            ip: GUEST_IP,
            prefix_len: 30,
            gateway: GATEWAY_IP,
            mac: GUEST_MAC,
            mtu: 1300,
            start_delay: Duration::from_millis(20),
        }
    }
}

/// Options for [`Guest::tcp_exchange`].
#[derive(Debug, Clone, Copy)]
pub struct TcpOpts {
    /// Send FIN once the payload is sent (servers that read to EOF, like
    /// the world's, need it); the receive half stays open.
    pub half_close: bool,
    /// Return as soon as this many bytes arrived instead of waiting for the
    /// peer to close.
    pub max_bytes: Option<usize>,
}

impl Default for TcpOpts {
    fn default() -> Self {
        TcpOpts {
            half_close: true,
            max_bytes: None,
        }
    }
}

// ---------------------------------------------------------------------------
// small helpers

fn errno_str() -> String {
    std::io::Error::last_os_error().to_string()
}

fn set_nonblocking(fd: BorrowedFd<'_>) -> Result<(), String> {
    // SAFETY: fcntl(F_GETFL/F_SETFL) on a valid, borrowed fd; no memory is passed.
    let r = unsafe {
        let fl = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
        if fl < 0 {
            fl
        } else {
            libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK)
        }
    };
    if r < 0 {
        Err(format!("fcntl O_NONBLOCK: {}", errno_str()))
    } else {
        Ok(())
    }
}

/// poll(2) for POLLIN on up to two fds; returns which are readable.
fn poll_in(fds: &[RawFd], timeout: Duration) -> Vec<bool> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: `pfds` is a live, exclusively borrowed array of `pfds.len()`
    // pollfd structs for the duration of the call.
    let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
    if n <= 0 {
        return vec![false; fds.len()];
    }
    pfds.iter().map(|p| p.revents != 0).collect()
}

/// One frame out of the TAP, vnet header stripped, checksum finished.
enum ReadOutcome {
    Frame(Vec<u8>),
    /// Something to skip (GSO frame, runt).
    Skip,
    WouldBlock,
    Error(String),
}

fn read_frame(fd: BorrowedFd<'_>) -> ReadOutcome {
    let mut buf = vec![0u8; VNET_HDR_LEN + 65550];
    // SAFETY: `buf` is a live, writable buffer of `buf.len()` bytes.
    let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        return match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted => {
                ReadOutcome::WouldBlock
            }
            _ => ReadOutcome::Error(format!("tap read: {e}")),
        };
    }
    let n = n as usize;
    if n < VNET_HDR_LEN + 14 {
        return ReadOutcome::Skip;
    }
    let (flags, gso_type) = (buf[0], buf[1]);
    if gso_type != 0 {
        // Only with TSO/USO offloads turned on for this queue (TUNSETOFFLOAD).
        eprintln!("guest: dropping a GSO frame (gso_type={gso_type}, {n} bytes)");
        return ReadOutcome::Skip;
    }
    let mut frame = buf[VNET_HDR_LEN..n].to_vec();
    if flags & VIRTIO_NET_HDR_F_NEEDS_CSUM != 0 {
        // CHECKSUM_PARTIAL (TUN_F_CSUM on): the pseudo-header sum is already
        // in place; fold the rest from csum_start and store it at csum_offset.
        let start = u16::from_le_bytes([buf[6], buf[7]]) as usize;
        let off = u16::from_le_bytes([buf[8], buf[9]]) as usize;
        if start + off + 2 <= frame.len() {
            let cs = !fold(sum16(&frame[start..]));
            frame[start + off..start + off + 2].copy_from_slice(&cs.to_be_bytes());
        }
    }
    ReadOutcome::Frame(frame)
}

fn write_frame(fd: BorrowedFd<'_>, frame: &[u8]) -> Result<(), String> {
    // A zeroed virtio_net_hdr: no checksum offload, GSO_NONE.
    write_frame_hdr(fd, [0; VNET_HDR_LEN], frame)
}

fn write_frame_hdr(
    fd: BorrowedFd<'_>,
    hdr: [u8; VNET_HDR_LEN],
    frame: &[u8],
) -> Result<(), String> {
    let mut buf = vec![0u8; VNET_HDR_LEN + frame.len()];
    buf[..VNET_HDR_LEN].copy_from_slice(&hdr);
    buf[VNET_HDR_LEN..].copy_from_slice(frame);
    // SAFETY: `buf` is a live buffer of `buf.len()` bytes; write(2) only reads it.
    let n = unsafe { libc::write(fd.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
    if n < 0 {
        Err(format!("tap write: {}", errno_str()))
    } else {
        Ok(())
    }
}

fn sum16(data: &[u8]) -> u32 {
    data.chunks(2)
        .map(|c| (u32::from(c[0]) << 8) | u32::from(*c.get(1).unwrap_or(&0)))
        .sum()
}

fn fold(mut sum: u32) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// A small xorshift generator: random source ports and ICMP idents.
struct Rng(u64);

impl Rng {
    fn new() -> Rng {
        static SALT: AtomicU64 = AtomicU64::new(0);
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        let salt = SALT.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
        Rng((t ^ salt ^ (u64::from(std::process::id()) << 32)) | 1)
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn port(&mut self) -> u16 {
        49152 + (self.next() % 16384) as u16
    }
}

fn v4(a: Ipv4Addr) -> Ipv4Address {
    // smoltcp 0.14's Ipv4Address is core::net::Ipv4Addr.
    a
}

fn ep(a: SocketAddrV4) -> IpEndpoint {
    IpEndpoint::new(IpAddress::Ipv4(v4(*a.ip())), a.port())
}

// ---------------------------------------------------------------------------
// the smoltcp device

struct VnetTap {
    fd: OwnedFd,
    mtu: usize,
    capture: Arc<Mutex<VecDeque<Vec<u8>>>>,
    dead: Option<String>,
}

struct Rx(Vec<u8>);
struct Tx<'a>(BorrowedFd<'a>);

impl phy::RxToken for Rx {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        f(&self.0)
    }
}

impl phy::TxToken for Tx<'_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        let mut frame = vec![0u8; len];
        let r = f(&mut frame);
        if let Err(e) = write_frame(self.0, &frame) {
            eprintln!("guest: {e}");
        }
        r
    }
}

impl Device for VnetTap {
    type RxToken<'a> = Rx;
    type TxToken<'a> = Tx<'a>;

    fn receive(&mut self, _t: Instant) -> Option<(Rx, Tx<'_>)> {
        if self.dead.is_some() {
            return None;
        }
        loop {
            match read_frame(self.fd.as_fd()) {
                ReadOutcome::Frame(frame) => {
                    let mut cap = self.capture.lock().unwrap();
                    if cap.len() >= CAPTURE_LIMIT {
                        cap.pop_front();
                    }
                    cap.push_back(frame.clone());
                    drop(cap);
                    return Some((Rx(frame), Tx(self.fd.as_fd())));
                }
                ReadOutcome::Skip => continue,
                ReadOutcome::WouldBlock => return None,
                ReadOutcome::Error(e) => {
                    eprintln!("guest: {e}; the guest stops using the TAP");
                    self.dead = Some(e);
                    return None;
                }
            }
        }
    }

    fn transmit(&mut self, _t: Instant) -> Option<Tx<'_>> {
        if self.dead.is_some() {
            return None;
        }
        Some(Tx(self.fd.as_fd()))
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut c = DeviceCapabilities::default();
        c.medium = Medium::Ethernet;
        c.max_transmission_unit = self.mtu + 14;
        c
    }
}

// ---------------------------------------------------------------------------
// commands and the worker thread

type Reply<T> = mpsc::Sender<Result<T, String>>;

enum Cmd {
    TcpConnect {
        dst: SocketAddrV4,
        payload: Vec<u8>,
        opts: TcpOpts,
        deadline: StdInstant,
        reply: Reply<Vec<u8>>,
    },
    TcpListen {
        port: u16,
        /// Echo what arrives and keep the connection (else: banner, close).
        echo: bool,
        reply: Reply<()>,
    },
    UdpEcho {
        port: u16,
        reply: Reply<()>,
    },
    UdpSendRecv {
        /// The guest's port; None: a random free one.
        src: Option<u16>,
        dst: SocketAddrV4,
        payload: Vec<u8>,
        deadline: StdInstant,
        reply: Reply<(Vec<u8>, SocketAddrV4)>,
    },
    Ping {
        dst: Ipv4Addr,
        deadline: StdInstant,
        reply: Reply<Duration>,
    },
    Stop,
}

struct TcpClient {
    handle: SocketHandle,
    dst: SocketAddrV4,
    payload: Vec<u8>,
    sent: usize,
    fin_sent: bool,
    opts: TcpOpts,
    rx: Vec<u8>,
    established: bool,
    peer_closed: bool,
    deadline: StdInstant,
    reply: Reply<Vec<u8>>,
}

struct Listener {
    port: u16,
    echo: bool,
    banner: Vec<u8>,
    /// (socket, banner already sent on the current connection)
    sockets: Vec<(SocketHandle, bool)>,
}

struct UdpClient {
    handle: SocketHandle,
    dst: SocketAddrV4,
    payload: Vec<u8>,
    last_sent: Option<StdInstant>,
    deadline: StdInstant,
    reply: Reply<(Vec<u8>, SocketAddrV4)>,
}

struct PingOp {
    handle: SocketHandle,
    dst: Ipv4Addr,
    ident: u16,
    seq: u16,
    sent: Vec<(u16, StdInstant)>,
    deadline: StdInstant,
    reply: Reply<Duration>,
}

struct Worker {
    iface: Interface,
    dev: VnetTap,
    sockets: SocketSet<'static>,
    rng: Rng,
    cmds: mpsc::Receiver<Cmd>,
    wake: OwnedFd,
    tcp_clients: Vec<TcpClient>,
    /// Finished client sockets, kept until their close handshake is done.
    lingering: Vec<(SocketHandle, StdInstant)>,
    listeners: Vec<Listener>,
    udp_echo: Vec<SocketHandle>,
    udp_clients: Vec<UdpClient>,
    pings: Vec<PingOp>,
}

fn tcp_socket() -> tcp::Socket<'static> {
    let mut s = tcp::Socket::new(
        tcp::SocketBuffer::new(vec![0; TCP_BUFFER]),
        tcp::SocketBuffer::new(vec![0; TCP_BUFFER]),
    );
    s.set_nagle_enabled(false);
    s
}

fn udp_socket() -> udp::Socket<'static> {
    udp::Socket::new(
        udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 64], vec![0; 65536]),
        udp::PacketBuffer::new(vec![udp::PacketMetadata::EMPTY; 64], vec![0; 65536]),
    )
}

fn icmp_socket() -> icmp::Socket<'static> {
    icmp::Socket::new(
        icmp::PacketBuffer::new(vec![icmp::PacketMetadata::EMPTY; 16], vec![0; 16384]),
        icmp::PacketBuffer::new(vec![icmp::PacketMetadata::EMPTY; 16], vec![0; 16384]),
    )
}

impl Worker {
    fn run(mut self) {
        loop {
            // Commands first, so that a Stop is never starved by traffic.
            loop {
                match self.cmds.try_recv() {
                    Ok(Cmd::Stop) | Err(mpsc::TryRecvError::Disconnected) => {
                        self.fail_all("guest stopped");
                        return;
                    }
                    Ok(cmd) => self.command(cmd),
                    Err(mpsc::TryRecvError::Empty) => break,
                }
            }
            self.iface
                .poll(Instant::now(), &mut self.dev, &mut self.sockets);
            self.progress();
            // Flush whatever progress() queued before sleeping.
            self.iface
                .poll(Instant::now(), &mut self.dev, &mut self.sockets);
            let mut delay = self
                .iface
                .poll_delay(Instant::now(), &self.sockets)
                .map(|d| Duration::from_micros(d.total_micros()))
                .unwrap_or(Duration::from_millis(50))
                .min(Duration::from_millis(50));
            if !self.udp_clients.is_empty()
                || !self.pings.is_empty()
                || !self.tcp_clients.is_empty()
            {
                delay = delay.min(Duration::from_millis(10));
            }
            let wake = self.wake.as_raw_fd();
            let ready = if self.dev.dead.is_some() {
                poll_in(&[wake], delay)
            } else {
                poll_in(&[wake, self.dev.fd.as_raw_fd()], delay)
            };
            if ready[0] {
                let mut v = 0u64;
                // SAFETY: reads 8 bytes into a live u64 from our own eventfd.
                unsafe { libc::read(wake, (&mut v as *mut u64).cast(), 8) };
            }
        }
    }

    fn fail_all(&mut self, why: &str) {
        for c in self.tcp_clients.drain(..) {
            let _ = c.reply.send(Err(why.into()));
        }
        for c in self.udp_clients.drain(..) {
            let _ = c.reply.send(Err(why.into()));
        }
        for p in self.pings.drain(..) {
            let _ = p.reply.send(Err(why.into()));
        }
    }

    fn port_in_use(&self, port: u16) -> bool {
        self.listeners.iter().any(|l| l.port == port)
            || self.sockets.iter().any(|(_, s)| match s {
                smoltcp::socket::Socket::Tcp(t) => {
                    t.local_endpoint().is_some_and(|e| e.port == port)
                        || t.listen_endpoint().port == port
                }
                smoltcp::socket::Socket::Udp(u) => u.endpoint().port == port,
                _ => false,
            })
    }

    fn free_port(&mut self) -> u16 {
        loop {
            let p = self.rng.port();
            if !self.port_in_use(p) {
                return p;
            }
        }
    }

    fn command(&mut self, cmd: Cmd) {
        if let Some(dead) = &self.dev.dead {
            let err = format!("guest TAP is unusable: {dead}");
            match cmd {
                Cmd::TcpConnect { reply, .. } => drop(reply.send(Err(err))),
                Cmd::TcpListen { reply, .. } | Cmd::UdpEcho { reply, .. } => {
                    drop(reply.send(Err(err)))
                }
                Cmd::UdpSendRecv { reply, .. } => drop(reply.send(Err(err))),
                Cmd::Ping { reply, .. } => drop(reply.send(Err(err))),
                Cmd::Stop => {}
            }
            return;
        }
        match cmd {
            Cmd::TcpConnect {
                dst,
                payload,
                opts,
                deadline,
                reply,
            } => {
                let local = self.free_port();
                let mut s = tcp_socket();
                if let Err(e) = s.connect(self.iface.context(), ep(dst), local) {
                    let _ = reply.send(Err(format!("connect {dst}: {e}")));
                    return;
                }
                let handle = self.sockets.add(s);
                self.tcp_clients.push(TcpClient {
                    handle,
                    dst,
                    payload,
                    sent: 0,
                    fin_sent: false,
                    opts,
                    rx: Vec::new(),
                    established: false,
                    peer_closed: false,
                    deadline,
                    reply,
                });
            }
            Cmd::TcpListen { port, echo, reply } => {
                if self.listeners.iter().any(|l| l.port == port) {
                    let _ = reply.send(Ok(()));
                    return;
                }
                let mut sockets = Vec::new();
                for _ in 0..LISTEN_BACKLOG {
                    let mut s = tcp_socket();
                    if let Err(e) = s.listen(port) {
                        let _ = reply.send(Err(format!("listen {port}: {e}")));
                        return;
                    }
                    sockets.push((self.sockets.add(s), false));
                }
                self.listeners.push(Listener {
                    port,
                    echo,
                    banner: format!("guest:{port}").into_bytes(),
                    sockets,
                });
                let _ = reply.send(Ok(()));
            }
            Cmd::UdpEcho { port, reply } => {
                let mut s = udp_socket();
                match s.bind(port) {
                    Ok(()) => {
                        self.udp_echo.push(self.sockets.add(s));
                        let _ = reply.send(Ok(()));
                    }
                    Err(e) => drop(reply.send(Err(format!("udp bind {port}: {e}")))),
                }
            }
            Cmd::UdpSendRecv {
                src,
                dst,
                payload,
                deadline,
                reply,
            } => {
                let port = src.unwrap_or_else(|| self.free_port());
                let mut s = udp_socket();
                if let Err(e) = s.bind(port) {
                    let _ = reply.send(Err(format!("udp bind {port}: {e}")));
                    return;
                }
                let handle = self.sockets.add(s);
                self.udp_clients.push(UdpClient {
                    handle,
                    dst,
                    payload,
                    last_sent: None,
                    deadline,
                    reply,
                });
            }
            Cmd::Ping {
                dst,
                deadline,
                reply,
            } => {
                let ident = self.rng.next() as u16;
                let mut s = icmp_socket();
                if let Err(e) = s.bind(icmp::Endpoint::Ident(ident)) {
                    let _ = reply.send(Err(format!("icmp bind: {e}")));
                    return;
                }
                let handle = self.sockets.add(s);
                self.pings.push(PingOp {
                    handle,
                    dst,
                    ident,
                    seq: 0,
                    sent: Vec::new(),
                    deadline,
                    reply,
                });
            }
            Cmd::Stop => {}
        }
    }

    fn progress(&mut self) {
        let now = StdInstant::now();
        self.progress_tcp_clients(now);
        self.progress_listeners();
        self.progress_udp();
        self.progress_udp_clients(now);
        self.progress_pings(now);
        self.lingering.retain(|&(h, since)| {
            let s = self.sockets.get_mut::<tcp::Socket>(h);
            if !s.is_open() || now.duration_since(since) > Duration::from_secs(5) {
                s.abort();
                self.sockets.remove(h);
                false
            } else {
                true
            }
        });
    }

    fn progress_tcp_clients(&mut self, now: StdInstant) {
        let mut i = 0;
        while i < self.tcp_clients.len() {
            let c = &mut self.tcp_clients[i];
            let s = self.sockets.get_mut::<tcp::Socket>(c.handle);
            let state = s.state();
            if !matches!(
                state,
                tcp::State::SynSent | tcp::State::SynReceived | tcp::State::Closed
            ) {
                c.established = true;
            }
            while s.can_recv() {
                let _ = s.recv(|d| {
                    c.rx.extend_from_slice(d);
                    (d.len(), ())
                });
            }
            if s.may_send() && c.sent < c.payload.len() {
                c.sent += s.send_slice(&c.payload[c.sent..]).unwrap_or(0);
            }
            if c.opts.half_close && c.sent == c.payload.len() && !c.fin_sent && s.may_send() {
                s.close();
                c.fin_sent = true;
            }
            if matches!(
                state,
                tcp::State::CloseWait
                    | tcp::State::LastAck
                    | tcp::State::Closing
                    | tcp::State::TimeWait
            ) {
                c.peer_closed = true;
            }
            let enough = c.opts.max_bytes.is_some_and(|n| c.rx.len() >= n);
            let result = if enough || (c.peer_closed && !s.can_recv()) {
                Some(Ok(()))
            } else if state == tcp::State::Closed {
                Some(Err(if c.established {
                    format!(
                        "tcp {}: connection reset after receiving {} bytes",
                        c.dst,
                        c.rx.len()
                    )
                } else {
                    format!("tcp {}: connection refused or reset", c.dst)
                }))
            } else if now >= c.deadline {
                Some(Err(format!(
                    "tcp {}: timed out in state {state} (sent {}/{} bytes, received {} bytes: {:?})",
                    c.dst,
                    c.sent,
                    c.payload.len(),
                    c.rx.len(),
                    String::from_utf8_lossy(&c.rx)
                )))
            } else {
                None
            };
            match result {
                None => i += 1,
                Some(r) => {
                    let c = self.tcp_clients.swap_remove(i);
                    let s = self.sockets.get_mut::<tcp::Socket>(c.handle);
                    match &r {
                        Ok(()) => s.close(),
                        Err(_) => s.abort(),
                    }
                    self.lingering.push((c.handle, now));
                    let _ = c.reply.send(r.map(|()| c.rx));
                }
            }
        }
    }

    fn progress_listeners(&mut self) {
        for l in &mut self.listeners {
            for (h, banner_sent) in &mut l.sockets {
                let s = self.sockets.get_mut::<tcp::Socket>(*h);
                if !s.is_open() {
                    // Closed or TIME-WAIT: re-arm for the next connection.
                    s.abort();
                    let _ = s.listen(l.port);
                    *banner_sent = false;
                    continue;
                }
                if l.echo {
                    if s.can_recv() && s.can_send() {
                        let room = s.send_capacity() - s.send_queue();
                        if let Ok(data) = s.recv(|d| {
                            let n = d.len().min(room);
                            (n, d[..n].to_vec())
                        }) {
                            let _ = s.send_slice(&data);
                        }
                    }
                    if s.state() == tcp::State::CloseWait {
                        s.close();
                    }
                    continue;
                }
                while s.can_recv() {
                    let _ = s.recv(|d| (d.len(), ()));
                }
                if s.may_send() && !*banner_sent {
                    let _ = s.send_slice(&l.banner);
                    s.close();
                    *banner_sent = true;
                } else if s.state() == tcp::State::CloseWait {
                    s.close();
                }
            }
        }
    }

    fn progress_udp(&mut self) {
        for &h in &self.udp_echo {
            let s = self.sockets.get_mut::<udp::Socket>(h);
            while let Ok((data, meta)) = s.recv() {
                let data = data.to_vec();
                let _ = s.send_slice(&data, meta.endpoint);
            }
        }
    }

    fn progress_udp_clients(&mut self, now: StdInstant) {
        let mut i = 0;
        while i < self.udp_clients.len() {
            let c = &mut self.udp_clients[i];
            let s = self.sockets.get_mut::<udp::Socket>(c.handle);
            let mut result = None;
            if let Ok((data, meta)) = s.recv() {
                let from = match meta.endpoint.addr {
                    IpAddress::Ipv4(a) => SocketAddrV4::new(a, meta.endpoint.port),
                };
                result = Some(Ok((data.to_vec(), from)));
            } else if now >= c.deadline {
                result = Some(Err(format!("udp {}: no reply before the deadline", c.dst)));
            } else if c.last_sent.is_none_or(|t| now.duration_since(t) >= RESEND) {
                if let Err(e) = s.send_slice(&c.payload, ep(c.dst)) {
                    result = Some(Err(format!("udp send to {}: {e}", c.dst)));
                }
                c.last_sent = Some(now);
            }
            match result {
                None => i += 1,
                Some(r) => {
                    let c = self.udp_clients.swap_remove(i);
                    self.sockets.remove(c.handle);
                    let _ = c.reply.send(r);
                }
            }
        }
    }

    fn progress_pings(&mut self, now: StdInstant) {
        let caps = ChecksumCapabilities::default();
        let mut i = 0;
        while i < self.pings.len() {
            let p = &mut self.pings[i];
            let s = self.sockets.get_mut::<icmp::Socket>(p.handle);
            let mut result = None;
            while let Ok((data, from)) = s.recv() {
                let Ok(pkt) = Icmpv4Packet::new_checked(data) else {
                    continue;
                };
                if let Ok(Icmpv4Repr::EchoReply { ident, seq_no, .. }) =
                    Icmpv4Repr::parse(&pkt, &caps)
                {
                    let from_ok = from == IpAddress::Ipv4(v4(p.dst));
                    if let Some((_, t)) = p.sent.iter().find(|(q, _)| *q == seq_no)
                        && ident == p.ident
                        && from_ok
                    {
                        result = Some(Ok(now.duration_since(*t)));
                        break;
                    }
                }
            }
            if result.is_none() {
                if now >= p.deadline {
                    result = Some(Err(format!(
                        "ping {}: no echo reply ({} requests sent)",
                        p.dst,
                        p.sent.len()
                    )));
                } else if p
                    .sent
                    .last()
                    .is_none_or(|(_, t)| now.duration_since(*t) >= RESEND)
                {
                    p.seq = p.seq.wrapping_add(1);
                    let data = *b"cube-guest-ping!";
                    let repr = Icmpv4Repr::EchoRequest {
                        ident: p.ident,
                        seq_no: p.seq,
                        data: &data,
                    };
                    match s.send(repr.buffer_len(), IpAddress::Ipv4(v4(p.dst))) {
                        Ok(buf) => {
                            let mut pkt = Icmpv4Packet::new_unchecked(buf);
                            repr.emit(&mut pkt, &caps);
                            p.sent.push((p.seq, now));
                        }
                        Err(e) => result = Some(Err(format!("ping {}: {e}", p.dst))),
                    }
                }
            }
            match result {
                None => i += 1,
                Some(r) => {
                    let p = self.pings.swap_remove(i);
                    self.sockets.remove(p.handle);
                    let _ = p.reply.send(r);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// the public Guest

/// A smoltcp guest on its own thread. Dropping it stops the thread and
/// closes its fds (the TAP itself belongs to whoever created it).
pub struct Guest {
    pub config: GuestConfig,
    cmds: mpsc::Sender<Cmd>,
    wake: OwnedFd,
    raw: OwnedFd,
    capture: Arc<Mutex<VecDeque<Vec<u8>>>>,
    thread: Option<JoinHandle<()>>,
}

impl Guest {
    /// Starts a guest on `fd` (a TAP fd with the 12-byte vnet header, e.g.
    /// from `Client::open_tap`). The stack starts after `config.start_delay`;
    /// calls made before then simply wait.
    pub fn start(fd: OwnedFd, config: GuestConfig) -> Guest {
        set_nonblocking(fd.as_fd()).expect("TAP fd");
        let raw = fd.try_clone().expect("dup TAP fd");
        // SAFETY: eventfd(2) with a zero initial value and valid flags; the
        // returned fd (checked below) is owned by us alone.
        let wake = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        assert!(wake >= 0, "eventfd: {}", errno_str());
        // SAFETY: `wake` is a freshly created fd nobody else owns.
        let wake = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(wake) };
        let worker_wake = wake.try_clone().expect("dup eventfd");
        let capture = Arc::new(Mutex::new(VecDeque::new()));
        let (tx, rx) = mpsc::channel();
        let cfg = config.clone();
        let cap = capture.clone();
        let thread = std::thread::Builder::new()
            .name("test-guest".into())
            .spawn(move || {
                std::thread::sleep(cfg.start_delay);
                let mut dev = VnetTap {
                    fd,
                    mtu: cfg.mtu,
                    capture: cap,
                    dead: None,
                };
                let mut rng = Rng::new();
                let mut icfg = Config::new(HardwareAddress::Ethernet(EthernetAddress(cfg.mac)));
                icfg.random_seed = rng.next();
                let mut iface = Interface::new(icfg, &mut dev, Instant::now());
                iface.update_ip_addrs(|a| {
                    a.push(IpCidr::new(IpAddress::Ipv4(v4(cfg.ip)), cfg.prefix_len))
                        .unwrap()
                });
                iface
                    .routes_mut()
                    .add_default_ipv4_route(v4(cfg.gateway))
                    .unwrap();
                Worker {
                    iface,
                    dev,
                    sockets: SocketSet::new(vec![]),
                    rng,
                    cmds: rx,
                    wake: worker_wake,
                    tcp_clients: Vec::new(),
                    lingering: Vec::new(),
                    listeners: Vec::new(),
                    udp_echo: Vec::new(),
                    udp_clients: Vec::new(),
                    pings: Vec::new(),
                }
                .run()
            })
            .expect("spawning the guest thread");
        Guest {
            config,
            cmds: tx,
            wake,
            raw,
            capture,
            thread: Some(thread),
        }
    }

    /// A guest with the default sandbox view (169.254.68.6/30 via .5).
    pub fn start_default(fd: OwnedFd) -> Guest {
        Guest::start(fd, GuestConfig::default())
    }

    fn send(&self, cmd: Cmd) -> Result<(), String> {
        self.cmds
            .send(cmd)
            .map_err(|_| "guest thread is gone".to_string())?;
        let one = 1u64;
        // SAFETY: writes 8 bytes from a live u64 to our own eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
        Ok(())
    }

    fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Cmd, timeout: Duration) -> Result<T, String> {
        let (tx, rx) = mpsc::channel();
        self.send(make(tx))?;
        // The worker enforces the deadline; this is only a backstop, with
        // room for the start delay.
        match rx.recv_timeout(timeout + self.config.start_delay + Duration::from_secs(1)) {
            Ok(r) => r,
            Err(mpsc::RecvTimeoutError::Timeout) => Err("guest thread did not answer".into()),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err("guest thread is gone".into()),
        }
    }

    fn deadline(&self, timeout: Duration) -> StdInstant {
        StdInstant::now() + timeout
    }

    /// Connects to `dst`, sends `payload`, half-closes and reads until the
    /// peer closes; returns what arrived.
    pub fn tcp_connect_send_recv(
        &self,
        dst: SocketAddrV4,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>, String> {
        self.tcp_exchange(dst, payload, TcpOpts::default(), timeout)
    }

    /// [`Guest::tcp_connect_send_recv`] with options (no half-close, stop
    /// after N bytes).
    pub fn tcp_exchange(
        &self,
        dst: SocketAddrV4,
        payload: &[u8],
        opts: TcpOpts,
        timeout: Duration,
    ) -> Result<Vec<u8>, String> {
        let deadline = self.deadline(timeout);
        self.call(
            |reply| Cmd::TcpConnect {
                dst,
                payload: payload.to_vec(),
                opts,
                deadline,
                reply,
            },
            timeout,
        )
    }

    /// Serves TCP `port`: every connection gets the banner `guest:<port>`
    /// and is closed (whatever the peer sends is read and discarded).
    pub fn tcp_listen(&self, port: u16) -> Result<(), String> {
        self.call(
            |reply| Cmd::TcpListen {
                port,
                echo: false,
                reply,
            },
            Duration::from_secs(1),
        )
    }

    /// Serves TCP `port`: every connection gets back what it sends and
    /// stays open until the peer closes it.
    pub fn tcp_echo(&self, port: u16) -> Result<(), String> {
        self.call(
            |reply| Cmd::TcpListen {
                port,
                echo: true,
                reply,
            },
            Duration::from_secs(1),
        )
    }

    /// Echoes every datagram arriving on UDP `port` back to its sender.
    pub fn udp_echo(&self, port: u16) -> Result<(), String> {
        self.call(|reply| Cmd::UdpEcho { port, reply }, Duration::from_secs(1))
    }

    /// Sends `payload` from a random port to `dst` (re-sent every 250 ms)
    /// and returns the first datagram that comes back.
    pub fn udp_send_recv(
        &self,
        dst: SocketAddrV4,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>, String> {
        self.udp_send_recv_from(dst, payload, timeout)
            .map(|(d, _)| d)
    }

    /// [`Guest::udp_send_recv`], also returning the reply's source.
    pub fn udp_send_recv_from(
        &self,
        dst: SocketAddrV4,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<(Vec<u8>, SocketAddrV4), String> {
        self.udp_exchange(None, dst, payload, timeout)
    }

    /// [`Guest::udp_send_recv_from`] from the guest's port `src` (a flow
    /// that lasts over many exchanges keeps its tuple).
    pub fn udp_exchange(
        &self,
        src: Option<u16>,
        dst: SocketAddrV4,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<(Vec<u8>, SocketAddrV4), String> {
        let deadline = self.deadline(timeout);
        self.call(
            |reply| Cmd::UdpSendRecv {
                src,
                dst,
                payload: payload.to_vec(),
                deadline,
                reply,
            },
            timeout,
        )
    }

    /// ICMP echo to `dst` (re-sent every 250 ms); the round-trip time of the
    /// first answered request.
    pub fn ping(&self, dst: Ipv4Addr, timeout: Duration) -> Result<Duration, String> {
        let deadline = self.deadline(timeout);
        self.call(
            |reply| Cmd::Ping {
                dst,
                deadline,
                reply,
            },
            timeout,
        )
    }

    /// Writes one raw ethernet frame to the TAP (vnet header prepended),
    /// bypassing smoltcp.
    pub fn send_raw_frame(&self, frame: &[u8]) -> Result<(), String> {
        write_frame(self.raw.as_fd(), frame)
    }

    /// Waits `timeout`, then returns every frame the guest received since
    /// the previous drain (including the ones smoltcp consumed).
    pub fn recv_raw_frames(&self, timeout: Duration) -> Vec<Vec<u8>> {
        std::thread::sleep(timeout);
        self.capture.lock().unwrap().drain(..).collect()
    }

    /// The first captured frame matching `pred` (removed from the capture),
    /// waiting up to `timeout`.
    pub fn wait_raw_frame(
        &self,
        timeout: Duration,
        mut pred: impl FnMut(&[u8]) -> bool,
    ) -> Option<Vec<u8>> {
        let deadline = StdInstant::now() + timeout;
        loop {
            {
                let mut cap = self.capture.lock().unwrap();
                if let Some(i) = cap.iter().position(|f| pred(f)) {
                    return cap.remove(i);
                }
            }
            if StdInstant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Forgets every captured frame.
    pub fn clear_raw_frames(&self) {
        self.capture.lock().unwrap().clear();
    }

    /// Stops the thread (also done by Drop).
    pub fn stop(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = self.send(Cmd::Stop);
            let _ = t.join();
        }
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        self.stop();
    }
}

// ---------------------------------------------------------------------------
// RawGuest

/// Frames in and out of a TAP fd, no stack: nothing answers ARP or TCP.
pub struct RawGuest {
    fd: OwnedFd,
}

impl RawGuest {
    /// Takes the fd and waits the 20 ms a freshly attached TAP needs.
    pub fn new(fd: OwnedFd) -> RawGuest {
        set_nonblocking(fd.as_fd()).expect("TAP fd");
        std::thread::sleep(Duration::from_millis(20));
        RawGuest { fd }
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Writes one ethernet frame (the vnet header is prepended).
    pub fn send(&self, frame: &[u8]) -> Result<(), String> {
        write_frame(self.fd.as_fd(), frame)
    }

    /// Writes an IPv4 TCP frame (from [`tcp_frame`]) as a VMM with
    /// checksum offload does: `NEEDS_CSUM` in the vnet header, the TCP
    /// checksum field holding only the pseudo-header sum.
    pub fn send_partial_csum(&self, frame: &[u8]) -> Result<(), String> {
        let start = 14 + usize::from(frame[14] & 0x0f) * 4;
        let tcp_len = frame.len() - start;
        let mut f = frame.to_vec();
        let mut pseudo = Vec::with_capacity(12);
        pseudo.extend_from_slice(&f[26..34]);
        pseudo.extend_from_slice(&[0, 6]);
        pseudo.extend_from_slice(&(tcp_len as u16).to_be_bytes());
        f[start + 16..start + 18].copy_from_slice(&fold(sum16(&pseudo)).to_be_bytes());
        let mut hdr = [0u8; VNET_HDR_LEN];
        hdr[0] = VIRTIO_NET_HDR_F_NEEDS_CSUM;
        hdr[6..8].copy_from_slice(&(start as u16).to_le_bytes());
        hdr[8..10].copy_from_slice(&16u16.to_le_bytes());
        write_frame_hdr(self.fd.as_fd(), hdr, &f)
    }

    /// Every frame that arrives within `timeout`.
    pub fn recv(&self, timeout: Duration) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let _ = self.recv_match(timeout, |f| {
            out.push(f.to_vec());
            false
        });
        out
    }

    /// The first frame within `timeout` for which `pred` is true (frames
    /// before it are discarded).
    pub fn recv_match(
        &self,
        timeout: Duration,
        mut pred: impl FnMut(&[u8]) -> bool,
    ) -> Option<Vec<u8>> {
        let deadline = StdInstant::now() + timeout;
        loop {
            match read_frame(self.fd.as_fd()) {
                ReadOutcome::Frame(f) => {
                    if pred(&f) {
                        return Some(f);
                    }
                    continue;
                }
                ReadOutcome::Skip => continue,
                ReadOutcome::WouldBlock => {}
                ReadOutcome::Error(e) => {
                    eprintln!("raw guest: {e}");
                    return None;
                }
            }
            let left = deadline.saturating_duration_since(StdInstant::now());
            if left.is_zero() {
                return None;
            }
            poll_in(&[self.fd.as_raw_fd()], left);
        }
    }

    /// Sends an ARP request for `target` (from the default guest MAC/IP)
    /// and returns the first ARP reply for it.
    pub fn arp(&self, target: Ipv4Addr, timeout: Duration) -> Option<Arp> {
        self.send(&arp_request(GUEST_MAC, GUEST_IP, target)).ok()?;
        self.recv_match(timeout, |f| {
            parse_arp(f).is_some_and(|a| a.op == ARP_REPLY && a.sender_ip == target)
        })
        .and_then(|f| parse_arp(&f))
    }
}

// ---------------------------------------------------------------------------
// frame builders and parsers

pub const ETH_P_ARP: u16 = 0x0806;
pub const ETH_P_IP: u16 = 0x0800;
pub const ARP_REQUEST: u16 = 1;
pub const ARP_REPLY: u16 = 2;

pub fn mac_str(m: &[u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

pub fn eth_type(frame: &[u8]) -> Option<u16> {
    (frame.len() >= 14).then(|| u16::from_be_bytes([frame[12], frame[13]]))
}

pub fn eth_src(frame: &[u8]) -> Option<[u8; 6]> {
    frame.get(6..12).map(|s| s.try_into().unwrap())
}

pub fn eth_dst(frame: &[u8]) -> Option<[u8; 6]> {
    frame.get(0..6).map(|s| s.try_into().unwrap())
}

pub fn eth_header(dst: [u8; 6], src: [u8; 6], ethertype: u16) -> Vec<u8> {
    let mut f = Vec::with_capacity(64);
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&ethertype.to_be_bytes());
    f
}

/// A broadcast ARP request "who has `target_ip`, tell `sender_ip`".
pub fn arp_request(sender_mac: [u8; 6], sender_ip: Ipv4Addr, target_ip: Ipv4Addr) -> Vec<u8> {
    arp_frame(
        BROADCAST_MAC,
        ARP_REQUEST,
        sender_mac,
        sender_ip,
        [0; 6],
        target_ip,
    )
}

/// Any ARP frame (for spoofing tests: e.g. a gratuitous reply).
pub fn arp_frame(
    eth_dst: [u8; 6],
    op: u16,
    sender_mac: [u8; 6],
    sender_ip: Ipv4Addr,
    target_mac: [u8; 6],
    target_ip: Ipv4Addr,
) -> Vec<u8> {
    let mut f = eth_header(eth_dst, sender_mac, ETH_P_ARP);
    f.extend_from_slice(&[0, 1, 0x08, 0x00, 6, 4]);
    f.extend_from_slice(&op.to_be_bytes());
    f.extend_from_slice(&sender_mac);
    f.extend_from_slice(&sender_ip.octets());
    f.extend_from_slice(&target_mac);
    f.extend_from_slice(&target_ip.octets());
    f.resize(60, 0);
    f
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arp {
    pub eth_src: [u8; 6],
    pub eth_dst: [u8; 6],
    pub op: u16,
    pub sender_mac: [u8; 6],
    pub sender_ip: Ipv4Addr,
    pub target_mac: [u8; 6],
    pub target_ip: Ipv4Addr,
}

pub fn parse_arp(f: &[u8]) -> Option<Arp> {
    if eth_type(f)? != ETH_P_ARP || f.len() < 42 || f[14..20] != [0, 1, 0x08, 0x00, 6, 4] {
        return None;
    }
    let ip = |o: usize| Ipv4Addr::new(f[o], f[o + 1], f[o + 2], f[o + 3]);
    Some(Arp {
        eth_dst: eth_dst(f)?,
        eth_src: eth_src(f)?,
        op: u16::from_be_bytes([f[20], f[21]]),
        sender_mac: f[22..28].try_into().unwrap(),
        sender_ip: ip(28),
        target_mac: f[32..38].try_into().unwrap(),
        target_ip: ip(38),
    })
}

/// An IPv4/UDP frame with correct checksums (for spoofed-source tests).
pub fn udp_frame(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: SocketAddrV4,
    dst: SocketAddrV4,
    payload: &[u8],
) -> Vec<u8> {
    let udp_len = 8 + payload.len();
    let mut udp = Vec::with_capacity(udp_len);
    udp.extend_from_slice(&src.port().to_be_bytes());
    udp.extend_from_slice(&dst.port().to_be_bytes());
    udp.extend_from_slice(&(udp_len as u16).to_be_bytes());
    udp.extend_from_slice(&[0, 0]);
    udp.extend_from_slice(payload);
    let mut pseudo = Vec::with_capacity(12 + udp_len);
    pseudo.extend_from_slice(&src.ip().octets());
    pseudo.extend_from_slice(&dst.ip().octets());
    pseudo.extend_from_slice(&[0, 17]);
    pseudo.extend_from_slice(&(udp_len as u16).to_be_bytes());
    pseudo.extend_from_slice(&udp);
    let cs = match !fold(sum16(&pseudo)) {
        0 => 0xffff,
        c => c,
    };
    udp[6..8].copy_from_slice(&cs.to_be_bytes());
    let mut f = eth_header(dst_mac, src_mac, ETH_P_IP);
    f.extend_from_slice(&ipv4_header(*src.ip(), *dst.ip(), 17, udp_len));
    f.extend_from_slice(&udp);
    f
}

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_PSH: u8 = 0x08;
pub const TCP_ACK: u8 = 0x10;

/// An IPv4 TCP frame (20-byte header, no options) with a complete checksum.
#[allow(clippy::too_many_arguments)]
pub fn tcp_frame(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: SocketAddrV4,
    dst: SocketAddrV4,
    seq: u32,
    ack: u32,
    flags: u8,
    payload: &[u8],
) -> Vec<u8> {
    let tcp_len = 20 + payload.len();
    let mut tcp = Vec::with_capacity(tcp_len);
    tcp.extend_from_slice(&src.port().to_be_bytes());
    tcp.extend_from_slice(&dst.port().to_be_bytes());
    tcp.extend_from_slice(&seq.to_be_bytes());
    tcp.extend_from_slice(&ack.to_be_bytes());
    tcp.extend_from_slice(&[5 << 4, flags, 0xff, 0xff, 0, 0, 0, 0]);
    tcp.extend_from_slice(payload);
    let cs = !fold(l4_sum(*src.ip(), *dst.ip(), 6, &tcp));
    tcp[16..18].copy_from_slice(&cs.to_be_bytes());
    let mut f = eth_header(dst_mac, src_mac, ETH_P_IP);
    f.extend_from_slice(&ipv4_header(*src.ip(), *dst.ip(), 6, tcp_len));
    f.extend_from_slice(&tcp);
    f
}

fn l4_sum(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, l4: &[u8]) -> u32 {
    let mut pseudo = Vec::with_capacity(12 + l4.len());
    pseudo.extend_from_slice(&src.octets());
    pseudo.extend_from_slice(&dst.octets());
    pseudo.extend_from_slice(&[0, proto]);
    pseudo.extend_from_slice(&(l4.len() as u16).to_be_bytes());
    pseudo.extend_from_slice(l4);
    sum16(&pseudo)
}

/// A TCP segment as parsed from a frame, with whether both its IP and
/// TCP checksums are right.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpSeg {
    pub src: SocketAddrV4,
    pub dst: SocketAddrV4,
    pub seq: u32,
    pub ack: u32,
    pub flags: u8,
    pub ttl: u8,
    pub payload: Vec<u8>,
    pub checksums_ok: bool,
}

pub fn parse_tcp(f: &[u8]) -> Option<TcpSeg> {
    let (src, dst, proto, l4) = parse_ipv4(f)?;
    if proto != 6 || l4.len() < 20 {
        return None;
    }
    let ihl = usize::from(f[14] & 0x0f) * 4;
    let doff = usize::from(l4[12] >> 4) * 4;
    let be16 = |o: usize| u16::from_be_bytes([l4[o], l4[o + 1]]);
    let be32 = |o: usize| u32::from_be_bytes([l4[o], l4[o + 1], l4[o + 2], l4[o + 3]]);
    Some(TcpSeg {
        src: SocketAddrV4::new(src, be16(0)),
        dst: SocketAddrV4::new(dst, be16(2)),
        seq: be32(4),
        ack: be32(8),
        flags: l4[13],
        ttl: f[22],
        payload: l4.get(doff..)?.to_vec(),
        checksums_ok: fold(sum16(&f[14..14 + ihl])) == 0xffff
            && fold(l4_sum(src, dst, 6, l4)) == 0xffff,
    })
}

fn ipv4_header(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, payload_len: usize) -> [u8; 20] {
    let mut h = [0u8; 20];
    h[0] = 0x45;
    h[2..4].copy_from_slice(&((20 + payload_len) as u16).to_be_bytes());
    h[6] = 0x40; // DF
    h[8] = 64;
    h[9] = proto;
    h[12..16].copy_from_slice(&src.octets());
    h[16..20].copy_from_slice(&dst.octets());
    let cs = !fold(sum16(&h));
    h[10..12].copy_from_slice(&cs.to_be_bytes());
    h
}

/// Parsed IPv4 header fields of a frame: (src, dst, protocol, L4 bytes).
pub fn parse_ipv4(f: &[u8]) -> Option<(Ipv4Addr, Ipv4Addr, u8, &[u8])> {
    if eth_type(f)? != ETH_P_IP || f.len() < 34 {
        return None;
    }
    let ihl = usize::from(f[14] & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([f[16], f[17]]));
    let end = (14 + total).min(f.len());
    let ip = |o: usize| Ipv4Addr::new(f[o], f[o + 1], f[o + 2], f[o + 3]);
    Some((ip(26), ip(30), f[23], f.get(14 + ihl..end)?))
}

// ---------------------------------------------------------------------------
// IPv6 frames (the guests' IPv6 link, docs/dual-stack.md)

pub const ETH_P_IPV6: u16 = 0x86dd;
/// The guest's fixed IPv6 address and the gateway's two.
pub const GUEST_IP6: Ipv6Addr = Ipv6Addr::new(0xfd63, 0x7562, 0x6500, 0, 0, 0, 0, 6);
pub const GATEWAY_IP6: Ipv6Addr = Ipv6Addr::new(0xfd63, 0x7562, 0x6500, 0, 0, 0, 0, 5);
pub const GATEWAY_LL: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0x2290, 0x6fff, 0xfecf, 0xcfcf);
/// The link-local and SLAAC addresses of [`GUEST_MAC`] (modified EUI-64).
pub const GUEST_LL: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0x2290, 0x6fff, 0xfefc, 0xfcfc);
pub const GUEST_SLAAC: Ipv6Addr =
    Ipv6Addr::new(0xfd63, 0x7562, 0x6500, 0, 0x2290, 0x6fff, 0xfefc, 0xfcfc);

fn l4_sum6(src: Ipv6Addr, dst: Ipv6Addr, next: u8, l4: &[u8]) -> u32 {
    let mut pseudo = Vec::with_capacity(40 + l4.len());
    pseudo.extend_from_slice(&src.octets());
    pseudo.extend_from_slice(&dst.octets());
    pseudo.extend_from_slice(&(l4.len() as u32).to_be_bytes());
    pseudo.extend_from_slice(&[0, 0, 0, next]);
    pseudo.extend_from_slice(l4);
    sum16(&pseudo)
}

/// Where the L4 checksum of `next` (ICMPv6, TCP, UDP) sits in its header.
fn csum_at6(next: u8) -> usize {
    match next {
        6 => 16,
        17 => 6,
        _ => 2,
    }
}

/// An IPv6 frame carrying `l4` (its checksum filled in), hop limit `hlim`.
#[allow(clippy::too_many_arguments)]
pub fn ip6_frame(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: Ipv6Addr,
    dst: Ipv6Addr,
    next: u8,
    hlim: u8,
    l4: &[u8],
) -> Vec<u8> {
    let mut l4 = l4.to_vec();
    let at = csum_at6(next);
    l4[at..at + 2].copy_from_slice(&[0, 0]);
    let cs = !fold(l4_sum6(src, dst, next, &l4));
    l4[at..at + 2].copy_from_slice(&cs.to_be_bytes());
    let mut f = eth_header(dst_mac, src_mac, ETH_P_IPV6);
    f.extend_from_slice(&[0x60, 0, 0, 0]);
    f.extend_from_slice(&(l4.len() as u16).to_be_bytes());
    f.extend_from_slice(&[next, hlim]);
    f.extend_from_slice(&src.octets());
    f.extend_from_slice(&dst.octets());
    f.extend_from_slice(&l4);
    f
}

/// A TCP header (no options) and payload, checksum left to [`ip6_frame`].
pub fn tcp6_segment(
    sport: u16,
    dport: u16,
    seq: u32,
    ack: u32,
    flags: u8,
    payload: &[u8],
) -> Vec<u8> {
    let mut t = Vec::with_capacity(20 + payload.len());
    t.extend_from_slice(&sport.to_be_bytes());
    t.extend_from_slice(&dport.to_be_bytes());
    t.extend_from_slice(&seq.to_be_bytes());
    t.extend_from_slice(&ack.to_be_bytes());
    t.extend_from_slice(&[5 << 4, flags, 0xff, 0xff, 0, 0, 0, 0]);
    t.extend_from_slice(payload);
    t
}

/// A UDP header and payload, checksum left to [`ip6_frame`].
pub fn udp6_datagram(sport: u16, dport: u16, payload: &[u8]) -> Vec<u8> {
    let mut u = Vec::with_capacity(8 + payload.len());
    u.extend_from_slice(&sport.to_be_bytes());
    u.extend_from_slice(&dport.to_be_bytes());
    u.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    u.extend_from_slice(&[0, 0]);
    u.extend_from_slice(payload);
    u
}

/// An IPv6 packet as parsed from a frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ip6Pkt {
    pub src: Ipv6Addr,
    pub dst: Ipv6Addr,
    pub next: u8,
    pub hlim: u8,
    pub l4: Vec<u8>,
    /// The L4 checksum (ICMPv6, TCP, UDP) is right.
    pub checksum_ok: bool,
}

pub fn parse_ip6(f: &[u8]) -> Option<Ip6Pkt> {
    if eth_type(f)? != ETH_P_IPV6 || f.len() < 54 || f[14] >> 4 != 6 {
        return None;
    }
    let plen = usize::from(u16::from_be_bytes([f[18], f[19]]));
    let l4 = f.get(54..54 + plen)?.to_vec();
    let a = |o: usize| Ipv6Addr::from(<[u8; 16]>::try_from(&f[o..o + 16]).unwrap());
    let (src, dst, next) = (a(22), a(38), f[20]);
    Some(Ip6Pkt {
        src,
        dst,
        next,
        hlim: f[21],
        checksum_ok: fold(l4_sum6(src, dst, next, &l4)) == 0xffff,
        l4,
    })
}

impl RawGuest {
    /// Writes an IPv6 TCP or UDP frame (from [`ip6_frame`]) as a VMM with
    /// checksum offload does: `NEEDS_CSUM`, the checksum field holding
    /// only the pseudo-header sum.
    pub fn send_partial_csum6(&self, frame: &[u8]) -> Result<(), String> {
        let p = parse_ip6(frame).ok_or("not an IPv6 frame")?;
        let at = csum_at6(p.next);
        let mut f = frame.to_vec();
        let pseudo = l4_sum6(p.src, p.dst, p.next, &[]) + p.l4.len() as u32;
        f[54 + at..56 + at].copy_from_slice(&fold(pseudo).to_be_bytes());
        let mut hdr = [0u8; VNET_HDR_LEN];
        hdr[0] = VIRTIO_NET_HDR_F_NEEDS_CSUM;
        hdr[6..8].copy_from_slice(&54u16.to_le_bytes());
        hdr[8..10].copy_from_slice(&(at as u16).to_le_bytes());
        write_frame_hdr(self.fd.as_fd(), hdr, &f)
    }
}

/// An ICMPv4 error as parsed from a frame: who sent it, to whom, its
/// (type, code), the quoted packet's tuple, and whether every checksum
/// is right (outer IP, ICMP, quoted IP, and the quoted UDP datagram's
/// when it is quoted whole).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IcmpError {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub kind: (u8, u8),
    pub inner_src: SocketAddrV4,
    pub inner_dst: SocketAddrV4,
    pub inner_proto: u8,
    pub checksums_ok: bool,
}

pub fn parse_icmp_error(f: &[u8]) -> Option<IcmpError> {
    let (src, dst, proto, icmp) = parse_ipv4(f)?;
    if proto != 1 || icmp.len() < 36 || ![3, 11, 12].contains(&icmp[0]) {
        return None;
    }
    let inner = &icmp[8..];
    let ihl = usize::from(inner[0] & 0x0f) * 4;
    let a = |o: usize| Ipv4Addr::new(inner[o], inner[o + 1], inner[o + 2], inner[o + 3]);
    let (isrc, idst, iproto) = (a(12), a(16), inner[9]);
    let l4 = inner.get(ihl..)?;
    let port = |o: usize| u16::from_be_bytes([l4[o], l4[o + 1]]);
    let outer_ihl = usize::from(f[14] & 0x0f) * 4;
    let mut ok = fold(sum16(&f[14..14 + outer_ihl])) == 0xffff
        && fold(sum16(icmp)) == 0xffff
        && fold(sum16(&inner[..ihl])) == 0xffff;
    let inner_len = usize::from(u16::from_be_bytes([inner[2], inner[3]]));
    if iproto == 17 && inner.len() >= inner_len && u16::from_be_bytes([l4[6], l4[7]]) != 0 {
        ok &= fold(l4_sum(isrc, idst, 17, &l4[..inner_len - ihl])) == 0xffff;
    }
    Some(IcmpError {
        src,
        dst,
        kind: (icmp[0], icmp[1]),
        inner_src: SocketAddrV4::new(isrc, port(0)),
        inner_dst: SocketAddrV4::new(idst, port(2)),
        inner_proto: iproto,
        checksums_ok: ok,
    })
}

/// An ICMPv4 error frame (`kind`: type, code) quoting `quoted` (an IP
/// packet, as much of it as given).
pub fn icmp_error_frame(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: Ipv4Addr,
    dst: Ipv4Addr,
    kind: (u8, u8),
    quoted: &[u8],
) -> Vec<u8> {
    let mut icmp = vec![kind.0, kind.1, 0, 0, 0, 0, 0, 0];
    icmp.extend_from_slice(quoted);
    let cs = !fold(sum16(&icmp));
    icmp[2..4].copy_from_slice(&cs.to_be_bytes());
    let mut f = eth_header(dst_mac, src_mac, ETH_P_IP);
    f.extend_from_slice(&ipv4_header(src, dst, 1, icmp.len()));
    f.extend_from_slice(&icmp);
    f
}
