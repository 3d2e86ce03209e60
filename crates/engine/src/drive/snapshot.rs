//! Snapshots in the engine (docs/adr/0012 as amended; docs/FORMAT-engine.md "Shadow
//! extents"). A snapshot is an epoch `s` of the extent's volume: it reads, per block, the
//! newest state written at an epoch at most `s`. The owner sets each copy's *snapshot
//! floor* (its newest snapshot) before writing after the snapshot; from then on a write
//! that replaces a state the floor's snapshot reads moves that state, physical block and
//! all, into the extent's *shadow* for that snapshot (a Preserve record in the write's own
//! journal batch) instead of freeing it. No data is copied, at the snapshot or after.
//!
//! Reading at snapshot `g`: per block, the first shadow of a snapshot at or after `g`
//! that holds a state of the block, else the live state; a state written after `g`
//! (a block written for the first time after it) reads as never written.

use super::*;
use crate::layout::SINCE_NONE;
use converge_types::FloorHistory;

/// A snapshot's epoch as the engine keeps it (extent-table entries and records hold 32
/// bits: the upper half of a version).
fn snapshot_epoch(e: Epoch, what: &str) -> Result<u32, EngineError> {
    u32::try_from(e.0).ok().filter(|&s| s > 0).ok_or_else(|| {
        EngineError::InvalidArgument(format!(
            "{what} epoch {} must be between 1 and {}",
            e.0,
            u32::MAX
        ))
    })
}

