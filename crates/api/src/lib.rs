//! The HTTP API's request and response bodies (JSON), one definition for both ends so the
//! CLI and the daemon cannot drift apart. Paths are under `/v1/`; errors are
//! `{"error": "..."}` with a 4xx/5xx status.

pub use converge_types::Role;
use converge_types::{
    CacheMode, ClusterId, Compression, DriveId, DriveRole, ExtentState, MediaType, NodeId,
    Resiliency, VolumeId,
};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub mod fleet;
pub mod lab;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ClusterInfo {
    pub id: ClusterId,
    pub name: String,
    pub slab_size_bytes: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NodeInfo {
    pub id: NodeId,
    pub name: String,
    pub live: bool,
    pub rpc_addr: String,
    pub api_addr: String,
    pub nbd_socket: String,
    pub nbd_tcp: Option<String>,
    pub version: String,
    /// In maintenance: its copies are stale, it owns no volume, nothing new is placed
    /// there and nothing is rebuilt away from it.
    #[serde(default)]
    pub maintenance: bool,
    /// Being drained for removal (`converge node remove`): its copies move to other nodes,
    /// copy before drop, and nothing new is placed there.
    #[serde(default)]
    pub draining: bool,
}

impl NodeInfo {
    /// A node known only by its drives (no live record): down, with no addresses.
    pub fn down(id: NodeId) -> NodeInfo {
        NodeInfo {
            id,
            name: format!("node{id}"),
            live: false,
            rpc_addr: String::new(),
            api_addr: String::new(),
            nbd_socket: String::new(),
            nbd_tcp: None,
            version: String::new(),
            maintenance: false,
            draining: false,
        }
    }
}

/// `POST /v1/nodes/ID/drain`: start (or cancel) moving every copy off a node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Drain {
    pub on: bool,
}

/// `DELETE /v1/nodes/ID`: what the removal of a drained node did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRemoved {
    pub node: NodeId,
    /// Volumes it served that moved to other nodes first.
    pub moved: Vec<String>,
    /// Its drives, whose records were deleted.
    pub drives: Vec<DriveId>,
}

/// `POST /v1/nodes/ID/maintenance`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Maintenance {
    pub on: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DriveInfo {
    pub id: DriveId,
    pub node: NodeId,
    pub path: String,
    pub role: DriveRole,
    pub media: MediaType,
    pub size_bytes: u64,
    pub extents_total: u64,
    /// Extents placed on this drive by slab maps.
    pub extents_used: u64,
    pub slab_size_bytes: u64,
    /// Why the drive failed (I/O errors), if it did: its copies are rebuilt elsewhere.
    #[serde(default)]
    pub failed: Option<String>,
    /// For a capacity drive: the cache drive it is bound to (if its node has one).
    #[serde(default)]
    pub cache: Option<DriveId>,
    /// Bytes of blocks holding data in the drive's extents (every copy and chunk counts);
    /// present in `/v1/status` for drives of live nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub written_bytes: Option<u64>,
    /// Bytes that data takes on the drive (compressed groups take less).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_bytes: Option<u64>,
    /// A thin drive's extent slots (more than `extents_total`: compressed extents take
    /// only what they store, docs/adr/0010); absent: as many as `extents_total`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots_total: Option<u64>,
    /// Bytes its extents claim: what its node last reported they claim (compressed ones
    /// less than whole, blocks kept for snapshots more), an extent placed since counted
    /// whole: what counts as used, and what placement counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub committed_bytes: Option<u64>,
    /// Lifetime writes and the endurance forecast (`/v1/status`; absent until the drive's
    /// node has counted it once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wear: Option<DriveWear>,
}

/// A drive's lifetime writes, as its node keeps them across restarts, and what its write
/// rates do to its rated endurance (docs/ENDURANCE.md).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DriveWear {
    /// Bytes written to the device since converge first counted it (data, journal,
    /// metadata: what wears it).
    pub lifetime_written_bytes: u64,
    /// When converge first counted it (unix seconds); the warranty is counted from here.
    pub first_seen_unix: u64,
    /// When its node last counted it.
    pub updated_unix: u64,
    /// Write rates, bytes per second, over the last hour, day and week (`1h`, `24h`,
    /// `7d`), each with the seconds it was measured over (shorter while the history is).
    pub write_rates: Vec<WearRate>,
    /// Rated endurance, bytes (the drive's `tbw`, else its media's default; none for RAM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rated_tbw_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warranty_years: Option<f64>,
    /// Share of the rated TBW written so far, percent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used_pct: Option<f64>,
    /// Days until the rated TBW is written at the rate of `rate_window` (absent: no rating,
    /// or no writes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub days_to_rated_tbw: Option<f64>,
    /// The longest window with a rate: the one the forecast uses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_window: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warranty_ends_unix: Option<u64>,
    /// At that rate the drive reaches its rated TBW before its warranty ends.
    pub wears_out_before_warranty: bool,
    /// Seconds of history the forecast's rate comes from; `status` warns only from an
    /// hour or more.
    #[serde(default)]
    pub forecast_span_s: u64,
}

