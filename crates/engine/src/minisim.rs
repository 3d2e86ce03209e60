//! Miniature simulations of the cache tier's own policy (Waldspurger et al., "Cache Modeling
//! and Optimization using Miniature Simulations", USENIX ATC '17). The working-set estimator
//! ([`crate::shards`]) gives an LRU cache's hit ratio at any size, but the tier is not LRU:
//! it admits a read block on its second miss within a ghost FIFO and reclaims its log FIFO
//! (docs/CACHE.md, "Read-cache policy"). A [`MiniTier`] runs that policy on the estimator's
//! spatially hashed sample of blocks, with the log and the ghost scaled down by the sampling
//! rate: a 256 MiB log (65,536 blocks) becomes ~655 blocks at 1 %. Its hit ratio on the
//! sampled reads estimates the tier's.
//!
//! What is modelled, block by block, as `crates/engine/src/cache.rs` does it:
//! * a read that hits marks the block referenced; one that misses, in `read-write` mode,
//!   goes to the ghost (`consider_admit`: a set and a FIFO of ¼ of the log's blocks, at least
//!   1,024, whose entries a second miss leaves in the FIFO) and is appended to the log as a
//!   clean copy if it was remembered;
//! * a write appends a dirty copy (in `none` mode only if the block is logged already), and
//!   the older copy's record stays in the log as dead space until the tail passes it;
//! * the log is reclaimed from its tail *under pressure* while more than the high watermark
//!   of it is in use (clean copies evicted, dirty ones destaged and dropped), and *without
//!   pressure* while more than the low watermark is dirty (`none`: while anything is dirty),
//!   where a clean block read since it got in is appended again (second chance);
//! * a flush turns dirty copies clean (`read-write`) or drops them (other modes).
//!
//! What is not: time (destage is taken to keep up with its watermarks; an admission lands
//! at once, never dropped for a full queue), the log's record and batch headers (~1.2 %),
//! the 8 MiB destage chunk, and reads of several blocks that partly hit (the tier admits
//! none of their missed blocks; this counts each block as its own read).

use converge_types::mrc::TierHit;
use converge_types::{CacheMode, BLOCK_SIZE};
use std::collections::hash_map::RandomState;
use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{BuildHasher, Hasher};

/// Hashes the simulations' block keys with splitmix64's finaliser, salted per process: std's
/// SipHash was most of a simulation's cost, and the salt keeps block addresses a client
/// picks from colliding on purpose.
#[derive(Clone)]
struct Salted(u64);

impl Default for Salted {
    fn default() -> Self {
        Salted(RandomState::new().build_hasher().finish())
    }
}

impl BuildHasher for Salted {
    type Hasher = KeyHasher;
    fn build_hasher(&self) -> KeyHasher {
        KeyHasher(self.0)
    }
}

struct KeyHasher(u64);

impl KeyHasher {
    fn mix(&mut self, x: u64) {
        let mut z = (self.0 ^ x).wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        self.0 = z ^ (z >> 31);
    }
}

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.mix(u64::from(b));
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.mix(x);
    }
}

/// Most log blocks a simulation holds: a cache too large for the estimator's rate is
/// simulated at a lower one (a sub-sample of its blocks), so each simulation stays under
/// ~0.7 MiB (log records, index and ghost). At 1 % this is a log of up to 4 GiB.
pub const SIM_LOG_BLOCKS_MAX: u64 = 8192;

/// The tier's policy at one cache size, at full scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// The cache log's size, bytes.
    pub log_bytes: u64,
    pub mode: CacheMode,
    /// Destage reclaims the log (without pressure) past this share of it dirty, percent.
    pub low_pct: u8,
    /// The log is reclaimed under pressure past this share of it in use, percent.
    pub high_pct: u8,
}

impl Policy {
    fn log_blocks(&self) -> u64 {
        self.log_bytes / BLOCK_SIZE as u64
    }

    /// Highest sampling rate at which a simulation of this policy stays within
    /// [`SIM_LOG_BLOCKS_MAX`].
    pub fn rate_max(&self) -> f64 {
        (SIM_LOG_BLOCKS_MAX as f64 / self.high_blocks().max(1) as f64).min(1.0)
    }

