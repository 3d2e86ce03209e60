//! Protocol tests of NBD_OPT_STARTTLS with a handwritten client: what is refused before
//! TLS, the upgrade itself (tokio-rustls on the client side), option haggling and I/O
//! over TLS, refused certificates, and the plaintext behaviour when TLS is off.

// Test code: a failed unwrap is a failed test, with the line in the panic message.
#![allow(clippy::unwrap_used)]

mod pki;

use std::sync::Arc;
use std::time::Duration;

use converge_nbd::proto::*;
use converge_nbd::rustls;
use converge_nbd::testing::{MemDev, MemResolver};
use converge_nbd::{serve_connection, NbdError, ServerConfig};
use pki::Pki;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};
use tokio::task::JoinHandle;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

const SIZE: usize = 1 << 20;
const OPT_UNKNOWN: u32 = 4242;

struct Setup {
    dev: Arc<MemDev>,
    resolver: Arc<MemResolver>,
}

fn setup() -> Setup {
    let dev = Arc::new(MemDev::new(SIZE));
    let resolver = MemResolver::new().with_export("vm01", Arc::clone(&dev));
    Setup {
        dev,
        resolver: Arc::new(resolver),
    }
}

fn tls_cfg(tls: Option<Arc<rustls::ServerConfig>>) -> ServerConfig {
    ServerConfig {
        tls,
        ..ServerConfig::default()
    }
}

fn opt_bytes(option: u32, data: &[u8]) -> Vec<u8> {
    let mut b = IHAVEOPT.to_be_bytes().to_vec();
    b.extend_from_slice(&option.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    b
}

/// NBD_OPT_GO/INFO data without NBD_INFO_BLOCK_SIZE: small unaligned I/O stays allowed.
fn go_data(name: &str) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&0u16.to_be_bytes());
    d
}

/// One NBD client connection over any stream; `C::fixed` and friends start on a duplex
/// pipe, `starttls` moves the same connection onto TLS.
struct Conn<S> {
    s: S,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Conn<S> {
    /// Reads the greeting and answers with `cflags`.
    async fn hello(&mut self, cflags: u32) {
        let mut b = [0u8; 18];
        self.s.read_exact(&mut b).await.unwrap();
        assert_eq!(u64::from_be_bytes(b[0..8].try_into().unwrap()), NBD_MAGIC);
        assert_eq!(u64::from_be_bytes(b[8..16].try_into().unwrap()), IHAVEOPT);
        self.s.write_all(&cflags.to_be_bytes()).await.unwrap();
    }

    async fn opt(&mut self, option: u32, data: &[u8]) {
        self.s.write_all(&opt_bytes(option, data)).await.unwrap();
        self.s.flush().await.unwrap();
    }

    async fn opt_reply(&mut self, option: u32) -> (u32, Vec<u8>) {
        let mut h = [0u8; 20];
        tokio::time::timeout(Duration::from_secs(5), self.s.read_exact(&mut h))
            .await
            .expect("no option reply within 5 s")
            .unwrap();
        assert_eq!(u64::from_be_bytes(h[0..8].try_into().unwrap()), REPLY_MAGIC);
        assert_eq!(u32::from_be_bytes(h[8..12].try_into().unwrap()), option);
        let typ = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
        let mut d = vec![0u8; len as usize];
        self.s.read_exact(&mut d).await.unwrap();
        (typ, d)
    }

    /// Sends an option and returns the type of its single (or final) reply.
    async fn ask(&mut self, option: u32, data: &[u8]) -> u32 {
        self.opt(option, data).await;
        loop {
            let (typ, _) = self.opt_reply(option).await;
            if typ != REP_INFO && typ != REP_SERVER {
                return typ;
            }
        }
    }

    async fn go(&mut self) -> u32 {
        self.ask(OPT_GO, &go_data("vm01")).await
    }

    async fn request(&mut self, typ: u16, handle: u64, offset: u64, len: u32) {
        let r = Request {
            flags: 0,
            typ,
            handle,
            offset,
            len,
        };
        self.s.write_all(&r.encode()).await.unwrap();
    }

    async fn reply(&mut self, handle: u64) -> u32 {
        let mut h = [0u8; 16];
        tokio::time::timeout(Duration::from_secs(5), self.s.read_exact(&mut h))
            .await
            .expect("no reply within 5 s")
            .unwrap();
        assert_eq!(
            u32::from_be_bytes(h[0..4].try_into().unwrap()),
            SIMPLE_REPLY_MAGIC
        );
        assert_eq!(u64::from_be_bytes(h[8..16].try_into().unwrap()), handle);
        u32::from_be_bytes(h[4..8].try_into().unwrap())
    }

    async fn write(&mut self, handle: u64, offset: u64, data: &[u8]) -> u32 {
        self.request(CMD_WRITE, handle, offset, data.len() as u32)
            .await;
        self.s.write_all(data).await.unwrap();
        self.s.flush().await.unwrap();
        self.reply(handle).await
    }

    async fn read(&mut self, handle: u64, offset: u64, len: u32) -> Vec<u8> {
        self.request(CMD_READ, handle, offset, len).await;
        self.s.flush().await.unwrap();
        assert_eq!(self.reply(handle).await, 0);
        let mut d = vec![0u8; len as usize];
        self.s.read_exact(&mut d).await.unwrap();
        d
    }

    /// The server closed its side: EOF (or, over TLS, an error for a torn session).
    async fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        let r = tokio::time::timeout(Duration::from_secs(5), self.s.read(&mut b))
            .await
            .expect("server should close");
        !matches!(r, Ok(n) if n > 0)
    }

