//! What `bench` prints: the per-run samples aggregated per mode (median, min–max),
//! the ratios that answer "how close to the ceilings, how far ahead of polling",
//! as a terminal table, one JSON object, or an SVG chart.

use std::fmt::Write as _;

use serde_json::{Value, json};

use super::args::{BenchArgs, Rate};
use super::drain::{
    CDC_EXACTLY_ONCE, CDC_MESSAGE, CDC_MESSAGE_UNAUDITED, CDC_TEXT, CDC_TRACED, Mode,
};
use super::stats::{LatencySpread, Spread, spread};
use super::steady_report::{SteadyResult, render_steady, steady_json};
use crate::tools::workload::Workload;

/// The steady rate (events/s) whose latencies go into the main results table.
pub(crate) const HEADLINE_RATE: f64 = 5000.0;

/// One measured drain.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Sample {
    pub events_per_s: f64,
    pub cpu_s_per_1m: Option<f64>,
    pub rss_mib: Option<f64>,
    /// WAL the application's inserts wrote, per event.
    pub insert_wal_bytes_per_event: Option<f64>,
    pub insert_events_per_s: Option<f64>,
    pub avg_payload_bytes: Option<f64>,
    /// WAL written while the mode drained (the poller's updates), per event.
    pub drain_wal_bytes_per_event: Option<f64>,
    pub dead_tuples: Option<i64>,
    pub table_growth_bytes: Option<i64>,
    /// CPU of the walsenders that served the mode, per million events.
    pub walsender_cpu_s_per_1m: Option<f64>,
    /// Read and write system calls of the mode's process, per event.
    pub io_calls_per_event: Option<f64>,
    /// What the server's logical decoding spilled to disk and streamed in progress
    /// while the mode drained (`pg_stat_replication_slots`), MiB.
    pub spill_mib: Option<f64>,
    pub stream_mib: Option<f64>,
}

/// The aggregated figures of one mode.
#[derive(Debug, Clone, PartialEq)]
pub struct ModeResult {
    pub mode: String,
    pub settings: String,
    pub runs: usize,
    pub events_per_s: Spread,
    pub cpu_s_per_1m: Option<Spread>,
    pub walsender_cpu_s_per_1m: Option<Spread>,
    pub io_calls_per_event: Option<Spread>,
    pub rss_mib: Option<Spread>,
    pub drain_wal_bytes_per_event: Option<Spread>,
    /// WAL the writers wrote per event for this mode's backlog (rows or messages).
    pub insert_wal_bytes_per_event: Option<Spread>,
    pub dead_tuples: Option<Spread>,
    pub table_growth_bytes: Option<Spread>,
    pub spill_mib: Option<Spread>,
    pub stream_mib: Option<Spread>,
    /// From the steady point at `HEADLINE_RATE` events/s.
    pub latency: Option<LatencySpread>,
}

/// The workload, as run.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadInfo {
    pub kind: String,
    pub events: u64,
    pub payload_bytes: usize,
    pub avg_payload_bytes: Option<f64>,
    pub rows_per_tx: u32,
    pub writers: u32,
    pub entities: u32,
    pub repeat: u32,
    pub steady_secs: u64,
    /// Relays (and slots) the `cdc` mode ran with (`--shards`).
    pub shards: u32,
    pub wal_bytes_per_event: Option<Spread>,
    pub insert_events_per_s: Option<Spread>,
}

impl WorkloadInfo {
    #[must_use]
    pub(crate) fn new(
        args: &BenchArgs,
        workload: &Workload,
        samples: &[(Mode, Sample)],
    ) -> WorkloadInfo {
        // The row outbox's writes (the message outbox's are in its own rows).
        let all = |f: fn(&Sample) -> Option<f64>| {
            Spread::of(
                &samples
                    .iter()
                    .filter(|(m, _)| !m.writes_messages())
                    .filter_map(|(_, s)| f(s))
                    .collect::<Vec<_>>(),
            )
        };
        WorkloadInfo {
            kind: format!("{:?}", args.workload).to_lowercase(),
            events: workload.events,
            payload_bytes: workload.payload_bytes,
            avg_payload_bytes: all(|s| s.avg_payload_bytes).map(|s| s.median),
            rows_per_tx: workload.rows_per_tx,
            writers: workload.writers,
            entities: workload.entities,
            repeat: args.repeat,
            steady_secs: args.steady_secs,
            shards: args.shards,
            wal_bytes_per_event: all(|s| s.insert_wal_bytes_per_event),
            insert_events_per_s: all(|s| s.insert_events_per_s),
        }
    }
}

