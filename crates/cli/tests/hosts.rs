//! End-to-end: the lab playing separate hosts (each node in a network namespace of its own,
//! with its own address and certificate, node 1 holding the CA and the others joined with
//! one-time tokens, etcd members beside the first three) loses an etcd member and then
//! takes a rolling restart of every node under a verifying client, with no error and every
//! copy in sync afterwards; and a fourth host joins a running cluster.

#![allow(clippy::unwrap_used)]

mod common;
use common::*;
use std::process::Command;

#[test]
fn three_hosts_survive_an_etcd_member_loss_and_a_rolling_restart_under_a_verifying_client() {
    let lab = Lab::up(3, &["--netns", "--etcd-members", "3"]);
    let lj = lab.lab_json();

    // Three hosts: an address, a certificate naming it, and all three etcd members in each
    // node's config, reached over TLS.
    let members: Vec<String> = std::iter::once(lj["etcd_endpoint"].as_str().unwrap().to_string())
        .chain(
            lj["etcd_more"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m["endpoint"].as_str().unwrap().to_string()),
        )
        .collect();
    assert_eq!(members.len(), 3, "{lj}");
    for (i, n) in lj["nodes"].as_array().unwrap().iter().enumerate() {
        let id = i as u32 + 1;
        let cfg = std::fs::read_to_string(n["config"].as_str().unwrap()).unwrap();
        for m in &members {
            assert!(
                m.starts_with("https://") && cfg.contains(m.as_str()),
                "{cfg}"
            );
        }
        let pki = lab.path().join(format!("node{id}/pki"));
        converge_pki::NodeTls::load(&pki, id).unwrap();
        let host = n["rpc"].as_str().unwrap().rsplit_once(':').unwrap().0;
        let out = must(Command::new("openssl").args([
            "x509",
            "-noout",
            "-ext",
            "subjectAltName",
            "-in",
            pki.join("node.crt").to_str().unwrap(),
        ]));
        assert!(out.contains(&format!("IP Address:{host}")), "{out}");
    }

    // Brought up as real hosts are: node 1 with the CA (cluster init), nodes 2 and 3 with
    // one-time join tokens through node 1.
    let logs = std::fs::read_to_string(lab.path().join("node1/converged.log")).unwrap();
    for id in [2, 3] {
        assert!(
            logs.contains(&format!("used: certificate issued for node {id}")),
            "node {id} did not join with a token"
        );
    }

    // The etcd leader dies (kill -9): the cluster goes on with the other two members, and
    // commands given while they elect a new leader wait for it instead of failing.
    let pid = etcd_leader_pid(&lj);
    // SAFETY: kill(2) on the PID the lab recorded for the etcd member it started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let uri = lab.create_volume("rr", "64M", "mirror-3");
    // The data is whole (healthy), and a warning names the dead member.
    let st = lab.json(&["status"]);
    assert_eq!(st["health"], "healthy", "{st}");
    assert!(
        st["warnings"].as_array().unwrap().iter().any(|w| w
            .as_str()
            .unwrap()
            .starts_with("etcd members not answering: ")),
        "{st}"
    );

    // A client attached to node 1's export keeps writing and verifying while every node is
    // restarted in turn, reconnecting when its own node restarts (as qemu does with
    // reconnect-delay).
    let client = Verifier::start(&lab, &uri);
    let out = run(&mut lab.cmd(&["cluster", "rolling-restart", "--json"]));
    let v = client.finish();
    assert!(
        out.status.success(),
        "rolling restart failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let steps: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(steps.as_array().unwrap().len(), 3, "{steps}");
    eprintln!("verifier: {v}\nrolling restart: {steps}");
    // The client's own node was restarted under it: it had to reconnect, and it worked on
    // across the restarts.
    assert!(v["reconnects"].as_u64().unwrap() >= 1, "{v}");

    // Every copy is in sync and the copies agree; the new processes serve verified I/O.
    assert!(all_in_sync(&lab, "rr"));
    assert_copies_agree(&lab, "rr");
    let f = fio(
        &uri,
        &["--rw=randwrite", "--bs=4k", "--size=8M", "--verify=crc32c"],
    );
    assert_eq!(fio_errors(&f), 0);
}

/// The reconnecting verifier (tests/tools/reconnecting_verifier.py) writing and checking
/// 32 MiB of a volume until told to stop.
struct Verifier {
    child: std::process::Child,
    stop: std::path::PathBuf,
}

impl Verifier {
    fn start(lab: &Lab, uri: &str) -> Verifier {
        let stop = lab.path().join("stop-verifier");
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/tools/reconnecting_verifier.py");
        let child = Command::new("/usr/bin/python3")
            .arg(&script)
            .arg(uri)
            .arg(&stop)
            .arg((32u64 << 20).to_string())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        Verifier { child, stop }
    }

    /// Stops it; its verdict, which must show work done and no mismatch or error.
    fn finish(self) -> serde_json::Value {
        std::fs::write(&self.stop, b"").unwrap();
        let out = self.child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "verifier: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["mismatches"], 0, "{v}");
        assert_eq!(v["errors"], 0, "{v}");
        assert!(v["ops"].as_u64().unwrap() > 0, "{v}");
        v
    }
}

/// The PID of the etcd member that leads now, read from each member's metrics.
fn etcd_leader_pid(lj: &serde_json::Value) -> i32 {
    let first = std::iter::once((&lj["etcd"], lj["etcd_health"].as_str().unwrap()));
    let more = lj["etcd_more"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (&m["proc"], m["health"].as_str().unwrap()));
    let mut seen = Vec::new();
    for (proc, url) in first.chain(more) {
        let hostport = url.trim_start_matches("http://").trim_end_matches('/');
        let mut s = std::net::TcpStream::connect(hostport).unwrap();
        use std::io::{Read, Write};
        write!(s, "GET /metrics HTTP/1.0\r\nHost: {hostport}\r\n\r\n").unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).unwrap();
        let leads = body
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["etcd_server_is_leader", "1"]);
        if leads {
            return proc["pid"].as_i64().unwrap() as i32;
        }
        seen.push(hostport.to_string());
    }
    panic!("no etcd member says it leads: {seen:?}");
}

