//! What PostgreSQL must provide before the relay (or an operator command) can work,
//! as one typed error per missing piece (exit code 3).
//!
//! These are problems no retry can fix: an operator has to change the server or run
//! `outbox-relay migrate`. Each variant names the object and says what to do, so the
//! message is the whole diagnosis; tests and callers match the variant, never the
//! text. Connection failures the server explains with a SQLSTATE of this kind
//! (authentication, missing database, privileges, object in use) are
//! [`Prerequisite::Refused`], with the server's message kept.

/// The last column the migrations added to the poison table that every poison
/// insert writes (`0012`'s `source_slot`): a table without it is not upgraded
/// ([`Prerequisite::PoisonTableOutdated`]).
pub const POISON_TABLE_NEWEST_COLUMN: &str = "source_slot";

/// A PostgreSQL prerequisite that is not met.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Prerequisite {
    /// `wal_level` is not `logical`.
    #[error(
        "wal_level is '{actual}', logical replication needs wal_level = logical \
         (set it in postgresql.conf and restart PostgreSQL)"
    )]
    WalLevel { actual: String },
    /// `postgres.url` is a standby: the relay's writes (position, poison rows,
    /// heartbeats) cannot go there.
    #[error(
        "postgres.url is a standby (in recovery): the relay writes its position and poison rows \
         there, which a standby refuses. Set postgres.url to the primary, and postgres.slot_url \
         to this standby to decode there (PostgreSQL 16+)"
    )]
    WritesOnStandby,
    /// `postgres.slot_url` is a standby older than PostgreSQL 16, which cannot hold
    /// a logical slot.
    #[error(
        "postgres.slot_url is a standby of PostgreSQL {server_version}: logical decoding on a \
         standby needs PostgreSQL 16 or later. Upgrade it, or remove postgres.slot_url to decode \
         on the primary"
    )]
    StandbyTooOld { server_version: String },
    /// The outbox table does not exist.
    #[error("table {table} does not exist: run `outbox-relay migrate` (or set outbox.table)")]
    OutboxTableMissing { table: String },
    /// The poison side table does not exist.
    #[error("poison table {table} does not exist: run `outbox-relay migrate`")]
    PoisonTableMissing { table: String },
    /// The poison table predates migration 12 (no source columns, and maybe no
    /// occurrence key or text columns either): this relay's inserts would fail on it.
    #[error(
        "poison table {table} is not upgraded (column {column} missing): run `outbox-relay migrate`"
    )]
    PoisonTableOutdated { table: String, column: String },
    /// The publication does not exist.
    #[error(
        "publication {publication} does not exist: run `outbox-relay migrate` \
         (or CREATE PUBLICATION {publication} FOR TABLE {table} WITH (publish = 'insert'))"
    )]
    PublicationMissing { publication: String, table: String },
    /// The outbox table lacks columns the polling relay (or the cutover) needs.
    #[error(
        "outbox table {table} has no column {columns}: the polling relay needs them \
         (`outbox-relay migrate` creates them with a new table; on an existing one, add them \
         or name them in [outbox.columns]; sent_at timestamptz, attempts integer NOT NULL \
         DEFAULT 0 and last_error text are the poller's own)"
    )]
    PollerColumnsMissing { table: String, columns: String },
    /// The cutover's marker table does not exist (its migration has not run).
    #[error(
        "table {table} does not exist: run `outbox-relay migrate` (the cutover records its progress there)"
    )]
    CutoverTableMissing { table: String },
    /// `outbox-relay cutover` on a slot that was not created by a cutover.
    #[error(
        "replication slot {slot} already exists and no cutover is pending for it: the relay streams \
         from it, and publishing the unsent rows now could send events the stream delivered. \
         Nothing was done"
    )]
    SlotExistsWithoutCutover { slot: String },
    /// The server answered `CREATE_REPLICATION_SLOT` without a snapshot name.
    #[error("CREATE_REPLICATION_SLOT {slot} returned no exported snapshot")]
    NoExportedSnapshot { slot: String },
    /// `postgres.shards > 1` on a server without publication row filters.
    #[error(
        "postgres.shards needs PostgreSQL 15 or later (publication row filters); the server \
         is {server_version}: set postgres.shards = 1"
    )]
    ShardingUnsupported { server_version: String },
    /// A shard's publication was made for another sharding (shard count or id
    /// column), or not by `migrate`.
    #[error(
        "publication {publication} is marked {found:?}, but this config needs {wanted:?}: \
         the number of shards or the id column changed, or the publication was not made by \
         `outbox-relay migrate`. Nothing was changed; see \"Sharding\" in docs/operations.md \
         for how to change the number of shards"
    )]
    ShardPublicationMismatch {
        publication: String,
        found: String,
        wanted: String,
    },
    /// The publication exists but does not publish the outbox table.
    #[error(
        "publication {publication} does not include {table}: \
         ALTER PUBLICATION {publication} ADD TABLE {table}"
    )]
    PublicationLacksTable { publication: String, table: String },
    /// The publication does not publish an outbox table, and its slot exists: adding
    /// the table now would leave its earlier rows out of the stream.
    #[error(
        "publication {publication} does not include {table}, and slot {slot} exists: \
         added now, the table's rows committed so far would never be streamed. Serve \
         {table} with a relay of its own (its own postgres.slot and postgres.publication), \
         or list it when the slot is created (docs/configuration.md#adding-an-outbox-later)"
    )]
    PublicationLacksTableUnderSlot {
        publication: String,
        table: String,
        slot: String,
    },
    /// `CREATE_REPLICATION_SLOT` was refused (no free slot, no privilege, …).
    #[error("cannot create replication slot {slot}: {reason}")]
    SlotNotCreated { slot: String, reason: String },
    /// Another process streams from the slot and did not let go in time.
    #[error(
        "replication slot {slot} is active (pid {pid}): another relay is streaming \
         from it; waited {waited_secs}s"
    )]
    SlotBusy {
        slot: String,
        pid: i32,
        waited_secs: u64,
    },
    /// The slot is not a `pgoutput` logical slot.
    #[error(
        "replication slot {slot} uses plugin {plugin:?}, not pgoutput (or is not a logical slot)"
    )]
    SlotPlugin { slot: String, plugin: String },
    /// The slot belongs to another database.
    #[error("replication slot {slot} belongs to database {database:?}, not {current:?}")]
    SlotDatabase {
        slot: String,
        database: String,
        current: String,
    },
    /// The slot was invalidated: the WAL it needed is gone.
    #[error(
        "replication slot {slot} was invalidated (wal_status = lost: the WAL it needed was \
         removed, see max_slot_wal_keep_size). Events committed while it was lost may not \
         have been relayed: drop the slot, run the poller or a cutover to catch up, then \
         start again"
    )]
    SlotInvalidated { slot: String },
    /// The relay's position table does not exist, or predates migration 0010.
    #[error(
        "table {table} does not exist or lacks the columns of migration 0010: run \
         `outbox-relay migrate` (the relay records there how far it has delivered, so that \
         a PostgreSQL restart or a lost slot loses nothing and re-sends little)"
    )]
    PositionTableMissing { table: String },
    /// `relay.on_poison = "park-key"` and the parked-key table is missing.
    #[error(
        "table {table} does not exist and relay.on_poison = \"park-key\" needs it: run \
         `outbox-relay migrate`"
    )]
    ParkedKeyTableMissing { table: String },
    /// The slot the relay recorded progress for is lost and `relay.on_slot_loss` is
    /// `fail`.
    #[error(
        "{detail}. relay.on_slot_loss = \"fail\": nothing was done. Set it to \"resync\" to \
         publish the rows committed since the relay's recorded position and stream again \
         (or delete the slot's row in outbox_relay_position to start afresh, which skips \
         those rows)"
    )]
    SlotLost { detail: String },
    /// The slot is lost, `relay.on_slot_loss` is `resync`, and the outbox lacks the
    /// columns a resync marks rows with (an adopted layout): nothing was done.
    #[error(
        "{detail}, and it cannot be resynced: outbox table {table} has no column {columns} \
         (a resync marks the rows it republishes, as a poller does). Nothing was done. Either \
         add them (ALTER TABLE {table} ADD COLUMN IF NOT EXISTS sent_at timestamptz, ADD COLUMN \
         IF NOT EXISTS attempts integer NOT NULL DEFAULT 0, ADD COLUMN IF NOT EXISTS last_error \
         text: no rewrite) and start again, which publishes the rows committed since the \
         recorded position; or delete the slot's row in outbox_relay_position and start again, \
         which creates a new slot and skips those rows (find them with `outbox-relay audit`)"
    )]
    ResyncImpossible {
        detail: String,
        table: String,
        columns: String,
    },
    /// No PostgreSQL server could be started on this machine (the demo's throwaway
    /// cluster).
    #[error(
        "could not start a throwaway PostgreSQL: {reason}\n(install the PostgreSQL server, \
         e.g. `apt-get install postgresql`, so that pg_ctl and initdb are on PATH or in \
         /usr/lib/postgresql/*/bin)"
    )]
    NoLocalServer { reason: String },
    /// The server refused the connection or a command for a reason only an operator
    /// can fix: authentication (SQLSTATE class 28), TLS, a missing database (3D000),
    /// privileges (42501), an object in use (55006) or in the wrong state (55000), an
    /// undefined object (42704).
    #[error("{context}{message}")]
    Refused {
        /// What was being done, e.g. "cannot connect to PostgreSQL at …: ".
        context: String,
        /// The server's (or the TLS layer's) explanation.
        message: String,
        /// The SQLSTATE, when the server sent one.
        sqlstate: Option<String>,
    },
}

