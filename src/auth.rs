//! Authorization (SPEC §5): uid 0 is allowed outright; everyone else needs
//! a polkit action, `org.cube.NetworkAgent.manage` for mutating calls and
//! `org.cube.NetworkAgent.read` for reads. polkit's answers are never
//! cached: they can change at any time (rules, group membership,
//! `auth_admin_keep` expiring). Only a bus name's uid is remembered, which
//! cannot change. If polkit cannot be asked, non-root callers are denied.
//!
//! Transport edges call [`Authority::check_bus_caller`] (D-Bus: subject =
//! the caller's unique bus name) or [`Authority::check_process`] (varlink:
//! subject = the peer process, pid + start time + uid from `SO_PEERCRED`).
//! The edge maps [`AuthError`] to its wire errors in one place.

use std::collections::HashMap;
use std::time::Duration;

use tracing::debug;
use zbus::Connection;
use zbus::names::UniqueName;
use zbus::zvariant::Value;

const POLKIT_NAME: &str = "org.freedesktop.PolicyKit1";
const POLKIT_PATH: &str = "/org/freedesktop/PolicyKit1/Authority";
const POLKIT_IFACE: &str = "org.freedesktop.PolicyKit1.Authority";
/// `CheckAuthorizationFlags.AllowUserInteraction`.
const POLKIT_ALLOW_USER_INTERACTION: u32 = 0x1;
/// A non-interactive polkit check answers in milliseconds; one that takes
/// this long means polkit is wedged, which counts as unreachable. An
/// interactive check waits for a human and has no deadline of ours.
const NON_INTERACTIVE_TIMEOUT: Duration = Duration::from_secs(25);

/// What a call wants to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Ensure, Release, Reconcile, OpenTap.
    Manage,
    /// GetNetwork, ListNetworks, Health.
    Read,
}

impl Action {
    /// The polkit action id.
    pub fn id(self) -> &'static str {
        match self {
            Action::Manage => "org.cube.NetworkAgent.manage",
            Action::Read => "org.cube.NetworkAgent.read",
        }
    }
}

impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.id())
    }
}

/// Why a caller was not allowed. Every variant is a denial.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("not authorized for {action}")]
    Denied { action: Action },
    /// polkit would allow it after authenticating the user, but the caller
    /// did not allow interaction (or no authentication agent could ask).
    #[error("interactive authorization is required for {action}")]
    InteractionRequired { action: Action },
    #[error("not authorized for {action}: polkit was unreachable ({reason})")]
    PolkitUnreachable { action: Action, reason: String },
    #[error("not authorized for {action}: polkit failed ({reason})")]
    PolkitFailed { action: Action, reason: String },
    #[error("not authorized for {action}: cannot identify the caller ({reason})")]
    UnknownCaller { action: Action, reason: String },
}

/// The agent's authority, once its bus connection exists (set by
/// `dbus::serve`). Edges without a connection of their own (varlink) use
/// it; until it is set they deny every non-root caller.
static GLOBAL: std::sync::OnceLock<Authority> = std::sync::OnceLock::new();

/// Makes `authority` the process-wide one; the first call wins.
pub fn set_global(authority: Authority) {
    let _ = GLOBAL.set(authority);
}

/// The process-wide authority, if the bus connection is up.
pub fn global() -> Option<&'static Authority> {
    GLOBAL.get()
}

/// Asks polkit on the agent's own bus connection. polkit lives on the
/// system bus; when the agent runs on a private (test) bus, polkit is looked
/// up there too, and, if absent, non-root callers are denied.
#[derive(Clone, Debug)]
pub struct Authority {
    conn: Connection,
    /// Unique bus name → uid. A unique name is never reused during the
    /// bus's life and a connection's uid never changes, so an entry can
    /// never be wrong; the cache only saves the bus round trip that every
    /// call (root's included) would otherwise pay. Bounded: cleared when
    /// full.
    uids: std::sync::Arc<std::sync::Mutex<HashMap<String, u32>>>,
}

const UID_CACHE_MAX: usize = 4096;

