//! Volume owners and their lives: a `Volume` per term built from the control plane's
//! records, every I/O it serves run as an abortable task, death with its node, deposition
//! (it keeps running as a zombie that fencing must stop), and takeover by a new owner at a
//! higher epoch that reconciles the copies before serving.

use crate::control::SimKv;
use crate::replicas::SimReplicas;
use crate::world::{lock, World};
use crate::VolumeSpec;
use converge_allocator::Allocator;
use converge_control::Cluster;
use converge_types::{Epoch, NodeId, VolumeId, BLOCK_SIZE};
use converge_volume::{Volume, VolumeConfig};
use rand::Rng;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::{AbortHandle, JoinHandle};

/// An owner in the simulation: the production owner logic and control-plane glue, over
/// the simulated network and etcd.
pub type SimVolume = Volume<SimReplicas, Allocator<SimKv>>;

pub(crate) struct Owner {
    pub vol: Arc<SimVolume>,
    pub node: NodeId,
    pub epoch: Epoch,
    tasks: Mutex<Vec<AbortHandle>>,
    alive: AtomicBool,
    /// Tick at which a newer owner finished taking over (0: not superseded).
    superseded_at: AtomicU64,
}

impl Owner {
    pub fn alive(&self) -> bool {
        self.alive.load(Ordering::Relaxed)
    }

    pub fn superseded_at(&self) -> Option<u64> {
        match self.superseded_at.load(Ordering::Relaxed) {
            0 => None,
            t => Some(t),
        }
    }

    /// Runs `f` as one of this owner's tasks (aborted if the owner dies). None if dead.
    pub fn spawn<T: Send + 'static>(
        &self,
        f: impl Future<Output = T> + Send + 'static,
    ) -> Option<JoinHandle<T>> {
        if !self.alive() {
            return None;
        }
        let h = tokio::spawn(f);
        let mut t = lock(&self.tasks);
        t.retain(|a| !a.is_finished());
        t.push(h.abort_handle());
        Some(h)
    }

    /// The owner's process is gone: every I/O it was serving stops where it was.
    pub fn kill(&self) {
        self.alive.store(false, Ordering::Relaxed);
        let tasks: Vec<AbortHandle> = lock(&self.tasks).drain(..).collect();
        for a in tasks {
            a.abort();
        }
    }
}

/// Per-volume runtime state.
pub(crate) struct VolRt {
    pub spec: VolumeSpec,
    pub id: VolumeId,
    pub name: String,
    /// The owner clients are sent to (None during a takeover).
    pub current: Option<Arc<Owner>>,
    /// Deposed owners still running (their clients have not noticed yet).
    pub zombies: Vec<Arc<Owner>>,
    /// The owner being built by a takeover (killed if its node dies).
    pub pending: Option<Arc<Owner>>,
    pub takeover_running: bool,
    /// Why the last takeover attempt failed (for liveness reports).
    pub last_takeover_error: Option<String>,
    /// Per client: a zombie it is still attached to.
    pub pins: Vec<Option<Arc<Owner>>>,
    /// Snapshots taken (variant `snapshot`), with the logical window they were taken in.
    pub snaps: Vec<SnapRec>,
    /// A clone not created yet: no record, no owner, its clients wait.
    pub dormant: bool,
    /// A clone that was created (variant `snapshot`).
    pub clone: Option<crate::clones::CloneRt>,
    /// Snapshots the final check could not read whole (a preserved block rotted on the
    /// one copy that held it: docs/SNAPSHOTS.md, "Limits").
    pub snaps_refused: Vec<String>,
}

/// A snapshot the snapshotter took: its epoch and the history ticks it was taken between
/// (a snapshot reads like a read over that window: docs/SIMULATION.md, "Snapshots").
#[derive(Clone, Debug)]
pub(crate) struct SnapRec {
    pub name: String,
    pub epoch: Epoch,
    pub start: u64,
    pub end: u64,
    /// A delete was asked (reads stop; a retry finishes it).
    pub deleting: bool,
}

/// Volume blocks one slab of `spec` holds: the extent's blocks, times K for a parity
/// slab (`Resiliency::slab_span`).
pub(crate) fn span_blocks(w: &World, spec: &VolumeSpec) -> u64 {
    spec.resiliency.slab_span(w.opts.slab_blocks)
}

