//! converge-sim: a deterministic simulation of a converge cluster's replicated data path
//! (DESIGN.md "Testing"). Real engine `Drive`s on fault-injecting `FaultyFile`s, the real
//! owner logic (`converge_volume::Volume`) over a simulated network and control plane,
//! clients with a checked history, and a nemesis that crashes nodes and owners, partitions,
//! drops and delays messages and rots bits. One seed replays a whole run.
//!
//! Volumes are mirrors, and with [`Options::parity`] one is a parity volume (parity-K+M):
//! the checkers then judge its slabs row by row (`rows.rs`: versions K chunks hold intact,
//! parity verified, rows decoded from K chunks checked against the history) instead of copy
//! by copy, and the fault budget leaves K of its K+M chunks healthy.
//!
//! [`simulate`] must run on a current-thread tokio runtime with paused time (the tests
//! build one): time is then virtual and every interleaving follows from the seed.
//! docs/SIMULATION.md describes the fault model and the invariants.

// Tests may unwrap: a panic there is the failure report.
#![cfg_attr(test, allow(clippy::unwrap_used))]

mod cache;
mod clones;
pub mod content;
mod control;
mod faults;
pub mod history;
mod owner;
mod replicas;
mod rows;
mod workload;
mod world;

pub use control::SimKv;
pub use faults::FaultWeights;
pub use owner::SimVolume;
pub use replicas::SimReplicas;

use converge_types::{Compression, NodeId, Resiliency, VolumeId, BLOCK_SIZE};
use converge_volume::resync::Throttle;
use history::Outcome;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use world::{lock, World};

/// One simulated volume.
#[derive(Clone, Debug)]
pub struct VolumeSpec {
    pub resiliency: Resiliency,
    pub min_replicas: usize,
    pub slabs: u64,
    /// Mirror-accelerated parity (docs/adr/0009): extents of a mirror part (0: none).
    pub mirror_part_extents: u64,
    /// How the copies compress the volume's data (docs/adr/0010; variant `compress`).
    pub compression: Compression,
    /// A clone of this volume's snapshots (variant `snapshot`): made mid-run.
    pub clone_of: Option<usize>,
}

/// Everything a run depends on besides the seed (and [`Options::for_seed`] derives these
/// from the seed too).
#[derive(Clone, Debug)]
pub struct Options {
    pub seed: u64,
    /// Print every step of the run to stderr.
    pub verbose: bool,
    pub nodes: usize,
    pub max_drives_per_node: usize,
    pub drive_bytes: u64,
    pub journal_bytes: u64,
    /// Slab size in 4 KiB blocks (small: copies of a slab collide a lot).
    pub slab_blocks: u64,
    pub volumes: Vec<VolumeSpec>,
    pub clients_per_volume: usize,
    /// Largest client I/O, in blocks.
    pub io_blocks_max: u64,
    /// Client think time between requests, up to this many microseconds.
    pub think_us: u64,
    /// How long faults are injected (virtual time); then the cluster heals.
    pub fault_phase: Duration,
    pub fault_interval_ms: (u64, u64),
    pub faults: FaultWeights,
    /// Copies of every slab that faults must leave healthy (in sync, on a node that is up,
    /// reachable and not just hit, free of rot). 1: up to copies - 1 copies of a slab may
    /// be impaired at once.
    pub healthy_copies_min: usize,
    pub rpc_timeout: Duration,
    /// How long after its owner dies a volume is taken over.
    pub lease_ttl: Duration,
    pub downtime_ms: (u64, u64),
    pub partition_ms: (u64, u64),
    /// How long a deposed owner keeps serving its attached clients.
    pub zombie_life_ms: (u64, u64),
    pub repair_period_ms: (u64, u64),
    /// How long a node must be down before the repair policy rebuilds its copies elsewhere
    /// (`repair_delay_s` in the daemon).
    pub repair_delay: Duration,
    /// The owners' data locality (`placement_locality_pct`): 0 places by balance alone.
    pub locality_pct: u64,
    /// How many capacity drives the nemesis may fail in a run (`FaultWeights::drive_failure`).
    pub drive_failures_max: u64,
    /// Scrub (with repair) every this many repair rounds.
    pub scrub_every_rounds: u64,
    pub degraded_write_wait: Duration,
    /// How long a read keeps trying the copies (`VolumeConfig::read_wait`).
    pub read_wait: Duration,
    /// When a read also asks the next copy (`VolumeConfig::read_hedge`).
    pub read_hedge: Duration,
    /// Allow partitions of an owner's node (or of a node running a takeover) shorter than
    /// its lease: the owner keeps its term but cannot reach etcd or its peers for a while.
    /// A variant with its own sweep (`short_owner_partitions`), not the default, because
    /// it relaxes two checks: in-sync copies may then legitimately differ on an unacked
    /// write whose failed copies could not be marked stale (scrub mismatches are counted,
    /// and the copies are not compared right after healing, only after the final scrub).
    pub short_owner_partitions: bool,
    /// Fail the run when a deposed owner acks a zero of a slab it never allocated (known
    /// issue 3: acked from its own slab map with no replica I/O). Off: counted, and the zero
    /// is recorded as failed (it changed nothing).
    pub check_unallocated_zero_fencing: bool,
    /// Allow rot on a block whose version no other in-sync copy holds (the only copy of an
    /// unacked write's block). Off by default: a takeover then fails forever (known issue 4).
    pub rot_sole_newest: bool,
    /// Give every node a cache drive (`converge_engine::Cache`) bound to its capacity
    /// drives: every request goes through a `Tier`, the cache's destage runs as random
    /// steps, modes switch at run time, and power losses also hit the cache drive, inside
    /// destage steps and during the boot's log replay. Off by default (variant `cache`).
    pub cache: bool,
    pub cache_bytes: u64,
    /// A cache destage step (or mode switch, or power loss inside a step) on a random node
    /// every this many ms.
    pub cache_work_ms: (u64, u64),
    /// Chance that a cache work item switches the node's cache mode instead.
    pub cache_mode_switch_p: f64,
    /// Chance that a cache work item arms a power loss inside the destage step.
    pub cache_destage_crash_p: f64,
    /// Chance that a reboot of a node with a cache loses power again during recovery
    /// (drive recovery or the cache log's replay and destage).
    pub cache_boot_crash_p: f64,
    /// Drain one node for removal at a random moment of the fault phase (`converge node
    /// remove`): its copies move elsewhere, copy before drop, under the same faults; after
    /// healing it must hold none. Off by default (variant `drain`).
    pub drain: bool,
    /// The second volume is `parity_volume` instead (variant `parity`): its slabs are K+M
    /// chunks, written in whole rows with held priors, and the checkers judge them row by
    /// row (decoded from K chunks, parity verified) instead of copy by copy.
    pub parity: bool,
    /// With `parity`: the parity volume has a mirror part of half its extents (mirror-
    /// accelerated parity, docs/adr/0009); the repair loop also runs the owner's rotation
    /// job, so spans move from the mirror part into parity under every fault.
    pub mirror_part: bool,
    /// Mirror volumes compress their data (variant `compress`, docs/adr/0010): lz4 for
    /// the first, zstd for the second; clients' blocks compress (a repeated pattern), so
    /// writes, resyncs, rebuilds, scrubs and destages go through compressed groups and
    /// their read-modify-writes under every fault.
    pub compress: bool,
    /// Owners take, read, and delete snapshots of the mirror volumes among the faults
    /// (variant `snapshot`, docs/adr/0012): every snapshot read is checked against the
    /// history as a read over the window the snapshot was taken in, and after healing every
    /// snapshot left is read whole.
    pub snapshots: bool,
    /// The parity volume of variant `parity`: parity-2+1, 2+2 or 3+1, drawn from the seed
    /// (every shape fits the 4–5 nodes; with K+M = nodes a lost chunk has nowhere else to
    /// go and waits for its node).
    pub parity_volume: VolumeSpec,
}

