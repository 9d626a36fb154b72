//! The agent's D-Bus calls the bench makes (Ping, Capacity, EnsureNetwork,
//! ReleaseNetwork, OpenTap), each within the call timeout, and `timed`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use cube_network_agent::dbus::{BUS_NAME, MANAGER_PATH};
use zbus::Connection;
use zbus::zvariant::{OwnedFd, OwnedValue};

/// What a failed step says.
pub(crate) type Error = String;
pub(crate) type Result<T> = std::result::Result<T, Error>;

/// Callers at once in the concurrent phases.
pub(crate) const CONCURRENT_CALLERS: usize = 16;

pub(crate) const IFACE: &str = "org.cube.NetworkAgent";
/// A call slower than this counts as a failure (the agent is wedged).
pub(crate) const CALL_TIMEOUT: Duration = Duration::from_secs(30);

pub(crate) fn empty_options() -> HashMap<String, OwnedValue> {
    HashMap::new()
}

/// One Capacity call (what a scheduler polls).
pub(crate) async fn capacity(conn: &Connection) -> Result<()> {
    conn.call_method(Some(BUS_NAME), MANAGER_PATH, Some(IFACE), "Capacity", &())
        .await
        .map(drop)
        .map_err(|e| format!("Capacity: {e}"))
}

pub(crate) async fn ping(conn: &Connection) -> Result<()> {
    conn.call_method(
        Some(BUS_NAME),
        MANAGER_PATH,
        Some("org.freedesktop.DBus.Peer"),
        "Ping",
        &(),
    )
    .await
    .map(drop)
    .map_err(|e| format!("Ping: {e}"))
}

/// Who answers EnsureNetwork/ReleaseNetwork: the agent, or the bus floor
/// server (see [`floor`]).
#[derive(Clone, Copy)]
pub(crate) struct Target<'a> {
    pub(crate) dest: &'a str,
    pub(crate) path: &'a str,
    pub(crate) iface: &'a str,
}

pub(crate) const AGENT: Target<'static> = Target {
    dest: BUS_NAME,
    path: MANAGER_PATH,
    iface: IFACE,
};

pub(crate) async fn ensure(conn: &Connection, id: &str) -> Result<()> {
    ensure_at(conn, AGENT, id).await
}

pub(crate) async fn release(conn: &Connection, id: &str) -> Result<()> {
    release_at(conn, AGENT, id).await
}

pub(crate) async fn ensure_at(conn: &Connection, t: Target<'_>, id: &str) -> Result<()> {
    ensure_with(conn, t, id, empty_options()).await
}

/// EnsureNetwork(id, options) as a VMM launcher calls it.
pub(crate) async fn ensure_with(
    conn: &Connection,
    t: Target<'_>,
    id: &str,
    options: HashMap<String, OwnedValue>,
) -> Result<()> {
    conn.call_method(
        Some(t.dest),
        t.path,
        Some(t.iface),
        "EnsureNetwork",
        &(id, options),
    )
    .await
    .map_err(|e| format!("EnsureNetwork({id}): {e}"))?
    .body()
    .deserialize::<HashMap<String, OwnedValue>>()
    .map(drop)
    .map_err(|e| format!("EnsureNetwork({id}) reply: {e}"))
}

pub(crate) async fn release_at(conn: &Connection, t: Target<'_>, id: &str) -> Result<()> {
    let released: bool = conn
        .call_method(
            Some(t.dest),
            t.path,
            Some(t.iface),
            "ReleaseNetwork",
            &(id,),
        )
        .await
        .map_err(|e| format!("ReleaseNetwork({id}): {e}"))?
        .body()
        .deserialize()
        .map_err(|e| format!("ReleaseNetwork({id}) reply: {e}"))?;
    if released {
        Ok(())
    } else {
        Err(format!("ReleaseNetwork({id}) returned false"))
    }
}

pub(crate) async fn open_tap(conn: &Connection, id: &str) -> Result<()> {
    conn.call_method(Some(BUS_NAME), MANAGER_PATH, Some(IFACE), "OpenTap", &(id,))
        .await
        .map_err(|e| format!("OpenTap({id}): {e}"))?
        .body()
        .deserialize::<OwnedFd>()
        .map(drop)
        .map_err(|e| format!("OpenTap({id}) reply: {e}"))
}

pub(crate) async fn timed<F: Future<Output = Result<()>>>(f: F) -> Result<Duration> {
    let t = Instant::now();
    f.await?;
    Ok(t.elapsed())
}
