//! The node's HTTP API (JSON, what the CLI uses) and `/metrics` (Prometheus text format).
//! Every node answers every request: cluster state comes from etcd; requests that change a
//! volume's served state (delete, resize) are forwarded to the volume's owner node.

use crate::node::{drive_loads, extents_used, Node};
use bytes::Bytes;
use converge_api::*;
use converge_control::model::{SlabRecord, VolumeRecord};
use converge_control::placement;
use converge_types::{Compression, ExtentState, NodeId, Resiliency, VolumeId, BLOCK_SIZE};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::cache_api;

type Resp = Response<Full<Bytes>>;

const BODY_BYTES_MAX: usize = 1 << 20;
/// Body bound of a request that carries no token (`POST /v1/join`: a join request is a few
/// hundred bytes).
const OPEN_BODY_BYTES_MAX: usize = 16 << 10;

/// Connections the API serves at once; further ones wait in the listen backlog.
const CONNECTIONS_MAX: usize = 256;
/// Connections one source host may hold before it has shown a token (in a TLS handshake,
/// sending headers, or on the routes that need none): one host cannot hold every slot.
const UNAUTHENTICATED_PER_SOURCE_MAX: usize = 32;
/// How long a connection may take from accept to its first request's headers (the TLS
/// handshake included).
const FIRST_REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
/// How long an authenticated connection may take to send a request's headers, and may sit
/// idle between requests, before it is closed.
const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// How long a request's body may take to arrive.
const BODY_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// How long the body of a request without a token may take (`POST /v1/join`).
const OPEN_BODY_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
/// Pause after a failed `accept` (out of file descriptors, most likely) before the next.
const ACCEPT_ERROR_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

/// A connection's standing: unauthenticated (it holds a place of its source host's) until a
/// request shows a valid token.
#[derive(Clone)]
struct Standing {
    pending: Arc<std::sync::Mutex<Option<converge_rpc::handshakes::Pending>>>,
    started: Arc<std::sync::atomic::AtomicBool>,
}

impl Standing {
    /// A request arrived (its headers are in).
    fn started(&self) {
        self.started
            .store(true, std::sync::atomic::Ordering::Release);
    }
    /// A request showed a valid token: the connection no longer counts against its host.
    fn authenticated(&self) {
        self.pending.lock().expect("standing poisoned").take();
    }
}

/// Serves the API on `listener` until the process ends. A failed `accept` (the process out
/// of file descriptors, say) is logged and retried after a pause, never the end of the API.
/// A connection must send its first request's headers within `FIRST_REQUEST_TIMEOUT` of
/// being accepted; until a request shows a token it holds one of its source host's
/// `UNAUTHENTICATED_PER_SOURCE_MAX` places (a host holding them all gets further
/// connections closed at once), and every answer to a request without a valid token closes
/// the connection. So a stranger holds at most that many of `CONNECTIONS_MAX` slots, each
/// for seconds.
pub async fn serve(
    listener: tokio::net::TcpListener,
    node: Arc<Node>,
    tls: Arc<rustls::ServerConfig>,
) -> std::io::Result<()> {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let slots = Arc::new(tokio::sync::Semaphore::new(CONNECTIONS_MAX));
    let handshakes = converge_rpc::handshakes::Handshakes::new(UNAUTHENTICATED_PER_SOURCE_MAX);
    loop {
        let permit = slots
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let (stream, addr) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                log::warn!("api: accept failed: {e}; retrying in {ACCEPT_ERROR_PAUSE:?}");
                tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                continue;
            }
        };
        let Some(pending) = handshakes.enter(addr.ip()) else {
            log::debug!(
                "api: {addr} holds {UNAUTHENTICATED_PER_SOURCE_MAX} unauthenticated \
                 connections already; closed"
            );
            continue;
        };
        let node = node.clone();
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let deadline = tokio::time::Instant::now() + FIRST_REQUEST_TIMEOUT;
            let standing = Standing {
                pending: Arc::new(std::sync::Mutex::new(Some(pending))),
                started: Default::default(),
            };
            // A duplicate descriptor of the socket, to shut it down if the certificate the
            // caller shows is revoked while the connection is open (keep-alive).
            let socket = match std::os::fd::AsFd::as_fd(&stream).try_clone_to_owned() {
                Ok(s) => s,
                Err(e) => {
                    log::warn!("api: cannot watch the connection from {addr} ({e}); closed");
                    return;
                }
            };
            // The TLS handshake is bounded with the first request's headers: a client that
            // stalls in it holds a connection slot no longer.
            let stream = match tokio::time::timeout_at(deadline, acceptor.accept(stream)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    log::debug!("api: TLS handshake with {addr} failed: {e}");
                    return;
                }
                Err(_) => {
                    log::debug!(
                        "api: no TLS handshake from {addr} within {FIRST_REQUEST_TIMEOUT:?}"
                    );
                    return;
                }
            };
            // Another node presents its certificate (checked by the handshake: the cluster
            // CA's, a node's, not revoked); people and programs present none.
            let certs = stream.get_ref().1.peer_certificates();
            let caller = match converge_pki::peer_node(certs) {
                Some(id) => crate::auth::Caller::Node(id),
                None => crate::auth::Caller::Anonymous,
            };
            // A node's certificate acts for the cluster as long as the connection lasts:
            // revoking it (or removing the node) ends the connection.
            let _watchman = certs.and_then(|c| c.first()).and_then(|cert| {
                node.revocations.watch_connection(
                    cert,
                    format!("api: the connection from {addr}"),
                    converge_pki::cut_socket(socket),
                )
            });
            let st = standing.clone();
            let svc = hyper::service::service_fn(move |req| {
                let node = node.clone();
                let st = st.clone();
                async move { Ok::<_, std::convert::Infallible>(handle(node, req, &st, caller).await) }
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(io, svc);
            tokio::pin!(conn);
            let mut first = true;
            loop {
                tokio::select! {
                    r = &mut conn => {
                        if let Err(e) = r {
                            log::debug!("api connection: {e}");
                        }
                        return;
                    }
                    _ = tokio::time::sleep_until(deadline), if first => {
                        first = false;
                        if !standing.started.load(std::sync::atomic::Ordering::Acquire) {
                            log::debug!(
                                "api: {addr} sent no request within {FIRST_REQUEST_TIMEOUT:?}; closed"
                            );
                            return;
                        }
                    }
                }
            }
        });
    }
}

pub struct ApiError(pub StatusCode, pub String);

impl From<cache_api::CacheApiError> for ApiError {
    fn from((status, msg): cache_api::CacheApiError) -> ApiError {
        ApiError(status, msg)
    }
}

impl ApiError {
    pub fn bad(msg: impl Into<String>) -> ApiError {
        ApiError(StatusCode::BAD_REQUEST, msg.into())
    }
    pub fn unavailable(msg: impl std::fmt::Display) -> ApiError {
        ApiError(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("control plane unavailable: {msg}"),
        )
    }
}

fn json<T: serde::Serialize>(status: StatusCode, v: &T) -> Resp {
    let body = serde_json::to_vec_pretty(v)
        .unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}").into_bytes());
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("static response parts are valid")
}

