//! `converge advise cache`: what hit ratio a cache of a given size would give each node,
//! and which cache mode suits its workload, from the working-set estimator every node runs
//! over the client I/O its capacity drives serve (`GET /v1/cache/advice`, docs/CACHE.md).

use crate::http;
use crate::table::Table;
use anyhow::{bail, Context, Result};
use clap::Subcommand;
use converge_api::{CacheAdvice, NodeInfo, VolumeInfo};
use converge_types::mrc::Mrc;
use converge_types::{format_size, parse_size, NodeId, BLOCK_SIZE};
use serde::Serialize;

#[derive(Subcommand)]
pub enum AdviseCmd {
    /// Hit ratios a cache of each size would have given each node's client I/O since the
    /// node started (an LRU cache over all its capacity drives, from sampled block
    /// addresses: SHARDS), the working set, and the cache mode that suits the workload.
    /// Read the advice after the workload of interest ran for a while.
    Cache {
        /// Only this node.
        #[arg(long)]
        node: Option<u32>,
        /// Cache sizes to evaluate besides the ladder (64 MiB, doubling past the working
        /// set) and the node's cache now, e.g. 512M,2G.
        #[arg(long, value_delimiter = ',')]
        size: Vec<String>,
    },
}

/// One node's answer, as `--json` prints it.
#[derive(Serialize)]
struct NodeAdvice {
    node: NodeId,
    advice: CacheAdvice,
    /// (cache bytes, read hit ratio, hit ratio of all accesses).
    curve: Vec<(u64, Option<f64>, Option<f64>)>,
    /// Cache bytes the advice and the per-volume hit ratios are judged at: the node's
    /// cache now, else the first `--size`, else 1 GiB.
    at_bytes: u64,
    mode: &'static str,
    why: String,
}

/// Cache sizes: 64 MiB doubling to twice the working set (at least 1 GiB), the cache now,
/// and those asked for; sorted, unique.
fn sizes(m: &Mrc, now: u64, asked: &[u64]) -> Vec<u64> {
    let ws = (m.blocks * BLOCK_SIZE as f64) as u64;
    let top = (2 * ws).max(1 << 30);
    let mut v = Vec::new();
    let mut s: u64 = 64 << 20;
    while s <= top {
        v.push(s);
        s *= 2;
    }
    v.push(s);
    if now > 0 {
        v.push(now);
    }
    v.extend_from_slice(asked);
    v.sort_unstable();
    v.dedup();
    // A ladder step within 2 % of the cache now reads as the same size twice.
    if now > 0 {
        v.retain(|&s| s == now || asked.contains(&s) || s.abs_diff(now) * 50 > now);
    }
    v
}

fn blocks(bytes: u64) -> u64 {
    bytes / BLOCK_SIZE as u64
}

/// The mode that suits what the curve shows at `size` bytes of cache.
fn advise(m: &Mrc, size: u64) -> (&'static str, String) {
    if m.refs <= 0.0 {
        return (
            "-",
            "no client I/O seen since the node started: run the workload, then ask again".into(),
        );
    }
    let reads = m.reads / m.refs;
    let writes = 1.0 - reads;
    let hit = m.hit_ratio(blocks(size), true);
    let at = format_size(size);
    match hit {
        Some(h) if h >= 0.3 => (
            "read-write",
            format!(
                "{:.0} % of reads would hit a {at} cache: keep hot reads on the cache drive",
                100.0 * h
            ),
        ),
        h if writes >= 0.1 => (
            "write",
            format!(
                "reads would hit {} in a {at} cache, but {:.0} % of accesses are writes: the \
                 log absorbs them (acked at the cache drive's latency, destaged later)",
                h.map_or("nothing".into(), |h| format!("{:.0} %", 100.0 * h)),
                100.0 * writes
            ),
        ),
        h => (
            "none",
            format!(
                "reads would hit {} in a {at} cache and only {:.0} % of accesses are writes: \
                 a cache would not pay for itself here",
                h.map_or("nothing".into(), |h| format!("{:.0} %", 100.0 * h)),
                100.0 * writes
            ),
        ),
    }
}

fn pct(v: Option<f64>) -> String {
    v.map_or("–".into(), |h| format!("{:.1} %", 100.0 * h))
}

