//! CPU time and peak memory of a process, read from Linux's `/proc`.
//!
//! The benchmark charges each mode with the CPU its relay process used while
//! draining (user + system, all threads: `/proc/<pid>/stat` fields 14 and 15) and
//! its peak resident set (`VmHWM` in `/proc/<pid>/status`). Child processes are
//! sampled while they run and once more right before they are stopped, so the
//! shutdown is not counted. In-process modes read `/proc/self` before and after, and
//! reset the peak first (`5` written to `/proc/self/clear_refs`), so one mode's peak
//! is not another's. Off Linux the figures are simply absent.
//!
//! It also counts the process's read and write system calls (`syscr` + `syscw` in
//! `/proc/<pid>/io`, all threads): per event, they show how finely the work was cut —
//! a relay that reads the replication socket in small pieces and produces small
//! batches makes more of them for the same events, and pays for it in CPU.

use std::time::Duration;

/// `USER_HZ`, the unit of the times in `/proc/<pid>/stat`: fixed at 100 by the Linux
/// ABI on every architecture this binary builds for (`sysconf(_SC_CLK_TCK)`).
pub(super) const USER_HZ: f64 = 100.0;

/// One reading of a process's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Usage {
    /// User + system CPU time so far.
    pub(crate) cpu: Duration,
    /// Peak resident set size so far, in KiB (`VmHWM`).
    pub(crate) peak_rss_kib: u64,
    /// Read and write system calls so far (`syscr` + `syscw`); 0 when unreadable.
    pub(crate) io_calls: u64,
}

impl Usage {
    /// Reads `/proc/<pid>` (`"self"` for this process); `None` when it is gone or
    /// unreadable.
    #[must_use]
    pub(crate) fn read(pid: &str) -> Option<Usage> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let io = std::fs::read_to_string(format!("/proc/{pid}/io")).unwrap_or_default();
        Some(Usage {
            cpu: cpu_from_stat(&stat)?,
            peak_rss_kib: peak_from_status(&status).unwrap_or(0),
            io_calls: io_calls_from_io(&io).unwrap_or(0),
        })
    }

    /// A newer reading of the same process, keeping the highest peak seen. A child
    /// that has exited but is not yet reaped (a zombie) still has its CPU times in
    /// `/proc/<pid>/stat`, but its `status` no longer has a `VmHWM` line, so its
    /// reading says 0 KiB: that must not replace the peak sampled while it ran.
    #[must_use]
    pub(crate) fn then(self, newer: Usage) -> Usage {
        Usage {
            cpu: self.cpu.max(newer.cpu),
            peak_rss_kib: self.peak_rss_kib.max(newer.peak_rss_kib),
            io_calls: self.io_calls.max(newer.io_calls),
        }
    }

    /// This process.
    #[must_use]
    pub(crate) fn of_self() -> Option<Usage> {
        Usage::read("self")
    }

    /// Resets this process's peak RSS to its current RSS, so the next reading shows
    /// the peak from now on. Best effort (needs Linux ≥ 4.0).
    pub(crate) fn reset_self_peak() {
        let _ = std::fs::write("/proc/self/clear_refs", "5");
    }
}

/// Utime + stime from the text of `/proc/<pid>/stat`. The command name (field 2)
/// may contain spaces and parentheses, so fields are counted after the last `)`.
fn cpu_from_stat(stat: &str) -> Option<Duration> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the command: state is field 3, utime field 14, stime field 15.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(Duration::from_secs_f64(
        super::stats::count_f64(utime + stime) / USER_HZ,
    ))
}

/// `syscr` + `syscw` from the text of `/proc/<pid>/io`.
fn io_calls_from_io(io: &str) -> Option<u64> {
    let field = |name: &str| -> Option<u64> {
        io.lines()
            .find_map(|l| l.strip_prefix(name))?
            .trim()
            .parse()
            .ok()
    };
    Some(field("syscr:")? + field("syscw:")?)
}

/// `VmHWM` in KiB from the text of `/proc/<pid>/status`.
fn peak_from_status(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zombie_reading_keeps_the_peak_seen_while_running() {
        let running = Usage {
            cpu: Duration::from_millis(300),
            peak_rss_kib: 12_288,
            io_calls: 500,
        };
        let zombie = Usage {
            cpu: Duration::from_millis(320),
            peak_rss_kib: 0,
            io_calls: 0,
        };
        assert_eq!(
            running.then(zombie),
            Usage {
                cpu: Duration::from_millis(320),
                peak_rss_kib: 12_288,
                io_calls: 500,
            }
        );
    }

    #[test]
    fn parses_stat_with_a_tricky_command_name() {
        let stat = "1234 (out) box (relay)) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 9 0 100 0 0";
        assert_eq!(cpu_from_stat(stat), Some(Duration::from_secs(3)));
        assert_eq!(cpu_from_stat("garbage"), None);
        assert_eq!(cpu_from_stat("1 (x) S 1"), None);
    }

    #[test]
    fn parses_io_calls() {
        let io = "rchar: 10\nwchar: 20\nsyscr: 7\nsyscw: 5\nread_bytes: 0\n";
        assert_eq!(io_calls_from_io(io), Some(12));
        assert_eq!(io_calls_from_io("rchar: 1\n"), None);
    }

    #[test]
    fn parses_vmhwm() {
        let status =
            "Name:\toutbox-relay\nVmPeak:\t  100 kB\nVmHWM:\t   20480 kB\nVmRSS:\t 10 kB\n";
        assert_eq!(peak_from_status(status), Some(20480));
        assert_eq!(peak_from_status("Name: x\n"), None);
    }

    #[test]
    fn reads_this_process_on_linux() {
        if cfg!(target_os = "linux") {
            let usage = Usage::of_self().unwrap();
            assert!(usage.peak_rss_kib > 0);
        }
    }
}
