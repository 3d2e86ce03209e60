//! A small async etcd v3 client over etcd's JSON gRPC-gateway (HTTP/1.1), so the control
//! plane needs no gRPC/protoc toolchain.
//!
//! Keys and values travel base64-encoded; int64 fields come back as JSON strings. Every
//! unary call opens its own connection (control-plane traffic is light) and is bounded by
//! the per-request timeout. On a connection failure the next endpoint is tried; once a
//! request has been sent it is never re-sent elsewhere, so a transaction cannot apply twice.
//!
//! Security ([`Etcd::with_security`], [`EtcdSecurity`]):
//! * `https://` endpoints use TLS (rustls, built once per client) with the configured CA
//!   only, checking etcd's certificate against the endpoint's host (a name or an IP
//!   address), and present a client certificate for etcd's `--client-cert-auth`.
//! * A username and password log in to etcd's authentication; the token is renewed when etcd
//!   refuses it, and only those refusals re-send a request (see `auth.rs` for why that is
//!   safe). With auth enabled, etcd's gateway refuses client certificates that carry a
//!   CommonName: the user comes from the password, not from the certificate.

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};
use serde_json::{json, Value};
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio_rustls::TlsConnector;

mod auth;
mod maintenance;
mod security;

use auth::{Credentials, Token};
pub use maintenance::{Alarm, AlarmKind, MemberStatus, DEFRAGMENT_TIMEOUT};
pub use security::{EtcdSecurity, PemRole, SecurityError, TlsFailure};

/// Default bound on one request (connect + answer).
pub const DEFAULT_REQUEST_TIMEOUT_MS: u64 = 5_000;
/// Largest unary answer accepted from etcd, bytes (etcd's own default request limit is 1.5 MiB;
/// a prefix range over many slabs can be larger).
pub const RESPONSE_BYTES_MAX: usize = 256 << 20;
/// Largest single watch message buffered, bytes.
pub const WATCH_MESSAGE_BYTES_MAX: usize = 64 << 20;

/// An etcd lease id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub i64);

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// What went wrong talking to etcd.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    #[error("no etcd endpoints given: pass at least one, e.g. http://127.0.0.1:2379")]
    NoEndpoints,
    #[error(
        "etcd endpoint {endpoint:?} is invalid: {reason}; use the form http://HOST:PORT or \
         https://HOST:PORT"
    )]
    InvalidEndpoint { endpoint: String, reason: String },
    #[error(transparent)]
    Security(#[from] SecurityError),
    #[error("etcd at {endpoint} {failure}")]
    Tls {
        endpoint: String,
        failure: TlsFailure,
    },
    #[error(
        "etcd at {endpoint} closed the connection without answering {path}; if etcd serves \
         TLS on this port, use an https:// endpoint and give its CA; over https, etcd does \
         this to a client certificate its revocation list names (a removed node's, or one \
         revoked with `converge cert revoke`); else check etcd's health"
    )]
    ClosedWithoutAnswer { endpoint: String, path: String },
    #[error("etcd at {endpoint} refused to log in user {user:?}: {message}; check the username and password")]
    AuthFailed {
        endpoint: String,
        user: String,
        message: String,
    },
    #[error(
        "etcd at {endpoint} requires authentication for {path} ({message}); give a username \
         and password"
    )]
    AuthRequired {
        endpoint: String,
        path: String,
        message: String,
    },
    #[error(
        "etcd at {endpoint} refused {path}: with authentication enabled, etcd's gateway refuses \
         client certificates that carry a CommonName (etcd said: {message}); use a client \
         certificate without a CN, and log in with a username and password"
    )]
    ClientCertificateHasCommonName {
        endpoint: String,
        path: String,
        message: String,
    },
    #[error("etcd at {endpoint} is unreachable: {reason}; is etcd running?")]
    Unreachable { endpoint: String, reason: String },
    #[error(
        "etcd at {endpoint} did not answer {path} within {timeout_ms} ms; \
         is etcd overloaded, or is the network partitioned?"
    )]
    Timeout {
        endpoint: String,
        path: String,
        timeout_ms: u64,
    },
    #[error("etcd at {endpoint} dropped the connection during {path}: {reason}; retry, and check etcd's health")]
    ConnectionLost {
        endpoint: String,
        path: String,
        reason: String,
    },
    #[error(
        "etcd at {endpoint} refused {path}: its database reached its space quota (NOSPACE \
         alarm), so it takes no writes until old revisions are compacted, the members are \
         defragmented and the alarm is disarmed (converged's leader does this by itself once \
         it can; docs/OPERATIONS.md, \"etcd out of space\")"
    )]
    NoSpace { endpoint: String, path: String },
    #[error("etcd at {endpoint} refused {path} (HTTP {status}): {message}")]
    Server {
        endpoint: String,
        path: String,
        status: u16,
        message: String,
    },
    #[error(
        "etcd at {endpoint} sent an unreadable answer to {path}: {reason}; \
         is this an etcd v3.4+ client endpoint?"
    )]
    BadResponse {
        endpoint: String,
        path: String,
        reason: String,
    },
    #[error(
        "watch on {prefix:?} can no longer be resumed: etcd compacted history up to revision \
         {compact_revision}; reload with a fresh read and watch again from its revision"
    )]
    WatchCompacted {
        prefix: String,
        compact_revision: i64,
    },
    #[error("watch on {prefix:?} at {endpoint} ended: {reason}; reload and watch again")]
    WatchClosed {
        endpoint: String,
        prefix: String,
        reason: String,
    },
}

/// One key as stored in etcd.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyValue {
    pub key: String,
    pub value: Vec<u8>,
    pub create_revision: i64,
    pub mod_revision: i64,
    /// Lease the key is bound to; 0 if none.
    pub lease: i64,
}

/// A condition of a transaction; all compare with "equal".
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Compare {
    /// The key's last modification revision equals this (0: the key is absent).
    ModRevision(String, i64),
    /// The key's creation revision equals this (0: the key is absent).
    CreateRevision(String, i64),
    /// The key exists and holds exactly these bytes.
    Value(String, Vec<u8>),
}

/// An operation of a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    Put(String, Vec<u8>, Option<LeaseId>),
    Delete(String),
    /// Deletes every key that starts with this prefix.
    DeletePrefix(String),
    /// Reads one key; its result lands in [`TxnResponse::gets`].
    Get(String),
}

/// An etcd transaction: if all `compare` hold, run `success`, else run `failure`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Txn {
    pub compare: Vec<Compare>,
    pub success: Vec<Op>,
    pub failure: Vec<Op>,
}

/// Outcome of a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TxnResponse {
    pub succeeded: bool,
    /// Store revision after the transaction.
    pub revision: i64,
    /// One entry per [`Op::Get`] of the branch that ran, in order.
    pub gets: Vec<Option<KeyValue>>,
}

