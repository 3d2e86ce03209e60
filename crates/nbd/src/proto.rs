//! Wire constants and fixed-layout encodings of the NBD protocol (fixed newstyle, simple and
//! structured replies, metadata contexts).
//!
//! Values come from the NBD protocol specification (NetworkBlockDevice/nbd, doc/proto.md).
//! All integers on the wire are big-endian.

/// "NBDMAGIC": first 8 bytes the server sends.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// "IHAVEOPT": newstyle magic, also prefixes every client option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic of every option reply.
pub const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of a transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// Handshake flags (server, 16 bits).
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
// Client flags (32 bits).
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

// Transmission flags (16 bits).
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// READ accepts NBD_CMD_FLAG_DF; only ever set once structured replies are negotiated.
pub const TFLAG_SEND_DF: u16 = 1 << 7;
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;

// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

// Option reply types.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
const REP_ERR: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_ERR + 1;
pub const REP_ERR_POLICY: u32 = REP_ERR + 2;
pub const REP_ERR_INVALID: u32 = REP_ERR + 3;
/// TLS is required: the option is refused until NBD_OPT_STARTTLS has upgraded the connection.
pub const REP_ERR_TLS_REQD: u32 = REP_ERR + 5;
pub const REP_ERR_UNKNOWN: u32 = REP_ERR + 6;
pub const REP_ERR_TOO_BIG: u32 = REP_ERR + 9;

// NBD_REP_INFO types.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// Commands.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// READ: at most one content chunk in the reply ("don't fragment").
pub const CMD_FLAG_DF: u16 = 1 << 2;
/// BLOCK_STATUS: exactly one descriptor, no longer than the request.
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;

// Structured reply chunks: flags and types.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
/// Error chunk types have bit 15 set.
pub const REPLY_TYPE_ERROR_BIT: u16 = 1 << 15;
pub const REPLY_TYPE_ERROR: u16 = REPLY_TYPE_ERROR_BIT + 1;
pub const REPLY_TYPE_ERROR_OFFSET: u16 = REPLY_TYPE_ERROR_BIT + 2;

/// `base:allocation` descriptor flags (bits 0 and 1; the rest are reserved, sent as 0),
/// and the `qemu:dirty-bitmap:` flag (bit 0; the rest reserved).
pub use crate::dev::{STATE_DIRTY, STATE_HOLE, STATE_ZERO};
/// The metadata context of the spec's `base:` namespace.
pub const META_BASE_ALLOCATION: &str = "base:allocation";
/// The `base:` namespace, a LIST_META_CONTEXT wildcard for its contexts.
pub const META_BASE: &str = "base:";
/// The `qemu:` namespace (qemu's docs/interop/nbd.rst), a LIST wildcard for its contexts.
pub const META_QEMU: &str = "qemu:";
/// Prefix of `qemu:dirty-bitmap:NAME` contexts; alone, a LIST wildcard for all of them.
pub const META_QEMU_DIRTY_BITMAP: &str = "qemu:dirty-bitmap:";

// Error values (the spec fixes these numbers; they are not the host's errno).
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const ENOMEM: u32 = 12;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;

/// Size of a transmission request header.
pub const REQUEST_LEN: usize = 28;
/// Size of a simple reply header.
pub const SIMPLE_REPLY_LEN: usize = 16;
/// Size of a structured reply chunk header (before its payload).
pub const STRUCTURED_REPLY_LEN: usize = 20;
/// One `NBD_REPLY_TYPE_BLOCK_STATUS` descriptor: u32 length, u32 flags.
pub const BLOCK_DESCRIPTOR_LEN: usize = 8;
/// Strings (export names, messages) MUST be no longer than this.
pub const STRING_MAX: usize = 4096;

/// A decoded transmission request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub typ: u16,
    pub handle: u64,
    pub offset: u64,
    pub len: u32,
}

fn be_u16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn be_u32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn be_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

impl Request {
    /// Decodes a header; returns the bad magic on mismatch.
    pub fn decode(b: &[u8; REQUEST_LEN]) -> Result<Self, u32> {
        let magic = be_u32(b, 0);
        if magic != REQUEST_MAGIC {
            return Err(magic);
        }
        Ok(Self {
            flags: be_u16(b, 4),
            typ: be_u16(b, 6),
            handle: be_u64(b, 8),
            offset: be_u64(b, 16),
            len: be_u32(b, 24),
        })
    }

