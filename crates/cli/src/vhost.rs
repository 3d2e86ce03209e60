//! `converge vhost`: volumes offered to qemu guests as vhost-user-blk disks, on the node
//! where the guest runs (docs/VMS.md).

use crate::http;
use crate::table::Table;
use anyhow::{bail, Context, Result};
use clap::Subcommand;
use converge_api::{AttachVhost, NodeInfo, VhostInfo};
use converge_types::{format_size, NodeId};

#[derive(Subcommand)]
pub enum VhostCmd {
    /// Offer a volume (or a snapshot, VOLUME@SNAPSHOT, read-only) on a node as a
    /// vhost-user-blk disk: prints the unix socket and the qemu options that attach it. The
    /// guest needs shared memory (-object memory-backend-memfd,share=on). Attaching again
    /// answers the same socket.
    Attach {
        volume: String,
        /// The node the guest runs on (default: the node the API address reaches).
        #[arg(long)]
        node: Option<u32>,
        /// Queues offered (1-16); the guest uses at most this many (qemu's num-queues).
        #[arg(long, default_value_t = 2)]
        queues: u16,
        /// Keep the volume's owner where it is when a guest starts on this disk. By
        /// default the node takes the volume over at the guest's first request (a boot, or
        /// a live migration arriving), so its I/O is served locally, not forwarded.
        #[arg(long)]
        owner_stays: bool,
    },
    /// Stop offering a volume on a node: its socket goes, and a guest still connected loses
    /// the disk.
    Detach {
        volume: String,
        /// The node it is attached on (default: the node the API address reaches).
        #[arg(long)]
        node: Option<u32>,
    },
    /// The vhost-user-blk disks of every live node (or of one), with their counters.
    List {
        #[arg(long)]
        node: Option<u32>,
    },
}

/// The API address of node `id`, or `base` itself when no node is named.
fn node_api(base: &str, id: Option<u32>) -> Result<(String, Option<NodeId>)> {
    let Some(id) = id else {
        return Ok((base.to_string(), None));
    };
    let nodes: Vec<NodeInfo> = http::call(base, "GET", "/v1/nodes", None)?;
    let Some(n) = nodes.iter().find(|n| n.id == NodeId(id)) else {
        bail!(
            "no node {id} in this cluster (nodes: {})",
            nodes
                .iter()
                .map(|n| n.id.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    };
    if !n.live {
        bail!("node {id} is down: its vhost-user disks are served when it is back");
    }
    let api = if n.api_addr.starts_with("https://") {
        n.api_addr.clone()
    } else {
        format!("https://{}", n.api_addr)
    };
    Ok((api, Some(n.id)))
}

pub fn run(c: &VhostCmd, json_out: bool, base: &str) -> Result<()> {
    match c {
        VhostCmd::Attach {
            volume,
            node,
            queues,
            owner_stays,
        } => {
            let (api, _) = node_api(base, *node)?;
            let body = serde_json::to_value(AttachVhost {
                volume: volume.clone(),
                queues: Some(*queues),
                owner_follows: Some(!owner_stays),
            })?;
            let v: VhostInfo = http::call(&api, "POST", "/v1/vhost", Some(&body))
                .with_context(|| format!("attaching {volume}"))?;
            if json_out {
                return crate::print_json(&v);
            }
            println!(
                "volume {} is a vhost-user-blk disk on node {}: socket {} ({} queues)",
                v.volume, v.node, v.socket, v.queues
            );
            println!("qemu options (the guest's memory must be shared):");
            println!("  -object memory-backend-memfd,id=mem,size=<RAM>,share=on -machine memory-backend=mem");
            println!(
                "  -chardev socket,id=vhost0,path={},reconnect=1 \\\n  -device vhost-user-blk-pci,chardev=vhost0,num-queues={}",
                v.socket, v.queues
            );
        }
        VhostCmd::Detach { volume, node } => {
            let (api, _) = node_api(base, *node)?;
            let v: serde_json::Value =
                http::call(&api, "DELETE", &format!("/v1/vhost/{volume}"), None)
                    .with_context(|| format!("detaching {volume}"))?;
            if json_out {
                return crate::print_json(&v);
            }
            println!("volume {volume} detached: its vhost-user socket is gone");
        }
        VhostCmd::List { node } => {
            let nodes: Vec<NodeInfo> = http::call(base, "GET", "/v1/nodes", None)?;
            let mut all = Vec::new();
            for n in nodes.iter().filter(|n| n.live) {
                if node.is_some_and(|id| NodeId(id) != n.id) {
                    continue;
                }
                let (api, _) = node_api(base, Some(n.id.0))?;
                let v: Vec<VhostInfo> = http::call(&api, "GET", "/v1/vhost", None)
                    .with_context(|| format!("asking node {}", n.id))?;
                all.extend(v);
            }
            if json_out {
                return crate::print_json(&all);
            }
            if all.is_empty() {
                println!("no vhost-user disks (`converge vhost attach VOLUME --node N` makes one)");
                return Ok(());
            }
            let mut t = Table::new(&[
                "NODE", "VOLUME", "QUEUES", "GUEST", "REQUESTS", "ERRORS", "READ", "WRITTEN",
                "SOCKET",
            ]);
            for v in &all {
                t.row(vec![
                    v.node.to_string(),
                    v.volume.clone(),
                    v.queues.to_string(),
                    if v.connected { "connected" } else { "-" }.into(),
                    v.requests.to_string(),
                    v.errors.to_string(),
                    format_size(v.bytes_read),
                    format_size(v.bytes_written),
                    v.socket.clone(),
                ]);
            }
            print!("{}", t.render());
        }
    }
    Ok(())
}
