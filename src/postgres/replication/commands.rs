//! The replication commands the relay sends, and their answers.
//!
//! A `replication=database` walsender understands a small command grammar next to
//! SQL (<https://www.postgresql.org/docs/current/protocol-replication.html>):
//! `IDENTIFY_SYSTEM`, `TIMELINE_HISTORY`, `CREATE_REPLICATION_SLOT`,
//! `DROP_REPLICATION_SLOT` and `START_REPLICATION`. Names are double-quoted identifiers and plugin option values
//! single-quoted literals, with the quote doubled inside; backslashes are not special.
//! The slot name and options come from configuration, so a name with a quote must
//! round-trip and a NUL byte (which would end the query string) is refused before
//! anything is sent.
//!
//! `CREATE_REPLICATION_SLOT` changed syntax in PostgreSQL 15: the option list
//! `(SNAPSHOT 'nothing')` replaced the keywords (`NOEXPORT_SNAPSHOT`), and the old
//! keywords are gone from newer servers, so [`create_slot_command`] picks the
//! spelling by the server's major version.
//!
//! From PostgreSQL 17 on, a permanent slot is created with `FAILOVER true`: a
//! standby with `sync_replication_slots = on` keeps a copy of it, so the relay
//! resumes from the slot on a promoted standby instead of losing it. Without that
//! setting on any standby the option changes nothing. A temporary slot cannot be a
//! failover slot (the server refuses the option), and older servers do not know it.
//!
//! The answers come back as one text row of the simple query protocol; the helpers
//! here check the row's shape and parse its fields, a malformed answer being a
//! [`ReplicationError::Protocol`].

use crate::config::quote_ident;
use crate::lsn::Lsn;

use super::error::ReplicationError;

/// Where one ancestor timeline of the server's current one ended: a line of the
/// timeline history file `TIMELINE_HISTORY` returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimelineSwitch {
    /// The ancestor timeline.
    pub timeline: u32,
    /// The WAL position at which it ended and its child timeline began: WAL past it
    /// on the ancestor is not on the server's history.
    pub switchpoint: Lsn,
}

/// Parses a timeline history file: one line per ancestor, `parentTLI`, the switch
/// point as `X/X` and a free-text reason, separated by tabs; blank lines and lines
/// starting with `#` are skipped (as `readTimeLineHistory` in PostgreSQL's
/// `timeline.c` does).
///
/// # Errors
///
/// [`ReplicationError::Protocol`] for a line that is not of that shape.
pub fn parse_timeline_history(content: &str) -> Result<Vec<TimelineSwitch>, ReplicationError> {
    let mut switches = Vec::new();
    for line in content.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut fields = line.split_whitespace();
        let bad =
            || ReplicationError::Protocol(format!("malformed timeline history line {line:?}"));
        let timeline = fields.next().and_then(|f| f.parse().ok()).ok_or_else(bad)?;
        let switchpoint = fields.next().and_then(|f| f.parse().ok()).ok_or_else(bad)?;
        switches.push(TimelineSwitch {
            timeline,
            switchpoint,
        });
    }
    Ok(switches)
}

/// The output plugin the relay decodes.
pub(crate) const OUTPUT_PLUGIN: &str = "pgoutput";

/// The answer to `IDENTIFY_SYSTEM`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SystemIdentity {
    /// The cluster's unique system identifier.
    pub systemid: u64,
    /// The current timeline.
    pub timeline: u32,
    /// The current WAL flush position.
    pub xlogpos: Lsn,
    /// The database this walsender is connected to.
    pub dbname: Option<String>,
}

/// What `CREATE_REPLICATION_SLOT` does with the snapshot at the slot's consistent point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotAction {
    /// Export it (valid until the next command on this connection); its name is
    /// returned in [`CreatedSlot::snapshot_name`].
    Export,
    /// Do not export it: the relay only needs changes from the consistent point on.
    NoExport,
    /// Use it in the current transaction of this connection (which must have run
    /// `BEGIN ISOLATION LEVEL REPEATABLE READ` first).
    Use,
}

/// The answer to `CREATE_REPLICATION_SLOT … LOGICAL`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreatedSlot {
    /// The slot's name.
    pub slot_name: String,
    /// Decoding starts here: the first transaction streamed commits after it.
    pub consistent_point: Lsn,
    /// The exported snapshot, with [`SnapshotAction::Export`].
    pub snapshot_name: Option<String>,
    /// The output plugin.
    pub output_plugin: Option<String>,
}

/// A rows-as-text result of the simple query protocol.
pub type TextRows = Vec<Vec<Option<String>>>;

