//! Target `rpc_session`: a whole server-side peer connection (crates/rpc/src/server.rs),
//! handshake and request loop, against a handler stub.
//!
//! The rpc crate's only public server entry point is `serve(TcpListener, ...)`, so the
//! harness runs one server per process on a loopback listener (127.0.0.1, port 0) and
//! opens one connection per input; no product code changes.
//!
//! Byte 0 is the mode: bit 0 sends the rest as raw bytes; otherwise the rest is a list of
//! records `[ctl u8][type u8][len u16 LE][payload]`, each sent as a frame with correct
//! crcs unless `ctl` asks for damage (bit 0: bad payload crc, bit 1: non-zero flags, bit 2:
//! bad header crc, bit 3: payload length announced larger than sent, bit 4: payload length
//! above the server's bound). Bit 1 of the mode leaves out the valid hello that otherwise
//! comes first; bits 2 and 3 send it from another cluster or protocol version.
//!
//! Properties: no panic (a panic in a server task aborts the process under libFuzzer),
//! the server closes the connection within the time bound, and everything it sends is a
//! sequence of well-formed answer frames (a frame cut at the very end is allowed: the
//! connection may be dropped mid-answer), at most one answer per request id.

use crate::input::Input;
use bytes::Bytes;
use converge_rpc::wire::{decode_frame, decode_response, encode_request, FrameHeader, WireError};
use converge_rpc::{serve, Handler, Hello, Request, Response, PROTOCOL_VERSION};
use converge_types::{
    BlocksReply, ClusterId, ExtentOp, ExtentReply, Knobs, NodeId, ReadReply, Version,
};
use std::collections::HashSet;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::runtime::Runtime;

pub const CLUSTER: ClusterId = ClusterId(0xc0_ffee);
const SERVER_NODE: NodeId = NodeId(1);
const PEER_NODE: NodeId = NodeId(2);
/// The server's frame bound here: small, so oversized announcements are cheap to probe.
pub const FRAME_BYTES_MAX: usize = 256 << 10;
/// A session that has not ended by then is a hang: the harness panics.
const SESSION_LIMIT: Duration = Duration::from_secs(10);

/// Answers like a replica would, with sizes taken from the request (capped, so a fuzzer
/// cannot make the stub allocate gigabytes; answers above the frame bound stay possible).
struct Stub;

impl Handler for Stub {
    fn handle(&self, _peer: NodeId, req: Request) -> impl Future<Output = Response> + Send {
        let data = |len: u64| Bytes::from(vec![0xa5; len.min(2 * FRAME_BYTES_MAX as u64) as usize]);
        let resp = match req {
            Request::VolRead { len, .. }
            | Request::Extent {
                op: ExtentOp::Read { len, .. },
                ..
            } => Response::Extent(ExtentReply::Read(ReadReply {
                data: data(u64::from(len)),
                bad_blocks: vec![0],
                suspect: vec![],
                version: Version(7),
            })),
            Request::Extent {
                op: ExtentOp::ReadBlocks { len, .. },
                ..
            } => Response::Extent(ExtentReply::Blocks(BlocksReply {
                data: data(u64::from(len)),
                bad_blocks: vec![],
                suspect: vec![],
                versions: vec![Version(3); (len as usize / 4096).min(1024)],
            })),
            Request::Extent {
                op: ExtentOp::Versions { count, .. },
                ..
            } => Response::Extent(ExtentReply::Versions(vec![
                Version(1);
                (count as usize)
                    .min(FRAME_BYTES_MAX / 4)
            ])),
            Request::Extent {
                op: ExtentOp::Digest { .. },
                ..
            } => Response::Extent(ExtentReply::Digest(42)),
            Request::Extent {
                op: ExtentOp::WriteBlocks { versions, .. },
                ..
            } => Response::Extent(ExtentReply::Written(versions.len() as u32)),
            Request::VolZero { trim: true, .. } => {
                Response::err(converge_rpc::ErrorCode::Busy, "stub: trims refused")
            }
            _ => Response::ok(),
        };
        async move { resp }
    }
}

struct Server {
    rt: Runtime,
    addr: SocketAddr,
}

fn server() -> &'static Server {
    static SERVER: OnceLock<Server> = OnceLock::new();
    SERVER.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind a loopback port");
        let addr = listener.local_addr().expect("local address");
        let knobs = Knobs {
            rpc_frame_bytes_max: FRAME_BYTES_MAX,
            rpc_inflight_max: 8,
            replica_timeout_ms: 2_000,
            ..Knobs::default()
        };
        rt.spawn(async move {
            let r = serve(listener, CLUSTER, SERVER_NODE, Arc::new(Stub), knobs, None).await;
            panic!("rpc server stopped: {r:?}");
        });
        Server { rt, addr }
    })
}

