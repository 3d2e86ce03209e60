//! `converge cache`: the cache tier from the operator's side — what each cache drive holds
//! and does (`status`), which mode the pool or a node runs (`mode`), and draining the
//! caches to the capacity drives (`flush`), e.g. before pulling a cache drive.

use crate::http;
use crate::table::Table;
use anyhow::{bail, Context, Result};
use clap::Subcommand;
use converge_api::{CacheInfo, NodeInfo, SetCacheMode, Settings};
use converge_types::{format_size, CacheMode, DriveId, NodeId};
use serde_json::json;
use std::time::{Duration, Instant};

const MODES_HELP: &str = "\
Cache modes (the S2D model):
  none        writes go straight to the capacity drives; the cache only drains what it
              still holds
  write       writes land in the cache drive's log, are acked once durable there and are
              destaged to the capacity drives in the background (each byte written to
              capacity once); reads are served from capacity (and from the log while dirty)
  read-write  write, plus hot reads are kept on the cache drive

Default when neither the pool nor the node has a mode set: by the media of the capacity
drives bound to the cache drive — write for flash (ssd, nvme), read-write for hdd.
A node's own mode (--node) overrides the pool's; `auto` removes a setting.";

#[derive(Subcommand)]
#[command(after_long_help = MODES_HELP)]
pub enum CacheCmd {
    /// Every cache drive: its node, mode in effect, bound capacity drives, how much of its
    /// log is used, dirty (not yet destaged) and clean (read cache), destage rate, hit ratio.
    #[command(after_long_help = MODES_HELP)]
    Status,
    /// Set the cache mode of the pool, or of one node (--node): none, write, read-write, or
    /// auto (remove the setting: the node falls back to the pool's mode, the pool to the
    /// media default). Nodes apply it within a few seconds, at run time.
    #[command(after_long_help = MODES_HELP)]
    Mode {
        /// none, write, read-write or auto.
        #[arg(value_parser = parse_mode_arg)]
        mode: ModeArg,
        /// Only this node (overrides the pool's mode on it).
        #[arg(long)]
        node: Option<u32>,
    },
    /// Drain the caches: destage every dirty block to the capacity drives and wait until
    /// done, on one node (--node) or on every live node in turn.
    Flush {
        /// Only this node.
        #[arg(long)]
        node: Option<u32>,
        /// Seconds to wait for each node's flush to finish.
        #[arg(long, default_value_t = 3600)]
        timeout: u64,
    },
}

/// A mode on the command line: a mode, or `auto` (no setting).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModeArg(pub Option<CacheMode>);

pub fn parse_mode_arg(s: &str) -> Result<ModeArg, String> {
    if s == "auto" {
        return Ok(ModeArg(None));
    }
    s.parse::<CacheMode>()
        .map(|m| ModeArg(Some(m)))
        .map_err(|_| format!("{s:?} is not a cache mode: use none, write, read-write or auto"))
}

