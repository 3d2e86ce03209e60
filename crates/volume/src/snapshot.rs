//! Snapshots at the owner (docs/adr/0012, docs/SNAPSHOTS.md). A snapshot closes the owner's
//! epoch `e`: with every write drained and none admitted, each copy's snapshot floor is set
//! to `e`, the control plane records the snapshot and moves the owner on to `e + 1` (one
//! compare-and-swap, which also proves this node still owns the volume), and writes resume
//! at the new epoch. Every write acked before it has an epoch at most `e` and is in it; every
//! write after has `e + 1` and is not. Nothing is copied: the copies' engines keep the
//! states a snapshot reads when later writes replace them.
//!
//! Supported here: mirror and simple volumes, compressed or not (a copy keeps a state of
//! a compressed group by copying it out of the group's stream), and parity volumes (their
//! chunks' priors settled before the floors; reads and changes in
//! `parity_snapshots.rs`), and mirror-accelerated parity volumes (a span's snapshots are
//! read from the layout it has now; a rotation carries them: `mirror_part_snapshots.rs`).

use super::*;
use converge_types::FloorHistory;

/// The most [`Volume::changed`] answers in one call: 4 GiB, a 128 KiB bitmap.
pub const CHANGES_MAX_BYTES: u64 = 4 << 30;

/// What the drives keep for one snapshot ([`Volume::snapshot_space`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotSpace {
    pub snapshot: Epoch,
    /// Bytes the drives keep for it, on every copy and chunk.
    pub kept_bytes: u64,
    /// Of those, the bytes deleting it would free (the rest the next older snapshot
    /// also reads, and keeps).
    pub freed_by_delete_bytes: u64,
}

impl<R: ReplicaIo, A: SlabAllocator> Volume<R, A> {
    /// What the drives keep for each snapshot (oldest first), summed over every copy and
    /// chunk that takes writes (metadata only: one `KeptBlocks` per copy). Returns the
    /// figures and how many copies did not answer (their share is missing).
    pub async fn snapshot_space(&self) -> Result<(Vec<SnapshotSpace>, u64), VolumeError> {
        self.check_serving()?;
        let snaps = self.snapshots();
        let mut out: Vec<SnapshotSpace> = snaps
            .iter()
            .map(|&snapshot| SnapshotSpace {
                snapshot,
                kept_bytes: 0,
                freed_by_delete_bytes: 0,
            })
            .collect();
        if snaps.is_empty() {
            return Ok((out, 0));
        }
        let targets = self.writable_copies();
        let mut unanswered = 0;
        // A bounded number of questions in flight at a time.
        for batch in targets.chunks(64) {
            let answers = join_all(
                batch
                    .iter()
                    .map(|&(idx, at)| {
                        let op = ExtentOp::KeptBlocks {
                            key: self.key(idx),
                            epoch: self.epoch(),
                            snapshots: snaps.clone(),
                        };
                        self.ask(at, op, ExtentReply::into_counts)
                    })
                    .collect(),
            )
            .await;
            for a in answers {
                match a {
                    Ok(c) if c.len() == 2 * snaps.len() => {
                        for (o, pair) in out.iter_mut().zip(c.chunks_exact(2)) {
                            o.kept_bytes += pair[0] * BS;
                            o.freed_by_delete_bytes += pair[1] * BS;
                        }
                    }
                    Err(ReplicaError::StaleEpoch(w)) => return Err(self.fenced(w)),
                    _ => unanswered += 1,
                }
            }
        }
        Ok((out, unanswered))
    }

    /// Every copy (or chunk) of every slab that takes writes, with its slab.
    fn writable_copies(&self) -> Vec<(SlabIndex, ExtentLoc)> {
        self.slabs
            .read()
            .expect("slab map lock poisoned")
            .iter()
            .flat_map(|(i, s)| writable(&s.extents()).into_iter().map(move |at| (*i, at)))
            .collect()
    }

