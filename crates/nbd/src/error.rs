//! Why a connection ended abnormally, and why a configuration was refused.

use std::io;

/// A server configuration that cannot be honoured on the wire.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("inflight_max must be at least 1")]
    InflightZero,
    #[error("min_block {0} must be a power of two between 1 and 65536")]
    MinBlock(u32),
    #[error("preferred_block {preferred} must be a power of two >= min_block {min}")]
    PreferredBlock { preferred: u32, min: u32 },
    #[error("max_request_bytes {max} must be a multiple of min_block {min}, at least preferred_block and at most 64 MiB")]
    MaxRequest { max: u32, min: u32 },
}

/// Why `serve_connection` stopped before a clean end (`NBD_OPT_ABORT`, `NBD_CMD_DISC` or
/// the client closing between messages all count as clean).
#[derive(Debug, thiserror::Error)]
pub enum NbdError {
    #[error("socket error: {0}")]
    Io(#[from] io::Error),
    #[error("client sent bad magic {got:#x} during {phase}; not an NBD client or out of sync")]
    BadMagic { phase: &'static str, got: u64 },
    #[error("client flags {0:#x} contain bits this server did not offer")]
    ClientFlags(u32),
    #[error("client sent more than {0} options without choosing an export")]
    TooManyOptions(usize),
    #[error("client sent option {option} with {len} bytes of data, far beyond any valid option")]
    OptionTooLarge { option: u32, len: u32 },
    #[error("client without fixed newstyle sent option {0}, which cannot be answered")]
    NonFixedOption(u32),
    #[error("NBD_OPT_EXPORT_NAME refused: {0}")]
    ExportRefused(String),
    #[error("handshake not finished within {0} ms")]
    HandshakeTimeout(u64),
    #[error("client sent NBD_OPT_EXPORT_NAME before NBD_OPT_STARTTLS, but this server requires TLS and that option cannot be refused; closing (configure the client for TLS, e.g. nbds:// or tls-creds)")]
    TlsRequiredExportName,
    #[error("client sent {0} bytes after NBD_OPT_STARTTLS without waiting for the reply; they are not trusted into the TLS session, closing")]
    PlaintextAfterStartTls(usize),
    #[error("TLS handshake failed: {0} (does the client trust this server's CA, and does it present a certificate the server's client CA signed, if one is required?)")]
    TlsHandshake(io::Error),
    #[error("client closed the connection in the middle of a message")]
    Truncated,
    #[error("invalid server configuration: {0}")]
    Config(#[from] ConfigError),
}
