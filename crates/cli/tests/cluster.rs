//! End-to-end: a 4-node lab (real etcd, real converged processes) serving a mirror-3
//! volume to real NBD clients; durability across clean restarts and kill -9; bad input.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use std::collections::BTreeSet;
use std::process::Command;

/// On RAM drives (driven inline from the daemon's tasks; the other tests' drives are files
/// on disk, driven from I/O threads).
#[test]
fn mirror3_volume_serves_real_clients_and_places_copies_on_distinct_nodes() {
    let lab = Lab::up(4, &["--ram"]);
    let uri = lab.create_volume("vm01", "512M", "mirror-3");
    assert!(uri.starts_with("nbd+unix:///vm01?socket="), "{uri}");

    // nbdinfo: size and block sizes.
    let info = must(Command::new("nbdinfo").arg("--json").arg(&uri));
    let info: serde_json::Value = serde_json::from_str(&info).expect("nbdinfo json");
    let export = &info["exports"][0];
    assert_eq!(export["export-size"].as_u64(), Some(512 << 20), "{info}");
    assert_eq!(export["block_size_minimum"].as_u64(), Some(4096), "{info}");
    assert_eq!(
        export["block_size_preferred"].as_u64(),
        Some(4096),
        "{info}"
    );
    assert!(
        export["block_size_maximum"].as_u64().unwrap_or(0) >= 1 << 20,
        "{info}"
    );

    // fio random writes with crc32c verify, then a separate read-back verify pass.
    let w = fio(
        &uri,
        &[
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--size=256M",
            "--io_size=32M",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--do_verify=1",
            "--randseed=42",
        ],
    );
    assert_eq!(
        fio_errors(&w),
        0,
        "fio write+verify errors: {w}\n{}",
        lab.logs()
    );
    let r = fio(
        &uri,
        &[
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--size=256M",
            "--io_size=32M",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--verify_only",
            "--randseed=42",
        ],
    );
    assert_eq!(fio_errors(&r), 0, "fio read-back verify errors: {r}");
    let verified = r["jobs"][0]["read"]["io_bytes"].as_u64().unwrap_or(0);
    assert!(
        verified >= 32 << 20,
        "read-back verify read {verified} bytes: {r}"
    );

    // nbdcopy of random data in and out, compared; qemu-img compare against the file.
    let tmp = tempfile::tempdir().expect("tmp");
    let src = random_file(tmp.path(), "src.img", 512 << 20, 7);
    must(Command::new("nbdcopy").arg(&src).arg(&uri));
    let back = tmp.path().join("back.img");
    must(Command::new("nbdcopy").arg(&uri).arg(&back));
    assert!(
        std::fs::read(&src).unwrap() == std::fs::read(&back).unwrap(),
        "nbdcopy round trip differs"
    );
    must(
        Command::new("qemu-img")
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(&src)
            .arg(&uri),
    );
    // And qemu-img compare must notice a difference (the check can fail).
    let mut other = std::fs::read(&src).unwrap();
    other[12345] ^= 1;
    std::fs::write(&back, &other).unwrap();
    let o = run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&back)
        .arg(&uri));
    assert!(!o.status.success(), "qemu-img compare missed a flipped bit");

    // Placement: every slab has 3 extents on 3 distinct nodes, all in sync.
    let v = lab.json(&["volume", "show", "vm01"]);
    let slabs = v["slabs"].as_array().expect("slabs");
    assert_eq!(slabs.len(), 8, "512 MiB of 64 MiB slabs fully written: {v}");
    for s in slabs {
        let ex = s["extents"].as_array().expect("extents");
        assert_eq!(ex.len(), 3, "{s}");
        let nodes: BTreeSet<u64> = ex.iter().map(|e| e["node"].as_u64().unwrap()).collect();
        assert_eq!(nodes.len(), 3, "copies of slab on distinct nodes: {s}");
        assert!(ex.iter().all(|e| e["state"] == "in-sync"), "{s}");
    }
    // Locality and balance: 8 slabs x 3 copies over 8 drives. The owner's node holds a
    // copy of every slab (it reads them all locally), 4 on each of its drives; the other 16
    // copies spread over the other 6 drives within one of each other.
    let owner = v["owner"].as_u64().expect("owner");
    for s in slabs {
        let ex = s["extents"].as_array().unwrap();
        assert!(
            ex.iter().any(|e| e["node"].as_u64() == Some(owner)),
            "the owner's node {owner} holds a copy of every slab: {s}"
        );
    }
    let drives = lab.json(&["drive", "list"]);
    let drives = drives.as_array().unwrap();
    let used = |local: bool| -> Vec<u64> {
        drives
            .iter()
            .filter(|d| (d["node"].as_u64() == Some(owner)) == local)
            .map(|d| d["extents_used"].as_u64().unwrap())
            .collect()
    };
    let (mine, others) = (used(true), used(false));
    assert_eq!(mine, [4, 4], "{drives:?}");
    assert_eq!(others.iter().sum::<u64>(), 16, "{drives:?}");
    assert!(
        others.iter().max().unwrap() - others.iter().min().unwrap() <= 1,
        "placement balances the other drives: {others:?}"
    );

    let st = lab.json(&["status"]);
    assert_eq!(st["health"], "healthy", "{st}");
    assert_eq!(st["nodes"].as_array().unwrap().len(), 4);
    // Human output works too.
    let human = lab.must(&["status"]);
    assert!(
        human.contains("vm01") && human.contains("4/4 live"),
        "{human}"
    );

    // Metrics expose drive and volume counters and the daemon's CPU time.
    let lj = lab.lab_json();
    let api = lj["nodes"][0]["api"]
        .as_str()
        .unwrap()
        .trim_start_matches("https://")
        .to_string();
    let metrics = http_get(&lab, &api, "/metrics", Some(&lab.token()));
    for m in [
        "converge_drive_written_bytes_total",
        "converge_drive_inflight_seconds_total",
        "converge_volume_write_latency_seconds_bucket",
        "converge_process_cpu_seconds_total",
    ] {
        assert!(metrics.contains(m), "metrics lack {m}:\n{metrics}");
    }
}

