//! Erasure coding for parity volumes (parity-K+M): where a volume byte lives inside a parity
//! slab, and the Reed–Solomon codec that computes, rebuilds and checks the M parity chunks.
//!
//! A parity slab is K data chunks and M parity chunks, each one `slab_size`-byte extent on a
//! different node. Row r of the slab is data block r of every data chunk (volume bytes
//! [r·K·4096, (r+1)·K·4096) of the slab, block j in chunk j) plus parity block r of every
//! parity chunk (chunk K+i). The code is systematic Reed–Solomon from `reed-solomon-simd`,
//! which works position by position: the parity of rows r0..r0+n is computed in one call by
//! handing it, as shard j, the n·4096 contiguous bytes of chunk j that hold those rows (the
//! test `multi_row_shards_encode_like_single_rows` holds the library to this).

use converge_types::BLOCK_SIZE;
use reed_solomon_simd::{EncoderResult, ReedSolomonDecoder, ReedSolomonEncoder};

const BS: u64 = BLOCK_SIZE as u64;

/// The shapes parity volumes accept (one definition, with [`converge_types::Resiliency`]).
pub use converge_types::{
    PARITY_ALL_MAX as CHUNKS_MAX, PARITY_CHUNKS_MAX, PARITY_CHUNKS_MIN,
    PARITY_DATA_MAX as DATA_CHUNKS_MAX, PARITY_DATA_MIN as DATA_CHUNKS_MIN,
};

/// Why a parity layout was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GeometryError {
    #[error(
        "parity-{k}+{m} is not supported: use {DATA_CHUNKS_MIN}..={DATA_CHUNKS_MAX} data chunks, \
         {PARITY_CHUNKS_MIN}..={PARITY_CHUNKS_MAX} parity chunks and at most {CHUNKS_MAX} in all"
    )]
    Shape { k: u8, m: u8 },
    #[error(
        "slab size {slab_size} bytes is not a non-zero multiple of the {BLOCK_SIZE}-byte block"
    )]
    SlabSize { slab_size: u64 },
}

fn check_shape(k: u8, m: u8) -> Result<(), GeometryError> {
    let ok = (DATA_CHUNKS_MIN..=DATA_CHUNKS_MAX).contains(&k)
        && (PARITY_CHUNKS_MIN..=PARITY_CHUNKS_MAX).contains(&m)
        && u16::from(k) + u16::from(m) <= u16::from(CHUNKS_MAX);
    if ok {
        Ok(())
    } else {
        Err(GeometryError::Shape { k, m })
    }
}

/// The validated shape of a parity-K+M slab; fields are private so every value is valid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    k: u8,
    m: u8,
    slab_size: u64,
}

/// Where one volume byte of a parity slab is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkPos {
    /// Row of the slab (= block index inside every chunk).
    pub row: u64,
    /// Data chunk holding the byte, 0..K.
    pub chunk: u8,
    /// Byte offset inside that chunk's extent.
    pub byte_in_chunk: u64,
}

/// The rows a byte range of a slab touches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowSpan {
    /// First row touched.
    pub first_row: u64,
    /// Number of rows touched (0 only for an empty range).
    pub row_count: u64,
    /// The first row is not wholly covered (its parity needs the bytes the range lacks).
    pub first_partial: bool,
    /// The last row is not wholly covered; equals `first_partial` when `row_count == 1`.
    pub last_partial: bool,
}

impl Geometry {
    /// Validates K (2..=16), M (1..=4), K+M ≤ 20 and that `slab_size` is whole blocks.
    pub fn new(k: u8, m: u8, slab_size: u64) -> Result<Geometry, GeometryError> {
        check_shape(k, m)?;
        if slab_size == 0 || !slab_size.is_multiple_of(BS) {
            return Err(GeometryError::SlabSize { slab_size });
        }
        Ok(Geometry { k, m, slab_size })
    }

    /// Data chunks per slab (K).
    pub fn k(&self) -> u8 {
        self.k
    }

    /// Parity chunks per slab (M).
    pub fn m(&self) -> u8 {
        self.m
    }

    /// Bytes of one chunk's extent.
    pub fn slab_size(&self) -> u64 {
        self.slab_size
    }

