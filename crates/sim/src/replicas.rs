//! `ReplicaIo` over the simulated network: each request to a peer is a message that is
//! delayed (so requests reorder), may be lost on the way or on the way back (the write then
//! applied, but the owner only sees a timeout), and is refused by partitions; it is served
//! by the daemon's replica service on the target node's real engine `Drive` (through its
//! cache `Tier` when the run has caches), the way the daemon drives a RAM drive: the I/O
//! inline, then an async wait for the journal batch, which the request leads itself if
//! nobody is (`World::serve`). A request to the owner's own node goes straight to its
//! drive, as in the daemon.
//!
//! A message in flight does not die with its sender: it is its own task, so a crashed or
//! deposed owner's last requests can still land afterwards (fencing must refuse them).

use crate::world::{Delivery, World};
use converge_engine::EngineError;
use converge_replica::replica_error;
use converge_types::{ExtentOp, ExtentReply, NodeId};
use converge_volume::{ExtentLoc, ReplicaError, ReplicaIo};
use std::sync::Arc;
use tokio::time::Instant;

/// One owner's path to every copy.
pub struct SimReplicas {
    pub(crate) world: Arc<World>,
    /// The node the owner runs on.
    pub(crate) from: NodeId,
}

impl ReplicaIo for SimReplicas {
    /// Delivers `op` to the node of `at` (or runs it here, for the owner's own node), where
    /// the replica service runs it, and brings its answer back, with the network's delays,
    /// losses and partitions.
    async fn call(&self, at: ExtentLoc, op: ExtentOp) -> Result<ExtentReply, ReplicaError> {
        let what = op.name();
        // What was sent, for a refusal's report (not data: cloned only if it has none).
        let sent = (!op.stores_blocks() && !matches!(op, ExtentOp::WriteShadow { .. }))
            .then(|| op.clone());
        let w = self.world.clone();
        let timeout = w.opts.rpc_timeout;
        let from = self.from;
        let r = if at.node == from {
            // Local drive: a little device latency, no network.
            tokio::time::sleep(w.us(5, 100)).await;
            match w.serve(from, at.node, at.drive, op).await {
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
                let r = match w2.serve(from, to, at.drive, op).await {
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
                        "engine on node {} drive {} refused a {what} from node {from}: {e} ({sent:?})",
                        at.node, at.drive
                    ));
                }
                Err(replica_error(e))
            }
            None => Err(ReplicaError::Unreachable(format!(
                "node {} did not answer a {what} within {:?}",
                at.node, timeout
            ))),
        }
    }
}
