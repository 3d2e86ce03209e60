//! Snapshot bookkeeping between a volume's owner and its record that the daemon and the
//! simulator share: noting a snapshot before its floors are set, and releasing what copies
//! keep for epochs that are no snapshot of the volume (docs/SNAPSHOTS.md, "Stray floors").

use converge_control::kv::Kv;
use converge_control::model::{Cluster, ControlError};
use converge_types::{Epoch, NodeId};
use converge_volume::{ReplicaIo, SlabAllocator, Volume, VolumeError};

/// The `note` of `Volume::snapshot_noted`: records in volume `name`'s record that its
/// owner (`node`) begins a snapshot of epoch `e`. A failure takes no snapshot.
pub async fn note_snapshot<K: Kv>(
    cluster: &Cluster<K>,
    name: &str,
    node: NodeId,
    e: Epoch,
) -> Result<(), VolumeError> {
    cluster
        .note_snapshot_attempt(name, node, e)
        .await
        .map_err(|err| VolumeError::Snapshot {
            volume: name.to_string(),
            why: format!("no snapshot taken: noting it in the volume record: {err}"),
        })
}

/// Releases what `v`'s copies keep for the record's `stray_floors` (snapshots begun and
/// never recorded, snapshots deleted while a copy was out of sync; read now: a term may
/// note one until it ends, so a new owner calls this once it serves), then settles them
/// in the record. Returns the epochs settled; the others (a copy did not answer, a copy
/// is out of sync, this term's own) stay listed for a later call. Costs one read of the record, and when
/// it lists some, one drop per copy and stray.
pub async fn release_stray_floors<K: Kv, R: ReplicaIo, A: SlabAllocator>(
    cluster: &Cluster<K>,
    v: &Volume<R, A>,
) -> Result<Vec<Epoch>, ControlError> {
    let strays = match cluster.volume(&v.config().name).await? {
        Some((rec, _)) => rec.stray_floors,
        None => return Ok(Vec::new()),
    };
    release_listed(cluster, v, &strays).await
}

/// [`release_stray_floors`] of the epochs `strays` the caller read from the record: drops
/// them, then settles what it may. Touches the control plane only to settle.
pub async fn release_listed<K: Kv, R: ReplicaIo, A: SlabAllocator>(
    cluster: &Cluster<K>,
    v: &Volume<R, A>,
    strays: &[Epoch],
) -> Result<Vec<Epoch>, ControlError> {
    if strays.is_empty() {
        return Ok(Vec::new());
    }
    let released = v.release_stray_floors(strays).await;
    if !released.is_empty() {
        cluster
            .settle_stray_floors(&v.config().name, &released)
            .await?;
    }
    Ok(released)
}
