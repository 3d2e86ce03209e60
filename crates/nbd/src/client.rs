//! A small async NBD client: fixed newstyle, `NBD_OPT_GO` (falling back to
//! `NBD_OPT_EXPORT_NAME` only when the server does not know GO), simple replies, no TLS.
//!
//! One [`Client`] is one transmission-phase session used by one task (`&mut self`). Large
//! reads and writes are split into pieces that are pipelined: up to [`WINDOW`] requests are
//! in flight at once and replies are matched to them by handle, in whatever order the
//! server sends them. Everything the server sends is checked; a reply that breaks the
//! protocol is a [`ClientError::Protocol`] and leaves the session unusable (every later
//! call fails), while an error the server reports for a request
//! ([`ClientError::Server`]) leaves the session in sync and usable.

use std::fmt;
use std::path::Path;
use std::time::Duration;

use tokio::io::{
    AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter, ReadHalf, WriteHalf,
};

use crate::proto::*;

/// Requests kept in flight by one `read`, `write` or `write_zeroes`.
pub const WINDOW: usize = 8;
/// Largest piece one READ or WRITE request carries (further bounded by [`Client::max_request`]).
pub const PIECE_MAX: u32 = 4 * 1024 * 1024;
/// Largest request used, whatever the server allows; also the spec's default maximum when
/// the server sends no `NBD_INFO_BLOCK_SIZE`.
pub const REQUEST_CAP: u32 = 32 * 1024 * 1024;
/// Option replies longer than this are refused (no legitimate reply comes close).
pub const OPTION_REPLY_MAX: u32 = 64 * 1024;
/// Option replies accepted for one NBD_OPT_GO before the server is considered broken.
const GO_REPLIES_MAX: usize = 64;
/// The whole handshake must finish within this time.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long `disconnect` waits for the server to close its side after NBD_CMD_DISC.
const DISCONNECT_WAIT: Duration = Duration::from_secs(5);
/// Error messages from the server are cut to this many characters.
const MESSAGE_MAX: usize = STRING_MAX;
/// Second magic of the oldstyle greeting (not supported).
const OLDSTYLE_MAGIC: u64 = 0x0000_4202_8186_1253;
/// `NBD_REP_ERR_SHUTDOWN` and `NBD_REP_ERR_BLOCK_SIZE_REQD` (not in `proto`: the server
/// never sends them).
const REP_ERR_SHUTDOWN: u32 = (1 << 31) + 7;
const REP_ERR_BLOCK_SIZE_REQD: u32 = (1 << 31) + 8;
const REP_ERR_PLATFORM: u32 = (1 << 31) + 4;

/// Why a client operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The connection failed (connect, read or write).
    #[error("NBD connection: {0}")]
    Io(#[from] std::io::Error),
    /// The server closed the connection where the protocol does not allow it.
    #[error("NBD server closed the connection {0}")]
    Closed(String),
    /// The server sent something the protocol does not allow; the session is unusable.
    #[error("NBD protocol violation by the server: {0}")]
    Protocol(String),
    /// The server refused the export during the handshake; `message` is its own text.
    #[error("NBD server refused export {export:?}: {message} ({})", rep_name(*.reply))]
    Refused {
        export: String,
        /// The `NBD_REP_ERR_*` reply type.
        reply: u32,
        message: String,
    },
    /// The server failed a request; `message` names the command, range and error.
    #[error("{message}")]
    Server { errno: u32, message: String },
    /// The request was refused locally, before anything was sent (range, alignment,
    /// read-only export, unusable session).
    #[error("NBD request not sent: {0}")]
    Invalid(String),
}

fn proto_err(msg: impl Into<String>) -> ClientError {
    ClientError::Protocol(msg.into())
}

/// The usual name of an NBD error value (the spec fixes the numbers).
pub fn errno_name(errno: u32) -> &'static str {
    match errno {
        EPERM => "EPERM",
        EIO => "EIO",
        ENOMEM => "ENOMEM",
        EINVAL => "EINVAL",
        ENOSPC => "ENOSPC",
        EOVERFLOW => "EOVERFLOW",
        ENOTSUP => "ENOTSUP",
        ESHUTDOWN => "ESHUTDOWN",
        _ => "unknown error",
    }
}