impl Prerequisite {
    /// Whether the server refused us for lack of a privilege (SQLSTATE 42501) or
    /// failed authentication (class 28).
    #[must_use]
    pub fn is_permission_denied(&self) -> bool {
        matches!(self, Prerequisite::Refused { sqlstate: Some(code), .. }
            if code == "42501" || code.starts_with("28"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_object_and_the_fix() {
        let missing = Prerequisite::PublicationMissing {
            publication: "outbox_pub".into(),
            table: "public.outbox".into(),
        };
        assert_eq!(
            missing.to_string(),
            "publication outbox_pub does not exist: run `outbox-relay migrate` \
             (or CREATE PUBLICATION outbox_pub FOR TABLE public.outbox WITH (publish = 'insert'))"
        );
        let busy = Prerequisite::SlotBusy {
            slot: "s".into(),
            pid: 42,
            waited_secs: 30,
        };
        assert!(busy.to_string().contains("active (pid 42)"));
    }

    #[test]
    fn permission_denied_is_told_by_sqlstate() {
        let refused = |code: &str| Prerequisite::Refused {
            context: String::new(),
            message: "no".into(),
            sqlstate: Some(code.into()),
        };
        assert!(refused("42501").is_permission_denied());
        assert!(refused("28P01").is_permission_denied());
        assert!(!refused("3D000").is_permission_denied());
    }
}