    /// Blocks in use before the log is reclaimed under pressure.
    fn high_blocks(&self) -> u64 {
        self.log_blocks() * u64::from(self.high_pct.min(100)) / 100
    }

    /// Dirty blocks before destage reclaims the log; `none` drains everything.
    fn low_blocks(&self) -> u64 {
        if self.mode == CacheMode::None {
            return 0;
        }
        self.log_blocks() * u64::from(self.low_pct.min(100)) / 100
    }

    /// The ghost's length, as `Cache::consider_admit` sizes it.
    fn ghost_blocks(&self) -> u64 {
        (self.log_blocks() / 4).max(1024)
    }
}

/// `n` full-scale blocks at sampling rate `rate`, at least one.
fn scaled(n: u64, rate: f64) -> usize {
    ((n as f64 * rate).round() as usize).max(1)
}

/// A block's newest copy in the simulated log.
#[derive(Clone, Copy, Debug)]
struct Live {
    /// The record holding it (records of older copies are dead space).
    seq: u64,
    hash: u64,
    dirty: bool,
    referenced: bool,
}

/// One record of the simulated log: (block, its sampling hash, record sequence).
type LogRec = (u64, u64, u64);

/// The tier's policy at one cache size, on sampled blocks. Blocks are named by a 64-bit key
/// and carry the hash that sampled them, so a lower sampling rate can drop those no longer
/// sampled ([`MiniTier::rescale`]). Memory: at most the scaled log and ghost lengths.
pub struct MiniTier {
    policy: Policy,
    rate: f64,
    /// Blocks are sampled below this hash (the caller's hash space).
    threshold: u64,
    /// Scaled: log blocks in use before reclaim under pressure, dirty blocks before
    /// destage, ghost length.
    cap: usize,
    dirty_max: usize,
    ghost_cap: usize,
    /// Oldest record first.
    log: VecDeque<LogRec>,
    index: HashMap<u64, Live, Salted>,
    dirty: usize,
    ghost: HashSet<u64, Salted>,
    /// (block, hash), oldest first; may hold blocks no longer in `ghost` (as the tier's).
    ghost_fifo: VecDeque<(u64, u64)>,
    seq: u64,
    reads: u64,
    read_hits: u64,
}

impl MiniTier {
    /// The policy scaled to sampling rate `rate` (1: every block, an exact simulation), for
    /// the blocks whose hash is below `threshold`.
    pub fn new(policy: Policy, rate: f64, threshold: u64) -> MiniTier {
        let mut m = MiniTier {
            policy,
            rate,
            threshold,
            cap: 0,
            dirty_max: 0,
            ghost_cap: 0,
            log: VecDeque::new(),
            index: HashMap::default(),
            dirty: 0,
            ghost: HashSet::default(),
            ghost_fifo: VecDeque::new(),
            seq: 0,
            reads: 0,
            read_hits: 0,
        };
        m.size_for(rate);
        m
    }

