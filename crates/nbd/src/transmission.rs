//! Transmission phase: reads requests continuously, runs up to `inflight_max` of them
//! concurrently on the device, and writes their replies from one writer as they complete:
//! simple replies, or structured chunks (READ data, BLOCK_STATUS extents, errors with a
//! message) once the client negotiated structured replies.

use std::borrow::Cow;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use crate::dev::{BlockDev, DevError, Extent};
use crate::error::NbdError;
use crate::handshake::{discard, read_exact_or_eof, MetaContext, MetaKind, Negotiated};
use crate::proto::*;
use crate::server::{ServerConfig, ServerStats};

/// A WRITE refused with a payload up to this size has its payload skipped so the stream
/// stays in sync; beyond it the server replies and then hangs up.
pub(crate) const WRITE_DISCARD_MAX: u32 = 64 * 1024 * 1024;
/// The most a BLOCK_STATUS asks the device about: a request may cover up to 4 GiB − 1,
/// but the answer may describe a prefix only, and clients ask again from where it ended.
/// A power of two, so a clamped request stays aligned to any minimum block size.
pub(crate) const BLOCK_STATUS_LEN_MAX: u32 = 1 << 30;
/// The most descriptors one BLOCK_STATUS reply carries (512 KiB; the spec's bound is 2^20
/// per chunk), shared evenly among the selected contexts' chunks.
pub(crate) const BLOCK_STATUS_EXTENTS_MAX: usize = 1 << 16;

const _: () = assert!(BLOCK_STATUS_LEN_MAX.is_power_of_two() && BLOCK_STATUS_LEN_MAX >= 1 << 16);
const _: () = assert!(BLOCK_STATUS_EXTENTS_MAX <= 1 << 20);

/// A validated request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Read {
        offset: u64,
        len: u32,
    },
    Write {
        offset: u64,
        len: u32,
        fua: bool,
    },
    Flush,
    Trim {
        offset: u64,
        len: u32,
        fua: bool,
    },
    WriteZeroes {
        offset: u64,
        len: u32,
        fua: bool,
        may_trim: bool,
    },
    BlockStatus {
        offset: u64,
        len: u32,
        req_one: bool,
    },
    Disc,
}

/// What a request is checked against.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub size_bytes: u64,
    pub max_request_bytes: u32,
    /// 1 unless the client negotiated block sizes.
    pub align: u32,
    pub read_only: bool,
    /// Structured replies negotiated: READ may carry NBD_CMD_FLAG_DF.
    pub structured: bool,
    /// The client selected at least one metadata context for this export.
    pub meta_selected: bool,
}

/// Why a request is refused: the NBD error value and a message for the client (sent only
/// in structured error chunks; simple replies carry the number alone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub errno: u32,
    pub why: &'static str,
}

fn refuse(errno: u32, why: &'static str) -> Result<Op, Refusal> {
    Err(Refusal { errno, why })
}

/// Checks a request against the export; `Err` is the NBD error to reply with.
pub(crate) fn classify(req: &Request, lim: &Limits) -> Result<Op, Refusal> {
    let allowed = match req.typ {
        CMD_READ if lim.structured => CMD_FLAG_FUA | CMD_FLAG_DF,
        CMD_READ | CMD_WRITE | CMD_FLUSH | CMD_TRIM | CMD_DISC => CMD_FLAG_FUA,
        CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE,
        CMD_BLOCK_STATUS => CMD_FLAG_FUA | CMD_FLAG_REQ_ONE,
        _ => return refuse(EINVAL, "unknown command"),
    };
    if req.flags & !allowed != 0 {
        return refuse(EINVAL, "command flags not valid for this command");
    }
    let fua = req.flags & CMD_FLAG_FUA != 0;
    match req.typ {
        CMD_FLUSH => return Ok(Op::Flush),
        CMD_DISC => return Ok(Op::Disc),
        CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES if lim.read_only => {
            return refuse(EPERM, "the export is read-only")
        }
        CMD_BLOCK_STATUS if !lim.meta_selected => {
            return refuse(
                EINVAL,
                "no metadata context selected: NBD_OPT_SET_META_CONTEXT base:allocation for this export first",
            )
        }
        _ => {}
    }
    if req.len == 0 {
        return refuse(EINVAL, "zero-length request");
    }
    let is_write = matches!(req.typ, CMD_WRITE | CMD_WRITE_ZEROES);
    if matches!(req.typ, CMD_READ | CMD_WRITE) && req.len > lim.max_request_bytes {
        return refuse(EOVERFLOW, "request longer than the maximum block size");
    }
    let end = req.offset.checked_add(u64::from(req.len));
    match end {
        Some(end) if end <= lim.size_bytes => {
            let align = u64::from(lim.align.max(1));
            // The last block of an export whose size is not a multiple may end at the size.
            if !req.offset.is_multiple_of(align) || (end % align != 0 && end != lim.size_bytes) {
                return refuse(EINVAL, "request not aligned to the minimum block size");
            }
        }
        _ => {
            let errno = if is_write { ENOSPC } else { EINVAL };
            return refuse(errno, "request beyond the end of the export");
        }
    }
    let (offset, len) = (req.offset, req.len);
    Ok(match req.typ {
        CMD_READ => Op::Read { offset, len },
        CMD_WRITE => Op::Write { offset, len, fua },
        CMD_TRIM => Op::Trim { offset, len, fua },
        CMD_BLOCK_STATUS => Op::BlockStatus {
            offset,
            len,
            req_one: req.flags & CMD_FLAG_REQ_ONE != 0,
        },
        _ => Op::WriteZeroes {
            offset,
            len,
            fua,
            may_trim: req.flags & CMD_FLAG_NO_HOLE == 0,
        },
    })
}

