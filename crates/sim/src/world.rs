//! The simulated cluster's physical state: nodes with their engine drives on
//! fault-injecting files, power loss and restart, bit rot, the network's mood (flaky, slow,
//! partitioned nodes), and the fault budget that keeps the run inside the fault model.
//!
//! Everything lives behind std mutexes in one `World` shared by every task. The runtime is
//! single-threaded, so the locks only satisfy `Send + Sync`; a lock is never held across
//! an `.await`, and never two at once except in the order nodes → ctl.

use crate::control::Ctl;
use crate::history::History;
use crate::owner::VolRt;
use crate::Options;
use converge_engine::{BlockFile, Drive, DriveIdentity, EngineError, FaultyFile, FormatOptions};
use converge_types::{
    ClusterId, DriveId, DriveRole, Epoch, ExtentKey, ExtentState, MediaType, NodeId, Version,
    BLOCK_SIZE,
};
use converge_volume::ExtentLoc;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
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
    /// None while the node is down (or if the drive failed to reopen).
    pub drive: Option<Arc<Drive>>,
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
}

/// One copy read whole: data, every block's version, and the blocks failing their crc.
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

pub struct World {
    pub(crate) opts: Options,
    rng: Mutex<StdRng>,
    t0: Instant,
    pub(crate) nodes: Mutex<Vec<Node>>,
    pub(crate) net: Mutex<Net>,
    pub(crate) ctl: Mutex<Ctl>,
    pub(crate) hist: Mutex<History>,
    pub(crate) rots: Mutex<Vec<Rot>>,
    pub(crate) vols: Mutex<Vec<VolRt>>,
    failures: Mutex<Vec<String>>,
    trace: Mutex<Trace>,
    /// Set when the fault phase is over: no new faults, clients stop.
    pub(crate) stopping: AtomicBool,
    pub(crate) stats: Mutex<BTreeMap<&'static str, u64>>,
    /// Nodes a recent fault may still make stale (a lost message, an ended partition or
    /// outage whose timeouts have not all been noticed yet), and until when.
    recently_hit: Mutex<BTreeMap<NodeId, Instant>>,
}

