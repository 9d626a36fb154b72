//! cube-cni: the CNI 1.1 front end of cube-network-agent (ADD, DEL, CHECK,
//! STATUS, GC, VERSION). A thin client: no state files, no locks; the
//! agent's store is the only state. See `src/cni/mod.rs` for the model and
//! docs/cni.md for the contract.
//!
//! The runtime runs it as root in its own network namespace. The agent
//! (hardened, no CAP_SYS_ADMIN) cannot enter the container's namespace, so
//! the plugin passes an fd of it with EnsureNetwork; the agent creates the
//! veth pair with the peer directly in there; the plugin then configures
//! the inside (address, link up, route, gateway neighbour) through a
//! netlink socket it opened inside the namespace.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, OwnedFd};
use std::process::ExitCode;
use std::time::Duration;

use serde_json::Value;
use zbus::zvariant::{OwnedValue, Value as ZValue};

use cube_network_agent::cni::{
    self, CniError, Command, META_CONTAINER_ID, META_IFNAME, META_NETNS, META_NETWORK, NetConf,
    NetFacts, code,
};
use cube_network_agent::config::parse_mac;
use cube_network_agent::netlink::Netlink;

const NAME: &str = "org.cube.NetworkAgent";
const PATH: &str = "/org/cube/NetworkAgent";
const IFACE: &str = "org.cube.NetworkAgent";

type Dict = HashMap<String, OwnedValue>;

/// What the reference plugins print without CNI_COMMAND (skel's "about").
fn about() -> String {
    format!(
        "CNI cube-cni plugin v{}\nCNI protocol versions supported: {}\n",
        env!("CARGO_PKG_VERSION"),
        cni::SUPPORTED_VERSIONS.join(", ")
    )
}

fn main() -> ExitCode {
    // Run by hand (no CNI_COMMAND), like the reference plugins: say what
    // this is and exit 0. --help adds how it is meant to be run.
    if env("CNI_COMMAND").is_none() {
        let asked: Vec<String> = std::env::args().skip(1).collect();
        let help = asked.iter().any(|a| a == "-h" || a == "--help");
        let text = if help {
            format!(
                "{}\ncube-cni is run by container runtimes (containerd, CRI-O, libcni) with \
                 CNI_COMMAND=ADD|DEL|CHECK|STATUS|GC|VERSION and the network configuration on \
                 stdin; see cube-cni(8).\n",
                about()
            )
        } else {
            about()
        };
        if asked.is_empty() {
            eprint!("{text}");
        } else {
            print!("{text}");
        }
        return ExitCode::SUCCESS;
    }
    let mut version = "1.1.0".to_owned();
    match run(&mut version) {
        Ok(Some(out)) => {
            let mut stdout = std::io::stdout().lock();
            let _ = serde_json::to_writer(&mut stdout, &out);
            let _ = stdout.write_all(b"\n");
            ExitCode::SUCCESS
        }
        Ok(None) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cube-cni: {} (code {})", e.msg, e.code);
            let mut stdout = std::io::stdout().lock();
            let _ = serde_json::to_writer(&mut stdout, &e.to_json(&version));
            let _ = stdout.write_all(b"\n");
            ExitCode::FAILURE
        }
    }
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// The verb's environment, checked: every missing variable is named.
struct Env {
    command: Command,
    container_id: String,
    netns: String,
    ifname: String,
    args: String,
}

impl Env {
    fn read() -> Result<Env, CniError> {
        let raw = env("CNI_COMMAND").ok_or_else(|| {
            CniError::new(
                code::INVALID_ENV,
                "required env variables [CNI_COMMAND] missing",
            )
        })?;
        let command = Command::parse(&raw)?;
        let missing: Vec<&str> = command
            .required_env()
            .iter()
            .copied()
            .filter(|v| env(v).is_none())
            .collect();
        if !missing.is_empty() {
            return Err(CniError::new(
                code::INVALID_ENV,
                format!("required env variables [{}] missing", missing.join(",")),
            ));
        }
        let ifname = env("CNI_IFNAME").unwrap_or_default();
        if !ifname.is_empty()
            && let Err(e) = cube_network_agent::agent::spec::validate_ifname("CNI_IFNAME", &ifname)
        {
            return Err(CniError::new(code::INVALID_ENV, e.to_string()));
        }
        Ok(Env {
            command,
            container_id: env("CNI_CONTAINERID").unwrap_or_default(),
            netns: env("CNI_NETNS").unwrap_or_default(),
            ifname,
            args: env("CNI_ARGS").unwrap_or_default(),
        })
    }
}