impl Drive {
    /// Sets the extent's snapshot floor to `snapshot` (its volume's newest snapshot):
    /// later writes at a newer epoch preserve the states it reads. `previous` is the
    /// volume's snapshot before it, and `history` what this copy holds of the older ones
    /// ([`FloorHistory`]): the extent then holds the snapshots from `since` to the floor,
    /// and refuses reads of others ([`Drive::read_at`]). Floors only rise here
    /// ([`Drive::drop_snapshot`] lowers one), but for [`FloorHistory::Joining`], which
    /// drops every snapshot the copy kept first (a fill copies them anew; its floor may be
    /// of a snapshot deleted while it was stale); the same call again is a no-op. An
    /// extent the drive does not hold has nothing to preserve: Ok (but `Full`, a new
    /// slab's copy, and `Joining` allocate it as a write would). An extent holding priors
    /// of held (parity) writes is refused: they must be settled first (a revert would
    /// bring back a state older than the snapshot). Later held writes copy the states the
    /// snapshot reads, which stay their priors ([`Record::PreserveCopy`]). Durable
    /// on Ok, and writes acked after it wait for it.
    pub fn set_snapshot_floor(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        snapshot: Epoch,
        previous: Option<Epoch>,
        history: FloorHistory,
    ) -> Result<(), EngineError> {
        self.check_failed()?;
        let floor = snapshot_epoch(snapshot, "snapshot")?;
        let previous = match previous {
            Some(p) => snapshot_epoch(p, "previous snapshot")?,
            None => 0,
        };
        // A new slab's copy is placed before its first write, and a copy being filled
        // before the fill writes: its floor makes it.
        let ext = if matches!(history, FloorHistory::Full | FloorHistory::Joining) {
            self.extent_for_write(key, epoch)?
        } else {
            let Some(ext) = self.lookup(key) else {
                return Ok(());
            };
            ext
        };
        Self::check_epoch(&ext, epoch)?;
        if history == FloorHistory::Joining {
            // What a copy being filled kept of snapshots before may be wrong (it missed
            // writes, or deletes): its fill copies them anew (docs/adr/0012, step 4).
            let kept: Vec<u32> = {
                let t = lock(&self.table);
                t.shadows
                    .range((key, 0)..=(key, u32::MAX))
                    .map(|(&(_, s), _)| s)
                    .collect()
            };
            for s in kept.into_iter().rev() {
                self.drop_snapshot(key, epoch, Epoch(u64::from(s)), None)?;
            }
        }
        let cur = ext.floor.load(Ordering::Acquire);
        if history == FloorHistory::Continues && previous < cur && cur < floor {
            // The copy's floor is above the volume's newest snapshot: a snapshot whose
            // commit failed (its owner could not tell whether the control plane recorded
            // it, so it left the floors), or one deleted while this copy was away. Neither
            // is the volume's: they are dropped first, what they kept that `previous` reads
            // staying for it. Taken for a missed snapshot instead, the copy would stop
            // holding every older one.
            let above: Vec<u32> = {
                let t = lock(&self.table);
                t.shadows
                    .range((key, previous + 1)..=(key, cur))
                    .map(|(&(_, s), _)| s)
                    .collect()
            };
            let below = (previous > 0).then(|| Epoch(u64::from(previous)));
            if !above.contains(&cur) {
                self.drop_snapshot(key, epoch, Epoch(u64::from(cur)), below)?;
            }
            for s in above.into_iter().rev() {
                self.drop_snapshot(key, epoch, Epoch(u64::from(s)), below)?;
            }
        }
        let seq = {
            // Under the table lock: writers read the floor and its shadow together.
            let _t = lock(&self.table);
            let m = lock(&ext.meta);
            if m.freed {
                return Err(EngineError::Released { key });
            }
            let cur = ext.floor.load(Ordering::Acquire);
            let cur_since = ext.since.load(Ordering::Acquire);
            // A copy joining holds nothing (its shadows went above): its floor may have
            // been a snapshot deleted while it was stale.
            if floor < cur && !matches!(history, FloorHistory::Joining | FloorHistory::Copied) {
                return Err(EngineError::InvalidArgument(format!(
                    "snapshot floor {floor} is below the extent's floor {cur}: a floor only \
                     rises, deleting the newest snapshot lowers it"
                )));
            }
            let empty = m.overlay.is_empty() && m.blocks.iter().all(|b| *b == BlockMeta::default());
            let since = match history {
                FloorHistory::Full if empty => 0,
                // A new slab's copy on a drive that still holds an earlier incarnation's
                // blocks (the release did not reach it): those are no snapshot's, so it
                // holds none of the snapshots so far (their reads go to the other copies)
                // and the later ones from the next.
                FloorHistory::Full | FloorHistory::Joining => SINCE_NONE,
                FloorHistory::Copied => {
                    // A fill copied the snapshots `previous..=snapshot` into this copy,
                    // whose floor it set at its start. The floor may be above the newest
                    // snapshot: one whose commit failed, not dropped again everywhere
                    // (nothing reads it; its epoch's writes preserve nothing for it).
                    if floor > cur || previous == 0 || previous > floor {
                        return Err(EngineError::InvalidArgument(format!(
                            "a fill's copied snapshots {previous} to {floor} do not end at \
                             or below the extent's floor {cur}"
                        )));
                    }
                    previous
                }
                // Re-sent (a retry): what the first call decided.
                _ if floor == cur => cur_since,
                _ if cur == previous => cur_since.min(floor),
                // It missed a snapshot between its floor and this one.
                _ => floor,
            };
            // `Copied` leaves the floor as it is.
            let floor = if history == FloorHistory::Copied {
                cur
            } else {
                floor
            };
            if floor == cur && since == cur_since {
                ext.epoch_seq.load(Ordering::Acquire)
            } else {
                if floor > cur && since <= floor && !m.held.is_empty() {
                    // A prior is a state a revert may bring back: one written before the
                    // snapshot would then replace a state the snapshot reads, unkept.
                    // (Priors of writes after the floor are safe: each write copied the
                    // state it replaced for the snapshot. A copy that holds none of the
                    // snapshots, joining or an earlier incarnation's, keeps none.)
                    return Err(EngineError::InvalidArgument(format!(
                        "a snapshot floor needs the extent's {} held priors settled first \
                         (the owner settles a parity chunk's rows before its snapshot)",
                        m.held.len()
                    )));
                }
                drop(m);
                let mut rec = [0u8; RECORD];
                Record::Floor {
                    slot: ext.slot,
                    floor,
                    since,
                }
                .encode(&mut rec);
                let seq = self.enqueue(&rec, true)?;
                ext.floor.store(floor, Ordering::Release);
                ext.since.store(since, Ordering::Release);
                ext.epoch_seq.fetch_max(seq, Ordering::AcqRel);
                seq
            }
        };
        self.wait_durable(seq)
    }