    /// The volume's snapshots (their epochs, oldest first), as this owner knows them.
    pub fn snapshots(&self) -> Vec<Epoch> {
        self.snapshots.lock().expect("snapshot list lock").clone()
    }

    /// Sets the snapshot list from the volume's record (when the owner takes the volume).
    pub fn set_snapshots(&self, mut epochs: Vec<Epoch>) {
        epochs.sort_unstable();
        *self.snapshots.lock().expect("snapshot list lock") = epochs;
    }

    pub(crate) fn snapshot_error(&self, why: impl Into<String>) -> VolumeError {
        VolumeError::Snapshot {
            volume: self.cfg.name.clone(),
            why: why.into(),
        }
    }

    /// Takes a snapshot. `commit(e)` records it in the control plane as the snapshot of
    /// epoch `e` and grants this owner its next epoch, which it returns; it runs with
    /// every write drained and none admitted, after every copy that takes writes has its
    /// floor at `e`. Returns the snapshot's epoch. A failure leaves the volume as it was
    /// (the floors set are dropped again, best effort), except when `commit` cannot tell
    /// whether it applied ([`VolumeError::Control`]: the control plane's answer was lost):
    /// then the snapshot may exist, so this owner must not write at `e` again; it stops
    /// serving (clients re-route, and the next owner's epoch is above both).
    pub async fn snapshot<F, Fut>(&self, commit: F) -> Result<Epoch, VolumeError>
    where
        F: FnOnce(Epoch) -> Fut,
        Fut: Future<Output = Result<Epoch, VolumeError>>,
    {
        self.snapshot_noted(|_| std::future::ready(Ok(())), commit)
            .await
    }

