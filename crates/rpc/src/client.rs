//! The calling side: one pipelined connection to a peer, shared by every caller on this node.
//!
//! Requests are matched to answers by request id, so any number (up to `rpc_inflight_max`)
//! may be in flight and answered in any order. The connection is opened lazily by the first
//! call and reopened lazily after it breaks, with bounded exponential backoff between failed
//! attempts so a dead peer is not hammered with connects.

use crate::frame::{self, Outgoing, ReadError, READ_BUFFER_BYTES};
use crate::wire::{
    self, ErrorCode, Hello, Request, Response, WireError, PROTOCOL_VERSION, PROTOCOL_VERSION_MIN,
};
use converge_pki::{Revocations, Watchman};
use converge_types::{Knobs, NodeId};
use std::collections::HashMap;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, BufReader};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::task::AbortHandle;
use tokio::time::Instant;

/// First delay after a failed connect; doubles per failure.
pub const RECONNECT_BACKOFF_MIN_MS: u64 = 50;
/// Longest delay between connect attempts.
pub const RECONNECT_BACKOFF_MAX_MS: u64 = 2_000;

/// Why a call did not produce a response.
#[derive(Clone, Debug, thiserror::Error)]
pub enum RpcError {
    #[error("rpc to {addr}: no answer within {timeout_ms} ms (peer slow or unreachable)")]
    Timeout { addr: String, timeout_ms: u64 },
    #[error("rpc to {addr}: connection lost before the answer arrived; the next call reconnects")]
    Disconnected { addr: String },
    #[error("rpc to {addr}: cannot connect: {source} (retrying with backoff)")]
    Connect {
        addr: String,
        source: Arc<std::io::Error>,
    },
    /// The peer's TLS port refused this node's certificate as that of a removed node
    /// (`converge_pki::says_removed`).
    #[error(
        "rpc to {addr}: the peer refuses this node's certificate: this node was removed from \
         the cluster (converge node remove)"
    )]
    ThisNodeRemoved { addr: String },
    #[error("rpc to {addr}: peer refused the connection ({code}): {message}")]
    Refused {
        addr: String,
        code: ErrorCode,
        message: String,
    },
    /// The peer answered `Response::Err`.
    #[error("peer answered {code}: {message}")]
    Remote { code: ErrorCode, message: String },
    #[error("request frame of {size} payload bytes exceeds rpc_frame_bytes_max {max}")]
    FrameTooLarge { size: usize, max: usize },
    #[error("invalid request, not sent: {0}")]
    Invalid(WireError),
    #[error("rpc to {addr}: peer sent bad bytes: {source}")]
    Protocol { addr: String, source: WireError },
}

type Reply = Result<Response, RpcError>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Critical sections below never panic; if one somehow did, the map is still usable.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Callers waiting for answers on one connection.
struct Pending {
    closed: bool,
    waiters: HashMap<u64, oneshot::Sender<Reply>>,
}

/// State shared by a connection's reader task, writer task and callers.
struct ConnShared {
    addr: String,
    pending: Mutex<Pending>,
    /// `pending.closed`, readable without the lock (every call checks it).
    closed: std::sync::atomic::AtomicBool,
    tasks: Mutex<Vec<AbortHandle>>,
}

impl ConnShared {
    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    fn register(&self, id: u64) -> Result<oneshot::Receiver<Reply>, RpcError> {
        let mut p = lock(&self.pending);
        if p.closed {
            return Err(RpcError::Disconnected {
                addr: self.addr.clone(),
            });
        }
        let (tx, rx) = oneshot::channel();
        p.waiters.insert(id, tx);
        Ok(rx)
    }

    fn take(&self, id: u64) -> Option<oneshot::Sender<Reply>> {
        lock(&self.pending).waiters.remove(&id)
    }

    /// The connection is dead: every waiter gets `Disconnected`, both tasks stop.
    fn fail(&self) {
        let waiters = {
            let mut p = lock(&self.pending);
            p.closed = true;
            self.closed.store(true, Ordering::Release);
            std::mem::take(&mut p.waiters)
        };
        for (_, w) in waiters {
            let _ = w.send(Err(RpcError::Disconnected {
                addr: self.addr.clone(),
            }));
        }
        for t in lock(&self.tasks).drain(..) {
            t.abort();
        }
    }

