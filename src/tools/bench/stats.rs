//! Pure arithmetic of the benchmark: the spread of repeated measurements, latency
//! percentiles, and the open-loop send schedule of the steady-rate writers.
//!
//! Kept apart from the I/O so that the numbers the README publishes rest on code
//! with unit tests.

use std::time::Duration;

/// Median with the range of repeated measurements of one figure.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    /// The spread of `values`, ignoring NaN; `None` when nothing is left.
    #[must_use]
    pub fn of(values: &[f64]) -> Option<Spread> {
        let mut sorted: Vec<f64> = values.iter().copied().filter(|v| !v.is_nan()).collect();
        if sorted.is_empty() {
            return None;
        }
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let median = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        Some(Spread {
            median,
            min: sorted[0],
            max: sorted[n - 1],
        })
    }
}

/// The `p`-th percentile (0–100) of `sorted` (ascending) by the nearest-rank
/// method: the smallest value with at least `p`% of the values at or below it.
/// `None` for an empty slice.
#[must_use]
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let n = sorted.len();
    let len = u64::try_from(n).unwrap_or(u64::MAX);
    let rank = truncate_u64(((p.clamp(0.0, 100.0) / 100.0) * count_f64(len)).ceil());
    let rank = usize::try_from(rank).unwrap_or(n);
    Some(sorted[rank.clamp(1, n) - 1])
}

/// Latency distribution of one run, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Latency {
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
}

impl Latency {
    /// Percentiles of `samples_ms` (any order); `None` when empty.
    #[must_use]
    pub fn of(mut samples_ms: Vec<f64>) -> Option<Latency> {
        samples_ms.retain(|v| !v.is_nan());
        samples_ms.sort_by(f64::total_cmp);
        Some(Latency {
            p50: percentile(&samples_ms, 50.0)?,
            p95: percentile(&samples_ms, 95.0)?,
            p99: percentile(&samples_ms, 99.0)?,
            max: *samples_ms.last()?,
        })
    }
}

/// Whether latency drifted during one run: the median of the first quarter of the
/// events (in the order the consumer read them) against that of the last quarter.
/// A relay that slowly falls behind, leaks, or fragments shows here even when the
/// run's overall percentiles look fine.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Drift {
    pub first_quarter_p50: f64,
    pub last_quarter_p50: f64,
}

impl Drift {
    /// From samples in arrival order; `None` with fewer than four.
    #[must_use]
    pub fn of(samples_in_order: &[f64]) -> Option<Drift> {
        let quarter = samples_in_order.len() / 4;
        if quarter == 0 {
            return None;
        }
        let p50 = |part: &[f64]| {
            let mut part = part.to_vec();
            part.retain(|v| !v.is_nan());
            part.sort_by(f64::total_cmp);
            percentile(&part, 50.0)
        };
        Some(Drift {
            first_quarter_p50: p50(&samples_in_order[..quarter])?,
            last_quarter_p50: p50(&samples_in_order[samples_in_order.len() - quarter..])?,
        })
    }

    /// The last quarter's median relative to the first's, in percent (+10 = 10 %
    /// slower at the end).
    #[must_use]
    pub fn change_pct(&self) -> f64 {
        if self.first_quarter_p50 <= 0.0 {
            return f64::NAN;
        }
        (self.last_quarter_p50 / self.first_quarter_p50 - 1.0) * 100.0
    }
}

/// Latency percentiles over repeated runs, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencySpread {
    pub p50: Spread,
    pub p95: Spread,
    pub p99: Spread,
    pub max: Spread,
}

impl LatencySpread {
    /// The spread of each percentile over `runs`.
    #[must_use]
    pub fn of(runs: &[Latency]) -> Option<LatencySpread> {
        let pick = |f: fn(&Latency) -> f64| Spread::of(&runs.iter().map(f).collect::<Vec<_>>());
        Some(LatencySpread {
            p50: pick(|l| l.p50)?,
            p95: pick(|l| l.p95)?,
            p99: pick(|l| l.p99)?,
            max: pick(|l| l.max)?,
        })
    }
}

/// `median [min–max]`, or just the value when all runs agree.
pub(crate) fn spread(s: &Spread, decimals: usize) -> String {
    if (s.max - s.min).abs() < f64::EPSILON {
        format!("{:.decimals$}", s.median)
    } else {
        format!(
            "{:.decimals$} [{:.decimals$}–{:.decimals$}]",
            s.median, s.min, s.max
        )
    }
}

/// An open-loop schedule: transaction `i` is due at `i × interval` after the start,
/// whatever happened to the transactions before it. A writer that falls behind
/// sends at once (without waiting) until it is back on schedule, so a slow
/// database shows up as latency, not as a lower offered rate (no coordinated
/// omission).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Schedule {
    interval: Duration,
    count: u64,
}

impl Schedule {
    /// `events_per_s` spread over transactions of `rows_per_tx` rows for `duration`.
    /// `None` when the rate or the row count is zero.
    #[must_use]
    pub fn new(events_per_s: f64, rows_per_tx: u32, duration: Duration) -> Option<Schedule> {
        if events_per_s.is_nan() || events_per_s <= 0.0 || rows_per_tx == 0 {
            return None;
        }
        let tx_per_s = events_per_s / f64::from(rows_per_tx);
        let interval = Duration::from_secs_f64(1.0 / tx_per_s);
        let count = truncate_u64((duration.as_secs_f64() * tx_per_s).floor());
        Some(Schedule { interval, count })
    }

    /// Time between two transactions.
    #[must_use]
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Transactions in the whole run.
    #[must_use]
    pub fn count(&self) -> u64 {
        self.count
    }

    /// When transaction `i` is due, from the start.
    #[must_use]
    pub fn due(&self, i: u64) -> Duration {
        self.interval
            .saturating_mul(u32::try_from(i).unwrap_or(u32::MAX))
    }

