//! Who spent the CPU of a steady point: PostgreSQL (all its processes, the
//! walsenders apart), the relay, the broker, and the bench itself (writers'
//! client side and consumer); and `--pin`, which puts the database on some cores
//! and everything else on the others, as in production, where only the walsender
//! runs beside the database.
//!
//! # Counting every PostgreSQL process
//!
//! A point's writers connect, write and disconnect: their backends exit before the
//! point ends. Linux adds the CPU of a child that exited and was waited for to its
//! parent's `cutime`/`cstime` (`/proc/<pid>/stat` fields 16–17), and the postmaster
//! waits for every backend. So the database's CPU over a point is the change of
//! the postmaster's own and children's times, plus the change of each child alive
//! at the end (from zero for one that started meanwhile), minus what the children
//! that exited had used before the point (their times moved into `cutime` whole).
//!
//! # Pinning
//!
//! `taskset -a -p -c CPUS PID` for the postmaster and each of its children: a
//! backend started later inherits the postmaster's affinity. The bench pins itself
//! (its relay children inherit it) and the broker, found as the process listening
//! on the configured broker port. Everything is given all cores back at the end.

use std::collections::HashMap;
use std::process::Command;
use std::time::Duration;

use tokio_postgres::Client;

use super::error::{BenchError, Result};
use super::usage::USER_HZ;

/// The fields of `/proc/<pid>/stat` a snapshot needs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Stat {
    ppid: u32,
    /// utime + stime, in ticks.
    own: u64,
    /// cutime + cstime, in ticks.
    children: u64,
}

/// Parses `/proc/<pid>/stat` (the command name may hold spaces and parentheses:
/// the fields start after the last `)`).
fn parse_stat(text: &str) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // f[0] is field 3 (state): field n is f[n - 3].
    let num = |n: usize| f.get(n - 3)?.parse::<u64>().ok();
    Some(Stat {
        ppid: u32::try_from(num(4)?).ok()?,
        own: num(14)? + num(15)?,
        children: num(16)? + num(17)?,
    })
}

fn read_stat(pid: u32) -> Option<Stat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

fn ticks(t: u64) -> Duration {
    #[allow(clippy::cast_precision_loss)]
    Duration::from_secs_f64(t as f64 / USER_HZ)
}

/// Every process id on this machine.
fn all_pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|dir| {
            dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The PostgreSQL server behind `client`: its postmaster's pid (the parent of the
/// client's backend), when it runs on this machine.
pub(crate) async fn postmaster(client: &Client) -> Option<u32> {
    let backend: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .ok()?
        .get(0);
    read_stat(u32::try_from(backend).ok()?).map(|s| s.ppid)
}

/// The postmaster's and its children's CPU at one instant.
#[derive(Debug, Clone, Default)]
pub(crate) struct DbSnapshot {
    postmaster: Stat,
    children: HashMap<u32, u64>,
}

impl DbSnapshot {
    pub(crate) fn take(postmaster: u32) -> Option<DbSnapshot> {
        let main = read_stat(postmaster)?;
        let children = all_pids()
            .into_iter()
            .filter_map(|pid| {
                let s = read_stat(pid)?;
                (s.ppid == postmaster).then_some((pid, s.own))
            })
            .collect();
        Some(DbSnapshot {
            postmaster: main,
            children,
        })
    }

    /// The database's CPU from `self` to `later` (module docs).
    pub(crate) fn until(&self, later: &DbSnapshot) -> Duration {
        let main = (later.postmaster.own + later.postmaster.children)
            .saturating_sub(self.postmaster.own + self.postmaster.children);
        let alive: u64 = later
            .children
            .iter()
            .map(|(pid, now)| now.saturating_sub(self.children.get(pid).copied().unwrap_or(0)))
            .sum();
        let exited_before: u64 = self
            .children
            .iter()
            .filter(|(pid, _)| !later.children.contains_key(pid))
            .map(|(_, before)| *before)
            .sum();
        ticks((main + alive).saturating_sub(exited_before))
    }

    /// The current children (to pin them).
    fn pids(&self) -> impl Iterator<Item = u32> + '_ {
        self.children.keys().copied()
    }
}

