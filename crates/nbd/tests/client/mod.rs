//! The handwritten NBD client the byte-level protocol tests share: a server on one end of
//! an in-memory duplex pipe, RAM exports behind it, and helpers that send options and
//! requests and check every reply's framing.

// Each test binary uses a different part of this module.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use converge_nbd::proto::*;
use converge_nbd::testing::{MemDev, MemResolver};
use converge_nbd::{serve_connection, NbdError, ResolveError, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::task::JoinHandle;

pub const SIZE: usize = 1 << 20;
pub const OPT_UNKNOWN: u32 = 4242;

pub struct Setup {
    pub dev: Arc<MemDev>,
    pub resolver: Arc<MemResolver>,
}

pub fn setup() -> Setup {
    let dev = Arc::new(MemDev::new(SIZE).with_description("test disk"));
    let resolver = MemResolver::new()
        .with_export("vm01", Arc::clone(&dev))
        .with_export("aaa", Arc::new(MemDev::new(8192)))
        .with_refusal(
            "vm02",
            ResolveError::Elsewhere {
                owner: "node 2 (127.0.0.2)".to_owned(),
            },
        )
        .with_refusal("vm03", ResolveError::Unavailable("resyncing".to_owned()));
    Setup {
        dev,
        resolver: Arc::new(resolver),
    }
}

pub fn small_cfg() -> ServerConfig {
    ServerConfig {
        max_request_bytes: 64 * 1024,
        preferred_block: 4096,
        ..ServerConfig::default()
    }
}

pub struct Client {
    pub s: DuplexStream,
    pub server: JoinHandle<Result<(), NbdError>>,
}

impl Client {
    pub fn connect(s: &Setup, cfg: ServerConfig) -> Self {
        let (c, srv) = tokio::io::duplex(256 * 1024);
        let server = tokio::spawn(serve_connection(srv, Arc::clone(&s.resolver), cfg));
        Self { s: c, server }
    }

    /// Reads the greeting and answers with `cflags`.
    pub async fn hello(&mut self, cflags: u32) -> u16 {
        let mut b = [0u8; 18];
        self.s.read_exact(&mut b).await.unwrap();
        assert_eq!(u64::from_be_bytes(b[0..8].try_into().unwrap()), NBD_MAGIC);
        assert_eq!(u64::from_be_bytes(b[8..16].try_into().unwrap()), IHAVEOPT);
        self.s.write_all(&cflags.to_be_bytes()).await.unwrap();
        u16::from_be_bytes([b[16], b[17]])
    }

    pub async fn fixed(s: &Setup, cfg: ServerConfig) -> Self {
        let mut c = Self::connect(s, cfg);
        let hflags = c.hello(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).await;
        assert_eq!(hflags, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        c
    }

    pub async fn opt(&mut self, option: u32, data: &[u8]) {
        let mut b = IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&option.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.s.write_all(&b).await.unwrap();
    }

    pub async fn opt_reply(&mut self, option: u32) -> (u32, Vec<u8>) {
        let mut h = [0u8; 20];
        tokio::time::timeout(Duration::from_secs(5), self.s.read_exact(&mut h))
            .await
            .expect("no option reply within 5 s")
            .unwrap();
        assert_eq!(u64::from_be_bytes(h[0..8].try_into().unwrap()), REPLY_MAGIC);
        assert_eq!(u32::from_be_bytes(h[8..12].try_into().unwrap()), option);
        let typ = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
        let mut d = vec![0u8; len as usize];
        self.s.read_exact(&mut d).await.unwrap();
        (typ, d)
    }

    /// Sends INFO/GO and collects replies up to the final one.
    pub async fn info_go(&mut self, option: u32, name: &str, infos: &[u16]) -> Vec<(u32, Vec<u8>)> {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
        for i in infos {
            d.extend_from_slice(&i.to_be_bytes());
        }
        self.opt(option, &d).await;
        let mut out = Vec::new();
        loop {
            let (typ, data) = self.opt_reply(option).await;
            let done = typ != REP_INFO;
            out.push((typ, data));
            if done {
                return out;
            }
        }
    }

    pub async fn go(s: &Setup, cfg: ServerConfig, infos: &[u16]) -> Self {
        let mut c = Self::fixed(s, cfg).await;
        let r = c.info_go(OPT_GO, "vm01", infos).await;
        assert_eq!(r.last().unwrap().0, REP_ACK, "{r:?}");
        c
    }

    pub async fn request(&mut self, typ: u16, flags: u16, handle: u64, offset: u64, len: u32) {
        let r = Request {
            flags,
            typ,
            handle,
            offset,
            len,
        };
        self.s.write_all(&r.encode()).await.unwrap();
    }

    pub async fn reply(&mut self) -> (u32, u64) {
        let mut h = [0u8; 16];
        tokio::time::timeout(Duration::from_secs(5), self.s.read_exact(&mut h))
            .await
            .expect("no reply within 5 s")
            .unwrap();
        assert_eq!(
            u32::from_be_bytes(h[0..4].try_into().unwrap()),
            SIMPLE_REPLY_MAGIC
        );
        (
            u32::from_be_bytes(h[4..8].try_into().unwrap()),
            u64::from_be_bytes(h[8..16].try_into().unwrap()),
        )
    }

    pub async fn write(&mut self, handle: u64, offset: u64, data: &[u8]) -> u32 {
        self.request(CMD_WRITE, 0, handle, offset, data.len() as u32)
            .await;
        self.s.write_all(data).await.unwrap();
        let (err, h) = self.reply().await;
        assert_eq!(h, handle);
        err
    }

    pub async fn read(&mut self, handle: u64, offset: u64, len: u32) -> Result<Vec<u8>, u32> {
        self.request(CMD_READ, 0, handle, offset, len).await;
        let (err, h) = self.reply().await;
        assert_eq!(h, handle);
        if err != 0 {
            return Err(err);
        }
        let mut d = vec![0u8; len as usize];
        self.s.read_exact(&mut d).await.unwrap();
        Ok(d)
    }

    /// Simple command without payload; returns the error value.
    pub async fn cmd(&mut self, typ: u16, flags: u16, handle: u64, offset: u64, len: u32) -> u32 {
        self.request(typ, flags, handle, offset, len).await;
        let (err, h) = self.reply().await;
        assert_eq!(h, handle);
        err
    }

    pub async fn expect_eof(&mut self) {
        let mut b = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(5), self.s.read(&mut b))
            .await
            .expect("server should close")
            .unwrap_or(0);
        assert_eq!(n, 0, "expected the server to close the connection");
    }

    pub async fn disc(mut self) -> Result<(), NbdError> {
        self.request(CMD_DISC, 0, 0, 0, 0).await;
        self.expect_eof().await;
        self.server.await.unwrap()
    }
}

pub fn info_of(replies: &[(u32, Vec<u8>)], info: u16) -> Option<Vec<u8>> {
    replies
        .iter()
        .filter(|(t, _)| *t == REP_INFO)
        .find(|(_, d)| u16::from_be_bytes([d[0], d[1]]) == info)
        .map(|(_, d)| d[2..].to_vec())
}

pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// One reply of any kind, read by its magic.
#[derive(Debug)]
pub enum AnyReply {
    Simple { errno: u32, handle: u64 },
    Chunk { head: ChunkHeader, payload: Vec<u8> },
}

/// An error chunk's contents.
#[derive(Debug, PartialEq, Eq)]
pub struct ChunkError {
    pub errno: u32,
    pub message: String,
}

/// A BLOCK_STATUS answer: the context id and (length, flags) descriptors.
pub type Extents = (u32, Vec<(u32, u32)>);

impl Client {
    /// Fixed newstyle, then NBD_OPT_STRUCTURED_REPLY acknowledged.
    pub async fn structured(s: &Setup, cfg: ServerConfig) -> Self {
        let mut c = Self::fixed(s, cfg).await;
        c.opt(OPT_STRUCTURED_REPLY, &[]).await;
        assert_eq!(c.opt_reply(OPT_STRUCTURED_REPLY).await, (REP_ACK, vec![]));
        c
    }

    /// Structured replies, `base:allocation` selected for vm01, then GO vm01; returns the
    /// context id the server chose.
    pub async fn with_allocation(s: &Setup, cfg: ServerConfig, infos: &[u16]) -> (Self, u32) {
        let mut c = Self::structured(s, cfg).await;
        let r = c
            .meta(OPT_SET_META_CONTEXT, "vm01", &["base:allocation"])
            .await;
        assert_eq!(r.len(), 2, "{r:?}");
        let id = meta_context_of(&r[0]);
        assert_eq!(r[1], (REP_ACK, vec![]));
        let r = c.info_go(OPT_GO, "vm01", infos).await;
        assert_eq!(r.last().unwrap().0, REP_ACK, "{r:?}");
        (c, id.0)
    }

    /// Sends LIST/SET_META_CONTEXT and collects replies up to the final one.
    pub async fn meta(&mut self, option: u32, name: &str, queries: &[&str]) -> Vec<(u32, Vec<u8>)> {
        self.opt(option, &meta_context_request(name, queries)).await;
        let mut out = Vec::new();
        loop {
            let (typ, data) = self.opt_reply(option).await;
            let done = typ != REP_META_CONTEXT;
            out.push((typ, data));
            if done {
                return out;
            }
        }
    }

    /// The next reply, simple or structured, with its framing checked.
    pub async fn any_reply(&mut self) -> AnyReply {
        let mut m = [0u8; 4];
        tokio::time::timeout(Duration::from_secs(5), self.s.read_exact(&mut m))
            .await
            .expect("no reply within 5 s")
            .unwrap();
        match u32::from_be_bytes(m) {
            SIMPLE_REPLY_MAGIC => {
                let mut r = [0u8; 12];
                self.s.read_exact(&mut r).await.unwrap();
                AnyReply::Simple {
                    errno: u32::from_be_bytes(r[0..4].try_into().unwrap()),
                    handle: u64::from_be_bytes(r[4..12].try_into().unwrap()),
                }
            }
            STRUCTURED_REPLY_MAGIC => {
                let mut h = [0u8; STRUCTURED_REPLY_LEN];
                h[0..4].copy_from_slice(&m);
                self.s.read_exact(&mut h[4..]).await.unwrap();
                let head = ChunkHeader::decode(&h).unwrap();
                let mut payload = vec![0u8; head.len as usize];
                self.s.read_exact(&mut payload).await.unwrap();
                AnyReply::Chunk { head, payload }
            }
            other => panic!("bad reply magic {other:#x}"),
        }
    }

    /// The next reply, which must be a structured chunk for `handle`.
    pub async fn chunk(&mut self, handle: u64) -> (ChunkHeader, Vec<u8>) {
        match self.any_reply().await {
            AnyReply::Chunk { head, payload } => {
                assert_eq!(head.handle, handle, "{head:?}");
                (head, payload)
            }
            other => panic!("expected a structured chunk for {handle}, got {other:?}"),
        }
    }

    /// A structured READ: the data chunks reassembled, or the error chunk.
    pub async fn read_chunks(
        &mut self,
        handle: u64,
        flags: u16,
        offset: u64,
        len: u32,
    ) -> Result<Vec<u8>, ChunkError> {
        self.request(CMD_READ, flags, handle, offset, len).await;
        let mut data = vec![0u8; len as usize];
        let mut covered = 0usize;
        let mut error = None;
        loop {
            let (head, payload) = self.chunk(handle).await;
            match head.typ {
                REPLY_TYPE_OFFSET_DATA => {
                    assert!(payload.len() > 8, "OFFSET_DATA needs at least 9 bytes");
                    let at = u64::from_be_bytes(payload[0..8].try_into().unwrap());
                    let n = payload.len() - 8;
                    assert!(at >= offset && at + n as u64 <= offset + u64::from(len));
                    let i = (at - offset) as usize;
                    data[i..i + n].copy_from_slice(&payload[8..]);
                    covered += n;
                }
                t if t & REPLY_TYPE_ERROR_BIT != 0 => error = Some(chunk_error(&head, &payload)),
                t => panic!("unexpected chunk type {t} in a READ reply"),
            }
            if head.flags & REPLY_FLAG_DONE != 0 {
                break;
            }
        }
        match error {
            Some(e) => Err(e),
            None => {
                assert_eq!(covered, len as usize, "chunks must cover the whole read");
                Ok(data)
            }
        }
    }

    /// A BLOCK_STATUS in one chunk (we select one context): its descriptors, or the error.
    pub async fn block_status(
        &mut self,
        handle: u64,
        flags: u16,
        offset: u64,
        len: u32,
    ) -> Result<Extents, ChunkError> {
        self.request(CMD_BLOCK_STATUS, flags, handle, offset, len)
            .await;
        let (head, payload) = self.chunk(handle).await;
        assert_ne!(head.flags & REPLY_FLAG_DONE, 0, "one chunk, flagged DONE");
        if head.typ & REPLY_TYPE_ERROR_BIT != 0 {
            return Err(chunk_error(&head, &payload));
        }
        assert_eq!(head.typ, REPLY_TYPE_BLOCK_STATUS);
        assert!(
            payload.len() >= 12 && (payload.len() - 4) % 8 == 0,
            "{head:?}"
        );
        let id = u32::from_be_bytes(payload[0..4].try_into().unwrap());
        let d = payload[4..]
            .chunks_exact(8)
            .map(|c| {
                (
                    u32::from_be_bytes(c[0..4].try_into().unwrap()),
                    u32::from_be_bytes(c[4..8].try_into().unwrap()),
                )
            })
            .collect();
        Ok((id, d))
    }

    /// A BLOCK_STATUS with any number of selected contexts: every chunk's answer in the
    /// order sent, checking that only the last is flagged DONE; or the error, which must
    /// be the reply's only chunk.
    pub async fn block_status_chunks(
        &mut self,
        handle: u64,
        flags: u16,
        offset: u64,
        len: u32,
    ) -> Result<Vec<Extents>, ChunkError> {
        self.request(CMD_BLOCK_STATUS, flags, handle, offset, len)
            .await;
        let mut out = Vec::new();
        loop {
            let (head, payload) = self.chunk(handle).await;
            let done = head.flags & REPLY_FLAG_DONE != 0;
            if head.typ & REPLY_TYPE_ERROR_BIT != 0 {
                assert!(out.is_empty(), "no status chunk before an error: {out:?}");
                assert!(done, "the error ends the reply");
                return Err(chunk_error(&head, &payload));
            }
            assert_eq!(head.typ, REPLY_TYPE_BLOCK_STATUS);
            assert_eq!(head.flags & !REPLY_FLAG_DONE, 0, "{head:?}");
            assert!(
                payload.len() >= 12 && (payload.len() - 4) % 8 == 0,
                "{head:?}"
            );
            let id = u32::from_be_bytes(payload[0..4].try_into().unwrap());
            let d = payload[4..]
                .chunks_exact(8)
                .map(|c| {
                    (
                        u32::from_be_bytes(c[0..4].try_into().unwrap()),
                        u32::from_be_bytes(c[4..8].try_into().unwrap()),
                    )
                })
                .collect();
            out.push((id, d));
            if done {
                return Ok(out);
            }
        }
    }

    /// A payload-less command after structured replies: a simple reply, or an error chunk.
    pub async fn cmd_any(
        &mut self,
        typ: u16,
        flags: u16,
        handle: u64,
        offset: u64,
        len: u32,
    ) -> Result<(), ChunkError> {
        self.request(typ, flags, handle, offset, len).await;
        match self.any_reply().await {
            AnyReply::Simple {
                errno: 0,
                handle: h,
            } if h == handle => Ok(()),
            AnyReply::Chunk { head, payload } if head.handle == handle => {
                assert_ne!(head.typ & REPLY_TYPE_ERROR_BIT, 0, "{head:?}");
                assert_ne!(head.flags & REPLY_FLAG_DONE, 0);
                Err(chunk_error(&head, &payload))
            }
            other => panic!("unexpected reply to {handle}: {other:?}"),
        }
    }
}

/// Decodes an error chunk, checking the lengths agree as the spec requires.
pub fn chunk_error(head: &ChunkHeader, payload: &[u8]) -> ChunkError {
    assert_eq!(
        head.typ, REPLY_TYPE_ERROR,
        "we send NBD_REPLY_TYPE_ERROR only"
    );
    assert!(payload.len() >= 6);
    let errno = u32::from_be_bytes(payload[0..4].try_into().unwrap());
    let mlen = u16::from_be_bytes([payload[4], payload[5]]) as usize;
    assert_eq!(
        payload.len(),
        6 + mlen,
        "message length disagrees with the chunk"
    );
    assert!(mlen <= STRING_MAX);
    assert_ne!(errno, 0, "an error chunk carries an error");
    ChunkError {
        errno,
        message: String::from_utf8(payload[6..].to_vec()).unwrap(),
    }
}

/// An NBD_REP_META_CONTEXT reply: (context id, name).
pub fn meta_context_of(reply: &(u32, Vec<u8>)) -> (u32, String) {
    assert_eq!(reply.0, REP_META_CONTEXT, "{reply:?}");
    let id = u32::from_be_bytes(reply.1[0..4].try_into().unwrap());
    (id, String::from_utf8(reply.1[4..].to_vec()).unwrap())
}
