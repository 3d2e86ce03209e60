//! Group commit and checkpoints: writers queue metadata records, one leader at a time
//! writes them as a journal batch and syncs once for everyone, then applies them; when the
//! journal fills, the leader writes the durable metadata in place and moves the tail.

use crate::drive::{lock, CommitState, Drive, Extent, ExtentMeta, IoKind, LeaderState};
use crate::error::{EngineError, GENERATION_EXHAUSTED};
use crate::file::AlignedBuf;
use crate::layout::{
    encode_meta_sector, encode_table_sector, seal_batch, BlockMeta, ExtentEntry, Record,
    BATCH_HEADER, BLOCK, BLOCKS_PER_META_PAGE, EXT_PER_PAGE, EXT_PER_SECTOR, META_PER_SECTOR,
    RECORD, SECTOR, SECTORS_PER_PAGE,
};
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};
use std::task::{Context, Poll};

impl Drive {
    /// Why the drive failed (a device write or sync error), if it did; it acks nothing
    /// after that.
    pub fn failure(&self) -> Option<String> {
        lock(&self.commit).failed.clone()
    }

    /// Takes the drive out of service as a failed device write or sync would: every later
    /// call fails, and nothing more is acked, until the drive is reopened. For fault
    /// injection (`converge lab fault fail-drive`) and for retiring a misbehaving drive.
    pub fn fail_now(&self, reason: &str) {
        self.fail(&EngineError::Failed {
            reason: format!("taken out of service: {reason}"),
        });
    }

    pub(crate) fn check_failed(&self) -> Result<(), EngineError> {
        match &lock(&self.commit).failed {
            Some(reason) => Err(EngineError::Failed {
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    pub(crate) fn fail(&self, e: &EngineError) {
        let mut st = lock(&self.commit);
        if st.failed.is_none() {
            log::error!("drive {} failed: {e}", self.id.drive);
            st.failed = Some(e.to_string());
        }
        wake_settled(&mut st);
        self.commit_notify(&st);
    }

    /// Waits on `commit_cv`, counted, so that a notifier finding nobody waiting skips the
    /// futex syscall that a condition variable's notify costs even then.
    pub(crate) fn commit_wait<'a>(
        &'a self,
        mut st: MutexGuard<'a, CommitState>,
    ) -> MutexGuard<'a, CommitState> {
        st.cv_waiters += 1;
        let mut st = self.commit_cv.wait(st).expect("commit lock poisoned");
        st.cv_waiters -= 1;
        st
    }

    /// Wakes the threads waiting on `commit_cv`, if there are any (`st` is the locked state).
    pub(crate) fn commit_notify(&self, st: &CommitState) {
        if st.cv_waiters > 0 {
            self.commit_cv.notify_all();
        }
    }

    /// Queues records for the journal and returns the batch sequence number that holds the
    /// last of them. `force` never waits for room (used under the table lock, where waiting
    /// could deadlock with the leader); a batch may then exceed its bound by a few records.
    pub(crate) fn enqueue(&self, records: &[u8], force: bool) -> Result<u64, EngineError> {
        debug_assert_eq!(records.len() % RECORD, 0);
        let cap = self.batch_records_max;
        let mut st = lock(&self.commit);
        let mut seq = st.open_seq;
        for chunk in records.chunks(cap) {
            loop {
                if let Some(reason) = &st.failed {
                    return Err(EngineError::Failed {
                        reason: reason.clone(),
                    });
                }
                if force || st.pending.len() + chunk.len() <= cap {
                    break;
                }
                st = if st.leader_active {
                    self.commit_wait(st)
                } else {
                    self.lead_one(st)
                };
            }
            st.pending.extend_from_slice(chunk);
            seq = st.open_seq;
        }
        if st.pool_waiters > 0 {
            // Writers wait for physical blocks that this batch will give back.
            self.commit_notify(&st);
        }
        Ok(seq)
    }

    /// Returns once batch `seq` (and all before it) is durable; leads a batch if nobody is.
    ///
    /// A failed drive acks nothing, even a write whose batch is durable: a write skipped
    /// because of a newer claim whose data write then failed has no batch of its own to
    /// wait for, and an error is always a safe answer (the owner treats it as unknown).
    pub(crate) fn wait_durable(&self, seq: u64) -> Result<(), EngineError> {
        let mut st = lock(&self.commit);
        loop {
            if let Some(reason) = &st.failed {
                return Err(EngineError::Failed {
                    reason: reason.clone(),
                });
            }
            if st.durable_seq >= seq {
                return Ok(());
            }
            st = if st.leader_active {
                self.commit_wait(st)
            } else {
                self.lead_one(st)
            };
        }
    }

    /// Records in batch `seq` if it is the open one (nobody writing it yet), else 0.
    pub(crate) fn open_batch_records(&self, seq: u64) -> usize {
        let st = lock(&self.commit);
        if st.open_seq == seq {
            st.pending.len() / RECORD
        } else {
            0
        }
    }

    /// The polling twin of [`Drive::wait_durable`], for a caller that must not block its
    /// thread waiting for another thread's batch (an async task). `Ready` once batch `seq`
    /// is durable (or the drive failed); otherwise the task is woken when that changes.
    ///
    /// With `lead`, a caller that finds the batch open and nobody leading writes it itself,
    /// on its own thread (the journal write and sync block it; that suits drives whose I/O
    /// takes microseconds). A caller that does not lead relies on one that does (or on a
    /// thread in `wait_durable`): a leader that leaves a batch open wakes every task still
    /// waiting, so one of them leads it.
    pub(crate) fn poll_durable(
        &self,
        seq: u64,
        cx: &mut Context<'_>,
        lead: bool,
    ) -> Poll<Result<(), EngineError>> {
        let mut st = lock(&self.commit);
        loop {
            if let Some(reason) = &st.failed {
                return Poll::Ready(Err(EngineError::Failed {
                    reason: reason.clone(),
                }));
            }
            if st.durable_seq >= seq {
                return Poll::Ready(Ok(()));
            }
            if !lead || st.leader_active {
                break;
            }
            // Not durable, nobody leading: our records are in the open batch.
            st = self.lead_one(st);
        }
        let w = cx.waker();
        if !st.wakers.iter().any(|(s, x)| *s == seq && x.will_wake(w)) {
            st.wakers.push((seq, w.clone()));
        }
        Poll::Pending
    }

    /// Writes the open batch as leader: one journal write, one sync for every waiter.
    pub(crate) fn lead_one<'a>(
        &'a self,
        mut st: MutexGuard<'a, CommitState>,
    ) -> MutexGuard<'a, CommitState> {
        assert!(
            !st.pending.is_empty(),
            "a waiter leads only when its records are in the open batch"
        );
        st.leader_active = true;
        let seq = st.open_seq;
        st.open_seq += 1;
        // Only the thread that set leader_active takes this lock, so it is free.
        let mut ld = lock(&self.leader);
        std::mem::swap(&mut st.pending, &mut ld.spare);
        drop(st);
        let res = self.write_batch(&mut ld, seq);
        drop(ld);
        let mut st = lock(&self.commit);
        match res {
            Ok(()) => st.durable_seq = seq,
            Err(e) => {
                log::error!(
                    "drive {} failed writing journal batch {seq}: {e}",
                    self.id.drive
                );
                st.failed.get_or_insert_with(|| e.to_string());
            }
        }
        st.leader_active = false;
        wake_settled(&mut st);
        self.commit_notify(&st);
        st
    }

