//! Real network faults for the lab. With `converge lab up --netns` every `converged` runs
//! in its own network namespace, joined by a veth pair to a Linux bridge in the root
//! namespace, where etcd and the CLI live:
//!
//! ```text
//!  root ns: etcd on 10.X.Y.1 (bridge cvgbTAG)   ns cvg-TAG-n1: eth0 10.X.Y.2  (converged 1)
//!           ├── veth cvgTAGh1 ─────────────────────────┘
//!           ├── veth cvgTAGh2 ── ns cvg-TAG-n2: eth0 10.X.Y.3  (converged 2) ...
//! ```
//!
//! `lab fault partition N` sets the root-side end of node N's veth down: the kernel drops
//! every packet to and from the node (the node sees its link lose carrier), so peers, etcd
//! and the API cannot reach it and it cannot reach them, as when a cable is pulled. `heal`
//! sets it up again.
//!
//! `lab fault partition A --from B` cuts only the link between two nodes, as a broken path
//! between two racks does while both still reach etcd and everyone else: an `unreachable`
//! route to B's address in A's namespace and one to A's in B's. Each kernel then refuses to
//! send to the other (new connections fail with "no route to host"; established ones stop
//! getting their segments through and time out). The routes carry protocol number
//! [`CUT_PROTO`], so they are found and removed without touching any other route. TAG and X.Y derive from the lab directory, so labs do not collide;
//! every link we create carries an alias naming the lab, checked before anything is
//! deleted, in the same spirit as checking a PID's command line before signalling it.

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::fs;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Name of the node's end of its veth pair, inside its namespace.
pub const NODE_IFACE: &str = "eth0";

/// Routing protocol number (`ip route ... proto 199`) marking the routes that cut the link
/// between two nodes; any number the kernel and routing daemons leave unused (they use
/// 0-4, 8-20, 42, 99, 168, 186-192) would do.
pub const CUT_PROTO: &str = "199";

/// The lab's network: bridge, subnet and one namespace + veth per node.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LabNet {
    /// Linux bridge in the root namespace; holds the first address of the subnet.
    pub bridge: String,
    /// Set as the alias (ifalias) of the bridge and of every veth: marks them as ours.
    pub alias: String,
    /// The lab's /24 is 10.X.Y.0/24; this is [X, Y].
    pub subnet: [u8; 2],
    pub nodes: Vec<NodeNet>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NodeNet {
    pub id: u32,
    /// Network namespace the node's converged runs in (`ip netns exec NAME ...`).
    pub netns: String,
    /// Root-namespace end of the node's veth pair, enslaved to the bridge.
    pub veth: String,
    pub addr: Ipv4Addr,
}

/// The `ip` program (iproute2), and a check that we may create namespaces.
pub fn require() -> Result<PathBuf> {
    // SAFETY: geteuid has no preconditions and touches no memory.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "--netns needs root: network namespaces, veth pairs and bridges can only be \
             created by root (run `sudo converge lab up --netns ...`)"
        );
    }
    ip_path()
}

fn ip_path() -> Result<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"])
        .map(|d| Path::new(d).join("ip"))
        .find(|p| p.exists());
    found.ok_or_else(|| {
        anyhow!("`ip` (iproute2) is not installed; install it (apt-get install iproute2)")
    })
}

/// Runs `ip ARGS`, returning its stdout; the error carries the command and ip's message.
fn ip(args: &[&str]) -> Result<String> {
    let out = Command::new(ip_path()?)
        .args(args)
        .output()
        .with_context(|| format!("running ip {}", args.join(" ")))?;
    if !out.status.success() {
        bail!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn link_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

fn link_alias(name: &str) -> String {
    fs::read_to_string(Path::new("/sys/class/net").join(name).join("ifalias"))
        .map(|s| s.trim_end().to_string())
        .unwrap_or_default()
}

/// IFF_UP of a root-namespace link; None if the link does not exist.
fn link_is_up(name: &str) -> Option<bool> {
    let flags = fs::read_to_string(Path::new("/sys/class/net").join(name).join("flags")).ok()?;
    let flags = u32::from_str_radix(flags.trim().trim_start_matches("0x"), 16).ok()?;
    Some(flags & 1 != 0)
}

fn netns_exists(name: &str) -> bool {
    Path::new("/run/netns").join(name).exists()
}

/// PIDs of processes inside a namespace (empty if none or if it does not exist).
fn netns_pids(name: &str) -> Vec<String> {
    if !netns_exists(name) {
        return Vec::new();
    }
    ip(&["netns", "pids", name])
        .map(|s| s.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default()
}

/// FNV-1a: a stable hash of the lab directory, for names that must not change.
pub fn fxhash(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf29ce484222325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100000001b3)
    })
}

