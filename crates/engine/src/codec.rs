//! Compression of block groups (docs/adr/0010): one stream per group of blocks, stored in
//! whole physical blocks only when that saves at least one. Thread-local contexts and
//! buffers, so the data path allocates nothing per group.

use converge_types::{Compression, BLOCK_SIZE};
use std::cell::RefCell;

/// zstd's level: 1 (docs/studies/savings.md: level 3 saves 1 % more for 1.3× the CPU).
const ZSTD_LEVEL: i32 = 1;

struct Contexts {
    zc: Option<zstd::bulk::Compressor<'static>>,
    zd: Option<zstd::bulk::Decompressor<'static>>,
}

thread_local! {
    static CTX: RefCell<Contexts> = const { RefCell::new(Contexts { zc: None, zd: None }) };
}

/// Compresses `input` (a whole group) into `out` with `codec`. Returns the stream's length
/// if it is at least one 4 KiB block shorter than `input` rounded to blocks (else storing
/// the group as is costs no more): `None` means "store it plainly".
pub(crate) fn compress(codec: Compression, input: &[u8], out: &mut [u8]) -> Option<usize> {
    // Room for a stream one block shorter than the input, at most.
    let limit = input.len().saturating_sub(BLOCK_SIZE).min(out.len());
    if limit == 0 {
        return None;
    }
    let n = match codec {
        Compression::None => return None,
        Compression::Lz4 => {
            // lz4 wants room for its worst case; give it the scratch, check the limit after.
            lz4_flex::block::compress_into(input, out).ok()?
        }
        Compression::Zstd => CTX.with(|c| {
            let mut c = c.borrow_mut();
            if c.zc.is_none() {
                c.zc = zstd::bulk::Compressor::new(ZSTD_LEVEL).ok();
            }
            let zc = c.zc.as_mut()?;
            zc.compress_to_buffer(input, &mut out[..limit]).ok()
        })?,
    };
    (n > 0 && n <= limit).then_some(n)
}

/// Decompresses a stream into exactly `out.len()` bytes; false if the stream is damaged
/// (or decompresses to another length).
pub(crate) fn decompress(codec: Compression, stream: &[u8], out: &mut [u8]) -> bool {
    match codec {
        Compression::None => false,
        Compression::Lz4 => {
            matches!(lz4_flex::block::decompress_into(stream, out), Ok(n) if n == out.len())
        }
        Compression::Zstd => CTX.with(|c| {
            let mut c = c.borrow_mut();
            if c.zd.is_none() {
                c.zd = zstd::bulk::Decompressor::new().ok();
            }
            let Some(zd) = c.zd.as_mut() else {
                return false;
            };
            matches!(zd.decompress_to_buffer(stream, out), Ok(n) if n == out.len())
        }),
    }
}

/// Bytes of scratch a compressor needs for a group of `group_bytes`: lz4's worst case.
pub(crate) fn scratch_bytes(group_bytes: usize) -> usize {
    lz4_flex::block::get_maximum_output_size(group_bytes).max(group_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(kind: u8) -> Vec<u8> {
        let mut v = vec![0u8; 4 * BLOCK_SIZE];
        match kind {
            // Text-like: compresses well.
            0 => {
                for (i, b) in v.iter_mut().enumerate() {
                    *b = b"converge stores volumes "[i % 24];
                }
            }
            // Random: does not compress.
            _ => {
                let mut x = 0x9E37_79B9_7F4A_7C15u64;
                for b in v.iter_mut() {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    *b = x as u8;
                }
            }
        }
        v
    }

    #[test]
    fn round_trip_and_refusal() {
        for codec in [Compression::Lz4, Compression::Zstd] {
            let input = group(0);
            let mut out = vec![0u8; scratch_bytes(input.len())];
            let n = compress(codec, &input, &mut out).expect("text compresses");
            assert!(n <= 3 * BLOCK_SIZE, "{codec}: {n}");
            let mut back = vec![0u8; input.len()];
            assert!(decompress(codec, &out[..n], &mut back));
            assert_eq!(back, input);
            // A damaged stream is refused or decompresses to other bytes (the crcs tell).
            let mut bad = out[..n].to_vec();
            bad[n / 2] ^= 0x55;
            let mut other = vec![0u8; input.len()];
            assert!(!decompress(codec, &bad, &mut other) || other != input);
            // A truncated stream never decompresses to the full length silently.
            assert!(!decompress(codec, &out[..n / 2], &mut other) || other != input);
            // Random data saves no block: stored plainly.
            let random = group(1);
            assert_eq!(compress(codec, &random, &mut out), None, "{codec}");
        }
        assert_eq!(
            compress(Compression::None, &group(0), &mut [0u8; 65536]),
            None
        );
    }
}