/// Answers `req`; an answer to a request that showed no valid token closes the connection
/// (its next request would have to start over, a new connection counted against its host).
async fn handle(
    node: Arc<Node>,
    req: Request<Incoming>,
    standing: &Standing,
    caller: crate::auth::Caller,
) -> Resp {
    standing.started();
    let mut resp = answer(node, req, standing, caller).await;
    if standing
        .pending
        .lock()
        .expect("standing poisoned")
        .is_some()
    {
        resp.headers_mut().insert(
            hyper::header::CONNECTION,
            hyper::header::HeaderValue::from_static("close"),
        );
    }
    resp
}

async fn answer(
    node: Arc<Node>,
    req: Request<Incoming>,
    standing: &Standing,
    caller: crate::auth::Caller,
) -> Resp {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    // Who asks, before anything is read or done for them.
    let header = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let open = match node.auth.authorize(&method, &path, header, caller).await {
        Ok(crate::auth::Granted::Token) => {
            standing.authenticated();
            false
        }
        Ok(crate::auth::Granted::Open) => true,
        Err(denied) => {
            let (status, error) = match denied {
                crate::auth::Denied::Unauthenticated(m) => (StatusCode::UNAUTHORIZED, m),
                crate::auth::Denied::Forbidden(m) => (StatusCode::FORBIDDEN, m),
                crate::auth::Denied::Unavailable(m) => (StatusCode::SERVICE_UNAVAILABLE, m),
            };
            return json(status, &ErrorBody { error });
        }
    };
    // A request without a token (the join) sends a small body, promptly.
    let (body_timeout, body_max) = if open {
        (OPEN_BODY_READ_TIMEOUT, OPEN_BODY_BYTES_MAX)
    } else {
        (BODY_READ_TIMEOUT, BODY_BYTES_MAX)
    };
    let body = match tokio::time::timeout(
        body_timeout,
        Limited::new(req.into_body(), body_max).collect(),
    )
    .await
    {
        Ok(Ok(b)) => b.to_bytes(),
        Err(_) => {
            return json(
                StatusCode::REQUEST_TIMEOUT,
                &ErrorBody {
                    error: format!("request body not received within {body_timeout:?}"),
                },
            )
        }
        Ok(Err(e)) => {
            return json(
                StatusCode::PAYLOAD_TOO_LARGE,
                &ErrorBody {
                    error: format!("request body unreadable or above {body_max} bytes: {e}"),
                },
            )
        }
    };
    if path == "/metrics" && method == Method::GET {
        let text = crate::metrics::render(&node).await;
        return Response::builder()
            .header("content-type", "text/plain; version=0.0.4")
            .body(Full::new(Bytes::from(text)))
            .expect("static response parts are valid");
    }
    match route(&node, &method, &path, &query, &body).await {
        Ok((status, v)) => json(status, &v),
        Err(ApiError(status, error)) => json(status, &ErrorBody { error }),
    }
}

pub type Out = Result<(StatusCode, serde_json::Value), ApiError>;

pub fn ok<T: serde::Serialize>(v: &T) -> Out {
    Ok((
        StatusCode::OK,
        serde_json::to_value(v)
            .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?,
    ))
}

async fn route(node: &Arc<Node>, method: &Method, path: &str, query: &str, body: &[u8]) -> Out {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    match (method, parts.as_slice()) {
        (&Method::GET, ["v1", "health"]) => {
            ok(&serde_json::json!({"ok": true, "node": node.cfg.node_id}))
        }
        (&Method::GET, ["v1", "status"]) => ok(&status(node).await?),
        (&Method::GET, ["v1", "nodes"]) => ok(&nodes(node).await?),
        (&Method::GET, ["v1", "drives"]) => ok(&drives(node).await?),
        (&Method::GET, ["v1", "extents"]) => ok(&crate::usage::local(node, None)),
        (&Method::GET, ["v1", "extents", id]) => {
            let id = id.parse::<u64>().map_err(|_| {
                ApiError::bad(format!(
                    "{id:?} is not a volume id (a number, as `converge volume show` prints it)"
                ))
            })?;
            ok(&crate::usage::local(node, Some(VolumeId(id))))
        }
        (&Method::GET, ["v1", "volumes"]) => {
            let g = crate::usage::gather(node, None, None).await;
            ok(&volumes(node, false, Some(&g)).await?)
        }
        (&Method::POST, ["v1", "volumes"]) => {
            let req: CreateVolume = serde_json::from_slice(body)
                .map_err(|e| ApiError::bad(format!("bad volume create request: {e}")))?;
            let v = create_volume(node, req).await?;
            Ok((
                StatusCode::CREATED,
                serde_json::to_value(v).map_err(|e| ApiError::bad(e.to_string()))?,
            ))
        }
        (&Method::GET, ["v1", "volumes", name]) => ok(&volume(node, name).await?),
        (&Method::DELETE, ["v1", "volumes", name]) => delete_volume(node, name, body).await,
        (&Method::POST, ["v1", "volumes", name, "resize"]) => resize_volume(node, name, body).await,
        (&Method::POST, ["v1", "volumes", name, "rekey"]) => rekey_volume(node, name).await,
        (&Method::POST, ["v1", "volumes", name, "settings"]) => {
            volume_settings(node, name, body).await
        }
        (&Method::POST, ["v1", "volumes", name, "move"]) => move_volume(node, name, body).await,
        (&Method::POST, ["v1", "volumes", name, "open"]) => open_here(node, name).await,
        (&Method::POST, ["v1", "volumes", name, "scrub"]) => scrub(node, name, body).await,
        (&Method::GET, ["v1", "volumes", name, "snapshots"]) => {
            crate::snapshots::list(node, name, query).await
        }
        (&Method::POST, ["v1", "volumes", name, "snapshots"]) => {
            crate::snapshots::create(node, name, body).await
        }
        (&Method::GET, ["v1", "volumes", name, "changes"]) => {
            crate::snapshots::changes(node, name, query).await
        }
        (&Method::DELETE, ["v1", "volumes", name, "snapshots", snap]) => {
            crate::snapshots::delete(node, name, snap).await
        }
        (&Method::POST, ["v1", "volumes", name, "snapshots", snap, "clone"]) => {
            crate::clones::create(node, name, snap, body).await
        }
        (&Method::POST, ["v1", "volumes", name, "flatten"]) => {
            crate::clones::flatten(node, name).await
        }
        (&Method::POST, ["v1", "volumes", name, "snapshots", snap, "rollback"]) => {
            crate::snapshots::rollback(node, name, snap).await
        }
        (&Method::GET, ["v1", "vhost"]) => crate::vhost::list(node),
        (&Method::POST, ["v1", "vhost"]) => crate::vhost::attach(node, body).await,
        (&Method::DELETE, ["v1", "vhost", volume]) => crate::vhost::detach(node, volume).await,
        (&Method::POST, ["v1", "nodes", id, "maintenance"]) => maintenance(node, id, body).await,
        (&Method::POST, ["v1", "nodes", id, "drain"]) => crate::drain::drain(node, id, body).await,
        (&Method::DELETE, ["v1", "nodes", id]) => crate::drain::remove(node, id).await,
        (&Method::GET, ["v1", "settings"]) => ok(&crate::repair::settings(node).await),
        (&Method::POST, ["v1", "settings"]) => {
            let new: Settings = serde_json::from_slice(body)
                .map_err(|e| ApiError::bad(format!("bad settings: {e}")))?;
            new.check().map_err(ApiError::bad)?;
            cache_api::check_nodes(node, new.node_cache_modes.keys().copied()).await?;
            ok(
                &cache_api::update_settings(node, |cur| cache_api::merge_settings(cur, &new))
                    .await?,
            )
        }
        (&Method::POST, ["v1", "cache", "flush"]) => {
            match crate::tiering::flush_local(node).await {
                Ok(v) => ok(&v),
                Err(e) => Err(ApiError::unavailable(e)),
            }
        }
        (&Method::GET, ["v1", "caches"]) => ok(&cache_api::read(node).await?.current()),
        (&Method::GET, ["v1", "cache", "advice"]) => ok(&cache_api::advice(node)),
        (&Method::POST, ["v1", "cache", "mode"]) => ok(&cache_api::set_mode(node, body).await?),
        (&Method::GET, ["v1", "scrub"]) => ok(&crate::scrub::results(node).await),
        (&Method::GET, ["v1", "tokens"]) => ok(&tokens(node).await?),
        (&Method::POST, ["v1", "tokens"]) => {
            let req: CreateToken = serde_json::from_slice(body)
                .map_err(|e| ApiError::bad(format!("bad token request: {e}")))?;
            let t = create_token(node, req).await?;
            Ok((
                StatusCode::CREATED,
                serde_json::to_value(t).map_err(|e| ApiError::bad(e.to_string()))?,
            ))
        }
        (&Method::DELETE, ["v1", "tokens", id]) => revoke_token(node, id).await,
        (_, ["v1", "certs", ..]) => crate::creds::route(node, method, &parts, body).await,
        (&Method::POST, ["v1", "join-tokens"]) => {
            let req: converge_api::CreateJoinToken = serde_json::from_slice(body)
                .map_err(|e| ApiError::bad(format!("bad join token request: {e}")))?;
            let t = crate::join::create(node, req)
                .await
                .map_err(|(s, m)| ApiError(s, m))?;
            Ok((
                StatusCode::CREATED,
                serde_json::to_value(t).map_err(|e| ApiError::bad(e.to_string()))?,
            ))
        }
        (&Method::POST, ["v1", "join"]) => {
            let req: converge_api::JoinRequest = serde_json::from_slice(body)
                .map_err(|e| ApiError::bad(format!("bad join request: {e}")))?;
            ok(&crate::join::join(node, req)
                .await
                .map_err(|(s, m)| ApiError(s, m))?)
        }
        (_, ["v1", "lab", ..]) if !node.cfg.lab_api => Err(ApiError(
            StatusCode::NOT_FOUND,
            "the lab API is off on this node (`[api] lab = true` turns it on; `converge lab \
             up` does)"
                .to_string(),
        )),
        (_, ["v1", "fleet", ..]) if !node.cfg.fleet_api => Err(ApiError(
            StatusCode::NOT_FOUND,
            "the fleet API is off on this node: its workers overwrite volumes (`[api] fleet = \
             true` turns it on; `converge lab up` does)"
                .to_string(),
        )),
        // Lab-only debug views (the fault injector); handlers live in lab_api.rs.
        (_, ["v1", "lab", rest @ ..]) => crate::lab_api::route(node, method, rest, body)
            .await
            .map_err(|(status, msg)| ApiError(status, msg)),
        // The fleet's workers and samples live in their own module (crate::fleet).
        (_, ["v1", "fleet", rest @ ..]) => crate::fleet::route(node, method, rest, body)
            .await
            .map_err(|(status, msg)| ApiError(status, msg)),
        (_, ["v1", ..]) | (_, ["metrics"]) => Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("no such API: {method} {path}"),
        )),
        _ => Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("no such path {path}; the API is under /v1/"),
        )),
    }
}