/// Kind of change a watch reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    Put,
    Delete,
}

/// One change seen by a watch. For a delete, `kv` carries the key and `mod_revision` only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchEvent {
    pub kind: EventKind,
    pub kv: KeyValue,
}

#[derive(Clone, Debug)]
struct Endpoint {
    url: String,
    /// host:port to connect to and to send as Host.
    authority: String,
    /// The host alone (no brackets around an IPv6 address): what etcd's certificate must name.
    host: String,
    /// `https://`: TLS, and the name to check etcd's certificate against.
    tls_name: Option<ServerName<'static>>,
}

struct Inner {
    endpoints: Vec<Endpoint>,
    /// Index of the endpoint that answered last; tried first.
    preferred: AtomicUsize,
    timeout: Duration,
    /// For `https://` endpoints; built once per client.
    tls: Option<TlsConnector>,
    /// A client certificate is configured (tells "etcd needs one" from "etcd refused ours").
    presents_client_cert: bool,
    /// etcd user and token, shared with clones made by [`Etcd::with_timeout`].
    credentials: Option<Arc<Credentials>>,
}

impl fmt::Debug for Inner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inner")
            .field("endpoints", &self.endpoints)
            .field("timeout", &self.timeout)
            .field("tls", &self.tls.is_some())
            .field("presents_client_cert", &self.presents_client_cert)
            .field("user", &self.credentials.as_ref().map(|c| c.user.as_str()))
            .finish()
    }
}

/// A connection to one endpoint, before HTTP.
enum Conn {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

/// Why one endpoint could not be connected to.
enum ConnectFailure {
    Unreachable(String),
    Tls(TlsFailure),
}

/// Starts HTTP/1.1 on a connection; the returned guard ends the connection's driver.
async fn http1<I>(
    io: I,
) -> Result<
    (
        hyper::client::conn::http1::SendRequest<Full<Bytes>>,
        AbortOnDrop,
    ),
    hyper::Error,
>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (sender, conn) = hyper::client::conn::http1::handshake(io).await?;
    let guard = AbortOnDrop(tokio::spawn(async move {
        match conn.await {
            Ok(()) => None,
            Err(e) => {
                log::debug!("etcd connection ended: {e}");
                Some(e)
            }
        }
    }));
    Ok((sender, guard))
}

/// Async etcd v3 client. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Etcd {
    inner: Arc<Inner>,
}

/// Aborts a spawned connection driver when the request or watch using it ends.
struct AbortOnDrop(JoinHandle<Option<hyper::Error>>);

impl AbortOnDrop {
    /// Why the connection's driver stopped, once it has: a request that failed because the
    /// connection went away reports only "canceled"; the driver knows the cause (a TLS alert
    /// from etcd, say). Bounded, since the driver ends right after the connection does.
    async fn ended_with(&mut self) -> Option<hyper::Error> {
        tokio::time::timeout(Duration::from_secs(1), &mut self.0)
            .await
            .ok()
            .and_then(|r| r.ok())
            .flatten()
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn parse_endpoint(raw: &str) -> Result<Endpoint, EtcdError> {
    let invalid = |reason: &str| EtcdError::InvalidEndpoint {
        endpoint: raw.to_string(),
        reason: reason.to_string(),
    };
    let s = raw.trim();
    let (tls, rest) = if let Some(r) = s.strip_prefix("http://") {
        (false, r)
    } else if let Some(r) = s.strip_prefix("https://") {
        (true, r)
    } else if s.contains("://") {
        return Err(invalid("only the http and https schemes are supported"));
    } else {
        (false, s)
    };
    let rest = rest.trim_end_matches('/');
    if rest.is_empty() {
        return Err(invalid("no host given"));
    }
    if rest.contains('/') {
        return Err(invalid("an endpoint has no path"));
    }
    // Without a port, etcd's default client port.
    let has_port = match rest.rfind(':') {
        Some(i) => !rest[..i].is_empty() && !rest.ends_with(']'),
        None => false,
    };
    let authority = if has_port {
        let port = &rest[rest.rfind(':').map_or(0, |i| i + 1)..];
        if port.parse::<u16>().is_err() {
            return Err(invalid("the port is not a number from 1 to 65535"));
        }
        rest.to_string()
    } else {
        format!("{rest}:2379")
    };
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default().to_string(),
        None => authority
            .rsplit_once(':')
            .map_or(authority.as_str(), |(h, _)| h)
            .to_string(),
    };
    let tls_name = if tls {
        Some(
            ServerName::try_from(host.clone())
                .map_err(|e| invalid(&format!("{host:?} is not a valid TLS server name: {e}")))?,
        )
    } else {
        None
    };
    Ok(Endpoint {
        url: format!("{}://{authority}", if tls { "https" } else { "http" }),
        authority,
        host,
        tls_name,
    })
}

/// The smallest key greater than every key with this prefix (etcd's `range_end` for a prefix).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // All 0xff (or empty): everything from the key on.
    vec![0]
}

fn b64(bytes: &[u8]) -> String {
    B64.encode(bytes)
}

/// int64 fields arrive as JSON strings (proto3 JSON); accept numbers too.
fn de_i64<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Num {
        S(String),
        I(i64),
    }
    match Option::<Num>::deserialize(d)? {
        None => Ok(0),
        Some(Num::I(i)) => Ok(i),
        Some(Num::S(s)) => s.parse().map_err(serde::de::Error::custom),
    }
}

#[derive(Deserialize, Default, Debug)]
struct RawHeader {
    #[serde(default, deserialize_with = "de_i64")]
    revision: i64,
}

#[derive(Deserialize, Default, Debug)]
struct RawKv {
    #[serde(default)]
    key: String,
    #[serde(default)]
    value: String,
    #[serde(default, deserialize_with = "de_i64")]
    create_revision: i64,
    #[serde(default, deserialize_with = "de_i64")]
    mod_revision: i64,
    #[serde(default, deserialize_with = "de_i64")]
    lease: i64,
}

impl RawKv {
    fn decode(self) -> Result<KeyValue, String> {
        let key = B64
            .decode(&self.key)
            .map_err(|e| format!("key is not base64: {e}"))?;
        let key = String::from_utf8(key).map_err(|_| "key is not UTF-8".to_string())?;
        let value = B64
            .decode(&self.value)
            .map_err(|e| format!("value of {key:?} is not base64: {e}"))?;
        Ok(KeyValue {
            key,
            value,
            create_revision: self.create_revision,
            mod_revision: self.mod_revision,
            lease: self.lease,
        })
    }
}

#[derive(Deserialize, Default, Debug)]
struct RangeResp {
    #[serde(default)]
    header: RawHeader,
    #[serde(default)]
    kvs: Vec<RawKv>,
}

#[derive(Deserialize, Default, Debug)]
struct PutResp {
    #[serde(default)]
    header: RawHeader,
}