/// One write rate of a [`DriveWear`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WearRate {
    /// `1h`, `24h` or `7d`.
    pub window: String,
    pub bytes_per_s: f64,
    /// Seconds it was measured over.
    pub over_s: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ExtentInfo {
    pub drive: DriveId,
    pub node: NodeId,
    pub state: ExtentState,
    /// A stale copy the slab record marks as holding every acked write: it may be made
    /// the slab's in-sync copy if every in-sync copy is lost (docs/CONSISTENCY.md).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub holds_acked: bool,
    /// Bytes of blocks holding data in this copy or chunk (absent: its node did not
    /// answer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub written_bytes: Option<u64>,
    /// Bytes of its drive this copy's data takes (compressed groups take less).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_bytes: Option<u64>,
}

/// One extent on a node's capacity drive, as `GET /v1/extents` lists them (the node's
/// own drives only; `/v1/volumes/NAME` and `/v1/status` gather them from every node).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalExtent {
    pub drive: DriveId,
    pub volume: VolumeId,
    pub slab: u64,
    /// Bytes of blocks holding data (written and not zeroed or trimmed since).
    pub written_bytes: u64,
    /// Bytes of the drive that data takes (less than written where compression saves);
    /// absent from nodes of older builds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_bytes: Option<u64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SlabInfo {
    /// The slab's index: byte offset / slab span, or for a mirror-part slab of a volume
    /// with a mirror part, bit 62 set and byte offset / extent size (shown as `m<n>`).
    pub index: u64,
    pub extents: Vec<ExtentInfo>,
}

/// A parity volume's mirror part (mirror-accelerated parity, docs/adr/0009), from its
/// slab records.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MirrorPartInfo {
    /// Volume bytes the mirror part may hold.
    pub size_bytes: u64,
    /// The mirror it uses (mirror-2 for parity-K+1, mirror-3 for parity-K+2).
    pub resiliency: Resiliency,
    /// Volume bytes held in the mirror part (allocated extents).
    pub mirror_bytes: u64,
    /// Volume bytes held in parity (allocated spans of K extents).
    pub parity_bytes: u64,
    /// Spans the owner rotated into parity and the bytes they held, in its current term
    /// (absent when the node that answered does not serve the volume).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotations: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotated_bytes: Option<u64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VolumeInfo {
    pub id: VolumeId,
    pub name: String,
    pub size_bytes: u64,
    pub resiliency: Resiliency,
    pub min_replicas: usize,
    pub slab_size_bytes: u64,
    pub owner: NodeId,
    pub owner_name: String,
    /// `nbd+unix:///NAME?socket=PATH` on the owner node.
    pub uri: String,
    /// `nbd://HOST:PORT/NAME` when the owner listens on TCP.
    pub uri_tcp: Option<String>,
    pub slabs_allocated: u64,
    /// How the copies compress the volume's data (docs/adr/0010).
    #[serde(default)]
    pub compression: Compression,
    /// Encryption at rest (docs/adr/0011); absent: not encrypted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encryption: Option<EncryptionInfo>,
    /// QoS limits and reservation (docs/QOS.md).
    #[serde(default)]
    pub qos: converge_types::Qos,
    /// Volume bytes in allocated slabs (thin provisioning), each slab counted once: a
    /// mirror slab spans one extent, a parity-K+M slab K extents (its data chunks).
    pub allocated_bytes: u64,
    /// Volume bytes that hold data (written and not trimmed or zeroed since): per slab,
    /// the data blocks of its fullest copy, or of its data chunks. Absent when a node
    /// holding the only copies that tell is down.
    /// Writes still in a write-back cache's log count once destaged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub written_bytes: Option<u64>,
    /// Bytes one copy of that data takes on its drive (the copy that gave
    /// `written_bytes`): less than written where compression saves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_bytes: Option<u64>,
    /// Extents not in sync.
    pub degraded_extents: u64,
    /// Mirror-accelerated parity: the mirror part and what each part holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mirror_part: Option<MirrorPartInfo>,
    /// Present in `GET /v1/volumes/NAME`, absent in lists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slabs: Option<Vec<SlabInfo>>,
    /// A clone's parent snapshot, `VOLUME@SNAPSHOT` (None: not a clone, or flattened).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
}