fn run(version: &mut String) -> Result<Option<Value>, CniError> {
    // The configuration first: an error about the environment is answered
    // in the caller's cniVersion (one this plugin speaks) too.
    let mut stdin = Vec::new();
    std::io::stdin()
        .read_to_end(&mut stdin)
        .map_err(|e| CniError::new(code::IO, format!("reading stdin: {e}")))?;
    if let Some(v) = serde_json::from_slice::<Value>(&stdin)
        .ok()
        .and_then(|v| v.get("cniVersion")?.as_str().map(str::to_owned))
        .filter(|v| cni::SUPPORTED_VERSIONS.contains(&v.as_str()))
    {
        *version = v;
    }
    let env = Env::read()?;
    if env.command == Command::Version {
        // No agent, no full config: only the version the caller speaks.
        let input: Option<String> = serde_json::from_slice::<Value>(&stdin)
            .ok()
            .and_then(|v| v.get("cniVersion")?.as_str().map(str::to_owned));
        return Ok(Some(cni::version_info(input.as_deref())));
    }
    let conf = match NetConf::parse(&stdin) {
        Ok(conf) => conf,
        // DEL releases what the environment names whatever stdin says:
        // a DEL that fails on its input wedges the pod for good.
        Err(e) if env.command == Command::Del => {
            eprintln!("cube-cni: DEL goes on despite its configuration: {}", e.msg);
            NetConf::lenient(&stdin)
        }
        Err(e) => return Err(e),
    };
    *version = conf.cni_version.clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| CniError::new(code::IO, format!("starting the runtime: {e}")))?;
    rt.block_on(async {
        match env.command {
            Command::Add => add(&env, &conf).await.map(Some),
            Command::Del => del(&env, &conf).await.map(|()| None),
            Command::Check => check(&env, &conf).await.map(|()| None),
            Command::Status => status(&conf).await.map(|()| None),
            Command::Gc => gc(&conf).await.map(|()| None),
            Command::Version => unreachable!("answered above"),
        }
    })
}

/// The agent over D-Bus, every call bounded by the config's timeout.
struct Agent {
    conn: zbus::Connection,
    timeout: Duration,
}

fn unreachable_agent(what: &str, e: impl std::fmt::Display) -> CniError {
    CniError::new(
        code::TRY_AGAIN_LATER,
        format!("cube-network-agent is not reachable ({what}): {e}"),
    )
}

impl Agent {
    async fn connect(conf: &NetConf) -> Result<Agent, CniError> {
        let timeout = Duration::from_millis(conf.timeout_ms);
        let connect = async {
            match &conf.dbus_address {
                Some(a) => {
                    zbus::connection::Builder::address(a.as_str())?
                        .build()
                        .await
                }
                None => zbus::Connection::system().await,
            }
        };
        let conn = tokio::time::timeout(timeout, connect)
            .await
            .map_err(|_| unreachable_agent("connecting to the bus", "timed out"))?
            .map_err(|e| unreachable_agent("connecting to the bus", e))?;
        Ok(Agent { conn, timeout })
    }

    async fn call<B, R>(&self, method: &str, body: &B) -> Result<R, CniError>
    where
        B: serde::Serialize + zbus::zvariant::DynamicType,
        R: for<'d> serde::Deserialize<'d> + zbus::zvariant::Type,
    {
        let call = self
            .conn
            .call_method(Some(NAME), PATH, Some(IFACE), method, body);
        let reply = match tokio::time::timeout(self.timeout, call).await {
            Err(_) => {
                return Err(unreachable_agent(
                    method,
                    format!("no answer within {} ms", self.timeout.as_millis()),
                ));
            }
            Ok(Err(zbus::Error::MethodError(name, msg, _))) => {
                return Err(cni::agent_error(
                    name.as_str(),
                    msg.as_deref().unwrap_or(name.as_str()),
                ));
            }
            Ok(Err(e)) => return Err(unreachable_agent(method, e)),
            Ok(Ok(m)) => m,
        };
        reply.body().deserialize::<R>().map_err(|e| {
            CniError::new(
                code::AGENT_FAILED,
                format!("{method}: unexpected answer from the agent: {e}"),
            )
        })
    }

