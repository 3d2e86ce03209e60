//! Fixed-newstyle option haggling: turns a fresh connection into a chosen export (or a
//! clean abort, or a request to upgrade to TLS), answering LIST/INFO/GO/EXPORT_NAME,
//! STARTTLS, STRUCTURED_REPLY and LIST/SET_META_CONTEXT and refusing everything else
//! politely.

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::dev::{BlockDev, Resolver};
use crate::error::NbdError;
use crate::proto::*;
use crate::server::ServerConfig;

/// Option data above this is never valid (longest are GO: 4 + 4096 name + 2 + a few info
/// requests, and SET_META_CONTEXT: 4 + 4096 name + 4 + a few queries), so it is not read
/// into memory.
pub(crate) const OPTION_DATA_MAX: u32 = 8 * 1024;
/// Oversized option data up to this is skipped and refused; beyond it we hang up.
pub(crate) const OPTION_DISCARD_MAX: u32 = 1024 * 1024;
/// Options accepted on one connection before it is considered abusive.
pub(crate) const OPTIONS_MAX: usize = 1024;
/// Our metadata context id for `base:allocation` (ids are the server's choice; 0 is what
/// LIST_META_CONTEXT sends, so a selected context gets another).
pub(crate) const BASE_ALLOCATION_ID: u32 = 1;

/// Where a connection stands with TLS; it decides how options are answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TlsPhase {
    /// No TLS configured: STARTTLS is refused, everything else is served in plaintext.
    Off,
    /// TLS configured and not yet started: only STARTTLS and ABORT are served.
    Required,
    /// STARTTLS done; the stream is TLS and a second STARTTLS is invalid.
    Active,
}

/// What the client announced in its flags.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClientFlags {
    pub fixed: bool,
    pub no_zeroes: bool,
}

/// How option haggling ended.
pub(crate) enum Haggled<D> {
    /// The client chose an export; transmission follows on the same stream.
    Export(Negotiated<D>),
    /// The client ended the handshake cleanly (ABORT, or closed between options).
    Closed,
    /// STARTTLS was acknowledged (only ever in `TlsPhase::Required`): the TLS handshake
    /// comes next, then haggling resumes over TLS in `TlsPhase::Active`.
    StartTls,
}

/// What option haggling chose.
pub(crate) struct Negotiated<D> {
    pub dev: Arc<D>,
    pub name: String,
    /// The client asked for NBD_INFO_BLOCK_SIZE in NBD_OPT_GO, so it promised to honour
    /// the advertised minimum block size; only then are unaligned requests refused.
    pub block_size_negotiated: bool,
    /// NBD_OPT_STRUCTURED_REPLY was acknowledged: READ replies are structured.
    pub structured: bool,
    /// The id of `base:allocation` if the last NBD_OPT_SET_META_CONTEXT selected it for
    /// this export; `None` refuses NBD_CMD_BLOCK_STATUS.
    pub meta_context: Option<u32>,
}

/// What the options of one haggling pass have negotiated so far. A pass starts empty, so
/// nothing sent before NBD_OPT_STARTTLS survives into the TLS session (the spec's rule).
#[derive(Debug, Default)]
struct Haggling {
    structured: bool,
    /// The export name of the last NBD_OPT_SET_META_CONTEXT if it selected
    /// `base:allocation`; any later SET replaces it, even a failed one.
    meta_export: Option<String>,
}

impl Haggling {
    /// The context to use in transmission with export `name`: only the one selected for
    /// that very name (the spec: a GO to another export drops the selection).
    fn meta_context_for(&self, name: &str) -> Option<u32> {
        match &self.meta_export {
            Some(selected) if self.structured && selected == name => Some(BASE_ALLOCATION_ID),
            Some(selected) => {
                log::debug!(
                    "nbd: metadata context was selected for export {selected:?}, not {name:?}; dropped"
                );
                None
            }
            None => None,
        }
    }
}

/// Transmission flags for an export under `cfg`; `structured`: structured replies were
/// negotiated, which NBD_FLAG_SEND_DF requires.
pub(crate) fn transmission_flags(cfg: &ServerConfig, structured: bool, read_only: bool) -> u16 {
    let mut f = TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH | TFLAG_SEND_FUA | TFLAG_CAN_MULTI_CONN;
    if structured {
        // We never split a READ reply, so NBD_CMD_FLAG_DF costs nothing to honour.
        f |= TFLAG_SEND_DF;
    }
    if cfg.read_only || read_only {
        f |= TFLAG_READ_ONLY;
    } else {
        f |= TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES;
    }
    f
}

