//! The snapshot API (docs/SNAPSHOTS.md): list, create, delete and roll back a volume's
//! snapshots. Every change runs on the volume's serving owner (requests to other nodes are
//! forwarded there), which drains the volume's writes for a snapshot and sends its copies
//! the extent operations; the list lives in the volume's record.

use crate::api::{forward_to_owner, ok, serving_owner, volume_record, ApiError, Out};
use crate::node::{Node, OpenError, Route, Vol};
use converge_api::{CreateSnapshot, RolledBack, SnapshotInfo};
use converge_control::model::{SnapshotRecord, VolumeRecord};
use converge_volume::VolumeError;
use hyper::StatusCode;
use std::sync::Arc;

/// Same rules as volume names (`@` separates a volume from its snapshot in export names).
fn check_name(s: &str) -> Result<(), ApiError> {
    let ok = !s.is_empty()
        && s.len() <= 64
        && !s.starts_with('.')
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(ApiError::bad(format!(
            "snapshot name {s:?} is invalid: use 1 to 64 letters, digits, '.', '_' or '-', not \
             starting with '.'"
        )))
    }
}

async fn info(node: &Node, rec: &VolumeRecord, s: &SnapshotRecord) -> SnapshotInfo {
    let owner = serving_owner(node, rec).await.unwrap_or(rec.owner);
    let socket = match node.cluster.live_nodes().await {
        Ok(live) => live
            .into_iter()
            .find(|n| n.id == owner)
            .map(|n| n.nbd_socket)
            .unwrap_or_else(|| format!("(owner node {owner} is down)")),
        Err(_) => "(control plane unavailable)".into(),
    };
    SnapshotInfo {
        name: s.name.clone(),
        epoch: s.epoch,
        created_unix: s.created_unix,
        size_bytes: if s.size_bytes > 0 {
            s.size_bytes
        } else {
            rec.size_bytes
        },
        uri: format!("nbd+unix:///{}@{}?socket={socket}", rec.name, s.name),
    }
}

/// `GET /v1/volumes/NAME/snapshots`: oldest first; one being deleted is not listed.
pub(crate) async fn list(node: &Arc<Node>, name: &str) -> Out {
    let (rec, _) = volume_record(node, name).await?;
    let mut out = Vec::new();
    for s in rec.snapshots.iter().filter(|s| !s.deleting) {
        out.push(info(node, &rec, s).await);
    }
    ok(&out)
}

/// The volume as this node serves it (it is the serving owner, or takes it over).
async fn served_here(node: &Arc<Node>, name: &str) -> Result<Arc<Vol>, ApiError> {
    match node.open_volume(name).await {
        Ok(Route::Local(v)) => Ok(v),
        Ok(Route::Remote { owner, .. }) => Err(ApiError(
            StatusCode::CONFLICT,
            format!("volume {name} is served by node {owner}; ask it (or retry)"),
        )),
        Err(OpenError::Unknown) => Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("no volume named {name:?}"),
        )),
        Err(OpenError::Unavailable(e)) => Err(ApiError::unavailable(e)),
    }
}

