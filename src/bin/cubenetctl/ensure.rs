//! `cubenetctl ensure ID [OPTIONS...]`: the options → EnsureNetwork's
//! `a{sv}`, and the agent's errors → errors that name the flag typed.

use std::collections::HashMap;

use zbus::zvariant::Value;

use crate::args::EnsureOpts;
use crate::dbus::Agent;
use crate::failure::{EXIT_OK, Res};
use crate::json::Dict;
use crate::output::Output;

fn options(o: &EnsureOpts) -> HashMap<&'static str, Value<'static>> {
    let mut m: HashMap<&'static str, Value<'static>> = HashMap::new();
    if !o.ports.is_empty() {
        let ports: Vec<(String, u16, u16, String)> = o
            .ports
            .iter()
            .map(|p| {
                (
                    p.protocol.clone(),
                    p.container_port,
                    p.host_port,
                    p.host_ip.clone(),
                )
            })
            .collect();
        m.insert("port_mappings", Value::from(ports));
    }
    if !o.allow_out.is_empty() {
        m.insert("allow_out", Value::from(o.allow_out.clone()));
    }
    if !o.deny_out.is_empty() {
        m.insert("deny_out", Value::from(o.deny_out.clone()));
    }
    if let Some(mode) = &o.egress_mode {
        m.insert("egress_mode", Value::from(mode.clone()));
    }
    if o.no_internet {
        m.insert("allow_internet_access", Value::from(false));
    }
    for (key, _, n) in &o.rates {
        m.insert(key, Value::from(*n));
    }
    if let Some(mtu) = o.mtu {
        m.insert("mtu", Value::from(mtu));
    }
    if !o.metadata.is_empty() {
        let md: HashMap<String, String> = o.metadata.iter().cloned().collect();
        m.insert("metadata", Value::from(md));
    }
    if let Some(k) = &o.idempotency_key {
        m.insert("idempotency_key", Value::from(k.clone()));
    }
    if let Some(src) = &o.clone_of {
        m.insert("clone_of", Value::from(src.clone()));
    }
    if o.paused {
        m.insert("paused", Value::from(true));
    }
    if let Some(f) = &o.egress_rules {
        m.insert(
            "egress_rules",
            Value::from(crate::rules_file::dbus_value(&f.rules)),
        );
    }
    if let Some((_, uid, gid)) = &o.tap_owner {
        m.insert("tap_owner_uid", Value::from(*uid));
        if let Some(g) = gid {
            m.insert("tap_owner_gid", Value::from(*g));
        }
    }
    m
}

