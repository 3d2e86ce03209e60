//! The two traits the NBD server is generic over: a block device (one export) and the
//! resolver that maps export names to devices. Storage logic lives behind them, not here.

use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;

use crate::proto;

/// What kind of failure a device reports; decides the NBD error value sent to the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DevErrorKind {
    /// Media or replication failure → `EIO`.
    Io,
    /// Out of space (thin pool full, quota) → `ENOSPC`.
    NoSpace,
    /// The request makes no sense for this device → `EINVAL`.
    Invalid,
    /// The request is too large for the device → `EOVERFLOW`.
    Overflow,
    /// The device cannot serve I/O right now (ownership lost, shutting down) → `ESHUTDOWN`,
    /// which tells a conforming client to disconnect (and reconnect, perhaps elsewhere).
    Unavailable,
}

/// A failed device operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind:?}: {message}")]
pub struct DevError {
    pub kind: DevErrorKind,
    pub message: String,
}

impl DevError {
    pub fn new(kind: DevErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// The NBD error value (spec-defined numbers) for this error.
    pub fn nbd_errno(&self) -> u32 {
        match self.kind {
            DevErrorKind::Io => proto::EIO,
            DevErrorKind::NoSpace => proto::ENOSPC,
            DevErrorKind::Invalid => proto::EINVAL,
            DevErrorKind::Overflow => proto::EOVERFLOW,
            DevErrorKind::Unavailable => proto::ESHUTDOWN,
        }
    }
}

/// One run of a block-status answer: `length` bytes with these NBD_STATE_* flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub length: u32,
    pub flags: u32,
}

/// `base:allocation`: the run is not allocated (a hole); writes to it may need space.
pub const STATE_HOLE: u32 = 1;
/// `base:allocation`: the run reads as all zeroes.
pub const STATE_ZERO: u32 = 2;
/// `qemu:dirty-bitmap:NAME` (the qemu namespace's one flag): the run changed since NAME.
pub const STATE_DIRTY: u32 = 1;

/// One export's I/O. The server has already checked ranges (`offset + len <= size_bytes()`),
/// lengths (`len >= 1`, reads/writes `<= max_request_bytes`, block and dirty status
/// `<= 1 GiB`) and, when the client negotiated block sizes, alignment to `min_block`;
/// otherwise requests may be unaligned.
///
/// Multi-conn contract: the server advertises `NBD_FLAG_CAN_MULTI_CONN`, so `flush` (and a
/// FUA write) must make durable every write acknowledged on *any* connection to the device.
pub trait BlockDev: Send + Sync + 'static {
    fn size_bytes(&self) -> u64;
    fn read(&self, offset: u64, len: u32) -> impl Future<Output = Result<Bytes, DevError>> + Send;
    /// `fua`: the write must be durable before this resolves.
    fn write(
        &self,
        offset: u64,
        data: Bytes,
        fua: bool,
    ) -> impl Future<Output = Result<(), DevError>> + Send;
    fn flush(&self) -> impl Future<Output = Result<(), DevError>> + Send;
    /// A hint: the range is no longer needed; its contents become unspecified.
    fn trim(&self, offset: u64, len: u32) -> impl Future<Output = Result<(), DevError>> + Send;
    /// The range must read back as zeroes; `may_trim` allows deallocating it to do so.
    fn write_zeroes(
        &self,
        offset: u64,
        len: u32,
        may_trim: bool,
    ) -> impl Future<Output = Result<(), DevError>> + Send;
    /// The allocation of `[offset, offset + len)` as runs covering at least a prefix of it
    /// (at least one run; lengths > 0, summing to at most `len`). Default: all data.
    ///
    /// Flags are `STATE_HOLE` / `STATE_ZERO`; 0 (allocated, contents unknown) is always a
    /// safe answer, `STATE_ZERO` a promise that the run reads as zeroes. The server asks for
    /// at most 1 GiB at a time and trims, drops or refuses (EIO) runs that break these rules.
    fn block_status(
        &self,
        offset: u64,
        len: u32,
    ) -> impl Future<Output = Result<Vec<Extent>, DevError>> + Send {
        async move {
            let _ = offset;
            Ok(vec![Extent {
                length: len,
                flags: 0,
            }])
        }
    }
    /// Names of the dirty bitmaps this export offers as `qemu:dirty-bitmap:NAME` metadata
    /// contexts (for converge: the snapshots of the volume older than this export's view).
    /// Asked on every NBD_OPT_LIST/SET_META_CONTEXT naming the export; names that are
    /// empty, repeated, contain NUL or make a context name over 4096 bytes are not offered.
    /// Default: none.
    fn dirty_bitmaps(&self) -> Vec<String> {
        Vec::new()
    }
    /// `qemu:dirty-bitmap:NAME` for `[offset, offset + len)`: runs covering at least a prefix
    /// of it, flags `STATE_DIRTY` where blocks changed since NAME, 0 where they did not.
    /// Same run rules as `block_status`. Only called for names `dirty_bitmaps` listed when
    /// the client selected them; one that has gone since should answer an error
    /// (`DevErrorKind::Invalid`). Default: the whole range dirty, always a safe answer.
    fn dirty_status(
        &self,
        bitmap: &str,
        offset: u64,
        len: u32,
    ) -> impl Future<Output = Result<Vec<Extent>, DevError>> + Send {
        async move {
            let _ = (bitmap, offset);
            Ok(vec![Extent {
                length: len,
                flags: STATE_DIRTY,
            }])
        }
    }
    /// Human-readable text for `NBD_INFO_DESCRIPTION`; `None` sends nothing.
    fn description(&self) -> Option<String> {
        None
    }
    /// The export takes no writes (a snapshot): advertised with `NBD_FLAG_READ_ONLY`, and
    /// writes, TRIMs and WRITE_ZEROES are refused with EPERM, as on a read-only server.
    fn read_only(&self) -> bool {
        false
    }
}

/// Why an export name could not be turned into a device.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    /// No such volume anywhere.
    #[error("unknown export")]
    Unknown,
    /// The volume exists but another node serves it; `owner` names it for humans,
    /// e.g. "node 2 (127.0.0.2)".
    #[error("owned by {owner}")]
    Elsewhere { owner: String },
    /// The volume exists here but cannot be served now (reason for humans).
    #[error("unavailable: {0}")]
    Unavailable(String),
}

impl ResolveError {
    /// The message sent to the client for export `name`.
    pub fn client_message(&self, name: &str) -> String {
        let shown = if name.is_empty() { "(default)" } else { name };
        match self {
            ResolveError::Unknown => format!("export {shown} does not exist"),
            ResolveError::Elsewhere { owner } => {
                format!("volume {shown} is owned by {owner}; connect there")
            }
            ResolveError::Unavailable(why) => {
                format!("volume {shown} is unavailable: {why}")
            }
        }
    }
}

/// Maps export names to devices (one export per volume).
pub trait Resolver: Send + Sync + 'static {
    type Dev: BlockDev;
    /// Names for `NBD_OPT_LIST`.
    fn list(&self) -> impl Future<Output = Vec<String>> + Send;
    fn resolve(
        &self,
        export: &str,
    ) -> impl Future<Output = Result<Arc<Self::Dev>, ResolveError>> + Send;
}
