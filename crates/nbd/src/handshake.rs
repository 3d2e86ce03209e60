//! Fixed-newstyle option haggling: turns a fresh connection into a chosen export (or a
//! clean abort, or a request to upgrade to TLS), answering LIST/INFO/GO/EXPORT_NAME,
//! STARTTLS, STRUCTURED_REPLY and LIST/SET_META_CONTEXT and refusing everything else
//! politely.

use std::collections::HashSet;
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
/// The id of the first `qemu:dirty-bitmap:NAME` a SET selects; the next ones count up from
/// it in the order the client's queries first name them.
pub(crate) const DIRTY_BITMAP_FIRST_ID: u32 = 2;
/// The most `qemu:dirty-bitmap:` contexts one SET may select (a volume keeps at most 64
/// snapshots); a SET asking for more is refused with NBD_REP_ERR_TOO_BIG. With
/// `base:allocation`, at most 65 contexts, so BLOCK_STATUS replies stay bounded.
pub(crate) const DIRTY_BITMAPS_MAX: usize = 64;

/// What a selected metadata context reports, and from which device call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum MetaKind {
    /// `base:allocation`: `BlockDev::block_status`.
    Allocation,
    /// `qemu:dirty-bitmap:NAME`: `BlockDev::dirty_status(NAME)`.
    DirtyBitmap(String),
}

impl MetaKind {
    /// The descriptor flag bits the context defines; the others are reserved (sent as 0).
    pub fn flags_defined(&self) -> u32 {
        match self {
            MetaKind::Allocation => STATE_HOLE | STATE_ZERO,
            MetaKind::DirtyBitmap(_) => STATE_DIRTY,
        }
    }
}

/// The context's name, as on the wire.
impl std::fmt::Display for MetaKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MetaKind::Allocation => f.write_str(META_BASE_ALLOCATION),
            MetaKind::DirtyBitmap(name) => write!(f, "{META_QEMU_DIRTY_BITMAP}{name}"),
        }
    }
}

/// A metadata context selected by NBD_OPT_SET_META_CONTEXT, with the id its BLOCK_STATUS
/// chunks carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MetaContext {
    pub id: u32,
    pub kind: MetaKind,
}

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
    /// The contexts the last NBD_OPT_SET_META_CONTEXT selected for this export, in the
    /// order BLOCK_STATUS answers them; empty refuses NBD_CMD_BLOCK_STATUS.
    pub meta_contexts: Arc<[MetaContext]>,
}

/// What the options of one haggling pass have negotiated so far. A pass starts empty, so
/// nothing sent before NBD_OPT_STARTTLS survives into the TLS session (the spec's rule).
#[derive(Debug, Default)]
struct Haggling {
    structured: bool,
    /// The export name of the last NBD_OPT_SET_META_CONTEXT and what it selected, if it
    /// selected anything; any later SET replaces it, even a failed one.
    meta: Option<(String, Arc<[MetaContext]>)>,
}