#[test]
fn acked_writes_survive_clean_restart_and_kill_9() {
    let lab = Lab::up(4, &[]);
    let uri = lab.create_volume("db", "256M", "mirror-3");
    let tmp = tempfile::tempdir().expect("tmp");
    let a = random_file(tmp.path(), "a.img", 256 << 20, 1);
    must(Command::new("nbdcopy").arg(&a).arg(&uri));

    // Clean stop (SIGTERM) of every process, then start the same lab again.
    lab.must(&["lab", "down"]);
    lab.must(&["lab", "up"]);
    let back = tmp.path().join("back.img");
    must(Command::new("nbdcopy").arg(&uri).arg(&back));
    assert!(
        std::fs::read(&a).unwrap() == std::fs::read(&back).unwrap(),
        "data differs after a clean restart\n{}",
        lab.logs()
    );

    // Write new data; as soon as nbdcopy returns (every write acked) kill -9 every node.
    let b = random_file(tmp.path(), "b.img", 256 << 20, 2);
    must(Command::new("nbdcopy").arg(&b).arg(&uri));
    lab.kill_all_and_restart(4);
    std::fs::remove_file(&back).unwrap();
    must(Command::new("nbdcopy").arg(&uri).arg(&back));
    assert!(
        std::fs::read(&b).unwrap() == std::fs::read(&back).unwrap(),
        "acked data lost or damaged after kill -9\n{}",
        lab.logs()
    );
    // fio verify after the crash too: write, kill -9 all, read back with verify_only.
    let args = [
        "--rw=randwrite",
        "--bs=16k",
        "--iodepth=8",
        "--size=128M",
        "--io_size=16M",
        "--verify=crc32c",
        "--verify_fatal=1",
        "--randseed=9",
    ];
    let mut w = args.to_vec();
    w.push("--do_verify=0");
    assert_eq!(fio_errors(&fio(&uri, &w)), 0);
    lab.kill_all_and_restart(4);
    let mut r = args.to_vec();
    r.push("--verify_only");
    let v = fio(&uri, &r);
    assert_eq!(
        fio_errors(&v),
        0,
        "verify after kill -9: {v}\n{}",
        lab.logs()
    );
}

