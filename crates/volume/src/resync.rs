//! Bringing copies back in sync: delta resync of a returning stale copy, rebuild of a
//! replacement copy, and the reconcile a new owner runs before it serves a volume.
//!
//! All three copy blocks with per-block versions: the copier reads the versions of source
//! and target, copies only the blocks that differ, and writes each block with a
//! compare-and-set on the target's version (see `Drive::write_blocks`), so a concurrent
//! owner write — which always reaches `syncing` copies too — is never overwritten by older
//! data. The rules are written down in docs/CONSISTENCY.md.

use crate::{
    block_crcs, ExtentLoc, ExtentOp, ExtentReply, ReplicaError, ReplicaIo, SlabAllocator,
    SlabChange, Volume,
};
use crate::{Slab, VolumeError, BS};
use converge_types::{DriveId, Epoch, ExtentState, SlabIndex, Version};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

/// Blocks whose versions are fetched per request.
pub(crate) const VERSIONS_CHUNK: u64 = 8192;
/// Largest copy request, in blocks (256 KiB).
const COPY_RUN_BLOCKS: u64 = 64;

/// Progress of one copy job, shared with whoever reports it.
#[derive(Debug, Default)]
pub struct Progress {
    /// Blocks whose versions were compared.
    pub blocks_compared: AtomicU64,
    /// Bytes found to differ (what the job will copy), known after the compare pass.
    pub bytes_total: AtomicU64,
    /// Bytes copied so far.
    pub bytes_done: AtomicU64,
    /// Blocks actually written on the target (a block changed meanwhile is not).
    pub blocks_written: AtomicU64,
}

/// A byte-rate limit shared by the copies of one node.
#[derive(Debug)]
pub struct Throttle {
    bytes_per_s: u64,
    next: Mutex<Instant>,
}

impl Throttle {
    pub fn new(bytes_per_s: u64) -> Throttle {
        Throttle {
            bytes_per_s: bytes_per_s.max(1),
            next: Mutex::new(Instant::now()),
        }
    }

    /// Waits until `bytes` more may be moved.
    pub async fn take(&self, bytes: u64) {
        let wait = {
            let mut next = self.next.lock().expect("throttle lock poisoned");
            let now = Instant::now();
            let start = (*next).max(now);
            *next = start + Duration::from_secs_f64(bytes as f64 / self.bytes_per_s as f64);
            start.saturating_duration_since(now)
        };
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }
}

/// What a finished copy did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CopyReport {
    pub blocks_compared: u64,
    pub blocks_differing: u64,
    pub blocks_written: u64,
}

/// Does the target's block need the source's? Newer on the source: yes. Newer on the
/// target: only if it was written in an older owner's term (an unacked write that reached
/// only some copies before a crash); a newer block of the current term is a write in flight
/// that the source is about to receive too.
pub(crate) fn needs_copy(src: Version, dst: Version, epoch: Epoch) -> bool {
    src > dst || (dst > src && (dst.0 >> 32) < epoch.0)
}

/// A block to copy and the target version seen when it was chosen.
#[derive(Clone, Copy)]
struct Diff {
    block: u64,
    expect: Version,
}

/// The slab's abandoned `syncing` copies (see `Slab::abandoned`).
fn abandoned(slab: &Slab) -> std::sync::MutexGuard<'_, std::collections::BTreeSet<DriveId>> {
    slab.abandoned
        .lock()
        .expect("abandoned-copies lock poisoned")
}

impl<R: ReplicaIo, A: SlabAllocator> Volume<R, A> {
    /// Reconciles slabs where a write failed on every in-sync copy (see `settle`), once
    /// their copies answer. Writes to the slab wait meanwhile. First, re-reads the record
    /// of every slab whose last change got no answer from the control plane (it may have
    /// been applied: a copy etcd has as stale must not stay in sync here, unresynced).
    pub async fn reconcile_suspect(&self) -> Result<u64, VolumeError> {
        let mut n = 0;
        let slabs: Vec<SlabIndex> = self.slab_map().keys().copied().collect();
        for idx in slabs {
            // Released (trimmed whole) since the listing: nothing to reconcile.
            let Some(slab) = self.slab(idx) else {
                continue;
            };
            if slab.unsure.swap(false, Ordering::AcqRel) {
                if let Err(e) = self.reload_record(idx, &slab).await {
                    slab.note_failed_change(&e);
                    return Err(e);
                }
            }
            if !slab.suspect.load(Ordering::Acquire) {
                continue;
            }
            let _g = slab.gate.write().await;
            if slab.is_released() {
                continue;
            }
            let r = self.reconcile_slab(idx, &slab).await?;
            slab.suspect.store(false, Ordering::Release);
            n += r.blocks_written;
        }
        Ok(n)
    }

    /// Reconciles one slab if it is suspect (as `reconcile_suspect` does, for a parity
    /// write that must not hold a row over a failed one); returns the blocks written.
    pub(crate) async fn reconcile_if_suspect(
        &self,
        idx: SlabIndex,
        slab: &Slab,
    ) -> Result<u64, VolumeError> {
        let _g = slab.gate.write().await;
        if slab.is_released() || !slab.suspect.load(Ordering::Acquire) {
            return Ok(0);
        }
        let r = self.reconcile_slab(idx, slab).await?;
        slab.suspect.store(false, Ordering::Release);
        Ok(r.blocks_written)
    }

