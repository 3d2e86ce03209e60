//! The owner's control-plane glue against a real etcd: placement on distinct live nodes,
//! and fencing of a deposed owner's allocation, record change and lookup.
#![allow(clippy::unwrap_used)] // tests: a failed step is the failure we want to see

use converge_allocator::Allocator;
use converge_control::testing::EtcdServer;
use converge_control::{Cluster, DriveRecord, NodeRecord};
use converge_types::{
    DriveId, DriveRole, Epoch, ExtentState, MediaType, NodeId, SlabIndex, VolumeId,
};
use converge_volume::{SlabAllocator, SlabChange, VolumeError};

async fn cluster_of(c: &Cluster, nodes: u32, lease: converge_control::LeaseId) {
    for n in 1..=nodes {
        let rec = NodeRecord {
            id: NodeId(n),
            name: format!("n{n}"),
            rpc_addr: format!("127.0.0.1:{}", 7000 + n),
            api_addr: "127.0.0.1:8080".into(),
            nbd_socket: "/run/converge/nbd.sock".into(),
            nbd_tcp: None,
            version: "0.1.0".into(),
            started_unix: 1,
        };
        c.register_node(&rec, lease).await.unwrap();
        c.put_drive(&DriveRecord {
            id: DriveId(u64::from(n) * 10),
            node: NodeId(n),
            path: format!("/dev/n{n}"),
            role: DriveRole::Capacity,
            media: MediaType::Ssd,
            size_bytes: 1 << 30,
            extents_total: 4,
            slab_size_bytes: 256 << 20,
            tbw_bytes: None,
            warranty_years: None,
            slots_total: None,
        })
        .await
        .unwrap();
    }
}

fn fenced(r: Result<impl std::fmt::Debug, VolumeError>, epoch: Epoch) {
    match r {
        Err(VolumeError::Fenced { epoch: e, .. }) => assert_eq!(e, epoch),
        other => panic!("a deposed owner was not fenced: {other:?}"),
    }
}