/// How a request ended, before it is put in wire form.
#[derive(Debug)]
enum Outcome {
    /// Success without payload.
    Done,
    /// READ data from `offset`.
    Data { offset: u64, data: Bytes },
    /// BLOCK_STATUS: per selected context, in order, its id and descriptors (u32 length,
    /// u32 flags each); at least one context.
    Extents { chunks: Vec<(u32, Bytes)> },
    Error {
        errno: u32,
        message: Cow<'static, str>,
    },
}

/// Longest fixed part of a reply: a chunk header and the 8-byte offset of OFFSET_DATA.
const HEAD_MAX: usize = STRUCTURED_REPLY_LEN + 8;

/// A reply's header and fixed fields, kept inline: the variable part (read data, an error
/// message, descriptors) goes out after it from its own buffer, without a copy.
#[derive(Debug, Clone, Copy)]
struct Head {
    buf: [u8; HEAD_MAX],
    len: usize,
}

impl Head {
    fn new(parts: &[&[u8]]) -> Self {
        let mut h = Head {
            buf: [0; HEAD_MAX],
            len: 0,
        };
        for p in parts {
            h.buf[h.len..h.len + p.len()].copy_from_slice(p);
            h.len += p.len();
        }
        h
    }

    fn bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

/// One reply in wire form, waiting for the writer.
struct Reply {
    head: Head,
    data: Option<Bytes>,
    /// Counted in `ServerStats::errors`.
    error: bool,
    /// READ payload bytes, counted in `ServerStats::bytes_read`.
    read_bytes: u64,
    /// Released once the reply is on the wire, so replies waiting for a slow client count
    /// against `inflight_max` too.
    _permit: OwnedSemaphorePermit,
}

/// Cuts a message to the spec's string limit, on a character boundary.
fn cap_message(message: Cow<'static, str>) -> Bytes {
    if message.len() <= STRING_MAX {
        return Bytes::from(message.into_owned());
    }
    let mut end = STRING_MAX;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    Bytes::copy_from_slice(&message.as_bytes()[..end])
}

/// A BLOCK_STATUS chunk's header and context id.
const BLOCK_STATUS_HEAD_LEN: usize = STRUCTURED_REPLY_LEN + 4;

/// The header of a BLOCK_STATUS chunk and its context id, for `len` bytes of descriptors.
fn block_status_head(
    handle: u64,
    done: bool,
    context: u32,
    len: usize,
) -> [u8; BLOCK_STATUS_HEAD_LEN] {
    let flags = if done { REPLY_FLAG_DONE } else { 0 };
    let len = u32::try_from(4 + len).expect("descriptors are capped");
    let chunk = structured_reply(flags, REPLY_TYPE_BLOCK_STATUS, handle, len);
    let mut h = [0u8; BLOCK_STATUS_HEAD_LEN];
    h[..STRUCTURED_REPLY_LEN].copy_from_slice(&chunk);
    h[STRUCTURED_REPLY_LEN..].copy_from_slice(&context.to_be_bytes());
    h
}

/// Puts `outcome` in wire form: simple replies unless `structured`; with structured
/// replies, READ data goes out as one chunk flagged DONE (never fragmented, so
/// NBD_CMD_FLAG_DF always holds), BLOCK_STATUS as one chunk per context with DONE on the
/// last, errors as NBD_REPLY_TYPE_ERROR with a message, and payload-less successes as
/// simple replies (the spec allows both).
fn encode(handle: u64, structured: bool, outcome: Outcome, permit: OwnedSemaphorePermit) -> Reply {
    let reply = |head, data, error, read_bytes| Reply {
        head,
        data,
        error,
        read_bytes,
        _permit: permit,
    };
    match outcome {
        Outcome::Done => reply(Head::new(&[&simple_reply(0, handle)]), None, false, 0),
        Outcome::Data { offset, data } => {
            let n = data.len() as u64;
            let head = if structured {
                // Reads are at most max_request_bytes (≤ 64 MiB), so this fits.
                let len = u32::try_from(8 + data.len()).expect("read payload under 4 GiB");
                let chunk = structured_reply(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, handle, len);
                Head::new(&[&chunk, &offset.to_be_bytes()])
            } else {
                Head::new(&[&simple_reply(0, handle)])
            };
            reply(head, Some(data), false, n)
        }
        Outcome::Extents { chunks } => {
            debug_assert!(
                structured,
                "BLOCK_STATUS is refused without structured replies"
            );
            debug_assert!(
                chunks
                    .iter()
                    .all(|(_, d)| !d.is_empty() && d.len() % BLOCK_DESCRIPTOR_LEN == 0),
                "at least one whole descriptor per chunk"
            );
            let Some(((context, descriptors), rest)) = chunks.split_first() else {
                debug_assert!(false, "BLOCK_STATUS answers at least one context");
                let head = Head::new(&[&simple_reply(EIO, handle)]);
                return reply(head, None, true, 0);
            };
            let head = Head::new(&[&block_status_head(
                handle,
                rest.is_empty(),
                *context,
                descriptors.len(),
            )]);
            if rest.is_empty() {
                return reply(head, Some(descriptors.clone()), false, 0);
            }
            // Several contexts: the first chunk's header goes inline, the rest of the
            // reply (its descriptors, then each further chunk) in one buffer.
            let total = descriptors.len()
                + rest
                    .iter()
                    .map(|(_, d)| BLOCK_STATUS_HEAD_LEN + d.len())
                    .sum::<usize>();
            let mut data = Vec::with_capacity(total);
            data.extend_from_slice(descriptors);
            for (i, (context, descriptors)) in rest.iter().enumerate() {
                let done = i + 1 == rest.len();
                data.extend_from_slice(&block_status_head(
                    handle,
                    done,
                    *context,
                    descriptors.len(),
                ));
                data.extend_from_slice(descriptors);
            }
            reply(head, Some(Bytes::from(data)), false, 0)
        }
        Outcome::Error { errno, message } => {
            debug_assert_ne!(errno, 0, "an error reply carries an error");
            let errno = if errno == 0 { EIO } else { errno };
            if !structured {
                return reply(Head::new(&[&simple_reply(errno, handle)]), None, true, 0);
            }
            let message = cap_message(message);
            // At most STRING_MAX (4096) bytes, so both lengths fit.
            let mlen = message.len() as u16;
            let len = 6 + u32::from(mlen);
            let chunk = structured_reply(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, handle, len);
            let head = Head::new(&[&chunk, &errno.to_be_bytes(), &mlen.to_be_bytes()]);
            let data = (!message.is_empty()).then_some(message);
            reply(head, data, true, 0)
        }
    }
}

/// One request's right to reply. Dropping it unanswered (a device future panicked)
/// still replies EIO, so the client never waits forever on a handle.
struct Slot {
    tx: mpsc::Sender<Reply>,
    handle: u64,
    structured: bool,
    permit: Option<OwnedSemaphorePermit>,
}

impl Slot {
    fn finish(mut self, outcome: Outcome) {
        self.send(outcome);
    }