/// One process's utime + stime now.
pub(crate) fn process_cpu(pid: u32) -> Option<Duration> {
    read_stat(pid).map(|s| ticks(s.own))
}

/// How often a process's threads went to sleep waiting (their voluntary context
/// switches, summed over `/proc/<pid>/task/*/status`): each is one wake-up later.
/// Threads that ended are not counted; the relay's and the walsender's live as long
/// as the point.
pub(crate) fn wakeups(pid: u32) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut total = 0;
    for task in tasks.flatten() {
        let Ok(status) = std::fs::read_to_string(task.path().join("status")) else {
            continue;
        };
        total += voluntary_switches(&status).unwrap_or(0);
    }
    Some(total)
}

/// `voluntary_ctxt_switches` of a `/proc/<pid>/status` text.
fn voluntary_switches(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|line| line.strip_prefix("voluntary_ctxt_switches:"))
        .and_then(|n| n.trim().parse().ok())
}

/// The process listening on TCP `port` on this machine (the broker), found through
/// `/proc/net/tcp{,6}` and the processes' socket descriptors.
pub(crate) fn listening_on(port: u16) -> Option<u32> {
    let inodes: Vec<String> = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|path| std::fs::read_to_string(path).ok())
        .flat_map(|text| listening_inodes(&text, port))
        .collect();
    if inodes.is_empty() {
        return None;
    }
    all_pids().into_iter().find(|pid| {
        std::fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|fds| {
            fds.filter_map(std::result::Result::ok).any(|fd| {
                std::fs::read_link(fd.path()).is_ok_and(|target| {
                    let target = target.to_string_lossy();
                    inodes
                        .iter()
                        .any(|inode| target == format!("socket:[{inode}]"))
                })
            })
        })
    })
}

/// Inodes of the sockets listening (state `0A`) on `port` in a `/proc/net/tcp` table.
fn listening_inodes(table: &str, port: u16) -> Vec<String> {
    let want = format!("{port:04X}");
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let local_port = f.get(1)?.rsplit(':').next()?;
            let inode = *f.get(9)?;
            (local_port == want && *f.get(3)? == "0A").then(|| inode.to_owned())
        })
        .collect()
}

/// `--pin DB:REST`: the cores of the database, and of everything else.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pin {
    pub db: String,
    pub rest: String,
}

impl std::str::FromStr for Pin {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Pin, String> {
        let (db, rest) = s
            .split_once(':')
            .ok_or_else(|| format!("{s:?} is not DB_CPUS:REST_CPUS (e.g. 0:1)"))?;
        let valid = |c: &str| {
            !c.is_empty()
                && c.chars()
                    .all(|ch| ch.is_ascii_digit() || ch == ',' || ch == '-')
        };
        if !valid(db) || !valid(rest) {
            return Err(format!(
                "{s:?}: each side is a taskset CPU list (e.g. 0, 0-1, 0,2)"
            ));
        }
        Ok(Pin {
            db: db.to_owned(),
            rest: rest.to_owned(),
        })
    }
}

/// What `--pin` changed, to give every core back ([`Pinned::release`]).
#[derive(Debug)]
pub(crate) struct Pinned {
    postmaster: u32,
    broker: Option<u32>,
    /// A standby's postmaster (`--standby-url`), pinned with the rest.
    standby: Option<u32>,
    all: String,
}

/// Pins the database (postmaster and children) to `pin.db`, this process, the
/// broker and a standby's server (postmaster and children) to `pin.rest`.
///
/// # Errors
///
/// [`BenchError::Pin`] when `taskset` is missing or refuses.
pub(crate) fn pin(
    pin: &Pin,
    postmaster: u32,
    broker: Option<u32>,
    standby: Option<u32>,
) -> Result<Pinned> {
    pin_tree(&pin.db, postmaster)?;
    taskset(&pin.rest, std::process::id())?;
    if let Some(broker) = broker {
        taskset(&pin.rest, broker)?;
    }
    if let Some(standby) = standby {
        pin_tree(&pin.rest, standby)?;
    }
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    Ok(Pinned {
        postmaster,
        broker,
        standby,
        all: format!("0-{}", cores.saturating_sub(1)),
    })
}

