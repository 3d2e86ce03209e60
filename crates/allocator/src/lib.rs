//! The owner's control-plane glue: how a volume's owner places, allocates, looks up and
//! changes slab records (`converge_volume::SlabAllocator`), and the repair policy
//! ([`repair`]: which copies to mark stale, resync or rebuild, when and where). It lives in its own crate so
//! that `converged` and the simulator run the very same code (docs/SIMULATION.md: "the
//! simulator runs what ships"): it is generic over the key-value store ([`Kv`]), which
//! the daemon fills with its etcd client and the simulator with an in-memory etcd that
//! has latency and partitions.
//!
//! It sits above both `control` (records, placement, transactions) and `volume` (the
//! trait it implements), which know nothing of each other: `volume` uses no I/O crate,
//! and `control` stays below the owner logic.
//!
//! Every call that changes a record is fenced: the transaction also compares the volume's
//! owner record with the caller's node and epoch, so a deposed owner (paused or cut off
//! past its lease) gets [`VolumeError::Fenced`] and changes nothing (docs/CONSISTENCY.md).

pub mod admission;
pub mod repair;
pub mod snapshots;

use converge_control::etcd::Etcd;
use converge_control::kv::Kv;
use converge_control::model::{
    Cluster, ControlError, ExtentRecord, OwnerRecord, SlabRecord, TXN_RETRIES_MAX,
};
use converge_control::placement::DriveLoad;
use converge_types::{DriveId, Epoch, NodeId, SlabIndex, VolumeId};
use converge_volume::{ExtentLoc, SlabAllocator, SlabChange, VolumeError};
use std::collections::HashMap;

/// Places new slabs: reads drives, live nodes and every slab's extents from the store,
/// picks drives on distinct nodes balancing use, and records the slab (create-if-absent,
/// fenced by the owner's epoch). Changes and lookups are fenced the same way.
pub struct Allocator<K = Etcd> {
    pub cluster: Cluster<K>,
    /// This node: slabs are allocated and changed as this node's ownership.
    pub me: NodeId,
    /// How far (points of used capacity) this node may be above the least-used one and
    /// still take a copy of the slabs it allocates (data locality; 0: balance alone).
    pub locality_pct: u64,
    /// One allocation at a time from this node: its volumes would only contend with each
    /// other in the store (each allocation re-reads every slab record when it loses).
    pub serial: tokio::sync::Mutex<()>,
}

/// The copies of a slab record, as the volume layer sees them.
pub fn extents_of(s: &SlabRecord) -> Vec<ExtentLoc> {
    s.extents
        .iter()
        .map(|e| ExtentLoc {
            node: e.node,
            drive: e.drive,
            state: e.state,
        })
        .collect()
}

/// Extents placed on each drive, counted from all slab records.
pub async fn extents_used<K: Kv>(cluster: &Cluster<K>) -> Result<HashMap<DriveId, u64>, String> {
    cluster.extents_used().await.map_err(|e| e.to_string())
}

/// Every drive as placement sees it: live means its node's lease is alive, the node is
/// not in maintenance, and the drive has not failed.
pub async fn drive_loads<K: Kv>(cluster: &Cluster<K>) -> Result<Vec<DriveLoad>, String> {
    cluster.drive_loads().await.map_err(|e| e.to_string())
}

impl<K: Kv> Allocator<K> {
    /// `locality_pct`: the `placement_locality_pct` knob (0: placement by balance alone).
    pub fn new(cluster: Cluster<K>, me: NodeId, locality_pct: u64) -> Allocator<K> {
        Allocator {
            cluster,
            me,
            locality_pct,
            serial: tokio::sync::Mutex::new(()),
        }
    }

    fn owner(&self, epoch: Epoch) -> OwnerRecord {
        OwnerRecord {
            node: self.me,
            epoch,
        }
    }
}

fn control(volume: VolumeId, e: impl ToString) -> VolumeError {
    VolumeError::Control(e.to_string(), volume.to_string())
}

