//! A working-set estimator: spatially hashed sampling of block addresses in the style of
//! SHARDS (Waldspurger et al., FAST '15), in its fixed-size form. A block is sampled iff a
//! hash of its address falls below a threshold, so every access to a sampled block is seen
//! and reuse distances among sampled blocks, divided by the sampling rate, estimate the
//! true ones. Memory is bounded: past `max_blocks` tracked blocks the threshold drops to
//! the largest tracked hash and the blocks at or above it are forgotten (the rate falls; the
//! accesses counted so far keep the weight of their time). Reuse distances among the
//! tracked blocks come from a Fenwick tree over access times: O(log n) per sampled access.
//!
//! What is built is a [`Mrc`]: the hit ratio of an LRU cache of any size, for reads and for
//! all accesses. Beside it, on the same sample, a node runs the cache tier's own policy in
//! miniature at a few cache sizes ([`crate::minisim`], [`TierEstimator`]): what the tier
//! would hit, where the curve says what any cache could.

use crate::minisim::{ladder, MiniTier, Policy};
use converge_types::mrc::{Mrc, TierHit};
use converge_types::{CacheMode, ExtentKey, VolumeId, BLOCK_SIZE};
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Hash values are compared with the threshold modulo this.
const MODULUS: u64 = 1 << 24;

/// The hash that decides sampling (splitmix64 finaliser): neighbouring blocks are sampled
/// independently.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The hash that decides whether block `key` is sampled: below the threshold.
pub(crate) fn sample_hash(key: u64) -> u64 {
    mix(key) % MODULUS
}

/// The hash threshold that samples `rate` of all blocks.
fn threshold_of(rate: f64) -> u64 {
    ((rate.clamp(0.0, 1.0) * MODULUS as f64) as u64).clamp(1, MODULUS)
}

/// Counts of marked access times, with prefix sums in O(log n).
struct Fenwick {
    tree: Vec<i32>,
}

impl Fenwick {
    fn new(n: usize) -> Fenwick {
        Fenwick {
            tree: vec![0; n + 1],
        }
    }
    fn add(&mut self, i: usize, v: i32) {
        let mut i = i + 1;
        while i < self.tree.len() {
            self.tree[i] += v;
            i += i & i.wrapping_neg();
        }
    }
    /// Marks at times `[0, i]`.
    fn prefix(&self, i: usize) -> i64 {
        let mut i = i + 1;
        let mut s = 0i64;
        while i > 0 {
            s += i64::from(self.tree[i]);
            i -= i & i.wrapping_neg();
        }
        s
    }
}

pub struct Shards {
    threshold: u64,
    max_blocks: usize,
    /// Tracked block → (its hash mod MODULUS, time of its last access).
    last: HashMap<u64, (u64, usize)>,
    /// Tracked blocks by hash, to forget the largest first.
    by_hash: BTreeSet<(u64, u64)>,
    /// A mark at each tracked block's last access time.
    times: Fenwick,
    /// Next access time.
    now: usize,
    mrc: Mrc,
    /// Every access counted, sampled or not, all and reads.
    total: u64,
    total_reads: u64,
}

impl Shards {
    /// Samples `rate` of all blocks (0 < rate ≤ 1) and tracks at most `max_blocks` of them.
    pub fn new(rate: f64, max_blocks: usize) -> Shards {
        let max_blocks = max_blocks.max(16);
        let threshold = threshold_of(rate);
        Shards {
            threshold,
            max_blocks,
            last: HashMap::new(),
            by_hash: BTreeSet::new(),
            times: Fenwick::new(Self::capacity(max_blocks)),
            now: 0,
            mrc: Mrc::default(),
            total: 0,
            total_reads: 0,
        }
    }

    fn capacity(max_blocks: usize) -> usize {
        4 * max_blocks
    }

    /// Blocks whose [`sample_hash`] is below this are sampled.
    pub(crate) fn threshold(&self) -> u64 {
        self.threshold
    }

    /// Share of blocks sampled now.
    pub fn rate(&self) -> f64 {
        self.threshold as f64 / MODULUS as f64
    }

    /// Whether block `key` is sampled at the current rate (cheap: callers may test it
    /// before taking a lock for [`Shards::access`]).
    pub fn sampled(&self, key: u64) -> bool {
        mix(key) % MODULUS < self.threshold
    }