    /// The schedule of writer `w` of `writers`: every `writers`-th transaction,
    /// shifted so the writers interleave evenly.
    #[must_use]
    pub fn split(&self, writers: u32) -> Vec<(Duration, Schedule)> {
        let writers = writers.max(1);
        (0..writers)
            .map(|w| {
                let count = self.count / u64::from(writers)
                    + u64::from(u64::from(w) < self.count % u64::from(writers));
                (
                    self.due(u64::from(w)),
                    Schedule {
                        interval: self.interval.saturating_mul(writers),
                        count,
                    },
                )
            })
            .collect()
    }
}

/// `events` per `elapsed`, in events per second (0 for a zero duration).
#[must_use]
pub fn rate(events: u64, elapsed: Duration) -> f64 {
    let secs = elapsed.as_secs_f64();
    if secs > 0.0 {
        count_f64(events) / secs
    } else {
        0.0
    }
}

/// A count as a float, for rates and averages. Exact up to 2^53 (about 9·10^15),
/// far beyond any count of events, bytes or ticks a run sees; above it the nearest
/// float is as good as a measured figure needs.
#[must_use]
pub(crate) fn count_f64(n: u64) -> f64 {
    #[allow(clippy::cast_precision_loss)] // exact below 2^53, see above
    let f = n as f64;
    f
}

/// [`count_f64`] for signed figures (table sizes, tuple counts, timestamps).
#[must_use]
pub(crate) fn signed_f64(n: i64) -> f64 {
    #[allow(clippy::cast_precision_loss)] // exact below 2^53, as count_f64
    let f = n as f64;
    f
}

/// The whole part of `v` (round it first where that is meant): negative values and
/// NaN give 0, values beyond `u64::MAX` give `u64::MAX`, as Rust's float-to-int
/// `as` is defined to saturate.
#[must_use]
pub(crate) fn truncate_u64(v: f64) -> u64 {
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    // saturating by definition, see above
    let n = v as u64;
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drift_compares_the_first_and_last_quarters_in_arrival_order() {
        // 8 samples: first quarter [10, 12], last quarter [20, 22].
        let samples = [10.0, 12.0, 5.0, 5.0, 5.0, 5.0, 20.0, 22.0];
        let drift = Drift::of(&samples).expect("enough samples");
        assert_eq!(drift.first_quarter_p50, 10.0);
        assert_eq!(drift.last_quarter_p50, 20.0);
        assert!((drift.change_pct() - 100.0).abs() < 1e-9);
        // Sorted input would hide it: order matters, not the distribution.
        let steady = [10.0, 20.0, 5.0, 5.0, 5.0, 5.0, 10.0, 20.0];
        assert_eq!(Drift::of(&steady).map(|d| d.change_pct()), Some(0.0));
        assert_eq!(Drift::of(&[1.0, 2.0, 3.0]), None);
    }

    #[test]
    fn spread_of_odd_and_even_counts() {
        let s = Spread::of(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        let s = Spread::of(&[4.0, 1.0, 3.0, 2.0]).unwrap();
        assert_eq!((s.median, s.min, s.max), (2.5, 1.0, 4.0));
        assert_eq!(Spread::of(&[]), None);
        assert_eq!(Spread::of(&[f64::NAN]), None);
        assert_eq!(Spread::of(&[f64::NAN, 5.0]).unwrap().median, 5.0);
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
        let l = Latency::of(vec![5.0, 1.0, 3.0, 2.0, 4.0]).unwrap();
        assert_eq!((l.p50, l.p95, l.p99, l.max), (3.0, 5.0, 5.0, 5.0));
        assert_eq!(Latency::of(Vec::new()), None);
    }

    #[test]
    fn schedule_spreads_the_rate_over_transactions() {
        let s = Schedule::new(1000.0, 10, Duration::from_secs(2)).unwrap();
        assert_eq!(s.interval(), Duration::from_millis(10));
        assert_eq!(s.count(), 200);
        assert_eq!(s.due(0), Duration::ZERO);
        assert_eq!(s.due(150), Duration::from_millis(1500));
        assert!(Schedule::new(0.0, 10, Duration::from_secs(1)).is_none());
        assert!(Schedule::new(f64::NAN, 10, Duration::from_secs(1)).is_none());
        assert!(Schedule::new(10.0, 0, Duration::from_secs(1)).is_none());
    }

    #[test]
    fn split_interleaves_writers_and_keeps_the_total() {
        let s = Schedule::new(1000.0, 10, Duration::from_secs(1)).unwrap();
        let parts = s.split(3);
        assert_eq!(parts.iter().map(|(_, p)| p.count()).sum::<u64>(), 100);
        assert_eq!(parts[0].0, Duration::ZERO);
        assert_eq!(parts[1].0, Duration::from_millis(10));
        assert_eq!(parts[2].0, Duration::from_millis(20));
        assert!(
            parts
                .iter()
                .all(|(_, p)| p.interval() == Duration::from_millis(30))
        );
        assert_eq!(s.split(0).len(), 1);
    }

    #[test]
    fn float_conversions_saturate() {
        assert_eq!(truncate_u64(2.9), 2);
        assert_eq!(truncate_u64(-1.0), 0);
        assert_eq!(truncate_u64(f64::NAN), 0);
        assert_eq!(truncate_u64(1e30), u64::MAX);
        assert_eq!(count_f64(1 << 53), 9_007_199_254_740_992.0);
        assert_eq!(signed_f64(-5), -5.0);
    }

    #[test]
    fn rate_per_second() {
        assert_eq!(rate(500, Duration::from_millis(250)), 2000.0);
        assert_eq!(rate(5, Duration::ZERO), 0.0);
    }
}
