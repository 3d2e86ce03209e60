//! Clones at the owner (docs/adr/0012 step 5, docs/SNAPSHOTS.md "Clones"). A clone is a
//! volume whose never-written blocks read as its parent snapshot does: its copies start
//! empty (creating one copies nothing), a block the clone writes, trims or zeroes is its
//! own from then on, and the rest is read from the parent through [`ParentRead`]. Which
//! blocks are its own comes with the data, in one answer from one copy (each block's
//! version: 0 is never written), so a write racing a read gives the old content (the
//! parent's) or the new, never zeros. Flattening copies what is still the parent's into the
//! clone.
//!
//! Supported: mirror and simple clones, unencrypted and uncompressed (the parent's data
//! comes in plain).

use super::*;
use std::pin::Pin;

/// Reads a clone's parent snapshot (the node reads it through the parent's owner).
pub trait ParentRead: Send + Sync + 'static {
    /// `[offset, offset + len)` of the parent snapshot, `len` at most [`MAX_IO_BYTES`];
    /// zeros past its end.
    fn read(
        &self,
        offset: u64,
        len: u64,
    ) -> Pin<Box<dyn Future<Output = Result<Bytes, VolumeError>> + Send + '_>>;
    /// `VOLUME@SNAPSHOT`, for messages.
    fn name(&self) -> String;
}

impl<R: ReplicaIo, A: SlabAllocator> Volume<R, A> {
    /// The clone's parent, if this volume is one (not yet flattened).
    pub fn parent(&self) -> Option<Arc<dyn ParentRead>> {
        self.parent.read().expect("parent lock").clone()
    }

    /// Makes this volume a clone of `parent` (when its owner opens it), or no longer one
    /// (flattened).
    pub fn set_parent(&self, parent: Option<Arc<dyn ParentRead>>) {
        *self.parent.write().expect("parent lock") = parent;
    }

    /// Reads `len` bytes at `vol_off` from the parent for slab `slab`: a parent that
    /// cannot be read makes the clone's piece unreadable (the client gets an I/O error
    /// for it), not its owner's term over (which would drop and reopen the clone's
    /// exports for nothing).
    async fn parent_read(
        &self,
        parent: &Arc<dyn ParentRead>,
        slab: SlabIndex,
        vol_off: u64,
        len: u64,
    ) -> Result<Bytes, VolumeError> {
        parent
            .read(vol_off, len)
            .await
            .map_err(|e| VolumeError::Unreadable {
                volume: self.cfg.name.clone(),
                slab,
                why: format!("its parent could not be read: {e}"),
            })
    }

    /// The blocks of piece `p` that were never written (as of snapshot `at`), from one
    /// in-sync copy, this node's first.
    async fn absent_bits(
        &self,
        slab: &Slab,
        p: Piece,
        at: Option<Epoch>,
    ) -> Result<Vec<u64>, VolumeError> {
        let key = self.key(p.slab);
        self.ask_in_turn(
            slab,
            p.slab,
            || ExtentOp::Absent {
                key,
                epoch: self.epoch(),
                at,
                offset: p.offset,
                count: (p.len / BS) as u32,
            },
            ExtentReply::into_bitmap,
            Ok,
        )
        .await
    }

    /// One piece of a clone's read (now, or at its snapshot `at`): its own blocks from its
    /// copies, the others from the parent.
    pub(crate) async fn clone_read_piece(
        &self,
        parent: &Arc<dyn ParentRead>,
        p: Piece,
        at: Option<Epoch>,
    ) -> Result<Bytes, VolumeError> {
        let vol_off = p.slab.0 * self.slab_span() + p.offset;
        let Some(slab) = self.slab(p.slab) else {
            return self.parent_read(parent, p.slab, vol_off, p.len).await;
        };
        let n = (p.len / BS) as usize;
        let (own, absent) = match at {
            None => {
                let reply = self.own_blocks(&slab, p).await?;
                let absent: Vec<bool> = reply.versions.iter().map(|v| v.0 == 0).collect();
                (reply.data, absent)
            }
            Some(g) => {
                // A snapshot's blocks do not change: which are the clone's may be asked
                // of one copy and the data read from another.
                let bits = self.absent_bits(&slab, p, at).await?;
                let absent: Vec<bool> = (0..n).map(|i| bits[i / 64] >> (i % 64) & 1 == 1).collect();
                if absent.iter().all(|&a| a) {
                    return self.parent_read(parent, p.slab, vol_off, p.len).await;
                }
                (self.read_at_piece(g, p).await?, absent)
            }
        };
        if !absent.iter().any(|&a| a) {
            return Ok(own);
        }
        let from_parent = self.parent_read(parent, p.slab, vol_off, p.len).await?;
        if absent.iter().all(|&a| a) {
            return Ok(from_parent);
        }
        let mut buf = BytesMut::from(&own[..]);
        let b = BS as usize;
        for i in (0..n).filter(|&i| absent[i]) {
            buf[i * b..(i + 1) * b].copy_from_slice(&from_parent[i * b..(i + 1) * b]);
        }
        Ok(buf.freeze())
    }