    async fn active_networks(&self) -> Result<u32, CniError> {
        let call = self.conn.call_method(
            Some(NAME),
            PATH,
            Some("org.freedesktop.DBus.Properties"),
            "Get",
            &(IFACE, "ActiveNetworks"),
        );
        let m = tokio::time::timeout(self.timeout, call)
            .await
            .map_err(|_| unreachable_agent("ActiveNetworks", "timed out"))?
            .map_err(|e| unreachable_agent("ActiveNetworks", e))?;
        let v: OwnedValue = m
            .body()
            .deserialize()
            .map_err(|e| unreachable_agent("ActiveNetworks", e))?;
        u32::try_from(v).map_err(|e| unreachable_agent("ActiveNetworks", e))
    }
}

fn field<T: TryFrom<OwnedValue>>(d: &Dict, key: &str) -> Result<T, CniError> {
    d.get(key)
        .and_then(|v| v.try_clone().ok())
        .and_then(|v| T::try_from(v).ok())
        .ok_or_else(|| {
            CniError::new(
                code::AGENT_FAILED,
                format!("the agent's network has no usable '{key}'"),
            )
        })
}

fn facts(d: &Dict) -> Result<NetFacts, CniError> {
    Ok(NetFacts {
        host_ifname: field(d, "tap_name")?,
        sandbox_ip: field(d, "sandbox_ip")?,
        guest_ip: field(d, "guest_ip")?,
        gateway_ip: field(d, "gateway_ip")?,
        guest_mac: field(d, "guest_mac")?,
        mtu: field(d, "mtu")?,
        guest_ipv6: field(d, "guest_ipv6").ok(),
        ipv6_egress: field(d, "ipv6_egress").unwrap_or(false),
        sandbox_ipv6: field(d, "sandbox_ipv6").ok(),
        gateway_ipv6: field(d, "gateway_ipv6").ok(),
    })
}

fn netns_err(what: &str, e: impl std::fmt::Display) -> CniError {
    CniError::new(code::NETNS, format!("{what}: {e}"))
}

/// A netlink socket inside the container's namespace (opened there, used
/// from here) and an fd of that namespace for the agent.
struct Inside {
    nl: Netlink,
    ns: OwnedFd,
}

fn open_netns(path: &str) -> Result<OwnedFd, CniError> {
    std::fs::File::open(path).map(OwnedFd::from).map_err(|e| {
        CniError::new(
            code::INVALID_ENV,
            format!("CNI_NETNS {path} cannot be opened: {e}"),
        )
    })
}

impl Inside {
    /// Must run on the runtime's (only) thread: setns changes the thread's
    /// namespace, the socket is made there, and the thread goes back.
    fn enter(path: &str) -> Result<Inside, CniError> {
        use nix::sched::{CloneFlags, setns};
        let ns = open_netns(path)?;
        let home = std::fs::File::open("/proc/thread-self/ns/net")
            .map_err(|e| netns_err("opening the plugin's own namespace", e))?;
        setns(ns.as_fd(), CloneFlags::CLONE_NEWNET)
            .map_err(|e| netns_err(&format!("entering {path}"), e))?;
        let nl = Netlink::new();
        setns(home.as_fd(), CloneFlags::CLONE_NEWNET)
            .map_err(|e| netns_err("returning to the plugin's namespace", e))?;
        let nl = nl.map_err(|e| netns_err(&format!("netlink in {path}"), e))?;
        Ok(Inside { nl, ns })
    }

