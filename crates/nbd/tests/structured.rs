//! Protocol tests of structured replies, metadata contexts and NBD_CMD_BLOCK_STATUS with
//! the handwritten client (tests/client): what the handshake answers, what READ and
//! BLOCK_STATUS put on the wire, and that a device's bad answers never reach it.

// Test code: a failed unwrap is a failed test, with the line in the panic message.
#![allow(clippy::unwrap_used)]

mod client;

use std::sync::Arc;

use bytes::Bytes;
use client::{
    info_of, meta_context_of, pattern, setup, small_cfg, AnyReply, ChunkError, Client, SIZE,
};
use converge_nbd::proto::*;
use converge_nbd::{
    serve_connection, BlockDev, DevError, DevErrorKind, Extent, ResolveError, Resolver,
    ServerConfig,
};
use tokio::io::AsyncWriteExt;

const HZ: u32 = STATE_HOLE | STATE_ZERO;
const BASE: &str = "base:allocation";

fn tflags_of(r: &[(u32, Vec<u8>)]) -> u16 {
    let export = info_of(r, INFO_EXPORT).expect("NBD_INFO_EXPORT");
    u16::from_be_bytes([export[8], export[9]])
}

fn err(errno: u32, message: &str) -> Result<client::Extents, ChunkError> {
    Err(ChunkError {
        errno,
        message: message.to_owned(),
    })
}

#[tokio::test]
async fn structured_reply_negotiation_and_send_df() {
    let s = setup();
    // Without structured replies: no SEND_DF.
    let mut c = Client::fixed(&s, small_cfg()).await;
    let r = c.info_go(OPT_INFO, "vm01", &[]).await;
    assert_eq!(tflags_of(&r) & TFLAG_SEND_DF, 0);
    // Data is refused and changes nothing.
    c.opt(OPT_STRUCTURED_REPLY, b"x").await;
    assert_eq!(c.opt_reply(OPT_STRUCTURED_REPLY).await.0, REP_ERR_INVALID);
    let r = c.info_go(OPT_INFO, "vm01", &[]).await;
    assert_eq!(tflags_of(&r) & TFLAG_SEND_DF, 0);
    // Acknowledged once; a repeat is invalid but harmless.
    c.opt(OPT_STRUCTURED_REPLY, &[]).await;
    assert_eq!(c.opt_reply(OPT_STRUCTURED_REPLY).await, (REP_ACK, vec![]));
    c.opt(OPT_STRUCTURED_REPLY, &[]).await;
    let (typ, msg) = c.opt_reply(OPT_STRUCTURED_REPLY).await;
    assert_eq!(typ, REP_ERR_INVALID);
    assert!(String::from_utf8_lossy(&msg).contains("already"), "{msg:?}");
    let r = c.info_go(OPT_GO, "vm01", &[]).await;
    assert_eq!(r.last().unwrap().0, REP_ACK);
    let flags = tflags_of(&r);
    assert_ne!(flags & TFLAG_SEND_DF, 0);
    assert_ne!(flags & TFLAG_SEND_TRIM, 0);
    // Transmission now answers READ with chunks.
    assert_eq!(c.read_chunks(1, 0, 0, 4096).await.unwrap(), vec![0u8; 4096]);
    assert!(c.disc().await.is_ok());

    // Old-style EXPORT_NAME after structured replies: the flags say SEND_DF too.
    let mut c = Client::structured(&s, small_cfg()).await;
    c.opt(OPT_EXPORT_NAME, b"vm01").await;
    let mut b = [0u8; 10];
    tokio::io::AsyncReadExt::read_exact(&mut c.s, &mut b)
        .await
        .unwrap();
    assert_ne!(u16::from_be_bytes([b[8], b[9]]) & TFLAG_SEND_DF, 0);
    assert_eq!(
        c.read_chunks(2, CMD_FLAG_DF, 0, 100).await.unwrap(),
        vec![0u8; 100]
    );
    assert!(c.disc().await.is_ok());
}

