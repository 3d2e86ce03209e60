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
//! the fixed-newstyle greeting; option replies are well framed, and META_CONTEXT replies
//! name `base:allocation` (with a nonzero id only for SET, only after structured replies
//! were acknowledged). Once transmission starts with structured replies negotiated,
//! every reply is self-describing, so each is checked against the spec: known magic, one
//! chunk per reply flagged DONE, OFFSET_DATA with data, BLOCK_STATUS with at least one
//! descriptor of nonzero length, reserved flags clear, at most 1 GiB described, error
//! chunks with a nonzero error and a message length that matches.

use converge_nbd::proto::*;
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
    let no_zeroes = data
        .get(0..4)
        .is_some_and(|f| u32::from_be_bytes([f[0], f[1], f[2], f[3]]) & FLAG_C_NO_ZEROES != 0);
    check_server_stream(&got[18..], no_zeroes);
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// Checks what the server sent after its greeting, as far as it can be read without the
/// client's side of the conversation. A session may end in the middle of a message (the
/// server hangs up on a bad client), so running out of bytes ends the check.
fn check_server_stream(mut got: &[u8], no_zeroes: bool) {
    let mut structured = false;
    // Option haggling.
    loop {
        if got.len() < 8 {
            return;
        }
        if got[0..8] != REPLY_MAGIC.to_be_bytes() {
            // The only other thing the server sends here is its answer to
            // NBD_OPT_EXPORT_NAME: size, flags and maybe 124 zeroes.
            let n = 10 + if no_zeroes { 0 } else { 124 };
            if got.len() < n {
                return;
            }
            got = &got[n..];
            break;
        }
        if got.len() < 20 {
            return;
        }
        let option = be32(&got[8..]);
        let typ = be32(&got[12..]);
        let len = be32(&got[16..]) as usize;
        let Some(data) = got.get(20..20 + len) else {
            return;
        };
        got = &got[20 + len..];
        match (option, typ) {
            (OPT_STARTTLS, REP_ACK) => return, // the rest is TLS records
            (OPT_STRUCTURED_REPLY, REP_ACK) => {
                assert!(!structured, "structured replies acknowledged twice");
                structured = true;
            }
            (OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT, REP_META_CONTEXT) => {
                assert!(len >= 4, "META_CONTEXT reply of {len} bytes");
                assert_eq!(&data[4..], META_BASE_ALLOCATION.as_bytes());
                let id = be32(data);
                if option == OPT_SET_META_CONTEXT {
                    assert!(structured, "a context selected without structured replies");
                    assert_ne!(id, 0, "SET must give a usable context id");
                } else {
                    assert_eq!(id, 0, "LIST sends the reserved id 0");
                }
            }
            (_, REP_META_CONTEXT) => panic!("META_CONTEXT reply to option {option}"),
            (OPT_GO, REP_ACK) => break,
            _ => {}
        }
    }
    if !structured {
        // Simple replies: whether data follows depends on the request; not checked.
        return;
    }
    // Transmission with structured replies: nothing but self-describing messages.
    while got.len() >= 4 {
        match be32(got) {
            SIMPLE_REPLY_MAGIC => {
                // Only for payload-less commands: READ always gets chunks.
                if got.len() < SIMPLE_REPLY_LEN {
                    return;
                }
                got = &got[SIMPLE_REPLY_LEN..];
            }
            STRUCTURED_REPLY_MAGIC => {
                let Some(h) = got.get(..STRUCTURED_REPLY_LEN) else {
                    return;
                };
                let h = ChunkHeader::decode(h.try_into().expect("20 bytes")).expect("magic");
                let Some(payload) =
                    got.get(STRUCTURED_REPLY_LEN..STRUCTURED_REPLY_LEN + h.len as usize)
                else {
                    return;
                };
                check_chunk(&h, payload);
                got = &got[STRUCTURED_REPLY_LEN + h.len as usize..];
            }
            other => panic!(
                "reply magic {other:#x} in transmission: {h:02x?}",
                h = &got[..4]
            ),
        }
    }
}

fn check_chunk(h: &ChunkHeader, payload: &[u8]) {
    // The server never splits a reply, so every chunk is the last one.
    assert_eq!(h.flags, REPLY_FLAG_DONE, "{h:?}");
    match h.typ {
        REPLY_TYPE_OFFSET_DATA => assert!(payload.len() >= 9, "{h:?}"),
        REPLY_TYPE_BLOCK_STATUS => {
            assert!(
                payload.len() >= 12 && (payload.len() - 4).is_multiple_of(8),
                "{h:?}"
            );
            assert_ne!(be32(payload), 0, "context id");
            let mut sum = 0u64;
            for d in payload[4..].chunks_exact(8) {
                let (len, flags) = (be32(d), be32(&d[4..]));
                assert_ne!(len, 0, "zero-length descriptor");
                assert_eq!(flags & !(STATE_HOLE | STATE_ZERO), 0, "reserved flags");
                sum += u64::from(len);
            }
            assert!(sum <= 1 << 30, "{sum} bytes described");
        }
        REPLY_TYPE_ERROR => {
            assert!(payload.len() >= 6, "{h:?}");
            assert_ne!(be32(payload), 0, "error chunk without an error");
            let mlen = usize::from(u16::from_be_bytes([payload[4], payload[5]]));
            assert_eq!(payload.len(), 6 + mlen, "message length");
            assert!(mlen <= STRING_MAX);
            assert!(
                std::str::from_utf8(&payload[6..]).is_ok(),
                "message not UTF-8"
            );
        }
        t => panic!("chunk type {t} is never sent"),
    }
}
