//! converge control plane: the cluster model over etcd, placement, leases (DESIGN.md,
//! "Control plane").
//!
//! * [`etcd`]: a small async etcd v3 client over the JSON gateway, over http or https
//!   (TLS with a given CA, optional client certificate) and with optional etcd
//!   username/password authentication ([`EtcdSecurity`]).
//! * [`kv`]: the key-value operations the model needs, as a trait ([`Etcd`] and the
//!   simulator's store implement it).
//! * [`model`]: typed records under `/converge/` and the transactions that change them.
//! * [`creds`]: what etcd keeps about credentials: certificates by node, revoked ones.
//! * [`placement`]: pure placement of slab copies on drives of distinct nodes.
//! * `testing` (feature `testing`): a throwaway real etcd for integration tests.

pub mod creds;
pub mod etcd;
pub mod kv;
pub mod model;
pub mod placement;
#[cfg(feature = "testing")]
pub mod testing;

pub use etcd::{
    Compare, Etcd, EtcdError, EtcdSecurity, EventKind, KeyValue, LeaseId, Op, SecurityError,
    TlsFailure, Txn, TxnResponse, Watch, WatchEvent,
};
pub use kv::Kv;
pub use model::{
    Cluster, ClusterRecord, ControlError, DriveRecord, ExtentRecord, NodeRecord, OwnerRecord,
    SlabRecord, SnapshotRecord, VolumeRecord, SNAPSHOTS_MAX,
};
pub use placement::{can_place_volume, place, DriveLoad, PlacementError};
