//! The cluster model against a real etcd: records, races, ownership epochs, deletion.
#![allow(clippy::unwrap_used)] // tests: a failed step is the failure we want to see

use converge_control::etcd::Etcd;
use converge_control::model::keys;
use converge_control::testing::EtcdServer;
use converge_control::{
    Cluster, ControlError, DriveRecord, ExtentRecord, NodeRecord, OwnerRecord, SlabRecord,
    VolumeRecord,
};
use converge_types::{
    DriveId, DriveRole, Epoch, ExtentState, MediaType, NodeId, Resiliency, SlabIndex, VolumeId,
};
use std::time::Duration;

fn node(id: u32, rpc: &str) -> NodeRecord {
    NodeRecord {
        id: NodeId(id),
        name: format!("n{id}"),
        rpc_addr: rpc.to_string(),
        api_addr: "127.0.0.1:8080".into(),
        nbd_socket: "/run/converge/nbd.sock".into(),
        nbd_tcp: None,
        version: "0.1.0".into(),
        started_unix: 1,
    }
}

fn volume(id: u64, name: &str) -> VolumeRecord {
    VolumeRecord {
        id: VolumeId(id),
        name: name.into(),
        size_bytes: 1 << 30,
        resiliency: Resiliency::Mirror3,
        mirror_part_bytes: 0,
        min_replicas: 2,
        slab_size_bytes: 256 << 20,
        owner: NodeId(1),
        created_unix: 1,
        compression: converge_types::Compression::None,
        encryption: None,
        qos: Default::default(),
        snapshots: Vec::new(),
        parent: None,
        stray_floors: Vec::new(),
    }
}

fn slab(drives: &[(u64, u32)]) -> SlabRecord {
    SlabRecord {
        extents: drives
            .iter()
            .map(|&(d, n)| ExtentRecord {
                drive: DriveId(d),
                node: NodeId(n),
                state: ExtentState::InSync,
                holds_acked: false,
            })
            .collect(),
    }
}

#[tokio::test]
async fn first_node_creates_the_cluster_others_load_it() {
    let srv = EtcdServer::start();
    let mut tasks = Vec::new();
    for i in 0..8 {
        let c = Cluster::new(srv.client());
        tasks.push(tokio::spawn(async move {
            c.init_or_load(&format!("name{i}"), 1 << 20).await.unwrap()
        }));
    }
    let mut recs = Vec::new();
    for t in tasks {
        recs.push(t.await.unwrap());
    }
    assert!(
        recs.iter().all(|r| r == &recs[0]),
        "every node sees one cluster: {recs:?}"
    );
    let later = Cluster::new(srv.client())
        .init_or_load("other", 4096)
        .await
        .unwrap();
    assert_eq!(later, recs[0]);
    assert_eq!(later.slab_size_bytes, 1 << 20, "the existing record wins");
}

