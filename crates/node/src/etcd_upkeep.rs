//! Keeps the cluster's etcd bounded whatever flags it was started with: etcd keeps every
//! revision of every key until something compacts them, and a compacted database keeps its
//! size on disk until it is defragmented; past its quota it raises NOSPACE and refuses every
//! write (no slab allocation, no copy marked stale, no failover). The leader, every
//! `etcd_upkeep_s`:
//! * compacts the history older than `etcd_history_s` (etcd's own `--auto-compaction-*`
//!   does the same where it is set; compacting twice is harmless);
//! * defragments one member whose file is mostly free pages (followers first, so the leader's
//!   pause comes last);
//! * on a NOSPACE alarm: compacts all history, defragments every member one at a time and
//!   disarms the alarm, so the cluster recovers by itself once deletes (a volume deleted,
//!   an operator's cleanup) or compaction made room; etcd raises the alarm again at the next
//!   write if there is still none.
//!
//! Cost per round: one status request per member, one alarm list, at most one compaction and
//! one defragmentation — the same at 3 nodes and at 1,000 (docs/SCALE.md).
//!
//! Once a day the leader also deletes the records of certificates that have expired
//! ([`prune_certs`]), so the revocation list and the certificate registry do not grow for
//! the life of the cluster.

use crate::node::Node;
use converge_control::etcd::{AlarmKind, Etcd, EtcdError, MemberStatus};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `status` warns once a member's database passes this share of the quota (%).
const QUOTA_WARN_PCT: u64 = 80;
/// After a NOSPACE, the alarm is disarmed once every member's live data is below this share
/// of the quota (%), so the cluster does not flap between full and not.
const QUOTA_ROOM_PCT: u64 = 90;

/// A member is defragmented once at least this many bytes of its file are free pages...
const DEFRAG_RECLAIMABLE_MIN_BYTES: u64 = 64 << 20;
/// ...and they are at least this share of the file (%).
const DEFRAG_RECLAIMABLE_MIN_PCT: u64 = 50;

/// What the leader remembers between rounds.
struct Upkeep {
    /// (when, store revision then), oldest first, spanning at least the history kept.
    seen: VecDeque<(Instant, i64)>,
    /// The revision this node last compacted to.
    compacted: i64,
    /// etcd's space quota (`[etcd] quota`).
    quota_bytes: u64,
}

/// The leader's etcd upkeep loop (see the module docs).
pub async fn run(node: Arc<Node>) {
    let every = Duration::from_secs(node.cfg.knobs.etcd_upkeep_s.max(1));
    let history = Duration::from_secs(node.cfg.knobs.etcd_history_s.max(1));
    let mut u = Upkeep {
        seen: VecDeque::new(),
        compacted: 0,
        quota_bytes: node.cfg.etcd_quota_bytes,
    };
    let mut pruned_at: Option<Instant> = None;
    loop {
        tokio::time::sleep(every).await;
        if !crate::repair::is_leader(&node).await {
            u.seen.clear();
            continue;
        }
        round(node.cluster.etcd(), &mut u, history).await;
        if pruned_at.is_none_or(|t| t.elapsed() >= PRUNE_EVERY) {
            pruned_at = Some(Instant::now());
            prune_certs(&node).await;
        }
    }
}

/// How often the leader deletes the records of expired certificates.
const PRUNE_EVERY: Duration = Duration::from_secs(86_400);

/// Deletes revocation and certificate records of certificates that have surely expired
/// (`Cluster::prune_expired_certs`): the longest a certificate converge issues lives, and a
/// day for clocks that disagree. Once a day: two prefix reads (about one record per node
/// and per revoked certificate) and a delete per expired record.
async fn prune_certs(node: &Node) {
    let days = converge_pki::NODE_DAYS.max(converge_pki::CLIENT_DAYS) + 1;
    let lifetime = u64::try_from(days).unwrap_or(0) * 86_400;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    match node.cluster.prune_expired_certs(now, lifetime).await {
        Ok((0, 0)) => {}
        Ok((revoked, certs)) => log::info!(
            "deleted the records of expired certificates: {revoked} revocations, {certs} \
             certificates seen (all older than {days} days)"
        ),
        Err(e) => log::warn!("deleting the records of expired certificates: {e}"),
    }
}