    /// Volume bytes one parity slab covers: K × slab_size.
    pub fn data_bytes_per_slab(&self) -> u64 {
        u64::from(self.k) * self.slab_size
    }

    /// Volume bytes in one row: K blocks.
    pub fn row_bytes(&self) -> u64 {
        u64::from(self.k) * BS
    }

    /// Rows per slab: blocks per chunk.
    pub fn rows(&self) -> u64 {
        self.slab_size / BS
    }

    /// Where byte `offset` of the slab's volume range lives.
    ///
    /// # Panics
    /// If `offset` is not below `data_bytes_per_slab()` (a caller bug).
    pub fn locate(&self, offset: u64) -> ChunkPos {
        assert!(
            offset < self.data_bytes_per_slab(),
            "offset {offset} outside a parity slab of {} data bytes",
            self.data_bytes_per_slab()
        );
        let row = offset / self.row_bytes();
        let chunk = u8::try_from((offset / BS) % u64::from(self.k))
            .expect("the remainder modulo K is below K, which is a u8");
        ChunkPos {
            row,
            chunk,
            byte_in_chunk: row * BS + offset % BS,
        }
    }

    /// The rows that bytes `offset..offset+len` of the slab touch, and whether the first and
    /// last of them are only partly covered (any alignment; `len == 0` touches no row).
    ///
    /// # Panics
    /// If the range runs past `data_bytes_per_slab()` (a caller bug).
    pub fn row_span(&self, offset: u64, len: u64) -> RowSpan {
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= self.data_bytes_per_slab());
        let end = end.unwrap_or_else(|| {
            panic!(
                "range {offset}+{len} outside a parity slab of {} data bytes",
                self.data_bytes_per_slab()
            )
        });
        let rb = self.row_bytes();
        if len == 0 {
            return RowSpan {
                first_row: offset / rb,
                row_count: 0,
                first_partial: false,
                last_partial: false,
            };
        }
        let first_row = offset / rb;
        let end_row = end.div_ceil(rb); // one past the last row touched
        let row_count = end_row - first_row;
        // A row is whole when the range starts at or before its start and ends at or after
        // its end.
        let whole = |row: u64| offset <= row * rb && end >= (row + 1) * rb;
        RowSpan {
            first_row,
            row_count,
            first_partial: !whole(first_row),
            last_partial: !whole(end_row - 1),
        }
    }

    /// Usable fraction of raw capacity: K / (K+M).
    pub fn capacity_multiplier(&self) -> f64 {
        f64::from(self.k) / (f64::from(self.k) + f64::from(self.m))
    }
}

/// Why the codec refused or failed an operation.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum CodecError {
    #[error(transparent)]
    Geometry(#[from] GeometryError),
    #[error("expected {expected} {what} shards, got {got} (a caller bug)")]
    ShardCount {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    #[error(
        "shard {index} is {len} bytes, not a non-zero multiple of the {BLOCK_SIZE}-byte block"
    )]
    ShardSize { index: usize, len: usize },
    #[error(
        "shard {index} is {len} bytes but the first shard is {expected}; \
         all shards of one stripe must cover the same rows"
    )]
    UnequalShards {
        index: usize,
        len: usize,
        expected: usize,
    },
    #[error(
        "only {have} shards present, {needed} needed to reconstruct: \
         the rows are lost unless more chunks can be read"
    )]
    NotEnoughShards { have: usize, needed: usize },
    #[error("Reed-Solomon library refused the shards: {0}")]
    Library(#[from] reed_solomon_simd::Error),
}

/// One of the K+M shards (chunk slices covering the same rows) given to
/// [`Codec::reconstruct`], indexed like chunks: data 0..K, then parity K..K+M.
#[derive(Debug)]
pub enum Shard<'a> {
    /// Read from its chunk and trusted as input.
    Have(&'a [u8]),
    /// Lost and wanted: `reconstruct` fills this buffer.
    Want(&'a mut [u8]),
    /// Lost or not read, and not wanted.
    Absent,
}

impl Shard<'_> {
    fn len(&self) -> Option<usize> {
        match self {
            Shard::Have(b) => Some(b.len()),
            Shard::Want(b) => Some(b.len()),
            Shard::Absent => None,
        }
    }

    fn is_have(&self) -> bool {
        matches!(self, Shard::Have(_))
    }

    fn is_want(&self) -> bool {
        matches!(self, Shard::Want(_))
    }
}

