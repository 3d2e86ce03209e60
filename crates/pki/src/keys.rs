//! The cluster's key-encryption keys (docs/adr/0011): a small text file every node reads,
//! kept outside etcd, so what etcd holds (each encrypted volume's data key, wrapped) is
//! useless without it.
//!
//! ```text
//! # converge cluster keys: ID BASE64 (32 bytes); the last one wraps new volume keys
//! 1 q1v3...=
//! 2 Zm9v...=
//! ```
//!
//! A volume's 64-byte data key is wrapped with AES-256-GCM under one of these keys, bound
//! to the volume's id (a wrapped key copied to another volume's record does not unwrap).
//! Rotation: add a key (`converge key add`) to every node's file, re-wrap the volumes
//! (`converge volume rekey --all`), then remove the old key. Data is never re-encrypted:
//! rotation changes the wrapping key only.

use crate::PkiError;
use base64::Engine as _;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::rand::{SecureRandom, SystemRandom};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use zeroize::{Zeroize, Zeroizing};

/// Bytes of a cluster key.
pub const CLUSTER_KEY_BYTES: usize = 32;
/// Bytes of a volume data key (AES-256-XTS: two AES-256 keys).
pub const DATA_KEY_BYTES: usize = 64;
/// The first line of a key file.
const HEADER: &str =
    "# converge cluster keys: ID BASE64 (32 bytes); the last one wraps new volume keys\n";
/// What a wrapped key is bound to besides the volume id.
const AAD_PREFIX: &[u8] = b"converge volume data key v1:";

/// A volume's data key, wiped when dropped.
pub type DataKey = Zeroizing<[u8; DATA_KEY_BYTES]>;

/// The keys of a key file, in file order (the last one is current).
pub struct Keyring {
    path: PathBuf,
    keys: Vec<(u32, Zeroizing<[u8; CLUSTER_KEY_BYTES]>)>,
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Keyring({}, ids {:?})", self.path.display(), self.ids())
    }
}

