//! The pool's capacity as `converge status` reports it: raw, used, free, provisioned,
//! allocated, what a rebuild of the fullest node needs free elsewhere, how much volume data
//! each resiliency holds, how full the pool is (near-full, full) and whether provisioning
//! stays within the overcommit ratio (docs/CAPACITY.md). Pure arithmetic over what the API
//! lists, so it is tested here.

use converge_api::{Capacity, DriveInfo, NodeInfo, PoolState, VolumeInfo};
use converge_types::{format_size, DriveRole, NodeId, Resiliency};
use std::collections::BTreeMap;

/// At this share of raw capacity used (percent) the pool is near full: `status` warns.
pub const NEAR_FULL_PCT: u64 = 85;
/// At this share the pool is full (critical): writes to new slabs are about to fail.
pub const FULL_PCT: u64 = 95;

/// Below this many times the rebuild reserve free elsewhere, `status` warns ahead.
const RESERVE_MARGIN: f64 = 1.25;

/// The most volume data that `copies` copies on distinct nodes fit in, with `caps` bytes
/// per node: the largest `d` with Σ min(cap, d) ≥ copies × d (a node holds at most one
/// copy of each byte). Balanced nodes give Σ cap ÷ copies; fewer nodes than copies, 0.
pub fn distinct_fit(caps: &[u64], copies: u64) -> u64 {
    if copies == 0 || (caps.iter().filter(|c| **c > 0).count() as u64) < copies {
        return 0;
    }
    let fits = |d: u64| {
        caps.iter().map(|c| u128::from((*c).min(d))).sum::<u128>()
            >= u128::from(copies) * u128::from(d)
    };
    let (mut lo, mut hi) = (0u64, caps.iter().sum::<u64>() / copies);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

fn size(b: u64) -> String {
    const G: f64 = (1u64 << 30) as f64;
    format!("{:.1} GiB", b as f64 / G)
}

/// The pool's capacity from its nodes, drives and volumes (see [`Capacity`]).
/// A thin drive over this share of its data region is warned about.
const THIN_FULL: f64 = 0.85;

/// `overcommit_pct`: the overcommit ratio in effect, in percent (cluster settings).
pub fn account(
    nodes: &[NodeInfo],
    drives: &[DriveInfo],
    vols: &[VolumeInfo],
    overcommit_pct: u32,
) -> Capacity {
    let capacity = |d: &&DriveInfo| d.role == DriveRole::Capacity && d.failed.is_none();
    let mut cap: BTreeMap<NodeId, u64> = BTreeMap::new();
    let mut used: BTreeMap<NodeId, u64> = BTreeMap::new();
    // A drive's extents use what they claim: plain ones whole, compressed ones (on thin
    // drives, docs/adr/0010) what they store, blocks kept for snapshots what they take,
    // as its node last reported (`DriveUsage::claimed_bytes`).
    let claimed = |d: &DriveInfo| {
        d.committed_bytes
            .unwrap_or(d.extents_used * d.slab_size_bytes)
    };
    for d in drives.iter().filter(capacity) {
        *cap.entry(d.node).or_default() += d.extents_total * d.slab_size_bytes;
        *used.entry(d.node).or_default() += claimed(d);
    }
    let total: u64 = cap.values().sum();
    let used_all: u64 = drives.iter().map(claimed).sum();
    let caps: Vec<u64> = cap.values().copied().collect();
    // Every extent of a slab on its own node: a parity-K+M slab's K+M chunks fit like
    // K+M copies, and hold K chunks' worth of volume data.
    let mut policies = vec![
        Resiliency::Simple,
        Resiliency::Mirror2,
        Resiliency::Mirror3,
        Resiliency::Parity { data: 2, parity: 1 },
        Resiliency::Parity { data: 4, parity: 2 },
    ];
    for v in vols {
        if !policies.contains(&v.resiliency) {
            policies.push(v.resiliency);
        }
    }
    let usable = policies
        .into_iter()
        .map(|r| {
            let fit = distinct_fit(&caps, r.copies() as u64) * r.needed() as u64;
            (r.to_string(), fit)
        })
        .collect();
    // The node holding the most: its copies must fit in what the live nodes left have free.
    let fullest = used
        .iter()
        .max_by_key(|(n, u)| (**u, std::cmp::Reverse(**n)))
        .filter(|(_, u)| **u > 0)
        .map(|(n, u)| (*n, *u));
    let mut warnings = Vec::new();
    // Thin drives (docs/adr/0010) holding more extents than they hold plain: compressed
    // data that stops compressing needs room they may not have.
    for d in drives.iter().filter(capacity) {
        let cap_bytes = d.extents_total * d.slab_size_bytes;
        let (Some(c), true) = (d.committed_bytes, d.extents_used > d.extents_total) else {
            continue;
        };
        if cap_bytes > 0 && c as f64 >= cap_bytes as f64 * THIN_FULL {
            warnings.push(format!(
                "drive {:016x} (node {}) holds {} extents, more than the {} it holds \
                 uncompressed, and is {:.0}% full: if their data stops compressing, writes \
                 to them fail and their copies are rebuilt elsewhere; add drives or move \
                 volumes away",
                d.id.0,
                d.node,
                d.extents_used,
                d.extents_total,
                100.0 * c as f64 / cap_bytes as f64
            ));
        }
    }
    if let Some((n, reserve)) = fullest {
        let live = |id: &NodeId| nodes.iter().any(|x| x.id == *id && x.live && !x.draining);
        let free_elsewhere: u64 = cap
            .iter()
            .filter(|(id, _)| **id != n && live(id))
            .map(|(id, c)| c.saturating_sub(used.get(id).copied().unwrap_or(0)))
            .sum();
        if free_elsewhere < reserve {
            warnings.push(format!(
                "the pool can no longer rebuild node {n}: if it failed, its {} of copies \
                 would not fit in the {} free on the other live nodes; add drives or nodes, \
                 or delete volumes",
                size(reserve),
                size(free_elsewhere)
            ));
        } else if (free_elsewhere as f64) < reserve as f64 * RESERVE_MARGIN {
            warnings.push(format!(
                "the pool is close to not being able to rebuild node {n}: its {} of copies \
                 would need most of the {} free on the other live nodes",
                size(reserve),
                size(free_elsewhere)
            ));
        }
    }
    // Stored and saved, from the drives that told (every copy counts).
    let told: Vec<(u64, u64)> = drives
        .iter()
        .filter_map(|d| Some((d.written_bytes?, d.stored_bytes?)))
        .collect();
    let (stored_bytes, compression_saved_bytes) = if told.is_empty() {
        (None, None)
    } else {
        (
            Some(told.iter().map(|t| t.1).sum()),
            Some(told.iter().map(|t| t.0.saturating_sub(t.1)).sum()),
        )
    };
    let provisioned_bytes: u64 = vols.iter().map(provisioned).sum();
    if provisioned_bytes > total {
        warnings.push(format!(
            "the pool is overcommitted: {} provisioned is {:.2}× its {} raw (the overcommit \
             ratio allows {:.2}×): thin volumes can fill it before they are full; watch what \
             is used",
            format_size(provisioned_bytes),
            provisioned_bytes as f64 / total.max(1) as f64,
            format_size(total),
            f64::from(overcommit_pct) / 100.0
        ));
    }
    Capacity {
        state: PoolState::Ok,
        overcommit_pct,
        total_bytes: total,
        used_bytes: used_all,
        stored_bytes,
        compression_saved_bytes,
        provisioned_bytes,
        free_bytes: total.saturating_sub(used.values().sum()),
        allocated_bytes: vols.iter().map(|v| v.allocated_bytes).sum(),
        written_bytes: vols.iter().map(|v| v.written_bytes).sum(),
        rebuild_reserve_bytes: fullest.map_or(0, |f| f.1),
        rebuild_reserve_node: fullest.map(|f| f.0),
        usable_bytes: usable,
        warnings,
    }
}

/// Raw bytes a volume takes written full: a mirror part's bytes at its mirror, the rest at
/// the volume's resiliency.
fn provisioned(v: &VolumeInfo) -> u64 {
    provisioned_bytes(
        v.resiliency,
        v.size_bytes,
        v.mirror_part.as_ref().map(|m| (m.resiliency, m.size_bytes)),
    )
}

/// Raw bytes a volume of `size_bytes` takes written full ("provisioned"): every copy of a
/// mirror (mirror-3: 3×), K+M chunks per K of data for parity-K+M ((K+M)/K), and a mirror
/// part's bytes (`mirror_part`: its mirror and its size) at its mirror's instead.
pub fn provisioned_bytes(
    r: Resiliency,
    size_bytes: u64,
    mirror_part: Option<(Resiliency, u64)>,
) -> u64 {
    match mirror_part {
        Some((m, bytes)) => m.raw_bytes(bytes) + r.raw_bytes(size_bytes.saturating_sub(bytes)),
        None => r.raw_bytes(size_bytes),
    }
}

/// A create, resize or clone the overcommit ratio does not allow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "it would provision {} more of raw capacity ({what}), {} in all against the pool's {} \
     raw ({:.2}×), and the overcommit ratio allows {:.2}× ({}); delete volumes, add drives \
     or nodes, or raise the ratio (`converge cluster set --overcommit-ratio R`, \
     docs/CAPACITY.md)",
    format_size(*adding),
    format_size(*after),
    format_size(*raw),
    *after as f64 / (*raw).max(1) as f64,
    f64::from(*limit_pct) / 100.0,
    format_size(*allowed)
)]
pub struct OvercommitRefused {
    pub what: String,
    pub adding: u64,
    pub after: u64,
    pub raw: u64,
    pub allowed: u64,
    pub limit_pct: u32,
}

