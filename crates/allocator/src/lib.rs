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
use converge_types::{DriveId, Epoch, ExtentState, NodeId, SlabIndex, VolumeId};
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

/// The record after `change`, with its `holds_acked` marks; `None` when the change does
/// not apply to it (its precondition fails, or a promotion the record does not allow).
pub fn changed(rec: &SlabRecord, change: &SlabChange) -> Option<SlabRecord> {
    let mut extents = extents_of(rec);
    if !promotable(rec, change) || !change.apply(&mut extents) {
        return None;
    }
    Some(SlabRecord {
        extents: with_holds_acked(rec, &extents, change),
    })
}

/// Whether the record lets `change` through: a promotion only of a copy it marks as
/// holding every acked write (docs/adr/0014).
fn promotable(rec: &SlabRecord, change: &SlabChange) -> bool {
    match change {
        SlabChange::Promote { drive } => rec
            .extents
            .iter()
            .any(|e| e.drive == *drive && e.state != ExtentState::InSync && e.holds_acked),
        _ => true,
    }
}

/// The record's copies after `change` left them as `after`, with their `holds_acked`
/// marks (docs/adr/0014): a copy that went from in sync to stale holds every acked write
/// if fewer than `min_replicas` copies stay in sync (nothing is acked without it from
/// then on); it keeps the mark while it is resynced (a syncing copy takes every write,
/// and its fill only adds) and if that resync fails, until a change leaves
/// `min_replicas` copies in sync again (acks resume without it); every other copy has
/// none (a new copy may be partial), and a promotion clears every mark (its copy is the
/// one truth now).
fn with_holds_acked(
    before: &SlabRecord,
    after: &[ExtentLoc],
    change: &SlabChange,
) -> Vec<ExtentRecord> {
    let min_replicas = match change {
        SlabChange::State { min_replicas, .. } => Some(*min_replicas),
        _ => None,
    };
    let in_sync = after
        .iter()
        .filter(|e| e.state == ExtentState::InSync)
        .count();
    let acks_resume = min_replicas.is_some_and(|m| in_sync >= m);
    after
        .iter()
        .map(|e| {
            let was = before.extents.iter().find(|b| b.drive == e.drive);
            let holds_acked = e.state != ExtentState::InSync
                && !acks_resume
                && !matches!(change, SlabChange::Promote { .. })
                && match was {
                    Some(b) if b.state != ExtentState::InSync => b.holds_acked,
                    Some(b) if b.state == ExtentState::InSync => {
                        min_replicas.is_some_and(|m| in_sync < m)
                    }
                    _ => false,
                };
            ExtentRecord {
                drive: e.drive,
                node: e.node,
                state: e.state,
                holds_acked,
            }
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
            let Some((rec, rev)) = self
                .cluster
                .slab(volume, slab)
                .await
                .map_err(|e| control(volume, e))?
            else {
                return Err(control(volume, format!("slab {slab} has no record")));
            };
            let Some(rec) = changed(&rec, &change) else {
                return Ok(extents_of(&rec));
            };
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

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(copies: &[(u64, ExtentState)]) -> SlabRecord {
        SlabRecord {
            extents: copies
                .iter()
                .map(|&(d, state)| ExtentRecord {
                    drive: DriveId(d),
                    node: NodeId(d as u32),
                    state,
                    holds_acked: false,
                })
                .collect(),
        }
    }

    fn state(drive: u64, from: &[ExtentState], to: ExtentState) -> SlabChange {
        SlabChange::State {
            drive: DriveId(drive),
            from: from.to_vec(),
            to,
            min_replicas: 2,
        }
    }

    fn stale(drive: u64) -> SlabChange {
        state(drive, &[ExtentState::InSync], ExtentState::Stale)
    }

    fn marked(r: &SlabRecord) -> Vec<u64> {
        r.extents
            .iter()
            .filter(|e| e.holds_acked)
            .map(|e| e.drive.0)
            .collect()
    }

    use ExtentState::{InSync, Stale, Syncing};

    #[test]
    fn the_copy_that_leaves_a_slab_below_min_replicas_holds_every_acked_write() {
        // Mirror-3, min_replicas 2: the first copy to go stale leaves two in sync (acks go
        // on without it), the second leaves one (nothing is acked from then on).
        let r = rec(&[(1, InSync), (2, InSync), (3, InSync)]);
        let r = changed(&r, &stale(1)).unwrap();
        assert_eq!(marked(&r), Vec::<u64>::new());
        let r = changed(&r, &stale(2)).unwrap();
        assert_eq!(marked(&r), vec![2]);
        // It keeps the mark while resynced and if that fails.
        let r = changed(&r, &state(2, &[Stale], Syncing)).unwrap();
        assert_eq!(marked(&r), vec![2]);
        let r = changed(&r, &state(2, &[Syncing], Stale)).unwrap();
        assert_eq!(marked(&r), vec![2]);
        // The last in-sync copy going stale is marked too: it held every acked write.
        let r = changed(&r, &stale(3)).unwrap();
        assert_eq!(marked(&r), vec![2, 3]);
        // Copy 1 was never marked: it may be promoted by no one.
        assert!(changed(&r, &SlabChange::Promote { drive: DriveId(1) }).is_none());
        // A promotion makes the copy the one truth and clears every mark.
        let r = changed(&r, &SlabChange::Promote { drive: DriveId(2) }).unwrap();
        assert_eq!(marked(&r), Vec::<u64>::new());
        let states: Vec<_> = r.extents.iter().map(|e| e.state).collect();
        assert_eq!(states, vec![Stale, InSync, Stale]);
        // It is in sync now, so it cannot be promoted again.
        assert!(changed(&r, &SlabChange::Promote { drive: DriveId(2) }).is_none());
    }

    #[test]
    fn marks_are_cleared_once_acks_resume_without_them() {
        let r = rec(&[(1, InSync), (2, InSync), (3, Stale)]);
        let r = changed(&r, &stale(1)).unwrap();
        assert_eq!(marked(&r), vec![1]);
        // Copy 3 resynced back in sync: two copies in sync again, writes are acked on them
        // and copy 1 misses them.
        let r = changed(&r, &state(3, &[Stale], Syncing)).unwrap();
        assert_eq!(marked(&r), vec![1]);
        let r = changed(&r, &state(3, &[Syncing], InSync)).unwrap();
        assert_eq!(marked(&r), Vec::<u64>::new());
        assert!(changed(&r, &SlabChange::Promote { drive: DriveId(1) }).is_none());
    }

    #[test]
    fn a_new_copy_and_an_older_record_hold_no_mark() {
        // An older build's record has no marks: unknown is never promoted.
        let r = rec(&[(1, Stale), (2, Stale), (3, Stale)]);
        assert!(changed(&r, &SlabChange::Promote { drive: DriveId(1) }).is_none());
        // A rebuilt copy may be partial: it replaces a marked one without the mark.
        let r = rec(&[(1, InSync), (2, InSync), (3, InSync)]);
        let r = changed(&r, &stale(1)).unwrap();
        let r = changed(&r, &stale(2)).unwrap();
        assert_eq!(marked(&r), vec![2]);
        let new = ExtentLoc {
            node: NodeId(4),
            drive: DriveId(4),
            state: Syncing,
        };
        let r = changed(
            &r,
            &SlabChange::Replace {
                old: DriveId(2),
                new,
            },
        )
        .unwrap();
        assert_eq!(marked(&r), Vec::<u64>::new());
        // A change whose precondition fails changes nothing.
        assert!(changed(&r, &stale(2)).is_none());
    }
}
