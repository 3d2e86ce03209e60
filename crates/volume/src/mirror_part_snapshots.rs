//! Snapshots of mirror-accelerated parity volumes (docs/adr/0009 and 0012, docs/SNAPSHOTS.md
//! "Mirror-accelerated parity"). A span is held in one layout at a time, and the slabs of
//! either layout keep what the snapshots read as any mirror or parity slab does, so a
//! snapshot read (or a change) of a span goes to the layout the span has now:
//! * a span no slab holds reads zeros at every snapshot;
//! * a span's slabs allocated after a snapshot read zeros there (`floor_new_slab`);
//! * a span held in the mirror part at a snapshot and rotated into parity since: the
//!   rotation wrote that snapshot's rows into the parity chunks before its flip freed the
//!   mirror-part copies that kept them ([`Volume::rotate_rows_versioned`],
//!   [`Volume::rotate_snapshots`]).
//!
//! A rotation's row gets, at each snapshot and live, the newest version of its K blocks in
//! the mirror part there. A block written after a snapshot has an epoch above it, so a row's
//! version differs between two snapshots (or a snapshot and now) exactly when one of its
//! blocks does: changes stay exact across a rotation. A row unchanged since the newest
//! snapshot is written live at its old version, which that snapshot reads as it is: the
//! parity chunks keep a copy only of what changed.

use super::*;
use crate::mirror_part::Layout;
use crate::parity_io::BSZ;
use crate::resync::{Progress, Throttle};

impl<R: ReplicaIo, A: SlabAllocator> Volume<R, A> {
    /// A snapshot read of one span of a volume with a mirror part (held against a flip).
    pub(crate) async fn map_read_at_piece(
        &self,
        snapshot: Epoch,
        p: Piece,
    ) -> Result<Bytes, VolumeError> {
        let _r = self.gate(p.slab.0).reads.read().await;
        match self.layout(p.slab.0) {
            None => Ok(Bytes::from(vec![0u8; p.len as usize])),
            Some(Layout::Parity) => self.read_at_piece(snapshot, p).await,
            Some(Layout::Mirror) => self.mirror_span_read_at(snapshot, p).await,
        }
    }

    /// Piece `p` of a span held in the mirror part, as snapshot `snapshot` reads it.
    async fn mirror_span_read_at(&self, snapshot: Epoch, p: Piece) -> Result<Bytes, VolumeError> {
        let mut buf = BytesMut::with_capacity(p.len as usize);
        for s in self.sub_pieces(p) {
            buf.extend_from_slice(&self.read_at_piece(snapshot, s).await?);
        }
        Ok(buf.freeze())
    }

    /// Which blocks of span piece `p` changed between `from` and `to` (None: now), from
    /// the layout the span has now.
    pub(crate) async fn map_changed_piece(
        &self,
        g: Geometry,
        from: Epoch,
        to: Option<Epoch>,
        p: Piece,
    ) -> Result<Vec<u64>, VolumeError> {
        let _r = self.gate(p.slab.0).reads.read().await;
        let blocks = (p.len / BS) as usize;
        let mut bits = vec![0u64; blocks.div_ceil(64)];
        match self.layout(p.slab.0) {
            None => {}
            Some(Layout::Parity) => {
                if let Some(slab) = self.slab(p.slab) {
                    bits = self.parity_changed_piece(g, &slab, from, to, p).await?;
                }
            }
            Some(Layout::Mirror) => {
                for s in self.sub_pieces(p) {
                    let Some(slab) = self.slab(s.slab) else {
                        continue;
                    };
                    let got = self.changed_piece(&slab, from, to, s).await?;
                    let base = ((s.at - p.at) / BS) as usize;
                    for i in 0..(s.len / BS) as usize {
                        if got[i / 64] >> (i % 64) & 1 == 1 {
                            let j = base + i;
                            bits[j / 64] |= 1 << (j % 64);
                        }
                    }
                }
            }
        }
        Ok(bits)
    }

    /// The span indexes that hold slabs (a volume with a mirror part: a span once however
    /// many of its slabs exist).
    pub(crate) fn spans_allocated(&self) -> Vec<u64> {
        let k = self.span_extents();
        let mut spans: Vec<u64> = self
            .slabs
            .read()
            .expect("slab map lock poisoned")
            .keys()
            .map(|i| match i.is_mirror_part() {
                true => i.position() / k,
                false => i.0,
            })
            .collect();
        spans.sort_unstable();
        spans.dedup();
        spans
    }

