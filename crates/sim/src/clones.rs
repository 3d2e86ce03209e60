//! Variant `snapshot`, clones (docs/SIMULATION.md, "Clones"): a clone of the first
//! volume is made from one of its snapshots mid-run with the daemon's own control-plane
//! steps (the snapshot records the clone, then the clone's record with its parent link,
//! then the pin again), gets an owner by a takeover like any volume, has its own clients,
//! reads what it never wrote from its parent snapshot through the parent's current owner,
//! and may be flattened (copy, drop the link by compare-and-swap, unpin) — all among the
//! faults. Every read of it is judged with the parent snapshot as its initial state
//! (`History::set_base`).

use crate::control::SimKv;
use crate::history::Base;
use crate::owner::{volume_blocks, SnapRec};
use crate::world::{lock, World};
use bytes::{Bytes, BytesMut};
use converge_control::model::ParentRecord;
use converge_control::{Cluster, ControlError, VolumeRecord};
use converge_types::{Epoch, NodeId, BLOCK_SIZE};
use converge_volume::{ParentRead, VolumeError};
use rand::Rng;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

/// A clone in the run: its parent and snapshot, and how far its life has gone.
#[derive(Clone, Debug)]
pub(crate) struct CloneRt {
    pub parent: usize,
    pub snap: SnapRec,
    /// The record no longer links the parent (every block is the clone's own).
    pub flattened: bool,
    /// ... and the snapshot no longer records the clone.
    pub unpinned: bool,
}

/// Reads a clone's parent snapshot through the parent volume's current owner, as the
/// daemon's reader goes through the parent's export (on its owner).
struct SimParent {
    world: Arc<World>,
    /// The clone reading it, and its link as its owner opened it.
    clone: String,
    link: ParentRecord,
    parent: usize,
    name: String,
    epoch: Epoch,
    size_bytes: u64,
}

impl SimParent {
    async fn read_inner(&self, offset: u64, len: u64) -> Result<Bytes, VolumeError> {
        let w = &self.world;
        let err = |why: &str| {
            VolumeError::Control(
                format!("reading the parent snapshot {}: {why}", self.name),
                self.name.clone(),
            )
        };
        let end = (offset + len).min(self.size_bytes);
        let mut buf = BytesMut::with_capacity(len as usize);
        if offset < end {
            let o = lock(&w.vols)[self.parent]
                .current
                .clone()
                .filter(|o| o.alive())
                .ok_or_else(|| err("the parent has no owner"))?;
            let vol = o.vol.clone();
            let epoch = self.epoch;
            let h = o
                .spawn(async move { vol.read_at(epoch, offset, end - offset).await })
                .ok_or_else(|| err("the parent's owner died"))?;
            let data = h.await.map_err(|_| err("the parent's owner died"))??;
            buf.extend_from_slice(&data);
        }
        buf.resize(len as usize, 0);
        Ok(buf.freeze())
    }
}

impl SimParent {
    /// As the daemon's reader: a failed read of a parent the clone's record no longer
    /// links (flattened meanwhile) reads as zeros.
    async fn read_or_flattened(&self, offset: u64, len: u64) -> Result<Bytes, VolumeError> {
        let e = match self.read_inner(offset, len).await {
            Ok(b) => return Ok(b),
            Err(e) => e,
        };
        let linked = lock(&self.world.ctl)
            .volume_record(&self.clone)
            .and_then(|r| r.parent);
        if linked.as_ref() == Some(&self.link) {
            return Err(e);
        }
        self.world
            .count("clone parent reads after a flatten (zeros)");
        Ok(Bytes::from(vec![0u8; len as usize]))
    }
}

impl ParentRead for SimParent {
    fn read(
        &self,
        offset: u64,
        len: u64,
    ) -> Pin<Box<dyn Future<Output = Result<Bytes, VolumeError>> + Send + '_>> {
        Box::pin(self.read_or_flattened(offset, len))
    }

    fn name(&self) -> String {
        self.name.clone()
    }
}

/// The parent reader an owner of volume `name` gets from its record, as the daemon's owner
/// does when it opens a clone (None: not a clone, or flattened).
pub(crate) fn parent_of(w: &Arc<World>, name: &str) -> Option<Arc<dyn ParentRead>> {
    let p = lock(&w.ctl).volume_record(name)?.parent?;
    let parent = lock(&w.vols).iter().position(|r| r.name == p.volume)?;
    Some(Arc::new(SimParent {
        world: w.clone(),
        clone: name.to_string(),
        link: p.clone(),
        parent,
        name: format!("{}@{}", p.volume, p.snapshot),
        epoch: p.epoch,
        size_bytes: p.size_bytes,
    }))
}

fn cluster_on(w: &Arc<World>, node: NodeId) -> Cluster<SimKv> {
    Cluster::new(SimKv {
        world: w.clone(),
        node,
    })
}