/// A postmaster and its children to `cpus` (later children inherit it).
fn pin_tree(cpus: &str, postmaster: u32) -> Result<()> {
    let snapshot = DbSnapshot::take(postmaster).unwrap_or_default();
    taskset(cpus, postmaster)?;
    for pid in snapshot.pids() {
        // A backend that exited meanwhile is no error.
        let _ = taskset(cpus, pid);
    }
    Ok(())
}

impl Pinned {
    /// Gives every pinned process all cores again (best effort).
    pub(crate) fn release(self) {
        for postmaster in std::iter::once(self.postmaster).chain(self.standby) {
            let _ = pin_tree(&self.all, postmaster);
        }
        let _ = taskset(&self.all, std::process::id());
        if let Some(broker) = self.broker {
            let _ = taskset(&self.all, broker);
        }
    }
}

fn taskset(cpus: &str, pid: u32) -> Result<()> {
    let out = Command::new("taskset")
        .args(["-a", "-p", "-c", cpus, &pid.to_string()])
        .output()
        .map_err(|e| BenchError::Pin(format!("taskset: {e} (install util-linux)")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(BenchError::Pin(format!(
            "taskset -a -p -c {cpus} {pid}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_after_the_command_name() {
        let text = "4242 (postgres: walsender (x)) S 17 4242 4242 0 -1 4194560 100 0 0 0 \
                    250 50 30 20 20 0 1 0 100 1000 10";
        assert_eq!(
            parse_stat(text),
            Some(Stat {
                ppid: 17,
                own: 300,
                children: 50
            })
        );
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn database_cpu_counts_exited_backends_once() {
        let stat = |own, children| Stat {
            ppid: 1,
            own,
            children,
        };
        let before = DbSnapshot {
            postmaster: stat(10, 100),
            // 7 exits during the point (it had used 40 before), 8 lives on.
            children: HashMap::from([(7, 40), (8, 5)]),
        };
        let after = DbSnapshot {
            // 7's 60 ticks and a short-lived backend's 30 were reaped.
            postmaster: stat(12, 190),
            // 8 used 10 more, 9 started and used 25.
            children: HashMap::from([(8, 15), (9, 25)]),
        };
        // postmaster 2 + reaped 90 − 7's earlier 40 + 8's 10 + 9's 25 = 87 ticks.
        assert_eq!(before.until(&after), ticks(87));
    }

    #[test]
    fn voluntary_switches_are_read_from_the_status_text() {
        let status =
            "Name:\tpostgres\nvoluntary_ctxt_switches:\t1234\nnonvoluntary_ctxt_switches:\t56\n";
        assert_eq!(voluntary_switches(status), Some(1234));
        assert_eq!(voluntary_switches("Name:\tx\n"), None);
        let own = wakeups(std::process::id()).expect("this process's tasks");
        std::thread::sleep(std::time::Duration::from_millis(5));
        assert!(wakeups(std::process::id()).expect("again") > own);
    }

    #[test]
    fn listening_sockets_by_port() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0100007F:4A85 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 123456 1 0 100 0 0 10 0\n\
   1: 0100007F:4A85 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 654321 1 0 20 4 30 10 -1\n";
        assert_eq!(listening_inodes(table, 19077), vec!["123456".to_owned()]);
        assert!(listening_inodes(table, 19093).is_empty());
    }

    #[test]
    fn pin_takes_two_cpu_lists() {
        assert_eq!(
            "0:1".parse(),
            Ok(Pin {
                db: "0".into(),
                rest: "1".into()
            })
        );
        assert!("0-1:2,3".parse::<Pin>().is_ok());
        assert!("0".parse::<Pin>().is_err());
        assert!("a:1".parse::<Pin>().is_err());
    }
}
