//! The owner's data path for parity volumes (docs/adr/0008): whole-row writes at one
//! version with held priors, reads from the data chunks, degraded reads that decode runs
//! of rows, read repair, thin reclaim of whole slabs.
//!
//! A parity slab's extents are its chunks, in order: data chunks `0..K`, then parity chunks
//! `K..K+M` (the record keeps that order; a rebuild replaces a chunk in place). Row `r` is
//! block `r` of every chunk; data block `j` of row `r` is volume byte
//! `(r·K + j)·4096` of the slab.

use crate::parity::{Codec, Geometry, Shard};
use crate::{
    block_crcs, join_all, writable, BlocksReply, ExtentLoc, ExtentOp, ExtentReply, Piece,
    ReplicaError, ReplicaIo, Retry, Slab, SlabAllocator, Volume, VolumeError, BS,
};
use bytes::{Bytes, BytesMut};
use converge_types::{ExtentState, SettleRows, SlabIndex, Version, SETTLE_ROWS_MAX};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use tokio::time::Instant;

/// A slab's writes settle (chunks drop the priors of rows every chunk has) once this many
/// rows were written since the last settle: priors are bounded per drive (`held_max`), and
/// a settle costs a journal record on every chunk.
const SETTLE_ROWS: u64 = 32;

/// How long a write keeps asking a chunk whose drive is busy (holds all the priors it may)
/// when `degraded_write_wait` is shorter: the drive is up and frees priors as the owners
/// settle, so waiting is better than failing the write.
const BUSY_WAIT: std::time::Duration = std::time::Duration::from_secs(20);

/// Rows of held writes one parity volume has in flight at most (per chunk: 1 MiB of priors
/// with 4 KiB blocks). A drive refuses held writes beyond its own bound (`held_max`), and
/// writes in flight hold priors on the chunks that took them while they wait for the others:
/// without this bound, a client with hundreds of requests in flight filled every drive with
/// half-done writes that each waited for a drive another one filled.
pub(crate) const HELD_ROWS_IN_FLIGHT: usize = 256;

/// Rows one held write covers at most (a larger request is written as several, each
/// settled before the next): with 4 KiB blocks, 256 KiB of priors per chunk.
const GROUP_ROWS: u64 = 64;

/// The rows of one slab that writes (and degraded reads) are working on: a row is written
/// by one request at a time, so its chunks only ever disagree while that request runs.
#[derive(Default)]
pub(crate) struct RowLocks {
    held: Mutex<Vec<(u64, u64)>>,
    freed: tokio::sync::Notify,
}

/// Rows `[first, end)` locked until dropped.
pub(crate) struct RowGuard<'a> {
    locks: &'a RowLocks,
    range: (u64, u64),
}

impl RowLocks {
    /// Waits until no other holder has any of rows `[first, end)`, then holds them.
    pub(crate) async fn lock(&self, first: u64, end: u64) -> RowGuard<'_> {
        loop {
            let freed = self.freed.notified();
            let mut freed = std::pin::pin!(freed);
            // Registered before the check, so a release between the two wakes this waiter.
            freed.as_mut().enable();
            {
                let mut held = self.held.lock().expect("row locks poisoned");
                if !held.iter().any(|&(a, b)| a < end && first < b) {
                    held.push((first, end));
                    return RowGuard {
                        locks: self,
                        range: (first, end),
                    };
                }
            }
            freed.await;
        }
    }
}

impl Drop for RowGuard<'_> {
    fn drop(&mut self) {
        let mut held = self.locks.held.lock().expect("row locks poisoned");
        if let Some(i) = held.iter().position(|r| *r == self.range) {
            held.swap_remove(i);
        }
        drop(held);
        self.locks.freed.notify_waiters();
    }
}

/// Row writes of one slab in flight, by version sequence: the chunks may drop the priors of
/// every version below the oldest one still running, and of the rows of every write that
/// completed since the last settle (`done`: first row, rows, version sequence).
#[derive(Default)]
pub(crate) struct RowWrites {
    flight: Mutex<BTreeSet<u64>>,
    done: Mutex<Vec<(u64, u64, u64)>>,
    since_settle: AtomicU64,
    settling: AtomicBool,
}

/// Clears `settling` however the settle ends.
struct Settling<'a>(&'a AtomicBool);

impl Drop for Settling<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Data chunk `j`'s rows within volume blocks `[b0, b1)` of a slab of K-block rows.
fn chunk_rows(k: u64, j: u64, b0: u64, b1: u64) -> (u64, u64) {
    let first = if b0 <= j { 0 } else { (b0 - j).div_ceil(k) };
    let end = if b1 <= j { 0 } else { (b1 - j).div_ceil(k) };
    (first, end.max(first))
}

