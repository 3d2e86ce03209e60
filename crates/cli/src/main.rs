//! `converge`: the command-line interface to a converge cluster and its lab.
//!
//! Cluster commands talk to any node's HTTP API (`--api` or `CONVERGE_API`; inside a lab
//! directory the lab's first node is used). Human tables by default, `--json` everywhere.

mod fleet;
mod http;
mod lab;
mod table;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use converge_api::{CreateVolume, DriveInfo, NodeInfo, ResizeVolume, Status, VolumeInfo};
use converge_types::{format_size, parse_size, Resiliency};
use serde_json::json;
use std::path::PathBuf;
use std::time::Duration;
use table::Table;

#[derive(Parser)]
#[command(
    name = "converge",
    version,
    about = "converge: replicated virtual disks for hyper-converged Linux clusters",
    long_about = "converge pools the drives of every node into resilient volumes (virtual disks) \
served over NBD.\n\nStart a cluster on this machine with `converge lab up`, then \
`eval $(converge lab env)` and use `converge status` and `converge volume ...`."
)]
struct Cli {
    /// Node API to talk to, e.g. http://127.0.0.2:7200 (default: the lab in
    /// $CONVERGE_LAB_DIR or ./converge-lab).
    #[arg(long, global = true, env = "CONVERGE_API")]
    api: Option<String>,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Cluster health, nodes, drives, volumes and capacity at a glance.
    Status,
    /// Nodes of the cluster.
    #[command(subcommand)]
    Node(NodeCmd),
    /// Drives of the cluster.
    #[command(subcommand)]
    Drive(DriveCmd),
    /// Volumes (virtual disks): create, list, show, delete, resize.
    #[command(subcommand)]
    Volume(VolumeCmd),
    /// A whole cluster on this machine: etcd plus N converged on 127.0.0.x.
    #[command(subcommand)]
    Lab(LabCmd),
    /// Benchmark the cluster the way vendors' reference architectures do: fio workers
    /// ("VMs") on every node swept over queue depths, read/write mixes and block sizes,
    /// with a report (tables, charts, CPU, queue length, write amplification, endurance).
    #[command(subcommand)]
    Fleet(fleet::FleetCmd),
}

#[derive(Subcommand)]
enum NodeCmd {
    /// List nodes and whether they are live.
    List,
}

#[derive(Subcommand)]
enum DriveCmd {
    /// List drives with their role, media, size and use.
    List,
}

#[derive(Subcommand)]
enum VolumeCmd {
    /// Create a thin-provisioned volume.
    Create {
        /// Name; also the NBD export name (letters, digits, '-', '_', '.').
        name: String,
        /// Size, e.g. 10G (binary units).
        #[arg(long)]
        size: String,
        /// simple (one copy), mirror-2 or mirror-3.
        #[arg(long, default_value = "mirror-3")]
        resiliency: String,
        /// Node that owns (serves) the volume; default: the node answering the API.
        #[arg(long)]
        owner: Option<u32>,
    },
    /// List volumes.
    List,
    /// Show a volume: NBD URI, owner, and every slab's extents.
    Show { name: String },
    /// Delete a volume and free its extents.
    Delete { name: String },
    /// Grow a volume (shrinking is refused).
    Resize {
        name: String,
        #[arg(long)]
        size: String,
    },
}

#[derive(Args, Clone)]
struct LabDir {
    /// Lab directory (default: $CONVERGE_LAB_DIR or ./converge-lab).
    #[arg(long)]
    dir: Option<PathBuf>,
}

impl LabDir {
    fn path(&self) -> PathBuf {
        self.dir.clone().unwrap_or_else(lab::default_dir)
    }
}

