//! One NBD export per volume: adapts the owner's [`Volume`](converge_volume::Volume) to
//! the NBD server's device trait, and resolves export names to the volumes this node owns.

use crate::node::{Node, OpenError, Vol};
use bytes::Bytes;
use converge_nbd::{BlockDev, DevError, DevErrorKind, ResolveError, Resolver};
use converge_volume::{ReplicaError, VolumeError};
use std::sync::Arc;

pub struct Export {
    pub vol: Arc<Vol>,
}

fn dev_error(e: VolumeError) -> DevError {
    let kind = match &e {
        VolumeError::OutOfRange { .. } => DevErrorKind::Invalid,
        VolumeError::NoSpace { .. } => DevErrorKind::NoSpace,
        VolumeError::Replica {
            error: ReplicaError::StaleEpoch(_),
            ..
        } => DevErrorKind::Unavailable,
        VolumeError::Replica {
            error: ReplicaError::NoSpace(_),
            ..
        } => DevErrorKind::NoSpace,
        _ => DevErrorKind::Io,
    };
    log::warn!("nbd I/O failed: {e}");
    DevError::new(kind, e.to_string())
}

impl BlockDev for Export {
    fn size_bytes(&self) -> u64 {
        self.vol.size_bytes()
    }

    async fn read(&self, offset: u64, len: u32) -> Result<Bytes, DevError> {
        self.vol.read(offset, len as u64).await.map_err(dev_error)
    }

    async fn write(&self, offset: u64, data: Bytes, _fua: bool) -> Result<(), DevError> {
        // Every acked write is already durable on every copy: FUA costs nothing extra.
        self.vol.write(offset, data).await.map_err(dev_error)
    }

    async fn flush(&self) -> Result<(), DevError> {
        // Writes are durable on every copy before they are acked (multi-conn safe).
        Ok(())
    }

    async fn trim(&self, offset: u64, len: u32) -> Result<(), DevError> {
        self.vol
            .zero(offset, len as u64, true)
            .await
            .map_err(dev_error)
    }

    async fn write_zeroes(&self, offset: u64, len: u32, _may_trim: bool) -> Result<(), DevError> {
        self.vol
            .zero(offset, len as u64, false)
            .await
            .map_err(dev_error)
    }

    fn description(&self) -> Option<String> {
        let c = self.vol.config();
        Some(format!(
            "converge volume {} ({}, epoch {})",
            c.name, c.resiliency, c.epoch
        ))
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
                .filter(|v| v.owner == self.node.cfg.node_id)
                .map(|v| v.name)
                .collect(),
            Err(e) => {
                log::warn!("nbd list: {e}");
                Vec::new()
            }
        }
    }

    async fn resolve(&self, export: &str) -> Result<Arc<Export>, ResolveError> {
        match self.node.open_volume(export).await {
            Ok(vol) => Ok(Arc::new(Export { vol })),
            Err(OpenError::Unknown) => Err(ResolveError::Unknown),
            Err(OpenError::Elsewhere(owner)) => Err(ResolveError::Elsewhere { owner }),
            Err(OpenError::Unavailable(why)) => Err(ResolveError::Unavailable(why)),
        }
    }
}