    /// [`Volume::snapshot`], with `note(e)` run first, before any copy's floor is set and
    /// before writes pause: it records in the control plane that a snapshot of epoch `e`
    /// is being taken (the volume record's `stray_floors`), so that if the snapshot is
    /// neither recorded nor undone everywhere, a later term releases the floors it left
    /// ([`Volume::release_stray_floors`]). A failed `note` takes no snapshot.
    pub async fn snapshot_noted<N, NFut, F, Fut>(
        &self,
        note: N,
        commit: F,
    ) -> Result<Epoch, VolumeError>
    where
        N: FnOnce(Epoch) -> NFut,
        NFut: Future<Output = Result<(), VolumeError>>,
        F: FnOnce(Epoch) -> Fut,
        Fut: Future<Output = Result<Epoch, VolumeError>>,
    {
        self.check_serving()?;
        // No fill copies snapshots meanwhile, no slab is allocated and no write runs: every
        // slab's gate, in order (a write holds one gate per piece; pieces of one write take
        // them independently).
        let _history = self.history.lock().await;
        // The epoch moves only under `history`: this is the snapshot's.
        note(self.epoch()).await?;
        let _alloc = self.alloc_lock.lock().await;
        let slabs: Vec<(SlabIndex, Arc<Slab>)> = self
            .slabs
            .read()
            .expect("slab map lock poisoned")
            .iter()
            .map(|(i, s)| (*i, s.clone()))
            .collect();
        let mut gates = Vec::with_capacity(slabs.len());
        for (_, s) in &slabs {
            gates.push(s.gate.write().await);
        }
        self.check_serving()?;
        // Parity chunks hold priors until their rows settle: none may outlive the floor.
        self.settle_for_snapshot(&slabs).await?;
        let e = self.epoch();
        let previous = self.snapshots().last().copied();
        let targets: Vec<(SlabIndex, ExtentLoc)> = slabs
            .iter()
            .flat_map(|(i, s)| writable(&s.extents()).into_iter().map(move |at| (*i, at)))
            .collect();
        let floors = join_all(
            targets
                .iter()
                .map(|&(idx, at)| {
                    // A copy still being filled may lack what the snapshot holds (its
                    // resync races the writes): it holds snapshots only from a later one.
                    let history = if at.state == ExtentState::InSync {
                        FloorHistory::Continues
                    } else {
                        FloorHistory::Joining
                    };
                    let op = ExtentOp::SnapshotFloor {
                        key: self.key(idx),
                        epoch: e,
                        snapshot: e,
                        previous,
                        history,
                    };
                    self.ask(at, op, ExtentReply::into_ok)
                })
                .collect(),
        )
        .await;
        let failed: Vec<String> = targets
            .iter()
            .zip(&floors)
            .filter_map(|((idx, at), r)| {
                r.as_ref()
                    .err()
                    .map(|err| format!("slab {idx} node {} drive {}: {err}", at.node, at.drive))
            })
            .collect();
        // Drops the floor again where it was set; returns the copies it could not reach.
        let undo = |set: Vec<(SlabIndex, ExtentLoc)>| async move {
            let below = self.snapshots().last().copied();
            let r = join_all(
                set.iter()
                    .map(|&(idx, at)| {
                        let op = ExtentOp::DropSnapshot {
                            key: self.key(idx),
                            epoch: e,
                            snapshot: e,
                            below,
                        };
                        self.ask(at, op, ExtentReply::into_ok)
                    })
                    .collect(),
            )
            .await;
            set.into_iter()
                .zip(r)
                .filter(|(_, r)| r.is_err())
                .map(|(t, _)| t)
                .collect::<Vec<_>>()
        };
        let set: Vec<(SlabIndex, ExtentLoc)> = targets
            .iter()
            .zip(&floors)
            .filter(|(_, r)| r.is_ok())
            .map(|(t, _)| *t)
            .collect();
        if !failed.is_empty() {
            // A refusal (no room, busy, fenced) set nothing; a lost answer or a drive
            // error mid-way may have.
            let mut unsure: Vec<(SlabIndex, ExtentLoc)> = targets
                .iter()
                .zip(&floors)
                .filter(|(_, r)| {
                    matches!(r, Err(ReplicaError::Unreachable(_) | ReplicaError::Io(_)))
                })
                .map(|(t, _)| *t)
                .collect();
            unsure.extend(undo(set).await);
            self.forget_floors(&slabs, unsure).await;
            return Err(self.snapshot_error(format!(
                "no snapshot taken: {} of {} copies could not start keeping it ({})",
                failed.len(),
                targets.len(),
                failed.join("; ")
            )));
        }
        let next = match commit(e).await {
            Ok(n) => n,
            Err(err @ VolumeError::Control(..)) => {
                self.retire();
                return Err(err);
            }
            Err(err) => {
                let unsure = undo(set).await;
                self.forget_floors(&slabs, unsure).await;
                return Err(err);
            }
        };
        if next.0 <= e.0 {
            return Err(self.snapshot_error(format!(
                "the control plane granted epoch {next} after snapshot epoch {e}"
            )));
        }
        self.epoch.store(next.0, Ordering::Release);
        {
            let mut l = self.snapshots.lock().expect("snapshot list lock");
            l.push(e);
            l.sort_unstable();
        }
        drop(gates);
        Ok(e)
    }

