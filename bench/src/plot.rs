//! The bench's two SVG plots, both systems on each: throughput against
//! clients, and latency percentiles (p50 solid, p99 dashed) against
//! clients. Both axes are logarithmic (x in powers of two, the client
//! counts the bench uses). Drawn with plotters' SVG backend, whose text is
//! rendered by whatever shows the file (no fonts needed here).

use plotters::backend::SVGBackend;
use plotters::chart::ChartBuilder;
use plotters::chart::SeriesLabelPosition;
use plotters::coord::combinators::BindKeyPoints;
use plotters::coord::combinators::IntoLogRange;
use plotters::drawing::IntoDrawingArea;
use plotters::element::Circle;
use plotters::element::EmptyElement;
use plotters::element::PathElement;
use plotters::series::DashedLineSeries;
use plotters::series::LineSeries;
use plotters::style::Color;
use plotters::style::IntoFont;
use plotters::style::RGBColor;
use plotters::style::TRANSPARENT;
use plotters::style::WHITE;

use crate::report::Summary;

const WIDTH: u32 = 900;
const HEIGHT: u32 = 560;
const INK: RGBColor = RGBColor(0x22, 0x22, 0x22);
const OURS: RGBColor = RGBColor(0x1f, 0x77, 0xb4);
const ETCD: RGBColor = RGBColor(0xd6, 0x27, 0x28);
const TRANSFERS: RGBColor = RGBColor(0x2c, 0xa0, 0x2c);

/// One line: its legend label, colour, dashed or not, and (clients, value)
/// points.
struct Line {
    label: String,
    color: RGBColor,
    dashed: bool,
    points: Vec<(f64, f64)>,
}

fn line(label: &str, color: RGBColor, dashed: bool, points: Vec<(usize, f64)>) -> Line {
    Line {
        label: label.to_string(),
        color,
        dashed,
        points: points
            .into_iter()
            .filter(|(n, v)| *n > 0 && v.is_finite() && *v > 0.0)
            .map(|(n, v)| ((n as f64).log2(), v))
            .collect(),
    }
}

/// Operations per second against clients: our Decide, etcd's
/// put-if-absent and our transfers.
pub fn throughput_svg(s: &Summary) -> Result<String, String> {
    let lines = vec![
        line(
            "ours: Decide/s",
            OURS,
            false,
            s.decide.iter().map(|(n, p)| (*n, p.stats.per_sec)).collect(),
        ),
        line(
            "etcd: put-if-absent/s",
            ETCD,
            false,
            s.etcd.iter().map(|(n, p)| (*n, p.stats.per_sec)).collect(),
        ),
        line(
            "ours: transfers/s",
            TRANSFERS,
            false,
            s.transfers.iter().map(|t| (t.clients, t.stats.per_sec)).collect(),
        ),
    ];
    render(
        "Throughput against clients (3 replicas each, fsync on)",
        "operations/s",
        &lines,
    )
}

/// p50 (solid) and p99 (dashed) latency in ms against clients.
pub fn latency_svg(s: &Summary) -> Result<String, String> {
    let ms = |us: u64| us as f64 / 1000.0;
    let lines = vec![
        line(
            "ours: Decide p50",
            OURS,
            false,
            s.decide.iter().map(|(n, p)| (*n, ms(p.stats.p50_us))).collect(),
        ),
        line(
            "ours: Decide p99",
            OURS,
            true,
            s.decide.iter().map(|(n, p)| (*n, ms(p.stats.p99_us))).collect(),
        ),
        line(
            "etcd: put-if-absent p50",
            ETCD,
            false,
            s.etcd.iter().map(|(n, p)| (*n, ms(p.stats.p50_us))).collect(),
        ),
        line(
            "etcd: put-if-absent p99",
            ETCD,
            true,
            s.etcd.iter().map(|(n, p)| (*n, ms(p.stats.p99_us))).collect(),
        ),
        line(
            "ours: transfer p50",
            TRANSFERS,
            false,
            s.transfers.iter().map(|t| (t.clients, ms(t.stats.p50_us))).collect(),
        ),
        line(
            "ours: transfer p99",
            TRANSFERS,
            true,
            s.transfers.iter().map(|t| (t.clients, ms(t.stats.p99_us))).collect(),
        ),
    ];
    render(
        "Latency against clients (p50 solid, p99 dashed)",
        "latency (ms)",
        &lines,
    )
}

/// Ticks for a logarithmic axis from `lo` to `hi`: 1, 2 and 5 times each
/// power of ten in between.
pub fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    if !(lo > 0.0 && hi >= lo && hi.is_finite()) {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut exp = lo.log10().floor() as i32;
    while 10f64.powi(exp) <= hi {
        for m in [1.0, 2.0, 5.0] {
            let v = m * 10f64.powi(exp);
            if v >= lo && v <= hi {
                out.push(v);
            }
        }
        exp += 1;
    }
    out
}

