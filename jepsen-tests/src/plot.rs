//! Latency and throughput over time as SVG images, drawn the way Jepsen
//! draws them, with every fault interval shaded.
//!
//! - [`latency_svg`]: a scatter of every completed client operation at
//!   (completion time in seconds since the run started, latency in ms) on a
//!   log-scale y axis, coloured by outcome (ok = blue, fail = red,
//!   info = orange).
//! - [`throughput_svg`]: operations completed per second, binned (1-second
//!   bins, wider for long runs so there are at most [`MAX_BINS`] bins), one
//!   line per outcome with the same colours.
//!
//! In both, each fault interval is a translucent vertical band across the
//! plot area, coloured by fault name, and a legend on the right lists the
//! outcome colours and the fault names.
//!
//! The input is independent of the history format: the runner converts its
//! history into [`Sample`]s and [`FaultInterval`]s. Bad values never panic:
//! a sample whose completion time is NaN, infinite or negative is skipped, a
//! NaN or +infinite latency leaves it out of the latency plot (it still
//! counts as a completion for throughput), and a latency ≤ 0 is drawn on the
//! lowest decade of the axis.
//!
//! The drawing is done by `plotters` with its SVG backend: SVG text is
//! rendered by whatever displays the file, so no font files or system
//! libraries are needed (plotters' bitmap text needs one or the other).

use std::path::Path;
use std::path::PathBuf;

use plotters::backend::SVGBackend;
use plotters::chart::ChartBuilder;
use plotters::chart::ChartContext;
use plotters::coord::cartesian::Cartesian2d;
use plotters::coord::combinators::IntoLogRange;
use plotters::coord::ranged1d::Ranged;
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::drawing::DrawingArea;
use plotters::drawing::DrawingAreaErrorKind;
use plotters::drawing::IntoDrawingArea;
use plotters::element::Circle;
use plotters::element::Rectangle;
use plotters::element::Text;
use plotters::series::LineSeries;
use plotters::style::Color;
use plotters::style::IntoFont;
use plotters::style::RGBColor;
use plotters::style::TextStyle;
use plotters::style::TRANSPARENT;

/// How a client operation completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// It happened.
    Ok,
    /// It certainly did not happen.
    Fail,
    /// Unknown: it may or may not have happened.
    Info,
}

impl Outcome {
    /// All outcomes, in drawing order (later ones are drawn on top, so the
    /// rarer, more interesting failures stay visible).
    const ALL: [Outcome; 3] = [Outcome::Ok, Outcome::Info, Outcome::Fail];

    /// The outcomes in legend order.
    const LEGEND: [Outcome; 3] = [Outcome::Ok, Outcome::Fail, Outcome::Info];

    fn color(self) -> RGBColor {
        match self {
            Outcome::Ok => RGBColor(0x1f, 0x77, 0xb4),
            Outcome::Fail => RGBColor(0xd6, 0x27, 0x28),
            Outcome::Info => RGBColor(0xff, 0x7f, 0x0e),
        }
    }

    fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Fail => "fail",
            Outcome::Info => "info",
        }
    }

    /// Index into per-outcome arrays such as [`Bins::counts`].
    fn index(self) -> usize {
        match self {
            Outcome::Ok => 0,
            Outcome::Fail => 1,
            Outcome::Info => 2,
        }
    }
}

/// One completed client operation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    /// Completion time, seconds since the run started.
    pub done_s: f64,
    /// Time from invocation to completion, milliseconds.
    pub latency_ms: f64,
    pub outcome: Outcome,
}

/// A fault that was active from `start_s` to `end_s` (seconds since the run
/// started). An infinite `end_s` means it was still active at the end.
#[derive(Clone, Debug, PartialEq)]
pub struct FaultInterval {
    pub name: String,
    pub start_s: f64,
    pub end_s: f64,
}

/// Everything a plot needs.
#[derive(Clone, Copy, Debug)]
pub struct PlotInput<'a> {
    /// Drawn as the title at the top.
    pub title: &'a str,
    pub samples: &'a [Sample],
    pub faults: &'a [FaultInterval],
    /// Length of the run in seconds: the x axis spans 0..duration_s (widened
    /// if a sample completed later).
    pub duration_s: f64,
}

/// Why a plot could not be written.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("cannot write plot {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot draw plot: {0}")]
    Draw(String),
}

impl<E: std::error::Error + Send + Sync> From<DrawingAreaErrorKind<E>> for PlotError {
    fn from(e: DrawingAreaErrorKind<E>) -> PlotError {
        PlotError::Draw(e.to_string())
    }
}

/// Writes the latency-over-time scatter plot to `path` as an SVG.
pub fn latency_svg(input: &PlotInput, path: &Path) -> Result<(), PlotError> {
    write_file(path, &render_latency(input)?)
}

/// Writes the throughput-over-time plot to `path` as an SVG.
pub fn throughput_svg(input: &PlotInput, path: &Path) -> Result<(), PlotError> {
    write_file(path, &render_throughput(input)?)
}

fn write_file(path: &Path, svg: &str) -> Result<(), PlotError> {
    std::fs::write(path, svg).map_err(|source| PlotError::Io {
        path: path.to_path_buf(),
        source,
    })
}

// ---------------------------------------------------------------------------
// Layout and colours
// ---------------------------------------------------------------------------

/// Image size in pixels.
const WIDTH: u32 = 1000;
const HEIGHT: u32 = 500;

/// Width of the legend column on the right; the chart gets the rest.
const LEGEND_WIDTH: u32 = 190;
/// Legend geometry inside its column, in pixels.
const LEGEND_TOP: i32 = 50;
const LEGEND_ROW: i32 = 16;
const SWATCH: i32 = 10;

/// Longest title and legend fault name drawn; longer ones are cut.
const MAX_TITLE_CHARS: usize = 70;
const MAX_LEGEND_CHARS: usize = 28;

/// Throughput: at most this many bins; longer runs get wider bins.
pub const MAX_BINS: usize = 300;

/// Opacity of fault bands (their legend swatches use twice as much).
const BAND_ALPHA: f64 = 0.22;

/// Radius of a latency dot, pixels.
const DOT_RADIUS: i32 = 2;

