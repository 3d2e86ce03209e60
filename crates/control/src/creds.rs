//! What the cluster keeps in etcd about its credentials (docs/adr/0013): which certificates
//! each node has used (so removing a node can revoke them by serial, which is what etcd's
//! `--client-crl-file` understands), which certificates are revoked, and the shared
//! internal token that clusters made before node certificates authenticated node-to-node
//! API calls still hold until it is retired.
//!
//! Nothing here is a secret: serial numbers and node ids only.

use crate::etcd::{Compare, Op, Txn};
use crate::kv::Kv;
use crate::model::{decode, encode, keys, Cluster, ControlError};
use converge_types::NodeId;
use serde::{Deserialize, Serialize};

/// A certificate a node presented (registered by the node at start, and by the node that
/// signs a join): `/converge/certs/<serial>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CertRecord {
    /// Lowercase hex, leading zero bytes dropped (`converge_pki::CertInfo::serial`).
    pub serial: String,
    pub node: NodeId,
    pub registered_unix: u64,
}

/// A revoked certificate: `/converge/revoked/<serial>`. Every node refuses it at every
/// handshake, and the etcd members' hosts list it in etcd's CRL file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevokedRecord {
    pub serial: String,
    /// Whose it was: "node 4", "NBD client qemu-host4", or what the operator said.
    pub subject: String,
    /// Why: "node 4 removed", "revoked by an admin", "node 4 re-joined".
    pub reason: String,
    pub revoked_unix: u64,
}

/// What the cluster refuses, as etcd holds it, and the revisions to watch each part from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RevocationState {
    pub removed: Vec<NodeId>,
    pub revoked: Vec<RevokedRecord>,
    /// Revision of the read of `/converge/removed/`.
    pub removed_revision: i64,
    /// Revision of the read of `/converge/revoked/`.
    pub revoked_revision: i64,
}

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl RevokedRecord {
    pub fn new(serial: &str, subject: &str, reason: &str) -> RevokedRecord {
        RevokedRecord {
            serial: serial.to_string(),
            subject: subject.to_string(),
            reason: reason.to_string(),
            revoked_unix: now_unix(),
        }
    }
}

pub(crate) fn revoked_key(serial: &str) -> String {
    format!("{}{serial}", keys::REVOKED)
}

fn cert_key(serial: &str) -> String {
    format!("{}{serial}", keys::CERTS)
}

/// The ops that revoke `records` (in a transaction of the caller's).
pub(crate) fn revoke_ops(records: &[RevokedRecord]) -> Result<Vec<Op>, ControlError> {
    records
        .iter()
        .map(|r| {
            let key = revoked_key(&r.serial);
            Ok(Op::Put(
                key.clone(),
                encode(&key, "revoked certificate", r)?,
                None,
            ))
        })
        .collect()
}

impl<K: Kv> Cluster<K> {
    /// Records that node `node` uses the certificate with `serial` (idempotent).
    pub async fn register_cert(&self, node: NodeId, serial: &str) -> Result<(), ControlError> {
        let key = cert_key(serial);
        if let Some(kv) = self.etcd.get(&key).await? {
            let rec: CertRecord = decode(&kv, "certificate record")?;
            if rec.node == node {
                return Ok(());
            }
        }
        let rec = CertRecord {
            serial: serial.to_string(),
            node,
            registered_unix: now_unix(),
        };
        self.etcd
            .put(&key, &encode(&key, "certificate record", &rec)?, None)
            .await?;
        Ok(())
    }

    /// The certificates node `node` was seen with (or was issued by a join).
    pub async fn certs_of(&self, node: NodeId) -> Result<Vec<CertRecord>, ControlError> {
        let (kvs, _) = self.etcd.get_prefix(keys::CERTS).await?;
        let mut out = Vec::new();
        for kv in &kvs {
            let rec: CertRecord = decode(kv, "certificate record")?;
            if rec.node == node {
                out.push(rec);
            }
        }
        Ok(out)
    }

    /// Revokes certificates: every node refuses them from its next handshake on.
    pub async fn revoke_certs(&self, records: &[RevokedRecord]) -> Result<(), ControlError> {
        if records.is_empty() {
            return Ok(());
        }
        self.etcd
            .txn(Txn {
                compare: vec![],
                success: revoke_ops(records)?,
                failure: vec![],
            })
            .await?;
        Ok(())
    }