fn bit(c: usize) -> u32 {
    1 << c
}

/// Row `i`'s version among the chunks' answers: the highest that `k` of them hold intact.
pub(crate) fn row_version(got: &[Option<BlocksReply>], i: usize, k: usize) -> Option<Version> {
    let mut counts: Vec<(Version, usize)> = Vec::new();
    for r in got.iter().flatten() {
        if r.bad_blocks.contains(&(i as u32)) {
            continue;
        }
        match counts.iter_mut().find(|(v, _)| *v == r.versions[i]) {
            Some((_, c)) => *c += 1,
            None => counts.push((r.versions[i], 1)),
        }
    }
    counts
        .iter()
        .filter(|(_, c)| *c >= k)
        .map(|(v, _)| *v)
        .max()
}

/// Counts a chunk answer's suspect blocks (rolled back by its drive's recovery) as bad:
/// they are no source for a row.
pub(crate) fn suspect_as_bad(r: &mut BlocksReply) {
    for i in std::mem::take(&mut r.suspect) {
        if !r.bad_blocks.contains(&i) {
            r.bad_blocks.push(i);
        }
    }
}

/// Whether chunk `c`'s answer holds row `i` intact at `version`.
pub(crate) fn good_at(got: &[Option<BlocksReply>], c: usize, i: usize, version: Version) -> bool {
    got[c]
        .as_ref()
        .is_some_and(|r| r.versions[i] == version && !r.bad_blocks.contains(&(i as u32)))
}

pub(crate) const BSZ: usize = BS as usize;

impl<R: ReplicaIo, A: SlabAllocator> Volume<R, A> {
    pub(crate) fn with_codec<T>(&self, g: Geometry, f: impl FnOnce(&mut Codec) -> T) -> T {
        let pooled = self.codecs.lock().expect("codec pool poisoned").pop();
        let mut c = pooled
            .unwrap_or_else(|| Codec::new(g.k(), g.m()).expect("a geometry's shape makes a codec"));
        let r = f(&mut c);
        self.codecs.lock().expect("codec pool poisoned").push(c);
        r
    }

    /// The slab's chunks, checked to be K+M (a record of another shape is refused, not
    /// indexed).
    pub(crate) fn chunks(
        &self,
        g: Geometry,
        idx: SlabIndex,
        slab: &Slab,
    ) -> Result<Vec<ExtentLoc>, VolumeError> {
        let ex = slab.extents();
        let all = usize::from(g.k()) + usize::from(g.m());
        if ex.len() != all {
            return Err(self.copy_error(
                idx,
                format!(
                    "the slab's record names {} extents; parity-{}+{} needs {all}",
                    ex.len(),
                    g.k(),
                    g.m()
                ),
            ));
        }
        Ok(ex.to_vec())
    }

    /// Which of the slab's chunks `ex` is on `drive`.
    pub(crate) fn chunk_on(
        &self,
        idx: SlabIndex,
        ex: &[ExtentLoc],
        drive: converge_types::DriveId,
    ) -> Result<usize, VolumeError> {
        ex.iter()
            .position(|e| e.drive == drive)
            .ok_or_else(|| self.copy_error(idx, format!("drive {drive} holds no chunk")))
    }

