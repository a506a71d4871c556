//! What a run shows and how it is stopped: progress on stderr (a bar on a
//! terminal, plain lines in a log), and Ctrl-C, which must still let the run drop
//! its slot (a forgotten slot pins WAL forever).

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

use super::error::{BenchError, Result};

/// Progress on stderr: a bar on a terminal, plain lines otherwise.
#[derive(Debug)]
pub(crate) struct Progress {
    bar: Option<ProgressBar>,
}

impl Progress {
    pub(crate) fn new(total: u64) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(total);
            if let Ok(style) =
                ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
            {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        Progress { bar }
    }

    /// Announces the next step.
    pub(crate) fn step(&self, message: String) {
        match &self.bar {
            Some(bar) => bar.set_message(message),
            None => eprintln!("bench: {message}"),
        }
    }

    /// One run is done.
    pub(crate) fn done(&self, message: &str) {
        match &self.bar {
            Some(bar) => {
                bar.inc(1);
                bar.println(format!("bench: {message}"));
            }
            None => eprintln!("bench: {message}"),
        }
    }

    pub(crate) fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// Runs `work` unless Ctrl-C comes first, so that the caller can still drop the
/// run's slot (a forgotten slot pins WAL). Child processes die with the dropped
/// future (`kill_on_drop`).
pub(crate) async fn until_interrupted<T>(
    work: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    tokio::select! {
        result = work => result,
        _ = tokio::signal::ctrl_c() => Err(BenchError::Interrupted),
    }
}