impl Options {
    /// The knobs of a run, randomised from its seed (so many seeds cover many shapes).
    pub fn for_seed(seed: u64) -> Options {
        let mut r = StdRng::seed_from_u64(seed ^ 0x5eed_0fc0_4e46_6500);
        let nodes = r.gen_range(4..=5);
        let mut volumes = vec![VolumeSpec {
            resiliency: Resiliency::Mirror3,
            min_replicas: 2,
            slabs: r.gen_range(3..=5),
            mirror_part_extents: 0,
            compression: Compression::None,
            clone_of: None,
        }];
        volumes.push(if r.gen_bool(0.5) {
            VolumeSpec {
                resiliency: Resiliency::Mirror2,
                min_replicas: 1,
                slabs: r.gen_range(2..=4),
                mirror_part_extents: 0,
                compression: Compression::None,
                clone_of: None,
            }
        } else {
            VolumeSpec {
                resiliency: Resiliency::Mirror3,
                min_replicas: 2,
                slabs: r.gen_range(2..=4),
                mirror_part_extents: 0,
                compression: Compression::None,
                clone_of: None,
            }
        });
        let second_slabs = volumes[1].slabs;
        Options {
            seed,
            verbose: false,
            nodes,
            max_drives_per_node: 2,
            drive_bytes: 2 << 20,
            journal_bytes: 64 << 10,
            slab_blocks: [8, 16, 32][r.gen_range(0..3)],
            volumes,
            clients_per_volume: r.gen_range(2..=4),
            io_blocks_max: r.gen_range(2..=8),
            think_us: r.gen_range(200..=3000),
            fault_phase: Duration::from_millis(r.gen_range(1500..=3000)),
            fault_interval_ms: (20, r.gen_range(80..=250)),
            faults: FaultWeights::default(),
            healthy_copies_min: 1,
            rpc_timeout: Duration::from_millis(100),
            lease_ttl: Duration::from_millis(r.gen_range(50..=200)),
            downtime_ms: (50, r.gen_range(100..=600)),
            partition_ms: (30, r.gen_range(100..=500)),
            zombie_life_ms: (50, 400),
            repair_period_ms: (20, 100),
            scrub_every_rounds: r.gen_range(5..=20),
            degraded_write_wait: Duration::from_millis([0, 50, 200][r.gen_range(0..3)]),
            short_owner_partitions: false,
            check_unallocated_zero_fencing: false,
            rot_sole_newest: false,
            cache: false,
            cache_bytes: converge_engine::CACHE_MIN_BYTES,
            cache_work_ms: (2, 40),
            cache_mode_switch_p: 0.1,
            cache_destage_crash_p: 0.05,
            cache_boot_crash_p: 0.25,
            // Drawn last, so the draws above (and the runs of earlier seeds) stay as they were.
            read_wait: Duration::from_millis([0, 50, 200][r.gen_range(0..3)]),
            read_hedge: Duration::from_millis([2, 10, 50][r.gen_range(0..3)]),
            repair_delay: Duration::from_millis([100, 300, 1000, 60_000][r.gen_range(0..4)]),
            locality_pct: [0, 10, 25, 100][r.gen_range(0..4)],
            drive_failures_max: 1,
            drain: false,
            parity: false,
            mirror_part: false,
            compress: false,
            snapshots: false,
            // Drawn last, so the draws above (and the runs of earlier seeds) stay as they were.
            parity_volume: parity_volume(&mut r, second_slabs),
        }
    }

    /// The volumes the run has: `volumes`, with the second one replaced by
    /// `parity_volume` in variant `parity`.
    pub fn effective_volumes(&self) -> Vec<VolumeSpec> {
        let mut v = self.volumes.clone();
        if self.compress {
            for (i, spec) in v.iter_mut().enumerate() {
                spec.compression = [Compression::Lz4, Compression::Zstd][i % 2];
            }
        }
        if self.parity {
            let mut p = self.parity_volume.clone();
            if self.mirror_part {
                p.mirror_part_extents = p.slabs * p.resiliency.needed() as u64 / 2;
            }
            match v.get_mut(1) {
                Some(second) => *second = p,
                None => v.push(p),
            }
        }
        if self.snapshots && !v.is_empty() {
            // A clone of the first volume, as large, mirror-2 or mirror-3.
            let (resiliency, min_replicas) = if self.seed.is_multiple_of(2) {
                (Resiliency::Mirror2, 1)
            } else {
                (Resiliency::Mirror3, 2)
            };
            v.push(VolumeSpec {
                resiliency,
                min_replicas,
                slabs: v[0].slabs,
                mirror_part_extents: 0,
                compression: Compression::None,
                clone_of: Some(0),
            });
        }
        v
    }
}

/// A parity volume's shape for a seed: 2+1 (min_replicas 2) half the time, else 2+2
/// (min_replicas 2 or 3) or 3+1 (min_replicas 3). `min_replicas` ≥ K: a row acked on fewer
/// than K chunks could not be read back.
fn parity_volume(r: &mut StdRng, slabs: u64) -> VolumeSpec {
    let (k, m, min_replicas) = match r.gen_range(0..6) {
        0..=2 => (2, 1, 2),
        3 => (2, 2, 2),
        4 => (2, 2, 3),
        _ => (3, 1, 3),
    };
    VolumeSpec {
        resiliency: Resiliency::parity(k, m).expect("a supported parity shape"),
        min_replicas,
        slabs,
        mirror_part_extents: 0,
        compression: Compression::None,
        clone_of: None,
    }
}

