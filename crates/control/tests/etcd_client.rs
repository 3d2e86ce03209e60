//! The etcd client against a real etcd: kv, transactions, leases, watches, failures.
#![allow(clippy::unwrap_used)] // tests: a failed step is the failure we want to see

use converge_control::etcd::{Compare, Etcd, EtcdError, EventKind, Op, Txn};
use converge_control::testing::{unused_endpoint, EtcdServer};
use std::time::Duration;

#[tokio::test]
async fn kv_put_get_prefix_delete() {
    let srv = EtcdServer::start();
    let etcd = srv.client();
    assert_eq!(etcd.get("/t/a").await.unwrap(), None);
    let r1 = etcd.put("/t/a", b"1", None).await.unwrap();
    let r2 = etcd.put("/t/b", b"2", None).await.unwrap();
    etcd.put("/t0", b"outside", None).await.unwrap();
    etcd.put("/u/a", b"outside", None).await.unwrap();
    assert!(r2 > r1 && r1 > 0);
    let a = etcd.get("/t/a").await.unwrap().unwrap();
    assert_eq!((a.key.as_str(), a.value.as_slice()), ("/t/a", &b"1"[..]));
    assert_eq!((a.create_revision, a.mod_revision, a.lease), (r1, r1, 0));

    let r3 = etcd.put("/t/a", b"one", None).await.unwrap();
    let a = etcd.get("/t/a").await.unwrap().unwrap();
    assert_eq!((a.create_revision, a.mod_revision), (r1, r3));
    // Binary values survive.
    let bin: Vec<u8> = (0..=255).collect();
    etcd.put("/t/bin", &bin, None).await.unwrap();
    assert_eq!(etcd.get("/t/bin").await.unwrap().unwrap().value, bin);

    let (kvs, rev) = etcd.get_prefix("/t/").await.unwrap();
    let keys: Vec<&str> = kvs.iter().map(|k| k.key.as_str()).collect();
    assert_eq!(keys, ["/t/a", "/t/b", "/t/bin"]);
    assert!(rev >= r3);

    assert_eq!(etcd.delete("/t/a").await.unwrap(), 1);
    assert_eq!(etcd.delete("/t/a").await.unwrap(), 0);
    assert_eq!(etcd.delete_prefix("/t/").await.unwrap(), 2);
    assert!(etcd.get_prefix("/t/").await.unwrap().0.is_empty());
    assert!(
        etcd.get("/t0").await.unwrap().is_some(),
        "prefix /t/ must not delete /t0"
    );
    assert!(etcd.get("/u/a").await.unwrap().is_some());
}

#[tokio::test]
async fn txn_compares_and_branches() {
    let srv = EtcdServer::start();
    let etcd = srv.client();
    let rev = etcd.put("/k", b"v1", None).await.unwrap();

    // Value compare holds: success branch with a get.
    let r = etcd
        .txn(Txn {
            compare: vec![Compare::Value("/k".into(), b"v1".to_vec())],
            success: vec![
                Op::Put("/k2".into(), b"x".to_vec(), None),
                Op::Get("/k".into()),
            ],
            failure: vec![],
        })
        .await
        .unwrap();
    assert!(r.succeeded);
    assert_eq!(r.gets.len(), 1);
    assert_eq!(r.gets[0].as_ref().unwrap().value, b"v1");
    assert!(r.revision > rev);

    // Stale mod revision: failure branch runs, gets report absent keys as None.
    etcd.put("/k", b"v2", None).await.unwrap();
    let r = etcd
        .txn(Txn {
            compare: vec![Compare::ModRevision("/k".into(), rev)],
            success: vec![Op::Delete("/k".into())],
            failure: vec![Op::Get("/k".into()), Op::Get("/absent".into())],
        })
        .await
        .unwrap();
    assert!(!r.succeeded);
    assert_eq!(r.gets[0].as_ref().unwrap().value, b"v2");
    assert_eq!(r.gets[1], None);
    assert!(
        etcd.get("/k").await.unwrap().is_some(),
        "success branch must not run"
    );

    // Value compare on an absent key fails; CreateRevision 0 holds for it.
    let r = etcd
        .txn(Txn {
            compare: vec![Compare::Value("/absent".into(), vec![])],
            success: vec![],
            failure: vec![],
        })
        .await
        .unwrap();
    assert!(!r.succeeded);
    let r = etcd
        .txn(Txn {
            compare: vec![Compare::CreateRevision("/absent".into(), 0)],
            success: vec![Op::DeletePrefix("/k".into())],
            failure: vec![],
        })
        .await
        .unwrap();
    assert!(r.succeeded);
    assert!(etcd.get("/k").await.unwrap().is_none());
    assert!(etcd.get("/k2").await.unwrap().is_none());
}

