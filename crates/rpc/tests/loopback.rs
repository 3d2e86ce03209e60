//! Client and server over real loopback TCP: pipelining, refusals, timeouts, reconnects.

use bytes::Bytes;
use converge_rpc::wire::{self, msg, FrameHeader, HEADER_LEN};
use converge_rpc::{
    serve, ErrorCode, Handler, Hello, Request, Response, RpcClient, RpcError, PROTOCOL_VERSION,
    PROTOCOL_VERSION_MIN,
};
use converge_types::{
    ClusterId, DriveId, Epoch, ExtentKey, ExtentOp, ExtentReply, Knobs, NodeId, ReadReply,
    SlabIndex, Version, VolumeId, BLOCK_SIZE,
};
use rand::Rng;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

const CLUSTER: ClusterId = ClusterId(0xc0ffee);
const SERVER_NODE: NodeId = NodeId(7);
/// Requests on this drive are never answered.
const DRIVE_BLACK_HOLE: DriveId = DriveId(999);
/// Requests on this drive are refused as coming from an old epoch.
const DRIVE_FENCED: DriveId = DriveId(998);
/// Requests on this drive take 10 s.
const DRIVE_SLOW: DriveId = DriveId(997);

/// A tiny engine: stores writes by (drive, key, offset), verifies crcs, sleeps randomly so
/// answers complete out of order, and records arrival vs completion order.
#[derive(Default)]
struct Store {
    blocks: Mutex<HashMap<(DriveId, ExtentKey, u64), Bytes>>,
    arrivals: AtomicU64,
    order: Mutex<Vec<u64>>,
}

impl Handler for Store {
    async fn handle(&self, peer: NodeId, req: Request) -> Response {
        assert_eq!(peer, NodeId(1));
        let arrival = self.arrivals.fetch_add(1, Ordering::SeqCst);
        let pause = rand::thread_rng().gen_range(0..3000u64);
        tokio::time::sleep(Duration::from_micros(pause)).await;
        let Request::Extent { drive, op } = req else {
            return Response::ok();
        };
        let resp = match op {
            ExtentOp::Read { .. } | ExtentOp::Zero { .. } if drive == DRIVE_BLACK_HOLE => {
                std::future::pending::<()>().await;
                Response::ok()
            }
            ExtentOp::Read { .. } if drive == DRIVE_SLOW => {
                tokio::time::sleep(Duration::from_secs(10)).await;
                Response::ok()
            }
            ExtentOp::Read { .. } if drive == DRIVE_FENCED => {
                Response::err(ErrorCode::StaleEpoch, "epoch 1 < 2")
            }
            ExtentOp::Write {
                key,
                offset,
                crcs,
                data,
                ..
            } => {
                let ok = data
                    .chunks(BLOCK_SIZE)
                    .zip(crcs.iter())
                    .all(|(b, c)| crc32c::crc32c(b) == *c);
                if !ok {
                    Response::err(ErrorCode::ChecksumMismatch, "block crc mismatch")
                } else {
                    self.blocks
                        .lock()
                        .expect("lock")
                        .insert((drive, key, offset), data);
                    Response::ok()
                }
            }
            ExtentOp::Read {
                key, offset, len, ..
            } => {
                let (data, version) =
                    match self.blocks.lock().expect("lock").get(&(drive, key, offset)) {
                        Some(d) => (d.clone(), Version(1)),
                        None => (Bytes::from(vec![0u8; len as usize]), Version(0)),
                    };
                Response::Extent(ExtentReply::Read(ReadReply {
                    data,
                    bad_blocks: vec![],
                    suspect: vec![],
                    version,
                }))
            }
            _ => Response::ok(),
        };
        self.order.lock().expect("lock").push(arrival);
        resp
    }
}

fn knobs(timeout_ms: u64, frame_max: usize) -> Knobs {
    Knobs {
        replica_timeout_ms: timeout_ms,
        rpc_inflight_max: 64,
        rpc_frame_bytes_max: frame_max,
        ..Knobs::default()
    }
}

