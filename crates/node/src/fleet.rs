//! The daemon's half of `converge fleet`: fio workers this node starts against volumes it
//! owns (the HCI layout: a VM's disk is served by the node the VM runs on), and samples of
//! the host's CPU, this daemon's CPU seconds and every local drive's counters. The CLI
//! drives every node through these routes, so a fleet needs no SSH on a real cluster.
//!
//! Workers are child processes of this daemon, tracked by the PID it got from spawning
//! them; a worker is only ever signalled while it has not been reaped, so a PID can never
//! have been reused by someone else. Every worker has a bounded lifetime.

use crate::node::Node;
use converge_api::fleet::{
    DriveCounters, FleetDrive, FleetNode, FleetSample, VmWorker, VolumeIoCounters, WorkerKind,
    WorkerSpec, WorkerState, WorkerStatus,
};
use converge_types::{BLOCK_SIZE, MAX_IO_BYTES};
use hyper::{Method, StatusCode};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Most workers alive on one node at once.
const WORKERS_MAX: usize = 256;
/// Ended workers remembered (with their result files) until the CLI deletes them.
const ENDED_KEPT_MAX: usize = 1024;
/// A measuring worker is killed this long after its warm-up + runtime should have ended.
const WORKER_GRACE_S: u64 = 120;
/// A pre-fill worker is killed after this long whatever its size.
const PREFILL_LIFETIME_MAX_S: u64 = 24 * 3600;
/// Longest warm-up + runtime accepted, seconds (a week).
const RUN_S_MAX: u64 = 7 * 24 * 3600;
/// A guest worker has this long to boot, beyond its measuring bound.
const GUEST_BOOT_MAX_S: u64 = 600;
/// After SIGTERM, fio gets this long to write its result before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(5);
/// Percentiles fio prints itself (the fleet merges its own from fio's histogram bins).
const FIO_PERCENTILES: &str = "50:90:99:99.9:99.99:99.999";

pub type FleetResult = Result<(StatusCode, serde_json::Value), (StatusCode, String)>;

struct Worker {
    status: WorkerStatus,
    started: Instant,
    output: PathBuf,
    stderr: PathBuf,
    stop: Option<oneshot::Sender<()>>,
    /// A guest worker's start signal (sent once it has booted and the CLI says go).
    go: Option<oneshot::Sender<()>>,
}

#[derive(Default)]
struct Registry {
    next_id: u64,
    workers: BTreeMap<u64, Worker>,
}

/// Workers are children of this process, so their registry is process-wide too.
fn registry() -> &'static Mutex<Registry> {
    static R: OnceLock<Mutex<Registry>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(Registry::default()))
}

fn lock() -> std::sync::MutexGuard<'static, Registry> {
    registry().lock().unwrap_or_else(|p| p.into_inner())
}

