//! Crash injection: kill -9 the agent at random moments of a storm of
//! ensure/release calls, restart it, and check that every acknowledged
//! change survived and nothing leaked. Root only.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Env, mappings, opts, ports, s, tap_info};

/// What a network looks like from outside: (ip, tap, mappings).
/// (sandbox IP, TAP, port mappings, ingress limit).
type Shape = (String, String, Vec<(String, u16, u16, String)>, u64);

#[derive(Debug, Clone, PartialEq)]
enum Known {
    /// The last acknowledged call left it like this (None = released).
    Acked(Option<Shape>),
    /// A call was in flight when the agent died: either outcome is fine.
    Uncertain,
}

fn shape(d: &common::Dict) -> Shape {
    let ingress = u64::try_from(d["ingress_bps"].try_clone().unwrap()).unwrap();
    (s(d, "sandbox_ip"), s(d, "tap_name"), mappings(d), ingress)
}

/// xorshift64*: deterministic from the printed seed.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

const TASKS: usize = 8;
const IDS_PER_TASK: usize = 4;

fn spec_for(rng: &mut Rng, idx: usize) -> common::Dict {
    match rng.below(4) {
        0 => opts(vec![]),
        1 => opts(vec![("port_mappings", ports(&[("tcp", 80, 0, "")]))]),
        // A bandwidth limit (a shaper on the TAP), changing between calls.
        2 => opts(vec![(
            "ingress_bps",
            zbus::zvariant::Value::from(10_000_000 * (1 + rng.below(3))),
        )]),
        _ => opts(vec![(
            "port_mappings",
            ports(&[("udp", 53, 0, ""), ("tcp", 22, 21000 + idx as u16, "")]),
        )]),
    }
}