#[tokio::test]
async fn list_meta_context_answers() {
    let s = setup();
    let mut c = Client::fixed(&s, small_cfg()).await;
    // Allowed before structured replies (the spec lets a server refuse; we answer).
    let r = c.meta(OPT_LIST_META_CONTEXT, "vm01", &[]).await;
    assert_eq!(r.len(), 2, "{r:?}");
    // LIST sends the reserved id 0.
    assert_eq!(meta_context_of(&r[0]), (0, BASE.to_owned()));
    assert_eq!(r[1], (REP_ACK, vec![]));
    c.opt(OPT_STRUCTURED_REPLY, &[]).await;
    assert_eq!(c.opt_reply(OPT_STRUCTURED_REPLY).await.0, REP_ACK);
    for queries in [
        &[][..],
        &["base:"][..],
        &[BASE][..],
        &["x-foo:", "base:", BASE, "base:"][..],
    ] {
        let r = c.meta(OPT_LIST_META_CONTEXT, "vm01", queries).await;
        assert_eq!(r.len(), 2, "{queries:?}: {r:?}");
        assert_eq!(meta_context_of(&r[0]), (0, BASE.to_owned()), "{queries:?}");
        assert_eq!(r[1], (REP_ACK, vec![]));
    }
    // Unknown namespaces and unknown leaves of base: are ignored: just the ACK.
    for queries in [
        &["qemu:dirty-bitmap:bitmap0"][..],
        &["x-converge:"][..],
        &["base:holes", "nonamespace"][..],
    ] {
        let r = c.meta(OPT_LIST_META_CONTEXT, "vm01", queries).await;
        assert_eq!(r, vec![(REP_ACK, vec![])], "{queries:?}");
    }
    // The export name is checked.
    let r = c.meta(OPT_LIST_META_CONTEXT, "nope", &[]).await;
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].0, REP_ERR_UNKNOWN);
    assert_eq!(r[0].1, b"export nope does not exist");
    let r = c.meta(OPT_LIST_META_CONTEXT, "vm02", &[BASE]).await;
    assert_eq!(r[0].0, REP_ERR_UNKNOWN);
    assert!(String::from_utf8_lossy(&r[0].1).contains("node 2"));
    // Malformed: a query length pointing past the data.
    let mut bad = meta_context_request("vm01", &[BASE]);
    bad.pop();
    c.opt(OPT_LIST_META_CONTEXT, &bad).await;
    assert_eq!(c.opt_reply(OPT_LIST_META_CONTEXT).await.0, REP_ERR_INVALID);
    // Still haggling.
    let r = c.info_go(OPT_GO, "vm01", &[]).await;
    assert_eq!(r.last().unwrap().0, REP_ACK);
    assert!(c.disc().await.is_ok());
}

#[tokio::test]
async fn set_meta_context_needs_structured_replies_and_selects_base_allocation_only() {
    let s = setup();
    let mut c = Client::fixed(&s, small_cfg()).await;
    let r = c.meta(OPT_SET_META_CONTEXT, "vm01", &[BASE]).await;
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].0, REP_ERR_INVALID);
    assert!(String::from_utf8_lossy(&r[0].1).contains("STRUCTURED_REPLY"));
    c.opt(OPT_STRUCTURED_REPLY, &[]).await;
    assert_eq!(c.opt_reply(OPT_STRUCTURED_REPLY).await.0, REP_ACK);
    // "base:" is a LIST wildcard only; unknown namespaces are ignored.
    for queries in [&["base:"][..], &["qemu:allocation-depth"][..], &[][..]] {
        let r = c.meta(OPT_SET_META_CONTEXT, "vm01", queries).await;
        assert_eq!(r, vec![(REP_ACK, vec![])], "{queries:?}");
    }
    // Selected once, even when asked for twice, with an id other than LIST's 0.
    let r = c
        .meta(OPT_SET_META_CONTEXT, "vm01", &["x-foo:bar", BASE, BASE])
        .await;
    assert_eq!(r.len(), 2, "{r:?}");
    let (id, name) = meta_context_of(&r[0]);
    assert_eq!(name, BASE);
    assert_ne!(id, 0);
    assert_eq!(r[1], (REP_ACK, vec![]));
    let r = c.info_go(OPT_GO, "vm01", &[]).await;
    assert_eq!(r.last().unwrap().0, REP_ACK);
    let (got, d) = c.block_status(1, 0, 0, 4096).await.unwrap();
    assert_eq!(got, id, "BLOCK_STATUS carries the id SET gave");
    assert_eq!(d, vec![(4096, HZ)]);
    assert!(c.disc().await.is_ok());
}

