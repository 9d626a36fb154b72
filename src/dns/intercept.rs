//! The egress gateway's interception engine (issue 46): for a host that
//! one of a sandbox's egress rules names, the proxy hands the guest's
//! connection here instead of splicing it. The engine answers the guest's
//! TLS with a leaf certificate for the server name, signed by the node CA
//! ([`NodeCa`]), reads each request, asks the core about it ([`Judge`]),
//! sets the rule's headers (secrets the guest never sees) and sends it on
//! over the engine's own TLS connection to the upstream, verified against
//! the trust roots for the same name. Bodies stream both ways; each
//! request leaves one [`AuditRecord`].
//!
//! HTTP/2 and HTTP/1.1 are offered to the guest (ALPN `h2`, `http/1.1`),
//! each HTTP/2 stream judged on its own. When the guest offers `h2`, the
//! upstream is offered `h2` and `http/1.1` and the engine speaks what it
//! chose (an HTTP/1.1 upstream takes an HTTP/2 guest's requests one at a
//! time on its one connection); a guest that offers HTTP/1.1 only gets an
//! upstream offered HTTP/1.1 only. WebSocket upgrades (HTTP/1.1) are judged
//! like any request and, once the upstream answers 101, spliced both ways;
//! WebSocket over HTTP/2 (RFC 8441), `CONNECT` and other upgrades are
//! refused with 501.

use std::collections::HashMap;
use std::convert::Infallible;
use std::fs::{self, File, OpenOptions};
use std::future::Future;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri};
use hyper::body::{Body, Bytes, Frame, Incoming, SizeHint};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, DnValue,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SerialNumber,
};
use rustls::client::danger::ServerCertVerifier;
use rustls::crypto::CryptoProvider;
use rustls::server::{
    Acceptor, ClientHello, ResolvesServerCert, ServerSessionMemoryCache, StoresServerSessions,
};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::{LazyConfigAcceptor, TlsConnector};

/// The node CA's key and certificate, in the directory given to
/// [`NodeCa::load_or_create`].
pub const CA_KEY_FILE: &str = "egress-ca.key";
pub const CA_CERT_FILE: &str = "egress-ca.crt";
/// The trust roots for upstream certificates when no bundle is configured.
pub const SYSTEM_TRUST_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

const DAY: Duration = Duration::from_secs(24 * 3600);
/// How long the node CA is valid.
const CA_VALIDITY: Duration = Duration::from_secs(3650 * 24 * 3600);
/// How long a leaf is valid, and how little of that may be left before a
/// new one is made.
const LEAF_VALIDITY: Duration = Duration::from_secs(7 * 24 * 3600);
const LEAF_RENEW: Duration = DAY;
/// Certificates start this long before they are made (clocks of guests
/// that lag a little).
const BACKDATE: Duration = Duration::from_secs(3600);
/// Leaf certificates kept at most (the least recently used goes first).
const LEAF_CACHE: usize = 1024;
/// Leaves one owner (a sandbox) may have made and still in the cache:
/// beyond, its own least recently used goes, so a sandbox naming host
/// after host of a wildcard rule churns its own share, never another's.
const LEAF_SHARE: usize = 64;
/// TLS sessions the guest side keeps for resumption.
const SESSION_CACHE: usize = 1024;
/// How long each TLS handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the guest has to send a request head, counted from the end
/// of the previous response on a kept-alive connection too.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(60);
const ALPN_HTTP11: &[u8] = b"http/1.1";
const ALPN_H2: &[u8] = b"h2";
/// Streams an HTTP/2 guest may have open at once.
const GUEST_MAX_STREAMS: u32 = 100;

/// The node CA: `<dir>/egress-ca.key` (PKCS#8 PEM, mode 0600, never
/// leaves the node) and `<dir>/egress-ca.crt` (PEM, 0644), which guests
/// are given to trust. Made at first start (ECDSA P-256, CN "cube-network-agent
/// egress CA <hostname>", CA with path length 0, key usage certificate
/// signing, valid 10 years) and loaded afterwards. A key file that group or
/// others may read is refused, and so is a certificate that does not match
/// the key.
pub struct NodeCa {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
    cert_der: CertificateDer<'static>,
}

impl NodeCa {
    /// Loads the CA from `dir`, or makes it there (the directory too) when
    /// neither file is there. A key without a certificate (a first start
    /// stopped between the two writes) gets a new certificate; a
    /// certificate without its key is refused.
    pub fn load_or_create(dir: &Path) -> Result<NodeCa, String> {
        let key_path = dir.join(CA_KEY_FILE);
        let cert_path = dir.join(CA_CERT_FILE);
        let key_pem = read_key_file(&key_path)?;
        let cert_pem = match fs::read_to_string(&cert_path) {
            Ok(s) => Some(s),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(format!("{}: {e}", cert_path.display())),
        };
        match (key_pem, cert_pem) {
            (Some(key_pem), Some(cert_pem)) => {
                let key = KeyPair::from_pem(&key_pem).map_err(|e| {
                    format!("{}: not a usable private key: {e}", key_path.display())
                })?;
                NodeCa::from_parts(key, cert_pem, &cert_path)
            }
            (None, Some(_)) => Err(format!(
                "{} is there but {} is not: the certificate is useless without its key; remove it to have a new CA made",
                cert_path.display(),
                key_path.display()
            )),
            (key_pem, None) => {
                let key = match key_pem {
                    Some(pem) => KeyPair::from_pem(&pem).map_err(|e| {
                        format!("{}: not a usable private key: {e}", key_path.display())
                    })?,
                    None => {
                        fs::DirBuilder::new()
                            .recursive(true)
                            .mode(0o755)
                            .create(dir)
                            .map_err(|e| format!("{}: {e}", dir.display()))?;
                        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
                            .map_err(|e| format!("making the egress CA key: {e}"))?;
                        write_atomic(&key_path, key.serialize_pem().as_bytes(), 0o600)?;
                        key
                    }
                };
                let params = ca_params(&ca_name())?;
                let cert = params
                    .self_signed(&key)
                    .map_err(|e| format!("making the egress CA certificate: {e}"))?;
                let pem = cert.pem();
                write_atomic(&cert_path, pem.as_bytes(), 0o644)?;
                NodeCa::from_parts(key, pem, &cert_path)
            }
        }
    }

    /// The CA certificate (PEM), for guests to trust.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Checks that `cert_pem` is a CA certificate for `key` and that the
    /// leaves it signs verify against it.
    fn from_parts(key: KeyPair, cert_pem: String, cert_path: &Path) -> Result<NodeCa, String> {
        let bad = |why: &str| format!("{}: {why}", cert_path.display());
        let cert_der = CertificateDer::from_pem_slice(cert_pem.as_bytes())
            .map_err(|_| bad("no PEM certificate in it"))?;
        let tbs = Tbs::parse(&cert_der).ok_or_else(|| bad("not a parsable X.509 certificate"))?;
        if tbs.public_key != key.public_key_raw() {
            return Err(bad(&format!("does not match the key in {CA_KEY_FILE}")));
        }
        let mut params = CertificateParams::default();
        params.distinguished_name = parse_name(tbs.subject_content)
            .ok_or_else(|| bad("its subject name is not one this agent makes"))?;
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign];
        let ca = NodeCa {
            issuer: Issuer::new(params, key),
            cert_pem,
            cert_der: cert_der.into_owned(),
        };
        ca.self_check()
            .map_err(|e| bad(&format!("a leaf it signs does not verify: {e}")))?;
        Ok(ca)
    }

    /// Signs a probe leaf and verifies it against the CA certificate, as a
    /// guest would.
    fn self_check(&self) -> Result<(), String> {
        let name = "egress-ca-check.invalid";
        let (leaf, _) = self.issue(name, SystemTime::now())?;
        let mut roots = RootCertStore::empty();
        roots
            .add(self.cert_der.clone())
            .map_err(|e| e.to_string())?;
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            provider(),
        )
        .build()
        .map_err(|e| e.to_string())?;
        let end = leaf.cert.first().ok_or("no leaf")?;
        let server = ServerName::try_from(name).map_err(|e| e.to_string())?;
        verifier
            .verify_server_cert(end, &[], &server, &[], UnixTime::now())
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    /// A leaf for `name` (SAN and CN that name, ECDSA P-256, server
    /// authentication), valid [`LEAF_VALIDITY`] from `now`, and when it
    /// ends.
    fn issue(
        &self,
        name: &str,
        now: SystemTime,
    ) -> Result<(Arc<CertifiedKey>, SystemTime), String> {
        let fail = |e: rcgen::Error| format!("making a certificate for {name}: {e}");
        let mut params = CertificateParams::new(vec![name.to_owned()]).map_err(fail)?;
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        let not_after = now + LEAF_VALIDITY;
        params.not_before = (now - BACKDATE).into();
        params.not_after = not_after.into();
        params.serial_number = Some(random_serial()?);
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(fail)?;
        let cert = params.signed_by(&key, &self.issuer).map_err(fail)?;
        let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let signing = provider()
            .key_provider
            .load_private_key(der)
            .map_err(|e| format!("loading the key for {name}: {e}"))?;
        Ok((
            Arc::new(CertifiedKey::new(vec![cert.der().clone()], signing)),
            not_after,
        ))
    }
}

/// The CA's parameters: name `cn`, CA with path length 0, certificate
/// signing only, valid [`CA_VALIDITY`].
fn ca_params(cn: &str) -> Result<CertificateParams, String> {
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, cn);
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign];
    let now = SystemTime::now();
    params.not_before = (now - BACKDATE).into();
    params.not_after = (now + CA_VALIDITY).into();
    params.serial_number = Some(random_serial()?);
    Ok(params)
}

/// "cube-network-agent egress CA <hostname>", or a random suffix when the
/// host has no usable name.
fn ca_name() -> String {
    let host = fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| {
            !h.is_empty()
                && h.len() <= 64
                && h.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        });
    let suffix = host.unwrap_or_else(|| {
        let mut b = [0u8; 6];
        let _ = crate::random::getrandom(&mut b);
        b.iter().map(|x| format!("{x:02x}")).collect()
    });
    format!("cube-network-agent egress CA {suffix}")
}

/// A positive random 128-bit serial number.
fn random_serial() -> Result<SerialNumber, String> {
    let mut b = [0u8; 16];
    crate::random::getrandom(&mut b).map_err(|e| format!("random serial: {e}"))?;
    b[0] = (b[0] & 0x7f) | 0x01;
    Ok(SerialNumber::from_slice(&b))
}

/// The CA key file's text, or `None` when there is none. Refused: a
/// symlink, anything but a regular file, a file group or others may use.
fn read_key_file(path: &Path) -> Result<Option<String>, String> {
    let mut f = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    let meta = f
        .metadata()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if !meta.is_file() {
        return Err(format!("{}: not a regular file", path.display()));
    }
    let mode = meta.mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "{}: mode {mode:04o} lets group or others at the egress CA's private key; refused (chmod 600 it, or remove both CA files to have a new CA made)",
            path.display()
        ));
    }
    let mut s = String::new();
    io::Read::read_to_string(&mut f, &mut s).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(Some(s))
}

