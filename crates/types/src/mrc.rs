//! Miss-ratio curves: how often a block was used again, by reuse distance, so that the hit
//! ratio of an LRU cache of any size can be read off. The estimator that builds them from
//! sampled block addresses (SHARDS) is `converge_engine::shards`; this is the result, as the
//! API carries it.
//!
//! The *reuse distance* of an access is the number of distinct other blocks accessed since
//! the same block was last accessed; an LRU cache of `C` blocks holds it then iff the
//! distance is below `C`. First accesses have none (a cold miss at every size).

use serde::{Deserialize, Serialize};

/// Distances below this are bucketed one by one.
const LINEAR: usize = 16;
/// Above them, each power of two is split in this many buckets (12.5 % wide).
const SUB: usize = 8;
/// Largest power of two a distance is bucketed under: 2^44 blocks (64 PiB of 4 KiB).
const MAX_EXP: usize = 44;
/// Buckets of a curve.
pub const BUCKETS: usize = LINEAR + (MAX_EXP - 4 + 1) * SUB;

/// The bucket a reuse distance (in blocks) falls in.
pub fn bucket_of(d: f64) -> usize {
    if d.is_nan() || d < 0.0 {
        return 0;
    }
    if d < LINEAR as f64 {
        return d as usize;
    }
    let e = (d.log2().floor() as usize).clamp(4, MAX_EXP);
    let frac = d / (2f64).powi(e as i32) - 1.0;
    let sub = ((frac * SUB as f64) as usize).min(SUB - 1);
    (LINEAR + (e - 4) * SUB + sub).min(BUCKETS - 1)
}

/// Distances of bucket `i`: `[lower, upper)`.
pub fn bucket_range(i: usize) -> (f64, f64) {
    if i < LINEAR {
        return (i as f64, i as f64 + 1.0);
    }
    let e = 4 + (i - LINEAR) / SUB;
    let sub = (i - LINEAR) % SUB;
    let p = (2f64).powi(e as i32);
    (
        p * (1.0 + sub as f64 / SUB as f64),
        p * (1.0 + (sub + 1) as f64 / SUB as f64),
    )
}

/// A miss-ratio curve: estimated accesses by reuse distance, all of them and reads alone
/// (a read cache is judged by its reads; writes still make blocks recent).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Mrc {
    /// Share of blocks sampled when the curve was taken (1: every block).
    pub rate: f64,
    /// Accesses sampled (each stands for 1 / rate accesses at the rate of its time).
    pub samples: u64,
    /// Estimated accesses, all and reads.
    pub refs: f64,
    pub reads: f64,
    /// Estimated distinct blocks accessed (sampled blocks tracked ÷ rate).
    pub blocks: f64,
    /// Estimated accesses per distance bucket ([`bucket_range`]), all and reads; empty
    /// before the first reuse.
    pub all: Vec<f64>,
    pub read: Vec<f64>,
}

impl Mrc {
    /// Hit ratio an LRU cache of `cache_blocks` blocks would have had, over reads or all
    /// accesses; None without any. Within the bucket `cache_blocks` falls in, accesses are
    /// taken as evenly spread.
    pub fn hit_ratio(&self, cache_blocks: u64, reads_only: bool) -> Option<f64> {
        let (hist, total) = if reads_only {
            (&self.read, self.reads)
        } else {
            (&self.all, self.refs)
        };
        if total <= 0.0 {
            return None;
        }
        let c = cache_blocks as f64;
        let mut hits = 0.0;
        for (i, &n) in hist.iter().enumerate() {
            let (lo, hi) = bucket_range(i);
            if hi <= c {
                hits += n;
            } else if lo < c {
                hits += n * (c - lo) / (hi - lo);
            }
        }
        Some((hits / total).clamp(0.0, 1.0))
    }

    /// The hit ratio if every block could be kept: all but first accesses.
    pub fn max_hit_ratio(&self, reads_only: bool) -> Option<f64> {
        self.hit_ratio(u64::MAX, reads_only)
    }

    /// Adds one estimated access at distance `d` (None: a first access) of weight `w`.
    pub fn add(&mut self, d: Option<f64>, read: bool, w: f64) {
        self.refs += w;
        if read {
            self.reads += w;
        }
        if let Some(d) = d {
            if self.all.is_empty() {
                self.all = vec![0.0; BUCKETS];
                self.read = vec![0.0; BUCKETS];
            }
            let i = bucket_of(d);
            self.all[i] += w;
            if read {
                self.read[i] += w;
            }
        }
    }
}

/// The cache tier's own policy simulated at one cache size on the sampled blocks (a
/// miniature simulation, Waldspurger et al., ATC '17: `converge_engine::minisim`): what the
/// tier would have hit, where [`Mrc`] says what an LRU cache could.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TierHit {
    /// The cache log's size simulated, bytes.
    pub cache_bytes: u64,
    /// The mode simulated (`read-write`: the read cache's policy).
    pub mode: crate::CacheMode,
    /// Share of blocks the simulation saw when taken (the estimator's rate).
    pub rate: f64,
    /// Sampled reads it saw, and how many of them hit.
    pub reads: u64,
    pub read_hits: u64,
}

impl TierHit {
    /// Read hit ratio; None before any sampled read.
    pub fn read_hit_ratio(&self) -> Option<f64> {
        (self.reads > 0).then(|| self.read_hits as f64 / self.reads as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_distance_once_in_order() {
        let mut prev_hi = 0.0;
        for i in 0..BUCKETS {
            let (lo, hi) = bucket_range(i);
            assert_eq!(
                lo,
                prev_hi,
                "bucket {i} starts where {} ended",
                i.max(1) - 1
            );
            assert!(hi > lo);
            assert_eq!(bucket_of(lo), i, "lower bound of {i}");
            assert_eq!(bucket_of((lo + hi) / 2.0), i);
            prev_hi = hi;
        }
        assert_eq!(bucket_of(3.0), 3);
        assert_eq!(bucket_of(1e30), BUCKETS - 1);
        assert_eq!(bucket_of(f64::NAN), 0);
    }

    #[test]
    fn hit_ratios_read_off_the_buckets() {
        let mut m = Mrc {
            rate: 1.0,
            ..Mrc::default()
        };
        assert_eq!(m.hit_ratio(10, false), None);
        // Two first accesses, a reuse at distance 0 (read) and one at 100 (write).
        m.add(None, true, 1.0);
        m.add(None, false, 1.0);
        m.add(Some(0.0), true, 1.0);
        m.add(Some(100.0), false, 1.0);
        assert_eq!(m.hit_ratio(0, false), Some(0.0));
        assert_eq!(m.hit_ratio(1, false), Some(0.25));
        assert_eq!(m.hit_ratio(1, true), Some(0.5));
        assert_eq!(m.max_hit_ratio(false), Some(0.5));
        // 100 is in [96, 104): a cache of 100 blocks counts half of it.
        assert_eq!(bucket_range(bucket_of(100.0)), (96.0, 104.0));
        assert_eq!(m.hit_ratio(100, false), Some(0.375));
        assert_eq!(m.hit_ratio(104, false), Some(0.5));
    }
}