/// `POST /v1/volumes/NAME/snapshots/SNAP/clone`: a new volume that reads as the snapshot
/// until written (docs/SNAPSHOTS.md "Clones").
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CreateClone {
    pub name: String,
    /// Preferred owner; default: the node answering.
    #[serde(default)]
    pub owner: Option<converge_types::NodeId>,
    /// simple, mirror-2 or mirror-3; default: the parent's.
    #[serde(default)]
    pub resiliency: Option<converge_types::Resiliency>,
    #[serde(default)]
    pub qos: Option<converge_types::Qos>,
    /// How the clone's own writes are compressed (mirror clones); default: none.
    #[serde(default)]
    pub compression: Option<Compression>,
}

/// What `POST /v1/volumes/NAME/flatten` did.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Flattened {
    pub volume: String,
    /// The parent snapshot it no longer reads from.
    pub parent: String,
    /// Bytes copied from the parent.
    pub bytes: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CreateVolume {
    pub name: String,
    pub size_bytes: u64,
    pub resiliency: Resiliency,
    /// Default: the node that receives the request.
    #[serde(default)]
    pub owner: Option<NodeId>,
    #[serde(default)]
    pub min_replicas: Option<usize>,
    /// Mirror-accelerated parity: volume bytes of a mirror part (parity-K+1 and
    /// parity-K+2 only), rounded up to whole extents. Absent or 0: none.
    #[serde(default)]
    pub mirror_part_bytes: Option<u64>,
    /// How the copies compress the volume's data (mirror and simple volumes). Absent:
    /// none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<Compression>,
    /// Encrypt the volume at rest (AES-256-XTS, docs/adr/0011) with a new data key wrapped
    /// by the receiving node's current cluster key. Not with compression.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub encrypt: bool,
    /// QoS limits and reservation (docs/QOS.md). Absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qos: Option<converge_types::Qos>,
}

/// An encrypted volume's cipher and the cluster key its data key is wrapped with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EncryptionInfo {
    pub cipher: String,
    pub key_id: u32,
}

/// `POST /v1/volumes/NAME/rekey`: what re-wrapping did.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Rekeyed {
    pub name: String,
    pub from_key: u32,
    pub to_key: u32,
}

/// `POST /v1/volumes/NAME/settings`: what to change (absent: unchanged).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeSettings {
    /// How later writes are compressed; stored data keeps its form until written again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<Compression>,
    /// QoS settings, replacing the volume's whole (absent fields: none), in force for the
    /// next I/O (docs/QOS.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qos: Option<converge_types::Qos>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ResizeVolume {
    pub size_bytes: u64,
}

/// `POST /v1/volumes/NAME/snapshots` (docs/SNAPSHOTS.md).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CreateSnapshot {
    pub name: String,
}

/// One snapshot of a volume.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotInfo {
    pub name: String,
    /// The owner's epoch the snapshot closed: it holds every write of that epoch or before.
    pub epoch: converge_types::Epoch,
    pub created_unix: u64,
    /// The volume's size when the snapshot was taken (its export's size).
    pub size_bytes: u64,
    /// `nbd+unix:///VOLUME@SNAPSHOT?socket=PATH`: the snapshot as a read-only export.
    pub uri: String,
    /// Clones made from it (it cannot be deleted while one still reads from it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clones: Vec<String>,
    /// Bytes the drives keep for it, on every copy and chunk (asked with `?space=1`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept_bytes: Option<u64>,
    /// Of those, the bytes deleting it would free (the rest the next older snapshot
    /// reads too, and keeps).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub freed_by_delete_bytes: Option<u64>,
    /// Copies that did not answer the space question (their share is missing above).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub space_copies_unanswered: Option<u64>,
}

