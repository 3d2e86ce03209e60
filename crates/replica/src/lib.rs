//! The replica service: runs one [`ExtentOp`] on a drive's [`Tier`] and answers it. The node
//! daemon runs it for the copies on its own drives, whether its own volumes or its peers'
//! requests ask, and the simulator runs the very same function on its simulated drives, so
//! a passing seed speaks for the code that ships.
//!
//! Left to the caller, because it differs by where the drive lives: finding the drive, the
//! daemon's admission check of a new extent against the slab records, and the thread the
//! blocking engine call runs on.

use bytes::Bytes;
use converge_engine::{AlignedBuf, Durable, EngineError, Tier};
use converge_types::{BlocksReply, Epoch, ExtentOp, ExtentReply, ReadReply, Version, MAX_IO_BYTES};
use converge_volume::ReplicaError;

/// Runs `op` on `tier` (blocking: the engine writes and syncs before it returns). The epoch
/// checks are the engine's: every operation but `Free` is refused below the extent's epoch.
pub fn execute(tier: &Tier, op: ExtentOp) -> Result<ExtentReply, EngineError> {
    let (reply, durable) = start(tier, op)?;
    durable.wait()?;
    Ok(reply)
}

/// A version is `epoch << 32 | sequence` (docs/adr/0003): an owner stamps only versions of
/// its own term or, when it copies blocks, of older ones. A version of a later term than
/// the request's epoch would stand above every write the real owner makes from then on (its
/// writes would be acked and silently dropped), so it is refused, whether it is written
/// or names a bound (release, settle, revert). Within the term, only the owner sends
/// versions at all (`converge_allocator::admission`: a peer's request comes from the
/// volume's owner), so none can stand above the owner's own sequence.
fn check_versions(op: &ExtentOp) -> Result<(), EngineError> {
    let later = |epoch: Epoch, v: &Version| v.0 >> 32 > epoch.0;
    let bad = match op {
        ExtentOp::Write { epoch, version, .. }
        | ExtentOp::WriteHeld { epoch, version, .. }
        | ExtentOp::Zero { epoch, version, .. } => Some(*version)
            .filter(|v| later(*epoch, v))
            .map(|v| (*epoch, v)),
        // Only what is written: an expected version is compared, never stored (the owner
        // expects one no block can have, u64::MAX, to skip a block).
        ExtentOp::WriteBlocks {
            epoch, versions, ..
        }
        | ExtentOp::WriteShadow {
            epoch, versions, ..
        } => versions
            .iter()
            .find(|v| later(*epoch, v))
            .map(|v| (*epoch, *v)),
        // A bound that names a later term would reach every write the owner makes from
        // then on: a release would free them, a settle drop their priors, a revert undo
        // them (`Release { upto: u64::MAX }` freed a copy whatever it held).
        ExtentOp::Release { epoch, upto, .. }
        | ExtentOp::Revert {
            epoch,
            version: upto,
            ..
        } => Some(*upto)
            .filter(|v| later(*epoch, v))
            .map(|v| (*epoch, v)),
        ExtentOp::Settle {
            epoch, upto, rows, ..
        } => std::iter::once(upto)
            .chain(rows.iter().map(|r| &r.upto))
            .find(|v| later(*epoch, v))
            .map(|v| (*epoch, *v)),
        _ => None,
    };
    match bad {
        Some((epoch, v)) => Err(EngineError::InvalidArgument(format!(
            "{} of volume {} slab {}: version {v} belongs to term {}, later than the \
             request's epoch {epoch}",
            op.name(),
            op.key().volume,
            op.key().slab,
            v.0 >> 32
        ))),
        None => Ok(()),
    }
}

/// Runs `op` on `tier` up to the wait for durability: the answer, which may be sent only
/// once the returned [`Durable`] has been waited for (blocking with `Durable::wait`, as
/// [`execute`] does, or polled from a task). Only writes and zeroes return before they are
/// durable; every other operation is whole when this returns.
/// Keeps the extent's codec the one its owner writes with (docs/adr/0010): the drive
/// compresses writes (destaged ones included) with it. One table lookup when it is
/// unchanged; a change allocates the extent as the write would.
fn set_codec(
    tier: &Tier,
    key: converge_types::ExtentKey,
    epoch: converge_types::Epoch,
    codec: converge_types::Compression,
) -> Result<(), EngineError> {
    if tier.codec_of(key) != codec {
        tier.set_codec(key, epoch, codec)?;
    }
    Ok(())
}

