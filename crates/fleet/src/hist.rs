//! Latency histograms as fio's json+ output gives them (`lat_ns.bins`: bucket value in ns
//! → count), merged across workers and repeats by adding counts, and percentiles read off
//! the merged counts. Percentiles of a fleet are never averaged: the average of per-worker
//! 99.9th percentiles is not the fleet's 99.9th percentile.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Percentiles the tables show.
pub const PERCENTILES: [f64; 6] = [50.0, 90.0, 99.0, 99.9, 99.99, 99.999];
/// I/Os a percentile needs before it means anything: ten beyond it (10 / (1 − p)), so
/// p99.9 needs 10,000 and p99.999 a million. The tables print a percentile only from that
/// many I/Os and mark it otherwise.
pub fn samples_needed(p: f64) -> u64 {
    (10.0 / (1.0 - p / 100.0)).round() as u64
}

/// Whether `samples` I/Os support percentile `p`.
pub fn supported(p: f64, samples: u64) -> bool {
    samples >= samples_needed(p)
}

/// Percentiles of the per-worker latency curves (denser, for the charts).
pub const CURVE_PERCENTILES: [f64; 14] = [
    1.0, 10.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.95, 99.99, 99.995, 99.999,
];

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Histogram {
    /// Bucket value (fio's representative value of the bucket, ns) → I/Os in it.
    pub bins: BTreeMap<u64, u64>,
}

impl Histogram {
    pub fn count(&self) -> u64 {
        self.bins.values().sum()
    }

    pub fn is_empty(&self) -> bool {
        self.count() == 0
    }

    pub fn add(&mut self, value: u64, n: u64) {
        if n > 0 {
            *self.bins.entry(value).or_insert(0) += n;
        }
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (&v, &n) in &other.bins {
            self.add(v, n);
        }
    }

