//! The vocabulary of DESIGN.md as types, so every layer names things the same way.
//!
//! Nothing here does I/O. Ids are small copyable newtypes; units are in the names.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

pub mod extent;
pub mod mrc;
pub use extent::{
    BadReply, BlocksReply, ExtentOp, ExtentReply, FloorHistory, ReadReply, ReplyShape, SettleRows,
    KEPT_SNAPSHOTS_MAX, SETTLE_ROWS_MAX,
};

/// Every internal I/O is in units of this many bytes (DESIGN.md: local engine).
pub const BLOCK_SIZE: usize = 4096;
/// Default slab size: the unit of placement.
pub const DEFAULT_SLAB_SIZE_BYTES: u64 = 256 << 20;
/// Largest single client or replica I/O, in bytes. NBD requests above this are refused.
pub const MAX_IO_BYTES: usize = 32 << 20;

macro_rules! id_type {
    ($(#[$m:meta])* $name:ident($inner:ty)) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default)]
        #[serde(transparent)]
        pub struct $name(pub $inner);
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}", self.0)
            }
        }
    };
}

id_type!(
    /// A node: one server running `converged`; the default fault domain.
    NodeId(u32)
);
/// Longest node name accepted.
pub const NODE_NAME_BYTES_MAX: usize = 63;

/// Whether a node name (`[node] name`) is one: 1 to 63 letters, digits, `.`, `_` and `-`,
/// starting with a letter or digit. Names reach shell commands (`cluster rolling-restart
/// --exec`), logs and tables; nothing else is needed to name a host.
pub fn valid_node_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= NODE_NAME_BYTES_MAX
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

id_type!(
    /// A drive, unique in the cluster (random, written in the drive's superblock).
    DriveId(u64)
);
id_type!(
    /// A volume, unique in the cluster (random; the name is the user-facing handle).
    VolumeId(u64)
);
/// Index of a slab within its volume (byte offset / slab span).
///
/// A volume with a mirror part (mirror-accelerated parity, docs/adr/0009) has two kinds:
/// a parity span's index (byte offset / (K × extent size)), and a mirror-part slab's
/// ([`SlabIndex::mirror_part`]): bit 62 set, the rest the byte offset / extent size. Its
/// text form is `m<n>`.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default,
)]
#[serde(transparent)]
pub struct SlabIndex(pub u64);

impl SlabIndex {
    const MIRROR_PART: u64 = 1 << 62;

    /// The mirror-part slab holding volume bytes `[n × extent, (n + 1) × extent)`.
    pub fn mirror_part(n: u64) -> SlabIndex {
        assert!(n < Self::MIRROR_PART, "mirror-part slab index out of range");
        SlabIndex(Self::MIRROR_PART | n)
    }

    /// Whether this is a mirror-part slab of a volume with a mirror part.
    pub fn is_mirror_part(self) -> bool {
        self.0 & Self::MIRROR_PART != 0
    }

    /// The extent-sized piece of the volume a mirror-part slab holds (`n` of
    /// [`SlabIndex::mirror_part`]), or the span index of any other slab.
    pub fn position(self) -> u64 {
        self.0 & !Self::MIRROR_PART
    }
}

impl fmt::Display for SlabIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_mirror_part() {
            write!(f, "m{}", self.position())
        } else {
            write!(f, "{}", self.0)
        }
    }
}
id_type!(
    /// Fencing number of an ownership term. Replicas refuse older epochs.
    Epoch(u64)
);
id_type!(
    /// Per-slab, per-write monotonically increasing stamp stored with each block.
    Version(u64)
);

/// Identity of a cluster: written into every drive's superblock so a drive from another
/// cluster is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct ClusterId(pub u128);

impl fmt::Display for ClusterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl FromStr for ClusterId {
    type Err = ParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        u128::from_str_radix(s, 16)
            .map(ClusterId)
            .map_err(|_| ParseError(format!("cluster id {s:?} is not 32 hex digits")))
    }
}

impl Serialize for ClusterId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for ClusterId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The key of an extent: which slab of which volume it holds a copy of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ExtentKey {
    pub volume: VolumeId,
    pub slab: SlabIndex,
}

/// Error for user-supplied text that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ParseError(pub String);

