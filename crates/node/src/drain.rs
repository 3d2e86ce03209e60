//! Removing a node for good, in two API calls the CLI's `converge node remove` makes:
//!
//! 1. `POST /v1/nodes/ID/drain {on: true}` marks the node draining, after checking that
//!    the other nodes can hold every copy it has (distinct nodes per slab, room). From
//!    then on placement skips its drives, and the owners of its copies move them elsewhere,
//!    copy before drop (`converge_allocator::repair::evacuations`, run by the repair
//!    loop): a slab never has fewer in-sync copies than before. `{on: false}` cancels.
//! 2. `DELETE /v1/nodes/ID`, once no slab record names its drives: its volumes move to
//!    other nodes, then one etcd transaction deletes its drive and node records and records
//!    its id as removed. The node sees that and exits; a removed id never registers again.

use crate::api::{move_volume, nodes, ok, serving_owner, slab_map, ApiError, Out};
use crate::node::{drive_loads, Node};
use converge_api::{Drain, MoveVolume, NodeRemoved};
use converge_control::placement::DriveLoad;
use converge_types::{DriveRole, NodeId};
use hyper::StatusCode;
use std::collections::BTreeSet;
use std::sync::Arc;

fn conflict(msg: String) -> ApiError {
    ApiError(StatusCode::CONFLICT, msg)
}

fn node_id(id: &str) -> Result<NodeId, ApiError> {
    id.parse()
        .map(NodeId)
        .map_err(|_| ApiError::bad(format!("node id {id:?} is not a number")))
}

/// The nodes that may take copies instead of `id` among `loads`: live, neither in
/// maintenance nor draining, with a capacity drive that has not failed.
fn receivers(loads: &[DriveLoad], id: NodeId) -> BTreeSet<NodeId> {
    loads
        .iter()
        .filter(|l| l.live && l.node != id && l.role == DriveRole::Capacity)
        .map(|l| l.node)
        .collect()
}

async fn loads(node: &Node) -> Result<Vec<DriveLoad>, ApiError> {
    drive_loads(&node.cluster)
        .await
        .map_err(ApiError::unavailable)
}

/// `POST /v1/nodes/ID/drain`.
pub async fn drain(node: &Arc<Node>, id: &str, body: &[u8]) -> Out {
    let req: Drain = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("bad drain request: {e}")))?;
    let id = node_id(id)?;
    if !nodes(node).await?.iter().any(|n| n.id == id) {
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("no node {id} in this cluster; `converge node list` shows them"),
        ));
    }
    if !req.on {
        node.cluster
            .set_draining(id, false)
            .await
            .map_err(ApiError::unavailable)?;
        log::info!("node {id} is no longer drained; copies already moved stay where they are");
        return ok(&nodes(node).await?);
    }
    let loads = loads(node).await?;
    let to = receivers(&loads, id);
    let free: u64 = loads
        .iter()
        .filter(|l| to.contains(&l.node) && l.role == DriveRole::Capacity)
        .map(|l| l.extents_total.saturating_sub(l.extents_used))
        .sum();
    let leaving: u64 = loads
        .iter()
        .filter(|l| l.node == id && l.role == DriveRole::Capacity)
        .map(|l| l.extents_used)
        .sum();
    let vols = node
        .cluster
        .volumes()
        .await
        .map_err(ApiError::unavailable)?;
    for v in &vols {
        // A mirror part's slabs need fewer nodes than the parity ones.
        let copies = v.resiliency.copies();
        if copies > to.len() {
            let slabs = slab_map(node, v.id).await?;
            if slabs
                .values()
                .any(|s| s.extents.iter().any(|e| e.node == id))
            {
                return Err(conflict(format!(
                    "refused: volume {} keeps {copies} copies on distinct nodes, and without \
                     node {id} only {} node(s) can hold them ({to:?}); add a node first \
                     (`converge node join-token`), or bring back nodes that are down or in \
                     maintenance",
                    v.name,
                    to.len(),
                )));
            }
        }
    }
    if leaving > free {
        return Err(conflict(format!(
            "refused: node {id} holds {leaving} extents and the other nodes have room for \
             {free}; add capacity first"
        )));
    }
    node.cluster
        .set_draining(id, true)
        .await
        .map_err(ApiError::unavailable)?;
    log::info!("node {id} is being drained: {leaving} extents move to nodes {to:?}");
    ok(&nodes(node).await?)
}

/// `DELETE /v1/nodes/ID`: removes a drained node (see the module docs).
pub async fn remove(node: &Arc<Node>, id: &str) -> Out {
    let id = node_id(id)?;
    let info = nodes(node).await?;
    let Some(n) = info.iter().find(|n| n.id == id) else {
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("no node {id} in this cluster; `converge node list` shows them"),
        ));
    };
    if !n.draining {
        return Err(conflict(format!(
            "refused: node {id} still holds data; drain it first (`converge node remove {id}` \
             drains and then removes it)"
        )));
    }
    let vols = node
        .cluster
        .volumes()
        .await
        .map_err(ApiError::unavailable)?;
    let mut left = 0usize;
    for v in &vols {
        let slabs = slab_map(node, v.id).await?;
        left += slabs
            .values()
            .map(|s| s.extents.iter().filter(|e| e.node == id).count())
            .sum::<usize>();
    }
    if left > 0 {
        return Err(conflict(format!(
            "refused: node {id} still holds {left} copies; the drain is moving them \
             (`converge status` lists the jobs)"
        )));
    }
    // Its volumes go to other nodes first (as for maintenance).
    let to: Vec<NodeId> = receivers(&loads(node).await?, id).into_iter().collect();
    let mut moved = Vec::new();
    for v in &vols {
        if serving_owner(node, v).await? != id {
            continue;
        }
        let Some(target) = to.first() else {
            return Err(conflict(format!(
                "refused: node {id} serves volume {} and no other live node can take it",
                v.name
            )));
        };
        let body = serde_json::to_vec(&MoveVolume { to: *target }).unwrap_or_default();
        move_volume(node, &v.name, &body).await?;
        if serving_owner(node, v).await? == id {
            return Err(ApiError::unavailable(format!(
                "volume {} is still served by node {id}; try again",
                v.name
            )));
        }
        moved.push(v.name.clone());
    }
    let drives = node
        .cluster
        .drives()
        .await
        .map_err(ApiError::unavailable)?
        .iter()
        .filter(|d| d.node == id)
        .map(|d| d.id)
        .collect();
    let revoked = node
        .cluster
        .decommission(id)
        .await
        .map_err(ApiError::unavailable)?;
    // Its certificates are refused here at once, on the other nodes as soon as their
    // watch of the revocation list says so.
    node.revocations
        .add(Some(id.0), revoked.iter().map(|r| r.serial.clone()));
    log::info!(
        "node {id} was removed from the cluster (drives {drives:?}, moved {moved:?}, \
         certificates revoked {:?})",
        revoked.iter().map(|r| &r.serial).collect::<Vec<_>>()
    );
    ok(&NodeRemoved {
        node: id,
        moved,
        drives,
    })
}
