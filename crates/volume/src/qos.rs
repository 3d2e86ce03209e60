//! Per-volume QoS (issue 16): limits on I/Os and bytes per second with a burst, enforced on
//! the owner before an I/O starts, and the node-wide gate the owner's contention
//! controller narrows for best-effort volumes while a volume with a reservation falls short
//! of it (crates/node/src/qos.rs).
//!
//! Each limit is a GCRA (the virtual-scheduling form of a token bucket): a theoretical
//! arrival time moves forward by cost / rate with each I/O, and an I/O waits while it is
//! more than the burst ahead of now. Nothing runs between I/Os (no refill timer), an I/O
//! under its limits takes one uncontended lock, and a volume without limits takes none.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

pub use converge_types::Qos;

/// One rate: `rate` units per second, `burst` seconds of it may run ahead.
#[derive(Debug)]
struct Gcra {
    rate: f64,
    burst: Duration,
    /// The time the next unit is due if the rate were kept exactly.
    tat: Option<Instant>,
}

impl Gcra {
    fn new(rate: f64, burst: Duration) -> Gcra {
        Gcra {
            rate,
            burst,
            tat: None,
        }
    }

    /// Takes `cost` units at `now`; how long the caller must wait before it starts.
    fn take(&mut self, now: Instant, cost: f64) -> Duration {
        let tat = self.tat.map_or(now, |t| t.max(now));
        let next = tat + Duration::from_secs_f64(cost / self.rate);
        self.tat = Some(next);
        // The I/O may start once its own share is within the burst of now.
        let start = tat.checked_sub(self.burst).unwrap_or(now);
        start.saturating_duration_since(now)
    }
}

#[derive(Debug, Default)]
struct Buckets {
    iops: Option<Gcra>,
    bytes: Option<Gcra>,
}

impl Buckets {
    fn of(q: &Qos) -> Buckets {
        let burst = Duration::from_secs_f64(q.burst_seconds());
        Buckets {
            iops: q.iops_limit.map(|r| Gcra::new(r as f64, burst)),
            bytes: q.bytes_limit.map(|r| Gcra::new(r as f64, burst)),
        }
    }
}

/// A volume's limits, changed live with [`Limiter::set`].
#[derive(Debug, Default)]
pub struct Limiter {
    /// True when any limit is set: the only thing an unlimited volume's I/O reads.
    on: AtomicBool,
    buckets: Mutex<Buckets>,
    /// I/Os that had to wait, and for how long in all (µs).
    pub throttled: AtomicU64,
    pub waited_us: AtomicU64,
}

impl Limiter {
    pub fn new(q: &Qos) -> Limiter {
        let l = Limiter::default();
        l.set(q);
        l
    }

    /// New limits; an I/O waiting under the old ones keeps its turn.
    pub fn set(&self, q: &Qos) {
        let b = Buckets::of(q);
        let on = b.iops.is_some() || b.bytes.is_some();
        *self.buckets.lock().unwrap_or_else(|p| p.into_inner()) = b;
        self.on.store(on, Relaxed);
    }

    /// How long an I/O of `bytes` must wait before it starts (and books its turn).
    pub fn delay(&self, bytes: u64) -> Duration {
        if !self.on.load(Relaxed) {
            return Duration::ZERO;
        }
        let now = Instant::now();
        let mut b = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let a = b.iops.as_mut().map_or(Duration::ZERO, |g| g.take(now, 1.0));
        let c = b
            .bytes
            .as_mut()
            .map_or(Duration::ZERO, |g| g.take(now, bytes as f64));
        a.max(c)
    }

    /// Waits for an I/O's turn under these limits; counts it when it waited. Returns how
    /// long it waited.
    pub async fn admit(&self, bytes: u64) -> Duration {
        let d = self.delay(bytes);
        if !d.is_zero() {
            self.throttled.fetch_add(1, Relaxed);
            self.waited_us.fetch_add(d.as_micros() as u64, Relaxed);
            tokio::time::sleep(d).await;
        }
        d
    }
}

