//! Each drive's lifetime writes, kept across restarts, and the endurance forecast made from
//! them (docs/ENDURANCE.md).
//!
//! The engines count the bytes written to each device since it was opened. Every
//! `wear_record_s` seconds (and at a clean shutdown) the node adds that count to what the
//! drive's record in etcd (`/converge/wear/<drive>`) held when the node started, keeps a
//! sample of it (`WearHistory`), and writes the record back if the count changed (an idle
//! drive's record is rewritten at most hourly). `/v1/status`, `/metrics` and
//! `converge status` read the records and forecast each drive against its rating.

use crate::node::Node;
use converge_api::{DriveInfo, DriveWear, WearRate};
use converge_fleet::endurance::{self, Forecast, WearHistory, RATE_WINDOWS};
use converge_types::DriveId;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The local drives' wear records: what etcd held at start (the base the engines' counts
/// since open add to) and the history as last counted.
#[derive(Default)]
pub struct WearBook {
    drives: Mutex<HashMap<DriveId, (u64, WearHistory)>>,
    /// Each local drive's rating, from its record (for `/metrics`).
    ratings: Mutex<HashMap<DriveId, Option<endurance::Rating>>>,
    /// Each local drive's lifetime count as last written to etcd, and when.
    written: Mutex<HashMap<DriveId, (u64, Instant)>>,
}

/// A drive whose count did not change is written again only this often (an idle drive's
/// record stays as it was; its forecast is made at its last count).
const UNCHANGED_REWRITE: Duration = Duration::from_secs(3600);

