//! A consumer that applies each outbox event exactly once, with the relay's inbox
//! helper (`outbox_relay::inbox`): it reads a topic with rdkafka, and for every record
//! claims the record's `idempotency_key` and applies the event's effect in one
//! database transaction, then commits the Kafka offset. A redelivered event (the
//! relay restarted, or this consumer restarted before its offset commit) finds its
//! key claimed and changes nothing.
//!
//! The effect here counts the events of each entity (`entity_events`): a counter is
//! what a redelivery would visibly break without the inbox.
//!
//! ```sh
//! INBOX_DATABASE_URL=postgresql://app@localhost/billing INBOX_BROKERS=localhost:9092 \
//! INBOX_TOPIC=outbox.event.order cargo run --example inbox_consumer
//! ```
//!
//! Settings (environment): `INBOX_DATABASE_URL`, `INBOX_BROKERS`, `INBOX_TOPIC`
//! (required); `INBOX_GROUP` (consumer group, default `inbox-example`),
//! `INBOX_CONSUMER` (the inbox's consumer name, default `inbox-example`),
//! `INBOX_TABLE` (default `public.outbox_inbox`), `INBOX_IDLE_EXIT_SECS` (stop after
//! this long without a record; default: run until stopped), `INBOX_EXIT_AFTER_RECORDS`
//! (stop once this many records were handled, for scripts that know how many to
//! expect; default: no limit), `INBOX_RETENTION_HOURS` (prune claimed keys older than
//! this at start; default 168).

use std::time::Duration;

use outbox_relay::inbox::Inbox;
use rdkafka::ClientConfig;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};

fn setting(name: &str) -> Result<String, String> {
    std::env::var(name).map_err(|_| format!("{name} is not set"))
}

fn setting_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = setting("INBOX_DATABASE_URL")?;
    let brokers = setting("INBOX_BROKERS")?;
    let topic = setting("INBOX_TOPIC")?;
    let group = setting_or("INBOX_GROUP", "inbox-example");
    let inbox = Inbox::new(
        &setting_or("INBOX_TABLE", "public.outbox_inbox"),
        &setting_or("INBOX_CONSUMER", "inbox-example"),
    );
    let idle = std::env::var("INBOX_IDLE_EXIT_SECS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .map(Duration::from_secs);
    let exit_after = std::env::var("INBOX_EXIT_AFTER_RECORDS")
        .ok()
        .map(|s| s.parse::<u64>())
        .transpose()?;
    let retention_hours: u64 = setting_or("INBOX_RETENTION_HOURS", "168").parse()?;

    let mut client = outbox_relay::postgres::connect(&url).await?;
    inbox.ensure_table(&client).await?;
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS entity_events (
                 entity text PRIMARY KEY, events bigint NOT NULL)",
        )
        .await?;
    let pruned = inbox
        .prune(&client, Duration::from_secs(retention_hours * 3600))
        .await?;

    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", &group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()?;
    consumer.subscribe(&[&topic])?;

    let (mut applied, mut skipped, mut handled) = (0_u64, 0_u64, 0_u64);
    loop {
        if exit_after.is_some_and(|n| handled >= n) {
            break;
        }
        let received = match idle {
            Some(idle) => match tokio::time::timeout(idle, consumer.recv()).await {
                Ok(received) => received,
                Err(_) => break,
            },
            None => consumer.recv().await,
        };
        let message = received?;
        handled += 1;
        let key = message.headers().and_then(|headers| {
            headers
                .iter()
                .find(|h| h.key == "idempotency_key")
                .and_then(|h| h.value)
                .and_then(|v| std::str::from_utf8(v).ok())
                .map(str::to_owned)
        });
        let Some(key) = key else {
            eprintln!(
                "inbox_consumer: record at offset {} has no idempotency_key header; skipped",
                message.offset()
            );
            consumer.commit_message(&message, CommitMode::Async)?;
            continue;
        };
        let entity = String::from_utf8_lossy(message.key().unwrap_or_default()).into_owned();
        let tx = client.transaction().await?;
        if inbox.claim(&tx, &key).await? {
            tx.execute(
                "INSERT INTO entity_events (entity, events) VALUES ($1, 1)
                 ON CONFLICT (entity) DO UPDATE SET events = entity_events.events + 1",
                &[&entity],
            )
            .await?;
            applied += 1;
        } else {
            skipped += 1;
        }
        tx.commit().await?;
        // After the database commit: a crash in between redelivers the record, and
        // the inbox skips it.
        consumer.commit_message(&message, CommitMode::Async)?;
    }
    println!("inbox_consumer: applied {applied}, skipped {skipped} redelivered, pruned {pruned}");
    Ok(())
}