/// Everything `bench` measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub workload: WorkloadInfo,
    pub results: Vec<ModeResult>,
    /// Label of the fastest poller setting, the baseline of `cdc_vs_poll`.
    pub best_poll: Option<String>,
    pub steady: Vec<SteadyResult>,
}

/// How the CDC relay compares, as `cdc events/s ÷ other events/s` (medians).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Ratios {
    pub cdc_vs_poll: Option<f64>,
    pub cdc_vs_pg_ceiling: Option<f64>,
    pub cdc_vs_pg_ceiling_ours: Option<f64>,
    pub cdc_vs_broker_ceiling: Option<f64>,
    /// Exactly-once drain rate over at-least-once (`cdc-exactly-once` / `cdc`).
    pub exactly_once_vs_cdc: Option<f64>,
    /// Message-outbox drain rate over the row outbox's (`cdc-message` / `cdc`).
    pub message_vs_cdc: Option<f64>,
    /// Walsender CPU per event, message outbox over row outbox (`cdc-message` /
    /// `cdc`; lower is better).
    pub message_walsender_vs_cdc: Option<f64>,
    /// As `message_vs_cdc`, with the message ledger off (`cdc-message-unaudited`).
    pub unaudited_message_vs_cdc: Option<f64>,
    /// As `message_walsender_vs_cdc`, with the message ledger off.
    pub unaudited_message_walsender_vs_cdc: Option<f64>,
    /// Drain rate in binary over text format (`cdc` / `cdc-text`).
    pub binary_vs_text: Option<f64>,
    /// Walsender CPU per event in binary over text format (`cdc` / `cdc-text`;
    /// lower is better).
    pub binary_walsender_vs_text: Option<f64>,
    /// Drain rate with every event traced over without (`cdc-traced` / `cdc`).
    pub traced_vs_cdc: Option<f64>,
    /// The relay's extra CPU per event with every event traced, in microseconds
    /// (`cdc-traced` − `cdc`, medians).
    pub traced_cpu_us_per_event: Option<f64>,
}

impl Report {
    /// Aggregates `samples` per mode, in the order of `modes`.
    #[must_use]
    pub(crate) fn new(
        workload: WorkloadInfo,
        modes: &[Mode],
        samples: &[(Mode, Sample)],
    ) -> Report {
        let results: Vec<ModeResult> = modes
            .iter()
            .filter_map(|mode| aggregate(*mode, samples))
            .collect();
        let best_poll = results
            .iter()
            .filter(|r| r.mode.starts_with("poll-"))
            .max_by(|a, b| a.events_per_s.median.total_cmp(&b.events_per_s.median))
            .map(|r| r.mode.clone());
        Report {
            workload,
            results,
            best_poll,
            steady: Vec::new(),
        }
    }

    /// The result of a mode by label.
    #[must_use]
    pub fn result(&self, label: &str) -> Option<&ModeResult> {
        self.results.iter().find(|r| r.mode == label)
    }

    fn median(&self, label: &str) -> Option<f64> {
        self.result(label).map(|r| r.events_per_s.median)
    }

    /// Mode `label` against `cdc`: drain rate and walsender CPU per event ratios.
    fn against_cdc(&self, label: &str) -> (Option<f64>, Option<f64>) {
        (
            over(self.median(label), self.median("cdc")),
            over(self.walsender_median(label), self.walsender_median("cdc")),
        )
    }

    /// The relay's CPU seconds per million events (= µs per event), median.
    fn cpu_median(&self, label: &str) -> Option<f64> {
        self.result(label)
            .and_then(|r| r.cpu_s_per_1m.as_ref())
            .map(|s| s.median)
    }

