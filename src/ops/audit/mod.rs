//! `outbox-relay audit`: a leak checker that compares the outbox with what the topics
//! hold.
//!
//! # Why
//!
//! The relay's promises (`docs/architecture.md#promises`) — no loss, at-least-once with a small duplicate
//! window, per-entity commit order — are tested in CI, but a user running it in
//! production wants to *see* them hold on their own data, after an incident, an
//! upgrade or a broker migration. `audit` reads the outbox rows of a range (and the
//! `poison_outbox` rows), reads the configured topics over the same range by the
//! `idempotency_key` header, and reports what is missing, repeated or reordered. It
//! only reads: no consumer-group offsets are committed, nothing is written to
//! PostgreSQL.
//!
//! # How it is built
//!
//! One pass, in the order [`run`] follows:
//!
//! * `args.rs` — the flags, and the range they select ([`TimeSpec`] resolved once,
//!   at the start);
//! * `load.rs` — the outbox and poison rows of the range, in one snapshot, into
//!   the ledger;
//! * `topic.rs` — each topic, every partition to its end, record by record, into
//!   the same ledger;
//! * `ledger.rs` — the definitions of the six numbers (`expected`, `delivered`,
//!   `lost`, `duplicates`, `out_of_order_keys`, `poisoned`) and the 16 bytes of
//!   state per row that count them;
//! * `report.rs` — the [`AuditReport`]: the JSON contract and the human table.

use std::time::{Duration, Instant};

use chrono::Utc;

use crate::config::Config;
use crate::error::Error;

mod args;
mod ledger;
mod load;
mod messages;
mod report;
mod topic;

pub use args::{AuditArgs, InvalidTimeSpec, TimeSpec};
pub use report::AuditReport;

use args::Range;
use load::Loaded;

/// Runs the audit and returns the report (printing it is the caller's job; only
/// progress goes to stderr). A non-clean report ([`AuditReport::is_clean`]) is not
/// an error.
///
/// # Errors
///
/// Bad flags or config ([`Error::Config`], exit code 2); missing outbox table
/// ([`Error::Prerequisite`], 3); broker unreachable ([`Error::AuditBroker`], 4);
/// PostgreSQL errors; [`Error::AuditRangeTooLarge`] for more than 2³² rows.
pub async fn run(config: &Config, args: &AuditArgs) -> Result<AuditReport, Error> {
    if !config.has_several_outboxes() {
        return run_one(config, &[], args).await;
    }
    // Several outbox tables: each is audited against its own topics, and the
    // counts add up (an event is one row of one table). Each audit knows the
    // others, whose records a shared topic may hold (`ledger.rs`).
    let started = Instant::now();
    let views = config.per_outbox();
    let others = |i: usize| -> Vec<Config> {
        views
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, v)| v.clone())
            .collect()
    };
    let Some(first) = views.first() else {
        return Box::pin(run_one(config, &[], args)).await;
    };
    let mut total = Box::pin(run_one(first, &others(0), args)).await?;
    total.label_by(&first.outbox.table);
    for (i, view) in views.iter().enumerate().skip(1) {
        let report = Box::pin(run_one(view, &others(i), args)).await?;
        total.add(report, &view.outbox.table);
    }
    total.elapsed = started.elapsed();
    Ok(total)
}

/// Audits one outbox table; `others` are the views of the config's other outboxes.
async fn run_one(
    config: &Config,
    others: &[Config],
    args: &AuditArgs,
) -> Result<AuditReport, Error> {
    let started = Instant::now();
    let range = Range::resolve(args, Utc::now())?;
    let consumer_cfg = topic::consumer_config(config, args.isolation)?;
    let progress = !args.no_progress;

    let mut client = crate::postgres::connect(&config.postgres.url).await?;
    // The mapper reads created_at as PostgreSQL's ISO output; a `timestamp`
    // column (and the range bounds) are taken as UTC, as the relay does.
    client
        .batch_execute("SET DateStyle = 'ISO, MDY'; SET TimeZone = 'UTC'")
        .await?;
    let cols = load::resolve_columns(&client, config).await?;
    load::check_id_bounds(&client, &cols, &range).await?;
    let others = load::other_outboxes(&client, others).await?;
    let Loaded {
        mut ledger,
        topics: mapped_topics,
        unmappable,
        mut notes,
    } = load::load(&mut client, config, &others, &cols, &range, progress).await?;

    let topics: Vec<String> = if args.topics.is_empty() {
        mapped_topics.into_iter().collect()
    } else {
        let mut t = args.topics.clone();
        t.sort();
        t.dedup();
        t
    };
    let since_ms = range.since.map(|s| s.timestamp_millis());
    let idle = Duration::from_secs(args.timeout_secs.max(1));
    let topics_for_task = topics.clone();
    let (ledger, kafka_notes) = tokio::task::spawn_blocking(move || {
        let mut notes = Vec::new();
        for topic in &topics_for_task {
            let outcome =
                topic::read_topic(&consumer_cfg, topic, since_ms, idle, &mut ledger, progress)?;
            notes.extend(outcome.notes);
        }
        Ok::<_, Error>((ledger, notes))
    })
    .await
    .map_err(Error::AuditConsumerTask)??;
    notes.extend(kafka_notes);

    let counts = ledger.counts();
    if let Some(m) = counts.messages {
        notes.push(format!(
            "message outbox (outbox_relay_message_ledger): {} emitted, {} delivered, {} \
             poisoned, {} lost (included in the counts above)",
            m.emitted, m.delivered, m.poisoned, m.lost
        ));
    }
    let lost_keys = if counts.lost > 0 {
        load::lost_sample(&mut client, config, &cols, &range, &ledger, counts.lost).await?
    } else {
        Vec::new()
    };
    Ok(AuditReport {
        expected: counts.expected,
        delivered: counts.delivered,
        lost: counts.lost,
        duplicates: ledger.duplicates,
        out_of_order_keys: ledger.out_of_order_keys,
        poisoned: counts.poisoned,
        parked: counts.parked,
        duplicated_events: ledger.duplicated_events,
        replayed: counts.replayed,
        out_of_order_records: ledger.out_of_order_records,
        records_read: ledger.records,
        outside_range: ledger.outside_range + counts.beyond_messages,
        without_key: ledger.without_key,
        unmappable_rows: unmappable,
        shared_keys: ledger.shared_keys,
        range: cols.describe(&range),
        topics,
        lost_sample: lost_keys,
        notes,
        state_bytes: ledger.state_bytes(),
        elapsed: started.elapsed(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_future_is_send() {
        fn assert_send<T: Send>(_: &T) {}
        let toml = "[postgres]\nurl = \"postgresql://h/db\"\n[kafka]\nbrokers = \"b:9092\"\n";
        let config = Config::from_sources("test", toml, Vec::new()).unwrap();
        let args = AuditArgs::default();
        let fut = run(&config, &args);
        assert_send(&fut);
    }
}