/// What a passing run did.
#[derive(Clone, Debug)]
pub struct Report {
    pub seed: u64,
    /// Digest of every step: equal digests mean identical runs.
    pub digest: u64,
    pub steps: u64,
    pub virtual_time: Duration,
    pub writes: u64,
    pub acked: u64,
    pub reads_checked: u64,
    pub blocks_checked: u64,
    pub counters: BTreeMap<&'static str, u64>,
}

/// A run that broke an invariant (or did not finish).
#[derive(Clone, Debug)]
pub struct Failure {
    pub seed: u64,
    pub violations: Vec<String>,
    /// The last steps before the end of the run.
    pub recent: Vec<String>,
    pub digest: u64,
    /// `CONVERGE_SIM_VARIANT=...` for the replay command, if the run used one.
    pub variant: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "simulation seed {} FAILED:", self.seed)?;
        for v in &self.violations {
            writeln!(f, "  - {v}")?;
        }
        writeln!(f, "last steps:")?;
        for l in &self.recent {
            writeln!(f, "  {l}")?;
        }
        write!(
            f,
            "replay: {}CONVERGE_SIM_SEED={} cargo nextest run --release -p converge-sim replay --no-capture",
            self.variant, self.seed
        )
    }
}

/// The writes of one block, for failure reports.
pub(crate) fn describe_block(w: &World, v: usize, block: u64) -> String {
    let hist = lock(&w.hist);
    let lines: Vec<String> = hist
        .block_writes(v, block)
        .iter()
        .map(|r| format!("      {r}"))
        .collect();
    let mut out = format!("    writes of vol{v} block {block}:\n{}", lines.join("\n"));
    if let Some(base) = hist.base(v) {
        let lines: Vec<String> = hist
            .block_writes(base.volume, block)
            .iter()
            .map(|r| format!("      {r}"))
            .collect();
        out.push_str(&format!(
            "\n    a clone of vol{}'s snapshot taken over ticks {}..{}; its writes of block {block}:\n{}",
            base.volume,
            base.start,
            base.end,
            lines.join("\n")
        ));
    }
    out
}

/// The replay environment for the non-default options a run used.
fn variant_env(o: &Options) -> String {
    let mut v = Vec::new();
    if o.short_owner_partitions {
        v.push("short-owner-partitions");
    }
    if o.compress {
        v.push("compress");
    }
    if o.check_unallocated_zero_fencing {
        v.push("unallocated-zero-fencing");
    }
    if o.rot_sole_newest {
        v.push("rot-sole-newest");
    }
    if o.cache {
        v.push("cache");
    }
    if o.drain {
        v.push("drain");
    }
    if o.parity && o.mirror_part {
        v.push("mirror-part");
    } else if o.parity {
        v.push("parity");
    }
    if o.compress {
        v.push("compress");
    }
    if o.snapshots {
        v.push("snapshot");
    }
    if v.is_empty() {
        String::new()
    } else {
        format!("CONVERGE_SIM_VARIANT={} ", v.join(","))
    }
}

/// Runs one simulation. Call it on a current-thread runtime with paused time.
pub async fn simulate(mut opts: Options) -> Result<Report, Failure> {
    opts.volumes = opts.effective_volumes();
    if opts.snapshots {
        // Snapshots keep overwritten blocks: room for them beside the volumes.
        opts.drive_bytes = opts.drive_bytes.max(6 << 20);
    }
    let world = match World::new(opts.clone()) {
        Ok(w) => w,
        Err(e) => {
            return Err(Failure {
                seed: opts.seed,
                violations: vec![e],
                recent: Vec::new(),
                digest: 0,
                variant: variant_env(&opts),
            })
        }
    };
    let w = world.clone();
    // Nothing in a correct run takes anywhere near this long in virtual time.
    let limit = opts.fault_phase + Duration::from_secs(600);
    match tokio::time::timeout(limit, run(w.clone())).await {
        Ok(()) => {}
        Err(_) => {
            let stuck: Vec<String> = lock(&w.vols)
                .iter()
                .filter_map(|r| {
                    r.last_takeover_error
                        .as_ref()
                        .map(|e| format!("{}: takeovers keep failing: {e}", r.name))
                })
                .collect();
            w.fail(format!(
                "the run did not finish within {limit:?} of virtual time (liveness){}{}",
                if stuck.is_empty() { "" } else { "; " },
                stuck.join("; ")
            ))
        }
    }
    w.stopping.store(true, Ordering::Relaxed);
    w.teardown();
    let (steps, digest, recent) = w.trace_summary();
    let failures = w.failures();
    if !failures.is_empty() {
        return Err(Failure {
            seed: opts.seed,
            violations: failures,
            recent,
            digest,
            variant: variant_env(&opts),
        });
    }
    let mut counters = lock(&w.stats).clone();
    let hist = lock(&w.hist);
    if hist.blocks_from_parents > 0 {
        counters.insert(
            "clone blocks read as their parent's",
            hist.blocks_from_parents,
        );
    }
    Ok(Report {
        seed: opts.seed,
        digest,
        steps,
        virtual_time: w.elapsed(),
        writes: hist.writes().len() as u64,
        acked: hist
            .writes()
            .iter()
            .filter(|r| r.outcome == Outcome::Acked)
            .count() as u64,
        reads_checked: hist.reads_checked,
        blocks_checked: hist.blocks_checked,
        counters,
    })
}