/// Reed–Solomon over K data and M parity shards. Keeps the library's encoder and decoder,
/// whose work buffers are reused from call to call (they grow to the largest shard length
/// seen: about (K+M rounded up to a power of two) × length bytes each).
pub struct Codec {
    k: usize,
    m: usize,
    encoder: ReedSolomonEncoder,
    decoder: ReedSolomonDecoder,
}

impl std::fmt::Debug for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Codec(parity-{}+{})", self.k, self.m)
    }
}

impl Codec {
    /// A codec for parity-K+M (same limits as [`Geometry::new`]).
    pub fn new(k: u8, m: u8) -> Result<Codec, CodecError> {
        check_shape(k, m)?;
        let (k, m) = (usize::from(k), usize::from(m));
        Ok(Codec {
            k,
            m,
            encoder: ReedSolomonEncoder::new(k, m, BLOCK_SIZE)?,
            decoder: ReedSolomonDecoder::new(k, m, BLOCK_SIZE)?,
        })
    }

    /// Data shards (K).
    pub fn k(&self) -> usize {
        self.k
    }

    /// Parity shards (M).
    pub fn m(&self) -> usize {
        self.m
    }

    /// Writes the M parity shards of K data shards; all K+M are the same length, a multiple
    /// of 4096 (n rows × 4096).
    pub fn encode(&mut self, data: &[&[u8]], parity: &mut [&mut [u8]]) -> Result<(), CodecError> {
        check_count("data", self.k, data.len())?;
        check_count("parity", self.m, parity.len())?;
        let lens = data
            .iter()
            .map(|d| d.len())
            .chain(parity.iter().map(|p| p.len()));
        let len = shard_len(lens.enumerate())?;
        let encoded = run_encoder(&mut self.encoder, self.k, self.m, len, data.iter().copied())?;
        for (dst, src) in parity.iter_mut().zip(encoded.recovery_iter()) {
            dst.copy_from_slice(src);
        }
        Ok(())
    }