async fn round(etcd: &Etcd, u: &mut Upkeep, history: Duration) {
    let members: Vec<MemberStatus> = etcd
        .member_statuses()
        .await
        .into_iter()
        .filter_map(|(ep, r)| match r {
            Ok(s) => Some(s),
            Err(e) => {
                log::debug!("etcd upkeep: status of {ep}: {e}");
                None
            }
        })
        .collect();
    let Some(revision) = members.iter().map(|m| m.revision).max() else {
        return;
    };
    let no_space = match etcd.alarms().await {
        Ok(a) => a
            .into_iter()
            .filter(|a| a.kind == AlarmKind::NoSpace)
            .collect(),
        Err(e) => {
            log::debug!("etcd upkeep: listing alarms: {e}");
            Vec::new()
        }
    };
    if !no_space.is_empty() {
        recover_space(etcd, &members, revision).await;
        u.compacted = u.compacted.max(revision);
        let in_use = etcd
            .member_statuses()
            .await
            .into_iter()
            .filter_map(|(_, r)| r.ok())
            .map(|m| m.db_size_in_use_bytes)
            .max()
            .unwrap_or(u64::MAX);
        if in_use.saturating_mul(100) >= u.quota_bytes.saturating_mul(QUOTA_ROOM_PCT) {
            log::error!(
                "etcd upkeep: etcd is still out of space after compaction and \
                 defragmentation: {} MiB of live data against a quota of {} MiB; delete \
                 what is not needed (volumes, snapshots) or raise etcd's \
                 --quota-backend-bytes and [etcd] quota (docs/OPERATIONS.md)",
                in_use >> 20,
                u.quota_bytes >> 20
            );
            return;
        }
        for a in &no_space {
            match etcd.disarm(a).await {
                Ok(()) => log::warn!(
                    "etcd upkeep: disarmed the NOSPACE alarm of member {:x}; etcd raises it \
                     again at the next write if there is still no room",
                    a.member_id
                ),
                Err(e) => log::error!("etcd upkeep: disarming NOSPACE: {e}"),
            }
        }
        return;
    }
    let now = Instant::now();
    u.seen.push_back((now, revision));
    // The newest revision seen at least `history` ago is the oldest one kept.
    let mut target = None;
    while let Some(&(at, rev)) = u.seen.front() {
        if now.duration_since(at) < history {
            break;
        }
        target = Some(rev);
        u.seen.pop_front();
    }
    if let Some(rev) = target.filter(|r| *r > u.compacted) {
        match etcd.compact(rev).await {
            Ok(_) => {
                log::debug!("etcd upkeep: compacted history before revision {rev}");
                u.compacted = rev;
            }
            Err(e) => log::warn!("etcd upkeep: compacting to revision {rev}: {e}"),
        }
    }
    if let Some(m) = defrag_candidate(&members) {
        defragment(etcd, m, "its file is mostly free pages").await;
    }
}

/// The member to defragment this round, if any: one whose file is mostly free pages,
/// followers before the leader.
fn defrag_candidate(members: &[MemberStatus]) -> Option<&MemberStatus> {
    members
        .iter()
        .filter(|m| {
            let free = m.reclaimable_bytes();
            free >= DEFRAG_RECLAIMABLE_MIN_BYTES
                && free * 100 >= m.db_size_bytes * DEFRAG_RECLAIMABLE_MIN_PCT
        })
        .min_by_key(|m| (m.is_leader(), std::cmp::Reverse(m.reclaimable_bytes())))
}

/// NOSPACE: every revision but the current one goes, then every member gives its free pages
/// back, one at a time (followers first).
async fn recover_space(etcd: &Etcd, members: &[MemberStatus], revision: i64) {
    log::warn!(
        "etcd upkeep: etcd is out of space (NOSPACE alarm); compacting all history and \
         defragmenting its members"
    );
    if let Err(e) = etcd.compact(revision).await {
        log::warn!("etcd upkeep: compacting to revision {revision}: {e}");
    }
    let mut order: Vec<&MemberStatus> = members.iter().collect();
    order.sort_by_key(|m| m.is_leader());
    for m in order {
        defragment(etcd, m, "etcd is out of space").await;
    }
}

async fn defragment(etcd: &Etcd, m: &MemberStatus, why: &str) {
    let started = Instant::now();
    match etcd.defragment(&m.endpoint).await {
        Ok(()) => log::info!(
            "etcd upkeep: defragmented {} ({why}: {} MiB of {} MiB free) in {:.1} s",
            m.endpoint,
            m.reclaimable_bytes() >> 20,
            m.db_size_bytes >> 20,
            started.elapsed().as_secs_f64()
        ),
        Err(e @ EtcdError::Server { .. }) if format!("{e}").contains("permission denied") => {
            log::error!(
                "etcd upkeep: defragmenting {} was refused ({e}): with etcd authentication \
                 on, defragmentation needs the root role; run `etcdctl defrag` on each \
                 member yourself (docs/OPERATIONS.md)",
                m.endpoint
            )
        }
        Err(e) => log::warn!("etcd upkeep: defragmenting {}: {e}", m.endpoint),
    }
}

/// etcd as `status` sees it.
pub struct Observed {
    pub info: converge_api::EtcdInfo,
    /// What makes the cluster unhealthy: a NOSPACE alarm (etcd takes no writes).
    pub problems: Vec<String>,
    /// What may: a member that does not answer, a database near its quota.
    pub warnings: Vec<String>,
}