fn token_info(r: &converge_control::model::TokenRecord) -> TokenInfo {
    TokenInfo {
        id: r.id.clone(),
        name: r.name.clone(),
        role: r.role,
        created_unix: r.created_unix,
        expires_unix: r.expires_unix,
    }
}

async fn tokens(node: &Node) -> Result<Vec<TokenInfo>, ApiError> {
    let v = node.cluster.tokens().await.map_err(ApiError::unavailable)?;
    Ok(v.iter().map(token_info).collect())
}

async fn create_token(node: &Node, req: CreateToken) -> Result<CreatedToken, ApiError> {
    let name = req.name.trim();
    if name.is_empty()
        || name.len() > 64
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.@ ".contains(c))
    {
        return Err(ApiError::bad(
            "a token's name is 1 to 64 letters, digits, spaces or -_.@",
        ));
    }
    let expires_unix = match req.expires_in_s {
        None => None,
        Some(s) if (1..=TOKEN_TTL_S_MAX).contains(&s) => Some(crate::repair::unix_now() + s),
        Some(s) => {
            return Err(ApiError::bad(format!(
                "expires_in_s {s}: a token lasts 1 s to {} days (leave it out for one that \
                 lasts until revoked)",
                TOKEN_TTL_S_MAX / 86_400
            )))
        }
    };
    let (token, rec) = crate::auth::new_token(name, req.role, expires_unix);
    if !node
        .cluster
        .create_token(&rec)
        .await
        .map_err(ApiError::unavailable)?
    {
        return Err(ApiError(
            StatusCode::CONFLICT,
            "token id taken (a 1 in 2^64 chance); try again".to_string(),
        ));
    }
    node.auth.remember(&rec);
    log::info!("made {} token {} ({})", rec.role, rec.id, rec.name);
    Ok(CreatedToken {
        info: token_info(&rec),
        token,
    })
}

async fn revoke_token(node: &Node, id: &str) -> Out {
    let gone = if id == crate::auth::LEGACY_INTERNAL_ID {
        // Once every node authenticates with its certificate (docs/SECURITY.md, "Migrating").
        node.cluster
            .retire_internal_token()
            .await
            .map_err(ApiError::unavailable)?
    } else {
        node.cluster
            .delete_token(id)
            .await
            .map_err(ApiError::unavailable)?
    };
    node.auth.forget(id);
    if !gone {
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("no token with id {id}"),
        ));
    }
    log::info!("revoked token {id}");
    ok(&serde_json::json!({ "revoked": id }))
}

pub(crate) async fn nodes(node: &Node) -> Result<Vec<NodeInfo>, ApiError> {
    let live = node
        .cluster
        .live_nodes()
        .await
        .map_err(ApiError::unavailable)?;
    let mut out: Vec<NodeInfo> = live
        .into_iter()
        .map(|n| NodeInfo {
            id: n.id,
            name: n.name,
            live: true,
            rpc_addr: n.rpc_addr,
            api_addr: n.api_addr,
            nbd_socket: n.nbd_socket,
            nbd_tcp: n.nbd_tcp,
            version: n.version,
            maintenance: false,
            draining: false,
        })
        .collect();
    // Nodes with drives but no live record are down.
    let drives = node.cluster.drives().await.map_err(ApiError::unavailable)?;
    for d in drives {
        if !out.iter().any(|n| n.id == d.node) {
            out.push(NodeInfo::down(d.node));
        }
    }
    let maint = node
        .cluster
        .maintenance_nodes()
        .await
        .map_err(ApiError::unavailable)?;
    let draining = node
        .cluster
        .draining_nodes()
        .await
        .map_err(ApiError::unavailable)?;
    for n in out.iter_mut() {
        n.maintenance = maint.contains(&n.id);
        n.draining = draining.contains(&n.id);
    }
    out.sort_by_key(|n| n.id);
    Ok(out)
}

