//! The gate in front of the manager's methods: a call is checked against
//! its method's size limit and signature from the bytes zbus already holds,
//! before anything decodes its body. A 2 MB EnsureNetwork used to cost ~90
//! MB of decoded `OwnedValue`s (and 1 GB for 24 MB) before the agent could
//! say no; now it costs the message itself, and the answer is a specific
//! error instead of zbus's generic one.
//!
//! zbus offers no hook before its generated dispatch decodes arguments, so
//! [`Bounded`] wraps the generated `Interface` and delegates everything
//! else to it (the zbus version is pinned in Cargo.lock; the trait is marked
//! unstable upstream).

use std::collections::HashMap;
use std::fmt::Write;

use zbus::message::{Header, Message};
use zbus::names::{InterfaceName, MemberName};
use zbus::object_server::{DispatchResult2, Interface, SignalEmitter};
use zbus::zvariant::{OwnedValue, Value};
use zbus::{Connection, ObjectServer, fdo};

use crate::agent::spec::{
    MAX_CIDRS, MAX_ID_LEN, MAX_IDEMPOTENCY_KEY, MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE,
    MAX_PORT_MAPPINGS,
};

/// Bytes of header, padding and fields every message carries, with room
/// for long sender/path names.
const HEADER_ALLOWANCE: usize = 1024;
/// One `{sv}` entry's fixed cost: alignment, key length, variant signature.
const ENTRY: usize = 32;

/// The largest EnsureNetwork a valid request can produce: every option at
/// its limit, strings at their longest (a port mapping's host ip is at most
/// 15 bytes, a CIDR 18), plus the per-entry framing. About 90 KiB.
pub const MAX_ENSURE_BYTES: usize = HEADER_ALLOWANCE
    + 8
    + MAX_ID_LEN
    + 16 * ENTRY
    + MAX_PORT_MAPPINGS * (8 + 4 + 8 + 2 + 2 + 4 + 16)
    + 2 * MAX_CIDRS * (8 + 19)
    + MAX_METADATA * (ENTRY + MAX_METADATA_KEY + MAX_METADATA_VALUE)
    + ENTRY
    + MAX_IDEMPOTENCY_KEY
    // attach ("veth"), ifname (15 bytes), netns_fd (an index)
    + 3 * ENTRY
    + 8
    + 16
    + 4;
const _: () = assert!(MAX_ENSURE_BYTES < 128 * 1024);
/// Every other method takes at most one sandbox id.
pub const MAX_SMALL_CALL_BYTES: usize = HEADER_ALLOWANCE + 8 + MAX_ID_LEN + 64;

/// (member, input signature, size limit) of each manager method.
const METHODS: &[(&str, &str, usize)] = &[
    ("EnsureNetwork", "sa{sv}", MAX_ENSURE_BYTES),
    ("ReleaseNetwork", "s", MAX_SMALL_CALL_BYTES),
    // Expectations are a subset of an EnsureNetwork's options.
    ("ReleaseNetworkIf", "sa{sv}", MAX_ENSURE_BYTES),
    ("ReconcileNetwork", "s", MAX_SMALL_CALL_BYTES),
    ("GetNetwork", "s", MAX_SMALL_CALL_BYTES),
    ("ListNetworks", "", MAX_SMALL_CALL_BYTES),
    ("OpenTap", "s", MAX_SMALL_CALL_BYTES),
    ("Health", "", MAX_SMALL_CALL_BYTES),
];

/// Why a call is refused before decoding, if it is.
pub fn precheck(member: &str, signature: &str, size: usize) -> Option<fdo::Error> {
    let &(_, want, limit) = METHODS.iter().find(|(m, _, _)| *m == member)?;
    if size > limit {
        return Some(fdo::Error::LimitsExceeded(format!(
            "{member}: the message is {size} bytes, the limit is {limit} \
             (at most {MAX_PORT_MAPPINGS} port_mappings, {MAX_CIDRS} CIDRs per list, \
             {MAX_METADATA} metadata entries of {MAX_METADATA_VALUE} bytes)"
        )));
    }
    if signature != want {
        return Some(fdo::Error::InvalidArgs(format!(
            "{member} takes ({want}), not ({signature})"
        )));
    }
    None
}

/// An interface whose method calls pass [`precheck`] first.
pub struct Bounded<I>(pub I);