    /// An access to block `key` (any 64-bit name of a block, e.g. its extent and index
    /// mixed); reads and writes both make it recent.
    pub fn access(&mut self, key: u64, read: bool) {
        self.count(1, u64::from(read));
        self.sampled_access(key, read);
    }

    /// Counts accesses without looking at them, for callers that pass only the sampled
    /// ones to [`Shards::sampled_access`] (the curve's totals are these counts).
    pub fn count(&mut self, all: u64, reads: u64) {
        self.total += all;
        self.total_reads += reads;
    }

    /// The totals, for a caller that counts accesses itself (outside its lock).
    fn set_totals(&mut self, all: u64, reads: u64) {
        self.total = all;
        self.total_reads = reads;
    }

    /// An access, looked at only if its block is sampled; not counted in the totals.
    pub fn sampled_access(&mut self, key: u64, read: bool) {
        let h = mix(key) % MODULUS;
        if h >= self.threshold {
            return;
        }
        self.mrc.samples += 1;
        let w = 1.0 / self.rate();
        if self.now >= self.times.tree.len() - 1 {
            self.renumber();
        }
        let t = self.now;
        self.now += 1;
        let d = match self.last.insert(key, (h, t)) {
            Some((_, prev)) => {
                // Distinct tracked blocks accessed since: marks after `prev`.
                let after = self.times.prefix(t.saturating_sub(1)) - self.times.prefix(prev);
                self.times.add(prev, -1);
                Some(after as f64 / self.rate())
            }
            None => {
                self.by_hash.insert((h, key));
                None
            }
        };
        self.times.add(t, 1);
        self.mrc.add(d, read, w);
        while self.last.len() > self.max_blocks {
            self.lower_threshold();
        }
    }

    /// Forgets the tracked blocks with the largest hash and samples only below it.
    fn lower_threshold(&mut self) {
        let Some(&(top, _)) = self.by_hash.iter().next_back() else {
            return;
        };
        self.threshold = top.max(1);
        while let Some(&(h, key)) = self.by_hash.iter().next_back() {
            if h < self.threshold {
                break;
            }
            self.by_hash.remove(&(h, key));
            if let Some((_, t)) = self.last.remove(&key) {
                self.times.add(t, -1);
            }
        }
    }

    /// Gives the tracked blocks' last access times 0..n again, in order, when the time
    /// space is used up.
    fn renumber(&mut self) {
        let mut order: Vec<(usize, u64)> = self.last.iter().map(|(&k, &(_, t))| (t, k)).collect();
        order.sort_unstable();
        self.times = Fenwick::new(Self::capacity(self.max_blocks));
        for (i, (_, k)) in order.into_iter().enumerate() {
            if let Some(e) = self.last.get_mut(&k) {
                e.1 = i;
            }
            self.times.add(i, 1);
        }
        self.now = self.last.len();
    }

    /// The curve so far. The sample's accesses, scaled, rarely add up to the accesses
    /// counted (a hot block sampled or not moves them a lot), so the difference goes to
    /// the shortest distance, where hot blocks' reuses are (SHARDS' "adj"); the totals
    /// are the counted ones. Without counts ([`Shards::count`] never called) the totals
    /// are the sample's, scaled.
    pub fn mrc(&self) -> Mrc {
        let mut m = self.mrc.clone();
        m.rate = self.rate();
        m.blocks = self.last.len() as f64 / self.rate();
        if self.total == 0 {
            return m;
        }
        if !m.all.is_empty() {
            m.all[0] = (m.all[0] + self.total as f64 - m.refs).max(0.0);
            m.read[0] = (m.read[0] + self.total_reads as f64 - m.reads).max(0.0);
        }
        m.refs = self.total as f64;
        m.reads = self.total_reads as f64;
        m
    }

    /// Accesses counted, sampled or not.
    pub fn accesses(&self) -> u64 {
        self.total
    }
}

/// A miniature simulation is rescaled once the estimator's rate fell below its own by more
/// than this factor (2 %): until then it keeps blocks no longer sampled, and a slightly
/// larger scale, which about cancel; rescaling at every step of a saturated estimator
/// (each new block lowers the threshold a little) would cost O(cache) per sampled access.
const RESCALE_STEP: f64 = 1.02;

