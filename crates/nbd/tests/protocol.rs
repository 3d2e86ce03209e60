//! Protocol tests with a handwritten NBD client over an in-memory duplex pipe: the
//! handshake and transmission with simple replies (structured replies: `structured.rs`).

// Test code: a failed unwrap is a failed test, with the line in the panic message.
#![allow(clippy::unwrap_used)]

mod client;

use std::sync::Arc;
use std::time::Duration;

use client::{info_of, pattern, setup, small_cfg, Client, OPT_UNKNOWN, SIZE};
use converge_nbd::proto::*;
use converge_nbd::{DevError, DevErrorKind, NbdError, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn list_then_abort() {
    let s = setup();
    let mut c = Client::fixed(&s, small_cfg()).await;
    c.opt(OPT_LIST, &[]).await;
    let mut names = Vec::new();
    loop {
        let (typ, d) = c.opt_reply(OPT_LIST).await;
        if typ == REP_ACK {
            break;
        }
        assert_eq!(typ, REP_SERVER);
        let n = u32::from_be_bytes(d[0..4].try_into().unwrap()) as usize;
        names.push(String::from_utf8(d[4..4 + n].to_vec()).unwrap());
    }
    assert_eq!(names, vec!["aaa", "vm01"]);
    c.opt(OPT_LIST, b"x").await;
    assert_eq!(c.opt_reply(OPT_LIST).await.0, REP_ERR_INVALID);
    c.opt(OPT_ABORT, &[]).await;
    assert_eq!(c.opt_reply(OPT_ABORT).await.0, REP_ACK);
    c.expect_eof().await;
    assert!(c.server.await.unwrap().is_ok());
}

#[tokio::test]
async fn info_reports_export_and_block_sizes_and_stays_in_haggling() {
    let s = setup();
    let mut c = Client::fixed(&s, small_cfg()).await;
    let r = c
        .info_go(
            OPT_INFO,
            "vm01",
            &[INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE],
        )
        .await;
    assert_eq!(r.last().unwrap().0, REP_ACK);
    let export = info_of(&r, INFO_EXPORT).expect("NBD_INFO_EXPORT");
    assert_eq!(
        u64::from_be_bytes(export[0..8].try_into().unwrap()),
        SIZE as u64
    );
    let flags = u16::from_be_bytes([export[8], export[9]]);
    for f in [
        TFLAG_HAS_FLAGS,
        TFLAG_SEND_FLUSH,
        TFLAG_SEND_FUA,
        TFLAG_SEND_TRIM,
        TFLAG_SEND_WRITE_ZEROES,
        TFLAG_CAN_MULTI_CONN,
    ] {
        assert_ne!(flags & f, 0, "flag {f:#x} missing from {flags:#x}");
    }
    assert_eq!(flags & TFLAG_READ_ONLY, 0);
    let bs = info_of(&r, INFO_BLOCK_SIZE).expect("NBD_INFO_BLOCK_SIZE");
    let words: Vec<u32> = bs
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(words, vec![4096, 4096, 64 * 1024]);
    assert_eq!(info_of(&r, INFO_NAME).unwrap(), b"vm01");
    assert_eq!(info_of(&r, INFO_DESCRIPTION).unwrap(), b"test disk");

    // Block size is sent even when not asked for; name is not.
    let r = c.info_go(OPT_INFO, "vm01", &[]).await;
    assert!(info_of(&r, INFO_BLOCK_SIZE).is_some());
    assert!(info_of(&r, INFO_NAME).is_none());

    // Still haggling: GO now works.
    let r = c.info_go(OPT_GO, "vm01", &[]).await;
    assert_eq!(r.last().unwrap().0, REP_ACK);
    assert!(c.read(1, 0, 4096).await.is_ok());
    assert!(c.disc().await.is_ok());
}

#[tokio::test]
async fn go_refusals_carry_messages_and_connection_continues() {
    let s = setup();
    let mut c = Client::fixed(&s, small_cfg()).await;
    let r = c.info_go(OPT_GO, "nope", &[]).await;
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].0, REP_ERR_UNKNOWN);
    let msg = String::from_utf8(r[0].1.clone()).unwrap();
    assert!(msg.contains("nope"), "{msg}");

    let r = c.info_go(OPT_GO, "vm02", &[]).await;
    assert_eq!(r[0].0, REP_ERR_UNKNOWN);
    assert_eq!(
        String::from_utf8(r[0].1.clone()).unwrap(),
        "volume vm02 is owned by node 2 (127.0.0.2); connect there"
    );
    let r = c.info_go(OPT_INFO, "vm03", &[]).await;
    assert_eq!(r[0].0, REP_ERR_UNKNOWN);
    assert!(String::from_utf8_lossy(&r[0].1).contains("resyncing"));

    // Malformed GO body.
    c.opt(OPT_GO, &[0, 0, 0, 9, b'x']).await;
    assert_eq!(c.opt_reply(OPT_GO).await.0, REP_ERR_INVALID);

    let r = c.info_go(OPT_GO, "vm01", &[]).await;
    assert_eq!(r.last().unwrap().0, REP_ACK);
    assert!(c.disc().await.is_ok());
}