    /// A write within one slab: the rows it touches are written whole on every chunk that
    /// is not stale, at one new version, held (each block keeps its prior until settled).
    /// Rows it covers only in part are read first (read-modify-write).
    pub(crate) async fn parity_write_piece(
        &self,
        g: Geometry,
        p: Piece,
        data: Bytes,
    ) -> Result<(), VolumeError> {
        loop {
            let slab = self.slab_or_allocate(p.slab).await?;
            self.wait_min_replicas(p.slab, &slab).await?;
            let gate = slab.gate.read().await;
            // As a mirror write: not after a snapshot ended this owner's serving.
            self.check_serving()?;
            if slab.is_released() {
                continue;
            }
            let span = g.row_span(p.offset, p.len);
            let (r0, n) = (span.first_row, span.row_count);
            let locked = slab.rows.lock(r0, r0 + n).await;
            if slab.suspect.load(Ordering::Acquire) {
                // A write of the slab failed and may have left in-sync chunks that disagree
                // on its rows: the chunks it reached may need their priors, and a chunk
                // keeps one prior per block. A held write over them would replace it,
                // leaving a takeover only the failed write's version to go back to (or the
                // zero rule). The slab's rows are made to agree first.
                drop(locked);
                drop(gate);
                self.reconcile_if_suspect(p.slab, &slab).await?;
                continue;
            }
            let rb = g.row_bytes();
            let mut merged = None;
            if span.first_partial || span.last_partial {
                let mut buf = vec![0u8; (n * rb) as usize];
                let edges = if n > 1 {
                    vec![r0, r0 + n - 1]
                } else {
                    vec![r0]
                };
                for r in edges {
                    if p.offset <= r * rb && p.offset + p.len >= (r + 1) * rb {
                        continue;
                    }
                    let row = self
                        .read_with_retries(p.slab, || {
                            self.read_rows_round(g, p.slab, &slab, r, 1, 0)
                        })
                        .await?;
                    let at = ((r - r0) * rb) as usize;
                    buf[at..at + rb as usize].copy_from_slice(&row);
                }
                let at = (p.offset - r0 * rb) as usize;
                buf[at..at + data.len()].copy_from_slice(&data);
                merged = Some(buf);
            }
            let rows: &[u8] = merged.as_deref().unwrap_or(&data);
            // Held in groups of rows, each settled before the next: a drive holds a
            // bounded number of priors (`held_max`), and one request may cover thousands
            // of rows.
            for first in (0..n).step_by(GROUP_ROWS as usize) {
                let count = GROUP_ROWS.min(n - first);
                let part = &rows[(first * rb) as usize..((first + count) * rb) as usize];
                if let Err(e) = self.write_rows(g, p.slab, &slab, r0 + first, part).await {
                    // Below min_replicas the chunks that failed are stale and the others
                    // hold the rows (or none does, and the slab is suspect already). Any
                    // other failure (fenced: deposed; a chunk that failed could not be
                    // marked stale) may leave in-sync chunks that disagree on the rows.
                    if !matches!(e, VolumeError::Degraded { .. }) {
                        slab.suspect.store(true, Ordering::Release);
                    }
                    return Err(e);
                }
                self.maybe_settle(p.slab, &slab, count).await;
            }
            return Ok(());
        }
    }

    /// Writes whole rows from `r0` (`rows`, row-major) at one new version, held, on every
    /// chunk that is not stale. The caller holds the rows' lock. A chunk whose drive is
    /// busy (holding all the priors it may) is asked again until `degraded_write_wait`.
    async fn write_rows(
        &self,
        g: Geometry,
        idx: SlabIndex,
        slab: &Slab,
        r0: u64,
        rows: &[u8],
    ) -> Result<(), VolumeError> {
        let n = rows.len() as u64 / g.row_bytes();
        let chunks = self.encode_rows(g, idx, rows)?;
        let cb = (n * BS) as usize;
        let shard = |c: usize| chunks.slice(c * cb..(c + 1) * cb);
        let all = usize::from(g.k()) + usize::from(g.m());
        let crcs: Vec<std::sync::Arc<[u32]>> = (0..all).map(|c| block_crcs(&shard(c))).collect();
        let extents = self.chunks(g, idx, slab)?;
        let key = self.key(idx);
        let epoch = self.epoch();
        let _room = self
            .held_rows
            .acquire_many(n.min(HELD_ROWS_IN_FLIGHT as u64) as u32)
            .await
            .expect("the semaphore is never closed");
        let version = self.begin_row_write(slab);
        let targets = writable(&extents);
        let busy_until = Instant::now() + self.cfg.degraded_write_wait.max(BUSY_WAIT);
        let r = self
            .replicate(idx, slab, targets, |at| {
                let c = extents
                    .iter()
                    .position(|e| e.drive == at.drive)
                    .expect("targets are the slab's chunks");
                let op = ExtentOp::WriteHeld {
                    key,
                    epoch,
                    version,
                    offset: r0 * BS,
                    crcs: crcs[c].clone(),
                    data: shard(c),
                };
                async move {
                    let mut pause = std::time::Duration::from_millis(2);
                    loop {
                        match self.ask(at, op.clone(), ExtentReply::into_ok).await {
                            Err(ReplicaError::Busy(why)) if Instant::now() < busy_until => {
                                log::debug!(
                                    "volume {}: slab {idx}: chunk on node {} busy ({why}); asking again",
                                    self.cfg.name,
                                    at.node
                                );
                                // The priors this slab's completed writes hold may be what
                                // fills the drive: settle them now.
                                self.maybe_settle(idx, slab, SETTLE_ROWS).await;
                                tokio::time::sleep(pause).await;
                                pause = (pause * 2).min(std::time::Duration::from_millis(50));
                            }
                            r => return r,
                        }
                    }
                }
            })
            .await;
        let seq = version.0 & 0xffff_ffff;
        if r.is_ok() {
            // Before it leaves `flight`, so a settle sees it in one or the other.
            let mut done = slab.row_writes.done.lock().expect("row writes poisoned");
            done.push((r0, n, seq));
        }
        slab.row_writes
            .flight
            .lock()
            .expect("row writes poisoned")
            .remove(&seq);
        r
    }

