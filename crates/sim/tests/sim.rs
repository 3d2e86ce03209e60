//! Runs the cluster simulation over many seeds, replays one seed verbosely, and checks that
//! a seed always replays the same run.
//!
//! * `CONVERGE_SIM_SEEDS=<n>`: how many seeds `many_seeds` runs (default below).
//! * `CONVERGE_SIM_FIRST_SEED=<n>`: where `many_seeds` starts (default 1).
//! * `CONVERGE_SIM_SEED=<n>`: the seed `replay` runs, printing every step.

use converge_sim::{simulate, Failure, Options, Report};
use std::time::Instant;

/// Sized so `many_seeds` takes well under a minute in release on a slow 2-core machine.
const DEFAULT_SEEDS: u64 = 40;

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|s| s.trim().parse().ok())
}

/// One run on a current-thread runtime with virtual time, as the simulation requires.
fn run(opts: Options) -> Result<Report, Failure> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("tokio runtime");
    rt.block_on(simulate(opts))
}

#[test]
fn many_seeds() {
    let n = env_u64("CONVERGE_SIM_SEEDS").unwrap_or(DEFAULT_SEEDS);
    let first = env_u64("CONVERGE_SIM_FIRST_SEED").unwrap_or(1);
    let start = Instant::now();
    let mut failed = Vec::new();
    let (mut writes, mut acked, mut blocks) = (0, 0, 0);
    for seed in first..first + n {
        match run(Options::for_seed(seed)) {
            Ok(r) => {
                writes += r.writes;
                acked += r.acked;
                blocks += r.blocks_checked;
            }
            Err(f) => {
                eprintln!("{f}\n");
                failed.push(seed);
            }
        }
    }
    eprintln!(
        "{n} seeds from {first} in {:.1?}: {writes} writes ({acked} acked), {blocks} blocks read and checked",
        start.elapsed()
    );
    assert!(
        failed.is_empty(),
        "seeds {failed:?} failed; replay one with CONVERGE_SIM_SEED=<seed> cargo nextest run --release -p converge-sim replay --no-capture"
    );
}

#[test]
fn replay() {
    let Some(seed) = env_u64("CONVERGE_SIM_SEED") else {
        eprintln!("set CONVERGE_SIM_SEED=<seed> to replay one seed with every step printed");
        return;
    };
    let _ = env_logger::builder().is_test(true).try_init();
    let mut opts = Options::for_seed(seed);
    opts.verbose = true;
    eprintln!("{opts:#?}");
    match run(opts) {
        Ok(r) => eprintln!("seed {seed} passed: {r:#?}"),
        Err(f) => panic!("{f}"),
    }
}

#[test]
fn same_seed_same_run() {
    let a = run(Options::for_seed(7))
        .map_err(|f| f.to_string())
        .unwrap();
    let b = run(Options::for_seed(7))
        .map_err(|f| f.to_string())
        .unwrap();
    assert_eq!(a.digest, b.digest, "seed 7 did not replay identically");
    assert_eq!(a.steps, b.steps);
    let c = run(Options::for_seed(8))
        .map_err(|f| f.to_string())
        .unwrap();
    assert_ne!(a.digest, c.digest, "different seeds should differ");
}