    async fn disc(&mut self) {
        self.request(CMD_DISC, 0, 0, 0).await;
        self.s.flush().await.unwrap();
        assert!(self.closed().await, "server must close after DISC");
    }
}

type Server = JoinHandle<Result<(), NbdError>>;

/// A fixed-newstyle client on a duplex pipe to `serve_connection`.
async fn connect(s: &Setup, cfg: ServerConfig) -> (Conn<DuplexStream>, Server) {
    let (c, srv) = tokio::io::duplex(256 * 1024);
    let server = tokio::spawn(serve_connection(srv, Arc::clone(&s.resolver), cfg));
    let mut conn = Conn { s: c };
    conn.hello(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).await;
    (conn, server)
}

impl<S: AsyncRead + AsyncWrite + Unpin> Conn<S> {
    /// STARTTLS, its ACK, then the TLS handshake as a client with `client`.
    async fn starttls(
        mut self,
        client: Arc<rustls::ClientConfig>,
    ) -> std::io::Result<Conn<TlsStream<S>>> {
        assert_eq!(self.ask(OPT_STARTTLS, &[]).await, REP_ACK);
        let s = TlsConnector::from(client)
            .connect(pki::server_name(), self.s)
            .await?;
        Ok(Conn { s })
    }
}

#[tokio::test]
async fn options_before_starttls_are_refused_with_tls_reqd() {
    let s = setup();
    let pki = Pki::new("a");
    let (mut c, server) = connect(&s, tls_cfg(Some(pki.server_config(false)))).await;
    assert_eq!(c.go().await, REP_ERR_TLS_REQD);
    assert_eq!(c.ask(OPT_LIST, &[]).await, REP_ERR_TLS_REQD);
    assert_eq!(c.ask(OPT_INFO, &go_data("vm01")).await, REP_ERR_TLS_REQD);
    assert_eq!(c.ask(OPT_STRUCTURED_REPLY, &[]).await, REP_ERR_TLS_REQD);
    assert_eq!(c.ask(OPT_UNKNOWN, b"x").await, REP_ERR_TLS_REQD);
    // STARTTLS with data is malformed; it does not start TLS.
    assert_eq!(c.ask(OPT_STARTTLS, b"junk").await, REP_ERR_INVALID);
    // ABORT is still served in plaintext, and nothing of the export leaked.
    assert_eq!(c.ask(OPT_ABORT, &[]).await, REP_ACK);
    assert!(c.closed().await);
    assert!(server.await.unwrap().is_ok());
}

