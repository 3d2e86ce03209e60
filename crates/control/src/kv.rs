//! The key-value operations the cluster model needs from etcd, as a trait, so the same
//! model code (and the owner's control-plane glue above it) runs against the real etcd in
//! `converged` and against the simulator's in-memory store with simulated latency and
//! partitions (docs/SIMULATION.md). Leases and watches stay on [`Etcd`] itself: only the
//! daemon uses them.

use crate::etcd::{Compare, Etcd, EtcdError, KeyValue, LeaseId, Op, Txn, TxnResponse};
use std::future::Future;

/// etcd's key-value API as the model uses it: reads of a key or a prefix, writes, and
/// transactions whose compares test mod revision, create revision or value.
pub trait Kv: Clone + Send + Sync + 'static {
    /// One key, if present.
    fn get(&self, key: &str) -> impl Future<Output = Result<Option<KeyValue>, EtcdError>> + Send;

    /// Every key with this prefix, sorted by key, and the store revision of the read.
    fn get_prefix(
        &self,
        prefix: &str,
    ) -> impl Future<Output = Result<(Vec<KeyValue>, i64), EtcdError>> + Send;

    /// Writes a key (bound to `lease` if given); returns the store revision of the write.
    fn put(
        &self,
        key: &str,
        value: &[u8],
        lease: Option<LeaseId>,
    ) -> impl Future<Output = Result<i64, EtcdError>> + Send;

    /// Deletes one key; returns how many keys were deleted (0 or 1).
    fn delete(&self, key: &str) -> impl Future<Output = Result<u64, EtcdError>> + Send;

    /// Runs a transaction atomically.
    fn txn(&self, txn: Txn) -> impl Future<Output = Result<TxnResponse, EtcdError>> + Send;

    /// Writes the key only if it is absent; true if this call created it.
    fn create(
        &self,
        key: &str,
        value: &[u8],
        lease: Option<LeaseId>,
    ) -> impl Future<Output = Result<bool, EtcdError>> + Send {
        let txn = Txn {
            compare: vec![Compare::CreateRevision(key.to_string(), 0)],
            success: vec![Op::Put(key.to_string(), value.to_vec(), lease)],
            failure: vec![],
        };
        async move { Ok(self.txn(txn).await?.succeeded) }
    }

    /// Writes the key only if its mod revision is still `expected_mod_revision` (0: absent).
    /// A key bound to a lease loses that binding; use [`Kv::txn`] to keep one.
    fn cas(
        &self,
        key: &str,
        value: &[u8],
        expected_mod_revision: i64,
    ) -> impl Future<Output = Result<bool, EtcdError>> + Send {
        let txn = Txn {
            compare: vec![Compare::ModRevision(key.to_string(), expected_mod_revision)],
            success: vec![Op::Put(key.to_string(), value.to_vec(), None)],
            failure: vec![],
        };
        async move { Ok(self.txn(txn).await?.succeeded) }
    }
}

impl Kv for Etcd {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, EtcdError> {
        Etcd::get(self, key).await
    }

    async fn get_prefix(&self, prefix: &str) -> Result<(Vec<KeyValue>, i64), EtcdError> {
        Etcd::get_prefix(self, prefix).await
    }

    async fn put(&self, key: &str, value: &[u8], lease: Option<LeaseId>) -> Result<i64, EtcdError> {
        Etcd::put(self, key, value, lease).await
    }

    async fn delete(&self, key: &str) -> Result<u64, EtcdError> {
        Etcd::delete(self, key).await
    }

    async fn txn(&self, txn: Txn) -> Result<TxnResponse, EtcdError> {
        Etcd::txn(self, txn).await
    }
}
