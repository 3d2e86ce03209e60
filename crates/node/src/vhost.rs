//! vhost-user-blk disks of this node: a volume attached here gets a socket
//! `<vhost_dir>/<volume>.sock` that a qemu guest on this host connects to
//! (`converge_vhost`). Each serves the volume's NBD export device ([`crate::export`]), so
//! ownership, redirection to the owner, failover and QoS are the NBD path's.
//!
//! The attached volumes are listed in `<vhost_dir>/attached`, so a restarted node offers
//! them again and qemu (`reconnect=1` on its chardev) connects again.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use converge_api::{AttachVhost, VhostInfo};
use converge_nbd::{ResolveError, Resolver};
use hyper::StatusCode;

use crate::api::{ok, ApiError, Out};
use crate::node::Node;

/// Queues a disk gets when the request names none.
pub const DEFAULT_QUEUES: u16 = 2;

/// One attached volume.
struct Attached {
    server: converge_vhost::Server,
    owner_follows: bool,
}

#[derive(Default)]
pub struct Attachments {
    servers: Mutex<BTreeMap<String, Attached>>,
    /// Attached before a restart, not served again yet.
    pending: Mutex<Vec<Entry>>,
    /// Serializes attach / detach / restore (each rewrites the list file).
    changing: tokio::sync::Mutex<()>,
}

fn socket_path(node: &Node, volume: &str) -> PathBuf {
    node.cfg.vhost_dir.join(format!("{volume}.sock"))
}

fn list_path(node: &Node) -> PathBuf {
    node.cfg.vhost_dir.join("attached")
}

/// A line of the list file: `volume queues follows`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    volume: String,
    queues: u16,
    owner_follows: bool,
}

fn info(node: &Node, volume: &str, a: &Attached) -> VhostInfo {
    let s = &a.server;
    let st = s.stats();
    VhostInfo {
        node: node.cfg.node_id,
        volume: volume.to_string(),
        socket: s.path().display().to_string(),
        queues: s.queues(),
        owner_follows: a.owner_follows,
        connected: s.connected(),
        requests: st.requests.load(Ordering::Relaxed),
        errors: st.errors.load(Ordering::Relaxed),
        bytes_read: st.bytes_read.load(Ordering::Relaxed),
        bytes_written: st.bytes_written.load(Ordering::Relaxed),
    }
}

/// Writes the list of attached volumes (`volume queues follows|stays` per line),
/// atomically: those served and those still waiting to be (after a restart). Callers hold
/// `changing`, so lists are written in the order of the changes.
fn save(node: &Node) {
    let text: String = {
        let servers = node.vhost.servers.lock().expect("vhost lock");
        let pending = node.vhost.pending.lock().expect("vhost lock");
        servers
            .iter()
            .map(|(v, a)| (v.as_str(), a.server.queues(), a.owner_follows))
            .chain(
                pending
                    .iter()
                    .map(|e| (e.volume.as_str(), e.queues, e.owner_follows)),
            )
            .map(|(v, q, f)| format!("{v} {q} {}\n", if f { "follows" } else { "stays" }))
            .collect()
    };
    let path = list_path(node);
    let tmp = path.with_extension("tmp");
    if let Err(e) = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, &path)) {
        log::warn!("vhost: saving the list of attached volumes: {e}");
    }
}

/// The guest started on this node: make this node the volume's owner.
async fn follow(node: &Arc<Node>, volume: &str) {
    if volume.contains('@') {
        return; // a snapshot: served wherever it is read
    }
    let owner = match node.cluster.volume(volume).await {
        Ok(Some((rec, _))) => rec.owner,
        Ok(None) => return,
        Err(e) => {
            log::warn!("vhost: a guest started on {volume}; its owner is unknown ({e})");
            return;
        }
    };
    if owner == node.cfg.node_id {
        return;
    }
    let body = serde_json::to_vec(&converge_api::MoveVolume {
        to: node.cfg.node_id,
    })
    .expect("json");
    match crate::api::move_volume(node, volume, &body).await {
        Ok(_) => log::info!(
            "vhost: a guest started on {volume} here: this node owns it now (was node {owner})"
        ),
        Err(ApiError(status, why)) => log::warn!(
            "vhost: a guest started on {volume} here; moving its owner here failed ({status}): \
             {why}"
        ),
    }
}

