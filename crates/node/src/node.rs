//! The running node: its drives, its peers, the volumes it owns, and the glue that lets
//! the volume layer reach any extent — through the local engine or a peer over RPC.

use crate::config::Config;
use bytes::Bytes;
use converge_allocator::admission::{Caller, Refusal};
use converge_control::etcd::LeaseId;
use converge_control::model::{Cluster, ClusterRecord, NodeRecord, SlabRecord, VolumeRecord};
use converge_engine::{Cache, EngineError, Tier};
use converge_replica::replica_error;
use converge_rpc::Handler;
use converge_rpc::{ErrorCode, Request, Response};
use converge_rpc::{Hello, RpcClient, RpcError};
use converge_types::{
    DriveId, ExtentKey, ExtentOp, ExtentReply, Knobs, NodeId, SlabIndex, Version, VolumeId,
};
use converge_volume::resync::Throttle;
use converge_volume::{
    ExtentLoc, ReadReply, ReplicaError, ReplicaIo, Tenure, Volume, VolumeConfig, VolumeError,
};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, RwLock};

pub type Vol = Volume<Replicas, Allocator>;

/// Shared state of this node.
pub struct Node {
    pub cfg: Config,
    pub cluster: Cluster,
    pub cluster_rec: ClusterRecord,
    pub lease: Mutex<LeaseId>,
    /// Until when this node may serve as an owner: its lease surely lives until then
    /// (extended by every confirmed keepalive; see `converge_volume::tenure`).
    pub tenure: Arc<Tenure>,
    /// Capacity drives (with their cache, if bound).
    pub drives: HashMap<DriveId, Arc<Tier>>,
    /// Cache drives, and their paths (for status).
    pub caches: HashMap<DriveId, Arc<Cache>>,
    pub cache_paths: HashMap<DriveId, String>,
    /// Out of the cluster on purpose (a cache drive failed; waiting for its copies to be
    /// marked stale): the keep-alive loop does not register the node again meanwhile.
    pub fenced: std::sync::atomic::AtomicBool,
    pub replicas: Arc<Replicas>,
    pub allocator: Arc<Allocator>,
    /// Volumes this node owns and serves, by name.
    pub volumes: tokio::sync::Mutex<HashMap<String, Arc<Vol>>>,
    /// The gate this node's volumes without a QoS reservation pass (`qos.rs` narrows it).
    pub qos_gate: Arc<converge_volume::qos::SharedGate>,
    /// The local drives' lifetime writes (docs/ENDURANCE.md).
    pub wear: crate::wear::WearBook,
    /// The working-set estimator every capacity drive's client I/O feeds
    /// (`GET /v1/cache/advice`).
    pub sampler: Arc<converge_engine::shards::AccessSampler>,
    /// Background copy jobs (resync, rebuild) of this node.
    pub jobs: crate::repair::Jobs,
    /// Shared by this node's copy jobs.
    pub throttle: Throttle,
    pub scrub_throttle: Throttle,
    pub scrub_stats: ScrubStats,
    /// Orphan extents freed by this node (`orphans.rs`).
    pub orphans_freed: std::sync::atomic::AtomicU64,
    /// Times this node did not claim an unowned volume because no takeover could serve it
    /// (`repair::unservable_slab`), as the leader or for a client: each such claim would
    /// have spent an epoch.
    pub takeovers_deferred: std::sync::atomic::AtomicU64,
    /// Local drives whose failure is recorded in etcd.
    pub failed_reported: Mutex<std::collections::HashSet<DriveId>>,
    /// Who may use the API (`auth.rs`).
    pub auth: crate::auth::Auth,
    /// Removed nodes and revoked certificates, checked at every TLS handshake (`creds.rs`).
    pub revocations: Arc<converge_pki::Revocations>,
    /// HTTPS to the other nodes' APIs: trusts the cluster's CA.
    pub https: Arc<rustls::ClientConfig>,
    /// Volumes offered to qemu guests here as vhost-user-blk disks (`vhost.rs`).
    pub vhost: crate::vhost::Attachments,
    /// This node, for what it hands out that must reach it later (a clone's parent reader).
    pub me: std::sync::OnceLock<std::sync::Weak<Node>>,
    /// The cluster's membership as this node sees it: who may ask what over the peer
    /// protocol (`members.rs`).
    pub members: crate::members::Members,
}

