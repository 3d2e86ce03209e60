//! One-shot HTTPS requests to a peer node's API (forwarding to a volume's owner).

use crate::node::Node;
use bytes::Bytes;
use converge_control::model::NodeRecord;
use http_body_util::{BodyExt, Full};
use std::time::Duration;

/// Sends one request to `target`'s API over TLS (its certificate must be the cluster's,
/// name `target` and not be revoked), presenting this node's certificate, which is how the
/// other node knows it is a node. Until a cluster made before that retires its shared
/// internal token, the token goes along too (a node not upgraded yet knows only that).
pub async fn request(
    node: &Node,
    target: &NodeRecord,
    method: &str,
    path: &str,
    body: &[u8],
) -> Result<(u16, Bytes), String> {
    let addr = target.api_addr.as_str();
    let legacy = node.auth.legacy_internal().await;
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
        let mut req = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", addr)
            .header("content-type", "application/json");
        if let Some(t) = &legacy {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let req = req
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
