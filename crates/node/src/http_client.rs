//! One-shot HTTP/1.1 requests to a peer node's API (forwarding to a volume's owner).

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use std::time::Duration;

/// `token`: the bearer token the request carries (the nodes' internal one).
pub async fn request(
    addr: &str,
    token: &str,
    method: &str,
    path: &str,
    body: &[u8],
) -> Result<(u16, Bytes), String> {
    let go = async {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let io = hyper_util::rt::TokioIo::new(stream);
        let (mut send, conn) = hyper::client::conn::http1::handshake(io)
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let req = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", addr)
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {token}"))
            .body(Full::new(Bytes::copy_from_slice(body)))
            .map_err(|e| e.to_string())?;
        let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok((status, bytes))
    };
    tokio::time::timeout(Duration::from_secs(60), go)
        .await
        .map_err(|_| "no answer within 60 s".to_string())?
}
