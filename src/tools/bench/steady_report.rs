//! How the steady points are shown: one row per (rate, mode) with the rate asked
//! for, the rate achieved and the end-to-end latency, failed points with their
//! reason; then, for the CDC relay, where the time went (p50 / p99 per stage, from
//! the relay's own histograms); and the same as JSON.

use std::fmt::Write as _;

use serde_json::{Value, json};

use super::args::Rate;
use super::drain::{CDC_EXACTLY_ONCE, CDC_MESSAGE};
use super::scrape::COMMIT_TO_ACK;
use super::stats::{LatencySpread, Spread, spread};
use crate::cdc::metrics as m;

/// Columns of the stage table: the relay's stages, then the end-to-end figure.
const STAGE_COLUMNS: [(&str, &str); 5] = [
    (m::STAGE_COMMIT_TO_RECEIVED, "commit→received"),
    (m::STAGE_RECEIVED_TO_PRODUCED, "received→produced"),
    (m::STAGE_PRODUCED_TO_ACKED, "produced→acked"),
    (m::STAGE_ACKED_TO_CONFIRMED, "acked→confirmed"),
    (COMMIT_TO_ACK, "commit→ack"),
];

/// Width of the mode column: the longest label (`pg-ceiling-recvlogical`).
const MODE_WIDTH: usize = 22;

/// The steady tables; `workload` describes the points (duration, rows/tx, writers).
pub(crate) fn render_steady(workload: &str, steady: &[SteadyResult]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nsteady rate, {workload}; latency from created_at to consumer (ms), drift = p50 of the last quarter against the first:\n{:<MODE_WIDTH$} {:>6} {:>10} {:>18} {:>18} {:>18} {:>18} {:>18} {:>8}",
        "mode", "rate", "target/s", "achieved/s", "p50", "p95", "p99", "max", "drift"
    );
    for s in steady {
        let _ = writeln!(out, "{}", steady_row(s));
        for failure in &s.failures {
            let _ = writeln!(out, "{:<MODE_WIDTH$} FAILED: {failure}", "");
        }
    }
    if steady
        .iter()
        .any(|s| s.cpu.db.is_some() || s.cpu.relay.is_some())
    {
        let _ = writeln!(
            out,
            "\nCPU per event written (µs; PostgreSQL = all its processes, walsender included; bench = writers' client side and consumer):\n{:<MODE_WIDTH$} {:>6} {:>10} {:>18} {:>18} {:>18} {:>18} {:>18}",
            "mode", "rate", "achieved/s", "PostgreSQL", "walsender", "relay", "broker", "bench"
        );
        for s in steady {
            let [db, walsender, relay, broker, bench] = s.cpu.cells();
            let _ = writeln!(
                out,
                "{:<MODE_WIDTH$} {:>6} {:>10} {db:>18} {walsender:>18} {relay:>18} {broker:>18} {bench:>18}",
                s.mode,
                rate_text(s),
                s.achieved_events_per_s
                    .map_or("-".into(), |a| format!("{:.0}", a.median)),
            );
        }
    }
    if steady.iter().any(|s| s.cpu.standby.is_some()) {
        let _ = writeln!(
            out,
            "
the standby (--standby-url): CPU per event written (µs, all its processes: replay, WAL receiver, and the walsender of cdc-standby) and the highest replay lag sampled (ms):\n{:<MODE_WIDTH$} {:>6} {:>10} {:>18} {:>18}",
            "mode", "rate", "achieved/s", "standby CPU", "replay lag max"
        );
        for s in steady {
            let cell = |v: Option<Spread>| v.map_or("-".into(), |v| spread(&v, 1));
            let _ = writeln!(
                out,
                "{:<MODE_WIDTH$} {:>6} {:>10} {:>18} {:>18}",
                s.mode,
                rate_text(s),
                s.achieved_events_per_s
                    .map_or("-".into(), |a| format!("{:.0}", a.median)),
                cell(s.cpu.standby),
                cell(s.cpu.replay_lag_ms),
            );
        }
    }
    if steady.iter().any(|s| s.cpu.has_traffic()) {
        let _ = writeln!(
            out,
            "\nper event: produce requests (per record sent, from the relay's librdkafka statistics) and wake-ups (voluntary context switches of the relay's threads, of the walsender):\n{:<MODE_WIDTH$} {:>6} {:>10} {:>18} {:>18} {:>18}",
            "mode",
            "rate",
            "achieved/s",
            "produce requests",
            "relay wake-ups",
            "walsender wake-ups"
        );
        for s in steady.iter().filter(|s| s.cpu.has_traffic()) {
            let [requests, relay, walsender] = s.cpu.traffic_cells();
            let _ = writeln!(
                out,
                "{:<MODE_WIDTH$} {:>6} {:>10} {requests:>18} {relay:>18} {walsender:>18}",
                s.mode,
                rate_text(s),
                s.achieved_events_per_s
                    .map_or("-".into(), |a| format!("{:.0}", a.median)),
            );
        }
    }
    for mode in ["cdc", CDC_EXACTLY_ONCE, CDC_MESSAGE] {
        let rows: Vec<&SteadyResult> = steady
            .iter()
            .filter(|s| s.mode == mode && !s.stages.is_empty())
            .collect();
        if rows.is_empty() {
            continue;
        }
        let _ = write!(
            out,
            "\nwhere the time goes ({mode}; the relay's histograms, ms, p50 / p99; drift = each stage's p50 over the last quarter against the first):\n{:>6} {:>10}",
            "rate", "achieved/s"
        );
        for (_, title) in STAGE_COLUMNS {
            let _ = write!(out, " {title:>18}");
        }
        let _ = writeln!(out);
        for s in rows {
            let _ = write!(out, "{}", stage_row(s));
        }
    }
    out
}

