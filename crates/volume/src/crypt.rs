//! Encryption at rest (docs/adr/0011): AES-256-XTS (IEEE 1619) with a 4 KiB data unit —
//! one volume block — whose tweak is the block's number in the volume. The owner seals
//! what a client writes before it fans out, and opens what the copies return, so every
//! copy, chunk, cache log, resync, rebuild, scrub and rotation handles ciphertext only, and
//! the checksums the copies keep are the ciphertext's.
//!
//! The tweak is the block's place in the volume, never where a copy keeps it: a block
//! moved between drives, slabs' copies or the two parts of a mirror-accelerated parity
//! volume stays readable as long as it keeps its volume offset (it always does).
//!
//! A block that reads back as all zeros is zeros in the volume: never written, trimmed, or
//! zeroed (those are metadata on the copies, and read as zeros). A sealed block is all zeros
//! with probability 2^-32768, so this costs no data; what it tells someone holding the
//! drives — which blocks hold data — thin provisioning tells anyway.

use aes::cipher::{BlockDecrypt, BlockEncrypt, KeyInit};
use aes::{Aes256, Block};
use zeroize::Zeroize;

/// Bytes of a volume data key: two AES-256 keys (data, tweak).
pub const KEY_BYTES: usize = 64;
/// The data unit: one volume block.
const UNIT: usize = converge_types::BLOCK_SIZE;
/// AES blocks handled at once (the AES-NI back-end pipelines eight).
const PAR: usize = 8;

/// The name volume records and the API use for the cipher.
pub const CIPHER_NAME: &str = "aes-256-xts";

/// A volume's data key, ready to seal and open blocks.
pub struct VolumeCipher {
    data: Aes256,
    tweak: Aes256,
}

impl std::fmt::Debug for VolumeCipher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("VolumeCipher(aes-256-xts)")
    }
}

/// Why a data key cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CipherError {
    #[error("a volume key is {KEY_BYTES} bytes, not {0}")]
    Length(usize),
    #[error("the two halves of a volume key are equal (XTS needs two different keys)")]
    EqualHalves,
}

impl VolumeCipher {
    /// From a 64-byte data key: the first half encrypts data, the second tweaks. The
    /// caller's copy is its own to wipe; the expanded keys are wiped when this is dropped.
    pub fn new(key: &[u8]) -> Result<VolumeCipher, CipherError> {
        if key.len() != KEY_BYTES {
            return Err(CipherError::Length(key.len()));
        }
        let (k1, k2) = key.split_at(KEY_BYTES / 2);
        if k1 == k2 {
            return Err(CipherError::EqualHalves);
        }
        let mut a = [0u8; 32];
        let mut b = [0u8; 32];
        a.copy_from_slice(k1);
        b.copy_from_slice(k2);
        let c = VolumeCipher {
            data: Aes256::new(&a.into()),
            tweak: Aes256::new(&b.into()),
        };
        a.zeroize();
        b.zeroize();
        Ok(c)
    }

    /// Encrypts `buf` in place: whole blocks, the first being volume block `first`.
    pub fn seal(&self, first: u64, buf: &mut [u8]) {
        debug_assert!(buf.len().is_multiple_of(UNIT));
        for (i, unit) in buf.chunks_exact_mut(UNIT).enumerate() {
            self.unit(first + i as u64, unit, true);
        }
    }

    /// Decrypts `buf` in place: whole blocks, the first being volume block `first`. A
    /// block of zeros stays zeros (a block the copies hold no data for).
    pub fn open(&self, first: u64, buf: &mut [u8]) {
        debug_assert!(buf.len().is_multiple_of(UNIT));
        for (i, unit) in buf.chunks_exact_mut(UNIT).enumerate() {
            if unit.iter().all(|&b| b == 0) {
                continue;
            }
            self.unit(first + i as u64, unit, false);
        }
    }