/// A number from the environment, or `default`.
fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// CRASH_SEED, or one from the clock (printed by the tests, to replay).
fn seed() -> u64 {
    env_or(
        "CRASH_SEED",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
            | 1,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_storm_loses_nothing_acknowledged() {
    require_root!();
    let iterations: u32 = env_or("CRASH_ITERATIONS", 15);
    let seed = seed();
    eprintln!("crash test: {iterations} iterations, CRASH_SEED={seed}");
    let mut rng = Rng(seed);
    let mut env = Env::new(&["--warm-pool", "4"]);
    let capacity = env.client().await.property_u32("FreeAddresses").await;
    let model: Arc<Mutex<HashMap<String, Known>>> = Arc::default();

    for iter in 0..iterations {
        let c = env.client().await;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut tasks = vec![];
        for t in 0..TASKS {
            let c = c.clone();
            let model = model.clone();
            let stop = stop.clone();
            let mut trng = Rng(rng.next() | 1);
            tasks.push(tokio::spawn(async move {
                let mut calls = 0u32;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let idx = t * IDS_PER_TASK + trng.below(IDS_PER_TASK as u64) as usize;
                    let id = format!("crash-{idx}");
                    let ensure = trng.below(3) != 0;
                    let result = if ensure {
                        c.ensure(&id, spec_for(&mut trng, idx))
                            .await
                            .map(|d| Some(shape(&d)))
                    } else {
                        c.release(&id).await.map(|_| None)
                    };
                    let mut m = model.lock().unwrap();
                    match result {
                        Ok(state) => {
                            m.insert(id, Known::Acked(state));
                            calls += 1;
                        }
                        Err(e) => {
                            // Only the agent dying may fail a call: an
                            // error reply would end the storm silently.
                            assert!(died(&e), "{id}: {e:?}");
                            m.insert(id, Known::Uncertain);
                            return calls;
                        }
                    }
                }
                calls
            }));
        }
        let delay = Duration::from_millis(30 + rng.below(400));
        tokio::time::sleep(delay).await;
        env.kill_agent();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut calls = 0;
        for t in tasks {
            calls += t.await.unwrap();
        }
        let started = Instant::now();
        env.start_agent();
        let restart_ms = started.elapsed().as_millis();
        let c = env.client().await;

        check_model(&c, &model, &format!("iteration {iter}"), seed).await;
        check_invariants(&env, &c, capacity, iter).await;
        eprintln!(
            "iteration {iter}: killed after {delay:?} and {calls} acknowledged calls; ready again in {restart_ms} ms"
        );
    }
    // Release everything: the namespace ends with no sandbox TAP and no
    // neighbour, the pool back to its size.
    let c = env.client().await;
    for d in c.list().await {
        assert!(c.release(&s(&d, "sandbox_id")).await.unwrap());
    }
    assert!(env.sandbox_taps().is_empty());
    assert!(env.neighbours().is_empty());
    assert_eq!(c.property_u32("FreeAddresses").await, capacity);
    let deadline = Instant::now() + Duration::from_secs(30);
    while env.pool_taps().len() > 8 {
        assert!(
            Instant::now() < deadline,
            "pool TAPs leaked: {:?}",
            env.pool_taps()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every acknowledged state is there exactly; uncertain ones are whatever
/// the agent says, and become known.
async fn check_model(
    c: &common::Client,
    model: &Arc<Mutex<HashMap<String, Known>>>,
    when: &str,
    seed: u64,
) {
    let mut m = model.lock().unwrap().clone();
    for (id, known) in m.iter_mut() {
        let actual = match c.get(id).await {
            Ok(d) => Some(shape(&d)),
            Err(e) => {
                assert_eq!(
                    e.name, "org.cube.NetworkAgent.Error.NotFound",
                    "{id}: {e:?}"
                );
                None
            }
        };
        if let Known::Acked(expected) = known {
            assert_eq!(
                &actual, expected,
                "{when}: {id} lost an acknowledged change (seed {seed})"
            );
        }
        *known = Known::Acked(actual);
    }
    *model.lock().unwrap() = m;
}

async fn check_invariants(env: &Env, c: &common::Client, capacity: u32, iter: u32) {
    let list = c.list().await;
    let taps: BTreeSet<String> = list.iter().map(|d| s(d, "tap_name")).collect();
    let ips: BTreeSet<(String, String)> = list
        .iter()
        .map(|d| (s(d, "sandbox_ip"), "20:90:6f:fc:fc:fc".to_string()))
        .collect();
    assert_eq!(
        taps.len(),
        list.len(),
        "iteration {iter}: two networks share a TAP"
    );
    assert_eq!(
        env.sandbox_taps(),
        taps,
        "iteration {iter}: TAPs in the kernel vs networks"
    );
    let links = env.links();
    for t in &taps {
        assert!(links[t].up, "iteration {iter}: {t} is down");
    }
    assert_eq!(
        env.neighbours(),
        ips,
        "iteration {iter}: neighbour entries vs networks"
    );
    assert_eq!(
        c.property_u32("FreeAddresses").await,
        capacity - list.len() as u32,
        "iteration {iter}: leaked or double-booked addresses"
    );
    let mut host_ports: BTreeMap<(String, u16), String> = BTreeMap::new();
    for d in &list {
        for m in mappings(d) {
            if let Some(other) = host_ports.insert((m.0.clone(), m.2), s(d, "sandbox_id")) {
                panic!(
                    "iteration {iter}: {} port {} held by {other} and {}",
                    m.0,
                    m.2,
                    s(d, "sandbox_id")
                );
            }
        }
        let (id, tap) = (s(d, "sandbox_id"), s(d, "tap_name"));
        let fd = match c.open_tap(&id).await {
            Ok(fd) => fd,
            Err(e) if e.name == "org.cube.NetworkAgent.Error.TapBusy" => {
                // Correct only if another process really holds the TAP:
                // this test itself can, for a while after a kill -9 (an
                // OpenTap reply's fd still buffered in a dropped zbus
                // connection), and the agent adopts such a TAP without an
                // fd. Never the agent itself (one TAP owned twice).
                let holders = common::tap_holders(&tap);
                assert!(
                    !holders.is_empty() && !holders.contains(&env.agent_pid()),
                    "iteration {iter}: {id}: TapBusy, but {tap} is held by {holders:?} \
                     (agent pid {})",
                    env.agent_pid()
                );
                eprintln!("iteration {iter}: {id}: {tap} held by {holders:?}: TapBusy is right");
                continue;
            }
            Err(e) => panic!("iteration {iter}: OpenTap {id}: {e:?}"),
        };
        assert_eq!(tap_info(&fd).name, tap);
    }
    // Exactly one record per network in the store directory's view: the
    // agent lists what it recovered, and the Health check reports no
    // quarantined records (nothing was corrupt).
    let (_, checks) = c.health().await;
    let rec = checks.iter().find(|c| c.0 == "recovery").unwrap();
    assert!(
        rec.1,
        "iteration {iter}: recovery reported problems: {}",
        rec.2
    );
}

/// A call that failed because the agent died under it (no reply, no owner
/// of the name), not because the agent answered with an error.
fn died(e: &common::CallError) -> bool {
    e.name == "transport" || e.name.starts_with("org.freedesktop.DBus.Error.")
}

/// One round's storm: ensure/release/OpenTap clients next to parallel
/// `ReconcileNetwork ""` callers. Returns the reconcile reports' removals
/// with the networks that were live and unchanged across each call.
struct StormRound {
    acked_calls: u32,
    reconciles: u32,
    /// (what Reconcile removed, IPs of networks stable across that call)
    removals: Vec<(String, BTreeSet<String>)>,
}

/// Per sandbox id: (calls started, calls finished), to tell a network that
/// was left alone for a while from one with a call in flight.
type InFlight = Arc<Mutex<HashMap<String, (u64, u64)>>>;

async fn storm_round(
    env: &mut Env,
    model: &Arc<Mutex<HashMap<String, Known>>>,
    rng: &mut Rng,
    run_for: Duration,
    crash: bool,
) -> StormRound {
    let c = &env.client().await;
    let agent_pid = env.agent_pid();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flight: InFlight = Arc::default();
    let mut clients = vec![];
    for t in 0..TASKS {
        let (c, model, stop, flight) = (c.clone(), model.clone(), stop.clone(), flight.clone());
        let mut trng = Rng(rng.next() | 1);
        clients.push(tokio::spawn(async move {
            let mut calls = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let idx = t * IDS_PER_TASK + trng.below(IDS_PER_TASK as u64) as usize;
                let id = format!("storm-{idx}");
                flight.lock().unwrap().entry(id.clone()).or_default().0 += 1;
                let result = match trng.below(5) {
                    0 | 1 => c
                        .ensure(&id, spec_for(&mut trng, idx))
                        .await
                        .map(|d| Some(Some(shape(&d)))),
                    2 => c.release(&id).await.map(|_| Some(None)),
                    _ => match c.open_tap(&id).await {
                        Ok(fd) => {
                            // The fd must be the network's TAP, usable.
                            let info = tap_info(&fd);
                            let m = model.lock().unwrap();
                            if let Some(Known::Acked(Some(shape))) = m.get(&id) {
                                assert_eq!(info.name, shape.1, "{id}: OpenTap gave another TAP");
                            }
                            Ok(None)
                        }
                        Err(e) if e.name == "org.cube.NetworkAgent.Error.NotFound" => Ok(None),
                        // As in the checks between rounds: right only while
                        // another process than the agent holds the TAP (this
                        // test can, after a kill -9, through an OpenTap
                        // reply's fd still buffered in a dropped zbus
                        // connection).
                        Err(e) if e.name == "org.cube.NetworkAgent.Error.TapBusy" => {
                            let holders = match c.get(&id).await {
                                Ok(d) => common::tap_holders(&s(&d, "tap_name")),
                                Err(_) => vec![],
                            };
                            if holders.is_empty() || holders.contains(&agent_pid) {
                                Err(e)
                            } else {
                                Ok(None)
                            }
                        }
                        Err(e) => Err(e),
                    },
                };
                let mut m = model.lock().unwrap();
                flight.lock().unwrap().entry(id.clone()).or_default().1 += 1;
                match result {
                    Ok(Some(state)) => {
                        m.insert(id, Known::Acked(state));
                        calls += 1;
                    }
                    Ok(None) => calls += 1,
                    Err(e) => {
                        assert!(crash && died(&e), "{id}: a call failed: {e:?}");
                        m.insert(id, Known::Uncertain);
                        return calls;
                    }
                }
            }
            calls
        }));
    }
    let mut reconcilers = vec![];
    for _ in 0..3 {
        let (c, model, stop, flight) = (c.clone(), model.clone(), stop.clone(), flight.clone());
        reconcilers.push(tokio::spawn(async move {
            // Live networks with no call in flight: id -> (ip, calls so far).
            let stable_ips = |m: &HashMap<String, Known>| -> BTreeMap<String, (String, u64)> {
                let f = flight.lock().unwrap();
                m.iter()
                    .filter_map(
                        |(id, k)| match (k, f.get(id).copied().unwrap_or_default()) {
                            (Known::Acked(Some(shape)), (started, done)) if started == done => {
                                Some((id.clone(), (shape.0.clone(), started)))
                            }
                            _ => None,
                        },
                    )
                    .collect()
            };
            let (mut n, mut removals) = (0u32, vec![]);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let before = stable_ips(&model.lock().unwrap());
                match c.reconcile("").await {
                    Ok(report) => {
                        n += 1;
                        let errors: Vec<String> =
                            Vec::<String>::try_from(report["errors"].try_clone().unwrap()).unwrap();
                        assert!(errors.is_empty(), "Reconcile errors: {errors:?}");
                        let after = stable_ips(&model.lock().unwrap());
                        // Same address, no call started or finished meanwhile.
                        let stable: BTreeSet<String> = before
                            .iter()
                            .filter(|(id, v)| after.get(*id) == Some(v))
                            .map(|(_, (ip, _))| ip.clone())
                            .collect();
                        for r in
                            Vec::<String>::try_from(report["removed"].try_clone().unwrap()).unwrap()
                        {
                            removals.push((r, stable.clone()));
                        }
                    }
                    Err(e) => {
                        assert!(crash && died(&e), "ReconcileNetwork failed: {e:?}");
                        break;
                    }
                }
            }
            (n, removals)
        }));
    }
    tokio::time::sleep(run_for).await;
    if crash {
        env.kill_agent();
    }
    // On a crash round the calls in flight fail and their tasks end; the
    // others stop at their next turn.
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut round = StormRound {
        acked_calls: 0,
        reconciles: 0,
        removals: vec![],
    };
    for t in clients {
        round.acked_calls += t.await.unwrap();
    }
    for t in reconcilers {
        let (n, r) = t.await.unwrap();
        round.reconciles += n;
        round.removals.extend(r);
    }
    round
}

/// Removals reported by Reconcile may only be leftovers: never the TAP or
/// neighbour of a network that was live and unchanged across the call.
fn check_removals(round: &StormRound, iter: u32) {
    for (what, stable) in &round.removals {
        let ip = if let Some(tap) = what.strip_prefix("orphan TAP ctap") {
            let n = u32::from_str_radix(tap, 16)
                .unwrap_or_else(|e| panic!("round {iter}: TAP name {what}: {e}"));
            std::net::Ipv4Addr::from(n).to_string()
        } else if let Some(ip) = what.strip_prefix("stale neighbour ") {
            ip.to_owned()
        } else {
            panic!("round {iter}: unexpected removal {what:?}");
        };
        assert!(
            !stable.contains(&ip),
            "round {iter}: Reconcile removed {what} of a live network"
        );
    }
}

async fn check_datapath_and_pool(env: &Env, c: &common::Client, iter: u32) {
    use cube_network_agent::datapath::maps::{DpSandbox, DpTap};
    let pins = env.dir.join("bpf");
    let open = |name: &str| aya::maps::MapData::from_pin(pins.join(name)).unwrap();
    let sandboxes: aya::maps::HashMap<_, u32, DpSandbox> =
        aya::maps::HashMap::try_from(aya::maps::Map::HashMap(open("sandboxes"))).unwrap();
    let by_ip: aya::maps::HashMap<_, u32, DpTap> =
        aya::maps::HashMap::try_from(aya::maps::Map::HashMap(open("by_ip"))).unwrap();
    let links = env.links();
    for d in c.list().await {
        let id = s(&d, "sandbox_id");
        let tap = s(&d, "tap_name");
        let link = &links[&tap];
        assert!(
            link.up && link.mtu == common::u(&d, "mtu"),
            "round {iter}: {id}: {tap} {link:?}"
        );
        let ip: std::net::Ipv4Addr = s(&d, "sandbox_ip").parse().unwrap();
        let ip_key = u32::from_ne_bytes(ip.octets());
        let sb = sandboxes
            .get(&link.ifindex, 0)
            .unwrap_or_else(|e| panic!("round {iter}: {id}: no sandboxes entry for {tap}: {e}"));
        assert_eq!(sb.sandbox_ip, ip_key, "round {iter}: {id}");
        let t = by_ip
            .get(&ip_key, 0)
            .unwrap_or_else(|e| panic!("round {iter}: {id}: no by_ip entry: {e}"));
        assert_eq!(t.ifindex, link.ifindex, "round {iter}: {id}");
    }
    // The kernel's pool is what the agent says it holds, once deletions of
    // surplus TAPs (batched, within a second) are through.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (kernel, idle) = (env.pool_taps().len(), c.property_u32("IdleTaps").await);
        // The pool keeps between its target (4) and twice it.
        if kernel == idle as usize && (4..=8).contains(&idle) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "round {iter}: {kernel} pool TAPs in the kernel, IdleTaps {idle}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The storm of issue 9: 8 clients ensure/release/OpenTap while 3 callers
/// run `ReconcileNetwork ""` in parallel, in rounds that end either quietly
/// (then every invariant is checked on the live agent, so damage done by
/// Reconcile cannot hide behind a restart's repairs) or with kill -9 at a
/// random moment (then every acknowledged change must survive).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storm_with_parallel_reconcile_and_kill_9() {
    require_root!();
    let seconds: u64 = env_or("STORM_SECONDS", 30);
    let seed = seed();
    eprintln!("storm: {seconds} s of storm, CRASH_SEED={seed}");
    let mut rng = Rng(seed);
    let mut env = Env::new(&["--warm-pool", "4"]);
    let capacity = env.client().await.property_u32("FreeAddresses").await;
    let model: Arc<Mutex<HashMap<String, Known>>> = Arc::default();
    let started = Instant::now();
    let (mut iter, mut reconciles, mut calls, mut crashes) = (0u32, 0u32, 0u32, 0u32);
    while started.elapsed() < Duration::from_secs(seconds) {
        iter += 1;
        let crash = iter % 2 == 0;
        let run_for = Duration::from_millis(300 + rng.below(2000));
        let round = storm_round(&mut env, &model, &mut rng, run_for, crash).await;
        if crash {
            crashes += 1;
            env.start_agent();
        } else {
            calls += round.acked_calls;
            reconciles += round.reconciles;
            check_removals(&round, iter);
        }
        let c = env.client().await;
        check_model(&c, &model, &format!("round {iter}"), seed).await;
        check_invariants(&env, &c, capacity, iter).await;
        check_datapath_and_pool(&env, &c, iter).await;
    }
    eprintln!(
        "storm: {iter} rounds ({crashes} ended by kill -9), {calls} acknowledged calls and \
         {reconciles} ReconcileNetwork \"\" calls in the quiet rounds, 0 violations"
    );
    assert!(reconciles > 0 && calls > 0, "the storm did nothing");
}