async fn start(
    node: &Arc<Node>,
    volume: &str,
    queues: u16,
    owner_follows: bool,
) -> Result<VhostInfo, ApiError> {
    if volume.contains('/') || volume.is_empty() {
        return Err(ApiError::bad(format!("{volume:?} is not a volume name")));
    }
    if queues == 0 || queues > converge_vhost::QUEUES_MAX {
        return Err(ApiError::bad(format!(
            "{queues} queues: a vhost-user-blk disk has 1 to {}",
            converge_vhost::QUEUES_MAX
        )));
    }
    let exports = crate::export::Exports { node: node.clone() };
    let dev = exports.resolve(volume).await.map_err(|e| match e {
        ResolveError::Unknown => ApiError(StatusCode::NOT_FOUND, format!("no volume {volume}")),
        other => ApiError(
            StatusCode::SERVICE_UNAVAILABLE,
            other.client_message(volume),
        ),
    })?;
    std::fs::create_dir_all(&node.cfg.vhost_dir).map_err(|e| {
        ApiError(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("creating {}: {e}", node.cfg.vhost_dir.display()),
        )
    })?;
    let path = socket_path(node, volume);
    let on_start = owner_follows.then(|| {
        let weak = Arc::downgrade(node);
        let volume = volume.to_string();
        let rt = tokio::runtime::Handle::current();
        Arc::new(move || {
            if let Some(node) = weak.upgrade() {
                let volume = volume.clone();
                rt.spawn(async move { follow(&node, &volume).await });
            }
        }) as Arc<dyn Fn() + Send + Sync>
    });
    let opts = converge_vhost::Options {
        queues,
        serial: volume.chars().take(20).collect(),
        on_start,
    };
    let server = converge_vhost::Server::start(&path, dev, opts, tokio::runtime::Handle::current())
        .map_err(|e| match e {
            converge_vhost::Error::PathTooLong(_) => ApiError::bad(format!(
                "{e}: use a shorter [network] vhost_dir or volume name"
            )),
            other => ApiError(StatusCode::INTERNAL_SERVER_ERROR, other.to_string()),
        })?;
    let attached = Attached {
        server,
        owner_follows,
    };
    let info = info(node, volume, &attached);
    node.vhost
        .servers
        .lock()
        .expect("vhost lock")
        .insert(volume.to_string(), attached);
    log::info!(
        "vhost: volume {volume} offered on {} ({queues} queues)",
        info.socket
    );
    Ok(info)
}

/// `POST /v1/vhost`.
pub async fn attach(node: &Arc<Node>, body: &[u8]) -> Out {
    let req: AttachVhost = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("bad attach request: {e}")))?;
    let (created, v) = attach_volume(
        node,
        &req.volume,
        req.queues,
        req.owner_follows.unwrap_or(true),
    )
    .await?;
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, serde_json::to_value(v).expect("json")))
}

/// Offers `volume` (if it is not offered yet: then `created`); `queues` `None` accepts
/// what an existing attachment has.
pub async fn attach_volume(
    node: &Arc<Node>,
    volume: &str,
    queues: Option<u16>,
    owner_follows: bool,
) -> Result<(bool, VhostInfo), ApiError> {
    let _g = node.vhost.changing.lock().await;
    if let Some(a) = node.vhost.servers.lock().expect("vhost lock").get(volume) {
        let s = &a.server;
        if queues.is_none_or(|q| q == s.queues()) && owner_follows == a.owner_follows {
            return Ok((false, info(node, volume, a)));
        }
        return Err(ApiError(
            StatusCode::CONFLICT,
            format!(
                "volume {volume} is attached with {} queues and owner_follows {} already; \
                 detach it first to change that",
                s.queues(),
                a.owner_follows
            ),
        ));
    }
    let v = start(
        node,
        volume,
        queues.unwrap_or(DEFAULT_QUEUES),
        owner_follows,
    )
    .await?;
    save(node);
    Ok((true, v))
}

