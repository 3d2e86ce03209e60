//! Byte-exact encoding of rpc frames and messages (docs/FORMAT-rpc.md is the contract).
//!
//! Everything is little-endian. A frame is a 32-byte header followed by a payload. Bulk data
//! (`Write::data`, `ReadOk::data`) is always the last field of its payload, so the encoder
//! hands it out as a separate `Bytes` (no copy, written with a vectored write) and the decoder
//! returns it as a slice of the received buffer (no copy either).
//!
//! Extent operations travel as the very [`ExtentOp`] and [`ExtentReply`] the owner and the
//! replica service use: each kind has its own message type, its fields in its own order.
//!
//! Decoders never panic: every length is checked against what is left before it is used.

use bytes::{BufMut, Bytes, BytesMut};
use converge_types::{
    BlocksReply, ClusterId, Compression, DriveId, Epoch, ExtentKey, ExtentOp, ExtentReply, NodeId,
    ReadReply, SettleRows, SlabIndex, Version, VolumeId, BLOCK_SIZE, SETTLE_ROWS_MAX,
};
use std::sync::Arc;

/// First four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"CVRP";
/// Version of the frame format and message set. Carried in every header and in `Hello`.
pub const PROTOCOL_VERSION: u16 = 2;
/// The oldest peer protocol version this build still speaks. A release speaks its
/// predecessor's version too (N and N-1), so during a rolling upgrade nodes of both serve
/// side by side (docs/FORMAT-rpc.md, "Versions").
pub const PROTOCOL_VERSION_MIN: u16 = 2;

/// The version a connection runs at when a caller speaking up to `offered` says hello to
/// a node speaking `ours`: the newest both speak, or None when the caller's newest is
/// older than the oldest the node speaks.
pub fn agree_within(ours: std::ops::RangeInclusive<u16>, offered: u16) -> Option<u16> {
    let v = offered.min(*ours.end());
    (v >= *ours.start()).then_some(v)
}

/// [`agree_within`] this build's versions.
pub fn agree(offered: u16) -> Option<u16> {
    agree_within(PROTOCOL_VERSION_MIN..=PROTOCOL_VERSION, offered)
}
/// Size of the fixed frame header, bytes.
pub const HEADER_LEN: usize = 32;
/// Error messages longer than this are truncated by the encoder, bytes.
pub const ERR_MESSAGE_BYTES_MAX: usize = 4096;

/// Message type byte. Requests are `0x01..=0x7f`, responses `0x80..=0xff`.
pub mod msg {
    pub const HELLO: u8 = 0x01;
    pub const PING: u8 = 0x02;
    pub const WRITE: u8 = 0x10;
    pub const READ: u8 = 0x11;
    pub const ZERO: u8 = 0x12;
    pub const FREE_EXTENT: u8 = 0x13;
    pub const READ_BLOCKS: u8 = 0x14;
    pub const WRITE_BLOCKS: u8 = 0x15;
    pub const VERSIONS: u8 = 0x16;
    pub const DIGEST: u8 = 0x17;
    pub const RELEASE_EXTENT: u8 = 0x18;
    pub const WRITE_HELD: u8 = 0x19;
    pub const SETTLE: u8 = 0x1a;
    pub const REVERT: u8 = 0x1b;
    pub const PRIORS: u8 = 0x1c;
    /// `WRITE` of a compressed volume: the same fields and a codec byte after the offset.
    /// Sent only for volumes with compression, so a cluster without any never needs a
    /// node that knows it (rolling upgrades).
    pub const WRITE_PACKED: u8 = 0x1d;
    /// `WRITE_BLOCKS` of a compressed volume: a codec byte after the offset.
    pub const WRITE_BLOCKS_PACKED: u8 = 0x1e;
    /// Snapshots (docs/adr/0012).
    pub const SNAPSHOT_FLOOR: u8 = 0x30;
    pub const DROP_SNAPSHOT: u8 = 0x31;
    pub const READ_AT: u8 = 0x32;
    /// Which blocks changed between two snapshots (incremental backup).
    pub const CHANGED: u8 = 0x33;
    /// Which blocks were never written (a clone reads them from its parent).
    pub const ABSENT: u8 = 0x34;
    /// Repair of snapshots (docs/adr/0012, step 4): versions and blocks at a snapshot,
    /// and a fill's write of a snapshot's states.
    pub const VERSIONS_AT: u8 = 0x35;
    pub const READ_BLOCKS_AT: u8 = 0x36;
    pub const WRITE_SHADOW: u8 = 0x37;
    /// What an extent keeps for each snapshot (per-snapshot space).
    pub const KEPT_BLOCKS: u8 = 0x38;
    pub const VOL_READ: u8 = 0x20;
    pub const VOL_WRITE: u8 = 0x21;
    pub const VOL_ZERO: u8 = 0x22;
    /// A redirected read of a volume's snapshot (docs/SNAPSHOTS.md).
    pub const VOL_READ_AT: u8 = 0x23;
    /// A redirected question: which blocks of a volume changed since a snapshot.
    pub const VOL_CHANGED: u8 = 0x24;

    pub const HELLO_OK: u8 = 0x81;
    pub const PONG: u8 = 0x82;
    pub const OK: u8 = 0x90;
    pub const READ_OK: u8 = 0x91;
    pub const BLOCKS_OK: u8 = 0x92;
    pub const VERSIONS_OK: u8 = 0x93;
    pub const WRITTEN: u8 = 0x94;
    pub const DIGEST_OK: u8 = 0x95;
    pub const PRIORS_OK: u8 = 0x96;
    pub const BITMAP_OK: u8 = 0x97;
    pub const COUNTS_OK: u8 = 0x98;
    pub const ERR: u8 = 0xff;

    /// True for the request half of the type space.
    pub fn is_request(t: u8) -> bool {
        (0x01..=0x7f).contains(&t)
    }
}

/// First message on every connection: who is calling, from which cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    pub cluster: ClusterId,
    pub node: NodeId,
    pub protocol_version: u16,
}

/// A request from one node to a peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    Hello(Hello),
    Ping,
    /// Run `op` on the extent that `drive` (on the receiving node) holds: message types
    /// `0x10..=0x1c`, one per kind of operation.
    Extent {
        drive: DriveId,
        op: ExtentOp,
    },
    /// Redirected I/O: a node serving a client for a volume it does not own forwards the
    /// client's request to the owner, which runs it as if the client were local.
    VolRead {
        volume: VolumeId,
        offset: u64,
        len: u32,
    },
    VolWrite {
        volume: VolumeId,
        offset: u64,
        data: Bytes,
    },
    VolZero {
        volume: VolumeId,
        offset: u64,
        len: u64,
        trim: bool,
    },
    /// A redirected read of snapshot `snapshot` (its epoch) of a volume.
    VolReadAt {
        volume: VolumeId,
        snapshot: Epoch,
        offset: u64,
        len: u32,
    },
    /// A redirected question: which blocks of `[offset, offset + len)` of a volume read
    /// differently at snapshot `from` and at `to` (`None`: now). Answered
    /// [`ExtentReply::Bitmap`], one bit per 4 KiB block of the range.
    VolChanged {
        volume: VolumeId,
        from: Epoch,
        to: Option<Epoch>,
        offset: u64,
        len: u64,
    },
}

/// Why a request failed on the remote side. Unknown codes decode as `Other`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    StaleEpoch,
    ChecksumMismatch,
    NoSpace,
    UnknownDrive,
    Io,
    Invalid,
    Busy,
    /// Redirected I/O reached a node that does not (or no longer) own the volume.
    NotOwner,
    /// Redirected I/O outside the volume.
    OutOfRange,
    Other,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 10] = [
        ErrorCode::StaleEpoch,
        ErrorCode::ChecksumMismatch,
        ErrorCode::NoSpace,
        ErrorCode::UnknownDrive,
        ErrorCode::Io,
        ErrorCode::Invalid,
        ErrorCode::Busy,
        ErrorCode::NotOwner,
        ErrorCode::OutOfRange,
        ErrorCode::Other,
    ];

    pub fn to_u16(self) -> u16 {
        match self {
            ErrorCode::StaleEpoch => 1,
            ErrorCode::ChecksumMismatch => 2,
            ErrorCode::NoSpace => 3,
            ErrorCode::UnknownDrive => 4,
            ErrorCode::Io => 5,
            ErrorCode::Invalid => 6,
            ErrorCode::Busy => 7,
            ErrorCode::NotOwner => 8,
            ErrorCode::OutOfRange => 9,
            ErrorCode::Other => 0xffff,
        }
    }

    pub fn from_u16(v: u16) -> ErrorCode {
        match v {
            1 => ErrorCode::StaleEpoch,
            2 => ErrorCode::ChecksumMismatch,
            3 => ErrorCode::NoSpace,
            4 => ErrorCode::UnknownDrive,
            5 => ErrorCode::Io,
            6 => ErrorCode::Invalid,
            7 => ErrorCode::Busy,
            8 => ErrorCode::NotOwner,
            9 => ErrorCode::OutOfRange,
            _ => ErrorCode::Other,
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self, f)
    }
}

/// The answer to a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Response {
    HelloOk {
        node: NodeId,
    },
    Pong,
    /// The answer to an extent operation: message types `0x90..=0x95`, one per kind of
    /// answer. Redirected I/O is answered with the same messages: `Ok` for `VolWrite` and
    /// `VolZero`, `Read` (no bad blocks, version 0) for `VolRead`.
    Extent(ExtentReply),
    Err {
        code: ErrorCode,
        message: String,
    },
}

impl Response {
    pub fn err(code: ErrorCode, message: impl Into<String>) -> Response {
        Response::Err {
            code,
            message: message.into(),
        }
    }

    /// The answer that says "done" (message `Ok`).
    pub fn ok() -> Response {
        Response::Extent(ExtentReply::Ok)
    }
}

/// What is wrong with some bytes or with a message about to be sent.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("bad frame magic {0:02x?} (not a converge rpc peer?)")]
    BadMagic([u8; 4]),
    #[error("frame header checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    HeaderChecksum { stored: u32, computed: u32 },
    #[error(
        "protocol version {got} not supported (this node speaks {PROTOCOL_VERSION_MIN} to \
         {PROTOCOL_VERSION})"
    )]
    Version { got: u16 },
    #[error("frame payload of {len} bytes exceeds rpc_frame_bytes_max {max}")]
    TooLarge { len: usize, max: usize },
    #[error("reserved header bytes are not zero")]
    Reserved,
    #[error("payload checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    PayloadChecksum { stored: u32, computed: u32 },
    #[error("unknown message type {0:#04x}")]
    UnknownType(u8),
    #[error("unknown frame flags {0:#04x}")]
    UnknownFlags(u8),
    #[error("message truncated: needed {needed} more bytes for {field}")]
    Truncated { field: &'static str, needed: usize },
    #[error("{0} trailing bytes after message")]
    Trailing(usize),
    #[error("invalid message: {0}")]
    Invalid(String),
}

/// The fixed part of a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// The protocol version the frame is in: the connection's, agreed at its hello.
    pub version: u16,
    pub msg_type: u8,
    pub flags: u8,
    pub request_id: u64,
    pub payload_len: u32,
    pub payload_crc: u32,
}