impl Authority {
    pub fn new(conn: Connection) -> Self {
        Authority {
            conn,
            uids: Default::default(),
        }
    }

    /// Authorizes the D-Bus caller `sender` for `action`. `interactive` is
    /// whether the caller set `ALLOW_INTERACTIVE_AUTHORIZATION`.
    pub async fn check_bus_caller(
        &self,
        sender: &UniqueName<'_>,
        action: Action,
        interactive: bool,
    ) -> Result<(), AuthError> {
        let uid = self.bus_caller_uid(sender, action).await?;
        if uid == 0 {
            return Ok(());
        }
        let mut details: HashMap<&str, Value<'_>> = HashMap::new();
        details.insert("name", Value::from(sender.as_str()));
        self.check(("system-bus-name", details), action, interactive, uid)
            .await
    }

    /// Authorizes a local process (varlink peer) for `action`. `uid` is the
    /// peer's uid from `SO_PEERCRED`; `start_time` is field 22 of
    /// `/proc/PID/stat` (see [`process_start_time`]), which pins the pid
    /// against reuse.
    pub async fn check_process(
        &self,
        pid: u32,
        start_time: u64,
        uid: u32,
        action: Action,
        interactive: bool,
    ) -> Result<(), AuthError> {
        if uid == 0 {
            return Ok(());
        }
        let mut details: HashMap<&str, Value<'_>> = HashMap::new();
        details.insert("pid", Value::from(pid));
        details.insert("start-time", Value::from(start_time));
        // polkit's unix-process subject carries the uid as int32.
        details.insert("uid", Value::from(uid as i32));
        self.check(("unix-process", details), action, interactive, uid)
            .await
    }

    /// The uid of bus name `sender` if an earlier call looked it up.
    pub fn known_uid(&self, sender: &UniqueName<'_>) -> Option<u32> {
        self.uids
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(sender.as_str())
            .copied()
    }

    async fn bus_caller_uid(
        &self,
        sender: &UniqueName<'_>,
        action: Action,
    ) -> Result<u32, AuthError> {
        if let Some(uid) = self
            .uids
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(sender.as_str())
        {
            return Ok(*uid);
        }
        let unknown = |reason: String| AuthError::UnknownCaller { action, reason };
        let reply = self
            .conn
            .call_method(
                Some("org.freedesktop.DBus"),
                "/org/freedesktop/DBus",
                Some("org.freedesktop.DBus"),
                "GetConnectionUnixUser",
                &(sender.as_str(),),
            )
            .await
            .map_err(|e| unknown(e.to_string()))?;
        let uid = reply
            .body()
            .deserialize::<u32>()
            .map_err(|e| unknown(e.to_string()))?;
        let mut uids = self.uids.lock().unwrap_or_else(|p| p.into_inner());
        if uids.len() >= UID_CACHE_MAX {
            uids.clear();
        }
        uids.insert(sender.as_str().to_owned(), uid);
        Ok(uid)
    }

