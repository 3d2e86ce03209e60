//! Compressed block groups on the data path (docs/adr/0010, docs/FORMAT-engine.md
//! "Compressed groups"): a write to an extent with a codec compresses each group of
//! [`COMPRESSION_GROUP_BLOCKS`] blocks it covers whole into one stream of consecutive
//! physical blocks, when that saves a block; a write to part of a compressed group reads
//! the group, merges and recompresses it (read-modify-write), so random small writes keep
//! the group compressed; reads decompress. Every member's metadata names the whole stream,
//! so recovery proves each block on its own, as for plain blocks.

use super::*;
use crate::codec;
use crate::file::AlignedBuf;
use crate::pool::Take;

/// How a piece's claimed block is stored.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Not claimed.
    Idle,
    /// Claimed but its content could not be read back (a damaged stream): its state is
    /// kept as it is (re-recorded unchanged), never rewritten from bytes we cannot trust.
    Keep,
    /// Written to a block of its own.
    Plain,
    /// A member of its group's new stream.
    Member,
}

/// A group of a piece whose members go into one stream.
struct GroupPlan {
    /// Index (in the piece) of the group's first block.
    j0: usize,
    /// Stream bytes and where the stream sits in [`PackScratch::out`].
    len: u32,
    out_at: usize,
}

/// Per-thread buffers of the packed paths (the data path allocates nothing per group once
/// they have grown).
#[derive(Default)]
struct PackScratch {
    /// A stream read from the device (aligned for O_DIRECT).
    raw: Option<AlignedBuf>,
    /// A decompressed group.
    plain: Vec<u8>,
    /// The content of a piece's claimed blocks, by index in the piece.
    input: Vec<u8>,
    /// Compressed streams of the piece, each padded to whole blocks.
    out: Vec<u8>,
    /// What one pwrite writes: runs of consecutive physical blocks.
    stage: Option<AlignedBuf>,
    kinds: Vec<Kind>,
    groups: Vec<GroupPlan>,
    /// Storage requests (home, blocks) in piece order, and what each is for.
    reqs: Vec<(u32, u32)>,
    req_of: Vec<Req>,
    /// First physical block taken for each request.
    taken: Vec<u32>,
    /// Index in `groups` of each group of the piece (usize::MAX: not compressed).
    group_idx: Vec<usize>,
    /// Physical block (or stream) each block (or group) got.
    phys_of: Vec<u32>,
    stream_of: Vec<u32>,
    /// Plain copies of packed states a write replaces that a snapshot reads (their stream
    /// stays with the group's other members), and the index in the piece of each.
    copies: Vec<u8>,
    copy_of: Vec<usize>,
    copy_phys: Vec<u32>,
    /// Indexes of packed states to keep whose content fails its crc (a damaged stream):
    /// kept as bad states, with no copy.
    copy_bad: Vec<usize>,
}

/// What a storage request is for.
#[derive(Clone, Copy)]
enum Req {
    /// The block at this index of the piece.
    Block(usize),
    /// The stream of this entry of the plan's groups.
    Group(usize),
    /// This entry of the plain copies kept for a snapshot.
    Copy(usize),
}

thread_local! {
    static PACK: RefCell<PackScratch> = RefCell::new(PackScratch::default());
}

fn with_pack<R>(f: impl FnOnce(&mut PackScratch) -> R) -> R {
    PACK.with(|c| match c.try_borrow_mut() {
        Ok(mut s) => f(&mut s),
        Err(_) => f(&mut PackScratch::default()),
    })
}

/// Makes `buf` an aligned buffer of `len` bytes, reusing it when it is big enough.
fn aligned(buf: &mut Option<AlignedBuf>, len: usize) -> &mut AlignedBuf {
    if buf.as_ref().is_none_or(|b| b.capacity() < len) {
        *buf = Some(AlignedBuf::new(len.max(16 * BLOCK_SIZE)));
    }
    let b = buf.as_mut().expect("just set");
    b.set_len(len);
    b
}

/// What a snapshot keeps of packed state `m` in a plain copy at physical block `phys`.
fn kept_copy(m: &BlockMeta, phys: u32) -> BlockMeta {
    let copy = BlockMeta::data(m.version, m.crc, phys);
    if m.is_suspect() {
        copy.suspect()
    } else {
        copy
    }
}