#[tokio::test]
async fn unsupported_and_oversized_options() {
    let s = setup();
    let mut c = Client::fixed(&s, small_cfg()).await;
    // NBD_OPT_EXTENDED_HEADERS (11): not offered.
    c.opt(11, &[]).await;
    assert_eq!(c.opt_reply(11).await.0, REP_ERR_UNSUP);
    c.opt(OPT_UNKNOWN, b"whatever").await;
    assert_eq!(c.opt_reply(OPT_UNKNOWN).await.0, REP_ERR_UNSUP);
    c.opt(OPT_STARTTLS, &[]).await;
    assert!(c.opt_reply(OPT_STARTTLS).await.0 & (1 << 31) != 0);
    // Too large to be valid but small enough to skip: refused, stream stays in sync.
    c.opt(OPT_GO, &vec![0u8; 100_000]).await;
    assert_eq!(c.opt_reply(OPT_GO).await.0, REP_ERR_TOO_BIG);
    let r = c.info_go(OPT_INFO, "vm01", &[]).await;
    assert_eq!(r.last().unwrap().0, REP_ACK);
    // Absurd length: refused without being read, then the server hangs up.
    let mut b = IHAVEOPT.to_be_bytes().to_vec();
    b.extend_from_slice(&OPT_GO.to_be_bytes());
    b.extend_from_slice(&u32::MAX.to_be_bytes());
    c.s.write_all(&b).await.unwrap();
    assert_eq!(c.opt_reply(OPT_GO).await.0, REP_ERR_TOO_BIG);
    c.expect_eof().await;
    assert!(matches!(
        c.server.await.unwrap(),
        Err(NbdError::OptionTooLarge { .. })
    ));
}

