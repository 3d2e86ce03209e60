//! Making a parity slab's chunks agree (docs/adr/0008): a new owner's reconcile of rows a
//! crash left half-written, the fill of a stale or new chunk by reconstruction (resync,
//! rebuild), and scrub's parity check.

use crate::parity::Geometry;
use crate::parity_io::row_version;
use crate::resync::{needs_copy, CopyReport, Progress, ScrubReport, Throttle, VERSIONS_CHUNK};
use crate::{
    block_crcs, BlocksReply, ExtentLoc, ExtentOp, ExtentReply, ReplicaError, ReplicaIo, Retry,
    Slab, SlabAllocator, Volume, VolumeError, BS,
};
use bytes::Bytes;
use converge_types::{DriveId, ExtentState, SlabIndex, Version};
use std::sync::atomic::Ordering;

const BSZ: usize = BS as usize;

/// Rows a fill reconstructs per step (its rows' writes wait for one step at most).
const FILL_RUN_ROWS: u64 = 64;

/// Rounds a row may take to agree (each revert steps back one version).
const ROW_ROUNDS: usize = 8;

fn in_sync(ex: &[ExtentLoc]) -> Vec<usize> {
    (0..ex.len())
        .filter(|&c| ex[c].state == ExtentState::InSync)
        .collect()
}

impl<R: ReplicaIo, A: SlabAllocator> Volume<R, A> {
    fn retry_failed(&self, idx: SlabIndex, r: Retry) -> VolumeError {
        match r {
            Retry::Fail(e) => e,
            Retry::Again(why) => self.copy_error(idx, why),
        }
    }

    /// After the fence and digest comparison of a takeover (`differ`: the in-sync chunks'
    /// version maps differ), makes every row of the slab agree, then settles every chunk:
    /// no prior from before is needed once every row agrees. The caller holds the slab
    /// with no write in flight (a takeover before serving, or the gate).
    pub(crate) async fn parity_reconcile_slab(
        &self,
        g: Geometry,
        idx: SlabIndex,
        slab: &Slab,
        differ: bool,
    ) -> Result<CopyReport, VolumeError> {
        let k = usize::from(g.k());
        let ex = self.chunks(g, idx, slab)?;
        let live = in_sync(&ex);
        if live.len() < k {
            return Err(self.copy_error(
                idx,
                format!(
                    "only {} of its {} chunks are in sync, {k} needed: the slab cannot be read until more return",
                    live.len(),
                    ex.len()
                ),
            ));
        }
        let mut report = CopyReport::default();
        if differ {
            let key = self.key(idx);
            let epoch = self.epoch();
            let rows = g.rows();
            report.blocks_compared = rows;
            let mut start = 0;
            while start < rows {
                let n = VERSIONS_CHUNK.min(rows - start);
                let mut maps: Vec<Vec<Version>> = Vec::with_capacity(live.len());
                for &c in &live {
                    let op = ExtentOp::Versions {
                        key,
                        epoch,
                        offset: start * BS,
                        count: n as u32,
                    };
                    maps.push(
                        self.ask(ex[c], op, ExtentReply::into_versions)
                            .await
                            .map_err(|e| self.replica_failed(idx, ex[c], e))?,
                    );
                }
                for i in 0..n as usize {
                    if maps.iter().all(|m| m[i] == maps[0][i]) {
                        continue;
                    }
                    report.blocks_differing += 1;
                    report.blocks_written +=
                        self.reconcile_row(g, idx, slab, start + i as u64).await?;
                }
                start += n;
            }
            if report.blocks_differing > 0 {
                log::warn!(
                    "volume {}: slab {idx}: takeover made {} half-written rows agree",
                    self.cfg.name,
                    report.blocks_differing
                );
            }
        }
        let upto = Version(self.epoch().0 << 32 | slab.seq.load(Ordering::Acquire));
        self.settle_chunks(idx, slab, upto, &[]).await;
        Ok(report)
    }

