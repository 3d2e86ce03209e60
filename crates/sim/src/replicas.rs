//! `ReplicaIo` over the simulated network: each request to a peer is a message that is
//! delayed (so requests reorder), may be lost on the way or on the way back (the write then
//! applied, but the owner only sees a timeout), and is refused by partitions; it is served
//! synchronously by the target node's real engine `Drive` (through its cache `Tier` when the
//! run has caches). A request to the owner's own node goes straight to its drive, as in the
//! daemon.
//!
//! A message in flight does not die with its sender: it is its own task, so a crashed or
//! deposed owner's last requests can still land afterwards (fencing must refuse them).

use crate::world::{Delivery, World};
use bytes::{Bytes, BytesMut};
use converge_engine::{EngineError, Tier};
use converge_types::{Epoch, ExtentKey, NodeId, Version};
use converge_volume::{BlocksReply, ExtentLoc, ReadReply, ReplicaError, ReplicaIo};
use std::sync::Arc;
use tokio::time::Instant;

/// One owner's path to every copy.
pub struct SimReplicas {
    pub(crate) world: Arc<World>,
    /// The node the owner runs on.
    pub(crate) from: NodeId,
}

fn engine_to_replica(e: EngineError) -> ReplicaError {
    match e {
        EngineError::StaleEpoch { .. } => ReplicaError::StaleEpoch(e.to_string()),
        EngineError::ChecksumMismatch { .. } => ReplicaError::Checksum(e.to_string()),
        EngineError::NoSpace { .. } => ReplicaError::NoSpace(e.to_string()),
        other => ReplicaError::Io(other.to_string()),
    }
}

impl SimReplicas {
    async fn call<T: Send + 'static>(
        &self,
        at: ExtentLoc,
        what: &'static str,
        op: impl FnOnce(&Tier) -> Result<T, EngineError> + Send + 'static,
    ) -> Result<T, ReplicaError> {
        let w = self.world.clone();
        let timeout = w.opts.rpc_timeout;
        let from = self.from;
        let r = if at.node == from {
            // Local drive: a little device latency, no network.
            tokio::time::sleep(w.us(5, 100)).await;
            match w.exec(at.node, at.drive, op) {
                Delivery::Done(r) => Some(r),
                Delivery::NoReply => {
                    // This very node lost power: the owner is dead too and is being
                    // aborted; never let it act on an answer.
                    tokio::time::sleep(timeout).await;
                    None
                }
            }
        } else {
            let deadline = Instant::now() + timeout;
            let (tx, rx) = tokio::sync::oneshot::channel();
            let to = at.node;
            let there = w.net_delay(to);
            let back = w.net_delay(to);
            let lose_request = w.drop_message(to);
            let lose_reply = !lose_request && w.drop_message(to);
            let w2 = w.clone();
            tokio::spawn(async move {
                tokio::time::sleep(there).await;
                if lose_request || !w2.reachable(from, to) {
                    w2.trace(|| format!("net: {what} n{from}->n{to} LOST on the way"));
                    return;
                }
                let inc = w2.incarnation(to);
                let r = match w2.exec(to, at.drive, op) {
                    Delivery::Done(r) => r,
                    Delivery::NoReply => return,
                };
                tokio::time::sleep(back).await;
                if lose_reply || !w2.reachable(from, to) || w2.incarnation(to) != inc {
                    w2.trace(|| {
                        format!(
                            "net: {what} n{from}->n{to} served ({}) but the reply was LOST",
                            if r.is_ok() { "ok" } else { "error" }
                        )
                    });
                    return;
                }
                let _ = tx.send(r);
            });
            match tokio::time::timeout_at(deadline, rx).await {
                Ok(Ok(r)) => Some(r),
                _ => {
                    tokio::time::sleep_until(deadline).await;
                    None
                }
            }
        };
        match r {
            Some(Ok(v)) => Ok(v),
            Some(Err(e)) => {
                if matches!(
                    e,
                    EngineError::InvalidIo { .. }
                        | EngineError::InvalidArgument(_)
                        | EngineError::Corrupt(_)
                ) {
                    w.fail(format!(
                        "engine on node {} drive {} refused a {what}: {e}",
                        at.node, at.drive
                    ));
                }
                Err(engine_to_replica(e))
            }
            None => Err(ReplicaError::Unreachable(format!(
                "node {} did not answer a {what} within {:?}",
                at.node, timeout
            ))),
        }
    }
}

impl ReplicaIo for SimReplicas {
    async fn write(
        &self,
        at: ExtentLoc,
        key: ExtentKey,
        epoch: Epoch,
        version: Version,
        offset: u64,
        crcs: Arc<[u32]>,
        data: Bytes,
    ) -> Result<(), ReplicaError> {
        self.call(at, "write", move |d| {
            d.write(key, epoch, version, offset, &data, &crcs)
        })
        .await
    }

    async fn read(
        &self,
        at: ExtentLoc,
        key: ExtentKey,
        epoch: Epoch,
        offset: u64,
        len: u32,
    ) -> Result<ReadReply, ReplicaError> {
        self.call(at, "read", move |d| {
            let mut buf = BytesMut::zeroed(len as usize);
            let info = d.read(key, epoch, offset, &mut buf)?;
            Ok(ReadReply {
                data: buf.freeze(),
                bad_blocks: info.bad_blocks,
                version: info.versions,
            })
        })
        .await
    }

    async fn zero(
        &self,
        at: ExtentLoc,
        key: ExtentKey,
        epoch: Epoch,
        version: Version,
        offset: u64,
        len: u64,
    ) -> Result<(), ReplicaError> {
        self.call(at, "zero", move |d| {
            d.zero(key, epoch, version, offset, len)
        })
        .await
    }

    async fn read_blocks(
        &self,
        at: ExtentLoc,
        key: ExtentKey,
        epoch: Epoch,
        offset: u64,
        len: u32,
    ) -> Result<BlocksReply, ReplicaError> {
        self.call(at, "read_blocks", move |d| {
            let mut buf = BytesMut::zeroed(len as usize);
            let mut versions = Vec::new();
            let info = d.read_blocks(key, epoch, offset, &mut buf, &mut versions)?;
            Ok(BlocksReply {
                data: buf.freeze(),
                bad_blocks: info.bad_blocks,
                versions,
            })
        })
        .await
    }

    async fn write_blocks(
        &self,
        at: ExtentLoc,
        key: ExtentKey,
        epoch: Epoch,
        offset: u64,
        crcs: Arc<[u32]>,
        versions: Vec<Version>,
        expect: Vec<Version>,
        data: Bytes,
    ) -> Result<u32, ReplicaError> {
        self.call(at, "write_blocks", move |d| {
            d.write_blocks(key, epoch, offset, &data, &crcs, &versions, &expect)
        })
        .await
    }

    async fn digest(
        &self,
        at: ExtentLoc,
        key: ExtentKey,
        epoch: Epoch,
    ) -> Result<u64, ReplicaError> {
        // As the daemon's handler: fence, then answer the version-map digest.
        self.call(at, "digest", move |d| d.fence_and_digest(key, epoch))
            .await
    }

    async fn versions(
        &self,
        at: ExtentLoc,
        key: ExtentKey,
        epoch: Epoch,
        offset: u64,
        count: u32,
    ) -> Result<Vec<Version>, ReplicaError> {
        // As the daemon's handler: fence, then answer the versions.
        self.call(at, "versions", move |d| {
            d.fence(key, epoch)?;
            d.block_versions(key, offset, count as usize)
        })
        .await
    }
}
