//! `converge fleet`: runs the fleet methodology (docs/FLEET.md) on a running cluster and
//! renders its report. Every node's daemon starts the fio workers for the volumes it owns,
//! so the same command works on the lab and on real servers; this side validates
//! everything first, creates and pre-fills the volumes, walks the sweep (caches flushed and
//! counters sampled, warm-up, measured window bracketed by counter samples on every node,
//! workers' end, caches flushed and counters sampled again, cool-down), collects, and
//! writes the report after every point — so Ctrl-C or a failure still leaves what was
//! measured.

mod qos;

use crate::http;
use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, Subcommand};
use converge_api::fleet::{
    FleetNode, FleetSample, WorkerKind, WorkerSpec, WorkerState, WorkerStatus,
};
use converge_api::{CacheInfo, CreateVolume, SetCacheMode, Status};
use converge_fleet::compare;
use converge_fleet::endurance;
use converge_fleet::fio;
use converge_fleet::format as fmt;
use converge_fleet::measure::{self, WorkerRun};
use converge_fleet::model::{ClusterConfig, DriveConfig, NodeConfig, FORMAT_VERSION};
use converge_fleet::profile::{self, Overrides, Point, Profile, Settings};
use converge_fleet::report;
use converge_fleet::scaleout;
use converge_fleet::timeline::{self, Timeline};
use converge_fleet::{PointRecord, RunConfig, RunStatus, RunSummary};
use converge_types::{format_size, parse_size, CacheMode, Compression, NodeId, Resiliency};
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How often workers are checked while they run.
const POLL: Duration = Duration::from_millis(500);
/// Workers must have ended this long after their warm-up + runtime.
const END_GRACE: Duration = Duration::from_secs(60);
/// How long the guests of a point (`--vms`) may take to boot, all together.
const GUEST_BOOT_WAIT: Duration = Duration::from_secs(600);
/// Volumes of the fleet are named `fleet-n<node>-w<k>`.
const VOLUME_PREFIX: &str = "fleet-n";
/// How long every cache drive has to report the mode `--cache-mode` set.
const CACHE_MODE_WAIT: Duration = Duration::from_secs(30);
/// How long one node may take to destage everything its caches hold.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(3600);

#[derive(Subcommand)]
pub enum FleetCmd {
    /// Run a fleet on the cluster: W fio workers per node, each against its own volume
    /// owned by that node, swept over a profile's points; writes raw fio JSON,
    /// summary.json/csv, report.md and report.html to --out.
    #[command(
        after_help = "Profiles (see `converge fleet profiles` and docs/FLEET.md):\n  \
        small-block  4 KiB random, QD 1,2,4,8 x write 0,10,30,100 %: the headline IOPS table\n  \
        large-block  128 KiB random, QD 1,2,4,8 x write 0,100 %: MB/s\n  \
        vm-scaling   4 KiB random, QD 1,8, workers per node 1..4\n  \
        oltp         8 KiB random, 10 % writes, QD 1..16\n  \
        exchange     32 KiB, 80 % random, 40 % writes, QD 1..16\n  \
        seq          512 KiB sequential, QD 1, write 0,100 %\n  \
        scale-out    4 KiB random, QD 1,8 x write 0,30,100 %, on half the nodes (the others\n               \
        draining, so no copy lands there) then on all: the scale-out factor\n\n\
        Examples:\n  \
        converge fleet run --profile small-block --quick --out /tmp/fleet1\n  \
        converge fleet run --profile small-block --resiliency mirror-2 --out /tmp/fleet-m2\n  \
        converge fleet run --profile large-block --warmup 5m --duration 90m --repeat 3 --out ra\n  \
        converge fleet run --profile scale-out --nodes 1,2,3,4,5,6 --out /tmp/scale\n  \
        converge fleet report /tmp/fleet1 /tmp/fleet-m2 --out /tmp/compare"
    )]
    Run(Box<RunArgs>),
    /// Render a run's report again from its summary.json, or lay several runs side by side
    /// with the % change of each against the first.
    Report {
        /// Run directories (each holds summary.json).
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
        /// Where to write: one run re-renders into its own directory by default; a
        /// comparison writes compare.md and compare.html here (printed only without it).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// List the profiles with their parameters.
    Profiles,
    /// The noisy-neighbour study (docs/QOS.md): on one node, a victim volume beside noisy
    /// neighbours, alone, unprotected, with a reservation, and with the neighbours limited;
    /// IOPS and latencies per phase, whether the reservation held, and how close each
    /// neighbour came to its limit (OUT/qos.md, qos.json).
    Qos(qos::QosArgs),
    /// After a crashed run: stop the fleet workers on every node and delete the fleet's
    /// volumes (fleet-n*-w*).
    Clean,
}

#[derive(Args, Clone)]
pub struct RunArgs {
    /// small-block, large-block, vm-scaling, oltp, exchange, seq or scale-out.
    #[arg(long)]
    profile: String,
    /// Directory for the results (must not exist, or be empty).
    #[arg(long)]
    out: PathBuf,
    /// Shrink everything (1 worker per node, 64 MiB working set, 2 s warm-up, 5 s
    /// measured) so a laptop lab finishes a small-block sweep in a few minutes. Other
    /// flags still override.
    #[arg(long)]
    quick: bool,
    /// Workers ("VMs") per node; several values are swept (e.g. 1,2,4).
    #[arg(long, value_delimiter = ',')]
    workers_per_node: Option<Vec<u64>>,
    /// Queue depths per worker, e.g. 1,2,4,8.
    #[arg(long, value_delimiter = ',')]
    qd: Option<Vec<u64>>,
    /// Write shares in %, e.g. 0,10,30,100 (read % = 100 - write %).
    #[arg(long, value_delimiter = ',')]
    write_pct: Option<Vec<u64>>,
    /// Block sizes, e.g. 4K or 4K,64K (multiples of 4 KiB).
    #[arg(long, value_delimiter = ',')]
    bs: Option<Vec<String>>,
    /// Data each worker touches: its volume's size, e.g. 1G.
    #[arg(long)]
    working_set: Option<String>,
    /// Resiliency of the fleet's volumes: simple, mirror-2, mirror-3 (default) or parity-K+M.
    /// With --study density: the policies to compare, each a resiliency with an optional
    /// `:CODEC`, e.g. mirror-3,mirror-3:zstd,parity-2+1.
    #[arg(long)]
    resiliency: Option<String>,
    /// Run a study instead of one sweep. `density`: the same profile and data on each
    /// policy in turn (default: mirror-3, mirror-3:zstd (compressed), mirror-2, parity-2+1,
    /// and parity-4+2 with 6 or more nodes; --resiliency picks others), each run in
    /// OUT/<policy>/, then OUT/compare.md and compare.html lay them side by side with a
    /// density-vs-performance table (usable capacity, raw per written byte, IOPS, latency,
    /// CPU per I/O, write amplification). Give --compressible for data compression can
    /// shrink (fio's default is random bytes). `scale-out`: the profile's points on the
    /// first half of the nodes (--nodes, or all live), the others draining so none of its
    /// copies lands there, then on all of them; OUT/nodes-N and OUT/nodes-2N, and
    /// OUT/scale-out.md/html/json with the factor per workload (`--profile scale-out`
    /// implies it).
    #[arg(long, value_name = "STUDY")]
    study: Option<String>,
    /// Warm-up per point, excluded from the measurements (e.g. 30s, 5m).
    #[arg(long)]
    warmup: Option<String>,
    /// Measured time per point (e.g. 60s, 10m).
    #[arg(long)]
    duration: Option<String>,
    /// Idle time after each point (e.g. 30s).
    #[arg(long)]
    cooldown: Option<String>,
    /// Times each point is measured; the report shows the mean and the spread.
    #[arg(long)]
    repeat: Option<u64>,
    /// Node ids that run workers (default: every node); all nodes hold copies either way.
    #[arg(long, value_delimiter = ',')]
    nodes: Option<Vec<u32>>,
    /// Keep the fleet's volumes at the end (default: delete them).
    #[arg(long)]
    keep: bool,
    /// Rated lifetime writes (TBW) of every drive, e.g. 3.5T, instead of each drive's own
    /// `tbw` setting or its media default (flash: 1 drive write per day for the warranty).
    #[arg(long)]
    drive_tbw: Option<String>,
    /// Warranty years of every drive (default: each drive's own setting, else 5).
    #[arg(long)]
    drive_warranty_years: Option<f64>,
    /// Run in this cache mode (none, write or read-write): set for the whole pool before
    /// the run, checked on every cache drive, and the pool's previous setting restored at
    /// the end (also after Ctrl-C or a failure). Needs cache drives. Default: the modes
    /// in effect, as they are.
    #[arg(long, value_parser = parse_cache_mode)]
    cache_mode: Option<CacheMode>,
    /// The data written, in % of every buffer that is a fixed pattern a compressor removes
    /// (fio's buffer_compress_percentage; pre-fill included). Default 0: random bytes.
    #[arg(long, value_name = "PCT")]
    compressible: Option<u64>,
    /// % of written buffers that repeat earlier ones (fio's dedupe_percentage). Default 0.
    #[arg(long, value_name = "PCT")]
    dedupe: Option<u64>,
    /// The workers' volumes compress their data: none (default), lz4 or zstd (mirror and
    /// simple resiliencies; docs/adr/0010). Use with --compressible: fio's default data is
    /// random and does not compress.
    #[arg(long, value_name = "CODEC")]
    compression: Option<String>,
    /// The workers' volumes are encrypted at rest (AES-256-XTS on their owners,
    /// docs/adr/0011): compare a run with and without it for encryption's CPU per I/O.
    #[arg(long)]
    encrypt: bool,
    /// Find each series' saturation instead of assuming it: the queue depth doubles
    /// 1,2,4,…,64 per worker (or runs the --qd values in rising order) and a series (block
    /// size, workers, write share) stops at the first depth that adds less than 10 % IOPS
    /// over the best below it. The report's Saturation section names each knee.
    #[arg(long)]
    saturate: bool,
    /// Run each worker's fio inside a real guest, as VMFleet does: every node offers each
    /// worker's volume as a vhost-user-blk disk and boots a qemu guest on it (the image of
    /// `scripts/guest-image.sh --with-fio`, in DIR on every node; default
    /// ./target/guest-fio); the points start once every guest is up. Needs
    /// qemu-system-x86 on the nodes.
    #[arg(long, value_name = "DIR", num_args = 0..=1, default_missing_value = "target/guest-fio")]
    vms: Option<PathBuf>,
    /// With --vms: qemu's accelerator, kvm (hardware virtualization: use it where the
    /// nodes have it) or tcg (emulation: slow, the guest's CPU bounds what it measures).
    #[arg(long, default_value = "tcg", value_parser = ["kvm", "tcg"])]
    vm_accel: String,
    /// With --vms: each guest's memory, MiB (the fio image needs about 200).
    #[arg(long, default_value_t = 512)]
    vm_memory: u32,
    /// The scale-out study's smaller size: the run sees only these nodes (the others are
    /// draining, and hold none of its copies).
    #[arg(skip)]
    cluster_nodes: Option<Vec<u32>>,
}