/// One steady-rate point: a mode at a requested rate, over `--repeat` runs.
#[derive(Debug, Clone, PartialEq)]
pub struct SteadyResult {
    pub mode: String,
    /// The rate asked for (`--rates`).
    pub rate: Rate,
    /// Events/s scheduled (`None` when `max` could not be measured).
    pub target_events_per_s: Option<f64>,
    pub runs: usize,
    /// What the writers reached, over the runs that wrote.
    pub achieved_events_per_s: Option<Spread>,
    /// Over the runs that were measured; `None` when every run failed.
    pub latency: Option<LatencySpread>,
    /// The relay's per-stage p50/p99 (CDC), in its order, then commit → ack.
    pub stages: Vec<StageSpread>,
    /// Latency drift within a run: last quarter's p50 against the first's, in %
    /// (over the measured runs).
    pub drift_pct: Option<Spread>,
    /// Why runs of this point failed (empty when none did).
    pub failures: Vec<String>,
    /// CPU per event by process, over the measured runs.
    pub cpu: PerEventSpread,
}

/// Microseconds of CPU per event written, by process, in one run of a point.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct PerEvent {
    /// Every PostgreSQL process (backends, walsenders, background workers).
    pub db: Option<f64>,
    /// Every process of the standby's server (`--standby-url`): its startup
    /// (replay), WAL receiver and, for `cdc-standby`, the relay's walsender.
    pub standby: Option<f64>,
    /// Not per event: the highest replay lag of the standby sampled during the run,
    /// ms (`pg_stat_replication.replay_lag` on the primary).
    pub replay_lag_ms: Option<f64>,
    /// Of `db`: the walsenders of the run's slot.
    pub walsender: Option<f64>,
    /// The relay or poller process.
    pub relay: Option<f64>,
    /// The broker process (found by its port on this machine).
    pub broker: Option<f64>,
    /// The bench itself: the writers' client side and the consumer.
    pub bench: Option<f64>,
    /// Produce requests per record the relay or poller transmitted (its
    /// librdkafka statistics, read from its `/metrics`).
    pub produce_requests: Option<f64>,
    /// Times the relay's or poller's threads slept and woke up, per event.
    pub relay_wakeups: Option<f64>,
    /// The same for the run's walsenders.
    pub walsender_wakeups: Option<f64>,
}

/// [`PerEvent`] over the runs of a point.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PerEventSpread {
    pub db: Option<Spread>,
    pub standby: Option<Spread>,
    pub replay_lag_ms: Option<Spread>,
    pub walsender: Option<Spread>,
    pub relay: Option<Spread>,
    pub broker: Option<Spread>,
    pub bench: Option<Spread>,
    pub produce_requests: Option<Spread>,
    pub relay_wakeups: Option<Spread>,
    pub walsender_wakeups: Option<Spread>,
}

impl PerEventSpread {
    pub(crate) fn of(runs: &[PerEvent]) -> PerEventSpread {
        let of = |f: fn(&PerEvent) -> Option<f64>| {
            Spread::of(&runs.iter().filter_map(f).collect::<Vec<_>>())
        };
        PerEventSpread {
            db: of(|c| c.db),
            standby: of(|c| c.standby),
            replay_lag_ms: of(|c| c.replay_lag_ms),
            walsender: of(|c| c.walsender),
            relay: of(|c| c.relay),
            broker: of(|c| c.broker),
            bench: of(|c| c.bench),
            produce_requests: of(|c| c.produce_requests),
            relay_wakeups: of(|c| c.relay_wakeups),
            walsender_wakeups: of(|c| c.walsender_wakeups),
        }
    }