/// Writes `path` whole or not at all: a temporary file created with
/// `mode` (never wider, even for a moment), synced, renamed over `path`,
/// and the directory synced.
fn write_atomic(path: &Path, data: &[u8], mode: u32) -> Result<(), String> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(".tmp");
    let tmp: PathBuf = dir.join(tmp_name);
    let err = |p: &Path, e: io::Error| format!("{}: {e}", p.display());
    match fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(&tmp, e)),
    }
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .map_err(|e| err(&tmp, e))?;
    // The umask may have narrowed a public file's mode; a key's stays
    // at most `mode`.
    if mode & 0o077 != 0 {
        f.set_permissions(fs::Permissions::from_mode(mode))
            .map_err(|e| err(&tmp, e))?;
    }
    f.write_all(data).map_err(|e| err(&tmp, e))?;
    f.sync_all().map_err(|e| err(&tmp, e))?;
    drop(f);
    fs::rename(&tmp, path).map_err(|e| err(path, e))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| err(dir, e))
}

/// The parts of a certificate's to-be-signed body the CA loading checks.
struct Tbs<'a> {
    /// The subject Name's content (the RDN sequence, without its tag).
    subject_content: &'a [u8],
    /// The subject public key (the BIT STRING's bits).
    public_key: &'a [u8],
}

impl<'a> Tbs<'a> {
    fn parse(cert: &'a [u8]) -> Option<Tbs<'a>> {
        let (tag, cert_body, _) = der_next(cert)?;
        if tag != 0x30 {
            return None;
        }
        let (tag, mut tbs, _) = der_next(cert_body)?;
        if tag != 0x30 {
            return None;
        }
        let mut field = || -> Option<(u8, &'a [u8])> {
            let (tag, content, rest) = der_next(tbs)?;
            tbs = rest;
            Some((tag, content))
        };
        let (mut tag, _) = field()?;
        if tag == 0xa0 {
            (tag, _) = field()?; // the version; then the serial number
        }
        if tag != 0x02 {
            return None;
        }
        let _signature = field()?;
        let _issuer = field()?;
        let _validity = field()?;
        let (tag, subject_content) = field()?;
        if tag != 0x30 {
            return None;
        }
        let (tag, spki) = field()?;
        if tag != 0x30 {
            return None;
        }
        let (_, _algorithm, rest) = der_next(spki)?;
        let (tag, bits, _) = der_next(rest)?;
        if tag != 0x03 || bits.first() != Some(&0) {
            return None;
        }
        Some(Tbs {
            subject_content,
            public_key: &bits[1..],
        })
    }
}

/// One DER element: (tag, content, what follows). Single-byte tags and
/// definite lengths only (all DER has).
fn der_next(b: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let tag = *b.first()?;
    let first = *b.get(1)?;
    let (len, at) = if first < 0x80 {
        (usize::from(first), 2)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 {
            return None;
        }
        let mut len = 0usize;
        for i in 0..n {
            len = (len << 8) | usize::from(*b.get(2 + i)?);
        }
        (len, 2 + n)
    };
    let end = at.checked_add(len)?;
    Some((tag, b.get(at..end)?, b.get(end..)?))
}

/// A Name's RDN sequence as rcgen's name (one attribute per RDN, string
/// values of the kinds rcgen writes), so leaves name the CA as it names
/// itself (checked by the self-check).
fn parse_name(mut rdns: &[u8]) -> Option<DistinguishedName> {
    let mut dn = DistinguishedName::new();
    while !rdns.is_empty() {
        let (tag, set, rest) = der_next(rdns)?;
        rdns = rest;
        let (tag2, atv, more) = der_next(set)?;
        if tag != 0x31 || tag2 != 0x30 || !more.is_empty() {
            return None;
        }
        let (tag, oid, rest) = der_next(atv)?;
        let (vtag, value, end) = der_next(rest)?;
        if tag != 0x06 || !end.is_empty() {
            return None;
        }
        let ty = match oid {
            [0x55, 0x04, 0x03] => DnType::CommonName,
            _ => DnType::CustomDnType(oid_arcs(oid)?),
        };
        let text = std::str::from_utf8(value).ok()?.to_owned();
        let value = match vtag {
            0x0c => DnValue::Utf8String(text),
            0x13 => DnValue::PrintableString(text.try_into().ok()?),
            _ => return None,
        };
        dn.push(ty, value);
    }
    Some(dn)
}

fn oid_arcs(b: &[u8]) -> Option<Vec<u64>> {
    let (&first, rest) = b.split_first()?;
    let mut arcs = vec![u64::from(first / 40), u64::from(first % 40)];
    let mut v = 0u64;
    for &x in rest {
        v = v.checked_mul(128)? | u64::from(x & 0x7f);
        if x & 0x80 == 0 {
            arcs.push(v);
            v = 0;
        }
    }
    Some(arcs)
}

/// rustls with *ring* (the agent builds without aws-lc-rs). rustls
/// deprecates it for its lack of post-quantum key exchange; classical
/// ECDHE is what both sides get until the agent moves providers.
#[allow(deprecated)]
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// What the core says about one request (asked per request, so rules
/// changed by a converge apply to the next request on a kept-alive
/// connection).
pub enum Judgement {
    /// Send it on, with these headers set (replacing any of the same name
    /// the guest sent). The values are secrets: the engine marks them
    /// sensitive and never logs or formats them.
    Pass {
        set_headers: Vec<(HeaderName, HeaderValue)>,
        rule_host: String,
    },
    /// Answer 403 with a short text naming the rule's host pattern and why
    /// (method or path not allowed).
    Forbid { rule_host: String, why: String },
    /// No rule for this host any more (rules changed): 403, and the
    /// connection is closed.
    Gone,
}

/// The core's side of the engine.
pub trait Judge: Send + Sync + 'static {
    /// `host` is the server name (lowercase, no port), `method` e.g.
    /// "GET", `path` the request target's path without the query.
    fn judge(&self, host: &str, method: &str, path: &str) -> Judgement;
    /// One record per request, once its response has been sent (or the
    /// guest went away).
    fn audit(&self, rec: AuditRecord);
    /// Whose connection this is (a sandbox id): the leaves it makes count
    /// against its share of the cache ([`LEAF_SHARE`]).
    fn owner(&self) -> &str {
        ""
    }
}

/// What happened to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditRecord {
    pub method: String,
    pub host: String,
    /// Without the query.
    pub path: String,
    pub status: u16,
    /// Request body bytes sent upstream.
    pub bytes_up: u64,
    /// Response body bytes sent to the guest (the engine's own text for a
    /// request it answered itself).
    pub bytes_down: u64,
    /// The pattern of the rule that judged it ("" when none did).
    pub rule_host: String,
    /// "forwarded", "forbidden", "misdirected" or "upstream_failed".
    pub verdict: &'static str,
    pub duration: Duration,
}

/// The interception engine: the node CA, the leaf certificates made so
/// far, and the TLS client configuration for upstreams.
pub struct Interceptor {
    ca: NodeCa,
    leaves: Mutex<LeafCache>,
    sessions: Arc<dyn StoresServerSessions>,
    /// Upstream TLS offering `http/1.1` only, and offering `h2` first.
    upstream_h1: Arc<ClientConfig>,
    upstream_h2: Arc<ClientConfig>,
}

impl Interceptor {
    /// `trust_bundle`: a PEM file of the roots upstream certificates are
    /// verified against; `None` for the system's ([`SYSTEM_TRUST_BUNDLE`]).
    /// A bundle that cannot be read or holds no usable certificate is an
    /// error.
    pub fn new(ca: NodeCa, trust_bundle: Option<&Path>) -> Result<Interceptor, String> {
        let path = trust_bundle.unwrap_or(Path::new(SYSTEM_TRUST_BUNDLE));
        let bad = |why: String| format!("trust bundle {}: {why}", path.display());
        let pem = fs::read(path).map_err(|e| bad(e.to_string()))?;
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(&pem) {
            let cert = cert.map_err(|e| bad(format!("bad PEM: {e}")))?;
            // A root webpki cannot use is skipped, as system bundles have some.
            let _ = roots.add(cert);
        }
        if roots.is_empty() {
            return Err(bad("no usable certificate in it".into()));
        }
        let mut upstream = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_no_client_auth();
        upstream.alpn_protocols = vec![ALPN_HTTP11.to_vec()];
        let mut upstream_h2 = upstream.clone();
        upstream_h2.alpn_protocols = vec![ALPN_H2.to_vec(), ALPN_HTTP11.to_vec()];
        Ok(Interceptor {
            ca,
            leaves: Mutex::new(LeafCache::default()),
            sessions: ServerSessionMemoryCache::new(SESSION_CACHE),
            upstream_h1: Arc::new(upstream),
            upstream_h2: Arc::new(upstream_h2),
        })
    }

    /// The node CA.
    pub fn ca(&self) -> &NodeCa {
        &self.ca
    }

