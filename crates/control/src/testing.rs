//! Test helpers shared with other crates' integration tests: a real, throwaway etcd.
//!
//! Enabled by the `testing` feature. Each [`EtcdServer`] runs its own etcd process on free
//! loopback ports with a temporary data directory, and kills exactly that process (by its
//! pid, through the child handle) when dropped. [`EtcdServer::start_tls`] serves https with
//! certificates the test makes, and [`EtcdServer::enable_auth`] turns on etcd's users.

use crate::etcd::{Etcd, EtcdSecurity};
use rustls::pki_types::ServerName;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Environment variable naming the etcd binary (default `/usr/bin/etcd`, else `etcd` on PATH).
pub const ETCD_BIN_ENV: &str = "CONVERGE_ETCD_BIN";
/// How long to wait for a started etcd to report healthy.
pub const STARTUP_TIMEOUT_MS: u64 = 60_000;
/// Attempts with fresh ports (another process may grab a port between probe and bind).
const START_ATTEMPTS: usize = 3;

/// Why a test etcd could not be started.
#[derive(Debug, thiserror::Error)]
pub enum TestEtcdError {
    #[error("cannot create a temporary directory for etcd's data: {0}")]
    TempDir(std::io::Error),
    #[error("cannot find a free loopback port: {0}")]
    Port(std::io::Error),
    #[error(
        "cannot run {bin}: {err}; install etcd (apt-get install etcd-server) or set {ETCD_BIN_ENV}"
    )]
    Spawn { bin: String, err: std::io::Error },
    #[error("the TLS settings for the test etcd cannot be used: {0}")]
    Tls(crate::etcd::SecurityError),
    #[error("etcd at {endpoint} did not become healthy: {reason}; its log ends with:\n{log_tail}")]
    NotHealthy {
        endpoint: String,
        reason: String,
        log_tail: String,
    },
}

/// TLS for a test etcd, as PEM; the test makes the certificates.
#[derive(Clone, Debug)]
pub struct TestTls {
    /// etcd's certificate (`--cert-file`). It must name 127.0.0.1 (an IP subject alternative
    /// name) and allow client authentication too: etcd's gateway dials etcd's own gRPC with it.
    pub server_cert_pem: Vec<u8>,
    /// Its private key (`--key-file`).
    pub server_key_pem: Vec<u8>,
    /// The CA etcd trusts for client certificates (`--trusted-ca-file`).
    pub trusted_ca_pem: Vec<u8>,
    /// Require a client certificate (`--client-cert-auth`).
    pub client_cert_auth: bool,
    /// How the helper connects (health checks, [`EtcdServer::client`],
    /// [`EtcdServer::gateway_post`]): the CA of etcd's certificate, and a client certificate
    /// if etcd requires one (without a CommonName if the test enables auth: etcd's gateway
    /// refuses certificates with one then).
    pub client: EtcdSecurity,
}

