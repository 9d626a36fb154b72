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
}
