//! dnsmasq in the world namespace as the agent's upstream resolver
//! (Debian package dnsmasq-base; .ci/run installs it), killed on drop.

#![allow(dead_code)]

use std::net::{SocketAddrV4, UdpSocket};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::world::{WORLD_IP, World};

pub struct Dnsmasq(Child);

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Serves on the world's address, port 53, with `records` (dnsmasq
/// options: `--address=...`, `--host-record=...`); returns once it
/// answers `probe` (a name it has an A record for).
pub fn start(world: &World, records: &[String], probe: &str) -> Dnsmasq {
    let child = Command::new("ip")
        .args([
            "netns",
            "exec",
            &world.ns,
            "dnsmasq",
            "--keep-in-foreground",
        ])
        .args(["--conf-file=/dev/null", "--user=root", "--group=root"])
        .args([
            "--pid-file=",
            "--bind-interfaces",
            "--no-resolv",
            "--no-hosts",
        ])
        .arg(format!("--listen-address={WORLD_IP}"))
        .args(records)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("dnsmasq (Debian package dnsmasq-base; .ci/run installs it)");
    let guard = Dnsmasq(child);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let q = cube_network_agent::dns::encode_query(1, probe, 1);
        let got = world.run(move || {
            let s = UdpSocket::bind("0.0.0.0:0").unwrap();
            s.set_read_timeout(Some(Duration::from_millis(200)))
                .unwrap();
            s.send_to(&q, SocketAddrV4::new(WORLD_IP, 53)).unwrap();
            let mut b = [0u8; 512];
            s.recv(&mut b).is_ok()
        });
        if got {
            return guard;
        }
        assert!(Instant::now() < deadline, "dnsmasq did not answer");
    }
}
