//! Egress rules (EnsureNetwork `egress_rules`, docs/egress.md "Egress
//! rules"): per host, headers the agent sets on the sandbox's requests
//! (secrets the sandbox never sees), and the methods and path prefixes it
//! may use. The types every edge shares, their validation, and which rule
//! a host name and a request fall under. Pure code: the proxy
//! (`dns::intercept`) applies a rule, the core (`agent/`) decides which.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// Rules per sandbox.
pub const MAX_RULES: usize = 64;
/// Headers one rule sets.
pub const MAX_HEADERS: usize = 16;
/// Bytes of one header value (a token, a key: never a document).
pub const MAX_VALUE: usize = 4096;
/// Bytes of one header name.
pub const MAX_NAME: usize = 64;
/// Methods, and path prefixes, one rule lists.
pub const MAX_LIST: usize = 32;
/// Bytes of one path prefix.
pub const MAX_PATH: usize = 1024;

/// Headers a rule may not set: they frame or route the request, which is
/// the proxy's business (or the guest's Host, checked against the name).
const RESERVED: &[&str] = &[
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
    "expect",
];

/// A header value the agent injects: a secret. Never formatted (Debug
/// says `<secret>`), only stored (root-only) and sent to the rule's host.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: String) -> Self {
        Secret(value)
    }

    /// The value, for the one place that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// A short digest an operator can compare with their copy
    /// (`sha256:` and the first 12 hex digits): enough to tell two
    /// values apart, far too little to recover one.
    pub fn digest(&self) -> String {
        let d = ring::digest::digest(&ring::digest::SHA256, self.0.as_bytes());
        let hex: String = d.as_ref()[..6].iter().map(|b| format!("{b:02x}")).collect();
        format!("sha256:{hex}")
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<secret>")
    }
}

/// One rule, as stored and as validated ([`EgressRule::validated`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct EgressRule {
    /// A name or `*.suffix` pattern (lowercase, as allow_out's).
    pub host: String,
    /// Header name (lowercase) → value, set on every request to the host.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub set_headers: BTreeMap<String, Secret>,
    /// Methods allowed (uppercase); empty: any.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub methods: Vec<String>,
    /// Path prefixes allowed; empty: any.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<String>,
    /// Plain HTTP to the host is intercepted too (else refused with 403).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub plain_http: bool,
}

/// A rule as it is shown (GetNetwork, ListNetworks, varlink, cubenetctl):
/// header names with a digest of their value, never the value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ShownRule {
    pub host: String,
    pub set_headers: BTreeMap<String, String>,
    pub methods: Vec<String>,
    pub paths: Vec<String>,
    pub plain_http: bool,
}

impl EgressRule {
    pub fn shown(&self) -> ShownRule {
        ShownRule {
            host: self.host.clone(),
            set_headers: self
                .set_headers
                .iter()
                .map(|(k, v)| (k.clone(), v.digest()))
                .collect(),
            methods: self.methods.clone(),
            paths: self.paths.clone(),
            plain_http: self.plain_http,
        }
    }

    /// Checks and normalises rule `i` (host lowercase, header names
    /// lowercase, methods uppercase); the error names the field and why.
    /// `host` is parsed by the caller's pattern parser (allow_out's).
    pub fn validated(
        mut self,
        i: usize,
        parse_host: impl Fn(&str) -> Result<String, String>,
    ) -> Result<EgressRule, String> {
        let at = |f: &str| format!("egress_rules[{i}].{f}");
        if self.host.trim().is_empty() {
            return Err(format!("{}: empty (give a name or *.suffix)", at("host")));
        }
        self.host = parse_host(&self.host).map_err(|why| {
            format!(
                "{}: '{}' is not a host name or *.suffix pattern: {why}",
                at("host"),
                self.host
            )
        })?;
        if self.set_headers.len() > MAX_HEADERS {
            return Err(format!(
                "{}: {} headers, the limit is {MAX_HEADERS}",
                at("set_headers"),
                self.set_headers.len()
            ));
        }
        let mut headers = BTreeMap::new();
        for (name, value) in std::mem::take(&mut self.set_headers) {
            let lower = name.to_ascii_lowercase();
            header_name_ok(&name)
                .map_err(|why| format!("{}: header name {name:?}: {why}", at("set_headers")))?;
            if RESERVED.contains(&lower.as_str()) {
                return Err(format!(
                    "{}: header {name:?} frames or routes the request; a rule may not set it",
                    at("set_headers")
                ));
            }
            // The value is a secret: the error says what is wrong, never
            // what it is.
            header_value_ok(value.expose())
                .map_err(|why| format!("{}[{name}]: the value {why}", at("set_headers")))?;
            if headers.insert(lower, value).is_some() {
                return Err(format!(
                    "{}: header {name:?} is given twice (names are case-insensitive)",
                    at("set_headers")
                ));
            }
        }
        self.set_headers = headers;
        if self.methods.len() > MAX_LIST {
            return Err(format!(
                "{}: {} entries, the limit is {MAX_LIST}",
                at("methods"),
                self.methods.len()
            ));
        }
        for m in &mut self.methods {
            if m.is_empty() || m.len() > 16 || !m.bytes().all(|b| b.is_ascii_alphabetic()) {
                return Err(format!(
                    "{}: {m:?} is not an HTTP method (letters only, e.g. GET)",
                    at("methods")
                ));
            }
            m.make_ascii_uppercase();
        }
        self.methods.sort();
        self.methods.dedup();
        if self.paths.len() > MAX_LIST {
            return Err(format!(
                "{}: {} entries, the limit is {MAX_LIST}",
                at("paths"),
                self.paths.len()
            ));
        }
        for p in &self.paths {
            if !p.starts_with('/') || p.len() > MAX_PATH {
                return Err(format!(
                    "{}: {p:?} must start with '/' and be at most {MAX_PATH} bytes",
                    at("paths")
                ));
            }
            if p.bytes()
                .any(|b| b <= b' ' || b == 0x7f || b == b'?' || b == b'#')
            {
                return Err(format!(
                    "{}: {p:?} has a space, a control character, '?' or '#' (a prefix of the \
                     path alone)",
                    at("paths")
                ));
            }
            if !path_plain(p) {
                return Err(format!(
                    "{}: {p:?} has a '.' or '..' segment, '//', a backslash or an encoded \
                     '/', '\\\\' or '.'",
                    at("paths")
                ));
            }
        }
        Ok(self)
    }