    fn set_tasks(&self, tasks: Vec<AbortHandle>) {
        let closed = self.is_closed();
        let mut t = lock(&self.tasks);
        t.extend(tasks);
        if closed {
            // A task failed before its handles were stored.
            for t in t.drain(..) {
                t.abort();
            }
        }
    }
}

/// One established connection. Dropping the last handle stops its tasks and closes the socket.
struct Conn {
    tx: mpsc::Sender<Outgoing>,
    shared: Arc<ConnShared>,
    peer: NodeId,
    /// Ends the connection if the peer's certificate is revoked while it is open.
    _watchman: Option<Watchman>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.shared.fail();
    }
}

/// Removes a waiter whose call gave up (timeout or cancellation), so late answers are dropped.
struct WaiterGuard<'a> {
    shared: &'a ConnShared,
    id: u64,
}

impl Drop for WaiterGuard<'_> {
    fn drop(&mut self) {
        self.shared.take(self.id);
    }
}

struct Slot {
    conn: Option<Arc<Conn>>,
    failures: u32,
    retry_at: Option<Instant>,
    last_err: Option<RpcError>,
}

struct Inner {
    addr: String,
    /// The hello; its `protocol_version` is the newest version offered (see
    /// [`RpcClient::connect`] for the older ones).
    hello: Hello,
    /// Mutual TLS: this node's client settings and the node the peer must prove to be.
    tls: Option<ClientTls>,
    frame_bytes_max: usize,
    timeout: Duration,
    inflight: Semaphore,
    inflight_max: usize,
    next_id: AtomicU64,
    connections: AtomicU64,
    /// The connection in use, for calls to take without waiting on `slot`'s async lock
    /// (taken only to connect): calls from every runtime thread share it.
    live: std::sync::RwLock<Option<Arc<Conn>>>,
    slot: tokio::sync::Mutex<Slot>,
}

/// Mutual TLS of a client: the settings, the node the peer must prove to be, and the
/// revocation list that ends an open connection whose certificate it comes to refuse.
#[derive(Clone)]
struct ClientTls {
    connector: tokio_rustls::TlsConnector,
    peer: NodeId,
    revocations: Option<Arc<Revocations>>,
}

/// A pipelined connection to one peer. Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct RpcClient {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for RpcClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcClient")
            .field("addr", &self.inner.addr)
            .finish_non_exhaustive()
    }
}

impl Hello {
    /// A hello for this node, speaking this build's protocol version.
    pub fn new(cluster: converge_types::ClusterId, node: NodeId) -> Hello {
        Hello {
            cluster,
            node,
            protocol_version: PROTOCOL_VERSION,
        }
    }
}

impl RpcClient {
    /// A client for the peer at `addr` (`host:port`). Does not connect: the first call does.
    pub fn new(addr: String, hello: Hello, knobs: &Knobs) -> RpcClient {
        Self::build(addr, hello, knobs, None)
    }

    /// A client for node `peer` at `addr` over mutual TLS (`tls` presents this node's
    /// certificate and trusts the cluster's CA): the connection is refused unless the peer's
    /// certificate names `peer` and its hello answers as `peer`.
    pub fn with_tls(
        addr: String,
        hello: Hello,
        knobs: &Knobs,
        tls: Arc<rustls::ClientConfig>,
        peer: NodeId,
    ) -> RpcClient {
        Self::build_tls(addr, hello, knobs, tls, peer, None)
    }

    /// As [`RpcClient::with_tls`], and a connection open when `revocations` comes to
    /// refuse the peer's certificate (the peer removed, its certificate revoked) is closed;
    /// the next call's handshake then refuses the peer. `tls` should check `revocations`
    /// too (`NodeTls::peer_client` of a `NodeTls` given them), as a node's does.
    pub fn with_tls_watching(
        addr: String,
        hello: Hello,
        knobs: &Knobs,
        tls: Arc<rustls::ClientConfig>,
        peer: NodeId,
        revocations: Arc<Revocations>,
    ) -> RpcClient {
        Self::build_tls(addr, hello, knobs, tls, peer, Some(revocations))
    }