    /// Lays `rows` (whole rows, row-major as the volume sees them) out as K+M chunk
    /// slices, one after the other, and computes the parity ones.
    pub(crate) fn encode_rows(
        &self,
        g: Geometry,
        idx: SlabIndex,
        rows: &[u8],
    ) -> Result<Bytes, VolumeError> {
        let k = usize::from(g.k());
        let all = k + usize::from(g.m());
        let n = rows.len() / (k * BSZ);
        let cb = n * BSZ;
        let mut out = BytesMut::zeroed(all * cb);
        for i in 0..n {
            for j in 0..k {
                let src = (i * k + j) * BSZ;
                let dst = j * cb + i * BSZ;
                out[dst..dst + BSZ].copy_from_slice(&rows[src..src + BSZ]);
            }
        }
        let (data, parity) = out.split_at_mut(k * cb);
        let data: Vec<&[u8]> = data.chunks(cb).collect();
        let mut parity: Vec<&mut [u8]> = parity.chunks_mut(cb).collect();
        self.with_codec(g, |c| c.encode(&data, &mut parity))
            .map_err(|e| self.copy_error(idx, format!("parity codec: {e}")))?;
        Ok(out.freeze())
    }

    /// Takes the next version of the slab for a row write and counts it in flight (under
    /// the one lock, so a settle never passes a version whose write has not begun).
    fn begin_row_write(&self, slab: &Slab) -> Version {
        let mut flight = slab.row_writes.flight.lock().expect("row writes poisoned");
        let v = self.next_version(slab);
        flight.insert(v.0 & 0xffff_ffff);
        v
    }

    /// Once [`SETTLE_ROWS`] rows were written since the last settle (`rows` more just
    /// now), tells the chunks to drop the priors of every version below the oldest row
    /// write still running, and those of the rows of every write that completed since the
    /// last settle (a write still running keeps its own: its rows are not among them, and
    /// a later write of the same rows has a newer version). Skipped while the slab is
    /// suspect (a write failed everywhere: its rows may need their priors). A failed settle
    /// only leaves priors for the next one (the oldest-write bound covers them once it
    /// passes them).
    async fn maybe_settle(&self, idx: SlabIndex, slab: &Slab, rows: u64) {
        let w = &slab.row_writes;
        if w.since_settle.fetch_add(rows, Ordering::AcqRel) + rows < SETTLE_ROWS
            || w.settling.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let _settling = Settling(&w.settling);
        w.since_settle.store(0, Ordering::Release);
        let epoch = self.epoch().0 << 32;
        let (below, done) = {
            let flight = w.flight.lock().expect("row writes poisoned");
            let below = match flight.first() {
                Some(oldest) => oldest - 1,
                None => slab.seq.load(Ordering::Acquire),
            };
            let done = std::mem::take(&mut *w.done.lock().expect("row writes poisoned"));
            (below, done)
        };
        if slab.suspect.load(Ordering::Acquire) {
            return;
        }
        let rows: Vec<SettleRows> = done
            .into_iter()
            .filter(|&(_, _, seq)| seq > below)
            .map(|(first, count, seq)| SettleRows {
                first: first as u32,
                count: count as u32,
                upto: Version(epoch | seq),
            })
            .collect();
        self.settle_chunks(idx, slab, Version(epoch | below), &rows)
            .await;
    }

    /// Settles every chunk that is not stale up to `upto`, and `rows` each up to its own
    /// version (failures are logged: the priors stay until the next settle).
    pub(crate) async fn settle_chunks(
        &self,
        idx: SlabIndex,
        slab: &Slab,
        upto: Version,
        rows: &[SettleRows],
    ) {
        let targets = writable(&slab.extents());
        for (at, r) in self.settle_on(idx, &targets, upto, rows).await {
            if let Err(e) = r {
                log::info!(
                    "volume {}: slab {idx}: chunk on node {} drive {} did not settle ({e}); its priors wait for the next settle",
                    self.cfg.name,
                    at.node,
                    at.drive
                );
            }
        }
    }

