//! JSON ↔ agent types for the varlink edge. Schema problems (a missing or
//! unknown field, a wrong JSON type, an out-of-range integer) are
//! `org.varlink.service.InvalidParameter` naming the field; value problems
//! (a bad protocol, CIDR, sandbox id) are the core's `InvalidArgument`.

use serde_json::{Map, Value, json};

use super::Failure;
use crate::agent::spec::{Bandwidth, EgressMode, Expect, NetworkSpec, PortMapping};
use crate::agent::{AgentError, NetworkInfo, ReconcileReport};
use crate::datapath::Check;

pub type Object = Map<String, Value>;

fn invalid(key: &str) -> Failure {
    Failure::InvalidParameter(key.to_owned())
}

/// Checks that `params` has no keys beyond `allowed`.
pub fn only(params: &Object, allowed: &[&str]) -> Result<(), Failure> {
    let mut keys: Vec<&String> = params.keys().collect();
    keys.sort();
    match keys.into_iter().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(invalid(k)),
        None => Ok(()),
    }
}

/// A required string parameter.
pub fn string(params: &Object, key: &str) -> Result<String, Failure> {
    match params.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        _ => Err(invalid(key)),
    }
}

fn as_string(v: &Value, key: &str) -> Result<String, Failure> {
    v.as_str().map(str::to_owned).ok_or_else(|| invalid(key))
}

fn as_bool(v: &Value, key: &str) -> Result<bool, Failure> {
    v.as_bool().ok_or_else(|| invalid(key))
}

fn as_uint<T: TryFrom<u64>>(v: &Value, key: &str) -> Result<T, Failure> {
    v.as_u64()
        .and_then(|n| T::try_from(n).ok())
        .ok_or_else(|| invalid(key))
}

fn as_strings(v: &Value, key: &str) -> Result<Vec<String>, Failure> {
    v.as_array()
        .ok_or_else(|| invalid(key))?
        .iter()
        .map(|s| as_string(s, key))
        .collect()
}

fn as_mappings(v: &Value, key: &str) -> Result<Vec<PortMapping>, Failure> {
    let list = v.as_array().ok_or_else(|| invalid(key))?;
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let m = m.as_object().ok_or_else(|| invalid(key))?;
        if m.keys().any(|k| {
            !matches!(
                k.as_str(),
                "protocol" | "container_port" | "host_port" | "host_ip"
            )
        }) {
            return Err(invalid(key));
        }
        let field = |f: &str| m.get(f).ok_or_else(|| invalid(key));
        let proto = as_string(field("protocol")?, key)?;
        let protocol = proto.parse().map_err(|()| {
            Failure::Agent(AgentError::InvalidArgument(format!(
                "port_mappings[{i}]: protocol '{proto}' is not 'tcp' or 'udp'"
            )))
        })?;
        out.push(PortMapping {
            protocol,
            container_port: as_uint(field("container_port")?, key)?,
            host_port: as_uint(field("host_port")?, key)?,
            host_ip: as_string(field("host_ip")?, key)?,
        });
    }
    Ok(out)
}

/// `egress_rules: []EgressRule` (host, set_headers, methods, paths,
/// plain_http); the core validates them. A field of the wrong type is
/// named as `egress_rules[i].field`; no error quotes a header value.
fn as_rules(v: &Value, key: &str) -> Result<Vec<crate::rules::EgressRule>, Failure> {
    use crate::rules::{EgressRule, MAX_RULES, Secret};
    let list = v.as_array().ok_or_else(|| invalid(key))?;
    if list.len() > MAX_RULES {
        return Err(Failure::Agent(AgentError::InvalidArgument(format!(
            "{key}: {} rules, the limit is {MAX_RULES}",
            list.len()
        ))));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, r) in list.iter().enumerate() {
        let r = r
            .as_object()
            .ok_or_else(|| invalid(&format!("{key}[{i}]")))?;
        let mut rule = EgressRule::default();
        for (name, v) in r {
            let field = format!("{key}[{i}].{name}");
            if v.is_null() {
                continue;
            }
            match name.as_str() {
                "host" => rule.host = as_string(v, &field)?,
                "set_headers" => {
                    let m = v.as_object().ok_or_else(|| invalid(&field))?;
                    for (h, val) in m {
                        let val = val.as_str().ok_or_else(|| invalid(&field))?;
                        rule.set_headers
                            .insert(h.clone(), Secret::new(val.to_owned()));
                    }
                }
                "methods" => rule.methods = as_strings(v, &field)?,
                "paths" => rule.paths = as_strings(v, &field)?,
                "plain_http" => rule.plain_http = as_bool(v, &field)?,
                _ => return Err(invalid(&field)),
            }
        }
        out.push(rule);
    }
    Ok(out)
}

