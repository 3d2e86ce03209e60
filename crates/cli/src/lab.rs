//! `converge lab`: a whole cluster on one machine — a local etcd and N `converged` on
//! 127.0.0.x (or, with `--netns`, each in its own network namespace) with file-backed
//! drives — for demos, tests, rehearsing failures and the fleet on a laptop.
//!
//! Everything the lab starts is recorded in `DIR/lab.json` (PID and command line, and the
//! network namespaces, veths and bridge of a `--netns` lab), and `lab down` stops exactly
//! those processes, checking each PID still runs what we started, and deletes exactly
//! those links.

use crate::netns::LabNet;
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
    /// Network namespace it runs in (started as `ip netns exec NETNS argv...`; ip execs,
    /// so `pid` is the program's own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LabNode {
    pub id: u32,
    pub config: PathBuf,
    pub api: String,
    pub rpc: String,
    pub nbd_socket: PathBuf,
    /// NBD over TCP with mutual TLS (`nbds://ADDR/VOLUME`, with the lab's client
    /// certificate in `DIR/pki/client`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd_tcp: Option<String>,
    pub drives: Vec<PathBuf>,
    /// Cache drive files (`--cache-drives`), in RAM with `--cache-in-ram`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cache_drives: Vec<PathBuf>,
    pub proc: LabProc,
}

/// The drives every node of a lab got, as `lab up` was asked for them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LabDrives {
    pub capacity_per_node: u32,
    pub capacity_size_bytes: u64,
    pub capacity_media: String,
    pub cache_per_node: u32,
    pub cache_size_bytes: u64,
    pub cache_media: String,
    pub cache_in_ram: bool,
}

impl std::fmt::Display for LabDrives {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} capacity drive{} of {} ({})",
            self.capacity_per_node,
            if self.capacity_per_node == 1 { "" } else { "s" },
            converge_types::format_size(self.capacity_size_bytes),
            self.capacity_media
        )?;
        if self.cache_per_node == 0 {
            return f.write_str(", no cache drive");
        }
        write!(
            f,
            ", {} cache drive{} of {} ({}{})",
            self.cache_per_node,
            if self.cache_per_node == 1 { "" } else { "s" },
            converge_types::format_size(self.cache_size_bytes),
            self.cache_media,
            if self.cache_in_ram { ", in RAM" } else { "" }
        )
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Lab {
    pub dir: PathBuf,
    /// etcd's client URL: https, with client certificates (the lab's CA signs them).
    pub etcd_endpoint: String,
    /// etcd's plain-HTTP metrics URL, where `/health` answers without a certificate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd_health: Option<String>,
    pub etcd: LabProc,
    /// etcd members after the first (`--etcd-members`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub etcd_more: Vec<LabEtcdMember>,
    pub nodes: Vec<LabNode>,
    /// Drive files in RAM (`--ram`, `--cache-in-ram`) live here, outside DIR.
    pub ram_dir: Option<PathBuf>,
    /// What drives each node got (absent in labs from before cache drives).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drives: Option<LabDrives>,
    /// Network namespaces, veths and bridge of a `--netns` lab.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net: Option<LabNet>,
}

/// An etcd member of the lab after the first.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LabEtcdMember {
    pub proc: LabProc,
    /// Its client URL (https).
    pub endpoint: String,
    /// Its plain-HTTP metrics URL (`/health`).
    pub health: String,
}

impl Lab {
    /// Every etcd member's client URL, the first member's first.
    pub fn etcd_endpoints(&self) -> Vec<String> {
        std::iter::once(self.etcd_endpoint.clone())
            .chain(self.etcd_more.iter().map(|m| m.endpoint.clone()))
            .collect()
    }

    /// Every etcd member's process, the first member's first.
    pub fn etcd_procs(&self) -> Vec<&LabProc> {
        std::iter::once(&self.etcd)
            .chain(self.etcd_more.iter().map(|m| &m.proc))
            .collect()
    }

    fn etcd_health_urls(&self) -> Vec<(&LabProc, String)> {
        std::iter::once((
            &self.etcd,
            self.etcd_health
                .clone()
                .unwrap_or_else(|| self.etcd_endpoint.clone()),
        ))
        .chain(self.etcd_more.iter().map(|m| (&m.proc, m.health.clone())))
        .collect()
    }
}

pub struct UpOptions {
    pub dir: PathBuf,
    pub nodes: u32,
    pub drives_per_node: u32,
    pub drive_size: u64,
    pub ram: bool,
    /// Media written into the config for capacity drives (default ssd, ram with --ram).
    pub capacity_media: Option<String>,
    /// Rated endurance written into the config for capacity drives (`tbw`, bytes; default:
    /// none, the media's default rating).
    pub capacity_tbw: Option<u64>,
    /// Cache drives per node (0: no cache tier).
    pub cache_drives: u32,
    pub cache_size: Option<u64>,
    /// Cache drive files in /dev/shm (media ram unless --cache-media says otherwise).
    pub cache_in_ram: bool,
    pub cache_media: Option<String>,
    pub slab_size: u64,
    pub timeout: Duration,
    pub repair_delay_s: u64,
    /// Each node in its own network namespace (needed for partitions).
    pub netns: bool,
    /// Runtime threads per node; `None`: the machine's cores divided among the nodes.
    pub threads_per_node: Option<usize>,
    /// etcd members: 1, 3 or 5.
    pub etcd_members: u32,
    /// etcd's `--quota-backend-bytes`.
    pub etcd_quota_bytes: u64,
}

/// etcd's history kept by its own compaction (`--auto-compaction-retention`), as in
/// packaging/systemd/converge-etcd.service.
pub const ETCD_COMPACTION_RETENTION: &str = "10m";
/// Smallest etcd quota the lab starts: room for a lab's records and some history.
pub const ETCD_QUOTA_MIN: u64 = 1 << 20;

/// A lab node's share of the machine's cores (at least one): the lab stands for hosts of
/// their own, and nodes that each take every core only fight over them.
pub fn threads_per_node(nodes: u32) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / nodes.max(1) as usize).max(1)
}

