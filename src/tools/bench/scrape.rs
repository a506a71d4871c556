//! Where the time goes: the relay's own per-stage histograms, read from its
//! `/metrics` endpoint at the end of a steady point.
//!
//! Only the relay knows when it took a frame, handed a record to librdkafka, got
//! the delivery report and sent the status that confirmed it; the benchmark cannot
//! see those moments from outside. So the CDC relay of a steady point runs with its
//! metrics endpoint on a loopback port, and after the point the benchmark reads the
//! Prometheus text once and turns each histogram into p50 and p99, interpolating
//! linearly inside a bucket as Prometheus' `histogram_quantile` does. The buckets
//! (see `crate::cdc::metrics`) are 1–10 ms wide where live traffic lands, so a
//! percentile read this way is good to about half a bucket. The relay is a fresh
//! process per point, so its histograms hold exactly that point's events.
//!
//! Two more pages, read at a quarter and at three quarters of the writing, give
//! each stage's drift ([`stages_of`]): its p50 over the last quarter against the
//! first, each quarter's histogram being the difference of two cumulative pages.
//! The consumer's drift includes the broker's fetch path, which for an in-memory
//! test broker slows as the run's records pile up in its RAM; the stages say which
//! part of the way slowed: the relay's own (commit → received, received →
//! produced) or the broker's produce round trip (produced → acked).

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::stats::Drift;
use crate::cdc::metrics as m;

/// Label of the end-to-end commit → ack figure in the stage table.
pub(crate) const COMMIT_TO_ACK: &str = "commit_to_ack";

/// How long the scrape may take.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);

/// p50 and p99 of one stage, in milliseconds, with the number of samples and the
/// drift of its p50 within the run.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StageLatency {
    pub(crate) stage: &'static str,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) count: u64,
    /// `None` without the quarter pages or when a quarter has no samples.
    pub(crate) drift: Option<Drift>,
}

