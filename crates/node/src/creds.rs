//! Keeps this node's revocation list current, so that every handshake it answers or makes
//! refuses removed nodes and revoked certificates within a second of the change in etcd
//! (docs/adr/0013), and on the etcd members' hosts writes that list as the CRL file etcd's
//! `--client-crl-file` reads on each new connection. Also the API of revocation:
//! `POST /v1/certs/revoke` and `GET /v1/certs/revoked` (admin).
//!
//! Cost at 1,000 nodes: two etcd watches per node (removed nodes, revoked serials), idle
//! unless something is revoked; each change makes every node read both prefixes once (a few
//! hundred bytes per removed node or revoked certificate): 1,000 small reads per
//! revocation. The certificate registry is one key per certificate a node has used, written
//! when the node starts with a new one.

use crate::api::{ok, ApiError, Out};
use crate::node::Node;
use converge_api::{RevokeCert, RevokedCert};
use converge_control::creds::{RevocationState, RevokedRecord};
use converge_control::model::{keys, Cluster};
use converge_pki::{NodeTls, Revocations, Revoked};
use hyper::{Method, StatusCode};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Pause before watching again after a watch failed (etcd restarting, a compaction).
const RETRY_PAUSE: Duration = Duration::from_secs(1);
/// Left in the node's PKI directory when the node sees its own removal: etcd refuses its
/// certificate from then on, so a restart could not ask etcd whether it was removed.
pub const REMOVED_MARK: &str = "removed";

/// Whether this node saw its own removal before (then it must not start).
pub fn removed_mark(tls_dir: &Path) -> Option<String> {
    std::fs::read_to_string(tls_dir.join(REMOVED_MARK)).ok()
}

/// Records that this node was removed (see [`REMOVED_MARK`]).
pub fn mark_removed(tls_dir: &Path, node: u32) {
    let text = format!(
        "node {node} was removed from this cluster (`converge node remove`); its certificate \
         is revoked. To use this host again, join it with a new id (move this directory \
         away first).\n"
    );
    if let Err(e) = converge_pki::write_file(&tls_dir.join(REMOVED_MARK), text.as_bytes(), 0o644) {
        log::warn!(
            "cannot record this node's removal in {}: {e}",
            tls_dir.display()
        );
    }
}

/// The peers a node saw at its last start, in its PKI directory: the cluster's id (hex) on
/// the first line, then `<node id> <rpc address>` per line. A node that was down through
/// its removal finds etcd refusing it at its next start and asks these (see
/// [`removed_say_remembered_peers`]).
pub const PEERS_FILE: &str = "peers";

/// Writes [`PEERS_FILE`] (at each start; a failure costs only that later answer).
pub fn remember_peers(
    tls_dir: &Path,
    cluster: converge_types::ClusterId,
    peers: &[(converge_types::NodeId, String)],
) {
    let mut text = format!("{:032x}\n", cluster.0);
    for (n, addr) in peers {
        text.push_str(&format!("{} {addr}\n", n.0));
    }
    if let Err(e) = converge_pki::write_file(&tls_dir.join(PEERS_FILE), text.as_bytes(), 0o644) {
        log::warn!("cannot record the peers in {}: {e}", tls_dir.display());
    }
}

/// Asks the peers of [`PEERS_FILE`] (up to five) whether they refuse this node's
/// certificate as a removed node's; the first that does. For a start-up that etcd refuses.
pub async fn removed_say_remembered_peers(
    cfg: &crate::config::Config,
) -> Option<converge_types::NodeId> {
    let text = std::fs::read_to_string(cfg.tls_dir.join(PEERS_FILE)).ok()?;
    let mut lines = text.lines();
    let cluster = converge_types::ClusterId(u128::from_str_radix(lines.next()?, 16).ok()?);
    let peers: Vec<(converge_types::NodeId, String)> = lines
        .filter_map(|l| {
            let (n, addr) = l.split_once(' ')?;
            Some((converge_types::NodeId(n.parse().ok()?), addr.to_string()))
        })
        .filter(|(n, _)| *n != cfg.node_id)
        .take(5)
        .collect();
    let tls = NodeTls::load(&cfg.tls_dir, cfg.node_id.0)
        .and_then(|t| t.peer_client())
        .ok()?;
    let hello = converge_rpc::Hello::new(cluster, cfg.node_id);
    ask_if_removed(&peers, &hello, &cfg.knobs, &tls).await
}

