//! One NBD export per volume. A client may connect to any node: if this node owns the
//! volume its I/O runs here; if another node does, every request is forwarded to that
//! owner over the peer protocol (redirected I/O); if the owner is gone, this node takes
//! the volume over. When ownership moves (takeover, `volume move`, a deposed owner), the
//! export re-resolves the route and retries the request, so clients see no error.

use crate::node::{Node, OpenError, Route};
use bytes::Bytes;
use converge_nbd::{
    BlockDev, DevError, DevErrorKind, Extent, ResolveError, Resolver, STATE_DIRTY, STATE_HOLE,
    STATE_ZERO,
};
use converge_rpc::{ErrorCode, Request, Response, RpcError};
use converge_types::{ExtentReply, NodeId, VolumeId};
use converge_volume::VolumeError;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

pub struct Export {
    node: Arc<Node>,
    name: String,
    size_bytes: u64,
    route: RwLock<Arc<Route>>,
    /// A snapshot's export (`VOLUME@SNAPSHOT`): its name and epoch. Read-only.
    snapshot: Option<(String, converge_types::Epoch)>,
    /// The snapshots older than what this export reads (every one, for the volume), offered
    /// as `qemu:dirty-bitmap:NAME` contexts: the blocks changed since each.
    bitmaps: Vec<(String, converge_types::Epoch)>,
}

/// Why one attempt failed: either for good, or because the route must be looked up again.
enum Attempt {
    Fail(DevError),
    Reroute(String),
}

fn dev_error(e: VolumeError) -> Attempt {
    let kind = match &e {
        VolumeError::Fenced { .. } | VolumeError::Control(..) => {
            return Attempt::Reroute(e.to_string())
        }
        VolumeError::OutOfRange { .. }
        | VolumeError::TooLong { .. }
        | VolumeError::Snapshot { .. } => DevErrorKind::Invalid,
        _ if e.is_no_space() => DevErrorKind::NoSpace,
        _ => DevErrorKind::Io,
    };
    log::warn!("nbd I/O failed: {e}");
    Attempt::Fail(DevError::new(kind, e.to_string()))
}

/// Whether a route looked up again leads where the failed one did (the same instance here,
/// or the same owner): then the retry waits a little, so an owner that answers `Busy` for a
/// while (cut from etcd, or holding a node in maintenance) is not asked in a tight loop.
fn same_route(a: &Route, b: &Route) -> bool {
    match (a, b) {
        (Route::Local(x), Route::Local(y)) => Arc::ptr_eq(x, y),
        (Route::Remote { owner: x, .. }, Route::Remote { owner: y, .. }) => x == y,
        _ => false,
    }
}

fn remote_error(owner: NodeId, e: RpcError) -> Attempt {
    match e {
        RpcError::Remote { code, message } => {
            let kind = match code {
                ErrorCode::NotOwner | ErrorCode::Busy => {
                    return Attempt::Reroute(format!("node {owner}: {message}"))
                }
                ErrorCode::OutOfRange | ErrorCode::Invalid => DevErrorKind::Invalid,
                ErrorCode::NoSpace => DevErrorKind::NoSpace,
                _ => DevErrorKind::Io,
            };
            log::warn!("redirected I/O to node {owner} failed: {message}");
            Attempt::Fail(DevError::new(kind, message))
        }
        // The owner is unreachable: it may be dead; look again (and maybe take over).
        other => Attempt::Reroute(format!("node {owner}: {other}")),
    }
}

impl Export {
    fn route(&self) -> Arc<Route> {
        self.route.read().expect("route lock poisoned").clone()
    }

    /// How long a request keeps trying new routes before it fails: long enough for a dead
    /// owner's lease to expire and for a takeover.
    fn reroute_deadline(&self) -> Instant {
        Instant::now() + Duration::from_secs(self.node.cfg.knobs.node_lease_ttl_s * 3 + 10)
    }