/// `OwnedElsewhere` from a fenced transaction, in the volume layer's terms.
fn fenced(volume: VolumeId, epoch: Epoch, e: ControlError, what: &str) -> VolumeError {
    match e {
        ControlError::OwnedElsewhere { node, epoch: e, .. } => VolumeError::Fenced {
            volume: volume.to_string(),
            epoch,
            why: format!(
                "the volume's owner record is now node {node} epoch {e}; this node may not {what}"
            ),
        },
        e => control(volume, e),
    }
}

impl<K: Kv> SlabAllocator for Allocator<K> {
    async fn allocate(
        &self,
        volume: VolumeId,
        slab: SlabIndex,
        epoch: Epoch,
        copies: usize,
        thin: bool,
    ) -> Result<Vec<ExtentLoc>, VolumeError> {
        let _serial = self.serial.lock().await;
        match self
            .cluster
            .allocate_slab_as(
                volume,
                slab,
                copies,
                self.owner(epoch),
                self.locality_pct,
                thin,
            )
            .await
        {
            Ok((rec, _)) => Ok(extents_of(&rec)),
            Err(ControlError::Placement(e)) if e.waits_for_nodes() => Err(VolumeError::NodesDown {
                volume: volume.to_string(),
                slab,
                why: e.to_string(),
            }),
            Err(ControlError::Placement(e)) => Err(VolumeError::NoSpace {
                volume: volume.to_string(),
                why: format!("its slab {slab} cannot be placed: {e}"),
            }),
            Err(e) => Err(fenced(volume, epoch, e, "allocate its slabs")),
        }
    }

    async fn lookup(
        &self,
        volume: VolumeId,
        slab: SlabIndex,
        epoch: Epoch,
    ) -> Result<Option<Vec<ExtentLoc>>, VolumeError> {
        let owner = self
            .cluster
            .owner(volume)
            .await
            .map_err(|e| control(volume, e))?;
        if owner != Some(self.owner(epoch)) {
            return Err(VolumeError::Fenced {
                volume: volume.to_string(),
                epoch,
                why: format!("the volume's owner record is now {owner:?}"),
            });
        }
        Ok(self
            .cluster
            .slab(volume, slab)
            .await
            .map_err(|e| control(volume, e))?
            .map(|(rec, _)| extents_of(&rec)))
    }

    async fn change(
        &self,
        volume: VolumeId,
        slab: SlabIndex,
        epoch: Epoch,
        change: SlabChange,
    ) -> Result<Vec<ExtentLoc>, VolumeError> {
        for _ in 0..TXN_RETRIES_MAX {
            let Some((mut rec, rev)) = self
                .cluster
                .slab(volume, slab)
                .await
                .map_err(|e| control(volume, e))?
            else {
                return Err(control(volume, format!("slab {slab} has no record")));
            };
            let mut extents = extents_of(&rec);
            if !change.apply(&mut extents) {
                return Ok(extents);
            }
            rec.extents = extents
                .iter()
                .map(|e| ExtentRecord {
                    drive: e.drive,
                    node: e.node,
                    state: e.state,
                })
                .collect();
            match self
                .cluster
                .cas_slab_as_owner(volume, slab, &rec, rev, self.owner(epoch))
                .await
            {
                Ok(Some(())) => return Ok(extents_of(&rec)),
                Ok(None) => {}
                Err(e) => return Err(fenced(volume, epoch, e, "change its slabs")),
            }
        }
        Err(control(
            volume,
            format!("slab {slab}: too many concurrent changes of its record"),
        ))
    }

    async fn release(
        &self,
        volume: VolumeId,
        slabs: &[SlabIndex],
        epoch: Epoch,
    ) -> Result<(), VolumeError> {
        self.cluster
            .release_slab_as_owner(volume, slabs, self.owner(epoch))
            .await
            .map_err(|e| fenced(volume, epoch, e, "release its slabs"))
    }
}