pub fn run(cmd: &CacheCmd, json_out: bool, base: &str) -> Result<()> {
    match cmd {
        CacheCmd::Status => {
            let caches: Vec<CacheInfo> = http::call(base, "GET", "/v1/caches", None)?;
            if json_out {
                return crate::print_json(&caches);
            }
            let settings: Settings = http::call(base, "GET", "/v1/settings", None)?;
            for l in settings_lines(&settings) {
                println!("{l}");
            }
            if caches.is_empty() {
                println!("{NO_CACHES}");
            } else {
                print!("\n{}", caches_table(&caches));
            }
        }
        CacheCmd::Mode { mode, node } => {
            let req = SetCacheMode {
                mode: mode.0,
                node: node.map(NodeId),
            };
            let s: Settings = http::call(
                base,
                "POST",
                "/v1/cache/mode",
                Some(&serde_json::to_value(&req)?),
            )?;
            if json_out {
                return crate::print_json(&s);
            }
            println!("{}", mode_changed(&req));
            let caches: Vec<CacheInfo> = http::call(base, "GET", "/v1/caches", None)?;
            if caches.is_empty() {
                println!("note: {NO_CACHES}; the setting applies once there are some");
            } else {
                println!(
                    "the nodes apply it within a few seconds; `converge cache status` shows the \
                     mode in effect"
                );
            }
        }
        CacheCmd::Flush { node, timeout } => {
            let nodes: Vec<NodeInfo> = http::call(base, "GET", "/v1/nodes", None)?;
            let targets = flush_targets(&nodes, node.map(NodeId))?;
            let mut done = Vec::new();
            let t_all = Instant::now();
            for n in targets {
                let api = if n.api_addr.starts_with("https://") {
                    n.api_addr.clone()
                } else {
                    format!("https://{}", n.api_addr)
                };
                if !json_out {
                    eprintln!("flushing the caches of node {} ({}) ...", n.id, n.name);
                }
                let t = Instant::now();
                let answer: serde_json::Value = http::call_timeout(
                    &api,
                    "POST",
                    "/v1/cache/flush",
                    None,
                    Duration::from_secs(*timeout),
                )
                .with_context(|| format!("flushing the caches of node {}", n.id))?;
                let s = t.elapsed().as_secs_f64();
                if !json_out {
                    println!("node {}: caches flushed in {s:.1} s", n.id);
                }
                done.push(json!({"node": n.id, "seconds": s, "answer": answer}));
            }
            if json_out {
                return crate::print_json(&done);
            }
            if done.len() > 1 {
                println!(
                    "{} nodes flushed in {:.1} s",
                    done.len(),
                    t_all.elapsed().as_secs_f64()
                );
            }
        }
    }
    Ok(())
}

const NO_CACHES: &str = "this cluster has no cache drives (give a node a [[drive]] with \
                         role = \"cache\", or `converge lab up --cache-drives N`)";

