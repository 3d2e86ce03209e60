//! Placement: which drives hold a slab's copies. Pure functions so the leader, the CLI's
//! create-time check and the simulation all decide the same way.
//!
//! Rules (DESIGN.md, control plane): the copies of a slab go to capacity drives on distinct
//! live nodes (a node is the fault domain). Balance is kept at both levels the copies land
//! on: the least-used *nodes* (used fraction of their capacity drives) take the copies, each
//! on its least-used drive. Ranking nodes, not drives, matters because a node takes at most
//! one copy of a slab: ranking drives alone lets a node whose drives all lag behind fall
//! further back whenever its drives lose ties, so it ends with unequal drives. Ties break on
//! the best drive's use, then drive id, so a placement is reproducible.
//!
//! The guarantee (tested below): on equal capacity drives, the same number per node, placing
//! slab after slab keeps every drive's used extents within one of every other's, so when
//! the copies divide evenly every drive holds the same number.

use converge_types::{format_size, DriveId, DriveRole, NodeId, Resiliency};
use std::cmp::Ordering;
use std::collections::BTreeMap;

/// A drive as placement sees it.
///
/// A thin drive (docs/adr/0010) has more extent slots than its data region holds extents
/// uncompressed: its extents are counted by the room they claim (`extents_used`: plain
/// ones whole, compressed ones what they store, as its node last reported), and by the
/// slots they take (`slots_used`). Placement needs both: room for one more whole extent,
/// and a free slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DriveLoad {
    pub drive: DriveId,
    pub node: NodeId,
    /// Extents (slab-sized) the drive's data region holds uncompressed.
    pub extents_total: u64,
    /// Extents' worth of room its extents claim.
    pub extents_used: u64,
    /// Extent slots it has (at least `extents_total`).
    pub slots_total: u64,
    /// Extents placed on it (slab records).
    pub slots_used: u64,
    /// Whether its node is live.
    pub live: bool,
    pub role: DriveRole,
}

impl DriveLoad {
    fn free(&self) -> u64 {
        self.extents_total
            .saturating_sub(self.extents_used)
            .min(self.slots_total.saturating_sub(self.slots_used))
    }
    fn usable(&self) -> bool {
        self.live && self.role == DriveRole::Capacity && self.free() > 0
    }

    /// The drive counted by slots alone: what a compressed volume may be provisioned on
    /// (its data's room depends on how it compresses, which nothing knows in advance).
    pub fn by_slots(&self) -> DriveLoad {
        DriveLoad {
            extents_total: self.slots_total,
            extents_used: self.slots_used,
            ..*self
        }
    }
}

/// Why copies cannot be placed, in the user's terms.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("a slab needs at least one copy; got {copies}")]
    NoCopies { copies: usize },
    #[error("slab size must be above 0 bytes")]
    ZeroSlabSize,
    #[error(
        "{layout} needs {copies} nodes with free capacity; only {available} live node{s} \
         {have} capacity drives with free space ({detail}); add nodes or drives, or free space",
        s = if *available == 1 { "" } else { "s" },
        have = if *available == 1 { "has" } else { "have" }
    )]
    NotEnoughNodes {
        layout: String,
        copies: usize,
        available: usize,
        /// Nodes that are down and would have room: with them back, `available + down`.
        down: usize,
        detail: String,
    },
    #[error(
        "a {size} volume as {layout} needs {needed} extents ({slabs} slabs × {copies} {unit}, \
         each {one} of a slab on another node), but live nodes can hold only {usable} more \
         ({detail}); add drives or nodes, free space, or create a smaller volume",
        unit = if layout.starts_with("parity") { "chunks" } else { "copies" },
        one = if layout.starts_with("parity") { "chunk" } else { "copy" }
    )]
    NotEnoughCapacity {
        size: String,
        layout: String,
        copies: usize,
        slabs: u64,
        needed: u128,
        usable: u128,
        detail: String,
    },
}

impl PlacementError {
    /// The copies could be placed once the nodes that are down are back: not a full pool
    /// (a node restarting in a rolling upgrade), so a write waits rather than fail as one.
    pub fn waits_for_nodes(&self) -> bool {
        matches!(self, PlacementError::NotEnoughNodes { copies, available, down, .. }
            if *down > 0 && available + down >= *copies)
    }
}