#[tokio::test]
async fn concurrent_create_has_one_winner_and_cas_detects_staleness() {
    let srv = EtcdServer::start();
    let etcd = srv.client();
    let mut tasks = Vec::new();
    for i in 0..24u32 {
        let etcd = etcd.clone();
        tasks.push(tokio::spawn(async move {
            let won = etcd
                .create("/race", i.to_string().as_bytes(), None)
                .await
                .unwrap();
            (i, won)
        }));
    }
    let mut winners = Vec::new();
    for t in tasks {
        let (i, won) = t.await.unwrap();
        if won {
            winners.push(i);
        }
    }
    assert_eq!(winners.len(), 1, "exactly one create wins: {winners:?}");
    let kv = etcd.get("/race").await.unwrap().unwrap();
    assert_eq!(kv.value, winners[0].to_string().as_bytes());

    assert!(etcd.cas("/race", b"new", kv.mod_revision).await.unwrap());
    assert!(
        !etcd.cas("/race", b"newer", kv.mod_revision).await.unwrap(),
        "a stale revision must lose"
    );
    assert_eq!(etcd.get("/race").await.unwrap().unwrap().value, b"new");
    assert!(
        etcd.cas("/fresh", b"x", 0).await.unwrap(),
        "revision 0 = absent"
    );
    assert!(!etcd.cas("/fresh", b"y", 0).await.unwrap());
}

