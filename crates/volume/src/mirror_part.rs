//! Mirror-accelerated parity (docs/adr/0009): a parity-K+M volume with a mirror part.
//!
//! The volume's address space is cut into spans of K extents (a parity slab's span). A
//! span is held in one of two layouts at a time:
//! * **mirror**: up to K mirror-part slabs ([`SlabIndex::mirror_part`]), one per extent of
//!   the span, each a mirror of M+1 copies ([`Resiliency::mirror_part`]), allocated on
//!   first write like any mirror slab;
//! * **parity**: one parity slab (K+M chunks) at the span's index.
//!
//! A write to a span with neither takes the mirror while the mirror part has room, else
//! parity. When the mirror part is above its high watermark, the span written least
//! recently is *rotated*: copied as whole rows into a parity slab, then its mirror-part
//! slabs' records are deleted in one fenced transaction — the flip. If both layouts have
//! records (a rotation that stopped before its flip), the mirror's are the truth and the
//! parity slab is discarded.
//!
//! Each span has a gate (striped: [`SPAN_GATES`] of them per volume). Writes take its
//! `writes` lock shared, reads its `reads` lock shared. Whatever may change a span's
//! layout takes `writes` exclusively: a zero that may release slabs, a rotation (for its
//! copy, so no write lands behind it), the discard of a leftover. The flip also takes
//! `reads` exclusively, so no read is routed to copies the flip frees. Under a shared
//! `writes` lock a span's layout, once it has one, does not change.

use crate::resync::{Progress, Throttle};
use crate::VolumeError;
use crate::{join_all_ok, join_all_ok_vec, split, Piece, ReplicaIo, Slab, SlabAllocator, Volume};
use bytes::{Bytes, BytesMut};
use converge_types::{ExtentState, SlabIndex, Version, ROTATE_HIGH_PCT, ROTATE_LOW_PCT};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::time::Instant;

/// Gates per volume: spans share them by index modulo this (a rotation holds its span's
/// gate, and so briefly the spans that share it).
pub(crate) const SPAN_GATES: usize = 64;

/// Bytes a rotation copies per step (rounded down to whole rows).
const ROTATE_STEP_BYTES: u64 = 4 << 20;

#[derive(Default)]
pub(crate) struct SpanGate {
    pub(crate) writes: tokio::sync::RwLock<()>,
    pub(crate) reads: tokio::sync::RwLock<()>,
}

/// What a volume with a mirror part keeps beside its slabs.
pub(crate) struct MirrorPart {
    /// Volume bytes the mirror part may hold (whole extents).
    pub(crate) bytes: u64,
    gates: Box<[SpanGate]>,
    /// The volume's clock origin: a mirror-part slab's last write is kept in ms since.
    origin: Instant,
}

impl MirrorPart {
    pub(crate) fn new(bytes: u64) -> MirrorPart {
        MirrorPart {
            bytes,
            gates: (0..SPAN_GATES).map(|_| SpanGate::default()).collect(),
            origin: Instant::now(),
        }
    }
}

/// How a span is held now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Layout {
    Mirror,
    Parity,
}

/// The mirror part's use, as the owner knows it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MirrorPartUsage {
    /// Volume bytes the mirror part may hold.
    pub limit_bytes: u64,
    /// Volume bytes in mirror-part slabs (allocated extents, each counted once).
    pub mirror_bytes: u64,
    /// Volume bytes in parity slabs (allocated spans).
    pub parity_bytes: u64,
}

/// What one rotation did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rotated {
    /// The span's data is now in its parity slab; this many volume bytes were copied.
    Span { span: u64, bytes: u64 },
    /// The mirror part is not above its high watermark (or holds nothing that may move).
    Nothing,
}

impl<R: ReplicaIo, A: SlabAllocator> Volume<R, A> {
    pub(crate) fn gate(&self, span: u64) -> &SpanGate {
        let m = self
            .map
            .as_ref()
            .expect("only volumes with a mirror part have span gates");
        &m.gates[(span % SPAN_GATES as u64) as usize]
    }

    /// Data chunks per span (K).
    pub(crate) fn span_extents(&self) -> u64 {
        self.geometry.map_or(1, |g| u64::from(g.k()))
    }

