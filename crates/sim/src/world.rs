//! The simulated cluster's physical state: nodes with their engine drives on
//! fault-injecting files, power loss and restart, bit rot, the network's mood (flaky, slow,
//! partitioned nodes), and the fault budget that keeps the run inside the fault model.
//!
//! Everything lives behind std mutexes in one `World` shared by every task. The runtime is
//! single-threaded, so the locks only satisfy `Send + Sync`; a lock is never held across
//! an `.await`, and never two at once except in the order nodes → ctl.

use crate::control::{Ctl, SimKv};
use crate::history::History;
use crate::owner::VolRt;
use crate::Options;
use converge_allocator::admission::{Admission, Caller, Refusal};
use converge_control::model::Cluster;
use converge_control::placement::DriveLoad;
use converge_engine::{
    BlockFile, Cache, Drive, DriveIdentity, EngineError, FaultyFile, FormatOptions, OpenReport,
    Tier,
};
use converge_types::{
    CacheMode, ClusterId, DriveId, DriveRole, Epoch, ExtentKey, ExtentOp, ExtentReply, ExtentState,
    MediaType, NodeId, Resiliency, SlabIndex, Version, VolumeId, BLOCK_SIZE,
};
use converge_volume::ExtentLoc;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::time::Instant;

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic inside the simulation is itself the failure being reported; keep going with
    // whatever state there is rather than cascading poison panics.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) struct SimDrive {
    pub id: DriveId,
    /// Handle on the drive's bytes that outlives crashes (for `rot` and `reattach`).
    pub image: FaultyFile,
    /// The handle the open `Drive` uses; dead after a crash.
    pub live: FaultyFile,
    /// Extents it can hold (as its drive record says).
    pub extents_total: u64,
    /// The drive as the node serves it: through its node's cache drive if the run has one,
    /// else straight to the drive. None while the node is down (or if the drive failed to
    /// reopen).
    pub tier: Option<Arc<Tier>>,
}

/// A node's cache drive (`Options::cache`), bound to every capacity drive of the node.
pub(crate) struct SimCache {
    pub id: DriveId,
    /// Handle on the cache drive's bytes that outlives crashes.
    pub image: FaultyFile,
    /// The handle the open `Cache` uses; dead after a crash.
    pub live: FaultyFile,
    /// None while the node is down (or if the cache failed to open).
    pub cache: Option<Arc<Cache>>,
    /// The mode in effect (the node's setting: it survives restarts).
    pub mode: CacheMode,
}

pub(crate) struct Node {
    pub id: NodeId,
    pub up: bool,
    /// Bumped at every crash and restart: a reply computed by an earlier incarnation is
    /// never delivered.
    pub incarnation: u64,
    pub drives: Vec<SimDrive>,
    /// Cut off from every other node and from the control plane until then.
    pub isolated_until: Option<Instant>,
    /// A power loss is armed on one of its drives (fires inside an engine write).
    pub armed: bool,
    /// Its cache drive, if the run has caches.
    pub cache: Option<SimCache>,
    /// Its replica service's checks with the control plane (the daemon's own code), with
    /// the epochs it confirmed: forgotten at a crash, as the daemon's are.
    pub admission: Arc<Admission>,
}

/// The network's current mood.
#[derive(Default)]
pub(crate) struct Net {
    pub flaky_until: Option<Instant>,
    pub drop_p: f64,
    pub slow: BTreeMap<NodeId, Instant>,
}

/// A block whose copy on `drive` was rotted; it impairs its node until it reads clean.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rot {
    pub node: NodeId,
    pub drive: DriveId,
    pub key: ExtentKey,
    pub block: u32,
    /// The rotted state's version (0: not known, a compressed group's other member).
    pub version: converge_types::Version,
}

/// What the fault budget holds against copies at one moment (`World::health`).
struct Health {
    bad_nodes: BTreeSet<NodeId>,
    bad_copies: BTreeSet<(VolumeId, NodeId)>,
    rots: Vec<Rot>,
    failed: BTreeSet<DriveId>,
}

impl Health {
    /// In sync, on a node that is not impaired, not recently hit, free of rot in its slab,
    /// on a drive that has not failed.
    fn healthy(&self, key: ExtentKey, e: &ExtentLoc) -> bool {
        e.state == ExtentState::InSync && self.usable(key, e)
    }

    /// Healthy but for its state: on a healthy node and drive, free of rot.
    fn usable(&self, key: ExtentKey, e: &ExtentLoc) -> bool {
        !self.bad_nodes.contains(&e.node)
            && !self.bad_copies.contains(&(key.volume, e.node))
            && !self.rots.iter().any(|r| r.drive == e.drive && r.key == key)
            && !self.failed.contains(&e.drive)
    }
}

/// One copy read whole: data, every block's version, and the blocks failing their crc or
/// suspect (rolled back by the drive's recovery, not yet checked by their owner).
pub(crate) type CopyImage = (Vec<u8>, Vec<Version>, Vec<u32>);

/// What an engine request delivered to a node came to.
pub(crate) enum Delivery<T> {
    Done(Result<T, EngineError>),
    /// The node is down, or died while serving the request: no reply will ever come.
    NoReply,
}

struct Trace {
    lines: u64,
    digest: u64,
    recent: VecDeque<String>,
}

const RECENT_LINES: usize = 400;

/// A node runs a cache destage step before a request when its log is this full (the log
/// must never fill: a write would then wait for a destage thread the simulation lacks).
const CACHE_PRESSURE_PCT: u64 = 60;
/// Still this full after a destage step: the cache is stuck.
const CACHE_FULL_PCT: u64 = 85;

pub struct World {
    pub(crate) opts: Options,
    rng: Mutex<StdRng>,
    t0: Instant,
    pub(crate) nodes: Mutex<Vec<Node>>,
    pub(crate) net: Mutex<Net>,
    pub(crate) ctl: Mutex<Ctl>,
    pub(crate) hist: Mutex<History>,
    pub(crate) rots: Mutex<Vec<Rot>>,
    /// Drives the nemesis failed (`Drive::fail_now`), until their node restarts: their
    /// copies cannot serve, and the node reports them to the control plane.
    pub(crate) failed_drives: Mutex<BTreeMap<DriveId, NodeId>>,
    /// Failed drives the node has recorded in the control plane.
    pub(crate) failures_reported: Mutex<BTreeSet<DriveId>>,
    /// Failed drives that are gone for good (a subset of `failed_drives`): at their node's
    /// next start a blank drive takes the place of each, under a new id.
    pub(crate) lost_drives: Mutex<BTreeSet<DriveId>>,
    /// Nodes that started with a blank drive in the place of a lost one and have not yet
    /// recorded the missing drive failed (`Cluster::fail_missing_drives`, as the daemon
    /// does at start-up).
    pub(crate) replaced_on: Mutex<BTreeSet<NodeId>>,
    /// Drive failures injected so far (at most `Options::drive_failures_max`).
    drive_failures: AtomicU64,
    pub(crate) vols: Mutex<Vec<VolRt>>,
    failures: Mutex<Vec<String>>,
    trace: Mutex<Trace>,
    /// Set when the fault phase is over: no new faults, clients stop.
    pub(crate) stopping: AtomicBool,
    pub(crate) stats: Mutex<BTreeMap<&'static str, u64>>,
    /// Stray-floor releases that new owners run beside serving, as the daemon spawns them
    /// (`owner::spawn_release`); the final checks wait for them.
    pub(crate) releases_running: AtomicU64,
    /// Nodes a recent fault may still make stale (a lost message, an ended partition or
    /// outage whose timeouts have not all been noticed yet), and until when.
    recently_hit: Mutex<BTreeMap<NodeId, Instant>>,
    /// Copies of one volume on one node that may be marked stale until a while after the
    /// given time: while an owner's node is cut off for less than its lease (variant
    /// short-owner-partitions), every copy of its volumes on *other* nodes fails for it,
    /// and it marks them stale once it reaches etcd again.
    recently_hit_copies: Mutex<BTreeMap<(VolumeId, NodeId), Instant>>,
}

pub(crate) fn slab_key(volume: converge_types::VolumeId, slab: u64) -> ExtentKey {
    ExtentKey {
        volume,
        slab: converge_types::SlabIndex(slab),
    }
}

/// A cache mode drawn at random (each node's, at start and when the mode switches).
pub(crate) fn random_mode(r: &mut StdRng) -> CacheMode {
    [CacheMode::None, CacheMode::Write, CacheMode::ReadWrite][r.gen_range(0..3)]
}

/// An open cache drive, one tier per capacity drive bound to it, and what its replay did.
pub(crate) type OpenedCache = (Arc<Cache>, Vec<Arc<Tier>>, OpenReport);

