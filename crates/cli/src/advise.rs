//! `converge advise cache`: what hit ratio a cache of a given size would give each node,
//! and which cache mode suits its workload, from the working-set estimator every node runs
//! over the client I/O its capacity drives serve (`GET /v1/cache/advice`, docs/CACHE.md).

use crate::http;
use crate::table::Table;
use anyhow::{bail, Context, Result};
use clap::Subcommand;
use converge_api::{CacheAdvice, NodeInfo, VolumeInfo};
use converge_types::mrc::{Mrc, TierHit};
use converge_types::{format_size, parse_size, CacheMode, NodeId, BLOCK_SIZE};
use serde::Serialize;

#[derive(Subcommand)]
pub enum AdviseCmd {
    /// Hit ratios a cache of each size would have given each node's client I/O since the
    /// node started, from sampled block addresses: the cache tier's own read-cache policy
    /// simulated in miniature at ¼ to 4 times the node's cache, and an LRU cache's at any
    /// size (SHARDS: what any cache could); the working set, and the cache mode that suits
    /// the workload. Read the advice after the workload of interest ran for a while.
    Cache {
        /// Only this node.
        #[arg(long)]
        node: Option<u32>,
        /// Cache sizes to evaluate besides the ladder (64 MiB, doubling past the working
        /// set) and the node's cache now, e.g. 512M,2G.
        #[arg(long, value_delimiter = ',')]
        size: Vec<String>,
        /// Also draw each node's curve as a chart — read hit ratio against cache size, the
        /// tier's policy beside LRU's — in this self-contained HTML file (SVG, no scripts).
        #[arg(long, value_name = "FILE")]
        html: Option<std::path::PathBuf>,
    },
}

/// A row of the table: (cache bytes, read hit ratio of LRU, hit ratio of all accesses of
/// LRU, read hit ratio of the tier's read-write policy where it was simulated).
type Point = (u64, Option<f64>, Option<f64>, Option<f64>);

/// One node's answer, as `--json` prints it.
#[derive(Serialize)]
struct NodeAdvice {
    node: NodeId,
    advice: CacheAdvice,
    curve: Vec<Point>,
    /// Cache bytes the advice and the per-volume hit ratios are judged at: the node's
    /// cache now, else the first `--size`, else 1 GiB.
    at_bytes: u64,
    /// Read hit ratios at `at_bytes`: the tier's read-write policy (if simulated at that
    /// size), an LRU cache's.
    at_tier_read_hit: Option<f64>,
    at_lru_read_hit: Option<f64>,
    mode: &'static str,
    why: String,
}

/// Cache sizes: 64 MiB doubling to twice the working set (at least 1 GiB), the cache now,
/// the sizes the tier was simulated at, and those asked for; sorted, unique.
fn sizes(m: &Mrc, now: u64, simulated: &[u64], asked: &[u64]) -> Vec<u64> {
    let ws = (m.blocks * BLOCK_SIZE as f64) as u64;
    let top = (2 * ws).max(1 << 30);
    let mut v = Vec::new();
    let mut s: u64 = 64 << 20;
    while s <= top {
        v.push(s);
        s *= 2;
    }
    v.push(s);
    let mut fixed: Vec<u64> = simulated.to_vec();
    if now > 0 {
        fixed.push(now);
    }
    v.extend_from_slice(&fixed);
    v.extend_from_slice(asked);
    v.sort_unstable();
    v.dedup();
    // A ladder step within 2 % of the cache now or of a simulated size reads as the same
    // size twice.
    v.retain(|&s| {
        fixed.contains(&s) || asked.contains(&s) || fixed.iter().all(|&f| s.abs_diff(f) * 50 > f)
    });
    v
}

/// The tier's read-write policy's read hit ratio at `bytes`, if it was simulated there.
fn tier_at(tier: &[TierHit], bytes: u64) -> Option<f64> {
    tier.iter()
        .find(|t| t.mode == CacheMode::ReadWrite && t.cache_bytes == bytes)
        .and_then(TierHit::read_hit_ratio)
}

fn blocks(bytes: u64) -> u64 {
    bytes / BLOCK_SIZE as u64
}

