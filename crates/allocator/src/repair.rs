//! The repair policy: which copies an owner marks stale, which it resyncs, which it
//! rebuilds on another node, when, and where. `converged`'s repair loop and the
//! simulator's repairer both run it, so the seeds test the decisions the daemon makes; each
//! carries them out with the production jobs (`Volume::copy_failed`, `resync`, `rebuild`).
//!
//! One round, for one volume its owner serves:
//!
//! 1. [`View::read`] reads what the control plane says now: live nodes (lease alive),
//!    nodes in maintenance, failed drives. [`DownClock::observe`] notes when each node
//!    that holds drives was first seen without a lease.
//! 2. [`copies_to_mark_stale`]: a copy that is not stale but sits on a node without a
//!    lease, a node in maintenance, or a failed drive is marked stale (writes stop
//!    waiting for it, and repair takes it up).
//! 3. [`plan`] decides per stale copy: a failed drive does not come back, so its copies
//!    are rebuilt at once; a live node's copy is resynced (if the node answers; on a
//!    draining node too: that restores redundancy at once, and the copy moves later); a
//!    down node's copy is rebuilt once its node has been down for the repair delay, at
//!    once if it is draining; a copy on a node in maintenance waits for the maintenance
//!    to end.
//! 4. [`rebuild_target`] places the replacement: `placement::place` over the drive loads,
//!    excluding every node that already holds a copy of the slab.
//! 5. [`evacuations`] drains nodes being removed, copy before drop: an in-sync copy on a
//!    draining node gets a new copy elsewhere first ([`Step::Evacuate`]: it stays in sync
//!    and takes writes while the new one fills), and is dropped only once the slab has its
//!    full count of in-sync copies without it ([`Step::Drop`]). So draining never lowers a
//!    slab's redundancy.

use converge_control::kv::Kv;
use converge_control::model::{Cluster, ControlError, ExtentRecord};
use converge_control::placement::{self, DriveLoad};
use converge_types::{DriveId, ExtentState, NodeId, Resiliency, SlabIndex};
use converge_volume::ExtentLoc;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;
use tokio::time::Instant;

/// What the control plane says about nodes and drives at one moment.
#[derive(Clone, Debug, Default)]
pub struct View {
    /// Nodes whose lease is alive.
    pub live: HashSet<NodeId>,
    /// Nodes in maintenance (their copies are stale, and neither resynced nor rebuilt
    /// until the maintenance ends).
    pub maintenance: HashSet<NodeId>,
    /// Drives recorded as failed.
    pub failed: HashSet<DriveId>,
    /// Nodes being drained for removal: their copies move elsewhere.
    pub draining: HashSet<NodeId>,
    /// Every node that holds a drive.
    pub nodes: HashSet<NodeId>,
}

impl View {
    /// Reads the view from the store.
    pub async fn read<K: Kv>(cluster: &Cluster<K>) -> Result<View, ControlError> {
        let live = cluster.live_nodes().await?.into_iter().map(|n| n.id);
        let maintenance = cluster.maintenance_nodes().await?.into_iter();
        let failed = cluster.failed_drives().await?.into_keys();
        let draining = cluster.draining_nodes().await?.into_iter();
        let nodes = cluster.drives().await?.into_iter().map(|d| d.node);
        Ok(View {
            live: live.collect(),
            maintenance: maintenance.collect(),
            failed: failed.collect(),
            draining: draining.collect(),
            nodes: nodes.collect(),
        })
    }

    /// Whether a copy there cannot take writes now: its node has no lease or is in
    /// maintenance, or its drive failed.
    pub fn away(&self, e: &ExtentLoc) -> bool {
        !self.live.contains(&e.node)
            || self.maintenance.contains(&e.node)
            || self.failed.contains(&e.drive)
    }
}

/// When each node that holds drives was first seen without a lease (forgotten when its
/// lease is back). Measured on the observer's monotonic clock, so a node's downtime counts
/// from when this observer noticed it, never from a wall clock another node set.
#[derive(Debug, Default)]
pub struct DownClock {
    since: HashMap<NodeId, Instant>,
}