/// IPv4 prefixes (address, length) of the routes and addresses in the root namespace,
/// except those on `own_bridge` (a leftover of this very lab, about to be replaced).
fn used_prefixes(own_bridge: &str) -> Vec<(u32, u32)> {
    let mut v = Vec::new();
    let routes = ip(&["-4", "-o", "route", "show", "table", "all"]).unwrap_or_default();
    let addrs = ip(&["-4", "-o", "addr", "show"]).unwrap_or_default();
    let not_ours = |l: &&str| !l.split_whitespace().any(|w| w == own_bridge);
    let words = routes
        .lines()
        .filter(not_ours)
        .filter_map(|l| {
            // "[type] DEST ...": DEST is the first word that looks like an address.
            l.split_whitespace()
                .take(2)
                .find(|w| w.chars().next().is_some_and(|c| c.is_ascii_digit()))
        })
        .chain(addrs.lines().filter(not_ours).filter_map(|l| {
            let mut w = l.split_whitespace();
            w.position(|x| x == "inet").and_then(|_| w.next())
        }));
    for w in words {
        let (a, len) = w.split_once('/').unwrap_or((w, "32"));
        if let (Ok(a), Ok(len)) = (a.parse::<Ipv4Addr>(), len.parse::<u32>()) {
            if len <= 32 {
                v.push((u32::from(a), len));
            }
        }
    }
    v
}

fn overlaps(a: (u32, u32), b: (u32, u32)) -> bool {
    let len = a.1.min(b.1);
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    a.0 & mask == b.0 & mask
}

impl LabNet {
    /// Names and subnet for a lab in `dir` (canonical path) with `nodes` nodes. The subnet
    /// is the first 10.X.Y.0/24 derived from the directory that no route or address on
    /// this machine overlaps.
    pub fn plan(dir: &Path, nodes: u32) -> Result<LabNet> {
        if nodes > 250 {
            bail!("--netns supports at most 250 nodes (one /24)");
        }
        let h = fxhash(dir.display().to_string().as_bytes());
        let tag = format!("{:06x}", h & 0xff_ffff);
        let bridge = format!("cvgb{tag}");
        let used = used_prefixes(&bridge);
        let subnet = (0..256u64)
            .map(|k| {
                let v = (h >> 24).wrapping_add(k.wrapping_mul(0x9e37));
                [(v >> 8) as u8, v as u8]
            })
            .find(|s| {
                let net = u32::from(Ipv4Addr::new(10, s[0], s[1], 0));
                !used.iter().any(|p| p.1 > 0 && overlaps((net, 24), *p))
            })
            .ok_or_else(|| anyhow!("no free 10.X.Y.0/24 subnet for the lab's bridge"))?;
        let mut alias = format!("converge-lab {}", dir.display());
        alias.truncate(200);
        Ok(LabNet {
            bridge,
            alias,
            subnet,
            nodes: (1..=nodes)
                .map(|id| NodeNet {
                    id,
                    netns: format!("cvg-{tag}-n{id}"),
                    veth: format!("cvg{tag}h{id}"),
                    addr: Ipv4Addr::new(10, subnet[0], subnet[1], (id + 1) as u8),
                })
                .collect(),
        })
    }