#[zbus::export::async_trait::async_trait]
impl<I: Interface> Interface for Bounded<I> {
    fn name() -> InterfaceName<'static> {
        I::name()
    }

    fn spawn_tasks_for_methods(&self) -> bool {
        self.0.spawn_tasks_for_methods()
    }

    async fn get(
        &self,
        property_name: &str,
        server: &ObjectServer,
        connection: &Connection,
        header: Option<&Header<'_>>,
        emitter: &SignalEmitter<'_>,
    ) -> Option<fdo::Result<OwnedValue>> {
        self.0
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
        self.0.get_all(server, connection, header, emitter).await
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
        self.0
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
        self.0
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
        let signature = msg.body().signature().to_string_no_parens();
        let size = msg.data().len();
        match precheck(name.as_str(), &signature, size) {
            Some(e) => {
                tracing::warn!(method = name.as_str(), size, %signature, error = %e, "call refused before decoding");
                DispatchResult2::new_async(connection, msg, async move { Err::<(), _>(e) })
            }
            None => self.0.call(server, connection, msg, name),
        }
    }

    fn call_mut<'call>(
        &'call mut self,
        server: &'call ObjectServer,
        connection: &'call Connection,
        msg: &'call Message,
        name: MemberName<'call>,
    ) -> DispatchResult2<'call> {
        self.0.call_mut(server, connection, msg, name)
    }

    fn introspect_to_writer(&self, writer: &mut dyn Write, level: usize) {
        self.0.introspect_to_writer(writer, level)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_and_signatures() {
        assert!(precheck("EnsureNetwork", "sa{sv}", 2_000).is_none());
        assert!(precheck("Health", "", 100).is_none());
        let e = precheck("EnsureNetwork", "sa{sv}", 2_400_000).unwrap();
        assert!(
            matches!(&e, fdo::Error::LimitsExceeded(m) if m.contains("2400000 bytes")),
            "{e:?}"
        );
        let e = precheck("ReleaseNetwork", "u", 40).unwrap();
        assert!(
            matches!(&e, fdo::Error::InvalidArgs(m) if m == "ReleaseNetwork takes (s), not (u)"),
            "{e:?}"
        );
        let e = precheck("GetNetwork", "s", MAX_SMALL_CALL_BYTES + 1).unwrap();
        assert!(matches!(e, fdo::Error::LimitsExceeded(_)));
        // Unknown members go on to zbus (UnknownMethod).
        assert!(precheck("Nope", "s", 1 << 20).is_none());
    }

    /// The largest valid EnsureNetwork (every option at its limit) passes.
    #[test]
    fn the_largest_valid_request_fits() {
        let id = "x".repeat(MAX_ID_LEN);
        let mappings: Vec<(String, u16, u16, String)> = (0..MAX_PORT_MAPPINGS)
            .map(|i| {
                (
                    "tcp".into(),
                    1 + i as u16,
                    20000 + i as u16,
                    "255.255.255.255".into(),
                )
            })
            .collect();
        let cidrs: Vec<String> = (0..MAX_CIDRS)
            .map(|_| "255.255.255.255/32".into())
            .collect();
        let metadata: HashMap<String, String> = (0..MAX_METADATA)
            .map(|i| {
                (
                    format!("{i:0>width$}", width = MAX_METADATA_KEY),
                    "v".repeat(MAX_METADATA_VALUE),
                )
            })
            .collect();
        let mut o: HashMap<&str, Value<'_>> = HashMap::new();
        o.insert("port_mappings", Value::from(mappings));
        o.insert("allow_out", Value::from(cidrs.clone()));
        o.insert("deny_out", Value::from(cidrs));
        o.insert("metadata", Value::from(metadata));
        o.insert(
            "idempotency_key",
            Value::from("k".repeat(MAX_IDEMPOTENCY_KEY)),
        );
        o.insert("allow_internet_access", Value::from(true));
        o.insert("mtu", Value::from(9000u32));
        let msg = Message::method_call("/org/cube/NetworkAgent", "EnsureNetwork")
            .unwrap()
            .sender(":1.123456789")
            .unwrap()
            .destination("org.cube.NetworkAgent")
            .unwrap()
            .interface("org.cube.NetworkAgent")
            .unwrap()
            .build(&(id, o))
            .unwrap();
        let size = msg.data().len();
        assert!(size <= MAX_ENSURE_BYTES, "{size} > {MAX_ENSURE_BYTES}");
        let sig = msg.body().signature().to_string_no_parens();
        assert!(precheck("EnsureNetwork", &sig, size).is_none());
    }
}
