//! What a replica checks with the control plane before it runs an extent operation, in
//! `converged` and in the simulator alike (docs/SECURITY.md, "Forged extent operations"
//! and "Who may ask what"):
//!
//! * the request's epoch is one etcd granted for the volume: a later one would fence every
//!   real owner out of the copy for good. Checked once per volume and epoch (the highest
//!   confirmed is cached; nothing is asked again for requests at or below it);
//! * a peer's request comes from the volume's owner: every operation that carries an epoch
//!   (writes, releases, fences, reads) only from the node the control plane made owner at
//!   the newest epoch this node has seen for the volume (learned with the granted epoch,
//!   in the same read, and again only when a request names a newer epoch). Repair runs on
//!   the owner (docs/adr/0004), so the owner is also the only node that holds a copy job
//!   for the volume's slabs. A `Free` (which carries no epoch) of a volume that has an
//!   owner comes only from that owner; of one that has none (deleted), from any member;
//! * an operation that creates the extent (it stores blocks, or fences) is backed by a slab
//!   record placing the copy on this drive: a late write of a deleted volume, of a copy
//!   rebuilt elsewhere, or of an invented volume must not take space nothing accounts for.
//!   It must also come from the volume's current owner: an extent's epoch fence is lost
//!   when the extent is freed (a slab released by TRIM, a copy moved), so a deposed
//!   owner's late write must not create it again under a new incarnation's record.
//!   Checked only when the drive does not hold the extent yet;
//! * a copy its slab record still places on this drive is never freed by a `Free` (its
//!   blocks would read as zeros). A `Release` (thin reclaim) comes only from the owner (the
//!   caller check above), which sends it once it has deleted the slab's record; the engine
//!   keeps the extent if a block is newer than the release's bound (a later incarnation).
//!   It is not checked against the record here: that read would delay the release past a
//!   new incarnation's first write, which the simulator showed losing that write.
//!
//! Per request this costs two hash lookups under read locks; etcd is asked once per volume
//! and new epoch (a takeover, a snapshot), and for every `Free` (rare).

use converge_control::kv::Kv;
use converge_control::model::{Cluster, OwnerRecord};
use converge_types::{DriveId, Epoch, ExtentKey, ExtentOp, NodeId, VolumeId};
use std::collections::HashMap;
use std::sync::RwLock;

/// Who sends an operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caller {
    /// This node's own volumes (the owner's local path, orphan reclaim): trusted.
    Local,
    /// Another node, as its certificate and hello proved (`converge_rpc`).
    Peer(NodeId),
}

/// Why an operation is not let through.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The request's epoch was never granted: no owner, past or present, sent it.
    NotGranted(String),
    /// It would create an extent no slab record places on this drive (a deleted volume's,
    /// a copy replaced meanwhile, an invented volume's).
    NotPlaced(String),
    /// It would free a copy the slab's record still places on this drive.
    StillPlaced(String),
    /// It would create an extent, or it comes from a peer, and its epoch is not the
    /// volume's current owner's (a deposed owner's late request): the sender is fenced.
    Deposed { current: Epoch, message: String },
    /// A peer that is not the volume's owner sent it.
    NotOwner(String),
    /// The control plane could not be asked.
    Unavailable(String),
}

impl Refusal {
    pub fn message(&self) -> &str {
        match self {
            Refusal::NotGranted(m)
            | Refusal::NotPlaced(m)
            | Refusal::StillPlaced(m)
            | Refusal::Deposed { message: m, .. }
            | Refusal::NotOwner(m)
            | Refusal::Unavailable(m) => m,
        }
    }
}

/// One node's admission checks: what it learned from the control plane, per volume.
#[derive(Default)]
pub struct Admission {
    /// The highest epoch confirmed granted.
    granted: RwLock<HashMap<VolumeId, Epoch>>,
    /// The owner record of the newest epoch seen (only rises).
    owners: RwLock<HashMap<VolumeId, OwnerRecord>>,
}