    fn write_batch(&self, ld: &mut LeaderState, seq: u64) -> Result<(), EngineError> {
        assert_eq!(seq, ld.next_seq, "journal batches are written in sequence");
        let records = std::mem::take(&mut ld.spare);
        let js = self.journal_sector as u64;
        let jlen = self.layout.journal_len;
        let len = (BATCH_HEADER + records.len()) as u64;
        let len = len.div_ceil(js) * js;
        // Checkpoint before the replay window passes half the journal: keeps room for the
        // batch and its wrap-around waste, and bounds recovery time.
        let waste = |head: u64| if head + len > jlen { jlen - head } else { 0 };
        if ld.used + waste(ld.head) + len > jlen / 2 {
            // Every earlier batch is synced and applied.
            self.checkpoint_locked(ld)?;
        }
        let (_, waste) = self.journal_write(ld, &records, seq + ld.jseq_skew)?;
        self.counters
            .journal_batches
            .fetch_add(1, Ordering::Relaxed);
        self.batches_written.fetch_add(1, Ordering::Relaxed);
        ld.used += waste + len;
        ld.next_seq = seq + 1;
        self.apply_records(ld, &records);
        ld.spare = records;
        ld.spare.clear();
        Ok(())
    }

    /// Writes `records` as one journal batch with journal sequence number `jseq` at the
    /// head (or at 0 when it does not fit before the end of the region), syncs, and moves
    /// the head past it. Returns (position, bytes skipped at the end by a wrap).
    fn journal_write(
        &self,
        ld: &mut LeaderState,
        records: &[u8],
        jseq: u64,
    ) -> Result<(u64, u64), EngineError> {
        let js = self.journal_sector as u64;
        let jlen = self.layout.journal_len;
        let len = ((BATCH_HEADER + records.len()) as u64).div_ceil(js) * js;
        let (pos, waste) = if ld.head + len > jlen {
            (0, jlen - ld.head)
        } else {
            (ld.head, 0)
        };
        let len_usize = len as usize;
        if ld.batch_buf.capacity() < len_usize {
            ld.batch_buf = AlignedBuf::new(len_usize);
        }
        ld.batch_buf.set_len(len_usize);
        let buf = &mut ld.batch_buf[..];
        buf[BATCH_HEADER..BATCH_HEADER + records.len()].copy_from_slice(records);
        buf[BATCH_HEADER + records.len()..].fill(0);
        seal_batch(
            buf,
            ld.sb.journal_gen,
            jseq,
            len_usize,
            (records.len() / RECORD) as u32,
        );
        self.dev_write(
            &ld.batch_buf[..],
            self.layout.journal_off + pos,
            IoKind::Journal,
        )?;
        self.dev_sync()?;
        ld.head = pos + len;
        if ld.head >= jlen {
            ld.head = 0;
        }
        Ok((pos, waste))
    }