    /// The bridge's address: etcd listens here and the CLI reaches nodes from here.
    pub fn bridge_addr(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, self.subnet[0], self.subnet[1], 1)
    }

    pub fn node(&self, id: u32) -> Result<&NodeNet> {
        self.nodes
            .iter()
            .find(|n| n.id == id)
            .ok_or_else(|| anyhow!("the lab network has no node {id}"))
    }

    fn tag(&self) -> &str {
        self.bridge.trim_start_matches("cvgb")
    }

    fn check_ours(&self, link: &str) -> Result<()> {
        let a = link_alias(link);
        if a != self.alias {
            bail!(
                "network interface {link} exists but is not this lab's (its alias is {a:?}, \
                 expected {:?}); remove it with `ip link del {link}` if it is a leftover",
                self.alias
            );
        }
        Ok(())
    }

    /// Creates whatever of the bridge, namespaces and veth pairs is missing, and sets
    /// every link up (so a fresh start is never partitioned).
    pub fn ensure(&self) -> Result<()> {
        let br = self.bridge.as_str();
        if link_exists(br) {
            self.check_ours(br)?;
        } else {
            ip(&["link", "add", "name", br, "type", "bridge"])?;
            ip(&["link", "set", "dev", br, "alias", &self.alias])?;
        }
        ip(&[
            "addr",
            "replace",
            &format!("{}/24", self.bridge_addr()),
            "dev",
            br,
        ])?;
        ip(&["link", "set", "dev", br, "up"])?;
        for n in &self.nodes {
            if !netns_exists(&n.netns) {
                ip(&["netns", "add", &n.netns])?;
            }
            ip(&["-n", &n.netns, "link", "set", "dev", "lo", "up"])?;
            if link_exists(&n.veth) {
                self.check_ours(&n.veth)?;
            } else {
                ip(&[
                    "link", "add", "name", &n.veth, "type", "veth", "peer", "name", NODE_IFACE,
                    "netns", &n.netns,
                ])?;
                ip(&["link", "set", "dev", &n.veth, "alias", &self.alias])?;
            }
            ip(&["link", "set", "dev", &n.veth, "master", br])?;
            ip(&["link", "set", "dev", &n.veth, "up"])?;
            ip(&[
                "-n",
                &n.netns,
                "addr",
                "replace",
                &format!("{}/24", n.addr),
                "dev",
                NODE_IFACE,
            ])?;
            ip(&["-n", &n.netns, "link", "set", "dev", NODE_IFACE, "up"])?;
            // Cuts between nodes left by a lab that crashed while they were in place.
            ip(&["-n", &n.netns, "route", "flush", "proto", CUT_PROTO])?;
        }
        Ok(())
    }

    /// Deletes the veth pairs, namespaces and bridge that exist and are ours. A namespace
    /// that still holds processes is left alone (deleting its name would hide it, not end
    /// it) and reported. Returns what was removed and what was left.
    pub fn teardown(&self) -> (Vec<String>, Vec<String>) {
        let (mut removed, mut left) = (Vec::new(), Vec::new());
        for n in &self.nodes {
            if link_exists(&n.veth) {
                match self.check_ours(&n.veth).and_then(|_| {
                    ip(&["link", "del", "dev", &n.veth])?;
                    Ok(())
                }) {
                    Ok(()) => removed.push(format!("veth {}", n.veth)),
                    Err(e) => left.push(format!("{e:#}")),
                }
            }
            if netns_exists(&n.netns) {
                let pids = netns_pids(&n.netns);
                if !pids.is_empty() {
                    left.push(format!(
                        "network namespace {} still holds processes {} (not this lab's \
                         daemons, which were stopped); it was left in place",
                        n.netns,
                        pids.join(" ")
                    ));
                    continue;
                }
                match ip(&["netns", "del", &n.netns]) {
                    Ok(_) => removed.push(format!("netns {}", n.netns)),
                    Err(e) => left.push(format!("{e:#}")),
                }
            }
        }
        if link_exists(&self.bridge) {
            match self.check_ours(&self.bridge).and_then(|_| {
                ip(&["link", "del", "dev", &self.bridge])?;
                Ok(())
            }) {
                Ok(()) => removed.push(format!("bridge {}", self.bridge)),
                Err(e) => left.push(format!("{e:#}")),
            }
        }
        (removed, left)
    }

    /// Before a fresh `lab up`: remove what a crashed lab in the same directory left
    /// (same tag, our alias), or refuse if it is still in use or not ours.
    pub fn clean_leftovers(&self) -> Result<Vec<String>> {
        let tag = self.tag();
        let ns_prefix = format!("cvg-{tag}-n");
        let veth_prefix = format!("cvg{tag}h");
        let mut stale = self.clone();
        stale.nodes.clear();
        let names = |dir: &str, prefix: &str| -> Vec<String> {
            fs::read_dir(dir)
                .map(|d| {
                    d.filter_map(|e| e.ok())
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .filter(|n| n.starts_with(prefix))
                        .collect()
                })
                .unwrap_or_default()
        };
        let mut ids: Vec<u32> = names("/run/netns", &ns_prefix)
            .iter()
            .filter_map(|n| n[ns_prefix.len()..].parse().ok())
            .chain(
                names("/sys/class/net", &veth_prefix)
                    .iter()
                    .filter_map(|n| n[veth_prefix.len()..].parse().ok()),
            )
            .collect();
        ids.sort_unstable();
        ids.dedup();
        for id in ids {
            let n = NodeNet {
                id,
                netns: format!("{ns_prefix}{id}"),
                veth: format!("{veth_prefix}{id}"),
                addr: Ipv4Addr::UNSPECIFIED,
            };
            let pids = netns_pids(&n.netns);
            if !pids.is_empty() {
                bail!(
                    "network namespace {} of an earlier lab in this directory still holds \
                     processes ({}): stop them (e.g. `ip netns pids {}` then kill those PIDs), \
                     then run `converge lab up --netns` again",
                    n.netns,
                    pids.join(" "),
                    n.netns
                );
            }
            if link_exists(&n.veth) {
                self.check_ours(&n.veth)?;
            }
            stale.nodes.push(n);
        }
        if link_exists(&self.bridge) {
            self.check_ours(&self.bridge)?;
        }
        let (removed, left) = stale.teardown();
        if !left.is_empty() {
            bail!(
                "cannot clean up an earlier lab's network: {}",
                left.join("; ")
            );
        }
        Ok(removed)
    }

    /// Cuts (`up = false`) or restores the link of node `id`.
    pub fn set_link(&self, id: u32, up: bool) -> Result<()> {
        let n = self.node(id)?;
        if !link_exists(&n.veth) {
            bail!(
                "node{id}'s link {} does not exist (was the lab brought down?); \
                 `converge lab up` creates the lab network again",
                n.veth
            );
        }
        self.check_ours(&n.veth)?;
        ip(&[
            "link",
            "set",
            "dev",
            &n.veth,
            if up { "up" } else { "down" },
        ])?;
        Ok(())
    }

    /// Cuts (`cut = true`) or restores the link between nodes `a` and `b`, both ways: an
    /// `unreachable` route to the other's address in each one's namespace. Idempotent per
    /// direction, so a half-done change (one route in place) is completed by the next call.
    pub fn set_cut(&self, a: u32, b: u32, cut: bool) -> Result<()> {
        if a == b {
            bail!("node{a} cannot be cut from itself: name another node with --from");
        }
        let (na, nb) = (self.node(a)?, self.node(b)?);
        for (from, to) in [(na, nb), (nb, na)] {
            if !netns_exists(&from.netns) {
                bail!(
                    "node{}'s network namespace {} does not exist (was the lab brought down?); \
                     `converge lab up` creates the lab network again",
                    from.id,
                    from.netns
                );
            }
            let present = self.cut_addrs(from).contains(&to.addr);
            if present == cut {
                continue;
            }
            ip(&[
                "-n",
                &from.netns,
                "route",
                if cut { "add" } else { "del" },
                "unreachable",
                &format!("{}/32", to.addr),
                "proto",
                CUT_PROTO,
            ])?;
        }
        Ok(())
    }

    /// Addresses node `n`'s namespace has a cut route to.
    fn cut_addrs(&self, n: &NodeNet) -> Vec<Ipv4Addr> {
        if !netns_exists(&n.netns) {
            return Vec::new();
        }
        ip(&[
            "-n",
            &n.netns,
            "-4",
            "-o",
            "route",
            "show",
            "type",
            "unreachable",
            "proto",
            CUT_PROTO,
        ])
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            l.split_whitespace()
                .find_map(|w| w.trim_end_matches("/32").parse::<Ipv4Addr>().ok())
        })
        .collect()
    }

    /// Every cut route as (node whose namespace holds it, node it cuts off).
    pub fn cuts(&self) -> Vec<(u32, u32)> {
        self.nodes
            .iter()
            .flat_map(|n| {
                let addrs = self.cut_addrs(n);
                self.nodes
                    .iter()
                    .filter(move |o| o.id != n.id && addrs.contains(&o.addr))
                    .map(move |o| (n.id, o.id))
            })
            .collect()
    }

    /// The nodes whose link with node `id` is cut (a route in either namespace).
    pub fn cut_from(&self, id: u32) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .cuts()
            .into_iter()
            .filter_map(|(a, b)| match (a == id, b == id) {
                (true, _) => Some(b),
                (_, true) => Some(a),
                _ => None,
            })
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Whether node `id` is cut off: its link is down or missing.
    pub fn partitioned(&self, id: u32) -> bool {
        match self.node(id) {
            Ok(n) => link_is_up(&n.veth) != Some(true),
            Err(_) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_overlap_when_one_contains_the_other() {
        let p = |s: &str, l| (u32::from(s.parse::<Ipv4Addr>().unwrap()), l);
        assert!(overlaps(p("10.1.2.0", 24), p("10.0.0.0", 8)));
        assert!(overlaps(p("10.1.2.0", 24), p("10.1.2.7", 32)));
        assert!(!overlaps(p("10.1.2.0", 24), p("10.1.3.0", 24)));
        assert!(!overlaps(p("10.1.2.0", 24), p("192.0.2.0", 24)));
    }

    #[test]
    fn names_fit_linux_limits_and_differ_between_labs() {
        let a = LabNet::plan(Path::new("/tmp/lab-a"), 200).unwrap();
        let b = LabNet::plan(Path::new("/tmp/lab-b"), 3).unwrap();
        assert_ne!(a.bridge, b.bridge);
        for n in &a.nodes {
            assert!(n.veth.len() <= 15, "{}", n.veth);
        }
        assert!(a.bridge.len() <= 15);
        assert_eq!(a.nodes[199].addr.octets()[3], 201);
        assert_eq!(a.bridge_addr().octets()[3], 1);
    }
}
