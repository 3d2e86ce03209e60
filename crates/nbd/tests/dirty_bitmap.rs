//! Protocol tests of the `qemu:dirty-bitmap:NAME` metadata contexts with the handwritten
//! client (tests/client): what LIST and SET_META_CONTEXT answer for each kind of query,
//! the context ids, and BLOCK_STATUS replies carrying one chunk per selected context.

// Test code: a failed unwrap is a failed test, with the line in the panic message.
#![allow(clippy::unwrap_used)]

mod client;

use std::sync::Arc;

use client::{meta_context_of, small_cfg, ChunkError, Client, Setup, SIZE};
use converge_nbd::proto::*;
use converge_nbd::testing::{MemDev, MemResolver};
use converge_nbd::{DevError, DevErrorKind};

const K: u64 = 1024;
const HZ: u32 = STATE_HOLE | STATE_ZERO;
const D: u32 = STATE_DIRTY;
const BASE: &str = "base:allocation";
const SNAP1: &str = "qemu:dirty-bitmap:snap1";
const SNAP2: &str = "qemu:dirty-bitmap:snap2";
const NO_CONTEXT: &str =
    "no metadata context selected: NBD_OPT_SET_META_CONTEXT base:allocation for this export first";

/// vm01 (1 MiB) with bitmaps snap1 and snap2 (declared in that order), aaa (8 KiB) with
/// a snap1 of its own, bare (8 KiB) with none.
fn setup() -> Setup {
    let dev = Arc::new(MemDev::new(SIZE));
    dev.set_dirty_bitmap("snap1", vec![(64 * K, 8 * K), (512 * K, 4 * K)]);
    dev.set_dirty_bitmap("snap2", vec![(900 * K, 124 * K), (0, 4 * K)]);
    let aaa = Arc::new(MemDev::new(8192));
    aaa.set_dirty_bitmap("snap1", vec![(0, 4096)]);
    let resolver = MemResolver::new()
        .with_export("vm01", Arc::clone(&dev))
        .with_export("aaa", aaa)
        .with_export("bare", Arc::new(MemDev::new(8192)));
    Setup {
        dev,
        resolver: Arc::new(resolver),
    }
}

/// The context names of a LIST answer (ids must be 0), checking it ends with ACK.
fn listed(r: &[(u32, Vec<u8>)]) -> Vec<String> {
    assert_eq!(r.last(), Some(&(REP_ACK, vec![])), "{r:?}");
    r[..r.len() - 1]
        .iter()
        .map(|rep| {
            let (id, name) = meta_context_of(rep);
            assert_eq!(id, 0, "LIST sends the reserved id 0");
            name
        })
        .collect()
}

/// The (id, name) pairs of a SET answer, checking it ends with ACK.
fn selected(r: &[(u32, Vec<u8>)]) -> Vec<(u32, String)> {
    assert_eq!(r.last(), Some(&(REP_ACK, vec![])), "{r:?}");
    r[..r.len() - 1].iter().map(meta_context_of).collect()
}

fn err<T>(errno: u32, message: &str) -> Result<T, ChunkError> {
    Err(ChunkError {
        errno,
        message: message.to_owned(),
    })
}

