//! Free physical data blocks. Every block of every extent lives in some physical block of
//! the data region (its metadata names which); a write always goes to a free one, and the
//! block it replaces is given back only once the record naming the new one is durable. So
//! no write ever touches data a durable record still points at: a crash leaves every
//! block's previous content intact (docs/FORMAT-engine.md, "Write path").
//!
//! The map lives only in memory; `open` rebuilds it from the durable metadata.

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
            self.written[(p / 64) as usize] |= 1 << (p % 64);
        }
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
        self.used[(p / 64) as usize] |= 1 << (p % 64);
        self.written[(p / 64) as usize] |= 1 << (p % 64);
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
        if let Some(p) = self.scan(true) {
            return p;
        }
        self.scan(false).expect("next_free on a full pool")
    }

    /// The first block from the cursor (wrapping) that is free (and written, with
    /// `written_only`).
    fn scan(&self, written_only: bool) -> Option<u32> {
        let words = self.used.len();
        let mut p = self.cursor;
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

    #[test]
    fn mark_refuses_used_and_out_of_range() {
        let mut p = Pool::new(64, 0);
        assert!(p.mark(63));
        assert!(!p.mark(63));
        assert!(!p.mark(64));
        assert_eq!(p.free(), 63);
    }
}