async fn run(w: Arc<World>) {
    let o = &w.opts;
    w.trace(|| {
        format!(
            "seed {}: {} nodes, slab {} blocks, volumes {:?}, {} clients each, faults for {:?}",
            o.seed, o.nodes, o.slab_blocks, o.volumes, o.clients_per_volume, o.fault_phase
        )
    });
    for (v, spec) in o.volumes.iter().enumerate() {
        lock(&w.vols).push(owner::VolRt {
            spec: spec.clone(),
            id: VolumeId(100 + v as u64),
            name: format!("vm{v:02}"),
            current: None,
            zombies: Vec::new(),
            pending: None,
            takeover_running: false,
            last_takeover_error: None,
            pins: vec![None; o.clients_per_volume],
            snaps: Vec::new(),
            dormant: spec.clone_of.is_some(),
            clone: None,
            snaps_refused: Vec::new(),
        });
        if spec.clone_of.is_some() {
            // Made from a snapshot mid-run (`clones::cloner`).
            continue;
        }
        if o.snapshots {
            // The snapshot transactions read and write the volume's record.
            let rec = converge_control::VolumeRecord {
                id: VolumeId(100 + v as u64),
                name: format!("vm{v:02}"),
                size_bytes: owner::volume_blocks(&w, spec) * converge_types::BLOCK_SIZE as u64,
                resiliency: spec.resiliency,
                mirror_part_bytes: 0,
                min_replicas: spec.min_replicas,
                slab_size_bytes: o.slab_blocks * converge_types::BLOCK_SIZE as u64,
                owner: NodeId(1),
                created_unix: 0,
                compression: spec.compression,
                encryption: None,
                qos: Default::default(),
                snapshots: Vec::new(),
                parent: None,
                stray_floors: Vec::new(),
            };
            lock(&w.ctl).put_volume(&rec);
        }
        owner::first_owner(&w, v);
    }
    let mut clients = Vec::new();
    for v in 0..o.volumes.len() {
        for c in 0..o.clients_per_volume {
            clients.push(tokio::spawn(workload::client(w.clone(), v, c)));
        }
    }
    let repairer = tokio::spawn(workload::repairer(w.clone()));
    let snapshotters: Vec<_> = (0..o.volumes.len())
        .filter(|&v| o.snapshots && o.volumes[v].clone_of.is_none())
        .map(|v| tokio::spawn(workload::snapshotter(w.clone(), v)))
        .collect();
    let cloners: Vec<_> = (0..o.volumes.len())
        .filter(|&v| o.volumes[v].clone_of.is_some())
        .map(|v| tokio::spawn(clones::cloner(w.clone(), v)))
        .collect();
    let cache_worker = o.cache.then(|| tokio::spawn(cache::worker(w.clone())));
    let until = Instant::now() + o.fault_phase;
    if o.drain {
        let at = w.ms(0, o.fault_phase.as_millis() as u64 / 2);
        tokio::spawn(faults::drain_one(w.clone(), at));
    }
    if w.targeted_loss() {
        tokio::spawn(faults::targeted_loss(w.clone(), until));
    }
    faults::nemesis(w.clone(), until).await;

    // ---- heal ----------------------------------------------------------------------------
    w.trace(|| "=== faults stop; clients finish; the cluster heals ===".to_string());
    w.stopping.store(true, Ordering::Relaxed);
    for c in clients {
        let _ = c.await;
    }
    let _ = repairer.await;
    for s in snapshotters.into_iter().chain(cloners) {
        let _ = s.await;
    }
    if let Some(c) = cache_worker {
        let _ = c.await;
    }
    heal(&w).await;
    if w.has_failed() {
        return;
    }
    final_checks(&w).await;
}

/// Every volume has an owner serving it (a clone not created yet has none).
fn all_served(w: &World) -> bool {
    lock(&w.vols)
        .iter()
        .all(|r| r.dormant || r.current.is_some())
}

