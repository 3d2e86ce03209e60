//! Transmission phase: reads requests continuously, runs up to `inflight_max` of them
//! concurrently on the device, and writes simple replies from one writer as they complete.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use crate::dev::{BlockDev, DevError};
use crate::error::NbdError;
use crate::handshake::{discard, read_exact_or_eof, Negotiated};
use crate::proto::*;
use crate::server::{ServerConfig, ServerStats};

/// A WRITE refused with a payload up to this size has its payload skipped so the stream
/// stays in sync; beyond it the server replies and then hangs up.
pub(crate) const WRITE_DISCARD_MAX: u32 = 64 * 1024 * 1024;

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
}

/// Checks a request against the export; `Err` is the NBD error value to reply with.
pub(crate) fn classify(req: &Request, lim: &Limits) -> Result<Op, u32> {
    let allowed = match req.typ {
        CMD_READ | CMD_WRITE | CMD_FLUSH | CMD_TRIM | CMD_DISC => CMD_FLAG_FUA,
        CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE,
        _ => return Err(EINVAL),
    };
    if req.flags & !allowed != 0 {
        return Err(EINVAL);
    }
    let fua = req.flags & CMD_FLAG_FUA != 0;
    match req.typ {
        CMD_FLUSH => return Ok(Op::Flush),
        CMD_DISC => return Ok(Op::Disc),
        CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES if lim.read_only => return Err(EPERM),
        _ => {}
    }
    if req.len == 0 {
        return Err(EINVAL);
    }
    let is_write = matches!(req.typ, CMD_WRITE | CMD_WRITE_ZEROES);
    if matches!(req.typ, CMD_READ | CMD_WRITE) && req.len > lim.max_request_bytes {
        return Err(EOVERFLOW);
    }
    let end = req.offset.checked_add(u64::from(req.len));
    match end {
        Some(end) if end <= lim.size_bytes => {
            let align = u64::from(lim.align.max(1));
            // The last block of an export whose size is not a multiple may end at the size.
            if !req.offset.is_multiple_of(align) || (end % align != 0 && end != lim.size_bytes) {
                return Err(EINVAL);
            }
        }
        _ => return Err(if is_write { ENOSPC } else { EINVAL }),
    }
    let (offset, len) = (req.offset, req.len);
    Ok(match req.typ {
        CMD_READ => Op::Read { offset, len },
        CMD_WRITE => Op::Write { offset, len, fua },
        CMD_TRIM => Op::Trim { offset, len, fua },
        _ => Op::WriteZeroes {
            offset,
            len,
            fua,
            may_trim: req.flags & CMD_FLAG_NO_HOLE == 0,
        },
    })
}

struct Reply {
    handle: u64,
    errno: u32,
    data: Option<Bytes>,
    /// Released once the reply is on the wire, so replies waiting for a slow client count
    /// against `inflight_max` too.
    _permit: OwnedSemaphorePermit,
}

/// One request's right to reply. Dropping it unanswered (a device future panicked)
/// still replies EIO, so the client never waits forever on a handle.
struct Slot {
    tx: mpsc::Sender<Reply>,
    handle: u64,
    permit: Option<OwnedSemaphorePermit>,
}

impl Slot {
    fn finish(mut self, errno: u32, data: Option<Bytes>) {
        self.send(errno, data);
    }

