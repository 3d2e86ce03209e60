//! Drive endurance: each drive's rated lifetime writes (TBW over its warranty years), where
//! the rating comes from, and what a measured write rate does to it at 24, 12 and 8 hours
//! of load a day.

use converge_types::MediaType;
use serde::{Deserialize, Serialize};

/// Default class of flash drives (SSD, NVMe) without a rating: 1 drive write per day.
pub const DEFAULT_FLASH_DWPD: f64 = 1.0;
/// Default warranty, years.
pub const DEFAULT_WARRANTY_YEARS: f64 = 5.0;
/// Default workload rating of hard drives, bytes per year (enterprise HDDs: 550 TB/year).
pub const DEFAULT_HDD_BYTES_PER_YEAR: f64 = 550e12;
/// Hours of load per day the endurance table considers.
pub const DUTY_HOURS: [u32; 3] = [24, 12, 8];

const SECONDS_PER_YEAR: f64 = 365.0 * 24.0 * 3600.0;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RatingSource {
    /// `tbw` / `warranty_years` of the drive in its node's converged.toml.
    Config,
    /// `converge fleet run --drive-tbw / --drive-warranty-years`.
    Flag,
    /// The default of the drive's media type.
    Default,
}

/// Rated endurance of one drive.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rating {
    pub tbw_bytes: u64,
    pub warranty_years: f64,
    pub source: RatingSource,
}

impl Rating {
    /// Writes per second the drive sustains over its warranty at 24 h a day.
    pub fn sustainable_bytes_per_s(&self) -> f64 {
        self.tbw_bytes as f64 / (self.warranty_years * SECONDS_PER_YEAR)
    }

    /// Drive writes per day the rating stands for.
    pub fn dwpd(&self, size_bytes: u64) -> f64 {
        self.tbw_bytes as f64 / (self.warranty_years * 365.0 * size_bytes as f64)
    }
}

/// The default rating of a media type; RAM does not wear, so it has none.
pub fn default_rating(media: MediaType, size_bytes: u64) -> Option<Rating> {
    let years = DEFAULT_WARRANTY_YEARS;
    let tbw = match media {
        MediaType::Ssd | MediaType::Nvme => DEFAULT_FLASH_DWPD * size_bytes as f64 * 365.0 * years,
        MediaType::Hdd => DEFAULT_HDD_BYTES_PER_YEAR * years,
        MediaType::Ram => return None,
    };
    Some(Rating {
        tbw_bytes: tbw as u64,
        warranty_years: years,
        source: RatingSource::Default,
    })
}

/// A drive's rating: the fleet's flags win over the node config, which wins over the
/// media default. Each field falls back on its own.
pub fn resolve(
    media: MediaType,
    size_bytes: u64,
    config_tbw: Option<u64>,
    config_years: Option<f64>,
    flag_tbw: Option<u64>,
    flag_years: Option<f64>,
) -> Option<Rating> {
    let default = default_rating(media, size_bytes);
    let (tbw, tbw_src) = match (flag_tbw, config_tbw) {
        (Some(t), _) => (t, RatingSource::Flag),
        (None, Some(t)) => (t, RatingSource::Config),
        (None, None) => (default?.tbw_bytes, RatingSource::Default),
    };
    let (years, years_src) = match (flag_years, config_years) {
        (Some(y), _) => (y, RatingSource::Flag),
        (None, Some(y)) => (y, RatingSource::Config),
        (None, None) => (DEFAULT_WARRANTY_YEARS, RatingSource::Default),
    };
    // The most specific source names the rating.
    let source = match (tbw_src, years_src) {
        (RatingSource::Flag, _) | (_, RatingSource::Flag) => RatingSource::Flag,
        (RatingSource::Config, _) | (_, RatingSource::Config) => RatingSource::Config,
        _ => RatingSource::Default,
    };
    (tbw > 0 && years > 0.0).then_some(Rating {
        tbw_bytes: tbw,
        warranty_years: years,
        source,
    })
}

/// Years until the rating is used up when the drive is written at `bytes_per_s` for
/// `duty_hours` a day (infinite without writes).
pub fn lifetime_years(rating: &Rating, bytes_per_s: f64, duty_hours: u32) -> f64 {
    let per_year = bytes_per_s * f64::from(duty_hours) * 3600.0 * 365.0;
    if per_year <= 0.0 {
        f64::INFINITY
    } else {
        rating.tbw_bytes as f64 / per_year
    }
}

