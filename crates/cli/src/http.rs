//! A minimal blocking HTTP/1.1 client for the node API: the CLI makes a handful of
//! requests to loopback or LAN addresses, so a runtime and a client stack would be dead
//! weight. One request per connection (`Connection: close`).
//!
//! The API speaks only TLS (`https://`, the default for a bare `HOST:PORT`); the node's
//! certificate is checked against the cluster's CA certificate (`--ca`/`$CONVERGE_CA`, else
//! the lab's, else `/etc/converge/pki/ca.crt`) and the host name or address in the URL.
//! `http://` is for other services (etcd's `/health`): a request that would carry the API
//! token over it is refused before anything is sent.
//!
//! Any node answers for the cluster, so the CLI is given a list of API endpoints
//! (`--api`/`$CONVERGE_API`, comma-separated) and tries them in turn: a node that cannot be
//! reached (refused, unreachable, connect timeout) is skipped. An HTTP answer, error or
//! not, is the cluster's answer and is not asked again elsewhere. A request that was sent
//! but got no answer (the node died or hung mid-way) moves on only if it is a `GET`, which
//! changes nothing; a `POST`/`DELETE` might have been applied, so it is not sent twice.

use anyhow::{anyhow, bail, Context, Result};
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an answer may take by default; long operations pass their own.
const READ_TIMEOUT: Duration = Duration::from_secs(120);
/// Bound on the endpoints of one list.
pub const ENDPOINTS_MAX: usize = 64;

/// Splits a comma-separated list of API addresses (`https://HOST:PORT` or `HOST:PORT`) into
/// base URLs, in the order given.
pub fn endpoints(list: &str) -> Result<Vec<String>> {
    let out: Vec<String> = list
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|e| {
            let e = e.trim_end_matches('/');
            if e.starts_with("http://") || e.starts_with("https://") {
                e.to_string()
            } else {
                format!("https://{e}")
            }
        })
        .collect();
    if out.is_empty() {
        bail!("no API address in {list:?}: give https://HOST:PORT, or several separated by commas");
    }
    if out.len() > ENDPOINTS_MAX {
        bail!(
            "{} API addresses given; at most {ENDPOINTS_MAX} are tried",
            out.len()
        );
    }
    Ok(out)
}

#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

static TOKEN: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
static CA_FILE: std::sync::OnceLock<Option<std::path::PathBuf>> = std::sync::OnceLock::new();
/// The TLS settings built from the CA file, once.
static TLS: std::sync::Mutex<Option<(std::path::PathBuf, std::sync::Arc<rustls::ClientConfig>)>> =
    std::sync::Mutex::new(None);

/// Where the installed node keeps the cluster's CA certificate.
pub const SYSTEM_CA: &str = "/etc/converge/pki/ca.crt";

static PINNED: std::sync::OnceLock<std::sync::Arc<rustls::ClientConfig>> =
    std::sync::OnceLock::new();

/// Trust only a server that presents the CA with this fingerprint (a host joining with a
/// join token, which has no CA certificate yet).
pub fn pin_ca(fingerprint: &str) -> Result<()> {
    let cfg = converge_pki::pinned_client_config(fingerprint).map_err(|e| anyhow!("{e}"))?;
    let _ = PINNED.set(cfg);
    Ok(())
}

/// The CA certificate the API's certificates are checked against (`--ca`, `$CONVERGE_CA`).
pub fn set_ca(path: Option<std::path::PathBuf>) {
    let _ = CA_FILE.set(path);
}

/// The CA certificate file to trust: the one given, else the lab's, else the system's.
fn ca_file() -> Result<std::path::PathBuf> {
    if let Some(Some(p)) = CA_FILE.get() {
        return Ok(p.clone());
    }
    let lab = LAB_DIR
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_deref()
        .map(crate::lab::ca_cert);
    if let Some(p) = lab.filter(|p| p.exists()) {
        return Ok(p);
    }
    let system = std::path::PathBuf::from(SYSTEM_CA);
    if system.exists() {
        return Ok(system);
    }
    bail!(
        "no CA certificate to check the API's TLS certificate against: give --ca FILE (or \
         CONVERGE_CA), the cluster's ca.crt from the host where `converge cluster init` ran \
         (installed nodes keep it as {SYSTEM_CA})"
    )
}

