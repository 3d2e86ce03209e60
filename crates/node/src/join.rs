//! Join tokens: a new host trades a one-time token for its node certificate, so its private
//! key never leaves it and nobody copies key files around (docs/SECURITY.md).
//!
//! `POST /v1/join-tokens` (admin) makes `cvj.<id>.<secret>.<CA fingerprint>` for one node
//! id and its addresses, valid for a while; etcd keeps the secret's hash. `POST /v1/join`
//! (no API token: the join token is the credential) takes the token and the host's public
//! key, uses the token up (an etcd transaction: once, whoever comes first) and answers the
//! certificate, signed by this node if it holds the cluster's CA key (where `cluster init`
//! ran). The joining host pins the CA by the fingerprint in the token, so it cannot be
//! talked into another cluster.
//!
//! An id that is in use (a live node, drives recorded for it, or a certificate registered
//! for it) is refused unless the token was made with `replace`; then the old host's
//! certificates are revoked when the new one is issued. A removed id is refused always: ids
//! are never used again. The host names are the token's: the joining host cannot choose
//! them, and names under `.converge` (another node's name) are refused.

use crate::auth::{hex, same};
use crate::node::Node;
use converge_api::{CreateJoinToken, CreatedJoinToken, JoinRequest, Joined};
use converge_control::creds::RevokedRecord;
use converge_control::model::JoinTokenRecord;
use converge_types::NodeId;
use hyper::StatusCode;
use rand::RngCore;
use sha2::{Digest, Sha256};

const PREFIX: &str = "cvj";
/// Default and longest validity of a join token.
pub const TTL_DEFAULT_S: u64 = 3600;
pub const TTL_MAX_S: u64 = 7 * 86_400;

type Failure = (StatusCode, String);

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn hash(secret: &str) -> String {
    hex(&Sha256::digest(secret.as_bytes()))
}

/// The parts of a join token: id, secret, CA fingerprint.
fn parse(token: &str) -> Option<(&str, &str, &str)> {
    let mut p = token.trim().split('.');
    match (p.next(), p.next(), p.next(), p.next(), p.next()) {
        (Some(PREFIX), Some(id), Some(secret), Some(fp), None)
            if id.len() == 16
                && secret.len() == 64
                && fp.len() == 64
                && [id, secret, fp]
                    .iter()
                    .all(|s| s.bytes().all(|b| b.is_ascii_hexdigit())) =>
        {
            Some((id, secret, fp))
        }
        _ => None,
    }
}

fn ca_fingerprint(node: &Node) -> Result<String, Failure> {
    let pem = std::fs::read(node.cfg.tls_dir.join(converge_pki::CA_CERT)).map_err(|e| {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("reading this node's CA certificate: {e}"),
        )
    })?;
    converge_pki::fingerprint_pem(&pem)
        .map_err(|e| (StatusCode::SERVICE_UNAVAILABLE, e.to_string()))
}

fn unavailable(e: converge_control::model::ControlError) -> Failure {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        format!("control plane unavailable: {e}"),
    )
}

/// Refuses node id `id` for a new host if it was removed, or if it is in use and
/// `replace` was not asked; what uses it otherwise.
async fn check_id(node: &Node, id: NodeId, replace: bool) -> Result<Option<String>, Failure> {
    if node.cluster.is_removed(id).await.map_err(unavailable)? {
        return Err((
            StatusCode::CONFLICT,
            format!(
                "node {id} was removed from this cluster; a removed id is never used again \
                 (its certificates are refused everywhere): give the new host another id"
            ),
        ));
    }
    let live = node
        .cluster
        .live_nodes()
        .await
        .map_err(unavailable)?
        .iter()
        .any(|n| n.id == id);
    let drives = node
        .cluster
        .drives()
        .await
        .map_err(unavailable)?
        .iter()
        .filter(|d| d.node == id)
        .count();
    let certs = node.cluster.certs_of(id).await.map_err(unavailable)?.len();
    let in_use = match (live, drives, certs) {
        (true, _, _) => Some(format!("node {id} is live")),
        (_, d, _) if d > 0 => Some(format!("node {id} has {d} drives in the cluster")),
        (_, _, c) if c > 0 => Some(format!("node {id} has a certificate")),
        _ => None,
    };
    match in_use {
        Some(why) if !replace => Err((
            StatusCode::CONFLICT,
            format!(
                "{why}: a join token for it would give a second host its identity. Use a new \
                 id, or `--replace` to give the id to a new host (the old host's certificates \
                 are revoked when the new one is issued)"
            ),
        )),
        other => Ok(other),
    }
}