/// SetEgressRules' `rules` (absent or null: none).
pub fn rules(v: Option<&Value>) -> Result<Vec<crate::rules::EgressRule>, Failure> {
    match v {
        None | Some(Value::Null) => Ok(vec![]),
        Some(v) => as_rules(v, "rules"),
    }
}

/// The `options` parameter (an `Options` object, absent or null = all
/// defaults) → a spec. A null field is the same as an absent one.
pub fn options(v: Option<&Value>) -> Result<NetworkSpec, Failure> {
    let mut spec = NetworkSpec::default();
    let o = match v {
        None | Some(Value::Null) => return Ok(spec),
        Some(Value::Object(o)) => o,
        Some(_) => return Err(invalid("options")),
    };
    let mut keys: Vec<&String> = o.keys().collect();
    keys.sort();
    for key in keys {
        let v = &o[key];
        if v.is_null() {
            continue;
        }
        match key.as_str() {
            "port_mappings" => spec.port_mappings = as_mappings(v, key)?,
            "allow_internet_access" => spec.allow_internet_access = Some(as_bool(v, key)?),
            "allow_out" => spec.allow_out = as_strings(v, key)?,
            "deny_out" => spec.deny_out = as_strings(v, key)?,
            "metadata" => {
                let m = v.as_object().ok_or_else(|| invalid(key))?;
                for (k, val) in m {
                    spec.metadata.insert(k.clone(), as_string(val, key)?);
                }
            }
            "idempotency_key" => spec.idempotency_key = Some(as_string(v, key)?),
            "mtu" => spec.mtu = Some(as_uint(v, key)?),
            "egress_mode" => {
                spec.egress_mode =
                    EgressMode::parse(key, &as_string(v, key)?).map_err(|_| invalid(key))?
            }
            "egress_rules" => spec.egress_rules = as_rules(v, key)?,
            "egress_bps" => spec.bandwidth.egress_bps = as_uint(v, key)?,
            "ingress_bps" => spec.bandwidth.ingress_bps = as_uint(v, key)?,
            "egress_burst" => spec.bandwidth.egress_burst = as_uint(v, key)?,
            "ingress_burst" => spec.bandwidth.ingress_burst = as_uint(v, key)?,
            "clone_of" => spec.clone_of = Some(as_string(v, key)?),
            "paused" => spec.paused = as_bool(v, key)?,
            "tap_owner_uid" => spec.tap_owner_uid = Some(as_uint(v, key)?),
            "tap_owner_gid" => spec.tap_owner_gid = Some(as_uint(v, key)?),
            "sandbox_ip" => {
                spec.sandbox_ip = Some(
                    crate::agent::cni::parse_sandbox_ip(&as_string(v, key)?)
                        .map_err(Failure::Agent)?,
                )
            }
            "sandbox_ipv6" => {
                spec.sandbox_ipv6 = Some(
                    crate::agent::cni::parse_sandbox_ipv6(&as_string(v, key)?)
                        .map_err(Failure::Agent)?,
                )
            }
            other => return Err(invalid(other)),
        }
    }
    Ok(spec)
}