    /// Whether the rule allows `method` on `path` (the request target's
    /// path, without the query); else why not.
    pub fn allows(&self, method: &str, path: &str) -> Result<(), String> {
        if !self.methods.is_empty() && !self.methods.iter().any(|m| m == method) {
            return Err(format!(
                "method {method} is not allowed for {} (allowed: {})",
                self.host,
                self.methods.join(", ")
            ));
        }
        if self.paths.is_empty() {
            return Ok(());
        }
        // A path that the upstream could read as another (dot segments,
        // encoded slashes) never passes a prefix check.
        if !path.starts_with('/') || !path_plain(path) {
            return Err(format!(
                "the path is not in plain form (dot segments or encoded separators) and {} \
                 allows only some paths",
                self.host
            ));
        }
        if self.paths.iter().any(|p| path_under(path, p)) {
            Ok(())
        } else {
            Err(format!(
                "path {path} is not under an allowed prefix for {} ({})",
                self.host,
                self.paths.join(", ")
            ))
        }
    }
}

/// `path` is `prefix` or below it: `/v1` covers `/v1`, `/v1/x` and
/// `/v1?…` but not `/v1x`; `/v1/` covers what starts with it.
pub fn path_under(path: &str, prefix: &str) -> bool {
    match path.strip_prefix(prefix) {
        None => false,
        Some(rest) => prefix.ends_with('/') || rest.is_empty() || rest.starts_with('/'),
    }
}

/// No dot segments, no empty segments, no backslash, no percent-encoded
/// '/', '\' or '.': the path means what it says to any server.
fn path_plain(p: &str) -> bool {
    let lower = p.to_ascii_lowercase();
    if p.contains('\\')
        || p.contains("//")
        || lower.contains("%2f")
        || lower.contains("%5c")
        || lower.contains("%2e")
    {
        return false;
    }
    !p.split('/').any(|s| s == "." || s == "..")
}

/// An HTTP field name (RFC 9110 5.1: a token).
fn header_name_ok(name: &str) -> Result<(), &'static str> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err("must be 1-64 bytes");
    }
    let tchar = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    if name.bytes().all(tchar) {
        Ok(())
    } else {
        Err("has a character a header name cannot have (CR, LF, ':', a space, ...)")
    }
}

/// An HTTP field value (RFC 9110 5.5): visible ASCII, spaces and tabs
/// inside, nothing that would end the line.
fn header_value_ok(v: &str) -> Result<(), String> {
    if v.is_empty() {
        return Err("is empty".into());
    }
    if v.len() > MAX_VALUE {
        return Err(format!("is {} bytes, the limit is {MAX_VALUE}", v.len()));
    }
    if v.starts_with([' ', '\t']) || v.ends_with([' ', '\t']) {
        return Err("starts or ends with white space".into());
    }
    if v.bytes().all(|b| b == b'\t' || (b' '..=b'~').contains(&b)) {
        Ok(())
    } else {
        Err("has a control character (CR, LF, NUL, ...) or a byte beyond ASCII".into())
    }
}