#[derive(Deserialize, Default, Debug)]
struct DeleteResp {
    #[serde(default, deserialize_with = "de_i64")]
    deleted: i64,
}

#[derive(Deserialize, Default, Debug)]
struct RawTxnItem {
    #[serde(default)]
    response_range: Option<RangeResp>,
}

#[derive(Deserialize, Default, Debug)]
struct RawTxnResp {
    #[serde(default)]
    header: RawHeader,
    #[serde(default)]
    succeeded: bool,
    #[serde(default)]
    responses: Vec<RawTxnItem>,
}

#[derive(Deserialize, Default, Debug)]
struct LeaseResp {
    #[serde(rename = "ID", default, deserialize_with = "de_i64")]
    id: i64,
    #[serde(rename = "TTL", default, deserialize_with = "de_i64")]
    ttl: i64,
    #[serde(default)]
    error: String,
}

#[derive(Deserialize, Debug)]
struct StreamMsg<T> {
    #[serde(default)]
    result: Option<T>,
    #[serde(default)]
    error: Option<Value>,
}

#[derive(Deserialize, Default, Debug)]
struct RawEvent {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    kv: RawKv,
}

#[derive(Deserialize, Default, Debug)]
struct RawWatchResp {
    #[serde(default)]
    header: RawHeader,
    #[serde(default)]
    created: bool,
    #[serde(default)]
    canceled: bool,
    #[serde(default, deserialize_with = "de_i64")]
    compact_revision: i64,
    #[serde(default)]
    cancel_reason: String,
    #[serde(default)]
    events: Vec<RawEvent>,
}

fn compare_json(c: &Compare) -> Value {
    match c {
        Compare::ModRevision(k, r) => json!({
            "key": b64(k.as_bytes()), "result": "EQUAL", "target": "MOD", "mod_revision": r.to_string()
        }),
        Compare::CreateRevision(k, r) => json!({
            "key": b64(k.as_bytes()), "result": "EQUAL", "target": "CREATE", "create_revision": r.to_string()
        }),
        Compare::Value(k, v) => json!({
            "key": b64(k.as_bytes()), "result": "EQUAL", "target": "VALUE", "value": b64(v)
        }),
    }
}

fn put_json(key: &str, value: &[u8], lease: Option<LeaseId>) -> Value {
    let mut v = json!({ "key": b64(key.as_bytes()), "value": b64(value) });
    if let Some(l) = lease {
        v["lease"] = Value::String(l.0.to_string());
    }
    v
}

fn op_json(op: &Op) -> Value {
    match op {
        Op::Put(k, v, l) => json!({ "request_put": put_json(k, v, *l) }),
        Op::Delete(k) => json!({ "request_delete_range": { "key": b64(k.as_bytes()) } }),
        Op::DeletePrefix(p) => json!({ "request_delete_range": {
            "key": b64(p.as_bytes()), "range_end": b64(&prefix_end(p.as_bytes()))
        }}),
        Op::Get(k) => json!({ "request_range": { "key": b64(k.as_bytes()) } }),
    }
}

/// Pulls the first complete JSON value off `buf`; `Ok(None)` if more bytes are needed.
fn take_json<T: DeserializeOwned>(buf: &mut Vec<u8>) -> Result<Option<T>, serde_json::Error> {
    let start = buf
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(buf.len());
    if start == buf.len() {
        buf.clear();
        return Ok(None);
    }
    let mut it = serde_json::Deserializer::from_slice(&buf[start..]).into_iter::<T>();
    match it.next() {
        None => Ok(None),
        Some(Ok(v)) => {
            let used = start + it.byte_offset();
            buf.drain(..used);
            Ok(Some(v))
        }
        Some(Err(e)) if e.is_eof() => Ok(None),
        Some(Err(e)) => Err(e),
    }
}

impl Etcd {
    /// A client for these endpoints (`http://HOST:PORT`), with the default request timeout.
    /// For `https://` endpoints or etcd users, see [`Etcd::with_security`].
    pub fn new(endpoints: Vec<String>) -> Result<Etcd, EtcdError> {
        Etcd::with_security(endpoints, EtcdSecurity::default())
    }