    /// Writes `value` to the namespace's `/proc/sys/net/<key>` (net
    /// sysctls are the writer's namespace's: written from inside). `Ok(false)`
    /// where /proc/sys cannot be written at all (read-only, as in a systemd
    /// container, or not permitted): the caller decides whether it needs it.
    fn sysctl(&self, key: &str, value: &str) -> Result<bool, CniError> {
        use nix::sched::{CloneFlags, setns};
        let home = std::fs::File::open("/proc/thread-self/ns/net")
            .map_err(|e| netns_err("opening the plugin's own namespace", e))?;
        setns(self.ns.as_fd(), CloneFlags::CLONE_NEWNET)
            .map_err(|e| netns_err("entering the container's namespace", e))?;
        let path = format!("/proc/sys/net/{key}");
        let written = std::fs::write(&path, value);
        setns(home.as_fd(), CloneFlags::CLONE_NEWNET)
            .map_err(|e| netns_err("returning to the plugin's namespace", e))?;
        match written {
            Ok(()) => Ok(true),
            Err(e)
                if e.kind() == std::io::ErrorKind::ReadOnlyFilesystem
                    || e.kind() == std::io::ErrorKind::PermissionDenied =>
            {
                Ok(false)
            }
            Err(e) => Err(netns_err(&format!("writing {value} to {path}"), e)),
        }
    }
}

fn parse_cidr(s: &str) -> Option<(Ipv4Addr, u8)> {
    let (a, p) = s.split_once('/')?;
    Some((a.parse().ok()?, p.parse().ok()?))
}

async fn add(env: &Env, conf: &NetConf) -> Result<Value, CniError> {
    if conf.prev_result.is_some() {
        return Err(CniError::new(
            code::INVALID_CONFIG,
            "cube-cni creates the interface: it must be the first plugin of the chain \
             (prevResult given)",
        ));
    }
    let inside = Inside::enter(&env.netns)?;
    let existing = inside
        .nl
        .link_by_name(&env.ifname)
        .await
        .map_err(|e| netns_err("looking for CNI_IFNAME", e))?;
    if existing.is_some() {
        return Err(CniError::new(
            code::INTERFACE_EXISTS,
            format!(
                "an interface named {} already exists in {}",
                env.ifname, env.netns
            ),
        ));
    }
    let id = cni::sandbox_id(&env.container_id, &env.ifname)?;
    let agent = Agent::connect(conf).await?;
    let mut metadata = cni::args_metadata(&env.args);
    metadata.insert(META_NETWORK.into(), conf.name.clone());
    metadata.insert(META_CONTAINER_ID.into(), env.container_id.clone());
    metadata.insert(META_IFNAME.into(), env.ifname.clone());
    metadata.insert(META_NETNS.into(), env.netns.clone());
    let mappings: Vec<(String, u16, u16, String)> = conf
        .port_mappings
        .iter()
        .map(|m| {
            (
                m.protocol.clone(),
                m.container_port,
                m.host_port,
                m.host_ip.clone(),
            )
        })
        .collect();
    let (ip4, ip6) = cni::requested_ips(&conf.ips, &env.args)?;
    let mut opts: HashMap<&str, ZValue<'_>> = HashMap::new();
    opts.insert("attach", ZValue::from("veth"));
    // Runtimes expect portmap's order: the mapping before any socket
    // (rootful podman holds each published port itself after ADD).
    opts.insert("mapping_wins", ZValue::from(true));
    if let Some(a) = ip4 {
        opts.insert("sandbox_ip", ZValue::from(a.to_string()));
    }
    if let Some(a) = ip6 {
        opts.insert("sandbox_ipv6", ZValue::from(a.to_string()));
    }
    opts.insert(
        "netns_fd",
        ZValue::from(zbus::zvariant::Fd::from(inside.ns.as_fd())),
    );
    opts.insert("ifname", ZValue::from(env.ifname.as_str()));
    opts.insert(
        "metadata",
        ZValue::from(metadata.into_iter().collect::<HashMap<_, _>>()),
    );
    if !mappings.is_empty() {
        opts.insert("port_mappings", ZValue::from(mappings));
    }
    if let Some(b) = conf.allow_internet_access {
        opts.insert("allow_internet_access", ZValue::from(b));
    }
    if !conf.allow_out.is_empty() {
        opts.insert("allow_out", ZValue::from(conf.allow_out.clone()));
    }
    if !conf.deny_out.is_empty() {
        opts.insert("deny_out", ZValue::from(conf.deny_out.clone()));
    }
    if let Some(mtu) = conf.mtu {
        opts.insert("mtu", ZValue::from(mtu));
    }
    if let Some(mode) = &conf.egress_mode {
        opts.insert("egress_mode", ZValue::from(mode.as_str()));
    }
    let bw = conf.bandwidth;
    for (key, v) in [
        ("egress_bps", bw.egress_bps),
        ("ingress_bps", bw.ingress_bps),
        ("egress_burst", bw.egress_burst),
        ("ingress_burst", bw.ingress_burst),
    ] {
        if v != 0 {
            opts.insert(key, ZValue::from(v));
        }
    }
    let net: Dict = agent.call("EnsureNetwork", &(id.as_str(), opts)).await?;
    let f = facts(&net)?;
    let gw_mac: String = field(&net, "gateway_mac")?;
    if let Err(e) = configure_inside(&inside, &env.ifname, &f, &gw_mac).await {
        // Leave nothing behind: the runtime DELs after a failed ADD, but a
        // network whose inside is not set up must not live until then.
        // Only the very network this ADD got (its handle): never one a
        // concurrent verb made under the same id since.
        if let Ok(handle) = field::<String>(&net, "network_handle") {
            let mut expect: HashMap<&str, ZValue<'_>> = HashMap::new();
            expect.insert("network_handle", ZValue::from(handle));
            let _: Result<bool, _> = agent.call("ReleaseNetworkIf", &(id.as_str(), expect)).await;
        }
        return Err(e);
    }
    // With domain rules the container must resolve through the agent (its
    // gateway): the result names it unless the config names servers.
    let domains = conf
        .allow_out
        .iter()
        .chain(&conf.deny_out)
        .any(|e| cube_network_agent::agent::domains::is_domain_entry(e));
    let dns = cni::dns_for(&conf.dns, domains.then_some(f.gateway_ip.as_str()));
    Ok(cni::result(
        &conf.cni_version,
        &f,
        &env.ifname,
        &env.netns,
        &dns,
    ))
}