    fn durable_extent(&self, slot: u32) -> Option<Arc<Extent>> {
        lock(&self.table)
            .slots
            .get(slot as usize)
            .and_then(|s| s.durable.clone())
    }

    /// Applies a durable batch to the in-memory durable state, in journal order, and
    /// gives back the physical blocks it made unused.
    fn apply_records(&self, ld: &mut LeaderState, records: &[u8]) {
        let mut cache: Option<(u32, Option<Arc<Extent>>)> = None;
        let mut gone = std::mem::take(&mut ld.gone);
        for raw in records.chunks_exact(RECORD) {
            let rec = Record::decode(raw).expect("records in a batch were encoded by this drive");
            match rec {
                Record::Data {
                    slot,
                    block,
                    crc,
                    version,
                    phys,
                    hold,
                    pack,
                } => {
                    let meta = BlockMeta::data_packed(version, crc, phys, pack);
                    let blocks = Some((block, 1));
                    self.apply_blocks(
                        ld,
                        &mut cache,
                        slot,
                        blocks,
                        meta.run(),
                        &mut gone,
                        |m, b, g| {
                            if hold {
                                m.apply_held(b, meta, g)
                            } else {
                                m.apply(b, meta, g)
                            }
                        },
                    );
                }
                Record::Zero {
                    slot,
                    block,
                    count,
                    version,
                } => {
                    let meta = BlockMeta::zero(version);
                    let blocks = Some((block, count));
                    self.apply_blocks(ld, &mut cache, slot, blocks, None, &mut gone, |m, b, g| {
                        m.apply(b, meta, g)
                    });
                }
                Record::Prior { slot, block, meta } => {
                    self.apply_blocks(ld, &mut cache, slot, None, None, &mut gone, |m, _, g| {
                        m.apply_prior(block, meta, g)
                    });
                }
                Record::Revert {
                    slot,
                    block,
                    version,
                } => {
                    let blocks = Some((block, 1));
                    self.apply_blocks(ld, &mut cache, slot, blocks, None, &mut gone, |m, b, g| {
                        m.apply_revert(b, version, g);
                    });
                }
                Record::Settle {
                    slot,
                    upto,
                    first,
                    count,
                } => {
                    let rows = (count > 0).then_some((first, count));
                    self.apply_blocks(ld, &mut cache, slot, None, None, &mut gone, |m, _, g| {
                        m.apply_settle(upto, rows, g)
                    });
                }
                Record::Alloc { slot, key, epoch } => {
                    cache = None;
                    let mut t = lock(&self.table);
                    let s = &mut t.slots[slot as usize];
                    s.durable = s.live.clone().filter(|e| e.key == key && e.shadow == 0);
                    s.entry = ExtentEntry {
                        in_use: true,
                        key: Some(key),
                        epoch: epoch.0,
                        codec: converge_types::Compression::None,
                        shadow: false,
                        aux: 0,
                        since: crate::layout::SINCE_NONE,
                    };
                    ld.dirty_table.insert(slot / EXT_PER_PAGE);
                    // The slot's metadata pages still hold a previous extent's: reset them.
                    for p in 0..self.layout.meta_pages_per_extent() {
                        ld.dirty_meta.insert((slot, p));
                    }
                }
                Record::Epoch { slot, epoch } => {
                    let mut t = lock(&self.table);
                    let e = &mut t.slots[slot as usize].entry;
                    e.epoch = e.epoch.max(epoch.0);
                    ld.dirty_table.insert(slot / EXT_PER_PAGE);
                }
                Record::Codec { slot, codec } => {
                    let mut t = lock(&self.table);
                    let e = &mut t.slots[slot as usize].entry;
                    if e.in_use {
                        e.codec = codec;
                        ld.dirty_table.insert(slot / EXT_PER_PAGE);
                    }
                }
                Record::Shadow { slot, key, epoch } => {
                    cache = None;
                    let mut t = lock(&self.table);
                    let s = &mut t.slots[slot as usize];
                    s.durable = s.live.clone().filter(|e| e.key == key && e.shadow == epoch);
                    s.entry = ExtentEntry {
                        in_use: true,
                        key: Some(key),
                        epoch: 0,
                        codec: converge_types::Compression::None,
                        shadow: true,
                        aux: epoch,
                        since: 0,
                    };
                    t.durable_shadows.insert((key, epoch), slot);
                    ld.dirty_table.insert(slot / EXT_PER_PAGE);
                    for p in 0..self.layout.meta_pages_per_extent() {
                        ld.dirty_meta.insert((slot, p));
                    }
                }
                Record::Floor { slot, floor, since } => {
                    let mut t = lock(&self.table);
                    let e = &mut t.slots[slot as usize].entry;
                    if e.in_use && !e.shadow {
                        e.aux = floor;
                        e.since = since;
                        ld.dirty_table.insert(slot / EXT_PER_PAGE);
                    }
                }
                Record::Preserve {
                    slot,
                    block,
                    snapshot,
                    meta,
                } => self.apply_preserve(ld, slot, block, snapshot, meta, &mut gone),
                Record::PreserveCopy {
                    slot,
                    block,
                    snapshot,
                    meta,
                } => self.apply_preserve_copy(ld, slot, block, snapshot, meta, &mut gone),
                Record::Retire { slot } => {
                    let mut t = lock(&self.table);
                    if let Some(sh) = t.slots.get(slot as usize).and_then(|s| s.durable.clone()) {
                        if sh.shadow != 0
                            && t.durable_shadows.get(&(sh.key, sh.shadow)) == Some(&slot)
                        {
                            t.durable_shadows.remove(&(sh.key, sh.shadow));
                        }
                    }
                }
                Record::Keep {
                    slot,
                    block,
                    from,
                    meta,
                } => self.apply_keep(ld, slot, block, from, meta, &mut gone),
                Record::DropShadow { slot } => {
                    cache = None;
                    self.apply_drop_shadow(ld, slot, &mut gone);
                }
                Record::Free { slot } => {
                    cache = None;
                    let mut t = lock(&self.table);
                    if let Some(ext) = &t.slots[slot as usize].durable {
                        if ext.shadow != 0 {
                            let k = (ext.key, ext.shadow);
                            t.durable_shadows.remove(&k);
                        }
                    }
                    let s = &mut t.slots[slot as usize];
                    if let Some(ext) = s.durable.take() {
                        let mut m = lock(&ext.meta);
                        // Every block and prior gives back its storage; a stream named by
                        // several members, once.
                        let mut streams = std::collections::BTreeSet::new();
                        for st in m.blocks.iter().chain(m.held.values()) {
                            if let Some((first, len)) = st.run() {
                                if !st.is_packed() || streams.insert(first) {
                                    gone.extend(first..first + len);
                                }
                            }
                        }
                        self.held_blocks
                            .fetch_sub(m.held.len() as u64, Ordering::Relaxed);
                        m.held.clear();
                        self.stored_of(&ext)
                            .fetch_sub(u64::from(m.stored_blocks), Ordering::Relaxed);
                        m.stored_blocks = 0;
                    }
                    s.entry = ExtentEntry::default();
                    if s.live.is_none() {
                        t.free.push(slot);
                    }
                    ld.dirty_table.insert(slot / EXT_PER_PAGE);
                }
            }
        }
        if !ld.orphans.is_empty() {
            ld.orphans.sort_unstable();
            ld.orphans.dedup();
            for &(first, len) in &ld.orphans {
                gone.extend(first..first + len);
            }
            ld.orphans.clear();
        }
        if !gone.is_empty() {
            let mut pool = lock(&self.pool);
            for &p in &gone {
                pool.release(p);
            }
        }
        gone.clear();
        ld.gone = gone;
    }

