//! Free physical data blocks. Every block of every extent lives in some physical block of
//! the data region (its metadata names which); a write always goes to a free one, and the
//! block it replaces is given back only once the record naming the new one is durable. So
//! no write ever touches data a durable record still points at: a crash leaves every
//! block's previous content intact (docs/FORMAT-engine.md, "Write path").
//!
//! The map lives only in memory; `open` rebuilds it from the durable metadata.

/// What [`Pool::take_runs`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Take {
    Taken,
    Short,
    Fragmented,
}

/// A bitmap of the data region's physical blocks (set = in use) with a next-fit cursor.
pub(crate) struct Pool {
    used: Vec<u64>,
    /// Blocks known to hold space in the drive file: written since open, the spare area
    /// (`format` writes it), and, at open, every block of an allocated extent's slot and
    /// every block metadata names. A write that cannot go home takes one of these before
    /// any other: on a sparse file (or tmpfs, where RAM drives live) a block written for
    /// the first time costs the file system an allocation on the data path, so relocated
    /// blocks stay within the space the drive already holds (when the drive is not full,
    /// there are as many such free blocks as spare ones).
    written: Vec<u64>,
    total: u32,
    free: u64,
    /// Free blocks that are also written: when none is left (the spare area used up, as
    /// after a snapshot keeps the blocks writes replace), the search for one is skipped
    /// rather than run over the whole map for every block taken.
    free_written: u64,
    /// Where the search for a block that cannot go home starts (next fit: a run of
    /// requests gets consecutive blocks while free space is contiguous).
    cursor: u32,
    /// First block that is nobody's home: the spare area.
    spare_start: u32,
}

impl Pool {
    /// `total` blocks, all free; the cursor starts at `spare_start` (the first block that
    /// is nobody's home), so relocated blocks fill the spare area before anyone's home,
    /// and goes back to the lowest spare block given back.
    pub fn new(total: u32, spare_start: u32) -> Pool {
        let words = (total as usize).div_ceil(64);
        let mut pool = Pool {
            used: vec![0; words],
            written: vec![0; words],
            total,
            free: u64::from(total),
            free_written: 0,
            cursor: if spare_start < total { spare_start } else { 0 },
            spare_start,
        };
        pool.note_written(spare_start, total.saturating_sub(spare_start));
        pool
    }

    /// Records that blocks `[first, first + count)` hold space in the drive file.
    pub fn note_written(&mut self, first: u32, count: u32) {
        let end = first.saturating_add(count).min(self.total);
        for p in first..end {
            let (w, bit) = ((p / 64) as usize, 1u64 << (p % 64));
            if self.written[w] & bit == 0 && self.used[w] & bit == 0 {
                self.free_written += 1;
            }
            self.written[w] |= bit;
        }
    }

    /// Physical blocks in the map.
    pub fn total(&self) -> u32 {
        self.total
    }

    pub fn free(&self) -> u64 {
        self.free
    }

    pub fn is_used(&self, p: u32) -> bool {
        p < self.total && self.used[(p / 64) as usize] & (1 << (p % 64)) != 0
    }

    /// Marks `p` in use; false if it is out of range or already in use.
    pub fn mark(&mut self, p: u32) -> bool {
        if p >= self.total || self.is_used(p) {
            return false;
        }
        let (w, bit) = ((p / 64) as usize, 1u64 << (p % 64));
        if self.written[w] & bit != 0 {
            self.free_written -= 1;
        }
        self.used[w] |= bit;
        self.written[w] |= bit;
        self.free -= 1;
        true
    }

    /// Gives `p` back. Releasing a free block is a bug in the caller; it is ignored (and
    /// asserted in debug builds) rather than corrupting the count.
    pub fn release(&mut self, p: u32) {
        debug_assert!(self.is_used(p), "physical block {p} released twice");
        if self.is_used(p) {
            self.used[(p / 64) as usize] &= !(1 << (p % 64));
            self.free += 1;
            // A block in use is written (`mark`).
            self.free_written += 1;
            // Reuse spare blocks before going on through the device: relocated blocks
            // stay in a small area (a drive file is not touched all over, which on a
            // sparse file costs an allocation per new block, and reads stay local).
            if p >= self.spare_start && p < self.cursor {
                self.cursor = p;
            }
        }
    }