#[tokio::test]
async fn list_names_bitmaps_for_each_kind_of_query() {
    let s = setup();
    let mut c = Client::structured(&s, small_cfg()).await;
    let list = async |c: &mut Client, name: &str, queries: &[&str]| {
        listed(&c.meta(OPT_LIST_META_CONTEXT, name, queries).await)
    };
    // No query: everything the export offers.
    assert_eq!(list(&mut c, "vm01", &[]).await, [BASE, SNAP1, SNAP2]);
    // The namespace and the bitmap prefix are wildcards for all bitmaps.
    for q in ["qemu:", "qemu:dirty-bitmap:"] {
        assert_eq!(list(&mut c, "vm01", &[q]).await, [SNAP1, SNAP2], "{q}");
    }
    // An exact name lists that bitmap alone.
    assert_eq!(list(&mut c, "vm01", &[SNAP2]).await, [SNAP2]);
    // Each context once, however many queries match it.
    assert_eq!(
        list(&mut c, "vm01", &[SNAP2, "qemu:", BASE, SNAP2, "base:"]).await,
        [BASE, SNAP1, SNAP2]
    );
    assert_eq!(list(&mut c, "vm01", &["base:"]).await, [BASE]);
    // Unknown bitmaps, other qemu: contexts, a mere prefix of a name, other namespaces:
    // nothing.
    for q in [
        "qemu:dirty-bitmap:nope",
        "qemu:dirty-bitmap:snap",
        "qemu:dirty-bitmap:snap1x",
        "qemu:allocation-depth",
        "qemu",
        "x-qemu:dirty-bitmap:snap1",
    ] {
        assert!(list(&mut c, "vm01", &[q]).await.is_empty(), "{q}");
    }
    // Bitmaps are the named export's own.
    assert_eq!(list(&mut c, "aaa", &["qemu:"]).await, [SNAP1]);
    assert_eq!(list(&mut c, "bare", &[]).await, [BASE]);
    assert!(list(&mut c, "bare", &["qemu:dirty-bitmap:"])
        .await
        .is_empty());
    // A bitmap the device no longer names is no longer listed.
    s.dev.remove_dirty_bitmap("snap1");
    assert_eq!(list(&mut c, "vm01", &["qemu:"]).await, [SNAP2]);
    assert!(list(&mut c, "vm01", &[SNAP1]).await.is_empty());
    let r = c.info_go(OPT_GO, "vm01", &[]).await;
    assert_eq!(r.last().unwrap().0, REP_ACK);
    assert!(c.disc().await.is_ok());
}