    fn build_tls(
        addr: String,
        hello: Hello,
        knobs: &Knobs,
        tls: Arc<rustls::ClientConfig>,
        peer: NodeId,
        revocations: Option<Arc<Revocations>>,
    ) -> RpcClient {
        let tls = ClientTls {
            connector: tokio_rustls::TlsConnector::from(tls),
            peer,
            revocations,
        };
        Self::build(addr, hello, knobs, Some(tls))
    }

    fn build(addr: String, hello: Hello, knobs: &Knobs, tls: Option<ClientTls>) -> RpcClient {
        let inflight_max = knobs.rpc_inflight_max.max(1);
        RpcClient {
            inner: Arc::new(Inner {
                addr,
                hello,
                tls,
                frame_bytes_max: knobs.rpc_frame_bytes_max,
                timeout: Duration::from_millis(knobs.replica_timeout_ms),
                inflight: Semaphore::new(inflight_max),
                inflight_max,
                next_id: AtomicU64::new(1),
                connections: AtomicU64::new(0),
                live: std::sync::RwLock::new(None),
                slot: tokio::sync::Mutex::new(Slot {
                    conn: None,
                    failures: 0,
                    retry_at: None,
                    last_err: None,
                }),
            }),
        }
    }

    /// The same client offering protocol versions up to `newest` (tests of how releases
    /// negotiate; a node offers this build's newest, [`PROTOCOL_VERSION`]).
    pub fn speaking(self, newest: u16) -> RpcClient {
        let mut hello = self.inner.hello.clone();
        hello.protocol_version = newest;
        RpcClient::build(
            self.inner.addr.clone(),
            hello,
            &Knobs {
                rpc_inflight_max: self.inner.inflight_max,
                rpc_frame_bytes_max: self.inner.frame_bytes_max,
                replica_timeout_ms: self.inner.timeout.as_millis() as u64,
                ..Knobs::default()
            },
            self.inner.tls.clone(),
        )
    }

    /// The peer's address, as given to `new`.
    pub fn addr(&self) -> &str {
        &self.inner.addr
    }

    /// How many connections (successful handshakes) this client has made so far.
    pub fn connections_made(&self) -> u64 {
        self.inner.connections.load(Ordering::Relaxed)
    }

    /// The peer's node id from its `HelloOk`, if a connection is up.
    pub async fn peer_node(&self) -> Option<NodeId> {
        let slot = self.inner.slot.lock().await;
        slot.conn
            .as_ref()
            .filter(|c| !c.shared.is_closed())
            .map(|c| c.peer)
    }

    /// Sends `req` and waits for its answer, at most `replica_timeout_ms` in all (waiting for
    /// an in-flight slot and connecting included).
    ///
    /// A `Response::Err` from the peer is returned as `Err(RpcError::Remote { code, message })`,
    /// so `Ok` always holds a success variant (`Extent`, `Pong`, `HelloOk`).
    /// `Hello` is sent by the client itself on connect and is refused here.
    pub async fn call(&self, req: Request) -> Result<Response, RpcError> {
        self.call_within(req, self.inner.timeout).await
    }

    /// [`RpcClient::call`] with its own time limit (redirected volume I/O may wait on the
    /// owner's own replica timeouts, so it needs longer than one replica request).
    pub async fn call_within(
        &self,
        req: Request,
        timeout: std::time::Duration,
    ) -> Result<Response, RpcError> {
        if matches!(req, Request::Hello(_)) {
            return Err(RpcError::Invalid(WireError::Invalid(
                "Hello is sent by the client on connect, not by callers".into(),
            )));
        }
        wire::validate_request(&req).map_err(RpcError::Invalid)?;
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let frame = wire::encode_request(id, &req);
        if frame.payload_len() > self.inner.frame_bytes_max {
            return Err(RpcError::FrameTooLarge {
                size: frame.payload_len(),
                max: self.inner.frame_bytes_max,
            });
        }
        let deadline = Instant::now() + timeout;
        match tokio::time::timeout_at(deadline, self.send_and_wait(id, frame, deadline)).await {
            Ok(r) => r,
            Err(_) => Err(RpcError::Timeout {
                addr: self.inner.addr.clone(),
                timeout_ms: timeout.as_millis() as u64,
            }),
        }
    }