/// What a snapshot keeps of packed state `m` whose content fails its crc (its stream is
/// damaged): a bad state of its version, which reads as bad (other copies answer, scrub
/// repairs it) and has no copy to check.
fn kept_bad(m: &BlockMeta) -> BlockMeta {
    BlockMeta {
        version: m.version,
        crc: m.crc,
        ..BlockMeta::BAD
    }
}

impl Drive {
    /// The codec a write of `ext` is stored with: none for a held write (parity chunks
    /// keep plain priors) and on a version-2 drive.
    pub(super) fn codec_for(&self, ext: &Extent, hold: bool) -> Compression {
        if hold || !self.packing {
            Compression::None
        } else {
            ext.codec()
        }
    }

    /// Reads the stream packed block `meta` names and decompresses its group into
    /// `plain`. Ok(false): the stream is out of range or does not decompress (damaged):
    /// its members' crcs will not match.
    fn load_stream(
        &self,
        meta: &BlockMeta,
        raw: &mut Option<AlignedBuf>,
        plain: &mut Vec<u8>,
    ) -> Result<bool, EngineError> {
        let Some((first, len)) = meta.run() else {
            return Ok(false);
        };
        if u64::from(first) + u64::from(len) > self.layout.data_blocks {
            return Ok(false);
        }
        let raw = aligned(raw, len as usize * BLOCK_SIZE);
        self.dev_read(&mut raw[..], self.layout.phys_off(first))?;
        plain.resize(meta.group_blocks() as usize * BLOCK_SIZE, 0);
        Ok(codec::decompress(
            meta.codec(),
            &raw[..meta.stream_len() as usize],
            plain,
        ))
    }