#[derive(Subcommand)]
enum LabCmd {
    /// Start a lab cluster (or start again a stopped one in the same directory) and wait
    /// until it is healthy.
    Up {
        #[command(flatten)]
        dir: LabDir,
        /// Number of nodes (converged processes on 127.0.0.2, .3, ...).
        #[arg(long, default_value_t = 4)]
        nodes: u32,
        /// Capacity drives per node (files).
        #[arg(long, default_value_t = 2)]
        drives_per_node: u32,
        /// Size of each drive file.
        #[arg(long, default_value = "2G")]
        drive_size: String,
        /// Put drive files in RAM (/dev/shm) instead of the lab directory.
        #[arg(long)]
        ram: bool,
        /// Slab size of the pool (unit of placement).
        #[arg(long, default_value = "256M")]
        slab_size: String,
        /// Seconds to wait for the cluster to become healthy.
        #[arg(long, default_value_t = 60)]
        timeout: u64,
    },
    /// Stop exactly the processes this lab started.
    Down {
        #[command(flatten)]
        dir: LabDir,
        /// Also delete the lab directory and RAM drives (all data).
        #[arg(long)]
        purge: bool,
    },
    /// Print shell lines that point later commands at this lab: eval "$(converge lab env)".
    Env {
        #[command(flatten)]
        dir: LabDir,
    },
    /// List the lab's processes and whether they run.
    Ps {
        #[command(flatten)]
        dir: LabDir,
    },
    /// Inject a real fault into a lab node, to rehearse failures.
    Fault {
        #[command(flatten)]
        dir: LabDir,
        #[command(subcommand)]
        fault: FaultCmd,
    },
}

#[derive(Subcommand, Clone, Copy)]
enum FaultCmd {
    /// kill -9 the node's converged (no clean shutdown).
    Kill { node: u32 },
    /// Stop the node cleanly (SIGTERM).
    Stop { node: u32 },
    /// Start a stopped or killed node again with its data.
    Restart { node: u32 },
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("converge: error: {e:#}");
        std::process::exit(1);
    }
}

fn api_base(cli: &Cli) -> Result<String> {
    if let Some(a) = &cli.api {
        return Ok(if a.starts_with("http://") {
            a.clone()
        } else {
            format!("http://{a}")
        });
    }
    let dir = lab::default_dir();
    let lab = lab::load(&dir).context(
        "no API address given: use --api http://HOST:PORT, set CONVERGE_API, or start a lab",
    )?;
    lab.nodes
        .iter()
        .find(|n| lab::is_ours(&n.proc))
        .map(|n| n.api.clone())
        .ok_or_else(|| anyhow::anyhow!("no node of the lab in {} is running", dir.display()))
}

fn print_json<T: serde::Serialize>(v: &T) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

fn run(cli: Cli) -> Result<()> {
    match &cli.cmd {
        Cmd::Lab(c) => return run_lab(c, cli.json),
        Cmd::Fleet(c) => return fleet::run(c, cli.json, || api_base(&cli)),
        Cmd::Status => {
            let s: Status = http::call(&api_base(&cli)?, "GET", "/v1/status", None)?;
            if cli.json {
                return print_json(&s);
            }
            print_status(&s);
        }
        Cmd::Node(NodeCmd::List) => {
            let v: Vec<NodeInfo> = http::call(&api_base(&cli)?, "GET", "/v1/nodes", None)?;
            if cli.json {
                return print_json(&v);
            }
            print!("{}", nodes_table(&v));
        }
        Cmd::Drive(DriveCmd::List) => {
            let v: Vec<DriveInfo> = http::call(&api_base(&cli)?, "GET", "/v1/drives", None)?;
            if cli.json {
                return print_json(&v);
            }
            print!("{}", drives_table(&v));
        }
        Cmd::Volume(v) => run_volume(&cli, v)?,
    }
    Ok(())
}

fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        && !name.starts_with('.');
    if !ok {
        bail!("volume name {name:?} is not valid: use 1-128 letters, digits, '-', '_' or '.' (not starting with '.')");
    }
    Ok(())
}