/// ReleaseNetworkIf's `expect` (an `Expect` object) → [`Expect`]. No
/// namespace here: a varlink call carries no fd (D-Bus does).
pub fn expect(v: Option<&Value>) -> Result<Expect, Failure> {
    let mut out = Expect::default();
    let o = match v {
        Some(Value::Object(o)) => o,
        _ => return Err(invalid("expect")),
    };
    for (key, v) in o {
        if v.is_null() {
            continue;
        }
        match key.as_str() {
            "network_handle" => out.network_handle = Some(as_string(v, key)?),
            "attach" => out.attach = Some(as_string(v, key)?),
            "ifname" => out.ifname = Some(as_string(v, key)?),
            "metadata" => {
                let m = v.as_object().ok_or_else(|| invalid(key))?;
                for (k, val) in m {
                    out.metadata.insert(k.clone(), as_string(val, key)?);
                }
            }
            other => return Err(invalid(other)),
        }
    }
    Ok(out)
}

fn mappings(m: &[PortMapping]) -> Value {
    m.iter()
        .map(|m| {
            json!({
                "protocol": m.protocol.to_string(),
                "container_port": m.container_port,
                "host_port": m.host_port,
                "host_ip": m.host_ip,
            })
        })
        .collect()
}

/// A `Traffic`.
pub fn traffic(t: &crate::agent::traffic::Traffic) -> Value {
    Value::Object(
        t.fields()
            .into_iter()
            .map(|(k, v)| (k.to_owned(), Value::from(v)))
            .collect(),
    )
}

/// A `Capacity` answer: the IDL's type `NodeCapacity` (a type may not share
/// the method's name: one namespace for types, methods and errors).
pub fn capacity(c: &crate::agent::capacity::Capacity) -> Value {
    let mut o: serde_json::Map<String, Value> = c
        .fields()
        .into_iter()
        .filter(|(k, _)| *k != "labels")
        .map(|(k, v)| (k.to_owned(), Value::from(v)))
        .collect();
    o.insert("labels".into(), json!(c.labels));
    Value::Object(o)
}

/// A `Network`.
pub fn network(info: NetworkInfo) -> Value {
    let r = std::sync::Arc::unwrap_or_clone(info.view.record);
    let mut o = json!({
        "sandbox_id": r.sandbox_id,
        "network_handle": r.network_handle,
        "tap_name": r.tap_name,
        "tap_ifindex": info.view.tap_ifindex,
        "sandbox_ip": r.sandbox_ip.to_string(),
        "guest_ip": info.guest_ip,
        "gateway_ip": info.gateway_ip,
        "guest_mac": info.guest_mac,
        "gateway_mac": info.gateway_mac,
        "mtu": r.mtu,
        "port_mappings": mappings(&r.port_mappings),
        "allow_internet_access": r.allow_internet_access,
        "allow_out": r.allow_out,
        "deny_out": r.deny_out,
        "egress_mode": r.egress_mode.as_str(),
        "egress_rules": r.egress_rules.iter().map(|x| x.shown()).collect::<Vec<_>>(),
        "metadata": r.metadata,
        "routes": info.routes.into_iter().map(|(destination, gateway, device)| {
            json!({"destination": destination, "gateway": gateway, "device": device})
        }).collect::<Value>(),
        "arp_neighbors": info.arp_neighbors.into_iter().map(|(ip, mac, device)| {
            json!({"ip": ip, "mac": mac, "device": device})
        }).collect::<Value>(),
        "created_unix": r.created_unix,
    });
    if let Some(k) = r.idempotency_key {
        o["idempotency_key"] = Value::String(k);
    }
    if let Some(src) = r.cloned_from {
        o["cloned_from"] = Value::String(src);
    }
    if let Some(a) = info.guest_ipv6 {
        o["guest_ipv6"] = Value::String(a);
    }
    if let Some(a) = info.gateway_ipv6 {
        o["gateway_ipv6"] = Value::String(a);
        o["ipv6_egress"] = Value::Bool(info.ipv6_egress);
        if let Some(why) = info.ipv6_egress_reason {
            o["ipv6_egress_reason"] = Value::String(why);
        }
    }
    if let Some(a) = info.sandbox_ipv6 {
        o["sandbox_ipv6"] = Value::String(a);
    }
    o["paused"] = Value::Bool(r.paused);
    if let Some(owner) = r.tap_owner {
        o["tap_owner_uid"] = Value::from(owner.uid);
        if let Some(g) = owner.gid {
            o["tap_owner_gid"] = Value::from(g);
        }
    }
    o["attach"] = Value::String(r.attach.name().into());
    let bw = r.bandwidth;
    o["egress_bps"] = Value::from(bw.egress_bps);
    o["ingress_bps"] = Value::from(bw.ingress_bps);
    if bw.egress_bps != 0 {
        o["egress_burst"] = Value::from(Bandwidth::burst_or_default(bw.egress_burst));
    }
    if bw.ingress_bps != 0 {
        o["ingress_burst"] = Value::from(Bandwidth::burst_or_default(bw.ingress_burst));
    }
    if let crate::agent::spec::AttachRecord::Veth { ifname, netns, .. } = r.attach {
        o["ifname"] = Value::String(ifname);
        if let Some(ns) = netns {
            o["netns"] = Value::String(ns.to_string());
        }
        o["mapping_wins"] = Value::Bool(r.mapping_wins);
    }
    o
}

