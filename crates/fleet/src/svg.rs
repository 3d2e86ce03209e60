//! Hand-written SVG charts for the self-contained HTML report (no scripts, no external
//! assets): grouped bars with optional lines on a second axis, and log-scale latency
//! percentile curves. Hovering a bar or point shows its value (SVG `<title>`).

use crate::table::html_escape as esc;
use std::fmt::Write as _;

const PALETTE: [&str; 10] = [
    "#3366cc", "#ff9900", "#109618", "#dc3912", "#990099", "#0099c6", "#dd4477", "#66aa00",
    "#b82e2e", "#316395",
];

pub fn color(i: usize) -> &'static str {
    PALETTE[i % PALETTE.len()]
}

/// The series colour darkened, for lines drawn over that series' bars.
pub fn dark(i: usize) -> String {
    let c = color(i).trim_start_matches('#');
    let ch = |k: usize| {
        u8::from_str_radix(c.get(k..k + 2).unwrap_or("00"), 16).unwrap_or(0) as f64 * 0.55
    };
    format!("#{:02x}{:02x}{:02x}", ch(0) as u8, ch(2) as u8, ch(4) as u8)
}

/// Legend entries laid out left to right, wrapping into more rows: (x, row) per entry.
fn legend_layout(widths: &[f64], x0: f64, x1: f64) -> Vec<(f64, usize)> {
    let mut out = Vec::new();
    let (mut x, mut row) = (x0, 0);
    for &w in widths {
        if x > x0 && x + w > x1 {
            x = x0;
            row += 1;
        }
        out.push((x, row));
        x += w;
    }
    out
}

#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub name: String,
    /// One value per group (None: not measured).
    pub values: Vec<Option<f64>>,
}

/// Bars grouped along x (e.g. by QD), one bar per series (e.g. read %), and lines drawn
/// through the same positions, on the bars' axis or a second one at the right.
#[derive(Clone, Debug)]
pub struct GroupedChart {
    pub title: String,
    pub x_label: String,
    pub groups: Vec<String>,
    pub bars: Vec<Series>,
    pub bar_unit: String,
    pub lines: Vec<Series>,
    /// Some(unit): lines on their own right-hand axis; None: on the bars' axis.
    pub line_unit: Option<String>,
    /// Value formatting for tooltips and ticks.
    pub fmt: fn(f64) -> String,
    pub line_fmt: fn(f64) -> String,
}

/// Latency against percentile, one curve per series, on log-log-like axes: x in "nines"
/// (90, 99, 99.9 ... evenly spaced), y logarithmic.
#[derive(Clone, Debug, PartialEq)]
pub struct CurveChart {
    pub title: String,
    /// (name, [(percentile, latency µs)]).
    pub series: Vec<(String, Vec<(f64, f64)>)>,
    pub width: f64,
    pub height: f64,
}

/// Values against time, one line per series, on linear axes from 0, with thin vertical
/// marks (their labels as tooltips) where something began: the run's points.
#[derive(Clone, Debug)]
pub struct TimeChart {
    pub title: String,
    /// The y axis' unit, e.g. "IOPS".
    pub unit: String,
    /// (name, [(seconds, value)]).
    pub series: Vec<(String, Vec<(f64, f64)>)>,
    pub marks: Vec<(f64, String)>,
    /// Tick and tooltip formatting of values.
    pub fmt: fn(f64) -> String,
    /// A line breaks where two neighbouring values are further apart than this, in
    /// seconds (a series without a value there: a drive with no operations has no
    /// latency); 0: never.
    pub gap_s: f64,
    pub width: f64,
    pub height: f64,
}

#[derive(Clone, Debug)]
pub enum Chart {
    Grouped(GroupedChart),
    Curves(CurveChart),
    Time(TimeChart),
}

impl Chart {
    pub fn render(&self) -> String {
        match self {
            Chart::Grouped(g) => grouped(g),
            Chart::Curves(c) => curves(c),
            Chart::Time(t) => time(t),
        }
    }

    pub fn title(&self) -> &str {
        match self {
            Chart::Grouped(g) => &g.title,
            Chart::Curves(c) => &c.title,
            Chart::Time(t) => &t.title,
        }
    }
}