#[test]
fn bad_volume_requests_get_clear_errors() {
    let lab = Lab::up(2, &[]);
    let e = lab.fails(&["volume", "create", "x", "--size", "12Q"]);
    assert!(e.contains("not a size"), "{e}");
    let e = lab.fails(&[
        "volume",
        "create",
        "x",
        "--size",
        "1G",
        "--resiliency",
        "raid5",
    ]);
    assert!(e.contains("unknown resiliency"), "{e}");
    let e = lab.fails(&[
        "volume",
        "create",
        "x",
        "--size",
        "1G",
        "--resiliency",
        "mirror-3",
    ]);
    assert!(e.contains("mirror-3 needs 3 nodes"), "{e}");
    let e = lab.fails(&[
        "volume",
        "create",
        "x",
        "--size",
        "100G",
        "--resiliency",
        "mirror-2",
    ]);
    assert!(e.contains("cannot create volume x"), "{e}");
    let e = lab.fails(&["volume", "create", "bad/name", "--size", "1G"]);
    assert!(e.contains("not valid"), "{e}");
    let e = lab.fails(&[
        "volume",
        "create",
        "x",
        "--size",
        "1000",
        "--resiliency",
        "mirror-2",
    ]);
    assert!(e.contains("multiple of 4096"), "{e}");
    let e = lab.fails(&["volume", "show", "nosuch"]);
    assert!(e.contains("no volume named"), "{e}");
    lab.must(&[
        "volume",
        "create",
        "x",
        "--size",
        "64M",
        "--resiliency",
        "mirror-2",
    ]);
    let e = lab.fails(&[
        "volume",
        "create",
        "x",
        "--size",
        "64M",
        "--resiliency",
        "mirror-2",
    ]);
    assert!(e.contains("already exists"), "{e}");
    let e = lab.fails(&["volume", "resize", "x", "--size", "32M"]);
    assert!(e.contains("shrinking"), "{e}");
    lab.must(&["volume", "resize", "x", "--size", "128M"]);
    assert_eq!(
        lab.json(&["volume", "show", "x"])["size_bytes"].as_u64(),
        Some(128 << 20)
    );
    lab.must(&["volume", "delete", "x"]);
    assert!(lab.json(&["volume", "list"]).as_array().unwrap().is_empty());

    // Unknown export over NBD.
    let sock = lab.lab_json()["nodes"][0]["nbd_socket"]
        .as_str()
        .unwrap()
        .to_string();
    let o = run(Command::new("nbdinfo").arg(format!("nbd+unix:///nosuch?socket={sock}")));
    assert!(!o.status.success(), "unknown export must be refused");
    lab.must(&[
        "volume",
        "create",
        "y",
        "--size",
        "64M",
        "--resiliency",
        "mirror-2",
        "--owner",
        "2",
    ]);
    // Asked on node 1, it is served by forwarding to node 2 (redirected I/O).
    let o = must(Command::new("qemu-img").args(["info", &format!("nbd+unix:///y?socket={sock}")]));
    assert!(o.contains("64 MiB"), "{o}");
    // An unreachable API is a clear error.
    let o = run(&mut lab.cmd(&["status", "--api", "https://127.0.0.1:9"]));
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("cannot reach the converge API"));
}

#[test]
fn converged_refuses_foreign_drives_bad_config_and_dead_etcd() {
    let lab = Lab::up(1, &[]);
    let lj = lab.lab_json();
    let cfg_path = lj["nodes"][0]["config"].as_str().unwrap().to_string();
    let cfg = std::fs::read_to_string(&cfg_path).unwrap();
    let converged = converge_bin().with_file_name("converged");
    let tmp = tempfile::tempdir().unwrap();

    // etcd not running: a closed port.
    let dead = cfg.replace(lj["etcd_endpoint"].as_str().unwrap(), "https://127.0.0.1:9");
    let dead = dead.replace("nbd.sock", "nbd-dead.sock");
    let p = tmp.path().join("dead.toml");
    std::fs::write(&p, &dead).unwrap();
    let o = run(Command::new(&converged).arg("--config").arg(&p));
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("127.0.0.1:9"),
        "names the etcd endpoint: {err}"
    );

    // The lab's etcd wants a client certificate of the cluster's CA: without one the node
    // is refused, and says why.
    let nocert: String = cfg
        .lines()
        .filter(|l| !l.starts_with("cert_file") && !l.starts_with("key_file"))
        .map(|l| format!("{}\n", l.replace("nbd.sock", "nbd-nocert.sock")))
        .collect();
    let p = tmp.path().join("nocert.toml");
    std::fs::write(&p, &nocert).unwrap();
    let o = run(Command::new(&converged).arg("--config").arg(&p));
    assert!(
        !o.status.success(),
        "etcd served a node without a certificate"
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("client certificate"), "{err}");

    // A second lab (another cluster) must refuse the first lab's drive file.
    let other = Lab::up(1, &[]);
    let ocfg =
        std::fs::read_to_string(other.lab_json()["nodes"][0]["config"].as_str().unwrap()).unwrap();
    let first_drive = lj["nodes"][0]["drives"][0].as_str().unwrap();
    let mut foreign = String::new();
    for line in ocfg.lines() {
        if line.starts_with("path = ") {
            foreign.push_str(&format!("path = \"{first_drive}\"\n"));
            break;
        }
        let line = line.replace("nbd.sock", "nbd-foreign.sock");
        // Fresh ports so the addresses are free.
        let line = if line.starts_with("rpc = ") {
            "rpc = \"127.0.0.2:0\"".to_string()
        } else if line.starts_with("api = ") {
            "api = \"127.0.0.2:0\"".to_string()
        } else {
            line
        };
        foreign.push_str(&line);
        foreign.push('\n');
    }
    foreign.push_str("size = 1073741824\nrole = \"capacity\"\n");
    // The other lab's node identity (its [tls] section came after the drives).
    foreign.push_str(&format!(
        "\n[tls]\ndir = {:?}\n",
        other.path().join("node1/pki").display().to_string()
    ));
    let p = tmp.path().join("foreign.toml");
    std::fs::write(&p, &foreign).unwrap();
    let o = run(Command::new(&converged).arg("--config").arg(&p));
    assert!(!o.status.success(), "foreign drive accepted:\n{foreign}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("belongs to another cluster"), "{err}");

    // A config error names the field.
    let p = tmp.path().join("bad.toml");
    std::fs::write(
        &p,
        cfg.replace("[network]\nrpc = ", "[network]\nrpc = \"nowhere\"\n#"),
    )
    .unwrap();
    let o = run(Command::new(&converged).arg("--config").arg(&p));
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("network.rpc"), "{err}");
}