/// The valid first frame of a peer.
pub fn hello_frame(cluster: ClusterId, protocol_version: u16) -> Vec<u8> {
    encode_request(
        0,
        &Request::Hello(Hello {
            cluster,
            node: PEER_NODE,
            protocol_version,
        }),
    )
    .to_vec()
}

/// The bytes a harness input sends (see the module docs).
pub fn client_bytes(data: &[u8]) -> (Vec<u8>, bool) {
    let mut inp = Input::new(data);
    let mode = inp.u8();
    if mode & 1 == 1 {
        return (inp.rest().to_vec(), false);
    }
    let mut out = Vec::new();
    if mode & 2 == 0 {
        let cluster = if mode & 4 == 0 {
            CLUSTER
        } else {
            ClusterId(CLUSTER.0 + 1)
        };
        let version = if mode & 8 == 0 {
            PROTOCOL_VERSION
        } else {
            PROTOCOL_VERSION + 1
        };
        out.extend_from_slice(&hello_frame(cluster, version));
    }
    let mut id = 1u64;
    while !inp.is_empty() {
        let ctl = inp.u8();
        let msg_type = inp.u8();
        let len = usize::from(inp.u16());
        let payload = inp.bytes(len);
        let mut h = FrameHeader {
            version: PROTOCOL_VERSION,
            msg_type,
            flags: u8::from(ctl & 2 != 0),
            request_id: id,
            payload_len: payload.len() as u32,
            payload_crc: crc32c::crc32c(payload),
        };
        if ctl & 1 != 0 {
            h.payload_crc ^= 1;
        }
        if ctl & 8 != 0 {
            h.payload_len += 1 + u32::from(ctl >> 5);
        }
        if ctl & 16 != 0 {
            h.payload_len = FRAME_BYTES_MAX as u32 + 1 + u32::from(ctl >> 5);
        }
        let mut head = h.encode();
        if ctl & 4 != 0 {
            head[28] ^= 0x80;
        }
        out.extend_from_slice(&head);
        out.extend_from_slice(payload);
        id += 1;
    }
    (out, true)
}

pub fn rpc_session(data: &[u8]) {
    let (bytes, structured) = client_bytes(data);
    let srv = server();
    let answers = srv.rt.block_on(async {
        let sock = tokio::net::TcpSocket::new_v4().expect("socket");
        // Reset instead of TIME_WAIT: thousands of connections a second would run out of
        // ephemeral ports otherwise. (Deprecated because a non-zero linger blocks the
        // dropping thread; a zero one does not wait.)
        #[allow(deprecated)]
        sock.set_linger(Some(Duration::ZERO)).expect("SO_LINGER");
        let stream = sock
            .connect(srv.addr)
            .await
            .expect("connect to the loopback server");
        let (mut rd, mut wr) = stream.into_split();
        let send = async {
            // The server may close early (bad hello, bad header): later writes then fail.
            let _ = wr.write_all(&bytes).await;
            let _ = wr.shutdown().await;
        };
        let recv = async {
            let mut got = Vec::new();
            let _ = rd.read_to_end(&mut got).await;
            got
        };
        match tokio::time::timeout(SESSION_LIMIT, async { tokio::join!(send, recv).1 }).await {
            Ok(got) => got,
            Err(_) => panic!(
                "rpc server kept the connection open {SESSION_LIMIT:?} after the client finished"
            ),
        }
    });
    check_answers(&answers, structured);
}

fn check_answers(stream: &[u8], unique_ids: bool) {
    let mut buf = Bytes::copy_from_slice(stream);
    let mut seen = HashSet::new();
    while !buf.is_empty() {
        let (h, payload, used) = match decode_frame(&buf, usize::MAX) {
            Ok(f) => f,
            // The connection may end in the middle of an answer (the writer is stopped).
            Err(WireError::Truncated { .. }) => return,
            Err(e) => panic!("server sent a bad frame: {e}"),
        };
        assert_eq!(h.flags, 0, "server answers carry no flags");
        if let Err(e) = decode_response(h.msg_type, payload) {
            panic!("server answer {} does not decode: {e}", h.request_id);
        }
        if unique_ids {
            assert!(
                seen.insert(h.request_id),
                "request {} answered twice",
                h.request_id
            );
        }
        buf = buf.slice(used..);
    }
}