/// Fewest data chunks of a parity slab: one would be replication, which mirrors do.
pub const PARITY_DATA_MIN: u8 = 2;
/// Most data chunks of a parity slab: bounds the nodes one slab spans and a row's size.
pub const PARITY_DATA_MAX: u8 = 16;
/// Fewest parity chunks of a parity slab.
pub const PARITY_CHUNKS_MIN: u8 = 1;
/// Most parity chunks of a parity slab.
pub const PARITY_CHUNKS_MAX: u8 = 4;
/// Most chunks (data + parity) of one slab, i.e. the nodes one slab needs.
pub const PARITY_ALL_MAX: u8 = 20;

/// Mirror-accelerated parity: the owner rotates spans from a volume's mirror part into
/// parity when the part is fuller than this (percent of its size)...
pub const ROTATE_HIGH_PCT: u64 = 85;
/// ...until it is at most this full.
pub const ROTATE_LOW_PCT: u64 = 70;

/// How a volume survives failures.
///
/// Written and read as text (`simple`, `mirror-2`, `mirror-3`, `parity-K+M`), in the
/// control plane's records and the API alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Resiliency {
    /// One copy: no redundancy. For comparisons and scratch data.
    Simple,
    Mirror2,
    Mirror3,
    /// Erasure coding (docs/adr/0008): each slab is `data` data chunks and `parity`
    /// Reed–Solomon parity chunks, each on a different node; any `parity` of them may be
    /// lost. Only values [`Resiliency::parity`] accepts exist.
    Parity {
        data: u8,
        parity: u8,
    },
}

impl Resiliency {
    /// parity-`data`+`parity`, if that shape is supported.
    pub fn parity(data: u8, parity: u8) -> Result<Resiliency, ParseError> {
        let ok = (PARITY_DATA_MIN..=PARITY_DATA_MAX).contains(&data)
            && (PARITY_CHUNKS_MIN..=PARITY_CHUNKS_MAX).contains(&parity)
            && u16::from(data) + u16::from(parity) <= u16::from(PARITY_ALL_MAX);
        if ok {
            Ok(Resiliency::Parity { data, parity })
        } else {
            Err(ParseError(format!(
                "parity-{data}+{parity} is not supported: use {PARITY_DATA_MIN} to \
                 {PARITY_DATA_MAX} data chunks, {PARITY_CHUNKS_MIN} to {PARITY_CHUNKS_MAX} \
                 parity chunks and at most {PARITY_ALL_MAX} chunks in all"
            )))
        }
    }

    /// Extents per slab (copies of a mirror, chunks of a parity slab), each on its own node.
    pub fn copies(self) -> usize {
        match self {
            Resiliency::Simple => 1,
            Resiliency::Mirror2 => 2,
            Resiliency::Mirror3 => 3,
            Resiliency::Parity { data, parity } => usize::from(data) + usize::from(parity),
        }
    }

    /// Extents needed to read a slab: one copy of a mirror, the data chunks' count of a
    /// parity slab.
    pub fn needed(self) -> usize {
        match self {
            Resiliency::Parity { data, .. } => usize::from(data),
            _ => 1,
        }
    }

    /// Volume bytes one slab holds, given the pool's extent size: a parity slab's data
    /// chunks each hold one extent's worth.
    pub fn slab_span(self, extent_bytes: u64) -> u64 {
        extent_bytes * self.needed() as u64
    }

    /// Default `min_replicas`: copies that must be in sync for writes to be acked (a
    /// parity slab's chunks: one short of all, so a write is acked with one chunk down,
    /// as a mirror-3 write is with one copy down).
    pub fn default_min_replicas(self) -> usize {
        match self {
            Resiliency::Simple => 1,
            Resiliency::Mirror2 => 1,
            Resiliency::Mirror3 => 2,
            Resiliency::Parity { data, parity } => usize::from(data) + usize::from(parity) - 1,
        }
    }

    /// Raw bytes per usable byte: 3 for mirror-3, (K+M)/K for parity.
    pub fn capacity_multiplier(self) -> f64 {
        self.copies() as f64 / self.needed() as f64
    }

