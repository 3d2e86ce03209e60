//! The simulated control plane: an in-memory etcd ([`Ctl`]: keys with create and mod
//! revisions, leases, atomic transactions) that owners reach through [`SimKv`], the
//! simulator's implementation of `converge_control::Kv`. Owners run the production glue
//! (`converge_allocator::Allocator` over `converge_control::Cluster`): placement,
//! epoch-fenced allocation and record changes, lookup. Only the store is simulated: every
//! call is a round trip with latency, fails when the caller's node is cut off (before the
//! store sees it, or after, with the reply lost), and the records are the daemon's own
//! (`converge_control::model`, JSON under `/converge/`).
//!
//! Leases: a node's lease id is its node id. A key bound to a lease (node records, owner
//! records) is visible only while that node is up and reachable, as if its lease expired
//! the moment it was cut off and it registered again when it came back.

use crate::world::{lock, World};
use converge_control::etcd::{Compare, EtcdError, KeyValue, LeaseId, Op, Txn, TxnResponse};
use converge_control::kv::Kv;
use converge_control::model::{keys, DriveRecord, NodeRecord, OwnerRecord, SlabRecord};
use converge_types::{DriveId, DriveRole, Epoch, MediaType, NodeId, SlabIndex, VolumeId};
use converge_volume::ExtentLoc;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

struct Stored {
    value: Vec<u8>,
    create_revision: i64,
    mod_revision: i64,
    lease: i64,
}

/// Leases alive now (node ids of nodes that are up and reachable).
pub(crate) type Leases = BTreeSet<i64>;

/// The store. The world reads it directly (no latency) for its checkers and fault budget.
#[derive(Default)]
pub(crate) struct Ctl {
    kvs: BTreeMap<String, Stored>,
    revision: i64,
    /// The slab records decoded, kept in step with `kvs` (the checkers read them often).
    slabs: BTreeMap<(VolumeId, SlabIndex), Vec<ExtentLoc>>,
    /// The copies the slab records mark as holding every acked write (docs/adr/0014).
    holders: BTreeSet<(VolumeId, SlabIndex, DriveId)>,
}

fn json<T: serde::Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("records always encode")
}

impl Ctl {
    fn visible(&self, key: &str, alive: &Leases) -> Option<KeyValue> {
        let s = self.kvs.get(key)?;
        if s.lease != 0 && !alive.contains(&s.lease) {
            return None;
        }
        Some(KeyValue {
            key: key.to_string(),
            value: s.value.clone(),
            create_revision: s.create_revision,
            mod_revision: s.mod_revision,
            lease: s.lease,
        })
    }

    fn range(&self, prefix: &str, alive: &Leases) -> Vec<KeyValue> {
        self.kvs
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .filter_map(|(k, _)| self.visible(k, alive))
            .collect()
    }

    fn holds(&self, c: &Compare, alive: &Leases) -> bool {
        match c {
            Compare::ModRevision(k, r) => {
                self.visible(k, alive).map_or(0, |kv| kv.mod_revision) == *r
            }
            Compare::CreateRevision(k, r) => {
                self.visible(k, alive).map_or(0, |kv| kv.create_revision) == *r
            }
            Compare::Value(k, v) => self.visible(k, alive).is_some_and(|kv| kv.value == *v),
        }
    }