fn parse_cache_mode(s: &str) -> Result<CacheMode, String> {
    s.parse::<CacheMode>().map_err(|e| e.to_string())
}

// ---------------------------------------------------------------------------- Ctrl-C

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Ctrl-C (or SIGTERM) sets a flag the run checks; a second one kills the CLI at once
/// (the daemons still bound their workers' lives).
fn install_signal_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction is valid; the handler only stores to an atomic,
        // which is async-signal-safe.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as *const () as usize;
            sa.sa_flags = libc::SA_RESETHAND;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

#[derive(Debug)]
struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted (Ctrl-C)")
    }
}

impl std::error::Error for Interrupted {}

fn check_interrupt() -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        return Err(Interrupted.into());
    }
    Ok(())
}

/// Sleep until `t`, waking for Ctrl-C.
fn sleep_until(t: Instant) -> Result<()> {
    loop {
        check_interrupt()?;
        let now = Instant::now();
        if now >= t {
            return Ok(());
        }
        std::thread::sleep((t - now).min(Duration::from_millis(100)));
    }
}

// ---------------------------------------------------------------------------- progress

struct Progress {
    tty: bool,
    shown: bool,
}

impl Progress {
    fn new() -> Progress {
        // SAFETY: isatty only inspects the descriptor.
        let tty = unsafe { libc::isatty(2) } == 1;
        Progress { tty, shown: false }
    }

    /// A line that the next one replaces (on a terminal; elsewhere it is printed once).
    fn status(&mut self, line: &str) {
        let mut e = std::io::stderr();
        if self.tty {
            let _ = write!(e, "\r\x1b[K{line}");
            let _ = e.flush();
            self.shown = true;
        }
    }

    /// A line that stays.
    fn line(&mut self, line: &str) {
        let mut e = std::io::stderr();
        if self.tty && self.shown {
            let _ = write!(e, "\r\x1b[K");
            self.shown = false;
        }
        let _ = writeln!(e, "{line}");
    }
}

// ---------------------------------------------------------------------------- nodes

struct NodeCtx {
    id: NodeId,
    api: String,
    info: FleetNode,
    runs_workers: bool,
}

fn node_api(addr: &str) -> String {
    if addr.starts_with("https://") || addr.starts_with("http://") {
        addr.to_string()
    } else {
        format!("https://{addr}")
    }
}

fn volume_name(node: NodeId, k: u32) -> String {
    format!("{VOLUME_PREFIX}{}-w{k}", node.0)
}

fn sample_all(nodes: &[NodeCtx]) -> Result<Vec<FleetSample>> {
    nodes
        .iter()
        .map(|n| {
            http::call(&n.api, "GET", "/v1/fleet/sample", None)
                .with_context(|| format!("sampling node {}", n.id))
        })
        .collect()
}

/// The run's timeline (`converge_fleet::timeline`), sampled once a second by a thread of
/// its own while the sweep runs; the sweep marks where each point began.
struct Recorder {
    start: Instant,
    tl: std::sync::Mutex<Timeline>,
    stop: std::sync::atomic::AtomicBool,
}

