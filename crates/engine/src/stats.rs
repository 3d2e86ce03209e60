//! Counters a node exports per drive (/metrics, `converge status`): ops, bytes, flushes,
//! queue depth integral and latency histograms, kept lock-free on the hot path.

use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// Number of latency buckets: bucket 0 is < 1 µs, bucket i is [2^(i-1), 2^i) µs, the last
/// bucket also holds everything slower (2^(N-2) µs ≈ 33 s and above).
pub const LATENCY_BUCKETS: usize = 27;

/// Latency histogram with fixed log2 buckets in microseconds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct LatencyHistogram {
    /// Exclusive upper bound of each bucket in µs (the last is open-ended: u64::MAX).
    pub bucket_upper_us: Vec<u64>,
    pub counts: Vec<u64>,
}

/// Snapshot of a drive's counters. Ops are engine calls; bytes are device bytes.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DriveStats {
    pub read_ops: u64,
    pub write_ops: u64,
    pub zero_ops: u64,
    /// Bytes read from the device (data, plus metadata during open).
    pub read_bytes: u64,
    /// Every byte written to the device: data + journal + metadata checkpoints + superblock.
    pub write_bytes: u64,
    /// Client data bytes written to the data region (write amplification = write_bytes / this).
    pub data_write_bytes: u64,
    pub journal_write_bytes: u64,
    pub metadata_write_bytes: u64,
    /// Device flushes (fdatasync); with group commit, far fewer than write_ops.
    pub flushes: u64,
    pub journal_batches: u64,
    pub checkpoints: u64,
    /// Blocks not written because the drive already held a newer version.
    pub skipped_blocks: u64,
    /// Blocks reported in ReadInfo::bad_blocks so far.
    pub bad_blocks_reported: u64,
    /// Blocks reported in ReadInfo::suspect so far.
    pub suspect_blocks_reported: u64,
    /// Blocks the last open's recovery rolled back and marked suspect.
    pub rolled_back_at_open: u64,
    /// Engine operations (read/write/zero) in progress now.
    pub inflight: u64,
    /// Integral over time of `inflight`, in ns: average queue depth over an interval is
    /// delta(inflight_time_ns) / delta(wall ns).
    pub inflight_time_ns: u64,
    pub read_latency_us: LatencyHistogram,
    pub write_latency_us: LatencyHistogram,
}

pub(crate) struct Counters {
    base: Instant,
    pub read_ops: AtomicU64,
    pub write_ops: AtomicU64,
    pub zero_ops: AtomicU64,
    pub read_bytes: AtomicU64,
    pub data_write_bytes: AtomicU64,
    pub journal_write_bytes: AtomicU64,
    pub metadata_write_bytes: AtomicU64,
    pub flushes: AtomicU64,
    pub journal_batches: AtomicU64,
    pub checkpoints: AtomicU64,
    pub skipped_blocks: AtomicU64,
    pub bad_blocks_reported: AtomicU64,
    pub suspect_blocks_reported: AtomicU64,
    pub rolled_back_at_open: AtomicU64,
    read_hist: [AtomicU64; LATENCY_BUCKETS],
    write_hist: [AtomicU64; LATENCY_BUCKETS],
    // The queue-depth integral without a lock (Little's law): the time every finished
    // operation spent in flight, plus, for those in flight, `now` minus their starts.
    inflight: AtomicU64,
    /// Sum of the start times (ns since `base`) of the operations in flight.
    inflight_starts_ns: AtomicU64,
    /// Sum of the durations of finished operations, ns.
    done_ns: AtomicU64,
}

#[derive(Clone, Copy, Debug)]
pub(crate) enum OpKind {
    Read,
    Write,
    Zero,
}

/// When an operation started (ns since the counters' base); `Counters::end` takes it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OpStart(u64);

fn bucket(us: u64) -> usize {
    ((u64::BITS - us.leading_zeros()) as usize).min(LATENCY_BUCKETS - 1)
}

impl Counters {
    pub fn new() -> Counters {
        Counters {
            base: Instant::now(),
            read_ops: AtomicU64::new(0),
            write_ops: AtomicU64::new(0),
            zero_ops: AtomicU64::new(0),
            read_bytes: AtomicU64::new(0),
            data_write_bytes: AtomicU64::new(0),
            journal_write_bytes: AtomicU64::new(0),
            metadata_write_bytes: AtomicU64::new(0),
            flushes: AtomicU64::new(0),
            journal_batches: AtomicU64::new(0),
            checkpoints: AtomicU64::new(0),
            skipped_blocks: AtomicU64::new(0),
            bad_blocks_reported: AtomicU64::new(0),
            suspect_blocks_reported: AtomicU64::new(0),
            rolled_back_at_open: AtomicU64::new(0),
            read_hist: std::array::from_fn(|_| AtomicU64::new(0)),
            write_hist: std::array::from_fn(|_| AtomicU64::new(0)),
            inflight: AtomicU64::new(0),
            inflight_starts_ns: AtomicU64::new(0),
            done_ns: AtomicU64::new(0),
        }
    }

