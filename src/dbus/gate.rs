//! The read gate: reads through the object tree need the same
//! authorization as GetNetwork/ListNetworks (SPEC §5). zbus serves
//! `org.freedesktop.DBus.Properties` and `ObjectManager.GetManagedObjects`
//! itself, without asking the interface's methods, so [`ReadGate`] wraps
//! an interface and checks `org.cube.NetworkAgent.read` (root passes
//! without asking polkit) before a caller's Get/GetAll reaches it, and,
//! for the ObjectManager, before GetManagedObjects. zbus's own reads
//! (InterfacesAdded, PropertiesChanged, GetManagedObjects collecting each
//! object's properties) carry no caller and pass — except while the
//! start's objects are registered ([`Registering`]). Introspection and
//! signals are the bus policy's part (dbus/org.cube.NetworkAgent.conf).

use std::collections::HashMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicBool, Ordering};

use zbus::message::{Flags, Header, Message};
use zbus::names::{InterfaceName, MemberName};
use zbus::object_server::{DispatchResult2, Interface, SignalEmitter};
use zbus::zvariant::{OwnedValue, Value};
use zbus::{Connection, ObjectServer, fdo};

use crate::auth::{Action, AuthError, Authority};

/// An interface whose property reads (and, with `gate_calls`, method
/// calls) need `org.cube.NetworkAgent.read`.
pub struct ReadGate<I> {
    pub inner: I,
    authority: Authority,
    gate_calls: bool,
}

impl<I> ReadGate<I> {
    /// Property reads gated; method calls go straight through (they
    /// authorize themselves).
    pub fn properties(inner: I, authority: Authority) -> Self {
        ReadGate {
            inner,
            authority,
            gate_calls: false,
        }
    }

    /// Property reads and method calls gated (the ObjectManager).
    pub fn everything(inner: I, authority: Authority) -> Self {
        ReadGate {
            inner,
            authority,
            gate_calls: true,
        }
    }
}

/// Set while the start's objects are registered: zbus's own reads fail.
static REGISTERING: AtomicBool = AtomicBool::new(false);

/// The message of the error zbus's own reads get while [`REGISTERING`].
const REGISTERING_MSG: &str = "network objects are being registered";

/// The start's registration of every network object and then the
/// ObjectManager, without a signal. zbus announces every object already
/// under a newly added ObjectManager (and every object added under an
/// existing one) with InterfacesAdded: at a start with 10,000 networks,
/// 10,000 broadcasts of each network's properties, sent before the agent
/// owns its name, so the bus policy's `receive_sender` rule (signals to
/// root only) does not apply to them, and they took ~450 ms of the start.
/// zbus collects every object's properties before it sends the first
/// signal; while this guard lives, those reads (they carry no caller)
/// fail, so nothing is sent, and the ObjectManager stays registered (zbus
/// adds it before it announces). Nobody can call us yet (the name is taken
/// after the guard is dropped).
pub struct Registering(());

impl Registering {
    pub fn start() -> Self {
        REGISTERING.store(true, Ordering::SeqCst);
        Registering(())
    }

    /// Whether `e` is the refusal of zbus's announcement (the
    /// registration itself succeeded).
    pub fn is_announcement(e: &zbus::Error) -> bool {
        matches!(e, zbus::Error::FDO(f) if matches!(&**f, fdo::Error::Failed(m) if m == REGISTERING_MSG))
    }
}

impl Drop for Registering {
    fn drop(&mut self) {
        REGISTERING.store(false, Ordering::SeqCst);
    }
}

