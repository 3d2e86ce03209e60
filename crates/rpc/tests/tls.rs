//! Peer RPC over mutual TLS on real loopback TCP: a node proves who it is with a certificate
//! of the cluster's CA that names it, and nothing else gets through.

use converge_pki::{Ca, NewKey, NodeTls, Revocations, Revoked, Subject};
use converge_rpc::{
    serve, ErrorCode, Handler, Hello, Request, Response, RpcClient, RpcError, ServerTls,
};
use converge_types::{ClusterId, Knobs, NodeId};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::net::TcpListener;

const CLUSTER: ClusterId = ClusterId(0xc0ffee);
const SERVER: NodeId = NodeId(7);

/// Counts the requests that reached the handler (none may, from a refused caller).
#[derive(Default)]
struct Counter(AtomicU64);

impl Handler for Counter {
    async fn handle(&self, _peer: NodeId, _req: Request) -> Response {
        self.0.fetch_add(1, Ordering::SeqCst);
        Response::ok()
    }
}

fn issue(ca: &Ca, subject: Subject) -> NodeTls {
    let key = NewKey::generate().expect("key");
    let cert = ca.issue(&subject, &key.public_key()).expect("issue");
    NodeTls::from_pem(
        ca.cert_pem().as_bytes(),
        cert.as_bytes(),
        key.pem().as_bytes(),
    )
    .expect("tls")
}

fn node(ca: &Ca, id: u32) -> NodeTls {
    issue(
        ca,
        Subject::Node {
            id,
            hosts: vec!["127.0.0.1".into()],
        },
    )
}

fn knobs() -> Knobs {
    Knobs {
        replica_timeout_ms: 10_000,
        ..Knobs::default()
    }
}

struct Server {
    addr: String,
    handled: Arc<Counter>,
    /// The list the server checks, at handshakes and for open connections.
    revocations: Arc<Revocations>,
    _task: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn start(ca: &Ca) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let handled = Arc::new(Counter::default());
    let tls = node(ca, SERVER.0);
    let task = tokio::spawn(serve(
        listener,
        CLUSTER,
        SERVER,
        handled.clone(),
        knobs(),
        Some(ServerTls {
            config: tls.peer_server().expect("server config"),
            revocations: tls.revocations().clone(),
        }),
    ));
    Server {
        addr,
        handled,
        revocations: tls.revocations().clone(),
        _task: task,
    }
}

fn tls_client(server: &Server, me: NodeId, tls: &NodeTls, expect: NodeId) -> RpcClient {
    RpcClient::with_tls(
        server.addr.clone(),
        Hello::new(CLUSTER, me),
        &knobs(),
        tls.peer_client().expect("client config"),
        expect,
    )
}

fn extent_req() -> Request {
    // Any request that reaches the handler (Ping is answered by the rpc layer itself).
    Request::Extent {
        drive: converge_types::DriveId(1),
        op: converge_types::ExtentOp::Free {
            key: converge_types::ExtentKey {
                volume: converge_types::VolumeId(1),
                slab: converge_types::SlabIndex(0),
            },
        },
    }
}

#[tokio::test]
async fn a_node_with_its_own_certificate_is_served() {
    let ca = Ca::generate().expect("ca");
    let s = start(&ca).await;
    let c = tls_client(&s, NodeId(1), &node(&ca, 1), SERVER);
    assert_eq!(c.call(Request::Ping).await.expect("ping"), Response::Pong);
    c.call(extent_req()).await.expect("request");
    assert_eq!(s.handled.0.load(Ordering::SeqCst), 1);
    assert_eq!(c.connections_made(), 1);
}

