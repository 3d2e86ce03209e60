//! Carrying a failed capacity drive's logged blocks: destage cannot write them, and
//! dropping them would lose acked writes of a copy the cluster may still count in sync
//! (if the drive opens again at the node's restart, as after a transient failure). So each
//! time the log's tail reaches them they are logged again at its head, and the rest of the
//! cache goes on; the node's restart destages them (the drive opened) or drops them (it
//! was replaced: its copies are rebuilt elsewhere). Before this, the first destage step
//! that met one failed the whole cache drive, and every copy behind it was resynced.

use super::*;

impl Cache {
    /// Logs the blocks `carried` (live dirty blocks of failed capacity drives) again at the
    /// head of the log and waits until that is durable, so the tail may move past their old
    /// records. A block rewritten meanwhile keeps its newer record (`index_batch` never
    /// lets a logged version go down). Without room for them the cache fails, as every
    /// destage error does (the log would otherwise never move again).
    pub(super) fn carry(&self, carried: &[LiveBlock]) -> Result<(), EngineError> {
        if carried.is_empty() {
            return Ok(());
        }
        let mut data = AlignedBuf::new(carried.len() * BLOCK_SIZE);
        self.read_locs(carried.iter().map(|b| b.3), &mut data)?;
        let recs: Vec<Rec> = carried
            .iter()
            .map(|&(drive, key, block, _, version, crc)| Rec {
                kind: K_DIRTY,
                block,
                drive,
                key,
                version,
                crc,
            })
            .collect();
        match self.append(&recs, &data, Room::Skip)? {
            Some(seq) => self.wait_durable(seq)?,
            None => {
                let e = EngineError::Failed {
                    reason: format!(
                        "no room in the log to carry {} blocks of a failed capacity drive",
                        carried.len()
                    ),
                };
                self.fail(&e.to_string());
                return Err(e);
            }
        }
        self.extra
            .carried
            .fetch_add(carried.len() as u64, Ordering::Relaxed);
        Ok(())
    }
}