/// A node the API request lands on (any that is up and reachable).
fn api_node(w: &Arc<World>) -> Option<NodeId> {
    let ready: Vec<NodeId> = w.node_ids().into_iter().filter(|&n| w.ready(n)).collect();
    (!ready.is_empty()).then(|| ready[w.rng(|r| r.gen_range(0..ready.len()))])
}

/// The life of clone volume `c`: made from a snapshot of its parent at a random moment,
/// then (in half of the runs) flattened at another.
pub(crate) async fn cloner(w: Arc<World>, c: usize) {
    let flatten = w.chance(0.5);
    while !w.stopping() {
        tokio::time::sleep(w.ms(30, 200)).await;
        let state = lock(&w.vols)[c].clone.clone();
        match state {
            None => create(&w, c).await,
            Some(cr) if !cr.flattened => {
                if flatten && w.chance(0.2) {
                    flatten_clone(&w, c, &cr).await;
                }
            }
            Some(cr) if !cr.unpinned => unpin(&w, c, &cr).await,
            Some(_) => {}
        }
    }
}

/// `POST /v1/volumes/PARENT/snapshots/SNAP/clone`, as the daemon runs it
/// (`crates/node/src/clones.rs`): pin, the clone's record, pin again.
async fn create(w: &Arc<World>, c: usize) {
    let (p, cname, id, spec) = {
        let vols = lock(&w.vols);
        let spec = vols[c].spec.clone();
        (
            spec.clone_of.expect("a clone volume"),
            vols[c].name.clone(),
            vols[c].id,
            spec,
        )
    };
    let (pname, live) = {
        let vols = lock(&w.vols);
        let live: Vec<SnapRec> = vols[p]
            .snaps
            .iter()
            .filter(|s| !s.deleting)
            .cloned()
            .collect();
        (vols[p].name.clone(), live)
    };
    if live.is_empty() {
        return;
    }
    let Some(node) = api_node(w) else { return };
    let s = live[w.rng(|r| r.gen_range(0..live.len()))].clone();
    let cluster = cluster_on(w, node);
    let pinned = match cluster.pin_clone(&pname, &s.name, &cname).await {
        Ok(Some(rec)) => rec,
        Ok(None) | Err(ControlError::Refused(_)) => {
            w.count("clone creations refused (snapshot gone or being deleted)");
            return;
        }
        Err(e) => {
            w.count("clone creations failed");
            w.trace(|| format!("vol{c}: clone of {pname}@{}: pin failed: {e}", s.name));
            return;
        }
    };
    let size_bytes = volume_blocks(w, &spec) * BLOCK_SIZE as u64;
    let rec = VolumeRecord {
        id,
        name: cname.clone(),
        size_bytes,
        resiliency: spec.resiliency,
        mirror_part_bytes: 0,
        min_replicas: spec.min_replicas,
        slab_size_bytes: w.opts.slab_blocks * BLOCK_SIZE as u64,
        owner: node,
        created_unix: 0,
        compression: spec.compression,
        encryption: None,
        qos: Default::default(),
        snapshots: Vec::new(),
        parent: Some(ParentRecord {
            volume: pname.clone(),
            snapshot: s.name.clone(),
            epoch: pinned.epoch,
            size_bytes,
        }),
        stray_floors: Vec::new(),
    };
    let created = cluster.create_volume(&rec).await;
    // Whatever the answer said (a lost one, or an earlier attempt's record), the record
    // says whether the clone exists and of which snapshot.
    let Some(truth) = lock(&w.ctl).volume_record(&cname) else {
        w.count("clone creations failed");
        w.trace(|| format!("vol{c}: creating the clone's record failed: {created:?}"));
        if let Err(e) = cluster.unpin_clone(&pname, &s.name, &cname).await {
            // Left for the snapshot's delete to prune.
            w.trace(|| format!("vol{c}: unpinning after a failed clone: {e}"));
        }
        return;
    };
    let link = truth
        .parent
        .clone()
        .expect("a clone record links its parent");
    // The pin again: a delete of the snapshot that pruned the pin as stale meanwhile (the
    // record did not exist yet) either sees the clone now, or has begun, and then the
    // clone must not stay. An unreachable etcd leaves the answer open: asked again.
    let again = loop {
        match cluster.pin_clone(&pname, &link.snapshot, &cname).await {
            Ok(r) => break Ok(r),
            Err(ControlError::Refused(m)) => break Err(m),
            Err(e) => {
                w.trace(|| format!("vol{c}: pinning again: {e}"));
                tokio::time::sleep(w.ms(10, 60)).await;
            }
        }
    };
    if !matches!(again, Ok(Some(_))) {
        w.count("clone creations undone (snapshot deleted meanwhile)");
        w.trace(|| {
            format!(
                "vol{c}: snapshot {} went meanwhile: {again:?}",
                link.snapshot
            )
        });
        while let Err(e) = cluster.delete_volume(&cname).await {
            w.trace(|| format!("vol{c}: deleting the clone's record: {e}"));
            tokio::time::sleep(w.ms(10, 60)).await;
        }
        return;
    }
    let Some(snap) = lock(&w.vols)[p]
        .snaps
        .iter()
        .find(|r| r.name == link.snapshot)
        .cloned()
    else {
        w.fail(format!(
            "vol{c}: clone of {pname}@{} created, but that snapshot is gone although it was pinned",
            link.snapshot
        ));
        return;
    };
    let tag = lock(&w.vols)[p].id.0;
    lock(&w.hist).set_base(
        c,
        Base {
            volume: p,
            tag,
            start: snap.start,
            end: snap.end,
        },
    );
    {
        let mut vols = lock(&w.vols);
        vols[c].clone = Some(CloneRt {
            parent: p,
            snap: snap.clone(),
            flattened: false,
            unpinned: false,
        });
        vols[c].dormant = false;
    }
    w.count("clones created");
    w.trace(|| {
        format!(
            "vol{c}: CLONE of {pname}@{} (epoch {}, ticks {}..{}) created",
            snap.name, snap.epoch, snap.start, snap.end
        )
    });
    // Its first owner claims it like any takeover: a new epoch, then it serves.
    crate::owner::start_takeover(w, c, Duration::ZERO);
}