/// Bits flipped in a drive file: reads return good data from another copy, and the bad
/// copy is rewritten (a second read needs no repair, and the file holds good bytes again).
#[test]
fn flipped_bits_are_served_from_a_good_copy_and_repaired() {
    let lab = Lab::up(3, &[]);
    lab.must(&[
        "volume",
        "create",
        "rot",
        "--size",
        "64M",
        "--resiliency",
        "mirror-3",
        "--owner",
        "1",
    ]);
    let uri = lab.uri("rot");
    let tmp = tempfile::tempdir().unwrap();
    // Flip a bit in blocks 100..110 of the owner's (node 1) copy: it is read first.
    let (src, flipped) = write_marked_and_flip(&lab, "rot", tmp.path(), 1, 100..110);
    assert_eq!(flipped.len(), 10);
    let data = std::fs::read(&src).unwrap();

    let repaired = || lab.metric(1, "converge_volume_repaired_blocks_total");
    let back = tmp.path().join("back.img");
    must(Command::new("nbdcopy").arg(&uri).arg(&back));
    assert!(
        std::fs::read(&back).unwrap() == data,
        "read returned damaged data\n{}",
        lab.logs()
    );
    assert_eq!(repaired(), 10, "each bad block repaired once");
    // Second read: nothing left to repair.
    must(Command::new("nbdcopy").arg(&uri).arg(&back));
    assert!(std::fs::read(&back).unwrap() == data);
    assert_eq!(repaired(), 10, "repair rewrote the bad copies");
    // The repair wrote each block out of place (the rotten physical block is free now, and
    // still holds the flipped bit): node 1's drive file must hold a good copy of each
    // flipped block somewhere, which before the repair it did not.
    for (path, off, _) in &flipped {
        let img = std::fs::read(path).unwrap();
        let pos = off - 2000;
        let marker = &img[pos..pos + 14];
        let b: usize = std::str::from_utf8(&marker[6..]).unwrap().parse().unwrap();
        let good = &data[b * 4096..(b + 1) * 4096];
        assert!(
            img.chunks_exact(4096).any(|blk| blk == good),
            "{path}: no good copy of block {b} after the repair"
        );
    }
}

/// Malformed NBD requests (libnbd with its client-side checks off) get error replies and
/// the connection stays usable.
#[test]
fn bad_nbd_requests_get_errors_and_the_connection_survives() {
    let lab = Lab::up(3, &[]);
    let uri = lab.create_volume("badio", "64M", "mirror-3");
    let script = r#"
import nbd, sys
h = nbd.NBD()
h.set_strict_mode(0)
h.connect_uri(sys.argv[1])
size = h.get_size()
h.pwrite(b"\xab" * 4096, 0)
def expect_error(what, f):
    try:
        f()
    except nbd.Error as e:
        print(what, "errno", e.errno)
        return
    sys.exit(what + ": no error")
expect_error("read past end", lambda: h.pread(4096, size))
expect_error("write past end", lambda: h.pwrite(b"\0" * 4096, size - 2048))
expect_error("oversized read", lambda: h.pread(48 << 20, 0))
expect_error("oversized write", lambda: h.pwrite(b"\0" * (40 << 20), 0))
expect_error("misaligned read", lambda: h.pread(4096, 100))
expect_error("trim past end", lambda: h.trim(8192, size))
# The connection still works and the data is intact.
assert h.pread(4096, 0) == b"\xab" * 4096, "data after errors"
h.shutdown()
print("ok")
"#;
    let out = nbd_script(script, &uri);
    assert_eq!(out.matches("errno").count(), 6, "{out}");
}