    /// Piece `p` of a clone as it is now, with each block's version, from one in-sync copy
    /// (this node's first): a block that copy never wrote (version 0) is the parent's. The
    /// data and which blocks are the clone's come in one answer: asked of two copies, a
    /// write in flight could have reached the one and not the other, and a block would
    /// read as neither the parent's nor the write's, but as zeros. A copy with a bad or
    /// suspect block there is passed over; if every copy has one, the ordinary read
    /// repairs it from a sound copy first.
    async fn own_blocks(&self, slab: &Slab, p: Piece) -> Result<BlocksReply, VolumeError> {
        let key = self.key(p.slab);
        let ask = || {
            self.ask_in_turn(
                slab,
                p.slab,
                || ExtentOp::ReadBlocks {
                    key,
                    epoch: self.epoch(),
                    offset: p.offset,
                    len: p.len as u32,
                },
                ExtentReply::into_blocks,
                |r: BlocksReply| {
                    if r.bad_blocks.is_empty() && r.suspect.is_empty() {
                        Ok(r)
                    } else {
                        Err("a bad or suspect block".to_string())
                    }
                },
            )
        };
        match ask().await {
            Ok(r) => Ok(r),
            Err(VolumeError::Unreadable { .. }) => {
                self.read_with_retries(p.slab, || self.mirror_read_round(p, slab))
                    .await?;
                ask().await
            }
            Err(e) => Err(e),
        }
    }

    /// Copies every block that is still the parent's into the clone, piece by piece, each
    /// with the slab's writes held (so a client write is never overwritten by the parent's
    /// older content); ranges of zeros in the parent are left (a never-written block reads
    /// zeros once the parent is gone). Refused while the clone has snapshots (they read
    /// their never-written blocks from the parent too). Returns the bytes copied; the caller
    /// then drops the parent link. Safe to run again after a crash: only absent blocks are
    /// written.
    pub async fn flatten(&self) -> Result<u64, VolumeError> {
        let Some(parent) = self.parent() else {
            return Ok(0);
        };
        self.check_serving()?;
        if !self.snapshots().is_empty() {
            return Err(VolumeError::Snapshot {
                volume: self.cfg.name.clone(),
                why: "a clone with snapshots cannot be flattened (they read from the parent \
                      too): delete its snapshots first"
                    .into(),
            });
        }
        let piece = 4u64 << 20;
        let size = self.size_bytes();
        let mut copied = 0;
        let mut off = 0;
        while off < size {
            let len = (size - off)
                .min(piece)
                .min(self.slab_span() - off % self.slab_span());
            let p = split(off, len, self.slab_span())
                .next()
                .expect("a non-empty range has a piece");
            let data = self.parent_read(&parent, p.slab, off, len).await?;
            if data.iter().any(|&x| x != 0) {
                copied += self.flatten_piece(p, &data).await?;
            }
            off += len;
        }
        self.check_serving()?;
        Ok(copied)
    }

    async fn flatten_piece(&self, p: Piece, data: &Bytes) -> Result<u64, VolumeError> {
        let slab = loop {
            let slab = self.slab_or_allocate(p.slab).await?;
            self.wait_min_replicas(p.slab, &slab).await?;
            if !slab.is_released() {
                break slab;
            }
        };
        let _gate = slab.gate.write().await;
        let bits = self.absent_bits(&slab, p, None).await?;
        let n = (p.len / BS) as usize;
        let absent = |i: usize| bits[i / 64] >> (i % 64) & 1 == 1;
        let b = BS as usize;
        let mut copied = 0;
        let mut i = 0;
        while i < n {
            if !absent(i) || data[i * b..(i + 1) * b].iter().all(|&x| x == 0) {
                i += 1;
                continue;
            }
            let first = i;
            while i < n && absent(i) && data[i * b..(i + 1) * b].iter().any(|&x| x != 0) {
                i += 1;
            }
            let run = data.slice(first * b..i * b);
            let at = Piece {
                slab: p.slab,
                offset: p.offset + first as u64 * BS,
                len: run.len() as u64,
                at: 0,
            };
            self.write_gated(&slab, at, run).await?;
            copied += ((i - first) * b) as u64;
        }
        Ok(copied)
    }
}