    /// The next free block at or after the cursor (wrapping) that holds space in the
    /// drive file, if there is one (`written`), else the next free one; the pool must not
    /// be full.
    fn next_free(&mut self) -> u32 {
        if self.free_written > 0 {
            if let Some(p) = self.scan(true) {
                return p;
            }
        }
        self.scan(false).expect("next_free on a full pool")
    }

    /// The first block from the cursor (wrapping) that is free (and written, with
    /// `written_only`).
    fn scan(&self, written_only: bool) -> Option<u32> {
        self.scan_from(self.cursor, written_only)
    }

    /// The first block from `start` (wrapping) that is free (and written, with
    /// `written_only`).
    fn scan_from(&self, start: u32, written_only: bool) -> Option<u32> {
        let words = self.used.len();
        let mut p = start;
        for _ in 0..=words {
            if p >= self.total {
                p = 0;
            }
            let w = (p / 64) as usize;
            let mut bits = self.used[w] | ((1u64 << (p % 64)) - 1);
            if written_only {
                bits |= !self.written[w];
            }
            if bits != u64::MAX {
                let q = w as u32 * 64 + (!bits).trailing_zeros();
                if q < self.total {
                    return Some(q);
                }
            }
            p = (w as u32 + 1) * 64;
        }
        None
    }

    /// Whether `[first, first + len)` is in range and free.
    fn run_free(&self, first: u32, len: u32) -> bool {
        first
            .checked_add(len)
            .is_some_and(|end| end <= self.total && (first..end).all(|p| !self.is_used(p)))
    }

    /// The first run of `len` free blocks from the cursor (wrapping once; written blocks
    /// first, as [`Pool::take`]), if free space is not too fragmented for one.
    fn find_run(&self, len: u32) -> Option<u32> {
        for written_only in [true, false] {
            if written_only && self.free_written < u64::from(len) {
                continue;
            }
            let mut p = self.cursor;
            let mut visited = 0u64;
            while visited <= u64::from(self.total) {
                let Some(q) = self.scan_from(p, written_only) else {
                    break;
                };
                // Distance moved, wrapping.
                visited += u64::from(if q >= p { q - p } else { self.total - p + q }) + 1;
                let whole = q.checked_add(len).is_some_and(|end| end <= self.total)
                    && (q..q + len).all(|x| {
                        !self.is_used(x)
                            && (!written_only
                                || self.written[(x / 64) as usize] & (1 << (x % 64)) != 0)
                    });
                if whole {
                    return Some(q);
                }
                p = if q + 1 >= self.total { 0 } else { q + 1 };
            }
        }
        None
    }

    /// Takes, per request `(home, len)`, `len` consecutive free blocks: from `home` when
    /// they are all free, else the first such run from the cursor. Pushes each run's first
    /// block onto `out`, in order. All or nothing: [`Take::Short`] when fewer blocks are
    /// free than asked for, [`Take::Fragmented`] when some run cannot be found although
    /// enough blocks are free (the caller stores that data in single blocks instead).
    pub fn take_runs(&mut self, reqs: &[(u32, u32)], out: &mut Vec<u32>) -> Take {
        let need: u64 = reqs.iter().map(|&(_, l)| u64::from(l)).sum();
        if need > self.free {
            return Take::Short;
        }
        let at = out.len();
        for &(home, len) in reqs {
            let first = if self.run_free(home, len) {
                home
            } else if let Some(p) = self.find_run(len) {
                self.cursor = p + len;
                p
            } else {
                // Give back what this call took.
                for (k, &p) in out[at..].iter().enumerate() {
                    for x in p..p + reqs[k].1 {
                        self.release(x);
                    }
                }
                out.truncate(at);
                return Take::Fragmented;
            };
            for p in first..first + len {
                let fresh = self.mark(p);
                debug_assert!(fresh);
            }
            out.push(first);
        }
        if self.cursor >= self.total {
            self.cursor = 0;
        }
        Take::Taken
    }