    /// The mirror-part slabs of `span` (first and last index).
    fn span_subs(&self, span: u64) -> std::ops::RangeInclusive<SlabIndex> {
        let k = self.span_extents();
        SlabIndex::mirror_part(span * k)..=SlabIndex::mirror_part(span * k + k - 1)
    }

    /// The span's layout from this owner's map: mirror if any mirror-part slab of it is
    /// allocated (the truth even beside a parity slab), else parity if its parity slab is.
    pub(crate) fn layout(&self, span: u64) -> Option<Layout> {
        let map = self.slabs.read().expect("slab map lock poisoned");
        if map.range(self.span_subs(span)).next().is_some() {
            Some(Layout::Mirror)
        } else if map.contains_key(&SlabIndex(span)) {
            Some(Layout::Parity)
        } else {
            None
        }
    }

    /// Whether `idx` is a mirror-part slab whose span also has a parity slab (a rotation's,
    /// not flipped yet or cut): the mirror part is the span's truth only while one of its
    /// slabs exists, so such a slab is zeroed, never released, until that parity slab is
    /// gone (releasing the span's last one would make the parity slab's stale rows the
    /// span's content).
    pub(crate) fn shadows_parity(&self, idx: SlabIndex) -> bool {
        self.map.is_some()
            && idx.is_mirror_part()
            && self
                .slab(SlabIndex(idx.position() / self.span_extents()))
                .is_some()
    }

    /// Whether `idx` is a parity slab beside its span's mirror-part slabs (a rotation's
    /// leftover, cut before its flip): not the span's truth, nor what its snapshots read.
    pub(crate) fn is_leftover(&self, idx: SlabIndex) -> bool {
        self.map.is_some() && !idx.is_mirror_part() && self.layout(idx.0) == Some(Layout::Mirror)
    }

    /// The mirror part's size and use.
    pub fn mirror_part_usage(&self) -> Option<MirrorPartUsage> {
        let m = self.map.as_ref()?;
        let map = self.slabs.read().expect("slab map lock poisoned");
        let mirror = map.range(SlabIndex::mirror_part(0)..).count() as u64;
        let parity = map.len() as u64 - mirror;
        Some(MirrorPartUsage {
            limit_bytes: m.bytes,
            mirror_bytes: mirror * self.cfg.slab_size_bytes,
            parity_bytes: parity * self.slab_span(),
        })
    }

    /// Pieces of the mirror-part slabs that piece `p` of a span covers (`at` still counted
    /// from the start of the client request).
    pub(crate) fn sub_pieces(&self, p: Piece) -> impl Iterator<Item = Piece> {
        let base = p.slab.0 * self.slab_span();
        split(base + p.offset, p.len, self.cfg.slab_size_bytes).map(move |s| Piece {
            slab: SlabIndex::mirror_part(s.slab.0),
            at: p.at + s.at,
            ..s
        })
    }

    /// A write to one span of a volume with a mirror part.
    pub(crate) async fn map_write_piece(
        &self,
        g: crate::Geometry,
        p: Piece,
        data: Bytes,
    ) -> Result<(), VolumeError> {
        let _w = self.gate(p.slab.0).writes.read().await;
        let layout = match self.layout(p.slab.0) {
            Some(l) => l,
            None => self.choose_layout(p).await?,
        };
        match layout {
            Layout::Parity => self.parity_write_piece(g, p, data).await,
            Layout::Mirror => {
                let now = self.map_clock();
                let subs: Vec<Piece> = self.sub_pieces(p).collect();
                join_all_ok(subs.into_iter().map(|s| {
                    let part = data.slice((s.at - p.at) as usize..(s.at - p.at + s.len) as usize);
                    async move {
                        let slab = self.mirror_write_piece(s, part).await?;
                        slab.touched_ms.fetch_max(now, Ordering::Relaxed);
                        Ok(())
                    }
                }))
                .await
            }
        }
    }

    fn map_clock(&self) -> u64 {
        let m = self.map.as_ref().expect("a volume with a mirror part");
        // +1: 0 means "not written since this owner took the volume".
        m.origin.elapsed().as_millis() as u64 + 1
    }