    /// Raw bytes that `volume_bytes` of volume data take: every copy, or K+M chunks for K
    /// chunks of data (exact in integers).
    pub fn raw_bytes(self, volume_bytes: u64) -> u64 {
        (u128::from(volume_bytes) * self.copies() as u128 / self.needed() as u128) as u64
    }

    pub fn is_parity(self) -> bool {
        matches!(self, Resiliency::Parity { .. })
    }

    /// Volume bytes the allocated slabs `idxs` of a volume with this resiliency hold,
    /// each slab counted once: a parity slab its K extents, a mirror (or mirror-part)
    /// slab one.
    pub fn allocated_bytes(
        self,
        extent_bytes: u64,
        idxs: impl IntoIterator<Item = SlabIndex>,
    ) -> u64 {
        idxs.into_iter()
            .map(|i| self.of_slab(i).slab_span(extent_bytes))
            .sum()
    }

    /// The mirror a parity-K+M volume's mirror part uses (mirror-accelerated parity,
    /// docs/adr/0009): M+1 copies, so it survives the M failures its parity part does.
    /// Only M = 1 (mirror-2) and M = 2 (mirror-3) have one.
    pub fn mirror_part(self) -> Option<Resiliency> {
        match self {
            Resiliency::Parity { parity: 1, .. } => Some(Resiliency::Mirror2),
            Resiliency::Parity { parity: 2, .. } => Some(Resiliency::Mirror3),
            _ => None,
        }
    }

    /// How slab `idx` of a volume with this resiliency is laid out: a mirror-part slab is
    /// the [`Resiliency::mirror_part`] mirror, any other slab the volume's resiliency.
    pub fn of_slab(self, idx: SlabIndex) -> Resiliency {
        match (idx.is_mirror_part(), self.mirror_part()) {
            (true, Some(m)) => m,
            _ => self,
        }
    }

    /// `min_replicas` for slab `idx`: a mirror-part slab keeps as many copies short of
    /// all as the volume's parity slabs keep chunks short of all (one, by default).
    pub fn min_replicas_of_slab(self, idx: SlabIndex, min_replicas: usize) -> usize {
        let slab = self.of_slab(idx);
        if slab == self {
            return min_replicas;
        }
        let short = self.copies().saturating_sub(min_replicas);
        slab.copies().saturating_sub(short).max(1)
    }
}

impl fmt::Display for Resiliency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Resiliency::Simple => f.write_str("simple"),
            Resiliency::Mirror2 => f.write_str("mirror-2"),
            Resiliency::Mirror3 => f.write_str("mirror-3"),
            Resiliency::Parity { data, parity } => write!(f, "parity-{data}+{parity}"),
        }
    }
}

impl FromStr for Resiliency {
    type Err = ParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "simple" => Ok(Resiliency::Simple),
            "mirror-2" => Ok(Resiliency::Mirror2),
            "mirror-3" => Ok(Resiliency::Mirror3),
            other => {
                if let Some((k, m)) = other
                    .strip_prefix("parity-")
                    .and_then(|km| km.split_once('+'))
                {
                    if let (Ok(k), Ok(m)) = (k.parse::<u8>(), m.parse::<u8>()) {
                        return Resiliency::parity(k, m);
                    }
                }
                Err(ParseError(format!(
                    "unknown resiliency {other:?}: expected simple, mirror-2, mirror-3 or \
                     parity-K+M (K data and M parity chunks, e.g. parity-2+1, parity-4+2)"
                )))
            }
        }
    }
}

impl Serialize for Resiliency {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Resiliency {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Role of a drive in its node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DriveRole {
    #[default]
    Capacity,
    Cache,
}

/// Media type of a drive; drives the cache-mode default and the endurance default.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum MediaType {
    #[default]
    Ssd,
    Nvme,
    Hdd,
    Ram,
}

/// What a node's cache drives do for the capacity drives bound to them (DESIGN.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CacheMode {
    /// Writes go to the capacity drives; the cache only drains what it still holds.
    None,
    /// Writes land on the cache drive, are acked once durable there, and are destaged to
    /// the capacity drives in the background (the default when capacity is flash).
    Write,
    /// `write`, plus hot reads are kept on the cache drive (the default for HDD capacity).
    ReadWrite,
}

