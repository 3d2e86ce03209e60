//! End-to-end tests with real NBD clients (libnbd's nbdinfo/nbdcopy, qemu-img, fio) against
//! a RAM export served on a unix socket, and over TCP with TLS (`nbds://`, qemu's
//! tls-creds-x509) using a throwaway CA. A missing client binary skips loudly. The clients
//! negotiate structured replies and `base:allocation`, so `nbdinfo --map` and
//! `qemu-img map` show the export's holes and zeroes, or a `qemu:dirty-bitmap:NAME`
//! context, so they show what changed since a snapshot.

mod pki;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use converge_nbd::testing::{MemDev, MemResolver};
use converge_nbd::{
    serve_tcp, serve_unix, BlockDev, ResolveError, ServerConfig, STATE_DIRTY, STATE_HOLE,
    STATE_ZERO,
};
use pki::Pki;
use rand::{RngCore, SeedableRng};
use tokio::process::Command;

const SIZE: usize = 16 << 20;

struct Served {
    dir: tempfile::TempDir,
    socket: PathBuf,
    dev: Arc<MemDev>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Served {
    fn uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.socket.display())
    }
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.server.abort();
    }
}

fn serve() -> Served {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("nbd.sock");
    let listener = tokio::net::UnixListener::bind(&socket).expect("bind");
    let dev = Arc::new(MemDev::new(SIZE).with_description("converge test export"));
    let resolver = MemResolver::new()
        .with_export("vm01", Arc::clone(&dev))
        .with_export("scratch", Arc::new(MemDev::new(1 << 20)))
        .with_refusal(
            "vm02",
            ResolveError::Elsewhere {
                owner: "node 2 (127.0.0.2)".to_owned(),
            },
        );
    let server = tokio::spawn(serve_unix(
        listener,
        Arc::new(resolver),
        ServerConfig::default(),
    ));
    Served {
        dir,
        socket,
        dev,
        server,
    }
}

fn have(bin: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).any(|d| d.join(bin).is_file())
}

macro_rules! require {
    ($($bin:literal),+) => {
        $(if !have($bin) {
            eprintln!("\n!!!!!!!! SKIPPING {}: `{}` is not installed !!!!!!!!\n", module_path!(), $bin);
            return;
        })+
    };
}

async fn run(cmd: &mut Command) -> Output {
    let fut = cmd.kill_on_drop(true).output();
    let out = tokio::time::timeout(Duration::from_secs(180), fut)
        .await
        .expect("client timed out")
        .expect("spawn client");
    eprintln!(
        "--- {:?}: {}\n{}{}",
        cmd.as_std().get_program(),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn random_file(path: &Path, len: usize, seed: u64) -> Vec<u8> {
    let mut data = vec![0u8; len];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut data);
    std::fs::write(path, &data).expect("write image");
    data
}

/// `"key": value` from nbdinfo's JSON (flat per-export object).
fn json_field<'a>(json: &'a str, key: &str) -> Option<&'a str> {
    let pat = format!("\"{key}\": ");
    let start = json.find(&pat)? + pat.len();
    let rest = &json[start..];
    let end = rest.find([',', '\n', '}']).unwrap_or(rest.len());
    Some(rest[..end].trim())
}

/// Every `{ … }` object of a client's JSON list that is printed one object per line.
fn json_objects(json: &str) -> Vec<&str> {
    json.split('{').skip(1).collect()
}

fn json_u64(obj: &str, key: &str) -> u64 {
    json_field(obj, key)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no number {key} in {obj}"))
}

/// Runs of (offset, length, NBD_STATE_* flags).
type Layout = Vec<(u64, u64, u32)>;

const MIB: u64 = 1 << 20;
const HZ: u32 = STATE_HOLE | STATE_ZERO;

/// Gives `dev` (SIZE bytes, all holes when new) a known allocation layout through the
/// device itself, and returns the runs that describe the whole export.
async fn lay_out(dev: &MemDev) -> Layout {
    let data = Bytes::from(vec![0x5a; 4 * MIB as usize]);
    dev.write(MIB, data.slice(..64 << 10), false)
        .await
        .expect("write");
    dev.write_zeroes(4 * MIB, MIB as u32, false)
        .await
        .expect("zero");
    dev.write(8 * MIB, data, false).await.expect("write");
    dev.trim(9 * MIB, MIB as u32).await.expect("trim");
    let layout = vec![
        (0, MIB, HZ),
        (MIB, 64 << 10, 0),
        (MIB + (64 << 10), 3 * MIB - (64 << 10), HZ),
        (4 * MIB, MIB, STATE_ZERO),
        (5 * MIB, 3 * MIB, HZ),
        (8 * MIB, MIB, 0),
        (9 * MIB, MIB, HZ),
        (10 * MIB, 2 * MIB, 0),
        (12 * MIB, 4 * MIB, HZ),
    ];
    assert_eq!(layout.iter().map(|r| r.1).sum::<u64>(), SIZE as u64);
    layout
}

