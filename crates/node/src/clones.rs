//! Clones (docs/SNAPSHOTS.md "Clones", docs/adr/0012 step 5): create a volume that reads as a
//! snapshot until written, flatten it, and the reader of its parent snapshot the owner
//! gets. Creating one is two etcd writes (the snapshot records the clone, so it cannot be
//! deleted under it; then the clone's record) and no data.

use crate::api::{forward_to_owner, ok, serving_owner, volume_record, ApiError, Out};
use crate::export::{Export, Exports};
use crate::node::Node;
use crate::snapshots::{served_here, volume_error};
use bytes::{Bytes, BytesMut};
use converge_api::{CreateClone, CreateVolume, Flattened};
use converge_control::model::ParentRecord;
use converge_nbd::{BlockDev, Resolver};
use converge_types::{Resiliency, MAX_IO_BYTES};
use converge_volume::{ParentRead, VolumeError};
use hyper::StatusCode;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Weak};

/// Most clones in a chain (a clone of a clone of …): each level of a read of a block no
/// clone wrote goes through one more export.
pub const CHAIN_MAX: usize = 16;

/// Reads a clone's parent snapshot through its export `VOLUME@SNAPSHOT` (served here when
/// this node owns the parent, else forwarded to its owner, re-routed on failover), opened
/// on first use.
struct ParentExport {
    node: Weak<Node>,
    /// The clone reading it.
    clone: String,
    link: ParentRecord,
    export: String,
    size_bytes: u64,
    dev: tokio::sync::OnceCell<Arc<Export>>,
}

pub(crate) fn parent_reader(node: &Node, clone: &str, p: &ParentRecord) -> Arc<dyn ParentRead> {
    Arc::new(ParentExport {
        node: node.me.get().cloned().unwrap_or_default(),
        clone: clone.to_string(),
        link: p.clone(),
        export: format!("{}@{}", p.volume, p.snapshot),
        size_bytes: p.size_bytes,
        dev: tokio::sync::OnceCell::new(),
    })
}

impl ParentExport {
    fn error(&self, why: impl std::fmt::Display) -> VolumeError {
        VolumeError::Control(
            format!("reading the parent snapshot {}: {why}", self.export),
            self.export.clone(),
        )
    }

    async fn read_inner(&self, offset: u64, len: u64) -> Result<Bytes, VolumeError> {
        let end = (offset + len).min(self.size_bytes);
        let mut buf = BytesMut::with_capacity(len as usize);
        if offset < end {
            let dev = self
                .dev
                .get_or_try_init(|| async {
                    let node = self
                        .node
                        .upgrade()
                        .ok_or_else(|| self.error("shutting down"))?;
                    Exports { node }
                        .resolve(&self.export)
                        .await
                        .map_err(|e| self.error(e))
                })
                .await?;
            let mut pos = offset;
            while pos < end {
                let n = (end - pos).min(MAX_IO_BYTES as u64);
                let data = dev
                    .read(pos, n as u32)
                    .await
                    .map_err(|e| VolumeError::Unreadable {
                        volume: self.export.clone(),
                        slab: converge_types::SlabIndex(0),
                        why: format!("the parent snapshot at {pos}: {}", e.message),
                    })?;
                buf.extend_from_slice(&data);
                pos += n;
            }
        }
        buf.resize(len as usize, 0);
        Ok(buf.freeze())
    }
}

impl ParentExport {
    /// A read that failed: if the clone's record no longer links this parent, the clone
    /// was flattened (by an owner before this one opened it, or by another term while this
    /// one was taking over) and its snapshot may be gone: every block it still lacks reads
    /// as zeros then (the flatten copied the others in).
    async fn read_or_flattened(&self, offset: u64, len: u64) -> Result<Bytes, VolumeError> {
        let e = match self.read_inner(offset, len).await {
            Ok(b) => return Ok(b),
            Err(e) => e,
        };
        let Some(node) = self.node.upgrade() else {
            return Err(e);
        };
        match node.cluster.volume(&self.clone).await {
            Ok(Some((rec, _))) if rec.parent.as_ref() != Some(&self.link) => {
                log::info!(
                    "volume {}: {} no longer its parent (flattened); its blocks not written read as zeros",
                    self.clone,
                    self.export
                );
                Ok(Bytes::from(vec![0u8; len as usize]))
            }
            _ => Err(e),
        }
    }
}

