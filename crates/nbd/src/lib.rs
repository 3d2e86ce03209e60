//! converge-nbd: the NBD front end of a node; speaks the protocol, holds no storage logic.
//!
//! A [`Resolver`] maps export names (one per volume) to [`BlockDev`]s; [`serve_unix`],
//! [`serve_tcp`] and [`serve_connection`] run fixed-newstyle NBD with pipelined requests
//! and multi-conn: simple replies, or structured replies for clients that negotiate them,
//! with the `base:allocation` metadata context and NBD_CMD_BLOCK_STATUS answered from
//! [`BlockDev::block_status`] ([`Extent`] runs flagged [`STATE_HOLE`] / [`STATE_ZERO`];
//! the server checks them before they reach the wire), and qemu's
//! `qemu:dirty-bitmap:NAME` contexts for the bitmaps [`BlockDev::dirty_bitmaps`] names,
//! answered from [`BlockDev::dirty_status`] ([`STATE_DIRTY`]). TCP connections may be
//! required to use TLS (NBD_OPT_STARTTLS; [`ServerConfig::tls`], [`tls_server_config`]).
//! Wire details: `docs/FORMAT-nbd.md`.

pub mod client;
mod dev;
mod error;
mod handshake;
pub mod proto;
mod server;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
mod tls;
mod transmission;

pub use dev::{
    BlockDev, DevError, DevErrorKind, Extent, ResolveError, Resolver, STATE_DIRTY, STATE_HOLE,
    STATE_ZERO,
};
pub use error::{ConfigError, NbdError};
pub use server::{
    serve_connection, serve_tcp, serve_unix, ClientWatch, ServerConfig, ServerStats, StatsSnapshot,
};
pub use tls::{tls_server_config, tls_server_config_from_files, TlsConfigError};
/// The rustls this crate was built with, so callers name the same `rustls::ServerConfig`.
pub use tokio_rustls::rustls;