/// The sum of a counter's samples (every label set) on a Prometheus text page;
/// `None` when the page has none.
pub(crate) fn counter(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with(' ') || rest.starts_with('{')) {
            continue;
        }
        let value = rest.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
        if let Some(v) = value {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// A free loopback port for a child's metrics endpoint (bound, read, released).
pub(crate) fn free_port() -> std::io::Result<SocketAddr> {
    std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()
}

/// The Prometheus text page of the endpoint at `addr`; `Err` with the reason when it
/// cannot be read.
pub(crate) async fn page(addr: SocketAddr) -> Result<String, String> {
    tokio::time::timeout(SCRAPE_TIMEOUT, get(addr, "/metrics"))
        .await
        .map_err(|_| format!("no answer from {addr} within {SCRAPE_TIMEOUT:?}"))?
        .map_err(|e| format!("reading {addr}/metrics: {e}"))
}

/// How a stage's median moved within a run: its p50 (ms) over the first quarter
/// and over the last, from the cumulative histograms of one relay process read at
/// a quarter of the run, at three quarters and at the end. `None` when a quarter has
/// no samples or the pages' buckets differ.
fn drift(
    at_quarter: &[(f64, u64)],
    at_three_quarters: &[(f64, u64)],
    at_end: &[(f64, u64)],
) -> Option<Drift> {
    let last = difference(at_end, at_three_quarters)?;
    Some(Drift {
        first_quarter_p50: quantile(at_quarter, 0.5)? * 1000.0,
        last_quarter_p50: quantile(&last, 0.5)? * 1000.0,
    })
}

/// Cumulative buckets `later − earlier`, bound by bound (`None` when the bounds
/// differ; an empty `earlier` is a histogram with no samples yet).
fn difference(later: &[(f64, u64)], earlier: &[(f64, u64)]) -> Option<Vec<(f64, u64)>> {
    if earlier.is_empty() {
        return Some(later.to_vec());
    }
    if later.len() != earlier.len() {
        return None;
    }
    later
        .iter()
        .zip(earlier)
        .map(|(&(le, count), &(le_before, before))| {
            le.total_cmp(&le_before)
                .is_eq()
                .then(|| (le, count.saturating_sub(before)))
        })
        .collect()
}

/// The stages found in the Prometheus text page read at the end of a point (stages
/// without samples left out), then commit → ack; with the pages read at a quarter
/// and at three quarters, each with its drift.
pub(crate) fn stages_of(at_end: &str, quarters: Option<(&str, &str)>) -> Vec<StageLatency> {
    let series = m::STAGES
        .iter()
        .map(|&stage| (stage, m::STAGE_LATENCY, Some(stage)))
        .chain(std::iter::once((COMMIT_TO_ACK, m::DELIVERY_LATENCY, None)));
    series
        .filter_map(|(stage, name, label)| {
            let end = buckets(at_end, name, label);
            let mut out = latency(stage, &end)?;
            out.drift = quarters.and_then(|(first, third)| {
                drift(
                    &buckets(first, name, label),
                    &buckets(third, name, label),
                    &end,
                )
            });
            Some(out)
        })
        .collect()
}

fn latency(stage: &'static str, buckets: &[(f64, u64)]) -> Option<StageLatency> {
    let count = buckets.last().map(|&(_, c)| c).filter(|&c| c > 0)?;
    Some(StageLatency {
        stage,
        p50_ms: quantile(buckets, 0.5)? * 1000.0,
        p99_ms: quantile(buckets, 0.99)? * 1000.0,
        count,
        drift: None,
    })
}

/// Whether the relay's `/readyz` answers 200: it streams (in exactly-once mode, only
/// once its transactions are initialised and its progress record read, which a held
/// slot does not say).
pub(crate) async fn ready(addr: SocketAddr) -> bool {
    tokio::time::timeout(SCRAPE_TIMEOUT, get(addr, "/readyz"))
        .await
        .is_ok_and(|answer| answer.is_ok())
}

/// One HTTP/1.0 `GET path` (the endpoint closes the connection after it): the body
/// of a 200 answer.
async fn get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: relay\r\n\r\n").as_bytes())
        .await?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await?;
    let text = String::from_utf8_lossy(&response);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return Err(std::io::Error::other("no HTTP response"));
    };
    if !head.lines().next().is_some_and(|l| l.contains(" 200 ")) {
        return Err(std::io::Error::other(format!(
            "answered {:?}",
            head.lines().next().unwrap_or_default()
        )));
    }
    Ok(body.to_owned())
}

/// The cumulative buckets `(le, count)` of histogram `name`, ascending, `+Inf` last;
/// with `stage`, only the series whose `stage` label is that.
pub(crate) fn buckets(text: &str, name: &str, stage: Option<&str>) -> Vec<(f64, u64)> {
    let prefix = format!("{name}_bucket{{");
    let mut out: Vec<(f64, u64)> = text
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(&prefix)?;
            let (labels, value) = rest.split_once("} ")?;
            if let Some(stage) = stage
                && label(labels, "stage") != Some(stage)
            {
                return None;
            }
            let le = match label(labels, "le")? {
                "+Inf" => f64::INFINITY,
                le => le.parse().ok()?,
            };
            let count = value.trim().parse::<f64>().ok()?;
            Some((le, super::stats::truncate_u64(count)))
        })
        .collect();
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

/// The value of `key="…"` in a label list (values without escapes, as ours are).
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    labels.split(',').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k.trim() == key).then(|| v.trim().trim_matches('"'))
    })
}

