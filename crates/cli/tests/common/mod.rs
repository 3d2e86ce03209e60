//! Helpers for end-to-end tests: a lab cluster in a temp dir driven through the real
//! `converge` CLI, and the real NBD clients (fio, nbdcopy, nbdinfo, qemu-img).

#![allow(clippy::unwrap_used)]
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn converge_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_converge"))
}

/// Run a command, returning its output; panics with stdout/stderr if it cannot start.
pub fn run(cmd: &mut Command) -> Output {
    let dbg = format!("{cmd:?}");
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {dbg}: {e}"))
}

pub fn must(cmd: &mut Command) -> String {
    let dbg = format!("{cmd:?}");
    let o = run(cmd);
    assert!(
        o.status.success(),
        "{dbg} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn require_tools() {
    for t in ["etcd", "fio", "nbdcopy", "nbdinfo", "qemu-img"] {
        let ok = Command::new("sh")
            .arg("-c")
            .arg(format!("command -v {t}"))
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        assert!(
            ok,
            "{t} is not installed: run scripts/setup.sh (tests need the real tools)"
        );
    }
}

/// Tests that create network namespaces run as root (as CI does).
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    assert!(
        root,
        "this test creates network namespaces and must run as root (as CI does)"
    );
}

pub struct Lab {
    pub dir: tempfile::TempDir,
}

impl Lab {
    pub fn up(nodes: u32, extra: &[&str]) -> Lab {
        require_tools();
        let dir = tempfile::Builder::new()
            .prefix("cvlab")
            .tempdir_in("/tmp")
            .expect("tempdir");
        let lab = Lab { dir };
        let n = nodes.to_string();
        let mut args = vec!["lab", "up", "--nodes", &n, "--drives-per-node", "2"];
        // 1 GiB drives and 64 MiB slabs unless `extra` says otherwise.
        for (flag, default) in [("--drive-size", "1G"), ("--slab-size", "64M")] {
            if !extra.contains(&flag) {
                args.extend([flag, default]);
            }
        }
        args.extend_from_slice(extra);
        lab.must(&args);
        lab
    }

    /// The lab's admin token (its first node wrote it).
    pub fn token(&self) -> String {
        std::fs::read_to_string(self.path().join("admin.token"))
            .expect("the lab's admin.token")
            .trim()
            .to_string()
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(converge_bin());
        c.args(args)
            .env("CONVERGE_LAB_DIR", self.path())
            .env_remove("CONVERGE_API");
        c
    }

    pub fn must(&self, args: &[&str]) -> String {
        must(&mut self.cmd(args))
    }

    /// Run expecting failure; returns stderr.
    pub fn fails(&self, args: &[&str]) -> String {
        let o = run(&mut self.cmd(args));
        assert!(
            !o.status.success(),
            "converge {args:?} should have failed but printed:\n{}",
            String::from_utf8_lossy(&o.stdout)
        );
        String::from_utf8_lossy(&o.stderr).into_owned()
    }

    pub fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut a = args.to_vec();
        a.push("--json");
        let out = self.must(&a);
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("bad JSON from {args:?}: {e}\n{out}"))
    }

    pub fn create_volume(&self, name: &str, size: &str, resiliency: &str) -> String {
        self.must(&[
            "volume",
            "create",
            name,
            "--size",
            size,
            "--resiliency",
            resiliency,
        ]);
        self.uri(name)
    }

    /// Creates a volume whose preferred owner is node `owner`.
    pub fn create_owned(&self, name: &str, size: &str, resiliency: &str, owner: u32) {
        let owner = owner.to_string();
        self.must(&[
            "volume",
            "create",
            name,
            "--size",
            size,
            "--resiliency",
            resiliency,
            "--owner",
            &owner,
        ]);
    }

    pub fn uri(&self, name: &str) -> String {
        self.json(&["volume", "show", name])["uri"]
            .as_str()
            .expect("uri")
            .to_string()
    }

    /// kill -9 every node, then start each again with its data.
    pub fn kill_all_and_restart(&self, nodes: u32) {
        for n in 1..=nodes {
            self.must(&["lab", "fault", "kill", &n.to_string()]);
        }
        for n in 1..=nodes {
            self.must(&["lab", "fault", "restart", &n.to_string()]);
        }
    }

    pub fn lab_json(&self) -> serde_json::Value {
        let t = std::fs::read_to_string(self.path().join("lab.json")).expect("lab.json");
        serde_json::from_str(&t).expect("lab.json parses")
    }

    pub fn logs(&self) -> String {
        let mut s = String::new();
        for i in 1..=8 {
            let p = self.path().join(format!("node{i}/converged.log"));
            if let Ok(t) = std::fs::read_to_string(&p) {
                let lines: Vec<&str> = t.lines().collect();
                s.push_str(&format!(
                    "--- node{i} (last 30 lines)\n{}\n",
                    lines[lines.len().saturating_sub(30)..].join("\n")
                ));
            }
        }
        s
    }
}