    /// Applies a Preserve record: block `block` of the live extent in `slot` moves its
    /// durable state (`state`, what the writer saw) into the shadow of `snapshot`, or,
    /// that shadow being gone (its snapshot deleted after the write was planned), into
    /// the shadow of the extent's floor if that snapshot reads the state. With neither,
    /// nothing moves (the write that follows frees the state).
    fn apply_preserve(
        &self,
        ld: &mut LeaderState,
        slot: u32,
        block: u32,
        snapshot: u32,
        state: BlockMeta,
        gone: &mut Vec<u32>,
    ) {
        let Some((live, tslot, shadow, upto)) = self.preserve_into(slot, snapshot) else {
            return;
        };
        let mut m = lock(&live.meta);
        let Some(&cur) = m.blocks.get(block as usize) else {
            return;
        };
        // The writer saw the state its record names; nothing else changes the block
        // between its claim and this record.
        debug_assert_eq!(cur, state, "a Preserve names the block's durable state");
        if cur != state
            || cur == BlockMeta::default()
            || crate::drive::epoch_of(&cur) > u64::from(upto)
        {
            return;
        }
        let Some(state) = m.take_preserved(block) else {
            return;
        };
        if let Some((_, len)) = state.run() {
            self.stored_of(&live)
                .fetch_sub(u64::from(len), Ordering::Relaxed);
        }
        let mut sm = lock(&shadow.meta);
        let before = sm.stored_blocks;
        sm.put_preserved(block, state, gone);
        let after = sm.stored_blocks;
        drop(sm);
        drop(m);
        self.shadow_stored_changed(before, after);
        let page = block / BLOCKS_PER_META_PAGE;
        ld.dirty_meta.insert((slot, page));
        ld.dirty_meta.insert((tslot, page));
    }