    async fn send_and_wait(
        &self,
        id: u64,
        frame: wire::EncodedFrame,
        deadline: Instant,
    ) -> Result<Response, RpcError> {
        let disconnected = || RpcError::Disconnected {
            addr: self.inner.addr.clone(),
        };
        let _permit = self
            .inner
            .inflight
            .acquire()
            .await
            .map_err(|_| disconnected())?;
        let conn = self.connection(deadline).await?;
        let rx = conn.shared.register(id)?;
        let _guard = WaiterGuard {
            shared: &conn.shared,
            id,
        };
        conn.tx
            .send(Outgoing::Frame(frame))
            .await
            .map_err(|_| disconnected())?;
        match rx.await.map_err(|_| disconnected())?? {
            Response::Err { code, message } => Err(RpcError::Remote { code, message }),
            r => Ok(r),
        }
    }

    /// The live connection, or a new one (one connect at a time; failed connects back off).
    async fn connection(&self, deadline: Instant) -> Result<Arc<Conn>, RpcError> {
        if let Some(c) = self
            .inner
            .live
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .filter(|c| !c.shared.is_closed())
        {
            return Ok(c.clone());
        }
        let mut slot = self.inner.slot.lock().await;
        if let Some(c) = &slot.conn {
            if !c.shared.is_closed() {
                return Ok(c.clone());
            }
            slot.conn = None;
            *self.inner.live.write().unwrap_or_else(|e| e.into_inner()) = None;
        }
        if let (Some(at), Some(e)) = (slot.retry_at, &slot.last_err) {
            if Instant::now() < at {
                return Err(e.clone());
            }
        }
        let attempt = tokio::time::timeout_at(deadline, self.connect()).await;
        match attempt {
            Ok(Ok(conn)) => {
                let conn = Arc::new(conn);
                slot.failures = 0;
                slot.retry_at = None;
                slot.last_err = None;
                slot.conn = Some(conn.clone());
                *self.inner.live.write().unwrap_or_else(|e| e.into_inner()) = Some(conn.clone());
                self.inner.connections.fetch_add(1, Ordering::Relaxed);
                Ok(conn)
            }
            Ok(Err(e)) => {
                self.backoff(&mut slot, e.clone());
                Err(e)
            }
            Err(_) => {
                let e = RpcError::Timeout {
                    addr: self.inner.addr.clone(),
                    timeout_ms: self.inner.timeout.as_millis() as u64,
                };
                self.backoff(&mut slot, e.clone());
                Err(e)
            }
        }
    }

    fn backoff(&self, slot: &mut Slot, e: RpcError) {
        slot.failures = slot.failures.saturating_add(1);
        let shift = (slot.failures - 1).min(16);
        let delay_ms = (RECONNECT_BACKOFF_MIN_MS << shift).min(RECONNECT_BACKOFF_MAX_MS);
        log::warn!(
            "rpc to {}: connect attempt {} failed: {e}; next attempt in {delay_ms} ms",
            self.inner.addr,
            slot.failures
        );
        slot.retry_at = Some(Instant::now() + Duration::from_millis(delay_ms));
        slot.last_err = Some(e);
    }