/// A step of 1, 2 or 5 × 10^k giving about `n` ticks up to `max`.
pub fn nice_step(max: f64, n: u32) -> f64 {
    if max <= 0.0 || !max.is_finite() {
        return 1.0;
    }
    let raw = max / f64::from(n.max(1));
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let m = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    m * mag
}

/// Axis top and step: the smallest multiple of a nice step at or above `max`.
pub fn axis(max: f64) -> (f64, f64) {
    let step = nice_step(max, 5);
    let top = (max / step).ceil().max(1.0) * step;
    (top, step)
}

fn series_max(s: &[Series]) -> f64 {
    s.iter()
        .flat_map(|x| x.values.iter().flatten())
        .copied()
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max)
}

fn text(out: &mut String, x: f64, y: f64, anchor: &str, extra: &str, s: &str) {
    let _ = write!(
        out,
        r#"<text x="{x:.1}" y="{y:.1}" text-anchor="{anchor}" {extra}>{}</text>"#,
        esc(s)
    );
}

fn grouped(c: &GroupedChart) -> String {
    let (w, h) = (760.0, 360.0);
    let right_axis = c.line_unit.is_some() && !c.lines.is_empty();
    let (ml, mr, mt) = (70.0, if right_axis { 70.0 } else { 20.0 }, 36.0);
    // Legend: bars then lines, wrapping; its rows decide the bottom margin.
    let entry_w = |name: &str, line: bool| {
        (if line { 30.0 } else { 24.0 }) + 6.6 * name.chars().count() as f64
    };
    let widths: Vec<f64> = c
        .bars
        .iter()
        .map(|s| entry_w(&s.name, false))
        .chain(c.lines.iter().map(|s| entry_w(&s.name, true)))
        .collect();
    let legend = legend_layout(&widths, ml, w - 10.0);
    let rows = legend.iter().map(|(_, r)| r + 1).max().unwrap_or(1) as f64;
    let h = h + 18.0 * (rows - 1.0);
    let mb = 78.0 + 18.0 * (rows - 1.0);
    let (pw, ph) = (w - ml - mr, h - mt - mb);
    let mut o = String::new();
    let _ = write!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" height="{h}" font-family="sans-serif" font-size="12" role="img"><title>{}</title>"#,
        esc(&c.title)
    );
    let _ = write!(o, r##"<rect width="{w}" height="{h}" fill="#fff"/>"##);
    text(
        &mut o,
        w / 2.0,
        20.0,
        "middle",
        r#"font-size="14" font-weight="bold""#,
        &c.title,
    );
    let mut bar_max = series_max(&c.bars);
    if c.line_unit.is_none() {
        bar_max = bar_max.max(series_max(&c.lines));
    }
    let (top, step) = axis(bar_max);
    let y_of = |v: f64| mt + ph - (v / top) * ph;
    // Grid and left axis.
    let mut t = 0.0;
    while t <= top + step / 2.0 {
        let y = y_of(t);
        let _ = write!(
            o,
            r##"<line x1="{ml}" x2="{:.1}" y1="{y:.1}" y2="{y:.1}" stroke="#e5e5e5"/>"##,
            ml + pw
        );
        text(&mut o, ml - 6.0, y + 4.0, "end", "", &(c.fmt)(t));
        t += step;
    }
    let _ = write!(
        o,
        r##"<line x1="{ml}" x2="{ml}" y1="{mt}" y2="{:.1}" stroke="#333"/><line x1="{ml}" x2="{:.1}" y1="{:.1}" y2="{:.1}" stroke="#333"/>"##,
        mt + ph,
        ml + pw,
        mt + ph,
        mt + ph
    );
    text(
        &mut o,
        16.0,
        mt + ph / 2.0,
        "middle",
        &format!(r#"transform="rotate(-90 16 {:.1})""#, mt + ph / 2.0),
        &c.bar_unit,
    );
    let ng = c.groups.len().max(1) as f64;
    let gw = pw / ng;
    let ns = c.bars.len().max(1) as f64;
    let bw = gw * 0.8 / ns;
    let x_of = |g: usize, s: usize| ml + gw * g as f64 + gw * 0.1 + bw * (s as f64 + 0.5);
    for (gi, g) in c.groups.iter().enumerate() {
        text(
            &mut o,
            ml + gw * (gi as f64 + 0.5),
            mt + ph + 16.0,
            "middle",
            "",
            g,
        );
    }
    text(
        &mut o,
        ml + pw / 2.0,
        mt + ph + 32.0,
        "middle",
        "",
        &c.x_label,
    );
    for (si, s) in c.bars.iter().enumerate() {
        for (gi, v) in s.values.iter().enumerate() {
            let Some(v) = v.filter(|v| v.is_finite()) else {
                continue;
            };
            let x = x_of(gi, si) - bw / 2.0;
            let y = y_of(v.max(0.0));
            let _ = write!(
                o,
                r#"<rect x="{x:.1}" y="{y:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{}, {}: {} {}</title></rect>"#,
                (bw - 1.0).max(1.0),
                (mt + ph - y).max(0.0),
                color(si),
                esc(&s.name),
                esc(&c.groups.get(gi).cloned().unwrap_or_default()),
                esc(&(c.fmt)(v)),
                esc(&c.bar_unit)
            );
        }
    }
    // Lines: on the right axis, or the bars' axis.
    let (ltop, lstep) = if right_axis {
        axis(series_max(&c.lines))
    } else {
        (top, step)
    };
    let ly_of = |v: f64| mt + ph - (v / ltop) * ph;
    if let Some(unit) = c.line_unit.as_ref().filter(|_| right_axis) {
        let mut t = 0.0;
        while t <= ltop + lstep / 2.0 {
            text(
                &mut o,
                ml + pw + 6.0,
                ly_of(t) + 4.0,
                "start",
                "",
                &(c.line_fmt)(t),
            );
            t += lstep;
        }
        let _ = write!(
            o,
            r##"<line x1="{:.1}" x2="{:.1}" y1="{mt}" y2="{:.1}" stroke="#333"/>"##,
            ml + pw,
            ml + pw,
            mt + ph
        );
        let xr = w - 14.0;
        text(
            &mut o,
            xr,
            mt + ph / 2.0,
            "middle",
            &format!(r#"transform="rotate(90 {xr:.1} {:.1})""#, mt + ph / 2.0),
            unit,
        );
    }
    let nbars = c.bars.len();
    for (li, s) in c.lines.iter().enumerate() {
        // A line per bar series sits on that series' bars; extra lines on group centres.
        let col = if c.lines.len() == nbars {
            dark(li)
        } else {
            "#222".to_string()
        };
        let xs = |gi: usize| {
            if c.lines.len() == nbars {
                x_of(gi, li)
            } else {
                ml + gw * (gi as f64 + 0.5)
            }
        };
        let pts: Vec<(f64, f64, f64, usize)> = s
            .values
            .iter()
            .enumerate()
            .filter_map(|(gi, v)| {
                v.filter(|v| v.is_finite())
                    .map(|v| (xs(gi), ly_of(v.max(0.0)), v, gi))
            })
            .collect();
        if pts.len() > 1 {
            let path: Vec<String> = pts
                .iter()
                .map(|(x, y, _, _)| format!("{x:.1},{y:.1}"))
                .collect();
            let _ = write!(
                o,
                r#"<polyline points="{}" fill="none" stroke="{col}" stroke-width="2" stroke-dasharray="5 3"/>"#,
                path.join(" ")
            );
        }
        for (x, y, v, gi) in &pts {
            let _ = write!(
                o,
                r##"<circle cx="{x:.1}" cy="{y:.1}" r="4" fill="{col}" stroke="#fff" stroke-width="1.5"><title>{}, {}: {} {}</title></circle>"##,
                esc(&s.name),
                esc(&c.groups.get(*gi).cloned().unwrap_or_default()),
                esc(&(c.line_fmt)(*v)),
                esc(c.line_unit.as_deref().unwrap_or(&c.bar_unit))
            );
        }
    }
    // Legend.
    let ly0 = mt + ph + 52.0;
    for (si, s) in c.bars.iter().enumerate() {
        let (lx, row) = legend[si];
        let ly = ly0 + 18.0 * row as f64;
        let _ = write!(
            o,
            r#"<rect x="{lx:.1}" y="{:.1}" width="12" height="12" fill="{}"/>"#,
            ly - 10.0,
            color(si)
        );
        text(&mut o, lx + 16.0, ly, "start", "", &s.name);
    }
    for (li, s) in c.lines.iter().enumerate() {
        let (lx, row) = legend[nbars + li];
        let ly = ly0 + 18.0 * row as f64;
        let col = if c.lines.len() == nbars {
            dark(li)
        } else {
            "#222".to_string()
        };
        let _ = write!(
            o,
            r#"<line x1="{lx:.1}" x2="{:.1}" y1="{:.1}" y2="{:.1}" stroke="{col}" stroke-width="2" stroke-dasharray="5 3"/><circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{col}"/>"#,
            lx + 20.0,
            ly - 4.0,
            ly - 4.0,
            lx + 10.0,
            ly - 4.0
        );
        text(&mut o, lx + 24.0, ly, "start", "", &s.name);
    }
    o.push_str("</svg>");
    o
}

/// Position of a percentile on the "nines" axis: 90 → 1, 99 → 2, 99.9 → 3 ...
pub fn nines(p: f64) -> f64 {
    let rest = (1.0 - p / 100.0).max(1e-7);
    -rest.log10()
}

/// An SVG of `w` × `h` on white, titled (tooltip and heading).
fn open(w: f64, h: f64, title: &str) -> String {
    let mut o = String::new();
    let _ = write!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" height="{h}" font-family="sans-serif" font-size="11" role="img"><title>{}</title>"#,
        esc(title)
    );
    let _ = write!(o, r##"<rect width="{w}" height="{h}" fill="#fff"/>"##);
    text(
        &mut o,
        w / 2.0,
        18.0,
        "middle",
        r#"font-weight="bold""#,
        title,
    );
    o
}

/// A line through `pts` ("x,y" each), named by its tooltip.
fn polyline(o: &mut String, pts: &[String], stroke: &str, width: f64, name: &str) {
    let _ = write!(
        o,
        r#"<polyline points="{}" fill="none" stroke="{stroke}" stroke-width="{width}"><title>{}</title></polyline>"#,
        pts.join(" "),
        esc(name)
    );
}

fn curves(c: &CurveChart) -> String {
    let (w, h) = (c.width, c.height);
    let (ml, mr, mt, mb) = (58.0, 24.0, 30.0, 40.0);
    let (pw, ph) = (w - ml - mr, h - mt - mb);
    let mut o = open(w, h, &c.title);
    let all: Vec<f64> = c
        .series
        .iter()
        .flat_map(|(_, v)| v.iter().map(|(_, l)| *l))
        .filter(|v| v.is_finite() && *v > 0.0)
        .collect();
    let lo = all.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = all.iter().copied().fold(0.0, f64::max);
    let (d0, d1) = if all.is_empty() {
        (1.0, 3.0)
    } else {
        let a = lo.log10().floor();
        let b = hi.log10().ceil().max(a + 1.0);
        (a, b)
    };
    let y_of = |us: f64| mt + ph - (us.max(1e-3).log10() - d0) / (d1 - d0) * ph;
    let xmax = 5.0;
    let x_of = |p: f64| ml + nines(p).min(xmax) / xmax * pw;
    let mut d = d0;
    while d <= d1 + 1e-9 {
        let y = y_of(10f64.powf(d));
        let _ = write!(
            o,
            r##"<line x1="{ml}" x2="{:.1}" y1="{y:.1}" y2="{y:.1}" stroke="#e5e5e5"/>"##,
            ml + pw
        );
        text(
            &mut o,
            ml - 5.0,
            y + 4.0,
            "end",
            "",
            &crate::format::lat_us(10f64.powf(d)),
        );
        d += 1.0;
    }
    for (p, label) in [
        (0.0, "0"),
        (90.0, "90"),
        (99.0, "99"),
        (99.9, "99.9"),
        (99.99, "99.99"),
        (99.999, "99.999"),
    ] {
        let x = x_of(p);
        let _ = write!(
            o,
            r##"<line x1="{x:.1}" x2="{x:.1}" y1="{mt}" y2="{:.1}" stroke="#e5e5e5"/>"##,
            mt + ph
        );
        text(&mut o, x, mt + ph + 14.0, "middle", "", label);
    }
    text(&mut o, ml + pw / 2.0, h - 6.0, "middle", "", "percentile");
    let _ = write!(
        o,
        r##"<rect x="{ml}" y="{mt}" width="{pw:.1}" height="{ph:.1}" fill="none" stroke="#333"/>"##
    );
    for (i, (name, pts)) in c.series.iter().enumerate() {
        let pts: Vec<String> = pts
            .iter()
            .filter(|(_, l)| l.is_finite() && *l > 0.0)
            .map(|(p, l)| format!("{:.1},{:.1}", x_of(*p), y_of(*l)))
            .collect();
        if !pts.is_empty() {
            polyline(&mut o, &pts, color(i), 1.5, name);
        }
    }
    o.push_str("</svg>");
    o
}

fn time(c: &TimeChart) -> String {
    let (w, h) = (c.width, c.height);
    let (ml, mr, mt, mb) = (64.0, 16.0, 30.0, 40.0);
    let (pw, ph) = (w - ml - mr, h - mt - mb);
    let mut o = open(w, h, &c.title);
    let finite = |v: &f64| v.is_finite();
    let t_max = c
        .series
        .iter()
        .flat_map(|(_, v)| v.iter().map(|p| p.0))
        .chain(c.marks.iter().map(|m| m.0))
        .filter(finite)
        .fold(0.0, f64::max);
    let y_max = c
        .series
        .iter()
        .flat_map(|(_, v)| v.iter().map(|p| p.1))
        .filter(finite)
        .fold(0.0, f64::max);
    let (x_top, x_step) = axis(t_max);
    let (y_top, y_step) = axis(y_max);
    let x_of = |t: f64| ml + t.max(0.0) / x_top * pw;
    let y_of = |v: f64| mt + ph - v.max(0.0) / y_top * ph;
    let mut y = 0.0;
    while y <= y_top + y_step * 1e-9 {
        let py = y_of(y);
        let _ = write!(
            o,
            r##"<line x1="{ml}" x2="{:.1}" y1="{py:.1}" y2="{py:.1}" stroke="#e5e5e5"/>"##,
            ml + pw
        );
        text(&mut o, ml - 5.0, py + 4.0, "end", "", &(c.fmt)(y));
        y += y_step;
    }
    let mut x = 0.0;
    while x <= x_top + x_step * 1e-9 {
        text(
            &mut o,
            x_of(x),
            mt + ph + 14.0,
            "middle",
            "",
            &crate::format::duration_s(x),
        );
        x += x_step;
    }
    text(
        &mut o,
        ml + pw / 2.0,
        h - 6.0,
        "middle",
        "",
        "time into the run",
    );
    text(&mut o, 12.0, mt - 8.0, "start", "", &c.unit);
    for (t, what) in &c.marks {
        let px = x_of(*t);
        let _ = write!(
            o,
            r##"<line x1="{px:.1}" x2="{px:.1}" y1="{mt}" y2="{:.1}" stroke="#bbb" stroke-dasharray="2,3"><title>{}</title></line>"##,
            mt + ph,
            esc(what)
        );
    }
    let _ = write!(
        o,
        r##"<rect x="{ml}" y="{mt}" width="{pw:.1}" height="{ph:.1}" fill="none" stroke="#333"/>"##
    );
    for (i, (name, pts)) in c.series.iter().enumerate() {
        let pts: Vec<&(f64, f64)> = pts
            .iter()
            .filter(|(t, v)| t.is_finite() && v.is_finite())
            .collect();
        let mut runs: Vec<Vec<String>> = Vec::new();
        let mut last: Option<f64> = None;
        for (t, v) in pts {
            if last.is_none_or(|l| c.gap_s > 0.0 && t - l > c.gap_s) {
                runs.push(Vec::new());
            }
            if let Some(r) = runs.last_mut() {
                r.push(format!("{:.1},{:.1}", x_of(*t), y_of(*v)));
            }
            last = Some(*t);
        }
        for run in runs {
            polyline(&mut o, &run, color(i), 1.2, name);
        }
    }
    o.push_str("</svg>");
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_time_chart_draws_a_line_per_series_and_a_mark_per_point() {
        let c = TimeChart {
            title: "drive <IOPS>".into(),
            unit: "IOPS".into(),
            series: vec![
                (
                    "drive 1".into(),
                    vec![(1.0, 10.0), (2.0, 30.0), (3.0, f64::NAN), (5.0, 1.0)],
                ),
                ("drive 2".into(), vec![(1.0, 5.0), (2.0, 7.0)]),
                ("idle".into(), vec![]),
            ],
            marks: vec![(0.5, "QD 1".into()), (2.5, "QD 2".into())],
            fmt: |v| format!("{v}"),
            gap_s: 1.5,
            width: 600.0,
            height: 200.0,
        };
        let s = Chart::Time(c).render();
        // drive 1 breaks after 2 s (no value until 5 s): two lines; drive 2 one.
        assert_eq!(s.matches("<polyline").count(), 3);
        assert_eq!(s.matches("stroke-dasharray").count(), 2);
        assert!(s.contains("drive &lt;IOPS&gt;"));
        assert!(!s.contains("NaN"));
    }

    fn f(v: f64) -> String {
        format!("{v}")
    }

    #[test]
    fn nice_axes() {
        assert_eq!(axis(0.0), (1.0, 1.0));
        assert_eq!(axis(9.3), (10.0, 2.0));
        assert_eq!(axis(15_194.0), (20_000.0, 5_000.0));
        assert_eq!(axis(0.42), (0.5, 0.1));
        assert!((nines(99.9) - 3.0).abs() < 1e-9);
        assert!((nines(90.0) - 1.0).abs() < 1e-9);
        assert_eq!(nines(0.0), 0.0);
    }

    #[test]
    fn grouped_chart_is_wellformed_svg_with_a_bar_per_value() {
        let c = GroupedChart {
            title: "IOPS <by> QD".into(),
            x_label: "queue depth per worker".into(),
            groups: vec!["QD 1".into(), "QD 2".into()],
            bars: vec![
                Series {
                    name: "read 100 %".into(),
                    values: vec![Some(10.0), Some(20.0)],
                },
                Series {
                    name: "read 0 %".into(),
                    values: vec![Some(5.0), None],
                },
            ],
            bar_unit: "IOPS".into(),
            lines: vec![
                Series {
                    name: "lat".into(),
                    values: vec![Some(1.0), Some(2.0)],
                },
                Series {
                    name: "lat w".into(),
                    values: vec![Some(3.0), None],
                },
            ],
            line_unit: Some("ms".into()),
            fmt: f,
            line_fmt: f,
        };
        let s = Chart::Grouped(c).render();
        assert!(s.starts_with("<svg") && s.ends_with("</svg>"));
        assert_eq!(
            s.matches("<rect x=").count(),
            3 + 2,
            "3 bars + 2 legend keys"
        );
        assert_eq!(
            s.matches("<circle cx").count() - 2,
            3,
            "3 points + 2 legend keys"
        );
        assert!(s.contains("IOPS &lt;by&gt; QD"));
        assert!(!s.contains("NaN") && !s.contains("inf"));
    }

    #[test]
    fn curves_are_drawn_per_series() {
        let c = CurveChart {
            title: "w".into(),
            series: vec![
                ("a".into(), vec![(50.0, 100.0), (99.9, 2000.0)]),
                ("b".into(), vec![(50.0, 150.0), (99.99, 9000.0)]),
            ],
            width: 300.0,
            height: 200.0,
        };
        let s = Chart::Curves(c).render();
        assert_eq!(s.matches("<polyline").count(), 2);
        assert!(!s.contains("NaN"));
    }
}
