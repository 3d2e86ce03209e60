//! `converge`: the command-line interface to a converge cluster and its lab.
//!
//! Cluster commands talk to any node's HTTP API: `--api` or `CONVERGE_API` give one or more
//! (comma-separated, tried in turn until one can be reached); without them, every node of
//! the lab directory. Human tables by default, `--json` everywhere.

mod advise;
mod cache;
mod diff;
mod fleet;
mod http;
mod key_cmd;
mod lab;
mod nemesis;
mod netns;
mod pki_cmd;
mod remove;
mod rolling;
mod table;
mod vhost;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use converge_api::{CreateVolume, DriveInfo, NodeInfo, ResizeVolume, Status, VolumeInfo};
use converge_types::{format_size, parse_size, DriveRole, Resiliency};
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
    /// Node APIs to talk to, comma-separated, e.g.
    /// https://127.0.0.2:7200,https://127.0.0.3:7200: any node answers for the cluster, and
    /// the next is tried when one cannot be reached (refused, unreachable, timed out; an
    /// HTTP error is an answer). Default: every node of the lab in $CONVERGE_LAB_DIR or
    /// ./converge-lab.
    #[arg(long, global = true, env = "CONVERGE_API", value_name = "URL[,URL...]")]
    api: Option<String>,
    /// API token (`converge token create` makes them; the cluster's first admin token is
    /// in the admin.token file the first node wrote). Default: the lab's, from
    /// $CONVERGE_LAB_DIR/admin.token.
    #[arg(
        long,
        global = true,
        env = "CONVERGE_TOKEN",
        value_name = "TOKEN",
        hide_env_values = true
    )]
    token: Option<String>,
    /// The cluster's CA certificate, to check the API's TLS certificate against. Default:
    /// the lab's ($CONVERGE_LAB_DIR/pki/ca.crt), else /etc/converge/pki/ca.crt.
    #[arg(long, global = true, env = "CONVERGE_CA", value_name = "FILE")]
    ca: Option<PathBuf>,
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
    /// Scrub: read every copy, verify checksums, compare copies, repair what differs.
    #[command(subcommand)]
    Scrub(ScrubCmd),
    /// Cluster-wide settings (override the nodes' [knobs]).
    #[command(subcommand)]
    Cluster(ClusterCmd),
    /// The cache tier: cache drives bound to the capacity drives of their node, in mode
    /// none, write (default for flash capacity) or read-write (default for HDD).
    #[command(subcommand)]
    Cache(cache::CacheCmd),
    /// Advice from what the cluster measured: `advise cache` gives the hit ratio a cache
    /// of each size would have had on each node's workload, and the mode that suits it.
    #[command(subcommand)]
    Advise(advise::AdviseCmd),
    /// A whole cluster on this machine: etcd plus N converged on 127.0.0.x (or each in
    /// its own network namespace), with faults to rehearse failures.
    #[command(subcommand)]
    Lab(LabCmd),
    /// API tokens: who may use the HTTP API and for what (read-only, operator, admin).
    #[command(subcommand)]
    Token(TokenCmd),
    /// Certificates: for nodes and etcd members (the cluster CA: peer RPC, API, etcd) and
    /// for NBD clients (the clients CA: qemu, nbdcopy over nbds://); revoke them.
    #[command(subcommand)]
    Cert(pki_cmd::CertCmd),
    /// Cluster keys: the key file (outside etcd, on every node) that wraps encrypted
    /// volumes' data keys; make it, rotate it (docs/adr/0011).
    #[command(subcommand)]
    Key(key_cmd::KeyCmd),
    /// Benchmark the cluster the way vendors' reference architectures do: fio workers
    /// ("VMs") on every node swept over queue depths, read/write mixes and block sizes,
    /// with a report (tables, charts, CPU, queue length, write amplification, endurance).
    #[command(subcommand)]
    Fleet(fleet::FleetCmd),
    /// vhost-user-blk: a volume as a qemu guest's virtio-blk disk on the node where the
    /// guest runs, without NBD in between (attach, detach, list; docs/VMS.md).
    #[command(subcommand)]
    Vhost(vhost::VhostCmd),
}

#[derive(Subcommand)]
enum TokenCmd {
    /// Make a token; it is printed this once and kept nowhere (etcd holds its hash).
    Create {
        /// What it is for: "ci", "grafana", a person's name.
        name: String,
        /// read-only (look), operator (run volumes, maintenance, caches, the fleet) or
        /// admin (also delete volumes, change settings, manage tokens).
        #[arg(long, default_value = "read-only")]
        role: converge_types::Role,
        /// How long it may be used, e.g. 30d, 12h, 90m (at most 10 years); without it, the
        /// token lasts until revoked.
        #[arg(long)]
        expires_in: Option<String>,
    },
    /// The tokens (ids, names, roles, expiry; never the secrets).
    List,
    /// Revoke a token by id: refused at once by the node that revokes it, by the others
    /// within 10 seconds. `internal` retires the shared token of a cluster made before
    /// nodes authenticated to each other with their certificates (once every node runs a
    /// version that does; docs/SECURITY.md, "Migrating").
    Revoke { id: String },
}

#[derive(Subcommand)]
enum ClusterCmd {
    /// Start a new cluster's trust: a CA (ca.crt, ca.key) in a PKI directory, and the first
    /// node's certificate if --node/--host are given. Run once, on the first host.
    Init {
        /// Where the CA goes (made 0700; ca.key is 0600).
        #[arg(long, default_value = pki_cmd::DEFAULT_PKI_DIR)]
        pki: PathBuf,
        /// The first node's id: its certificate and key go to the same directory.
        #[arg(long)]
        node: Option<u32>,
        /// The first node's IP addresses or DNS names (repeat for several).
        #[arg(long = "host")]
        hosts: Vec<String>,
    },
    /// Restart (or upgrade) the nodes one at a time: each waits until the cluster is
    /// healthy (every copy in sync), goes into maintenance (its volumes move to other
    /// owners), is restarted, comes back, leaves maintenance and resyncs. Stops at the
    /// first node that does not come back healthy.
    RollingRestart {
        /// How to restart a node: a shell command with {id}, {name} and {host} replaced,
        /// e.g. "ssh root@{host} systemctl restart converged" (install the new binary first
        /// for an upgrade). Without it, a lab's nodes are restarted by the lab
        /// ($CONVERGE_LAB_DIR).
        #[arg(long)]
        exec: Option<String>,
        /// Only these nodes (comma-separated ids), in id order. Default: every node.
        #[arg(long, value_delimiter = ',')]
        nodes: Vec<u32>,
        /// Seconds each wait may take (healthy before, back after, in sync again).
        #[arg(long, default_value_t = 900)]
        timeout: u64,
    },
    /// Show the cluster-wide settings.
    Settings,
    /// Change cluster-wide settings.
    Set {
        /// How long a down node's copies wait before they are rebuilt elsewhere, e.g.
        /// 600s, 10m, 1h (vSAN waits 60 minutes; the knob's default is 10 minutes).
        #[arg(long)]
        repair_delay: Option<String>,
        /// How far the volumes' provisioned bytes (sizes × copies, or (K+M)/K for parity)
        /// may exceed the pool's raw capacity: 1.0 (the default) allows none, 1.5 half as
        /// much again. A volume create, resize or clone beyond it is refused
        /// (docs/CAPACITY.md).
        #[arg(long, value_name = "R")]
        overcommit_ratio: Option<String>,
    },
}

/// "1.5" → 150 (percent, what the settings keep): 0.1 to 100, at most two decimals.
fn parse_overcommit_ratio(s: &str) -> Result<u32> {
    let r: f64 = s.trim().parse().map_err(|_| {
        anyhow::anyhow!("--overcommit-ratio {s:?} is not a number (e.g. 1.0, 1.5, 2)")
    })?;
    let pct = (r * 100.0).round();
    let (lo, hi) = (
        converge_api::OVERCOMMIT_PCT_MIN,
        converge_api::OVERCOMMIT_PCT_MAX,
    );
    if !r.is_finite() || pct < f64::from(lo) || pct > f64::from(hi) {
        bail!(
            "--overcommit-ratio {s} is outside {:.1} to {:.0} (1.0: provisioned may reach raw capacity, no more)",
            f64::from(lo) / 100.0,
            f64::from(hi) / 100.0
        );
    }
    Ok(pct as u32)
}

/// "90", "90s", "10m", "1h", "30d" → seconds.
fn parse_duration_s(s: &str) -> Result<u64> {
    let t = s.trim();
    let (num, mul) = match t.char_indices().last() {
        Some((i, 's')) => (&t[..i], 1),
        Some((i, 'm')) => (&t[..i], 60),
        Some((i, 'h')) => (&t[..i], 3600),
        Some((i, 'd')) => (&t[..i], 86_400),
        _ => (t, 1),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| anyhow::anyhow!("{s:?} is not a duration like 90s, 10m, 1h or 30d"))?;
    n.checked_mul(mul)
        .ok_or_else(|| anyhow::anyhow!("{s:?} is too long a duration"))
}

#[derive(Subcommand)]
enum ScrubCmd {
    /// Scrub volumes now (all of them, or those named). Each runs on its volume's owner,
    /// throttled by the scrub_bytes_per_s knob; the schedule (scrub_interval_h) runs it too.
    Start {
        /// Volumes to scrub; default: every volume.
        volumes: Vec<String>,
        /// Wait and print each result (else the scrubs run in the background; see
        /// `converge scrub status`).
        #[arg(long)]
        wait: bool,
        /// Only report bad or disagreeing blocks; do not rewrite them.
        #[arg(long)]
        no_repair: bool,
    },
    /// Last scrub result of each volume, and scrubs running now.
    Status,
}