pub(crate) fn volume_blocks(w: &World, spec: &VolumeSpec) -> u64 {
    spec.slabs * span_blocks(w, spec)
}

fn build_owner(w: &Arc<World>, v: usize, node: NodeId, epoch: Epoch) -> Arc<Owner> {
    let (spec, id, name, slabs) = {
        let vols = lock(&w.vols);
        let r = &vols[v];
        let slabs = lock(&w.ctl).slabs_of(r.id);
        (r.spec.clone(), r.id, r.name.clone(), slabs)
    };
    let cfg = VolumeConfig {
        id,
        name: name.clone(),
        size_bytes: volume_blocks(w, &spec) * BLOCK_SIZE as u64,
        slab_size_bytes: w.opts.slab_blocks * BLOCK_SIZE as u64,
        resiliency: spec.resiliency,
        mirror_part_bytes: spec.mirror_part_extents * w.opts.slab_blocks * BLOCK_SIZE as u64,
        epoch,
        local_node: node,
        min_replicas: spec.min_replicas,
        degraded_write_wait: w.opts.degraded_write_wait,
        read_wait: w.opts.read_wait,
        read_hedge: w.opts.read_hedge,
        // Owners here are deposed by the nemesis (zombies), not by time.
        tenure: Arc::new(converge_volume::Tenure::unbounded()),
        compression: spec.compression,
        cipher: None,
        qos: converge_types::Qos::default(),
        gate: None,
    };
    let io = Arc::new(SimReplicas {
        world: w.clone(),
        from: node,
    });
    let ctl = Arc::new(Allocator::new(
        Cluster::new(SimKv {
            world: w.clone(),
            node,
        }),
        node,
        w.opts.locality_pct,
    ));
    let vol = Arc::new(Volume::new(cfg, slabs, io, ctl));
    // As the daemon does when it takes a volume: the snapshots its record lists.
    vol.set_snapshots(lock(&w.ctl).snapshot_epochs(&name));
    // ... and the parent snapshot its record links, if it is a clone.
    vol.set_parent(crate::clones::parent_of(w, &name));
    Arc::new(Owner {
        vol,
        node,
        epoch,
        tasks: Mutex::new(Vec::new()),
        alive: AtomicBool::new(true),
        superseded_at: AtomicU64::new(0),
    })
}

/// The first owner of a fresh volume (nothing to reconcile).
pub(crate) fn first_owner(w: &Arc<World>, v: usize) {
    let nodes = w.node_ids();
    let node = nodes[w.rng(|r| r.gen_range(0..nodes.len()))];
    let id = lock(&w.vols)[v].id;
    let epoch = lock(&w.ctl).first_claim(id, node);
    let o = build_owner(w, v, node, epoch);
    w.trace(|| format!("vol{v}: owner on node {node} at epoch {epoch}"));
    lock(&w.vols)[v].current = Some(o);
}

/// A node lost power: owners running there die with it.
pub(crate) fn node_died(w: &Arc<World>, node: NodeId) {
    let mut takeovers = Vec::new();
    {
        let mut vols = lock(&w.vols);
        for (v, r) in vols.iter_mut().enumerate() {
            if let Some(o) = r.current.take_if(|o| o.node == node) {
                o.kill();
                takeovers.push((v, o.epoch));
            }
            if let Some(o) = r.pending.take_if(|o| o.node == node) {
                o.kill();
            }
            r.zombies.retain(|z| {
                if z.node == node {
                    z.kill();
                }
                z.node != node
            });
        }
    }
    for (v, e) in takeovers {
        w.trace(|| format!("vol{v}: owner at epoch {e} died with node {node}"));
        start_takeover(w, v, w.opts.lease_ttl);
    }
}

/// Takeovers being run by `node` are abandoned (their owner is killed; the takeover loop
/// retries on another node).
pub(crate) fn abandon_pending_on(w: &Arc<World>, node: NodeId) {
    let pending: Vec<(usize, Arc<Owner>)> = lock(&w.vols)
        .iter_mut()
        .enumerate()
        .filter_map(|(v, r)| r.pending.take_if(|o| o.node == node).map(|o| (v, o)))
        .collect();
    for (v, o) in pending {
        o.kill();
        w.trace(|| {
            format!(
                "vol{v}: takeover at epoch {} on node {node} abandoned (cut off)",
                o.epoch
            )
        });
    }
}

