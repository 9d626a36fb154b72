//! Egress rules from a JSON file (`ensure --egress-rules FILE`,
//! `egress-rules ID FILE`): a command line is readable by every uid, so
//! the headers' values (secrets) come from a file, which may be root's
//! alone (0600), or from stdin (`-`). The file is checked here before
//! anything is sent: unknown keys and wrong types are named as
//! `FILE: [i].field`; no error, and nothing printed, carries a header's
//! value (the agent shows each as `sha256:` and 12 hex digits).

use std::collections::{BTreeMap, HashMap};
use std::io::Read;

use cube_network_agent::rules::{EgressRule, Secret};
use serde_json::Value as Json;
use zbus::zvariant::{OwnedValue, Value};

use crate::failure::{EXIT_USAGE, Failure, Res};

/// No file of rules is larger (64 rules of 16 headers of 4 KiB each, and
/// room for the rest).
const MAX_FILE: u64 = 16 << 20;

const KNOWN: &str = "host, set_headers, methods, paths, plain_http";

/// The rules of one file and the name it is given in messages (the path as
/// typed; `stdin` for `-`).
#[derive(Debug, Clone)]
pub struct RulesFile {
    pub name: String,
    pub rules: Vec<EgressRule>,
}

/// Reads and checks `path` (`-`: stdin).
pub fn read(path: &str) -> Res<RulesFile> {
    let name = if path == "-" {
        "stdin".to_owned()
    } else {
        path.to_owned()
    };
    let fail = |m: String| Failure::new(EXIT_USAGE, m);
    let mut bytes = vec![];
    let got = if path == "-" {
        std::io::stdin()
            .lock()
            .take(MAX_FILE + 1)
            .read_to_end(&mut bytes)
    } else {
        std::fs::File::open(path).and_then(|f| f.take(MAX_FILE + 1).read_to_end(&mut bytes))
    };
    got.map_err(|e| fail(format!("{name}: cannot read the egress rules: {e}")))?;
    if bytes.len() as u64 > MAX_FILE {
        return Err(fail(format!(
            "{name}: more than {} MiB: not a file of egress rules",
            MAX_FILE >> 20
        )));
    }
    let text = String::from_utf8(bytes)
        .map_err(|_| fail(format!("{name}: not UTF-8 text (a JSON array of rules)")))?;
    let rules = parse(&name, &text).map_err(fail)?;
    Ok(RulesFile { name, rules })
}

/// The JSON type of `v`, for "expected a string, got a number".
fn kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "an array",
        Json::Object(_) => "an object",
    }
}

fn strings(at: &str, v: &Json) -> Result<Vec<String>, String> {
    let Json::Array(a) = v else {
        return Err(format!(
            "{at}: expected an array of strings, got {}",
            kind(v)
        ));
    };
    a.iter()
        .enumerate()
        .map(|(j, x)| match x {
            Json::String(s) => Ok(s.clone()),
            other => Err(format!("{at}[{j}]: expected a string, got {}", kind(other))),
        })
        .collect()
}

/// The file's text → rules, each checked as the agent checks it (hosts
/// excepted: the agent's pattern parser judges them). `name` starts every
/// error.
pub fn parse(name: &str, text: &str) -> Result<Vec<EgressRule>, String> {
    // serde_json's syntax errors say where (line, column), never what.
    let doc: Json = serde_json::from_str(text).map_err(|e| {
        format!(
            "{name}: not JSON ({e}); expected an array of rules: \
             [{{\"host\": ..., \"set_headers\": {{...}}, \"methods\": [...], \"paths\": [...], \
             \"plain_http\": false}}]"
        )
    })?;
    let Json::Array(items) = doc else {
        return Err(format!(
            "{name}: expected a JSON array of rules ([{{\"host\": ...}}, ...]), got {}",
            kind(&doc)
        ));
    };
    let mut rules = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let Json::Object(fields) = item else {
            return Err(format!(
                "{name}: [{i}]: expected an object (a rule), got {}",
                kind(item)
            ));
        };
        let mut r = EgressRule::default();
        for (key, v) in fields {
            let at = format!("{name}: [{i}].{key}");
            match key.as_str() {
                "host" => match v {
                    Json::String(s) => r.host = s.clone(),
                    other => return Err(format!("{at}: expected a string, got {}", kind(other))),
                },
                "set_headers" => {
                    let Json::Object(h) = v else {
                        return Err(format!(
                            "{at}: expected an object of header name to value, got {}",
                            kind(v)
                        ));
                    };
                    let mut headers = BTreeMap::new();
                    for (hname, hv) in h {
                        match hv {
                            Json::String(s) => {
                                headers.insert(hname.clone(), Secret::new(s.clone()));
                            }
                            // The type only: never the value.
                            other => {
                                return Err(format!(
                                    "{at}[{hname:?}]: expected a string, got {}",
                                    kind(other)
                                ));
                            }
                        }
                    }
                    r.set_headers = headers;
                }
                "methods" => r.methods = strings(&at, v)?,
                "paths" => r.paths = strings(&at, v)?,
                "plain_http" => match v {
                    Json::Bool(b) => r.plain_http = *b,
                    other => {
                        return Err(format!("{at}: expected true or false, got {}", kind(other)));
                    }
                },
                other => {
                    return Err(format!(
                        "{name}: [{i}].{other:?}: unknown key (known: {KNOWN})"
                    ));
                }
            }
        }
        // The agent's own checks (hosts left to it): the message names
        // `egress_rules[i].field`, written here as `FILE: [i].field`.
        r.clone()
            .validated(i, |h| Ok(h.to_owned()))
            .map_err(|e| here(name, &e))?;
        rules.push(r);
    }
    Ok(rules)
}