/// A free port on `ip` (bound, then closed).
fn free_port(ip: &str) -> u16 {
    std::net::TcpListener::bind((ip, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A new host joins with a one-time token: its key is made there, the certificate comes from
/// the node that holds the CA key (another node refuses without using the token up), the
/// token works once, a token pinned to another CA is refused by the joining side, and the
/// node started with what it got is live in the cluster and holds copies.
#[test]
fn a_new_host_joins_with_a_one_time_token_and_becomes_a_live_node() {
    let lab = Lab::up(3, &[]);
    let lj = lab.lab_json();
    let api = |i: usize| lj["nodes"][i]["api"].as_str().unwrap().to_string();
    let t = lab.json(&[
        "node",
        "join-token",
        "--node",
        "4",
        "--host",
        "127.0.0.5",
        "--ttl",
        "10m",
    ]);
    let token = t["token"].as_str().unwrap().to_string();
    // An operator token may not make join tokens.
    let op = lab.json(&["token", "create", "ops", "--role", "operator"]);
    let mut c = lab.cmd(&["node", "join-token", "--node", "5", "--host", "127.0.0.6"]);
    c.args(["--token", op["token"].as_str().unwrap()]);
    let o = run(&mut c);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("admin"));

    let tmp = tempfile::tempdir().unwrap();
    let pki = tmp.path().join("pki");
    let pki_s = pki.to_str().unwrap();
    let join = |api: &str, token: &str, dir: &str| {
        let mut c = Command::new(converge_bin());
        c.args(["node", "join", "--api", api, "--token", token, "--pki", dir]);
        run(&mut c)
    };
    // Node 2 has no CA key: refused, and the token is not used up.
    let o = join(&api(1), &token, pki_s);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("cannot sign"),
        "{o:?}"
    );
    // A token whose fingerprint names another CA: the joining side refuses the cluster.
    let other_fp = "0".repeat(64);
    let forged = format!("{}.{other_fp}", &token[..token.rfind('.').unwrap()]);
    let o = join(&api(0), &forged, pki_s);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("did not present the CA"),
        "{o:?}"
    );
    // Node 1 signs.
    let o = join(&api(0), &token, pki_s);
    assert!(o.status.success(), "{o:?}");
    let tls = converge_pki::NodeTls::load(&pki, 4).unwrap();
    tls.check_node(4).unwrap();
    // Once only.
    let o = join(&api(0), &token, tmp.path().join("again").to_str().unwrap());
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("already used"));

    // converged with node 3's settings, as node 4 on 127.0.0.5 with the joined identity.
    let cfg3 = std::fs::read_to_string(lj["nodes"][2]["config"].as_str().unwrap()).unwrap();
    let node3 = lab.path().join("node3");
    let mut cfg = String::new();
    for line in cfg3.lines() {
        let line = if line.starts_with("id = ") {
            "id = 4".to_string()
        } else if line.starts_with("name = ") {
            "name = \"node4\"".to_string()
        } else if line.starts_with("rpc = ") {
            format!("rpc = \"127.0.0.5:{}\"", free_port("127.0.0.5"))
        } else if line.starts_with("api = ") {
            format!("api = \"127.0.0.5:{}\"", free_port("127.0.0.5"))
        } else if line.starts_with("nbd_tcp = ") {
            format!("nbd_tcp = \"127.0.0.5:{}\"", free_port("127.0.0.5"))
        } else {
            line.replace(node3.to_str().unwrap(), tmp.path().to_str().unwrap())
        };
        cfg.push_str(&line);
        cfg.push('\n');
    }
    let cfg_path = tmp.path().join("converged.toml");
    std::fs::write(&cfg_path, &cfg).unwrap();
    let converged = converge_bin().with_file_name("converged");
    let log = std::fs::File::create(tmp.path().join("converged.log")).unwrap();
    let _node4 = Stop(
        Command::new(&converged)
            .arg("--config")
            .arg(&cfg_path)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    let live = || {
        lab.json(&["node", "list"])
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["id"] == 4 && n["live"] == true)
    };
    lab.wait_for(
        "node 4 to be live",
        std::time::Duration::from_secs(60),
        live,
    );
    // It holds copies like any node: a mirror-3 volume owned by it takes verified writes.
    let out = lab.must(&[
        "volume", "create", "joined", "--size", "64M", "--owner", "4",
    ]);
    assert!(out.contains("node4"), "{out}");
    let uri = format!(
        "nbd+unix:///joined?socket={}",
        tmp.path().join("nbd.sock").display()
    );
    let f = fio(
        &uri,
        &["--rw=randwrite", "--bs=4k", "--size=8M", "--verify=crc32c"],
    );
    assert_eq!(fio_errors(&f), 0);
    assert!(all_in_sync(&lab, "joined"));
}