impl Recorder {
    fn new() -> Recorder {
        Recorder {
            start: Instant::now(),
            tl: std::sync::Mutex::new(Timeline::new()),
            stop: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Timeline> {
        // A panic elsewhere must not lose the report: the timeline is plain data.
        self.tl.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn mark(&self, what: impl Into<String>) {
        let t = self.start.elapsed().as_secs_f64();
        self.lock().mark(t, what);
    }

    fn snapshot(&self) -> Timeline {
        self.lock().clone()
    }

    fn stopped(&self) -> bool {
        self.stop.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Samples every node once a second until stopped. A second in which some node does
    /// not answer adds no tick; the next one spans both (its rates use the daemons' own
    /// clocks).
    fn record(&self, nodes: &[NodeCtx]) {
        let mut prev = sample_all(nodes).unwrap_or_default();
        let mut next = Instant::now() + Duration::from_secs(1);
        while !self.stopped() {
            let now = Instant::now();
            if now < next {
                std::thread::sleep((next - now).min(Duration::from_millis(100)));
                continue;
            }
            next += Duration::from_secs(1);
            if let Ok(cur) = sample_all(nodes) {
                let t = self.start.elapsed().as_secs_f64();
                self.lock().push(timeline::tick(t, &prev, &cur));
                prev = cur;
            }
        }
    }
}

/// Destage everything every node's caches hold (`POST /v1/cache/flush`, all nodes at
/// once; a node without cache drives answers at once) and return each node's answer.
/// Write amplification is counted between two such flushes, so every byte a point's
/// writes cost on the drives falls inside it.
fn flush_all(nodes: &[NodeCtx], when: &str) -> Result<Vec<Value>> {
    std::thread::scope(|sc| {
        let calls: Vec<_> = nodes
            .iter()
            .map(|n| {
                sc.spawn(move || {
                    http::call_timeout::<Value>(
                        &n.api,
                        "POST",
                        "/v1/cache/flush",
                        None,
                        FLUSH_TIMEOUT,
                    )
                })
            })
            .collect();
        nodes
            .iter()
            .zip(calls)
            .map(|(n, c)| {
                let r = c
                    .join()
                    .map_err(|_| anyhow!("the flush of node {} panicked", n.id))?;
                r.map_err(|e| {
                    anyhow!(
                        "flushing the caches of node {} ({}) {when} failed: {e:#}. Write \
                         amplification is counted between flushed caches, so the run cannot \
                         go on; see `converge cache status` and node {}'s log",
                        n.id,
                        n.api,
                        n.id
                    )
                })
            })
            .collect()
    })
}

// ---------------------------------------------------------------------------- entry

pub fn run(cmd: &FleetCmd, json: bool, api: impl Fn() -> Result<String>) -> Result<()> {
    match cmd {
        FleetCmd::Run(a) if a.study.is_some() || is_scale_out(a) => run_study(a, json, &api()?),
        FleetCmd::Run(a) => run_fleet(a, json, &api()?),
        FleetCmd::Report { dirs, out } => report_cmd(dirs, out.as_deref(), json),
        FleetCmd::Profiles => {
            profiles(json);
            Ok(())
        }
        FleetCmd::Clean => clean(&api()?),
        FleetCmd::Qos(a) => qos::run(a, json, &api()?),
    }
}

fn profiles(json: bool) {
    if json {
        let v: Vec<Value> = Profile::ALL
            .iter()
            .map(|p| serde_json::json!({"name": p.name(), "description": p.description(), "defaults": p.defaults()}))
            .collect();
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return;
    }
    let mut t = converge_fleet::table::Table::new(
        "",
        &[
            "PROFILE",
            "BS",
            "QD",
            "WRITE %",
            "WORKERS/NODE",
            "WORKING SET",
            "POINTS",
        ],
    );
    for p in Profile::ALL {
        let d = p.defaults();
        let l = |v: &[u32]| {
            v.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        t.row(vec![
            p.name().into(),
            d.block_sizes
                .iter()
                .map(|b| format_size(*b))
                .collect::<Vec<_>>()
                .join(","),
            l(&d.queue_depths),
            d.write_pcts
                .iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(","),
            l(&d.workers_per_node),
            format_size(d.working_set_bytes),
            profile::points(&d).len().to_string(),
        ]);
    }
    print!("{}", t.to_text());
    println!("\nDefaults: 10 s warm-up, 30 s measured per point, mirror-3. --quick: 1 worker/node, 64 MiB, 2 s + 5 s.");
    for p in Profile::ALL {
        println!("  {:12} {}", p.name(), p.description());
    }
}

fn overrides(a: &RunArgs) -> Result<Overrides> {
    let dur = |v: &Option<String>| -> Result<Option<u64>> {
        v.as_deref()
            .map(profile::parse_duration_s)
            .transpose()
            .map_err(|e| anyhow!("{e}"))
    };
    Ok(Overrides {
        workers_per_node: a.workers_per_node.clone(),
        qd: a.qd.clone(),
        write_pct: a.write_pct.clone(),
        bs: a
            .bs
            .as_ref()
            .map(|v| {
                v.iter()
                    .map(|s| parse_size(s).map_err(|e| anyhow!("--bs: {e}")))
                    .collect::<Result<Vec<u64>>>()
            })
            .transpose()?,
        working_set: a
            .working_set
            .as_deref()
            .map(|s| parse_size(s).map_err(|e| anyhow!("--working-set: {e}")))
            .transpose()?,
        resiliency: a
            .resiliency
            .as_deref()
            .map(|s| {
                s.parse::<Resiliency>()
                    .map_err(|e| anyhow!("--resiliency: {e}"))
            })
            .transpose()?,
        warmup_s: dur(&a.warmup).context("--warmup")?,
        duration_s: dur(&a.duration).context("--duration")?,
        cooldown_s: dur(&a.cooldown).context("--cooldown")?,
        repeat: a.repeat,
        quick: a.quick,
        compress_pct: a.compressible,
        dedupe_pct: a.dedupe,
        compression: a
            .compression
            .as_deref()
            .map(|c| {
                c.parse::<Compression>()
                    .map_err(|e| anyhow!("--compression: {e}"))
            })
            .transpose()?,
        encrypt: a.encrypt,
        saturate: a.saturate,
    })
}

fn check_out_dir(out: &Path) -> Result<()> {
    if out.exists() {
        let empty = std::fs::read_dir(out)
            .with_context(|| format!("--out {} exists but cannot be read", out.display()))?
            .next()
            .is_none();
        if !empty {
            bail!(
                "--out {} already exists and is not empty: choose a new directory (runs are \
                 never overwritten; `converge fleet report {}` re-renders that one)",
                out.display(),
                out.display()
            );
        }
    }
    Ok(())
}

/// The run: everything checked before anything starts.
struct Plan {
    settings: Settings,
    points: Vec<Point>,
    nodes: Vec<NodeCtx>,
    config: RunConfig,
}

fn plan(a: &RunArgs, api: &str) -> Result<Plan> {
    // 1. The arguments alone.
    let mut settings = profile::resolve(&a.profile, &overrides(a)?).map_err(|e| anyhow!("{e}"))?;
    if let Some(dir) = &a.vms {
        let dir = std::path::absolute(dir).with_context(|| format!("--vms {}", dir.display()))?;
        for f in ["vmlinuz", "initrd.gz"] {
            if !dir.join(f).is_file() {
                bail!(
                    "--vms {}: no {f} there; build the guest image with \
                     scripts/guest-image.sh --with-fio {}",
                    dir.display(),
                    dir.display()
                );
            }
        }
        settings.vm = Some(converge_api::fleet::VmWorker {
            image: dir.display().to_string(),
            accel: a.vm_accel.clone(),
            memory_mib: a.vm_memory,
        });
    }
    let points = profile::points(&settings);
    let flag_tbw = a
        .drive_tbw
        .as_deref()
        .map(|s| parse_size(s).map_err(|e| anyhow!("--drive-tbw: {e}")))
        .transpose()?;
    if let Some(y) = a.drive_warranty_years {
        if !(y > 0.0 && y <= 100.0) {
            bail!("--drive-warranty-years {y}: must be above 0 and at most 100");
        }
    }
    if flag_tbw == Some(0) {
        bail!("--drive-tbw 0: a rating must be above 0");
    }
    check_out_dir(&a.out)?;

    // 2. The cluster.
    let status: Status =
        http::call(api, "GET", "/v1/status", None).context("reading the cluster's status")?;
    if status.health != "healthy" {
        bail!(
            "the cluster is not healthy ({}): a fleet would measure a degraded cluster; \
             fix it first (`converge status`)",
            status.health
        );
    }
    let cache_settings: converge_api::Settings =
        http::call(api, "GET", "/v1/settings", None).context("reading the cluster's settings")?;
    check_cache_mode(a.cache_mode, &status.caches, &cache_settings)?;
    let live: Vec<_> = status
        .nodes
        .iter()
        .filter(|n| n.live)
        .filter(|n| a.cluster_nodes.as_ref().is_none_or(|c| c.contains(&n.id.0)))
        .collect();
    let worker_ids: Vec<NodeId> = match &a.nodes {
        None => live.iter().map(|n| n.id).collect(),
        Some(ids) => {
            let mut v = Vec::new();
            for &id in ids {
                if !live.iter().any(|n| n.id.0 == id) {
                    bail!(
                        "--nodes {id}: no live node {id} (live nodes: {})",
                        live.iter()
                            .map(|n| n.id.to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    );
                }
                if !v.contains(&NodeId(id)) {
                    v.push(NodeId(id));
                }
            }
            v
        }
    };
    if worker_ids.is_empty() {
        bail!("no live node to run workers on");
    }
    let copies = settings.resiliency.copies();
    if live.len() < copies {
        bail!(
            "{} needs {copies} nodes for its copies or chunks but the cluster has {} live: \
             use --resiliency with fewer, or add nodes",
            settings.resiliency,
            live.len()
        );
    }
    let mut nodes = Vec::new();
    for n in &live {
        let api = node_api(&n.api_addr);
        let info: FleetNode =
            http::call(&api, "GET", "/v1/fleet/node", None).with_context(|| {
                format!(
                    "asking node {} ({api}) for its fleet information: is it running a converged \
                 with the fleet API?",
                    n.id
                )
            })?;
        let runs_workers = worker_ids.contains(&n.id);
        if runs_workers {
            if let Some(e) = &info.fio_error {
                bail!("node {} cannot run fleet workers: {e}", n.id);
            }
            let qd_max = settings.queue_depths.iter().copied().max().unwrap_or(1);
            if qd_max as usize > info.nbd_inflight_max {
                bail!(
                    "--qd {qd_max} is above node {}'s limit of {} requests in flight per NBD \
                     connection (knobs.nbd_inflight_max): use a lower QD or raise the knob",
                    n.id,
                    info.nbd_inflight_max
                );
            }
        }
        let busy: Vec<WorkerStatus> = http::call(&api, "GET", "/v1/fleet/workers", None)?;
        if let Some(w) = busy.iter().find(|w| w.state == WorkerState::Running) {
            bail!(
                "node {} already runs fleet worker {} ({} on volume {}): another fleet is \
                 running; wait for it, or stop it with `converge fleet clean`",
                n.id,
                w.id,
                w.spec.name,
                w.spec.volume
            );
        }
        nodes.push(NodeCtx {
            id: n.id,
            api,
            info,
            runs_workers,
        });
    }
    let per_node = settings.volumes_per_node();
    let volumes: Vec<String> = nodes
        .iter()
        .filter(|n| n.runs_workers)
        .flat_map(|n| (1..=per_node).map(move |k| volume_name(n.id, k)))
        .collect();
    let existing: Vec<&str> = status
        .volumes
        .iter()
        .map(|v| v.name.as_str())
        .filter(|v| volumes.iter().any(|x| x == v))
        .collect();
    if !existing.is_empty() {
        bail!(
            "volume{} {} already exist{} (left by an earlier fleet run?): delete {} with \
             `converge fleet clean` or `converge volume delete NAME`",
            if existing.len() == 1 { "" } else { "s" },
            existing.join(", "),
            if existing.len() == 1 { "s" } else { "" },
            if existing.len() == 1 { "it" } else { "them" }
        );
    }
    // 3. Capacity: every volume is written end to end, so every slab of it is allocated.
    let slab = status.cluster.slab_size_bytes.max(1);
    let per_copy = settings.working_set_bytes.div_ceil(slab) * slab;
    let need = volumes.len() as u64 * per_copy * copies as u64;
    let free = status
        .capacity
        .total_bytes
        .saturating_sub(status.capacity.used_bytes);
    if need > free {
        bail!(
            "not enough free capacity for the fleet: it needs {} ({} volumes × {} in {} \
             slabs × {copies} copies for {}) but the cluster has {} free of {}. Use a smaller \
             --working-set, fewer --workers-per-node or --nodes, or a resiliency with fewer \
             copies",
            format_size(need),
            volumes.len(),
            format_size(settings.working_set_bytes),
            format_size(slab),
            settings.resiliency,
            format_size(free),
            format_size(status.capacity.total_bytes)
        );
    }
    // 4. The configuration the report states.
    let mut drives = Vec::new();
    for n in &nodes {
        for d in &n.info.drives {
            drives.push(DriveConfig {
                id: d.id,
                node: d.node.0,
                path: d.path.clone(),
                role: d.role,
                media: d.media,
                size_bytes: d.size_bytes,
                rating: endurance::resolve(
                    d.media,
                    d.size_bytes,
                    d.tbw_bytes,
                    d.warranty_years,
                    flag_tbw,
                    a.drive_warranty_years,
                ),
            });
        }
    }
    let config = RunConfig {
        format_version: FORMAT_VERSION,
        command: std::env::args().collect::<Vec<_>>().join(" "),
        cli_version: env!("CARGO_PKG_VERSION").to_string(),
        started_unix: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        cluster: ClusterConfig {
            name: status.cluster.name.clone(),
            id: status.cluster.id.to_string(),
            slab_size_bytes: status.cluster.slab_size_bytes,
            health: status.health.clone(),
            // Stated again once --cache-mode is in effect (see run_fleet).
            cache_mode: describe_caches(&status.caches, &drives),
        },
        capacity: None,
        copy_nodes: Vec::new(),
        nodes: nodes
            .iter()
            .map(|n| NodeConfig {
                id: n.id.0,
                name: n.info.name.clone(),
                hostname: n.info.hostname.clone(),
                host_id: n.info.host_id.clone(),
                kernel: n.info.kernel.clone(),
                cpus: n.info.cpus,
                converged_version: n.info.converged_version.clone(),
                fio_version: n.info.fio_version.clone().unwrap_or_default(),
                runs_workers: n.runs_workers,
            })
            .collect(),
        drives,
        settings: settings.clone(),
        volumes,
    };
    Ok(Plan {
        settings,
        points,
        nodes,
        config,
    })
}

// ---------------------------------------------------------------------------- cache mode

/// `--cache-mode` is refused before anything starts when it cannot take effect: no cache
/// drives, or nodes whose own mode overrides the pool's.
fn check_cache_mode(
    want: Option<CacheMode>,
    caches: &[CacheInfo],
    settings: &converge_api::Settings,
) -> Result<()> {
    let Some(want) = want else { return Ok(()) };
    if caches.is_empty() {
        bail!(
            "--cache-mode needs cache drives (converge lab up --cache-drives N), and this \
             cluster has none"
        );
    }
    if !settings.node_cache_modes.is_empty() {
        let nodes: Vec<String> = settings
            .node_cache_modes
            .iter()
            .map(|(n, m)| format!("node {n} ({m})"))
            .collect();
        bail!(
            "--cache-mode {want} sets the pool's mode, but {} ha{} a mode of its own, which \
             wins: clear it with `converge cache mode auto --node N` first",
            nodes.join(", "),
            if nodes.len() == 1 { "s" } else { "ve" }
        );
    }
    Ok(())
}

/// The cache tier as the report states it: the modes in effect, how many cache drives,
/// their size and how capacity drives are bound to them.
fn describe_caches(caches: &[CacheInfo], drives: &[DriveConfig]) -> String {
    if caches.is_empty() {
        return "none (no cache drives)".into();
    }
    let mut by_mode: BTreeMap<String, Vec<NodeId>> = BTreeMap::new();
    for c in caches {
        let nodes = by_mode.entry(c.mode.to_string()).or_default();
        if !nodes.contains(&c.node) {
            nodes.push(c.node);
        }
    }
    let modes = if by_mode.len() == 1 {
        by_mode.keys().next().cloned().unwrap_or_default()
    } else {
        let parts: Vec<String> = by_mode
            .iter()
            .map(|(m, ns)| {
                let ids: Vec<String> = ns.iter().map(|n| n.to_string()).collect();
                format!(
                    "{m} on node{} {}",
                    if ids.len() == 1 { "" } else { "s" },
                    ids.join(", ")
                )
            })
            .collect();
        format!("mixed: {}", parts.join("; "))
    };
    let size_of = |c: &CacheInfo| -> u64 {
        drives
            .iter()
            .find(|d| d.id == c.drive)
            .map_or(c.log_bytes, |d| d.size_bytes)
    };
    let (lo, hi) = caches
        .iter()
        .map(size_of)
        .fold((u64::MAX, 0), |(lo, hi), x| (lo.min(x), hi.max(x)));
    let size = if lo == hi {
        format!("{} each", format_size(lo))
    } else {
        format!("{} to {}", format_size(lo), format_size(hi))
    };
    let (blo, bhi) = caches
        .iter()
        .map(|c| c.bound.len())
        .fold((usize::MAX, 0), |(lo, hi), x| (lo.min(x), hi.max(x)));
    let bound = if blo == bhi {
        format!("bound 1:{blo}")
    } else {
        format!("bound 1:{blo} to 1:{bhi}")
    };
    let failed = caches.iter().filter(|c| c.failed.is_some()).count();
    format!(
        "{modes} ({} cache drive{}, {size}, {bound}{})",
        caches.len(),
        if caches.len() == 1 { "" } else { "s" },
        if failed > 0 {
            format!(", {failed} failed")
        } else {
            String::new()
        }
    )
}

fn caches_now(api: &str) -> Result<Vec<CacheInfo>> {
    http::call(api, "GET", "/v1/caches", None).context("reading the cache drives")
}

fn set_pool_cache_mode(api: &str, mode: Option<CacheMode>) -> Result<()> {
    let body = serde_json::to_value(SetCacheMode { mode, node: None })?;
    let _: converge_api::Settings = http::call(api, "POST", "/v1/cache/mode", Some(&body))?;
    Ok(())
}

/// The pool's cache mode as it was before `--cache-mode`, put back on every way out of
/// the run (also when dropped on an early return).
struct CacheModeGuard<'a> {
    api: &'a str,
    prev: Option<CacheMode>,
    armed: bool,
}

impl CacheModeGuard<'_> {
    /// Restores the pool's setting; says what it did, or why it could not.
    fn restore(&mut self) -> Option<String> {
        if !std::mem::take(&mut self.armed) {
            return None;
        }
        let what = self
            .prev
            .map_or("auto (no pool setting)".to_string(), |m| m.to_string());
        Some(match set_pool_cache_mode(self.api, self.prev) {
            Ok(()) => format!("pool cache mode restored to {what}"),
            Err(e) => format!(
                "warning: could not restore the pool cache mode to {what}: {e:#} (set it with \
                 `converge cache mode {}`)",
                self.prev.map_or("auto".to_string(), |m| m.to_string())
            ),
        })
    }
}

impl Drop for CacheModeGuard<'_> {
    fn drop(&mut self) {
        if let Some(msg) = self.restore() {
            eprintln!("{msg}");
        }
    }
}

/// Sets the pool's cache mode and waits until every cache drive reports it.
fn apply_cache_mode<'a>(
    api: &'a str,
    want: CacheMode,
    progress: &mut Progress,
) -> Result<(CacheModeGuard<'a>, Vec<CacheInfo>)> {
    let settings: converge_api::Settings = http::call(api, "GET", "/v1/settings", None)?;
    set_pool_cache_mode(api, Some(want)).context("setting the pool's cache mode")?;
    let guard = CacheModeGuard {
        api,
        prev: settings.cache_mode,
        armed: true,
    };
    let deadline = Instant::now() + CACHE_MODE_WAIT;
    loop {
        let caches = caches_now(api)?;
        let behind: Vec<String> = caches
            .iter()
            .filter(|c| c.mode != want)
            .map(|c| format!("{} on node {} ({})", c.path, c.node, c.mode))
            .collect();
        if behind.is_empty() && !caches.is_empty() {
            return Ok((guard, caches));
        }
        progress.status(&format!(
            "cache mode {want}: waiting for {} cache drive(s)",
            behind.len()
        ));
        if Instant::now() > deadline {
            bail!(
                "cache mode {want} was set but after {} s these cache drives still run \
                 another mode: {} (see `converge cache status` and the nodes' logs)",
                CACHE_MODE_WAIT.as_secs(),
                behind.join(", ")
            );
        }
        sleep_until(Instant::now() + POLL)?;
    }
}

/// What the run has started on the cluster, so it can be undone on every way out.
struct Session<'a> {
    api: &'a str,
    nodes: &'a [NodeCtx],
    created: Vec<String>,
    /// (node index, worker id) of workers not yet deleted.
    workers: Vec<(usize, u64)>,
    keep: bool,
}

impl<'a> Session<'a> {
    fn new(api: &'a str, nodes: &'a [NodeCtx], keep: bool) -> Session<'a> {
        Session {
            api,
            nodes,
            created: Vec::new(),
            workers: Vec::new(),
            keep,
        }
    }