    /// Connects, says hello offering the newest protocol version, and starts the reader and
    /// writer tasks. A peer of an older release that refuses the version (releases before
    /// 0.2 refuse any but their own) is asked again in each older version this build
    /// speaks, down to [`PROTOCOL_VERSION_MIN`].
    async fn connect(&self) -> Result<Conn, RpcError> {
        let mut offered = self.inner.hello.protocol_version;
        loop {
            match self.connect_offering(offered).await {
                Err(RpcError::Refused { message, .. })
                    if message.contains("protocol version") && offered > PROTOCOL_VERSION_MIN =>
                {
                    log::info!(
                        "rpc to {}: the peer does not speak protocol version {offered} \
                         ({message}); saying hello in version {}",
                        self.inner.addr,
                        offered - 1
                    );
                    offered -= 1;
                }
                r => return r,
            }
        }
    }

    async fn connect_offering(&self, offered: u16) -> Result<Conn, RpcError> {
        let addr = &self.inner.addr;
        let io_err = |e: std::io::Error| RpcError::Connect {
            addr: addr.clone(),
            source: Arc::new(e),
        };
        let stream = TcpStream::connect(addr.as_str()).await.map_err(io_err)?;
        stream.set_nodelay(true).map_err(io_err)?;
        match &self.inner.tls {
            None => {
                let (rd, wr) = stream.into_split();
                self.start(rd, wr, None, offered).await
            }
            Some(ClientTls {
                connector,
                peer,
                revocations,
            }) => {
                // A duplicate descriptor of the socket, for the watch to shut it down.
                let socket = match revocations {
                    Some(_) => Some(stream.as_fd().try_clone_to_owned().map_err(io_err)?),
                    None => None,
                };
                let name = converge_pki::node_server_name(peer.0);
                let tls = connector.connect(name, stream).await.map_err(|e| {
                    if converge_pki::io_says_removed(&e) {
                        return RpcError::ThisNodeRemoved { addr: addr.clone() };
                    }
                    io_err(std::io::Error::new(
                        e.kind(),
                        format!("TLS handshake with node {peer} failed: {e}"),
                    ))
                })?;
                let cert = tls.get_ref().1.peer_certificates().and_then(|c| c.first());
                let watchman = match (revocations, cert, socket) {
                    (Some(r), Some(cert), Some(socket)) => r.watch_connection(
                        cert,
                        format!("rpc to {addr} (node {peer})"),
                        converge_pki::cut_socket(socket),
                    ),
                    _ => None,
                };
                let (rd, wr) = tokio::io::split(tls);
                let mut conn = self.start(rd, wr, Some(*peer), offered).await?;
                conn._watchman = watchman;
                Ok(conn)
            }
        }
    }