    /// Makes one row's in-sync chunks agree; returns the blocks written. With the newest
    /// version intact on K chunks, the row is completed forward (decoded, written to the
    /// others). Otherwise the chunks holding it go back to their priors (a held write that
    /// did not complete: never acked, since an acked write reached every in-sync chunk),
    /// and the row is looked at again. A newest version without priors can only be the
    /// unheld zero that starts a slab (before any client write): the row is zeroed at it.
    async fn reconcile_row(
        &self,
        g: Geometry,
        idx: SlabIndex,
        slab: &Slab,
        row: u64,
    ) -> Result<u64, VolumeError> {
        let k = usize::from(g.k());
        let key = self.key(idx);
        let epoch = self.epoch();
        let mut written = 0;
        for _ in 0..ROW_ROUNDS {
            let ex = self.chunks(g, idx, slab)?;
            let live = in_sync(&ex);
            let mut state: Vec<(usize, Version, Option<Version>)> = Vec::new();
            for &c in &live {
                let op = ExtentOp::Priors {
                    key,
                    epoch,
                    offset: row * BS,
                    count: 1,
                };
                let p = self
                    .ask(ex[c], op, ExtentReply::into_priors)
                    .await
                    .map_err(|e| self.replica_failed(idx, ex[c], e))?;
                state.push((c, p[0].0, p[0].1));
            }
            let newest = state.iter().map(|s| s.1).max().unwrap_or(Version(0));
            if state.iter().all(|s| s.1 == newest) {
                return Ok(written);
            }
            let at_newest: Vec<&(usize, Version, Option<Version>)> =
                state.iter().filter(|s| s.1 == newest).collect();
            if at_newest.len() >= k {
                if let Some(n) = self.complete_row(g, idx, &ex, &live, row, newest).await? {
                    log::warn!(
                        "volume {}: slab {idx} row {row}: completed at version {newest} on {n} chunks",
                        self.cfg.name
                    );
                    written += n;
                    continue;
                }
            }
            if at_newest.iter().all(|s| s.2.is_some()) {
                for s in &at_newest {
                    let op = ExtentOp::Revert {
                        key,
                        epoch,
                        version: newest,
                        offset: row * BS,
                        len: BS as u32,
                    };
                    self.ask(ex[s.0], op, ExtentReply::into_written)
                        .await
                        .map_err(|e| self.replica_failed(idx, ex[s.0], e))?;
                }
                log::warn!(
                    "volume {}: slab {idx} row {row}: version {newest} reached only {} of {} in-sync chunks; reverted to the priors",
                    self.cfg.name,
                    at_newest.len(),
                    live.len()
                );
                written += at_newest.len() as u64;
                continue;
            }
            log::warn!(
                "volume {}: slab {idx} row {row}: the slab's initial zero (version {newest}) reached {} of {} chunks; zeroing the row on all",
                self.cfg.name,
                at_newest.len(),
                live.len()
            );
            for &c in &live {
                let op = ExtentOp::Zero {
                    key,
                    epoch,
                    version: newest,
                    offset: row * BS,
                    len: BS,
                };
                self.ask(ex[c], op, ExtentReply::into_ok)
                    .await
                    .map_err(|e| self.replica_failed(idx, ex[c], e))?;
            }
            written += live.len() as u64;
        }
        Err(self.copy_error(
            idx,
            format!("row {row} did not come to agree in {ROW_ROUNDS} rounds"),
        ))
    }