    fn start_worker(&mut self, ni: usize, spec: &WorkerSpec) -> Result<WorkerStatus> {
        let n = &self.nodes[ni];
        let body = serde_json::to_value(spec)?;
        let w: WorkerStatus = http::call(&n.api, "POST", "/v1/fleet/workers", Some(&body))
            .with_context(|| format!("starting worker {} on node {}", spec.name, n.id))?;
        self.workers.push((ni, w.id));
        Ok(w)
    }

    fn statuses(&self) -> Result<Vec<(usize, WorkerStatus)>> {
        let mut out = Vec::new();
        for (ni, n) in self.nodes.iter().enumerate() {
            if !self.workers.iter().any(|(i, _)| *i == ni) {
                continue;
            }
            let all: Vec<WorkerStatus> = http::call(&n.api, "GET", "/v1/fleet/workers", None)
                .with_context(|| format!("polling node {}'s workers", n.id))?;
            for w in all {
                if self.workers.contains(&(ni, w.id)) {
                    out.push((ni, w));
                }
            }
        }
        Ok(out)
    }

    /// Fail fast if a worker failed or vanished.
    fn check_workers(&self) -> Result<usize> {
        let st = self.statuses()?;
        if st.len() < self.workers.len() {
            bail!("a fleet worker vanished from its node (was converged restarted?)");
        }
        for (ni, w) in &st {
            if w.state == WorkerState::Failed || w.state == WorkerState::Stopped {
                bail!(
                    "worker {} on node {} {}: {}",
                    w.spec.name,
                    self.nodes[*ni].id,
                    if w.state == WorkerState::Failed {
                        "failed"
                    } else {
                        "was stopped"
                    },
                    w.message.clone().unwrap_or_else(|| "no message".into())
                );
            }
        }
        Ok(st
            .iter()
            .filter(|(_, w)| w.state == WorkerState::Running)
            .count())
    }

    fn delete_workers(&mut self) {
        for (ni, id) in std::mem::take(&mut self.workers) {
            let n = &self.nodes[ni];
            let _ = http::request(&n.api, "DELETE", &format!("/v1/fleet/workers/{id}"), None);
        }
    }

    fn cleanup(&mut self, progress: &mut Progress) {
        self.delete_workers();
        if self.keep {
            if !self.created.is_empty() {
                progress.line(&format!(
                    "kept {} volumes (--keep): {}",
                    self.created.len(),
                    self.created.join(", ")
                ));
            }
            return;
        }
        for v in std::mem::take(&mut self.created) {
            if let Err(e) =
                http::call::<Value>(self.api, "DELETE", &format!("/v1/volumes/{v}"), None)
            {
                progress.line(&format!(
                    "warning: could not delete volume {v}: {e:#} (delete it with `converge volume delete {v}`)"
                ));
            }
        }
    }
}

fn run_fleet(a: &RunArgs, json: bool, api: &str) -> Result<()> {
    let t0 = Instant::now();
    let Plan {
        settings,
        points,
        nodes,
        mut config,
    } = plan(a, api)?;
    std::fs::create_dir_all(a.out.join("raw"))
        .with_context(|| format!("creating {}", a.out.display()))?;
    install_signal_handlers();
    let mut progress = Progress::new();
    let mut cache_guard = None;
    let mut notes = Vec::new();
    if let Some(want) = a.cache_mode {
        let (guard, caches) = apply_cache_mode(api, want, &mut progress)?;
        config.cluster.cache_mode = describe_caches(&caches, &config.drives);
        notes.push(format!(
            "cache mode {want} set for the run (--cache-mode); the pool's setting before it \
             was {}",
            guard
                .prev
                .map_or("auto (no pool setting)".to_string(), |m| m.to_string())
        ));
        progress.line(&format!("cache: {}", config.cluster.cache_mode));
        cache_guard = Some(guard);
    }
    let total = points.len() * settings.repeat as usize;
    progress.line(&format!(
        "fleet {}: {} points x {} repeat{} on {} nodes ({} workers), {} of {} per worker; \
         estimated {}; results in {}",
        settings.profile,
        points.len(),
        settings.repeat,
        if settings.repeat == 1 { "" } else { "s" },
        config.worker_nodes(),
        config.volumes.len(),
        format_size(settings.working_set_bytes),
        settings.resiliency,
        fmt::duration_s(profile::estimated_s(&settings) as f64),
        a.out.display()
    ));
    let mut summary = RunSummary {
        config,
        status: RunStatus::Running,
        wall_s: 0.0,
        points_planned: points.len(),
        points: Vec::new(),
        notes,
        timeline: None,
    };
    let mut session = Session::new(api, &nodes, a.keep);
    let rec = Recorder::new();
    let result = std::thread::scope(|sc| {
        sc.spawn(|| rec.record(&nodes));
        let r = sweep(
            &mut session,
            &settings,
            &points,
            &a.out,
            &mut summary,
            &mut progress,
            t0,
            total,
            &rec,
        );
        rec.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        r
    });
    summary.timeline = Some(rec.snapshot());
    session.cleanup(&mut progress);
    if let Some(msg) = cache_guard.as_mut().and_then(|g| g.restore()) {
        progress.line(&msg);
    }
    summary.wall_s = t0.elapsed().as_secs_f64();
    summary.status = match &result {
        Ok(()) => RunStatus::Complete,
        Err(e) if e.downcast_ref::<Interrupted>().is_some() => {
            RunStatus::Interrupted("Ctrl-C; workers stopped".into())
        }
        Err(e) => RunStatus::Failed(format!("{e:#}")),
    };
    summary.restat();
    report::write_all(&a.out, &summary)
        .with_context(|| format!("writing the report into {}", a.out.display()))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        print!("{}", report::headline_text(&summary));
        print_tail(&summary, &a.out);
    }
    match result {
        Ok(()) => Ok(()),
        Err(e) if e.downcast_ref::<Interrupted>().is_some() => {
            eprintln!(
                "converge: interrupted: {} of {} points measured; the report of those is in {}",
                summary.measured().count(),
                summary.points_planned,
                a.out.display()
            );
            std::process::exit(130);
        }
        Err(e) => Err(e.context(format!(
            "the fleet stopped; what was measured is in {}",
            a.out.display()
        ))),
    }
}

