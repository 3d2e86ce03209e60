//! What a changing operation still waits for before it may be acknowledged: its journal
//! batch becoming durable. Splitting an operation there lets a caller that must not park its
//! thread (an async task on a runtime worker) do the I/O inline and await durability, while
//! the blocking API (`Tier::write` and friends) simply waits in place.

use crate::drive::Drive;
use crate::error::EngineError;
use crate::stats::{OpKind, OpStart};
use std::sync::Arc;
use std::task::{Context, Poll};

/// An operation whose data is written and whose records are queued: it is durable (and may
/// be acknowledged) once its journal batch is. Waiting for it — [`Durable::wait`] on a
/// thread, [`Durable::poll_wait`] from a task — also closes the operation's counters;
/// dropping it unwaited closes them too (the operation then counts as ended unacked).
#[must_use = "an operation may be acknowledged only once its Durable has been waited for"]
pub struct Durable {
    wait: Option<Waiting>,
}

struct Waiting {
    drive: Arc<Drive>,
    seq: u64,
    op: OpKind,
    start: OpStart,
}

impl Durable {
    /// Nothing to wait for: the operation is already durable, or changed nothing.
    pub fn done() -> Durable {
        Durable { wait: None }
    }

    /// How many records the journal batch this waits for holds so far, while it is still
    /// open (0 once it is being written or durable). A task about to lead it can watch it
    /// grow: while other requests keep adding records, waiting a little longer makes one
    /// journal write and flush serve more of them.
    pub fn batch_records(&self) -> usize {
        self.wait
            .as_ref()
            .map_or(0, |w| w.drive.open_batch_records(w.seq))
    }

    /// Whether there is nothing to wait for.
    pub fn is_done(&self) -> bool {
        self.wait.is_none()
    }

    pub(crate) fn on(drive: Arc<Drive>, seq: u64, op: OpKind, start: OpStart) -> Durable {
        Durable {
            wait: Some(Waiting {
                drive,
                seq,
                op,
                start,
            }),
        }
    }

    /// Blocks until durable (leading the journal batch if nobody is).
    pub fn wait(mut self) -> Result<(), EngineError> {
        match self.wait.take() {
            None => Ok(()),
            Some(w) => {
                let r = w.drive.wait_durable(w.seq);
                w.drive.counters.end(w.op, w.start);
                r
            }
        }
    }

    /// `Ready` once durable; otherwise the task is woken when that may have changed. With
    /// `lead`, a task that finds the batch open and nobody writing it writes it itself, on
    /// its own thread: for drives whose journal write and flush take microseconds. Without,
    /// it waits for a leader: some waiter must lead (a blocked thread always does).
    pub fn poll_wait(&mut self, cx: &mut Context<'_>, lead: bool) -> Poll<Result<(), EngineError>> {
        let Some(w) = &self.wait else {
            return Poll::Ready(Ok(()));
        };
        match w.drive.poll_durable(w.seq, cx, lead) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(r) => {
                if let Some(w) = self.wait.take() {
                    w.drive.counters.end(w.op, w.start);
                }
                Poll::Ready(r)
            }
        }
    }
}

impl Drop for Durable {
    fn drop(&mut self) {
        if let Some(w) = self.wait.take() {
            w.drive.counters.end(w.op, w.start);
        }
    }
}

impl std::fmt::Debug for Durable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.wait {
            None => f.write_str("Durable(done)"),
            Some(w) => write!(f, "Durable(batch {})", w.seq),
        }
    }
}