    /// Encodes a header (used by tests and clients).
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.typ.to_be_bytes());
        b[8..16].copy_from_slice(&self.handle.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.len.to_be_bytes());
        b
    }
}

/// Encodes a simple reply header.
pub fn simple_reply(errno: u32, handle: u64) -> [u8; SIMPLE_REPLY_LEN] {
    let mut b = [0u8; SIMPLE_REPLY_LEN];
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&errno.to_be_bytes());
    b[8..16].copy_from_slice(&handle.to_be_bytes());
    b
}

/// Encodes a structured reply chunk header; `payload_len` bytes of payload follow it.
pub fn structured_reply(
    flags: u16,
    typ: u16,
    handle: u64,
    payload_len: u32,
) -> [u8; STRUCTURED_REPLY_LEN] {
    let mut b = [0u8; STRUCTURED_REPLY_LEN];
    b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&typ.to_be_bytes());
    b[8..16].copy_from_slice(&handle.to_be_bytes());
    b[16..20].copy_from_slice(&payload_len.to_be_bytes());
    b
}

/// A decoded structured reply chunk header (used by tests and clients).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    pub flags: u16,
    pub typ: u16,
    pub handle: u64,
    pub len: u32,
}

impl ChunkHeader {
    /// Decodes a chunk header; returns the bad magic on mismatch.
    pub fn decode(b: &[u8; STRUCTURED_REPLY_LEN]) -> Result<Self, u32> {
        let magic = be_u32(b, 0);
        if magic != STRUCTURED_REPLY_MAGIC {
            return Err(magic);
        }
        Ok(Self {
            flags: be_u16(b, 4),
            typ: be_u16(b, 6),
            handle: be_u64(b, 8),
            len: be_u32(b, 16),
        })
    }
}