/// Authorizes the caller of `header` for a read; `Ok` for zbus's own
/// reads, which have no caller (refused while [`Registering`]).
async fn allow_read(authority: &Authority, header: Option<&Header<'_>>) -> fdo::Result<()> {
    let Some(header) = header else {
        if REGISTERING.load(Ordering::SeqCst) {
            return Err(fdo::Error::Failed(REGISTERING_MSG.into()));
        }
        return Ok(());
    };
    let Some(sender) = header.sender() else {
        return Err(fdo::Error::AccessDenied(format!(
            "not authorized for {}: the call has no sender",
            Action::Read
        )));
    };
    let interactive = header
        .primary()
        .flags()
        .contains(Flags::AllowInteractiveAuth);
    match authority
        .check_bus_caller(sender, Action::Read, interactive)
        .await
    {
        Ok(()) => Ok(()),
        Err(e) => {
            crate::refusals::note(
                crate::refusals::Caller {
                    edge: "dbus",
                    name: sender.as_str(),
                    uid: authority.known_uid(sender),
                    pid: None,
                },
                crate::refusals::Refusal {
                    method: header.member().map(|m| m.as_str()).unwrap_or(""),
                    sandbox_id: "",
                    error: "AccessDenied",
                    message: &format!(
                        "{} on {}: {e}",
                        header.member().map(|m| m.as_str()).unwrap_or(""),
                        header.path().map(|p| p.as_str()).unwrap_or("")
                    ),
                },
            );
            Err(match e {
                e @ AuthError::InteractionRequired { .. } => {
                    fdo::Error::InteractiveAuthorizationRequired(e.to_string())
                }
                e => fdo::Error::AccessDenied(e.to_string()),
            })
        }
    }
}

#[zbus::export::async_trait::async_trait]
impl<I: Interface> Interface for ReadGate<I> {
    fn name() -> InterfaceName<'static> {
        I::name()
    }

    fn spawn_tasks_for_methods(&self) -> bool {
        self.inner.spawn_tasks_for_methods()
    }

    async fn get(
        &self,
        property_name: &str,
        server: &ObjectServer,
        connection: &Connection,
        header: Option<&Header<'_>>,
        emitter: &SignalEmitter<'_>,
    ) -> Option<fdo::Result<OwnedValue>> {
        if let Err(e) = allow_read(&self.authority, header).await {
            return Some(Err(e));
        }
        self.inner
            .get(property_name, server, connection, header, emitter)
            .await
    }

    async fn get_all(
        &self,
        server: &ObjectServer,
        connection: &Connection,
        header: Option<&Header<'_>>,
        emitter: &SignalEmitter<'_>,
    ) -> fdo::Result<HashMap<String, OwnedValue>> {
        allow_read(&self.authority, header).await?;
        self.inner
            .get_all(server, connection, header, emitter)
            .await
    }

    fn set<'call>(
        &'call self,
        property_name: &'call str,
        value: &'call Value<'_>,
        server: &'call ObjectServer,
        connection: &'call Connection,
        header: Option<&'call Header<'_>>,
        emitter: &'call SignalEmitter<'_>,
    ) -> DispatchResult2<'call> {
        self.inner
            .set(property_name, value, server, connection, header, emitter)
    }

    async fn set_mut(
        &mut self,
        property_name: &str,
        value: &Value<'_>,
        server: &ObjectServer,
        connection: &Connection,
        header: Option<&Header<'_>>,
        emitter: &SignalEmitter<'_>,
    ) -> Option<fdo::Result<()>> {
        self.inner
            .set_mut(property_name, value, server, connection, header, emitter)
            .await
    }

    fn call<'call>(
        &'call self,
        server: &'call ObjectServer,
        connection: &'call Connection,
        msg: &'call Message,
        name: MemberName<'call>,
    ) -> DispatchResult2<'call> {
        if !self.gate_calls {
            return self.inner.call(server, connection, msg, name);
        }
        // The inner future sends its own reply; an error returned from
        // here is sent by zbus as the error reply.
        DispatchResult2::Async(Box::pin(async move {
            allow_read(&self.authority, Some(&msg.header())).await?;
            match self.inner.call(server, connection, msg, name) {
                DispatchResult2::Async(f) => f.await,
                DispatchResult2::NotFound | DispatchResult2::RequiresMut => {
                    Err(fdo::Error::UnknownMethod(format!(
                        "Unknown method '{}'",
                        msg.header().member().map(|m| m.as_str()).unwrap_or("")
                    )))
                }
            }
        }))
    }

    fn call_mut<'call>(
        &'call mut self,
        server: &'call ObjectServer,
        connection: &'call Connection,
        msg: &'call Message,
        name: MemberName<'call>,
    ) -> DispatchResult2<'call> {
        self.inner.call_mut(server, connection, msg, name)
    }

    fn introspect_to_writer(&self, writer: &mut dyn Write, level: usize) {
        self.inner.introspect_to_writer(writer, level)
    }
}
