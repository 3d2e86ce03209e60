//! Moving frames between a socket and memory: one reader, one batching writer per connection.
//!
//! Shared by client and server so that both ends read and write the same way.

use crate::wire::{EncodedFrame, FrameHeader, WireError, HEADER_LEN};
use bytes::{Buf, Bytes, BytesMut};
use std::io::{self, IoSlice};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

/// Most frames one writer wake-up gathers into a single vectored write.
pub(crate) const BATCH_FRAMES_MAX: usize = 256;
/// Most bytes one writer wake-up gathers before writing (more frames wait for the next one).
pub(crate) const BATCH_BYTES_MAX: usize = 4 << 20;
/// Most slices passed to one `writev` (Linux IOV_MAX is 1024).
const IOV_MAX: usize = 1024;
/// Read buffer per connection: small frames are read many at a time.
pub(crate) const READ_BUFFER_BYTES: usize = 64 << 10;

/// Why reading the next frame failed. After any of these the stream is out of sync.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReadError {
    #[error("socket error: {0}")]
    Io(#[from] io::Error),
    #[error("{0}")]
    Wire(#[from] WireError),
    /// The header is intact but announces a payload above the bound.
    #[error("frame {} announces {} payload bytes, above rpc_frame_bytes_max {max}", header.request_id, header.payload_len)]
    TooLarge { header: FrameHeader, max: usize },
}

/// Reads one frame. `Ok(None)` is a clean end of stream at a frame boundary. The payload crc
/// is *not* checked here: the caller knows the request id and can answer for that frame.
pub(crate) async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    payload_bytes_max: usize,
) -> Result<Option<(FrameHeader, Bytes)>, ReadError> {
    let mut h = [0u8; HEADER_LEN];
    // Distinguish EOF before a frame (clean close) from EOF inside one (truncated).
    let first = r.read(&mut h).await?;
    if first == 0 {
        return Ok(None);
    }
    r.read_exact(&mut h[first..]).await?;
    let header = FrameHeader::decode(&h, usize::MAX)?;
    let len = header.payload_len as usize;
    if len > payload_bytes_max {
        return Err(ReadError::TooLarge {
            header,
            max: payload_bytes_max,
        });
    }
    let mut payload = BytesMut::zeroed(len);
    r.read_exact(&mut payload).await?;
    Ok(Some((header, payload.freeze())))
}

/// Writes one frame (handshake only; everything else goes through [`write_loop`]).
pub(crate) async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    frame: &EncodedFrame,
) -> io::Result<()> {
    let mut chunks = vec![frame.head.clone(), frame.data.clone()];
    write_all_vectored(w, &mut chunks).await?;
    w.flush().await
}

/// Writes every chunk, with as few `writev` calls as the socket allows.
async fn write_all_vectored<W: AsyncWrite + Unpin>(
    w: &mut W,
    chunks: &mut Vec<Bytes>,
) -> io::Result<()> {
    chunks.retain(|c| !c.is_empty());
    let mut first = 0;
    while first < chunks.len() {
        let n = {
            let slices: Vec<IoSlice<'_>> = chunks[first..]
                .iter()
                .take(IOV_MAX)
                .map(|c| IoSlice::new(c))
                .collect();
            w.write_vectored(&slices).await?
        };
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "peer socket accepted no bytes",
            ));
        }
        let mut left = n;
        while left > 0 && first < chunks.len() {
            let c = &mut chunks[first];
            if c.len() <= left {
                left -= c.len();
                first += 1;
            } else {
                c.advance(left);
                left = 0;
            }
        }
    }
    chunks.clear();
    Ok(())
}

/// What a connection's writer is asked to do.
#[derive(Debug)]
pub(crate) enum Outgoing {
    Frame(EncodedFrame),
    /// Write what is queued before this, then close the sending side.
    Close,
}