/// Totals of this node's scrubs (for /metrics).
#[derive(Default)]
pub struct ScrubStats {
    pub blocks: std::sync::atomic::AtomicU64,
    pub bad: std::sync::atomic::AtomicU64,
    pub mismatches: std::sync::atomic::AtomicU64,
    pub repaired: std::sync::atomic::AtomicU64,
    /// Snapshot blocks no in-sync copy holding the snapshot has whole.
    pub snapshot_lost: std::sync::atomic::AtomicU64,
}

/// Where a volume's I/O goes from this node.
pub enum Route {
    /// This node owns it.
    Local(Arc<Vol>),
    /// Another node owns it: forward I/O there (redirected I/O).
    Remote { owner: NodeId, volume: VolumeId },
}

impl Node {
    pub fn lease(&self) -> LeaseId {
        *self.lease.lock().expect("lease lock poisoned")
    }

    /// How long a lease confirmed at `sent` surely lives, by this node's clock: its TTL,
    /// counted by etcd from when it received the request (later than `sent`), less a margin
    /// for clock-rate drift and the time a new owner takes to notice.
    pub fn lease_margin(ttl_s: u64) -> std::time::Duration {
        let ttl = std::time::Duration::from_secs(ttl_s);
        ttl - (ttl / 10)
            .max(std::time::Duration::from_millis(500))
            .min(ttl / 2)
    }

    /// Grants a new node lease and starts this node's tenure with it.
    pub async fn grant_lease(&self) -> Result<LeaseId, converge_control::etcd::EtcdError> {
        let ttl = self.cfg.knobs.node_lease_ttl_s.max(3);
        let sent = tokio::time::Instant::now();
        let l = self.cluster.etcd().lease_grant(ttl as i64).await?;
        *self.lease.lock().expect("lease lock poisoned") = l;
        self.tenure.extend(sent + Self::lease_margin(ttl));
        Ok(l)
    }

    pub fn node_record(&self) -> NodeRecord {
        NodeRecord {
            id: self.cfg.node_id,
            name: self.cfg.name.clone(),
            rpc_addr: self.cfg.rpc_addr.to_string(),
            api_addr: self.cfg.api_addr.to_string(),
            nbd_socket: self.cfg.nbd_socket.display().to_string(),
            nbd_tcp: self.cfg.nbd_tcp.map(|a| a.to_string()),
            version: env!("CARGO_PKG_VERSION").to_string(),
            started_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        }
    }