    /// After a snapshot that was not taken: the copies that may still hold its floor (the
    /// floor's answer or its undo was lost). Such a copy takes writes at this epoch for
    /// the snapshot's own, and would not keep for the older snapshots what they overwrite
    /// (the owner goes on writing at this epoch): each goes stale, and its fill sets its
    /// snapshots anew. If that cannot be recorded, this owner stops serving: the next
    /// term writes at a higher epoch, which keeps what the older snapshots read on it (the
    /// next snapshot then drops the stray floor, `FloorHistory::Continues`).
    async fn forget_floors(
        &self,
        slabs: &[(SlabIndex, Arc<Slab>)],
        unsure: Vec<(SlabIndex, ExtentLoc)>,
    ) {
        for (idx, at) in unsure {
            let Some((_, slab)) = slabs.iter().find(|(i, _)| *i == idx) else {
                continue;
            };
            let others = slab
                .extents()
                .iter()
                .filter(|e| e.state == ExtentState::InSync && e.drive != at.drive)
                .count();
            let last = others == 0 && at.state == ExtentState::InSync;
            let r = match last {
                // The slab's last in-sync copy stays so.
                true => Err(self.copy_error(idx, "it is the slab's last in-sync copy".into())),
                false => self.mark_stale(idx, slab, at.drive).await,
            };
            match r {
                Ok(()) => log::warn!(
                    "volume {}: slab {idx}: the copy on node {} drive {} may hold the floor of a snapshot that was not taken; marked stale",
                    self.cfg.name,
                    at.node,
                    at.drive
                ),
                Err(err) => {
                    log::warn!(
                        "volume {}: slab {idx}: the copy on node {} drive {} may hold the floor of a snapshot that was not taken, and cannot be marked stale ({err}): stopping serving",
                        self.cfg.name,
                        at.node,
                        at.drive
                    );
                    self.retire();
                    return;
                }
            }
        }
    }

    /// Releases the floors and states that copies may keep for epochs that are no
    /// snapshot of the volume (`strays`: the volume record's stray floors — snapshots
    /// begun and never recorded, snapshots deleted while a copy was out of sync;
    /// docs/SNAPSHOTS.md, "Stray floors"). Each is dropped from every copy that takes
    /// writes as the newest snapshot is deleted: what the volume's snapshots read stays
    /// with them, the rest is freed (a copy that does not hold it answers Ok). Returns the
    /// epochs the caller may settle in the record: those dropped everywhere, if every copy
    /// of the volume is in sync (a copy out of sync did not get the drops; its fill or a
    /// later release does), and any that turned out to be a snapshot of the volume.
    pub async fn release_stray_floors(&self, strays: &[Epoch]) -> Vec<Epoch> {
        let mut settled = Vec::new();
        let mut dropped = Vec::new();
        for &s in strays {
            if self.snapshots().contains(&s) {
                settled.push(s);
                continue;
            }
            if s >= self.epoch() {
                // This term's own: its snapshot at this epoch may still be taken (which
                // makes such a floor the snapshot's), else the next term releases it.
                continue;
            }
            match self.drop_snapshot(s).await {
                Ok(()) => dropped.push(s),
                Err(e) => log::warn!(
                    "volume {}: what the copies keep for epoch {s}, no snapshot of the volume, is not released yet: {e}",
                    self.cfg.name
                ),
            }
        }
        let all_in_sync = !self.has_copies_out_of_sync();
        if !dropped.is_empty() {
            log::info!(
                "volume {}: released what the copies kept for epochs {dropped:?}, which are no snapshots of the volume{}",
                self.cfg.name,
                if all_in_sync { "" } else { " (copies out of sync get it at their fill)" }
            );
        }
        if all_in_sync {
            settled.extend(dropped);
        }
        settled
    }

    /// Is any copy of the volume out of sync (stale or being filled)? Such a copy does not
    /// take a snapshot's delete: the caller lists the epoch as a stray floor.
    pub fn has_copies_out_of_sync(&self) -> bool {
        self.slabs
            .read()
            .expect("slab map lock poisoned")
            .values()
            .any(|s| s.extents().iter().any(|e| e.state != ExtentState::InSync))
    }

