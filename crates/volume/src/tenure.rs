//! How long an owner may still serve: reads are fenced by time, not only by epochs.
//!
//! A partitioned owner cannot be fenced by the replicas (nobody reaches them to raise
//! their epoch), and its own copy goes on answering reads with whatever it holds. So an
//! owner serves only while its ownership lease in the control plane is surely alive, by
//! its own monotonic clock: the node extends its [`Tenure`] to *the time it sent a
//! keepalive that was confirmed* plus the lease TTL minus a margin. The control plane
//! counts the TTL from when it received that keepalive (later), so the tenure always
//! ends before the lease can expire, and a new owner (which claims only once the lease
//! has expired there) never serves while an old one still does.

use std::sync::atomic::{AtomicU64, Ordering};
// The runtime's clock, so the simulator's virtual time applies too.
use tokio::time::Instant;

/// Until when this node may act as an owner. Shared by every volume the node serves.
#[derive(Debug)]
pub struct Tenure {
    origin: Instant,
    /// Microseconds after `origin`; 0 = not (or no longer) granted; `u64::MAX` = unbounded.
    until_us: AtomicU64,
}

impl Tenure {
    /// Not granted yet: nothing is served until [`Tenure::extend`] is called.
    pub fn new() -> Tenure {
        Tenure {
            origin: Instant::now(),
            until_us: AtomicU64::new(0),
        }
    }

    /// Never ends (unit tests, and the simulator, whose owners are deposed by its nemesis).
    pub fn unbounded() -> Tenure {
        Tenure {
            origin: Instant::now(),
            until_us: AtomicU64::new(u64::MAX),
        }
    }

    /// Extends the tenure to `until` (never shortens it: keepalives may answer out of order).
    pub fn extend(&self, until: Instant) {
        let us = until
            .saturating_duration_since(self.origin)
            .as_micros()
            .min(u128::from(u64::MAX - 1)) as u64;
        self.until_us.fetch_max(us.max(1), Ordering::AcqRel);
    }

    /// Ends it now: the lease is gone (expired, revoked, or replaced by a new one).
    pub fn revoke(&self) {
        self.until_us.store(0, Ordering::Release);
    }

    /// Whether this node may still serve as an owner right now.
    pub fn holds(&self) -> bool {
        let until = self.until_us.load(Ordering::Acquire);
        until == u64::MAX || (until > 0 && (self.origin.elapsed().as_micros() as u64) < until)
    }

    /// How long is left (zero when it has ended); `None` when unbounded.
    pub fn left(&self) -> Option<std::time::Duration> {
        let until = self.until_us.load(Ordering::Acquire);
        if until == u64::MAX {
            return None;
        }
        let now = self.origin.elapsed().as_micros() as u64;
        Some(std::time::Duration::from_micros(until.saturating_sub(now)))
    }
}

impl Default for Tenure {
    fn default() -> Self {
        Tenure::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn a_tenure_ends_when_its_time_is_up_and_never_shrinks_by_an_extension() {
        let t = Tenure::new();
        assert!(!t.holds(), "not granted yet");
        let now = Instant::now();
        t.extend(now + Duration::from_secs(5));
        assert!(t.holds());
        // An older keepalive's answer arriving late does not shorten it.
        t.extend(now + Duration::from_secs(2));
        tokio::time::advance(Duration::from_secs(3)).await;
        assert!(t.holds());
        tokio::time::advance(Duration::from_millis(2001)).await;
        assert!(!t.holds(), "past its end");
        assert_eq!(t.left(), Some(Duration::ZERO));
        t.extend(Instant::now() + Duration::from_secs(1));
        assert!(t.holds());
        t.revoke();
        assert!(!t.holds());
        assert!(Tenure::unbounded().holds());
        assert_eq!(Tenure::unbounded().left(), None);
    }
}