#[tokio::test]
async fn set_selects_base_allocation_and_bitmaps_each_with_its_own_id() {
    let s = setup();
    let mut c = Client::structured(&s, small_cfg()).await;
    // Wildcards select nothing; unknown bitmaps are ignored.
    for queries in [
        &["qemu:"][..],
        &["qemu:dirty-bitmap:"][..],
        &["qemu:dirty-bitmap:nope", "qemu:dirty-bitmap:snap"][..],
    ] {
        let r = c.meta(OPT_SET_META_CONTEXT, "vm01", queries).await;
        assert_eq!(r, vec![(REP_ACK, vec![])], "{queries:?}");
    }
    // base:allocation keeps id 1; bitmaps count from 2 in the order first named; each
    // context once.
    let r = c
        .meta(
            OPT_SET_META_CONTEXT,
            "vm01",
            &[
                SNAP2,
                "qemu:dirty-bitmap:nope",
                BASE,
                SNAP1,
                SNAP2,
                "qemu:dirty-bitmap:",
                "qemu:",
                BASE,
            ],
        )
        .await;
    assert_eq!(
        selected(&r),
        [
            (1, BASE.to_owned()),
            (2, SNAP2.to_owned()),
            (3, SNAP1.to_owned())
        ]
    );
    let r = c.info_go(OPT_GO, "vm01", &[]).await;
    assert_eq!(r.last().unwrap().0, REP_ACK);
    assert_eq!(c.write(1, 64 * K, &[7u8; 8192]).await, 0);
    let size = SIZE as u32;
    let snap1 = vec![
        (64 * 1024, 0),
        (8192, D),
        (440 * 1024, 0),
        (4096, D),
        (size - 516 * 1024, 0),
    ];
    let snap2 = vec![(4096, D), (896 * 1024, 0), (124 * 1024, D)];
    // One chunk per context, in id order, DONE on the last only (checked by the helper).
    assert_eq!(
        c.block_status_chunks(2, 0, 0, size).await.unwrap(),
        vec![
            (1, vec![(64 * 1024, HZ), (8192, 0), (size - 72 * 1024, HZ)]),
            (2, snap2.clone()),
            (3, snap1.clone()),
        ]
    );
    // A range inside: each context describes it from the offset.
    assert_eq!(
        c.block_status_chunks(3, 0, 65 * K, 10 * 1024)
            .await
            .unwrap(),
        vec![
            (1, vec![(7 * 1024, 0), (3 * 1024, HZ)]),
            (2, vec![(10 * 1024, 0)]),
            (3, vec![(7 * 1024, D), (3 * 1024, 0)]),
        ]
    );
    // REQ_ONE: exactly one descriptor per context, never longer than asked.
    assert_eq!(
        c.block_status_chunks(4, CMD_FLAG_REQ_ONE, 60 * K, 16 * 1024)
            .await
            .unwrap(),
        vec![
            (1, vec![(4096, HZ)]),
            (2, vec![(16 * 1024, 0)]),
            (3, vec![(4096, 0)]),
        ]
    );
    assert_eq!(
        c.block_status_chunks(5, CMD_FLAG_REQ_ONE, 0, size)
            .await
            .unwrap(),
        vec![
            (1, vec![(64 * 1024, HZ)]),
            (2, vec![(4096, D)]),
            (3, vec![(64 * 1024, 0)]),
        ]
    );
    // A device answering a prefix only: each chunk is a prefix.
    s.dev.set_extents_max(1);
    assert_eq!(
        c.block_status_chunks(6, 0, 0, size).await.unwrap(),
        vec![
            (1, vec![(64 * 1024, HZ)]),
            (2, vec![(4096, D)]),
            (3, vec![(64 * 1024, 0)]),
        ]
    );
    assert!(c.disc().await.is_ok());

    // Bitmaps alone, without base:allocation: one chunk, DONE, with the bitmap's id.
    s.dev.set_extents_max(usize::MAX);
    let mut c = Client::structured(&s, small_cfg()).await;
    let r = c.meta(OPT_SET_META_CONTEXT, "vm01", &[SNAP1]).await;
    assert_eq!(selected(&r), [(2, SNAP1.to_owned())]);
    let r = c.info_go(OPT_GO, "vm01", &[]).await;
    assert_eq!(r.last().unwrap().0, REP_ACK);
    assert_eq!(
        c.block_status(1, 0, 0, size).await.unwrap(),
        (2, snap1.clone())
    );
    assert!(c.disc().await.is_ok());
}

#[tokio::test]
async fn an_error_in_any_context_is_the_only_chunk() {
    let s = setup();
    let mut c = Client::structured(&s, small_cfg()).await;
    let r = c
        .meta(OPT_SET_META_CONTEXT, "vm01", &[BASE, SNAP1, SNAP2])
        .await;
    assert_eq!(selected(&r).len(), 3);
    let r = c.info_go(OPT_GO, "vm01", &[]).await;
    assert_eq!(r.last().unwrap().0, REP_ACK);
    // The bitmaps' device call fails (after base:allocation answered): no chunk of the
    // answers already in hand goes out, just the error.
    s.dev
        .fail_dirty_next(DevError::new(DevErrorKind::Io, "bitmap unreadable"));
    assert_eq!(
        c.block_status_chunks(1, 0, 0, 8192).await,
        err(
            EIO,
            "block status of qemu:dirty-bitmap:snap1 failed: bitmap unreadable"
        )
    );
    // base:allocation failing (asked first) is the same.
    s.dev
        .fail_next(DevError::new(DevErrorKind::Unavailable, "volume moved"));
    assert_eq!(
        c.block_status_chunks(2, 0, 0, 8192).await,
        err(ESHUTDOWN, "block status failed: volume moved")
    );
    // A snapshot deleted after SET: the device refuses the bitmap.
    s.dev.remove_dirty_bitmap("snap2");
    assert_eq!(
        c.block_status_chunks(3, CMD_FLAG_REQ_ONE, 0, 8192).await,
        err(
            EINVAL,
            "block status of qemu:dirty-bitmap:snap2 failed: no dirty bitmap snap2"
        )
    );
    // The connection stays usable, and a bitmap back answers again.
    s.dev.set_dirty_bitmap("snap2", vec![]);
    assert_eq!(
        c.block_status_chunks(4, 0, 0, 8192).await.unwrap(),
        vec![
            (1, vec![(8192, HZ)]),
            (2, vec![(8192, 0)]),
            (3, vec![(8192, 0)]),
        ]
    );
    assert!(c.disc().await.is_ok());
}