    fn send(&mut self, errno: u32, data: Option<Bytes>) {
        if let Some(permit) = self.permit.take() {
            // Never full: the channel holds as many slots as there are permits, and
            // every queued reply carries one.
            let _ = self.tx.try_send(Reply {
                handle: self.handle,
                errno,
                data,
                _permit: permit,
            });
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.permit.is_some() {
            log::error!(
                "nbd: request {:#x} ended without a reply; sending EIO",
                self.handle
            );
            self.send(EIO, None);
        }
    }
}

fn dev_errno(op: &str, e: &DevError) -> u32 {
    log::warn!("nbd: {op} failed: {e}");
    e.nbd_errno()
}

async fn execute<D: BlockDev>(dev: &D, op: Op, payload: Bytes) -> Result<Option<Bytes>, u32> {
    match op {
        Op::Read { offset, len } => {
            let data = dev
                .read(offset, len)
                .await
                .map_err(|e| dev_errno("read", &e))?;
            if data.len() != len as usize {
                log::error!(
                    "nbd: device returned {} bytes for a {len}-byte read at {offset}",
                    data.len()
                );
                return Err(EIO);
            }
            Ok(Some(data))
        }
        Op::Write { offset, fua, .. } => {
            dev.write(offset, payload, fua)
                .await
                .map_err(|e| dev_errno("write", &e))?;
            Ok(None)
        }
        Op::Flush => {
            dev.flush().await.map_err(|e| dev_errno("flush", &e))?;
            Ok(None)
        }
        Op::Trim { offset, len, fua } => {
            dev.trim(offset, len)
                .await
                .map_err(|e| dev_errno("trim", &e))?;
            if fua {
                dev.flush().await.map_err(|e| dev_errno("flush", &e))?;
            }
            Ok(None)
        }
        Op::WriteZeroes {
            offset,
            len,
            fua,
            may_trim,
        } => {
            dev.write_zeroes(offset, len, may_trim)
                .await
                .map_err(|e| dev_errno("write_zeroes", &e))?;
            if fua {
                dev.flush().await.map_err(|e| dev_errno("flush", &e))?;
            }
            Ok(None)
        }
        Op::Disc => Ok(None),
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
    align: u32,
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
            max_request_bytes: cfg.max_request_bytes,
            align,
            read_only: cfg.read_only,
        };
        let permit = permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| NbdError::Truncated)?;
        let slot = Slot {
            tx: tx.clone(),
            handle: req.handle,
            permit: Some(permit),
        };
        let op = match classify(&req, &lim) {
            Ok(op) => op,
            Err(errno) => {
                log::debug!("nbd: rejecting {req:?} with error {errno}");
                // Consume a refused WRITE's payload before replying: a client may not
                // expect the reply to a command it is still sending (libnbd drops the
                // connection if it comes early).
                if req.typ == CMD_WRITE && req.len <= WRITE_DISCARD_MAX {
                    discard(rd, u64::from(req.len)).await?;
                }
                slot.finish(errno, None);
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
        let request = async move {
            match execute(&*dev, op, payload).await {
                Ok(data) => slot.finish(0, data),
                Err(errno) => slot.finish(errno, None),
            }
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
            tokio::spawn(request);
        }
    }
}

impl Slot {
    /// Gives the permit back without replying (NBD_CMD_DISC has no reply).
    fn permit_free(mut self) -> Option<OwnedSemaphorePermit> {
        self.permit.take()
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
    let mut heads: Vec<[u8; SIMPLE_REPLY_LEN]> = Vec::with_capacity(inflight_max);
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
        heads.clear();
        for r in &batch {
            if r.errno != 0 {
                stats.errors.fetch_add(1, Ordering::Relaxed);
            }
            heads.push(simple_reply(r.errno, r.handle));
            if let Some(data) = &r.data {
                stats
                    .bytes_read
                    .fetch_add(data.len() as u64, Ordering::Relaxed);
            }
        }
        write_batch(wr, &heads, &batch).await?;
        // Dropping the replies gives their permits back.
        batch.clear();
    }
    wr.flush().await?;
    wr.shutdown().await?;
    Ok(())
}

/// Most slices one vectored write takes (well under Linux's IOV_MAX).
const WRITE_SLICES_MAX: usize = 64;

/// Writes each reply's header and then its data, in order, with as few vectored writes as
/// the socket allows: read data goes to the socket from the buffer the drive read it into,
/// without a copy.
async fn write_batch<Wr: AsyncWrite + Unpin>(
    wr: &mut Wr,
    heads: &[[u8; SIMPLE_REPLY_LEN]],
    replies: &[Reply],
) -> std::io::Result<()> {
    // The chunks, in order: chunk 2i is reply i's header, chunk 2i + 1 its data (if any).
    let chunk = |k: usize| -> &[u8] {
        if k.is_multiple_of(2) {
            &heads[k / 2]
        } else {
            replies[k / 2].data.as_deref().unwrap_or(&[])
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
    let align = if neg.block_size_negotiated {
        cfg.min_block
    } else {
        1
    };
    let permits = Arc::new(Semaphore::new(cfg.inflight_max));
    let (tx, rx) = mpsc::channel(cfg.inflight_max);
    let writer_permits = permits.clone();
    let reader = async {
        let end = read_requests(rd, &neg.dev, align, cfg, tx, permits).await?;
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
        }
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

    /// Replies written in pieces arrive whole and in order: each header, then its data.
    #[tokio::test]
    async fn a_batch_of_replies_survives_partial_writes() {
        let sem = Arc::new(Semaphore::new(200));
        let mut replies = Vec::new();
        let mut want = Vec::new();
        for i in 0..150u64 {
            let data = (i % 3 != 0).then(|| Bytes::from(vec![i as u8; (i as usize * 37) % 5000]));
            let errno = if i % 7 == 0 { EIO } else { 0 };
            want.extend_from_slice(&simple_reply(errno, i));
            if let Some(d) = &data {
                want.extend_from_slice(d);
            }
            replies.push(Reply {
                handle: i,
                errno,
                data,
                _permit: sem.clone().try_acquire_owned().unwrap(),
            });
        }
        let heads: Vec<_> = replies
            .iter()
            .map(|r| simple_reply(r.errno, r.handle))
            .collect();
        let mut out = Trickle(Vec::new());
        write_batch(&mut out, &heads, &replies).await.unwrap();
        assert_eq!(out.0.len(), want.len());
        assert!(out.0 == want, "bytes differ");
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