    fn cells(&self) -> [String; 5] {
        [self.db, self.walsender, self.relay, self.broker, self.bench]
            .map(|s| s.map_or("-".into(), |s| spread(&s, 1)))
    }

    fn traffic_cells(&self) -> [String; 3] {
        [
            self.produce_requests,
            self.relay_wakeups,
            self.walsender_wakeups,
        ]
        .map(|s| s.map_or("-".into(), |s| spread(&s, 2)))
    }

    fn has_traffic(&self) -> bool {
        self.produce_requests.is_some() || self.relay_wakeups.is_some()
    }
}

impl SteadyResult {
    /// The p50/p99 of `stage`, if measured.
    #[must_use]
    pub fn stage(&self, stage: &str) -> Option<&StageSpread> {
        self.stages.iter().find(|s| s.stage == stage)
    }

    /// The relay's commit → ack drift (CDC; from its histograms).
    #[must_use]
    pub fn ack_drift_pct(&self) -> Option<Spread> {
        self.stage(COMMIT_TO_ACK).and_then(|s| s.drift_pct)
    }
}

/// p50 and p99 of one stage over repeated runs, in milliseconds, and the drift of
/// its p50 within a run (last quarter against the first, in %).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageSpread {
    pub stage: &'static str,
    pub p50: Spread,
    pub p99: Spread,
    pub drift_pct: Option<Spread>,
}

fn rate_text(s: &SteadyResult) -> String {
    s.rate.to_string()
}

fn steady_row(s: &SteadyResult) -> String {
    let target = s
        .target_events_per_s
        .map_or("-".into(), |t| format!("{t:.0}"));
    let achieved = s
        .achieved_events_per_s
        .map_or("-".into(), |a| spread(&a, 0));
    let latency = s.latency.map_or_else(
        || vec!["-".to_owned(); 4],
        |l| {
            [l.p50, l.p95, l.p99, l.max]
                .iter()
                .map(|p| spread(p, 1))
                .collect()
        },
    );
    let drift = drift_cell(s.drift_pct);
    format!(
        "{:<MODE_WIDTH$} {:>6} {:>10} {:>18} {:>18} {:>18} {:>18} {:>18} {:>8}",
        s.mode,
        rate_text(s),
        target,
        achieved,
        latency[0],
        latency[1],
        latency[2],
        latency[3],
        drift,
    )
}

fn stage_row(s: &SteadyResult) -> String {
    let mut row = format!(
        "{:>6} {:>10}",
        rate_text(s),
        s.achieved_events_per_s
            .map_or("-".into(), |a| format!("{:.0}", a.median))
    );
    for (stage, _) in STAGE_COLUMNS {
        let cell = s.stage(stage).map_or("-".into(), |st| {
            format!("{:.1} / {:.1}", st.p50.median, st.p99.median)
        });
        let _ = write!(row, " {cell:>18}");
    }
    let _ = write!(row, "\n{:>6} {:>10}", "", "drift");
    for (stage, _) in STAGE_COLUMNS {
        let cell = drift_cell(s.stage(stage).and_then(|st| st.drift_pct));
        let _ = write!(row, " {cell:>18}");
    }
    let _ = writeln!(row);
    row
}

/// A drift's median over the runs as a signed percentage, `-` when none.
fn drift_cell(drift: Option<Spread>) -> String {
    drift.map_or("-".into(), |d| format!("{:+.0}%", d.median))
}