impl Lab {
    /// The URI of `volume` on node `node`'s NBD socket (any node serves any volume).
    pub fn uri_on(&self, volume: &str, node: u32) -> String {
        let sock = self.lab_json()["nodes"][node as usize - 1]["nbd_socket"]
            .as_str()
            .expect("nbd_socket")
            .to_string();
        format!("nbd+unix:///{volume}?socket={sock}")
    }

    /// Sum of a metric's samples on node `node`'s /metrics.
    pub fn metric(&self, node: u32, name: &str) -> u64 {
        let api = self.lab_json()["nodes"][node as usize - 1]["api"]
            .as_str()
            .expect("api")
            .trim_start_matches("https://")
            .to_string();
        http_get(self, &api, "/metrics", Some(&self.token()))
            .lines()
            .filter(|l| {
                l.strip_prefix(name)
                    .is_some_and(|r| r.starts_with(' ') || r.starts_with('{'))
            })
            .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap() as u64)
            .sum()
    }

    /// Sum of a metric's samples whose labels contain `label` (e.g. `tier="capacity"`).
    pub fn metric_where(&self, node: u32, name: &str, label: &str) -> f64 {
        let api = self.lab_json()["nodes"][node as usize - 1]["api"]
            .as_str()
            .expect("api")
            .trim_start_matches("https://")
            .to_string();
        http_get(self, &api, "/metrics", Some(&self.token()))
            .lines()
            .filter(|l| {
                l.strip_prefix(name)
                    .is_some_and(|r| r.starts_with('{') && r.contains(label))
            })
            .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
            .sum()
    }

    /// Polls `f` every 500 ms until it is true; panics with `what` and the logs after
    /// `timeout` (a generous bound, not a timing assertion).
    pub fn wait_for(&self, what: &str, timeout: std::time::Duration, mut f: impl FnMut() -> bool) {
        let end = std::time::Instant::now() + timeout;
        while !f() {
            if std::time::Instant::now() > end {
                panic!("gave up waiting for {what}\n{}", self.logs());
            }
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
    }

    /// Extents of `volume` as (slab, node, state).
    pub fn extents(&self, volume: &str) -> Vec<(u64, u64, String)> {
        let v = self.json(&["volume", "show", volume]);
        let mut out = Vec::new();
        for s in v["slabs"].as_array().expect("slabs") {
            for e in s["extents"].as_array().expect("extents") {
                out.push((
                    s["index"].as_u64().unwrap(),
                    e["node"].as_u64().unwrap(),
                    e["state"].as_str().unwrap().to_string(),
                ));
            }
        }
        out
    }
}

