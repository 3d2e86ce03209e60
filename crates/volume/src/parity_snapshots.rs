//! Snapshots of parity volumes (docs/adr/0012, docs/SNAPSHOTS.md "Parity volumes"). A
//! parity slab's K+M chunks are extents like a mirror's copies: each keeps what the
//! snapshot reads when later (held) row writes replace it, so at a snapshot every chunk
//! that holds it reads the row as it was, and the rows are consistent there as they were
//! when it was taken (writes drained, priors settled first). A read at a snapshot reads
//! the data chunks there and decodes what one cannot give from any K chunks that hold
//! the snapshot, as a live read does; changes come per row (a row is written whole, at one
//! version, on every chunk).

use super::*;
use crate::parity_io::{good_at, interleave, row_version, suspect_as_bad, BSZ};
use crate::resync::Throttle;
use converge_types::BlocksReply;

/// Rows a parity fill copies of a snapshot per step (256 KiB per chunk).
const RUN_ROWS: u64 = 64;

impl<R: ReplicaIo, A: SlabAllocator> Volume<R, A> {
    /// Before a snapshot of a parity volume, with every write drained (the caller holds
    /// every slab's gate): every chunk drops the priors its row writes still hold (a
    /// revert must never bring back a state older than the snapshot; a floor is refused
    /// while priors are held). A slab a failed write left suspect (its rows may need their
    /// priors) is reconciled first.
    pub(crate) async fn settle_for_snapshot(
        &self,
        slabs: &[(SlabIndex, Arc<Slab>)],
    ) -> Result<(), VolumeError> {
        for (idx, slab) in slabs {
            if self.geometry_of(*idx).is_none() || slab.is_released() {
                continue;
            }
            if slab.suspect.load(Ordering::Acquire) {
                self.reconcile_slab(*idx, slab).await?;
                slab.suspect.store(false, Ordering::Release);
            }
            let failed: Vec<String> = self
                .settle_on(
                    *idx,
                    &writable(&slab.extents()),
                    self.settled_upto(slab),
                    &[],
                )
                .await
                .into_iter()
                .filter_map(|(at, r)| {
                    r.err()
                        .map(|e| format!("slab {idx} node {} drive {}: {e}", at.node, at.drive))
                })
                .collect();
            if !failed.is_empty() {
                return Err(self.snapshot_error(format!(
                    "no snapshot taken: {} parity chunks could not drop the priors of their \
                     row writes ({})",
                    failed.len(),
                    failed.join("; ")
                )));
            }
        }
        Ok(())
    }

    /// Every row write of the slab so far: what a settle of all its priors names.
    pub(crate) fn settled_upto(&self, slab: &Slab) -> Version {
        Version(self.epoch().0 << 32 | slab.seq.load(Ordering::Acquire))
    }

    /// Before a parity chunk being filled takes the newest snapshot as its floor: it drops
    /// the priors it still holds (a chunk out of sync is never reverted: its rows are
    /// rewritten by the fill), as a floor requires.
    pub(crate) async fn settle_joining(
        &self,
        idx: SlabIndex,
        slab: &Slab,
        target: ExtentLoc,
    ) -> Result<(), VolumeError> {
        if self.geometry_of(idx).is_none() {
            return Ok(());
        }
        let upto = self.settled_upto(slab);
        match self.settle_on(idx, &[target], upto, &[]).await.pop() {
            Some((_, Err(e))) => Err(self.replica_failed(idx, target, e)),
            _ => Ok(()),
        }
    }

