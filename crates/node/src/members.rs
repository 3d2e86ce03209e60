//! Who may ask this node what over the peer protocol, by the cluster's membership: the
//! nodes that hold drives (members), those in maintenance, and those removed
//! (`/converge/removed/<id>`), as this node last saw them. Every peer request passes
//! [`Members::admit`] before anything else runs for it (docs/SECURITY.md, "Who may ask
//! what"); an extent operation is then checked against its volume's owner
//! (`converge_allocator::admission`).
//!
//! * A removed node gets nothing: its certificate may outlive its removal.
//! * Forwarded volume I/O (a client of another node reading or writing a volume this node
//!   owns) comes only from a member that is not in maintenance: a node in maintenance serves
//!   no clients (its I/O is answered `Busy`, which its export retries until the restart
//!   that maintenance is for ends the connection, or its reroute deadline passes).
//!
//! The view is kept by etcd watches on three prefixes (drives, maintenance, removed), read
//! whole at start and after a broken watch. Per request it costs a read lock and a hash
//! lookup. At 1,000 nodes: one read of the drive records at start (about 10,000 records,
//! 3 MB) and three watches per node (3,000 on etcd), which deliver one event per change of
//! a drive record, maintenance or removal to every node: nothing periodic.

use converge_control::etcd::{EventKind, KeyValue, WatchEvent};
use converge_control::model::{keys, DriveRecord};
use converge_rpc::{ErrorCode, Request, Response};
use converge_types::{DriveId, NodeId};
use std::collections::{HashMap, HashSet};
use std::sync::RwLock;
use std::time::Duration;

/// Pause before the view is read again after etcd failed or a watch broke.
const RETRY_PAUSE: Duration = Duration::from_secs(1);

/// The membership as this node last saw it.
#[derive(Debug, Default)]
pub struct View {
    /// Each drive record's node: a node holding a drive is a member.
    drives: HashMap<DriveId, NodeId>,
    maintenance: HashSet<NodeId>,
    removed: HashSet<NodeId>,
    /// Read from etcd at least once (until then, forwarded I/O waits).
    loaded: bool,
}

impl View {
    fn member(&self, node: NodeId) -> bool {
        !self.removed.contains(&node) && self.drives.values().any(|n| *n == node)
    }

    /// What `peer` may ask: `Err` is the answer it gets instead.
    pub fn admit(&self, peer: NodeId, req: &Request) -> Result<(), Response> {
        if self.removed.contains(&peer) {
            return Err(Response::err(
                ErrorCode::Invalid,
                format!(
                    "node {peer} was removed from the cluster (converge node remove): it may \
                     not use the peer protocol any more; refused"
                ),
            ));
        }
        let forwarded = matches!(
            req,
            Request::VolRead { .. }
                | Request::VolWrite { .. }
                | Request::VolZero { .. }
                | Request::VolReadAt { .. }
                | Request::VolChanged { .. }
        );
        if !forwarded {
            return Ok(());
        }
        if !self.loaded {
            return Err(Response::err(
                ErrorCode::Busy,
                "this node has not read the cluster's membership from etcd yet; ask again",
            ));
        }
        if !self.member(peer) {
            return Err(Response::err(
                ErrorCode::Invalid,
                format!(
                    "node {peer} is not a member of this cluster (no drive record names it): \
                     its volume I/O is refused"
                ),
            ));
        }
        if self.maintenance.contains(&peer) {
            return Err(Response::err(
                ErrorCode::Busy,
                format!(
                    "node {peer} is in maintenance: its clients' volume I/O is not served \
                     until `converge node maintenance {peer} off` (move its VMs first)"
                ),
            ));
        }
        Ok(())
    }

    /// Replaces the view with what etcd holds.
    fn load(&mut self, drives: &[KeyValue], maintenance: &[KeyValue], removed: &[KeyValue]) {
        self.drives = drives.iter().filter_map(drive_of).collect();
        self.maintenance = maintenance
            .iter()
            .filter_map(|kv| node_of(&kv.key, keys::MAINTENANCE))
            .collect();
        self.removed = removed
            .iter()
            .filter_map(|kv| node_of(&kv.key, keys::REMOVED))
            .collect();
        self.loaded = true;
    }

