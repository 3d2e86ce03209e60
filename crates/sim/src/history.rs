//! The clients' record of every write (issued, acked, failed, cut short by an owner crash)
//! and the checker that judges every block a read returns against it.
//!
//! Time here is a logical clock (`tick`) bumped at every issue and completion; the run is
//! single-threaded, so it orders events totally.
//!
//! A read of block `b` may return the content of write `w` (or zeros, standing for the
//! initial state and every zeroing) only if `w` covered `b`, was issued before the read
//! ended, and is not *superseded*: no write `w'` of `b` was acked before the read began
//! and issued after `w` ended (acked, failed or aborted). A `w'` issued after `w` ended
//! carries a higher version (same owner: higher sequence; a later owner: higher epoch), so
//! once acked it must hide `w` everywhere. In particular nothing older than the last ack
//! can come back, and an unacked write may resolve either way.

use crate::content::Decoded;
use converge_types::{Epoch, BLOCK_SIZE};
use std::collections::BTreeMap;
use std::fmt;

/// How a write ended, as the client saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    InFlight,
    Acked,
    Failed(String),
    /// The owner died with the write in flight (its task was aborted).
    Aborted,
}

#[derive(Clone, Debug)]
pub struct WriteRec {
    pub id: u64,
    pub volume: usize,
    pub first: u64,
    pub blocks: u64,
    pub zero: bool,
    pub epoch: Epoch,
    pub issue: u64,
    pub end: Option<u64>,
    pub outcome: Outcome,
}

impl fmt::Display for WriteRec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "w{} {} vol{} blocks {}..{} epoch {} issued@{} ended@{} {:?}",
            self.id,
            if self.zero { "zero" } else { "write" },
            self.volume,
            self.first,
            self.first + self.blocks,
            self.epoch,
            self.issue,
            self.end.map_or_else(|| "-".to_string(), |e| e.to_string()),
            self.outcome
        )
    }
}

/// What a clone's never-written blocks read as (docs/SIMULATION.md, "Clones"): its
/// parent's snapshot, judged as a read of the parent over the window the snapshot was
/// taken in.
#[derive(Clone, Copy, Debug)]
pub struct Base {
    /// The parent volume's index and content tag.
    pub volume: usize,
    pub tag: u64,
    /// The ticks the snapshot was taken between.
    pub start: u64,
    pub end: u64,
}

#[derive(Default)]
pub struct History {
    tick: u64,
    /// Per clone volume: what its initial state is (else zeros).
    bases: BTreeMap<usize, Base>,
    /// Index = write id - 1.
    writes: Vec<WriteRec>,
    /// (volume, block) -> ids of the writes covering it, in issue order.
    by_block: BTreeMap<(usize, u64), Vec<u64>>,
    pub reads_checked: u64,
    pub blocks_checked: u64,
    /// Blocks of clones that read as their parent snapshot's data (and passed).
    pub blocks_from_parents: u64,
}

impl History {
    pub fn tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    pub fn now(&self) -> u64 {
        self.tick
    }

    /// Records a write about to be issued; returns its id (the id is in its content).
    pub fn issue(
        &mut self,
        volume: usize,
        first: u64,
        blocks: u64,
        zero: bool,
        epoch: Epoch,
    ) -> u64 {
        let id = self.writes.len() as u64 + 1;
        let issue = self.tick();
        self.writes.push(WriteRec {
            id,
            volume,
            first,
            blocks,
            zero,
            epoch,
            issue,
            end: None,
            outcome: Outcome::InFlight,
        });
        for b in first..first + blocks {
            self.by_block.entry((volume, b)).or_default().push(id);
        }
        id
    }

    pub fn finish(&mut self, id: u64, outcome: Outcome) {
        let t = self.tick();
        if let Some(w) = id
            .checked_sub(1)
            .and_then(|i| self.writes.get_mut(i as usize))
        {
            w.end = Some(t);
            w.outcome = outcome;
        }
    }

    /// Volume `volume` is a clone: its blocks start as `base` holds them.
    pub fn set_base(&mut self, volume: usize, base: Base) {
        self.bases.insert(volume, base);
    }

    pub fn base(&self, volume: usize) -> Option<Base> {
        self.bases.get(&volume).copied()
    }

    pub fn get(&self, id: u64) -> Option<&WriteRec> {
        id.checked_sub(1).and_then(|i| self.writes.get(i as usize))
    }

    pub fn writes(&self) -> &[WriteRec] {
        &self.writes
    }

    /// Writes covering a block, for failure reports.
    pub fn block_writes(&self, volume: usize, block: u64) -> Vec<&WriteRec> {
        self.by_block
            .get(&(volume, block))
            .map(|ids| ids.iter().filter_map(|&id| self.get(id)).collect())
            .unwrap_or_default()
    }