    /// XTS over one data unit (its length a multiple of 128 bytes): the tweak is the unit's
    /// number encrypted with the tweak key, multiplied by α for each next AES block; each
    /// AES block is XORed with its tweak before and after the cipher.
    fn unit(&self, n: u64, unit: &mut [u8], encrypt: bool) {
        let mut t = Block::from(u128::from(n).to_le_bytes());
        self.tweak.encrypt_block(&mut t);
        let mut tw = u128::from_le_bytes(t.into());
        let mut par = [Block::default(); PAR];
        let mut tws = [0u128; PAR];
        for chunk in unit.chunks_exact_mut(16 * PAR) {
            for (i, (b, t)) in par.iter_mut().zip(tws.iter_mut()).enumerate() {
                *t = tw;
                let x = u128_at(chunk, i) ^ tw;
                *b = Block::from(x.to_le_bytes());
                tw = times_alpha(tw);
            }
            if encrypt {
                self.data.encrypt_blocks(&mut par);
            } else {
                self.data.decrypt_blocks(&mut par);
            }
            for (i, (b, t)) in par.iter().zip(tws.iter()).enumerate() {
                let x = u128::from_le_bytes((*b).into()) ^ t;
                chunk[16 * i..16 * i + 16].copy_from_slice(&x.to_le_bytes());
            }
        }
        // The last plaintexts and tweaks on the stack.
        for b in par.iter_mut() {
            b.as_mut_slice().zeroize();
        }
        tws.zeroize();
    }
}

fn u128_at(chunk: &[u8], i: usize) -> u128 {
    let mut b = [0u8; 16];
    b.copy_from_slice(&chunk[16 * i..16 * i + 16]);
    u128::from_le_bytes(b)
}

/// Multiplication by α in GF(2^128) as XTS defines it (little-endian, x^128 = x^7+x^2+x+1).
fn times_alpha(t: u128) -> u128 {
    (t << 1) ^ ((t >> 127) * 0x87)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(seed: u8) -> [u8; KEY_BYTES] {
        std::array::from_fn(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
    }

    fn data(len: usize, seed: u32) -> Vec<u8> {
        (0..len as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13).wrapping_add(seed) as u8)
            .collect()
    }

    /// Against an independent XTS implementation (the xts-mode crate), unit by unit.
    #[test]
    fn matches_another_xts_implementation() {
        use xts_mode::{get_tweak_default, Xts128};
        let k = key(5);
        let c = VolumeCipher::new(&k).unwrap();
        let other = Xts128::<Aes256>::new(
            Aes256::new_from_slice(&k[..32]).unwrap(),
            Aes256::new_from_slice(&k[32..]).unwrap(),
        );
        let plain = data(8 * UNIT, 1);
        for first in [0u64, 1, 77, u64::from(u32::MAX) + 3] {
            let mut a = plain.clone();
            c.seal(first, &mut a);
            let mut b = plain.clone();
            other.encrypt_area(&mut b, UNIT, u128::from(first), get_tweak_default);
            assert!(a == b, "unit {first}");
            assert!(a != plain);
            c.open(first, &mut a);
            assert!(a == plain, "round trip at {first}");
        }
    }

    /// Equal blocks at different places encrypt differently; another key gives other
    /// ciphertext; opening at the wrong place gives garbage, not the data.
    #[test]
    fn the_tweak_is_the_place_and_the_key_matters() {
        let c = VolumeCipher::new(&key(1)).unwrap();
        let block = data(UNIT, 9);
        let mut two = [block.clone(), block.clone()].concat();
        c.seal(40, &mut two);
        assert!(two[..UNIT] != two[UNIT..]);
        let mut other = block.clone();
        VolumeCipher::new(&key(2)).unwrap().seal(40, &mut other);
        assert!(other[..] != two[..UNIT]);
        let mut moved = two[..UNIT].to_vec();
        c.open(41, &mut moved);
        assert!(moved != block);
    }

    #[test]
    fn zeros_read_back_as_zeros_and_written_zeros_are_sealed() {
        let c = VolumeCipher::new(&key(3)).unwrap();
        let mut z = vec![0u8; 2 * UNIT];
        c.open(10, &mut z);
        assert!(z.iter().all(|&b| b == 0), "a hole stays a hole");
        let mut w = vec![0u8; UNIT];
        c.seal(10, &mut w);
        assert!(
            w.iter().any(|&b| b != 0),
            "written zeros are not stored as zeros"
        );
        c.open(10, &mut w);
        assert!(w.iter().all(|&b| b == 0));
    }

    #[test]
    fn bad_keys_are_refused() {
        assert_eq!(
            VolumeCipher::new(&[1u8; 10]).unwrap_err(),
            CipherError::Length(10)
        );
        assert_eq!(
            VolumeCipher::new(&[7u8; KEY_BYTES]).unwrap_err(),
            CipherError::EqualHalves
        );
    }
}
