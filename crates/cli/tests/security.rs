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
        .trim_start_matches("http://")
        .to_string()
}

/// `GET path`, or None if the node did not answer.
fn try_get(hostport: &str, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(hostport).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
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
        try_get(&api, "/v1/status").is_some_and(|a| a.starts_with("HTTP/1.1 200"))
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
/// have used up the node's descriptors.
#[test]
fn a_half_sent_api_request_is_closed() {
    let lab = Lab::up(3, &[]);
    let api = node_api(&lab, 1);
    let mut s = TcpStream::connect(&api).unwrap();
    s.write_all(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    // Far beyond the timeout: if the node has not closed by then, it never will.
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut buf = Vec::new();
    match s.read_to_end(&mut buf) {
        Ok(_) => {}
        Err(e) => panic!("the connection was still open: {e}"),
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
    assert!(http_get(&api, "/v1/status").starts_with("HTTP/1.1 200"));
}