/// One policy a density study compares: a resiliency, and how its volumes compress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Policy {
    resiliency: Resiliency,
    compression: Compression,
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.compression.is_none() {
            write!(f, "{}", self.resiliency)
        } else {
            write!(f, "{}:{}", self.resiliency, self.compression)
        }
    }
}

impl std::str::FromStr for Policy {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Policy> {
        let (r, c) = match s.trim().split_once(':') {
            Some((r, c)) => (r, c.parse::<Compression>()?),
            None => (s.trim(), Compression::None),
        };
        let resiliency: Resiliency = r.parse()?;
        if resiliency.is_parity() && !c.is_none() {
            bail!("{s}: parity volumes store their chunks as written; compress mirror volumes");
        }
        Ok(Policy {
            resiliency,
            compression: c,
        })
    }
}

impl Policy {
    /// The run's directory under the study's: `mirror-3`, `mirror-3-zstd`.
    fn dir(&self) -> String {
        self.to_string().replace(':', "-")
    }
}

/// The policies a density study compares by default: those the cluster's live nodes can
/// place (every copy or chunk of a slab on its own node), and mirror-3 compressed.
fn density_defaults(api: &str) -> Result<Vec<Policy>> {
    let st: converge_api::Status = http::call(api, "GET", "/v1/status", None)?;
    let live = st.nodes.iter().filter(|n| n.live).count();
    let plain = |resiliency| Policy {
        resiliency,
        compression: Compression::None,
    };
    let all = [
        plain(Resiliency::Mirror3),
        Policy {
            resiliency: Resiliency::Mirror3,
            compression: Compression::Zstd,
        },
        plain(Resiliency::Mirror2),
        plain(Resiliency::Parity { data: 2, parity: 1 }),
        plain(Resiliency::Parity { data: 4, parity: 2 }),
    ];
    Ok(all
        .into_iter()
        .filter(|p| p.resiliency.copies() <= live)
        .collect())
}

/// `--study density`: one run per resiliency, then the comparison.
fn run_study(a: &RunArgs, json: bool, api: &str) -> Result<()> {
    let study = a
        .study
        .as_deref()
        .unwrap_or(if is_scale_out(a) { "scale-out" } else { "" });
    match study {
        "density" if is_scale_out(a) => bail!(
            "--profile scale-out is a study of its own (N nodes, then 2N): run it without \
             --study density"
        ),
        "density" => {}
        "scale-out" => return run_scale_out(a, json, api),
        _ => bail!(
            "--study {study:?}: the studies are `density` (the same profile on several \
             resiliencies, side by side) and `scale-out` (the same per-node load on N nodes, \
             then on 2N)"
        ),
    }
    check_out_dir(&a.out)?;
    if a.compression.is_some() {
        bail!(
            "--compression with --study density: name each policy's codec in --resiliency \
             instead, e.g. --resiliency mirror-3,mirror-3:zstd"
        );
    }
    let list: Vec<Policy> = match &a.resiliency {
        Some(s) => s
            .split(',')
            .map(|r| {
                r.parse::<Policy>()
                    .map_err(|e| anyhow!("--resiliency: {e}"))
            })
            .collect::<Result<_>>()?,
        None => density_defaults(api)?,
    };
    let mut unique = list.clone();
    unique.sort_by_key(|r| r.to_string());
    unique.dedup();
    if unique.len() < 2 || unique.len() != list.len() {
        bail!(
            "--study density compares two or more different policies; got {} (give \
             --resiliency mirror-3,parity-2+1, or use a cluster with 3 or more nodes)",
            list.iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    // Every run's own checks (profile, flags) before the first one starts.
    let mut check = a.clone();
    check.resiliency = None;
    profile::resolve(&a.profile, &overrides(&check)?).map_err(|e| anyhow!("{e}"))?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let mut dirs = Vec::new();
    if a.compressible.unwrap_or(0) == 0 && list.iter().any(|p| !p.compression.is_none()) {
        println!(
            "density study: the workers write random bytes (fio's default), which do not \
             compress: give --compressible PCT to see what compression saves"
        );
    }
    for (i, r) in list.iter().enumerate() {
        println!(
            "density study: run {} of {}: {r} -> {}",
            i + 1,
            list.len(),
            a.out.join(r.dir()).display()
        );
        let mut one = a.clone();
        one.study = None;
        one.resiliency = Some(r.resiliency.to_string());
        one.compression = (!r.compression.is_none()).then(|| r.compression.to_string());
        one.out = a.out.join(r.dir());
        if let Err(e) = run_fleet(&one, false, api) {
            if !dirs.is_empty() {
                let _ = report_cmd(&dirs, Some(&a.out), false);
            }
            return Err(e.context(format!(
                "density study: the {r} run failed; the runs before it are compared in {}",
                a.out.display()
            )));
        }
        dirs.push(one.out);
    }
    report_cmd(&dirs, Some(&a.out), json)
}

fn is_scale_out(a: &RunArgs) -> bool {
    a.profile.parse::<Profile>().is_ok_and(|p| p.is_scale_out())
}

/// Nodes the scale-out study set draining; dropping it cancels what it set, whatever
/// happened meanwhile (a failed run, Ctrl-C).
struct Draining<'a> {
    api: &'a str,
    set: Vec<u32>,
}

impl Draining<'_> {
    fn drain(&mut self, node: u32) -> Result<()> {
        self.set.push(node);
        crate::remove::drain(self.api, node)
            .with_context(|| format!("setting node {node} draining"))?;
        Ok(())
    }

    fn undrain(&mut self, node: u32) -> Result<()> {
        crate::remove::cancel(self.api, node)
            .with_context(|| format!("cancelling node {node}'s draining"))?;
        self.set.retain(|&n| n != node);
        Ok(())
    }
}

impl Drop for Draining<'_> {
    fn drop(&mut self) {
        for n in std::mem::take(&mut self.set) {
            if let Err(e) = crate::remove::cancel(self.api, n) {
                eprintln!(
                    "converge: node {n} is still draining after the scale-out study: {e:#}; \
                     cancel it with `converge node remove {n} --cancel`"
                );
            }
        }
    }
}

