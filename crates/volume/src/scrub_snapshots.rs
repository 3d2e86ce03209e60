//! Scrub of what copies keep for snapshots (docs/SNAPSHOTS.md, "Scrub"). After a mirror
//! slab's live blocks, with snapshots neither taken nor deleted and no fill copying them,
//! each snapshot from the newest down: every in-sync copy that holds it reads the slab at
//! it (`ReadBlocksAt`, each block's state checked against its crc); a block bad on one copy
//! and whole on another is written back into the bad copy's keeping for that snapshot
//! (`WriteShadow`, the good copy's data and version), and copies that read a snapshot
//! differently are counted as mismatches. Newest first: a state kept for a snapshot also
//! answers the reads of older ones, so one bad state found at the newest snapshot that
//! reads it is repaired before the older ones are read. Only the blocks a snapshot reads
//! differently from the next newer one (or, for the newest, from the live blocks) are read
//! at it, as each copy's metadata says (`Changed`): the others are the same states, checked
//! there already, so a scrub reads each kept state once, not the slab once per snapshot.
//! The newest snapshot's steps hold the slab's writes (they preserve into its keeping).

use super::*;
use crate::resync::{ScrubReport, Throttle, SCRUB_STEP_BLOCKS};

impl<R: ReplicaIo, A: SlabAllocator> Volume<R, A> {
    /// Scrubs slab `idx`'s snapshots (see the module docs); a parity slab has none.
    pub(crate) async fn scrub_snapshots(
        &self,
        idx: SlabIndex,
        slab: &Slab,
        repair: bool,
        throttle: &Throttle,
    ) -> Result<ScrubReport, VolumeError> {
        let mut rep = ScrubReport::default();
        if self.geometry_of(idx).is_some() || self.snapshots().is_empty() {
            return Ok(rep);
        }
        let _history = self.history.lock().await;
        let snaps = self.snapshots();
        let Some(&newest) = snaps.last() else {
            return Ok(rep);
        };
        let blocks = self.cfg.slab_size_bytes / BS;
        for (i, &s) in snaps.iter().enumerate().rev() {
            let newer = snaps.get(i + 1).copied();
            let mut start = 0;
            while start < blocks {
                let n = SCRUB_STEP_BLOCKS.min(blocks - start);
                throttle.take(n * BS * slab.in_sync() as u64).await;
                let _g = match s == newest {
                    true => Some(slab.gate.write().await),
                    false => None,
                };
                if slab.is_released() {
                    return Ok(rep);
                }
                rep.add(
                    &self
                        .scrub_snapshot_step(idx, slab, (s, newer), start, n, repair)
                        .await?,
                );
                start += n;
            }
        }
        Ok(rep)
    }

    /// Blocks `[start, start + n)` of snapshot `s` (`newer`: the next newer snapshot, None
    /// for the newest) on every in-sync copy that holds it.
    async fn scrub_snapshot_step(
        &self,
        idx: SlabIndex,
        slab: &Slab,
        (s, newer): (Epoch, Option<Epoch>),
        start: u64,
        n: u64,
        repair: bool,
    ) -> Result<ScrubReport, VolumeError> {
        let key = self.key(idx);
        let epoch = self.epoch();
        let mut rep = ScrubReport::default();
        // The blocks any holder reads differently at `s` than at `newer` (metadata).
        let mut kept = vec![0u64; (n as usize).div_ceil(64)];
        let mut holders = Vec::new();
        for e in slab.extents().iter() {
            if e.state != ExtentState::InSync {
                continue;
            }
            let op = ExtentOp::Changed {
                key,
                epoch,
                from: s,
                to: newer,
                offset: start * BS,
                count: n as u32,
            };
            match self.ask(*e, op, ExtentReply::into_bitmap).await {
                Ok(bits) => {
                    for (k, b) in kept.iter_mut().zip(&bits) {
                        *k |= b;
                    }
                    holders.push(*e);
                }
                Err(ReplicaError::StaleEpoch(why)) => return Err(self.fenced(why)),
                // It does not hold the snapshot, or it is away: not judged here.
                Err(_) => {}
            }
        }
        let is_kept = |b: usize| kept[b / 64] >> (b % 64) & 1 == 1;
        if !(0..n as usize).any(is_kept) {
            return Ok(rep);
        }
        let mut copies = Vec::new();
        for e in holders {
            let op = ExtentOp::ReadBlocksAt {
                key,
                epoch,
                snapshot: s,
                offset: start * BS,
                len: (n * BS) as u32,
            };
            match self.ask(e, op, ExtentReply::into_blocks).await {
                Ok(r) => {
                    rep.bytes_read += n * BS;
                    copies.push((e, r));
                }
                Err(ReplicaError::StaleEpoch(why)) => return Err(self.fenced(why)),
                // A copy filled after the snapshot does not hold it (reads of it go
                // elsewhere), or it is away: not judged here.
                Err(_) => {}
            }
        }
        if copies.is_empty() {
            return Ok(rep);
        }
        let bsz = BS as usize;
        for b in (0..n as usize).filter(|&b| is_kept(b)) {
            rep.snapshot_blocks_checked += 1;
            let bi = b as u32;
            fn state(r: &BlocksReply, b: usize, bsz: usize) -> (Version, &[u8]) {
                (r.versions[b], &r.data[b * bsz..(b + 1) * bsz])
            }
            let whole: Vec<&(ExtentLoc, BlocksReply)> = copies
                .iter()
                .filter(|(_, r)| !r.bad_blocks.contains(&bi) && !r.suspect.contains(&bi))
                .collect();
            if whole
                .windows(2)
                .any(|w| state(&w[0].1, b, bsz) != state(&w[1].1, b, bsz))
            {
                rep.mismatches += 1;
                log::error!(
                    "scrub: volume {} slab {idx} block {}: the copies holding snapshot {s} read it differently ({})",
                    self.cfg.name,
                    start + b as u64,
                    whole
                        .iter()
                        .map(|(e, r)| format!("node {} drive {}: version {}", e.node, e.drive, r.versions[b]))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
            let bad: Vec<ExtentLoc> = copies
                .iter()
                .filter(|(_, r)| r.bad_blocks.contains(&bi))
                .map(|(e, _)| *e)
                .collect();
            if bad.is_empty() {
                continue;
            }
            rep.bad_checksums += 1;
            let Some((src, sr)) = whole.first() else {
                rep.snapshot_blocks_lost += 1;
                log::error!(
                    "scrub: volume {} slab {idx} block {}: no copy holding snapshot {s} has it whole",
                    self.cfg.name,
                    start + b as u64
                );
                continue;
            };
            if !repair {
                continue;
            }
            for e in bad {
                let data = sr.data.slice(b * bsz..(b + 1) * bsz);
                let op = ExtentOp::WriteShadow {
                    key,
                    epoch,
                    snapshot: s,
                    offset: (start + b as u64) * BS,
                    crcs: block_crcs(&data),
                    versions: vec![sr.versions[b]],
                    data,
                };
                let w = self
                    .ask(e, op, ExtentReply::into_written)
                    .await
                    .map_err(|err| self.replica_failed(idx, e, err))?;
                rep.repaired += u64::from(w);
                log::warn!(
                    "scrub: volume {} slab {idx} block {}: repaired snapshot {s} on the copy on node {} from node {}",
                    self.cfg.name,
                    start + b as u64,
                    e.node,
                    src.node
                );
            }
        }
        Ok(rep)
    }
}