async fn drives(node: &Node) -> Result<Vec<DriveInfo>, ApiError> {
    let caches = cache_api::read(node).await?;
    drives_with(node, &caches).await
}

/// The drives, their bound cache drives filled in from `caches`.
async fn drives_with(node: &Node, caches: &cache_api::Caches) -> Result<Vec<DriveInfo>, ApiError> {
    let used = extents_used(&node.cluster)
        .await
        .map_err(ApiError::unavailable)?;
    let failed = node
        .cluster
        .failed_drives()
        .await
        .map_err(ApiError::unavailable)?;
    let usage = node
        .cluster
        .drive_usage()
        .await
        .map_err(ApiError::unavailable)?;
    let mut v: Vec<DriveInfo> = node
        .cluster
        .drives()
        .await
        .map_err(ApiError::unavailable)?
        .into_iter()
        .map(|d| DriveInfo {
            id: d.id,
            node: d.node,
            path: d.path,
            role: d.role,
            media: d.media,
            size_bytes: d.size_bytes,
            extents_total: d.extents_total,
            extents_used: used.get(&d.id).copied().unwrap_or(0),
            slab_size_bytes: d.slab_size_bytes,
            failed: failed.get(&d.id).cloned(),
            cache: None,
            written_bytes: None,
            stored_bytes: None,
            slots_total: d.slots_total,
            // What its node last reported its extents claim (compressed ones less than
            // whole, blocks kept for snapshots more), an extent placed since whole.
            committed_bytes: usage
                .get(&d.id)
                .map(|u| u.claimed_bytes(used.get(&d.id).copied().unwrap_or(0), d.slab_size_bytes)),
            wear: None,
        })
        .collect();
    cache_api::annotate_drives(&mut v, caches);
    Ok(v)
}

pub(crate) fn uri_of(rec: &VolumeRecord, owner: Option<&NodeInfo>) -> (String, Option<String>) {
    match owner {
        Some(n) => (
            format!("nbd+unix:///{}?socket={}", rec.name, n.nbd_socket),
            n.nbd_tcp
                .as_ref()
                .map(|t| format!("nbd://{t}/{}", rec.name)),
        ),
        None => (
            format!(
                "nbd+unix:///{}?socket=(owner node {} is down)",
                rec.name, rec.owner
            ),
            None,
        ),
    }
}

/// A volume's mirror part as its slab records show it (rotation counts are the owner's).
fn mirror_part_info(
    rec: &VolumeRecord,
    slabs: &BTreeMap<converge_types::SlabIndex, SlabRecord>,
) -> Option<converge_api::MirrorPartInfo> {
    let m = rec
        .resiliency
        .mirror_part()
        .filter(|_| rec.mirror_part_bytes > 0)?;
    let mirror = slabs.keys().filter(|i| i.is_mirror_part()).count() as u64;
    let parity = slabs.len() as u64 - mirror;
    Some(converge_api::MirrorPartInfo {
        size_bytes: rec.mirror_part_bytes,
        resiliency: m,
        mirror_bytes: mirror * rec.slab_size_bytes,
        parity_bytes: parity * rec.resiliency.slab_span(rec.slab_size_bytes),
        rotations: None,
        rotated_bytes: None,
    })
}

fn volume_info(
    rec: &VolumeRecord,
    slabs: &BTreeMap<converge_types::SlabIndex, SlabRecord>,
    nodes: &[NodeInfo],
    detail: bool,
    written: Option<&crate::usage::Gathered>,
) -> VolumeInfo {
    let owner = nodes.iter().find(|n| n.id == rec.owner && n.live);
    let (uri, uri_tcp) = uri_of(rec, owner);
    let usage = written.and_then(|g| crate::usage::volume_usage(rec.id, rec.resiliency, slabs, g));
    VolumeInfo {
        id: rec.id,
        name: rec.name.clone(),
        size_bytes: rec.size_bytes,
        resiliency: rec.resiliency,
        min_replicas: rec.min_replicas,
        slab_size_bytes: rec.slab_size_bytes,
        owner: rec.owner,
        owner_name: owner
            .map(|n| n.name.clone())
            .unwrap_or_else(|| format!("node{} (down)", rec.owner)),
        uri,
        uri_tcp,
        slabs_allocated: slabs.len() as u64,
        compression: rec.compression,
        encryption: rec
            .encryption
            .as_ref()
            .map(|e| converge_api::EncryptionInfo {
                cipher: e.cipher.clone(),
                key_id: e.key_id,
            }),
        qos: rec.qos,
        // A parity slab holds K extents' worth of volume data, a mirror-part slab one.
        allocated_bytes: rec
            .resiliency
            .allocated_bytes(rec.slab_size_bytes, slabs.keys().copied()),
        mirror_part: mirror_part_info(rec, slabs),
        written_bytes: usage.map(|u| u.written),
        stored_bytes: usage.map(|u| u.stored),
        degraded_extents: slabs
            .values()
            .flat_map(|s| s.extents.iter())
            .filter(|e| e.state != ExtentState::InSync)
            .count() as u64,
        slabs: detail.then(|| {
            slabs
                .iter()
                .map(|(i, s)| SlabInfo {
                    index: i.0,
                    extents: s
                        .extents
                        .iter()
                        .map(|e| ExtentInfo {
                            drive: e.drive,
                            node: e.node,
                            state: e.state,
                            holds_acked: e.holds_acked,
                            written_bytes: written
                                .and_then(|g| g.of(e, rec.id, *i))
                                .map(|u| u.written),
                            stored_bytes: written
                                .and_then(|g| g.of(e, rec.id, *i))
                                .map(|u| u.stored),
                        })
                        .collect(),
                })
                .collect()
        }),
        parent: rec
            .parent
            .as_ref()
            .map(|p| format!("{}@{}", p.volume, p.snapshot)),
    }
}

pub(crate) async fn slab_map(
    node: &Node,
    id: VolumeId,
) -> Result<BTreeMap<converge_types::SlabIndex, SlabRecord>, ApiError> {
    Ok(node
        .cluster
        .slabs(id)
        .await
        .map_err(ApiError::unavailable)?
        .into_iter()
        .map(|(i, (s, _))| (i, s))
        .collect())
}