async fn start_on(
    addr: SocketAddr,
    store: Arc<Store>,
    knobs: Knobs,
) -> (SocketAddr, JoinHandle<std::io::Result<()>>) {
    let listener = TcpListener::bind(addr).await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(serve(listener, CLUSTER, SERVER_NODE, store, knobs, None));
    (addr, task)
}

async fn start(knobs: Knobs) -> (SocketAddr, Arc<Store>, JoinHandle<std::io::Result<()>>) {
    let store = Arc::new(Store::default());
    let (addr, task) = start_on("127.0.0.1:0".parse().expect("addr"), store.clone(), knobs).await;
    (addr, store, task)
}

fn client(addr: SocketAddr, knobs: &Knobs) -> RpcClient {
    RpcClient::new(addr.to_string(), Hello::new(CLUSTER, NodeId(1)), knobs)
}

fn key(slab: u64) -> ExtentKey {
    ExtentKey {
        volume: VolumeId(5),
        slab: SlabIndex(slab),
    }
}

fn write(drive: DriveId, offset: u64, blocks: usize, fill: u8) -> Request {
    let data = Bytes::from(vec![fill; blocks * BLOCK_SIZE]);
    let crcs: Vec<u32> = data.chunks(BLOCK_SIZE).map(crc32c::crc32c).collect();
    write_with_crcs(drive, offset, data, crcs)
}

fn write_with_crcs(drive: DriveId, offset: u64, data: Bytes, crcs: Vec<u32>) -> Request {
    let op = ExtentOp::Write {
        key: key(0),
        epoch: Epoch(1),
        version: Version(offset),
        offset,
        crcs: crcs.into(),
        data,
        codec: converge_types::Compression::None,
    };
    Request::Extent { drive, op }
}

