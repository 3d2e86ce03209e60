//! The simulated control plane: an in-memory "etcd" holding each slab's record (its copies
//! and their states, with a revision), each volume's ownership epoch, and drive usage for
//! placement. Owners reach it through [`OwnerControl`], their `SlabAllocator`: every call
//! is a round trip with latency, fails when the owner's node is partitioned, and changes a
//! record only by compare-and-swap on its revision.

use crate::world::{lock, World};
use converge_types::{DriveId, Epoch, ExtentState, NodeId, SlabIndex, VolumeId};
use converge_volume::{ExtentLoc, SlabAllocator, SlabChange, VolumeError};
use rand::Rng;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// How many times a compare-and-swap is retried against concurrent changers.
const CAS_RETRIES_MAX: usize = 16;

#[derive(Default)]
pub(crate) struct Ctl {
    /// (volume, slab) -> (copies, revision).
    slabs: BTreeMap<(VolumeId, SlabIndex), (Vec<ExtentLoc>, u64)>,
    epochs: BTreeMap<VolumeId, Epoch>,
    /// drive -> (node, extents total, extents placed).
    drives: BTreeMap<DriveId, (NodeId, u64, u64)>,
}

impl Ctl {
    pub(crate) fn add_drive(&mut self, node: NodeId, drive: DriveId, extents_total: u64) {
        self.drives.insert(drive, (node, extents_total, 0));
    }

    pub(crate) fn extents(&self, v: VolumeId, s: SlabIndex) -> Option<Vec<ExtentLoc>> {
        self.slabs.get(&(v, s)).map(|(e, _)| e.clone())
    }

    pub(crate) fn slabs_of(&self, v: VolumeId) -> BTreeMap<SlabIndex, Vec<ExtentLoc>> {
        self.slabs
            .iter()
            .filter(|((vv, _), _)| *vv == v)
            .map(|((_, s), (e, _))| (*s, e.clone()))
            .collect()
    }

    pub(crate) fn all(&self) -> Vec<((VolumeId, SlabIndex), Vec<ExtentLoc>)> {
        self.slabs
            .iter()
            .map(|(k, (e, _))| (*k, e.clone()))
            .collect()
    }

    pub(crate) fn epoch(&self, v: VolumeId) -> Epoch {
        self.epochs.get(&v).copied().unwrap_or(Epoch(0))
    }

    /// A new ownership term (the etcd transaction a claiming node runs).
    pub(crate) fn bump_epoch(&mut self, v: VolumeId) -> Epoch {
        let e = self.epochs.entry(v).or_insert(Epoch(0));
        e.0 += 1;
        *e
    }
}

/// One owner's handle on the control plane (its node, its term).
pub struct OwnerControl {
    pub(crate) world: Arc<World>,
    pub(crate) node: NodeId,
    pub(crate) epoch: Epoch,
    pub(crate) name: String,
}

impl OwnerControl {
    /// One round trip to etcd: latency, and failure if this node is cut off (or, when the
    /// control plane fences deposed owners, if a newer term exists).
    async fn round_trip(&self, volume: VolumeId) -> Result<(), VolumeError> {
        let w = &self.world;
        tokio::time::sleep(w.us(50, 800)).await;
        if w.isolated(self.node) {
            tokio::time::sleep(w.opts.rpc_timeout).await;
            return Err(VolumeError::Control(
                format!("etcd unreachable from node {} (partitioned)", self.node),
                self.name.clone(),
            ));
        }
        if w.opts.control_fences_deposed_owners {
            let current = lock(&w.ctl).epoch(volume);
            if current != self.epoch {
                return Err(VolumeError::Fenced {
                    volume: self.name.clone(),
                    epoch: self.epoch,
                    why: format!("the control plane is at epoch {current}"),
                });
            }
        }
        Ok(())
    }
}

