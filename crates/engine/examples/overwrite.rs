//! Engine-only write benchmark: formats a drive file, fills one extent, then runs THREADS
//! writers doing random 4 KiB overwrites (each thread one write at a time, so THREADS is
//! the queue depth) until OPS writes are acked. Prints the IOPS and the device flushes per
//! write. For before/after comparisons of the engine's write path on a real device:
//!
//!   cargo run --release -p converge-engine --example overwrite -- /var/tmp/d.img 1 5000
//!
//! Arguments: PATH THREADS OPS [PASSES] [held]. The file is created (256 MiB) and left
//! behind. `held`: the writes are a parity chunk's (`write_held`, each keeping its block's
//! prior), and every writer settles after each 8 of its writes, as an owner would (the
//! 256 MiB file's drive holds at most 256 priors).
//! PASSES (default 1) repeats the overwrites, printing each pass: the first pass over a
//! fresh (sparse) drive file also pays the file system's allocation of the blocks that
//! out-of-place writes touch for the first time; later passes show the steady state.

use converge_engine::{DirectFile, Drive, DriveIdentity};
use converge_types::{
    ClusterId, DriveId, DriveRole, Epoch, ExtentKey, MediaType, NodeId, SlabIndex, Version,
    VolumeId,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

const SLAB: u64 = 64 << 20;
const B: usize = 4096;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).expect("usage: overwrite PATH THREADS OPS");
    let threads: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1);
    let ops: u64 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(5000);
    let passes: u64 = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(1);
    let held = args.get(5).is_some_and(|s| s == "held");
    let _ = std::fs::remove_file(path);
    let file = DirectFile::open(std::path::Path::new(path), Some(256 << 20)).expect("open");
    let id = DriveIdentity {
        cluster: ClusterId(1),
        node: NodeId(1),
        drive: DriveId(1),
        slab_size_bytes: SLAB,
        role: DriveRole::Capacity,
        media: MediaType::Ssd,
    };
    let d = Arc::new(Drive::format(Arc::new(file), id).expect("format"));
    let key = ExtentKey {
        volume: VolumeId(1),
        slab: SlabIndex(0),
    };
    let fill = vec![7u8; 1 << 20];
    let fill_crcs: Vec<u32> = fill.chunks(B).map(crc32c::crc32c).collect();
    for off in (0..SLAB).step_by(fill.len()) {
        d.write(key, Epoch(1), Version(1), off, &fill, &fill_crcs)
            .expect("fill");
    }
    let version = Arc::new(AtomicU64::new(2));
    for pass in 1..=passes {
        overwrite_pass(&d, key, threads, ops, &version, pass, held);
    }
}

fn overwrite_pass(
    d: &Arc<Drive>,
    key: ExtentKey,
    threads: u64,
    ops: u64,
    version: &Arc<AtomicU64>,
    pass: u64,
    held: bool,
) {
    let blocks = SLAB / B as u64;
    let left = Arc::new(AtomicU64::new(ops));
    let flushes0 = d.stats().flushes;
    let t0 = Instant::now();
    let hs: Vec<_> = (0..threads)
        .map(|t| {
            let (d, version, left) = (d.clone(), version.clone(), left.clone());
            std::thread::spawn(move || {
                let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (t + 1);
                let mut buf = vec![0u8; B];
                let mut n = 0u64;
                while left
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                    .is_ok()
                {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    buf[..8].copy_from_slice(&x.to_le_bytes());
                    let v = version.fetch_add(1, Ordering::Relaxed);
                    let (off, crc) = ((x % blocks) * B as u64, crc32c::crc32c(&buf));
                    if held {
                        d.write_held(key, Epoch(1), Version(v), off, &buf, &[crc])
                            .expect("held write");
                        n += 1;
                        if n.is_multiple_of(8) {
                            // Everything this far behind has been acked.
                            let upto = v.saturating_sub(4 * threads);
                            d.settle(key, Epoch(1), Version(upto), &[]).expect("settle");
                        }
                    } else {
                        d.write(key, Epoch(1), Version(v), off, &buf, &[crc])
                            .expect("write");
                    }
                }
            })
        })
        .collect();
    for h in hs {
        h.join().expect("writer");
    }
    let secs = t0.elapsed().as_secs_f64();
    let flushes = d.stats().flushes - flushes0;
    println!(
        "pass {pass}: {threads} threads, {ops} {}overwrites: {:.0} IOPS, {:.2} flushes per write",
        if held { "held " } else { "" },
        ops as f64 / secs,
        flushes as f64 / ops as f64
    );
}