async fn volumes(
    node: &Node,
    detail: bool,
    written: Option<&crate::usage::Gathered>,
) -> Result<Vec<VolumeInfo>, ApiError> {
    let ns = nodes(node).await?;
    let mut out = Vec::new();
    for rec in node
        .cluster
        .volumes()
        .await
        .map_err(ApiError::unavailable)?
    {
        let slabs = slab_map(node, rec.id).await?;
        out.push(volume_info(&rec, &slabs, &ns, detail, written));
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// The volume's record and its revision, or 404.
pub(crate) async fn volume_record(
    node: &Node,
    name: &str,
) -> Result<(VolumeRecord, i64), ApiError> {
    node.cluster
        .volume(name)
        .await
        .map_err(ApiError::unavailable)?
        .ok_or_else(|| ApiError(StatusCode::NOT_FOUND, format!("no volume named {name:?}")))
}

async fn volume(node: &Node, name: &str) -> Result<VolumeInfo, ApiError> {
    let (rec, _) = volume_record(node, name).await?;
    let ns = nodes(node).await?;
    let slabs = slab_map(node, rec.id).await?;
    // Written bytes from the nodes holding its copies.
    let holders: BTreeSet<NodeId> = slabs
        .values()
        .flat_map(|s| s.extents.iter().map(|e| e.node))
        .collect();
    let g = crate::usage::gather(node, Some(&holders), Some(rec.id)).await;
    let mut info = volume_info(&rec, &slabs, &ns, true, Some(&g));
    let served = node.volumes.lock().await.get(name).cloned();
    if let (Some(mp), Some(v)) = (info.mirror_part.as_mut(), served) {
        let s = v.stats();
        mp.rotations = Some(s.rotations);
        mp.rotated_bytes = Some(s.rotated_bytes);
    }
    Ok(info)
}

async fn status(node: &Node) -> Result<Status, ApiError> {
    let ns = nodes(node).await?;
    let caches = cache_api::read(node).await?;
    let mut ds = drives_with(node, &caches).await?;
    let caches = caches.current();
    let g = crate::usage::gather(node, None, None).await;
    let vs = volumes(node, false, Some(&g)).await?;
    let per_drive = g.per_drive();
    for d in ds
        .iter_mut()
        .filter(|d| d.role == converge_types::DriveRole::Capacity && d.failed.is_none())
        .filter(|d| g.answered.contains(&d.node))
    {
        let u = per_drive.get(&d.id).copied().unwrap_or_default();
        d.written_bytes = Some(u.written);
        d.stored_bytes = Some(u.stored);
    }
    let settings = crate::repair::settings(node).await;
    let mut capacity = crate::capacity::account(&ns, &ds, &vs, settings.overcommit_pct());
    // One read of the drives' use (every slab record) for both placement questions.
    let loads = drive_loads(&node.cluster).await.ok();
    let unplaceable = crate::provisioning::unplaceable(loads.as_deref(), &ns, &vs);
    let short = crate::capacity::settle_state(&mut capacity, &unplaceable);
    let mut problems = Vec::new();
    let down: Vec<String> = ns
        .iter()
        .filter(|n| !n.live)
        .map(|n| n.name.clone())
        .collect();
    if !down.is_empty() {
        problems.push(format!("nodes down: {}", down.join(", ")));
    }
    // Failed cache drives are reported from what their node publishes (below).
    let failed: Vec<String> = ds
        .iter()
        .filter(|d| d.failed.is_some() && d.role != converge_types::DriveRole::Cache)
        .map(|d| format!("{} on node {}", d.id, d.node))
        .collect();
    if !failed.is_empty() {
        problems.push(format!("drives failed: {}", failed.join(", ")));
    }
    problems.extend(cache_api::problems(&caches));
    let degraded: u64 = vs.iter().map(|v| v.degraded_extents).sum();
    if degraded > 0 {
        problems.push(format!("{degraded} extents not in sync"));
    }
    let jobs = crate::repair::all_jobs(node).await;
    problems.extend(jobs_problem(&jobs));
    let etcd = crate::etcd_upkeep::observe(node.cluster.etcd(), node.cfg.etcd_quota_bytes).await;
    problems.extend(etcd.problems);
    let mut warnings = rebuild_warnings(node, &ns, loads.as_deref()).await;
    warnings.extend(capacity.warnings.iter().cloned());
    warnings.extend(crate::wear::annotate(node, &mut ds).await);
    warnings.extend(etcd.warnings);
    let c = &node.cluster_rec;
    Ok(Status {
        caches,
        jobs,
        warnings,
        cluster: ClusterInfo {
            id: c.cluster_id,
            name: c.name.clone(),
            slab_size_bytes: c.slab_size_bytes,
        },
        // Capacity short of room (near-full, full) is its own state; after a degradation.
        health: match (problems.is_empty(), short) {
            (true, None) => "healthy".into(),
            (true, Some(s)) => s,
            (false, s) => format!(
                "degraded: {}{}",
                problems.join("; "),
                s.map(|s| format!("; {s}")).unwrap_or_default()
            ),
        },
        nodes: ns,
        drives: ds,
        volumes: vs,
        capacity,
        answered_by: node.cfg.node_id,
        etcd: Some(etcd.info),
    })
}

/// Repairs under way make the cluster degraded (copies are being brought back); a scrub
/// only checks copies that are in sync, and a rotation (mirror-accelerated parity) moves
/// data between layouts at full redundancy, so they are listed among the jobs but are no
/// problem.
fn jobs_problem(jobs: &[JobInfo]) -> Option<String> {
    let repairs = jobs
        .iter()
        .filter(|j| j.kind != "scrub" && j.kind != "rotate")
        .count();
    (repairs > 0).then(|| format!("{repairs} repair jobs running"))
}

/// Lost copies (on nodes that are down) that no drive could take if they had to be rebuilt.
async fn rebuild_warnings(
    node: &Node,
    ns: &[NodeInfo],
    loads: Option<&[converge_control::DriveLoad]>,
) -> Vec<String> {
    let live: Vec<NodeId> = ns.iter().filter(|n| n.live).map(|n| n.id).collect();
    let Ok(vols) = node.cluster.volumes().await else {
        return Vec::new();
    };
    let Some(loads) = loads else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for v in vols {
        let Ok(slabs) = node.cluster.slabs(v.id).await else {
            continue;
        };
        for (idx, (s, _)) in slabs {
            for e in s.extents.iter().filter(|e| !live.contains(&e.node)) {
                let holding: Vec<NodeId> = s.extents.iter().map(|x| x.node).collect();
                if let Err(err) = placement::place(1, loads, &holding) {
                    out.push(format!(
                        "volume {} slab {idx}: the copy on node {} (down) cannot be rebuilt elsewhere: {err}",
                        v.name, e.node
                    ));
                }
            }
        }
    }
    out
}

/// The drives as a create or resize of a volume compressed by `c` counts them: plain
/// volumes by the room a full write would take, compressed ones by extent slots (what
/// their data takes depends on how it compresses: thin drives hold up to twice as many
/// extents as they hold plain, docs/adr/0010).
async fn provisioning_loads(
    cluster: &converge_control::Cluster,
    c: Compression,
) -> Result<Vec<converge_control::DriveLoad>, ApiError> {
    let loads = drive_loads(cluster).await.map_err(ApiError::unavailable)?;
    Ok(if c.is_none() {
        loads
    } else {
        loads.iter().map(|d| d.by_slots()).collect()
    })
}

/// Compression is for mirror and simple volumes: a parity chunk's rows are written whole
/// with held priors, which are kept as written (docs/adr/0010).
fn check_compression(r: Resiliency, c: Compression) -> Result<(), ApiError> {
    if r.is_parity() && !c.is_none() {
        return Err(ApiError::bad(format!(
            "compression {c} is not available for {r} volumes: parity chunks are stored as \
             written (compression works on mirror-2, mirror-3 and simple volumes)"
        )));
    }
    Ok(())
}

async fn create_volume(node: &Node, req: CreateVolume) -> Result<VolumeInfo, ApiError> {
    create_volume_with(node, req, None).await
}

/// Creates a volume; with `parent`, a clone of that snapshot (docs/SNAPSHOTS.md "Clones").
pub(crate) async fn create_volume_with(
    node: &Node,
    req: CreateVolume,
    parent: Option<converge_control::model::ParentRecord>,
) -> Result<VolumeInfo, ApiError> {
    if !converge_control::model::valid_volume_name(&req.name) {
        return Err(ApiError::bad(format!(
            "volume name {:?} is not valid: use 1-128 letters, digits, '-', '_' or '.'",
            req.name
        )));
    }
    let bs = BLOCK_SIZE as u64;
    if req.size_bytes == 0 || !req.size_bytes.is_multiple_of(bs) {
        return Err(ApiError::bad(format!(
            "volume size {} bytes is not valid: it must be above 0 and a multiple of {bs} bytes",
            req.size_bytes
        )));
    }
    if req.size_bytes > 1 << 50 {
        return Err(ApiError::bad("volume size above 1 PiB is not supported"));
    }
    let copies = req.resiliency.copies();
    let min_replicas = req
        .min_replicas
        .unwrap_or_else(|| req.resiliency.default_min_replicas());
    if min_replicas == 0 || min_replicas > copies {
        return Err(ApiError::bad(format!(
            "min_replicas {min_replicas} must be between 1 and {copies} for {}",
            req.resiliency
        )));
    }
    let compression = req.compression.unwrap_or_default();
    check_compression(req.resiliency, compression)?;
    let qos = req.qos.unwrap_or_default();
    qos.check()
        .map_err(|e| ApiError::bad(format!("bad qos: {e}")))?;
    if req.encrypt && !compression.is_none() {
        return Err(ApiError::bad(
            "an encrypted volume cannot be compressed: ciphertext does not compress (choose \
             one of encryption and compression)",
        ));
    }
    let owner = req.owner.unwrap_or(node.cfg.node_id);
    let live = node
        .cluster
        .live_nodes()
        .await
        .map_err(ApiError::unavailable)?;
    if !live.iter().any(|n| n.id == owner) {
        return Err(ApiError::bad(format!(
            "owner node {owner} is not a live node"
        )));
    }
    let slab = node.cluster_rec.slab_size_bytes;
    let mirror_part_bytes = mirror_part_of(&req, slab)?;
    let loads = provisioning_loads(&node.cluster, compression).await?;
    // A mirror part counts full, on top of the whole volume in parity (a span in both
    // layouts while it rotates).
    let mut parts = vec![(req.resiliency, req.size_bytes)];
    if let (Some(m), true) = (req.resiliency.mirror_part(), mirror_part_bytes > 0) {
        parts.push((m, mirror_part_bytes));
    }
    placement::can_place_parts(&parts, slab, &loads).map_err(|e| {
        ApiError(
            StatusCode::CONFLICT,
            format!("cannot create volume {}: {e}", req.name),
        )
    })?;
    let part = req
        .resiliency
        .mirror_part()
        .filter(|_| mirror_part_bytes > 0)
        .map(|m| (m, mirror_part_bytes));
    crate::provisioning::check(
        node,
        crate::capacity::provisioned_bytes(req.resiliency, req.size_bytes, part),
        crate::provisioning::describe(req.size_bytes, req.resiliency),
        &format!("cannot create volume {}", req.name),
    )
    .await?;
    let id = VolumeId(rand::random::<u64>() >> 1);
    let encryption = if req.encrypt {
        Some(crate::encryption::new_record(&node.cfg, id.0).map_err(|e| {
            ApiError(
                StatusCode::CONFLICT,
                format!("cannot create encrypted volume {}: {e}", req.name),
            )
        })?)
    } else {
        None
    };
    let rec = VolumeRecord {
        id,
        name: req.name.clone(),
        size_bytes: req.size_bytes,
        resiliency: req.resiliency,
        mirror_part_bytes,
        min_replicas,
        slab_size_bytes: slab,
        owner,
        created_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        compression,
        encryption,
        qos,
        snapshots: Vec::new(),
        parent,
        stray_floors: Vec::new(),
    };
    node.cluster
        .create_volume(&rec)
        .await
        .map_err(|e| match e {
            converge_control::model::ControlError::VolumeExists { .. } => ApiError(
                StatusCode::CONFLICT,
                format!("a volume named {} already exists", req.name),
            ),
            other => ApiError::unavailable(other),
        })?;
    log::info!(
        "created volume {} ({} bytes, {}) owned by node {owner}",
        rec.name,
        rec.size_bytes,
        rec.resiliency
    );
    volume(node, &req.name).await
}

/// A create request's mirror part in bytes (whole extents of `extent` bytes; 0 for none),
/// or why it cannot have one.
fn mirror_part_of(req: &CreateVolume, extent: u64) -> Result<u64, ApiError> {
    let asked = req.mirror_part_bytes.unwrap_or(0);
    if asked == 0 {
        return Ok(0);
    }
    let Some(m) = req.resiliency.mirror_part() else {
        return Err(ApiError::bad(format!(
            "a mirror part needs a parity-K+1 or parity-K+2 volume (its mirror part is then \
             mirror-2 or mirror-3, surviving as many failures as the parity); {} has none",
            req.resiliency
        )));
    };
    let bytes = asked.div_ceil(extent) * extent;
    if bytes > req.size_bytes {
        return Err(ApiError::bad(format!(
            "the mirror part ({asked} bytes, {bytes} in whole {extent}-byte extents) is larger \
             than the volume ({} bytes)",
            req.size_bytes
        )));
    }
    log::info!(
        "volume {}: a mirror part of {bytes} bytes ({m}, {} extents)",
        req.name,
        bytes / extent
    );
    Ok(bytes)
}

/// The node serving the volume now (its owner record), else its preferred owner.
pub(crate) async fn serving_owner(node: &Node, rec: &VolumeRecord) -> Result<NodeId, ApiError> {
    Ok(node
        .cluster
        .owner(rec.id)
        .await
        .map_err(ApiError::unavailable)?
        .map_or(rec.owner, |o| o.node))
}

/// `volume move`: runs on the serving owner. Makes `to` the preferred owner, stops
/// serving here and gives up ownership, then asks `to` to take the volume over (a new
/// epoch fences this node; clients connected here are forwarded to `to`).
pub(crate) async fn move_volume(node: &Arc<Node>, name: &str, body: &[u8]) -> Out {
    let req: MoveVolume = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("bad move request: {e}")))?;
    let (mut rec, rev) = volume_record(node, name).await?;
    let live = node
        .cluster
        .live_nodes()
        .await
        .map_err(ApiError::unavailable)?;
    let Some(target) = live.iter().find(|n| n.id == req.to) else {
        return Err(ApiError::bad(format!(
            "node {} is not a live node of this cluster; `converge node list` shows them",
            req.to
        )));
    };
    let serving = serving_owner(node, &rec).await?;
    if serving == req.to {
        return ok(&volume(node, name).await?);
    }
    if let Some(r) = forward_to_owner(
        node,
        serving,
        "POST",
        &format!("/v1/volumes/{name}/move"),
        body,
    )
    .await?
    {
        return Ok(r);
    }
    rec.owner = req.to;
    update_record(node, name, &rec, rev).await?;
    node.drop_volume(name).await;
    node.cluster
        .release_ownership(rec.id, node.cfg.node_id)
        .await
        .map_err(ApiError::unavailable)?;
    let (status, bytes) = crate::http_client::request(
        node,
        target,
        "POST",
        &format!("/v1/volumes/{name}/open"),
        b"",
    )
    .await
    .map_err(|e| {
        ApiError(
            StatusCode::BAD_GATEWAY,
            format!("volume {name}: node {} did not take it over: {e}", req.to),
        )
    })?;
    if status != 200 {
        return Err(ApiError(
            StatusCode::BAD_GATEWAY,
            format!(
                "volume {name}: node {} did not take it over: {}",
                req.to,
                String::from_utf8_lossy(&bytes)
            ),
        ));
    }
    log::info!("volume {name} moved to node {}", req.to);
    ok(&volume(node, name).await?)
}