#[tokio::test]
async fn nodes_are_live_while_their_lease_is() {
    let srv = EtcdServer::start();
    let etcd = srv.client();
    let c = Cluster::new(etcd.clone());
    let l1 = etcd.lease_grant(60).await.unwrap();
    let l2 = etcd.lease_grant(60).await.unwrap();
    c.register_node(&node(2, "10.0.0.2:7000"), l2)
        .await
        .unwrap();
    c.register_node(&node(1, "10.0.0.1:7000"), l1)
        .await
        .unwrap();
    let live: Vec<NodeId> = c.live_nodes().await.unwrap().iter().map(|n| n.id).collect();
    assert_eq!(live, [NodeId(1), NodeId(2)]);

    // Same id, another address: refused, naming both.
    let e = c
        .register_node(&node(1, "10.0.0.9:7000"), l2)
        .await
        .unwrap_err();
    assert!(matches!(e, ControlError::NodeIdInUse { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("10.0.0.1:7000") && msg.contains("10.0.0.9:7000"),
        "{msg}"
    );

    // Same id and address (a restart with a new lease): replaces the record.
    let l1b = etcd.lease_grant(60).await.unwrap();
    let mut restarted = node(1, "10.0.0.1:7000");
    restarted.started_unix = 2;
    c.register_node(&restarted, l1b).await.unwrap();
    etcd.lease_revoke(l1).await.unwrap();
    let nodes = c.live_nodes().await.unwrap();
    assert_eq!(
        nodes[0], restarted,
        "bound to the new lease, so it survives the old one"
    );

    // A node whose lease ends is no longer live; its id is free again.
    etcd.lease_revoke(l2).await.unwrap();
    let live: Vec<NodeId> = c.live_nodes().await.unwrap().iter().map(|n| n.id).collect();
    assert_eq!(live, [NodeId(1)]);
    let l3 = etcd.lease_grant(60).await.unwrap();
    c.register_node(&node(2, "10.0.0.22:7000"), l3)
        .await
        .unwrap();
}

#[tokio::test]
async fn drives_round_trip() {
    let srv = EtcdServer::start();
    let c = Cluster::new(srv.client());
    let mut d = DriveRecord {
        id: DriveId(42),
        node: NodeId(1),
        path: "/dev/nvme0n1".into(),
        role: DriveRole::Capacity,
        media: MediaType::Nvme,
        size_bytes: 1 << 40,
        extents_total: 4000,
        slab_size_bytes: 256 << 20,
        tbw_bytes: Some(600 << 40),
        warranty_years: Some(5.0),
        slots_total: None,
    };
    c.put_drive(&d).await.unwrap();
    let mut d2 = d.clone();
    d2.id = DriveId(7);
    d2.role = DriveRole::Cache;
    d2.tbw_bytes = None;
    c.put_drive(&d2).await.unwrap();
    d.extents_total = 3999;
    c.put_drive(&d).await.unwrap();
    assert_eq!(c.drives().await.unwrap(), vec![d2.clone(), d.clone()]);

    // At start-up a node records its capacity drives that did not open as failed (a blank
    // drive in the place of drive 42 formats under a new id): caches, other nodes' drives
    // and drives failed already are left alone.
    let mut other = d.clone();
    other.id = DriveId(9);
    other.node = NodeId(2);
    c.put_drive(&other).await.unwrap();
    assert!(c
        .fail_missing_drives(NodeId(1), &[DriveId(42)])
        .await
        .unwrap()
        .is_empty());
    assert!(c.failed_drives().await.unwrap().is_empty());
    assert_eq!(
        c.fail_missing_drives(NodeId(1), &[DriveId(43)])
            .await
            .unwrap(),
        vec![DriveId(42)]
    );
    let failed = c.failed_drives().await.unwrap();
    assert_eq!(
        failed.keys().copied().collect::<Vec<_>>(),
        vec![DriveId(42)]
    );
    assert!(failed[&DriveId(42)].contains("not there when the node started"));
    c.set_drive_failed(DriveId(42), Some("its writes failed"))
        .await
        .unwrap();
    assert!(c
        .fail_missing_drives(NodeId(1), &[])
        .await
        .unwrap()
        .is_empty());
    assert_eq!(
        c.failed_drives().await.unwrap()[&DriveId(42)],
        "its writes failed"
    );
}

#[tokio::test]
async fn volumes_create_update_and_refuse_duplicates() {
    let srv = EtcdServer::start();
    let c = Cluster::new(srv.client());
    let v = volume(11, "vm01");
    c.create_volume(&v).await.unwrap();
    let e = c.create_volume(&volume(12, "vm01")).await.unwrap_err();
    assert!(matches!(e, ControlError::VolumeExists { .. }), "{e}");
    assert!(e.to_string().contains("\"vm01\""), "{e}");
    let e = c.create_volume(&volume(13, "a/b")).await.unwrap_err();
    assert!(matches!(e, ControlError::InvalidVolumeName { .. }), "{e}");

    let (got, rev) = c.volume("vm01").await.unwrap().unwrap();
    assert_eq!(got, v);
    assert!(c.volume("nope").await.unwrap().is_none());

    let mut bigger = v.clone();
    bigger.size_bytes *= 2;
    assert!(c.update_volume(&bigger, rev).await.unwrap());
    assert!(
        !c.update_volume(&v, rev).await.unwrap(),
        "stale revision loses"
    );
    assert_eq!(c.volume("vm01").await.unwrap().unwrap().0, bigger);
    assert!(
        !c.update_volume(&volume(14, "ghost"), 0).await.unwrap(),
        "update never creates"
    );
    assert!(c.volume("ghost").await.unwrap().is_none());

    c.create_volume(&volume(15, "db")).await.unwrap();
    let names: Vec<String> = c
        .volumes()
        .await
        .unwrap()
        .into_iter()
        .map(|v| v.name)
        .collect();
    assert_eq!(names, ["db", "vm01"]);
}

#[tokio::test]
async fn concurrent_slab_allocation_agrees_on_one_record() {
    let srv = EtcdServer::start();
    let etcd = srv.client();
    let c = Cluster::new(etcd.clone());
    let vol = VolumeId(5);
    let lease = etcd.lease_grant(60).await.unwrap();
    let owner = OwnerRecord {
        node: NodeId(1),
        epoch: c.claim_ownership(vol, NodeId(1), lease).await.unwrap(),
    };
    let mut tasks = Vec::new();
    for i in 0..16u64 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            c.create_slab_as_owner(vol, SlabIndex(3), &slab(&[(i, 1), (100 + i, 2)]), owner)
                .await
                .unwrap()
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.unwrap());
    }
    assert!(
        results.iter().all(|r| r == &results[0]),
        "every allocator returns the record etcd holds: {results:?}"
    );
    let map = c.slabs(vol).await.unwrap();
    assert_eq!(map.len(), 1);
    assert_eq!(map[&SlabIndex(3)], results[0]);

    // CAS: mark an extent stale with the right revision; a stale revision loses.
    let (mut rec, rev) = results[0].clone();
    rec.extents[1].state = ExtentState::Stale;
    assert_eq!(
        c.cas_slab_as_owner(vol, SlabIndex(3), &rec, rev, owner)
            .await
            .unwrap(),
        Some(())
    );
    assert_eq!(
        c.cas_slab_as_owner(vol, SlabIndex(3), &results[0].0, rev, owner)
            .await
            .unwrap(),
        None
    );
    assert_eq!(
        c.cas_slab_as_owner(vol, SlabIndex(4), &rec, 0, owner)
            .await
            .unwrap(),
        None,
        "cas never creates"
    );
    let map = c.slabs(vol).await.unwrap();
    assert_eq!(map[&SlabIndex(3)].0, rec);

    // Slab order follows the index, not the text.
    for i in [10u64, 2, 100] {
        c.create_slab_as_owner(vol, SlabIndex(i), &slab(&[(1, 1)]), owner)
            .await
            .unwrap();
    }
    let idx: Vec<u64> = c.slabs(vol).await.unwrap().keys().map(|s| s.0).collect();
    assert_eq!(idx, [2, 3, 10, 100]);
}