    /// A span with no slab yet: the mirror while the mirror part has room for one more
    /// extent, else parity. Decided and allocated under the allocation lock, so two writes
    /// to the span decide the same.
    async fn choose_layout(&self, p: Piece) -> Result<Layout, VolumeError> {
        let _a = self.alloc_lock.lock().await;
        if let Some(l) = self.layout(p.slab.0) {
            return Ok(l);
        }
        let usage = self.mirror_part_usage().unwrap_or_default();
        if usage.mirror_bytes + self.cfg.slab_size_bytes <= usage.limit_bytes {
            let first = self
                .sub_pieces(p)
                .next()
                .expect("a piece covers a sub-slab");
            self.allocate_locked(first.slab).await?;
            Ok(Layout::Mirror)
        } else {
            self.allocate_locked(p.slab).await?;
            Ok(Layout::Parity)
        }
    }

    /// A read of one span of a volume with a mirror part.
    pub(crate) async fn map_read_piece(
        &self,
        g: crate::Geometry,
        p: Piece,
    ) -> Result<Bytes, VolumeError> {
        let _r = self.gate(p.slab.0).reads.read().await;
        match self.layout(p.slab.0) {
            None => Ok(Bytes::from(vec![0u8; p.len as usize])),
            Some(Layout::Parity) => self.parity_read_piece(g, p).await,
            Some(Layout::Mirror) => self.mirror_span_read(p).await,
        }
    }

    /// Reads piece `p` of a span held in the mirror part (never-written extents read zeros).
    pub(crate) async fn mirror_span_read(&self, p: Piece) -> Result<Bytes, VolumeError> {
        let subs: Vec<Piece> = self.sub_pieces(p).collect();
        if subs.len() == 1 {
            return self.mirror_read_piece(subs[0]).await;
        }
        let parts = join_all_ok_vec(subs.into_iter().map(|s| self.mirror_read_piece(s))).await?;
        let mut buf = BytesMut::with_capacity(p.len as usize);
        for part in parts {
            buf.extend_from_slice(&part);
        }
        Ok(buf.freeze())
    }

    /// Whether `[offset, offset + len)` of span piece `p` may hold data (block status).
    pub(crate) fn map_allocated(&self, p: Piece) -> Vec<(u64, bool)> {
        match self.layout(p.slab.0) {
            None => vec![(p.len, false)],
            Some(Layout::Parity) => vec![(p.len, true)],
            Some(Layout::Mirror) => self
                .sub_pieces(p)
                .map(|s| (s.len, self.slab(s.slab).is_some()))
                .collect(),
        }
    }

    /// A TRIM or WRITE_ZEROES of piece `p` of a span; `whole`: it covers the span whole.
    /// Holds the span's gate exclusively: it may release the span's slabs.
    pub(crate) async fn map_zero(
        &self,
        g: crate::Geometry,
        p: Piece,
        whole: bool,
        trim: bool,
    ) -> Result<(), VolumeError> {
        let _w = self.gate(p.slab.0).writes.write().await;
        if self.layout(p.slab.0).is_none() {
            // Not in this owner's map: asked of the control plane as a plain zero does (a
            // deposed owner learns it is; a parity slab another term left is taken up).
            self.known_slab(p.slab).await?;
        }
        match self.layout(p.slab.0) {
            None => Ok(()),
            Some(Layout::Mirror) => {
                // A leftover parity slab (a rotation that did not flip) goes first with a
                // whole-span zero; while one stays, no extent of the mirror part is released
                // (`shadows_parity`). Extents the zero covers whole are released, the rest
                // zeroed.
                if whole && self.slab(p.slab).is_some() {
                    self.parity_release(p.slab).await?;
                }
                for s in self.sub_pieces(p) {
                    if s.offset == 0 && s.len == self.cfg.slab_size_bytes {
                        self.release_slab(s.slab, false).await?;
                    } else {
                        self.zero_piece(s).await?;
                    }
                }
                Ok(())
            }
            Some(Layout::Parity) if whole => {
                if self.parity_release(p.slab).await? || trim {
                    return Ok(());
                }
                self.parity_zero_piece(g, p).await
            }
            // A parity span's partial TRIM is a hint it drops, as a parity volume does.
            Some(Layout::Parity) if trim => Ok(()),
            Some(Layout::Parity) => self.parity_zero_piece(g, p).await,
        }
    }