fn tls_config() -> Result<std::sync::Arc<rustls::ClientConfig>> {
    if let Some(cfg) = PINNED.get() {
        return Ok(cfg.clone());
    }
    let path = ca_file()?;
    let mut cached = TLS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((p, cfg)) = cached.as_ref() {
        if *p == path {
            return Ok(cfg.clone());
        }
    }
    let pem = std::fs::read(&path)
        .with_context(|| format!("reading the CA certificate {}", path.display()))?;
    let cfg = converge_pki::client_config(&pem)
        .map_err(|e| anyhow!("CA certificate {}: {e}", path.display()))?;
    *cached = Some((path, cfg.clone()));
    Ok(cfg)
}

/// A connection, plain or TLS.
trait Conn: Read + Write {}
impl<T: Read + Write> Conn for T {}
static LAB_DIR: std::sync::Mutex<Option<std::path::PathBuf>> = std::sync::Mutex::new(None);

/// The bearer token every API request carries, if given (`--token`, `$CONVERGE_TOKEN`).
pub fn set_token(token: Option<String>) {
    let _ = TOKEN.set(token);
}

/// Without a token given, requests carry the admin token of the lab in `dir` (read at each
/// request: a lab being started writes it when its first node comes up).
pub fn use_lab_dir(dir: &std::path::Path) {
    *LAB_DIR.lock().unwrap_or_else(|e| e.into_inner()) = Some(dir.to_path_buf());
}

fn auth_header(path: &str) -> String {
    // Only converge's API gets it (not etcd's /health, say).
    if !(path.starts_with("/v1/") || path == "/metrics") {
        return String::new();
    }
    let token = match TOKEN.get() {
        Some(Some(t)) => Some(t.clone()),
        _ => LAB_DIR
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_deref()
            .and_then(crate::lab::admin_token),
    };
    match token {
        Some(t) => format!("Authorization: Bearer {t}\r\n"),
        None => String::new(),
    }
}

/// `api` is one node's API (`http://127.0.0.2:7200`) or several, comma-separated, tried in
/// turn (module doc).
pub fn request(api: &str, method: &str, path: &str, body: Option<&[u8]>) -> Result<Response> {
    request_timeout(api, method, path, body, READ_TIMEOUT)
}

/// Why one endpoint gave no answer.
enum Failure {
    /// Nothing was sent: the next endpoint may be asked.
    NotSent(anyhow::Error),
    /// The request went out, but no (complete) answer came back.
    NoAnswer(anyhow::Error),
}

/// [`request`] waiting up to `read_timeout` for the answer (e.g. a cache flush, which
/// answers when the node's caches are drained).
pub fn request_timeout(
    api: &str,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    read_timeout: Duration,
) -> Result<Response> {
    let list = endpoints(api)?;
    let mut tried = Vec::new();
    for base in &list {
        match request_one(base, method, path, body, read_timeout) {
            Ok(r) => return Ok(r),
            Err(Failure::NotSent(e)) => tried.push(format!("{base}: {e:#}")),
            Err(Failure::NoAnswer(e)) if method == "GET" => {
                tried.push(format!("{base}: sent, no answer: {e:#}"))
            }
            Err(Failure::NoAnswer(e)) => {
                return Err(e.context(format!(
                    "{method} {path} was sent to {base} but no answer came back; it may or \
                     may not have been applied: check (e.g. `converge status`) before retrying"
                )))
            }
        }
    }
    bail!(
        "cannot reach the converge API at {} (tried {} endpoint{} in turn):\n  {}\nis \
         converged running there? Give live nodes with --api or CONVERGE_API \
         (comma-separated), or run `eval \"$(converge lab env)\"` for the lab",
        list.join(", "),
        list.len(),
        if list.len() == 1 { "" } else { "s" },
        tried.join("\n  ")
    )
}