    /// Where `name`'s I/O goes: the volume if this node serves it; else its live owner;
    /// else this node claims ownership with a new epoch, fences every copy and reconciles
    /// them (takeover), and serves it.
    pub async fn open_volume(&self, name: &str) -> Result<Route, OpenError> {
        let mut vols = self.volumes.lock().await;
        if let Some(v) = vols.get(name) {
            return Ok(Route::Local(v.clone()));
        }
        if !self.tenure.holds() {
            // Whatever etcd says, this node cannot serve before its lease is confirmed.
            return Err(OpenError::Unavailable(
                "this node's lease is not confirmed by etcd (etcd unreachable?)".into(),
            ));
        }
        let unavailable =
            |e: converge_control::model::ControlError| OpenError::Unavailable(e.to_string());
        let Some((rec, _)) = self.cluster.volume(name).await.map_err(unavailable)? else {
            return Err(OpenError::Unknown);
        };
        match self.cluster.owner(rec.id).await.map_err(unavailable)? {
            Some(o) if o.node != self.cfg.node_id => {
                return Ok(Route::Remote {
                    owner: o.node,
                    volume: rec.id,
                });
            }
            Some(_) => {}
            None => {
                // Unowned: the preferred owner (where it was created or moved to) takes it
                // if it is live; otherwise this node does (failover).
                if rec.owner != self.cfg.node_id {
                    let live = self.cluster.live_nodes().await.map_err(unavailable)?;
                    if live.iter().any(|n| n.id == rec.owner) {
                        return Ok(Route::Remote {
                            owner: rec.owner,
                            volume: rec.id,
                        });
                    }
                }
            }
        }
        // An encrypted volume is served only by a node that can open its key: one that
        // cannot never takes it (and so never holds it from a node that could).
        let cipher = crate::encryption::cipher_of(&self.cfg, &rec).map_err(|e| {
            log::error!("cannot serve volume {}: {e}", rec.name);
            OpenError::Unavailable(e)
        })?;
        self.check_servable(&rec).await?;
        let epoch = match self
            .cluster
            .claim_ownership(rec.id, self.cfg.node_id, self.lease())
            .await
        {
            Ok(e) => e,
            Err(converge_control::model::ControlError::OwnedElsewhere { node, .. }) => {
                return Ok(Route::Remote {
                    owner: node,
                    volume: rec.id,
                })
            }
            Err(e) => return Err(unavailable(e)),
        };
        let slabs = self
            .cluster
            .slabs(rec.id)
            .await
            .map_err(unavailable)?
            .into_iter()
            .map(|(i, (s, _))| (i, extents_of(&s)))
            .collect();
        let v = Arc::new(Volume::new(
            VolumeConfig {
                id: rec.id,
                name: rec.name.clone(),
                size_bytes: rec.size_bytes,
                slab_size_bytes: rec.slab_size_bytes,
                resiliency: rec.resiliency,
                mirror_part_bytes: rec.mirror_part_bytes,
                epoch,
                local_node: self.cfg.node_id,
                min_replicas: rec.min_replicas.max(1),
                degraded_write_wait: std::time::Duration::from_millis(
                    self.cfg.knobs.degraded_write_wait_ms,
                ),
                read_wait: std::time::Duration::from_millis(self.cfg.knobs.read_wait_ms),
                read_hedge: std::time::Duration::from_millis(self.cfg.knobs.read_hedge_ms),
                tenure: self.tenure.clone(),
                compression: rec.compression,
                cipher,
                qos: rec.qos,
                gate: Some(self.qos_gate.clone()),
            },
            slabs,
            self.replicas.clone(),
            self.allocator.clone(),
        ));
        v.set_snapshots(
            rec.snapshots
                .iter()
                .filter(|s| !s.deleting)
                .map(|s| s.epoch)
                .collect(),
        );
        if let Some(p) = &rec.parent {
            v.set_parent(Some(crate::clones::parent_reader(self, &rec.name, p)));
        }
        match v.reconcile().await {
            Ok(r) => log::info!(
                "serving volume {} (id {}) at epoch {}: copies fenced and compared ({} blocks, {} diverged, {} rewritten)",
                rec.name,
                rec.id,
                epoch,
                r.blocks_compared,
                r.blocks_differing,
                r.blocks_written
            ),
            Err(e) => {
                log::error!("volume {}: takeover failed: {e}", rec.name);
                if let Err(e2) = self.cluster.release_ownership(rec.id, self.cfg.node_id).await {
                    log::warn!("volume {}: releasing ownership: {e2}", rec.name);
                }
                return Err(OpenError::Unavailable(format!(
                    "taking over volume {}: {e}",
                    rec.name
                )));
            }
        }
        vols.insert(name.to_string(), v.clone());
        let (cluster, vol) = (self.cluster.clone(), v.clone());
        tokio::spawn(async move { crate::snapshots::release_stray_floors(&cluster, &vol).await });
        Ok(Route::Local(v))
    }