    /// A client for these endpoints with TLS and/or etcd authentication, with the default
    /// request timeout. All endpoints are `https://` (TLS, which needs `security.ca_pem`) or
    /// all are `http://`; TLS settings with http endpoints are refused rather than ignored.
    pub fn with_security(
        endpoints: Vec<String>,
        security: EtcdSecurity,
    ) -> Result<Etcd, EtcdError> {
        if endpoints.is_empty() {
            return Err(EtcdError::NoEndpoints);
        }
        let endpoints = endpoints
            .iter()
            .map(|e| parse_endpoint(e))
            .collect::<Result<Vec<_>, _>>()?;
        let https = endpoints.iter().find(|e| e.tls_name.is_some());
        let http = endpoints.iter().find(|e| e.tls_name.is_none());
        let tls = match (https, http) {
            (Some(s), Some(p)) => {
                return Err(SecurityError::MixedSchemes {
                    http: p.url.clone(),
                    https: s.url.clone(),
                }
                .into())
            }
            (Some(s), None) => Some(TlsConnector::from(security.client_config(&s.url)?)),
            (None, _) if security.has_tls_settings() => {
                return Err(SecurityError::TlsSettingsWithoutHttps {
                    endpoints: endpoints
                        .iter()
                        .map(|e| e.url.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                }
                .into())
            }
            (None, _) => None,
        };
        let credentials = security
            .user()?
            .map(|(user, password)| Arc::new(Credentials::new(user, password)));
        if let (Some(c), None) = (&credentials, &tls) {
            log::warn!(
                "etcd user {:?} logs in over plain http: the password crosses the network \
                 unencrypted; use https:// endpoints",
                c.user
            );
        }
        Ok(Etcd {
            inner: Arc::new(Inner {
                endpoints,
                preferred: AtomicUsize::new(0),
                timeout: Duration::from_millis(DEFAULT_REQUEST_TIMEOUT_MS),
                presents_client_cert: tls.is_some() && security.client_cert_pem.is_some(),
                tls,
                credentials,
            }),
        })
    }

    /// The same endpoints, TLS settings and user with another per-request timeout.
    pub fn with_timeout(&self, timeout: Duration) -> Etcd {
        Etcd {
            inner: Arc::new(Inner {
                endpoints: self.inner.endpoints.clone(),
                preferred: AtomicUsize::new(self.inner.preferred.load(Ordering::Relaxed)),
                timeout,
                tls: self.inner.tls.clone(),
                presents_client_cert: self.inner.presents_client_cert,
                credentials: self.inner.credentials.clone(),
            }),
        }
    }

    /// The endpoints, normalised to `http://HOST:PORT` or `https://HOST:PORT`.
    pub fn endpoints(&self) -> Vec<String> {
        self.inner.endpoints.iter().map(|e| e.url.clone()).collect()
    }

    fn timeout_ms(&self) -> u64 {
        u64::try_from(self.inner.timeout.as_millis()).unwrap_or(u64::MAX)
    }

    /// TCP, then TLS for an https endpoint.
    async fn connect_one(&self, ep: &Endpoint) -> Result<Conn, ConnectFailure> {
        let tcp = TcpStream::connect(&ep.authority)
            .await
            .map_err(|e| ConnectFailure::Unreachable(e.to_string()))?;
        let _ = tcp.set_nodelay(true);
        let (Some(connector), Some(name)) = (&self.inner.tls, &ep.tls_name) else {
            return Ok(Conn::Plain(tcp));
        };
        match connector.connect(name.clone(), tcp).await {
            Ok(stream) => Ok(Conn::Tls(Box::new(stream))),
            Err(e) => Err(
                match security::classify_handshake_failure(
                    &e,
                    &ep.host,
                    self.inner.presents_client_cert,
                ) {
                    Some(f) => ConnectFailure::Tls(f),
                    None => ConnectFailure::Unreachable(format!("TLS handshake failed: {e}")),
                },
            ),
        }
    }

    /// Connects to the first endpoint that accepts, starting at the preferred one. If none
    /// does and one failed in TLS, that failure is returned: it is the one to fix.
    async fn connect(&self) -> Result<(usize, Conn), EtcdError> {
        let n = self.inner.endpoints.len();
        let start = self.inner.preferred.load(Ordering::Relaxed) % n;
        let mut reasons = Vec::new();
        let mut tls_failure = None;
        for i in 0..n {
            let idx = (start + i) % n;
            let ep = &self.inner.endpoints[idx];
            let reason = match tokio::time::timeout(self.inner.timeout, self.connect_one(ep)).await
            {
                Ok(Ok(conn)) => {
                    self.inner.preferred.store(idx, Ordering::Relaxed);
                    return Ok((idx, conn));
                }
                Ok(Err(ConnectFailure::Unreachable(reason))) => reason,
                Ok(Err(ConnectFailure::Tls(failure))) => {
                    let reason = failure.to_string();
                    tls_failure.get_or_insert(EtcdError::Tls {
                        endpoint: ep.url.clone(),
                        failure,
                    });
                    reason
                }
                Err(_) => format!(
                    "connect{} timed out after {} ms",
                    if ep.tls_name.is_some() {
                        " and TLS handshake"
                    } else {
                        ""
                    },
                    self.timeout_ms()
                ),
            };
            if n > 1 {
                log::warn!(
                    "etcd at {} is unreachable ({reason}); trying the next endpoint",
                    ep.url,
                );
            }
            reasons.push((ep.url.clone(), reason));
        }
        if let Some(e) = tls_failure {
            return Err(e);
        }
        let endpoint = reasons
            .iter()
            .map(|r| r.0.as_str())
            .collect::<Vec<_>>()
            .join(", ");
        let reason = if reasons.len() == 1 {
            reasons[0].1.clone()
        } else {
            reasons
                .iter()
                .map(|(u, r)| format!("{u}: {r}"))
                .collect::<Vec<_>>()
                .join("; ")
        };
        Err(EtcdError::Unreachable { endpoint, reason })
    }

    /// Names a failure of an established connection: a TLS refusal (under TLS 1.3 etcd
    /// rejects a client certificate only after our side finished the handshake, so it
    /// shows up here), a plain-http request that a TLS port closed without a word, or else a
    /// lost connection.
    fn lost(&self, idx: usize, path: &str, err: &(dyn std::error::Error + 'static)) -> EtcdError {
        let ep = &self.inner.endpoints[idx];
        if ep.tls_name.is_some() {
            if let Some(failure) =
                security::classify_tls_failure(err, &ep.host, self.inner.presents_client_cert)
            {
                return EtcdError::Tls {
                    endpoint: ep.url.clone(),
                    failure,
                };
            }
        } else if err
            .downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_incomplete_message)
        {
            return EtcdError::ClosedWithoutAnswer {
                endpoint: ep.url.clone(),
                path: path.to_string(),
            };
        }
        EtcdError::ConnectionLost {
            endpoint: ep.url.clone(),
            path: path.to_string(),
            reason: err.to_string(),
        }
    }

    /// An error answer from etcd, named where the fix is known.
    fn refused(&self, idx: usize, path: &str, status: u16, message: String) -> EtcdError {
        let endpoint = self.inner.endpoints[idx].url.clone();
        let path = path.to_string();
        if message.contains("database space exceeded") {
            EtcdError::NoSpace { endpoint, path }
        } else if message.contains("CommonName of client sending a request against gateway") {
            EtcdError::ClientCertificateHasCommonName {
                endpoint,
                path,
                message,
            }
        } else if self.inner.credentials.is_none() && auth::is_token_refusal(Some(status), &message)
        {
            EtcdError::AuthRequired {
                endpoint,
                path,
                message,
            }
        } else {
            EtcdError::Server {
                endpoint,
                path,
                status,
                message,
            }
        }
    }

    /// Sends one POST and returns the response head and body stream, plus the connection guard.
    async fn open(
        &self,
        path: &str,
        body: Bytes,
        token: Option<&str>,
    ) -> Result<(usize, hyper::Response<Incoming>, AbortOnDrop), EtcdError> {
        let (idx, conn) = self.connect().await?;
        let ep = &self.inner.endpoints[idx];
        let started = match conn {
            Conn::Plain(s) => http1(TokioIo::new(s)).await,
            Conn::Tls(s) => http1(TokioIo::new(s)).await,
        };
        let (mut sender, mut guard) = started.map_err(|e| self.lost(idx, path, &e))?;
        let mut req = hyper::Request::post(path)
            .header(hyper::header::HOST, ep.authority.as_str())
            .header(hyper::header::CONTENT_TYPE, "application/json");
        if let Some(token) = token {
            req = req.header(hyper::header::AUTHORIZATION, token);
        }
        let req = req
            .body(Full::new(body))
            .map_err(|e| EtcdError::InvalidEndpoint {
                endpoint: ep.url.clone(),
                reason: format!("cannot build a request for it: {e}"),
            })?;
        let resp = match sender.send_request(req).await {
            Ok(r) => r,
            Err(e) if e.is_canceled() => {
                return Err(match guard.ended_with().await {
                    Some(cause) => self.lost(idx, path, &cause),
                    None => self.lost(idx, path, &e),
                })
            }
            Err(e) => return Err(self.lost(idx, path, &e)),
        };
        Ok((idx, resp, guard))
    }

    async fn post_inner(
        &self,
        path: &str,
        body: Bytes,
        token: Option<&str>,
    ) -> Result<(usize, Bytes), EtcdError> {
        let (idx, resp, _guard) = self.open(path, body, token).await?;
        let status = resp.status();
        let bytes = Limited::new(resp.into_body(), RESPONSE_BYTES_MAX)
            .collect()
            .await
            .map_err(|e| self.lost(idx, path, &*e))?
            .to_bytes();
        if !status.is_success() {
            let message = serde_json::from_slice::<Value>(&bytes)
                .ok()
                .and_then(|v| {
                    v.get("message")
                        .or_else(|| v.get("error"))
                        .and_then(|m| m.as_str().map(str::to_string))
                })
                .unwrap_or_else(|| String::from_utf8_lossy(&bytes).trim().to_string());
            return Err(self.refused(idx, path, status.as_u16(), message));
        }
        Ok((idx, bytes))
    }

    /// One bounded request/response exchange, with this token if given.
    async fn exchange(
        &self,
        path: &str,
        body: Bytes,
        token: Option<&str>,
    ) -> Result<(usize, Bytes), EtcdError> {
        match tokio::time::timeout(self.inner.timeout, self.post_inner(path, body, token)).await {
            Ok(r) => r,
            Err(_) => Err(self.timed_out(path)),
        }
    }

    fn timed_out(&self, path: &str) -> EtcdError {
        let idx = self.inner.preferred.load(Ordering::Relaxed) % self.inner.endpoints.len();
        EtcdError::Timeout {
            endpoint: self.inner.endpoints[idx].url.clone(),
            path: path.to_string(),
            timeout_ms: self.timeout_ms(),
        }
    }

    /// Logs in; the token to use from now on.
    async fn authenticate(&self, creds: &Credentials) -> Result<Token, EtcdError> {
        const PATH: &str = "/v3/auth/authenticate";
        #[derive(Deserialize)]
        struct AuthResp {
            #[serde(default)]
            token: String,
        }
        let body = json!({ "name": creds.user, "password": creds.password }).to_string();
        match self.exchange(PATH, Bytes::from(body), None).await {
            Ok((idx, bytes)) => {
                let r: AuthResp =
                    serde_json::from_slice(&bytes).map_err(|e| self.bad(idx, PATH, e))?;
                if r.token.is_empty() {
                    return Err(self.bad(idx, PATH, "no token in the answer"));
                }
                Ok(Token::Valid(r.token))
            }
            // Users are usually set up before `etcdctl auth enable`; until then, go without.
            Err(EtcdError::Server {
                endpoint, message, ..
            }) if auth::is_auth_not_enabled(&message) => {
                log::warn!(
                    "etcd at {endpoint} has authentication disabled; sending requests without \
                     logging in as {:?}",
                    creds.user
                );
                Ok(Token::NotNeeded)
            }
            Err(EtcdError::Server {
                endpoint, message, ..
            }) if auth::is_bad_credentials(&message) => Err(EtcdError::AuthFailed {
                endpoint,
                user: creds.user.clone(),
                message,
            }),
            Err(e) => Err(e),
        }
    }

    /// The token to use: the current one, or a fresh one if there is none yet or if the
    /// current one is `stale` (refused by etcd). Concurrent callers holding the same stale
    /// token wait on one login.
    async fn token(&self, creds: &Credentials, stale: Option<&Token>) -> Result<Token, EtcdError> {
        let mut current = creds.token.lock().await;
        let renew = *current == Token::Unknown || stale.is_some_and(|s| *s == *current);
        if renew {
            // Unknown until a login succeeds, so a failed one is retried by the next request.
            *current = Token::Unknown;
            *current = self.authenticate(creds).await?;
        }
        Ok(current.clone())
    }

    /// Runs `attempt` with the current token; if etcd refuses that token (which happens
    /// before anything is applied, see `auth.rs`), logs in again and runs it once more.
    async fn with_token<T, F, Fut>(&self, attempt: F) -> Result<T, EtcdError>
    where
        F: Fn(Option<String>) -> Fut,
        Fut: std::future::Future<Output = Result<T, EtcdError>>,
    {
        let Some(creds) = &self.inner.credentials else {
            return attempt(None).await;
        };
        let token = self.token(creds, None).await?;
        match attempt(token.header()).await {
            Err(e) if token_refused(&e) => {
                log::info!(
                    "etcd refused the token of user {:?} ({e}); logging in again",
                    creds.user
                );
                let token = self.token(creds, Some(&token)).await?;
                attempt(token.header()).await
            }
            r => r,
        }
    }

    /// One request/response exchange, logged in if a user is configured. While etcd elects
    /// a leader it refuses requests it has not applied ("leader changed", "no leader", "too
    /// many requests"); those are sent again, backing off, for up to the request timeout in
    /// all. A `Read` is also sent again after any other unavailable answer, timeout or lost
    /// connection, as sending it twice changes nothing; a write that may have been applied
    /// is not, and its caller gets the error.
    async fn post(
        &self,
        path: &str,
        body: &Value,
        kind: Request,
    ) -> Result<(usize, Bytes), EtcdError> {
        let body = Bytes::from(body.to_string());
        let started = tokio::time::Instant::now();
        let mut pause = RETRY_PAUSE_FIRST;
        loop {
            let r = self
                .with_token(|token| {
                    let body = body.clone();
                    async move { self.exchange(path, body, token.as_deref()).await }
                })
                .await;
            match r {
                Err(e)
                    if worth_retrying(&e, kind)
                        && started.elapsed() + pause < self.inner.timeout =>
                {
                    log::info!("{e}; sending {path} again in {} ms", pause.as_millis());
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(RETRY_PAUSE_MAX);
                }
                r => return r,
            }
        }
    }

    fn bad(&self, idx: usize, path: &str, reason: impl fmt::Display) -> EtcdError {
        EtcdError::BadResponse {
            endpoint: self.inner.endpoints[idx].url.clone(),
            path: path.to_string(),
            reason: reason.to_string(),
        }
    }

    async fn call<T: DeserializeOwned>(
        &self,
        path: &str,
        body: &Value,
        kind: Request,
    ) -> Result<(usize, T), EtcdError> {
        let (idx, bytes) = self.post(path, body, kind).await?;
        let v = serde_json::from_slice(&bytes).map_err(|e| self.bad(idx, path, e))?;
        Ok((idx, v))
    }

    async fn range(&self, body: Value) -> Result<(Vec<KeyValue>, i64), EtcdError> {
        const PATH: &str = "/v3/kv/range";
        let (idx, r): (usize, RangeResp) = self.call(PATH, &body, Request::Read).await?;
        let kvs = r
            .kvs
            .into_iter()
            .map(RawKv::decode)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.bad(idx, PATH, e))?;
        Ok((kvs, r.header.revision))
    }

