//! Target `nbd_session`: the NBD server's handshake (option haggling) and transmission
//! phase (crates/nbd), fed a client's bytes over an in-memory duplex stream, serving RAM
//! devices (`converge_nbd::testing`). NBD carries no checksums, so the input is the raw
//! client byte stream; seeds are whole sessions that libFuzzer mutates.
//!
//! One input length in five serves the exports read-only; one in three requires TLS (the
//! server then refuses every option before NBD_OPT_STARTTLS, and a STARTTLS hands the rest
//! of the input to a real rustls handshake, which random bytes fail).
//!
//! Properties: no panic; `serve_connection` returns (Ok or an error) within the time
//! bound once the client has sent everything and closed; the server's first bytes are
//! the fixed-newstyle greeting.

use converge_nbd::proto::{IHAVEOPT, NBD_MAGIC};
use converge_nbd::testing::{MemDev, MemResolver};
use converge_nbd::{serve_connection, ResolveError, ServerConfig};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::runtime::Runtime;

/// Size of the main export: small, so whole-device requests stay cheap.
pub const EXPORT_BYTES: usize = 256 << 10;
/// Largest READ/WRITE the server accepts here.
pub const MAX_REQUEST_BYTES: u32 = 64 << 10;
const SESSION_LIMIT: Duration = Duration::from_secs(10);

fn runtime() -> &'static Runtime {
    static RT: OnceLock<Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime")
    })
}

/// A throwaway node certificate's NBD TLS settings, made once.
fn tls() -> Arc<converge_pki::rustls::ServerConfig> {
    static TLS: OnceLock<Arc<converge_pki::rustls::ServerConfig>> = OnceLock::new();
    TLS.get_or_init(|| {
        let ca = converge_pki::Ca::generate().expect("CA");
        let key = converge_pki::NewKey::generate().expect("key");
        let cert = ca
            .issue(
                &converge_pki::Subject::Node {
                    id: 1,
                    hosts: vec!["127.0.0.1".into()],
                },
                &key.public_key(),
            )
            .expect("certificate");
        converge_pki::NodeTls::from_pem(
            ca.cert_pem().as_bytes(),
            cert.as_bytes(),
            key.pem().as_bytes(),
        )
        .and_then(|t| t.nbd_server())
        .expect("TLS settings")
    })
    .clone()
}

pub fn nbd_session(data: &[u8]) {
    // Fresh devices per input: what one session writes must not change the next.
    let dev = Arc::new(MemDev::new(EXPORT_BYTES).with_description("fuzz disk"));
    let resolver = MemResolver::new()
        .with_export("vm01", dev)
        // An export whose size is not a multiple of the block size.
        .with_export("odd", Arc::new(MemDev::new(12_345)))
        .with_refusal(
            "vm02",
            ResolveError::Elsewhere {
                owner: "node 2 (127.0.0.2)".to_owned(),
            },
        )
        .with_refusal("vm03", ResolveError::Unavailable("resyncing".to_owned()));
    // Read-only exports (writes refused with EPERM) for one input length in five: both
    // modes are explored without taking a byte out of the client's stream.
    let read_only = data.len().is_multiple_of(5);
    let cfg = ServerConfig {
        max_request_bytes: MAX_REQUEST_BYTES,
        inflight_max: 8,
        read_only,
        handshake_timeout_ms: 5_000,
        tls: (data.len() % 3 == 1).then(tls),
        ..ServerConfig::default()
    };
    let (client, server) = tokio::io::duplex(64 << 10);
    let out = runtime().block_on(async move {
        let srv = tokio::spawn(serve_connection(server, Arc::new(resolver), cfg));
        let (mut rd, mut wr) = tokio::io::split(client);
        let send = async {
            let _ = wr.write_all(data).await;
            let _ = wr.shutdown().await;
        };
        // Drain the server's output as it comes, or a full pipe would stall it.
        let recv = async {
            let mut got = Vec::new();
            let _ = rd.read_to_end(&mut got).await;
            got
        };
        let session = async {
            let (_, got) = tokio::join!(send, recv);
            let result = srv.await.expect("the connection task panicked");
            (got, result)
        };
        match tokio::time::timeout(SESSION_LIMIT, session).await {
            Ok(x) => x,
            Err(_) => panic!("NBD server still busy {SESSION_LIMIT:?} after the client closed"),
        }
    });
    let (got, _result) = out;
    assert!(got.len() >= 18, "no greeting: {} bytes", got.len());
    assert_eq!(&got[0..8], &NBD_MAGIC.to_be_bytes());
    assert_eq!(&got[8..16], &IHAVEOPT.to_be_bytes());
}