/// The `q` quantile (0–1) of cumulative `buckets`, linear inside the bucket it falls
/// in (from the bucket below, or 0); in the `+Inf` bucket, the highest finite bound.
/// `None` without samples.
pub(crate) fn quantile(buckets: &[(f64, u64)], q: f64) -> Option<f64> {
    let total = super::stats::count_f64(buckets.last()?.1);
    if total <= 0.0 {
        return None;
    }
    let rank = q.clamp(0.0, 1.0) * total;
    let (mut lower, mut below) = (0.0, 0.0);
    for &(le, count) in buckets {
        let count = super::stats::count_f64(count);
        if count >= rank {
            if le.is_infinite() {
                return Some(lower);
            }
            let share = if count > below {
                (rank - below) / (count - below)
            } else {
                0.0
            };
            return Some(lower + (le - lower) * share);
        }
        (lower, below) = (le, count);
    }
    Some(lower)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = "\
# TYPE outbox_relay_stage_latency_seconds histogram
outbox_relay_stage_latency_seconds_bucket{stage=\"produced_to_acked\",le=\"0.001\"} 0
outbox_relay_stage_latency_seconds_bucket{stage=\"produced_to_acked\",le=\"0.005\"} 50
outbox_relay_stage_latency_seconds_bucket{stage=\"produced_to_acked\",le=\"0.01\"} 99
outbox_relay_stage_latency_seconds_bucket{stage=\"produced_to_acked\",le=\"+Inf\"} 100
outbox_relay_stage_latency_seconds_sum{stage=\"produced_to_acked\"} 0.4
outbox_relay_stage_latency_seconds_count{stage=\"produced_to_acked\"} 100
outbox_relay_stage_latency_seconds_bucket{stage=\"commit_to_received\",le=\"0.001\"} 0
outbox_relay_stage_latency_seconds_bucket{stage=\"commit_to_received\",le=\"+Inf\"} 0
outbox_relay_delivery_latency_seconds_bucket{le=\"0.01\"} 4
outbox_relay_delivery_latency_seconds_bucket{le=\"0.02\"} 8
outbox_relay_delivery_latency_seconds_bucket{le=\"+Inf\"} 8
";

    fn delivery_page(counts: [u64; 3]) -> String {
        format!(
            "outbox_relay_delivery_latency_seconds_bucket{{le=\"0.01\"}} {}\n\
             outbox_relay_delivery_latency_seconds_bucket{{le=\"0.02\"}} {}\n\
             outbox_relay_delivery_latency_seconds_bucket{{le=\"+Inf\"}} {}\n",
            counts[0], counts[1], counts[2]
        )
    }

    fn ack_drift(quarter: &str, three_quarters: &str, end: &str) -> Option<Drift> {
        stages_of(end, Some((quarter, three_quarters)))
            .into_iter()
            .find(|s| s.stage == COMMIT_TO_ACK)
            .and_then(|s| s.drift)
    }

    #[test]
    fn ack_drift_compares_the_last_quarter_with_the_first() {
        // First quarter: 10 samples, all in (0, 10 ms]: p50 5 ms. By three
        // quarters 30 samples; the last quarter adds 10, all in (10, 20 ms]: p50
        // 15 ms, +200 %. The middle half (whatever it holds) does not count.
        let quarter = delivery_page([10, 10, 10]);
        let three_quarters = delivery_page([12, 30, 30]);
        let end = delivery_page([12, 40, 40]);
        let drift = ack_drift(&quarter, &three_quarters, &end).expect("both quarters");
        assert!((drift.first_quarter_p50 - 5.0).abs() < 1e-9, "{drift:?}");
        assert!((drift.change_pct() - 200.0).abs() < 1e-9, "{drift:?}");
        // The same traffic in both quarters: no drift.
        let flat = delivery_page([20, 30, 30]);
        let drift = ack_drift(&quarter, &flat, &delivery_page([30, 40, 40])).expect("flat");
        assert!(drift.change_pct().abs() < 1e-9, "{drift:?}");
        // A quarter without samples, or pages that disagree on the buckets: none.
        assert_eq!(ack_drift(&quarter, &end, &end), None);
        assert_eq!(ack_drift("", &quarter, &end), None);
        let other_buckets = "outbox_relay_delivery_latency_seconds_bucket{le=\"0.05\"} 1\n\
                             outbox_relay_delivery_latency_seconds_bucket{le=\"+Inf\"} 1\n";
        assert_eq!(ack_drift(&quarter, other_buckets, &end), None);
        // Without the quarter pages the figures are there, the drift is not.
        assert!(stages_of(&end, None).iter().all(|s| s.drift.is_none()));
    }

    #[test]
    fn each_stage_has_its_own_drift() {
        // produced → acked: 50 samples in (1, 5 ms] by a quarter; the last quarter
        // (end minus three quarters) puts its 50 in (5, 10 ms]: p50 3 → 7.5 ms.
        let stage = |counts: [u64; 4]| {
            format!(
                "outbox_relay_stage_latency_seconds_bucket{{stage=\"produced_to_acked\",le=\"0.001\"}} {}\n\
                 outbox_relay_stage_latency_seconds_bucket{{stage=\"produced_to_acked\",le=\"0.005\"}} {}\n\
                 outbox_relay_stage_latency_seconds_bucket{{stage=\"produced_to_acked\",le=\"0.01\"}} {}\n\
                 outbox_relay_stage_latency_seconds_bucket{{stage=\"produced_to_acked\",le=\"+Inf\"}} {}\n",
                counts[0], counts[1], counts[2], counts[3]
            )
        };
        let quarter = stage([0, 50, 50, 50]);
        let three_quarters = stage([0, 150, 150, 150]);
        let end = stage([0, 150, 200, 200]);
        let stages = stages_of(&end, Some((&quarter, &three_quarters)));
        let acked = stages
            .iter()
            .find(|s| s.stage == "produced_to_acked")
            .and_then(|s| s.drift)
            .expect("both quarters");
        assert!((acked.first_quarter_p50 - 3.0).abs() < 1e-9, "{acked:?}");
        assert!((acked.last_quarter_p50 - 7.5).abs() < 1e-9, "{acked:?}");
    }

    #[test]
    fn reads_the_buckets_of_one_stage() {
        let b = buckets(PAGE, m::STAGE_LATENCY, Some("produced_to_acked"));
        assert_eq!(
            b,
            vec![(0.001, 0), (0.005, 50), (0.01, 99), (f64::INFINITY, 100)]
        );
        assert!(buckets(PAGE, m::STAGE_LATENCY, Some("acked_to_confirmed")).is_empty());
    }

    #[test]
    fn counters_sum_their_label_sets() {
        let page = "# TYPE outbox_relay_kafka_produce_requests_total counter\n\
                    outbox_relay_kafka_produce_requests_total 12\n\
                    outbox_relay_kafka_produce_requests_total_other 99\n\
                    outbox_relay_events_relayed_total{topic=\"a\"} 3\n\
                    outbox_relay_events_relayed_total{topic=\"b b\"} 4\n";
        assert_eq!(
            counter(page, "outbox_relay_kafka_produce_requests_total"),
            Some(12.0)
        );
        assert_eq!(
            counter(page, "outbox_relay_events_relayed_total"),
            Some(7.0)
        );
        assert_eq!(counter(page, "outbox_relay_reconnects_total"), None);
    }

    #[test]
    fn quantiles_interpolate_inside_a_bucket() {
        let b = buckets(PAGE, m::STAGE_LATENCY, Some("produced_to_acked"));
        // Rank 50 is the top of (1 ms, 5 ms]; rank 99 the top of (5, 10].
        assert!((quantile(&b, 0.5).unwrap() - 0.005).abs() < 1e-12);
        assert!((quantile(&b, 0.99).unwrap() - 0.01).abs() < 1e-12);
        // Rank 25 is half-way through (1, 5].
        assert!((quantile(&b, 0.25).unwrap() - 0.003).abs() < 1e-12);
        // In +Inf: the highest finite bound.
        assert!((quantile(&b, 1.0).unwrap() - 0.01).abs() < 1e-12);
        assert_eq!(quantile(&[(0.001, 0), (f64::INFINITY, 0)], 0.5), None);
        assert_eq!(quantile(&[], 0.5), None);
    }

    #[test]
    fn stages_skip_empty_histograms_and_add_commit_to_ack() {
        let stages = stages_of(PAGE, None);
        let names: Vec<&str> = stages.iter().map(|s| s.stage).collect();
        assert_eq!(names, ["produced_to_acked", COMMIT_TO_ACK]);
        assert_eq!(stages[0].count, 100);
        assert!((stages[0].p50_ms - 5.0).abs() < 1e-9);
        // Rank 4 of 8 is the top of the first bucket (0, 10 ms].
        assert!((stages[1].p50_ms - 10.0).abs() < 1e-9);
    }
}