fn mono_ns() -> u64 {
    static BASE: OnceLock<Instant> = OnceLock::new();
    BASE.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

fn bad(msg: impl Into<String>) -> (StatusCode, String) {
    (StatusCode::BAD_REQUEST, msg.into())
}

fn not_found(id: u64) -> (StatusCode, String) {
    (
        StatusCode::NOT_FOUND,
        format!("no fleet worker {id} on this node (it may have been deleted)"),
    )
}

fn to_value<T: serde::Serialize>(status: StatusCode, v: &T) -> FleetResult {
    serde_json::to_value(v)
        .map(|v| (status, v))
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

/// `/v1/fleet/...`; `rest` is the path after `fleet`.
pub async fn route(node: &Arc<Node>, method: &Method, rest: &[&str], body: &[u8]) -> FleetResult {
    match (method, rest) {
        (&Method::GET, ["node"]) => to_value(StatusCode::OK, &node_info(node).await?),
        (&Method::GET, ["sample"]) => to_value(StatusCode::OK, &sample(node).await),
        (&Method::GET, ["workers"]) => {
            let all: Vec<WorkerStatus> =
                lock().workers.values().map(|w| current(w, node)).collect();
            to_value(StatusCode::OK, &all)
        }
        (&Method::POST, ["workers"]) => {
            let spec: WorkerSpec = serde_json::from_slice(body)
                .map_err(|e| bad(format!("bad fleet worker request: {e}")))?;
            to_value(StatusCode::CREATED, &start(node, spec).await?)
        }
        (&Method::POST, ["stop"]) => {
            let n = stop_all();
            to_value(StatusCode::OK, &serde_json::json!({ "stopping": n }))
        }
        (&Method::GET, ["workers", id]) => {
            let id = parse_id(id)?;
            let r = lock();
            let w = r.workers.get(&id).ok_or_else(|| not_found(id))?;
            to_value(StatusCode::OK, &current(w, node))
        }
        (&Method::GET, ["workers", id, "result"]) => result(parse_id(id)?).await,
        (&Method::POST, ["workers", id, "stop"]) => {
            let id = parse_id(id)?;
            let mut r = lock();
            let w = r.workers.get_mut(&id).ok_or_else(|| not_found(id))?;
            if let Some(tx) = w.stop.take() {
                let _ = tx.send(());
            }
            to_value(StatusCode::OK, &current(w, node))
        }
        (&Method::POST, ["workers", id, "go"]) => {
            let id = parse_id(id)?;
            let mut r = lock();
            let w = r.workers.get_mut(&id).ok_or_else(|| not_found(id))?;
            if w.status.booting {
                return Err((
                    StatusCode::CONFLICT,
                    format!("fleet worker {id}'s guest is still booting"),
                ));
            }
            if let Some(tx) = w.go.take() {
                let _ = tx.send(());
            }
            to_value(StatusCode::OK, &current(w, node))
        }
        (&Method::DELETE, ["workers", id]) => {
            let id = parse_id(id)?;
            let w = lock().workers.remove(&id).ok_or_else(|| not_found(id))?;
            if let Some(tx) = w.stop {
                // Its task still owns the child and stops it; the files go now.
                let _ = tx.send(());
            }
            let _ = std::fs::remove_file(&w.output);
            let _ = std::fs::remove_file(&w.stderr);
            to_value(StatusCode::OK, &serde_json::json!({ "deleted": id }))
        }
        _ => Err((
            StatusCode::NOT_FOUND,
            format!(
                "no such fleet API: {method} /v1/fleet/{}; see docs/FLEET.md",
                rest.join("/")
            ),
        )),
    }
}

fn parse_id(s: &str) -> Result<u64, (StatusCode, String)> {
    s.parse()
        .map_err(|_| bad(format!("fleet worker id {s:?} is not a number")))
}

fn current(w: &Worker, node: &Node) -> WorkerStatus {
    let mut s = w.status.clone();
    s.node = node.cfg.node_id;
    if s.state == WorkerState::Running {
        s.elapsed_ms = w.started.elapsed().as_millis() as u64;
    }
    s
}

fn stop_all() -> usize {
    let mut r = lock();
    let mut n = 0;
    for w in r.workers.values_mut() {
        if let Some(tx) = w.stop.take() {
            let _ = tx.send(());
            n += 1;
        }
    }
    n
}

fn read_trimmed(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Host CPU ticks from the first line of /proc/stat: (busy, total).
fn host_cpu_ticks() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(line) = text.lines().find(|l| l.starts_with("cpu ")) else {
        return (0, 0);
    };
    let f: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    let get = |i: usize| f.get(i).copied().unwrap_or(0);
    // user nice system idle iowait irq softirq steal (guest time is inside user).
    let busy = get(0) + get(1) + get(2) + get(5) + get(6) + get(7);
    let total = busy + get(3) + get(4);
    (busy, total)
}

fn host_id() -> String {
    read_trimmed("/proc/sys/kernel/random/boot_id")
}

async fn sample(node: &Node) -> FleetSample {
    let mut volumes: Vec<VolumeIoCounters> = node
        .volumes
        .lock()
        .await
        .iter()
        .map(|(name, v)| {
            let s = v.stats();
            VolumeIoCounters {
                name: name.clone(),
                read_ops: s.read_ops,
                read_bytes: s.read_bytes,
                write_ops: s.write_ops,
                write_bytes: s.write_bytes,
            }
        })
        .collect();
    volumes.sort_by(|a, b| a.name.cmp(&b.name));
    let (busy, total) = host_cpu_ticks();
    let mut drives: Vec<DriveCounters> = node
        .drives
        .iter()
        .map(|(id, d)| drive_counters(*id, &d.stats()))
        .chain(
            node.caches
                .iter()
                .map(|(id, c)| drive_counters(*id, &c.drive_stats())),
        )
        .collect();
    drives.sort_by_key(|d| d.id);
    FleetSample {
        node: node.cfg.node_id,
        host_id: host_id(),
        mono_ns: mono_ns(),
        host_busy_ticks: busy,
        host_total_ticks: total,
        converged_cpu_s: crate::metrics::process_cpu_seconds(),
        drives,
        volumes,
    }
}

fn drive_counters(id: converge_types::DriveId, s: &converge_engine::DriveStats) -> DriveCounters {
    DriveCounters {
        id,
        read_ops: s.read_ops,
        write_ops: s.write_ops + s.zero_ops,
        read_bytes: s.read_bytes,
        write_bytes: s.write_bytes,
        data_write_bytes: s.data_write_bytes,
        journal_write_bytes: s.journal_write_bytes,
        metadata_write_bytes: s.metadata_write_bytes,
        inflight_time_ns: s.inflight_time_ns,
    }
}

async fn fio_version() -> Result<String, String> {
    let out = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::process::Command::new("fio")
            .arg("--version")
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .map_err(|_| "`fio --version` did not answer within 10 s".to_string())?
    .map_err(|e| format!("cannot run fio ({e}): install it (Debian: apt-get install fio)"))?;
    if !out.status.success() {
        return Err(format!("`fio --version` failed ({})", out.status));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

async fn node_info(node: &Node) -> Result<FleetNode, (StatusCode, String)> {
    let recs = node.cluster.drives().await.map_err(|e| {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("control plane unavailable: {e}"),
        )
    })?;
    let mut drives: Vec<FleetDrive> = node
        .drives
        .iter()
        .map(|(id, d)| {
            let ident = d.identity();
            let rec = recs.iter().find(|r| r.id == *id);
            FleetDrive {
                id: *id,
                node: node.cfg.node_id,
                path: rec.map(|r| r.path.clone()).unwrap_or_default(),
                role: ident.role,
                media: ident.media,
                size_bytes: d.capacity().bytes_total,
                tbw_bytes: rec.and_then(|r| r.tbw_bytes),
                warranty_years: rec.and_then(|r| r.warranty_years),
            }
        })
        .chain(node.caches.iter().map(|(id, c)| {
            let ident = c.identity();
            let rec = recs.iter().find(|r| r.id == *id);
            FleetDrive {
                id: *id,
                node: node.cfg.node_id,
                path: rec.map(|r| r.path.clone()).unwrap_or_default(),
                role: ident.role,
                media: ident.media,
                size_bytes: c.log_bytes(),
                tbw_bytes: rec.and_then(|r| r.tbw_bytes),
                warranty_years: rec.and_then(|r| r.warranty_years),
            }
        }))
        .collect();
    drives.sort_by(|a, b| a.path.cmp(&b.path));
    let (fio_version, fio_error) = match fio_version().await {
        Ok(v) => (Some(v), None),
        Err(e) => (None, Some(e)),
    };
    Ok(FleetNode {
        node: node.cfg.node_id,
        name: node.cfg.name.clone(),
        hostname: read_trimmed("/proc/sys/kernel/hostname"),
        host_id: host_id(),
        kernel: read_trimmed("/proc/sys/kernel/osrelease"),
        cpus: std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1),
        converged_version: env!("CARGO_PKG_VERSION").to_string(),
        fio_version,
        fio_error,
        nbd_socket: node.cfg.nbd_socket.display().to_string(),
        nbd_inflight_max: node.cfg.knobs.nbd_inflight_max,
        drives,
    })
}

/// Where worker output goes: a `fleet` directory beside the node's NBD socket (the lab's
/// node directory, `/run/converge` on a server).
fn work_dir(node: &Node) -> PathBuf {
    node.cfg
        .nbd_socket
        .parent()
        .map(|p| p.join("fleet"))
        .unwrap_or_else(|| {
            std::env::temp_dir().join(format!("converge-fleet-{}", node.cfg.node_id))
        })
}

fn valid_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

async fn check_spec(node: &Node, s: &WorkerSpec) -> Result<(), (StatusCode, String)> {
    if !valid_label(&s.name) {
        return Err(bad(format!(
            "worker name {:?}: use 1-128 letters, digits, '-', '_' or '.'",
            s.name
        )));
    }
    let bs = BLOCK_SIZE as u64;
    if s.bs_bytes == 0 || !s.bs_bytes.is_multiple_of(bs) || s.bs_bytes > MAX_IO_BYTES as u64 {
        return Err(bad(format!(
            "block size {} bytes: must be a multiple of {bs} and at most {MAX_IO_BYTES}",
            s.bs_bytes
        )));
    }
    let qd_max = node.cfg.knobs.nbd_inflight_max as u32;
    if s.qd == 0 || s.qd > qd_max {
        return Err(bad(format!(
            "queue depth {}: must be 1..={qd_max} (this node's knobs.nbd_inflight_max)",
            s.qd
        )));
    }
    if s.write_pct > 100 || s.random_pct > 100 || s.compress_pct > 100 || s.dedupe_pct > 100 {
        return Err(bad(format!(
            "write_pct {}, random_pct {}, compress_pct {} and dedupe_pct {} must be 0..=100",
            s.write_pct, s.random_pct, s.compress_pct, s.dedupe_pct
        )));
    }
    if s.size_bytes < s.bs_bytes || !s.size_bytes.is_multiple_of(bs) {
        return Err(bad(format!(
            "working set {} bytes: must be a multiple of {bs} and at least the block size",
            s.size_bytes
        )));
    }
    if s.kind == WorkerKind::Measure && (s.runtime_s == 0 || s.ramp_s + s.runtime_s > RUN_S_MAX) {
        return Err(bad(format!(
            "runtime {} s (+ warm-up {} s): must be 1 s or more and at most a week in total",
            s.runtime_s, s.ramp_s
        )));
    }
    if let Some(vm) = &s.vm {
        if s.kind != WorkerKind::Measure {
            return Err(bad("only measuring workers run in a guest".to_string()));
        }
        if vm.accel != "kvm" && vm.accel != "tcg" {
            return Err(bad(format!("accelerator {:?}: kvm or tcg", vm.accel)));
        }
        if !(128..=65536).contains(&vm.memory_mib) {
            return Err(bad(format!(
                "guest memory {} MiB: 128 to 65536",
                vm.memory_mib
            )));
        }
        for f in ["vmlinuz", "initrd.gz"] {
            let p = Path::new(&vm.image).join(f);
            if !p.is_file() {
                return Err(bad(format!(
                    "no guest image on node {}: {} is missing (build it there with \
                     scripts/guest-image.sh --with-fio DIR)",
                    node.cfg.node_id,
                    p.display()
                )));
            }
        }
    }
    let rec = node
        .cluster
        .volume(&s.volume)
        .await
        .map_err(|e| {
            (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("control plane unavailable: {e}"),
            )
        })?
        .map(|(r, _)| r)
        .ok_or_else(|| {
            (
                StatusCode::NOT_FOUND,
                format!("no volume named {:?}", s.volume),
            )
        })?;
    if rec.owner != node.cfg.node_id {
        return Err(bad(format!(
            "volume {} is owned by node {}, not this node ({}): start its worker there",
            s.volume, rec.owner, node.cfg.node_id
        )));
    }
    if s.size_bytes > rec.size_bytes {
        return Err(bad(format!(
            "working set {} bytes is larger than volume {} ({} bytes)",
            s.size_bytes, s.volume, rec.size_bytes
        )));
    }
    Ok(())
}

/// fio's arguments for a spec; nothing of the request reaches fio untyped.
fn fio_args(node: &Node, s: &WorkerSpec, output: &Path) -> Vec<String> {
    let uri = format!(
        "nbd+unix:///{}?socket={}",
        s.volume,
        node.cfg.nbd_socket.display()
    );
    let mut a = vec![
        format!("--name={}", s.name),
        "--ioengine=nbd".to_string(),
        format!("--uri={uri}"),
        "--numjobs=1".to_string(),
        // One process per worker: the job runs as a thread, so a signal reaches all of it.
        "--thread".to_string(),
        format!("--bs={}", s.bs_bytes),
        format!("--iodepth={}", s.qd),
        format!("--size={}", s.size_bytes),
        "--output-format=json+".to_string(),
        format!("--output={}", output.display()),
        // Percentiles and histogram bins of the total latency (submission + completion):
        // what a VM waits for.
        "--lat_percentiles=1".to_string(),
        format!("--percentile_list={FIO_PERCENTILES}"),
    ];
    // The data pattern, for pre-fill and measured writes alike.
    if s.compress_pct > 0 {
        a.push(format!("--buffer_compress_percentage={}", s.compress_pct));
        a.push("--refill_buffers".to_string());
    }
    if s.dedupe_pct > 0 {
        a.push(format!("--dedupe_percentage={}", s.dedupe_pct));
    }
    match s.kind {
        WorkerKind::Prefill => {
            a.push("--rw=write".to_string());
        }
        WorkerKind::Measure => {
            let random = s.random_pct > 0;
            let rw = match (s.write_pct, random) {
                (0, true) => "randread",
                (100, true) => "randwrite",
                (_, true) => "randrw",
                (0, false) => "read",
                (100, false) => "write",
                (_, false) => "rw",
            };
            a.push(format!("--rw={rw}"));
            if s.write_pct > 0 && s.write_pct < 100 {
                a.push(format!("--rwmixwrite={}", s.write_pct));
            }
            if random && s.random_pct < 100 {
                a.push(format!("--percentage_random={}", s.random_pct));
            }
            if random {
                a.push("--norandommap".to_string());
            }
            a.push("--time_based".to_string());
            a.push(format!("--ramp_time={}", s.ramp_s));
            a.push(format!("--runtime={}", s.runtime_s));
        }
    }
    a
}

/// The guest's fio arguments (its kernel command line's `converge.fioargs`, commas for
/// spaces): the host worker's, on the guest's virtio disk with libaio and O_DIRECT, the
/// result on its console.
fn fio_guest_args(node: &Node, s: &WorkerSpec) -> String {
    fio_args(node, s, Path::new("-"))
        .into_iter()
        .filter(|a| {
            !a.starts_with("--ioengine=") && !a.starts_with("--uri=") && !a.starts_with("--output=")
        })
        .chain([
            "--ioengine=libaio".to_string(),
            "--direct=1".to_string(),
            "--filename=/dev/vda".to_string(),
        ])
        .collect::<Vec<_>>()
        .join(",")
}

/// qemu with the guest of `vm` on the vhost-user-blk disk at `socket`, its console on
/// stdin/stdout.
fn qemu_command(
    node: &Node,
    s: &WorkerSpec,
    vm: &VmWorker,
    socket: &str,
) -> tokio::process::Command {
    let image = Path::new(&vm.image);
    let mut c = tokio::process::Command::new("qemu-system-x86_64");
    c.args(["-accel", &vm.accel, "-smp", "1"])
        .args(["-m", &vm.memory_mib.to_string()])
        .args([
            "-display",
            "none",
            "-monitor",
            "none",
            "-serial",
            "stdio",
            "-no-reboot",
        ])
        .arg("-kernel")
        .arg(image.join("vmlinuz"))
        .arg("-initrd")
        .arg(image.join("initrd.gz"))
        .arg("-append")
        .arg(format!(
            "console=ttyS0 panic=-1 quiet converge.job=fleet converge.fioargs={}",
            fio_guest_args(node, s)
        ))
        .args([
            "-object",
            &format!(
                "memory-backend-memfd,id=mem,size={}M,share=on",
                vm.memory_mib
            ),
        ])
        .args(["-machine", "memory-backend=mem"])
        .args(["-chardev", &format!("socket,id=vd,path={socket}")])
        .args(["-device", "vhost-user-blk-pci,chardev=vd,num-queues=1"]);
    c
}

/// What a guest worker printed: fio's JSON between its markers, and its own verdict.
#[derive(Default)]
struct GuestOutput {
    json: Vec<String>,
    json_done: bool,
    errors: Option<u64>,
    tail: std::collections::VecDeque<String>,
}

/// Reads a guest's console: marks the worker booted at `CONVERGE-GUEST ready`, then waits
/// for `go` and sends it the line that starts fio; gathers fio's JSON.
async fn watch_guest(
    id: u64,
    stdout: tokio::process::ChildStdout,
    mut stdin: tokio::process::ChildStdin,
    go: oneshot::Receiver<()>,
) -> GuestOutput {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let mut out = GuestOutput::default();
    let mut go = Some(go);
    let mut in_json = false;
    while let Ok(Some(line)) = lines.next_line().await {
        let line = line.trim_end_matches('\r').to_string();
        if line == "CONVERGE-FIO-JSON-BEGIN" {
            in_json = true;
        } else if line == "CONVERGE-FIO-JSON-END" {
            in_json = false;
            out.json_done = true;
        } else if in_json {
            out.json.push(line);
            continue;
        } else if line.starts_with("CONVERGE-GUEST ready") {
            if let Some(w) = lock().workers.get_mut(&id) {
                w.status.booting = false;
            }
            if let Some(rx) = go.take() {
                // Deleted or stopped meanwhile: the sender goes, and so does qemu soon.
                if rx.await.is_ok() {
                    let _ = stdin.write_all(b"go\n").await;
                    let _ = stdin.flush().await;
                }
            }
        } else if let Some(rest) = line.strip_prefix("CONVERGE-GUEST fleet ") {
            out.errors = rest
                .split_whitespace()
                .find_map(|w| w.strip_prefix("errors="))
                .and_then(|n| n.parse().ok());
        }
        if out.tail.len() == 12 {
            out.tail.pop_front();
        }
        out.tail.push_back(line);
    }
    out
}

/// A worker's program could not start.
fn spawn_failed(node: &Node, program: &str, e: std::io::Error, hint: &str) -> (StatusCode, String) {
    (
        StatusCode::INTERNAL_SERVER_ERROR,
        format!(
            "cannot start {program} on node {} ({e}): {hint}",
            node.cfg.node_id
        ),
    )
}

async fn start(node: &Arc<Node>, spec: WorkerSpec) -> Result<WorkerStatus, (StatusCode, String)> {
    check_spec(node, &spec).await?;
    let dir = work_dir(node);
    std::fs::create_dir_all(&dir).map_err(|e| {
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot create the fleet directory {}: {e}", dir.display()),
        )
    })?;
    let id = {
        let mut r = lock();
        let running = r
            .workers
            .values()
            .filter(|w| w.status.state == WorkerState::Running)
            .count();
        if running >= WORKERS_MAX {
            return Err((
                StatusCode::CONFLICT,
                format!("{running} fleet workers already run on this node (at most {WORKERS_MAX})"),
            ));
        }
        // Forget the oldest ended workers nobody collected (a CLI that died).
        while r.workers.len() >= ENDED_KEPT_MAX {
            let Some(old) = r
                .workers
                .iter()
                .find(|(_, w)| w.status.state != WorkerState::Running)
                .map(|(id, _)| *id)
            else {
                break;
            };
            if let Some(w) = r.workers.remove(&old) {
                let _ = std::fs::remove_file(&w.output);
                let _ = std::fs::remove_file(&w.stderr);
            }
        }
        r.next_id += 1;
        r.next_id
    };
    let output = dir.join(format!("w{id}.json"));
    let stderr_path = dir.join(format!("w{id}.stderr"));
    let _ = std::fs::remove_file(&output);
    let stderr = std::fs::File::create(&stderr_path).map_err(|e| {
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot create {}: {e}", stderr_path.display()),
        )
    })?;
    let (go_tx, go_rx) = oneshot::channel();
    let mut guest = None;
    let mut child = if let Some(vm) = &spec.vm {
        let (_, disk) = crate::vhost::attach_volume(node, &spec.volume, Some(1), false)
            .await
            .map_err(|crate::api::ApiError(status, why)| (status, why))?;
        let spawned = qemu_command(node, &spec, vm, &disk.socket)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                // No guest will use the disk: do not leave it attached.
                let _ = crate::vhost::detach_volume(node, &spec.volume).await;
                return Err(spawn_failed(
                    node,
                    "qemu-system-x86_64",
                    e,
                    "is it installed (scripts/setup.sh)?",
                ));
            }
        };
        let (stdout, stdin) = (
            child.stdout.take().expect("piped"),
            child.stdin.take().expect("piped"),
        );
        guest = Some(tokio::spawn(watch_guest(id, stdout, stdin, go_rx)));
        child
    } else {
        let args = fio_args(node, &spec, &output);
        tokio::process::Command::new("fio")
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| spawn_failed(node, "fio", e, "is fio installed (apt-get install fio)?"))?
    };
    let pid = child.id().map(|p| p as i32);
    log::info!(
        "fleet worker {id} ({}) started: fio pid {pid:?} on volume {}",
        spec.name,
        spec.volume
    );
    let lifetime = match spec.kind {
        WorkerKind::Prefill => Duration::from_secs(PREFILL_LIFETIME_MAX_S),
        WorkerKind::Measure if spec.vm.is_some() => {
            Duration::from_secs(spec.ramp_s + spec.runtime_s + WORKER_GRACE_S + GUEST_BOOT_MAX_S)
        }
        WorkerKind::Measure => Duration::from_secs(spec.ramp_s + spec.runtime_s + WORKER_GRACE_S),
    };
    let (tx, rx) = oneshot::channel();
    let output_path = output.clone();
    let spec_is_vm = spec.vm.is_some();
    let guest_volume = spec.vm.as_ref().map(|_| spec.volume.clone());
    let task_node = node.clone();
    let status = WorkerStatus {
        id,
        node: node.cfg.node_id,
        spec,
        state: WorkerState::Running,
        pid,
        exit_code: None,
        message: None,
        elapsed_ms: 0,
        booting: spec_is_vm,
    };
    lock().workers.insert(
        id,
        Worker {
            status: status.clone(),
            started: Instant::now(),
            output,
            stderr: stderr_path.clone(),
            stop: Some(tx),
            go: spec_is_vm.then_some(go_tx),
        },
    );
    tokio::spawn(async move {
        // This task owns the child: it signals it only before reaping it.
        let mut stopped = false;
        let exit = tokio::select! {
            s = child.wait() => s,
            _ = rx => {
                stopped = true;
                terminate(&mut child).await
            }
            _ = tokio::time::sleep(lifetime) => {
                log::warn!("fleet worker {id} outlived its bound of {lifetime:?}; stopping it");
                stopped = true;
                terminate(&mut child).await
            }
        };
        // A guest's verdict and fio's JSON come from its console; its disk goes.
        let guest_out = match guest {
            Some(g) => g.await.ok(),
            None => None,
        };
        if let Some(volume) = guest_volume {
            let _ = crate::vhost::detach_volume(&task_node, &volume).await;
        }
        let mut guest_failure = None;
        if let Some(g) = &guest_out {
            let json_ok = g.json_done && std::fs::write(&output_path, g.json.join("\n")).is_ok();
            if !json_ok || g.errors != Some(0) {
                guest_failure = Some(format!(
                    "the guest {}; its console ends with: {}",
                    if json_ok {
                        "reported errors"
                    } else {
                        "gave no fio result"
                    },
                    g.tail.iter().cloned().collect::<Vec<_>>().join(" | ")
                ));
            }
        }
        let mut r = lock();
        let Some(w) = r.workers.get_mut(&id) else {
            // Deleted while it ran: fio may have written its result since; drop it too.
            let _ = std::fs::remove_file(&output_path);
            let _ = std::fs::remove_file(&stderr_path);
            return;
        };
        w.stop = None;
        w.go = None;
        w.status.booting = false;
        w.status.pid = None;
        w.status.elapsed_ms = w.started.elapsed().as_millis() as u64;
        match exit {
            Ok(st) => {
                w.status.exit_code = st.code();
                if stopped {
                    w.status.state = WorkerState::Stopped;
                } else if let Some(why) = guest_failure {
                    w.status.state = WorkerState::Failed;
                    w.status.message = Some(why);
                } else if st.success() {
                    w.status.state = WorkerState::Done;
                } else {
                    w.status.state = WorkerState::Failed;
                    w.status.message = Some(format!(
                        "fio exited with {st}; its stderr ends with: {}",
                        tail(&stderr_path, 8)
                    ));
                }
            }
            Err(e) => {
                w.status.state = WorkerState::Failed;
                w.status.message = Some(format!("waiting for fio failed: {e}"));
            }
        }
        log::info!(
            "fleet worker {id} ({}) ended: {:?}",
            w.status.spec.name,
            w.status.state
        );
    });
    Ok(status)
}