    /// Revokes every certificate node `node` registered; what was revoked.
    pub async fn revoke_node_certs(
        &self,
        node: NodeId,
        reason: &str,
    ) -> Result<Vec<RevokedRecord>, ControlError> {
        let recs: Vec<RevokedRecord> = self
            .certs_of(node)
            .await?
            .iter()
            .map(|c| RevokedRecord::new(&c.serial, &format!("node {}", node.0), reason))
            .collect();
        self.revoke_certs(&recs).await?;
        Ok(recs)
    }

    /// The revoked certificates.
    pub async fn revoked_certs(&self) -> Result<Vec<RevokedRecord>, ControlError> {
        let (kvs, _) = self.etcd.get_prefix(keys::REVOKED).await?;
        kvs.iter()
            .map(|kv| decode(kv, "revoked certificate"))
            .collect()
    }

    /// Deletes the records of certificates that have surely expired: revocation records
    /// revoked, and certificate records first seen, more than `lifetime_s` before
    /// `now_unix` (a certificate is issued before either, and is valid for at most
    /// `lifetime_s`: past that every handshake refuses it by its date). Without this both
    /// lists grow with every node replaced, certificate renewed or client revoked, for the
    /// life of the cluster; with it they hold what was revoked or used within one
    /// certificate lifetime. Removal records (`/converge/removed/<id>`) stay: an id is never
    /// used again. Returns how many revocation and certificate records were deleted.
    pub async fn prune_expired_certs(
        &self,
        now_unix: u64,
        lifetime_s: u64,
    ) -> Result<(usize, usize), ControlError> {
        let expired = |at: u64| at.saturating_add(lifetime_s) < now_unix;
        let mut revoked = 0;
        let (kvs, _) = self.etcd.get_prefix(keys::REVOKED).await?;
        for kv in &kvs {
            let rec: RevokedRecord = decode(kv, "revoked certificate")?;
            if expired(rec.revoked_unix) {
                self.etcd.delete(&kv.key).await?;
                revoked += 1;
            }
        }
        let mut certs = 0;
        let (kvs, _) = self.etcd.get_prefix(keys::CERTS).await?;
        for kv in &kvs {
            let rec: CertRecord = decode(kv, "certificate record")?;
            if expired(rec.registered_unix) {
                self.etcd.delete(&kv.key).await?;
                certs += 1;
            }
        }
        Ok((revoked, certs))
    }

    /// Removed nodes and revoked certificates, with the revisions to watch them from.
    pub async fn revocation_state(&self) -> Result<RevocationState, ControlError> {
        let (kvs, removed_revision) = self.etcd.get_prefix(keys::REMOVED).await?;
        let removed = kvs
            .iter()
            .filter_map(|kv| kv.key.strip_prefix(keys::REMOVED)?.parse().ok())
            .map(NodeId)
            .collect();
        let (kvs, revoked_revision) = self.etcd.get_prefix(keys::REVOKED).await?;
        let revoked = kvs
            .iter()
            .map(|kv| decode(kv, "revoked certificate"))
            .collect::<Result<_, _>>()?;
        Ok(RevocationState {
            removed,
            revoked,
            removed_revision,
            revoked_revision,
        })
    }

    /// The shared internal token of a cluster made before nodes authenticated to each
    /// other's APIs with their certificates (None once retired, and in newer clusters).
    pub async fn legacy_internal_token(&self) -> Result<Option<String>, ControlError> {
        Ok(self
            .etcd
            .get(keys::INTERNAL_TOKEN)
            .await?
            .map(|kv| String::from_utf8_lossy(&kv.value).trim().to_string()))
    }

    /// Deletes the legacy internal token (`converge token revoke internal`): `false` if
    /// there was none.
    pub async fn retire_internal_token(&self) -> Result<bool, ControlError> {
        let r = self
            .etcd
            .txn(Txn {
                compare: vec![Compare::CreateRevision(keys::INTERNAL_TOKEN.to_string(), 0)],
                success: vec![],
                failure: vec![Op::Delete(keys::INTERNAL_TOKEN.to_string())],
            })
            .await?;
        Ok(!r.succeeded)
    }
}