    /// Reads one key.
    pub async fn get(&self, key: &str) -> Result<Option<KeyValue>, EtcdError> {
        let (kvs, _) = self.range(json!({ "key": b64(key.as_bytes()) })).await?;
        Ok(kvs.into_iter().next())
    }

    /// Reads every key with this prefix, sorted by key, and the store revision of the read
    /// (watch from revision + 1 to see every later change).
    pub async fn get_prefix(&self, prefix: &str) -> Result<(Vec<KeyValue>, i64), EtcdError> {
        self.range(json!({
            "key": b64(prefix.as_bytes()),
            "range_end": b64(&prefix_end(prefix.as_bytes())),
        }))
        .await
    }

    /// Writes a key; returns the store revision of the write.
    pub async fn put(
        &self,
        key: &str,
        value: &[u8],
        lease: Option<LeaseId>,
    ) -> Result<i64, EtcdError> {
        let (_, r): (usize, PutResp) = self
            .call("/v3/kv/put", &put_json(key, value, lease), Request::Write)
            .await?;
        Ok(r.header.revision)
    }

    /// Deletes one key; returns how many keys were deleted (0 or 1).
    pub async fn delete(&self, key: &str) -> Result<u64, EtcdError> {
        let (_, r): (usize, DeleteResp) = self
            .call(
                "/v3/kv/deleterange",
                &json!({ "key": b64(key.as_bytes()) }),
                Request::Write,
            )
            .await?;
        Ok(u64::try_from(r.deleted).unwrap_or(0))
    }