/// A slab of `copies` extents in the user's words (allocation knows the count, not the
/// resiliency: a mirror's copies or a parity slab's chunks).
fn layout_name(copies: usize) -> String {
    match copies {
        1 => "a slab of one copy".to_string(),
        n => format!("a slab of {n} copies or chunks"),
    }
}

/// Per node: free and total extents over its live capacity drives, or why it has none.
#[derive(Default)]
struct NodeSummary {
    free: u64,
    /// Free extents of its capacity drives whether or not it is live.
    free_when_up: u64,
    total: u64,
    capacity_drives: usize,
    live: bool,
    excluded: bool,
}

fn summarize(candidates: &[DriveLoad], exclude_nodes: &[NodeId]) -> BTreeMap<NodeId, NodeSummary> {
    let mut nodes: BTreeMap<NodeId, NodeSummary> = BTreeMap::new();
    for d in candidates {
        let n = nodes.entry(d.node).or_default();
        n.excluded = exclude_nodes.contains(&d.node);
        if d.live {
            n.live = true;
        }
        if d.role == DriveRole::Capacity {
            n.free_when_up += d.free();
        }
        if d.live && d.role == DriveRole::Capacity {
            n.capacity_drives += 1;
            n.free += d.free();
            n.total += d.extents_total;
        }
    }
    nodes
}

/// Nodes that are down but would have room (and hold no copy of the slab yet).
fn down_with_room(nodes: &BTreeMap<NodeId, NodeSummary>) -> usize {
    nodes
        .values()
        .filter(|n| !n.live && !n.excluded && n.free_when_up > 0)
        .count()
}

