//! Numbers for people: IOPS with thousands separators, latencies in µs or ms, rates,
//! percentages and changes, with the same rules in every table and chart.

/// `15194.6` → `15,195`.
pub fn iops(v: f64) -> String {
    let n = v.round().max(0.0) as u64;
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Three significant digits, no exponent: 0.123, 1.23, 12.3, 123, 1234.
pub fn sig3(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 || !v.is_finite() {
        return if v.is_finite() {
            "0".into()
        } else {
            "∞".into()
        };
    }
    if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else if a >= 0.01 {
        format!("{v:.3}")
    } else {
        format!("{v:.4}")
    }
}

/// A latency given in µs: `87.5 µs`, `1.23 ms`, `2.50 s`.
pub fn lat_us(v: f64) -> String {
    if v < 1000.0 {
        format!("{} µs", sig3(v))
    } else if v < 1_000_000.0 {
        format!("{} ms", sig3(v / 1000.0))
    } else {
        format!("{} s", sig3(v / 1e6))
    }
}

pub fn lat_opt(v: Option<f64>) -> String {
    v.map(lat_us).unwrap_or_else(|| "no I/O".into())
}

/// A latency percentile read from `samples` I/Os: absent with I/Os means too few of them
/// to support it (`hist::supported`), marked instead of printed.
pub fn tail(v: Option<f64>, samples: u64) -> String {
    match v {
        Some(u) => lat_us(u),
        None if samples > 0 => "too few I/Os".into(),
        None => "no I/O".into(),
    }
}

pub fn pct(v: f64) -> String {
    format!("{v:.1} %")
}

pub fn ratio(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.2}"))
        .unwrap_or_else(|| "no writes".into())
}

/// Drive life: `12.3 y`, `>1000 y`, `45.6 days` under a year, `no wear`.
pub fn years(v: Option<f64>) -> String {
    match v {
        None => "no wear".into(),
        Some(y) if y >= 1000.0 => ">1000 y".into(),
        Some(y) if y < 1.0 => format!("{} days", sig3(y * 365.0)),
        Some(y) => format!("{} y", sig3(y)),
    }
}

/// Change from `base` to `v`: `+12.3 %`, `-4.0 %`, `n/a` when base is 0.
pub fn change(base: f64, v: f64) -> String {
    if base == 0.0 || !base.is_finite() || !v.is_finite() {
        return "n/a".into();
    }
    let c = 100.0 * (v - base) / base;
    format!("{}{c:.1} %", if c >= 0.0 { "+" } else { "" })
}

/// Seconds as `2m05s`, `1h02m`, `45s`.
pub fn duration_s(s: f64) -> String {
    let s = s.max(0.0).round() as u64;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(iops(15194.6), "15,195");
        assert_eq!(iops(999.0), "999");
        assert_eq!(iops(1_000_000.0), "1,000,000");
        assert_eq!(lat_us(87.54), "87.5 µs");
        assert_eq!(lat_us(1234.0), "1.23 ms");
        assert_eq!(lat_us(2_500_000.0), "2.50 s");
        assert_eq!(lat_opt(None), "no I/O");
        assert_eq!(change(100.0, 112.34), "+12.3 %");
        assert_eq!(change(100.0, 96.0), "-4.0 %");
        assert_eq!(change(0.0, 5.0), "n/a");
        assert_eq!(years(Some(5000.0)), ">1000 y");
        assert_eq!(years(Some(2.345)), "2.35 y");
        assert_eq!(years(Some(0.5)), "182 days");
        assert_eq!(duration_s(125.0), "2m05s");
        assert_eq!(duration_s(3725.0), "1h02m");
        assert_eq!(sig3(0.004567), "0.0046");
    }
}