/// The nodes a flush goes to: the one asked for (live), else every live node.
pub fn flush_targets(nodes: &[NodeInfo], only: Option<NodeId>) -> Result<Vec<&NodeInfo>> {
    match only {
        Some(id) => match nodes.iter().find(|n| n.id == id) {
            None => bail!(
                "no node {id} in this cluster (nodes: {})",
                nodes
                    .iter()
                    .map(|n| n.id.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Some(n) if !n.live => bail!(
                "node {id} is down: its caches cannot be flushed until it is back (what they \
                 hold is destaged when it starts)"
            ),
            Some(n) => Ok(vec![n]),
        },
        None => {
            let live: Vec<&NodeInfo> = nodes.iter().filter(|n| n.live).collect();
            if live.is_empty() {
                bail!("no live node to flush");
            }
            Ok(live)
        }
    }
}

fn mode_changed(req: &SetCacheMode) -> String {
    match (req.node, req.mode) {
        (None, Some(m)) => format!("pool cache mode: {m} (nodes without a mode of their own)"),
        (None, None) => "pool cache mode: auto (each cache drive by its capacity media: write \
                         for flash, read-write for hdd)"
            .into(),
        (Some(n), Some(m)) => format!("node {n} cache mode: {m} (overrides the pool's)"),
        (Some(n), None) => format!("node {n} cache mode: auto (follows the pool's)"),
    }
}

/// The cache mode settings, one line each (for `cache status` and `cluster settings`).
pub fn settings_lines(s: &Settings) -> Vec<String> {
    let mut v = vec![match s.cache_mode {
        Some(m) => format!("cache mode    {m} (pool setting)"),
        None => "cache mode    auto: by capacity media, write for flash, read-write for hdd \
                 (no pool setting)"
            .into(),
    }];
    for (n, m) in &s.node_cache_modes {
        v.push(format!("cache mode    {m} on node {n} (node setting)"));
    }
    v
}

/// A drive id as the tables show it when space is short: its first 8 hex digits (the
/// start of the 16 that `converge drive list` shows).
pub fn short_id(d: DriveId) -> String {
    format!("{:016x}", d.0)[..8].to_string()
}

fn pct(r: Option<f64>) -> String {
    r.map_or("-".into(), |r| format!("{:.1}", 100.0 * r))
}

fn rate(bps: f64) -> String {
    if bps <= 0.0 {
        "0".into()
    } else {
        format_size(bps as u64)
    }
}

pub fn caches_table(v: &[CacheInfo]) -> String {
    let mut t = Table::new(&[
        "NODE",
        "DRIVE",
        "PATH",
        "MODE",
        "BOUND",
        "LOG",
        "USED",
        "DIRTY",
        "CLEAN",
        "DESTAGE/s",
        "HIT%",
    ]);
    for c in v {
        t.row(vec![
            c.node.to_string(),
            format!("{:016x}", c.drive.0),
            c.path.clone(),
            match &c.failed {
                Some(_) => format!("{} (failed)", c.mode),
                None => c.mode.to_string(),
            },
            if c.bound.is_empty() {
                "-".into()
            } else {
                c.bound
                    .iter()
                    .map(|d| short_id(*d))
                    .collect::<Vec<_>>()
                    .join(",")
            },
            format_size(c.log_bytes),
            format_size(c.used_bytes),
            format_size(c.dirty_bytes),
            format_size(c.clean_bytes),
            rate(c.destage_bytes_per_s),
            pct(c.read_hit_ratio),
        ]);
    }
    let mut out = t.render();
    for c in v {
        if let Some(why) = &c.failed {
            out.push_str(&format!("failed: {} on node {}: {why}\n", c.path, c.node));
        }
    }
    out
}

/// The short CACHES table of `converge status`.
pub fn status_table(v: &[CacheInfo]) -> String {
    let mut t = Table::new(&["NODE", "DRIVE", "MODE", "DIRTY", "DESTAGE/s"]);
    for c in v {
        t.row(vec![
            c.node.to_string(),
            format!("{:016x}", c.drive.0),
            match &c.failed {
                Some(_) => format!("{} (failed)", c.mode),
                None => c.mode.to_string(),
            },
            format_size(c.dirty_bytes),
            rate(c.destage_bytes_per_s),
        ]);
    }
    t.render()
}

#[cfg(test)]
mod tests {
    use super::*;
    use converge_types::MediaType;

    fn cache(node: u32, drive: u64) -> CacheInfo {
        CacheInfo {
            node: NodeId(node),
            drive: DriveId(drive),
            path: format!("/lab/node{node}/cache1.img"),
            media: MediaType::Ram,
            mode: CacheMode::Write,
            bound: vec![
                DriveId(0x1234_5678_9abc_def0),
                DriveId(0xfedc_ba98_7654_3210),
            ],
            log_bytes: 512 << 20,
            used_bytes: 128 << 20,
            dirty_bytes: 64 << 20,
            clean_bytes: 0,
            destage_bytes_per_s: 0.0,
            read_hit_ratio: Some(0.875),
            failed: None,
        }
    }

    fn node(id: u32, live: bool) -> NodeInfo {
        NodeInfo {
            live,
            api_addr: format!("127.0.0.{}:7200", id + 1),
            ..NodeInfo::down(NodeId(id))
        }
    }

    #[test]
    fn mode_args() {
        assert_eq!(parse_mode_arg("auto"), Ok(ModeArg(None)));
        assert_eq!(parse_mode_arg("none"), Ok(ModeArg(Some(CacheMode::None))));
        assert_eq!(parse_mode_arg("write"), Ok(ModeArg(Some(CacheMode::Write))));
        assert_eq!(
            parse_mode_arg("read-write"),
            Ok(ModeArg(Some(CacheMode::ReadWrite)))
        );
        let e = parse_mode_arg("readwrite").unwrap_err();
        assert!(e.contains("none, write, read-write or auto"), "{e}");
        assert!(parse_mode_arg("Write").is_err());
    }

    #[test]
    fn cli_parses_cache_commands() {
        use clap::Parser;
        let c = crate::Cli::try_parse_from(["converge", "cache", "mode", "auto", "--node", "3"])
            .expect("parses");
        match c.cmd {
            crate::Cmd::Cache(CacheCmd::Mode { mode, node }) => {
                assert_eq!(mode, ModeArg(None));
                assert_eq!(node, Some(3));
            }
            _ => panic!("wrong command"),
        }
        assert!(crate::Cli::try_parse_from(["converge", "cache", "mode", "fast"]).is_err());
        assert!(crate::Cli::try_parse_from(["converge", "cache", "mode"]).is_err());
        let c = crate::Cli::try_parse_from(["converge", "cache", "flush"]).expect("parses");
        assert!(matches!(
            c.cmd,
            crate::Cmd::Cache(CacheCmd::Flush {
                node: None,
                timeout: 3600
            })
        ));
    }

    #[test]
    fn table_shows_every_column() {
        let mut c2 = cache(2, 0xab);
        c2.mode = CacheMode::ReadWrite;
        c2.bound.clear();
        c2.read_hit_ratio = None;
        c2.destage_bytes_per_s = 3.0 * 1048576.0;
        c2.failed = Some("I/O error at offset 4096".into());
        let out = caches_table(&[cache(1, 0x42), c2]);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            lines[0].split_whitespace().collect::<Vec<_>>(),
            [
                "NODE",
                "DRIVE",
                "PATH",
                "MODE",
                "BOUND",
                "LOG",
                "USED",
                "DIRTY",
                "CLEAN",
                "DESTAGE/s",
                "HIT%"
            ]
        );
        assert!(
            lines[1].contains("0000000000000042"),
            "full drive id: {}",
            lines[1]
        );
        assert!(
            lines[1].contains("12345678,fedcba98"),
            "short bound ids: {}",
            lines[1]
        );
        assert!(lines[1].contains("512 MiB"), "{}", lines[1]);
        assert!(lines[1].contains("64 MiB"), "{}", lines[1]);
        assert!(lines[1].ends_with("87.5"), "hit ratio in %: {}", lines[1]);
        assert!(lines[2].contains("read-write (failed)"), "{}", lines[2]);
        assert!(lines[2].contains("3 MiB"), "{}", lines[2]);
        assert!(lines[2].ends_with('-'), "no hit ratio yet: {}", lines[2]);
        assert_eq!(
            lines[3],
            "failed: /lab/node2/cache1.img on node 2: I/O error at offset 4096"
        );
    }

    #[test]
    fn status_table_is_short() {
        let out = status_table(&[cache(3, 7)]);
        assert_eq!(
            out,
            "NODE  DRIVE             MODE   DIRTY   DESTAGE/s\n\
             3     0000000000000007  write  64 MiB  0\n"
        );
    }

    #[test]
    fn settings_lines_name_pool_and_nodes() {
        let s = Settings::default();
        let l = settings_lines(&s);
        assert_eq!(l.len(), 1);
        assert!(l[0].contains("auto") && l[0].contains("read-write for hdd"));
        let s = Settings {
            cache_mode: Some(CacheMode::Write),
            node_cache_modes: [(NodeId(2), CacheMode::None)].into_iter().collect(),
            ..Default::default()
        };
        assert_eq!(
            settings_lines(&s),
            vec![
                "cache mode    write (pool setting)",
                "cache mode    none on node 2 (node setting)"
            ]
        );
    }

    #[test]
    fn flush_goes_to_live_nodes() {
        let ns = [node(1, true), node(2, false), node(3, true)];
        let all: Vec<u32> = flush_targets(&ns, None)
            .unwrap()
            .iter()
            .map(|n| n.id.0)
            .collect();
        assert_eq!(all, [1, 3]);
        assert_eq!(
            flush_targets(&ns, Some(NodeId(3))).unwrap()[0].id,
            NodeId(3)
        );
        let e = flush_targets(&ns, Some(NodeId(2))).unwrap_err().to_string();
        assert!(e.contains("node 2 is down"), "{e}");
        let e = flush_targets(&ns, Some(NodeId(9))).unwrap_err().to_string();
        assert!(e.contains("no node 9") && e.contains("1, 2, 3"), "{e}");
        assert!(flush_targets(&[node(1, false)], None).is_err());
    }

    #[test]
    fn short_ids_are_the_start_of_the_long_ones() {
        assert_eq!(short_id(DriveId(0x1234_5678_9abc_def0)), "12345678");
        assert_eq!(short_id(DriveId(0xab)), "00000000");
    }
}
