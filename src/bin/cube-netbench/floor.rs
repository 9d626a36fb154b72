//! The bus floor of an ensure+release pair: a process of its own (this
//! binary run as `cube-netbench --serve-floor ADDRESS`) that answers the
//! same calls with the same messages as the agent (reply dictionary of the
//! same shape, an object per network under an ObjectManager, so
//! InterfacesAdded/Removed carry the same properties, NetworkEnsured and
//! NetworkReleased) and does nothing else: no kernel, no disk, no locks.
//! Pairs/s against it is what dbus-daemon and zbus allow on this machine;
//! the agent can only come below it.
//!
//! With `--kernel` (run inside a network namespace of its own) it also does
//! exactly the kernel work the safe TAP lifecycle cannot skip, nothing
//! more: a warm pool of TAPs created in the background (TUNSETIFF, IPv6
//! off, a clsact qdisc joined to a shared tc block, as every TAP running
//! the datapath is), each EnsureNetwork takes one up (one RTM_NEWLINK), each
//! ReleaseNetwork moves its TAP into the retire group (one RTM_NEWLINK),
//! and retired TAPs are deleted in batches by group, as the agent does.
//! No disk, no datapath, no neighbour entries: the agent's own work is
//! what it adds to this floor.

use std::collections::HashMap;
use std::sync::Mutex;

use zbus::object_server::SignalEmitter;
use zbus::zvariant::{OwnedValue, Value};
use zbus::{Connection, interface};

pub const PATH: &str = "/org/cube/BenchFloor";
pub const IFACE: &str = "org.cube.BenchFloor";

type Dict = HashMap<String, OwnedValue>;

fn owned(v: Value<'_>) -> OwnedValue {
    v.try_to_owned().expect("no fds")
}

/// A network dictionary of the agent's shape (the same keys and types,
/// values of typical length).
fn network_dict(id: &str) -> Dict {
    let mut d = Dict::new();
    let mut put = |k: &str, v: Value<'_>| {
        d.insert(k.to_owned(), owned(v));
    };
    put("sandbox_id", Value::from(id));
    put(
        "network_handle",
        Value::from("5f0c1f6b0a7d4c2e9a1b3c4d5e6f7a8b"),
    );
    put("tap_name", Value::from("ctapw1234"));
    put("tap_ifindex", Value::from(1234i32));
    put("sandbox_ip", Value::from("10.96.4.210"));
    put("guest_ip", Value::from("169.254.68.6/30"));
    put("gateway_ip", Value::from("169.254.68.5"));
    put("guest_mac", Value::from("20:90:6f:fc:fc:fc"));
    put("gateway_mac", Value::from("20:90:6f:cf:cf:cf"));
    put("mtu", Value::from(1500u32));
    put(
        "port_mappings",
        Value::from(Vec::<(String, u16, u16, String)>::new()),
    );
    put("allow_internet_access", Value::from(true));
    put("allow_out", Value::from(Vec::<String>::new()));
    put("deny_out", Value::from(Vec::<String>::new()));
    put("metadata", Value::from(HashMap::<String, String>::new()));
    let route = vec![(
        "0.0.0.0/0".to_owned(),
        "169.254.68.5".to_owned(),
        "eth0".to_owned(),
    )];
    put("routes", Value::from(route));
    let neigh = vec![(
        "169.254.68.5".to_owned(),
        "20:90:6f:cf:cf:cf".to_owned(),
        "eth0".to_owned(),
    )];
    put("arp_neighbors", Value::from(neigh));
    put("created_unix", Value::from(1_764_554_400u64));
    put("attach", Value::from("tap"));
    d
}

/// NetworkEnsured's dictionary, as the agent sends it.
fn ensured_dict() -> Dict {
    let mut d = Dict::new();
    d.insert("change".into(), owned(Value::from("created")));
    d.insert(
        "network_handle".into(),
        owned(Value::from("5f0c1f6b0a7d4c2e9a1b3c4d5e6f7a8b")),
    );
    d.insert("tap_name".into(), owned(Value::from("ctapw1234")));
    d.insert("tap_ifindex".into(), owned(Value::from(1234i32)));
    d.insert("sandbox_ip".into(), owned(Value::from("10.96.4.210")));
    d
}

