//! Server entry points: configuration, counters, accept loops and the per-connection driver.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufReader, BufWriter, ReadHalf, WriteHalf};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::CertificateDer;

use crate::dev::Resolver;
use crate::error::{ConfigError, NbdError};
use crate::handshake::{ClientFlags, Haggled, TlsPhase};
use crate::{handshake, transmission};

/// Buffer size of each direction during the handshake (the reader keeps it for requests).
const STREAM_BUFFER_BYTES: usize = 64 * 1024;

/// Server tunables. `Default` gives the documented defaults.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Requests executing or waiting to be written, per connection (default 64).
    pub inflight_max: usize,
    /// Largest READ/WRITE payload, advertised as the maximum block size (default 32 MiB).
    pub max_request_bytes: u32,
    /// Advertised minimum block size (default 4096, the engine's checksum block). Enforced
    /// (EINVAL) only for clients that asked for block sizes in NBD_OPT_GO.
    pub min_block: u32,
    /// Advertised preferred block size (default 4096).
    pub preferred_block: u32,
    /// Export read-only: NBD_FLAG_READ_ONLY, writes/trims fail with EPERM.
    pub read_only: bool,
    /// A client must pick an export within this time (default 30 s).
    pub handshake_timeout_ms: u64,
    /// Connections served at once by `serve_unix`/`serve_tcp` (default 1024); more wait.
    pub connections_max: usize,
    /// Counters shared by every connection served with this configuration.
    pub stats: Arc<ServerStats>,
    /// `Some`: TLS is required (the NBD spec's FORCEDTLS mode). Before NBD_OPT_STARTTLS
    /// every option but STARTTLS and ABORT is refused with `NBD_REP_ERR_TLS_REQD` and
    /// NBD_OPT_EXPORT_NAME closes the connection; after it, the rest of the handshake and
    /// all transmission run over TLS. Whether clients need certificates is this rustls
    /// configuration's business (see [`tls_server_config`](crate::tls_server_config)).
    /// `None` (default): no TLS, STARTTLS is refused with `NBD_REP_ERR_POLICY`.
    /// `serve_tcp` and `serve_connection` honour it; `serve_unix` never uses TLS.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// Told of each TCP client's certificate once its TLS handshake is done, to end the
    /// connection if that certificate is revoked while it is open (`serve_tcp` only).
    pub client_watch: Option<Arc<dyn ClientWatch>>,
}

/// Ends TLS connections whose client certificate comes to be refused while they are open
/// (a revoked certificate): see [`ServerConfig::client_watch`].
pub trait ClientWatch: Send + Sync + std::fmt::Debug {
    /// Starts watching the connection from `peer`, whose client presented `cert`; calling
    /// `cut` ends the connection (its socket is shut down both ways: requests in flight
    /// finish, their replies are lost). What it returns is dropped when the connection ends,
    /// and should stop the watch then.
    fn watch(
        &self,
        cert: &CertificateDer<'_>,
        peer: &str,
        cut: Box<dyn FnOnce() + Send>,
    ) -> Option<Box<dyn Send>>;
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            inflight_max: 64,
            max_request_bytes: 32 * 1024 * 1024,
            min_block: 4096,
            preferred_block: 4096,
            read_only: false,
            handshake_timeout_ms: 30_000,
            connections_max: 1024,
            stats: Arc::new(ServerStats::default()),
            tls: None,
            client_watch: None,
        }
    }
}

impl ServerConfig {
    /// Checks the block-size constraints the NBD spec puts on advertised values.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.inflight_max == 0 {
            return Err(ConfigError::InflightZero);
        }
        let min = self.min_block;
        if !min.is_power_of_two() || min > 65536 {
            return Err(ConfigError::MinBlock(min));
        }
        let preferred = self.preferred_block;
        if !preferred.is_power_of_two() || preferred < min {
            return Err(ConfigError::PreferredBlock { preferred, min });
        }
        let max = self.max_request_bytes;
        if !max.is_multiple_of(min) || max < preferred || max > 64 * 1024 * 1024 {
            return Err(ConfigError::MaxRequest { max, min });
        }
        Ok(())
    }
}

/// Counters, cheap to bump from any connection; read them with `snapshot`.
#[derive(Debug, Default)]
pub struct ServerStats {
    pub connections_accepted: AtomicU64,
    pub connections_active: AtomicU64,
    pub requests: AtomicU64,
    /// Error replies sent (bad requests and device errors).
    pub errors: AtomicU64,
    /// Payload bytes returned by reads / accepted by writes.
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
}