fn errno_text(errno: u32) -> &'static str {
    match errno {
        EPERM => "operation not permitted",
        EIO => "input/output error",
        ENOMEM => "out of memory",
        EINVAL => "invalid argument",
        ENOSPC => "no space left on device",
        EOVERFLOW => "value too large",
        ENOTSUP => "operation not supported",
        ESHUTDOWN => "server is shutting down",
        _ => "not defined by the NBD protocol",
    }
}

/// The name of an option reply type, for messages.
fn rep_name(reply: u32) -> String {
    match reply {
        REP_ERR_UNSUP => "NBD_REP_ERR_UNSUP".to_owned(),
        REP_ERR_POLICY => "NBD_REP_ERR_POLICY".to_owned(),
        REP_ERR_INVALID => "NBD_REP_ERR_INVALID".to_owned(),
        REP_ERR_PLATFORM => "NBD_REP_ERR_PLATFORM".to_owned(),
        REP_ERR_TLS_REQD => "NBD_REP_ERR_TLS_REQD".to_owned(),
        REP_ERR_UNKNOWN => "NBD_REP_ERR_UNKNOWN".to_owned(),
        REP_ERR_SHUTDOWN => "NBD_REP_ERR_SHUTDOWN".to_owned(),
        REP_ERR_BLOCK_SIZE_REQD => "NBD_REP_ERR_BLOCK_SIZE_REQD".to_owned(),
        REP_ERR_TOO_BIG => "NBD_REP_ERR_TOO_BIG".to_owned(),
        other => format!("option reply type {other:#x}"),
    }
}

fn cmd_name(typ: u16) -> &'static str {
    match typ {
        CMD_READ => "NBD_CMD_READ",
        CMD_WRITE => "NBD_CMD_WRITE",
        CMD_DISC => "NBD_CMD_DISC",
        CMD_FLUSH => "NBD_CMD_FLUSH",
        CMD_TRIM => "NBD_CMD_TRIM",
        CMD_WRITE_ZEROES => "NBD_CMD_WRITE_ZEROES",
        _ => "NBD command",
    }
}

/// Server text made safe to print: lossy UTF-8, control characters replaced, bounded.
fn printable(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .chars()
        .take(MESSAGE_MAX)
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}

fn be_u16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
fn be_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
fn be_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

/// Any byte stream a session can run over.
trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

type BoxStream = Box<dyn Stream>;

/// Reads exactly `buf.len()` bytes; EOF is reported as the server closing during `what`.
async fn read_full<R: AsyncRead + Unpin>(
    rd: &mut R,
    buf: &mut [u8],
    what: &str,
) -> Result<(), ClientError> {
    match rd.read_exact(buf).await {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            Err(ClientError::Closed(format!("during {what}")))
        }
        Err(e) => Err(ClientError::Io(e)),
    }
}

/// What the handshake learned about the export.
#[derive(Debug, Clone, Copy)]
struct ExportInfo {
    size: u64,
    flags: u16,
    min_block: u32,
    preferred_block: u32,
    max_block: u32,
}

/// A connected NBD session in the transmission phase.
pub struct Client {
    rd: BufReader<ReadHalf<BoxStream>>,
    wr: BufWriter<WriteHalf<BoxStream>>,
    export: String,
    info: ExportInfo,
    /// READ/WRITE pieces: `min(max_request, PIECE_MAX)`, a multiple of the minimum block.
    piece: u32,
    next_handle: u64,
    /// Why the session can no longer be used (protocol violation, I/O error, an
    /// operation cancelled half-way, ESHUTDOWN).
    broken: Option<String>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("export", &self.export)
            .field("size", &self.info.size)
            .field("flags", &format_args!("{:#x}", self.info.flags))
            .field("min_block", &self.info.min_block)
            .field("max_request", &self.max_request())
            .field("broken", &self.broken)
            .finish()
    }
}