    /// Serves one intercepted TLS connection: `guest` is the accepted
    /// stream from which `hello` (the ClientHello) was read, `sni` the name
    /// in it, `upstream` a connected stream to the upstream (the engine
    /// does the TLS handshake on it, verifying the certificate for `sni`).
    /// Returns when the connection ends.
    pub async fn serve_tls(
        &self,
        guest: TcpStream,
        hello: Vec<u8>,
        sni: &str,
        upstream: TcpStream,
        judge: Arc<dyn Judge>,
    ) -> Result<(), String> {
        let name = plain_name(sni);
        let server_name =
            ServerName::try_from(name.clone()).map_err(|_| format!("{name}: not a server name"))?;
        let leaf = self.leaf(&name, judge.owner())?;
        let deadline = tokio::time::Instant::now() + HANDSHAKE_TIMEOUT;
        let start = tokio::time::timeout_at(
            deadline,
            LazyConfigAcceptor::new(Acceptor::default(), Prefixed::new(hello, guest)),
        )
        .await;
        let start = match start {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(format!("TLS handshake with the guest for {name}: {e}")),
            Err(_) => {
                return Err(format!(
                    "TLS handshake with the guest for {name}: timed out"
                ));
            }
        };
        // HTTP/2 to the guest when it offers it (the engine prefers it), and
        // then h2 is offered to the upstream too. A guest that offers
        // HTTP/1.1 only (WebSocket clients do) gets an upstream offered
        // HTTP/1.1 only, where its upgrades can go.
        let h2 = start
            .client_hello()
            .alpn()
            .is_some_and(|mut offered| offered.any(|p| p == ALPN_H2));
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(OneLeaf(leaf)));
        config.alpn_protocols = if h2 {
            vec![ALPN_H2.to_vec(), ALPN_HTTP11.to_vec()]
        } else {
            vec![ALPN_HTTP11.to_vec()]
        };
        config.session_storage = self.sessions.clone();
        let connector = TlsConnector::from(if h2 {
            self.upstream_h2.clone()
        } else {
            self.upstream_h1.clone()
        });
        let (guest, upstream) = tokio::join!(
            tokio::time::timeout_at(deadline, start.into_stream(Arc::new(config))),
            tokio::time::timeout(HANDSHAKE_TIMEOUT, connector.connect(server_name, upstream)),
        );
        let guest = match guest {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(format!("TLS handshake with the guest for {name}: {e}")),
            Err(_) => {
                return Err(format!(
                    "TLS handshake with the guest for {name}: timed out"
                ));
            }
        };
        let guest_h2 = guest.get_ref().1.alpn_protocol() == Some(ALPN_H2);
        let upstream = match upstream {
            Ok(Ok(s)) => {
                let h2 = s.get_ref().1.alpn_protocol() == Some(ALPN_H2);
                Ok((s, h2))
            }
            Ok(Err(e)) => Err(upstream_tls_failure(&name, &e)),
            Err(_) => Err(format!("TLS handshake with upstream {name} timed out")),
        };
        serve(guest, guest_h2, upstream, name, judge).await
    }

    /// Plain HTTP (a rule with `plain_http`): the same request handling
    /// without TLS on either side. `head` is what the proxy read of the
    /// first request, `host` the Host it named.
    pub async fn serve_http(
        &self,
        guest: TcpStream,
        head: Vec<u8>,
        host: &str,
        upstream: TcpStream,
        judge: Arc<dyn Judge>,
    ) -> Result<(), String> {
        let name = plain_name(strip_port(host));
        serve(
            Prefixed::new(head, guest),
            false,
            Ok((upstream, false)),
            name,
            judge,
        )
        .await
    }

    /// The leaf for `name`, from the cache or made now.
    fn leaf(&self, name: &str, owner: &str) -> Result<Arc<CertifiedKey>, String> {
        let now = SystemTime::now();
        if let Some(k) = lock(&self.leaves).get(name, now) {
            return Ok(k);
        }
        let (key, not_after) = self.ca.issue(name, now)?;
        lock(&self.leaves).put(name, key.clone(), not_after, owner);
        Ok(key)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Lowercase, without a trailing dot.
fn plain_name(s: &str) -> String {
    s.strip_suffix('.').unwrap_or(s).to_ascii_lowercase()
}

/// Why the upstream handshake failed, in words for a 502's body.
fn upstream_tls_failure(name: &str, e: &io::Error) -> String {
    match e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
        Some(rustls::Error::InvalidCertificate(c)) => {
            format!("upstream certificate for {name} not trusted: {c}")
        }
        Some(r) => format!("TLS handshake with upstream {name} failed: {r}"),
        None => format!("TLS handshake with upstream {name} failed: {}", e.kind()),
    }
}

/// The leaves made so far, by name; an owner (the sandbox whose
/// connection made a leaf) keeps at most [`LEAF_SHARE`] of them (its own
/// least recently used goes), and the least recently used of all goes
/// when [`LEAF_CACHE`] are kept.
#[derive(Default)]
struct LeafCache {
    map: HashMap<String, Leaf>,
    tick: u64,
    /// Leaves in `map` per owner.
    owned: HashMap<String, usize>,
}

struct Leaf {
    key: Arc<CertifiedKey>,
    not_after: SystemTime,
    used: u64,
    owner: String,
}

impl LeafCache {
    /// The leaf for `name` unless it has less than [`LEAF_RENEW`] left.
    fn get(&mut self, name: &str, now: SystemTime) -> Option<Arc<CertifiedKey>> {
        self.tick += 1;
        let leaf = self.map.get_mut(name)?;
        if leaf.not_after < now + LEAF_RENEW {
            return None;
        }
        leaf.used = self.tick;
        Some(leaf.key.clone())
    }

    fn put(&mut self, name: &str, key: Arc<CertifiedKey>, not_after: SystemTime, owner: &str) {
        self.tick += 1;
        self.remove(name);
        let full_share = self.owned.get(owner).copied().unwrap_or(0) >= LEAF_SHARE;
        let victim = self
            .map
            .iter()
            .filter(|(_, l)| !full_share || l.owner == owner)
            .min_by_key(|(_, l)| l.used)
            .map(|(n, _)| n.clone());
        if let Some(v) = victim
            && (full_share || self.map.len() >= LEAF_CACHE)
        {
            self.remove(&v);
        }
        let used = self.tick;
        *self.owned.entry(owner.to_owned()).or_default() += 1;
        self.map.insert(
            name.to_owned(),
            Leaf {
                key,
                not_after,
                used,
                owner: owner.to_owned(),
            },
        );
    }

    fn remove(&mut self, name: &str) {
        if let Some(old) = self.map.remove(name)
            && let Some(n) = self.owned.get_mut(&old.owner)
        {
            *n -= 1;
            if *n == 0 {
                self.owned.remove(&old.owner);
            }
        }
    }
}

/// The guest side's certificate: the one leaf made for the connection's
/// name.
#[derive(Debug)]
struct OneLeaf(Arc<CertifiedKey>);