    /// Where a Preserve (or PreserveCopy) record of the live extent in `slot` for
    /// `snapshot` puts its state: (the live extent, the shadow's slot, the shadow, the
    /// newest epoch the state may have there), or None when it keeps nothing.
    fn preserve_into(
        &self,
        slot: u32,
        snapshot: u32,
    ) -> Option<(Arc<Extent>, u32, Arc<Extent>, u32)> {
        let t = lock(&self.table);
        let live = t.slots.get(slot as usize).and_then(|s| s.durable.clone())?;
        if live.shadow != 0 {
            return None;
        }
        let floor = t.slots[slot as usize].entry.aux;
        let target = crate::drive::preserve_target(snapshot, floor, |e| {
            t.durable_shadows.get(&(live.key, e)).copied()
        });
        target.and_then(|(s, upto)| {
            t.slots[s as usize]
                .durable
                .clone()
                .map(|sh| (live, s, sh, upto))
        })
    }

    /// Applies a PreserveCopy record: the shadow keeps `copy`, a plain copy of block
    /// `block`'s packed state (or a bad state, when its stream was damaged), when the live block still holds that state (its version and
    /// crc) and the snapshot reads it; otherwise the copy's physical block is free.
    fn apply_preserve_copy(
        &self,
        ld: &mut LeaderState,
        slot: u32,
        block: u32,
        snapshot: u32,
        copy: BlockMeta,
        gone: &mut Vec<u32>,
    ) {
        let free = |gone: &mut Vec<u32>| {
            if let Some((first, len)) = copy.run() {
                gone.extend(first..first + len);
            }
        };
        let Some((live, tslot, shadow, upto)) = self.preserve_into(slot, snapshot) else {
            free(gone);
            return;
        };
        let m = lock(&live.meta);
        let holds = m.blocks.get(block as usize).is_some_and(|cur| {
            *cur != BlockMeta::default() && cur.version == copy.version && cur.crc == copy.crc
        });
        if !holds
            || (copy.run().is_none() && !copy.is_bad())
            || crate::drive::epoch_of(&copy) > u64::from(upto)
        {
            free(gone);
            return;
        }
        let mut sm = lock(&shadow.meta);
        let before = sm.stored_blocks;
        sm.put_preserved(block, copy, gone);
        let after = sm.stored_blocks;
        drop(sm);
        drop(m);
        self.shadow_stored_changed(before, after);
        ld.dirty_meta.insert((tslot, block / BLOCKS_PER_META_PAGE));
    }

    /// The shadows' stored blocks went from `before` to `after`.
    fn shadow_stored_changed(&self, before: u32, after: u32) {
        if after >= before {
            self.shadow_stored
                .fetch_add(u64::from(after - before), Ordering::Relaxed);
        } else {
            self.shadow_stored
                .fetch_sub(u64::from(before - after), Ordering::Relaxed);
        }
    }

    /// Applies a Keep record: block `block`'s state `state` moves from the retired
    /// shadow in `from` into the shadow in `slot`, if `from` still holds it.
    fn apply_keep(
        &self,
        ld: &mut LeaderState,
        slot: u32,
        block: u32,
        from: u32,
        state: BlockMeta,
        gone: &mut Vec<u32>,
    ) {
        let (src, dst) = {
            let t = lock(&self.table);
            let get = |s: u32| {
                t.slots
                    .get(s as usize)
                    .and_then(|x| x.durable.clone())
                    .filter(|e| e.shadow != 0)
            };
            match (get(from), get(slot)) {
                (Some(a), Some(b)) if a.key == b.key && from != slot => (a, b),
                _ => return,
            }
        };
        let mut sm = lock(&src.meta);
        if sm.blocks.get(block as usize) != Some(&state) {
            return;
        }
        let mut dm = lock(&dst.meta);
        let before = sm.stored_blocks + dm.stored_blocks;
        sm.take_preserved(block);
        dm.put_preserved(block, state, gone);
        let after = sm.stored_blocks + dm.stored_blocks;
        drop(dm);
        drop(sm);
        self.shadow_stored_changed(before, after);
        let page = block / BLOCKS_PER_META_PAGE;
        ld.dirty_meta.insert((from, page));
        ld.dirty_meta.insert((slot, page));
    }