fn read(drive: DriveId, offset: u64, len: u32) -> Request {
    let op = ExtentOp::Read {
        key: key(0),
        epoch: Epoch(1),
        offset,
        len,
    };
    Request::Extent { drive, op }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_calls_on_one_connection_get_their_own_answers() {
    let k = knobs(10_000, 1 << 20);
    let (addr, store, _server) = start(k.clone()).await;
    let c = client(addr, &k);
    const N: u64 = 400;
    let mut tasks = Vec::new();
    for i in 0..N {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            let blocks = 1 + (i % 3) as usize;
            let resp = c.call(write(DriveId(1), i * 65536, blocks, i as u8)).await;
            assert_eq!(resp.expect("write"), Response::ok());
            let resp = c
                .call(read(DriveId(1), i * 65536, (blocks * BLOCK_SIZE) as u32))
                .await
                .expect("read");
            match resp {
                Response::Extent(ExtentReply::Read(ReadReply {
                    data, bad_blocks, ..
                })) => {
                    assert!(bad_blocks.is_empty());
                    assert_eq!(data.len(), blocks * BLOCK_SIZE, "request {i}");
                    assert!(
                        data.iter().all(|b| *b == i as u8),
                        "request {i} got another's data"
                    );
                }
                other => panic!("request {i}: {other:?}"),
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    assert_eq!(
        c.connections_made(),
        1,
        "everything went over one connection"
    );
    assert_eq!(c.peer_node().await, Some(SERVER_NODE));
    let order = store.order.lock().expect("lock").clone();
    assert_eq!(order.len() as u64, 2 * N);
    let inversions = order.windows(2).filter(|w| w[0] > w[1]).count();
    assert!(
        inversions > 0,
        "handlers ran concurrently and finished out of order"
    );
    assert_eq!(c.call(Request::Ping).await.expect("ping"), Response::Pong);
}

#[tokio::test]
async fn remote_errors_are_mapped_with_their_code() {
    let k = knobs(10_000, 1 << 20);
    let (addr, _store, _server) = start(k.clone()).await;
    let c = client(addr, &k);
    match c.call(read(DRIVE_FENCED, 0, 4096)).await {
        Err(RpcError::Remote { code, message }) => {
            assert_eq!(code, ErrorCode::StaleEpoch);
            assert_eq!(message, "epoch 1 < 2");
        }
        other => panic!("{other:?}"),
    }
    // A corrupted block reaches the handler (the rpc layer only checks counts) and is refused.
    let data = Bytes::from(vec![9; 2 * BLOCK_SIZE]);
    let mut crcs: Vec<u32> = data.chunks(BLOCK_SIZE).map(crc32c::crc32c).collect();
    crcs[1] ^= 1;
    let w = write_with_crcs(DriveId(1), 0, data.clone(), crcs.clone());
    assert!(matches!(
        c.call(w).await,
        Err(RpcError::Remote {
            code: ErrorCode::ChecksumMismatch,
            ..
        })
    ));
    // Wrong crc count: refused locally, never sent.
    crcs.pop();
    let w = write_with_crcs(DriveId(1), 0, data, crcs);
    assert!(matches!(c.call(w).await, Err(RpcError::Invalid(_))));
    assert!(matches!(
        c.call(Request::Hello(Hello::new(CLUSTER, NodeId(1)))).await,
        Err(RpcError::Invalid(_))
    ));
}

#[tokio::test]
async fn wrong_cluster_is_refused_with_a_clear_error() {
    let k = knobs(10_000, 1 << 20);
    let (addr, _store, _server) = start(k.clone()).await;
    let stranger = RpcClient::new(
        addr.to_string(),
        Hello::new(ClusterId(0xbad), NodeId(1)),
        &k,
    );
    match stranger.call(Request::Ping).await {
        Err(RpcError::Refused { code, message, .. }) => {
            assert_eq!(code, ErrorCode::Invalid);
            assert!(message.contains("cluster mismatch"), "{message}");
            // The refusal names neither cluster: a stranger learns nothing to retry with.
            assert!(!message.contains(&CLUSTER.to_string()), "{message}");
        }
        other => panic!("expected Refused, got {other:?}"),
    }
    assert_eq!(stranger.connections_made(), 0);
    // The server is still there for its own cluster.
    let friend = client(addr, &k);
    assert_eq!(
        friend.call(Request::Ping).await.expect("ping"),
        Response::Pong
    );
}

#[tokio::test]
async fn a_caller_older_than_the_oldest_version_spoken_is_refused() {
    let k = knobs(10_000, 1 << 20);
    let (addr, _store, _server) = start(k.clone()).await;
    let hello = Hello {
        cluster: CLUSTER,
        node: NodeId(1),
        protocol_version: PROTOCOL_VERSION_MIN - 1,
    };
    let c = RpcClient::new(addr.to_string(), hello, &k);
    match c.call(Request::Ping).await {
        Err(RpcError::Refused { message, .. }) => {
            assert!(message.contains("protocol version"), "{message}")
        }
        other => panic!("{other:?}"),
    }
}

/// A caller of a newer release (speaking up to the next version) is answered in this
/// build's newest version, and the connection runs in it.
#[tokio::test]
async fn a_newer_caller_is_answered_in_the_newest_version_both_speak() {
    let k = knobs(10_000, 1 << 20);
    let (addr, _store, _server) = start(k.clone()).await;
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let hello = Hello {
        cluster: CLUSTER,
        node: NodeId(1),
        protocol_version: PROTOCOL_VERSION + 1,
    };
    // A newer caller frames its hello in the oldest version it speaks.
    let f = wire::encode_request(1, &Request::Hello(hello)).at_version(PROTOCOL_VERSION_MIN);
    s.write_all(&f.to_vec()).await.expect("hello");
    let (h, r) = raw_read(&mut s).await.expect("hello answer");
    assert_eq!(r, Response::HelloOk { node: SERVER_NODE });
    assert_eq!(
        h.version, PROTOCOL_VERSION,
        "answered in the version agreed"
    );
    s.write_all(&wire::encode_request(2, &Request::Ping).to_vec())
        .await
        .expect("ping");
    let (h, _) = raw_read(&mut s).await.expect("pong");
    assert_eq!((h.request_id, h.version), (2, PROTOCOL_VERSION));
}

/// A caller that speaks a newer version than a strict older peer (one that refuses any
/// other version, as releases before 0.2 do) is refused, then says hello again in the
/// next older version it speaks, and is served.
#[tokio::test]
async fn a_refused_newer_hello_is_retried_in_the_older_version() {
    let k = knobs(10_000, 1 << 20);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let strict = tokio::spawn(async move {
        let mut offered = Vec::new();
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut head = [0u8; wire::HEADER_LEN];
            s.read_exact(&mut head).await.unwrap();
            let h = FrameHeader::decode(&head, 4096).unwrap();
            let mut payload = vec![0u8; h.payload_len as usize];
            s.read_exact(&mut payload).await.unwrap();
            let Request::Hello(hello) = wire::decode_request(h.msg_type, payload.into()).unwrap()
            else {
                panic!("not a hello")
            };
            offered.push(hello.protocol_version);
            if hello.protocol_version != PROTOCOL_VERSION {
                let no = Response::err(ErrorCode::Invalid, "protocol version mismatch");
                s.write_all(&wire::encode_response(h.request_id, &no).to_vec())
                    .await
                    .unwrap();
                continue;
            }
            let ok = Response::HelloOk { node: SERVER_NODE };
            s.write_all(&wire::encode_response(h.request_id, &ok).to_vec())
                .await
                .unwrap();
            let mut head = [0u8; wire::HEADER_LEN];
            s.read_exact(&mut head).await.unwrap();
            let h = FrameHeader::decode(&head, 4096).unwrap();
            assert_eq!(
                h.version, PROTOCOL_VERSION,
                "the connection runs in the version agreed"
            );
            let pong = wire::encode_response(h.request_id, &Response::Pong);
            s.write_all(&pong.to_vec()).await.unwrap();
            return offered;
        }
    });
    let hello = Hello {
        cluster: CLUSTER,
        node: NodeId(1),
        protocol_version: PROTOCOL_VERSION,
    };
    let c = RpcClient::new(addr.to_string(), hello, &k).speaking(PROTOCOL_VERSION + 1);
    c.call(Request::Ping).await.expect("served after the retry");
    assert_eq!(
        strict.await.unwrap(),
        vec![PROTOCOL_VERSION + 1, PROTOCOL_VERSION]
    );
}

#[tokio::test]
async fn call_times_out_when_the_handler_never_answers() {
    let k = knobs(300, 1 << 20);
    let (addr, _store, _server) = start(k.clone()).await;
    let c = client(addr, &k);
    assert_eq!(c.call(Request::Ping).await.expect("ping"), Response::Pong);
    let t0 = Instant::now();
    match c.call(read(DRIVE_BLACK_HOLE, 0, 4096)).await {
        Err(RpcError::Timeout { timeout_ms, .. }) => assert_eq!(timeout_ms, 300),
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(t0.elapsed() >= Duration::from_millis(290));
    // The connection survives a timed-out call.
    assert_eq!(c.call(Request::Ping).await.expect("ping"), Response::Pong);
    assert_eq!(c.connections_made(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_death_fails_pending_calls_and_the_client_reconnects() {
    let k = knobs(5_000, 1 << 20);
    let (addr, store, server) = start(k.clone()).await;
    let c = client(addr, &k);
    assert_eq!(c.call(Request::Ping).await.expect("ping"), Response::Pong);
    let pending: Vec<_> = (0..5)
        .map(|_| {
            let c = c.clone();
            tokio::spawn(async move { c.call(read(DRIVE_SLOW, 0, 4096)).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    server.abort();
    let t0 = Instant::now();
    for p in pending {
        match p.await.expect("task") {
            Err(RpcError::Disconnected { .. }) => {}
            other => panic!("expected Disconnected, got {other:?}"),
        }
    }
    assert!(
        t0.elapsed() < Duration::from_secs(4),
        "failed fast, not by timeout"
    );

    // While the server is down, calls fail (connect refused, then backoff) without hanging.
    match c.call(Request::Ping).await {
        Err(RpcError::Connect { .. }) => {}
        other => panic!("expected Connect error, got {other:?}"),
    }

    let (_, _server) = start_on(addr, store, k.clone()).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match c.call(Request::Ping).await {
            Ok(r) => {
                assert_eq!(r, Response::Pong);
                break;
            }
            Err(e) => {
                assert!(Instant::now() < deadline, "no reconnect: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    assert_eq!(c.connections_made(), 2);
}

#[tokio::test]
async fn oversized_request_is_refused_before_sending() {
    let k = knobs(10_000, 64 << 10);
    let (addr, _store, _server) = start(k.clone()).await;
    let c = client(addr, &k);
    match c.call(write(DriveId(1), 0, 16, 1)).await {
        Err(RpcError::FrameTooLarge { size, max }) => {
            assert!(size > 16 * BLOCK_SIZE);
            assert_eq!(max, 64 << 10);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(c.connections_made(), 0, "nothing was sent");
    assert_eq!(
        c.call(write(DriveId(1), 0, 15, 1)).await.expect("fits"),
        Response::ok()
    );
    // An answer that would not fit is replaced by an error instead of a huge frame.
    match c.call(read(DriveId(2), 0, 128 << 10)).await {
        Err(RpcError::Remote { code, message }) => {
            assert_eq!(code, ErrorCode::Invalid);
            assert!(message.contains("rpc_frame_bytes_max"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

// ---- raw-socket tests: a misbehaving peer --------------------------------------------------

async fn raw_read(s: &mut TcpStream) -> Option<(FrameHeader, Response)> {
    let mut h = [0u8; HEADER_LEN];
    if s.read_exact(&mut h).await.is_err() {
        return None;
    }
    let header = FrameHeader::decode(&h, 1 << 20).expect("server header is valid");
    let mut p = vec![0u8; header.payload_len as usize];
    s.read_exact(&mut p).await.expect("payload");
    let resp = wire::decode_response(header.msg_type, Bytes::from(p)).expect("response");
    Some((header, resp))
}

async fn raw_connect(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let hello = wire::encode_request(1, &Request::Hello(Hello::new(CLUSTER, NodeId(1))));
    s.write_all(&hello.to_vec()).await.expect("hello");
    let (h, r) = raw_read(&mut s).await.expect("hello answer");
    assert_eq!(h.request_id, 1);
    assert_eq!(r, Response::HelloOk { node: SERVER_NODE });
    s
}

fn raw_frame(msg_type: u8, id: u64, payload: &[u8]) -> Vec<u8> {
    let h = FrameHeader {
        version: PROTOCOL_VERSION,
        msg_type,
        flags: 0,
        request_id: id,
        payload_len: payload.len() as u32,
        payload_crc: crc32c::crc32c(payload),
    };
    let mut v = h.encode().to_vec();
    v.extend_from_slice(payload);
    v
}

#[tokio::test]
async fn server_refuses_frames_above_the_bound_and_closes() {
    let k = knobs(10_000, 64 << 10);
    let (addr, _store, _server) = start(k.clone()).await;
    let mut s = raw_connect(addr).await;
    let h = FrameHeader {
        version: PROTOCOL_VERSION,
        msg_type: msg::WRITE,
        flags: 0,
        request_id: 77,
        payload_len: (64 << 10) + 1,
        payload_crc: 0,
    };
    s.write_all(&h.encode()).await.expect("send");
    let (h, r) = raw_read(&mut s).await.expect("refusal");
    assert_eq!(h.request_id, 77);
    match r {
        Response::Err { code, message } => {
            assert_eq!(code, ErrorCode::Invalid);
            assert!(message.contains("rpc_frame_bytes_max"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    let mut rest = Vec::new();
    let n = s.read_to_end(&mut rest).await.expect("clean close");
    assert_eq!(n, 0, "connection closed after the refusal");
}

/// A first frame larger than any hello is not read (nor answered): the connection is closed
/// at its header, so a stranger cannot make the node buffer megabytes before the hello check.
#[tokio::test]
async fn a_first_frame_larger_than_a_hello_closes_the_connection_unread() {
    let k = knobs(10_000, 1 << 20);
    let (addr, _store, _server) = start(k.clone()).await;
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let frame = raw_frame(msg::HELLO, 1, &vec![0u8; 64 << 10]);
    // The server may close before it has taken all of it; that is the point.
    let _ = s.write_all(&frame).await;
    let mut rest = Vec::new();
    let n = s.read_to_end(&mut rest).await.unwrap_or(0);
    assert_eq!(n, 0, "closed without an answer");
    // Its own peers still connect.
    let friend = client(addr, &k);
    assert_eq!(
        friend.call(Request::Ping).await.expect("ping"),
        Response::Pong
    );
}

#[tokio::test]
async fn unknown_types_and_bad_payloads_get_errors_and_the_connection_stays_up() {
    let k = knobs(10_000, 1 << 20);
    let (addr, _store, _server) = start(k.clone()).await;
    let mut s = raw_connect(addr).await;

    // A message type from a future protocol version.
    s.write_all(&raw_frame(0x55, 10, b"future"))
        .await
        .expect("send");
    let (h, r) = raw_read(&mut s).await.expect("answer");
    assert_eq!(h.request_id, 10);
    assert!(
        matches!(
            r,
            Response::Err {
                code: ErrorCode::Invalid,
                ..
            }
        ),
        "{r:?}"
    );

    // A response type sent as a request.
    s.write_all(&raw_frame(msg::OK, 11, b""))
        .await
        .expect("send");
    let (h, r) = raw_read(&mut s).await.expect("answer");
    assert_eq!(h.request_id, 11);
    assert!(
        matches!(
            r,
            Response::Err {
                code: ErrorCode::Invalid,
                ..
            }
        ),
        "{r:?}"
    );

    // A known type with a malformed (short) payload.
    s.write_all(&raw_frame(msg::READ, 12, &[1, 2, 3]))
        .await
        .expect("send");
    let (h, r) = raw_read(&mut s).await.expect("answer");
    assert_eq!(h.request_id, 12);
    assert!(
        matches!(
            r,
            Response::Err {
                code: ErrorCode::Invalid,
                ..
            }
        ),
        "{r:?}"
    );

    // Payload damaged in transit.
    let mut f = wire::encode_request(13, &read(DriveId(1), 0, 4096)).to_vec();
    let last = f.len() - 1;
    f[last] ^= 0xff;
    s.write_all(&f).await.expect("send");
    let (h, r) = raw_read(&mut s).await.expect("answer");
    assert_eq!(h.request_id, 13);
    assert!(
        matches!(
            r,
            Response::Err {
                code: ErrorCode::ChecksumMismatch,
                ..
            }
        ),
        "{r:?}"
    );

    // A second hello.
    let hello = wire::encode_request(14, &Request::Hello(Hello::new(CLUSTER, NodeId(1))));
    s.write_all(&hello.to_vec()).await.expect("send");
    let (_, r) = raw_read(&mut s).await.expect("answer");
    assert!(
        matches!(
            r,
            Response::Err {
                code: ErrorCode::Invalid,
                ..
            }
        ),
        "{r:?}"
    );

    // Still up.
    s.write_all(&wire::encode_request(15, &Request::Ping).to_vec())
        .await
        .expect("send");
    let (h, r) = raw_read(&mut s).await.expect("answer");
    assert_eq!((h.request_id, r), (15, Response::Pong));
}

#[tokio::test]
async fn first_message_must_be_hello_and_garbage_closes() {
    let k = knobs(10_000, 1 << 20);
    let (addr, _store, _server) = start(k.clone()).await;

    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(&wire::encode_request(3, &Request::Ping).to_vec())
        .await
        .expect("send");
    let (h, r) = raw_read(&mut s).await.expect("refusal");
    assert_eq!(h.request_id, 3);
    assert!(
        matches!(
            r,
            Response::Err {
                code: ErrorCode::Invalid,
                ..
            }
        ),
        "{r:?}"
    );
    assert!(raw_read(&mut s).await.is_none(), "closed");

    let mut s = raw_connect(addr).await;
    let mut junk = [0u8; 64];
    rand::thread_rng().fill(&mut junk[..]);
    s.write_all(&junk).await.expect("send");
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await;
    assert!(
        closed.is_ok(),
        "server closed a connection that sent garbage"
    );
}