    /// Writes `row` at `version` on every in-sync chunk that lacks it intact, decoded
    /// from K chunks that have it; `None` if fewer than K have it intact.
    async fn complete_row(
        &self,
        g: Geometry,
        idx: SlabIndex,
        ex: &[ExtentLoc],
        live: &[usize],
        row: u64,
        version: Version,
    ) -> Result<Option<u64>, VolumeError> {
        let mut got: Vec<Option<BlocksReply>> = vec![None; ex.len()];
        let mut errors = Vec::new();
        self.read_blocks_into(idx, ex, live, row, 1, &mut got, &mut errors)
            .await
            .map_err(|r| self.retry_failed(idx, r))?;
        if !errors.is_empty() {
            return Err(self.copy_error(idx, errors.join("; ")));
        }
        let intact = |c: usize| {
            got[c]
                .as_ref()
                .is_some_and(|r| r.versions[0] == version && r.bad_blocks.is_empty())
        };
        if live.iter().filter(|&&c| intact(c)).count() < usize::from(g.k()) {
            return Ok(None);
        }
        let decoded = self
            .decode_rows(g, &got, &[version], &|_, c| live.contains(&c))
            .map_err(|why| self.copy_error(idx, why))?;
        let mut n = 0;
        for &c in live {
            if intact(c) {
                continue;
            }
            let data = Bytes::copy_from_slice(&decoded[c].as_ref().expect("wanted")[..BSZ]);
            let seen = got[c].as_ref().expect("read").versions[0];
            let op = ExtentOp::WriteBlocks {
                key: self.key(idx),
                epoch: self.epoch(),
                offset: row * BS,
                crcs: block_crcs(&data),
                versions: vec![version],
                expect: vec![seen],
                data,
                codec: converge_types::Compression::None,
            };
            n += u64::from(
                self.ask(ex[c], op, ExtentReply::into_written)
                    .await
                    .map_err(|e| self.replica_failed(idx, ex[c], e))?,
            );
        }
        Ok(Some(n))
    }

    /// Fills the `syncing` chunk on `drive` (resync of a stale one, or a rebuild's new
    /// one) while writes go on: rows whose version there differs from the in-sync
    /// chunks' are reconstructed from K of them, under the rows' lock, and written with a
    /// compare-and-set on the version seen (a write that reached the chunk meanwhile is
    /// kept).
    pub(crate) async fn parity_fill(
        &self,
        g: Geometry,
        idx: SlabIndex,
        slab: &Slab,
        drive: DriveId,
        throttle: &Throttle,
        progress: &Progress,
    ) -> Result<CopyReport, VolumeError> {
        let k = usize::from(g.k());
        let key = self.key(idx);
        let epoch = self.epoch();
        let ex = self.chunks(g, idx, slab)?;
        let tc = self.chunk_on(idx, &ex, drive)?;
        let target = ex[tc];
        // With snapshots: the chunk drops what it kept of them (a stale chunk's may be
        // wrong) and holds the later ones only; reads of the older decode from chunks that
        // hold them (docs/SNAPSHOTS.md, "Parity volumes").
        self.join_snapshots(idx, slab, target).await?;
        let sources: Vec<usize> = in_sync(&ex).into_iter().filter(|&c| c != tc).collect();
        if sources.len() < k {
            return Err(self.copy_error(
                idx,
                format!(
                    "only {} other chunks are in sync, {k} needed to rebuild chunk {tc}",
                    sources.len()
                ),
            ));
        }
        let versions = |at: ExtentLoc, start: u64, n: u64| {
            let op = ExtentOp::Versions {
                key,
                epoch,
                offset: start * BS,
                count: n as u32,
            };
            async move {
                self.ask(at, op, ExtentReply::into_versions)
                    .await
                    .map_err(|e| self.replica_failed(idx, at, e))
            }
        };
        let rows = g.rows();
        let mut report = CopyReport {
            blocks_compared: rows,
            ..CopyReport::default()
        };
        let mut start = 0;
        while start < rows {
            let n = VERSIONS_CHUNK.min(rows - start);
            let tv = versions(target, start, n).await?;
            let mut sv = Vec::with_capacity(sources.len());
            for &c in &sources {
                sv.push(versions(ex[c], start, n).await?);
            }
            // Rows to look at under their lock: the sources disagree (a write in flight,
            // which reaches this chunk too, or a row to reconstruct), or the chunk lags.
            let look: Vec<u64> = (0..n as usize)
                .filter(|&i| {
                    sv.iter().any(|v| v[i] != sv[0][i]) || needs_copy(sv[0][i], tv[i], epoch)
                })
                .map(|i| start + i as u64)
                .collect();
            progress.blocks_compared.fetch_add(n, Ordering::Relaxed);
            let mut i = 0;
            while i < look.len() {
                let mut j = i + 1;
                while j < look.len()
                    && look[j] == look[j - 1] + 1
                    && look[j] - look[i] < FILL_RUN_ROWS
                {
                    j += 1;
                }
                let (a, b) = (look[i], look[j - 1] + 1);
                throttle.take((b - a) * BS).await;
                let (differing, written) = self.fill_rows(g, idx, slab, tc, a, b - a).await?;
                report.blocks_differing += differing;
                report.blocks_written += written;
                progress
                    .blocks_written
                    .fetch_add(written, Ordering::Relaxed);
                progress
                    .bytes_done
                    .fetch_add(differing * BS, Ordering::Relaxed);
                i = j;
            }
            start += n;
        }
        let still = in_sync(&self.chunks(g, idx, slab)?)
            .into_iter()
            .filter(|&c| c != tc)
            .count();
        if still < k {
            return Err(self.copy_error(
                idx,
                format!("chunks went stale during the fill: {still} in sync, {k} needed"),
            ));
        }
        Ok(report)
    }