    /// Settles the chunks at `targets` up to `upto` (and `rows` each up to its own
    /// version); each chunk's answer.
    pub(crate) async fn settle_on(
        &self,
        idx: SlabIndex,
        targets: &[ExtentLoc],
        upto: Version,
        rows: &[SettleRows],
    ) -> Vec<(ExtentLoc, Result<(), ReplicaError>)> {
        let key = self.key(idx);
        let epoch = self.epoch();
        let answers = join_all(
            targets
                .iter()
                .map(|&at| async move {
                    let mut r = Ok(());
                    // The first op also settles below `upto`; each carries a bounded list
                    // (one op with none when there are no rows).
                    let parts = rows.chunks(SETTLE_ROWS_MAX).map(<[_]>::to_vec);
                    let parts = parts.chain(rows.is_empty().then(Vec::new));
                    for (i, part) in parts.enumerate() {
                        let op = ExtentOp::Settle {
                            key,
                            epoch,
                            upto: if i == 0 { upto } else { Version(0) },
                            rows: part,
                        };
                        r = r.and(self.ask(at, op, ExtentReply::into_ok).await);
                    }
                    (at, r)
                })
                .collect(),
        )
        .await;
        answers
    }

    /// WRITE_ZEROES of part of a parity slab: zeros written as rows (a zero is then as
    /// consistent across chunks, and as revertible, as any write).
    pub(crate) async fn parity_zero_piece(&self, g: Geometry, p: Piece) -> Result<(), VolumeError> {
        self.parity_write_piece(g, p, Bytes::from(vec![0u8; p.len as usize]))
            .await
    }

    /// Thin reclaim of a parity slab a TRIM or WRITE_ZEROES covers whole: with no write in
    /// flight and every chunk in sync, its record is deleted (from then on it reads as
    /// zeros, at once and for every later owner) and its chunks are freed. Returns whether
    /// it was released; a slab that cannot be now is left as it is, and a WRITE_ZEROES
    /// then writes its zeros as rows.
    pub(crate) async fn parity_release(&self, idx: SlabIndex) -> Result<bool, VolumeError> {
        let Some(slab) = self.known_slab(idx).await? else {
            return Ok(true);
        };
        let _gate = slab.gate.write().await;
        if slab.is_released() {
            return Ok(true);
        }
        // The volume's snapshots read what the chunks keep (checked under the gate: a
        // snapshot holds every gate while it is taken), but for a rotation's leftover:
        // the span's mirror part holds its data, and what its snapshots read.
        if !self.snapshots().is_empty() && !self.is_leftover(idx) {
            return Ok(false);
        }
        let _c = slab.change.lock().await;
        let extents = slab.extents();
        let settled = extents.iter().all(|e| e.state == ExtentState::InSync)
            && !slab.suspect.load(Ordering::Acquire)
            && !slab.unsure.load(Ordering::Acquire)
            && crate::abandoned_none(&slab);
        if !settled {
            return Ok(false);
        }
        let upto = Version(self.epoch().0 << 32 | slab.seq.load(Ordering::Acquire));
        let epoch = self.epoch();
        let deleted = self.alloc.release(self.cfg.id, &[idx], epoch).await;
        // Whatever the answer, no write may go to these chunks under this handle: if the
        // record is still there, the next write takes the slab up again (zeroing it).
        self.forget_released(idx, &slab);
        // Unlike a mirror's, a parity slab is not zeroed before its record goes: if the
        // record may still be there, the zero is not done.
        deleted?;
        self.free_released(idx, &extents, upto).await;
        Ok(true)
    }

