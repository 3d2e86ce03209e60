//! Target `rpc_wire`: the peer protocol's decoders (crates/rpc/src/wire.rs).
//!
//! Byte 0 picks how the rest is read:
//! * even: a raw byte stream of frames, walked with `decode_frame` as a receiver would
//!   (header checks, both crcs), each frame's payload decoded as request and as response;
//! * odd: byte 1 is a message type and the rest its payload, decoded directly (no crc to
//!   guess) and then also wrapped in a correct frame and decoded through `decode_frame`.
//!
//! Properties: no panic on any bytes; a header that decodes re-encodes to the same 32
//! bytes; a message that decodes survives encode → `decode_frame` → decode unchanged.

use bytes::Bytes;
use converge_rpc::wire::{
    self, decode_frame, decode_request, decode_response, encode_request, encode_response,
    FrameHeader, HEADER_LEN,
};

/// Frames larger than this are refused by the receivers the harness models.
const PAYLOAD_MAX: usize = 1 << 20;

pub fn rpc_wire(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode & 1 == 0 {
        frames(rest);
    } else if let Some((&msg_type, payload)) = rest.split_first() {
        let payload = Bytes::copy_from_slice(payload);
        messages(msg_type, 0x5eed, &payload);
        // The same payload inside a frame with correct crcs, as a peer would send it.
        let framed = frame(msg_type, 0x5eed, &payload);
        frames(&framed);
    }
}

/// A frame around `payload` with correct header and payload crcs.
pub fn frame(msg_type: u8, request_id: u64, payload: &[u8]) -> Vec<u8> {
    let h = FrameHeader {
        version: converge_rpc::PROTOCOL_VERSION,
        msg_type,
        flags: 0,
        request_id,
        payload_len: u32::try_from(payload.len()).unwrap_or(u32::MAX),
        payload_crc: crc32c::crc32c(payload),
    };
    let mut v = h.encode().to_vec();
    v.extend_from_slice(payload);
    v
}

fn frames(stream: &[u8]) {
    if let Some(h) = stream.first_chunk::<HEADER_LEN>() {
        if let Ok(header) = FrameHeader::decode(h, usize::MAX) {
            assert_eq!(
                &header.encode(),
                h,
                "a decoded header re-encodes to its bytes"
            );
        }
    }
    let mut buf = Bytes::copy_from_slice(stream);
    while !buf.is_empty() {
        let Ok((h, payload, used)) = decode_frame(&buf, PAYLOAD_MAX) else {
            return;
        };
        assert!(
            used >= HEADER_LEN && used <= buf.len(),
            "frame length {used}"
        );
        assert_eq!(used - HEADER_LEN, payload.len());
        messages(h.msg_type, h.request_id, &payload);
        buf = buf.slice(used..);
    }
}

fn messages(msg_type: u8, id: u64, payload: &Bytes) {
    if let Ok(req) = decode_request(msg_type, payload.clone()) {
        assert_eq!(wire::request_type(&req), msg_type);
        let f = encode_request(id, &req).to_vec();
        let (h, p, used) =
            decode_frame(&Bytes::from(f.clone()), usize::MAX).expect("an encoded request frames");
        assert_eq!(used, f.len());
        assert_eq!((h.msg_type, h.request_id, h.flags), (msg_type, id, 0));
        let again = decode_request(h.msg_type, p).expect("an encoded request decodes");
        assert!(
            again == req,
            "request round trip: {} became {}",
            short(&req),
            short(&again)
        );
        wire::validate_request(&req).expect("a decoded request is valid");
    }
    if let Ok(resp) = decode_response(msg_type, payload.clone()) {
        assert_eq!(wire::response_type(&resp), msg_type);
        let f = encode_response(id, &resp).to_vec();
        let (h, p, used) =
            decode_frame(&Bytes::from(f.clone()), usize::MAX).expect("an encoded answer frames");
        assert_eq!(used, f.len());
        assert_eq!((h.msg_type, h.request_id, h.flags), (msg_type, id, 0));
        let again = decode_response(h.msg_type, p).expect("an encoded answer decodes");
        assert!(
            again == resp,
            "response round trip: {} became {}",
            short(&resp),
            short(&again)
        );
    }
}

/// A value for a panic message, cut short (payloads can be megabytes).
fn short(v: &impl std::fmt::Debug) -> String {
    let s = format!("{v:?}");
    match s.char_indices().nth(300) {
        Some((i, _)) => format!("{}… ({} bytes of Debug)", &s[..i], s.len()),
        None => s,
    }
}