impl DownClock {
    pub fn observe(&mut self, view: &View, now: Instant) {
        for n in &view.nodes {
            if !view.live.contains(n) {
                self.since.entry(*n).or_insert(now);
            }
        }
        self.since.retain(|n, _| !view.live.contains(n));
    }

    /// How long `node` has been seen down (zero if live or never seen).
    pub fn down_for(&self, node: NodeId, now: Instant) -> Duration {
        self.since
            .get(&node)
            .map(|t| now.saturating_duration_since(*t))
            .unwrap_or_default()
    }
}

/// Copies that are not stale but whose node or drive is away ([`View::away`]): the owner
/// marks them stale (`Volume::copy_failed`).
pub fn copies_to_mark_stale(
    slabs: &BTreeMap<SlabIndex, Vec<ExtentLoc>>,
    view: &View,
) -> Vec<(SlabIndex, ExtentLoc)> {
    slabs
        .iter()
        .flat_map(|(idx, ex)| ex.iter().map(move |e| (*idx, *e)))
        .filter(|(_, e)| e.state != ExtentState::Stale && view.away(e))
        .collect()
}

/// The first slab that no takeover could serve now, with how many of its copies could
/// answer and how many a read needs: fewer of them are in sync on a live node and a drive
/// not failed than a read of that slab needs (one copy of a mirror or of a mirror-part
/// slab, `data` chunks of a parity slab; a mirror slab with a reachable stale copy that
/// holds every acked write can answer: a takeover promotes it, docs/adr/0014). The
/// leader does not claim
/// a volume with such a slab: the claim would take a new epoch and fail, once a second for
/// as long as the copies are away. It claims it once enough of them are back.
pub fn unservable_slab<'a>(
    slabs: impl IntoIterator<Item = (SlabIndex, &'a [ExtentRecord])>,
    resiliency: Resiliency,
    view: &View,
) -> Option<(SlabIndex, usize, usize)> {
    slabs.into_iter().find_map(|(idx, extents)| {
        let up = |e: &&ExtentRecord| view.live.contains(&e.node) && !view.failed.contains(&e.drive);
        let answering = extents
            .iter()
            .filter(|e| e.state == ExtentState::InSync)
            .filter(up)
            .count();
        // A mirror-accelerated parity volume's mirror-part slabs are mirrors.
        let layout = resiliency.of_slab(idx);
        let needed = layout.needed();
        // A mirror's stale copy that holds every acked write serves once a takeover
        // promotes it (docs/adr/0014).
        let holder = !layout.is_parity()
            && extents
                .iter()
                .filter(|e| e.state != ExtentState::InSync && e.holds_acked)
                .any(|e| up(&e));
        (answering < needed && !holder).then_some((idx, answering, needed))
    })
}

/// Why a copy is rebuilt elsewhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cause {
    /// Its drive failed: it does not come back.
    FailedDrive,
    /// Its node has been down for the repair delay.
    DownPastDelay,
    /// Its node is being drained: it is not brought back there.
    Draining,
    /// Its resync found no room on its drive (a copy whose first write found the drive
    /// full has no extent there): it goes to a drive with room, maybe on its own node.
    NoRoom,
}

impl Cause {
    /// The drive of the copy replaced for this cause, if the copy does not keep its node
    /// out of [`rebuild_target`]: a failed or full drive's node may take the new copy on
    /// another drive.
    pub fn replacing(self, copy: &ExtentLoc) -> Option<DriveId> {
        matches!(self, Cause::FailedDrive | Cause::NoRoom).then_some(copy.drive)
    }
}

/// What to do about one stale copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Bring it back by a delta resync, if its node answers.
    Resync(SlabIndex, ExtentLoc),
    /// Replace it by a new copy on another node ([`rebuild_target`]).
    Rebuild(SlabIndex, ExtentLoc, Cause),
    /// Add a new copy on another node ([`rebuild_target`]) beside this in-sync copy on a
    /// draining node, fill it, then drop this one.
    Evacuate(SlabIndex, ExtentLoc),
    /// Drop this in-sync copy on a draining node: the slab has its full count of in-sync
    /// copies on other nodes (an evacuation that stopped between its two halves).
    Drop(SlabIndex, ExtentLoc),
    /// Make this stale copy of a mirror slab in sync: every in-sync copy is out of reach
    /// (`Volume::promote`; the control plane refuses unless its record says the copy holds
    /// every acked write, docs/adr/0014).
    Promote(SlabIndex, ExtentLoc),
}

