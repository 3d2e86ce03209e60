//! etcd's maintenance API, so the cluster keeps its own etcd bounded: each member's status
//! (revision, database size and how much of it is in use), the alarms (NOSPACE once the
//! database reached its quota), compaction of old revisions, defragmentation of one member
//! (which gives the space compaction freed back to the file system), and disarming an
//! alarm once space is back. docs/OPERATIONS.md says how converged uses them.

use super::{de_i64, Etcd, EtcdError, Inner, Request};
use serde::{Deserialize, Deserializer};
use serde_json::json;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;

/// One member's answer to a status request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberStatus {
    /// The client URL asked.
    pub endpoint: String,
    pub member_id: u64,
    /// The member the asked one follows (itself if it leads).
    pub leader_id: u64,
    /// The store revision the member has applied.
    pub revision: i64,
    /// Bytes of the member's database file.
    pub db_size_bytes: u64,
    /// Bytes of it holding live data; the rest is free pages a defragmentation gives back.
    pub db_size_in_use_bytes: u64,
    /// etcd's version string.
    pub version: String,
}

impl MemberStatus {
    pub fn is_leader(&self) -> bool {
        self.member_id != 0 && self.member_id == self.leader_id
    }

    /// Bytes a defragmentation would give back.
    pub fn reclaimable_bytes(&self) -> u64 {
        self.db_size_bytes.saturating_sub(self.db_size_in_use_bytes)
    }
}

/// What an alarm says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AlarmKind {
    /// The member's database reached its quota: etcd refuses every write but deletes until
    /// space is freed (compaction + defragmentation) and the alarm is disarmed.
    NoSpace,
    /// A member's data disagrees with the others'.
    Corrupt,
    Other(String),
}

impl AlarmKind {
    fn parse(s: &str) -> AlarmKind {
        match s {
            "NOSPACE" => AlarmKind::NoSpace,
            "CORRUPT" => AlarmKind::Corrupt,
            o => AlarmKind::Other(o.to_string()),
        }
    }

    fn wire(&self) -> &str {
        match self {
            AlarmKind::NoSpace => "NOSPACE",
            AlarmKind::Corrupt => "CORRUPT",
            AlarmKind::Other(s) => s,
        }
    }
}

/// An alarm raised by one member.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Alarm {
    pub member_id: u64,
    pub kind: AlarmKind,
}

/// etcd's ids are unsigned 64-bit numbers, which its JSON gateway prints as strings.
fn de_u64<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Num {
        S(String),
        U(u64),
    }
    match Option::<Num>::deserialize(d)? {
        None => Ok(0),
        Some(Num::U(u)) => Ok(u),
        Some(Num::S(s)) => s.parse().map_err(serde::de::Error::custom),
    }
}

#[derive(Deserialize, Default, Debug)]
struct RawMemberHeader {
    #[serde(default, deserialize_with = "de_u64")]
    member_id: u64,
    #[serde(default, deserialize_with = "de_i64")]
    revision: i64,
}

#[derive(Deserialize, Default, Debug)]
struct RawStatus {
    #[serde(default)]
    header: RawMemberHeader,
    #[serde(default)]
    version: String,
    #[serde(rename = "dbSize", default, deserialize_with = "de_i64")]
    db_size: i64,
    #[serde(rename = "dbSizeInUse", default, deserialize_with = "de_i64")]
    db_size_in_use: i64,
    #[serde(default, deserialize_with = "de_u64")]
    leader: u64,
}

#[derive(Deserialize, Default, Debug)]
struct RawAlarm {
    #[serde(rename = "memberID", default, deserialize_with = "de_u64")]
    member_id: u64,
    #[serde(default)]
    alarm: String,
}

#[derive(Deserialize, Default, Debug)]
struct RawAlarms {
    #[serde(default)]
    alarms: Vec<RawAlarm>,
}

/// How long a defragmentation (or a compaction's freeing of pages) may take: it rewrites
/// the member's whole database (seconds per GiB), during which that member answers nothing.
pub const DEFRAGMENT_TIMEOUT: Duration = Duration::from_secs(120);

impl Etcd {
    /// A client that talks to the `idx`-th endpoint only (maintenance acts on one member).
    fn only(&self, idx: usize, timeout: Duration) -> Etcd {
        let ep = self.inner.endpoints[idx].clone();
        Etcd {
            inner: Arc::new(Inner {
                endpoints: vec![ep],
                preferred: AtomicUsize::new(0),
                timeout,
                tls: self.inner.tls.clone(),
                presents_client_cert: self.inner.presents_client_cert,
                credentials: self.inner.credentials.clone(),
            }),
        }
    }

    /// Every endpoint's status, in the order the endpoints were given; an endpoint that
    /// does not answer has its error instead.
    pub async fn member_statuses(&self) -> Vec<(String, Result<MemberStatus, EtcdError>)> {
        let mut out = Vec::with_capacity(self.inner.endpoints.len());
        for idx in 0..self.inner.endpoints.len() {
            let url = self.inner.endpoints[idx].url.clone();
            let one = self.only(idx, self.inner.timeout);
            out.push((url.clone(), one.status_here(url).await));
        }
        out
    }

