//! A long-running test guest for tests/systemd/run.sh: one sandbox on the
//! far side of a TAP fd (fd 3, as `cubenetctl open-tap ID -- flow-guest …`
//! hands it over), with two continuous UDP flows whose every datagram is
//! accounted for, so a test can prove that nothing is lost while the agent
//! is killed, restarted or stopped.
//!
//! * out: every `--interval-ms` a numbered datagram `out <seq>` from
//!   169.254.68.6:<src-port> to `--dst` (an echo server in the world, through
//!   the agent's SNAT); the echoes are matched by sequence number.
//! * in: every UDP datagram arriving on `--echo-port` (the container port of
//!   a port mapping) is sent back to its source.
//!
//! The guest has no IP stack: it answers ARP for the guest address and
//! builds/parses the frames itself with the raw-frame helpers of the test
//! harness (tests/common/guest.rs, `RawGuest`), so nothing else (no ICMP
//! port-unreachable for echoes) leaves it.
//!
//! Every 100 ms it rewrites `--status FILE` (atomically) with one line:
//! `pid=P sent=N echoed=M lost=L pending=K in=I echoed_in=J lost_seqs=…`
//! where `lost` counts datagrams sent more than `--lost-after-ms` (1000)
//! ago whose echo has not arrived (a late echo takes it back), `pending`
//! those sent more recently and not yet echoed, `in` the datagrams received
//! on the echo port and `echoed_in` those it sent back.
//!
//! Usage: flow-guest --status FILE --dst IP:PORT [--echo-port 7000]
//!        [--src-port N] [--interval-ms 10] [--fd 3]

#[path = "../tests/common/guest.rs"]
mod guest;

use std::net::SocketAddrV4;
use std::os::fd::{FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use guest::{
    ARP_REPLY, ARP_REQUEST, GATEWAY_MAC, GUEST_IP, GUEST_MAC, RawGuest, arp_frame, parse_arp,
    parse_ipv4, udp_frame,
};

struct Args {
    status: String,
    dst: SocketAddrV4,
    echo_port: u16,
    src_port: u16,
    interval: Duration,
    lost_after: Duration,
    fd: i32,
}

fn usage(msg: &str) -> ! {
    eprintln!("flow-guest: {msg}");
    eprintln!(
        "usage: flow-guest --status FILE --dst IP:PORT [--echo-port 7000] [--src-port N] [--interval-ms 10] [--lost-after-ms 1000] [--fd 3]"
    );
    std::process::exit(2)
}

fn parse_args() -> Args {
    let mut status = None;
    let mut dst = None;
    let mut echo_port = 7000u16;
    let mut src_port = 40000 + (std::process::id() % 20000) as u16;
    let mut interval = Duration::from_millis(10);
    let mut lost_after = Duration::from_millis(1000);
    let mut fd = 3;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut val = || {
            it.next()
                .unwrap_or_else(|| usage(&format!("{a} needs a value")))
        };
        let num = |v: String| -> u64 {
            v.parse()
                .unwrap_or_else(|_| usage(&format!("{a}: '{v}' is not a number")))
        };
        match a.as_str() {
            "--status" => status = Some(val()),
            "--dst" => {
                let v = val();
                dst = Some(
                    v.parse()
                        .unwrap_or_else(|_| usage(&format!("--dst: '{v}' is not IP:PORT"))),
                )
            }
            "--echo-port" => echo_port = num(val()) as u16,
            "--src-port" => src_port = num(val()) as u16,
            "--interval-ms" => interval = Duration::from_millis(num(val())),
            "--lost-after-ms" => lost_after = Duration::from_millis(num(val())),
            "--fd" => fd = num(val()) as i32,
            _ => usage(&format!("unknown argument '{a}'")),
        }
    }
    Args {
        status: status.unwrap_or_else(|| usage("--status is required")),
        dst: dst.unwrap_or_else(|| usage("--dst is required")),
        echo_port,
        src_port,
        interval,
        lost_after,
        fd,
    }
}

#[derive(Default)]
struct Counters {
    /// Send time and "echo seen" per sequence number.
    sent: Vec<(Instant, bool)>,
    echoed: u64,
    /// Sequence numbers below this are decided (older than lost_after).
    decided: usize,
    lost: Vec<usize>,
    dup_echoes: u64,
    inbound: u64,
    echoed_in: u64,
    arp_replies: u64,
    other: u64,
}