#[tokio::test]
async fn ownership_epochs_increase_and_conflicts_name_the_owner() {
    let srv = EtcdServer::start();
    let etcd = srv.client();
    let c = Cluster::new(etcd.clone());
    let vol = VolumeId(9);
    let l1 = etcd.lease_grant(60).await.unwrap();
    let l2 = etcd.lease_grant(60).await.unwrap();

    let e1 = c.claim_ownership(vol, NodeId(1), l1).await.unwrap();
    assert_eq!(e1, Epoch(1));
    let e1b = c.claim_ownership(vol, NodeId(1), l1).await.unwrap();
    assert!(e1b > e1, "re-claiming starts a new term");
    assert_eq!(
        c.owner(vol).await.unwrap(),
        Some(OwnerRecord {
            node: NodeId(1),
            epoch: e1b
        })
    );

    let e = c.claim_ownership(vol, NodeId(2), l2).await.unwrap_err();
    match &e {
        ControlError::OwnedElsewhere { node, epoch, .. } => {
            assert_eq!((*node, *epoch), (NodeId(1), e1b));
        }
        other => panic!("unexpected {other}"),
    }
    assert!(e.to_string().contains("owned by node 1"), "{e}");

    // Releasing by a non-owner is a no-op; by the owner frees it, and the epoch goes on.
    c.release_ownership(vol, NodeId(2)).await.unwrap();
    assert!(c.owner(vol).await.unwrap().is_some());
    c.release_ownership(vol, NodeId(1)).await.unwrap();
    assert_eq!(c.owner(vol).await.unwrap(), None);
    let e2 = c.claim_ownership(vol, NodeId(2), l2).await.unwrap();
    assert!(e2 > e1b, "{e2} after {e1b}");

    // The owner's lease ends (node died): another node takes over with a higher epoch.
    etcd.lease_revoke(l2).await.unwrap();
    let e3 = c.claim_ownership(vol, NodeId(1), l1).await.unwrap();
    assert!(e3 > e2);

    // Racing claimants: exactly one wins, the rest see it as the owner.
    let vol2 = VolumeId(10);
    let mut tasks = Vec::new();
    for n in 1..=8u32 {
        let c = c.clone();
        let etcd = etcd.clone();
        tasks.push(tokio::spawn(async move {
            let l = etcd.lease_grant(60).await.unwrap();
            (n, c.claim_ownership(vol2, NodeId(n), l).await)
        }));
    }
    let mut winners = Vec::new();
    let mut seen_owners = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            (n, Ok(epoch)) => winners.push((n, epoch)),
            (_, Err(ControlError::OwnedElsewhere { node, .. })) => seen_owners.push(node),
            (_, Err(e)) => panic!("unexpected {e}"),
        }
    }
    assert_eq!(winners.len(), 1, "{winners:?}");
    assert!(seen_owners.iter().all(|n| n.0 == winners[0].0));
}