#[tokio::test]
async fn a_deposed_owner_can_neither_allocate_nor_change_nor_look_up() {
    let srv = EtcdServer::start();
    let etcd = srv.client();
    let c = Cluster::new(etcd.clone());
    let lease = etcd.lease_grant(60).await.unwrap();
    cluster_of(&c, 4, lease).await;
    let vol = VolumeId(3);
    let e1 = c.claim_ownership(vol, NodeId(1), lease).await.unwrap();
    let old = Allocator::new(c.clone(), NodeId(1), 0);

    // The owner places copies on distinct live nodes, least-used first.
    let a = old.allocate(vol, SlabIndex(0), e1, 3, false).await.unwrap();
    let mut nodes: Vec<NodeId> = a.iter().map(|e| e.node).collect();
    nodes.sort();
    nodes.dedup();
    assert_eq!(nodes.len(), 3, "copies on distinct nodes: {a:?}");
    let b = old.allocate(vol, SlabIndex(1), e1, 3, false).await.unwrap();
    let unused = (1..=4)
        .map(NodeId)
        .find(|n| !a.iter().any(|e| e.node == *n))
        .unwrap();
    assert!(
        b.iter().any(|e| e.node == unused),
        "the node left out of slab 0 is least used: {b:?}"
    );
    // Create-if-absent: allocating again returns the record.
    assert_eq!(
        old.allocate(vol, SlabIndex(0), e1, 3, false).await.unwrap(),
        a
    );
    // Asking with another epoch than the one the node holds is refused too.
    fenced(
        old.allocate(vol, SlabIndex(5), Epoch(e1.0 + 7), 3, false)
            .await,
        Epoch(e1.0 + 7),
    );

    // Node 1 loses the volume to node 2 (its lease expired).
    c.release_ownership(vol, NodeId(1)).await.unwrap();
    let e2 = c.claim_ownership(vol, NodeId(2), lease).await.unwrap();
    assert!(e2 > e1);

    fenced(old.allocate(vol, SlabIndex(2), e1, 3, false).await, e1);
    let stale = SlabChange::State {
        drive: a[0].drive,
        from: vec![ExtentState::InSync],
        to: ExtentState::Stale,
        min_replicas: 2,
    };
    fenced(old.change(vol, SlabIndex(0), e1, stale.clone()).await, e1);
    fenced(old.lookup(vol, SlabIndex(0), e1).await, e1);
    let slabs = c.slabs(vol).await.unwrap();
    assert_eq!(slabs.len(), 2, "the deposed owner allocated nothing");
    assert!(slabs[&SlabIndex(0)]
        .0
        .extents
        .iter()
        .all(|e| e.state == ExtentState::InSync));

    // The new owner can do all three.
    let new = Allocator::new(c.clone(), NodeId(2), 0);
    let after = new.change(vol, SlabIndex(0), e2, stale).await.unwrap();
    assert_eq!(after[0].state, ExtentState::Stale);
    assert_eq!(
        new.lookup(vol, SlabIndex(0), e2).await.unwrap(),
        Some(after)
    );
    assert_eq!(new.lookup(vol, SlabIndex(2), e2).await.unwrap(), None);
    new.allocate(vol, SlabIndex(2), e2, 2, false).await.unwrap();
    assert_eq!(c.slabs(vol).await.unwrap().len(), 3);

    // Slab 0 has gone below min_replicas: the copy that took it there is marked in etcd as
    // holding every acked write (docs/adr/0014); only it may be promoted, and only by the
    // owner.
    let second = SlabChange::State {
        drive: a[1].drive,
        from: vec![ExtentState::InSync],
        to: ExtentState::Stale,
        min_replicas: 2,
    };
    new.change(vol, SlabIndex(0), e2, second).await.unwrap();
    let rec = &c.slabs(vol).await.unwrap()[&SlabIndex(0)].0;
    let marked: Vec<DriveId> = rec
        .extents
        .iter()
        .filter(|e| e.holds_acked)
        .map(|e| e.drive)
        .collect();
    assert_eq!(marked, vec![a[1].drive]);
    let promote = |drive| SlabChange::Promote { drive };
    let unchanged = new
        .change(vol, SlabIndex(0), e2, promote(a[0].drive))
        .await
        .unwrap();
    assert_eq!(unchanged[0].state, ExtentState::Stale, "unmarked: refused");
    fenced(
        old.change(vol, SlabIndex(0), e1, promote(a[1].drive)).await,
        e1,
    );
    let promoted = new
        .change(vol, SlabIndex(0), e2, promote(a[1].drive))
        .await
        .unwrap();
    let states: Vec<ExtentState> = promoted.iter().map(|e| e.state).collect();
    assert_eq!(
        states,
        vec![ExtentState::Stale, ExtentState::InSync, ExtentState::Stale]
    );
    let rec = &c.slabs(vol).await.unwrap()[&SlabIndex(0)].0;
    assert!(rec.extents.iter().all(|e| !e.holds_acked));
}

