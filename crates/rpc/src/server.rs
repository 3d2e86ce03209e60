//! The answering side: accepts peers, checks their hello, and runs requests concurrently.
//!
//! Per connection: the handshake comes first; then one task reads frames and starts a handler
//! task per request (at most `rpc_inflight_max` at once, further reading waits), and one
//! writer task sends the answers in completion order, batched.
//!
//! Handler tasks are detached on purpose: when a connection (or the whole server) goes away,
//! a handler that is halfway through a write to a drive is allowed to finish rather than being
//! cancelled at an arbitrary await point; only its answer is lost.

use crate::frame::{self, Outgoing, ReadError, READ_BUFFER_BYTES};
use crate::handshakes::{Handshakes, Pending};
use crate::wire::{
    self, msg, EncodedFrame, ErrorCode, FrameHeader, Request, Response, WireError,
    PROTOCOL_VERSION, PROTOCOL_VERSION_MIN,
};
use converge_pki::Revocations;
use converge_types::{ClusterId, Knobs, NodeId};
use rustls::pki_types::CertificateDer;
use std::future::Future;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

/// Pause after an accept error (e.g. out of file descriptors) before accepting again.
const ACCEPT_ERROR_PAUSE_MS: u64 = 100;
/// The largest first frame (the hello) of a connection: a hello is a few dozen bytes.
const HELLO_FRAME_BYTES_MAX: usize = 4096;
/// Connections served at once; further ones wait in the listen backlog. Peers hold one
/// each; the rest are strangers, each dropped after the handshake deadline at most.
pub const CONNECTIONS_MAX: usize = 1024;
/// Connections one source host may hold before they are authenticated (TLS and hello): a
/// node needs one per peer connection it opens, a lab on one address a few per node. A
/// host holding these many gets its next connections closed at once, so no host can hold
/// the others' slots in handshakes it never finishes.
pub const HANDSHAKES_PER_SOURCE_MAX: usize = 32;
/// The longest a connection may take from accept to a checked hello (TLS handshake
/// included); `replica_timeout_ms` if that is shorter.
pub const HANDSHAKE_MS_MAX: u64 = 5_000;

/// The peer port's mutual TLS: the server settings (which check the revocation list at each
/// handshake) and that list, which also ends an open connection whose certificate it comes
/// to refuse (`converge node remove`, `converge cert revoke`).
#[derive(Clone)]
pub struct ServerTls {
    pub config: Arc<rustls::ServerConfig>,
    pub revocations: Arc<Revocations>,
}

/// What the node plugs into the server: the engine, in production.
pub trait Handler: Send + Sync + 'static {
    /// Answers one request from node `peer`. `Hello` and `Ping` never reach the handler
    /// (the rpc layer answers them).
    fn handle(&self, peer: NodeId, req: Request) -> impl Future<Output = Response> + Send;
}

