//! API authentication: bearer tokens with roles.
//!
//! A token is `cvt.<id>.<secret>`: the id names its record in etcd
//! (`/converge/tokens/<id>`: name, role, SHA-256 of the whole token), the secret is 32
//! random bytes. The token itself is shown once, when it is made, and kept nowhere; a node
//! checks one by hashing it and comparing with the record, which it caches for
//! [`CACHE_TTL`] (so a token revoked on another node stops working there within that
//! time; on the node that revoked it, at once).
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
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a node trusts what it read of a token record.
pub const CACHE_TTL: Duration = Duration::from_secs(10);
/// Token records cached at most (a flood of invented ids cannot grow it further).
const CACHE_ENTRIES_MAX: usize = 4096;
const PREFIX: &str = "cvt";
/// What `converge token revoke` calls the legacy internal token.
pub const LEGACY_INTERNAL_ID: &str = "internal";

/// A new token and its record (the record holds only its hash).
pub fn new_token(name: &str, role: Role) -> (String, TokenRecord) {
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
        created_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
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

pub struct Auth {
    cluster: Cluster,
    /// Where the first admin token was written (for the refusal's hint).
    admin_token_file: String,
    cache: Mutex<HashMap<String, (Option<TokenRecord>, Instant)>>,
    /// The legacy internal token, as last read (and when).
    legacy: Mutex<Option<(Option<String>, Instant)>>,
}

impl Auth {
    pub fn new(cluster: Cluster, cfg: &Config) -> Auth {
        Auth {
            cluster,
            admin_token_file: cfg.admin_token_file.display().to_string(),
            cache: Mutex::new(HashMap::new()),
            legacy: Mutex::new(None),
        }
    }

    /// The shared internal token of a cluster made before node certificates authenticated
    /// node-to-node calls, while it is not retired: still sent along to the other nodes
    /// (one not upgraded yet knows nothing else) and accepted from them. Read through a
    /// cache like a token record; unreadable counts as none.
    pub async fn legacy_internal(&self) -> Option<String> {
        if let Some((t, at)) = self.legacy.lock().expect("legacy token poisoned").as_ref() {
            if at.elapsed() < CACHE_TTL {
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

    /// Forgets what it knew of token `id` (revoked here: refused from now on).
    pub fn forget(&self, id: &str) {
        self.cache.lock().expect("token cache poisoned").remove(id);
        if id == LEGACY_INTERNAL_ID {
            *self.legacy.lock().expect("legacy token poisoned") = Some((None, Instant::now()));
        }
    }

    async fn record(&self, id: &str) -> Result<Option<TokenRecord>, Denied> {
        if let Some((rec, at)) = self.cache.lock().expect("token cache poisoned").get(id) {
            if at.elapsed() < CACHE_TTL {
                return Ok(rec.clone());
            }
        }
        let rec = self.cluster.token(id).await.map_err(|e| {
            Denied::Unavailable(format!(
                "cannot check the token with the control plane: {e}"
            ))
        })?;
        let mut c = self.cache.lock().expect("token cache poisoned");
        if c.len() >= CACHE_ENTRIES_MAX {
            c.clear();
        }
        c.insert(id.to_string(), (rec.clone(), Instant::now()));
        Ok(rec)
    }

    /// Lets a request through if the bearer of `authorization` (the header's value) holds
    /// the role it needs.
    pub async fn authorize(
        &self,
        method: &hyper::Method,
        path: &str,
        authorization: Option<&str>,
        caller: Caller,
    ) -> Result<(), Denied> {
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        match required(method, &parts) {
            None => Ok(()),
            Some(needed) => allow(
                self.role(authorization, caller).await?,
                needed,
                method,
                path,
            ),
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
        if let Some(id) = token_id(token) {
            if let Some(rec) = self.record(id).await? {
                if same(hash(token).as_bytes(), rec.sha256.as_bytes()) {
                    return Ok(rec.role);
                }
            }
        }
        // A cluster made before node certificates: its nodes' shared token, until retired.
        if let Some(legacy) = self.legacy_internal().await {
            if same(token.as_bytes(), legacy.as_bytes()) {
                return Ok(Role::Admin);
            }
        }
        Err(Denied::Unauthenticated(
            "unknown or revoked token".to_string(),
        ))
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
    let (admin, rec) = new_token("bootstrap-admin", Role::Admin);
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
        let (t, rec) = new_token("ci", Role::Operator);
        assert_eq!(token_id(&t), Some(rec.id.as_str()));
        assert_eq!(hash(&t), rec.sha256);
        assert!(!rec.sha256.contains(&t[20..]));
        let (t2, _) = new_token("ci", Role::Operator);
        assert_ne!(t, t2);
        for bad in ["", "cvt", "cvt.x.y", &t[..t.len() - 1], &format!("{t}.x")] {
            assert_eq!(token_id(bad), None, "{bad}");
        }
        assert!(same(b"abc", b"abc"));
        assert!(!same(b"abc", b"abd"));
        assert!(!same(b"abc", b"ab"));
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
