//! Reading fio's `--output-format=json+` result of one worker (one job): I/Os, bytes,
//! rates, mean latency, latency histogram bins, errors and fio's own CPU use, per direction.

use crate::hist::Histogram;
use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FioError {
    #[error("fio output is not JSON: {0}")]
    NotJson(String),
    #[error("fio output has no job (expected exactly one: fleet workers run one job each)")]
    NoJob,
    #[error("fio output lacks {0}")]
    Missing(&'static str),
}

/// One direction (read or write) of one worker over fio's measured time (after ramp).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DirStats {
    pub ios: u64,
    pub bytes: u64,
    /// Measured time of this direction, ms.
    pub runtime_ms: u64,
    pub iops: f64,
    pub bytes_per_s: f64,
    /// Mean total latency (submission + completion), ns; 0 without I/Os.
    pub lat_mean_ns: f64,
    /// Total latency histogram (or completion latency if fio gave no total bins).
    pub hist: Histogram,
}

/// A worker's result.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FioJob {
    pub name: String,
    /// fio's error code for the job (0 = none).
    pub error: i64,
    pub read: DirStats,
    pub write: DirStats,
    /// CPU fio itself used, in cores (user + system share of one CPU).
    pub cpu_cores: f64,
    pub fio_version: String,
}

fn u(v: &Value, k: &str) -> u64 {
    v.get(k)
        .and_then(|x| x.as_u64().or_else(|| x.as_f64().map(|f| f.max(0.0) as u64)))
        .unwrap_or(0)
}

fn f(v: &Value, k: &str) -> f64 {
    v.get(k).and_then(Value::as_f64).unwrap_or(0.0)
}

fn bins(v: &Value) -> Histogram {
    let mut h = Histogram::default();
    if let Some(m) = v.get("bins").and_then(Value::as_object) {
        for (k, n) in m {
            if let (Ok(val), Some(n)) = (k.parse::<u64>(), n.as_u64()) {
                h.add(val, n);
            }
        }
    }
    h
}

fn dir(v: &Value) -> DirStats {
    let lat = v.get("lat_ns").cloned().unwrap_or(Value::Null);
    let clat = v.get("clat_ns").cloned().unwrap_or(Value::Null);
    let mut hist = bins(&lat);
    if hist.is_empty() {
        hist = bins(&clat);
    }
    DirStats {
        ios: u(v, "total_ios"),
        bytes: u(v, "io_bytes"),
        runtime_ms: u(v, "runtime"),
        iops: f(v, "iops"),
        bytes_per_s: f(v, "bw_bytes"),
        lat_mean_ns: if u(&lat, "N") > 0 {
            f(&lat, "mean")
        } else {
            f(&clat, "mean")
        },
        hist,
    }
}

/// Parse one worker's json+ output. fio may print notices before the JSON.
pub fn parse(text: &str) -> Result<FioJob, FioError> {
    let start = text
        .find('{')
        .ok_or_else(|| FioError::NotJson("no '{'".into()))?;
    let v: Value =
        serde_json::from_str(&text[start..]).map_err(|e| FioError::NotJson(e.to_string()))?;
    from_value(&v)
}

pub fn from_value(v: &Value) -> Result<FioJob, FioError> {
    let job = v
        .get("jobs")
        .and_then(Value::as_array)
        .and_then(|j| j.first())
        .ok_or(FioError::NoJob)?;
    if job.get("read").is_none() || job.get("write").is_none() {
        return Err(FioError::Missing("jobs[0].read / jobs[0].write"));
    }
    Ok(FioJob {
        name: job
            .get("jobname")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        error: job.get("error").and_then(Value::as_i64).unwrap_or(0),
        read: dir(&job["read"]),
        write: dir(&job["write"]),
        cpu_cores: (f(job, "usr_cpu") + f(job, "sys_cpu")) / 100.0,
        fio_version: v
            .get("fio version")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hist::PERCENTILES;

    const SAMPLE: &str = include_str!("../tests/data/fio-jsonplus.json");

    #[test]
    fn parses_a_real_json_plus_output() {
        let v: Value = serde_json::from_str(SAMPLE).unwrap();
        let j = parse(SAMPLE).unwrap();
        assert_eq!(j.error, 0);
        assert!(j.read.ios > 0 && j.write.ios > 0);
        // Every latency fio recorded is in the bins (a few I/Os more than total_ios:
        // those completing as the window closed).
        for (d, stats) in [("read", &j.read), ("write", &j.write)] {
            let n = v["jobs"][0][d]["lat_ns"]["N"].as_u64().unwrap();
            assert_eq!(stats.hist.count(), n, "{d}");
            assert!(n.abs_diff(stats.ios) <= 16, "{d}: {n} vs {}", stats.ios);
        }
        assert!(j.read.iops > 0.0 && j.read.lat_mean_ns > 0.0);
        assert!(j.fio_version.starts_with("fio-"));
    }

    #[test]
    fn percentiles_from_bins_reproduce_fios_own() {
        let v: Value = serde_json::from_str(SAMPLE).unwrap();
        let j = from_value(&v).unwrap();
        for (d, stats) in [("read", &j.read), ("write", &j.write)] {
            let printed = v["jobs"][0][d]["lat_ns"]["percentile"].as_object().unwrap();
            assert_eq!(
                printed.len(),
                PERCENTILES.len(),
                "fixture made with our list"
            );
            for (key, val) in printed {
                let p: f64 = key.parse().unwrap();
                assert_eq!(stats.hist.percentile(p), val.as_u64(), "{d} p{p}");
            }
        }
    }

    #[test]
    fn notices_before_the_json_and_garbage() {
        let j = parse(&format!("fio: connected to NBD server\n{SAMPLE}")).unwrap();
        assert!(j.read.ios > 0);
        assert!(matches!(parse("nothing"), Err(FioError::NotJson(_))));
        assert!(matches!(parse("{\"jobs\": []}"), Err(FioError::NoJob)));
    }
}