    /// For a zero replacing packed states the snapshot at `floor` reads (`before`, at the
    /// claim's applied blocks from `first`): copies each out of its stream into a block of
    /// its own, written before its PreserveCopy record is pushed onto `records` (the
    /// zero's records follow in the same batch). The group's other members keep the stream.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn copy_preserves(
        &self,
        ext: &Extent,
        first: u32,
        floor: u32,
        applied: &[bool],
        before: &[BlockMeta],
        version_of: &impl Fn(usize) -> u64,
        records: &mut Vec<u8>,
    ) -> Result<(), EngineError> {
        if floor == 0 {
            return Ok(());
        }
        let wanted =
            |i: &usize| before[*i].is_packed() && must_preserve(floor, &before[*i], version_of(*i));
        let n = applied_indexes(applied).filter(wanted).count();
        if n == 0 {
            return Ok(());
        }
        let mut phys = Vec::with_capacity(n);
        let homes = applied_indexes(applied)
            .filter(wanted)
            .map(|i| self.layout.home_block(ext.slot, first + i as u32));
        self.take_blocks(ExactLen(homes, n), &mut phys)?;
        let which = applied_indexes(applied).filter(wanted);
        self.copy_kept_states(ext, first, floor, which, before, &phys, records)
            .inspect_err(|e| {
                // The device failed under us: stop acking, as a write does.
                self.fail(e);
            })
    }

    /// For a write (or zero) replacing states the snapshot at `floor` reads that cannot
    /// move into its keeping (`before[i]` for each `i` of `which`, blocks from `first`): a
    /// held write's, which stay as the blocks' priors, or packed members, whose stream the
    /// group's others still name. Copies each into its block of `phys` (taken with the
    /// write's blocks, or alone for a zero) and pushes its PreserveCopy record onto
    /// `records`, ahead of the write's own. A state whose content fails its crc is kept as
    /// a bad state (its block is given back).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn copy_kept_states(
        &self,
        ext: &Extent,
        first: u32,
        floor: u32,
        which: impl Iterator<Item = usize>,
        before: &[BlockMeta],
        phys: &[u32],
        records: &mut Vec<u8>,
    ) -> Result<(), EngineError> {
        with_pack(|p| {
            let mut loaded = None;
            for (i, &to) in which.zip(phys) {
                let m = before[i];
                let whole = if m.is_packed() {
                    self.member_content(&m, &mut p.raw, &mut p.plain, &mut loaded)?;
                    let at = m.member() as usize * BLOCK_SIZE;
                    match p.plain.get(at..at + BLOCK_SIZE) {
                        Some(src) if crc32c::crc32c(src) == m.crc => {
                            let blk = aligned(&mut p.stage, BLOCK_SIZE);
                            blk.copy_from_slice(src);
                            true
                        }
                        _ => false,
                    }
                } else {
                    let blk = aligned(&mut p.stage, BLOCK_SIZE);
                    self.dev_read(&mut blk[..], self.layout.phys_off(m.phys))?;
                    crc32c::crc32c(&blk[..]) == m.crc
                };
                let copy = if whole {
                    let blk = aligned(&mut p.stage, BLOCK_SIZE);
                    self.dev_write(&blk[..], self.layout.phys_off(to), IoKind::Data)?;
                    kept_copy(&m, to)
                } else {
                    lock(&self.pool).release(to);
                    kept_bad(&m)
                };
                Record::PreserveCopy {
                    slot: ext.slot,
                    block: first + i as u32,
                    snapshot: floor,
                    meta: copy,
                }
                .push(records);
            }
            Ok(())
        })
    }

    /// Makes `plain` hold the decompressed group of packed block `m`, reusing the group
    /// `loaded` names when it is `m`'s (a damaged stream leaves zeros, which `m`'s crc
    /// refuses).
    fn member_content(
        &self,
        m: &BlockMeta,
        raw: &mut Option<AlignedBuf>,
        plain: &mut Vec<u8>,
        loaded: &mut Option<(BlockMeta, bool)>,
    ) -> Result<(), EngineError> {
        if loaded.is_some_and(|(l, _)| l.same_storage(m)) {
            return Ok(());
        }
        let ok = self.load_stream(m, raw, plain)?;
        if !ok {
            plain.clear();
            plain.resize(m.group_blocks() as usize * BLOCK_SIZE, 0);
        }
        *loaded = Some((*m, ok));
        Ok(())
    }

    /// Fills the places in `buf` of the packed blocks of `metas` (plain ones are read by
    /// `read_runs`): one read and one decompression per stream. A stream that does not
    /// decompress leaves zeros, which its members' crcs then refuse (unless they were
    /// zeros).
    pub(super) fn read_packed(
        &self,
        metas: &[BlockMeta],
        buf: &mut [u8],
    ) -> Result<(), EngineError> {
        with_pack(|p| {
            let mut loaded: Option<(BlockMeta, bool)> = None;
            for (i, m) in metas.iter().enumerate() {
                if !m.is_packed() {
                    continue;
                }
                let ok = match loaded {
                    Some((l, ok)) if l.same_storage(m) => ok,
                    _ => {
                        let ok = self.load_stream(m, &mut p.raw, &mut p.plain)?;
                        loaded = Some((*m, ok));
                        ok
                    }
                };
                let dst = &mut buf[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE];
                let at = m.member() as usize * BLOCK_SIZE;
                match p.plain.get(at..at + BLOCK_SIZE) {
                    Some(src) if ok => dst.copy_from_slice(src),
                    _ => dst.fill(0),
                }
            }
            Ok(())
        })
    }

    /// [`Drive::write_piece`] for an extent with a codec: claims the piece widened to
    /// whole groups (the blocks outside the piece only when they are packed: a write to
    /// part of a compressed group rewrites the group), compresses each group, takes
    /// storage (a run of consecutive blocks per stream, one block per plain block),
    /// writes, and queues one Data record per claimed block. Returns (blocks of the piece
    /// written, the batch to wait for).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn write_piece_packed(
        &self,
        ext: &Extent,
        first: u32,
        count: u32,
        data: &[u8],
        crcs: &[u32],
        version_of: impl Fn(usize) -> u64,
        accept: impl Fn(usize, &BlockMeta, &BlockMeta) -> bool,
        codec: Compression,
    ) -> Result<(u32, u64), EngineError> {
        let g = COMPRESSION_GROUP_BLOCKS;
        let bpe = self.layout.blocks_per_extent;
        let gfirst = first - first % g;
        let gend = (first + count).div_ceil(g).saturating_mul(g).min(bpe);
        let n = gend - gfirst;
        let off = (first - gfirst) as usize;
        let covered = |j: usize| j >= off && j - off < count as usize;
        with_scratch(|s| {
            let (claimed, need_seq) = self.claim(
                ext,
                gfirst,
                n,
                |j, cur| {
                    if covered(j) {
                        BlockMeta::data(version_of(j - off), crcs[j - off], 0)
                    } else {
                        *cur
                    }
                },
                |j, cur, new| {
                    if covered(j) {
                        accept(j - off, cur, new)
                    } else {
                        cur.is_packed()
                    }
                },
                &mut s.applied,
                Some(&mut s.metas),
            )?;
            let written = applied_indexes(&s.applied).filter(|&j| covered(j)).count() as u32;
            self.counters
                .skipped_blocks
                .fetch_add(u64::from(count - written), Ordering::Relaxed);
            let seq = need_seq.max(ext.epoch_seq.load(Ordering::Acquire));
            if claimed == 0 {
                return Ok((0, seq));
            }
            // The claim's blocks outside the piece keep their versions (never preserved).
            let claim_version = |j: usize| {
                if covered(j) {
                    version_of(j - off)
                } else {
                    s.metas[j].version
                }
            };
            let floor = if ext.floor.load(Ordering::Acquire) > 0 {
                match self.plan_preserves(ext, &s.applied, &s.metas, &claim_version) {
                    Ok(f) => f,
                    Err(e) => {
                        self.unclaim(ext, gfirst, &s.applied, &s.metas);
                        return Err(e);
                    }
                }
            } else {
                0
            };
            let Scratch {
                applied,
                records,
                metas,
                metas2: finals,
                ..
            } = s;
            finals.clear();
            let res = with_pack(|p| {
                self.pack_piece(
                    ext,
                    gfirst,
                    (off, count),
                    data,
                    crcs,
                    &version_of,
                    codec,
                    floor,
                    applied,
                    metas,
                    p,
                    records,
                    finals,
                )
            });
            if let Err(EngineError::Full {
                committed_bytes,
                capacity_bytes,
            }) = res
            {
                // Refused before anything was written or queued: the blocks go back to
                // the states they had, and the drive serves on.
                self.unclaim(ext, gfirst, applied, metas);
                return Err(EngineError::Full {
                    committed_bytes,
                    capacity_bytes,
                });
            }
            if let Err(e) = &res {
                // The data on disk may no longer match what we know: stop acking.
                self.fail(e);
            }
            let done = *res.as_ref().unwrap_or(&0);
            self.release_with(ext, gfirst, applied, done, |k, m| {
                if let Some(f) = finals.get(k) {
                    *m = *f;
                }
            });
            Ok((written, seq.max(res?)))
        })
    }

    /// Plans, stores and records a claimed piece (see [`Drive::write_piece_packed`]):
    /// pushes each claimed block's final metadata onto `finals`, returns the batch holding
    /// the records.
    #[allow(clippy::too_many_arguments)]
    fn pack_piece(
        &self,
        ext: &Extent,
        gfirst: u32,
        (off, count): (usize, u32),
        data: &[u8],
        crcs: &[u32],
        version_of: &impl Fn(usize) -> u64,
        codec: Compression,
        floor: u32,
        applied: &[bool],
        before: &[BlockMeta],
        p: &mut PackScratch,
        records: &mut Vec<u8>,
        finals: &mut Vec<BlockMeta>,
    ) -> Result<u64, EngineError> {
        const B: usize = BLOCK_SIZE;
        let g = COMPRESSION_GROUP_BLOCKS as usize;
        let n = applied.len();
        let covered = |j: usize| j >= off && j - off < count as usize;
        let version = |j: usize| {
            if covered(j) {
                version_of(j - off)
            } else {
                before[j].version
            }
        };
        let crc = |j: usize| {
            if covered(j) {
                crcs[j - off]
            } else {
                before[j].crc
            }
        };
        let PackScratch {
            raw,
            plain,
            input,
            out,
            stage,
            kinds,
            groups,
            reqs,
            req_of,
            taken,
            group_idx,
            phys_of,
            stream_of,
            copies,
            copy_of,
            copy_phys,
            copy_bad,
        } = p;
        // States the write replaces that the snapshot at `floor` reads: a plain one moves
        // into the snapshot's shadow (Preserve); a packed one is copied out of its stream
        // into a block of its own (PreserveCopy), as the group's other members still name
        // the stream.
        copies.clear();
        copy_of.clear();
        copy_bad.clear();
        {
            let mut loaded: Option<(BlockMeta, bool)> = None;
            for j in applied_indexes(applied) {
                let m = before[j];
                if !(m.is_packed() && must_preserve(floor, &m, version(j))) {
                    continue;
                }
                self.member_content(&m, raw, plain, &mut loaded)?;
                let at = m.member() as usize * B;
                match plain.get(at..at + B) {
                    Some(src) if crc32c::crc32c(src) == m.crc => {
                        copies.extend_from_slice(src);
                        copy_of.push(j);
                    }
                    _ => copy_bad.push(j),
                }
            }
        }
        input.clear();
        input.resize(n * B, 0);
        out.clear();
        kinds.clear();
        kinds.resize(n, Kind::Idle);
        groups.clear();

        // Plan: each claimed block's content, and which groups compress.
        for j0 in (0..n).step_by(g) {
            let j1 = (j0 + g).min(n);
            let mut loaded: Option<(BlockMeta, bool)> = None;
            let mut members = 0;
            for j in j0..j1 {
                if !applied[j] {
                    continue;
                }
                let dst = &mut input[j * B..(j + 1) * B];
                if covered(j) {
                    dst.copy_from_slice(&data[(j - off) * B..(j - off + 1) * B]);
                    kinds[j] = Kind::Plain;
                    members += 1;
                    continue;
                }
                // A packed block outside the piece, rewritten with its group: its content
                // from its stream, checked against its crc.
                let m = before[j];
                let ok = match loaded {
                    Some((l, ok)) if l.same_storage(&m) => ok,
                    _ => {
                        let ok = self.load_stream(&m, raw, plain)?;
                        loaded = Some((m, ok));
                        ok
                    }
                };
                let at = m.member() as usize * B;
                match plain.get(at..at + B) {
                    Some(src) if ok && crc32c::crc32c(src) == m.crc => {
                        dst.copy_from_slice(src);
                        kinds[j] = Kind::Plain;
                        members += 1;
                    }
                    _ => kinds[j] = Kind::Keep,
                }
            }
            // A whole group with two or more blocks to store compresses when its stream
            // takes fewer blocks than they would.
            if j1 - j0 == g && members >= 2 {
                let out_at = out.len();
                out.resize(out_at + codec::scratch_bytes(g * B), 0);
                let len = codec::compress(codec, &input[j0 * B..j1 * B], &mut out[out_at..]);
                match len {
                    Some(len) if len.div_ceil(B) < members => {
                        let end = out_at + len.div_ceil(B) * B;
                        out[out_at + len..end].fill(0);
                        out.truncate(end);
                        groups.push(GroupPlan {
                            j0,
                            len: len as u32,
                            out_at,
                        });
                        for k in kinds[j0..j1].iter_mut().filter(|k| **k == Kind::Plain) {
                            *k = Kind::Member;
                        }
                    }
                    _ => out.truncate(out_at),
                }
            }
        }

        // Storage: a run per stream, a block per plain block; when free space is too
        // fragmented for the runs, every group is stored plainly instead.
        for attempt in 0..2 {
            reqs.clear();
            req_of.clear();
            group_idx.clear();
            group_idx.resize(n.div_ceil(g), usize::MAX);
            for (i, gp) in groups.iter().enumerate() {
                group_idx[gp.j0 / g] = i;
            }
            for j in 0..n {
                let home = |j: usize| self.layout.home_block(ext.slot, gfirst + j as u32);
                match kinds[j] {
                    Kind::Plain => {
                        reqs.push((home(j), 1));
                        req_of.push(Req::Block(j));
                    }
                    // The group's first member asks for its stream.
                    Kind::Member if !kinds[j - j % g..j].contains(&Kind::Member) => {
                        let gi = group_idx[j / g];
                        let gp = &groups[gi];
                        reqs.push((home(gp.j0), gp.len.div_ceil(B as u32)));
                        req_of.push(Req::Group(gi));
                    }
                    _ => {}
                }
            }
            for (ci, &j) in copy_of.iter().enumerate() {
                reqs.push((self.layout.home_block(ext.slot, gfirst + j as u32), 1));
                req_of.push(Req::Copy(ci));
            }
            let need: u64 = reqs.iter().map(|&(_, l)| u64::from(l)).sum();
            self.check_thin_room(ext, need)?;
            taken.clear();
            let got = loop {
                match lock(&self.pool).take_runs(reqs, taken) {
                    Take::Taken => break true,
                    Take::Fragmented => break false,
                    Take::Short => self.wait_free_blocks(need)?,
                }
            };
            if got {
                break;
            }
            assert_eq!(attempt, 0, "single blocks are never fragmented");
            for k in kinds.iter_mut().filter(|k| **k == Kind::Member) {
                *k = Kind::Plain;
            }
            groups.clear();
        }

        // Write: what the runs hold, staged in request order, one pwrite per stretch that
        // is consecutive on the device.
        let total: usize = reqs.iter().map(|&(_, l)| l as usize * B).sum();
        let st = aligned(stage, total.max(B));
        let mut at = 0usize;
        let mut run: Option<(u32, usize)> = None; // (first physical block, stage offset)
        for (k, (&(_, len), &what)) in reqs.iter().zip(req_of.iter()).enumerate() {
            let bytes = len as usize * B;
            let src = match what {
                Req::Group(gi) => {
                    let gp = &groups[gi];
                    &out[gp.out_at..gp.out_at + bytes]
                }
                Req::Block(j) => &input[j * B..(j + 1) * B],
                Req::Copy(ci) => &copies[ci * B..(ci + 1) * B],
            };
            let phys = taken[k];
            if let Some((p0, s0)) = run {
                if p0 as usize + (at - s0) / B != phys as usize {
                    self.dev_write(&st[s0..at], self.layout.phys_off(p0), IoKind::Data)?;
                    run = None;
                }
            }
            if run.is_none() {
                run = Some((phys, at));
            }
            st[at..at + bytes].copy_from_slice(src);
            at += bytes;
        }
        if let Some((p0, s0)) = run {
            self.dev_write(&st[s0..at], self.layout.phys_off(p0), IoKind::Data)?;
        }

        // Records, and each claimed block's final metadata.
        phys_of.clear();
        phys_of.resize(n, u32::MAX);
        stream_of.clear();
        stream_of.resize(groups.len(), u32::MAX);
        copy_phys.clear();
        copy_phys.resize(copy_of.len(), u32::MAX);
        for (k, &what) in req_of.iter().enumerate() {
            match what {
                Req::Group(gi) => stream_of[gi] = taken[k],
                Req::Block(j) => phys_of[j] = taken[k],
                Req::Copy(ci) => copy_phys[ci] = taken[k],
            }
        }
        records.clear();
        finals.clear();
        // The snapshot's states first: the writes below replace them in the same batch.
        let mut ci = 0;
        for j in applied_indexes(applied) {
            let m = before[j];
            if !must_preserve(floor, &m, version(j)) {
                continue;
            }
            let block = gfirst + j as u32;
            if m.is_packed() {
                let copy = if copy_bad.contains(&j) {
                    kept_bad(&m)
                } else {
                    ci += 1;
                    kept_copy(&m, copy_phys[ci - 1])
                };
                Record::PreserveCopy {
                    slot: ext.slot,
                    block,
                    snapshot: floor,
                    meta: copy,
                }
                .push(records);
            } else {
                Record::Preserve {
                    slot: ext.slot,
                    block,
                    snapshot: floor,
                    meta: m,
                }
                .push(records);
            }
        }
        for j in applied_indexes(applied) {
            let meta = match kinds[j] {
                Kind::Keep | Kind::Idle => before[j],
                Kind::Plain => BlockMeta::data(version(j), crc(j), phys_of[j]),
                Kind::Member => {
                    let gi = group_idx[j / g];
                    let gp = &groups[gi];
                    BlockMeta::packed(
                        version(j),
                        crc(j),
                        stream_of[gi],
                        codec,
                        (j - gp.j0) as u32,
                        g as u32,
                        gp.len,
                    )
                }
            };
            finals.push(meta);
            Record::Data {
                slot: ext.slot,
                block: gfirst + j as u32,
                crc: meta.crc,
                version: meta.version,
                phys: meta.phys,
                hold: false,
                pack: meta.pack_bits(),
            }
            .push(records);
        }
        self.enqueue(records, false)
    }

    /// A write to a thin extent (one with a codec) may take `need` more physical blocks
    /// only while the drive keeps what its plain extents may still write (each holds its
    /// whole size) and half its spare blocks (the room out-of-place writes need): else it
    /// fails with [`EngineError::Full`] and the owner rebuilds that copy elsewhere, rather
    /// than a plain extent's write finding no block.
    fn check_thin_room(&self, ext: &Extent, need: u64) -> Result<(), EngineError> {
        if self.layout.overcommit <= 1 || ext.codec().is_none() {
            return Ok(());
        }
        let bpe = u64::from(self.layout.blocks_per_extent);
        let plain_unwritten = (self.plain_extents.load(Ordering::Relaxed) * bpe)
            .saturating_sub(self.plain_stored.load(Ordering::Relaxed));
        let keep = plain_unwritten + self.layout.spare_blocks() / 2;
        let free = lock(&self.pool).free();
        if free < need + keep {
            return Err(EngineError::Full {
                committed_bytes: self.committed_blocks() * BLOCK,
                capacity_bytes: self.layout.extent_blocks() * BLOCK,
            });
        }
        Ok(())
    }
}