    /// Refuses a takeover that could not serve `rec` (a slab with fewer copies in sync on
    /// live nodes and drives than a read needs, `repair::unservable_slab`): its claim would
    /// spend an epoch and fail, at each attempt of a client retrying. Costs the slab records
    /// and the repair view (live nodes, failed drives...) per takeover, nothing on a volume
    /// already served.
    async fn check_servable(&self, rec: &VolumeRecord) -> Result<(), OpenError> {
        let unavailable =
            |e: converge_control::model::ControlError| OpenError::Unavailable(e.to_string());
        let slabs = self.cluster.slabs(rec.id).await.map_err(unavailable)?;
        let view = converge_allocator::repair::View::read(&self.cluster)
            .await
            .map_err(unavailable)?;
        let by_slab = slabs.iter().map(|(i, (s, _))| (*i, s.extents.as_slice()));
        match converge_allocator::repair::unservable_slab(by_slab, rec.resiliency, &view) {
            None => Ok(()),
            Some((idx, answering, needed)) => {
                self.takeovers_deferred
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Err(OpenError::Unavailable(format!(
                    "volume {} cannot be served now: {answering} of the {needed} copies of \
                     slab {idx} a read needs are in sync on a live node and drive (not taken \
                     over until they are back)",
                    rec.name
                )))
            }
        }
    }

    /// Stops serving `v` if it is still the instance this node serves under its name: a
    /// client holding an older instance must not drop the one another connection has just
    /// opened (each would take the volume back from the other, epoch after epoch).
    pub async fn drop_instance(&self, v: &Arc<Vol>) {
        v.retire();
        let mut vols = self.volumes.lock().await;
        let name = &v.config().name;
        if vols.get(name).is_some_and(|cur| Arc::ptr_eq(cur, v)) {
            vols.remove(name);
            log::warn!("volume {name}: no longer served by this node");
        }
    }

    /// Stops serving `name` here (deposed, moved or deleted); clients are re-routed.
    pub async fn drop_volume(&self, name: &str) {
        if let Some(v) = self.volumes.lock().await.remove(name) {
            v.retire();
            log::warn!("volume {name}: no longer served by this node");
        }
    }

    /// Stops serving every volume: the node lease was lost, so other nodes may own them now.
    pub async fn drop_all_volumes(&self) {
        let mut v = self.volumes.lock().await;
        if !v.is_empty() {
            log::warn!("dropping {} volumes after losing the node lease", v.len());
            for (_, vol) in v.drain() {
                vol.retire();
            }
        }
    }

    /// The served volume with this id, opening it if this node may own it.
    pub async fn volume_by_id(&self, id: VolumeId) -> Result<Route, OpenError> {
        let name = {
            let vols = self.volumes.lock().await;
            if let Some(v) = vols.values().find(|v| v.config().id == id) {
                return Ok(Route::Local(v.clone()));
            }
            None::<String>
        };
        let name = match name {
            Some(n) => n,
            None => self
                .cluster
                .volumes()
                .await
                .map_err(|e| OpenError::Unavailable(e.to_string()))?
                .into_iter()
                .find(|v| v.id == id)
                .map(|v| v.name)
                .ok_or(OpenError::Unknown)?,
        };
        self.open_volume(&name).await
    }

    /// Free every extent of a deleted volume on whichever node holds it.
    pub async fn free_extents(&self, rec: &VolumeRecord, slabs: &BTreeMap<SlabIndex, SlabRecord>) {
        for (idx, s) in slabs {
            for e in &s.extents {
                let key = ExtentKey {
                    volume: rec.id,
                    slab: *idx,
                };
                if let Err(err) = self.replicas.free(e.node, e.drive, key).await {
                    log::warn!(
                        "volume {}: could not free slab {} on node {} drive {}: {err} (space is reclaimed when that node frees orphan extents)",
                        rec.name, idx, e.node, e.drive
                    );
                }
            }
        }
    }
}

pub enum OpenError {
    Unknown,
    Unavailable(String),
}