    /// Runs a transaction atomically, as etcd does: one new revision if it writes.
    fn txn(&mut self, txn: &Txn, alive: &Leases) -> TxnResponse {
        let succeeded = txn.compare.iter().all(|c| self.holds(c, alive));
        let ops = if succeeded {
            &txn.success
        } else {
            &txn.failure
        };
        let rev = self.revision + 1;
        let mut wrote = false;
        let mut gets = Vec::new();
        for op in ops {
            match op {
                Op::Get(k) => gets.push(self.visible(k, alive)),
                Op::Put(k, v, lease) => {
                    let create_revision =
                        self.visible(k, alive).map_or(rev, |kv| kv.create_revision);
                    self.kvs.insert(
                        k.clone(),
                        Stored {
                            value: v.clone(),
                            create_revision,
                            mod_revision: rev,
                            lease: lease.map_or(0, |l| l.0),
                        },
                    );
                    wrote = true;
                    if let Some(at) = keys::parse_slab(k) {
                        match serde_json::from_slice::<SlabRecord>(v) {
                            Ok(rec) => {
                                self.slabs.insert(at, converge_allocator::extents_of(&rec));
                                self.holders.retain(|h| (h.0, h.1) != at);
                                for e in rec.extents.iter().filter(|e| e.holds_acked) {
                                    self.holders.insert((at.0, at.1, e.drive));
                                }
                            }
                            Err(_) => {
                                self.slabs.remove(&at);
                                self.holders.retain(|h| (h.0, h.1) != at);
                            }
                        }
                    }
                }
                Op::Delete(k) => {
                    wrote |= self.kvs.remove(k).is_some();
                    if let Some(at) = keys::parse_slab(k) {
                        self.slabs.remove(&at);
                        self.holders.retain(|h| (h.0, h.1) != at);
                    }
                }
                Op::DeletePrefix(p) => {
                    let before = self.kvs.len();
                    self.kvs.retain(|k, _| !k.starts_with(p.as_str()));
                    wrote |= self.kvs.len() != before;
                    let kvs = &self.kvs;
                    self.slabs
                        .retain(|(v, s), _| kvs.contains_key(&keys::slab(*v, *s)));
                    self.holders
                        .retain(|(v, s, _)| kvs.contains_key(&keys::slab(*v, *s)));
                }
            }
        }
        if wrote {
            self.revision = rev;
        }
        TxnResponse {
            succeeded,
            revision: self.revision,
            gets,
        }
    }

    fn put_direct(&mut self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) {
        let txn = Txn {
            compare: vec![],
            success: vec![Op::Put(key.to_string(), value, lease)],
            failure: vec![],
        };
        self.txn(&txn, &Leases::new());
    }

    /// Clears a drive's failure record, as its node does when the drive opens at start-up.
    pub(crate) fn clear_drive_failure(&mut self, drive: DriveId) {
        let txn = Txn {
            compare: vec![],
            success: vec![Op::Delete(format!("{}{}", keys::FAILED_DRIVES, drive.0))],
            failure: vec![],
        };
        self.txn(&txn, &Leases::new());
    }

    /// A capacity drive, as the node publishes it at start-up.
    pub(crate) fn add_drive(
        &mut self,
        node: NodeId,
        drive: DriveId,
        extents_total: u64,
        slab_size_bytes: u64,
    ) {
        let rec = DriveRecord {
            id: drive,
            node,
            path: format!("sim://n{node}/d{drive}"),
            role: DriveRole::Capacity,
            media: MediaType::Ram,
            size_bytes: extents_total * slab_size_bytes,
            extents_total,
            slab_size_bytes,
            tbw_bytes: None,
            warranty_years: None,
            // Placement counts the simulated drives' extents whole (no usage is published):
            // slots beyond their data extents are never used.
            slots_total: None,
        };
        self.put_direct(&keys::drive(drive), json(&rec), None);
    }

    /// Marks a node draining, as `converge node remove` does.
    pub(crate) fn drain(&mut self, node: NodeId) {
        self.put_direct(
            &format!("{}{}", keys::DRAINING, node.0),
            b"{}".to_vec(),
            None,
        );
    }

    /// A node's record, bound to its lease (present = live).
    pub(crate) fn add_node(&mut self, node: NodeId) {
        let rec = NodeRecord {
            id: node,
            name: format!("n{node}"),
            rpc_addr: format!("sim:{node}"),
            api_addr: String::new(),
            nbd_socket: String::new(),
            nbd_tcp: None,
            version: String::new(),
            started_unix: 0,
        };
        self.put_direct(&keys::node(node), json(&rec), Some(lease_of(node)));
    }

    pub(crate) fn extents(&self, v: VolumeId, s: SlabIndex) -> Option<Vec<ExtentLoc>> {
        self.slabs.get(&(v, s)).cloned()
    }