fn main() {
    let args = parse_args();
    // SAFETY: the fd number comes from the caller (cubenetctl open-tap puts
    // the TAP on fd 3); nothing else in this process owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(args.fd) };
    if let Err(e) = check_fd(args.fd) {
        usage(&format!("fd {}: {e}", args.fd));
    }
    let g = RawGuest::new(fd);
    let src = SocketAddrV4::new(GUEST_IP, args.src_port);
    let mut c = Counters::default();
    let tmp = format!("{}.tmp", args.status);
    let start = Instant::now();
    let mut next_send = start;
    let mut next_status = start;
    loop {
        let now = Instant::now();
        if now >= next_send {
            let seq = c.sent.len();
            let payload = format!("out {seq}");
            let f = udp_frame(GUEST_MAC, GATEWAY_MAC, src, args.dst, payload.as_bytes());
            if let Err(e) = g.send(&f) {
                eprintln!("flow-guest: send seq {seq}: {e}");
            }
            c.sent.push((now, false));
            next_send += args.interval;
            if next_send < now {
                next_send = now + args.interval; // fell behind: no burst
            }
        }
        if now >= next_status {
            write_status(&args, &mut c, &tmp);
            next_status = now + Duration::from_millis(100);
        }
        let wait = next_send
            .min(next_status)
            .saturating_duration_since(Instant::now());
        // Handle every frame that arrives before the next tick.
        let _ = g.recv_match(wait, |f| {
            handle(&g, &args, src, &mut c, f);
            false
        });
    }
}

fn check_fd(fd: i32) -> Result<(), String> {
    // SAFETY: F_GETFD on an fd number; no memory is passed.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        Err(std::io::Error::last_os_error().to_string())
    } else {
        Ok(())
    }
}

fn handle(g: &RawGuest, args: &Args, src: SocketAddrV4, c: &mut Counters, f: &[u8]) {
    if let Some(a) = parse_arp(f) {
        if a.op == ARP_REQUEST && a.target_ip == GUEST_IP {
            let r = arp_frame(
                a.sender_mac,
                ARP_REPLY,
                GUEST_MAC,
                GUEST_IP,
                a.sender_mac,
                a.sender_ip,
            );
            let _ = g.send(&r);
            c.arp_replies += 1;
        }
        return;
    }
    let Some((ip_src, ip_dst, proto, l4)) = parse_ipv4(f) else {
        c.other += 1;
        return;
    };
    if proto != 17 || ip_dst != GUEST_IP || l4.len() < 8 {
        c.other += 1;
        return;
    }
    let sport = u16::from_be_bytes([l4[0], l4[1]]);
    let dport = u16::from_be_bytes([l4[2], l4[3]]);
    let payload = &l4[8..];
    if dport == args.echo_port {
        c.inbound += 1;
        let back = udp_frame(
            GUEST_MAC,
            GATEWAY_MAC,
            SocketAddrV4::new(GUEST_IP, args.echo_port),
            SocketAddrV4::new(ip_src, sport),
            payload,
        );
        if g.send(&back).is_ok() {
            c.echoed_in += 1;
        }
    } else if dport == src.port() && ip_src == *args.dst.ip() && sport == args.dst.port() {
        let seq = std::str::from_utf8(payload)
            .ok()
            .and_then(|s| s.strip_prefix("out "))
            .and_then(|n| n.parse::<usize>().ok());
        match seq {
            Some(s) if s < c.sent.len() => {
                if c.sent[s].1 {
                    c.dup_echoes += 1;
                } else {
                    c.sent[s].1 = true;
                    c.echoed += 1;
                    if s < c.decided {
                        c.lost.retain(|&l| l != s); // a late echo
                    }
                }
            }
            _ => c.other += 1,
        }
    } else {
        c.other += 1;
    }
}

fn write_status(args: &Args, c: &mut Counters, tmp: &str) {
    let now = Instant::now();
    while c.decided < c.sent.len() && now.duration_since(c.sent[c.decided].0) >= args.lost_after {
        if !c.sent[c.decided].1 {
            c.lost.push(c.decided);
        }
        c.decided += 1;
    }
    let pending = c.sent[c.decided..].iter().filter(|s| !s.1).count();
    let lost_seqs: Vec<String> = c.lost.iter().take(20).map(|s| s.to_string()).collect();
    let line = format!(
        "pid={} src_port={} sent={} echoed={} lost={} pending={} in={} echoed_in={} dup={} arp={} other={} lost_seqs={}\n",
        std::process::id(),
        args.src_port,
        c.sent.len(),
        c.echoed,
        c.lost.len(),
        pending,
        c.inbound,
        c.echoed_in,
        c.dup_echoes,
        c.arp_replies,
        c.other,
        if lost_seqs.is_empty() {
            "-".to_string()
        } else {
            lost_seqs.join(",")
        },
    );
    if std::fs::write(tmp, line).is_ok() {
        let _ = std::fs::rename(tmp, &args.status);
    }
}