    pub fn merged<'a>(hs: impl IntoIterator<Item = &'a Histogram>) -> Histogram {
        let mut out = Histogram::default();
        for h in hs {
            out.merge(h);
        }
        out
    }

    /// The value of the first bucket whose cumulative count reaches `p`% of all I/Os
    /// (fio's own rule, so one worker's merge reproduces fio's printed percentiles).
    pub fn percentile(&self, p: f64) -> Option<u64> {
        self.percentiles(&[p]).into_iter().next().flatten()
    }

    /// Several percentiles in one pass; `ps` in any order.
    pub fn percentiles(&self, ps: &[f64]) -> Vec<Option<u64>> {
        let total = self.count();
        if total == 0 {
            return vec![None; ps.len()];
        }
        let mut order: Vec<usize> = (0..ps.len()).collect();
        order.sort_by(|&a, &b| ps[a].total_cmp(&ps[b]));
        let mut out = vec![None; ps.len()];
        let mut k = 0;
        let mut cum = 0u64;
        let last = self.bins.keys().next_back().copied();
        for (&v, &n) in &self.bins {
            cum += n;
            while k < order.len() && cum as f64 >= ps[order[k]] / 100.0 * total as f64 {
                out[order[k]] = Some(v);
                k += 1;
            }
        }
        // Rounding can leave p = 100 unmet by a hair: that is the largest bucket.
        for i in order.into_iter().skip(k) {
            out[i] = last;
        }
        out
    }

    /// Mean of the bucket values weighted by count (fio's exact mean is preferred).
    pub fn mean(&self) -> Option<f64> {
        let n = self.count();
        (n > 0).then(|| {
            self.bins
                .iter()
                .map(|(&v, &c)| v as f64 * c as f64)
                .sum::<f64>()
                / n as f64
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// A log-linear bucketing like fio's (64 buckets per power of two, values below 128
    /// exact), mapping a sample to its bucket's middle value: a model of how fio fills
    /// `bins`, written here to generate test histograms from raw samples.
    fn bucket_value(v: u64) -> u64 {
        if v < 128 {
            return v;
        }
        let msb = 63 - v.leading_zeros() as u64;
        let shift = msb - 6;
        let low = (v >> shift) << shift;
        low + (1u64 << shift) / 2
    }

    /// The brute-force answer: all raw samples of all workers in one sorted list, the
    /// first sample whose rank reaches p% of the total.
    fn brute(samples: &mut [u64], p: f64) -> u64 {
        samples.sort_unstable();
        let n = samples.len();
        let mut i = 0;
        while ((i + 1) as f64) < p / 100.0 * n as f64 {
            i += 1;
        }
        samples[i.min(n - 1)]
    }

    #[test]
    fn merged_percentiles_equal_a_brute_force_merge_of_raw_samples() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for round in 0..20 {
            // Workers with very different distributions: one slow one shapes the tail.
            let workers = 1 + round % 6;
            let mut all_raw = Vec::new();
            let mut per_worker = Vec::new();
            for w in 0..workers {
                let n = rng.gen_range(1..20_000);
                let scale = 50_000.0 * (1.0 + w as f64 * 3.0);
                let mut h = Histogram::default();
                for _ in 0..n {
                    // Log-normal-ish latencies with rare huge outliers.
                    let x: f64 = rng.gen::<f64>();
                    let mut v = (scale * (-(1.0 - x).ln()).powf(1.5)) as u64 + 1000;
                    if rng.gen_ratio(1, 2000) {
                        v *= 100;
                    }
                    all_raw.push(v);
                    h.add(bucket_value(v), 1);
                }
                per_worker.push(h);
            }
            let merged = Histogram::merged(&per_worker);
            assert_eq!(merged.count(), all_raw.len() as u64);
            let ps = [0.0, 1.0, 50.0, 90.0, 99.0, 99.9, 99.99, 99.999, 100.0];
            let got = merged.percentiles(&ps);
            for (i, &p) in ps.iter().enumerate() {
                let exact = brute(&mut all_raw, p);
                // Same bucket as the brute-force sample: identical value...
                assert_eq!(got[i], Some(bucket_value(exact)), "round {round} p{p}");
                // ...within the bucket's resolution of the exact raw percentile.
                let g = got[i].unwrap() as f64;
                assert!(
                    (g - exact as f64).abs() <= exact as f64 / 64.0 + 1.0,
                    "round {round} p{p}: {g} vs {exact}"
                );
            }
        }
    }

    #[test]
    fn averaging_percentiles_is_wrong_and_merging_is_not() {
        // A fast and a slow worker: the fleet's p99 lies in the slow one's range.
        let mut fast = Histogram::default();
        fast.add(100, 990);
        fast.add(200, 10);
        let mut slow = Histogram::default();
        slow.add(10_000, 990);
        slow.add(20_000, 10);
        let m = Histogram::merged([&fast, &slow]);
        assert_eq!(m.percentile(25.0), Some(100));
        assert_eq!(m.percentile(99.0), Some(10_000));
        assert_eq!(m.percentile(99.9), Some(20_000));
        let avg = (fast.percentile(99.9).unwrap() + slow.percentile(99.9).unwrap()) / 2;
        assert_eq!(avg, 10_100, "the average is a latency nobody saw");
    }

    #[test]
    fn edge_cases() {
        let h = Histogram::default();
        assert_eq!(h.percentile(99.0), None);
        assert_eq!(h.mean(), None);
        let mut h = Histogram::default();
        h.add(5, 1);
        h.add(7, 0);
        assert_eq!(h.bins.len(), 1);
        assert_eq!(h.percentiles(&[99.999, 0.0, 100.0]), vec![Some(5); 3]);
        assert_eq!(h.mean(), Some(5.0));
        // Serialized as a plain map (string keys in JSON) and back.
        let j = serde_json::to_string(&h).unwrap();
        assert_eq!(j, "{\"5\":1}");
        assert_eq!(serde_json::from_str::<Histogram>(&j).unwrap(), h);
    }
}