impl CacheMode {
    /// S2D's defaults: a write-only cache in front of flash, read+write in front of disks.
    pub fn default_for(capacity_media: MediaType) -> CacheMode {
        match capacity_media {
            MediaType::Hdd => CacheMode::ReadWrite,
            _ => CacheMode::Write,
        }
    }
}

impl fmt::Display for CacheMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CacheMode::None => "none",
            CacheMode::Write => "write",
            CacheMode::ReadWrite => "read-write",
        })
    }
}

impl FromStr for CacheMode {
    type Err = ParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" => Ok(CacheMode::None),
            "write" => Ok(CacheMode::Write),
            "read-write" => Ok(CacheMode::ReadWrite),
            other => Err(ParseError(format!(
                "unknown cache mode {other:?}: expected none, write or read-write"
            ))),
        }
    }
}

/// Per-volume QoS (docs/QOS.md): limits the owner enforces before each client I/O, with a
/// burst, and a reservation its node keeps under contention by holding back the volumes
/// without one. Every request (read, write, TRIM, zero) counts as one I/O whatever its size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Qos {
    /// Most I/Os per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iops_limit: Option<u64>,
    /// Most bytes per second (reads and writes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_limit: Option<u64>,
    /// How far I/O may run ahead of the limits after a quiet spell, in milliseconds of
    /// them (default 1000: a second's worth at once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst_ms: Option<u32>,
    /// I/Os per second the volume keeps when its node's volumes contend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iops_reserve: Option<u64>,
}

/// Longest QoS burst.
pub const QOS_BURST_MAX_MS: u32 = 60_000;

impl Qos {
    pub fn burst_seconds(&self) -> f64 {
        f64::from(self.burst_ms.unwrap_or(1000)) / 1000.0
    }

    /// No limit and no reservation.
    pub fn is_none(&self) -> bool {
        self.iops_limit.is_none() && self.bytes_limit.is_none() && self.iops_reserve.is_none()
    }

    pub fn is_none_ref(q: &Qos) -> bool {
        q.is_none()
    }

    /// Why these settings make no sense, if they do not.
    pub fn check(&self) -> Result<(), String> {
        for (name, v) in [
            ("iops_limit", self.iops_limit),
            ("bytes_limit", self.bytes_limit),
            ("iops_reserve", self.iops_reserve),
        ] {
            if v == Some(0) {
                return Err(format!(
                    "{name} 0 would stop the volume: leave it out for none"
                ));
            }
        }
        if let (Some(r), Some(l)) = (self.iops_reserve, self.iops_limit) {
            if r > l {
                return Err(format!(
                    "iops_reserve {r} is above iops_limit {l}: a volume cannot be kept above its own limit"
                ));
            }
        }
        if self.bytes_limit.is_some_and(|b| b < BLOCK_SIZE as u64) {
            return Err(format!(
                "bytes_limit below {BLOCK_SIZE} bytes per second would hold every request for seconds"
            ));
        }
        if self.burst_ms.is_some_and(|b| b > QOS_BURST_MAX_MS) {
            return Err(format!("burst_ms is at most {QOS_BURST_MAX_MS} (a minute)"));
        }
        Ok(())
    }
}

impl std::fmt::Display for Qos {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_none() {
            return f.write_str("none");
        }
        let mut parts = Vec::new();
        if let Some(i) = self.iops_limit {
            parts.push(format!("limit {i} IOPS"));
        }
        if let Some(b) = self.bytes_limit {
            parts.push(format!("limit {}/s", format_size(b)));
        }
        if self.iops_limit.is_some() || self.bytes_limit.is_some() {
            parts.push(format!("burst {} s", self.burst_seconds()));
        }
        if let Some(r) = self.iops_reserve {
            parts.push(format!("reserve {r} IOPS"));
        }
        f.write_str(&parts.join(", "))
    }
}

/// How a volume's data is compressed on its drives (docs/adr/0010): per group of
/// [`COMPRESSION_GROUP_BLOCKS`] blocks, by each copy's engine; a group that does not shrink
/// by a whole block is stored as is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    /// Blocks are stored as written.
    #[default]
    None,
    /// LZ4 (block format): fast, for write-heavy volumes.
    Lz4,
    /// Zstandard at level 1: about a third more saving than lz4 for twice its CPU
    /// (docs/studies/savings.md).
    Zstd,
}