/// Encodes one option reply (header + data) into `out`.
pub fn option_reply(out: &mut Vec<u8>, option: u32, reply_type: u32, data: &[u8]) {
    out.extend_from_slice(&REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply_type.to_be_bytes());
    // Callers only pass bounded data (names ≤ 4096, info ≤ 14 bytes, messages ≤ 4096).
    let len = u32::try_from(data.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(data);
}

/// Parsed body of NBD_OPT_INFO / NBD_OPT_GO.
#[derive(Debug, PartialEq, Eq)]
pub struct InfoRequest {
    pub name: String,
    pub requests: Vec<u16>,
}

/// Parses the body of NBD_OPT_INFO / NBD_OPT_GO; `None` when malformed.
pub fn parse_info_request(data: &[u8]) -> Option<InfoRequest> {
    if data.len() < 6 {
        return None;
    }
    let name_len = be_u32(data, 0) as usize;
    if name_len > STRING_MAX || name_len > data.len() - 6 {
        return None;
    }
    let name = std::str::from_utf8(&data[4..4 + name_len]).ok()?.to_owned();
    let rest = &data[4 + name_len..];
    let n = be_u16(rest, 0) as usize;
    let list = &rest[2..];
    if list.len() != n * 2 {
        return None;
    }
    let requests = list.chunks_exact(2).map(|c| be_u16(c, 0)).collect();
    Some(InfoRequest { name, requests })
}

/// Parsed body of NBD_OPT_LIST_META_CONTEXT / NBD_OPT_SET_META_CONTEXT.
#[derive(Debug, PartialEq, Eq)]
pub struct MetaContextRequest {
    pub name: String,
    pub queries: Vec<String>,
}

/// Parses the body of NBD_OPT_LIST/SET_META_CONTEXT: u32 name length, name, u32 query
/// count, then per query u32 length and the query. `None` when malformed: lengths that
/// point past the data, strings over 4096 bytes or not UTF-8, bytes left over.
/// The count is never trusted for an allocation: queries are read while data lasts.
pub fn parse_meta_context_request(data: &[u8]) -> Option<MetaContextRequest> {
    let mut at = 0usize;
    let string = |at: &mut usize| -> Option<String> {
        let len = be_u32(data.get(*at..*at + 4)?, 0) as usize;
        *at += 4;
        if len > STRING_MAX {
            return None;
        }
        let bytes = data.get(*at..at.checked_add(len)?)?;
        *at += len;
        Some(std::str::from_utf8(bytes).ok()?.to_owned())
    };
    let name = string(&mut at)?;
    let count = be_u32(data.get(at..at + 4)?, 0);
    at += 4;
    let mut queries = Vec::new();
    for _ in 0..count {
        queries.push(string(&mut at)?);
    }
    (at == data.len()).then_some(MetaContextRequest { name, queries })
}

/// Encodes an option request body for LIST/SET_META_CONTEXT (used by tests and clients).
pub fn meta_context_request(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut d = Vec::new();
    d.extend_from_slice(&(name.len() as u32).to_be_bytes());
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        d.extend_from_slice(&(q.len() as u32).to_be_bytes());
        d.extend_from_slice(q.as_bytes());
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_roundtrip_and_bad_magic() {
        let r = Request {
            flags: 3,
            typ: CMD_WRITE,
            handle: 0xdead_beef_0102_0304,
            offset: 1 << 40,
            len: 4096,
        };
        assert_eq!(Request::decode(&r.encode()), Ok(r));
        let mut b = r.encode();
        b[0] ^= 1;
        assert!(Request::decode(&b).is_err());
    }

    #[test]
    fn info_request_parsing_rejects_inconsistent_lengths() {
        let mut d = Vec::new();
        d.extend_from_slice(&3u32.to_be_bytes());
        d.extend_from_slice(b"vm1");
        d.extend_from_slice(&1u16.to_be_bytes());
        d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        let p = parse_info_request(&d).expect("valid");
        assert_eq!(p.name, "vm1");
        assert_eq!(p.requests, vec![INFO_BLOCK_SIZE]);
        // Name length pointing past the end.
        let mut bad = d.clone();
        bad[3] = 200;
        assert!(parse_info_request(&bad).is_none());
        // Count of info requests disagreeing with the data.
        let mut bad = d.clone();
        bad.push(0);
        assert!(parse_info_request(&bad).is_none());
        assert!(parse_info_request(&d[..5]).is_none());
        // Non-UTF-8 name.
        let mut bad = d;
        bad[4] = 0xff;
        assert!(parse_info_request(&bad).is_none());
    }

    #[test]
    fn meta_context_request_parsing() {
        let d = meta_context_request("vm01", &["base:", "base:allocation", "qemu:dirty-bitmap:x"]);
        let p = parse_meta_context_request(&d).expect("valid");
        assert_eq!(p.name, "vm01");
        assert_eq!(
            p.queries,
            vec!["base:", "base:allocation", "qemu:dirty-bitmap:x"]
        );
        let none = meta_context_request("", &[]);
        assert_eq!(
            parse_meta_context_request(&none),
            Some(MetaContextRequest {
                name: String::new(),
                queries: vec![]
            })
        );
        // Every truncation is malformed, and so is a trailing byte.
        for cut in 0..d.len() {
            assert!(parse_meta_context_request(&d[..cut]).is_none(), "cut {cut}");
        }
        let mut long = d.clone();
        long.push(0);
        assert!(parse_meta_context_request(&long).is_none());
        // A count far beyond the data fails without allocating for it.
        let mut many = meta_context_request("vm01", &[]);
        let n = many.len();
        many[n - 4..].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(parse_meta_context_request(&many).is_none());
        // Query too long, name not UTF-8.
        let big = "b".repeat(STRING_MAX + 1);
        assert!(parse_meta_context_request(&meta_context_request("vm01", &[&big])).is_none());
        let mut bad = d;
        bad[4] = 0xff;
        assert!(parse_meta_context_request(&bad).is_none());
    }

    #[test]
    fn structured_reply_header_roundtrip() {
        let h = structured_reply(REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, 0x1122, 12);
        assert_eq!(
            ChunkHeader::decode(&h),
            Ok(ChunkHeader {
                flags: REPLY_FLAG_DONE,
                typ: REPLY_TYPE_BLOCK_STATUS,
                handle: 0x1122,
                len: 12
            })
        );
        assert_eq!(&h[0..4], &[0x66, 0x8e, 0x33, 0xef]);
        let mut bad = h;
        bad[1] ^= 1;
        assert!(ChunkHeader::decode(&bad).is_err());
    }
}
