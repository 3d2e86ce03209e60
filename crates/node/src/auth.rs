//! API authentication: bearer tokens with roles.
//!
//! A token is `cvt.<id>.<secret>`: the id names its record in etcd
//! (`/converge/tokens/<id>`: name, role, SHA-256 of the whole token, optional expiry), the
//! secret is 32 random bytes. The token itself is shown once, when it is made, and kept
//! nowhere; a node checks one by hashing it and comparing with the record.
//!
//! A node keeps the list of token records in memory ([`TokenBook`]), read whole from etcd
//! when a token is checked and the list is older than [`CACHE_TTL`] (so a token revoked
//! on another node stops working here within that time; on the node that revoked it, at
//! once), or when an id is not in it and the list is older than [`MISS_REFRESH`] (a token
//! just made on another node). An id that names no token therefore never costs more than
//! one read of the list per `MISS_REFRESH`, shared by every request, and never displaces
//! a known token. At 1,000 nodes: one read of the list (a few hundred bytes per token) per
//! node and 10 s while its API is used.
//!
//! The nodes reach each other's APIs (a request forwarded to a volume's owner, a scrub, a
//! volume move) with their node certificates: the API's TLS asks for one, checks it
//! against the cluster CA and the revocation list, and a caller that presents one acts as
//! that node. No secret shared by the nodes is kept in etcd (docs/adr/0013). Clusters made
//! before have a shared internal token there, which is still accepted (and sent, for nodes
//! not yet upgraded) until `converge token revoke internal` retires it.
//!
//! The first node to start makes the first admin token, which it writes to its
//! `[api] admin_token_file` (mode 0600) for the operator.

use crate::config::Config;
use converge_control::model::{Cluster, TokenRecord};
use converge_types::Role;
use rand::RngCore;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Mutex, RwLock};
use std::time::{Duration, Instant};

/// How long a node trusts the token records it read.
pub const CACHE_TTL: Duration = Duration::from_secs(10);
/// How often at most an id missing from the list makes the node read the list again.
pub const MISS_REFRESH: Duration = Duration::from_secs(1);
const PREFIX: &str = "cvt";
/// What `converge token revoke` calls the legacy internal token.
pub const LEGACY_INTERNAL_ID: &str = "internal";

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A new token and its record (the record holds only its hash), refused from
/// `expires_unix` on if given.
pub fn new_token(name: &str, role: Role, expires_unix: Option<u64>) -> (String, TokenRecord) {
    let mut id = [0u8; 8];
    let mut secret = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut id);
    rand::thread_rng().fill_bytes(&mut secret);
    let id = hex(&id);
    let token = format!("{PREFIX}.{id}.{}", hex(&secret));
    let rec = TokenRecord {
        id,
        name: name.to_string(),
        role,
        sha256: hash(&token),
        created_unix: now_unix(),
        expires_unix,
    };
    (token, rec)
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn hash(token: &str) -> String {
    hex(&Sha256::digest(token.as_bytes()))
}

/// Equal, in time that does not depend on where they differ.
pub fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The id a token names, if it has a token's shape.
fn token_id(token: &str) -> Option<&str> {
    let mut parts = token.split('.');
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(PREFIX), Some(id), Some(secret), None)
            if id.len() == 16
                && secret.len() == 64
                && id.bytes().all(|c| c.is_ascii_hexdigit()) =>
        {
            Some(id)
        }
        _ => None,
    }
}

/// Why a request is not let in.
#[derive(Debug, PartialEq, Eq)]
pub enum Denied {
    /// No token, or not one this cluster knows (401).
    Unauthenticated(String),
    /// The token's role may not do this (403).
    Forbidden(String),
    /// The token could not be checked: etcd is unreachable (503).
    Unavailable(String),
}

/// Who is asking, as far as the connection says (before any token is looked at).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caller {
    /// No certificate: a person or program, with a token.
    Anonymous,
    /// Another node, by its certificate (the API's TLS checked it is the cluster CA's, names
    /// this node and is not revoked).
    Node(u32),
}

/// What let a request in.
#[derive(Debug, PartialEq, Eq)]
pub enum Granted {
    /// A valid token of a role the request needs.
    Token,
    /// Nothing: the request needs no token (the liveness probe, a join).
    Open,
}

/// The token records as last read from etcd.
#[derive(Default)]
struct TokenBook {
    records: HashMap<String, TokenRecord>,
    read_at: Option<Instant>,
}

impl TokenBook {
    fn younger_than(&self, age: Duration) -> bool {
        self.read_at.is_some_and(|t| t.elapsed() < age)
    }
}

