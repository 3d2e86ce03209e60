//! converge-nbd: the NBD front end of a node; speaks the protocol, holds no storage logic.
//!
//! A [`Resolver`] maps export names (one per volume) to [`BlockDev`]s; [`serve_unix`],
//! [`serve_tcp`] and [`serve_connection`] run fixed-newstyle NBD with simple replies,
//! pipelined requests and multi-conn. Wire details: `docs/FORMAT-nbd.md`.

mod dev;
mod error;
mod handshake;
pub mod proto;
mod server;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
mod transmission;

pub use dev::{BlockDev, DevError, DevErrorKind, ResolveError, Resolver};
pub use error::{ConfigError, NbdError};
pub use server::{
    serve_connection, serve_tcp, serve_unix, ServerConfig, ServerStats, StatsSnapshot,
};