/// Asks `peers`, each over a new connection, whether it refuses this node's certificate as
/// a removed node's (`converge_pki::says_removed`); the first that does. Costs one TLS
/// handshake and a ping per peer asked.
pub async fn ask_if_removed(
    peers: &[(converge_types::NodeId, String)],
    hello: &converge_rpc::Hello,
    knobs: &converge_types::Knobs,
    tls: &Arc<rustls::ClientConfig>,
) -> Option<converge_types::NodeId> {
    for (node, addr) in peers.iter().filter(|(n, _)| *n != hello.node) {
        let c = converge_rpc::RpcClient::with_tls(
            addr.clone(),
            hello.clone(),
            knobs,
            tls.clone(),
            *node,
        );
        if let Err(converge_rpc::RpcError::ThisNodeRemoved { .. }) =
            c.call(converge_rpc::Request::Ping).await
        {
            return Some(*node);
        }
    }
    None
}

fn to_revoked(state: &RevocationState) -> Revoked {
    Revoked {
        removed_nodes: state.removed.iter().map(|n| n.0).collect(),
        serials: state.revoked.iter().map(|r| r.serial.clone()).collect(),
    }
}

/// The revocation list as etcd holds it now.
pub async fn load(cluster: &Cluster) -> anyhow::Result<(Arc<Revocations>, RevocationState)> {
    let state = cluster
        .revocation_state()
        .await
        .map_err(|e| anyhow::anyhow!("reading the revocation list: {e}"))?;
    Ok((Revocations::new(to_revoked(&state)), state))
}

/// Records the certificate this node runs with, so that removing the node (or giving its
/// id to a new host) revokes it by serial, which etcd's CRL needs.
pub async fn register_own(cluster: &Cluster, tls: &NodeTls, node: u32) -> anyhow::Result<()> {
    let me = tls
        .own_cert()
        .map_err(|e| anyhow::anyhow!("this node's certificate: {e}"))?;
    cluster
        .register_cert(converge_types::NodeId(node), &me.serial)
        .await
        .map_err(|e| anyhow::anyhow!("registering this node's certificate: {e}"))
}

/// Writes etcd's CRL file (`[tls] etcd_crl_file`) when the revoked serials differ from what
/// it last wrote. A failure is logged: etcd keeps the file it has. etcd reads the file at
/// each new connection only, so when the list gains a serial and `[tls] etcd_client_port`
/// names the local member's client port, every connection to that port is reset: each
/// client reconnects and meets the new list, and one opened with the revoked certificate
/// is refused.
pub struct CrlFile {
    path: PathBuf,
    tls: NodeTls,
    reset_port: Option<u16>,
    written: Option<BTreeSet<String>>,
    /// What the file listed when this node started (`None`: missing or unreadable).
    found: Option<BTreeSet<String>>,
}

impl CrlFile {
    pub fn new(path: PathBuf, tls: NodeTls, reset_port: Option<u16>) -> CrlFile {
        let found = std::fs::read(&path)
            .ok()
            .and_then(|pem| converge_pki::crl_serials(&pem).ok());
        CrlFile {
            path,
            tls,
            reset_port,
            written: None,
            found,
        }
    }

    pub async fn update(&mut self, serials: &BTreeSet<String>) {
        if self.written.as_ref() == Some(serials) {
            return;
        }
        let r = self.tls.crl_pem(serials).and_then(|pem| {
            converge_pki::write_file(&self.path, pem.as_bytes(), 0o644).map(|_| ())
        });
        if let Err(e) = r {
            log::error!(
                "cannot write etcd's revocation list {}: {e}; etcd keeps the one it has",
                self.path.display()
            );
            return;
        }
        log::info!(
            "etcd's revocation list {} now lists {} certificates",
            self.path.display(),
            serials.len()
        );
        // What etcd refused until now: what this node wrote last, or what the file held
        // when it started.
        let before = self.written.take().or_else(|| self.found.take());
        self.written = Some(serials.clone());
        let gained = before.is_none_or(|b| !serials.is_subset(&b));
        if let (true, Some(port)) = (gained, self.reset_port) {
            reset_etcd_connections(port).await;
        }
    }
}

