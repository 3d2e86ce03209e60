//! converge rpc layer: the pipelined binary peer protocol between nodes (DESIGN.md, "rpc").
//!
//! * [`wire`]: frames and messages, byte by byte (docs/FORMAT-rpc.md).
//! * [`RpcClient`]: one pipelined TCP connection to a peer, lazily (re)connected.
//! * [`serve`] + [`Handler`]: accepts peers of the same cluster and runs their requests.
//! * [`handshakes`]: per-source bounds on connections not yet authenticated (the API's too).

mod client;
mod frame;
pub mod handshakes;
mod server;
pub mod wire;

pub use client::{RpcClient, RpcError, RECONNECT_BACKOFF_MAX_MS, RECONNECT_BACKOFF_MIN_MS};
pub use server::{
    serve, Handler, ServerTls, CONNECTIONS_MAX, HANDSHAKES_PER_SOURCE_MAX, HANDSHAKE_MS_MAX,
};
pub use wire::{
    ErrorCode, Hello, Request, Response, WireError, PROTOCOL_VERSION, PROTOCOL_VERSION_MIN,
};