fn engine_to_response(e: EngineError) -> Response {
    let code = match &e {
        EngineError::StaleEpoch { .. } => ErrorCode::StaleEpoch,
        EngineError::ChecksumMismatch { .. } => ErrorCode::ChecksumMismatch,
        _ if e.is_no_space() => ErrorCode::NoSpace,
        EngineError::HeldFull { .. } => ErrorCode::Busy,
        EngineError::InvalidArgument(_) | EngineError::InvalidIo { .. } => ErrorCode::Invalid,
        _ => ErrorCode::Io,
    };
    Response::err(code, e.to_string())
}

fn rpc_to_replica(e: RpcError) -> ReplicaError {
    match e {
        RpcError::Remote { code, message } => match code {
            ErrorCode::StaleEpoch => ReplicaError::StaleEpoch(message),
            ErrorCode::ChecksumMismatch => ReplicaError::Checksum(message),
            ErrorCode::NoSpace => ReplicaError::NoSpace(message),
            ErrorCode::Busy => ReplicaError::Busy(message),
            _ => ReplicaError::Io(format!("{code}: {message}")),
        },
        other => ReplicaError::Unreachable(other.to_string()),
    }
}

/// Runs blocking engine work off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, EngineError> + Send + 'static,
) -> Result<T, EngineError> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(e) => Err(EngineError::Failed {
            reason: format!("engine task failed: {e}"),
        }),
    }
}

/// Local engine operations, shared by the owner's local path and the RPC handler.
pub struct LocalDrives {
    pub drives: HashMap<DriveId, Arc<Tier>>,
    /// To check that a write creating an extent is backed by a slab record.
    pub cluster: Cluster,
    /// Extents being freed as orphans: writes to them are refused meanwhile.
    pub condemned: Mutex<std::collections::HashSet<(DriveId, ExtentKey)>>,
    /// How many are condemned (kept with the set, under its lock).
    pub condemned_count: std::sync::atomic::AtomicUsize,
    /// The checks with the control plane every operation passes first (shared with the
    /// simulator).
    admission: converge_allocator::admission::Admission,
}

impl LocalDrives {
    pub fn new(drives: HashMap<DriveId, Arc<Tier>>, cluster: Cluster) -> LocalDrives {
        LocalDrives {
            drives,
            cluster,
            condemned: Default::default(),
            condemned_count: Default::default(),
            admission: Default::default(),
        }
    }

    fn drive(&self, id: DriveId) -> Result<Arc<Tier>, EngineError> {
        // A copy's drive that did not open at start-up (replaced, or taken out of the
        // configuration) is a failed drive to the owner: it marks the copy stale, and the
        // repair rebuilds it once the start-up's record of the drive is seen.
        self.drives
            .get(&id)
            .cloned()
            .ok_or_else(|| EngineError::Failed {
                reason: format!(
                    "drive {id:016x} is not on this node (replaced, or not in its configuration)",
                    id = id.0
                ),
            })
    }

    /// An extent being freed as an orphan takes no writes meanwhile (they would bring it
    /// back).
    fn condemned(&self, drive: DriveId, key: ExtentKey) -> Result<(), EngineError> {
        // The set is almost always empty: skip its lock on the write path then.
        if self
            .condemned_count
            .load(std::sync::atomic::Ordering::Acquire)
            > 0
            && self
                .condemned
                .lock()
                .expect("condemned lock poisoned")
                .contains(&(drive, key))
        {
            return Err(EngineError::InvalidArgument(format!(
                "slab {} of volume {} on drive {:016x} is being freed as an orphan",
                key.slab, key.volume, drive.0
            )));
        }
        Ok(())
    }