    /// Deletes snapshot `snapshot` from every copy: the states only it reads are freed,
    /// those the next older snapshot reads stay for it. The caller has marked it deleting
    /// in the volume's record first (nothing reads it any more). Retry-safe: a copy that
    /// was unreachable is named in the error, and deleting again finishes it.
    pub async fn drop_snapshot(&self, snapshot: Epoch) -> Result<(), VolumeError> {
        self.check_serving()?;
        let _history = self.history.lock().await;
        // Nothing reads it from here on, whatever the copies answer.
        self.snapshots
            .lock()
            .expect("snapshot list lock")
            .retain(|&s| s != snapshot);
        let below = self.snapshots().into_iter().filter(|&s| s < snapshot).max();
        let epoch = self.epoch();
        let targets = self.writable_copies();
        let results = join_all(
            targets
                .iter()
                .map(|&(idx, at)| {
                    let op = ExtentOp::DropSnapshot {
                        key: self.key(idx),
                        epoch,
                        snapshot,
                        below,
                    };
                    self.ask(at, op, ExtentReply::into_ok)
                })
                .collect(),
        )
        .await;
        let failed: Vec<String> = targets
            .iter()
            .zip(&results)
            .filter_map(|((idx, at), r)| {
                r.as_ref()
                    .err()
                    .map(|err| format!("slab {idx} node {} drive {}: {err}", at.node, at.drive))
            })
            .collect();
        if failed.is_empty() {
            Ok(())
        } else {
            Err(self.snapshot_error(format!(
                "snapshot deleted, but {} copies still keep its space until deleted again: {}",
                failed.len(),
                failed.join("; ")
            )))
        }
    }

    /// Reads `len` bytes at `offset` as snapshot `snapshot` holds them, from copies that
    /// hold it (a copy filled after the snapshot refuses: docs/SNAPSHOTS.md, "Limits").
    pub async fn read_at(
        &self,
        snapshot: Epoch,
        offset: u64,
        len: u64,
    ) -> Result<Bytes, VolumeError> {
        self.check_len(len)?;
        self.check_range(offset, len)?;
        self.check_serving()?;
        if !self.snapshots().contains(&snapshot) {
            return Err(self.snapshot_error(format!("no snapshot at epoch {snapshot}")));
        }
        if len == 0 {
            return Ok(Bytes::new());
        }
        self.admit(len).await;
        let a_start = offset / BS * BS;
        let a_end = (offset + len).div_ceil(BS) * BS;
        let mut buf = BytesMut::with_capacity((a_end - a_start) as usize);
        let parent = self.parent();
        for p in split(a_start, a_end - a_start, self.slab_span()) {
            let piece = match &parent {
                Some(parent) => self.clone_read_piece(parent, p, Some(snapshot)).await?,
                None if self.map.is_some() => self.map_read_at_piece(snapshot, p).await?,
                None => self.read_at_piece(snapshot, p).await?,
            };
            buf.extend_from_slice(&piece);
        }
        if let Some(c) = &self.cfg.cipher {
            c.open(a_start / BS, &mut buf);
        }
        let at = (offset - a_start) as usize;
        let out = buf.freeze().slice(at..at + len as usize);
        self.check_serving()?;
        Ok(out)
    }