    /// Looks the route up again; false if the volume no longer exists.
    async fn reresolve(&self, why: &str, failed: &Route) -> bool {
        if let Route::Local(v) = failed {
            self.node.drop_instance(v).await;
        }
        match self.node.open_volume(&self.name).await {
            Ok(r) => {
                let desc = match &r {
                    Route::Local(v) => format!("served here at epoch {}", v.epoch()),
                    Route::Remote { owner, .. } => format!("forwarded to node {owner}"),
                };
                log::info!("volume {}: re-routed ({why}): {desc}", self.name);
                *self.route.write().expect("route lock poisoned") = Arc::new(r);
            }
            Err(OpenError::Unknown) => {
                log::warn!("volume {}: deleted; failing its clients' I/O", self.name);
                return false;
            }
            Err(OpenError::Unavailable(e)) => {
                log::warn!("volume {}: re-routing ({why}): {e}", self.name)
            }
        }
        true
    }

    async fn forward(&self, owner: NodeId, req: Request) -> Result<Response, Attempt> {
        match self.node.replicas.call_peer(owner, req).await {
            Ok(Response::Err { code, message }) => {
                Err(remote_error(owner, RpcError::Remote { code, message }))
            }
            Ok(r) => Ok(r),
            Err(e) => Err(remote_error(owner, e)),
        }
    }

    /// Runs `local` or forwards `remote()` depending on the route, re-routing on ownership
    /// changes until the deadline.
    async fn run<T, L, LF>(
        &self,
        local: L,
        remote: impl Fn(VolumeId) -> Request,
        from_response: impl Fn(Response) -> Result<T, Attempt>,
    ) -> Result<T, DevError>
    where
        L: Fn(Arc<converge_volume::Volume<crate::node::Replicas, crate::node::Allocator>>) -> LF,
        LF: std::future::Future<Output = Result<T, VolumeError>>,
    {
        let mut deadline = None;
        loop {
            let route = self.route();
            let r = match &*route {
                Route::Local(v) => local(v.clone()).await.map_err(dev_error),
                Route::Remote { owner, volume } => {
                    match self.forward(*owner, remote(*volume)).await {
                        Ok(resp) => from_response(resp),
                        Err(e) => Err(e),
                    }
                }
            };
            match r {
                Ok(v) => return Ok(v),
                Err(Attempt::Fail(e)) => return Err(e),
                Err(Attempt::Reroute(why)) => {
                    let d = *deadline.get_or_insert_with(|| self.reroute_deadline());
                    if Instant::now() >= d {
                        return Err(DevError::new(
                            DevErrorKind::Unavailable,
                            format!("volume {}: no owner could be reached: {why}", self.name),
                        ));
                    }
                    if !self.reresolve(&why, &route).await {
                        return Err(DevError::new(
                            DevErrorKind::Io,
                            format!("volume {} was deleted", self.name),
                        ));
                    }
                    if same_route(&route, &self.route()) {
                        tokio::time::sleep(Duration::from_millis(250)).await;
                    }
                }
            }
        }
    }
}

fn unexpected<T>(r: Response) -> Result<T, Attempt> {
    Err(Attempt::Fail(DevError::new(
        DevErrorKind::Io,
        format!("owner answered {r:?}"),
    )))
}

impl BlockDev for Export {
    fn size_bytes(&self) -> u64 {
        if self.snapshot.is_some() {
            return self.size_bytes;
        }
        match &*self.route() {
            Route::Local(v) => v.size_bytes(),
            Route::Remote { .. } => self.size_bytes,
        }
    }

    async fn read(&self, offset: u64, len: u32) -> Result<Bytes, DevError> {
        if let Some((_, snapshot)) = &self.snapshot {
            let snapshot = *snapshot;
            return self
                .run(
                    |v| async move { v.read_at(snapshot, offset, len as u64).await },
                    |volume| Request::VolReadAt {
                        volume,
                        snapshot,
                        offset,
                        len,
                    },
                    |r| match r {
                        Response::Extent(ExtentReply::Read(r)) if r.data.len() == len as usize => {
                            Ok(r.data)
                        }
                        other => unexpected(other),
                    },
                )
                .await;
        }
        self.run(
            |v| async move { v.read(offset, len as u64).await },
            |volume| Request::VolRead {
                volume,
                offset,
                len,
            },
            |r| match r {
                Response::Extent(ExtentReply::Read(r)) if r.data.len() == len as usize => {
                    Ok(r.data)
                }
                other => unexpected(other),
            },
        )
        .await
    }