    /// Is write `cand` (0 = the initial zeros) an acceptable answer for a read of `block`
    /// issued at `r_issue` and ended at `r_end`? Returns the superseding write if not.
    fn superseded_by(
        &self,
        volume: usize,
        block: u64,
        cand: u64,
        r_issue: u64,
        r_end: u64,
    ) -> Result<(), String> {
        let (c_issue, c_end) = match cand {
            0 => (0, Some(0)),
            id => match self.get(id) {
                Some(w) => (w.issue, w.end),
                None => return Err(format!("w{id} was never issued")),
            },
        };
        if c_issue >= r_end {
            return Err(format!("w{cand} was issued after the read ended"));
        }
        let Some(c_end) = c_end else {
            return Ok(()); // still in flight: concurrent with everything after it
        };
        let ids = self
            .by_block
            .get(&(volume, block))
            .map_or(&[][..], |v| &v[..]);
        for &id in ids {
            let Some(w) = self.get(id) else { continue };
            if w.outcome == Outcome::Acked && w.end.is_some_and(|e| e < r_issue) && w.issue > c_end
            {
                return Err(format!("superseded by acked {w}"));
            }
        }
        Ok(())
    }

    /// May block `b` of `volume` (content tag `tag`) read as `d` in a read over `(issue,
    /// end)`? Not `strict`: only that it is some write's content for that block.
    fn block_ok(
        &self,
        volume: usize,
        tag: u64,
        b: u64,
        d: Decoded,
        (r_issue, r_end): (u64, u64),
        strict: bool,
    ) -> Result<(), String> {
        match d {
            Decoded::Garbage => Err("content matches no write (garbage)".to_string()),
            Decoded::Write {
                volume: v,
                block,
                write,
            } if v == tag => {
                let covers = self.get(write).is_some_and(|w| {
                    w.volume == volume && !w.zero && (w.first..w.first + w.blocks).contains(&b)
                });
                if block != b || !covers {
                    Err(format!(
                        "content of volume tag {v} block {block} write w{write}, not written here"
                    ))
                } else if strict {
                    self.superseded_by(volume, b, write, r_issue, r_end)
                        .map_err(|e| format!("returned w{write}, {e}"))
                } else {
                    Ok(())
                }
            }
            Decoded::Zero if !strict => Ok(()),
            Decoded::Zero => {
                let mut why = Vec::new();
                for w in self.block_writes(volume, b).iter().filter(|w| w.zero) {
                    match self.superseded_by(volume, b, w.id, r_issue, r_end) {
                        Ok(()) => return Ok(()),
                        Err(e) => why.push(format!("w{}: {e}", w.id)),
                    }
                }
                match self.initial_ok(volume, b, d, (r_issue, r_end), strict) {
                    Ok(()) => Ok(()),
                    Err(e) => {
                        why.push(e);
                        Err(format!("returned zeros, but {}", why.join("; ")))
                    }
                }
            }
            Decoded::Write {
                volume: v,
                block,
                write,
            } => match self.bases.get(&volume) {
                Some(_) => self.initial_ok(volume, b, d, (r_issue, r_end), strict),
                None => Err(format!(
                    "content of volume tag {v} block {block} write w{write}, not written here"
                )),
            },
        }
    }

    /// May block `b` of `volume` still read as it was at first (zeros, or a clone's parent
    /// snapshot), holding `d`?
    fn initial_ok(
        &self,
        volume: usize,
        b: u64,
        d: Decoded,
        (r_issue, r_end): (u64, u64),
        strict: bool,
    ) -> Result<(), String> {
        if strict {
            self.superseded_by(volume, b, 0, r_issue, r_end)
                .map_err(|e| format!("w0 (the initial state): {e}"))?;
        }
        match self.bases.get(&volume) {
            None if d == Decoded::Zero => Ok(()),
            None => Err("not written here".to_string()),
            Some(base) => self
                .block_ok(base.volume, base.tag, b, d, (base.start, base.end), strict)
                .map_err(|e| {
                    format!(
                        "as vol{}'s snapshot (ticks {}..{}) reads it: {e}",
                        base.volume, base.start, base.end
                    )
                }),
        }
    }

