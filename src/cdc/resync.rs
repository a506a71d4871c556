//! Healing a lost slot without losing an event: a resync.
//!
//! When the slot the relay recorded progress for is missing, invalidated or was
//! re-created by someone else (`cdc::start`), the transactions committed between the
//! relay's last recorded position and "now" would never be streamed: a new slot starts
//! at its own consistent point. A resync publishes exactly those rows, with the
//! cutover's machinery (`cdc::cutover`, which explains the exported snapshot):
//!
//! 1. record the loss in the position row (`slot_lost_at`): a relay that crashes
//!    during the resync starts it over, with the same bound;
//! 2. drop what is left of the old slot, create it again with an exported snapshot;
//! 3. in that snapshot, publish every outbox row that is not sent (`sent_at`), not
//!    poisoned, and not below the position's `delivered_xmin` checkpoint: every row
//!    committed after the last recorded position and before the new slot, plus the
//!    few delivered just before the position was saved, which the backlog finds in
//!    the topic and marks sent without publishing them again (`backlog::delivered`);
//! 4. record the new slot's consistent point as the position and the snapshot's
//!    xmin as `delivered_xmin`, clearing the loss; streaming starts there.
//!
//! Rows committed after the consistent point are streamed, and every resync row is
//! acked before the first streamed one is produced, so per-entity order holds.
//! Without a known `delivered_xmin` (a position recorded on another server history,
//! or none promoted yet) every unsent, unpoisoned row is published: duplicates, but
//! no gap. The outbox needs the poller's `sent_at`/`attempts`/`last_error` columns,
//! which the resync marks as a cutover does.

use tokio_postgres::Client;

use crate::cdc::backlog::{BacklogQuery, Backlogs};
use crate::cdc::cutover::CutoverSummary;
use crate::cdc::start::SlotLoss;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::outbox::position::{PositionTable, ServerHistory};
use crate::poller;
use crate::postgres::conninfo::ConnInfo;
use crate::postgres::prerequisite::Prerequisite;
use crate::postgres::replication::ReplicationConnection;
use crate::postgres::servers::ServerPair;
use crate::postgres::slot;

/// Runs steps 1–4 of the module docs; returns what was published.
pub(crate) async fn resync(
    config: &Config,
    conninfo: &ConnInfo,
    conn: &mut ReplicationConnection,
    servers: &mut ServerPair<'_>,
    history: ServerHistory,
    loss: &SlotLoss,
    delivered_xmin: Option<i64>,
) -> Result<CutoverSummary> {
    let slot_name = &config.postgres.slot_name();
    let positions = PositionTable::new(config)?;
    // Nothing is recorded before everything that can refuse has been asked: a slot
    // another relay streams from is not lost (marking it would make that relay's
    // saves fail), and an outbox without the columns a resync needs, a connection or
    // the broker failing must leave the position row as it was.
    ensure_idle(servers.slot(), slot_name).await?;
    // One backlog per outbox table, merged in commit order in the same snapshot
    // (`cdc::backlog`).
    let mut views = config.per_outbox();
    if views.is_empty() {
        views.push(config.clone());
    }
    let mut backlog = Backlogs::open(&views, servers.writes(), None, history)
        .await
        .map_err(|e| impossible(e, loss))?;
    let mut reader = poller::session(conninfo).await?;
    positions
        .mark_lost(servers.writes(), &loss.to_string())
        .await?;
    drop_old_slot(conn, servers.slot(), slot_name).await?;
    // On a standby, its snapshot must see what was just written on the primary.
    servers.wait_replayed().await?;
    let (consistent_point, snapshot) =
        crate::cdc::cutover::create_exported_slot(conn, slot_name).await?;
    tracing::error!(
        slot = %slot_name,
        %consistent_point,
        delivered_xmin,
        "resync: slot created again with an exported snapshot; publishing the rows committed since the recorded position"
    );
    let query = BacklogQuery::Undelivered {
        delivered_xmin: delivered_xmin.unwrap_or(0),
    };
    let published = backlog
        .publish(
            servers.writes(),
            &mut reader,
            &snapshot,
            consistent_point,
            query,
        )
        .await?;
    drop(backlog);
    let already_delivered = published.already_delivered;
    let summary = CutoverSummary::of(consistent_point, published);
    positions
        .resynced(
            servers.writes(),
            history,
            consistent_point,
            summary.snapshot_xmin,
        )
        .await?;
    ::metrics::counter!(crate::cdc::metrics::RESYNCED_ROWS)
        .increment(summary.published + summary.poisoned);
    tracing::warn!(
        slot = %slot_name,
        consistent_point = %summary.consistent_point,
        rows = summary.rows,
        published = summary.published,
        poisoned = summary.poisoned,
        already_delivered,
        "resync complete: streaming starts at the new slot's consistent point"
    );
    Ok(summary)
}

/// The outbox lacks the columns a resync marks rows with: said in the resync's
/// terms, with the operator's two ways out (`check` warns of it beforehand).
fn impossible(e: Error, loss: &SlotLoss) -> Error {
    match e {
        Error::Prerequisite(Prerequisite::PollerColumnsMissing { table, columns }) => {
            Prerequisite::ResyncImpossible {
                detail: loss.to_string(),
                table,
                columns,
            }
            .into()
        }
        other => other,
    }
}

/// A slot another process streams from is not lost: that is retried (the start plan
/// then waits for it as a standby).
async fn ensure_idle(metadata: &Client, slot_name: &str) -> Result<()> {
    match slot::slot_info(metadata, slot_name).await? {
        Some(slot::SlotInfo {
            active_pid: Some(pid),
            ..
        }) => Err(Error::CutoverSlotActive {
            slot: slot_name.to_owned(),
            pid,
        }),
        _ => Ok(()),
    }
}

/// Drops the old slot if it is still there (invalidated, or re-created by someone
/// else). A slot another process streams from is not taken away: that is retried.
async fn drop_old_slot(
    conn: &mut ReplicationConnection,
    metadata: &Client,
    slot_name: &str,
) -> Result<()> {
    let Some(info) = slot::slot_info(metadata, slot_name).await? else {
        return Ok(());
    };
    if let Some(pid) = info.active_pid {
        return Err(Error::CutoverSlotActive {
            slot: slot_name.to_owned(),
            pid,
        });
    }
    conn.drop_slot(slot_name, false)
        .await
        .map_err(|e| crate::postgres::process_error(e, "cannot drop the lost slot: ").into())
}
