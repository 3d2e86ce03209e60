//! Encryption at rest on the node (docs/adr/0011): the cluster key file named by the
//! config's `[encryption] key_file`, read afresh whenever a volume key is made, opened or
//! re-wrapped (so a key added to the file needs no restart).

use crate::config::Config;
use converge_control::model::{EncryptionRecord, VolumeRecord};
use converge_pki::keys::{new_data_key, Keyring};
use converge_volume::crypt::{VolumeCipher, CIPHER_NAME};
use std::sync::Arc;

/// This node's cluster keys, or why there are none.
pub fn keyring(cfg: &Config) -> Result<Keyring, String> {
    let Some(path) = &cfg.key_file else {
        return Err(format!(
            "node {} has no cluster key file: set [encryption] key_file in its config (make \
             one with `converge key init --file PATH` and copy it to every node)",
            cfg.node_id
        ));
    };
    Keyring::load(path).map_err(|e| e.to_string())
}

/// A new data key for volume `id`, wrapped with the current cluster key.
pub fn new_record(cfg: &Config, id: u64) -> Result<EncryptionRecord, String> {
    let ring = keyring(cfg)?;
    let key = new_data_key().map_err(|e| e.to_string())?;
    let (key_id, wrapped_key) = ring.wrap(id, &key).map_err(|e| e.to_string())?;
    Ok(EncryptionRecord {
        cipher: CIPHER_NAME.into(),
        key_id,
        wrapped_key,
    })
}

/// The cipher an encrypted volume's owner serves it with; `None` for a plain volume.
pub fn cipher_of(cfg: &Config, rec: &VolumeRecord) -> Result<Option<Arc<VolumeCipher>>, String> {
    let Some(e) = &rec.encryption else {
        return Ok(None);
    };
    if e.cipher != CIPHER_NAME {
        return Err(format!(
            "volume {} is encrypted with {:?}, which this converge does not know",
            rec.name, e.cipher
        ));
    }
    let ring = keyring(cfg)?;
    let key = ring
        .unwrap(e.key_id, rec.id.0, &e.wrapped_key)
        .map_err(|err| format!("volume {}: {err}", rec.name))?;
    VolumeCipher::new(&key[..])
        .map(|c| Some(Arc::new(c)))
        .map_err(|err| format!("volume {}: {err}", rec.name))
}

/// `rec`'s data key wrapped again with the current cluster key (the data is unchanged).
pub fn rewrap(cfg: &Config, rec: &VolumeRecord) -> Result<EncryptionRecord, String> {
    let Some(e) = &rec.encryption else {
        return Err(format!("volume {} is not encrypted", rec.name));
    };
    let ring = keyring(cfg)?;
    let key = ring
        .unwrap(e.key_id, rec.id.0, &e.wrapped_key)
        .map_err(|err| format!("volume {}: {err}", rec.name))?;
    let (key_id, wrapped_key) = ring.wrap(rec.id.0, &key).map_err(|e| e.to_string())?;
    Ok(EncryptionRecord {
        cipher: e.cipher.clone(),
        key_id,
        wrapped_key,
    })
}
