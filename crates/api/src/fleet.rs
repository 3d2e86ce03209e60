//! Bodies of the fleet routes (`/v1/fleet/...`): the CLI asks each node's daemon to start
//! fio workers against volumes that node owns, and to sample its CPU and drive counters, so
//! `converge fleet` works on a real multi-host cluster without SSH.

use converge_types::{DriveId, DriveRole, MediaType, NodeId};
use serde::{Deserialize, Serialize};

/// What a worker does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkerKind {
    /// Write the volume once end to end, sequentially (runs until `size_bytes` is written).
    Prefill,
    /// A measured load: `ramp_s` of warm-up, then `runtime_s` measured.
    Measure,
}

/// `POST /v1/fleet/workers`: start one fio process (1 job) against a volume this node owns.
/// The daemon builds fio's command line from these typed fields only.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerSpec {
    /// Label for logs and fio's job name (letters, digits, '-', '_', '.').
    pub name: String,
    /// Volume this node owns; fio reaches it through the node's NBD unix socket.
    pub volume: String,
    pub kind: WorkerKind,
    pub bs_bytes: u64,
    /// Outstanding I/Os of the worker (fio iodepth).
    pub qd: u32,
    /// Share of writes, 0..=100.
    pub write_pct: u8,
    /// Share of random offsets, 0..=100 (100 = random, 0 = sequential).
    pub random_pct: u8,
    /// Bytes of the volume the worker touches from offset 0 (its working set).
    pub size_bytes: u64,
    /// Warm-up seconds, excluded from fio's statistics (`Measure` only).
    pub ramp_s: u64,
    /// Measured seconds (`Measure` only).
    pub runtime_s: u64,
    /// Share of every written buffer that is a fixed, compressible pattern, 0..=100 (fio's
    /// `buffer_compress_percentage`; 0: fio's random data).
    #[serde(default)]
    pub compress_pct: u8,
    /// Share of written buffers that repeat earlier ones, 0..=100 (`dedupe_percentage`).
    #[serde(default)]
    pub dedupe_pct: u8,
    /// Run fio inside a guest (`converge fleet run --vms`) rather than on the host: the
    /// node offers the volume as a vhost-user-blk disk, boots the guest and, once the CLI
    /// says go (`POST …/go`), runs the measurement there (`Measure` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm: Option<VmWorker>,
}

/// How a worker's guest runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmWorker {
    /// Directory on the node with the guest's `vmlinuz` and `initrd.gz`
    /// (`scripts/guest-image.sh --with-fio`).
    pub image: String,
    /// qemu's accelerator: `kvm` (hardware virtualization) or `tcg` (emulation).
    pub accel: String,
    /// Guest memory, MiB.
    pub memory_mib: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkerState {
    Running,
    /// fio exited by itself with status 0: its JSON result is ready.
    Done,
    /// fio exited with an error or could not start; `message` says why.
    Failed,
    /// Stopped on request (its result, if fio wrote one, is partial).
    Stopped,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WorkerStatus {
    pub id: u64,
    pub node: NodeId,
    pub spec: WorkerSpec,
    pub state: WorkerState,
    /// PID of fio while it runs.
    pub pid: Option<i32>,
    pub exit_code: Option<i32>,
    /// Why it failed: fio's exit status and the end of its stderr.
    pub message: Option<String>,
    pub elapsed_ms: u64,
    /// A guest worker (`spec.vm`) still booting: it measures nothing until it is up and
    /// told to go.
    #[serde(default)]
    pub booting: bool,
}

/// A drive as the fleet reports it, with its endurance rating if the node's config has one.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FleetDrive {
    pub id: DriveId,
    pub node: NodeId,
    pub path: String,
    pub role: DriveRole,
    pub media: MediaType,
    pub size_bytes: u64,
    /// Rated lifetime writes (`tbw` in the node config), bytes.
    pub tbw_bytes: Option<u64>,
    pub warranty_years: Option<f64>,
}

/// `GET /v1/fleet/node`: what the report needs to state about this node.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FleetNode {
    pub node: NodeId,
    pub name: String,
    pub hostname: String,
    /// Identifies the host (its boot id): lab nodes on one machine share it.
    pub host_id: String,
    pub kernel: String,
    pub cpus: u32,
    pub converged_version: String,
    /// `fio --version` on this node, or None with `fio_error` saying why.
    pub fio_version: Option<String>,
    pub fio_error: Option<String>,
    pub nbd_socket: String,
    /// Most requests in flight on one NBD connection: the highest usable QD.
    pub nbd_inflight_max: usize,
    pub drives: Vec<FleetDrive>,
}

/// Cumulative counters of one drive (engine counters, see `converge_engine::DriveStats`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct DriveCounters {
    pub id: DriveId,
    pub read_ops: u64,
    pub write_ops: u64,
    pub read_bytes: u64,
    /// Every byte written: data + journal + metadata.
    pub write_bytes: u64,
    pub data_write_bytes: u64,
    pub journal_write_bytes: u64,
    pub metadata_write_bytes: u64,
    /// Time integral of outstanding engine operations, ns.
    pub inflight_time_ns: u64,
}

/// Cumulative client I/O counters of one volume this node owns (what the NBD clients —
/// the workers — asked for, before replication).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct VolumeIoCounters {
    pub name: String,
    pub read_ops: u64,
    pub read_bytes: u64,
    pub write_ops: u64,
    pub write_bytes: u64,
}

/// `GET /v1/fleet/sample`: cumulative counters now; the fleet takes one before and one
/// after the measured window and works with the differences.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct FleetSample {
    pub node: NodeId,
    pub host_id: String,
    /// Monotonic clock of the daemon, ns: the window's length.
    pub mono_ns: u64,
    /// Host CPU time from /proc/stat, in clock ticks: busy (user, nice, system, irq,
    /// softirq, steal) and total (busy + idle + iowait).
    pub host_busy_ticks: u64,
    pub host_total_ticks: u64,
    /// CPU seconds (user + system) used by this `converged`.
    pub converged_cpu_s: f64,
    pub drives: Vec<DriveCounters>,
    /// Volumes this node serves: client bytes counted in the same window as the drives'.
    #[serde(default)]
    pub volumes: Vec<VolumeIoCounters>,
}
