//! Written and stored bytes: how much of each volume, extent and drive holds data, as
//! opposed to what is allocated (whole slabs), and what that data takes on the drives
//! (less than written where compression saves, docs/adr/0010). Every drive counts the
//! blocks of its extents that hold data and the physical blocks they occupy (the engine
//! keeps both with the block map); each node lists its own at `GET /v1/extents`, and
//! `volume show` and `status` gather the lists from the live nodes and fold them with the
//! slab maps: a mirror slab's figures are its fullest copy's, a parity slab's are its data
//! chunks' sum (parity chunks hold no volume data).

use crate::node::Node;
use converge_api::LocalExtent;
use converge_control::model::{ExtentRecord, SlabRecord};
use converge_types::{DriveId, ExtentState, NodeId, Resiliency, SlabIndex, VolumeId};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

/// A node that has not listed its extents within this long counts as not answering
/// (`status` must not hang on a node that is cut off but not yet declared down).
const ASK_TIMEOUT: Duration = Duration::from_secs(3);

/// This node's extents on its working capacity drives (of `volume` only, if given).
pub fn local(node: &Node, volume: Option<VolumeId>) -> Vec<LocalExtent> {
    let mut out = Vec::new();
    for (id, t) in &node.drives {
        if t.failure().is_some() {
            continue;
        }
        out.extend(
            t.extents()
                .into_iter()
                .filter(|e| volume.is_none_or(|v| e.key.volume == v))
                .map(|e| LocalExtent {
                    drive: *id,
                    volume: e.key.volume,
                    slab: e.key.slab.0,
                    written_bytes: e.bytes_written,
                    stored_bytes: Some(e.bytes_stored),
                }),
        );
    }
    out.sort_by_key(|e| (e.volume, e.slab, e.drive));
    out
}

/// What one extent (or a sum of them) holds: bytes written, and bytes they take on the
/// drive.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub written: u64,
    pub stored: u64,
}

impl Usage {
    fn add(self, o: Usage) -> Usage {
        Usage {
            written: self.written + o.written,
            stored: self.stored + o.stored,
        }
    }

    /// Bytes compression saves (0 when it saves nothing, or when a compressed group
    /// partly zeroed takes more than its remaining blocks).
    #[cfg(test)]
    pub fn saved(&self) -> u64 {
        self.written.saturating_sub(self.stored)
    }
}

/// This node's capacity drives as their engines count them: what placement needs to count
/// a drive's extents by the room they claim (compressed ones less than whole, docs/adr/0010;
/// blocks kept for snapshots more, docs/adr/0012) and its slots by the shadow extents too.
pub fn node_usage(node: &Node) -> converge_control::model::NodeUsage {
    let mut u = converge_control::model::NodeUsage::default();
    for (id, t) in &node.drives {
        if t.failure().is_some() {
            continue;
        }
        u.drives.insert(*id, drive_usage(&t.capacity()));
    }
    u
}

/// One drive's report, from what its engine counts.
pub fn drive_usage(c: &converge_engine::Capacity) -> converge_control::model::DriveUsage {
    converge_control::model::DriveUsage {
        extents_used: c.extents_used,
        committed_bytes: c.bytes_committed,
        slots_used: Some(c.slots_used),
    }
}

/// An unchanged usage record is written again this often (in case it was deleted); an idle
/// node writes nothing else.
const UNCHANGED_REWRITE: Duration = Duration::from_secs(600);