    /// The version of each block of span piece `p` in the mirror part, at `at` (None:
    /// now): 0 for a block never written there (an extent with no slab included). Metadata
    /// only, from one in-sync copy of each mirror-part slab.
    async fn mirror_versions(
        &self,
        p: Piece,
        at: Option<Epoch>,
    ) -> Result<Vec<Version>, VolumeError> {
        let mut out = Vec::with_capacity((p.len / BS) as usize);
        for s in self.sub_pieces(p) {
            let count = (s.len / BS) as usize;
            let Some(slab) = self.slab(s.slab) else {
                out.resize(out.len() + count, Version(0));
                continue;
            };
            let (key, offset) = (self.key(s.slab), s.offset);
            let got = self
                .ask_in_turn(
                    &slab,
                    s.slab,
                    || match at {
                        Some(snapshot) => ExtentOp::VersionsAt {
                            key,
                            epoch: self.epoch(),
                            snapshot,
                            offset,
                            count: count as u32,
                            any: false,
                        },
                        None => ExtentOp::Versions {
                            key,
                            epoch: self.epoch(),
                            offset,
                            count: count as u32,
                        },
                    },
                    ExtentReply::into_versions,
                    |v| match v.len() == count {
                        true => Ok(v),
                        false => Err("a short answer".into()),
                    },
                )
                .await?;
            out.extend(got);
        }
        Ok(out)
    }

    /// A row's version in the parity chunks: the newest of its K blocks' (0: none of them
    /// was ever written).
    fn row_versions(&self, g: Geometry, blocks: &[Version]) -> Vec<Version> {
        blocks
            .chunks(usize::from(g.k()))
            .map(|row| row.iter().copied().max().unwrap_or(Version(0)))
            .collect()
    }

    /// Before a rotation's copy while the volume has snapshots: every chunk of the span's
    /// new parity slab must hold them all, as `floor_new_slab` placed it (its floor the
    /// newest, each reading as never written before the slab existed). A chunk whose floor
    /// was not set then (an answer lost, a node away) stops the rotation here: the span
    /// stays in the mirror part, and the next pass releases this slab and places another.
    /// Asked of each chunk with a one-block `VersionsAt` of the oldest and the newest
    /// snapshot, which a chunk that does not hold them refuses.
    pub(crate) async fn check_rotation_floors(
        &self,
        g: Geometry,
        idx: SlabIndex,
        slab: &Slab,
        snapshots: &[Epoch],
    ) -> Result<(), VolumeError> {
        let (Some(&oldest), Some(&newest)) = (snapshots.first(), snapshots.last()) else {
            return Ok(());
        };
        let ex = self.chunks(g, idx, slab)?;
        join_all_ok(ex.iter().map(|&at| async move {
            for s in [oldest, newest] {
                let op = ExtentOp::VersionsAt {
                    key: self.key(idx),
                    epoch: self.epoch(),
                    snapshot: s,
                    offset: 0,
                    count: 1,
                    any: false,
                };
                self.ask(at, op, ExtentReply::into_versions)
                    .await
                    .map_err(|e| match e {
                        ReplicaError::StaleEpoch(_) => self.replica_failed(idx, at, e),
                        e => self.replica_failed(
                            idx,
                            at,
                            ReplicaError::Io(format!(
                                "the new parity chunk does not hold the volume's snapshots \
                                 ({e}); the span stays in the mirror part for now"
                            )),
                        ),
                    })?;
            }
            Ok(())
        }))
        .await
    }

    /// The rotation's copy of span piece `p` (whole rows) while the volume has snapshots:
    /// each row written once to every chunk of the span's new parity slab, at its version
    /// in the mirror part ([`Volume::row_versions`]) with a compare-and-set on what the
    /// chunk holds; rows never written are left as the slab was taken up (zeros). The
    /// caller holds the span's writes.
    pub(crate) async fn rotate_rows_versioned(
        &self,
        g: Geometry,
        p: Piece,
        slab: &Slab,
    ) -> Result<(), VolumeError> {
        let rows = self.row_versions(g, &self.mirror_versions(p, None).await?);
        if rows.iter().all(|v| v.0 == 0) {
            return Ok(());
        }
        let data = self.mirror_span_read(p).await?;
        let enc = self.encode_rows(g, p.slab, &data)?;
        let r0 = p.offset / g.row_bytes();
        let ex = self.chunks(g, p.slab, slab)?;
        let cb = rows.len() * BSZ;
        join_all_ok(ex.iter().enumerate().map(|(c, &at)| {
            let chunk = enc.slice(c * cb..(c + 1) * cb);
            let rows = &rows;
            async move {
                let have = self
                    .chunk_versions(p.slab, at, r0, rows.len(), None)
                    .await?;
                for (i, j) in runs(rows.len(), |i| rows[i].0 != 0) {
                    let data = chunk.slice(i * BSZ..j * BSZ);
                    let op = ExtentOp::WriteBlocks {
                        key: self.key(p.slab),
                        epoch: self.epoch(),
                        offset: (r0 + i as u64) * BS,
                        crcs: block_crcs(&data),
                        versions: rows[i..j].to_vec(),
                        expect: have[i..j].to_vec(),
                        data,
                        codec: converge_types::Compression::None,
                    };
                    let n = self
                        .ask(at, op, ExtentReply::into_written)
                        .await
                        .map_err(|e| self.replica_failed(p.slab, at, e))?;
                    if n as usize != j - i {
                        return Err(self.copy_error(
                            p.slab,
                            format!(
                                "the chunk on node {} drive {} changed during the rotation",
                                at.node, at.drive
                            ),
                        ));
                    }
                }
                Ok(())
            }
        }))
        .await?;
        // The slab's next row write must carry a newer version than any copied here.
        let epoch = self.epoch().0;
        for v in rows.iter().filter(|v| v.0 >> 32 == epoch) {
            slab.seq.fetch_max(v.0 & 0xffff_ffff, Ordering::AcqRel);
        }
        Ok(())
    }