/// A tick label: no trailing zeros (0.5, 2, 1000).
fn tick_label(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// The axis ranges: x in log2(clients) with half a step of room, y from a
/// bit under the smallest value to a bit over the largest (0.1 to 10 when
/// there is nothing to draw).
fn ranges(lines: &[Line]) -> ((f64, f64), (f64, f64)) {
    let pts = lines.iter().flat_map(|l| l.points.iter());
    let (mut x_lo, mut x_hi, mut y_lo, mut y_hi) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (x, y) in pts {
        x_lo = x_lo.min(*x);
        x_hi = x_hi.max(*x);
        y_lo = y_lo.min(*y);
        y_hi = y_hi.max(*y);
    }
    if x_lo > x_hi {
        return ((-0.5, 8.5), (0.1, 10.0));
    }
    // A factor of 1.6 each way spans more than 2.5, the widest gap between
    // two ticks of `log_ticks`, so there is always a tick.
    ((x_lo - 0.5, x_hi + 0.5), (y_lo / 1.6, y_hi * 1.6))
}

fn render(title: &str, y_desc: &str, lines: &[Line]) -> Result<String, String> {
    let err = |e: &dyn std::fmt::Display| format!("cannot draw plot {title:?}: {e}");
    let ((x_lo, x_hi), (y_lo, y_hi)) = ranges(lines);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22).into_font().color(&INK))
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(75)
            .build_cartesian_2d(
                x_lo..x_hi,
                (y_lo..y_hi).log_scale().with_key_points(log_ticks(y_lo, y_hi)),
            )
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("clients (log scale)")
            .y_desc(format!("{y_desc} (log scale)"))
            // x is log2(clients): ticks at whole steps are powers of two.
            .x_labels(((x_hi - x_lo).ceil() as usize).max(2))
            .x_label_formatter(&|v| {
                if (v - v.round()).abs() < 1e-6 && *v >= 0.0 {
                    format!("{}", 2f64.powi(v.round() as i32))
                } else {
                    String::new()
                }
            })
            .y_label_formatter(&|v| tick_label(*v))
            .bold_line_style(INK.mix(0.15))
            .light_line_style(TRANSPARENT)
            .label_style(("sans-serif", 13).into_font().color(&INK))
            .axis_desc_style(("sans-serif", 15).into_font().color(&INK))
            .draw()
            .map_err(|e| err(&e))?;
        for l in lines.iter().filter(|l| !l.points.is_empty()) {
            let style = l.color.stroke_width(2);
            let anno = if l.dashed {
                chart.draw_series(DashedLineSeries::new(l.points.clone(), 8, 5, style))
            } else {
                chart.draw_series(LineSeries::new(l.points.clone(), style))
            }
            .map_err(|e| err(&e))?;
            // The legend's swatch: two segments, with a gap when dashed.
            let gap = if l.dashed { 5 } else { 0 };
            anno.label(l.label.clone()).legend(move |(x, y)| {
                EmptyElement::at((x, y))
                    + PathElement::new(vec![(0, 0), (8, 0)], style)
                    + PathElement::new(vec![(8 + gap, 0), (22, 0)], style)
            });
            chart
                .draw_series(l.points.iter().map(|p| Circle::new(*p, 3, l.color.filled())))
                .map_err(|e| err(&e))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(INK)
            .label_font(("sans-serif", 13).into_font().color(&INK))
            .draw()
            .map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Phase;
    use crate::report::Stats;

    fn phase(per_sec: f64) -> Phase {
        Phase {
            stats: Stats {
                ops: 10,
                per_sec,
                p50_us: 1500,
                p99_us: 4000,
            },
            unknown: 0,
            errors: 0,
            first_error: None,
            cpu_us_per_op: None,
            leader_change: None,
            leader_work: None,
        }
    }

    #[test]
    fn both_systems_are_on_each_plot_and_an_empty_run_still_draws() {
        let s = Summary {
            fsync_p50_us: 100,
            decide: vec![(1, phase(600.0)), (64, phase(9000.0))],
            etcd: vec![(1, phase(500.0)), (64, phase(3000.0))],
            transfers: vec![],
        };
        for svg in [throughput_svg(&s).unwrap(), latency_svg(&s).unwrap()] {
            assert!(svg.starts_with("<svg"), "{}", &svg[..60.min(svg.len())]);
            assert!(svg.contains("ours: Decide") && svg.contains("etcd: put-if-absent"));
            assert!(!svg.contains("transfer"), "no transfers were measured");
        }
        assert!(latency_svg(&s).unwrap().contains("p99"));
        let empty = throughput_svg(&Summary::default()).unwrap();
        assert!(empty.starts_with("<svg"));
    }

    #[test]
    fn log_ticks_are_one_two_five_per_decade_within_the_range() {
        assert_eq!(log_ticks(0.3, 60.0), vec![0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0]);
        assert_eq!(log_ticks(100.0, 100.0), vec![100.0]);
        assert!(log_ticks(0.0, 10.0).is_empty());
        assert_eq!(tick_label(0.5), "0.5");
        assert_eq!(tick_label(2000.0), "2000");
    }
}