pub fn run(cmd: &AdviseCmd, json: bool, base: &str) -> Result<()> {
    let AdviseCmd::Cache { node, size } = cmd;
    let asked: Vec<u64> = size
        .iter()
        .map(|s| parse_size(s).map_err(|e| anyhow::anyhow!("--size {s}: {e}")))
        .collect::<Result<_>>()?;
    if let Some(&bad) = asked.iter().find(|&&s| s < BLOCK_SIZE as u64) {
        bail!("--size {bad}: a cache holds at least one 4 KiB block");
    }
    let nodes: Vec<NodeInfo> = http::call(base, "GET", "/v1/nodes", None)?;
    let targets: Vec<&NodeInfo> = nodes
        .iter()
        .filter(|n| node.is_none_or(|id| n.id.0 == id))
        .collect();
    if targets.is_empty() {
        bail!(
            "no node {} in the cluster (nodes: {})",
            node.unwrap_or(0),
            nodes
                .iter()
                .map(|n| n.id.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let volumes: Vec<VolumeInfo> = http::call(base, "GET", "/v1/volumes", None)?;
    let name_of = |id| {
        volumes
            .iter()
            .find(|v| v.id == id)
            .map_or_else(|| format!("volume {id}"), |v| v.name.clone())
    };
    let mut out = Vec::new();
    for n in targets {
        let api = if n.api_addr.starts_with("https://") {
            n.api_addr.clone()
        } else {
            format!("https://{}", n.api_addr)
        };
        let a: CacheAdvice = http::call(&api, "GET", "/v1/cache/advice", None)
            .with_context(|| format!("asking node {} ({api}) for its working set", n.id))?;
        let at = if a.cache_bytes > 0 {
            a.cache_bytes
        } else {
            asked.first().copied().unwrap_or(1 << 30)
        };
        let (mode, why) = advise(&a.mrc, at);
        let curve = sizes(&a.mrc, a.cache_bytes, &asked)
            .into_iter()
            .map(|s| {
                (
                    s,
                    a.mrc.hit_ratio(blocks(s), true),
                    a.mrc.hit_ratio(blocks(s), false),
                )
            })
            .collect();
        out.push(NodeAdvice {
            node: n.id,
            advice: a,
            curve,
            at_bytes: at,
            mode,
            why,
        });
    }
    if json {
        return crate::print_json(&out);
    }
    for (i, na) in out.iter().enumerate() {
        let a = &na.advice;
        let m = &a.mrc;
        if i > 0 {
            println!();
        }
        let cache = if a.cache_drives == 0 {
            "no cache drives".to_string()
        } else {
            format!(
                "{} cache drive{} of {} together ({})",
                a.cache_drives,
                if a.cache_drives == 1 { "" } else { "s" },
                format_size(a.cache_bytes),
                a.cache_modes.join(", ")
            )
        };
        println!("node {}: {cache}", na.node);
        if m.refs <= 0.0 {
            println!("  {}", na.why);
            continue;
        }
        println!(
            "  {} block accesses (4 KiB) since the node started, {:.0} % reads; working set \
             about {} (sampled {:.2} % of blocks, {} accesses seen)",
            a.accesses,
            100.0 * m.reads / m.refs,
            format_size((m.blocks * BLOCK_SIZE as f64) as u64),
            100.0 * m.rate,
            m.samples
        );
        let mut t = Table::new(&["CACHE SIZE", "READ HIT", "ALL HIT"]);
        for &(s, r, all) in &na.curve {
            let label = if s == a.cache_bytes {
                format!("{} (now)", format_size(s))
            } else {
                format_size(s)
            };
            t.row(vec![label, pct(r), pct(all)]);
        }
        t.row(vec![
            "unbounded".into(),
            pct(m.max_hit_ratio(true)),
            pct(m.max_hit_ratio(false)),
        ]);
        for l in t.render().lines() {
            println!("  {l}");
        }
        println!("  advice: {} — {}", na.mode, na.why);
        let at = blocks(na.at_bytes);
        let mut vt = Table::new(&["VOLUME", "WORKING SET", "READS", "READ HIT ALONE"]);
        for v in &a.volumes {
            vt.row(vec![
                name_of(v.volume),
                format_size((v.mrc.blocks * BLOCK_SIZE as f64) as u64),
                format!("{:.0} %", 100.0 * v.mrc.reads / v.mrc.refs.max(1.0)),
                pct(v.mrc.hit_ratio(at, true)),
            ]);
        }
        if !a.volumes.is_empty() {
            println!(
                "  per volume (its accesses on this node, with a cache of {} to itself):",
                format_size(at * BLOCK_SIZE as u64)
            );
            for l in vt.render().lines() {
                println!("  {l}");
            }
        }
    }
    println!(
        "\nHit ratios are an LRU cache's over the I/O since each node started: what a cache \
         of that size could give. The cache tier admits a block only on its second miss and \
         evicts FIFO with a second chance, so it gives less today, by up to tens of points \
         (docs/studies/cache-advice.md)."
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn curve(read_share: f64, hit_below: u64) -> Mrc {
        // Every access a reuse at distance `hit_below` blocks.
        let mut m = Mrc {
            rate: 1.0,
            ..Mrc::default()
        };
        for i in 0..100 {
            let read = (i as f64) < read_share * 100.0;
            m.add(Some(hit_below as f64), read, 1.0);
        }
        m
    }

    #[test]
    fn the_mode_follows_the_reads_reuse_and_the_writes() {
        let g = 1u64 << 30;
        // Reads reuse within 1 GiB: read-write.
        assert_eq!(advise(&curve(0.9, blocks(g) / 2), g).0, "read-write");
        // No reuse within the cache, many writes: write.
        assert_eq!(advise(&curve(0.5, blocks(g) * 4), g).0, "write");
        // No reuse, nearly all reads: none.
        assert_eq!(advise(&curve(0.95, blocks(g) * 4), g).0, "none");
        assert_eq!(advise(&Mrc::default(), g).0, "-");
    }

    #[test]
    fn sizes_double_past_the_working_set_and_include_the_cache_and_asked() {
        let m = Mrc {
            blocks: (3u64 << 30) as f64 / 4096.0,
            ..Mrc::default()
        };
        let v = sizes(&m, (256 << 20) - 8192, &[5 << 30]);
        assert!(
            !v.contains(&(256 << 20)),
            "the cache now stands for 256 MiB: {v:?}"
        );
        let v = sizes(&m, 300 << 20, &[5 << 30]);
        assert_eq!(v.first(), Some(&(64 << 20)));
        assert!(v.contains(&(300 << 20)) && v.contains(&(5 << 30)));
        assert!(*v.last().unwrap() >= 6 << 30);
        assert!(v.windows(2).all(|w| w[0] < w[1]));
    }
}