/// Resets every established TCP connection to this host's port `port` (etcd's client
/// port) with `ss -K`, which needs CAP_NET_ADMIN and a kernel built with
/// INET_DIAG_DESTROY. Every client of that member reconnects (converge's etcd client and
/// etcd's own JSON gateway do so by themselves), and etcd checks its CRL at the new
/// connection. A failure is logged with what to do instead.
async fn reset_etcd_connections(port: u16) {
    let filter = format!(":{port}");
    let out = tokio::process::Command::new("ss")
        .args(["-K", "-t", "-n", "-H", "state", "established", "sport", "="])
        .arg(&filter)
        .output()
        .await;
    let restart = "restart the etcd member on this host, so that connections opened before \
                   the revocation end";
    match out {
        Ok(o) if o.status.success() => {
            let n = String::from_utf8_lossy(&o.stdout).lines().count();
            log::warn!(
                "etcd's revocation list gained a certificate: reset {n} connections to etcd's \
                 client port {port}, so that each reconnects and meets it"
            );
        }
        Ok(o) => log::error!(
            "cannot reset the connections to etcd's client port {port} (ss -K: {}); {restart}",
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => log::error!(
            "cannot reset the connections to etcd's client port {port} (running ss: {e}); \
             {restart}"
        ),
    }
}

/// Least time between two [`RemovalProbe`] rounds while etcd does not answer.
const PROBE_EVERY: Duration = Duration::from_secs(10);
/// Peers asked in one round.
const PROBE_PEERS: usize = 2;

/// How a node that etcd no longer answers asks its peers whether it was removed: etcd cuts
/// a removed node's connections at the revocation (`CrlFile`), possibly before the watch
/// below delivered the removal, and refuses it from then on; the peers' ports tell a
/// removed node's certificate so at the handshake (`converge_pki::says_removed`). While
/// etcd fails, a round asks [`PROBE_PEERS`] peers (by turns) at most every
/// [`PROBE_EVERY`]: during an etcd outage, at 1,000 nodes, about 200 TLS handshakes a
/// second across the cluster; nothing while etcd answers.
pub struct RemovalProbe {
    replicas: Arc<crate::node::Replicas>,
    /// The live nodes when this node started (the peers it has no client for yet).
    at_start: Vec<(converge_types::NodeId, String)>,
    turn: usize,
    last: Option<tokio::time::Instant>,
}

impl RemovalProbe {
    pub fn new(
        replicas: Arc<crate::node::Replicas>,
        at_start: Vec<(converge_types::NodeId, String)>,
    ) -> RemovalProbe {
        RemovalProbe {
            replicas,
            at_start,
            turn: 0,
            last: None,
        }
    }

    /// A peer that refuses this node as removed, if one asked this round does.
    async fn ask(&mut self) -> Option<converge_types::NodeId> {
        if self.last.is_some_and(|t| t.elapsed() < PROBE_EVERY) {
            return None;
        }
        self.last = Some(tokio::time::Instant::now());
        let mut peers: std::collections::BTreeMap<_, _> = self.at_start.iter().cloned().collect();
        // A client's address is the newer one (read when it was made).
        peers.extend(self.replicas.known_peers());
        let peers: Vec<_> = peers.into_iter().collect();
        if peers.is_empty() {
            return None;
        }
        let round: Vec<_> = (0..PROBE_PEERS.min(peers.len()))
            .map(|i| peers[(self.turn + i) % peers.len()].clone())
            .collect();
        self.turn = self.turn.wrapping_add(round.len());
        self.replicas.told_removed(&round).await
    }
}

/// Watches removed nodes and revoked certificates and applies every change to
/// `revocations` (and to etcd's CRL file if this node keeps one). Runs until this node
/// itself is removed (it returns then): the watch tells it, or, when etcd stops answering
/// (it refuses a removed node's certificate, and may cut the open watch before it
/// delivered the removal), a peer refusing this node as removed (`probe`). A failed watch
/// (etcd away, a compaction) is read again and watched anew.
pub async fn watch(
    cluster: Cluster,
    me: converge_types::NodeId,
    revocations: Arc<Revocations>,
    mut crl: Option<CrlFile>,
    mut state: RevocationState,
    mut probe: RemovalProbe,
) {
    let my_key = format!("{}{}", keys::REMOVED, me.0);
    loop {
        if state.removed.contains(&me) {
            return;
        }
        revocations.set(to_revoked(&state));
        if let Some(c) = crl.as_mut() {
            c.update(&revocations.snapshot().serials).await;
        }
        let etcd = cluster.etcd();
        let watches = async {
            let removed = etcd
                .watch_prefix(keys::REMOVED, state.removed_revision + 1)
                .await?;
            let revoked = etcd
                .watch_prefix(keys::REVOKED, state.revoked_revision + 1)
                .await?;
            Ok::<_, converge_control::EtcdError>((removed, revoked))
        };
        match watches.await {
            Ok((mut removed, mut revoked)) => {
                // Any change: read both again (small, and never half-applied).
                let r = tokio::select! {
                    r = removed.next() => r.map(|events| {
                        events.iter().any(|e| {
                            e.kind == converge_control::EventKind::Put && e.kv.key == my_key
                        })
                    }),
                    r = revoked.next() => r.map(|_| false),
                };
                match r {
                    Ok(true) => return,
                    Ok(false) => {}
                    Err(e) => {
                        log::warn!("watching the revocation list: {e}; reading it again");
                        tokio::time::sleep(RETRY_PAUSE).await;
                    }
                }
            }
            Err(e) => {
                log::warn!("cannot watch the revocation list: {e}; trying again");
                tokio::time::sleep(RETRY_PAUSE).await;
            }
        }
        loop {
            match cluster.revocation_state().await {
                Ok(s) => {
                    state = s;
                    break;
                }
                Err(e) => {
                    log::warn!("reading the revocation list: {e}; trying again");
                    if let Some(peer) = probe.ask().await {
                        log::warn!(
                            "etcd does not answer this node, and node {peer} refuses its \
                             certificate as that of a removed node"
                        );
                        return;
                    }
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
            }
        }
    }
}

/// Ends an NBD/TCP connection whose client certificate is revoked while it is open.
#[derive(Debug)]
pub struct NbdClientWatch(pub Arc<Revocations>);

impl converge_nbd::ClientWatch for NbdClientWatch {
    fn watch(
        &self,
        cert: &rustls::pki_types::CertificateDer<'_>,
        peer: &str,
        cut: Box<dyn FnOnce() + Send>,
    ) -> Option<Box<dyn Send>> {
        self.0
            .watch_connection(cert, format!("nbd: the client connection from {peer}"), cut)
            .map(|w| Box::new(w) as Box<dyn Send>)
    }
}

/// `/v1/certs/...` (admin).
pub async fn route(node: &Node, method: &Method, parts: &[&str], body: &[u8]) -> Out {
    match (method, parts) {
        (&Method::GET, ["v1", "certs", "revoked"]) => {
            let list: Vec<RevokedCert> = node
                .cluster
                .revoked_certs()
                .await
                .map_err(ApiError::unavailable)?
                .into_iter()
                .map(|r| RevokedCert {
                    serial: r.serial,
                    subject: r.subject,
                    reason: r.reason,
                    revoked_unix: r.revoked_unix,
                })
                .collect();
            ok(&list)
        }
        (&Method::POST, ["v1", "certs", "revoke"]) => {
            let req: RevokeCert = serde_json::from_slice(body)
                .map_err(|e| ApiError::bad(format!("bad revoke request: {e}")))?;
            let serial = converge_pki::check_serial(&req.serial)
                .map_err(|e| ApiError::bad(e.to_string()))?;
            let rec = RevokedRecord::new(
                &serial,
                req.subject.as_deref().unwrap_or("a certificate"),
                req.reason.as_deref().unwrap_or("revoked by an admin"),
            );
            node.cluster
                .revoke_certs(std::slice::from_ref(&rec))
                .await
                .map_err(ApiError::unavailable)?;
            // Refused here at once; elsewhere as soon as the watch says so.
            node.revocations.add(None, [serial.clone()]);
            log::info!(
                "revoked the certificate of {} (serial {serial}): {}",
                rec.subject,
                rec.reason
            );
            ok(&RevokedCert {
                serial: rec.serial,
                subject: rec.subject,
                reason: rec.reason,
                revoked_unix: rec.revoked_unix,
            })
        }
        _ => Err(ApiError(
            StatusCode::NOT_FOUND,
            "no such certificate request (GET /v1/certs/revoked, POST /v1/certs/revoke)".into(),
        )),
    }
}