    /// One round of a read of a parity slab. Healthy: each data chunk the piece touches
    /// reads its blocks (one request per chunk; a 4 KiB read asks one chunk). Otherwise
    /// (a data chunk not in sync, an error, a bad block) the rows are read whole under
    /// their lock and what is missing decoded. A data chunk that has not answered within
    /// `read_hedge` is hedged: the rows are read from the other chunks (not asking it) and
    /// its blocks decoded, so one hung node costs a read `read_hedge`, not a timeout.
    pub(crate) async fn parity_read_round(
        &self,
        g: Geometry,
        p: Piece,
        slab: &Slab,
    ) -> Result<Bytes, Retry> {
        let ex = self.chunks(g, p.slab, slab).map_err(Retry::Fail)?;
        let k = u64::from(g.k());
        let (b0, b1) = (p.offset / BS, (p.offset + p.len) / BS);
        let reads: Vec<(u64, u64, u64)> = (0..k)
            .map(|j| {
                let (rs, re) = chunk_rows(k, j, b0, b1);
                (j, rs, re)
            })
            .filter(|(_, rs, re)| re > rs)
            .collect();
        if reads
            .iter()
            .all(|(j, _, _)| ex[*j as usize].state == ExtentState::InSync)
        {
            let key = self.key(p.slab);
            let epoch = self.epoch();
            let answered: Vec<AtomicBool> = reads.iter().map(|_| AtomicBool::new(false)).collect();
            let mut healthy = std::pin::pin!(join_all(
                reads
                    .iter()
                    .zip(&answered)
                    .map(|(&(j, rs, re), answered)| {
                        let op = ExtentOp::Read {
                            key,
                            epoch,
                            offset: rs * BS,
                            len: ((re - rs) * BS) as u32,
                        };
                        let at = ex[j as usize];
                        async move {
                            let r = self.ask(at, op, ExtentReply::into_read).await;
                            answered.store(true, Ordering::Release);
                            r
                        }
                    })
                    .collect(),
            ));
            let answers = match tokio::time::timeout(self.cfg.read_hedge, &mut healthy).await {
                Ok(answers) => answers,
                Err(_) => {
                    // Hedge: the data chunks that have not answered are left out, if the
                    // others still make K (at most M left out); else wait for them.
                    let avoid = reads
                        .iter()
                        .zip(&answered)
                        .filter(|(_, a)| !a.load(Ordering::Acquire))
                        .fold(0u32, |m, (&(j, _, _), _)| m | bit(j as usize));
                    if avoid.count_ones() > u32::from(g.m()) {
                        healthy.await
                    } else {
                        self.counters.hedged_reads.fetch_add(1, Ordering::Relaxed);
                        return self.parity_read_rows(g, p, slab, avoid).await;
                    }
                }
            };
            if slab.is_released() {
                return Err(released_meanwhile());
            }
            let mut whole = true;
            for (a, (j, _, _)) in answers.iter().zip(&reads) {
                match a {
                    // A suspect block (rolled back by its replica's recovery) may be older
                    // than the row: the slow path compares the chunks' versions.
                    Ok(r) if r.bad_blocks.is_empty() && r.suspect.is_empty() => {}
                    Ok(_) => whole = false,
                    Err(ReplicaError::StaleEpoch(why)) => {
                        return Err(Retry::Fail(self.fenced(why.clone())))
                    }
                    Err(e) => {
                        let at = ex[*j as usize];
                        log::warn!(
                            "volume {}: read of slab {} from chunk {j} on node {} drive {} failed: {e}; decoding from the others",
                            self.cfg.name, p.slab, at.node, at.drive
                        );
                        whole = false;
                    }
                }
            }
            if whole {
                let mut answers: Vec<Bytes> = answers
                    .into_iter()
                    .map(|a| a.expect("checked above").data)
                    .collect();
                if answers.len() == 1 {
                    // One data chunk: the piece is its blocks, as read.
                    return Ok(answers.pop().expect("one answer"));
                }
                let mut out = BytesMut::zeroed(p.len as usize);
                for (data, &(j, rs, re)) in answers.iter().zip(&reads) {
                    for r in rs..re {
                        let dst = ((r * k + j - b0) * BS) as usize;
                        let src = ((r - rs) * BS) as usize;
                        out[dst..dst + BSZ].copy_from_slice(&data[src..src + BSZ]);
                    }
                }
                return Ok(out.freeze());
            }
        }
        self.parity_read_rows(g, p, slab, 0).await
    }

    /// Piece `p` read as whole rows under their lock, decoded where a data chunk falls
    /// short; the data chunks in `avoid` (a bit each) are not asked.
    async fn parity_read_rows(
        &self,
        g: Geometry,
        p: Piece,
        slab: &Slab,
        avoid: u32,
    ) -> Result<Bytes, Retry> {
        let k = u64::from(g.k());
        let (b0, b1) = (p.offset / BS, (p.offset + p.len) / BS);
        let (r0, r1) = (b0 / k, (b1 - 1) / k + 1);
        let _rows = slab.rows.lock(r0, r1).await;
        let rows = self
            .read_rows_round(g, p.slab, slab, r0, r1 - r0, avoid)
            .await?;
        if slab.is_released() {
            return Err(released_meanwhile());
        }
        let at = (p.offset - r0 * g.row_bytes()) as usize;
        Ok(Bytes::from(rows).slice(at..at + p.len as usize))
    }

