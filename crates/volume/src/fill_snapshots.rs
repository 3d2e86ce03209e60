//! A fill carries the volume's snapshots into the copy it fills (docs/adr/0012, step 4;
//! docs/SNAPSHOTS.md "Repair"). Before the fill copies live blocks, the copy gets the
//! newest snapshot as its floor (`Joining`: it drops whatever it kept of snapshots before,
//! which may be wrong, and holds none), so writes from then on preserve on it as on the
//! in-sync copies. After the live blocks, with snapshots neither taken nor deleted, each
//! snapshot from the newest down: where the copy reads differently at it than the source,
//! the source's states there are written into the copy's keeping for it; newest first,
//! because what a copy keeps for a snapshot also answers reads of the older ones. The
//! copy then holds the snapshots down to the oldest copied (`Copied`). Each snapshot comes
//! from any in-sync copy that holds it: one that fails mid-copy (unreachable, a refusal)
//! passes it on to the next holder. A snapshot no holder gives whole (none holds it, or a
//! block of it is bad on every copy) ends the descent: the copy holds the newer ones only,
//! and reads of the older go to other copies.

use super::*;
use crate::resync::{Throttle, VERSIONS_CHUNK};
use converge_types::FloorHistory;

/// Largest snapshot copy request, in blocks (256 KiB), as the live fill's.
const RUN_BLOCKS: u64 = 64;

impl<R: ReplicaIo, A: SlabAllocator> Volume<R, A> {
    /// Before a fill of the copy at `target` copies live blocks: if the volume has
    /// snapshots, the copy's floor becomes the newest, holding none (see the module docs).
    pub(crate) async fn join_snapshots(
        &self,
        idx: SlabIndex,
        slab: &Slab,
        target: ExtentLoc,
    ) -> Result<(), VolumeError> {
        if self.snapshots().is_empty() {
            return Ok(());
        }
        let _history = self.history.lock().await;
        // No write in flight: one that started before sees the copy's old floor.
        let _g = slab.gate.write().await;
        let snaps = self.snapshots();
        let Some(&newest) = snaps.last() else {
            return Ok(());
        };
        self.settle_joining(idx, slab, target).await?;
        let op = ExtentOp::SnapshotFloor {
            key: self.key(idx),
            epoch: self.epoch(),
            snapshot: newest,
            previous: snaps.len().checked_sub(2).map(|i| snaps[i]),
            history: FloorHistory::Joining,
        };
        self.ask(target, op, ExtentReply::into_ok)
            .await
            .map_err(|e| self.replica_failed(idx, target, e))
    }

    /// After a fill copied the live blocks into the copy on `drive`: copies the volume's
    /// snapshots into it (see the module docs). The caller holds `history`.
    pub(crate) async fn fill_snapshots(
        &self,
        idx: SlabIndex,
        slab: &Slab,
        drive: DriveId,
        throttle: &Throttle,
    ) -> Result<(), VolumeError> {
        if let Some(g) = self.geometry_of(idx) {
            return self
                .parity_fill_snapshots(g, idx, slab, drive, throttle)
                .await;
        }
        let snaps = self.snapshots();
        let Some(&newest) = snaps.last() else {
            return Ok(());
        };
        let target = self.copy_on(idx, slab, drive)?;
        if target.state != ExtentState::Syncing {
            // It missed writes, and maybe the floor of a snapshot taken since.
            return Err(self.copy_error(
                idx,
                format!(
                    "the copy on drive {drive} went {:?} during the fill",
                    target.state
                ),
            ));
        }
        // Each snapshot from an in-sync copy that holds it, this node's first.
        let mut sources: Vec<ExtentLoc> = slab
            .extents()
            .iter()
            .filter(|e| e.state == ExtentState::InSync && e.drive != drive)
            .copied()
            .collect();
        sources.sort_by_key(|e| e.node != self.cfg.local_node);
        if sources.is_empty() {
            return Err(self.copy_error(idx, "no in-sync copy to copy from".into()));
        }
        let mut oldest = None;
        // Each snapshot from the first holder that gives it whole: a source that cannot (it
        // went away mid-copy, or a block of it is bad on every copy) passes it on to the
        // next holder, so one unreachable copy does not cost the new copy its snapshots.
        for &s in snaps.iter().rev() {
            let mut copied = false;
            for &src in &sources {
                if !self.holds(idx, src, s).await? {
                    continue;
                }
                if self
                    .copy_snapshot(idx, slab, src, target, s, s == newest, throttle)
                    .await?
                {
                    copied = true;
                    break;
                }
            }
            if !copied {
                break;
            }
            oldest = Some(s);
        }
        self.copied_snapshots(idx, target, &snaps, oldest).await
    }