/// Drive writes per day the load needs at `duty_hours` a day: compare with drive classes
/// (read-intensive ~1, mixed-use ~3, write-intensive ~10 DWPD).
pub fn dwpd_needed(bytes_per_s: f64, duty_hours: u32, size_bytes: u64) -> f64 {
    if size_bytes == 0 {
        return 0.0;
    }
    bytes_per_s * f64::from(duty_hours) * 3600.0 / size_bytes as f64
}

/// History a forecast needs before it warns: a rate measured over less (a burst in the
/// first minutes) is shown, but says little of the years ahead.
pub const FORECAST_SPAN_MIN_S: u64 = 3600;

/// Windows of the live write rates, seconds: 1 hour, 24 hours, 7 days.
pub const RATE_WINDOWS: [(&str, u64); 3] = [("1h", 3600), ("24h", 86_400), ("7d", 7 * 86_400)];

/// One drive's lifetime writes as its node keeps them across restarts (in etcd at
/// `/converge/wear/<drive>`): the bytes the device was written since converge first saw it,
/// and samples of that count to measure rates over [`RATE_WINDOWS`]. Samples are thinned
/// with age (one per 5 minutes within the hour, per hour within the day, per 6 hours
/// within 8 days; older ones go), so the record stays under ~70 samples.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WearHistory {
    /// When converge first counted this drive's writes (unix seconds): its warranty is
    /// counted from here.
    pub first_seen_unix: u64,
    /// Bytes written to the device since then (data, journal and metadata).
    pub lifetime_bytes: u64,
    /// When `lifetime_bytes` was last counted.
    pub updated_unix: u64,
    /// (unix seconds, lifetime bytes then), oldest first.
    pub samples: Vec<(u64, u64)>,
}

/// A write rate measured over `over_s` seconds (less than its window while the history is
/// shorter).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct WearRate {
    pub bytes_per_s: f64,
    pub over_s: u64,
}

/// What the rates say of a drive's rated endurance.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Forecast {
    pub lifetime_bytes: u64,
    pub first_seen_unix: u64,
    /// The rates over [`RATE_WINDOWS`], in order (None: no history yet).
    pub rates: [Option<WearRate>; 3],
    pub rating: Option<Rating>,
    /// Share of the rated TBW written so far, percent.
    pub used_pct: Option<f64>,
    /// Days until the rated TBW is reached at the rate of the longest window measured
    /// (None: no rating, or no writes at that rate).
    pub days_to_rated: Option<f64>,
    /// The window `days_to_rated` comes from.
    pub rate_window: Option<String>,
    /// When the warranty ends: `first_seen_unix` + the rating's warranty years.
    pub warranty_ends_unix: Option<u64>,
    /// The rated TBW is reached before the warranty ends at that rate.
    pub wears_out_before_warranty: bool,
    /// Seconds of history the forecast's rate was measured over; a forecast from less than
    /// [`FORECAST_SPAN_MIN_S`] is not one to warn on.
    pub span_s: u64,
}

impl Forecast {
    /// The drive wears out before its warranty ends, by a rate measured over enough history
    /// to say so.
    pub fn warns(&self) -> bool {
        self.wears_out_before_warranty && self.span_s >= FORECAST_SPAN_MIN_S
    }
}

impl WearHistory {
    /// A drive first seen at `now`, with nothing written yet.
    pub fn new(now: u64) -> WearHistory {
        WearHistory {
            first_seen_unix: now,
            updated_unix: now,
            lifetime_bytes: 0,
            samples: vec![(now, 0)],
        }
    }

    /// Counts the drive's lifetime writes at `now` and keeps a sample of it.
    pub fn record(&mut self, now: u64, lifetime_bytes: u64) {
        self.lifetime_bytes = self.lifetime_bytes.max(lifetime_bytes);
        self.updated_unix = self.updated_unix.max(now);
        self.samples.push((now, self.lifetime_bytes));
        // One sample per bucket of its age class, the bucket's first (so a sample's time
        // does not move as newer ones arrive); the newest is always kept.
        let bucket = |t: u64| -> Option<u64> {
            let age = now.saturating_sub(t);
            match age {
                a if a <= 3600 => Some(t / 300),
                a if a <= 86_400 => Some((1 << 40) | (t / 3600)),
                a if a <= 8 * 86_400 => Some((2 << 40) | (t / 21_600)),
                _ => None,
            }
        };
        let newest = self.samples.len() - 1;
        let mut last: Option<u64> = None;
        let mut kept = Vec::with_capacity(self.samples.len());
        for (i, &(t, b)) in self.samples.iter().enumerate() {
            let k = bucket(t);
            if i == newest || (k.is_some() && k != last) {
                kept.push((t, b));
            }
            if k.is_some() {
                last = k;
            }
        }
        self.samples = kept;
    }