    /// Applies one change a watch reported.
    fn apply(&mut self, ev: &WatchEvent) {
        let key = ev.kv.key.as_str();
        let put = ev.kind == EventKind::Put;
        if let Some(id) = key.strip_prefix(keys::DRIVES) {
            match (put, drive_of(&ev.kv)) {
                (true, Some((d, n))) => {
                    self.drives.insert(d, n);
                }
                _ => {
                    if let Ok(d) = id.parse() {
                        self.drives.remove(&DriveId(d));
                    }
                }
            }
        } else if let Some(n) = node_of(key, keys::MAINTENANCE) {
            if put {
                self.maintenance.insert(n);
            } else {
                self.maintenance.remove(&n);
            }
        } else if let Some(n) = node_of(key, keys::REMOVED) {
            if put {
                self.removed.insert(n);
            } else {
                self.removed.remove(&n);
            }
        }
    }
}

fn drive_of(kv: &KeyValue) -> Option<(DriveId, NodeId)> {
    serde_json::from_slice::<DriveRecord>(&kv.value)
        .ok()
        .map(|d| (d.id, d.node))
}

fn node_of(key: &str, prefix: &str) -> Option<NodeId> {
    key.strip_prefix(prefix)?.parse().ok().map(NodeId)
}

/// This node's view of the membership, shared by the peer protocol's handler.
#[derive(Default)]
pub struct Members {
    view: RwLock<View>,
}

impl Members {
    /// See [`View::admit`].
    pub fn admit(&self, peer: NodeId, req: &Request) -> Result<(), Response> {
        self.view
            .read()
            .expect("members lock poisoned")
            .admit(peer, req)
    }

    fn with<T>(&self, f: impl FnOnce(&mut View) -> T) -> T {
        f(&mut self.view.write().expect("members lock poisoned"))
    }
}

/// Keeps the node's membership view current from etcd until the process ends.
pub async fn run(node: std::sync::Arc<crate::node::Node>) {
    loop {
        if let Err(e) = watch(node.cluster.etcd(), &node.members).await {
            log::warn!("membership view: {e}; reading it again in {RETRY_PAUSE:?}");
        }
        tokio::time::sleep(RETRY_PAUSE).await;
    }
}