/// The mode that suits what the curve shows at `size` bytes of cache: judged by the tier's
/// read-write policy's read hit ratio `tier` where it was simulated, else by LRU's.
fn advise(m: &Mrc, size: u64, tier: Option<f64>) -> (&'static str, String) {
    if m.refs <= 0.0 {
        return (
            "-",
            "no client I/O seen since the node started: run the workload, then ask again".into(),
        );
    }
    let reads = m.reads / m.refs;
    let writes = 1.0 - reads;
    let hit = tier.or_else(|| m.hit_ratio(blocks(size), true));
    let at = if tier.is_some() {
        format!("{} cache (the tier's policy, simulated)", format_size(size))
    } else {
        format!("{} cache (LRU)", format_size(size))
    };
    match hit {
        Some(h) if h >= 0.3 => (
            "read-write",
            format!(
                "{:.0} % of reads would hit a {at}: keep hot reads on the cache drive",
                100.0 * h
            ),
        ),
        h if writes >= 0.1 => (
            "write",
            format!(
                "reads would hit {} in a {at}, but {:.0} % of accesses are writes: the \
                 log absorbs them (acked at the cache drive's latency, destaged later)",
                h.map_or("nothing".into(), |h| format!("{:.0} %", 100.0 * h)),
                100.0 * writes
            ),
        ),
        h => (
            "none",
            format!(
                "reads would hit {} in a {at} and only {:.0} % of accesses are writes: \
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
    let AdviseCmd::Cache { node, size, html } = cmd;
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
        let at_tier = tier_at(&a.tier, at);
        let (mode, why) = advise(&a.mrc, at, at_tier);
        let simulated: Vec<u64> = a
            .tier
            .iter()
            .filter(|t| t.mode == CacheMode::ReadWrite)
            .map(|t| t.cache_bytes)
            .collect();
        let curve = sizes(&a.mrc, a.cache_bytes, &simulated, &asked)
            .into_iter()
            .map(|s| {
                (
                    s,
                    a.mrc.hit_ratio(blocks(s), true),
                    a.mrc.hit_ratio(blocks(s), false),
                    tier_at(&a.tier, s),
                )
            })
            .collect();
        out.push(NodeAdvice {
            node: n.id,
            at_lru_read_hit: a.mrc.hit_ratio(blocks(at), true),
            advice: a,
            curve,
            at_bytes: at,
            at_tier_read_hit: at_tier,
            mode,
            why,
        });
    }
    if let Some(path) = html {
        std::fs::write(path, charts(&out))
            .with_context(|| format!("--html: writing {}", path.display()))?;
        eprintln!("charts: {}", path.display());
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
        let mut t = Table::new(&[
            "CACHE SIZE",
            "READ HIT: TIER POLICY",
            "READ HIT: ANY CACHE COULD (LRU)",
            "ALL HIT (LRU)",
        ]);
        for &(s, r, all, tier) in &na.curve {
            let label = if s == a.cache_bytes {
                format!("{} (now)", format_size(s))
            } else {
                format_size(s)
            };
            t.row(vec![label, pct(tier), pct(r), pct(all)]);
        }
        t.row(vec![
            "unbounded".into(),
            "–".into(),
            pct(m.max_hit_ratio(true)),
            pct(m.max_hit_ratio(false)),
        ]);
        for l in t.render().lines() {
            println!("  {l}");
        }
        // The cache's own mode, if it is not read-write: what the tier gives as it is.
        for th in a
            .tier
            .iter()
            .filter(|t| t.mode != CacheMode::ReadWrite && t.cache_bytes == a.cache_bytes)
        {
            println!(
                "  at the cache now, in its mode {}: {} of reads hit (simulated; the column \
                 above is read-write mode)",
                th.mode,
                pct(th.read_hit_ratio())
            );
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
        "\nOver the I/O since each node started. TIER POLICY: the cache tier's read-write \
         policy (admission on the second miss, FIFO log) simulated on the sampled blocks at ¼ \
         to 4 times the node's cache; LRU: what any cache of that size could give, often \
         more (docs/CACHE.md, \"Cache advice\")."
    );
    Ok(())
}

/// The curves as a page: per node with I/O, read hit ratio (%) at each cache size — the
/// tier's policy where simulated, LRU's everywhere — and LRU's hit ratio of all accesses.
fn charts(out: &[NodeAdvice]) -> String {
    use converge_fleet::report::{html_page, Item, Section};
    use converge_fleet::svg::{Chart, GroupedChart, Series};
    let secs: Vec<Section> = out
        .iter()
        .map(|na| {
            let series = |name: &str, f: &dyn Fn(&Point) -> Option<f64>| Series {
                name: name.into(),
                values: na.curve.iter().map(|p| f(p).map(|h| 100.0 * h)).collect(),
            };
            let items = if na.advice.mrc.refs <= 0.0 {
                vec![Item::Text(na.why.clone())]
            } else {
                vec![
                    Item::Chart(Chart::Grouped(GroupedChart {
                        title: format!("node {}: read hit ratio against cache size", na.node),
                        x_label: "cache size".into(),
                        groups: na
                            .curve
                            .iter()
                            .map(|p| {
                                if p.0 == na.advice.cache_bytes {
                                    format!("{} (now)", format_size(p.0))
                                } else {
                                    format_size(p.0)
                                }
                            })
                            .collect(),
                        bars: vec![
                            series("read hit: tier policy", &|p| p.3),
                            series("read hit: any cache could (LRU)", &|p| p.1),
                        ],
                        bar_unit: "%".into(),
                        lines: vec![series("all accesses hit (LRU)", &|p| p.2)],
                        line_unit: None,
                        fmt: |v| format!("{v:.1} %"),
                        line_fmt: |v| format!("{v:.1} %"),
                    })),
                    Item::Text(format!("advice: {} — {}", na.mode, na.why)),
                ]
            };
            Section {
                id: format!("node{}", na.node),
                title: format!("node {}", na.node),
                items,
            }
        })
        .collect();
    html_page(
        "converge advise cache",
        "Over the I/O since each node started (docs/CACHE.md, \"Cache advice\").",
        false,
        &secs,
    )
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
        assert_eq!(advise(&curve(0.9, blocks(g) / 2), g, None).0, "read-write");
        // No reuse within the cache, many writes: write.
        assert_eq!(advise(&curve(0.5, blocks(g) * 4), g, None).0, "write");
        // No reuse, nearly all reads: none.
        assert_eq!(advise(&curve(0.95, blocks(g) * 4), g, None).0, "none");
        assert_eq!(advise(&Mrc::default(), g, None).0, "-");
        // The tier's policy, where simulated, decides over LRU's curve.
        let (mode, why) = advise(&curve(0.95, blocks(g) / 2), g, Some(0.1));
        assert_eq!(mode, "none", "{why}");
        assert!(
            why.contains("10 %") && why.contains("tier's policy"),
            "{why}"
        );
        assert_eq!(
            advise(&curve(0.9, blocks(g) * 4), g, Some(0.4)).0,
            "read-write"
        );
    }

    #[test]
    fn sizes_double_past_the_working_set_and_include_the_cache_and_asked() {
        let m = Mrc {
            blocks: (3u64 << 30) as f64 / 4096.0,
            ..Mrc::default()
        };
        let now = (256 << 20) - 8192;
        let v = sizes(&m, now, &[now / 4, now, now * 4], &[5 << 30]);
        assert!(
            !v.contains(&(256 << 20)) && !v.contains(&(64 << 20)) && !v.contains(&(1 << 30)),
            "the cache now and the simulated sizes stand for 64 MiB, 256 MiB, 1 GiB: {v:?}"
        );
        assert!(v.contains(&(now / 4)) && v.contains(&(now * 4)), "{v:?}");
        let v = sizes(&m, 300 << 20, &[], &[5 << 30]);
        assert_eq!(v.first(), Some(&(64 << 20)));
        assert!(v.contains(&(300 << 20)) && v.contains(&(5 << 30)));
        assert!(*v.last().unwrap() >= 6 << 30);
        assert!(v.windows(2).all(|w| w[0] < w[1]));
    }
}
