//! `converge lab`: a whole cluster on one machine — a local etcd and N `converged` on
//! 127.0.0.x with file-backed drives — for demos, tests and the fleet on a laptop.
//!
//! Everything the lab starts is recorded in `DIR/lab.json` (PID and command line), and
//! `lab down` stops exactly those processes, checking each PID still runs what we started.

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::fs;
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LabProc {
    pub name: String,
    pub pid: i32,
    /// A string that must appear in /proc/PID/cmdline for the PID to still be ours.
    pub marker: String,
    pub log: PathBuf,
    pub addr: String,
    /// Program and arguments, to start it again.
    pub argv: Vec<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LabNode {
    pub id: u32,
    pub config: PathBuf,
    pub api: String,
    pub rpc: String,
    pub nbd_socket: PathBuf,
    pub drives: Vec<PathBuf>,
    pub proc: LabProc,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Lab {
    pub dir: PathBuf,
    pub etcd_endpoint: String,
    pub etcd: LabProc,
    pub nodes: Vec<LabNode>,
    /// Drive files in RAM (`--ram`) live here, outside DIR.
    pub ram_dir: Option<PathBuf>,
}

pub struct UpOptions {
    pub dir: PathBuf,
    pub nodes: u32,
    pub drives_per_node: u32,
    pub drive_size: u64,
    pub ram: bool,
    pub slab_size: u64,
    pub timeout: Duration,
    pub repair_delay_s: u64,
}

pub fn default_dir() -> PathBuf {
    std::env::var_os("CONVERGE_LAB_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("converge-lab"))
}

fn lab_file(dir: &Path) -> PathBuf {
    dir.join("lab.json")
}

pub fn load(dir: &Path) -> Result<Lab> {
    let f = lab_file(dir);
    let text = fs::read_to_string(&f).with_context(|| {
        format!(
            "no lab in {}: start one with `converge lab up --dir {}`",
            dir.display(),
            dir.display()
        )
    })?;
    serde_json::from_str(&text).with_context(|| format!("{} is not a lab file", f.display()))
}

fn save(lab: &Lab) -> Result<()> {
    let tmp = lab.dir.join("lab.json.tmp");
    fs::write(&tmp, serde_json::to_vec_pretty(lab)?)?;
    fs::rename(&tmp, lab_file(&lab.dir))?;
    Ok(())
}

/// Is `pid` alive and still the process we started?
pub fn is_ours(p: &LabProc) -> bool {
    match fs::read(format!("/proc/{}/cmdline", p.pid)) {
        Ok(cmd) => {
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            // A zombie has an empty cmdline: not running.
            !cmd.is_empty() && cmd.contains(&p.marker)
        }
        Err(_) => false,
    }
}

/// Free TCP ports on `ip`, all held open together so they are distinct.
fn free_ports(ip: Ipv4Addr, n: usize) -> Result<Vec<u16>> {
    let ls: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind(SocketAddrV4::new(ip, 0)))
        .collect::<std::io::Result<_>>()
        .with_context(|| format!("cannot bind a port on {ip}"))?;
    ls.iter()
        .map(|l| Ok(l.local_addr()?.port()))
        .collect::<Result<Vec<u16>>>()
}

fn find_binary(name: &str) -> Result<PathBuf> {
    if let Ok(me) = std::env::current_exe() {
        if let Some(dir) = me.parent() {
            let p = dir.join(name);
            if p.exists() {
                return Ok(p);
            }
        }
    }
    for dir in std::env::var("PATH").unwrap_or_default().split(':') {
        let p = Path::new(dir).join(name);
        if p.exists() {
            return Ok(p);
        }
    }
    bail!("cannot find `{name}` next to converge or on PATH (install etcd-server for etcd; build converge for converged)")
}

fn spawn(
    name: &str,
    cmd: &mut Command,
    log: &Path,
    marker: String,
    addr: String,
) -> Result<LabProc> {
    let argv: Vec<String> = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let out = fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(log)
        .with_context(|| format!("opening {}", log.display()))?;
    let err = out.try_clone()?;
    // Own process group: a Ctrl-C meant for the CLI must not take the lab down.
    let child = cmd
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting {name}"))?;
    let p = LabProc {
        name: name.to_string(),
        pid: child.id() as i32,
        marker,
        log: log.to_path_buf(),
        addr,
        argv,
    };
    // Until exec completes, /proc/PID/cmdline is still ours: wait for the exec (or exit).
    let mut child = child;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !is_ours(&p) {
        if let Ok(Some(status)) = child.try_wait() {
            bail!(
                "{name} exited at once ({status}); its log ({}) ends with:\n{}",
                log.display(),
                tail(log, 15)
            );
        }
        if Instant::now() > deadline {
            bail!("{name} did not start within 10 s");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(p)
}

/// Start a recorded process again with the same command line.
pub fn respawn(p: &mut LabProc) -> Result<()> {
    if is_ours(p) {
        bail!("{} is still running (pid {})", p.name, p.pid);
    }
    let (prog, args) = p
        .argv
        .split_first()
        .ok_or_else(|| anyhow!("no command recorded for {}", p.name))?;
    let mut cmd = Command::new(prog);
    cmd.args(args);
    if std::env::var_os("RUST_LOG").is_none() {
        cmd.env("RUST_LOG", "info");
    }
    let np = spawn(
        &p.name,
        &mut cmd,
        &p.log.clone(),
        p.marker.clone(),
        p.addr.clone(),
    )?;
    *p = np;
    Ok(())
}

/// Start every stopped process of a lab again (etcd first) and wait for health.
pub fn resume(dir: &Path, timeout: Duration) -> Result<Lab> {
    let mut lab = load(dir)?;
    if !is_ours(&lab.etcd) {
        respawn(&mut lab.etcd)?;
        save(&lab)?;
    }
    wait_etcd(&lab, timeout)?;
    for i in 0..lab.nodes.len() {
        if !is_ours(&lab.nodes[i].proc) {
            respawn(&mut lab.nodes[i].proc)?;
            save(&lab)?;
        }
    }
    wait_healthy(&lab, timeout)?;
    Ok(lab)
}

/// Start one node of the lab again.
pub fn restart_node(lab: &mut Lab, id: u32) -> Result<()> {
    let n = lab
        .nodes
        .iter_mut()
        .find(|n| n.id == id)
        .ok_or_else(|| anyhow!("the lab has no node {id}"))?;
    respawn(&mut n.proc)?;
    save(lab)
}

fn tail(path: &Path, lines: usize) -> String {
    let t = fs::read_to_string(path).unwrap_or_default();
    let v: Vec<&str> = t.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

pub fn up(o: &UpOptions) -> Result<Lab> {
    if o.nodes == 0 || o.nodes > 200 {
        bail!("--nodes must be between 1 and 200");
    }
    if o.drives_per_node == 0 || o.drives_per_node > 64 {
        bail!("--drives-per-node must be between 1 and 64");
    }
    if o.drive_size < 2 * o.slab_size + (64 << 20) {
        bail!(
            "--drive-size {} is too small: a drive needs room for at least two slabs of {} plus metadata",
            converge_types::format_size(o.drive_size),
            converge_types::format_size(o.slab_size)
        );
    }
    if let Ok(lab) = load(&o.dir) {
        if lab.nodes.iter().all(|n| is_ours(&n.proc)) && is_ours(&lab.etcd) {
            bail!(
                "a lab is already running in {} (see `converge lab ps --dir {}`; stop it with `converge lab down`)",
                o.dir.display(),
                o.dir.display()
            );
        }
        // A stopped (or partly stopped) lab: start what is down, keep its data.
        return resume(&o.dir, o.timeout);
    }
    fs::create_dir_all(&o.dir).with_context(|| format!("creating {}", o.dir.display()))?;
    let dir = fs::canonicalize(&o.dir)?;
    let etcd_bin = find_binary("etcd")?;
    let converged = find_binary("converged")?;

    // etcd on 127.0.0.1
    let ports = free_ports(Ipv4Addr::LOCALHOST, 2)?;
    let client = format!("http://127.0.0.1:{}", ports[0]);
    let peer = format!("http://127.0.0.1:{}", ports[1]);
    let etcd_dir = dir.join("etcd");
    let mut cmd = Command::new(&etcd_bin);
    cmd.arg("--name")
        .arg("converge-lab")
        .arg("--data-dir")
        .arg(&etcd_dir)
        .arg("--listen-client-urls")
        .arg(&client)
        .arg("--advertise-client-urls")
        .arg(&client)
        .arg("--listen-peer-urls")
        .arg(&peer)
        .arg("--initial-advertise-peer-urls")
        .arg(&peer)
        .arg("--initial-cluster")
        .arg(format!("converge-lab={peer}"))
        .arg("--log-level")
        .arg("warn");
    let etcd = spawn(
        "etcd",
        &mut cmd,
        &dir.join("etcd.log"),
        etcd_dir.display().to_string(),
        client.clone(),
    )?;
    let ram_dir = if o.ram {
        let d = PathBuf::from(format!(
            "/dev/shm/converge-lab-{:x}",
            fxhash(dir.display().to_string().as_bytes())
        ));
        fs::create_dir_all(&d)?;
        Some(d)
    } else {
        None
    };
    let mut lab = Lab {
        dir: dir.clone(),
        etcd_endpoint: client.clone(),
        etcd,
        nodes: Vec::new(),
        ram_dir: ram_dir.clone(),
    };
    save(&lab)?;
    wait_etcd(&lab, o.timeout)?;

    for id in 1..=o.nodes {
        let ip = Ipv4Addr::new(127, 0, 0, (id + 1) as u8);
        let ports = free_ports(ip, 2)?;
        let ndir = dir.join(format!("node{id}"));
        fs::create_dir_all(&ndir)?;
        let ddir = match &ram_dir {
            Some(r) => {
                let d = r.join(format!("node{id}"));
                fs::create_dir_all(&d)?;
                d
            }
            None => ndir.clone(),
        };
        let drives: Vec<PathBuf> = (1..=o.drives_per_node)
            .map(|j| ddir.join(format!("drive{j}.img")))
            .collect();
        let rpc = format!("{ip}:{}", ports[0]);
        let api = format!("{ip}:{}", ports[1]);
        let sock = ndir.join("nbd.sock");
        let config = ndir.join("converged.toml");
        let mut toml = format!(
            "# written by `converge lab up`\n[node]\nid = {id}\nname = \"node{id}\"\ncluster_name = \"lab\"\nslab_size = {}\n\n[network]\nrpc = \"{rpc}\"\napi = \"{api}\"\nnbd_socket = \"{}\"\n\n[etcd]\nendpoints = [\"{client}\"]\n",
            o.slab_size,
            sock.display()
        );
        for d in &drives {
            toml.push_str(&format!(
                "\n[[drive]]\npath = \"{}\"\nsize = {}\nrole = \"capacity\"\nmedia = \"{}\"\n",
                d.display(),
                o.drive_size,
                if o.ram { "ram" } else { "ssd" }
            ));
        }
        // Failure detection tuned for rehearsing failures on one machine: a dead node is
        // noticed in seconds, not minutes.
        toml.push_str(&format!(
            "\n[knobs]\nnode_lease_ttl_s = 6\nreplica_timeout_ms = 3000\nrepair_delay_s = {}\n",
            o.repair_delay_s
        ));
        fs::write(&config, toml)?;
        let mut cmd = Command::new(&converged);
        cmd.arg("--config").arg(&config);
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "info");
        }
        let proc = spawn(
            &format!("node{id}"),
            &mut cmd,
            &ndir.join("converged.log"),
            config.display().to_string(),
            format!("http://{api}"),
        )?;
        lab.nodes.push(LabNode {
            id,
            config,
            api: format!("http://{api}"),
            rpc,
            nbd_socket: sock,
            drives,
            proc,
        });
        save(&lab)?;
    }
    wait_healthy(&lab, o.timeout)?;
    Ok(lab)
}

fn fxhash(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf29ce484222325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100000001b3)
    })
}