/// A `ReconcileReport`.
pub fn report(r: ReconcileReport) -> Value {
    json!({
        "checked": r.checked,
        "repaired": r.repaired,
        "removed": r.removed,
        "errors": r.errors,
    })
}

/// `[]HealthCheck`.
pub fn checks(c: Vec<Check>) -> Value {
    c.into_iter()
        .map(|(name, ok, detail)| json!({"name": name, "ok": ok, "detail": detail}))
        .collect()
}

/// WatchFlows' parameters, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowWatch {
    pub filter: crate::flows::Filter,
    /// Replay the kept records of the last this many seconds first.
    pub since_seconds: u64,
    /// Then every new record (else the stream ends after the history).
    pub follow: bool,
}

/// The most WatchFlows replays: the agent keeps at most an hour.
pub const MAX_FLOW_HISTORY_SECONDS: u64 = 3600;

/// WatchFlows' parameters (`sandbox_id`, `denied`, `since_seconds`,
/// `follow`; null is absent, `sandbox_id` "" is every sandbox): an unknown
/// one, a wrong type or `since_seconds` outside 0..=3600 is
/// InvalidParameter naming it.
pub fn flow_watch(p: &Object) -> Result<FlowWatch, Failure> {
    only(p, &["sandbox_id", "denied", "since_seconds", "follow"])?;
    let get = |k: &str| p.get(k).filter(|v| !v.is_null());
    let sandbox_id = get("sandbox_id")
        .map(|v| as_string(v, "sandbox_id"))
        .transpose()?
        .filter(|s| !s.is_empty());
    let denied = get("denied")
        .map(|v| as_bool(v, "denied"))
        .transpose()?
        .unwrap_or(false);
    let since_seconds = get("since_seconds")
        .map(|v| as_uint::<u64>(v, "since_seconds"))
        .transpose()?
        .unwrap_or(0);
    if since_seconds > MAX_FLOW_HISTORY_SECONDS {
        return Err(invalid("since_seconds"));
    }
    let follow = get("follow")
        .map(|v| as_bool(v, "follow"))
        .transpose()?
        .unwrap_or(true);
    Ok(FlowWatch {
        filter: crate::flows::Filter { sandbox_id, denied },
        since_seconds,
        follow,
    })
}

/// `time_unix_ns` as RFC 3339 in UTC with microseconds
/// (`2025-03-01T12:00:00.123456Z`).
pub fn rfc3339_micros(unix_ns: u64) -> String {
    let t = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(unix_ns))
        .expect("a u64 of nanoseconds is within time's range");
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:06}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second(),
        t.microsecond()
    )
}

fn endpoint(e: &crate::flows::Endpoint) -> Value {
    json!({"ip": e.ip.to_string(), "port": e.port})
}