impl Admission {
    pub fn new() -> Admission {
        Admission::default()
    }

    /// Checks `op` from `caller`, bound for `drive`; `holds_extent` says whether the drive
    /// already holds the extent (asked only for operations that would create it).
    pub async fn check<K: Kv>(
        &self,
        cluster: &Cluster<K>,
        caller: Caller,
        drive: DriveId,
        op: &ExtentOp,
        holds_extent: impl FnOnce() -> bool,
    ) -> Result<(), Refusal> {
        let key = op.key();
        match op.epoch() {
            Some(epoch) => {
                let peer = matches!(caller, Caller::Peer(_));
                self.confirm_epoch(cluster, key, epoch, peer).await?;
                if let Caller::Peer(peer) = caller {
                    self.confirm_caller(key, epoch, peer)?;
                }
            }
            None => {
                if let Caller::Peer(peer) = caller {
                    confirm_free_by(cluster, key, peer).await?;
                }
                confirm_free(cluster, drive, key).await?
            }
        }
        if op.creates_extent() && !holds_extent() {
            confirm_placed(cluster, drive, key).await?;
            if let Some(epoch) = op.epoch() {
                confirm_owner(cluster, key, epoch).await?;
            }
        }
        Ok(())
    }

    /// The owner record of the newest epoch this node has seen for `volume`, if any.
    pub fn owner_seen(&self, volume: VolumeId) -> Option<OwnerRecord> {
        self.owners
            .read()
            .expect("owners lock poisoned")
            .get(&volume)
            .copied()
    }

    /// Confirms `epoch` was granted; with `learn_owner`, also learns the owner of that epoch
    /// (a peer's request is checked against it next).
    async fn confirm_epoch<K: Kv>(
        &self,
        cluster: &Cluster<K>,
        key: ExtentKey,
        epoch: Epoch,
        learn_owner: bool,
    ) -> Result<(), Refusal> {
        let known = self
            .granted
            .read()
            .expect("granted lock poisoned")
            .get(&key.volume)
            .copied();
        let owner_known = !learn_owner
            || self
                .owner_seen(key.volume)
                .is_some_and(|o| o.epoch >= epoch);
        if known.is_some_and(|k| epoch <= k) && owner_known {
            return Ok(());
        }
        let (granted, owner) = cluster.granted_and_owner(key.volume).await.map_err(|e| {
            Refusal::Unavailable(format!(
                "cannot check epoch {epoch} of volume {} with the control plane: {e}",
                key.volume
            ))
        })?;
        {
            let mut g = self.granted.write().expect("granted lock poisoned");
            let k = g.entry(key.volume).or_insert(granted);
            *k = (*k).max(granted);
        }
        if let Some(o) = owner {
            let mut m = self.owners.write().expect("owners lock poisoned");
            let k = m.entry(key.volume).or_insert(o);
            if o.epoch > k.epoch {
                *k = o;
            }
        }
        if epoch > granted {
            return Err(Refusal::NotGranted(format!(
                "epoch {epoch} of volume {} was never granted (the control plane's latest is \
                 {granted}): refused",
                key.volume
            )));
        }
        Ok(())
    }

    /// A peer's request at `epoch` must come from the volume's owner: the node holding
    /// `epoch` if it is the newest this node knows, or the current owner (which may still
    /// have requests of its own earlier epoch in flight, e.g. across a snapshot). Nobody
    /// else sends extent operations (docs/adr/0004: repair runs on the owner too).
    fn confirm_caller(&self, key: ExtentKey, epoch: Epoch, peer: NodeId) -> Result<(), Refusal> {
        let owner = self.owner_seen(key.volume);
        match owner {
            Some(o) if o.node == peer && o.epoch >= epoch => Ok(()),
            Some(o) if o.epoch > epoch => Err(Refusal::Deposed {
                current: o.epoch,
                message: format!(
                    "epoch {epoch} of volume {} is over: node {} owns it at epoch {}; node \
                     {peer} may not act on its copies: refused",
                    key.volume, o.node, o.epoch
                ),
            }),
            Some(o) if o.epoch == epoch => Err(Refusal::NotOwner(format!(
                "node {peer} is not the owner of volume {} (node {} is, at epoch {epoch}): \
                 only a volume's owner acts on its copies: refused",
                key.volume, o.node
            ))),
            // The control plane names no owner at this epoch (its lease ended, or it never
            // held it): whoever sends it is not the owner now.
            _ => Err(Refusal::Deposed {
                current: owner.map_or(Epoch(epoch.0 + 1), |o| o.epoch.max(Epoch(epoch.0 + 1))),
                message: format!(
                    "volume {} has no owner at epoch {epoch} (its ownership ended): node \
                     {peer} may not act on its copies: refused",
                    key.volume
                ),
            }),
        }
    }
}