    /// Takes one block per entry of `homes`: the home when it is free, else the next free
    /// one from the cursor. Pushes them onto `out` in order. Takes nothing and returns
    /// false when fewer than `homes.len()` blocks are free.
    pub fn take(&mut self, homes: impl ExactSizeIterator<Item = u32>, out: &mut Vec<u32>) -> bool {
        if (homes.len() as u64) > self.free {
            return false;
        }
        for h in homes {
            let p = if h < self.total && !self.is_used(h) {
                h
            } else {
                let p = self.next_free();
                self.cursor = p + 1;
                p
            };
            let fresh = self.mark(p);
            debug_assert!(fresh);
            out.push(p);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn homes_first_then_next_fit_and_exhaustion() {
        let mut p = Pool::new(200, 150);
        let mut out = Vec::new();
        assert!(p.take(10..14, &mut out));
        assert_eq!(out, [10, 11, 12, 13]);
        out.clear();
        // Homes taken: the cursor's blocks, consecutive.
        assert!(p.take(11..14, &mut out));
        assert_eq!(out, [150, 151, 152]);
        assert_eq!(p.free(), 193);
        p.release(11);
        out.clear();
        assert!(p.take([11, 12].into_iter(), &mut out));
        assert_eq!(out, [11, 153]);
        // A spare block given back is reused before the cursor goes on.
        p.release(151);
        out.clear();
        assert!(p.take([12, 12].into_iter(), &mut out));
        assert_eq!(out, [151, 154]);
        // Fill it, then one more fails without taking anything.
        out.clear();
        let left = p.free() as u32;
        assert!(p.take((0..left).map(|_| u32::MAX), &mut out));
        assert_eq!(p.free(), 0);
        let mut sorted = out.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), out.len(), "no block handed out twice");
        assert!(!p.take([5].into_iter(), &mut out));
        p.release(77);
        out.clear();
        assert!(p.take([u32::MAX].into_iter(), &mut out));
        assert_eq!(out, [77], "wraps around to the only free block");
    }

