//! D-Bus answers → JSON, in the one shape a network has on every edge:
//! the varlink `Network` type (src/varlink/convert.rs `network()`). The
//! `a{sv}` keys are already the varlink field names; D-Bus structures
//! (`port_mappings` a(sqqs), `routes` a(sss), `arp_neighbors` a(sss)) are
//! positional, so they get their varlink field names here.

use std::collections::HashMap;
use std::os::fd::AsRawFd;

use serde_json::{Value as Json, json};
use zbus::zvariant::{OwnedValue, Value};

pub type Dict = HashMap<String, OwnedValue>;

/// The field names of each structure in a network, in D-Bus order
/// (`PortMapping`, `Route`, `ArpNeighbor` in varlink/org.cube.NetworkAgent.varlink).
const STRUCT_FIELDS: &[(&str, &[&str])] = &[
    (
        "port_mappings",
        &["protocol", "container_port", "host_port", "host_ip"],
    ),
    ("routes", &["destination", "gateway", "device"]),
    ("arp_neighbors", &["ip", "mac", "device"]),
];

/// Any D-Bus value as JSON: structures become arrays, dictionaries objects.
pub fn to_json(v: &Value<'_>) -> Json {
    match v {
        Value::U8(n) => json!(n),
        Value::Bool(b) => json!(b),
        Value::I16(n) => json!(n),
        Value::U16(n) => json!(n),
        Value::I32(n) => json!(n),
        Value::U32(n) => json!(n),
        Value::I64(n) => json!(n),
        Value::U64(n) => json!(n),
        Value::F64(n) => json!(n),
        Value::Str(s) => json!(s.as_str()),
        Value::Signature(s) => json!(s.to_string()),
        Value::ObjectPath(p) => json!(p.as_str()),
        Value::Value(inner) => to_json(inner),
        Value::Array(a) => Json::Array(a.inner().iter().map(to_json).collect()),
        Value::Dict(d) => Json::Object(
            d.iter()
                .map(|(k, v)| {
                    let key = match k {
                        Value::Str(s) => s.as_str().to_owned(),
                        other => to_json(other).to_string(),
                    };
                    (key, to_json(v))
                })
                .collect(),
        ),
        Value::Structure(s) => Json::Array(s.fields().iter().map(to_json).collect()),
        Value::Fd(fd) => json!(fd.as_raw_fd()),
    }
}

/// A dictionary answer (a reconcile report...) as a JSON object.
pub fn dict_json(d: &Dict) -> Json {
    Json::Object(d.iter().map(|(k, v)| (k.clone(), to_json(v))).collect())
}

/// A list of positional structures → objects with `names`; an entry of
/// another arity is left as it is (an agent newer than this tool).
fn name_fields(list: Json, names: &[&str]) -> Json {
    match list {
        Json::Array(items) => Json::Array(
            items
                .into_iter()
                .map(|item| match item {
                    Json::Array(parts) if parts.len() == names.len() => {
                        Json::Object(names.iter().map(|n| n.to_string()).zip(parts).collect())
                    }
                    other => other,
                })
                .collect(),
        ),
        other => other,
    }
}

/// A network `a{sv}` as the varlink `Network` object. D-Bus leaves
/// `egress_rules` out when there are none; varlink says `[]`, and so does
/// this (one shape on every edge).
pub fn network_json(d: &Dict) -> Json {
    let mut o: serde_json::Map<String, Json> = d
        .iter()
        .map(|(k, v)| {
            let j = to_json(v);
            let j = match STRUCT_FIELDS.iter().find(|(key, _)| key == k) {
                Some((_, names)) => name_fields(j, names),
                None => j,
            };
            (k.clone(), j)
        })
        .collect();
    if o.contains_key("sandbox_id") && !o.contains_key("egress_rules") {
        o.insert("egress_rules".into(), json!([]));
    }
    Json::Object(o)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owned(v: Value<'_>) -> OwnedValue {
        v.try_to_owned().unwrap()
    }

    #[test]
    fn network_structures_get_their_varlink_names() {
        let mut d = Dict::new();
        d.insert("sandbox_id".into(), owned(Value::from("s")));
        d.insert("mtu".into(), owned(Value::from(1300u32)));
        d.insert(
            "port_mappings".into(),
            owned(Value::from(vec![(
                "tcp".to_owned(),
                80u16,
                20000u16,
                "0.0.0.0".to_owned(),
            )])),
        );
        d.insert(
            "routes".into(),
            owned(Value::from(vec![(
                "0.0.0.0/0".to_owned(),
                "169.254.68.5".to_owned(),
                "eth0".to_owned(),
            )])),
        );
        d.insert(
            "arp_neighbors".into(),
            owned(Value::from(vec![(
                "169.254.68.5".to_owned(),
                "20:90:6f:cf:cf:cf".to_owned(),
                "eth0".to_owned(),
            )])),
        );
        let mut md = HashMap::new();
        md.insert("k".to_owned(), "v".to_owned());
        d.insert("metadata".into(), owned(Value::from(md)));
        assert_eq!(
            network_json(&d),
            json!({
                "sandbox_id": "s",
                "mtu": 1300,
                "port_mappings": [{"protocol": "tcp", "container_port": 80, "host_port": 20000, "host_ip": "0.0.0.0"}],
                "routes": [{"destination": "0.0.0.0/0", "gateway": "169.254.68.5", "device": "eth0"}],
                "arp_neighbors": [{"ip": "169.254.68.5", "mac": "20:90:6f:cf:cf:cf", "device": "eth0"}],
                "metadata": {"k": "v"},
                "egress_rules": [],
            })
        );
    }
}