    fn walsender_median(&self, label: &str) -> Option<f64> {
        self.result(label)
            .and_then(|r| r.walsender_cpu_s_per_1m.as_ref())
            .map(|s| s.median)
    }

    /// The headline ratios; `None` where a side was not measured.
    #[must_use]
    pub fn ratios(&self) -> Ratios {
        let cdc = self.median("cdc");
        let ratio = |other: Option<f64>| over(cdc, other);
        let recvlogical = self.median("pg-ceiling-recvlogical");
        let ours = self.median("pg-ceiling-ours");
        Ratios {
            cdc_vs_poll: ratio(self.best_poll.as_deref().and_then(|p| self.median(p))),
            cdc_vs_pg_ceiling: ratio(recvlogical.or(ours)),
            cdc_vs_pg_ceiling_ours: ratio(ours),
            cdc_vs_broker_ceiling: ratio(self.median("broker-ceiling")),
            exactly_once_vs_cdc: over(self.median(CDC_EXACTLY_ONCE), cdc),
            message_vs_cdc: self.against_cdc(CDC_MESSAGE).0,
            message_walsender_vs_cdc: self.against_cdc(CDC_MESSAGE).1,
            unaudited_message_vs_cdc: self.against_cdc(CDC_MESSAGE_UNAUDITED).0,
            unaudited_message_walsender_vs_cdc: self.against_cdc(CDC_MESSAGE_UNAUDITED).1,
            binary_vs_text: over(cdc, self.median(CDC_TEXT)),
            binary_walsender_vs_text: over(
                self.walsender_median("cdc"),
                self.walsender_median(CDC_TEXT),
            ),
            traced_vs_cdc: over(self.median(CDC_TRACED), cdc),
            traced_cpu_us_per_event: self
                .cpu_median(CDC_TRACED)
                .zip(self.cpu_median("cdc"))
                .map(|(traced, plain)| traced - plain),
        }
    }

    /// Copies the headline steady latencies into the results of the same modes
    /// (the steady poller runs with the settings of one backlog row).
    pub fn attach_latencies(&mut self) {
        for result in &mut self.results {
            result.latency = self
                .steady
                .iter()
                .find(|s| s.mode == result.mode && s.rate == Rate::Fixed(HEADLINE_RATE))
                .and_then(|s| s.latency);
        }
    }

    /// The `--json` object: `{"workload", "results", "ratios", "steady"}`.
    #[must_use]
    pub fn to_json(&self) -> Value {
        let r = self.ratios();
        json!({
            "workload": {
                "kind": self.workload.kind,
                "events": self.workload.events,
                "payload_bytes": self.workload.payload_bytes,
                "avg_payload_bytes": self.workload.avg_payload_bytes,
                "rows_per_tx": self.workload.rows_per_tx,
                "writers": self.workload.writers,
                "entities": self.workload.entities,
                "repeat": self.workload.repeat,
                "steady_secs": self.workload.steady_secs,
                "shards": self.workload.shards,
                "wal_bytes_per_event": self.workload.wal_bytes_per_event.map(|s| s.median),
                "insert_events_per_s": self.workload.insert_events_per_s.map(|s| s.median),
            },
            "results": self.results.iter().map(|m| result_json(m, self.best_poll.as_deref())).collect::<Vec<_>>(),
            "best_poll": self.best_poll,
            "ratios": {
                "cdc_vs_poll": r.cdc_vs_poll,
                "cdc_vs_pg_ceiling": r.cdc_vs_pg_ceiling,
                "cdc_vs_pg_ceiling_ours": r.cdc_vs_pg_ceiling_ours,
                "cdc_vs_broker_ceiling": r.cdc_vs_broker_ceiling,
                "exactly_once_vs_cdc": r.exactly_once_vs_cdc,
                "message_vs_cdc": r.message_vs_cdc,
                "message_walsender_vs_cdc": r.message_walsender_vs_cdc,
                "unaudited_message_vs_cdc": r.unaudited_message_vs_cdc,
                "unaudited_message_walsender_vs_cdc": r.unaudited_message_walsender_vs_cdc,
                "binary_vs_text": r.binary_vs_text,
                "traced_vs_cdc": r.traced_vs_cdc,
                "traced_cpu_us_per_event": r.traced_cpu_us_per_event,
                "binary_walsender_vs_text": r.binary_walsender_vs_text,
            },
            "steady": self.steady.iter().map(steady_json).collect::<Vec<_>>(),
        })
    }