fn describe(nodes: &BTreeMap<NodeId, NodeSummary>) -> String {
    if nodes.is_empty() {
        return "no drives are registered".to_string();
    }
    nodes
        .iter()
        .map(|(id, n)| {
            if !n.live {
                format!("node {id}: down")
            } else if n.excluded {
                format!("node {id}: already holds a copy")
            } else if n.capacity_drives == 0 {
                format!("node {id}: no capacity drives")
            } else {
                format!("node {id}: {} free of {} slabs", n.free, n.total)
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Orders drives by used fraction (least used first), then by drive id.
fn by_load(a: &DriveLoad, b: &DriveLoad) -> Ordering {
    by_fraction(
        a.extents_used,
        a.extents_total,
        b.extents_used,
        b.extents_total,
    )
    .then(a.drive.cmp(&b.drive))
}

/// used_a / total_a vs used_b / total_b, exactly, in integers.
fn by_fraction(used_a: u64, total_a: u64, used_b: u64, total_b: u64) -> Ordering {
    let lhs = u128::from(used_a) * u128::from(total_b);
    let rhs = u128::from(used_b) * u128::from(total_a);
    lhs.cmp(&rhs)
}

/// A node as a placement candidate: its use over all its live capacity drives, and its
/// least-used drive with free space.
struct NodeCandidate {
    used: u64,
    total: u64,
    best: DriveLoad,
}

/// Orders nodes by used fraction, then by their best drive (its use, then its id).
fn by_node_load(a: &NodeCandidate, b: &NodeCandidate) -> Ordering {
    by_fraction(a.used, a.total, b.used, b.total).then(by_load(&a.best, &b.best))
}

/// Picks `copies` capacity drives on distinct live nodes not in `exclude_nodes` (e.g. nodes
/// that already hold a copy of the slab): the least-used nodes, each's least-used drive.
/// The result is in the order chosen: the least-used node's drive first.
pub fn place(
    copies: usize,
    candidates: &[DriveLoad],
    exclude_nodes: &[NodeId],
) -> Result<Vec<DriveId>, PlacementError> {
    place_near(copies, candidates, exclude_nodes, None)
}

/// Data locality for [`place_near`]: the node that will read the slab most (its volume's
/// owner, which serves reads from its own copy without a network hop), and how many
/// percentage points of used capacity it may be above the least-used eligible node and
/// still take a copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Near {
    pub node: NodeId,
    pub slack_pct: u64,
}

/// [`place`], except that the node `near` names, when it is eligible and its used fraction
/// is at most `slack_pct` points above the least-used eligible node's, takes the first
/// copy; the other copies go by balance as always. So an owner reads its volume locally
/// while its node is not much fuller than the rest, and balance takes over beyond that
/// (with volumes owned evenly across nodes, locality costs no balance at all).
pub fn place_near(
    copies: usize,
    candidates: &[DriveLoad],
    exclude_nodes: &[NodeId],
    near: Option<Near>,
) -> Result<Vec<DriveId>, PlacementError> {
    if copies == 0 {
        return Err(PlacementError::NoCopies { copies });
    }
    // Best drive per node.
    let mut best: BTreeMap<NodeId, DriveLoad> = BTreeMap::new();
    for d in candidates
        .iter()
        .filter(|d| d.usable() && !exclude_nodes.contains(&d.node))
    {
        match best.get(&d.node) {
            Some(cur) if by_load(cur, d) != Ordering::Greater => {}
            _ => {
                best.insert(d.node, *d);
            }
        }
    }
    if best.len() < copies {
        let nodes = summarize(candidates, exclude_nodes);
        return Err(PlacementError::NotEnoughNodes {
            layout: layout_name(copies),
            copies,
            available: best.len(),
            down: down_with_room(&nodes),
            detail: describe(&nodes),
        });
    }
    // A node's use counts all its live capacity drives, full ones too: they are its share.
    let mut picks: Vec<NodeCandidate> = best
        .into_iter()
        .map(|(node, best)| {
            let (used, total) = candidates
                .iter()
                .filter(|d| d.node == node && d.live && d.role == DriveRole::Capacity)
                .fold((0, 0), |(u, t), d| {
                    (u + d.extents_used, t + d.extents_total)
                });
            debug_assert!(total > 0, "a node with a usable drive has capacity");
            NodeCandidate { used, total, best }
        })
        .collect();
    picks.sort_by(by_node_load);
    if let Some(near) = near {
        if let Some(i) = picks.iter().position(|n| n.best.node == near.node) {
            let (least, n) = (&picks[0], &picks[i]);
            // used_n/total_n <= used_l/total_l + slack/100, in integers.
            let lhs = 100 * u128::from(n.used) * u128::from(least.total);
            let rhs = 100 * u128::from(least.used) * u128::from(n.total)
                + u128::from(near.slack_pct) * u128::from(n.total) * u128::from(least.total);
            if lhs <= rhs {
                let n = picks.remove(i);
                picks.insert(0, n);
            }
        }
    }
    Ok(picks
        .into_iter()
        .take(copies)
        .map(|n| n.best.drive)
        .collect())
}

/// Create-time check: could a volume of `size_bytes` with `resiliency` be fully written
/// on today's free capacity, its extents `extent_size` bytes? Checks that enough live nodes
/// have capacity drives with free space, and that their free extents can hold every slab's
/// copies (or parity chunks) on distinct nodes. A parity-K+M slab spans K extents of data.
pub fn can_place_volume(
    resiliency: Resiliency,
    size_bytes: u64,
    extent_size: u64,
    candidates: &[DriveLoad],
) -> Result<(), PlacementError> {
    can_place_parts(&[(resiliency, size_bytes)], extent_size, candidates)
}

/// [`can_place_volume`] for a volume in parts of different resiliencies (a parity volume
/// and its mirror part): `(resiliency, bytes)` each, placed together.
pub fn can_place_parts(
    parts: &[(Resiliency, u64)],
    extent_size: u64,
    candidates: &[DriveLoad],
) -> Result<(), PlacementError> {
    let copies = parts.iter().map(|p| p.0.copies()).max().unwrap_or(0);
    if copies == 0 {
        return Err(PlacementError::NoCopies { copies });
    }
    if extent_size == 0 {
        return Err(PlacementError::ZeroSlabSize);
    }
    let layout = parts
        .iter()
        .map(|p| p.0.to_string())
        .collect::<Vec<_>>()
        .join(" + ");
    let nodes = summarize(candidates, &[]);
    let with_space = nodes.values().filter(|n| n.live && n.free > 0).count();
    if with_space < copies {
        return Err(PlacementError::NotEnoughNodes {
            layout,
            copies,
            available: with_space,
            down: down_with_room(&nodes),
            detail: describe(&nodes),
        });
    }
    // The volume's size: the first part (a mirror part is more room for some of it).
    let size_bytes = parts.first().map_or(0, |p| p.1);
    let slabs_of = |(r, bytes): &(Resiliency, u64)| bytes.div_ceil(r.slab_span(extent_size));
    let slabs: u64 = parts.iter().map(slabs_of).sum();
    // S slabs of c copies on distinct nodes fit iff sum over nodes of min(free, S) >= c*S:
    // a node can hold at most one copy of each slab, so its space beyond S is no use.
    // (With parts of different copies, S counts all their slabs: a sufficient bound.)
    let usable: u128 = nodes
        .values()
        .filter(|n| n.live)
        .map(|n| u128::from(n.free.min(slabs)))
        .sum();
    let needed: u128 = parts
        .iter()
        .map(|p| u128::from(slabs_of(p)) * p.0.copies() as u128)
        .sum();
    if usable < needed {
        let detail = nodes
            .iter()
            .filter(|(_, n)| n.live && n.capacity_drives > 0)
            .map(|(id, n)| format!("node {id}: {} free", n.free))
            .collect::<Vec<_>>()
            .join(", ");
        return Err(PlacementError::NotEnoughCapacity {
            size: format_size(size_bytes),
            layout,
            copies,
            slabs,
            needed,
            usable,
            detail,
        });
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use std::collections::BTreeSet;

    fn drive(id: u64, node: u32, total: u64, used: u64) -> DriveLoad {
        DriveLoad {
            slots_total: total,
            slots_used: used,
            drive: DriveId(id),
            node: NodeId(node),
            extents_total: total,
            extents_used: used,
            live: true,
            role: DriveRole::Capacity,
        }
    }

    #[test]
    fn picks_distinct_nodes_least_used_first() {
        let c = [
            drive(1, 1, 10, 5),
            drive(2, 1, 10, 0),
            drive(3, 2, 10, 9),
            drive(4, 3, 10, 1),
        ];
        assert_eq!(
            place(2, &c, &[]).unwrap(),
            vec![DriveId(4), DriveId(2)],
            "node 3 (1 of 10 used), then node 1 (5 of 20) on its emptier drive; node 2 is \
             the fullest"
        );
        assert_eq!(
            place(3, &c, &[]).unwrap(),
            vec![DriveId(4), DriveId(2), DriveId(3)]
        );
    }

    #[test]
    fn the_near_node_takes_a_copy_within_its_slack() {
        let c = [
            drive(1, 1, 10, 4),
            drive(2, 2, 10, 1),
            drive(3, 3, 10, 2),
            drive(4, 4, 10, 3),
        ];
        let near = |slack_pct| {
            Some(Near {
                node: NodeId(1),
                slack_pct,
            })
        };
        // Node 1 is 30 points above node 2: within 30 it takes the first copy, the others
        // go by balance; within 20 it does not.
        assert_eq!(
            place_near(3, &c, &[], near(30)).unwrap(),
            vec![DriveId(1), DriveId(2), DriveId(3)]
        );
        assert_eq!(
            place_near(3, &c, &[], near(20)).unwrap(),
            vec![DriveId(2), DriveId(3), DriveId(4)]
        );
        // An excluded, full or unknown near node changes nothing.
        assert_eq!(
            place_near(2, &c, &[NodeId(1)], near(100)).unwrap(),
            vec![DriveId(2), DriveId(3)]
        );
        let full = [drive(1, 1, 4, 4), drive(2, 2, 10, 1), drive(3, 3, 10, 2)];
        assert_eq!(
            place_near(2, &full, &[], near(100)).unwrap(),
            vec![DriveId(2), DriveId(3)]
        );
        assert_eq!(
            place_near(2, &c, &[], None).unwrap(),
            place(2, &c, &[]).unwrap()
        );
    }

    /// An owner that allocates slab after slab keeps a local copy of each while its node
    /// stays within the slack of the least-used one, and the other nodes stay balanced among
    /// themselves; past the slack, balance wins.
    #[test]
    fn locality_is_bounded_by_the_slack() {
        let mut c: Vec<DriveLoad> = (1..=4)
            .flat_map(|n| {
                [
                    drive(u64::from(n) * 10, n, 14, 0),
                    drive(u64::from(n) * 10 + 1, n, 14, 0),
                ]
            })
            .collect();
        let near = Some(Near {
            node: NodeId(1),
            slack_pct: 25,
        });
        let mut local = 0;
        for _ in 0..40 {
            let Ok(chosen) = place_near(3, &c, &[], near) else {
                break;
            };
            for d in &chosen {
                c.iter_mut().find(|l| l.drive == *d).unwrap().extents_used += 1;
            }
            let node_used = |n: u32| -> u64 {
                c.iter()
                    .filter(|d| d.node == NodeId(n))
                    .map(|d| d.extents_used)
                    .sum()
            };
            if chosen.iter().any(|d| d.0 / 10 == 1) {
                local += 1;
            }
            let least = (2..=4).map(node_used).min().unwrap();
            assert!(
                node_used(1) * 100 <= least * 100 + 25 * 28 + 100,
                "node 1 holds {} extents, the least-used other {least}",
                node_used(1)
            );
            let others: Vec<u64> = (2..=4).map(node_used).collect();
            assert!(
                others.iter().max().unwrap() - others.iter().min().unwrap() <= 1,
                "{others:?}"
            );
        }
        assert!(
            local >= 8,
            "a 2 GiB volume's 8 slabs are all local: {local}"
        );
    }

    #[test]
    fn nodes_rank_before_drives() {
        // Node 1's drive 1 is the emptiest drive, but node 1 as a whole (13 of 20) is
        // fuller than node 2 (5 of 10) and node 3 (6 of 10).
        let c = [
            drive(1, 1, 10, 3),
            drive(2, 1, 10, 10),
            drive(3, 2, 10, 5),
            drive(4, 3, 10, 6),
        ];
        assert_eq!(place(2, &c, &[]).unwrap(), vec![DriveId(3), DriveId(4)]);
    }

    /// The lab's layout (4 nodes × 2 drives, random drive ids) with a mirror-3 volume of 8
    /// slabs: 24 copies, 3 per drive, whatever the ids. Ranking drives alone (the old rule)
    /// ended with e.g. [3, 4, 3, 3, 3, 3, 2, 3] for some ids: a node whose two drives lost
    /// the id ties early could not catch up, since it takes one copy per slab.
    #[test]
    fn lab_layout_ends_exactly_balanced_for_any_drive_ids() {
        let mut rng = StdRng::seed_from_u64(12);
        for case in 0..2_000 {
            let mut c: Vec<DriveLoad> = (0..8u32)
                .map(|i| drive(rng.gen::<u64>() >> 1, i / 2 + 1, 15, 0))
                .collect();
            for _ in 0..8 {
                for p in place(3, &c, &[]).unwrap() {
                    c.iter_mut().find(|d| d.drive == p).unwrap().extents_used += 1;
                }
            }
            let used: Vec<u64> = c.iter().map(|d| d.extents_used).collect();
            assert_eq!(used, vec![3; 8], "case {case}: {c:?}");
        }
    }

    #[test]
    fn ties_break_on_drive_id() {
        let c = [drive(9, 1, 10, 0), drive(3, 2, 10, 0), drive(5, 3, 10, 0)];
        assert_eq!(place(2, &c, &[]).unwrap(), vec![DriveId(3), DriveId(5)]);
    }

    #[test]
    fn used_fraction_not_count() {
        // 5 of 100 used is emptier than 1 of 10.
        let c = [drive(1, 1, 10, 1), drive(2, 2, 100, 5)];
        assert_eq!(place(1, &c, &[]).unwrap(), vec![DriveId(2)]);
    }

    #[test]
    fn skips_dead_cache_full_and_excluded() {
        let mut dead = drive(1, 1, 10, 0);
        dead.live = false;
        let mut cache = drive(2, 2, 10, 0);
        cache.role = DriveRole::Cache;
        let full = drive(3, 3, 8, 8);
        let ok = drive(4, 4, 10, 3);
        let excluded = drive(5, 5, 10, 0);
        let c = [dead, cache, full, ok, excluded];
        assert_eq!(place(1, &c, &[NodeId(5)]).unwrap(), vec![DriveId(4)]);
        let e = place(3, &c, &[NodeId(5)]).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.starts_with(
                "a slab of 3 copies or chunks needs 3 nodes with free capacity; only 1 live node has"
            ),
            "{msg}"
        );
        for part in [
            "node 1: down",
            "node 2: no capacity drives",
            "node 3: 0 free of 8 slabs",
            "node 4: 7 free of 10 slabs",
            "node 5: already holds a copy",
        ] {
            assert!(msg.contains(part), "{msg} lacks {part}");
        }
    }

    #[test]
    fn zero_copies_and_no_drives() {
        assert!(matches!(
            place(0, &[], &[]),
            Err(PlacementError::NoCopies { .. })
        ));
        let msg = place(2, &[], &[]).unwrap_err().to_string();
        assert!(
            msg.contains("a slab of 2 copies or chunks needs 2 nodes"),
            "{msg}"
        );
        assert!(msg.contains("no drives are registered"), "{msg}");
    }

    fn random_cluster(rng: &mut StdRng) -> Vec<DriveLoad> {
        let nodes = rng.gen_range(0..7u32);
        let mut out = Vec::new();
        let mut id = 0;
        for n in 0..nodes {
            for _ in 0..rng.gen_range(0..4) {
                id += 1;
                let total = rng.gen_range(0..20);
                let mut d = drive(id, n, total, rng.gen_range(0..=total));
                d.live = rng.gen_bool(0.85);
                if rng.gen_bool(0.15) {
                    d.role = DriveRole::Cache;
                }
                out.push(d);
            }
        }
        out
    }

    /// Property: a placement is either valid (distinct live nodes, capacity drives with
    /// space, not excluded, the least-used per node) or an error exactly when too few
    /// nodes qualify.
    #[test]
    fn property_placements_are_valid() {
        let mut rng = StdRng::seed_from_u64(0xC0FFEE);
        for case in 0..5_000 {
            let c = random_cluster(&mut rng);
            let copies = rng.gen_range(1..=4);
            let exclude: Vec<NodeId> = (0..rng.gen_range(0..2))
                .map(|_| NodeId(rng.gen_range(0..7)))
                .collect();
            let eligible: BTreeSet<NodeId> = c
                .iter()
                .filter(|d| d.usable() && !exclude.contains(&d.node))
                .map(|d| d.node)
                .collect();
            match place(copies, &c, &exclude) {
                Ok(picks) => {
                    assert_eq!(picks.len(), copies, "case {case}");
                    let mut seen = BTreeSet::new();
                    for p in &picks {
                        let d = c.iter().find(|d| d.drive == *p).unwrap();
                        assert!(d.usable(), "case {case}: picked unusable {d:?}");
                        assert!(!exclude.contains(&d.node), "case {case}: excluded node");
                        assert!(
                            seen.insert(d.node),
                            "case {case}: two copies on node {}",
                            d.node
                        );
                        // No other eligible drive on that node is strictly less used.
                        for o in c.iter().filter(|o| o.node == d.node && o.usable()) {
                            assert_ne!(by_load(o, d), Ordering::Less, "case {case}");
                        }
                    }
                    // Deterministic.
                    assert_eq!(place(copies, &c, &exclude).unwrap(), picks);
                }
                Err(PlacementError::NotEnoughNodes { available, .. }) => {
                    assert!(eligible.len() < copies, "case {case}");
                    assert_eq!(available, eligible.len(), "case {case}");
                }
                Err(e) => panic!("case {case}: unexpected {e}"),
            }
        }
    }

    /// A node down is not a full pool: the copies wait for it (CI: a rolling restart's
    /// write to a new slab got ENOSPC). Full nodes, or too few nodes even with it, are.
    #[test]
    fn nodes_down_make_a_wait_not_a_full_pool() {
        let down = |mut d: DriveLoad| {
            d.live = false;
            d
        };
        let three = [
            drive(1, 1, 10, 0),
            drive(2, 2, 10, 0),
            down(drive(3, 3, 10, 0)),
        ];
        let e = place(3, &three, &[]).unwrap_err();
        assert!(e.waits_for_nodes(), "{e}");
        assert!(e.to_string().contains("node 3: down"), "{e}");
        // Down, but full: no wait helps.
        let full = [
            drive(1, 1, 10, 0),
            drive(2, 2, 10, 0),
            down(drive(3, 3, 10, 10)),
        ];
        assert!(!place(3, &full, &[]).unwrap_err().waits_for_nodes());
        // Down, and one node short even with it back.
        assert!(!place(4, &three, &[]).unwrap_err().waits_for_nodes());
        // The down node already holds a copy of the slab: it does not count.
        assert!(!place(3, &three, &[NodeId(3)])
            .unwrap_err()
            .waits_for_nodes());
        assert!(!can_place_parts(&[(Resiliency::Mirror3, 30)], 10, &full)
            .unwrap_err()
            .waits_for_nodes());
        assert!(can_place_parts(&[(Resiliency::Mirror3, 30)], 10, &three)
            .unwrap_err()
            .waits_for_nodes());
    }

    /// Property (the documented guarantee): placing slab after slab on equal drives, the same
    /// number on every node, keeps every drive's used extents within one of every other's,
    /// whatever the drive ids.
    #[test]
    fn property_repeated_placement_balances() {
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..300 {
            let nodes = rng.gen_range(3..8u32);
            let per_node = rng.gen_range(1..4u64);
            let total = 64;
            let mut c: Vec<DriveLoad> = (0..nodes)
                .flat_map(|n| (0..per_node).map(move |_| n))
                .map(|n| drive(rng.gen::<u64>() >> 1, n, total, 0))
                .collect();
            let copies = rng.gen_range(1..=3usize);
            let slabs = rng.gen_range(1..200);
            for _ in 0..slabs {
                let Ok(picks) = place(copies, &c, &[]) else {
                    break;
                };
                for p in picks {
                    let d = c.iter_mut().find(|d| d.drive == p).unwrap();
                    d.extents_used += 1;
                }
                let used: Vec<u64> = c.iter().map(|d| d.extents_used).collect();
                let (lo, hi) = (used.iter().min().unwrap(), used.iter().max().unwrap());
                assert!(
                    hi - lo <= 1,
                    "unbalanced: {used:?} nodes {nodes} per node {per_node} copies {copies}"
                );
            }
        }
    }

    /// Property: with unequal drives, fuller drives are never preferred: after many slabs,
    /// the used fractions of all drives stay within one extent's worth of each other.
    #[test]
    fn property_balances_used_fraction() {
        let mut c = vec![
            drive(1, 1, 100, 0),
            drive(2, 2, 50, 0),
            drive(3, 3, 25, 0),
            drive(4, 4, 100, 0),
        ];
        for _ in 0..100 {
            for p in place(2, &c, &[]).unwrap() {
                c.iter_mut().find(|d| d.drive == p).unwrap().extents_used += 1;
            }
        }
        let fr: Vec<f64> = c
            .iter()
            .map(|d| d.extents_used as f64 / d.extents_total as f64)
            .collect();
        let lo = fr.iter().cloned().fold(f64::MAX, f64::min);
        let hi = fr.iter().cloned().fold(0.0, f64::max);
        assert!(hi - lo <= 1.0 / 25.0 + 1e-9, "fractions {fr:?}");
    }

    #[test]
    fn volume_check_counts_nodes() {
        let c = [drive(1, 1, 8, 8), drive(2, 2, 8, 0), drive(3, 3, 8, 0)];
        let msg = can_place_volume(Resiliency::Mirror3, 1 << 30, 256 << 20, &c)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("mirror-3 needs 3 nodes with free capacity; only 2 live nodes have"),
            "{msg}"
        );
        assert!(msg.contains("node 1: 0 free of 8 slabs"), "{msg}");
        can_place_volume(Resiliency::Mirror2, 1 << 30, 256 << 20, &c).unwrap();
    }

    #[test]
    fn volume_check_counts_capacity_per_distinct_node() {
        // 4 slabs × 2 copies = 8 extents. Node 1 has 100 free but can hold only one copy
        // of each slab (4); node 2 has 3: 7 usable < 8.
        let slab = 1 << 20;
        let c = [drive(1, 1, 100, 0), drive(2, 2, 3, 0)];
        let e = can_place_volume(Resiliency::Mirror2, 4 * slab, slab, &c).unwrap_err();
        match &e {
            PlacementError::NotEnoughCapacity {
                needed,
                usable,
                slabs,
                ..
            } => {
                assert_eq!((*needed, *usable, *slabs), (8, 7, 4));
            }
            other => panic!("unexpected {other}"),
        }
        let msg = e.to_string();
        assert!(
            msg.contains("4 MiB volume as mirror-2 needs 8 extents (4 slabs × 2 copies"),
            "{msg}"
        );
        assert!(msg.contains("can hold only 7 more"), "{msg}");
        assert!(msg.contains("node 1: 100 free, node 2: 3 free"), "{msg}");
        // A partial last slab still takes a whole extent; 3 slabs fit.
        can_place_volume(Resiliency::Mirror2, 2 * slab + 1, slab, &c).unwrap();
        assert!(can_place_volume(Resiliency::Mirror2, 3 * slab + 1, slab, &c).is_err());
        // Dead nodes' space does not count.
        let mut dead = drive(3, 3, 100, 0);
        dead.live = false;
        assert!(
            can_place_volume(Resiliency::Mirror2, 4 * slab, slab, &[c[0], c[1], dead]).is_err()
        );
        can_place_volume(
            Resiliency::Mirror2,
            4 * slab,
            slab,
            &[c[0], c[1], drive(3, 3, 1, 0)],
        )
        .unwrap();
        assert_eq!(
            can_place_volume(Resiliency::Simple, 1, 0, &c),
            Err(PlacementError::ZeroSlabSize)
        );
        can_place_volume(Resiliency::Simple, 0, slab, &c).unwrap();
    }

    /// A parity-K+M slab holds K extents of data in K+M chunks, one per node.
    #[test]
    fn volume_check_counts_parity_chunks() {
        let ext = 1 << 20;
        let c = [drive(1, 1, 4, 0), drive(2, 2, 4, 0), drive(3, 3, 4, 0)];
        let p21 = Resiliency::parity(2, 1).unwrap();
        // 8 MiB = 4 slabs of 2 MiB, 3 chunks each: all 12 free extents.
        can_place_volume(p21, 8 * ext, ext, &c).unwrap();
        let msg = can_place_volume(p21, 9 * ext, ext, &c)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("as parity-2+1 needs 15 extents (5 slabs × 3 chunks, each chunk"),
            "{msg}"
        );
        let msg = can_place_volume(Resiliency::parity(4, 2).unwrap(), ext, ext, &c)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("parity-4+2 needs 6 nodes"), "{msg}");
    }

    /// Property: when can_place_volume accepts, repeated place() really fits every slab.
    #[test]
    fn property_volume_check_is_sound() {
        let mut rng = StdRng::seed_from_u64(42);
        for case in 0..2_000 {
            let mut c = random_cluster(&mut rng);
            let r =
                [Resiliency::Simple, Resiliency::Mirror2, Resiliency::Mirror3][rng.gen_range(0..3)];
            let copies = r.copies();
            let slabs = rng.gen_range(0..30u64);
            let ok = can_place_volume(r, slabs * 4096, 4096, &c).is_ok();
            let mut placed_all = true;
            for _ in 0..slabs {
                match place(copies, &c, &[]) {
                    Ok(p) => {
                        for id in p {
                            let d = c.iter_mut().find(|d| d.drive == id).unwrap();
                            d.extents_used += 1;
                            d.slots_used += 1;
                        }
                    }
                    Err(_) => {
                        placed_all = false;
                        break;
                    }
                }
            }
            if placed_all && slabs > 0 {
                // The check never refuses what could be placed.
                assert!(ok, "case {case}: check refused a placeable volume");
            }
        }
    }

    /// A thin drive (docs/adr/0010) takes a copy only with room for one more whole extent
    /// and a free slot; a compressed volume is provisioned by slots.
    #[test]
    fn thin_drives_need_room_and_a_slot() {
        // Three nodes of 4 data extents and 8 slots. Node 1's drive: 6 extents placed,
        // compressed to 2 extents' room. Node 2's: 8 placed (no slot left), 3 of room.
        // Node 3's: 4 plain extents (no room left).
        let thin = |id: u64, node: u32, room: u64, placed: u64| DriveLoad {
            slots_total: 8,
            slots_used: placed,
            ..drive(id, node, 4, room)
        };
        let c = vec![thin(1, 1, 2, 6), thin(2, 2, 3, 8), thin(3, 3, 4, 4)];
        assert_eq!(c[0].free(), 2);
        assert_eq!(c[1].free(), 0, "no slot left");
        assert_eq!(c[2].free(), 0, "no room left");
        assert!(place(1, &c, &[]).unwrap() == vec![DriveId(1)]);
        assert!(place(2, &c, &[]).is_err());
        // Provisioning by slots: node 1 has 2 slots, node 3 four.
        let by_slots: Vec<DriveLoad> = c.iter().map(DriveLoad::by_slots).collect();
        assert!(can_place_volume(Resiliency::Mirror2, 2 * 4096, 4096, &by_slots).is_ok());
        assert!(can_place_volume(Resiliency::Mirror2, 3 * 4096, 4096, &by_slots).is_err());
        assert!(can_place_volume(Resiliency::Mirror2, 4096, 4096, &c).is_err());
    }
}