    async fn write(&self, offset: u64, data: Bytes, _fua: bool) -> Result<(), DevError> {
        self.writable()?;
        // Every acked write is already durable on min_replicas copies: FUA costs nothing.
        self.run(
            |v| {
                let data = data.clone();
                async move { v.write(offset, data).await }
            },
            |volume| Request::VolWrite {
                volume,
                offset,
                data: data.clone(),
            },
            |r| match r {
                Response::Extent(ExtentReply::Ok) => Ok(()),
                other => unexpected(other),
            },
        )
        .await
    }

    async fn flush(&self) -> Result<(), DevError> {
        // Writes are durable before they are acked (multi-conn safe).
        Ok(())
    }

    async fn trim(&self, offset: u64, len: u32) -> Result<(), DevError> {
        self.zero(offset, u64::from(len), true).await
    }

    async fn write_zeroes(&self, offset: u64, len: u32, _may_trim: bool) -> Result<(), DevError> {
        self.zero(offset, u64::from(len), false).await
    }

    /// Slabs never written are holes that read as zeroes; everything else counts as data.
    /// Asked of the owner's slab map when it is served here. Forwarded to another owner,
    /// the answer is "all data" (the peer protocol does not carry this question yet):
    /// never wrong, only less useful.
    async fn block_status(&self, offset: u64, len: u32) -> Result<Vec<Extent>, DevError> {
        let all_data = || {
            vec![Extent {
                length: len,
                flags: 0,
            }]
        };
        let runs = match &*self.route() {
            Route::Local(v) => match v.allocation(offset, u64::from(len)) {
                Ok(runs) => runs,
                Err(e) => match dev_error(e) {
                    // Deposed meanwhile: the next request re-routes; this one stays safe.
                    Attempt::Reroute(_) => return Ok(all_data()),
                    Attempt::Fail(e) => return Err(e),
                },
            },
            Route::Remote { .. } => return Ok(all_data()),
        };
        Ok(runs
            .into_iter()
            .map(|(n, allocated)| Extent {
                length: n as u32,
                flags: if allocated {
                    0
                } else {
                    STATE_HOLE | STATE_ZERO
                },
            })
            .collect())
    }

    fn read_only(&self) -> bool {
        self.snapshot.is_some()
    }

    fn dirty_bitmaps(&self) -> Vec<String> {
        self.bitmaps.iter().map(|(n, _)| n.clone()).collect()
    }

    /// From the copies' block metadata ([`converge_volume::Volume::changed`]) on the owner,
    /// in 4 KiB blocks: a partly covered block that changed is dirty.
    async fn dirty_status(
        &self,
        bitmap: &str,
        offset: u64,
        len: u32,
    ) -> Result<Vec<Extent>, DevError> {
        let Some(&(_, from)) = self.bitmaps.iter().find(|(n, _)| n == bitmap) else {
            return Err(DevError::new(
                DevErrorKind::Invalid,
                format!("volume {} has no snapshot {bitmap}", self.name),
            ));
        };
        let to = self.snapshot.as_ref().map(|(_, e)| *e);
        let len64 = u64::from(len);
        let bits = self
            .run(
                |v| async move { v.changed(from, to, offset, len64).await },
                |volume| Request::VolChanged {
                    volume,
                    from,
                    to,
                    offset,
                    len: len64,
                },
                |r| match r {
                    Response::Extent(ExtentReply::Bitmap(b)) => Ok(b),
                    other => unexpected(other),
                },
            )
            .await?;
        // Runs of equal bits, cut to the range asked about (the bitmap is in whole blocks).
        const BS: u64 = converge_types::BLOCK_SIZE as u64;
        let base = offset / BS * BS;
        let end = offset + len64;
        let blocks = (end.div_ceil(BS) * BS - base) / BS;
        if bits.len() as u64 != blocks.div_ceil(64) {
            return Err(DevError::new(
                DevErrorKind::Io,
                format!(
                    "the owner answered {} bitmap words for {blocks} blocks",
                    bits.len()
                ),
            ));
        }
        let mut out: Vec<Extent> = Vec::new();
        for b in 0..blocks {
            let dirty = bits[(b / 64) as usize] >> (b % 64) & 1 == 1;
            let flags = if dirty { STATE_DIRTY } else { 0 };
            let lo = (base + b * BS).max(offset);
            let hi = (base + (b + 1) * BS).min(end);
            let n = (hi - lo) as u32;
            match out.last_mut() {
                Some(e) if e.flags == flags => e.length += n,
                _ => out.push(Extent { length: n, flags }),
            }
        }
        Ok(out)
    }