    /// The terminal table.
    #[must_use]
    pub fn render_table(&self) -> String {
        let w = &self.workload;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "workload: {} events, ~{} B payload ({} measured), {} rows/tx, {} writers, {} entities; median [min–max] of {} run(s)",
            w.events,
            w.payload_bytes,
            w.avg_payload_bytes
                .map_or("-".into(), |b| format!("{b:.0} B")),
            w.rows_per_tx,
            w.writers,
            w.entities,
            w.repeat,
        );
        if w.shards > 1 {
            let _ = writeln!(
                out,
                "cdc: {} shards, one relay process and one slot each (CPU and RSS summed)",
                w.shards
            );
        }
        if let (Some(wal), Some(rate)) = (w.wal_bytes_per_event, w.insert_events_per_s) {
            let _ = writeln!(
                out,
                "inserts: {} WAL bytes/event, {} events/s",
                spread(&wal, 0),
                spread(&rate, 0)
            );
        }
        let _ = writeln!(
            out,
            "\n{:<32} {:>28} {:>13} {:>15} {:>12} {:>13} {:>14} {:>14} {:>12} {:>12} {:>16} {:>12}  settings",
            "mode",
            "events/s",
            "CPU s/1M ev",
            "walsender s/1M",
            "I/O calls/ev",
            "peak RSS MiB",
            "insert WAL B/ev",
            "drain WAL B/ev",
            "table B/ev",
            "dead tuples",
            "spill/stream MiB",
            "p99 ms"
        );
        for m in &self.results {
            let best = if self.best_poll.as_deref() == Some(&m.mode) {
                " (best poll)"
            } else {
                ""
            };
            let _ = writeln!(
                out,
                "{:<32} {:>28} {:>13} {:>15} {:>12} {:>13} {:>14} {:>14} {:>12} {:>12} {:>16} {:>12}  {}{best}",
                m.mode,
                spread(&m.events_per_s, 0),
                opt(m.cpu_s_per_1m.as_ref(), 1),
                opt(m.walsender_cpu_s_per_1m.as_ref(), 1),
                opt(m.io_calls_per_event.as_ref(), 2),
                opt(m.rss_mib.as_ref(), 0),
                opt(m.insert_wal_bytes_per_event.as_ref(), 0),
                opt(m.drain_wal_bytes_per_event.as_ref(), 0),
                m.table_growth_bytes
                    .as_ref()
                    .map_or("-".into(), |g| format!(
                        "{:.0}",
                        g.median / super::stats::count_f64(w.events.max(1))
                    )),
                opt(m.dead_tuples.as_ref(), 0),
                match (&m.spill_mib, &m.stream_mib) {
                    (None, None) => "-".into(),
                    (spill, stream) =>
                        format!("{}/{}", opt(spill.as_ref(), 0), opt(stream.as_ref(), 0)),
                },
                m.latency
                    .map_or("-".into(), |l| format!("{:.0}", l.p99.median)),
                m.settings,
            );
        }
        let r = self.ratios();
        let ratio = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.2}×"));
        let _ = writeln!(
            out,
            "\ncdc vs best poll {}  ·  cdc vs PostgreSQL ceiling {} (ours {})  ·  cdc vs broker ceiling {}",
            ratio(r.cdc_vs_poll),
            ratio(r.cdc_vs_pg_ceiling),
            ratio(r.cdc_vs_pg_ceiling_ours),
            ratio(r.cdc_vs_broker_ceiling),
        );
        if r.exactly_once_vs_cdc.is_some() {
            let _ = writeln!(
                out,
                "cdc-exactly-once vs cdc {} (drain rate; CPU per event in the table)",
                ratio(r.exactly_once_vs_cdc),
            );
        }
        if r.traced_vs_cdc.is_some() {
            let _ = writeln!(
                out,
                "cdc-traced vs cdc {} (drain rate, every event traced) · relay CPU per event {}",
                ratio(r.traced_vs_cdc),
                r.traced_cpu_us_per_event
                    .map_or("-".into(), |us| format!("{us:+.1} µs")),
            );
        }
        if r.binary_vs_text.is_some() {
            let _ = writeln!(
                out,
                "cdc (binary) vs cdc-text {} (drain rate) · walsender CPU per event {}",
                ratio(r.binary_vs_text),
                ratio(r.binary_walsender_vs_text),
            );
        }
        for label in [CDC_MESSAGE_UNAUDITED, CDC_MESSAGE] {
            let (Some(rate), walsender) = self.against_cdc(label) else {
                continue;
            };
            let _ = writeln!(
                out,
                "{label} vs cdc {} (drain rate) · walsender CPU per event {}",
                ratio(Some(rate)),
                ratio(walsender),
            );
        }
        if !self.steady.is_empty() {
            let points = format!(
                "{} s per point, {} rows/tx, {} writers",
                w.steady_secs, w.rows_per_tx, w.writers
            );
            out.push_str(&render_steady(&points, &self.steady));
        }
        out
    }
}

