//! The running node: its drives, its peers, the volumes it owns, and the glue that lets
//! the volume layer reach any extent — through the local engine or a peer over RPC.

use crate::config::Config;
use bytes::{Bytes, BytesMut};
use converge_control::etcd::LeaseId;
use converge_control::model::{
    Cluster, ClusterRecord, DriveRecord, NodeRecord, SlabRecord, VolumeRecord,
};
use converge_control::placement::{self, DriveLoad};
use converge_engine::{Drive, EngineError};
use converge_rpc::Handler;
use converge_rpc::{ErrorCode, Request, Response};
use converge_rpc::{Hello, RpcClient, RpcError};
use converge_types::{
    DriveId, Epoch, ExtentKey, ExtentState, Knobs, NodeId, SlabIndex, Version, VolumeId,
};
use converge_volume::{
    ExtentLoc, ReadReply, ReplicaError, ReplicaIo, SlabAllocator, Volume, VolumeConfig, VolumeError,
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
    pub drives: HashMap<DriveId, Arc<Drive>>,
    pub replicas: Arc<Replicas>,
    pub allocator: Arc<Allocator>,
    /// Volumes this node owns and serves, by name.
    pub volumes: tokio::sync::Mutex<HashMap<String, Arc<Vol>>>,
}

impl Node {
    pub fn lease(&self) -> LeaseId {
        *self.lease.lock().expect("lease lock poisoned")
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

    /// Serve `name`: load it if this node is its owner, claiming a new epoch.
    pub async fn open_volume(&self, name: &str) -> Result<Arc<Vol>, OpenError> {
        let mut vols = self.volumes.lock().await;
        if let Some(v) = vols.get(name) {
            return Ok(v.clone());
        }
        let Some((rec, _)) = self
            .cluster
            .volume(name)
            .await
            .map_err(|e| OpenError::Unavailable(e.to_string()))?
        else {
            return Err(OpenError::Unknown);
        };
        if rec.owner != self.cfg.node_id {
            let nodes = self.cluster.live_nodes().await.unwrap_or_default();
            let owner = nodes
                .iter()
                .find(|n| n.id == rec.owner)
                .map(|n| format!("node {} ({}, socket {})", n.id, n.name, n.nbd_socket))
                .unwrap_or_else(|| format!("node {} (not live)", rec.owner));
            return Err(OpenError::Elsewhere(owner));
        }
        let epoch = self
            .cluster
            .claim_ownership(rec.id, self.cfg.node_id, self.lease())
            .await
            .map_err(|e| OpenError::Unavailable(e.to_string()))?;
        let slabs = self
            .cluster
            .slabs(rec.id)
            .await
            .map_err(|e| OpenError::Unavailable(e.to_string()))?
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
                epoch,
                local_node: self.cfg.node_id,
            },
            slabs,
            self.replicas.clone(),
            self.allocator.clone(),
        ));
        log::info!(
            "serving volume {} (id {}) at epoch {}",
            rec.name,
            rec.id,
            epoch
        );
        vols.insert(name.to_string(), v.clone());
        Ok(v)
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

pub fn extents_of(s: &SlabRecord) -> Vec<ExtentLoc> {
    s.extents
        .iter()
        .map(|e| ExtentLoc {
            node: e.node,
            drive: e.drive,
            state: e.state,
        })
        .collect()
}

pub enum OpenError {
    Unknown,
    Elsewhere(String),
    Unavailable(String),
}

fn engine_to_replica(e: EngineError) -> ReplicaError {
    match e {
        EngineError::StaleEpoch { .. } => ReplicaError::StaleEpoch(e.to_string()),
        EngineError::ChecksumMismatch { .. } => ReplicaError::Checksum(e.to_string()),
        EngineError::NoSpace { .. } => ReplicaError::NoSpace(e.to_string()),
        other => ReplicaError::Io(other.to_string()),
    }
}

