//! Wire constants and fixed-layout encodings of the NBD protocol (fixed newstyle, simple replies).
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
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;

// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;

// Option reply types.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
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

// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;

// Error values (the spec fixes these numbers; they are not the host's errno).
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ESHUTDOWN: u32 = 108;

/// Size of a transmission request header.
pub const REQUEST_LEN: usize = 28;
/// Size of a simple reply header.
pub const SIMPLE_REPLY_LEN: usize = 16;
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
}