/// `--profile scale-out` (or `--study scale-out`): the same per-node load on the first
/// half of the nodes, every copy confined to them (placement skips draining nodes, so the
/// others drain for that run), then on all of them; OUT/nodes-N and OUT/nodes-2N hold the
/// runs, OUT/scale-out.{md,html,json} the factor per workload and each size's per-VM
/// latencies.
fn run_scale_out(a: &RunArgs, json: bool, api: &str) -> Result<()> {
    check_out_dir(&a.out)?;
    if a.keep {
        bail!(
            "--keep with the scale-out study: its second run creates the same volumes \
             (fleet-n<node>-w<k>) as the first, so the first run's cannot stay"
        );
    }
    let settings = profile::resolve(&a.profile, &overrides(a)?).map_err(|e| anyhow!("{e}"))?;
    let status: Status =
        http::call(api, "GET", "/v1/status", None).context("reading the cluster's status")?;
    let live: Vec<u32> = status
        .nodes
        .iter()
        .filter(|n| n.live)
        .map(|n| n.id.0)
        .collect();
    let mut all: Vec<u32> = match &a.nodes {
        Some(ids) => {
            for id in ids {
                if !live.contains(id) {
                    bail!("--nodes {id}: no live node {id} (live nodes: {live:?})");
                }
            }
            ids.clone()
        }
        None => live.clone(),
    };
    all.sort_unstable();
    all.dedup();
    let copies = settings.resiliency.copies();
    let half = all.len() / 2;
    if half < copies {
        bail!(
            "the scale-out study runs on N nodes, then on 2N, with every copy of the N-node \
             run inside its N nodes: {} needs N ≥ {copies}, so {} nodes, but {} {}. Add \
             nodes (`converge lab up --nodes {}`) or use --resiliency with fewer copies",
            settings.resiliency,
            2 * copies,
            if a.nodes.is_some() {
                "--nodes names"
            } else {
                "the cluster has"
            },
            all.len(),
            2 * copies
        );
    }
    if all.len() % 2 == 1 {
        let left = all.pop().unwrap_or_default();
        println!("scale-out: an odd number of nodes; node {left} sits out both runs");
    }
    let small: Vec<u32> = all[..half].to_vec();
    // Nodes outside a run's size must take none of its copies: they drain for it. Draining
    // moves copies away, so those nodes must hold none of anything.
    let outside: Vec<u32> = live
        .iter()
        .copied()
        .filter(|n| !small.contains(n))
        .collect();
    for &n in &outside {
        let held = crate::remove::copies_on(api, n)?;
        if held > 0 {
            bail!(
                "the scale-out study keeps node {n}'s drives out of the {half}-node run by \
                 draining node {n}, but node {n} holds {held} copies of other volumes, which \
                 draining would move: run the study on a cluster whose nodes {} hold no \
                 volumes (e.g. a fresh `converge lab up`)",
                outside
                    .iter()
                    .map(|x| x.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    if let Some(n) = status.nodes.iter().find(|n| n.draining) {
        bail!(
            "node {} is draining already: finish or cancel that first (`converge node remove \
             {} --cancel`)",
            n.id,
            n.id
        );
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let mut draining = Draining {
        api,
        set: Vec::new(),
    };
    let mut dirs = Vec::new();
    for (i, size) in [small.clone(), all.clone()].into_iter().enumerate() {
        for &n in &live {
            let inside = size.contains(&n);
            if !inside && !draining.set.contains(&n) {
                draining.drain(n)?;
            } else if inside && draining.set.contains(&n) {
                draining.undrain(n)?;
            }
        }
        let dir = format!("nodes-{}", size.len());
        println!(
            "scale-out: run {} of 2: nodes {} -> {}",
            i + 1,
            size.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            a.out.join(&dir).display()
        );
        let mut one = a.clone();
        one.study = None;
        one.nodes = Some(size.clone());
        one.cluster_nodes = Some(size.clone());
        one.out = a.out.join(&dir);
        run_fleet(&one, false, api).with_context(|| {
            format!(
                "scale-out: the {}-node run failed{}",
                size.len(),
                if dirs.is_empty() {
                    String::new()
                } else {
                    format!(
                        "; the {}-node run is in {}",
                        half,
                        a.out.join(&dirs[0]).display()
                    )
                }
            )
        })?;
        dirs.push(dir);
    }
    drop(draining);
    scale_out_report(&a.out, &dirs, json)
}

/// The scale-out study's directories under `out`: `nodes-N` and `nodes-2N`, by size.
fn scale_out_dirs(out: &Path) -> Result<Vec<String>> {
    let mut found: Vec<(usize, String)> = std::fs::read_dir(out)
        .with_context(|| format!("reading {}", out.display()))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let n = name.strip_prefix("nodes-")?.parse().ok()?;
            e.path().join("summary.json").is_file().then_some((n, name))
        })
        .collect();
    found.sort();
    if found.len() != 2 {
        bail!(
            "{} is neither a fleet run (no summary.json) nor a finished scale-out study (it \
             needs nodes-N/ and nodes-2N/, each with summary.json; found {})",
            out.display(),
            found.len()
        );
    }
    Ok(found.into_iter().map(|(_, d)| d).collect())
}

/// Writes OUT/scale-out.{md,html,json} from the runs in OUT/`dirs` (smaller first) and
/// prints the factor table (or the JSON).
fn scale_out_report(out: &Path, dirs: &[String], json: bool) -> Result<()> {
    let load = |d: &str| report::load(&out.join(d)).map_err(|e| anyhow!("{e}"));
    let (s1, s2) = (load(&dirs[0])?, load(&dirs[1])?);
    let (z1, z2) = (
        scaleout::Size {
            dir: dirs[0].clone(),
            summary: &s1,
        },
        scaleout::Size {
            dir: dirs[1].clone(),
            summary: &s2,
        },
    );
    let study = scaleout::study(&z1, &z2);
    for (name, body) in [
        ("scale-out.md", scaleout::markdown(&z1, &z2)),
        ("scale-out.html", scaleout::html(&z1, &z2)),
        ("scale-out.json", serde_json::to_string_pretty(&study)?),
    ] {
        report::write_atomic(&out.join(name), body.as_bytes())?;
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&study)?);
    } else {
        print!("{}", scaleout::text(&z1, &z2));
        println!(
            "scale-out: {}/scale-out.html (and scale-out.md, scale-out.json; each run's \
             report in {}/)",
            out.display(),
            dirs.join("/, ")
        );
    }
    Ok(())
}

fn print_tail(s: &RunSummary, out: &Path) {
    let wp: Vec<_> = s.measured().filter(|(p, _)| p.write_pct > 0).collect();
    if !wp.is_empty() {
        let avg = |f: &dyn Fn(&converge_fleet::PointStats) -> Option<f64>| {
            let v: Vec<f64> = wp.iter().filter_map(|(_, st)| f(st)).collect();
            if v.is_empty() {
                0.0
            } else {
                v.iter().sum::<f64>() / v.len() as f64
            }
        };
        let cache = if wp.iter().any(|(_, st)| st.wa.cache.is_some()) {
            format!(", cache tier {:.2}", avg(&|st| st.wa.cache))
        } else {
            String::new()
        };
        println!(
            "write amplification ({}, mean of write points, bytes over each point with the \
             caches flushed): capacity total {:.2}, data only {:.2}{cache}",
            s.config.settings.resiliency,
            avg(&|st| st.wa.total),
            avg(&|st| st.wa.data)
        );
    }
    for l in report::wait_analysis(s) {
        println!("{l}");
    }
    println!(
        "wall time {}; report: {}/report.html (and report.md, summary.json, summary.csv, raw/)",
        fmt::duration_s(s.wall_s),
        out.display()
    );
}

/// The fleet's volumes in the cluster's capacity accounting, once pre-filled.
fn capacity_after_prefill(
    api: &str,
    settings: &Settings,
    volumes: &[String],
) -> Result<converge_fleet::model::RunCapacity> {
    let st: converge_api::Status = http::call(api, "GET", "/v1/status", None)?;
    let r = settings.resiliency;
    let ours: Vec<&converge_api::VolumeInfo> = st
        .volumes
        .iter()
        .filter(|v| volumes.contains(&v.name))
        .collect();
    let allocated: u64 = ours.iter().map(|v| v.allocated_bytes).sum();
    let written: Option<u64> = ours.iter().map(|v| v.written_bytes).sum();
    let stored: Option<u64> = ours.iter().map(|v| v.stored_bytes).sum();
    // A compressed volume's copies take what they store; a plain one's, whole slabs.
    let raw_used = match (settings.compression.is_none(), stored) {
        (false, Some(st)) => r.raw_bytes(st),
        _ => r.raw_bytes(allocated),
    };
    let saved = match (written, stored) {
        (Some(w), Some(st)) => r.raw_bytes(w.saturating_sub(st)),
        _ => 0,
    };
    Ok(converge_fleet::model::RunCapacity {
        pool_raw_bytes: st.capacity.total_bytes,
        pool_usable_bytes: st
            .capacity
            .usable_bytes
            .get(&r.to_string())
            .copied()
            .unwrap_or(0),
        provisioned_bytes: ours.iter().map(|v| v.size_bytes).sum(),
        allocated_bytes: allocated,
        written_bytes: written,
        raw_used_bytes: raw_used,
        compression_saved_bytes: saved,
        stored_bytes: stored,
    })
}

/// Nodes whose drives hold a copy or chunk of `volumes`, from their slab records.
fn copy_nodes(api: &str, volumes: &[String]) -> Result<Vec<u32>> {
    let mut nodes = std::collections::BTreeSet::new();
    for v in volumes {
        let info: converge_api::VolumeInfo =
            http::call(api, "GET", &format!("/v1/volumes/{v}"), None)?;
        for slab in info.slabs.unwrap_or_default() {
            nodes.extend(slab.extents.iter().map(|e| e.node.0));
        }
    }
    Ok(nodes.into_iter().collect())
}

/// Power of two ≤ 1 MiB dividing `ws` (a multiple of 4 KiB): the pre-fill block size.
fn prefill_bs(ws: u64) -> u64 {
    let mut bs = 1 << 20;
    while bs > 4096 && !ws.is_multiple_of(bs) {
        bs >>= 1;
    }
    bs
}

#[allow(clippy::too_many_arguments)]
fn sweep(
    session: &mut Session,
    settings: &Settings,
    points: &[Point],
    out: &Path,
    summary: &mut RunSummary,
    progress: &mut Progress,
    t0: Instant,
    mut total: usize,
    recorder: &Recorder,
) -> Result<()> {
    let nodes = session.nodes;
    let workers: Vec<usize> = (0..nodes.len())
        .filter(|&i| nodes[i].runs_workers)
        .collect();
    // Volumes, each owned by its worker's node.
    let per_node = settings.volumes_per_node();
    for &ni in &workers {
        for k in 1..=per_node {
            check_interrupt()?;
            let name = volume_name(nodes[ni].id, k);
            progress.status(&format!("creating volume {name}"));
            let body = serde_json::to_value(CreateVolume {
                name: name.clone(),
                size_bytes: settings.working_set_bytes,
                resiliency: settings.resiliency,
                owner: Some(nodes[ni].id),
                min_replicas: None,
                mirror_part_bytes: None,
                compression: (!settings.compression.is_none()).then_some(settings.compression),
                encrypt: settings.encrypt,
                qos: None,
            })?;
            let _: Value = http::call(session.api, "POST", "/v1/volumes", Some(&body))
                .with_context(|| format!("creating volume {name}"))?;
            session.created.push(name);
        }
    }
    // Pre-fill every volume once, all at the same time.
    recorder.mark("pre-fill");
    let tp = Instant::now();
    let ws = settings.working_set_bytes;
    for &ni in &workers {
        for k in 1..=per_node {
            let spec = WorkerSpec {
                name: format!("prefill-n{}-w{k}", nodes[ni].id),
                volume: volume_name(nodes[ni].id, k),
                kind: WorkerKind::Prefill,
                bs_bytes: prefill_bs(ws),
                qd: 4,
                write_pct: 100,
                random_pct: 0,
                size_bytes: ws,
                ramp_s: 0,
                runtime_s: 0,
                compress_pct: settings.compress_pct,
                dedupe_pct: settings.dedupe_pct,
                vm: None,
            };
            session.start_worker(ni, &spec)?;
        }
    }
    let nvol = session.workers.len();
    loop {
        sleep_until(Instant::now() + POLL)?;
        let running = session.check_workers()?;
        progress.status(&format!(
            "pre-filling {nvol} volumes of {}: {} done ({})",
            format_size(ws),
            nvol - running,
            fmt::duration_s(tp.elapsed().as_secs_f64())
        ));
        if running == 0 {
            break;
        }
    }
    for &(ni, id) in &session.workers {
        let v: Value = http::call(
            &nodes[ni].api,
            "GET",
            &format!("/v1/fleet/workers/{id}/result"),
            None,
        )?;
        let job =
            fio::from_value(&v).map_err(|e| anyhow!("pre-fill on node {}: {e}", nodes[ni].id))?;
        if job.error != 0 || job.write.bytes < ws {
            bail!(
                "pre-fill on node {} wrote {} of {} (fio error {})",
                nodes[ni].id,
                format_size(job.write.bytes),
                format_size(ws),
                job.error
            );
        }
    }
    session.delete_workers();
    progress.line(&format!(
        "pre-filled {nvol} volumes of {} in {}",
        format_size(ws),
        fmt::duration_s(tp.elapsed().as_secs_f64())
    ));
    match capacity_after_prefill(session.api, settings, &session.created) {
        Ok(c) => summary.config.capacity = Some(c),
        Err(e) => progress.line(&format!(
            "warning: no capacity figures in the report: reading /v1/status: {e:#}"
        )),
    }
    match copy_nodes(session.api, &session.created) {
        Ok(n) => summary.config.copy_nodes = n,
        Err(e) => progress.line(&format!(
            "warning: the report does not say which nodes hold the copies: {e:#}"
        )),
    }

    let mut done = 0usize;
    let sweep_start = Instant::now();
    // Series a saturation search has finished, with their knees.
    let mut saturated: Vec<((u64, u32, u8), u32)> = Vec::new();
    for point in points {
        let series = profile::series_of(point);
        if let Some(&(_, knee)) = saturated.iter().find(|(k, _)| *k == series) {
            // Past the knee: not run, and not planned any more.
            total -= settings.repeat as usize;
            summary.points_planned -= 1;
            progress.line(&format!(
                "{}: not run, the series saturated at QD {knee}",
                point.label()
            ));
            continue;
        }
        let mut rec = PointRecord {
            point: point.clone(),
            repeats: Vec::new(),
            stats: None,
        };
        for rep in 1..=settings.repeat {
            let eta = {
                let left = (total - done) as f64;
                let per = if done > 0 {
                    sweep_start.elapsed().as_secs_f64() / done as f64
                } else {
                    (settings.warmup_s + settings.duration_s + settings.cooldown_s) as f64 + 2.0
                };
                fmt::duration_s(left * per)
            };
            let head = format!(
                "[{:>w$}/{total}] {}{}",
                done + 1,
                point.label(),
                if settings.repeat > 1 {
                    format!(" (repeat {rep}/{})", settings.repeat)
                } else {
                    String::new()
                },
                w = total.to_string().len()
            );
            recorder.mark(if settings.repeat > 1 {
                format!("{} (repeat {rep})", point.label())
            } else {
                point.label()
            });
            let m = measure_point(session, settings, point, rep, out, progress, &head, &eta)?;
            rec.repeats.push(m);
            done += 1;
            if settings.cooldown_s > 0 {
                progress.status(&format!(
                    "{head}: cool-down {} s — ETA {eta}",
                    settings.cooldown_s
                ));
                sleep_until(Instant::now() + Duration::from_secs(settings.cooldown_s))?;
            }
        }
        rec.stats = converge_fleet::model::point_stats(&summary.config, point, &rec.repeats);
        if let Some(st) = &rec.stats {
            progress.line(&format!(
                "[{:>w$}/{}] {}: {} IOPS, {} MB/s, mean {}, p99.9 {}",
                summary.points.len() + 1,
                summary.points_planned,
                point.label(),
                fmt::iops(st.iops),
                fmt::sig3(st.mb_per_s),
                fmt::lat_opt(st.lat_mean_us),
                fmt::tail(
                    st.all_pct_us.get(3).copied().flatten(),
                    st.read_samples + st.write_samples
                ),
                w = points.len().to_string().len()
            ));
        }
        summary.points.push(rec);
        if settings.saturate {
            let curve: Vec<(u32, f64)> = summary
                .measured()
                .filter(|(p, _)| profile::series_of(p) == series)
                .map(|(p, st)| (p.qd, st.iops))
                .collect();
            if let Some(knee) = profile::saturated_at(&curve) {
                saturated.push((series, knee));
                progress.line(&format!(
                    "saturated at QD {knee}: QD {} added less than {:.0} % IOPS",
                    point.qd,
                    100.0 * profile::SATURATION_GAIN
                ));
            }
        }
        // The report so far, after every point: a crash or Ctrl-C keeps it.
        summary.wall_s = t0.elapsed().as_secs_f64();
        summary.timeline = Some(recorder.snapshot());
        report::write_all(out, summary)
            .with_context(|| format!("writing the report into {}", out.display()))?;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn measure_point(
    session: &mut Session,
    s: &Settings,
    point: &Point,
    rep: u32,
    out: &Path,
    progress: &mut Progress,
    head: &str,
    eta: &str,
) -> Result<measure::RepeatMeasure> {
    let nodes = session.nodes;
    let raw = out.join("raw").join(point.slug()).join(format!("r{rep}"));
    std::fs::create_dir_all(&raw).with_context(|| format!("creating {}", raw.display()))?;
    let warmup = Duration::from_secs(s.warmup_s);
    let duration = Duration::from_secs(s.duration_s);
    // WA start: nothing left in any cache from before (pre-fill, the previous point).
    progress.status(&format!("{head}: flushing caches — ETA {eta}"));
    let flush_start = flush_all(nodes, &format!("before {}", point.label()))?;
    check_interrupt()?;
    let wa_start = sample_all(nodes)?;
    // Start every worker; the measured window must lie inside every worker's.
    let mut slots = Vec::new();
    let first = Instant::now();
    for (ni, n) in nodes.iter().enumerate().filter(|(_, n)| n.runs_workers) {
        for k in 1..=point.workers_per_node {
            let spec = WorkerSpec {
                name: format!("{}-r{rep}-n{}-w{k}", point.slug(), n.id),
                volume: volume_name(n.id, k),
                kind: WorkerKind::Measure,
                bs_bytes: point.bs_bytes,
                qd: point.qd,
                write_pct: point.write_pct,
                random_pct: point.random_pct,
                size_bytes: s.working_set_bytes,
                ramp_s: s.warmup_s,
                runtime_s: s.duration_s,
                compress_pct: s.compress_pct,
                dedupe_pct: s.dedupe_pct,
                vm: s.vm.clone(),
            };
            let w = session.start_worker(ni, &spec)?;
            slots.push((ni, k, w.id, spec.volume));
        }
    }
    let mut first = first;
    if s.vm.is_some() {
        // Guests: every one boots first, then all start together.
        let deadline = Instant::now() + GUEST_BOOT_WAIT;
        loop {
            session.check_workers()?;
            let booting = session
                .statuses()?
                .iter()
                .filter(|(_, w)| w.booting)
                .count();
            if booting == 0 {
                break;
            }
            if Instant::now() > deadline {
                bail!(
                    "{booting} guests of {} did not boot within {} s",
                    point.label(),
                    GUEST_BOOT_WAIT.as_secs()
                );
            }
            progress.status(&format!(
                "{head}: {booting} of {} guests booting — ETA {eta}",
                slots.len()
            ));
            sleep_until(Instant::now() + POLL)?;
        }
        first = Instant::now();
        for (ni, _, id, _) in &slots {
            let n = &nodes[*ni];
            let _: Value = http::call(&n.api, "POST", &format!("/v1/fleet/workers/{id}/go"), None)
                .with_context(|| format!("starting guest worker {id} on node {}", n.id))?;
        }
    }
    let last = Instant::now();
    // Window: after the last worker's warm-up, before the first worker's end.
    let margin = (duration / 10).min(Duration::from_millis(500));
    let from = last + warmup + Duration::from_millis(100);
    let mut to = first + warmup + duration - margin;
    if to <= from + Duration::from_millis(200) {
        to = from + Duration::from_millis(200);
    }
    while Instant::now() < from {
        progress.status(&format!(
            "{head}: warm-up {}/{} s — ETA {eta}",
            first.elapsed().as_secs().min(s.warmup_s),
            s.warmup_s
        ));
        sleep_until((Instant::now() + POLL).min(from))?;
        session.check_workers()?;
    }
    let before = sample_all(nodes)?;
    while Instant::now() < to {
        progress.status(&format!(
            "{head}: measuring {}/{} s — ETA {eta}",
            from.elapsed().as_secs().min(s.duration_s),
            s.duration_s
        ));
        sleep_until((Instant::now() + POLL).min(to))?;
        if Instant::now() < to {
            session.check_workers()?;
        }
    }
    let after = sample_all(nodes)?;
    let deadline = first + warmup + duration + END_GRACE;
    loop {
        let running = session.check_workers()?;
        if running == 0 {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "{running} workers of {} still run {} s after their end; see the nodes' logs",
                point.label(),
                END_GRACE.as_secs()
            );
        }
        progress.status(&format!("{head}: collecting — ETA {eta}"));
        sleep_until(Instant::now() + Duration::from_millis(250))?;
    }
    // WA end: every byte the point's writes cost, destage of what the caches hold included.
    progress.status(&format!("{head}: flushing caches — ETA {eta}"));
    let flush_end = flush_all(nodes, &format!("after {}", point.label()))?;
    let wa_end = sample_all(nodes)?;
    let mut runs = Vec::new();
    for (ni, k, id, volume) in slots {
        let n = &nodes[ni];
        let v: Value = http::call(
            &n.api,
            "GET",
            &format!("/v1/fleet/workers/{id}/result"),
            None,
        )
        .with_context(|| format!("fetching the result of worker {id} on node {}", n.id))?;
        let file = raw.join(format!("node{}-w{k}.json", n.id));
        std::fs::write(&file, serde_json::to_vec_pretty(&v)?)
            .with_context(|| format!("writing {}", file.display()))?;
        let job = fio::from_value(&v)
            .map_err(|e| anyhow!("worker {k} on node {} ({}): {e}", n.id, file.display()))?;
        runs.push(WorkerRun {
            node: n.id.0,
            worker: k,
            volume,
            job,
        });
    }
    session.delete_workers();
    let pairs: Vec<(FleetSample, FleetSample)> = before.into_iter().zip(after).collect();
    std::fs::write(
        raw.join("samples.json"),
        serde_json::to_vec_pretty(
            &pairs
                .iter()
                .map(|(a, b)| serde_json::json!({"node": a.node, "before": a, "after": b}))
                .collect::<Vec<_>>(),
        )?,
    )?;
    let wa_pairs: Vec<(FleetSample, FleetSample)> = wa_start.into_iter().zip(wa_end).collect();
    std::fs::write(
        raw.join("wa-samples.json"),
        serde_json::to_vec_pretty(
            &wa_pairs
                .iter()
                .zip(flush_start.iter().zip(&flush_end))
                .map(|((a, b), (fa, fb))| {
                    serde_json::json!({
                        "node": a.node,
                        "flush_start": fa,
                        "start": a,
                        "flush_end": fb,
                        "end": b,
                    })
                })
                .collect::<Vec<_>>(),
        )?,
    )?;
    let mut m =
        measure::measure(rep, &runs, &pairs).map_err(|e| anyhow!("{}: {e}", point.label()))?;
    m.point_bytes = Some(
        measure::point_bytes(&wa_pairs)
            .map_err(|e| anyhow!("{} (write amplification): {e}", point.label()))?,
    );
    Ok(m)
}

fn report_cmd(dirs: &[PathBuf], out: Option<&Path>, json: bool) -> Result<()> {
    if let [d] = dirs {
        if d.is_dir() && !d.join("summary.json").exists() {
            // A scale-out study's directory: its report again, from its two runs.
            if out.is_some() {
                bail!(
                    "--out with a scale-out study: its report is written into {}",
                    d.display()
                );
            }
            return scale_out_report(d, &scale_out_dirs(d)?, json);
        }
    }
    let mut runs = Vec::new();
    for d in dirs {
        let s = report::load(d).map_err(|e| anyhow!("{e}"))?;
        runs.push((d.display().to_string(), s));
    }
    if runs.len() == 1 {
        let (src, s) = &runs[0];
        let dir = out
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from(src));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        report::write_all(&dir, s).with_context(|| format!("writing into {}", dir.display()))?;
        if json {
            println!("{}", serde_json::to_string_pretty(s)?);
        } else {
            print!("{}", report::headline_text(s));
            println!(
                "report: {}/report.html (and report.md, summary.csv)",
                dir.display()
            );
        }
        return Ok(());
    }
    let labels = compare::labels(&runs);
    let runs: Vec<compare::Run> = runs
        .into_iter()
        .zip(labels)
        .map(|((source, summary), label)| compare::Run {
            label,
            source,
            summary,
        })
        .collect();
    if json {
        let v: Vec<Value> = runs
            .iter()
            .map(
                |r| serde_json::json!({"label": r.label, "source": r.source, "summary": r.summary}),
            )
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", compare::text(&runs));
    }
    if let Some(dir) = out {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        report::write_atomic(&dir.join("compare.md"), compare::markdown(&runs).as_bytes())?;
        report::write_atomic(&dir.join("compare.html"), compare::html(&runs).as_bytes())?;
        if !json {
            println!(
                "comparison: {}/compare.html (and compare.md)",
                dir.display()
            );
        }
    }
    Ok(())
}

fn clean(api: &str) -> Result<()> {
    let status: Status = http::call(api, "GET", "/v1/status", None)?;
    let mut stopped = 0;
    for n in status.nodes.iter().filter(|n| n.live) {
        let napi = node_api(&n.api_addr);
        let ws: Vec<WorkerStatus> = match http::call(&napi, "GET", "/v1/fleet/workers", None) {
            Ok(v) => v,
            Err(e) => {
                eprintln!("warning: node {}: {e:#}", n.id);
                continue;
            }
        };
        for w in ws {
            if w.state == WorkerState::Running {
                stopped += 1;
            }
            let _ = http::request(
                &napi,
                "DELETE",
                &format!("/v1/fleet/workers/{}", w.id),
                None,
            );
        }
    }
    let mut deleted = Vec::new();
    for v in &status.volumes {
        let fleet = v
            .name
            .strip_prefix(VOLUME_PREFIX)
            .and_then(|r| r.split_once("-w"))
            .is_some_and(|(n, k)| {
                !n.is_empty()
                    && !k.is_empty()
                    && n.bytes().all(|b| b.is_ascii_digit())
                    && k.bytes().all(|b| b.is_ascii_digit())
            });
        if fleet {
            let _: Value = http::call(api, "DELETE", &format!("/v1/volumes/{}", v.name), None)
                .with_context(|| format!("deleting volume {}", v.name))?;
            deleted.push(v.name.clone());
        }
    }
    println!(
        "stopped {stopped} running fleet workers; deleted {} fleet volumes{}",
        deleted.len(),
        if deleted.is_empty() {
            String::new()
        } else {
            format!(": {}", deleted.join(", "))
        }
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_block_divides_the_working_set() {
        assert_eq!(prefill_bs(64 << 20), 1 << 20);
        assert_eq!(prefill_bs(12 << 10), 4 << 10);
        assert_eq!(prefill_bs(3 << 19), 512 << 10);
    }

    /// A node API that answers every request with `status` and `body`, once per accepted
    /// connection, `n` times.
    fn fake_node(status: &str, body: &'static str, n: usize) -> String {
        use std::io::{Read, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let status = status.to_string();
        std::thread::spawn(move || {
            for c in l.incoming().take(n) {
                let mut c = c.unwrap();
                let mut buf = Vec::new();
                let mut b = [0u8; 1024];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    let k = c.read(&mut b).unwrap();
                    if k == 0 {
                        break;
                    }
                    buf.extend_from_slice(&b[..k]);
                }
                let _ = write!(
                    c,
                    "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: \
                     {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        format!("http://{addr}")
    }

    fn node_ctx(id: u32, api: String) -> NodeCtx {
        NodeCtx {
            id: NodeId(id),
            api,
            info: FleetNode {
                node: NodeId(id),
                name: format!("node{id}"),
                hostname: "lab".into(),
                host_id: "h1".into(),
                kernel: "6.1".into(),
                cpus: 2,
                converged_version: "0.1.0".into(),
                fio_version: None,
                fio_error: None,
                nbd_socket: String::new(),
                nbd_inflight_max: 128,
                drives: vec![],
            },
            runs_workers: true,
        }
    }

    #[test]
    fn a_failed_flush_names_the_node_and_why() {
        let ok = r#"{"node":1,"caches":1,"dirty_bytes_before":4096,"seconds":0.1}"#;
        let bad = r#"{"error":"cache drive 7: destage failed: I/O error"}"#;
        let nodes = vec![
            node_ctx(1, fake_node("200 OK", ok, 2)),
            node_ctx(2, fake_node("500 Internal Server Error", bad, 1)),
        ];
        let e = flush_all(&nodes, "after p02").unwrap_err().to_string();
        assert!(
            e.contains("flushing the caches of node 2")
                && e.contains("after p02 failed")
                && e.contains("destage failed: I/O error"),
            "{e}"
        );
        let answers = flush_all(&nodes[..1], "before p01").unwrap();
        assert_eq!(answers[0]["dirty_bytes_before"], 4096);
    }

    #[test]
    fn volume_names() {
        assert_eq!(volume_name(NodeId(3), 2), "fleet-n3-w2");
    }

    fn cache(node: u32, drive: u64, mode: CacheMode, bound: usize) -> CacheInfo {
        CacheInfo {
            node: NodeId(node),
            drive: converge_types::DriveId(drive),
            path: format!("/lab/node{node}/cache1.img"),
            media: converge_types::MediaType::Ram,
            mode,
            bound: (0..bound as u64)
                .map(|i| converge_types::DriveId(1000 + i))
                .collect(),
            log_bytes: 250 << 20,
            used_bytes: 0,
            dirty_bytes: 0,
            clean_bytes: 0,
            destage_bytes_per_s: 0.0,
            read_hit_ratio: None,
            failed: None,
        }
    }

    #[test]
    fn cache_mode_refused_without_cache_drives() {
        let none = converge_api::Settings::default();
        let e = check_cache_mode(Some(CacheMode::Write), &[], &none)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--cache-mode needs cache drives (converge lab up --cache-drives N)"),
            "{e}"
        );
        // Without the flag a cluster without caches runs as before.
        check_cache_mode(None, &[], &none).unwrap();
        check_cache_mode(
            Some(CacheMode::None),
            &[cache(1, 1, CacheMode::Write, 1)],
            &none,
        )
        .unwrap();
    }

    #[test]
    fn cache_mode_refused_when_a_node_overrides_it() {
        let s = converge_api::Settings {
            node_cache_modes: [(NodeId(2), CacheMode::ReadWrite)].into_iter().collect(),
            ..Default::default()
        };
        let e = check_cache_mode(
            Some(CacheMode::Write),
            &[cache(2, 1, CacheMode::ReadWrite, 1)],
            &s,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("node 2 (read-write)") && e.contains("cache mode auto --node N"),
            "{e}"
        );
    }

    #[test]
    fn cache_flag_parses_modes_only() {
        assert_eq!(parse_cache_mode("read-write"), Ok(CacheMode::ReadWrite));
        assert!(
            parse_cache_mode("auto").is_err(),
            "a run needs a definite mode"
        );
    }

    #[test]
    fn report_states_the_cache_tier() {
        assert_eq!(describe_caches(&[], &[]), "none (no cache drives)");
        let four: Vec<CacheInfo> = (1..=4)
            .map(|n| cache(n, n as u64, CacheMode::Write, 1))
            .collect();
        let sized: Vec<DriveConfig> = four
            .iter()
            .map(|c| DriveConfig {
                id: c.drive,
                node: c.node.0,
                path: c.path.clone(),
                role: converge_types::DriveRole::Cache,
                media: c.media,
                size_bytes: 256 << 20,
                rating: None,
            })
            .collect();
        assert_eq!(
            describe_caches(&four, &sized),
            "write (4 cache drives, 256 MiB each, bound 1:1)"
        );
        // Without the drives' sizes: their logs'.
        assert_eq!(
            describe_caches(&four[..1], &[]),
            "write (1 cache drive, 250 MiB each, bound 1:1)"
        );
        let mut mixed = four.clone();
        mixed[1].mode = CacheMode::ReadWrite;
        mixed[1].bound.push(converge_types::DriveId(7));
        mixed[3].failed = Some("gone".into());
        assert_eq!(
            describe_caches(&mixed, &[]),
            "mixed: read-write on node 2; write on nodes 1, 3, 4 (4 cache drives, 250 MiB \
             each, bound 1:1 to 1:2, 1 failed)"
        );
    }
}