fn net_path(id: &str) -> String {
    format!("{PATH}/network/{}", id.replace(['-', '.', ':'], "_"))
}

/// One network's object: the agent's ten properties.
struct FloorNetwork {
    id: String,
}

#[interface(name = "org.cube.BenchFloor.Network")]
impl FloorNetwork {
    #[zbus(property)]
    fn sandbox_id(&self) -> String {
        self.id.clone()
    }
    #[zbus(property)]
    fn network_handle(&self) -> String {
        "5f0c1f6b0a7d4c2e9a1b3c4d5e6f7a8b".into()
    }
    #[zbus(property)]
    fn sandbox_ip(&self) -> String {
        "10.96.4.210".into()
    }
    #[zbus(property)]
    fn tap_name(&self) -> String {
        "ctapw1234".into()
    }
    #[zbus(property)]
    fn tap_ifindex(&self) -> i32 {
        1234
    }
    #[zbus(property)]
    fn mtu(&self) -> u32 {
        1500
    }
    #[zbus(property)]
    fn port_mappings(&self) -> Vec<(String, u16, u16, String)> {
        vec![]
    }
    #[zbus(property)]
    fn allow_internet_access(&self) -> bool {
        true
    }
    #[zbus(property)]
    fn allow_out(&self) -> Vec<String> {
        vec![]
    }
    #[zbus(property)]
    fn deny_out(&self) -> Vec<String> {
        vec![]
    }
}

/// The kernel part of `--kernel`: TAPs and the netlink socket.
struct Kernel {
    nl: cube_network_agent::netlink::Netlink,
    /// The agent's default retire group and tc block (the floor runs in a
    /// namespace of its own).
    retire_group: u32,
    block: u32,
    pool: Mutex<Pool>,
    wake: tokio::sync::Notify,
}

#[derive(Default)]
struct Pool {
    idle: Vec<(cube_network_agent::tap::Tap, u32)>,
    used: HashMap<String, (cube_network_agent::tap::Tap, u32)>,
    retired: Vec<cube_network_agent::tap::Tap>,
    next: u64,
}

/// The agent's pool size in the bench (`--warm-pool 64`) and deletion
/// batch (see `agent::pool`).
const POOL: usize = 64;
const DELETE_BATCH: usize = 32;

impl Kernel {
    fn lock(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn create(&self) -> Result<(cube_network_agent::tap::Tap, u32), String> {
        let name = {
            let mut p = self.lock();
            p.next += 1;
            format!("cfl{}", p.next)
        };
        let tap = cube_network_agent::tap::Tap::create(&name).map_err(|e| e.to_string())?;
        let _ = cube_network_agent::sysctl::disable_ipv6(&name);
        let ifindex = nix::net::if_::if_nametoindex(name.as_str()).map_err(|e| e.to_string())?;
        // Joined to a shared tc block, as every TAP must be to run the
        // datapath (its teardown is part of the deletion too).
        cube_network_agent::datapath::tc::add_clsact(ifindex, Some(self.block))
            .map_err(|e| e.to_string())?;
        Ok((tap, ifindex))
    }

    /// Background: refill the pool, delete retired TAPs in batches.
    async fn run(self: std::sync::Arc<Self>) {
        loop {
            while self.lock().idle.len() < POOL {
                let me = self.clone();
                match tokio::task::spawn_blocking(move || me.create()).await {
                    Ok(Ok(t)) => self.lock().idle.push(t),
                    _ => break,
                }
            }
            let batch = std::mem::take(&mut self.lock().retired);
            if !batch.is_empty() {
                let _ = self.nl.delete_group(self.retire_group).await;
                tokio::task::spawn_blocking(move || drop(batch));
            }
            let _ =
                tokio::time::timeout(std::time::Duration::from_millis(200), self.wake.notified())
                    .await;
        }
    }

    async fn take(&self, id: &str) -> zbus::fdo::Result<()> {
        let got = self.lock().idle.pop();
        let (tap, ifindex) = match got {
            Some(t) => t,
            None => self.create().map_err(zbus::fdo::Error::Failed)?,
        };
        self.wake.notify_one();
        let change = cube_network_agent::netlink::LinkChange {
            mtu: Some(1300),
            up: Some(true),
            ..Default::default()
        };
        self.nl
            .set_link(ifindex, change)
            .await
            .map_err(|e| zbus::fdo::Error::Failed(e.to_string()))?;
        self.lock().used.insert(id.to_owned(), (tap, ifindex));
        Ok(())
    }

    async fn retire(&self, id: &str) -> zbus::fdo::Result<()> {
        let Some((tap, ifindex)) = self.lock().used.remove(id) else {
            return Ok(());
        };
        let change = cube_network_agent::netlink::LinkChange {
            group: Some(self.retire_group),
            ..Default::default()
        };
        self.nl
            .set_link(ifindex, change)
            .await
            .map_err(|e| zbus::fdo::Error::Failed(e.to_string()))?;
        let full = {
            let mut p = self.lock();
            p.retired.push(tap);
            p.retired.len() >= DELETE_BATCH
        };
        if full {
            self.wake.notify_one();
        }
        Ok(())
    }
}

struct Floor {
    kernel: Option<std::sync::Arc<Kernel>>,
}

#[interface(name = "org.cube.BenchFloor")]
impl Floor {
    async fn ensure_network(
        &self,
        sandbox_id: String,
        _options: HashMap<String, OwnedValue>,
        #[zbus(object_server)] server: &zbus::ObjectServer,
        #[zbus(signal_emitter)] emitter: SignalEmitter<'_>,
    ) -> zbus::fdo::Result<Dict> {
        if let Some(k) = &self.kernel {
            k.take(&sandbox_id).await?;
        }
        server
            .at(
                net_path(&sandbox_id),
                FloorNetwork {
                    id: sandbox_id.clone(),
                },
            )
            .await?;
        Self::network_ensured(&emitter, &sandbox_id, ensured_dict()).await?;
        Ok(network_dict(&sandbox_id))
    }

