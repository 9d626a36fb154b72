//! Numbered datagrams both ways through a live guest while a test does
//! something to the agent (restart, upgrade): what was lost is counted.

use std::net::SocketAddrV4;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::guest::Guest;
use super::world::{self, World};

/// Numbered datagrams in both directions while the test does something to
/// the agent: the guest sends to the world's echo server through SNAT (one
/// exchange at a time), the world sends to node:host_port (the port
/// mapping) and the guest echoes. Counts what went out and came back.
pub struct Flow {
    stop: Arc<AtomicBool>,
    egress: std::thread::JoinHandle<(u64, u64)>,
    ingress: std::thread::JoinHandle<(u64, u64)>,
}

impl Flow {
    /// `src`: the guest's port for every egress exchange (one long flow
    /// through SNAT), else a new port (a new flow) for each.
    pub fn start(
        g: Arc<Guest>,
        echo: SocketAddrV4,
        world_ns: &str,
        host_port: u16,
        src: Option<u16>,
    ) -> Flow {
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        let egress = std::thread::spawn(move || {
            let (mut sent, mut back) = (0, 0);
            while !st.load(Ordering::Relaxed) {
                sent += 1;
                let msg = format!("e{sent}");
                // One try only (the guest re-sends after 250 ms): a datagram
                // that does not come back within 240 ms counts as lost.
                if g.udp_exchange(src, echo, msg.as_bytes(), Duration::from_millis(240))
                    .is_ok_and(|(r, _)| r.ends_with(msg.as_bytes()))
                {
                    back += 1;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            (sent, back)
        });
        let st = stop.clone();
        let target = World::node_addr(host_port);
        let ns = world_ns.to_owned();
        let ingress = std::thread::spawn(move || {
            world::in_netns(&ns, move || {
                let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
                s.set_read_timeout(Some(Duration::from_millis(10))).unwrap();
                let (mut sent, got) = (0u64, AtomicU64::new(0));
                let mut seen = std::collections::HashSet::new();
                let mut buf = [0u8; 2048];
                let mut recv = |seen: &mut std::collections::HashSet<u64>| {
                    while let Ok((n, _)) = s.recv_from(&mut buf) {
                        if let Some(i) = std::str::from_utf8(&buf[..n])
                            .ok()
                            .and_then(|t| t.strip_prefix('i'))
                            .and_then(|t| t.parse::<u64>().ok())
                            && seen.insert(i)
                        {
                            got.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                };
                while !st.load(Ordering::Relaxed) {
                    sent += 1;
                    s.send_to(format!("i{sent}").as_bytes(), target).unwrap();
                    recv(&mut seen);
                }
                // Let the last echoes arrive.
                let until = Instant::now() + Duration::from_millis(500);
                while Instant::now() < until {
                    recv(&mut seen);
                }
                (sent, got.load(Ordering::Relaxed))
            })
        });
        Flow {
            stop,
            egress,
            ingress,
        }
    }

    /// ((egress sent, back), (ingress sent, back)).
    pub fn finish(self) -> ((u64, u64), (u64, u64)) {
        self.stop.store(true, Ordering::Relaxed);
        (self.egress.join().unwrap(), self.ingress.join().unwrap())
    }
}