    /// The count of free, written blocks (which lets a search skip a pass over the whole
    /// map when there is none) stays equal to the map's through every kind of change; and
    /// with none left, blocks are still found.
    #[test]
    fn the_free_written_count_follows_the_map() {
        use rand::{Rng, SeedableRng};
        let recount = |p: &Pool| -> u64 {
            (0..p.total)
                .filter(|&b| !p.is_used(b) && p.written[(b / 64) as usize] & (1 << (b % 64)) != 0)
                .count() as u64
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let mut p = Pool::new(1000, 900);
        let mut held: Vec<u32> = Vec::new();
        assert_eq!(p.free_written, recount(&p));
        for step in 0..4000 {
            let mut out = Vec::new();
            match rng.gen_range(0..5) {
                0 if p.free() > 4 => {
                    let home = rng.gen_range(0..1100);
                    assert!(p.take((home..home + 3).map(|h| h % 1100), &mut out));
                }
                1 if p.free() > 8 => {
                    let reqs = [(rng.gen_range(0..1000), 4), (u32::MAX, 2)];
                    let _ = p.take_runs(&reqs, &mut out);
                    for (k, &f) in out.iter().enumerate() {
                        held.extend(f..f + reqs[k].1);
                    }
                    out.clear();
                }
                2 if !held.is_empty() => {
                    let i = rng.gen_range(0..held.len());
                    p.release(held.swap_remove(i));
                }
                3 => {
                    let b = rng.gen_range(0..1000);
                    if p.mark(b) {
                        held.push(b);
                    }
                }
                _ => p.note_written(rng.gen_range(0..1000), rng.gen_range(0..40)),
            }
            held.extend(out);
            assert_eq!(p.free_written, recount(&p), "step {step}");
        }
        // Every written block in use: the next block comes from the unwritten ones.
        let mut p = Pool::new(200, 190);
        let mut out = Vec::new();
        assert!(p.take(190..200, &mut out));
        assert_eq!(p.free_written, 0);
        out.clear();
        assert!(p.take([195].into_iter(), &mut out));
        assert!(out[0] < 190, "{out:?}");
    }

    /// A block that cannot go home takes a free block the drive file already holds (the
    /// spare area, or blocks written before) before one it never wrote.
    #[test]
    fn relocated_blocks_stay_in_written_space() {
        // 100 homes (blocks 0..100), 4 spare blocks (100..104).
        let mut p = Pool::new(104, 100);
        let mut out = Vec::new();
        // Blocks 0..10 written at home.
        assert!(p.take(0..10, &mut out));
        // Their overwrites fill the spares, then must go elsewhere: to written blocks only
        // once some are free (here: none yet, so the next free block, 10).
        out.clear();
        assert!(p.take(0..5, &mut out));
        assert_eq!(out, [100, 101, 102, 103, 10]);
        // The first versions become free (their records durable): blocks 0..5.
        for b in 0..5 {
            p.release(b);
        }
        // Overwrites of blocks 5..10 (at home) go to the written, free blocks 0..5 (and a
        // spare first, when one is free), not on into never-written homes 11.. .
        p.release(101);
        out.clear();
        assert!(p.take(5..10, &mut out));
        assert_eq!(out, [101, 0, 1, 2, 3]);
        assert!(out.iter().all(|&b| !(11..100).contains(&b)), "{out:?}");
    }

    /// Compressed streams take consecutive blocks: at home when free, else the first run
    /// from the cursor; all or nothing.
    #[test]
    fn runs_home_then_next_fit_all_or_nothing() {
        let mut p = Pool::new(40, 32);
        let mut out = Vec::new();
        assert_eq!(p.take_runs(&[(0, 3), (4, 2)], &mut out), Take::Taken);
        assert_eq!(out, [0, 4]);
        // Home 1..4 is partly used: the spare area's first run.
        out.clear();
        assert_eq!(p.take_runs(&[(1, 3)], &mut out), Take::Taken);
        assert_eq!(out, [32]);
        assert_eq!(p.free(), 40 - 8);
        // Fragment the rest: free blocks but no run of 4 from the spare area on.
        out.clear();
        assert_eq!(p.take_runs(&[(u32::MAX, 1); 5], &mut out), Take::Taken);
        let free_before = p.free();
        // Used: 0..3, 4..6, 32..40. Free: 3, 6..32 → a run of 4 exists at 6.
        out.clear();
        assert_eq!(p.take_runs(&[(u32::MAX, 4)], &mut out), Take::Taken);
        assert_eq!(out, [6]);
        for x in 6..10 {
            p.release(x);
        }
        assert_eq!(p.free(), free_before);
        // Every other block used: runs of 2 cannot be found; nothing is taken.
        let mut q = Pool::new(8, 8);
        for x in [0, 2, 4, 6] {
            assert!(q.mark(x));
        }
        out.clear();
        assert_eq!(
            q.take_runs(&[(u32::MAX, 1), (u32::MAX, 2)], &mut out),
            Take::Fragmented
        );
        assert!(out.is_empty());
        assert_eq!(q.free(), 4, "the single block taken first was given back");
        assert_eq!(q.take_runs(&[(u32::MAX, 5)], &mut out), Take::Short);
    }

    #[test]
    fn mark_refuses_used_and_out_of_range() {
        let mut p = Pool::new(64, 0);
        assert!(p.mark(63));
        assert!(!p.mark(63));
        assert!(!p.mark(64));
        assert_eq!(p.free(), 63);
    }
}