    fn send(&mut self, outcome: Outcome) {
        if let Some(permit) = self.permit.take() {
            // Never full: the channel holds as many slots as there are permits, and
            // every queued reply carries one.
            let _ = self
                .tx
                .try_send(encode(self.handle, self.structured, outcome, permit));
        }
    }

    /// Gives the permit back without replying (NBD_CMD_DISC has no reply).
    fn permit_free(mut self) -> Option<OwnedSemaphorePermit> {
        self.permit.take()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.permit.is_some() {
            log::error!(
                "nbd: request {:#x} ended without a reply; sending EIO",
                self.handle
            );
            self.send(Outcome::Error {
                errno: EIO,
                message: "the request failed inside the server".into(),
            });
        }
    }
}

fn dev_error(op: &str, e: &DevError) -> Outcome {
    log::warn!("nbd: {op} failed: {e}");
    Outcome::Error {
        errno: e.nbd_errno(),
        message: format!("{op} failed: {}", e.message).into(),
    }
}

/// A device's answer for a log line: its first runs only, however many it sent.
fn runs_for_log(runs: &[Extent]) -> String {
    const SHOWN: usize = 4;
    let head = &runs[..runs.len().min(SHOWN)];
    if runs.len() > SHOWN {
        format!("{head:?} and {} more runs", runs.len() - SHOWN)
    } else {
        format!("{head:?}")
    }
}

/// Turns a device's answer for context `kind` over `[offset, offset + asked)` into
/// descriptors that keep the spec's rules whatever the device did: zero-length runs
/// dropped, runs past the range cut off, flag bits the context does not define cleared,
/// neighbours with the same flags merged, at most `max` descriptors. `None` if nothing is
/// left to send.
fn descriptors(runs: &[Extent], asked: u32, max: usize, kind: &MetaKind) -> Option<Bytes> {
    debug_assert!(max >= 1);
    let mut out: Vec<Extent> = Vec::with_capacity(runs.len().min(max));
    let mut left = asked;
    let mut bent = false;
    for run in runs {
        if left == 0 {
            bent = true;
            break;
        }
        if run.length == 0 {
            bent = true;
            continue;
        }
        let length = run.length.min(left);
        let flags = run.flags & kind.flags_defined();
        bent |= length != run.length || flags != run.flags;
        if let Some(last) = out.last_mut().filter(|l| l.flags == flags) {
            // No overflow: the lengths sum to at most `asked`.
            last.length += length;
        } else if out.len() == max {
            break;
        } else {
            out.push(Extent { length, flags });
        }
        left -= length;
    }
    if bent {
        log::warn!(
            "nbd: device status of {kind} for {asked} bytes broke the rules (fixed up): {}",
            runs_for_log(runs)
        );
    }
    if out.is_empty() {
        return None;
    }
    let mut b = Vec::with_capacity(out.len() * BLOCK_DESCRIPTOR_LEN);
    for e in &out {
        b.extend_from_slice(&e.length.to_be_bytes());
        b.extend_from_slice(&e.flags.to_be_bytes());
    }
    Some(Bytes::from(b))
}

/// What a context's device errors are called in messages: "block status" as ever for
/// `base:allocation`, naming the context for the others.
fn status_op(kind: &MetaKind) -> Cow<'static, str> {
    match kind {
        MetaKind::Allocation => "block status".into(),
        MetaKind::DirtyBitmap(_) => format!("block status of {kind}").into(),
    }
}

