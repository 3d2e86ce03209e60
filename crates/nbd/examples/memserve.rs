//! Serves a RAM-backed export over a unix socket, to poke the server with real clients:
//! `cargo run -p converge-nbd --features testing --example memserve -- /tmp/nbd.sock vm01 256`
//! then `nbdinfo 'nbd+unix:///vm01?socket=/tmp/nbd.sock'`.

use std::sync::Arc;

use converge_nbd::testing::{MemDev, MemResolver};
use converge_nbd::{serve_unix, ResolveError, ServerConfig};

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let socket = args
        .next()
        .unwrap_or_else(|| "/tmp/converge-nbd.sock".to_owned());
    let name = args.next().unwrap_or_else(|| "vm01".to_owned());
    let size_mib: usize = match args.next() {
        Some(s) => s.parse().map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("size in MiB: {e}"),
            )
        })?,
        None => 64,
    };
    let _ = std::fs::remove_file(&socket);
    let listener = tokio::net::UnixListener::bind(&socket)?;
    let dev = Arc::new(MemDev::new(size_mib << 20).with_description("converge RAM export"));
    let resolver = MemResolver::new().with_export(&name, dev).with_refusal(
        "elsewhere",
        ResolveError::Elsewhere {
            owner: "node 2 (127.0.0.2)".to_owned(),
        },
    );
    eprintln!("serving {name} ({size_mib} MiB) on nbd+unix:///{name}?socket={socket}");
    serve_unix(listener, Arc::new(resolver), ServerConfig::default()).await
}