    /// Runs `op` from `caller` on one of this node's drives (the replica service), after
    /// the checks with the control plane (`converge_allocator::admission`): a request's
    /// epoch must be one etcd granted, a peer's must come from the volume's owner, an
    /// operation may create only an extent a slab record places here, and a copy the
    /// records still place here is never freed. A drive whose I/O takes microseconds
    /// (`Tier::inline_io`) is driven from this task: the I/O inline, then an async wait
    /// for its journal batch, which this task writes itself if nobody is. Any other drive
    /// is driven from a blocking thread, which may wait there for its device.
    pub async fn call(
        &self,
        caller: Caller,
        drive: DriveId,
        op: ExtentOp,
    ) -> Result<ExtentReply, EngineError> {
        let d = self.drive(drive)?;
        if op.stores_blocks() {
            self.condemned(drive, op.key())?;
        }
        self.admission
            .check(&self.cluster, caller, drive, &op, || d.has_extent(op.key()))
            .await
            .map_err(|r| match r {
                Refusal::Unavailable(reason) => EngineError::Failed { reason },
                Refusal::Deposed { current, .. } => EngineError::StaleEpoch {
                    key: op.key(),
                    requested: op.epoch().unwrap_or_default(),
                    current,
                },
                other => EngineError::InvalidArgument(other.message().to_string()),
            })?;
        if !d.inline_io() {
            return blocking(move || converge_replica::execute(&d, op)).await;
        }
        let (reply, durable) = converge_replica::start(&d, op)?;
        converge_replica::durable(durable).await?;
        Ok(reply)
    }
}

/// The owner's path to every extent: local drives directly, peers over RPC.
pub struct Replicas {
    pub me: NodeId,
    pub local: Arc<LocalDrives>,
    pub cluster: Cluster,
    pub hello: Hello,
    pub knobs: Knobs,
    /// Mutual TLS to peers: this node's certificate, the cluster's CA.
    tls: Arc<rustls::ClientConfig>,
    /// Ends a connection to a peer whose certificate is revoked while it is open.
    revocations: Arc<converge_pki::Revocations>,
    peers: RwLock<HashMap<NodeId, RpcClient>>,
}

impl Replicas {
    pub fn new(
        me: NodeId,
        local: Arc<LocalDrives>,
        cluster: Cluster,
        hello: Hello,
        knobs: Knobs,
        tls: Arc<rustls::ClientConfig>,
        revocations: Arc<converge_pki::Revocations>,
    ) -> Replicas {
        Replicas {
            me,
            local,
            cluster,
            hello,
            knobs,
            tls,
            revocations,
            peers: RwLock::new(HashMap::new()),
        }
    }

    async fn peer(&self, node: NodeId) -> Result<RpcClient, ReplicaError> {
        if let Some(c) = self.peers.read().expect("peers lock poisoned").get(&node) {
            return Ok(c.clone());
        }
        let nodes = self
            .cluster
            .live_nodes()
            .await
            .map_err(|e| ReplicaError::Unreachable(format!("looking up node {node}: {e}")))?;
        let rec = nodes
            .into_iter()
            .find(|n| n.id == node)
            .ok_or_else(|| ReplicaError::Unreachable(format!("node {node} is not live")))?;
        let mut peers = self.peers.write().expect("peers lock poisoned");
        let c = peers
            .entry(node)
            .or_insert_with(|| {
                RpcClient::with_tls_watching(
                    rec.rpc_addr.clone(),
                    self.hello.clone(),
                    &self.knobs,
                    self.tls.clone(),
                    node,
                    self.revocations.clone(),
                )
            })
            .clone();
        Ok(c)
    }

    /// The peers this node has a client for, with their addresses (for
    /// [`Replicas::told_removed`]).
    pub fn known_peers(&self) -> Vec<(NodeId, String)> {
        self.peers
            .read()
            .expect("peers lock poisoned")
            .iter()
            .map(|(n, c)| (*n, c.addr().to_string()))
            .collect()
    }

    /// Asks `peers` whether they refuse this node as removed (`creds::ask_if_removed`).
    pub async fn told_removed(&self, peers: &[(NodeId, String)]) -> Option<NodeId> {
        crate::creds::ask_if_removed(peers, &self.hello, &self.knobs, &self.tls).await
    }