/// What to do about each stale copy (see the module docs); copies on nodes in maintenance,
/// and copies of nodes down for less than `repair_delay`, are left as they are.
pub fn plan(
    stale: &[(SlabIndex, ExtentLoc)],
    view: &View,
    down: &DownClock,
    repair_delay: Duration,
    now: Instant,
) -> Vec<Step> {
    stale
        .iter()
        .filter(|(_, e)| !view.maintenance.contains(&e.node))
        .filter_map(|&(idx, e)| {
            if view.failed.contains(&e.drive) {
                Some(Step::Rebuild(idx, e, Cause::FailedDrive))
            } else if view.live.contains(&e.node) {
                Some(Step::Resync(idx, e))
            } else if view.draining.contains(&e.node) {
                Some(Step::Rebuild(idx, e, Cause::Draining))
            } else if down.down_for(e.node, now) >= repair_delay {
                Some(Step::Rebuild(idx, e, Cause::DownPastDelay))
            } else {
                None
            }
        })
        .collect()
}

/// The copies on draining nodes and what to do with each, for a volume of `resiliency`
/// (a slab keeps its [`Resiliency::of_slab`] count of copies): drop it (whatever its
/// state) if the slab has that many in-sync copies on other nodes; else, if it is in sync and so is every copy of the slab
/// (no repair under way, which comes first), evacuate it; else leave it for now. One step
/// per slab and round.
pub fn evacuations(
    slabs: &BTreeMap<SlabIndex, Vec<ExtentLoc>>,
    view: &View,
    resiliency: Resiliency,
) -> Vec<Step> {
    slabs
        .iter()
        .filter_map(|(idx, ex)| {
            let copies = resiliency.of_slab(*idx).copies();
            let leaving = *ex.iter().find(|e| view.draining.contains(&e.node))?;
            let staying = ex
                .iter()
                .filter(|e| e.state == ExtentState::InSync && !view.draining.contains(&e.node))
                .count();
            if staying >= copies {
                Some(Step::Drop(*idx, leaving))
            } else if ex.iter().all(|e| e.state == ExtentState::InSync) {
                Some(Step::Evacuate(*idx, leaving))
            } else {
                None
            }
        })
        .collect()
}

/// Mirror slabs none of whose in-sync copies can answer (node without a lease, failed
/// drive): a [`Step::Promote`] of each of its other copies that can answer (the control
/// plane lets through the one its record marks, if any; the rest are refused, unchanged).
pub fn promotions(
    slabs: &BTreeMap<SlabIndex, Vec<ExtentLoc>>,
    view: &View,
    resiliency: Resiliency,
) -> Vec<Step> {
    let gone = |e: &ExtentLoc| !view.live.contains(&e.node) || view.failed.contains(&e.drive);
    slabs
        .iter()
        .filter(|(idx, _)| !resiliency.of_slab(**idx).is_parity())
        .flat_map(|(idx, ex)| {
            let mut in_sync = ex.iter().filter(|e| e.state == ExtentState::InSync);
            let stuck = in_sync.clone().next().is_some() && in_sync.all(gone);
            ex.iter()
                .filter(move |e| stuck && e.state != ExtentState::InSync && !gone(e))
                .map(|e| Step::Promote(*idx, *e))
        })
        .collect()
}

/// One round's steps for one volume, as its owner runs them: [`promotions`] first, then
/// [`plan`] for the stale copies, then, while nodes are draining, [`evacuations`]. A copy that the evacuations
/// drop (its slab has its full count of in-sync copies elsewhere) is not also rebuilt.
#[allow(clippy::too_many_arguments)]
pub fn round(
    slabs: &BTreeMap<SlabIndex, Vec<ExtentLoc>>,
    stale: &[(SlabIndex, ExtentLoc)],
    view: &View,
    down: &DownClock,
    repair_delay: Duration,
    now: Instant,
    resiliency: Resiliency,
) -> Vec<Step> {
    let moves = if view.draining.is_empty() {
        Vec::new()
    } else {
        evacuations(slabs, view, resiliency)
    };
    let dropped: HashSet<(SlabIndex, DriveId)> = moves
        .iter()
        .filter_map(|s| match s {
            Step::Drop(idx, e) => Some((*idx, e.drive)),
            _ => None,
        })
        .collect();
    let mut steps = promotions(slabs, view, resiliency);
    steps.extend(
        plan(stale, view, down, repair_delay, now)
            .into_iter()
            .filter(
                |s| !matches!(s, Step::Rebuild(idx, e, _) if dropped.contains(&(*idx, e.drive))),
            ),
    );
    steps.extend(moves);
    steps
}