    /// Deletes snapshot `snapshot` from the extent: the states only it reads are freed,
    /// and those the next older remaining snapshot `below` (None: no older one remains)
    /// also reads move into that one's shadow (metadata only). Deleting the newest
    /// snapshot lowers the floor to `below`. Unknown snapshots and extents are Ok
    /// (retries are safe; a delete cut short by a crash is finished by its retry).
    /// Durable on Ok.
    ///
    /// In two journal steps: first the floor moves and the shadow is *retired* (writes
    /// stop preserving into it; one planned before falls back to the floor's shadow);
    /// once that is applied its states are frozen, and Keep records move what `below`
    /// reads, one self-contained record per block, before the shadow is dropped.
    pub fn drop_snapshot(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        snapshot: Epoch,
        below: Option<Epoch>,
    ) -> Result<(), EngineError> {
        self.check_failed()?;
        let s = snapshot_epoch(snapshot, "snapshot")?;
        let p = match below {
            Some(b) => snapshot_epoch(b, "older snapshot")?,
            None => 0,
        };
        if p >= s {
            return Err(EngineError::InvalidArgument(format!(
                "the older snapshot {p} must be older than the deleted one {s}"
            )));
        }
        let Some(ext) = self.lookup(key) else {
            return Ok(());
        };
        Self::check_epoch(&ext, epoch)?;
        let _one_at_a_time = lock(&self.snapshot_ops);
        // Step 1: the floor, and the retirement of the shadow.
        let (seq, retired) = {
            let mut t = lock(&self.table);
            let floor = ext.floor.load(Ordering::Acquire);
            let retired = t.shadows.get(&(key, s)).copied();
            // The older snapshot's shadow exists before anything may move into it: the
            // retired shadow's states, and a write planned for the old floor whose
            // Preserve comes after the retirement (it falls back to the floor's shadow).
            if p > 0 && (floor == s || retired.is_some()) && !t.shadows.contains_key(&(key, p)) {
                self.alloc_shadow(&mut t, key, p)?;
            }
            let mut recs = Vec::with_capacity(2 * RECORD);
            if floor == s {
                Record::Floor {
                    slot: ext.slot,
                    floor: p,
                    since: ext.since.load(Ordering::Acquire),
                }
                .push(&mut recs);
            }
            if let Some(slot) = retired {
                Record::Retire { slot }.push(&mut recs);
            }
            let mut seq = ext.epoch_seq.load(Ordering::Acquire);
            if !recs.is_empty() {
                seq = seq.max(self.enqueue(&recs, true)?);
                if floor == s {
                    ext.floor.store(p, Ordering::Release);
                    ext.epoch_seq.fetch_max(seq, Ordering::AcqRel);
                }
            }
            (seq, retired)
        };
        self.wait_durable(seq)?;
        let Some(slot) = retired else {
            return Ok(());
        };
        // Step 2: the retired shadow's states are frozen now (applied; nothing finds it).
        let seq = {
            let mut t = lock(&self.table);
            let into = match p {
                0 => None,
                p => t.shadows.get(&(key, p)).copied(),
            };
            let mut recs = Vec::new();
            if let (Some(into), Some(shadow)) = (into, t.slots[slot as usize].live.clone()) {
                let m = lock(&shadow.meta);
                for (b, st) in m.blocks.iter().enumerate() {
                    if *st != BlockMeta::default() && epoch_of(st) <= u64::from(p) {
                        Record::Keep {
                            slot: into,
                            block: b as u32,
                            from: slot,
                            meta: *st,
                        }
                        .push(&mut recs);
                    }
                }
            }
            Record::DropShadow { slot }.push(&mut recs);
            t.shadows.remove(&(key, s));
            t.slots[slot as usize].live = None;
            self.enqueue(&recs, true)?
        };
        self.wait_durable(seq)
    }