    /// Fills every [`Shard::Want`] from the [`Shard::Have`] shards (at least K of them).
    /// Missing data comes from the decoder; missing parity from re-encoding the completed
    /// data. Used for degraded reads, rebuilding a lost chunk and repairing bad parity.
    pub fn reconstruct(&mut self, shards: &mut [Shard<'_>]) -> Result<(), CodecError> {
        let (k, m) = (self.k, self.m);
        check_count("data+parity", k + m, shards.len())?;
        let have = shards.iter().filter(|s| s.is_have()).count();
        if have < k {
            return Err(CodecError::NotEnoughShards { have, needed: k });
        }
        let lens = shards.iter().enumerate();
        let len = shard_len(lens.filter_map(|(i, s)| Some((i, s.len()?))))?;

        let Codec {
            encoder, decoder, ..
        } = self;
        let (data, parity) = shards.split_at_mut(k);
        let parity_wanted = parity.iter().any(Shard::is_want);

        if data.iter().all(Shard::is_have) {
            if parity_wanted {
                let data = data.iter().map(|s| match s {
                    Shard::Have(b) => *b,
                    _ => unreachable!("all data shards were checked to be present"),
                });
                let encoded = run_encoder(encoder, k, m, len, data)?;
                fill_wanted(parity, &encoded);
            }
            return Ok(());
        }

        decoder.reset(k, m, len)?;
        for (j, s) in data.iter().enumerate() {
            if let Shard::Have(b) = s {
                decoder.add_original_shard(j, b)?;
            }
        }
        for (i, s) in parity.iter().enumerate() {
            if let Shard::Have(b) = s {
                decoder.add_recovery_shard(i, b)?;
            }
        }
        let restored = decoder.decode()?;
        let restored_data = |j: usize| {
            restored
                .restored_original(j)
                .expect("the decoder restores every data shard it was not given")
        };
        for (j, s) in data.iter_mut().enumerate() {
            if let Shard::Want(buf) = s {
                buf.copy_from_slice(restored_data(j));
            }
        }
        if parity_wanted {
            let data = data.iter().enumerate().map(|(j, s)| match s {
                Shard::Have(b) => *b,
                Shard::Want(b) => &**b,
                Shard::Absent => restored_data(j),
            });
            let encoded = run_encoder(encoder, k, m, len, data)?;
            fill_wanted(parity, &encoded);
        }
        Ok(())
    }

    /// Whether the M parity shards match the K data shards (all K+M given, data first): the
    /// scrub check. `false` means some shard is wrong, not which one.
    pub fn verify(&mut self, shards: &[&[u8]]) -> Result<bool, CodecError> {
        check_count("data+parity", self.k + self.m, shards.len())?;
        let len = shard_len(shards.iter().map(|s| s.len()).enumerate())?;
        let (data, parity) = shards.split_at(self.k);
        let encoded = run_encoder(&mut self.encoder, self.k, self.m, len, data.iter().copied())?;
        let matches = parity
            .iter()
            .zip(encoded.recovery_iter())
            .all(|(stored, computed)| *stored == computed);
        Ok(matches)
    }
}

fn check_count(what: &'static str, expected: usize, got: usize) -> Result<(), CodecError> {
    if got == expected {
        Ok(())
    } else {
        Err(CodecError::ShardCount {
            what,
            expected,
            got,
        })
    }
}

/// The common length of shards given as (index, length): non-zero whole blocks, all equal.
fn shard_len(lens: impl Iterator<Item = (usize, usize)>) -> Result<usize, CodecError> {
    let mut expected = None;
    for (index, len) in lens {
        if len == 0 || !len.is_multiple_of(BLOCK_SIZE) {
            return Err(CodecError::ShardSize { index, len });
        }
        match expected {
            None => expected = Some(len),
            Some(e) if e != len => {
                return Err(CodecError::UnequalShards {
                    index,
                    len,
                    expected: e,
                })
            }
            Some(_) => {}
        }
    }
    // Callers check the shard count (≥ K ≥ 2) first, so there is always a first shard.
    Ok(expected.expect("callers pass at least one shard"))
}

/// Resets the encoder for this length (cheap: its buffer is only resized) and encodes.
fn run_encoder<'e, 'd>(
    encoder: &'e mut ReedSolomonEncoder,
    k: usize,
    m: usize,
    len: usize,
    data: impl Iterator<Item = &'d [u8]>,
) -> Result<EncoderResult<'e>, CodecError> {
    encoder.reset(k, m, len)?;
    for d in data {
        encoder.add_original_shard(d)?;
    }
    Ok(encoder.encode()?)
}

