//! The HTTP API's request and response bodies (JSON), one definition for both ends so the
//! CLI and the daemon cannot drift apart. Paths are under `/v1/`; errors are
//! `{"error": "..."}` with a 4xx/5xx status.

use converge_types::{
    ClusterId, DriveId, DriveRole, ExtentState, MediaType, NodeId, Resiliency, VolumeId,
};
use serde::{Deserialize, Serialize};

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
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ExtentInfo {
    pub drive: DriveId,
    pub node: NodeId,
    pub state: ExtentState,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SlabInfo {
    pub index: u64,
    pub extents: Vec<ExtentInfo>,
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
    /// Bytes of slabs allocated (thin provisioning), per copy.
    pub allocated_bytes: u64,
    /// Extents not in sync.
    pub degraded_extents: u64,
    /// Present in `GET /v1/volumes/NAME`, absent in lists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slabs: Option<Vec<SlabInfo>>,
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
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ResizeVolume {
    pub size_bytes: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Capacity {
    pub total_bytes: u64,
    /// Bytes of extents placed (each copy counts).
    pub used_bytes: u64,
    /// Sum of volume sizes × copies (thin provisioning: may exceed total).
    pub provisioned_bytes: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Status {
    pub cluster: ClusterInfo,
    /// `healthy`, or `degraded: ...` with the reasons.
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
    /// The node that answered.
    pub answered_by: NodeId,
}

/// Cluster-wide settings (`/v1/settings`), overriding the nodes' knobs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Settings {
    /// Seconds a down node's copies wait before they are rebuilt elsewhere.
    #[serde(default)]
    pub repair_delay_s: Option<u64>,
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