impl FrameHeader {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..4].copy_from_slice(&MAGIC);
        h[4..6].copy_from_slice(&self.version.to_le_bytes());
        h[6] = self.msg_type;
        h[7] = self.flags;
        h[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        h[16..20].copy_from_slice(&self.payload_len.to_le_bytes());
        h[20..24].copy_from_slice(&self.payload_crc.to_le_bytes());
        // 24..28 reserved, zero.
        let crc = crc32c::crc32c(&h[0..28]);
        h[28..32].copy_from_slice(&crc.to_le_bytes());
        h
    }

    /// Checks magic, header crc, version, reserved bytes and the payload bound. Errors here
    /// mean the byte stream cannot be trusted any more: the connection must be closed.
    /// Unknown message types and flags are *not* errors here (the frame can still be skipped).
    pub fn decode(
        h: &[u8; HEADER_LEN],
        payload_bytes_max: usize,
    ) -> Result<FrameHeader, WireError> {
        let magic = [h[0], h[1], h[2], h[3]];
        if magic != MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        let stored = u32::from_le_bytes([h[28], h[29], h[30], h[31]]);
        let computed = crc32c::crc32c(&h[0..28]);
        if stored != computed {
            return Err(WireError::HeaderChecksum { stored, computed });
        }
        let version = u16::from_le_bytes([h[4], h[5]]);
        if !(PROTOCOL_VERSION_MIN..=PROTOCOL_VERSION).contains(&version) {
            return Err(WireError::Version { got: version });
        }
        if h[24..28] != [0, 0, 0, 0] {
            return Err(WireError::Reserved);
        }
        let mut id = [0u8; 8];
        id.copy_from_slice(&h[8..16]);
        let payload_len = u32::from_le_bytes([h[16], h[17], h[18], h[19]]);
        if payload_len as usize > payload_bytes_max {
            return Err(WireError::TooLarge {
                len: payload_len as usize,
                max: payload_bytes_max,
            });
        }
        Ok(FrameHeader {
            version,
            msg_type: h[6],
            flags: h[7],
            request_id: u64::from_le_bytes(id),
            payload_len,
            payload_crc: u32::from_le_bytes([h[20], h[21], h[22], h[23]]),
        })
    }
}

/// A frame ready to be written: `head` (header + fixed fields) then `data` (bulk, may be empty).
#[derive(Clone, Debug)]
pub struct EncodedFrame {
    pub head: Bytes,
    pub data: Bytes,
}

impl EncodedFrame {
    /// The same frame in protocol version `version` (a connection agreed on an older one
    /// than this build's newest): the header's version and checksum are rewritten. The
    /// messages of the versions this build speaks have the same bytes; a version that
    /// changes a message encodes it by the connection's version instead.
    pub fn at_version(self, version: u16) -> EncodedFrame {
        if self.head.get(4..6) == Some(&version.to_le_bytes()[..]) {
            return self;
        }
        let mut head = BytesMut::from(&self.head[..]);
        head[4..6].copy_from_slice(&version.to_le_bytes());
        let crc = crc32c::crc32c(&head[0..28]);
        head[28..32].copy_from_slice(&crc.to_le_bytes());
        EncodedFrame {
            head: head.freeze(),
            data: self.data,
        }
    }

    /// Length of the payload (everything after the header), bytes.
    pub fn payload_len(&self) -> usize {
        self.head.len() - HEADER_LEN + self.data.len()
    }

    /// Total bytes on the wire.
    pub fn wire_len(&self) -> usize {
        self.head.len() + self.data.len()
    }

    /// The frame as one contiguous buffer (copies; for tests and tools).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.wire_len());
        v.extend_from_slice(&self.head);
        v.extend_from_slice(&self.data);
        v
    }
}

/// Checks what the rpc layer itself can check about a request before it is sent or handled.
pub fn validate_request(req: &Request) -> Result<(), WireError> {
    let Request::Extent { op, .. } = req else {
        return Ok(());
    };
    if let ExtentOp::WriteBlocks {
        crcs,
        versions,
        expect,
        ..
    } = op
    {
        if versions.len() != crcs.len() || expect.len() != crcs.len() {
            return Err(WireError::Invalid(format!(
                "block copy carries {} crcs, {} versions and {} expected versions: need one of each per block",
                crcs.len(),
                versions.len(),
                expect.len()
            )));
        }
    }
    if let ExtentOp::WriteShadow { crcs, versions, .. } = op {
        if versions.len() != crcs.len() {
            return Err(WireError::Invalid(format!(
                "snapshot copy carries {} crcs and {} versions: need one of each per block",
                crcs.len(),
                versions.len()
            )));
        }
    }
    if let ExtentOp::Write { crcs, data, .. }
    | ExtentOp::WriteHeld { crcs, data, .. }
    | ExtentOp::WriteBlocks { crcs, data, .. }
    | ExtentOp::WriteShadow { crcs, data, .. } = op
    {
        if crcs.len().checked_mul(BLOCK_SIZE) != Some(data.len()) {
            return Err(WireError::Invalid(format!(
                "write carries {} crcs for {} data bytes: need one crc per {BLOCK_SIZE}-byte block",
                crcs.len(),
                data.len()
            )));
        }
    }
    Ok(())
}

fn put_key(b: &mut BytesMut, drive: DriveId, key: &ExtentKey) {
    b.put_u64_le(drive.0);
    b.put_u64_le(key.volume.0);
    b.put_u64_le(key.slab.0);
}

/// Builds a frame: `body` is written after a header placeholder, then the header is filled in.
fn finish(msg_type: u8, request_id: u64, mut head: BytesMut, data: Bytes) -> EncodedFrame {
    let body_len = head.len() - HEADER_LEN;
    let crc = crc32c::crc32c_append(crc32c::crc32c(&head[HEADER_LEN..]), &data);
    // Payload lengths above u32::MAX saturate; every receiver bounds frames far below that,
    // and senders check `payload_len()` against rpc_frame_bytes_max first.
    let payload_len = u32::try_from(body_len + data.len()).unwrap_or(u32::MAX);
    let header = FrameHeader {
        version: PROTOCOL_VERSION,
        msg_type,
        flags: 0,
        request_id,
        payload_len,
        payload_crc: crc,
    };
    head[..HEADER_LEN].copy_from_slice(&header.encode());
    EncodedFrame {
        head: head.freeze(),
        data,
    }
}

fn new_head(body_capacity: usize) -> BytesMut {
    let mut b = BytesMut::with_capacity(HEADER_LEN + body_capacity);
    b.put_bytes(0, HEADER_LEN);
    b
}

/// Message type of a request.
pub fn request_type(req: &Request) -> u8 {
    match req {
        Request::Hello(_) => msg::HELLO,
        Request::Ping => msg::PING,
        Request::Extent { op, .. } => match op {
            ExtentOp::Write { codec, .. } if !codec.is_none() => msg::WRITE_PACKED,
            ExtentOp::Write { .. } => msg::WRITE,
            ExtentOp::Read { .. } => msg::READ,
            ExtentOp::Zero { .. } => msg::ZERO,
            ExtentOp::Free { .. } => msg::FREE_EXTENT,
            ExtentOp::ReadBlocks { .. } => msg::READ_BLOCKS,
            ExtentOp::WriteBlocks { codec, .. } if !codec.is_none() => msg::WRITE_BLOCKS_PACKED,
            ExtentOp::WriteBlocks { .. } => msg::WRITE_BLOCKS,
            ExtentOp::Versions { .. } => msg::VERSIONS,
            ExtentOp::Digest { .. } => msg::DIGEST,
            ExtentOp::Release { .. } => msg::RELEASE_EXTENT,
            ExtentOp::WriteHeld { .. } => msg::WRITE_HELD,
            ExtentOp::Settle { .. } => msg::SETTLE,
            ExtentOp::Revert { .. } => msg::REVERT,
            ExtentOp::Priors { .. } => msg::PRIORS,
            ExtentOp::SnapshotFloor { .. } => msg::SNAPSHOT_FLOOR,
            ExtentOp::DropSnapshot { .. } => msg::DROP_SNAPSHOT,
            ExtentOp::ReadAt { .. } => msg::READ_AT,
            ExtentOp::Changed { .. } => msg::CHANGED,
            ExtentOp::Absent { .. } => msg::ABSENT,
            ExtentOp::VersionsAt { .. } => msg::VERSIONS_AT,
            ExtentOp::ReadBlocksAt { .. } => msg::READ_BLOCKS_AT,
            ExtentOp::WriteShadow { .. } => msg::WRITE_SHADOW,
            ExtentOp::KeptBlocks { .. } => msg::KEPT_BLOCKS,
        },
        Request::VolRead { .. } => msg::VOL_READ,
        Request::VolWrite { .. } => msg::VOL_WRITE,
        Request::VolZero { .. } => msg::VOL_ZERO,
        Request::VolReadAt { .. } => msg::VOL_READ_AT,
        Request::VolChanged { .. } => msg::VOL_CHANGED,
    }
}

/// Message type of a response.
pub fn response_type(resp: &Response) -> u8 {
    match resp {
        Response::HelloOk { .. } => msg::HELLO_OK,
        Response::Pong => msg::PONG,
        Response::Extent(r) => match r {
            ExtentReply::Ok => msg::OK,
            ExtentReply::Read(_) => msg::READ_OK,
            ExtentReply::Blocks(_) => msg::BLOCKS_OK,
            ExtentReply::Versions(_) => msg::VERSIONS_OK,
            ExtentReply::Written(_) => msg::WRITTEN,
            ExtentReply::Digest(_) => msg::DIGEST_OK,
            ExtentReply::Priors(_) => msg::PRIORS_OK,
            ExtentReply::Bitmap(_) => msg::BITMAP_OK,
            ExtentReply::Counts(_) => msg::COUNTS_OK,
        },
        Response::Err { .. } => msg::ERR,
    }
}

/// Encodes a request frame. Does not validate (see [`validate_request`]) so that tests can
/// build bad frames; `data` is shared, not copied.
pub fn encode_request(request_id: u64, req: &Request) -> EncodedFrame {
    let t = request_type(req);
    match req {
        Request::Hello(h) => {
            let mut b = new_head(22);
            b.put_u128_le(h.cluster.0);
            b.put_u32_le(h.node.0);
            b.put_u16_le(h.protocol_version);
            finish(t, request_id, b, Bytes::new())
        }
        Request::Ping => finish(t, request_id, new_head(0), Bytes::new()),
        Request::Extent { drive, op } => {
            let (b, data) = encode_extent_op(*drive, op);
            finish(t, request_id, b, data)
        }
        Request::VolRead {
            volume,
            offset,
            len,
        } => {
            let mut b = new_head(20);
            b.put_u64_le(volume.0);
            b.put_u64_le(*offset);
            b.put_u32_le(*len);
            finish(t, request_id, b, Bytes::new())
        }
        Request::VolWrite {
            volume,
            offset,
            data,
        } => {
            let mut b = new_head(20);
            b.put_u64_le(volume.0);
            b.put_u64_le(*offset);
            b.put_u32_le(u32::try_from(data.len()).unwrap_or(u32::MAX));
            finish(t, request_id, b, data.clone())
        }
        Request::VolZero {
            volume,
            offset,
            len,
            trim,
        } => {
            let mut b = new_head(25);
            b.put_u64_le(volume.0);
            b.put_u64_le(*offset);
            b.put_u64_le(*len);
            b.put_u8(u8::from(*trim));
            finish(t, request_id, b, Bytes::new())
        }
        Request::VolReadAt {
            volume,
            snapshot,
            offset,
            len,
        } => {
            let mut b = new_head(28);
            b.put_u64_le(volume.0);
            b.put_u64_le(snapshot.0);
            b.put_u64_le(*offset);
            b.put_u32_le(*len);
            finish(t, request_id, b, Bytes::new())
        }
        Request::VolChanged {
            volume,
            from,
            to,
            offset,
            len,
        } => {
            let mut b = new_head(40);
            b.put_u64_le(volume.0);
            b.put_u64_le(from.0);
            b.put_u64_le(to.map_or(0, |e| e.0));
            b.put_u64_le(*offset);
            b.put_u64_le(*len);
            finish(t, request_id, b, Bytes::new())
        }
    }
}