    fn description(&self) -> Option<String> {
        if let Some((snap, epoch)) = &self.snapshot {
            return Some(format!(
                "converge snapshot {snap} (epoch {epoch}) of volume {}, read-only",
                self.name
            ));
        }
        Some(match &*self.route() {
            Route::Local(v) => {
                let c = v.config();
                format!(
                    "converge volume {} ({}, epoch {}, served here)",
                    c.name, c.resiliency, c.epoch
                )
            }
            Route::Remote { owner, .. } => {
                format!(
                    "converge volume {} (forwarded to owner node {owner})",
                    self.name
                )
            }
        })
    }
}

impl Export {
    /// A snapshot takes no writes (the NBD server refuses them first; this is the device's
    /// own word on it).
    fn writable(&self) -> Result<(), DevError> {
        match &self.snapshot {
            Some((snap, _)) => Err(DevError::new(
                DevErrorKind::Invalid,
                format!("snapshot {snap} of volume {} is read-only", self.name),
            )),
            None => Ok(()),
        }
    }

    async fn zero(&self, offset: u64, len: u64, trim: bool) -> Result<(), DevError> {
        self.writable()?;
        self.run(
            |v| async move { v.zero(offset, len, trim).await },
            |volume| Request::VolZero {
                volume,
                offset,
                len,
                trim,
            },
            |r| match r {
                Response::Extent(ExtentReply::Ok) => Ok(()),
                other => unexpected(other),
            },
        )
        .await
    }
}

pub struct Exports {
    pub node: Arc<Node>,
}

impl Resolver for Exports {
    type Dev = Export;

    async fn list(&self) -> Vec<String> {
        match self.node.cluster.volumes().await {
            Ok(v) => v
                .into_iter()
                .flat_map(|v| {
                    let snaps: Vec<String> = v
                        .snapshots
                        .iter()
                        .filter(|s| !s.deleting)
                        .map(|s| format!("{}@{}", v.name, s.name))
                        .collect();
                    std::iter::once(v.name).chain(snaps)
                })
                .collect(),
            Err(e) => {
                log::warn!("nbd list: {e}");
                Vec::new()
            }
        }
    }

    /// `VOLUME` is the volume; `VOLUME@SNAPSHOT` its snapshot, read-only.
    async fn resolve(&self, export: &str) -> Result<Arc<Export>, ResolveError> {
        let (volume, snap) = match export.split_once('@') {
            Some((v, s)) => (v, Some(s)),
            None => (export, None),
        };
        let (size, snapshot, bitmaps) = match self.node.cluster.volume(volume).await {
            Ok(Some((rec, _))) => {
                let (size, snapshot) = match snap {
                    None => (rec.size_bytes, None),
                    Some(s) => match rec.snapshots.iter().find(|x| x.name == s && !x.deleting) {
                        // Records from before the size was kept: the volume's (a volume
                        // only grows; reads past the snapshot's end read zeros).
                        Some(x) => (
                            if x.size_bytes > 0 {
                                x.size_bytes
                            } else {
                                rec.size_bytes
                            },
                            Some((s.to_string(), x.epoch)),
                        ),
                        None => return Err(ResolveError::Unknown),
                    },
                };
                let upto = snapshot.as_ref().map(|(_, e)| *e);
                let bitmaps = rec
                    .snapshots
                    .iter()
                    .filter(|s| !s.deleting && upto.is_none_or(|u| s.epoch < u))
                    .map(|s| (s.name.clone(), s.epoch))
                    .collect();
                (size, snapshot, bitmaps)
            }
            Ok(None) => return Err(ResolveError::Unknown),
            Err(e) => return Err(ResolveError::Unavailable(e.to_string())),
        };
        match self.node.open_volume(volume).await {
            Ok(route) => Ok(Arc::new(Export {
                node: self.node.clone(),
                name: volume.to_string(),
                size_bytes: size,
                route: RwLock::new(Arc::new(route)),
                snapshot,
                bitmaps,
            })),
            Err(OpenError::Unknown) => Err(ResolveError::Unknown),
            Err(OpenError::Unavailable(why)) => Err(ResolveError::Unavailable(why)),
        }
    }
}
