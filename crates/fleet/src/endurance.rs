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
}