    /// One step of the rotation job: if the mirror part is above its high watermark,
    /// rotates the span written least recently into parity. Spans whose mirror-part slabs
    /// are not all settled (a copy out of sync) wait for repair. Call it again while it
    /// rotates something.
    ///
    /// `continuing`: a rotation started by the high watermark goes on down to the low one.
    ///
    /// The copy takes its bytes from `throttle` and counts them in `progress`.
    pub async fn rotate_once(
        &self,
        continuing: bool,
        throttle: &Throttle,
        progress: &Progress,
    ) -> Result<Rotated, VolumeError> {
        let Some(usage) = self.mirror_part_usage() else {
            return Ok(Rotated::Nothing);
        };
        self.discard_leftovers().await?;
        let pct = if continuing {
            ROTATE_LOW_PCT
        } else {
            ROTATE_HIGH_PCT
        };
        if usage.mirror_bytes <= usage.limit_bytes * pct / 100 {
            return Ok(Rotated::Nothing);
        }
        for span in self.spans_coldest_first() {
            if let Some(bytes) = self.rotate_span(span, throttle, progress).await? {
                return Ok(Rotated::Span { span, bytes });
            }
        }
        Ok(Rotated::Nothing)
    }

    /// Spans held in the mirror part, least recently written first.
    fn spans_coldest_first(&self) -> Vec<u64> {
        let k = self.span_extents();
        let map = self.slabs.read().expect("slab map lock poisoned");
        let mut spans: Vec<(u64, u64)> = Vec::new();
        for (idx, slab) in map.range(SlabIndex::mirror_part(0)..) {
            let span = idx.position() / k;
            let t = slab.touched_ms.load(Ordering::Relaxed);
            match spans.last_mut() {
                Some((s, last)) if *s == span => *last = (*last).max(t),
                _ => spans.push((span, t)),
            }
        }
        spans.sort_by_key(|&(span, t)| (t, span));
        spans.into_iter().map(|(s, _)| s).collect()
    }

    /// A parity slab beside a span's mirror-part slabs is what a rotation left that did not
    /// flip: the mirror holds the span's data, so the parity slab is released.
    async fn discard_leftovers(&self) -> Result<(), VolumeError> {
        let k = self.span_extents();
        let leftovers: Vec<u64> = {
            let map = self.slabs.read().expect("slab map lock poisoned");
            let mut v: Vec<u64> = map
                .range(SlabIndex::mirror_part(0)..)
                .map(|(idx, _)| idx.position() / k)
                .filter(|span| map.contains_key(&SlabIndex(*span)))
                .collect();
            v.dedup();
            v
        };
        for span in leftovers {
            let _w = self.gate(span).writes.write().await;
            if self.layout(span) == Some(Layout::Mirror) && self.slab(SlabIndex(span)).is_some() {
                log::info!(
                    "volume {}: span {span} has a parity slab from a rotation that did not finish; the mirror part holds its data, so the parity slab is released",
                    self.cfg.name
                );
                self.parity_release(SlabIndex(span)).await?;
            }
        }
        Ok(())
    }