/// Blocks compressed together as one stream (16 KiB): docs/studies/savings.md measured
/// that single 4 KiB blocks save nothing once stored in whole blocks, and 16 KiB groups a
/// third or more.
pub const COMPRESSION_GROUP_BLOCKS: u32 = 4;

impl Compression {
    /// The code stored in the engine's block metadata and on the wire (0: none).
    pub fn code(self) -> u8 {
        match self {
            Compression::None => 0,
            Compression::Lz4 => 1,
            Compression::Zstd => 2,
        }
    }

    /// The compression a code names, if any.
    pub fn from_code(c: u8) -> Option<Compression> {
        match c {
            0 => Some(Compression::None),
            1 => Some(Compression::Lz4),
            2 => Some(Compression::Zstd),
            _ => None,
        }
    }

    pub fn is_none(self) -> bool {
        self == Compression::None
    }

    /// [`Compression::is_none`] by reference (serde's `skip_serializing_if`).
    pub fn is_none_ref(c: &Compression) -> bool {
        c.is_none()
    }
}

impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Compression::None => "none",
            Compression::Lz4 => "lz4",
            Compression::Zstd => "zstd",
        })
    }
}

impl FromStr for Compression {
    type Err = ParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" | "off" => Ok(Compression::None),
            "lz4" => Ok(Compression::Lz4),
            "zstd" => Ok(Compression::Zstd),
            other => Err(ParseError(format!(
                "unknown compression {other:?}: expected none, lz4 or zstd"
            ))),
        }
    }
}

/// State of an extent (DESIGN.md vocabulary).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ExtentState {
    InSync,
    Stale,
    Syncing,
}

impl fmt::Display for ExtentState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ExtentState::InSync => "in-sync",
            ExtentState::Stale => "stale",
            ExtentState::Syncing => "syncing",
        })
    }
}

/// Parse a human size: `512`, `4K`, `64KiB`, `2G`, `1.5T` (binary units).
pub fn parse_size(s: &str) -> Result<u64, ParseError> {
    let t = s.trim();
    let err = || {
        ParseError(format!(
            "size {s:?} is not a size: use bytes or a number with K, M, G or T (binary units), e.g. 10G"
        ))
    };
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(err());
    }
    let mult: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "K" | "KB" | "KIB" => 1 << 10,
        "M" | "MB" | "MIB" => 1 << 20,
        "G" | "GB" | "GIB" => 1 << 30,
        "T" | "TB" | "TIB" => 1 << 40,
        _ => return Err(err()),
    };
    if num.contains('.') {
        let v: f64 = num.parse().map_err(|_| err())?;
        let bytes = v * mult as f64;
        if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
            return Err(err());
        }
        Ok(bytes as u64)
    } else {
        let v: u64 = num.parse().map_err(|_| err())?;
        v.checked_mul(mult).ok_or_else(err)
    }
}