/// `'value'` with embedded quotes doubled. Backslashes are not special in the
/// replication grammar (nor in SQL with `standard_conforming_strings`).
#[must_use]
pub(crate) fn quote_literal(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

/// `publication_names` value: each name as a quoted identifier, comma-separated
/// (pgoutput splits it with `SplitIdentifierString`).
#[must_use]
pub(crate) fn publication_names_option(names: &[&str]) -> String {
    names
        .iter()
        .map(|n| quote_ident(n))
        .collect::<Vec<_>>()
        .join(",")
}

/// The first server major version with failover slots (`FAILOVER` in
/// `CREATE_REPLICATION_SLOT`, `sync_replication_slots` on standbys).
const FAILOVER_SLOTS_SINCE: u32 = 17;

/// Whether a slot created on a server of `server_major` is a failover slot: a
/// permanent slot on PostgreSQL 17 or later. An unknown version gets no
/// `FAILOVER` (a 15 or 16 server would refuse the option).
#[must_use]
pub(crate) fn creates_failover_slot(
    temporary: bool,
    server_major: Option<u32>,
    on_standby: bool,
) -> bool {
    !temporary && !on_standby && server_major.is_some_and(|v| v >= FAILOVER_SLOTS_SINCE)
}

/// The `CREATE_REPLICATION_SLOT` command for a server major version (`None`:
/// assume a current server, without failover). A permanent slot on PostgreSQL 17
/// or later is a failover slot (`FAILOVER true`), except on a standby
/// (`on_standby`), where PostgreSQL refuses one: "cannot enable failover for a
/// replication slot created on the standby" (`slot.c`); such a slot cannot be
/// synced anyway, and a promotion of that standby keeps it.
#[must_use]
pub fn create_slot_command(
    name: &str,
    temporary: bool,
    snapshot: SnapshotAction,
    server_major: Option<u32>,
    on_standby: bool,
) -> String {
    let mut command = format!("CREATE_REPLICATION_SLOT {}", quote_ident(name));
    if temporary {
        command.push_str(" TEMPORARY");
    }
    command.push_str(" LOGICAL ");
    command.push_str(OUTPUT_PLUGIN);
    if server_major.is_none_or(|v| v >= 15) {
        command.push_str(match snapshot {
            SnapshotAction::Export => " (SNAPSHOT 'export'",
            SnapshotAction::NoExport => " (SNAPSHOT 'nothing'",
            SnapshotAction::Use => " (SNAPSHOT 'use'",
        });
        if creates_failover_slot(temporary, server_major, on_standby) {
            command.push_str(", FAILOVER true");
        }
        command.push(')');
    } else {
        command.push_str(match snapshot {
            SnapshotAction::Export => " EXPORT_SNAPSHOT",
            SnapshotAction::NoExport => " NOEXPORT_SNAPSHOT",
            SnapshotAction::Use => " USE_SNAPSHOT",
        });
    }
    command
}

/// The `START_REPLICATION SLOT … LOGICAL` command.
#[must_use]
pub(crate) fn start_replication_command(
    slot: &str,
    start: Lsn,
    options: &[(&str, &str)],
) -> String {
    let mut command = format!(
        "START_REPLICATION SLOT {} LOGICAL {start}",
        quote_ident(slot)
    );
    if !options.is_empty() {
        let list = options
            .iter()
            .map(|(name, value)| format!("{} {}", quote_ident(name), quote_literal(value)))
            .collect::<Vec<_>>()
            .join(", ");
        command.push_str(" (");
        command.push_str(&list);
        command.push(')');
    }
    command
}

/// The major version from `server_version` ("15.4 (Debian …)" → 15, "9.6.3" → 9,
/// "17devel" → 17).
#[must_use]
pub(crate) fn parse_major_version(server_version: &str) -> Option<u32> {
    let digits: String = server_version
        .trim_start()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

pub(super) fn check_no_nul(what: &str, value: &str) -> Result<(), ReplicationError> {
    if value.contains('\0') {
        Err(ReplicationError::Config(format!(
            "{what} contains a NUL byte"
        )))
    } else {
        Ok(())
    }
}

pub(super) fn single_row<'a>(
    rows: &'a TextRows,
    command: &str,
    min_columns: usize,
) -> Result<&'a [Option<String>], ReplicationError> {
    match rows.as_slice() {
        [row] if row.len() >= min_columns => Ok(row),
        _ => Err(ReplicationError::Protocol(format!(
            "{command} returned {} rows (expected one with {min_columns} columns)",
            rows.len()
        ))),
    }
}

pub(super) fn required_field<'a>(
    row: &'a [Option<String>],
    index: usize,
    what: &str,
) -> Result<&'a str, ReplicationError> {
    row.get(index)
        .and_then(Option::as_deref)
        .ok_or_else(|| ReplicationError::Protocol(format!("{what} is missing")))
}

pub(super) fn parse_field<T: std::str::FromStr>(
    row: &[Option<String>],
    index: usize,
    what: &str,
) -> Result<T, ReplicationError> {
    let text = required_field(row, index, what)?;
    text.parse()
        .map_err(|_| ReplicationError::Protocol(format!("{what} {text:?} is not a number")))
}

pub(super) fn parse_lsn_field(
    row: &[Option<String>],
    index: usize,
    what: &str,
) -> Result<Lsn, ReplicationError> {
    let text = required_field(row, index, what)?;
    text.parse()
        .map_err(|e| ReplicationError::Protocol(format!("{what}: {e}")))
}