/// A node's estimator: the LRU curve ([`Shards`]) and, on the same sampled accesses, the
/// cache tier's policy simulated at a few cache sizes ([`MiniTier`]).
pub struct TierEstimator {
    shards: Shards,
    minis: Vec<MiniTier>,
    /// What the simulations are set up for: the cache logs' size together (0: none), the
    /// watermarks, and the mode the cache is in.
    setup: (u64, u8, u8, CacheMode),
}

impl TierEstimator {
    /// Samples `rate` of blocks, tracks at most `max_blocks` of them for the curve, and
    /// simulates the tier with the default watermarks (25 %, 80 %) at cache sizes of 128 MiB
    /// to 4 GiB until [`TierEstimator::set_tier`] says what the node has.
    pub fn new(rate: f64, max_blocks: usize) -> TierEstimator {
        let mut t = TierEstimator {
            shards: Shards::new(rate, max_blocks),
            minis: Vec::new(),
            setup: (0, 0, 0, CacheMode::ReadWrite),
        };
        t.set_tier(0, 25, 80, CacheMode::ReadWrite);
        t
    }

    /// The node's cache: its logs' size together (0 without cache drives), destage's low and
    /// high watermarks (percent), its mode. The read-write policy is simulated at ¼ to 4
    /// times that size ([`ladder`]), and at that size in the cache's own mode too if it is
    /// another. Simulations of sizes and modes kept go on; new ones start empty (they count
    /// from now).
    pub fn set_tier(&mut self, log_bytes: u64, low_pct: u8, high_pct: u8, mode: CacheMode) {
        let setup = (log_bytes, low_pct, high_pct, mode);
        if setup == self.setup {
            return;
        }
        self.setup = setup;
        let policy = |log_bytes, mode| Policy {
            log_bytes,
            mode,
            low_pct,
            high_pct,
        };
        let mut want: Vec<Policy> = ladder(log_bytes)
            .into_iter()
            .map(|b| policy(b, CacheMode::ReadWrite))
            .collect();
        if log_bytes > 0 && mode != CacheMode::ReadWrite {
            want.push(policy(log_bytes, mode));
        }
        let mut old = std::mem::take(&mut self.minis);
        for p in want {
            match old.iter().position(|m| m.policy() == p) {
                Some(i) => self.minis.push(old.swap_remove(i)),
                None => {
                    let t = self.shards.threshold().min(threshold_of(p.rate_max()));
                    self.minis
                        .push(MiniTier::new(p, t as f64 / MODULUS as f64, t));
                }
            }
        }
    }

    /// An access to block `key`, counted in the curve's totals.
    pub fn access(&mut self, key: u64, read: bool) {
        self.shards.count(1, u64::from(read));
        self.sampled_access(key, read);
    }

    /// An access, looked at only if its block is sampled; not counted in the totals.
    pub fn sampled_access(&mut self, key: u64, read: bool) {
        self.shards.sampled_access(key, read);
        let h = sample_hash(key);
        let threshold = self.shards.threshold();
        if h >= threshold {
            return;
        }
        for m in &mut self.minis {
            // Its own rate: the estimator's, or lower for a cache too large to simulate at it.
            let t = threshold.min(threshold_of(m.policy().rate_max()));
            if m.threshold() as f64 > t as f64 * RESCALE_STEP {
                m.rescale(t as f64 / MODULUS as f64, t);
            }
            if h >= m.threshold() {
                continue;
            }
            if read {
                m.read(key, h);
            } else {
                m.write(key, h);
            }
        }
    }

    /// The node's caches were flushed (`converge cache flush`).
    pub fn flushed(&mut self) {
        for m in &mut self.minis {
            m.flushed();
        }
    }

    /// The curve so far ([`Shards::mrc`]).
    pub fn mrc(&self) -> Mrc {
        self.shards.mrc()
    }

    /// The tier's policy's hit ratios so far, one per simulated size (and mode).
    pub fn tier(&self) -> Vec<TierHit> {
        self.minis.iter().map(MiniTier::result).collect()
    }
}

/// Sampling rate of a node's estimators: 1 % of blocks (SHARDS' evaluation found 0.1–1 %
/// enough for real traces; the bound on tracked blocks lowers it for large working sets).
pub const NODE_RATE: f64 = 0.01;
/// Tracked blocks of the node-wide estimator: with the sampled-block map and the time tree,
/// about 2 MiB.
pub const NODE_MAX_BLOCKS: usize = 16 * 1024;
/// Tracked blocks per volume.
pub const VOLUME_MAX_BLOCKS: usize = 4 * 1024;
/// Volumes with a curve of their own on a node; past it, only the node-wide curve counts
/// the others' accesses.
pub const VOLUMES_MAX: usize = 256;