#[derive(Subcommand)]
enum NodeCmd {
    /// Planned downtime: `on` moves the node's volumes away and stops writing its copies
    /// (refused if a resync or rebuild is running, or if any slab would keep fewer than
    /// min_replicas in-sync copies); `off` resyncs what it missed.
    Maintenance {
        /// Node id.
        node: u32,
        /// on or off.
        #[arg(value_parser = ["on", "off"])]
        state: String,
    },
    /// List nodes and whether they are live.
    List,
    /// Remove a node for good: its copies move to the other nodes first (each new copy is
    /// filled before the old one is dropped, so no slab loses redundancy), then its volumes
    /// move, its records leave the cluster and its converged stops. Refused if the other
    /// nodes cannot hold its copies (distinct nodes per slab, room). Needs an admin token.
    Remove {
        /// Node id.
        node: u32,
        /// Start the drain and return; run the command again to wait and remove.
        #[arg(long, conflicts_with = "cancel")]
        no_wait: bool,
        /// Stop draining the node (copies already moved stay where they are).
        #[arg(long)]
        cancel: bool,
        /// How long to wait for the drain, e.g. 30m, 6h.
        #[arg(long, default_value = "24h")]
        timeout: String,
    },
    /// Make a one-time token with which a new host gets node NODE's certificate (`node
    /// join`), so no key files are copied: the first step of adding a host (also `node
    /// add`). Needs an admin API token.
    #[command(alias = "add")]
    JoinToken {
        /// The new node's id (as in its converged.toml).
        #[arg(long)]
        node: u32,
        /// The new node's IP addresses or DNS names (repeat for several).
        #[arg(long = "host", required = true)]
        hosts: Vec<String>,
        /// How long it may be used, e.g. 30m, 1h (at most 7 days).
        #[arg(long, default_value = "1h")]
        ttl: String,
        /// The id is in use (a host with it is live, has drives or a certificate): give it
        /// to a new host, revoking the old host's certificates when the new one is issued.
        /// A removed id is never used again, replace or not.
        #[arg(long)]
        replace: bool,
    },
    /// On a new host: trade a join token for this node's certificate. The key is made here
    /// and never leaves; the cluster is checked against the CA fingerprint in the token.
    Join {
        /// The token from `converge node join-token`.
        #[arg(long, env = "CONVERGE_JOIN_TOKEN", hide_env_values = true)]
        token: String,
        /// Where to write ca.crt, node.crt and node.key (made 0700).
        #[arg(long, default_value = pki_cmd::DEFAULT_PKI_DIR)]
        pki: PathBuf,
    },
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
        /// simple (one copy), mirror-2, mirror-3, or parity-K+M (K data and M parity chunks
        /// per slab, each on its own node; e.g. parity-2+1, parity-4+2; docs/adr/0008).
        #[arg(long, default_value = "mirror-3")]
        resiliency: String,
        /// Node that owns (serves) the volume; default: the node answering the API.
        #[arg(long)]
        owner: Option<u32>,
        /// Mirror-accelerated parity (parity-K+1 and parity-K+2 only): a mirror part of
        /// this size (e.g. 20G) or share of the volume (e.g. 20%), rounded up to whole
        /// extents. New data lands mirrored (mirror-2 / mirror-3) while the part has room;
        /// when it is over 85 % full, the least recently written data is rotated into
        /// parity in the background until it is at 70 % (docs/adr/0009).
        #[arg(long, value_name = "SIZE|PCT%")]
        mirror_part: Option<String>,
        /// Compress the volume's data on its drives: none, lz4 (fast, for write-heavy
        /// volumes) or zstd (level 1: a third more saving than lz4 for twice its CPU).
        /// Each copy compresses groups of 16 KiB, stores a group that does not shrink by a
        /// block as is, and reads back whole blocks; mirror and simple volumes only
        /// (docs/adr/0010). `volume set` changes it later.
        #[arg(long, default_value = "none")]
        compression: String,
        /// Encrypt the volume at rest: AES-256-XTS on the owner, so the drives, caches and
        /// copies hold only ciphertext. Its data key is wrapped by the cluster key file
        /// (`converge key`), which every node that may serve it needs. Not with
        /// --compression (docs/adr/0011).
        #[arg(long)]
        encrypt: bool,
        #[command(flatten)]
        qos: QosArgs,
    },
    /// Wrap encrypted volumes' data keys again with the current cluster key (after
    /// `converge key add`); the data is not rewritten.
    Rekey {
        /// The volume; or --all.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        name: Option<String>,
        /// Every encrypted volume.
        #[arg(long)]
        all: bool,
    },
    /// Change a volume's settings live: how later writes are compressed (what is stored
    /// keeps its form until it is written again), and its QoS limits and reservation (in
    /// force for the next request; docs/QOS.md).
    Set {
        name: String,
        /// none, lz4 or zstd.
        #[arg(long)]
        compression: Option<String>,
        /// Replace the volume's QoS with the --iops-limit, --bw-limit, --burst and
        /// --iops-reserve given here (any left out: none); `--qos none` clears them all.
        #[arg(long, value_name = "none")]
        qos: Option<String>,
        #[command(flatten)]
        limits: QosArgs,
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
    /// Hand a volume over to another node cleanly: the new owner fences the copies with a
    /// new epoch and serves it; clients connected to the old owner are forwarded.
    Move {
        name: String,
        /// Node id of the new owner.
        #[arg(long)]
        to: u32,
    },
    /// Snapshots: crash-consistent and instant (nothing is copied), each a read-only NBD
    /// export `VOLUME@SNAPSHOT`; every resiliency, compressed or not (docs/SNAPSHOTS.md).
    #[command(subcommand)]
    Snapshot(SnapshotCmd),
    /// A new volume that reads as a snapshot until written: instant (nothing is copied;
    /// unchanged blocks are read from the snapshot), so one golden image serves many VMs.
    /// The snapshot cannot be deleted while clones read from it (flatten or delete them).
    Clone {
        /// The snapshot, VOLUME@SNAPSHOT.
        source: String,
        /// The clone's name.
        name: String,
        /// Preferred owner; default: the node answering the API.
        #[arg(long)]
        owner: Option<u32>,
        /// simple, mirror-2 or mirror-3; default: the parent's.
        #[arg(long)]
        resiliency: Option<String>,
        /// none, lz4 or zstd: how the clone's own writes are stored (mirror clones);
        /// default: none.
        #[arg(long)]
        compression: Option<String>,
    },
    /// Copy into a clone every block it still reads from its parent snapshot, then cut
    /// the link (the snapshot may then be deleted). Runs while the clone is in use.
    Flatten { name: String },
    /// Which runs of the volume changed between two snapshots (or since one, with no
    /// --to): from the copies' block metadata, in 4 KiB blocks; no data is read.
    Changes {
        volume: String,
        /// The older snapshot.
        #[arg(long)]
        from: String,
        /// The newer snapshot (absent: the volume now).
        #[arg(long)]
        to: Option<String>,
    },
    /// Write what changed between two snapshots (or, without --from, the whole snapshot)
    /// to a file: an incremental backup. Only the changed runs are read, found from the
    /// copies' block metadata; the format is docs/FORMAT-diff.md. Runs on a cluster node
    /// (it reads through the node's NBD socket).
    ExportDiff {
        volume: String,
        /// The older snapshot (absent: a full image of --to).
        #[arg(long)]
        from: Option<String>,
        /// The newer snapshot, whose content the diff leads to.
        #[arg(long)]
        to: String,
        /// The file to write ('-': standard output); an existing file is not overwritten.
        file: PathBuf,
        /// The NBD unix socket to read through (default: the owner's, from the API).
        #[arg(long)]
        socket: Option<PathBuf>,
    },
    /// Apply a diff from export-diff to a volume, then take the diff's newer snapshot on
    /// it, so the next diff of the chain applies on top. A diff with --from needs that
    /// snapshot on the volume, with nothing written since (else refused). A file is checked
    /// whole before anything is written.
    ImportDiff {
        volume: String,
        /// The diff file ('-': standard input, checked as it is applied).
        file: PathBuf,
        /// Apply even though the volume was written since the diff's older snapshot.
        #[arg(long)]
        force: bool,
        /// Do not take the diff's newer snapshot afterwards.
        #[arg(long)]
        no_snapshot: bool,
        /// The NBD unix socket to write through (default: the owner's, from the API).
        #[arg(long)]
        socket: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum SnapshotCmd {
    /// Take a snapshot now: it holds every write acked before it and none started after
    /// (writes pause for the moment it takes, a few milliseconds per slab's copies).
    Create {
        volume: String,
        /// Its name (letters, digits, '-', '_', '.'; at most 64 per volume).
        name: String,
    },
    /// List a volume's snapshots with their read-only NBD URIs, and what the drives keep
    /// for each (KEPT, on every copy) and what deleting it would free (FREED BY DELETE),
    /// as the volume's owner counts them from its copies' metadata.
    List {
        volume: String,
        /// Leave out the space figures (no question to the owner's copies).
        #[arg(long)]
        no_space: bool,
    },
    /// Delete a snapshot: the space only it holds returns; older snapshots keep what they
    /// read. Cut short (a node unreachable), run it again to finish.
    Delete { volume: String, name: String },
    /// Roll the volume back to a snapshot: every slab is rewritten with what the snapshot
    /// holds (the snapshots stay). Stop the volume's clients first: a write racing the
    /// rollback may land before or after the part it touches.
    Rollback {
        volume: String,
        name: String,
        /// Confirm: the volume's current data is overwritten.
        #[arg(long)]
        yes: bool,
    },
}

/// Per-volume QoS (docs/QOS.md).
#[derive(Args, Clone, Debug, Default)]
struct QosArgs {
    /// Most I/Os per second (every request counts one, whatever its size), enforced on the
    /// owner.
    #[arg(long, value_name = "IOPS")]
    iops_limit: Option<u64>,
    /// Most bytes per second, reads and writes together, e.g. 200M.
    #[arg(long, value_name = "SIZE")]
    bw_limit: Option<String>,
    /// How far I/O may run ahead of the limits after a quiet spell, in seconds of them
    /// (default 1; up to 60), e.g. 0.5.
    #[arg(long, value_name = "SECONDS")]
    burst: Option<f64>,
    /// I/Os per second the volume keeps when the volumes its owner serves contend: the
    /// owner holds back those without a reservation while this one falls short.
    #[arg(long, value_name = "IOPS")]
    iops_reserve: Option<u64>,
}

impl QosArgs {
    fn given(&self) -> bool {
        self.iops_limit.is_some()
            || self.bw_limit.is_some()
            || self.burst.is_some()
            || self.iops_reserve.is_some()
    }

    fn to_qos(&self) -> Result<converge_types::Qos> {
        let burst_ms = match self.burst {
            Some(b) if !(0.0..=60.0).contains(&b) || b.is_nan() => {
                bail!("--burst {b}: give seconds from 0 to 60")
            }
            Some(b) => Some((b * 1000.0).round() as u32),
            None => None,
        };
        let q = converge_types::Qos {
            iops_limit: self.iops_limit,
            bytes_limit: self.bw_limit.as_deref().map(parse_size).transpose()?,
            burst_ms,
            iops_reserve: self.iops_reserve,
        };
        q.check().map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(q)
    }
}

#[derive(Args, Clone)]
struct LabDir {
    /// Lab directory (default: $CONVERGE_LAB_DIR or ./converge-lab).
    #[arg(long, global = true)]
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
        /// Media the nodes are told their capacity drives are (default: ssd, or ram with
        /// --ram). It picks the default cache mode: read-write for hdd, write otherwise.
        #[arg(long, value_parser = ["ssd", "hdd", "nvme"])]
        capacity_media: Option<String>,
        /// Rated endurance (terabytes written, e.g. 600T) given to the capacity drives in
        /// the nodes' configs; default: the media's (flash: 1 drive write a day for 5
        /// years). `converge status` forecasts each drive's wear against it.
        #[arg(long)]
        drive_tbw: Option<String>,
        /// Cache drives per node (0 to 8; default 0: no cache tier). Each node binds its
        /// capacity drives to them; see `converge cache --help` for the modes.
        #[arg(long, default_value_t = 0)]
        cache_drives: u32,
        /// Size of each cache drive file, at least 64M (default 1G).
        #[arg(long)]
        cache_size: Option<String>,
        /// Put the cache drive files in RAM (/dev/shm/converge-lab-HASH/nodeN/cacheM.img),
        /// as a fast cache in front of disk-backed capacity drives; media ram unless
        /// --cache-media says otherwise. `lab down --purge` frees them.
        #[arg(long)]
        cache_in_ram: bool,
        /// Media the nodes are told their cache drives are (default: nvme, or ram with
        /// --cache-in-ram).
        #[arg(long, value_parser = ["nvme", "ssd", "ram"])]
        cache_media: Option<String>,
        /// Slab size of the pool (unit of placement).
        #[arg(long, default_value = "256M")]
        slab_size: String,
        /// Seconds to wait for the cluster to become healthy.
        #[arg(long, default_value_t = 60)]
        timeout: u64,
        /// Seconds a down node's copies wait before they are rebuilt elsewhere (the
        /// repair_delay_s knob; production default 600, short in the lab to rehearse it).
        #[arg(long, default_value_t = 60)]
        repair_delay: u64,
        /// Run each node in its own network namespace (cvg-TAG-nN), joined to a bridge by
        /// a veth pair, so `lab fault partition` can cut its link. Needs root and iproute2.
        /// Nodes get 10.X.Y.2, .3, ...; etcd listens on the bridge (10.X.Y.1).
        #[arg(long)]
        netns: bool,
        /// Runtime threads of each node (its `[node] threads`, 1 to 1024). Default: the
        /// machine's cores divided among the nodes, at least 1 — each node gets its share of
        /// the machine, as if it were a host of its own.
        #[arg(long)]
        threads_per_node: Option<usize>,
        /// etcd members (1, 3 or 5), over TLS with client certificates like the rest. With
        /// --netns, member M runs in node M's namespace, as etcd alongside the first nodes
        /// of a real cluster (so at most --nodes).
        #[arg(long, default_value_t = 1)]
        etcd_members: u32,
        /// etcd's space quota (its --quota-backend-bytes): past it etcd raises NOSPACE and
        /// refuses writes until space is freed (docs/OPERATIONS.md). The lab's etcd also
        /// compacts history older than 10 minutes.
        #[arg(long, default_value = "2G")]
        etcd_quota: String,
    },
    /// Stop exactly the processes this lab started (paused ones too) and delete its
    /// network namespaces, veths and bridge.
    Down {
        #[command(flatten)]
        dir: LabDir,
        /// Also delete the lab directory and RAM drives (all data).
        #[arg(long)]
        purge: bool,
    },
    /// Print shell lines that point later commands at this lab: eval "$(converge lab env)".
    /// CONVERGE_API lists every node's API, so commands still work while a node is down.
    Env {
        #[command(flatten)]
        dir: LabDir,
    },
    /// List the lab's processes: PID, state (running, paused, partitioned, dead) and
    /// network namespace.
    Ps {
        #[command(flatten)]
        dir: LabDir,
    },
    /// Inject a real fault into a lab node, to rehearse failures: signals to its process,
    /// a cut link, flipped bits in its drive files.
    Fault {
        #[command(flatten)]
        dir: LabDir,
        #[command(subcommand)]
        fault: FaultCmd,
    },
}

#[derive(Subcommand, Clone)]
enum FaultCmd {
    /// kill -9 the node's converged (no clean shutdown).
    Kill {
        /// Node id (1, 2, ...; see `converge lab ps`).
        node: u32,
    },
    /// Stop the node cleanly (SIGTERM).
    Stop {
        /// Node id (1, 2, ...; see `converge lab ps`).
        node: u32,
    },
    /// Start a stopped or killed node again with its data (in its namespace, if any).
    Restart {
        /// Node id (1, 2, ...; see `converge lab ps`).
        node: u32,
    },
    /// Freeze the node's converged (SIGSTOP): it keeps its connections but answers
    /// nothing, like a hung server; its etcd lease runs out and peers see it down.
    Pause {
        /// Node id (1, 2, ...; see `converge lab ps`).
        node: u32,
    },
    /// Continue a paused node (SIGCONT); it registers itself live again.
    Resume {
        /// Node id (1, 2, ...; see `converge lab ps`).
        node: u32,
    },
    /// Cut the node's network link (needs `lab up --netns`): the kernel drops every packet
    /// between it and peers, etcd and the CLI, while the process keeps running. With
    /// --from, cut only its links with those nodes (both ways), while all of them still
    /// reach etcd, the CLI and the other nodes: a partial, non-transitive partition.
    Partition {
        /// Node id (1, 2, ...; see `converge lab ps`).
        node: u32,
        /// Cut only the links between the node and these nodes (e.g. `--from 3` or
        /// `--from 2,4`), with an unreachable route to each end in the other's namespace.
        #[arg(long, value_delimiter = ',')]
        from: Vec<u32>,
    },
    /// Reconnect a partitioned node: its link and every link cut between it and other
    /// nodes, or with --from only the links with those nodes.
    Heal {
        /// Node id (1, 2, ...; see `converge lab ps`).
        node: u32,
        /// Restore only the links between the node and these nodes.
        #[arg(long, value_delimiter = ',')]
        from: Vec<u32>,
    },
    /// Flip one bit in each of --blocks random written data blocks of the node's drive files,
    /// as a failing disk would; reads of those blocks then fail their checksum and are
    /// served from another copy, which repairs them.
    Corrupt {
        /// Node id (1, 2, ...; see `converge lab ps`).
        node: u32,
        /// How many distinct blocks to damage.
        #[arg(long, default_value_t = 1)]
        blocks: u32,
        /// Seed of the random choice (printed), to replay it.
        #[arg(long)]
        seed: Option<u64>,
        /// Only this drive of the node (id from `converge drive list`).
        #[arg(long)]
        drive: Option<String>,
    },
    /// Fail one of the node's capacity drives as an I/O error would: the drive refuses
    /// every request until the node restarts, the node reports it failed, and its copies
    /// are rebuilt on other drives at once.
    FailDrive {
        /// Node id (1, 2, ...; see `converge lab ps`).
        node: u32,
        /// This drive (id from `converge drive list`); default: the node's drive holding
        /// the most copies.
        #[arg(long)]
        drive: Option<String>,
    },
}

impl FaultCmd {
    fn node(&self) -> u32 {
        match self {
            FaultCmd::Kill { node }
            | FaultCmd::Stop { node }
            | FaultCmd::Restart { node }
            | FaultCmd::Pause { node }
            | FaultCmd::Resume { node }
            | FaultCmd::Partition { node, .. }
            | FaultCmd::Heal { node, .. }
            | FaultCmd::Corrupt { node, .. }
            | FaultCmd::FailDrive { node, .. } => *node,
        }
    }
}

fn main() {
    // Output piped into `head` and the like: end quietly when the reader goes away, as
    // command-line tools do, instead of panicking on the failed write.
    // SAFETY: resetting a signal's disposition to the default touches no memory.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    http::set_token(resolve_token(&cli));
    http::set_ca(cli.ca.clone());
    if let Err(e) = run(cli) {
        eprintln!("converge: error: {e:#}");
        std::process::exit(1);
    }
}

/// The token to send: `--token`/`$CONVERGE_TOKEN`; without one, the lab's admin token
/// (`http::use_lab_dir`).
fn resolve_token(cli: &Cli) -> Option<String> {
    http::use_lab_dir(&lab::default_dir());
    cli.token.as_ref().map(|t| t.trim().to_string())
}

/// The API endpoints to try, in order, as a comma-separated list (what `http` takes).
fn api_base(cli: &Cli) -> Result<String> {
    if let Some(a) = &cli.api {
        return Ok(http::endpoints(a)?.join(","));
    }
    let dir = lab::default_dir();
    let lab = lab::load(&dir).context(
        "no API address given: use --api https://HOST:PORT[,https://HOST:PORT...], set \
         CONVERGE_API, or start a lab",
    )?;
    // Every node, those that serve first: a paused node accepts connections but never
    // answers, a partitioned one cannot be reached, so they are tried last.
    let (serving, rest): (Vec<&lab::LabNode>, Vec<&lab::LabNode>) = lab
        .nodes
        .iter()
        .partition(|n| lab::node_state(&lab, n).serves());
    if serving.is_empty() {
        bail!(
            "no node of the lab in {} is running and reachable (see `converge lab ps`)",
            dir.display()
        );
    }
    Ok(serving
        .iter()
        .chain(rest.iter())
        .map(|n| n.api.as_str())
        .collect::<Vec<_>>()
        .join(","))
}

fn run_token(cli: &Cli, c: &TokenCmd) -> Result<()> {
    let base = api_base(cli)?;
    match c {
        TokenCmd::Create {
            name,
            role,
            expires_in,
        } => {
            let expires_in_s = expires_in
                .as_deref()
                .map(|t| {
                    parse_duration_s(t).with_context(|| {
                        format!("--expires-in {t:?}: give a duration such as 30d, 12h or 90m")
                    })
                })
                .transpose()?;
            let body = serde_json::to_value(converge_api::CreateToken {
                name: name.clone(),
                role: *role,
                expires_in_s,
            })?;
            let t: converge_api::CreatedToken =
                http::call(&base, "POST", "/v1/tokens", Some(&body))?;
            if cli.json {
                return print_json(&t);
            }
            println!("{}", t.token);
            eprintln!(
                "{} token {} ({}): shown this once; keep it like a password",
                t.info.role, t.info.id, t.info.name
            );
        }
        TokenCmd::List => {
            let v: Vec<converge_api::TokenInfo> = http::call(&base, "GET", "/v1/tokens", None)?;
            if cli.json {
                return print_json(&v);
            }
            println!("{:<18} {:<10} {:<12} NAME", "ID", "ROLE", "EXPIRES");
            for t in v {
                let expires = t
                    .expires_unix
                    .map_or_else(|| "never".to_string(), |at| at.to_string());
                println!(
                    "{:<18} {:<10} {:<12} {}",
                    t.id,
                    t.role.to_string(),
                    expires,
                    t.name
                );
            }
        }
        TokenCmd::Revoke { id } => {
            let v: serde_json::Value =
                http::call(&base, "DELETE", &format!("/v1/tokens/{id}"), None)?;
            if cli.json {
                return print_json(&v);
            }
            println!("revoked token {id}");
        }
    }
    Ok(())
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
        Cmd::Node(NodeCmd::Maintenance { node, state }) => {
            let body = serde_json::to_value(converge_api::Maintenance { on: state == "on" })?;
            let v: Vec<NodeInfo> = http::call(
                &api_base(&cli)?,
                "POST",
                &format!("/v1/nodes/{node}/maintenance"),
                Some(&body),
            )?;
            if cli.json {
                return print_json(&v);
            }
            println!("node {node}: maintenance {state}");
            print!("{}", nodes_table(&v));
        }
        Cmd::Node(NodeCmd::JoinToken {
            node,
            hosts,
            ttl,
            replace,
        }) => {
            let body = serde_json::to_value(converge_api::CreateJoinToken {
                node: converge_types::NodeId(*node),
                hosts: hosts.clone(),
                ttl_s: Some(parse_duration_s(ttl)?),
                replace: *replace,
            })?;
            let t: converge_api::CreatedJoinToken =
                http::call(&api_base(&cli)?, "POST", "/v1/join-tokens", Some(&body))?;
            if cli.json {
                return print_json(&t);
            }
            println!(
                "join token for node {} at {} (one use, until unix time {}):\n  {}\non the new \
                 host, with any node's API that holds the CA key (where `cluster init` ran):\n  \
                 converge node join --api https://HOST:PORT --token {}",
                t.node,
                t.hosts.join(", "),
                t.expires_unix,
                t.token,
                t.token
            );
        }
        Cmd::Node(NodeCmd::Join { token, pki }) => {
            let api = cli.api.clone().ok_or_else(|| {
                anyhow::anyhow!(
                    "give --api https://HOST:PORT: a node of the cluster that holds the CA key"
                )
            })?;
            pki_cmd::join(&http::endpoints(&api)?.join(","), token, pki, cli.json)?;
        }
        Cmd::Node(NodeCmd::Remove {
            node,
            no_wait,
            cancel,
            timeout,
        }) => {
            let base = api_base(&cli)?;
            if *cancel {
                let v = remove::cancel(&base, *node)?;
                if cli.json {
                    return print_json(&v);
                }
                println!("node {node}: no longer drained");
                print!("{}", nodes_table(&v));
                return Ok(());
            }
            let timeout = Duration::from_secs(parse_duration_s(timeout)?);
            let r = remove::run(&base, *node, !*no_wait, timeout)?;
            if cli.json {
                return print_json(&r);
            }
            if let Some(r) = r {
                if !r.moved.is_empty() {
                    println!("volumes moved to other nodes: {}", r.moved.join(", "));
                }
                println!(
                    "node {node} removed (drives {}); its certificate is revoked and its \
                     converged stops by itself: disable its service on that host \
                     (`systemctl disable converged`)",
                    r.drives
                        .iter()
                        .map(|d| d.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
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
        Cmd::Cache(c) => cache::run(c, cli.json, &api_base(&cli)?)?,
        Cmd::Advise(c) => advise::run(c, cli.json, &api_base(&cli)?)?,
        Cmd::Vhost(c) => vhost::run(c, cli.json, &api_base(&cli)?)?,
        Cmd::Scrub(c) => run_scrub(&cli, c)?,
        Cmd::Token(c) => run_token(&cli, c)?,
        Cmd::Cert(c) => pki_cmd::run(c, cli.json, &|| api_base(&cli))?,
        Cmd::Key(k) => key_cmd::run(k, api_base(&cli).ok().as_deref())?,
        Cmd::Cluster(ClusterCmd::Init { pki, node, hosts }) => pki_cmd::init(pki, *node, hosts)?,
        Cmd::Cluster(ClusterCmd::RollingRestart {
            exec,
            nodes,
            timeout,
        }) => {
            let how = match exec {
                Some(t) => rolling::Restart::Exec(t.clone()),
                None => {
                    let dir = lab::default_dir();
                    if lab::load(&dir).is_err() {
                        bail!(
                            "give --exec with the command that restarts a node (e.g. \
                             \"ssh root@{{host}} systemctl restart converged\"); without it \
                             only a lab's nodes can be restarted, and there is no lab in {}",
                            dir.display()
                        );
                    }
                    rolling::Restart::Lab(dir)
                }
            };
            let steps = rolling::run(&api_base(&cli)?, &how, nodes, Duration::from_secs(*timeout))?;
            if cli.json {
                return print_json(&steps);
            }
            println!(
                "rolling restart done: {} nodes, every copy in sync",
                steps.len()
            );
        }
        Cmd::Cluster(c) => {
            let base = api_base(&cli)?;
            let v: converge_api::Settings = match c {
                ClusterCmd::Init { .. } | ClusterCmd::RollingRestart { .. } => {
                    bail!("handled above")
                }
                ClusterCmd::Settings => http::call(&base, "GET", "/v1/settings", None)?,
                ClusterCmd::Set {
                    repair_delay,
                    overcommit_ratio,
                } => {
                    let body = serde_json::to_value(converge_api::Settings {
                        repair_delay_s: repair_delay
                            .as_deref()
                            .map(parse_duration_s)
                            .transpose()?,
                        overcommit_pct: overcommit_ratio
                            .as_deref()
                            .map(parse_overcommit_ratio)
                            .transpose()?,
                        ..Default::default()
                    })?;
                    http::call(&base, "POST", "/v1/settings", Some(&body))?
                }
            };
            if cli.json {
                return print_json(&v);
            }
            match v.repair_delay_s {
                Some(s) => println!("repair delay  {s} s (cluster setting)"),
                None => println!("repair delay  each node's repair_delay_s knob (default 600 s)"),
            }
            match v.overcommit_pct {
                Some(p) => println!(
                    "overcommit    {:.2}× (provisioned may reach {p}% of raw capacity)",
                    f64::from(p) / 100.0
                ),
                None => println!(
                    "overcommit    {:.2}× (the default: provisioned may reach raw capacity, no more)",
                    f64::from(converge_api::OVERCOMMIT_PCT_DEFAULT) / 100.0
                ),
            }
            for l in cache::settings_lines(&v) {
                println!("{l}");
            }
        }
    }
    Ok(())
}

/// A size (`20G`) or a share of `whole` (`20%`, 1 to 100), in bytes.
fn parse_share(s: &str, whole: u64) -> Result<u64> {
    if let Some(pct) = s.strip_suffix('%') {
        let p: f64 = pct
            .trim()
            .parse()
            .map_err(|_| anyhow::anyhow!("{s:?} is not a share: expected e.g. 20%"))?;
        if !(p > 0.0 && p <= 100.0) {
            bail!("{s:?}: a share must be above 0 % and at most 100 %");
        }
        return Ok((whole as f64 * p / 100.0).ceil() as u64);
    }
    Ok(parse_size(s)?)
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

fn run_snapshot(cli: &Cli, cmd: &SnapshotCmd) -> Result<()> {
    use converge_api::{CreateSnapshot, RolledBack, SnapshotInfo};
    match cmd {
        SnapshotCmd::Create { volume, name } => {
            check_name(volume)?;
            let body = serde_json::to_value(CreateSnapshot { name: name.clone() })?;
            let s: SnapshotInfo = http::call(
                &api_base(cli)?,
                "POST",
                &format!("/v1/volumes/{volume}/snapshots"),
                Some(&body),
            )?;
            if cli.json {
                return print_json(&s);
            }
            println!("snapshot {volume}@{} taken (epoch {})", s.name, s.epoch);
            println!("uri  {}", s.uri);
        }
        SnapshotCmd::List { volume, no_space } => {
            check_name(volume)?;
            let base = api_base(cli)?;
            let plain = format!("/v1/volumes/{volume}/snapshots");
            // The space figures need the volume's owner; without it the list still comes.
            let (v, why): (Vec<SnapshotInfo>, Option<String>) = match no_space {
                true => (http::call(&base, "GET", &plain, None)?, None),
                false => match http::call(&base, "GET", &format!("{plain}?space=1"), None) {
                    Ok(v) => (v, None),
                    Err(e) => (
                        http::call(&base, "GET", &plain, None)?,
                        Some(format!("{e:#}")),
                    ),
                },
            };
            if cli.json {
                return print_json(&v);
            }
            let mut t = table::Table::new(&[
                "NAME",
                "EPOCH",
                "CREATED (UNIX)",
                "SIZE",
                "KEPT",
                "FREED BY DELETE",
                "CLONES",
                "URI",
            ]);
            let size = |b: Option<u64>| b.map_or_else(|| "-".to_string(), format_size);
            for s in &v {
                t.row(vec![
                    s.name.clone(),
                    s.epoch.to_string(),
                    s.created_unix.to_string(),
                    format_size(s.size_bytes),
                    size(s.kept_bytes),
                    size(s.freed_by_delete_bytes),
                    s.clones.len().to_string(),
                    s.uri.clone(),
                ]);
            }
            print!("{}", t.render());
            if let Some(n) = v.iter().find_map(|s| s.space_copies_unanswered) {
                if n > 0 {
                    println!("({n} copies did not answer: their share of KEPT is missing)");
                }
            }
            if let Some(why) = why {
                println!("(space figures unavailable: {why})");
            }
        }
        SnapshotCmd::Delete { volume, name } => {
            check_name(volume)?;
            let v: serde_json::Value = http::call(
                &api_base(cli)?,
                "DELETE",
                &format!("/v1/volumes/{volume}/snapshots/{name}"),
                None,
            )?;
            if cli.json {
                return print_json(&v);
            }
            println!("deleted snapshot {volume}@{name}");
        }
        SnapshotCmd::Rollback { volume, name, yes } => {
            check_name(volume)?;
            if !yes {
                bail!(
                    "rolling volume {volume} back to {name} overwrites its current data; stop its \
                     clients and run again with --yes"
                );
            }
            let r: RolledBack = http::call(
                &api_base(cli)?,
                "POST",
                &format!("/v1/volumes/{volume}/snapshots/{name}/rollback"),
                None,
            )?;
            if cli.json {
                return print_json(&r);
            }
            println!(
                "volume {volume} rolled back to {name} ({} rewritten)",
                format_size(r.bytes)
            );
        }
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
            mirror_part,
            compression,
            encrypt,
            qos,
        } => {
            check_name(name)?;
            let size_bytes = parse_size(size)?;
            let resiliency: Resiliency = resiliency.parse()?;
            let compression: converge_types::Compression = compression.parse()?;
            let mirror_part_bytes = mirror_part
                .as_deref()
                .map(|m| parse_share(m, size_bytes))
                .transpose()?;
            let body = serde_json::to_value(CreateVolume {
                name: name.clone(),
                size_bytes,
                resiliency,
                owner: owner.map(converge_types::NodeId),
                min_replicas: None,
                mirror_part_bytes,
                compression: (!compression.is_none()).then_some(compression),
                encrypt: *encrypt,
                qos: qos.given().then(|| qos.to_qos()).transpose()?,
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
        VolumeCmd::Snapshot(c) => return run_snapshot(cli, c),
        VolumeCmd::Clone {
            source,
            name,
            owner,
            resiliency,
            compression,
        } => {
            let Some((vol, snap)) = source.split_once('@') else {
                bail!("give the snapshot as VOLUME@SNAPSHOT, not {source:?}");
            };
            check_name(vol)?;
            check_name(name)?;
            let resiliency: Option<Resiliency> =
                resiliency.as_deref().map(str::parse).transpose()?;
            let body = serde_json::to_value(converge_api::CreateClone {
                name: name.clone(),
                owner: owner.map(converge_types::NodeId),
                resiliency,
                qos: None,
                compression: compression
                    .as_deref()
                    .map(str::parse::<converge_types::Compression>)
                    .transpose()?,
            })?;
            let v: VolumeInfo = http::call(
                &api_base(cli)?,
                "POST",
                &format!("/v1/volumes/{vol}/snapshots/{snap}/clone"),
                Some(&body),
            )?;
            if cli.json {
                return print_json(&v);
            }
            println!(
                "created volume {} ({}, {}) as a clone of {source}, owned by {}\n  {}",
                v.name,
                format_size(v.size_bytes),
                v.resiliency,
                v.owner_name,
                v.uri
            );
        }
        VolumeCmd::Flatten { name } => {
            check_name(name)?;
            let f: converge_api::Flattened = http::call_timeout(
                &api_base(cli)?,
                "POST",
                &format!("/v1/volumes/{name}/flatten"),
                None,
                std::time::Duration::from_secs(24 * 3600),
            )?;
            if cli.json {
                return print_json(&f);
            }
            println!(
                "volume {name} flattened: {} copied from {}; it no longer depends on it",
                format_size(f.bytes),
                f.parent
            );
        }
        VolumeCmd::Changes { volume, from, to } => {
            check_name(volume)?;
            let mut q = format!("from={from}");
            if let Some(t) = to {
                q.push_str(&format!("&to={t}"));
            }
            let c: converge_api::Changes = http::call(
                &api_base(cli)?,
                "GET",
                &format!("/v1/volumes/{volume}/changes?{q}"),
                None,
            )?;
            if cli.json {
                return print_json(&c);
            }
            println!(
                "{volume}: {} changed from {from} to {} in {} runs (of {})",
                format_size(c.changed_bytes),
                to.as_deref().unwrap_or("now"),
                c.runs.len(),
                format_size(c.size_bytes)
            );
            let mut t = table::Table::new(&["OFFSET", "LENGTH"]);
            for r in c.runs.iter().take(40) {
                t.row(vec![r.offset.to_string(), r.length.to_string()]);
            }
            print!("{}", t.render());
            if c.runs.len() > 40 {
                println!(
                    "... {} more runs (--json lists them all)",
                    c.runs.len() - 40
                );
            }
        }
        VolumeCmd::ExportDiff {
            volume,
            from,
            to,
            file,
            socket,
        } => {
            check_name(volume)?;
            let e = diff::export(
                &api_base(cli)?,
                volume,
                from.as_deref(),
                to,
                file,
                socket.as_deref(),
            )?;
            let what = match &e.header.from {
                Some(f) => format!("changes of {volume} from {f} to {to}"),
                None => format!("{volume}@{to} whole"),
            };
            let msg = format!(
                "exported {what}: {} of data, {} of zeros in {} records",
                format_size(e.totals.data_bytes),
                format_size(e.totals.zero_bytes),
                e.totals.records
            );
            // The diff may be on standard output: the summary goes to standard error.
            eprintln!("{msg}");
        }
        VolumeCmd::ImportDiff {
            volume,
            file,
            force,
            no_snapshot,
            socket,
        } => {
            check_name(volume)?;
            let i = diff::import(
                &api_base(cli)?,
                volume,
                file,
                *force,
                !no_snapshot,
                socket.as_deref(),
            )?;
            let what = match &i.header.from {
                Some(f) => format!("the changes from {f} to {}", i.header.to),
                None => format!("a full image of {}", i.header.to),
            };
            println!(
                "imported {what} into {volume}: {} of data, {} of zeros{}",
                format_size(i.totals.data_bytes),
                format_size(i.totals.zero_bytes),
                i.snapshot
                    .map(|s| format!("; snapshot {volume}@{s} taken"))
                    .unwrap_or_default()
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
            if let Some(p) = &v.parent {
                println!(
                    "clone of    {p} (unwritten blocks read from it; `volume flatten` copies them)"
                );
            }
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
            match v.written_bytes {
                Some(w) => println!(
                    "written     {} ({:.0}% of allocated; TRIMmed and zeroed blocks do not count)",
                    format_size(w),
                    100.0 * w as f64 / v.allocated_bytes.max(1) as f64
                ),
                None => println!(
                    "written     unknown: the nodes holding some slab's copies did not answer"
                ),
            }
            println!("compression {}", compression_line(&v));
            match &v.encryption {
                Some(e) => println!(
                    "encryption  {} (data key wrapped by cluster key {})",
                    e.cipher, e.key_id
                ),
                None => println!("encryption  none"),
            }
            println!("qos         {}", v.qos);
            if let Some(m) = &v.mirror_part {
                println!(
                    "mirror part {} ({}): {} used ({:.0}%), parity {} (rotates at {}% full, down to {}%)",
                    format_size(m.size_bytes),
                    m.resiliency,
                    format_size(m.mirror_bytes),
                    100.0 * m.mirror_bytes as f64 / m.size_bytes.max(1) as f64,
                    format_size(m.parity_bytes),
                    converge_types::ROTATE_HIGH_PCT,
                    converge_types::ROTATE_LOW_PCT,
                );
                if let (Some(n), Some(b)) = (m.rotations, m.rotated_bytes) {
                    println!(
                        "rotations   {n} span(s), {} moved into parity by this owner",
                        format_size(b)
                    );
                }
            }
            let mut t = Table::new(&["SLAB", "DRIVE", "NODE", "STATE", "WRITTEN", "STORED"]);
            for s in v.slabs.iter().flatten() {
                for e in &s.extents {
                    t.row(vec![
                        converge_types::SlabIndex(s.index).to_string(),
                        format!("{:016x}", e.drive.0),
                        e.node.to_string(),
                        if e.holds_acked {
                            format!("{} (holds every acked write)", e.state)
                        } else {
                            e.state.to_string()
                        },
                        e.written_bytes.map_or("-".into(), format_size),
                        e.stored_bytes.map_or("-".into(), format_size),
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
        VolumeCmd::Set {
            name,
            compression,
            qos,
            limits,
        } => {
            check_name(name)?;
            let compression = compression
                .as_deref()
                .map(str::parse::<converge_types::Compression>)
                .transpose()?;
            let qos = match qos.as_deref() {
                Some("none") if limits.given() => {
                    bail!("--qos none clears every limit: give it alone")
                }
                Some("none") => Some(converge_types::Qos::default()),
                Some(other) => bail!("--qos {other:?}: the only value is none"),
                None if limits.given() => Some(limits.to_qos()?),
                None => None,
            };
            if compression.is_none() && qos.is_none() {
                bail!("nothing to change: give --compression, or QoS (--iops-limit, --bw-limit, --burst, --iops-reserve, or --qos none)");
            }
            let body = serde_json::to_value(converge_api::VolumeSettings { compression, qos })?;
            let v: VolumeInfo = http::call(
                &api_base(cli)?,
                "POST",
                &format!("/v1/volumes/{name}/settings"),
                Some(&body),
            )?;
            if cli.json {
                return print_json(&v);
            }
            if compression.is_some() {
                println!(
                    "volume {}: compression {} for the writes that follow (stored data keeps its form until written again)",
                    v.name, v.compression
                );
            }
            if qos.is_some() {
                println!("volume {}: qos {}", v.name, v.qos);
            }
        }
        VolumeCmd::Rekey { name, all } => {
            let base = api_base(cli)?;
            let names: Vec<String> = match name {
                Some(n) => {
                    check_name(n)?;
                    vec![n.clone()]
                }
                None => {
                    debug_assert!(*all);
                    let v: Vec<VolumeInfo> = http::call(&base, "GET", "/v1/volumes", None)?;
                    v.into_iter()
                        .filter(|v| v.encryption.is_some())
                        .map(|v| v.name)
                        .collect()
                }
            };
            let mut done = Vec::new();
            for n in &names {
                let r: converge_api::Rekeyed =
                    http::call(&base, "POST", &format!("/v1/volumes/{n}/rekey"), None)
                        .with_context(|| format!("re-keying volume {n}"))?;
                if !cli.json {
                    if r.from_key == r.to_key {
                        println!("volume {n}: already wrapped by cluster key {}", r.to_key);
                    } else {
                        println!(
                            "volume {n}: data key re-wrapped from cluster key {} to {}",
                            r.from_key, r.to_key
                        );
                    }
                }
                done.push(r);
            }
            if cli.json {
                return print_json(&done);
            }
            if names.is_empty() {
                println!("no encrypted volumes");
            }
        }
        VolumeCmd::Move { name, to } => {
            check_name(name)?;
            let body = serde_json::to_value(converge_api::MoveVolume {
                to: converge_types::NodeId(*to),
            })?;
            let v: VolumeInfo = http::call(
                &api_base(cli)?,
                "POST",
                &format!("/v1/volumes/{name}/move"),
                Some(&body),
            )?;
            if cli.json {
                return print_json(&v);
            }
            println!("volume {} is now served by node {}", v.name, v.owner);
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
            capacity_media,
            drive_tbw,
            cache_drives,
            cache_size,
            cache_in_ram,
            cache_media,
            slab_size,
            timeout,
            repair_delay,
            netns,
            threads_per_node,
            etcd_members,
            etcd_quota,
        } => {
            let o = lab::UpOptions {
                threads_per_node: *threads_per_node,
                repair_delay_s: *repair_delay,
                dir: dir.path(),
                nodes: *nodes,
                drives_per_node: *drives_per_node,
                drive_size: parse_size(drive_size)?,
                ram: *ram,
                capacity_media: capacity_media.clone(),
                capacity_tbw: drive_tbw
                    .as_deref()
                    .map(|s| parse_size(s).map_err(|e| anyhow::anyhow!("--drive-tbw: {e}")))
                    .transpose()?,
                cache_drives: *cache_drives,
                cache_size: cache_size
                    .as_deref()
                    .map(|s| parse_size(s).map_err(|e| anyhow::anyhow!("--cache-size: {e}")))
                    .transpose()?,
                cache_in_ram: *cache_in_ram,
                cache_media: cache_media.clone(),
                slab_size: parse_size(slab_size)?,
                timeout: Duration::from_secs(*timeout),
                netns: *netns,
                etcd_members: *etcd_members,
                etcd_quota_bytes: parse_size(etcd_quota)
                    .map_err(|e| anyhow::anyhow!("--etcd-quota: {e}"))?,
            };
            let lab = lab::up(&o)?;
            if json_out {
                return print_json(&lab);
            }
            println!(
                "lab up in {}: etcd {} and {} nodes",
                lab.dir.display(),
                lab.etcd_endpoints().join(","),
                lab.nodes.len()
            );
            if let Some(d) = &lab.drives {
                println!("drives per node: {d}");
            }
            for n in lab
                .nodes
                .iter()
                .filter(|n| !n.cache_drives.is_empty())
                .take(1)
            {
                println!(
                    "cache drives: {} on node{} (likewise on every node); `converge cache \
                     status` shows them",
                    n.cache_drives
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                    n.id
                );
            }
            if let Some(net) = &lab.net {
                println!(
                    "network: bridge {} ({}/24), one namespace per node ({} ...)",
                    net.bridge,
                    net.bridge_addr(),
                    net.nodes.first().map(|n| n.netns.as_str()).unwrap_or("")
                );
            }
            println!(
                "point the CLI at it with:  eval \"$(converge lab env --dir {})\"",
                lab.dir.display()
            );
        }
        LabCmd::Down { dir, purge } => {
            let r = lab::down(&dir.path(), *purge)?;
            if json_out {
                print_json(&r)?;
            } else {
                if r.stopped.is_empty() {
                    println!("nothing was running");
                }
                for s in &r.stopped {
                    println!("stopped {s}");
                }
                if !r.removed.is_empty() {
                    println!("removed {}", r.removed.join(", "));
                }
                if let Some(d) = &r.ram_kept {
                    println!(
                        "the drive files in RAM stay in {} with the lab's data (cache drives may \
                         hold writes not yet destaged); `converge lab down --purge` frees them",
                        d.display()
                    );
                }
            }
            if !r.left.is_empty() {
                bail!(
                    "the lab is down but some of it remains: {}",
                    r.left.join("; ")
                );
            }
        }
        LabCmd::Env { dir } => {
            let l = lab::load(&dir.path())?;
            // Every node: the CLI moves on to the next when one is down.
            let api = l
                .nodes
                .iter()
                .map(|n| n.api.as_str())
                .collect::<Vec<_>>()
                .join(",");
            let token = lab::admin_token(&l.dir).unwrap_or_default();
            let ca = lab::ca_cert(&l.dir);
            if json_out {
                return print_json(&json!({
                    "CONVERGE_API": api, "CONVERGE_LAB_DIR": l.dir, "CONVERGE_ETCD": l.etcd_endpoints().join(","),
                    "CONVERGE_TOKEN": token, "CONVERGE_CA": ca
                }));
            }
            println!("export CONVERGE_API={api}");
            println!("export CONVERGE_TOKEN={token}");
            println!("export CONVERGE_CA={}", ca.display());
            println!("export CONVERGE_LAB_DIR={}", l.dir.display());
            println!("export CONVERGE_ETCD={}", l.etcd_endpoints().join(","));
        }
        LabCmd::Fault { dir, fault } => return run_fault(&dir.path(), fault, json_out),
        LabCmd::Ps { dir } => {
            let l = lab::load(&dir.path())?;
            // (process, state, namespace, nodes its link is cut from)
            let mut rows: Vec<(&lab::LabProc, String, Option<String>, Vec<u32>)> = l
                .etcd_procs()
                .into_iter()
                .map(|p| {
                    (
                        p,
                        node_state_word(lab::proc_state(p)).to_string(),
                        p.netns.clone(),
                        Vec::new(),
                    )
                })
                .collect();
            for n in &l.nodes {
                let st = lab::node_state(&l, n);
                rows.push((&n.proc, st.to_string(), n.proc.netns.clone(), st.cut_from));
            }
            if json_out {
                let v: Vec<_> = rows
                    .iter()
                    .map(|(p, state, ns, cut)| {
                        json!({
                            "name": p.name, "pid": p.pid, "running": lab::is_ours(p),
                            "state": state, "cut_from": cut, "netns": ns, "addr": p.addr,
                            "log": p.log,
                        })
                    })
                    .collect();
                return print_json(&v);
            }
            let mut t = Table::new(&["NAME", "PID", "STATE", "NETNS", "ADDRESS", "LOG"]);
            for (p, state, ns, _) in rows {
                t.row(vec![
                    p.name.clone(),
                    p.pid.to_string(),
                    state,
                    ns.unwrap_or_else(|| "-".into()),
                    p.addr.clone(),
                    p.log.display().to_string(),
                ]);
            }
            print!("{}", t.render());
            if let Some(d) = &l.drives {
                println!("drives per node: {d}");
            }
            if let Some(r) = &l.ram_dir {
                println!("drive files in RAM: {}", r.display());
            }
        }
    }
    Ok(())
}

/// "node2" or "node2, node4".
fn node_list(ids: &[u32]) -> String {
    ids.iter()
        .map(|i| format!("node{i}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn node_state_word(s: lab::ProcState) -> &'static str {
    match s {
        lab::ProcState::Running => "running",
        lab::ProcState::Paused => "paused",
        lab::ProcState::Dead => "dead",
    }
}

fn run_fault(dir: &std::path::Path, fault: &FaultCmd, json_out: bool) -> Result<()> {
    let mut l = lab::load(dir)?;
    let id = fault.node();
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
            format!("killed (SIGKILL to pid {})", n.proc.pid)
        }
        FaultCmd::Stop { .. } => {
            if !lab::stop_proc(&n.proc, Duration::from_secs(15)) {
                bail!("node{id} is not running");
            }
            format!("stopped (SIGTERM to pid {})", n.proc.pid)
        }
        FaultCmd::Restart { .. } => {
            lab::restart_node(&mut l, id)?;
            let pid = l.nodes.iter().find(|x| x.id == id).map(|x| x.proc.pid);
            if l.net.as_ref().is_some_and(|net| net.partitioned(id)) {
                format!(
                    "restarted (pid {}) but partitioned: it joins the cluster after \
                     `converge lab fault heal {id}`",
                    pid.unwrap_or(0)
                )
            } else {
                lab::wait_node(&l, id, Duration::from_secs(60))?;
                format!("restarted (pid {})", pid.unwrap_or(0))
            }
        }
        FaultCmd::Pause { .. } => {
            let pid = lab::pause_node(&l, id)?;
            format!(
                "paused (SIGSTOP to pid {pid}): it answers nothing and its lease runs out; \
                 `converge lab fault resume {id}` continues it"
            )
        }
        FaultCmd::Resume { .. } => {
            let pid = lab::resume_node(&l, id)?;
            format!("resumed (SIGCONT to pid {pid})")
        }
        FaultCmd::Partition { from, .. } if from.is_empty() => {
            let veth = lab::partition_node(&l, id)?;
            format!(
                "partitioned (link {veth} down): packets to and from it are dropped; \
                 `converge lab fault heal {id}` reconnects it"
            )
        }
        FaultCmd::Partition { from, .. } => {
            let cut = node_list(&lab::cut_node(&l, id, from)?);
            format!(
                "cut from {cut} (unreachable routes both ways): they cannot reach each other, \
                 while both still reach etcd and the other nodes; \
                 `converge lab fault heal {id} --from {}` restores the links",
                from.iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            )
        }
        FaultCmd::Heal { from, .. } if from.is_empty() => {
            let (veth, cut) = lab::heal_node(&l, id)?;
            let mut done = Vec::new();
            if let Some(v) = veth {
                done.push(format!("link {v} up"));
            }
            if !cut.is_empty() {
                done.push(format!("links with {} restored", node_list(&cut)));
            }
            format!("healed ({})", done.join("; "))
        }
        FaultCmd::Heal { from, .. } => {
            let healed = node_list(&lab::uncut_node(&l, id, from)?);
            format!("healed (links with {healed} restored)")
        }
        FaultCmd::FailDrive { drive, .. } => {
            let failed = nemesis::fail_drive(&l, id, drive.as_deref())?;
            if json_out {
                return print_json(&serde_json::json!({ "node": id, "drive": failed }));
            }
            format!("drive {failed} failed; its copies will be rebuilt on other drives")
        }
        FaultCmd::Corrupt {
            blocks,
            seed,
            drive,
            ..
        } => {
            let r = nemesis::corrupt(&l, id, *blocks, *seed, drive.as_deref())?;
            if json_out {
                return print_json(&r);
            }
            let mut t = Table::new(&[
                "DRIVE", "VOLUME", "SLAB", "BLOCK", "OFFSET", "BIT", "BYTE", "FILE",
            ]);
            for f in &r.flips {
                t.row(vec![
                    f.drive.clone(),
                    f.volume.clone(),
                    f.slab.to_string(),
                    f.block.to_string(),
                    f.offset_bytes.to_string(),
                    f.bit.to_string(),
                    format!("{:02x}->{:02x}", f.before, f.after),
                    f.path.clone(),
                ]);
            }
            print!("{}", t.render());
            let short = if (r.flips.len() as u32) < *blocks {
                format!(" (only {} written blocks were there)", r.written_blocks)
            } else {
                String::new()
            };
            println!(
                "node{id}: flipped one bit in each of {} written blocks{short} (seed {}); \
                 reads of them fail their checksum and are answered from another copy",
                r.flips.len(),
                r.seed
            );
            return Ok(());
        }
    };
    if json_out {
        return print_json(&json!({ "node": id, "result": what }));
    }
    println!("node{id} {what}");
    // A CLI pinned to this node's API alone would now hang or fail: say so.
    let cut_off = matches!(fault, FaultCmd::Partition { from, .. } if from.is_empty());
    if (cut_off
        || matches!(
            fault,
            FaultCmd::Pause { .. } | FaultCmd::Kill { .. } | FaultCmd::Stop { .. }
        ))
        && std::env::var("CONVERGE_API")
            .ok()
            .and_then(|a| http::endpoints(&a).ok())
            .is_some_and(|a| a == [n.api.trim_end_matches('/')])
    {
        eprintln!(
            "note: CONVERGE_API points at node{id} ({}) only; run `eval \"$(converge lab \
             env)\"` (every node's API) or `unset CONVERGE_API` so commands use a node of \
             the lab that answers",
            n.api
        );
    }
    Ok(())
}

fn nodes_table(v: &[NodeInfo]) -> String {
    let mut t = Table::new(&["ID", "NAME", "STATE", "RPC", "API", "NBD SOCKET"]);
    for n in v {
        t.row(vec![
            n.id.to_string(),
            n.name.clone(),
            {
                let mut state = if n.live { "live" } else { "down" }.to_string();
                if n.maintenance {
                    state.push_str(", maintenance");
                }
                if n.draining {
                    state.push_str(", draining");
                }
                state
            },
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
        "WRITTEN",
        "STORED",
        "CACHE",
        "PATH",
    ]);
    for d in v {
        t.row(vec![
            format!("{:016x}", d.id.0),
            d.node.to_string(),
            format!("{:?}", d.role).to_lowercase(),
            format!("{:?}", d.media).to_lowercase(),
            format_size(d.size_bytes),
            if d.role == DriveRole::Cache {
                "-".into()
            } else {
                match d.slots_total {
                    // A thin drive: extents placed, and the slots it has.
                    Some(slots) => {
                        format!("{}/{} ({slots} slots)", d.extents_used, d.extents_total)
                    }
                    None => format!("{}/{}", d.extents_used, d.extents_total),
                }
            },
            d.written_bytes.map_or("-".into(), format_size),
            d.stored_bytes.map_or("-".into(), format_size),
            match (d.role, d.cache) {
                (DriveRole::Cache, _) => "cache".into(),
                (_, Some(c)) => cache::short_id(c),
                (_, None) => "-".into(),
            },
            d.path.clone(),
        ]);
    }
    t.render()
}

/// A volume's compression and what it saves, for `volume show`.
fn compression_line(v: &VolumeInfo) -> String {
    match (v.written_bytes, v.stored_bytes) {
        (Some(w), Some(st)) if w > 0 => {
            let saved = w.saturating_sub(st);
            format!(
                "{}: one copy stores {} of {} written, {} saved ({:.0}%) on each copy",
                v.compression,
                format_size(st),
                format_size(w),
                format_size(saved),
                100.0 * saved as f64 / w as f64
            )
        }
        _ => v.compression.to_string(),
    }
}

fn volumes_table(v: &[VolumeInfo]) -> String {
    let mut t = Table::new(&[
        "NAME",
        "SIZE",
        "RESILIENCY",
        "OWNER",
        "ALLOCATED",
        "WRITTEN",
        "STORED",
        "COMPRESSION",
        "ENCRYPTION",
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
            x.written_bytes.map_or("-".into(), format_size),
            x.stored_bytes.map_or("-".into(), format_size),
            x.compression.to_string(),
            x.encryption
                .as_ref()
                .map_or("-".into(), |e| format!("key {}", e.key_id)),
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
    if let Some(e) = &s.etcd {
        println!("etcd      {}", etcd_line(e));
    }
    let c = &s.capacity;
    let of_raw = |b: u64| b as f64 / c.total_bytes.max(1) as f64;
    println!(
        "capacity  {} used of {} raw ({}%), {} free ({} provisioned: {:.2}× raw, overcommit limit {:.2}×; {} of volume data allocated, {} written)",
        format_size(c.used_bytes),
        format_size(c.total_bytes),
        // Rounded down, as the health line's near-full (85 %) and full (95 %) are.
        (u128::from(c.used_bytes) * 100 / u128::from(c.total_bytes.max(1))),
        format_size(c.free_bytes),
        format_size(c.provisioned_bytes),
        of_raw(c.provisioned_bytes),
        // A node of an older build does not say: the default.
        f64::from(if c.overcommit_pct == 0 {
            converge_api::OVERCOMMIT_PCT_DEFAULT
        } else {
            c.overcommit_pct
        }) / 100.0,
        format_size(c.allocated_bytes),
        c.written_bytes.map_or("?".into(), format_size)
    );
    if let (Some(st), Some(saved)) = (c.stored_bytes, c.compression_saved_bytes) {
        println!(
            "stored    {} on the drives (every copy), {} saved by compression",
            format_size(st),
            format_size(saved)
        );
    }
    if !c.usable_bytes.is_empty() {
        let per: Vec<String> = c
            .usable_bytes
            .iter()
            .map(|(p, b)| format!("{p} {}", format_size(*b)))
            .collect();
        println!(
            "usable    {} (volume data the empty pool holds)",
            per.join(", ")
        );
    }
    if let Some(n) = c.rebuild_reserve_node {
        println!(
            "reserve   {} kept free elsewhere to rebuild node {n}, the fullest",
            format_size(c.rebuild_reserve_bytes)
        );
    }
    println!("\nNODES\n{}", nodes_table(&s.nodes));
    println!("DRIVES\n{}", drives_table(&s.drives));
    println!("VOLUMES\n{}", volumes_table(&s.volumes));
    if !s.caches.is_empty() {
        println!("CACHES\n{}", cache::status_table(&s.caches));
    }
    if s.drives.iter().any(|d| d.wear.is_some()) {
        println!("ENDURANCE\n{}", endurance_table(&s.drives));
    }
    if !s.jobs.is_empty() {
        println!("JOBS\n{}", jobs_table(&s.jobs));
    }
    for w in &s.warnings {
        println!("warning: {w}");
    }
}

/// etcd in one line: members answering, the revision, the leader's database size and how
/// much of it is in use, and any alarm.
fn etcd_line(e: &converge_api::EtcdInfo) -> String {
    let answering: Vec<&converge_api::EtcdMember> =
        e.members.iter().filter(|m| m.error.is_none()).collect();
    let mut line = format!("{}/{} members answer", answering.len(), e.members.len());
    if let Some(m) = answering
        .iter()
        .find(|m| m.leader)
        .or_else(|| answering.first())
    {
        line.push_str(&format!(
            ", revision {}, database {} ({} in use)",
            m.revision,
            format_size(m.db_size_bytes),
            format_size(m.db_in_use_bytes)
        ));
    }
    for a in &e.alarms {
        line.push_str(&format!(", ALARM {a}"));
    }
    line
}

/// Each drive's lifetime writes, write rate per day over the last hour, day and week, and
/// what the longest of them does to its rated endurance (docs/ENDURANCE.md).
fn endurance_table(drives: &[DriveInfo]) -> String {
    let mut t = table::Table::new(&[
        "DRIVE", "NODE", "WRITTEN", "1H/DAY", "24H/DAY", "7D/DAY", "RATED", "USED", "LEFT",
        "WARRANTY",
    ]);
    let per_day = |w: &converge_api::DriveWear, name: &str| {
        w.write_rates
            .iter()
            .find(|r| r.window == name)
            .map_or("-".into(), |r| {
                let v = format_size((r.bytes_per_s * 86_400.0) as u64);
                // A window the history does not fill yet says over how long it was measured.
                let full = match name {
                    "1h" => 3600,
                    "24h" => 86_400,
                    _ => 7 * 86_400,
                };
                if r.over_s + 300 < full {
                    format!("{v} ({})", human_secs(r.over_s))
                } else {
                    v
                }
            })
    };
    for d in drives {
        let Some(w) = &d.wear else { continue };
        let left = match (w.days_to_rated_tbw, w.rated_tbw_bytes) {
            // Under an hour of history the forecast is said to be one, not warned on.
            (Some(days), _) if w.forecast_span_s < 3600 => {
                format!(
                    "{days:.0} days ({} of history)",
                    human_secs(w.forecast_span_s)
                )
            }
            (Some(days), _) => format!(
                "{days:.0} days{}",
                if w.wears_out_before_warranty {
                    " (!)"
                } else {
                    ""
                }
            ),
            (None, Some(_)) => "no writes".into(),
            (None, None) => "unrated".into(),
        };
        let warranty = w.warranty_ends_unix.map_or("-".into(), |e| {
            format!(
                "{:.0} days",
                e.saturating_sub(w.updated_unix) as f64 / 86_400.0
            )
        });
        t.row(vec![
            format!("{:016x}", d.id.0),
            d.node.to_string(),
            format_size(w.lifetime_written_bytes),
            per_day(w, "1h"),
            per_day(w, "24h"),
            per_day(w, "7d"),
            w.rated_tbw_bytes.map_or("-".into(), format_size),
            w.used_pct.map_or("-".into(), |p| format!("{p:.3} %")),
            left,
            warranty,
        ]);
    }
    t.render()
}

/// `90 s`, `12 min`, `5 h`, `3 d`.
fn human_secs(s: u64) -> String {
    match s {
        s if s < 120 => format!("{s} s"),
        s if s < 7200 => format!("{} min", s / 60),
        s if s < 2 * 86_400 => format!("{} h", s / 3600),
        s => format!("{} d", s / 86_400),
    }
}

fn run_scrub(cli: &Cli, c: &ScrubCmd) -> Result<()> {
    let base = api_base(cli)?;
    match c {
        ScrubCmd::Start {
            volumes,
            wait,
            no_repair,
        } => {
            let names: Vec<String> = if volumes.is_empty() {
                let v: Vec<VolumeInfo> = http::call(&base, "GET", "/v1/volumes", None)?;
                v.into_iter().map(|v| v.name).collect()
            } else {
                volumes.clone()
            };
            let body = serde_json::to_value(converge_api::ScrubRequest {
                wait: *wait,
                repair: !*no_repair,
            })?;
            let mut results = Vec::new();
            for n in &names {
                check_name(n)?;
                if *wait {
                    let r: converge_api::ScrubResult = http::call(
                        &base,
                        "POST",
                        &format!("/v1/volumes/{n}/scrub"),
                        Some(&body),
                    )?;
                    results.push(r);
                } else {
                    let _: serde_json::Value = http::call(
                        &base,
                        "POST",
                        &format!("/v1/volumes/{n}/scrub"),
                        Some(&body),
                    )?;
                    if !cli.json {
                        println!("scrub of {n} started");
                    }
                }
            }
            if *wait {
                if cli.json {
                    return print_json(&results);
                }
                print!("{}", scrub_table(&results));
            }
        }
        ScrubCmd::Status => {
            let r: Vec<converge_api::ScrubResult> = http::call(&base, "GET", "/v1/scrub", None)?;
            let s: Status = http::call(&base, "GET", "/v1/status", None)?;
            let running: Vec<converge_api::JobInfo> =
                s.jobs.into_iter().filter(|j| j.kind == "scrub").collect();
            if cli.json {
                return print_json(&serde_json::json!({"last": r, "running": running}));
            }
            if !running.is_empty() {
                println!("RUNNING\n{}", jobs_table(&running));
            }
            println!("LAST RESULTS\n{}", scrub_table(&r));
        }
    }
    Ok(())
}

fn scrub_table(v: &[converge_api::ScrubResult]) -> String {
    let mut t = table::Table::new(&[
        "VOLUME", "NODE", "CHECKED", "BAD", "MISMATCH", "REPAIRED", "LOST", "FINISHED", "ERROR",
    ]);
    for r in v {
        t.row(vec![
            r.volume.clone(),
            r.node.to_string(),
            format_size(r.blocks_checked * 4096),
            r.bad_checksums.to_string(),
            r.mismatches.to_string(),
            r.repaired.to_string(),
            r.snapshot_blocks_lost.to_string(),
            r.finished_unix.to_string(),
            r.error.clone().unwrap_or_default(),
        ]);
    }
    t.render()
}

fn jobs_table(v: &[converge_api::JobInfo]) -> String {
    let mut t = table::Table::new(&[
        "KIND", "NODE", "VOLUME", "SLAB", "DONE", "TOTAL", "ETA", "DETAIL",
    ]);
    for j in v {
        t.row(vec![
            j.kind.clone(),
            j.node.to_string(),
            j.volume.clone(),
            j.slab.to_string(),
            format_size(j.bytes_done),
            if j.bytes_total > 0 {
                format_size(j.bytes_total)
            } else {
                "comparing".into()
            },
            j.eta_s.map_or("-".into(), |s| format!("{s}s")),
            j.detail.clone(),
        ]);
    }
    t.render()
}

#[cfg(test)]
mod tests {
    use super::*;
    use converge_types::{DriveId, MediaType, NodeId};

    fn drive(id: u64, role: DriveRole, cache: Option<u64>) -> DriveInfo {
        DriveInfo {
            id: DriveId(id),
            node: NodeId(1),
            path: format!("/lab/d{id}.img"),
            role,
            media: MediaType::Ssd,
            size_bytes: 2 << 30,
            extents_total: if role == DriveRole::Cache { 0 } else { 7 },
            extents_used: 1,
            slab_size_bytes: 256 << 20,
            failed: None,
            cache: cache.map(DriveId),
            written_bytes: None,
            stored_bytes: None,
            slots_total: None,
            committed_bytes: None,
            wear: None,
        }
    }

    #[test]
    fn drive_list_shows_the_bound_cache() {
        let out = drives_table(&[
            drive(1, DriveRole::Capacity, Some(0xabcd_ef01_2345_6789)),
            drive(2, DriveRole::Capacity, None),
            drive(0xabcd_ef01_2345_6789, DriveRole::Cache, None),
        ]);
        let lines: Vec<&str> = out.lines().collect();
        // The cell of a column starts where its header does (the table aligns them).
        let cell = |l: &str, h: &str| -> String {
            let at = lines[0].find(h).expect("column");
            l[at..].split_whitespace().next().unwrap_or("").to_string()
        };
        assert_eq!(cell(lines[1], "CACHE"), "abcdef01");
        assert_eq!(cell(lines[2], "CACHE"), "-");
        assert_eq!(cell(lines[3], "CACHE"), "cache");
        assert_eq!(cell(lines[1], "SLABS USED"), "1/7");
        assert_eq!(
            cell(lines[3], "SLABS USED"),
            "-",
            "no slabs on a cache drive"
        );
    }
}

#[cfg(test)]
mod parse_tests {
    use super::*;

    fn up(args: &[&str]) -> Result<LabCmd, clap::Error> {
        let mut v = vec!["converge", "lab", "up"];
        v.extend_from_slice(args);
        Cli::try_parse_from(v).map(|c| match c.cmd {
            Cmd::Lab(l) => l,
            _ => panic!("not a lab command"),
        })
    }

    fn fault(args: &[&str]) -> FaultCmd {
        let mut v = vec!["converge", "lab", "fault"];
        v.extend_from_slice(args);
        match Cli::try_parse_from(v).expect("parses").cmd {
            Cmd::Lab(LabCmd::Fault { fault, .. }) => fault,
            _ => panic!("not a lab fault command"),
        }
    }

    #[test]
    fn partition_from_takes_one_or_more_nodes() {
        match fault(&["partition", "1"]) {
            FaultCmd::Partition { node: 1, from } => assert!(from.is_empty()),
            _ => panic!("not a partition"),
        }
        match fault(&["partition", "1", "--from", "2,4"]) {
            FaultCmd::Partition { node: 1, from } => assert_eq!(from, vec![2, 4]),
            _ => panic!("not a partition"),
        }
        match fault(&["heal", "3", "--from", "1"]) {
            FaultCmd::Heal { node: 3, from } => assert_eq!(from, vec![1]),
            _ => panic!("not a heal"),
        }
    }

    #[test]
    fn lab_up_cache_flags() {
        match up(&[
            "--cache-drives",
            "2",
            "--cache-size",
            "512M",
            "--cache-in-ram",
        ])
        .unwrap()
        {
            LabCmd::Up {
                cache_drives,
                cache_size,
                cache_in_ram,
                cache_media,
                capacity_media,
                ..
            } => {
                assert_eq!(cache_drives, 2);
                assert_eq!(cache_size.as_deref(), Some("512M"));
                assert!(cache_in_ram);
                assert_eq!((cache_media, capacity_media), (None, None));
            }
            _ => panic!("not lab up"),
        }
        assert!(
            up(&["--cache-media", "hdd"]).is_err(),
            "hdd is no cache media"
        );
        assert!(up(&["--capacity-media", "ram"]).is_err());
        assert!(up(&["--capacity-media", "hdd", "--cache-media", "nvme"]).is_ok());
        assert!(up(&["--cache-drives", "-1"]).is_err());
    }
}