    /// Says hello over a connected stream, offering protocol versions up to `offered`, and
    /// starts the reader and writer tasks in the version the peer answers in. With
    /// `expect`, the peer must answer as that node.
    async fn start<R, W>(
        &self,
        rd: R,
        mut wr: W,
        expect: Option<NodeId>,
        offered: u16,
    ) -> Result<Conn, RpcError>
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let addr = &self.inner.addr;
        // Under TLS 1.3 the server judges our certificate after our side finished the
        // handshake: its refusal arrives here, at the hello.
        let io_err = |e: std::io::Error| match converge_pki::io_says_removed(&e) {
            true => RpcError::ThisNodeRemoved { addr: addr.clone() },
            false => RpcError::Connect {
                addr: addr.clone(),
                source: Arc::new(e),
            },
        };
        let mut rd = BufReader::with_capacity(READ_BUFFER_BYTES, rd);

        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let hello = Hello {
            protocol_version: offered,
            ..self.inner.hello.clone()
        };
        // Framed in the oldest version this build speaks, which a peer one release older
        // reads too; the version offered is in the hello itself.
        let hello =
            wire::encode_request(id, &Request::Hello(hello)).at_version(PROTOCOL_VERSION_MIN);
        frame::write_frame(&mut wr, &hello).await.map_err(io_err)?;
        let protocol = |source: WireError| RpcError::Protocol {
            addr: addr.clone(),
            source,
        };
        let (h, payload) = match frame::read_frame(&mut rd, self.inner.frame_bytes_max).await {
            Ok(Some(f)) => f,
            Ok(None) => {
                return Err(io_err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "peer closed the connection during the handshake",
                )))
            }
            Err(ReadError::Io(e)) => return Err(io_err(e)),
            Err(ReadError::Wire(e)) => return Err(protocol(e)),
            Err(e @ ReadError::TooLarge { .. }) => {
                return Err(protocol(WireError::Invalid(e.to_string())))
            }
        };
        wire::check_payload(&h, &payload).map_err(protocol)?;
        if h.request_id != id {
            return Err(protocol(WireError::Invalid(format!(
                "handshake answer carries request id {}, expected {id}",
                h.request_id
            ))));
        }
        // The answer comes in the version the connection runs at.
        let version = h.version;
        let peer = match wire::decode_response(h.msg_type, payload).map_err(protocol)? {
            Response::HelloOk { .. } if !(PROTOCOL_VERSION_MIN..=offered).contains(&version) => {
                return Err(protocol(WireError::Invalid(format!(
                    "the peer answered in protocol version {version}; this node offered \
                     {PROTOCOL_VERSION_MIN} to {offered}"
                ))))
            }
            Response::HelloOk { node } => node,
            Response::Err { code, message } => {
                log::warn!("rpc to {addr}: peer refused our hello ({code}): {message}");
                return Err(RpcError::Refused {
                    addr: addr.clone(),
                    code,
                    message,
                });
            }
            other => {
                return Err(protocol(WireError::Invalid(format!(
                    "handshake answered with {other:?} instead of HelloOk"
                ))))
            }
        };
        if let Some(want) = expect {
            if peer != want {
                return Err(protocol(WireError::Invalid(format!(
                    "the peer answered as node {peer}, but its certificate is node {want}'s"
                ))));
            }
        }
        log::debug!("rpc to {addr}: connected to node {peer} (protocol version {version})");

        let shared = Arc::new(ConnShared {
            addr: addr.clone(),
            pending: Mutex::new(Pending {
                closed: false,
                waiters: HashMap::new(),
            }),
            closed: std::sync::atomic::AtomicBool::new(false),
            tasks: Mutex::new(Vec::new()),
        });
        let (tx, rx) = mpsc::channel(self.inner.inflight_max);
        let writer = {
            let shared = shared.clone();
            tokio::spawn(async move {
                // More frames are likely while other requests of this connection wait
                // for their answers (a busy peer); with one request in flight, none.
                let busy = shared.clone();
                let more = move |n: usize| lock(&busy.pending).waiters.len() > n;
                if let Err(e) = frame::write_loop(wr, rx, more, version).await {
                    log::warn!("rpc to {}: write failed: {e}", shared.addr);
                }
                shared.fail();
            })
        };
        let reader = tokio::spawn(read_loop(rd, shared.clone(), self.inner.frame_bytes_max));
        shared.set_tasks(vec![writer.abort_handle(), reader.abort_handle()]);
        Ok(Conn {
            tx,
            shared,
            peer,
            _watchman: None,
        })
    }
}

/// Delivers each answer to its caller until the connection breaks.
async fn read_loop<R: tokio::io::AsyncRead + Unpin>(
    mut rd: R,
    shared: Arc<ConnShared>,
    frame_bytes_max: usize,
) {
    loop {
        match frame::read_frame(&mut rd, frame_bytes_max).await {
            Ok(Some((h, payload))) => {
                let reply = wire::check_payload(&h, &payload)
                    .and_then(|()| wire::decode_response(h.msg_type, payload))
                    .map_err(|source| RpcError::Protocol {
                        addr: shared.addr.clone(),
                        source,
                    });
                match shared.take(h.request_id) {
                    Some(w) => {
                        let _ = w.send(reply);
                    }
                    None => log::debug!(
                        "rpc to {}: answer to request {} arrived after its caller gave up",
                        shared.addr,
                        h.request_id
                    ),
                }
            }
            Ok(None) => {
                log::info!("rpc to {}: peer closed the connection", shared.addr);
                break;
            }
            Err(e) => {
                log::warn!("rpc to {}: dropping connection: {e}", shared.addr);
                break;
            }
        }
    }
    shared.fail();
}