/// `GET /v1/volumes/NAME/changes?from=A[&to=B][&offset=O&length=L]`: the byte runs of
/// the volume that read differently at snapshot `from` and at snapshot `to` (absent: now),
/// in 4 KiB blocks, over `[offset, offset + length)`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Changes {
    pub volume: String,
    pub from: String,
    /// `None`: the volume as it is now (writes racing the question may or may not show).
    pub to: Option<String>,
    /// The range asked about (the whole volume, as `to` sees it, by default).
    pub offset: u64,
    pub length: u64,
    /// The volume's size at `to` (its export's size).
    pub size_bytes: u64,
    /// Sum of the runs' lengths.
    pub changed_bytes: u64,
    /// Changed runs, in order, neither overlapping nor touching, each a whole number of
    /// 4 KiB blocks.
    pub runs: Vec<ChangedRun>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChangedRun {
    pub offset: u64,
    pub length: u64,
}

/// What `POST /v1/volumes/NAME/snapshots/SNAP/rollback` did.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RolledBack {
    pub volume: String,
    pub snapshot: String,
    /// Volume bytes rewritten from the snapshot.
    pub bytes: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Capacity {
    /// Raw bytes of every capacity drive (failed ones excluded).
    pub total_bytes: u64,
    /// Bytes of extents placed (each copy counts).
    pub used_bytes: u64,
    /// Sum of volume sizes × copies (thin provisioning: may exceed total).
    pub provisioned_bytes: u64,
    /// Raw bytes not placed: total − used.
    #[serde(default)]
    pub free_bytes: u64,
    /// Volume data allocated (slabs written at least once), each slab once whatever its
    /// copies.
    #[serde(default)]
    pub allocated_bytes: u64,
    /// Volume data written (the volumes' `written_bytes` summed); absent when one of them
    /// is unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub written_bytes: Option<u64>,
    /// Bytes the volumes' data takes on the drives, every copy and chunk counted (the
    /// drives' stored bytes summed); absent when a node did not answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_bytes: Option<u64>,
    /// Bytes compression saves on the drives, every copy counted: what the copies hold
    /// written less what they store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression_saved_bytes: Option<u64>,
    /// What must stay free on the other nodes for the copies of the node holding the most
    /// to be rebuilt if it failed: that node's used bytes, and the node.
    #[serde(default)]
    pub rebuild_reserve_bytes: u64,
    #[serde(default)]
    pub rebuild_reserve_node: Option<NodeId>,
    /// Volume data the pool holds at each resiliency (`simple`, `mirror-2`, `mirror-3`)
    /// when empty: the copies on distinct nodes, so uneven nodes hold less than raw ÷ copies,
    /// and fewer nodes than copies hold nothing.
    #[serde(default)]
    pub usable_bytes: std::collections::BTreeMap<String, u64>,
    /// What is wrong or about to be: the pool can no longer rebuild its fullest node, or
    /// soon cannot; it is near full or full; it is overcommitted.
    #[serde(default)]
    pub warnings: Vec<String>,
    /// How full the pool is (docs/CAPACITY.md): `ok`, `near-full` (85 % of raw used) or
    /// `full` (95 %, or no room for a new slab of some volume's layout).
    #[serde(default)]
    pub state: PoolState,
    /// The overcommit ratio in effect, in percent (provisioned may reach this share of
    /// raw).
    #[serde(default)]
    pub overcommit_pct: u32,
}

impl Status {
    /// Every node live, every copy in sync, no repair running: `healthy`, or a pool that is
    /// only short of room (`near-full`, `full`), which restarting a node does not make worse.
    pub fn redundant(&self) -> bool {
        !self.health.starts_with("degraded")
    }
}

/// How full the pool is, as `status` reports it (docs/CAPACITY.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PoolState {
    #[default]
    Ok,
    /// 85 % of raw capacity or more is used.
    NearFull,
    /// 95 % or more is used, or a new slab of some volume cannot be placed: writes to
    /// space not yet allocated fail with ENOSPC.
    Full,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Status {
    pub cluster: ClusterInfo,
    /// `healthy`; `near-full: ...` or `full: ...` when only capacity is short
    /// ([`Capacity::state`]); or `degraded: ...` with the reasons (and the capacity state
    /// after them, if not ok).
    pub health: String,
    pub nodes: Vec<NodeInfo>,
    pub drives: Vec<DriveInfo>,
    pub volumes: Vec<VolumeInfo>,
    pub capacity: Capacity,
    /// Background jobs running now (resync, rebuild, scrub), from every node.
    #[serde(default)]
    pub jobs: Vec<JobInfo>,
    /// Why the cluster cannot restore full redundancy, if it cannot (e.g. no room for a
    /// rebuild).
    #[serde(default)]
    pub warnings: Vec<String>,
    /// Every cache drive of the cluster, as its node last published it.
    #[serde(default)]
    pub caches: Vec<CacheInfo>,
    /// The node that answered.
    pub answered_by: NodeId,
    /// The control plane's etcd as the answering node sees it (absent from older nodes).
    #[serde(default)]
    pub etcd: Option<EtcdInfo>,
}