    /// Reconstructs rows `[r0, r0 + n)` of chunk `tc` where it lags, under the rows' lock;
    /// returns (rows that differed, blocks written).
    async fn fill_rows(
        &self,
        g: Geometry,
        idx: SlabIndex,
        slab: &Slab,
        tc: usize,
        r0: u64,
        n: u64,
    ) -> Result<(u64, u64), VolumeError> {
        let k = usize::from(g.k());
        let key = self.key(idx);
        let epoch = self.epoch();
        let _rows = slab.rows.lock(r0, r0 + n).await;
        let ex = self.chunks(g, idx, slab)?;
        let target = ex[tc];
        let op = ExtentOp::Versions {
            key,
            epoch,
            offset: r0 * BS,
            count: n as u32,
        };
        let tv = self
            .ask(target, op, ExtentReply::into_versions)
            .await
            .map_err(|e| self.replica_failed(idx, target, e))?;
        let sources: Vec<usize> = in_sync(&ex).into_iter().filter(|&c| c != tc).collect();
        let mut got: Vec<Option<BlocksReply>> = vec![None; ex.len()];
        let mut errors = Vec::new();
        // K sources first (data chunks first: no decode when the target is parity and
        // they are intact); the others only if those fall short.
        let (first, rest) = sources.split_at(k.min(sources.len()));
        self.read_blocks_into(idx, &ex, first, r0, n, &mut got, &mut errors)
            .await
            .map_err(|r| self.retry_failed(idx, r))?;
        let short = |got: &[Option<BlocksReply>]| {
            first
                .iter()
                .any(|&c| got[c].as_ref().is_none_or(|r| !r.bad_blocks.is_empty()))
        };
        if short(&got) {
            self.read_blocks_into(idx, &ex, rest, r0, n, &mut got, &mut errors)
                .await
                .map_err(|r| self.retry_failed(idx, r))?;
        }
        // Each row's version: the highest that K sources hold intact.
        let mut row_versions = Vec::with_capacity(n as usize);
        for i in 0..n as usize {
            let v = row_version(&got, i, k).ok_or_else(|| {
                self.copy_error(
                    idx,
                    format!(
                        "row {}: fewer than {k} chunks hold it intact at one version{}",
                        r0 + i as u64,
                        if errors.is_empty() {
                            String::new()
                        } else {
                            format!(" ({})", errors.join("; "))
                        }
                    ),
                )
            })?;
            row_versions.push(v);
        }
        let lags = |i: usize| needs_copy(row_versions[i], tv[i], epoch);
        let differing = (0..n as usize).filter(|&i| lags(i)).count() as u64;
        if differing == 0 {
            return Ok((0, 0));
        }
        let decoded = self
            .decode_rows(g, &got, &row_versions, &|i, c| c == tc && lags(i))
            .map_err(|why| self.copy_error(idx, why))?;
        let data = match &decoded[tc] {
            Some(buf) => Bytes::copy_from_slice(buf),
            None => return Ok((differing, 0)),
        };
        // Rows that do not lag get an expected version no block has: not written.
        let expect: Vec<Version> = (0..n as usize)
            .map(|i| if lags(i) { tv[i] } else { Version(u64::MAX) })
            .collect();
        let op = ExtentOp::WriteBlocks {
            key,
            epoch,
            offset: r0 * BS,
            crcs: block_crcs(&data),
            versions: row_versions,
            expect,
            data,
            codec: converge_types::Compression::None,
        };
        let written = self
            .ask(target, op, ExtentReply::into_written)
            .await
            .map_err(|e| self.replica_failed(idx, target, e))?;
        Ok((differing, u64::from(written)))
    }