/// How long ADD waits for the container's IPv6 default route (the RA the
/// datapath answers its Router Solicitation with comes within
/// milliseconds).
const IPV6_ROUTE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Inside the container: address, link up, default route via the gateway,
/// the gateway's MAC as a permanent neighbour (no ARP round trip on the
/// first packet; the datapath's proxy ARP answers anyway), lo up. With the
/// guests' IPv6 link: the SLAAC address at once (no duplicate address
/// detection: the link's only other node is the gateway, which never
/// claims it), and, where the sandbox's IPv6 reaches the world, a short
/// wait for the RA's default route, so that the container has both
/// families when ADD returns.
async fn configure_inside(
    inside: &Inside,
    ifname: &str,
    f: &NetFacts,
    gw_mac: &str,
) -> Result<(), CniError> {
    let nl = &inside.nl;
    let link = nl
        .link_by_name(ifname)
        .await
        .map_err(|e| netns_err("looking up the new interface", e))?
        .ok_or_else(|| {
            netns_err(
                "the new interface",
                format!("{ifname} is not in the namespace"),
            )
        })?;
    let (addr, len) = parse_cidr(&f.guest_ip)
        .ok_or_else(|| netns_err("guest_ip", format!("'{}' is not a CIDR", f.guest_ip)))?;
    let gw: Ipv4Addr = f
        .gateway_ip
        .parse()
        .map_err(|e| netns_err("gateway_ip", e))?;
    let mac = parse_mac(gw_mac)
        .ok_or_else(|| netns_err("gateway_mac", format!("'{gw_mac}' is not a MAC")))?;
    nl.add_ipv4_addr(link.index, addr, len)
        .await
        .map_err(|e| netns_err("adding the address", e))?;
    // With the guests' IPv6 link the container configures IPv6 from the
    // gateway's Router Advertisements (its SLAAC address, and a default
    // route where the sandbox's IPv6 reaches the world). Without it, IPv4
    // only, as the datapath: the interface's router solicitations, DAD and
    // MLD reports would be dropped from the moment it is up.
    let ipv6 = f.container_ipv6();
    if ipv6.is_none() {
        nl.ipv6_quiet(link.index)
            .await
            .map_err(|e| netns_err("turning IPv6 address generation off", e))?;
    } else {
        // Its link-local address usable at once too: the Router
        // Solicitation leaves on link up, not a DAD round later. And its
        // IPv6 address kept while the link is down, as the IPv4 one is.
        // Both are refinements: where /proc/sys is read-only (a runtime
        // in a systemd container) the link-local address waits for its
        // DAD (1 s) before the Router Solicitation leaves, and the default
        // route may come after ADD returned; said on stderr, not failed.
        let dad = inside.sysctl(&format!("ipv6/conf/{ifname}/accept_dad"), "0")?;
        let keep = inside.sysctl(&format!("ipv6/conf/{ifname}/keep_addr_on_down"), "1")?;
        if !(dad && keep) {
            eprintln!(
                "cube-cni: /proc/sys/net is read-only here: {ifname}'s link-local DAD stays on \
                 (its IPv6 default route may follow ADD by about a second)"
            );
        }
    }
    let up = cube_network_agent::netlink::LinkChange {
        up: Some(true),
        ..Default::default()
    };
    nl.set_link(link.index, up.clone())
        .await
        .map_err(|e| netns_err("setting the interface up", e))?;
    nl.neigh_replace_permanent(link.index, std::net::IpAddr::V4(gw), mac)
        .await
        .map_err(|e| netns_err("adding the gateway neighbour", e))?;
    nl.replace_default_route(gw, link.index)
        .await
        .map_err(|e| netns_err("adding the default route", e))?;
    if let Some(lo) = nl
        .link_by_name("lo")
        .await
        .map_err(|e| netns_err("looking up lo", e))?
        && !lo.up
    {
        nl.set_link(lo.index, up)
            .await
            .map_err(|e| netns_err("setting lo up", e))?;
    }
    let Some(a) = ipv6 else {
        return Ok(());
    };
    nl.add_ipv6_addr_nodad(link.index, a, 64)
        .await
        .map_err(|e| netns_err("adding the IPv6 address", e))?;
    let deadline = std::time::Instant::now() + IPV6_ROUTE_WAIT;
    // Not an error when it does not come: the route follows the node's
    // IPv6 egress live, by RA, whatever ADD saw.
    while f.ipv6_egress
        && !nl
            .ipv6_default_route(link.index)
            .await
            .map_err(|e| netns_err("listing IPv6 routes", e))?
        && std::time::Instant::now() < deadline
    {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    Ok(())
}

/// What DEL, CHECK and GC require of the agent's network for this
/// attachment: a veth, for this container and interface, in this namespace
/// when the namespace still exists (the agent checks and releases
/// atomically, ReleaseNetworkIf).
fn expectations<'a>(
    container_id: &'a str,
    ifname: &'a str,
    netns: Option<&'a OwnedFd>,
) -> HashMap<&'static str, ZValue<'a>> {
    let mut e: HashMap<&str, ZValue<'_>> = HashMap::new();
    e.insert("attach", ZValue::from("veth"));
    e.insert("ifname", ZValue::from(ifname));
    let meta: HashMap<&str, &str> = [(META_CONTAINER_ID, container_id), (META_IFNAME, ifname)]
        .into_iter()
        .collect();
    e.insert("metadata", ZValue::from(meta));
    if let Some(fd) = netns {
        e.insert(
            "netns_fd",
            ZValue::from(zbus::zvariant::Fd::from(fd.as_fd())),
        );
    }
    e
}