fn wait_etcd(lab: &Lab, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(r) = crate::http::request(&lab.etcd_endpoint, "GET", "/health", None) {
            if r.status == 200 {
                return Ok(());
            }
        }
        if !is_ours(&lab.etcd) {
            bail!(
                "etcd exited during start-up; its log ({}) ends with:\n{}",
                lab.etcd.log.display(),
                tail(&lab.etcd.log, 15)
            );
        }
        if Instant::now() > deadline {
            bail!(
                "etcd did not become healthy at {} in time",
                lab.etcd_endpoint
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Wait until every node answers and sees every other node live.
pub fn wait_healthy(lab: &Lab, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let want = lab.nodes.len();
    for n in &lab.nodes {
        loop {
            if !is_ours(&n.proc) {
                bail!(
                    "node{} exited during start-up; its log ({}) ends with:\n{}",
                    n.id,
                    n.proc.log.display(),
                    tail(&n.proc.log, 15)
                );
            }
            let ok = crate::http::call::<converge_api::Status>(&n.api, "GET", "/v1/status", None)
                .map(|s| s.nodes.iter().filter(|x| x.live).count() >= want)
                .unwrap_or(false);
            if ok {
                break;
            }
            if Instant::now() > deadline {
                bail!(
                    "node{} did not become healthy in {:?}; its log ({}) ends with:\n{}",
                    n.id,
                    timeout,
                    n.proc.log.display(),
                    tail(&n.proc.log, 15)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    Ok(())
}

/// Wait until node `id` answers its API and sees itself live.
pub fn wait_node(lab: &Lab, id: u32, timeout: Duration) -> Result<()> {
    let n = lab
        .nodes
        .iter()
        .find(|n| n.id == id)
        .ok_or_else(|| anyhow!("the lab has no node {id}"))?;
    let deadline = Instant::now() + timeout;
    loop {
        if !is_ours(&n.proc) {
            bail!(
                "node{id} exited during start-up; its log ({}) ends with:\n{}",
                n.proc.log.display(),
                tail(&n.proc.log, 15)
            );
        }
        let ok = crate::http::call::<Vec<converge_api::NodeInfo>>(&n.api, "GET", "/v1/nodes", None)
            .map(|v| v.iter().any(|x| x.id.0 == id && x.live))
            .unwrap_or(false);
        if ok {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "node{id} did not become healthy in {timeout:?}; see {}",
                n.proc.log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Send `sig` and wait for the process to go; escalate to SIGKILL after `grace`.
pub fn stop_proc(p: &LabProc, grace: Duration) -> bool {
    if !is_ours(p) {
        return false;
    }
    // SAFETY: kill(2) with a PID we verified runs our command; no memory is touched.
    unsafe { libc::kill(p.pid, libc::SIGTERM) };
    let deadline = Instant::now() + grace;
    while is_ours(p) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    if is_ours(p) {
        // SAFETY: as above.
        unsafe { libc::kill(p.pid, libc::SIGKILL) };
        while is_ours(p) {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    true
}

/// kill -9, no grace: for failure tests.
pub fn kill_proc(p: &LabProc) -> bool {
    if !is_ours(p) {
        return false;
    }
    // SAFETY: kill(2) with a PID we verified runs our command.
    unsafe { libc::kill(p.pid, libc::SIGKILL) };
    while is_ours(p) {
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

pub fn down(dir: &Path, purge: bool) -> Result<Vec<String>> {
    let lab = load(dir)?;
    let mut stopped = Vec::new();
    for n in &lab.nodes {
        if stop_proc(&n.proc, Duration::from_secs(15)) {
            stopped.push(format!("{} (pid {})", n.proc.name, n.proc.pid));
        }
    }
    if stop_proc(&lab.etcd, Duration::from_secs(10)) {
        stopped.push(format!("etcd (pid {})", lab.etcd.pid));
    }
    if purge {
        if let Some(r) = &lab.ram_dir {
            let _ = fs::remove_dir_all(r);
        }
        fs::remove_dir_all(&lab.dir).with_context(|| format!("removing {}", lab.dir.display()))?;
    }
    Ok(stopped)
}