    /// Checks every block of a read of `volume` from `first`; returns each bad block with
    /// why. Not `strict`: only that each block is some write's content for that block.
    #[allow(clippy::too_many_arguments)]
    pub fn check_read(
        &mut self,
        volume: usize,
        volume_tag: u64,
        first: u64,
        data: &[u8],
        r_issue: u64,
        r_end: u64,
        strict: bool,
    ) -> Vec<(u64, String)> {
        self.reads_checked += 1;
        let mut bad = Vec::new();
        for (i, blk) in data.chunks(BLOCK_SIZE).enumerate() {
            self.blocks_checked += 1;
            let b = first + i as u64;
            let verdict = self.block_ok(
                volume,
                volume_tag,
                b,
                crate::content::decode(blk),
                (r_issue, r_end),
                strict,
            );
            if verdict.is_ok()
                && matches!(crate::content::decode(blk), Decoded::Write { volume: v, .. } if v != volume_tag)
            {
                self.blocks_from_parents += 1;
            }
            if let Err(e) = verdict {
                bad.push((
                    b,
                    format!("vol{volume} block {b} (read issued@{r_issue} ended@{r_end}): {e}"),
                ));
            }
        }
        bad
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::content::push_block;

    fn content(w: u64, first: u64, n: u64) -> Vec<u8> {
        let mut v = Vec::new();
        for b in first..first + n {
            push_block(&mut v, 7, b, w);
        }
        v
    }

    #[test]
    fn checker_accepts_latest_and_concurrent_rejects_older() {
        let mut h = History::default();
        let e = Epoch(1);
        let w1 = h.issue(0, 0, 2, false, e);
        h.finish(w1, Outcome::Acked);
        // Before any other write: w1 or nothing else.
        let (i, t) = (h.tick(), h.tick());
        assert!(h
            .check_read(0, 7, 0, &content(w1, 0, 2), i, t, true)
            .is_empty());
        assert_eq!(h.check_read(0, 7, 0, &vec![0u8; 8192], i, t, true).len(), 2);
        let w2 = h.issue(0, 1, 1, false, e);
        // w2 in flight: a read may see w1 or w2 in block 1.
        let (i, t) = (h.tick(), h.tick());
        assert!(h
            .check_read(0, 7, 1, &content(w1, 1, 1), i, t, true)
            .is_empty());
        assert!(h
            .check_read(0, 7, 1, &content(w2, 1, 1), i, t, true)
            .is_empty());
        h.finish(w2, Outcome::Acked);
        let (i, t) = (h.tick(), h.tick());
        assert_eq!(
            h.check_read(0, 7, 1, &content(w1, 1, 1), i, t, true).len(),
            1
        );
        // A failed write may still show up, until a later acked write hides it.
        let w3 = h.issue(0, 1, 1, false, e);
        h.finish(w3, Outcome::Failed("x".into()));
        let (i, t) = (h.tick(), h.tick());
        assert!(h
            .check_read(0, 7, 1, &content(w3, 1, 1), i, t, true)
            .is_empty());
        assert!(h
            .check_read(0, 7, 1, &content(w2, 1, 1), i, t, true)
            .is_empty());
        let z = h.issue(0, 1, 1, true, e);
        h.finish(z, Outcome::Acked);
        let (i, t) = (h.tick(), h.tick());
        assert!(h
            .check_read(0, 7, 1, &vec![0u8; 4096], i, t, true)
            .is_empty());
        assert_eq!(
            h.check_read(0, 7, 1, &content(w3, 1, 1), i, t, true).len(),
            1
        );
        // Wrong block, wrong volume, garbage.
        assert_eq!(
            h.check_read(0, 7, 0, &content(w2, 1, 1), i, t, true).len(),
            1
        );
        assert_eq!(
            h.check_read(0, 8, 0, &content(w1, 0, 1), i, t, true).len(),
            1
        );
        let mut g = content(w1, 0, 1);
        g[100] ^= 1;
        assert_eq!(h.check_read(0, 7, 0, &g, i, t, true).len(), 1);
    }

    #[test]
    fn a_clone_reads_its_parent_snapshot_until_it_writes_the_block() {
        let mut h = History::default();
        let e = Epoch(1);
        // The parent (volume 0, tag 7) writes block 0, then a snapshot is taken, then it
        // writes block 0 again.
        let p1 = h.issue(0, 0, 1, false, e);
        h.finish(p1, Outcome::Acked);
        let (start, end) = (h.tick(), h.tick());
        let p2 = h.issue(0, 0, 1, false, e);
        h.finish(p2, Outcome::Acked);
        h.set_base(
            1,
            Base {
                volume: 0,
                tag: 7,
                start,
                end,
            },
        );
        let clone = |w: u64| {
            let mut v = Vec::new();
            push_block(&mut v, 8, 0, w);
            v
        };
        let (i, t) = (h.tick(), h.tick());
        // The clone (volume 1, tag 8) reads the snapshot's block, not the parent's later
        // write, nor zeros.
        assert!(h
            .check_read(1, 8, 0, &content(p1, 0, 1), i, t, true)
            .is_empty());
        assert_eq!(
            h.check_read(1, 8, 0, &content(p2, 0, 1), i, t, true).len(),
            1
        );
        assert_eq!(h.check_read(1, 8, 0, &[0u8; 4096], i, t, true).len(), 1);
        // Once the clone's own write is acked, the parent's block is superseded.
        let c1 = h.issue(1, 0, 1, false, e);
        let (i, t) = (h.tick(), h.tick());
        assert!(h
            .check_read(1, 8, 0, &content(p1, 0, 1), i, t, true)
            .is_empty());
        assert!(h.check_read(1, 8, 0, &clone(c1), i, t, true).is_empty());
        h.finish(c1, Outcome::Acked);
        let (i, t) = (h.tick(), h.tick());
        assert_eq!(
            h.check_read(1, 8, 0, &content(p1, 0, 1), i, t, true).len(),
            1
        );
        assert!(h.check_read(1, 8, 0, &clone(c1), i, t, true).is_empty());
    }
}