/// Sets up a connection whose SET is `set` (export, queries), then GO `go` and returns
/// the answer to a BLOCK_STATUS of the first 4 KiB.
async fn block_status_after(
    s: &Setup,
    set: (&str, &[&str]),
    go: &str,
) -> Result<Vec<client::Extents>, ChunkError> {
    let mut c = Client::structured(s, small_cfg()).await;
    let r = c.meta(OPT_SET_META_CONTEXT, set.0, set.1).await;
    assert_eq!(r.last().unwrap().0, REP_ACK, "{r:?}");
    let r = c.info_go(OPT_GO, go, &[]).await;
    assert_eq!(r.last().unwrap().0, REP_ACK);
    let answer = c.block_status_chunks(1, 0, 0, 4096).await;
    assert!(c.disc().await.is_ok());
    answer
}

#[tokio::test]
async fn the_selection_holds_for_the_export_set_named() {
    let s = setup();
    // aaa offers a snap1 too, but a selection for aaa does not carry over to vm01.
    assert_eq!(
        block_status_after(&s, ("aaa", &[SNAP1]), "vm01").await,
        err(EINVAL, NO_CONTEXT)
    );
    assert_eq!(
        block_status_after(&s, ("vm01", &[BASE, SNAP1]), "aaa").await,
        err(EINVAL, NO_CONTEXT)
    );
    // Each export answers from its own bitmap.
    assert_eq!(
        block_status_after(&s, ("aaa", &[SNAP1]), "aaa").await,
        Ok(vec![(2, vec![(4096, D)])])
    );
    assert_eq!(
        block_status_after(&s, ("vm01", &[SNAP1]), "vm01").await,
        Ok(vec![(2, vec![(4096, 0)])])
    );
    // A later SET replaces the selection: bitmaps, then base:allocation alone.
    let mut c = Client::structured(&s, small_cfg()).await;
    let r = c.meta(OPT_SET_META_CONTEXT, "vm01", &[SNAP1, SNAP2]).await;
    assert_eq!(selected(&r).len(), 2);
    let r = c.meta(OPT_SET_META_CONTEXT, "vm01", &[BASE]).await;
    assert_eq!(selected(&r), [(1, BASE.to_owned())]);
    let r = c.info_go(OPT_GO, "vm01", &[]).await;
    assert_eq!(r.last().unwrap().0, REP_ACK);
    assert_eq!(
        c.block_status_chunks(1, 0, 0, 4096).await.unwrap(),
        vec![(1, vec![(4096, HZ)])]
    );
    assert!(c.disc().await.is_ok());
}