fn fill_wanted(parity: &mut [Shard<'_>], encoded: &EncoderResult<'_>) {
    for (s, p) in parity.iter_mut().zip(encoded.recovery_iter()) {
        if let Shard::Want(buf) = s {
            buf.copy_from_slice(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, RngCore, SeedableRng};

    fn random_shards(count: usize, len: usize, seed: u64) -> Vec<Vec<u8>> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..count)
            .map(|_| {
                let mut v = vec![0u8; len];
                rng.fill_bytes(&mut v);
                v
            })
            .collect()
    }

    /// K random data shards followed by their M parity shards.
    fn stripe(codec: &mut Codec, len: usize, seed: u64) -> Vec<Vec<u8>> {
        let mut shards = random_shards(codec.k(), len, seed);
        let mut parity = vec![vec![0u8; len]; codec.m()];
        {
            let data: Vec<&[u8]> = shards.iter().map(|v| v.as_slice()).collect();
            let mut par: Vec<&mut [u8]> = parity.iter_mut().map(|v| v.as_mut_slice()).collect();
            codec.encode(&data, &mut par).expect("encode");
        }
        shards.extend(parity);
        shards
    }

    fn refs(shards: &[Vec<u8>]) -> Vec<&[u8]> {
        shards.iter().map(|v| v.as_slice()).collect()
    }

    /// Every subset of 0..n with 1..=max members, as bitmasks.
    fn erasure_patterns(n: usize, max: usize) -> Vec<u32> {
        (1u32..1 << n)
            .filter(|p| (p.count_ones() as usize) <= max)
            .collect()
    }

    #[test]
    fn parity_geometry_validates_shape_and_slab_size() {
        assert!(Geometry::new(2, 1, 4096).is_ok());
        assert!(Geometry::new(16, 4, 1 << 30).is_ok());
        for (k, m) in [(1, 1), (17, 1), (2, 0), (2, 5), (16, 5), (0, 0)] {
            assert_eq!(
                Geometry::new(k, m, 4096),
                Err(GeometryError::Shape { k, m }),
                "{k}+{m}"
            );
        }
        for slab_size in [0, 4095, 4097, 8192 + 512] {
            assert_eq!(
                Geometry::new(4, 2, slab_size),
                Err(GeometryError::SlabSize { slab_size })
            );
        }
        assert!(matches!(Codec::new(1, 1), Err(CodecError::Geometry(_))));
        assert!(matches!(Codec::new(4, 5), Err(CodecError::Geometry(_))));
    }

    #[test]
    fn parity_geometry_sizes() {
        let g = Geometry::new(4, 2, 1 << 20).expect("valid");
        assert_eq!(g.data_bytes_per_slab(), 4 << 20);
        assert_eq!(g.rows(), 256);
        assert_eq!(g.row_bytes(), 4 * 4096);
        assert!((g.capacity_multiplier() - 4.0 / 6.0).abs() < 1e-12);
        let g = Geometry::new(2, 1, 4096).expect("valid");
        assert!((g.capacity_multiplier() - 2.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn parity_locate_follows_the_row_layout() {
        let g = Geometry::new(3, 2, 8 * 4096).expect("valid");
        let pos = |row, chunk, byte_in_chunk| ChunkPos {
            row,
            chunk,
            byte_in_chunk,
        };
        assert_eq!(g.locate(0), pos(0, 0, 0));
        assert_eq!(g.locate(4095), pos(0, 0, 4095));
        assert_eq!(g.locate(4096), pos(0, 1, 0));
        assert_eq!(g.locate(2 * 4096 + 7), pos(0, 2, 7));
        assert_eq!(g.locate(3 * 4096), pos(1, 0, 4096));
        assert_eq!(
            g.locate(3 * 4096 * 5 + 4096 + 100),
            pos(5, 1, 5 * 4096 + 100)
        );
        let last = g.data_bytes_per_slab() - 1;
        assert_eq!(g.locate(last), pos(7, 2, 8 * 4096 - 1));
        // Every block of the slab maps to a distinct (chunk, block) and back.
        let mut seen = std::collections::HashSet::new();
        for block in 0..g.data_bytes_per_slab() / BS {
            let p = g.locate(block * BS);
            assert_eq!(p.byte_in_chunk % BS, 0);
            assert_eq!(p.byte_in_chunk / BS, p.row);
            assert_eq!(p.row * g.row_bytes() + u64::from(p.chunk) * BS, block * BS);
            assert!(seen.insert((p.chunk, p.row)));
        }
    }

    #[test]
    #[should_panic(expected = "outside a parity slab")]
    fn parity_locate_rejects_offsets_past_the_slab() {
        let g = Geometry::new(2, 1, 4096).expect("valid");
        g.locate(2 * 4096);
    }

    #[test]
    fn parity_row_span_marks_partial_rows() {
        let g = Geometry::new(2, 1, 16 * 4096).expect("valid");
        let rb = g.row_bytes(); // 8192
        let span = |first_row, row_count, first_partial, last_partial| RowSpan {
            first_row,
            row_count,
            first_partial,
            last_partial,
        };
        // Whole rows.
        assert_eq!(g.row_span(0, rb), span(0, 1, false, false));
        assert_eq!(g.row_span(rb, 3 * rb), span(1, 3, false, false));
        assert_eq!(
            g.row_span(0, g.data_bytes_per_slab()),
            span(0, 16, false, false)
        );
        // One block of a row, and one byte.
        assert_eq!(g.row_span(4096, 4096), span(0, 1, true, true));
        assert_eq!(g.row_span(rb + 5, 1), span(1, 1, true, true));
        // Unaligned head, whole tail; whole head, unaligned tail; both unaligned.
        assert_eq!(g.row_span(4096, rb + 4096), span(0, 2, true, false));
        assert_eq!(g.row_span(0, rb + 1), span(0, 2, false, true));
        assert_eq!(g.row_span(rb - 1, 2), span(0, 2, true, true));
        assert_eq!(g.row_span(100, 3 * rb), span(0, 4, true, true));
        // Ends exactly at the slab's end.
        assert_eq!(g.row_span(15 * rb + 1, rb - 1), span(15, 1, true, true));
        // Empty.
        assert_eq!(g.row_span(rb, 0).row_count, 0);
    }

    #[test]
    #[should_panic(expected = "outside a parity slab")]
    fn parity_row_span_rejects_ranges_past_the_slab() {
        let g = Geometry::new(2, 1, 4096).expect("valid");
        g.row_span(4096, 4097);
    }

    /// Every pattern of up to M lost shards is rebuilt byte for byte, both when every lost
    /// shard is wanted and when only one is (the others Absent).
    #[test]
    fn parity_reconstructs_every_erasure_pattern() {
        for (k, m) in [(2u8, 1u8), (3, 2), (4, 2)] {
            let mut codec = Codec::new(k, m).expect("valid");
            let n = usize::from(k + m);
            let len = 2 * BLOCK_SIZE;
            let original = stripe(&mut codec, len, u64::from(k) * 10 + u64::from(m));
            for pattern in erasure_patterns(n, usize::from(m)) {
                let lost: Vec<usize> = (0..n).filter(|i| pattern & (1 << i) != 0).collect();
                // All lost shards wanted.
                let mut out = vec![vec![0xAAu8; len]; n];
                let mut shards: Vec<Shard> = original
                    .iter()
                    .zip(out.iter_mut())
                    .enumerate()
                    .map(|(i, (orig, buf))| {
                        if lost.contains(&i) {
                            Shard::Want(buf.as_mut_slice())
                        } else {
                            Shard::Have(orig.as_slice())
                        }
                    })
                    .collect();
                codec.reconstruct(&mut shards).expect("reconstruct");
                for &i in &lost {
                    assert!(out[i] == original[i], "{k}+{m} lost {lost:?}: shard {i}");
                }
                // Only one lost shard wanted, the rest of the lost ones Absent.
                for &want in &lost {
                    let mut buf = vec![0x55u8; len];
                    let mut shards: Vec<Shard> = (0..n)
                        .map(|i| {
                            if !lost.contains(&i) {
                                Shard::Have(original[i].as_slice())
                            } else {
                                Shard::Absent
                            }
                        })
                        .collect();
                    shards[want] = Shard::Want(buf.as_mut_slice());
                    codec.reconstruct(&mut shards).expect("reconstruct");
                    assert!(buf == original[want], "{k}+{m} lost {lost:?}: want {want}");
                }
            }
        }
    }

    /// The design rests on this: encoding n rows at once (shard j = n·4096 contiguous bytes
    /// of chunk j) gives the same parity as encoding each row on its own.
    #[test]
    fn parity_multi_row_shards_encode_like_single_rows() {
        for (k, m) in [(2u8, 1u8), (3, 2), (4, 2), (16, 4)] {
            let mut codec = Codec::new(k, m).expect("valid");
            let rows = 32;
            let whole = stripe(&mut codec, rows * BLOCK_SIZE, 7 + u64::from(k));
            let (data, parity) = whole.split_at(codec.k());
            for row in 0..rows {
                let at = row * BLOCK_SIZE..(row + 1) * BLOCK_SIZE;
                let row_data: Vec<&[u8]> = data.iter().map(|d| &d[at.clone()]).collect();
                let mut row_parity = vec![vec![0u8; BLOCK_SIZE]; codec.m()];
                let mut outs: Vec<&mut [u8]> =
                    row_parity.iter_mut().map(|v| v.as_mut_slice()).collect();
                codec.encode(&row_data, &mut outs).expect("encode row");
                for i in 0..codec.m() {
                    assert!(
                        row_parity[i] == parity[i][at.clone()],
                        "{k}+{m}: row {row} parity {i} differs from the multi-row encode"
                    );
                }
            }
            // And a run of rows in the middle (rows 5..13) matches too.
            let at = 5 * BLOCK_SIZE..13 * BLOCK_SIZE;
            let run_data: Vec<&[u8]> = data.iter().map(|d| &d[at.clone()]).collect();
            let mut run_parity = vec![vec![0u8; at.len()]; codec.m()];
            let mut outs: Vec<&mut [u8]> =
                run_parity.iter_mut().map(|v| v.as_mut_slice()).collect();
            codec.encode(&run_data, &mut outs).expect("encode run");
            for i in 0..codec.m() {
                assert!(
                    run_parity[i] == parity[i][at.clone()],
                    "{k}+{m}: run parity {i}"
                );
            }
        }
    }

    #[test]
    fn parity_encode_is_systematic_and_deterministic_across_codecs() {
        // Two codecs, one reused at other lengths in between, give identical parity.
        let mut a = Codec::new(4, 2).expect("valid");
        let mut b = Codec::new(4, 2).expect("valid");
        let first = stripe(&mut a, BLOCK_SIZE, 1);
        let _ = stripe(&mut a, 3 * BLOCK_SIZE, 2);
        let again = stripe(&mut a, BLOCK_SIZE, 1);
        let other = stripe(&mut b, BLOCK_SIZE, 1);
        assert_eq!(first, again);
        assert_eq!(first, other);
        // Parity is not trivially zero or a copy of the data.
        assert!(first[4].iter().any(|&x| x != 0));
        assert!(first[4] != first[0] && first[4] != first[5]);
    }

    #[test]
    fn parity_verify_detects_any_single_flipped_bit() {
        for (k, m) in [(2u8, 1u8), (4, 2)] {
            let mut codec = Codec::new(k, m).expect("valid");
            let len = 2 * BLOCK_SIZE;
            let mut shards = stripe(&mut codec, len, 99);
            assert!(codec.verify(&refs(&shards)).expect("verify"));
            let mut rng = rand::rngs::StdRng::seed_from_u64(5);
            for shard in 0..shards.len() {
                let mut spots = vec![0, len - 1, BLOCK_SIZE, BLOCK_SIZE - 1];
                spots.extend((0..4).map(|_| rng.gen_range(0..len)));
                for byte in spots {
                    for bit in [0u8, 7, rng.gen_range(0..8)] {
                        shards[shard][byte] ^= 1 << bit;
                        let ok = codec.verify(&refs(&shards)).expect("verify");
                        assert!(!ok, "{k}+{m}: flip of shard {shard} byte {byte} bit {bit}");
                        shards[shard][byte] ^= 1 << bit;
                    }
                }
            }
            assert!(codec.verify(&refs(&shards)).expect("verify"));
        }
    }

    #[test]
    fn parity_errors_for_bad_shards() {
        let mut codec = Codec::new(3, 2).expect("valid");
        let len = BLOCK_SIZE;
        let shards = stripe(&mut codec, len, 3);
        let mut buf = vec![0u8; len];

        // Fewer than K present.
        let mut few: Vec<Shard> = vec![
            Shard::Have(&shards[0]),
            Shard::Want(&mut buf),
            Shard::Absent,
            Shard::Absent,
            Shard::Have(&shards[4]),
        ];
        assert_eq!(
            codec.reconstruct(&mut few),
            Err(CodecError::NotEnoughShards { have: 2, needed: 3 })
        );

        // Unequal lengths, in reconstruct, encode and verify.
        let short = vec![0u8; 2 * len];
        let mut uneven: Vec<Shard> = vec![
            Shard::Have(&shards[0]),
            Shard::Want(&mut buf),
            Shard::Have(&shards[2]),
            Shard::Have(&short),
            Shard::Have(&shards[4]),
        ];
        assert_eq!(
            codec.reconstruct(&mut uneven),
            Err(CodecError::UnequalShards {
                index: 3,
                len: 2 * len,
                expected: len
            })
        );
        let data: Vec<&[u8]> = vec![&shards[0], &short, &shards[2]];
        let mut p0 = vec![0u8; len];
        let mut p1 = vec![0u8; len];
        assert!(matches!(
            codec.encode(&data, &mut [&mut p0, &mut p1]),
            Err(CodecError::UnequalShards { index: 1, .. })
        ));
        let mut all = refs(&shards);
        all[4] = &short;
        assert!(matches!(
            codec.verify(&all),
            Err(CodecError::UnequalShards { index: 4, .. })
        ));

        // Not whole blocks.
        let odd = vec![0u8; 100];
        let data: Vec<&[u8]> = vec![&odd, &odd, &odd];
        let mut q0 = vec![0u8; 100];
        let mut q1 = vec![0u8; 100];
        assert_eq!(
            codec.encode(&data, &mut [&mut q0, &mut q1]),
            Err(CodecError::ShardSize { index: 0, len: 100 })
        );

        // Wrong shard counts.
        let data = refs(&shards[..2]);
        assert!(matches!(
            codec.encode(&data, &mut [&mut p0, &mut p1]),
            Err(CodecError::ShardCount {
                expected: 3,
                got: 2,
                ..
            })
        ));
        let data = refs(&shards[..3]);
        assert!(matches!(
            codec.encode(&data, &mut [&mut p0]),
            Err(CodecError::ShardCount {
                expected: 2,
                got: 1,
                ..
            })
        ));
        assert!(matches!(
            codec.verify(&refs(&shards[..4])),
            Err(CodecError::ShardCount {
                expected: 5,
                got: 4,
                ..
            })
        ));

        // The codec still works after all those refusals.
        let mut out = vec![0u8; len];
        let mut ok: Vec<Shard> = vec![
            Shard::Absent,
            Shard::Want(&mut out),
            Shard::Have(&shards[2]),
            Shard::Have(&shards[3]),
            Shard::Have(&shards[4]),
        ];
        codec.reconstruct(&mut ok).expect("reconstruct");
        assert!(out == shards[1]);
    }

    /// Throughput on one core, in data bytes per second. Not a pass/fail check:
    /// `cargo test --release -p converge-volume parity_throughput -- --ignored --nocapture`.
    #[test]
    #[ignore = "prints throughput; run in release with --ignored --nocapture"]
    fn parity_throughput() {
        use std::hint::black_box;
        use std::time::{Duration, Instant};
        const RUN: Duration = Duration::from_millis(500);
        for (k, m) in [(2u8, 1u8), (4, 2)] {
            for rows in [1usize, 32] {
                let len = rows * BLOCK_SIZE;
                let mut codec = Codec::new(k, m).expect("valid");
                let shards = stripe(&mut codec, len, 42);
                let data_bytes = (usize::from(k) * len) as f64;
                let (data, _) = shards.split_at(usize::from(k));
                let data = refs(data);
                let mut parity = vec![vec![0u8; len]; usize::from(m)];

                let start = Instant::now();
                let mut calls = 0u64;
                while start.elapsed() < RUN {
                    let mut outs: Vec<&mut [u8]> =
                        parity.iter_mut().map(|v| v.as_mut_slice()).collect();
                    codec.encode(black_box(&data), &mut outs).expect("encode");
                    calls += 1;
                }
                let encode = data_bytes * calls as f64 / start.elapsed().as_secs_f64() / 1e6;

                // Worst degraded case: the first M data shards lost, all parity read.
                let mut lost = vec![vec![0u8; len]; usize::from(m)];
                let start = Instant::now();
                let mut calls = 0u64;
                while start.elapsed() < RUN {
                    let mut sh: Vec<Shard> = lost
                        .iter_mut()
                        .map(|b| Shard::Want(b.as_mut_slice()))
                        .chain(shards[usize::from(m)..].iter().map(|s| Shard::Have(s)))
                        .collect();
                    codec.reconstruct(black_box(&mut sh)).expect("reconstruct");
                    calls += 1;
                }
                let rebuild = data_bytes * calls as f64 / start.elapsed().as_secs_f64() / 1e6;
                assert!(lost.iter().zip(&shards).all(|(a, b)| a == b));
                println!(
                    "parity-{k}+{m} L={:>6} B: encode {encode:>8.0} MB/s, \
                     reconstruct ({m} data lost) {rebuild:>8.0} MB/s",
                    len
                );
            }
        }
    }
}