    /// The write rate over the last `window` seconds before `now`: from the newest sample
    /// at least that old, else the oldest (a shorter span, said in `over_s`).
    pub fn rate(&self, now: u64, window: u64) -> Option<WearRate> {
        let from = self
            .samples
            .iter()
            .rev()
            .find(|(t, _)| now.saturating_sub(*t) >= window)
            .or_else(|| self.samples.first())?;
        let over_s = now.saturating_sub(from.0);
        (over_s > 0).then(|| WearRate {
            bytes_per_s: self.lifetime_bytes.saturating_sub(from.1) as f64 / over_s as f64,
            over_s,
        })
    }

    /// The rates and what they do to `rating` at `now`.
    pub fn forecast(&self, rating: Option<Rating>, now: u64) -> Forecast {
        let rates = RATE_WINDOWS.map(|(_, w)| self.rate(now, w));
        // The longest window measured: a rate over 7 days says more than one over an hour.
        let chosen = RATE_WINDOWS
            .iter()
            .zip(&rates)
            .rev()
            .find_map(|((name, _), r)| r.map(|r| (*name, r)));
        let warranty_ends_unix =
            rating.map(|r| self.first_seen_unix + (r.warranty_years * SECONDS_PER_YEAR) as u64);
        let days_to_rated = match (rating, chosen) {
            (Some(r), Some((_, rate))) if rate.bytes_per_s > 0.0 => Some(
                r.tbw_bytes.saturating_sub(self.lifetime_bytes) as f64
                    / rate.bytes_per_s
                    / 86_400.0,
            ),
            _ => None,
        };
        let wears_out_before_warranty = match (days_to_rated, warranty_ends_unix) {
            (Some(d), Some(end)) => now as f64 + d * 86_400.0 < end as f64,
            _ => false,
        };
        Forecast {
            lifetime_bytes: self.lifetime_bytes,
            first_seen_unix: self.first_seen_unix,
            rates,
            rating,
            used_pct: rating.map(|r| 100.0 * self.lifetime_bytes as f64 / r.tbw_bytes as f64),
            days_to_rated,
            rate_window: chosen.map(|(n, _)| n.to_string()),
            warranty_ends_unix,
            wears_out_before_warranty,
            span_s: chosen.map_or(0, |(_, r)| r.over_s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TB: u64 = 1_000_000_000_000;

    #[test]
    fn default_flash_rating_is_one_dwpd_over_five_years() {
        let r = default_rating(MediaType::Nvme, 2 * TB).unwrap();
        assert_eq!(r.tbw_bytes, 2 * TB * 365 * 5);
        assert_eq!(r.warranty_years, 5.0);
        assert!((r.dwpd(2 * TB) - 1.0).abs() < 1e-12);
        assert!(default_rating(MediaType::Ram, TB).is_none());
        let h = default_rating(MediaType::Hdd, 10 * TB).unwrap();
        assert_eq!(h.tbw_bytes, 550 * TB * 5);
    }

    #[test]
    fn sustainable_rate_and_duty_cycles() {
        // 3650 TB over 5 years: 2 TB a day = 23.148 MB/s around the clock.
        let r = Rating {
            tbw_bytes: 3650 * TB,
            warranty_years: 5.0,
            source: RatingSource::Config,
        };
        let s = r.sustainable_bytes_per_s();
        assert!((s - 2e12 / 86400.0).abs() < 1e-3, "{s}");
        // Written at exactly that rate all day, it lasts the warranty; at 12 h a day it
        // lasts twice as long, at 8 h three times.
        assert!((lifetime_years(&r, s, 24) - 5.0).abs() < 1e-9);
        assert!((lifetime_years(&r, s, 12) - 10.0).abs() < 1e-9);
        assert!((lifetime_years(&r, s, 8) - 15.0).abs() < 1e-9);
        // Twice the rate halves the life.
        assert!((lifetime_years(&r, 2.0 * s, 24) - 2.5).abs() < 1e-9);
        assert!(lifetime_years(&r, 0.0, 24).is_infinite());
        // A 2 TB drive at that rate is written once a day at 24 h, half at 12 h.
        assert!((dwpd_needed(s, 24, 2 * TB) - 1.0).abs() < 1e-9);
        assert!((dwpd_needed(s, 12, 2 * TB) - 0.5).abs() < 1e-9);
    }

    #[test]
    fn precedence_flag_then_config_then_default() {
        let m = MediaType::Ssd;
        let r = resolve(m, TB, None, None, None, None).unwrap();
        assert_eq!(r.source, RatingSource::Default);
        let r = resolve(m, TB, Some(7 * TB), None, None, None).unwrap();
        assert_eq!((r.tbw_bytes, r.source), (7 * TB, RatingSource::Config));
        assert_eq!(r.warranty_years, 5.0);
        let r = resolve(m, TB, Some(7 * TB), Some(3.0), Some(9 * TB), None).unwrap();
        assert_eq!((r.tbw_bytes, r.warranty_years), (9 * TB, 3.0));
        assert_eq!(r.source, RatingSource::Flag);
        assert!(resolve(MediaType::Ram, TB, None, None, None, None).is_none());
        // A RAM drive given a rating explicitly has one.
        assert!(resolve(MediaType::Ram, TB, None, None, Some(TB), None).is_some());
        assert!(resolve(m, TB, Some(0), None, None, None).is_none());
    }

    #[test]
    fn wear_history_keeps_few_samples_and_measures_each_window() {
        let t0 = 1_000_000_000;
        let mut h = WearHistory::new(t0);
        // 10 days written at 1 MB/s, counted every minute.
        let mut now = t0;
        while now <= t0 + 10 * 86_400 {
            h.record(now, (now - t0) * 1_000_000);
            now += 60;
        }
        let now = now - 60;
        assert!(h.samples.len() <= 70, "{} samples", h.samples.len());
        assert!(h.samples.windows(2).all(|w| w[0].0 < w[1].0));
        for (_, w) in RATE_WINDOWS {
            let r = h.rate(now, w).unwrap();
            assert!((r.bytes_per_s - 1e6).abs() < 1.0, "{w}: {r:?}");
            // Within a bucket of the window.
            assert!(r.over_s >= w && r.over_s <= w + 21_600, "{w}: {r:?}");
        }
        // Then an idle hour: the 1 h rate falls to 0, the longer ones less.
        h.record(now + 3600, h.lifetime_bytes);
        assert_eq!(h.rate(now + 3600, 3600).unwrap().bytes_per_s, 0.0);
        assert!(h.rate(now + 3600, 86_400).unwrap().bytes_per_s > 0.9e6);
        // A count never goes back (a node that lost its last minute counts on from there).
        h.record(now + 3660, 5);
        assert_eq!(h.lifetime_bytes, 10 * 86_400 * 1_000_000);
    }

    #[test]
    fn forecast_says_when_the_rating_runs_out_and_whether_before_the_warranty() {
        let t0 = 1_000_000_000;
        let rating = Rating {
            tbw_bytes: 100 * TB,
            warranty_years: 5.0,
            source: RatingSource::Config,
        };
        // Two hours of history at 1 GB/s: 100 TB last 100,000 s − the 7.2 TB written.
        let mut h = WearHistory::new(t0);
        for m in 0..=120 {
            h.record(t0 + m * 60, m * 60 * 1_000_000_000);
        }
        let now = t0 + 7200;
        let f = h.forecast(Some(rating), now);
        assert_eq!(
            f.rate_window.as_deref(),
            Some("7d"),
            "the longest window measured"
        );
        assert_eq!(
            f.rates[2].unwrap().over_s,
            7200,
            "only two hours of it so far"
        );
        let days = f.days_to_rated.unwrap();
        assert!(
            (days - (100e12 - 7.2e12) / 1e9 / 86_400.0).abs() < 1e-6,
            "{days}"
        );
        assert!((f.used_pct.unwrap() - 7.2).abs() < 1e-9);
        assert!(f.wears_out_before_warranty);
        assert!(f.warns(), "two hours of history are enough to warn");
        let young = {
            let mut y = WearHistory::new(t0);
            y.record(t0 + 600, 600_000_000_000);
            y.forecast(Some(rating), t0 + 600)
        };
        assert!(
            young.wears_out_before_warranty && !young.warns(),
            "ten minutes are not"
        );
        assert_eq!(
            f.warranty_ends_unix,
            Some(t0 + (5.0 * SECONDS_PER_YEAR) as u64)
        );
        // At 0.1 MB/s it outlives the warranty (31.7 years); without writes, no date at all.
        let mut slow = WearHistory::new(t0);
        slow.record(t0 + 3600, 360_000_000);
        let f = slow.forecast(Some(rating), t0 + 3600);
        assert!(!f.wears_out_before_warranty && f.days_to_rated.unwrap() > 5.0 * 365.0);
        let idle = WearHistory::new(t0).forecast(Some(rating), t0 + 60);
        assert_eq!(
            (idle.days_to_rated, idle.wears_out_before_warranty),
            (None, false)
        );
        // No rating (RAM): rates, but nothing to forecast against.
        let f = h.forecast(None, now);
        assert!(f.rates[0].is_some() && f.days_to_rated.is_none() && f.used_pct.is_none());
    }
}