/// Is `o` the owner clients are sent to now?
pub(crate) fn is_current(w: &World, v: usize, o: &Arc<Owner>) -> bool {
    lock(&w.vols)[v]
        .current
        .as_ref()
        .is_some_and(|c| Arc::ptr_eq(c, o))
}

/// The current owner's process dies (node stays up).
pub(crate) fn crash_owner(w: &Arc<World>, v: usize) -> bool {
    let o = lock(&w.vols)[v].current.take();
    let Some(o) = o else { return false };
    o.kill();
    w.count("owner crashes");
    w.trace(|| {
        format!(
            "vol{v}: owner on node {} at epoch {} CRASHED",
            o.node, o.epoch
        )
    });
    let delay = w.ms(0, w.opts.lease_ttl.as_millis() as u64);
    start_takeover(w, v, delay);
    true
}

/// The current owner loses its lease without knowing (paused, or cut off from etcd): a new
/// owner takes over while the old one keeps serving some clients for a while.
pub(crate) fn depose_owner(w: &Arc<World>, v: usize, delay: Duration) -> bool {
    let life = w.ms(w.opts.zombie_life_ms.0, w.opts.zombie_life_ms.1);
    let pins: Vec<bool> = {
        let n = lock(&w.vols)[v].pins.len();
        (0..n).map(|_| w.chance(0.5)).collect()
    };
    let o = {
        let mut vols = lock(&w.vols);
        let r = &mut vols[v];
        let Some(o) = r.current.take() else {
            return false;
        };
        r.zombies.push(o.clone());
        for (p, pin) in r.pins.iter_mut().zip(pins) {
            if pin {
                *p = Some(o.clone());
            }
        }
        o
    };
    w.count("owners deposed");
    w.trace(|| {
        format!(
            "vol{v}: owner on node {} at epoch {} DEPOSED (keeps running as a zombie for {life:?})",
            o.node, o.epoch
        )
    });
    start_takeover(w, v, delay);
    let w2 = w.clone();
    tokio::spawn(async move {
        tokio::time::sleep(delay + life).await;
        kill_zombie(&w2, v, &o);
    });
    true
}

pub(crate) fn kill_zombie(w: &Arc<World>, v: usize, o: &Arc<Owner>) {
    let mut vols = lock(&w.vols);
    let r = &mut vols[v];
    r.zombies.retain(|z| !Arc::ptr_eq(z, o));
    for p in r.pins.iter_mut() {
        if p.as_ref().is_some_and(|z| Arc::ptr_eq(z, o)) {
            *p = None;
        }
    }
    drop(vols);
    if o.alive() {
        o.kill();
        w.trace(|| format!("vol{v}: zombie owner at epoch {} stopped", o.epoch));
    }
}

pub(crate) fn start_takeover(w: &Arc<World>, v: usize, delay: Duration) {
    {
        let mut vols = lock(&w.vols);
        if vols[v].takeover_running {
            return;
        }
        vols[v].takeover_running = true;
    }
    let w = w.clone();
    tokio::spawn(async move {
        tokio::time::sleep(delay).await;
        takeover(&w, v).await;
        lock(&w.vols)[v].takeover_running = false;
    });
}