/// NBD_CMD_BLOCK_STATUS: asks the device about every selected context first, then answers
/// with one chunk per context, or with the first failure alone (so no chunk of a reply
/// that ends in an error ever goes out). With REQ_ONE one descriptor per context.
async fn block_status<D: BlockDev>(
    dev: &D,
    contexts: &[MetaContext],
    offset: u64,
    len: u32,
    req_one: bool,
) -> Outcome {
    let asked = len.min(BLOCK_STATUS_LEN_MAX);
    let max = if req_one {
        1
    } else {
        (BLOCK_STATUS_EXTENTS_MAX / contexts.len().max(1)).max(1)
    };
    let mut chunks = Vec::with_capacity(contexts.len());
    for c in contexts {
        let answer = match &c.kind {
            MetaKind::Allocation => dev.block_status(offset, asked).await,
            MetaKind::DirtyBitmap(name) => dev.dirty_status(name, offset, asked).await,
        };
        let runs = match answer {
            Ok(runs) => runs,
            Err(e) => return dev_error(&status_op(&c.kind), &e),
        };
        let Some(descriptors) = descriptors(&runs, asked, max, &c.kind) else {
            log::error!(
                "nbd: device returned no usable extent for {} at {offset}+{asked}: {}",
                c.kind,
                runs_for_log(&runs)
            );
            return Outcome::Error {
                errno: EIO,
                message: format!(
                    "{} failed: the device described no extent",
                    status_op(&c.kind)
                )
                .into(),
            };
        };
        chunks.push((c.id, descriptors));
    }
    if chunks.is_empty() {
        // classify refuses BLOCK_STATUS without a context; never reached.
        return Outcome::Error {
            errno: EINVAL,
            message: "no metadata context selected".into(),
        };
    }
    Outcome::Extents { chunks }
}

async fn execute<D: BlockDev>(
    dev: &D,
    op: Op,
    payload: Bytes,
    contexts: &[MetaContext],
) -> Outcome {
    match op {
        Op::Read { offset, len } => match dev.read(offset, len).await {
            Err(e) => dev_error("read", &e),
            Ok(data) if data.len() != len as usize => {
                log::error!(
                    "nbd: device returned {} bytes for a {len}-byte read at {offset}",
                    data.len()
                );
                Outcome::Error {
                    errno: EIO,
                    message: "read failed: the device returned a wrong length".into(),
                }
            }
            Ok(data) => Outcome::Data { offset, data },
        },
        Op::Write { offset, fua, .. } => match dev.write(offset, payload, fua).await {
            Err(e) => dev_error("write", &e),
            Ok(()) => Outcome::Done,
        },
        Op::Flush => match dev.flush().await {
            Err(e) => dev_error("flush", &e),
            Ok(()) => Outcome::Done,
        },
        Op::Trim { offset, len, fua } => {
            if let Err(e) = dev.trim(offset, len).await {
                return dev_error("trim", &e);
            }
            if fua {
                if let Err(e) = dev.flush().await {
                    return dev_error("flush", &e);
                }
            }
            Outcome::Done
        }
        Op::WriteZeroes {
            offset,
            len,
            fua,
            may_trim,
        } => {
            if let Err(e) = dev.write_zeroes(offset, len, may_trim).await {
                return dev_error("write_zeroes", &e);
            }
            if fua {
                if let Err(e) = dev.flush().await {
                    return dev_error("flush", &e);
                }
            }
            Outcome::Done
        }
        Op::BlockStatus {
            offset,
            len,
            req_one,
        } => block_status(dev, contexts, offset, len, req_one).await,
        Op::Disc => Outcome::Done,
    }
}

/// How the request reader stopped.
enum ReaderEnd {
    Disc,
    Closed,
    OversizedPayload(u32),
}

async fn read_requests<D, Rd>(
    rd: &mut Rd,
    dev: &Arc<D>,
    contexts: &Arc<[MetaContext]>,
    session: Limits,
    cfg: &ServerConfig,
    tx: mpsc::Sender<Reply>,
    permits: Arc<Semaphore>,
) -> Result<ReaderEnd, NbdError>
where
    D: BlockDev,
    Rd: AsyncRead + Unpin,
{
    let stats: &ServerStats = &cfg.stats;
    loop {
        let mut hdr = [0u8; REQUEST_LEN];
        if !read_exact_or_eof(rd, &mut hdr).await? {
            return Ok(ReaderEnd::Closed);
        }
        let req = Request::decode(&hdr).map_err(|got| NbdError::BadMagic {
            phase: "transmission",
            got: u64::from(got),
        })?;
        stats.requests.fetch_add(1, Ordering::Relaxed);
        let lim = Limits {
            size_bytes: dev.size_bytes(),
            ..session
        };
        let permit = permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| NbdError::Truncated)?;
        let slot = Slot {
            tx: tx.clone(),
            handle: req.handle,
            structured: session.structured,
            permit: Some(permit),
        };
        let op = match classify(&req, &lim) {
            Ok(op) => op,
            Err(refusal) => {
                log::debug!("nbd: rejecting {req:?}: {refusal:?}");
                // Consume a refused WRITE's payload before replying: a client may not
                // expect the reply to a command it is still sending (libnbd drops the
                // connection if it comes early).
                if req.typ == CMD_WRITE && req.len <= WRITE_DISCARD_MAX {
                    discard(rd, u64::from(req.len)).await?;
                }
                slot.finish(Outcome::Error {
                    errno: refusal.errno,
                    message: refusal.why.into(),
                });
                if req.typ == CMD_WRITE && req.len > WRITE_DISCARD_MAX {
                    return Ok(ReaderEnd::OversizedPayload(req.len));
                }
                continue;
            }
        };
        let payload = match op {
            Op::Disc => {
                drop(slot.permit_free());
                return Ok(ReaderEnd::Disc);
            }
            Op::Write { len, .. } => {
                let mut buf = BytesMut::with_capacity(len as usize);
                let mut take = (&mut *rd).take(u64::from(len));
                while buf.len() < len as usize {
                    if take.read_buf(&mut buf).await? == 0 {
                        return Err(NbdError::Truncated);
                    }
                }
                stats
                    .bytes_written
                    .fetch_add(u64::from(len), Ordering::Relaxed);
                buf.freeze()
            }
            _ => Bytes::new(),
        };
        let dev = Arc::clone(dev);
        // Only BLOCK_STATUS reads the selected contexts.
        let contexts = matches!(op, Op::BlockStatus { .. }).then(|| Arc::clone(contexts));
        let request = async move {
            let contexts = contexts.as_deref().unwrap_or_default();
            slot.finish(execute(&*dev, op, payload, contexts).await);
        };
        if matches!(op, Op::Read { .. }) {
            // A read often completes without waiting (a drive in RAM, read inline): run it
            // here until it first waits, and give it a task of its own only then. Its
            // first poll's waker is a no-op; the task's own first poll registers the real
            // one, and every future checks its state again when polled, so no wake-up is
            // lost in between.
            // A device that panics costs this request (its slot answers EIO when the
            // future is dropped), never the connection, as in a task of its own.
            let mut request = Box::pin(request);
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                std::future::Future::poll(request.as_mut(), &mut cx)
            }));
            match polled {
                Ok(std::task::Poll::Pending) => {
                    tokio::spawn(request);
                }
                Ok(std::task::Poll::Ready(())) => {}
                Err(_) => log::error!("nbd: a read request panicked; answering EIO"),
            }
        } else {
            // Boxed first: the request's future is several KiB (the volume's whole write
            // path), and a task stores its future inline, so spawning it unboxed copies it
            // into the task and copies the task's stage again when it finishes.
            tokio::spawn(Box::pin(request));
        }
    }
}

