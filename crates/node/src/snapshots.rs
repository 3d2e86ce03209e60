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
        clones: s.clones.clone(),
        kept_bytes: None,
        freed_by_delete_bytes: None,
        space_copies_unanswered: None,
    }
}

/// `GET /v1/volumes/NAME/snapshots[?space=1]`: oldest first; one being deleted is not
/// listed. With `space=1` the volume's owner (asked through this node) adds what the
/// drives keep for each snapshot and what deleting it would free.
pub(crate) async fn list(node: &Arc<Node>, name: &str, query: &str) -> Out {
    let space = match query {
        "" | "space=0" => false,
        "space=1" => true,
        other => {
            return Err(ApiError::bad(format!(
                "unknown query {other:?}: the snapshot list takes space=1 (or nothing)"
            )))
        }
    };
    let (rec, _) = volume_record(node, name).await?;
    let mut out = Vec::new();
    for s in rec.snapshots.iter().filter(|s| !s.deleting) {
        out.push(info(node, &rec, s).await);
    }
    if !space || out.is_empty() {
        return ok(&out);
    }
    let v = match serving_for_read(node, &rec).await? {
        ReadAt::Here(v) => v,
        ReadAt::Owner(owner) => {
            let path = format!("/v1/volumes/{name}/snapshots?space=1");
            return forward_read(node, &rec, owner, &path).await;
        }
    };
    let (figures, unanswered) = v.snapshot_space().await.map_err(volume_error)?;
    for i in out.iter_mut() {
        if let Some(f) = figures.iter().find(|f| f.snapshot == i.epoch) {
            i.kept_bytes = Some(f.kept_bytes);
            i.freed_by_delete_bytes = Some(f.freed_by_delete_bytes);
            i.space_copies_unanswered = Some(unanswered);
        }
    }
    ok(&out)
}

/// Where a read-only question about a volume is answered.
pub(crate) enum ReadAt {
    /// This node serves it.
    Here(Arc<Vol>),
    /// Another live node does.
    Owner(converge_types::NodeId),
}

/// Where a `GET` about `rec`'s volume is answered, without changing who serves it: here if
/// this node serves it, else by its owner. A read never opens a volume (that would take it
/// over: a new epoch, every copy fenced, from a read-only token): one nobody serves is
/// refused, saying how to have it served.
pub(crate) async fn serving_for_read(
    node: &Arc<Node>,
    rec: &VolumeRecord,
) -> Result<ReadAt, ApiError> {
    if let Some(v) = node.volumes.lock().await.get(&rec.name) {
        return Ok(ReadAt::Here(v.clone()));
    }
    match node
        .cluster
        .owner(rec.id)
        .await
        .map_err(ApiError::unavailable)?
    {
        Some(o) if o.node != node.cfg.node_id => Ok(ReadAt::Owner(o.node)),
        _ => Err(not_served(&rec.name)),
    }
}

fn not_served(name: &str) -> ApiError {
    ApiError(
        StatusCode::CONFLICT,
        format!(
            "volume {name} is not served by any node now, and a read does not make one take it \
             over: have it served first (a client attached to it, a snapshot taken, or \
             `converge volume move {name} --to NODE`), then ask again"
        ),
    )
}

/// Forwards a read to the volume's owner; an owner that is gone serves nothing.
async fn forward_read(
    node: &Arc<Node>,
    rec: &VolumeRecord,
    owner: converge_types::NodeId,
    path: &str,
) -> Out {
    match forward_to_owner(node, owner, "GET", path, b"").await? {
        Some(r) => Ok(r),
        None => Err(not_served(&rec.name)),
    }
}