pub(crate) fn slab_key(volume: converge_types::VolumeId, slab: u64) -> ExtentKey {
    ExtentKey {
        volume,
        slab: converge_types::SlabIndex(slab),
    }
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
                    },
                )
                .map_err(|e| format!("formatting simulated drive {id}: {e}"))?;
                let extents_total = drive.capacity().extents_total;
                ctl.add_drive(NodeId(n), id, extents_total);
                drives.push(SimDrive {
                    id,
                    image,
                    live,
                    drive: Some(Arc::new(drive)),
                });
            }
            nodes.push(Node {
                id: NodeId(n),
                up: true,
                incarnation: 0,
                drives,
                isolated_until: None,
                armed: false,
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
            vols: Mutex::new(Vec::new()),
            failures: Mutex::new(Vec::new()),
            trace: Mutex::new(Trace {
                lines: 0,
                digest: 0xcbf2_9ce4_8422_2325,
                recent: VecDeque::new(),
            }),
            stopping: AtomicBool::new(false),
            stats: Mutex::new(BTreeMap::new()),
            recently_hit: Mutex::new(BTreeMap::new()),
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

    pub(crate) fn incarnation(&self, id: NodeId) -> u64 {
        self.with_node(id, |n| n.incarnation).unwrap_or(0)
    }

    pub(crate) fn reachable(&self, from: NodeId, to: NodeId) -> bool {
        from == to || (!self.isolated(from) && !self.isolated(to))
    }

    /// Runs one engine request on a node's drive, as that node's request handler would.
    /// A power loss armed on the drive may fire inside: the node is then down and no reply
    /// is ever sent.
    pub(crate) fn exec<T>(
        self: &Arc<Self>,
        node: NodeId,
        drive: DriveId,
        op: impl FnOnce(&Drive) -> Result<T, EngineError>,
    ) -> Delivery<T> {
        let got = self.with_node(node, |n| {
            if !n.up {
                return None;
            }
            Some(match n.drives.iter().find(|d| d.id == drive) {
                None => Err(EngineError::InvalidArgument(format!(
                    "node {node} has no drive {drive}"
                ))),
                Some(d) => match &d.drive {
                    Some(dr) => Ok((dr.clone(), d.live.clone())),
                    None => Err(EngineError::Failed {
                        reason: format!("drive {drive} did not reopen after the last crash"),
                    }),
                },
            })
        });
        let (d, live) = match got.flatten() {
            None => return Delivery::NoReply,
            Some(Err(e)) => return Delivery::Done(Err(e)),
            Some(Ok(x)) => x,
        };
        let r = op(&d);
        drop(d);
        if live.crashed() {
            self.crash_node(node, "armed power loss fired inside an engine write");
            return Delivery::NoReply;
        }
        Delivery::Done(r)
    }

    /// Power loss on a whole node: every drive loses or tears its unsynced writes, the
    /// daemon (and any volume owner on it) is gone, and it reboots after a while.
    pub(crate) fn crash_node(self: &Arc<Self>, id: NodeId, why: &str) {
        let seeds: Vec<u64> = (0..4).map(|_| self.rng(|r| r.gen())).collect();
        let crashed = self
            .with_node(id, |n| {
                if !n.up {
                    return false;
                }
                n.up = false;
                n.armed = false;
                n.incarnation += 1;
                for (i, d) in n.drives.iter_mut().enumerate() {
                    d.image.crash(seeds[i % seeds.len()]);
                    d.drive = None;
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

    /// Reboot: every drive is reopened from what survived (journal replay and recovery).
    pub(crate) fn restart_node(self: &Arc<Self>, id: NodeId) {
        let mut errors = Vec::new();
        let restarted = self
            .with_node(id, |n| {
                if n.up {
                    return false;
                }
                for d in n.drives.iter_mut() {
                    let live = d.image.reattach();
                    let file: Arc<dyn BlockFile> = Arc::new(live.clone());
                    match Drive::open(file) {
                        Ok(dr) => {
                            d.drive = Some(Arc::new(dr));
                            d.live = live;
                        }
                        Err(e) => {
                            errors.push(format!(
                                "engine could not recover drive {} of node {id} after power loss: {e}",
                                d.id
                            ));
                            d.drive = None;
                            d.live = live;
                        }
                    }
                }
                n.up = true;
                n.incarnation += 1;
                true
            })
            .unwrap_or(false);
        if restarted {
            self.hit(id, Instant::now());
            self.trace(|| format!("node {id} restarted, drives reopened"));
            self.find_torn_blocks(id);
        }
        for e in errors {
            self.fail(e);
        }
    }

    /// Blocks that recovery reports bad after a power loss (a torn write) are corruption,
    /// like rot: they count against the fault budget until repaired or rewritten.
    fn find_torn_blocks(self: &Arc<Self>, id: NodeId) {
        let blocks = self.opts.slab_blocks;
        let drives: Vec<(DriveId, Vec<ExtentKey>)> = self
            .with_node(id, |n| {
                n.drives
                    .iter()
                    .filter_map(|d| {
                        d.drive
                            .as_ref()
                            .map(|dr| (d.id, dr.extents().into_iter().map(|e| e.key).collect()))
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
                    self.count("torn blocks found after power loss");
                    self.trace(|| {
                        format!("node {id} drive {drive}: vol {} slab {} block {block} reads bad after recovery (torn)", key.volume, key.slab)
                    });
                    lock(&self.rots).push(Rot {
                        node: id,
                        drive,
                        key,
                        block,
                    });
                }
            }
        }
    }

    /// Arms a power loss inside one of the node's next engine writes (mid-write: data
    /// written, journal not yet synced, or mid-checkpoint), so recovery sees lost and torn
    /// unsynced writes. Falls back to an immediate power cut if nothing writes there soon.
    pub(crate) fn arm_crash(self: &Arc<Self>, id: NodeId) -> bool {
        let writes = self.rng(|r| r.gen_range(1..=6u64));
        let seed = self.rng(|r| r.gen());
        let pick = self.rng(|r| r.gen::<usize>());
        let armed = self
            .with_node(id, |n| {
                if !n.up || n.armed {
                    return None;
                }
                let live: Vec<&SimDrive> = n.drives.iter().filter(|d| d.drive.is_some()).collect();
                if live.is_empty() {
                    return None;
                }
                let d = live[pick % live.len()];
                d.live.crash_after_writes(writes, seed);
                let inc = n.incarnation;
                let drive = d.id;
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
        let keep: Vec<Rot> = rots.into_iter().filter(|r| self.still_rotten(r)).collect();
        *lock(&self.rots) = keep.clone();
        keep
    }

    /// May a fault now hit the copies `hit` selects (on top of what is impaired already)?
    /// Every slab must keep at least one copy that is in sync, on a healthy node and free
    /// of rot: with none, no copy could ever be brought back in sync (the volume has no
    /// way out of that; see docs/SIMULATION.md), so the fault model stops short of it.
    fn within_budget(self: &Arc<Self>, hit: impl Fn(ExtentKey, &ExtentLoc) -> bool) -> bool {
        let bad_nodes = self.impaired_nodes();
        let rots = self.live_rots();
        let records = lock(&self.ctl).all();
        records.iter().all(|((v, s), extents)| {
            let key = ExtentKey {
                volume: *v,
                slab: *s,
            };
            if !extents.iter().any(|e| hit(key, e)) {
                return true;
            }
            let healthy = extents
                .iter()
                .filter(|e| {
                    !hit(key, e)
                        && e.state == ExtentState::InSync
                        && !bad_nodes.contains(&e.node)
                        && !rots.iter().any(|r| r.drive == e.drive && r.key == key)
                })
                .count();
            healthy >= self.opts.healthy_copies_min
        })
    }

    /// May a fault hit every copy on `node` (power loss, partition, lost messages)?
    pub(crate) fn may_impair(self: &Arc<Self>, node: NodeId) -> bool {
        self.within_budget(|_, e| e.node == node)
    }

    fn still_rotten(self: &Arc<Self>, r: &Rot) -> bool {
        let key = r.key;
        let off = u64::from(r.block) * BLOCK_SIZE as u64;
        match self.exec(r.node, r.drive, move |d| {
            let mut buf = vec![0u8; BLOCK_SIZE];
            let mut v = Vec::new();
            d.read_blocks(key, Epoch(u64::MAX), off, &mut buf, &mut v)
        }) {
            Delivery::Done(Ok(info)) => !info.bad_blocks.is_empty(),
            // Down or failing: assume still rotten until it can be checked.
            _ => true,
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
                    .filter_map(|d| d.drive.clone().map(|dr| (d.id, dr, d.image.clone())))
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
        if !self.opts.rot_sole_newest {
            // Another healthy in-sync copy must hold this very version of the block (not
            // just an older one): see `Options::rot_sole_newest`.
            let off = u64::from(blk.block) * BLOCK_SIZE as u64;
            let key = blk.key;
            let bad_nodes = self.impaired_nodes();
            let shared = extents
                .iter()
                .filter(|e| {
                    e.drive != *drive
                        && e.state == ExtentState::InSync
                        && !bad_nodes.contains(&e.node)
                })
                .any(|e| {
                    matches!(self.exec(e.node, e.drive, move |d| d.block_versions(key, off, 1)),
                        Delivery::Done(Ok(v)) if v.first() == Some(&blk.version))
                });
            if !shared {
                return None;
            }
        }
        image.rot(blk.offset_bytes + byte, bit);
        lock(&self.rots).push(Rot {
            node,
            drive: *drive,
            key: blk.key,
            block: blk.block,
        });
        self.count("rotted blocks");
        Some(format!(
            "node {node} drive {drive}: bit {bit} of byte {byte} ROTTED in vol {} slab {} block {} (version {})",
            blk.key.volume, blk.key.slab, blk.block, blk.version
        ))
    }

    /// Reads one whole copy directly from its drive (no network), for the final compare.
    pub(crate) fn read_copy(
        self: &Arc<Self>,
        node: NodeId,
        drive: DriveId,
        key: ExtentKey,
        blocks: u64,
    ) -> Result<CopyImage, String> {
        let len = blocks as usize * BLOCK_SIZE;
        match self.exec(node, drive, move |d| {
            let mut buf = vec![0u8; len];
            let mut v = Vec::new();
            let info = d.read_blocks(key, Epoch(u64::MAX), 0, &mut buf, &mut v)?;
            Ok((buf, v, info.bad_blocks))
        }) {
            Delivery::Done(Ok(x)) => Ok(x),
            Delivery::Done(Err(e)) => Err(format!("node {node} drive {drive}: {e}")),
            Delivery::NoReply => Err(format!("node {node} is down")),
        }
    }

    /// States of every copy per slab, from the control plane (the truth).
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