/// The fields of an extent operation after the frame header, and its bulk data.
fn encode_extent_op(drive: DriveId, op: &ExtentOp) -> (BytesMut, Bytes) {
    match op {
        ExtentOp::Write {
            key,
            epoch,
            version,
            offset,
            crcs,
            data,
            codec,
        } => {
            let mut b = new_head(57 + 4 * crcs.len());
            put_key(&mut b, drive, key);
            b.put_u64_le(epoch.0);
            b.put_u64_le(version.0);
            b.put_u64_le(*offset);
            // WRITE_PACKED only: a plain write keeps WRITE's bytes.
            if !codec.is_none() {
                b.put_u8(codec.code());
            }
            put_u32_list(&mut b, crcs);
            b.put_u32_le(u32::try_from(data.len()).unwrap_or(u32::MAX));
            (b, data.clone())
        }
        ExtentOp::WriteHeld {
            key,
            epoch,
            version,
            offset,
            crcs,
            data,
        } => encode_extent_op(
            drive,
            &ExtentOp::Write {
                key: *key,
                epoch: *epoch,
                version: *version,
                offset: *offset,
                crcs: crcs.clone(),
                data: data.clone(),
                codec: Compression::None,
            },
        ),
        ExtentOp::Read {
            key,
            epoch,
            offset,
            len,
        }
        | ExtentOp::ReadBlocks {
            key,
            epoch,
            offset,
            len,
        } => {
            let mut b = new_head(44);
            put_key(&mut b, drive, key);
            b.put_u64_le(epoch.0);
            b.put_u64_le(*offset);
            b.put_u32_le(*len);
            (b, Bytes::new())
        }
        ExtentOp::Zero {
            key,
            epoch,
            version,
            offset,
            len,
        } => {
            let mut b = new_head(56);
            put_key(&mut b, drive, key);
            b.put_u64_le(epoch.0);
            b.put_u64_le(version.0);
            b.put_u64_le(*offset);
            b.put_u64_le(*len);
            (b, Bytes::new())
        }
        ExtentOp::Free { key } => {
            let mut b = new_head(24);
            put_key(&mut b, drive, key);
            (b, Bytes::new())
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
            let mut b = new_head(61 + 20 * crcs.len());
            put_key(&mut b, drive, key);
            b.put_u64_le(epoch.0);
            b.put_u64_le(*offset);
            if !codec.is_none() {
                b.put_u8(codec.code());
            }
            put_u32_list(&mut b, crcs);
            put_versions(&mut b, versions);
            put_versions(&mut b, expect);
            b.put_u32_le(u32::try_from(data.len()).unwrap_or(u32::MAX));
            (b, data.clone())
        }
        ExtentOp::Versions {
            key,
            epoch,
            offset,
            count,
        } => {
            let mut b = new_head(44);
            put_key(&mut b, drive, key);
            b.put_u64_le(epoch.0);
            b.put_u64_le(*offset);
            b.put_u32_le(*count);
            (b, Bytes::new())
        }
        ExtentOp::Digest { key, epoch } => {
            let mut b = new_head(32);
            put_key(&mut b, drive, key);
            b.put_u64_le(epoch.0);
            (b, Bytes::new())
        }
        ExtentOp::Release { key, epoch, upto } => {
            let mut b = new_head(40);
            put_key(&mut b, drive, key);
            b.put_u64_le(epoch.0);
            b.put_u64_le(upto.0);
            (b, Bytes::new())
        }
        ExtentOp::Settle {
            key,
            epoch,
            upto,
            rows,
        } => {
            let mut b = new_head(44 + 16 * rows.len());
            put_key(&mut b, drive, key);
            b.put_u64_le(epoch.0);
            b.put_u64_le(upto.0);
            b.put_u32_le(rows.len() as u32);
            for r in rows {
                b.put_u32_le(r.first);
                b.put_u32_le(r.count);
                b.put_u64_le(r.upto.0);
            }
            (b, Bytes::new())
        }
        ExtentOp::Revert {
            key,
            epoch,
            version,
            offset,
            len,
        } => {
            let mut b = new_head(52);
            put_key(&mut b, drive, key);
            b.put_u64_le(epoch.0);
            b.put_u64_le(version.0);
            b.put_u64_le(*offset);
            b.put_u32_le(*len);
            (b, Bytes::new())
        }
        ExtentOp::Priors {
            key,
            epoch,
            offset,
            count,
        } => {
            let mut b = new_head(44);
            put_key(&mut b, drive, key);
            b.put_u64_le(epoch.0);
            b.put_u64_le(*offset);
            b.put_u32_le(*count);
            (b, Bytes::new())
        }
        ExtentOp::SnapshotFloor {
            key,
            epoch,
            snapshot,
            previous,
            history,
        } => {
            let mut b = new_head(49);
            put_key(&mut b, drive, key);
            b.put_u64_le(epoch.0);
            b.put_u64_le(snapshot.0);
            b.put_u64_le(previous.map_or(0, |e| e.0));
            b.put_u8(history.code());
            (b, Bytes::new())
        }
        ExtentOp::DropSnapshot {
            key,
            epoch,
            snapshot,
            below,
        } => {
            let mut b = new_head(48);
            put_key(&mut b, drive, key);
            b.put_u64_le(epoch.0);
            b.put_u64_le(snapshot.0);
            b.put_u64_le(below.map_or(0, |e| e.0));
            (b, Bytes::new())
        }
        ExtentOp::ReadAt {
            key,
            epoch,
            snapshot,
            offset,
            len,
        }
        | ExtentOp::ReadBlocksAt {
            key,
            epoch,
            snapshot,
            offset,
            len,
        } => {
            let mut b = new_head(52);
            put_key(&mut b, drive, key);
            b.put_u64_le(epoch.0);
            b.put_u64_le(snapshot.0);
            b.put_u64_le(*offset);
            b.put_u32_le(*len);
            (b, Bytes::new())
        }
        ExtentOp::Changed {
            key,
            epoch,
            from,
            to,
            offset,
            count,
        } => {
            let mut b = new_head(60);
            put_key(&mut b, drive, key);
            b.put_u64_le(epoch.0);
            b.put_u64_le(from.0);
            b.put_u64_le(to.map_or(0, |e| e.0));
            b.put_u64_le(*offset);
            b.put_u32_le(*count);
            (b, Bytes::new())
        }
        ExtentOp::Absent {
            key,
            epoch,
            at,
            offset,
            count,
        } => {
            let mut b = new_head(52);
            put_key(&mut b, drive, key);
            b.put_u64_le(epoch.0);
            b.put_u64_le(at.map_or(0, |e| e.0));
            b.put_u64_le(*offset);
            b.put_u32_le(*count);
            (b, Bytes::new())
        }
        ExtentOp::KeptBlocks {
            key,
            epoch,
            snapshots,
        } => {
            let mut b = new_head(36 + 8 * snapshots.len());
            put_key(&mut b, drive, key);
            b.put_u64_le(epoch.0);
            b.put_u32_le(u32::try_from(snapshots.len()).unwrap_or(u32::MAX));
            for s in snapshots {
                b.put_u64_le(s.0);
            }
            (b, Bytes::new())
        }
        ExtentOp::VersionsAt {
            key,
            epoch,
            snapshot,
            offset,
            count,
            any,
        } => {
            let mut b = new_head(53);
            put_key(&mut b, drive, key);
            b.put_u64_le(epoch.0);
            b.put_u64_le(snapshot.0);
            b.put_u64_le(*offset);
            b.put_u32_le(*count);
            b.put_u8(u8::from(*any));
            (b, Bytes::new())
        }
        ExtentOp::WriteShadow {
            key,
            epoch,
            snapshot,
            offset,
            crcs,
            versions,
            data,
        } => {
            let mut b = new_head(60 + 12 * crcs.len());
            put_key(&mut b, drive, key);
            b.put_u64_le(epoch.0);
            b.put_u64_le(snapshot.0);
            b.put_u64_le(*offset);
            put_u32_list(&mut b, crcs);
            put_versions(&mut b, versions);
            b.put_u32_le(u32::try_from(data.len()).unwrap_or(u32::MAX));
            (b, data.clone())
        }
    }
}

fn put_u32_list(b: &mut BytesMut, v: &[u32]) {
    b.put_u32_le(u32::try_from(v.len()).unwrap_or(u32::MAX));
    for x in v {
        b.put_u32_le(*x);
    }
}

fn put_versions(b: &mut BytesMut, v: &[Version]) {
    b.put_u32_le(u32::try_from(v.len()).unwrap_or(u32::MAX));
    for x in v {
        b.put_u64_le(x.0);
    }
}

/// Encodes a response frame; `data` is shared, not copied.
pub fn encode_response(request_id: u64, resp: &Response) -> EncodedFrame {
    let t = response_type(resp);
    match resp {
        Response::HelloOk { node } => {
            let mut b = new_head(4);
            b.put_u32_le(node.0);
            finish(t, request_id, b, Bytes::new())
        }
        Response::Pong => finish(t, request_id, new_head(0), Bytes::new()),
        Response::Extent(r) => {
            let (b, data) = encode_extent_reply(r);
            finish(t, request_id, b, data)
        }
        Response::Err { code, message } => {
            let m = err_message_prefix(message).as_bytes();
            let mut b = new_head(6 + m.len());
            b.put_u16_le(code.to_u16());
            b.put_u32_le(m.len() as u32);
            b.put_slice(m);
            finish(t, request_id, b, Bytes::new())
        }
    }
}

/// The part of an error message that goes on the wire: at most [`ERR_MESSAGE_BYTES_MAX`]
/// bytes, cut at a character boundary. The decoder applies it too, so that what it returns
/// encodes unchanged (lossy decoding turns each bad byte into 3: a message can grow).
fn err_message_prefix(message: &str) -> &str {
    let mut end = message.len().min(ERR_MESSAGE_BYTES_MAX);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    &message[..end]
}