#[tokio::test]
async fn a_plaintext_caller_is_refused() {
    let ca = Ca::generate().expect("ca");
    let s = start(&ca).await;
    // Even with the right cluster id, which was once the only check.
    let c = RpcClient::new(s.addr.clone(), Hello::new(CLUSTER, NodeId(1)), &knobs());
    let r = c.call(extent_req()).await;
    assert!(r.is_err(), "{r:?}");
    assert_eq!(c.connections_made(), 0);
    assert_eq!(s.handled.0.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_node_claiming_another_nodes_id_is_refused() {
    let ca = Ca::generate().expect("ca");
    let s = start(&ca).await;
    // Node 2's genuine certificate, with a hello that says node 1.
    let c = tls_client(&s, NodeId(1), &node(&ca, 2), SERVER);
    match c.call(extent_req()).await {
        Err(RpcError::Refused { code, message, .. }) => {
            assert_eq!(code, ErrorCode::Invalid);
            assert!(message.contains("not node 1's"), "{message}");
        }
        other => panic!("expected Refused, got {other:?}"),
    }
    assert_eq!(s.handled.0.load(Ordering::SeqCst), 0);
    // The same certificate as itself is fine.
    let ok = tls_client(&s, NodeId(2), &node(&ca, 2), SERVER);
    ok.call(extent_req()).await.expect("node 2 as node 2");
}

#[tokio::test]
async fn a_client_certificate_is_not_a_node() {
    let ca = Ca::generate().expect("ca");
    let s = start(&ca).await;
    let qemu = issue(
        &ca,
        Subject::Client {
            name: "qemu-1".into(),
        },
    );
    // Refused in the handshake: the peer port takes node certificates only.
    let c = tls_client(&s, NodeId(1), &qemu, SERVER);
    match c.call(extent_req()).await {
        Err(RpcError::Connect { source, .. }) => {
            assert!(
                source.to_string().contains("CertificateUnknown"),
                "{source}"
            )
        }
        other => panic!("expected Connect, got {other:?}"),
    }
    assert_eq!(c.connections_made(), 0);
    assert_eq!(s.handled.0.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_certificate_of_another_cluster_is_refused_both_ways() {
    let ca = Ca::generate().expect("ca");
    let other = Ca::generate().expect("other ca");
    let s = start(&ca).await;
    // The caller's certificate is another CA's: the server's handshake refuses it (and the
    // caller, trusting only its own CA, refuses the server too).
    let c = tls_client(&s, NodeId(1), &node(&other, 1), SERVER);
    match c.call(extent_req()).await {
        Err(RpcError::Connect { source, .. }) => {
            assert!(source.to_string().contains("TLS handshake"), "{source}")
        }
        other => panic!("expected Connect, got {other:?}"),
    }
    assert_eq!(c.connections_made(), 0);
    assert_eq!(s.handled.0.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_server_that_is_not_the_node_expected_is_refused_by_the_caller() {
    let ca = Ca::generate().expect("ca");
    let s = start(&ca).await;
    // The address is node 7's, but the caller wants node 8: a misdirected or spoofed peer.
    let c = tls_client(&s, NodeId(1), &node(&ca, 1), NodeId(8));
    match c.call(Request::Ping).await {
        Err(RpcError::Connect { source, .. }) => {
            assert!(source.to_string().contains("node 8"), "{source}")
        }
        other => panic!("expected Connect, got {other:?}"),
    }
}

/// Binds a TCP connection to `server` from `source` (another loopback address: another
/// host, as far as the server can tell).
async fn connect_from(source: &str, server: &str) -> std::io::Result<tokio::net::TcpStream> {
    let sock = tokio::net::TcpSocket::new_v4()?;
    sock.bind(format!("{source}:0").parse().expect("address"))?;
    sock.connect(server.parse().expect("address")).await
}

/// A host that opens every connection the server will hold and never finishes a handshake
/// (it once held all 1,024 slots, each for a replica timeout, and again as soon as they
/// were freed) takes only its own few places: a real peer on another address still
/// connects and is served at once, while the stranger's connections are still open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_holding_every_slot_in_handshakes_does_not_keep_a_peer_out() {
    let ca = Ca::generate().expect("ca");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let handled = Arc::new(Counter::default());
    // A long replica timeout: before, each silent connection held its slot that long.
    let slow = Knobs {
        replica_timeout_ms: 120_000,
        ..Knobs::default()
    };
    let tls = node(&ca, SERVER.0);
    let _task = tokio::spawn(serve(
        listener,
        CLUSTER,
        SERVER,
        handled.clone(),
        slow,
        Some(ServerTls {
            config: tls.peer_server().expect("server config"),
            revocations: tls.revocations().clone(),
        }),
    ));
    // More connections than the server serves at once, from one address, silent.
    let mut held = Vec::new();
    for _ in 0..converge_rpc::CONNECTIONS_MAX + 64 {
        match connect_from("127.0.0.3", &addr).await {
            Ok(s) => held.push(s),
            // The listen backlog is full: every slot is taken or queued.
            Err(_) => break,
        }
    }
    assert!(
        held.len() >= converge_rpc::CONNECTIONS_MAX,
        "{}",
        held.len()
    );
    // A real peer from another address (127.0.0.1), with a generous wait (longer than
    // the new handshake deadline, far shorter than the stranger's hold before).
    let peer = RpcClient::with_tls(
        addr.clone(),
        Hello::new(CLUSTER, NodeId(1)),
        &Knobs {
            replica_timeout_ms: 60_000,
            ..Knobs::default()
        },
        node(&ca, 1).peer_client().expect("client config"),
        SERVER,
    );
    peer.call(extent_req())
        .await
        .expect("a real peer is served");
    assert_eq!(handled.0.load(Ordering::SeqCst), 1);
    drop(held);
}

/// Pings over `c` until a ping fails: the connection it had was closed (Ping is answered by
/// the rpc layer itself, so only a closed connection fails it). The bound only keeps a
/// broken build from hanging the suite.
async fn until_cut(c: &RpcClient) -> RpcError {
    let wait = async {
        loop {
            match c.call(Request::Ping).await {
                Ok(_) => tokio::time::sleep(std::time::Duration::from_millis(10)).await,
                Err(e) => return e,
            }
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(60), wait)
        .await
        .expect("the connection was never closed")
}

/// Issue 48: a certificate was checked when a connection opened, and a connection open when
/// it was revoked went on being served. The server now closes it, and only it.
#[tokio::test]
async fn the_server_closes_an_open_connection_whose_certificate_is_revoked() {
    let ca = Ca::generate().expect("ca");
    let s = start(&ca).await;
    let one = node(&ca, 1);
    let serial = one.own_cert().expect("own cert").serial;
    let c = tls_client(&s, NodeId(1), &one, SERVER);
    let c2 = tls_client(&s, NodeId(2), &node(&ca, 2), SERVER);
    c.call(extent_req()).await.expect("served before");
    c2.call(extent_req()).await.expect("served before");
    // Another node removed, another serial revoked: nothing happens to these two.
    let other = node(&ca, 3).own_cert().expect("own cert").serial;
    s.revocations.add(Some(9), [other]);
    s.revocations.add(None, [serial]);
    until_cut(&c).await;
    match c.call(extent_req()).await {
        Err(RpcError::Connect { source, .. }) => {
            assert!(
                source.to_string().contains("CertificateRevoked"),
                "{source}"
            )
        }
        other => panic!("expected the handshake to refuse it, got {other:?}"),
    }
    assert_eq!(c.connections_made(), 1);
    assert_eq!(s.handled.0.load(Ordering::SeqCst), 2);
    // Node 2's connection was not touched: still the first one.
    c2.call(extent_req()).await.expect("node 2 served after");
    assert_eq!(c2.connections_made(), 1);
    assert_eq!(s.handled.0.load(Ordering::SeqCst), 3);
}

/// A removed node learns it from a peer's handshake (it may no longer reach etcd to read
/// it): its certificate is refused as a removed node's, which no other refusal is.
#[tokio::test]
async fn a_removed_node_is_told_so_at_the_handshake_and_a_revoked_one_is_not() {
    let ca = Ca::generate().expect("ca");
    let s = start(&ca).await;
    let (one, two) = (node(&ca, 1), node(&ca, 2));
    s.revocations.add(Some(1), []);
    s.revocations
        .add(None, [two.own_cert().expect("own cert").serial]);
    match tls_client(&s, NodeId(1), &one, SERVER)
        .call(Request::Ping)
        .await
    {
        Err(RpcError::ThisNodeRemoved { addr }) => assert_eq!(addr, s.addr),
        other => panic!("node 1 is removed: {other:?}"),
    }
    match tls_client(&s, NodeId(2), &two, SERVER)
        .call(Request::Ping)
        .await
    {
        Err(RpcError::Connect { source, .. }) => {
            assert!(
                source.to_string().contains("CertificateRevoked"),
                "{source}"
            )
        }
        other => panic!("node 2's certificate is revoked, node 2 is not removed: {other:?}"),
    }
    tls_client(&s, NodeId(3), &node(&ca, 3), SERVER)
        .call(Request::Ping)
        .await
        .expect("node 3 is served");
    assert_eq!(s.handled.0.load(Ordering::SeqCst), 0);
}

/// And a node closes its own connection to a peer whose certificate is revoked (or which
/// is removed) while the connection is open; its handshake refuses the peer from then on.
#[tokio::test]
async fn a_caller_closes_its_connection_to_a_peer_that_is_removed() {
    let ca = Ca::generate().expect("ca");
    let s = start(&ca).await;
    let mine = Revocations::new(Revoked::default());
    let me = node(&ca, 1).with_revocations(mine.clone());
    let c = RpcClient::with_tls_watching(
        s.addr.clone(),
        Hello::new(CLUSTER, NodeId(1)),
        &knobs(),
        me.peer_client().expect("client config"),
        SERVER,
        mine.clone(),
    );
    c.call(extent_req()).await.expect("served before");
    mine.add(Some(SERVER.0), []);
    until_cut(&c).await;
    let r = c.call(extent_req()).await;
    assert!(matches!(r, Err(RpcError::Connect { .. })), "{r:?}");
    assert_eq!(c.connections_made(), 1);
    assert_eq!(s.handled.0.load(Ordering::SeqCst), 1);
}
