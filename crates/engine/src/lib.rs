//! converge-engine: the per-drive store (DESIGN.md "Local engine"). Extents of slab size,
//! crc32c + version per 4 KiB block, epoch fencing, a metadata journal with group commit,
//! and crash recovery that returns old or new data, or reports the block bad.
//!
//! Layout and recovery are specified byte by byte in docs/FORMAT-engine.md.

// Tests may unwrap: a panic there is the failure report.
#![cfg_attr(test, allow(clippy::unwrap_used))]

mod cache;
mod codec;
mod commit;
mod drive;
mod durable;
mod error;
pub mod faulty;
pub mod file;
pub mod layout;
pub mod minisim;
mod pool;
mod recover;
mod sample;
pub mod shards;
mod stats;

pub use cache::{Cache, CacheStats, OpenReport, Tier, CACHE_FORMAT_VERSION, CACHE_MIN_BYTES};
pub use drive::{Capacity, DestageRun, Drive, ExtentInfo, FormatOptions, ReadInfo, ShadowInfo};
pub use durable::Durable;
pub use error::EngineError;
pub use faulty::{CrashMode, FaultyFile};
pub use file::{AlignedBuf, BlockFile, DirectFile};
pub use layout::{DriveIdentity, FORMAT_VERSION};
pub use sample::{DataBlock, DataBlockSample};
pub use stats::{DriveStats, LatencyHistogram, LATENCY_BUCKETS};

#[cfg(test)]
mod tests;