pub fn start(tier: &Tier, op: ExtentOp) -> Result<(ExtentReply, Durable), EngineError> {
    // A read's length comes from a peer: refuse what the engine would refuse before
    // allocating its buffer, so one request cannot make the node allocate gigabytes.
    if let ExtentOp::Read {
        key, offset, len, ..
    }
    | ExtentOp::ReadBlocks {
        key, offset, len, ..
    }
    | ExtentOp::ReadAt {
        key, offset, len, ..
    }
    | ExtentOp::ReadBlocksAt {
        key, offset, len, ..
    } = &op
    {
        if *len as usize > MAX_IO_BYTES {
            return Err(EngineError::InvalidIo {
                key: *key,
                reason: "length must be between 4 KiB and 32 MiB",
                offset: *offset,
                len: u64::from(*len),
            });
        }
    }
    check_versions(&op)?;
    // Client I/O (not repair's block copies) feeds the node's working-set estimator.
    match &op {
        ExtentOp::Read {
            key, offset, len, ..
        } => tier.sample(*key, *offset, u64::from(*len), true),
        ExtentOp::Write {
            key, offset, data, ..
        }
        | ExtentOp::WriteHeld {
            key, offset, data, ..
        } => tier.sample(*key, *offset, data.len() as u64, false),
        _ => {}
    }
    let shape = op.reply_shape();
    let mut durable = Durable::done();
    let reply = match op {
        ExtentOp::Write {
            key,
            epoch,
            version,
            offset,
            crcs,
            data,
            codec,
        } => {
            set_codec(tier, key, epoch, codec)?;
            durable = tier.write_begin(key, epoch, version, offset, &data, &crcs)?;
            ExtentReply::Ok
        }
        ExtentOp::Read {
            key,
            epoch,
            offset,
            len,
        } => {
            // Aligned, so the drive reads straight into it (no bounce copy).
            let mut buf = AlignedBuf::new(len as usize);
            let info = tier.read(key, epoch, offset, &mut buf)?;
            ExtentReply::Read(ReadReply {
                data: Bytes::from_owner(buf),
                bad_blocks: info.bad_blocks,
                suspect: info.suspect,
                version: info.versions,
            })
        }
        ExtentOp::Zero {
            key,
            epoch,
            version,
            offset,
            len,
        } => {
            durable = tier.zero_begin(key, epoch, version, offset, len)?;
            ExtentReply::Ok
        }
        ExtentOp::ReadBlocks {
            key,
            epoch,
            offset,
            len,
        } => {
            let mut buf = AlignedBuf::new(len as usize);
            let mut versions = Vec::new();
            let info = tier.read_blocks(key, epoch, offset, &mut buf, &mut versions)?;
            ExtentReply::Blocks(BlocksReply {
                data: Bytes::from_owner(buf),
                bad_blocks: info.bad_blocks,
                suspect: info.suspect,
                versions,
            })
        }
        ExtentOp::WriteBlocks {
            key,
            epoch,
            offset,
            crcs,
            versions,
            expect,
            data,
            codec,
        } => {
            set_codec(tier, key, epoch, codec)?;
            let (n, d) =
                tier.write_blocks_begin(key, epoch, offset, &data, &crcs, &versions, &expect)?;
            durable = d;
            ExtentReply::Written(n)
        }
        ExtentOp::Versions {
            key,
            epoch,
            offset,
            count,
        } => {
            tier.fence(key, epoch)?;
            ExtentReply::Versions(tier.block_versions(key, offset, count as usize)?)
        }
        ExtentOp::Digest { key, epoch } => ExtentReply::Digest(tier.fence_and_digest(key, epoch)?),
        ExtentOp::Free { key } => {
            tier.free_extent(key)?;
            ExtentReply::Ok
        }
        ExtentOp::Release { key, epoch, upto } => {
            tier.release_extent(key, epoch, upto)?;
            ExtentReply::Ok
        }
        ExtentOp::WriteHeld {
            key,
            epoch,
            version,
            offset,
            crcs,
            data,
        } => {
            tier.write_held(key, epoch, version, offset, &data, &crcs)?;
            ExtentReply::Ok
        }
        ExtentOp::Settle {
            key,
            epoch,
            upto,
            rows,
        } => {
            tier.settle_held(key, epoch, upto, &rows)?;
            ExtentReply::Ok
        }
        ExtentOp::Revert {
            key,
            epoch,
            version,
            offset,
            len,
        } => ExtentReply::Written(tier.revert(key, epoch, version, offset, u64::from(len))?),
        ExtentOp::Priors {
            key,
            epoch,
            offset,
            count,
        } => ExtentReply::Priors(tier.priors(key, epoch, offset, count as usize)?),
        ExtentOp::SnapshotFloor {
            key,
            epoch,
            snapshot,
            previous,
            history,
        } => {
            tier.set_snapshot_floor(key, epoch, snapshot, previous, history)?;
            ExtentReply::Ok
        }
        ExtentOp::DropSnapshot {
            key,
            epoch,
            snapshot,
            below,
        } => {
            tier.drop_snapshot(key, epoch, snapshot, below)?;
            ExtentReply::Ok
        }
        ExtentOp::ReadAt {
            key,
            epoch,
            snapshot,
            offset,
            len,
        } => {
            let mut buf = AlignedBuf::new(len as usize);
            let info = tier.read_at(key, epoch, snapshot, offset, &mut buf)?;
            ExtentReply::Read(ReadReply {
                data: Bytes::from_owner(buf),
                bad_blocks: info.bad_blocks,
                suspect: info.suspect,
                version: info.versions,
            })
        }
        ExtentOp::Changed {
            key,
            epoch,
            from,
            to,
            offset,
            count,
        } => ExtentReply::Bitmap(tier.changed(
            key,
            epoch,
            from,
            to,
            offset,
            u64::from(count) * converge_types::BLOCK_SIZE as u64,
        )?),
        ExtentOp::Absent {
            key,
            epoch,
            at,
            offset,
            count,
        } => ExtentReply::Bitmap(tier.absent(
            key,
            epoch,
            at,
            offset,
            u64::from(count) * converge_types::BLOCK_SIZE as u64,
        )?),
        ExtentOp::VersionsAt {
            key,
            epoch,
            snapshot,
            offset,
            count,
            any,
        } => ExtentReply::Versions(tier.versions_at(key, epoch, snapshot, offset, count, any)?),
        ExtentOp::KeptBlocks {
            key,
            epoch,
            snapshots,
        } => ExtentReply::Counts(
            tier.kept_blocks(key, epoch, &snapshots)?
                .into_iter()
                .flat_map(|(kept, freed)| [kept, freed])
                .collect(),
        ),
        ExtentOp::ReadBlocksAt {
            key,
            epoch,
            snapshot,
            offset,
            len,
        } => {
            let mut buf = AlignedBuf::new(len as usize);
            let mut versions = Vec::new();
            let info =
                tier.read_blocks_at(key, epoch, snapshot, offset, &mut buf, &mut versions)?;
            ExtentReply::Blocks(BlocksReply {
                data: Bytes::from_owner(buf),
                bad_blocks: info.bad_blocks,
                suspect: info.suspect,
                versions,
            })
        }
        ExtentOp::WriteShadow {
            key,
            epoch,
            snapshot,
            offset,
            crcs,
            versions,
            data,
        } => ExtentReply::Written(
            tier.write_shadow(key, epoch, snapshot, offset, &data, &crcs, &versions)?,
        ),
    };
    // The owner checks this too (it trusts no peer); a failure here is this node's bug.
    if let Err(e) = shape.check(&reply) {
        panic!("the replica service {e}");
    }
    Ok((reply, durable))
}