/// `node maintenance ID on|off`. On: refused while a resync or rebuild runs anywhere, or
/// if a slab would be left with fewer than min_replicas in-sync copies elsewhere; then
/// the node's volumes move to other nodes and owners mark its copies stale (so writes
/// never wait for it). Off: the copies are resynced by their owners (delta).
async fn maintenance(node: &Arc<Node>, id: &str, body: &[u8]) -> Out {
    let req: Maintenance = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("bad maintenance request: {e}")))?;
    let id = NodeId(
        id.parse()
            .map_err(|_| ApiError::bad(format!("node id {id:?} is not a number")))?,
    );
    let ns = nodes(node).await?;
    if !ns.iter().any(|n| n.id == id) {
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("no node {id} in this cluster"),
        ));
    }
    if !req.on {
        node.cluster
            .set_maintenance(id, false)
            .await
            .map_err(ApiError::unavailable)?;
        log::info!("node {id} leaves maintenance; its copies will be resynced");
        return ok(&nodes(node).await?);
    }
    let jobs = crate::repair::all_jobs(node).await;
    if let Some(j) = jobs.iter().find(|j| j.kind != "scrub") {
        return Err(ApiError(
            StatusCode::CONFLICT,
            format!(
                "refused: a {} of volume {} slab {} is running on node {}; wait until `converge status` shows no jobs",
                j.kind, j.volume, j.slab, j.node
            ),
        ));
    }
    let maint = node
        .cluster
        .maintenance_nodes()
        .await
        .map_err(ApiError::unavailable)?;
    let usable: Vec<NodeId> = ns
        .iter()
        .filter(|n| n.live && n.id != id && !maint.contains(&n.id))
        .map(|n| n.id)
        .collect();
    let vols = node
        .cluster
        .volumes()
        .await
        .map_err(ApiError::unavailable)?;
    let mut owned_here = Vec::new();
    for v in &vols {
        let slabs = slab_map(node, v.id).await?;
        for (idx, s) in &slabs {
            if !s.extents.iter().any(|e| e.node == id) {
                continue;
            }
            let left = s
                .extents
                .iter()
                .filter(|e| {
                    e.node != id && e.state == ExtentState::InSync && usable.contains(&e.node)
                })
                .count();
            if left < v.min_replicas {
                return Err(ApiError(
                    StatusCode::CONFLICT,
                    format!(
                        "refused: volume {} slab {idx} would keep {left} in-sync copies, below its min_replicas {} (wait for resyncs, or bring nodes back first)",
                        v.name, v.min_replicas
                    ),
                ));
            }
        }
        if serving_owner(node, v).await? == id {
            owned_here.push(v.name.clone());
        }
    }
    node.cluster
        .set_maintenance(id, true)
        .await
        .map_err(ApiError::unavailable)?;
    if !owned_here.is_empty() && usable.is_empty() {
        node.cluster
            .set_maintenance(id, false)
            .await
            .map_err(ApiError::unavailable)?;
        return Err(ApiError(
            StatusCode::CONFLICT,
            format!("refused: node {id} serves volumes and no other live node can take them"),
        ));
    }
    for name in owned_here {
        let to = usable[0];
        let body = serde_json::to_vec(&MoveVolume { to }).unwrap_or_default();
        if let Err(ApiError(_, e)) = move_volume(node, &name, &body).await {
            log::warn!("maintenance: moving volume {name} off node {id}: {e}");
        }
    }
    log::info!("node {id} is in maintenance");
    ok(&nodes(node).await?)
}