async fn write_replies<Wr: AsyncWrite + Unpin>(
    wr: &mut Wr,
    mut rx: mpsc::Receiver<Reply>,
    stats: &ServerStats,
    permits: Arc<Semaphore>,
    inflight_max: usize,
) -> Result<(), NbdError> {
    let mut batch: Vec<Reply> = Vec::with_capacity(inflight_max);
    while let Some(first) = rx.recv().await {
        batch.push(first);
        // Batch whatever is already queued into one write; then, if requests are still
        // executing (each holds a permit until its reply is written, the replies in hand
        // included), let the tasks the runtime has ready run once (often the rest of a
        // burst, about to reply) and take theirs too: a burst of replies then costs one
        // write, not one per reply. Alone (QD 1), write at once.
        while let Ok(r) = rx.try_recv() {
            batch.push(r);
        }
        if inflight_max - permits.available_permits() > batch.len() {
            tokio::task::yield_now().await;
            while let Ok(r) = rx.try_recv() {
                batch.push(r);
            }
        }
        for r in &batch {
            if r.error {
                stats.errors.fetch_add(1, Ordering::Relaxed);
            }
            stats.bytes_read.fetch_add(r.read_bytes, Ordering::Relaxed);
        }
        write_batch(wr, &batch).await?;
        // Dropping the replies gives their permits back.
        batch.clear();
    }
    wr.flush().await?;
    wr.shutdown().await?;
    Ok(())
}

/// Most slices one vectored write takes (well under Linux's IOV_MAX).
const WRITE_SLICES_MAX: usize = 64;

/// Writes each reply's head and then its data, in order, with as few vectored writes as
/// the socket allows: read data goes to the socket from the buffer the drive read it into,
/// without a copy.
async fn write_batch<Wr: AsyncWrite + Unpin>(
    wr: &mut Wr,
    replies: &[Reply],
) -> std::io::Result<()> {
    // The chunks, in order: chunk 2i is reply i's head, chunk 2i + 1 its data (if any).
    let chunk = |k: usize| -> &[u8] {
        let r = &replies[k / 2];
        if k.is_multiple_of(2) {
            r.head.bytes()
        } else {
            r.data.as_deref().unwrap_or(&[])
        }
    };
    let chunks = 2 * replies.len();
    let (mut at, mut off) = (0, 0);
    while at < chunks {
        let mut slices = [std::io::IoSlice::new(&[]); WRITE_SLICES_MAX];
        let mut n = 0;
        let mut k = at;
        while n < WRITE_SLICES_MAX && k < chunks {
            let c = if k == at { &chunk(k)[off..] } else { chunk(k) };
            if !c.is_empty() {
                slices[n] = std::io::IoSlice::new(c);
                n += 1;
            }
            k += 1;
        }
        if n == 0 {
            break;
        }
        let mut written = wr.write_vectored(&slices[..n]).await?;
        if written == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::WriteZero,
                "the client's socket accepted no bytes",
            ));
        }
        while at < chunks {
            let left = chunk(at).len() - off;
            if written < left {
                off += written;
                break;
            }
            written -= left;
            at += 1;
            off = 0;
        }
    }
    wr.flush().await
}

