//! End-to-end: what a hostile or careless client can do to a node, and what it gets. Each
//! test is an attack that once worked; now it must be refused or outlived, with the node
//! still serving afterwards.

#![allow(clippy::unwrap_used)]

mod common;
use common::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

fn node_pid(lab: &Lab, id: usize) -> i32 {
    lab.lab_json()["nodes"][id - 1]["proc"]["pid"]
        .as_i64()
        .unwrap() as i32
}

fn node_api(lab: &Lab, id: usize) -> String {
    lab.lab_json()["nodes"][id - 1]["api"]
        .as_str()
        .unwrap()
        .trim_start_matches("https://")
        .to_string()
}

/// `GET path` with `token`, or None if the node did not answer.
fn try_get(lab: &Lab, hostport: &str, path: &str, token: &str) -> Option<String> {
    let pem = std::fs::read(lab.path().join("pki/ca.crt")).ok()?;
    let cfg = converge_pki::client_config(&pem).ok()?;
    let host = hostport.rsplit_once(':')?.0.to_string();
    let name = rustls::pki_types::ServerName::try_from(host).ok()?;
    let tcp = TcpStream::connect(hostport).ok()?;
    tcp.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    let mut s = rustls::StreamOwned::new(rustls::ClientConnection::new(cfg, name).ok()?, tcp);
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = Vec::new();
    read_until_closed(&mut s, &mut out).ok()?;
    Some(String::from_utf8_lossy(&out).into_owned())
}

fn open_fds(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

fn alive(pid: i32) -> bool {
    // A zombie (exited, not yet reaped by the lab) counts as dead.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false)
}

/// A node out of file descriptors (a client holding hundreds of connections) cannot accept
/// API connections for a while; it must keep serving once descriptors are free again,
/// not exit (a failed `accept` once ended the API server, and with it `converged`).
#[test]
fn the_api_outlives_running_out_of_file_descriptors() {
    let lab = Lab::up(3, &[]);
    let pid = node_pid(&lab, 1);
    let api = node_api(&lab, 1);
    let limits = must(Command::new("prlimit").args([
        "--pid",
        &pid.to_string(),
        "--nofile",
        "--noheadings",
        "--output=SOFT,HARD",
    ]));
    let (soft, hard) = {
        let v: Vec<&str> = limits.split_whitespace().collect();
        (v[0].to_string(), v[1].to_string())
    };
    // Leave the node 16 descriptors to spare, then open 64 connections to its API.
    let tight = open_fds(pid) + 16;
    must(Command::new("prlimit").args([
        "--pid",
        &pid.to_string(),
        &format!("--nofile={tight}:{hard}"),
    ]));
    let conns: Vec<TcpStream> = (0..64)
        .filter_map(|_| TcpStream::connect(&api).ok())
        .collect();
    assert!(!conns.is_empty(), "the listen backlog takes connections");
    lab.wait_for(
        "the node to run out of descriptors",
        Duration::from_secs(60),
        || lab.logs().contains("api: accept failed"),
    );
    drop(conns);
    must(Command::new("prlimit").args([
        "--pid",
        &pid.to_string(),
        &format!("--nofile={soft}:{hard}"),
    ]));
    assert!(alive(pid), "converged exited after failed accepts");
    lab.wait_for("the API to answer again", Duration::from_secs(60), || {
        try_get(&lab, &api, "/v1/status", &lab.token())
            .is_some_and(|a| a.starts_with("HTTP/1.1 200"))
    });
    assert!(alive(pid));
    // The node is still a working cluster member: its volume serves I/O.
    let uri = lab.create_volume("after", "64M", "mirror-3");
    let v = fio(
        &uri,
        &["--rw=randwrite", "--bs=4k", "--size=8M", "--verify=crc32c"],
    );
    assert_eq!(fio_errors(&v), 0);
}

/// A client that sends half a request's headers and goes quiet holds its connection only
/// until the header read timeout (10 s); it once held it forever, and enough of them would
/// have used up the node's descriptors. The same bound holds for one that never finishes
/// its TLS handshake, and one that sends nothing at all.
#[test]
fn a_half_sent_api_request_is_closed() {
    let lab = Lab::up(3, &[]);
    let api = node_api(&lab, 1);
    let mut s = tls_connect(&lab, &api);
    s.write_all(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    s.flush().unwrap();
    // Far beyond the timeout (the stream's read timeout is 120 s): if the node has not
    // closed by then, it never will.
    let mut buf = Vec::new();
    if let Err(e) = read_until_closed(&mut s, &mut buf) {
        panic!("the connection was still open: {e}");
    }
    let text = String::from_utf8_lossy(&buf);
    assert!(
        buf.is_empty() || text.starts_with("HTTP/1.1 408"),
        "unexpected answer: {text}"
    );
    // An idle connection that never sent a byte is closed too.
    let mut idle = TcpStream::connect(&api).unwrap();
    idle.set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    let mut one = [0u8; 1];
    assert_eq!(idle.read(&mut one).unwrap(), 0, "closed without an answer");
    // Half a TLS handshake (the first bytes of a ClientHello).
    let mut half = TcpStream::connect(&api).unwrap();
    half.set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    half.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00]).unwrap();
    assert_eq!(half.read(&mut one).unwrap(), 0, "closed without an answer");
    assert!(http_get(&lab, &api, "/v1/status", Some(&lab.token())).starts_with("HTTP/1.1 200"));
}