fn engine_to_response(e: EngineError) -> Response {
    let code = match &e {
        EngineError::StaleEpoch { .. } => ErrorCode::StaleEpoch,
        EngineError::ChecksumMismatch { .. } => ErrorCode::ChecksumMismatch,
        EngineError::NoSpace { .. } => ErrorCode::NoSpace,
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
    pub drives: HashMap<DriveId, Arc<Drive>>,
}

impl LocalDrives {
    fn drive(&self, id: DriveId) -> Result<Arc<Drive>, EngineError> {
        self.drives.get(&id).cloned().ok_or_else(|| {
            EngineError::InvalidArgument(format!("drive {id:016x} is not on this node", id = id.0))
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub async fn write(
        &self,
        drive: DriveId,
        key: ExtentKey,
        epoch: Epoch,
        version: Version,
        offset: u64,
        crcs: Arc<[u32]>,
        data: Bytes,
    ) -> Result<(), EngineError> {
        let d = self.drive(drive)?;
        blocking(move || d.write(key, epoch, version, offset, &data, &crcs)).await
    }

    pub async fn read(
        &self,
        drive: DriveId,
        key: ExtentKey,
        epoch: Epoch,
        offset: u64,
        len: u32,
    ) -> Result<ReadReply, EngineError> {
        let d = self.drive(drive)?;
        blocking(move || {
            let mut buf = BytesMut::zeroed(len as usize);
            let info = d.read(key, epoch, offset, &mut buf)?;
            Ok(ReadReply {
                data: buf.freeze(),
                bad_blocks: info.bad_blocks,
                version: info.versions,
            })
        })
        .await
    }

    pub async fn zero(
        &self,
        drive: DriveId,
        key: ExtentKey,
        epoch: Epoch,
        version: Version,
        offset: u64,
        len: u64,
    ) -> Result<(), EngineError> {
        let d = self.drive(drive)?;
        blocking(move || d.zero(key, epoch, version, offset, len)).await
    }

    pub async fn free(&self, drive: DriveId, key: ExtentKey) -> Result<(), EngineError> {
        let d = self.drive(drive)?;
        blocking(move || d.free_extent(key)).await
    }
}

/// The owner's path to every extent: local drives directly, peers over RPC.
pub struct Replicas {
    pub me: NodeId,
    pub local: Arc<LocalDrives>,
    pub cluster: Cluster,
    pub hello: Hello,
    pub knobs: Knobs,
    peers: RwLock<HashMap<NodeId, RpcClient>>,
}

impl Replicas {
    pub fn new(
        me: NodeId,
        local: Arc<LocalDrives>,
        cluster: Cluster,
        hello: Hello,
        knobs: Knobs,
    ) -> Replicas {
        Replicas {
            me,
            local,
            cluster,
            hello,
            knobs,
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
                RpcClient::new(rec.rpc_addr.clone(), self.hello.clone(), &self.knobs)
            })
            .clone();
        Ok(c)
    }

    async fn call(&self, node: NodeId, req: Request) -> Result<Response, ReplicaError> {
        let c = self.peer(node).await?;
        match c.call(req).await.map_err(rpc_to_replica)? {
            Response::Err { code, message } => {
                Err(rpc_to_replica(RpcError::Remote { code, message }))
            }
            r => Ok(r),
        }
    }

    pub async fn free(
        &self,
        node: NodeId,
        drive: DriveId,
        key: ExtentKey,
    ) -> Result<(), ReplicaError> {
        if node == self.me {
            return self.local.free(drive, key).await.map_err(engine_to_replica);
        }
        self.call(node, Request::FreeExtent { drive, key })
            .await
            .map(|_| ())
    }
}

impl ReplicaIo for Replicas {
    async fn write(
        &self,
        at: ExtentLoc,
        key: ExtentKey,
        epoch: Epoch,
        version: Version,
        offset: u64,
        crcs: Arc<[u32]>,
        data: Bytes,
    ) -> Result<(), ReplicaError> {
        if at.node == self.me {
            return self
                .local
                .write(at.drive, key, epoch, version, offset, crcs, data)
                .await
                .map_err(engine_to_replica);
        }
        let req = Request::Write {
            drive: at.drive,
            key,
            epoch,
            version,
            offset,
            crcs: crcs.to_vec(),
            data,
        };
        self.call(at.node, req).await.map(|_| ())
    }

    async fn read(
        &self,
        at: ExtentLoc,
        key: ExtentKey,
        epoch: Epoch,
        offset: u64,
        len: u32,
    ) -> Result<ReadReply, ReplicaError> {
        if at.node == self.me {
            return self
                .local
                .read(at.drive, key, epoch, offset, len)
                .await
                .map_err(engine_to_replica);
        }
        let req = Request::Read {
            drive: at.drive,
            key,
            epoch,
            offset,
            len,
        };
        match self.call(at.node, req).await? {
            Response::ReadOk {
                data,
                bad_blocks,
                version,
            } => {
                if data.len() != len as usize {
                    return Err(ReplicaError::Io(format!(
                        "node {} answered {} bytes for a {len}-byte read",
                        at.node,
                        data.len()
                    )));
                }
                Ok(ReadReply {
                    data,
                    bad_blocks,
                    version,
                })
            }
            other => Err(ReplicaError::Io(format!("unexpected answer {other:?}"))),
        }
    }

    async fn zero(
        &self,
        at: ExtentLoc,
        key: ExtentKey,
        epoch: Epoch,
        version: Version,
        offset: u64,
        len: u64,
    ) -> Result<(), ReplicaError> {
        if at.node == self.me {
            return self
                .local
                .zero(at.drive, key, epoch, version, offset, len)
                .await
                .map_err(engine_to_replica);
        }
        let req = Request::Zero {
            drive: at.drive,
            key,
            epoch,
            version,
            offset,
            len,
        };
        self.call(at.node, req).await.map(|_| ())
    }
}

/// Places new slabs: reads drives, live nodes and every slab's extents from etcd,
/// picks drives on distinct nodes balancing use, and records the slab (create-if-absent).
pub struct Allocator {
    pub cluster: Cluster,
}

/// Extents placed on each drive, counted from all slab records.
pub async fn extents_used(cluster: &Cluster) -> Result<HashMap<DriveId, u64>, String> {
    let (kvs, _) = cluster
        .etcd()
        .get_prefix(converge_control::model::keys::SLABS)
        .await
        .map_err(|e| e.to_string())?;
    let mut used: HashMap<DriveId, u64> = HashMap::new();
    for kv in kvs {
        if let Ok(s) = serde_json::from_slice::<SlabRecord>(&kv.value) {
            for e in s.extents {
                *used.entry(e.drive).or_default() += 1;
            }
        }
    }
    Ok(used)
}

pub async fn drive_loads(cluster: &Cluster) -> Result<Vec<DriveLoad>, String> {
    let drives: Vec<DriveRecord> = cluster.drives().await.map_err(|e| e.to_string())?;
    let live: Vec<NodeId> = cluster
        .live_nodes()
        .await
        .map_err(|e| e.to_string())?
        .iter()
        .map(|n| n.id)
        .collect();
    let used = extents_used(cluster).await?;
    Ok(drives
        .iter()
        .map(|d| DriveLoad {
            drive: d.id,
            node: d.node,
            extents_total: d.extents_total,
            extents_used: used.get(&d.id).copied().unwrap_or(0),
            live: live.contains(&d.node),
            role: d.role,
        })
        .collect())
}

impl SlabAllocator for Allocator {
    async fn allocate(
        &self,
        volume: VolumeId,
        slab: SlabIndex,
        copies: usize,
    ) -> Result<Vec<ExtentLoc>, VolumeError> {
        let ctl = |e: String| VolumeError::Control(e, volume.to_string());
        let loads = drive_loads(&self.cluster).await.map_err(ctl)?;
        let chosen = placement::place(copies, &loads, &[]).map_err(|e| VolumeError::NoSpace {
            volume: volume.to_string(),
            why: e.to_string(),
        })?;
        let rec = SlabRecord {
            extents: chosen
                .iter()
                .map(|d| {
                    let node = loads
                        .iter()
                        .find(|l| l.drive == *d)
                        .map(|l| l.node)
                        .expect("placement returns candidate drives");
                    converge_control::model::ExtentRecord {
                        drive: *d,
                        node,
                        state: ExtentState::InSync,
                    }
                })
                .collect(),
        };
        let (rec, _) = self
            .cluster
            .create_slab(volume, slab, &rec)
            .await
            .map_err(|e| ctl(e.to_string()))?;
        Ok(extents_of(&rec))
    }
}

/// Serves peers' requests against this node's drives.
pub struct RpcHandler {
    pub local: Arc<LocalDrives>,
}

impl Handler for RpcHandler {
    async fn handle(&self, _peer: NodeId, req: Request) -> Response {
        let r = match req {
            Request::Write {
                drive,
                key,
                epoch,
                version,
                offset,
                crcs,
                data,
            } => self
                .local
                .write(drive, key, epoch, version, offset, crcs.into(), data)
                .await
                .map(|_| Response::Ok),
            Request::Read {
                drive,
                key,
                epoch,
                offset,
                len,
            } => self
                .local
                .read(drive, key, epoch, offset, len)
                .await
                .map(|r| Response::ReadOk {
                    data: r.data,
                    bad_blocks: r.bad_blocks,
                    version: r.version,
                }),
            Request::Zero {
                drive,
                key,
                epoch,
                version,
                offset,
                len,
            } => self
                .local
                .zero(drive, key, epoch, version, offset, len)
                .await
                .map(|_| Response::Ok),
            Request::FreeExtent { drive, key } => {
                self.local.free(drive, key).await.map(|_| Response::Ok)
            }
            Request::Ping => Ok(Response::Pong),
            Request::Hello(_) => Ok(Response::err(ErrorCode::Invalid, "hello after handshake")),
        };
        r.unwrap_or_else(engine_to_response)
    }
}