/// The volume as this node serves it (it is the serving owner, or takes it over).
pub(crate) async fn served_here(node: &Arc<Node>, name: &str) -> Result<Arc<Vol>, ApiError> {
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

pub(crate) fn volume_error(e: VolumeError) -> ApiError {
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
    let noter = node.cluster.clone();
    let note =
        |e| async move { converge_allocator::snapshots::note_snapshot(&noter, name, me, e).await };
    let taken = v
        .snapshot_noted(note, |e| async move {
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
        .await;
    if taken.is_err() && !v.is_retired() {
        // Still serving: it undid its floors or marked their copies stale, so this term's
        // epoch stays listed for the next term; strays of earlier terms go now.
        release_stray_floors(&node.cluster, &v).await;
    }
    let epoch = taken.map_err(volume_error)?;
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
    crate::clones::prune_pins(node, name, snap).await?;
    let Some(epoch) = node
        .cluster
        .mark_snapshot_deleting(name, snap)
        .await
        .map_err(|e| match e {
            converge_control::ControlError::Refused(m) => ApiError(StatusCode::CONFLICT, m),
            other => ApiError::unavailable(other),
        })?
    else {
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("volume {name} has no snapshot named {snap}"),
        ));
    };
    v.drop_snapshot(epoch).await.map_err(volume_error)?;
    // A copy out of sync did not take the delete: its epoch stays listed until released.
    node.cluster
        .remove_snapshot_left_on(name, snap, v.has_copies_out_of_sync())
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

/// The parameters of `GET /v1/volumes/NAME/changes`: `from` (a snapshot, required), `to`
/// (a newer snapshot; absent: now), `offset` and `length` (bytes; default: the whole
/// volume). Names are plain (snapshot names need no escaping); unknown keys are refused.
struct ChangesQuery {
    from: String,
    to: Option<String>,
    offset: Option<u64>,
    length: Option<u64>,
}

fn changes_query(q: &str) -> Result<ChangesQuery, ApiError> {
    let mut out = ChangesQuery {
        from: String::new(),
        to: None,
        offset: None,
        length: None,
    };
    let number = |k: &str, v: &str| {
        v.parse::<u64>()
            .map_err(|_| ApiError::bad(format!("{k}={v:?} is not a number of bytes")))
    };
    for kv in q.split('&').filter(|s| !s.is_empty()) {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        match k {
            "from" => out.from = v.to_string(),
            "to" => out.to = Some(v.to_string()),
            "offset" => out.offset = Some(number(k, v)?),
            "length" => out.length = Some(number(k, v)?),
            _ => {
                return Err(ApiError::bad(format!(
                    "unknown parameter {k:?}: changes take from=SNAP, to=SNAP, offset=BYTES, \
                     length=BYTES"
                )))
            }
        }
    }
    if out.from.is_empty() {
        return Err(ApiError::bad(
            "changes need from=SNAPSHOT (and optionally to=SNAPSHOT; absent: now)",
        ));
    }
    Ok(out)
}

/// `GET /v1/volumes/NAME/changes?from=A[&to=B][&offset=O&length=L]`: the runs that read
/// differently at snapshot A and at B (or now), from the copies' block metadata (no data
/// is read). Answered by the volume's serving owner.
pub(crate) async fn changes(node: &Arc<Node>, name: &str, query: &str) -> Out {
    let q = changes_query(query)?;
    let (rec, _) = volume_record(node, name).await?;
    let find = |snap: &str| {
        rec.snapshots
            .iter()
            .find(|s| s.name == snap && !s.deleting)
            .cloned()
            .ok_or_else(|| {
                ApiError(
                    StatusCode::NOT_FOUND,
                    format!("volume {name} has no snapshot named {snap}"),
                )
            })
    };
    let from = find(&q.from)?;
    let to = q.to.as_deref().map(find).transpose()?;
    if let Some(t) = &to {
        if t.epoch <= from.epoch {
            return Err(ApiError::bad(format!(
                "snapshot {} is not newer than {}: changes go from the older to the newer",
                t.name, from.name
            )));
        }
    }
    let v = match serving_for_read(node, &rec).await? {
        ReadAt::Here(v) => v,
        ReadAt::Owner(owner) => {
            let path = format!("/v1/volumes/{name}/changes?{query}");
            return forward_read(node, &rec, owner, &path).await;
        }
    };
    let size = match &to {
        Some(t) if t.size_bytes > 0 => t.size_bytes.min(v.size_bytes()),
        _ => v.size_bytes(),
    };
    let offset = q.offset.unwrap_or(0);
    let length = q.length.unwrap_or(size.saturating_sub(offset));
    if offset.checked_add(length).is_none_or(|e| e > size) {
        return Err(ApiError::bad(format!(
            "offset {offset} + length {length} is past the end of volume {name} ({size} bytes)"
        )));
    }
    let bs = converge_types::BLOCK_SIZE as u64;
    let mut runs: Vec<converge_api::ChangedRun> = Vec::new();
    let mut pos = offset;
    while pos < offset + length {
        let len = (offset + length - pos).min(converge_volume::CHANGES_MAX_BYTES);
        let bits = v
            .changed(from.epoch, to.as_ref().map(|t| t.epoch), pos, len)
            .await
            .map_err(volume_error)?;
        let base = pos / bs * bs;
        for (i, w) in bits.iter().enumerate() {
            let mut w = *w;
            while w != 0 {
                let b = w.trailing_zeros() as u64;
                w &= w - 1;
                let at = base + (i as u64 * 64 + b) * bs;
                match runs.last_mut() {
                    Some(r) if r.offset + r.length == at => r.length += bs,
                    _ => runs.push(converge_api::ChangedRun {
                        offset: at,
                        length: bs,
                    }),
                }
            }
        }
        pos += len;
    }
    ok(&converge_api::Changes {
        volume: name.to_string(),
        from: from.name,
        to: to.map(|t| t.name),
        offset,
        length,
        size_bytes: size,
        changed_bytes: runs.iter().map(|r| r.length).sum(),
        runs,
    })
}

/// After a takeover (spawned once the volume serves), a snapshot that failed while the
/// volume is still served, and a resync: what copies keep for epochs that are no snapshot
/// of the volume is released (`converge_allocator::snapshots::release_stray_floors`).
pub(crate) async fn release_stray_floors(cluster: &converge_control::Cluster, v: &Vol) {
    if let Err(e) = converge_allocator::snapshots::release_stray_floors(cluster, v).await {
        log::warn!(
            "volume {}: releasing what copies keep for epochs that are no snapshot: {e}",
            v.config().name
        );
    }
}