/// SIGTERM (fio then writes what it measured), SIGKILL if it does not go in time.
async fn terminate(child: &mut tokio::process::Child) -> std::io::Result<std::process::ExitStatus> {
    if let Some(pid) = child.id() {
        // SAFETY: kill(2) on the PID of our own child, which has not been reaped (we hold
        // the Child and have not awaited its exit), so the PID cannot have been reused.
        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    }
    match tokio::time::timeout(STOP_GRACE, child.wait()).await {
        Ok(r) => r,
        Err(_) => {
            let _ = child.start_kill();
            child.wait().await
        }
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let t = std::fs::read_to_string(path).unwrap_or_default();
    let v: Vec<&str> = t.lines().filter(|l| !l.trim().is_empty()).collect();
    let s = v[v.len().saturating_sub(lines)..].join(" | ");
    if s.is_empty() {
        "(nothing)".to_string()
    } else {
        s
    }
}

/// fio's JSON result of a worker that has ended.
async fn result(id: u64) -> FleetResult {
    let (state, output, message) = {
        let r = lock();
        let w = r.workers.get(&id).ok_or_else(|| not_found(id))?;
        (w.status.state, w.output.clone(), w.status.message.clone())
    };
    if state == WorkerState::Running {
        return Err((
            StatusCode::CONFLICT,
            format!("fleet worker {id} is still running; its result comes when it ends"),
        ));
    }
    let text = tokio::fs::read_to_string(&output).await.map_err(|e| {
        (
            StatusCode::NOT_FOUND,
            format!(
                "fleet worker {id} ({state:?}) left no result in {}: {e}{}",
                output.display(),
                message.map(|m| format!("; {m}")).unwrap_or_default()
            ),
        )
    })?;
    // fio may print notices before its JSON.
    let start = text.find('{').unwrap_or(0);
    let v: serde_json::Value = serde_json::from_str(&text[start..]).map_err(|e| {
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!(
                "fleet worker {id}: fio's output {} is not JSON: {e}",
                output.display()
            ),
        )
    })?;
    Ok((StatusCode::OK, v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ticks_are_read() {
        let (busy, total) = host_cpu_ticks();
        assert!(total > 0 && busy <= total, "{busy} {total}");
    }

    #[test]
    fn labels() {
        assert!(valid_label("fleet-n1-w1"));
        assert!(!valid_label("a b"));
        assert!(!valid_label("--output=/etc/passwd"));
        assert!(!valid_label(""));
    }
}
