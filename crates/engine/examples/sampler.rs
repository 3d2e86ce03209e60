//! Cost of the working-set estimator on the data path: `AccessSampler::io` per 4 KiB
//! access, over a random workload (1 % of blocks sampled), single thread and 2 threads;
//! then what the miniature simulations of the tier add per sampled access (the node's
//! estimator with and without them, on one thread).
//!
//! cargo run --release -p converge-engine --example sampler [ACCESSES]

use converge_engine::shards::{AccessSampler, Shards, TierEstimator};
use converge_types::{CacheMode, ExtentKey, SlabIndex, VolumeId};
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::Instant;

fn run(s: &AccessSampler, n: u64, seed: u64) {
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    for _ in 0..n {
        let key = ExtentKey {
            volume: VolumeId(r.gen_range(1..8)),
            slab: SlabIndex(r.gen_range(0..64)),
        };
        let b: u64 = r.gen_range(0..16_384);
        s.io(key, b * 4096, 4096, r.gen::<f64>() < 0.7);
    }
}

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(10_000_000);
    // The random numbers alone, to subtract.
    let t = Instant::now();
    let mut r = rand::rngs::StdRng::seed_from_u64(1);
    let mut x = 0u64;
    for _ in 0..n {
        x ^= r.gen_range(1..8u64) ^ r.gen_range(0..64u64) ^ r.gen_range(0..16_384u64);
        x ^= u64::from(r.gen::<f64>() < 0.7);
    }
    let base = t.elapsed().as_secs_f64();
    let s = AccessSampler::new();
    let t = Instant::now();
    run(&s, n, 1);
    let one = t.elapsed().as_secs_f64();
    let s2 = Arc::new(AccessSampler::new());
    let t = Instant::now();
    std::thread::scope(|sc| {
        for i in 0..2 {
            let s2 = s2.clone();
            sc.spawn(move || run(&s2, n / 2, 10 + i));
        }
    });
    let two = t.elapsed().as_secs_f64();
    let (m, vols) = s.curves();
    println!(
        "{n} accesses ({x} ignore): {:.1} ns each on 1 thread, {:.1} ns of wall time each on 2 \
         threads (random numbers subtracted: {:.1} ns); sampled {} of them, {} volumes",
        (one - base) * 1e9 / n as f64,
        (two - base / 2.0) * 1e9 / n as f64,
        base * 1e9 / n as f64,
        m.samples,
        vols.len()
    );
    sims_cost(n);
}

/// The node's estimator alone ([`Shards`]) and with the tier simulated at 5 sizes of a
/// 256 MiB cache plus its own mode ([`TierEstimator`]), over the same accesses to 200,000
/// blocks (90 % reads): the difference per sampled access.
fn sims_cost(n: u64) {
    let mut r = rand::rngs::StdRng::seed_from_u64(3);
    let keys: Vec<(u64, bool)> = (0..n)
        .map(|_| (r.gen_range(0..200_000u64), r.gen::<f64>() < 0.9))
        .collect();
    let mut s = Shards::new(0.01, 16_384);
    let t = Instant::now();
    for &(k, read) in &keys {
        s.access(k, read);
    }
    let alone = t.elapsed().as_secs_f64();
    let mut e = TierEstimator::new(0.01, 16_384);
    e.set_tier(256 << 20, 25, 80, CacheMode::Write);
    let t = Instant::now();
    for &(k, read) in &keys {
        e.access(k, read);
    }
    let with = t.elapsed().as_secs_f64();
    let samples = s.mrc().samples.max(1);
    println!(
        "estimator alone {:.1} ns per access, with the tier's 6 simulations {:.1} ns: {:.0} ns \
         more per sampled access ({samples} sampled)",
        alone * 1e9 / n as f64,
        with * 1e9 / n as f64,
        (with - alone) * 1e9 / samples as f64
    );
}