pub struct Auth {
    cluster: Cluster,
    /// Where the first admin token was written (for the refusal's hint).
    admin_token_file: String,
    book: RwLock<TokenBook>,
    /// The legacy internal token, as last read (and when).
    legacy: Mutex<Option<(Option<String>, Instant)>>,
    /// One read of the list at a time: concurrent misses wait for it instead of reading
    /// again.
    reading: tokio::sync::Mutex<()>,
    /// [`CACHE_TTL`] and [`MISS_REFRESH`] (tests lengthen them).
    cache_ttl: Duration,
    miss_refresh: Duration,
}

impl Auth {
    pub fn new(cluster: Cluster, cfg: &Config) -> Auth {
        Auth::with_ages(
            cluster,
            cfg.admin_token_file.display().to_string(),
            CACHE_TTL,
            MISS_REFRESH,
        )
    }

    fn with_ages(
        cluster: Cluster,
        admin_token_file: String,
        cache_ttl: Duration,
        miss_refresh: Duration,
    ) -> Auth {
        Auth {
            cluster,
            admin_token_file,
            book: Default::default(),
            legacy: Mutex::new(None),
            reading: Default::default(),
            cache_ttl,
            miss_refresh,
        }
    }

    /// The shared internal token of a cluster made before node certificates authenticated
    /// node-to-node calls, while it is not retired: still sent along to the other nodes
    /// (one not upgraded yet knows nothing else) and accepted from them. Read through a
    /// cache like a token record; unreadable counts as none.
    pub async fn legacy_internal(&self) -> Option<String> {
        if let Some((t, at)) = self.legacy.lock().expect("legacy token poisoned").as_ref() {
            if at.elapsed() < self.cache_ttl {
                return t.clone();
            }
        }
        let t = match self.cluster.legacy_internal_token().await {
            Ok(t) => t,
            Err(e) => {
                log::warn!("cannot read the legacy internal token: {e}");
                return None;
            }
        };
        *self.legacy.lock().expect("legacy token poisoned") = Some((t.clone(), Instant::now()));
        t
    }

    /// Forgets token `id` (revoked here: refused from now on).
    pub fn forget(&self, id: &str) {
        self.book
            .write()
            .expect("token book poisoned")
            .records
            .remove(id);
        if id == LEGACY_INTERNAL_ID {
            *self.legacy.lock().expect("legacy token poisoned") = Some((None, Instant::now()));
        }
    }

    /// Knows a token made here from now on (before the next read of the list).
    pub fn remember(&self, rec: &TokenRecord) {
        self.book
            .write()
            .expect("token book poisoned")
            .records
            .insert(rec.id.clone(), rec.clone());
    }

    /// The record of token `id`, if there is one: from memory while the list is fresh.
    async fn record(&self, id: &str) -> Result<Option<TokenRecord>, Denied> {
        let fresh = |b: &TokenBook| match b.records.get(id) {
            Some(r) if b.younger_than(self.cache_ttl) => Some(Some(r.clone())),
            None if b.younger_than(self.miss_refresh) => Some(None),
            _ => None,
        };
        if let Some(r) = fresh(&self.book.read().expect("token book poisoned")) {
            return Ok(r);
        }
        let _reading = self.reading.lock().await;
        // Another request may have read the list meanwhile.
        if let Some(r) = fresh(&self.book.read().expect("token book poisoned")) {
            return Ok(r);
        }
        let list = self.cluster.tokens().await.map_err(|e| {
            Denied::Unavailable(format!(
                "cannot check the token with the control plane: {e}"
            ))
        })?;
        let mut b = self.book.write().expect("token book poisoned");
        b.records = list.into_iter().map(|r| (r.id.clone(), r)).collect();
        b.read_at = Some(Instant::now());
        Ok(b.records.get(id).cloned())
    }

    /// Lets a request through if the bearer of `authorization` (the header's value) holds
    /// the role it needs.
    pub async fn authorize(
        &self,
        method: &hyper::Method,
        path: &str,
        authorization: Option<&str>,
        caller: Caller,
    ) -> Result<Granted, Denied> {
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        match required(method, &parts) {
            None => Ok(Granted::Open),
            Some(needed) => {
                allow(
                    self.role(authorization, caller).await?,
                    needed,
                    method,
                    path,
                )?;
                Ok(Granted::Token)
            }
        }
    }