#[tokio::test]
async fn export_name_old_way_with_and_without_zeroes() {
    let s = setup();
    for cflags in [
        FLAG_C_FIXED_NEWSTYLE,
        FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES,
        0,
    ] {
        let mut c = Client::connect(&s, small_cfg());
        c.hello(cflags).await;
        c.opt(OPT_EXPORT_NAME, b"vm01").await;
        let mut b = [0u8; 10];
        c.s.read_exact(&mut b).await.unwrap();
        assert_eq!(u64::from_be_bytes(b[0..8].try_into().unwrap()), SIZE as u64);
        assert_ne!(u16::from_be_bytes([b[8], b[9]]) & TFLAG_HAS_FLAGS, 0);
        if cflags & FLAG_C_NO_ZEROES == 0 {
            let mut z = [1u8; 124];
            c.s.read_exact(&mut z).await.unwrap();
            assert!(z.iter().all(|&x| x == 0));
        }
        // No block sizes negotiated: unaligned I/O reaches the device.
        assert_eq!(c.write(7, 100, b"hello").await, 0);
        assert_eq!(c.read(8, 100, 5).await.unwrap(), b"hello");
        assert!(c.disc().await.is_ok());
    }
    // Unknown export via EXPORT_NAME cannot be answered: the server hangs up.
    let mut c = Client::connect(&s, small_cfg());
    c.hello(FLAG_C_FIXED_NEWSTYLE).await;
    c.opt(OPT_EXPORT_NAME, b"vm02").await;
    c.expect_eof().await;
    match c.server.await.unwrap() {
        Err(NbdError::ExportRefused(m)) => assert!(m.contains("node 2"), "{m}"),
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test]
async fn bad_client_flags_and_garbage_end_the_connection() {
    let s = setup();
    let mut c = Client::connect(&s, small_cfg());
    c.hello(1 << 7).await;
    c.expect_eof().await;
    assert!(matches!(
        c.server.await.unwrap(),
        Err(NbdError::ClientFlags(_))
    ));

    let mut c = Client::fixed(&s, small_cfg()).await;
    c.s.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    c.expect_eof().await;
    assert!(matches!(
        c.server.await.unwrap(),
        Err(NbdError::BadMagic { .. })
    ));

    // Non-fixed client sending a non-EXPORT_NAME option.
    let mut c = Client::connect(&s, small_cfg());
    c.hello(0).await;
    c.opt(OPT_LIST, &[]).await;
    c.expect_eof().await;
    assert!(c.server.await.unwrap().is_err());

    // Garbage in transmission.
    let mut c = Client::go(&s, small_cfg(), &[]).await;
    c.s.write_all(&[0xffu8; 28]).await.unwrap();
    c.expect_eof().await;
    assert!(matches!(
        c.server.await.unwrap(),
        Err(NbdError::BadMagic { .. })
    ));

    // Hang-up in the middle of a write payload.
    let mut c = Client::go(&s, small_cfg(), &[]).await;
    c.request(CMD_WRITE, 0, 1, 0, 4096).await;
    c.s.write_all(&[1u8; 100]).await.unwrap();
    drop(c.s);
    assert!(matches!(c.server.await.unwrap(), Err(NbdError::Truncated)));
}

#[tokio::test]
async fn read_write_flush_trim_zeroes_roundtrip() {
    let s = setup();
    let mut c = Client::go(&s, small_cfg(), &[INFO_BLOCK_SIZE]).await;
    let data = pattern(64 * 1024, 3);
    assert_eq!(c.write(1, 8192, &data).await, 0);
    assert_eq!(c.read(2, 8192, data.len() as u32).await.unwrap(), data);
    assert_eq!(&s.dev.contents()[8192..8192 + data.len()], &data[..]);
    // FUA write.
    c.request(CMD_WRITE, CMD_FLAG_FUA, 3, 0, 4096).await;
    c.s.write_all(&[9u8; 4096]).await.unwrap();
    assert_eq!(c.reply().await, (0, 3));
    let before = s.dev.flushes();
    assert_eq!(c.cmd(CMD_FLUSH, 0, 4, 0, 0).await, 0);
    assert_eq!(s.dev.flushes(), before + 1);
    assert_eq!(c.cmd(CMD_TRIM, 0, 5, 8192, 4096).await, 0);
    assert_eq!(c.read(6, 8192, 4096).await.unwrap(), vec![0u8; 4096]);
    // Zeroes with FUA flush after the zeroing.
    let before = s.dev.flushes();
    assert_eq!(
        c.cmd(
            CMD_WRITE_ZEROES,
            CMD_FLAG_NO_HOLE | CMD_FLAG_FUA,
            7,
            12288,
            8192
        )
        .await,
        0
    );
    assert_eq!(s.dev.flushes(), before + 1);
    assert_eq!(c.read(8, 12288, 8192).await.unwrap(), vec![0u8; 8192]);
    assert_eq!(c.read(9, 20480, 4096).await.unwrap(), data[12288..16384]);
    assert!(c.disc().await.is_ok());
}

#[tokio::test]
async fn pipelined_requests_complete_out_of_order() {
    let s = setup();
    let mut c = Client::go(&s, small_cfg(), &[]).await;
    s.dev.gate(0);
    c.request(CMD_READ, 0, 100, 0, 4096).await;
    c.request(CMD_WRITE, 0, 101, 4096, 4).await;
    c.s.write_all(b"abcd").await.unwrap();
    c.request(CMD_READ, 0, 102, 4096, 4).await;
    // The write and read behind the held read finish first.
    let mut seen = Vec::new();
    for _ in 0..2 {
        let (err, h) = c.reply().await;
        assert_eq!(err, 0);
        if h == 102 {
            let mut d = [0u8; 4];
            c.s.read_exact(&mut d).await.unwrap();
            assert!(&d == b"abcd" || d == [0; 4]);
        }
        seen.push(h);
    }
    seen.sort();
    assert_eq!(seen, vec![101, 102]);
    s.dev.open(0);
    assert_eq!(c.reply().await, (0, 100));
    let mut d = vec![0u8; 4096];
    c.s.read_exact(&mut d).await.unwrap();
    assert!(c.disc().await.is_ok());
}

#[tokio::test]
async fn inflight_is_bounded_per_connection() {
    let s = setup();
    let cfg = ServerConfig {
        inflight_max: 2,
        ..small_cfg()
    };
    let mut c = Client::go(&s, cfg, &[]).await;
    s.dev.gate(0);
    // Two held requests use up the slots; the third waits even though it could run.
    c.request(CMD_READ, 0, 1, 0, 512).await;
    c.request(CMD_READ, 0, 2, 0, 512).await;
    c.request(CMD_READ, 0, 3, 4096, 512).await;
    let mut b = [0u8; 1];
    let early = tokio::time::timeout(Duration::from_millis(200), c.s.read(&mut b)).await;
    assert!(
        early.is_err(),
        "no reply may arrive while all slots are held"
    );
    s.dev.open(0);
    let mut handles = Vec::new();
    for _ in 0..3 {
        let (err, h) = c.reply().await;
        assert_eq!(err, 0);
        let mut d = vec![0u8; 512];
        c.s.read_exact(&mut d).await.unwrap();
        handles.push(h);
    }
    handles.sort();
    assert_eq!(handles, vec![1, 2, 3]);
    assert!(c.disc().await.is_ok());
}

#[tokio::test]
async fn bad_requests_get_errors_and_connection_stays_usable() {
    let s = setup();
    let mut c = Client::go(&s, small_cfg(), &[INFO_BLOCK_SIZE]).await;
    let end = SIZE as u64;
    assert_eq!(c.read(1, end - 4096, 8192).await, Err(EINVAL));
    assert_eq!(c.read(2, u64::MAX - 4095, 4096).await, Err(EINVAL));
    // Write past the end: ENOSPC, payload consumed.
    assert_eq!(c.write(3, end, &[7u8; 4096]).await, ENOSPC);
    assert_eq!(c.cmd(CMD_WRITE_ZEROES, 0, 4, end, 4096).await, ENOSPC);
    assert_eq!(c.cmd(CMD_TRIM, 0, 5, end, 4096).await, EINVAL);
    // Oversized read and write (64 KiB limit here); the write payload is skipped.
    assert_eq!(c.read(6, 0, 128 * 1024).await, Err(EOVERFLOW));
    assert_eq!(c.write(7, 0, &vec![5u8; 128 * 1024]).await, EOVERFLOW);
    assert_eq!(c.read(8, 0, 4096).await.unwrap(), vec![0u8; 4096]);
    // Unknown command and unknown/inapplicable flags.
    assert_eq!(c.cmd(42, 0, 9, 0, 4096).await, EINVAL);
    assert_eq!(c.cmd(CMD_READ, 1 << 9, 10, 0, 4096).await, EINVAL);
    assert_eq!(c.cmd(CMD_TRIM, CMD_FLAG_NO_HOLE, 11, 0, 4096).await, EINVAL);
    // Zero length.
    assert_eq!(c.cmd(CMD_READ, 0, 12, 0, 0).await, EINVAL);
    // Misaligned, with block sizes negotiated.
    assert_eq!(c.read(13, 512, 4096).await, Err(EINVAL));
    assert_eq!(c.write(14, 4096, &[1u8; 1000]).await, EINVAL);
    // Still fine.
    assert_eq!(c.write(15, 4096, &[1u8; 4096]).await, 0);
    assert_eq!(c.read(16, 4096, 4096).await.unwrap(), vec![1u8; 4096]);
    assert!(s.dev.contents()[..4096].iter().all(|&b| b == 0));
    assert!(c.disc().await.is_ok());
}

#[tokio::test]
async fn write_too_large_to_skip_is_refused_then_disconnected() {
    let s = setup();
    let mut c = Client::go(&s, small_cfg(), &[]).await;
    c.request(CMD_WRITE, 0, 1, 0, u32::MAX).await;
    assert_eq!(c.reply().await, (EOVERFLOW, 1));
    c.expect_eof().await;
    assert!(c.server.await.unwrap().is_ok());
}

#[tokio::test]
async fn misaligned_requests_pass_through_without_block_size_negotiation() {
    let s = setup();
    let mut c = Client::go(&s, small_cfg(), &[INFO_NAME]).await;
    assert_eq!(c.write(1, 513, b"xyz").await, 0);
    assert_eq!(c.read(2, 512, 5).await.unwrap(), b"\0xyz\0");
    assert!(c.disc().await.is_ok());
}

#[tokio::test]
async fn device_errors_map_to_nbd_errors() {
    let s = setup();
    let mut c = Client::go(&s, small_cfg(), &[]).await;
    for (kind, want) in [
        (DevErrorKind::Io, EIO),
        (DevErrorKind::NoSpace, ENOSPC),
        (DevErrorKind::Invalid, EINVAL),
        (DevErrorKind::Overflow, EOVERFLOW),
        (DevErrorKind::Unavailable, ESHUTDOWN),
    ] {
        s.dev.fail_next(DevError::new(kind, "injected"));
        assert_eq!(c.read(1, 0, 4096).await, Err(want), "{kind:?}");
    }
    s.dev.fail_next(DevError::new(DevErrorKind::Io, "injected"));
    assert_eq!(c.cmd(CMD_FLUSH, 0, 2, 0, 0).await, EIO);
    assert!(c.read(3, 0, 4096).await.is_ok());
    assert!(c.disc().await.is_ok());
}

#[tokio::test]
async fn panicking_device_op_is_answered_with_eio() {
    let s = setup();
    let mut c = Client::go(&s, small_cfg(), &[]).await;
    s.dev.panic_next();
    assert_eq!(c.read(1, 0, 4096).await, Err(EIO));
    assert!(c.read(2, 0, 4096).await.is_ok());
    assert!(c.disc().await.is_ok());
}

#[tokio::test]
async fn disc_waits_for_inflight_requests() {
    let s = setup();
    let mut c = Client::go(&s, small_cfg(), &[]).await;
    s.dev.gate(0);
    c.request(CMD_WRITE, 0, 77, 0, 4).await;
    c.s.write_all(b"last").await.unwrap();
    c.request(CMD_DISC, 0, 0, 0, 0).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        !c.server.is_finished(),
        "server must wait for the held write"
    );
    s.dev.open(0);
    assert_eq!(c.reply().await, (0, 77));
    c.expect_eof().await;
    assert!(c.server.await.unwrap().is_ok());
    assert_eq!(&s.dev.contents()[..4], b"last");
}