/// The fields of an extent operation's answer after the frame header, and its bulk data.
fn encode_extent_reply(r: &ExtentReply) -> (BytesMut, Bytes) {
    match r {
        ExtentReply::Ok => (new_head(0), Bytes::new()),
        ExtentReply::Read(ReadReply {
            data,
            bad_blocks,
            suspect,
            version,
        }) => {
            let mut b = new_head(20 + 4 * (bad_blocks.len() + suspect.len()));
            b.put_u64_le(version.0);
            put_u32_list(&mut b, bad_blocks);
            put_u32_list(&mut b, suspect);
            b.put_u32_le(u32::try_from(data.len()).unwrap_or(u32::MAX));
            (b, data.clone())
        }
        ExtentReply::Blocks(BlocksReply {
            data,
            bad_blocks,
            suspect,
            versions,
        }) => {
            let mut b = new_head(16 + 4 * (bad_blocks.len() + suspect.len()) + 8 * versions.len());
            put_u32_list(&mut b, bad_blocks);
            put_u32_list(&mut b, suspect);
            put_versions(&mut b, versions);
            b.put_u32_le(u32::try_from(data.len()).unwrap_or(u32::MAX));
            (b, data.clone())
        }
        ExtentReply::Versions(versions) => {
            let mut b = new_head(4 + 8 * versions.len());
            put_versions(&mut b, versions);
            (b, Bytes::new())
        }
        ExtentReply::Written(blocks) => {
            let mut b = new_head(4);
            b.put_u32_le(*blocks);
            (b, Bytes::new())
        }
        ExtentReply::Digest(digest) => {
            let mut b = new_head(8);
            b.put_u64_le(*digest);
            (b, Bytes::new())
        }
        ExtentReply::Priors(v) => {
            // Two lists of equal length: the versions, then the priors (u64::MAX: none;
            // no block version reaches it).
            let mut b = new_head(8 + 16 * v.len());
            let count = u32::try_from(v.len()).unwrap_or(u32::MAX);
            b.put_u32_le(count);
            for (cur, _) in v {
                b.put_u64_le(cur.0);
            }
            b.put_u32_le(count);
            for (_, prior) in v {
                b.put_u64_le(prior.map_or(NO_PRIOR, |p| p.0));
            }
            (b, Bytes::new())
        }
        ExtentReply::Bitmap(words) | ExtentReply::Counts(words) => {
            let mut b = new_head(4 + 8 * words.len());
            b.put_u32_le(u32::try_from(words.len()).unwrap_or(u32::MAX));
            for w in words {
                b.put_u64_le(*w);
            }
            (b, Bytes::new())
        }
    }
}

/// A block without a prior, in a [`msg::PRIORS_OK`] answer.
const NO_PRIOR: u64 = u64::MAX;

/// Checks the payload against the crc in its header.
pub fn check_payload(header: &FrameHeader, payload: &[u8]) -> Result<(), WireError> {
    let computed = crc32c::crc32c(payload);
    if computed != header.payload_crc {
        return Err(WireError::PayloadChecksum {
            stored: header.payload_crc,
            computed,
        });
    }
    Ok(())
}

/// Splits one complete frame held in `buf` into header and payload (checks both crcs).
/// Returns the number of bytes consumed as well, so callers can walk a buffer of frames.
pub fn decode_frame(
    buf: &Bytes,
    payload_bytes_max: usize,
) -> Result<(FrameHeader, Bytes, usize), WireError> {
    let Some(h) = buf.get(..HEADER_LEN) else {
        return Err(WireError::Truncated {
            field: "frame header",
            needed: HEADER_LEN - buf.len(),
        });
    };
    let mut hb = [0u8; HEADER_LEN];
    hb.copy_from_slice(h);
    let header = FrameHeader::decode(&hb, payload_bytes_max)?;
    let end = HEADER_LEN + header.payload_len as usize;
    if buf.len() < end {
        return Err(WireError::Truncated {
            field: "frame payload",
            needed: end - buf.len(),
        });
    }
    let payload = buf.slice(HEADER_LEN..end);
    check_payload(&header, &payload)?;
    Ok((header, payload, end))
}

/// Reads fields off a payload without panicking.
struct Reader {
    buf: Bytes,
    pos: usize,
}

impl Reader {
    fn new(buf: Bytes) -> Reader {
        Reader { buf, pos: 0 }
    }