/// Where one pipelined operation takes its payload from and puts its data.
enum Io<'a> {
    /// READ: replies fill this buffer.
    Read(&'a mut [u8]),
    /// WRITE: each piece sends its part of this buffer.
    Write(&'a [u8]),
    /// WRITE of zeroes: each piece sends the start of this (zero) buffer.
    Zeroes(&'a [u8]),
    /// No payload either way (WRITE_ZEROES).
    None,
}

struct Pending {
    handle: u64,
    /// Offset relative to the start of the operation.
    rel: u64,
    len: u32,
}

impl Client {
    /// Connects to a unix socket and opens `export` (see [`Client::connect_stream`]).
    pub async fn connect_unix(path: &Path, export: &str) -> Result<Client, ClientError> {
        let s = tokio::net::UnixStream::connect(path).await.map_err(|e| {
            ClientError::Io(std::io::Error::new(
                e.kind(),
                format!("connecting to {}: {e}", path.display()),
            ))
        })?;
        Self::connect_stream(s, export).await
    }

    /// Connects over TCP to `addr` (`host:port`) and opens `export`; no TLS.
    pub async fn connect_tcp(addr: &str, export: &str) -> Result<Client, ClientError> {
        let s = tokio::net::TcpStream::connect(addr).await.map_err(|e| {
            ClientError::Io(std::io::Error::new(
                e.kind(),
                format!("connecting to {addr}: {e}"),
            ))
        })?;
        s.set_nodelay(true)?;
        Self::connect_stream(s, export).await
    }

    /// Runs the handshake on an already connected stream: fixed newstyle, then NBD_OPT_GO
    /// for `export` asking for NBD_INFO_BLOCK_SIZE (NBD_OPT_EXPORT_NAME if the server
    /// answers GO with NBD_REP_ERR_UNSUP). A refusal is [`ClientError::Refused`] with the
    /// server's message. The handshake must finish within [`HANDSHAKE_TIMEOUT`].
    pub async fn connect_stream<S>(stream: S, export: &str) -> Result<Client, ClientError>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        if export.len() > STRING_MAX {
            return Err(ClientError::Invalid(format!(
                "export name is {} bytes; the limit is {STRING_MAX}",
                export.len()
            )));
        }
        let boxed: BoxStream = Box::new(stream);
        let (rd, wr) = tokio::io::split(boxed);
        let mut rd = BufReader::with_capacity(64 * 1024, rd);
        let mut wr = BufWriter::with_capacity(64 * 1024, wr);
        let info = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(&mut rd, &mut wr, export))
            .await
            .map_err(|_| {
                ClientError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("NBD handshake did not finish within {HANDSHAKE_TIMEOUT:?}"),
                ))
            })??;
        let max = effective_max(info.min_block, info.max_block);
        let piece = round_down(max.min(PIECE_MAX), info.min_block);
        Ok(Client {
            rd,
            wr,
            export: export.to_owned(),
            info,
            piece,
            next_handle: 1,
            broken: None,
        })
    }

    /// The export's name as opened.
    pub fn export(&self) -> &str {
        &self.export
    }

    /// Export size in bytes.
    pub fn size(&self) -> u64 {
        self.info.size
    }

    /// The raw transmission flags.
    pub fn transmission_flags(&self) -> u16 {
        self.info.flags
    }

    fn flag(&self, f: u16) -> bool {
        self.info.flags & f != 0
    }

    /// The export takes no writes (`NBD_FLAG_READ_ONLY`).
    pub fn read_only(&self) -> bool {
        self.flag(TFLAG_READ_ONLY)
    }

    /// The server takes NBD_CMD_FLUSH.
    pub fn can_flush(&self) -> bool {
        self.flag(TFLAG_SEND_FLUSH)
    }

    /// The server honours NBD_CMD_FLAG_FUA.
    pub fn can_fua(&self) -> bool {
        self.flag(TFLAG_SEND_FUA)
    }

    /// The server takes NBD_CMD_WRITE_ZEROES.
    pub fn can_write_zeroes(&self) -> bool {
        self.flag(TFLAG_SEND_WRITE_ZEROES)
    }

    /// The server takes NBD_CMD_TRIM.
    pub fn can_trim(&self) -> bool {
        self.flag(TFLAG_SEND_TRIM)
    }

    /// The server allows several connections to the export (`NBD_FLAG_CAN_MULTI_CONN`).
    pub fn can_multi_conn(&self) -> bool {
        self.flag(TFLAG_CAN_MULTI_CONN)
    }

    /// Minimum block size: every offset and length must be a multiple of it (a range may
    /// end at the export size). 1 when the server sent no block sizes.
    pub fn min_block(&self) -> u32 {
        self.info.min_block
    }

    /// The server's preferred block size (4096 when it sent none).
    pub fn preferred_block(&self) -> u32 {
        self.info.preferred_block
    }

    /// Largest request this client sends: `min(server maximum, 32 MiB)`, a multiple of
    /// [`Client::min_block`]. `read` and `write` split larger ranges themselves.
    pub fn max_request(&self) -> u32 {
        effective_max(self.info.min_block, self.info.max_block)
    }

    /// Reads `buf.len()` bytes at `offset`, in pipelined pieces.
    pub async fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), ClientError> {
        let len = buf.len() as u64;
        self.check_range(CMD_READ, offset, len)?;
        let piece = self.piece;
        self.run(CMD_READ, 0, offset, len, piece, Io::Read(buf))
            .await
    }

    /// Writes `data` at `offset`, in pipelined pieces. `fua`: durable when this returns
    /// (NBD_CMD_FLAG_FUA on every piece, or a flush afterwards if the server has no FUA).
    pub async fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<(), ClientError> {
        let len = data.len() as u64;
        self.check_writable(CMD_WRITE)?;
        self.check_range(CMD_WRITE, offset, len)?;
        let flags = if fua && self.can_fua() {
            CMD_FLAG_FUA
        } else {
            0
        };
        let piece = self.piece;
        self.run(CMD_WRITE, flags, offset, len, piece, Io::Write(data))
            .await?;
        if fua && flags == 0 && len > 0 {
            self.flush().await?;
        }
        Ok(())
    }

    /// Makes `[offset, offset + len)` read as zeroes: NBD_CMD_WRITE_ZEROES (the server may
    /// deallocate) when offered, else writes of zero buffers. Pipelined either way.
    pub async fn write_zeroes(&mut self, offset: u64, len: u64) -> Result<(), ClientError> {
        self.check_writable(CMD_WRITE_ZEROES)?;
        self.check_range(CMD_WRITE_ZEROES, offset, len)?;
        if len == 0 {
            return Ok(());
        }
        if self.can_write_zeroes() {
            let piece = self.max_request();
            self.run(CMD_WRITE_ZEROES, 0, offset, len, piece, Io::None)
                .await
        } else {
            let piece = self.piece;
            let zeroes = vec![0u8; len.min(u64::from(piece)) as usize];
            self.run(CMD_WRITE, 0, offset, len, piece, Io::Zeroes(&zeroes))
                .await
        }
    }

    /// NBD_CMD_FLUSH: every write acknowledged so far is durable when this returns. A
    /// no-op when the server does not offer flush (it has no volatile cache to flush).
    pub async fn flush(&mut self) -> Result<(), ClientError> {
        if !self.can_flush() {
            self.usable()?;
            return Ok(());
        }
        self.run(CMD_FLUSH, 0, 0, 0, 0, Io::None).await
    }

    /// Ends the session: NBD_CMD_DISC, then closes the connection once the server has (or
    /// after a few seconds). A session broken by an earlier error is just dropped.
    pub async fn disconnect(mut self) -> Result<(), ClientError> {
        if self.broken.is_some() {
            return Ok(());
        }
        let req = Request {
            flags: 0,
            typ: CMD_DISC,
            handle: self.take_handle(),
            offset: 0,
            len: 0,
        };
        self.wr.write_all(&req.encode()).await?;
        self.wr.flush().await?;
        // Closing our side is fine even if the server already went away.
        let _ = self.wr.shutdown().await;
        // The server must not answer DISC; wait (bounded) for it to close, dropping
        // anything it sends anyway.
        let mut sink = [0u8; 512];
        let _ = tokio::time::timeout(DISCONNECT_WAIT, async {
            loop {
                match self.rd.read(&mut sink).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
        })
        .await;
        Ok(())
    }

    fn take_handle(&mut self) -> u64 {
        let h = self.next_handle;
        self.next_handle = self.next_handle.wrapping_add(1);
        h
    }

    fn usable(&self) -> Result<(), ClientError> {
        match &self.broken {
            Some(why) => Err(ClientError::Invalid(format!(
                "the NBD session is no longer usable: {why}"
            ))),
            None => Ok(()),
        }
    }

    fn check_writable(&self, typ: u16) -> Result<(), ClientError> {
        if self.read_only() {
            return Err(ClientError::Invalid(format!(
                "{} refused: export {:?} is read-only",
                cmd_name(typ),
                self.export
            )));
        }
        Ok(())
    }

    /// Refuses ranges past the end or off the minimum block size.
    fn check_range(&self, typ: u16, offset: u64, len: u64) -> Result<(), ClientError> {
        let size = self.info.size;
        let end = offset.checked_add(len).filter(|&e| e <= size);
        let Some(end) = end else {
            return Err(ClientError::Invalid(format!(
                "{} of {len} bytes at offset {offset} goes beyond the end of export {:?} ({size} bytes)",
                cmd_name(typ),
                self.export
            )));
        };
        let min = u64::from(self.info.min_block);
        if len > 0 && (!offset.is_multiple_of(min) || (!end.is_multiple_of(min) && end != size)) {
            return Err(ClientError::Invalid(format!(
                "{} of {len} bytes at offset {offset} is not aligned to the export's minimum block size {min}",
                cmd_name(typ)
            )));
        }
        Ok(())
    }

    /// Runs one operation, split into pieces of at most `piece` bytes (FLUSH: one request
    /// of length 0), keeping up to `WINDOW` in flight. A failed piece stops new pieces;
    /// those in flight are still collected so the stream stays in sync, and the first
    /// failure is returned. Errors other than the server's leave the session broken.
    async fn run(
        &mut self,
        typ: u16,
        flags: u16,
        offset: u64,
        len: u64,
        piece: u32,
        io: Io<'_>,
    ) -> Result<(), ClientError> {
        self.usable()?;
        if len == 0 && typ != CMD_FLUSH {
            return Ok(());
        }
        // Set while requests may be half-sent or replies half-read: if this future is
        // dropped midway, the session stays marked broken.
        self.broken = Some(format!(
            "an earlier {} was interrupted midway",
            cmd_name(typ)
        ));
        let result = self.pipeline(typ, flags, offset, len, piece, io).await;
        self.broken = match &result {
            Ok(()) => None,
            Err(ClientError::Server { errno, .. }) if *errno == ESHUTDOWN => {
                Some("the server is shutting down (ESHUTDOWN)".to_owned())
            }
            Err(ClientError::Server { .. }) => None,
            Err(e) => Some(e.to_string()),
        };
        result
    }

    async fn pipeline(
        &mut self,
        typ: u16,
        flags: u16,
        offset: u64,
        len: u64,
        piece: u32,
        mut io: Io<'_>,
    ) -> Result<(), ClientError> {
        let mut inflight: Vec<Pending> = Vec::with_capacity(WINDOW);
        let mut issued = 0u64;
        let mut first_err: Option<ClientError> = None;
        let mut flush_sent = false;
        loop {
            let mut sent = false;
            while first_err.is_none() && inflight.len() < WINDOW {
                let n = if typ == CMD_FLUSH {
                    if flush_sent {
                        break;
                    }
                    flush_sent = true;
                    0
                } else if issued < len {
                    // `piece` is a u32, so the minimum fits too.
                    (len - issued).min(u64::from(piece)) as u32
                } else {
                    break;
                };
                let handle = self.take_handle();
                let req = Request {
                    flags,
                    typ,
                    handle,
                    offset: offset + issued,
                    len: n,
                };
                self.wr.write_all(&req.encode()).await?;
                let from = issued as usize;
                match &io {
                    Io::Write(data) => self.wr.write_all(&data[from..from + n as usize]).await?,
                    Io::Zeroes(zeroes) => self.wr.write_all(&zeroes[..n as usize]).await?,
                    Io::Read(_) | Io::None => {}
                }
                inflight.push(Pending {
                    handle,
                    rel: issued,
                    len: n,
                });
                issued += u64::from(n);
                sent = true;
            }
            if sent {
                self.wr.flush().await?;
            }
            if inflight.is_empty() {
                break;
            }
            let mut hdr = [0u8; SIMPLE_REPLY_LEN];
            read_full(&mut self.rd, &mut hdr, "a transmission reply").await?;
            let magic = be_u32(&hdr[0..4]);
            if magic != SIMPLE_REPLY_MAGIC {
                return Err(if magic == STRUCTURED_REPLY_MAGIC {
                    proto_err(
                        "structured reply received, but structured replies were not negotiated",
                    )
                } else {
                    proto_err(format!("bad reply magic {magic:#010x}"))
                });
            }
            let errno = be_u32(&hdr[4..8]);
            let handle = be_u64(&hdr[8..16]);
            let Some(at) = inflight.iter().position(|p| p.handle == handle) else {
                return Err(proto_err(format!(
                    "reply for handle {handle:#x}, which no request in flight has"
                )));
            };
            let p = inflight.swap_remove(at);
            if errno == 0 {
                if let Io::Read(buf) = &mut io {
                    let from = p.rel as usize;
                    let dst = &mut buf[from..from + p.len as usize];
                    read_full(&mut self.rd, dst, "the data of a read reply").await?;
                }
            } else if first_err.is_none() {
                let at = offset + p.rel;
                let message = if typ == CMD_FLUSH {
                    format!(
                        "NBD server failed {}: {} ({})",
                        cmd_name(typ),
                        errno_name(errno),
                        errno_text(errno)
                    )
                } else {
                    format!(
                        "NBD server failed {} of {} bytes at offset {at}: {} ({}, error {errno})",
                        cmd_name(typ),
                        p.len,
                        errno_name(errno),
                        errno_text(errno)
                    )
                };
                first_err = Some(ClientError::Server { errno, message });
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

fn round_down(v: u32, to: u32) -> u32 {
    v - v % to.max(1)
}

/// `min(server maximum, REQUEST_CAP)` rounded down to the minimum block (never below it).
fn effective_max(min_block: u32, max_block: u32) -> u32 {
    round_down(max_block.min(REQUEST_CAP), min_block).max(min_block)
}

/// Sends one option with its data.
async fn send_option<W: AsyncWrite + Unpin>(
    wr: &mut W,
    option: u32,
    data: &[u8],
) -> Result<(), ClientError> {
    let mut out = Vec::with_capacity(16 + data.len());
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    // Callers bound the data (an export name ≤ 4096 plus a few bytes).
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    wr.write_all(&out).await?;
    wr.flush().await?;
    Ok(())
}

/// Reads one option reply to `option`: (reply type, data), data bounded by
/// `OPTION_REPLY_MAX`.
async fn read_option_reply<R: AsyncRead + Unpin>(
    rd: &mut R,
    option: u32,
) -> Result<(u32, Vec<u8>), ClientError> {
    let mut hdr = [0u8; 20];
    read_full(rd, &mut hdr, "option haggling").await?;
    let magic = be_u64(&hdr[0..8]);
    if magic != REPLY_MAGIC {
        return Err(proto_err(format!("bad option reply magic {magic:#018x}")));
    }
    let got = be_u32(&hdr[8..12]);
    if got != option {
        return Err(proto_err(format!(
            "option reply for option {got}, but option {option} was sent"
        )));
    }
    let typ = be_u32(&hdr[12..16]);
    let len = be_u32(&hdr[16..20]);
    if len > OPTION_REPLY_MAX {
        return Err(proto_err(format!(
            "option reply of {len} bytes; at most {OPTION_REPLY_MAX} are accepted"
        )));
    }
    let mut data = vec![0u8; len as usize];
    read_full(rd, &mut data, "option haggling").await?;
    Ok((typ, data))
}

async fn handshake<R, W>(rd: &mut R, wr: &mut W, export: &str) -> Result<ExportInfo, ClientError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut hello = [0u8; 18];
    read_full(rd, &mut hello[..16], "the greeting").await?;
    let magic = be_u64(&hello[0..8]);
    if magic != NBD_MAGIC {
        return Err(proto_err(format!(
            "bad greeting magic {magic:#018x} (is this an NBD server?)"
        )));
    }
    let magic = be_u64(&hello[8..16]);
    if magic == OLDSTYLE_MAGIC {
        return Err(proto_err(
            "the server uses oldstyle negotiation, which is not supported",
        ));
    }
    if magic != IHAVEOPT {
        return Err(proto_err(format!("bad newstyle magic {magic:#018x}")));
    }
    read_full(rd, &mut hello[16..18], "the greeting").await?;
    let hflags = be_u16(&hello[16..18]);
    if hflags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(proto_err(
            "the server does not offer fixed newstyle negotiation, which this client needs",
        ));
    }
    let no_zeroes = hflags & FLAG_NO_ZEROES != 0;
    let mut cflags = FLAG_C_FIXED_NEWSTYLE;
    if no_zeroes {
        cflags |= FLAG_C_NO_ZEROES;
    }
    wr.write_all(&cflags.to_be_bytes()).await?;

    let mut go = Vec::with_capacity(8 + export.len());
    go.extend_from_slice(&(export.len() as u32).to_be_bytes());
    go.extend_from_slice(export.as_bytes());
    go.extend_from_slice(&1u16.to_be_bytes());
    go.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    send_option(wr, OPT_GO, &go).await?;

    let mut export_info: Option<(u64, u16)> = None;
    let mut blocks: Option<(u32, u32, u32)> = None;
    for _ in 0..GO_REPLIES_MAX {
        let (typ, data) = read_option_reply(rd, OPT_GO).await?;
        match typ {
            REP_ACK => {
                if !data.is_empty() {
                    return Err(proto_err("NBD_REP_ACK to NBD_OPT_GO carries data"));
                }
                let Some((size, flags)) = export_info else {
                    return Err(proto_err("NBD_OPT_GO acknowledged without NBD_INFO_EXPORT"));
                };
                return finish_info(size, flags, blocks);
            }
            REP_INFO => {
                if data.len() < 2 {
                    return Err(proto_err("NBD_REP_INFO shorter than its type"));
                }
                match be_u16(&data[0..2]) {
                    INFO_EXPORT => {
                        if data.len() != 12 {
                            return Err(proto_err(format!(
                                "NBD_INFO_EXPORT of {} bytes, not 12",
                                data.len()
                            )));
                        }
                        export_info = Some((be_u64(&data[2..10]), be_u16(&data[10..12])));
                    }
                    INFO_BLOCK_SIZE => {
                        if data.len() != 14 {
                            return Err(proto_err(format!(
                                "NBD_INFO_BLOCK_SIZE of {} bytes, not 14",
                                data.len()
                            )));
                        }
                        blocks = Some((
                            be_u32(&data[2..6]),
                            be_u32(&data[6..10]),
                            be_u32(&data[10..14]),
                        ));
                    }
                    // Information we did not ask for (name, description, newer types).
                    _ => {}
                }
            }
            REP_ERR_UNSUP => {
                // A server without GO: the old way, which cannot report errors.
                return export_name(rd, wr, export, no_zeroes).await;
            }
            t if t & (1 << 31) != 0 => {
                // End the session the polite way (a soft disconnect); the server may
                // already be gone, and its ACK is not awaited.
                let _ = send_option(wr, OPT_ABORT, &[]).await;
                let message = if data.is_empty() {
                    "no reason given".to_owned()
                } else {
                    printable(&data)
                };
                return Err(ClientError::Refused {
                    export: export.to_owned(),
                    reply: t,
                    message,
                });
            }
            t => {
                return Err(proto_err(format!(
                    "unexpected option reply type {t} to NBD_OPT_GO"
                )))
            }
        }
    }
    Err(proto_err(format!(
        "more than {GO_REPLIES_MAX} replies to NBD_OPT_GO"
    )))
}

/// NBD_OPT_EXPORT_NAME: the server answers with the export or hangs up.
async fn export_name<R, W>(
    rd: &mut R,
    wr: &mut W,
    export: &str,
    no_zeroes: bool,
) -> Result<ExportInfo, ClientError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    send_option(wr, OPT_EXPORT_NAME, export.as_bytes()).await?;
    let mut b = [0u8; 10 + 124];
    let want = if no_zeroes { 10 } else { b.len() };
    match rd.read_exact(&mut b[..want]).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            return Err(ClientError::Closed(format!(
                "after NBD_OPT_EXPORT_NAME {export:?} (the server does not know NBD_OPT_GO \
                 and gives no reason; the export probably does not exist)"
            )))
        }
        Err(e) => return Err(ClientError::Io(e)),
    }
    finish_info(be_u64(&b[0..8]), be_u16(&b[8..10]), None)
}