/// A peer's extent operations are admitted only from the volume's owner (issue 48): another
/// member at the current epoch is refused (writes, fences, releases), a deposed owner is
/// fenced, and a `Free` of a volume with an owner comes only from it. Learned once per
/// volume and epoch: with etcd gone, the owner's requests are still admitted from what this
/// node knows (no etcd read per request).
#[tokio::test]
async fn only_the_owner_acts_on_copies_and_placed_copies_are_never_released() {
    use converge_allocator::admission::{Admission, Caller, Refusal};
    use converge_types::{ExtentKey, ExtentOp, Version};
    let mut srv = EtcdServer::start();
    let etcd = srv.client();
    let c = Cluster::new(etcd.clone());
    let lease = etcd.lease_grant(60).await.unwrap();
    cluster_of(&c, 3, lease).await;
    let vol = VolumeId(11);
    let e1 = c.claim_ownership(vol, NodeId(1), lease).await.unwrap();
    let owner = Allocator::new(c.clone(), NodeId(1), 0);
    let placed = owner
        .allocate(vol, SlabIndex(0), e1, 3, false)
        .await
        .unwrap();
    // This replica is node 3; it holds a copy of slab 0.
    let drive = placed.iter().find(|e| e.node == NodeId(3)).unwrap().drive;
    let key = ExtentKey {
        volume: vol,
        slab: SlabIndex(0),
    };
    let adm = Admission::new();
    let check = |caller: Caller, op: ExtentOp| {
        let adm = &adm;
        let c = &c;
        async move { adm.check(c, caller, drive, &op, || true).await }
    };
    let in_term_max = Version(e1.0 << 32 | 0xffff_ffff);
    let write = |epoch: Epoch| ExtentOp::Zero {
        key,
        epoch,
        version: in_term_max,
        offset: 0,
        len: 4096,
    };
    let release = |epoch: Epoch, upto: Version| ExtentOp::Release { key, epoch, upto };

    // The owner is admitted; another member at the same epoch is not, for writes, fences
    // and releases alike.
    assert_eq!(check(Caller::Peer(NodeId(1)), write(e1)).await, Ok(()));
    for op in [
        write(e1),
        ExtentOp::Digest { key, epoch: e1 },
        release(e1, in_term_max),
    ] {
        match check(Caller::Peer(NodeId(2)), op).await {
            Err(Refusal::NotOwner(m)) => assert!(m.contains("not the owner"), "{m}"),
            other => panic!("a member that is not the owner: {other:?}"),
        }
    }
    // The owner's release is its own to send (the engine keeps what is newer than it).
    assert_eq!(
        check(Caller::Peer(NodeId(1)), release(e1, in_term_max)).await,
        Ok(())
    );
    // A free of a copy of an owned volume, from another member: refused.
    assert!(matches!(
        check(Caller::Peer(NodeId(2)), ExtentOp::Free { key }).await,
        Err(Refusal::NotOwner(_))
    ));
    // This node's own requests are not the owner check's business.
    assert_eq!(
        check(Caller::Local, ExtentOp::Digest { key, epoch: e1 }).await,
        Ok(())
    );

    // Node 2 takes over: node 1 is deposed, node 2 admitted.
    c.release_ownership(vol, NodeId(1)).await.unwrap();
    let e2 = c.claim_ownership(vol, NodeId(2), lease).await.unwrap();
    assert_eq!(check(Caller::Peer(NodeId(2)), write(e2)).await, Ok(()));
    match check(Caller::Peer(NodeId(1)), write(e1)).await {
        Err(Refusal::Deposed { current, .. }) => assert_eq!(current, e2),
        other => panic!("a deposed owner: {other:?}"),
    }
    assert!(matches!(
        check(Caller::Peer(NodeId(1)), write(e2)).await,
        Err(Refusal::NotOwner(_))
    ));

    // Learned: with etcd gone, the owner's requests at its epoch are still admitted, and
    // the others still refused, from memory.
    srv.stop();
    assert_eq!(check(Caller::Peer(NodeId(2)), write(e2)).await, Ok(()));
    assert_eq!(
        check(Caller::Peer(NodeId(2)), ExtentOp::Digest { key, epoch: e2 }).await,
        Ok(())
    );
    assert!(matches!(
        check(Caller::Peer(NodeId(3)), write(e2)).await,
        Err(Refusal::NotOwner(_))
    ));
}

/// Once a slab's record is deleted (thin reclaim), its owner's release is admitted; and a
/// deleted volume's copies may be freed by any member (the node that ran the delete).
#[tokio::test]
async fn released_and_deleted_copies_may_be_freed() {
    use converge_allocator::admission::{Admission, Caller};
    use converge_types::{ExtentKey, ExtentOp, Version};
    let srv = EtcdServer::start();
    let etcd = srv.client();
    let c = Cluster::new(etcd.clone());
    let lease = etcd.lease_grant(60).await.unwrap();
    cluster_of(&c, 3, lease).await;
    let vol = VolumeId(12);
    let e1 = c.claim_ownership(vol, NodeId(1), lease).await.unwrap();
    let owner = Allocator::new(c.clone(), NodeId(1), 0);
    let placed = owner
        .allocate(vol, SlabIndex(0), e1, 3, false)
        .await
        .unwrap();
    let drive = placed.iter().find(|e| e.node == NodeId(3)).unwrap().drive;
    let key = ExtentKey {
        volume: vol,
        slab: SlabIndex(0),
    };
    let adm = Admission::new();
    owner.release(vol, &[SlabIndex(0)], e1).await.unwrap();
    let upto = Version(e1.0 << 32 | 7);
    let release = ExtentOp::Release {
        key,
        epoch: e1,
        upto,
    };
    assert_eq!(
        adm.check(&c, Caller::Peer(NodeId(1)), drive, &release, || true)
            .await,
        Ok(())
    );
    // The volume is deleted (its owner record goes with it): any member may free.
    c.release_ownership(vol, NodeId(1)).await.unwrap();
    assert_eq!(
        adm.check(
            &c,
            Caller::Peer(NodeId(2)),
            drive,
            &ExtentOp::Free { key },
            || true
        )
        .await,
        Ok(())
    );
}