impl Haggling {
    /// The contexts to use in transmission with export `name`: only those selected for
    /// that very name (the spec: a GO to another export drops the selection).
    fn meta_contexts_for(&self, name: &str) -> Arc<[MetaContext]> {
        match &self.meta {
            Some((selected, contexts)) if self.structured && selected == name => {
                Arc::clone(contexts)
            }
            Some((selected, _)) => {
                log::debug!(
                    "nbd: metadata contexts were selected for export {selected:?}, not {name:?}; dropped"
                );
                Arc::new([])
            }
            None => Arc::new([]),
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

/// The dirty bitmaps `dev` offers, in its order: names that cannot make a context name
/// (empty, which would read as the `qemu:dirty-bitmap:` wildcard; with NUL; over the
/// spec's 4096 bytes with the prefix) and repeats are left out.
fn offered_bitmaps<D: BlockDev>(dev: &D) -> Vec<String> {
    let mut seen = HashSet::new();
    dev.dirty_bitmaps()
        .into_iter()
        .filter(|name| {
            let usable = !name.is_empty()
                && !name.contains('\0')
                && META_QEMU_DIRTY_BITMAP.len() + name.len() <= STRING_MAX;
            if !usable {
                log::warn!("nbd: dirty bitmap name {name:?} cannot be offered; skipped");
            }
            usable && seen.insert(name.clone())
        })
        .collect()
}

/// Appends an NBD_REP_META_CONTEXT naming `prefix` + `leaf` with `id`.
fn meta_context_reply(out: &mut Vec<u8>, option: u32, id: u32, prefix: &str, leaf: &str) {
    let mut d = Vec::with_capacity(4 + prefix.len() + leaf.len());
    d.extend_from_slice(&id.to_be_bytes());
    d.extend_from_slice(prefix.as_bytes());
    d.extend_from_slice(leaf.as_bytes());
    option_reply(out, option, REP_META_CONTEXT, &d);
}

/// The contexts a SET with `queries` selects among `bitmaps`: `base:allocation` (id 1)
/// if a query names it, then each offered `qemu:dirty-bitmap:NAME` a query names exactly,
/// in the order first named, with ids from 2. Each at most once; wildcards and unknown
/// names select nothing. `Err(n)`: `n` bitmaps, more than `DIRTY_BITMAPS_MAX`.
fn select_meta_contexts(queries: &[String], bitmaps: &[String]) -> Result<Vec<MetaContext>, usize> {
    let offered: HashSet<&str> = bitmaps.iter().map(String::as_str).collect();
    let mut base = false;
    let mut chosen: Vec<&str> = Vec::new();
    let mut seen = HashSet::new();
    for q in queries {
        if q == META_BASE_ALLOCATION {
            base = true;
        } else if let Some(name) = q.strip_prefix(META_QEMU_DIRTY_BITMAP) {
            if offered.contains(name) && seen.insert(name) {
                chosen.push(name);
            }
        }
    }
    if chosen.len() > DIRTY_BITMAPS_MAX {
        return Err(chosen.len());
    }
    let base = base.then_some(MetaContext {
        id: BASE_ALLOCATION_ID,
        kind: MetaKind::Allocation,
    });
    // At most DIRTY_BITMAPS_MAX, so the ids fit.
    let bitmaps = (DIRTY_BITMAP_FIRST_ID..)
        .zip(chosen)
        .map(|(id, name)| MetaContext {
            id,
            kind: MetaKind::DirtyBitmap(name.to_owned()),
        });
    Ok(base.into_iter().chain(bitmaps).collect())
}

/// Answers NBD_OPT_LIST_META_CONTEXT / NBD_OPT_SET_META_CONTEXT. We offer
/// `base:allocation` and `qemu:dirty-bitmap:NAME` for each bitmap the export names.
/// LIST names `base:allocation` for no query, `base:` or `base:allocation`, and a bitmap
/// for no query, `qemu:`, `qemu:dirty-bitmap:` or its own name; SET selects what
/// `select_meta_contexts` says. Queries in other namespaces, and other leaves, are
/// ignored as the spec requires.
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
        state.meta = None;
        if !state.structured {
            let msg = "NBD_OPT_SET_META_CONTEXT needs NBD_OPT_STRUCTURED_REPLY first";
            return send_error(wr, option, REP_ERR_INVALID, msg).await;
        }
    }
    let Some(req) = parse_meta_context_request(data) else {
        let msg = "malformed NBD_OPT_LIST/SET_META_CONTEXT data";
        return send_error(wr, option, REP_ERR_INVALID, msg).await;
    };
    let dev = match resolver.resolve(&req.name).await {
        Ok(dev) => dev,
        Err(e) => {
            let msg = e.client_message(&req.name);
            log::info!("nbd: refusing metadata contexts: {msg}");
            return send_error(wr, option, REP_ERR_UNKNOWN, &msg).await;
        }
    };
    let bitmaps = offered_bitmaps(&*dev);
    let mut out = Vec::new();
    if set {
        let selected = match select_meta_contexts(&req.queries, &bitmaps) {
            Ok(selected) => selected,
            Err(n) => {
                let msg = format!(
                    "{n} qemu:dirty-bitmap: contexts asked for; at most {DIRTY_BITMAPS_MAX} may be selected"
                );
                return send_error(wr, option, REP_ERR_TOO_BIG, &msg).await;
            }
        };
        for c in &selected {
            match &c.kind {
                MetaKind::Allocation => {
                    meta_context_reply(&mut out, option, c.id, META_BASE_ALLOCATION, "")
                }
                MetaKind::DirtyBitmap(name) => {
                    meta_context_reply(&mut out, option, c.id, META_QEMU_DIRTY_BITMAP, name)
                }
            }
        }
        option_reply(&mut out, option, REP_ACK, &[]);
        send(wr, &out).await?;
        if !selected.is_empty() {
            state.meta = Some((req.name, selected.into()));
        }
        return Ok(());
    }
    // LIST sends the reserved id 0; each context once however many queries match it.
    let all = req.queries.is_empty();
    let has = |wanted: &[&str]| req.queries.iter().any(|q| wanted.contains(&q.as_str()));
    if all || has(&[META_BASE, META_BASE_ALLOCATION]) {
        meta_context_reply(&mut out, option, 0, META_BASE_ALLOCATION, "");
    }
    let all_bitmaps = all || has(&[META_QEMU, META_QEMU_DIRTY_BITMAP]);
    let named: HashSet<&str> = req
        .queries
        .iter()
        .filter_map(|q| q.strip_prefix(META_QEMU_DIRTY_BITMAP))
        .collect();
    for name in &bitmaps {
        if all_bitmaps || named.contains(name.as_str()) {
            meta_context_reply(&mut out, option, 0, META_QEMU_DIRTY_BITMAP, name);
        }
    }
    option_reply(&mut out, option, REP_ACK, &[]);
    send(wr, &out).await
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
                state.meta = None;
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
                let meta_contexts = state.meta_contexts_for(&name);
                return Ok(Haggled::Export(Negotiated {
                    dev,
                    name,
                    block_size_negotiated: false,
                    structured: state.structured,
                    meta_contexts,
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
                    let meta_contexts = state.meta_contexts_for(&req.name);
                    return Ok(Haggled::Export(Negotiated {
                        dev,
                        name: req.name,
                        block_size_negotiated: req.requests.contains(&INFO_BLOCK_SIZE),
                        structured: state.structured,
                        meta_contexts,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dev::{DevError, Extent};
    use bytes::Bytes;

    /// A device that only names bitmaps, to see which of them are offered.
    struct Named(Vec<String>);

    impl BlockDev for Named {
        fn size_bytes(&self) -> u64 {
            4096
        }
        async fn read(&self, _offset: u64, len: u32) -> Result<Bytes, DevError> {
            Ok(Bytes::from(vec![0u8; len as usize]))
        }
        async fn write(&self, _offset: u64, _data: Bytes, _fua: bool) -> Result<(), DevError> {
            Ok(())
        }
        async fn flush(&self) -> Result<(), DevError> {
            Ok(())
        }
        async fn trim(&self, _offset: u64, _len: u32) -> Result<(), DevError> {
            Ok(())
        }
        async fn write_zeroes(&self, _o: u64, _l: u32, _may_trim: bool) -> Result<(), DevError> {
            Ok(())
        }
        fn dirty_bitmaps(&self) -> Vec<String> {
            self.0.clone()
        }
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn only_names_that_make_a_context_name_are_offered_once_each() {
        let longest = "n".repeat(STRING_MAX - META_QEMU_DIRTY_BITMAP.len());
        let too_long = format!("{longest}n");
        let dev = Named(vec![
            "b".into(),
            String::new(),
            "a\0b".into(),
            "a".into(),
            "b".into(),
            too_long,
            longest.clone(),
        ]);
        assert_eq!(offered_bitmaps(&dev), vec!["b".into(), "a".into(), longest]);
    }

    #[tokio::test]
    async fn the_default_device_offers_no_bitmap_and_calls_any_range_dirty() {
        struct Plain;
        impl BlockDev for Plain {
            fn size_bytes(&self) -> u64 {
                4096
            }
            async fn read(&self, _offset: u64, len: u32) -> Result<Bytes, DevError> {
                Ok(Bytes::from(vec![0u8; len as usize]))
            }
            async fn write(&self, _o: u64, _data: Bytes, _fua: bool) -> Result<(), DevError> {
                Ok(())
            }
            async fn flush(&self) -> Result<(), DevError> {
                Ok(())
            }
            async fn trim(&self, _offset: u64, _len: u32) -> Result<(), DevError> {
                Ok(())
            }
            async fn write_zeroes(&self, _o: u64, _l: u32, _t: bool) -> Result<(), DevError> {
                Ok(())
            }
        }
        assert!(Plain.dirty_bitmaps().is_empty());
        assert_eq!(
            Plain.dirty_status("x", 512, 1000).await,
            Ok(vec![Extent {
                length: 1000,
                flags: STATE_DIRTY
            }])
        );
    }

    #[test]
    fn set_selects_exact_names_once_with_ids_in_query_order() {
        let bitmaps = strings(&["s1", "s2", "s3"]);
        let sel = |q: &[&str]| select_meta_contexts(&strings(q), &bitmaps);
        let dirty = |id, name: &str| MetaContext {
            id,
            kind: MetaKind::DirtyBitmap(name.to_owned()),
        };
        let base = MetaContext {
            id: BASE_ALLOCATION_ID,
            kind: MetaKind::Allocation,
        };
        assert_eq!(sel(&[]), Ok(vec![]));
        assert_eq!(
            sel(&[
                "qemu:",
                "qemu:dirty-bitmap:",
                "base:",
                "qemu:dirty-bitmap:s"
            ]),
            Ok(vec![])
        );
        assert_eq!(
            sel(&[
                "qemu:dirty-bitmap:s3",
                "qemu:dirty-bitmap:nope",
                "qemu:dirty-bitmap:s1",
                "base:allocation",
                "qemu:dirty-bitmap:s3",
            ]),
            Ok(vec![base, dirty(2, "s3"), dirty(3, "s1")])
        );
        // The bound counts distinct bitmaps.
        let many: Vec<String> = (0..=DIRTY_BITMAPS_MAX).map(|i| format!("b{i}")).collect();
        let q: Vec<String> = many
            .iter()
            .map(|n| format!("qemu:dirty-bitmap:{n}"))
            .collect();
        let all = select_meta_contexts(&q, &many);
        assert_eq!(all, Err(DIRTY_BITMAPS_MAX + 1));
        let mut at_bound = q[..DIRTY_BITMAPS_MAX].to_vec();
        at_bound.extend_from_slice(&q[..DIRTY_BITMAPS_MAX]);
        let got = select_meta_contexts(&at_bound, &many).unwrap();
        assert_eq!(got.len(), DIRTY_BITMAPS_MAX);
        assert_eq!(got.last().map(|c| c.id), Some(DIRTY_BITMAPS_MAX as u32 + 1));
    }
}