impl ResolvesServerCert for OneLeaf {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

/// A stream whose first bytes were already read: they are read again
/// from here first.
struct Prefixed<S> {
    prefix: Vec<u8>,
    at: usize,
    inner: S,
}

impl<S> Prefixed<S> {
    fn new(prefix: Vec<u8>, inner: S) -> Prefixed<S> {
        Prefixed {
            prefix,
            at: 0,
            inner,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.at < this.prefix.len() {
            let n = (this.prefix.len() - this.at).min(buf.remaining());
            buf.put_slice(&this.prefix[this.at..this.at + n]);
            this.at += n;
            if this.at == this.prefix.len() {
                this.prefix = Vec::new();
                this.at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// The upstream connection's request sender.
enum Upstream {
    /// HTTP/1.1: one request at a time (the guest's HTTP/2 streams wait
    /// their turn here).
    H1(tokio::sync::Mutex<hyper::client::conn::http1::SendRequest<Counted>>),
    /// HTTP/2 (the upstream chose `h2`): each request its own stream, sent
    /// concurrently through clones of the sender.
    H2(hyper::client::conn::http2::SendRequest<Counted>),
}

/// One guest connection's state, shared by its requests.
struct Conn {
    /// The server name (lowercase, no port).
    name: String,
    judge: Arc<dyn Judge>,
    /// The guest speaks HTTP/2 (ALPN `h2`).
    guest_h2: bool,
    /// The upstream connection, or why there is none.
    upstream: Result<Upstream, String>,
    /// Asks for the guest's connection to be closed gracefully (HTTP/2:
    /// GOAWAY, the streams in flight finish).
    close: tokio::sync::Notify,
    /// A WebSocket upgrade is under way upstream: the upstream connection's
    /// task ending then is the upgrade, not the upstream closing.
    upgrading: AtomicBool,
    /// The spliced WebSocket, once both sides switched protocols.
    tunnel: Mutex<Option<AbortOnDrop>>,
}

/// Aborts the upstream connection's task when the guest connection ends.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Serves the guest's requests on `guest` (HTTP/2 when `guest_h2`, else
/// HTTP/1.1), forwarding the ones that pass over `upstream` (HTTP/2 when
/// its flag says the upstream chose it, else HTTP/1.1), or answering each
/// 502 when it is an error.
async fn serve<G, U>(
    guest: G,
    guest_h2: bool,
    upstream: Result<(U, bool), String>,
    name: String,
    judge: Arc<dyn Judge>,
) -> Result<(), String>
where
    G: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    U: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut driver = None;
    let upstream = match upstream {
        Ok((io, true)) => match hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .handshake::<_, Counted>(TokioIo::new(io))
            .await
        {
            Ok((sender, conn)) => {
                driver = Some(AbortOnDrop(tokio::spawn(async move {
                    let _ = conn.await;
                })));
                Ok(Upstream::H2(sender))
            }
            Err(_) => Err(format!("HTTP/2 connection to upstream {name} failed")),
        },
        Ok((io, false)) => match hyper::client::conn::http1::Builder::new()
            .handshake::<_, Counted>(TokioIo::new(io))
            .await
        {
            Ok((sender, conn)) => {
                driver = Some(AbortOnDrop(tokio::spawn(async move {
                    let _ = conn.with_upgrades().await;
                })));
                Ok(Upstream::H1(tokio::sync::Mutex::new(sender)))
            }
            Err(_) => Err(format!("HTTP/1.1 connection to upstream {name} failed")),
        },
        Err(why) => Err(why),
    };
    let conn = Arc::new(Conn {
        name,
        judge,
        guest_h2,
        upstream,
        close: tokio::sync::Notify::new(),
        upgrading: AtomicBool::new(false),
        tunnel: Mutex::new(None),
    });
    let shared = conn.clone();
    let service = service_fn(move |req| {
        let conn = shared.clone();
        async move { Ok::<_, Infallible>(handle(&conn, req).await) }
    });
    let served = if guest_h2 {
        let served = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .max_concurrent_streams(GUEST_MAX_STREAMS)
            .serve_connection(TokioIo::new(guest), service);
        drive(served, |c| c.graceful_shutdown(), &conn, &mut driver).await
    } else {
        let served = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(HEADER_READ_TIMEOUT)
            .keep_alive(true)
            .serve_connection(TokioIo::new(guest), service)
            .with_upgrades();
        drive(served, |c| c.graceful_shutdown(), &conn, &mut driver).await
    };
    // A WebSocket goes on after the HTTP connection handed its stream over.
    let tunnel = lock(&conn.tunnel).take();
    if let Some(mut t) = tunnel {
        let _ = (&mut t.0).await;
    }
    drop(driver);
    match served {
        Ok(()) => Ok(()),
        Err(e)
            if e.is_incomplete_message()
                || e.is_closed()
                || e.is_canceled()
                || e.is_timeout()
                || went_away(&e) =>
        {
            Ok(())
        }
        // hyper's errors name what went wrong, never request contents.
        Err(e) => Err(format!("guest HTTP connection: {e}")),
    }
}

/// Whether the guest just closed or dropped the connection (an HTTP/2
/// client often closes without TLS close_notify once it has its answers).
fn went_away(e: &hyper::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<io::Error>() {
            return matches!(
                io.kind(),
                io::ErrorKind::UnexpectedEof
                    | io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::BrokenPipe
            );
        }
        source = s.source();
    }
    false
}

/// Runs the guest's connection `served` to its end, shutting it down
/// gracefully (`shutdown`) when the upstream closes its side (idle, or
/// after a response that said so: the guest's connection could not be
/// served any more once the requests in flight are answered) or a request
/// asks for it.
async fn drive<C>(
    served: C,
    shutdown: impl Fn(Pin<&mut C>),
    conn: &Conn,
    driver: &mut Option<AbortOnDrop>,
) -> Result<(), hyper::Error>
where
    C: Future<Output = Result<(), hyper::Error>>,
{
    let mut served = std::pin::pin!(served);
    let mut upstream_closed = std::pin::pin!(async {
        match driver.as_mut() {
            Some(d) => {
                let _ = (&mut d.0).await;
            }
            None => std::future::pending().await,
        }
    });
    let mut asked = std::pin::pin!(conn.close.notified());
    let (mut upstream_done, mut closing) = (false, false);
    loop {
        tokio::select! {
            r = &mut served => return r,
            () = &mut upstream_closed, if !upstream_done => {
                upstream_done = true;
                if !closing && !conn.upgrading.load(Ordering::Relaxed) {
                    closing = true;
                    shutdown(served.as_mut());
                }
            }
            () = &mut asked, if !closing => {
                closing = true;
                shutdown(served.as_mut());
            }
        }
    }
}

/// Answers one request: checks, judges, forwards.
async fn handle(conn: &Conn, mut req: Request<Incoming>) -> Response<Out> {
    let mut audit = Audit {
        judge: conn.judge.clone(),
        start: Instant::now(),
        up: None,
        rec: AuditRecord {
            method: req.method().as_str().to_owned(),
            host: conn.name.clone(),
            path: req.uri().path().to_owned(),
            status: 0,
            bytes_up: 0,
            bytes_down: 0,
            rule_host: String::new(),
            verdict: "forbidden",
            duration: Duration::ZERO,
        },
    };
    let Some(host) = request_host(&req, &conn.name) else {
        audit.rec.verdict = "misdirected";
        let body = format!(
            "421 Misdirected Request: this connection is for {}\n",
            conn.name
        );
        drain(&mut req).await;
        return text(conn, StatusCode::MISDIRECTED_REQUEST, body, audit, false);
    };
    let websocket = is_websocket(&req);
    if req.method() == Method::CONNECT
        || (req.headers().contains_key(header::UPGRADE) && !websocket)
    {
        let body = "501 Not Implemented: the egress gateway passes WebSocket upgrades only (no CONNECT, no other protocol upgrade)\n";
        return text(conn, StatusCode::NOT_IMPLEMENTED, body.into(), audit, true);
    }
    if has_dot_segment(req.uri().path()) {
        let body = "400 Bad Request: dot segments in the path are refused\n";
        drain(&mut req).await;
        return text(conn, StatusCode::BAD_REQUEST, body.into(), audit, true);
    }
    let set_headers = match conn
        .judge
        .judge(&conn.name, req.method().as_str(), req.uri().path())
    {
        Judgement::Pass {
            set_headers,
            rule_host,
        } => {
            audit.rec.rule_host = rule_host;
            set_headers
        }
        Judgement::Forbid { rule_host, why } => {
            let body = format!("403 Forbidden: {why} (egress rule {rule_host})\n");
            audit.rec.rule_host = rule_host;
            drain(&mut req).await;
            return text(conn, StatusCode::FORBIDDEN, body, audit, false);
        }
        Judgement::Gone => {
            let body = format!(
                "403 Forbidden: no egress rule names {} any more\n",
                conn.name
            );
            if conn.guest_h2 {
                conn.close.notify_one();
            }
            drain(&mut req).await;
            return text(conn, StatusCode::FORBIDDEN, body, audit, true);
        }
    };
    let upstream = match &conn.upstream {
        Ok(u) => u,
        Err(why) => {
            audit.rec.verdict = "upstream_failed";
            return text(
                conn,
                StatusCode::BAD_GATEWAY,
                format!("502 Bad Gateway: {why}\n"),
                audit,
                false,
            );
        }
    };
    if websocket && matches!(upstream, Upstream::H2(_)) {
        // Not reached through serve_tls: a guest that offers HTTP/1.1 only
        // gets an upstream offered HTTP/1.1 only.
        let body = "501 Not Implemented: the upstream speaks HTTP/2; WebSocket over HTTP/2 (RFC 8441) is not supported\n";
        return text(conn, StatusCode::NOT_IMPLEMENTED, body.into(), audit, true);
    }

    let guest_upgrade = websocket.then(|| hyper::upgrade::on(&mut req));
    let upgrade = req.headers().get(header::UPGRADE).cloned();
    let te_trailers = has_token(req.headers(), header::TE, "trailers");
    let (mut parts, body) = req.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    // The guest's values of these names go first, so that a rule may set
    // one name more than once.
    for (name, _) in &set_headers {
        parts.headers.remove(name);
    }
    for (name, mut value) in set_headers {
        value.set_sensitive(true);
        parts.headers.append(name, value);
    }
    let pq = parts
        .uri
        .path_and_query()
        .map_or("/", |pq| pq.as_str())
        .to_owned();
    match upstream {
        Upstream::H1(_) => {
            parts.headers.insert(header::HOST, host);
            if parts.uri.authority().is_some() {
                // Absolute form (or HTTP/2's) to origin form: the upstream
                // is an origin server.
                parts.uri = pq.parse::<Uri>().unwrap_or_else(|_| Uri::from_static("/"));
            }
            parts.version = http::Version::HTTP_11;
            join_cookies(&mut parts.headers);
            if let Some(upgrade) = upgrade.filter(|_| websocket) {
                parts.headers.insert(header::UPGRADE, upgrade);
                parts
                    .headers
                    .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            }
        }
        Upstream::H2(_) => {
            // The name goes in :authority; HTTP/2 has no Host.
            parts.headers.remove(header::HOST);
            let authority = host.to_str().unwrap_or(&conn.name).to_owned();
            let Ok(uri) = Uri::builder()
                .scheme("https")
                .authority(authority)
                .path_and_query(pq)
                .build()
            else {
                let body = "400 Bad Request: the request target cannot be sent on\n";
                return text(conn, StatusCode::BAD_REQUEST, body.into(), audit, true);
            };
            parts.uri = uri;
            parts.version = http::Version::HTTP_2;
            // The one TE value HTTP/2 allows (gRPC needs it).
            if te_trailers {
                parts
                    .headers
                    .insert(header::TE, HeaderValue::from_static("trailers"));
            }
        }
    }
    let up = Arc::new(AtomicU64::new(0));
    audit.up = Some(up.clone());
    let req = Request::from_parts(
        parts,
        Counted {
            inner: body,
            count: up,
        },
    );

    if websocket {
        conn.upgrading.store(true, Ordering::Relaxed);
    }
    let answer = match upstream {
        Upstream::H1(sender) => {
            let mut sender = sender.lock().await;
            match sender.ready().await {
                Ok(()) => sender.send_request(req).await.map_err(|_| ()),
                Err(_) => Err(()),
            }
        }
        Upstream::H2(sender) => {
            let mut sender = sender.clone();
            match sender.ready().await {
                Ok(()) => sender.send_request(req).await.map_err(|_| ()),
                Err(_) => Err(()),
            }
        }
    };
    let switched = answer
        .as_ref()
        .is_ok_and(|r| r.status() == StatusCode::SWITCHING_PROTOCOLS);
    if !switched {
        conn.upgrading.store(false, Ordering::Relaxed);
    }
    let Ok(mut resp) = answer else {
        audit.rec.verdict = "upstream_failed";
        let body = format!("502 Bad Gateway: upstream {} failed to answer\n", conn.name);
        return text(conn, StatusCode::BAD_GATEWAY, body, audit, true);
    };
    if switched {
        let Some(guest_upgrade) = guest_upgrade else {
            audit.rec.verdict = "upstream_failed";
            let body = format!(
                "502 Bad Gateway: upstream {} switched protocols unasked\n",
                conn.name
            );
            return text(conn, StatusCode::BAD_GATEWAY, body, audit, true);
        };
        let upstream_upgrade = hyper::upgrade::on(&mut resp);
        let (mut parts, _) = resp.into_parts();
        let upgrade = parts.headers.get(header::UPGRADE).cloned();
        strip_hop_by_hop(&mut parts.headers);
        if let Some(upgrade) = upgrade {
            parts.headers.insert(header::UPGRADE, upgrade);
        }
        parts
            .headers
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        audit.rec.verdict = "forwarded";
        audit.rec.status = parts.status.as_u16();
        let task = tokio::spawn(splice(guest_upgrade, upstream_upgrade, audit));
        *lock(&conn.tunnel) = Some(AbortOnDrop(task));
        return Response::from_parts(
            parts,
            Out {
                body: OutBody::Text(None),
                audit: None,
            },
        );
    }
    let (mut parts, body) = resp.into_parts();
    let close = has_token(&parts.headers, header::CONNECTION, "close");
    strip_hop_by_hop(&mut parts.headers);
    if close && !conn.guest_h2 {
        parts
            .headers
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    audit.rec.verdict = "forwarded";
    audit.rec.status = parts.status.as_u16();
    Response::from_parts(
        parts,
        Out {
            body: OutBody::Upstream(body),
            audit: Some(audit),
        },
    )
}

/// Whether the comma-separated values of header `name` have `token`
/// (case aside).
fn has_token(h: &HeaderMap, name: HeaderName, token: &str) -> bool {
    h.get_all(name).iter().any(|v| {
        v.to_str()
            .is_ok_and(|s| s.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
    })
}

/// An HTTP/1.1 `GET` asking to switch to WebSocket (`Upgrade: websocket`,
/// `Connection: upgrade`), the one upgrade passed on.
fn is_websocket(req: &Request<Incoming>) -> bool {
    let mut upgrades = req
        .headers()
        .get_all(header::UPGRADE)
        .iter()
        .flat_map(|v| v.to_str().unwrap_or("?").split(','))
        .map(str::trim);
    req.method() == Method::GET
        && req.version() == http::Version::HTTP_11
        && upgrades
            .next()
            .is_some_and(|u| u.eq_ignore_ascii_case("websocket"))
        && upgrades.next().is_none()
        && has_token(req.headers(), header::CONNECTION, "upgrade")
}

/// Several Cookie fields (as HTTP/2 clients send them) as one, for an
/// HTTP/1.1 upstream (RFC 9113 section 8.2.3).
fn join_cookies(h: &mut HeaderMap) {
    if h.get_all(header::COOKIE).iter().nth(1).is_none() {
        return;
    }
    let mut joined = Vec::new();
    for v in h.get_all(header::COOKIE) {
        if !joined.is_empty() {
            joined.extend_from_slice(b"; ");
        }
        joined.extend_from_slice(v.as_bytes());
    }
    if let Ok(v) = HeaderValue::from_bytes(&joined) {
        h.insert(header::COOKIE, v);
    }
}

/// Splices the guest's and the upstream's upgraded streams both ways until
/// they close, then leaves the request's audit record with the bytes each
/// way.
async fn splice(
    guest: hyper::upgrade::OnUpgrade,
    upstream: hyper::upgrade::OnUpgrade,
    mut audit: Audit,
) {
    let up = Arc::new(AtomicU64::new(0));
    let down = Arc::new(AtomicU64::new(0));
    audit.up = Some(up.clone());
    if let (Ok(g), Ok(u)) = tokio::join!(guest, upstream) {
        let mut g = Tally {
            inner: TokioIo::new(g),
            count: up,
        };
        let mut u = Tally {
            inner: TokioIo::new(u),
            count: down.clone(),
        };
        let _ = tokio::io::copy_bidirectional(&mut g, &mut u).await;
    }
    audit.rec.bytes_down = down.load(Ordering::Relaxed);
}

/// A stream whose reads are counted.
struct Tally<S> {
    inner: S,
    count: Arc<AtomicU64>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Tally<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.inner).poll_read(cx, buf);
        let n = buf.filled().len() - before;
        this.count.fetch_add(n as u64, Ordering::Relaxed);
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Tally<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// The request's Host (and absolute-form authority), when each there is
/// names `name` (case aside, port ignored), as the value to send on.
fn request_host(req: &Request<Incoming>, name: &str) -> Option<HeaderValue> {
    let mut hosts = req.headers().get_all(header::HOST).iter();
    let header = hosts.next();
    if hosts.next().is_some() {
        return None;
    }
    let authority = req.uri().authority().map(|a| a.as_str());
    let matches = |h: &str| {
        let h = strip_port(h);
        h.strip_suffix('.').unwrap_or(h).eq_ignore_ascii_case(name)
    };
    if let Some(a) = authority
        && (a.contains('@') || !matches(a))
    {
        return None;
    }
    match header {
        Some(v) => matches(v.to_str().ok()?).then(|| v.clone()),
        None => HeaderValue::from_str(authority?).ok(),
    }
}

/// `host[:port]` without the port (a bracketed IPv6 address keeps its
/// brackets).
fn strip_port(h: &str) -> &str {
    if h.starts_with('[') {
        return h.find(']').map_or(h, |i| &h[..=i]);
    }
    match h.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => h,
    }
}

/// Whether `path` has a "." or ".." segment, also when spelled with
/// percent escapes or backslashes (the upstream could resolve one to a
/// path the rule's prefixes do not allow).
fn has_dot_segment(path: &str) -> bool {
    let p = path
        .to_ascii_lowercase()
        .replace("%2e", ".")
        .replace("%2f", "/")
        .replace("%5c", "/")
        .replace('\\', "/");
    p.split('/').any(|s| s == "." || s == "..")
}

/// Removes the headers that are about one hop only: Connection and the
/// ones it names, Keep-Alive, Proxy-*, TE, Trailer, Transfer-Encoding
/// (hyper frames each side's body itself) and Upgrade.
fn strip_hop_by_hop(h: &mut HeaderMap) {
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|s| s.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in [
        header::CONNECTION,
        HeaderName::from_static("keep-alive"),
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ] {
        h.remove(n);
    }
    let proxy: Vec<HeaderName> = h
        .keys()
        .filter(|k| k.as_str().starts_with("proxy-"))
        .cloned()
        .collect();
    for n in proxy {
        h.remove(n);
    }
}

/// A response the engine makes itself: `body` as text, with
/// `Connection: close` when `close` (HTTP/1.1; an HTTP/2 stream ends on
/// its own).
/// What of a refused request's body is read (and dropped) before the
/// answer, at most: an HTTP/2 client still sending when the answer comes
/// gets its stream reset, and reports a framing error instead of the
/// answer (curl: "Stream error in the HTTP/2 framing layer").
const DRAIN_MAX: usize = 256 * 1024;
const DRAIN_TIME: Duration = Duration::from_secs(2);

/// Reads what is left of a refused request's body, up to [`DRAIN_MAX`]
/// bytes or [`DRAIN_TIME`]. Not when the client waits for a `100
/// Continue` (reading would ask it to send the body it need not send).
async fn drain(req: &mut Request<Incoming>) {
    if req.headers().contains_key(header::EXPECT) {
        return;
    }
    let body = req.body_mut();
    let mut seen = 0;
    let _ = tokio::time::timeout(DRAIN_TIME, async {
        while seen < DRAIN_MAX && !body.is_end_stream() {
            match std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await {
                Some(Ok(frame)) => seen += frame.data_ref().map_or(0, |d| d.len()),
                _ => break,
            }
        }
    })
    .await;
}

fn text(
    conn: &Conn,
    status: StatusCode,
    body: String,
    mut audit: Audit,
    close: bool,
) -> Response<Out> {
    audit.rec.status = status.as_u16();
    let mut resp = Response::new(Out {
        body: OutBody::Text(Some(Bytes::from(body))),
        audit: Some(audit),
    });
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    if close && !conn.guest_h2 {
        h.insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}

/// One request's audit record, handed to the judge when the response
/// body is done with (sent, or dropped when the guest went away).
struct Audit {
    judge: Arc<dyn Judge>,
    start: Instant,
    /// The request body's count, when it was sent on.
    up: Option<Arc<AtomicU64>>,
    rec: AuditRecord,
}

impl Drop for Audit {
    fn drop(&mut self) {
        let mut rec = std::mem::replace(
            &mut self.rec,
            AuditRecord {
                method: String::new(),
                host: String::new(),
                path: String::new(),
                status: 0,
                bytes_up: 0,
                bytes_down: 0,
                rule_host: String::new(),
                verdict: "",
                duration: Duration::ZERO,
            },
        );
        rec.duration = self.start.elapsed();
        if let Some(up) = &self.up {
            rec.bytes_up = up.load(Ordering::Relaxed);
        }
        self.judge.audit(rec);
    }
}

/// The request body sent upstream, counted.
struct Counted {
    inner: Incoming,
    count: Arc<AtomicU64>,
}

impl Body for Counted {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(f))) = &r
            && let Some(d) = f.data_ref()
        {
            self.count.fetch_add(d.len() as u64, Ordering::Relaxed);
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The response body sent to the guest: the engine's text or the
/// upstream's body, counted, with the request's audit record (none for a
/// 101, whose record goes with the splice).
struct Out {
    body: OutBody,
    audit: Option<Audit>,
}

enum OutBody {
    Text(Option<Bytes>),
    Upstream(Incoming),
}

impl Body for Out {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        let r = match &mut this.body {
            OutBody::Text(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            OutBody::Upstream(inner) => Pin::new(inner).poll_frame(cx),
        };
        if let Poll::Ready(Some(Ok(f))) = &r
            && let Some(d) = f.data_ref()
            && let Some(audit) = &mut this.audit
        {
            audit.rec.bytes_down += d.len() as u64;
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        match &self.body {
            OutBody::Text(b) => b.is_none(),
            OutBody::Upstream(inner) => inner.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.body {
            OutBody::Text(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            OutBody::Upstream(inner) => inner.size_hint(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;

    use http_body_util::combinators::BoxBody;
    use http_body_util::{BodyExt, Empty, Full, StreamBody};
    use hyper::client::conn::http1::SendRequest;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tokio_rustls::TlsAcceptor;

    use crate::dns::proxy::{Hello, tls_server_name};

    const SECRET: &str = "Bearer s3cr3t-TOKEN-1f2e3d";
    const GUEST_TOKEN: &str = "Bearer guest-sent";
    const BIG: usize = 8 * 1024 * 1024;
    const CHUNK: usize = 128 * 1024;

    type TestBody = BoxBody<Bytes, Infallible>;

    fn empty() -> TestBody {
        Empty::new().boxed()
    }

    fn big_body() -> TestBody {
        let chunks = (0..BIG / CHUNK).map(|i| Ok(Frame::data(Bytes::from(vec![i as u8; CHUNK]))));
        StreamBody::new(futures::stream::iter(chunks)).boxed()
    }

    /// A test CA (the upstream's, as a public CA would be) and leaves it
    /// signs.
    struct TestCa {
        issuer: Issuer<'static, KeyPair>,
        pem: String,
    }

    impl TestCa {
        fn new() -> TestCa {
            let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
            let params = ca_params("test upstream CA").unwrap();
            let pem = params.self_signed(&key).unwrap().pem();
            TestCa {
                issuer: Issuer::new(params, key),
                pem,
            }
        }

        fn leaf(&self, name: &str) -> (CertificateDer<'static>, PrivateKeyDer<'static>) {
            let mut params = CertificateParams::new(vec![name.to_owned()]).unwrap();
            params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
            let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
            let cert = params.signed_by(&key, &self.issuer).unwrap();
            (
                cert.der().clone(),
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            )
        }
    }

    /// What the test upstream was asked.
    #[derive(Debug, Clone)]
    struct Seen {
        path: String,
        version: http::Version,
        headers: Vec<(String, Vec<u8>)>,
    }

    /// A TLS HTTP/1.1 upstream with a leaf for `leaf_name`: it records
    /// each request head, answers `/big` with [`BIG`] bytes and anything
    /// else with the request's headers (all but Authorization) and the
    /// size of its body.
    async fn upstream(ca: &TestCa, leaf_name: &str) -> (SocketAddr, Arc<Mutex<Vec<Seen>>>) {
        upstream_alpn(ca, leaf_name, &[ALPN_HTTP11]).await
    }

    /// The same, offering `alpn` (HTTP/2 served when `h2` is chosen).
    async fn upstream_alpn(
        ca: &TestCa,
        leaf_name: &str,
        alpn: &[&[u8]],
    ) -> (SocketAddr, Arc<Mutex<Vec<Seen>>>) {
        let (cert, key) = ca.leaf(leaf_name);
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![cert], key)
            .unwrap();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        start_upstream(Some(TlsAcceptor::from(Arc::new(config)))).await
    }

    /// The same upstream over plain TCP, or TLS with `tls`.
    async fn start_upstream(tls: Option<TlsAcceptor>) -> (SocketAddr, Arc<Mutex<Vec<Seen>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let seen2 = seen.clone();
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let tls = tls.clone();
                let seen = seen2.clone();
                tokio::spawn(async move {
                    match tls {
                        Some(acceptor) => {
                            if let Ok(io) = acceptor.accept(tcp).await {
                                let h2 = io.get_ref().1.alpn_protocol() == Some(ALPN_H2);
                                serve_echo(io, seen, h2).await;
                            }
                        }
                        None => serve_echo(tcp, seen, false).await,
                    }
                });
            }
        });
        (addr, seen)
    }

    async fn serve_echo<I>(io: I, seen: Arc<Mutex<Vec<Seen>>>, h2: bool)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let service = service_fn(move |req: Request<Incoming>| {
            let seen = seen.clone();
            async move { Ok::<_, Infallible>(echo(&seen, req).await) }
        });
        if h2 {
            let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(io), service)
                .await;
        } else {
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(io), service)
                .with_upgrades()
                .await;
        }
    }

    /// The test upstream's answers: `/big`, `/close`, `/pair` (waits for
    /// a second `/pair` request to be in, proving both are in flight at
    /// once), an upgrade (101, then echoes the bytes on the upgraded
    /// stream) and the echo of the request head otherwise.
    async fn echo(seen: &Mutex<Vec<Seen>>, mut req: Request<Incoming>) -> Response<TestBody> {
        let headers: Vec<(String, Vec<u8>)> = req
            .headers()
            .iter()
            .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
            .collect();
        let path = req
            .uri()
            .path_and_query()
            .map_or("/".to_owned(), |pq| pq.to_string());
        lock(seen).push(Seen {
            path: path.clone(),
            version: req.version(),
            headers: headers.clone(),
        });
        if req.headers().contains_key(header::UPGRADE) {
            let on = hyper::upgrade::on(&mut req);
            tokio::spawn(async move {
                let Ok(upgraded) = on.await else { return };
                let mut io = TokioIo::new(upgraded);
                let mut buf = [0u8; 4096];
                loop {
                    match io.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            if io.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                    }
                }
            });
            return Response::builder()
                .status(StatusCode::SWITCHING_PROTOCOLS)
                .header(header::UPGRADE, "websocket")
                .header(header::CONNECTION, "Upgrade")
                .header("sec-websocket-accept", "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=")
                .body(empty())
                .unwrap();
        }
        if path.starts_with("/pair") {
            for _ in 0..500 {
                if lock(seen)
                    .iter()
                    .filter(|s| s.path.starts_with("/pair"))
                    .count()
                    >= 2
                {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        let mut body = req.into_body();
        let mut n = 0;
        while let Some(f) = body.frame().await {
            if let Some(d) = f.unwrap().data_ref() {
                n += d.len();
            }
        }
        if path.starts_with("/big") {
            return Response::new(big_body());
        }
        if path.starts_with("/close") {
            let mut resp = Response::new(empty());
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            return resp;
        }
        let mut out = String::new();
        for (name, v) in &headers {
            if name != "authorization" {
                out.push_str(&format!("{name}: {}\n", String::from_utf8_lossy(v)));
            }
        }
        out.push_str(&format!("body-bytes: {n}\n"));
        Response::new(Full::new(Bytes::from(out)).boxed())
    }

    /// Passes everything but paths under /forbidden, setting
    /// Authorization to [`SECRET`]; keeps the audit records.
    #[derive(Default)]
    struct TestJudge {
        audits: Mutex<Vec<AuditRecord>>,
    }

    impl Judge for TestJudge {
        fn judge(&self, host: &str, _method: &str, path: &str) -> Judgement {
            assert_eq!(host, "api.test");
            if path.starts_with("/forbidden") {
                return Judgement::Forbid {
                    rule_host: "*.test".into(),
                    why: "path not allowed".into(),
                };
            }
            if path.starts_with("/gone") {
                return Judgement::Gone;
            }
            Judgement::Pass {
                set_headers: vec![(header::AUTHORIZATION, HeaderValue::from_static(SECRET))],
                rule_host: "api.test".into(),
            }
        }

        fn audit(&self, rec: AuditRecord) {
            lock(&self.audits).push(rec);
        }
    }

    /// Records what the guest side reads (the plaintext inside TLS).
    struct Tap<S> {
        inner: S,
        got: Arc<Mutex<Vec<u8>>>,
    }

    impl<S: AsyncRead + Unpin> AsyncRead for Tap<S> {
        fn poll_read(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            let this = self.get_mut();
            let before = buf.filled().len();
            let r = Pin::new(&mut this.inner).poll_read(cx, buf);
            lock(&this.got).extend_from_slice(&buf.filled()[before..]);
            r
        }
    }

    impl<S: AsyncWrite + Unpin> AsyncWrite for Tap<S> {
        fn poll_write(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
        }
        fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.get_mut().inner).poll_flush(cx)
        }
        fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
        }
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let mut r = [0u8; 8];
        crate::random::getrandom(&mut r).unwrap();
        let dir = std::env::temp_dir().join(format!(
            "cna-intercept-{tag}-{}-{}",
            std::process::id(),
            u64::from_le_bytes(r)
        ));
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A world: the node CA, the upstream's CA, the interceptor trusting
    /// the latter.
    struct World {
        interceptor: Arc<Interceptor>,
        node_ca_pem: String,
        upstream_ca: TestCa,
        dir: PathBuf,
    }

    impl World {
        fn new() -> World {
            let dir = temp_dir("world");
            let ca = NodeCa::load_or_create(&dir).unwrap();
            let node_ca_pem = ca.cert_pem().to_owned();
            let upstream_ca = TestCa::new();
            let bundle = dir.join("bundle.pem");
            fs::write(&bundle, &upstream_ca.pem).unwrap();
            let interceptor = Arc::new(Interceptor::new(ca, Some(&bundle)).unwrap());
            World {
                interceptor,
                node_ca_pem,
                upstream_ca,
                dir,
            }
        }
    }

    impl Drop for World {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }

    /// The guest's TLS connection to "api.test" through the engine (as
    /// the proxy would hand it over: the ClientHello read off first) to
    /// the upstream at `up`, and the engine's task.
    async fn guest_tls(
        w: &World,
        up: SocketAddr,
        judge: Arc<TestJudge>,
    ) -> (
        tokio_rustls::client::TlsStream<TcpStream>,
        tokio::task::JoinHandle<Result<(), String>>,
    ) {
        let (tls, served) = guest_tls_alpn(w, up, judge, &[ALPN_HTTP11]).await;
        assert_eq!(tls.get_ref().1.alpn_protocol(), Some(ALPN_HTTP11));
        (tls, served)
    }

    /// The same, the guest offering `alpn`.
    async fn guest_tls_alpn(
        w: &World,
        up: SocketAddr,
        judge: Arc<TestJudge>,
        alpn: &[&[u8]],
    ) -> (
        tokio_rustls::client::TlsStream<TcpStream>,
        tokio::task::JoinHandle<Result<(), String>>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let interceptor = w.interceptor.clone();
        let served = tokio::spawn(async move {
            let (mut tcp, _) = listener.accept().await.unwrap();
            let mut hello = Vec::new();
            let sni = loop {
                let mut buf = [0u8; 4096];
                let n = tcp.read(&mut buf).await.unwrap();
                assert!(n > 0, "guest closed before its ClientHello");
                hello.extend_from_slice(&buf[..n]);
                match tls_server_name(&hello) {
                    Hello::More(_) => continue,
                    Hello::Done(name) => break name.unwrap(),
                }
            };
            let upstream = TcpStream::connect(up).await.unwrap();
            interceptor
                .serve_tls(tcp, hello, &sni, upstream, judge)
                .await
        });
        let mut roots = RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(w.node_ca_pem.as_bytes()).unwrap())
            .unwrap();
        let mut config = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        let tcp = TcpStream::connect(addr).await.unwrap();
        let tls = TlsConnector::from(Arc::new(config))
            .connect(ServerName::try_from("api.test").unwrap(), tcp)
            .await
            .unwrap();
        (tls, served)
    }

    /// A guest connection to "api.test" through the interceptor (as the
    /// proxy would hand it over: the ClientHello read off first) to the
    /// upstream at `up`: the guest's request sender, what it read, and
    /// the engine's task.
    struct Guest {
        sender: SendRequest<TestBody>,
        got: Arc<Mutex<Vec<u8>>>,
        served: tokio::task::JoinHandle<Result<(), String>>,
    }

    impl Guest {
        async fn connect(w: &World, up: SocketAddr, judge: Arc<TestJudge>) -> Guest {
            let (tls, served) = guest_tls(w, up, judge).await;
            Guest::over(tls, served).await
        }

        /// A plain HTTP guest connection through [`Interceptor::serve_http`]
        /// (the proxy having read the first request's head).
        async fn connect_plain(w: &World, up: SocketAddr, judge: Arc<TestJudge>) -> Guest {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let interceptor = w.interceptor.clone();
            let served = tokio::spawn(async move {
                let (mut tcp, _) = listener.accept().await.unwrap();
                let mut head = Vec::new();
                while !contains(&head, b"\r\n\r\n") {
                    let mut buf = [0u8; 4096];
                    let n = tcp.read(&mut buf).await.unwrap();
                    assert!(n > 0, "guest closed before its request head");
                    head.extend_from_slice(&buf[..n]);
                }
                let upstream = TcpStream::connect(up).await.unwrap();
                interceptor
                    .serve_http(tcp, head, "api.test:80", upstream, judge)
                    .await
            });
            let tcp = TcpStream::connect(addr).await.unwrap();
            Guest::over(tcp, served).await
        }

        async fn over<I>(io: I, served: tokio::task::JoinHandle<Result<(), String>>) -> Guest
        where
            I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
        {
            let got = Arc::new(Mutex::new(Vec::new()));
            let tap = Tap {
                inner: io,
                got: got.clone(),
            };
            let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tap))
                .await
                .unwrap();
            tokio::spawn(async move {
                let _ = conn.with_upgrades().await;
            });
            Guest {
                sender,
                got,
                served,
            }
        }

        async fn send(
            &mut self,
            method: &str,
            path: &str,
            host: &str,
            body: TestBody,
        ) -> (u16, Bytes) {
            let req = Request::builder()
                .method(method)
                .uri(path)
                .header(header::HOST, host)
                .header(header::AUTHORIZATION, GUEST_TOKEN)
                .body(body)
                .unwrap();
            self.sender.ready().await.unwrap();
            let resp = self.sender.send_request(req).await.unwrap();
            let status = resp.status().as_u16();
            (status, resp.into_body().collect().await.unwrap().to_bytes())
        }

        /// Closes the guest's side and waits for the engine to finish
        /// (all audit records are in then).
        async fn close(self) -> Vec<u8> {
            drop(self.sender);
            let served = tokio::time::timeout(Duration::from_secs(5), self.served).await;
            served.expect("engine did not finish").unwrap().unwrap();
            std::mem::take(&mut *lock(&self.got))
        }
    }

    fn contains(hay: &[u8], needle: &[u8]) -> bool {
        hay.windows(needle.len()).any(|w| w == needle)
    }

    /// An HTTP/2 guest connection to "api.test" through the engine: its
    /// sender (cloned for each stream) and the engine's task.
    async fn h2_guest(
        w: &World,
        up: SocketAddr,
        judge: Arc<TestJudge>,
    ) -> (
        hyper::client::conn::http2::SendRequest<TestBody>,
        tokio::task::JoinHandle<Result<(), String>>,
    ) {
        let (tls, served) = guest_tls_alpn(w, up, judge, &[ALPN_H2, ALPN_HTTP11]).await;
        assert_eq!(tls.get_ref().1.alpn_protocol(), Some(ALPN_H2));
        let (sender, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
                .await
                .unwrap();
        tokio::spawn(async move {
            let _ = conn.await;
        });
        (sender, served)
    }

    /// One HTTP/2 stream: `uri` absolute (its authority is `:authority`).
    async fn h2_send(
        sender: &hyper::client::conn::http2::SendRequest<TestBody>,
        method: &str,
        uri: &str,
        extra: &[(&str, &str)],
        body: TestBody,
    ) -> (u16, Bytes) {
        let mut req = Request::builder()
            .method(method)
            .uri(uri)
            .version(http::Version::HTTP_2)
            .header(header::AUTHORIZATION, GUEST_TOKEN);
        for (n, v) in extra {
            req = req.header(*n, *v);
        }
        let mut sender = sender.clone();
        sender.ready().await.unwrap();
        let resp = sender.send_request(req.body(body).unwrap()).await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.into_body().collect().await.unwrap().to_bytes())
    }

    async fn finish(served: tokio::task::JoinHandle<Result<(), String>>) {
        tokio::time::timeout(Duration::from_secs(5), served)
            .await
            .expect("engine did not finish")
            .unwrap()
            .unwrap();
    }

    fn authorization(s: &Seen) -> Vec<&[u8]> {
        s.headers
            .iter()
            .filter(|(n, _)| n == "authorization")
            .map(|(_, v)| v.as_slice())
            .collect()
    }

    #[tokio::test]
    async fn intercept_h2_guest_streams_judged_each_over_h2_upstream() {
        let w = World::new();
        let (up, seen) = upstream_alpn(&w.upstream_ca, "api.test", &[ALPN_H2, ALPN_HTTP11]).await;
        let judge = Arc::new(TestJudge::default());
        let (sender, served) = h2_guest(&w, up, judge.clone()).await;
        // Two streams at once: the upstream answers /pair only when both
        // are in, so they share the one upstream connection concurrently.
        let started = Instant::now();
        let te = [("te", "trailers")];
        let (a, b) = tokio::join!(
            h2_send(&sender, "GET", "https://api.test/pair?a", &te, empty()),
            h2_send(&sender, "GET", "https://api.test/pair?b", &[], empty()),
        );
        assert!(started.elapsed() < Duration::from_secs(4), "not concurrent");
        assert_eq!((a.0, b.0), (200, 200));
        assert!(contains(&a.1, b"te: trailers\n"), "{:?}", a.1);
        let (status, body) = h2_send(&sender, "GET", "https://other.test/x", &[], empty()).await;
        assert_eq!(status, 421);
        assert!(contains(&body, b"api.test"));
        let (status, _) =
            h2_send(&sender, "GET", "https://api.test/forbidden/x", &[], empty()).await;
        assert_eq!(status, 403);
        // The connection goes on after both.
        let (status, _) = h2_send(&sender, "GET", "https://api.test/last", &[], empty()).await;
        assert_eq!(status, 200);
        drop(sender);
        finish(served).await;

        let seen = lock(&seen).clone();
        let mut paths: Vec<&str> = seen.iter().map(|s| s.path.as_str()).collect();
        paths.sort();
        assert_eq!(paths, ["/last", "/pair?a", "/pair?b"]);
        for s in &seen {
            assert_eq!(s.version, http::Version::HTTP_2);
            assert_eq!(authorization(s), [SECRET.as_bytes()]);
        }
        let audits = lock(&judge.audits).clone();
        let mut got: Vec<(u16, &str)> = audits.iter().map(|a| (a.status, a.verdict)).collect();
        got.sort();
        assert_eq!(
            got,
            [
                (200, "forwarded"),
                (200, "forwarded"),
                (200, "forwarded"),
                (403, "forbidden"),
                (421, "misdirected")
            ]
        );
    }

    #[tokio::test]
    async fn intercept_h2_guest_over_http11_upstream() {
        let w = World::new();
        let (up, seen) = upstream(&w.upstream_ca, "api.test").await;
        let judge = Arc::new(TestJudge::default());
        let (sender, served) = h2_guest(&w, up, judge.clone()).await;
        let cookies = [("cookie", "a=1"), ("cookie", "b=2"), ("te", "trailers")];
        let (a, b) = tokio::join!(
            h2_send(&sender, "GET", "https://api.test/one", &cookies, empty()),
            h2_send(
                &sender,
                "POST",
                "https://api.test/two",
                &[],
                Full::new(Bytes::from_static(b"hello")).boxed()
            ),
        );
        assert_eq!((a.0, b.0), (200, 200));
        // Host from :authority, the cookies joined, no TE on HTTP/1.1.
        assert!(contains(&a.1, b"host: api.test\n"), "{:?}", a.1);
        assert!(contains(&a.1, b"cookie: a=1; b=2\n"), "{:?}", a.1);
        assert!(!contains(&a.1, b"te:"), "{:?}", a.1);
        assert!(contains(&b.1, b"body-bytes: 5\n"), "{:?}", b.1);
        let (status, _) = h2_send(&sender, "GET", "https://other.test/x", &[], empty()).await;
        assert_eq!(status, 421);
        // Gone: 403, and the engine ends the connection (GOAWAY) though
        // the guest keeps its side open.
        let (status, _) = h2_send(&sender, "GET", "https://api.test/gone", &[], empty()).await;
        assert_eq!(status, 403);
        finish(served).await;
        drop(sender);
        let seen = lock(&seen).clone();
        assert_eq!(seen.len(), 2);
        for s in &seen {
            assert_eq!(s.version, http::Version::HTTP_11);
            assert_eq!(authorization(s), [SECRET.as_bytes()]);
        }
        assert_eq!(lock(&judge.audits).len(), 4);
    }

    fn websocket_request(path: &str) -> Request<TestBody> {
        Request::builder()
            .method("GET")
            .uri(path)
            .header(header::HOST, "api.test")
            .header(header::AUTHORIZATION, GUEST_TOKEN)
            .header(header::UPGRADE, "websocket")
            .header(header::CONNECTION, "Upgrade")
            .header("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==")
            .header("sec-websocket-version", "13")
            .body(empty())
            .unwrap()
    }

    #[tokio::test]
    async fn intercept_websocket_upgrade_after_the_verdict() {
        let w = World::new();
        let (up, seen) = upstream(&w.upstream_ca, "api.test").await;
        let judge = Arc::new(TestJudge::default());
        let mut g = Guest::connect(&w, up, judge.clone()).await;
        // Forbidden: 403, no switch.
        g.sender.ready().await.unwrap();
        let resp = g
            .sender
            .send_request(websocket_request("/forbidden/ws"))
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::FORBIDDEN);
        resp.into_body().collect().await.unwrap();
        // Other upgrades: 501.
        let mut h2c = websocket_request("/ws");
        h2c.headers_mut()
            .insert(header::UPGRADE, HeaderValue::from_static("h2c"));
        g.sender.ready().await.unwrap();
        let resp = g.sender.send_request(h2c).await.unwrap();
        assert_eq!(resp.status(), StatusCode::NOT_IMPLEMENTED);
        drop(resp);
        let mut g = Guest::connect(&w, up, judge.clone()).await;
        g.sender.ready().await.unwrap();
        let resp = g
            .sender
            .send_request(websocket_request("/ws"))
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::SWITCHING_PROTOCOLS);
        assert_eq!(
            resp.headers().get("sec-websocket-accept").unwrap(),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
        let mut io = TokioIo::new(hyper::upgrade::on(resp).await.unwrap());
        for msg in [&b"ping over the tunnel"[..], b"and again"] {
            io.write_all(msg).await.unwrap();
            let mut back = vec![0u8; msg.len()];
            io.read_exact(&mut back).await.unwrap();
            assert_eq!(back, msg);
        }
        drop(io);
        g.close().await;

        let seen = lock(&seen).clone();
        assert_eq!(seen.len(), 1, "neither the 403 nor the 501 went upstream");
        assert_eq!(seen[0].path, "/ws");
        assert_eq!(authorization(&seen[0]), [SECRET.as_bytes()]);
        assert!(
            seen[0]
                .headers
                .contains(&("upgrade".into(), b"websocket".to_vec()))
        );
        let audits = lock(&judge.audits).clone();
        let got: Vec<(u16, &str, u64, u64)> = audits
            .iter()
            .filter(|a| a.status != 501)
            .map(|a| (a.status, a.verdict, a.bytes_up, a.bytes_down))
            .collect();
        let n = (b"ping over the tunnel".len() + b"and again".len()) as u64;
        assert_eq!(
            got,
            [(403, "forbidden", 0, got[0].3), (101, "forwarded", n, n)]
        );
    }