fn bad(path: &Path, message: impl Into<String>) -> PkiError {
    PkiError::Bad {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

fn b64() -> base64::engine::GeneralPurpose {
    base64::engine::general_purpose::STANDARD
}

fn random(buf: &mut [u8]) -> Result<(), PkiError> {
    SystemRandom::new().fill(buf).map_err(|_| PkiError::Bad {
        path: PathBuf::from("/dev/urandom"),
        message: "the system's random number generator failed".into(),
    })
}

impl Keyring {
    /// Reads a key file. Refused when others may read it (it must be 0600 or 0400, like an
    /// ssh key), when a line is not `ID BASE64` of 32 bytes, or when an id repeats.
    pub fn load(path: &Path) -> Result<Keyring, PkiError> {
        let meta = std::fs::metadata(path).map_err(|source| PkiError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let mode = meta.permissions().mode();
        if mode & 0o077 != 0 {
            return Err(bad(
                path,
                format!(
                    "cluster key file is readable by others (mode {:o}): chmod 600 it",
                    mode & 0o777
                ),
            ));
        }
        let text =
            Zeroizing::new(
                std::fs::read_to_string(path).map_err(|source| PkiError::Io {
                    path: path.to_path_buf(),
                    source,
                })?,
            );
        let mut keys: Vec<(u32, Zeroizing<[u8; CLUSTER_KEY_BYTES]>)> = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let what = || format!("line {}: expected `ID BASE64` (a 32-byte key)", n + 1);
            let (id, key) = line
                .split_once(char::is_whitespace)
                .ok_or_else(|| bad(path, what()))?;
            let id: u32 = id
                .parse()
                .ok()
                .filter(|&i| i > 0)
                .ok_or_else(|| bad(path, format!("{}: the id is a number from 1", what())))?;
            let raw = Zeroizing::new(b64().decode(key.trim()).map_err(|_| bad(path, what()))?);
            if raw.len() != CLUSTER_KEY_BYTES {
                return Err(bad(
                    path,
                    format!("{}: key {id} is {} bytes", what(), raw.len()),
                ));
            }
            if keys.iter().any(|(k, _)| *k == id) {
                return Err(bad(
                    path,
                    format!("line {}: key {id} is listed twice", n + 1),
                ));
            }
            let mut k = Zeroizing::new([0u8; CLUSTER_KEY_BYTES]);
            k.copy_from_slice(&raw);
            keys.push((id, k));
        }
        if keys.is_empty() {
            return Err(bad(
                path,
                "holds no key: make one with `converge key init --file PATH`",
            ));
        }
        Ok(Keyring {
            path: path.to_path_buf(),
            keys,
        })
    }

    /// Writes a new key file with one random key (id 1). Refuses to overwrite a file.
    pub fn create(path: &Path) -> Result<Keyring, PkiError> {
        if path.exists() {
            return Err(bad(
                path,
                "exists already: add a key to it with `converge key add`",
            ));
        }
        let mut k = Zeroizing::new([0u8; CLUSTER_KEY_BYTES]);
        random(&mut k[..])?;
        let ring = Keyring {
            path: path.to_path_buf(),
            keys: vec![(1, k)],
        };
        ring.save()?;
        Ok(ring)
    }

    /// Adds a random key, which becomes current (it wraps the keys of volumes created or
    /// re-keyed from now on); its id is one more than the largest. Returns the id.
    pub fn add(&mut self) -> Result<u32, PkiError> {
        let id = self.keys.iter().map(|(i, _)| *i).max().unwrap_or(0) + 1;
        let mut k = Zeroizing::new([0u8; CLUSTER_KEY_BYTES]);
        random(&mut k[..])?;
        self.keys.push((id, k));
        self.save()?;
        Ok(id)
    }

    /// Removes key `id`; the current key cannot be removed (add another first).
    pub fn remove(&mut self, id: u32) -> Result<(), PkiError> {
        if !self.keys.iter().any(|(i, _)| *i == id) {
            return Err(bad(
                &self.path,
                format!("has no key {id} (it has {:?})", self.ids()),
            ));
        }
        if self.current() == id {
            return Err(bad(
                &self.path,
                format!("key {id} is the current key: add a new one and re-key the volumes first"),
            ));
        }
        self.keys.retain(|(i, _)| *i != id);
        self.save()
    }

    fn save(&self) -> Result<(), PkiError> {
        let mut text = Zeroizing::new(String::from(HEADER));
        for (id, k) in &self.keys {
            let mut line = format!("{id} {}\n", b64().encode(&k[..]));
            text.push_str(&line);
            line.zeroize();
        }
        crate::write_file(&self.path, text.as_bytes(), 0o600)
    }

    /// The key ids, in file order.
    pub fn ids(&self) -> Vec<u32> {
        self.keys.iter().map(|(i, _)| *i).collect()
    }

    /// The id of the key that wraps new volume keys: the last in the file.
    pub fn current(&self) -> u32 {
        self.keys.last().map(|(i, _)| *i).unwrap_or(0)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn key(&self, id: u32) -> Result<LessSafeKey, PkiError> {
        let (_, k) = self.keys.iter().find(|(i, _)| *i == id).ok_or_else(|| {
            bad(
                &self.path,
                format!(
                    "has no cluster key {id} (it has {:?}): every node's key file needs the \
                     keys the volumes are wrapped with (`converge volume list` shows them)",
                    self.ids()
                ),
            )
        })?;
        let unbound = UnboundKey::new(&AES_256_GCM, &k[..])
            .map_err(|_| bad(&self.path, format!("key {id} is not an AES-256 key")))?;
        Ok(LessSafeKey::new(unbound))
    }

    /// Wraps `data_key` for volume `volume` with the current key: (key id, base64 of
    /// nonce, ciphertext and tag).
    pub fn wrap(&self, volume: u64, data_key: &DataKey) -> Result<(u32, String), PkiError> {
        let id = self.current();
        let key = self.key(id)?;
        let mut nonce = [0u8; NONCE_LEN];
        random(&mut nonce)?;
        let mut sealed = Zeroizing::new(data_key.to_vec());
        key.seal_in_place_append_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(aad(volume)),
            &mut *sealed,
        )
        .map_err(|_| bad(&self.path, "sealing a volume key failed"))?;
        let mut out = nonce.to_vec();
        out.extend_from_slice(&sealed);
        Ok((id, b64().encode(out)))
    }

    /// Unwraps a key `wrap` made with key `id` for volume `volume`. Fails when the file has
    /// no key `id`, or when that key is not the one it was wrapped with.
    pub fn unwrap(&self, id: u32, volume: u64, wrapped: &str) -> Result<DataKey, PkiError> {
        let key = self.key(id)?;
        let wrong = || {
            bad(
                &self.path,
                format!(
                    "cluster key {id} does not unwrap volume {volume}'s key: this file's key {id} \
                     is not the one it was wrapped with (or the record was altered)"
                ),
            )
        };
        let raw = b64().decode(wrapped).map_err(|_| wrong())?;
        if raw.len() != NONCE_LEN + DATA_KEY_BYTES + AES_256_GCM.tag_len() {
            return Err(wrong());
        }
        let (nonce, rest) = raw.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| wrong())?;
        let mut buf = Zeroizing::new(rest.to_vec());
        let plain = key
            .open_in_place(nonce, Aad::from(aad(volume)), &mut buf)
            .map_err(|_| wrong())?;
        let mut out = Zeroizing::new([0u8; DATA_KEY_BYTES]);
        out.copy_from_slice(plain);
        Ok(out)
    }
}

fn aad(volume: u64) -> Vec<u8> {
    let mut a = AAD_PREFIX.to_vec();
    a.extend_from_slice(&volume.to_le_bytes());
    a
}

/// A new random volume data key (its two halves differ, as XTS requires).
pub fn new_data_key() -> Result<DataKey, PkiError> {
    let mut k = Zeroizing::new([0u8; DATA_KEY_BYTES]);
    loop {
        random(&mut k[..])?;
        if k[..DATA_KEY_BYTES / 2] != k[DATA_KEY_BYTES / 2..] {
            return Ok(k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrap_unwrap_rotate_and_refusals() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("keys");
        let mut ring = Keyring::create(&p).unwrap();
        assert!(Keyring::create(&p).is_err(), "never overwritten");
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let dk = new_data_key().unwrap();
        let (id, w) = ring.wrap(9, &dk).unwrap();
        assert_eq!(id, 1);
        assert_eq!(*ring.unwrap(1, 9, &w).unwrap(), *dk);
        // Bound to the volume; a flipped bit is caught.
        assert!(ring.unwrap(1, 10, &w).is_err());
        let mut raw = b64().decode(&w).unwrap();
        raw[20] ^= 1;
        assert!(ring.unwrap(1, 9, &b64().encode(raw)).is_err());
        // Rotation: a new current key; the old still unwraps; the current is kept.
        assert_eq!(ring.add().unwrap(), 2);
        let ring2 = Keyring::load(&p).unwrap();
        assert_eq!(ring2.ids(), vec![1, 2]);
        assert_eq!(ring2.current(), 2);
        let (id2, w2) = ring2.wrap(9, &dk).unwrap();
        assert_eq!(id2, 2);
        assert_eq!(*ring2.unwrap(1, 9, &w).unwrap(), *dk);
        assert!(ring.remove(2).is_err(), "the current key stays");
        ring.remove(1).unwrap();
        let ring3 = Keyring::load(&p).unwrap();
        let e = ring3.unwrap(1, 9, &w).unwrap_err().to_string();
        assert!(e.contains("has no cluster key 1"), "{e}");
        assert_eq!(*ring3.unwrap(2, 9, &w2).unwrap(), *dk);
        // Another file's key 2 is not this one.
        let other = Keyring::create(&dir.path().join("other")).unwrap();
        let mut other = other;
        other.add().unwrap();
        let e = other.unwrap(2, 9, &w2).unwrap_err().to_string();
        assert!(e.contains("does not unwrap"), "{e}");
    }

    #[test]
    fn files_that_are_open_to_others_or_malformed_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("keys");
        Keyring::create(&p).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = Keyring::load(&p).unwrap_err().to_string();
        assert!(e.contains("chmod 600"), "{e}");
        for (text, want) in [
            ("# nothing\n", "holds no key"),
            ("1 abc\n", "expected `ID BASE64`"),
            ("0 AAAA\n", "the id is a number from 1"),
            ("1 AAAA\n", "is 3 bytes"),
        ] {
            crate::write_file(&p, text.as_bytes(), 0o600).unwrap();
            let e = Keyring::load(&p).unwrap_err().to_string();
            assert!(e.contains(want), "{text:?}: {e}");
        }
        let k = b64().encode([1u8; 32]);
        crate::write_file(&p, format!("1 {k}\n1 {k}\n").as_bytes(), 0o600).unwrap();
        let e = Keyring::load(&p).unwrap_err().to_string();
        assert!(e.contains("listed twice"), "{e}");
    }

    #[test]
    fn data_keys_are_random_with_distinct_halves() {
        let a = new_data_key().unwrap();
        let b = new_data_key().unwrap();
        assert_ne!(*a, *b);
        assert_ne!(a[..32], a[32..]);
    }
}