/// Scrub one volume: wait for the result, or start it as a job.
async fn scrub(node: &Arc<Node>, name: &str, body: &[u8]) -> Out {
    let req: ScrubRequest = if body.is_empty() {
        ScrubRequest {
            wait: false,
            repair: true,
        }
    } else {
        serde_json::from_slice(body)
            .map_err(|e| ApiError::bad(format!("bad scrub request: {e}")))?
    };
    volume_record(node, name).await?;
    if req.wait {
        return match crate::scrub::scrub_volume(node, name, req.repair).await {
            Ok(r) => ok(&r),
            Err(e) => Err(ApiError::unavailable(e)),
        };
    }
    let n = node.clone();
    let name2 = name.to_string();
    tokio::spawn(async move {
        if let Err(e) = crate::scrub::scrub_volume(&n, &name2, req.repair).await {
            log::warn!("scrub of volume {name2}: {e}");
        }
    });
    ok(&serde_json::json!({"started": name}))
}

/// Serve the volume from this node now (the second half of a move).
async fn open_here(node: &Arc<Node>, name: &str) -> Out {
    match node.open_volume(name).await {
        Ok(crate::node::Route::Local(_)) => ok(&volume(node, name).await?),
        Ok(crate::node::Route::Remote { owner, .. }) => Err(ApiError(
            StatusCode::CONFLICT,
            format!("volume {name} is served by node {owner}"),
        )),
        Err(crate::node::OpenError::Unknown) => Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("no volume named {name}"),
        )),
        Err(crate::node::OpenError::Unavailable(e)) => Err(ApiError::unavailable(e)),
    }
}

/// Forward a request to the owner node's API when it is another live node.
pub(crate) async fn forward_to_owner(
    node: &Node,
    owner: NodeId,
    method: &str,
    path: &str,
    body: &[u8],
) -> Result<Option<(StatusCode, serde_json::Value)>, ApiError> {
    if owner == node.cfg.node_id {
        return Ok(None);
    }
    let live = node
        .cluster
        .live_nodes()
        .await
        .map_err(ApiError::unavailable)?;
    let Some(n) = live.into_iter().find(|n| n.id == owner) else {
        // The owner is down: act here (it serves nothing).
        return Ok(None);
    };
    let (status, bytes) = crate::http_client::request(node, &n, method, path, body)
        .await
        .map_err(|e| {
            ApiError(
                StatusCode::BAD_GATEWAY,
                format!("forwarding to owner node {owner} at {}: {e}", n.api_addr),
            )
        })?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
    Ok(Some((
        StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY),
        v,
    )))
}