    /// Rotates one span from the mirror part into parity; the volume bytes copied, or
    /// `None` if the span is not (or no longer) held by a settled mirror.
    pub async fn rotate_span(
        &self,
        span: u64,
        throttle: &Throttle,
        progress: &Progress,
    ) -> Result<Option<u64>, VolumeError> {
        let g = self
            .geometry
            .expect("a volume with a mirror part is a parity volume");
        // No snapshot is taken or deleted while the span moves: the copy carries them.
        let _history = self.history.lock().await;
        let gate = self.gate(span);
        let _w = gate.writes.write().await;
        let subs: Vec<(SlabIndex, Arc<Slab>)> = {
            let map = self.slabs.read().expect("slab map lock poisoned");
            map.range(self.span_subs(span))
                .map(|(i, s)| (*i, s.clone()))
                .collect()
        };
        if subs.is_empty() || !subs.iter().all(|(_, s)| settled(s)) {
            return Ok(None);
        }
        // With snapshots, the copy writes each row once at its own version (and the
        // snapshots' rows into the chunks' keeping): a parity slab left by an earlier
        // rotation goes first, so the copy starts from a new one.
        let snapshots = self.snapshots();
        if !snapshots.is_empty()
            && self.slab(SlabIndex(span)).is_some()
            && !self.parity_release(SlabIndex(span)).await?
        {
            return Ok(None);
        }
        // The parity slab: a new one is zeroed as it is taken up, so the span's extents
        // that were never written need no copy; one left by an earlier rotation is written
        // whole.
        let started = Instant::now();
        let fresh = self.slab(SlabIndex(span)).is_none();
        let parity = self.slab_or_allocate(SlabIndex(span)).await?;
        self.check_rotation_floors(g, SlabIndex(span), &parity, &snapshots)
            .await?;
        let row = g.row_bytes();
        let step = (ROTATE_STEP_BYTES / row).max(1) * row;
        let span_bytes = self.slab_span();
        progress
            .bytes_total
            .store(span_bytes * (1 + snapshots.len() as u64), Ordering::Relaxed);
        progress.bytes_done.store(0, Ordering::Relaxed);
        let mut copied = 0;
        let mut off = 0;
        while off < span_bytes {
            let len = step.min(span_bytes - off);
            let p = Piece {
                slab: SlabIndex(span),
                offset: off,
                len,
                at: 0,
            };
            off += len;
            let held = self.sub_pieces(p).any(|s| self.slab(s.slab).is_some());
            if (held || !fresh) && !snapshots.is_empty() {
                throttle.take(len).await;
                self.rotate_rows_versioned(g, p, &parity).await?;
                copied += len;
            } else if held || !fresh {
                throttle.take(len).await;
                let data = self.mirror_span_read(p).await?;
                self.parity_write_piece(g, p, data).await?;
                copied += len;
            }
            progress.bytes_done.fetch_add(len, Ordering::Relaxed);
        }
        if !snapshots.is_empty() {
            let kept = self
                .rotate_snapshots(g, span, &snapshots, throttle, progress)
                .await?;
            log::info!(
                "volume {}: span {span}: its {} snapshots' rows written into its parity chunks ({} MiB compared and copied)",
                self.cfg.name,
                snapshots.len(),
                kept >> 20
            );
        }
        // The flip: no read may be on its way to the mirror copies freed below.
        let _r = gate.reads.write().await;
        let _a = self.alloc_lock.lock().await;
        let idxs: Vec<SlabIndex> = subs.iter().map(|(i, _)| *i).collect();
        self.flip(&idxs).await?;
        let freed: Vec<(SlabIndex, Arc<[crate::ExtentLoc]>, Version)> = subs
            .iter()
            .map(|(i, s)| {
                let upto = Version(self.epoch().0 << 32 | s.seq.load(Ordering::Acquire));
                self.forget_released(*i, s);
                (*i, s.extents(), upto)
            })
            .collect();
        drop(_a);
        drop(_r);
        drop(_w);
        for (i, extents, upto) in freed {
            self.free_extents(i, &extents, upto).await;
        }
        self.counters.rotations.fetch_add(1, Ordering::Relaxed);
        self.counters
            .rotated_bytes
            .fetch_add(copied, Ordering::Relaxed);
        let secs = started.elapsed().as_secs_f64();
        log::info!(
            "volume {}: span {span} rotated from the mirror part into parity: {} MiB copied in {secs:.2} s ({:.0} MiB/s)",
            self.cfg.name,
            copied >> 20,
            copied as f64 / (1 << 20) as f64 / secs.max(1e-6)
        );
        Ok(Some(copied))
    }

    /// Deletes the span's mirror-part records in one fenced transaction. An answer that
    /// did not come leaves it unknown whether they are gone, and the span's truth is the
    /// mirror while they are not, the parity slab once they are: the delete (idempotent) is
    /// asked again until it answers, or this owner's term ends.
    async fn flip(&self, idxs: &[SlabIndex]) -> Result<(), VolumeError> {
        let mut pause = std::time::Duration::from_millis(50);
        loop {
            match self.alloc.release(self.cfg.id, idxs, self.epoch()).await {
                Ok(()) => return Ok(()),
                Err(e @ VolumeError::Fenced { .. }) => return Err(e),
                Err(e) => {
                    log::warn!(
                        "volume {}: the flip of a rotation got no answer ({e}); asking again",
                        self.cfg.name
                    );
                    self.check_serving()?;
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(std::time::Duration::from_secs(1));
                }
            }
        }
    }
}

/// Every copy in sync and nothing left to reconcile: a slab that may be copied from and
/// freed.
fn settled(s: &Slab) -> bool {
    s.extents().iter().all(|e| e.state == ExtentState::InSync)
        && !s.suspect.load(Ordering::Acquire)
        && !s.unsure.load(Ordering::Acquire)
        && crate::abandoned_none(s)
}