/// The cluster's etcd: each member's status and the alarms raised (`status`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EtcdInfo {
    pub members: Vec<EtcdMember>,
    /// Alarms raised, e.g. `NOSPACE on member 3a32b120a5b062ca`.
    #[serde(default)]
    pub alarms: Vec<String>,
}

/// One etcd member, by the client URL the nodes use.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EtcdMember {
    pub endpoint: String,
    /// Member id (hex), when it answered.
    #[serde(default)]
    pub id: Option<String>,
    #[serde(default)]
    pub leader: bool,
    /// Store revision applied.
    #[serde(default)]
    pub revision: i64,
    /// Bytes of its database file, and of live data in it (the rest a defragmentation
    /// gives back).
    #[serde(default)]
    pub db_size_bytes: u64,
    #[serde(default)]
    pub db_in_use_bytes: u64,
    #[serde(default)]
    pub version: String,
    /// Why it did not answer, if it did not.
    #[serde(default)]
    pub error: Option<String>,
}

/// One cache drive, as its node publishes it (`/converge/caches/<node>` in etcd: its mode,
/// binding and failure as they change, its counters at most every 30 s).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CacheInfo {
    pub node: NodeId,
    pub drive: DriveId,
    pub path: String,
    pub media: MediaType,
    /// The mode in effect now.
    pub mode: CacheMode,
    /// Capacity drives of the same node bound to this cache drive.
    pub bound: Vec<DriveId>,
    /// Bytes of the log (the cache drive minus its superblocks).
    pub log_bytes: u64,
    /// Bytes of the log in use (dirty, clean read-cache and not yet reclaimed).
    pub used_bytes: u64,
    /// Acked writes not yet destaged to capacity.
    pub dirty_bytes: u64,
    /// Read-cache blocks held (read-write mode).
    pub clean_bytes: u64,
    /// Destage rate over the last publishing interval.
    pub destage_bytes_per_s: f64,
    /// Read hits ÷ reads of blocks (since start).
    pub read_hit_ratio: Option<f64>,
    /// Why the cache drive failed, if it did.
    #[serde(default)]
    pub failed: Option<String>,
}

/// `POST /v1/cache/mode`: set the cache mode of the pool (`node` absent) or of one node.
/// `mode` absent clears the setting (back to the media default, or to the pool's).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetCacheMode {
    #[serde(default)]
    pub mode: Option<CacheMode>,
    #[serde(default)]
    pub node: Option<NodeId>,
}

/// Cluster-wide settings (`/v1/settings`), overriding the nodes' knobs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Settings {
    /// Seconds a down node's copies wait before they are rebuilt elsewhere.
    #[serde(default)]
    pub repair_delay_s: Option<u64>,
    /// Cache mode of the whole pool; absent: by capacity media (write for flash,
    /// read-write for HDD).
    #[serde(default)]
    pub cache_mode: Option<CacheMode>,
    /// Per-node cache modes, overriding the pool's.
    #[serde(default)]
    pub node_cache_modes: BTreeMap<NodeId, CacheMode>,
    /// The overcommit ratio, in percent: the volumes' provisioned bytes (sizes × their
    /// resiliency's raw multiplier) may reach this share of the pool's raw capacity, and a
    /// volume create, resize or clone beyond it is refused (docs/CAPACITY.md). Absent:
    /// [`OVERCOMMIT_PCT_DEFAULT`] (1.0×: no overcommit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overcommit_pct: Option<u32>,
}

/// The overcommit ratio when none is set: provisioned may reach raw (1.0×), no more.
pub const OVERCOMMIT_PCT_DEFAULT: u32 = 100;
/// Bounds of the overcommit ratio, in percent (0.1× to 100×).
pub const OVERCOMMIT_PCT_MIN: u32 = 10;
pub const OVERCOMMIT_PCT_MAX: u32 = 10_000;