/// One steady point in the `--json` object.
pub(crate) fn steady_json(s: &SteadyResult) -> Value {
    let stages: serde_json::Map<String, Value> = s
        .stages
        .iter()
        .map(|st| {
            (
                st.stage.to_owned(),
                json!({"p50_ms": st.p50.median, "p99_ms": st.p99.median,
                       "p99_ms_min": st.p99.min, "p99_ms_max": st.p99.max,
                       "drift_pct": st.drift_pct.map(|d| d.median)}),
            )
        })
        .collect();
    let l = s.latency;
    json!({
        "mode": s.mode,
        "rate": rate_text(s),
        "target_events_per_s": s.target_events_per_s,
        "events_per_s": s.achieved_events_per_s.map(|a| a.median),
        "runs": s.runs,
        "failed": !s.failures.is_empty(),
        "failures": s.failures,
        "p50_ms": l.map(|l| l.p50.median),
        "p95_ms": l.map(|l| l.p95.median),
        "p99_ms": l.map(|l| l.p99.median),
        "max_ms": l.map(|l| l.max.median),
        "p99_ms_min": l.map(|l| l.p99.min),
        "p99_ms_max": l.map(|l| l.p99.max),
        "stages": stages,
        "drift_pct": s.drift_pct.map(|d| d.median),
        "ack_drift_pct": s.ack_drift_pct().map(|d| d.median),
        "cpu_us_per_event": {
            "postgres": s.cpu.db.map(|d| d.median),
            "walsender": s.cpu.walsender.map(|d| d.median),
            "relay": s.cpu.relay.map(|d| d.median),
            "broker": s.cpu.broker.map(|d| d.median),
            "bench": s.cpu.bench.map(|d| d.median),
        },
        "per_event": {
            "produce_requests": s.cpu.produce_requests.map(|d| d.median),
            "relay_wakeups": s.cpu.relay_wakeups.map(|d| d.median),
            "walsender_wakeups": s.cpu.walsender_wakeups.map(|d| d.median),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(v: f64) -> Spread {
        Spread {
            median: v,
            min: v,
            max: v,
        }
    }

    fn point(rate: Rate, failures: Vec<String>) -> SteadyResult {
        let measured = failures.is_empty();
        SteadyResult {
            mode: "cdc".into(),
            rate,
            target_events_per_s: Some(1000.0),
            runs: 1,
            achieved_events_per_s: Some(one(990.0)),
            latency: measured.then(|| LatencySpread {
                p50: one(4.0),
                p95: one(8.0),
                p99: one(12.0),
                max: one(30.0),
            }),
            stages: if measured {
                vec![
                    StageSpread {
                        stage: m::STAGE_PRODUCED_TO_ACKED,
                        p50: one(2.5),
                        p99: one(6.0),
                        drift_pct: Some(one(7.0)),
                    },
                    StageSpread {
                        stage: COMMIT_TO_ACK,
                        p50: one(3.0),
                        p99: one(7.0),
                        drift_pct: Some(one(4.0)),
                    },
                ]
            } else {
                Vec::new()
            },
            drift_pct: measured.then(|| one(-3.0)),
            failures,
            cpu: PerEventSpread {
                db: measured.then(|| one(41.5)),
                relay: measured.then(|| one(20.0)),
                produce_requests: measured.then(|| one(0.25)),
                relay_wakeups: measured.then(|| one(1.5)),
                ..PerEventSpread::default()
            },
        }
    }

    #[test]
    fn cpu_per_event_is_shown_by_process() {
        let ok = point(Rate::Fixed(1000.0), Vec::new());
        let table = render_steady("10 s", std::slice::from_ref(&ok));
        assert!(table.contains("CPU per event written"), "{table}");
        assert!(table.contains("41.5"), "{table}");
        let json = steady_json(&ok);
        assert_eq!(json["cpu_us_per_event"]["postgres"], 41.5);
        assert!(json["cpu_us_per_event"]["broker"].is_null());
        assert!(table.contains("produce requests"), "{table}");
        assert!(table.contains("0.25"), "{table}");
        assert_eq!(json["per_event"]["produce_requests"], 0.25);
        assert_eq!(json["per_event"]["relay_wakeups"], 1.5);
        assert!(json["per_event"]["walsender_wakeups"].is_null());
    }

    #[test]
    fn failed_points_show_their_reason_and_measured_ones_their_stages() {
        let ok = point(Rate::Fixed(1000.0), Vec::new());
        let failed = point(Rate::WritersMax, vec!["the writers fell behind".into()]);
        let json = steady_json(&failed);
        assert_eq!(json["failed"], true);
        assert_eq!(json["rate"], "max");
        assert_eq!(json["failures"][0], "the writers fell behind");
        assert!(json["p99_ms"].is_null());
        let json = steady_json(&ok);
        assert_eq!(json["failed"], false);
        assert_eq!(json["stages"]["produced_to_acked"]["p99_ms"], 6.0);
        assert_eq!(json["drift_pct"], -3.0);
        assert!(steady_row(&ok).ends_with("-3%"), "{}", steady_row(&ok));
        assert_eq!(json["ack_drift_pct"], 4.0);
        assert_eq!(json["stages"]["produced_to_acked"]["drift_pct"], 7.0);
        let row = stage_row(&ok);
        let (figures, drifts) = row.split_once('\n').expect("a drift line");
        assert!(figures.contains("2.5 / 6.0"), "{row}");
        assert!(figures.trim_end().ends_with("3.0 / 7.0"), "{row}");
        // Each stage's drift under its figures; a stage without one shows `-`.
        let cells: Vec<&str> = drifts.split_whitespace().collect();
        assert_eq!(cells, ["drift", "-", "-", "+7%", "-", "+4%"], "{row}");
        assert!(
            steady_row(&failed).contains(" - "),
            "{}",
            steady_row(&failed)
        );
    }
}