    /// A request to a peer, with the peer protocol's own errors (for redirected I/O).
    pub async fn call_peer(&self, node: NodeId, req: Request) -> Result<Response, RpcError> {
        let c = self.peer(node).await.map_err(|e| RpcError::Connect {
            addr: format!("node {node}"),
            source: Arc::new(std::io::Error::other(e.to_string())),
        })?;
        // The owner may itself wait for a replica timeout and for degraded writes.
        let limit = std::time::Duration::from_millis(
            self.knobs.replica_timeout_ms * 2 + self.knobs.degraded_write_wait_ms,
        );
        c.call_within(req, limit).await
    }

    /// Is the node reachable (a ping over the peer protocol)? This node always is.
    pub async fn call_peer_or_local_ping(&self, node: NodeId) -> Result<(), ReplicaError> {
        if node == self.me {
            return Ok(());
        }
        self.request(node, Request::Ping).await.map(|_| ())
    }

    async fn request(&self, node: NodeId, req: Request) -> Result<Response, ReplicaError> {
        let c = self.peer(node).await?;
        match c.call(req).await.map_err(rpc_to_replica)? {
            Response::Err { code, message } => {
                Err(rpc_to_replica(RpcError::Remote { code, message }))
            }
            r => Ok(r),
        }
    }

    /// Runs `op` on `drive` of `node`: this node's drives directly, a peer's over RPC.
    pub async fn run(
        &self,
        node: NodeId,
        drive: DriveId,
        op: ExtentOp,
    ) -> Result<ExtentReply, ReplicaError> {
        if node == self.me {
            return self
                .local
                .call(Caller::Local, drive, op)
                .await
                .map_err(replica_error);
        }
        match self.request(node, Request::Extent { drive, op }).await? {
            Response::Extent(r) => Ok(r),
            other => Err(ReplicaError::Io(format!(
                "node {node} answered an extent operation with {other:?}"
            ))),
        }
    }

    pub async fn free(
        &self,
        node: NodeId,
        drive: DriveId,
        key: ExtentKey,
    ) -> Result<(), ReplicaError> {
        self.run(node, drive, ExtentOp::Free { key })
            .await
            .map(|_| ())
    }
}

impl ReplicaIo for Replicas {
    async fn call(&self, at: ExtentLoc, op: ExtentOp) -> Result<ExtentReply, ReplicaError> {
        self.run(at.node, at.drive, op).await
    }
}

/// The owner's control-plane glue (placement, fenced allocation and record changes,
/// lookup) lives in `converge-allocator`, so the simulator runs the same code.
pub use converge_allocator::{drive_loads, extents_of, extents_used, Allocator};

/// Serves peers' requests: extent I/O against this node's drives, and redirected volume
/// I/O for the volumes this node owns.
pub struct RpcHandler {
    pub local: Arc<LocalDrives>,
    pub node: Arc<Node>,
}

fn volume_to_response(e: VolumeError) -> Response {
    let code = match &e {
        VolumeError::Fenced { .. } => ErrorCode::NotOwner,
        // This owner cannot reach etcd (it may be cut off and about to be deposed): the
        // forwarding node looks the owner up again and retries, instead of failing.
        VolumeError::Control(..) => ErrorCode::Busy,
        VolumeError::OutOfRange { .. } => ErrorCode::OutOfRange,
        VolumeError::TooLong { .. } => ErrorCode::Invalid,
        _ if e.is_no_space() => ErrorCode::NoSpace,
        VolumeError::Snapshot { .. } => ErrorCode::Invalid,
        _ => ErrorCode::Io,
    };
    Response::err(code, e.to_string())
}