/// A running etcd for one test. Dropping it kills the process and deletes its data.
#[derive(Debug)]
pub struct EtcdServer {
    /// Client URL, `http://127.0.0.1:<port>` (`https://` when started with TLS).
    pub endpoint: String,
    /// Process id of the etcd process.
    pub pid: u32,
    port: u16,
    /// What [`EtcdServer::client`] uses; default for plain http.
    security: EtcdSecurity,
    /// For the helper's own blocking requests, when etcd serves TLS.
    tls: Option<Arc<rustls::ClientConfig>>,
    child: Option<Child>,
    dir: tempfile::TempDir,
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> Result<u16, std::io::Error> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// An endpoint where (very likely) nothing listens: for "etcd is down" tests.
pub fn unused_endpoint() -> String {
    let port = free_port().unwrap_or(1);
    format!("http://127.0.0.1:{port}")
}

fn etcd_bin() -> String {
    if let Ok(b) = std::env::var(ETCD_BIN_ENV) {
        return b;
    }
    if PathBuf::from("/usr/bin/etcd").exists() {
        "/usr/bin/etcd".to_string()
    } else {
        "etcd".to_string()
    }
}

/// One blocking HTTP/1.0 exchange with a loopback port (over TLS if `tls`); the whole
/// answer as far as it arrived.
fn http_sync(
    port: u16,
    tls: Option<&Arc<rustls::ClientConfig>>,
    request: &str,
) -> Result<String, std::io::Error> {
    let tcp = TcpStream::connect(("127.0.0.1", port))?;
    tcp.set_read_timeout(Some(Duration::from_secs(2)))?;
    tcp.set_write_timeout(Some(Duration::from_secs(2)))?;
    let mut out = Vec::new();
    match tls {
        None => {
            let mut s = tcp;
            s.write_all(request.as_bytes())?;
            let _ = s.read_to_end(&mut out);
        }
        Some(config) => {
            let name = ServerName::IpAddress(Ipv4Addr::LOCALHOST.into());
            let conn = rustls::ClientConnection::new(config.clone(), name)
                .map_err(std::io::Error::other)?;
            let mut s = rustls::StreamOwned::new(conn, tcp);
            s.write_all(request.as_bytes())?;
            // etcd may close without close_notify; what arrived is the answer.
            let _ = s.read_to_end(&mut out);
        }
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// Healthy, and really our process: with ports probed by many tests at once, another
/// test's etcd could hold the port ours failed to bind, so check the member name too.
fn healthy_and_ours(port: u16, tls: Option<&Arc<rustls::ClientConfig>>, name: &str) -> bool {
    let health = http_sync(port, tls, "GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    if !health.is_ok_and(|h| h.contains("\"health\":\"true\"")) {
        return false;
    }
    let members = http_sync(
        port,
        tls,
        "POST /v3/cluster/member/list HTTP/1.0\r\nHost: 127.0.0.1\r\n\
         Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
    );
    members.is_ok_and(|m| m.contains(&format!("\"name\":\"{name}\"")))
}

fn tail(path: &std::path::Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

impl EtcdServer {
    /// Starts etcd and waits until it is healthy. Panics with the reason (for tests).
    pub fn start() -> EtcdServer {
        match Self::try_start() {
            Ok(s) => s,
            Err(e) => panic!("test etcd failed to start: {e}"),
        }
    }

    /// Starts etcd serving https with these certificates and waits until it is healthy.
    /// Panics with the reason (for tests).
    pub fn start_tls(tls: TestTls) -> EtcdServer {
        match Self::try_start_with(Some(&tls)) {
            Ok(s) => s,
            Err(e) => panic!("test etcd (TLS) failed to start: {e}"),
        }
    }

    /// Starts etcd and waits until it is healthy.
    pub fn try_start() -> Result<EtcdServer, TestEtcdError> {
        Self::try_start_with(None)
    }

    /// Starts etcd with these extra flags (e.g. `--quota-backend-bytes`) and waits until it
    /// is healthy. Panics with the reason (for tests).
    pub fn start_with_flags(flags: &[&str]) -> EtcdServer {
        match Self::try_start_full(None, flags) {
            Ok(s) => s,
            Err(e) => panic!("test etcd failed to start: {e}"),
        }
    }

    /// Starts etcd, serving https if `tls` is given, and waits until it is healthy.
    pub fn try_start_with(tls: Option<&TestTls>) -> Result<EtcdServer, TestEtcdError> {
        Self::try_start_full(tls, &[])
    }

    fn try_start_full(tls: Option<&TestTls>, flags: &[&str]) -> Result<EtcdServer, TestEtcdError> {
        let mut last = None;
        for _ in 0..START_ATTEMPTS {
            match Self::start_once(tls, flags) {
                Ok(s) => return Ok(s),
                Err(e @ TestEtcdError::NotHealthy { .. }) => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or(TestEtcdError::NotHealthy {
            endpoint: String::new(),
            reason: "no attempt made".to_string(),
            log_tail: String::new(),
        }))
    }

    fn start_once(tls: Option<&TestTls>, flags: &[&str]) -> Result<EtcdServer, TestEtcdError> {
        let dir = tempfile::Builder::new()
            .prefix("converge-etcd-")
            .tempdir()
            .map_err(TestEtcdError::TempDir)?;
        let client_port = free_port().map_err(TestEtcdError::Port)?;
        let mut peer_port = free_port().map_err(TestEtcdError::Port)?;
        while peer_port == client_port {
            peer_port = free_port().map_err(TestEtcdError::Port)?;
        }
        let scheme = if tls.is_some() { "https" } else { "http" };
        let endpoint = format!("{scheme}://127.0.0.1:{client_port}");
        let name = format!("converge-test-{}", rand::random::<u64>());
        let peer = format!("http://127.0.0.1:{peer_port}");
        let log_path = dir.path().join("etcd.log");
        let log = std::fs::File::create(&log_path).map_err(TestEtcdError::TempDir)?;
        let log2 = log.try_clone().map_err(TestEtcdError::TempDir)?;
        let bin = etcd_bin();
        let mut cmd = Command::new(&bin);
        let mut probe_tls = None;
        let mut security = EtcdSecurity::default();
        if let Some(tls) = tls {
            let write = |file: &str, pem: &[u8]| {
                let path = dir.path().join(file);
                std::fs::write(&path, pem).map(|()| path)
            };
            cmd.arg("--cert-file")
                .arg(write("server.pem", &tls.server_cert_pem).map_err(TestEtcdError::TempDir)?)
                .arg("--key-file")
                .arg(write("server.key", &tls.server_key_pem).map_err(TestEtcdError::TempDir)?)
                .arg("--trusted-ca-file")
                .arg(write("ca.pem", &tls.trusted_ca_pem).map_err(TestEtcdError::TempDir)?);
            if tls.client_cert_auth {
                cmd.arg("--client-cert-auth");
            }
            probe_tls = Some(
                tls.client
                    .client_config(&endpoint)
                    .map_err(TestEtcdError::Tls)?,
            );
            security = tls.client.clone();
        }
        let child = cmd
            .arg("--name")
            .arg(&name)
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .arg("--listen-client-urls")
            .arg(&endpoint)
            .arg("--advertise-client-urls")
            .arg(&endpoint)
            .arg("--listen-peer-urls")
            .arg(&peer)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer)
            .arg("--initial-cluster")
            .arg(format!("{name}={peer}"))
            .args(flags)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log2))
            .spawn()
            .map_err(|err| TestEtcdError::Spawn {
                bin: bin.clone(),
                err,
            })?;
        let pid = child.id();
        let mut server = EtcdServer {
            endpoint,
            pid,
            port: client_port,
            security,
            tls: probe_tls,
            child: Some(child),
            dir,
        };
        let deadline = Instant::now() + Duration::from_millis(STARTUP_TIMEOUT_MS);
        loop {
            if healthy_and_ours(client_port, server.tls.as_ref(), &name) {
                return Ok(server);
            }
            let exited = server
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            let reason = if let Some(status) = exited {
                Some(format!("etcd exited with {status}"))
            } else if Instant::now() > deadline {
                Some(format!("not healthy after {STARTUP_TIMEOUT_MS} ms"))
            } else {
                None
            };
            if let Some(reason) = reason {
                let log_tail = tail(&log_path);
                server.stop();
                return Err(TestEtcdError::NotHealthy {
                    endpoint: server.endpoint.clone(),
                    reason,
                    log_tail,
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A client for this server (with the TLS settings it was started with).
    pub fn client(&self) -> Etcd {
        Etcd::with_security(vec![self.endpoint.clone()], self.security.clone())
            .expect("a test endpoint and its TLS settings are valid")
    }

    /// One blocking POST of a JSON body to etcd's gateway (over TLS if etcd serves it), with
    /// an `Authorization` token if given: for what the client has no call for (users, auth).
    /// Returns the HTTP status and the body.
    pub fn gateway_post(
        &self,
        path: &str,
        body: &str,
        token: Option<&str>,
    ) -> Result<(u16, String), std::io::Error> {
        let auth = token.map_or(String::new(), |t| format!("Authorization: {t}\r\n"));
        let answer = http_sync(
            self.port,
            self.tls.as_ref(),
            &format!(
                "POST {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
                 {auth}Content-Length: {}\r\n\r\n{body}",
                body.len()
            ),
        )?;
        let bad = || std::io::Error::other(format!("not an HTTP answer: {answer:?}"));
        let status = answer
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse::<u16>().ok())
            .ok_or_else(bad)?;
        let body = answer.split_once("\r\n\r\n").ok_or_else(bad)?.1;
        Ok((status, body.to_string()))
    }

    /// [`EtcdServer::gateway_post`] that must succeed; panics with etcd's answer otherwise.
    fn gateway_ok(&self, path: &str, body: &str, token: Option<&str>) -> String {
        match self.gateway_post(path, body, token) {
            Ok((200, body)) => body,
            Ok((status, body)) => panic!("etcd refused {path} (HTTP {status}): {body}"),
            Err(e) => panic!("etcd at {} did not answer {path}: {e}", self.endpoint),
        }
    }

    /// Turns on etcd's authentication with user `root` (role root) and this password, as
    /// `etcdctl user add root && etcdctl auth enable` would. Panics with the reason.
    pub fn enable_auth(&self, root_password: &str) {
        let root = serde_json::json!({ "name": "root", "password": root_password }).to_string();
        match self.gateway_post("/v3/auth/role/add", r#"{"name":"root"}"#, None) {
            Ok((200, _)) => {}
            Ok((_, body)) if body.contains("role name already exists") => {}
            Ok((status, body)) => panic!("etcd refused to add role root (HTTP {status}): {body}"),
            Err(e) => panic!("etcd at {} did not answer: {e}", self.endpoint),
        }
        self.gateway_ok("/v3/auth/user/add", &root, None);
        self.gateway_ok(
            "/v3/auth/user/grant",
            r#"{"user":"root","role":"root"}"#,
            None,
        );
        self.gateway_ok("/v3/auth/enable", "{}", None);
    }

    /// Logs in to etcd as this user; the token. Panics with the reason.
    pub fn authenticate(&self, user: &str, password: &str) -> String {
        let body = serde_json::json!({ "name": user, "password": password }).to_string();
        let answer = self.gateway_ok("/v3/auth/authenticate", &body, None);
        serde_json::from_str::<serde_json::Value>(&answer)
            .ok()
            .and_then(|v| v.get("token")?.as_str().map(str::to_string))
            .unwrap_or_else(|| panic!("no token in etcd's answer: {answer}"))
    }

    /// Sets the user's password (to the same one, if wanted). etcd drops every token it
    /// issued to that user, so clients holding one must log in again: the way to expire a
    /// token now, without waiting for `--auth-token-ttl`.
    pub fn change_password(&self, user: &str, password: &str, token: &str) {
        let body = serde_json::json!({ "name": user, "password": password }).to_string();
        self.gateway_ok("/v3/auth/user/changepw", &body, Some(token));
    }

    /// Where etcd keeps its data and log (`etcd.log`).
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// Kills the etcd process now (SIGKILL to its pid) and reaps it. Idempotent.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
    }
}
