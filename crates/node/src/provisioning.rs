//! What the cluster's records say about room, for the API: a volume create, resize or clone
//! is refused when it would take the volumes' provisioned bytes past the overcommit ratio,
//! and `status` calls the pool full when a new slab of an existing volume's layout no longer
//! fits (docs/CAPACITY.md). The arithmetic is in `capacity.rs`; this reads etcd for it.

use crate::api::ApiError;
use crate::capacity;
use crate::node::Node;
use converge_api::{NodeInfo, VolumeInfo};
use converge_control::model::VolumeRecord;
use converge_control::placement::{self, DriveLoad};
use converge_types::{format_size, DriveRole, Resiliency};
use hyper::StatusCode;
use std::collections::BTreeSet;

/// Raw bytes the volume's record provisions (its size at its resiliency, a mirror part at
/// its mirror).
pub fn of_record(rec: &VolumeRecord) -> u64 {
    let part = rec
        .resiliency
        .mirror_part()
        .filter(|_| rec.mirror_part_bytes > 0)
        .map(|m| (m, rec.mirror_part_bytes));
    capacity::provisioned_bytes(rec.resiliency, rec.size_bytes, part)
}

/// Refuses `doing` (e.g. "cannot create volume vm01") when provisioning `adding` more raw
/// bytes would pass the overcommit ratio. `what` names the volume bytes they stand for.
/// Reads the settings, the drives and every volume record: a create, resize or clone is
/// rare, and these are small (one record per volume and per drive).
pub async fn check(node: &Node, adding: u64, what: String, doing: &str) -> Result<(), ApiError> {
    let settings = crate::repair::settings(node).await;
    let failed = node
        .cluster
        .failed_drives()
        .await
        .map_err(ApiError::unavailable)?;
    let raw: u64 = node
        .cluster
        .drives()
        .await
        .map_err(ApiError::unavailable)?
        .iter()
        .filter(|d| d.role == DriveRole::Capacity && !failed.contains_key(&d.id))
        .map(|d| d.extents_total * d.slab_size_bytes)
        .sum();
    let provisioned: u64 = node
        .cluster
        .volumes()
        .await
        .map_err(ApiError::unavailable)?
        .iter()
        .map(of_record)
        .sum();
    capacity::check_overcommit(raw, provisioned, adding, settings.overcommit_pct(), &what)
        .map_err(|e| ApiError(StatusCode::CONFLICT, format!("{doing}: {e}")))
}

/// What `what` says of a volume's bytes: "a 640 MiB mirror-3 volume, 3 copies".
pub fn describe(size_bytes: u64, r: Resiliency) -> String {
    let per = if r.is_parity() {
        format!("{} chunks per {} of data", r.copies(), r.needed())
    } else if r.copies() == 1 {
        "one copy".to_string()
    } else {
        format!("{} copies", r.copies())
    };
    format!("{} as {r}, {per}", format_size(size_bytes))
}

/// The layouts of existing volumes no new slab of which fits now on `loads` (the drives as
/// placement sees them; None: unknown), each a line "mirror-3 volumes: why" (compressed
/// volumes are placed by extent slots, docs/adr/0010). Nothing while a node is down or
/// away: placement then fails for want of nodes, which the health line already says, not
/// for want of space.
pub fn unplaceable(
    loads: Option<&[DriveLoad]>,
    nodes: &[NodeInfo],
    vols: &[VolumeInfo],
) -> Vec<String> {
    if vols.is_empty() || nodes.iter().any(|n| !n.live || n.maintenance || n.draining) {
        return Vec::new();
    }
    let Some(loads) = loads else {
        return Vec::new();
    };
    let mut layouts: BTreeSet<(String, usize, bool)> = BTreeSet::new();
    for v in vols {
        let thin = !v.compression.is_none();
        layouts.insert((v.resiliency.to_string(), v.resiliency.copies(), thin));
        if let Some(m) = &v.mirror_part {
            layouts.insert((m.resiliency.to_string(), m.resiliency.copies(), thin));
        }
    }
    let by_slots: Vec<_> = loads.iter().map(|d| d.by_slots()).collect();
    layouts
        .into_iter()
        .filter_map(|(name, copies, thin)| {
            let l = if thin { &by_slots[..] } else { loads };
            let e = placement::place(copies, l, &[]).err()?;
            let kind = if thin { " compressed" } else { "" };
            Some(format!("{name}{kind} volumes: {e}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use converge_types::{Compression, DriveId, NodeId};

    fn vol(r: &str, compression: Compression) -> VolumeInfo {
        let mut v: VolumeInfo = serde_json::from_value(serde_json::json!({
            "id": 1, "name": "v", "size_bytes": 1, "resiliency": r, "min_replicas": 1,
            "slab_size_bytes": 1, "owner": 1, "owner_name": "n1", "uri": "",
            "slabs_allocated": 0, "allocated_bytes": 0, "degraded_extents": 0
        }))
        .expect("a volume");
        v.compression = compression;
        v
    }

    fn load(node: u32, total: u64, used: u64) -> DriveLoad {
        DriveLoad {
            drive: DriveId(u64::from(node)),
            node: NodeId(node),
            extents_total: total,
            extents_used: used,
            slots_total: 2 * total,
            slots_used: used,
            live: true,
            role: DriveRole::Capacity,
        }
    }

    /// A pool is full for a layout when a new slab of it cannot be placed: node 3 is full,
    /// so mirror-3 slabs do not fit while mirror-2 ones still do; compressed volumes count
    /// slots; a node down says nothing of space.
    #[test]
    fn a_layout_is_unplaceable_when_no_new_slab_of_it_fits() {
        let nodes: Vec<NodeInfo> = (1..=3)
            .map(|i| NodeInfo {
                live: true,
                ..NodeInfo::down(NodeId(i))
            })
            .collect();
        let loads = [load(1, 4, 1), load(2, 4, 2), load(3, 4, 4)];
        let vols = [
            vol("mirror-3", Compression::None),
            vol("mirror-2", Compression::None),
        ];
        let u = unplaceable(Some(&loads), &nodes, &vols);
        assert_eq!(u.len(), 1, "{u:?}");
        assert!(u[0].starts_with("mirror-3 volumes: "), "{u:?}");
        assert!(u[0].contains("node 3: 0 free of 4 slabs"), "{u:?}");
        // Compressed mirror-3 volumes are placed by slots: node 3 has 4 left.
        let zstd = [vol("mirror-3", Compression::Zstd)];
        assert!(unplaceable(Some(&loads), &nodes, &zstd).is_empty());
        // A node down: nothing (the health line says degraded).
        let mut down = nodes.clone();
        down[0].live = false;
        assert!(unplaceable(Some(&loads), &down, &vols).is_empty());
        assert!(unplaceable(None, &nodes, &vols).is_empty());
    }
}