fn request_one(
    base: &str,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    read_timeout: Duration,
) -> Result<Response, Failure> {
    let (tls, hostport) = if let Some(h) = base.strip_prefix("https://") {
        (true, h)
    } else if let Some(h) = base.strip_prefix("http://") {
        (false, h)
    } else {
        return Err(Failure::NotSent(anyhow!(
            "API address {base:?} must start with https://"
        )));
    };
    let auth = plain_text_guard(tls, base, auth_header(path)).map_err(Failure::NotSent)?;
    // A bounded connect: a node cut off the network (a lab partition) must fail in
    // seconds, not after the kernel's SYN retries.
    let tcp = connect(hostport).map_err(|e| Failure::NotSent(e.into()))?;
    tcp.set_read_timeout(Some(read_timeout))
        .map_err(|e| Failure::NotSent(e.into()))?;
    let mut s: Box<dyn Conn> = if tls {
        let cfg = tls_config().map_err(Failure::NotSent)?;
        let host = host_of(hostport);
        let name = rustls::pki_types::ServerName::try_from(host.to_string())
            .map_err(|e| Failure::NotSent(anyhow!("{host:?} is not a host name: {e}")))?;
        let conn = rustls::ClientConnection::new(cfg, name)
            .map_err(|e| Failure::NotSent(anyhow!("TLS: {e}")))?;
        let mut stream = rustls::StreamOwned::new(conn, tcp);
        // Handshake now, so a certificate problem is reported as such (and nothing was
        // sent).
        while stream.conn.is_handshaking() {
            stream.conn.complete_io(&mut stream.sock).map_err(|e| {
                Failure::NotSent(anyhow!(
                    "TLS handshake with {hostport} failed: {e} (is this a converge API, \
                         and is the CA certificate this cluster's?)"
                ))
            })?;
        }
        Box::new(stream)
    } else {
        Box::new(tcp)
    };
    let sent = (|| -> Result<()> {
        let body = body.unwrap_or(&[]);
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {hostport}\r\nConnection: close\r\nContent-Type: application/json\r\n{}Content-Length: {}\r\n\r\n",
            auth,
            body.len()
        );
        s.write_all(head.as_bytes())?;
        s.write_all(body)?;
        Ok(())
    })();
    // A write that fails may still have delivered the request.
    sent.map_err(Failure::NoAnswer)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)
        .with_context(|| format!("reading the answer from {base}{path}"))
        .map_err(Failure::NoAnswer)?;
    parse(&raw)
        .with_context(|| format!("bad HTTP answer from {base}{path}"))
        .map_err(Failure::NoAnswer)
}

/// The `Authorization` header line for a request to `base`, refused over plain `http://`:
/// a bearer token sent in the clear is anyone's who can watch the network.
fn plain_text_guard(tls: bool, base: &str, header: String) -> Result<String> {
    if !tls && !header.is_empty() {
        bail!(
            "refusing to send the API token to {base} over plain http:// (anyone on the \
             network could read it and act as you): the converge API speaks https only; give \
             https://{}",
            base.trim_start_matches("http://")
        );
    }
    Ok(header)
}

/// The host part of `host:port` (`[v6]:port` too).
fn host_of(hostport: &str) -> &str {
    let host = match hostport.rfind(':') {
        Some(i) if !hostport[i + 1..].contains(']') => &hostport[..i],
        _ => hostport,
    };
    host.trim_start_matches('[').trim_end_matches(']')
}

fn connect(hostport: &str) -> std::io::Result<TcpStream> {
    let mut last = None;
    for a in hostport.to_socket_addrs()? {
        match TcpStream::connect_timeout(&a, CONNECT_TIMEOUT) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::NotFound, "no address to connect to")
    }))
}

fn parse(raw: &[u8]) -> Result<Response> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| anyhow!("no end of headers"))?;
    let head = std::str::from_utf8(&raw[..end])?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("bad status line {status_line:?}"))?;
    let mut chunked = false;
    for l in lines {
        let l = l.to_ascii_lowercase();
        if l.starts_with("transfer-encoding:") && l.contains("chunked") {
            chunked = true;
        }
    }
    let rest = &raw[end + 4..];
    let body = if chunked {
        dechunk(rest)?
    } else {
        rest.to_vec()
    };
    Ok(Response { status, body })
}