impl RpcHandler {
    async fn owned(&self, id: VolumeId) -> Result<Arc<Vol>, Response> {
        match self.node.volume_by_id(id).await {
            Ok(Route::Local(v)) => Ok(v),
            Ok(Route::Remote { owner, .. }) => Err(Response::err(
                ErrorCode::NotOwner,
                format!("volume {id} is owned by node {owner}"),
            )),
            Err(OpenError::Unknown) => Err(Response::err(
                ErrorCode::Invalid,
                format!("no volume with id {id}"),
            )),
            Err(OpenError::Unavailable(why)) => Err(Response::err(ErrorCode::Busy, why)),
        }
    }

    async fn volume_io(&self, req: Request) -> Response {
        let (id, r) = match req {
            Request::VolRead {
                volume,
                offset,
                len,
            } => (volume, VolIo::Read(offset, len)),
            Request::VolWrite {
                volume,
                offset,
                data,
            } => (volume, VolIo::Write(offset, data)),
            Request::VolZero {
                volume,
                offset,
                len,
                trim,
            } => (volume, VolIo::Zero(offset, len, trim)),
            Request::VolReadAt {
                volume,
                snapshot,
                offset,
                len,
            } => (volume, VolIo::ReadAt(snapshot, offset, len)),
            Request::VolChanged {
                volume,
                from,
                to,
                offset,
                len,
            } => (volume, VolIo::Changed(from, to, offset, len)),
            _ => return Response::err(ErrorCode::Invalid, "not a volume request"),
        };
        let v = match self.owned(id).await {
            Ok(v) => v,
            Err(resp) => return resp,
        };
        let r = match r {
            VolIo::Read(off, len) => v.read(off, u64::from(len)).await.map(|data| {
                Response::Extent(ExtentReply::Read(ReadReply {
                    data,
                    bad_blocks: Vec::new(),
                    suspect: vec![],
                    version: Version(0),
                }))
            }),
            VolIo::Write(off, data) => v.write(off, data).await.map(|_| Response::ok()),
            VolIo::Zero(off, len, trim) => v.zero(off, len, trim).await.map(|_| Response::ok()),
            VolIo::ReadAt(snap, off, len) => {
                v.read_at(snap, off, u64::from(len)).await.map(|data| {
                    Response::Extent(ExtentReply::Read(ReadReply {
                        data,
                        bad_blocks: Vec::new(),
                        suspect: vec![],
                        version: Version(0),
                    }))
                })
            }
            VolIo::Changed(from, to, off, len) => v
                .changed(from, to, off, len)
                .await
                .map(|bits| Response::Extent(ExtentReply::Bitmap(bits))),
        };
        match r {
            Ok(resp) => resp,
            Err(e) => {
                if matches!(e, VolumeError::Fenced { .. }) {
                    self.node.drop_instance(&v).await;
                }
                volume_to_response(e)
            }
        }
    }
}

enum VolIo {
    Read(u64, u32),
    Write(u64, Bytes),
    Zero(u64, u64, bool),
    ReadAt(converge_types::Epoch, u64, u32),
    Changed(
        converge_types::Epoch,
        Option<converge_types::Epoch>,
        u64,
        u64,
    ),
}

impl Handler for RpcHandler {
    /// Every request is checked against who sends it: the cluster's membership first
    /// (`members.rs`: removed nodes get nothing, forwarded volume I/O only from members out
    /// of maintenance), then an extent operation against the volume's owner (admission).
    async fn handle(&self, peer: NodeId, req: Request) -> Response {
        if let Err(refused) = self.node.members.admit(peer, &req) {
            return refused;
        }
        match req {
            Request::Extent { drive, op } => {
                match self.local.call(Caller::Peer(peer), drive, op).await {
                    Ok(r) => Response::Extent(r),
                    Err(e) => engine_to_response(e),
                }
            }
            req @ (Request::VolRead { .. }
            | Request::VolWrite { .. }
            | Request::VolZero { .. }
            | Request::VolReadAt { .. }
            | Request::VolChanged { .. }) => self.volume_io(req).await,
            Request::Ping => Response::Pong,
            Request::Hello(_) => Response::err(ErrorCode::Invalid, "hello after handshake"),
        }
    }
}