    /// Rows `[r0, r0 + n)` whole (row-major, as the volume sees them), read from the data
    /// chunks, or decoded from any K chunks holding the row at its version when a data
    /// chunk cannot give them. Blocks that failed their checksum on an in-sync chunk are
    /// rewritten from the decoded row. The caller holds the rows' lock. The chunks in
    /// `avoid` (a bit each: a hedged read's chunks that did not answer in time) are not
    /// asked.
    pub(crate) async fn read_rows_round(
        &self,
        g: Geometry,
        idx: SlabIndex,
        slab: &Slab,
        r0: u64,
        n: u64,
        avoid: u32,
    ) -> Result<Vec<u8>, Retry> {
        let ex = self.chunks(g, idx, slab).map_err(Retry::Fail)?;
        let k = usize::from(g.k());
        let all = ex.len();
        let n_us = n as usize;
        let mut got: Vec<Option<BlocksReply>> = vec![None; all];
        let mut errors: Vec<String> = Vec::new();
        let mut asked = 0u32;
        // Data chunks first; the parity chunks only when some data chunk falls short.
        for phase in [0..k, k..all] {
            let want: Vec<usize> = phase
                .filter(|&c| ex[c].state == ExtentState::InSync && avoid & bit(c) == 0)
                .collect();
            self.read_blocks_into(idx, &ex, &want, r0, n, &mut got, &mut errors)
                .await?;
            asked |= want.iter().fold(0, |m, &c| m | bit(c));
            let data_whole = (0..k).all(|c| {
                got[c]
                    .as_ref()
                    .is_some_and(|r| r.bad_blocks.is_empty() && r.suspect.is_empty())
            });
            if data_whole {
                return Ok(interleave(k, n_us, |c, i| {
                    &got[c].as_ref().expect("checked").data[i * BSZ..]
                }));
            }
        }
        // Each row's version: the highest that K chunks hold intact.
        let mut versions = Vec::with_capacity(n_us);
        for i in 0..n_us {
            let Some(v) = row_version(&got, i, k) else {
                let why = format!(
                    "row {} of slab {idx}: fewer than {k} chunks hold it intact at one version{}",
                    r0 + i as u64,
                    if errors.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", errors.join("; "))
                    }
                );
                // Every in-sync chunk answered: nothing more will come.
                let in_sync = ex
                    .iter()
                    .enumerate()
                    .filter(|(_, e)| e.state == ExtentState::InSync)
                    .fold(0, |m, (c, _)| m | bit(c));
                let answered = got
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| r.is_some())
                    .fold(0, |m, (c, _)| m | bit(c));
                return Err(if answered == in_sync && asked == in_sync {
                    Retry::Fail(self.copy_error(idx, why))
                } else {
                    Retry::Again(why)
                });
            };
            versions.push(v);
        }
        // Decode the data chunks' missing blocks, and every in-sync chunk's bad ones.
        let bad = |i: usize, c: usize| {
            got[c]
                .as_ref()
                .is_some_and(|r| r.bad_blocks.contains(&(i as u32)))
        };
        let suspect = |i: usize, c: usize| {
            got[c]
                .as_ref()
                .is_some_and(|r| r.suspect.contains(&(i as u32)))
        };
        let decoded = self
            .decode_rows(g, &got, &versions, &|i, c| {
                c < k || bad(i, c) || suspect(i, c)
            })
            .map_err(|why| Retry::Fail(self.copy_error(idx, why)))?;
        let rows = interleave(k, n_us, |c, i| {
            if good_at(&got, c, i, versions[i]) {
                &got[c].as_ref().expect("good").data[i * BSZ..]
            } else {
                &decoded[c].as_ref().expect("decoded")[i * BSZ..]
            }
        });
        // Read repair: rewrite each bad or suspect block at its row's version, unless it
        // changed (a suspect block that agrees with its row is rewritten as it is, which
        // clears its mark).
        let key = self.key(idx);
        let epoch = self.epoch();
        for c in 0..all {
            for (i, &row_version) in versions.iter().enumerate() {
                if !bad(i, c) && !suspect(i, c) {
                    continue;
                }
                let from: &[u8] = if good_at(&got, c, i, row_version) {
                    &got[c].as_ref().expect("good").data
                } else {
                    decoded[c].as_ref().expect("decoded")
                };
                let block = Bytes::copy_from_slice(&from[i * BSZ..(i + 1) * BSZ]);
                let seen = got[c].as_ref().expect("bad implies read").versions[i];
                let op = ExtentOp::WriteBlocks {
                    key,
                    epoch,
                    offset: (r0 + i as u64) * BS,
                    crcs: block_crcs(&block),
                    versions: vec![row_version],
                    expect: vec![seen],
                    data: block,
                    codec: converge_types::Compression::None,
                };
                match self.ask(ex[c], op, ExtentReply::into_written).await {
                    Ok(_) => {
                        self.counters
                            .repaired_blocks
                            .fetch_add(1, Ordering::Relaxed);
                        log::warn!(
                            "volume {}: repaired block of row {} of slab {idx} on chunk {c} (node {} drive {}) from the other chunks",
                            self.cfg.name, r0 + i as u64, ex[c].node, ex[c].drive
                        );
                    }
                    Err(e) => log::error!(
                        "volume {}: could not rewrite bad block of row {} of slab {idx} on node {} drive {}: {e}",
                        self.cfg.name,
                        r0 + i as u64,
                        ex[c].node,
                        ex[c].drive
                    ),
                }
            }
        }
        Ok(rows)
    }

    /// Reads rows `[r0, r0 + n)` from the chunks `which` into `got` (in parallel); a chunk
    /// that fails is left out, its error noted. A fenced answer ends the round.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn read_blocks_into(
        &self,
        idx: SlabIndex,
        ex: &[ExtentLoc],
        which: &[usize],
        r0: u64,
        n: u64,
        got: &mut [Option<BlocksReply>],
        errors: &mut Vec<String>,
    ) -> Result<(), Retry> {
        let key = self.key(idx);
        let epoch = self.epoch();
        let answers = join_all(
            which
                .iter()
                .map(|&c| {
                    let op = ExtentOp::ReadBlocks {
                        key,
                        epoch,
                        offset: r0 * BS,
                        len: (n * BS) as u32,
                    };
                    self.ask(ex[c], op, ExtentReply::into_blocks)
                })
                .collect(),
        )
        .await;
        for (&c, a) in which.iter().zip(answers) {
            match a {
                Ok(r) => got[c] = Some(r),
                Err(ReplicaError::StaleEpoch(why)) => return Err(Retry::Fail(self.fenced(why))),
                Err(e) => errors.push(format!(
                    "chunk {c} on node {} drive {}: {e}",
                    ex[c].node, ex[c].drive
                )),
            }
        }
        Ok(())
    }

    /// Reconstructs, for each row `i` of the answers in `got` (one per chunk, or none),
    /// the blocks of the chunks `want(i, c)` names that do not hold the row intact at
    /// `versions[i]`, from K chunks that do (data chunks first). Consecutive rows with the
    /// same chunks present and wanted are decoded in one call. Returns per chunk a buffer
    /// of the rows (only wanted blocks filled), or why a row could not be decoded.
    pub(crate) fn decode_rows(
        &self,
        g: Geometry,
        got: &[Option<BlocksReply>],
        versions: &[Version],
        want: &dyn Fn(usize, usize) -> bool,
    ) -> Result<Vec<Option<Vec<u8>>>, String> {
        let k = usize::from(g.k());
        let all = got.len();
        let n = versions.len();
        let masks = |i: usize| {
            let mut have = 0u32;
            let mut wanted = 0u32;
            for c in 0..all {
                if good_at(got, c, i, versions[i]) {
                    if have.count_ones() < k as u32 {
                        have |= bit(c);
                    }
                } else if want(i, c) {
                    wanted |= bit(c);
                }
            }
            (have, wanted)
        };
        let mut out: Vec<Option<Vec<u8>>> = vec![None; all];
        let mut i = 0;
        while i < n {
            let (have, wanted) = masks(i);
            let mut j = i + 1;
            while j < n && masks(j) == (have, wanted) {
                j += 1;
            }
            if wanted != 0 {
                if have.count_ones() < k as u32 {
                    return Err(format!(
                        "row {i} of the run: only {} chunks hold it intact at version {}, {k} needed",
                        have.count_ones(),
                        versions[i]
                    ));
                }
                for (c, o) in out.iter_mut().enumerate() {
                    if wanted & bit(c) != 0 && o.is_none() {
                        *o = Some(vec![0u8; n * BSZ]);
                    }
                }
                let mut shards: Vec<Shard<'_>> = Vec::with_capacity(all);
                for (c, o) in out.iter_mut().enumerate() {
                    let s = if have & bit(c) != 0 {
                        Shard::Have(&got[c].as_ref().expect("present").data[i * BSZ..j * BSZ])
                    } else if wanted & bit(c) != 0 {
                        Shard::Want(&mut o.as_mut().expect("allocated")[i * BSZ..j * BSZ])
                    } else {
                        Shard::Absent
                    };
                    shards.push(s);
                }
                self.with_codec(g, |codec| codec.reconstruct(&mut shards))
                    .map_err(|e| format!("parity codec: {e}"))?;
            }
            i = j;
        }
        Ok(out)
    }
}

/// A read of a slab that a TRIM released while the chunks answered: what they said may be
/// a later incarnation's (a chunk's drive may hold another place of its rows by then), so
/// the read starts again from the slab map.
fn released_meanwhile() -> Retry {
    Retry::Again("the slab was released while it was read".into())
}

/// K chunks' blocks of `n` rows laid out as the volume sees them: row by row, chunk 0
/// first. `block(c, i)` starts with chunk `c`'s block of row `i`.
pub(crate) fn interleave<'a>(
    k: usize,
    n: usize,
    block: impl Fn(usize, usize) -> &'a [u8],
) -> Vec<u8> {
    let mut out = vec![0u8; n * k * BSZ];
    for i in 0..n {
        for c in 0..k {
            let dst = (i * k + c) * BSZ;
            out[dst..dst + BSZ].copy_from_slice(&block(c, i)[..BSZ]);
        }
    }
    out
}
