//! Tests of `converge_nbd::client::Client`: against the crate's own server with RAM exports
//! on a unix socket (and TCP), against hand-rolled servers that break the protocol (each
//! must be a clean error, never a hang), and against `nbdkit memory` when installed.

// Test code: a failed unwrap is a failed test, with the line in the panic message.
#![allow(clippy::unwrap_used)]

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use converge_nbd::client::{Client, ClientError, WINDOW};
use converge_nbd::proto::*;
use converge_nbd::testing::{MemDev, MemResolver};
use converge_nbd::{
    serve_tcp, serve_unix, DevError, DevErrorKind, ResolveError, ServerConfig, ServerStats,
};
use rand::{RngCore, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

const SIZE: usize = 64 << 20;
const MIB: usize = 1 << 20;

/// Every client call in these tests must finish well within this.
const LIMIT: Duration = Duration::from_secs(20);

async fn within<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(LIMIT, f)
        .await
        .expect("client call hung")
}

fn random(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

struct Served {
    _dir: tempfile::TempDir,
    socket: PathBuf,
    dev: Arc<MemDev>,
    stats: Arc<ServerStats>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Drop for Served {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl Served {
    fn requests(&self) -> u64 {
        self.stats.requests.load(Ordering::Relaxed)
    }

    async fn connect(&self, export: &str) -> Result<Client, ClientError> {
        within(Client::connect_unix(&self.socket, export)).await
    }
}

fn resolver(dev: &Arc<MemDev>) -> MemResolver {
    MemResolver::new()
        .with_export("vm01", Arc::clone(dev))
        .with_refusal(
            "vm02",
            ResolveError::Elsewhere {
                owner: "node 2 (127.0.0.2)".to_owned(),
            },
        )
}

fn serve(cfg: ServerConfig) -> Served {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nbd.sock");
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    let dev = Arc::new(MemDev::new(SIZE));
    let stats = Arc::clone(&cfg.stats);
    let server = tokio::spawn(serve_unix(listener, Arc::new(resolver(&dev)), cfg));
    Served {
        _dir: dir,
        socket,
        dev,
        stats,
        server,
    }
}

fn small_cfg() -> ServerConfig {
    ServerConfig {
        max_request_bytes: 64 * 1024,
        ..ServerConfig::default()
    }
}

#[tokio::test]
async fn negotiates_export_and_block_sizes() {
    let s = serve(ServerConfig::default());
    let c = s.connect("vm01").await.unwrap();
    assert_eq!(c.size(), SIZE as u64);
    assert_eq!(c.export(), "vm01");
    assert!(!c.read_only());
    assert!(c.can_flush() && c.can_fua() && c.can_write_zeroes() && c.can_trim());
    assert!(c.can_multi_conn());
    assert_eq!(c.min_block(), 4096);
    assert_eq!(c.preferred_block(), 4096);
    assert_eq!(c.max_request(), 32 * MIB as u32);
    within(c.disconnect()).await.unwrap();

    let s = serve(small_cfg());
    let c = s.connect("vm01").await.unwrap();
    assert_eq!(c.max_request(), 64 * 1024);
    within(c.disconnect()).await.unwrap();
    // The server saw a clean end: no connection left open.
    for _ in 0..100 {
        if s.stats.connections_active.load(Ordering::Relaxed) == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(s.stats.connections_active.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn large_write_and_read_round_trip_in_pieces() {
    let s = serve(ServerConfig::default());
    let mut c = s.connect("vm01").await.unwrap();
    // 21 MiB + 3 blocks: six pieces of 4 MiB, the last one short.
    let len = 21 * MIB + 3 * 4096;
    let offset = 8192u64;
    let data = random(len, 1);
    within(c.write(offset, &data, false)).await.unwrap();
    let after_write = s.requests();
    assert_eq!(after_write, 6, "4 MiB pieces");
    assert_eq!(
        &s.dev.contents()[offset as usize..offset as usize + len],
        &data[..]
    );
    let mut back = vec![0xaau8; len];
    within(c.read(offset, &mut back)).await.unwrap();
    assert!(back == data, "read back differs");
    assert_eq!(s.requests(), after_write + 6);
    // FUA writes work too.
    within(c.write(0, &data[..4096], true)).await.unwrap();
    // Zero-length calls send nothing.
    let n = s.requests();
    within(c.read(4096, &mut [])).await.unwrap();
    within(c.write(4096, &[], false)).await.unwrap();
    within(c.write_zeroes(4096, 0)).await.unwrap();
    assert_eq!(s.requests(), n);
    within(c.disconnect()).await.unwrap();
}

#[tokio::test]
async fn pieces_are_pipelined() {
    let s = serve(ServerConfig::default());
    let mut c = s.connect("vm01").await.unwrap();
    let data = random(40 * MIB, 2);
    within(c.write(0, &data, false)).await.unwrap();
    let before = s.requests();
    let piece = 4 * MIB as u64;
    let wait_for = |n: u64| {
        let stats = Arc::clone(&s.stats);
        async move {
            for _ in 0..500 {
                if stats.requests.load(Ordering::Relaxed) - before >= n {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            stats.requests.load(Ordering::Relaxed) - before
        }
    };
    // Hold every piece in the device: the client sends the first WINDOW without waiting
    // for replies, and not one more while they are outstanding.
    let pieces = 40 * MIB as u64 / piece;
    assert!(pieces > WINDOW as u64 + 1);
    for i in 0..pieces {
        s.dev.gate(i * piece);
    }
    let task = tokio::spawn(async move {
        let mut back = vec![0u8; 40 * MIB];
        let r = c.read(0, &mut back).await;
        (c, r, back)
    });
    assert_eq!(wait_for(WINDOW as u64).await, WINDOW as u64);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(s.requests() - before, WINDOW as u64, "window exceeded");
    assert!(!task.is_finished());
    // Releasing the second piece makes room for exactly one more; the first still waits.
    s.dev.open(piece);
    assert_eq!(wait_for(WINDOW as u64 + 1).await, WINDOW as u64 + 1);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(s.requests() - before, WINDOW as u64 + 1, "window exceeded");
    for i in 0..pieces {
        s.dev.open(i * piece);
    }
    let (c, r, back) = within(task).await.unwrap();
    r.unwrap();
    assert!(back == data, "read back differs");
    within(c.disconnect()).await.unwrap();
}

#[tokio::test]
async fn small_maximum_and_alignment() {
    let s = serve(small_cfg());
    let mut c = s.connect("vm01").await.unwrap();
    let data = random(MIB + 8192, 3);
    within(c.write(65536, &data, false)).await.unwrap();
    assert_eq!(s.requests(), 17, "pieces of at most 64 KiB");
    let mut back = vec![0u8; data.len()];
    within(c.read(65536, &mut back)).await.unwrap();
    assert!(back == data);

    let n = s.requests();
    let mut buf = vec![0u8; 4096];
    let e = within(c.read(100, &mut buf)).await.unwrap_err();
    assert!(matches!(e, ClientError::Invalid(_)), "{e}");
    assert!(e.to_string().contains("minimum block size 4096"), "{e}");
    let e = within(c.write(0, &[1u8; 4097], false)).await.unwrap_err();
    assert!(matches!(e, ClientError::Invalid(_)), "{e}");
    let e = within(c.write_zeroes(4096, 100)).await.unwrap_err();
    assert!(matches!(e, ClientError::Invalid(_)), "{e}");
    assert_eq!(s.requests(), n, "refused locally");
    // A range may end at the export size.
    within(c.read(SIZE as u64 - 4096, &mut buf)).await.unwrap();
    within(c.disconnect()).await.unwrap();
}

#[tokio::test]
async fn write_zeroes_and_flush() {
    let s = serve(small_cfg());
    let mut c = s.connect("vm01").await.unwrap();
    let data = random(4 * MIB, 4);
    within(c.write(0, &data, false)).await.unwrap();
    let n = s.requests();
    // 1 MiB + 4 KiB in pieces of at most 64 KiB.
    within(c.write_zeroes(8192, (MIB + 4096) as u64))
        .await
        .unwrap();
    assert_eq!(s.requests() - n, 17);
    let mut want = data.clone();
    want[8192..8192 + MIB + 4096].fill(0);
    let mut back = vec![1u8; 4 * MIB];
    within(c.read(0, &mut back)).await.unwrap();
    assert!(back == want);
    assert!(s.dev.contents()[..4 * MIB] == want[..]);

    let flushes = s.dev.flushes();
    within(c.flush()).await.unwrap();
    assert_eq!(s.dev.flushes(), flushes + 1);
    within(c.disconnect()).await.unwrap();
}

#[tokio::test]
async fn read_only_export_refuses_writes_locally() {
    let s = serve(ServerConfig {
        read_only: true,
        ..ServerConfig::default()
    });
    let mut c = s.connect("vm01").await.unwrap();
    assert!(c.read_only());
    assert!(!c.can_write_zeroes());
    let n = s.requests();
    let e = within(c.write(0, &[7u8; 4096], false)).await.unwrap_err();
    assert!(matches!(e, ClientError::Invalid(_)), "{e}");
    assert!(e.to_string().contains("read-only"), "{e}");
    let e = within(c.write_zeroes(0, 4096)).await.unwrap_err();
    assert!(e.to_string().contains("read-only"), "{e}");
    assert_eq!(s.requests(), n);
    let mut buf = vec![1u8; 8192];
    within(c.read(0, &mut buf)).await.unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    within(c.disconnect()).await.unwrap();
}

#[tokio::test]
async fn refused_exports_carry_the_server_message() {
    let s = serve(ServerConfig::default());
    match s.connect("nope").await {
        Err(ClientError::Refused {
            export,
            reply,
            message,
        }) => {
            assert_eq!(export, "nope");
            assert_eq!(reply, REP_ERR_UNKNOWN);
            assert_eq!(message, "export nope does not exist");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    let e = s.connect("vm02").await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "NBD server refused export \"vm02\": volume vm02 is owned by node 2 (127.0.0.2); \
         connect there (NBD_REP_ERR_UNKNOWN)"
    );
    let e = within(Client::connect_unix(&s.socket.with_extension("x"), "vm01"))
        .await
        .unwrap_err();
    assert!(matches!(e, ClientError::Io(_)), "{e}");
    assert!(e.to_string().contains("nbd.x"), "{e}");
}

#[tokio::test]
async fn out_of_range_is_refused_before_sending() {
    let s = serve(ServerConfig::default());
    let mut c = s.connect("vm01").await.unwrap();
    let size = SIZE as u64;
    let mut buf = vec![0u8; 8192];
    let e = within(c.read(size - 4096, &mut buf)).await.unwrap_err();
    assert!(matches!(e, ClientError::Invalid(_)), "{e}");
    assert!(e.to_string().contains("beyond the end"), "{e}");
    let e = within(c.write(size, &buf, false)).await.unwrap_err();
    assert!(matches!(e, ClientError::Invalid(_)), "{e}");
    let e = within(c.write_zeroes(u64::MAX - 4095, 8192))
        .await
        .unwrap_err();
    assert!(matches!(e, ClientError::Invalid(_)), "{e}");
    let e = within(c.write_zeroes(0, size + 4096)).await.unwrap_err();
    assert!(matches!(e, ClientError::Invalid(_)), "{e}");
    assert_eq!(s.requests(), 0);
    // The session is untouched.
    within(c.read(size - 8192, &mut buf)).await.unwrap();
    within(c.disconnect()).await.unwrap();
}

#[tokio::test]
async fn device_errors_surface_and_the_session_stays_usable() {
    let s = serve(ServerConfig::default());
    let mut c = s.connect("vm01").await.unwrap();
    let data = random(16 * MIB, 5);
    within(c.write(0, &data, false)).await.unwrap();

    s.dev
        .fail_next(DevError::new(DevErrorKind::Io, "disk on fire"));
    let mut buf = vec![0u8; 4096];
    match within(c.read(8192, &mut buf)).await {
        Err(ClientError::Server { errno, message }) => {
            assert_eq!(errno, EIO);
            assert_eq!(
                message,
                "NBD server failed NBD_CMD_READ of 4096 bytes at offset 8192: \
                 EIO (input/output error, error 5)"
            );
        }
        other => panic!("expected EIO, got {other:?}"),
    }
    within(c.read(8192, &mut buf)).await.unwrap();
    assert_eq!(&buf[..], &data[8192..8192 + 4096]);

    // One failed piece of a pipelined read: the others are drained, the stream stays in
    // sync and the next read is right.
    s.dev.fail_next(DevError::new(DevErrorKind::Io, "again"));
    let mut big = vec![0u8; 16 * MIB];
    let e = within(c.read(0, &mut big)).await.unwrap_err();
    assert!(matches!(e, ClientError::Server { errno: EIO, .. }), "{e}");
    within(c.read(0, &mut big)).await.unwrap();
    assert!(big == data);

    s.dev
        .fail_next(DevError::new(DevErrorKind::NoSpace, "thin pool full"));
    let e = within(c.write(0, &data[..8 * MIB], false))
        .await
        .unwrap_err();
    assert!(
        matches!(e, ClientError::Server { errno: ENOSPC, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("NBD_CMD_WRITE"), "{e}");
    assert!(e.to_string().contains("ENOSPC"), "{e}");

    s.dev
        .fail_next(DevError::new(DevErrorKind::Io, "flush failed"));
    let e = within(c.flush()).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "NBD server failed NBD_CMD_FLUSH: EIO (input/output error)"
    );

    // ESHUTDOWN: the client must stop using the session.
    s.dev
        .fail_next(DevError::new(DevErrorKind::Unavailable, "ownership lost"));
    let e = within(c.read(0, &mut buf)).await.unwrap_err();
    assert!(
        matches!(
            e,
            ClientError::Server {
                errno: ESHUTDOWN,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("ESHUTDOWN"), "{e}");
    let e = within(c.read(0, &mut buf)).await.unwrap_err();
    assert!(matches!(e, ClientError::Invalid(_)), "{e}");
    assert!(e.to_string().contains("shutting down"), "{e}");
    within(c.disconnect()).await.unwrap();
}

#[tokio::test]
async fn tcp_round_trip() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let dev = Arc::new(MemDev::new(SIZE));
    let server = tokio::spawn(serve_tcp(
        listener,
        Arc::new(resolver(&dev)),
        ServerConfig::default(),
    ));
    let mut c = within(Client::connect_tcp(&addr, "vm01")).await.unwrap();
    let data = random(9 * MIB, 6);
    within(c.write(4096, &data, true)).await.unwrap();
    let mut back = vec![0u8; data.len()];
    within(c.read(4096, &mut back)).await.unwrap();
    assert!(back == data);
    within(c.disconnect()).await.unwrap();
    server.abort();
}

// ---- Hand-rolled servers ----------------------------------------------------------------

/// Serves one connection on a fresh unix socket with `script`.
fn fake<F, Fut>(script: F) -> (tempfile::TempDir, PathBuf)
where
    F: FnOnce(UnixStream) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("fake.sock");
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    tokio::spawn(async move {
        let (s, _) = listener.accept().await.unwrap();
        script(s).await;
    });
    (dir, socket)
}

/// Greets with `hflags` and reads the client's flags and first option (number, data).
async fn greet(s: &mut UnixStream, hflags: u16) -> (u32, Vec<u8>) {
    let mut b = NBD_MAGIC.to_be_bytes().to_vec();
    b.extend_from_slice(&IHAVEOPT.to_be_bytes());
    b.extend_from_slice(&hflags.to_be_bytes());
    s.write_all(&b).await.unwrap();
    let mut cflags = [0u8; 4];
    s.read_exact(&mut cflags).await.unwrap();
    read_option(s).await
}

async fn read_option(s: &mut UnixStream) -> (u32, Vec<u8>) {
    let mut h = [0u8; 16];
    s.read_exact(&mut h).await.unwrap();
    assert_eq!(u64::from_be_bytes(h[0..8].try_into().unwrap()), IHAVEOPT);
    let option = u32::from_be_bytes(h[8..12].try_into().unwrap());
    let len = u32::from_be_bytes(h[12..16].try_into().unwrap());
    let mut data = vec![0u8; len as usize];
    s.read_exact(&mut data).await.unwrap();
    (option, data)
}

async fn reply(s: &mut UnixStream, option: u32, typ: u32, data: &[u8]) {
    let mut out = Vec::new();
    option_reply(&mut out, option, typ, data);
    s.write_all(&out).await.unwrap();
}

/// A full GO handshake for an export of `size` bytes with `tflags`.
async fn go(s: &mut UnixStream, size: u64, tflags: u16) {
    let (option, _) = greet(s, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).await;
    assert_eq!(option, OPT_GO);
    let mut export = INFO_EXPORT.to_be_bytes().to_vec();
    export.extend_from_slice(&size.to_be_bytes());
    export.extend_from_slice(&tflags.to_be_bytes());
    reply(s, OPT_GO, REP_INFO, &export).await;
    let mut bs = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
    for v in [512u32, 4096, 1 << 20] {
        bs.extend_from_slice(&v.to_be_bytes());
    }
    reply(s, OPT_GO, REP_INFO, &bs).await;
    reply(s, OPT_GO, REP_ACK, &[]).await;
}

async fn read_request(s: &mut UnixStream) -> Option<Request> {
    let mut b = [0u8; REQUEST_LEN];
    s.read_exact(&mut b).await.ok()?;
    Some(Request::decode(&b).unwrap())
}

/// Keeps the connection open without answering: a client waiting for more would hang.
async fn linger(s: UnixStream) {
    tokio::time::sleep(Duration::from_secs(60)).await;
    drop(s);
}

fn protocol_error(r: Result<Client, ClientError>, want: &str) {
    match r {
        Err(ClientError::Protocol(msg)) => assert!(msg.contains(want), "{msg}"),
        other => panic!("expected a protocol error with {want:?}, got {other:?}"),
    }
}

async fn connect(socket: &Path, export: &str) -> Result<Client, ClientError> {
    within(Client::connect_unix(socket, export)).await
}

#[tokio::test]
async fn bad_greeting_is_a_protocol_error() {
    let (_d, sock) = fake(|mut s| async move {
        s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            .await
            .unwrap();
        linger(s).await;
    });
    protocol_error(connect(&sock, "x").await, "bad greeting magic");

    let (_d, sock) = fake(|mut s| async move {
        let mut b = NBD_MAGIC.to_be_bytes().to_vec();
        b.extend_from_slice(&IHAVEOPT.to_be_bytes());
        b.extend_from_slice(&0u16.to_be_bytes());
        s.write_all(&b).await.unwrap();
        linger(s).await;
    });
    protocol_error(connect(&sock, "x").await, "fixed newstyle");

    // Closed mid-greeting.
    let (_d, sock) = fake(|mut s| async move {
        s.write_all(&NBD_MAGIC.to_be_bytes()).await.unwrap();
    });
    let e = connect(&sock, "x").await.unwrap_err();
    assert!(matches!(e, ClientError::Closed(_)), "{e}");
}

#[tokio::test]
async fn hostile_option_replies_are_protocol_errors() {
    // A reply claiming a gigabyte of data: refused before reading (or allocating) it.
    let (_d, sock) = fake(|mut s| async move {
        greet(&mut s, FLAG_FIXED_NEWSTYLE).await;
        let mut b = REPLY_MAGIC.to_be_bytes().to_vec();
        b.extend_from_slice(&OPT_GO.to_be_bytes());
        b.extend_from_slice(&REP_INFO.to_be_bytes());
        b.extend_from_slice(&(1u32 << 30).to_be_bytes());
        s.write_all(&b).await.unwrap();
        linger(s).await;
    });
    protocol_error(
        connect(&sock, "x").await,
        "option reply of 1073741824 bytes",
    );

    let (_d, sock) = fake(|mut s| async move {
        greet(&mut s, FLAG_FIXED_NEWSTYLE).await;
        reply(&mut s, OPT_LIST, REP_ACK, &[]).await;
        linger(s).await;
    });
    protocol_error(connect(&sock, "x").await, "option 3, but option 7");

    let (_d, sock) = fake(|mut s| async move {
        greet(&mut s, FLAG_FIXED_NEWSTYLE).await;
        let mut b = 0x1234u64.to_be_bytes().to_vec();
        b.extend_from_slice(&[0u8; 12]);
        s.write_all(&b).await.unwrap();
        linger(s).await;
    });
    protocol_error(connect(&sock, "x").await, "bad option reply magic");

    // ACK without the export's size.
    let (_d, sock) = fake(|mut s| async move {
        greet(&mut s, FLAG_FIXED_NEWSTYLE).await;
        reply(&mut s, OPT_GO, REP_ACK, &[]).await;
        linger(s).await;
    });
    protocol_error(connect(&sock, "x").await, "without NBD_INFO_EXPORT");

    // A truncated NBD_INFO_EXPORT.
    let (_d, sock) = fake(|mut s| async move {
        greet(&mut s, FLAG_FIXED_NEWSTYLE).await;
        reply(&mut s, OPT_GO, REP_INFO, &[0, 0, 1, 2, 3]).await;
        linger(s).await;
    });
    protocol_error(connect(&sock, "x").await, "NBD_INFO_EXPORT of 5 bytes");

    // A refusal whose message would paint the terminal: printed harmlessly.
    let (_d, sock) = fake(|mut s| async move {
        greet(&mut s, FLAG_FIXED_NEWSTYLE).await;
        reply(&mut s, OPT_GO, REP_ERR_POLICY, b"no \x1b[31mway").await;
        linger(s).await;
    });
    match connect(&sock, "x").await {
        Err(ClientError::Refused { reply, message, .. }) => {
            assert_eq!(reply, REP_ERR_POLICY);
            assert_eq!(message, "no ?[31mway");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[tokio::test]
async fn hostile_transmission_replies_are_protocol_errors() {
    // A reply to a handle that was never sent.
    let (_d, sock) = fake(|mut s| async move {
        go(&mut s, 1 << 20, TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH).await;
        let r = read_request(&mut s).await.unwrap();
        s.write_all(&simple_reply(0, r.handle ^ 0xffff))
            .await
            .unwrap();
        linger(s).await;
    });
    let mut c = connect(&sock, "x").await.unwrap();
    assert_eq!(c.min_block(), 512);
    assert_eq!(c.max_request(), 1 << 20);
    let mut buf = vec![0u8; 4096];
    let e = within(c.read(0, &mut buf)).await.unwrap_err();
    assert!(matches!(e, ClientError::Protocol(_)), "{e}");
    assert!(e.to_string().contains("no request in flight"), "{e}");
    // The session is spent.
    let e = within(c.flush()).await.unwrap_err();
    assert!(matches!(e, ClientError::Invalid(_)), "{e}");
    assert!(e.to_string().contains("no longer usable"), "{e}");
    within(c.disconnect()).await.unwrap();

    // A bad reply magic, and a structured reply that was never negotiated.
    for magic in [0xdead_beefu32, STRUCTURED_REPLY_MAGIC] {
        let (_d, sock) = fake(move |mut s| async move {
            go(&mut s, 1 << 20, TFLAG_HAS_FLAGS).await;
            let r = read_request(&mut s).await.unwrap();
            let mut b = simple_reply(0, r.handle);
            b[0..4].copy_from_slice(&magic.to_be_bytes());
            s.write_all(&b).await.unwrap();
            linger(s).await;
        });
        let mut c = connect(&sock, "x").await.unwrap();
        let e = within(c.read(0, &mut buf)).await.unwrap_err();
        assert!(matches!(e, ClientError::Protocol(_)), "{e}");
    }

    // Read data cut short by a hang-up.
    let (_d, sock) = fake(|mut s| async move {
        go(&mut s, 1 << 20, TFLAG_HAS_FLAGS).await;
        let r = read_request(&mut s).await.unwrap();
        s.write_all(&simple_reply(0, r.handle)).await.unwrap();
        s.write_all(&[1u8; 100]).await.unwrap();
    });
    let mut c = connect(&sock, "x").await.unwrap();
    let e = within(c.read(0, &mut buf)).await.unwrap_err();
    assert!(matches!(e, ClientError::Closed(_)), "{e}");
    assert!(e.to_string().contains("read reply"), "{e}");

    // A server that answers a write with EPERM although it did not say read-only.
    let (_d, sock) = fake(|mut s| async move {
        go(&mut s, 1 << 20, TFLAG_HAS_FLAGS).await;
        let r = read_request(&mut s).await.unwrap();
        let mut payload = vec![0u8; r.len as usize];
        s.read_exact(&mut payload).await.unwrap();
        s.write_all(&simple_reply(EPERM, r.handle)).await.unwrap();
        linger(s).await;
    });
    let mut c = connect(&sock, "x").await.unwrap();
    let e = within(c.write(4096, &buf, false)).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "NBD server failed NBD_CMD_WRITE of 4096 bytes at offset 4096: \
         EPERM (operation not permitted, error 1)"
    );
}

/// A server without NBD_OPT_GO, NO_ZEROES or WRITE_ZEROES: the client uses
/// NBD_OPT_EXPORT_NAME and zeroes with plain writes.
#[tokio::test]
async fn export_name_fallback_and_zeroes_by_writing() {
    let (_d, sock) = fake(|mut s| async move {
        let (option, _) = greet(&mut s, FLAG_FIXED_NEWSTYLE).await;
        assert_eq!(option, OPT_GO);
        reply(&mut s, OPT_GO, REP_ERR_UNSUP, &[]).await;
        let (option, name) = read_option(&mut s).await;
        assert_eq!(option, OPT_EXPORT_NAME);
        assert_eq!(name, b"legacy");
        let mut b = (1u64 << 20).to_be_bytes().to_vec();
        b.extend_from_slice(&(TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH).to_be_bytes());
        b.extend_from_slice(&[0u8; 124]);
        s.write_all(&b).await.unwrap();
        let mut zeroed = 0u64;
        while let Some(r) = read_request(&mut s).await {
            match r.typ {
                CMD_WRITE => {
                    let mut payload = vec![1u8; r.len as usize];
                    s.read_exact(&mut payload).await.unwrap();
                    assert!(payload.iter().all(|&b| b == 0));
                    zeroed += u64::from(r.len);
                    s.write_all(&simple_reply(0, r.handle)).await.unwrap();
                }
                CMD_DISC => break,
                t => panic!("unexpected command {t}"),
            }
        }
        assert_eq!(zeroed, 300_000);
    });
    let mut c = connect(&sock, "legacy").await.unwrap();
    assert_eq!(c.size(), 1 << 20);
    assert_eq!(c.min_block(), 1);
    assert!(!c.can_write_zeroes());
    within(c.write_zeroes(12345, 300_000)).await.unwrap();
    within(c.disconnect()).await.unwrap();
}

// ---- nbdkit -------------------------------------------------------------------------------

fn have(bin: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).any(|d| d.join(bin).is_file())
}

#[tokio::test]
async fn against_nbdkit_memory() {
    if !have("nbdkit") {
        eprintln!(
            "\n!!!!!!!! SKIPPING {}: `nbdkit` is not installed !!!!!!!!\n",
            module_path!()
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nbdkit.sock");
    let mut child = tokio::process::Command::new("nbdkit")
        .arg("--foreground")
        .arg("--exit-with-parent")
        .arg("--unix")
        .arg(&sock)
        .arg("memory")
        .arg("64M")
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    for _ in 0..500 {
        if sock.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut c = connect(&sock, "").await.unwrap();
    eprintln!("nbdkit session: {c:?}");
    assert_eq!(c.size(), 64 << 20);
    assert!(!c.read_only());
    let data = random(10 * MIB + 512, 7);
    within(c.write(1 << 20, &data, false)).await.unwrap();
    let mut back = vec![0u8; data.len()];
    within(c.read(1 << 20, &mut back)).await.unwrap();
    assert!(back == data);
    within(c.write_zeroes(2 << 20, 3 << 20)).await.unwrap();
    within(c.flush()).await.unwrap();
    within(c.write(0, &data[..4096], true)).await.unwrap();
    let mut want = data.clone();
    want[1 << 20..4 << 20].fill(0);
    within(c.read(1 << 20, &mut back)).await.unwrap();
    assert!(back == want);
    let e = within(c.read(64 << 20, &mut back[..1])).await.unwrap_err();
    assert!(matches!(e, ClientError::Invalid(_)), "{e}");
    within(c.disconnect()).await.unwrap();
    child.kill().await.unwrap();
}