/// Reads exactly `buf.len()` bytes; `Ok(false)` if the peer closed before the first byte.
pub(crate) async fn read_exact_or_eof<Rd: AsyncRead + Unpin>(
    rd: &mut Rd,
    buf: &mut [u8],
) -> Result<bool, NbdError> {
    let mut got = 0;
    while got < buf.len() {
        let n = rd.read(&mut buf[got..]).await?;
        if n == 0 {
            return if got == 0 {
                Ok(false)
            } else {
                Err(NbdError::Truncated)
            };
        }
        got += n;
    }
    Ok(true)
}

/// Reads exactly `buf.len()` bytes; EOF anywhere is a truncated message.
pub(crate) async fn read_exact<Rd: AsyncRead + Unpin>(
    rd: &mut Rd,
    buf: &mut [u8],
) -> Result<(), NbdError> {
    if read_exact_or_eof(rd, buf).await? || buf.is_empty() {
        Ok(())
    } else {
        Err(NbdError::Truncated)
    }
}

/// Reads and drops `len` bytes without buffering them all.
pub(crate) async fn discard<Rd: AsyncRead + Unpin>(rd: &mut Rd, len: u64) -> Result<(), NbdError> {
    let copied = tokio::io::copy(&mut rd.take(len), &mut tokio::io::sink()).await?;
    if copied == len {
        Ok(())
    } else {
        Err(NbdError::Truncated)
    }
}

async fn send<Wr: AsyncWrite + Unpin>(wr: &mut Wr, buf: &[u8]) -> Result<(), NbdError> {
    wr.write_all(buf).await?;
    wr.flush().await?;
    Ok(())
}

async fn send_error<Wr: AsyncWrite + Unpin>(
    wr: &mut Wr,
    option: u32,
    reply_type: u32,
    message: &str,
) -> Result<(), NbdError> {
    let mut msg = message.as_bytes();
    if msg.len() > STRING_MAX {
        msg = &msg[..STRING_MAX];
    }
    let mut out = Vec::with_capacity(20 + msg.len());
    option_reply(&mut out, option, reply_type, msg);
    send(wr, &out).await
}

fn info_reply(out: &mut Vec<u8>, option: u32, info: &[u8]) {
    option_reply(out, option, REP_INFO, info);
}

/// Answers NBD_OPT_LIST_META_CONTEXT / NBD_OPT_SET_META_CONTEXT. We offer exactly
/// `base:allocation`: LIST names it for no query, `base:` or `base:allocation`; SET
/// selects it for `base:allocation`. Queries in other namespaces, and other leaves of
/// `base:`, are ignored as the spec requires.
async fn meta_context<R, Wr>(
    wr: &mut Wr,
    resolver: &R,
    option: u32,
    data: &[u8],
    state: &mut Haggling,
) -> Result<(), NbdError>
where
    R: Resolver,
    Wr: AsyncWrite + Unpin,
{
    let set = option == OPT_SET_META_CONTEXT;
    if set {
        // A SET replaces the selection even when it fails.
        state.meta_export = None;
        if !state.structured {
            let msg = "NBD_OPT_SET_META_CONTEXT needs NBD_OPT_STRUCTURED_REPLY first";
            return send_error(wr, option, REP_ERR_INVALID, msg).await;
        }
    }
    let Some(req) = parse_meta_context_request(data) else {
        let msg = "malformed NBD_OPT_LIST/SET_META_CONTEXT data";
        return send_error(wr, option, REP_ERR_INVALID, msg).await;
    };
    if let Err(e) = resolver.resolve(&req.name).await {
        let msg = e.client_message(&req.name);
        log::info!("nbd: refusing metadata contexts: {msg}");
        return send_error(wr, option, REP_ERR_UNKNOWN, &msg).await;
    }
    let matches = |q: &String| q == META_BASE_ALLOCATION || (!set && q == "base:");
    let selected = if set {
        req.queries.iter().any(matches)
    } else {
        req.queries.is_empty() || req.queries.iter().any(matches)
    };
    let mut out = Vec::new();
    if selected {
        // LIST must send id 0 (reserved); SET sends the id BLOCK_STATUS replies will carry.
        let id = if set { BASE_ALLOCATION_ID } else { 0 };
        let mut d = id.to_be_bytes().to_vec();
        d.extend_from_slice(META_BASE_ALLOCATION.as_bytes());
        option_reply(&mut out, option, REP_META_CONTEXT, &d);
    }
    option_reply(&mut out, option, REP_ACK, &[]);
    send(wr, &out).await?;
    if set && selected {
        state.meta_export = Some(req.name);
    }
    Ok(())
}