impl ParentRead for ParentExport {
    fn read(
        &self,
        offset: u64,
        len: u64,
    ) -> Pin<Box<dyn Future<Output = Result<Bytes, VolumeError>> + Send + '_>> {
        Box::pin(self.read_or_flattened(offset, len))
    }

    fn name(&self) -> String {
        self.export.clone()
    }
}

/// `POST /v1/volumes/NAME/snapshots/SNAP/clone` `{"name": NEW, ...}`: the clone, now.
pub(crate) async fn create(node: &Arc<Node>, name: &str, snap: &str, body: &[u8]) -> Out {
    let req: CreateClone = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("bad clone request: {e}")))?;
    let (parent, _) = volume_record(node, name).await?;
    if parent.encryption.is_some() {
        return Err(ApiError::bad(format!(
            "volume {name} is encrypted: clones of encrypted volumes are not supported yet"
        )));
    }
    let resiliency = req.resiliency.unwrap_or(parent.resiliency);
    if !matches!(
        resiliency,
        Resiliency::Simple | Resiliency::Mirror2 | Resiliency::Mirror3
    ) {
        return Err(ApiError::bad(format!(
            "a clone is simple, mirror-2 or mirror-3 (not {resiliency}): clones of parity \
             layouts are not supported yet; give --resiliency mirror-2 or mirror-3 (a parity \
             volume's snapshot can be cloned into one)"
        )));
    }
    // How deep the new clone would sit.
    let mut depth = 1;
    let mut up = parent.parent.clone();
    while let Some(p) = up {
        depth += 1;
        if depth > CHAIN_MAX {
            return Err(ApiError(
                StatusCode::CONFLICT,
                format!(
                    "volume {name} is already a clone {} levels deep; a chain holds at most \
                     {CHAIN_MAX}: flatten {name} first",
                    depth - 1
                ),
            ));
        }
        up = match node
            .cluster
            .volume(&p.volume)
            .await
            .map_err(ApiError::unavailable)?
        {
            Some((v, _)) => v.parent,
            None => None,
        };
    }
    if !parent
        .snapshots
        .iter()
        .any(|s| s.name == snap && !s.deleting)
    {
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("volume {name} has no snapshot named {snap}"),
        ));
    }
    if node
        .cluster
        .volume(&req.name)
        .await
        .map_err(ApiError::unavailable)?
        .is_some()
    {
        return Err(ApiError(
            StatusCode::CONFLICT,
            format!("a volume named {} already exists", req.name),
        ));
    }
    // The snapshot records the clone first: from here it cannot be deleted under it.
    let s = match node.cluster.pin_clone(name, snap, &req.name).await {
        Ok(Some(s)) => s,
        Ok(None) => {
            return Err(ApiError(
                StatusCode::NOT_FOUND,
                format!("volume {name} has no snapshot named {snap}"),
            ))
        }
        Err(converge_control::model::ControlError::Refused(m)) => {
            return Err(ApiError(StatusCode::CONFLICT, m))
        }
        Err(e) => return Err(ApiError::unavailable(e)),
    };
    let size = if s.size_bytes > 0 {
        s.size_bytes
    } else {
        parent.size_bytes
    };
    let create = CreateVolume {
        name: req.name.clone(),
        size_bytes: size,
        resiliency,
        owner: req.owner,
        min_replicas: None,
        mirror_part_bytes: None,
        compression: req.compression,
        encrypt: false,
        qos: req.qos,
    };
    let link = ParentRecord {
        volume: name.to_string(),
        snapshot: snap.to_string(),
        epoch: s.epoch,
        size_bytes: size,
    };
    match crate::api::create_volume_with(node, create, Some(link)).await {
        Ok(v) => {
            // The pin again: a delete of the snapshot that pruned it as stale meanwhile
            // (this clone's record did not exist yet) either sees it now, or has begun,
            // and then this clone must not stay.
            match node.cluster.pin_clone(name, snap, &req.name).await {
                Ok(Some(_)) => {}
                Ok(None) | Err(converge_control::model::ControlError::Refused(_)) => {
                    let undone = undo_clone(node, &req.name).await;
                    return Err(ApiError(
                        StatusCode::CONFLICT,
                        format!("snapshot {snap} of volume {name} was deleted meanwhile; {undone}"),
                    ));
                }
                Err(e) => {
                    // Whether the pin holds is unknown: the clone must not stay without it.
                    let undone = undo_clone(node, &req.name).await;
                    return Err(ApiError::unavailable(format!(
                        "the control plane did not confirm that snapshot {snap} of volume \
                         {name} keeps the clone ({e}); {undone}"
                    )));
                }
            }
            log::info!("created volume {} as a clone of {name}@{snap}", req.name);
            Ok((
                StatusCode::CREATED,
                serde_json::to_value(v).map_err(|e| ApiError::bad(e.to_string()))?,
            ))
        }
        Err(e) => {
            if let Err(u) = node.cluster.unpin_clone(name, snap, &req.name).await {
                log::warn!("unpinning {name}@{snap} after a failed clone: {u}");
            }
            Err(e)
        }
    }
}