/// A `Flow`: optional fields (node, reason, dns_name, totals) only when
/// the record has them.
pub fn flow(rec: &crate::flows::FlowRecord) -> Value {
    let mut o = json!({
        "time": rfc3339_micros(rec.time_unix_ns),
        "time_unix_ns": rec.time_unix_ns,
        "sandbox_id": rec.sandbox_id,
        "event": rec.event.as_str(),
        "family": rec.family,
        "protocol": rec.protocol,
        "direction": rec.direction.as_str(),
        "guest": endpoint(&rec.guest),
        "remote": endpoint(&rec.remote),
        "verdict": rec.verdict(),
    });
    if let Some(n) = &rec.node {
        o["node"] = endpoint(n);
    }
    if let Some(r) = rec.refused {
        o["reason"] = Value::from(r.as_str());
    }
    if let Some(d) = &rec.dns_name {
        o["dns_name"] = Value::from(d.as_str());
    }
    if let Some(t) = &rec.end {
        o["totals"] = json!({
            "bytes_out": t.bytes_out,
            "packets_out": t.packets_out,
            "bytes_in": t.bytes_in,
            "packets_in": t.packets_in,
            "duration_ms": t.duration_ms,
        });
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param_err(r: Result<NetworkSpec, Failure>) -> String {
        match r {
            Err(Failure::InvalidParameter(p)) => p,
            other => panic!("expected InvalidParameter, got {other:?}"),
        }
    }

    #[test]
    fn parses_every_option() {
        let v = json!({
            "port_mappings": [{"protocol": "tcp", "container_port": 80, "host_port": 0, "host_ip": ""}],
            "allow_internet_access": false,
            "allow_out": ["10.0.0.0/8"],
            "deny_out": ["1.1.1.1"],
            "metadata": {"k": "v"},
            "idempotency_key": "req-1",
            "mtu": 1400,
        });
        let s = options(Some(&v)).unwrap();
        assert_eq!(
            options(Some(&json!({"clone_of": "golden"})))
                .unwrap()
                .clone_of
                .as_deref(),
            Some("golden")
        );
        assert_eq!(s.port_mappings.len(), 1);
        assert_eq!(s.allow_internet_access, Some(false));
        assert_eq!(s.allow_out, vec!["10.0.0.0/8"]);
        assert_eq!(s.deny_out, vec!["1.1.1.1"]);
        assert_eq!(s.metadata.get("k").map(String::as_str), Some("v"));
        assert_eq!(s.idempotency_key.as_deref(), Some("req-1"));
        assert_eq!(s.mtu, Some(1400));
        assert_eq!(options(None).unwrap(), NetworkSpec::default());
        assert_eq!(
            options(Some(&json!({"mtu": null}))).unwrap(),
            NetworkSpec::default()
        );
    }

    #[test]
    fn schema_errors_name_the_key() {
        assert_eq!(param_err(options(Some(&json!({"bogus": 1})))), "bogus");
        assert_eq!(param_err(options(Some(&json!({"mtu": "1400"})))), "mtu");
        assert_eq!(param_err(options(Some(&json!({"mtu": -1})))), "mtu");
        assert_eq!(param_err(options(Some(&json!({"mtu": 1.5})))), "mtu");
        assert_eq!(param_err(options(Some(&json!([])))), "options");
        assert_eq!(
            param_err(options(Some(
                &json!({"port_mappings": [{"protocol": "tcp", "container_port": 70000, "host_port": 0, "host_ip": ""}]})
            ))),
            "port_mappings"
        );
        assert_eq!(
            param_err(options(Some(
                &json!({"port_mappings": [{"protocol": "tcp"}]})
            ))),
            "port_mappings"
        );
        assert_eq!(
            param_err(options(Some(&json!({"metadata": {"k": 1}})))),
            "metadata"
        );
        let e = options(Some(
            &json!({"port_mappings": [{"protocol": "sctp", "container_port": 1, "host_port": 0, "host_ip": ""}]}),
        ));
        assert!(
            matches!(&e, Err(Failure::Agent(AgentError::InvalidArgument(m))) if m.contains("protocol 'sctp'")),
            "{e:?}"
        );
    }
    #[test]
    fn an_ipv4_refusal_as_a_flow() {
        use crate::flows::{Direction, Endpoint, FlowEvent, FlowRecord, Reason};
        let rec = FlowRecord {
            time_unix_ns: 1_740_830_400_123_456_789,
            sandbox_id: "sbx-1".into(),
            event: FlowEvent::Refused,
            family: 4,
            protocol: "tcp".into(),
            direction: Direction::Egress,
            guest: Endpoint {
                ip: "169.254.68.6".parse().unwrap(),
                port: 41000,
            },
            remote: Endpoint {
                ip: "203.0.113.9".parse().unwrap(),
                port: 443,
            },
            node: None,
            refused: Some(Reason::Policy),
            dns_name: Some("blocked.example.com".into()),
            end: None,
        };
        assert_eq!(
            flow(&rec),
            json!({
                "time": "2025-03-01T12:00:00.123456Z",
                "time_unix_ns": 1_740_830_400_123_456_789_u64,
                "sandbox_id": "sbx-1",
                "event": "refused",
                "family": 4,
                "protocol": "tcp",
                "direction": "egress",
                "guest": {"ip": "169.254.68.6", "port": 41000},
                "remote": {"ip": "203.0.113.9", "port": 443},
                "verdict": "dropped",
                "reason": "policy",
                "dns_name": "blocked.example.com",
            })
        );
    }

    #[test]
    fn an_ipv6_end_with_totals_as_a_flow() {
        use crate::flows::{Direction, Endpoint, FlowEvent, FlowRecord, Totals};
        let rec = FlowRecord {
            time_unix_ns: 0,
            sandbox_id: "b".into(),
            event: FlowEvent::End,
            family: 6,
            protocol: "udp".into(),
            direction: Direction::Ingress,
            guest: Endpoint {
                ip: "fd00::2".parse().unwrap(),
                port: 53,
            },
            remote: Endpoint {
                ip: "2001:db8::1".parse().unwrap(),
                port: 5353,
            },
            node: Some(Endpoint {
                ip: "2001:db8:1::10".parse().unwrap(),
                port: 20053,
            }),
            refused: None,
            dns_name: None,
            end: Some(Totals {
                bytes_out: 1200,
                packets_out: 3,
                bytes_in: 400,
                packets_in: 2,
                duration_ms: 1500,
            }),
        };
        assert_eq!(
            flow(&rec),
            json!({
                "time": "1970-01-01T00:00:00.000000Z",
                "time_unix_ns": 0,
                "sandbox_id": "b",
                "event": "end",
                "family": 6,
                "protocol": "udp",
                "direction": "ingress",
                "guest": {"ip": "fd00::2", "port": 53},
                "remote": {"ip": "2001:db8::1", "port": 5353},
                "node": {"ip": "2001:db8:1::10", "port": 20053},
                "verdict": "forwarded",
                "totals": {"bytes_out": 1200, "packets_out": 3, "bytes_in": 400,
                           "packets_in": 2, "duration_ms": 1500},
            })
        );
        assert_eq!(rfc3339_micros(u64::MAX), "2554-07-21T23:34:33.709551Z");
    }

    #[test]
    fn watch_flows_parameters() {
        let w = |v: Value| flow_watch(v.as_object().unwrap());
        let name = |v: Value| match w(v) {
            Err(Failure::InvalidParameter(p)) => p,
            other => panic!("expected InvalidParameter, got {other:?}"),
        };
        assert_eq!(
            w(json!({})).unwrap(),
            FlowWatch {
                filter: crate::flows::Filter::default(),
                since_seconds: 0,
                follow: true,
            }
        );
        let all =
            w(json!({"sandbox_id": "a", "denied": true, "since_seconds": 3600, "follow": false}))
                .unwrap();
        assert_eq!(all.filter.sandbox_id.as_deref(), Some("a"));
        assert!(all.filter.denied && !all.follow);
        assert_eq!(all.since_seconds, 3600);
        let nulls =
            json!({"sandbox_id": null, "denied": null, "since_seconds": null, "follow": null});
        assert_eq!(w(nulls).unwrap(), w(json!({})).unwrap());
        assert_eq!(
            w(json!({"sandbox_id": ""})).unwrap().filter.sandbox_id,
            None
        );
        assert_eq!(name(json!({"bogus": 1})), "bogus");
        assert_eq!(name(json!({"sandbox_id": 1})), "sandbox_id");
        assert_eq!(name(json!({"denied": "yes"})), "denied");
        assert_eq!(name(json!({"follow": 1})), "follow");
        for bad in [json!(-1), json!(3601), json!(1.5), json!("60")] {
            assert_eq!(name(json!({ "since_seconds": bad })), "since_seconds");
        }
    }
}
