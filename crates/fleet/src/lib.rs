//! converge-fleet: the fleet methodology (`../shared/METHODOLOGY.md`, docs/FLEET.md) as
//! pure code. Profiles expand into sweep points; fio json+ results and node counter
//! samples reduce to per-point measurements; those become fleet totals, percentiles merged
//! from histograms, CPU per I/O, drive queue length against the expected, write
//! amplification by tier and endurance, second-by-second timelines; and those become `summary.json`, `summary.csv`,
//! `report.md`, a self-contained `report.html` with SVG charts, and comparisons of runs.
//!
//! No I/O here except reading and writing report files: the CLI collects, this decides.

#![cfg_attr(test, allow(clippy::unwrap_used))]

pub mod compare;
pub mod endurance;
pub mod fio;
pub mod format;
pub mod hist;
pub mod measure;
pub mod model;
pub mod profile;
pub mod report;
pub mod scaleout;
pub mod svg;
pub mod table;
pub mod timeline;

pub use model::{PointRecord, PointStats, RunConfig, RunStatus, RunSummary};
pub use profile::{Overrides, Point, Profile, Settings};