/// Sends the greeting and reads the client's flags; `Ok(None)` if the client left first.
pub(crate) async fn greet<Rd, Wr>(rd: &mut Rd, wr: &mut Wr) -> Result<Option<ClientFlags>, NbdError>
where
    Rd: AsyncRead + Unpin,
    Wr: AsyncWrite + Unpin,
{
    let mut hello = [0u8; 18];
    hello[0..8].copy_from_slice(&NBD_MAGIC.to_be_bytes());
    hello[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    hello[16..18].copy_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    send(wr, &hello).await?;

    let mut cflags = [0u8; 4];
    if !read_exact_or_eof(rd, &mut cflags).await? {
        return Ok(None);
    }
    let cflags = u32::from_be_bytes(cflags);
    if cflags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(NbdError::ClientFlags(cflags));
    }
    Ok(Some(ClientFlags {
        fixed: cflags & FLAG_C_FIXED_NEWSTYLE != 0,
        no_zeroes: cflags & FLAG_C_NO_ZEROES != 0,
    }))
}

/// Answers options until the client picks an export, leaves, or (in `TlsPhase::Required`)
/// asks for TLS. `options_seen` counts options across the plaintext and the TLS part of
/// one connection, so the bound holds for the whole handshake.
pub(crate) async fn haggle<R, Rd, Wr>(
    rd: &mut Rd,
    wr: &mut Wr,
    resolver: &R,
    cfg: &ServerConfig,
    client: ClientFlags,
    tls: TlsPhase,
    options_seen: &mut usize,
) -> Result<Haggled<R::Dev>, NbdError>
where
    R: Resolver,
    Rd: AsyncRead + Unpin,
    Wr: AsyncWrite + Unpin,
{
    let ClientFlags { fixed, no_zeroes } = client;
    let mut state = Haggling::default();

    while *options_seen < OPTIONS_MAX {
        *options_seen += 1;
        let mut hdr = [0u8; 16];
        if !read_exact_or_eof(rd, &mut hdr).await? {
            return Ok(Haggled::Closed);
        }
        let mut magic = [0u8; 8];
        magic.copy_from_slice(&hdr[0..8]);
        let magic = u64::from_be_bytes(magic);
        if magic != IHAVEOPT {
            return Err(NbdError::BadMagic {
                phase: "option haggling",
                got: magic,
            });
        }
        let option = u32::from_be_bytes([hdr[8], hdr[9], hdr[10], hdr[11]]);
        let len = u32::from_be_bytes([hdr[12], hdr[13], hdr[14], hdr[15]]);
        if !fixed && option != OPT_EXPORT_NAME {
            return Err(NbdError::NonFixedOption(option));
        }
        if len > OPTION_DATA_MAX {
            if option == OPT_SET_META_CONTEXT {
                // Refused, and a refused SET still replaces the selection.
                state.meta_export = None;
            }
            if option == OPT_EXPORT_NAME || len > OPTION_DISCARD_MAX {
                let _ = send_error(wr, option, REP_ERR_TOO_BIG, "option data too large").await;
                return Err(NbdError::OptionTooLarge { option, len });
            }
            discard(rd, u64::from(len)).await?;
            let msg =
                format!("option {option} carries {len} bytes; the limit is {OPTION_DATA_MAX}");
            send_error(wr, option, REP_ERR_TOO_BIG, &msg).await?;
            continue;
        }
        let mut data = vec![0u8; len as usize];
        read_exact(rd, &mut data).await?;

        if tls == TlsPhase::Required {
            match option {
                OPT_STARTTLS | OPT_ABORT => {}
                // It cannot be answered with an error, and serving it would skip TLS.
                OPT_EXPORT_NAME => return Err(NbdError::TlsRequiredExportName),
                _ => {
                    let msg = "TLS is required: send NBD_OPT_STARTTLS first";
                    send_error(wr, option, REP_ERR_TLS_REQD, msg).await?;
                    continue;
                }
            }
        }

        match option {
            OPT_EXPORT_NAME => {
                let name = String::from_utf8(data)
                    .map_err(|_| NbdError::ExportRefused("export name is not UTF-8".to_owned()))?;
                let dev = resolver
                    .resolve(&name)
                    .await
                    .map_err(|e| NbdError::ExportRefused(e.client_message(&name)))?;
                let mut out = Vec::with_capacity(10 + 124);
                out.extend_from_slice(&dev.size_bytes().to_be_bytes());
                let tflags = transmission_flags(cfg, state.structured, dev.read_only());
                out.extend_from_slice(&tflags.to_be_bytes());
                if !no_zeroes {
                    out.extend_from_slice(&[0u8; 124]);
                }
                send(wr, &out).await?;
                let meta_context = state.meta_context_for(&name);
                return Ok(Haggled::Export(Negotiated {
                    dev,
                    name,
                    block_size_negotiated: false,
                    structured: state.structured,
                    meta_context,
                }));
            }
            OPT_ABORT => {
                // The client may already be gone; it is leaving either way.
                let mut out = Vec::new();
                option_reply(&mut out, option, REP_ACK, &[]);
                let _ = send(wr, &out).await;
                return Ok(Haggled::Closed);
            }
            OPT_LIST => {
                if len != 0 {
                    send_error(wr, option, REP_ERR_INVALID, "NBD_OPT_LIST takes no data").await?;
                    continue;
                }
                let mut out = Vec::new();
                for name in resolver.list().await {
                    if name.len() > STRING_MAX {
                        continue;
                    }
                    let mut d = Vec::with_capacity(4 + name.len());
                    d.extend_from_slice(&(name.len() as u32).to_be_bytes());
                    d.extend_from_slice(name.as_bytes());
                    option_reply(&mut out, option, REP_SERVER, &d);
                }
                option_reply(&mut out, option, REP_ACK, &[]);
                send(wr, &out).await?;
            }
            OPT_INFO | OPT_GO => {
                let Some(req) = parse_info_request(&data) else {
                    send_error(
                        wr,
                        option,
                        REP_ERR_INVALID,
                        "malformed NBD_OPT_INFO/GO data",
                    )
                    .await?;
                    continue;
                };
                let dev = match resolver.resolve(&req.name).await {
                    Ok(dev) => dev,
                    Err(e) => {
                        let msg = e.client_message(&req.name);
                        log::info!("nbd: refusing export: {msg}");
                        send_error(wr, option, REP_ERR_UNKNOWN, &msg).await?;
                        continue;
                    }
                };
                let mut out = Vec::new();
                let mut export = Vec::with_capacity(12);
                export.extend_from_slice(&INFO_EXPORT.to_be_bytes());
                export.extend_from_slice(&dev.size_bytes().to_be_bytes());
                let tflags = transmission_flags(cfg, state.structured, dev.read_only());
                export.extend_from_slice(&tflags.to_be_bytes());
                info_reply(&mut out, option, &export);
                if req.requests.contains(&INFO_NAME) {
                    let mut d = INFO_NAME.to_be_bytes().to_vec();
                    d.extend_from_slice(req.name.as_bytes());
                    info_reply(&mut out, option, &d);
                }
                if req.requests.contains(&INFO_DESCRIPTION) {
                    if let Some(text) = dev.description() {
                        let mut d = INFO_DESCRIPTION.to_be_bytes().to_vec();
                        let text = text.as_bytes();
                        d.extend_from_slice(&text[..text.len().min(STRING_MAX)]);
                        info_reply(&mut out, option, &d);
                    }
                }
                let mut bs = Vec::with_capacity(14);
                bs.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
                bs.extend_from_slice(&cfg.min_block.to_be_bytes());
                bs.extend_from_slice(&cfg.preferred_block.to_be_bytes());
                bs.extend_from_slice(&cfg.max_request_bytes.to_be_bytes());
                info_reply(&mut out, option, &bs);
                option_reply(&mut out, option, REP_ACK, &[]);
                send(wr, &out).await?;
                if option == OPT_GO {
                    let meta_context = state.meta_context_for(&req.name);
                    return Ok(Haggled::Export(Negotiated {
                        dev,
                        name: req.name,
                        block_size_negotiated: req.requests.contains(&INFO_BLOCK_SIZE),
                        structured: state.structured,
                        meta_context,
                    }));
                }
            }
            OPT_STARTTLS => match tls {
                TlsPhase::Off => {
                    let msg = "TLS is not offered on this socket";
                    send_error(wr, option, REP_ERR_POLICY, msg).await?;
                }
                TlsPhase::Active => {
                    let msg = "TLS is already active on this connection";
                    send_error(wr, option, REP_ERR_INVALID, msg).await?;
                }
                TlsPhase::Required if len != 0 => {
                    let msg = "NBD_OPT_STARTTLS takes no data";
                    send_error(wr, option, REP_ERR_INVALID, msg).await?;
                }
                TlsPhase::Required => {
                    let mut out = Vec::with_capacity(20);
                    option_reply(&mut out, option, REP_ACK, &[]);
                    send(wr, &out).await?;
                    return Ok(Haggled::StartTls);
                }
            },
            OPT_STRUCTURED_REPLY => {
                if len != 0 {
                    let msg = "NBD_OPT_STRUCTURED_REPLY takes no data";
                    send_error(wr, option, REP_ERR_INVALID, msg).await?;
                } else if state.structured {
                    let msg = "structured replies are already negotiated";
                    send_error(wr, option, REP_ERR_INVALID, msg).await?;
                } else {
                    let mut out = Vec::with_capacity(20);
                    option_reply(&mut out, option, REP_ACK, &[]);
                    send(wr, &out).await?;
                    state.structured = true;
                }
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                meta_context(wr, resolver, option, &data, &mut state).await?;
            }
            _ => {
                let msg = format!("option {option} is not supported");
                send_error(wr, option, REP_ERR_UNSUP, &msg).await?;
            }
        }
    }
    Err(NbdError::TooManyOptions(OPTIONS_MAX))
}