/// What a stranger who learned the cluster id (from `GET /v1/status`) could do with a few
/// peer requests, each of which once worked (now the peer port wants a certificate of the
/// cluster's CA naming the node, so these are tried with members' genuine certificates, the
/// owner's and another's: a member that is not the owner may not act on the copies at all,
/// nor a node that never joined forward volume I/O): stamp a version from the far future on every
/// copy (later writes acked and dropped), fence every copy at epoch `u64::MAX` (the volume
/// unwritable for good), free every copy (reads return zeros), write to an invented volume
/// (space the control plane does not see), and make the owner allocate 512 MiB for one
/// read. Each is refused with a reason; afterwards the data a real client wrote reads back
/// intact, and the volume takes verified writes.
#[test]
fn forged_peer_requests_are_refused_and_the_data_stays_intact() {
    use bytes::Bytes;
    use converge_rpc::{ErrorCode, Hello, Request, Response, RpcClient, RpcError};
    use converge_types::{
        ClusterId, DriveId, Epoch, ExtentKey, ExtentOp, Knobs, NodeId, SlabIndex, Version, VolumeId,
    };
    use std::sync::Arc;

    let lab = Lab::up(3, &[]);
    let uri = lab.create_volume("victim", "64M", "mirror-3");
    let dir = tempfile::tempdir().unwrap();
    let image = random_file(dir.path(), "image", 64 << 20, 7);
    must(Command::new("nbdcopy").arg(&image).arg(&uri));

    let status = lab.json(&["status"]);
    let cluster: ClusterId = status["cluster"]["id"].as_str().unwrap().parse().unwrap();
    let rpc_of = |node: u64| -> String {
        status["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["id"].as_u64() == Some(node))
            .unwrap()["rpc_addr"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let vol = lab.json(&["volume", "show", "victim"]);
    let volume = VolumeId(vol["id"].as_u64().unwrap());
    let owner = vol["owner"].as_u64().unwrap();
    let key = ExtentKey {
        volume,
        slab: SlabIndex(0),
    };
    let copies: Vec<(u64, DriveId)> = vol["slabs"][0]["extents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["node"].as_u64().unwrap(),
                DriveId(e["drive"].as_u64().unwrap()),
            )
        })
        .collect();
    assert_eq!(copies.len(), 3);

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let knobs = Knobs::default();
    let tls_of = |ca: &converge_pki::Ca, subject: converge_pki::Subject| {
        let key = converge_pki::NewKey::generate().unwrap();
        let cert = ca.issue(&subject, &key.public_key()).unwrap();
        converge_pki::NodeTls::from_pem(
            ca.cert_pem().as_bytes(),
            cert.as_bytes(),
            key.pem().as_bytes(),
        )
        .unwrap()
        .peer_client()
        .unwrap()
    };
    let node_cert = |ca: &converge_pki::Ca, id: u32| {
        tls_of(ca, converge_pki::Subject::Node { id, hosts: vec![] })
    };
    let lab_ca = converge_pki::Ca::load(&lab.path().join("pki")).unwrap();
    let other_ca = converge_pki::Ca::generate().unwrap();
    let free = |drive| Request::Extent {
        drive,
        op: ExtentOp::Free { key },
    };
    // Knowing the cluster id (once the only check) gets a stranger nothing now: without a
    // certificate of the cluster's CA there is no connection, and a certificate of another
    // CA, or a client certificate of this one, is no better.
    for &(node, drive) in &copies {
        let me = NodeId(node as u32 % 3 + 1);
        let plain = RpcClient::new(rpc_of(node), Hello::new(cluster, me), &knobs);
        let r = rt.block_on(plain.call(free(drive)));
        assert!(r.is_err(), "a plaintext peer got an answer: {r:?}");
        assert_eq!(plain.connections_made(), 0);
        let foreign = RpcClient::with_tls(
            rpc_of(node),
            Hello::new(cluster, me),
            &knobs,
            node_cert(&other_ca, me.0),
            NodeId(node as u32),
        );
        match rt.block_on(foreign.call(free(drive))) {
            Err(RpcError::Connect { source, .. }) => {
                assert!(source.to_string().contains("TLS handshake"), "{source}")
            }
            other => panic!("another CA's certificate: {other:?}"),
        }
        let qemu = RpcClient::with_tls(
            rpc_of(node),
            Hello::new(cluster, me),
            &knobs,
            tls_of(
                &lab_ca,
                converge_pki::Subject::Client {
                    name: "qemu".into(),
                },
            ),
            NodeId(node as u32),
        );
        // (A client certificate of the cluster CA, as made before the clients CA: the peer
        // port takes node certificates only, so the handshake fails.)
        match rt.block_on(qemu.call(free(drive))) {
            Err(RpcError::Connect { source, .. }) => {
                assert!(
                    source.to_string().contains("CertificateUnknown"),
                    "{source}"
                )
            }
            other => panic!("a client certificate as a peer: {other:?}"),
        }
    }
    // Defence in depth: even a member's genuine certificate (a compromised node) cannot do
    // any of what follows, whether it is the volume's owner or not.
    let client = |node: u64, me: u32| {
        RpcClient::with_tls(
            rpc_of(node),
            Hello::new(cluster, NodeId(me)),
            &knobs,
            node_cert(&lab_ca, me),
            NodeId(node as u32),
        )
    };
    let block = Bytes::from(vec![0u8; 4096]);
    let crcs: Arc<[u32]> = Arc::from(vec![crc32c::crc32c(&block)]);
    let write = |key: ExtentKey, epoch: u64, version: u64| ExtentOp::Write {
        key,
        epoch: Epoch(epoch),
        version: Version(version),
        offset: 0,
        crcs: crcs.clone(),
        data: block.clone(),
        codec: converge_types::Compression::None,
    };
    let refusal = |node: u64, me: u32, req: Request| -> (ErrorCode, String) {
        match rt.block_on(client(node, me).call(req)) {
            Ok(Response::Err { code, message }) | Err(RpcError::Remote { code, message }) => {
                (code, message)
            }
            other => panic!("node {node} did not refuse node {me}: {other:?}"),
        }
    };
    let refused = |what: &str, node: u64, me: u32, req: Request, because: &str| {
        let (code, message) = refusal(node, me, req);
        assert_eq!(code, ErrorCode::Invalid, "{what}: {message}");
        assert!(message.contains(because), "{what}: {message}");
    };
    let owner_id = owner as u32;
    let other = owner_id % 3 + 1;
    // The volume's current epoch, as a replica's refusal of a later one names it.
    let epoch: u64 = {
        let (_, m) = refusal(
            copies[0].0,
            owner_id,
            Request::Extent {
                drive: copies[0].1,
                op: write(key, u64::MAX, 1),
            },
        );
        let at = m.find("latest is ").expect("the granted epoch") + "latest is ".len();
        m[at..]
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let in_term_max = epoch << 32 | 0xffff_ffff;
    for &(node, drive) in &copies {
        let extent = |op: ExtentOp| Request::Extent { drive, op };
        // As the owner itself.
        refused(
            "a version from the far future",
            node,
            owner_id,
            extent(write(key, epoch, u64::MAX)),
            "later than the request's epoch",
        );
        refused(
            "a write at an epoch never granted",
            node,
            owner_id,
            extent(write(key, u64::MAX, u64::MAX)),
            "never granted",
        );
        refused(
            "fencing at epoch u64::MAX",
            node,
            owner_id,
            extent(ExtentOp::Digest {
                key,
                epoch: Epoch(u64::MAX),
            }),
            "never granted",
        );
        refused(
            "freeing a live copy",
            node,
            owner_id,
            extent(ExtentOp::Free { key }),
            "not freed",
        );
        refused(
            "a release naming a version from the far future",
            node,
            owner_id,
            extent(ExtentOp::Release {
                key,
                epoch: Epoch(epoch),
                upto: Version(u64::MAX),
            }),
            "later than the request's epoch",
        );
        refused(
            "a write to an invented volume",
            node,
            owner_id,
            extent(write(
                ExtentKey {
                    volume: VolumeId(0x0bad),
                    slab: SlabIndex(0),
                },
                1,
                1 << 32 | 1,
            )),
            "never granted",
        );
        // As another member, at the volume's current epoch: the owner alone acts on its
        // copies (each of these once went through).
        for (what, op) in [
            (
                "an in-term version above the owner's",
                write(key, epoch, in_term_max),
            ),
            (
                "a release",
                ExtentOp::Release {
                    key,
                    epoch: Epoch(epoch),
                    upto: Version(in_term_max),
                },
            ),
            (
                "a fence",
                ExtentOp::Digest {
                    key,
                    epoch: Epoch(epoch),
                },
            ),
            (
                "a read of a copy",
                ExtentOp::Read {
                    key,
                    epoch: Epoch(epoch),
                    offset: 0,
                    len: 4096,
                },
            ),
        ] {
            refused(what, node, other, extent(op), "is not the owner");
        }
        refused(
            "a member freeing another's copy",
            node,
            other,
            extent(ExtentOp::Free { key }),
            "may not free",
        );
    }
    refused(
        "a 512 MiB volume read",
        owner,
        other,
        Request::VolRead {
            volume,
            offset: 0,
            len: 512 << 20,
        },
        "longer than one request may be",
    );
    // Forwarded volume I/O from a certificate of the cluster's CA for a node that never
    // joined (no drive of it is recorded): refused, while a member's is served.
    refused(
        "volume I/O from a node that is no member",
        owner,
        9,
        Request::VolRead {
            volume,
            offset: 0,
            len: 4096,
        },
        "not a member",
    );
    match rt.block_on(client(owner, other).call(Request::VolRead {
        volume,
        offset: 0,
        len: 4096,
    })) {
        Ok(Response::Extent(converge_types::ExtentReply::Read(r))) => {
            assert_eq!(r.data.len(), 4096)
        }
        other => panic!("a member's forwarded read: {other:?}"),
    }

    // Nothing of it reached the data: every byte reads back, the owner still owns the
    // volume and its writes land (a verified fio run), and the copies agree.
    compare(&uri, &image, "after the forged requests");
    let v = fio(
        &uri,
        &["--rw=randwrite", "--bs=4k", "--size=16M", "--verify=crc32c"],
    );
    assert_eq!(fio_errors(&v), 0);
    assert!(all_in_sync(&lab, "victim"));
    assert_copies_agree(&lab, "victim");
}

/// Drive files hold every VM's disk and the NBD socket opens every volume: neither is open
/// to other local users, whatever the umask (drive files were 0644). A repair delay that
/// would turn rebuilds off (`u64::MAX` was accepted) is refused with its bound.
#[test]
fn drive_files_and_sockets_are_private_and_absurd_settings_are_refused() {
    use std::os::unix::fs::PermissionsExt;
    let lab = Lab::up(3, &[]);
    for i in 1..=3 {
        let dir = lab.path().join(format!("node{i}"));
        let mode = |name: &str| {
            std::fs::metadata(dir.join(name))
                .unwrap()
                .permissions()
                .mode()
                & 0o777
        };
        assert_eq!(mode("drive1.img"), 0o600, "node {i} drive file");
        assert_eq!(mode("drive2.img"), 0o600, "node {i} drive file");
        assert_eq!(mode("nbd.sock"), 0o660, "node {i} NBD socket");
    }
    let e = lab.fails(&["cluster", "set", "--repair-delay", "18446744073709551615"]);
    assert!(e.contains("repair_delay_s") && e.contains("30 days"), "{e}");
    // A sane one still goes through.
    lab.must(&["cluster", "set", "--repair-delay", "2h"]);
    let s = lab.json(&["cluster", "settings"]);
    assert_eq!(s["repair_delay_s"].as_u64(), Some(7200), "{s}");
}

/// `method path` with `token` (if any) and a JSON body: (status code, answer body).
fn api_call(
    lab: &Lab,
    hostport: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> (u16, String) {
    let mut s = tls_connect(lab, hostport);
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = Vec::new();
    read_until_closed(&mut s, &mut out).unwrap();
    let out = String::from_utf8_lossy(&out).into_owned();
    let status = out[9..12].parse().unwrap();
    let body = out.split_once("\r\n\r\n").map_or("", |x| x.1).to_string();
    (status, body)
}

/// Without a token nothing but the liveness probe answers (anyone could delete volumes,
/// change settings or start fio jobs that overwrite a volume); each role does its part and
/// no more; a revoked token is refused; the lab's fault views (drive paths, block offsets)
/// and the fleet's workers answer only where the node's config turns them on.
#[test]
fn the_api_needs_a_token_and_each_role_may_do_only_its_part() {
    let lab = Lab::up(3, &[]);
    let api1 = node_api(&lab, 1);
    let api3 = node_api(&lab, 3);
    let admin = lab.token();
    lab.create_volume("keep", "64M", "mirror-3");

    // No token, or a made-up one.
    for (method, path, body) in [
        ("GET", "/v1/status", ""),
        ("GET", "/metrics", ""),
        ("DELETE", "/v1/volumes/keep", ""),
        ("POST", "/v1/settings", r#"{"repair_delay_s": 1}"#),
        ("POST", "/v1/lab/blocks/sample", "{}"),
        (
            "POST",
            "/v1/volumes",
            r#"{"name":"x","size_bytes":67108864}"#,
        ),
    ] {
        let (status, text) = api_call(&lab, &api1, method, path, None, body);
        assert_eq!(status, 401, "{method} {path} without a token: {text}");
        assert!(text.contains("needs a token"), "{text}");
        let forged = format!("cvt.{}.{}", "0".repeat(16), "1".repeat(64));
        let (status, text) = api_call(&lab, &api1, method, path, Some(&forged), body);
        assert_eq!(status, 401, "{method} {path} with a made-up token: {text}");
        assert!(text.contains("unknown or revoked"), "{text}");
    }
    assert_eq!(api_call(&lab, &api1, "GET", "/v1/health", None, "").0, 200);

    // A read-only and an operator token, made by the admin.
    let make = |name: &str, role: &str| -> (String, String) {
        let out = lab.must(&["token", "create", name, "--role", role, "--json"]);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        (
            v["token"].as_str().unwrap().to_string(),
            v["id"].as_str().unwrap().to_string(),
        )
    };
    let (ro, ro_id) = make("grafana", "read-only");
    let (op, _) = make("ci", "operator");
    let with = |token: &str, args: &[&str]| {
        let mut c = lab.cmd(args);
        c.args(["--token", token, "--api", &format!("https://{api1}")]);
        run(&mut c)
    };
    let refused = |token: &str, args: &[&str], needs: &str| {
        let o = with(token, args);
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} went through");
        assert!(e.contains("may not") && e.contains(needs), "{args:?}: {e}");
    };
    assert!(with(&ro, &["status"]).status.success());
    assert!(with(&ro, &["volume", "show", "keep"]).status.success());
    assert_eq!(
        api_call(&lab, &api1, "GET", "/metrics", Some(&ro), "").0,
        200
    );
    refused(&ro, &["volume", "create", "x", "--size", "64M"], "operator");
    refused(&ro, &["token", "list"], "admin");
    assert!(with(&op, &["volume", "create", "opvol", "--size", "64M"])
        .status
        .success());
    refused(&op, &["volume", "delete", "keep"], "admin");
    refused(&op, &["cluster", "set", "--repair-delay", "1h"], "admin");
    refused(&op, &["token", "create", "me", "--role", "admin"], "admin");

    // The admin lists them (never their secrets), and revokes one: refused from then on.
    let list = lab.must(&["token", "list", "--json"]);
    assert!(list.contains("grafana") && list.contains("ci") && list.contains("bootstrap-admin"));
    assert!(!list.contains(&ro) && !list.contains(&admin), "{list}");
    let mut c = lab.cmd(&["token", "revoke", &ro_id]);
    c.args(["--api", &format!("https://{api1}")]);
    must(&mut c);
    let (status, text) = api_call(&lab, &api1, "GET", "/v1/status", Some(&ro), "");
    assert_eq!(status, 401, "{text}");

    // The lab's views answer in the lab; a node whose config leaves them off does not.
    assert_eq!(
        api_call(
            &lab,
            &api3,
            "POST",
            "/v1/lab/blocks/sample",
            Some(&admin),
            "{}"
        )
        .0,
        400,
        "the lab API is on in the lab (the empty request is refused for its content)"
    );
    lab.must(&["lab", "fault", "stop", "3"]);
    let config = lab.path().join("node3/converged.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        text.replace("lab = true", "lab = false")
            .replace("fleet = true", "fleet = false"),
    )
    .unwrap();
    lab.must(&["lab", "fault", "restart", "3"]);
    for path in ["/v1/lab/blocks/sample", "/v1/fleet/workers"] {
        let (status, text) = api_call(&lab, &api3, "POST", path, Some(&admin), "{}");
        assert_eq!(status, 404, "{path}: {text}");
        assert!(text.contains("is off on this node"), "{text}");
    }
}

/// `cluster init` makes a CA (and the first node's certificate), refuses to make a second
/// one over it, and `cert node` / `cert client` make certificates a node loads and that
/// name who they are for; private keys are 0600.
#[test]
fn cluster_init_and_cert_make_the_clusters_certificates() {
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::tempdir().unwrap();
    let conv = |args: &[&str]| {
        let mut c = Command::new(converge_bin());
        c.args(args);
        run(&mut c)
    };
    let ca = d.path().join("ca");
    let ca_s = ca.to_str().unwrap();
    let o = conv(&[
        "cluster", "init", "--pki", ca_s, "--node", "1", "--host", "10.9.0.1",
    ]);
    assert!(o.status.success(), "{o:?}");
    converge_pki::NodeTls::load(&ca, 1).unwrap();
    let again = conv(&["cluster", "init", "--pki", ca_s]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already holds a CA key"));

    let n2 = d.path().join("n2");
    let o = conv(&[
        "cert",
        "node",
        "--ca-dir",
        ca_s,
        "--node",
        "2",
        "--host",
        "10.9.0.2",
        "--out",
        n2.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{o:?}");
    converge_pki::NodeTls::load(&n2, 2).unwrap();
    let wrong = converge_pki::NodeTls::load(&n2, 1)
        .err()
        .unwrap()
        .to_string();
    assert!(wrong.contains("not node 1's"), "{wrong}");
    let q = d.path().join("qemu");
    let o = conv(&[
        "cert",
        "client",
        "--ca-dir",
        ca_s,
        "--name",
        "qemu-h1",
        "--out",
        q.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{o:?}");
    for (f, mode) in [
        (ca.join("ca.key"), 0o600),
        (ca.join("node.key"), 0o600),
        (n2.join("node.key"), 0o600),
        (q.join("client-key.pem"), 0o600),
        (q.join("ca-cert.pem"), 0o644),
    ] {
        let m = std::fs::metadata(&f).unwrap().permissions().mode() & 0o777;
        assert_eq!(m, mode, "{}", f.display());
    }
    let bad = conv(&[
        "cert",
        "client",
        "--ca-dir",
        ca_s,
        "--name",
        "Bad Name",
        "--out",
        q.to_str().unwrap(),
    ]);
    assert!(String::from_utf8_lossy(&bad.stderr).contains("client name"));
    // The client's certificate is the clients CA's, not the cluster CA's (which etcd and
    // peers trust); its directory's ca-cert.pem holds both (qemu checks its certificate
    // against it).
    let m = std::fs::metadata(ca.join("clients-ca.key"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(m & 0o777, 0o600);
    let verify = |cafile: &std::path::Path| {
        run(Command::new("openssl").args([
            "verify",
            "-CAfile",
            cafile.to_str().unwrap(),
            q.join("client-cert.pem").to_str().unwrap(),
        ]))
        .status
        .success()
    };
    assert!(!verify(&ca.join("ca.crt")));
    assert!(verify(&ca.join("clients-ca.crt")));
    assert!(verify(&q.join("ca-cert.pem")));
    // A node's host names cannot name another node.
    let o = conv(&[
        "cert",
        "node",
        "--ca-dir",
        ca_s,
        "--node",
        "3",
        "--host",
        "node-1.converge",
        "--out",
        d.path().join("n3").to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("converge's own"),
        "{o:?}"
    );
    // Without the CA key nothing can be issued.
    let none = conv(&[
        "cert",
        "node",
        "--ca-dir",
        n2.to_str().unwrap(),
        "--node",
        "3",
        "--host",
        "x",
        "--out",
        d.path().join("n3").to_str().unwrap(),
    ]);
    assert!(!none.status.success());
    assert!(String::from_utf8_lossy(&none.stderr).contains("ca.key"));
}

/// NBD over TCP wants TLS with a client certificate of the cluster's CA: real clients
/// (nbdcopy and nbdinfo over `nbds://`, qemu-img with `tls-creds-x509`) read and write
/// through it; a plaintext client, one without a certificate and one with another CA's
/// certificate are refused, and the data is intact afterwards.
#[test]
fn nbd_over_tcp_needs_tls_and_a_client_certificate() {
    let lab = Lab::up(3, &[]);
    let unix_uri = lab.create_volume("tlsvol", "64M", "mirror-3");
    let tcp = lab.lab_json()["nodes"][0]["nbd_tcp"]
        .as_str()
        .unwrap()
        .to_string();
    let certs = lab.path().join("pki/client");
    let certs_s = certs.to_str().unwrap();
    let nbds = format!("nbds://{tcp}/tlsvol?tls-certificates={certs_s}");
    let dir = tempfile::tempdir().unwrap();
    let image = random_file(dir.path(), "image", 64 << 20, 11);
    must(Command::new("nbdcopy").arg(&image).arg(&nbds));
    // What went in over TLS reads back over the unix socket, and over TLS with qemu-img.
    compare(&unix_uri, &image, "written over nbds://");
    let (host, port) = tcp.rsplit_once(':').unwrap();
    let qemu_tls = format!("tls-creds-x509,id=tls0,dir={certs_s},endpoint=client");
    let opts = format!("driver=nbd,host={host},port={port},export=tlsvol,tls-creds=tls0");
    let out = must(Command::new("qemu-img").args([
        "compare",
        "--object",
        &qemu_tls,
        "--image-opts",
        &opts,
        &format!("driver=raw,file.filename={}", image.display()),
    ]));
    assert!(out.contains("Images are identical"), "{out}");
    assert!(must(Command::new("nbdinfo").arg(&nbds)).contains("67108864"));

    // Refused: plaintext; TLS without a client certificate; another CA's certificate.
    let o = run(Command::new("nbdinfo").arg(format!("nbd://{tcp}/tlsvol")));
    assert!(!o.status.success(), "plaintext NBD was served");
    let e = String::from_utf8_lossy(&o.stderr).to_lowercase();
    assert!(e.contains("tls"), "{e}");
    let ca_only = dir.path().join("ca-only");
    std::fs::create_dir(&ca_only).unwrap();
    std::fs::copy(certs.join("ca-cert.pem"), ca_only.join("ca-cert.pem")).unwrap();
    let o = run(Command::new("nbdinfo").arg(format!(
        "nbds://{tcp}/tlsvol?tls-certificates={}",
        ca_only.display()
    )));
    assert!(
        !o.status.success(),
        "a client without a certificate was served"
    );
    let other = converge_pki::Ca::generate().unwrap();
    let key = converge_pki::NewKey::generate().unwrap();
    let cert = other
        .issue(
            &converge_pki::Subject::Client {
                name: "intruder".into(),
            },
            &key.public_key(),
        )
        .unwrap();
    let foreign = dir.path().join("foreign");
    // It trusts the lab's CA (so the server is accepted) but holds another CA's certificate.
    converge_pki::write_client_dir(
        &foreign,
        &std::fs::read_to_string(certs.join("ca-cert.pem")).unwrap(),
        &cert,
        &key.pem(),
    )
    .unwrap();
    let o = run(Command::new("nbdinfo").arg(format!(
        "nbds://{tcp}/tlsvol?tls-certificates={}",
        foreign.display()
    )));
    assert!(
        !o.status.success(),
        "another CA's client certificate was served"
    );
    compare(&unix_uri, &image, "after the refused clients");

    // A client connected before its certificate is revoked is disconnected, not only
    // refused at its next connection; the other clients go on.
    let made = lab.path().join("qemu-h5");
    lab.must(&[
        "cert",
        "client",
        "--ca-dir",
        lab.path().join("pki").to_str().unwrap(),
        "--name",
        "qemu-h5",
        "--out",
        made.to_str().unwrap(),
    ]);
    let made_uri = format!("nbds://{tcp}/tlsvol?tls-certificates={}", made.display());
    let mut session = NbdSession::open(&made_uri);
    let mut lab_session = NbdSession::open(&nbds);
    assert_eq!(session.read(), "ok");
    lab.must(&[
        "cert",
        "revoke",
        made.join("client-cert.pem").to_str().unwrap(),
    ]);
    lab.wait_for(
        "the revoked client's open NBD connection closed",
        Duration::from_secs(60),
        || session.read() != "ok",
    );
    assert_eq!(
        lab_session.read(),
        "ok",
        "another client's connection was cut"
    );
    let o = run(Command::new("nbdinfo").arg(&made_uri));
    assert!(
        !o.status.success(),
        "a revoked client certificate was served"
    );
    compare(&unix_uri, &image, "after the revoked client");
}

/// The systemd units shipped for real hosts are valid units (`systemd-analyze verify`,
/// with converged where the unit expects it replaced by this build's), and `cert etcd`
/// makes a member certificate for the addresses given.
#[test]
fn packaged_systemd_units_verify_and_cert_etcd_works() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let d = tempfile::tempdir().unwrap();
    let converged = converge_bin().with_file_name("converged");
    for unit in ["converged.service", "converge-etcd.service"] {
        let text = std::fs::read_to_string(root.join("packaging/systemd").join(unit)).unwrap();
        let text = text.replace("/usr/local/bin/converged", converged.to_str().unwrap());
        let path = d.path().join(unit);
        std::fs::write(&path, text).unwrap();
        let o = run(Command::new("systemd-analyze").arg("verify").arg(&path));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success() && err.trim().is_empty(), "{unit}: {err}");
    }
    let ca = d.path().join("ca");
    let mut init = Command::new(converge_bin());
    init.args(["cluster", "init", "--pki", ca.to_str().unwrap()]);
    must(&mut init);
    let out = d.path().join("etcd");
    let mut c = Command::new(converge_bin());
    c.args([
        "cert",
        "etcd",
        "--ca-dir",
        ca.to_str().unwrap(),
        "--host",
        "10.0.0.1",
        "--out",
        out.to_str().unwrap(),
    ]);
    must(&mut c);
    let text = must(Command::new("openssl").args([
        "x509",
        "-noout",
        "-ext",
        "subjectAltName,extendedKeyUsage",
        "-in",
        out.join("server.crt").to_str().unwrap(),
    ]));
    assert!(text.contains("IP Address:10.0.0.1"), "{text}");
    assert!(text.contains("Server Authentication") && text.contains("Client Authentication"));
    // And the (empty) revocation list etcd's --client-crl-file names.
    let crl = must(Command::new("openssl").args([
        "crl",
        "-noout",
        "-text",
        "-in",
        out.join("revoked.crl").to_str().unwrap(),
    ]));
    assert!(crl.contains("No Revoked Certificates"), "{crl}");
}

/// `etcdctl` with `cert`/`key` against the lab's etcd: its output, or why it failed.
fn etcdctl(
    lab: &Lab,
    cert: &std::path::Path,
    key: &std::path::Path,
    args: &[&str],
) -> Result<String, String> {
    let endpoint = lab.lab_json()["etcd_endpoint"]
        .as_str()
        .unwrap()
        .to_string();
    let o = run(Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .args([
            "--endpoints",
            &endpoint,
            "--dial-timeout",
            "5s",
            "--command-timeout",
            "20s",
        ])
        .arg("--cacert")
        .arg(lab.path().join("pki/ca.crt"))
        .arg("--cert")
        .arg(cert)
        .arg("--key")
        .arg(key)
        .args(args));
    if o.status.success() {
        Ok(String::from_utf8_lossy(&o.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&o.stderr).into_owned())
    }
}

/// `GET path` on the API at `hostport` with a TLS client configuration of the caller's
/// (e.g. one that presents a node's certificate) and `token` if any: the answer, or None if
/// the handshake or the connection failed.
fn api_get_with(
    cfg: std::sync::Arc<rustls::ClientConfig>,
    server: rustls::pki_types::ServerName<'static>,
    hostport: &str,
    path: &str,
    token: Option<&str>,
) -> Option<String> {
    let tcp = TcpStream::connect(hostport).ok()?;
    tcp.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    let mut s = rustls::StreamOwned::new(rustls::ClientConnection::new(cfg, server).ok()?, tcp);
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = Vec::new();
    read_until_closed(&mut s, &mut out).ok()?;
    (!out.is_empty()).then(|| String::from_utf8_lossy(&out).into_owned())
}

/// A libnbd session (Debian's python3-libnbd) kept open across the test: each `read` asks
/// for the first 4 KiB over the same connection and says "ok" or the error.
struct NbdSession {
    child: std::process::Child,
    out: std::io::BufReader<std::process::ChildStdout>,
}

impl NbdSession {
    const SCRIPT: &'static str = r#"
import nbd, sys
h = nbd.NBD()
h.set_uri_allow_local_file(True)
h.connect_uri(sys.argv[1])
print("connected", flush=True)
for line in sys.stdin:
    try:
        h.pread(4096, 0)
        print("ok", flush=True)
    except nbd.Error as e:
        print("error", str(e).replace("\n", " "), flush=True)
"#;

    fn open(uri: &str) -> NbdSession {
        use std::io::BufRead;
        let mut child = Command::new("/usr/bin/python3")
            .args(["-c", Self::SCRIPT, uri])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3 with libnbd");
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "connected", "the NBD session did not connect");
        NbdSession { child, out }
    }

    fn read(&mut self) -> String {
        use std::io::BufRead;
        let stdin = self.child.stdin.as_mut().unwrap();
        if writeln!(stdin, "read").is_err() {
            return "the session ended".into();
        }
        let mut line = String::new();
        match self.out.read_line(&mut line) {
            Ok(0) | Err(_) => "the session ended".into(),
            Ok(_) => line.trim().to_string(),
        }
    }
}

impl Drop for NbdSession {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTPS connection kept alive across requests (as a client that keeps its connection
/// would: to a node's API, to etcd's JSON gateway), presenting the certificate `cfg` holds.
struct KeptHttps(rustls::StreamOwned<rustls::ClientConnection, TcpStream>);

impl KeptHttps {
    fn open(
        cfg: std::sync::Arc<rustls::ClientConfig>,
        server: rustls::pki_types::ServerName<'static>,
        hostport: &str,
    ) -> KeptHttps {
        let tcp = TcpStream::connect(hostport).unwrap();
        tcp.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let conn = rustls::ClientConnection::new(cfg, server).unwrap();
        KeptHttps(rustls::StreamOwned::new(conn, tcp))
    }

    fn line(&mut self) -> Option<String> {
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        while !line.ends_with(b"\r\n") {
            match self.0.read(&mut b) {
                Ok(1) => line.push(b[0]),
                _ => return None,
            }
        }
        line.truncate(line.len() - 2);
        Some(String::from_utf8_lossy(&line).into_owned())
    }

    /// `method path` with `body` on the same connection: the status line, or None once the
    /// connection is closed.
    fn request(&mut self, method: &str, path: &str, body: &str) -> Option<String> {
        write!(
            self.0,
            "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .ok()?;
        self.0.flush().ok()?;
        let status = self.line()?;
        let (mut len, mut chunked) = (0usize, false);
        loop {
            let l = self.line()?;
            if l.is_empty() {
                break;
            }
            let (k, v) = l.split_once(':')?;
            if k.eq_ignore_ascii_case("content-length") {
                len = v.trim().parse().ok()?;
            } else if k.eq_ignore_ascii_case("transfer-encoding") {
                chunked = v.trim().eq_ignore_ascii_case("chunked");
            }
        }
        if chunked {
            loop {
                let size = usize::from_str_radix(self.line()?.trim(), 16).ok()?;
                let mut chunk = vec![0u8; size + 2];
                self.0.read_exact(&mut chunk).ok()?;
                if size == 0 {
                    break;
                }
            }
        } else {
            let mut body = vec![0u8; len];
            self.0.read_exact(&mut body).ok()?;
        }
        Some(status)
    }

    /// Keeps the connection busy (a request every half second: an idle one may be closed
    /// by a server's idle timeout anyway) until the server closes it, and sets `closed`
    /// then. What it answers meanwhile does not matter: the connection is what is tested.
    fn keep_busy(
        mut self,
        method: &'static str,
        path: &'static str,
        body: &'static str,
        closed: std::sync::Arc<std::sync::atomic::AtomicBool>,
    ) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || loop {
            match self.request(method, path, body) {
                Some(line) => assert!(line.starts_with("HTTP/1.1 "), "{path}: {line}"),
                None => {
                    closed.store(true, std::sync::atomic::Ordering::SeqCst);
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(500));
        })
    }
}

/// Issue 48: every certificate of the cluster's CA was an etcd superuser (an NBD client's
/// read `/converge/internal-token`, an admin token for every node's API). etcdctl with each
/// kind of certificate: a node's reaches etcd, as does an etcd member's (it is etcd's own);
/// an NBD client's (the lab's, and one made by `converge cert client`) and another CA's do
/// not, while the NBD client's still opens volumes over NBD/TCP. And etcd holds no secret
/// that grants more than its reader has: no value under /converge/ is an API credential.
#[test]
fn etcd_takes_node_certificates_only_and_holds_no_credential() {
    let lab = Lab::up(3, &[]);
    lab.create_volume("vol", "64M", "mirror-2");
    let p = lab.path();
    let node = (p.join("node2/pki/node.crt"), p.join("node2/pki/node.key"));
    let member = (p.join("pki/etcd/server.crt"), p.join("pki/etcd/server.key"));
    let lab_client = (
        p.join("pki/client/client-cert.pem"),
        p.join("pki/client/client-key.pem"),
    );
    let made = p.join("qemu-h4");
    lab.must(&[
        "cert",
        "client",
        "--ca-dir",
        p.join("pki").to_str().unwrap(),
        "--name",
        "qemu-h4",
        "--out",
        made.to_str().unwrap(),
    ]);
    let made_client = (made.join("client-cert.pem"), made.join("client-key.pem"));
    let other_dir = tempfile::tempdir().unwrap();
    let other = converge_pki::Ca::generate().unwrap();
    let key = converge_pki::NewKey::generate().unwrap();
    let cert = other
        .issue(
            &converge_pki::Subject::Node {
                id: 2,
                hosts: vec!["127.0.0.3".into()],
            },
            &key.public_key(),
        )
        .unwrap();
    converge_pki::write_node_dir(other_dir.path(), other.cert_pem(), &cert, &key.pem()).unwrap();
    let foreign = (
        other_dir.path().join("node.crt"),
        other_dir.path().join("node.key"),
    );

    for (what, (c, k)) in [("node", &node), ("etcd member", &member)] {
        let out = etcdctl(
            &lab,
            c,
            k,
            &["get", "/converge/cluster", "--print-value-only"],
        )
        .unwrap_or_else(|e| panic!("a {what} certificate was refused by etcd: {e}"));
        assert!(out.contains("cluster_id"), "{what}: {out}");
    }
    for (what, (c, k)) in [
        ("the lab's NBD client", &lab_client),
        ("a `cert client`", &made_client),
        ("another CA's node", &foreign),
    ] {
        let r = etcdctl(
            &lab,
            c,
            k,
            &["get", "--prefix", "/converge/", "--keys-only"],
        );
        assert!(r.is_err(), "{what} certificate read etcd: {r:?}");
    }
    // The NBD client's certificates do their own job.
    let tcp = lab.lab_json()["nodes"][0]["nbd_tcp"]
        .as_str()
        .unwrap()
        .to_string();
    for dir in [p.join("pki/client"), made] {
        must(Command::new("nbdinfo").arg(format!(
            "nbds://{tcp}/vol?tls-certificates={}",
            dir.display()
        )));
    }

    // Nothing etcd holds is a credential: not the legacy internal token, and no value is
    // taken by the API as a token.
    let all = etcdctl(
        &lab,
        &node.0,
        &node.1,
        &["get", "--prefix", "/converge/", "--print-value-only"],
    )
    .unwrap();
    let keys = etcdctl(
        &lab,
        &node.0,
        &node.1,
        &["get", "--prefix", "/converge/", "--keys-only"],
    )
    .unwrap();
    assert!(!keys.contains("internal-token"), "{keys}");
    let api = node_api(&lab, 1);
    let mut tried = 0;
    for value in all.lines().map(str::trim).filter(|v| !v.is_empty()) {
        let answer = try_get(&lab, &api, "/v1/status", value).unwrap();
        assert!(
            answer.starts_with("HTTP/1.1 401"),
            "etcd value {value:?} opens the API: {answer}"
        );
        tried += 1;
    }
    assert!(tried > 10, "only {tried} values in etcd");
}

/// Issue 48: removing a node revoked nothing (its certificate still read etcd, and stayed
/// good for peer RPC and NBD/TCP for its two years; the internal token it knew was
/// nobody's to revoke), and an admin token could mint a join certificate for a live or a
/// removed node id, or name another node among its host names. After `node remove 3`, each
/// credential node 3 had is tried: its certificate on etcd, on peer RPC, on the API and on
/// NBD/TCP, all refused within seconds; join tokens refuse the removed id, a live id unless
/// `--replace`, and `.converge` host names; a replacing join revokes the old host's
/// certificate.
#[test]
fn a_removed_node_keeps_no_credential_and_join_refuses_taken_ids() {
    use converge_rpc::{Hello, Request, RpcClient, RpcError};
    use converge_types::{ClusterId, Knobs, NodeId};
    let lab = Lab::up(3, &[]);
    let vol_uri = lab.create_volume("vol", "64M", "mirror-2");
    let dir = tempfile::tempdir().unwrap();
    let image = random_file(dir.path(), "image", 64 << 20, 11);
    must(Command::new("nbdcopy").arg(&image).arg(&vol_uri));
    let p = lab.path().to_path_buf();
    let n3 = p.join("node3/pki");
    let (cert3, key3) = (n3.join("node.crt"), n3.join("node.key"));
    let tls3 = converge_pki::NodeTls::load(&n3, 3).unwrap();
    let status = lab.json(&["status"]);
    let cluster: ClusterId = status["cluster"]["id"].as_str().unwrap().parse().unwrap();
    let rpc1 = status["nodes"][0]["rpc_addr"].as_str().unwrap().to_string();
    let api1 = node_api(&lab, 1);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let ping_as_3 = || {
        let c = RpcClient::with_tls(
            rpc1.clone(),
            Hello::new(cluster, NodeId(3)),
            &Knobs::default(),
            tls3.peer_client().unwrap(),
            NodeId(1),
        );
        rt.block_on(c.call(Request::Ping))
    };
    let api_as_3 = || {
        api_get_with(
            tls3.https_client().unwrap(),
            converge_pki::node_server_name(1),
            &api1,
            "/v1/status",
            None,
        )
    };
    // Before: node 3's certificate reaches etcd, its peers and (as a node) their APIs; etcd
    // holds no shared token for it to learn.
    let seen = etcdctl(&lab, &cert3, &key3, &["get", "/converge/internal-token"]).unwrap();
    assert!(
        seen.trim().is_empty(),
        "etcd holds an internal token: {seen}"
    );
    ping_as_3().unwrap();
    let answer = api_as_3().unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // Connections node 3's certificate opened before the removal and keeps using: one to
    // a peer's port (Ping is answered by the rpc layer itself, whoever asks) and one to
    // an API, kept alive.
    let held = RpcClient::with_tls(
        rpc1.clone(),
        Hello::new(cluster, NodeId(3)),
        &Knobs::default(),
        tls3.peer_client().unwrap(),
        NodeId(1),
    );
    rt.block_on(held.call(Request::Ping)).unwrap();
    let mut kept = KeptHttps::open(
        tls3.https_client().unwrap(),
        converge_pki::node_server_name(1),
        &api1,
    );
    let line = kept.request("GET", "/v1/status", "").unwrap();
    assert!(line.starts_with("HTTP/1.1 200"), "{line}");
    let closed = || std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let is = |b: &std::sync::Arc<std::sync::atomic::AtomicBool>| {
        b.load(std::sync::atomic::Ordering::SeqCst)
    };
    let api_closed = closed();
    let api_busy = kept.keep_busy("GET", "/v1/status", "", api_closed.clone());
    // And one to etcd (its JSON gateway), reading the cluster record.
    let etcd_at = lab.lab_json()["etcd_endpoint"]
        .as_str()
        .unwrap()
        .trim_start_matches("https://")
        .to_string();
    let etcd_host = etcd_at.rsplit_once(':').unwrap().0.to_string();
    let mut kept_etcd = KeptHttps::open(
        tls3.https_client().unwrap(),
        rustls::pki_types::ServerName::try_from(etcd_host).unwrap(),
        &etcd_at,
    );
    // {"key": base64("/converge/cluster")}
    const RANGE: &str = r#"{"key":"L2NvbnZlcmdlL2NsdXN0ZXI="}"#;
    let line = kept_etcd.request("POST", "/v3/kv/range", RANGE).unwrap();
    assert!(line.starts_with("HTTP/1.1 200"), "{line}");
    let etcd_closed = closed();
    let etcd_busy = kept_etcd.keep_busy("POST", "/v3/kv/range", RANGE, etcd_closed.clone());

    lab.must(&["node", "remove", "3"]);

    // All three are closed, however busy they are kept: the API's and the peer's by node
    // 1, etcd's by node 1 resetting its member's connections once its CRL lists node 3.
    lab.wait_for(
        "node 3's open API connection closed",
        Duration::from_secs(60),
        || is(&api_closed),
    );
    api_busy.join().unwrap();
    lab.wait_for(
        "node 3's open etcd connection closed",
        Duration::from_secs(60),
        || is(&etcd_closed),
    );
    etcd_busy.join().unwrap();
    lab.wait_for(
        "node 3's open peer connection closed",
        Duration::from_secs(60),
        || rt.block_on(held.call(Request::Ping)).is_err(),
    );

    // After: refused everywhere, within seconds (the other nodes and etcd's revocation
    // list learn it from a watch).
    lab.wait_for(
        "node 3's certificate refused by etcd",
        Duration::from_secs(60),
        || etcdctl(&lab, &cert3, &key3, &["get", "/converge/cluster"]).is_err(),
    );
    let node2 = (p.join("node2/pki/node.crt"), p.join("node2/pki/node.key"));
    etcdctl(&lab, &node2.0, &node2.1, &["get", "/converge/cluster"]).unwrap();
    // Refused as a removed node's, which tells node 3 it was removed.
    match ping_as_3() {
        Err(RpcError::ThisNodeRemoved { .. }) => {}
        other => panic!("node 3's certificate on the peer port after removal: {other:?}"),
    }
    assert_eq!(
        api_as_3(),
        None,
        "node 3's certificate on the API after removal"
    );
    let as_client = dir.path().join("node3-as-client");
    converge_pki::write_client_dir(
        &as_client,
        &std::fs::read_to_string(p.join("pki/ca.crt")).unwrap(),
        &std::fs::read_to_string(&cert3).unwrap(),
        &std::fs::read_to_string(&key3).unwrap(),
    )
    .unwrap();
    let tcp = lab.lab_json()["nodes"][0]["nbd_tcp"]
        .as_str()
        .unwrap()
        .to_string();
    let o = run(Command::new("nbdinfo").arg(format!(
        "nbds://{tcp}/vol?tls-certificates={}",
        as_client.display()
    )));
    assert!(
        !o.status.success(),
        "node 3's certificate opened a volume over NBD/TCP"
    );
    let revoked = lab.json(&["cert", "revoked"]);
    let serial3 = converge_pki::cert_info_pem(&std::fs::read(&cert3).unwrap())
        .unwrap()
        .serial;
    assert!(
        revoked
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["serial"] == serial3.as_str()),
        "{revoked}"
    );

    // Join tokens: never a removed id; a live one only when replacing it; no `.converge`
    // host names.
    let e = lab.fails(&["node", "join-token", "--node", "3", "--host", "127.0.0.9"]);
    assert!(e.contains("was removed"), "{e}");
    let e = lab.fails(&["node", "join-token", "--node", "2", "--host", "127.0.0.9"]);
    assert!(
        e.contains("node 2 is live") && e.contains("--replace"),
        "{e}"
    );
    let e = lab.fails(&[
        "node",
        "join-token",
        "--node",
        "9",
        "--host",
        "node-1.converge",
    ]);
    assert!(e.contains("converge's own"), "{e}");
    let t = lab.json(&[
        "node",
        "join-token",
        "--node",
        "2",
        "--host",
        "127.0.0.3",
        "--replace",
    ]);
    let new2 = dir.path().join("new-node2");
    lab.must(&[
        "node",
        "join",
        "--api",
        &format!("https://{api1}"),
        "--token",
        t["token"].as_str().unwrap(),
        "--pki",
        new2.to_str().unwrap(),
    ]);
    // The new certificate is node 2's; the old host's is refused.
    etcdctl(
        &lab,
        &new2.join("node.crt"),
        &new2.join("node.key"),
        &["get", "/converge/cluster"],
    )
    .unwrap();
    lab.wait_for(
        "node 2's old certificate refused by etcd",
        Duration::from_secs(60),
        || etcdctl(&lab, &node2.0, &node2.1, &["get", "/converge/cluster"]).is_err(),
    );
    // The data written before is intact (read through node 1, which serves it now or
    // after the move).
    compare(&lab.uri_on("vol", 1), &image, "after node 3's removal");
}

/// A read never makes a node take a volume over: `GET …/changes` and `…/snapshots?space=1`
/// opened a volume no node served (a new epoch, every copy fenced, at a read-only token's
/// word). Now they answer 409 saying how to have it served, and are answered once a client
/// serves it. And a token made to expire is refused once it has, saying so.
#[test]
fn reads_never_take_a_volume_over_and_tokens_expire() {
    let lab = Lab::up(1, &[]);
    let api = node_api(&lab, 1);
    let uri = lab.create_volume("v", "16M", "simple");
    lab.must(&["volume", "snapshot", "create", "v", "s0"]);
    // After a restart nobody serves it (nothing is degraded: the leader leaves it be).
    lab.kill_all_and_restart(1);
    lab.wait_for("the node to answer", Duration::from_secs(120), || {
        try_get(&lab, &api, "/v1/status", &lab.token())
            .is_some_and(|a| a.starts_with("HTTP/1.1 200"))
    });
    let token = |args: &[&str]| -> String {
        let mut all = vec!["token", "create"];
        all.extend_from_slice(args);
        all.push("--json");
        let v: serde_json::Value = serde_json::from_str(&lab.must(&all)).unwrap();
        v["token"].as_str().unwrap().to_string()
    };
    let ro = token(&["backup", "--role", "read-only"]);
    let reads = [
        "/v1/volumes/v/changes?from=s0",
        "/v1/volumes/v/snapshots?space=1",
    ];
    for _ in 0..2 {
        for path in reads {
            let (status, text) = api_call(&lab, &api, "GET", path, Some(&ro), "");
            assert_eq!(status, 409, "{path}: {text}");
            assert!(text.contains("not served by any node"), "{text}");
        }
    }
    // A client serves it (it takes the volume, as before); then the reads are answered.
    must(Command::new("nbdinfo").arg(&uri));
    for path in reads {
        let (status, text) = api_call(&lab, &api, "GET", path, Some(&ro), "");
        assert_eq!(status, 200, "{path}: {text}");
    }

    // Expiry: a token that lasts one second works, then is refused as expired.
    let brief = token(&["brief", "--role", "read-only", "--expires-in", "1s"]);
    let list = lab.must(&["token", "list"]);
    assert!(list.contains("EXPIRES") && list.contains("never"), "{list}");
    lab.wait_for("the token to expire", Duration::from_secs(60), || {
        let (status, text) = api_call(&lab, &api, "GET", "/v1/status", Some(&brief), "");
        status == 401 && text.contains("expired")
    });
    assert_eq!(
        api_call(&lab, &api, "GET", "/v1/status", Some(&ro), "").0,
        200
    );
}