fn run_volume(cli: &Cli, cmd: &VolumeCmd) -> Result<()> {
    match cmd {
        VolumeCmd::Create {
            name,
            size,
            resiliency,
            owner,
        } => {
            check_name(name)?;
            let size_bytes = parse_size(size)?;
            let resiliency: Resiliency = resiliency.parse()?;
            let body = serde_json::to_value(CreateVolume {
                name: name.clone(),
                size_bytes,
                resiliency,
                owner: owner.map(converge_types::NodeId),
                min_replicas: None,
            })?;
            let v: VolumeInfo = http::call(&api_base(cli)?, "POST", "/v1/volumes", Some(&body))?;
            if cli.json {
                return print_json(&v);
            }
            println!(
                "created volume {} ({}, {}) owned by {}\n  {}",
                v.name,
                format_size(v.size_bytes),
                v.resiliency,
                v.owner_name,
                v.uri
            );
        }
        VolumeCmd::List => {
            let v: Vec<VolumeInfo> = http::call(&api_base(cli)?, "GET", "/v1/volumes", None)?;
            if cli.json {
                return print_json(&v);
            }
            print!("{}", volumes_table(&v));
        }
        VolumeCmd::Show { name } => {
            check_name(name)?;
            let v: VolumeInfo =
                http::call(&api_base(cli)?, "GET", &format!("/v1/volumes/{name}"), None)?;
            if cli.json {
                return print_json(&v);
            }
            println!("volume      {} (id {})", v.name, v.id);
            println!("size        {}", format_size(v.size_bytes));
            println!(
                "resiliency  {} (min replicas {})",
                v.resiliency, v.min_replicas
            );
            println!("owner       {} (node {})", v.owner_name, v.owner);
            println!("uri         {}", v.uri);
            if let Some(t) = &v.uri_tcp {
                println!("uri (tcp)   {t}");
            }
            println!(
                "allocated   {} in {} slabs of {}",
                format_size(v.allocated_bytes),
                v.slabs_allocated,
                format_size(v.slab_size_bytes)
            );
            let mut t = Table::new(&["SLAB", "DRIVE", "NODE", "STATE"]);
            for s in v.slabs.iter().flatten() {
                for e in &s.extents {
                    t.row(vec![
                        s.index.to_string(),
                        format!("{:016x}", e.drive.0),
                        e.node.to_string(),
                        e.state.to_string(),
                    ]);
                }
            }
            print!("\n{}", t.render());
        }
        VolumeCmd::Delete { name } => {
            check_name(name)?;
            let v: serde_json::Value = http::call(
                &api_base(cli)?,
                "DELETE",
                &format!("/v1/volumes/{name}"),
                None,
            )?;
            if cli.json {
                return print_json(&v);
            }
            println!("deleted volume {name}");
        }
        VolumeCmd::Resize { name, size } => {
            check_name(name)?;
            let size_bytes = parse_size(size)?;
            let body = serde_json::to_value(ResizeVolume { size_bytes })?;
            let v: VolumeInfo = http::call(
                &api_base(cli)?,
                "POST",
                &format!("/v1/volumes/{name}/resize"),
                Some(&body),
            )?;
            if cli.json {
                return print_json(&v);
            }
            println!("volume {} is now {}", v.name, format_size(v.size_bytes));
        }
    }
    Ok(())
}

fn run_lab(c: &LabCmd, json_out: bool) -> Result<()> {
    match c {
        LabCmd::Up {
            dir,
            nodes,
            drives_per_node,
            drive_size,
            ram,
            slab_size,
            timeout,
        } => {
            let o = lab::UpOptions {
                dir: dir.path(),
                nodes: *nodes,
                drives_per_node: *drives_per_node,
                drive_size: parse_size(drive_size)?,
                ram: *ram,
                slab_size: parse_size(slab_size)?,
                timeout: Duration::from_secs(*timeout),
            };
            let lab = lab::up(&o)?;
            if json_out {
                return print_json(&lab);
            }
            println!(
                "lab up in {}: etcd {} and {} nodes",
                lab.dir.display(),
                lab.etcd_endpoint,
                lab.nodes.len()
            );
            println!(
                "point the CLI at it with:  eval \"$(converge lab env --dir {})\"",
                lab.dir.display()
            );
        }
        LabCmd::Down { dir, purge } => {
            let stopped = lab::down(&dir.path(), *purge)?;
            if json_out {
                return print_json(&json!({ "stopped": stopped }));
            }
            if stopped.is_empty() {
                println!("nothing was running");
            }
            for s in stopped {
                println!("stopped {s}");
            }
        }
        LabCmd::Env { dir } => {
            let l = lab::load(&dir.path())?;
            let api = l.nodes.first().map(|n| n.api.clone()).unwrap_or_default();
            if json_out {
                return print_json(&json!({
                    "CONVERGE_API": api, "CONVERGE_LAB_DIR": l.dir, "CONVERGE_ETCD": l.etcd_endpoint
                }));
            }
            println!("export CONVERGE_API={api}");
            println!("export CONVERGE_LAB_DIR={}", l.dir.display());
            println!("export CONVERGE_ETCD={}", l.etcd_endpoint);
        }
        LabCmd::Fault { dir, fault } => {
            let mut l = lab::load(&dir.path())?;
            let id = match fault {
                FaultCmd::Kill { node } | FaultCmd::Stop { node } | FaultCmd::Restart { node } => {
                    *node
                }
            };
            let Some(n) = l.nodes.iter().find(|n| n.id == id).cloned() else {
                bail!(
                    "the lab has no node {id} (it has nodes 1..={})",
                    l.nodes.len()
                );
            };
            let what = match fault {
                FaultCmd::Kill { .. } => {
                    if !lab::kill_proc(&n.proc) {
                        bail!("node{id} is not running");
                    }
                    "killed (SIGKILL)"
                }
                FaultCmd::Stop { .. } => {
                    if !lab::stop_proc(&n.proc, Duration::from_secs(15)) {
                        bail!("node{id} is not running");
                    }
                    "stopped"
                }
                FaultCmd::Restart { .. } => {
                    lab::restart_node(&mut l, id)?;
                    lab::wait_node(&l, id, Duration::from_secs(60))?;
                    "restarted"
                }
            };
            if json_out {
                return print_json(&json!({ "node": id, "result": what }));
            }
            println!("node{id} {what}");
        }
        LabCmd::Ps { dir } => {
            let l = lab::load(&dir.path())?;
            let procs: Vec<&lab::LabProc> = std::iter::once(&l.etcd)
                .chain(l.nodes.iter().map(|n| &n.proc))
                .collect();
            if json_out {
                let v: Vec<_> = procs
                    .iter()
                    .map(|p| json!({"name": p.name, "pid": p.pid, "running": lab::is_ours(p), "addr": p.addr, "log": p.log}))
                    .collect();
                return print_json(&v);
            }
            let mut t = Table::new(&["NAME", "PID", "STATE", "ADDRESS", "LOG"]);
            for p in procs {
                t.row(vec![
                    p.name.clone(),
                    p.pid.to_string(),
                    if lab::is_ours(p) {
                        "running"
                    } else {
                        "stopped"
                    }
                    .into(),
                    p.addr.clone(),
                    p.log.display().to_string(),
                ]);
            }
            print!("{}", t.render());
        }
    }
    Ok(())
}