/// The rule for `host` (lowercase, no port): an exact pattern before a
/// wildcard, the longest suffix among wildcards.
pub fn rule_for<'a>(rules: &'a [EgressRule], host: &str) -> Option<&'a EgressRule> {
    let mut best: Option<(&EgressRule, usize)> = None;
    for r in rules {
        let score = if r.host == host {
            usize::MAX
        } else if let Some(suffix) = r.host.strip_prefix("*.") {
            match host.strip_suffix(suffix) {
                Some(head) if head.ends_with('.') && head.len() > 1 => suffix.len(),
                _ => continue,
            }
        } else {
            continue;
        };
        if best.is_none_or(|(_, s)| score > s) {
            best = Some((r, score));
        }
    }
    best.map(|(r, _)| r)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(h: &str) -> Result<String, String> {
        if h.contains(' ') {
            Err("a space".into())
        } else {
            Ok(h.to_ascii_lowercase())
        }
    }

    fn rule(host: &str) -> EgressRule {
        EgressRule {
            host: host.into(),
            ..Default::default()
        }
    }

    #[test]
    fn secrets_never_format() {
        let mut r = rule("api.example.com");
        r.set_headers
            .insert("authorization".into(), Secret::new("Bearer s3cr3t".into()));
        let shown = format!("{r:?} {:?}", r.shown());
        assert!(!shown.contains("s3cr3t"), "{shown}");
        assert!(shown.contains("sha256:"), "{shown}");
        assert_eq!(r.shown().set_headers["authorization"].len(), 7 + 12);
    }

    #[test]
    fn validation_names_the_field_and_never_the_value() {
        let bad = |r: EgressRule| r.validated(3, parse).unwrap_err();
        assert!(bad(rule("")).contains("egress_rules[3].host: empty"));
        assert!(bad(rule("a b")).contains("egress_rules[3].host"));
        let with = |name: &str, value: &str| {
            let mut r = rule("api.example.com");
            r.set_headers.insert(name.into(), Secret::new(value.into()));
            r
        };
        for name in ["X-A\r\nB", "x:y", "", "a b"] {
            let e = bad(with(name, "v"));
            assert!(e.contains("egress_rules[3].set_headers"), "{e}");
        }
        assert!(bad(with("Host", "v")).contains("frames or routes"));
        for value in ["tok\r\nX-Evil: 1", "tok\0", &"x".repeat(MAX_VALUE + 1), ""] {
            let e = bad(with("authorization", value));
            assert!(
                e.contains("egress_rules[3].set_headers[authorization]"),
                "{e}"
            );
            assert!(!e.contains("tok"), "the value leaked into the error: {e}");
        }
        let mut r = rule("api.example.com");
        r.methods = vec!["GE T".into()];
        assert!(bad(r).contains("egress_rules[3].methods"));
        let mut r = rule("api.example.com");
        r.paths = vec!["v1".into()];
        assert!(bad(r).contains("egress_rules[3].paths"));
        let mut r = rule("api.example.com");
        r.paths = vec!["/v1/../admin".into()];
        assert!(bad(r).contains("egress_rules[3].paths"));
        let mut r = with("X-Key", "k");
        r.set_headers
            .insert("x-key".into(), Secret::new("k2".into()));
        assert!(bad(r).contains("twice"));
    }

    #[test]
    fn methods_and_path_prefix_boundaries() {
        let mut r = rule("api.example.com");
        r.methods = vec!["get".into()];
        r.paths = vec!["/v1".into(), "/static/".into()];
        let r = r.validated(0, parse).unwrap();
        assert_eq!(r.methods, vec!["GET"]);
        assert!(r.allows("GET", "/v1").is_ok());
        assert!(r.allows("GET", "/v1/models").is_ok());
        assert!(r.allows("GET", "/v1x").is_err());
        assert!(r.allows("GET", "/static/app.js").is_ok());
        assert!(r.allows("GET", "/static").is_err());
        assert!(r.allows("POST", "/v1").is_err());
        for sneaky in [
            "/v1/../admin",
            "/v1/%2e%2e/admin",
            "/v1%2fadmin",
            "/v1/..",
            "/v1//x",
        ] {
            assert!(r.allows("GET", sneaky).is_err(), "{sneaky}");
        }
        let any = rule("api.example.com").validated(0, parse).unwrap();
        assert!(any.allows("DELETE", "/anything/../x").is_ok());
    }

    #[test]
    fn the_most_specific_rule_wins() {
        let rules = vec![
            rule("*.example.com"),
            rule("api.example.com"),
            rule("*.b.example.com"),
        ];
        assert_eq!(
            rule_for(&rules, "api.example.com").unwrap().host,
            "api.example.com"
        );
        assert_eq!(
            rule_for(&rules, "x.b.example.com").unwrap().host,
            "*.b.example.com"
        );
        assert_eq!(
            rule_for(&rules, "www.example.com").unwrap().host,
            "*.example.com"
        );
        assert!(rule_for(&rules, "example.com").is_none());
        assert!(rule_for(&rules, "evilexample.com").is_none());
        assert!(rule_for(&rules, "api.example.com.evil").is_none());
    }
}