/// Accepts connections on `listener` until this future is dropped; dropping it closes every
/// connection it accepted. Returns an error only if the listener itself is unusable.
pub async fn serve<H: Handler>(
    listener: TcpListener,
    cluster: ClusterId,
    my_node: NodeId,
    handler: Arc<H>,
    knobs: Knobs,
    tls: Option<ServerTls>,
) -> std::io::Result<()> {
    let knobs = Arc::new(knobs);
    let tls = tls.map(|t| (tokio_rustls::TlsAcceptor::from(t.config), t.revocations));
    let mut conns = JoinSet::new();
    let slots = Arc::new(Semaphore::new(CONNECTIONS_MAX));
    let handshakes = Handshakes::new(HANDSHAKES_PER_SOURCE_MAX);
    loop {
        tokio::select! {
            accepted = accept(&listener, &slots) => match accepted {
                Ok((stream, addr, permit)) => {
                    let Some(pending) = handshakes.enter(addr.ip()) else {
                        log::debug!(
                            "rpc server: {addr} holds {HANDSHAKES_PER_SOURCE_MAX} unfinished \
                             handshakes already; closed"
                        );
                        continue;
                    };
                    let conn = serve_conn(
                        stream,
                        addr,
                        pending,
                        cluster,
                        my_node,
                        handler.clone(),
                        knobs.clone(),
                        tls.clone(),
                    );
                    conns.spawn(async move {
                        conn.await;
                        drop(permit);
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => return Err(e),
                Err(e) => {
                    log::warn!("rpc server (node {my_node}): accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(ACCEPT_ERROR_PAUSE_MS)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

/// The next connection, once fewer than `CONNECTIONS_MAX` are open.
async fn accept(
    listener: &TcpListener,
    slots: &Arc<Semaphore>,
) -> std::io::Result<(TcpStream, SocketAddr, OwnedSemaphorePermit)> {
    let permit = slots
        .clone()
        .acquire_owned()
        .await
        .expect("the semaphore is never closed");
    let (stream, addr) = listener.accept().await?;
    Ok((stream, addr, permit))
}

/// Encodes an answer, replacing it by an error if it would exceed the frame bound.
fn encode_reply(id: u64, resp: &Response, frame_bytes_max: usize) -> EncodedFrame {
    let f = wire::encode_response(id, resp);
    if f.payload_len() <= frame_bytes_max {
        return f;
    }
    wire::encode_response(
        id,
        &Response::err(
            ErrorCode::Invalid,
            format!(
                "answer of {} bytes exceeds rpc_frame_bytes_max {frame_bytes_max}; ask for less",
                f.payload_len()
            ),
        ),
    )
}

/// Sends an error answer if the handler task ends without answering (it panicked).
struct ReplyGuard {
    tx: Option<mpsc::Sender<Outgoing>>,
    id: u64,
    _permit: OwnedSemaphorePermit,
}

impl Drop for ReplyGuard {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            let resp = Response::err(ErrorCode::Other, "request handler failed (panicked)");
            let _ = tx.try_send(Outgoing::Frame(wire::encode_response(self.id, &resp)));
        }
    }
}

/// How long a connection may take from accept to a checked hello.
fn handshake_deadline(knobs: &Knobs) -> Duration {
    Duration::from_millis(knobs.replica_timeout_ms.min(HANDSHAKE_MS_MAX))
}

#[allow(clippy::too_many_arguments)]
async fn serve_conn<H: Handler>(
    stream: TcpStream,
    addr: SocketAddr,
    pending: Pending,
    cluster: ClusterId,
    my_node: NodeId,
    handler: Arc<H>,
    knobs: Arc<Knobs>,
    tls: Option<(tokio_rustls::TlsAcceptor, Arc<Revocations>)>,
) {
    if let Err(e) = stream.set_nodelay(true) {
        log::warn!("rpc server: cannot set TCP_NODELAY for {addr}: {e}");
    }
    // One deadline for the TLS handshake and the hello together.
    let deadline = tokio::time::Instant::now() + handshake_deadline(&knobs);
    let handshake_timeout = handshake_deadline(&knobs);
    let Some((acceptor, revocations)) = tls else {
        let (rd, wr) = stream.into_split();
        return serve_stream(
            rd, wr, None, addr, pending, deadline, cluster, my_node, handler, knobs,
        )
        .await;
    };
    // To end the connection if its certificate is revoked later (a duplicate descriptor of
    // the same socket; the watch shuts the socket down, the stream below sees its end).
    let socket = match stream.as_fd().try_clone_to_owned() {
        Ok(s) => s,
        Err(e) => {
            log::warn!("rpc server: cannot watch the connection from {addr} ({e}); closed");
            return;
        }
    };
    // The TLS handshake checks that the caller holds a certificate of this cluster's CA;
    // which node it names is checked against the hello.
    let stream = match tokio::time::timeout_at(deadline, acceptor.accept(stream)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            log::warn!("rpc server: TLS handshake with {addr} failed, refused: {e}");
            return;
        }
        Err(_) => {
            log::info!(
                "rpc server: {addr} did not finish a TLS handshake within {handshake_timeout:?}"
            );
            return;
        }
    };
    let cert = stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.clone().into_owned());
    let Some(cert) = cert else {
        log::warn!("rpc server: {addr} presented no certificate; refused");
        return;
    };
    let _watchman = revocations.watch_connection(
        &cert,
        format!("rpc server: the peer connection from {addr}"),
        converge_pki::cut_socket(socket),
    );
    let (rd, wr) = tokio::io::split(stream);
    serve_stream(
        rd,
        wr,
        Some(cert),
        addr,
        pending,
        deadline,
        cluster,
        my_node,
        handler,
        knobs,
    )
    .await
}

/// One connection after TLS (if any): the hello (by `deadline`), then requests until it
/// ends. `cert`: the caller's verified certificate, which must name the node its hello
/// claims. `pending` is given back once the hello is checked.
#[allow(clippy::too_many_arguments)]
async fn serve_stream<H, R, W>(
    rd: R,
    mut wr: W,
    cert: Option<CertificateDer<'static>>,
    addr: SocketAddr,
    pending: Pending,
    deadline: tokio::time::Instant,
    cluster: ClusterId,
    my_node: NodeId,
    handler: Arc<H>,
    knobs: Arc<Knobs>,
) where
    H: Handler,
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let max = knobs.rpc_frame_bytes_max;
    let inflight_max = knobs.rpc_inflight_max.max(1);
    let mut rd = BufReader::with_capacity(READ_BUFFER_BYTES, rd);

    let handshake_timeout = handshake_deadline(&knobs);
    let peer = match tokio::time::timeout_at(
        deadline,
        handshake(&mut rd, &mut wr, addr, cluster, my_node, max, cert.as_ref()),
    )
    .await
    {
        Ok(Some(agreed)) => agreed,
        Ok(None) => return,
        Err(_) => {
            log::info!("rpc server: {addr} sent no hello within {handshake_timeout:?}");
            return;
        }
    };
    drop(pending);
    let (peer, version) = peer;
    log::debug!("rpc server: node {peer} connected from {addr} (protocol version {version})");

    let (tx, rx) = mpsc::channel(inflight_max);
    let slots = Arc::new(Semaphore::new(inflight_max));
    // More answers are likely while other requests of this connection are still being
    // handled: each holds a slot until its answer is queued, and the reader holds one
    // for the next request.
    let busy = slots.clone();
    let more = move |_: usize| inflight_max - busy.available_permits() > 1;
    let mut writer = tokio::spawn(frame::write_loop(wr, rx, more, version));
    // Stop the writer (and so close the socket) however this task ends, aborted included.
    let _stop_writer = AbortOnDrop(writer.abort_handle());

    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            _ = &mut writer => break,
        };
        let next = tokio::select! {
            f = frame::read_frame(&mut rd, max) => f,
            _ = &mut writer => break,
        };
        let (h, payload) = match next {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(ReadError::TooLarge { header, max }) => {
                log::warn!(
                    "rpc server: node {peer} at {addr} sent a {} byte frame, above \
                     rpc_frame_bytes_max {max}; closing the connection",
                    header.payload_len
                );
                let resp = Response::err(
                    ErrorCode::Invalid,
                    format!(
                        "frame of {} payload bytes exceeds rpc_frame_bytes_max {max}; \
                         connection closed",
                        header.payload_len
                    ),
                );
                let _ = tx
                    .send(Outgoing::Frame(wire::encode_response(
                        header.request_id,
                        &resp,
                    )))
                    .await;
                let _ = tx.send(Outgoing::Close).await;
                // Let the writer deliver the refusal before the socket is closed.
                let _ = tokio::time::timeout(handshake_timeout, &mut writer).await;
                break;
            }
            Err(e) => {
                log::warn!("rpc server: dropping connection of node {peer} at {addr}: {e}");
                break;
            }
        };
        let id = h.request_id;
        let req = match parse(&h, payload) {
            Ok(r) => r,
            Err(resp) => {
                log::debug!("rpc server: bad request {id} from node {peer}: {resp:?}");
                if tx
                    .send(Outgoing::Frame(wire::encode_response(id, &resp)))
                    .await
                    .is_err()
                {
                    break;
                }
                continue;
            }
        };
        let direct = match req {
            Request::Ping => Some(Response::Pong),
            Request::Hello(_) => Some(Response::err(
                ErrorCode::Invalid,
                "Hello is only valid as the first message of a connection",
            )),
            _ => None,
        };
        if let Some(resp) = direct {
            if tx
                .send(Outgoing::Frame(wire::encode_response(id, &resp)))
                .await
                .is_err()
            {
                break;
            }
            continue;
        }
        let mut guard = ReplyGuard {
            tx: Some(tx.clone()),
            id,
            _permit: permit,
        };
        let handler = handler.clone();
        // Boxed first: a handler's future is several KiB (7 KiB for a node's), and a task
        // stores its future inline, so spawning it unboxed copies it into the task and
        // copies the task's stage again when it finishes.
        tokio::spawn(Box::pin(async move {
            let resp = handler.handle(peer, req).await;
            if let Some(tx) = guard.tx.take() {
                let _ = tx.send(Outgoing::Frame(encode_reply(id, &resp, max))).await;
            }
            drop(guard);
        }));
    }
    drop(tx);
    log::debug!("rpc server: node {peer} at {addr} disconnected");
}

/// Turns a frame into a request, or into the error answer the peer should get.
fn parse(h: &FrameHeader, payload: bytes::Bytes) -> Result<Request, Response> {
    if h.flags != 0 {
        return Err(Response::err(
            ErrorCode::Invalid,
            WireError::UnknownFlags(h.flags).to_string(),
        ));
    }
    if let Err(e) = wire::check_payload(h, &payload) {
        return Err(Response::err(ErrorCode::ChecksumMismatch, e.to_string()));
    }
    if !msg::is_request(h.msg_type) {
        return Err(Response::err(
            ErrorCode::Invalid,
            format!(
                "message type {:#04x} is not a request (protocol version {PROTOCOL_VERSION})",
                h.msg_type
            ),
        ));
    }
    wire::decode_request(h.msg_type, payload).map_err(|e| {
        let msg = match e {
            WireError::UnknownType(_) => {
                format!("{e}: this node speaks protocol version {PROTOCOL_VERSION}")
            }
            _ => e.to_string(),
        };
        Response::err(ErrorCode::Invalid, msg)
    })
}

struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Reads and checks the peer's hello; answers it in the protocol version they agree on.
/// The peer and that version; `None`: the connection must be closed.
async fn handshake<R, W>(
    rd: &mut R,
    wr: &mut W,
    addr: SocketAddr,
    cluster: ClusterId,
    my_node: NodeId,
    max: usize,
    cert: Option<&CertificateDer<'static>>,
) -> Option<(NodeId, u16)>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    // Nothing is allocated for a stranger beyond a hello's size.
    let (h, payload) = match frame::read_frame(rd, HELLO_FRAME_BYTES_MAX.min(max)).await {
        Ok(Some(f)) => f,
        Ok(None) => return None,
        Err(e) => {
            log::warn!("rpc server: bad first frame from {addr}: {e}");
            return None;
        }
    };
    let refuse = |message: String| Response::err(ErrorCode::Invalid, message);
    let answer = match parse(&h, payload) {
        Err(resp) => Err(resp),
        Ok(Request::Hello(hello)) => {
            if wire::agree(hello.protocol_version).is_none() {
                Err(refuse(format!(
                    "protocol version mismatch: node {my_node} speaks {PROTOCOL_VERSION_MIN} \
                     to {PROTOCOL_VERSION}, node {} at {addr} speaks up to {}; upgrade it \
                     (a release speaks its predecessor's version, docs/OPERATIONS.md)",
                    hello.node, hello.protocol_version
                )))
            } else if hello.cluster != cluster {
                // The answer must not tell a stranger which cluster id would be let in; the
                // log here says it all.
                log::warn!(
                    "rpc server: {addr} (says node {}) belongs to cluster {}, this node to \
                     cluster {cluster}; refused",
                    hello.node,
                    hello.cluster
                );
                Err(refuse(format!(
                    "cluster mismatch: node {my_node} belongs to another cluster than the \
                     one named in this hello; check the peer's configuration"
                )))
            } else if cert.is_some_and(|c| !converge_pki::cert_names_node(c, hello.node.0)) {
                log::warn!(
                    "rpc server: {addr} says it is node {} but its certificate is not that \
                     node's; refused",
                    hello.node
                );
                Err(refuse(format!(
                    "node {} refused: the certificate presented is not node {}'s",
                    my_node, hello.node
                )))
            } else {
                Ok((hello.node, hello.protocol_version))
            }
        }
        Ok(_) => Err(refuse(
            "the first message of a connection must be Hello".into(),
        )),
    };
    let (resp, result) = match answer {
        Ok((node, offered)) => {
            let version = wire::agree(offered).unwrap_or(PROTOCOL_VERSION);
            (Response::HelloOk { node: my_node }, Some((node, version)))
        }
        Err(resp) => {
            if let Response::Err { message, .. } = &resp {
                log::warn!("rpc server: refusing connection from {addr}: {message}");
            }
            (resp, None)
        }
    };
    // Answered in the version agreed on; a refusal in the version the hello came in.
    let version = result.map_or(h.version, |(_, v)| v);
    let answer = wire::encode_response(h.request_id, &resp).at_version(version);
    if let Err(e) = frame::write_frame(wr, &answer).await {
        log::info!("rpc server: cannot answer hello from {addr}: {e}");
        return None;
    }
    result
}