/// Checks the export's size, flags and block sizes.
fn finish_info(
    size: u64,
    flags: u16,
    blocks: Option<(u32, u32, u32)>,
) -> Result<ExportInfo, ClientError> {
    if flags & TFLAG_HAS_FLAGS == 0 {
        return Err(proto_err(format!(
            "transmission flags {flags:#x} lack NBD_FLAG_HAS_FLAGS"
        )));
    }
    if size > i64::MAX as u64 {
        return Err(proto_err(format!("export size {size} is beyond 2^63 - 1")));
    }
    let (min_block, preferred_block, max_block) = blocks.unwrap_or((1, 4096, REQUEST_CAP));
    if !min_block.is_power_of_two() || min_block > 64 * 1024 {
        return Err(proto_err(format!(
            "minimum block size {min_block} is not a power of two up to 64 KiB"
        )));
    }
    if !preferred_block.is_power_of_two() || preferred_block < min_block {
        return Err(proto_err(format!(
            "preferred block size {preferred_block} is not a power of two of at least the minimum {min_block}"
        )));
    }
    if max_block < min_block {
        return Err(proto_err(format!(
            "maximum block size {max_block} is below the minimum {min_block}"
        )));
    }
    Ok(ExportInfo {
        size,
        flags,
        min_block,
        preferred_block,
        max_block,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn effective_max_caps_and_aligns() {
        assert_eq!(effective_max(4096, 64 * 1024 * 1024), REQUEST_CAP);
        assert_eq!(effective_max(4096, u32::MAX), REQUEST_CAP);
        assert_eq!(effective_max(4096, 64 * 1024), 64 * 1024);
        assert_eq!(effective_max(4096, 64 * 1024 + 100), 64 * 1024);
        assert_eq!(effective_max(1, 1000), 1000);
        assert_eq!(effective_max(512, 512), 512);
    }

    #[test]
    fn block_sizes_are_checked() {
        let f = TFLAG_HAS_FLAGS;
        assert!(finish_info(1 << 20, f, Some((4096, 4096, 1 << 20))).is_ok());
        assert!(finish_info(1 << 20, f, None).is_ok());
        assert!(finish_info(1 << 20, 0, None).is_err());
        assert!(finish_info(1 << 20, f, Some((3000, 4096, 1 << 20))).is_err());
        assert!(finish_info(1 << 20, f, Some((1 << 17, 1 << 17, 1 << 20))).is_err());
        assert!(finish_info(1 << 20, f, Some((4096, 512, 1 << 20))).is_err());
        assert!(finish_info(1 << 20, f, Some((4096, 4096, 512))).is_err());
        assert!(finish_info(u64::MAX, f, None).is_err());
    }

    #[test]
    fn names_and_printable() {
        assert_eq!(errno_name(EIO), "EIO");
        assert_eq!(errno_name(ESHUTDOWN), "ESHUTDOWN");
        assert_eq!(errno_name(4242), "unknown error");
        assert_eq!(printable(b"ok\x1b[2Jx\xff"), "ok?[2Jx\u{fffd}");
        let e = ClientError::Refused {
            export: "vm9".to_owned(),
            reply: REP_ERR_UNKNOWN,
            message: "export vm9 does not exist".to_owned(),
        };
        assert_eq!(
            e.to_string(),
            "NBD server refused export \"vm9\": export vm9 does not exist (NBD_REP_ERR_UNKNOWN)"
        );
    }
}