/// A node's working-set estimators: one over every client access its capacity drives
/// serve (what a cache in front of them would see) and one per volume. Accesses to blocks
/// outside the sample cost a hash; sampled ones take a lock.
pub struct AccessSampler {
    /// Every access is counted (all, reads) outside the locks; the estimators see only the
    /// sampled ones.
    node: Mutex<TierEstimator>,
    volumes: Mutex<HashMap<VolumeId, Shards>>,
    accesses: AtomicU64,
    reads: AtomicU64,
}

/// A block's name for the estimators: its extent and index.
fn block_key(key: ExtentKey, block: u64) -> u64 {
    key.volume
        .0
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .rotate_left(17)
        ^ key.slab.0.wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ block
}

impl Default for AccessSampler {
    fn default() -> Self {
        Self::new()
    }
}

impl AccessSampler {
    pub fn new() -> AccessSampler {
        AccessSampler {
            node: Mutex::new(TierEstimator::new(NODE_RATE, NODE_MAX_BLOCKS)),
            volumes: Mutex::new(HashMap::new()),
            accesses: AtomicU64::new(0),
            reads: AtomicU64::new(0),
        }
    }

    /// What the node's cache is: see [`TierEstimator::set_tier`] (cheap when unchanged).
    pub fn set_tier(&self, log_bytes: u64, low_pct: u8, high_pct: u8, mode: CacheMode) {
        let mut n = self.node.lock().unwrap_or_else(|e| e.into_inner());
        n.set_tier(log_bytes, low_pct, high_pct, mode);
    }

    /// The node's caches were flushed: see [`TierEstimator::flushed`].
    pub fn flushed(&self) {
        let mut n = self.node.lock().unwrap_or_else(|e| e.into_inner());
        n.flushed();
    }

    /// The tier's policy simulated at each size: see [`TierEstimator::tier`].
    pub fn tier(&self) -> Vec<TierHit> {
        let n = self.node.lock().unwrap_or_else(|e| e.into_inner());
        n.tier()
    }

    /// A client read or write of `len` bytes at byte `offset` of extent `key`. Blocks
    /// outside every estimator's sample (99 % of them) cost a hash; only a request with a
    /// sampled block takes the locks.
    pub fn io(&self, key: ExtentKey, offset: u64, len: u64, read: bool) {
        let bs = BLOCK_SIZE as u64;
        let first = offset / bs;
        let n = len.div_ceil(bs).max(1);
        self.accesses.fetch_add(n, Ordering::Relaxed);
        if read {
            self.reads.fetch_add(n, Ordering::Relaxed);
        }
        // Thresholds only fall: none samples a block at or above the starting one.
        let start = threshold_of(NODE_RATE);
        let sampled = |b: u64| mix(block_key(key, b)) % MODULUS < start;
        if !(first..first + n).any(sampled) {
            return;
        }
        {
            let mut node = self.node.lock().unwrap_or_else(|e| e.into_inner());
            for b in (first..first + n).filter(|&b| sampled(b)) {
                node.sampled_access(block_key(key, b), read);
            }
        }
        let mut vols = self.volumes.lock().unwrap_or_else(|e| e.into_inner());
        if !vols.contains_key(&key.volume) && vols.len() >= VOLUMES_MAX {
            return;
        }
        let v = vols
            .entry(key.volume)
            .or_insert_with(|| Shards::new(NODE_RATE, VOLUME_MAX_BLOCKS));
        for b in (first..first + n).filter(|&b| sampled(b)) {
            v.sampled_access(block_key(key, b), read);
        }
    }

    /// The node-wide curve and each volume's.
    pub fn curves(&self) -> (Mrc, Vec<(VolumeId, Mrc)>) {
        let node = {
            let mut n = self.node.lock().unwrap_or_else(|e| e.into_inner());
            // The counts are kept outside the lock: hand the estimator their totals.
            let (all, reads) = (self.accesses(), self.reads.load(Ordering::Relaxed));
            n.shards.set_totals(all, reads);
            n.mrc()
        };
        let vols = self.volumes.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<(VolumeId, Mrc)> = vols.iter().map(|(id, s)| (*id, s.mrc())).collect();
        v.sort_by_key(|x| x.0);
        (node, v)
    }