fn nodes_table(v: &[NodeInfo]) -> String {
    let mut t = Table::new(&["ID", "NAME", "STATE", "RPC", "API", "NBD SOCKET"]);
    for n in v {
        t.row(vec![
            n.id.to_string(),
            n.name.clone(),
            if n.live { "live" } else { "down" }.into(),
            n.rpc_addr.clone(),
            n.api_addr.clone(),
            n.nbd_socket.clone(),
        ]);
    }
    t.render()
}

fn drives_table(v: &[DriveInfo]) -> String {
    let mut t = Table::new(&[
        "DRIVE",
        "NODE",
        "ROLE",
        "MEDIA",
        "SIZE",
        "SLABS USED",
        "PATH",
    ]);
    for d in v {
        t.row(vec![
            format!("{:016x}", d.id.0),
            d.node.to_string(),
            format!("{:?}", d.role).to_lowercase(),
            format!("{:?}", d.media).to_lowercase(),
            format_size(d.size_bytes),
            format!("{}/{}", d.extents_used, d.extents_total),
            d.path.clone(),
        ]);
    }
    t.render()
}

fn volumes_table(v: &[VolumeInfo]) -> String {
    let mut t = Table::new(&[
        "NAME",
        "SIZE",
        "RESILIENCY",
        "OWNER",
        "ALLOCATED",
        "DEGRADED",
        "URI",
    ]);
    for x in v {
        t.row(vec![
            x.name.clone(),
            format_size(x.size_bytes),
            x.resiliency.to_string(),
            x.owner_name.clone(),
            format_size(x.allocated_bytes),
            x.degraded_extents.to_string(),
            x.uri.clone(),
        ]);
    }
    t.render()
}

fn print_status(s: &Status) {
    let live = s.nodes.iter().filter(|n| n.live).count();
    println!("cluster   {} ({})", s.cluster.name, s.cluster.id);
    println!("health    {}", s.health);
    println!("nodes     {live}/{} live", s.nodes.len());
    println!(
        "capacity  {} used of {} ({} provisioned)",
        format_size(s.capacity.used_bytes),
        format_size(s.capacity.total_bytes),
        format_size(s.capacity.provisioned_bytes)
    );
    println!("\nNODES\n{}", nodes_table(&s.nodes));
    println!("DRIVES\n{}", drives_table(&s.drives));
    println!("VOLUMES\n{}", volumes_table(&s.volumes));
}