/// `POST /v1/volumes/CLONE/flatten` on the clone's owner: copy what is still the
/// parent's, drop the link (compare-and-swap), stop reading the parent, unpin.
async fn flatten_clone(w: &Arc<World>, c: usize, cr: &CloneRt) {
    let Some(o) = lock(&w.vols)[c].current.clone().filter(|o| o.alive()) else {
        return;
    };
    let cname = lock(&w.vols)[c].name.clone();
    let vol = o.vol.clone();
    let r = match o.spawn(async move { vol.flatten().await }) {
        Some(h) => h.await.ok(),
        None => None,
    };
    match r {
        Some(Ok(bytes)) => w.trace(|| format!("vol{c}: flatten copied {bytes} bytes")),
        Some(Err(e)) => {
            w.count("clone flattens failed");
            w.trace(|| format!("vol{c}: flatten failed: {e}"));
            return;
        }
        None => {
            w.count("clone flattens aborted");
            return;
        }
    }
    let cluster = cluster_on(w, o.node);
    loop {
        let (mut rec, rev) = match cluster.volume(&cname).await {
            Ok(Some(x)) => x,
            Ok(None) => {
                w.fail(format!("vol{c}: the clone's record is gone"));
                return;
            }
            Err(e) => {
                w.trace(|| format!("vol{c}: flatten: reading the record: {e}"));
                break;
            }
        };
        if rec.parent.is_none() {
            break;
        }
        rec.parent = None;
        match cluster.update_volume(&rec, rev).await {
            Ok(true) => break,
            Ok(false) => continue,
            Err(e) => {
                w.trace(|| format!("vol{c}: flatten: dropping the link: {e}"));
                break;
            }
        }
    }
    let dropped = lock(&w.ctl)
        .volume_record(&cname)
        .is_some_and(|r| r.parent.is_none());
    if !dropped {
        w.count("clone flattens failed");
        return;
    }
    o.vol.set_parent(None);
    if let Some(cr) = lock(&w.vols)[c].clone.as_mut() {
        cr.flattened = true;
    }
    w.count("clones flattened");
    w.trace(|| format!("vol{c}: FLATTENED (no longer reads {})", cr.snap.name));
    unpin(w, c, cr).await;
}

async fn unpin(w: &Arc<World>, c: usize, cr: &CloneRt) {
    let Some(node) = api_node(w) else { return };
    let (pname, cname) = {
        let vols = lock(&w.vols);
        (vols[cr.parent].name.clone(), vols[c].name.clone())
    };
    match cluster_on(w, node)
        .unpin_clone(&pname, &cr.snap.name, &cname)
        .await
    {
        Ok(()) => {
            if let Some(cr) = lock(&w.vols)[c].clone.as_mut() {
                cr.unpinned = true;
            }
        }
        Err(e) => w.trace(|| format!("vol{c}: unpinning {pname}@{}: {e}", cr.snap.name)),
    }
}

/// Before a snapshot is deleted, as the daemon does (`prune_pins`): the clones it records
/// that no longer read it (flattened, or never created) are taken off, so only live ones
/// refuse the delete.
pub(crate) async fn prune_pins(
    cluster: &Cluster<SimKv>,
    name: &str,
    snap: &str,
) -> Result<(), ControlError> {
    let Some((rec, _)) = cluster.volume(name).await? else {
        return Ok(());
    };
    let Some(s) = rec.snapshots.iter().find(|s| s.name == snap) else {
        return Ok(());
    };
    for c in &s.clones {
        let live = match cluster.volume(c).await? {
            Some((v, _)) => v
                .parent
                .is_some_and(|p| p.volume == name && p.snapshot == snap),
            None => false,
        };
        if !live {
            cluster.unpin_clone(name, snap, c).await?;
        }
    }
    Ok(())
}