    #[tokio::test]
    async fn intercept_injects_header_and_keeps_secret_from_guest() {
        let w = World::new();
        let (up, seen) = upstream(&w.upstream_ca, "api.test").await;
        let judge = Arc::new(TestJudge::default());
        let mut g = Guest::connect(&w, up, judge.clone()).await;
        let (status, body) = g.send("GET", "/echo?x=1", "api.test", empty()).await;
        assert_eq!(status, 200);
        assert!(contains(&body, b"host: api.test\n"), "{body:?}");
        let got = g.close().await;

        let seen = lock(&seen).clone();
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].path, "/echo?x=1");
        let auth: Vec<&Vec<u8>> = seen[0]
            .headers
            .iter()
            .filter(|(n, _)| n == "authorization")
            .map(|(_, v)| v)
            .collect();
        assert_eq!(
            auth,
            [&SECRET.as_bytes().to_vec()],
            "the upstream sees the rule's value only"
        );
        assert!(!got.is_empty());
        assert!(
            !contains(&got, SECRET.as_bytes()),
            "the secret reached the guest"
        );
        assert!(!contains(&got, b"s3cr3t"));
    }

    #[tokio::test]
    async fn intercept_plain_http_injects_and_checks_host() {
        let w = World::new();
        let (up, seen) = start_upstream(None).await;
        let judge = Arc::new(TestJudge::default());
        let mut g = Guest::connect_plain(&w, up, judge.clone()).await;
        assert_eq!(g.send("GET", "/echo", "api.test", empty()).await.0, 200);
        assert_eq!(g.send("GET", "/echo", "other.test", empty()).await.0, 421);
        assert_eq!(
            g.send("GET", "/forbidden", "api.test", empty()).await.0,
            403
        );
        let got = g.close().await;
        let seen = lock(&seen).clone();
        assert_eq!(seen.len(), 1);
        assert!(
            seen[0]
                .headers
                .contains(&("authorization".into(), SECRET.as_bytes().to_vec()))
        );
        assert!(!contains(&got, SECRET.as_bytes()));
    }

    #[tokio::test]
    async fn intercept_expect_100_continue() {
        let w = World::new();
        let (up, seen) = upstream(&w.upstream_ca, "api.test").await;
        let judge = Arc::new(TestJudge::default());
        let (mut tls, served) = guest_tls(&w, up, judge.clone()).await;
        tls.write_all(
            b"POST /upload HTTP/1.1\r\nHost: api.test\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n",
        )
        .await
        .unwrap();
        // The body only after the 100.
        let mut got = Vec::new();
        while !contains(&got, b"\r\n\r\n") {
            let mut buf = [0u8; 1024];
            let n = tls.read(&mut buf).await.unwrap();
            assert!(n > 0);
            got.extend_from_slice(&buf[..n]);
        }
        assert!(
            got.starts_with(b"HTTP/1.1 100 Continue\r\n"),
            "{:?}",
            String::from_utf8_lossy(&got)
        );
        tls.write_all(b"hello").await.unwrap();
        let mut got = Vec::new();
        while !contains(&got, b"body-bytes: 5\n") {
            let mut buf = [0u8; 4096];
            let n = tls.read(&mut buf).await.unwrap();
            assert!(n > 0, "{:?}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
        assert!(got.starts_with(b"HTTP/1.1 200 OK\r\n"));
        drop(tls);
        tokio::time::timeout(Duration::from_secs(5), served)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(lock(&seen).len(), 1);
        assert_eq!(lock(&judge.audits)[0].bytes_up, 5);
    }

    #[tokio::test]
    async fn intercept_misdirected_host_on_kept_alive_connection() {
        let w = World::new();
        let (up, seen) = upstream(&w.upstream_ca, "api.test").await;
        let judge = Arc::new(TestJudge::default());
        let mut g = Guest::connect(&w, up, judge.clone()).await;
        let (status, _) = g.send("GET", "/one", "API.test:443", empty()).await;
        assert_eq!(status, 200);
        let (status, body) = g.send("GET", "/two", "other.test", empty()).await;
        assert_eq!(status, 421);
        assert!(contains(&body, b"api.test"));
        // The connection goes on for requests that name the right host.
        let (status, _) = g.send("GET", "/three", "api.test", empty()).await;
        assert_eq!(status, 200);
        g.close().await;
        let paths: Vec<String> = lock(&seen).iter().map(|s| s.path.clone()).collect();
        assert_eq!(paths, ["/one", "/three"]);
    }

    #[tokio::test]
    async fn intercept_forbid_and_gone_answer_403_without_upstream() {
        let w = World::new();
        let (up, seen) = upstream(&w.upstream_ca, "api.test").await;
        let judge = Arc::new(TestJudge::default());
        let mut g = Guest::connect(&w, up, judge.clone()).await;
        let (status, body) = g.send("DELETE", "/forbidden/x", "api.test", empty()).await;
        assert_eq!(status, 403);
        assert!(
            contains(&body, b"*.test") && contains(&body, b"path not allowed"),
            "{body:?}"
        );
        let (status, _) = g.send("GET", "/gone", "api.test", empty()).await;
        assert_eq!(status, 403);
        // Gone closes the connection.
        assert!(g.sender.ready().await.is_err());
        g.close().await;
        assert!(lock(&seen).is_empty());
    }

    #[tokio::test]
    async fn intercept_upstream_closing_closes_the_guest_connection() {
        let w = World::new();
        let (up, seen) = upstream(&w.upstream_ca, "api.test").await;
        let judge = Arc::new(TestJudge::default());
        let mut g = Guest::connect(&w, up, judge.clone()).await;
        assert_eq!(g.send("GET", "/close", "api.test", empty()).await.0, 200);
        assert!(
            g.sender.ready().await.is_err(),
            "the guest's connection is closed too"
        );
        g.close().await;
        assert_eq!(lock(&seen).len(), 1);
    }

    #[tokio::test]
    async fn intercept_upstream_certificate_for_another_name_is_502() {
        let w = World::new();
        let (up, seen) = upstream(&w.upstream_ca, "other.test").await;
        let judge = Arc::new(TestJudge::default());
        let mut g = Guest::connect(&w, up, judge.clone()).await;
        for _ in 0..2 {
            let (status, body) = g.send("GET", "/x", "api.test", empty()).await;
            assert_eq!(status, 502);
            assert!(
                contains(&body, b"upstream certificate for api.test not trusted"),
                "{body:?}"
            );
        }
        g.close().await;
        assert!(lock(&seen).is_empty());
        let audits = lock(&judge.audits).clone();
        assert_eq!(audits.len(), 2);
        assert!(
            audits
                .iter()
                .all(|a| a.verdict == "upstream_failed" && a.status == 502)
        );
    }

    #[tokio::test]
    async fn intercept_streams_large_bodies_and_counts_them() {
        let w = World::new();
        let (up, _seen) = upstream(&w.upstream_ca, "api.test").await;
        let judge = Arc::new(TestJudge::default());
        let mut g = Guest::connect(&w, up, judge.clone()).await;
        let (status, body) = g.send("POST", "/upload", "api.test", big_body()).await;
        assert_eq!(status, 200);
        assert!(
            contains(&body, format!("body-bytes: {BIG}\n").as_bytes()),
            "{body:?}"
        );
        let (status, body) = g.send("GET", "/big", "api.test", empty()).await;
        assert_eq!(status, 200);
        assert_eq!(body.len(), BIG);
        assert!(
            body.chunks(CHUNK)
                .enumerate()
                .all(|(i, c)| c.iter().all(|&b| b == i as u8))
        );
        g.close().await;
        let audits = lock(&judge.audits).clone();
        assert_eq!(audits.len(), 2);
        assert_eq!(
            (audits[0].bytes_up, audits[0].bytes_down),
            (BIG as u64, body_len_of_echo(&audits[0]))
        );
        assert_eq!((audits[1].bytes_up, audits[1].bytes_down), (0, BIG as u64));
    }

    /// The echo's size for the upload request is whatever it was; only
    /// checks it is small and non-zero.
    fn body_len_of_echo(a: &AuditRecord) -> u64 {
        assert!(a.bytes_down > 0 && a.bytes_down < 4096);
        a.bytes_down
    }

    #[tokio::test]
    async fn intercept_audits_each_request() {
        let w = World::new();
        let (up, _seen) = upstream(&w.upstream_ca, "api.test").await;
        let judge = Arc::new(TestJudge::default());
        let mut g = Guest::connect(&w, up, judge.clone()).await;
        assert_eq!(
            g.send("GET", "/a/b?q=secret-query", "api.test", empty())
                .await
                .0,
            200
        );
        assert_eq!(
            g.send("PUT", "/forbidden/c?x=1", "api.test", empty())
                .await
                .0,
            403
        );
        assert_eq!(g.send("GET", "/d", "evil.test", empty()).await.0, 421);
        assert_eq!(
            g.send("GET", "/a/../forbidden", "api.test", empty())
                .await
                .0,
            400
        );
        g.close().await;
        let audits = lock(&judge.audits).clone();
        let got: Vec<(&str, &str, &str, u16, &str, &str)> = audits
            .iter()
            .map(|a| {
                (
                    a.method.as_str(),
                    a.host.as_str(),
                    a.path.as_str(),
                    a.status,
                    a.verdict,
                    a.rule_host.as_str(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("GET", "api.test", "/a/b", 200, "forwarded", "api.test"),
                (
                    "PUT",
                    "api.test",
                    "/forbidden/c",
                    403,
                    "forbidden",
                    "*.test"
                ),
                ("GET", "api.test", "/d", 421, "misdirected", ""),
                ("GET", "api.test", "/a/../forbidden", 400, "forbidden", ""),
            ]
        );
    }

    #[test]
    fn node_ca_created_then_loaded_and_key_mode_enforced() {
        let dir = temp_dir("ca");
        let ca = NodeCa::load_or_create(&dir).unwrap();
        let key_path = dir.join(CA_KEY_FILE);
        let cert_path = dir.join(CA_CERT_FILE);
        assert_eq!(fs::metadata(&key_path).unwrap().mode() & 0o777, 0o600);
        assert_eq!(fs::metadata(&cert_path).unwrap().mode() & 0o777, 0o644);
        assert!(ca.cert_pem().starts_with("-----BEGIN CERTIFICATE-----"));
        let again = NodeCa::load_or_create(&dir).unwrap();
        assert_eq!(again.cert_pem(), ca.cert_pem());
        // The loaded CA's leaves name it as it names itself.
        again.self_check().unwrap();

        fs::set_permissions(&key_path, fs::Permissions::from_mode(0o644)).unwrap();
        let err = NodeCa::load_or_create(&dir).err().unwrap();
        assert!(err.contains("mode 0644"), "{err}");
        fs::set_permissions(&key_path, fs::Permissions::from_mode(0o600)).unwrap();

        // Another CA's certificate beside this key.
        let other = temp_dir("ca-other");
        let other_ca = NodeCa::load_or_create(&other).unwrap();
        fs::write(&cert_path, other_ca.cert_pem()).unwrap();
        let err = NodeCa::load_or_create(&dir).err().unwrap();
        assert!(err.contains("does not match the key"), "{err}");

        // A key without its certificate (a first start cut short) gets one.
        fs::remove_file(&cert_path).unwrap();
        let remade = NodeCa::load_or_create(&dir).unwrap();
        assert_ne!(remade.cert_pem(), ca.cert_pem());
        assert_eq!(
            NodeCa::load_or_create(&dir).unwrap().cert_pem(),
            remade.cert_pem()
        );

        // A certificate without its key is refused.
        fs::remove_file(&key_path).unwrap();
        assert!(NodeCa::load_or_create(&dir).is_err());
        let _ = fs::remove_dir_all(&dir);
        let _ = fs::remove_dir_all(&other);
    }

    #[test]
    fn leaf_cache_reuses_renews_and_bounds() {
        let dir = temp_dir("leaf");
        let ca = NodeCa::load_or_create(&dir).unwrap();
        let now = SystemTime::now();
        let (a, not_after) = ca.issue("a.test", now).unwrap();
        let mut cache = LeafCache::default();
        cache.put("a.test", a.clone(), not_after, "");
        assert!(Arc::ptr_eq(&cache.get("a.test", now).unwrap(), &a));
        // Less than a day left: made again.
        assert!(
            cache
                .get("a.test", now + LEAF_VALIDITY - LEAF_RENEW / 2)
                .is_none()
        );
        // Many owners, a leaf each: the cache holds LEAF_CACHE, the least
        // recently used of all went.
        for i in 0..LEAF_CACHE + 10 {
            cache.put(
                &format!("n{i}.test"),
                a.clone(),
                not_after,
                &format!("sb{i}"),
            );
        }
        assert_eq!(cache.map.len(), LEAF_CACHE);
        assert!(
            cache.get("n0.test", now).is_none(),
            "the least recently used went"
        );
        // One sandbox naming 10,000 hosts while another works: the flooder
        // churns its own share; the other's leaf stays.
        let mut cache = LeafCache::default();
        cache.put("quiet.test", a.clone(), not_after, "quiet");
        for i in 0..10_000 {
            cache.put(&format!("h{i}.flood.test"), a.clone(), not_after, "flood");
        }
        assert!(cache.get("quiet.test", now).is_some());
        assert_eq!(cache.owned["flood"], LEAF_SHARE);
        assert_eq!(cache.map.len(), LEAF_SHARE + 1);
        assert!(cache.get("h9999.flood.test", now).is_some());
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn hosts_ports_and_dot_segments() {
        assert_eq!(strip_port("api.test:443"), "api.test");
        assert_eq!(strip_port("api.test"), "api.test");
        assert_eq!(strip_port("[::1]:80"), "[::1]");
        for p in [
            "/a/../b",
            "/a/%2e%2E/b",
            "/a/.",
            "/a\\..\\b",
            "/a%2f..%2fb",
            "/./x",
        ] {
            assert!(has_dot_segment(p), "{p}");
        }
        for p in ["/a/b", "/a..b/c", "/.well-known/x", "/a%2fb"] {
            assert!(!has_dot_segment(p), "{p}");
        }
    }
}
