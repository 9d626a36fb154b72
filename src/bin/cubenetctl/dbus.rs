//! The D-Bus side: connecting to the chosen bus, calling the agent and
//! mapping its errors to exit statuses and `NAME: message` lines.

use zbus::Connection;

use crate::args::Bus;
use crate::failure::{EXIT_AGENT, EXIT_NOT_FOUND, EXIT_UNREACHABLE, Failure, Res};

pub const NAME: &str = "org.cube.NetworkAgent";
const PATH: &str = "/org/cube/NetworkAgent";
const IFACE: &str = "org.cube.NetworkAgent";
const ERROR_PREFIX: &str = "org.cube.NetworkAgent.Error.";

/// The exit status for an error answer: `agent_error` is the name of one of
/// the agent's own errors (`NotFound`), None for the bus's (whose last name
/// component is `short`: `ServiceUnknown`, `AccessDenied`...).
fn exit_code(agent_error: Option<&str>, short: &str) -> u8 {
    match agent_error {
        Some("NotFound") => EXIT_NOT_FOUND,
        Some(_) => EXIT_AGENT,
        None => match short {
            "ServiceUnknown" | "NameHasNoOwner" | "AccessDenied" | "NoReply" | "Disconnected"
            | "NoServer" | "Timeout" | "TimedOut" | "LimitsExceeded" => EXIT_UNREACHABLE,
            _ => EXIT_AGENT,
        },
    }
}

pub struct Agent {
    conn: Connection,
    bus: Bus,
}

impl Agent {
    pub async fn connect(bus: &Bus) -> Res<Agent> {
        let unreachable = |e: zbus::Error| {
            Failure::new(
                EXIT_UNREACHABLE,
                format!("cannot connect to the {}: {e}", bus.describe()),
            )
        };
        let builder = match bus {
            Bus::System => zbus::connection::Builder::system().map_err(unreachable)?,
            Bus::Session => zbus::connection::Builder::session().map_err(unreachable)?,
            Bus::Address(a) => zbus::connection::Builder::address(a.as_str()).map_err(|e| {
                Failure::usage(format!("--bus '{a}': not a usable D-Bus address: {e}"))
            })?,
        };
        Ok(Agent {
            conn: builder.build().await.map_err(unreachable)?,
            bus: bus.clone(),
        })
    }

    pub async fn call<B, R>(&self, method: &str, body: &B) -> Res<R>
    where
        B: serde::Serialize + zbus::zvariant::DynamicType,
        R: for<'d> zbus::zvariant::DynamicDeserialize<'d>,
    {
        self.call_explained(method, body, &|m| m.to_owned()).await
    }

    /// Like `call`; `explain` rewrites the message of an error the agent
    /// answered with (to name the flag the user typed).
    pub async fn call_explained<B, R>(
        &self,
        method: &str,
        body: &B,
        explain: &dyn Fn(&str) -> String,
    ) -> Res<R>
    where
        B: serde::Serialize + zbus::zvariant::DynamicType,
        R: for<'d> zbus::zvariant::DynamicDeserialize<'d>,
    {
        self.call_on(IFACE, method, body, explain).await
    }

    async fn call_on<B, R>(
        &self,
        iface: &str,
        method: &str,
        body: &B,
        explain: &dyn Fn(&str) -> String,
    ) -> Res<R>
    where
        B: serde::Serialize + zbus::zvariant::DynamicType,
        R: for<'d> zbus::zvariant::DynamicDeserialize<'d>,
    {
        let reply = self
            .conn
            .call_method(Some(NAME), PATH, Some(iface), method, body)
            .await
            .map_err(|e| self.failure(e, explain))?;
        reply.body().deserialize().map_err(|e| {
            Failure::new(
                EXIT_AGENT,
                format!("{method}: unexpected reply from the agent: {e}"),
            )
        })
    }

    /// A string property of the agent's interface (`EgressCaCertificate`).
    pub async fn string_property(&self, name: &str) -> Res<String> {
        let v: zbus::zvariant::OwnedValue = self
            .call_on(
                "org.freedesktop.DBus.Properties",
                "Get",
                &(IFACE, name),
                &|m| m.to_owned(),
            )
            .await?;
        String::try_from(v).map_err(|e| {
            Failure::new(
                EXIT_AGENT,
                format!("{name}: unexpected value from the agent: {e}"),
            )
        })
    }

    /// A failed call → exit status and `NAME: message`.
    fn failure(&self, e: zbus::Error, explain: &dyn Fn(&str) -> String) -> Failure {
        match e {
            zbus::Error::MethodError(name, msg, _) => {
                let full = name.as_str();
                let short = full.rsplit('.').next().unwrap_or(full);
                let agent_error = full.strip_prefix(ERROR_PREFIX);
                let code = exit_code(agent_error, short);
                let msg = msg.unwrap_or_default();
                let msg = if agent_error.is_some() {
                    explain(&msg)
                } else {
                    msg
                };
                let hint = if short == "AccessDenied" {
                    // The agent (or the bus) answered: a question of rights.
                    crate::failure::access_hint()
                } else if code == EXIT_UNREACHABLE {
                    format!(
                        " (is cube-network-agent running on the {}?)",
                        self.bus.describe()
                    )
                } else {
                    String::new()
                };
                Failure::new(code, format!("{short}: {msg}{hint}"))
            }
            other => Failure::new(
                EXIT_UNREACHABLE,
                format!("talking to {NAME} on the {}: {other}", self.bus.describe()),
            ),
        }
    }
}