    async fn release_network(
        &self,
        sandbox_id: String,
        #[zbus(object_server)] server: &zbus::ObjectServer,
        #[zbus(signal_emitter)] emitter: SignalEmitter<'_>,
    ) -> zbus::fdo::Result<bool> {
        if let Some(k) = &self.kernel {
            k.retire(&sandbox_id).await?;
        }
        let gone = server
            .remove::<FloorNetwork, _>(net_path(&sandbox_id))
            .await?;
        Self::network_released(&emitter, &sandbox_id).await?;
        Ok(gone)
    }

    #[zbus(signal)]
    async fn network_ensured(
        emitter: &SignalEmitter<'_>,
        sandbox_id: &str,
        network: Dict,
    ) -> zbus::Result<()>;

    #[zbus(signal)]
    async fn network_released(emitter: &SignalEmitter<'_>, sandbox_id: &str) -> zbus::Result<()>;
}

/// `--serve-floor ADDRESS`: prints the unique bus name on stdout once
/// ready and serves until killed. Same runtime shape as the agent (a
/// multi-thread tokio runtime with a worker per core).
pub fn serve(address: &str, kernel: bool) -> std::result::Result<(), String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async {
        let kernel = if kernel {
            let defaults = cube_network_agent::config::Config::default();
            let k = std::sync::Arc::new(Kernel {
                nl: cube_network_agent::netlink::Netlink::new().map_err(|e| e.to_string())?,
                retire_group: defaults.retire_group,
                block: defaults.tc_block,
                pool: Mutex::default(),
                wake: tokio::sync::Notify::new(),
            });
            // The pool filled before the first call, as the agent's is at READY.
            while k.lock().idle.len() < POOL {
                let t = k.create()?;
                k.lock().idle.push(t);
            }
            tokio::spawn(k.clone().run());
            Some(k)
        } else {
            None
        };
        let conn: Connection = zbus::connection::Builder::address(address)
            .map_err(|e| e.to_string())?
            .serve_at(PATH, Floor { kernel })
            .map_err(|e| e.to_string())?
            .serve_at(PATH, zbus::fdo::ObjectManager)
            .map_err(|e| e.to_string())?
            .build()
            .await
            .map_err(|e| e.to_string())?;
        let name = conn
            .unique_name()
            .map(|n| n.to_string())
            .unwrap_or_default();
        println!("{name}");
        use std::io::Write;
        std::io::stdout().flush().map_err(|e| e.to_string())?;
        std::future::pending::<()>().await;
        Ok(())
    })
}
