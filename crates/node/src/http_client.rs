//! One-shot HTTPS requests to a peer node's API (forwarding to a volume's owner).

use crate::node::Node;
use bytes::Bytes;
use converge_control::model::NodeRecord;
use http_body_util::{BodyExt, Full};
use std::time::Duration;

/// Sends one request to `target`'s API over TLS (its certificate must be the cluster's and
/// name `target`), carrying the nodes' internal token.
pub async fn request(
    node: &Node,
    target: &NodeRecord,
    method: &str,
    path: &str,
    body: &[u8],
) -> Result<(u16, Bytes), String> {
    let addr = target.api_addr.as_str();
    let go = async {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let stream = tokio_rustls::TlsConnector::from(node.https.clone())
            .connect(converge_pki::node_server_name(target.id.0), stream)
            .await
            .map_err(|e| format!("TLS handshake with node {}: {e}", target.id))?;
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
            .header("authorization", format!("Bearer {}", node.auth.internal()))
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