impl Settings {
    /// Refuses values the cluster cannot run with (the same bounds as the nodes' knobs).
    pub fn check(&self) -> Result<(), String> {
        if let Some(d) = self.repair_delay_s {
            if d > converge_types::REPAIR_DELAY_S_MAX {
                return Err(format!(
                    "repair_delay_s = {d} is above {} (30 days): rebuilds would all but never start",
                    converge_types::REPAIR_DELAY_S_MAX
                ));
            }
        }
        if let Some(p) = self.overcommit_pct {
            if !(OVERCOMMIT_PCT_MIN..=OVERCOMMIT_PCT_MAX).contains(&p) {
                return Err(format!(
                    "overcommit_pct = {p} is outside {OVERCOMMIT_PCT_MIN}..={OVERCOMMIT_PCT_MAX} \
                     (an overcommit ratio of 0.1 to 100; 100 = 1.0: provisioned may reach raw)"
                ));
            }
        }
        Ok(())
    }

    /// The overcommit ratio in effect, in percent.
    pub fn overcommit_pct(&self) -> u32 {
        self.overcommit_pct.unwrap_or(OVERCOMMIT_PCT_DEFAULT)
    }
}

/// `POST /v1/volumes/NAME/scrub`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScrubRequest {
    /// Wait for the scrub to finish and answer its result (else it runs as a job).
    #[serde(default)]
    pub wait: bool,
    /// Rewrite bad or disagreeing blocks from a good copy (default true).
    #[serde(default = "yes")]
    pub repair: bool,
}

fn yes() -> bool {
    true
}

/// The result of one volume's scrub.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScrubResult {
    pub volume: String,
    /// The node that ran it (the volume's owner).
    pub node: NodeId,
    pub started_unix: u64,
    pub finished_unix: u64,
    pub blocks_checked: u64,
    pub bytes_read: u64,
    pub bad_checksums: u64,
    pub mismatches: u64,
    pub repaired: u64,
    /// Blocks read at a snapshot (their bad checksums, mismatches and repairs count above).
    #[serde(default)]
    pub snapshot_blocks_checked: u64,
    /// Of the bad checksums, snapshot blocks no in-sync copy holding the snapshot has whole.
    #[serde(default)]
    pub snapshot_blocks_lost: u64,
    /// Set if the scrub stopped early.
    pub error: Option<String>,
}

/// `POST /v1/volumes/NAME/move`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoveVolume {
    pub to: NodeId,
}

/// A background job: a resync of a returning copy, a rebuild of a lost one, a scrub.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobInfo {
    /// `resync`, `rebuild` or `scrub`.
    pub kind: String,
    /// The node running it.
    pub node: NodeId,
    pub volume: String,
    pub slab: u64,
    /// What is copied where, in words.
    pub detail: String,
    pub bytes_done: u64,
    /// Known once the job has compared versions (0 before).
    pub bytes_total: u64,
    pub started_unix: u64,
    /// Seconds left at the current rate, if known.
    pub eta_s: Option<u64>,
}

/// `POST /v1/tokens` (admin).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateToken {
    /// What it is for ("ci", "grafana", a person's name).
    pub name: String,
    pub role: Role,
    /// Seconds it may be used from now (at most [`TOKEN_TTL_S_MAX`]); absent: until
    /// revoked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_in_s: Option<u64>,
}

/// The longest an expiring API token may be made to last: ten years.
pub const TOKEN_TTL_S_MAX: u64 = 10 * 366 * 24 * 3600;

/// One API token as listed (`GET /v1/tokens`): never the secret.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenInfo {
    pub id: String,
    pub name: String,
    pub role: Role,
    pub created_unix: u64,
    /// When it stops being accepted (unix seconds); absent: when revoked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_unix: Option<u64>,
}

/// The answer to `POST /v1/tokens`: the token itself, shown this once.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreatedToken {
    #[serde(flatten)]
    pub info: TokenInfo,
    pub token: String,
}