    /// Deletes every key with this prefix; returns how many were deleted.
    pub async fn delete_prefix(&self, prefix: &str) -> Result<u64, EtcdError> {
        let (_, r): (usize, DeleteResp) = self
            .call(
                "/v3/kv/deleterange",
                &json!({
                    "key": b64(prefix.as_bytes()),
                    "range_end": b64(&prefix_end(prefix.as_bytes())),
                }),
                Request::Write,
            )
            .await?;
        Ok(u64::try_from(r.deleted).unwrap_or(0))
    }

    /// Runs a transaction atomically.
    pub async fn txn(&self, txn: Txn) -> Result<TxnResponse, EtcdError> {
        const PATH: &str = "/v3/kv/txn";
        let body = json!({
            "compare": txn.compare.iter().map(compare_json).collect::<Vec<_>>(),
            "success": txn.success.iter().map(op_json).collect::<Vec<_>>(),
            "failure": txn.failure.iter().map(op_json).collect::<Vec<_>>(),
        });
        let (idx, r): (usize, RawTxnResp) = self.call(PATH, &body, Request::Write).await?;
        let mut gets = Vec::new();
        for item in r.responses {
            if let Some(range) = item.response_range {
                let kv = match range.kvs.into_iter().next() {
                    Some(raw) => Some(raw.decode().map_err(|e| self.bad(idx, PATH, e))?),
                    None => None,
                };
                gets.push(kv);
            }
        }
        Ok(TxnResponse {
            succeeded: r.succeeded,
            revision: r.header.revision,
            gets,
        })
    }

    /// Writes the key only if it is absent; true if this call created it.
    pub async fn create(
        &self,
        key: &str,
        value: &[u8],
        lease: Option<LeaseId>,
    ) -> Result<bool, EtcdError> {
        let r = self
            .txn(Txn {
                compare: vec![Compare::CreateRevision(key.to_string(), 0)],
                success: vec![Op::Put(key.to_string(), value.to_vec(), lease)],
                failure: vec![],
            })
            .await?;
        Ok(r.succeeded)
    }

    /// Writes the key only if its mod revision is still `expected_mod_revision` (0: absent).
    /// A key bound to a lease loses that binding; use [`Etcd::txn`] to keep one.
    pub async fn cas(
        &self,
        key: &str,
        value: &[u8],
        expected_mod_revision: i64,
    ) -> Result<bool, EtcdError> {
        let r = self
            .txn(Txn {
                compare: vec![Compare::ModRevision(key.to_string(), expected_mod_revision)],
                success: vec![Op::Put(key.to_string(), value.to_vec(), None)],
                failure: vec![],
            })
            .await?;
        Ok(r.succeeded)
    }

    /// Grants a lease that expires after `ttl_s` seconds without a keepalive.
    pub async fn lease_grant(&self, ttl_s: i64) -> Result<LeaseId, EtcdError> {
        const PATH: &str = "/v3/lease/grant";
        let (idx, r): (usize, LeaseResp) = self
            .call(
                PATH,
                &json!({ "TTL": ttl_s.to_string(), "ID": "0" }),
                Request::Write,
            )
            .await?;
        if !r.error.is_empty() {
            return Err(EtcdError::Server {
                endpoint: self.inner.endpoints[idx].url.clone(),
                path: PATH.to_string(),
                status: 200,
                message: r.error,
            });
        }
        if r.id == 0 {
            return Err(self.bad(idx, PATH, "no lease ID in the answer"));
        }
        Ok(LeaseId(r.id))
    }

    /// Renews a lease once; returns the TTL left in seconds. 0 means the lease has expired
    /// (or was revoked): keys bound to it are gone, grant a new one.
    pub async fn lease_keepalive(&self, id: LeaseId) -> Result<i64, EtcdError> {
        const PATH: &str = "/v3/lease/keepalive";
        // A streaming RPC: the gateway answers one message per request message.
        let (idx, bytes) = self
            .post(PATH, &json!({ "ID": id.0.to_string() }), Request::Read)
            .await?;
        let mut buf = bytes.to_vec();
        let msg: StreamMsg<LeaseResp> = take_json(&mut buf)
            .map_err(|e| self.bad(idx, PATH, e))?
            .ok_or_else(|| self.bad(idx, PATH, "empty answer"))?;
        if let Some(err) = msg.error {
            return Err(EtcdError::Server {
                endpoint: self.inner.endpoints[idx].url.clone(),
                path: PATH.to_string(),
                status: 200,
                message: err.to_string(),
            });
        }
        Ok(msg.result.map_or(0, |r| r.ttl.max(0)))
    }

