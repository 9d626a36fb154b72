//! Crash injection: kill -9 the agent at random moments of a storm of
//! ensure/release calls, restart it, and check that every acknowledged
//! change survived and nothing leaked. Root only.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Env, mappings, opts, ports, s, tap_info};

/// What a network looks like from outside: (ip, tap, mappings).
type Shape = (String, String, Vec<(String, u16, u16, String)>);

#[derive(Debug, Clone, PartialEq)]
enum Known {
    /// The last acknowledged call left it like this (None = released).
    Acked(Option<Shape>),
    /// A call was in flight when the agent died: either outcome is fine.
    Uncertain,
}

fn shape(d: &common::Dict) -> Shape {
    (s(d, "sandbox_ip"), s(d, "tap_name"), mappings(d))
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
    match rng.below(3) {
        0 => opts(vec![]),
        1 => opts(vec![("port_mappings", ports(&[("tcp", 80, 0, "")]))]),
        _ => opts(vec![(
            "port_mappings",
            ports(&[("udp", 53, 0, ""), ("tcp", 22, 31000 + idx as u16, "")]),
        )]),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_storm_loses_nothing_acknowledged() {
    require_root!();
    let iterations: u32 = std::env::var("CRASH_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(15);
    let seed = std::env::var("CRASH_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
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
                        Err(_) => {
                            // The agent died with this call in flight.
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

        // Every acknowledged state is there exactly; uncertain ones are
        // whatever the agent says, and become known.
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
                    "iteration {iter}: {id} lost an acknowledged change (seed {seed})"
                );
            }
            *known = Known::Acked(actual);
        }
        *model.lock().unwrap() = m;
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
        let fd = c.open_tap(&s(d, "sandbox_id")).await.unwrap();
        assert_eq!(tap_info(&fd).name, s(d, "tap_name"));
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