#[tokio::test]
async fn at_most_64_bitmaps_may_be_selected() {
    let dev = Arc::new(MemDev::new(SIZE));
    let names: Vec<String> = (0..70)
        .map(|i| format!("qemu:dirty-bitmap:b{i:02}"))
        .collect();
    for i in 0..70u64 {
        dev.set_dirty_bitmap(&format!("b{i:02}"), vec![(i * 4096, 4096)]);
    }
    let s = Setup {
        resolver: Arc::new(MemResolver::new().with_export("vm01", Arc::clone(&dev))),
        dev,
    };
    let q: Vec<&str> = names.iter().map(String::as_str).collect();
    let mut c = Client::structured(&s, small_cfg()).await;
    // 64 bitmaps (named twice) and base:allocation: 65 contexts, ids 1 to 65.
    let mut queries = vec![BASE];
    queries.extend_from_slice(&q[..64]);
    queries.extend_from_slice(&q[..64]);
    let r = c.meta(OPT_SET_META_CONTEXT, "vm01", &queries).await;
    let got = selected(&r);
    assert_eq!(got.len(), 65);
    for (i, (id, name)) in got.iter().enumerate() {
        assert_eq!(*id, i as u32 + 1);
        assert_eq!(name, if i == 0 { BASE } else { q[i - 1] });
    }
    // 65 bitmaps: refused as too big, and the earlier selection is gone.
    let r = c.meta(OPT_SET_META_CONTEXT, "vm01", &q[..65]).await;
    assert_eq!(r.len(), 1, "{r:?}");
    assert_eq!(r[0].0, REP_ERR_TOO_BIG);
    assert_eq!(
        String::from_utf8_lossy(&r[0].1),
        "65 qemu:dirty-bitmap: contexts asked for; at most 64 may be selected"
    );
    let r = c.info_go(OPT_GO, "vm01", &[]).await;
    assert_eq!(r.last().unwrap().0, REP_ACK);
    assert_eq!(
        c.block_status_chunks(1, 0, 0, 4096).await,
        err(EINVAL, NO_CONTEXT)
    );
    assert!(c.disc().await.is_ok());

    // The 65 contexts answer in 65 chunks, each bitmap its own runs.
    let mut c = Client::structured(&s, small_cfg()).await;
    let r = c.meta(OPT_SET_META_CONTEXT, "vm01", &queries).await;
    assert_eq!(selected(&r).len(), 65);
    let r = c.info_go(OPT_GO, "vm01", &[]).await;
    assert_eq!(r.last().unwrap().0, REP_ACK);
    let answer = c.block_status_chunks(1, 0, 0, 64 * 4096).await.unwrap();
    assert_eq!(answer.len(), 65);
    assert_eq!(answer[0], (1, vec![(64 * 4096, HZ)]));
    for (i, (id, d)) in answer[1..].iter().enumerate() {
        assert_eq!(*id, i as u32 + 2);
        let i = i as u32;
        let mut want = vec![(4096 * i, 0), (4096, D), (4096 * (63 - i), 0)];
        want.retain(|r| r.0 > 0);
        assert_eq!(*d, want, "bitmap b{i:02}");
    }
    assert!(c.disc().await.is_ok());
}

/// The descriptor bound is per reply: contexts share it, so a reply stays bounded however
/// many are selected.
#[tokio::test]
async fn selected_contexts_share_the_descriptor_bound() {
    let dev = Arc::new(MemDev::new(SIZE));
    // Alternating dirty and clean bytes: 80 000 runs.
    dev.set_dirty_bitmap("fine", (0..40_000u64).map(|i| (2 * i, 1)).collect());
    let s = Setup {
        resolver: Arc::new(MemResolver::new().with_export("vm01", Arc::clone(&dev))),
        dev,
    };
    let alternating = |d: &[(u32, u32)]| {
        d.iter()
            .enumerate()
            .all(|(i, &(l, f))| l == 1 && f == if i % 2 == 0 { D } else { 0 })
    };
    for (queries, runs) in [
        (&["qemu:dirty-bitmap:fine"][..], 65_536),
        (&[BASE, "qemu:dirty-bitmap:fine"][..], 32_768),
    ] {
        let mut c = Client::structured(&s, small_cfg()).await;
        let r = c.meta(OPT_SET_META_CONTEXT, "vm01", queries).await;
        assert_eq!(selected(&r).len(), queries.len());
        let r = c.info_go(OPT_GO, "vm01", &[]).await;
        assert_eq!(r.last().unwrap().0, REP_ACK);
        let answer = c.block_status_chunks(1, 0, 0, 100_000).await.unwrap();
        let (_, d) = answer.last().unwrap();
        assert_eq!(d.len(), runs, "{queries:?}");
        assert!(alternating(d));
        assert!(c.disc().await.is_ok());
    }
}
