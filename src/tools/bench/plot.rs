//! The `--plot` chart: horizontal bars (median) with min–max whiskers of events/s
//! per mode, and below them the steady-rate latencies (p99 bar, p50 bar inside it).
//! SVG only: the `plotters` SVG backend needs no font or image libraries.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::error::{BenchError, PlotError};
use super::report::Report;

const WIDTH: u32 = 1100;
const ROW_HEIGHT: u32 = 34;
const CHART_EXTRA: u32 = 110;

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
        CHART_EXTRA + ROW_HEIGHT * count_u32(report.steady.len())
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
        let rows: Vec<Row> = report
            .steady
            .iter()
            .map(|s| Row {
                label: format!("{} @ {:.0}%", s.mode, s.fraction * 100.0),
                bar: s.latency.p99.median,
                inner: Some(s.latency.p50.median),
                whisker: None,
            })
            .collect();
        bars(
            &bottom,
            "Steady rate: latency created_at → consumer (p99 bar, p50 inside)",
            "ms",
            &rows,
        )?;
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