/// Opens (formatting it if blank) a node's cache drive on `file` as the node does at boot,
/// after its capacity drives `caps`: the log is replayed and everything newer than
/// capacity destaged. Returns the cache and one tier per capacity drive, bound to it, in
/// the order of `caps`.
pub(crate) fn open_cache(
    node: NodeId,
    id: DriveId,
    slab_bytes: u64,
    file: &FaultyFile,
    caps: &[(DriveId, Arc<Drive>)],
    mode: CacheMode,
) -> Result<OpenedCache, EngineError> {
    let ident = DriveIdentity {
        cluster: ClusterId(0x5157),
        node,
        drive: id,
        slab_size_bytes: slab_bytes,
        role: DriveRole::Cache,
        media: MediaType::Ram,
    };
    let map: HashMap<DriveId, Arc<Drive>> = caps.iter().cloned().collect();
    let (cache, report) = Cache::open(Arc::new(file.clone()), ident, &map)?;
    cache.set_mode(mode);
    let tiers = caps
        .iter()
        .map(|(_, d)| {
            let t = Tier::new(d.clone());
            t.bind(cache.clone());
            Arc::new(t)
        })
        .collect();
    Ok((cache, tiers, report))
}

impl World {
    pub(crate) fn new(opts: Options) -> Result<Arc<World>, String> {
        let mut rng = StdRng::seed_from_u64(opts.seed);
        let slab_bytes = opts.slab_blocks * BLOCK_SIZE as u64;
        let mut nodes = Vec::new();
        let mut ctl = Ctl::default();
        for n in 1..=opts.nodes as u32 {
            let count = rng.gen_range(1..=opts.max_drives_per_node.max(1));
            let mut drives = Vec::new();
            for d in 0..count as u64 {
                let id = DriveId(u64::from(n) * 10 + d);
                let image = FaultyFile::new(opts.drive_bytes);
                let live = image.reattach();
                let ident = DriveIdentity {
                    cluster: ClusterId(0x5157),
                    node: NodeId(n),
                    drive: id,
                    slab_size_bytes: slab_bytes,
                    role: DriveRole::Capacity,
                    media: MediaType::Ram,
                };
                let drive = Drive::format_with(
                    Arc::new(live.clone()),
                    ident,
                    FormatOptions {
                        journal_bytes: Some(opts.journal_bytes),
                        ..Default::default()
                    },
                )
                .map_err(|e| format!("formatting simulated drive {id}: {e}"))?;
                let extents_total = drive.capacity().extents_total;
                ctl.add_drive(NodeId(n), id, extents_total, slab_bytes);
                drives.push(SimDrive {
                    id,
                    image,
                    live,
                    extents_total,
                    tier: Some(Arc::new(Tier::new(Arc::new(drive)))),
                });
            }
            let cache = if opts.cache {
                let id = DriveId(u64::from(n) * 10 + 9);
                let image = FaultyFile::new(opts.cache_bytes);
                let live = image.reattach();
                let mode = random_mode(&mut rng);
                let caps: Vec<(DriveId, Arc<Drive>)> = drives
                    .iter()
                    .filter_map(|d| d.tier.as_ref().map(|t| (d.id, t.drive().clone())))
                    .collect();
                let (cache, tiers, _) =
                    open_cache(NodeId(n), id, slab_bytes, &live, &caps, mode)
                        .map_err(|e| format!("formatting simulated cache drive {id}: {e}"))?;
                for (d, t) in drives.iter_mut().zip(tiers) {
                    d.tier = Some(t);
                }
                Some(SimCache {
                    id,
                    image,
                    live,
                    cache: Some(cache),
                    mode,
                })
            } else {
                None
            };
            ctl.add_node(NodeId(n));
            nodes.push(Node {
                id: NodeId(n),
                up: true,
                incarnation: 0,
                drives,
                isolated_until: None,
                armed: false,
                cache,
                admission: Arc::new(Admission::new()),
            });
        }
        Ok(Arc::new(World {
            opts,
            rng: Mutex::new(rng),
            t0: Instant::now(),
            nodes: Mutex::new(nodes),
            net: Mutex::new(Net::default()),
            ctl: Mutex::new(ctl),
            hist: Mutex::new(History::default()),
            rots: Mutex::new(Vec::new()),
            failed_drives: Mutex::new(BTreeMap::new()),
            failures_reported: Mutex::new(BTreeSet::new()),
            lost_drives: Mutex::new(BTreeSet::new()),
            replaced_on: Mutex::new(BTreeSet::new()),
            drive_failures: AtomicU64::new(0),
            vols: Mutex::new(Vec::new()),
            failures: Mutex::new(Vec::new()),
            trace: Mutex::new(Trace {
                lines: 0,
                digest: 0xcbf2_9ce4_8422_2325,
                recent: VecDeque::new(),
            }),
            stopping: AtomicBool::new(false),
            releases_running: AtomicU64::new(0),
            stats: Mutex::new(BTreeMap::new()),
            recently_hit: Mutex::new(BTreeMap::new()),
            recently_hit_copies: Mutex::new(BTreeMap::new()),
        }))
    }

    /// Runs `f` with the run's one random generator.
    pub(crate) fn rng<T>(&self, f: impl FnOnce(&mut StdRng) -> T) -> T {
        f(&mut lock(&self.rng))
    }

    pub(crate) fn chance(&self, p: f64) -> bool {
        self.rng(|r| r.gen_bool(p.clamp(0.0, 1.0)))
    }

    pub(crate) fn ms(&self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(self.rng(|r| r.gen_range(lo..=hi)))
    }

    pub(crate) fn us(&self, lo: u64, hi: u64) -> Duration {
        Duration::from_micros(self.rng(|r| r.gen_range(lo..=hi)))
    }

    pub(crate) fn elapsed(&self) -> Duration {
        Instant::now() - self.t0
    }