/// `DELETE /v1/vhost/VOLUME`: a connected guest loses its disk.
pub async fn detach(node: &Arc<Node>, volume: &str) -> Out {
    detach_volume(node, volume).await
}

/// Stops offering `volume`; what it served, for the answer.
pub async fn detach_volume(node: &Arc<Node>, volume: &str) -> Out {
    let _g = node.vhost.changing.lock().await;
    let (server, was_pending) = {
        let mut servers = node.vhost.servers.lock().expect("vhost lock");
        let mut pending = node.vhost.pending.lock().expect("vhost lock");
        let was_pending = pending.iter().any(|e| e.volume == volume);
        pending.retain(|e| e.volume != volume);
        (servers.remove(volume), was_pending)
    };
    if server.is_some() || was_pending {
        save(node);
    }
    let Some(server) = server else {
        if was_pending {
            return ok(&serde_json::json!({ "volume": volume, "detached": "not served yet" }));
        }
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("volume {volume} is not attached as a vhost-user disk on this node"),
        ));
    };
    let was = info(node, volume, &server);
    // Stopping joins the serving threads, which may wait for requests in flight.
    tokio::task::spawn_blocking(move || server.server.stop())
        .await
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    log::info!("vhost: volume {volume} detached");
    ok(&was)
}

/// `GET /v1/vhost`.
pub fn list(node: &Node) -> Out {
    let servers = node.vhost.servers.lock().expect("vhost lock");
    let v: Vec<VhostInfo> = servers.iter().map(|(n, a)| info(node, n, a)).collect();
    ok(&v)
}

/// At start-up: offers again what was attached when the node stopped. A volume that
/// cannot be opened yet (etcd or its copies not ready) is tried again every 5 s; one that
/// no longer exists is dropped from the list.
pub async fn restore(node: Arc<Node>) {
    let text = match std::fs::read_to_string(list_path(&node)) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
        Err(e) => {
            log::warn!("vhost: reading {}: {e}", list_path(&node).display());
            return;
        }
    };
    *node.vhost.pending.lock().expect("vhost lock") = text
        .lines()
        .filter_map(|line| {
            let mut it = line.split_whitespace();
            let volume = it.next()?.to_string();
            let queues = it
                .next()
                .and_then(|q| q.parse().ok())
                .unwrap_or(DEFAULT_QUEUES);
            let owner_follows = it.next() != Some("stays");
            Some(Entry {
                volume,
                queues,
                owner_follows,
            })
        })
        .collect();
    loop {
        {
            let _g = node.vhost.changing.lock().await;
            let todo = node.vhost.pending.lock().expect("vhost lock").clone();
            for Entry {
                volume,
                queues,
                owner_follows,
            } in todo
            {
                let r = start(&node, &volume, queues, owner_follows).await;
                let keep = match r {
                    Ok(i) => {
                        log::info!("vhost: volume {volume} offered again on {}", i.socket);
                        false
                    }
                    Err(ApiError(StatusCode::NOT_FOUND, why)) => {
                        log::warn!("vhost: volume {volume} not offered again: {why}");
                        false
                    }
                    Err(ApiError(status, why)) => {
                        log::info!("vhost: volume {volume} not offered yet ({status}): {why}");
                        true
                    }
                };
                if !keep {
                    node.vhost
                        .pending
                        .lock()
                        .expect("vhost lock")
                        .retain(|e| e.volume != volume);
                }
            }
            save(&node);
            if node.vhost.pending.lock().expect("vhost lock").is_empty() {
                return;
            }
        }
        tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    }
}

/// At shutdown: stops every server (their sockets go; the list stays for the restart).
pub fn stop_all(node: &Node) {
    let servers = std::mem::take(&mut *node.vhost.servers.lock().expect("vhost lock"));
    for (_, a) in servers {
        a.server.stop();
    }
}