/// Sets up a connection whose last SET_META_CONTEXT is `last` (after a good one for vm01),
/// enters vm01 and returns the answer to a BLOCK_STATUS.
async fn block_status_after(
    last: impl AsyncFnOnce(&mut Client),
) -> Result<client::Extents, ChunkError> {
    let s = setup();
    let mut c = Client::structured(&s, small_cfg()).await;
    let r = c.meta(OPT_SET_META_CONTEXT, "vm01", &[BASE]).await;
    assert_eq!(r.last().unwrap().0, REP_ACK);
    last(&mut c).await;
    let r = c.info_go(OPT_GO, "vm01", &[]).await;
    assert_eq!(r.last().unwrap().0, REP_ACK);
    let answer = c.block_status(1, 0, 0, 4096).await;
    // Either way the connection stays usable.
    assert!(c.read_chunks(2, 0, 0, 512).await.is_ok());
    assert!(c.disc().await.is_ok());
    answer
}

#[tokio::test]
async fn a_later_set_replaces_the_selection_even_when_it_fails() {
    let no_context = "no metadata context selected: NBD_OPT_SET_META_CONTEXT base:allocation for this export first";
    // Control: nothing after the good SET.
    assert!(block_status_after(async |_| {}).await.is_ok());
    // A SET selecting nothing.
    let r = block_status_after(async |c| {
        let r = c.meta(OPT_SET_META_CONTEXT, "vm01", &["base:"]).await;
        assert_eq!(r, vec![(REP_ACK, vec![])]);
    })
    .await;
    assert_eq!(r, err(EINVAL, no_context));
    // A SET for an unknown export.
    let r = block_status_after(async |c| {
        let r = c.meta(OPT_SET_META_CONTEXT, "nope", &[BASE]).await;
        assert_eq!(r[0].0, REP_ERR_UNKNOWN);
    })
    .await;
    assert_eq!(r, err(EINVAL, no_context));
    // A malformed SET.
    let r = block_status_after(async |c| {
        c.opt(OPT_SET_META_CONTEXT, &[0, 0, 0, 4, b'v']).await;
        assert_eq!(c.opt_reply(OPT_SET_META_CONTEXT).await.0, REP_ERR_INVALID);
    })
    .await;
    assert_eq!(r, err(EINVAL, no_context));
    // A SET too large to read.
    let r = block_status_after(async |c| {
        c.opt(OPT_SET_META_CONTEXT, &vec![0u8; 20_000]).await;
        assert_eq!(c.opt_reply(OPT_SET_META_CONTEXT).await.0, REP_ERR_TOO_BIG);
    })
    .await;
    assert_eq!(r, err(EINVAL, no_context));
    // Other options in between change nothing.
    let r = block_status_after(async |c| {
        let r = c.meta(OPT_LIST_META_CONTEXT, "aaa", &[]).await;
        assert_eq!(r.last().unwrap().0, REP_ACK);
        let r = c.info_go(OPT_INFO, "aaa", &[]).await;
        assert_eq!(r.last().unwrap().0, REP_ACK);
    })
    .await;
    assert!(r.is_ok(), "{r:?}");
}

#[tokio::test]
async fn entering_another_export_than_set_named_drops_the_selection() {
    let s = setup();
    // SET for aaa, GO vm01: no context.
    let mut c = Client::structured(&s, small_cfg()).await;
    let r = c.meta(OPT_SET_META_CONTEXT, "aaa", &[BASE]).await;
    assert_eq!(r.len(), 2);
    let r = c.info_go(OPT_GO, "vm01", &[]).await;
    assert_eq!(r.last().unwrap().0, REP_ACK);
    let e = c.block_status(1, 0, 0, 4096).await.unwrap_err();
    assert_eq!(e.errno, EINVAL);
    assert!(c.disc().await.is_ok());
    // The same with EXPORT_NAME; and with the same name EXPORT_NAME keeps it.
    for (set_for, selected) in [("aaa", false), ("vm01", true)] {
        let mut c = Client::structured(&s, small_cfg()).await;
        let r = c.meta(OPT_SET_META_CONTEXT, set_for, &[BASE]).await;
        assert_eq!(r.len(), 2);
        c.opt(OPT_EXPORT_NAME, b"vm01").await;
        let mut b = [0u8; 10];
        tokio::io::AsyncReadExt::read_exact(&mut c.s, &mut b)
            .await
            .unwrap();
        let answer = c.block_status(2, 0, 0, 4096).await;
        assert_eq!(answer.is_ok(), selected, "SET for {set_for}: {answer:?}");
        assert!(c.disc().await.is_ok());
    }
}