/// Publishes [`node_usage`] when it changes (checked every 2 s) and at least every
/// [`UNCHANGED_REWRITE`], so placement and `status` see what the drives hold within
/// seconds; and checkpoints the drives that went quiet.
pub async fn publish(node: std::sync::Arc<Node>) {
    let mut last: Option<(converge_control::model::NodeUsage, std::time::Instant)> = None;
    loop {
        // A drive that wrote nothing since the last round folds its journal into its
        // metadata pages (see `Drive::checkpoint_if_quiet`).
        for t in node.drives.values().filter(|t| t.failure().is_none()) {
            if let Err(e) = t.drive().checkpoint_if_quiet() {
                log::warn!("drive {}: checkpoint: {e}", t.identity().drive);
            }
        }
        let now = node_usage(&node);
        let stale = last
            .as_ref()
            .is_none_or(|(u, at)| *u != now || at.elapsed() > UNCHANGED_REWRITE);
        if stale {
            match node.cluster.put_usage(node.cfg.node_id, &now).await {
                Ok(()) => last = Some((now, std::time::Instant::now())),
                Err(e) => log::debug!("publishing drive usage: {e}"),
            }
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// Written and stored bytes of the extents the asked nodes hold, by (drive, volume, slab).
#[derive(Default)]
pub struct Gathered {
    pub written: HashMap<(DriveId, VolumeId, u64), Usage>,
    /// Nodes that answered: an extent they did not list has nothing written (the slab is
    /// placed, but no write reached that copy yet).
    pub answered: BTreeSet<NodeId>,
}

impl Gathered {
    /// What the copy `e` of `volume`'s slab holds, if its node answered.
    pub fn of(&self, e: &ExtentRecord, volume: VolumeId, slab: SlabIndex) -> Option<Usage> {
        self.answered.contains(&e.node).then(|| {
            self.written
                .get(&(e.drive, volume, slab.0))
                .copied()
                .unwrap_or_default()
        })
    }

    fn add(&mut self, list: Vec<LocalExtent>) {
        for e in list {
            // A node of an older build does not say: its extents store what they hold.
            let usage = Usage {
                written: e.written_bytes,
                stored: e.stored_bytes.unwrap_or(e.written_bytes),
            };
            self.written.insert((e.drive, e.volume, e.slab), usage);
        }
    }

    /// Sum per drive (every copy and chunk counts).
    pub fn per_drive(&self) -> HashMap<DriveId, Usage> {
        let mut m: HashMap<DriveId, Usage> = HashMap::new();
        for ((d, _, _), u) in &self.written {
            let e = m.entry(*d).or_default();
            *e = e.add(*u);
        }
        m
    }
}

/// Asks `nodes` (all live nodes when `None`) for their extents (of `volume` only, if
/// given), at once: this node answers from its own drives.
pub async fn gather(
    node: &Node,
    nodes: Option<&BTreeSet<NodeId>>,
    volume: Option<VolumeId>,
) -> Gathered {
    let mut g = Gathered::default();
    let live = match node.cluster.live_nodes().await {
        Ok(l) => l,
        Err(e) => {
            log::warn!("written bytes: listing live nodes: {e}");
            return g;
        }
    };
    let path = match volume {
        Some(v) => format!("/v1/extents/{v}"),
        None => "/v1/extents".to_string(),
    };
    let mut asks = Vec::new();
    let wanted = |id: NodeId| nodes.is_none_or(|n| n.contains(&id));
    for n in live.into_iter().filter(|n| wanted(n.id)) {
        if n.id == node.cfg.node_id {
            g.add(local(node, volume));
            g.answered.insert(n.id);
            continue;
        }
        let path = path.clone();
        asks.push(async move {
            let got = tokio::time::timeout(
                ASK_TIMEOUT,
                crate::http_client::request(node, &n, "GET", &path, b""),
            )
            .await;
            let list = match got {
                Ok(Ok((200, body))) => match serde_json::from_slice::<Vec<LocalExtent>>(&body) {
                    Ok(l) => Some(l),
                    Err(e) => {
                        log::warn!("written bytes: node {}'s extent list: {e}", n.id);
                        None
                    }
                },
                Ok(Ok((status, _))) => {
                    log::warn!("written bytes: node {} answered {status}", n.id);
                    None
                }
                Ok(Err(e)) => {
                    log::warn!("written bytes: asking node {}: {e}", n.id);
                    None
                }
                Err(_) => {
                    log::warn!(
                        "written bytes: node {} did not answer in {ASK_TIMEOUT:?}",
                        n.id
                    );
                    None
                }
            };
            (n.id, list)
        });
    }
    for (id, list) in converge_volume::join_all(asks).await {
        if let Some(l) = list {
            g.add(l);
            g.answered.insert(id);
        }
    }
    g
}

/// A volume's written and stored bytes from its slab map and what its extents' nodes
/// answered: per slab, a mirror's fullest in-sync copy that answered (else its fullest
/// copy), a parity slab's data chunks summed (chunk `j < K` of the record). `None` when a
/// slab has no copy that answered, or a data chunk did not.
pub fn volume_usage(
    volume: VolumeId,
    resiliency: Resiliency,
    slabs: &BTreeMap<SlabIndex, SlabRecord>,
    g: &Gathered,
) -> Option<Usage> {
    let mut total = Usage::default();
    for (idx, s) in slabs {
        let of = |e: &ExtentRecord| g.of(e, volume, *idx);
        let fullest = |it: &mut dyn Iterator<Item = Usage>| it.max_by_key(|u| u.written);
        let slab = match resiliency.of_slab(*idx) {
            Resiliency::Parity { data, .. } => s
                .extents
                .iter()
                .take(usize::from(data))
                .map(of)
                .try_fold(Usage::default(), |acc, u| Some(acc.add(u?)))?,
            // In-sync copies tell; a stale one may miss writes or keep trimmed blocks.
            _ => fullest(
                &mut s
                    .extents
                    .iter()
                    .filter(|e| e.state == ExtentState::InSync)
                    .filter_map(of),
            )
            .or_else(|| fullest(&mut s.extents.iter().filter_map(of)))?,
        };
        total = total.add(slab);
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slab(drives: &[u64]) -> SlabRecord {
        SlabRecord {
            extents: drives
                .iter()
                .map(|d| ExtentRecord {
                    drive: DriveId(*d),
                    node: NodeId(*d as u32),
                    state: ExtentState::InSync,
                    holds_acked: false,
                })
                .collect(),
        }
    }

    /// Plain extents: what they store is what they hold.
    fn u(w: u64) -> Usage {
        Usage {
            written: w,
            stored: w,
        }
    }

    fn written(
        v: VolumeId,
        r: Resiliency,
        slabs: &BTreeMap<SlabIndex, SlabRecord>,
        g: &Gathered,
    ) -> Option<u64> {
        volume_usage(v, r, slabs, g).map(|u| u.written)
    }

    /// Compressed copies: the chosen copy's stored bytes come with its written ones.
    #[test]
    fn stored_bytes_follow_the_copy_that_tells() {
        let v = VolumeId(9);
        let mut g = Gathered::default();
        for (d, w, st) in [(1, 40, 10), (2, 40, 12), (3, 36, 9)] {
            g.written.insert(
                (DriveId(d), v, 0),
                Usage {
                    written: w,
                    stored: st,
                },
            );
            g.answered.insert(NodeId(d as u32));
        }
        let slabs: BTreeMap<SlabIndex, SlabRecord> = [(SlabIndex(0), slab(&[1, 2, 3]))].into();
        let got = volume_usage(v, Resiliency::Mirror3, &slabs, &g).unwrap();
        assert_eq!(got.written, 40);
        assert!(got.stored == 10 || got.stored == 12);
        assert_eq!(got.saved(), 40 - got.stored);
        let d = g.per_drive();
        assert_eq!((d[&DriveId(3)].written, d[&DriveId(3)].stored), (36, 9));
        // An older node's list (no stored figure) stores what it holds.
        let mut h = Gathered::default();
        h.add(vec![LocalExtent {
            drive: DriveId(1),
            volume: v,
            slab: 0,
            written_bytes: 64,
            stored_bytes: None,
        }]);
        assert_eq!(h.per_drive()[&DriveId(1)].stored, 64);
        assert_eq!(
            Usage {
                written: 4,
                stored: 9
            }
            .saved(),
            0
        );
    }

    #[test]
    fn mirrors_count_their_fullest_copy_and_parity_its_data_chunks() {
        let v = VolumeId(9);
        let mut g = Gathered::default();
        // Nodes 1..=4 (drive d on node d) answered; slab 0 on drives 1, 2, 3; slab 1 on drives 2, 3, 4.
        for (d, s, w) in [
            (1, 0, 40),
            (2, 0, 40),
            (3, 0, 36),
            (2, 1, 8),
            (3, 1, 8),
            (4, 1, 8),
        ] {
            g.written.insert((DriveId(d), v, s), u(w));
            g.answered.insert(NodeId(d as u32));
        }
        let slabs: BTreeMap<SlabIndex, SlabRecord> = [
            (SlabIndex(0), slab(&[1, 2, 3])),
            (SlabIndex(1), slab(&[2, 3, 4])),
        ]
        .into();
        assert_eq!(written(v, Resiliency::Mirror3, &slabs, &g), Some(48));
        // A stale copy counts only when no in-sync copy answered.
        let mut stale = slabs.clone();
        stale.get_mut(&SlabIndex(0)).unwrap().extents[0].state = ExtentState::Stale;
        g.written.insert((DriveId(1), v, 0), u(64));
        assert_eq!(written(v, Resiliency::Mirror3, &stale, &g), Some(48));
        g.answered.remove(&NodeId(2));
        g.answered.remove(&NodeId(3));
        // Only slab 0's stale copy answered: better than nothing.
        assert_eq!(written(v, Resiliency::Mirror3, &stale, &g), Some(64 + 8));
        g.answered.extend([NodeId(2), NodeId(3)]);
        g.written.insert((DriveId(1), v, 0), u(40));
        // As parity-2+1, drive 3 (chunk 2) is parity: slab 0 = 40 + 40, slab 1 = 8 + 8.
        let p = Resiliency::Parity { data: 2, parity: 1 };
        assert_eq!(written(v, p, &slabs, &g), Some(96));
        // An extent a node that answered does not hold has nothing written.
        g.written.remove(&(DriveId(1), v, 0));
        assert_eq!(written(v, p, &slabs, &g), Some(40 + 8 + 8));
        g.written.insert((DriveId(1), v, 0), u(40));
        // A parity chunk whose node is down does not matter; a data chunk's does.
        // (drive 3 is slab 0's parity chunk, drive 4 slab 1's).
        g.answered.remove(&NodeId(4));
        assert_eq!(written(v, p, &slabs, &g), Some(96));
        g.answered.remove(&NodeId(2));
        assert_eq!(written(v, p, &slabs, &g), None);
        // A mirror needs one copy of each slab whose node answered.
        assert_eq!(written(v, Resiliency::Mirror3, &slabs, &g), Some(48));
        g.answered.remove(&NodeId(3));
        assert_eq!(written(v, Resiliency::Mirror3, &slabs, &g), None);
        // Another volume's extents never count.
        g.written.insert((DriveId(2), VolumeId(10), 1), u(4096));
        assert_eq!(written(v, Resiliency::Mirror3, &slabs, &g), None);
        assert_eq!(g.per_drive()[&DriveId(2)].written, 40 + 8 + 4096);
    }

    /// Placement never places an extent its drive refuses, nor refuses one it would take:
    /// a real engine (a thin drive: two slots per data extent) takes random new extents,
    /// overwrites, compressed extents, snapshots (their kept blocks claim room and shadow
    /// extents take slots) and frees; before every new extent, placement decides from the
    /// drive record and this node's report of the engine's count, as the cluster does
    /// (`drive_load`), and the engine must agree. Placement used to drop the kept blocks'
    /// claim, and so placed extents on drives that had no room for them (issue 42).
    #[test]
    fn placement_places_exactly_the_extents_a_drive_takes() {
        use converge_control::model::{drive_load, DriveRecord};
        use converge_engine::{Drive, DriveIdentity, FaultyFile, FormatOptions};
        use converge_types::{
            ClusterId, Compression, Epoch, ExtentKey, FloorHistory, MediaType, Version,
        };
        use rand::{Rng, SeedableRng};
        const SLAB: u64 = 1 << 20;
        const B: usize = 4096;
        let mut refused = 0;
        let mut placed_total = 0;
        for seed in 0..4u64 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let id = DriveIdentity {
                cluster: ClusterId(1),
                node: NodeId(1),
                drive: DriveId(9),
                slab_size_bytes: SLAB,
                role: converge_types::DriveRole::Capacity,
                media: MediaType::Ssd,
            };
            let d = Drive::format_with(
                std::sync::Arc::new(FaultyFile::new(8 << 20)),
                id,
                FormatOptions {
                    journal_bytes: Some(256 << 10),
                    ..Default::default()
                },
            )
            .unwrap();
            let cap = d.capacity();
            assert!(cap.slots_total > cap.extents_total, "a thin drive: {cap:?}");
            let rec = DriveRecord {
                id: DriveId(9),
                node: NodeId(1),
                path: String::new(),
                role: converge_types::DriveRole::Capacity,
                media: MediaType::Ssd,
                size_bytes: cap.bytes_total,
                extents_total: cap.extents_total,
                slab_size_bytes: SLAB,
                tbw_bytes: None,
                warranty_years: None,
                slots_total: Some(cap.slots_total),
            };
            let data = |rng: &mut rand::rngs::StdRng, blocks: usize, plain: bool| {
                let mut v = vec![0u8; blocks * B];
                if plain {
                    rng.fill(&mut v[..]);
                } else {
                    // Compressible: one random byte per 512.
                    for c in v.chunks_mut(512) {
                        c.fill(rng.gen());
                    }
                }
                v
            };
            let (mut epoch, mut seq) = (1u64, 0u64);
            let mut keys: Vec<ExtentKey> = Vec::new();
            let mut next = 0u64;
            let mut snapshots: Vec<u64> = Vec::new();
            for op in 0..300 {
                seq += 1;
                let version = Version(epoch << 32 | seq);
                let ctx = format!("seed {seed} op {op}: {:?}", d.capacity());
                match rng.gen_range(0..10) {
                    // A new extent, where placement says there is room.
                    0..=3 => {
                        let load = drive_load(
                            &rec,
                            keys.len() as u64,
                            Some(&drive_usage(&d.capacity())),
                            true,
                        );
                        let fits = converge_control::place(1, &[load], &[]).is_ok();
                        next += 1;
                        let k = ExtentKey {
                            volume: VolumeId(1),
                            slab: SlabIndex(next),
                        };
                        // Whole and incompressible: the most a new extent may take.
                        let v = data(&mut rng, (SLAB as usize) / B, true);
                        let crcs = converge_volume::block_crcs(&v);
                        let r = d.write(k, Epoch(epoch), version, 0, &v, &crcs);
                        match (fits, r) {
                            (true, Ok(())) => {
                                keys.push(k);
                                placed_total += 1;
                            }
                            (false, Err(_)) => refused += 1,
                            (true, Err(e)) => {
                                panic!("{ctx}: placement placed {load:?}; the drive refused: {e}")
                            }
                            (false, Ok(())) => {
                                panic!("{ctx}: placement refused {load:?}; the drive took it")
                            }
                        }
                    }
                    // Part of an extent rewritten (kept for the snapshot, if any); the
                    // drive may refuse it when full: not placement's business.
                    4..=6 if !keys.is_empty() => {
                        let k = keys[rng.gen_range(0..keys.len())];
                        let n = rng.gen_range(1..=64);
                        let first = rng.gen_range(0..(SLAB as usize / B) - n);
                        let plain = rng.gen_bool(0.5);
                        let v = data(&mut rng, n, plain);
                        let crcs = converge_volume::block_crcs(&v);
                        let off = (first * B) as u64;
                        let _ = d.write(k, Epoch(epoch), version, off, &v, &crcs);
                    }
                    // Later writes of an extent compressed.
                    7 if !keys.is_empty() => {
                        let k = keys[rng.gen_range(0..keys.len())];
                        let _ = d.set_codec(k, Epoch(epoch), Compression::Lz4);
                    }
                    // A snapshot of every extent; the owner writes at the next epoch.
                    8 => {
                        let previous = snapshots.last().copied().map(Epoch);
                        for &k in &keys {
                            d.set_snapshot_floor(
                                k,
                                Epoch(epoch),
                                Epoch(epoch),
                                previous,
                                FloorHistory::Continues,
                            )
                            .unwrap();
                        }
                        snapshots.push(epoch);
                        epoch += 1;
                        seq = 0;
                    }
                    // An extent freed (its volume deleted).
                    _ if !keys.is_empty() => {
                        let k = keys.swap_remove(rng.gen_range(0..keys.len()));
                        d.free_extent(k).unwrap();
                    }
                    _ => {}
                }
            }
        }
        // Both sides of the check were exercised.
        assert!(
            refused > 20 && placed_total > 20,
            "{refused} {placed_total}"
        );
    }
}