impl WearBook {
    /// Each local drive counted so far: its history as last counted and its forecast then.
    pub fn forecasts(&self) -> Vec<(DriveId, WearHistory, Forecast)> {
        let ratings = self.ratings.lock().expect("wear book poisoned");
        let mut v: Vec<_> = self
            .drives
            .lock()
            .expect("wear book poisoned")
            .iter()
            .map(|(id, (_, h))| {
                let rating = ratings.get(id).copied().flatten();
                (*id, h.clone(), h.forecast(rating, h.updated_unix))
            })
            .collect();
        v.sort_by_key(|x| x.0);
        v
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Bytes written to each local drive (capacity and cache) since it was opened; a failed
/// drive is left out.
fn written_since_open(node: &Node) -> Vec<(DriveId, u64)> {
    let mut out: Vec<(DriveId, u64)> = node
        .drives
        .iter()
        .filter(|(_, t)| t.failure().is_none())
        .map(|(id, t)| (*id, t.drive().stats().write_bytes))
        .collect();
    out.extend(
        node.caches
            .iter()
            .filter(|(_, c)| c.stats().failed.is_none())
            .map(|(id, c)| (*id, c.drive_stats().write_bytes)),
    );
    out
}

/// Counts every local drive now and writes their records. A drive whose record could not
/// be read yet is not written (it would start its count from zero over the real one).
pub async fn record(node: &Node) {
    let now = unix_now();
    let counts = written_since_open(node);
    let missing = {
        let book = node.wear.drives.lock().expect("wear book poisoned");
        counts.iter().any(|(id, _)| !book.contains_key(id))
    };
    if missing {
        let both = match node.cluster.wear_records::<WearHistory>().await {
            Ok(r) => node.cluster.drives().await.map(|d| (r, d)),
            Err(e) => Err(e),
        };
        match both {
            Ok((recs, defs)) => {
                let mut ratings = node.wear.ratings.lock().expect("wear book poisoned");
                for d in defs.iter().filter(|d| d.node == node.cfg.node_id) {
                    ratings.insert(d.id, rating_of(d));
                }
                drop(ratings);
                let mut book = node.wear.drives.lock().expect("wear book poisoned");
                for (id, _) in &counts {
                    // The first count after the node starts is written even if unchanged
                    // (one write per drive and start): the record then says this node
                    // counted it since (`updated_unix`).
                    book.entry(*id).or_insert_with(|| match recs.get(id) {
                        Some(h) => (h.lifetime_bytes, h.clone()),
                        None => (0, WearHistory::new(now)),
                    });
                }
            }
            Err(e) => {
                log::debug!("reading the drives' wear records: {e}");
                return;
            }
        }
    }
    let updated: Vec<(DriveId, WearHistory)> = {
        let mut book = node.wear.drives.lock().expect("wear book poisoned");
        counts
            .iter()
            .filter_map(|(id, written)| {
                let (base, h) = book.get_mut(id)?;
                h.record(now, *base + written);
                Some((*id, h.clone()))
            })
            .collect()
    };
    for (id, h) in updated {
        let due = {
            let written = node.wear.written.lock().expect("wear book poisoned");
            written.get(&id).is_none_or(|(bytes, at)| {
                *bytes != h.lifetime_bytes || at.elapsed() >= UNCHANGED_REWRITE
            })
        };
        if !due {
            continue;
        }
        match node.cluster.put_wear(id, &h).await {
            Ok(()) => {
                node.wear
                    .written
                    .lock()
                    .expect("wear book poisoned")
                    .insert(id, (h.lifetime_bytes, Instant::now()));
            }
            Err(e) => log::debug!("writing drive {id}'s wear record: {e}"),
        }
    }
}

/// Counts the local drives every `wear_record_s` seconds.
pub async fn run(node: Arc<Node>) {
    let every = Duration::from_secs(node.cfg.knobs.wear_record_s.max(1));
    loop {
        record(&node).await;
        tokio::time::sleep(every).await;
    }
}

/// A drive's rating: its `tbw` and `warranty_years`, else its media's defaults (none for
/// RAM).
fn rating_of(rec: &converge_control::model::DriveRecord) -> Option<endurance::Rating> {
    endurance::resolve(
        rec.media,
        rec.size_bytes,
        rec.tbw_bytes,
        rec.warranty_years,
        None,
        None,
    )
}

/// The health warning of a drive whose forecast says it wears out before its warranty
/// ends, from an hour of history or more ([`Forecast::warns`]).
fn warning(d: &DriveInfo, f: &Forecast, now: u64) -> Option<String> {
    if !f.warns() {
        return None;
    }
    let days = f.days_to_rated.unwrap_or(0.0);
    let left = f
        .warranty_ends_unix
        .map_or(0.0, |e| e.saturating_sub(now) as f64 / 86_400.0);
    Some(format!(
        "drive {:016x} on node {} reaches its rated endurance in {days:.0} days at its {} write rate, before its warranty ends in {left:.0} days",
        d.id.0,
        d.node,
        f.rate_window.as_deref().unwrap_or("measured"),
    ))
}

fn to_api(h: &WearHistory, f: Forecast) -> DriveWear {
    DriveWear {
        lifetime_written_bytes: f.lifetime_bytes,
        first_seen_unix: f.first_seen_unix,
        updated_unix: h.updated_unix,
        write_rates: RATE_WINDOWS
            .iter()
            .zip(f.rates)
            .filter_map(|((name, _), r)| {
                r.map(|r| WearRate {
                    window: (*name).to_string(),
                    bytes_per_s: r.bytes_per_s,
                    over_s: r.over_s,
                })
            })
            .collect(),
        rated_tbw_bytes: f.rating.map(|r| r.tbw_bytes),
        warranty_years: f.rating.map(|r| r.warranty_years),
        used_pct: f.used_pct,
        days_to_rated_tbw: f.days_to_rated,
        rate_window: f.rate_window,
        warranty_ends_unix: f.warranty_ends_unix,
        wears_out_before_warranty: f.wears_out_before_warranty,
        forecast_span_s: f.span_s,
    }
}

/// Fills in each drive's [`DriveWear`] from the records in etcd, forecast at the time of
/// its last count (so the figures of a drive whose node is down, or restarted, stay what
/// they were); returns a warning for each drive that wears out before its warranty ends.
pub async fn annotate(node: &Node, drives: &mut [DriveInfo]) -> Vec<String> {
    let (Ok(recs), Ok(defs)) = (
        node.cluster.wear_records::<WearHistory>().await,
        node.cluster.drives().await,
    ) else {
        return Vec::new();
    };
    let defs: HashMap<DriveId, _> = defs.into_iter().map(|r| (r.id, r)).collect();
    let mut warnings = Vec::new();
    for d in drives.iter_mut() {
        let (Some(h), Some(rec)) = (recs.get(&d.id), defs.get(&d.id)) else {
            continue;
        };
        let f = h.forecast(rating_of(rec), h.updated_unix);
        warnings.extend(warning(d, &f, h.updated_unix));
        d.wear = Some(to_api(h, f));
    }
    warnings
}