/// `nbdinfo --map --json` output as runs: `"type"` is the NBD_STATE_* flags.
fn nbdinfo_layout(json: &str) -> Layout {
    json_objects(json)
        .into_iter()
        .map(|o| {
            let flags = u32::try_from(json_u64(o, "type")).expect("flags fit u32");
            (json_u64(o, "offset"), json_u64(o, "length"), flags)
        })
        .collect()
}

/// `qemu-img map --output=json` output as runs: qemu says `"zero"` for NBD_STATE_ZERO and
/// `"data": false` for NBD_STATE_HOLE (it reports holes only where they also read as
/// zeroes, which is all a hole means to it).
fn qemu_layout(json: &str) -> Layout {
    json_objects(json)
        .into_iter()
        .map(|o| {
            let is = |key| match json_field(o, key) {
                Some("true") => true,
                Some("false") => false,
                other => panic!("{key} is {other:?} in {o}"),
            };
            let mut flags = 0;
            if is("zero") {
                flags |= STATE_ZERO;
            }
            if !is("data") {
                flags |= STATE_HOLE;
            }
            (json_u64(o, "start"), json_u64(o, "length"), flags)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdinfo_map_shows_holes_zeroes_and_data() {
    require!("nbdinfo");
    let s = serve();
    // A fresh export is one hole that reads as zeroes.
    let out = run(Command::new("nbdinfo")
        .args(["--map", "--json"])
        .arg(s.uri("vm01")))
    .await;
    assert!(out.status.success());
    assert_eq!(
        nbdinfo_layout(&String::from_utf8_lossy(&out.stdout)),
        vec![(0, SIZE as u64, HZ)]
    );
    let want = lay_out(&s.dev).await;
    let out = run(Command::new("nbdinfo")
        .args(["--map", "--json"])
        .arg(s.uri("vm01")))
    .await;
    assert!(out.status.success());
    assert_eq!(nbdinfo_layout(&String::from_utf8_lossy(&out.stdout)), want);
    // A device that answers one run at a time: libnbd asks again from where each answer
    // ended, and the map comes out the same.
    s.dev.set_extents_max(1);
    let out = run(Command::new("nbdinfo")
        .args(["--map", "--json"])
        .arg(s.uri("vm01")))
    .await;
    assert!(out.status.success());
    assert_eq!(nbdinfo_layout(&String::from_utf8_lossy(&out.stdout)), want);
    // The totals agree with the layout: bytes per type.
    let out = run(Command::new("nbdinfo")
        .args(["--map", "--totals"])
        .arg(s.uri("vm01")))
    .await;
    assert!(out.status.success());
    let mut totals: Vec<(u64, u32)> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            // "   3211264  19.1%   0 data"
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[0].parse().expect("bytes"), f[2].parse().expect("type"))
        })
        .collect();
    totals.sort_by_key(|t| t.1);
    let total = |flags| want.iter().filter(|r| r.2 == flags).map(|r| r.1).sum();
    assert_eq!(
        totals,
        vec![
            (total(0), 0),
            (total(STATE_ZERO), STATE_ZERO),
            (total(HZ), HZ)
        ]
    );
    assert_eq!(total(0), 3 * MIB + (64 << 10));
}

/// `nbdinfo --json` output's `"contexts"` list, names unquoted.
fn nbdinfo_contexts(json: &str) -> Option<Vec<String>> {
    json.split_once("\"contexts\": [")
        .and_then(|(_, rest)| rest.split_once(']'))
        .map(|(list, _)| {
            list.split(',')
                .map(|c| c.trim().trim_matches('"').to_owned())
                .filter(|c| !c.is_empty())
                .collect()
        })
}