async fn delete_volume(node: &Arc<Node>, name: &str, body: &[u8]) -> Out {
    let (rec, _) = volume_record(node, name).await?;
    if !rec.snapshots.is_empty() {
        let names: Vec<&str> = rec.snapshots.iter().map(|s| s.name.as_str()).collect();
        return Err(ApiError(
            StatusCode::CONFLICT,
            format!(
                "volume {name} has {} snapshots ({}): delete them first (`converge volume \
                 snapshot delete {name} SNAPSHOT`)",
                names.len(),
                names.join(", ")
            ),
        ));
    }
    if let Some(r) = forward_to_owner(
        node,
        serving_owner(node, &rec).await?,
        "DELETE",
        &format!("/v1/volumes/{name}"),
        body,
    )
    .await?
    {
        return Ok(r);
    }
    let slabs = slab_map(node, rec.id).await?;
    // Stop serving first so no write races the delete, then drop records, then space.
    node.drop_volume(name).await;
    node.cluster
        .delete_volume(name)
        .await
        .map_err(ApiError::unavailable)?;
    if let Some(p) = &rec.parent {
        // Its parent snapshot no longer needs to stay for it (a pin left behind is
        // pruned when that snapshot is deleted).
        if let Err(e) = node.cluster.unpin_clone(&p.volume, &p.snapshot, name).await {
            log::warn!("volume {name}: unpinning {}@{}: {e}", p.volume, p.snapshot);
        }
    }
    node.free_extents(&rec, &slabs).await;
    log::info!("deleted volume {name}");
    ok(&serde_json::json!({"deleted": name}))
}

/// Writes a volume's changed record if it is still at revision `rev` (else 409: it
/// changed meanwhile).
async fn update_record(
    node: &Node,
    name: &str,
    rec: &converge_control::model::VolumeRecord,
    rev: i64,
) -> Result<(), ApiError> {
    if !node
        .cluster
        .update_volume(rec, rev)
        .await
        .map_err(ApiError::unavailable)?
    {
        return Err(ApiError(
            StatusCode::CONFLICT,
            format!("volume {name} changed meanwhile; try again"),
        ));
    }
    Ok(())
}

/// Changes a volume's settings live (compression): on the serving owner, which applies it
/// to the writes that follow; what is stored keeps its form until written again.
async fn volume_settings(node: &Arc<Node>, name: &str, body: &[u8]) -> Out {
    let req: converge_api::VolumeSettings = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("bad volume settings request: {e}")))?;
    if req.compression.is_none() && req.qos.is_none() {
        return Err(ApiError::bad(
            "nothing to change: give compression (none, lz4 or zstd) or qos",
        ));
    }
    if let Some(q) = &req.qos {
        q.check()
            .map_err(|e| ApiError::bad(format!("bad qos: {e}")))?;
    }
    let (mut rec, rev) = volume_record(node, name).await?;
    if let Some(c) = req.compression {
        check_compression(rec.resiliency, c)?;
        if rec.encryption.is_some() && !c.is_none() {
            return Err(ApiError::bad(format!(
                "volume {name} is encrypted: ciphertext does not compress, so compression \
                 stays none"
            )));
        }
    }
    if let Some(r) = forward_to_owner(
        node,
        serving_owner(node, &rec).await?,
        "POST",
        &format!("/v1/volumes/{name}/settings"),
        body,
    )
    .await?
    {
        return Ok(r);
    }
    if let Some(c) = req.compression {
        rec.compression = c;
    }
    if let Some(q) = req.qos {
        rec.qos = q;
    }
    update_record(node, name, &rec, rev).await?;
    if let Some(v) = node.volumes.lock().await.get(name) {
        v.set_compression(rec.compression);
        v.set_qos(rec.qos);
    }
    log::info!(
        "volume {name}: compression {}, qos {}",
        rec.compression,
        rec.qos
    );
    ok(&volume(node, name).await?)
}

/// Wraps an encrypted volume's data key again with this node's current cluster key (key
/// rotation, docs/adr/0011). The data and its key stay as they are: the owner keeps
/// serving, and any node whose key file has the new key can open it from now on.
async fn rekey_volume(node: &Arc<Node>, name: &str) -> Out {
    let (mut rec, rev) = volume_record(node, name).await?;
    let Some(from) = rec.encryption.as_ref().map(|e| e.key_id) else {
        return Err(ApiError::bad(format!("volume {name} is not encrypted")));
    };
    let e = crate::encryption::rewrap(&node.cfg, &rec)
        .map_err(|e| ApiError(StatusCode::CONFLICT, format!("cannot re-key: {e}")))?;
    let to = e.key_id;
    if to != from {
        rec.encryption = Some(e);
        update_record(node, name, &rec, rev).await?;
        log::info!("volume {name}: data key re-wrapped from cluster key {from} to {to}");
    }
    ok(&converge_api::Rekeyed {
        name: name.to_string(),
        from_key: from,
        to_key: to,
    })
}

async fn resize_volume(node: &Arc<Node>, name: &str, body: &[u8]) -> Out {
    let req: ResizeVolume = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("bad resize request: {e}")))?;
    let (mut rec, rev) = volume_record(node, name).await?;
    if req.size_bytes < rec.size_bytes {
        return Err(ApiError::bad(format!(
            "volume {name} is {} bytes; shrinking to {} is refused (it would cut data off the end)",
            rec.size_bytes, req.size_bytes
        )));
    }
    if !req.size_bytes.is_multiple_of(BLOCK_SIZE as u64) || req.size_bytes > 1 << 50 {
        return Err(ApiError::bad(format!(
            "size {} bytes must be a multiple of {BLOCK_SIZE} and at most 1 PiB",
            req.size_bytes
        )));
    }
    if let Some(r) = forward_to_owner(
        node,
        serving_owner(node, &rec).await?,
        "POST",
        &format!("/v1/volumes/{name}/resize"),
        body,
    )
    .await?
    {
        return Ok(r);
    }
    let loads = provisioning_loads(&node.cluster, rec.compression).await?;
    let grow = req.size_bytes - rec.size_bytes;
    if grow > 0 {
        placement::can_place_volume(rec.resiliency, grow, rec.slab_size_bytes, &loads).map_err(
            |e| {
                ApiError(
                    StatusCode::CONFLICT,
                    format!("cannot grow volume {name}: {e}"),
                )
            },
        )?;
        crate::provisioning::check(
            node,
            rec.resiliency.raw_bytes(grow),
            format!(
                "{} more",
                crate::provisioning::describe(grow, rec.resiliency)
            ),
            &format!("cannot grow volume {name}"),
        )
        .await?;
    }
    rec.size_bytes = req.size_bytes;
    update_record(node, name, &rec, rev).await?;
    if let Some(v) = node.volumes.lock().await.get(name) {
        v.grow(req.size_bytes)
            .map_err(|e| ApiError::bad(e.to_string()))?;
    }
    ok(&volume(node, name).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scrubs_and_rotations_leave_the_cluster_healthy() {
        let job = |kind: &str| JobInfo {
            kind: kind.into(),
            node: NodeId(1),
            volume: "v".into(),
            slab: 0,
            detail: String::new(),
            bytes_done: 0,
            bytes_total: 0,
            started_unix: 0,
            eta_s: None,
        };
        assert_eq!(jobs_problem(&[]), None);
        assert_eq!(jobs_problem(&[job("scrub"), job("rotate")]), None);
        assert_eq!(
            jobs_problem(&[job("scrub"), job("resync"), job("rebuild")]).as_deref(),
            Some("2 repair jobs running")
        );
    }
}