fn dechunk(mut b: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = b
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or_else(|| anyhow!("truncated chunk"))?;
        let size_str = std::str::from_utf8(&b[..eol])?;
        let size = usize::from_str_radix(size_str.split(';').next().unwrap_or("").trim(), 16)?;
        b = &b[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        if b.len() < size + 2 {
            bail!("truncated chunk body");
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

/// Call the API (one endpoint or several, as [`request`]) and decode JSON; a non-2xx answer
/// becomes the server's error message.
pub fn call<T: serde::de::DeserializeOwned>(
    base: &str,
    method: &str,
    path: &str,
    body: Option<&serde_json::Value>,
) -> Result<T> {
    call_timeout(base, method, path, body, READ_TIMEOUT)
}

/// [`call`] waiting up to `read_timeout` for the answer.
pub fn call_timeout<T: serde::de::DeserializeOwned>(
    base: &str,
    method: &str,
    path: &str,
    body: Option<&serde_json::Value>,
    read_timeout: Duration,
) -> Result<T> {
    let bytes = body.map(serde_json::to_vec).transpose()?;
    let r = request_timeout(base, method, path, bytes.as_deref(), read_timeout)?;
    if !(200..300).contains(&r.status) {
        let msg = serde_json::from_slice::<converge_api::ErrorBody>(&r.body)
            .map(|e| e.error)
            .unwrap_or_else(|_| String::from_utf8_lossy(&r.body).into_owned());
        bail!("{msg}");
    }
    serde_json::from_slice(&r.body).with_context(|| format!("decoding the answer of {path}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_chunked() {
        let r = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi").unwrap();
        assert_eq!((r.status, &r.body[..]), (200, &b"hi"[..]));
        let r = parse(b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n").unwrap();
        assert_eq!((r.status, &r.body[..]), (404, &b"abcde"[..]));
        assert!(parse(b"garbage").is_err());
    }

    /// The bearer token never leaves over plain http (before, `--api http://HOST:PORT`
    /// sent it in the clear).
    #[test]
    fn the_token_is_never_sent_over_plain_http() {
        let token = "Authorization: Bearer cvt.x.y\r\n".to_string();
        let e = plain_text_guard(false, "http://10.0.0.1:7200", token.clone()).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("refusing to send the API token") && msg.contains("https://10.0.0.1:7200"),
            "{msg}"
        );
        assert_eq!(
            plain_text_guard(true, "https://10.0.0.1:7200", token.clone()).unwrap(),
            token
        );
        // Without a token (etcd's /health), plain http is fine.
        assert_eq!(
            plain_text_guard(false, "http://127.0.0.1:2379", String::new()).unwrap(),
            ""
        );
    }

    #[test]
    fn endpoint_lists() {
        assert_eq!(
            endpoints("https://a:1, b:2/ ,,http://c:3/").unwrap(),
            ["https://a:1", "https://b:2", "http://c:3"]
        );
        assert!(endpoints(" , ").is_err());
        let many = vec!["a:1"; ENDPOINTS_MAX + 1].join(",");
        assert!(endpoints(&many).is_err());
    }

    /// A listener that answers every connection with `answer`, on a free port.
    fn server(answer: &'static [u8]) -> String {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let mut s = s.unwrap();
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf);
                let _ = s.write_all(answer);
            }
        });
        format!("http://{addr}")
    }

    /// A port where nothing listens (bound, then closed).
    fn dead() -> String {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    }

    #[test]
    fn tries_endpoints_in_turn_until_one_answers() {
        let ok = server(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}");
        let (d1, d2) = (dead(), dead());
        let r = request(&format!("{d1},{d2},{ok}"), "POST", "/x", None).unwrap();
        assert_eq!(r.status, 200);
        // An HTTP error is an answer: the next endpoint is not asked.
        let err =
            server(b"HTTP/1.1 404 Not Found\r\nContent-Length: 20\r\n\r\n{\"error\":\"no such\"}");
        let e = call::<serde_json::Value>(&format!("{err},{ok}"), "GET", "/x", None).unwrap_err();
        assert_eq!(e.to_string(), "no such");
        // None answers: every endpoint is named.
        let e = request(&format!("{d1},{d2}"), "GET", "/x", None).unwrap_err();
        let msg = format!("{e:#}");
        assert!(
            msg.contains("tried 2 endpoints") && msg.contains(&d1) && msg.contains(&d2),
            "{msg}"
        );
    }

    #[test]
    fn a_sent_request_without_answer_is_not_sent_again_unless_it_is_a_get() {
        // Closes the connection after reading the request: sent, never answered.
        let mute = server(b"");
        let ok = server(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}");
        let e = request(&format!("{mute},{ok}"), "POST", "/v1/volumes", None).unwrap_err();
        assert!(
            format!("{e:#}").contains("may or may not have been applied"),
            "{e:#}"
        );
        assert_eq!(
            request(&format!("{mute},{ok}"), "GET", "/x", None)
                .unwrap()
                .status,
            200
        );
    }
}
