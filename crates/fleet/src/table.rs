//! Tables of the report and their three renderings (terminal text, Markdown, HTML), and the
//! RA layout of a metric over a sweep: one block per block size (and workers per node),
//! rows = queue depth, columns = read % from 100 down to 0.

use crate::model::{PointStats, RunSummary};
use crate::profile::Point;
use converge_types::format_size;
use std::collections::BTreeSet;

/// Shown in a cell whose point was not measured (an interrupted run).
pub const NOT_MEASURED: &str = "–";

#[derive(Clone, Debug, PartialEq)]
pub struct Table {
    /// Caption; empty for none.
    pub title: String,
    pub header: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(title: impl Into<String>, header: &[&str]) -> Table {
        Table {
            title: title.into(),
            header: header.iter().map(|s| s.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    fn widths(&self) -> Vec<usize> {
        let mut w: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for r in &self.rows {
            for (i, c) in r.iter().enumerate().take(w.len()) {
                w[i] = w[i].max(c.chars().count());
            }
        }
        w
    }

    /// Aligned columns: the first left-aligned (labels), the rest right-aligned (numbers).
    pub fn to_text(&self) -> String {
        let w = self.widths();
        let mut out = String::new();
        if !self.title.is_empty() {
            out.push_str(&self.title);
            out.push('\n');
        }
        let line = |cells: &[String]| {
            let mut s = String::new();
            for (i, width) in w.iter().enumerate() {
                let c = cells.get(i).map(String::as_str).unwrap_or("");
                let pad = width.saturating_sub(c.chars().count());
                if i > 0 {
                    s.push_str("  ");
                    s.push_str(&" ".repeat(pad));
                    s.push_str(c);
                } else {
                    s.push_str(c);
                    s.push_str(&" ".repeat(pad));
                }
            }
            s.trim_end().to_string() + "\n"
        };
        out.push_str(&line(&self.header));
        for r in &self.rows {
            out.push_str(&line(r));
        }
        out
    }

    pub fn to_markdown(&self) -> String {
        let esc = |s: &str| s.replace('|', "\\|");
        let mut out = String::new();
        if !self.title.is_empty() {
            out.push_str(&format!("**{}**\n\n", self.title));
        }
        out.push_str(&format!(
            "| {} |\n",
            self.header
                .iter()
                .map(|h| esc(h))
                .collect::<Vec<_>>()
                .join(" | ")
        ));
        out.push_str(&format!(
            "|{}|\n",
            (0..self.header.len())
                .map(|i| if i == 0 { "---" } else { "---:" })
                .collect::<Vec<_>>()
                .join("|")
        ));
        for r in &self.rows {
            let mut cells: Vec<String> = r.iter().map(|c| esc(c)).collect();
            cells.resize(self.header.len(), String::new());
            out.push_str(&format!("| {} |\n", cells.join(" | ")));
        }
        out
    }

    pub fn to_html(&self) -> String {
        let mut out = String::from("<table>");
        if !self.title.is_empty() {
            out.push_str(&format!("<caption>{}</caption>", html_escape(&self.title)));
        }
        out.push_str("<thead><tr>");
        for h in &self.header {
            out.push_str(&format!("<th>{}</th>", html_escape(h)));
        }
        out.push_str("</tr></thead><tbody>");
        for r in &self.rows {
            out.push_str("<tr>");
            for (i, c) in r.iter().enumerate() {
                let tag = if i == 0 { "th" } else { "td" };
                out.push_str(&format!("<{tag}>{}</{tag}>", html_escape(c)));
            }
            out.push_str("</tr>");
        }
        out.push_str("</tbody></table>\n");
        out
    }

    /// Cells with nothing in them (a filled table has none).
    pub fn empty_cells(&self) -> usize {
        self.rows
            .iter()
            .map(|r| {
                r.iter().filter(|c| c.trim().is_empty()).count()
                    + self.header.len().saturating_sub(r.len())
            })
            .sum()
    }
}

pub fn html_escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

/// One block of the RA layout: the points of one block size and one fleet size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    pub bs_bytes: u64,
    pub workers_per_node: u32,
    /// Row keys, ascending.
    pub qds: Vec<u32>,
    /// Column keys, descending (100 = all reads first).
    pub read_pcts: Vec<u8>,
}

impl Block {
    pub fn label(&self) -> String {
        format!(
            "{}, {} worker{}/node",
            format_size(self.bs_bytes),
            self.workers_per_node,
            if self.workers_per_node == 1 { "" } else { "s" }
        )
    }

    pub fn contains(&self, p: &Point) -> bool {
        p.bs_bytes == self.bs_bytes && p.workers_per_node == self.workers_per_node
    }
}

/// The blocks of a run's planned points (measured or not), in run order.
pub fn blocks(s: &RunSummary) -> Vec<Block> {
    let planned = crate::profile::points(&s.config.settings);
    let mut keys: Vec<(u64, u32)> = Vec::new();
    for p in &planned {
        if !keys.contains(&(p.bs_bytes, p.workers_per_node)) {
            keys.push((p.bs_bytes, p.workers_per_node));
        }
    }
    keys.into_iter()
        .map(|(bs, w)| {
            let mine = planned
                .iter()
                .filter(|p| p.bs_bytes == bs && p.workers_per_node == w);
            let qds: BTreeSet<u32> = mine.clone().map(|p| p.qd).collect();
            let reads: BTreeSet<u8> = mine.map(|p| p.read_pct()).collect();
            Block {
                bs_bytes: bs,
                workers_per_node: w,
                qds: qds.into_iter().collect(),
                read_pcts: reads.into_iter().rev().collect(),
            }
        })
        .collect()
}

/// A metric in the RA layout, one table per block. `cell` gives a measured point's text;
/// unmeasured points show `NOT_MEASURED`.
pub fn ra_tables(
    s: &RunSummary,
    metric: &str,
    cell: impl Fn(&Point, &PointStats) -> String,
) -> Vec<Table> {
    let bl = blocks(s);
    let many = bl.len() > 1;
    bl.iter()
        .map(|b| {
            let title = if many {
                format!("{metric} — {}", b.label())
            } else {
                metric.to_string()
            };
            let mut header = vec!["QD".to_string()];
            header.extend(b.read_pcts.iter().map(|r| format!("read {r} %")));
            let mut t = Table {
                title,
                header,
                rows: Vec::new(),
            };
            for &qd in &b.qds {
                let mut row = vec![qd.to_string()];
                for &r in &b.read_pcts {
                    let c = s
                        .measured()
                        .find(|(p, _)| b.contains(p) && p.qd == qd && p.read_pct() == r)
                        .map(|(p, st)| cell(p, st))
                        .unwrap_or_else(|| NOT_MEASURED.to_string());
                    row.push(c);
                }
                t.row(row);
            }
            t
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::{config, summary_from};

    fn summary(write: Vec<u64>, qd: Vec<u64>, measured: usize) -> RunSummary {
        summary_from(&config(write, qd), measured, |_, p| 100.0 * f64::from(p.qd))
    }

    #[test]
    fn ra_layout_rows_are_qd_and_columns_read_pct_descending() {
        let s = summary(vec![0, 10, 30, 100], vec![1, 2, 4, 8], 16);
        let t = ra_tables(&s, "IOPS", |_, st| format!("{:.0}", st.iops));
        assert_eq!(t.len(), 1);
        let t = &t[0];
        assert_eq!(
            t.header,
            vec!["QD", "read 100 %", "read 90 %", "read 70 %", "read 0 %"]
        );
        let rows: Vec<&str> = t.rows.iter().map(|r| r[0].as_str()).collect();
        assert_eq!(rows, vec!["1", "2", "4", "8"]);
        // 4 workers × 100 × QD.
        assert_eq!(t.rows[2], vec!["4", "1600", "1600", "1600", "1600"]);
        assert_eq!(t.empty_cells(), 0);
        let text = t.to_text();
        assert_eq!(text.lines().next().unwrap(), "IOPS", "title first:\n{text}");
        assert_eq!(
            text.lines().nth(1).unwrap(),
            "QD  read 100 %  read 90 %  read 70 %  read 0 %"
        );
        assert_eq!(
            text.lines().nth(2).unwrap(),
            format!(
                "1{}400{}400{}400{}400",
                " ".repeat(10),
                " ".repeat(8),
                " ".repeat(8),
                " ".repeat(7)
            )
        );
    }

    #[test]
    fn unmeasured_points_are_marked_and_blocks_split() {
        let s = summary(vec![0, 100], vec![1, 8], 3);
        let t = &ra_tables(&s, "IOPS", |_, st| format!("{:.0}", st.iops))[0];
        assert_eq!(t.rows[1], vec!["8", "3200", NOT_MEASURED]);
        let mut s2 = s.clone();
        s2.config.settings.workers_per_node = vec![1, 2];
        let t = ra_tables(&s2, "IOPS", |_, st| format!("{:.0}", st.iops));
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].title, "IOPS — 4 KiB, 1 worker/node");
        assert_eq!(t[1].title, "IOPS — 4 KiB, 2 workers/node");
    }

    #[test]
    fn markdown_and_html_renderings() {
        let mut t = Table::new("T", &["a", "b|c"]);
        t.row(vec!["x<y".into(), "1".into()]);
        t.row(vec!["z".into()]);
        assert_eq!(t.empty_cells(), 1);
        let md = t.to_markdown();
        assert!(
            md.contains("| a | b\\|c |\n|---|---:|\n| x<y | 1 |\n| z |  |"),
            "{md}"
        );
        let h = t.to_html();
        assert!(h.contains("<caption>T</caption>"));
        assert!(h.contains("<th>x&lt;y</th><td>1</td>"), "{h}");
    }
}