    fn now_ns(&self) -> u64 {
        self.base.elapsed().as_nanos() as u64
    }

    /// Marks an operation started; pass the result to `end` exactly once.
    pub fn begin(&self) -> OpStart {
        let now = self.now_ns();
        self.inflight_starts_ns.fetch_add(now, Relaxed);
        self.inflight.fetch_add(1, Relaxed);
        OpStart(now)
    }

    pub fn end(&self, kind: OpKind, start: OpStart) {
        let now = self.now_ns();
        let took = now.saturating_sub(start.0);
        self.done_ns.fetch_add(took, Relaxed);
        self.inflight_starts_ns.fetch_sub(start.0, Relaxed);
        self.inflight.fetch_sub(1, Relaxed);
        let (ops, hist) = match kind {
            OpKind::Read => (&self.read_ops, &self.read_hist),
            OpKind::Write => (&self.write_ops, &self.write_hist),
            OpKind::Zero => (&self.zero_ops, &self.write_hist),
        };
        ops.fetch_add(1, Relaxed);
        hist[bucket(took / 1000)].fetch_add(1, Relaxed);
    }

    pub fn snapshot(&self) -> DriveStats {
        // Read apart, the three may disagree by an operation that ends in between: the
        // integral is then off by at most that operation's time in flight.
        let inflight = self.inflight.load(Relaxed);
        let starts = self.inflight_starts_ns.load(Relaxed);
        let done = self.done_ns.load(Relaxed);
        let now = self.now_ns();
        let integral = done.saturating_add((inflight.saturating_mul(now)).saturating_sub(starts));
        let hist = |h: &[AtomicU64; LATENCY_BUCKETS]| LatencyHistogram {
            bucket_upper_us: (0..LATENCY_BUCKETS)
                .map(|i| {
                    if i + 1 == LATENCY_BUCKETS {
                        u64::MAX
                    } else {
                        1u64 << i
                    }
                })
                .collect(),
            counts: h.iter().map(|c| c.load(Relaxed)).collect(),
        };
        let data = self.data_write_bytes.load(Relaxed);
        let journal = self.journal_write_bytes.load(Relaxed);
        let meta = self.metadata_write_bytes.load(Relaxed);
        DriveStats {
            read_ops: self.read_ops.load(Relaxed),
            write_ops: self.write_ops.load(Relaxed),
            zero_ops: self.zero_ops.load(Relaxed),
            read_bytes: self.read_bytes.load(Relaxed),
            write_bytes: data + journal + meta,
            data_write_bytes: data,
            journal_write_bytes: journal,
            metadata_write_bytes: meta,
            flushes: self.flushes.load(Relaxed),
            journal_batches: self.journal_batches.load(Relaxed),
            checkpoints: self.checkpoints.load(Relaxed),
            skipped_blocks: self.skipped_blocks.load(Relaxed),
            bad_blocks_reported: self.bad_blocks_reported.load(Relaxed),
            suspect_blocks_reported: self.suspect_blocks_reported.load(Relaxed),
            rolled_back_at_open: self.rolled_back_at_open.load(Relaxed),
            inflight,
            inflight_time_ns: integral,
            read_latency_us: hist(&self.read_hist),
            write_latency_us: hist(&self.write_hist),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_log2() {
        assert_eq!(bucket(0), 0);
        assert_eq!(bucket(1), 1);
        assert_eq!(bucket(2), 2);
        assert_eq!(bucket(3), 2);
        assert_eq!(bucket(1000), 10);
        assert_eq!(bucket(u64::MAX), LATENCY_BUCKETS - 1);
    }

    #[test]
    fn inflight_integral_grows_while_busy() {
        let c = Counters::new();
        let t = c.begin();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let s = c.snapshot();
        assert_eq!(s.inflight, 1);
        assert!(s.inflight_time_ns >= 1_000_000);
        c.end(OpKind::Write, t);
        let s = c.snapshot();
        assert_eq!(s.inflight, 0);
        assert_eq!(s.write_ops, 1);
        assert_eq!(s.write_latency_us.counts.iter().sum::<u64>(), 1);
    }
}