const FONT: &str = "sans-serif";
const INK: RGBColor = RGBColor(0x20, 0x20, 0x20);
const BACKGROUND: RGBColor = RGBColor(0xff, 0xff, 0xff);
const GRID: RGBColor = RGBColor(0xe8, 0xe8, 0xe8);

/// Colours for fault bands; none is close to an outcome colour.
/// At least as many as there are nemeses (seventeen), so every fault of a
/// run with all of them has a colour of its own.
const FAULT_PALETTE: [RGBColor; 18] = [
    RGBColor(0x2c, 0xa0, 0x2c), // green
    RGBColor(0x94, 0x67, 0xbd), // purple
    RGBColor(0x8c, 0x56, 0x4b), // brown
    RGBColor(0xe3, 0x77, 0xc2), // pink
    RGBColor(0x7f, 0x7f, 0x7f), // grey
    RGBColor(0xbc, 0xbd, 0x22), // olive
    RGBColor(0x17, 0xbe, 0xcf), // cyan
    RGBColor(0x00, 0x60, 0x60), // dark teal
    RGBColor(0xe6, 0xc2, 0x00), // gold
    RGBColor(0x1b, 0x2a, 0x7a), // navy
    RGBColor(0xb0, 0x00, 0xb0), // magenta
    RGBColor(0x7f, 0xe0, 0x00), // lime
    RGBColor(0xd2, 0xb4, 0x8c), // sand
    RGBColor(0x1e, 0x5a, 0x1e), // forest
    RGBColor(0x55, 0x6b, 0x2f), // dark olive
    RGBColor(0x80, 0x00, 0x20), // maroon
    RGBColor(0x4b, 0x00, 0x82), // indigo
    RGBColor(0x99, 0x55, 0x00), // rust
];

/// `text` cut to at most `max_chars` characters, ending in ".." if cut.
fn truncate(text: &str, max_chars: usize) -> String {
    if text.chars().count() <= max_chars {
        return text.to_string();
    }
    let kept: String = text.chars().take(max_chars.saturating_sub(2)).collect();
    format!("{kept}..")
}

fn text_style(size: u32) -> TextStyle<'static> {
    (FONT, size).into_font().color(&INK)
}

// ---------------------------------------------------------------------------
// Axes
// ---------------------------------------------------------------------------

/// Whether a sample's completion time can be plotted.
fn valid_time(t: f64) -> bool {
    t.is_finite() && t >= 0.0
}

/// The end of the x axis: the run's duration, widened to cover every
/// sample; 1 s if there is nothing sensible.
fn x_axis_max(input: &PlotInput) -> f64 {
    let duration = if input.duration_s.is_finite() && input.duration_s > 0.0 {
        input.duration_s
    } else {
        0.0
    };
    let last = input
        .samples
        .iter()
        .map(|s| s.done_s)
        .filter(|t| valid_time(*t))
        .fold(0.0, f64::max);
    let max = duration.max(last);
    if max > 0.0 {
        max
    } else {
        1.0
    }
}