/// Reads the view, then applies the watches' changes until one of them fails.
async fn watch(
    etcd: &converge_control::etcd::Etcd,
    members: &Members,
) -> Result<(), converge_control::etcd::EtcdError> {
    let (drives, rd) = etcd.get_prefix(keys::DRIVES).await?;
    let (maint, rm) = etcd.get_prefix(keys::MAINTENANCE).await?;
    let (removed, rr) = etcd.get_prefix(keys::REMOVED).await?;
    let mut wd = etcd.watch_prefix(keys::DRIVES, rd + 1).await?;
    let mut wm = etcd.watch_prefix(keys::MAINTENANCE, rm + 1).await?;
    let mut wr = etcd.watch_prefix(keys::REMOVED, rr + 1).await?;
    members.with(|v| v.load(&drives, &maint, &removed));
    loop {
        let events = tokio::select! {
            e = wd.next() => e?,
            e = wm.next() => e?,
            e = wr.next() => e?,
        };
        members.with(|v| events.iter().for_each(|e| v.apply(e)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use converge_types::VolumeId;

    fn kv(key: String, value: Vec<u8>) -> KeyValue {
        KeyValue {
            key,
            value,
            create_revision: 1,
            mod_revision: 1,
            lease: 0,
        }
    }

    fn drive(id: u64, node: u32) -> KeyValue {
        let rec = DriveRecord {
            id: DriveId(id),
            node: NodeId(node),
            path: format!("/d{id}"),
            role: converge_types::DriveRole::Capacity,
            media: converge_types::MediaType::Ssd,
            size_bytes: 1 << 30,
            extents_total: 4,
            slab_size_bytes: 1 << 28,
            tbw_bytes: None,
            warranty_years: None,
            slots_total: None,
        };
        kv(keys::drive(DriveId(id)), serde_json::to_vec(&rec).unwrap())
    }

    fn mark(prefix: &str, node: u32) -> KeyValue {
        kv(format!("{prefix}{node}"), b"{}".to_vec())
    }

    fn ev(kind: EventKind, kv: KeyValue) -> WatchEvent {
        WatchEvent { kind, kv }
    }

    fn read() -> Request {
        Request::VolRead {
            volume: VolumeId(1),
            offset: 0,
            len: 4096,
        }
    }

    fn write() -> Request {
        Request::VolWrite {
            volume: VolumeId(1),
            offset: 0,
            data: Bytes::from(vec![0u8; 4096]),
        }
    }

    fn code(r: Result<(), Response>) -> Option<ErrorCode> {
        match r {
            Ok(()) => None,
            Err(Response::Err { code, .. }) => Some(code),
            Err(other) => panic!("{other:?}"),
        }
    }

    /// Forwarded volume I/O only from members out of maintenance, nothing at all from a
    /// removed node (before, any certificate of the cluster's CA could read and write every
    /// volume through its owner, whatever its node's standing).
    #[test]
    fn forwarded_io_only_from_members_out_of_maintenance_and_nothing_from_removed_nodes() {
        let mut v = View::default();
        // Before etcd was read: forwarded I/O waits (Busy is retried by the forwarder).
        assert_eq!(code(v.admit(NodeId(1), &read())), Some(ErrorCode::Busy));
        v.load(
            &[drive(10, 1), drive(20, 2), drive(30, 3)],
            &[mark(keys::MAINTENANCE, 3)],
            &[mark(keys::REMOVED, 4)],
        );
        assert_eq!(code(v.admit(NodeId(1), &read())), None);
        assert_eq!(code(v.admit(NodeId(2), &write())), None);
        // Node 3 is in maintenance, node 9 never joined, node 4 was removed.
        assert_eq!(code(v.admit(NodeId(3), &write())), Some(ErrorCode::Busy));
        assert_eq!(code(v.admit(NodeId(9), &read())), Some(ErrorCode::Invalid));
        assert_eq!(code(v.admit(NodeId(4), &read())), Some(ErrorCode::Invalid));
        // Extent operations are the owner check's to judge; a removed node gets nothing.
        assert_eq!(code(v.admit(NodeId(9), &Request::Ping)), None);
        assert_eq!(
            code(v.admit(NodeId(4), &Request::Ping)),
            Some(ErrorCode::Invalid)
        );

        // Changes as the watches report them.
        v.apply(&ev(EventKind::Delete, mark(keys::MAINTENANCE, 3)));
        assert_eq!(code(v.admit(NodeId(3), &write())), None);
        v.apply(&ev(EventKind::Put, mark(keys::MAINTENANCE, 1)));
        assert_eq!(code(v.admit(NodeId(1), &read())), Some(ErrorCode::Busy));
        v.apply(&ev(EventKind::Put, drive(90, 9)));
        assert_eq!(code(v.admit(NodeId(9), &read())), None);
        // `node remove`: its drive records go and its id is marked removed, in one
        // transaction.
        v.apply(&ev(EventKind::Delete, kv(keys::drive(DriveId(20)), vec![])));
        assert_eq!(code(v.admit(NodeId(2), &read())), Some(ErrorCode::Invalid));
        v.apply(&ev(EventKind::Put, mark(keys::REMOVED, 9)));
        assert_eq!(code(v.admit(NodeId(9), &read())), Some(ErrorCode::Invalid));
        assert_eq!(
            code(v.admit(NodeId(9), &Request::Ping)),
            Some(ErrorCode::Invalid)
        );
    }
}