#[tokio::test]
async fn read_only_export_refuses_writes() {
    let s = setup();
    let cfg = ServerConfig {
        read_only: true,
        ..small_cfg()
    };
    let mut c = Client::fixed(&s, cfg).await;
    let r = c.info_go(OPT_GO, "vm01", &[]).await;
    let export = info_of(&r, INFO_EXPORT).unwrap();
    let flags = u16::from_be_bytes([export[8], export[9]]);
    assert_ne!(flags & TFLAG_READ_ONLY, 0);
    assert_eq!(flags & TFLAG_SEND_TRIM, 0);
    assert_eq!(c.write(1, 0, &[1u8; 4096]).await, EPERM);
    assert_eq!(c.cmd(CMD_TRIM, 0, 2, 0, 4096).await, EPERM);
    assert!(c.read(3, 0, 4096).await.is_ok());
    assert!(c.disc().await.is_ok());
}

#[tokio::test]
async fn multi_conn_shares_the_device_and_counts_stats() {
    let s = setup();
    let cfg = small_cfg();
    let stats = Arc::clone(&cfg.stats);
    let mut a = Client::go(&s, cfg.clone(), &[]).await;
    let mut b = Client::go(&s, cfg, &[]).await;
    let data = pattern(4096, 9);
    assert_eq!(a.write(1, 4096, &data).await, 0);
    assert_eq!(b.cmd(CMD_FLUSH, 0, 2, 0, 0).await, 0);
    assert_eq!(b.read(3, 4096, 4096).await.unwrap(), data);
    assert_eq!(b.read(4, SIZE as u64, 4096).await, Err(EINVAL));
    let snap = stats.snapshot();
    assert_eq!(snap.connections_active, 2);
    assert_eq!(snap.requests, 4);
    assert_eq!(snap.errors, 1);
    assert_eq!(snap.bytes_written, 4096);
    assert!(a.disc().await.is_ok());
    assert!(b.disc().await.is_ok());
    assert_eq!(stats.snapshot().connections_active, 0);
}

#[tokio::test(start_paused = true)]
async fn idle_handshake_times_out() {
    let s = setup();
    let cfg = ServerConfig {
        handshake_timeout_ms: 1000,
        ..small_cfg()
    };
    let mut c = Client::connect(&s, cfg);
    c.hello(FLAG_C_FIXED_NEWSTYLE).await;
    let r = c.server.await.unwrap();
    assert!(matches!(r, Err(NbdError::HandshakeTimeout(1000))), "{r:?}");
}