/// A `Free` from a peer: of a volume that has an owner, only that owner frees copies (a
/// copy it moved away); of a volume without one (deleted), any member may, for the slab
/// records are gone (checked next).
async fn confirm_free_by<K: Kv>(
    cluster: &Cluster<K>,
    key: ExtentKey,
    peer: NodeId,
) -> Result<(), Refusal> {
    match cluster.owner(key.volume).await {
        Ok(Some(o)) if o.node != peer => Err(Refusal::NotOwner(format!(
            "node {peer} may not free slab {} of volume {}: node {} owns the volume: refused",
            key.slab, key.volume, o.node
        ))),
        Ok(_) => Ok(()),
        Err(e) => Err(Refusal::Unavailable(format!(
            "cannot check the owner of volume {} before freeing slab {}: {e}",
            key.volume, key.slab
        ))),
    }
}

async fn confirm_placed<K: Kv>(
    cluster: &Cluster<K>,
    drive: DriveId,
    key: ExtentKey,
) -> Result<(), Refusal> {
    match cluster.slab(key.volume, key.slab).await {
        Ok(Some((rec, _))) if rec.extents.iter().any(|e| e.drive == drive) => Ok(()),
        Ok(_) => Err(Refusal::NotPlaced(format!(
            "no slab record places slab {} of volume {} on drive {:016x} (volume deleted, or \
             the copy moved): refused",
            key.slab, key.volume, drive.0
        ))),
        Err(e) => Err(Refusal::Unavailable(format!(
            "cannot check the slab record of a new extent (slab {} of volume {}): {e}",
            key.slab, key.volume
        ))),
    }
}

async fn confirm_owner<K: Kv>(
    cluster: &Cluster<K>,
    key: ExtentKey,
    epoch: Epoch,
) -> Result<(), Refusal> {
    match cluster.owner(key.volume).await {
        Ok(Some(o)) if epoch >= o.epoch => Ok(()),
        Ok(o) => {
            let current = o.map_or(Epoch(epoch.0 + 1), |o| o.epoch);
            Err(Refusal::Deposed {
                current,
                message: format!(
                    "a new extent of slab {} of volume {} at epoch {epoch}, but the volume's \
                     owner is at epoch {current} (or has none): refused",
                    key.slab, key.volume
                ),
            })
        }
        Err(e) => Err(Refusal::Unavailable(format!(
            "cannot check the owner of volume {} before creating an extent: {e}",
            key.volume
        ))),
    }
}

async fn confirm_free<K: Kv>(
    cluster: &Cluster<K>,
    drive: DriveId,
    key: ExtentKey,
) -> Result<(), Refusal> {
    match cluster.slab(key.volume, key.slab).await {
        Ok(Some((rec, _))) if rec.extents.iter().any(|e| e.drive == drive) => {
            Err(Refusal::StillPlaced(format!(
                "slab {} of volume {} has a copy on drive {:016x} in its slab record: not freed",
                key.slab, key.volume, drive.0
            )))
        }
        Ok(_) => Ok(()),
        Err(e) => Err(Refusal::Unavailable(format!(
            "cannot check the slab record before freeing slab {} of volume {}: {e}",
            key.slab, key.volume
        ))),
    }
}