    pub(crate) fn slabs_of(&self, v: VolumeId) -> BTreeMap<SlabIndex, Vec<ExtentLoc>> {
        self.slabs
            .iter()
            .filter(|((vv, _), _)| *vv == v)
            .map(|((_, s), e)| (*s, e.clone()))
            .collect()
    }

    /// Nodes marked draining.
    pub(crate) fn draining(&self) -> BTreeSet<NodeId> {
        self.kvs
            .range(keys::DRAINING.to_string()..)
            .take_while(|(k, _)| k.starts_with(keys::DRAINING))
            .filter_map(|(k, _)| k.strip_prefix(keys::DRAINING)?.parse().ok())
            .map(NodeId)
            .collect()
    }

    pub(crate) fn all(&self) -> Vec<((VolumeId, SlabIndex), Vec<ExtentLoc>)> {
        self.slabs.iter().map(|(k, e)| (*k, e.clone())).collect()
    }

    /// The copies the slab records mark as holding every acked write (docs/adr/0014).
    pub(crate) fn holders(&self) -> BTreeSet<(VolumeId, SlabIndex, DriveId)> {
        self.holders.clone()
    }

    /// The previous owner's lease is gone (the nemesis decided it: crash, deposition, or a
    /// takeover attempt that is given up): its owner record disappears, as etcd deletes a
    /// lease's keys when it expires.
    /// Writes a volume's record (variant `snapshot`: the snapshot transactions read it).
    pub(crate) fn put_volume(&mut self, rec: &converge_control::VolumeRecord) {
        self.put_direct(&keys::volume(&rec.name), json(rec), None);
    }

    /// Volume `name`'s record, as it stands.
    pub(crate) fn volume_record(&self, name: &str) -> Option<converge_control::VolumeRecord> {
        let alive = Leases::default();
        self.visible(&keys::volume(name), &alive)
            .and_then(|kv| serde_json::from_slice(&kv.value).ok())
    }