    /// The role of the caller: a node (by its certificate) acts for the cluster as the
    /// internal token did; anyone else is the bearer of `authorization` (the header's
    /// value).
    pub async fn role(&self, authorization: Option<&str>, caller: Caller) -> Result<Role, Denied> {
        if let Caller::Node(_) = caller {
            return Ok(Role::Admin);
        }
        let Some(value) = authorization else {
            return Err(Denied::Unauthenticated(format!(
                "this API needs a token: pass --token or set CONVERGE_TOKEN (the first admin \
                 token is in {} on the node that started the cluster; `converge token create` \
                 makes more)",
                self.admin_token_file
            )));
        };
        let token = value
            .strip_prefix("Bearer ")
            .map(str::trim)
            .ok_or_else(|| {
                Denied::Unauthenticated(
                    "the Authorization header must be `Bearer <token>`".to_string(),
                )
            })?;
        let unknown = || Denied::Unauthenticated("unknown or revoked token".to_string());
        let rec = match token_id(token) {
            Some(id) => self
                .record(id)
                .await?
                .filter(|rec| same(hash(token).as_bytes(), rec.sha256.as_bytes())),
            None => None,
        };
        let Some(rec) = rec else {
            // A cluster made before node certificates: its nodes' shared token, until
            // retired.
            if let Some(legacy) = self.legacy_internal().await {
                if same(token.as_bytes(), legacy.as_bytes()) {
                    return Ok(Role::Admin);
                }
            }
            return Err(unknown());
        };
        if let Some(at) = rec.expires_unix.filter(|at| now_unix() >= *at) {
            return Err(Denied::Unauthenticated(format!(
                "token {} ({}) expired at {at} (unix time): ask an admin for a new one \
                 (`converge token create`)",
                rec.id, rec.name
            )));
        }
        Ok(rec.role)
    }
}

/// The role a request needs; `None`: open to all (the liveness probe).
pub fn required(method: &hyper::Method, parts: &[&str]) -> Option<Role> {
    use hyper::Method;
    match (method, parts) {
        (&Method::GET, ["v1", "health"]) => None,
        // The join token in the body is the credential (join.rs).
        (&Method::POST, ["v1", "join"]) => None,
        (_, ["v1", "tokens", ..])
        | (_, ["v1", "join-tokens", ..])
        | (_, ["v1", "certs", ..])
        | (_, ["v1", "lab", ..]) => Some(Role::Admin),
        (&Method::GET, _) => Some(Role::ReadOnly),
        (&Method::DELETE, ["v1", "volumes", ..])
        | (&Method::POST, ["v1", "settings"])
        | (&Method::POST, ["v1", "volumes", _, "rekey"])
        | (&Method::POST, ["v1", "volumes", _, "snapshots", _, "rollback"])
        | (&Method::POST, ["v1", "nodes", _, "drain"])
        | (&Method::DELETE, ["v1", "nodes", _]) => Some(Role::Admin),
        _ => Some(Role::Operator),
    }
}

/// Checks `role` against what the request needs.
pub fn allow(role: Role, needed: Role, method: &hyper::Method, path: &str) -> Result<(), Denied> {
    if role >= needed {
        Ok(())
    } else {
        Err(Denied::Forbidden(format!(
            "a {role} token may not {method} {path}: that needs {needed}"
        )))
    }
}

/// Makes the cluster's first admin token if no node has: it goes to
/// `cfg.admin_token_file` (0600), written before it is registered so it is never
/// registered and lost. A cluster made before this version (it has the legacy internal
/// token) had its first admin token made then.
pub async fn bootstrap(cluster: &Cluster, cfg: &Config) -> anyhow::Result<()> {
    use anyhow::Context;
    let (admin, rec) = new_token("bootstrap-admin", Role::Admin, None);
    let path = &cfg.admin_token_file;
    // Its own temporary file: the lab's nodes share one admin_token_file and start at once.
    let tmp = path.with_extension(format!("token.{}-{}.new", std::process::id(), rec.id));
    write_private(&tmp, &admin)
        .with_context(|| format!("writing the first admin token to {}", tmp.display()))?;
    let won = cluster.bootstrap_tokens(&rec).await;
    match won {
        Ok(true) => {
            std::fs::rename(&tmp, path)
                .with_context(|| format!("moving the admin token to {}", path.display()))?;
            log::info!(
                "made the cluster's first admin token: {} (keep it safe; `converge token` makes more)",
                path.display()
            );
            Ok(())
        }
        Ok(false) => {
            let _ = std::fs::remove_file(&tmp);
            Ok(())
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(anyhow::anyhow!("registering the first admin token: {e}"))
        }
    }
}

fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    writeln!(f, "{text}")?;
    f.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::Method;

    #[test]
    fn tokens_have_a_checkable_shape_and_their_hash_is_not_them() {
        let (t, rec) = new_token("ci", Role::Operator, None);
        assert_eq!(token_id(&t), Some(rec.id.as_str()));
        assert_eq!(hash(&t), rec.sha256);
        assert!(!rec.sha256.contains(&t[20..]));
        let (t2, _) = new_token("ci", Role::Operator, None);
        assert_ne!(t, t2);
        for bad in ["", "cvt", "cvt.x.y", &t[..t.len() - 1], &format!("{t}.x")] {
            assert_eq!(token_id(bad), None, "{bad}");
        }
        assert!(same(b"abc", b"abc"));
        assert!(!same(b"abc", b"abd"));
        assert!(!same(b"abc", b"ab"));
    }

    /// Invented token ids cost no etcd read and displace no known token (before, each one
    /// was an etcd read, and 4,096 of them cleared the cache, so known tokens needed etcd
    /// again); an expired token is refused, saying so.
    #[tokio::test]
    async fn invented_ids_neither_read_etcd_nor_evict_known_tokens_and_expiry_holds() {
        let mut srv = converge_control::testing::EtcdServer::start();
        let cluster = Cluster::new(srv.client());
        let auth = Auth::with_ages(
            cluster.clone(),
            "admin.token".into(),
            Duration::from_secs(3600),
            Duration::from_secs(3600),
        );
        let bearer = |t: &str| format!("Bearer {t}");
        let (known, rec) = new_token("ci", Role::Operator, None);
        assert!(cluster.create_token(&rec).await.unwrap());
        let (old, rec) = new_token("old", Role::Admin, Some(now_unix() - 1));
        assert!(cluster.create_token(&rec).await.unwrap());
        let (later, rec) = new_token("later", Role::ReadOnly, Some(now_unix() + 3600));
        assert!(cluster.create_token(&rec).await.unwrap());
        assert_eq!(
            auth.role(Some(&bearer(&known)), Caller::Anonymous).await,
            Ok(Role::Operator)
        );
        assert_eq!(
            auth.role(Some(&bearer(&later)), Caller::Anonymous).await,
            Ok(Role::ReadOnly)
        );
        match auth.role(Some(&bearer(&old)), Caller::Anonymous).await {
            Err(Denied::Unauthenticated(m)) => assert!(m.contains("expired"), "{m}"),
            other => panic!("an expired token: {other:?}"),
        }
        // A flood of invented ids, more than the old cache held.
        for _ in 0..5000 {
            let (t, _) = new_token("x", Role::Admin, None);
            assert!(matches!(
                auth.role(Some(&bearer(&t)), Caller::Anonymous).await,
                Err(Denied::Unauthenticated(_))
            ));
        }
        // With etcd gone, the known token still works and invented ids are still refused
        // as unknown: neither needed etcd.
        srv.stop();
        assert_eq!(
            auth.role(Some(&bearer(&known)), Caller::Anonymous).await,
            Ok(Role::Operator)
        );
        let (t, _) = new_token("y", Role::Admin, None);
        assert!(matches!(
            auth.role(Some(&bearer(&t)), Caller::Anonymous).await,
            Err(Denied::Unauthenticated(_))
        ));
    }

    #[test]
    fn each_route_needs_its_role() {
        let need = |m: &Method, p: &str| required(m, &p.split('/').collect::<Vec<_>>());
        assert_eq!(need(&Method::GET, "v1/health"), None);
        assert_eq!(need(&Method::POST, "v1/join"), None);
        assert_eq!(need(&Method::POST, "v1/join-tokens"), Some(Role::Admin));
        assert_eq!(need(&Method::GET, "v1/join"), Some(Role::ReadOnly));
        assert_eq!(need(&Method::GET, "v1/status"), Some(Role::ReadOnly));
        assert_eq!(need(&Method::GET, "metrics"), Some(Role::ReadOnly));
        assert_eq!(need(&Method::POST, "v1/volumes"), Some(Role::Operator));
        assert_eq!(
            need(&Method::POST, "v1/volumes/a/resize"),
            Some(Role::Operator)
        );
        assert_eq!(need(&Method::POST, "v1/fleet/run"), Some(Role::Operator));
        assert_eq!(need(&Method::DELETE, "v1/volumes/a"), Some(Role::Admin));
        assert_eq!(need(&Method::POST, "v1/settings"), Some(Role::Admin));
        assert_eq!(need(&Method::POST, "v1/volumes/a/rekey"), Some(Role::Admin));
        assert_eq!(need(&Method::POST, "v1/nodes/3/drain"), Some(Role::Admin));
        assert_eq!(need(&Method::DELETE, "v1/nodes/3"), Some(Role::Admin));
        assert_eq!(
            need(&Method::POST, "v1/nodes/3/maintenance"),
            Some(Role::Operator)
        );
        assert_eq!(need(&Method::GET, "v1/tokens"), Some(Role::Admin));
        assert_eq!(
            need(&Method::GET, "v1/lab/blocks/sample"),
            Some(Role::Admin)
        );
        assert!(allow(Role::Admin, Role::Operator, &Method::POST, "/x").is_ok());
        assert!(matches!(
            allow(Role::ReadOnly, Role::Operator, &Method::POST, "/v1/volumes"),
            Err(Denied::Forbidden(m)) if m.contains("read-only") && m.contains("operator")
        ));
    }
}