async fn del(env: &Env, conf: &NetConf) -> Result<(), CniError> {
    let agent = Agent::connect(conf).await?;
    // The namespace may be gone (the veth went with it; the agent deletes
    // whatever is left of the host end): then nothing ties DEL to one.
    let netns = (!env.netns.is_empty())
        .then(|| open_netns(&env.netns).ok())
        .flatten();
    let expect = expectations(&env.container_id, &env.ifname, netns.as_ref());
    // false (no such network) is success: DEL is repeatable.
    let mut released: bool = agent
        .call(
            "ReleaseNetworkIf",
            &(cni::sandbox_id(&env.container_id, &env.ifname)?, &expect),
        )
        .await?;
    if !released {
        // A network made before the injective ids: released only if it is
        // this very attachment; anything else under that id (a VMM's TAP
        // network, another container's) is not this DEL's business.
        let legacy = cni::legacy_sandbox_id(&env.container_id, &env.ifname);
        released = match agent.call("ReleaseNetworkIf", &(legacy, &expect)).await {
            Err(e) if e.code == code::NOT_THIS_ATTACHMENT => false,
            other => other?,
        };
    }
    if released && !env.netns.is_empty() {
        free_ifname(&env.netns, &env.ifname).await;
    }
    Ok(())
}

/// The agent deletes a released veth in the background (off its reply
/// path); until then the peer would keep `CNI_IFNAME` taken in the
/// namespace, and an ADD right after this DEL (a runtime retrying) would
/// find it. So the peer steps aside: down, then renamed (a veth cannot be
/// renamed while up). Best effort: the namespace may be gone, or the pair
/// deleted already.
async fn free_ifname(netns: &str, ifname: &str) {
    let Ok(inside) = Inside::enter(netns) else {
        return;
    };
    let nl = &inside.nl;
    let Ok(Some(link)) = nl.link_by_name(ifname).await else {
        return;
    };
    if link.kind.as_deref() != Some("veth") {
        return;
    }
    let down = cube_network_agent::netlink::LinkChange {
        up: Some(false),
        ..Default::default()
    };
    let rename = cube_network_agent::netlink::LinkChange {
        name: Some(format!("cnigone{:08x}", link.index)),
        ..Default::default()
    };
    if nl.set_link(link.index, down).await.is_ok() {
        let _ = nl.set_link(link.index, rename).await;
    }
}