/// Most cache drives per node the lab makes.
pub const CACHE_DRIVES_MAX: u32 = 8;
/// Smallest cache drive the lab makes: room for the log and its superblocks.
pub const CACHE_SIZE_MIN: u64 = 64 << 20;
/// Cache drive size when `--cache-drives` is given without `--cache-size`.
pub const CACHE_SIZE_DEFAULT: u64 = 1 << 30;

impl UpOptions {
    /// The drives each node gets, with the defaults filled in; refuses flags that do not
    /// fit together, before anything starts.
    pub fn lab_drives(&self) -> Result<LabDrives> {
        let capacity_media = match &self.capacity_media {
            Some(m) => m.clone(),
            None if self.ram => "ram".into(),
            None => "ssd".into(),
        };
        if self.cache_drives > CACHE_DRIVES_MAX {
            bail!(
                "--cache-drives {}: at most {CACHE_DRIVES_MAX} cache drives per node",
                self.cache_drives
            );
        }
        if self.cache_drives == 0 {
            let stray = [
                (self.cache_size.is_some(), "--cache-size"),
                (self.cache_in_ram, "--cache-in-ram"),
                (self.cache_media.is_some(), "--cache-media"),
            ];
            if let Some((_, flag)) = stray.iter().find(|(given, _)| *given) {
                bail!("{flag} needs --cache-drives N (1 to {CACHE_DRIVES_MAX}): the lab has no cache drives without it");
            }
        }
        let cache_size = self.cache_size.unwrap_or(CACHE_SIZE_DEFAULT);
        if self.cache_drives > 0 {
            if cache_size < CACHE_SIZE_MIN {
                bail!(
                    "--cache-size {} is too small: a cache drive needs at least {}",
                    converge_types::format_size(cache_size),
                    converge_types::format_size(CACHE_SIZE_MIN)
                );
            }
            if !cache_size.is_multiple_of(converge_types::BLOCK_SIZE as u64) {
                bail!(
                    "--cache-size {cache_size} bytes is not a multiple of {} bytes",
                    converge_types::BLOCK_SIZE
                );
            }
        }
        let cache_media = match &self.cache_media {
            Some(m) => m.clone(),
            None if self.cache_in_ram => "ram".into(),
            None => "nvme".into(),
        };
        Ok(LabDrives {
            capacity_per_node: self.drives_per_node,
            capacity_size_bytes: self.drive_size,
            capacity_media,
            cache_per_node: self.cache_drives,
            cache_size_bytes: if self.cache_drives > 0 { cache_size } else { 0 },
            cache_media,
            cache_in_ram: self.cache_in_ram && self.cache_drives > 0,
        })
    }
}

/// Bytes of RAM the lab's drive files in /dev/shm take once written.
fn ram_needed(d: &LabDrives, nodes: u32, ram: bool) -> u64 {
    let mut per_node = 0;
    if ram {
        per_node += d.capacity_per_node as u64 * d.capacity_size_bytes;
    }
    if d.cache_in_ram {
        per_node += d.cache_per_node as u64 * d.cache_size_bytes;
    }
    per_node * nodes as u64
}

/// Bytes free for unprivileged users on the file system holding `path`.
fn bytes_available(path: &Path) -> Option<u64> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statvfs writes into the zeroed struct we own; `c` is a valid C string.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(st.f_bavail as u64 * st.f_frsize as u64)
}

/// The lab's admin token (written by its first node to `DIR/admin.token`), if there is one.
pub fn admin_token(dir: &Path) -> Option<String> {
    fs::read_to_string(dir.join("admin.token"))
        .ok()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
}

/// The lab's CA (`DIR/pki`), made on first use.
fn lab_ca(dir: &Path) -> Result<converge_pki::Ca> {
    let pki = dir.join("pki");
    if pki.join(converge_pki::CA_KEY).exists() {
        return converge_pki::Ca::load(&pki).map_err(|e| anyhow!("the lab's CA: {e}"));
    }
    let ca = converge_pki::Ca::generate().map_err(|e| anyhow!("making the lab's CA: {e}"))?;
    ca.write(&pki)
        .map_err(|e| anyhow!("writing the lab's CA: {e}"))?;
    Ok(ca)
}

/// The etcd members' certificate for their addresses (`DIR/pki/etcd/server.{crt,key}`).
fn lab_etcd_cert(ca: &converge_pki::Ca, dir: &Path, hosts: &[String]) -> Result<()> {
    let key = converge_pki::NewKey::generate().map_err(|e| anyhow!("{e}"))?;
    let cert = ca
        .issue(
            &converge_pki::Subject::Etcd {
                hosts: hosts.to_vec(),
            },
            &key.public_key(),
        )
        .map_err(|e| anyhow!("etcd's certificate: {e}"))?;
    converge_pki::make_dir(dir).map_err(|e| anyhow!("{e}"))?;
    converge_pki::write_file(&dir.join("server.key"), key.pem().as_bytes(), 0o600)
        .map_err(|e| anyhow!("{e}"))?;
    converge_pki::write_file(&dir.join("server.crt"), cert.as_bytes(), 0o644)
        .map_err(|e| anyhow!("{e}"))
}

/// Node `id`'s PKI directory by the join-token flow, through node 1 (the lab's admin token
/// makes the token).
fn join_node_pki(lab: &Lab, dir: &Path, id: u32, host: &str) -> Result<()> {
    crate::http::use_lab_dir(&lab.dir);
    let first = lab
        .nodes
        .first()
        .ok_or_else(|| anyhow!("node 1 is not started"))?;
    let body = serde_json::to_value(converge_api::CreateJoinToken {
        node: converge_types::NodeId(id),
        hosts: vec![host.to_string()],
        ttl_s: Some(600),
        replace: false,
    })?;
    let t: converge_api::CreatedJoinToken =
        crate::http::call(&first.api, "POST", "/v1/join-tokens", Some(&body))
            .with_context(|| format!("a join token for node {id}"))?;
    crate::pki_cmd::fetch_certificate(&first.api, &t.token, dir, None)
        .with_context(|| format!("node {id} joining through node 1"))?;
    Ok(())
}

/// The lab's NBD client certificate (`lab`, from the lab's clients CA), if not made yet.
fn lab_client_cert(lab_pki: &Path, dir: &Path) -> Result<()> {
    if dir.join("client-cert.pem").exists() {
        return Ok(());
    }
    crate::pki_cmd::client_files(lab_pki, "lab", dir)
        .map(|_| ())
        .context("the lab's client certificate")
}