    /// Revokes a lease, deleting its keys at once. Revoking an expired lease is not an error.
    pub async fn lease_revoke(&self, id: LeaseId) -> Result<(), EtcdError> {
        match self
            .post(
                "/v3/lease/revoke",
                &json!({ "ID": id.0.to_string() }),
                Request::Read,
            )
            .await
        {
            Ok(_) => Ok(()),
            Err(EtcdError::Server { message, .. }) if message.contains("lease not found") => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Watches every key with this prefix from `start_revision` (0: from now). Returns once
    /// etcd has confirmed the watch, so every change after this call is reported.
    pub async fn watch_prefix(
        &self,
        prefix: &str,
        start_revision: i64,
    ) -> Result<Watch, EtcdError> {
        const PATH: &str = "/v3/watch";
        let mut create = json!({
            "key": b64(prefix.as_bytes()),
            "range_end": b64(&prefix_end(prefix.as_bytes())),
        });
        if start_revision > 0 {
            create["start_revision"] = Value::String(start_revision.to_string());
        }
        let body = Bytes::from(json!({ "create_request": create }).to_string());
        // Opening a watch changes nothing in etcd, so it may always be tried again.
        let opened = self
            .with_token(|token| {
                let body = body.clone();
                async move {
                    let setup = self.start_watch(PATH, prefix, body, token.as_deref());
                    match tokio::time::timeout(self.inner.timeout, setup).await {
                        Ok(r) => r,
                        Err(_) => Err(self.timed_out(PATH)),
                    }
                }
            })
            .await;
        match opened {
            // Without a user, a watch refused for want of one says so like any request.
            Err(EtcdError::WatchClosed {
                endpoint, reason, ..
            }) if self.inner.credentials.is_none() && auth::is_token_refusal(None, &reason) => {
                Err(EtcdError::AuthRequired {
                    endpoint,
                    path: PATH.to_string(),
                    message: reason,
                })
            }
            r => r,
        }
    }

    async fn start_watch(
        &self,
        path: &str,
        prefix: &str,
        body: Bytes,
        token: Option<&str>,
    ) -> Result<Watch, EtcdError> {
        let (idx, resp, guard) = self.open(path, body, token).await?;
        if !resp.status().is_success() {
            return Err(self.refused(
                idx,
                path,
                resp.status().as_u16(),
                "the watch was refused".to_string(),
            ));
        }
        let mut watch = Watch {
            body: resp.into_body(),
            buf: Vec::new(),
            pending: Vec::new(),
            endpoint: self.inner.endpoints[idx].url.clone(),
            prefix: prefix.to_string(),
            revision: 0,
            _conn: guard,
        };
        // Wait for "created"; events that arrive with it are kept for next(). A watch refused
        // for its token is created and canceled at once, with etcd's reason.
        loop {
            let msg = watch.read_message().await?;
            let created = msg.created;
            let events = watch.handle(msg)?;
            watch.pending.extend(events);
            if created {
                return Ok(watch);
            }
        }
    }
}

/// True if etcd refused a request or a watch for its token (see `auth.rs`).
/// Whether sending a request twice could change more than sending it once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Request {
    /// Reads, keepalives and revokes: the same effect however often sent.
    Read,
    /// Puts, deletes, transactions, grants: sent again only when etcd said it did not apply it.
    Write,
}

const RETRY_PAUSE_FIRST: Duration = Duration::from_millis(50);
const RETRY_PAUSE_MAX: Duration = Duration::from_millis(800);

/// Whether `e` is worth sending a `kind` request again for: etcd refused it before applying
/// it while it has no settled leader, or it is a read and etcd was unavailable or slow.
fn worth_retrying(e: &EtcdError, kind: Request) -> bool {
    match e {
        EtcdError::Server {
            status, message, ..
        } => not_applied(message) || (kind == Request::Read && *status == 503),
        EtcdError::Timeout { .. } | EtcdError::ConnectionLost { .. } => kind == Request::Read,
        _ => false,
    }
}

/// etcd's refusals that come before a request is proposed (ErrNoLeader, ErrTooManyRequests)
/// or that only reads wait for (ErrLeaderChanged, from the read-index wait), so the request
/// had no effect. Its "request timed out" is not among them: a timed-out proposal may still
/// be applied.
fn not_applied(message: &str) -> bool {
    ["leader changed", "no leader", "too many requests"]
        .iter()
        .any(|m| message.contains(m))
}

fn token_refused(e: &EtcdError) -> bool {
    match e {
        EtcdError::Server {
            status, message, ..
        } => auth::is_token_refusal(Some(*status), message),
        EtcdError::WatchClosed { reason, .. } => auth::is_token_refusal(None, reason),
        _ => false,
    }
}

/// A live watch on a prefix. Dropping it closes the stream (etcd cancels the watch).
pub struct Watch {
    body: Incoming,
    buf: Vec<u8>,
    pending: Vec<WatchEvent>,
    endpoint: String,
    prefix: String,
    revision: i64,
    _conn: AbortOnDrop,
}

impl fmt::Debug for Watch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watch")
            .field("endpoint", &self.endpoint)
            .field("prefix", &self.prefix)
            .field("revision", &self.revision)
            .finish()
    }
}

impl Watch {
    /// Waits for the next batch of changes (never empty). Errors end the watch: reload the
    /// state with a read and watch again from its revision + 1.
    pub async fn next(&mut self) -> Result<Vec<WatchEvent>, EtcdError> {
        if !self.pending.is_empty() {
            return Ok(std::mem::take(&mut self.pending));
        }
        loop {
            let msg = self.read_message().await?;
            let events = self.handle(msg)?;
            if !events.is_empty() {
                return Ok(events);
            }
        }
    }

    /// Highest store revision this watch has reported (0 before the first message).
    pub fn revision(&self) -> i64 {
        self.revision
    }

    fn closed(&self, reason: impl fmt::Display) -> EtcdError {
        EtcdError::WatchClosed {
            endpoint: self.endpoint.clone(),
            prefix: self.prefix.clone(),
            reason: reason.to_string(),
        }
    }