async fn check(env: &Env, conf: &NetConf) -> Result<(), CniError> {
    let id = cni::sandbox_id(&env.container_id, &env.ifname)?;
    let agent = Agent::connect(conf).await?;
    let get = |id: String| {
        let agent = &agent;
        async move {
            agent
                .call::<_, Dict>("GetNetwork", &(id.as_str(),))
                .await
                .map(|net| (id, net))
        }
    };
    let (id, net) = match get(id.clone()).await {
        Err(e) if e.code == code::NOT_FOUND => {
            get(cni::legacy_sandbox_id(&env.container_id, &env.ifname))
                .await
                .map_err(|e| match e.code {
                    code::NOT_FOUND => CniError::new(
                        code::NOT_FOUND,
                        format!(
                            "no network for container {} interface {} (agent id {id})",
                            env.container_id, env.ifname
                        ),
                    ),
                    _ => e,
                })?
        }
        other => other?,
    };
    let attach: String = field(&net, "attach")?;
    if attach != "veth" {
        return Err(CniError::new(
            code::CHECK_FAILED,
            format!("network {id} is a {attach} network, not a CNI attachment"),
        ));
    }
    let meta: HashMap<String, String> = field(&net, "metadata").unwrap_or_default();
    let ifname: String = field(&net, "ifname").unwrap_or_default();
    if meta.get(META_CONTAINER_ID) != Some(&env.container_id) || ifname != env.ifname {
        return Err(CniError::new(
            code::CHECK_FAILED,
            format!(
                "network {id} belongs to container {:?} interface '{ifname}', not to {} {}",
                meta.get(META_CONTAINER_ID),
                env.container_id,
                env.ifname
            ),
        ));
    }
    // The namespace the attachment lives in must be the one CHECK names:
    // CHECK looks inside it below.
    if let Ok(recorded) = field::<String>(&net, "netns") {
        let passed = cube_network_agent::netns::netns_fd(open_netns(&env.netns)?)
            .map(|n| n.id.to_string())
            .map_err(|e| netns_err(&format!("CNI_NETNS {}", env.netns), e))?;
        if passed != recorded {
            return Err(CniError::new(
                code::CHECK_FAILED,
                format!(
                    "network {id} lives in network namespace {recorded}, not in CNI_NETNS {} ({passed})",
                    env.netns
                ),
            ));
        }
    }
    let f = facts(&net)?;
    // The agent's own check (TAP/veth, neighbour, datapath filter and
    // entries), repairing drift it can repair.
    let report: Dict = agent.call("ReconcileNetwork", &(id.as_str(),)).await?;
    let errors: Vec<String> = field(&report, "errors").unwrap_or_default();
    if !errors.is_empty() {
        return Err(CniError::new(
            code::CHECK_FAILED,
            format!("the agent cannot serve {id}: {}", errors.join("; ")),
        ));
    }
    if let Some(prev) = &conf.prev_result {
        let want = format!("{}/32", f.sandbox_ip);
        let listed = prev
            .get("ips")
            .and_then(Value::as_array)
            .is_some_and(|ips| ips.iter().any(|ip| ip["address"] == want.as_str()));
        if !listed {
            return Err(CniError::new(
                code::CHECK_FAILED,
                format!("prevResult does not list the attachment's address {want}"),
            ));
        }
    }
    let inside = Inside::enter(&env.netns)?;
    let nl = &inside.nl;
    let fail = |what: String| CniError::new(code::CHECK_FAILED, what);
    let link = nl
        .link_by_name(&env.ifname)
        .await
        .map_err(|e| netns_err("looking up CNI_IFNAME", e))?
        .ok_or_else(|| fail(format!("{} is missing in {}", env.ifname, env.netns)))?;
    if !link.up {
        return Err(fail(format!("{} is down in {}", env.ifname, env.netns)));
    }
    let (addr, len) = parse_cidr(&f.guest_ip)
        .ok_or_else(|| fail(format!("guest_ip '{}' is not a CIDR", f.guest_ip)))?;
    let addrs = nl
        .ipv4_addrs(link.index)
        .await
        .map_err(|e| netns_err("listing addresses", e))?;
    if !addrs.contains(&(addr, len)) {
        return Err(fail(format!(
            "{} lacks its address {}/{len} in {}",
            env.ifname, addr, env.netns
        )));
    }
    if let Some(a) = f.container_ipv6()
        && !nl
            .ipv6_addrs(link.index)
            .await
            .map_err(|e| netns_err("listing IPv6 addresses", e))?
            .contains(&a)
    {
        return Err(fail(format!(
            "{} lacks its IPv6 address {a}/64 in {}",
            env.ifname, env.netns
        )));
    }
    let gw: Ipv4Addr = f.gateway_ip.parse().map_err(|e| fail(format!("{e}")))?;
    if !nl
        .default_route_via(gw, link.index)
        .await
        .map_err(|e| netns_err("listing routes", e))?
    {
        return Err(fail(format!(
            "no default route via {gw} on {} in {}",
            env.ifname, env.netns
        )));
    }
    Ok(())
}