#[tokio::test]
async fn read_replies_are_chunks_and_errors_carry_messages() {
    let s = setup();
    let (mut c, _) = Client::with_allocation(&s, small_cfg(), &[INFO_BLOCK_SIZE]).await;
    let data = pattern(16384, 5);
    // Writes and other payload-less successes keep simple replies.
    assert_eq!(c.write(1, 8192, &data).await, 0);
    c.request(CMD_READ, 0, 2, 8192, 16384).await;
    let (head, payload) = c.chunk(2).await;
    assert_eq!(head.typ, REPLY_TYPE_OFFSET_DATA);
    assert_eq!(head.flags, REPLY_FLAG_DONE, "one chunk, flagged DONE");
    assert_eq!(head.len, 8 + 16384);
    assert_eq!(u64::from_be_bytes(payload[0..8].try_into().unwrap()), 8192);
    assert!(payload[8..] == data[..]);
    // DF: never fragmented anyway.
    assert_eq!(
        c.read_chunks(3, CMD_FLAG_DF | CMD_FLAG_FUA, 12288, 4096)
            .await
            .unwrap(),
        data[4096..8192]
    );
    // Refusals of READ are error chunks too (never simple replies), with a message.
    let e = c
        .read_chunks(4, 0, SIZE as u64 - 4096, 8192)
        .await
        .unwrap_err();
    assert_eq!(
        e,
        ChunkError {
            errno: EINVAL,
            message: "request beyond the end of the export".into()
        }
    );
    let e = c
        .read_chunks(5, CMD_FLAG_REQ_ONE, 0, 4096)
        .await
        .unwrap_err();
    assert_eq!(e.errno, EINVAL);
    assert_eq!(
        c.read_chunks(6, 0, 512, 4096).await.unwrap_err().errno,
        EINVAL
    );
    let e = c.read_chunks(7, 0, 0, 128 * 1024).await.unwrap_err();
    assert_eq!(e.errno, EOVERFLOW);
    // Device errors name the operation and the device's reason.
    s.dev
        .fail_next(DevError::new(DevErrorKind::Unavailable, "volume moved"));
    let e = c.read_chunks(8, 0, 0, 4096).await.unwrap_err();
    assert_eq!(
        e,
        ChunkError {
            errno: ESHUTDOWN,
            message: "read failed: volume moved".into()
        }
    );
    // Other commands' errors are chunks as well.
    assert_eq!(
        c.cmd_any(CMD_WRITE_ZEROES, 0, 9, SIZE as u64, 4096)
            .await
            .unwrap_err()
            .errno,
        ENOSPC
    );
    s.dev
        .fail_next(DevError::new(DevErrorKind::Io, "disk on fire"));
    let e = c.cmd_any(CMD_FLUSH, 0, 10, 0, 0).await.unwrap_err();
    assert_eq!(e.message, "flush failed: disk on fire");
    assert!(c.cmd_any(CMD_TRIM, 0, 11, 8192, 4096).await.is_ok());
    // A device that panics: the slot's fallback answer is an error chunk.
    s.dev.panic_next();
    assert_eq!(c.read_chunks(12, 0, 0, 4096).await.unwrap_err().errno, EIO);
    assert!(c.disc().await.is_ok());
}

#[tokio::test]
async fn df_is_refused_without_structured_replies() {
    let s = setup();
    let mut c = Client::go(&s, small_cfg(), &[]).await;
    assert_eq!(c.cmd(CMD_READ, CMD_FLAG_DF, 1, 0, 4096).await, EINVAL);
    // BLOCK_STATUS without structured replies gets a simple EINVAL reply.
    assert_eq!(c.cmd(CMD_BLOCK_STATUS, 0, 2, 0, 4096).await, EINVAL);
    assert_eq!(c.read(3, 0, 4096).await.unwrap(), vec![0u8; 4096]);
    assert!(c.disc().await.is_ok());
}