/// The decades (lo, hi) of the latency plot's log axis, 10^lo..10^hi ms:
/// from the decade below the smallest positive latency to the decade above
/// the largest (1 ms..1 s if there are none), kept within 1 µs..10^7 ms.
fn latency_decades(input: &PlotInput) -> (i32, i32) {
    const LOWEST: i32 = -3;
    const HIGHEST: i32 = 7;
    let positive = input
        .samples
        .iter()
        .filter(|s| valid_time(s.done_s) && s.latency_ms.is_finite() && s.latency_ms > 0.0)
        .map(|s| s.latency_ms);
    let (min, max) = positive.fold((f64::INFINITY, 0.0_f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if max > 0.0 {
        let lo = (min.log10().floor() as i32).clamp(LOWEST, HIGHEST - 1);
        let hi = (max.log10().ceil() as i32).clamp(lo + 1, HIGHEST);
        (lo, hi)
    } else {
        (0, 3)
    }
}

/// A latency tick label: whole milliseconds, or as many decimals as a
/// sub-millisecond value needs.
fn format_ms(v: &f64) -> String {
    if *v >= 1.0 || *v <= 0.0 {
        format!("{v:.0}")
    } else {
        let decimals = (-v.log10()).ceil().max(0.0) as usize;
        format!("{v:.decimals$}")
    }
}

/// A linear-axis tick label: the value with at most three decimals and
/// no trailing zeros ("0", "2.5", "0.125").
fn format_tick(v: &f64) -> String {
    let text = format!("{v:.3}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    if text == "-0" {
        "0".to_string()
    } else {
        text.to_string()
    }
}

/// A "nice" tick step (1, 2 or 5 × 10^k) giving about `target` ticks over
/// `range`.
fn nice_step(range: f64, target: f64) -> f64 {
    let raw = range / target;
    if !(raw.is_finite() && raw > 0.0) {
        return 1.0;
    }
    let magnitude = 10f64.powf(raw.log10().floor());
    let norm = raw / magnitude;
    let nice = if norm < 1.5 {
        1.0
    } else if norm < 3.0 {
        2.0
    } else if norm < 7.0 {
        5.0
    } else {
        10.0
    };
    nice * magnitude
}

// ---------------------------------------------------------------------------
// Throughput bins
// ---------------------------------------------------------------------------

/// Completions per outcome in consecutive time bins.
#[derive(Clone, Debug, PartialEq)]
struct Bins {
    /// Width of every bin in seconds (a whole number, at least 1).
    width_s: f64,
    /// `counts[outcome.index()][i]`: completions in [i·width, (i+1)·width).
    counts: [Vec<u64>; 3],
}

impl Bins {
    /// Completions per second of `outcome` in bin `i`.
    fn rate(&self, outcome: Outcome, i: usize) -> f64 {
        self.counts[outcome.index()][i] as f64 / self.width_s
    }

    fn len(&self) -> usize {
        self.counts[0].len()
    }
}

/// Bins every valid sample by completion time over 0..x_max: 1-second bins,
/// or wider whole-second bins so there are at most [`MAX_BINS`]. A sample at
/// exactly x_max falls in the last bin.
fn bin_samples(samples: &[Sample], x_max: f64) -> Bins {
    let x_max = if x_max.is_finite() && x_max > 0.0 { x_max } else { 1.0 };
    let width_s = (x_max / MAX_BINS as f64).ceil().max(1.0);
    let n = ((x_max / width_s).ceil() as usize).clamp(1, MAX_BINS);
    let mut counts = [vec![0; n], vec![0; n], vec![0; n]];
    for s in samples.iter().filter(|s| valid_time(s.done_s)) {
        let i = ((s.done_s / width_s).floor() as usize).min(n - 1);
        counts[s.outcome.index()][i] += 1;
    }
    Bins { width_s, counts }
}

/// The top of the throughput plot's linear y axis (which starts at 0): a
/// round number above the highest rate plus a little headroom, at least 1.
fn throughput_y_max(bins: &Bins) -> f64 {
    let peak = Outcome::ALL
        .iter()
        .flat_map(|o| (0..bins.len()).map(move |i| bins.rate(*o, i)))
        .fold(0.0, f64::max);
    if peak > 0.0 {
        // 5% headroom so a line at the peak does not run along the frame.
        let top = peak * 1.05;
        let step = nice_step(top, 5.0);
        ((top / step).ceil() * step).max(1.0)
    } else {
        1.0
    }
}

// ---------------------------------------------------------------------------
// Faults
// ---------------------------------------------------------------------------

/// FNV-1a: a small hash that is stable across runs and Rust versions.
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The distinct fault names in order of first appearance, each with its
/// colour: the palette entry picked by the name's hash, or the next free one
/// if an earlier name already took it (so names differ in colour while the
/// palette lasts).
fn fault_colors(faults: &[FaultInterval]) -> Vec<(&str, RGBColor)> {
    let mut assigned: Vec<(&str, RGBColor)> = Vec::new();
    let mut taken = [false; FAULT_PALETTE.len()];
    for fault in faults {
        if assigned.iter().any(|(name, _)| *name == fault.name) {
            continue;
        }
        let home = (fnv1a(&fault.name) % FAULT_PALETTE.len() as u64) as usize;
        let slot = (0..FAULT_PALETTE.len())
            .map(|k| (home + k) % FAULT_PALETTE.len())
            .find(|i| !taken[*i])
            .unwrap_or(home);
        taken[slot] = true;
        assigned.push((&fault.name, FAULT_PALETTE[slot]));
    }
    assigned
}

/// The part of each fault interval on the axis 0..x_max, with its colour.
/// Intervals with a NaN bound, that end before they start or that lie
/// entirely off the axis are left out; an infinite end runs to the end of
/// the axis, and every band is at least `min_width` wide.
fn fault_bands(faults: &[FaultInterval], x_max: f64, min_width: f64) -> Vec<(f64, f64, RGBColor)> {
    let colors = fault_colors(faults);
    faults
        .iter()
        .filter(|f| !(f.start_s.is_nan() || f.end_s.is_nan() || f.end_s < f.start_s))
        .filter(|f| f.end_s >= 0.0 && f.start_s <= x_max)
        .map(|f| {
            let color = colors
                .iter()
                .find(|(name, _)| *name == f.name)
                .map_or(FAULT_PALETTE[0], |(_, c)| *c);
            let start = f.start_s.max(0.0);
            let end = f.end_s.min(x_max).max((start + min_width).min(x_max));
            let start = start.min(end - min_width).max(0.0);
            (start, end, color)
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Drawing
// ---------------------------------------------------------------------------

/// A chart with time (s) on the x axis and `Y` on the y axis.
type Chart<'a, 'b, Y> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, Y>>;

/// Fills the background, splits off the legend column (drawn here) and
/// returns the area for the chart.
fn layout<'b>(
    root: &DrawingArea<SVGBackend<'b>, Shift>,
    faults: &[FaultInterval],
) -> Result<DrawingArea<SVGBackend<'b>, Shift>, PlotError> {
    root.fill(&BACKGROUND)?;
    let (chart_area, legend_area) = root.split_horizontally(WIDTH - LEGEND_WIDTH);
    draw_legend(&legend_area, faults)?;
    Ok(chart_area)
}

/// The chart builder both plots share: title on top, room for tick labels
/// and axis descriptions.
fn chart_builder<'a, 'b>(
    area: &'a DrawingArea<SVGBackend<'b>, Shift>,
    title: &str,
) -> ChartBuilder<'a, 'b, SVGBackend<'b>> {
    let mut builder = ChartBuilder::on(area);
    if !title.is_empty() {
        builder.caption(truncate(title, MAX_TITLE_CHARS), text_style(24));
    }
    builder.margin(10).x_label_area_size(45).y_label_area_size(70);
    builder
}

/// Shades the fault intervals over the whole height of the plot area, then
/// outlines the plot area.
fn draw_faults_and_frame<Y: Ranged<ValueType = f64>>(
    chart: &mut Chart<Y>,
    faults: &[FaultInterval],
) -> Result<(), PlotError> {
    let x = chart.x_range();
    let y = chart.y_range();
    // One pixel of the plot area in seconds, so no band is invisible.
    let px = (x.end - x.start) / f64::from(chart.plotting_area().dim_in_pixel().0.max(1));
    let bands = fault_bands(faults, x.end, px);
    chart.draw_series(
        bands.into_iter().map(|(start, end, color)| {
            Rectangle::new([(start, y.end), (end, y.start)], color.mix(BAND_ALPHA).filled())
        }),
    )?;
    chart.plotting_area().draw(&Rectangle::new(
        [(x.start, y.end), (x.end, y.start)],
        INK.stroke_width(1),
    ))?;
    Ok(())
}

/// The legend column: outcome colours, then fault names.
fn draw_legend(area: &DrawingArea<SVGBackend, Shift>, faults: &[FaultInterval]) -> Result<(), PlotError> {
    let label = |text: &str, x: i32, y: i32| Text::new(text.to_string(), (x, y - 2), text_style(14));
    let mut y = LEGEND_TOP;
    for outcome in Outcome::LEGEND {
        area.draw(&Rectangle::new(
            [(0, y), (SWATCH, y + SWATCH)],
            outcome.color().filled(),
        ))?;
        area.draw(&label(outcome.label(), SWATCH + 4, y))?;
        y += LEGEND_ROW;
    }
    let colors = fault_colors(faults);
    if colors.is_empty() {
        return Ok(());
    }
    y += LEGEND_ROW / 2;
    area.draw(&label("faults:", 0, y))?;
    y += LEGEND_ROW;
    let bottom = HEIGHT as i32 - 50;
    for (name, color) in colors {
        if y + LEGEND_ROW > bottom {
            area.draw(&label("...", 0, y))?;
            break;
        }
        // The swatch looks like a band: translucent fill, solid outline.
        let corners = [(0, y), (SWATCH, y + SWATCH)];
        area.draw(&Rectangle::new(corners, color.mix(BAND_ALPHA * 2.0).filled()))?;
        area.draw(&Rectangle::new(corners, color.stroke_width(1)))?;
        area.draw(&label(&truncate(name, MAX_LEGEND_CHARS), SWATCH + 4, y))?;
        y += LEGEND_ROW;
    }
    Ok(())
}

/// The latency scatter plot as an SVG document.
fn render_latency(input: &PlotInput) -> Result<String, PlotError> {
    let x_max = x_axis_max(input);
    let (lo, hi) = latency_decades(input);
    let (y_lo, y_hi) = (10f64.powi(lo), 10f64.powi(hi));
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        let area = layout(&root, input.faults)?;
        let mut chart = chart_builder(&area, input.title).build_cartesian_2d(0.0..x_max, (y_lo..y_hi).log_scale())?;
        chart
            .configure_mesh()
            .axis_style(INK)
            .light_line_style(TRANSPARENT)
            .bold_line_style(GRID)
            .label_style(text_style(13))
            .axis_desc_style(text_style(15))
            .x_desc("time (s)")
            .y_desc("latency (ms)")
            .x_label_formatter(&format_tick)
            .y_label_formatter(&format_ms)
            .draw()?;
        draw_faults_and_frame(&mut chart, input.faults)?;
        for outcome in Outcome::ALL {
            let points = input.samples.iter().filter(|s| {
                s.outcome == outcome && valid_time(s.done_s) && !s.latency_ms.is_nan()
                    // +inf has no place on the axis; -inf is ≤ 0 and clamps.
                    && s.latency_ms != f64::INFINITY
            });
            let style = outcome.color().filled();
            chart.draw_series(
                points.map(|s| Circle::new((s.done_s, s.latency_ms.clamp(y_lo, y_hi)), DOT_RADIUS, style)),
            )?;
        }
        root.present()?;
    }
    Ok(svg)
}

/// The throughput plot as an SVG document: one line per outcome through
/// the bin centres.
fn render_throughput(input: &PlotInput) -> Result<String, PlotError> {
    let x_max = x_axis_max(input);
    let bins = bin_samples(input.samples, x_max);
    let y_max = throughput_y_max(&bins);
    let y_desc = if bins.width_s > 1.0 {
        format!("throughput (ops/s, {} s bins)", bins.width_s)
    } else {
        "throughput (ops/s)".to_string()
    };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        let area = layout(&root, input.faults)?;
        let mut chart = chart_builder(&area, input.title).build_cartesian_2d(0.0..x_max, 0.0..y_max)?;
        chart
            .configure_mesh()
            .axis_style(INK)
            .light_line_style(TRANSPARENT)
            .bold_line_style(GRID)
            .label_style(text_style(13))
            .axis_desc_style(text_style(15))
            .x_desc("time (s)")
            .y_desc(y_desc)
            .x_label_formatter(&format_tick)
            .y_label_formatter(&format_tick)
            .draw()?;
        draw_faults_and_frame(&mut chart, input.faults)?;
        for outcome in Outcome::ALL {
            if bins.counts[outcome.index()].iter().all(|c| *c == 0) {
                continue; // no line for an outcome that never happened
            }
            let points: Vec<(f64, f64)> = (0..bins.len())
                .map(|i| (((i as f64 + 0.5) * bins.width_s).min(x_max), bins.rate(outcome, i)))
                .collect();
            let color = outcome.color();
            if let [point] = points[..] {
                chart.draw_series([Circle::new(point, DOT_RADIUS, color.filled())])?;
            } else {
                chart.draw_series(LineSeries::new(points, color.stroke_width(2)))?;
            }
        }
        root.present()?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::atomic::Ordering;

    /// A unique path in the system temp directory.
    fn temp_svg(name: &str) -> PathBuf {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        std::env::temp_dir().join(format!("jepsen-plot-{}-{n}-{name}.svg", std::process::id()))
    }

    /// One SVG element: its name, attributes and (for `<text>`) its text.
    #[derive(Debug)]
    struct Element {
        name: String,
        attrs: Vec<(String, String)>,
        text: String,
    }

    impl Element {
        fn attr(&self, key: &str) -> Option<&str> {
            self.attrs.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
        }

        fn num(&self, key: &str) -> f64 {
            let v = self.attr(key).unwrap_or_else(|| panic!("{self:?} has no {key}"));
            v.parse().unwrap_or_else(|_| panic!("{key}={v:?} is not a number"))
        }

        /// The points of a polyline.
        fn points(&self) -> Vec<(f64, f64)> {
            let points = self.attr("points").expect("points");
            points
                .split_whitespace()
                .map(|p| {
                    let (x, y) = p.split_once(',').expect("x,y");
                    (x.parse().expect("x"), y.parse().expect("y"))
                })
                .collect()
        }
    }

    /// Replaces the five XML entities; panics on a bare `&`.
    fn unescape(s: &str) -> String {
        let mut out = String::new();
        let mut rest = s;
        while let Some(i) = rest.find('&') {
            out.push_str(&rest[..i]);
            rest = &rest[i..];
            let entities = [
                ("&lt;", '<'),
                ("&gt;", '>'),
                ("&amp;", '&'),
                ("&quot;", '"'),
                ("&apos;", '\''),
            ];
            let (entity, c) = entities
                .iter()
                .find(|(e, _)| rest.starts_with(e))
                .unwrap_or_else(|| panic!("bare & in {s:?}"));
            out.push(*c);
            rest = &rest[entity.len()..];
        }
        out.push_str(rest);
        out
    }

    /// Parses the flat XML plotters writes into its elements, in document
    /// order, checking that it is well formed: one `<svg>` root holding
    /// everything, every tag closed in order, attributes quoted, no stray
    /// `<` or `&`.
    fn parse_svg(svg: &str) -> Vec<Element> {
        let mut elements: Vec<Element> = Vec::new();
        let mut open: Vec<usize> = Vec::new();
        let mut rest = svg;
        while let Some(lt) = rest.find('<') {
            let between = &rest[..lt];
            match open.last() {
                Some(&top) => elements[top].text.push_str(&unescape(between)),
                None => assert!(between.trim().is_empty(), "text outside the root: {between:?}"),
            }
            let gt = rest[lt..].find('>').expect("tag is closed") + lt;
            let tag = &rest[lt + 1..gt];
            rest = &rest[gt + 1..];
            assert!(!tag.contains('<'), "stray < in {tag:?}");
            if let Some(name) = tag.strip_prefix('/') {
                let top = open.pop().unwrap_or_else(|| panic!("</{name}> closes nothing"));
                assert_eq!(elements[top].name, name.trim(), "closing tag in order");
                continue;
            }
            assert!(elements.is_empty() || !open.is_empty(), "a second root: {tag:?}");
            let self_closing = tag.ends_with('/');
            let body = tag.trim_end_matches('/').trim();
            let (name, mut attrs_text) = body.split_once(char::is_whitespace).unwrap_or((body, ""));
            let mut attrs = Vec::new();
            loop {
                attrs_text = attrs_text.trim_start();
                if attrs_text.is_empty() {
                    break;
                }
                let (key, after) = attrs_text.split_once("=\"").expect("key=\"value\"");
                let (value, after) = after.split_once('"').expect("closing quote");
                assert!(
                    !key.is_empty() && !key.contains(char::is_whitespace),
                    "attribute name {key:?}"
                );
                attrs.push((key.to_string(), unescape(value)));
                attrs_text = after;
            }
            elements.push(Element {
                name: name.to_string(),
                attrs,
                text: String::new(),
            });
            if !self_closing {
                open.push(elements.len() - 1);
            }
        }
        assert!(rest.trim().is_empty(), "text after the root");
        assert!(open.is_empty(), "unclosed tags");
        assert_eq!(elements.first().map(|e| e.name.as_str()), Some("svg"));
        elements
    }

    /// `#RRGGBB`, the way the SVG backend writes colours.
    fn hex(c: RGBColor) -> String {
        format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
    }

    fn texts(elements: &[Element]) -> Vec<String> {
        elements
            .iter()
            .filter(|e| e.name == "text")
            .map(|e| e.text.trim().to_string())
            .collect()
    }

    /// Filled dots of `color`.
    fn dots(elements: &[Element], color: RGBColor) -> Vec<&Element> {
        elements
            .iter()
            .filter(|e| e.name == "circle" && e.attr("fill") == Some(hex(color).as_str()))
            .collect()
    }

    /// Fault bands (translucent filled rectangles) of `color`.
    fn bands(elements: &[Element], color: RGBColor) -> Vec<&Element> {
        elements
            .iter()
            .filter(|e| {
                e.name == "rect"
                    && e.attr("fill") == Some(hex(color).as_str())
                    && e.attr("opacity") == Some(BAND_ALPHA.to_string().as_str())
            })
            .collect()
    }

    fn all_bands(elements: &[Element]) -> usize {
        FAULT_PALETTE.iter().map(|c| bands(elements, *c).len()).sum()
    }

    /// The outline of the plot area: (left, top, right, bottom).
    fn frame(elements: &[Element]) -> (f64, f64, f64, f64) {
        let outlines: Vec<&Element> = elements
            .iter()
            .filter(|e| {
                e.name == "rect" && e.attr("fill") == Some("none") && e.attr("stroke") == Some(hex(INK).as_str())
            })
            .collect();
        assert_eq!(outlines.len(), 1, "one frame");
        let f = outlines[0];
        (
            f.num("x"),
            f.num("y"),
            f.num("x") + f.num("width"),
            f.num("y") + f.num("height"),
        )
    }

    fn sample(done_s: f64, latency_ms: f64, outcome: Outcome) -> Sample {
        Sample {
            done_s,
            latency_ms,
            outcome,
        }
    }

    fn fault(name: &str, start_s: f64, end_s: f64) -> FaultInterval {
        FaultInterval {
            name: name.to_string(),
            start_s,
            end_s,
        }
    }

    fn color_of(faults: &[FaultInterval], name: &str) -> RGBColor {
        fault_colors(faults)
            .into_iter()
            .find(|(n, _)| *n == name)
            .expect("fault has a colour")
            .1
    }

    #[test]
    fn latency_svg_shows_samples_bands_title_and_legend() {
        let samples = [
            sample(1.0, 5.0, Outcome::Ok),
            sample(5.0, 10.0, Outcome::Ok),
            sample(6.0, 200.0, Outcome::Fail),
            sample(7.0, 1.5, Outcome::Info),
        ];
        let faults = [fault("partition", 2.0, 4.0), fault("kill", 8.0, 9.0)];
        let input = PlotInput {
            title: "bank latency",
            samples: &samples,
            faults: &faults,
            duration_s: 10.0,
        };
        let svg = render_latency(&input).expect("render");
        let el = parse_svg(&svg);
        assert_eq!(
            (el[0].num("width"), el[0].num("height")),
            (f64::from(WIDTH), f64::from(HEIGHT))
        );

        let texts = texts(&el);
        for expected in [
            "bank latency",
            "latency (ms)",
            "time (s)",
            "ok",
            "fail",
            "info",
            "faults:",
            "partition",
            "kill",
        ] {
            assert!(texts.iter().any(|t| t == expected), "{expected:?} in {texts:?}");
        }
        // The log axis spans 1..1000 ms: its decades are labelled.
        for label in ["1", "10", "100", "1000"] {
            assert!(texts.iter().any(|t| t == label), "tick {label} in {texts:?}");
        }

        // One dot per sample, in its outcome's colour, inside the frame.
        let (left, top, right, bottom) = frame(&el);
        assert_eq!(dots(&el, Outcome::Ok.color()).len(), 2);
        assert_eq!(dots(&el, Outcome::Fail.color()).len(), 1);
        assert_eq!(dots(&el, Outcome::Info.color()).len(), 1);
        // The dot of a sample: its colour's dot nearest its time.
        let dot_at = |s: &Sample| {
            let x = left + s.done_s / 10.0 * (right - left);
            let dist = |e: &Element| (e.num("cx") - x).abs();
            let d = dots(&el, s.outcome.color())
                .into_iter()
                .min_by(|a, b| dist(a).total_cmp(&dist(b)))
                .expect("a dot");
            (d.num("cx"), d.num("cy"))
        };
        let ok_1s = dot_at(&samples[0]);
        let ok_5s = dot_at(&samples[1]);
        let fail = dot_at(&samples[2]);
        let info = dot_at(&samples[3]);
        for (x, y) in [ok_1s, ok_5s, fail, info] {
            assert!(
                left < x && x < right && top < y && y < bottom,
                "({x}, {y}) inside the frame"
            );
        }
        assert!(
            ok_1s.0 < ok_5s.0 && ok_5s.0 < fail.0 && fail.0 < info.0,
            "later is further right"
        );
        // Log scale: 200 ms is highest; 5 ms → 10 ms rises as much as
        // 1.5 ms → 3 ms would, about a tenth of the 3 decades.
        assert!(fail.1 < ok_5s.1 && ok_5s.1 < ok_1s.1 && ok_1s.1 < info.1);
        let decade = (bottom - top) / 3.0;
        assert!(((ok_1s.1 - ok_5s.1) - decade * 2f64.log10()).abs() < 2.0);

        // Each fault is one band of its colour over the plot's full height,
        // at its time: the partition between the 1 s and 5 s dots, the kill
        // right of the info dot at 7 s.
        let partition = bands(&el, color_of(&faults, "partition"));
        let kill = bands(&el, color_of(&faults, "kill"));
        assert_eq!((partition.len(), kill.len(), all_bands(&el)), (1, 1, 2));
        for band in [partition[0], kill[0]] {
            assert_eq!((band.num("y"), band.num("y") + band.num("height")), (top, bottom));
        }
        let (p0, p1) = (partition[0].num("x"), partition[0].num("x") + partition[0].num("width"));
        assert!(
            ok_1s.0 < p0 && p1 < ok_5s.0 && p1 > p0,
            "partition band at 2..4 s: {p0}..{p1}"
        );
        assert!(info.0 < kill[0].num("x"));
        // Bands are drawn before the dots, so they do not hide them.
        let first_dot = el.iter().position(|e| e.name == "circle").expect("dots");
        assert!(
            el.iter()
                .rposition(|e| e.attr("opacity") == Some("0.22"))
                .expect("bands")
                < first_dot
        );
    }

    #[test]
    fn throughput_svg_shows_rate_lines_and_bands() {
        // 10 ok completions per second for 10 s, plus one failure at 4.5 s.
        let mut samples: Vec<Sample> = (0..100)
            .map(|i| sample(f64::from(i) * 0.1 + 0.05, 3.0, Outcome::Ok))
            .collect();
        samples.push(sample(4.5, 3.0, Outcome::Fail));
        let faults = [fault("clock-skew", 6.0, 8.0)];
        let input = PlotInput {
            title: "bank throughput",
            samples: &samples,
            faults: &faults,
            duration_s: 10.0,
        };
        let el = parse_svg(&render_throughput(&input).expect("render"));
        let labels = texts(&el);
        for expected in ["bank throughput", "throughput (ops/s)", "time (s)", "clock-skew", "12"] {
            assert!(labels.iter().any(|t| t == expected), "{expected:?} in {labels:?}");
        }
        let (left, top, right, bottom) = frame(&el);
        let y_of = |rate: f64| bottom - rate / 12.0 * (bottom - top);

        let line = |outcome: Outcome| {
            let lines: Vec<&Element> = el
                .iter()
                .filter(|e| e.name == "polyline" && e.attr("stroke") == Some(hex(outcome.color()).as_str()))
                .collect();
            assert!(lines.len() <= 1, "one line per outcome");
            lines.first().map(|l| l.points())
        };
        // The ok line is flat at 10 ops/s through the 10 bin centres.
        let ok = line(Outcome::Ok).expect("ok line");
        assert_eq!(ok.len(), 10);
        assert!(ok.iter().all(|(_, y)| (y - y_of(10.0)).abs() <= 1.0), "{ok:?}");
        assert!(ok.windows(2).all(|w| w[0].0 < w[1].0));
        assert!(left < ok[0].0 && ok[9].0 < right);
        // The fail line is 0 except for 1 op/s in the bin of 4.5 s.
        let fail = line(Outcome::Fail).expect("fail line");
        assert_eq!(fail.len(), 10);
        for (i, (_, y)) in fail.iter().enumerate() {
            let rate = if i == 4 { 1.0 } else { 0.0 };
            assert!((y - y_of(rate)).abs() <= 1.0, "bin {i}: {y}");
        }
        assert!(line(Outcome::Info).is_none(), "no info line without info ops");

        // The clock-skew band covers bins 6 and 7 (centres 6.5 s, 7.5 s).
        let band = bands(&el, color_of(&faults, "clock-skew"));
        assert_eq!((band.len(), all_bands(&el)), (1, 1));
        let (b0, b1) = (band[0].num("x"), band[0].num("x") + band[0].num("width"));
        assert!(
            b0 < ok[6].0 && ok[7].0 < b1 && ok[5].0 < b0 && b1 < ok[8].0,
            "{b0}..{b1}"
        );

        // A long run gets wider bins, and says so.
        let long = PlotInput {
            duration_s: 1000.0,
            ..input
        };
        let long_texts = texts(&parse_svg(&render_throughput(&long).expect("render")));
        assert!(
            long_texts.iter().any(|t| t == "throughput (ops/s, 4 s bins)"),
            "{long_texts:?}"
        );
    }

    #[test]
    fn no_faults_no_bands_or_fault_legend() {
        let samples = [sample(1.0, 5.0, Outcome::Ok), sample(2.0, 7.0, Outcome::Info)];
        let input = PlotInput {
            title: "calm",
            samples: &samples,
            faults: &[],
            duration_s: 3.0,
        };
        for svg in [render_latency(&input), render_throughput(&input)] {
            let el = parse_svg(&svg.expect("render"));
            assert_eq!(all_bands(&el), 0);
            assert!(!el.iter().any(|e| e.attr("opacity") == Some("0.22")));
            let texts = texts(&el);
            assert!(!texts.iter().any(|t| t == "faults:"));
            assert!(texts.iter().any(|t| t == "calm"));
            frame(&el);
        }
    }

    #[test]
    fn empty_input_draws_axes_and_faults() {
        let faults = [fault("partition", 2.0, 4.0)];
        let input = PlotInput {
            title: "nothing happened",
            samples: &[],
            faults: &faults,
            duration_s: 10.0,
        };
        for svg in [render_latency(&input), render_throughput(&input)] {
            let el = parse_svg(&svg.expect("render"));
            assert_eq!(bands(&el, color_of(&faults, "partition")).len(), 1);
            let data = |e: &Element| {
                let colors = Outcome::ALL.map(|o| Some(hex(o.color())));
                e.name == "circle" || (e.name == "polyline" && colors.contains(&e.attr("stroke").map(String::from)))
            };
            assert!(!el.iter().any(data), "no data drawn");
            let texts = texts(&el);
            assert!(texts.iter().any(|t| t == "nothing happened"));
            // x ticks 0..10 s.
            assert!(
                texts.iter().any(|t| t == "0") && texts.iter().any(|t| t == "10"),
                "{texts:?}"
            );
            frame(&el);
        }
    }

    #[test]
    fn nan_and_negative_values_do_not_panic() {
        let samples = [
            sample(f64::NAN, 5.0, Outcome::Ok),
            sample(1.0, f64::NAN, Outcome::Ok),
            sample(-3.0, 5.0, Outcome::Fail),
            sample(f64::INFINITY, 5.0, Outcome::Info),
            sample(2.0, f64::INFINITY, Outcome::Info),
            sample(3.0, f64::NEG_INFINITY, Outcome::Info),
            sample(4.0, -7.0, Outcome::Fail),
            sample(5.0, 0.0, Outcome::Ok),
            sample(6.0, 50.0, Outcome::Ok),
        ];
        let faults = [
            fault("nan", f64::NAN, 3.0),
            fault("backwards", 5.0, 2.0),
            fault("open-ended", 8.0, f64::INFINITY),
            fault("early", -5.0, -1.0),
        ];
        for duration_s in [f64::NAN, -1.0, 0.0, 10.0] {
            let input = PlotInput {
                title: "odd values",
                samples: &samples,
                faults: &faults,
                duration_s,
            };
            parse_svg(&render_latency(&input).expect("render latency"));
            parse_svg(&render_throughput(&input).expect("render throughput"));
        }

        // Latency ≤ 0 (and -inf) lands on the lowest decade, at the bottom
        // edge; NaN and +inf latencies and bad times are not drawn.
        let input = PlotInput {
            title: "",
            samples: &samples,
            faults: &faults,
            duration_s: 10.0,
        };
        assert_eq!(latency_decades(&input), (1, 2));
        let el = parse_svg(&render_latency(&input).expect("render"));
        let (_, _, right, bottom) = frame(&el);
        let info = dots(&el, Outcome::Info.color());
        let fail = dots(&el, Outcome::Fail.color());
        let ok = dots(&el, Outcome::Ok.color());
        assert_eq!((ok.len(), fail.len(), info.len()), (2, 1, 1));
        for d in [info[0], fail[0]] {
            assert_eq!(d.num("cy"), bottom);
        }
        assert_eq!(ok.iter().filter(|d| d.num("cy") == bottom).count(), 1);
        // Only the open-ended fault is on the axis; it runs to the right edge.
        let open = bands(&el, color_of(&faults, "open-ended"));
        assert_eq!((open.len(), all_bands(&el)), (1, 1));
        assert_eq!(open[0].num("x") + open[0].num("width"), right);
        // An empty title draws no text of its own.
        assert!(!texts(&el).iter().any(|t| t.is_empty()));
    }

    #[test]
    fn writes_svg_files_with_escaped_text() {
        let samples = [sample(0.5, 2.0, Outcome::Ok)];
        let faults = [fault("a<b>&\"c\"", 0.0, 1.0)];
        let input = PlotInput {
            title: "seed <1> & \"2\"",
            samples: &samples,
            faults: &faults,
            duration_s: 1.0,
        };
        let latency = temp_svg("latency");
        let throughput = temp_svg("throughput");
        latency_svg(&input, &latency).expect("write latency plot");
        throughput_svg(&input, &throughput).expect("write throughput plot");
        for path in [latency, throughput] {
            let svg = std::fs::read_to_string(&path).expect("read back");
            std::fs::remove_file(&path).expect("remove");
            assert!(svg.starts_with("<svg"));
            assert!(svg.contains("seed &lt;1&gt; &amp; &quot;2&quot;"));
            let el = parse_svg(&svg);
            let texts = texts(&el);
            assert!(texts.iter().any(|t| t == "seed <1> & \"2\""), "{texts:?}");
            assert!(texts.iter().any(|t| t == "a<b>&\"c\""), "{texts:?}");
            assert_eq!(all_bands(&el), 1);
        }
    }

    #[test]
    fn unwritable_path_is_an_io_error() {
        let input = PlotInput {
            title: "t",
            samples: &[],
            faults: &[],
            duration_s: 1.0,
        };
        let path = temp_svg("no-such-dir").join("plot.svg");
        match latency_svg(&input, &path) {
            Err(PlotError::Io { path: p, .. }) => assert_eq!(p, path),
            other => panic!("expected an I/O error, got {other:?}"),
        }
    }

    #[test]
    fn binning_counts_per_second_and_outcome() {
        let samples = [
            sample(0.1, 1.0, Outcome::Ok),
            sample(0.5, 1.0, Outcome::Ok),
            sample(0.9, 1.0, Outcome::Ok),
            sample(2.5, 1.0, Outcome::Ok),
            sample(1.2, 1.0, Outcome::Info),
            sample(3.0, 1.0, Outcome::Fail), // exactly at the end: last bin
            sample(f64::NAN, 1.0, Outcome::Ok),
            sample(-1.0, 1.0, Outcome::Ok),
        ];
        let bins = bin_samples(&samples, 3.0);
        assert_eq!(bins.width_s, 1.0);
        assert_eq!(bins.counts[Outcome::Ok.index()], vec![3, 0, 1]);
        assert_eq!(bins.counts[Outcome::Info.index()], vec![0, 1, 0]);
        assert_eq!(bins.counts[Outcome::Fail.index()], vec![0, 0, 1]);
        assert_eq!(bins.rate(Outcome::Ok, 0), 3.0);
    }

    #[test]
    fn long_runs_get_wider_bins() {
        let samples = [sample(0.5, 1.0, Outcome::Ok), sample(3.9, 1.0, Outcome::Ok)];
        let bins = bin_samples(&samples, 1000.0);
        assert_eq!(bins.width_s, 4.0);
        assert_eq!(bins.len(), 250);
        assert!(bins.len() <= MAX_BINS);
        assert_eq!(bins.counts[Outcome::Ok.index()][0], 2);
        assert_eq!(bins.rate(Outcome::Ok, 0), 0.5);

        let bins = bin_samples(&[], 300.0);
        assert_eq!((bins.width_s, bins.len()), (1.0, 300));
        let bins = bin_samples(&[], 301.0);
        assert_eq!((bins.width_s, bins.len()), (2.0, 151));
    }

    #[test]
    fn axis_ranges() {
        let input = |samples: &'static [Sample], duration_s: f64| PlotInput {
            title: "",
            samples,
            faults: &[],
            duration_s,
        };
        const SAMPLES: [Sample; 3] = [
            Sample {
                done_s: 1.0,
                latency_ms: 1.5,
                outcome: Outcome::Ok,
            },
            Sample {
                done_s: 12.0,
                latency_ms: 200.0,
                outcome: Outcome::Fail,
            },
            Sample {
                done_s: 2.0,
                latency_ms: 0.0,
                outcome: Outcome::Info,
            },
        ];
        // Decades around the positive latencies; 1 ms..1 s with none.
        assert_eq!(latency_decades(&input(&SAMPLES, 10.0)), (0, 3));
        assert_eq!(latency_decades(&input(&[], 10.0)), (0, 3));
        let tiny = [sample(1.0, 1e-9, Outcome::Ok), sample(1.0, 1e12, Outcome::Ok)];
        let tiny = PlotInput {
            samples: &tiny,
            ..input(&[], 1.0)
        };
        assert_eq!(latency_decades(&tiny), (-3, 7));
        // The x axis covers the run and every sample.
        assert_eq!(x_axis_max(&input(&SAMPLES, 10.0)), 12.0);
        assert_eq!(x_axis_max(&input(&SAMPLES, 30.0)), 30.0);
        assert_eq!(x_axis_max(&input(&[], f64::NAN)), 1.0);
        // The throughput axis: peak 10/s plus headroom rounds to 12.
        let ten_per_s: Vec<Sample> = (0..30).map(|i| sample(f64::from(i) * 0.1, 1.0, Outcome::Ok)).collect();
        assert_eq!(throughput_y_max(&bin_samples(&ten_per_s, 3.0)), 12.0);
        assert_eq!(throughput_y_max(&bin_samples(&[], 3.0)), 1.0);
        // Tick labels.
        assert_eq!(format_tick(&2.5), "2.5");
        assert_eq!(format_tick(&20.0), "20");
        assert_eq!(format_tick(&0.125), "0.125");
        assert_eq!(format_tick(&-0.0), "0");
        assert_eq!(format_ms(&1000.0), "1000");
        assert_eq!(format_ms(&0.01), "0.01");
        assert_eq!(format_ms(&0.002), "0.002");
    }

    #[test]
    fn fault_bands_are_clipped_to_the_axis() {
        let faults = [
            fault("a", -2.0, 3.0),
            fault("b", 8.0, f64::INFINITY),
            fault("c", 5.0, 5.0),
            fault("d", 11.0, 12.0),
            fault("e", 4.0, 3.0),
            fault("f", 1.0, f64::NAN),
            fault("g", 10.0, 10.0),
        ];
        let bands: Vec<(f64, f64)> = fault_bands(&faults, 10.0, 0.5)
            .into_iter()
            .map(|(s, e, _)| (s, e))
            .collect();
        assert_eq!(bands, vec![(0.0, 3.0), (8.0, 10.0), (5.0, 5.5), (9.5, 10.0)]);
        assert_eq!(fault_bands(&faults, 10.0, 0.5)[0].2, color_of(&faults, "a"));
    }

    #[test]
    fn helpers_and_fault_colours() {
        assert_eq!(nice_step(10.0, 10.0), 1.0);
        assert_eq!(nice_step(60.0, 10.0), 5.0);
        assert!((nice_step(0.2, 10.0) - 0.02).abs() < 1e-12);
        assert_eq!(nice_step(f64::NAN, 10.0), 1.0);
        assert_eq!(truncate("abcdef", 4), "ab..");
        assert_eq!(truncate("abc", 4), "abc");

        // The same name always gets the same colour; distinct names get
        // distinct colours while the palette lasts.
        let faults: Vec<FaultInterval> = (0..FAULT_PALETTE.len())
            .map(|i| fault(&format!("fault-{i}"), 0.0, 1.0))
            .chain([fault("fault-0", 2.0, 3.0)])
            .collect();
        let colors = fault_colors(&faults);
        assert_eq!(colors.len(), FAULT_PALETTE.len());
        assert!(FAULT_PALETTE.len() >= crate::nemesis::Fault::ALL.len());
        for (i, (_, a)) in colors.iter().enumerate() {
            assert!(colors[i + 1..].iter().all(|(_, b)| a != b));
        }
        assert_eq!(
            color_of(&[fault("x", 0.0, 1.0)], "x"),
            color_of(&[fault("x", 5.0, 6.0)], "x")
        );
    }
}