/// etcd as `status` shows it (see [`Observed`]). One status request per member and one
/// alarm list, on demand.
pub async fn observe(etcd: &Etcd, quota_bytes: u64) -> Observed {
    let members: Vec<converge_api::EtcdMember> = etcd
        .member_statuses()
        .await
        .into_iter()
        .map(|(endpoint, r)| match r {
            Ok(m) => converge_api::EtcdMember {
                endpoint,
                id: Some(format!("{:x}", m.member_id)),
                leader: m.is_leader(),
                revision: m.revision,
                db_size_bytes: m.db_size_bytes,
                db_in_use_bytes: m.db_size_in_use_bytes,
                version: m.version,
                error: None,
            },
            Err(e) => converge_api::EtcdMember {
                endpoint,
                error: Some(e.to_string()),
                ..Default::default()
            },
        })
        .collect();
    let mut problems = Vec::new();
    let alarms = match etcd.alarms().await {
        Ok(a) => a,
        Err(e) => {
            log::debug!("status: listing etcd's alarms: {e}");
            Vec::new()
        }
    };
    let no_space: Vec<String> = alarms
        .iter()
        .filter(|a| a.kind == AlarmKind::NoSpace)
        .map(|a| format!("{:x}", a.member_id))
        .collect();
    if !no_space.is_empty() {
        problems.push(format!(
            "etcd out of space (NOSPACE on member {}): it takes no writes, so no new slab can \
             be allocated, no copy marked stale and no volume fail over; the leader compacts \
             and defragments etcd and disarms the alarm once there is room \
             (docs/OPERATIONS.md, \"etcd out of space\")",
            no_space.join(", ")
        ));
    }
    let silent: Vec<&str> = members
        .iter()
        .filter(|m| m.error.is_some())
        .map(|m| m.endpoint.as_str())
        .collect();
    // A warning, not a degradation: the data keeps every copy and the cluster works on
    // with a quorum of the others (a rolling restart of the nodes may go on), but etcd has
    // one fault less to spare.
    let mut warnings: Vec<String> = Vec::new();
    if !silent.is_empty() {
        warnings.push(format!(
            "etcd members not answering: {} (etcd works on while a majority answers; bring \
             them back or replace them: docs/DEPLOY.md)",
            silent.join(", ")
        ));
    }
    warnings.extend(
        members
            .iter()
            .filter(|m| {
                m.db_size_bytes.saturating_mul(100) >= quota_bytes.saturating_mul(QUOTA_WARN_PCT)
            })
            .map(|m| {
                format!(
                    "etcd member {} holds {} ({} of it live data), {}% of its {} quota: past the \
                 quota etcd refuses every write (docs/OPERATIONS.md, \"etcd out of space\")",
                    m.endpoint,
                    converge_types::format_size(m.db_size_bytes),
                    converge_types::format_size(m.db_in_use_bytes),
                    m.db_size_bytes * 100 / quota_bytes.max(1),
                    converge_types::format_size(quota_bytes)
                )
            }),
    );
    let info = converge_api::EtcdInfo {
        members,
        alarms: alarms
            .iter()
            .map(|a| {
                let kind = match &a.kind {
                    AlarmKind::NoSpace => "NOSPACE".to_string(),
                    AlarmKind::Corrupt => "CORRUPT".to_string(),
                    AlarmKind::Other(o) => o.clone(),
                };
                format!("{kind} on member {:x}", a.member_id)
            })
            .collect(),
    };
    Observed {
        info,
        problems,
        warnings,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: u64, leader: u64, size_mib: u64, in_use_mib: u64) -> MemberStatus {
        MemberStatus {
            endpoint: format!("https://10.0.0.{id}:2379"),
            member_id: id,
            leader_id: leader,
            revision: 7,
            db_size_bytes: size_mib << 20,
            db_size_in_use_bytes: in_use_mib << 20,
            version: "3.4.23".into(),
        }
    }

    #[test]
    fn only_a_file_mostly_free_is_defragmented_and_the_leader_last() {
        // Small or mostly in use: left alone.
        assert!(defrag_candidate(&[member(1, 1, 100, 60), member(2, 1, 60, 10)]).is_none());
        // Two candidates: the follower goes first even with less to give back.
        let ms = [member(1, 1, 400, 10), member(2, 1, 200, 50)];
        assert_eq!(defrag_candidate(&ms).map(|m| m.member_id), Some(2));
        // Among followers, the one with most to give back.
        let ms = [
            member(1, 1, 400, 10),
            member(2, 1, 200, 50),
            member(3, 1, 300, 10),
        ];
        assert_eq!(defrag_candidate(&ms).map(|m| m.member_id), Some(3));
        // The leader alone qualifies: it is defragmented.
        assert_eq!(
            defrag_candidate(&[member(1, 1, 400, 10)]).map(|m| m.member_id),
            Some(1)
        );
    }
}