/// The single writer of a connection: each wake-up drains every frame already queued (up to
/// the batch bounds) and writes them together, so pipelined frames share syscalls.
/// `more(n)` says whether, with `n` frames in hand, others are likely to be queued in a
/// moment (requests of this connection still in progress): the writer then lets the
/// runtime's ready tasks run once before it writes, so they join the batch; alone (QD 1),
/// it writes at once. Returns `Ok` when every sender is gone or on `Close`, `Err` on the
/// first socket error.
pub(crate) async fn write_loop<W: AsyncWrite + Unpin>(
    mut w: W,
    mut rx: mpsc::Receiver<Outgoing>,
    more: impl Fn(usize) -> bool,
    version: u16,
) -> io::Result<()> {
    let mut chunks: Vec<Bytes> = Vec::with_capacity(2 * BATCH_FRAMES_MAX);
    let mut next = rx.recv().await;
    while let Some(Outgoing::Frame(frame)) = next {
        // Frames are encoded in this build's newest version; a connection that agreed on
        // an older one gets them in that (a no-op otherwise).
        let frame = frame.at_version(version);
        let mut frames = 1;
        let mut bytes = frame.wire_len();
        chunks.push(frame.head);
        chunks.push(frame.data);
        next = None;
        // Drain what is queued; then let the tasks the runtime has ready run once (they
        // are usually the rest of a burst of requests, each about to queue a frame) and
        // drain again: a burst then costs one writev, not one per frame.
        for round in 0..2 {
            if round == 1 {
                if frames >= BATCH_FRAMES_MAX || bytes >= BATCH_BYTES_MAX || !more(frames) {
                    break;
                }
                tokio::task::yield_now().await;
            }
            while frames < BATCH_FRAMES_MAX && bytes < BATCH_BYTES_MAX {
                match rx.try_recv() {
                    Ok(Outgoing::Frame(f)) => {
                        let f = f.at_version(version);
                        frames += 1;
                        bytes += f.wire_len();
                        chunks.push(f.head);
                        chunks.push(f.data);
                    }
                    Ok(Outgoing::Close) => {
                        next = Some(Outgoing::Close);
                        break;
                    }
                    Err(_) => break,
                }
            }
            if next.is_some() {
                break;
            }
        }
        write_all_vectored(&mut w, &mut chunks).await?;
        // Free on a plain socket; a TLS stream may hold records back until flushed.
        w.flush().await?;
        if next.is_none() {
            next = rx.recv().await;
        }
    }
    w.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{self, Request, Response};
    use converge_types::{ExtentReply, ReadReply};

    /// Accepts a few bytes per write, to exercise partial vectored writes.
    struct Trickle {
        out: Vec<u8>,
        writes: usize,
    }

    impl AsyncWrite for Trickle {
        fn poll_write(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<io::Result<usize>> {
            let n = buf.len().min(7);
            self.out.extend_from_slice(&buf[..n]);
            self.writes += 1;
            std::task::Poll::Ready(Ok(n))
        }
        fn poll_write_vectored(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            bufs: &[IoSlice<'_>],
        ) -> std::task::Poll<io::Result<usize>> {
            let mut n = 0;
            for b in bufs {
                let take = b.len().min(1000 - n);
                self.out.extend_from_slice(&b[..take]);
                n += take;
                if n == 1000 {
                    break;
                }
            }
            self.writes += 1;
            std::task::Poll::Ready(Ok(n))
        }
        fn is_write_vectored(&self) -> bool {
            true
        }
        fn poll_flush(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
        fn poll_shutdown(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn queued_frames_are_batched_and_read_back_in_order() {
        let (tx, rx) = mpsc::channel(64);
        let mut expect = Vec::new();
        for i in 0..50u64 {
            let resp = Response::Extent(ExtentReply::Read(ReadReply {
                data: Bytes::from(vec![i as u8; 100]),
                bad_blocks: vec![i as u32],
                suspect: vec![],
                version: converge_types::Version(i),
            }));
            let f = wire::encode_response(i, &resp);
            expect.extend_from_slice(&f.to_vec());
            tx.send(Outgoing::Frame(f)).await.expect("queue");
        }
        drop(tx);
        let mut sink = Trickle {
            out: Vec::new(),
            writes: 0,
        };
        write_loop(&mut sink, rx, |_| true, crate::wire::PROTOCOL_VERSION)
            .await
            .expect("writes");
        assert_eq!(sink.out, expect);
        // 50 frames queued before the writer ran: one batch, split only by the sink's limit.
        assert!(
            sink.writes <= expect.len().div_ceil(1000) + 1,
            "{}",
            sink.writes
        );

        let mut r = &expect[..];
        for i in 0..50u64 {
            let (h, p) = read_frame(&mut r, 1 << 20)
                .await
                .expect("reads")
                .expect("frame");
            assert_eq!(h.request_id, i);
            wire::check_payload(&h, &p).expect("crc");
            let resp = wire::decode_response(h.msg_type, p).expect("decodes");
            assert!(matches!(resp, Response::Extent(ExtentReply::Read(_))));
        }
        assert!(read_frame(&mut r, 1 << 20).await.expect("eof").is_none());
    }

    #[tokio::test]
    async fn truncated_stream_is_an_error_not_a_clean_close() {
        let f = wire::encode_request(1, &Request::Ping).to_vec();
        for cut in 1..f.len() {
            let mut r = &f[..cut];
            assert!(read_frame(&mut r, 1 << 20).await.is_err(), "cut {cut}");
        }
    }

    #[tokio::test]
    async fn oversized_announcement_is_refused_before_reading_the_payload() {
        let f = wire::encode_response(
            3,
            &Response::Extent(ExtentReply::Read(ReadReply {
                data: Bytes::from(vec![0u8; 4096]),
                bad_blocks: vec![],
                suspect: vec![],
                version: converge_types::Version(0),
            })),
        )
        .to_vec();
        let mut r = &f[..HEADER_LEN];
        match read_frame(&mut r, 100).await {
            Err(ReadError::TooLarge { header, max }) => {
                assert_eq!(header.request_id, 3);
                assert_eq!(max, 100);
            }
            other => panic!("expected TooLarge, got {other:?}"),
        }
    }
}