    /// One scrub step of a parity slab: rows `[start, start + n)` read from every in-sync
    /// chunk, with the rows' writes, and changes of the slab's chunks, held back. A row's
    /// chunks must agree on its version, hold it intact, and its parity must match its data
    /// (all K+M present). With `repair`, bad blocks are decoded from the others and
    /// rewritten, and parity that does not match intact data is recomputed from it.
    pub(crate) async fn parity_scrub_step(
        &self,
        g: Geometry,
        idx: SlabIndex,
        slab: &Slab,
        start: u64,
        n: u64,
        repair: bool,
    ) -> Result<ScrubReport, VolumeError> {
        let k = usize::from(g.k());
        let key = self.key(idx);
        let epoch = self.epoch();
        // The gate (shared, as writes hold it) keeps the slab from being released, or its
        // chunks replaced, while the step reads them: a TRIM freeing the chunks under the
        // reads made them look like in-sync chunks that disagree.
        let _gate = slab.gate.read().await;
        let _rows = slab.rows.lock(start, start + n).await;
        if slab.is_released() {
            return Ok(ScrubReport::default());
        }
        let ex = self.chunks(g, idx, slab)?;
        let live = in_sync(&ex);
        let mut got: Vec<Option<BlocksReply>> = vec![None; ex.len()];
        let mut errors = Vec::new();
        self.read_blocks_into(idx, &ex, &live, start, n, &mut got, &mut errors)
            .await
            .map_err(|r| self.retry_failed(idx, r))?;
        for e in &errors {
            log::warn!("scrub: volume {} slab {idx}: {e}", self.cfg.name);
        }
        let mut rep = ScrubReport {
            blocks_checked: n,
            bytes_read: got.iter().flatten().count() as u64 * n * BS,
            ..ScrubReport::default()
        };
        let all_present = got.iter().all(Option::is_some);
        let mut fix: Vec<(usize, usize, Version)> = Vec::new(); // (row, chunk, seen version)
        let mut row_versions = Vec::with_capacity(n as usize);
        for i in 0..n as usize {
            let v = got
                .iter()
                .flatten()
                .find(|r| !r.bad_blocks.contains(&(i as u32)))
                .map_or(Version(0), |r| r.versions[i]);
            let mut bad = false;
            let mut agree = true;
            for (c, r) in got.iter().enumerate() {
                let Some(r) = r else { continue };
                if r.bad_blocks.contains(&(i as u32)) {
                    bad = true;
                    fix.push((i, c, r.versions[i]));
                } else if r.versions[i] != v {
                    agree = false;
                }
            }
            rep.bad_checksums += u64::from(bad);
            let mut mismatch = !agree;
            if agree && !bad && all_present {
                let shards: Vec<&[u8]> = got
                    .iter()
                    .map(|r| &r.as_ref().expect("present").data[i * BSZ..(i + 1) * BSZ])
                    .collect();
                let ok = self
                    .with_codec(g, |codec| codec.verify(&shards))
                    .map_err(|e| self.copy_error(idx, format!("parity codec: {e}")))?;
                if !ok {
                    mismatch = true;
                    // Intact data, wrong parity: the parity chunks are recomputed.
                    for (c, r) in got.iter().enumerate().skip(k) {
                        fix.push((i, c, r.as_ref().expect("present").versions[i]));
                    }
                } else {
                    // A row that verifies, with chunks their recovery marked suspect (rolled
                    // back by a power loss): rewritten as they are, from the others, which
                    // clears the marks — when the others are enough to decode them.
                    let suspect: Vec<usize> = got
                        .iter()
                        .enumerate()
                        .filter(|(_, r)| {
                            r.as_ref().is_some_and(|r| r.suspect.contains(&(i as u32)))
                        })
                        .map(|(c, _)| c)
                        .collect();
                    if !suspect.is_empty() && suspect.len() <= got.len() - k {
                        for c in suspect {
                            fix.push((i, c, got[c].as_ref().expect("present").versions[i]));
                        }
                    }
                }
            }
            rep.mismatches += u64::from(mismatch);
            if mismatch && !agree {
                log::error!(
                    "scrub: volume {} slab {idx} row {}: in-sync chunks disagree on the version",
                    self.cfg.name,
                    start + i as u64
                );
            }
            row_versions.push(v);
        }
        if !repair || fix.is_empty() {
            return Ok(rep);
        }
        let wanted = |i: usize, c: usize| fix.iter().any(|f| f.0 == i && f.1 == c);
        // Parity blocks to recompute read as intact: leave them out of the decode's input.
        let input = without(&got, fix.iter().map(|&(i, c, _)| (i, c)));
        let decoded = match self.decode_rows(g, &input, &row_versions, &wanted) {
            Ok(d) => d,
            Err(why) => {
                log::error!(
                    "scrub: volume {} slab {idx}: cannot repair: {why}",
                    self.cfg.name
                );
                return Ok(rep);
            }
        };
        for (i, c, seen) in fix {
            let Some(buf) = decoded[c].as_ref() else {
                continue;
            };
            let data = Bytes::copy_from_slice(&buf[i * BSZ..(i + 1) * BSZ]);
            let op = ExtentOp::WriteBlocks {
                key,
                epoch,
                offset: (start + i as u64) * BS,
                crcs: block_crcs(&data),
                versions: vec![row_versions[i]],
                expect: vec![seen],
                data,
                codec: converge_types::Compression::None,
            };
            match self.ask(ex[c], op, ExtentReply::into_written).await {
                Ok(w) => rep.repaired += u64::from(w),
                Err(ReplicaError::StaleEpoch(why)) => return Err(self.fenced(why)),
                Err(e) => log::error!(
                    "scrub: volume {} slab {idx}: could not rewrite row {} on chunk {c}: {e}",
                    self.cfg.name,
                    start + i as u64
                ),
            }
        }
        Ok(rep)
    }
}

/// `got` with block `i` of chunk `c` counted bad for each `(i, c)` of `blocks`: what a
/// decode must not take as input (blocks it is asked to recompute).
pub(crate) fn without(
    got: &[Option<BlocksReply>],
    blocks: impl Iterator<Item = (usize, usize)>,
) -> Vec<Option<BlocksReply>> {
    let mut input = got.to_vec();
    for (i, c) in blocks {
        if let Some(r) = input[c].as_mut() {
            if !r.bad_blocks.contains(&(i as u32)) {
                r.bad_blocks.push(i as u32);
            }
        }
    }
    input
}