#[tokio::test]
async fn block_status_reports_holes_zeroes_and_data() {
    let s = setup();
    let (mut c, id) = Client::with_allocation(&s, small_cfg(), &[]).await;
    const K: u64 = 1024;
    // Layout (1 MiB): data 64K..72K, NO_HOLE zeroes 128K..144K, trimmed zeroes 256K..260K
    // inside data 252K..264K, a 100-byte write at 512K+10 (its block becomes data).
    assert_eq!(c.write(1, 64 * K, &[1u8; 8192]).await, 0);
    assert!(c
        .cmd_any(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 2, 128 * K, 16384)
        .await
        .is_ok());
    assert_eq!(c.write(3, 252 * K, &[2u8; 12288]).await, 0);
    assert!(c
        .cmd_any(CMD_WRITE_ZEROES, 0, 4, 256 * K, 4096)
        .await
        .is_ok());
    assert_eq!(c.write(5, 512 * K + 10, &[3u8; 100]).await, 0);
    let want = vec![
        (64 * 1024, HZ),
        (8192, 0),
        (56 * 1024, HZ),
        (16384, STATE_ZERO),
        (108 * 1024, HZ),
        (4096, 0),
        (4096, HZ),
        (4096, 0),
        (248 * 1024, HZ),
        (4096, 0),
        (508 * 1024, HZ),
    ];
    assert_eq!(want.iter().map(|d| d.0 as usize).sum::<usize>(), SIZE);
    assert_eq!(
        c.block_status(6, 0, 0, SIZE as u32).await.unwrap(),
        (id, want.clone())
    );
    // A length beyond the maximum block size is fine: there is no payload.
    assert!(SIZE as u32 > small_cfg().max_request_bytes);
    // REQ_ONE: exactly one descriptor, never longer than asked.
    assert_eq!(
        c.block_status(7, CMD_FLAG_REQ_ONE, 0, SIZE as u32)
            .await
            .unwrap(),
        (id, vec![(64 * 1024, HZ)])
    );
    assert_eq!(
        c.block_status(8, CMD_FLAG_REQ_ONE, 0, 4096).await.unwrap(),
        (id, vec![(4096, HZ)])
    );
    assert_eq!(
        c.block_status(9, CMD_FLAG_REQ_ONE | CMD_FLAG_FUA, 66 * K, 8192)
            .await
            .unwrap(),
        (id, vec![(6144, 0)])
    );
    // Unaligned (no block sizes negotiated): descriptors start at the offset and stop at
    // the end of the range.
    assert_eq!(
        c.block_status(10, 0, 64 * K - 100, 200).await.unwrap(),
        (id, vec![(100, HZ), (100, 0)])
    );
    // The last byte of the export.
    assert_eq!(
        c.block_status(11, 0, SIZE as u64 - 1, 1).await.unwrap(),
        (id, vec![(1, HZ)])
    );
    // Trimming data makes a hole again; reads agree with what block status says.
    assert!(c.cmd_any(CMD_TRIM, 0, 12, 64 * K, 8192).await.is_ok());
    assert_eq!(
        c.block_status(13, 0, 0, 128 * 1024).await.unwrap(),
        (id, vec![(128 * 1024, HZ)])
    );
    let contents = s.dev.contents();
    let mut at = 0usize;
    for (len, flags) in want {
        if flags & STATE_ZERO != 0 {
            assert!(contents[at..at + len as usize].iter().all(|&b| b == 0));
        }
        at += len as usize;
    }
    assert!(c.disc().await.is_ok());
}

#[tokio::test]
async fn block_status_refusals() {
    let s = setup();
    // Structured replies but no context: an EINVAL error chunk that says why.
    let mut c = Client::structured(&s, small_cfg()).await;
    let r = c.info_go(OPT_GO, "vm01", &[]).await;
    assert_eq!(r.last().unwrap().0, REP_ACK);
    let e = c.block_status(1, 0, 0, 4096).await.unwrap_err();
    assert_eq!(e.errno, EINVAL);
    assert!(e.message.contains("SET_META_CONTEXT"), "{}", e.message);
    assert!(c.disc().await.is_ok());

    let (mut c, _) = Client::with_allocation(&s, small_cfg(), &[INFO_BLOCK_SIZE]).await;
    let end = SIZE as u64;
    let beyond = "request beyond the end of the export";
    assert_eq!(
        c.block_status(1, 0, end - 4096, 8192).await,
        err(EINVAL, beyond)
    );
    assert_eq!(c.block_status(2, 0, end, 4096).await, err(EINVAL, beyond));
    assert_eq!(
        c.block_status(3, 0, u64::MAX - 4095, 4096).await,
        err(EINVAL, beyond)
    );
    assert_eq!(c.block_status(4, 0, 0, u32::MAX).await, err(EINVAL, beyond));
    assert_eq!(
        c.block_status(5, 0, 0, 0).await,
        err(EINVAL, "zero-length request")
    );
    assert_eq!(
        c.block_status(6, CMD_FLAG_DF, 0, 4096).await,
        err(EINVAL, "command flags not valid for this command")
    );
    assert_eq!(
        c.block_status(7, 0, 512, 4096).await,
        err(EINVAL, "request not aligned to the minimum block size")
    );
    assert!(c.block_status(8, 0, 0, 4096).await.is_ok());
    assert!(c.disc().await.is_ok());
}