/// The agent names the option key (`port_mappings[1]: ...`); the user
/// typed a flag. Each `KEY[i]` the user's flags produced becomes
/// `--flag VALUE (KEY[i])`, and a message about a whole option
/// (`mtu: ...`) starts with the flag: `--mtu 50 (mtu): ...`.
pub fn explain(o: &EnsureOpts, msg: &str) -> String {
    let item = |key: &str, idx: &str| -> Option<(&'static str, String)> {
        let i = idx.parse::<usize>().ok();
        match key {
            "port_mappings" => Some(("--port", o.ports.get(i?)?.typed.clone())),
            "allow_out" => Some(("--allow-out", o.allow_out.get(i?)?.clone())),
            "deny_out" => Some(("--deny-out", o.deny_out.get(i?)?.clone())),
            "metadata" => o
                .metadata
                .iter()
                .find(|(k, _)| k == idx)
                .map(|(k, v)| ("--metadata", format!("{k}={v}"))),
            _ => None,
        }
    };
    let whole = |key: &str| -> Option<String> {
        match key {
            "port_mappings" if !o.ports.is_empty() => Some("--port".into()),
            "allow_out" if !o.allow_out.is_empty() => Some("--allow-out".into()),
            "deny_out" if !o.deny_out.is_empty() => Some("--deny-out".into()),
            "metadata" if !o.metadata.is_empty() => Some("--metadata".into()),
            "idempotency_key" if o.idempotency_key.is_some() => Some("--idempotency-key".into()),
            "clone_of" => o.clone_of.as_ref().map(|s| format!("--clone-of {s}")),
            "mtu" => o.mtu.map(|m| format!("--mtu {m}")),
            "egress_mode" => o.egress_mode.as_ref().map(|m| format!("--egress-mode {m}")),
            // The file's name, never what it holds (secrets).
            k if k == "egress_rules" || k.starts_with("egress_rules[") => o
                .egress_rules
                .as_ref()
                .map(|f| format!("--egress-rules {}", f.name)),
            "tap_owner_uid" | "tap_owner_gid" => o
                .tap_owner
                .as_ref()
                .map(|(t, _, _)| format!("--tap-owner {t}")),
            k => o
                .rates
                .iter()
                .find(|(key, _, _)| *key == k)
                .map(|(_, typed, _)| typed.clone()),
        }
    };
    let mut out = String::with_capacity(msg.len() + 32);
    // "node full (RESOURCE): KEY: ..." names the option after the prefix.
    let (prefix, msg) = match msg.split_once("): ") {
        Some((p, m)) if p.starts_with("node full (") => (&msg[..p.len() + 3], m),
        _ => ("", msg),
    };
    out.push_str(prefix);
    let mut rest = msg;
    let clone_tail;
    if let Some((key, tail)) = msg.split_once(": ")
        && let Some(flag) = whole(key)
    {
        out.push_str(&format!("{flag} ({key}): "));
        rest = tail;
        if key == "clone_of" {
            clone_tail = clone_flags(o, tail);
            rest = &clone_tail;
        }
    }
    let keys = ["port_mappings", "allow_out", "deny_out", "metadata"];
    let mut prev: Option<char> = out.chars().last();
    'scan: while let Some(c) = rest.chars().next() {
        let at_word = !prev.is_some_and(|p| p.is_ascii_alphanumeric() || p == '_');
        if at_word {
            for key in keys {
                if let Some(after) = rest.strip_prefix(key).and_then(|a| a.strip_prefix('['))
                    && let Some(end) = after.find(']')
                    && let Some((flag, value)) = item(key, &after[..end])
                {
                    out.push_str(&format!("{flag} {value} ({key}[{}])", &after[..end]));
                    rest = &after[end + 1..];
                    prev = Some(')');
                    continue 'scan;
                }
            }
        }
        out.push(c);
        prev = Some(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

/// The refusal of options next to `clone_of` names the options the user
/// may and did type: "only --metadata, --idempotency-key and --paused may
/// come with it (got --port)", not their wire keys.
fn clone_flags(o: &EnsureOpts, tail: &str) -> String {
    let mut t = tail.replace(
        "only metadata, idempotency_key and paused",
        "only --metadata, --idempotency-key and --paused",
    );
    let Some(start) = t.rfind("(got ") else {
        return t;
    };
    let Some(len) = t[start..].find(')') else {
        return t;
    };
    let key = &t[start + 5..start + len];
    let flag = match key {
        "port_mappings" => "--port",
        "allow_internet_access" => "--no-internet",
        "allow_out" => "--allow-out",
        "deny_out" => "--deny-out",
        "mtu" => "--mtu",
        "egress_mode" => "--egress-mode",
        // The flag alone: the rules are set from a file.
        "egress_rules" => "--egress-rules",
        "bandwidth" => o
            .rates
            .first()
            .and_then(|(_, typed, _)| typed.split_whitespace().next())
            .unwrap_or("--egress-rate"),
        _ => return t,
    };
    t.replace_range(start + 5..start + len, flag);
    t
}

pub async fn run(agent: &Agent, out: &Output, id: &str, o: &EnsureOpts) -> Res<u8> {
    let net: Dict = agent
        .call_explained("EnsureNetwork", &(id, options(o)), &|m| explain(o, m))
        .await?;
    // -q: the exit status says it worked; the network is what `status`
    // (or --json) shows.
    if out.quiet && !out.json() {
        return Ok(EXIT_OK);
    }
    crate::status::show(&net, out);
    Ok(EXIT_OK)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::parse_port;

    fn opts() -> EnsureOpts {
        EnsureOpts {
            ports: vec![
                parse_port("tcp:80:8080").unwrap(),
                parse_port("tcp:81:8080").unwrap(),
            ],
            deny_out: vec!["10.0.0.0/8".into(), "10.0.0.1/8".into()],
            mtu: Some(50),
            metadata: vec![("k".into(), "v".into())],
            ..EnsureOpts::default()
        }
    }

    #[test]
    fn agent_keys_become_the_flags_typed() {
        let o = opts();
        assert_eq!(
            explain(
                &o,
                "port_mappings[1]: tcp host port 8080 is also used by port_mappings[0]"
            ),
            "--port tcp:81:8080 (port_mappings[1]): tcp host port 8080 is also used by \
             --port tcp:80:8080 (port_mappings[0])"
        );
        assert_eq!(
            explain(&o, "deny_out[1]: address 10.0.0.1/8 has host bits set"),
            "--deny-out 10.0.0.1/8 (deny_out[1]): address 10.0.0.1/8 has host bits set"
        );
        assert_eq!(
            explain(&o, "mtu: 50 is out of range 68-65535"),
            "--mtu 50 (mtu): 50 is out of range 68-65535"
        );
        assert_eq!(
            explain(&o, "metadata[k]: value is 9999 bytes"),
            "--metadata k=v (metadata[k]): value is 9999 bytes"
        );
        // Nothing the user typed: left alone.
        assert_eq!(explain(&o, "port_mappings[7]: x"), "port_mappings[7]: x");
        assert_eq!(
            explain(
                &EnsureOpts::default(),
                "mtu: 1500 is above the MTU of the uplink"
            ),
            "mtu: 1500 is above the MTU of the uplink"
        );
        assert_eq!(
            explain(&o, "sandbox_id: must not be empty"),
            "sandbox_id: must not be empty"
        );
        assert_eq!(explain(&o, "xdeny_out[0]"), "xdeny_out[0]");
        // Rules name the file they came from, never a value.
        let r = EnsureOpts {
            egress_rules: Some(crate::rules_file::RulesFile {
                name: "/etc/r.json".into(),
                rules: vec![],
            }),
            ..EnsureOpts::default()
        };
        assert_eq!(
            explain(&r, "egress_rules[0].host: 'a.test' already has a rule"),
            "--egress-rules /etc/r.json (egress_rules[0].host): 'a.test' already has a rule"
        );
        assert_eq!(
            explain(&o, "egress_rules[0].host: x"),
            "egress_rules[0].host: x"
        );
    }

    #[test]
    fn clone_of_refusals_name_the_flags() {
        let msg = "clone_of: a clone takes the source's port mappings, policy, MTU and \
                   limits; only metadata, idempotency_key and paused may come with it (got KEY)";
        let o = EnsureOpts {
            clone_of: Some("golden".into()),
            rates: vec![("ingress_bps", "--ingress-rate 1M".into(), 1_000_000)],
            ..EnsureOpts::default()
        };
        for (key, flag) in [
            ("port_mappings", "--port"),
            ("mtu", "--mtu"),
            ("allow_internet_access", "--no-internet"),
            ("bandwidth", "--ingress-rate"),
            ("egress_rules", "--egress-rules"),
        ] {
            let e = explain(&o, &msg.replace("KEY", key));
            assert!(
                e.starts_with("--clone-of golden (clone_of): a clone takes")
                    && e.ends_with(&format!(
                        "only --metadata, --idempotency-key and --paused may come with it (got {flag})"
                    )),
                "{e}"
            );
        }
    }
}