    fn size_for(&mut self, rate: f64) {
        assert!(rate > 0.0 && rate <= 1.0, "sampling rate {rate}");
        self.rate = rate;
        self.cap = scaled(self.policy.high_blocks(), rate);
        self.dirty_max = if self.policy.low_blocks() == 0 {
            0
        } else {
            scaled(self.policy.low_blocks(), rate)
        };
        self.ghost_cap = scaled(self.policy.ghost_blocks(), rate);
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The sampling rate the log and ghost are scaled to.
    pub fn rate(&self) -> f64 {
        self.rate
    }

    /// Blocks whose hash is below this are simulated.
    pub fn threshold(&self) -> u64 {
        self.threshold
    }

    /// Records in the simulated log (its memory, with the index and ghost that follow it).
    pub fn log_len(&self) -> usize {
        self.log.len()
    }

    /// A read of block `key` (sampled by `hash`); true if it hit.
    pub fn read(&mut self, key: u64, hash: u64) -> bool {
        self.reads += 1;
        if let Some(l) = self.index.get_mut(&key) {
            l.referenced = true;
            self.read_hits += 1;
            return true;
        }
        if self.policy.mode == CacheMode::ReadWrite && self.second_miss(key, hash) {
            self.append(key, hash, false);
            self.reclaim();
        }
        false
    }

    /// A write of block `key`: its new copy goes into the log.
    pub fn write(&mut self, key: u64, hash: u64) {
        if self.policy.mode == CacheMode::None && !self.index.contains_key(&key) {
            // Straight to capacity: nothing of the block is logged.
            return;
        }
        self.append(key, hash, true);
        self.reclaim();
    }

    /// `converge cache flush`: every dirty copy is destaged; `read-write` keeps it as a
    /// clean copy where it is, the other modes drop it.
    pub fn flushed(&mut self) {
        let keep = self.policy.mode == CacheMode::ReadWrite;
        self.index.retain(|_, l| {
            if !l.dirty {
                return true;
            }
            l.dirty = false;
            l.referenced = false;
            keep
        });
        self.dirty = 0;
    }

    /// The estimator's rate fell to `rate`: blocks whose hash is at or above `threshold`
    /// are no longer sampled, so they leave the log and the ghost, which shrink to the new
    /// scale (the surplus reclaimed from the tail, under pressure).
    pub fn rescale(&mut self, rate: f64, threshold: u64) {
        self.log.retain(|r| r.1 < threshold);
        self.index.retain(|_, l| l.hash < threshold);
        self.dirty = self.index.values().filter(|l| l.dirty).count();
        for &(k, h) in &self.ghost_fifo {
            if h >= threshold {
                self.ghost.remove(&k);
            }
        }
        self.ghost_fifo.retain(|g| g.1 < threshold);
        self.threshold = threshold;
        self.size_for(rate);
        self.reclaim();
        self.trim_ghost();
    }

    /// What it measured so far.
    pub fn result(&self) -> TierHit {
        TierHit {
            cache_bytes: self.policy.log_bytes,
            mode: self.policy.mode,
            rate: self.rate,
            reads: self.reads,
            read_hits: self.read_hits,
        }
    }

    /// `Cache::consider_admit`: true on the second miss while remembered; else the block
    /// is remembered (the oldest forgotten past the ghost's length).
    fn second_miss(&mut self, key: u64, hash: u64) -> bool {
        if self.ghost.remove(&key) {
            return true;
        }
        if self.ghost.insert(key) {
            self.ghost_fifo.push_back((key, hash));
        }
        self.trim_ghost();
        false
    }

    fn trim_ghost(&mut self) {
        while self.ghost_fifo.len() > self.ghost_cap {
            if let Some((old, _)) = self.ghost_fifo.pop_front() {
                self.ghost.remove(&old);
            }
        }
    }

    fn append(&mut self, key: u64, hash: u64, dirty: bool) {
        self.seq += 1;
        self.log.push_back((key, hash, self.seq));
        let new = Live {
            seq: self.seq,
            hash,
            dirty,
            referenced: false,
        };
        if self.index.insert(key, new).is_some_and(|old| old.dirty) {
            self.dirty -= 1;
        }
        if dirty {
            self.dirty += 1;
        }
    }

    /// The destage thread's work, taken to keep up with the watermarks.
    fn reclaim(&mut self) {
        while self.log.len() > self.cap {
            self.reclaim_tail(true);
        }
        while self.dirty > self.dirty_max {
            self.reclaim_tail(false);
        }
        assert!(self.log.len() <= self.cap && self.index.len() <= self.log.len());
    }

    /// `Cache::destage_once` for the oldest record: dead space goes; a dirty copy is
    /// destaged and dropped; a clean one read since it got in is appended again when the
    /// log is not under pressure (read-write mode), else evicted.
    fn reclaim_tail(&mut self, pressure: bool) {
        let Some((key, hash, seq)) = self.log.pop_front() else {
            return;
        };
        let Some(l) = self.index.get(&key).copied() else {
            return;
        };
        if l.seq != seq {
            return;
        }
        if l.dirty {
            self.dirty -= 1;
            self.index.remove(&key);
        } else if self.policy.mode == CacheMode::ReadWrite && l.referenced && !pressure {
            self.append(key, hash, false);
        } else {
            self.index.remove(&key);
        }
    }
}

/// Cache sizes a node simulates: ¼ to 4 times its cache logs together (the size now in the
/// middle), or, without cache drives, 128 MiB to 4 GiB doubling.
pub fn ladder(log_bytes: u64) -> Vec<u64> {
    if log_bytes == 0 {
        return (0..6).map(|i| (128u64 << 20) << i).collect();
    }
    vec![
        log_bytes / 4,
        log_bytes / 2,
        log_bytes,
        log_bytes * 2,
        log_bytes * 4,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};

    /// An access of a trace: a read or write of a block, or a flush.
    #[derive(Clone, Copy, Debug)]
    enum Op {
        Read(u64),
        Write(u64),
        Flush,
    }

    /// The tier's policy written down once more, as plainly as possible, for the simulator
    /// to be checked against: the log a list of records with a flag for the newest copy,
    /// the ghost a list scanned from the end. Quadratic; small traces only.
    struct Reference {
        p: Policy,
        /// (block, newest copy of it, dirty, referenced), oldest first.
        log: Vec<(u64, bool, bool, bool)>,
        /// Blocks remembered, and the FIFO (with blocks no longer remembered).
        remembered: Vec<u64>,
        fifo: Vec<u64>,
        hits: u64,
        reads: u64,
    }

    impl Reference {
        fn new(p: Policy) -> Reference {
            Reference {
                p,
                log: Vec::new(),
                remembered: Vec::new(),
                fifo: Vec::new(),
                hits: 0,
                reads: 0,
            }
        }
        fn newest(&mut self, k: u64) -> Option<&mut (u64, bool, bool, bool)> {
            self.log.iter_mut().find(|r| r.0 == k && r.1)
        }
        fn put(&mut self, k: u64, dirty: bool) {
            if let Some(r) = self.newest(k) {
                r.1 = false;
            }
            self.log.push((k, true, dirty, false));
            self.settle();
        }
        fn dirty(&self) -> u64 {
            self.log.iter().filter(|r| r.1 && r.2).count() as u64
        }
        fn settle(&mut self) {
            while self.log.len() as u64 > self.p.high_blocks() {
                self.log.remove(0);
            }
            while self.dirty() > self.p.low_blocks() {
                let r = self.log.remove(0);
                let rw = self.p.mode == CacheMode::ReadWrite;
                if r.1 && !r.2 && r.3 && rw {
                    self.log.push((r.0, true, false, false));
                }
            }
        }
        fn op(&mut self, o: Op) {
            match o {
                Op::Read(k) => {
                    self.reads += 1;
                    if let Some(r) = self.newest(k) {
                        r.3 = true;
                        self.hits += 1;
                        return;
                    }
                    if self.p.mode != CacheMode::ReadWrite {
                        return;
                    }
                    if let Some(i) = self.remembered.iter().position(|&x| x == k) {
                        self.remembered.remove(i);
                        self.put(k, false);
                        return;
                    }
                    self.remembered.push(k);
                    self.fifo.push(k);
                    while self.fifo.len() as u64 > self.p.ghost_blocks() {
                        let old = self.fifo.remove(0);
                        self.remembered.retain(|&x| x != old);
                    }
                }
                Op::Write(k) => {
                    if self.p.mode == CacheMode::None && self.newest(k).is_none() {
                        return;
                    }
                    self.put(k, true);
                }
                Op::Flush => {
                    let keep = self.p.mode == CacheMode::ReadWrite;
                    for r in self.log.iter_mut().filter(|r| r.1 && r.2) {
                        r.2 = false;
                        r.3 = false;
                        r.1 = keep;
                    }
                }
            }
        }
    }

    fn policy(log_blocks: u64, mode: CacheMode) -> Policy {
        Policy {
            log_bytes: log_blocks * BLOCK_SIZE as u64,
            mode,
            low_pct: 25,
            high_pct: 80,
        }
    }

    fn run(m: &mut MiniTier, trace: &[Op]) {
        for &o in trace {
            match o {
                Op::Read(k) => {
                    m.read(k, 0);
                }
                Op::Write(k) => m.write(k, 0),
                Op::Flush => m.flushed(),
            }
        }
    }

    #[test]
    fn the_full_rate_simulation_is_the_reference_policy_access_by_access() {
        let mut r = StdRng::seed_from_u64(7);
        for mode in [CacheMode::ReadWrite, CacheMode::Write, CacheMode::None] {
            for round in 0..6 {
                // A log of 5,000 blocks (a ghost of 1,250), 2,000 to 9,000 blocks touched.
                let p = policy(5_000, mode);
                let n = 2_000 + round * 1_400;
                let write_share = [0.0, 0.1, 0.4][round as usize % 3];
                let mut m = MiniTier::new(p, 1.0, u64::MAX);
                let mut reference = Reference::new(p);
                for i in 0..30_000 {
                    let k = if r.gen::<f64>() < 0.5 {
                        r.gen_range(0..n / 5)
                    } else {
                        r.gen_range(0..n)
                    };
                    let o = if i % 7_000 == 6_999 {
                        Op::Flush
                    } else if r.gen::<f64>() < write_share {
                        Op::Write(k)
                    } else {
                        Op::Read(k)
                    };
                    let hits = m.read_hits;
                    run(&mut m, &[o]);
                    let want = reference.hits;
                    reference.op(o);
                    assert_eq!(
                        m.read_hits - hits,
                        reference.hits - want,
                        "{mode} round {round}, access {i}: {o:?}"
                    );
                }
                assert_eq!(m.reads, reference.reads);
                assert!(m.read_hits > 0 || mode != CacheMode::ReadWrite, "{mode}");
                assert_eq!(m.log.len(), reference.log.len(), "{mode} round {round}");
            }
        }
    }

    /// `passes` passes over blocks `0..n`, each in a new random order.
    fn random_passes(n: u64, passes: usize, r: &mut StdRng) -> Vec<Op> {
        let mut out = Vec::new();
        for _ in 0..passes {
            let mut v: Vec<u64> = (0..n).collect();
            v.shuffle(r);
            out.extend(v.into_iter().map(Op::Read));
        }
        out
    }

    fn hit_ratio(m: &MiniTier) -> f64 {
        m.result().read_hit_ratio().unwrap_or(0.0)
    }

    /// Policies of the tier at full size on `trace`, and scaled to a hashed sample of
    /// `rate` (block names are mixed so the sample is spatially random).
    fn full_and_sampled(p: Policy, trace: &[Op], rate: f64) -> (f64, f64) {
        let mut full = MiniTier::new(p, 1.0, u64::MAX);
        run(&mut full, trace);
        let t = (rate * (1u64 << 24) as f64) as u64;
        let mut mini = MiniTier::new(p, rate, t);
        for &o in trace {
            let (k, read) = match o {
                Op::Read(k) => (k, true),
                Op::Write(k) => (k, false),
                Op::Flush => {
                    mini.flushed();
                    continue;
                }
            };
            let h = crate::shards::sample_hash(k);
            if h >= t {
                continue;
            }
            if read {
                mini.read(k, h);
            } else {
                mini.write(k, h);
            }
        }
        (hit_ratio(&full), hit_ratio(&mini))
    }

    #[test]
    fn a_sampled_simulation_follows_the_full_one_on_random_passes() {
        // A 100,000-block log sampled at 2 %: ~1,600 of its 80,000 usable blocks.
        let p = policy(100_000, CacheMode::ReadWrite);
        let mut r = StdRng::seed_from_u64(11);
        // Sets of ¼, ½, ¾ and all of the log; the ghost remembers 25,000 misses.
        for n in [25_000u64, 50_000, 75_000, 100_000] {
            let trace = random_passes(n, 4, &mut r);
            let (full, mini) = full_and_sampled(p, &trace, 0.02);
            eprintln!("random passes over {n}: full {full:.3} sampled {mini:.3}");
            assert!((full - mini).abs() < 0.05, "{n}: {full} vs {mini}");
        }
    }

    #[test]
    fn a_sampled_simulation_follows_the_full_one_on_a_scan_and_a_hot_set() {
        let p = policy(100_000, CacheMode::ReadWrite);
        let mut r = StdRng::seed_from_u64(12);
        // A cyclic scan the ghost cannot span (40,000 misses apart): never admitted.
        let scan: Vec<Op> = (0..4).flat_map(|_| (0..40_000u64).map(Op::Read)).collect();
        let (full, mini) = full_and_sampled(p, &scan, 0.02);
        assert_eq!(full, 0.0);
        assert!(mini < 0.05, "scan: {mini}");
        // The same scan of 20,000: the second pass admits it, the last two hit.
        let scan: Vec<Op> = (0..4).flat_map(|_| (0..20_000u64).map(Op::Read)).collect();
        let (full, mini) = full_and_sampled(p, &scan, 0.02);
        assert!((full - 0.5).abs() < 1e-9, "{full}");
        assert!((full - mini).abs() < 0.05, "short scan: {full} vs {mini}");
        // A hot set of 10,000 blocks takes 70 % of the reads; a scan of 1,000,000 others
        // the rest, and some writes into the hot set.
        let mut trace = Vec::new();
        let mut scan_at = 1_000_000u64;
        for _ in 0..400_000 {
            let x = r.gen::<f64>();
            trace.push(if x < 0.65 {
                Op::Read(r.gen_range(0..10_000))
            } else if x < 0.7 {
                Op::Write(r.gen_range(0..10_000))
            } else {
                scan_at += 1;
                Op::Read(scan_at)
            });
        }
        let (full, mini) = full_and_sampled(p, &trace, 0.02);
        eprintln!("hot set and scan: full {full:.3} sampled {mini:.3}");
        assert!(full > 0.5, "the hot set is cached: {full}");
        assert!((full - mini).abs() < 0.05, "hot set: {full} vs {mini}");
    }

    #[test]
    fn a_lower_rate_keeps_the_simulation_bounded_and_close() {
        let p = policy(100_000, CacheMode::ReadWrite);
        let mut r = StdRng::seed_from_u64(13);
        let trace = random_passes(50_000, 4, &mut r);
        let (full, _) = full_and_sampled(p, &trace, 0.04);
        // Start at 4 %, drop to 2 % half way through the first pass.
        let t4 = (1u64 << 24) / 25;
        let mut m = MiniTier::new(p, 0.04, t4);
        let t2 = (1u64 << 24) / 50;
        let mut t = t4;
        for (i, &o) in trace.iter().enumerate() {
            if i == 25_000 {
                t = t2;
                m.rescale(0.02, t2);
                assert!(m.log.iter().all(|r| r.1 < t2));
                assert!(m.ghost_fifo.iter().all(|g| g.1 < t2));
                assert!(m.log.len() <= (80_000.0 * 0.02) as usize + 1);
            }
            let Op::Read(k) = o else { unreachable!() };
            let h = crate::shards::sample_hash(k);
            if h < t {
                m.read(k, h);
            }
        }
        let mini = hit_ratio(&m);
        assert!((full - mini).abs() < 0.06, "{full} vs {mini}");
    }

    #[test]
    fn writes_are_hits_until_destaged_and_flushed_copies_stay_in_read_write() {
        // Write 1,000 blocks into a log of 10,000 (25 % dirty allowed), then read them.
        for (mode, flush, want) in [
            (CacheMode::ReadWrite, false, 1.0),
            (CacheMode::Write, false, 1.0),
            (CacheMode::ReadWrite, true, 1.0),
            (CacheMode::Write, true, 0.0),
            (CacheMode::None, false, 0.0),
        ] {
            let mut m = MiniTier::new(policy(10_000, mode), 1.0, u64::MAX);
            let mut t: Vec<Op> = (0..1_000).map(Op::Write).collect();
            if flush {
                t.push(Op::Flush);
            }
            t.extend((0..1_000).map(Op::Read));
            run(&mut m, &t);
            assert_eq!(hit_ratio(&m), want, "{mode} flush {flush}");
        }
        // 4,000 writes: only the last 2,500 (the low watermark) are still logged.
        let mut m = MiniTier::new(policy(10_000, CacheMode::Write), 1.0, u64::MAX);
        let t: Vec<Op> = (0..4_000)
            .map(Op::Write)
            .chain((0..4_000).map(Op::Read))
            .collect();
        run(&mut m, &t);
        assert_eq!(m.read_hits, 2_500);
    }
}