/// Most scheduler rounds [`durable`] waits for other requests to join a journal batch.
pub const GATHER_ROUNDS_MAX: usize = 8;

/// Waits, from a task, for an operation [`start`]ed inline to be durable, the way the daemon
/// waits for its RAM drives (and the simulator for its drives): first it lets the requests
/// the runtime has ready run (one yield), and again while the last round added records to
/// the batch (a burst is still arriving), at most [`GATHER_ROUNDS_MAX`] rounds; then it
/// writes the batch itself if nobody is, on this thread. One journal write and flush then
/// serve a whole burst: fewer flushes, and less journal per 4 KiB block (a batch pads to a
/// 512-byte sector). A request alone pays one round.
pub async fn durable(mut durable: Durable) -> Result<(), EngineError> {
    if durable.is_done() {
        return Ok(());
    }
    let mut seen = durable.batch_records();
    for _ in 0..GATHER_ROUNDS_MAX {
        tokio::task::yield_now().await;
        let now = durable.batch_records();
        if now <= seen {
            break;
        }
        seen = now;
    }
    std::future::poll_fn(|cx| durable.poll_wait(cx, true)).await
}

/// What an engine failure means to the owner: refused as a deposed owner, a corrupted
/// request, a full drive, or an I/O failure of that copy.
pub fn replica_error(e: EngineError) -> ReplicaError {
    match e {
        EngineError::StaleEpoch { .. } => ReplicaError::StaleEpoch(e.to_string()),
        EngineError::ChecksumMismatch { .. } => ReplicaError::Checksum(e.to_string()),
        _ if e.is_no_space() => ReplicaError::NoSpace(e.to_string()),
        EngineError::HeldFull { .. } => ReplicaError::Busy(e.to_string()),
        other => ReplicaError::Io(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use converge_engine::{Drive, DriveIdentity, FaultyFile, FormatOptions};
    use converge_types::{
        ClusterId, DriveId, DriveRole, Epoch, ExtentKey, MediaType, NodeId, SlabIndex, Version,
        VolumeId, BLOCK_SIZE,
    };
    use std::sync::Arc;

    const KEY: ExtentKey = ExtentKey {
        volume: VolumeId(7),
        slab: SlabIndex(1),
    };
    const BS: u64 = BLOCK_SIZE as u64;

    fn tier() -> Tier {
        let ident = DriveIdentity {
            cluster: ClusterId(1),
            node: NodeId(1),
            drive: DriveId(10),
            slab_size_bytes: 16 * BS,
            role: DriveRole::Capacity,
            media: MediaType::Ram,
        };
        let file = FaultyFile::new(2 << 20);
        let opts = FormatOptions {
            journal_bytes: Some(64 << 10),
            ..Default::default()
        };
        let drive = Drive::format_with(Arc::new(file), ident, opts).expect("format");
        Tier::new(Arc::new(drive))
    }

    fn blocks(n: usize, fill: u8) -> (Arc<[u32]>, Bytes) {
        let data = vec![fill; n * BLOCK_SIZE];
        (
            data.chunks(BLOCK_SIZE).map(crc32c::crc32c).collect(),
            data.into(),
        )
    }

    fn write(epoch: u64, version: u64, offset: u64, n: usize, fill: u8) -> ExtentOp {
        let (crcs, data) = blocks(n, fill);
        ExtentOp::Write {
            key: KEY,
            epoch: Epoch(epoch),
            version: Version(version),
            offset,
            crcs,
            data,
            codec: converge_types::Compression::None,
        }
    }

    fn read(epoch: u64, offset: u64, len: u64) -> ExtentOp {
        ExtentOp::Read {
            key: KEY,
            epoch: Epoch(epoch),
            offset,
            len: len as u32,
        }
    }

    fn run(t: &Tier, op: ExtentOp) -> ExtentReply {
        execute(t, op).expect("the engine runs it")
    }

    #[test]
    fn a_read_longer_than_the_io_limit_is_refused() {
        let t = tier();
        for op in [
            read(1, 0, u64::from(u32::MAX)),
            ExtentOp::ReadBlocks {
                key: KEY,
                epoch: Epoch(1),
                offset: 0,
                len: (MAX_IO_BYTES + BLOCK_SIZE) as u32,
            },
        ] {
            assert!(matches!(
                execute(&t, op),
                Err(EngineError::InvalidIo { .. })
            ));
        }
    }

    /// A version from a later term than the request's epoch (`version = u64::MAX` from a
    /// hostile or broken peer) would stand above every later write of the real owner: it is
    /// refused, whatever operation carries it, and the block keeps what it had.
    #[test]
    fn versions_of_a_later_term_than_the_epoch_are_refused() {
        let t = tier();
        assert_eq!(run(&t, write(1, 1 << 32 | 1, 0, 1, 0xaa)), ExtentReply::Ok);
        let (crcs, data) = blocks(1, 0xbb);
        for op in [
            write(1, u64::MAX, 0, 1, 0xbb),
            write(1, 2 << 32, 0, 1, 0xbb),
            ExtentOp::Zero {
                key: KEY,
                epoch: Epoch(1),
                version: Version(u64::MAX),
                offset: 0,
                len: BS,
            },
            ExtentOp::WriteBlocks {
                key: KEY,
                epoch: Epoch(1),
                offset: 0,
                crcs,
                versions: vec![Version(5 << 32)],
                expect: vec![Version(1 << 32 | 1)],
                data,
                codec: converge_types::Compression::None,
            },
            // A bound of a later term reaches every later write too: a release would free
            // the copy whatever it holds, a settle drop the priors of writes not yet made.
            ExtentOp::Release {
                key: KEY,
                epoch: Epoch(1),
                upto: Version(u64::MAX),
            },
            ExtentOp::Settle {
                key: KEY,
                epoch: Epoch(1),
                upto: Version(1 << 32),
                rows: vec![converge_types::SettleRows {
                    first: 0,
                    count: 1,
                    upto: Version(u64::MAX),
                }],
            },
            ExtentOp::Revert {
                key: KEY,
                epoch: Epoch(1),
                version: Version(2 << 32),
                offset: 0,
                len: BS as u32,
            },
        ] {
            let what = op.name();
            match execute(&t, op) {
                Err(EngineError::InvalidArgument(m)) => assert!(m.contains("later than"), "{m}"),
                other => panic!("{what}: {other:?}"),
            }
        }
        match run(&t, read(1, 0, BS)) {
            ExtentReply::Read(r) => assert!(r.data.iter().all(|&b| b == 0xaa)),
            other => panic!("{other:?}"),
        }
        // The owner's next write lands.
        assert_eq!(run(&t, write(1, 1 << 32 | 2, 0, 1, 0xcc)), ExtentReply::Ok);
        match run(&t, read(1, 0, BS)) {
            ExtentReply::Read(r) => assert!(r.data.iter().all(|&b| b == 0xcc)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn every_operation_answers_its_kind() {
        let t = tier();
        assert_eq!(run(&t, write(1, 5, BS, 2, 0xab)), ExtentReply::Ok);
        let r = run(&t, read(1, 0, 4 * BS)).into_read().unwrap();
        assert_eq!(r.version, Version(5));
        assert!(r.bad_blocks.is_empty());
        assert!(r.data[..BLOCK_SIZE].iter().all(|b| *b == 0));
        assert!(r.data[BLOCK_SIZE..3 * BLOCK_SIZE]
            .iter()
            .all(|b| *b == 0xab));
        let op = ExtentOp::ReadBlocks {
            key: KEY,
            epoch: Epoch(1),
            offset: 0,
            len: 3 * BLOCK_SIZE as u32,
        };
        let b = run(&t, op).into_blocks().unwrap();
        assert_eq!(b.versions, [Version(0), Version(5), Version(5)]);
        // Copy-in: only the block still at its expected version is written.
        let (crcs, data) = blocks(2, 0xcd);
        let op = ExtentOp::WriteBlocks {
            key: KEY,
            epoch: Epoch(1),
            offset: BS,
            crcs,
            versions: vec![Version(9), Version(9)],
            expect: vec![Version(5), Version(4)],
            data,
            codec: converge_types::Compression::None,
        };
        assert_eq!(run(&t, op), ExtentReply::Written(1));
        let op = ExtentOp::Zero {
            key: KEY,
            epoch: Epoch(1),
            version: Version(10),
            offset: 2 * BS,
            len: BS,
        };
        assert_eq!(run(&t, op), ExtentReply::Ok);
        let op = ExtentOp::Versions {
            key: KEY,
            epoch: Epoch(1),
            offset: 0,
            count: 3,
        };
        assert_eq!(
            run(&t, op),
            ExtentReply::Versions(vec![Version(0), Version(9), Version(10)])
        );
        let digest = |epoch| {
            run(
                &t,
                ExtentOp::Digest {
                    key: KEY,
                    epoch: Epoch(epoch),
                },
            )
        };
        let d = digest(1).into_digest().unwrap();
        assert_eq!(digest(1), ExtentReply::Digest(d), "same versions");
        assert_eq!(run(&t, ExtentOp::Free { key: KEY }), ExtentReply::Ok);
        assert!(!t.has_extent(KEY));
    }

    #[test]
    fn snapshot_operations_answer_their_kinds() {
        let t = tier();
        assert_eq!(run(&t, write(1, 1 << 32 | 1, 0, 2, 0xaa)), ExtentReply::Ok);
        let floor = ExtentOp::SnapshotFloor {
            key: KEY,
            epoch: Epoch(1),
            snapshot: Epoch(1),
            previous: None,
            history: converge_types::FloorHistory::Continues,
        };
        assert_eq!(run(&t, floor), ExtentReply::Ok);
        assert_eq!(run(&t, write(2, 2 << 32 | 1, 0, 1, 0xbb)), ExtentReply::Ok);
        let at = ExtentOp::ReadAt {
            key: KEY,
            epoch: Epoch(2),
            snapshot: Epoch(1),
            offset: 0,
            len: 2 * BS as u32,
        };
        let r = run(&t, at).into_read().unwrap();
        assert!(
            r.data.iter().all(|&b| b == 0xaa),
            "the snapshot reads the first write"
        );
        assert_eq!(r.version, Version(1 << 32 | 1));
        let r = run(&t, read(2, 0, BS)).into_read().unwrap();
        assert!(r.data.iter().all(|&b| b == 0xbb));
        // A read at a snapshot is bounded like any read.
        let long = ExtentOp::ReadAt {
            key: KEY,
            epoch: Epoch(2),
            snapshot: Epoch(1),
            offset: 0,
            len: u32::MAX,
        };
        assert!(matches!(
            execute(&t, long),
            Err(EngineError::InvalidIo { .. })
        ));
        let drop = ExtentOp::DropSnapshot {
            key: KEY,
            epoch: Epoch(2),
            snapshot: Epoch(1),
            below: None,
        };
        assert_eq!(run(&t, drop.clone()), ExtentReply::Ok);
        assert_eq!(run(&t, drop), ExtentReply::Ok, "a retried delete is Ok");
        assert_eq!(t.capacity().bytes_preserved, 0);
    }

    #[test]
    fn fencing_operations_refuse_older_owners_from_then_on() {
        let t = tier();
        assert_eq!(run(&t, write(1, 1, 0, 1, 1)), ExtentReply::Ok);
        let op = ExtentOp::Digest {
            key: KEY,
            epoch: Epoch(2),
        };
        assert!(execute(&t, op).is_ok());
        for old in [write(1, 2, 0, 1, 2), read(1, 0, BS)] {
            let e = execute(&t, old).expect_err("epoch 1 is fenced");
            assert!(matches!(e, EngineError::StaleEpoch { .. }), "{e}");
            assert!(matches!(replica_error(e), ReplicaError::StaleEpoch(_)));
        }
        let op = ExtentOp::Versions {
            key: KEY,
            epoch: Epoch(3),
            offset: 0,
            count: 1,
        };
        assert!(execute(&t, op).is_ok());
        let e = execute(&t, read(2, 0, BS)).expect_err("epoch 2 is fenced now");
        assert!(matches!(e, EngineError::StaleEpoch { .. }), "{e}");
    }

    /// A drive with no room for another whole extent refuses it as `Full` (a thin drive
    /// still has slots): the owner must hear "no space", never an I/O error (issue 42).
    #[test]
    fn a_full_drive_answers_no_space() {
        let t = tier();
        let mut e = None;
        for slab in 1..1_000 {
            let (crcs, data) = blocks(16, slab as u8);
            let op = ExtentOp::Write {
                key: ExtentKey {
                    volume: KEY.volume,
                    slab: SlabIndex(slab),
                },
                epoch: Epoch(1),
                version: Version(1),
                offset: 0,
                crcs,
                data,
                codec: converge_types::Compression::None,
            };
            if let Err(err) = execute(&t, op) {
                e = Some(err);
                break;
            }
        }
        let e = e.expect("a 2 MiB drive fills");
        assert!(matches!(e, EngineError::Full { .. }), "{e}");
        assert!(matches!(replica_error(e), ReplicaError::NoSpace(_)));
    }

    #[test]
    fn a_corrupted_write_is_refused_and_says_so() {
        let t = tier();
        let ExtentOp::Write {
            key,
            epoch,
            version,
            offset,
            data,
            ..
        } = write(1, 1, 0, 1, 7)
        else {
            unreachable!()
        };
        let op = ExtentOp::Write {
            key,
            epoch,
            version,
            offset,
            crcs: Arc::from([0u32]),
            data,
            codec: converge_types::Compression::None,
        };
        let e = execute(&t, op).expect_err("crc mismatch");
        assert!(matches!(replica_error(e), ReplicaError::Checksum(_)));
    }

    /// A parity chunk's operations, through the service as a peer would send them: a held
    /// write keeps each block's prior, a revert puts it back, a settle drops it, and each
    /// is refused to an older owner.
    #[test]
    fn held_writes_revert_and_settle_through_the_service() {
        let t = tier();
        let priors = |t: &Tier, epoch: u64| {
            let op = ExtentOp::Priors {
                key: KEY,
                epoch: Epoch(epoch),
                offset: 0,
                count: 3,
            };
            run(t, op).into_priors().expect("priors")
        };
        run(&t, write(1, 10, 0, 2, 1));
        let (crcs, data) = blocks(3, 2);
        let held = ExtentOp::WriteHeld {
            key: KEY,
            epoch: Epoch(2),
            version: Version(20),
            offset: 0,
            crcs,
            data,
        };
        assert_eq!(run(&t, held), ExtentReply::Ok);
        assert_eq!(
            priors(&t, 2),
            vec![
                (Version(20), Some(Version(10))),
                (Version(20), Some(Version(10))),
                (Version(20), Some(Version(0))),
            ]
        );
        let revert = |epoch: u64| ExtentOp::Revert {
            key: KEY,
            epoch: Epoch(epoch),
            version: Version(20),
            offset: 0,
            len: 2 * BS as u32,
        };
        let e = execute(&t, revert(1)).expect_err("an older owner may not revert");
        assert!(matches!(e, EngineError::StaleEpoch { .. }), "{e}");
        assert_eq!(run(&t, revert(2)), ExtentReply::Written(2));
        let r = run(&t, read(2, 0, 3 * BS)).into_read().expect("read");
        assert!(
            r.data[..2 * BLOCK_SIZE].iter().all(|&b| b == 1),
            "blocks 0..2 back at V10"
        );
        assert!(
            r.data[2 * BLOCK_SIZE..].iter().all(|&b| b == 2),
            "block 2 still at V20"
        );
        let settle = ExtentOp::Settle {
            key: KEY,
            epoch: Epoch(2),
            upto: Version(20),
            rows: Vec::new(),
        };
        assert_eq!(run(&t, settle), ExtentReply::Ok);
        assert_eq!(
            priors(&t, 2),
            vec![
                (Version(10), None),
                (Version(10), None),
                (Version(20), None)
            ]
        );
        let e = execute(
            &t,
            ExtentOp::Priors {
                key: KEY,
                epoch: Epoch(1),
                offset: 0,
                count: 1,
            },
        )
        .expect_err("an older owner may not look");
        assert!(matches!(e, EngineError::StaleEpoch { .. }), "{e}");
    }
}
