//! Latency and throughput over time as PNG images, drawn the way Jepsen
//! draws them, with every fault interval shaded.
//!
//! - [`latency_png`]: a scatter of every completed client operation at
//!   (completion time in seconds since the run started, latency in ms) on a
//!   log-scale y axis, coloured by outcome (ok = blue, fail = red,
//!   info = orange).
//! - [`throughput_png`]: operations completed per second, binned (1-second
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
//! NaN or infinite latency leaves it out of the latency plot (it still counts
//! as a completion for throughput), and a latency ≤ 0 is drawn on the lowest
//! decade of the axis.
//!
//! Everything is drawn on a small RGB [`Canvas`] with an embedded bitmap
//! font (see [`font`]) and written with the `png` crate, so no system fonts
//! or plotting libraries are needed.

mod font;

use std::fs::File;
use std::io::BufWriter;
use std::io::Write;
use std::path::Path;
use std::path::PathBuf;

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

    fn color(self) -> Rgb {
        match self {
            Outcome::Ok => Rgb(0x1f, 0x77, 0xb4),
            Outcome::Fail => Rgb(0xd6, 0x27, 0x28),
            Outcome::Info => Rgb(0xff, 0x7f, 0x0e),
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
    /// Drawn as the title line at the top.
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
    #[error("cannot encode plot as PNG: {0}")]
    Encode(#[from] png::EncodingError),
}

/// Writes the latency-over-time scatter plot to `path` as a PNG.
pub fn latency_png(input: &PlotInput, path: &Path) -> Result<(), PlotError> {
    render_latency(input).write_png(path)
}

/// Writes the throughput-over-time plot to `path` as a PNG.
pub fn throughput_png(input: &PlotInput, path: &Path) -> Result<(), PlotError> {
    render_throughput(input).write_png(path)
}

// ---------------------------------------------------------------------------
// Layout
// ---------------------------------------------------------------------------

/// Image size in pixels.
const WIDTH: u32 = 1000;
const HEIGHT: u32 = 500;

/// The data area, inclusive pixel bounds. The frame is drawn one pixel
/// outside it; ticks and labels further out.
const PLOT_LEFT: i64 = 75;
const PLOT_RIGHT: i64 = 830;
const PLOT_TOP: i64 = 50;
const PLOT_BOTTOM: i64 = 450;

/// Where the title (scale 2) and the y-axis label (scale 1) start.
const TITLE_Y: i64 = 8;
const Y_LABEL_Y: i64 = 36;

/// Left edge of the legend.
const LEGEND_X: i64 = 846;
const LEGEND_ROW: i64 = 14;
const SWATCH: i64 = 10;

/// Tick length, outside the frame.
const TICK: i64 = 5;
const MINOR_TICK: i64 = 2;

/// Throughput: at most this many bins; longer runs get wider bins.
pub const MAX_BINS: usize = 300;

/// Opacity of fault bands.
const BAND_ALPHA: f64 = 0.22;

/// Radius of a latency dot.
const DOT_RADIUS: i64 = 2;

const BACKGROUND: Rgb = Rgb(0xff, 0xff, 0xff);
const INK: Rgb = Rgb(0x20, 0x20, 0x20);

/// Colours for fault bands; none is close to an outcome colour.
/// As many as there are nemeses (fourteen), so every fault of a run with
/// all of them has a colour of its own.
const FAULT_PALETTE: [Rgb; 14] = [
    Rgb(0x2c, 0xa0, 0x2c), // green
    Rgb(0x94, 0x67, 0xbd), // purple
    Rgb(0x8c, 0x56, 0x4b), // brown
    Rgb(0xe3, 0x77, 0xc2), // pink
    Rgb(0x7f, 0x7f, 0x7f), // grey
    Rgb(0xbc, 0xbd, 0x22), // olive
    Rgb(0x17, 0xbe, 0xcf), // cyan
    Rgb(0x00, 0x60, 0x60), // dark teal
    Rgb(0xe6, 0xc2, 0x00), // gold
    Rgb(0x1b, 0x2a, 0x7a), // navy
    Rgb(0xb0, 0x00, 0xb0), // magenta
    Rgb(0x7f, 0xe0, 0x00), // lime
    Rgb(0xd2, 0xb4, 0x8c), // sand
    Rgb(0x1e, 0x5a, 0x1e), // forest
];

// ---------------------------------------------------------------------------
// Canvas
// ---------------------------------------------------------------------------

/// An RGB colour.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Rgb(u8, u8, u8);

/// `over` drawn with opacity `alpha` (0..=1) on top of `under`.
fn blend(under: Rgb, over: Rgb, alpha: f64) -> Rgb {
    let a = alpha.clamp(0.0, 1.0);
    let mix = |u: u8, o: u8| (f64::from(u) * (1.0 - a) + f64::from(o) * a).round() as u8;
    Rgb(mix(under.0, over.0), mix(under.1, over.1), mix(under.2, over.2))
}

/// A small RGB raster. Coordinates are signed and everything is clipped, so
/// callers never need to check bounds.
struct Canvas {
    width: u32,
    height: u32,
    /// Row-major, 3 bytes per pixel.
    pixels: Vec<u8>,
}

impl Canvas {
    fn new(width: u32, height: u32, background: Rgb) -> Canvas {
        let mut pixels = Vec::with_capacity(width as usize * height as usize * 3);
        for _ in 0..width as usize * height as usize {
            pixels.extend_from_slice(&[background.0, background.1, background.2]);
        }
        Canvas { width, height, pixels }
    }

    /// Byte offset of pixel (x, y), or None if it is off the canvas.
    fn offset(&self, x: i64, y: i64) -> Option<usize> {
        if x < 0 || y < 0 || x >= i64::from(self.width) || y >= i64::from(self.height) {
            return None;
        }
        Some((y as usize * self.width as usize + x as usize) * 3)
    }

    /// The colour at (x, y); off-canvas reads as black.
    fn pixel(&self, x: i64, y: i64) -> Rgb {
        match self.offset(x, y) {
            Some(i) => Rgb(self.pixels[i], self.pixels[i + 1], self.pixels[i + 2]),
            None => Rgb(0, 0, 0),
        }
    }

    /// Sets one pixel (ignored off the canvas).
    fn point(&mut self, x: i64, y: i64, c: Rgb) {
        if let Some(i) = self.offset(x, y) {
            self.pixels[i..i + 3].copy_from_slice(&[c.0, c.1, c.2]);
        }
    }

    /// Clips the rectangle with corners (x0, y0) and (x1, y1), inclusive, in
    /// any order, to the canvas; None if nothing is left.
    fn clip(&self, x0: i64, y0: i64, x1: i64, y1: i64) -> Option<(i64, i64, i64, i64)> {
        let (xa, xb) = (x0.min(x1).max(0), x0.max(x1).min(i64::from(self.width) - 1));
        let (ya, yb) = (y0.min(y1).max(0), y0.max(y1).min(i64::from(self.height) - 1));
        (xa <= xb && ya <= yb).then_some((xa, ya, xb, yb))
    }

    /// Fills a rectangle (corners inclusive).
    fn fill_rect(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, c: Rgb) {
        if let Some((xa, ya, xb, yb)) = self.clip(x0, y0, x1, y1) {
            for y in ya..=yb {
                for x in xa..=xb {
                    self.point(x, y, c);
                }
            }
        }
    }

    /// Paints a rectangle (corners inclusive) translucently over what is
    /// there.
    fn blend_rect(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, c: Rgb, alpha: f64) {
        if let Some((xa, ya, xb, yb)) = self.clip(x0, y0, x1, y1) {
            for y in ya..=yb {
                for x in xa..=xb {
                    let under = self.pixel(x, y);
                    self.point(x, y, blend(under, c, alpha));
                }
            }
        }
    }

    /// Draws the outline of a rectangle (corners inclusive).
    fn rect_outline(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, c: Rgb) {
        self.line(x0, y0, x1, y0, c);
        self.line(x0, y1, x1, y1, c);
        self.line(x0, y0, x0, y1, c);
        self.line(x1, y0, x1, y1, c);
    }

    /// A one-pixel line from (x0, y0) to (x1, y1), both ends included
    /// (Bresenham's algorithm, all octants).
    fn line(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, c: Rgb) {
        self.stamp_line(x0, y0, x1, y1, |canvas, x, y| canvas.point(x, y, c));
    }

    /// A line `thickness` pixels wide: a square stamped at every point.
    fn thick_line(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, thickness: i64, c: Rgb) {
        let lo = -(thickness - 1) / 2;
        let hi = lo + thickness - 1;
        self.stamp_line(x0, y0, x1, y1, |canvas, x, y| {
            canvas.fill_rect(x + lo, y + lo, x + hi, y + hi, c)
        });
    }

    /// Bresenham's walk from (x0, y0) to (x1, y1), calling `plot` on every
    /// pixel.
    fn stamp_line(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, mut plot: impl FnMut(&mut Canvas, i64, i64)) {
        let dx = (x1 - x0).abs();
        let dy = -(y1 - y0).abs();
        let sx = if x0 < x1 { 1 } else { -1 };
        let sy = if y0 < y1 { 1 } else { -1 };
        let (mut x, mut y, mut err) = (x0, y0, dx + dy);
        // An 8-connected line has exactly max(|dx|, |dy|) + 1 pixels.
        for _ in 0..=dx.max(-dy) {
            plot(self, x, y);
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    /// A filled disc of radius `r` centred on (cx, cy).
    fn dot(&mut self, cx: i64, cy: i64, r: i64, c: Rgb) {
        for dy in -r..=r {
            for dx in -r..=r {
                // `+ r` rounds the disc a little so small dots look round.
                if dx * dx + dy * dy <= r * r + r {
                    self.point(cx + dx, cy + dy, c);
                }
            }
        }
    }

    /// Draws `text` with its top-left corner at (x, y), each font pixel
    /// `scale` × `scale` pixels. Returns the width drawn.
    fn text(&mut self, x: i64, y: i64, text: &str, c: Rgb, scale: i64) -> i64 {
        let mut left = x;
        for ch in text.chars() {
            for row in 0..font::GLYPH_H {
                for col in 0..font::GLYPH_W {
                    if font::is_set(ch, col, row) {
                        let px = left + col as i64 * scale;
                        let py = y + row as i64 * scale;
                        self.fill_rect(px, py, px + scale - 1, py + scale - 1, c);
                    }
                }
            }
            left += font::ADVANCE as i64 * scale;
        }
        left - x
    }

    /// Encodes the canvas as an 8-bit RGB PNG at `path`.
    fn write_png(&self, path: &Path) -> Result<(), PlotError> {
        let io_error = |source| PlotError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::create(path).map_err(io_error)?;
        let mut out = BufWriter::new(file);
        {
            let mut encoder = png::Encoder::new(&mut out, self.width, self.height);
            encoder.set_color(png::ColorType::Rgb);
            encoder.set_depth(png::BitDepth::Eight);
            let mut writer = encoder.write_header()?;
            writer.write_image_data(&self.pixels)?;
            writer.finish()?;
        }
        out.flush().map_err(io_error)
    }
}

/// Width in pixels of `text` drawn at `scale`.
fn text_width(text: &str, scale: i64) -> i64 {
    text.chars().count() as i64 * font::ADVANCE as i64 * scale
}

/// `text` cut to at most `max_chars` characters, ending in ".." if cut.
fn truncate(text: &str, max_chars: usize) -> String {
    if text.chars().count() <= max_chars {
        return text.to_string();
    }
    let kept: String = text.chars().take(max_chars.saturating_sub(2)).collect();
    format!("{kept}..")
}

// ---------------------------------------------------------------------------
// Coordinates
// ---------------------------------------------------------------------------

/// How data values map onto the vertical axis.
#[derive(Clone, Copy, Debug, PartialEq)]
enum YScale {
    /// 0..=max, linear.
    Linear { max: f64 },
    /// 10^lo..=10^hi, logarithmic (lo < hi).
    Log10 { lo: i32, hi: i32 },
}

/// The mapping from data coordinates to pixels of one plot.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Frame {
    /// The x axis spans 0..=x_max seconds.
    x_max: f64,
    y: YScale,
}

impl Frame {
    /// Pixel column of time `t` (clamped to the axis).
    fn x_px(&self, t: f64) -> i64 {
        let frac = (t / self.x_max).clamp(0.0, 1.0);
        PLOT_LEFT + (frac * (PLOT_RIGHT - PLOT_LEFT) as f64).round() as i64
    }

    /// Pixel row of value `v` (clamped to the axis; for a log axis, v ≤ 0
    /// lands on the lowest decade).
    fn y_px(&self, v: f64) -> i64 {
        let frac = match self.y {
            YScale::Linear { max } => v / max,
            YScale::Log10 { lo, hi } => {
                if v > 0.0 {
                    (v.log10() - f64::from(lo)) / f64::from(hi - lo)
                } else {
                    0.0
                }
            }
        };
        let frac = if frac.is_nan() { 0.0 } else { frac.clamp(0.0, 1.0) };
        PLOT_BOTTOM - (frac * (PLOT_BOTTOM - PLOT_TOP) as f64).round() as i64
    }
}

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

/// The frame of the latency plot: a log axis from the decade below the
/// smallest positive latency to the decade above the largest (1 ms..1 s if
/// there are none), kept within 1 µs..10^7 ms.
fn latency_frame(input: &PlotInput) -> Frame {
    const LOWEST: i32 = -3;
    const HIGHEST: i32 = 7;
    let positive = input
        .samples
        .iter()
        .filter(|s| valid_time(s.done_s) && s.latency_ms.is_finite() && s.latency_ms > 0.0)
        .map(|s| s.latency_ms);
    let (min, max) = positive.fold((f64::INFINITY, 0.0_f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let (lo, hi) = if max > 0.0 {
        let lo = (min.log10().floor() as i32).clamp(LOWEST, HIGHEST - 1);
        let hi = (max.log10().ceil() as i32).clamp(lo + 1, HIGHEST);
        (lo, hi)
    } else {
        (0, 3)
    };
    Frame {
        x_max: x_axis_max(input),
        y: YScale::Log10 { lo, hi },
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

/// Formats a tick value with as many decimals as `step` needs.
fn format_tick(value: f64, step: f64) -> String {
    let decimals = if step >= 1.0 {
        0
    } else {
        (-step.log10().floor()).max(0.0) as usize
    };
    format!("{value:.decimals$}")
}

/// Ticks 0, step, 2·step, … up to `max` (at most 100 of them).
fn linear_ticks(max: f64, step: f64) -> Vec<f64> {
    (0..=100)
        .map(|i| f64::from(i) * step)
        .take_while(|v| *v <= max * (1.0 + 1e-9))
        .collect()
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

/// The frame of the throughput plot: linear from 0 to a round number above
/// the highest rate plus a little headroom (at least 1).
fn throughput_frame(input: &PlotInput, bins: &Bins) -> Frame {
    let peak = Outcome::ALL
        .iter()
        .flat_map(|o| (0..bins.len()).map(move |i| bins.rate(*o, i)))
        .fold(0.0, f64::max);
    let max = if peak > 0.0 {
        // 5% headroom so a line at the peak does not run along the frame.
        let top = peak * 1.05;
        let step = nice_step(top, 5.0);
        ((top / step).ceil() * step).max(1.0)
    } else {
        1.0
    };
    Frame {
        x_max: x_axis_max(input),
        y: YScale::Linear { max },
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
fn fault_colors(faults: &[FaultInterval]) -> Vec<(&str, Rgb)> {
    let mut assigned: Vec<(&str, Rgb)> = Vec::new();
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

/// Shades every fault interval as a translucent band over the data area.
/// Intervals with a NaN end or that end before they start are skipped; an
/// infinite end runs to the end of the axis.
fn draw_fault_bands(canvas: &mut Canvas, frame: &Frame, faults: &[FaultInterval]) {
    let colors = fault_colors(faults);
    for fault in faults {
        if fault.start_s.is_nan() || fault.end_s.is_nan() || fault.end_s < fault.start_s {
            continue;
        }
        if fault.end_s < 0.0 || fault.start_s > frame.x_max {
            continue; // entirely off the axis
        }
        let color = colors
            .iter()
            .find(|(name, _)| *name == fault.name)
            .map_or(FAULT_PALETTE[0], |(_, c)| *c);
        let x0 = frame.x_px(fault.start_s);
        let x1 = frame.x_px(fault.end_s).max(x0); // at least one pixel wide
        canvas.blend_rect(x0, PLOT_TOP, x1, PLOT_BOTTOM, color, BAND_ALPHA);
    }
}

// ---------------------------------------------------------------------------
// Axes, title and legend
// ---------------------------------------------------------------------------

/// Draws the frame, ticks and tick labels of both axes, the axis labels,
/// the title and the legend.
fn draw_decorations(canvas: &mut Canvas, input: &PlotInput, frame: &Frame, y_label: &str, x_label: &str) {
    // Frame, one pixel outside the data area.
    canvas.rect_outline(PLOT_LEFT - 1, PLOT_TOP - 1, PLOT_RIGHT + 1, PLOT_BOTTOM + 1, INK);

    // X axis: time in seconds.
    let x_step = nice_step(frame.x_max, 10.0);
    for t in linear_ticks(frame.x_max, x_step) {
        let x = frame.x_px(t);
        canvas.line(x, PLOT_BOTTOM + 2, x, PLOT_BOTTOM + 1 + TICK, INK);
        let label = format_tick(t, x_step);
        let w = text_width(&label, 1);
        canvas.text(x - w / 2, PLOT_BOTTOM + TICK + 5, &label, INK, 1);
    }
    let w = text_width(x_label, 1);
    canvas.text(
        (PLOT_LEFT + PLOT_RIGHT) / 2 - w / 2,
        PLOT_BOTTOM + TICK + 20,
        x_label,
        INK,
        1,
    );

    // Y axis.
    let y_tick = |canvas: &mut Canvas, v: f64, label: &str| {
        let y = frame.y_px(v);
        canvas.line(PLOT_LEFT - 1 - TICK, y, PLOT_LEFT - 2, y, INK);
        let w = text_width(label, 1);
        canvas.text(PLOT_LEFT - TICK - 4 - w, y - 3, label, INK, 1);
    };
    match frame.y {
        YScale::Linear { max } => {
            let step = nice_step(max, 8.0);
            for v in linear_ticks(max, step) {
                y_tick(canvas, v, &format_tick(v, step));
            }
        }
        YScale::Log10 { lo, hi } => {
            for decade in lo..=hi {
                let value = 10f64.powi(decade);
                let label = if decade >= 0 {
                    format!("{value:.0}")
                } else {
                    format!("{value:.prec$}", prec = decade.unsigned_abs() as usize)
                };
                y_tick(canvas, value, &label);
                // Minor ticks at 2..9 × 10^decade.
                if decade < hi {
                    for m in 2..10 {
                        let y = frame.y_px(f64::from(m) * value);
                        canvas.line(PLOT_LEFT - 1 - MINOR_TICK, y, PLOT_LEFT - 2, y, INK);
                    }
                }
            }
        }
    }
    canvas.text(PLOT_LEFT - TICK - 4 - 30, Y_LABEL_Y, y_label, INK, 1);

    // Title.
    let max_chars = ((i64::from(canvas.width) - PLOT_LEFT) / (font::ADVANCE as i64 * 2)) as usize;
    canvas.text(PLOT_LEFT, TITLE_Y, &truncate(input.title, max_chars), INK, 2);

    draw_legend(canvas, input.faults);
}

/// The legend right of the plot: outcome colours, then fault names.
fn draw_legend(canvas: &mut Canvas, faults: &[FaultInterval]) {
    let max_chars = ((i64::from(canvas.width) - LEGEND_X - SWATCH - 8) / font::ADVANCE as i64) as usize;
    let mut y = PLOT_TOP;
    for outcome in Outcome::LEGEND {
        canvas.fill_rect(LEGEND_X, y, LEGEND_X + SWATCH - 1, y + SWATCH - 1, outcome.color());
        canvas.text(LEGEND_X + SWATCH + 4, y + 1, outcome.label(), INK, 1);
        y += LEGEND_ROW;
    }
    let colors = fault_colors(faults);
    if colors.is_empty() {
        return;
    }
    y += LEGEND_ROW / 2;
    canvas.text(LEGEND_X, y + 1, "faults:", INK, 1);
    y += LEGEND_ROW;
    for (name, color) in colors {
        if y + LEGEND_ROW > PLOT_BOTTOM {
            canvas.text(LEGEND_X, y + 1, "...", INK, 1);
            break;
        }
        // The swatch looks like a band: translucent fill, solid outline.
        canvas.blend_rect(
            LEGEND_X,
            y,
            LEGEND_X + SWATCH - 1,
            y + SWATCH - 1,
            color,
            BAND_ALPHA * 2.0,
        );
        canvas.rect_outline(LEGEND_X, y, LEGEND_X + SWATCH - 1, y + SWATCH - 1, color);
        canvas.text(LEGEND_X + SWATCH + 4, y + 1, &truncate(name, max_chars), INK, 1);
        y += LEGEND_ROW;
    }
}

// ---------------------------------------------------------------------------
// The two plots
// ---------------------------------------------------------------------------

/// Draws the latency scatter plot.
fn render_latency(input: &PlotInput) -> Canvas {
    let frame = latency_frame(input);
    let mut canvas = Canvas::new(WIDTH, HEIGHT, BACKGROUND);
    draw_fault_bands(&mut canvas, &frame, input.faults);
    for outcome in Outcome::ALL {
        let points = input.samples.iter().filter(|s| {
            s.outcome == outcome && valid_time(s.done_s) && !s.latency_ms.is_nan()
                // +inf has no place on the axis; -inf is ≤ 0 and clamps.
                && s.latency_ms != f64::INFINITY
        });
        for s in points {
            let (x, y) = (frame.x_px(s.done_s), frame.y_px(s.latency_ms));
            canvas.dot(x, y, DOT_RADIUS, outcome.color());
        }
    }
    draw_decorations(&mut canvas, input, &frame, "latency (ms)", "time (s)");
    canvas
}

/// Draws the throughput plot: one line per outcome through the bin centres.
fn render_throughput(input: &PlotInput) -> Canvas {
    let bins = bin_samples(input.samples, x_axis_max(input));
    let frame = throughput_frame(input, &bins);
    let mut canvas = Canvas::new(WIDTH, HEIGHT, BACKGROUND);
    draw_fault_bands(&mut canvas, &frame, input.faults);
    for outcome in Outcome::ALL {
        if bins.counts[outcome.index()].iter().all(|c| *c == 0) {
            continue; // no line for an outcome that never happened
        }
        let points: Vec<(i64, i64)> = (0..bins.len())
            .map(|i| {
                let centre = (i as f64 + 0.5) * bins.width_s;
                (frame.x_px(centre), frame.y_px(bins.rate(outcome, i)))
            })
            .collect();
        for pair in points.windows(2) {
            let ((x0, y0), (x1, y1)) = (pair[0], pair[1]);
            canvas.thick_line(x0, y0, x1, y1, 2, outcome.color());
        }
        if let [(x, y)] = points[..] {
            canvas.dot(x, y, DOT_RADIUS, outcome.color());
        }
    }
    let y_label = if bins.width_s > 1.0 {
        format!("throughput (ops/s, {} s bins)", bins.width_s)
    } else {
        "throughput (ops/s)".to_string()
    };
    draw_decorations(&mut canvas, input, &frame, &y_label, "time (s)");
    canvas
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::atomic::Ordering;

    /// A unique path in the system temp directory.
    fn temp_png(name: &str) -> PathBuf {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        std::env::temp_dir().join(format!("jepsen-plot-{}-{n}-{name}.png", std::process::id()))
    }

    /// A decoded PNG: width, height and RGB pixels.
    struct Decoded {
        width: u32,
        height: u32,
        rgb: Vec<u8>,
    }

    impl Decoded {
        fn pixel(&self, x: i64, y: i64) -> Rgb {
            let i = (y as usize * self.width as usize + x as usize) * 3;
            Rgb(self.rgb[i], self.rgb[i + 1], self.rgb[i + 2])
        }
    }

    /// Reads `path` back with the png decoder, then deletes it.
    fn decode(path: &Path) -> Decoded {
        let file = File::open(path).expect("open png");
        let mut reader = png::Decoder::new(file).read_info().expect("png header");
        let mut buf = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut buf).expect("png frame");
        assert_eq!(info.color_type, png::ColorType::Rgb);
        assert_eq!(info.bit_depth, png::BitDepth::Eight);
        buf.truncate(info.buffer_size());
        std::fs::remove_file(path).expect("remove png");
        Decoded {
            width: info.width,
            height: info.height,
            rgb: buf,
        }
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

    fn color_of(faults: &[FaultInterval], name: &str) -> Rgb {
        fault_colors(faults)
            .into_iter()
            .find(|(n, _)| *n == name)
            .expect("fault has a colour")
            .1
    }

    fn is_dark(c: Rgb) -> bool {
        u32::from(c.0) + u32::from(c.1) + u32::from(c.2) < 200
    }

    /// Dark pixels in the rows where the title is drawn.
    fn dark_pixels_in_title(img: &Decoded) -> usize {
        let rows = TITLE_Y..TITLE_Y + 2 * font::GLYPH_H as i64;
        rows.flat_map(|y| (0..i64::from(img.width)).map(move |x| (x, y)))
            .filter(|(x, y)| is_dark(img.pixel(*x, *y)))
            .count()
    }

    #[test]
    fn latency_plot_has_bands_and_coloured_samples() {
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
        let path = temp_png("latency");
        latency_png(&input, &path).expect("write latency plot");
        let img = decode(&path);
        assert_eq!((img.width, img.height), (WIDTH, HEIGHT));

        let frame = latency_frame(&input);
        assert_eq!(frame.y, YScale::Log10 { lo: 0, hi: 3 });
        let mid_y = (PLOT_TOP + PLOT_BOTTOM) / 2;

        // Inside the partition band: its tint; at the same height outside
        // any band: background.
        let tint = blend(BACKGROUND, color_of(&faults, "partition"), BAND_ALPHA);
        assert_ne!(tint, BACKGROUND);
        assert_eq!(img.pixel(frame.x_px(3.0), mid_y), tint);
        let kill_tint = blend(BACKGROUND, color_of(&faults, "kill"), BAND_ALPHA);
        assert_eq!(img.pixel(frame.x_px(8.5), mid_y), kill_tint);
        assert_eq!(img.pixel(frame.x_px(9.5), mid_y), BACKGROUND);
        assert_eq!(img.pixel(frame.x_px(1.5), mid_y), BACKGROUND);

        // Every sample's position has its outcome colour.
        for s in &samples {
            let (x, y) = (frame.x_px(s.done_s), frame.y_px(s.latency_ms));
            assert_eq!(img.pixel(x, y), s.outcome.color(), "sample {s:?}");
        }

        assert!(dark_pixels_in_title(&img) > 20, "title is drawn");
    }

    #[test]
    fn throughput_plot_has_bands_and_lines() {
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
        let path = temp_png("throughput");
        throughput_png(&input, &path).expect("write throughput plot");
        let img = decode(&path);
        assert_eq!((img.width, img.height), (WIDTH, HEIGHT));

        let bins = bin_samples(&samples, x_axis_max(&input));
        assert_eq!(bins.counts[Outcome::Ok.index()], vec![10; 10]);
        let frame = throughput_frame(&input, &bins);
        assert_eq!(frame.y, YScale::Linear { max: 12.0 });

        // The ok line is flat at 10 ops/s (below the top, 12). Away from
        // the line, the band is tinted and the rest is background.
        let ok_y = frame.y_px(10.0);
        assert_eq!(img.pixel(frame.x_px(2.0), ok_y), Outcome::Ok.color());
        let y = frame.y_px(5.0);
        let tint = blend(BACKGROUND, color_of(&faults, "clock-skew"), BAND_ALPHA);
        assert_eq!(img.pixel(frame.x_px(7.0), y), tint);
        assert_eq!(img.pixel(frame.x_px(9.0), y), BACKGROUND);

        // The fail line peaks at 1 op/s in the bin centred on 4.5 s.
        let peak = (frame.x_px(4.5), frame.y_px(1.0));
        assert_eq!(img.pixel(peak.0, peak.1), Outcome::Fail.color());

        assert!(dark_pixels_in_title(&img) > 20, "title is drawn");
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
    fn empty_input_draws_axes_and_faults() {
        let faults = [fault("partition", 2.0, 4.0)];
        let input = PlotInput {
            title: "nothing happened",
            samples: &[],
            faults: &faults,
            duration_s: 10.0,
        };
        let tint = blend(BACKGROUND, color_of(&faults, "partition"), BAND_ALPHA);
        let mid_y = (PLOT_TOP + PLOT_BOTTOM) / 2;

        let path = temp_png("empty-latency");
        latency_png(&input, &path).expect("write latency plot");
        let img = decode(&path);
        let frame = latency_frame(&input);
        assert_eq!(img.pixel(frame.x_px(3.0), mid_y), tint);
        // The frame's left edge is drawn.
        assert!(is_dark(img.pixel(PLOT_LEFT - 1, mid_y)));

        let path = temp_png("empty-throughput");
        throughput_png(&input, &path).expect("write throughput plot");
        let img = decode(&path);
        let frame = throughput_frame(&input, &bin_samples(&[], 10.0));
        assert_eq!(img.pixel(frame.x_px(3.0), mid_y), tint);
        assert!(is_dark(img.pixel(PLOT_LEFT - 1, mid_y)));
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
            let path = temp_png("nan-latency");
            latency_png(&input, &path).expect("write latency plot");
            let img = decode(&path);
            assert_eq!((img.width, img.height), (WIDTH, HEIGHT));
            let path = temp_png("nan-throughput");
            throughput_png(&input, &path).expect("write throughput plot");
            decode(&path);
        }

        // Latency ≤ 0 lands on the lowest decade, at the bottom edge.
        let input = PlotInput {
            title: "",
            samples: &samples,
            faults: &faults,
            duration_s: 10.0,
        };
        let frame = latency_frame(&input);
        assert_eq!(frame.y, YScale::Log10 { lo: 1, hi: 2 });
        assert_eq!(frame.y_px(0.0), PLOT_BOTTOM);
        assert_eq!(frame.y_px(-7.0), PLOT_BOTTOM);
        let path = temp_png("clamp");
        latency_png(&input, &path).expect("write latency plot");
        let img = decode(&path);
        assert_eq!(img.pixel(frame.x_px(5.0), PLOT_BOTTOM), Outcome::Ok.color());
        assert_eq!(img.pixel(frame.x_px(4.0), PLOT_BOTTOM), Outcome::Fail.color());
        // The open-ended fault runs to the right edge.
        let tint = blend(BACKGROUND, color_of(&faults, "open-ended"), BAND_ALPHA);
        assert_eq!(img.pixel(PLOT_RIGHT, PLOT_TOP + 100), tint);
        // An empty title draws nothing in the title rows.
        assert_eq!(dark_pixels_in_title(&img), 0);
    }

    #[test]
    fn unwritable_path_is_an_io_error() {
        let input = PlotInput {
            title: "t",
            samples: &[],
            faults: &[],
            duration_s: 1.0,
        };
        let path = temp_png("no-such-dir").join("plot.png");
        match latency_png(&input, &path) {
            Err(PlotError::Io { path: p, .. }) => assert_eq!(p, path),
            other => panic!("expected an I/O error, got {other:?}"),
        }
    }

    #[test]
    fn canvas_primitives() {
        let mut c = Canvas::new(20, 10, BACKGROUND);
        let red = Rgb(255, 0, 0);

        // Lines include both ends, in every direction, and clip silently.
        c.line(2, 1, 12, 5, red);
        assert_eq!(c.pixel(2, 1), red);
        assert_eq!(c.pixel(12, 5), red);
        c.line(15, 9, 15, 0, red);
        assert!((0..10).all(|y| c.pixel(15, y) == red));
        c.line(-100, -100, 100, 100, red);
        assert_eq!(c.pixel(3, 3), red);

        // fill_rect takes corners in any order and clips.
        c.fill_rect(19, 9, 17, 7, red);
        assert_eq!(c.pixel(18, 8), red);
        c.fill_rect(-5, -5, 0, 0, red);
        assert_eq!(c.pixel(0, 0), red);

        // blend_rect mixes with what is there.
        let mut c = Canvas::new(4, 4, BACKGROUND);
        c.blend_rect(0, 0, 3, 3, Rgb(0, 0, 0), 0.5);
        assert_eq!(c.pixel(1, 1), Rgb(128, 128, 128));
        assert_eq!(blend(Rgb(0, 0, 0), Rgb(200, 100, 0), 1.0), Rgb(200, 100, 0));

        // A dot covers its centre and its radius along the axes.
        let mut c = Canvas::new(10, 10, BACKGROUND);
        c.dot(5, 5, 2, red);
        assert_eq!(c.pixel(5, 5), red);
        assert_eq!(c.pixel(7, 5), red);
        assert_eq!(c.pixel(5, 3), red);
        assert_eq!(c.pixel(8, 5), BACKGROUND);
    }

    #[test]
    fn text_draws_glyph_pixels() {
        let mut c = Canvas::new(40, 20, BACKGROUND);
        let w = c.text(1, 1, "1-", INK, 1);
        assert_eq!(w, 2 * font::ADVANCE as i64);
        assert_eq!(w, text_width("1-", 1));
        // '1' has its top pixel in the middle column; '-' is a bar on row 3.
        assert_eq!(c.pixel(1 + 2, 1), INK);
        assert!((0..5).all(|col| c.pixel(1 + 6 + col, 1 + 3) == INK));
        assert_eq!(c.pixel(1 + 6, 1), BACKGROUND);
        // At scale 2 each font pixel is 2×2.
        let mut c = Canvas::new(40, 20, BACKGROUND);
        c.text(0, 0, "-", INK, 2);
        assert_eq!(c.pixel(9, 7), INK);
        assert_eq!(c.pixel(9, 8), BACKGROUND);
    }

    #[test]
    fn ticks_and_helpers() {
        assert_eq!(nice_step(10.0, 10.0), 1.0);
        assert_eq!(nice_step(60.0, 10.0), 5.0);
        assert!((nice_step(0.2, 10.0) - 0.02).abs() < 1e-12);
        assert_eq!(nice_step(f64::NAN, 10.0), 1.0);
        assert_eq!(format_tick(2.5, 0.5), "2.5");
        assert_eq!(format_tick(20.0, 5.0), "20");
        assert_eq!(linear_ticks(10.0, 2.5), vec![0.0, 2.5, 5.0, 7.5, 10.0]);
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
