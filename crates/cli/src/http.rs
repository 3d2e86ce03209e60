//! A minimal blocking HTTP/1.1 client for the node API: the CLI makes a handful of
//! requests to loopback or LAN addresses, so a runtime and a client stack would be dead
//! weight. One request per connection (`Connection: close`).

use anyhow::{anyhow, bail, Context, Result};
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an answer may take by default; long operations pass their own.
const READ_TIMEOUT: Duration = Duration::from_secs(120);

pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

/// `base` is like `http://127.0.0.2:7200`.
pub fn request(base: &str, method: &str, path: &str, body: Option<&[u8]>) -> Result<Response> {
    request_timeout(base, method, path, body, READ_TIMEOUT)
}

/// [`request`] waiting up to `read_timeout` for the answer (e.g. a cache flush, which
/// answers when the node's caches are drained).
pub fn request_timeout(
    base: &str,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    read_timeout: Duration,
) -> Result<Response> {
    let hostport = base
        .strip_prefix("http://")
        .ok_or_else(|| anyhow!("API address {base:?} must start with http://"))?
        .trim_end_matches('/');
    let unreachable = || {
        format!("cannot reach the converge API at {base}: is converged running there? (set --api or CONVERGE_API)")
    };
    // A bounded connect: a node cut off the network (a lab partition) must fail in
    // seconds, not after the kernel's SYN retries.
    let mut s = connect(hostport).with_context(unreachable)?;
    s.set_read_timeout(Some(read_timeout))?;
    let body = body.unwrap_or(&[]);
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {hostport}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)
        .with_context(|| format!("reading the answer from {base}{path}"))?;
    parse(&raw).with_context(|| format!("bad HTTP answer from {base}{path}"))
}

fn connect(hostport: &str) -> std::io::Result<TcpStream> {
    let mut last = None;
    for a in hostport.to_socket_addrs()? {
        match TcpStream::connect_timeout(&a, CONNECT_TIMEOUT) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::NotFound, "no address to connect to")
    }))
}

fn parse(raw: &[u8]) -> Result<Response> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| anyhow!("no end of headers"))?;
    let head = std::str::from_utf8(&raw[..end])?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("bad status line {status_line:?}"))?;
    let mut chunked = false;
    for l in lines {
        let l = l.to_ascii_lowercase();
        if l.starts_with("transfer-encoding:") && l.contains("chunked") {
            chunked = true;
        }
    }
    let rest = &raw[end + 4..];
    let body = if chunked {
        dechunk(rest)?
    } else {
        rest.to_vec()
    };
    Ok(Response { status, body })
}

fn dechunk(mut b: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = b
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or_else(|| anyhow!("truncated chunk"))?;
        let size_str = std::str::from_utf8(&b[..eol])?;
        let size = usize::from_str_radix(size_str.split(';').next().unwrap_or("").trim(), 16)?;
        b = &b[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        if b.len() < size + 2 {
            bail!("truncated chunk body");
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

/// Call the API and decode JSON; a non-2xx answer becomes the server's error message.
pub fn call<T: serde::de::DeserializeOwned>(
    base: &str,
    method: &str,
    path: &str,
    body: Option<&serde_json::Value>,
) -> Result<T> {
    call_timeout(base, method, path, body, READ_TIMEOUT)
}

/// [`call`] waiting up to `read_timeout` for the answer.
pub fn call_timeout<T: serde::de::DeserializeOwned>(
    base: &str,
    method: &str,
    path: &str,
    body: Option<&serde_json::Value>,
    read_timeout: Duration,
) -> Result<T> {
    let bytes = body.map(serde_json::to_vec).transpose()?;
    let r = request_timeout(base, method, path, bytes.as_deref(), read_timeout)?;
    if !(200..300).contains(&r.status) {
        let msg = serde_json::from_slice::<converge_api::ErrorBody>(&r.body)
            .map(|e| e.error)
            .unwrap_or_else(|_| String::from_utf8_lossy(&r.body).into_owned());
        bail!("{msg}");
    }
    serde_json::from_slice(&r.body).with_context(|| format!("decoding the answer of {path}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_chunked() {
        let r = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi").unwrap();
        assert_eq!((r.status, &r.body[..]), (200, &b"hi"[..]));
        let r = parse(b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n").unwrap();
        assert_eq!((r.status, &r.body[..]), (404, &b"abcde"[..]));
        assert!(parse(b"garbage").is_err());
    }
}
