//! Domain patterns in `allow_out` / `deny_out` (docs/egress.md): what a
//! sandbox may resolve through the agent's resolver, and so which
//! addresses it learns. The resolver (`crate::dns`) asks
//! [`Patterns::verdict`]; the datapath admits a new flow to a learned
//! address of the sandbox's own (`dns_learned`), next to the CIDR rules.

use std::fmt;

/// Longest name (RFC 1035: 255 octets on the wire, 253 as text).
const MAX_NAME: usize = 253;
const MAX_LABEL: usize = 63;

/// `example.com` (that name) or `*.example.com` (any name below it, not
/// the apex). Stored lowercase, without a trailing dot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainPattern {
    /// The name, or for a wildcard the name below which it matches.
    name: String,
    wildcard: bool,
}

impl DomainPattern {
    /// Parses an entry; `Err` says why it is not a domain pattern.
    pub fn parse(entry: &str) -> Result<Self, String> {
        let (wildcard, rest) = match entry.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, entry),
        };
        let rest = rest.strip_suffix('.').unwrap_or(rest);
        if !rest.is_ascii() {
            return Err(
                "a name with non-ASCII characters: write an IDN in punycode (xn--...)".into(),
            );
        }
        let name = rest.to_ascii_lowercase();
        check_name(&name)?;
        if !name.contains('.') {
            // `*.com`: every name of a top-level domain; `nope`: a typo
            // more often than a name (search domains do not apply here).
            return Err(if wildcard {
                format!("'*.{name}' would match a whole top-level domain")
            } else {
                "a single label: a domain pattern has at least two (example.com)".into()
            });
        }
        if name
            .split('.')
            .all(|l| l.bytes().all(|b| b.is_ascii_digit()))
        {
            return Err("looks like an IPv4 address, not a name".into());
        }
        Ok(DomainPattern { name, wildcard })
    }

    /// Whether `name` (lowercase, no trailing dot) matches.
    pub fn matches(&self, name: &str) -> bool {
        if !self.wildcard {
            return name == self.name;
        }
        name.len() > self.name.len() + 1
            && name.ends_with(self.name.as_str())
            && name.as_bytes()[name.len() - self.name.len() - 1] == b'.'
    }
}

impl fmt::Display for DomainPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.wildcard {
            f.write_str("*.")?;
        }
        f.write_str(&self.name)
    }
}

/// Letters, digits and hyphens (and underscores, which service names
/// use), labels of 1-63 not starting or ending with a hyphen.
fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("an empty name".into());
    }
    if name.len() > MAX_NAME {
        return Err(format!("longer than {MAX_NAME} characters"));
    }
    for label in name.split('.') {
        if label.is_empty() {
            return Err("an empty label (two dots in a row)".into());
        }
        if label.len() > MAX_LABEL {
            return Err(format!("a label longer than {MAX_LABEL} characters"));
        }
        if let Some(c) = label
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
        {
            return Err(format!("'{c}' is not allowed in a name"));
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err(format!("the label '{label}' starts or ends with '-'"));
        }
    }
    Ok(())
}

pub use crate::types::is_domain_entry;

/// What the resolver does with a query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Resolve it and learn the answer's addresses for this sandbox.
    Allow,
    /// Answer REFUSED.
    Refuse,
}

/// A sandbox's domain patterns.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Patterns {
    pub allow: Vec<DomainPattern>,
    pub deny: Vec<DomainPattern>,
}