#[tokio::test]
async fn ownership_lapses_when_the_lease_expires() {
    let srv = EtcdServer::start();
    let etcd = srv.client();
    let c = Cluster::new(etcd.clone());
    let vol = VolumeId(3);
    let short = etcd.lease_grant(1).await.unwrap();
    let e1 = c.claim_ownership(vol, NodeId(1), short).await.unwrap();
    let mut free = false;
    for _ in 0..300 {
        if c.owner(vol).await.unwrap().is_none() {
            free = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(free, "ownership must end with its lease");
    let l2 = etcd.lease_grant(60).await.unwrap();
    let e2 = c.claim_ownership(vol, NodeId(2), l2).await.unwrap();
    assert!(e2 > e1, "epochs survive the owner's lease");
}

#[tokio::test]
async fn delete_volume_removes_its_slabs_owner_and_epoch() {
    let srv = EtcdServer::start();
    let etcd = srv.client();
    let c = Cluster::new(etcd.clone());
    let v = volume(1, "gone");
    let keep = volume(12, "kept"); // id 12 shares the text prefix "1" with volume 1
    c.create_volume(&v).await.unwrap();
    c.create_volume(&keep).await.unwrap();
    let lease = etcd.lease_grant(60).await.unwrap();
    let owner = |epoch| OwnerRecord {
        node: NodeId(1),
        epoch,
    };
    let ev = owner(c.claim_ownership(v.id, NodeId(1), lease).await.unwrap());
    let ek = owner(c.claim_ownership(keep.id, NodeId(1), lease).await.unwrap());
    for i in 0..5 {
        c.create_slab_as_owner(v.id, SlabIndex(i), &slab(&[(1, 1)]), ev)
            .await
            .unwrap();
    }
    c.create_slab_as_owner(keep.id, SlabIndex(0), &slab(&[(1, 1)]), ek)
        .await
        .unwrap();

    let deleted = c.delete_volume("gone").await.unwrap();
    assert_eq!(deleted, Some(v.clone()));
    assert!(c.volume("gone").await.unwrap().is_none());
    assert!(c.slabs(v.id).await.unwrap().is_empty());
    assert!(c.owner(v.id).await.unwrap().is_none());
    assert!(etcd.get(&keys::epoch(v.id)).await.unwrap().is_none());
    assert_eq!(c.delete_volume("gone").await.unwrap(), None);

    // The other volume is untouched.
    assert!(c.volume("kept").await.unwrap().is_some());
    assert_eq!(c.slabs(keep.id).await.unwrap().len(), 1);
    assert!(c.owner(keep.id).await.unwrap().is_some());
    assert!(etcd.get(&keys::epoch(keep.id)).await.unwrap().is_some());
}

#[tokio::test]
async fn corrupt_records_are_reported_with_their_key() {
    let srv = EtcdServer::start();
    let etcd = srv.client();
    let c = Cluster::new(etcd.clone());
    etcd.put("/converge/volumes/bad", b"{not json", None)
        .await
        .unwrap();
    let e = c.volume("bad").await.unwrap_err();
    assert!(matches!(e, ControlError::Corrupt { .. }), "{e}");
    assert!(e.to_string().contains("/converge/volumes/bad"), "{e}");
}

#[tokio::test]
async fn model_errors_when_etcd_is_down() {
    let c = Cluster::new(Etcd::new(vec![converge_control::testing::unused_endpoint()]).unwrap());
    let e = c.volumes().await.unwrap_err();
    assert!(matches!(e, ControlError::Etcd(_)), "{e}");
    assert!(e.to_string().contains("is etcd running?"), "{e}");
}

/// Owners of different volumes allocate at the same time (as a fleet's prefill does): each
/// allocation still sees every one committed before it, so the drives end up exactly
/// balanced, as when slabs are placed one after another. Without the ordering through
/// `placement-seq`, concurrent allocators read the same counts and pile onto the same
/// "least used" drives.
#[tokio::test]
async fn concurrent_allocations_of_many_owners_still_balance() {
    let srv = EtcdServer::start();
    let etcd = srv.client();
    let c = Cluster::new(etcd.clone());
    let lease = etcd.lease_grant(600).await.unwrap();
    let mut drive_ids = Vec::new();
    for n in 1..=4u32 {
        c.register_node(&node(n, &format!("10.0.0.{n}:7000")), lease)
            .await
            .unwrap();
        for _ in 0..2 {
            let id = DriveId(rand::random::<u64>() >> 1);
            drive_ids.push(id);
            c.put_drive(&DriveRecord {
                id,
                node: NodeId(n),
                path: format!("/dev/n{n}-{}", id.0),
                role: DriveRole::Capacity,
                media: MediaType::Nvme,
                size_bytes: 64 << 30,
                extents_total: 64,
                slab_size_bytes: 1 << 30,
                tbw_bytes: None,
                warranty_years: None,
                slots_total: None,
            })
            .await
            .unwrap();
        }
    }
    // 4 owners (one allocation at a time each, as a node's allocator does), 2 volumes each,
    // 6 slabs per volume, mirror-3: 144 copies over 8 drives.
    let mut tasks = Vec::new();
    for owner in 0..4u64 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            let me = NodeId(owner as u32 + 1);
            let mut terms = Vec::new();
            for vol in [owner * 2, owner * 2 + 1] {
                let epoch = c.claim_ownership(VolumeId(vol), me, lease).await.unwrap();
                terms.push(converge_control::model::OwnerRecord { node: me, epoch });
            }
            for slab in 0..6 {
                for (i, vol) in [owner * 2, owner * 2 + 1].into_iter().enumerate() {
                    let (rec, _) = c
                        .allocate_slab(VolumeId(vol), SlabIndex(slab), 3, terms[i], 0)
                        .await
                        .unwrap();
                    let nodes: std::collections::BTreeSet<NodeId> =
                        rec.extents.iter().map(|e| e.node).collect();
                    assert_eq!(nodes.len(), 3, "copies on distinct nodes: {rec:?}");
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let used = c.extents_used().await.unwrap();
    let per_drive: Vec<u64> = drive_ids
        .iter()
        .map(|d| used.get(d).copied().unwrap_or(0))
        .collect();
    assert_eq!(per_drive, vec![18; 8], "drives' used extents");

    // An allocation of a slab that exists returns the record etcd holds.
    let held = c.slab(VolumeId(0), SlabIndex(0)).await.unwrap().unwrap();
    let term0 = converge_control::model::OwnerRecord {
        node: NodeId(1),
        epoch: c.owner(VolumeId(0)).await.unwrap().unwrap().epoch,
    };
    assert_eq!(
        c.allocate_slab(VolumeId(0), SlabIndex(0), 3, term0, 0)
            .await
            .unwrap(),
        held
    );
    // No room on enough nodes: a placement error, in the user's terms.
    let e99 = c
        .claim_ownership(VolumeId(99), NodeId(1), lease)
        .await
        .unwrap();
    let e = c
        .allocate_slab(
            VolumeId(99),
            SlabIndex(0),
            5,
            converge_control::model::OwnerRecord {
                node: NodeId(1),
                epoch: e99,
            },
            0,
        )
        .await
        .unwrap_err();
    assert!(
        matches!(e, ControlError::Placement(_)) && e.to_string().contains("needs 5 nodes"),
        "{e}"
    );
}

/// Allocation is fenced like record changes: only the volume's current owner at its epoch
/// creates a slab record; a deposed owner's transaction fails and writes nothing.
#[tokio::test]
async fn slab_allocation_is_fenced_by_the_owner_epoch() {
    let srv = EtcdServer::start();
    let etcd = srv.client();
    let c = Cluster::new(etcd.clone());
    let vol = VolumeId(11);
    let l1 = etcd.lease_grant(60).await.unwrap();
    let l2 = etcd.lease_grant(60).await.unwrap();
    let e1 = c.claim_ownership(vol, NodeId(1), l1).await.unwrap();
    let old = OwnerRecord {
        node: NodeId(1),
        epoch: e1,
    };

    // No owner record at all (not claimed): refused.
    let other = VolumeId(12);
    let r = c
        .create_slab_as_owner(other, SlabIndex(0), &slab(&[(1, 1)]), old)
        .await;
    assert!(
        matches!(r, Err(ControlError::OwnedElsewhere { .. })),
        "{r:?}"
    );

    // The owner allocates; a second allocation of the same term gets the first record.
    let (a, rev) = c
        .create_slab_as_owner(vol, SlabIndex(0), &slab(&[(1, 1), (2, 2)]), old)
        .await
        .unwrap();
    assert_eq!(a, slab(&[(1, 1), (2, 2)]));
    let again = c
        .create_slab_as_owner(vol, SlabIndex(0), &slab(&[(3, 3), (4, 4)]), old)
        .await
        .unwrap();
    assert_eq!(
        again,
        (a.clone(), rev),
        "create-if-absent keeps the first record"
    );

    // A new term (same node claiming again, or another node after the lease): the old
    // term can no longer allocate, and nothing is written.
    let e2 = c.claim_ownership(vol, NodeId(1), l1).await.unwrap();
    assert!(e2 > e1);
    let r = c
        .create_slab_as_owner(vol, SlabIndex(1), &slab(&[(1, 1)]), old)
        .await;
    match r {
        Err(ControlError::OwnedElsewhere { node, epoch, .. }) => {
            assert_eq!((node, epoch), (NodeId(1), e2));
        }
        other => panic!("a deposed owner allocated: {other:?}"),
    }
    etcd.lease_revoke(l1).await.unwrap();
    let e3 = c.claim_ownership(vol, NodeId(2), l2).await.unwrap();
    let r = c
        .create_slab_as_owner(vol, SlabIndex(1), &slab(&[(1, 1)]), old)
        .await;
    assert!(
        matches!(
            r,
            Err(ControlError::OwnedElsewhere {
                node: NodeId(2),
                ..
            })
        ),
        "{r:?}"
    );
    // Also for a slab that exists: the deposed owner does not get the record either.
    let r = c
        .create_slab_as_owner(vol, SlabIndex(0), &slab(&[(1, 1)]), old)
        .await;
    assert!(
        matches!(r, Err(ControlError::OwnedElsewhere { .. })),
        "{r:?}"
    );
    let map = c.slabs(vol).await.unwrap();
    assert_eq!(map.len(), 1, "only the owner's slab exists: {map:?}");
    let new = OwnerRecord {
        node: NodeId(2),
        epoch: e3,
    };
    let (b, _) = c
        .create_slab_as_owner(vol, SlabIndex(1), &slab(&[(5, 2)]), new)
        .await
        .unwrap();
    assert_eq!(b, slab(&[(5, 2)]));
    assert!(c.slab(other, SlabIndex(0)).await.unwrap().is_none());
}

/// A snapshot is recorded and the owner moves on to the next epoch in one transaction that
/// proves the ownership; names are unique, deposed owners are refused, and removing one
/// gives back its epoch.
#[tokio::test]
async fn snapshots_close_the_owners_epoch_in_one_transaction() {
    let srv = EtcdServer::start();
    let etcd = srv.client();
    let c = Cluster::new(etcd.clone());
    let v = volume(21, "snapme");
    c.create_volume(&v).await.unwrap();
    let l1 = etcd.lease_grant(60).await.unwrap();
    let e = c.claim_ownership(v.id, NodeId(1), l1).await.unwrap();
    let next = c
        .take_snapshot("snapme", NodeId(1), l1, e, "before-upgrade", 7)
        .await
        .unwrap();
    assert_eq!(next, Epoch(e.0 + 1));
    assert_eq!(
        c.owner(v.id).await.unwrap(),
        Some(OwnerRecord {
            node: NodeId(1),
            epoch: next
        })
    );
    assert_eq!(c.granted_epoch(v.id).await.unwrap(), next);
    let (rec, _) = c.volume("snapme").await.unwrap().unwrap();
    assert_eq!(rec.snapshots.len(), 1);
    assert_eq!(
        (rec.snapshots[0].name.as_str(), rec.snapshots[0].epoch),
        ("before-upgrade", e)
    );
    // The same name again is refused; so is an owner whose epoch moved on.
    let err = c
        .take_snapshot("snapme", NodeId(1), l1, next, "before-upgrade", 8)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("already has a snapshot"), "{err}");
    let err = c
        .take_snapshot("snapme", NodeId(1), l1, e, "stale", 8)
        .await
        .unwrap_err();
    assert!(matches!(err, ControlError::OwnedElsewhere { .. }), "{err}");
    let err = c
        .take_snapshot("snapme", NodeId(2), l1, next, "intruder", 8)
        .await
        .unwrap_err();
    assert!(matches!(err, ControlError::OwnedElsewhere { .. }), "{err}");
    assert_eq!(
        c.remove_snapshot("snapme", "before-upgrade").await.unwrap(),
        Some(e)
    );
    assert_eq!(
        c.remove_snapshot("snapme", "before-upgrade").await.unwrap(),
        None
    );
    assert!(c
        .volume("snapme")
        .await
        .unwrap()
        .unwrap()
        .0
        .snapshots
        .is_empty());
}

/// A snapshot begun is noted in the volume record before any floor is set (only by the
/// owner), and so is one deleted while a copy was out of sync; recording a snapshot
/// clears its own attempt, settling clears the ones released, and the list keeps only the
/// newest STRAY_FLOORS_MAX.
#[tokio::test]
async fn snapshots_begun_and_not_recorded_stay_listed_until_settled() {
    use converge_control::model::STRAY_FLOORS_MAX;
    let srv = EtcdServer::start();
    let etcd = srv.client();
    let c = Cluster::new(etcd.clone());
    let v = volume(22, "strays");
    c.create_volume(&v).await.unwrap();
    let l1 = etcd.lease_grant(60).await.unwrap();
    let e = c.claim_ownership(v.id, NodeId(1), l1).await.unwrap();
    let strays = || async { c.volume("strays").await.unwrap().unwrap().0.stray_floors };
    c.note_snapshot_attempt("strays", NodeId(1), e)
        .await
        .unwrap();
    c.note_snapshot_attempt("strays", NodeId(1), e)
        .await
        .unwrap();
    assert_eq!(strays().await, [e], "noted once");
    let err = c
        .note_snapshot_attempt("strays", NodeId(2), Epoch(e.0 + 5))
        .await
        .unwrap_err();
    assert!(matches!(err, ControlError::OwnedElsewhere { .. }), "{err}");
    // Recorded: the attempt is no stray.
    let next = c
        .take_snapshot("strays", NodeId(1), l1, e, "s1", 7)
        .await
        .unwrap();
    assert!(strays().await.is_empty());
    // Begun and not recorded: it stays, through a new term, until settled.
    c.note_snapshot_attempt("strays", NodeId(1), next)
        .await
        .unwrap();
    c.release_ownership(v.id, NodeId(1)).await.unwrap();
    let l2 = etcd.lease_grant(60).await.unwrap();
    let e2 = c.claim_ownership(v.id, NodeId(2), l2).await.unwrap();
    assert_eq!(strays().await, [next]);
    c.settle_stray_floors("strays", &[Epoch(1)]).await.unwrap();
    assert_eq!(strays().await, [next], "only what was released goes");
    c.settle_stray_floors("strays", &[next]).await.unwrap();
    assert!(strays().await.is_empty());
    // A snapshot deleted while a copy was out of sync leaves its epoch listed.
    assert_eq!(
        c.remove_snapshot_left_on("strays", "s1", true)
            .await
            .unwrap(),
        Some(e)
    );
    assert_eq!(strays().await, [e]);
    c.settle_stray_floors("strays", &[e]).await.unwrap();
    // Bounded: the newest are kept.
    let mut r = c.volume("strays").await.unwrap().unwrap();
    r.0.stray_floors = (0..=STRAY_FLOORS_MAX as u64)
        .filter(|&x| x != e2.0)
        .take(STRAY_FLOORS_MAX)
        .map(Epoch)
        .collect();
    assert!(c.update_volume(&r.0, r.1).await.unwrap());
    c.note_snapshot_attempt("strays", NodeId(2), e2)
        .await
        .unwrap();
    let left = strays().await;
    assert_eq!(left.len(), STRAY_FLOORS_MAX);
    assert!(left.contains(&e2) && !left.contains(&Epoch(0)), "{left:?}");
}

/// Certificate records do not pile up for the life of the cluster: once a certificate has
/// surely expired (revoked, or first seen, more than a certificate's lifetime ago) its
/// records go; the younger ones and the removal marks stay.
#[tokio::test]
async fn records_of_expired_certificates_are_pruned_and_nothing_else() {
    use converge_control::creds::RevokedRecord;
    let srv = EtcdServer::start();
    let c = Cluster::new(srv.client());
    let day = 86_400;
    let now = RevokedRecord::new("aa", "x", "y").revoked_unix;
    let mut old = RevokedRecord::new("0b", "NBD client old", "revoked by an admin");
    old.revoked_unix = now - 800 * day;
    let young = RevokedRecord::new("0c", "NBD client young", "revoked by an admin");
    c.revoke_certs(&[old, young]).await.unwrap();
    c.register_cert(NodeId(4), "0d").await.unwrap();
    c.decommission(NodeId(4)).await.unwrap();
    let lifetime = 731 * day;
    assert_eq!(c.prune_expired_certs(now, lifetime).await.unwrap(), (1, 0));
    let left: Vec<String> = c
        .revoked_certs()
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.serial)
        .collect();
    assert_eq!(left, ["0c", "0d"]);
    assert_eq!(c.certs_of(NodeId(4)).await.unwrap().len(), 1);
    // Nothing goes twice; a lifetime later the rest goes, but not the removal.
    assert_eq!(c.prune_expired_certs(now, lifetime).await.unwrap(), (0, 0));
    let later = now + lifetime + day;
    assert_eq!(
        c.prune_expired_certs(later, lifetime).await.unwrap(),
        (2, 1)
    );
    assert!(c.revoked_certs().await.unwrap().is_empty());
    assert!(c.certs_of(NodeId(4)).await.unwrap().is_empty());
    assert!(c.is_removed(NodeId(4)).await.unwrap());
}