async fn status(conf: &NetConf) -> Result<(), CniError> {
    let agent = Agent::connect(conf)
        .await
        .map_err(|e| CniError::new(code::NOT_READY, e.msg))?;
    let (_healthy, checks): (bool, Vec<(String, bool, String)>) =
        agent
            .call("Health", &())
            .await
            .map_err(|e| CniError::new(code::NOT_READY, e.msg))?;
    let active = agent.active_networks().await.unwrap_or(1);
    match cni::status_verdict(&checks, active) {
        None => Ok(()),
        Some(e) => Err(e),
    }
}

async fn gc(conf: &NetConf) -> Result<(), CniError> {
    let valid = conf.valid_attachments.as_ref().ok_or_else(|| {
        CniError::new(
            code::INVALID_CONFIG,
            "GC needs cni.dev/valid-attachments (refusing to treat a missing list as empty)",
        )
    })?;
    let agent = Agent::connect(conf).await?;
    let nets: Vec<Dict> = agent.call("ListNetworks", &()).await?;
    let nets: Vec<(String, BTreeMap<String, String>)> = nets
        .iter()
        .filter_map(|d| {
            let id: String = field(d, "sandbox_id").ok()?;
            let meta: HashMap<String, String> = field(d, "metadata").unwrap_or_default();
            Some((id, meta.into_iter().collect()))
        })
        .collect();
    let mut failures = vec![];
    for (id, meta) in cni::gc_victims(&conf.name, valid, &nets) {
        // Released only if it still is that attachment of this network.
        let mut expect: HashMap<&str, ZValue<'_>> = HashMap::new();
        expect.insert("attach", ZValue::from("veth"));
        expect.insert("metadata", ZValue::from(meta));
        match agent
            .call::<_, bool>("ReleaseNetworkIf", &(id.as_str(), expect))
            .await
        {
            Ok(_) => eprintln!("cube-cni: GC released {id}"),
            Err(e) => failures.push(format!("{id}: {}", e.msg)),
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(CniError::new(
            code::GC_INCOMPLETE,
            format!("GC could not release {} networks", failures.len()),
        )
        .with_details(failures.join("; ")))
    }
}