#[tokio::test]
async fn export_name_before_starttls_closes_the_connection() {
    let s = setup();
    let pki = Pki::new("a");
    for cflags in [FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES, 0] {
        let (c, srv) = tokio::io::duplex(64 * 1024);
        let cfg = tls_cfg(Some(pki.server_config(false)));
        let server = tokio::spawn(serve_connection(srv, Arc::clone(&s.resolver), cfg));
        let mut c = Conn { s: c };
        c.hello(cflags).await;
        c.opt(OPT_EXPORT_NAME, b"vm01").await;
        // No export information may come back, only the end of the connection.
        let mut b = [0u8; 1];
        assert_eq!(c.s.read(&mut b).await.unwrap(), 0, "cflags {cflags:#x}");
        let r = server.await.unwrap();
        assert!(
            matches!(r, Err(NbdError::TlsRequiredExportName)),
            "cflags {cflags:#x}: {r:?}"
        );
    }
}

#[tokio::test]
async fn starttls_then_go_and_io_over_tls_1_3_and_1_2() {
    let pki = Pki::new("a");
    for version in [&rustls::version::TLS13, &rustls::version::TLS12] {
        let s = setup();
        let cfg = tls_cfg(Some(pki.server_config(false)));
        let stats = Arc::clone(&cfg.stats);
        let (c, server) = connect(&s, cfg).await;
        let mut c = c
            .starttls(pki::client_config(&pki, None, &[version]))
            .await
            .unwrap();
        assert_eq!(
            c.s.get_ref().1.protocol_version(),
            Some(version.version),
            "negotiated version"
        );
        // Haggling goes on over TLS: LIST is served now, a second STARTTLS is invalid.
        assert_eq!(c.ask(OPT_LIST, &[]).await, REP_ACK);
        assert_eq!(c.ask(OPT_STARTTLS, &[]).await, REP_ERR_INVALID);
        assert_eq!(c.go().await, REP_ACK);

        let data: Vec<u8> = (0..64 * 1024).map(|i| (i * 7 % 251) as u8).collect();
        assert_eq!(c.write(1, 8192, &data).await, 0);
        assert_eq!(c.read(2, 8192, data.len() as u32).await, data);
        assert_eq!(&s.dev.contents()[8192..8192 + data.len()], &data[..]);
        c.disc().await;
        assert!(server.await.unwrap().is_ok());
        let snap = stats.snapshot();
        assert_eq!(snap.bytes_written, data.len() as u64);
        assert_eq!(snap.bytes_read, data.len() as u64);
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Conn<S> {
    /// The next reply, which must be a structured chunk for `handle`.
    async fn chunk(&mut self, handle: u64) -> (ChunkHeader, Vec<u8>) {
        let mut h = [0u8; STRUCTURED_REPLY_LEN];
        tokio::time::timeout(Duration::from_secs(5), self.s.read_exact(&mut h))
            .await
            .expect("no reply within 5 s")
            .unwrap();
        let head = ChunkHeader::decode(&h).expect("a structured reply chunk");
        assert_eq!(head.handle, handle);
        let mut payload = vec![0u8; head.len as usize];
        self.s.read_exact(&mut payload).await.unwrap();
        (head, payload)
    }
}

/// Structured replies and block status are negotiated over TLS like everything else:
/// refused before STARTTLS, served after it.
#[tokio::test]
async fn structured_replies_and_block_status_over_tls() {
    let s = setup();
    let pki = Pki::new("a");
    let (mut c, server) = connect(&s, tls_cfg(Some(pki.server_config(false)))).await;
    let set = meta_context_request("vm01", &["base:allocation"]);
    assert_eq!(c.ask(OPT_STRUCTURED_REPLY, &[]).await, REP_ERR_TLS_REQD);
    assert_eq!(c.ask(OPT_SET_META_CONTEXT, &set).await, REP_ERR_TLS_REQD);
    assert_eq!(c.ask(OPT_LIST_META_CONTEXT, &set).await, REP_ERR_TLS_REQD);
    let mut c = c.starttls(pki.client_config(false)).await.unwrap();
    assert_eq!(c.ask(OPT_STRUCTURED_REPLY, &[]).await, REP_ACK);
    c.opt(OPT_SET_META_CONTEXT, &set).await;
    let (typ, d) = c.opt_reply(OPT_SET_META_CONTEXT).await;
    assert_eq!(typ, REP_META_CONTEXT);
    let id = u32::from_be_bytes(d[0..4].try_into().unwrap());
    assert_eq!(&d[4..], b"base:allocation");
    assert_eq!(c.opt_reply(OPT_SET_META_CONTEXT).await.0, REP_ACK);
    assert_eq!(c.go().await, REP_ACK);

    assert_eq!(c.write(1, 8192, &[7u8; 4096]).await, 0);
    c.request(CMD_BLOCK_STATUS, 2, 0, 16384).await;
    c.s.flush().await.unwrap();
    let (head, payload) = c.chunk(2).await;
    assert_eq!(
        (head.typ, head.flags),
        (REPLY_TYPE_BLOCK_STATUS, REPLY_FLAG_DONE)
    );
    let mut want = id.to_be_bytes().to_vec();
    for (len, flags) in [(8192u32, STATE_HOLE | STATE_ZERO), (4096, 0), (4096, 3)] {
        want.extend_from_slice(&len.to_be_bytes());
        want.extend_from_slice(&flags.to_be_bytes());
    }
    assert_eq!(payload, want);
    c.request(CMD_READ, 3, 8192, 4096).await;
    c.s.flush().await.unwrap();
    let (head, payload) = c.chunk(3).await;
    assert_eq!(
        (head.typ, head.flags),
        (REPLY_TYPE_OFFSET_DATA, REPLY_FLAG_DONE)
    );
    assert_eq!(u64::from_be_bytes(payload[0..8].try_into().unwrap()), 8192);
    assert!(payload[8..].iter().all(|&b| b == 7));
    c.disc().await;
    assert!(server.await.unwrap().is_ok());
}

#[tokio::test]
async fn abort_over_tls_is_clean() {
    let s = setup();
    let pki = Pki::new("a");
    let (c, server) = connect(&s, tls_cfg(Some(pki.server_config(false)))).await;
    let mut c = c.starttls(pki.client_config(false)).await.unwrap();
    assert_eq!(c.ask(OPT_ABORT, &[]).await, REP_ACK);
    // The server ends the TLS session properly: a clean EOF, not a torn connection.
    let mut b = [0u8; 1];
    assert_eq!(c.s.read(&mut b).await.unwrap(), 0);
    assert!(server.await.unwrap().is_ok());
}

#[tokio::test]
async fn client_that_does_not_trust_the_server_ca_fails() {
    let s = setup();
    let pki = Pki::new("a");
    let stranger = Pki::new("b");
    let (c, server) = connect(&s, tls_cfg(Some(pki.server_config(false)))).await;
    let e = match c.starttls(stranger.client_config(false)).await {
        Ok(_) => panic!("a client with another CA accepted the server's certificate"),
        Err(e) => e,
    };
    assert!(e.to_string().contains("invalid peer certificate"), "{e}");
    let r = server.await.unwrap();
    assert!(matches!(r, Err(NbdError::TlsHandshake(_))), "{r:?}");
}

/// With mutual TLS the server refuses the handshake of a client without a certificate or
/// with one from another CA, and serves one with a certificate from its CA.
#[tokio::test]
async fn mutual_tls_requires_a_client_certificate_from_the_ca() {
    let pki = Pki::new("a");
    let stranger = Pki::new("b");
    // The client trusts the server in both refused cases; only its own certificate fails.
    let refused = [
        (
            pki::client_config(&pki, None, rustls::DEFAULT_VERSIONS),
            "no certificates",
        ),
        (
            pki::client_config(&pki, Some(&stranger), rustls::DEFAULT_VERSIONS),
            "UnknownIssuer",
        ),
    ];
    for (client, why) in refused {
        let s = setup();
        let (c, server) = connect(&s, tls_cfg(Some(pki.server_config(true)))).await;
        // In TLS 1.3 the client may finish its side before the server judges its
        // certificate; the refusal then arrives as an alert on the first read.
        // The server may be gone by the time the option is written, so a failed write
        // is fine; an answer is not.
        if let Ok(mut c) = c.starttls(client).await {
            let _ = c.s.write_all(&opt_bytes(OPT_LIST, &[])).await;
            let _ = c.s.flush().await;
            assert!(c.closed().await, "the server served a refused client");
        }
        match server.await.unwrap() {
            Err(e @ NbdError::TlsHandshake(_)) => {
                assert!(e.to_string().contains(why), "{e}");
            }
            other => panic!("expected a failed TLS handshake ({why}), got {other:?}"),
        }
    }
    let s = setup();
    let (c, server) = connect(&s, tls_cfg(Some(pki.server_config(true)))).await;
    let mut c = c.starttls(pki.client_config(true)).await.unwrap();
    assert_eq!(c.go().await, REP_ACK);
    assert_eq!(c.write(1, 0, b"mutual").await, 0);
    assert_eq!(c.read(2, 0, 6).await, b"mutual");
    c.disc().await;
    assert!(server.await.unwrap().is_ok());
}

#[tokio::test]
async fn tls_off_refuses_starttls_and_serves_plaintext() {
    let s = setup();
    let (mut c, server) = connect(&s, tls_cfg(None)).await;
    assert_eq!(c.ask(OPT_STARTTLS, &[]).await, REP_ERR_POLICY);
    assert_eq!(c.go().await, REP_ACK);
    assert_eq!(c.write(1, 4096, b"plain").await, 0);
    assert_eq!(c.read(2, 4096, 5).await, b"plain");
    c.disc().await;
    assert!(server.await.unwrap().is_ok());
}

/// Bytes a client sends behind STARTTLS, before the ACK and the TLS handshake, could have
/// been injected by anyone on the path; they must not become part of the TLS session.
#[tokio::test]
async fn plaintext_sent_behind_starttls_ends_the_connection() {
    let s = setup();
    let pki = Pki::new("a");
    let (mut c, server) = connect(&s, tls_cfg(Some(pki.server_config(false)))).await;
    // One write, so the server reads both together.
    let mut b = opt_bytes(OPT_STARTTLS, &[]);
    b.extend_from_slice(&opt_bytes(OPT_GO, &go_data("vm01")));
    c.s.write_all(&b).await.unwrap();
    assert_eq!(c.opt_reply(OPT_STARTTLS).await.0, REP_ACK);
    assert!(c.closed().await);
    let r = server.await.unwrap();
    let want = b.len() - 16;
    assert!(
        matches!(r, Err(NbdError::PlaintextAfterStartTls(n)) if n == want),
        "{r:?}"
    );
}

/// The handshake deadline covers the TLS handshake: a client that asks for TLS and then
/// says nothing is dropped.
#[tokio::test(start_paused = true)]
async fn silent_client_after_starttls_times_out() {
    let s = setup();
    let pki = Pki::new("a");
    let cfg = ServerConfig {
        handshake_timeout_ms: 1000,
        ..tls_cfg(Some(pki.server_config(false)))
    };
    let (mut c, server) = connect(&s, cfg).await;
    assert_eq!(c.ask(OPT_STARTTLS, &[]).await, REP_ACK);
    let r = server.await.unwrap();
    assert!(matches!(r, Err(NbdError::HandshakeTimeout(1000))), "{r:?}");
}

/// Through the listeners: `serve_tcp` requires TLS on real TCP connections, `serve_unix`
/// serves the same configuration in plaintext.
#[tokio::test]
async fn serve_tcp_requires_tls_and_serve_unix_never_uses_it() {
    let s = setup();
    let pki = Pki::new("a");
    let cfg = tls_cfg(Some(pki.server_config(false)));

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let tcp = tokio::spawn(converge_nbd::serve_tcp(
        listener,
        Arc::clone(&s.resolver),
        cfg.clone(),
    ));
    let mut c = Conn {
        s: tokio::net::TcpStream::connect(addr).await.unwrap(),
    };
    c.hello(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).await;
    assert_eq!(c.go().await, REP_ERR_TLS_REQD);
    let mut c = c.starttls(pki.client_config(false)).await.unwrap();
    assert_eq!(c.go().await, REP_ACK);
    assert_eq!(c.write(1, 0, b"over tcp").await, 0);
    assert_eq!(c.read(2, 0, 8).await, b"over tcp");
    c.disc().await;
    tcp.abort();

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nbd.sock");
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    let unix = tokio::spawn(converge_nbd::serve_unix(
        listener,
        Arc::clone(&s.resolver),
        cfg,
    ));
    let mut c = Conn {
        s: tokio::net::UnixStream::connect(&path).await.unwrap(),
    };
    c.hello(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).await;
    assert_eq!(c.ask(OPT_STARTTLS, &[]).await, REP_ERR_POLICY);
    assert_eq!(c.go().await, REP_ACK);
    assert_eq!(c.read(3, 0, 8).await, b"over tcp");
    c.disc().await;
    unix.abort();
}