/// Removes the record of a clone whose creation did not complete; says what became of it
/// (a record left behind names the command that removes it).
async fn undo_clone(node: &Arc<Node>, clone: &str) -> String {
    match node.cluster.delete_volume(clone).await {
        Ok(_) => format!("volume {clone} was not created"),
        Err(e) => {
            log::warn!("removing the record of clone {clone} whose creation did not complete: {e}");
            format!(
                "the record of volume {clone} could not be removed ({e}): remove it with \
                 `converge volume delete {clone}`"
            )
        }
    }
}

/// `POST /v1/volumes/NAME/flatten`: the clone copies what it still reads from its parent
/// and stops depending on it. Runs on the owner; the parent snapshot may then be deleted.
pub(crate) async fn flatten(node: &Arc<Node>, name: &str) -> Out {
    let (rec, _) = volume_record(node, name).await?;
    let Some(p) = rec.parent.clone() else {
        return Err(ApiError(
            StatusCode::CONFLICT,
            format!("volume {name} is not a clone (or was flattened already)"),
        ));
    };
    if let Some(r) = forward_to_owner(
        node,
        serving_owner(node, &rec).await?,
        "POST",
        &format!("/v1/volumes/{name}/flatten"),
        b"",
    )
    .await?
    {
        return Ok(r);
    }
    let v = served_here(node, name).await?;
    let bytes = v.flatten().await.map_err(volume_error)?;
    // Every block is the clone's own now: drop the link (compare-and-swap on the record),
    // then stop reading from the parent and let its snapshot go.
    loop {
        let (mut rec, rev) = volume_record(node, name).await?;
        if rec.parent.is_none() {
            break;
        }
        rec.parent = None;
        if node
            .cluster
            .update_volume(&rec, rev)
            .await
            .map_err(ApiError::unavailable)?
        {
            break;
        }
    }
    v.set_parent(None);
    if let Err(e) = node.cluster.unpin_clone(&p.volume, &p.snapshot, name).await {
        log::warn!("volume {name}: unpinning {}@{}: {e}", p.volume, p.snapshot);
    }
    log::info!(
        "volume {name}: flattened ({bytes} bytes copied from {}@{})",
        p.volume,
        p.snapshot
    );
    ok(&Flattened {
        volume: name.to_string(),
        parent: format!("{}@{}", p.volume, p.snapshot),
        bytes,
    })
}

/// Before snapshot `snap` of `name` is deleted: takes off the clones it records that no
/// longer read it (deleted, flattened, or never created: a clone whose creation failed
/// half way), so only live ones refuse the delete.
pub(crate) async fn prune_pins(node: &Node, name: &str, snap: &str) -> Result<(), ApiError> {
    let (rec, _) = volume_record(node, name).await?;
    let Some(s) = rec.snapshots.iter().find(|s| s.name == snap) else {
        return Ok(());
    };
    for c in &s.clones {
        let live = match node
            .cluster
            .volume(c)
            .await
            .map_err(ApiError::unavailable)?
        {
            Some((v, _)) => v
                .parent
                .is_some_and(|p| p.volume == name && p.snapshot == snap),
            None => false,
        };
        if !live {
            node.cluster
                .unpin_clone(name, snap, c)
                .await
                .map_err(ApiError::unavailable)?;
        }
    }
    Ok(())
}