    pub(crate) fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Relaxed)
    }

    pub(crate) fn count(&self, what: &'static str) {
        *lock(&self.stats).entry(what).or_insert(0) += 1;
    }

    /// One step of the run: folded into the digest, kept for failure reports, printed when
    /// verbose.
    pub(crate) fn trace(&self, line: impl FnOnce() -> String) {
        let t = self.elapsed();
        let line = format!(
            "[{:>5}.{:03}ms] {}",
            t.as_millis(),
            t.as_micros() % 1000,
            line()
        );
        let mut tr = lock(&self.trace);
        tr.lines += 1;
        for b in line.as_bytes() {
            tr.digest = (tr.digest ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
        }
        if self.opts.verbose {
            eprintln!("{line}");
        }
        if tr.recent.len() == RECENT_LINES {
            tr.recent.pop_front();
        }
        tr.recent.push_back(line);
    }

    pub(crate) fn trace_summary(&self) -> (u64, u64, Vec<String>) {
        let tr = lock(&self.trace);
        (tr.lines, tr.digest, tr.recent.iter().cloned().collect())
    }

    /// Records an invariant violation (the run goes on, so the report shows what followed).
    pub(crate) fn fail(&self, what: String) {
        self.trace(|| format!("INVARIANT VIOLATED: {what}"));
        let mut f = lock(&self.failures);
        if f.len() < 50 {
            f.push(what);
        }
    }

    /// Owners (and their in-flight tasks, once the runtime goes) hold the world: drop them
    /// and the drives, so a finished run frees its memory.
    pub(crate) fn teardown(&self) {
        let vols = std::mem::take(&mut *lock(&self.vols));
        for r in vols {
            for o in r
                .current
                .iter()
                .chain(r.pending.iter())
                .chain(r.zombies.iter())
            {
                o.kill();
            }
        }
        for n in lock(&self.nodes).iter_mut() {
            n.drives.clear();
            n.cache = None;
        }
    }

    pub(crate) fn failures(&self) -> Vec<String> {
        lock(&self.failures).clone()
    }

    pub(crate) fn has_failed(&self) -> bool {
        !lock(&self.failures).is_empty()
    }

    // ---- nodes -------------------------------------------------------------------------

    fn with_node<T>(&self, id: NodeId, f: impl FnOnce(&mut Node) -> T) -> Option<T> {
        let mut nodes = lock(&self.nodes);
        nodes.iter_mut().find(|n| n.id == id).map(f)
    }

    pub(crate) fn node_ids(&self) -> Vec<NodeId> {
        lock(&self.nodes).iter().map(|n| n.id).collect()
    }

    /// Whether `drive` is (still) one of `node`'s drives.
    pub(crate) fn holds_drive(&self, node: NodeId, drive: DriveId) -> bool {
        self.with_node(node, |n| n.drives.iter().any(|d| d.id == drive))
            .unwrap_or(false)
    }

    pub(crate) fn is_up(&self, id: NodeId) -> bool {
        self.with_node(id, |n| n.up).unwrap_or(false)
    }

    pub(crate) fn isolated(&self, id: NodeId) -> bool {
        let now = Instant::now();
        self.with_node(id, |n| n.isolated_until.is_some_and(|t| now < t))
            .unwrap_or(false)
    }

    /// Up and reachable: a node a new owner may run on, or a stale copy may be resynced on.
    pub(crate) fn ready(&self, id: NodeId) -> bool {
        self.is_up(id) && !self.isolated(id)
    }

    /// The simulated etcd's live leases: one per node that is up and reachable.
    pub(crate) fn live_leases(&self) -> crate::control::Leases {
        let now = Instant::now();
        lock(&self.nodes)
            .iter()
            .filter(|n| n.up && n.isolated_until.is_none_or(|t| now >= t))
            .map(|n| crate::control::lease_of(n.id).0)
            .collect()
    }

    pub(crate) fn incarnation(&self, id: NodeId) -> u64 {
        self.with_node(id, |n| n.incarnation).unwrap_or(0)
    }

    pub(crate) fn reachable(&self, from: NodeId, to: NodeId) -> bool {
        from == to || (!self.isolated(from) && !self.isolated(to))
    }

    /// Serves one extent operation on a node's drive as the daemon serves it on a RAM
    /// drive (`LocalDrives::call`): the replica service's `start` (the I/O, inline), then
    /// `converge_replica::durable`: after letting the other requests queue their records,
    /// the wait for its journal batch, led by this request if nobody leads. Requests that meet at the yield share a
    /// batch (group commit), so the simulation exercises it; a power loss armed on the
    /// node's files may fire in either part.
    pub(crate) async fn serve(
        self: &Arc<Self>,
        from: NodeId,
        node: NodeId,
        drive: DriveId,
        op: ExtentOp,
    ) -> Delivery<ExtentReply> {
        let inc = self.incarnation(node);
        if let Some(refused) = self.admit(from, node, drive, &op).await {
            return refused;
        }
        if self.incarnation(node) != inc {
            return Delivery::NoReply;
        }
        let (reply, durable) = match self.exec(node, drive, |t| converge_replica::start(t, op)) {
            Delivery::Done(Ok(x)) => x,
            Delivery::Done(Err(e)) => return Delivery::Done(Err(e)),
            Delivery::NoReply => return Delivery::NoReply,
        };
        if durable.is_done() {
            return Delivery::Done(Ok(reply));
        }
        let r = converge_replica::durable(durable).await;
        if self.any_file_crashed(node) {
            self.crash_node(node, "armed power loss fired inside a journal write");
            return Delivery::NoReply;
        }
        if self.incarnation(node) != inc {
            // The node died (and maybe came back) while this request waited: whatever the
            // drive of that life says, its answer is never sent.
            return Delivery::NoReply;
        }
        Delivery::Done(r.map(|()| reply))
    }

    /// The daemon's checks with the control plane before its replica service runs `op`
    /// (`converge_allocator::admission`, through this node's view of the simulated etcd).
    /// A refusal of the volume's current owner is a bug: the run fails. A deposed owner's
    /// refused request is answered as a fenced one (it is); a check the node cannot make
    /// (etcd out of its reach) gets no answer, as the daemon's error would not help either.
    async fn admit(
        self: &Arc<Self>,
        from: NodeId,
        node: NodeId,
        drive: DriveId,
        op: &ExtentOp,
    ) -> Option<Delivery<ExtentReply>> {
        let admission = self.with_node(node, |n| n.up.then(|| n.admission.clone()))??;
        let key = op.key();
        let holds = match self.exec(node, drive, |t| Ok(t.has_extent(key))) {
            Delivery::Done(Ok(h)) => h,
            Delivery::Done(Err(e)) => return Some(Delivery::Done(Err(e))),
            Delivery::NoReply => return Some(Delivery::NoReply),
        };
        let cluster = Cluster::new(SimKv {
            world: self.clone(),
            node,
        });
        let caller = if from == node {
            Caller::Local
        } else {
            Caller::Peer(from)
        };
        let checked = admission.check(&cluster, caller, drive, op, || holds).await;
        if let Err(r) = &checked {
            self.trace(|| {
                format!(
                    "n{node}: admission refused n{from}'s {} of {key:?} at {:?}: {r:?}",
                    op.name(),
                    op.epoch()
                )
            });
        }
        match checked {
            Ok(()) => None,
            Err(Refusal::NotOwner(why)) if op.epoch().is_some() => {
                // Only owners send epochs, and an epoch is one node's: a bug.
                self.fail(format!(
                    "node {node} drive {drive} refused node {from}'s {} of epoch {:?} as not \
                     the owner's: {why}",
                    op.name(),
                    op.epoch()
                ));
                Some(Delivery::NoReply)
            }
            Err(Refusal::NotOwner(why)) => {
                // A deposed owner's late free of a copy it replaced: the new owner's now.
                self.count("frees refused to a node that is not the owner");
                Some(Delivery::Done(Err(EngineError::Failed { reason: why })))
            }
            Err(Refusal::Unavailable(why)) => {
                self.trace(|| format!("n{node}: admission unavailable: {why}"));
                self.count("replica checks the control plane could not answer");
                Some(Delivery::NoReply)
            }
            Err(Refusal::NotGranted(why)) => {
                // No owner ever held that epoch: nothing in the simulation may send it.
                self.fail(format!(
                    "node {node} drive {drive} refused a {} of epoch {:?}: {why}",
                    op.name(),
                    op.epoch()
                ));
                Some(Delivery::NoReply)
            }
            Err(Refusal::Deposed { current, .. }) => {
                self.count("new extents refused to a deposed owner");
                Some(Delivery::Done(Err(EngineError::StaleEpoch {
                    key,
                    requested: op.epoch().unwrap_or_default(),
                    current,
                })))
            }
            Err(refused @ (Refusal::NotPlaced(_) | Refusal::StillPlaced(_))) => {
                // A request that raced a change of the slab's record (a copy replaced
                // meanwhile), or a deposed owner's late one: refused, as the daemon does;
                // the owner counts that copy as failed for this request.
                self.count("requests refused for a copy the slab record does not place");
                Some(Delivery::Done(Err(EngineError::Failed {
                    reason: refused.message().to_string(),
                })))
            }
        }
    }

    /// Runs one engine request on a node's drive (through its cache tier, if the run has
    /// caches), as that node's request handler would. A power loss armed on one of the
    /// node's files may fire inside: the node is then down and no reply is ever sent.
    pub(crate) fn exec<T>(
        self: &Arc<Self>,
        node: NodeId,
        drive: DriveId,
        op: impl FnOnce(&Tier) -> Result<T, EngineError>,
    ) -> Delivery<T> {
        let lost = lock(&self.lost_drives).contains(&drive);
        let got = self.with_node(node, |n| {
            if !n.up {
                return None;
            }
            let cache = n.cache.as_ref().and_then(|c| c.cache.clone());
            Some(match n.drives.iter().find(|d| d.id == drive) {
                // As the daemon answers for a drive it did not open.
                None if lost => Err(EngineError::Failed {
                    reason: format!("drive {drive} is not on node {node} (replaced?)"),
                }),
                None => Err(EngineError::InvalidArgument(format!(
                    "node {node} has no drive {drive}"
                ))),
                Some(d) => match &d.tier {
                    Some(t) => Ok((t.clone(), cache)),
                    None => Err(EngineError::Failed {
                        reason: format!("drive {drive} did not reopen after the last crash"),
                    }),
                },
            })
        });
        let (t, cache) = match got.flatten() {
            None => return Delivery::NoReply,
            Some(Err(e)) => return Delivery::Done(Err(e)),
            Some(Ok(x)) => x,
        };
        if let Some(c) = cache {
            if c.used_pct() >= CACHE_PRESSURE_PCT {
                // No destage thread here: do what it would before the log fills up (a write
                // through a full log waits for destage, which would never come).
                self.count("cache destage steps under pressure");
                let r = c.background_step(true);
                if self.any_file_crashed(node) {
                    self.crash_node(node, "armed power loss fired inside an engine write");
                    return Delivery::NoReply;
                }
                if let Err(e) = r {
                    self.fail(format!("node {node}: cache destage failed: {e}"));
                }
                if c.used_pct() >= CACHE_FULL_PCT {
                    self.fail(format!(
                        "node {node}: the cache log stays {}% full after a destage step",
                        c.used_pct()
                    ));
                    return Delivery::Done(Err(EngineError::Failed {
                        reason: "cache log full".into(),
                    }));
                }
            }
        }
        let r = op(&t);
        drop(t);
        if self.any_file_crashed(node) {
            self.crash_node(node, "armed power loss fired inside an engine write");
            return Delivery::NoReply;
        }
        Delivery::Done(r)
    }

    /// Folds a cache's counters into the run's (when it dies with its node).
    fn cache_totals(&self, c: &Cache) {
        let s = c.stats();
        let mut st = lock(&self.stats);
        if s.dirty_bytes > 0 {
            *st.entry("power losses with dirty blocks in the cache log")
                .or_insert(0) += 1;
        }
        *st.entry("cache read hit blocks").or_insert(0) += s.read_hit_blocks;
        *st.entry("cache read-cache admissions").or_insert(0) += s.admitted_blocks;
        *st.entry("cache writes stalled (log full)").or_insert(0) += s.write_stalls;
        *st.entry("cache blocks of failed drives carried")
            .or_insert(0) += s.carried_blocks;
    }

    /// Did an armed power loss fire on one of the node's open files (drives or cache)?
    fn any_file_crashed(&self, node: NodeId) -> bool {
        self.with_node(node, |n| {
            n.up && (n
                .drives
                .iter()
                .any(|d| d.tier.is_some() && d.live.crashed())
                || n.cache
                    .as_ref()
                    .is_some_and(|c| c.cache.is_some() && c.live.crashed()))
        })
        .unwrap_or(false)
    }

    /// One step of a node's cache background work (admissions, then destage and reclaim
    /// of the log's oldest chunk), as the destage thread would do it at this moment.
    /// Returns the bytes destaged, or None if the node is down, has no cache, or lost
    /// power inside the step.
    pub(crate) fn cache_step(self: &Arc<Self>, node: NodeId, pressure: bool) -> Option<u64> {
        let c = self
            .with_node(node, |n| {
                if !n.up {
                    return None;
                }
                n.cache.as_ref().and_then(|c| c.cache.clone())
            })
            .flatten()?;
        let r = c.background_step(pressure);
        if self.any_file_crashed(node) {
            self.count("node crashes inside a cache destage step");
            self.crash_node(node, "armed power loss fired inside a cache destage step");
            return None;
        }
        match r {
            Ok(b) => Some(b),
            Err(e) => {
                self.fail(format!("node {node}: cache destage failed: {e}"));
                None
            }
        }
    }

    /// Power loss on a whole node: every drive loses or tears its unsynced writes, the
    /// daemon (and any volume owner on it) is gone, and it reboots after a while.
    pub(crate) fn crash_node(self: &Arc<Self>, id: NodeId, why: &str) {
        let seeds: Vec<u64> = (0..4).map(|_| self.rng(|r| r.gen())).collect();
        let cache_seed = if self.opts.cache {
            self.rng(|r| r.gen())
        } else {
            0
        };
        let dying_cache = self
            .with_node(id, |n| {
                n.cache
                    .as_ref()
                    .and_then(|c| c.cache.clone())
                    .filter(|_| n.up)
            })
            .flatten();
        if let Some(c) = dying_cache {
            self.cache_totals(&c);
        }
        let crashed = self
            .with_node(id, |n| {
                if !n.up {
                    return false;
                }
                n.up = false;
                n.armed = false;
                n.incarnation += 1;
                n.admission = Arc::new(Admission::new());
                for (i, d) in n.drives.iter_mut().enumerate() {
                    d.image.crash(seeds[i % seeds.len()]);
                    d.tier = None;
                }
                if let Some(c) = n.cache.as_mut() {
                    c.image.crash(cache_seed);
                    c.cache = None;
                }
                true
            })
            .unwrap_or(false);
        if !crashed {
            return;
        }
        self.count(if why.starts_with("armed power loss fired inside") {
            "node crashes inside an engine write"
        } else {
            "node crashes between requests"
        });
        self.trace(|| format!("node {id} CRASHED ({why})"));
        crate::owner::node_died(self, id);
        if !self.stopping() {
            let down = self.ms(self.opts.downtime_ms.0, self.opts.downtime_ms.1);
            let w = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(down).await;
                w.restart_node(id);
            });
        }
    }

    /// Reboot: every drive is reopened from what survived (journal replay and recovery),
    /// then the cache drive, if any: its log is replayed and destaged into the capacity
    /// drives before they serve. With caches, the power may fail again during that boot
    /// (armed inside one of its device writes): the node then stays down a while longer.
    pub(crate) fn restart_node(self: &Arc<Self>, id: NodeId) {
        // (writes, seed, which file, seeds of the crash) of a power loss during the boot.
        let boot_crash = if self.opts.cache
            && !self.stopping()
            && self.is_down(id)
            && self.chance(self.opts.cache_boot_crash_p)
        {
            let writes = self.rng(|r| r.gen_range(1..=12u64));
            let seed = self.rng(|r| r.gen());
            let pick = self.rng(|r| r.gen::<usize>());
            let seeds: Vec<u64> = (0..5).map(|_| self.rng(|r| r.gen())).collect();
            Some((writes, seed, pick, seeds))
        } else {
            None
        };
        let slab_bytes = self.opts.slab_blocks * BLOCK_SIZE as u64;
        if self.is_down(id) {
            self.replace_lost_drives(id);
        }
        let mut errors = Vec::new();
        let mut reports = Vec::new();
        let outcome = self
            .with_node(id, |n| {
                if n.up {
                    return None;
                }
                for d in n.drives.iter_mut() {
                    d.live = d.image.reattach();
                }
                if let Some(c) = n.cache.as_mut() {
                    c.live = c.image.reattach();
                }
                let mut armed_on: Option<FaultyFile> = None;
                if let Some((writes, seed, pick, _)) = &boot_crash {
                    let i = pick % (n.drives.len() + 1);
                    let f = match (n.drives.get(i), n.cache.as_ref()) {
                        (Some(d), _) => d.live.clone(),
                        (None, Some(c)) => c.live.clone(),
                        (None, None) => n.drives[0].live.clone(),
                    };
                    f.crash_after_writes(*writes, *seed);
                    armed_on = Some(f);
                }
                let mut caps = Vec::new();
                for d in n.drives.iter_mut() {
                    let file: Arc<dyn BlockFile> = Arc::new(d.live.clone());
                    match Drive::open(file) {
                        Ok(dr) => {
                            let rolled_back = dr.stats().rolled_back_at_open;
                            if rolled_back > 0 {
                                *lock(&self.stats)
                                    .entry("blocks rolled back by recovery (marked suspect)")
                                    .or_default() += rolled_back;
                            }
                            let dr = Arc::new(dr);
                            caps.push((d.id, dr.clone()));
                            d.tier = Some(Arc::new(Tier::new(dr)));
                        }
                        Err(e) => {
                            errors.push(format!(
                                "engine could not recover drive {} of node {id} after power loss: {e}",
                                d.id
                            ));
                            d.tier = None;
                        }
                    }
                }
                let all_open = caps.len() == n.drives.len();
                if let Some(c) = n.cache.as_mut().filter(|_| all_open) {
                    // (Never without every capacity drive: the log of a missing one would
                    // be dropped with the old log.)
                    match open_cache(id, c.id, slab_bytes, &c.live, &caps, c.mode) {
                        Ok((cache, tiers, report)) => {
                            for ((drive, _), t) in caps.iter().zip(tiers) {
                                if let Some(d) = n.drives.iter_mut().find(|d| d.id == *drive) {
                                    d.tier = Some(t);
                                }
                            }
                            c.cache = Some(cache);
                            reports.push(report);
                        }
                        Err(e) => {
                            errors.push(format!(
                                "engine could not open cache drive {} of node {id} after power loss: {e}",
                                c.id
                            ));
                            c.cache = None;
                            // Without its log, the capacity drives may miss acked writes:
                            // they must not serve.
                            for d in n.drives.iter_mut() {
                                d.tier = None;
                            }
                        }
                    }
                }
                let fired = n.drives.iter().any(|d| d.live.crashed())
                    || n.cache.as_ref().is_some_and(|c| c.live.crashed());
                if fired {
                    // Power failed again during the boot: down again, everything unsynced
                    // lost or torn once more.
                    let seeds = boot_crash.as_ref().map(|b| b.3.clone()).unwrap_or_default();
                    for (i, d) in n.drives.iter_mut().enumerate() {
                        d.image.crash(seeds.get(i).copied().unwrap_or(0));
                        d.tier = None;
                    }
                    if let Some(c) = n.cache.as_mut() {
                        c.image.crash(seeds.get(4).copied().unwrap_or(0));
                        c.cache = None;
                    }
                    return Some(false);
                }
                if let Some(f) = armed_on {
                    // Not reached during the boot: disarm (far beyond the run).
                    f.crash_after_writes(u64::MAX, 0);
                }
                n.up = true;
                n.incarnation += 1;
                Some(true)
            })
            .flatten();
        match outcome {
            None => {}
            Some(false) => {
                self.count("power losses during a boot (recovery)");
                self.trace(|| {
                    format!("node {id} LOST POWER AGAIN while booting (recovery interrupted)")
                });
                if !self.stopping() {
                    let down = self.ms(10, 100);
                    let w = self.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(down).await;
                        w.restart_node(id);
                    });
                }
            }
            Some(true) => {
                self.hit(id, Instant::now());
                // As converged at start-up: a drive that opened is not failed any more (its
                // copies were rebuilt elsewhere, or are still stale and get resynced).
                // (A drive lost for good is not there any more: a blank one took its place.)
                let lost = lock(&self.lost_drives).clone();
                let drives: Vec<DriveId> = lock(&self.failed_drives)
                    .iter()
                    .filter(|(d, n)| **n == id && !lost.contains(d))
                    .map(|(d, _)| *d)
                    .collect();
                for d in drives {
                    lock(&self.failed_drives).remove(&d);
                    lock(&self.failures_reported).remove(&d);
                    lock(&self.ctl).clear_drive_failure(d);
                    self.trace(|| format!("node {id}: drive {d} reopened, no longer failed"));
                }
                self.reclaim_orphans(id);
                for r in &reports {
                    if r.blocks_destaged > 0 {
                        self.count("cache replays that destaged blocks");
                    }
                    *lock(&self.stats)
                        .entry("cache blocks destaged by replay")
                        .or_insert(0) += r.blocks_destaged;
                    // A drive lost for good leaves its logged blocks to no drive: dropped,
                    // as converged does (its copies are rebuilt from the others).
                    let replaced = lock(&self.failed_drives)
                        .iter()
                        .any(|(d, n)| *n == id && lost.contains(d));
                    if r.blocks_lost > 0 || (r.blocks_of_unknown_drives > 0 && !replaced) {
                        self.fail(format!(
                            "node {id}: cache replay lost {} logged blocks ({} of unknown drives)",
                            r.blocks_lost, r.blocks_of_unknown_drives
                        ));
                    }
                }
                self.trace(|| {
                    let replay: Vec<String> = reports
                        .iter()
                        .map(|r| {
                            format!(
                                ", cache log replayed ({} batches, {} blocks destaged)",
                                r.batches_replayed, r.blocks_destaged
                            )
                        })
                        .collect();
                    format!("node {id} restarted, drives reopened{}", replay.concat())
                });
                self.find_torn_blocks(id);
                for e in errors {
                    self.fail(e);
                }
            }
        }
    }

    /// Destages everything in the node's cache log (`Cache::flush`, which runs the destage
    /// steps itself when no thread does).
    pub(crate) fn flush_cache(self: &Arc<Self>, id: NodeId) {
        let Some(c) = self
            .with_node(id, |n| {
                if !n.up {
                    return None;
                }
                n.cache.as_ref().and_then(|c| c.cache.clone())
            })
            .flatten()
        else {
            return;
        };
        let r = c.flush();
        if self.any_file_crashed(id) {
            self.crash_node(id, "armed power loss fired inside a cache flush");
            return;
        }
        match r {
            Ok(()) => self.trace(|| format!("node {id}: cache flushed")),
            Err(e) => self.fail(format!("node {id}: cache flush failed: {e}")),
        }
    }

    fn is_down(&self, id: NodeId) -> bool {
        self.with_node(id, |n| !n.up).unwrap_or(false)
    }

    /// After a power loss every block must read whole (the engine writes out of place, so
    /// a lost or torn unsynced write leaves the previous content provable): a block that
    /// reads bad and is not a known rot fails the run.
    fn find_torn_blocks(self: &Arc<Self>, id: NodeId) {
        let blocks = self.opts.slab_blocks;
        let drives: Vec<(DriveId, Vec<ExtentKey>)> = self
            .with_node(id, |n| {
                n.drives
                    .iter()
                    .filter_map(|d| {
                        d.tier
                            .as_ref()
                            .map(|t| (d.id, t.extents().into_iter().map(|e| e.key).collect()))
                    })
                    .collect()
            })
            .unwrap_or_default();
        for (drive, keys) in drives {
            for key in keys {
                let Ok((_, _, bad)) = self.read_copy(id, drive, key, blocks) else {
                    continue;
                };
                for block in bad {
                    let known = lock(&self.rots).iter().any(|r| {
                        r.node == id && r.drive == drive && r.key == key && r.block == block
                    });
                    if !known {
                        self.fail(format!(
                            "node {id} drive {drive}: vol {} slab {} block {block} reads bad after recovery from a power loss (torn)",
                            key.volume, key.slab
                        ));
                    }
                }
            }
        }
    }

    /// Arms a power loss inside one of the node's next engine writes (mid-write: data
    /// written, journal not yet synced, or mid-checkpoint; with caches also mid log batch
    /// or mid-destage), so recovery sees lost and torn unsynced writes. Falls back to an
    /// immediate power cut if nothing writes there soon.
    pub(crate) fn arm_crash(self: &Arc<Self>, id: NodeId) -> bool {
        let writes = self.rng(|r| r.gen_range(1..=6u64));
        self.arm_crash_with(id, writes, None)
    }

    /// [`World::arm_crash`] within `writes` device writes, on the file `on` picks (an
    /// index into the node's open capacity drives, then its cache), or a random one.
    pub(crate) fn arm_crash_with(
        self: &Arc<Self>,
        id: NodeId,
        writes: u64,
        on: Option<usize>,
    ) -> bool {
        let seed = self.rng(|r| r.gen());
        let pick = on.unwrap_or_else(|| self.rng(|r| r.gen::<usize>()));
        let armed = self
            .with_node(id, |n| {
                if !n.up || n.armed {
                    return None;
                }
                let mut files: Vec<(DriveId, &FaultyFile)> = n
                    .drives
                    .iter()
                    .filter(|d| d.tier.is_some())
                    .map(|d| (d.id, &d.live))
                    .collect();
                if let Some(c) = n.cache.as_ref().filter(|c| c.cache.is_some()) {
                    files.push((c.id, &c.live));
                }
                if files.is_empty() {
                    return None;
                }
                let (drive, f) = files[pick % files.len()];
                f.crash_after_writes(writes, seed);
                let inc = n.incarnation;
                n.armed = true;
                Some((inc, drive))
            })
            .flatten();
        let Some((inc, drive)) = armed else {
            return false;
        };
        self.trace(|| {
            format!("node {id}: power loss armed on drive {drive} within {writes} device writes")
        });
        let w = self.clone();
        let fallback = self.ms(100, 400);
        tokio::spawn(async move {
            tokio::time::sleep(fallback).await;
            if w.incarnation(id) == inc && w.is_up(id) {
                w.crash_node(id, "armed power loss did not fire; power cut now");
            }
        });
        true
    }

    // ---- network -------------------------------------------------------------------------

    pub(crate) fn isolate(&self, id: NodeId, d: Duration) {
        let now = Instant::now();
        let until = self
            .with_node(id, |n| {
                // A new cut never shortens one in progress.
                let u = match n.isolated_until {
                    Some(t) if t > now + d => t,
                    _ => now + d,
                };
                n.isolated_until = Some(u);
                u
            })
            .unwrap_or(now);
        self.hit(id, until);
    }

    pub(crate) fn heal_partition(&self, id: NodeId) {
        self.with_node(id, |n| n.isolated_until = None);
    }

    /// `node` may have copies marked stale until a while after `t` (requests that failed
    /// by then are noticed one timeout later, and marked a control round trip after that).
    fn hit(&self, node: NodeId, t: Instant) {
        let until = t + self.opts.rpc_timeout * 3;
        let mut h = lock(&self.recently_hit);
        let e = h.entry(node).or_insert(until);
        *e = (*e).max(until);
    }

    /// `volume`'s copies on `node` may be marked stale until a while after `t` (as for
    /// [`World::hit`], plus the time a write may retry failed copies before failing).
    pub(crate) fn hit_copies(&self, volume: VolumeId, node: NodeId, t: Instant) {
        let until = t + self.opts.rpc_timeout * 3 + self.opts.degraded_write_wait;
        let mut h = lock(&self.recently_hit_copies);
        let e = h.entry((volume, node)).or_insert(until);
        *e = (*e).max(until);
    }

    /// Random one-way delay of a message to or from `node`: usually sub-millisecond,
    /// sometimes a spike, more when the node is slow. Always below the RPC timeout, so
    /// only drops and partitions cause timeouts.
    pub(crate) fn net_delay(&self, node: NodeId) -> Duration {
        let slow = lock(&self.net)
            .slow
            .get(&node)
            .is_some_and(|&t| Instant::now() < t);
        let mut d = self.us(20, 1000);
        if self.chance(0.03) {
            d += self.us(1000, 10_000);
        }
        if slow {
            d += self.us(2000, 15_000);
        }
        d
    }

    /// Should this message to or from `node` be lost? Only while the network is flaky, and
    /// only if losing it stays within the fault budget (it may make `node`'s copy stale).
    pub(crate) fn drop_message(self: &Arc<Self>, node: NodeId) -> bool {
        let p = {
            let net = lock(&self.net);
            match net.flaky_until {
                Some(t) if Instant::now() < t => net.drop_p,
                _ => return false,
            }
        };
        if self.chance(p) && self.may_impair(node) {
            self.hit(node, Instant::now());
            return true;
        }
        false
    }

    // ---- fault budget ----------------------------------------------------------------

    /// Nodes whose copies are not fully usable now or soon: down, cut off, about to lose
    /// power, or recently hit by a fault whose stale marks may still be on their way.
    pub(crate) fn impaired_nodes(&self) -> BTreeSet<NodeId> {
        let now = Instant::now();
        let mut s: BTreeSet<NodeId> = lock(&self.nodes)
            .iter()
            .filter(|n| !n.up || n.armed || n.isolated_until.is_some_and(|t| now < t))
            .map(|n| n.id)
            .collect();
        s.extend(
            lock(&self.recently_hit)
                .iter()
                .filter(|(_, &t)| now < t)
                .map(|(n, _)| *n),
        );
        s
    }

    /// Rotted blocks that still read bad (the others were repaired or rewritten).
    fn live_rots(self: &Arc<Self>) -> Vec<Rot> {
        let rots: Vec<Rot> = lock(&self.rots).clone();
        let keep: Vec<Rot> = rots
            .into_iter()
            .filter(|r| {
                let bad = self.still_rotten(r);
                if !bad {
                    self.trace(|| {
                        format!(
                            "rot of node {} drive {} vol {} slab {} block {} reads whole again",
                            r.node, r.drive, r.key.volume, r.key.slab, r.block
                        )
                    });
                }
                bad
            })
            .collect();
        *lock(&self.rots) = keep.clone();
        keep
    }

    /// What keeps a copy from counting as healthy now: impaired nodes, copies recently
    /// hit, live rot, failed drives.
    fn health(self: &Arc<Self>) -> Health {
        let now = Instant::now();
        Health {
            bad_nodes: self.impaired_nodes(),
            bad_copies: lock(&self.recently_hit_copies)
                .iter()
                .filter(|(_, &t)| now < t)
                .map(|(k, _)| *k)
                .collect(),
            rots: self.live_rots(),
            failed: lock(&self.failed_drives).keys().copied().collect(),
        }
    }

    /// Each volume's resiliency, from which [`healthy_needed`] tells a slab's.
    fn resiliencies(&self) -> BTreeMap<VolumeId, Resiliency> {
        lock(&self.vols)
            .iter()
            .map(|r| (r.id, r.spec.resiliency))
            .collect()
    }

    /// May a fault now hit the copies `hit` selects (on top of what is impaired already)?
    /// Every slab must keep at least one copy (K chunks of a parity slab) that is in sync,
    /// on a healthy node and free of rot: with fewer, no copy could ever be brought back in
    /// sync (the volume has no way out of that; see docs/SIMULATION.md), so the fault model
    /// stops short of it.
    ///
    /// A parity slab's chunk on a draining node does not count as healthy either: its
    /// evacuation replaces it in its place and rebuilds it from the others (ADR 0008: the
    /// slab is one chunk short while it is rebuilt, as after a failed drive), so the drain
    /// is one of the M impairments the slab can take, and `drain_one` only drains a node
    /// the budget allows. (With one more chunk out of reach during that rebuild, the slab
    /// waits for it: I/O fails meanwhile.)
    pub(crate) fn within_budget(
        self: &Arc<Self>,
        hit: impl Fn(ExtentKey, &ExtentLoc) -> bool,
    ) -> bool {
        self.within_budget_or(hit, |_, _| false)
    }

    /// [`Self::within_budget`], where a slab short of healthy copies is still let go if
    /// `rescue(slab, its copies)` says so.
    fn within_budget_or(
        self: &Arc<Self>,
        hit: impl Fn(ExtentKey, &ExtentLoc) -> bool,
        rescue: impl Fn(ExtentKey, &[ExtentLoc]) -> bool,
    ) -> bool {
        let health = self.health();
        let res = self.resiliencies();
        let records = lock(&self.ctl).all();
        let draining = if res.values().any(|r| r.is_parity()) {
            lock(&self.ctl).draining()
        } else {
            BTreeSet::new()
        };
        records.iter().all(|((v, s), extents)| {
            let key = ExtentKey {
                volume: *v,
                slab: *s,
            };
            if !extents.iter().any(|e| hit(key, e)) {
                return true;
            }
            let (min, parity) = res
                .get(v)
                .map_or((self.opts.healthy_copies_min, false), |r| {
                    healthy_needed(r.of_slab(*s), self.opts.healthy_copies_min)
                });
            let healthy = extents
                .iter()
                .filter(|e| !hit(key, e) && health.healthy(key, e))
                .filter(|e| !parity || !draining.contains(&e.node))
                .count();
            healthy >= min || rescue(key, extents)
        })
    }

    /// May a fault hit every copy on `node` (power loss, partition, lost messages)?
    pub(crate) fn may_impair(self: &Arc<Self>, node: NodeId) -> bool {
        self.within_budget(|_, e| e.node == node)
    }

    fn still_rotten(self: &Arc<Self>, r: &Rot) -> bool {
        let key = r.key;
        let off = u64::from(r.block) * BLOCK_SIZE as u64;
        // Read from the drive itself: a cache's copy of the block may hide it for a while.
        match self.exec(r.node, r.drive, move |t| {
            let mut buf = vec![0u8; BLOCK_SIZE];
            let mut v = Vec::new();
            t.drive()
                .read_blocks(key, Epoch(u64::MAX), off, &mut buf, &mut v)
                .map(|info| (info, v))
        }) {
            // A block that reads whole at an older version than the rotted one was rolled
            // back by a recovery (its write was in the journal's last batch and did not
            // check out): the rotted state may come back at a later recovery, once that
            // batch is no longer the last.
            Delivery::Done(Ok((info, v))) => {
                !info.bad_blocks.is_empty() || v.first().is_some_and(|&v| v < r.version)
            }
            // Down or failing: assume still rotten until it can be checked.
            _ => true,
        }
    }

    /// Fails one capacity drive of `node` as a dead device would (every later call fails),
    /// if the run's drive failures are not used up and the fault budget allows losing
    /// every copy on it. The node reports it; the repair policy rebuilds its copies
    /// elsewhere. Returns what it did.
    pub(crate) fn fail_drive(self: &Arc<Self>, node: NodeId) -> Option<String> {
        if self.drive_failures.load(Ordering::Relaxed) >= self.opts.drive_failures_max {
            return None;
        }
        let pick = self.rng(|r| r.gen::<usize>());
        let cands: Vec<(DriveId, Arc<Tier>)> = self
            .with_node(node, |n| {
                if !n.up {
                    return Vec::new();
                }
                n.drives
                    .iter()
                    .filter_map(|d| d.tier.clone().map(|t| (d.id, t)))
                    .collect()
            })
            .unwrap_or_default();
        if cands.is_empty() {
            return None;
        }
        // Half the seeds lose the drive for good (a bit of the seed, so that no other
        // fault's schedule moves). Such a loss may take a slab's every in-sync copy if a
        // stale copy the record says holds every acked write is left (docs/adr/0014): the
        // nemesis then picks such a drive when there is one, the worst it could lose.
        // Half of those (another bit) wait for such a drive.
        let for_good = (self.opts.seed >> 1) & 1 == 1;
        let targeted = for_good && (self.opts.seed >> 2) & 1 == 1;
        let worst = cands
            .iter()
            .find(|(d, _)| for_good && self.sole_in_sync_beside_a_holder(*d));
        if worst.is_none() && targeted {
            return None;
        }
        let (id, tier) = worst.unwrap_or(&cands[pick % cands.len()]).clone();
        let allowed = if for_good {
            self.may_lose_for_good(id)
        } else {
            self.within_budget(|_, e| e.drive == id)
        };
        if !allowed || !self.room_to_rebuild(id) {
            return None;
        }
        tier.drive().fail_now("the simulation's nemesis");
        lock(&self.failed_drives).insert(id, node);
        self.drive_failures.fetch_add(1, Ordering::Relaxed);
        self.count("drive failures");
        // Lost for good: a blank drive replaces it at the node's next start. If the budget
        // lets the whole node go, it goes now, as an operator powers a node down to swap
        // the drive; its start then finds the drive missing, unreported.
        if for_good {
            lock(&self.lost_drives).insert(id);
            self.count("drives lost for good");
            if worst.is_some() {
                self.count("drives lost for good with a slab's only in-sync copy");
            }
            if self.may_impair(node) {
                self.crash_node(node, &format!("powered down to replace drive {id}"));
            }
            return Some(format!("node {node}: drive {id} FAILED, lost for good"));
        }
        Some(format!("node {node}: drive {id} FAILED"))
    }

    /// Whether this seed loses a drive for good in a targeted way (see `fail_drive`).
    pub(crate) fn targeted_loss(&self) -> bool {
        !self.opts.cache && self.opts.drive_failures_max > 0 && (self.opts.seed >> 1) & 3 == 3
    }

    /// Whether `drive` holds the only in-sync copy of a mirror slab that has a stale copy
    /// the record marks as holding every acked write.
    fn sole_in_sync_beside_a_holder(&self, drive: DriveId) -> bool {
        let (records, holders) = {
            let ctl = lock(&self.ctl);
            (ctl.all(), ctl.holders())
        };
        records.iter().any(|((v, s), ex)| {
            let mut in_sync = ex.iter().filter(|e| e.state == ExtentState::InSync);
            in_sync.clone().count() == 1
                && in_sync.all(|e| e.drive == drive)
                && ex.iter().any(|e| holders.contains(&(*v, *s, e.drive)))
        })
    }

    /// May `drive` be lost for good? Every slab with a copy on it must keep, elsewhere,
    /// what the budget asks (healthy in-sync copies), or a usable stale copy its record
    /// marks as holding every acked write (a mirror slab of a volume without snapshots:
    /// docs/adr/0014). The marks are the code under test's: a mark that lies lets the
    /// loss happen, and the acked write it lost shows in the checks.
    fn may_lose_for_good(self: &Arc<Self>, drive: DriveId) -> bool {
        let health = self.health();
        let res = self.resiliencies();
        let holders = lock(&self.ctl).holders();
        self.within_budget_or(
            |_, e| e.drive == drive,
            |key, ex| {
                let mirror = res
                    .get(&key.volume)
                    .is_some_and(|r| !r.of_slab(key.slab).is_parity());
                mirror
                    && !self.opts.snapshots
                    && ex.iter().any(|e| {
                        e.drive != drive
                            && e.state != ExtentState::InSync
                            && holders.contains(&(key.volume, key.slab, e.drive))
                            && health.usable(key, e)
                    })
            },
        )
    }

    /// Puts a blank drive, formatted under a new id, in the place of each of `node`'s
    /// drives that is lost for good (the node is down), and publishes it as the node's
    /// start-up does. The lost drive's records stay; `replaced_on` has the node record the
    /// missing drive failed once it is up (`workload::report_failed_drives`).
    fn replace_lost_drives(self: &Arc<Self>, node: NodeId) {
        let lost = lock(&self.lost_drives).clone();
        let slab_bytes = self.opts.slab_blocks * BLOCK_SIZE as u64;
        let mut added = Vec::new();
        let mut errors = Vec::new();
        self.with_node(node, |n| {
            for d in n.drives.iter_mut().filter(|d| lost.contains(&d.id)) {
                let id = DriveId(d.id.0 + 1000);
                let image = FaultyFile::new(self.opts.drive_bytes);
                let live = image.reattach();
                let ident = DriveIdentity {
                    cluster: ClusterId(0x5157),
                    node,
                    drive: id,
                    slab_size_bytes: slab_bytes,
                    role: DriveRole::Capacity,
                    media: MediaType::Ram,
                };
                let opts = FormatOptions {
                    journal_bytes: Some(self.opts.journal_bytes),
                    ..Default::default()
                };
                match Drive::format_with(Arc::new(live.clone()), ident, opts) {
                    Ok(drive) => {
                        let extents_total = drive.capacity().extents_total;
                        added.push((d.id, id, extents_total));
                        *d = SimDrive {
                            id,
                            image,
                            live,
                            extents_total,
                            tier: None,
                        };
                    }
                    Err(e) => errors.push(format!("formatting the blank drive {id}: {e}")),
                }
            }
        });
        for e in errors {
            self.fail(format!("node {node}: {e}"));
        }
        for (old, new, extents_total) in added {
            lock(&self.ctl).add_drive(node, new, extents_total, slab_bytes);
            lock(&self.replaced_on).insert(node);
            self.count("blank drives in place of lost ones");
            self.trace(|| {
                format!("node {node}: blank drive {new} in the place of lost drive {old}")
            });
        }
    }

    /// What converged does at start-up and after its scrubs (`orphans::reclaim`): frees the
    /// extents on the node's drives that no slab record places there (copies rebuilt
    /// elsewhere while it was down or its drive had failed). Runs in one step, so no record
    /// can change meanwhile (the daemon condemns each candidate for that).
    pub(crate) fn reclaim_orphans(self: &Arc<Self>, id: NodeId) {
        let placed: BTreeSet<(DriveId, ExtentKey)> = lock(&self.ctl)
            .all()
            .into_iter()
            .flat_map(|((v, s), ex)| ex.into_iter().map(move |e| (e.drive, slab_key(v, s.0))))
            .collect();
        let tiers: Vec<(DriveId, Arc<Tier>)> = self
            .with_node(id, |n| {
                n.drives
                    .iter()
                    .filter_map(|d| d.tier.clone().map(|t| (d.id, t)))
                    .collect()
            })
            .unwrap_or_default();
        for (d, t) in tiers {
            for e in t.extents() {
                if placed.contains(&(d, e.key)) {
                    continue;
                }
                let r = converge_replica::execute(&t, ExtentOp::Free { key: e.key });
                self.count("orphan extents freed");
                self.trace(|| {
                    format!(
                        "node {id}: freed orphan extent {:?} on drive {d}: {r:?}",
                        e.key
                    )
                });
            }
        }
    }

    /// Whether the copies on `drive` could all be rebuilt elsewhere: each finds a drive on
    /// a node holding no copy of its slab (the repair policy's `rebuild_target`), counting
    /// the extents the records place and the ones rebuilt before it.
    fn room_to_rebuild(&self, drive: DriveId) -> bool {
        let records = lock(&self.ctl).all();
        let mut used: BTreeMap<DriveId, u64> = BTreeMap::new();
        for (_, ex) in &records {
            for e in ex {
                *used.entry(e.drive).or_default() += 1;
            }
        }
        let mut loads: Vec<DriveLoad> = lock(&self.nodes)
            .iter()
            .flat_map(|n| {
                n.drives.iter().map(|d| DriveLoad {
                    drive: d.id,
                    node: n.id,
                    extents_total: d.extents_total,
                    extents_used: used.get(&d.id).copied().unwrap_or(0),
                    slots_total: d.extents_total,
                    slots_used: used.get(&d.id).copied().unwrap_or(0),
                    live: d.id != drive,
                    role: DriveRole::Capacity,
                })
            })
            .collect();
        for (_, ex) in records
            .iter()
            .filter(|(_, ex)| ex.iter().any(|e| e.drive == drive))
        {
            match converge_allocator::repair::rebuild_target(ex, Some(drive), &loads) {
                Ok(t) => {
                    if let Some(l) = loads.iter_mut().find(|l| l.drive == t.drive) {
                        l.extents_used += 1;
                        l.slots_used += 1;
                    }
                }
                Err(_) => return false,
            }
        }
        true
    }

    /// Failed drives of nodes that are up, not yet recorded in the control plane, with
    /// the reason their engine gives.
    pub(crate) fn unreported_failures(&self) -> Vec<(NodeId, DriveId, String)> {
        let failed: Vec<(DriveId, NodeId)> = lock(&self.failed_drives)
            .iter()
            .map(|(d, n)| (*d, *n))
            .collect();
        let reported = lock(&self.failures_reported).clone();
        failed
            .into_iter()
            .filter(|(d, n)| !reported.contains(d) && self.is_up(*n))
            .filter_map(|(d, n)| {
                let reason = self.with_node(n, |node| {
                    node.drives
                        .iter()
                        .find(|x| x.id == d)
                        .and_then(|x| x.tier.as_ref())
                        .and_then(|t| t.failure())
                })??;
                Some((n, d, reason))
            })
            .collect()
    }

    /// Nodes that are up with a blank drive in the place of a lost one, not yet recorded,
    /// with the drives they opened.
    pub(crate) fn replaced_unreported(&self) -> Vec<(NodeId, Vec<DriveId>)> {
        let nodes = lock(&self.replaced_on).clone();
        nodes
            .into_iter()
            .filter(|n| self.is_up(*n))
            .filter_map(|n| {
                let present = self.with_node(n, |x| x.drives.iter().map(|d| d.id).collect())?;
                Some((n, present))
            })
            .collect()
    }

    /// Every up node's drives that wrote no journal batch since the last call checkpoint
    /// (`Drive::checkpoint_if_quiet`, as the daemon does every few seconds). An armed
    /// power loss may fire inside one: the node crashes, as for any engine write.
    pub(crate) fn checkpoint_quiet_drives(self: &Arc<Self>) {
        let nodes: Vec<NodeId> = lock(&self.nodes).iter().map(|n| n.id).collect();
        for id in nodes {
            let drives: Vec<Arc<Drive>> = self
                .with_node(id, |n| {
                    if !n.up {
                        return Vec::new();
                    }
                    n.drives
                        .iter()
                        .filter_map(|d| d.tier.as_ref().map(|t| t.drive().clone()))
                        .collect()
                })
                .unwrap_or_default();
            for d in drives {
                match d.checkpoint_if_quiet() {
                    Ok(true) => {
                        self.count("quiet checkpoints");
                        let drive = d.identity().drive;
                        self.trace(|| format!("node {id} drive {drive}: quiet checkpoint"));
                    }
                    Ok(false) => {}
                    Err(e) => {
                        let drive = d.identity().drive;
                        self.trace(|| {
                            format!("node {id} drive {drive}: quiet checkpoint failed: {e}")
                        });
                    }
                }
                if self.any_file_crashed(id) {
                    self.crash_node(id, "armed power loss fired inside a quiet checkpoint");
                    break;
                }
            }
        }
    }

    /// Flips one bit, at rest, in a written data block of some drive of `node` whose other
    /// copies read clean. Returns what it did.
    pub(crate) fn inject_rot(self: &Arc<Self>, node: NodeId) -> Option<String> {
        let seed = self.rng(|r| r.gen());
        let byte = self.rng(|r| r.gen_range(0..BLOCK_SIZE as u64));
        let bit = self.rng(|r| r.gen_range(0..8u8));
        let pick = self.rng(|r| r.gen::<usize>());
        let cands: Vec<(DriveId, Arc<Drive>, FaultyFile)> = self
            .with_node(node, |n| {
                if !n.up {
                    return Vec::new();
                }
                n.drives
                    .iter()
                    .filter_map(|d| {
                        d.tier
                            .as_ref()
                            .map(|t| (d.id, t.drive().clone(), d.image.clone()))
                    })
                    .collect()
            })
            .unwrap_or_default();
        if cands.is_empty() {
            return None;
        }
        let (drive, dr, image) = &cands[pick % cands.len()];
        let sample = dr.sample_data_blocks(1, seed);
        let blk = sample.blocks.first()?.clone();
        // Only a copy the control plane knows, and only if its slab keeps a healthy copy
        // (which then holds this block intact: rot is only counted per slab).
        if !self.opts.rot_sole_newest {
            // In-sync copies only disagree between an owner's death and the end of the next
            // reconcile; no rot on that volume meanwhile.
            let settled = lock(&self.vols).iter().any(|r| {
                r.id == blk.key.volume
                    && r.current.is_some()
                    && r.pending.is_none()
                    && !r.takeover_running
            });
            if !settled {
                return None;
            }
        }
        let extents = lock(&self.ctl).extents(blk.key.volume, blk.key.slab)?;
        let known = extents.iter().any(|e| e.drive == *drive);
        let target = (blk.key, *drive);
        if !known || !self.within_budget(|k, e| (k, e.drive) == target) {
            return None;
        }
        let parity_k = lock(&self.vols)
            .iter()
            .find(|r| r.id == blk.key.volume)
            .and_then(|r| match r.spec.resiliency.of_slab(blk.key.slab) {
                Resiliency::Parity { data, .. } => Some(usize::from(data)),
                _ => None,
            });
        if let Some(k) = parity_k {
            // A chunk's block is one row's: K other chunks, healthy, must hold that row
            // at this very version, so it still decodes (whatever `rot_sole_newest` says:
            // a row K chunks cannot give back is lost, not a takeover's problem).
            let off = u64::from(blk.block) * BLOCK_SIZE as u64;
            let key = blk.key;
            let health = self.health();
            let holders = extents
                .iter()
                .filter(|e| e.drive != *drive && health.healthy(key, e))
                .filter(|e| {
                    matches!(self.exec(e.node, e.drive, move |d| d.block_versions(key, off, 1)),
                        Delivery::Done(Ok(v)) if v.first() == Some(&blk.version))
                })
                .count();
            if holders < k {
                return None;
            }
        } else if !self.opts.rot_sole_newest {
            // Another healthy in-sync copy must hold this very version of the block (not
            // just an older one): see `Options::rot_sole_newest`. A block of a compressed
            // group shares its stream with the group's other members: the flipped bit may
            // damage any of them, so each must be held elsewhere too.
            let key = blk.key;
            let bad_nodes = self.impaired_nodes();
            // The versions of the stream's other members (a plain block: just its own, as
            // the sample says, with no drive call).
            let mine: Vec<converge_types::Version> = if blk.members.len() > 1 {
                let blocks_per_slab = self.opts.slab_blocks as usize;
                let Delivery::Done(Ok(v)) = self.exec(node, *drive, move |d| {
                    d.block_versions(key, 0, blocks_per_slab)
                }) else {
                    return None;
                };
                v
            } else {
                let mut v = vec![converge_types::Version(0); blk.block as usize + 1];
                v[blk.block as usize] = blk.version;
                v
            };
            for &member in &blk.members {
                let want = mine.get(member as usize).copied();
                let off = u64::from(member) * BLOCK_SIZE as u64;
                let shared = extents
                    .iter()
                    .filter(|e| {
                        e.drive != *drive
                            && e.state == ExtentState::InSync
                            && !bad_nodes.contains(&e.node)
                    })
                    .any(|e| {
                        matches!(self.exec(e.node, e.drive, move |d| d.block_versions(key, off, 1)),
                            Delivery::Done(Ok(v)) if v.first().copied() == want)
                    });
                if !shared {
                    return None;
                }
            }
        }
        image.rot(blk.offset_bytes + byte, bit);
        for &member in &blk.members {
            lock(&self.rots).push(Rot {
                node,
                drive: *drive,
                key: blk.key,
                block: member,
                version: if member == blk.block {
                    blk.version
                } else {
                    converge_types::Version(0)
                },
            });
        }
        self.count("rotted blocks");
        Some(format!(
            "node {node} drive {drive}: bit {bit} of byte {byte} ROTTED in vol {} slab {} block {} (version {})",
            blk.key.volume, blk.key.slab, blk.block, blk.version
        ))
    }

    /// Reads one whole copy directly from its node (no network), as a read through its
    /// tier sees it, or (`capacity_only`) from the capacity drive alone.
    pub(crate) fn read_copy_from(
        self: &Arc<Self>,
        node: NodeId,
        drive: DriveId,
        key: ExtentKey,
        blocks: u64,
        capacity_only: bool,
    ) -> Result<CopyImage, String> {
        let len = blocks as usize * BLOCK_SIZE;
        match self.exec(node, drive, move |t| {
            let mut buf = vec![0u8; len];
            let mut v = Vec::new();
            let info = if capacity_only {
                t.drive()
                    .read_blocks(key, Epoch(u64::MAX), 0, &mut buf, &mut v)?
            } else {
                t.read_blocks(key, Epoch(u64::MAX), 0, &mut buf, &mut v)?
            };
            // A suspect block (rolled back by the drive's recovery) is not yet judged:
            // the owner checks it against the other copies before serving it.
            let mut bad = info.bad_blocks;
            bad.extend(info.suspect);
            bad.sort_unstable();
            bad.dedup();
            Ok((buf, v, bad))
        }) {
            Delivery::Done(Ok(x)) => Ok(x),
            Delivery::Done(Err(e)) => Err(format!("node {node} drive {drive}: {e}")),
            Delivery::NoReply => Err(format!("node {node} is down")),
        }
    }

    /// Reads one whole copy directly from its node (no network), for the checkers.
    pub(crate) fn read_copy(
        self: &Arc<Self>,
        node: NodeId,
        drive: DriveId,
        key: ExtentKey,
        blocks: u64,
    ) -> Result<CopyImage, String> {
        self.read_copy_from(node, drive, key, blocks, false)
    }

    /// States of every copy per slab, from the control plane (the truth).
    /// Copies that slab records still place on a draining node, with their slab's copies.
    pub(crate) fn copies_on_draining_nodes(
        &self,
    ) -> Vec<((VolumeId, SlabIndex), ExtentLoc, Vec<ExtentLoc>)> {
        let ctl = lock(&self.ctl);
        let draining = ctl.draining();
        ctl.all()
            .into_iter()
            .flat_map(|(key, ex)| {
                ex.iter()
                    .filter(|e| draining.contains(&e.node))
                    .map(|e| (key, *e, ex.clone()))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    pub(crate) fn not_in_sync(&self) -> Vec<String> {
        lock(&self.ctl)
            .all()
            .into_iter()
            .flat_map(|((v, s), ex)| {
                ex.into_iter()
                    .filter(|e| e.state != ExtentState::InSync)
                    .map(move |e| {
                        format!(
                            "vol {v} slab {s} node {} drive {} {}",
                            e.node, e.drive, e.state
                        )
                    })
            })
            .collect()
    }
}

/// Copies of a slab laid out as `res` that must stay healthy: `min` (the run's
/// `healthy_copies_min`) of a mirror's; a parity slab's K chunks more than that, less one
/// (at most M of its K+M chunks impaired at once, by default: K are needed to read a row).
/// And whether the slab is a parity one.
fn healthy_needed(res: Resiliency, min: usize) -> (usize, bool) {
    (res.needed() + min - 1, res.is_parity())
}