    /// Piece `p` of parity slab `idx` as snapshot `snapshot` reads it: the rows it touches,
    /// read at the snapshot from the data chunks that hold it (the parity chunks too when
    /// a data chunk cannot give a row), decoded where needed. Nothing is repaired here.
    pub(crate) async fn parity_read_at_piece(
        &self,
        g: Geometry,
        snapshot: Epoch,
        p: Piece,
        slab: &Slab,
    ) -> Result<Bytes, VolumeError> {
        let k = u64::from(g.k());
        let (b0, b1) = (p.offset / BS, (p.offset + p.len) / BS);
        let (r0, r1) = (b0 / k, (b1 - 1) / k + 1);
        let n = r1 - r0;
        let ex = self.chunks(g, p.slab, slab)?;
        let ku = usize::from(g.k());
        let all = ex.len();
        let mut got: Vec<Option<BlocksReply>> = vec![None; all];
        let mut errors: Vec<String> = Vec::new();
        for phase in [0..ku, ku..all] {
            let want: Vec<usize> = phase
                .filter(|&c| ex[c].state == ExtentState::InSync)
                .collect();
            let answers = join_all(
                want.iter()
                    .map(|&c| {
                        let op = ExtentOp::ReadBlocksAt {
                            key: self.key(p.slab),
                            epoch: self.epoch(),
                            snapshot,
                            offset: r0 * BS,
                            len: (n * BS) as u32,
                        };
                        self.ask(ex[c], op, ExtentReply::into_blocks)
                    })
                    .collect(),
            )
            .await;
            for (&c, a) in want.iter().zip(answers) {
                match a {
                    Ok(r) => got[c] = Some(r),
                    Err(ReplicaError::StaleEpoch(why)) => return Err(self.fenced(why)),
                    Err(e) => errors.push(format!(
                        "chunk {c} on node {} drive {}: {e}",
                        ex[c].node, ex[c].drive
                    )),
                }
            }
            let data_whole = (0..ku).all(|c| {
                got[c]
                    .as_ref()
                    .is_some_and(|r| r.bad_blocks.is_empty() && r.suspect.is_empty())
            });
            if data_whole {
                let rows = interleave(ku, n as usize, |c, i| {
                    &got[c].as_ref().expect("checked").data[i * BSZ..]
                });
                return Ok(self.rows_piece(g, r0, p, rows));
            }
        }
        let unreadable = |why: String| {
            self.copy_error(
                p.slab,
                format!(
                    "snapshot at epoch {snapshot}: {why}{}",
                    if errors.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", errors.join("; "))
                    }
                ),
            )
        };
        // A suspect block (rolled back by its drive's recovery) is no source here.
        got.iter_mut().flatten().for_each(suspect_as_bad);
        let mut versions = Vec::with_capacity(n as usize);
        for i in 0..n as usize {
            match row_version(&got, i, ku) {
                Some(v) => versions.push(v),
                None => {
                    return Err(unreadable(format!(
                        "fewer than {ku} chunks hold row {} intact",
                        r0 + i as u64
                    )))
                }
            }
        }
        let decoded = self
            .decode_rows(g, &got, &versions, &|_, c| c < ku)
            .map_err(unreadable)?;
        let rows = interleave(ku, n as usize, |c, i| {
            if good_at(&got, c, i, versions[i]) {
                &got[c].as_ref().expect("good").data[i * BSZ..]
            } else {
                &decoded[c].as_ref().expect("decoded")[i * BSZ..]
            }
        });
        Ok(self.rows_piece(g, r0, p, rows))
    }

    /// Piece `p` out of whole rows from `r0`.
    fn rows_piece(&self, g: Geometry, r0: u64, p: Piece, rows: Vec<u8>) -> Bytes {
        let at = (p.offset - r0 * g.row_bytes()) as usize;
        Bytes::from(rows).slice(at..at + p.len as usize)
    }

    /// Which blocks of piece `p` of parity slab `idx` changed between `from` and `to`
    /// (None: now). Rows are written whole at one version on every chunk, so one chunk's
    /// row versions at the two answer for its rows (a row changed iff they differ), and
    /// every block of a changed row counts as changed. Versions, not the copies' `Changed`:
    /// that one takes two zero blocks for the same, but a chunk's block of a row can read
    /// as zeros at both while the row's other blocks changed.
    pub(crate) async fn parity_changed_piece(
        &self,
        g: Geometry,
        slab: &Slab,
        from: Epoch,
        to: Option<Epoch>,
        p: Piece,
    ) -> Result<Vec<u64>, VolumeError> {
        let k = u64::from(g.k());
        let (b0, b1) = (p.offset / BS, (p.offset + p.len) / BS);
        let (r0, r1) = (b0 / k, (b1 - 1) / k + 1);
        let (key, epoch) = (self.key(p.slab), self.epoch());
        let count = (r1 - r0) as u32;
        let at_snapshot = |s: Epoch| ExtentOp::VersionsAt {
            key,
            epoch,
            snapshot: s,
            offset: r0 * BS,
            count,
            any: false,
        };
        let mut chunks: Vec<ExtentLoc> = slab
            .extents()
            .iter()
            .filter(|e| e.state == ExtentState::InSync)
            .copied()
            .collect();
        chunks.sort_by_key(|e| e.node != self.cfg.local_node);
        let mut why = Vec::new();
        for at in chunks {
            let then = self.ask(at, at_snapshot(from), ExtentReply::into_versions);
            let now = match to {
                Some(t) => self.ask(at, at_snapshot(t), ExtentReply::into_versions),
                None => self.ask(
                    at,
                    ExtentOp::Versions {
                        key,
                        epoch,
                        offset: r0 * BS,
                        count,
                    },
                    ExtentReply::into_versions,
                ),
            };
            let (a, b) = match (then.await, now.await) {
                (Ok(a), Ok(b)) if a.len() == b.len() && a.len() == count as usize => (a, b),
                (Err(ReplicaError::StaleEpoch(w)), _) | (_, Err(ReplicaError::StaleEpoch(w))) => {
                    return Err(self.fenced(w))
                }
                (Err(e), _) | (_, Err(e)) => {
                    why.push(format!("node {} drive {}: {e}", at.node, at.drive));
                    continue;
                }
                _ => {
                    why.push(format!(
                        "node {} drive {}: a short answer",
                        at.node, at.drive
                    ));
                    continue;
                }
            };
            let blocks = (b1 - b0) as usize;
            let mut bits = vec![0u64; blocks.div_ceil(64)];
            for i in 0..blocks {
                let r = ((b0 + i as u64) / k - r0) as usize;
                if a[r] != b[r] {
                    bits[i / 64] |= 1 << (i % 64);
                }
            }
            return Ok(bits);
        }
        Err(VolumeError::Unreadable {
            volume: self.cfg.name.clone(),
            slab: p.slab,
            why: format!(
                "no in-sync chunk could tell the changes since the snapshot at epoch {from}: {}",
                why.join("; ")
            ),
        })
    }

    /// After a fill rebuilt (or resynced) the chunk on `drive`: its keeping for each
    /// snapshot, newest first, as the other chunks that hold the snapshot read their rows
    /// there (decoded from any K of them: a chunk is never a copy of another). Rows the
    /// chunk already reads right at a snapshot are skipped; the others are written into
    /// its keeping (`WriteShadow`, the row's version). The newest snapshot's rows are done
    /// with the slab's writes held (they preserve into its keeping). A snapshot fewer than
    /// K other chunks hold ends the descent: the chunk holds the newer ones. The caller
    /// holds `history`.
    pub(crate) async fn parity_fill_snapshots(
        &self,
        g: Geometry,
        idx: SlabIndex,
        slab: &Slab,
        drive: DriveId,
        throttle: &Throttle,
    ) -> Result<(), VolumeError> {
        let snaps = self.snapshots();
        let Some(&newest) = snaps.last() else {
            return Ok(());
        };
        let ex = self.chunks(g, idx, slab)?;
        let tc = self.chunk_on(idx, &ex, drive)?;
        if ex[tc].state != ExtentState::Syncing {
            return Err(self.copy_error(
                idx,
                format!(
                    "the chunk on drive {drive} went {:?} during the fill",
                    ex[tc].state
                ),
            ));
        }
        let rows = self.cfg.slab_size_bytes / BS;
        let mut oldest = None;
        'snapshots: for &s in snaps.iter().rev() {
            let mut r0 = 0;
            while r0 < rows {
                let n = RUN_ROWS.min(rows - r0);
                throttle.take(n * BS * u64::from(g.k())).await;
                let _g = match s == newest {
                    true => Some(slab.gate.write().await),
                    false => None,
                };
                if !self
                    .parity_copy_snapshot_rows(g, idx, slab, tc, s, r0, n)
                    .await?
                {
                    break 'snapshots;
                }
                r0 += n;
            }
            oldest = Some(s);
        }
        self.copied_snapshots(idx, ex[tc], &snaps, oldest).await
    }

    /// Rows `[r0, r0 + n)` of snapshot `s` into chunk `tc`'s keeping, where it reads them
    /// differently than the other chunks holding `s` do. Ok(false) when fewer than K of
    /// them give a row intact.
    #[allow(clippy::too_many_arguments)]
    async fn parity_copy_snapshot_rows(
        &self,
        g: Geometry,
        idx: SlabIndex,
        slab: &Slab,
        tc: usize,
        s: Epoch,
        r0: u64,
        n: u64,
    ) -> Result<bool, VolumeError> {
        let ex = self.chunks(g, idx, slab)?;
        let (key, epoch) = (self.key(idx), self.epoch());
        let target = ex[tc];
        let op = ExtentOp::VersionsAt {
            key,
            epoch,
            snapshot: s,
            offset: r0 * BS,
            count: n as u32,
            any: true,
        };
        let have = self
            .ask(target, op, ExtentReply::into_versions)
            .await
            .map_err(|e| self.replica_failed(idx, target, e))?;
        let others: Vec<usize> = (0..ex.len())
            .filter(|&c| c != tc && ex[c].state == ExtentState::InSync)
            .collect();
        let answers = join_all(
            others
                .iter()
                .map(|&c| {
                    let op = ExtentOp::ReadBlocksAt {
                        key,
                        epoch,
                        snapshot: s,
                        offset: r0 * BS,
                        len: (n * BS) as u32,
                    };
                    self.ask(ex[c], op, ExtentReply::into_blocks)
                })
                .collect(),
        )
        .await;
        let mut got: Vec<Option<BlocksReply>> = vec![None; ex.len()];
        for (&c, a) in others.iter().zip(answers) {
            match a {
                Ok(mut r) => {
                    suspect_as_bad(&mut r);
                    got[c] = Some(r);
                }
                Err(ReplicaError::StaleEpoch(why)) => return Err(self.fenced(why)),
                Err(e) => log::info!(
                    "volume {}: slab {idx}: snapshot {s} not read from chunk {c} (drive {}): {e}",
                    self.cfg.name,
                    ex[c].drive
                ),
            }
        }
        let k = usize::from(g.k());
        let mut versions = Vec::with_capacity(n as usize);
        for i in 0..n as usize {
            match row_version(&got, i, k) {
                Some(v) => versions.push(v),
                None => {
                    log::warn!(
                        "volume {}: slab {idx}: snapshot {s}'s row {} is held intact by fewer than {k} other chunks; the chunk on drive {} holds the later snapshots only",
                        self.cfg.name,
                        r0 + i as u64,
                        target.drive
                    );
                    return Ok(false);
                }
            }
        }
        let differ = |i: usize| have.get(i).is_none_or(|v| *v != versions[i]);
        if !(0..n as usize).any(differ) {
            return Ok(true);
        }
        let decoded = match self.decode_rows(g, &got, &versions, &|i, c| c == tc && differ(i)) {
            Ok(d) => d,
            Err(why) => {
                log::warn!(
                    "volume {}: slab {idx}: snapshot {s} could not be rebuilt into drive {}: {why}",
                    self.cfg.name,
                    target.drive
                );
                return Ok(false);
            }
        };
        let buf = decoded[tc].as_ref().expect("the target's rows are wanted");
        for (i, j) in crate::mirror_part_snapshots::runs(n as usize, differ) {
            let data = Bytes::copy_from_slice(&buf[i * BSZ..j * BSZ]);
            let op = ExtentOp::WriteShadow {
                key,
                epoch,
                snapshot: s,
                offset: (r0 + i as u64) * BS,
                crcs: block_crcs(&data),
                versions: versions[i..j].to_vec(),
                data,
            };
            self.ask(target, op, ExtentReply::into_written)
                .await
                .map_err(|e| self.replica_failed(idx, target, e))?;
        }
        Ok(true)
    }
}