    fn take(&mut self, n: usize, field: &'static str) -> Result<&[u8], WireError> {
        let left = self.buf.len() - self.pos;
        if n > left {
            return Err(WireError::Truncated {
                field,
                needed: n - left,
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn take_bytes(&mut self, n: usize, field: &'static str) -> Result<Bytes, WireError> {
        let left = self.buf.len() - self.pos;
        if n > left {
            return Err(WireError::Truncated {
                field,
                needed: n - left,
            });
        }
        let b = self.buf.slice(self.pos..self.pos + n);
        self.pos += n;
        Ok(b)
    }

    fn u16(&mut self, f: &'static str) -> Result<u16, WireError> {
        let s = self.take(2, f)?;
        Ok(u16::from_le_bytes([s[0], s[1]]))
    }

    fn u32(&mut self, f: &'static str) -> Result<u32, WireError> {
        let s = self.take(4, f)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }

    fn u64(&mut self, f: &'static str) -> Result<u64, WireError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8, f)?);
        Ok(u64::from_le_bytes(a))
    }

    fn u128(&mut self, f: &'static str) -> Result<u128, WireError> {
        let mut a = [0u8; 16];
        a.copy_from_slice(self.take(16, f)?);
        Ok(u128::from_le_bytes(a))
    }

    /// A u32 count followed by that many u32s; the count is checked before allocating.
    fn u32_list(&mut self, f: &'static str) -> Result<Vec<u32>, WireError> {
        let n = self.u32(f)? as usize;
        let raw = self.take(n.saturating_mul(4), f)?;
        Ok(raw
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// A list of crcs, in one allocation (the count is checked before allocating).
    fn crcs(&mut self, f: &'static str) -> Result<Arc<[u32]>, WireError> {
        let n = self.u32(f)? as usize;
        let raw = self.take(n.saturating_mul(4), f)?;
        Ok(raw
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// A u32 count followed by that many u64 versions; the count is checked first.
    fn versions(&mut self, f: &'static str) -> Result<Vec<Version>, WireError> {
        let n = self.u32(f)? as usize;
        let raw = self.take(n.saturating_mul(8), f)?;
        Ok(raw
            .chunks_exact(8)
            .map(|c| {
                let mut a = [0u8; 8];
                a.copy_from_slice(c);
                Version(u64::from_le_bytes(a))
            })
            .collect())
    }

    /// A settle's row ranges: a u32 count (at most [`SETTLE_ROWS_MAX`]), then per range
    /// its first block, block count (above 0) and version, each range inside an extent.
    fn settle_rows(&mut self) -> Result<Vec<SettleRows>, WireError> {
        let n = self.u32("settle rows")? as usize;
        if n > SETTLE_ROWS_MAX {
            return Err(WireError::Invalid(format!(
                "a settle names {n} row ranges; at most {SETTLE_ROWS_MAX}"
            )));
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let first = self.u32("settle rows")?;
            let count = self.u32("settle rows")?;
            let upto = Version(self.u64("settle rows")?);
            if count == 0 || first.checked_add(count).is_none() {
                return Err(WireError::Invalid(format!(
                    "a settle names rows {first}+{count}: not a range of blocks"
                )));
            }
            out.push(SettleRows { first, count, upto });
        }
        Ok(out)
    }

    fn u8(&mut self, f: &'static str) -> Result<u8, WireError> {
        Ok(self.take(1, f)?[0])
    }

    /// A packed write's codec: a known one other than none (the plain messages say none).
    fn codec(&mut self) -> Result<Compression, WireError> {
        let c = self.u8("codec")?;
        match Compression::from_code(c) {
            Some(codec) if !codec.is_none() => Ok(codec),
            _ => Err(WireError::Invalid(format!(
                "codec {c} is not one this node knows (1 lz4, 2 zstd)"
            ))),
        }
    }

    fn drive_key(&mut self) -> Result<(DriveId, ExtentKey), WireError> {
        let drive = DriveId(self.u64("drive")?);
        let volume = VolumeId(self.u64("volume")?);
        let slab = SlabIndex(self.u64("slab")?);
        Ok((drive, ExtentKey { volume, slab }))
    }

    fn finish(self) -> Result<(), WireError> {
        let left = self.buf.len() - self.pos;
        if left != 0 {
            return Err(WireError::Trailing(left));
        }
        Ok(())
    }
}

/// Decodes a request payload of type `msg_type`. `payload` is sliced, not copied.
pub fn decode_request(msg_type: u8, payload: Bytes) -> Result<Request, WireError> {
    let mut r = Reader::new(payload);
    let req = match msg_type {
        msg::HELLO => Request::Hello(Hello {
            cluster: ClusterId(r.u128("cluster")?),
            node: NodeId(r.u32("node")?),
            protocol_version: r.u16("protocol_version")?,
        }),
        msg::PING => Request::Ping,
        msg::WRITE..=msg::WRITE_BLOCKS_PACKED | msg::SNAPSHOT_FLOOR..=msg::KEPT_BLOCKS => {
            decode_extent_op(msg_type, &mut r)?
        }
        msg::VOL_READ => Request::VolRead {
            volume: VolumeId(r.u64("volume")?),
            offset: r.u64("offset")?,
            len: r.u32("len")?,
        },
        msg::VOL_WRITE => {
            let volume = VolumeId(r.u64("volume")?);
            let offset = r.u64("offset")?;
            let len = r.u32("data length")? as usize;
            let data = r.take_bytes(len, "data")?;
            Request::VolWrite {
                volume,
                offset,
                data,
            }
        }
        msg::VOL_ZERO => Request::VolZero {
            volume: VolumeId(r.u64("volume")?),
            offset: r.u64("offset")?,
            len: r.u64("len")?,
            trim: match r.u8("trim")? {
                0 => false,
                1 => true,
                v => return Err(WireError::Invalid(format!("trim flag {v} is not 0 or 1"))),
            },
        },
        msg::VOL_READ_AT => Request::VolReadAt {
            volume: VolumeId(r.u64("volume")?),
            snapshot: Epoch(r.u64("snapshot")?),
            offset: r.u64("offset")?,
            len: r.u32("len")?,
        },
        msg::VOL_CHANGED => Request::VolChanged {
            volume: VolumeId(r.u64("volume")?),
            from: Epoch(r.u64("from snapshot")?),
            to: Some(Epoch(r.u64("to snapshot")?)).filter(|e| e.0 > 0),
            offset: r.u64("offset")?,
            len: r.u64("len")?,
        },
        other => return Err(WireError::UnknownType(other)),
    };
    r.finish()?;
    validate_request(&req)?;
    Ok(req)
}

/// Decodes the extent operation of type `msg_type` (one of `0x10..=0x1e`).
fn decode_extent_op(msg_type: u8, r: &mut Reader) -> Result<Request, WireError> {
    let (drive, key) = r.drive_key()?;
    let op = match msg_type {
        msg::WRITE | msg::WRITE_HELD | msg::WRITE_PACKED => {
            let epoch = Epoch(r.u64("epoch")?);
            let version = Version(r.u64("version")?);
            let offset = r.u64("offset")?;
            let codec = if msg_type == msg::WRITE_PACKED {
                r.codec()?
            } else {
                Compression::None
            };
            let crcs = r.crcs("crcs")?;
            let len = r.u32("data length")? as usize;
            let data = r.take_bytes(len, "data")?;
            if msg_type != msg::WRITE_HELD {
                ExtentOp::Write {
                    key,
                    epoch,
                    version,
                    offset,
                    crcs,
                    data,
                    codec,
                }
            } else {
                ExtentOp::WriteHeld {
                    key,
                    epoch,
                    version,
                    offset,
                    crcs,
                    data,
                }
            }
        }
        msg::READ => ExtentOp::Read {
            key,
            epoch: Epoch(r.u64("epoch")?),
            offset: r.u64("offset")?,
            len: r.u32("len")?,
        },
        msg::ZERO => ExtentOp::Zero {
            key,
            epoch: Epoch(r.u64("epoch")?),
            version: Version(r.u64("version")?),
            offset: r.u64("offset")?,
            len: r.u64("len")?,
        },
        msg::FREE_EXTENT => ExtentOp::Free { key },
        msg::READ_BLOCKS => ExtentOp::ReadBlocks {
            key,
            epoch: Epoch(r.u64("epoch")?),
            offset: r.u64("offset")?,
            len: r.u32("len")?,
        },
        msg::WRITE_BLOCKS | msg::WRITE_BLOCKS_PACKED => {
            let epoch = Epoch(r.u64("epoch")?);
            let offset = r.u64("offset")?;
            let codec = if msg_type == msg::WRITE_BLOCKS_PACKED {
                r.codec()?
            } else {
                Compression::None
            };
            let crcs = r.crcs("crcs")?;
            let versions = r.versions("versions")?;
            let expect = r.versions("expected versions")?;
            let len = r.u32("data length")? as usize;
            let data = r.take_bytes(len, "data")?;
            ExtentOp::WriteBlocks {
                key,
                epoch,
                offset,
                crcs,
                versions,
                expect,
                data,
                codec,
            }
        }
        msg::VERSIONS => ExtentOp::Versions {
            key,
            epoch: Epoch(r.u64("epoch")?),
            offset: r.u64("offset")?,
            count: r.u32("count")?,
        },
        msg::DIGEST => ExtentOp::Digest {
            key,
            epoch: Epoch(r.u64("epoch")?),
        },
        msg::RELEASE_EXTENT => ExtentOp::Release {
            key,
            epoch: Epoch(r.u64("epoch")?),
            upto: Version(r.u64("upto")?),
        },
        msg::SETTLE => ExtentOp::Settle {
            key,
            epoch: Epoch(r.u64("epoch")?),
            upto: Version(r.u64("upto")?),
            rows: r.settle_rows()?,
        },
        msg::REVERT => ExtentOp::Revert {
            key,
            epoch: Epoch(r.u64("epoch")?),
            version: Version(r.u64("version")?),
            offset: r.u64("offset")?,
            len: r.u32("len")?,
        },
        msg::PRIORS => ExtentOp::Priors {
            key,
            epoch: Epoch(r.u64("epoch")?),
            offset: r.u64("offset")?,
            count: r.u32("count")?,
        },
        msg::SNAPSHOT_FLOOR => ExtentOp::SnapshotFloor {
            key,
            epoch: Epoch(r.u64("epoch")?),
            snapshot: Epoch(r.u64("snapshot")?),
            previous: Some(Epoch(r.u64("previous snapshot")?)).filter(|e| e.0 > 0),
            history: {
                let c = r.u8("history")?;
                converge_types::FloorHistory::from_code(c).ok_or_else(|| {
                    WireError::Invalid(format!("snapshot floor history {c} is not 0 to 3"))
                })?
            },
        },
        msg::DROP_SNAPSHOT => ExtentOp::DropSnapshot {
            key,
            epoch: Epoch(r.u64("epoch")?),
            snapshot: Epoch(r.u64("snapshot")?),
            below: Some(Epoch(r.u64("older snapshot")?)).filter(|e| e.0 > 0),
        },
        msg::READ_AT => ExtentOp::ReadAt {
            key,
            epoch: Epoch(r.u64("epoch")?),
            snapshot: Epoch(r.u64("snapshot")?),
            offset: r.u64("offset")?,
            len: r.u32("len")?,
        },
        msg::CHANGED => ExtentOp::Changed {
            key,
            epoch: Epoch(r.u64("epoch")?),
            from: Epoch(r.u64("from snapshot")?),
            to: Some(Epoch(r.u64("to snapshot")?)).filter(|e| e.0 > 0),
            offset: r.u64("offset")?,
            count: r.u32("count")?,
        },
        msg::ABSENT => ExtentOp::Absent {
            key,
            epoch: Epoch(r.u64("epoch")?),
            at: Some(Epoch(r.u64("snapshot")?)).filter(|e| e.0 > 0),
            offset: r.u64("offset")?,
            count: r.u32("count")?,
        },
        msg::VERSIONS_AT => ExtentOp::VersionsAt {
            key,
            epoch: Epoch(r.u64("epoch")?),
            snapshot: Epoch(r.u64("snapshot")?),
            offset: r.u64("offset")?,
            count: r.u32("count")?,
            any: match r.u8("any")? {
                0 => false,
                1 => true,
                c => {
                    return Err(WireError::Invalid(format!(
                        "versions-at flag {c} is not 0 or 1"
                    )))
                }
            },
        },
        msg::READ_BLOCKS_AT => ExtentOp::ReadBlocksAt {
            key,
            epoch: Epoch(r.u64("epoch")?),
            snapshot: Epoch(r.u64("snapshot")?),
            offset: r.u64("offset")?,
            len: r.u32("len")?,
        },
        msg::WRITE_SHADOW => {
            let epoch = Epoch(r.u64("epoch")?);
            let snapshot = Epoch(r.u64("snapshot")?);
            let offset = r.u64("offset")?;
            let crcs = r.crcs("crcs")?;
            let versions = r.versions("versions")?;
            let len = r.u32("data length")? as usize;
            let data = r.take_bytes(len, "data")?;
            ExtentOp::WriteShadow {
                key,
                epoch,
                snapshot,
                offset,
                crcs,
                versions,
                data,
            }
        }
        msg::KEPT_BLOCKS => {
            let epoch = Epoch(r.u64("epoch")?);
            let snapshots: Vec<Epoch> = r
                .versions("snapshots")?
                .into_iter()
                .map(|v| Epoch(v.0))
                .collect();
            if snapshots.len() > converge_types::KEPT_SNAPSHOTS_MAX {
                return Err(WireError::Invalid(format!(
                    "{} snapshots named; at most {}",
                    snapshots.len(),
                    converge_types::KEPT_SNAPSHOTS_MAX
                )));
            }
            ExtentOp::KeptBlocks {
                key,
                epoch,
                snapshots,
            }
        }
        other => return Err(WireError::UnknownType(other)),
    };
    Ok(Request::Extent { drive, op })
}

/// Decodes a response payload of type `msg_type`. `payload` is sliced, not copied.
pub fn decode_response(msg_type: u8, payload: Bytes) -> Result<Response, WireError> {
    let mut r = Reader::new(payload);
    let resp = match msg_type {
        msg::HELLO_OK => Response::HelloOk {
            node: NodeId(r.u32("node")?),
        },
        msg::PONG => Response::Pong,
        msg::OK => Response::ok(),
        msg::READ_OK => {
            let version = Version(r.u64("version")?);
            let bad_blocks = r.u32_list("bad_blocks")?;
            let suspect = r.u32_list("suspect blocks")?;
            let len = r.u32("data length")? as usize;
            let data = r.take_bytes(len, "data")?;
            Response::Extent(ExtentReply::Read(ReadReply {
                data,
                bad_blocks,
                suspect,
                version,
            }))
        }
        msg::BLOCKS_OK => {
            let bad_blocks = r.u32_list("bad_blocks")?;
            let suspect = r.u32_list("suspect blocks")?;
            let versions = r.versions("versions")?;
            let len = r.u32("data length")? as usize;
            let data = r.take_bytes(len, "data")?;
            Response::Extent(ExtentReply::Blocks(BlocksReply {
                data,
                bad_blocks,
                suspect,
                versions,
            }))
        }
        msg::VERSIONS_OK => Response::Extent(ExtentReply::Versions(r.versions("versions")?)),
        msg::WRITTEN => Response::Extent(ExtentReply::Written(r.u32("blocks")?)),
        msg::DIGEST_OK => Response::Extent(ExtentReply::Digest(r.u64("digest")?)),
        msg::PRIORS_OK => {
            let versions = r.versions("versions")?;
            let priors = r.versions("priors")?;
            if priors.len() != versions.len() {
                return Err(WireError::Invalid(format!(
                    "{} priors for {} versions",
                    priors.len(),
                    versions.len()
                )));
            }
            let pairs = versions
                .into_iter()
                .zip(priors)
                .map(|(v, p)| (v, (p.0 != NO_PRIOR).then_some(p)))
                .collect();
            Response::Extent(ExtentReply::Priors(pairs))
        }
        msg::BITMAP_OK | msg::COUNTS_OK => {
            let n = r.u32("words")? as usize;
            let raw = r.take(n.saturating_mul(8), "words")?;
            let words = raw
                .chunks_exact(8)
                .map(|c| {
                    let mut a = [0u8; 8];
                    a.copy_from_slice(c);
                    u64::from_le_bytes(a)
                })
                .collect();
            Response::Extent(match msg_type {
                msg::BITMAP_OK => ExtentReply::Bitmap(words),
                _ => ExtentReply::Counts(words),
            })
        }
        msg::ERR => {
            let code = ErrorCode::from_u16(r.u16("error code")?);
            let len = r.u32("message length")? as usize;
            let raw = String::from_utf8_lossy(r.take(len, "message")?);
            let message = err_message_prefix(&raw).to_owned();
            Response::Err { code, message }
        }
        other => return Err(WireError::UnknownType(other)),
    };
    r.finish()?;
    Ok(resp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, RngCore, SeedableRng};

    const MAX: usize = 1 << 20;

    fn key(rng: &mut impl Rng) -> ExtentKey {
        ExtentKey {
            volume: VolumeId(rng.gen()),
            slab: SlabIndex(rng.gen()),
        }
    }

    fn data(rng: &mut impl Rng, blocks: usize) -> (Arc<[u32]>, Bytes) {
        let mut d = vec![0u8; blocks * BLOCK_SIZE];
        rng.fill_bytes(&mut d);
        let crcs = d.chunks(BLOCK_SIZE).map(crc32c::crc32c).collect();
        (crcs, Bytes::from(d))
    }

    fn random_codec(rng: &mut impl Rng) -> converge_types::Compression {
        use converge_types::Compression::*;
        [None, Lz4, Zstd][rng.gen_range(0..3)]
    }

    fn random_request(rng: &mut impl Rng) -> Request {
        match rng.gen_range(0..29) {
            28 => Request::Extent {
                drive: DriveId(rng.gen()),
                op: ExtentOp::KeptBlocks {
                    key: key(rng),
                    epoch: Epoch(rng.gen()),
                    snapshots: (0..rng.gen_range(0..70))
                        .map(|_| Epoch(rng.gen()))
                        .collect(),
                },
            },
            25 => Request::Extent {
                drive: DriveId(rng.gen()),
                op: ExtentOp::VersionsAt {
                    key: key(rng),
                    epoch: Epoch(rng.gen()),
                    snapshot: Epoch(rng.gen()),
                    offset: rng.gen(),
                    count: rng.gen(),
                    any: rng.gen(),
                },
            },
            26 => Request::Extent {
                drive: DriveId(rng.gen()),
                op: ExtentOp::ReadBlocksAt {
                    key: key(rng),
                    epoch: Epoch(rng.gen()),
                    snapshot: Epoch(rng.gen()),
                    offset: rng.gen(),
                    len: rng.gen(),
                },
            },
            27 => {
                let blocks = rng.gen_range(0..5);
                let (crcs, data) = data(rng, blocks);
                Request::Extent {
                    drive: DriveId(rng.gen()),
                    op: ExtentOp::WriteShadow {
                        key: key(rng),
                        epoch: Epoch(rng.gen()),
                        snapshot: Epoch(rng.gen()),
                        offset: rng.gen(),
                        versions: (0..blocks).map(|_| Version(rng.gen())).collect(),
                        crcs,
                        data,
                    },
                }
            }
            24 => Request::Extent {
                drive: DriveId(rng.gen()),
                op: ExtentOp::Absent {
                    key: key(rng),
                    epoch: Epoch(rng.gen()),
                    at: rng.gen_bool(0.5).then(|| Epoch(rng.gen_range(1..u64::MAX))),
                    offset: rng.gen(),
                    count: rng.gen(),
                },
            },
            22 => Request::VolChanged {
                volume: VolumeId(rng.gen()),
                from: Epoch(rng.gen()),
                // 0 on the wire is "now".
                to: rng.gen_bool(0.5).then(|| Epoch(rng.gen_range(1..u64::MAX))),
                offset: rng.gen(),
                len: rng.gen(),
            },
            23 => Request::Extent {
                drive: DriveId(rng.gen()),
                op: ExtentOp::Changed {
                    key: key(rng),
                    epoch: Epoch(rng.gen()),
                    from: Epoch(rng.gen()),
                    to: rng.gen_bool(0.5).then(|| Epoch(rng.gen_range(1..u64::MAX))),
                    offset: rng.gen(),
                    count: rng.gen(),
                },
            },
            21 => Request::VolReadAt {
                volume: VolumeId(rng.gen()),
                snapshot: Epoch(rng.gen()),
                offset: rng.gen(),
                len: rng.gen(),
            },
            18 => Request::Extent {
                drive: DriveId(rng.gen()),
                op: ExtentOp::SnapshotFloor {
                    key: key(rng),
                    epoch: Epoch(rng.gen()),
                    snapshot: Epoch(rng.gen()),
                    previous: rng.gen_bool(0.5).then(|| Epoch(rng.gen_range(1..u64::MAX))),
                    history: converge_types::FloorHistory::from_code(rng.gen_range(0..4))
                        .expect("0..4 are codes"),
                },
            },
            19 => Request::Extent {
                drive: DriveId(rng.gen()),
                op: ExtentOp::DropSnapshot {
                    key: key(rng),
                    epoch: Epoch(rng.gen()),
                    snapshot: Epoch(rng.gen()),
                    // 0 on the wire is "no older snapshot".
                    below: rng.gen_bool(0.5).then(|| Epoch(rng.gen_range(1..u64::MAX))),
                },
            },
            20 => Request::Extent {
                drive: DriveId(rng.gen()),
                op: ExtentOp::ReadAt {
                    key: key(rng),
                    epoch: Epoch(rng.gen()),
                    snapshot: Epoch(rng.gen()),
                    offset: rng.gen(),
                    len: rng.gen(),
                },
            },
            15 => Request::Extent {
                drive: DriveId(rng.gen()),
                op: ExtentOp::Settle {
                    key: key(rng),
                    epoch: Epoch(rng.gen()),
                    upto: Version(rng.gen()),
                    rows: (0..rng.gen_range(0..4))
                        .map(|_| SettleRows {
                            first: rng.gen_range(0..1 << 20),
                            count: rng.gen_range(1..1 << 10),
                            upto: Version(rng.gen()),
                        })
                        .collect(),
                },
            },
            16 => Request::Extent {
                drive: DriveId(rng.gen()),
                op: ExtentOp::Revert {
                    key: key(rng),
                    epoch: Epoch(rng.gen()),
                    version: Version(rng.gen()),
                    offset: rng.gen(),
                    len: rng.gen(),
                },
            },
            17 => Request::Extent {
                drive: DriveId(rng.gen()),
                op: ExtentOp::Priors {
                    key: key(rng),
                    epoch: Epoch(rng.gen()),
                    offset: rng.gen(),
                    count: rng.gen(),
                },
            },
            13 => Request::Extent {
                drive: DriveId(rng.gen()),
                op: ExtentOp::Release {
                    key: key(rng),
                    epoch: Epoch(rng.gen()),
                    upto: Version(rng.gen()),
                },
            },
            12 => Request::Extent {
                drive: DriveId(rng.gen()),
                op: ExtentOp::Digest {
                    key: key(rng),
                    epoch: Epoch(rng.gen()),
                },
            },
            6 => Request::Extent {
                drive: DriveId(rng.gen()),
                op: ExtentOp::ReadBlocks {
                    key: key(rng),
                    epoch: Epoch(rng.gen()),
                    offset: rng.gen(),
                    len: rng.gen(),
                },
            },
            7 => {
                let blocks = rng.gen_range(0..5);
                let (crcs, data) = data(rng, blocks);
                Request::Extent {
                    drive: DriveId(rng.gen()),
                    op: ExtentOp::WriteBlocks {
                        key: key(rng),
                        epoch: Epoch(rng.gen()),
                        offset: rng.gen(),
                        versions: (0..blocks).map(|_| Version(rng.gen())).collect(),
                        expect: (0..blocks).map(|_| Version(rng.gen())).collect(),
                        crcs,
                        data,
                        codec: random_codec(rng),
                    },
                }
            }
            8 => Request::Extent {
                drive: DriveId(rng.gen()),
                op: ExtentOp::Versions {
                    key: key(rng),
                    epoch: Epoch(rng.gen()),
                    offset: rng.gen(),
                    count: rng.gen(),
                },
            },
            9 => Request::VolRead {
                volume: VolumeId(rng.gen()),
                offset: rng.gen(),
                len: rng.gen(),
            },
            10 => {
                let blocks = rng.gen_range(0..5);
                let (_, data) = data(rng, blocks);
                Request::VolWrite {
                    volume: VolumeId(rng.gen()),
                    offset: rng.gen(),
                    data,
                }
            }
            11 => Request::VolZero {
                volume: VolumeId(rng.gen()),
                offset: rng.gen(),
                len: rng.gen(),
                trim: rng.gen(),
            },
            0 => Request::Hello(Hello {
                cluster: ClusterId(rng.gen()),
                node: NodeId(rng.gen()),
                protocol_version: rng.gen(),
            }),
            n @ (1 | 14) => {
                let blocks = rng.gen_range(0..5);
                let (crcs, data) = data(rng, blocks);
                let (key, epoch) = (key(rng), Epoch(rng.gen()));
                let (version, offset) = (Version(rng.gen()), rng.gen());
                let op = if n == 1 {
                    ExtentOp::Write {
                        key,
                        epoch,
                        version,
                        offset,
                        crcs,
                        data,
                        codec: random_codec(rng),
                    }
                } else {
                    ExtentOp::WriteHeld {
                        key,
                        epoch,
                        version,
                        offset,
                        crcs,
                        data,
                    }
                };
                Request::Extent {
                    drive: DriveId(rng.gen()),
                    op,
                }
            }
            2 => Request::Extent {
                drive: DriveId(rng.gen()),
                op: ExtentOp::Read {
                    key: key(rng),
                    epoch: Epoch(rng.gen()),
                    offset: rng.gen(),
                    len: rng.gen(),
                },
            },
            3 => Request::Extent {
                drive: DriveId(rng.gen()),
                op: ExtentOp::Zero {
                    key: key(rng),
                    epoch: Epoch(rng.gen()),
                    version: Version(rng.gen()),
                    offset: rng.gen(),
                    len: rng.gen(),
                },
            },
            4 => Request::Extent {
                drive: DriveId(rng.gen()),
                op: ExtentOp::Free { key: key(rng) },
            },
            _ => Request::Ping,
        }
    }

    fn random_string(rng: &mut impl Rng) -> String {
        let n = rng.gen_range(0..40);
        (0..n)
            .map(|_| {
                if rng.gen_bool(0.2) {
                    'é'
                } else {
                    rng.gen_range(' '..='~')
                }
            })
            .collect()
    }

    fn random_response(rng: &mut impl Rng) -> Response {
        match rng.gen_range(0..12) {
            11 => Response::Extent(ExtentReply::Counts(
                (0..rng.gen_range(0..40)).map(|_| rng.gen()).collect(),
            )),
            10 => Response::Extent(ExtentReply::Bitmap(
                (0..rng.gen_range(0..40)).map(|_| rng.gen()).collect(),
            )),
            9 => Response::Extent(ExtentReply::Priors(
                (0..rng.gen_range(0..9))
                    .map(|_| {
                        let prior = rng
                            .gen_bool(0.5)
                            .then(|| Version(rng.gen_range(0..u64::MAX)));
                        (Version(rng.gen()), prior)
                    })
                    .collect(),
            )),
            8 => Response::Extent(ExtentReply::Digest(rng.gen())),
            5 => {
                let blocks = rng.gen_range(0..5);
                let (_, data) = data(rng, blocks);
                Response::Extent(ExtentReply::Blocks(BlocksReply {
                    data,
                    bad_blocks: (0..rng.gen_range(0..3)).map(|_| rng.gen()).collect(),
                    suspect: (0..rng.gen_range(0..3)).map(|_| rng.gen()).collect(),
                    versions: (0..blocks).map(|_| Version(rng.gen())).collect(),
                }))
            }
            6 => Response::Extent(ExtentReply::Versions(
                (0..rng.gen_range(0..9))
                    .map(|_| Version(rng.gen()))
                    .collect(),
            )),
            7 => Response::Extent(ExtentReply::Written(rng.gen())),
            0 => Response::HelloOk {
                node: NodeId(rng.gen()),
            },
            1 => Response::ok(),
            2 => {
                let blocks = rng.gen_range(0..5);
                let (_, data) = data(rng, blocks);
                let n = rng.gen_range(0..6);
                Response::Extent(ExtentReply::Read(ReadReply {
                    data,
                    bad_blocks: (0..n).map(|_| rng.gen()).collect(),
                    suspect: (0..rng.gen_range(0..3)).map(|_| rng.gen()).collect(),
                    version: Version(rng.gen()),
                }))
            }
            3 => Response::Pong,
            _ => Response::Err {
                code: ErrorCode::ALL[rng.gen_range(0..ErrorCode::ALL.len())],
                message: random_string(rng),
            },
        }
    }

    #[test]
    fn requests_round_trip() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..2000 {
            let req = random_request(&mut rng);
            let id: u64 = rng.gen();
            let frame = encode_request(id, &req);
            let buf = Bytes::from(frame.to_vec());
            let (h, payload, used) = decode_frame(&buf, MAX).expect("frame decodes");
            assert_eq!(used, buf.len());
            assert_eq!(h.request_id, id);
            assert_eq!(h.payload_len as usize, frame.payload_len());
            seen.insert(h.msg_type);
            let back = decode_request(h.msg_type, payload).expect("request decodes");
            assert_eq!(back, req);
        }
        assert_eq!(seen.len(), 31, "every request type was exercised");
    }

    /// A write without compression keeps its message type and bytes (nodes of older
    /// builds read it); with compression it is a `WRITE_PACKED` that carries the codec
    /// after the offset, and a codec this node does not know (or none) is refused there.
    #[test]
    fn packed_writes_carry_their_codec_and_plain_ones_stay_as_they_were() {
        use converge_types::Compression;
        let k = ExtentKey {
            volume: VolumeId(3),
            slab: SlabIndex(4),
        };
        let data = Bytes::from(vec![7u8; BLOCK_SIZE]);
        let crcs: Arc<[u32]> = Arc::from([crc32c::crc32c(&data)]);
        let write = |codec| Request::Extent {
            drive: DriveId(9),
            op: ExtentOp::Write {
                key: k,
                epoch: Epoch(2),
                version: Version(5),
                offset: 8192,
                crcs: crcs.clone(),
                data: data.clone(),
                codec,
            },
        };
        let plain = encode_request(1, &write(Compression::None));
        let packed = encode_request(1, &write(Compression::Zstd));
        let (hp, pp, _) = decode_frame(&Bytes::from(plain.to_vec()), MAX).unwrap();
        let (hz, pz, _) = decode_frame(&Bytes::from(packed.to_vec()), MAX).unwrap();
        assert_eq!(hp.msg_type, msg::WRITE);
        assert_eq!(hz.msg_type, msg::WRITE_PACKED);
        assert_eq!(pz.len(), pp.len() + 1, "one codec byte more");
        // The codec byte sits after drive, volume, slab, epoch, version and offset.
        assert_eq!(pz[48], Compression::Zstd.code());
        for bad in [0u8, 3, 0xff] {
            let mut b = pz.to_vec();
            b[48] = bad;
            assert!(
                matches!(
                    decode_request(msg::WRITE_PACKED, Bytes::from(b)),
                    Err(WireError::Invalid(_))
                ),
                "codec {bad}"
            );
        }
        assert_eq!(
            decode_request(hz.msg_type, pz).unwrap(),
            write(Compression::Zstd)
        );
    }

    #[test]
    fn responses_round_trip() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..2000 {
            let resp = random_response(&mut rng);
            let id: u64 = rng.gen();
            let buf = Bytes::from(encode_response(id, &resp).to_vec());
            let (h, payload, _) = decode_frame(&buf, MAX).expect("frame decodes");
            assert_eq!(h.request_id, id);
            seen.insert(h.msg_type);
            assert_eq!(decode_response(h.msg_type, payload).expect("decodes"), resp);
        }
        assert_eq!(seen.len(), 12, "every response type was exercised");
    }

    /// One message of every type with fixed fields (lists of one entry, a few bytes of
    /// data: the encoder does not validate, and only the layout matters here).
    fn fixed_requests() -> Vec<Request> {
        let drive = DriveId(0x0102_0304_0506_0708);
        let key = ExtentKey {
            volume: VolumeId(0x1112_1314_1516_1718),
            slab: SlabIndex(0x2122_2324_2526_2728),
        };
        let epoch = Epoch(0x3132_3334_3536_3738);
        let data = Bytes::from_static(b"data");
        vec![
            Request::Hello(Hello {
                cluster: ClusterId(0x4142_4344_4546_4748_494a_4b4c_4d4e_4f50),
                node: NodeId(0x5152_5354),
                protocol_version: 1,
            }),
            Request::Ping,
            Request::Extent {
                drive,
                op: ExtentOp::Write {
                    key,
                    epoch,
                    version: Version(0x6162_6364_6566_6768),
                    offset: 0x7172_7374_7576_7778,
                    crcs: Arc::from([0x8182_8384]),
                    data: data.clone(),
                    codec: converge_types::Compression::None,
                },
            },
            Request::Extent {
                drive,
                op: ExtentOp::Read {
                    key,
                    epoch,
                    offset: 0x7172_7374_7576_7778,
                    len: 0x9192_9394,
                },
            },
            Request::Extent {
                drive,
                op: ExtentOp::Zero {
                    key,
                    epoch,
                    version: Version(0x6162_6364_6566_6768),
                    offset: 0x7172_7374_7576_7778,
                    len: 0xa1a2_a3a4_a5a6_a7a8,
                },
            },
            Request::Extent {
                drive,
                op: ExtentOp::Free { key },
            },
            Request::Extent {
                drive,
                op: ExtentOp::ReadBlocks {
                    key,
                    epoch,
                    offset: 0x7172_7374_7576_7778,
                    len: 0x9192_9394,
                },
            },
            Request::Extent {
                drive,
                op: ExtentOp::WriteBlocks {
                    key,
                    epoch,
                    offset: 0x7172_7374_7576_7778,
                    crcs: Arc::from([0x8182_8384]),
                    versions: vec![Version(0x6162_6364_6566_6768)],
                    expect: vec![Version(0xb1b2_b3b4_b5b6_b7b8)],
                    data: data.clone(),
                    codec: converge_types::Compression::None,
                },
            },
            Request::Extent {
                drive,
                op: ExtentOp::Versions {
                    key,
                    epoch,
                    offset: 0x7172_7374_7576_7778,
                    count: 0xc1c2_c3c4,
                },
            },
            Request::Extent {
                drive,
                op: ExtentOp::Digest { key, epoch },
            },
            Request::Extent {
                drive,
                op: ExtentOp::Release {
                    key,
                    epoch,
                    upto: Version(0x6162_6364_6566_6768),
                },
            },
            Request::Extent {
                drive,
                op: ExtentOp::WriteHeld {
                    key,
                    epoch,
                    version: Version(0x6162_6364_6566_6768),
                    offset: 0x7172_7374_7576_7778,
                    crcs: Arc::from([0x8182_8384]),
                    data: data.clone(),
                },
            },
            Request::Extent {
                drive,
                op: ExtentOp::Settle {
                    key,
                    epoch,
                    upto: Version(0x6162_6364_6566_6768),
                    rows: vec![SettleRows {
                        first: 0x0102_0304,
                        count: 0x0506_0708,
                        upto: Version(0xb1b2_b3b4_b5b6_b7b8),
                    }],
                },
            },
            Request::Extent {
                drive,
                op: ExtentOp::Revert {
                    key,
                    epoch,
                    version: Version(0x6162_6364_6566_6768),
                    offset: 0x7172_7374_7576_7778,
                    len: 0x9192_9394,
                },
            },
            Request::Extent {
                drive,
                op: ExtentOp::Priors {
                    key,
                    epoch,
                    offset: 0x7172_7374_7576_7778,
                    count: 0xc1c2_c3c4,
                },
            },
            Request::VolRead {
                volume: key.volume,
                offset: 0x7172_7374_7576_7778,
                len: 0x9192_9394,
            },
            Request::VolWrite {
                volume: key.volume,
                offset: 0x7172_7374_7576_7778,
                data,
            },
            Request::VolZero {
                volume: key.volume,
                offset: 0x7172_7374_7576_7778,
                len: 0xa1a2_a3a4_a5a6_a7a8,
                trim: true,
            },
        ]
    }

    fn fixed_responses() -> Vec<Response> {
        let data = Bytes::from_static(b"data");
        vec![
            Response::HelloOk {
                node: NodeId(0x5152_5354),
            },
            Response::Pong,
            Response::ok(),
            Response::Extent(ExtentReply::Read(ReadReply {
                data: data.clone(),
                bad_blocks: vec![0xd1d2_d3d4],
                suspect: vec![0xc1c2_c3c4, 7],
                version: Version(0x6162_6364_6566_6768),
            })),
            Response::Extent(ExtentReply::Blocks(BlocksReply {
                data,
                bad_blocks: vec![0xd1d2_d3d4],
                suspect: vec![0xc1c2_c3c4, 7],
                versions: vec![Version(0x6162_6364_6566_6768)],
            })),
            Response::Extent(ExtentReply::Versions(vec![Version(0x6162_6364_6566_6768)])),
            Response::Extent(ExtentReply::Written(0xe1e2_e3e4)),
            Response::Extent(ExtentReply::Digest(0xf1f2_f3f4_f5f6_f7f8)),
            Response::Extent(ExtentReply::Priors(vec![
                (
                    Version(0x6162_6364_6566_6768),
                    Some(Version(0xb1b2_b3b4_b5b6_b7b8)),
                ),
                (Version(0x6162_6364_6566_6768), None),
            ])),
            Response::err(ErrorCode::StaleEpoch, "old"),
        ]
    }

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    /// The frames of `fixed_requests` and `fixed_responses` (request id 0x0a0b0c0d0e0f1011),
    /// byte by byte as docs/FORMAT-rpc.md describes them: a change of the encoding fails here.
    const GOLDEN_REQUESTS: [&str; 18] = [
        "435652500200010011100f0e0d0c0b0a160000002ac21df700000000773b0fce504f4e4d4c4b4a494847464544434241545352510100",
        "435652500200020011100f0e0d0c0b0a00000000000000000000000076f2608e",
        "435652500200100011100f0e0d0c0b0a40000000ef063490000000003c09e77908070605040302011817161514131211282726252423222138373635343332316867666564636261787776757473727101000000848382810400000064617461",
        "435652500200110011100f0e0d0c0b0a2c00000040812b5e000000000afdfb7b0807060504030201181716151413121128272625242322213837363534333231787776757473727194939291",
        "435652500200120011100f0e0d0c0b0a380000009ec551c80000000056bcc446080706050403020118171615141312112827262524232221383736353433323168676665646362617877767574737271a8a7a6a5a4a3a2a1",
        "435652500200130011100f0e0d0c0b0a180000000e233ef6000000004f7ca4f3080706050403020118171615141312112827262524232221",
        "435652500200140011100f0e0d0c0b0a2c00000040812b5e000000009fdf55520807060504030201181716151413121128272625242322213837363534333231787776757473727194939291",
        "435652500200150011100f0e0d0c0b0a500000003968ba92000000008bdd004908070605040302011817161514131211282726252423222138373635343332317877767574737271010000008483828101000000686766656463626101000000b8b7b6b5b4b3b2b10400000064617461",
        "435652500200160011100f0e0d0c0b0a2c0000009f7fd93a00000000484dbdad08070605040302011817161514131211282726252423222138373635343332317877767574737271c4c3c2c1",
        "435652500200170011100f0e0d0c0b0a200000009db46e6500000000e63c5f5b0807060504030201181716151413121128272625242322213837363534333231",
        "435652500200180011100f0e0d0c0b0a280000007c26257700000000a7527fd908070605040302011817161514131211282726252423222138373635343332316867666564636261",
        "435652500200190011100f0e0d0c0b0a40000000ef06349000000000ca7f85ce08070605040302011817161514131211282726252423222138373635343332316867666564636261787776757473727101000000848382810400000064617461",
        "4356525002001a0011100f0e0d0c0b0a3c0000007ab7e72a00000000ab3a296308070605040302011817161514131211282726252423222138373635343332316867666564636261010000000403020108070605b8b7b6b5b4b3b2b1",
        "4356525002001b0011100f0e0d0c0b0a340000000e8a7bda00000000bb8875e208070605040302011817161514131211282726252423222138373635343332316867666564636261787776757473727194939291",
        "4356525002001c0011100f0e0d0c0b0a2c0000009f7fd93a000000006208e1fe08070605040302011817161514131211282726252423222138373635343332317877767574737271c4c3c2c1",
        "435652500200200011100f0e0d0c0b0a14000000ab9aa36f00000000a4cd87f21817161514131211787776757473727194939291",
        "435652500200210011100f0e0d0c0b0a180000004dd0a4030000000081d15d1e181716151413121178777675747372710400000064617461",
        "435652500200220011100f0e0d0c0b0a19000000896720380000000070c1a63a18171615141312117877767574737271a8a7a6a5a4a3a2a101",
    ];

    const GOLDEN_RESPONSES: [&str; 10] = [
        "435652500200810011100f0e0d0c0b0a0400000075f7b768000000000db5a6d554535251",
        "435652500200820011100f0e0d0c0b0a000000000000000000000000f8f7130a",
        "435652500200900011100f0e0d0c0b0a000000000000000000000000e56c3b61",
        "435652500200910011100f0e0d0c0b0a240000007335f84b0000000099d19c63686766656463626101000000d4d3d2d102000000c4c3c2c1070000000400000064617461",
        "435652500200920011100f0e0d0c0b0a2800000091cb4a65000000007a58b8a401000000d4d3d2d102000000c4c3c2c1070000000100000068676665646362610400000064617461",
        "435652500200930011100f0e0d0c0b0a0c000000cdefddfc0000000082ff692c010000006867666564636261",
        "435652500200940011100f0e0d0c0b0a0400000092f00f17000000002a6e8a1ce4e3e2e1",
        "435652500200950011100f0e0d0c0b0a080000006be1cd9800000000b0052199f8f7f6f5f4f3f2f1",
        "435652500200960011100f0e0d0c0b0a280000003d13f4ee000000009d9ff265020000006867666564636261686766656463626102000000b8b7b6b5b4b3b2b1ffffffffffffffff",
        "435652500200ff0011100f0e0d0c0b0a09000000cd6900680000000035574ec90100030000006f6c64",
    ];

    #[test]
    fn frames_are_byte_exact() {
        let id = 0x0a0b_0c0d_0e0f_1011;
        let reqs = fixed_requests();
        assert_eq!(reqs.len(), GOLDEN_REQUESTS.len());
        for (r, want) in reqs.iter().zip(GOLDEN_REQUESTS) {
            assert_eq!(hex(&encode_request(id, r).to_vec()), want, "{r:?}");
            let buf = Bytes::from(encode_request(id, r).to_vec());
            let (h, payload, _) = decode_frame(&buf, MAX).expect("frame decodes");
            // The fixed data is not a whole block: only the writes refuse that.
            if !matches!(h.msg_type, msg::WRITE | msg::WRITE_HELD | msg::WRITE_BLOCKS) {
                assert_eq!(&decode_request(h.msg_type, payload).expect("decodes"), r);
            }
        }
        let resps = fixed_responses();
        assert_eq!(resps.len(), GOLDEN_RESPONSES.len());
        for (r, want) in resps.iter().zip(GOLDEN_RESPONSES) {
            assert_eq!(hex(&encode_response(id, r).to_vec()), want, "{r:?}");
            let buf = Bytes::from(encode_response(id, r).to_vec());
            let (h, payload, _) = decode_frame(&buf, MAX).expect("frame decodes");
            assert_eq!(&decode_response(h.msg_type, payload).expect("decodes"), r);
        }
    }

    #[test]
    fn every_error_code_round_trips() {
        for code in ErrorCode::ALL {
            assert_eq!(ErrorCode::from_u16(code.to_u16()), code);
        }
        assert_eq!(ErrorCode::from_u16(999), ErrorCode::Other);
    }

    #[test]
    fn long_error_message_is_truncated_on_a_char_boundary() {
        let resp = Response::err(ErrorCode::Io, "é".repeat(ERR_MESSAGE_BYTES_MAX));
        let buf = Bytes::from(encode_response(1, &resp).to_vec());
        let (h, p, _) = decode_frame(&buf, MAX).expect("frame");
        match decode_response(h.msg_type, p).expect("decodes") {
            Response::Err { code, message } => {
                assert_eq!(code, ErrorCode::Io);
                assert!(message.len() <= ERR_MESSAGE_BYTES_MAX && message.len() > 4000);
                assert!(message.chars().all(|c| c == 'é'));
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    /// Found by fuzz target rpc_wire: a message the decoder returned (2000 bad bytes,
    /// decoded lossily to 6000) came back shorter after encode and decode.
    #[test]
    fn decoded_error_messages_survive_a_round_trip() {
        for raw in [vec![0xffu8; 2000], "é".repeat(3000).into_bytes()] {
            let mut payload = 6u16.to_le_bytes().to_vec();
            payload.extend_from_slice(&(raw.len() as u32).to_le_bytes());
            payload.extend_from_slice(&raw);
            let first = decode_response(msg::ERR, Bytes::from(payload)).expect("decodes");
            let buf = Bytes::from(encode_response(1, &first).to_vec());
            let (h, p, _) = decode_frame(&buf, MAX).expect("frame");
            assert_eq!(decode_response(h.msg_type, p).expect("decodes"), first);
        }
    }

    #[test]
    fn write_payload_is_not_copied_on_decode() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let (crcs, data) = data(&mut rng, 2);
        let req = Request::Extent {
            drive: DriveId(1),
            op: ExtentOp::Write {
                key: key(&mut rng),
                epoch: Epoch(1),
                version: Version(1),
                offset: 0,
                crcs,
                data,
                codec: converge_types::Compression::None,
            },
        };
        let buf = Bytes::from(encode_request(9, &req).to_vec());
        let (h, payload, _) = decode_frame(&buf, MAX).expect("frame");
        let Request::Extent {
            op: ExtentOp::Write { data, .. },
            ..
        } = decode_request(h.msg_type, payload).expect("req")
        else {
            panic!("not a write")
        };
        let inside = buf.as_ptr() as usize..buf.as_ptr() as usize + buf.len();
        assert!(inside.contains(&(data.as_ptr() as usize)));
    }

    #[test]
    fn write_with_wrong_crc_count_is_invalid() {
        let req = Request::Extent {
            drive: DriveId(1),
            op: ExtentOp::Write {
                key: ExtentKey {
                    volume: VolumeId(1),
                    slab: SlabIndex(0),
                },
                epoch: Epoch(1),
                version: Version(1),
                offset: 0,
                crcs: Arc::from([0; 2]),
                data: Bytes::from(vec![0u8; BLOCK_SIZE]),
                codec: converge_types::Compression::None,
            },
        };
        assert!(matches!(validate_request(&req), Err(WireError::Invalid(_))));
        let buf = Bytes::from(encode_request(1, &req).to_vec());
        let (h, p, _) = decode_frame(&buf, MAX).expect("frame itself is fine");
        assert!(matches!(
            decode_request(h.msg_type, p),
            Err(WireError::Invalid(_))
        ));
        // Data not a multiple of the block size either.
        let req = Request::Extent {
            drive: DriveId(1),
            op: ExtentOp::Write {
                key: ExtentKey {
                    volume: VolumeId(1),
                    slab: SlabIndex(0),
                },
                epoch: Epoch(1),
                version: Version(1),
                offset: 0,
                crcs: Arc::from([0; 1]),
                data: Bytes::from(vec![0u8; BLOCK_SIZE + 1]),
                codec: converge_types::Compression::None,
            },
        };
        assert!(validate_request(&req).is_err());
    }

    #[test]
    fn every_header_bit_flip_is_detected() {
        let frame = encode_request(42, &Request::Ping).to_vec();
        for bit in 0..HEADER_LEN * 8 {
            let mut f = frame.clone();
            f[bit / 8] ^= 1 << (bit % 8);
            let err = decode_frame(&Bytes::from(f), MAX).expect_err("flip must be detected");
            assert!(
                matches!(
                    err,
                    WireError::HeaderChecksum { .. } | WireError::BadMagic(_)
                ),
                "bit {bit}: {err:?}"
            );
        }
    }

    #[test]
    fn payload_corruption_is_detected() {
        let req = Request::Extent {
            drive: DriveId(1),
            op: ExtentOp::Read {
                key: ExtentKey {
                    volume: VolumeId(2),
                    slab: SlabIndex(3),
                },
                epoch: Epoch(4),
                offset: 5,
                len: 6,
            },
        };
        let frame = encode_request(1, &req).to_vec();
        for i in HEADER_LEN..frame.len() {
            let mut f = frame.clone();
            f[i] ^= 0x10;
            assert!(matches!(
                decode_frame(&Bytes::from(f), MAX),
                Err(WireError::PayloadChecksum { .. })
            ));
        }
    }

    #[test]
    fn oversized_frame_is_refused_by_the_header() {
        let frame = encode_response(
            1,
            &Response::Extent(ExtentReply::Read(ReadReply {
                data: Bytes::from(vec![7u8; 2 * BLOCK_SIZE]),
                bad_blocks: vec![],
                suspect: vec![],
                version: Version(1),
            })),
        );
        let buf = Bytes::from(frame.to_vec());
        let err = decode_frame(&buf, BLOCK_SIZE).expect_err("too large");
        assert!(matches!(err, WireError::TooLarge { .. }), "{err:?}");
        assert!(decode_frame(&buf, frame.payload_len()).is_ok());
        assert!(decode_frame(&buf, frame.payload_len() - 1).is_err());
    }

    #[test]
    fn other_protocol_version_is_refused() {
        let mut h = encode_request(1, &Request::Ping).to_vec();
        h[4] = 1;
        let crc = crc32c::crc32c(&h[0..28]);
        h[28..32].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(
            decode_frame(&Bytes::from(h), MAX).expect_err("version"),
            WireError::Version { got: 1 }
        );
    }

    #[test]
    fn truncated_frames_and_payloads_are_errors() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        for _ in 0..300 {
            let req = random_request(&mut rng);
            let frame = encode_request(1, &req).to_vec();
            for cut in 0..frame.len().min(200) {
                assert!(decode_frame(&Bytes::from(frame[..cut].to_vec()), MAX).is_err());
            }
            // A shorter payload under a type must not decode, except for empty messages.
            let payload = Bytes::from(frame[HEADER_LEN..].to_vec());
            for cut in 0..payload.len().min(200) {
                assert!(decode_request(request_type(&req), payload.slice(..cut)).is_err());
            }
            // Extra bytes are refused too.
            let mut longer = payload.to_vec();
            longer.push(0);
            assert!(decode_request(request_type(&req), Bytes::from(longer)).is_err());
        }
    }

    #[test]
    fn releases_agree_on_the_newest_version_both_speak() {
        // This build and the next (speaking N and N+1), the previous (N-1 and N).
        assert_eq!(agree_within(2..=3, 3), Some(3));
        assert_eq!(
            agree_within(2..=3, 2),
            Some(2),
            "an older caller, in its version"
        );
        assert_eq!(agree_within(2..=2, 3), Some(2), "a newer caller, in ours");
        assert_eq!(agree_within(3..=4, 2), None, "two releases apart");
        assert_eq!(agree(PROTOCOL_VERSION), Some(PROTOCOL_VERSION));
        assert_eq!(agree(PROTOCOL_VERSION + 1), Some(PROTOCOL_VERSION));
        assert_eq!(agree(PROTOCOL_VERSION_MIN - 1), None);
        // A frame moved to another version keeps everything but the version, and decodes.
        let f = encode_request(9, &Request::Ping);
        let g = f.clone().at_version(PROTOCOL_VERSION_MIN);
        let (h, _, _) = decode_frame(&Bytes::from(g.to_vec()), MAX).unwrap();
        assert_eq!((h.version, h.request_id), (PROTOCOL_VERSION_MIN, 9));
        assert_eq!(f.to_vec(), f.clone().at_version(PROTOCOL_VERSION).to_vec());
    }

    #[test]
    fn random_bytes_never_panic() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let types: Vec<u8> = (0..=255).collect();
        for i in 0..20_000 {
            let n = rng.gen_range(0..300);
            let mut b = vec![0u8; n];
            rng.fill_bytes(&mut b);
            if i % 2 == 0 && n >= HEADER_LEN {
                // Give half of them a valid-looking header so the payload decoders run.
                b[0..4].copy_from_slice(&MAGIC);
                b[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
                b[24..28].fill(0);
                let crc = crc32c::crc32c(&b[0..28]);
                b[28..32].copy_from_slice(&crc.to_le_bytes());
            }
            let buf = Bytes::from(b);
            let _ = decode_frame(&buf, MAX);
            let t = types[rng.gen_range(0..types.len())];
            let _ = decode_request(t, buf.clone());
            let _ = decode_response(t, buf.clone());
            // Counts that claim huge lists must not allocate or panic.
            let mut huge = vec![0u8; 60];
            rng.fill_bytes(&mut huge);
            let _ = decode_request(msg::WRITE, Bytes::from(huge.clone()));
            let _ = decode_response(msg::READ_OK, Bytes::from(huge));
        }
    }
}