impl SlabAllocator for OwnerControl {
    async fn allocate(
        &self,
        volume: VolumeId,
        slab: SlabIndex,
        _epoch: Epoch,
        copies: usize,
    ) -> Result<Vec<ExtentLoc>, VolumeError> {
        self.round_trip(volume).await?;
        let w = &self.world;
        // Placement sees the nodes whose leases are alive (up and reachable).
        let live: BTreeSet<NodeId> = w.node_ids().into_iter().filter(|&n| w.ready(n)).collect();
        // Healthy nodes first (as a placement that avoids failing nodes would).
        let impaired = w.impaired_nodes();
        let tiebreak: u64 = w.rng(|r| r.gen());
        let placed = {
            let mut ctl = lock(&w.ctl);
            if let Some((e, _)) = ctl.slabs.get(&(volume, slab)) {
                return Ok(e.clone()); // create-if-absent: a concurrent allocator won
            }
            // Least-used drive per node, then the least-used nodes, ties broken by the run's
            // randomness.
            let mut best: BTreeMap<NodeId, (u64, u64, DriveId)> = BTreeMap::new();
            for (&d, &(n, total, used)) in &ctl.drives {
                if !live.contains(&n) || used >= total {
                    continue;
                }
                let k = (
                    u64::from(impaired.contains(&n)) << 40 | used,
                    (d.0 ^ tiebreak).rotate_left(17),
                    d,
                );
                let slot = best.entry(n).or_insert(k);
                if k < *slot {
                    *slot = k;
                }
            }
            let mut nodes: Vec<(u64, u64, DriveId, NodeId)> = best
                .into_iter()
                .map(|(n, (u, t, d))| (u, (u64::from(n.0) ^ tiebreak).rotate_left(5) ^ t, d, n))
                .collect();
            nodes.sort();
            if nodes.len() < copies {
                return Err(VolumeError::NoSpace {
                    volume: self.name.clone(),
                    why: format!(
                        "{copies} copies need distinct live nodes with room, {} have",
                        nodes.len()
                    ),
                });
            }
            let ex: Vec<ExtentLoc> = nodes[..copies]
                .iter()
                .map(|&(_, _, drive, node)| ExtentLoc {
                    node,
                    drive,
                    state: ExtentState::InSync,
                })
                .collect();
            for e in &ex {
                if let Some(d) = ctl.drives.get_mut(&e.drive) {
                    d.2 += 1;
                }
            }
            ctl.slabs.insert((volume, slab), (ex.clone(), 1));
            ex
        };
        w.trace(|| {
            let where_: Vec<String> = placed
                .iter()
                .map(|e| format!("n{}/d{}", e.node, e.drive))
                .collect();
            format!(
                "ctl: vol {volume} slab {slab} placed on {}",
                where_.join(" ")
            )
        });
        Ok(placed)
    }

    async fn lookup(
        &self,
        volume: VolumeId,
        slab: SlabIndex,
        _epoch: Epoch,
    ) -> Result<Option<Vec<ExtentLoc>>, VolumeError> {
        // Fenced like every other control-plane call of this term (see `round_trip`).
        self.round_trip(volume).await?;
        Ok(lock(&self.world.ctl)
            .slabs
            .get(&(volume, slab))
            .map(|(ex, _)| ex.clone()))
    }

    async fn change(
        &self,
        volume: VolumeId,
        slab: SlabIndex,
        // This handle already carries its owner's term (`self.epoch`).
        _epoch: Epoch,
        change: SlabChange,
    ) -> Result<Vec<ExtentLoc>, VolumeError> {
        let w = &self.world;
        for _ in 0..CAS_RETRIES_MAX {
            self.round_trip(volume).await?;
            let Some((mut ex, rev)) = lock(&w.ctl).slabs.get(&(volume, slab)).cloned() else {
                return Err(VolumeError::Control(
                    format!("slab {slab} has no record"),
                    self.name.clone(),
                ));
            };
            let mut changed = false;
            match &change {
                SlabChange::State { drive, from, to } => {
                    for e in ex.iter_mut() {
                        if e.drive == *drive && from.contains(&e.state) && e.state != *to {
                            e.state = *to;
                            changed = true;
                        }
                    }
                }
                SlabChange::Replace { old, new } => {
                    for e in ex.iter_mut() {
                        if e.drive == *old {
                            *e = *new;
                            changed = true;
                        }
                    }
                }
            }
            if !changed {
                return Ok(ex);
            }
            // The compare-and-swap is a second round trip; others may change it meanwhile.
            self.round_trip(volume).await?;
            let done = {
                let mut ctl = lock(&w.ctl);
                match ctl.slabs.get_mut(&(volume, slab)) {
                    Some(cur) if cur.1 == rev => {
                        *cur = (ex.clone(), rev + 1);
                        true
                    }
                    _ => false,
                }
            };
            if done {
                w.trace(|| {
                    format!(
                        "ctl: vol {volume} slab {slab} by epoch {}: {change:?} -> {}",
                        self.epoch,
                        ex.iter()
                            .map(|e| format!("n{}/d{}:{}", e.node, e.drive, e.state))
                            .collect::<Vec<_>>()
                            .join(" ")
                    )
                });
                return Ok(ex);
            }
        }
        Err(VolumeError::Control(
            format!("slab {slab}: too many concurrent changes of its record"),
            self.name.clone(),
        ))
    }
}