/// Every fault ends: zombies stop, armed power losses fire, partitions and flaky links
/// heal, nodes restart, every volume gets an owner, and stale copies are resynced until
/// none is left.
async fn heal(w: &Arc<World>) {
    let zombies: Vec<(usize, Arc<owner::Owner>)> = lock(&w.vols)
        .iter()
        .enumerate()
        .flat_map(|(v, r)| r.zombies.iter().map(move |z| (v, z.clone())))
        .collect();
    for (v, z) in zombies {
        owner::kill_zombie(w, v, &z);
    }
    let armed: Vec<_> = lock(&w.nodes)
        .iter()
        .filter(|n| n.armed)
        .map(|n| n.id)
        .collect();
    for n in armed {
        w.crash_node(n, "armed power loss fired at the end of the fault phase");
    }
    // A failed drive ends as an operator would end it: its node reboots and the drive
    // opens again (its copies are rebuilt elsewhere or resynced; the cluster may lack the
    // room to rebuild them, which the run cannot judge), or, lost for good, a blank one
    // takes its place.
    let failed: BTreeSet<NodeId> = lock(&w.failed_drives)
        .iter()
        .filter(|(d, n)| w.holds_drive(**n, **d))
        .map(|(_, n)| *n)
        .collect();
    for n in failed {
        if w.is_up(n) {
            w.crash_node(
                n,
                "rebooted at the end of the fault phase to reopen its failed drive",
            );
        }
    }
    {
        let mut net = lock(&w.net);
        net.flaky_until = None;
        net.slow.clear();
    }
    for n in w.node_ids() {
        w.heal_partition(n);
        w.restart_node(n);
    }
    // Let messages still in flight land and takeovers finish.
    let nvols = lock(&w.vols).len();
    for v in 0..nvols {
        let idle = {
            let vols = lock(&w.vols);
            vols[v].current.is_none() && !vols[v].takeover_running && !vols[v].dormant
        };
        if idle {
            owner::start_takeover(w, v, Duration::ZERO);
        }
    }
    loop {
        let ready = all_served(w);
        if ready {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(w.opts.rpc_timeout * 2).await;
    // Orphans left on nodes that stayed up (a replaced copy whose free was lost) are freed
    // as the daemon frees them after its scrubs: rebuilds need their room.
    for n in w.node_ids() {
        w.reclaim_orphans(n);
    }
    let throttle = Arc::new(Throttle::new(u64::MAX));
    for round in 0..50 {
        let owners: Vec<(usize, Arc<owner::Owner>)> = lock(&w.vols)
            .iter()
            .enumerate()
            .filter_map(|(v, r)| r.current.clone().map(|o| (v, o)))
            .collect();
        // The repair policy, as during the run: with every node up, it resyncs stale copies
        // and rebuilds the copies of failed drives elsewhere.
        workload::report_failed_drives(w).await;
        for (v, o) in &owners {
            let mut clock = converge_allocator::repair::DownClock::default();
            workload::repair_volume(w, *v, o, &mut clock, &throttle).await;
        }
        let left = w.not_in_sync();
        let draining = workload::movable_copies_on_draining_nodes(w).await;
        if left.is_empty() && draining.is_empty() {
            w.trace(|| format!("healed after {} resync rounds", round + 1));
            return;
        }
        if round == 49 {
            w.fail(format!(
                "copies still not in sync after the cluster healed: {}; copies left on \
                 draining nodes: {}",
                left.join(", "),
                draining.join(", ")
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn final_checks(w: &Arc<World>) {
    let throttle = Arc::new(Throttle::new(u64::MAX));
    let owners: Vec<(usize, Arc<owner::Owner>)> = lock(&w.vols)
        .iter()
        .enumerate()
        .filter_map(|(v, r)| r.current.clone().map(|o| (v, o)))
        .collect();
    check_copies(w, "after healing", true);
    if !w.opts.short_owner_partitions {
        let vols: Vec<(VolumeId, converge_types::Epoch)> = owners
            .iter()
            .map(|(_, o)| (o.vol.config().id, o.epoch))
            .collect();
        for (id, epoch) in vols {
            check_agree(w, id, epoch);
        }
    }
    for (v, o) in &owners {
        workload::check_snapshots(w, *v, o).await;
    }
    // Rot and torn blocks left over, and in-sync copies that still differ on an unacked
    // write, are repaired by one scrub (the background scrubber's job).
    for (v, o) in &owners {
        workload::scrub(w, *v, o, true, &throttle).await;
    }
    for (v, o) in &owners {
        match workload::scrub(w, *v, o, false, &throttle).await {
            Some(rep) if rep.bad_checksums == rep.snapshot_blocks_lost && rep.mismatches == 0 => {
                // A snapshot's block rotted on every in-sync copy holding it (the final
                // snapshot reads refused it: docs/SNAPSHOTS.md, "Limits").
                if rep.snapshot_blocks_lost > 0 {
                    *lock(&w.stats)
                        .entry("snapshot blocks bad on every copy holding them")
                        .or_insert(0) += rep.snapshot_blocks_lost;
                }
            }
            Some(rep) => w.fail(format!(
                "vol{v}: after repair, scrub still finds {} bad checksums and {} mismatches",
                rep.bad_checksums, rep.mismatches
            )),
            None => w.fail(format!("vol{v}: the final scrub could not run")),
        }
    }
    compare_copies(w, false);
    for (v, o) in &owners {
        read_back(w, *v, o, "after healing").await;
    }
    // One more owner change, then everything must still read back.
    for (v, _) in &owners {
        owner::crash_owner(w, *v);
    }
    loop {
        // Each takeover done, with what it does once it serves (stray floors released).
        let ready = all_served(w)
            && lock(&w.vols).iter().all(|r| !r.takeover_running)
            && w.releases_running.load(std::sync::atomic::Ordering::SeqCst) == 0;
        if ready {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let owners: Vec<(usize, Arc<owner::Owner>)> = lock(&w.vols)
        .iter()
        .enumerate()
        .filter_map(|(v, r)| r.current.clone().map(|o| (v, o)))
        .collect();
    for (v, o) in &owners {
        read_back(w, *v, o, "after a final takeover").await;
    }
    compare_copies(w, false);
    check_no_stray_floors(w);
    if w.opts.cache && !w.has_failed() {
        cache_final_checks(w).await;
    }
}

/// After the final takeovers (each released what snapshots begun and never recorded left):
/// every in-sync copy keeps states only for snapshots its volume's record lists (taken, or
/// being deleted), and the record lists no stray floor. A floor left by a snapshot that
/// was not recorded would keep space for ever (until the volume's next snapshot).
fn check_no_stray_floors(w: &Arc<World>) {
    // A dormant volume has no owner to release them.
    let vols: Vec<(VolumeId, String)> = lock(&w.vols)
        .iter()
        .filter(|r| r.current.is_some())
        .map(|r| (r.id, r.name.clone()))
        .collect();
    for (id, name) in vols {
        let Some(rec) = lock(&w.ctl).volume_record(&name) else {
            continue;
        };
        if !rec.stray_floors.is_empty() {
            w.fail(format!(
                "vol {name}: its record still lists stray snapshot floors {:?} after the final takeover",
                rec.stray_floors
            ));
        }
        let known: Vec<u64> = rec.snapshots.iter().map(|s| s.epoch.0).collect();
        for (slab, extents) in lock(&w.ctl).slabs_of(id) {
            let key = world::slab_key(id, slab.0);
            for e in extents
                .iter()
                .filter(|e| e.state == converge_types::ExtentState::InSync)
            {
                let kept = w.exec(e.node, e.drive, move |t| {
                    let d = t.drive();
                    let mut kept: Vec<u64> = d
                        .shadows(key)
                        .iter()
                        .map(|s| u64::from(s.snapshot))
                        .collect();
                    kept.push(u64::from(d.snapshot_floor(key)));
                    Ok(kept)
                });
                let world::Delivery::Done(Ok(kept)) = kept else {
                    continue;
                };
                if let Some(s) = kept.iter().find(|&&s| s != 0 && !known.contains(&s)) {
                    w.fail(format!(
                        "vol {name} slab {slab}: the copy on node {} drive {} keeps a floor or states for epoch {s}, which is no snapshot of the volume (its snapshots: {known:?})",
                        e.node, e.drive
                    ));
                }
            }
        }
    }
}

/// With caches: the whole cluster loses power at once, with dirty blocks in the logs of
/// about half of the nodes (the others' logs were flushed first). Each node replays its
/// log at boot, so capacity alone must then hold every acked write: after new takeovers
/// and one scrub with repair (rot a read-cached copy hid from the first one), the caches
/// are flushed and the capacity drives, read without their caches, must be identical.
async fn cache_final_checks(w: &Arc<World>) {
    let throttle = Arc::new(Throttle::new(u64::MAX));
    for n in w.node_ids() {
        if w.chance(0.5) {
            w.flush_cache(n);
        }
    }
    for n in w.node_ids() {
        w.crash_node(n, "the whole cluster loses power at the end");
    }
    for n in w.node_ids() {
        w.restart_node(n);
    }
    let nvols = lock(&w.vols).len();
    for v in 0..nvols {
        let idle = {
            let vols = lock(&w.vols);
            vols[v].current.is_none() && !vols[v].takeover_running && !vols[v].dormant
        };
        if idle {
            owner::start_takeover(w, v, Duration::ZERO);
        }
    }
    loop {
        let ready = all_served(w);
        if ready {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let owners: Vec<(usize, Arc<owner::Owner>)> = lock(&w.vols)
        .iter()
        .enumerate()
        .filter_map(|(v, r)| r.current.clone().map(|o| (v, o)))
        .collect();
    for (v, o) in &owners {
        read_back(w, *v, o, "after a whole-cluster power loss").await;
    }
    check_copies(w, "after a whole-cluster power loss", true);
    for (v, o) in &owners {
        workload::scrub(w, *v, o, true, &throttle).await;
    }
    for n in w.node_ids() {
        w.flush_cache(n);
    }
    compare_copies(w, true);
}

/// The run's volumes by id: index, content tag, resiliency.
fn volumes_by_id(w: &World) -> BTreeMap<VolumeId, (usize, u64, Resiliency)> {
    lock(&w.vols)
        .iter()
        .enumerate()
        .map(|(i, r)| (r.id, (i, r.id.0, r.spec.resiliency)))
        .collect()
}

/// A parity volume's (K, M).
/// The parity slabs that are not the truth of their span: a parity slab beside mirror-part
/// records of the same span (a rotation that has not flipped, docs/adr/0009) holds what a
/// copy in progress, or a cut one, left; reads see the mirror part. Not judged.
fn shadowed(
    records: &[(
        (VolumeId, converge_types::SlabIndex),
        Vec<converge_volume::ExtentLoc>,
    )],
    vols: &BTreeMap<VolumeId, (usize, u64, Resiliency)>,
) -> BTreeSet<(VolumeId, converge_types::SlabIndex)> {
    records
        .iter()
        .map(|(k, _)| *k)
        .filter(|(_, s)| s.is_mirror_part())
        .filter_map(|(vol, s)| {
            let k = vols.get(&vol)?.2.needed() as u64;
            Some((vol, converge_types::SlabIndex(s.position() / k)))
        })
        .collect()
}

/// A slab's first volume block, given its blocks per extent: a mirror-part slab's
/// extent-sized piece, else its span's.
fn first_block(res: Resiliency, slab: converge_types::SlabIndex, extent_blocks: u64) -> u64 {
    slab.position() * res.of_slab(slab).slab_span(extent_blocks)
}

fn parity_shape(res: Resiliency) -> Option<(usize, usize)> {
    match res {
        Resiliency::Parity { data, parity } => Some((usize::from(data), usize::from(parity))),
        _ => None,
    }
}

/// The chunks of a parity slab that `pick` selects, each read whole from its drive (through
/// its tier, or from the capacity drive alone); those that cannot be read are passed to
/// `unreadable`.
fn read_chunks(
    w: &Arc<World>,
    key: converge_types::ExtentKey,
    extents: &[converge_volume::ExtentLoc],
    pick: impl Fn(&converge_volume::ExtentLoc) -> bool,
    capacity_only: bool,
    mut unreadable: impl FnMut(&converge_volume::ExtentLoc, String),
) -> Vec<rows::Chunk> {
    let blocks = w.opts.slab_blocks;
    extents
        .iter()
        .enumerate()
        .filter(|(_, e)| pick(e))
        .filter_map(
            |(c, e)| match w.read_copy_from(e.node, e.drive, key, blocks, capacity_only) {
                Ok((data, versions, bad)) => Some(rows::Chunk {
                    c,
                    node: e.node,
                    drive: e.drive,
                    data,
                    versions,
                    bad,
                }),
                Err(err) => {
                    unreadable(e, err);
                    None
                }
            },
        )
        .collect()
}

/// Fails the run for every chunk whose block disagrees with what K chunks at its row's
/// version decode to.
fn fail_mismatches(w: &World, what: &str, judged: &rows::Judged, chunks: &[rows::Chunk]) {
    for mm in &judged.mismatches {
        let node = chunks
            .iter()
            .find(|ch| ch.c == mm.chunk)
            .map_or(NodeId(0), |ch| ch.node);
        w.fail(format!(
            "{what} row {}: chunk {} on node {node} holds version {} but not what chunks {:?} at that version decode to (parity does not verify)",
            mm.row, mm.chunk, mm.version, mm.from
        ));
    }
}

/// Checks blocks of volume `v` (first block, content) against the history as a read at
/// this instant would be checked; fails the run for each bad one.
fn check_now(w: &World, v: usize, tag: u64, blocks: &[(u64, &[u8])], what: &dyn Fn() -> String) {
    let mut bad = Vec::new();
    {
        let mut hist = lock(&w.hist);
        let now = hist.tick();
        for (first, data) in blocks {
            bad.extend(hist.check_read(v, tag, *first, data, now, now, true));
        }
    }
    for (b, why) in bad {
        let writes = describe_block(w, v, b);
        w.fail(format!("{}: {why}\n{writes}", what()));
    }
}

/// Every in-sync copy, read alone straight from its drive, must pass the clients' read
/// check: any of them may serve the next read, so each must hold every acked write (or a
/// later unacked one) and nothing else. Blocks that fail their checksum are skipped (reads
/// never return them; scrub repairs them). Parity slabs: see [`check_chunks`].
pub(crate) fn check_copies(w: &Arc<World>, when: &str, settled: bool) {
    let blocks = w.opts.slab_blocks;
    let records = lock(&w.ctl).all();
    let vols = volumes_by_id(w);
    // The slabs each volume's current owner serves. One whose record was just created is
    // not taken up until its copies are zeroed (`Volume::adopt`), and until then its drives
    // may still hold a released incarnation's blocks (a copy replaced while its node was
    // away and never freed; every chunk of a released parity slab, which is not zeroed
    // before its record goes, and in other places of the row): not judged yet.
    let served: BTreeMap<VolumeId, BTreeSet<converge_types::SlabIndex>> = lock(&w.vols)
        .iter()
        .filter_map(|r| {
            let o = r.current.as_ref()?;
            Some((r.id, o.vol.slab_map().into_keys().collect()))
        })
        .collect();
    let shadowed = shadowed(&records, &vols);
    // Clones still linked to their parent: a block they never wrote is not on their
    // copies (reads take it from the parent), so a copy holds zeros there.
    let linked: BTreeSet<usize> = lock(&w.vols)
        .iter()
        .enumerate()
        .filter(|(_, r)| r.clone.as_ref().is_some_and(|c| !c.flattened))
        .map(|(v, _)| v)
        .collect();
    for ((vol, slab), extents) in records {
        let Some(&(v, tag, res)) = vols.get(&vol) else {
            continue;
        };
        if shadowed.contains(&(vol, slab)) {
            w.count("parity slabs of spans still in the mirror part (not judged)");
            continue;
        }
        let res = res.of_slab(slab);
        let adopting = served.get(&vol).is_some_and(|s| !s.contains(&slab));
        if let Some((k, m)) = parity_shape(res) {
            // With no owner (a takeover running), the next one reconciles the chunks
            // first, and `check_agree` follows it.
            if served.contains_key(&vol) && !adopting {
                check_chunks(w, when, settled, (v, tag), (k, m), (vol, slab), &extents);
            }
            continue;
        }
        for e in extents
            .iter()
            .filter(|e| e.state == converge_types::ExtentState::InSync)
        {
            let key = world::slab_key(vol, slab.0);
            let Ok((mut data, versions, bad)) = w.read_copy(e.node, e.drive, key, blocks) else {
                continue; // down: it cannot serve reads either
            };
            let first = first_block(res, slab, blocks);
            // Bad blocks are never served; make them pass as the block's current content
            // would not be judged at all.
            let mut hist = lock(&w.hist);
            let now = hist.tick();
            let mut skip = vec![false; blocks as usize];
            for b in bad {
                w.count("bad blocks seen on in-sync copies");
                if let Some(s) = skip.get_mut(b as usize) {
                    *s = true;
                }
            }
            if linked.contains(&v) {
                for (i, ver) in versions.iter().enumerate() {
                    if *ver == converge_types::Version(0) {
                        skip[i] = true;
                    }
                }
            }
            for (i, chunk) in data.chunks_mut(BLOCK_SIZE).enumerate() {
                if skip[i] {
                    chunk.fill(0);
                }
            }
            let verdicts = hist.check_read(v, tag, first, &data, now, now, true);
            drop(hist);
            w.count("copy checks");
            for (b, why) in verdicts {
                // (A slab being taken up is read and checked all the same, so the run goes
                // as before, but not judged.)
                if skip[(b - first) as usize] || adopting {
                    continue;
                }
                let writes = describe_block(w, v, b);
                w.fail(format!(
                    "{when}: in-sync copy of vol {vol} slab {slab} on node {} drive {}: {why}\n{writes}",
                    e.node, e.drive
                ));
            }
        }
    }
}

/// Invariant 3 for a parity slab: its in-sync chunks, read straight from their drives,
/// judged row by row. Any K of them may serve the next read of a row (decoded), and a
/// healthy read takes a data chunk's block as it is, so: (a) at every version of a row
/// that K in-sync chunks hold intact, every chunk holding it agrees with what K of them
/// decode to (parity verifies), and the row's data decoded at it passes the clients' read
/// check; (b) every intact block of an in-sync data chunk passes it too; (c) once
/// `settled` (no write in flight, every takeover done), every row has such a version.
/// During the run a row being written may have none for a moment (3+1 with a write that
/// reached 2 chunks): counted.
fn check_chunks(
    w: &Arc<World>,
    when: &str,
    settled: bool,
    (v, tag): (usize, u64),
    (k, m): (usize, usize),
    (vol, slab): (VolumeId, converge_types::SlabIndex),
    extents: &[converge_volume::ExtentLoc],
) {
    let rows = w.opts.slab_blocks as usize;
    let key = world::slab_key(vol, slab.0);
    let in_sync = |e: &converge_volume::ExtentLoc| e.state == converge_types::ExtentState::InSync;
    // A chunk that is down cannot serve reads either.
    let chunks = read_chunks(w, key, extents, in_sync, false, |_, _| {});
    for ch in &chunks {
        for _ in &ch.bad {
            w.count("bad blocks seen on in-sync copies");
        }
        w.count("chunk checks");
    }
    let judged = rows::judge(k, m, rows, &chunks);
    let what = format!("{when}: vol {vol} slab {slab}");
    fail_mismatches(w, &what, &judged, &chunks);
    // The slab's first volume block: K blocks per row.
    let first = slab.0 * (rows * k) as u64;
    let row_first = |r: usize| first + (r * k) as u64;
    let decoded: Vec<(u64, &[u8])> = judged
        .versions
        .iter()
        .map(|rv| (row_first(rv.row), &rv.data[..]))
        .collect();
    check_now(w, v, tag, &decoded, &|| {
        format!("{what}: a row decoded from its in-sync chunks")
    });
    // Data blocks at a version K chunks do not hold (a row being written) are read as they
    // are by a healthy read; the others were just judged decoded.
    for ch in chunks.iter().filter(|ch| ch.c < k) {
        let alone: Vec<(u64, &[u8])> = (0..rows)
            .filter(|&r| ch.intact(r))
            .filter(|&r| {
                !judged
                    .versions
                    .iter()
                    .any(|rv| rv.row == r && rv.holders.contains(&ch.c))
            })
            .map(|r| (row_first(r) + ch.c as u64, ch.block(r)))
            .collect();
        check_now(w, v, tag, &alone, &|| {
            format!(
                "{what}: in-sync data chunk {} on node {} drive {}",
                ch.c, ch.node, ch.drive
            )
        });
    }
    for &r in &judged.undecodable {
        if settled {
            let held: Vec<String> = chunks
                .iter()
                .map(|ch| {
                    format!(
                        "chunk {} node {}: version {}{}",
                        ch.c,
                        ch.node,
                        ch.versions[r],
                        if ch.intact(r) { "" } else { " (bad)" }
                    )
                })
                .collect();
            w.fail(format!(
                "{what} row {r}: no version is held intact by {k} in-sync chunks ({})",
                held.join(", ")
            ));
        } else {
            w.count("parity rows without K chunks at one version (mid-write)");
        }
    }
}

/// Right after a takeover's reconcile (before the new owner serves anything) and once the
/// cluster has healed, the in-sync copies of every slab of `volume` must agree block by
/// block (DESIGN: unacked writes may resolve to old or new, but every copy agrees). Blocks
/// failing their crc are skipped. A parity slab's in-sync chunks must agree on every
/// row's version, and parity must verify at it.
pub(crate) fn check_agree(w: &Arc<World>, volume: VolumeId, epoch: converge_types::Epoch) {
    let blocks = w.opts.slab_blocks;
    let res = volumes_by_id(w).get(&volume).map(|&(_, _, res)| res);
    let slabs = lock(&w.ctl).slabs_of(volume);
    // A rotation's leftover (a parity slab beside its span's mirror-part records) is not
    // the span's truth: a cut rotation may have written some of its chunks (`shadowed`).
    let leftovers: BTreeSet<u64> = match res {
        Some(r) => slabs
            .iter()
            .filter(|(s, _)| s.is_mirror_part())
            .map(|(s, _)| s.position() / r.needed() as u64)
            .collect(),
        None => BTreeSet::new(),
    };
    for (slab, extents) in slabs {
        if !slab.is_mirror_part() && leftovers.contains(&slab.0) {
            continue;
        }
        if let Some((k, m)) = res.and_then(|r| parity_shape(r.of_slab(slab))) {
            let key = world::slab_key(volume, slab.0);
            let in_sync =
                |e: &converge_volume::ExtentLoc| e.state == converge_types::ExtentState::InSync;
            let chunks = read_chunks(w, key, &extents, in_sync, false, |_, _| {});
            for r in 0..blocks as usize {
                let intact: Vec<&rows::Chunk> = chunks.iter().filter(|ch| ch.intact(r)).collect();
                if let Some(c0) = intact.first() {
                    for ch in &intact[1..] {
                        if ch.versions[r] != c0.versions[r] {
                            w.fail(format!(
                                "vol {volume} slab {slab} row {r}: at epoch {epoch}, in-sync chunks {} on node {} (version {}) and {} on node {} (version {}) disagree",
                                c0.c, c0.node, c0.versions[r], ch.c, ch.node, ch.versions[r]
                            ));
                        }
                    }
                }
            }
            let judged = rows::judge(k, m, blocks as usize, &chunks);
            let what = format!("at epoch {epoch}: vol {volume} slab {slab}");
            fail_mismatches(w, &what, &judged, &chunks);
            continue;
        }
        let mut copies = Vec::new();
        for e in extents
            .iter()
            .filter(|e| e.state == converge_types::ExtentState::InSync)
        {
            if let Ok(img) = w.read_copy(e.node, e.drive, world::slab_key(volume, slab.0), blocks) {
                copies.push((e.node, img));
            }
        }
        for b in 0..blocks as usize {
            let good: Vec<(converge_types::NodeId, converge_types::Version, &[u8])> = copies
                .iter()
                .filter(|(_, (_, _, bad))| !bad.contains(&(b as u32)))
                .map(|(n, (data, vers, _))| {
                    (*n, vers[b], &data[b * BLOCK_SIZE..(b + 1) * BLOCK_SIZE])
                })
                .collect();
            if let Some((n0, v0, d0)) = good.first() {
                for (n, v, d) in &good[1..] {
                    if v != v0 || d != d0 {
                        w.fail(format!(
                            "vol {volume} slab {slab} block {b}: at epoch {epoch}, in-sync copies on nodes {n0} (version {v0}, {:?}) and {n} (version {v}, {:?}) disagree",
                            content::decode(d0),
                            content::decode(d)
                        ));
                    }
                }
            }
        }
    }
}

/// Every copy of every slab holds the same bytes and versions, with no bad block. Read
/// through each node's cache tier, or (`capacity_only`) from the capacity drives alone.
/// A parity slab's chunks: readable, no bad block, equal versions, parity verifies at
/// every row, and every row's data, decoded, passes the clients' read check.
fn compare_copies(w: &Arc<World>, capacity_only: bool) {
    let what = if capacity_only {
        "capacity copy"
    } else {
        "copy"
    };
    let blocks = w.opts.slab_blocks;
    let records = lock(&w.ctl).all();
    let vols = volumes_by_id(w);
    let shadowed = shadowed(&records, &vols);
    for ((vol, slab), extents) in records {
        if shadowed.contains(&(vol, slab)) {
            continue;
        }
        if let Some(&(v, tag, res)) = vols.get(&vol) {
            if let Some((k, m)) = parity_shape(res.of_slab(slab)) {
                compare_chunks(w, capacity_only, (v, tag), (k, m), (vol, slab), &extents);
                continue;
            }
        }
        let mut first: Option<(
            converge_types::NodeId,
            Vec<u8>,
            Vec<converge_types::Version>,
        )> = None;
        for e in &extents {
            let key = world::slab_key(vol, slab.0);
            match w.read_copy_from(e.node, e.drive, key, blocks, capacity_only) {
                Err(err) => w.fail(format!("vol {vol} slab {slab}: {what} unreadable: {err}")),
                Ok((data, versions, bad)) => {
                    if !bad.is_empty() {
                        w.fail(format!(
                            "vol {vol} slab {slab}: {what} on node {} has bad blocks {bad:?} after healing",
                            e.node
                        ));
                    }
                    match &first {
                        None => first = Some((e.node, data, versions)),
                        Some((n0, d0, v0)) => {
                            if *v0 != versions {
                                w.fail(format!(
                                    "vol {vol} slab {slab}: versions differ between {what}s on nodes {n0} and {}: {:?} vs {:?}",
                                    e.node, v0, versions
                                ));
                            } else if *d0 != data {
                                let b = d0
                                    .chunks(BLOCK_SIZE)
                                    .zip(data.chunks(BLOCK_SIZE))
                                    .position(|(a, b)| a != b)
                                    .unwrap_or(0);
                                w.fail(format!(
                                    "vol {vol} slab {slab}: data differs between {what}s on nodes {n0} and {} (first at block {b}) with equal versions",
                                    e.node
                                ));
                            }
                        }
                    }
                }
            }
        }
    }
}

/// [`compare_copies`] for a parity slab.
fn compare_chunks(
    w: &Arc<World>,
    capacity_only: bool,
    (v, tag): (usize, u64),
    (k, m): (usize, usize),
    (vol, slab): (VolumeId, converge_types::SlabIndex),
    extents: &[converge_volume::ExtentLoc],
) {
    let what = if capacity_only {
        "capacity chunk"
    } else {
        "chunk"
    };
    let rows = w.opts.slab_blocks as usize;
    let key = world::slab_key(vol, slab.0);
    let chunks = read_chunks(
        w,
        key,
        extents,
        |_| true,
        capacity_only,
        |e, err| {
            w.fail(format!(
                "vol {vol} slab {slab}: {what} on node {} unreadable: {err}",
                e.node
            ))
        },
    );
    for ch in &chunks {
        if !ch.bad.is_empty() {
            w.fail(format!(
                "vol {vol} slab {slab}: {what} {} on node {} has bad blocks {:?} after healing",
                ch.c, ch.node, ch.bad
            ));
        }
        if ch.versions != chunks[0].versions {
            w.fail(format!(
                "vol {vol} slab {slab}: versions differ between {what}s {} on node {} and {} on node {}: {:?} vs {:?}",
                chunks[0].c, chunks[0].node, ch.c, ch.node, chunks[0].versions, ch.versions
            ));
        }
    }
    if chunks.len() < extents.len() {
        return;
    }
    let judged = rows::judge(k, m, rows, &chunks);
    let place = format!("vol {vol} slab {slab} ({what}s)");
    fail_mismatches(w, &place, &judged, &chunks);
    for &r in &judged.undecodable {
        w.fail(format!(
            "{place} row {r}: no version is held intact by {k} chunks"
        ));
    }
    let first = slab.0 * (rows * k) as u64;
    let decoded: Vec<(u64, &[u8])> = judged
        .versions
        .iter()
        .map(|rv| (first + (rv.row * k) as u64, &rv.data[..]))
        .collect();
    check_now(w, v, tag, &decoded, &|| format!("{place}: a row decoded"));
}

/// Reads the whole volume through `o` and checks every block against the history.
async fn read_back(w: &Arc<World>, v: usize, o: &Arc<owner::Owner>, when: &str) {
    let (blocks, tag) = {
        let vols = lock(&w.vols);
        (owner::volume_blocks(w, &vols[v].spec), vols[v].id.0)
    };
    let issue = lock(&w.hist).tick();
    let vol = o.vol.clone();
    let len = blocks * BLOCK_SIZE as u64;
    let r = match o.spawn(async move { vol.read(0, len).await }) {
        Some(h) => h.await.ok(),
        None => None,
    };
    let end = lock(&w.hist).tick();
    match r {
        Some(Ok(data)) => {
            let bad = lock(&w.hist).check_read(v, tag, 0, &data, issue, end, true);
            w.trace(|| {
                format!(
                    "vol{v}: read back {blocks} blocks {when}: {} bad",
                    bad.len()
                )
            });
            for (b, why) in bad {
                let writes = describe_block(w, v, b);
                w.fail(format!("read back {when}: {why}\n{writes}"));
            }
        }
        Some(Err(e)) => {
            // A clone reads what it never wrote from its parent snapshot: one the parent's
            // own final check found refused (the limit) refuses the clone's read too.
            let parent_refused = {
                let vols = lock(&w.vols);
                vols[v].clone.as_ref().is_some_and(|c| {
                    !c.flattened && vols[c.parent].snaps_refused.contains(&c.snap.name)
                })
            };
            if parent_refused {
                w.count("clone read backs refused (its parent snapshot is refused)");
                w.trace(|| format!("vol{v}: read back {when} refused: {e}"));
            } else {
                w.fail(format!("vol{v}: read back {when} failed: {e}"))
            }
        }
        None => w.fail(format!("vol{v}: read back {when} did not complete")),
    }
}