/// Format bytes for humans, binary units.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else if v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[u])
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Tunables with documented defaults. Simulation randomises them; config may override.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default)]
pub struct Knobs {
    /// TTL of a node's liveness lease in etcd.
    pub node_lease_ttl_s: u64,
    /// TTL of a volume owner's lease in etcd.
    pub owner_lease_ttl_s: u64,
    /// How long the owner waits for a replica's answer before treating it as failed.
    pub replica_timeout_ms: u64,
    /// Bound on requests in flight on one peer connection.
    pub rpc_inflight_max: usize,
    /// Largest RPC frame payload accepted, bytes.
    pub rpc_frame_bytes_max: usize,
    /// Bound on NBD requests in flight per client connection.
    pub nbd_inflight_max: usize,
    /// Most writes one group commit makes durable with a single flush.
    pub group_commit_max: usize,
    /// How long a write waits for enough in-sync copies (`min_replicas`) to come back
    /// before it fails; nothing is acked below `min_replicas`.
    pub degraded_write_wait_ms: u64,
    /// How long a read keeps trying the in-sync copies (each round with the slab's state
    /// read afresh) before it fails: reads ride through the faults writes wait out.
    pub read_wait_ms: u64,
    /// A copy that has not answered a read within this long is joined by the next copy
    /// (hedged read); the first answer wins.
    pub read_hedge_ms: u64,
    /// Resync / rebuild copy rate per job, bytes per second (throttle).
    pub resync_bytes_per_s: u64,
    /// How long a stale extent's node or drive may stay away before its extents are
    /// rebuilt elsewhere (vSAN waits 60 minutes, Mayastor 10).
    pub repair_delay_s: u64,
    /// Scrub read rate per node, bytes per second (throttle).
    pub scrub_bytes_per_s: u64,
    /// Scrub every volume this often (hours; 0 turns the schedule off). The leader starts
    /// the scrub of a volume whose last one is older.
    pub scrub_interval_h: u64,
    /// Destage rate per cache drive while its log is between the watermarks, bytes per
    /// second; above the high watermark destage runs unthrottled.
    pub cache_destage_bytes_per_s: u64,
    /// Destage starts once dirty data fills this % of a cache drive's log.
    pub cache_low_watermark_pct: u8,
    /// Above this % of the log in use, destage (and read-cache eviction) runs flat out.
    pub cache_high_watermark_pct: u8,
    /// Data locality: a volume's owner places one copy of each new slab on its own node
    /// (its reads then cross no network) while its node's used capacity is at most this
    /// many percentage points above the least-used node's; beyond that, and with 0,
    /// placement goes by balance alone.
    pub placement_locality_pct: u64,
    /// How often a node counts its drives' lifetime writes into their wear records in etcd
    /// (seconds; also at a clean shutdown). A node killed loses at most this much of the
    /// count.
    pub wear_record_s: u64,
    /// How often the leader tends etcd (seconds): compacts history older than
    /// `etcd_history_s`, defragments a member whose file is mostly free pages, and recovers
    /// from a NOSPACE alarm (docs/OPERATIONS.md). One status request per member per round.
    pub etcd_upkeep_s: u64,
    /// How much etcd history the leader keeps (seconds): revisions older than this are
    /// compacted away.
    pub etcd_history_s: u64,
}

/// What an API token may do. Each role may do what the ones before it may.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    /// Look: status, volumes, drives, settings, metrics, scrub and fleet results.
    ReadOnly,
    /// Run the cluster: create, resize, move and scrub volumes, maintenance, cache modes
    /// and flushes, fleet runs.
    Operator,
    /// Everything: delete volumes, change settings, manage tokens, the lab's fault views.
    Admin,
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::ReadOnly => "read-only",
            Role::Operator => "operator",
            Role::Admin => "admin",
        })
    }
}

impl FromStr for Role {
    type Err = ParseError;
    fn from_str(s: &str) -> Result<Role, ParseError> {
        match s {
            "read-only" | "readonly" => Ok(Role::ReadOnly),
            "operator" => Ok(Role::Operator),
            "admin" => Ok(Role::Admin),
            _ => Err(ParseError(format!(
                "unknown role {s:?}: read-only, operator or admin"
            ))),
        }
    }
}

/// The longest `repair_delay_s` accepted (30 days): a longer one would all but turn rebuilds
/// off, and `u64::MAX` once did.
pub const REPAIR_DELAY_S_MAX: u64 = 30 * 24 * 3600;