#[tokio::test]
async fn block_status_checks_what_the_device_answers() {
    let s = setup();
    let (mut c, id) = Client::with_allocation(&s, small_cfg(), &[]).await;
    let ext = |length, flags| Extent { length, flags };
    // Nothing at all, or only empty runs: EIO, never an empty chunk.
    for runs in [vec![], vec![ext(0, 0), ext(0, HZ)]] {
        s.dev.extents_next(runs);
        let e = c.block_status(1, 0, 0, 8192).await.unwrap_err();
        assert_eq!(e.errno, EIO);
        assert!(e.message.contains("no extent"), "{}", e.message);
    }
    // Runs past the range are cut; zero-length runs dropped, equal neighbours merged,
    // reserved flag bits cleared.
    s.dev.extents_next(vec![
        ext(4096, HZ),
        ext(0, 0),
        ext(2048, HZ | 0x100),
        ext(10_000, 0),
        ext(4096, STATE_ZERO),
    ]);
    assert_eq!(
        c.block_status(2, 0, 0, 8192).await.unwrap(),
        (id, vec![(6144, HZ), (2048, 0)])
    );
    // REQ_ONE with a device that answers many runs: the first one only, cut to the range.
    s.dev
        .extents_next(vec![ext(1 << 20, STATE_ZERO), ext(4096, 0)]);
    assert_eq!(
        c.block_status(3, CMD_FLAG_REQ_ONE, 4096, 4096)
            .await
            .unwrap(),
        (id, vec![(4096, STATE_ZERO)])
    );
    // A device that answers a prefix only: the reply says so, the client asks again.
    s.dev.extents_next(vec![ext(512, 0)]);
    assert_eq!(
        c.block_status(4, 0, 0, 8192).await.unwrap(),
        (id, vec![(512, 0)])
    );
    // More runs than a reply carries: capped at 65536 descriptors, a prefix of the answer.
    let many: Vec<Extent> = (0..100_000u32)
        .map(|i| ext(1, if i % 2 == 0 { 0 } else { HZ }))
        .collect();
    s.dev.extents_next(many);
    let (_, d) = c.block_status(5, 0, 0, 100_000).await.unwrap();
    assert_eq!(d.len(), 65536);
    assert!(d
        .iter()
        .enumerate()
        .all(|(i, &(l, f))| l == 1 && f == if i % 2 == 0 { 0 } else { HZ }));
    // Device errors become error chunks with the device's reason; panics, EIO.
    s.dev
        .fail_next(DevError::new(DevErrorKind::Io, "map unreadable"));
    assert_eq!(
        c.block_status(6, 0, 0, 4096).await,
        err(EIO, "block status failed: map unreadable")
    );
    s.dev.panic_next();
    assert_eq!(c.block_status(7, 0, 0, 4096).await.unwrap_err().errno, EIO);
    assert_eq!(
        c.block_status(8, 0, 0, 4096).await.unwrap(),
        (id, vec![(4096, HZ)])
    );
    assert!(c.disc().await.is_ok());
}