/// Serves requests until the client disconnects; in-flight requests finish and are
/// answered before a clean return.
pub(crate) async fn run<D, Rd, Wr>(
    rd: &mut Rd,
    wr: &mut Wr,
    neg: Negotiated<D>,
    cfg: &ServerConfig,
) -> Result<(), NbdError>
where
    D: BlockDev,
    Rd: AsyncRead + Unpin,
    Wr: AsyncWrite + Unpin,
{
    let session = Limits {
        size_bytes: neg.dev.size_bytes(),
        max_request_bytes: cfg.max_request_bytes,
        align: if neg.block_size_negotiated {
            cfg.min_block
        } else {
            1
        },
        read_only: cfg.read_only || neg.dev.read_only(),
        structured: neg.structured,
        meta_selected: !neg.meta_contexts.is_empty(),
    };
    let permits = Arc::new(Semaphore::new(cfg.inflight_max));
    let (tx, rx) = mpsc::channel(cfg.inflight_max);
    let writer_permits = permits.clone();
    let reader = async {
        let end =
            read_requests(rd, &neg.dev, &neg.meta_contexts, session, cfg, tx, permits).await?;
        match end {
            ReaderEnd::Disc => log::debug!("nbd: export {}: client sent DISC", neg.name),
            ReaderEnd::Closed => log::debug!("nbd: export {}: client closed", neg.name),
            ReaderEnd::OversizedPayload(len) => log::warn!(
                "nbd: export {}: refused a {len}-byte write; too large to skip, disconnecting",
                neg.name
            ),
        }
        Ok::<(), NbdError>(())
    };
    let writer = write_replies(wr, rx, &cfg.stats, writer_permits, cfg.inflight_max);
    tokio::try_join!(reader, writer)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lim(align: u32) -> Limits {
        Limits {
            size_bytes: 1 << 20,
            max_request_bytes: 64 * 1024,
            align,
            read_only: false,
            structured: false,
            meta_selected: false,
        }
    }

    /// `classify` with only the error number of a refusal.
    fn classify(req: &Request, lim: &Limits) -> Result<Op, u32> {
        super::classify(req, lim).map_err(|r| r.errno)
    }

    fn req(typ: u16, flags: u16, offset: u64, len: u32) -> Request {
        Request {
            flags,
            typ,
            handle: 1,
            offset,
            len,
        }
    }

    #[test]
    fn classify_ranges_and_lengths() {
        let l = lim(1);
        assert_eq!(
            classify(&req(CMD_READ, 0, 0, 4096), &l),
            Ok(Op::Read {
                offset: 0,
                len: 4096
            })
        );
        assert_eq!(
            classify(&req(CMD_READ, 0, (1 << 20) - 1, 2), &l),
            Err(EINVAL)
        );
        assert_eq!(
            classify(&req(CMD_WRITE, 0, (1 << 20) - 1, 2), &l),
            Err(ENOSPC)
        );
        assert_eq!(
            classify(&req(CMD_WRITE_ZEROES, 0, 1 << 20, 1), &l),
            Err(ENOSPC)
        );
        assert_eq!(classify(&req(CMD_TRIM, 0, 1 << 20, 1), &l), Err(EINVAL));
        assert_eq!(classify(&req(CMD_READ, 0, u64::MAX, 1), &l), Err(EINVAL));
        assert_eq!(classify(&req(CMD_READ, 0, 0, 0), &l), Err(EINVAL));
        assert_eq!(
            classify(&req(CMD_WRITE, 0, 0, 64 * 1024 + 1), &l),
            Err(EOVERFLOW)
        );
        // Trim/zero carry no payload, so max_request_bytes does not bound them.
        assert!(classify(&req(CMD_TRIM, 0, 0, 1 << 20), &l).is_ok());
        assert_eq!(classify(&req(CMD_FLUSH, 0, 0, 0), &l), Ok(Op::Flush));
    }

    #[test]
    fn classify_flags_commands_and_read_only() {
        let l = lim(1);
        assert_eq!(classify(&req(9, 0, 0, 1), &l), Err(EINVAL));
        assert_eq!(classify(&req(CMD_READ, 1 << 2, 0, 1), &l), Err(EINVAL));
        assert_eq!(
            classify(&req(CMD_WRITE, CMD_FLAG_NO_HOLE, 0, 1), &l),
            Err(EINVAL)
        );
        assert_eq!(
            classify(
                &req(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE | CMD_FLAG_FUA, 0, 8),
                &l
            ),
            Ok(Op::WriteZeroes {
                offset: 0,
                len: 8,
                fua: true,
                may_trim: false
            })
        );
        let ro = Limits {
            read_only: true,
            ..l
        };
        assert_eq!(classify(&req(CMD_WRITE, 0, 0, 1), &ro), Err(EPERM));
        assert_eq!(classify(&req(CMD_TRIM, 0, 0, 1), &ro), Err(EPERM));
        assert!(classify(&req(CMD_READ, 0, 0, 1), &ro).is_ok());
    }

    /// Accepts at most 7 bytes per (vectored) write, to exercise partial writes.
    struct Trickle(Vec<u8>);

    impl AsyncWrite for Trickle {
        fn poll_write(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            let n = buf.len().min(7);
            self.0.extend_from_slice(&buf[..n]);
            std::task::Poll::Ready(Ok(n))
        }
        fn poll_write_vectored(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            bufs: &[std::io::IoSlice<'_>],
        ) -> std::task::Poll<std::io::Result<usize>> {
            let mut n = 0;
            for b in bufs {
                let take = b.len().min(7 - n);
                self.0.extend_from_slice(&b[..take]);
                n += take;
                if n == 7 {
                    break;
                }
            }
            std::task::Poll::Ready(Ok(n))
        }
        fn is_write_vectored(&self) -> bool {
            true
        }
        fn poll_flush(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
        fn poll_shutdown(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
    }

    /// Replies written in pieces arrive whole and in order: each head, then its data.
    #[tokio::test]
    async fn a_batch_of_replies_survives_partial_writes() {
        let sem = Arc::new(Semaphore::new(200));
        let mut replies = Vec::new();
        let mut want = Vec::new();
        for i in 0..150u64 {
            let structured = i % 2 == 0;
            let outcome = match i % 5 {
                0 => Outcome::Error {
                    errno: EIO,
                    message: format!("failure {i}").into(),
                },
                1 => Outcome::Done,
                2 => Outcome::Extents {
                    chunks: vec![(7, Bytes::from(vec![i as u8; 8 * (1 + i as usize % 4)]))],
                },
                _ => Outcome::Data {
                    offset: i * 512,
                    data: Bytes::from(vec![i as u8; (i as usize * 37) % 5000]),
                },
            };
            // What the reply must look like, built independently of `encode`.
            let (head, data): (Vec<u8>, Vec<u8>) = match &outcome {
                Outcome::Done => (simple_reply(0, i).to_vec(), vec![]),
                Outcome::Error { .. } if !structured => (simple_reply(EIO, i).to_vec(), vec![]),
                Outcome::Error { message, .. } => {
                    let m = message.as_bytes();
                    let mut h =
                        structured_reply(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, i, 6 + m.len() as u32)
                            .to_vec();
                    h.extend_from_slice(&EIO.to_be_bytes());
                    h.extend_from_slice(&(m.len() as u16).to_be_bytes());
                    (h, m.to_vec())
                }
                Outcome::Extents { chunks } if structured => {
                    let descriptors = &chunks[0].1;
                    let mut h = structured_reply(
                        REPLY_FLAG_DONE,
                        REPLY_TYPE_BLOCK_STATUS,
                        i,
                        4 + descriptors.len() as u32,
                    )
                    .to_vec();
                    h.extend_from_slice(&7u32.to_be_bytes());
                    (h, descriptors.to_vec())
                }
                // Never sent without structured replies; stands in for a plain reply here.
                Outcome::Extents { .. } => continue,
                Outcome::Data { data, .. } if !structured => {
                    (simple_reply(0, i).to_vec(), data.to_vec())
                }
                Outcome::Data { offset, data } => {
                    let mut h = structured_reply(
                        REPLY_FLAG_DONE,
                        REPLY_TYPE_OFFSET_DATA,
                        i,
                        8 + data.len() as u32,
                    )
                    .to_vec();
                    h.extend_from_slice(&offset.to_be_bytes());
                    (h, data.to_vec())
                }
            };
            want.extend_from_slice(&head);
            want.extend_from_slice(&data);
            replies.push(encode(
                i,
                structured,
                outcome,
                sem.clone().try_acquire_owned().unwrap(),
            ));
        }
        let mut out = Trickle(Vec::new());
        write_batch(&mut out, &replies).await.unwrap();
        assert_eq!(out.0.len(), want.len());
        assert!(out.0 == want, "bytes differ");
    }

    fn ext(length: u32, flags: u32) -> Extent {
        Extent { length, flags }
    }

    fn decoded(b: Option<Bytes>) -> Option<Vec<Extent>> {
        let b = b?;
        assert_eq!(b.len() % 8, 0);
        Some(
            b.chunks_exact(8)
                .map(|c| {
                    ext(
                        u32::from_be_bytes(c[0..4].try_into().unwrap()),
                        u32::from_be_bytes(c[4..8].try_into().unwrap()),
                    )
                })
                .collect(),
        )
    }

    /// Whatever a device answers, what goes on the wire keeps the spec's rules.
    #[test]
    fn device_extents_are_checked_trimmed_and_merged() {
        let d = |runs: &[Extent], asked, max| {
            decoded(descriptors(runs, asked, max, &MetaKind::Allocation))
        };
        let (h, z, hz) = (STATE_HOLE, STATE_ZERO, STATE_HOLE | STATE_ZERO);
        // A good answer passes unchanged.
        assert_eq!(
            d(&[ext(4096, hz), ext(8192, 0)], 16384, 100),
            Some(vec![ext(4096, hz), ext(8192, 0)])
        );
        // Nothing, or only zero-length runs: nothing to send (the caller answers EIO).
        assert_eq!(d(&[], 4096, 100), None);
        assert_eq!(d(&[ext(0, 0), ext(0, z)], 4096, 100), None);
        // Zero-length runs dropped; the neighbours then merge.
        assert_eq!(
            d(&[ext(512, z), ext(0, 0), ext(512, z)], 4096, 100),
            Some(vec![ext(1024, z)])
        );
        // Runs past the range are cut at its end.
        assert_eq!(
            d(&[ext(1000, 0), ext(5000, h), ext(77, z)], 4096, 100),
            Some(vec![ext(1000, 0), ext(3096, h)])
        );
        assert_eq!(d(&[ext(u32::MAX, 0)], 4096, 100), Some(vec![ext(4096, 0)]));
        // Reserved flag bits are cleared.
        assert_eq!(
            d(&[ext(4096, 0xffff_fff0 | z)], 4096, 100),
            Some(vec![ext(4096, z)])
        );
        // At most `max` descriptors: REQ_ONE gets the first run (merged with equal ones).
        let alternating: Vec<Extent> = (0..10)
            .map(|i| ext(512, if i % 2 == 0 { 0 } else { hz }))
            .collect();
        assert_eq!(d(&alternating, 5120, 1), Some(vec![ext(512, 0)]));
        assert_eq!(
            d(&alternating, 5120, 3),
            Some(vec![ext(512, 0), ext(512, hz), ext(512, 0)])
        );
        assert_eq!(
            d(&[ext(512, z), ext(512, z), ext(512, 0)], 5120, 1),
            Some(vec![ext(1024, z)])
        );
        // Merging never overflows: the sum is bounded by the range asked for.
        assert_eq!(
            d(&[ext(u32::MAX - 1, 0), ext(5, 0)], u32::MAX, 10),
            Some(vec![ext(u32::MAX, 0)])
        );
    }

    /// A dirty bitmap defines bit 0 only: the others are cleared, and runs that then agree
    /// merge.
    #[test]
    fn dirty_bitmap_extents_keep_only_the_dirty_bit() {
        let kind = MetaKind::DirtyBitmap("snap1".to_owned());
        let d = |runs: &[Extent], asked, max| decoded(descriptors(runs, asked, max, &kind));
        assert_eq!(
            d(
                &[ext(4096, STATE_DIRTY | 0xffff_fff0 | STATE_ZERO)],
                4096,
                100
            ),
            Some(vec![ext(4096, STATE_DIRTY)])
        );
        assert_eq!(
            d(&[ext(100, STATE_ZERO), ext(100, 0), ext(100, 1)], 4096, 100),
            Some(vec![ext(200, 0), ext(100, STATE_DIRTY)])
        );
        // The same answer for base:allocation keeps ZERO.
        assert_eq!(
            decoded(descriptors(
                &[ext(100, STATE_ZERO), ext(100, 0)],
                4096,
                100,
                &MetaKind::Allocation
            )),
            Some(vec![ext(100, STATE_ZERO), ext(100, 0)])
        );
    }

    /// Several contexts: one BLOCK_STATUS chunk each, in order, DONE on the last only.
    #[tokio::test]
    async fn block_status_for_several_contexts_is_one_chunk_each() {
        let sem = Arc::new(Semaphore::new(1));
        let chunks: Vec<(u32, Bytes)> = vec![
            (1, Bytes::from(vec![1u8; 16])),
            (2, Bytes::from(vec![2u8; 8])),
            (3, Bytes::from(vec![3u8; 24])),
        ];
        let mut want = Vec::new();
        for (i, (id, d)) in chunks.iter().enumerate() {
            let flags = if i == 2 { REPLY_FLAG_DONE } else { 0 };
            let len = 4 + d.len() as u32;
            want.extend_from_slice(&structured_reply(flags, REPLY_TYPE_BLOCK_STATUS, 0x77, len));
            want.extend_from_slice(&id.to_be_bytes());
            want.extend_from_slice(d);
        }
        let r = encode(
            0x77,
            true,
            Outcome::Extents { chunks },
            sem.try_acquire_owned().unwrap(),
        );
        assert!(!r.error);
        let mut out = Trickle(Vec::new());
        write_batch(&mut out, &[r]).await.unwrap();
        assert_eq!(out.0, want);
    }

    #[test]
    fn classify_block_status_and_df() {
        let with_ctx = Limits {
            structured: true,
            meta_selected: true,
            ..lim(1)
        };
        let bs = |flags, offset, len, l: &Limits| {
            classify(&req(CMD_BLOCK_STATUS, flags, offset, len), l)
        };
        // No context selected (or no structured replies at all): EINVAL.
        assert_eq!(bs(0, 0, 4096, &lim(1)), Err(EINVAL));
        assert_eq!(
            bs(
                0,
                0,
                4096,
                &Limits {
                    structured: true,
                    ..lim(1)
                }
            ),
            Err(EINVAL)
        );
        assert_eq!(
            bs(CMD_FLAG_REQ_ONE, 4096, 8192, &with_ctx),
            Ok(Op::BlockStatus {
                offset: 4096,
                len: 8192,
                req_one: true,
            })
        );
        // Longer than max_request_bytes is fine (no payload); beyond the end is not.
        assert!(bs(0, 0, 1 << 20, &with_ctx).is_ok());
        assert_eq!(bs(0, 4096, 1 << 20, &with_ctx), Err(EINVAL));
        assert_eq!(bs(0, 0, 0, &with_ctx), Err(EINVAL));
        assert_eq!(bs(CMD_FLAG_DF, 0, 4096, &with_ctx), Err(EINVAL));
        // Read-only exports answer block status too.
        assert!(bs(
            0,
            0,
            4096,
            &Limits {
                read_only: true,
                ..with_ctx
            }
        )
        .is_ok());
        assert_eq!(
            bs(
                0,
                512,
                4096,
                &Limits {
                    align: 4096,
                    ..with_ctx
                }
            ),
            Err(EINVAL)
        );
        // DF on READ only once structured replies are negotiated; REQ_ONE never on READ.
        assert_eq!(
            classify(&req(CMD_READ, CMD_FLAG_DF, 0, 4096), &lim(1)),
            Err(EINVAL)
        );
        assert!(classify(&req(CMD_READ, CMD_FLAG_DF, 0, 4096), &with_ctx).is_ok());
        assert_eq!(
            classify(&req(CMD_READ, CMD_FLAG_REQ_ONE, 0, 4096), &with_ctx),
            Err(EINVAL)
        );
        assert_eq!(
            classify(&req(CMD_WRITE, CMD_FLAG_DF, 0, 4096), &with_ctx),
            Err(EINVAL)
        );
    }

    #[test]
    fn classify_alignment_only_when_negotiated() {
        assert!(classify(&req(CMD_WRITE, 0, 512, 512), &lim(1)).is_ok());
        assert_eq!(
            classify(&req(CMD_WRITE, 0, 512, 4096), &lim(4096)),
            Err(EINVAL)
        );
        assert_eq!(classify(&req(CMD_READ, 0, 0, 512), &lim(4096)), Err(EINVAL));
        assert!(classify(&req(CMD_READ, 0, 4096, 8192), &lim(4096)).is_ok());
        let odd = Limits {
            size_bytes: 4096 + 100,
            ..lim(4096)
        };
        assert!(classify(&req(CMD_READ, 0, 4096, 100), &odd).is_ok());
    }
}