/// `GET path` from the API at `hostport` with `token` (if any); the raw answer.
pub fn http_get(lab: &Lab, hostport: &str, path: &str, token: Option<&str>) -> String {
    use std::io::Write;
    let mut s = tls_connect(lab, hostport);
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = Vec::new();
    read_until_closed(&mut s, &mut out).unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

/// A TLS connection to a lab node's API (`host:port`), checked against the lab's CA.
pub fn tls_connect(
    lab: &Lab,
    hostport: &str,
) -> rustls::StreamOwned<rustls::ClientConnection, std::net::TcpStream> {
    let pem = std::fs::read(lab.path().join("pki/ca.crt")).unwrap();
    let cfg = converge_pki::client_config(&pem).unwrap();
    let host = hostport.rsplit_once(':').unwrap().0.to_string();
    let name = rustls::pki_types::ServerName::try_from(host).unwrap();
    let conn = rustls::ClientConnection::new(cfg, name).unwrap();
    let tcp = std::net::TcpStream::connect(hostport).unwrap();
    tcp.set_read_timeout(Some(std::time::Duration::from_secs(120)))
        .unwrap();
    rustls::StreamOwned::new(conn, tcp)
}

/// Reads until the peer closes. A TLS peer that closes without a close_notify alert has
/// still closed (hyper drops a timed-out connection that way).
pub fn read_until_closed(r: &mut impl std::io::Read, out: &mut Vec<u8>) -> std::io::Result<()> {
    match r.read_to_end(out) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(()),
        Err(e) => Err(e),
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        // A failed test keeps the lab's logs (not its drives) for the post-mortem.
        if std::thread::panicking() {
            let name = self
                .path()
                .file_name()
                .unwrap()
                .to_string_lossy()
                .into_owned();
            let keep = Path::new("/tmp/converge-failed").join(name);
            let _ = std::fs::create_dir_all(&keep);
            let _ = std::fs::copy(self.path().join("lab.json"), keep.join("lab.json"));
            let _ = std::fs::copy(self.path().join("etcd.log"), keep.join("etcd.log"));
            for i in 1..=8 {
                let _ = std::fs::copy(
                    self.path().join(format!("node{i}/converged.log")),
                    keep.join(format!("node{i}.log")),
                );
            }
            eprintln!("the lab's logs are kept in {}", keep.display());
        }
        let _ = run(&mut self.cmd(&["lab", "down", "--purge"]));
    }
}

/// A file of `len` random bytes (seeded) in `dir`.
pub fn random_file(dir: &Path, name: &str, len: usize, seed: u64) -> PathBuf {
    use rand::{RngCore, SeedableRng};
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    let mut v = vec![0u8; len];
    r.fill_bytes(&mut v);
    let p = dir.join(name);
    std::fs::write(&p, v).expect("write random file");
    p
}

/// Runs a Python script that uses libnbd (Debian's module loads under /usr/bin/python3, not
/// the first python3 on PATH) with `uri` as its argument; its output, which must end with
/// "ok".
pub fn nbd_script(script: &str, uri: &str) -> String {
    let out = must(
        Command::new("/usr/bin/python3")
            .arg("-c")
            .arg(script)
            .arg(uri),
    );
    assert!(out.trim_end().ends_with("ok"), "{out}");
    out
}

/// fio against an NBD URI; returns fio's JSON output.
pub fn fio(uri: &str, args: &[&str]) -> serde_json::Value {
    let mut c = Command::new("fio");
    c.arg("--name=t")
        .arg("--ioengine=nbd")
        .arg(format!("--uri={uri}"))
        .arg("--output-format=json")
        .arg("--verify_state_save=0")
        .args(args);
    let out = must(&mut c);
    // fio may print warnings before the JSON.
    let start = out.find('{').expect("fio JSON output");
    serde_json::from_str(&out[start..]).expect("fio JSON parses")
}

pub fn fio_errors(v: &serde_json::Value) -> u64 {
    v["jobs"]
        .as_array()
        .expect("jobs")
        .iter()
        .map(|j| j["error"].as_u64().unwrap_or(0))
        .sum()
}