fn volume_error(e: VolumeError) -> ApiError {
    match e {
        VolumeError::Control(..) => ApiError::unavailable(e),
        VolumeError::Snapshot { .. } => ApiError(StatusCode::CONFLICT, e.to_string()),
        VolumeError::OutOfRange { .. } | VolumeError::TooLong { .. } => {
            ApiError::bad(e.to_string())
        }
        _ => ApiError(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

/// `POST /v1/volumes/NAME/snapshots` `{"name": SNAP}`: a crash-consistent snapshot, now.
pub(crate) async fn create(node: &Arc<Node>, name: &str, body: &[u8]) -> Out {
    let req: CreateSnapshot = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("bad snapshot request: {e}")))?;
    check_name(&req.name)?;
    let (rec, _) = volume_record(node, name).await?;
    if rec.snapshots.iter().any(|s| s.name == req.name) {
        return Err(ApiError(
            StatusCode::CONFLICT,
            format!("volume {name} already has a snapshot named {}", req.name),
        ));
    }
    if let Some(r) = forward_to_owner(
        node,
        serving_owner(node, &rec).await?,
        "POST",
        &format!("/v1/volumes/{name}/snapshots"),
        body,
    )
    .await?
    {
        return Ok(r);
    }
    let v = served_here(node, name).await?;
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (me, lease) = (node.cfg.node_id, node.lease());
    let cluster = node.cluster.clone();
    let (vname, sname) = (name.to_string(), req.name.clone());
    let epoch = v
        .snapshot(|e| async move {
            cluster
                .take_snapshot(&vname, me, lease, e, &sname, created)
                .await
                .map_err(|err| match err {
                    // The answer was lost: it may have applied (Volume::snapshot stops
                    // serving at this epoch).
                    converge_control::ControlError::Etcd(_) => VolumeError::Control(
                        format!("recording snapshot {sname}: {err}; it may have been taken"),
                        vname.clone(),
                    ),
                    _ => VolumeError::Snapshot {
                        volume: vname.clone(),
                        why: format!("no snapshot taken: {err}"),
                    },
                })
        })
        .await
        .map_err(volume_error)?;
    log::info!("volume {name}: snapshot {} at epoch {epoch}", req.name);
    let (rec, _) = volume_record(node, name).await?;
    let s = rec
        .snapshots
        .iter()
        .find(|s| s.name == req.name)
        .cloned()
        .ok_or_else(|| ApiError::unavailable("the snapshot's record vanished"))?;
    let info = info(node, &rec, &s).await;
    Ok((
        StatusCode::CREATED,
        serde_json::to_value(info).map_err(|e| ApiError::bad(e.to_string()))?,
    ))
}

/// `DELETE /v1/volumes/NAME/snapshots/SNAP`: its space returns; the older snapshots keep
/// what they read. Cut short (a copy unreachable), it stays marked deleting and the same
/// request again finishes it.
pub(crate) async fn delete(node: &Arc<Node>, name: &str, snap: &str) -> Out {
    let (rec, _) = volume_record(node, name).await?;
    if !rec.snapshots.iter().any(|s| s.name == snap) {
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("volume {name} has no snapshot named {snap}"),
        ));
    }
    if let Some(r) = forward_to_owner(
        node,
        serving_owner(node, &rec).await?,
        "DELETE",
        &format!("/v1/volumes/{name}/snapshots/{snap}"),
        b"",
    )
    .await?
    {
        return Ok(r);
    }
    let v = served_here(node, name).await?;
    let Some(epoch) = node
        .cluster
        .mark_snapshot_deleting(name, snap)
        .await
        .map_err(ApiError::unavailable)?
    else {
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("volume {name} has no snapshot named {snap}"),
        ));
    };
    v.drop_snapshot(epoch).await.map_err(volume_error)?;
    node.cluster
        .remove_snapshot(name, snap)
        .await
        .map_err(ApiError::unavailable)?;
    log::info!("volume {name}: snapshot {snap} (epoch {epoch}) deleted");
    ok(&serde_json::json!({"deleted": snap}))
}

/// `POST /v1/volumes/NAME/snapshots/SNAP/rollback`: the volume becomes what the snapshot
/// holds (rewritten through the owner; snapshots stay). Clients should not write meanwhile.
pub(crate) async fn rollback(node: &Arc<Node>, name: &str, snap: &str) -> Out {
    let (rec, _) = volume_record(node, name).await?;
    let Some(s) = rec.snapshots.iter().find(|s| s.name == snap && !s.deleting) else {
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("volume {name} has no snapshot named {snap}"),
        ));
    };
    let epoch = s.epoch;
    if let Some(r) = forward_to_owner(
        node,
        serving_owner(node, &rec).await?,
        "POST",
        &format!("/v1/volumes/{name}/snapshots/{snap}/rollback"),
        b"",
    )
    .await?
    {
        return Ok(r);
    }
    let v = served_here(node, name).await?;
    let bytes = v.rollback(epoch).await.map_err(volume_error)?;
    log::info!("volume {name}: rolled back to snapshot {snap} ({bytes} bytes rewritten)");
    ok(&RolledBack {
        volume: name.to_string(),
        snapshot: snap.to_string(),
        bytes,
    })
}