/// Stops the process this test started (by its PID), however the test ends.
struct Stop(std::process::Child);

impl Drop for Stop {
    fn drop(&mut self) {
        // SAFETY: SIGTERM to the child this test spawned.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

/// A node is removed for good under a verifying client: `node remove` refuses what would
/// break redundancy, drains the node (every copy moves elsewhere, copy before drop), moves
/// the volume it serves, deletes its records; its converged stops by itself and can never
/// register again; the data written before is intact and every copy is in sync.
#[test]
fn a_node_is_drained_and_removed_under_a_verifying_client() {
    let lab = Lab::up(4, &[]);
    // Data written before the removal, checked after it; and a volume that the node to be
    // removed serves.
    let uri = lab.create_volume("kept", "64M", "mirror-3");
    let job = ["--rw=write", "--bs=64k", "--size=48M", "--verify=crc32c"];
    let f = fio(&uri, &[&job[..], &["--do_verify=0"]].concat());
    assert_eq!(fio_errors(&f), 0);
    let copies_on = |node: u64| {
        let d = lab.json(&["drive", "list"]);
        d.as_array()
            .unwrap()
            .iter()
            .filter(|d| d["node"].as_u64() == Some(node))
            .map(|d| d["extents_used"].as_u64().unwrap())
            .sum::<u64>()
    };
    // Three copies on four nodes: at least two of nodes 2..4 hold one (the CLI speaks to
    // node 1's API).
    let gone = (2..=4).find(|n| copies_on(*n) > 0).unwrap();
    let gone_s = gone.to_string();
    let idx = gone as usize - 1;
    lab.create_owned("live", "64M", "mirror-3", gone as u32);

    // Unknown nodes and bad flags are refused.
    let e = lab.fails(&["node", "remove", "9"]);
    assert!(e.contains("no node 9"), "{e}");

    // A client writes and verifies through node 1 while that node, the volume's owner,
    // leaves.
    let client = Verifier::start(&lab, &lab.uri_on("live", 1));
    let pid = lab.lab_json()["nodes"][idx]["proc"]["pid"]
        .as_i64()
        .unwrap() as i32;
    let out = lab.json(&["node", "remove", &gone_s, "--timeout", "10m"]);
    let v = client.finish();
    eprintln!("verifier: {v}\nremoval: {out}");
    assert_eq!(out["node"], gone, "{out}");
    assert_eq!(out["moved"], serde_json::json!(["live"]), "{out}");

    // Gone from the cluster: no node, no drive, no copy; its converged stopped by itself.
    let nodes = lab.json(&["node", "list"]);
    assert!(
        nodes.as_array().unwrap().iter().all(|n| n["id"] != gone),
        "{nodes}"
    );
    assert_eq!(copies_on(gone), 0);
    for vol in ["kept", "live"] {
        assert!(lab.extents(vol).iter().all(|(_, node, _)| *node != gone));
        assert!(all_in_sync(&lab, vol), "{vol}");
        assert_copies_agree(&lab, vol);
    }
    // SAFETY: kill(2) with signal 0 only asks whether the lab's node process exists.
    lab.wait_for(
        "its converged to stop",
        std::time::Duration::from_secs(60),
        || unsafe { libc::kill(pid, 0) != 0 },
    );
    let log = std::fs::read_to_string(lab.path().join(format!("node{gone}/converged.log")));
    let log = log.unwrap();
    assert!(log.contains("was removed from the cluster"), "{log}");
    // Started again, it refuses at once with its own exit status.
    let cfg = lab.lab_json()["nodes"][idx]["config"]
        .as_str()
        .unwrap()
        .to_string();
    let refused_at_start = || {
        let again = run(Command::new(converge_bin().with_file_name("converged"))
            .args(["--config", cfg.as_str()]));
        let err = String::from_utf8_lossy(&again.stderr);
        assert_eq!(again.status.code(), Some(3), "{err}");
        assert!(
            err.contains(&format!("node {gone} was removed from this cluster")),
            "{err}"
        );
    };
    refused_at_start();
    // As a node that was down through its removal would (no mark left): etcd refuses it,
    // and the peers it saw at its last start tell it why.
    let mark = lab.path().join(format!("node{gone}/pki/removed"));
    std::fs::remove_file(&mark).unwrap();
    refused_at_start();
    assert!(mark.exists(), "the removal is marked again");
    assert!(lab.json(&["node", "list"]).as_array().unwrap().len() == 3);

    // The data written before is all there.
    let f = fio(&uri, &[&job[..], &["--verify_only"]].concat());
    assert_eq!(fio_errors(&f), 0);
    // (Health may still list the scrub of assert_copies_agree: check the copies instead.)
    let st = lab.json(&["status"]);
    for v in st["volumes"].as_array().unwrap() {
        assert_eq!(v["degraded_extents"], 0, "{st}");
    }

    // With three nodes left, a mirror-3 volume cannot lose another: refused, nothing moves.
    let other = if gone == 2 { "3" } else { "2" };
    let e = lab.fails(&["node", "remove", other]);
    assert!(e.contains("only 2 node(s) can hold them"), "{e}");
    let nodes = lab.json(&["node", "list"]);
    assert!(
        nodes
            .as_array()
            .unwrap()
            .iter()
            .all(|n| n["draining"] == false),
        "{nodes}"
    );
}