    async fn status_here(&self, endpoint: String) -> Result<MemberStatus, EtcdError> {
        let (_, r): (usize, RawStatus) = self
            .call("/v3/maintenance/status", &json!({}), Request::Read)
            .await?;
        Ok(MemberStatus {
            endpoint,
            member_id: r.header.member_id,
            leader_id: r.leader,
            revision: r.header.revision,
            db_size_bytes: u64::try_from(r.db_size).unwrap_or(0),
            db_size_in_use_bytes: u64::try_from(r.db_size_in_use).unwrap_or(0),
            version: r.version,
        })
    }

    /// The alarms raised in the etcd cluster (any member answers for all).
    pub async fn alarms(&self) -> Result<Vec<Alarm>, EtcdError> {
        let (_, r): (usize, RawAlarms) = self
            .call(
                "/v3/maintenance/alarm",
                &json!({ "action": "GET" }),
                Request::Read,
            )
            .await?;
        Ok(r.alarms
            .into_iter()
            .filter(|a| !a.alarm.is_empty() && a.alarm != "NONE")
            .map(|a| Alarm {
                member_id: a.member_id,
                kind: AlarmKind::parse(&a.alarm),
            })
            .collect())
    }

    /// Disarms an alarm. etcd raises NOSPACE again at the next write if space is still
    /// short, so disarming early loses nothing.
    pub async fn disarm(&self, alarm: &Alarm) -> Result<(), EtcdError> {
        self.post(
            "/v3/maintenance/alarm",
            &json!({
                "action": "DEACTIVATE",
                "memberID": alarm.member_id.to_string(),
                "alarm": alarm.kind.wire(),
            }),
            // Disarming twice is disarming once.
            Request::Read,
        )
        .await?;
        Ok(())
    }

    /// Drops every revision older than `revision` from the history (the current value of
    /// every key stays), and waits until the member answering has freed their pages. A
    /// revision already compacted is not an error: there is nothing left to do. Returns
    /// whether this call compacted anything.
    pub async fn compact(&self, revision: i64) -> Result<bool, EtcdError> {
        let r: Result<(usize, serde_json::Value), EtcdError> = self
            .with_timeout(DEFRAGMENT_TIMEOUT.max(self.inner.timeout))
            .call(
                "/v3/kv/compaction",
                &json!({ "revision": revision.to_string(), "physical": true }),
                // Compacting twice to the same revision is compacting once.
                Request::Read,
            )
            .await;
        match r {
            Ok(_) => Ok(true),
            Err(EtcdError::Server { message, .. })
                if message.contains("required revision has been compacted") =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Defragments the member at `endpoint` (one of this client's): it rewrites its
    /// database without the free pages and answers nothing meanwhile, so defragment one
    /// member at a time. Needs etcd's root role when etcd authentication is on.
    pub async fn defragment(&self, endpoint: &str) -> Result<(), EtcdError> {
        let idx = self
            .inner
            .endpoints
            .iter()
            .position(|e| e.url == endpoint)
            .ok_or_else(|| EtcdError::InvalidEndpoint {
                endpoint: endpoint.to_string(),
                reason: "it is not one of this client's endpoints".to_string(),
            })?;
        let one = self.only(idx, DEFRAGMENT_TIMEOUT.max(self.inner.timeout));
        one.post("/v3/maintenance/defragment", &json!({}), Request::Read)
            .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_and_alarms_decode_the_gateways_json() {
        let s: RawStatus = serde_json::from_str(
            r#"{"header":{"cluster_id":"9801649324762813316","member_id":"7554839495294274804",
            "revision":"446","raft_term":"2"},"version":"3.4.23","dbSize":"196608",
            "leader":"7554839495294274804","raftIndex":"473","dbSizeInUse":"65536"}"#,
        )
        .unwrap();
        assert_eq!(s.header.revision, 446);
        assert_eq!(s.db_size, 196_608);
        assert_eq!(s.db_size_in_use, 65_536);
        assert_eq!(s.leader, 7_554_839_495_294_274_804);
        // Member ids use all 64 bits.
        let a: RawAlarms = serde_json::from_str(
            r#"{"header":{},"alarms":[{"memberID":"18446744073709551615","alarm":"NOSPACE"},
            {"memberID":"3","alarm":"CORRUPT"}]}"#,
        )
        .unwrap();
        assert_eq!(a.alarms[0].member_id, u64::MAX);
        assert_eq!(AlarmKind::parse(&a.alarms[0].alarm), AlarmKind::NoSpace);
        assert_eq!(AlarmKind::parse(&a.alarms[1].alarm), AlarmKind::Corrupt);
        assert_eq!(AlarmKind::NoSpace.wire(), "NOSPACE");
        let none: RawAlarms = serde_json::from_str(r#"{"header":{}}"#).unwrap();
        assert!(none.alarms.is_empty());
    }
}