/// `egress_rules[i]...` at the start of a message → `FILE: [i]...`.
fn here(name: &str, msg: &str) -> String {
    match msg.strip_prefix("egress_rules") {
        Some(rest) if rest.starts_with('[') => format!("{name}: {rest}"),
        _ => format!("{name}: {msg}"),
    }
}

/// The rules as D-Bus `aa{sv}` (host s, set_headers a{ss}, methods as,
/// paths as, plain_http b).
pub fn dbus_value(rules: &[EgressRule]) -> Vec<HashMap<String, OwnedValue>> {
    rules
        .iter()
        .map(|r| {
            let mut d = HashMap::new();
            let mut put = |k: &str, v: Value<'_>| {
                if let Ok(v) = v.try_to_owned() {
                    d.insert(k.to_owned(), v);
                }
            };
            put("host", Value::from(r.host.clone()));
            let headers: HashMap<String, String> = r
                .set_headers
                .iter()
                .map(|(k, v)| (k.clone(), v.expose().to_owned()))
                .collect();
            put("set_headers", Value::from(headers));
            put("methods", Value::from(r.methods.clone()));
            put("paths", Value::from(r.paths.clone()));
            put("plain_http", Value::from(r.plain_http));
            d
        })
        .collect()
}

/// The agent's message about the rules (`egress_rules[1].host: ...`)
/// names the file they came from: `FLAG (egress_rules[1].host): ...`,
/// where FLAG is what the user typed (`--egress-rules FILE`, or FILE).
pub fn explain(flag: &str, msg: &str) -> String {
    match msg.split_once(": ") {
        Some((key, tail))
            if key == "egress_rules"
                || key.starts_with("egress_rules[")
                || key == "rules"
                || key.starts_with("rules[") =>
        {
            format!("{flag} ({key}): {tail}")
        }
        _ => msg.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "Bearer s3cr3t-value";

    fn err(text: &str) -> String {
        let e = parse("rules.json", text).unwrap_err();
        assert!(!e.contains("s3cr3t"), "the value leaked: {e}");
        e
    }

    #[test]
    fn a_good_file() {
        let r = parse(
            "f",
            &format!(
                r#"[{{"host": "api.example.com", "set_headers": {{"Authorization": "{SECRET}"}},
                     "methods": ["GET"], "paths": ["/v1"], "plain_http": true}},
                   {{"host": "*.mirror.test"}}]"#
            ),
        )
        .unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].set_headers["Authorization"].expose(), SECRET);
        assert!(r[0].plain_http && !r[1].plain_http);
        assert_eq!(r[0].paths, ["/v1"]);
        assert!(parse("f", "[]").unwrap().is_empty());
        let v = dbus_value(&r);
        assert_eq!(v.len(), 2);
        assert_eq!(v[0].len(), 5);
        assert!(!format!("{r:?}").contains("s3cr3t"));
    }

    #[test]
    fn errors_name_the_file_and_field_never_the_value() {
        let e = err(&format!(
            r#"[{{"host": "a.test", "sethdrs": {{"X": "{SECRET}"}}}}]"#
        ));
        assert!(
            e.starts_with("rules.json: [0].\"sethdrs\": unknown key"),
            "{e}"
        );
        let e = err(r#"[{"host": "a.test"}, {"host": "b.test", "methods": "GET"}]"#);
        assert_eq!(
            e,
            "rules.json: [1].methods: expected an array of strings, got a string"
        );
        let e = err(r#"[{"host": "a.test", "set_headers": {"X-Key": 42}}]"#);
        assert!(e.starts_with("rules.json: [0].set_headers[\"X-Key\"]: expected a string"));
        let e = err(&format!(
            r#"[{{"host": "a.test", "set_headers": {{"X-A\nB": "{SECRET}"}}}}]"#
        ));
        assert!(
            e.starts_with("rules.json: [0].set_headers: header name"),
            "{e}"
        );
        let e = err(r#"[{"host": "a.test", "set_headers": {"X-Key": "tok\r\nX-Evil: 1"}}]"#);
        assert!(
            e.starts_with("rules.json: [0].set_headers[X-Key]: the value"),
            "{e}"
        );
        assert!(!e.contains("tok"), "{e}");
        let e = err(r#"[{"host": "a.test", "plain_http": "yes"}]"#);
        assert!(e.contains("[0].plain_http: expected true or false, got a string"));
        let e = err(r#"{"host": "a.test"}"#);
        assert!(e.contains("expected a JSON array of rules"), "{e}");
        let e = err(r#"["a.test"]"#);
        assert!(
            e.contains("[0]: expected an object (a rule), got a string"),
            "{e}"
        );
        let e = err(&format!(
            r#"[{{"host": "a", "set_headers": {{"A": "{SECRET}"#
        ));
        assert!(e.starts_with("rules.json: not JSON (EOF"), "{e}");
        let e = err(r#"[{"set_headers": {}}]"#);
        assert!(e.starts_with("rules.json: [0].host: empty"), "{e}");
    }

    #[test]
    fn agent_messages_name_the_flag() {
        assert_eq!(
            explain(
                "--egress-rules r.json",
                "egress_rules[1].host: 'a b' is not a host name"
            ),
            "--egress-rules r.json (egress_rules[1].host): 'a b' is not a host name"
        );
        assert_eq!(explain("r.json", "sandbox_id: empty"), "sandbox_id: empty");
    }
}
