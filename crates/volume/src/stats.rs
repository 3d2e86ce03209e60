//! Lock-free I/O counters and a log2 latency histogram, shared by the volume and node
//! layers so `/metrics` and the fleet see the same numbers.

use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Buckets: bucket i counts latencies in [2^(i-1), 2^i) microseconds; bucket 0 is < 1 µs.
pub const LATENCY_BUCKETS: usize = 32;

#[derive(Default)]
pub struct Histogram {
    buckets: [AtomicU64; LATENCY_BUCKETS],
    sum_us: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    pub fn record_us(&self, us: u64) {
        let idx = (64 - us.leading_zeros() as usize).min(LATENCY_BUCKETS - 1);
        self.buckets[idx].fetch_add(1, Relaxed);
        self.sum_us.fetch_add(us, Relaxed);
        self.count.fetch_add(1, Relaxed);
    }

    pub fn snapshot(&self) -> HistogramSnapshot {
        HistogramSnapshot {
            buckets: self.buckets.iter().map(|b| b.load(Relaxed)).collect(),
            sum_us: self.sum_us.load(Relaxed),
            count: self.count.load(Relaxed),
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct HistogramSnapshot {
    /// Counts per bucket; upper bound of bucket i is 2^i µs.
    pub buckets: Vec<u64>,
    pub sum_us: u64,
    pub count: u64,
}

impl HistogramSnapshot {
    /// Upper bound (µs) of bucket `i`.
    pub fn bucket_le_us(i: usize) -> u64 {
        1u64 << i
    }
}

/// Per-volume counters, as the owner sees client I/O.
#[derive(Default)]
pub struct VolumeCounters {
    pub read_ops: AtomicU64,
    pub read_bytes: AtomicU64,
    pub write_ops: AtomicU64,
    pub write_bytes: AtomicU64,
    pub zero_ops: AtomicU64,
    pub errors: AtomicU64,
    /// Client writes (and zeroes) refused for lack of space (counted in `errors` too).
    pub no_space_errors: AtomicU64,
    /// Blocks found bad on a replica and rewritten from a good copy.
    pub repaired_blocks: AtomicU64,
    /// Copies marked stale because they failed a write.
    pub extents_marked_stale: AtomicU64,
    /// Stale copies made in sync because they held every acked write while every in-sync
    /// copy was away (docs/adr/0014).
    pub copies_promoted: AtomicU64,
    /// Slabs a TRIM or WRITE_ZEROES covered whole and returned to the pool.
    pub slabs_released: AtomicU64,
    /// Mirror-accelerated parity: spans rotated from the mirror part into parity, and the
    /// volume bytes they held.
    pub rotations: AtomicU64,
    pub rotated_bytes: AtomicU64,
    /// Parity reads whose data chunks did not all answer within `read_hedge`, read from
    /// the other chunks instead.
    pub hedged_reads: AtomicU64,
    /// Client I/Os QoS held back (the volume's limits or its node's best-effort gate), and
    /// for how long in all.
    pub qos_throttled: AtomicU64,
    pub qos_waited_us: AtomicU64,
    pub read_latency: Histogram,
    pub write_latency: Histogram,
}

#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct VolumeStats {
    pub read_ops: u64,
    pub read_bytes: u64,
    pub write_ops: u64,
    pub write_bytes: u64,
    pub zero_ops: u64,
    pub errors: u64,
    #[serde(default)]
    pub no_space_errors: u64,
    pub repaired_blocks: u64,
    pub extents_marked_stale: u64,
    #[serde(default)]
    pub copies_promoted: u64,
    #[serde(default)]
    pub slabs_released: u64,
    #[serde(default)]
    pub rotations: u64,
    #[serde(default)]
    pub rotated_bytes: u64,
    #[serde(default)]
    pub hedged_reads: u64,
    #[serde(default)]
    pub qos_throttled: u64,
    #[serde(default)]
    pub qos_waited_us: u64,
    pub read_latency: HistogramSnapshot,
    pub write_latency: HistogramSnapshot,
}

impl VolumeCounters {
    pub fn snapshot(&self) -> VolumeStats {
        VolumeStats {
            read_ops: self.read_ops.load(Relaxed),
            read_bytes: self.read_bytes.load(Relaxed),
            write_ops: self.write_ops.load(Relaxed),
            write_bytes: self.write_bytes.load(Relaxed),
            zero_ops: self.zero_ops.load(Relaxed),
            errors: self.errors.load(Relaxed),
            no_space_errors: self.no_space_errors.load(Relaxed),
            repaired_blocks: self.repaired_blocks.load(Relaxed),
            extents_marked_stale: self.extents_marked_stale.load(Relaxed),
            copies_promoted: self.copies_promoted.load(Relaxed),
            slabs_released: self.slabs_released.load(Relaxed),
            rotations: self.rotations.load(Relaxed),
            rotated_bytes: self.rotated_bytes.load(Relaxed),
            hedged_reads: self.hedged_reads.load(Relaxed),
            qos_throttled: self.qos_throttled.load(Relaxed),
            qos_waited_us: self.qos_waited_us.load(Relaxed),
            read_latency: self.read_latency.snapshot(),
            write_latency: self.write_latency.snapshot(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets() {
        let h = Histogram::default();
        h.record_us(0);
        h.record_us(1);
        h.record_us(3);
        h.record_us(1000);
        h.record_us(u64::MAX);
        let s = h.snapshot();
        assert_eq!(s.count, 5);
        assert_eq!(s.buckets[0], 1);
        assert_eq!(s.buckets[1], 1);
        assert_eq!(s.buckets[2], 1);
        assert_eq!(s.buckets[10], 1); // 512 <= 1000 < 1024
        assert_eq!(s.buckets[LATENCY_BUCKETS - 1], 1);
    }
}