    /// Adopts the slab's record as the control plane holds it. A copy that is `syncing`
    /// there but was not here had its copy job end before it learnt the outcome: it is
    /// abandoned (resync takes it up).
    async fn reload_record(&self, idx: SlabIndex, slab: &Slab) -> Result<(), VolumeError> {
        let _c = slab.change.lock().await;
        let Some(record) = self.alloc.lookup(self.cfg.id, idx, self.epoch()).await? else {
            return Ok(());
        };
        let before = slab.extents();
        for e in &record {
            if e.state == ExtentState::Syncing
                && !before
                    .iter()
                    .any(|b| b.drive == e.drive && b.state == ExtentState::Syncing)
            {
                abandoned(slab).insert(e.drive);
            }
        }
        if record.as_slice() != &before[..] {
            log::warn!(
                "volume {}: slab {idx}: adopted the control plane's record after a change with no answer: {record:?}",
                self.cfg.name
            );
        }
        slab.set_extents(record);
        Ok(())
    }

    /// Copies that missed writes, per slab: the resync candidates. Besides the stale ones,
    /// copies a failed copy job left `syncing` (it could not reach the control plane to
    /// mark them stale): nothing else would ever fill them.
    pub fn stale_extents(&self) -> Vec<(SlabIndex, ExtentLoc)> {
        let slabs: Vec<(SlabIndex, std::sync::Arc<Slab>)> = self
            .slabs
            .read()
            .expect("slab map lock poisoned")
            .iter()
            .map(|(i, s)| (*i, s.clone()))
            .collect();
        slabs
            .into_iter()
            .flat_map(|(i, slab)| {
                let abandoned = abandoned(&slab).clone();
                slab.extents()
                    .iter()
                    .filter(|e| {
                        e.state == ExtentState::Stale
                            || (e.state == ExtentState::Syncing && abandoned.contains(&e.drive))
                    })
                    .map(|e| (i, *e))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Marks the copy on `drive` stale because its node or drive is known to be down
    /// (failure detection outside the I/O path: a lease expired). Nothing to do if it is
    /// stale already.
    pub async fn copy_failed(&self, idx: SlabIndex, drive: DriveId) -> Result<(), VolumeError> {
        let slab = self.slab_or_err(idx)?;
        if slab.is_released() {
            return Ok(());
        }
        self.mark_stale(idx, &slab, drive).await
    }

    /// Serves the mirror slab `idx` again from its stale copy on `drive` (the repair
    /// policy's `Step::Promote`: every in-sync copy is away), if the control plane's record
    /// says that copy holds every acked write (docs/adr/0014); whether it did.
    pub async fn promote(&self, idx: SlabIndex, drive: DriveId) -> Result<bool, VolumeError> {
        let slab = self.slab_or_err(idx)?;
        let _g = slab.gate.write().await;
        if slab.is_released() {
            return Ok(false);
        }
        let Some(c) = slab.extents().iter().find(|e| e.drive == drive).copied() else {
            return Ok(false);
        };
        Ok(self.promote_holder(idx, &slab, &[c]).await?.is_some())
    }

    /// Makes the first of `candidates` (stale copies that answer) that the record marks as
    /// holding every acked write the slab's in-sync copy, and its in-sync copies (all
    /// away) stale: one fenced change, refused by the control plane for an unmarked copy.
    /// Not for parity slabs, nor while the volume has snapshots (a stale copy takes no
    /// snapshot floor). The caller holds the slab's write gate. Returns the copy promoted.
    pub(crate) async fn promote_holder(
        &self,
        idx: SlabIndex,
        slab: &Slab,
        candidates: &[ExtentLoc],
    ) -> Result<Option<ExtentLoc>, VolumeError> {
        if self.geometry_of(idx).is_some() || !self.snapshots().is_empty() {
            return Ok(None);
        }
        let _c = slab.change.lock().await;
        for c in candidates.iter().filter(|e| e.state != ExtentState::InSync) {
            self.apply_change(idx, slab, SlabChange::Promote { drive: c.drive })
                .await?;
            if slab
                .extents()
                .iter()
                .any(|e| e.drive == c.drive && e.state == ExtentState::InSync)
            {
                log::warn!(
                    "volume {}: slab {idx}: no in-sync copy answers; the stale copy on node {} drive {} holds every acked write and is in sync now (the others are stale)",
                    self.cfg.name,
                    c.node,
                    c.drive
                );
                self.counters
                    .copies_promoted
                    .fetch_add(1, Ordering::Relaxed);
                return Ok(Some(*c));
            }
        }
        Ok(None)
    }

    /// The slab's copy on `drive`, which a copy job fills.
    pub(crate) fn copy_on(
        &self,
        idx: SlabIndex,
        slab: &Slab,
        drive: DriveId,
    ) -> Result<ExtentLoc, VolumeError> {
        slab.extents()
            .iter()
            .find(|e| e.drive == drive)
            .copied()
            .ok_or_else(|| self.copy_error(idx, format!("drive {drive} holds no copy")))
    }

    /// The best copy to copy from: in-sync, this node's first.
    pub(crate) fn source(&self, slab: &Slab, not: DriveId) -> Option<ExtentLoc> {
        let ex = slab.extents();
        let mut v: Vec<ExtentLoc> = ex
            .iter()
            .filter(|e| e.state == ExtentState::InSync && e.drive != not)
            .copied()
            .collect();
        v.sort_by_key(|e| e.node != self.cfg.local_node);
        v.first().copied()
    }

    fn slab_or_err(&self, idx: SlabIndex) -> Result<std::sync::Arc<Slab>, VolumeError> {
        self.slab(idx).ok_or_else(|| VolumeError::Unreadable {
            volume: self.cfg.name.clone(),
            slab: idx,
            why: "slab is not allocated".into(),
        })
    }

    /// Delta resync of the stale copy on `drive`: it becomes `syncing` (receives new
    /// writes), only the blocks that differ from an in-sync copy are copied, and it becomes
    /// `in-sync`. On failure it is left (or marked) stale, or, if the control plane cannot
    /// be reached to say so, left `syncing` and abandoned; running it again is safe, and
    /// takes an abandoned copy up again.
    pub async fn resync(
        &self,
        idx: SlabIndex,
        drive: DriveId,
        throttle: &Throttle,
        progress: &Progress,
    ) -> Result<CopyReport, VolumeError> {
        let slab = self.slab_or_err(idx)?;
        {
            // No write with a snapshot that skips this copy may be in flight once it is
            // `syncing`: such a write would be missed by both the copy and the writer.
            let _g = slab.gate.write().await;
            self.check_not_released(idx, &slab)?;
            // An abandoned copy is `syncing` already (every write reaches it); this job
            // takes it over.
            let resume = abandoned(&slab).remove(&drive);
            let from: &[ExtentState] = if resume {
                &[ExtentState::Stale, ExtentState::Syncing]
            } else {
                &[ExtentState::Stale]
            };
            if let Err(e) = self
                .change_state(idx, &slab, drive, from, ExtentState::Syncing)
                .await
            {
                if resume {
                    abandoned(&slab).insert(drive);
                }
                return Err(e);
            }
        }
        self.fill_and_promote(idx, &slab, drive, throttle, progress)
            .await
    }

    /// Rebuild: replaces the copy on `old` by a new one at `new` (another node's drive),
    /// fills it from an in-sync copy while writes continue, then makes it `in-sync`. The
    /// caller frees the old extent afterwards.
    pub async fn rebuild(
        &self,
        idx: SlabIndex,
        old: DriveId,
        new: ExtentLoc,
        throttle: &Throttle,
        progress: &Progress,
    ) -> Result<CopyReport, VolumeError> {
        let slab = self.slab_or_err(idx)?;
        {
            let _g = slab.gate.write().await;
            let _c = slab.change.lock().await;
            self.check_not_released(idx, &slab)?;
            if self.geometry_of(idx).is_some()
                && slab
                    .extents()
                    .iter()
                    .any(|e| e.node == new.node && e.drive != old)
            {
                // Each chunk of a parity slab on its own node (the chunk replaced aside).
                return Err(self.copy_error(
                    idx,
                    format!("node {} already holds a chunk of the slab", new.node),
                ));
            }
            let new = ExtentLoc {
                state: ExtentState::Syncing,
                ..new
            };
            self.apply_change(idx, &slab, SlabChange::Replace { old, new })
                .await?;
        }
        self.fill_and_promote(idx, &slab, new.drive, throttle, progress)
            .await
    }

    /// Evacuation, copy before drop: adds a new copy at `new` (a drive of a node that holds
    /// no copy of the slab) beside the in-sync copy on `leaving`, fills it while writes
    /// reach both, makes it `in-sync`, then drops the copy on `leaving` from the slab's
    /// record ([`Volume::drop_copy`]). The caller frees that extent afterwards. The slab
    /// never has fewer in-sync copies than before. If the fill fails, `leaving` keeps its
    /// copy and the new one is left stale (resync takes it up, and then it is `leaving`'s
    /// that goes).
    pub async fn evacuate(
        &self,
        idx: SlabIndex,
        leaving: DriveId,
        new: ExtentLoc,
        throttle: &Throttle,
        progress: &Progress,
    ) -> Result<CopyReport, VolumeError> {
        let slab = self.slab_or_err(idx)?;
        if self.geometry_of(idx).is_some() {
            // A parity slab's chunks are ordered (the record's order is the row layout):
            // a chunk beside the others has no place in it. The leaving chunk is replaced
            // in its place and rebuilt from the others, only when every chunk is in sync
            // (the slab is one failure short of full redundancy while it is rebuilt, as
            // with a failed drive; the leaving chunk stays on its drive until the caller
            // frees it).
            if let Some(e) = slab
                .extents()
                .iter()
                .find(|e| e.state != ExtentState::InSync)
            {
                return Err(self.copy_error(
                    idx,
                    format!(
                        "the chunk on drive {} is not in sync: repair comes first",
                        e.drive
                    ),
                ));
            }
            return self.rebuild(idx, leaving, new, throttle, progress).await;
        }
        let new = ExtentLoc {
            state: ExtentState::Syncing,
            ..new
        };
        {
            let _g = slab.gate.write().await;
            let _c = slab.change.lock().await;
            self.check_not_released(idx, &slab)?;
            if !slab
                .extents()
                .iter()
                .any(|e| e.drive == leaving && e.state == ExtentState::InSync)
            {
                return Err(self.copy_error(
                    idx,
                    format!("the copy on drive {leaving} is not in sync: repair comes first"),
                ));
            }
            self.apply_change(idx, &slab, SlabChange::Add { new })
                .await?;
            if !slab.extents().contains(&new) {
                return Err(self.copy_error(idx, format!("node {} holds a copy already", new.node)));
            }
        }
        let report = self
            .fill_and_promote(idx, &slab, new.drive, throttle, progress)
            .await?;
        self.drop_copy(idx, leaving).await?;
        Ok(report)
    }

    /// Drops the copy on `drive` from the slab's record, if the slab keeps its full count
    /// of in-sync copies without it (refused otherwise). No write is in flight meanwhile,
    /// and later ones no longer reach it. The caller frees the extent afterwards.
    pub async fn drop_copy(&self, idx: SlabIndex, drive: DriveId) -> Result<(), VolumeError> {
        let slab = self.slab_or_err(idx)?;
        let keep = self.cfg.resiliency.of_slab(idx).copies();
        let _g = slab.gate.write().await;
        let _c = slab.change.lock().await;
        self.check_not_released(idx, &slab)?;
        self.apply_change(idx, &slab, SlabChange::Remove { drive, keep })
            .await?;
        if slab.extents().iter().any(|e| e.drive == drive) {
            return Err(self.copy_error(
                idx,
                format!(
                    "the copy on drive {drive} stays: without it fewer than {keep} copies are in sync"
                ),
            ));
        }
        Ok(())
    }

    async fn fill_and_promote(
        &self,
        idx: SlabIndex,
        slab: &Slab,
        drive: DriveId,
        throttle: &Throttle,
        progress: &Progress,
    ) -> Result<CopyReport, VolumeError> {
        // Held from the snapshots' copy through the promotion: the copy holds what the
        // volume's snapshots are when it joins.
        let mut _history = None;
        let r = match self.fill(idx, slab, drive, throttle, progress).await {
            Ok(rep) => {
                _history = Some(self.history.lock().await);
                self.fill_snapshots(idx, slab, drive, throttle)
                    .await
                    .map(|()| rep)
            }
            Err(e) => Err(e),
        };
        let report = match r {
            Ok(rep) => rep,
            Err(e) => {
                if let Err(e2) = self
                    .change_state(
                        idx,
                        slab,
                        drive,
                        &[ExtentState::Syncing],
                        ExtentState::Stale,
                    )
                    .await
                {
                    log::warn!(
                        "volume {}: slab {idx}: the copy on drive {drive} stays syncing with no job filling it, until resync takes it up again: {e2}",
                        self.cfg.name
                    );
                    abandoned(slab).insert(drive);
                }
                return Err(e);
            }
        };
        if let Err(e) = self
            .change_state(
                idx,
                slab,
                drive,
                &[ExtentState::Syncing],
                ExtentState::InSync,
            )
            .await
        {
            abandoned(slab).insert(drive);
            return Err(e);
        }
        let now = slab.extents();
        if !now
            .iter()
            .any(|e| e.drive == drive && e.state == ExtentState::InSync)
        {
            return Err(VolumeError::Unreadable {
                volume: self.cfg.name.clone(),
                slab: idx,
                why: format!("the copy on drive {drive} failed during the copy; it stays stale"),
            });
        }
        log::info!(
            "volume {}: slab {idx} copy on drive {drive} is in sync ({} of {} blocks differed, {} written)",
            self.cfg.name,
            report.blocks_differing,
            report.blocks_compared,
            report.blocks_written
        );
        Ok(report)
    }

    /// Compares and copies into the `syncing` copy on `drive`; the source must stay in
    /// sync throughout (checked at the end).
    async fn fill(
        &self,
        idx: SlabIndex,
        slab: &Slab,
        drive: DriveId,
        throttle: &Throttle,
        progress: &Progress,
    ) -> Result<CopyReport, VolumeError> {
        if let Some(g) = self.geometry_of(idx) {
            return self
                .parity_fill(g, idx, slab, drive, throttle, progress)
                .await;
        }
        let key = self.key(idx);
        let epoch = self.epoch();
        let target = self.copy_on(idx, slab, drive)?;
        let src = self
            .source(slab, drive)
            .ok_or_else(|| self.copy_error(idx, "no in-sync copy to copy from".into()))?;
        self.join_snapshots(idx, slab, target).await?;
        let blocks = self.cfg.slab_size_bytes / BS;
        let mut diffs = Vec::new();
        let mut start = 0;
        while start < blocks {
            let n = VERSIONS_CHUNK.min(blocks - start);
            let op = ExtentOp::Versions {
                key,
                epoch,
                offset: start * BS,
                count: n as u32,
            };
            let sv = self
                .ask(src, op.clone(), ExtentReply::into_versions)
                .await
                .map_err(|e| self.replica_failed(idx, src, e))?;
            let tv = self
                .ask(target, op, ExtentReply::into_versions)
                .await
                .map_err(|e| self.replica_failed(idx, target, e))?;
            for (i, (s, t)) in sv.iter().zip(&tv).enumerate() {
                if needs_copy(*s, *t, epoch) {
                    diffs.push(Diff {
                        block: start + i as u64,
                        expect: *t,
                    });
                }
            }
            progress.blocks_compared.fetch_add(n, Ordering::Relaxed);
            start += n;
        }
        progress
            .bytes_total
            .store(diffs.len() as u64 * BS, Ordering::Relaxed);
        let mut report = CopyReport {
            blocks_compared: blocks,
            blocks_differing: diffs.len() as u64,
            blocks_written: 0,
        };
        let mut i = 0;
        while i < diffs.len() {
            // A run of consecutive differing blocks, bounded.
            let mut j = i + 1;
            while j < diffs.len()
                && diffs[j].block == diffs[j - 1].block + 1
                && (j - i) < COPY_RUN_BLOCKS as usize
            {
                j += 1;
            }
            let run = &diffs[i..j];
            let bytes = run.len() as u64 * BS;
            throttle.take(bytes).await;
            let written = self.copy_run(idx, slab, src, target, run).await?;
            report.blocks_written += u64::from(written);
            progress
                .blocks_written
                .fetch_add(u64::from(written), Ordering::Relaxed);
            progress.bytes_done.fetch_add(bytes, Ordering::Relaxed);
            i = j;
        }
        // The source must still be in sync: if it failed meanwhile, what it gave us may
        // lack writes it missed (those reached the target directly, but be safe).
        if !slab
            .extents()
            .iter()
            .any(|e| e.drive == src.drive && e.state == ExtentState::InSync)
        {
            return Err(self.copy_error(idx, format!("source drive {} went stale", src.drive)));
        }
        Ok(report)
    }

    /// Copies one run of blocks from `src` (or, for blocks that fail their checksum there,
    /// from another in-sync copy) into `target`.
    async fn copy_run(
        &self,
        idx: SlabIndex,
        slab: &Slab,
        src: ExtentLoc,
        target: ExtentLoc,
        run: &[Diff],
    ) -> Result<u32, VolumeError> {
        let key = self.key(idx);
        let epoch = self.epoch();
        let off = run[0].block * BS;
        let len = run.len() as u64 * BS;
        let op = ExtentOp::ReadBlocks {
            key,
            epoch,
            offset: off,
            len: len as u32,
        };
        let r = self
            .ask(src, op, ExtentReply::into_blocks)
            .await
            .map_err(|e| self.replica_failed(idx, src, e))?;
        let mut data = bytes::BytesMut::from(&r.data[..]);
        let mut versions = r.versions;
        let mut expect: Vec<Version> = run.iter().map(|d| d.expect).collect();
        // Bad blocks, and suspect ones (rolled back by the source's recovery: maybe older
        // than an acked write), are taken from another in-sync copy that holds them intact.
        let suspect = r.suspect.iter().filter(|b| !r.bad_blocks.contains(b));
        for (&b, is_suspect) in r
            .bad_blocks
            .iter()
            .map(|b| (b, false))
            .chain(suspect.map(|b| (b, true)))
        {
            let boff = off + u64::from(b) * BS;
            let mut fixed = false;
            for other in slab.extents().iter() {
                if other.state != ExtentState::InSync
                    || other.drive == src.drive
                    || other.drive == target.drive
                {
                    continue;
                }
                let op = ExtentOp::ReadBlocks {
                    key,
                    epoch,
                    offset: boff,
                    len: BS as u32,
                };
                if let Ok(g) = self.ask(*other, op, ExtentReply::into_blocks).await {
                    if g.bad_blocks.is_empty() && g.suspect.is_empty() {
                        let at = b as usize * BS as usize;
                        data[at..at + BS as usize].copy_from_slice(&g.data);
                        versions[b as usize] = g.versions[0];
                        fixed = true;
                        break;
                    }
                }
            }
            if !fixed && is_suspect {
                // No copy holds it unsuspected: the source's sound bytes are the newest
                // there are.
                continue;
            }
            if !fixed {
                // No good copy of this block exists (e.g. an unacked write torn on every
                // copy by crashes): leave the target's own block, which reads as its old
                // data or as bad, and carry on rather than block the copy forever. An
                // expected version no block can have makes the compare-and-set skip it.
                log::error!(
                    "volume {}: slab {idx}: block at offset {boff} fails its checksum on every in-sync copy; left as it is on node {}",
                    self.cfg.name,
                    target.node
                );
                expect[b as usize] = Version(u64::MAX);
            }
        }
        let data = data.freeze();
        let op = ExtentOp::WriteBlocks {
            key,
            epoch,
            offset: off,
            crcs: block_crcs(&data),
            versions,
            expect,
            data,
            codec: self.compression(),
        };
        self.ask(target, op, ExtentReply::into_written)
            .await
            .map_err(|e| self.replica_failed(idx, target, e))
    }

    /// Run by a new owner before serving: fences every copy at the new epoch (older owners
    /// are refused from then on) and makes the in-sync copies agree block by block (a
    /// crashed owner's last writes may have reached only some of them). Copies that do
    /// not answer are marked stale; `syncing` copies (an interrupted resync) become stale
    /// and are resynced later. Per slab it compares one digest per copy; only slabs whose
    /// digests differ are compared block by block, and only differing blocks copied.
    pub async fn reconcile(&self) -> Result<CopyReport, VolumeError> {
        let mut total = CopyReport::default();
        let slabs: Vec<SlabIndex> = self.slab_map().keys().copied().collect();
        for idx in slabs {
            let slab = self.slab_or_err(idx)?;
            let r = self.reconcile_slab(idx, &slab).await?;
            total.blocks_compared += r.blocks_compared;
            total.blocks_differing += r.blocks_differing;
            total.blocks_written += r.blocks_written;
        }
        Ok(total)
    }

    pub(crate) async fn reconcile_slab(
        &self,
        idx: SlabIndex,
        slab: &Slab,
    ) -> Result<CopyReport, VolumeError> {
        let differ = self.fence_and_compare(idx, slab).await?;
        if let Some(g) = self.geometry_of(idx) {
            return self.parity_reconcile_slab(g, idx, slab, differ).await;
        }
        if !differ {
            return Ok(CopyReport::default());
        }
        let key = self.key(idx);
        let epoch = self.epoch();
        let blocks = self.cfg.slab_size_bytes / BS;
        let mut report = CopyReport {
            blocks_compared: blocks,
            ..CopyReport::default()
        };
        let mut start = 0;
        while start < blocks {
            let n = VERSIONS_CHUNK.min(blocks - start);
            // Fence and fetch versions from every copy, stale ones included (they must be
            // fenced too); only in-sync copies take part in the comparison.
            let ex = slab.extents();
            let mut copies: Vec<(ExtentLoc, Vec<Version>)> = Vec::new();
            for e in ex.iter() {
                let op = ExtentOp::Versions {
                    key,
                    epoch,
                    offset: start * BS,
                    count: n as u32,
                };
                match self.ask(*e, op, ExtentReply::into_versions).await {
                    Ok(v) if e.state == ExtentState::InSync => copies.push((*e, v)),
                    Ok(_) => {}
                    Err(ReplicaError::StaleEpoch(why)) => return Err(self.fenced(why)),
                    Err(err) => {
                        if e.state == ExtentState::InSync {
                            return Err(self.copy_error(
                                idx,
                                format!(
                                    "copy on node {} drive {} stopped answering: {err}",
                                    e.node, e.drive
                                ),
                            ));
                        }
                    }
                }
            }
            if copies.is_empty() {
                return Err(self.copy_error(idx, "no in-sync copy answered".into()));
            }
            for i in 0..n as usize {
                let (best, bv) = copies
                    .iter()
                    .map(|(e, v)| (*e, v[i]))
                    .max_by_key(|(_, v)| *v)
                    .expect("copies is not empty");
                for (e, v) in &copies {
                    if v[i] == bv {
                        continue;
                    }
                    report.blocks_differing += 1;
                    let d = Diff {
                        block: start + i as u64,
                        expect: v[i],
                    };
                    report.blocks_written +=
                        u64::from(self.copy_run(idx, slab, best, *e, &[d]).await?);
                }
            }
            start += n;
        }
        if report.blocks_differing > 0 {
            log::warn!(
                "volume {}: slab {idx}: takeover made {} diverged blocks agree",
                self.cfg.name,
                report.blocks_differing
            );
        }
        Ok(report)
    }

    /// A takeover's first step for one slab: `syncing` copies become stale, every copy is
    /// fenced at this owner's epoch, in-sync copies that do not answer are marked stale.
    /// Returns whether the in-sync copies' version maps differ (their digests).
    async fn fence_and_compare(&self, idx: SlabIndex, slab: &Slab) -> Result<bool, VolumeError> {
        let key = self.key(idx);
        let epoch = self.epoch();
        for e in slab.extents().iter() {
            if e.state == ExtentState::Syncing {
                self.change_state(
                    idx,
                    slab,
                    e.drive,
                    &[ExtentState::Syncing],
                    ExtentState::Stale,
                )
                .await?;
            }
        }
        // Fence every copy (stale ones too) and compare digests of the version maps: only
        // a slab whose in-sync copies differ (writes in flight at the crash) is compared
        // block by block, so a takeover's work is bounded by what was being written.
        let mut digests = Vec::new();
        let mut unreachable = Vec::new();
        let mut answered_stale = Vec::new();
        for e in slab.extents().iter() {
            match self
                .ask(
                    *e,
                    ExtentOp::Digest { key, epoch },
                    ExtentReply::into_digest,
                )
                .await
            {
                Ok(d) if e.state == ExtentState::InSync => digests.push(d),
                Ok(_) => answered_stale.push(*e),
                Err(ReplicaError::StaleEpoch(why)) => return Err(self.fenced(why)),
                Err(err) => {
                    if e.state == ExtentState::InSync {
                        unreachable.push((*e, err));
                    }
                }
            }
        }
        if digests.is_empty() {
            // A stale copy that holds every acked write serves instead (docs/adr/0014).
            if self
                .promote_holder(idx, slab, &answered_stale)
                .await?
                .is_some()
            {
                return Ok(false);
            }
            // Never mark the last in-sync copies stale: wait for one to answer.
            return Err(self.copy_error(idx, "no in-sync copy answered".into()));
        }
        for (e, err) in unreachable {
            log::warn!(
                "volume {}: slab {idx}: copy on node {} drive {} unreachable at takeover ({err}); marking it stale",
                self.cfg.name, e.node, e.drive
            );
            self.mark_stale(idx, slab, e.drive).await?;
        }
        Ok(!digests.iter().all(|d| *d == digests[0]))
    }
    /// A job that got the slab before a TRIM released it has nothing left to do.
    fn check_not_released(&self, idx: SlabIndex, slab: &Slab) -> Result<(), VolumeError> {
        if slab.is_released() {
            return Err(self.copy_error(idx, "the slab was released (trimmed whole)".into()));
        }
        Ok(())
    }

    pub(crate) fn copy_error(&self, idx: SlabIndex, why: String) -> VolumeError {
        VolumeError::Unreadable {
            volume: self.cfg.name.clone(),
            slab: idx,
            why,
        }
    }

    pub(crate) fn replica_failed(
        &self,
        idx: SlabIndex,
        at: ExtentLoc,
        e: ReplicaError,
    ) -> VolumeError {
        match e {
            ReplicaError::StaleEpoch(why) => return self.fenced(why),
            // The target's drive has no room for the extent (a copy whose first write
            // found it full has none yet): the repair policy places it elsewhere.
            ReplicaError::NoSpace(_) => {
                return VolumeError::NoSpace {
                    volume: self.cfg.name.clone(),
                    why: format!(
                        "slab {idx}: the copy on node {} drive {} has no room: {e}",
                        at.node, at.drive
                    ),
                }
            }
            _ => {}
        }
        self.copy_error(
            idx,
            format!("copy on node {} drive {}: {e}", at.node, at.drive),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_rule() {
        let e = Epoch(5);
        let v = |ep: u64, s: u64| Version(ep << 32 | s);
        assert!(needs_copy(v(5, 3), v(5, 2), e));
        assert!(!needs_copy(v(5, 3), v(5, 3), e));
        // Newer target of this term: a write in flight, leave it.
        assert!(!needs_copy(v(5, 2), v(5, 3), e));
        // Newer target of an older term: an unacked leftover, overwrite it.
        assert!(needs_copy(v(4, 2), v(4, 9), e));
        assert!(needs_copy(Version(0), v(3, 1), e));
    }
}

/// What a scrub found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ScrubReport {
    /// Blocks compared (per slab block, across all its in-sync copies).
    pub blocks_checked: u64,
    /// Bytes read from all copies.
    pub bytes_read: u64,
    /// Blocks whose data failed its checksum on some copy.
    pub bad_checksums: u64,
    /// Blocks whose in-sync copies disagreed (version or bytes).
    pub mismatches: u64,
    /// Blocks rewritten from a good copy.
    pub repaired: u64,
    /// Blocks read at a snapshot (per slab block and snapshot, across the copies holding
    /// it): their bad checksums, mismatches and repairs count in the fields above.
    #[serde(default)]
    pub snapshot_blocks_checked: u64,
    /// Of the bad checksums, blocks of a snapshot that no in-sync copy holding it has
    /// whole: that snapshot's reads of them fail until a copy that holds it comes back.
    #[serde(default)]
    pub snapshot_blocks_lost: u64,
}

impl ScrubReport {
    pub fn add(&mut self, o: &ScrubReport) {
        self.blocks_checked += o.blocks_checked;
        self.bytes_read += o.bytes_read;
        self.bad_checksums += o.bad_checksums;
        self.mismatches += o.mismatches;
        self.repaired += o.repaired;
        self.snapshot_blocks_checked += o.snapshot_blocks_checked;
        self.snapshot_blocks_lost += o.snapshot_blocks_lost;
    }
}

/// Blocks compared per scrub step (the slab's writes wait for one step at most).
pub(crate) const SCRUB_STEP_BLOCKS: u64 = 64;

impl<R: ReplicaIo, A: SlabAllocator> Volume<R, A> {
    /// Reads every block of every in-sync copy of every allocated slab, verifies checksums
    /// and that the copies agree (same version, same bytes), and repairs what does not
    /// (from a copy with a good checksum and the highest version) when `repair` is set.
    /// Each step holds the slab's writes back briefly so copies are compared at rest.
    pub async fn scrub(
        &self,
        repair: bool,
        throttle: &Throttle,
        progress: &Progress,
    ) -> Result<ScrubReport, VolumeError> {
        let mut total = ScrubReport::default();
        let slabs: Vec<SlabIndex> = self.slab_map().keys().copied().collect();
        progress.bytes_total.store(
            slabs.len() as u64 * self.cfg.slab_size_bytes,
            Ordering::Relaxed,
        );
        for idx in slabs {
            let Some(slab) = self.slab(idx) else {
                continue;
            };
            let blocks = self.cfg.slab_size_bytes / BS;
            if self.is_leftover(idx) {
                // A rotation's parity slab beside its span's mirror-part slabs (in progress,
                // or cut before its flip): not the span's truth, and a cut copy may have
                // reached some chunks only. The next rotation pass discards it.
                progress
                    .bytes_done
                    .fetch_add(blocks * BS, Ordering::Relaxed);
                continue;
            }
            let mut start = 0;
            while start < blocks {
                let n = SCRUB_STEP_BLOCKS.min(blocks - start);
                throttle.take(n * BS * slab.in_sync() as u64).await;
                let r = match self.geometry_of(idx) {
                    Some(g) => {
                        self.parity_scrub_step(g, idx, &slab, start, n, repair)
                            .await?
                    }
                    None => self.scrub_step(idx, &slab, start, n, repair).await?,
                };
                total.add(&r);
                progress.bytes_done.fetch_add(n * BS, Ordering::Relaxed);
                progress.blocks_compared.fetch_add(n, Ordering::Relaxed);
                start += n;
            }
            total.add(&self.scrub_snapshots(idx, &slab, repair, throttle).await?);
        }
        self.counters
            .repaired_blocks
            .fetch_add(total.repaired, Ordering::Relaxed);
        Ok(total)
    }

    async fn scrub_step(
        &self,
        idx: SlabIndex,
        slab: &Slab,
        start: u64,
        n: u64,
        repair: bool,
    ) -> Result<ScrubReport, VolumeError> {
        let key = self.key(idx);
        let epoch = self.epoch();
        let _g = slab.gate.write().await;
        if slab.is_released() {
            return Ok(ScrubReport::default());
        }
        let mut rep = ScrubReport {
            blocks_checked: n,
            ..ScrubReport::default()
        };
        let mut copies = Vec::new();
        for e in slab.extents().iter() {
            if e.state != ExtentState::InSync {
                continue;
            }
            let op = ExtentOp::ReadBlocks {
                key,
                epoch,
                offset: start * BS,
                len: (n * BS) as u32,
            };
            match self.ask(*e, op, ExtentReply::into_blocks).await {
                Ok(r) => {
                    rep.bytes_read += n * BS;
                    copies.push((*e, r));
                }
                Err(ReplicaError::StaleEpoch(why)) => return Err(self.fenced(why)),
                Err(err) => log::warn!(
                    "scrub: volume {} slab {idx}: copy on node {} unreadable: {err}",
                    self.cfg.name,
                    e.node
                ),
            }
        }
        let bsz = BS as usize;
        for b in 0..n as usize {
            let good =
                |(_, r): &&(ExtentLoc, crate::BlocksReply)| !r.bad_blocks.contains(&(b as u32));
            let bad_here = copies.iter().filter(|c| !good(c)).count() as u64;
            rep.bad_checksums += u64::from(bad_here > 0);
            // The reference: a good copy with the highest version, preferring copies not
            // suspect (a suspect one was rolled back by its recovery: maybe older than an
            // acked write); among equals, the bytes most copies hold (a majority outvotes
            // one silently different copy). A suspect copy is rewritten even when it
            // agrees, which clears its mark.
            let unsuspected = |r: &crate::BlocksReply| !r.suspect.contains(&(b as u32));
            let same = |x: &crate::BlocksReply| {
                copies
                    .iter()
                    .filter(good)
                    .filter(|(_, r)| {
                        r.versions[b] == x.versions[b]
                            && r.data[b * bsz..(b + 1) * bsz] == x.data[b * bsz..(b + 1) * bsz]
                    })
                    .count()
            };
            let Some((src, sr)) = copies
                .iter()
                .filter(good)
                .max_by_key(|(_, r)| (unsuspected(r), r.versions[b], same(r)))
            else {
                if bad_here > 0 {
                    log::error!(
                        "scrub: volume {} slab {idx} block {}: no copy has a good checksum",
                        self.cfg.name,
                        start + b as u64
                    );
                }
                continue;
            };
            let sdata = &sr.data[b * bsz..(b + 1) * bsz];
            let mut mismatch = false;
            for (e, r) in &copies {
                let agrees = !r.bad_blocks.contains(&(b as u32))
                    && r.versions[b] == sr.versions[b]
                    && &r.data[b * bsz..(b + 1) * bsz] == sdata;
                if agrees && unsuspected(r) {
                    continue;
                }
                // A suspect copy may legitimately be behind: rewritten, not a divergence.
                if !agrees && !r.bad_blocks.contains(&(b as u32)) && unsuspected(r) {
                    mismatch = true;
                }
                if repair {
                    let data = sr.data.slice(b * bsz..(b + 1) * bsz);
                    let op = ExtentOp::WriteBlocks {
                        key,
                        epoch,
                        offset: (start + b as u64) * BS,
                        crcs: block_crcs(&data),
                        versions: vec![sr.versions[b]],
                        expect: vec![r.versions[b]],
                        data,
                        codec: self.compression(),
                    };
                    let w = self
                        .ask(*e, op, ExtentReply::into_written)
                        .await
                        .map_err(|err| self.replica_failed(idx, *e, err))?;
                    rep.repaired += u64::from(w);
                    log::warn!(
                        "scrub: volume {} slab {idx} block {}: repaired the copy on node {} from node {}",
                        self.cfg.name,
                        start + b as u64,
                        e.node,
                        src.node
                    );
                }
            }
            rep.mismatches += u64::from(mismatch);
        }
        Ok(rep)
    }
}