    /// Ends a fill's copy of the snapshots: the copy at `target` holds them from `oldest`
    /// on (None: none; reads of them go to other copies).
    pub(crate) async fn copied_snapshots(
        &self,
        idx: SlabIndex,
        target: ExtentLoc,
        snaps: &[Epoch],
        oldest: Option<Epoch>,
    ) -> Result<(), VolumeError> {
        let drive = target.drive;
        let Some(&newest) = snaps.last() else {
            return Ok(());
        };
        let Some(oldest) = oldest else {
            log::warn!(
                "volume {}: slab {idx}: the copy on drive {drive} holds none of the volume's snapshots (its source gave none); reads of them go to other copies",
                self.cfg.name
            );
            return Ok(());
        };
        if oldest != snaps[0] {
            log::warn!(
                "volume {}: slab {idx}: the copy on drive {drive} holds the snapshots from epoch {oldest} on, not the older ones (its source could not give them)",
                self.cfg.name
            );
        }
        let (key, epoch) = (self.key(idx), self.epoch());
        let op = ExtentOp::SnapshotFloor {
            key,
            epoch,
            snapshot: newest,
            previous: Some(oldest),
            history: FloorHistory::Copied,
        };
        self.ask(target, op, ExtentReply::into_ok)
            .await
            .map_err(|e| self.replica_failed(idx, target, e))
    }

    /// Copies snapshot `s` from `src` into the target: every run of blocks the two read
    /// differently at `s`. `newest`: writes preserve into its keeping, so each run is
    /// compared again and copied with the slab's writes held. Ok(false) when `src` cannot
    /// give it whole (what was copied stays: a retry from another holder skips it).
    #[allow(clippy::too_many_arguments)]
    async fn copy_snapshot(
        &self,
        idx: SlabIndex,
        slab: &Slab,
        src: ExtentLoc,
        target: ExtentLoc,
        s: Epoch,
        newest: bool,
        throttle: &Throttle,
    ) -> Result<bool, VolumeError> {
        let blocks = self.cfg.slab_size_bytes / BS;
        let mut start = 0;
        while start < blocks {
            let n = VERSIONS_CHUNK.min(blocks - start);
            let Some(differ) = self.snapshot_differs(idx, src, target, s, start, n).await? else {
                return Ok(false);
            };
            let mut i = 0;
            while i < differ.len() {
                let mut j = i + 1;
                while j < differ.len()
                    && differ[j] == differ[j - 1] + 1
                    && (j - i) < RUN_BLOCKS as usize
                {
                    j += 1;
                }
                let (first, count) = (differ[i], (j - i) as u64);
                throttle.take(count * BS).await;
                let _g = match newest {
                    true => Some(slab.gate.write().await),
                    false => None,
                };
                if !self
                    .copy_snapshot_run(idx, slab, src, target, s, first, count, newest)
                    .await?
                {
                    return Ok(false);
                }
                i = j;
            }
            start += n;
        }
        Ok(true)
    }

    /// Whether the copy at `at` holds snapshot `s` (it answers a one-block question at it).
    async fn holds(&self, idx: SlabIndex, at: ExtentLoc, s: Epoch) -> Result<bool, VolumeError> {
        let op = ExtentOp::VersionsAt {
            key: self.key(idx),
            epoch: self.epoch(),
            snapshot: s,
            offset: 0,
            count: 1,
            any: false,
        };
        match self.ask(at, op, ExtentReply::into_versions).await {
            Ok(_) => Ok(true),
            Err(ReplicaError::StaleEpoch(why)) => Err(self.fenced(why)),
            Err(_) => Ok(false),
        }
    }