    /// Applies a DropShadow record: the shadow in `slot` goes and what it still holds is
    /// free (what a younger snapshot's deletion kept moved out with Keep records first).
    fn apply_drop_shadow(&self, ld: &mut LeaderState, slot: u32, gone: &mut Vec<u32>) {
        let mut t = lock(&self.table);
        let Some(sh) = t.slots.get(slot as usize).and_then(|s| s.durable.clone()) else {
            return;
        };
        if sh.shadow == 0 {
            return;
        }
        if t.durable_shadows.get(&(sh.key, sh.shadow)) == Some(&slot) {
            t.durable_shadows.remove(&(sh.key, sh.shadow));
        }
        {
            let mut m = lock(&sh.meta);
            for c in &m.blocks {
                if let Some((first, len)) = c.run() {
                    gone.extend(first..first + len);
                }
            }
            self.shadow_stored
                .fetch_sub(u64::from(m.stored_blocks), Ordering::Relaxed);
            m.stored_blocks = 0;
            m.data_blocks = 0;
            m.blocks.fill(BlockMeta::default());
            m.freed = true;
        }
        let s = &mut t.slots[slot as usize];
        s.durable = None;
        s.entry = ExtentEntry::default();
        if s.live.is_none() {
            t.free.push(slot);
        }
        ld.dirty_table.insert(slot / EXT_PER_PAGE);
    }

    /// The drive's count of stored blocks `ext` belongs to: thin (with a codec) or plain.
    pub(crate) fn stored_of(&self, ext: &Extent) -> &std::sync::atomic::AtomicU64 {
        if ext.shadow != 0 {
            &self.shadow_stored
        } else if ext.codec().is_none() {
            &self.plain_stored
        } else {
            &self.thin_stored
        }
    }

    /// Applies `op` to each block of `blocks` (first, count) of the durable extent in
    /// `slot`, marking their metadata pages dirty, or once (`None`: a record that changes
    /// no block's state: a prior, a settle); keeps the drive's count of priors and of
    /// stored blocks. If the extent was freed meanwhile, `orphan` (the physical blocks
    /// the record wrote: a block, or a stream every member's record names) is free.
    #[allow(clippy::too_many_arguments)]
    fn apply_blocks(
        &self,
        ld: &mut LeaderState,
        cache: &mut Option<(u32, Option<Arc<Extent>>)>,
        slot: u32,
        blocks: Option<(u32, u32)>,
        orphan: Option<(u32, u32)>,
        gone: &mut Vec<u32>,
        mut op: impl FnMut(&mut ExtentMeta, u32, &mut Vec<u32>),
    ) {
        let ext = match cache {
            Some((s, e)) if *s == slot => e.clone(),
            _ => {
                let e = self.durable_extent(slot);
                *cache = Some((slot, e.clone()));
                e
            }
        };
        let Some(ext) = ext else {
            // The extent was freed meanwhile: nothing names this block's new data (a
            // stream's members all name it: given back once, see `apply_records`).
            if let Some((first, len)) = orphan {
                ld.orphans.push((first, len));
            }
            return;
        };
        let mut m = lock(&ext.meta);
        let held_before = m.held.len();
        let stored_before = m.stored_blocks;
        match blocks {
            None => op(&mut m, 0, gone),
            Some((block, count)) => {
                for b in block..block.saturating_add(count) {
                    op(&mut m, b, gone);
                }
            }
        }
        let held_after = m.held.len();
        let stored_after = m.stored_blocks;
        let stored = self.stored_of(&ext);
        if stored_after >= stored_before {
            stored.fetch_add(u64::from(stored_after - stored_before), Ordering::Relaxed);
        } else {
            stored.fetch_sub(u64::from(stored_before - stored_after), Ordering::Relaxed);
        }
        drop(m);
        if held_after >= held_before {
            self.held_blocks
                .fetch_add((held_after - held_before) as u64, Ordering::Relaxed);
        } else {
            self.held_blocks
                .fetch_sub((held_before - held_after) as u64, Ordering::Relaxed);
        }
        if let Some((block, count)) = blocks {
            let last = block.saturating_add(count.max(1) - 1);
            for p in block / BLOCKS_PER_META_PAGE..=last / BLOCKS_PER_META_PAGE {
                ld.dirty_meta.insert((slot, p));
            }
        }
    }