/// `POST /v1/join-tokens` (admin): a one-time token for a new host to get node `node`'s
/// certificate at `hosts`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateJoinToken {
    pub node: NodeId,
    pub hosts: Vec<String>,
    /// How long it may be used (default 1 hour, at most 7 days).
    #[serde(default)]
    pub ttl_s: Option<u64>,
    /// The id is in use (a node registered it, has drives, or has a certificate): give it
    /// to a new host anyway, revoking the old host's certificates when the new one is
    /// issued. Without it such an id is refused; a removed id is refused always.
    #[serde(default)]
    pub replace: bool,
}

/// The answer: the token (shown once; etcd keeps its hash) and what it is for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreatedJoinToken {
    /// `cvj.<id>.<secret>.<CA fingerprint>`: the fingerprint lets the joining host check
    /// the cluster it talks to before it trusts it.
    pub token: String,
    pub id: String,
    pub node: NodeId,
    pub hosts: Vec<String>,
    pub expires_unix: u64,
}

/// `POST /v1/join` (no API token: the join token is the credential).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinRequest {
    pub token: String,
    /// The new host's public key (an uncompressed P-256 point), hex; its private key never
    /// leaves that host.
    pub public_key_hex: String,
}

/// The answer to a join: the new node's certificate and the cluster's CA certificate.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Joined {
    pub node: NodeId,
    pub cert_pem: String,
    pub ca_pem: String,
    /// The clients CA's certificate (what the node's NBD/TCP port trusts), if the cluster
    /// has one.
    #[serde(default)]
    pub clients_ca_pem: Option<String>,
}

/// `POST /v1/certs/revoke` (admin): refuse this certificate everywhere from now on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevokeCert {
    /// The serial number, hex (`openssl x509 -noout -serial`, or `converge cert revoke
    /// FILE` reads it).
    pub serial: String,
    /// Whose it is ("NBD client qemu-host4"), for the list.
    #[serde(default)]
    pub subject: Option<String>,
    #[serde(default)]
    pub reason: Option<String>,
}

/// A revoked certificate (`GET /v1/certs/revoked`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevokedCert {
    pub serial: String,
    pub subject: String,
    pub reason: String,
    pub revoked_unix: u64,
}

/// `GET /v1/cache/advice` (one node): what the node's working-set estimator saw of the
/// client I/O its capacity drives served since it started (docs/CACHE.md, "Cache advice").
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct CacheAdvice {
    pub node: NodeId,
    /// The node's cache drives' logs together, bytes; 0 without cache drives.
    pub cache_bytes: u64,
    pub cache_drives: usize,
    /// The cache drives' modes (`none`, `write`, `read-write`), one per cache drive.
    pub cache_modes: Vec<String>,
    /// Block accesses (4 KiB) counted since the node started, all of them.
    pub accesses: u64,
    /// Over every access of the node (what a cache in front of all its capacity drives
    /// sees).
    pub mrc: converge_types::mrc::Mrc,
    /// Per volume, over its accesses on this node.
    pub volumes: Vec<VolumeMrc>,
    /// The cache tier's own policy simulated on the same sample at a few cache sizes
    /// (read-write at ¼ to 4 times `cache_bytes`, or 128 MiB to 4 GiB without cache
    /// drives; and at `cache_bytes` in the cache's mode if it is another): what the tier
    /// would hit, where `mrc` is what an LRU cache could. Absent from older nodes.
    #[serde(default)]
    pub tier: Vec<converge_types::mrc::TierHit>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct VolumeMrc {
    pub volume: VolumeId,
    pub mrc: converge_types::mrc::Mrc,
}

/// `POST /v1/vhost`: offer a volume (or a snapshot, `VOLUME@SNAPSHOT`, read-only) to a
/// qemu guest on this node as a vhost-user-blk disk.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachVhost {
    pub volume: String,
    /// Queues offered (1 to 16; default 2); the guest uses at most this many.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queues: Option<u16>,
    /// When a guest starts on the disk (boots, or is migrated in: its first request), this
    /// node becomes the volume's owner (`volume move`), so its I/O is served here rather
    /// than forwarded. Default true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_follows: Option<bool>,
}

/// One vhost-user-blk disk of a node (`GET /v1/vhost`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VhostInfo {
    pub node: NodeId,
    pub volume: String,
    /// The unix socket qemu connects to (`-chardev socket,path=…`).
    pub socket: String,
    pub queues: u16,
    /// This node takes the volume over when a guest starts on the disk.
    pub owner_follows: bool,
    /// A guest is connected now.
    pub connected: bool,
    pub requests: u64,
    /// Requests answered with an error status.
    pub errors: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
}
