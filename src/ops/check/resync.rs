//! `postgres.resync`: whether a lost slot can be healed on this outbox's layout.
//!
//! A resync (`crate::cdc::resync`) publishes the rows committed since the relay's
//! saved position from the outbox table itself, in an exported snapshot, and marks
//! them as a cutover does: it needs the poller's `sent_at`, `attempts` and
//! `last_error` columns. An adopted layout (the Debezium preset, say) often lacks
//! them; a lost slot then cannot be healed and `run` stops with exit code 3 before
//! touching anything. Said here rather than on the day the slot is lost, with the
//! two ways out. And even with the columns, a resync can only republish rows that
//! are still in the table: an application that deletes outbox rows right after
//! inserting them (a common Debezium habit) loses what happened while the slot was
//! gone, whatever the relay does.

use tokio_postgres::Client;

use super::Check;
use crate::config::{Config, SlotLossMode, quote_qualified};

const NAME: &str = "postgres.resync";

/// The columns a resync marks rows with (the poller's).
const RESYNC_COLUMNS: [&str; 3] = ["sent_at", "attempts", "last_error"];

/// `postgres.resync`.
pub(super) async fn check(client: &Client, config: &Config) -> Check {
    let outbox = quote_qualified(&config.outbox.table);
    let rows = match client
        .query(
            "SELECT attname::text FROM pg_attribute
              WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped",
            &[&outbox],
        )
        .await
    {
        Ok(rows) => rows,
        Err(e) => return Check::query_failed(NAME, "cannot read the outbox's columns", &e),
    };
    let columns: Vec<String> = rows.iter().filter_map(|r| r.try_get(0).ok()).collect();
    if columns.is_empty() {
        // The outbox is missing: the publication and migration checks say so.
        return Check::ok(NAME, "no outbox table to look at");
    }
    let missing: Vec<&str> = RESYNC_COLUMNS
        .into_iter()
        .filter(|c| !columns.iter().any(|have| have == c))
        .collect();
    // Without it, a resync reads the backlog by created_at (see cdc::backlog).
    let commit_timestamps = match commit_timestamps(client).await {
        Ok(on) => on,
        Err(e) => return Check::query_failed(NAME, "cannot read track_commit_timestamp", &e),
    };
    let (schema, _) = crate::config::qualified_name(&config.outbox.table).unwrap_or_default();
    let messages = match crate::outbox::message::emit_installed(client, &schema).await {
        Ok(installed) => installed,
        Err(e) => return Check::query_failed(NAME, "cannot look for outbox_emit", &e),
    };
    let mut check = verdict(config, &outbox, &missing, commit_timestamps);
    if messages {
        check.detail.push_str(MESSAGES_NOTE);
    }
    check
}

/// What a lost slot means for the message outbox, added to the check's detail
/// when `outbox_emit` is installed.
const MESSAGES_NOTE: &str = "; events written with outbox_emit (the message outbox) are in no \
     table: those written while the slot was gone are lost for good, whatever the relay does \
     (a resync republishes rows only; `audit` counts the missing messages as lost)";

/// The check's result for the columns `missing` of `outbox`.
fn verdict(config: &Config, outbox: &str, missing: &[&str], commit_timestamps: bool) -> Check {
    match (config.relay.on_slot_loss, missing.is_empty()) {
        (SlotLossMode::Fail, _) => Check::ok(
            NAME,
            "relay.on_slot_loss = \"fail\": a lost slot stops `run` (exit 3) for an operator to decide",
        ),
        (SlotLossMode::Resync, true) => Check::ok(
            NAME,
            format!(
                "a lost slot is resynced from the saved position (only rows still in the outbox can be \
                 republished: an application that deletes them after insert loses what happened while \
                 the slot was gone); {}",
                if commit_timestamps {
                    "its rows are read in commit order (track_commit_timestamp = on)"
                } else {
                    "its rows are read by created_at, which is commit order only for writers that \
                     lock their entity (track_commit_timestamp = on, a restart, makes it exact)"
                }
            ),
        ),
        (SlotLossMode::Resync, false) => Check::warn(
            NAME,
            format!(
                "a lost slot cannot be resynced on this layout: {outbox} has no {} (a resync marks \
                 the rows it republishes); `run` would stop with exit 3 when the slot is lost",
                missing.join(", ")
            ),
            format!(
                "add the columns (ALTER TABLE {outbox} ADD COLUMN IF NOT EXISTS sent_at timestamptz, \
                 ADD COLUMN IF NOT EXISTS attempts integer NOT NULL DEFAULT 0, \
                 ADD COLUMN IF NOT EXISTS last_error text: cheap, no rewrite), or set \
                 relay.on_slot_loss = \"fail\" to stop on a lost slot by design"
            ),
        ),
    }
}

/// Whether the server keeps commit timestamps (`track_commit_timestamp`).
async fn commit_timestamps(client: &Client) -> Result<bool, tokio_postgres::Error> {
    let row = client
        .query_one(
            "SELECT current_setting('track_commit_timestamp')::bool",
            &[],
        )
        .await?;
    row.try_get(0)
}

/// `postgres.track_commit_timestamp`, in exactly-once mode: whether a data
/// directory restored in place and written past the progress record can be told
/// from a restart (`crate::cdc::wal_identity`). Off, such a restore's new events
/// below the record's watermark would be taken as delivered.
pub(super) async fn restore_detection(client: &Client) -> Check {
    const NAME: &str = "postgres.track_commit_timestamp";
    let on = match commit_timestamps(client).await {
        Ok(on) => on,
        Err(e) => return Check::query_failed(NAME, "cannot read track_commit_timestamp", &e),
    };
    if on {
        Check::ok(
            NAME,
            "on: exactly-once tells a data directory restored in place from a restart by the \
             commit times of the transactions its progress record names",
        )
    } else {
        Check::warn(
            NAME,
            "off: exactly-once cannot tell a data directory restored in place (a storage \
             snapshot rolled back) and written past its progress record before the relay \
             came back from a restart; events committed after such a restore could be taken \
             as delivered",
            "ALTER SYSTEM SET track_commit_timestamp = on; then restart PostgreSQL",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_config as cfg;

    #[test]
    fn a_layout_without_the_marks_cannot_be_resynced_and_says_how_to_fix_it() {
        let config = cfg("");
        let check = verdict(
            &config,
            "\"public\".\"outbox\"",
            &["sent_at", "attempts"],
            false,
        );
        let text = format!("{check:?}");
        assert!(text.contains("Warn"), "{text}");
        assert!(text.contains("has no sent_at, attempts"), "{text}");
        assert!(text.contains("ALTER TABLE"), "{text}");
        assert!(text.contains("on_slot_loss = \\\"fail\\\""), "{text}");
        let fail = cfg("[relay]\non_slot_loss = \"fail\"\n");
        assert!(format!("{:?}", verdict(&fail, "t", &["sent_at"], false)).contains("Ok"));
        let off = format!("{:?}", verdict(&config, "t", &[], false));
        assert!(off.contains("Ok") && off.contains("by created_at"), "{off}");
        let on = format!("{:?}", verdict(&config, "t", &[], true));
        assert!(on.contains("in commit order"), "{on}");
    }
}