/// Incremental backup's question, asked by libnbd: which blocks changed since a snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdinfo_map_shows_a_dirty_bitmap() {
    require!("nbdinfo");
    let s = serve();
    const DIRTY: u32 = STATE_DIRTY;
    s.dev
        .set_dirty_bitmap("snap1", vec![(8 * MIB, 2 * MIB), (MIB, 64 << 10)]);
    s.dev.set_dirty_bitmap("snap2", vec![]);
    // nbdinfo lists every context the export offers.
    let out = run(Command::new("nbdinfo").arg("--json").arg(s.uri("vm01"))).await;
    assert!(out.status.success());
    let json = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        nbdinfo_contexts(&json),
        Some(vec![
            "base:allocation".to_owned(),
            "qemu:dirty-bitmap:snap1".to_owned(),
            "qemu:dirty-bitmap:snap2".to_owned()
        ]),
        "{json}"
    );
    let want = vec![
        (0, MIB, 0),
        (MIB, 64 << 10, DIRTY),
        (MIB + (64 << 10), 7 * MIB - (64 << 10), 0),
        (8 * MIB, 2 * MIB, DIRTY),
        (10 * MIB, 6 * MIB, 0),
    ];
    let map = |context: &str| {
        let mut cmd = Command::new("nbdinfo");
        cmd.arg(format!("--map={context}"))
            .arg("--json")
            .arg(s.uri("vm01"));
        cmd
    };
    let out = run(&mut map("qemu:dirty-bitmap:snap1")).await;
    assert!(out.status.success());
    assert_eq!(nbdinfo_layout(&String::from_utf8_lossy(&out.stdout)), want);
    // One run per answer: libnbd asks again from where each ended; same map.
    s.dev.set_extents_max(1);
    let out = run(&mut map("qemu:dirty-bitmap:snap1")).await;
    assert!(out.status.success());
    assert_eq!(nbdinfo_layout(&String::from_utf8_lossy(&out.stdout)), want);
    let out = run(&mut map("qemu:dirty-bitmap:snap2")).await;
    assert!(out.status.success());
    assert_eq!(
        nbdinfo_layout(&String::from_utf8_lossy(&out.stdout)),
        vec![(0, SIZE as u64, 0)]
    );
    // A bitmap the export does not offer is not negotiated: nbdinfo fails.
    let out = run(&mut map("qemu:dirty-bitmap:nope")).await;
    assert!(!out.status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_img_map_shows_holes_zeroes_and_data() {
    require!("qemu-img");
    let s = serve();
    let want = lay_out(&s.dev).await;
    let out = run(Command::new("qemu-img")
        .args(["map", "--output=json", "-f", "raw"])
        .arg(s.uri("vm01")))
    .await;
    assert!(out.status.success());
    assert_eq!(qemu_layout(&String::from_utf8_lossy(&out.stdout)), want);
    // Answers of a prefix only: qemu asks again and merges the same map.
    s.dev.set_extents_max(2);
    let out = run(Command::new("qemu-img")
        .args(["map", "--output=json", "-f", "raw"])
        .arg(s.uri("vm01")))
    .await;
    assert!(out.status.success());
    assert_eq!(qemu_layout(&String::from_utf8_lossy(&out.stdout)), want);
}

/// qemu's way to read a dirty bitmap for incremental backup (`x-dirty-bitmap`, as
/// qemu-iotests 223 does): the client negotiates that context in place of
/// `base:allocation` and reports dirty runs as `"data": false` (bit 0 read as a hole).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_img_map_reads_a_dirty_bitmap() {
    require!("qemu-img");
    let s = serve();
    s.dev
        .set_dirty_bitmap("snap1", vec![(MIB, 64 << 10), (8 * MIB, 2 * MIB)]);
    let opts = format!(
        "driver=nbd,server.type=unix,server.path={},export=vm01,\
         x-dirty-bitmap=qemu:dirty-bitmap:snap1",
        s.socket.display()
    );
    let out = run(Command::new("qemu-img")
        .args(["map", "--output=json", "--image-opts"])
        .arg(&opts))
    .await;
    assert!(out.status.success());
    // qemu_layout's STATE_HOLE (data: false) is the dirty bit.
    assert_eq!(
        qemu_layout(&String::from_utf8_lossy(&out.stdout)),
        vec![
            (0, MIB, 0),
            (MIB, 64 << 10, STATE_DIRTY),
            (MIB + (64 << 10), 7 * MIB - (64 << 10), 0),
            (8 * MIB, 2 * MIB, STATE_DIRTY),
            (10 * MIB, 6 * MIB, 0),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdinfo_reports_size_block_sizes_and_flags() {
    require!("nbdinfo");
    let s = serve();
    let out = run(Command::new("nbdinfo").arg("--json").arg(s.uri("vm01"))).await;
    assert!(out.status.success());
    let json = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        json_field(&json, "export-size"),
        Some(SIZE.to_string().as_str())
    );
    assert_eq!(json_field(&json, "block_size_minimum"), Some("4096"));
    assert_eq!(json_field(&json, "block_size_preferred"), Some("4096"));
    assert_eq!(json_field(&json, "block_size_maximum"), Some("33554432"));
    for flag in [
        "can_df",
        "can_flush",
        "can_fua",
        "can_multi_conn",
        "can_trim",
        "can_zero",
    ] {
        assert_eq!(json_field(&json, flag), Some("true"), "{flag}");
    }
    assert_eq!(json_field(&json, "structured"), Some("true"), "{json}");
    let contexts = json
        .split_once("\"contexts\": [")
        .and_then(|(_, rest)| rest.split_once(']'))
        .map(|(list, _)| list.split_whitespace().collect::<Vec<_>>());
    assert_eq!(contexts, Some(vec!["\"base:allocation\""]), "{json}");
    // `--can df` answers with its exit status: 0 for true, 2 for false.
    let out = run(Command::new("nbdinfo")
        .args(["--can", "df"])
        .arg(s.uri("vm01")))
    .await;
    assert_eq!(out.status.code(), Some(0), "can_df");
    let out = run(Command::new("nbdinfo")
        .args(["--can", "fast-zero"])
        .arg(s.uri("vm01")))
    .await;
    assert_eq!(out.status.code(), Some(2), "--can must be able to say no");
    assert_eq!(json_field(&json, "is_read_only"), Some("false"));
    assert_eq!(
        json_field(&json, "description"),
        Some("\"converge test export\"")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdinfo_lists_exports() {
    require!("nbdinfo");
    let s = serve();
    let uri = format!("nbd+unix://?socket={}", s.socket.display());
    let out = run(Command::new("nbdinfo").arg("--list").arg("--json").arg(uri)).await;
    assert!(out.status.success());
    let json = String::from_utf8_lossy(&out.stdout);
    assert!(json.contains("\"export-name\": \"vm01\""), "{json}");
    assert!(json.contains("\"export-name\": \"scratch\""), "{json}");
    assert!(!json.contains("vm02"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdcopy_in_and_out_then_qemu_img_compare() {
    require!("nbdcopy", "qemu-img");
    let s = serve();
    let input = s.path("in.img");
    let data = random_file(&input, SIZE, 0x5eed);
    let out = run(Command::new("nbdcopy").arg(&input).arg(s.uri("vm01"))).await;
    assert!(out.status.success());
    assert!(
        s.dev.contents() == data,
        "device contents differ after nbdcopy in"
    );

    let output = s.path("out.img");
    let out = run(Command::new("nbdcopy").arg(s.uri("vm01")).arg(&output)).await;
    assert!(out.status.success());
    assert!(std::fs::read(&output).expect("read out.img") == data);

    let compare = |img: PathBuf| {
        let mut c = Command::new("qemu-img");
        c.args(["compare", "-f", "raw", "-F", "raw"])
            .arg(img)
            .arg(s.uri("vm01"));
        c
    };
    let out = run(&mut compare(input.clone())).await;
    assert_eq!(
        out.status.code(),
        Some(0),
        "qemu-img compare found differences"
    );
    // The comparison must be able to fail: one flipped byte is a difference.
    let mut changed = data;
    changed[SIZE / 2 + 17] ^= 0x40;
    let other = s.path("changed.img");
    std::fs::write(&other, &changed).expect("write");
    let out = run(&mut compare(other)).await;
    assert_eq!(
        out.status.code(),
        Some(1),
        "qemu-img compare missed a difference"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_img_convert_and_refusal_message() {
    require!("qemu-img");
    let s = serve();
    let input = s.path("in.img");
    let data = random_file(&input, SIZE, 7);
    let out = run(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&input)
        .arg(s.uri("vm01")))
    .await;
    assert!(out.status.success());
    assert!(s.dev.contents() == data);
    let out = run(Command::new("qemu-img").arg("info").arg(s.uri("vm02"))).await;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("volume vm02 is owned by node 2 (127.0.0.2); connect there"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fio_randwrite_verify_crc32c_over_two_connections() {
    require!("fio");
    let s = serve();
    let out = run(Command::new("fio")
        .current_dir(s.dir.path())
        .args([
            "--name=converge-nbd",
            "--ioengine=nbd",
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--numjobs=2",
            "--size=8m",
            "--offset_increment=8m",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--do_verify=1",
            "--group_reporting",
        ])
        .arg(format!("--uri={}", s.uri("vm01"))))
    .await;
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("err= 0"), "{stdout}");
    assert!(!stdout.contains("verify:"), "{stdout}");
    // Both halves of the device were written (one connection each).
    let contents = s.dev.contents();
    assert!(contents[..SIZE / 2].iter().any(|&b| b != 0));
    assert!(contents[SIZE / 2..].iter().any(|&b| b != 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_listener_serves_nbdcopy() {
    require!("nbdcopy");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind tcp");
    let port = listener.local_addr().expect("local addr").port();
    let dev = Arc::new(MemDev::new(1 << 20));
    let resolver = MemResolver::new().with_export("vm01", Arc::clone(&dev));
    let server = tokio::spawn(converge_nbd::serve_tcp(
        listener,
        Arc::new(resolver),
        ServerConfig::default(),
    ));
    let dir = tempfile::tempdir().expect("tempdir");
    let input = dir.path().join("in.img");
    let data = random_file(&input, 1 << 20, 11);
    let out = run(Command::new("nbdcopy")
        .arg(&input)
        .arg(format!("nbd://127.0.0.1:{port}/vm01")))
    .await;
    server.abort();
    assert!(out.status.success());
    assert!(dev.contents() == data);
}

/// A RAM export on TCP with TLS required; `mutual`: clients need a certificate.
struct TlsServed {
    dir: tempfile::TempDir,
    port: u16,
    pki: Pki,
    dev: Arc<MemDev>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Drop for TlsServed {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn serve_tls(mutual: bool) -> TlsServed {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind tcp");
    let port = listener.local_addr().expect("local addr").port();
    let pki = Pki::new("clients");
    let dev = Arc::new(MemDev::new(SIZE));
    let resolver = MemResolver::new().with_export("vm01", Arc::clone(&dev));
    let cfg = ServerConfig {
        tls: Some(pki.server_config(mutual)),
        ..ServerConfig::default()
    };
    let server = tokio::spawn(serve_tcp(listener, Arc::new(resolver), cfg));
    TlsServed {
        dir: tempfile::tempdir().expect("tempdir"),
        port,
        pki,
        dev,
        server,
    }
}

impl TlsServed {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// A client certificate directory named `name` trusting this server's CA, with this
    /// CA's client certificate if `with_cert`.
    fn certs(&self, name: &str, with_cert: bool) -> PathBuf {
        let dir = self.path(name);
        self.pki.write_client_dir(&dir, with_cert);
        dir
    }

    /// libnbd's URI for TLS (required, peer verified) with the certificates in `certs`.
    fn nbds_uri(&self, certs: &Path) -> String {
        format!(
            "nbds://127.0.0.1:{}/vm01?tls-certificates={}",
            self.port,
            certs.display()
        )
    }

    /// qemu's block options for the export over TLS with the `tls0` credentials object.
    fn qemu_image_opts(&self) -> String {
        format!(
            "driver=nbd,host=127.0.0.1,port={},export=vm01,tls-creds=tls0",
            self.port
        )
    }
}

fn qemu_tls_object(certs: &Path) -> String {
    format!(
        "tls-creds-x509,id=tls0,dir={},endpoint=client",
        certs.display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdinfo_over_tls_and_plaintext_or_untrusting_clients_refused() {
    require!("nbdinfo");
    let s = serve_tls(false).await;
    let certs = s.certs("certs", false);
    let out = run(Command::new("nbdinfo")
        .arg("--json")
        .arg(s.nbds_uri(&certs)))
    .await;
    assert!(out.status.success());
    let json = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        json_field(&json, "export-size"),
        Some(SIZE.to_string().as_str())
    );
    assert_eq!(json_field(&json, "TLS"), Some("true"), "{json}");

    // Plaintext is refused: every option gets TLS_REQD, so libnbd gives up.
    let plain = format!("nbd://127.0.0.1:{}/vm01", s.port);
    let out = run(Command::new("nbdinfo").env("LIBNBD_DEBUG", "1").arg(&plain)).await;
    assert!(!out.status.success(), "a plaintext client was served");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("TLS is required: send NBD_OPT_STARTTLS first"),
        "{err}"
    );
    if have("qemu-img") {
        let out = run(Command::new("qemu-img").arg("info").arg(&plain)).await;
        assert!(!out.status.success(), "a plaintext qemu-img was served");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("TLS is required"), "{err}");
    }

    // A client trusting another CA refuses the server's certificate.
    let stranger = s.path("stranger");
    Pki::new("stranger").write_client_dir(&stranger, false);
    let out = run(Command::new("nbdinfo").arg(s.nbds_uri(&stranger))).await;
    assert!(!out.status.success(), "a client with another CA connected");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("certificate verification"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdinfo_map_over_tls() {
    require!("nbdinfo");
    let s = serve_tls(false).await;
    let certs = s.certs("certs", false);
    let want = lay_out(&s.dev).await;
    let out = run(Command::new("nbdinfo")
        .args(["--map", "--json"])
        .arg(s.nbds_uri(&certs)))
    .await;
    assert!(out.status.success());
    assert_eq!(nbdinfo_layout(&String::from_utf8_lossy(&out.stdout)), want);
    let out = run(Command::new("nbdinfo")
        .arg("--json")
        .arg(s.nbds_uri(&certs)))
    .await;
    assert!(out.status.success());
    let json = String::from_utf8_lossy(&out.stdout);
    assert_eq!(json_field(&json, "TLS"), Some("true"), "{json}");
    assert_eq!(json_field(&json, "structured"), Some("true"), "{json}");
    assert_eq!(json_field(&json, "can_df"), Some("true"), "{json}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdcopy_round_trip_over_mutual_tls() {
    require!("nbdcopy", "nbdinfo");
    let s = serve_tls(true).await;
    let certs = s.certs("certs", true);
    let input = s.path("in.img");
    let data = random_file(&input, SIZE, 0x7157);
    let out = run(Command::new("nbdcopy").arg(&input).arg(s.nbds_uri(&certs))).await;
    assert!(out.status.success());
    assert!(
        s.dev.contents() == data,
        "device contents differ after nbdcopy in"
    );
    let output = s.path("out.img");
    let out = run(Command::new("nbdcopy").arg(s.nbds_uri(&certs)).arg(&output)).await;
    assert!(out.status.success());
    assert!(std::fs::read(&output).expect("read out.img") == data);

    // Without a client certificate the server refuses the TLS handshake.
    let no_cert = s.certs("no-cert", false);
    let out = run(Command::new("nbdinfo").arg(s.nbds_uri(&no_cert))).await;
    assert!(
        !out.status.success(),
        "a client without a certificate connected"
    );
    // GnuTLS reports the server's alert that ended the handshake.
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("alert"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_img_info_convert_compare_over_mutual_tls() {
    require!("qemu-img");
    let s = serve_tls(true).await;
    let certs = s.certs("certs", true);
    let out = run(Command::new("qemu-img")
        .arg("info")
        .arg("--object")
        .arg(qemu_tls_object(&certs))
        .arg("--image-opts")
        .arg(s.qemu_image_opts()))
    .await;
    assert!(out.status.success());
    let info = String::from_utf8_lossy(&out.stdout);
    assert!(info.contains(&format!("({SIZE} bytes)")), "{info}");

    let input = s.path("in.img");
    let data = random_file(&input, SIZE, 0x9e1);
    let out = run(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "--object"])
        .arg(qemu_tls_object(&certs))
        .arg(&input)
        .arg("--target-image-opts")
        .arg(s.qemu_image_opts()))
    .await;
    assert!(out.status.success());
    assert!(
        s.dev.contents() == data,
        "device contents differ after qemu-img convert"
    );

    let compare = |img: &Path| {
        let mut c = Command::new("qemu-img");
        c.args(["compare", "--object"])
            .arg(qemu_tls_object(&certs))
            .arg("--image-opts")
            .arg(format!("driver=raw,file.filename={}", img.display()))
            .arg(s.qemu_image_opts());
        c
    };
    let out = run(&mut compare(&input)).await;
    assert_eq!(
        out.status.code(),
        Some(0),
        "qemu-img compare found differences"
    );
    let mut changed = data;
    changed[SIZE / 3 + 5] ^= 0x01;
    let other = s.path("changed.img");
    std::fs::write(&other, &changed).expect("write");
    let out = run(&mut compare(&other)).await;
    assert_eq!(
        out.status.code(),
        Some(1),
        "qemu-img compare missed a difference"
    );
}