    /// Each row's version on one chunk, at `at` (None: now; a snapshot: what the chunk
    /// reads there so far).
    async fn chunk_versions(
        &self,
        idx: SlabIndex,
        at: ExtentLoc,
        r0: u64,
        n: usize,
        snapshot: Option<Epoch>,
    ) -> Result<Vec<Version>, VolumeError> {
        let (key, epoch, offset, count) = (self.key(idx), self.epoch(), r0 * BS, n as u32);
        let op = match snapshot {
            Some(snapshot) => ExtentOp::VersionsAt {
                key,
                epoch,
                snapshot,
                offset,
                count,
                any: true,
            },
            None => ExtentOp::Versions {
                key,
                epoch,
                offset,
                count,
            },
        };
        let v = self
            .ask(at, op, ExtentReply::into_versions)
            .await
            .map_err(|e| self.replica_failed(idx, at, e))?;
        if v.len() != n {
            return Err(self.replica_failed(idx, at, ReplicaError::Io("a short answer".into())));
        }
        Ok(v)
    }

    /// After a rotation's copy of span `span` into its new parity slab, and before the
    /// flip: each snapshot's rows, newest first, as the mirror part reads them there, into
    /// the keeping of every chunk that reads them otherwise (`WriteShadow`; a shadow also
    /// answers older snapshots' reads of the rows it holds, so most rows are written once).
    /// A snapshot the mirror part cannot give whole (a block bad on every copy) fails the
    /// rotation: the span stays in the mirror part, which holds it. The caller holds
    /// `history` and the span's writes.
    pub(crate) async fn rotate_snapshots(
        &self,
        g: Geometry,
        span: u64,
        snapshots: &[Epoch],
        throttle: &Throttle,
        progress: &Progress,
    ) -> Result<u64, VolumeError> {
        let idx = SlabIndex(span);
        let slab = self
            .slab(idx)
            .ok_or_else(|| self.copy_error(idx, "the rotation's parity slab is gone".into()))?;
        let ex = self.chunks(g, idx, &slab)?;
        let row = g.row_bytes();
        let step = (ROTATE_SNAPSHOT_STEP_BYTES / row).max(1) * row;
        let span_bytes = self.slab_span();
        let mut copied = 0;
        for &s in snapshots.iter().rev() {
            let mut off = 0;
            while off < span_bytes {
                let len = step.min(span_bytes - off);
                let p = Piece {
                    slab: idx,
                    offset: off,
                    len,
                    at: 0,
                };
                let r0 = off / row;
                off += len;
                progress.bytes_done.fetch_add(len, Ordering::Relaxed);
                let want = self.row_versions(g, &self.mirror_versions(p, Some(s)).await?);
                let have = join_all_ok_vec(
                    ex.iter()
                        .map(|&at| self.chunk_versions(idx, at, r0, want.len(), Some(s))),
                )
                .await?;
                if have.iter().all(|h| *h == want) {
                    continue;
                }
                throttle.take(len).await;
                let data = self.mirror_span_read_at(s, p).await?;
                let enc = self.encode_rows(g, idx, &data)?;
                let cb = want.len() * BSZ;
                copied += len;
                join_all_ok(ex.iter().zip(&have).enumerate().map(|(c, (&at, have))| {
                    let chunk = enc.slice(c * cb..(c + 1) * cb);
                    let want = &want;
                    async move {
                        for (i, j) in runs(want.len(), |i| have[i] != want[i]) {
                            let data = chunk.slice(i * BSZ..j * BSZ);
                            let op = ExtentOp::WriteShadow {
                                key: self.key(idx),
                                epoch: self.epoch(),
                                snapshot: s,
                                offset: (r0 + i as u64) * BS,
                                crcs: block_crcs(&data),
                                versions: want[i..j].to_vec(),
                                data,
                            };
                            self.ask(at, op, ExtentReply::into_written)
                                .await
                                .map_err(|e| self.replica_failed(idx, at, e))?;
                        }
                        Ok(())
                    }
                }))
                .await?;
            }
        }
        Ok(copied)
    }
}

/// Bytes of a span a rotation compares (and copies where they differ) per snapshot step.
const ROTATE_SNAPSHOT_STEP_BYTES: u64 = 4 << 20;

/// The runs `[i, j)` of `0..n` where `pick` holds.
pub(crate) fn runs(n: usize, pick: impl Fn(usize) -> bool) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < n {
        if !pick(i) {
            i += 1;
            continue;
        }
        let mut j = i + 1;
        while j < n && pick(j) {
            j += 1;
        }
        out.push((i, j));
        i = j;
    }
    out
}