    /// Block accesses counted since the node started.
    pub fn accesses(&self) -> u64 {
        self.accesses.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// Hit ratio of a true LRU cache of `c` blocks over `trace`, reads only or all: the
    /// cache simulated block by block (evicting the least recently used), not from
    /// distances.
    fn lru_hits(trace: &[(u64, bool)], c: usize, reads_only: bool) -> f64 {
        let mut at: HashMap<u64, usize> = HashMap::new();
        let mut by_time: std::collections::BTreeMap<usize, u64> = Default::default();
        let (mut hits, mut n) = (0u64, 0u64);
        for (t, &(k, read)) in trace.iter().enumerate() {
            let hit = match at.insert(k, t) {
                Some(old) => {
                    by_time.remove(&old);
                    true
                }
                None => false,
            };
            by_time.insert(t, k);
            if by_time.len() > c {
                if let Some((_, gone)) = by_time.pop_first() {
                    at.remove(&gone);
                }
            }
            if read || !reads_only {
                n += 1;
                hits += u64::from(hit);
            }
        }
        hits as f64 / n as f64
    }

    fn run(trace: &[(u64, bool)], rate: f64, max: usize) -> Mrc {
        let mut s = Shards::new(rate, max);
        for &(k, read) in trace {
            s.access(k, read);
        }
        s.mrc()
    }

    /// A hot set: 80 % of the accesses go to 20 % of `n` blocks, the rest anywhere, at
    /// random; 30 % are writes.
    fn skewed(n: u64, len: usize, seed: u64) -> Vec<(u64, bool)> {
        let mut r = StdRng::seed_from_u64(seed);
        (0..len)
            .map(|_| {
                let hot = r.gen::<f64>() < 0.8;
                let k = if hot {
                    r.gen_range(0..n / 5)
                } else {
                    r.gen_range(0..n)
                };
                (k, r.gen::<f64>() >= 0.3)
            })
            .collect()
    }

    /// Few very hot blocks and a long tail (the top block takes 2.7 % of all accesses):
    /// what a sample estimates worst, since one hot block sampled or not moves the curve.
    fn zipfish(n: u64, len: usize, seed: u64) -> Vec<(u64, bool)> {
        let mut r = StdRng::seed_from_u64(seed);
        (0..len)
            .map(|_| ((r.gen::<f64>().powi(3) * n as f64) as u64, true))
            .collect()
    }

    #[test]
    fn sampling_every_block_gives_lrus_exact_hit_ratios() {
        let trace = skewed(2000, 20_000, 1);
        let m = run(&trace, 1.0, 1 << 20);
        assert_eq!(m.rate, 1.0);
        for c in [1usize, 5, 10, 16, 100, 500, 1000, 2000] {
            for reads in [false, true] {
                let want = lru_hits(&trace, c, reads);
                let got = m.hit_ratio(c as u64, reads).unwrap();
                // Exact below 16 blocks; above, within the 12.5 % wide bucket holding c.
                let tol = if c <= 16 { 1e-9 } else { 0.02 };
                assert!(
                    (got - want).abs() <= tol,
                    "c {c} reads {reads}: {got} vs {want}"
                );
            }
        }
        assert!(
            (m.blocks - trace.iter().map(|t| t.0).collect::<BTreeSet<_>>().len() as f64).abs()
                < 1e-9
        );
    }

    #[test]
    fn very_hot_blocks_are_estimated_exactly_at_full_rate_and_roughly_sampled() {
        let trace = zipfish(20_000, 200_000, 4);
        let exact = run(&trace, 1.0, 1 << 20);
        let sampled = run(&trace, 0.1, 1 << 20);
        for c in [200usize, 2000, 10_000] {
            let want = lru_hits(&trace, c, true);
            assert!((exact.hit_ratio(c as u64, true).unwrap() - want).abs() < 0.02);
            let got = sampled.hit_ratio(c as u64, true).unwrap();
            assert!((got - want).abs() < 0.25, "c {c}: {got} vs {want}");
        }
    }

    #[test]
    fn a_sample_of_the_blocks_estimates_the_curve() {
        let trace = skewed(50_000, 400_000, 2);
        let m = run(&trace, 0.05, 1 << 20);
        assert!(m.samples < 40_000, "about 5 % sampled: {}", m.samples);
        for c in [500usize, 2000, 10_000, 30_000] {
            let want = lru_hits(&trace, c, true);
            let got = m.hit_ratio(c as u64, true).unwrap();
            assert!((got - want).abs() < 0.05, "c {c}: {got} vs {want}");
        }
    }

    #[test]
    fn memory_stays_bounded_and_the_rate_falls_instead() {
        let trace = skewed(50_000, 400_000, 3);
        let mut s = Shards::new(1.0, 2000);
        for &(k, read) in &trace {
            s.access(k, read);
            assert!(s.last.len() <= 2000);
        }
        let m = s.mrc();
        assert!(m.rate < 0.1, "rate {}", m.rate);
        assert!(s.by_hash.len() == s.last.len());
        // The working set is estimated from the blocks tracked at the last rate.
        let distinct = trace.iter().map(|t| t.0).collect::<BTreeSet<_>>().len() as f64;
        assert!(
            (m.blocks / distinct - 1.0).abs() < 0.2,
            "{} vs {distinct}",
            m.blocks
        );
        for c in [2000usize, 10_000, 30_000] {
            let want = lru_hits(&trace, c, false);
            let got = m.hit_ratio(c as u64, false).unwrap();
            assert!((got - want).abs() < 0.06, "c {c}: {got} vs {want}");
        }
    }

    #[test]
    fn a_nodes_sampler_counts_every_access_and_curves_each_volume() {
        use converge_types::SlabIndex;
        let s = AccessSampler::new();
        let key = |v: u64| ExtentKey {
            volume: VolumeId(v),
            slab: SlabIndex(0),
        };
        let mut r = StdRng::seed_from_u64(5);
        let bs = BLOCK_SIZE as u64;
        // Volume 1: 40,000 blocks read at random; volume 2: 8 KiB writes over 10,000.
        let mut trace = Vec::new();
        for _ in 0..300_000 {
            let b = r.gen_range(0..40_000u64);
            s.io(key(1), b * bs, bs, true);
            trace.push((block_key(key(1), b), true));
            if r.gen::<f64>() < 0.25 {
                let b = r.gen_range(0..5_000u64) * 2;
                s.io(key(2), b * bs, 2 * bs, false);
                trace.push((block_key(key(2), b), false));
                trace.push((block_key(key(2), b + 1), false));
            }
        }
        assert_eq!(s.accesses(), trace.len() as u64);
        let (node, vols) = s.curves();
        assert_eq!(node.refs, trace.len() as f64);
        assert_eq!(node.reads, 300_000.0);
        assert!(
            (node.blocks / 50_000.0 - 1.0).abs() < 0.1,
            "{}",
            node.blocks
        );
        for c in [10_000usize, 25_000, 45_000] {
            let want = lru_hits(&trace, c, true);
            let got = node.hit_ratio(c as u64, true).unwrap();
            assert!((got - want).abs() < 0.05, "node c {c}: {got} vs {want}");
        }
        assert_eq!(vols.len(), 2);
        assert!(
            (vols[0].1.blocks / 40_000.0 - 1.0).abs() < 0.15,
            "{}",
            vols[0].1.blocks
        );
        assert!(
            (vols[1].1.blocks / 10_000.0 - 1.0).abs() < 0.15,
            "{}",
            vols[1].1.blocks
        );
        assert_eq!(vols[1].1.reads, 0.0);
        // Volume 1 alone: a cache of 20,000 of its 40,000 blocks holds half of its reads.
        let h = vols[0].1.hit_ratio(20_000, true).unwrap();
        assert!((h - 0.5).abs() < 0.06, "{h}");
    }

    #[test]
    fn the_node_estimator_runs_the_tiers_policy_on_its_sample_as_the_rate_falls() {
        use crate::minisim::{MiniTier, Policy};
        use rand::seq::SliceRandom;
        // A 400 MiB log (102,400 blocks, 81,920 usable, a ghost of 25,600) in write mode;
        // random passes over 40,000 blocks. 2,000 of them sampled at 5 %, more than the
        // 1,500 tracked: the rate falls to ~3.7 % on the first pass.
        let log_bytes = 102_400 * BLOCK_SIZE as u64;
        let mut e = TierEstimator::new(0.05, 1_500);
        e.set_tier(log_bytes, 25, 80, CacheMode::Write);
        let rw = Policy {
            log_bytes,
            mode: CacheMode::ReadWrite,
            low_pct: 25,
            high_pct: 80,
        };
        let mut full = MiniTier::new(rw, 1.0, u64::MAX);
        let mut r = StdRng::seed_from_u64(6);
        for _ in 0..4 {
            let mut v: Vec<u64> = (0..40_000).collect();
            v.shuffle(&mut r);
            for k in v {
                e.access(k, true);
                full.read(k, 0);
            }
        }
        assert!(e.shards.rate() < 0.04, "rate {}", e.shards.rate());
        let tier = e.tier();
        let sizes: Vec<(u64, CacheMode)> = tier.iter().map(|t| (t.cache_bytes, t.mode)).collect();
        assert_eq!(
            sizes,
            vec![
                (log_bytes / 4, CacheMode::ReadWrite),
                (log_bytes / 2, CacheMode::ReadWrite),
                (log_bytes, CacheMode::ReadWrite),
                (log_bytes * 2, CacheMode::ReadWrite),
                (log_bytes * 4, CacheMode::ReadWrite),
                (log_bytes, CacheMode::Write),
            ]
        );
        let want = full.result().read_hit_ratio().unwrap();
        let got = tier[2].read_hit_ratio().unwrap();
        assert!((got - want).abs() < 0.05, "{got} vs {want}");
        // Between a quarter and all of the log: the ghost admits slowly, far below LRU.
        let lru = e.mrc().hit_ratio(102_400, true).unwrap();
        assert!(lru > 0.7 && want < 0.4, "LRU {lru}, tier {want}");
        // Write mode caches no reads; the largest cache holds everything after two passes.
        assert_eq!(tier[5].read_hits, 0);
        assert!(tier[4].read_hit_ratio().unwrap() > 0.4, "{:?}", tier[4]);
        // A setup of the same sizes and mode keeps the simulations; a new mode restarts
        // only its own.
        e.set_tier(log_bytes, 25, 80, CacheMode::Write);
        assert_eq!(e.tier(), tier);
        e.set_tier(log_bytes, 25, 80, CacheMode::None);
        assert_eq!(e.tier()[..5], tier[..5]);
        assert_eq!(e.tier()[5].reads, 0);
    }

    #[test]
    fn a_cache_too_large_for_the_rate_is_simulated_on_fewer_blocks() {
        use crate::minisim::SIM_LOG_BLOCKS_MAX;
        // A 1.5 GiB log: at 1 % its 4 times (1.26 M usable blocks) would take 12,583 log
        // records. 1.5 M rewrites of 100,000 blocks fill every log with dead records.
        let log_bytes = 3u64 << 29;
        let mut e = TierEstimator::new(0.01, 16_384);
        e.set_tier(log_bytes, 25, 80, CacheMode::ReadWrite);
        let mut r = StdRng::seed_from_u64(8);
        for _ in 0..1_500_000 {
            e.access(r.gen_range(0..100_000), false);
        }
        let rate = e.shards.rate();
        for m in &e.minis {
            let want = rate.min(m.policy().rate_max());
            assert!(
                (m.rate() / want - 1.0).abs() < 1e-3,
                "{:?}: {} vs {want}",
                m.policy(),
                m.rate()
            );
            assert!(m.log_len() as u64 <= SIM_LOG_BLOCKS_MAX, "{}", m.log_len());
        }
        // ¼ of the log at the estimator's rate; 4 times at 2/3 of it, its log full.
        assert_eq!(e.minis[0].rate(), rate);
        assert!(e.minis[4].rate() < rate * 0.66, "{}", e.minis[4].rate());
        assert!(e.minis[4].log_len() as u64 >= SIM_LOG_BLOCKS_MAX * 9 / 10);
    }

    #[test]
    fn a_loop_larger_than_the_cache_never_hits() {
        // 1000 blocks read in order, 5 times: LRU of fewer than 1000 blocks never hits.
        // (Distance 999 is bucketed in [960, 1024): the curve resolves 12.5 % steps.)
        let trace: Vec<(u64, bool)> = (0..5)
            .flat_map(|_| (0..1000u64).map(|k| (k, true)))
            .collect();
        let m = run(&trace, 1.0, 1 << 20);
        assert_eq!(m.hit_ratio(960, true), Some(0.0));
        assert!((m.hit_ratio(1024, true).unwrap() - 0.8).abs() < 1e-9);
    }
}