/// The node-wide gate best-effort volumes (those without a reservation) pass: no limit
/// until the contention controller sets one, in I/Os per second for all of them together.
#[derive(Debug, Default)]
pub struct SharedGate {
    limiter: Limiter,
    /// The cap in force (I/Os per second; 0 = none), as the controller last set it.
    cap: AtomicU64,
}

impl SharedGate {
    /// Caps the best-effort volumes at `iops` together (with a tenth of a second of
    /// burst), or lifts the cap.
    pub fn set_cap(&self, iops: Option<u64>) {
        let q = Qos {
            iops_limit: iops.map(|i| i.max(1)),
            burst_ms: Some(100),
            ..Qos::default()
        };
        self.limiter.set(&q);
        self.cap.store(iops.unwrap_or(0), Relaxed);
    }

    pub fn cap(&self) -> Option<u64> {
        Some(self.cap.load(Relaxed)).filter(|&c| c > 0)
    }

    pub async fn admit(&self) -> Duration {
        self.limiter.admit(0).await
    }

    /// I/Os the gate held back, and for how long in all (µs).
    pub fn throttled(&self) -> (u64, u64) {
        (
            self.limiter.throttled.load(Relaxed),
            self.limiter.waited_us.load(Relaxed),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(iops: Option<u64>, bytes: Option<u64>, burst_ms: u32) -> Qos {
        Qos {
            iops_limit: iops,
            bytes_limit: bytes,
            burst_ms: Some(burst_ms),
            iops_reserve: None,
        }
    }

    /// With time paused, the limiter lets exactly the burst through at once and then one
    /// I/O per 1/rate: 100 I/Os at 50/s with a 1 s burst take 50 s of waiting in all
    /// after the first 50.
    #[tokio::test(start_paused = true)]
    async fn iops_limit_with_burst() {
        let l = Limiter::new(&q(Some(50), None, 1000));
        let t0 = Instant::now();
        let mut started = Vec::new();
        for _ in 0..150 {
            l.admit(4096).await;
            started.push(t0.elapsed().as_secs_f64());
        }
        // The first 51 (the burst, and the one due now) start at once.
        assert!(started[50] < 1e-9, "{:?}", &started[..52]);
        assert!(started[51] > 0.0);
        // Then 50 per second: the 150th starts at (149 - 50) / 50 s.
        let last = started[149];
        assert!((last - 99.0 / 50.0).abs() < 1e-3, "{last}");
        assert_eq!(l.throttled.load(Relaxed), 99);
    }

    #[tokio::test(start_paused = true)]
    async fn bytes_limit_counts_bytes_and_no_limit_never_waits() {
        let l = Limiter::new(&q(None, Some(1 << 20), 0));
        let t0 = Instant::now();
        for _ in 0..10 {
            l.admit(512 << 10).await;
        }
        // 5 MiB at 1 MiB/s with no burst: the 10th starts after 4.5 s.
        let e = t0.elapsed().as_secs_f64();
        assert!((e - 4.5).abs() < 1e-3, "{e}");
        let free = Limiter::new(&Qos::default());
        for _ in 0..1000 {
            assert_eq!(free.delay(1 << 30), Duration::ZERO);
        }
        // Set live: the same limiter now waits, and lifted again it does not.
        free.set(&q(Some(10), None, 0));
        assert_eq!(free.delay(0), Duration::ZERO);
        assert!(free.delay(0) > Duration::ZERO);
        free.set(&Qos::default());
        assert_eq!(free.delay(0), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn the_shared_gate_caps_and_lifts() {
        let g = SharedGate::default();
        assert_eq!(g.cap(), None);
        g.set_cap(Some(100));
        assert_eq!(g.cap(), Some(100));
        let t0 = Instant::now();
        for _ in 0..111 {
            g.admit().await;
        }
        // 10 in the 0.1 s burst and one due now, then 100 more at 100/s.
        let e = t0.elapsed().as_secs_f64();
        assert!((e - 1.0).abs() < 1e-3, "{e}");
        g.set_cap(None);
        assert_eq!(g.cap(), None);
        let t1 = Instant::now();
        for _ in 0..1000 {
            g.admit().await;
        }
        assert_eq!(t1.elapsed(), Duration::ZERO);
    }
}
