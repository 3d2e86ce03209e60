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
    /// Scrubs slab `idx`'s snapshots (see the module docs; a parity slab's in
    /// [`Volume::parity_scrub_snapshot_step`]).
    pub(crate) async fn scrub_snapshots(
        &self,
        idx: SlabIndex,
        slab: &Slab,
        repair: bool,
        throttle: &Throttle,
    ) -> Result<ScrubReport, VolumeError> {
        let mut rep = ScrubReport::default();
        // A rotation's leftover keeps no snapshot anyone reads (the span's mirror part
        // does), and a cut rotation may have left its keeping half written.
        if self.snapshots().is_empty() || self.is_leftover(idx) {
            return Ok(rep);
        }
        let geometry = self.geometry_of(idx);
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
                let step = match geometry {
                    Some(g) => {
                        self.parity_scrub_snapshot_step(g, idx, slab, (s, newer), start, n, repair)
                            .await?
                    }
                    None => {
                        self.scrub_snapshot_step(idx, slab, (s, newer), start, n, repair)
                            .await?
                    }
                };
                rep.add(&step);
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

    /// Rows `[start, start + n)` of parity slab `idx` at snapshot `s` (`newer`: the next
    /// newer snapshot, None for the newest), on every in-sync chunk that holds it: only
    /// rows whose version there differs from the next newer point (the chunks keep states
    /// for those; a row is written whole at one version on every chunk). Each row's chunks
    /// must agree on its version and hold it intact, and with all K+M present its parity
    /// must match its data. With `repair`, a chunk's bad (or suspect) block is decoded from
    /// K others and written back into its keeping (`WriteShadow`, the row's version), and
    /// parity that does not match intact data is recomputed; a row fewer than K chunks
    /// give intact counts its bad blocks as lost.
    #[allow(clippy::too_many_arguments)]
    async fn parity_scrub_snapshot_step(
        &self,
        g: crate::parity::Geometry,
        idx: SlabIndex,
        slab: &Slab,
        (s, newer): (Epoch, Option<Epoch>),
        start: u64,
        n: u64,
        repair: bool,
    ) -> Result<ScrubReport, VolumeError> {
        use crate::parity_io::{row_version, suspect_as_bad, BSZ};
        let (k, key, epoch) = (usize::from(g.k()), self.key(idx), self.epoch());
        let mut rep = ScrubReport::default();
        let ex = self.chunks(g, idx, slab)?;
        let versions_at = |at: ExtentLoc, point: Option<Epoch>| {
            let op = match point {
                Some(snapshot) => ExtentOp::VersionsAt {
                    key,
                    epoch,
                    snapshot,
                    offset: start * BS,
                    count: n as u32,
                    any: false,
                },
                None => ExtentOp::Versions {
                    key,
                    epoch,
                    offset: start * BS,
                    count: n as u32,
                },
            };
            self.ask(at, op, ExtentReply::into_versions)
        };
        // The chunks that hold `s`, and the rows they keep states of for it.
        let mut kept = vec![false; n as usize];
        let mut holders = Vec::new();
        for (c, &at) in ex.iter().enumerate() {
            if at.state != ExtentState::InSync {
                continue;
            }
            match (versions_at(at, Some(s)).await, versions_at(at, newer).await) {
                (Ok(a), Ok(b)) if a.len() == n as usize && b.len() == n as usize => {
                    for i in 0..n as usize {
                        kept[i] |= a[i] != b[i] && a[i].0 != 0;
                    }
                    holders.push(c);
                }
                (Err(ReplicaError::StaleEpoch(w)), _) | (_, Err(ReplicaError::StaleEpoch(w))) => {
                    return Err(self.fenced(w))
                }
                // It does not hold the snapshot, or it is away: not judged here.
                _ => {}
            }
        }
        if !kept.iter().any(|&x| x) {
            return Ok(rep);
        }
        let mut got: Vec<Option<BlocksReply>> = vec![None; ex.len()];
        for &c in &holders {
            let op = ExtentOp::ReadBlocksAt {
                key,
                epoch,
                snapshot: s,
                offset: start * BS,
                len: (n * BS) as u32,
            };
            match self.ask(ex[c], op, ExtentReply::into_blocks).await {
                Ok(mut r) => {
                    rep.bytes_read += n * BS;
                    suspect_as_bad(&mut r);
                    got[c] = Some(r);
                }
                Err(ReplicaError::StaleEpoch(why)) => return Err(self.fenced(why)),
                Err(_) => {}
            }
        }
        let all_present = got.iter().all(Option::is_some);
        let present = got.iter().flatten().count();
        let mut fix: Vec<(usize, usize)> = Vec::new(); // (row, chunk)
        let mut row_versions = vec![Version(0); n as usize];
        for i in (0..n as usize).filter(|&i| kept[i]) {
            rep.snapshot_blocks_checked += k as u64;
            let bad: Vec<usize> = (0..ex.len())
                .filter(|&c| {
                    got[c]
                        .as_ref()
                        .is_some_and(|r| r.bad_blocks.contains(&(i as u32)))
                })
                .collect();
            if present < k {
                // Fewer than K chunks hold the snapshot here (the others were filled after
                // it, their descent cut short): its rows cannot be decoded or checked
                // against each other, only each block against its crc.
                rep.bad_checksums += u64::from(!bad.is_empty());
                rep.snapshot_blocks_lost += bad.len() as u64;
                continue;
            }
            let Some(v) = row_version(&got, i, k) else {
                rep.bad_checksums += u64::from(!bad.is_empty());
                rep.snapshot_blocks_lost += bad.len() as u64;
                rep.mismatches += u64::from(bad.is_empty());
                let seen: Vec<String> = got
                    .iter()
                    .enumerate()
                    .filter_map(|(c, r)| {
                        let r = r.as_ref()?;
                        let bad = r.bad_blocks.contains(&(i as u32));
                        Some(format!(
                            "chunk {c}: {}{}",
                            r.versions[i],
                            if bad { " (bad)" } else { "" }
                        ))
                    })
                    .collect();
                log::error!(
                    "scrub: volume {} slab {idx} row {}: fewer than {k} chunks holding snapshot {s} give it intact at one version ({})",
                    self.cfg.name,
                    start + i as u64,
                    seen.join(", ")
                );
                continue;
            };
            row_versions[i] = v;
            let disagree: Vec<usize> = (0..ex.len())
                .filter(|&c| {
                    got[c]
                        .as_ref()
                        .is_some_and(|r| !r.bad_blocks.contains(&(i as u32)) && r.versions[i] != v)
                })
                .collect();
            if !disagree.is_empty() {
                rep.mismatches += 1;
                log::error!(
                    "scrub: volume {} slab {idx} row {}: chunks {disagree:?} read snapshot {s} at another version than {v} ({:?})",
                    self.cfg.name,
                    start + i as u64,
                    got.iter().map(|r| r.as_ref().map(|r| r.versions[i])).collect::<Vec<_>>()
                );
            }
            if !bad.is_empty() {
                rep.bad_checksums += 1;
                fix.extend(bad.iter().map(|&c| (i, c)));
            } else if disagree.is_empty() && all_present {
                let shards: Vec<&[u8]> = got
                    .iter()
                    .map(|r| &r.as_ref().expect("present").data[i * BSZ..(i + 1) * BSZ])
                    .collect();
                let ok = self
                    .with_codec(g, |codec| codec.verify(&shards))
                    .map_err(|e| self.copy_error(idx, format!("parity codec: {e}")))?;
                if !ok {
                    rep.mismatches += 1;
                    fix.extend((k..ex.len()).map(|c| (i, c)));
                }
            }
        }
        if !repair || fix.is_empty() {
            return Ok(rep);
        }
        let wanted = |i: usize, c: usize| fix.contains(&(i, c));
        // Parity blocks to recompute read as intact: left out of the decode's input.
        let input = crate::parity_sync::without(&got, fix.iter().copied());
        let decoded = match self.decode_rows(g, &input, &row_versions, &wanted) {
            Ok(d) => d,
            Err(why) => {
                log::error!(
                    "scrub: volume {} slab {idx}: snapshot {s} cannot be repaired: {why}",
                    self.cfg.name
                );
                return Ok(rep);
            }
        };
        for (i, c) in fix {
            let Some(buf) = decoded[c].as_ref() else {
                continue;
            };
            let data = Bytes::copy_from_slice(&buf[i * BSZ..(i + 1) * BSZ]);
            let op = ExtentOp::WriteShadow {
                key,
                epoch,
                snapshot: s,
                offset: (start + i as u64) * BS,
                crcs: block_crcs(&data),
                versions: vec![row_versions[i]],
                data,
            };
            match self.ask(ex[c], op, ExtentReply::into_written).await {
                Ok(w) => {
                    rep.repaired += u64::from(w);
                    log::warn!(
                        "scrub: volume {} slab {idx} row {}: repaired snapshot {s} on chunk {c} (node {})",
                        self.cfg.name,
                        start + i as u64,
                        ex[c].node
                    );
                }
                Err(ReplicaError::StaleEpoch(why)) => return Err(self.fenced(why)),
                Err(e) => log::error!(
                    "scrub: volume {} slab {idx}: could not repair snapshot {s}'s row {} on chunk {c}: {e}",
                    self.cfg.name,
                    start + i as u64
                ),
            }
        }
        Ok(rep)
    }
}