    async fn read_message(&mut self) -> Result<RawWatchResp, EtcdError> {
        loop {
            match take_json::<StreamMsg<RawWatchResp>>(&mut self.buf) {
                Ok(Some(msg)) => {
                    if let Some(err) = msg.error {
                        return Err(self.closed(format!("etcd reported {err}")));
                    }
                    match msg.result {
                        Some(r) => return Ok(r),
                        None => continue,
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    return Err(EtcdError::BadResponse {
                        endpoint: self.endpoint.clone(),
                        path: "/v3/watch".to_string(),
                        reason: e.to_string(),
                    })
                }
            }
            if self.buf.len() > WATCH_MESSAGE_BYTES_MAX {
                return Err(self.closed(format!(
                    "a message exceeded {WATCH_MESSAGE_BYTES_MAX} bytes"
                )));
            }
            match self.body.frame().await {
                None => return Err(self.closed("etcd closed the stream")),
                Some(Err(e)) => return Err(self.closed(e)),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
            }
        }
    }

    fn handle(&mut self, msg: RawWatchResp) -> Result<Vec<WatchEvent>, EtcdError> {
        if msg.canceled {
            if msg.compact_revision > 0 {
                return Err(EtcdError::WatchCompacted {
                    prefix: self.prefix.clone(),
                    compact_revision: msg.compact_revision,
                });
            }
            return Err(self.closed(format!("etcd canceled the watch: {}", msg.cancel_reason)));
        }
        self.revision = self.revision.max(msg.header.revision);
        let mut out = Vec::with_capacity(msg.events.len());
        for ev in msg.events {
            let kind = match ev.kind.as_deref() {
                None | Some("PUT") => EventKind::Put,
                Some("DELETE") => EventKind::Delete,
                Some(other) => {
                    return Err(EtcdError::BadResponse {
                        endpoint: self.endpoint.clone(),
                        path: "/v3/watch".to_string(),
                        reason: format!("unknown event type {other:?}"),
                    })
                }
            };
            let kv = ev.kv.decode().map_err(|e| EtcdError::BadResponse {
                endpoint: self.endpoint.clone(),
                path: "/v3/watch".to_string(),
                reason: e,
            })?;
            self.revision = self.revision.max(kv.mod_revision);
            out.push(WatchEvent { kind, kv });
        }
        Ok(out)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse() {
        assert_eq!(
            parse_endpoint("http://127.0.0.1:2379").unwrap().authority,
            "127.0.0.1:2379"
        );
        assert_eq!(
            parse_endpoint("http://127.0.0.1:2379/").unwrap().url,
            "http://127.0.0.1:2379"
        );
        assert_eq!(parse_endpoint("etcd1").unwrap().authority, "etcd1:2379");
        assert_eq!(
            parse_endpoint("etcd1:1234").unwrap().url,
            "http://etcd1:1234"
        );
        let tls = parse_endpoint("https://127.0.0.1:2379/").unwrap();
        assert_eq!(tls.url, "https://127.0.0.1:2379");
        assert_eq!(tls.host, "127.0.0.1");
        assert!(matches!(tls.tls_name, Some(ServerName::IpAddress(_))));
        let v6 = parse_endpoint("https://[::1]:2379").unwrap();
        assert_eq!(
            (v6.host.as_str(), v6.authority.as_str()),
            ("::1", "[::1]:2379")
        );
        assert!(matches!(v6.tls_name, Some(ServerName::IpAddress(_))));
        let named = parse_endpoint("https://etcd1").unwrap();
        assert_eq!(named.url, "https://etcd1:2379");
        assert!(matches!(named.tls_name, Some(ServerName::DnsName(_))));
        assert!(parse_endpoint("http://x:1").unwrap().tls_name.is_none());
        assert!(parse_endpoint("unix://x").is_err());
        assert!(parse_endpoint("http://x:notaport").is_err());
        assert!(parse_endpoint("http://x:1/v3").is_err());
        assert!(parse_endpoint("").is_err());
        assert!(matches!(Etcd::new(vec![]), Err(EtcdError::NoEndpoints)));
    }

    #[test]
    fn schemes_and_tls_settings_must_agree() {
        let e = Etcd::new(vec!["http://a:1".into(), "https://b:1".into()]).unwrap_err();
        assert!(
            matches!(e, EtcdError::Security(SecurityError::MixedSchemes { .. })),
            "{e}"
        );
        assert!(e.to_string().contains("http://a:1") && e.to_string().contains("https://b:1"));
        // https without a CA: no system roots to fall back on.
        let e = Etcd::new(vec!["https://127.0.0.1:2379".into()]).unwrap_err();
        assert!(
            matches!(e, EtcdError::Security(SecurityError::NoCa { .. })),
            "{e}"
        );
        // A CA with http endpoints would silently not encrypt.
        let sec = EtcdSecurity {
            ca_pem: Some(b"x".to_vec()),
            ..Default::default()
        };
        let e = Etcd::with_security(vec!["http://a:1".into()], sec).unwrap_err();
        assert!(
            matches!(
                e,
                EtcdError::Security(SecurityError::TlsSettingsWithoutHttps { .. })
            ),
            "{e}"
        );
        // A user without TLS is allowed (etcd allows it), a half user is not.
        let user = EtcdSecurity::default().with_user("u", "p");
        assert!(Etcd::with_security(vec!["http://a:1".into()], user).is_ok());
        let half = EtcdSecurity {
            username: Some("u".into()),
            ..Default::default()
        };
        assert!(Etcd::with_security(vec!["http://a:1".into()], half).is_err());
    }

    #[test]
    fn only_requests_etcd_did_not_apply_or_reads_are_sent_again() {
        let server = |status: u16, message: &str| EtcdError::Server {
            endpoint: "https://e:2379".into(),
            path: "/v3/kv/txn".into(),
            status,
            message: message.into(),
        };
        for m in [
            "etcdserver: leader changed",
            "etcdserver: no leader",
            "etcdserver: too many requests",
        ] {
            assert!(worth_retrying(&server(503, m), Request::Write), "{m}");
            assert!(worth_retrying(&server(503, m), Request::Read), "{m}");
        }
        // A proposal that timed out may yet be applied: a write is not sent twice.
        let timed_out = server(503, "etcdserver: request timed out");
        assert!(!worth_retrying(&timed_out, Request::Write));
        assert!(worth_retrying(&timed_out, Request::Read));
        let lost = EtcdError::ConnectionLost {
            endpoint: "e".into(),
            path: "p".into(),
            reason: "reset".into(),
        };
        assert!(!worth_retrying(&lost, Request::Write));
        assert!(worth_retrying(&lost, Request::Read));
        // Refusals that another try would not change.
        assert!(!worth_retrying(
            &server(
                400,
                "etcdserver: mvcc: required revision has been compacted"
            ),
            Request::Read
        ));
        let down = EtcdError::Unreachable {
            endpoint: "e".into(),
            reason: "refused".into(),
        };
        assert!(!worth_retrying(&down, Request::Read));
    }

    #[test]
    fn prefix_ends() {
        assert_eq!(prefix_end(b"/a/"), b"/a0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
        assert_eq!(prefix_end(b""), vec![0]);
    }

    #[test]
    fn stream_messages_split_anywhere() {
        let text = br#"{"result":{"header":{"revision":"3"},"created":true}}
{"result":{"header":{"revision":"4"},"events":[{"type":"DELETE","kv":{"key":"YQ==","mod_revision":"4"}}]}}"#;
        for cut in 0..text.len() {
            let mut buf = text[..cut].to_vec();
            let mut got = Vec::new();
            while let Some(m) = take_json::<StreamMsg<RawWatchResp>>(&mut buf).unwrap() {
                got.push(m);
            }
            buf.extend_from_slice(&text[cut..]);
            while let Some(m) = take_json::<StreamMsg<RawWatchResp>>(&mut buf).unwrap() {
                got.push(m);
            }
            assert_eq!(got.len(), 2, "cut at {cut}");
            let last = got[1].result.as_ref().unwrap();
            assert_eq!(last.header.revision, 4);
            assert_eq!(last.events[0].kind.as_deref(), Some("DELETE"));
        }
    }

    #[test]
    fn kv_decodes_proto_json() {
        let raw: RawKv = serde_json::from_str(
            r#"{"key":"YQ==","create_revision":"2","mod_revision":"3","version":"1","value":"Yg==","lease":"7"}"#,
        )
        .unwrap();
        let kv = raw.decode().unwrap();
        assert_eq!(kv.key, "a");
        assert_eq!(kv.value, b"b");
        assert_eq!((kv.create_revision, kv.mod_revision, kv.lease), (2, 3, 7));
    }
}
