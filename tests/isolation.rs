//! Tenant isolation (issue 16), end to end with real packets: nothing a
//! VMM, a guest or a host process does reaches another tenant's traffic.
//! Root only; every test runs the real agent in namespaces of its own.

mod common;

use std::net::SocketAddrV4;
use std::time::Duration;

use common::guest::{GATEWAY_MAC, GUEST_IP, GUEST_MAC, RawGuest, udp_frame};
use common::world::{guest_for, node};
use common::{Env, opts, s};

const T: Duration = Duration::from_secs(5);

fn ifindex(net: &common::Dict) -> i32 {
    i32::try_from(net["tap_ifindex"].try_clone().unwrap()).unwrap()
}

/// Polls until link `name` is gone (true) or 5 s passed (false).
fn wait_gone(env: &Env, name: &str) -> bool {
    let deadline = std::time::Instant::now() + T;
    while std::time::Instant::now() < deadline {
        if !env.links().contains_key(name) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// A VMM that keeps its TAP fd after ReleaseNetwork (slow, hung or
/// hostile) never sees or speaks for the next sandboxes: the handed-out
/// TAP is deleted, never pooled, while new sandboxes cycle through the
/// pool and talk to the world.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tap_a_vmm_still_holds_never_reaches_the_next_sandbox() {
    require_root!();
    let (env, world) = node(&["--warm-pool", "2"]);
    let c = env.client().await;
    let echo = world.udp_echo(5300);
    // A server only the old holder's frames could reach.
    let trap = world.udp_echo(5301);

    let a = c.ensure("vm-a", opts(vec![])).await.unwrap();
    let (tap_a, index_a) = (s(&a, "tap_name"), ifindex(&a));
    let holder = RawGuest::new(c.open_tap("vm-a").await.unwrap());
    assert!(c.release("vm-a").await.unwrap());

    // More sandboxes than the pool holds, released and created again, each
    // with a live guest talking to the world; the holder listens and
    // sends all along.
    let mut live = vec![];
    for i in 0..8 {
        let id = format!("vm-b{i}");
        let (net, g) = guest_for(&c, &id, opts(vec![])).await;
        assert_ne!(s(&net, "tap_name"), tap_a, "{id} got the held TAP");
        assert_ne!(ifindex(&net), index_a, "{id} got the held TAP's device");
        let msg = format!("b{i}");
        assert_eq!(
            g.udp_send_recv(echo, msg.as_bytes(), T).unwrap(),
            format!("world:{msg}").as_bytes()
        );
        let spoof = udp_frame(
            GUEST_MAC,
            GATEWAY_MAC,
            SocketAddrV4::new(GUEST_IP, 40000 + i),
            trap,
            format!("holder-{i}").as_bytes(),
        );
        // The write may fail (the device is down or gone): either way
        // nothing may leave.
        let _ = holder.send(&spoof);
        let seen = holder.recv(Duration::from_millis(200));
        assert!(
            seen.is_empty(),
            "the old holder read {} frame(s) while {id} was live",
            seen.len()
        );
        live.push((id, g));
        if i % 2 == 1 {
            let (id, mut g) = live.remove(0);
            g.stop();
            assert!(c.release(&id).await.unwrap());
        }
    }
    assert!(
        world.peers(5301).is_empty(),
        "frames written to the old TAP fd left the node: {:?}",
        world.peers(5301)
    );
    assert!(wait_gone(&env, &tap_a), "{tap_a} was not deleted");
    let (healthy, checks) = c.health().await;
    assert!(healthy, "{checks:?}");
}