    /// The epochs of the snapshots volume `name`'s record lists (not being deleted).
    pub(crate) fn snapshot_epochs(&self, name: &str) -> Vec<Epoch> {
        let alive = Leases::default();
        self.visible(&keys::volume(name), &alive)
            .and_then(|kv| serde_json::from_slice::<converge_control::VolumeRecord>(&kv.value).ok())
            .map(|r| {
                r.snapshots
                    .iter()
                    .filter(|s| !s.deleting)
                    .map(|s| s.epoch)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Snapshot `snap` of volume `name` as its record lists it: (epoch, being deleted).
    pub(crate) fn snapshot_of(&self, name: &str, snap: &str) -> Option<(Epoch, bool)> {
        let alive = Leases::default();
        let rec = self.visible(&keys::volume(name), &alive).and_then(|kv| {
            serde_json::from_slice::<converge_control::VolumeRecord>(&kv.value).ok()
        })?;
        rec.snapshots
            .iter()
            .find(|s| s.name == snap)
            .map(|s| (s.epoch, s.deleting))
    }

    pub(crate) fn expire_owner(&mut self, v: VolumeId) {
        self.kvs.remove(&keys::owner(v));
        self.revision += 1;
    }

    /// The first owner of a fresh volume, before the run starts (no latency).
    pub(crate) fn first_claim(&mut self, v: VolumeId, node: NodeId) -> Epoch {
        let epoch = Epoch(1);
        self.put_direct(&keys::epoch(v), json(&epoch), None);
        self.put_direct(
            &keys::owner(v),
            json(&OwnerRecord { node, epoch }),
            Some(lease_of(node)),
        );
        epoch
    }
}

/// The lease of a node in the simulated store.
pub(crate) fn lease_of(node: NodeId) -> LeaseId {
    LeaseId(i64::from(node.0))
}

/// One node's connection to the simulated etcd.
#[derive(Clone)]
pub struct SimKv {
    pub(crate) world: Arc<World>,
    pub(crate) node: NodeId,
}

impl SimKv {
    fn unreachable(&self, path: &str) -> EtcdError {
        EtcdError::Timeout {
            endpoint: format!("simulated etcd (from node {}, cut off)", self.node),
            path: path.to_string(),
            timeout_ms: self.world.opts.rpc_timeout.as_millis() as u64,
        }
    }

    /// One round trip: the request travels, the store applies `f` atomically, the answer
    /// travels back. A node that is cut off loses the request or, if cut off meanwhile,
    /// the answer (the store did apply it), and sees a timeout.
    async fn call<T>(
        &self,
        path: &str,
        f: impl FnOnce(&mut Ctl, &Leases) -> T,
    ) -> Result<T, EtcdError> {
        let w = &self.world;
        tokio::time::sleep(w.us(25, 400)).await;
        if w.isolated(self.node) {
            tokio::time::sleep(w.opts.rpc_timeout).await;
            return Err(self.unreachable(path));
        }
        let alive = w.live_leases();
        let out = f(&mut lock(&w.ctl), &alive);
        tokio::time::sleep(w.us(25, 400)).await;
        if w.isolated(self.node) {
            tokio::time::sleep(w.opts.rpc_timeout).await;
            return Err(self.unreachable(path));
        }
        Ok(out)
    }
}

/// The owner compare of a fenced transaction, if it has one.
fn owner_compare(txn: &Txn) -> Option<&Compare> {
    txn.compare
        .iter()
        .find(|c| matches!(c, Compare::Value(k, _) if k.starts_with(keys::OWNERS)))
}

impl Kv for SimKv {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, EtcdError> {
        self.call("get", |c, alive| c.visible(key, alive)).await
    }

    async fn get_prefix(&self, prefix: &str) -> Result<(Vec<KeyValue>, i64), EtcdError> {
        self.call("get_prefix", |c, alive| {
            (c.range(prefix, alive), c.revision)
        })
        .await
    }

    async fn put(&self, key: &str, value: &[u8], lease: Option<LeaseId>) -> Result<i64, EtcdError> {
        let txn = Txn {
            compare: vec![],
            success: vec![Op::Put(key.to_string(), value.to_vec(), lease)],
            failure: vec![],
        };
        Ok(self.txn(txn).await?.revision)
    }

    async fn delete(&self, key: &str) -> Result<u64, EtcdError> {
        self.call("delete", |c, alive| {
            let present = c.visible(key, alive).is_some();
            let txn = Txn {
                compare: vec![],
                success: vec![Op::Delete(key.to_string())],
                failure: vec![],
            };
            c.txn(&txn, alive);
            u64::from(present)
        })
        .await
    }

    async fn txn(&self, txn: Txn) -> Result<TxnResponse, EtcdError> {
        let w = self.world.clone();
        let node = self.node;
        self.call("txn", |c, alive| {
            let fenced = owner_compare(&txn).is_some_and(|oc| !c.holds(oc, alive));
            let r = c.txn(&txn, alive);
            if fenced {
                let what = if txn
                    .compare
                    .iter()
                    .any(|c| matches!(c, Compare::CreateRevision(..)))
                {
                    "control plane refused a deposed owner's allocation"
                } else {
                    "control plane refused a deposed owner's record change"
                };
                w.count(what);
                w.trace(|| format!("ctl: node {node}: {what}"));
            }
            if r.succeeded {
                for op in &txn.success {
                    if let Op::Put(k, v, _) = op {
                        if let (Some((vol, slab)), Ok(rec)) =
                            (keys::parse_slab(k), serde_json::from_slice::<SlabRecord>(v))
                        {
                            w.trace(|| {
                                format!(
                                    "ctl: node {node}: vol {vol} slab {slab} -> {}",
                                    rec.extents
                                        .iter()
                                        .map(|e| format!("n{}/d{}:{}", e.node, e.drive, e.state))
                                        .collect::<Vec<_>>()
                                        .join(" ")
                                )
                            });
                        }
                    }
                }
            }
            r
        })
        .await
    }
}