/// A node claims the volume: new epoch, slab records, `reconcile` (fences every copy and
/// makes in-sync copies agree), then serves. Retries until it succeeds.
async fn takeover(w: &Arc<World>, v: usize) {
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        let ready: Vec<NodeId> = w.node_ids().into_iter().filter(|&n| w.ready(n)).collect();
        if ready.is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        let node = ready[w.rng(|r| r.gen_range(0..ready.len()))];
        let id = lock(&w.vols)[v].id;
        // The previous term's lease is gone (that is why there is a takeover), and so is
        // its owner record; the node claims the volume with the daemon's own transaction.
        lock(&w.ctl).expire_owner(id);
        let cluster = Cluster::new(SimKv {
            world: w.clone(),
            node,
        });
        let epoch = match cluster
            .claim_ownership(id, node, crate::control::lease_of(node))
            .await
        {
            Ok(e) => e,
            Err(e) => {
                w.trace(|| format!("vol{v}: claim by node {node} failed: {e}"));
                tokio::time::sleep(w.ms(10, 60)).await;
                continue;
            }
        };
        if !w.ready(node) {
            continue;
        }
        let o = build_owner(w, v, node, epoch);
        lock(&w.vols)[v].pending = Some(o.clone());
        w.trace(|| {
            format!(
                "vol{v}: TAKEOVER by node {node} at epoch {epoch} (attempt {attempt}): reconciling"
            )
        });
        let vol = o.vol.clone();
        let r = match o.spawn(async move { vol.reconcile().await }) {
            Some(h) => h.await.ok(),
            None => None,
        };
        let installed = {
            let mut vols = lock(&w.vols);
            let still_pending = vols[v].pending.as_ref().is_some_and(|p| Arc::ptr_eq(p, &o));
            if still_pending {
                vols[v].pending = None;
            }
            match &r {
                Some(Ok(_)) if still_pending && o.alive() => {
                    vols[v].last_takeover_error = None;
                    let tick = lock(&w.hist).tick();
                    for z in &vols[v].zombies {
                        if z.superseded_at().is_none() {
                            z.superseded_at.store(tick, Ordering::Relaxed);
                        }
                    }
                    vols[v].current = Some(o.clone());
                    Some(tick)
                }
                _ => None,
            }
        };
        match (installed, r) {
            (Some(tick), Some(Ok(rep))) => {
                w.count("takeovers");
                if lock(&w.vols)[v].spec.resiliency.is_parity() {
                    *lock(&w.stats)
                        .entry("parity rows made to agree by takeovers")
                        .or_insert(0) += rep.blocks_differing;
                }
                crate::check_agree(w, id, epoch);
                w.trace(|| {
                    format!(
                        "vol{v}: node {node} SERVES at epoch {epoch} (tick {tick}; reconcile compared {} blocks, {} differed, {} rewritten)",
                        rep.blocks_compared, rep.blocks_differing, rep.blocks_written
                    )
                });
                // As the daemon does once it serves a volume it took: beside serving, so a
                // takeover is over (another may start) whatever the release waits for.
                spawn_release(w, v, &o);
                return;
            }
            (_, other) => {
                o.kill();
                if let Some(Err(e)) = &other {
                    lock(&w.vols)[v].last_takeover_error = Some(e.to_string());
                }
                w.trace(|| match other {
                    Some(Err(e)) => format!("vol{v}: takeover at epoch {epoch} failed: {e}"),
                    _ => format!("vol{v}: takeover at epoch {epoch} cut short (node died)"),
                });
                tokio::time::sleep(w.ms(10, 60)).await;
            }
        }
    }
}

/// The release a new owner runs beside serving (the daemon spawns it too).
fn spawn_release(w: &Arc<World>, v: usize, o: &Arc<Owner>) {
    w.releases_running.fetch_add(1, Ordering::SeqCst);
    let (w, o) = (w.clone(), o.clone());
    tokio::spawn(async move {
        release_stray_floors(&w, v, &o).await;
        w.releases_running.fetch_sub(1, Ordering::SeqCst);
    });
}

/// What the daemon does once it serves a volume it took, and after a snapshot that failed
/// while its owner serves on: the floors that snapshots begun and never recorded left on
/// the copies are released (`converge_allocator::snapshots::release_stray_floors`).
pub(crate) async fn release_stray_floors(w: &Arc<World>, v: usize, o: &Arc<Owner>) {
    let cluster = Cluster::new(SimKv {
        world: w.clone(),
        node: o.node,
    });
    let vol = o.vol.clone();
    // A volume whose record lists none is left alone without a read through the
    // simulated etcd (its latency would shift every run that has no snapshots); one that
    // lists some is released as the daemon does, reading the record again.
    let listed = lock(&w.ctl)
        .volume_record(&vol.config().name)
        .is_some_and(|r| !r.stray_floors.is_empty());
    if !listed {
        return;
    }
    let r = match o.spawn(async move {
        converge_allocator::snapshots::release_stray_floors(&cluster, &vol).await
    }) {
        Some(h) => h.await.ok(),
        None => None,
    };
    match r {
        Some(Ok(released)) => {
            let strays = released.len() as u64;
            if strays > 0 {
                *lock(&w.stats)
                    .entry("stray snapshot floors released")
                    .or_insert(0) += strays;
                w.trace(|| {
                    format!("vol{v}: floors of snapshots never recorded released: {released:?}")
                });
            }
        }
        Some(Err(e)) => w.trace(|| format!("vol{v}: releasing stray floors: {e}")),
        None => {}
    }
}