    /// Which 4 KiB blocks of the volume read differently at snapshot `from` and at `to`
    /// (`None`: now), over `[offset, offset + len)` widened to whole blocks: a bitmap, bit
    /// `i % 64` of word `i / 64` for block `offset / 4096 + i`. Metadata only (no data is
    /// read); each slab's answer comes from one in-sync copy that holds the snapshots (its
    /// own first), the next on a refusal. A block whose state a copy cannot tell (lost
    /// metadata) counts as changed. At most [`CHANGES_MAX_BYTES`] per call.
    pub async fn changed(
        &self,
        from: Epoch,
        to: Option<Epoch>,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u64>, VolumeError> {
        if len > CHANGES_MAX_BYTES {
            return Err(VolumeError::TooLong {
                volume: self.cfg.name.clone(),
                len,
                max: CHANGES_MAX_BYTES,
            });
        }
        self.check_range(offset, len)?;
        self.check_serving()?;
        let snaps = self.snapshots();
        if !snaps.contains(&from) {
            return Err(self.snapshot_error(format!("no snapshot at epoch {from}")));
        }
        if let Some(t) = to {
            if !snaps.contains(&t) {
                return Err(self.snapshot_error(format!("no snapshot at epoch {t}")));
            }
            if t <= from {
                return Err(self.snapshot_error(format!(
                    "changes from the snapshot at epoch {from} to the one at epoch {t}: the \
                     second must be the newer"
                )));
            }
        }
        let a_start = offset / BS * BS;
        let a_end = (offset + len).div_ceil(BS) * BS;
        let blocks = ((a_end - a_start) / BS) as usize;
        let mut bits = vec![0u64; blocks.div_ceil(64)];
        for p in split(a_start, a_end - a_start, self.slab_span()) {
            let got = match (self.geometry, &self.map) {
                (Some(g), Some(_)) => self.map_changed_piece(g, from, to, p).await?,
                _ => {
                    let Some(slab) = self.slab(p.slab) else {
                        continue;
                    };
                    self.changed_piece(&slab, from, to, p).await?
                }
            };
            let base = (p.at / BS) as usize;
            for i in 0..(p.len / BS) as usize {
                if got[i / 64] >> (i % 64) & 1 == 1 {
                    let j = base + i;
                    bits[j / 64] |= 1 << (j % 64);
                }
            }
        }
        self.check_serving()?;
        Ok(bits)
    }

    pub(crate) async fn changed_piece(
        &self,
        slab: &Slab,
        from: Epoch,
        to: Option<Epoch>,
        p: Piece,
    ) -> Result<Vec<u64>, VolumeError> {
        if let Some(g) = self.geometry_of(p.slab) {
            return self.parity_changed_piece(g, slab, from, to, p).await;
        }
        let key = self.key(p.slab);
        self.ask_in_turn(
            slab,
            p.slab,
            || ExtentOp::Changed {
                key,
                epoch: self.epoch(),
                from,
                to,
                offset: p.offset,
                count: (p.len / BS) as u32,
            },
            ExtentReply::into_bitmap,
            Ok,
        )
        .await
    }

    /// Asks the slab's in-sync copies in turn, this node's first, until one answers `op()`
    /// with what `accept` takes (its `Err(why)` passes on to the next copy, as a copy's
    /// refusal does); a fenced answer ends it. A metadata question or a snapshot read: any
    /// one copy that holds what is asked answers for all.
    pub(crate) async fn ask_in_turn<T, U>(
        &self,
        slab: &Slab,
        idx: SlabIndex,
        op: impl Fn() -> ExtentOp,
        unpack: fn(ExtentReply) -> Option<T>,
        accept: impl Fn(T) -> Result<U, String>,
    ) -> Result<U, VolumeError> {
        let mut copies: Vec<ExtentLoc> = slab
            .extents()
            .iter()
            .filter(|e| e.state == ExtentState::InSync)
            .copied()
            .collect();
        copies.sort_by_key(|e| e.node != self.cfg.local_node);
        let mut why = Vec::new();
        for at in copies {
            match self.ask(at, op(), unpack).await {
                Ok(r) => match accept(r) {
                    Ok(u) => return Ok(u),
                    Err(w) => why.push(format!("node {} drive {}: {w}", at.node, at.drive)),
                },
                Err(ReplicaError::StaleEpoch(w)) => return Err(self.fenced(w)),
                Err(e) => why.push(format!("node {} drive {}: {e}", at.node, at.drive)),
            }
        }
        Err(VolumeError::Unreadable {
            volume: self.cfg.name.clone(),
            slab: idx,
            why: if why.is_empty() {
                "no in-sync copy".into()
            } else {
                why.join("; ")
            },
        })
    }

    /// One piece of a snapshot read, from one in-sync copy (this node's first): a copy
    /// that does not hold the snapshot (filled after it) refuses, and one with bad or
    /// suspect blocks is passed over for the next.
    pub(crate) async fn read_at_piece(
        &self,
        snapshot: Epoch,
        p: Piece,
    ) -> Result<Bytes, VolumeError> {
        let Some(slab) = self.slab(p.slab) else {
            return Ok(Bytes::from(vec![0u8; p.len as usize]));
        };
        if let Some(g) = self.geometry_of(p.slab) {
            return self.parity_read_at_piece(g, snapshot, p, &slab).await;
        }
        let key = self.key(p.slab);
        self.ask_in_turn(
            &slab,
            p.slab,
            || ExtentOp::ReadAt {
                key,
                epoch: self.epoch(),
                snapshot,
                offset: p.offset,
                len: p.len as u32,
            },
            ExtentReply::into_read,
            |r| {
                if r.bad_blocks.is_empty() && r.suspect.is_empty() {
                    Ok(r.data)
                } else {
                    Err(format!(
                        "{} bad and {} suspect blocks",
                        r.bad_blocks.len(),
                        r.suspect.len()
                    ))
                }
            },
        )
        .await
    }

    /// Before a new slab's first write, while the volume has snapshots: each copy is
    /// placed holding every snapshot (before its slab existed, each reads as zeros), with
    /// the newest as its floor. A copy that does not take it holds none of them (reads of
    /// snapshots go to the others).
    pub(crate) async fn floor_new_slab(&self, idx: SlabIndex, extents: &[ExtentLoc]) {
        let snaps = self.snapshots();
        let Some(&newest) = snaps.last() else {
            return;
        };
        let previous = snaps.len().checked_sub(2).map(|i| snaps[i]);
        let epoch = self.epoch();
        let key = self.key(idx);
        let results = join_all(
            extents
                .iter()
                .map(|&at| {
                    let op = ExtentOp::SnapshotFloor {
                        key,
                        epoch,
                        snapshot: newest,
                        previous,
                        history: FloorHistory::Full,
                    };
                    self.ask(at, op, ExtentReply::into_ok)
                })
                .collect(),
        )
        .await;
        for (at, r) in extents.iter().zip(results) {
            if let Err(e) = r {
                log::warn!(
                    "volume {}: new slab {idx} on node {} drive {}: no snapshot floor ({e}); \
                     reads of its snapshots go to the other copies",
                    self.cfg.name,
                    at.node,
                    at.drive
                );
            }
        }
    }

    /// Rolls the volume back to snapshot `snapshot`: every block that changed since it (as
    /// [`Volume::changed`] finds them) is rewritten with what the snapshot reads (new writes
    /// at the current epoch, so the snapshot and every newer one stay as they are). Clients should not write meanwhile: a write racing the rollback
    /// may land before or after the part it touches. Returns the bytes rewritten.
    pub async fn rollback(&self, snapshot: Epoch) -> Result<u64, VolumeError> {
        if !self.snapshots().contains(&snapshot) {
            return Err(self.snapshot_error(format!("no snapshot at epoch {snapshot}")));
        }
        let span = self.slab_span();
        let size = self.size_bytes();
        let mut done = 0;
        for idx in self.spans_allocated() {
            let start = idx * span;
            let end = (start + span).min(size);
            let mut off = start;
            while off < end {
                let n = (end - off).min(MAX_IO_BYTES as u64);
                // Only what changed since the snapshot (its copies' metadata says which
                // blocks) is rewritten.
                let bits = self.changed(snapshot, None, off, n).await?;
                let changed = |b: u64| bits[(b / 64) as usize] >> (b % 64) & 1 == 1;
                let blocks = n / BS;
                let mut b = 0;
                while b < blocks {
                    if !changed(b) {
                        b += 1;
                        continue;
                    }
                    let first = b;
                    while b < blocks && changed(b) {
                        b += 1;
                    }
                    let (at, len) = (off + first * BS, (b - first) * BS);
                    let data = self.read_at(snapshot, at, len).await?;
                    if data.iter().all(|&x| x == 0) {
                        self.zero(at, len, false).await?;
                    } else {
                        self.write(at, data).await?;
                    }
                    done += len;
                }
                off += n;
            }
        }
        Ok(done)
    }
}