    async fn check(
        &self,
        subject: (&str, HashMap<&str, Value<'_>>),
        action: Action,
        interactive: bool,
        uid: u32,
    ) -> Result<(), AuthError> {
        let flags = if interactive {
            POLKIT_ALLOW_USER_INTERACTION
        } else {
            0
        };
        let details: HashMap<&str, &str> = HashMap::new();
        let body = (&subject, action.id(), details, flags, "");
        let call = self.conn.call_method(
            Some(POLKIT_NAME),
            POLKIT_PATH,
            Some(POLKIT_IFACE),
            "CheckAuthorization",
            &body,
        );
        let reply = if interactive {
            call.await
        } else {
            match tokio::time::timeout(NON_INTERACTIVE_TIMEOUT, call).await {
                Ok(r) => r,
                Err(_) => {
                    return Err(AuthError::PolkitUnreachable {
                        action,
                        reason: format!("no answer in {}s", NON_INTERACTIVE_TIMEOUT.as_secs()),
                    });
                }
            }
        };
        let reply = reply.map_err(|e| polkit_call_error(action, e))?;
        let (authorized, challenge, _details): (bool, bool, HashMap<String, String>) = reply
            .body()
            .deserialize()
            .map_err(|e| AuthError::PolkitFailed {
                action,
                reason: format!("malformed reply: {e}"),
            })?;
        debug!(
            subject = subject.0,
            uid,
            action = action.id(),
            authorized,
            challenge,
            interactive,
            "polkit decision"
        );
        if authorized {
            Ok(())
        } else if challenge {
            Err(AuthError::InteractionRequired { action })
        } else {
            Err(AuthError::Denied { action })
        }
    }
}

/// Errors that mean "nobody answered" rather than "polkit said no".
fn polkit_call_error(action: Action, e: zbus::Error) -> AuthError {
    const UNREACHABLE: &[&str] = &[
        "org.freedesktop.DBus.Error.ServiceUnknown",
        "org.freedesktop.DBus.Error.NameHasNoOwner",
        "org.freedesktop.DBus.Error.NoReply",
        "org.freedesktop.DBus.Error.Timeout",
        "org.freedesktop.DBus.Error.TimedOut",
        "org.freedesktop.DBus.Error.Disconnected",
        "org.freedesktop.DBus.Error.Spawn.ChildExited",
        "org.freedesktop.DBus.Error.Spawn.Failed",
        "org.freedesktop.DBus.Error.Spawn.ExecFailed",
        "org.freedesktop.DBus.Error.UnknownObject",
        "org.freedesktop.DBus.Error.UnknownInterface",
        "org.freedesktop.DBus.Error.UnknownMethod",
    ];
    let (name, reason) = match &e {
        zbus::Error::MethodError(name, desc, _) => (
            Some(name.as_str().to_owned()),
            desc.clone().unwrap_or_default(),
        ),
        zbus::Error::FDO(f) => (
            Some(zbus::DBusError::name(f.as_ref()).as_str().to_owned()),
            zbus::DBusError::description(f.as_ref())
                .unwrap_or_default()
                .to_owned(),
        ),
        _ => (None, String::new()),
    };
    match name {
        Some(n) if UNREACHABLE.contains(&n.as_str()) => AuthError::PolkitUnreachable {
            action,
            reason: format!("{n}: {reason}"),
        },
        Some(n) => AuthError::PolkitFailed {
            action,
            reason: format!("{n}: {reason}"),
        },
        // Transport-level failure (I/O, closed connection).
        None => AuthError::PolkitUnreachable {
            action,
            reason: e.to_string(),
        },
    }
}

/// The process start time polkit wants for a `unix-process` subject: field
/// 22 (`starttime`, clock ticks since boot) of `/proc/PID/stat`.
pub fn process_start_time(pid: u32) -> std::io::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_start_time(&stat).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("/proc/{pid}/stat: no start time field"),
        )
    })
}

/// `comm` (field 2) may contain spaces and parentheses, so fields are
/// counted after the last `)`: field 3 is the first one there.
fn parse_start_time(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_ascii_whitespace().nth(22 - 3)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn action_ids() {
        assert_eq!(Action::Manage.id(), "org.cube.NetworkAgent.manage");
        assert_eq!(Action::Read.id(), "org.cube.NetworkAgent.read");
    }

    #[test]
    fn start_time_survives_odd_comm() {
        let stat =
            "1234 (a) b (c) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10";
        assert_eq!(parse_start_time(stat), Some(987654));
        assert_eq!(parse_start_time("1 (x) S 1"), None);
        let own = process_start_time(std::process::id()).unwrap();
        assert!(own > 0);
    }

    #[test]
    fn messages_name_the_action() {
        let e = AuthError::Denied {
            action: Action::Manage,
        };
        assert!(e.to_string().contains("org.cube.NetworkAgent.manage"));
        let e = AuthError::PolkitUnreachable {
            action: Action::Read,
            reason: "x".into(),
        };
        assert!(e.to_string().contains("polkit was unreachable"), "{e}");
        assert!(e.to_string().contains("org.cube.NetworkAgent.read"), "{e}");
    }
}