/// Writes `volume` (64 MiB) with blocks that each start with a unique marker, then flips
/// a bit in the blocks numbered `blocks` of node `node`'s copy (found by marker in its
/// drive files). Returns the image written and each flip as (drive file, offset, the
/// block's fill byte).
pub fn write_marked_and_flip(
    lab: &Lab,
    volume: &str,
    dir: &Path,
    node: u32,
    blocks: std::ops::Range<u32>,
) -> (PathBuf, Vec<(String, usize, u8)>) {
    let mut data = Vec::with_capacity(64 << 20);
    for b in 0..(64u32 << 20) / 4096 {
        let mut blk = vec![(b % 251) as u8; 4096];
        let m = format!("CVMARK{b:08}");
        blk[..m.len()].copy_from_slice(m.as_bytes());
        data.extend_from_slice(&blk);
    }
    let src = dir.join(format!("{volume}.img"));
    std::fs::write(&src, &data).unwrap();
    must(Command::new("nbdcopy").arg(&src).arg(lab.uri(volume)));
    let drives: Vec<String> = lab.lab_json()["nodes"][node as usize - 1]["drives"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_str().unwrap().to_string())
        .collect();
    let mut flipped = Vec::new();
    for path in &drives {
        let img = std::fs::read(path).unwrap();
        for pos in (0..img.len()).step_by(4096) {
            if img[pos..].starts_with(b"CVMARK") {
                let b: u32 = std::str::from_utf8(&img[pos + 6..pos + 14])
                    .unwrap()
                    .parse()
                    .unwrap();
                if blocks.contains(&b) {
                    flipped.push((path.clone(), pos + 2000, (b % 251) as u8));
                }
            }
        }
    }
    for (path, off, _) in &flipped {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        let mut byte = [0u8; 1];
        f.read_exact_at(&mut byte, *off as u64).unwrap();
        byte[0] ^= 0x40;
        f.write_all_at(&byte, *off as u64).unwrap();
        f.sync_all().unwrap();
    }
    (src, flipped)
}

/// fio arguments `job` as a crc32c-verified pass: writing and verifying (`only` false), or
/// reading back and verifying what an earlier pass of the same job wrote (`only` true).
pub fn verify_pass<'a>(job: &[&'a str], only: bool) -> Vec<&'a str> {
    let mut a = job.to_vec();
    a.extend(["--verify=crc32c", "--verify_fatal=1"]);
    a.push(if only {
        "--verify_only"
    } else {
        "--do_verify=1"
    });
    a
}

/// qemu-img compare of a volume against the image it should hold.
pub fn compare(uri: &str, expected: &std::path::Path, what: &str) {
    let o = run(Command::new("qemu-img").args([
        "compare",
        "-f",
        "raw",
        "-F",
        "raw",
        &expected.display().to_string(),
        uri,
    ]));
    assert!(
        o.status.success(),
        "{what}: data differs: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Every copy of `vol` is in sync.
pub fn all_in_sync(lab: &Lab, vol: &str) -> bool {
    lab.extents(vol).iter().all(|(_, _, s)| s == "in-sync")
}

/// Scrub with repair off: every copy must agree and have good checksums.
pub fn assert_copies_agree(lab: &Lab, vol: &str) {
    let r = lab.json(&["scrub", "start", vol, "--wait", "--no-repair"]);
    let r = &r[0];
    assert!(r["blocks_checked"].as_u64().unwrap() > 0, "{r}");
    assert_eq!(r["bad_checksums"], 0, "{r}");
    assert_eq!(r["mismatches"], 0, "copies disagree: {r}\n{}", lab.logs());
    assert!(r["error"].is_null(), "{r}");
}

/// The read-only export of snapshot `snap` of `vol`, as `snapshot list` prints it.
pub fn snap_uri(lab: &Lab, vol: &str, snap: &str) -> String {
    let v = lab.json(&["volume", "snapshot", "list", vol]);
    v.as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == snap)
        .unwrap_or_else(|| panic!("snapshot {snap} listed: {v}"))["uri"]
        .as_str()
        .unwrap()
        .to_string()
}

/// The volume's slabs as (index text, copies or chunks), from `volume show`.
pub fn slab_layout(lab: &Lab, vol: &str) -> Vec<(String, usize)> {
    let v = lab.json(&["volume", "show", vol]);
    v["slabs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let idx = converge_types::SlabIndex(s["index"].as_u64().unwrap());
            (idx.to_string(), s["extents"].as_array().unwrap().len())
        })
        .collect()
}