#[tokio::test]
async fn structured_replies_are_pipelined_and_counted() {
    let s = setup();
    let cfg = small_cfg();
    let stats = Arc::clone(&cfg.stats);
    let (mut c, id) = Client::with_allocation(&s, cfg, &[]).await;
    s.dev.gate(0);
    c.request(CMD_READ, 0, 100, 0, 4096).await;
    c.request(CMD_BLOCK_STATUS, 0, 101, 0, 4096).await;
    c.request(CMD_BLOCK_STATUS, 0, 102, 8192, 4096).await;
    c.request(CMD_WRITE, 0, 103, 4096, 4).await;
    c.s.write_all(b"abcd").await.unwrap();
    c.request(CMD_READ, 0, 104, SIZE as u64, 1).await;
    // Everything not held at offset 0 answers first, in whatever order.
    let mut seen = Vec::new();
    for _ in 0..3 {
        match c.any_reply().await {
            AnyReply::Simple { errno: 0, handle } => seen.push(handle),
            AnyReply::Chunk { head, payload } => {
                if head.handle == 102 {
                    assert_eq!(head.typ, REPLY_TYPE_BLOCK_STATUS);
                    assert_eq!(u32::from_be_bytes(payload[0..4].try_into().unwrap()), id);
                } else {
                    assert_eq!(head.handle, 104);
                    assert_eq!(head.typ, REPLY_TYPE_ERROR);
                }
                seen.push(head.handle);
            }
            other => panic!("{other:?}"),
        }
    }
    seen.sort();
    assert_eq!(seen, vec![102, 103, 104]);
    s.dev.open(0);
    let mut held = Vec::new();
    for _ in 0..2 {
        match c.any_reply().await {
            AnyReply::Chunk { head, .. } => held.push((head.handle, head.typ)),
            other => panic!("{other:?}"),
        }
    }
    held.sort();
    assert_eq!(
        held,
        vec![
            (100, REPLY_TYPE_OFFSET_DATA),
            (101, REPLY_TYPE_BLOCK_STATUS)
        ]
    );
    let snap = stats.snapshot();
    assert_eq!(snap.requests, 5);
    assert_eq!(snap.errors, 1);
    assert_eq!(snap.bytes_read, 4096, "only READ data counts as bytes read");
    assert!(c.disc().await.is_ok());
}

/// A device far larger than RAM, for what MemDev cannot hold. It keeps the trait's
/// default block status (all data, exactly the length asked for), so the length of the
/// answer is the length the server asked the device about.
struct Huge;

impl BlockDev for Huge {
    fn size_bytes(&self) -> u64 {
        16 << 30
    }
    async fn read(&self, _offset: u64, len: u32) -> Result<Bytes, DevError> {
        Ok(Bytes::from(vec![0u8; len as usize]))
    }
    async fn write(&self, _offset: u64, _data: Bytes, _fua: bool) -> Result<(), DevError> {
        Ok(())
    }
    async fn flush(&self) -> Result<(), DevError> {
        Ok(())
    }
    async fn trim(&self, _offset: u64, _len: u32) -> Result<(), DevError> {
        Ok(())
    }
    async fn write_zeroes(&self, _o: u64, _l: u32, _may_trim: bool) -> Result<(), DevError> {
        Ok(())
    }
}

struct HugeResolver(Arc<Huge>);

impl Resolver for HugeResolver {
    type Dev = Huge;
    async fn list(&self) -> Vec<String> {
        vec!["big".to_owned()]
    }
    async fn resolve(&self, export: &str) -> Result<Arc<Huge>, ResolveError> {
        match export {
            "big" => Ok(Arc::clone(&self.0)),
            _ => Err(ResolveError::Unknown),
        }
    }
}

#[tokio::test]
async fn block_status_asks_the_default_device_about_at_most_1_gib() {
    let (s, srv) = tokio::io::duplex(64 * 1024);
    let server = tokio::spawn(serve_connection(
        srv,
        Arc::new(HugeResolver(Arc::new(Huge))),
        ServerConfig::default(),
    ));
    let mut c = Client { s, server };
    c.hello(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).await;
    c.opt(OPT_STRUCTURED_REPLY, &[]).await;
    assert_eq!(c.opt_reply(OPT_STRUCTURED_REPLY).await.0, REP_ACK);
    let r = c.meta(OPT_SET_META_CONTEXT, "big", &[BASE]).await;
    let (id, _) = meta_context_of(&r[0]);
    let r = c.info_go(OPT_GO, "big", &[INFO_BLOCK_SIZE]).await;
    assert_eq!(r.last().unwrap().0, REP_ACK);
    // The largest length the protocol carries, aligned to 4096: the device is asked
    // about 1 GiB, and the client learns about that prefix.
    let len = u32::MAX - 4095;
    assert_eq!(
        c.block_status(1, 0, 4 << 30, len).await.unwrap(),
        (id, vec![(1 << 30, 0)])
    );
    // Shorter requests are passed through as they are.
    let len = (1 << 30) - 4096;
    assert_eq!(
        c.block_status(2, CMD_FLAG_REQ_ONE, 0, len).await.unwrap(),
        (id, vec![(len, 0)])
    );
    assert!(c.disc().await.is_ok());
}