    /// Makes the durable in-memory metadata durable in place, then moves the journal tail
    /// to the head. Only the commit leader calls this, between batches (every earlier one
    /// is synced and applied).
    pub(crate) fn checkpoint_locked(&self, ld: &mut LeaderState) -> Result<(), EngineError> {
        // Never write a superblock the decoder refuses (generation u64::MAX).
        let generation = ld
            .sb
            .generation
            .checked_add(1)
            .filter(|&g| g < u64::MAX)
            .ok_or_else(|| EngineError::Corrupt(GENERATION_EXHAUSTED.into()))?;
        let table_pages = std::mem::take(&mut ld.dirty_table);
        let meta_pages = std::mem::take(&mut ld.dirty_meta);
        let mut buf = std::mem::replace(&mut ld.page_buf, AlignedBuf::new(0));
        let res = self.write_pages(&table_pages, &meta_pages, &mut buf);
        ld.page_buf = buf;
        res?;
        self.dev_sync()?;
        // Priors are not in the metadata pages: re-log them past the old window before
        // the tail moves, and start the new window at that batch.
        let (tail, tail_seq) = match self.relog_priors(ld)? {
            Some(at) => at,
            None => (ld.head, ld.next_seq + ld.jseq_skew),
        };
        // The superblock write is the commit point: copies alternate, so a torn write
        // leaves the previous one valid.
        ld.sb.generation = generation;
        ld.sb.journal_tail = tail;
        ld.sb.journal_tail_seq = tail_seq;
        ld.sb.journal_sector = self.journal_sector as u32;
        let mut sbuf = AlignedBuf::new(BLOCK as usize);
        ld.sb.encode(&mut sbuf);
        self.dev_write(&sbuf, (ld.sb.generation % 2) * BLOCK, IoKind::Meta)?;
        self.dev_sync()?;
        ld.used = if tail == ld.head {
            0
        } else {
            (ld.head + self.layout.journal_len - tail) % self.layout.journal_len
        };
        ld.used_at_checkpoint = ld.used;
        self.counters.checkpoints.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Writes one journal batch holding a Prior record for every prior the durable state
    /// holds, at the head (after the window the checkpoint retires, which stays intact
    /// until the superblock moves the tail), synced. Returns its (position, journal
    /// sequence number), or None when the drive holds no prior.
    fn relog_priors(&self, ld: &mut LeaderState) -> Result<Option<(u64, u64)>, EngineError> {
        if self.held_blocks.load(Ordering::Relaxed) == 0 {
            return Ok(None);
        }
        let mut records = Vec::new();
        {
            let t = lock(&self.table);
            for (slot, s) in t.slots.iter().enumerate() {
                let Some(ext) = &s.durable else { continue };
                let m = lock(&ext.meta);
                for (&block, &meta) in &m.held {
                    Record::Prior {
                        slot: slot as u32,
                        block,
                        meta,
                    }
                    .push(&mut records);
                }
            }
        }
        if records.is_empty() {
            return Ok(None);
        }
        let jseq = ld.next_seq + ld.jseq_skew;
        let (pos, _) = self.journal_write(ld, &records, jseq)?;
        ld.jseq_skew += 1;
        Ok(Some((pos, jseq)))
    }

    fn write_pages(
        &self,
        table_pages: &std::collections::BTreeSet<u32>,
        meta_pages: &std::collections::BTreeSet<(u32, u32)>,
        buf: &mut AlignedBuf,
    ) -> Result<(), EngineError> {
        const PAGE: usize = BLOCK as usize;
        let chunk_pages = buf.capacity() / PAGE;
        for &page in table_pages {
            buf.set_len(PAGE);
            {
                let t = lock(&self.table);
                for sec in 0..SECTORS_PER_PAGE {
                    let sector = page * SECTORS_PER_PAGE + sec;
                    let first = (sector * EXT_PER_SECTOR) as usize;
                    let end = (first + EXT_PER_SECTOR as usize).min(t.slots.len());
                    let entries: Vec<ExtentEntry> = t
                        .slots
                        .get(first..end)
                        .unwrap_or(&[])
                        .iter()
                        .map(|s| s.entry)
                        .collect();
                    let at = sec as usize * SECTOR;
                    encode_table_sector(&mut buf[at..at + SECTOR], sector, &entries);
                }
            }
            self.dev_write(buf, self.layout.table_page_off(page), IoKind::Meta)?;
        }
        // Coalesce runs of adjacent metadata pages into one write each.
        let mut run: Option<(u32, u32, usize)> = None; // (slot, first page, pages)
        let mut metas = vec![BlockMeta::default(); META_PER_SECTOR as usize];
        for &(slot, page) in meta_pages {
            if let Some((s, p0, n)) = run {
                if s != slot || p0 + n as u32 != page || n == chunk_pages {
                    self.dev_write(
                        &buf[..n * PAGE],
                        self.layout.meta_page_off(s, p0),
                        IoKind::Meta,
                    )?;
                    run = None;
                }
            }
            let (s, p0, n) = run.unwrap_or((slot, page, 0));
            buf.set_len(buf.capacity());
            let ext = self.durable_extent(slot);
            let guard = ext.as_ref().map(|e| lock(&e.meta));
            for sec in 0..SECTORS_PER_PAGE {
                let sector = page * SECTORS_PER_PAGE + sec;
                let first = (sector * META_PER_SECTOR) as usize;
                let bpe = self.layout.blocks_per_extent as usize;
                let end = (first + META_PER_SECTOR as usize).min(bpe);
                let src: &[BlockMeta] = match &guard {
                    Some(m) if first < bpe => &m.blocks[first..end],
                    _ => &[],
                };
                metas[..src.len()].copy_from_slice(src);
                let at = n * PAGE + sec as usize * SECTOR;
                encode_meta_sector(&mut buf[at..at + SECTOR], slot, sector, &metas[..src.len()]);
            }
            run = Some((s, p0, n + 1));
        }
        if let Some((s, p0, n)) = run {
            self.dev_write(
                &buf[..n * PAGE],
                self.layout.meta_page_off(s, p0),
                IoKind::Meta,
            )?;
        }
        Ok(())
    }

    /// Checkpoints if the drive wrote no journal batch since the last call and has batches
    /// to fold in (returns whether it did). Called now and then by the node (every few
    /// seconds): a drive gone quiet gets its journal's last batch into the metadata pages.
    ///
    /// Why: recovery cannot tell whether the journal's last batch was synced, so a block
    /// of that batch whose data does not match its crc is taken for a write the crash cut
    /// short and goes back to its previous state. On a drive that stays quiet after a
    /// write, that batch stays the last one: bit rot in the written block, then a power
    /// loss, would roll back an acked write on that copy (simulation seeds 1311, 46, 12 of
    /// the parity sweep). Once checkpointed, the pages hold the block's state and rot is
    /// reported as what it is, a bad block, which the owner repairs from another copy.
    pub fn checkpoint_if_quiet(&self) -> Result<bool, EngineError> {
        let now = self.batches_written.load(Ordering::Relaxed);
        let seen = self.batches_seen_quiet.swap(now, Ordering::Relaxed);
        if now != seen {
            return Ok(false);
        }
        {
            let st = lock(&self.commit);
            if st.leader_active || !st.pending.is_empty() {
                return Ok(false);
            }
        }
        {
            // Nothing written since the last checkpoint (beyond its re-log of priors).
            let ld = lock(&self.leader);
            if ld.used <= ld.used_at_checkpoint {
                return Ok(false);
            }
        }
        self.checkpoint()?;
        Ok(true)
    }

    /// Writes all durable metadata in place and empties the journal now (e.g. before a
    /// clean shutdown, so the next open replays nothing). Writes keep flowing meanwhile.
    pub fn checkpoint(&self) -> Result<(), EngineError> {
        let mut st = lock(&self.commit);
        loop {
            if let Some(reason) = &st.failed {
                return Err(EngineError::Failed {
                    reason: reason.clone(),
                });
            }
            if !st.leader_active {
                break;
            }
            st = self.commit_wait(st);
        }
        st.leader_active = true;
        drop(st);
        let res = {
            let mut ld = lock(&self.leader);
            self.checkpoint_locked(&mut ld)
        };
        let mut st = lock(&self.commit);
        if let Err(e) = &res {
            st.failed.get_or_insert_with(|| e.to_string());
        }
        st.leader_active = false;
        wake_settled(&mut st);
        self.commit_notify(&st);
        drop(st);
        res
    }
}

/// Wakes the tasks whose batch is now durable (every task, if the drive failed). If a batch
/// is still open with no leader, wakes the rest too: one of them leads it (a task that
/// leads polls with `lead`; one that does not is woken again by that leader).
fn wake_settled(st: &mut CommitState) {
    if st.wakers.is_empty() {
        return;
    }
    let all = st.failed.is_some() || (!st.leader_active && !st.pending.is_empty());
    let durable = st.durable_seq;
    st.wakers.retain(|(seq, w)| {
        if all || *seq <= durable {
            w.wake_by_ref();
            false
        } else {
            true
        }
    });
}