/// What a guest's `mkfs` and `fstrim` send: TRIM and WRITE_ZEROES far longer than one
/// extent operation (whole 64 MiB slabs, and 4 GiB at once), unaligned, across slabs, on
/// slabs that hold data; and unaligned 32 MiB writes and reads from a client that did not
/// negotiate block sizes. Each works, at once, and the volume then reads back what a byte
/// array would hold, on every copy.
#[test]
fn trims_and_zeroes_of_any_size_and_unaligned_32_mib_requests_work() {
    let lab = Lab::up(3, &["--drive-size", "3G"]);
    let uri = lab.create_volume("big", "4G", "mirror-3");
    let script = r#"
import nbd, os, sys
M = 1 << 20
h = nbd.NBD()
h.set_strict_mode(0)
h.set_request_block_size(False)
h.connect_uri(sys.argv[1])
size = h.get_size()
span = 256 * M                 # four slabs hold data
model = bytearray(span)
def write(off, data):
    h.pwrite(data, off)
    model[off:off + len(data)] = data
def trim(off, n):
    h.trim(n, off)
    a, b = -(-off // 4096) * 4096, min((off + n) // 4096 * 4096, span)
    if b > a:
        model[a:b] = bytes(b - a)   # whole blocks read as zeros; the edges keep their data
def zero(off, n):
    h.zero(n, off)
    end = min(off + n, span)
    if end > off:
        model[off:end] = bytes(end - off)
def check(what):
    for off in range(0, span, 32 * M):
        if h.pread(32 * M, off) != model[off:off + 32 * M]:
            sys.exit(f"{what}: the volume differs in [{off}, +32 MiB)")
    print(what, "ok")
for off in range(0, span, 32 * M):
    write(off, os.urandom(32 * M))
check("written")
write(1000, os.urandom(32 * M))
if h.pread(32 * M, 777) != model[777:777 + 32 * M]:
    sys.exit("unaligned 32 MiB read differs")
check("unaligned 32 MiB write")
zero(100 * M + 5, 40 * M + 1000)
check("40 MiB unaligned WRITE_ZEROES")
trim(64 * M, 64 * M)
check("whole-slab TRIM")
write(60 * M, os.urandom(32 * M))
zero(3, 130 * M)
check("130 MiB WRITE_ZEROES from byte 3")
write(0, os.urandom(32 * M))
trim(2048, size - 4096)
check("4 GiB TRIM")
write(200 * M + 1, os.urandom(M))
zero(0, size - 4096)
check("4 GiB WRITE_ZEROES")
write(5 * M, os.urandom(2 * M))
h.flush()
h.shutdown()
print("ok")
"#;
    nbd_script(script, &uri);
    assert!(all_in_sync(&lab, "big"), "no copy was marked stale");
    assert_copies_agree(&lab, "big");
}

/// The CLI is a cluster client: `lab env` gives it every node's API, and with node 1 killed
/// (kill -9) `status`, `volume list` and even a `volume create` still work through the
/// others. Pinned to node 1 alone it fails, naming what it tried.
#[test]
fn cli_works_through_lab_env_with_node_1_killed() {
    let lab = Lab::up(3, &[]);
    lab.create_volume("before", "64M", "mirror-2");
    let env = lab.json(&["lab", "env"]);
    let list = env["CONVERGE_API"].as_str().unwrap().to_string();
    let apis: Vec<String> = lab.lab_json()["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["api"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(list, apis.join(","), "lab env exports every node's API");
    // As a user's shell after `eval "$(converge lab env)"`, with no lab directory to fall
    // back on: only CONVERGE_API (and the token and CA it exports) leads to the cluster.
    let no_lab = tempfile::tempdir().unwrap();
    let cli = |api: &str, args: &[&str]| {
        let mut c = Command::new(converge_bin());
        c.args(args)
            .env("CONVERGE_API", api)
            .env("CONVERGE_TOKEN", env["CONVERGE_TOKEN"].as_str().unwrap())
            .env("CONVERGE_CA", env["CONVERGE_CA"].as_str().unwrap())
            .env("CONVERGE_LAB_DIR", no_lab.path().join("none"));
        run(&mut c)
    };
    let json = |args: &[&str]| {
        let mut a = args.to_vec();
        a.push("--json");
        let o = cli(&list, &a);
        assert!(
            o.status.success(),
            "converge {args:?} through {list} failed:\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    assert_eq!(json(&["status"])["nodes"].as_array().unwrap().len(), 3);

    lab.must(&["lab", "fault", "kill", "1"]);
    // Node 1 alone: every endpoint tried is named.
    let o = cli(&apis[0], &["status"]);
    assert!(!o.status.success(), "node 1 is dead");
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("cannot reach the converge API") && e.contains(&apis[0]),
        "{e}"
    );
    let st = json(&["status"]);
    assert_eq!(st["nodes"].as_array().unwrap().len(), 3, "{st}");
    let names = |v: serde_json::Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|v| v["name"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(names(json(&["volume", "list"])), ["before"]);
    // A POST to the dead node was never sent: the next node takes it, once.
    json(&[
        "volume",
        "create",
        "after",
        "--size",
        "64M",
        "--resiliency",
        "mirror-2",
        "--owner",
        "2",
    ]);
    assert_eq!(names(json(&["volume", "list"])), ["after", "before"]);
    // An HTTP error is the cluster's answer, not a reason to ask another node.
    let o = cli(&list, &["volume", "show", "nosuch"]);
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!e.contains("cannot reach"), "{e}");
}

/// NBD block status (`base:allocation`): slabs never written are holes that read as
/// zeroes, so `qemu-img map`, `nbdinfo --map` and copies that skip holes see a thin
/// volume as it is; the data is still all there to read. `status` counts the same slabs.
/// A metric (every line whose name starts `name{`) summed over every node of the lab.
fn metric_sum(lab: &Lab, name: &str) -> u64 {
    let lj = lab.lab_json();
    let prefix = format!("{name}{{");
    lj["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            let api = n["api"].as_str().unwrap().trim_start_matches("https://");
            http_get(lab, api, "/metrics", Some(&lab.token()))
                .lines()
                .filter(|l| l.starts_with(&prefix))
                .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
                .sum::<u64>()
        })
        .sum()
}

/// Extents the engines of every node hold on their capacity drives (their own count, not
/// the slab records').
fn engine_extents(lab: &Lab) -> u64 {
    metric_sum(lab, "converge_drive_extents_used")
}

#[test]
fn an_fstrim_sized_trim_returns_whole_slabs_to_the_pool_on_every_copy() {
    const M: u64 = 1 << 20;
    let lab = Lab::up(3, &[]);
    let uri = lab.create_volume("reclaim", "512M", "mirror-2");
    // Slabs 0, 1 and 2 (64 MiB each) written whole.
    let tmp = tempfile::tempdir().unwrap();
    let a = random_file(tmp.path(), "a.img", (192 * M) as usize, 7);
    must(
        Command::new("qemu-img")
            .args(["convert", "-n", "-f", "raw", "-O", "raw"])
            .arg(&a)
            .arg(&uri),
    );
    let allocated = |lab: &Lab| {
        lab.json(&["status"])["capacity"]["allocated_bytes"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(allocated(&lab), 3 * 64 * M);
    assert_eq!(engine_extents(&lab), 6, "three slabs, two copies each");
    // Written bytes: what holds data, per volume (once), per copy, per drive (each copy).
    let written = |lab: &Lab| {
        let s = lab.json(&["status"]);
        let drives: u64 = s["drives"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|d| d["written_bytes"].as_u64())
            .sum();
        let show = lab.json(&["volume", "show", "reclaim"]);
        let copies: Vec<u64> = show["slabs"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|s| s["extents"].as_array().unwrap().iter())
            .map(|e| e["written_bytes"].as_u64().unwrap())
            .collect();
        assert_eq!(
            show["written_bytes"], s["volumes"][0]["written_bytes"],
            "{show}"
        );
        assert_eq!(s["capacity"]["written_bytes"], show["written_bytes"], "{s}");
        let list = lab.json(&["volume", "list"]);
        assert_eq!(list[0]["written_bytes"], show["written_bytes"], "{list}");
        assert_eq!(metric_sum(lab, "converge_drive_data_bytes"), drives);
        (show["written_bytes"].as_u64().unwrap(), copies, drives)
    };
    assert_eq!(written(&lab), (192 * M, vec![64 * M; 6], 2 * 192 * M));

    // What a guest's fstrim sends: one discard over free space, here 32 MiB..160 MiB. It
    // covers slab 1 whole, which goes back to the pool on both copies; the parts of slabs
    // 0 and 2 read as zeros but stay allocated.
    must(Command::new("qemu-io").args(["-f", "raw", "-c", "discard 32M 128M", &uri]));
    assert_eq!(allocated(&lab), 2 * 64 * M);
    assert_eq!(engine_extents(&lab), 4, "slab 1 freed on every copy");
    let c = lab.json(&["status"])["capacity"].clone();
    assert_eq!(c["used_bytes"].as_u64().unwrap(), 2 * 2 * 64 * M, "{c}");
    let show = lab.json(&["volume", "show", "reclaim"]);
    assert_eq!(show["slabs_allocated"], 2, "{show}");
    assert_eq!(metric_sum(&lab, "converge_volume_slabs_released_total"), 1);
    // Slab 0 keeps 32 MiB of data, slab 2 its last 32 MiB.
    assert_eq!(written(&lab), (64 * M, vec![32 * M; 4], 2 * 64 * M));
    let text = lab.must(&["volume", "show", "reclaim"]);
    assert!(
        text.contains("written     64 MiB (50% of allocated"),
        "{text}"
    );
    // Each node lists its own extents; a volume id that is not a number is refused.
    let apis: Vec<String> = lab.lab_json()["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            n["api"]
                .as_str()
                .unwrap()
                .trim_start_matches("https://")
                .to_string()
        })
        .collect();
    let bad = http_get(&lab, &apis[0], "/v1/extents/reclaim", Some(&lab.token()));
    assert!(
        bad.starts_with("HTTP/1.1 400") && bad.contains("is not a volume id"),
        "{bad}"
    );
    let mut listed = Vec::new();
    for api in &apis {
        let r = http_get(
            &lab,
            api,
            &format!("/v1/extents/{}", show["id"]),
            Some(&lab.token()),
        );
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        let body: serde_json::Value =
            serde_json::from_str(r.split("\r\n\r\n").nth(1).unwrap()).unwrap();
        listed.extend(
            body.as_array()
                .unwrap()
                .iter()
                .map(|e| e["written_bytes"].as_u64().unwrap()),
        );
    }
    assert_eq!(listed, vec![32 * M; 4], "two slabs, two copies each");

    // The volume reads what was written outside the discard and zeros inside it.
    let back = tmp.path().join("back.img");
    must(Command::new("nbdcopy").arg(&uri).arg(&back));
    let (a, back) = (std::fs::read(&a).unwrap(), std::fs::read(&back).unwrap());
    let (lo, hi, end) = ((32 * M) as usize, (160 * M) as usize, (192 * M) as usize);
    assert!(back[..lo] == a[..lo], "data before the discard changed");
    assert!(
        back[lo..hi].iter().all(|&b| b == 0),
        "the discarded range does not read zeros"
    );
    assert!(back[hi..end] == a[hi..], "data after the discard changed");
    assert!(back[end..].iter().all(|&b| b == 0));
    // qemu-img map sees slab 1 as a hole again, slabs 0 and 2 as data.
    let map = must(Command::new("qemu-img").args(["map", "--output=json", "-f", "raw", &uri]));
    let map: serde_json::Value = serde_json::from_str(&map).unwrap();
    let data_at = |off: u64| {
        map.as_array()
            .unwrap()
            .iter()
            .find(|e| {
                let (s, l) = (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap());
                s <= off && off < s + l
            })
            .map(|e| e["data"].as_bool().unwrap())
            .unwrap()
    };
    assert!(
        data_at(0) && !data_at(64 * M) && !data_at(127 * M) && data_at(128 * M),
        "{map}"
    );

    // Written again, slab 1 is allocated afresh and holds what a verifying client wrote.
    let f = fio(
        &uri,
        &[
            "--rw=write",
            "--bs=64k",
            "--size=4M",
            "--offset=80M",
            "--verify=crc32c",
        ],
    );
    assert_eq!(fio_errors(&f), 0);
    assert_eq!(allocated(&lab), 3 * 64 * M);
    assert_eq!(engine_extents(&lab), 6);
    // And a discard of the whole volume gives everything back.
    must(Command::new("qemu-io").args(["-f", "raw", "-c", "discard 0 512M", &uri]));
    assert_eq!(allocated(&lab), 0);
    assert_eq!(engine_extents(&lab), 0);

    // Discards smaller than a slab add up: slab 3 written, then discarded in two halves (as
    // a file system's fstrim does, one free extent at a time), goes back too.
    let f = fio(
        &uri,
        &["--rw=write", "--bs=1M", "--size=64M", "--offset=192M"],
    );
    assert_eq!(fio_errors(&f), 0);
    assert_eq!(allocated(&lab), 64 * M);
    must(Command::new("qemu-io").args(["-f", "raw", "-c", "discard 192M 40M", &uri]));
    assert_eq!(
        allocated(&lab),
        64 * M,
        "half a slab discarded: still allocated"
    );
    must(Command::new("qemu-io").args(["-f", "raw", "-c", "discard 232M 24M", &uri]));
    assert_eq!(allocated(&lab), 0);
    assert_eq!(engine_extents(&lab), 0);
}

#[test]
fn qemu_img_map_nbdinfo_and_status_see_slabs_never_written_as_holes() {
    let lab = Lab::up(3, &[]);
    let uri = lab.create_volume("thin", "512M", "mirror-2");
    // Data in slabs 1 and 5 (of eight 64 MiB slabs) only.
    for offset in ["64M", "320M"] {
        let f = fio(
            &uri,
            &[
                "--rw=write",
                "--bs=64k",
                "--size=1M",
                &format!("--offset={offset}"),
                "--verify=crc32c",
            ],
        );
        assert_eq!(fio_errors(&f), 0);
    }
    let map = must(Command::new("qemu-img").args(["map", "--output=json", "-f", "raw", &uri]));
    let map: serde_json::Value = serde_json::from_str(&map).unwrap();
    let data_at = |off: u64| {
        let e = map
            .as_array()
            .unwrap()
            .iter()
            .find(|e| {
                let (s, l) = (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap());
                s <= off && off < s + l
            })
            .unwrap_or_else(|| panic!("no entry at {off}: {map}"));
        (e["data"].as_bool().unwrap(), e["zero"].as_bool().unwrap())
    };
    const M: u64 = 1 << 20;
    for slab in 0..8u64 {
        let written = slab == 1 || slab == 5;
        for off in [slab * 64 * M, slab * 64 * M + 63 * M] {
            assert_eq!(
                data_at(off),
                (written, !written),
                "offset {off} (slab {slab}): {map}"
            );
        }
    }
    // The capacity report counts the same two slabs: allocated once, placed twice, and
    // says what each resiliency holds on these three equal nodes.
    let c = lab.json(&["status"])["capacity"].clone();
    let n = |k: &str| c[k].as_u64().unwrap();
    assert_eq!(n("allocated_bytes"), 2 * 64 * M, "{c}");
    assert_eq!(n("used_bytes"), 2 * 2 * 64 * M, "{c}");
    assert_eq!(n("free_bytes"), n("total_bytes") - n("used_bytes"), "{c}");
    assert_eq!(
        n("rebuild_reserve_bytes"),
        2 * 64 * M,
        "4 copies on 3 nodes: {c}"
    );
    let total = n("total_bytes");
    assert_eq!(c["usable_bytes"]["simple"], total, "{c}");
    assert_eq!(c["usable_bytes"]["mirror-2"], total / 2, "{c}");
    assert_eq!(c["usable_bytes"]["mirror-3"], total / 3, "{c}");
    assert_eq!(c["warnings"], serde_json::json!([]), "{c}");
    let text = lab.must(&["status"]);
    assert!(text.contains("usable    mirror-2"), "{text}");

    // nbdinfo agrees: 2 of 8 slabs hold data.
    let totals = must(Command::new("nbdinfo").args(["--map", "--totals", &uri]));
    assert!(
        totals
            .lines()
            .any(|l| l.contains("25.0%") && l.contains("data")),
        "{totals}"
    );
    // A copy that skips holes brings back exactly what was written.
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("thin.img");
    must(Command::new("nbdcopy").arg(&uri).arg(&out));
    must(
        Command::new("qemu-img")
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(&out)
            .arg(&uri),
    );
    // Through a node that forwards to the owner, every range counts as data (never wrong).
    let other = (1..=3u32)
        .find(|n| lab.json(&["volume", "show", "thin"])["owner"] != *n)
        .unwrap();
    let map = must(Command::new("qemu-img").args([
        "map",
        "--output=json",
        "-f",
        "raw",
        &lab.uri_on("thin", other),
    ]));
    let map: serde_json::Value = serde_json::from_str(&map).unwrap();
    assert!(
        map.as_array().unwrap().iter().all(|e| e["data"] == true),
        "{map}"
    );
}