impl Patterns {
    /// The domain entries of normalised `allow_out` / `deny_out` lists
    /// (CIDR entries are the datapath's).
    pub fn from_lists(allow_out: &[String], deny_out: &[String]) -> Self {
        let pick = |l: &[String]| {
            l.iter()
                .filter(|e| is_domain_entry(e))
                .filter_map(|e| DomainPattern::parse(e).ok())
                .collect()
        };
        Patterns {
            allow: pick(allow_out),
            deny: pick(deny_out),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.allow.is_empty() && self.deny.is_empty()
    }

    /// Whether an allow pattern names `name` (not merely no deny pattern).
    pub fn allowed_by_rule(&self, name: &str) -> bool {
        self.allow.iter().any(|p| p.matches(name))
    }

    /// Allow beats deny, as for CIDRs. With allow patterns, a name none of
    /// them matches is refused; with deny patterns only, a name they match
    /// is refused and any other resolves.
    pub fn verdict(&self, name: &str) -> Verdict {
        if self.allow.iter().any(|p| p.matches(name)) {
            return Verdict::Allow;
        }
        if !self.allow.is_empty() || self.deny.iter().any(|p| p.matches(name)) {
            return Verdict::Refuse;
        }
        Verdict::Allow
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> DomainPattern {
        DomainPattern::parse(s).unwrap()
    }

    #[test]
    fn parses_and_normalises() {
        assert_eq!(p("Example.COM.").to_string(), "example.com");
        assert_eq!(p("*.GitHub.com").to_string(), "*.github.com");
        assert_eq!(
            p("xn--bcher-kva.example").to_string(),
            "xn--bcher-kva.example"
        );
        assert_eq!(p("_acme.example.com").to_string(), "_acme.example.com");
        for (bad, why) in [
            ("", "empty name"),
            ("a..b", "empty label"),
            ("bücher.example", "punycode"),
            ("*.com", "top-level"),
            ("-a.com", "starts or ends"),
            ("a b.com", "' ' is not allowed"),
            ("*.*.a.com", "'*' is not allowed"),
            ("a.*.com", "'*' is not allowed"),
            (&format!("{}.com", "a".repeat(64)), "longer than 63"),
            (&"a.".repeat(128), "longer than 253"),
            ("1.2.3", "IPv4"),
            ("nope", "single label"),
        ] {
            let e = DomainPattern::parse(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn exact_and_wildcard_matching() {
        let exact = p("pypi.org");
        assert!(exact.matches("pypi.org"));
        assert!(!exact.matches("www.pypi.org"));
        assert!(!exact.matches("xpypi.org"));
        let wild = p("*.github.com");
        assert!(wild.matches("api.github.com"));
        assert!(wild.matches("a.b.github.com"));
        assert!(!wild.matches("github.com"), "not the apex");
        assert!(!wild.matches("evilgithub.com"));
        assert!(!wild.matches("github.com.evil.net"));
    }

    #[test]
    fn entries_are_told_apart_from_cidrs() {
        assert!(!is_domain_entry("10.0.0.0/8"));
        assert!(!is_domain_entry("1.1.1.1"));
        assert!(is_domain_entry("example.com"));
        assert!(is_domain_entry("*.a.b"));
        assert!(is_domain_entry("10.0.0.0/x"));
    }

    #[test]
    fn allow_beats_deny_and_allow_lists_refuse_the_rest() {
        let only = Patterns::from_lists(
            &["*.allowed.test".into(), "10.0.0.0/8".into()],
            &["0.0.0.0/0".into()],
        );
        assert_eq!(only.verdict("www.allowed.test"), Verdict::Allow);
        assert_eq!(only.verdict("allowed.test"), Verdict::Refuse);
        assert_eq!(only.verdict("denied.test"), Verdict::Refuse);
        let deny = Patterns::from_lists(&["ok.evil.test".into()], &["*.evil.test".into()]);
        assert_eq!(deny.verdict("ok.evil.test"), Verdict::Allow);
        assert_eq!(deny.verdict("x.evil.test"), Verdict::Refuse);
        let deny_only = Patterns::from_lists(&[], &["*.evil.test".into()]);
        assert_eq!(deny_only.verdict("x.evil.test"), Verdict::Refuse);
        assert_eq!(deny_only.verdict("example.com"), Verdict::Allow);
        assert!(Patterns::from_lists(&["1.1.1.1/32".into()], &[]).is_empty());
    }
}