/// `POST /v1/join-tokens`.
pub async fn create(node: &Node, req: CreateJoinToken) -> Result<CreatedJoinToken, Failure> {
    let bad = |m: String| (StatusCode::BAD_REQUEST, m);
    if req.node.0 == 0 {
        return Err(bad("node ids start at 1".into()));
    }
    if req.hosts.is_empty() {
        return Err(bad(
            "give the new node's addresses (the names and IPs clients and peers use)".into(),
        ));
    }
    // The names must be ones a certificate can carry; checked now, not at join time.
    for h in &req.hosts {
        converge_pki::check_host(h).map_err(|e| bad(e.to_string()))?;
    }
    let ttl = req.ttl_s.unwrap_or(TTL_DEFAULT_S);
    if ttl == 0 || ttl > TTL_MAX_S {
        return Err(bad(format!(
            "ttl {ttl} s: a join token lives 1 s to {TTL_MAX_S} s (7 days)"
        )));
    }
    check_id(node, req.node, req.replace).await?;
    let fp = ca_fingerprint(node)?;
    let mut id = [0u8; 8];
    let mut secret = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut id);
    rand::thread_rng().fill_bytes(&mut secret);
    let (id, secret) = (hex(&id), hex(&secret));
    let rec = JoinTokenRecord {
        id: id.clone(),
        sha256: hash(&secret),
        node: req.node,
        hosts: req.hosts.clone(),
        expires_unix: now_unix() + ttl,
        replace: req.replace,
    };
    let made = node.cluster.create_join_token(&rec).await.map_err(|e| {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("control plane unavailable: {e}"),
        )
    })?;
    if !made {
        return Err((
            StatusCode::CONFLICT,
            "join token id taken (a 1 in 2^64 chance); try again".into(),
        ));
    }
    log::info!(
        "made join token {id} for node {} at {}",
        req.node,
        req.hosts.join(", ")
    );
    Ok(CreatedJoinToken {
        token: format!("{PREFIX}.{id}.{secret}.{fp}"),
        id,
        node: req.node,
        hosts: req.hosts,
        expires_unix: rec.expires_unix,
    })
}

/// `POST /v1/join`.
pub async fn join(node: &Node, req: JoinRequest) -> Result<Joined, Failure> {
    let refused = |m: &str| (StatusCode::UNAUTHORIZED, m.to_string());
    let Some((id, secret, fp)) = parse(&req.token) else {
        return Err(refused(
            "not a join token (cvj.<id>.<secret>.<fingerprint>, from `converge node join-token`)",
        ));
    };
    if fp != ca_fingerprint(node)? {
        return Err(refused(
            "this join token is for a cluster with another CA than this node's",
        ));
    }
    let key = (|| {
        let raw: Vec<u8> = (0..req.public_key_hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(req.public_key_hex.get(i..i + 2)?, 16).ok())
            .collect::<Option<_>>()?;
        converge_pki::PublicKey::from_raw(&raw).ok()
    })()
    .ok_or_else(|| {
        (
            StatusCode::BAD_REQUEST,
            "public_key_hex: an uncompressed P-256 public key (65 bytes, hex)".to_string(),
        )
    })?;
    let Some((rec, rev)) = node.cluster.join_token(id).await.map_err(unavailable)? else {
        return Err(refused("unknown or already used join token"));
    };
    if !same(hash(secret).as_bytes(), rec.sha256.as_bytes()) {
        return Err(refused("unknown or already used join token"));
    }
    if now_unix() >= rec.expires_unix {
        return Err(refused(
            "this join token has expired; make another with `converge node join-token`",
        ));
    }
    // Only where the CA key is; checked before the token is used up.
    let ca = match converge_pki::Ca::load(&node.cfg.tls_dir) {
        Ok(ca) => ca,
        Err(e) => {
            return Err((
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "node {} cannot sign certificates ({e}); send the join to the node where \
                     `converge cluster init` ran (it holds ca.key)",
                    node.cfg.node_id
                ),
            ))
        }
    };
    // Checked again: the id may have been taken or removed since the token was made.
    let replaced = check_id(node, rec.node, rec.replace).await?;
    let clients_ca_pem =
        std::fs::read_to_string(node.cfg.tls_dir.join(converge_pki::CLIENTS_CA_CERT)).ok();
    if !node
        .cluster
        .consume_join_token(id, rev)
        .await
        .map_err(unavailable)?
    {
        return Err(refused("unknown or already used join token"));
    }
    if let Some(why) = replaced {
        // The old host's identity ends before the new one's begins.
        let gone = node
            .cluster
            .revoke_node_certs(rec.node, &format!("node {} given to a new host", rec.node))
            .await
            .map_err(unavailable)?;
        node.revocations
            .add(None, gone.iter().map(|r: &RevokedRecord| r.serial.clone()));
        log::info!(
            "join token {id} replaces node {} ({why}): revoked its certificates {:?}",
            rec.node,
            gone.iter().map(|r| &r.serial).collect::<Vec<_>>()
        );
    }
    let cert = ca
        .issue(
            &converge_pki::Subject::Node {
                id: rec.node.0,
                hosts: rec.hosts.clone(),
            },
            &key,
        )
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    // Registered at once, so that removing or replacing the node revokes it even if the
    // host never starts with it.
    let serial = converge_pki::cert_info_pem(cert.as_bytes())
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .serial;
    node.cluster
        .register_cert(rec.node, &serial)
        .await
        .map_err(unavailable)?;
    log::info!(
        "join token {id} used: certificate issued for node {} at {}",
        rec.node,
        rec.hosts.join(", ")
    );
    Ok(Joined {
        node: NodeId(rec.node.0),
        cert_pem: cert,
        ca_pem: ca.cert_pem().to_string(),
        clients_ca_pem,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn join_tokens_parse_only_in_their_shape() {
        let t = format!(
            "cvj.{}.{}.{}",
            "a".repeat(16),
            "b".repeat(64),
            "c".repeat(64)
        );
        assert!(parse(&t).is_some());
        assert!(parse(&t.replacen("cvj", "cvt", 1)).is_none());
        assert!(parse(&format!("{t}.x")).is_none());
        assert!(parse(&t.replacen('a', "g", 1)).is_none());
        assert!(parse("cvj...").is_none());
    }
}