/// Where a rebuilt copy of a slab whose copies are `copies` goes: one drive on a live node
/// that holds no copy of it (`placement::place`), as a `syncing` copy; else why there is
/// none (placement's explanation: which nodes are full, down, or already hold a copy).
/// The copy on a failed (or full) drive that the new one replaces, `replacing`, does not
/// count: its node may take the new copy on another drive (a node's blank drive in the
/// place of the failed one, or a three-node cluster's mirror-3 slab, has nowhere else to
/// go); that drive itself never does.
pub fn rebuild_target(
    copies: &[ExtentLoc],
    replacing: Option<DriveId>,
    loads: &[DriveLoad],
) -> Result<ExtentLoc, String> {
    let holding: Vec<NodeId> = copies
        .iter()
        .filter(|x| Some(x.drive) != replacing)
        .map(|x| x.node)
        .collect();
    let others: Vec<DriveLoad>;
    let loads = match replacing {
        Some(d) => {
            others = loads.iter().filter(|l| l.drive != d).cloned().collect();
            &others[..]
        }
        None => loads,
    };
    let drive = placement::place(1, loads, &holding).map_err(|e| e.to_string())?[0];
    let node = loads
        .iter()
        .find(|l| l.drive == drive)
        .map(|l| l.node)
        .expect("placement picks among the loads");
    Ok(ExtentLoc {
        node,
        drive,
        state: ExtentState::Syncing,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use converge_types::DriveRole;

    fn loc(node: u32, drive: u64, state: ExtentState) -> ExtentLoc {
        ExtentLoc {
            node: NodeId(node),
            drive: DriveId(drive),
            state,
        }
    }

    fn view(live: &[u32], maint: &[u32], failed: &[u64]) -> View {
        View {
            live: live.iter().map(|n| NodeId(*n)).collect(),
            maintenance: maint.iter().map(|n| NodeId(*n)).collect(),
            failed: failed.iter().map(|d| DriveId(*d)).collect(),
            draining: HashSet::new(),
            nodes: (1..=4).map(NodeId).collect(),
        }
    }

    #[test]
    fn a_mirror_slab_whose_in_sync_copies_are_all_gone_tries_its_reachable_others() {
        use ExtentState::*;
        let mut slabs = BTreeMap::new();
        // Slab 0: its one in-sync copy is on node 1 (down); node 2's copy is stale, node
        // 3's syncing, node 4's stale on a failed drive.
        slabs.insert(
            SlabIndex(0),
            vec![
                loc(1, 10, InSync),
                loc(2, 20, Stale),
                loc(3, 30, Syncing),
                loc(4, 40, Stale),
            ],
        );
        // Slab 1: an in-sync copy still answers; nothing to promote.
        slabs.insert(
            SlabIndex(1),
            vec![loc(1, 10, InSync), loc(2, 20, InSync), loc(3, 30, Stale)],
        );
        let v = view(&[2, 3, 4], &[], &[40]);
        let steps = promotions(&slabs, &v, Resiliency::Mirror3);
        assert_eq!(
            steps,
            vec![
                Step::Promote(SlabIndex(0), loc(2, 20, Stale)),
                Step::Promote(SlabIndex(0), loc(3, 30, Syncing)),
            ]
        );
        // With every node up, nothing is stuck.
        assert!(promotions(&slabs, &view(&[1, 2, 3, 4], &[], &[]), Resiliency::Mirror3).is_empty());
        // A parity slab is never promoted: its chunks are not copies of each other.
        let p21 = Resiliency::parity(2, 1).unwrap();
        assert!(promotions(&slabs, &v, p21).is_empty());
    }

    #[test]
    fn away_copies_are_marked_stale_once() {
        use ExtentState::*;
        let mut slabs = BTreeMap::new();
        slabs.insert(
            SlabIndex(0),
            vec![loc(1, 10, InSync), loc(2, 20, InSync), loc(3, 30, InSync)],
        );
        slabs.insert(
            SlabIndex(1),
            vec![loc(2, 21, Stale), loc(3, 31, Syncing), loc(4, 40, InSync)],
        );
        // Node 2 down, node 3 in maintenance, drive 40 failed.
        let v = view(&[1, 3, 4], &[3], &[40]);
        let got = copies_to_mark_stale(&slabs, &v);
        assert_eq!(
            got,
            vec![
                (SlabIndex(0), loc(2, 20, InSync)),
                (SlabIndex(0), loc(3, 30, InSync)),
                (SlabIndex(1), loc(3, 31, Syncing)),
                (SlabIndex(1), loc(4, 40, InSync)),
            ],
            "the copy already stale (node 2, drive 21) is left alone"
        );
        assert!(copies_to_mark_stale(&slabs, &view(&[1, 2, 3, 4], &[], &[])).is_empty());
    }

    #[test]
    fn a_slab_no_copy_of_which_can_answer_is_unservable() {
        use ExtentState::*;
        let rec = |node: u32, drive: u64, state| ExtentRecord {
            node: NodeId(node),
            drive: DriveId(drive),
            state,
            holds_acked: false,
        };
        let mirror = [
            vec![rec(1, 10, InSync), rec(2, 20, InSync)],
            vec![rec(2, 21, InSync), rec(3, 30, Stale)],
        ];
        fn slabs(s: &[Vec<ExtentRecord>]) -> Vec<(SlabIndex, &[ExtentRecord])> {
            s.iter()
                .enumerate()
                .map(|(i, e)| (SlabIndex(i as u64), e.as_slice()))
                .collect()
        }
        let m2 = Resiliency::Mirror2;
        assert_eq!(
            unservable_slab(slabs(&mirror), m2, &view(&[1, 2, 3], &[], &[])),
            None
        );
        // Node 2 down: slab 1's only in-sync copy is away (its stale copy cannot serve).
        assert_eq!(
            unservable_slab(slabs(&mirror), m2, &view(&[1, 3], &[], &[])),
            Some((SlabIndex(1), 0, 1))
        );
        // Node 2 live but drive 21 failed: the same.
        assert_eq!(
            unservable_slab(slabs(&mirror), m2, &view(&[1, 2, 3], &[], &[21])),
            Some((SlabIndex(1), 0, 1))
        );
        // Unless the stale copy holds every acked write (docs/adr/0014): a takeover
        // promotes it.
        let mut holder = mirror.clone();
        holder[1][1].holds_acked = true;
        assert_eq!(
            unservable_slab(slabs(&holder), m2, &view(&[1, 3], &[], &[])),
            None
        );
        // (Not when it is away too.)
        assert_eq!(
            unservable_slab(slabs(&holder), m2, &view(&[1], &[], &[])),
            Some((SlabIndex(1), 0, 1))
        );
        // A node in maintenance still answers reads.
        assert_eq!(
            unservable_slab(slabs(&mirror), m2, &view(&[1, 2, 3], &[2], &[])),
            None
        );
        // Parity 2+1: two of the three chunks must answer.
        let parity = [vec![
            rec(1, 10, InSync),
            rec(2, 20, InSync),
            rec(3, 30, InSync),
        ]];
        let p21 = Resiliency::parity(2, 1).unwrap();
        assert_eq!(
            unservable_slab(slabs(&parity), p21, &view(&[1, 3], &[], &[])),
            None
        );
        assert_eq!(
            unservable_slab(slabs(&parity), p21, &view(&[1], &[], &[])),
            Some((SlabIndex(0), 1, 2))
        );
        // Its mirror part is a mirror: one copy of a mirror-part slab serves it (CI: a
        // mirror-accelerated parity volume whose owner died was never taken over).
        let part = vec![rec(1, 11, InSync), rec(2, 21, InSync)];
        let with_part = [(SlabIndex::mirror_part(0), part.as_slice())];
        assert_eq!(
            unservable_slab(with_part, p21, &view(&[2, 3], &[], &[])),
            None
        );
        assert_eq!(
            unservable_slab(with_part, p21, &view(&[3], &[], &[])),
            Some((SlabIndex::mirror_part(0), 0, 1))
        );
    }

    #[test]
    fn plan_resyncs_live_copies_and_rebuilds_failed_drives_and_long_absences() {
        use ExtentState::Stale;
        let t0 = Instant::now();
        let delay = Duration::from_secs(60);
        // Node 2 down since t0, node 3 live, node 4 in maintenance (and down), drive 11
        // failed on live node 1.
        let v = view(&[1, 3], &[4], &[11]);
        let mut down = DownClock::default();
        down.observe(&v, t0);
        let stale = vec![
            (SlabIndex(0), loc(2, 20, Stale)),
            (SlabIndex(1), loc(3, 30, Stale)),
            (SlabIndex(2), loc(4, 40, Stale)),
            (SlabIndex(3), loc(1, 11, Stale)),
        ];
        assert_eq!(
            plan(&stale, &v, &down, delay, t0 + Duration::from_secs(59)),
            vec![
                Step::Resync(SlabIndex(1), loc(3, 30, Stale)),
                Step::Rebuild(SlabIndex(3), loc(1, 11, Stale), Cause::FailedDrive),
            ],
            "node 2 is not down for the delay yet; node 4's maintenance holds its copy"
        );
        assert_eq!(
            plan(&stale, &v, &down, delay, t0 + delay),
            vec![
                Step::Rebuild(SlabIndex(0), loc(2, 20, Stale), Cause::DownPastDelay),
                Step::Resync(SlabIndex(1), loc(3, 30, Stale)),
                Step::Rebuild(SlabIndex(3), loc(1, 11, Stale), Cause::FailedDrive),
            ]
        );
        // Node 2 comes back: its clock restarts from zero the next time it goes down.
        let back = view(&[1, 2, 3], &[4], &[11]);
        down.observe(&back, t0 + delay);
        assert_eq!(down.down_for(NodeId(2), t0 + delay * 2), Duration::ZERO);
        down.observe(&v, t0 + delay * 2);
        assert_eq!(
            down.down_for(NodeId(2), t0 + delay * 2 + Duration::from_secs(5)),
            Duration::from_secs(5)
        );
    }

    #[test]
    fn a_draining_node_keeps_its_copies_until_others_hold_them_in_sync() {
        use ExtentState::*;
        let mut v = view(&[1, 2, 3, 4], &[], &[]);
        v.draining.insert(NodeId(3));
        let mut slabs = BTreeMap::new();
        // Full and in sync: evacuate the copy on node 3 (it stays in sync meanwhile).
        slabs.insert(
            SlabIndex(0),
            vec![loc(1, 10, InSync), loc(2, 20, InSync), loc(3, 30, InSync)],
        );
        // The new copy on node 4 is still filling: nothing yet.
        slabs.insert(
            SlabIndex(1),
            vec![
                loc(1, 10, InSync),
                loc(2, 20, InSync),
                loc(3, 30, InSync),
                loc(4, 40, Syncing),
            ],
        );
        // The new copy is in sync: drop the one on node 3.
        slabs.insert(
            SlabIndex(2),
            vec![
                loc(1, 10, InSync),
                loc(2, 20, InSync),
                loc(3, 30, InSync),
                loc(4, 40, InSync),
            ],
        );
        // Another copy is stale: repair it first, never drain below the target.
        slabs.insert(
            SlabIndex(3),
            vec![loc(1, 10, InSync), loc(2, 20, Stale), loc(3, 30, InSync)],
        );
        // Nothing on node 3.
        slabs.insert(
            SlabIndex(4),
            vec![loc(1, 10, InSync), loc(2, 20, InSync), loc(4, 40, InSync)],
        );
        assert_eq!(
            evacuations(&slabs, &v, Resiliency::Mirror3),
            vec![
                Step::Evacuate(SlabIndex(0), loc(3, 30, InSync)),
                Step::Drop(SlabIndex(2), loc(3, 30, InSync)),
            ]
        );
        // Copies stay in sync on a draining node: nothing is marked stale for it.
        assert!(copies_to_mark_stale(&slabs, &v).is_empty());
        // A stale copy on the draining node is resynced while its node is up (redundancy
        // first; it moves once in sync), and rebuilt elsewhere at once when it is down...
        let mut down = DownClock::default();
        let stale = [(SlabIndex(5), loc(3, 31, Stale))];
        let (delay, now) = (Duration::from_secs(600), Instant::now());
        assert_eq!(
            plan(&stale, &v, &down, delay, now),
            vec![Step::Resync(SlabIndex(5), loc(3, 31, Stale))]
        );
        v.live.remove(&NodeId(3));
        down.observe(&v, now);
        assert_eq!(
            plan(&stale, &v, &down, delay, now),
            vec![Step::Rebuild(
                SlabIndex(5),
                loc(3, 31, Stale),
                Cause::Draining
            )]
        );
        // ...unless its slab has its full count of in-sync copies elsewhere (an evacuation
        // whose drop failed, then its node went down): then it is only dropped.
        let mut five = BTreeMap::new();
        five.insert(
            SlabIndex(5),
            vec![
                loc(1, 10, InSync),
                loc(3, 31, Stale),
                loc(2, 20, InSync),
                loc(4, 40, InSync),
            ],
        );
        assert_eq!(
            round(&five, &stale, &v, &down, delay, now, Resiliency::Mirror3),
            vec![Step::Drop(SlabIndex(5), loc(3, 31, Stale))]
        );
    }

    #[test]
    fn a_rebuilt_copy_goes_to_a_node_without_a_copy() {
        use ExtentState::*;
        let load = |node: u32, drive: u64, used: u64, live: bool| DriveLoad {
            drive: DriveId(drive),
            node: NodeId(node),
            extents_total: 10,
            extents_used: used,
            slots_total: 10,
            slots_used: used,
            live,
            role: DriveRole::Capacity,
        };
        // Node 4 is the emptiest but holds a copy; node 5 is down; node 3 is the least used
        // of the rest.
        let loads = [
            load(1, 10, 5, true),
            load(2, 20, 5, true),
            load(3, 30, 3, true),
            load(3, 31, 4, true),
            load(4, 40, 0, true),
            load(5, 50, 0, false),
        ];
        let copies = [loc(1, 10, InSync), loc(2, 20, Stale), loc(4, 40, InSync)];
        assert_eq!(
            rebuild_target(&copies, None, &loads).unwrap(),
            loc(3, 30, Syncing)
        );
        let full = [
            loc(1, 10, InSync),
            loc(2, 20, Stale),
            loc(3, 30, InSync),
            loc(4, 40, InSync),
        ];
        assert!(rebuild_target(&full, None, &loads).is_err());

        // Three nodes, mirror-3, node 3's drive 30 failed: its copy is replaced on node 3's
        // other drive (or the blank one in its place), which only the failed copy's
        // exception allows.
        let three = [
            load(1, 10, 0, true),
            load(2, 20, 0, true),
            load(3, 30, 0, false),
            load(3, 31, 5, true),
        ];
        let copies = [loc(1, 10, InSync), loc(2, 20, InSync), loc(3, 30, Stale)];
        assert!(rebuild_target(&copies, None, &three).is_err());
        assert_eq!(
            rebuild_target(&copies, Some(DriveId(30)), &three).unwrap(),
            loc(3, 31, Syncing)
        );

        // Node 3's drive 30 has no room for the copy its resync needs, though the loads
        // (etcd's claims) say it is the emptiest: the copy goes to node 3's other drive,
        // never back to drive 30.
        let claims = [
            load(1, 10, 5, true),
            load(2, 20, 5, true),
            load(3, 30, 0, true),
            load(3, 31, 6, true),
        ];
        let stale = loc(3, 30, Stale);
        assert_eq!(Cause::NoRoom.replacing(&stale), Some(DriveId(30)));
        assert_eq!(Cause::DownPastDelay.replacing(&stale), None);
        assert_eq!(
            rebuild_target(&copies, Cause::NoRoom.replacing(&stale), &claims).unwrap(),
            loc(3, 31, Syncing)
        );
    }
}