/// A node's PKI directory: a new key, and a certificate from `ca` naming the node and
/// `hosts`.
pub fn issue_node_pki(ca: &converge_pki::Ca, dir: &Path, id: u32, hosts: &[String]) -> Result<()> {
    let key = converge_pki::NewKey::generate().map_err(|e| anyhow!("{e}"))?;
    let cert = ca
        .issue(
            &converge_pki::Subject::Node {
                id,
                hosts: hosts.to_vec(),
            },
            &key.public_key(),
        )
        .map_err(|e| anyhow!("certificate of node {id}: {e}"))?;
    converge_pki::write_node_dir(dir, ca.cert_pem(), &cert, &key.pem()).map_err(|e| anyhow!("{e}"))
}

/// The lab's CA certificate (the lab is its own cluster CA).
pub fn ca_cert(dir: &Path) -> PathBuf {
    dir.join("pki").join(converge_pki::CA_CERT)
}

pub fn default_dir() -> PathBuf {
    std::env::var_os("CONVERGE_LAB_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("converge-lab"))
}

/// The lab's cluster key file (docs/adr/0011), which every node of the lab names.
pub fn key_file(dir: &Path) -> PathBuf {
    dir.join("cluster.keys")
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

/// The first word of /proc/PID/cmdline (the program the PID runs now).
fn program_of(pid: i32) -> Option<String> {
    let cmd = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let first = cmd.split(|&b| b == 0).next()?;
    Some(String::from_utf8_lossy(first).into_owned())
}

/// Stopped by a signal (SIGSTOP): the state letter in /proc/PID/stat is `T`.
fn is_stopped(p: &LabProc) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{}/stat", p.pid)) else {
        return false;
    };
    // The state follows the command name, which may hold spaces: look after the last ')'.
    stat.rfind(')')
        .and_then(|i| stat[i + 1..].split_whitespace().next())
        .is_some_and(|s| s == "T")
}

/// What a lab process is doing, as the kernel sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProcState {
    Running,
    /// Stopped with SIGSTOP (`lab fault pause`).
    Paused,
    /// Not running (stopped, killed, or never started).
    Dead,
}

pub fn proc_state(p: &LabProc) -> ProcState {
    if !is_ours(p) {
        ProcState::Dead
    } else if is_stopped(p) {
        ProcState::Paused
    } else {
        ProcState::Running
    }
}

/// A node's state: its process, whether its link is cut, and which peers it is cut from
/// (`--netns` labs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeState {
    pub proc: ProcState,
    pub partitioned: bool,
    /// Nodes whose link with this one is cut (`lab fault partition N --from M`); both
    /// still reach etcd, the CLI and everyone else.
    pub cut_from: Vec<u32>,
}

impl NodeState {
    /// Running and reachable: its API will answer.
    pub fn serves(&self) -> bool {
        self.proc == ProcState::Running && !self.partitioned
    }
}

impl std::fmt::Display for NodeState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = match self.proc {
            ProcState::Running => "running",
            ProcState::Paused => "paused",
            ProcState::Dead => "dead",
        };
        match (self.proc, self.partitioned) {
            (ProcState::Running, true) => write!(f, "partitioned")?,
            (_, true) => write!(f, "{p}, partitioned")?,
            (_, false) => write!(f, "{p}")?,
        }
        if !self.cut_from.is_empty() {
            let ids: Vec<String> = self.cut_from.iter().map(u32::to_string).collect();
            write!(f, ", cut from {}", ids.join(","))?;
        }
        Ok(())
    }
}

pub fn node_state(lab: &Lab, n: &LabNode) -> NodeState {
    NodeState {
        proc: proc_state(&n.proc),
        partitioned: lab.net.as_ref().is_some_and(|net| net.partitioned(n.id)),
        cut_from: lab
            .net
            .as_ref()
            .map(|net| net.cut_from(n.id))
            .unwrap_or_default(),
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

/// The command that starts `argv`, inside `netns` if given.
fn command(argv: &[String], netns: Option<&str>) -> Result<Command> {
    let (prog, args) = argv
        .split_first()
        .ok_or_else(|| anyhow!("empty command line"))?;
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new(crate::netns::require()?);
            c.args(["netns", "exec", ns]).arg(prog);
            c
        }
        None => Command::new(prog),
    };
    cmd.args(args);
    if std::env::var_os("RUST_LOG").is_none() {
        cmd.env("RUST_LOG", "info");
    }
    Ok(cmd)
}

fn argv_of(cmd: &Command) -> Vec<String> {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect()
}