    /// Reads blocks of the extent as snapshot `snapshot` holds them (see the module
    /// docs); as [`Drive::read`] otherwise (bad and suspect blocks reported, unallocated
    /// ones zeros). Refused for a snapshot the extent does not hold (outside its
    /// `since..=floor`: it was filled after that snapshot, or never had its floor).
    pub fn read_at(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        snapshot: Epoch,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<ReadInfo, EngineError> {
        self.read_at_inner(key, epoch, snapshot, offset, buf, None)
    }

    /// [`Drive::read_at`] that also reports each block's version at the snapshot (0:
    /// never written then; `versions` is replaced), for copying a snapshot's states into a
    /// copy being filled ([`Drive::write_shadow`]).
    pub fn read_blocks_at(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        snapshot: Epoch,
        offset: u64,
        buf: &mut [u8],
        versions: &mut Vec<Version>,
    ) -> Result<ReadInfo, EngineError> {
        self.read_at_inner(key, epoch, snapshot, offset, buf, Some(versions))
    }

    /// [`Drive::read_at`], reporting each block's version at the snapshot when asked.
    fn read_at_inner(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        snapshot: Epoch,
        offset: u64,
        buf: &mut [u8],
        versions: Option<&mut Vec<Version>>,
    ) -> Result<ReadInfo, EngineError> {
        let g = snapshot_epoch(snapshot, "snapshot")?;
        let (first, count) = self.range(key, offset, buf.len() as u64)?;
        self.check_failed()?;
        let Some(ext) = self.lookup(key) else {
            buf.fill(0);
            if let Some(v) = versions {
                v.clear();
                v.resize(count as usize, Version(0));
            }
            return Ok(ReadInfo::default());
        };
        Self::check_epoch(&ext, epoch)?;
        Self::check_holds(&ext, g)?;
        let t = self.counters.begin();
        let r = with_scratch(|s| {
            self.read_checked(buf, s, versions, &|out: &mut Vec<BlockMeta>| {
                self.states_at(&ext, g, first, count, out)
            })
        });
        self.counters.end(OpKind::Read, t);
        r
    }

    /// The version of each of `count` blocks from `offset` as snapshot `snapshot` reads it
    /// on this copy (0: never written then). Metadata only. Refused like
    /// [`Drive::read_at`] when the copy does not hold the snapshot, unless `any`: a fill
    /// compares what the copy it fills reads so far ([`Drive::write_shadow`]).
    #[allow(clippy::too_many_arguments)]
    pub fn versions_at(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        snapshot: Epoch,
        offset: u64,
        count: u32,
        any: bool,
    ) -> Result<Vec<Version>, EngineError> {
        let g = snapshot_epoch(snapshot, "snapshot")?;
        self.slab_range(key, offset, u64::from(count) * BLOCK)?;
        self.check_failed()?;
        let Some(ext) = self.lookup(key) else {
            return Ok(vec![Version(0); count as usize]);
        };
        Self::check_epoch(&ext, epoch)?;
        if !any {
            Self::check_holds(&ext, g)?;
        }
        let mut states = Vec::with_capacity(count as usize);
        self.states_at(&ext, g, (offset / BLOCK) as u32, count, &mut states);
        Ok(states.iter().map(|m| Version(m.version)).collect())
    }

    /// A fill (docs/adr/0012, step 4) sets what this copy reads at snapshot `snapshot`
    /// (at most the extent's floor, which the fill set first): block `i` of the range gets
    /// the state of version `versions[i]` and `data`'s block `i`, kept in the extent's
    /// shadow for that snapshot. A version of 0 means the block reads as never written at
    /// the snapshot: the shadow keeps a zero state of the next epoch for it, which reads
    /// as never written at that snapshot and every older one. A block of zeros is kept as
    /// a zero state (no physical block). Every version must be of the snapshot's epoch or
    /// older. The owner sends it with the slab's snapshots neither taken nor deleted, and
    /// for the newest with no write in flight (a write preserves into that one's shadow).
    /// Returns the blocks set. Durable on Ok.
    #[allow(clippy::too_many_arguments)]
    pub fn write_shadow(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        snapshot: Epoch,
        offset: u64,
        data: &[u8],
        crcs: &[u32],
        versions: &[Version],
    ) -> Result<u32, EngineError> {
        let s = snapshot_epoch(snapshot, "snapshot")?;
        let (first, count) = self.checked_write_range(key, offset, data, crcs)?;
        let bad = |reason| EngineError::InvalidIo {
            key,
            reason,
            offset,
            len: data.len() as u64,
        };
        if versions.len() != count as usize {
            return Err(bad("one version per 4 KiB block is required"));
        }
        if versions.iter().any(|v| v.0 >> 32 > u64::from(s)) {
            return Err(bad("a snapshot's state must be of its epoch or older"));
        }
        self.check_failed()?;
        let Some(ext) = self.lookup(key) else {
            return Err(EngineError::InvalidArgument(format!(
                "extent {key:?} is not on this drive: a fill sets the copy's snapshot floor \
                 before it copies snapshots"
            )));
        };
        Self::check_epoch(&ext, epoch)?;
        let _one_at_a_time = lock(&self.snapshot_ops);
        let zero: Vec<bool> = versions
            .iter()
            .zip(data.chunks_exact(BLOCK_SIZE))
            .map(|(v, b)| v.0 == 0 || b.iter().all(|&x| x == 0))
            .collect();
        let marker = (u64::from(s) + 1) << 32;
        let version_of = |i: usize| {
            if versions[i].0 == 0 {
                marker
            } else {
                versions[i].0
            }
        };
        let stored = zero.iter().filter(|z| !**z).count() as u64;
        let shadow = {
            let mut t = lock(&self.table);
            let floor = ext.floor.load(Ordering::Acquire);
            if s > floor {
                return Err(EngineError::InvalidArgument(format!(
                    "snapshot {s} is above the extent's floor {floor}: a fill sets the floor \
                     before it copies snapshots"
                )));
            }
            if lock(&ext.meta).freed {
                return Err(EngineError::Released { key });
            }
            if stored > 0 {
                self.room_to_preserve(stored)?;
            }
            let slot = match t.shadows.get(&(key, s)) {
                Some(&slot) => slot,
                None => self.alloc_shadow(&mut t, key, s)?,
            };
            t.slots[slot as usize]
                .live
                .clone()
                .expect("a shadow's slot holds it")
        };
        let mut seq = ext.epoch_seq.load(Ordering::Acquire);
        let mut n = 0;
        if stored > 0 {
            let (k, q) = self.write_claimed(
                &shadow,
                first,
                count,
                data,
                crcs,
                version_of,
                |i, _, _| !zero[i],
                false,
            )?;
            n += k;
            seq = seq.max(q);
        }
        // The zero states, a piece at a time (each record one block: versions differ).
        let piece = self.piece_blocks();
        let mut at = 0u32;
        while at < count {
            let len = piece.min(count - at);
            let (k, q) = with_scratch(|sc| -> Result<(u32, u64), EngineError> {
                let (k, need) = self.claim(
                    &shadow,
                    first + at,
                    len,
                    |i, _| BlockMeta::zero(version_of(at as usize + i)),
                    |i, _, _| zero[at as usize + i],
                    &mut sc.applied,
                    None,
                )?;
                if k == 0 {
                    return Ok((0, need));
                }
                sc.records.clear();
                for i in applied_indexes(&sc.applied) {
                    Record::Zero {
                        slot: shadow.slot,
                        block: first + at + i as u32,
                        count: 1,
                        version: version_of(at as usize + i),
                    }
                    .push(&mut sc.records);
                }
                let q = self.queue_claimed(&shadow, first + at, &sc.applied, &sc.records)?;
                Ok((k, need.max(q)))
            })?;
            n += k;
            seq = seq.max(q);
            at += len;
        }
        self.wait_durable(seq)?;
        Ok(n)
    }

    /// Refuses snapshot `g` unless this copy of the extent holds it (`since..=floor`).
    fn check_holds(ext: &Extent, g: u32) -> Result<(), EngineError> {
        let (since, floor) = (
            ext.since.load(Ordering::Acquire),
            ext.floor.load(Ordering::Acquire),
        );
        if g < since || g > floor {
            return Err(EngineError::NoSnapshot {
                key: ext.key,
                snapshot: g,
                holds: if since > floor {
                    "none".to_string()
                } else {
                    format!("{since} to {floor}")
                },
            });
        }
        Ok(())
    }

    /// Checks a metadata question's range: whole blocks, within the slab (up to all of
    /// it, unlike I/O's 32 MiB).
    fn slab_range(&self, key: ExtentKey, offset: u64, len: u64) -> Result<(), EngineError> {
        let bad = |reason| EngineError::InvalidIo {
            key,
            reason,
            offset,
            len,
        };
        if !offset.is_multiple_of(BLOCK) || !len.is_multiple_of(BLOCK) || len == 0 {
            return Err(bad("offset and length must be non-zero multiples of 4096"));
        }
        if offset
            .checked_add(len)
            .is_none_or(|end| end > self.layout.slab_size_bytes)
        {
            return Err(bad("the range must lie within the slab"));
        }
        Ok(())
    }

    /// Which blocks of `[offset, offset + len)` changed between snapshot `from` and
    /// snapshot `to` (`None`: the live extent, as durable now): a bitmap, bit `i % 64` of
    /// word `i / 64` set when block `i` of the range reads differently at the two — its
    /// states there are two different writes, not both of zeros. Metadata only,
    /// no data is read. A block whose metadata was lost counts as changed (a backup copies
    /// it rather than miss it). `len` may cover the whole slab. Refused like
    /// [`Drive::read_at`] when the copy does not hold a snapshot named; an extent the drive
    /// does not hold changed nowhere.
    pub fn changed(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        from: Epoch,
        to: Option<Epoch>,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u64>, EngineError> {
        let g_from = snapshot_epoch(from, "changes' from")?;
        let g_to = to.map(|t| snapshot_epoch(t, "changes' to")).transpose()?;
        self.slab_range(key, offset, len)?;
        if g_to.is_some_and(|t| t <= g_from) {
            return Err(EngineError::InvalidArgument(format!(
                "changes from snapshot epoch {g_from} to {}: the second must be newer",
                to.map_or(0, |t| t.0)
            )));
        }
        self.check_failed()?;
        let (first, count) = ((offset / BLOCK) as u32, (len / BLOCK) as u32);
        let mut bits = vec![0u64; (count as usize).div_ceil(64)];
        let Some(ext) = self.lookup(key) else {
            return Ok(bits);
        };
        Self::check_epoch(&ext, epoch)?;
        Self::check_holds(&ext, g_from)?;
        if let Some(t) = g_to {
            Self::check_holds(&ext, t)?;
        }
        let mut a = Vec::with_capacity(count as usize);
        self.states_at(&ext, g_from, first, count, &mut a);
        let mut b = Vec::with_capacity(count as usize);
        match g_to {
            Some(t) => self.states_at(&ext, t, first, count, &mut b),
            None => {
                let m = lock(&ext.meta);
                b.extend_from_slice(&m.blocks[first as usize..(first + count) as usize]);
            }
        }
        // Two states of one block read the same iff they are one state, or both read as
        // zeros (never written, trimmed, zeroed: a new slab is zeroed whole, for one).
        let zeros = |m: &BlockMeta| !m.has_data() && !m.is_bad();
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            if x.is_bad() || y.is_bad() || (x.version != y.version && !(zeros(x) && zeros(y))) {
                bits[i / 64] |= 1 << (i % 64);
            }
        }
        Ok(bits)
    }

    /// Which blocks of `[offset, offset + len)` were never written as of snapshot `at`
    /// (`None`: now, as durable): a bitmap as [`Drive::changed`]'s. A clone reads those from
    /// its parent (docs/adr/0012, step 5); a TRIM or zeroing is a write, so a zeroed block
    /// is not absent. An extent the drive does not hold is absent throughout. Refused like
    /// [`Drive::read_at`] when the copy does not hold snapshot `at`.
    pub fn absent(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        at: Option<Epoch>,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u64>, EngineError> {
        let g = at.map(|a| snapshot_epoch(a, "snapshot")).transpose()?;
        self.slab_range(key, offset, len)?;
        self.check_failed()?;
        let (first, count) = ((offset / BLOCK) as u32, (len / BLOCK) as u32);
        let Some(ext) = self.lookup(key) else {
            let mut bits = vec![u64::MAX; (count as usize).div_ceil(64)];
            if count % 64 != 0 {
                *bits.last_mut().expect("count > 0") = (1u64 << (count % 64)) - 1;
            }
            return Ok(bits);
        };
        Self::check_epoch(&ext, epoch)?;
        let mut states = Vec::with_capacity(count as usize);
        match g {
            Some(g) => {
                Self::check_holds(&ext, g)?;
                self.states_at(&ext, g, first, count, &mut states);
            }
            None => {
                let m = lock(&ext.meta);
                states.extend_from_slice(&m.blocks[first as usize..(first + count) as usize]);
            }
        }
        let mut bits = vec![0u64; (count as usize).div_ceil(64)];
        for (i, st) in states.iter().enumerate() {
            if *st == BlockMeta::default() {
                bits[i / 64] |= 1 << (i % 64);
            }
        }
        Ok(bits)
    }

    /// The durable state of each block of `[first, first + count)` at snapshot `g`.
    fn states_at(&self, ext: &Extent, g: u32, first: u32, count: u32, out: &mut Vec<BlockMeta>) {
        // Table, live extent, then shadows oldest first: the order applies take them in
        // (a drop holds the table; a preserve holds the live extent, then its shadow).
        let t = lock(&self.table);
        let shadows: Vec<Arc<Extent>> = t
            .durable_shadows
            .range((ext.key, g)..=(ext.key, u32::MAX))
            .filter_map(|(_, &slot)| t.slots[slot as usize].durable.clone())
            .collect();
        let m = lock(&ext.meta);
        let held: Vec<MutexGuard<'_, ExtentMeta>> = shadows.iter().map(|s| lock(&s.meta)).collect();
        out.clear();
        out.extend((first..first + count).map(|b| {
            let state = held
                .iter()
                .map(|h| h.blocks[b as usize])
                .find(|x| *x != BlockMeta::default())
                .unwrap_or(m.blocks[b as usize]);
            if epoch_of(&state) <= u64::from(g) {
                state
            } else {
                BlockMeta::default()
            }
        }));
    }

    /// The extent's shadows (its snapshots' preserved states on this drive), oldest
    /// snapshot first.
    pub fn shadows(&self, key: ExtentKey) -> Vec<ShadowInfo> {
        let t = lock(&self.table);
        t.shadows
            .range((key, 0)..=(key, u32::MAX))
            .filter_map(|(&(_, snapshot), &slot)| {
                let s = t.slots[slot as usize].live.as_ref()?;
                let m = lock(&s.meta);
                Some(ShadowInfo {
                    snapshot,
                    blocks: m
                        .blocks
                        .iter()
                        .filter(|b| **b != BlockMeta::default())
                        .count() as u32,
                    bytes_stored: u64::from(m.stored_blocks) * BLOCK,
                })
            })
            .collect()
    }

    /// What this extent keeps for each of the volume's snapshots `snapshots` (oldest
    /// first): (blocks stored in its shadow, how many of them deleting the snapshot would
    /// free). A state the snapshot keeps is also read by the next older snapshot (and so
    /// moved into its keeping by a delete, not freed) when it is of that snapshot's epoch
    /// or older and that snapshot keeps no state of the block itself. Metadata only; a
    /// drive that does not hold the extent keeps nothing. Counts physical blocks (a
    /// state kept for several snapshots counts once, for the newest).
    pub fn kept_blocks(
        &self,
        key: ExtentKey,
        epoch: Epoch,
        snapshots: &[Epoch],
    ) -> Result<Vec<(u64, u64)>, EngineError> {
        self.check_failed()?;
        let snaps: Vec<u32> = snapshots
            .iter()
            .map(|&s| snapshot_epoch(s, "snapshot"))
            .collect::<Result<_, _>>()?;
        if snaps.windows(2).any(|w| w[0] >= w[1]) {
            return Err(EngineError::InvalidArgument(
                "snapshots must be named oldest first, each once".into(),
            ));
        }
        let Some(ext) = self.lookup(key) else {
            return Ok(vec![(0, 0); snaps.len()]);
        };
        Self::check_epoch(&ext, epoch)?;
        // Table, then shadows oldest first (the order `states_at` takes them in).
        let t = lock(&self.table);
        let shadows: Vec<Option<Arc<Extent>>> = snaps
            .iter()
            .map(|&s| {
                let slot = *t.shadows.get(&(key, s))?;
                t.slots[slot as usize].live.clone()
            })
            .collect();
        let held: Vec<Option<MutexGuard<'_, ExtentMeta>>> = shadows
            .iter()
            .map(|s| s.as_ref().map(|e| lock(&e.meta)))
            .collect();
        Ok((0..snaps.len())
            .map(|i| {
                let Some(h) = &held[i] else {
                    return (0, 0);
                };
                let older = i.checked_sub(1).map(|j| (u64::from(snaps[j]), &held[j]));
                let freed: Vec<BlockMeta> = h
                    .blocks
                    .iter()
                    .enumerate()
                    .filter(|(b, st)| {
                        st.run().is_some()
                            && match older {
                                None => true,
                                Some((g, o)) => {
                                    epoch_of(st) > g
                                        || o.as_ref()
                                            .is_some_and(|o| o.blocks[*b] != BlockMeta::default())
                                }
                            }
                    })
                    .map(|(_, st)| *st)
                    .collect();
                (u64::from(h.stored_blocks), u64::from(stored_of(&freed)))
            })
            .collect())
    }

    /// The extent's snapshot floor (0: none, or the drive does not hold the extent).
    pub fn snapshot_floor(&self, key: ExtentKey) -> u32 {
        self.lookup(key)
            .map_or(0, |e| e.floor.load(Ordering::Acquire))
    }
}