/// A point-in-time copy of `ServerStats`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub connections_accepted: u64,
    pub connections_active: u64,
    pub requests: u64,
    pub errors: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
}

impl ServerStats {
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            connections_accepted: self.connections_accepted.load(Ordering::Relaxed),
            connections_active: self.connections_active.load(Ordering::Relaxed),
            requests: self.requests.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            bytes_read: self.bytes_read.load(Ordering::Relaxed),
            bytes_written: self.bytes_written.load(Ordering::Relaxed),
        }
    }
}

struct ActiveGuard(Arc<ServerStats>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.connections_active.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Serves one already-accepted connection to its end. `Ok` for clean ends (ABORT, DISC,
/// client closing between messages); `Err` says why the connection was dropped. With
/// `cfg.tls` set the client must upgrade with NBD_OPT_STARTTLS, whatever `stream` is.
pub async fn serve_connection<R, S>(
    stream: S,
    resolver: Arc<R>,
    cfg: ServerConfig,
) -> Result<(), NbdError>
where
    R: Resolver,
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    serve_watched(stream, None, resolver, cfg).await
}

/// A TCP connection's socket, for [`ServerConfig::client_watch`] to cut.
struct Watched {
    /// A duplicate descriptor of the connection's socket.
    socket: OwnedFd,
    /// The peer's address, for the log.
    peer: String,
}

/// [`serve_connection`], with what a client watch needs to end the connection.
async fn serve_watched<R, S>(
    stream: S,
    watched: Option<Watched>,
    resolver: Arc<R>,
    cfg: ServerConfig,
) -> Result<(), NbdError>
where
    R: Resolver,
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    cfg.validate()?;
    cfg.stats
        .connections_accepted
        .fetch_add(1, Ordering::Relaxed);
    cfg.stats.connections_active.fetch_add(1, Ordering::Relaxed);
    let _active = ActiveGuard(Arc::clone(&cfg.stats));

    // One deadline for the whole handshake, a TLS upgrade included.
    let deadline = Instant::now() + Duration::from_millis(cfg.handshake_timeout_ms);
    let (rd, wr) = tokio::io::split(stream);
    let mut rd = BufReader::with_capacity(STREAM_BUFFER_BYTES, rd);
    let mut wr = BufWriter::with_capacity(STREAM_BUFFER_BYTES, wr);
    let phase = if cfg.tls.is_some() {
        TlsPhase::Required
    } else {
        TlsPhase::Off
    };
    let mut options_seen = 0;
    let greeted = async {
        let Some(client) = handshake::greet(&mut rd, &mut wr).await? else {
            return Ok(None);
        };
        let haggled = handshake::haggle(
            &mut rd,
            &mut wr,
            &*resolver,
            &cfg,
            client,
            phase,
            &mut options_seen,
        )
        .await?;
        Ok::<_, NbdError>(Some((client, haggled)))
    };
    let Some((client, haggled)) = within(deadline, &cfg, greeted).await? else {
        return Ok(());
    };
    match haggled {
        Haggled::Export(neg) => transmit(&mut rd, wr, neg, &cfg).await,
        Haggled::Closed => Ok(()),
        Haggled::StartTls => {
            let Some(tls) = cfg.tls.clone() else {
                unreachable!(
                    "STARTTLS is acknowledged only in TlsPhase::Required, set from cfg.tls"
                );
            };
            // Boxed: the TLS session's state stays out of the plaintext connection's future.
            let upgrade = Upgrade {
                tls,
                client,
                options_seen,
                deadline,
                watched,
            };
            Box::pin(serve_tls(rd, wr, upgrade, &*resolver, &cfg)).await
        }
    }
}

/// Runs a handshake step against the connection's handshake deadline.
async fn within<T>(
    deadline: Instant,
    cfg: &ServerConfig,
    step: impl std::future::Future<Output = Result<T, NbdError>>,
) -> Result<T, NbdError> {
    tokio::time::timeout_at(deadline, step)
        .await
        .map_err(|_| NbdError::HandshakeTimeout(cfg.handshake_timeout_ms))?
}

/// What the plaintext part of a handshake hands to the TLS part.
struct Upgrade {
    tls: Arc<rustls::ServerConfig>,
    client: ClientFlags,
    options_seen: usize,
    deadline: Instant,
    watched: Option<Watched>,
}