/// Whether provisioning `adding` raw bytes more (`what` says what they are) keeps the
/// pool's provisioned bytes (`provisioned` now) within `overcommit_pct` percent of `raw`.
pub fn check_overcommit(
    raw: u64,
    provisioned: u64,
    adding: u64,
    overcommit_pct: u32,
    what: &str,
) -> Result<(), OvercommitRefused> {
    let allowed = u128::from(raw) * u128::from(overcommit_pct) / 100;
    let after = u128::from(provisioned) + u128::from(adding);
    if adding == 0 || after <= allowed {
        return Ok(());
    }
    let clamp = |b: u128| u64::try_from(b).unwrap_or(u64::MAX);
    Err(OvercommitRefused {
        what: what.to_string(),
        adding,
        after: clamp(after),
        raw,
        allowed: clamp(allowed),
        limit_pct: overcommit_pct,
    })
}

/// Percent of raw capacity used, rounded down (a pool with no raw capacity and anything
/// used is 100 % used).
pub fn used_pct(c: &Capacity) -> u64 {
    if c.total_bytes == 0 {
        return if c.used_bytes > 0 { 100 } else { 0 };
    }
    (u128::from(c.used_bytes) * 100 / u128::from(c.total_bytes)) as u64
}

/// Sets how full the pool is from the share of raw capacity used and `unplaceable`: the
/// layouts of existing volumes no new slab of which fits now (each a line saying why), and
/// warns of it. Returns what the health line says of it (None: the pool is not short).
pub fn settle_state(c: &mut Capacity, unplaceable: &[String]) -> Option<String> {
    let pct = used_pct(c);
    let (state, health) = if pct >= FULL_PCT || !unplaceable.is_empty() {
        let why = if pct >= FULL_PCT {
            format!("{pct}% of raw capacity used (full at {FULL_PCT}%)")
        } else {
            format!(
                "no room for a new slab of {} ({pct}% of raw capacity used)",
                unplaceable
                    .iter()
                    .map(|l| l.split(':').next().unwrap_or(l))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        c.warnings.push(format!(
            "the pool is full: {why}; writes to space a volume has not allocated yet fail \
             with ENOSPC (\"No space left on device\"); free space (delete volumes or \
             snapshots, TRIM inside guests) or add drives or nodes"
        ));
        c.warnings.extend(unplaceable.iter().cloned());
        (PoolState::Full, format!("full: {why}"))
    } else if pct >= NEAR_FULL_PCT {
        c.warnings.push(format!(
            "the pool is near full: {pct}% of raw capacity used (near full at \
             {NEAR_FULL_PCT}%, full at {FULL_PCT}%); free space or add drives before writes \
             start failing with ENOSPC"
        ));
        (
            PoolState::NearFull,
            format!("near-full: {pct}% of raw capacity used"),
        )
    } else {
        (PoolState::Ok, String::new())
    };
    c.state = state;
    (state != PoolState::Ok).then_some(health)
}

#[cfg(test)]
mod tests {
    use super::*;
    use converge_types::{DriveId, MediaType};

    const G: u64 = 1 << 30;

    #[test]
    fn copies_on_distinct_nodes_fit_what_the_nodes_allow() {
        assert_eq!(distinct_fit(&[G, G, G], 3), G);
        assert_eq!(distinct_fit(&[G, G, G], 2), 3 * G / 2);
        assert_eq!(distinct_fit(&[G, G, G], 1), 3 * G);
        // Too few nodes for the copies: nothing.
        assert_eq!(distinct_fit(&[G, G], 3), 0);
        assert_eq!(distinct_fit(&[G, G, 0], 3), 0);
        // A big node cannot take more than one copy of each byte: 10 + 1 + 1 with three
        // copies holds 1, not 4.
        assert_eq!(distinct_fit(&[10 * G, G, G], 3), G);
        // Four nodes, one twice the others: mirror-2 fills them all, (2+1+1+1)/2.
        assert_eq!(distinct_fit(&[2 * G, G, G, G], 2), 5 * G / 2);
    }

    fn node(id: u32, live: bool) -> NodeInfo {
        NodeInfo {
            live,
            ..NodeInfo::down(NodeId(id))
        }
    }

    fn drive(node: u32, total: u64, used: u64) -> DriveInfo {
        DriveInfo {
            id: DriveId(u64::from(node)),
            node: NodeId(node),
            path: String::new(),
            role: DriveRole::Capacity,
            media: MediaType::Ssd,
            size_bytes: total * G,
            extents_total: total,
            extents_used: used,
            slab_size_bytes: G,
            failed: None,
            cache: None,
            written_bytes: None,
            stored_bytes: None,
            slots_total: None,
            committed_bytes: None,
            wear: None,
        }
    }

    /// Thin drives (docs/adr/0010): compressed extents count what they claim, not whole
    /// extents, and a drive holding more than it could plain is warned about when nearly
    /// full.
    #[test]
    fn thin_drives_count_what_their_extents_claim() {
        let nodes: Vec<NodeInfo> = (1..=3).map(|i| node(i, true)).collect();
        let thin = |n: u32, placed: u64, committed_g: u64| DriveInfo {
            slots_total: Some(20),
            committed_bytes: Some(committed_g * G),
            wear: None,
            ..drive(n, 10, placed)
        };
        // Node 1: 14 extents placed (more than the 10 that fit plain) in 9 GiB; node 2: 14
        // in 4 GiB; node 3: 3 plain extents.
        let drives = [thin(1, 14, 9), thin(2, 14, 4), drive(3, 10, 3)];
        let c = account(&nodes, &drives, &[], 100);
        assert_eq!(c.used_bytes, (9 + 4 + 3) * G);
        assert_eq!(c.free_bytes, (1 + 6 + 7) * G);
        assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
        assert!(
            c.warnings[0].contains("node 1") && c.warnings[0].contains("90% full"),
            "{:?}",
            c.warnings
        );
        // Blocks kept for snapshots count beyond whole extents: 2 extents placed and
        // 3 GiB claimed (`DriveUsage::claimed_bytes` folds a stale report in first).
        let c = account(&nodes, &[thin(1, 2, 3)], &[], 100);
        assert_eq!(c.used_bytes, 3 * G);
    }

    #[test]
    fn status_warns_before_the_fullest_node_cannot_be_rebuilt() {
        let nodes: Vec<NodeInfo> = (1..=4).map(|i| node(i, true)).collect();
        // 4 nodes of 10 GiB; node 2 holds the most (6), the others have 4 + 5 + 7 free.
        let drives = [
            drive(1, 10, 6),
            drive(2, 10, 6),
            drive(3, 10, 5),
            drive(4, 10, 3),
        ];
        let c = account(&nodes, &drives, &[], 100);
        assert_eq!(c.total_bytes, 40 * G);
        assert_eq!(c.used_bytes, 20 * G);
        assert_eq!(c.free_bytes, 20 * G);
        assert_eq!(c.rebuild_reserve_bytes, 6 * G);
        assert_eq!(
            c.rebuild_reserve_node,
            Some(NodeId(1)),
            "ties go to the lowest id"
        );
        assert_eq!(c.usable_bytes["simple"], 40 * G);
        assert_eq!(c.usable_bytes["mirror-2"], 20 * G);
        assert_eq!(c.usable_bytes["mirror-3"], 40 * G / 3);
        // Parity-2+1's 3 chunks fit like mirror-3's copies and hold twice the data.
        assert_eq!(c.usable_bytes["parity-2+1"], 40 * G / 3 * 2);
        assert_eq!(c.usable_bytes["parity-4+2"], 0, "4+2 needs 6 nodes");
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
        // Fuller: node 1 holds 8, the others 2 + 1 + 3 free (6 < 8): cannot rebuild.
        let drives = [
            drive(1, 10, 8),
            drive(2, 10, 8),
            drive(3, 10, 9),
            drive(4, 10, 7),
        ];
        let c = account(&nodes, &drives, &[], 100);
        assert_eq!(c.rebuild_reserve_node, Some(NodeId(3)));
        assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
        assert!(
            c.warnings[0].contains("can no longer rebuild node 3"),
            "{:?}",
            c.warnings
        );
        // Close: 9 held, 10 free elsewhere (< 9 × 1.25).
        let drives = [
            drive(1, 10, 9),
            drive(2, 10, 7),
            drive(3, 10, 7),
            drive(4, 10, 6),
        ];
        let c = account(&nodes, &drives, &[], 100);
        assert!(c.warnings[0].contains("close to"), "{:?}", c.warnings);
        // Space on a down node does not count: 7 held by node 1, 3 + 3 (+ 10 on node 4).
        let drives = [
            drive(1, 10, 7),
            drive(2, 10, 7),
            drive(3, 10, 7),
            drive(4, 10, 0),
        ];
        assert!(account(&nodes, &drives, &[], 100).warnings.is_empty());
        let mut down = nodes.clone();
        down[3].live = false;
        let c = account(&down, &drives, &[], 100);
        assert!(c.warnings[0].contains("can no longer"), "{:?}", c.warnings);
    }

    #[test]
    fn provisioned_bytes_count_each_resiliency_at_its_raw_cost() {
        let p21 = Resiliency::parity(2, 1).unwrap();
        let p42 = Resiliency::parity(4, 2).unwrap();
        assert_eq!(provisioned_bytes(Resiliency::Simple, G, None), G);
        assert_eq!(provisioned_bytes(Resiliency::Mirror2, G, None), 2 * G);
        assert_eq!(provisioned_bytes(Resiliency::Mirror3, 10 * G, None), 30 * G);
        assert_eq!(provisioned_bytes(p21, 10 * G, None), 15 * G);
        // A mirror part counts at its mirror, the rest at the parity.
        assert_eq!(
            provisioned_bytes(p42, 8 * G, Some((Resiliency::Mirror3, 2 * G))),
            6 * G + 9 * G
        );
    }

    /// The pool: 4.8 GiB provisioned on 3 GiB raw went through unwarned. With the
    /// default ratio (1.0) provisioning stops at raw; the operator may allow more.
    #[test]
    fn the_overcommit_ratio_bounds_what_volumes_provision() {
        let mib = 1 << 20;
        // 3 GiB raw, 1 GiB provisioned: 2 GiB more fit at 1.0×, not a byte more.
        check_overcommit(3 * G, G, 2 * G, 100, "x").unwrap();
        let e = check_overcommit(3 * G, G, 2 * G + 4096, 100, "640 MiB as mirror-3")
            .unwrap_err()
            .to_string();
        for part in [
            "(640 MiB as mirror-3)",
            "the pool's 3 GiB raw",
            "the overcommit ratio allows 1.00× (3 GiB)",
            "converge cluster set --overcommit-ratio R",
        ] {
            assert!(e.contains(part), "{e} lacks {part}");
        }
        // 3 GiB + 1.8 GiB on 3 GiB raw (1.6×): allowed at 1.6×, refused just below.
        let (now, more) = (3 * G, 1843 * mib);
        assert!(check_overcommit(3 * G, now, more, 100, "x").is_err());
        assert!(check_overcommit(3 * G, now, more, 159, "x").is_err());
        check_overcommit(3 * G, now, more, 161, "x").unwrap();
        // Nothing more (a resize to the same size) passes, even past the ratio already
        // (the ratio was lowered since).
        check_overcommit(3 * G, 9 * G, 0, 100, "x").unwrap();
        // No raw capacity at all: nothing may be provisioned.
        assert!(check_overcommit(0, 0, 4096, 100, "x").is_err());
    }

    /// Near full at 85 % of raw used, full at 95 % or when a new slab of some volume's
    /// layout does not fit; the health line and the warnings say so.
    #[test]
    fn the_pool_is_near_full_at_85_and_full_at_95_or_when_no_slab_fits() {
        let nodes: Vec<NodeInfo> = (1..=4).map(|i| node(i, true)).collect();
        let at = |used: [u64; 4]| {
            let d: Vec<DriveInfo> = (0..4).map(|i| drive(i as u32 + 1, 25, used[i])).collect();
            account(&nodes, &d, &[], 100)
        };
        let mut c = at([21, 21, 21, 21]);
        assert_eq!(used_pct(&c), 84);
        assert_eq!(settle_state(&mut c, &[]), None);
        assert_eq!(c.state, PoolState::Ok);
        let mut c = at([22, 21, 21, 21]);
        assert_eq!(
            settle_state(&mut c, &[]).as_deref(),
            Some("near-full: 85% of raw capacity used")
        );
        assert_eq!(c.state, PoolState::NearFull);
        assert!(
            c.warnings.iter().any(|w| w.contains("near full")),
            "{:?}",
            c.warnings
        );
        let mut c = at([24, 24, 24, 23]);
        assert_eq!(used_pct(&c), 95);
        let h = settle_state(&mut c, &[]).unwrap();
        assert!(h.starts_with("full: 95% of raw capacity used"), "{h}");
        assert_eq!(c.state, PoolState::Full);
        assert!(
            c.warnings.iter().any(|w| w.contains("ENOSPC")),
            "{:?}",
            c.warnings
        );
        // Half used, but no new mirror-3 slab fits (three nodes are full): full.
        let mut c = at([25, 25, 25, 0]);
        let why = "mirror-3 volumes: a slab of 3 copies or chunks needs 3 nodes".to_string();
        let h = settle_state(&mut c, std::slice::from_ref(&why)).unwrap();
        assert_eq!(
            h,
            "full: no room for a new slab of mirror-3 volumes (75% of raw capacity used)"
        );
        assert!(c.warnings.contains(&why), "{:?}", c.warnings);
    }

    #[test]
    fn status_warns_when_the_pool_is_overcommitted() {
        let nodes: Vec<NodeInfo> = (1..=3).map(|i| node(i, true)).collect();
        let drives: Vec<DriveInfo> = (1..=3).map(|n| drive(n, 1, 0)).collect();
        let vol = |size: u64| VolumeInfo {
            size_bytes: size,
            resiliency: Resiliency::Mirror3,
            ..serde_json::from_value(serde_json::json!({
                "id": 1, "name": "v", "size_bytes": 0, "resiliency": "mirror-3",
                "min_replicas": 2, "slab_size_bytes": G, "owner": 1, "owner_name": "n1",
                "uri": "", "slabs_allocated": 0, "allocated_bytes": 0,
                "degraded_extents": 0
            }))
            .unwrap()
        };
        let c = account(&nodes, &drives, &[vol(G)], 150);
        assert!(
            c.warnings.is_empty(),
            "3 GiB on 3 GiB raw: {:?}",
            c.warnings
        );
        assert_eq!((c.provisioned_bytes, c.overcommit_pct), (3 * G, 150));
        let c = account(&nodes, &drives, &[vol(G), vol(G / 2)], 150);
        assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
        assert!(
            c.warnings[0].contains("overcommitted") && c.warnings[0].contains("1.50×"),
            "{:?}",
            c.warnings
        );
    }
}