fn spawn(
    name: &str,
    argv: Vec<String>,
    netns: Option<String>,
    log: &Path,
    marker: String,
    addr: String,
) -> Result<LabProc> {
    let mut cmd = command(&argv, netns.as_deref())?;
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
        netns,
    };
    // Until exec completes, /proc/PID/cmdline is still ours: wait for the exec (or exit).
    // Inside a namespace `ip netns exec` runs first with the marker in its arguments: wait
    // until it has exec'd the program itself.
    let started = |p: &LabProc| {
        is_ours(p) && (p.netns.is_none() || program_of(p.pid).as_ref() == p.argv.first())
    };
    let mut child = child;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !started(&p) {
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
    if p.argv.is_empty() {
        bail!("no command recorded for {}", p.name);
    }
    let np = spawn(
        &p.name,
        p.argv.clone(),
        p.netns.clone(),
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
    if let Some(net) = &lab.net {
        crate::netns::require()?;
        net.ensure()?;
    }
    if !is_ours(&lab.etcd) {
        respawn(&mut lab.etcd)?;
        save(&lab)?;
    }
    for i in 0..lab.etcd_more.len() {
        if !is_ours(&lab.etcd_more[i].proc) {
            respawn(&mut lab.etcd_more[i].proc)?;
            save(&lab)?;
        }
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
    let lab_drives = o.lab_drives()?;
    if o.netns {
        crate::netns::require()?;
    }
    if let Ok(lab) = load(&o.dir) {
        // Asking for cache drives on an existing lab must not silently give none.
        if o.cache_drives > 0 && lab.drives.as_ref() != Some(&lab_drives) {
            bail!(
                "the lab in {} exists with {}; drives are fixed when a lab is created: \
                 `converge lab up --dir {}` starts it again as it is, or \
                 `converge lab down --purge --dir {}` deletes it so it can be made anew",
                o.dir.display(),
                lab.drives
                    .as_ref()
                    .map_or("no cache drives".to_string(), |d| d.to_string()),
                o.dir.display(),
                o.dir.display()
            );
        }

        if o.netns && lab.net.is_none() {
            bail!(
                "the lab in {} was started without --netns; bring it down with \
                 `converge lab down --purge --dir {}` and start it again with --netns",
                o.dir.display(),
                o.dir.display()
            );
        }
        if lab.nodes.iter().all(|n| is_ours(&n.proc)) && lab.etcd_procs().into_iter().all(is_ours) {
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
    let threads = match o.threads_per_node {
        Some(t) if !(1..=1024).contains(&t) => {
            bail!("--threads-per-node {t}: must be between 1 and 1024")
        }
        Some(t) => t,
        None => threads_per_node(o.nodes),
    };
    let etcd_bin = find_binary("etcd")?;
    let converged = find_binary("converged")?;
    // Drive files in RAM: refuse before anything starts if /dev/shm cannot hold them.
    let ram_dir = (o.ram || lab_drives.cache_in_ram).then(|| {
        PathBuf::from(format!(
            "/dev/shm/converge-lab-{:x}",
            crate::netns::fxhash(dir.display().to_string().as_bytes())
        ))
    });
    if ram_dir.is_some() {
        let need = ram_needed(&lab_drives, o.nodes, o.ram);
        if let Some(avail) = bytes_available(Path::new("/dev/shm")) {
            if need > avail {
                bail!(
                    "the lab's drive files in RAM need {} but /dev/shm has {} free: use \
                     smaller or fewer drives, or keep them on disk (without --ram / \
                     --cache-in-ram)",
                    converge_types::format_size(need),
                    converge_types::format_size(avail)
                );
            }
        }
    }

    // With --netns: the bridge, a namespace and a veth pair per node, before anything
    // listens on their addresses.
    let net = if o.netns {
        let net = LabNet::plan(&dir, o.nodes)?;
        net.clean_leftovers()?;
        if let Err(e) = net.ensure() {
            let (_, left) = net.teardown();
            if !left.is_empty() {
                log_warn(&format!("could not remove: {}", left.join("; ")));
            }
            return Err(e.context("creating the lab network"));
        }
        Some(net)
    } else {
        None
    };

    // etcd on 127.0.0.1, or on the bridge so namespaced nodes reach it; with several
    // members and --netns, member M in node M's namespace (etcd beside the first nodes).
    if ![1, 3, 5].contains(&o.etcd_members) {
        bail!(
            "--etcd-members {}: use 1, 3 or 5 (an odd number keeps a majority)",
            o.etcd_members
        );
    }
    if o.etcd_quota_bytes < ETCD_QUOTA_MIN {
        bail!(
            "--etcd-quota {}: give at least {} (the lab's records and some history)",
            converge_types::format_size(o.etcd_quota_bytes),
            converge_types::format_size(ETCD_QUOTA_MIN)
        );
    }
    if o.netns && o.etcd_members > 1 && o.etcd_members > o.nodes {
        bail!(
            "--etcd-members {} with --netns runs member M in node M's namespace: give at least \
             as many --nodes",
            o.etcd_members
        );
    }
    struct Member {
        name: String,
        ip: Ipv4Addr,
        netns: Option<String>,
        client: String,
        peer: String,
        metrics: String,
        data: PathBuf,
        log: PathBuf,
    }
    let mut members = Vec::new();
    // The client port of member M, for node M to reset its connections when etcd's
    // revocation list gains a certificate (`[tls] etcd_client_port`): when the member
    // listens in node M's network (this host, or node M's namespace). One member beside
    // namespaced nodes listens on the bridge, where no node can reach its sockets.
    let mut reset_ports: Vec<Option<u16>> = Vec::new();
    for m in 1..=o.etcd_members {
        let (ip, netns, ports) = match &net {
            Some(net) if o.etcd_members > 1 => {
                let n = net.node(m)?;
                (n.addr, Some(n.netns.clone()), vec![2379, 2380, 2381])
            }
            Some(net) => (net.bridge_addr(), None, free_ports(net.bridge_addr(), 3)?),
            None => (
                Ipv4Addr::LOCALHOST,
                None,
                free_ports(Ipv4Addr::LOCALHOST, 3)?,
            ),
        };
        reset_ports.push(match &net {
            Some(_) if o.etcd_members > 1 => Some(ports[0]),
            Some(_) => None,
            None => Some(ports[0]),
        });
        let suffix = if m == 1 { String::new() } else { m.to_string() };
        members.push(Member {
            name: format!("etcd{suffix}"),
            ip,
            netns,
            client: format!("https://{ip}:{}", ports[0]),
            peer: format!("https://{ip}:{}", ports[1]),
            metrics: format!("http://{ip}:{}", ports[2]),
            data: dir.join(format!("etcd{suffix}")),
            log: dir.join(format!("etcd{suffix}.log")),
        });
    }
    let client = members[0].client.clone();
    let initial_cluster = members
        .iter()
        .map(|m| format!("{}={}", m.name, m.peer))
        .collect::<Vec<_>>()
        .join(",");
    // The lab is its own cluster CA: etcd, every node and NBD clients get certificates, as
    // on real hosts (etcd wants a client certificate of the CA from every caller, members
    // of each other too).
    let ca = lab_ca(&dir)?;
    // One cluster key file for the lab's nodes (they share this machine), so encrypted
    // volumes work in any lab; kept across `lab down` with the rest of DIR.
    if !key_file(&dir).exists() {
        converge_pki::keys::Keyring::create(&key_file(&dir))
            .map_err(|e| anyhow!("making the lab's cluster key: {e}"))?;
    }
    let etcd_pki = dir.join("pki").join("etcd");
    let etcd_hosts: Vec<String> = members.iter().map(|m| m.ip.to_string()).collect();
    lab_etcd_cert(&ca, &etcd_pki, &etcd_hosts)?;
    // etcd refuses the certificates this list names (revoked ones, removed nodes'); the
    // nodes keep it current. It must exist before etcd starts.
    let etcd_crl = etcd_pki.join(crate::pki_cmd::ETCD_CRL);
    crate::pki_cmd::initial_etcd_crl(&ca, &etcd_crl)?;
    lab_client_cert(&dir.join("pki"), &dir.join("pki").join("client"))?;
    let mut procs = Vec::new();
    for m in &members {
        let mut cmd = Command::new(&etcd_bin);
        cmd.arg("--name")
            .arg(&m.name)
            .arg("--data-dir")
            .arg(&m.data)
            .arg("--listen-client-urls")
            .arg(&m.client)
            .arg("--advertise-client-urls")
            .arg(&m.client)
            .arg("--listen-peer-urls")
            .arg(&m.peer)
            .arg("--initial-advertise-peer-urls")
            .arg(&m.peer)
            .arg("--initial-cluster")
            .arg(&initial_cluster)
            .arg("--initial-cluster-token")
            .arg("converge-lab")
            .arg("--cert-file")
            .arg(etcd_pki.join("server.crt"))
            .arg("--key-file")
            .arg(etcd_pki.join("server.key"))
            .arg("--trusted-ca-file")
            .arg(ca_cert(&dir))
            .arg("--client-cert-auth")
            .arg("--client-crl-file")
            .arg(&etcd_crl)
            .arg("--peer-cert-file")
            .arg(etcd_pki.join("server.crt"))
            .arg("--peer-key-file")
            .arg(etcd_pki.join("server.key"))
            .arg("--peer-trusted-ca-file")
            .arg(ca_cert(&dir))
            .arg("--peer-client-cert-auth")
            .arg("--listen-metrics-urls")
            .arg(&m.metrics)
            // Bounded: history older than 10 minutes compacted, the database capped.
            .arg("--auto-compaction-mode")
            .arg("periodic")
            .arg("--auto-compaction-retention")
            .arg(ETCD_COMPACTION_RETENTION)
            .arg("--quota-backend-bytes")
            .arg(o.etcd_quota_bytes.to_string())
            .arg("--log-level")
            .arg("warn");
        match spawn(
            &m.name,
            argv_of(&cmd),
            m.netns.clone(),
            &m.log,
            m.data.display().to_string(),
            m.client.clone(),
        ) {
            Ok(p) => procs.push(p),
            Err(e) => {
                for p in &procs {
                    stop_proc(p, Duration::from_secs(10));
                }
                if let Some(net) = &net {
                    net.teardown();
                }
                return Err(e);
            }
        }
    }
    let mut procs = procs.into_iter();
    let etcd = procs
        .next()
        .ok_or_else(|| anyhow!("no etcd member started"))?;
    let etcd_more: Vec<LabEtcdMember> = procs
        .zip(members.iter().skip(1))
        .map(|(proc, m)| LabEtcdMember {
            proc,
            endpoint: m.client.clone(),
            health: m.metrics.clone(),
        })
        .collect();
    let etcd_endpoints: Vec<String> = members.iter().map(|m| m.client.clone()).collect();
    let ram_dir = match &ram_dir {
        Some(d) => {
            fs::create_dir_all(d)?;
            Some(d.clone())
        }
        None => None,
    };
    let mut lab = Lab {
        dir: dir.clone(),
        etcd_endpoint: client.clone(),
        etcd_health: Some(members[0].metrics.clone()),
        etcd,
        etcd_more,
        nodes: Vec::new(),
        ram_dir: ram_dir.clone(),
        drives: Some(lab_drives.clone()),
        net: net.clone(),
    };
    save(&lab)?;
    wait_etcd(&lab, o.timeout)?;

    for id in 1..=o.nodes {
        let (ip, ports, netns) = match &net {
            // A namespace of its own: the usual ports are free there.
            Some(net) => {
                let n = net.node(id)?;
                (n.addr, vec![7100, 7200, 10809], Some(n.netns.clone()))
            }
            None => {
                let ip = Ipv4Addr::new(127, 0, 0, (id + 1) as u8);
                (ip, free_ports(ip, 3)?, None)
            }
        };
        let ndir = dir.join(format!("node{id}"));
        fs::create_dir_all(&ndir)?;
        let ram_node_dir = match &ram_dir {
            Some(r) => {
                let d = r.join(format!("node{id}"));
                fs::create_dir_all(&d)?;
                Some(d)
            }
            None => None,
        };
        let ddir = match (&ram_node_dir, o.ram) {
            (Some(d), true) => d.clone(),
            _ => ndir.clone(),
        };
        let drives: Vec<PathBuf> = (1..=o.drives_per_node)
            .map(|j| ddir.join(format!("drive{j}.img")))
            .collect();
        // Cache drives sit next to the capacity drives, or in RAM with --cache-in-ram.
        let cdir = match (&ram_node_dir, lab_drives.cache_in_ram) {
            (Some(d), true) => d.clone(),
            _ => ddir.clone(),
        };
        let cache_drives: Vec<PathBuf> = (1..=lab_drives.cache_per_node)
            .map(|j| cdir.join(format!("cache{j}.img")))
            .collect();
        let rpc = format!("{ip}:{}", ports[0]);
        let api = format!("{ip}:{}", ports[1]);
        let sock = ndir.join("nbd.sock");
        let nbd_tcp = format!("{ip}:{}", ports[2]);
        if id == 1 {
            // As `cluster init --node 1` leaves the first host: its certificate, and the CA
            // key with which it signs the certificates of the nodes that join.
            issue_node_pki(&ca, &ndir.join("pki"), id, &[ip.to_string()])?;
            // Its NBD/TCP port trusts the lab's clients CA (the others get it by joining).
            let (clients_ca, _) = converge_pki::Ca::load_or_make_clients(&dir.join("pki"))
                .map_err(|e| anyhow!("the lab's clients CA: {e}"))?;
            converge_pki::write_clients_ca(&ndir.join("pki"), clients_ca.cert_pem())
                .map_err(|e| anyhow!("{e}"))?;
            let key = fs::read(dir.join("pki").join(converge_pki::CA_KEY))?;
            converge_pki::write_file(&ndir.join("pki").join(converge_pki::CA_KEY), &key, 0o600)
                .map_err(|e| anyhow!("{e}"))?;
        } else {
            // The others join as new hosts do: a one-time token from node 1, a key made
            // here, the certificate signed by node 1.
            if id == 2 {
                wait_node(&lab, 1, o.timeout)?;
            }
            join_node_pki(&lab, &ndir.join("pki"), id, &ip.to_string())?;
        }
        let config = ndir.join("converged.toml");
        let mut toml = format!(
            "# written by `converge lab up`\n[node]\nid = {id}\nname = \"node{id}\"\ncluster_name = \"lab\"\nslab_size = {}\nthreads = {threads}\n\n[network]\nrpc = \"{rpc}\"\napi = \"{api}\"\nnbd_socket = \"{}\"\nnbd_tcp = \"{nbd_tcp}\"\n\n[etcd]\nendpoints = {etcd_endpoints:?}\ncert_file = {:?}\nkey_file = {:?}\nquota = {}\n",
            o.slab_size,
            sock.display(),
            ndir.join("pki").join(converge_pki::NODE_CERT).display().to_string(),
            ndir.join("pki").join(converge_pki::NODE_KEY).display().to_string(),
            o.etcd_quota_bytes
        );
        for d in &drives {
            toml.push_str(&drive_toml(
                d,
                o.drive_size,
                "capacity",
                &lab_drives.capacity_media,
            ));
            if let Some(t) = o.capacity_tbw {
                toml.push_str(&format!("tbw = {t}\n"));
            }
        }
        for d in &cache_drives {
            toml.push_str(&drive_toml(
                d,
                lab_drives.cache_size_bytes,
                "cache",
                &lab_drives.cache_media,
            ));
        }
        // Failure detection tuned for rehearsing failures on one machine: a dead node is
        // noticed in seconds, not minutes; drives' wear counted every few seconds.
        toml.push_str(&format!(
            "\n[knobs]\nnode_lease_ttl_s = 6\nreplica_timeout_ms = 3000\nrepair_delay_s = {}\nwear_record_s = 5\netcd_upkeep_s = 5\n",
            o.repair_delay_s
        ));
        // The lab's own admin token (whichever node starts first writes it), and the lab's
        // fault views and the fleet, which a production node keeps off.
        toml.push_str(&format!(
            "\n[api]\nadmin_token_file = {:?}\nlab = true\nfleet = true\n",
            dir.join("admin.token").display().to_string()
        ));
        toml.push_str(&format!(
            "\n[tls]\ndir = {:?}\netcd_crl_file = {:?}\n",
            ndir.join("pki").display().to_string(),
            etcd_crl.display().to_string(),
        ));
        if let Some(Some(port)) = reset_ports.get(id as usize - 1) {
            toml.push_str(&format!("etcd_client_port = {port}\n"));
        }
        toml.push_str(&format!(
            "\n[encryption]\nkey_file = {:?}\n",
            key_file(&dir).display().to_string()
        ));
        fs::write(&config, toml)?;
        let argv = vec![
            converged.display().to_string(),
            "--config".to_string(),
            config.display().to_string(),
        ];
        let proc = spawn(
            &format!("node{id}"),
            argv,
            netns,
            &ndir.join("converged.log"),
            config.display().to_string(),
            format!("https://{api}"),
        )?;
        lab.nodes.push(LabNode {
            id,
            config,
            api: format!("https://{api}"),
            rpc,
            nbd_socket: sock,
            nbd_tcp: Some(nbd_tcp),
            drives,
            cache_drives,
            proc,
        });
        save(&lab)?;
    }
    wait_healthy(&lab, o.timeout)?;
    Ok(lab)
}

/// One `[[drive]]` of a node config.
fn drive_toml(path: &Path, size: u64, role: &str, media: &str) -> String {
    format!(
        "\n[[drive]]\npath = \"{}\"\nsize = {size}\nrole = \"{role}\"\nmedia = \"{media}\"\n",
        path.display()
    )
}

fn wait_etcd(lab: &Lab, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    for (proc, health) in lab.etcd_health_urls() {
        loop {
            if let Ok(r) = crate::http::request(&health, "GET", "/health", None) {
                if r.status == 200 {
                    break;
                }
            }
            if !is_ours(proc) {
                bail!(
                    "{} exited during start-up; its log ({}) ends with:\n{}",
                    proc.name,
                    proc.log.display(),
                    tail(&proc.log, 15)
                );
            }
            if Instant::now() > deadline {
                bail!("{} did not become healthy at {health} in time", proc.name);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    Ok(())
}

/// Wait until every node answers and sees every other node live.
pub fn wait_healthy(lab: &Lab, timeout: Duration) -> Result<()> {
    crate::http::use_lab_dir(&lab.dir);
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
    crate::http::use_lab_dir(&lab.dir);
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
    // A paused (SIGSTOPped) process handles SIGTERM only once continued.
    // SAFETY: as above.
    unsafe { libc::kill(p.pid, libc::SIGCONT) };
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

/// What `lab down` did.
#[derive(Debug, Default, Serialize)]
pub struct DownReport {
    pub stopped: Vec<String>,
    /// Network namespaces, veths and bridge deleted.
    pub removed: Vec<String>,
    /// What could not be removed, and why.
    pub left: Vec<String>,
    /// Drive files in RAM kept with the data (freed by `lab down --purge`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ram_kept: Option<PathBuf>,
}

pub fn down(dir: &Path, purge: bool) -> Result<DownReport> {
    let lab = load(dir)?;
    let mut report = DownReport::default();
    // Heal cut links first, so every daemon can leave the cluster cleanly on SIGTERM.
    if let Some(net) = &lab.net {
        for n in &net.nodes {
            if net.partitioned(n.id) {
                if let Err(e) = net.set_link(n.id, true) {
                    report.left.push(format!("{e:#}"));
                }
            }
        }
        for (a, b) in net.cuts() {
            if let Err(e) = net.set_cut(a, b, false) {
                report.left.push(format!("{e:#}"));
            }
        }
    }
    let stopped = &mut report.stopped;
    for n in &lab.nodes {
        if stop_proc(&n.proc, Duration::from_secs(15)) {
            stopped.push(format!("{} (pid {})", n.proc.name, n.proc.pid));
        }
    }
    for p in lab.etcd_procs() {
        if stop_proc(p, Duration::from_secs(10)) {
            stopped.push(format!("{} (pid {})", p.name, p.pid));
        }
    }
    if let Some(net) = &lab.net {
        let (removed, left) = net.teardown();
        report.removed = removed;
        report.left.extend(left);
    }
    if !purge {
        report.ram_kept = lab.ram_dir.clone().filter(|r| r.exists());
    }
    if purge {
        if let Some(r) = &lab.ram_dir {
            let _ = fs::remove_dir_all(r);
        }
        fs::remove_dir_all(&lab.dir).with_context(|| format!("removing {}", lab.dir.display()))?;
    }
    Ok(report)
}

fn log_warn(msg: &str) {
    eprintln!("converge: warning: {msg}");
}

fn find_node(lab: &Lab, id: u32) -> Result<&LabNode> {
    lab.nodes.iter().find(|n| n.id == id).ok_or_else(|| {
        anyhow!(
            "the lab has no node {id} (it has nodes 1..={})",
            lab.nodes.len()
        )
    })
}

/// SIGSTOP node `id`'s converged: it keeps its sockets and leases but answers nothing, as
/// a hung or overloaded server does; its etcd lease expires after the TTL.
pub fn pause_node(lab: &Lab, id: u32) -> Result<i32> {
    let n = find_node(lab, id)?;
    match proc_state(&n.proc) {
        ProcState::Dead => {
            bail!("node{id} is not running; `converge lab fault restart {id}` starts it")
        }
        ProcState::Paused => {
            bail!("node{id} is already paused; `converge lab fault resume {id}` continues it")
        }
        ProcState::Running => {}
    }
    // SAFETY: kill(2) with a PID whose command line we just checked.
    unsafe { libc::kill(n.proc.pid, libc::SIGSTOP) };
    wait_for(|| is_stopped(&n.proc) || !is_ours(&n.proc), "node to stop")?;
    Ok(n.proc.pid)
}

/// SIGCONT a paused node.
pub fn resume_node(lab: &Lab, id: u32) -> Result<i32> {
    let n = find_node(lab, id)?;
    match proc_state(&n.proc) {
        ProcState::Dead => {
            bail!("node{id} is not running; `converge lab fault restart {id}` starts it")
        }
        ProcState::Running => bail!("node{id} is not paused"),
        ProcState::Paused => {}
    }
    // SAFETY: kill(2) with a PID whose command line we just checked.
    unsafe { libc::kill(n.proc.pid, libc::SIGCONT) };
    wait_for(|| !is_stopped(&n.proc), "node to continue")?;
    Ok(n.proc.pid)
}

fn wait_for(mut done: impl FnMut() -> bool, what: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        if Instant::now() > deadline {
            bail!("timed out waiting for the {what}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

fn lab_net(lab: &Lab, id: u32) -> Result<&LabNet> {
    find_node(lab, id)?;
    lab.net.as_ref().ok_or_else(|| {
        anyhow!(
            "node{id} runs in the root network namespace, so its network cannot be cut without \
             cutting everything else; partitions need a lab started with `converge lab up \
             --netns` (as root, with iproute2's `ip`): `converge lab down --purge`, then \
             `converge lab up --netns ...`"
        )
    })
}

/// Cut node `id` off the network: its veth's root-side end goes down, so the kernel drops
/// every packet between the node and the bridge (peers, etcd, the CLI).
pub fn partition_node(lab: &Lab, id: u32) -> Result<String> {
    let net = lab_net(lab, id)?;
    if net.partitioned(id) {
        bail!("node{id} is already partitioned; `converge lab fault heal {id}` reconnects it");
    }
    net.set_link(id, false)?;
    Ok(net.node(id)?.veth.clone())
}

/// Cut the links between node `id` and each of `from`, both ways, while all of them keep
/// reaching etcd, the CLI and the other nodes. Returns the nodes newly cut from `id`.
pub fn cut_node(lab: &Lab, id: u32, from: &[u32]) -> Result<Vec<u32>> {
    let net = lab_net(lab, id)?;
    for &b in from {
        find_node(lab, b)?;
        if b == id {
            bail!("node{id} cannot be cut from itself: --from names the other end of the link");
        }
    }
    let already = net.cut_from(id);
    if let Some(b) = from.iter().find(|b| already.contains(b)) {
        bail!(
            "node{id} is already cut from node{b}; `converge lab fault heal {id} --from {b}` \
             restores their link"
        );
    }
    for &b in from {
        net.set_cut(id, b, true)?;
    }
    Ok(from.to_vec())
}

/// Restore the links between node `id` and each of `from`.
pub fn uncut_node(lab: &Lab, id: u32, from: &[u32]) -> Result<Vec<u32>> {
    let net = lab_net(lab, id)?;
    for &b in from {
        find_node(lab, b)?;
    }
    let cut = net.cut_from(id);
    if let Some(b) = from.iter().find(|b| !cut.contains(b)) {
        bail!("node{id}'s link with node{b} is not cut");
    }
    for &b in from {
        net.set_cut(id, b, false)?;
    }
    Ok(from.to_vec())
}

/// Everything that cuts node `id` off: its link, if down, and its links with other nodes.
/// Returns the veth set up again (if it was down) and the nodes whose links were restored.
pub fn heal_node(lab: &Lab, id: u32) -> Result<(Option<String>, Vec<u32>)> {
    let net = lab_net(lab, id)?;
    let cut = net.cut_from(id);
    let partitioned = net.partitioned(id);
    if !partitioned && cut.is_empty() {
        bail!("node{id} is not partitioned");
    }
    let veth = if partitioned {
        net.set_link(id, true)?;
        Some(net.node(id)?.veth.clone())
    } else {
        None
    };
    for &b in &cut {
        net.set_cut(id, b, false)?;
    }
    Ok((veth, cut))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> UpOptions {
        UpOptions {
            dir: PathBuf::from("/nonexistent"),
            nodes: 4,
            drives_per_node: 2,
            drive_size: 2 << 30,
            ram: false,
            capacity_media: None,
            capacity_tbw: None,
            cache_drives: 0,
            cache_size: None,
            cache_in_ram: false,
            cache_media: None,
            slab_size: 256 << 20,
            timeout: Duration::from_secs(1),
            repair_delay_s: 60,
            netns: false,
            threads_per_node: None,
            etcd_members: 1,
            etcd_quota_bytes: 2 << 30,
        }
    }

    #[test]
    fn nodes_share_the_cores() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(threads_per_node(1), cores);
        assert_eq!(threads_per_node(cores as u32), 1);
        assert_eq!(threads_per_node(cores as u32 * 4), 1, "at least one thread");
    }

    #[test]
    fn node_state_names_the_peers_a_node_is_cut_from() {
        let st = |proc, partitioned, cut_from: &[u32]| {
            NodeState {
                proc,
                partitioned,
                cut_from: cut_from.to_vec(),
            }
            .to_string()
        };
        assert_eq!(st(ProcState::Running, false, &[]), "running");
        assert_eq!(st(ProcState::Running, true, &[]), "partitioned");
        assert_eq!(st(ProcState::Paused, true, &[]), "paused, partitioned");
        assert_eq!(st(ProcState::Running, false, &[3]), "running, cut from 3");
        assert_eq!(
            st(ProcState::Running, true, &[2, 4]),
            "partitioned, cut from 2,4"
        );
        let cut = NodeState {
            proc: ProcState::Running,
            partitioned: false,
            cut_from: vec![2],
        };
        assert!(cut.serves(), "a node cut from a peer still answers the CLI");
    }

    #[test]
    fn no_cache_by_default() {
        let d = opts().lab_drives().unwrap();
        assert_eq!(d.cache_per_node, 0);
        assert_eq!(d.capacity_media, "ssd");
        assert!(!d.cache_in_ram);
        assert_eq!(
            d.to_string(),
            "2 capacity drives of 2 GiB (ssd), no cache drive"
        );
    }

    #[test]
    fn cache_flags_and_defaults() {
        let mut o = opts();
        o.cache_drives = 1;
        let d = o.lab_drives().unwrap();
        assert_eq!(
            (d.cache_size_bytes, d.cache_media.as_str()),
            (CACHE_SIZE_DEFAULT, "nvme")
        );
        o.cache_in_ram = true;
        o.cache_size = Some(512 << 20);
        let d = o.lab_drives().unwrap();
        assert_eq!(d.cache_media, "ram", "in RAM: media ram by default");
        assert!(d.cache_in_ram);
        assert_eq!(
            d.to_string(),
            "2 capacity drives of 2 GiB (ssd), 1 cache drive of 512 MiB (ram, in RAM)"
        );
        o.cache_media = Some("ssd".into());
        assert_eq!(o.lab_drives().unwrap().cache_media, "ssd");
        o.capacity_media = Some("hdd".into());
        assert_eq!(o.lab_drives().unwrap().capacity_media, "hdd");
        let mut r = opts();
        r.ram = true;
        assert_eq!(r.lab_drives().unwrap().capacity_media, "ram");
    }

    #[test]
    fn cache_flags_are_validated() {
        let err = |o: &UpOptions| o.lab_drives().unwrap_err().to_string();
        let mut o = opts();
        o.cache_drives = 9;
        assert!(err(&o).contains("at most 8"), "{}", err(&o));
        o.cache_drives = 8;
        o.cache_size = Some(64 << 20);
        assert!(o.lab_drives().is_ok(), "8 drives of 64 MiB are fine");
        o.cache_size = Some((64 << 20) - 4096);
        assert!(err(&o).contains("too small"), "{}", err(&o));
        o.cache_size = Some((64 << 20) + 1);
        assert!(err(&o).contains("multiple of 4096"), "{}", err(&o));
        for (flag, set) in [
            (
                "--cache-size",
                &(|o: &mut UpOptions| o.cache_size = Some(1 << 30)) as &dyn Fn(&mut UpOptions),
            ),
            ("--cache-in-ram", &|o: &mut UpOptions| o.cache_in_ram = true),
            ("--cache-media", &|o: &mut UpOptions| {
                o.cache_media = Some("ram".into())
            }),
        ] {
            let mut o = opts();
            set(&mut o);
            let e = err(&o);
            assert!(e.starts_with(flag) && e.contains("--cache-drives N"), "{e}");
        }
    }

    #[test]
    fn ram_needed_counts_only_files_in_ram() {
        let mut o = opts();
        o.cache_drives = 2;
        o.cache_size = Some(512 << 20);
        let d = o.lab_drives().unwrap();
        assert_eq!(ram_needed(&d, 4, false), 0, "nothing in RAM");
        o.cache_in_ram = true;
        let d = o.lab_drives().unwrap();
        assert_eq!(ram_needed(&d, 4, false), 4 * 2 * (512 << 20));
        assert_eq!(
            ram_needed(&d, 4, true),
            4 * (2 * (512 << 20) + 2 * (2u64 << 30))
        );
    }

    #[test]
    fn cache_drive_config_names_role_and_media() {
        let t = drive_toml(
            Path::new("/dev/shm/x/node1/cache1.img"),
            512 << 20,
            "cache",
            "ram",
        );
        assert_eq!(
            t,
            "\n[[drive]]\npath = \"/dev/shm/x/node1/cache1.img\"\nsize = 536870912\nrole = \"cache\"\nmedia = \"ram\"\n"
        );
    }

    #[test]
    fn old_lab_files_still_load() {
        let lab: Lab = serde_json::from_value(serde_json::json!({
            "dir": "/tmp/l", "etcd_endpoint": "http://127.0.0.1:2379",
            "etcd": {"name": "etcd", "pid": 1, "marker": "x", "log": "/tmp/l/etcd.log",
                     "addr": "", "argv": []},
            "nodes": [{"id": 1, "config": "/tmp/l/c", "api": "http://a", "rpc": "r",
                       "nbd_socket": "/tmp/s", "drives": [],
                       "proc": {"name": "node1", "pid": 2, "marker": "y", "log": "/tmp/l/n",
                                "addr": "", "argv": []}}],
            "ram_dir": null
        }))
        .expect("a lab.json from before cache drives");
        assert!(lab.drives.is_none());
        assert!(lab.nodes[0].cache_drives.is_empty());
    }
}