    /// The blocks of `[start, start + n)` that the target reads differently at snapshot
    /// `s` than the source; None when the source cannot tell (it does not hold `s`).
    async fn snapshot_differs(
        &self,
        idx: SlabIndex,
        src: ExtentLoc,
        target: ExtentLoc,
        s: Epoch,
        start: u64,
        n: u64,
    ) -> Result<Option<Vec<u64>>, VolumeError> {
        let op = |any| ExtentOp::VersionsAt {
            key: self.key(idx),
            epoch: self.epoch(),
            snapshot: s,
            offset: start * BS,
            count: n as u32,
            any,
        };
        let sv = match self.ask(src, op(false), ExtentReply::into_versions).await {
            Ok(v) => v,
            Err(ReplicaError::StaleEpoch(why)) => return Err(self.fenced(why)),
            Err(e) => {
                log::info!(
                    "volume {}: slab {idx}: snapshot {s} not copied from drive {}: {e}",
                    self.cfg.name,
                    src.drive
                );
                return Ok(None);
            }
        };
        let tv = self
            .ask(target, op(true), ExtentReply::into_versions)
            .await
            .map_err(|e| self.replica_failed(idx, target, e))?;
        Ok(Some(
            sv.iter()
                .zip(&tv)
                .enumerate()
                .filter(|(_, (a, b))| a != b)
                .map(|(i, _)| start + i as u64)
                .collect(),
        ))
    }

    /// Copies snapshot `s`'s states of blocks `[first, first + count)` from the source into
    /// the target's keeping for it (`recheck`: compares again first, the slab's writes
    /// held). A block bad on the source is read from another in-sync copy; Ok(false) when
    /// no copy gives it (the descent ends there).
    #[allow(clippy::too_many_arguments)]
    async fn copy_snapshot_run(
        &self,
        idx: SlabIndex,
        slab: &Slab,
        src: ExtentLoc,
        target: ExtentLoc,
        s: Epoch,
        first: u64,
        count: u64,
        recheck: bool,
    ) -> Result<bool, VolumeError> {
        if recheck {
            match self
                .snapshot_differs(idx, src, target, s, first, count)
                .await?
            {
                None => return Ok(false),
                Some(d) if d.is_empty() => return Ok(true),
                Some(_) => {}
            }
        }
        let key = self.key(idx);
        let epoch = self.epoch();
        let read = |at: ExtentLoc, offset: u64, len: u64| {
            self.ask(
                at,
                ExtentOp::ReadBlocksAt {
                    key,
                    epoch,
                    snapshot: s,
                    offset,
                    len: len as u32,
                },
                ExtentReply::into_blocks,
            )
        };
        let off = first * BS;
        let r = match read(src, off, count * BS).await {
            Ok(r) => r,
            Err(ReplicaError::StaleEpoch(why)) => return Err(self.fenced(why)),
            Err(_) => return Ok(false),
        };
        let mut data = bytes::BytesMut::from(&r.data[..]);
        let mut versions = r.versions;
        for &b in &r.bad_blocks {
            let boff = off + u64::from(b) * BS;
            let mut fixed = false;
            for other in slab.extents().iter() {
                if other.state != ExtentState::InSync
                    || other.drive == src.drive
                    || other.drive == target.drive
                {
                    continue;
                }
                if let Ok(g) = read(*other, boff, BS).await {
                    if g.bad_blocks.is_empty() {
                        let at = b as usize * BS as usize;
                        data[at..at + BS as usize].copy_from_slice(&g.data);
                        versions[b as usize] = g.versions[0];
                        fixed = true;
                        break;
                    }
                }
            }
            if !fixed {
                log::error!(
                    "volume {}: slab {idx}: snapshot {s}'s block at offset {boff} fails its checksum on every in-sync copy",
                    self.cfg.name
                );
                return Ok(false);
            }
        }
        let data = data.freeze();
        let op = ExtentOp::WriteShadow {
            key,
            epoch,
            snapshot: s,
            offset: off,
            crcs: block_crcs(&data),
            versions,
            data,
        };
        self.ask(target, op, ExtentReply::into_written)
            .await
            .map_err(|e| self.replica_failed(idx, target, e))?;
        Ok(true)
    }
}
