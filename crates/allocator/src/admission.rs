//! What a replica checks with the control plane before it runs an extent operation, in
//! `converged` and in the simulator alike (docs/SECURITY.md, "Forged extent operations"):
//!
//! * the request's epoch is one etcd granted for the volume: a later one would fence every
//!   real owner out of the copy for good. Checked once per volume and epoch (the highest
//!   confirmed is cached; nothing is asked again for requests at or below it);
//! * an operation that creates the extent (it stores blocks, or fences) is backed by a slab
//!   record placing the copy on this drive: a late write of a deleted volume, of a copy
//!   rebuilt elsewhere, or of an invented volume must not take space nothing accounts for.
//!   It must also come from the volume's current owner: an extent's epoch fence is lost
//!   when the extent is freed (a slab released by TRIM, a copy moved), so a deposed
//!   owner's late write must not create it again under a new incarnation's record.
//!   Checked only when the drive does not hold the extent yet;
//! * a copy its slab record still places on this drive is never freed (its blocks would
//!   read as zeros).

use converge_control::kv::Kv;
use converge_control::model::Cluster;
use converge_types::{DriveId, Epoch, ExtentKey, ExtentOp, VolumeId};
use std::collections::HashMap;
use std::sync::RwLock;

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
    /// It would create an extent, and its epoch is not the volume's current owner's (a
    /// deposed owner's late request): the sender is fenced.
    Deposed { current: Epoch, message: String },
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
            | Refusal::Unavailable(m) => m,
        }
    }
}

/// One node's admission checks (its cache of confirmed epochs).
#[derive(Default)]
pub struct Admission {
    granted: RwLock<HashMap<VolumeId, Epoch>>,
}

impl Admission {
    pub fn new() -> Admission {
        Admission::default()
    }

    /// Checks `op`, bound for `drive`; `holds_extent` says whether the drive already holds
    /// the extent (asked only for operations that would create it).
    pub async fn check<K: Kv>(
        &self,
        cluster: &Cluster<K>,
        drive: DriveId,
        op: &ExtentOp,
        holds_extent: impl FnOnce() -> bool,
    ) -> Result<(), Refusal> {
        let key = op.key();
        match op.epoch() {
            Some(epoch) => self.confirm_epoch(cluster, key, epoch).await?,
            None => confirm_free(cluster, drive, key).await?,
        }
        if op.creates_extent() && !holds_extent() {
            confirm_placed(cluster, drive, key).await?;
            if let Some(epoch) = op.epoch() {
                confirm_owner(cluster, key, epoch).await?;
            }
        }
        Ok(())
    }

    async fn confirm_epoch<K: Kv>(
        &self,
        cluster: &Cluster<K>,
        key: ExtentKey,
        epoch: Epoch,
    ) -> Result<(), Refusal> {
        let known = self
            .granted
            .read()
            .expect("granted lock poisoned")
            .get(&key.volume)
            .copied();
        if known.is_some_and(|k| epoch <= k) {
            return Ok(());
        }
        let granted = cluster.granted_epoch(key.volume).await.map_err(|e| {
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
        if epoch > granted {
            return Err(Refusal::NotGranted(format!(
                "epoch {epoch} of volume {} was never granted (the control plane's latest is \
                 {granted}): refused",
                key.volume
            )));
        }
        Ok(())
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
                    "a new extent of slab {} of volume {} at epoch {epoch}, but the volume's                      owner is at epoch {current} (or has none): refused",
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
