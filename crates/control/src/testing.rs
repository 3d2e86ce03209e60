//! Test helpers shared with other crates' integration tests: a real, throwaway etcd.
//!
//! Enabled by the `testing` feature. Each [`EtcdServer`] runs its own etcd process on free
//! loopback ports with a temporary data directory, and kills exactly that process (by its
//! pid, through the child handle) when dropped.

use crate::etcd::Etcd;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
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
    #[error("etcd at {endpoint} did not become healthy: {reason}; its log ends with:\n{log_tail}")]
    NotHealthy {
        endpoint: String,
        reason: String,
        log_tail: String,
    },
}

/// A running etcd for one test. Dropping it kills the process and deletes its data.
#[derive(Debug)]
pub struct EtcdServer {
    /// Client URL, `http://127.0.0.1:<port>`.
    pub endpoint: String,
    /// Process id of the etcd process.
    pub pid: u32,
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

/// One blocking HTTP/1.0 exchange with a loopback port; the whole answer, or None.
fn http_sync(port: u16, request: &str) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
    s.write_all(request.as_bytes()).ok()?;
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    Some(out)
}

/// Healthy, and really our process: with ports probed by many tests at once, another
/// test's etcd could hold the port ours failed to bind, so check the member name too.
fn healthy_and_ours(port: u16, name: &str) -> bool {
    let health = http_sync(port, "GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    if !health.is_some_and(|h| h.contains("\"health\":\"true\"")) {
        return false;
    }
    let members = http_sync(
        port,
        "POST /v3/cluster/member/list HTTP/1.0\r\nHost: 127.0.0.1\r\n\
         Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
    );
    members.is_some_and(|m| m.contains(&format!("\"name\":\"{name}\"")))
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

    /// Starts etcd and waits until it is healthy.
    pub fn try_start() -> Result<EtcdServer, TestEtcdError> {
        let mut last = None;
        for _ in 0..START_ATTEMPTS {
            match Self::start_once() {
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

    fn start_once() -> Result<EtcdServer, TestEtcdError> {
        let dir = tempfile::Builder::new()
            .prefix("converge-etcd-")
            .tempdir()
            .map_err(TestEtcdError::TempDir)?;
        let client_port = free_port().map_err(TestEtcdError::Port)?;
        let mut peer_port = free_port().map_err(TestEtcdError::Port)?;
        while peer_port == client_port {
            peer_port = free_port().map_err(TestEtcdError::Port)?;
        }
        let endpoint = format!("http://127.0.0.1:{client_port}");
        let name = format!("converge-test-{}", rand::random::<u64>());
        let peer = format!("http://127.0.0.1:{peer_port}");
        let log_path = dir.path().join("etcd.log");
        let log = std::fs::File::create(&log_path).map_err(TestEtcdError::TempDir)?;
        let log2 = log.try_clone().map_err(TestEtcdError::TempDir)?;
        let bin = etcd_bin();
        let child = Command::new(&bin)
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
            child: Some(child),
            dir,
        };
        let deadline = Instant::now() + Duration::from_millis(STARTUP_TIMEOUT_MS);
        loop {
            if healthy_and_ours(client_port, &name) {
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

    /// A client for this server.
    pub fn client(&self) -> Etcd {
        Etcd::new(vec![self.endpoint.clone()]).expect("a test endpoint is a valid http URL")
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
