//! `outbox-relay replay`: re-publish rows of `poison_outbox` once their cause is fixed.
//!
//! Promise 5 (`docs/architecture.md#promises`) says nothing is silently dropped: an event the relay could
//! not deliver lands in the poison table with its error, and stays there. This module
//! is the way back out. The operator fixes the cause (raises `message.max.bytes`,
//! creates the missing topic, grants the ACL, repairs the row) and runs
//! `outbox-relay replay --all` (or `--id N` for chosen rows); each selected row is
//! published again and then marked.
//!
//! # How it is built
//!
//! [`run`] checks the selection (`args.rs`), takes the replay lock and reads the
//! poison table page by page (`store.rs`), publishes each page and collects its
//! acknowledgements (`publish.rs`), marks the acknowledged rows, and returns a
//! [`ReplayReport`] (`report.rs`). Replays of `PROGRESS_MIN_ROWS` rows or more show
//! progress on stderr (`crate::ops::meter`).
//!
//! # Parked keys
//!
//! Rows parked behind a poisoned event of their key (`relay.on_poison =
//! "park-key"`) are not published by the main pass: once the poisoned rows of a key
//! are delivered, `release.rs` publishes its parked rows in order and releases the
//! key. `--all` looks at every parked key; `--id` at the keys of the named rows.
//!
//! # Concurrency and exit codes
//!
//! A replay holds a PostgreSQL advisory lock named after the poison table for its
//! duration, so two replays cannot publish the same rows at once (the second fails
//! at once, exit code 1, [`Error::ReplayLocked`]). `--dry-run` takes no lock, connects to no broker, publishes
//! nothing and changes nothing; it lists what would be published (poison id,
//! idempotency key, key, topic, record bytes) and which rows cannot be mapped.
//!
//! [`run`] fails with exit code 2 for a bad selection, 3 when the poison table does
//! not exist (run `migrate`), 4 when the broker is unreachable at start (checked only
//! when there is something to publish). Otherwise it returns a [`ReplayReport`];
//! [`ReplayReport::exit_code`] is 1 when a row failed or the producer hit a fatal
//! error, else 0.

use crate::config::{Config, quote_qualified};
use crate::error::Error;
use crate::ops::meter::Meter;
use crate::outbox::OutboxMapper;

mod args;
#[cfg(test)]
mod fixtures;
mod publish;
mod release;
mod report;
mod store;

pub use args::ReplayArgs;
pub use report::{KeyOutcome, Outcome, ParkedKeyReport, ReplayReport, ReplayedRow};

use args::Selection;
use publish::{PAGE_ROWS, Sender, dry_run_page};
use release::Release;
use store::{Originals, PoisonStore, payload_format_for_type};

/// Replays of at least this many rows show progress on stderr.
pub(crate) const PROGRESS_MIN_ROWS: u64 = 1000;

/// Runs `replay`: selects poison rows, re-publishes them with their original
/// idempotency key and headers, marks the acknowledged ones. See the module doc.
///
/// # Errors
///
/// [`Error::Config`] (exit 2) without `--id`/`--all` or for an unknown id;
/// [`Error::Prerequisite`] (exit 3) when the poison table is missing;
/// [`Error::Broker`] (exit 4) when the broker does not answer;
/// [`Error::ReplayLocked`] (exit 1) while another replay runs;
/// PostgreSQL errors (exit 1). Row failures are not errors: they are in the report.
pub async fn run(config: &Config, args: &ReplayArgs) -> Result<ReplayReport, Error> {
    let selection = Selection::from_args(args)?;
    let config = &args::replayed_outbox(config, args)?;
    let mapper = OutboxMapper::new(&config.outbox, &config.kafka, config.kafka.envelope.clone())?;
    // The relay's session settings (UTC, ISO dates), so that the original of a
    // truncated copy reads as the stream read it (its placed columns included).
    let conninfo = crate::postgres::parse_url(&config.postgres.url)?;
    let client = crate::poller::session(&conninfo).await?;
    let store = PoisonStore {
        client,
        table: quote_qualified(&config.outbox.poison_table),
        name: config.outbox.poison_table.clone(),
        parked_keys: crate::poison::parked_key_table(&config.outbox),
        source_table: crate::poison::source_table(&config.outbox),
    };
    store.check_table().await?;
    if !args.dry_run {
        store.lock().await?;
    }
    let result = replay(config, args, &selection, &mapper, &store).await;
    if !args.dry_run {
        store.unlock().await;
    }
    result
}

async fn replay(
    config: &Config,
    args: &ReplayArgs,
    selection: &Selection,
    mapper: &OutboxMapper,
    store: &PoisonStore,
) -> Result<ReplayReport, Error> {
    store.check_ids(&selection.ids).await?;
    let counts = store.counts(selection).await?;
    let payload_format =
        payload_format_for_type(store.payload_type(&config.outbox).await?.as_deref());
    let mut report = ReplayReport {
        poison_table: config.outbox.poison_table.clone(),
        dry_run: args.dry_run,
        selected: counts.selected,
        already_replayed: counts.already_replayed,
        ..ReplayReport::default()
    };
    let keys = store.parked_keys(selection).await?;
    if counts.selected == 0 && keys.is_empty() {
        return Ok(report);
    }
    tracing::info!(
        rows = counts.selected,
        table = %config.outbox.poison_table,
        dry_run = args.dry_run,
        "replaying poison rows"
    );
    // The broker is needed only when there is something to publish.
    let mut sender = if args.dry_run {
        None
    } else {
        Some(Sender::connect(config).await?)
    };
    let page_rows = PAGE_ROWS.min(config.relay.max_in_flight_events.max(1));
    let mut after = 0;
    let what = if args.dry_run {
        "poison rows (dry run)"
    } else {
        "poison rows"
    };
    let mut meter = Meter::new(
        "replay",
        what,
        counts.selected,
        counts.selected >= PROGRESS_MIN_ROWS,
    );
    let mut originals = Originals::default();
    loop {
        let mut page = store
            .page(
                selection,
                after,
                counts.max_id,
                page_rows,
                config.relay.max_in_flight_bytes,
            )
            .await?;
        let Some(last) = page.last() else { break };
        after = last.poison_id;
        store
            .restore_originals(&config.outbox, &mut originals, &mut page)
            .await?;
        let (rows, fatal) = match sender.as_mut() {
            None => (dry_run_page(mapper, &page, payload_format), None),
            Some(sender) => sender.publish_page(mapper, &page, payload_format).await?,
        };
        drop(page);
        let acked: Vec<i64> = rows
            .iter()
            .filter(|r| r.outcome == Outcome::Published)
            .map(|r| r.poison_id)
            .collect();
        let marked = store.mark_replayed(&acked).await?;
        if marked != acked.len() as u64 {
            tracing::warn!(
                acked = acked.len(),
                marked,
                "not every acknowledged poison row could be marked"
            );
        }
        meter.inc(rows.len() as u64);
        for row in rows {
            report.add(row);
        }
        if let Some(reason) = fatal {
            report.aborted = Some(reason);
            break;
        }
    }
    meter.finish();
    if report.aborted.is_none() && !keys.is_empty() {
        let release = Release {
            config,
            mapper,
            store,
            payload_format,
            page_rows,
        };
        release.run(&keys, sender.as_mut(), &mut report).await?;
    }
    tracing::info!(
        published = report.published,
        failed = report.failed,
        dry_run = args.dry_run,
        "replay finished"
    );
    Ok(report)
}
