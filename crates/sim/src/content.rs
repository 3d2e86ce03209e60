//! Self-describing block contents: every 4 KiB block a simulated client writes names the
//! volume, the block and the write it came from, so any block read back can be traced to
//! exactly one write (or shown to be garbage).

use converge_types::BLOCK_SIZE;

const MAGIC: u64 = 0x3156_4e4f_434d_4953; // "SIMCONV1", little-endian
const HEADER_BYTES: usize = 32;

/// What a block read back holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decoded {
    /// All zeros: never written, or zeroed (TRIM / WRITE_ZEROES).
    Zero,
    /// The content write `write` put into `block` of volume `volume`.
    Write { volume: u64, block: u64, write: u64 },
    /// Bytes no write ever produced (a torn or rotten block that slipped through, or data
    /// of the wrong place).
    Garbage,
}

/// splitmix64: a tiny, good-enough generator for filler bytes.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Words of filler generated per block; the rest repeats them, so a compressed volume's
/// groups shrink (variant `compress`) while every block stays unique to its write.
const FILLER_WORDS: usize = 8;

/// Appends the content of `block` of `volume` as written by write `write` (ids start at 1).
pub fn push_block(out: &mut Vec<u8>, volume: u64, block: u64, write: u64) {
    let start = out.len();
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.extend_from_slice(&volume.to_le_bytes());
    out.extend_from_slice(&block.to_le_bytes());
    out.extend_from_slice(&write.to_le_bytes());
    let mut s = mix(volume ^ mix(block ^ mix(write)));
    let mut words = [0u64; FILLER_WORDS];
    for w in words.iter_mut() {
        s = mix(s);
        *w = s;
    }
    let mut i = 0;
    while out.len() - start < BLOCK_SIZE {
        out.extend_from_slice(&words[i % FILLER_WORDS].to_le_bytes());
        i += 1;
    }
}

/// Which write (if any) produced `buf` (one block).
pub fn decode(buf: &[u8]) -> Decoded {
    if buf.iter().all(|&b| b == 0) {
        return Decoded::Zero;
    }
    if buf.len() != BLOCK_SIZE {
        return Decoded::Garbage;
    }
    let word = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&buf[i * 8..i * 8 + 8]);
        u64::from_le_bytes(w)
    };
    if word(0) != MAGIC {
        return Decoded::Garbage;
    }
    let (volume, block, write) = (word(1), word(2), word(3));
    let mut want = Vec::with_capacity(BLOCK_SIZE);
    push_block(&mut want, volume, block, write);
    if want[HEADER_BYTES..] != buf[HEADER_BYTES..] {
        return Decoded::Garbage;
    }
    Decoded::Write {
        volume,
        block,
        write,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_garbage() {
        let mut b = Vec::new();
        push_block(&mut b, 3, 17, 99);
        assert_eq!(b.len(), BLOCK_SIZE);
        assert_eq!(
            decode(&b),
            Decoded::Write {
                volume: 3,
                block: 17,
                write: 99
            }
        );
        assert_eq!(decode(&[0u8; BLOCK_SIZE]), Decoded::Zero);
        b[1000] ^= 4;
        assert_eq!(decode(&b), Decoded::Garbage);
        let mut torn = Vec::new();
        push_block(&mut torn, 3, 17, 100);
        torn[512..1024].fill(0);
        assert_eq!(decode(&torn), Decoded::Garbage);
    }
}