#[tokio::test]
async fn lease_keeps_key_alive_then_expires() {
    let srv = EtcdServer::start();
    let etcd = srv.client();
    let lease = etcd.lease_grant(2).await.unwrap();
    etcd.put("/live", b"x", Some(lease)).await.unwrap();
    assert_eq!(etcd.get("/live").await.unwrap().unwrap().lease, lease.0);
    assert!(etcd.create("/live2", b"x", Some(lease)).await.unwrap());
    assert!(etcd.lease_keepalive(lease).await.unwrap() > 0);

    // Without keepalives the keys vanish. Bounded wait, no timing assertion.
    let mut gone = false;
    for _ in 0..300 {
        if etcd.get("/live").await.unwrap().is_none() {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(gone, "a key bound to an expired lease must vanish");
    assert!(etcd.get("/live2").await.unwrap().is_none());
    assert_eq!(etcd.lease_keepalive(lease).await.unwrap(), 0, "expired");
    // Putting with an expired lease is refused with etcd's reason.
    let e = etcd.put("/k", b"x", Some(lease)).await.unwrap_err();
    assert!(e.to_string().contains("lease not found"), "{e}");

    // Revoke deletes at once and is idempotent.
    let l2 = etcd.lease_grant(60).await.unwrap();
    etcd.put("/r", b"x", Some(l2)).await.unwrap();
    etcd.lease_revoke(l2).await.unwrap();
    assert!(etcd.get("/r").await.unwrap().is_none());
    etcd.lease_revoke(l2).await.unwrap();
}

#[tokio::test]
async fn lease_keepalive_extends_past_ttl() {
    let srv = EtcdServer::start();
    let etcd = srv.client();
    let lease = etcd.lease_grant(2).await.unwrap();
    etcd.put("/kept", b"x", Some(lease)).await.unwrap();
    // Keep it alive for longer than its TTL; it must survive throughout.
    for _ in 0..8 {
        assert!(etcd.lease_keepalive(lease).await.unwrap() > 0);
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(etcd.get("/kept").await.unwrap().is_some());
    }
}

#[tokio::test]
async fn watch_reports_puts_and_deletes_under_prefix() {
    let srv = EtcdServer::start();
    let etcd = srv.client();
    let before = etcd.put("/w/old", b"0", None).await.unwrap();
    let mut w = etcd.watch_prefix("/w/", 0).await.unwrap();
    etcd.put("/other", b"x", None).await.unwrap();
    etcd.put("/w0", b"x", None).await.unwrap();
    let put_rev = etcd.put("/w/a", b"1", None).await.unwrap();
    etcd.delete("/w/a").await.unwrap();

    let mut events = Vec::new();
    while events.len() < 2 {
        let batch = tokio::time::timeout(Duration::from_secs(30), w.next())
            .await
            .expect("watch events arrive")
            .unwrap();
        assert!(!batch.is_empty());
        events.extend(batch);
    }
    assert_eq!(events.len(), 2, "{events:?}");
    assert_eq!(events[0].kind, EventKind::Put);
    assert_eq!(events[0].kv.key, "/w/a");
    assert_eq!(events[0].kv.value, b"1");
    assert_eq!(events[0].kv.mod_revision, put_rev);
    assert_eq!(events[1].kind, EventKind::Delete);
    assert_eq!(events[1].kv.key, "/w/a");
    assert!(w.revision() > put_rev);

    // From a past revision, history is replayed.
    let mut w2 = etcd.watch_prefix("/w/", before).await.unwrap();
    let mut replay = Vec::new();
    while replay.len() < 3 {
        replay.extend(
            tokio::time::timeout(Duration::from_secs(30), w2.next())
                .await
                .expect("replayed events arrive")
                .unwrap(),
        );
    }
    let kinds: Vec<(EventKind, &str)> =
        replay.iter().map(|e| (e.kind, e.kv.key.as_str())).collect();
    assert_eq!(
        kinds,
        [
            (EventKind::Put, "/w/old"),
            (EventKind::Put, "/w/a"),
            (EventKind::Delete, "/w/a")
        ]
    );
}

#[tokio::test]
async fn watch_ends_with_an_error_when_etcd_dies() {
    let mut srv = EtcdServer::start();
    let etcd = srv.client();
    let mut w = etcd.watch_prefix("/w/", 0).await.unwrap();
    srv.stop();
    let r = tokio::time::timeout(Duration::from_secs(30), w.next())
        .await
        .expect("a dead etcd ends the watch");
    let e = r.unwrap_err();
    assert!(matches!(e, EtcdError::WatchClosed { .. }), "{e}");
    assert!(e.to_string().contains(&srv.endpoint), "{e}");
}

#[tokio::test]
async fn unreachable_etcd_names_the_endpoint() {
    let dead = unused_endpoint();
    let etcd = Etcd::new(vec![dead.clone()]).unwrap();
    let e = etcd.get("/x").await.unwrap_err();
    assert!(matches!(e, EtcdError::Unreachable { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.starts_with(&format!("etcd at {dead} is unreachable: ")),
        "{msg}"
    );
    assert!(msg.to_lowercase().contains("connection refused"), "{msg}");
    assert!(msg.ends_with("is etcd running?"), "{msg}");
    assert!(etcd.watch_prefix("/x", 0).await.is_err());
    assert!(etcd.lease_grant(5).await.is_err());
}

#[tokio::test]
async fn fails_over_to_the_next_endpoint() {
    let srv = EtcdServer::start();
    let etcd = Etcd::new(vec![unused_endpoint(), srv.endpoint.clone()]).unwrap();
    etcd.put("/f", b"1", None).await.unwrap();
    assert_eq!(etcd.get("/f").await.unwrap().unwrap().value, b"1");
    let mut w = etcd.watch_prefix("/f", 0).await.unwrap();
    etcd.put("/f", b"2", None).await.unwrap();
    let ev = tokio::time::timeout(Duration::from_secs(30), w.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ev[0].kv.value, b"2");
}

#[tokio::test]
async fn invalid_endpoints_are_refused_up_front() {
    // https needs a CA (Etcd::with_security): there are no system roots to fall back on.
    let e = Etcd::new(vec!["https://127.0.0.1:2379".into()]).unwrap_err();
    assert!(
        e.to_string().contains("uses TLS but no CA certificate"),
        "{e}"
    );
    let e = Etcd::new(vec!["ftp://127.0.0.1:2379".into()]).unwrap_err();
    assert!(matches!(e, EtcdError::InvalidEndpoint { .. }), "{e}");
    assert!(matches!(Etcd::new(vec![]), Err(EtcdError::NoEndpoints)));
}

/// The maintenance calls converged's etcd upkeep makes, against a real etcd with a tiny
/// quota: status and its sizes, compaction, NOSPACE seen as such on a write and as an
/// alarm, defragmentation giving the space back, and disarming letting writes in again.
#[tokio::test]
async fn maintenance_compacts_defragments_and_recovers_from_nospace() {
    use converge_control::etcd::AlarmKind;
    let srv = EtcdServer::start_with_flags(&["--quota-backend-bytes", "4194304"]);
    let etcd = srv.client();
    let statuses = etcd.member_statuses().await;
    assert_eq!(statuses.len(), 1);
    let first = statuses[0].1.as_ref().unwrap().clone();
    assert!(first.is_leader(), "{first:?}");
    assert!(first.db_size_bytes > 0 && first.db_size_in_use_bytes <= first.db_size_bytes);
    assert!(etcd.alarms().await.unwrap().is_empty());

    // Rewrite one key until etcd is full of its history.
    let value = vec![7u8; 256 << 10];
    let mut last_ok = 0;
    let mut full = None;
    for i in 0..200 {
        match etcd.put("/h/key", &value, None).await {
            Ok(rev) => last_ok = rev,
            Err(e) => {
                full = Some((i, e));
                break;
            }
        }
    }
    let (i, err) = full.expect("a 4 MiB quota fills with 50 MiB of history");
    assert!(
        matches!(err, EtcdError::NoSpace { .. }),
        "write {i}: {err:?}"
    );
    assert!(err.to_string().contains("quota"), "{err}");
    let alarms = etcd.alarms().await.unwrap();
    assert_eq!(alarms.len(), 1, "{alarms:?}");
    assert_eq!(alarms[0].kind, AlarmKind::NoSpace);
    assert_eq!(alarms[0].member_id, first.member_id);
    // Reads and deletes still work; writes do not, even after the alarm's cause is gone,
    // until the space is freed and the alarm disarmed.
    assert_eq!(etcd.get("/h/key").await.unwrap().unwrap().value, value);

    assert!(etcd.compact(last_ok).await.unwrap(), "history compacted");
    assert!(
        !etcd.compact(last_ok).await.unwrap(),
        "nothing left to compact"
    );
    let before = etcd.member_statuses().await[0].1.as_ref().unwrap().clone();
    etcd.defragment(&srv.endpoint).await.unwrap();
    let after = etcd.member_statuses().await[0].1.as_ref().unwrap().clone();
    assert!(
        after.db_size_bytes * 2 < before.db_size_bytes,
        "compaction freed the history's pages and defragmentation gave them back: \
         {before:?} -> {after:?}"
    );
    assert!(matches!(
        etcd.put("/h/other", b"x", None).await,
        Err(EtcdError::NoSpace { .. })
    ));
    etcd.disarm(&alarms[0]).await.unwrap();
    assert!(etcd.alarms().await.unwrap().is_empty());
    etcd.put("/h/other", b"x", None).await.unwrap();
    // An endpoint the client does not have is refused, not guessed.
    assert!(etcd.defragment("http://127.0.0.1:1").await.is_err());
}
