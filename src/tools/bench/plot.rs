//! The `--plot` chart: horizontal bars (median) with min–max whiskers of events/s
//! per mode, and below them latency against rate for the steady points: p50 and p99
//! lines per relay over the rate the writers achieved (a log scale, since the tail
//! spans milliseconds to seconds), failed points as red crosses along the top at
//! the rate asked for. SVG only: the `plotters` SVG backend needs no font or image
//! libraries.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::error::{BenchError, PlotError};
use super::report::Report;
use super::steady_report::SteadyResult;

const WIDTH: u32 = 1100;
const ROW_HEIGHT: u32 = 34;
const CHART_EXTRA: u32 = 110;
const LATENCY_HEIGHT: u32 = 460;

impl Report {
    /// Writes an SVG chart: events/s per mode (median bar, min–max whisker), and the
    /// steady-rate latencies (p50 and p99) when measured.
    pub fn plot(&self, path: &Path) -> Result<(), BenchError> {
        draw(self, path).map_err(|source| BenchError::Output {
            path: path.display().to_string(),
            source,
        })
    }
}

/// Draws the report's chart into `path`.
fn draw(report: &Report, path: &Path) -> Result<(), PlotError> {
    let throughput_height = CHART_EXTRA + ROW_HEIGHT * count_u32(report.results.len());
    let latency_height = if report.steady.is_empty() {
        0
    } else {
        LATENCY_HEIGHT
    };
    let root =
        SVGBackend::new(path, (WIDTH, throughput_height + latency_height)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(throughput_height);
    let rows: Vec<Row> = report
        .results
        .iter()
        .map(|r| Row {
            label: r.mode.clone(),
            bar: r.events_per_s.median,
            inner: None,
            whisker: Some((r.events_per_s.min, r.events_per_s.max)),
        })
        .collect();
    let caption = format!(
        "Backlog drain, {} events (median, min–max of {} runs)",
        report.workload.events, report.workload.repeat
    );
    bars(&top, &caption, "events/s", &rows)?;
    if !report.steady.is_empty() {
        latency_lines(&bottom, &report.steady)?;
    }
    root.present()
}

struct Row {
    label: String,
    bar: f64,
    inner: Option<f64>,
    whisker: Option<(f64, f64)>,
}

fn count_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX / ROW_HEIGHT)
}

fn bars(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    caption: &str,
    unit: &str,
    rows: &[Row],
) -> Result<(), PlotError> {
    let top = rows
        .iter()
        .map(|r| r.whisker.map_or(r.bar, |(_, max)| max.max(r.bar)))
        .fold(0.0_f64, f64::max)
        .max(1.0)
        * 1.1;
    let n = rows.len();
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(200)
        .build_cartesian_2d(0.0..top, (0..n).into_segmented())?;
    let labels: Vec<String> = rows.iter().map(|r| r.label.clone()).collect();
    let label_of = move |v: &SegmentValue<usize>| match v {
        SegmentValue::CenterOf(i) => labels.get(*i).cloned().unwrap_or_default(),
        _ => String::new(),
    };
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(n)
        .y_label_formatter(&label_of)
        .x_label_formatter(&|v| format!("{v:.0}"))
        .x_desc(unit)
        .draw()?;
    let light = RGBColor(158, 202, 225);
    let dark = RGBColor(49, 130, 189);
    chart.draw_series(rows.iter().enumerate().map(|(i, r)| {
        let color = if r.inner.is_some() { light } else { dark };
        let mut bar = Rectangle::new(
            [
                (0.0, SegmentValue::Exact(i)),
                (r.bar, SegmentValue::Exact(i + 1)),
            ],
            color.filled(),
        );
        bar.set_margin(6, 6, 0, 0);
        bar
    }))?;
    chart.draw_series(rows.iter().enumerate().filter_map(|(i, r)| {
        let inner = r.inner?;
        let mut bar = Rectangle::new(
            [
                (0.0, SegmentValue::Exact(i)),
                (inner, SegmentValue::Exact(i + 1)),
            ],
            dark.filled(),
        );
        bar.set_margin(12, 12, 0, 0);
        Some(bar)
    }))?;
    chart.draw_series(rows.iter().enumerate().filter_map(|(i, r)| {
        let (min, max) = r.whisker?;
        Some(PathElement::new(
            vec![
                (min, SegmentValue::CenterOf(i)),
                (max, SegmentValue::CenterOf(i)),
            ],
            BLACK.stroke_width(2),
        ))
    }))?;
    Ok(())
}

/// Latency (log scale) against achieved rate: p50 and p99 per mode, failed points
/// as crosses at the top.
fn latency_lines(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    steady: &[SteadyResult],
) -> Result<(), PlotError> {
    let rate_of = |s: &SteadyResult| {
        s.achieved_events_per_s
            .map(|a| a.median)
            .or(s.target_events_per_s)
    };
    let max_rate = steady.iter().filter_map(rate_of).fold(1.0_f64, f64::max) * 1.05;
    let latencies = || steady.iter().filter_map(|s| s.latency);
    let top = latencies().map(|l| l.p99.median).fold(10.0_f64, f64::max) * 2.0;
    let bottom = latencies()
        .map(|l| l.p50.median)
        .fold(top, f64::min)
        .clamp(0.1, 1.0);
    let mut chart = ChartBuilder::on(area)
        .caption(
            "Steady rate: latency created_at → consumer against the rate achieved (p50 solid, p99 dashed)",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..max_rate, (bottom..top).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("events/s achieved")
        .y_desc("ms")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{v}"))
        .draw()?;
    let mut modes: Vec<&str> = Vec::new();
    for s in steady {
        if !modes.contains(&s.mode.as_str()) {
            modes.push(&s.mode);
        }
    }
    for (i, mode) in modes.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let mut points: Vec<(f64, f64, f64)> = steady
            .iter()
            .filter(|s| s.mode == *mode)
            .filter_map(|s| Some((rate_of(s)?, s.latency?)))
            .map(|(r, l)| (r, l.p50.median, l.p99.median))
            .collect();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(LineSeries::new(
                points.iter().map(|&(r, p50, _)| (r, p50)),
                color.stroke_width(2),
            ))?
            .label(format!("{mode} p50"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart
            .draw_series(DashedLineSeries::new(
                points.iter().map(|&(r, _, p99)| (r, p99)),
                6,
                4,
                color.stroke_width(2),
            ))?
            .label(format!("{mode} p99"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(1))
            });
        chart.draw_series(points.iter().flat_map(|&(r, p50, p99)| {
            [
                Circle::new((r, p50), 3, color.filled()),
                Circle::new((r, p99), 3, color.filled()),
            ]
        }))?;
    }
    chart
        .draw_series(
            steady
                .iter()
                .filter(|s| !s.failures.is_empty())
                .filter_map(|s| s.target_events_per_s.or_else(|| rate_of(s)))
                .map(|r| Cross::new((r.min(max_rate), top / 1.2), 6, RED.stroke_width(2))),
        )?
        .label("failed point (rate asked for)")
        .legend(|(x, y)| Cross::new((x + 10, y), 5, RED.stroke_width(2)));
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()?;
    Ok(())
}