impl Knobs {
    /// Refuses values outside what the cluster can run with (a zero rate would stall every
    /// rebuild, a lease of hours would keep a dead owner's volumes unserved, a frame bound
    /// below the largest request would refuse every 32 MiB write): the knob's name, its
    /// value and the accepted range.
    pub fn check(&self) -> Result<(), String> {
        fn within(name: &str, v: u64, lo: u64, hi: u64) -> Result<(), String> {
            if (lo..=hi).contains(&v) {
                Ok(())
            } else {
                Err(format!("knobs.{name} = {v} is outside {lo}..={hi}"))
            }
        }
        const MIB: u64 = 1 << 20;
        within("node_lease_ttl_s", self.node_lease_ttl_s, 1, 300)?;
        within("owner_lease_ttl_s", self.owner_lease_ttl_s, 1, 300)?;
        within("replica_timeout_ms", self.replica_timeout_ms, 100, 600_000)?;
        within("rpc_inflight_max", self.rpc_inflight_max as u64, 1, 65_536)?;
        within(
            "rpc_frame_bytes_max",
            self.rpc_frame_bytes_max as u64,
            (MAX_IO_BYTES + (64 << 10)) as u64,
            256 * MIB,
        )?;
        within("nbd_inflight_max", self.nbd_inflight_max as u64, 1, 4096)?;
        within("group_commit_max", self.group_commit_max as u64, 1, 65_536)?;
        within(
            "degraded_write_wait_ms",
            self.degraded_write_wait_ms,
            0,
            3_600_000,
        )?;
        within("read_wait_ms", self.read_wait_ms, 0, 3_600_000)?;
        within("read_hedge_ms", self.read_hedge_ms, 1, 600_000)?;
        within("resync_bytes_per_s", self.resync_bytes_per_s, MIB, 1 << 40)?;
        within("repair_delay_s", self.repair_delay_s, 0, REPAIR_DELAY_S_MAX)?;
        within("scrub_bytes_per_s", self.scrub_bytes_per_s, MIB, 1 << 40)?;
        within("scrub_interval_h", self.scrub_interval_h, 0, 24 * 366)?;
        within(
            "cache_destage_bytes_per_s",
            self.cache_destage_bytes_per_s,
            MIB,
            1 << 40,
        )?;
        within(
            "cache_high_watermark_pct",
            u64::from(self.cache_high_watermark_pct),
            2,
            100,
        )?;
        within(
            "cache_low_watermark_pct",
            u64::from(self.cache_low_watermark_pct),
            1,
            u64::from(self.cache_high_watermark_pct) - 1,
        )?;
        within(
            "placement_locality_pct",
            self.placement_locality_pct,
            0,
            100,
        )?;
        within("wear_record_s", self.wear_record_s, 1, 3600)?;
        within("etcd_upkeep_s", self.etcd_upkeep_s, 1, 3600)?;
        within("etcd_history_s", self.etcd_history_s, 1, 7 * 86_400)?;
        Ok(())
    }
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs {
            node_lease_ttl_s: 10,
            owner_lease_ttl_s: 10,
            replica_timeout_ms: 10_000,
            rpc_inflight_max: 256,
            rpc_frame_bytes_max: MAX_IO_BYTES + (64 << 10),
            nbd_inflight_max: 128,
            group_commit_max: 256,
            degraded_write_wait_ms: 30_000,
            read_wait_ms: 30_000,
            read_hedge_ms: 100,
            resync_bytes_per_s: 256 << 20,
            repair_delay_s: 600,
            scrub_bytes_per_s: 64 << 20,
            scrub_interval_h: 168,
            cache_destage_bytes_per_s: 256 << 20,
            cache_low_watermark_pct: 25,
            cache_high_watermark_pct: 80,
            placement_locality_pct: 25,
            wear_record_s: 60,
            etcd_upkeep_s: 60,
            etcd_history_s: 600,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_are_plain_words() {
        for ok in [
            "node1",
            "n",
            "rack-2.host_7",
            &"a".repeat(NODE_NAME_BYTES_MAX),
        ] {
            assert!(valid_node_name(ok), "{ok}");
        }
        for bad in [
            "",
            "-n",
            ".n",
            "a b",
            "x;reboot",
            "$(id)",
            "`id`",
            "n'",
            "n\"",
            "n/1",
            "née",
            &"a".repeat(NODE_NAME_BYTES_MAX + 1),
        ] {
            assert!(!valid_node_name(bad), "{bad}");
        }
    }

    #[test]
    fn default_knobs_are_within_bounds_and_absurd_ones_are_refused() {
        Knobs::default().check().expect("defaults are valid");
        let bad = |f: fn(&mut Knobs)| {
            let mut k = Knobs::default();
            f(&mut k);
            k.check().expect_err("refused")
        };
        assert!(bad(|k| k.repair_delay_s = u64::MAX).contains("repair_delay_s"));
        assert!(bad(|k| k.resync_bytes_per_s = 0).contains("resync_bytes_per_s"));
        assert!(bad(|k| k.rpc_frame_bytes_max = 1 << 20).contains("rpc_frame_bytes_max"));
        assert!(bad(|k| k.cache_low_watermark_pct = 90).contains("cache_low_watermark_pct"));
        assert!(bad(|k| k.node_lease_ttl_s = 0).contains("node_lease_ttl_s"));
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("2G").unwrap(), 2 << 30);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
        assert!(parse_size("").is_err());
        assert!(parse_size("G").is_err());
        assert!(parse_size("12X").is_err());
        assert!(parse_size("-1G").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn mirror_part_slabs_are_mirrors_of_one_more_copy_than_parity_chunks() {
        let idx = SlabIndex::mirror_part(5);
        assert!(idx.is_mirror_part() && !SlabIndex(5).is_mirror_part());
        assert_eq!((idx.position(), idx.to_string()), (5, "m5".to_string()));
        assert!(
            idx > SlabIndex(u64::MAX >> 2),
            "mirror-part keys sort after spans"
        );
        let p21 = Resiliency::parity(2, 1).unwrap();
        let p42 = Resiliency::parity(4, 2).unwrap();
        assert_eq!(p21.mirror_part(), Some(Resiliency::Mirror2));
        assert_eq!(p42.mirror_part(), Some(Resiliency::Mirror3));
        assert_eq!(Resiliency::parity(4, 3).unwrap().mirror_part(), None);
        assert_eq!(Resiliency::Mirror3.mirror_part(), None);
        assert_eq!(p42.of_slab(idx), Resiliency::Mirror3);
        assert_eq!(p42.of_slab(SlabIndex(5)), p42);
        // One short of all, as the parity slabs' default; all of them when parity needs all.
        assert_eq!(p42.min_replicas_of_slab(idx, 5), 2);
        assert_eq!(p42.min_replicas_of_slab(idx, 6), 3);
        assert_eq!(p42.min_replicas_of_slab(idx, 4), 1);
        assert_eq!(p42.min_replicas_of_slab(SlabIndex(5), 5), 5);
        assert_eq!(p21.min_replicas_of_slab(idx, 2), 1);
    }

    #[test]
    fn resiliency_round_trip() {
        for r in [
            Resiliency::Simple,
            Resiliency::Mirror2,
            Resiliency::Mirror3,
            Resiliency::parity(2, 1).unwrap(),
            Resiliency::parity(4, 2).unwrap(),
            Resiliency::parity(16, 4).unwrap(),
        ] {
            assert_eq!(r.to_string().parse::<Resiliency>().unwrap(), r);
            let json = serde_json::to_string(&r).unwrap();
            assert_eq!(json, format!("\"{r}\""));
            assert_eq!(serde_json::from_str::<Resiliency>(&json).unwrap(), r);
        }
        let p = Resiliency::parity(4, 2).unwrap();
        assert_eq!(
            (p.copies(), p.needed(), p.default_min_replicas()),
            (6, 4, 5)
        );
        assert_eq!(p.capacity_multiplier(), 1.5);
        assert_eq!(p.slab_span(64 << 20), 256 << 20);
        assert_eq!(Resiliency::Mirror3.capacity_multiplier(), 3.0);
        assert_eq!(p.raw_bytes(256 << 20), 384 << 20);
        assert_eq!(Resiliency::Mirror2.raw_bytes(1 << 30), 2 << 30);
        let e = "raid5".parse::<Resiliency>().unwrap_err();
        assert!(e.0.contains("raid5"));
        for bad in [
            "parity-1+1",
            "parity-4+0",
            "parity-17+1",
            "parity-16+5",
            "parity-4+",
            "parity-x+2",
        ] {
            let e = bad.parse::<Resiliency>().unwrap_err();
            assert!(e.0.contains("parity"), "{bad}: {e}");
        }
        assert!(serde_json::from_str::<Resiliency>("\"parity-1+1\"").is_err());
    }

    #[test]
    fn cluster_id_round_trip() {
        let c = ClusterId(0x1234_5678_9abc_def0_1122_3344_5566_7788);
        assert_eq!(c.to_string().parse::<ClusterId>().unwrap(), c);
    }

    #[test]
    fn format_sizes() {
        assert_eq!(format_size(512), "512 B");
        assert_eq!(format_size(2 << 30), "2 GiB");
        assert_eq!(format_size(3 << 29), "1.5 GiB");
    }
}