/// After an acknowledged STARTTLS: the TLS handshake on the same stream, then option
/// haggling again and the transmission phase, both over TLS.
async fn serve_tls<R, S>(
    rd: BufReader<ReadHalf<S>>,
    wr: BufWriter<WriteHalf<S>>,
    mut up: Upgrade,
    resolver: &R,
    cfg: &ServerConfig,
) -> Result<(), NbdError>
where
    R: Resolver,
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    // Bytes already buffered were sent in plaintext before our ACK (a compliant client
    // waits for it); taking them into the TLS session would let whoever can write to the
    // network inject them, so they end the connection.
    if !rd.buffer().is_empty() {
        return Err(NbdError::PlaintextAfterStartTls(rd.buffer().len()));
    }
    // Every handshake message is flushed as it is sent, so nothing is lost here.
    debug_assert!(wr.buffer().is_empty());
    let stream = rd.into_inner().unsplit(wr.into_inner());
    let acceptor = tokio_rustls::TlsAcceptor::from(up.tls);
    let accept = async {
        acceptor
            .accept(stream)
            .await
            .map_err(NbdError::TlsHandshake)
    };
    let stream = within(up.deadline, cfg, accept).await?;
    let _watch = {
        let (_, session) = stream.get_ref();
        log::debug!(
            "nbd: TLS established: {:?}, {:?}, client certificate: {}",
            session.protocol_version(),
            session.negotiated_cipher_suite().map(|s| s.suite()),
            session.peer_certificates().is_some_and(|c| !c.is_empty()),
        );
        let cert = session.peer_certificates().and_then(|c| c.first());
        match (&cfg.client_watch, cert, up.watched.take()) {
            (Some(w), Some(cert), Some(Watched { socket, peer })) => {
                w.watch(cert, &peer, Box::new(move || shut_down(socket)))
            }
            _ => None,
        }
    };

    let (rd, wr) = tokio::io::split(stream);
    let mut rd = BufReader::with_capacity(STREAM_BUFFER_BYTES, rd);
    let mut wr = BufWriter::with_capacity(STREAM_BUFFER_BYTES, wr);
    let haggle = handshake::haggle(
        &mut rd,
        &mut wr,
        resolver,
        cfg,
        up.client,
        TlsPhase::Active,
        &mut up.options_seen,
    );
    match within(up.deadline, cfg, haggle).await? {
        Haggled::Export(neg) => transmit(&mut rd, wr, neg, cfg).await,
        Haggled::Closed => {
            // Say goodbye properly (close_notify) to a client that aborted.
            let _ = wr.shutdown().await;
            Ok(())
        }
        Haggled::StartTls => unreachable!("a second STARTTLS is refused, never acknowledged"),
    }
}

/// The transmission phase after a successful handshake on either kind of stream.
async fn transmit<D, Rd, Wr>(
    rd: &mut Rd,
    mut wr: BufWriter<Wr>,
    neg: handshake::Negotiated<D>,
    cfg: &ServerConfig,
) -> Result<(), NbdError>
where
    D: crate::BlockDev,
    Rd: AsyncRead + Unpin,
    Wr: AsyncWrite + Unpin,
{
    log::debug!(
        "nbd: serving export {} (block sizes negotiated: {}, structured replies: {}, \
         metadata contexts: {})",
        neg.name,
        neg.block_size_negotiated,
        neg.structured,
        neg.meta_contexts.len(),
    );
    // Replies go to the socket directly (vectored, read data not copied): the buffer
    // served the handshake's small messages only.
    wr.flush().await?;
    transmission::run(rd, wr.get_mut(), neg, cfg).await
}

/// Shuts a TCP socket down both ways, given a duplicate of its descriptor: the
/// connection's reads see the end of the stream and its writes fail.
fn shut_down(socket: OwnedFd) {
    let s = std::net::TcpStream::from(socket);
    if let Err(e) = s.shutdown(std::net::Shutdown::Both) {
        log::debug!("nbd: shutting a connection's socket down: {e}");
    }
}

fn config_io_error(e: ConfigError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, e)
}

