//! Progress of long commands (`audit`, `replay`, `demo`) on stderr: a bar redrawn
//! in place on a terminal, plain lines every few percent otherwise (CI logs,
//! `journald`, pipes), nothing for small totals. stdout stays free for the
//! command's result (tables, JSON).
//!
//! The terminal bar is `indicatif`'s (as `bench` uses): it handles terminal width,
//! redraw rate and clearing. The plain-line mode — the one CI logs and services see —
//! is ours, so its lines stay greppable (`audit: outbox rows 150000/300000 (50%, …)`).

use std::io::{IsTerminal, Write as _};
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};

/// Below this many rows `audit` shows no progress: they finish before a bar helps.
pub(crate) const MIN_TOTAL: u64 = 50_000;

/// A progress bar on a terminal, plain lines every few percent otherwise; silent
/// for small totals.
#[derive(Debug)]
pub(crate) struct Meter {
    /// The command, printed first (`audit: …`).
    command: &'static str,
    what: String,
    total: u64,
    done: u64,
    /// `done` at the last plain line.
    printed: u64,
    enabled: bool,
    tty: bool,
    step: u64,
    next_line: u64,
    started: Instant,
    /// The terminal bar, made at the first update.
    bar: Option<ProgressBar>,
}

impl Meter {
    /// A meter for `total` units of `what`; `enabled = false` keeps it silent
    /// (callers pass e.g. `total >= MIN_TOTAL`).
    #[must_use]
    pub(crate) fn new(
        command: &'static str,
        what: impl Into<String>,
        total: u64,
        enabled: bool,
    ) -> Meter {
        let now = Instant::now();
        // A plain line every 5 %.
        let step = (total / 20).max(1);
        Meter {
            command,
            what: what.into(),
            total,
            done: 0,
            printed: 0,
            enabled,
            tty: std::io::stderr().is_terminal(),
            step,
            next_line: step,
            started: now,
            bar: None,
        }
    }

    /// Counts the rate from `started` (work that began before the meter existed).
    #[must_use]
    #[cfg(feature = "tools")]
    pub(crate) fn started_at(mut self, started: Instant) -> Meter {
        self.started = started;
        self
    }

    /// Adds `n` units done.
    pub(crate) fn inc(&mut self, n: u64) {
        self.done += n;
        if !self.enabled {
            return;
        }
        if self.tty {
            self.draw_bar();
        } else if self.done >= self.next_line {
            self.print_line();
            while self.next_line <= self.done {
                self.next_line += self.step;
            }
        }
    }

    /// Draws the final state (a no-op when silent).
    pub(crate) fn finish(&mut self) {
        if !self.enabled {
            return;
        }
        if self.tty {
            self.draw_bar();
            if let Some(bar) = &self.bar {
                bar.finish();
            }
        } else if self.printed != self.done {
            self.print_line();
        }
        self.enabled = false;
    }

    // `u64 -> f64` rounds only above 2^53 units, and the rate is printed without
    // decimals: the rounding can never show.
    #[allow(clippy::cast_precision_loss)]
    fn rate(&self) -> f64 {
        let secs = self.started.elapsed().as_secs_f64();
        if secs > 0.0 {
            self.done as f64 / secs
        } else {
            0.0
        }
    }

    /// The total, or what was done when the estimate was short (a topic's end
    /// offsets are an estimate).
    fn shown_total(&self) -> u64 {
        self.total.max(self.done)
    }

    fn percent(&self) -> u64 {
        (self.done * 100)
            .checked_div(self.shown_total())
            .unwrap_or(100)
    }

    fn draw_bar(&mut self) {
        let bar = self.bar.get_or_insert_with(|| {
            let bar = ProgressBar::new(self.total).with_elapsed(self.started.elapsed());
            let template = format!(
                "{}: {} [{{bar:30}}] {{percent:>3}}% {{pos}}/{{len}} ({{elapsed}})",
                self.command, self.what
            );
            if let Ok(style) = ProgressStyle::with_template(&template) {
                bar.set_style(style.progress_chars("#> "));
            }
            bar
        });
        // indicatif rate-limits the redraws itself.
        bar.set_length(self.total.max(self.done));
        bar.set_position(self.done);
    }

    fn print_line(&mut self) {
        let _ = writeln!(
            std::io::stderr(),
            "{}: {} {}/{} ({}%, {:.0}/s)",
            self.command,
            self.what,
            self.done,
            self.shown_total(),
            self.percent(),
            self.rate()
        );
        self.printed = self.done;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn total_grows_when_the_estimate_was_short() {
        let mut p = Meter::new("audit", "x", 10, false);
        assert!(!p.enabled);
        p.inc(5);
        assert_eq!((p.percent(), p.shown_total()), (50, 10));
        p.inc(10);
        assert_eq!((p.percent(), p.shown_total()), (100, 15));
        assert_eq!(Meter::new("audit", "y", 0, false).percent(), 100);
        assert!(Meter::new("audit", "z", 1, true).enabled);
    }
}