/// `a / b` when both were measured and `b` is positive.
fn over(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

fn aggregate(mode: Mode, samples: &[(Mode, Sample)]) -> Option<ModeResult> {
    let mine: Vec<&Sample> = samples
        .iter()
        .filter(|(m, _)| *m == mode)
        .map(|(_, s)| s)
        .collect();
    let spread_of = |f: &dyn Fn(&Sample) -> Option<f64>| {
        Spread::of(&mine.iter().filter_map(|s| f(s)).collect::<Vec<_>>())
    };
    let as_f64 = |v: Option<i64>| v.map(super::stats::signed_f64);
    Some(ModeResult {
        mode: mode.label(),
        settings: mode.settings(),
        runs: mine.len(),
        events_per_s: spread_of(&|s| Some(s.events_per_s))?,
        cpu_s_per_1m: spread_of(&|s| s.cpu_s_per_1m),
        walsender_cpu_s_per_1m: spread_of(&|s| s.walsender_cpu_s_per_1m),
        io_calls_per_event: spread_of(&|s| s.io_calls_per_event),
        rss_mib: spread_of(&|s| s.rss_mib),
        drain_wal_bytes_per_event: spread_of(&|s| s.drain_wal_bytes_per_event),
        insert_wal_bytes_per_event: spread_of(&|s| s.insert_wal_bytes_per_event),
        dead_tuples: spread_of(&|s| as_f64(s.dead_tuples)),
        table_growth_bytes: spread_of(&|s| as_f64(s.table_growth_bytes)),
        spill_mib: spread_of(&|s| s.spill_mib),
        stream_mib: spread_of(&|s| s.stream_mib),
        latency: None,
    })
}

fn result_json(m: &ModeResult, best_poll: Option<&str>) -> Value {
    let med = |s: Option<&Spread>| s.map(|s| s.median);
    json!({
        "mode": m.mode,
        "settings": m.settings,
        "best_poll": best_poll == Some(m.mode.as_str()),
        "runs": m.runs,
        "events_per_s": m.events_per_s.median,
        "events_per_s_min": m.events_per_s.min,
        "events_per_s_max": m.events_per_s.max,
        "p50_ms": m.latency.map(|l| l.p50.median),
        "p95_ms": m.latency.map(|l| l.p95.median),
        "p99_ms": m.latency.map(|l| l.p99.median),
        "max_ms": m.latency.map(|l| l.max.median),
        "cpu_s_per_1m": med(m.cpu_s_per_1m.as_ref()),
        "walsender_cpu_s_per_1m": med(m.walsender_cpu_s_per_1m.as_ref()),
        "io_calls_per_event": med(m.io_calls_per_event.as_ref()),
        "rss_mib": med(m.rss_mib.as_ref()),
        "drain_wal_bytes_per_event": med(m.drain_wal_bytes_per_event.as_ref()),
        "insert_wal_bytes_per_event": med(m.insert_wal_bytes_per_event.as_ref()),
        "dead_tuples": med(m.dead_tuples.as_ref()),
        "table_growth_bytes": med(m.table_growth_bytes.as_ref()),
        "spill_mib": med(m.spill_mib.as_ref()),
        "stream_mib": med(m.stream_mib.as_ref()),
    })
}

fn opt(s: Option<&Spread>, decimals: usize) -> String {
    s.map_or("-".into(), |s| format!("{:.decimals$}", s.median))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(rate: f64) -> Sample {
        Sample {
            events_per_s: rate,
            cpu_s_per_1m: Some(10.0),
            ..Sample::default()
        }
    }

    fn info() -> WorkloadInfo {
        WorkloadInfo {
            kind: "backlog".into(),
            events: 10,
            payload_bytes: 300,
            avg_payload_bytes: None,
            rows_per_tx: 1,
            writers: 1,
            entities: 1,
            repeat: 2,
            steady_secs: 1,
            shards: 1,
            wal_bytes_per_event: None,
            insert_events_per_s: None,
        }
    }

    #[test]
    fn aggregates_per_mode_and_picks_the_best_poller() {
        let p1 = Mode::Poll {
            batch: 100,
            workers: 1,
        };
        let p4 = Mode::Poll {
            batch: 1000,
            workers: 4,
        };
        let samples = vec![
            (Mode::Cdc, sample(100.0)),
            (Mode::Cdc, sample(300.0)),
            (p1, sample(10.0)),
            (p4, sample(50.0)),
            (Mode::RecvLogical, sample(400.0)),
            (Mode::BrokerCeiling, sample(200.0)),
        ];
        let modes = [Mode::RecvLogical, Mode::BrokerCeiling, Mode::Cdc, p1, p4];
        let report = Report::new(info(), &modes, &samples);
        let cdc = report.result("cdc").unwrap();
        assert_eq!(
            cdc.events_per_s,
            Spread {
                median: 200.0,
                min: 100.0,
                max: 300.0
            }
        );
        assert_eq!(report.best_poll.as_deref(), Some("poll-b1000-w4"));
        let r = report.ratios();
        assert_eq!(r.cdc_vs_poll, Some(4.0));
        assert_eq!(r.cdc_vs_pg_ceiling, Some(0.5));
        assert_eq!(r.cdc_vs_broker_ceiling, Some(1.0));
        assert_eq!(r.cdc_vs_pg_ceiling_ours, None);
        let json = report.to_json();
        assert_eq!(json["results"].as_array().unwrap().len(), 5);
        assert_eq!(json["ratios"]["cdc_vs_poll"], 4.0);
        assert!(json["results"][0]["p50_ms"].is_null());
        assert!(report.render_table().contains("poll-b1000-w4"));
    }

    #[test]
    fn exactly_once_is_compared_with_the_at_least_once_drain() {
        let samples = vec![
            (Mode::Cdc, sample(200.0)),
            (Mode::CdcExactlyOnce, sample(150.0)),
        ];
        let modes = [Mode::Cdc, Mode::CdcExactlyOnce];
        let report = Report::new(info(), &modes, &samples);
        assert_eq!(report.ratios().exactly_once_vs_cdc, Some(0.75));
        assert_eq!(report.to_json()["ratios"]["exactly_once_vs_cdc"], 0.75);
        let table = report.render_table();
        assert!(table.contains("cdc-exactly-once vs cdc 0.75×"), "{table}");
        assert!(table.contains("kafka.delivery = exactly-once"), "{table}");

        let alone = Report::new(info(), &[Mode::Cdc], &samples[..1]);
        assert_eq!(alone.ratios().exactly_once_vs_cdc, None);
        assert!(!alone.render_table().contains("cdc-exactly-once vs cdc"));
    }

    #[test]
    fn spread_text() {
        assert_eq!(
            spread(
                &Spread {
                    median: 2.0,
                    min: 1.0,
                    max: 3.0
                },
                0
            ),
            "2 [1–3]"
        );
        assert_eq!(
            spread(
                &Spread {
                    median: 2.0,
                    min: 2.0,
                    max: 2.0
                },
                1
            ),
            "2.0"
        );
    }
}