async fn accept_backoff(e: &io::Error) {
    // EMFILE and friends: wait instead of spinning; the loop must survive them.
    log::warn!("nbd: accept failed: {e}");
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// A listener the shared accept loop can take connections from.
trait Acceptor: Send + Sync {
    type Stream: AsyncRead + AsyncWrite + AsFd + Unpin + Send + 'static;
    /// The next connection and a name for the peer, for logs.
    fn accept_one(
        &self,
    ) -> impl std::future::Future<Output = io::Result<(Self::Stream, String)>> + Send;
    /// Whether a client watch can end this kind of connection.
    const WATCHABLE: bool;
}

impl Acceptor for UnixListener {
    type Stream = tokio::net::UnixStream;
    // No TLS, so no certificate to revoke.
    const WATCHABLE: bool = false;
    async fn accept_one(&self) -> io::Result<(Self::Stream, String)> {
        let (stream, _) = self.accept().await?;
        Ok((stream, "unix socket".to_string()))
    }
}

impl Acceptor for TcpListener {
    type Stream = tokio::net::TcpStream;
    const WATCHABLE: bool = true;
    async fn accept_one(&self) -> io::Result<(Self::Stream, String)> {
        let (stream, peer) = self.accept().await?;
        // Replies are small and latency-bound; do not let Nagle hold them back.
        if let Err(e) = stream.set_nodelay(true) {
            log::debug!("nbd: set_nodelay for {peer}: {e}");
        }
        Ok((stream, peer.to_string()))
    }
}

/// The accept loop both listeners share: bounded connections, one task per connection,
/// accept errors (EMFILE and friends) waited out rather than fatal.
async fn accept_loop<R: Resolver, L: Acceptor>(
    listener: L,
    resolver: Arc<R>,
    cfg: ServerConfig,
) -> io::Result<()> {
    cfg.validate().map_err(config_io_error)?;
    let slots = Arc::new(Semaphore::new(cfg.connections_max.max(1)));
    loop {
        let permit = Arc::clone(&slots)
            .acquire_owned()
            .await
            .map_err(io::Error::other)?;
        let (stream, peer) = match listener.accept_one().await {
            Ok(x) => x,
            Err(e) => {
                accept_backoff(&e).await;
                continue;
            }
        };
        // A duplicate of the socket, for a client watch to shut it down.
        let watched = if L::WATCHABLE && cfg.tls.is_some() && cfg.client_watch.is_some() {
            match stream.as_fd().try_clone_to_owned() {
                Ok(socket) => Some(Watched {
                    socket,
                    peer: peer.clone(),
                }),
                Err(e) => {
                    log::warn!("nbd: cannot watch the connection from {peer} ({e}); closed");
                    continue;
                }
            }
        } else {
            None
        };
        let (resolver, cfg) = (Arc::clone(&resolver), cfg.clone());
        tokio::spawn(async move {
            if let Err(e) = serve_watched(stream, watched, resolver, cfg).await {
                log::info!("nbd: connection from {peer} ended: {e}");
            }
            drop(permit);
        });
    }
}

/// Accepts on a unix socket forever, one task per connection. Errs only on a bad `cfg`.
/// `cfg.tls` is ignored: a unix socket is as private as its file's permissions, and the
/// clients on this host connect in plaintext.
pub async fn serve_unix<R: Resolver>(
    listener: UnixListener,
    resolver: Arc<R>,
    mut cfg: ServerConfig,
) -> io::Result<()> {
    cfg.tls = None;
    accept_loop(listener, resolver, cfg).await
}

/// Accepts on TCP forever, one task per connection. Errs only on a bad `cfg`. With
/// `cfg.tls` set every client must upgrade with NBD_OPT_STARTTLS (`nbds://` URIs).
pub async fn serve_tcp<R: Resolver>(
    listener: TcpListener,
    resolver: Arc<R>,
    cfg: ServerConfig,
) -> io::Result<()> {
    accept_loop(listener, resolver, cfg).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_validation() {
        assert!(ServerConfig::default().validate().is_ok());
        let bad = |f: fn(&mut ServerConfig)| {
            let mut c = ServerConfig::default();
            f(&mut c);
            c.validate().is_err()
        };
        assert!(bad(|c| c.inflight_max = 0));
        assert!(bad(|c| c.min_block = 3000));
        assert!(bad(|c| c.preferred_block = 512));
        assert!(bad(|c| c.max_request_bytes = 32 * 1024 * 1024 + 512));
        assert!(bad(|c| c.max_request_bytes = 128 * 1024 * 1024));
    }
}
