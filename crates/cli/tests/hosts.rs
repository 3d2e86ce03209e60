//! End-to-end: the lab playing separate hosts (each node in a network namespace of its own,
//! with its own address and certificate, etcd members beside the first three) loses an etcd
//! member and then takes a rolling restart of every node under a verifying client, with no
//! error and every copy in sync afterwards.

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

    // One etcd member dies (kill -9): the cluster goes on with the other two.
    let pid = lj["etcd_more"][0]["proc"]["pid"].as_i64().unwrap() as i32;
    // SAFETY: kill(2) on the PID the lab recorded for the etcd member it started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let uri = lab.create_volume("rr", "64M", "mirror-3");
    assert!(lab.json(&["status"])["health"] == "healthy");

    // A client attached to node 1's export keeps writing and verifying while every node is
    // restarted in turn, reconnecting when its own node restarts (as qemu does with
    // reconnect-delay).
    let stop = lab.path().join("stop-verifier");
    let verifier = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/tools/reconnecting_verifier.py");
    let client = Command::new("/usr/bin/python3")
        .arg(&verifier)
        .arg(&uri)
        .arg(&stop)
        .arg((32u64 << 20).to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = run(&mut lab.cmd(&["cluster", "rolling-restart", "--json"]));
    std::fs::write(&stop, b"").unwrap();
    let verdict = client.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "rolling restart failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let steps: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(steps.as_array().unwrap().len(), 3, "{steps}");
    assert!(
        verdict.status.success(),
        "verifier: {}",
        String::from_utf8_lossy(&verdict.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&verdict.stdout).unwrap();
    eprintln!("verifier: {v}\nrolling restart: {steps}");
    assert_eq!(v["mismatches"], 0, "{v}");
    assert_eq!(v["errors"], 0, "{v}");
    // The client's own node was restarted under it: it had to reconnect, and it worked on
    // across the restarts.
    assert!(v["reconnects"].as_u64().unwrap() >= 1, "{v}");
    assert!(v["ops"].as_u64().unwrap() > 0, "{v}");

    // Every copy is in sync and the copies agree; the new processes serve verified I/O.
    assert!(all_in_sync(&lab, "rr"));
    assert_copies_agree(&lab, "rr");
    let f = fio(
        &uri,
        &["--rw=randwrite", "--bs=4k", "--size=8M", "--verify=crc32c"],
    );
    assert_eq!(fio_errors(&f), 0);
}
