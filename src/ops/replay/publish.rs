//! Publishing a page of poison rows again, or (`--dry-run`) saying what would be
//! published.
//!
//! # Why the record is rebuilt with the relay's mapper
//!
//! The poison row keeps the outbox row's columns as text, not the Kafka record. The
//! record is rebuilt with [`OutboxMapper::map_row`], the function the polling relay
//! uses, so a replayed record follows the same contract as one from `run` or `poll`
//! (`docs/architecture.md#the-kafka-record`): key = `aggregate_id`, the original `idempotency_key` header first
//! (consumers dedupe on it, so a replay of an event that did arrive after all is
//! harmless), `event_type`, `aggregate_type`, `occurred_at`, then the row's `headers`
//! entries; the timestamp is the original `created_at`. Two details:
//!
//! * **`source_lsn`** is the commit LSN stored with the poison row when there is one
//!   (rows poisoned by the CDC relay), so the record is header for header the one the
//!   relay would have produced. Rows without an LSN (poisoned by the polling relay)
//!   get no `source_lsn` header, as in `poll`.
//! * **No extra header** such as `replayed_from_poison` or `replay_count`: the
//!   contract says the record is *the same* for `run`, `poll` and `replay`, and a
//!   new relay-owned header name could collide with a name in a row's `headers`
//!   object. Replays are recorded where operators look for them — `replayed_at`
//!   and `replay_count` in the poison table, and this command's report.
//!
//! The topic is the poison row's `topic` when set (the topic the relay produced to,
//! or the row's own `topic` column) and otherwise `kafka.topic_template`. A row that
//! still cannot be mapped (a NULL `aggregate_id`, say) is reported as failed with the
//! mapper's reason and left unmarked.
//!
//! # At-least-once, like the relay
//!
//! Rows are marked only after the broker acknowledged them (`acks=all`), in the same
//! pages they were published in. A crash between the ack and the `UPDATE` re-publishes
//! that page on the next run, with the same idempotency keys; nothing is marked that
//! was not delivered.
//!
//! # Bounded, not awaited one at a time
//!
//! A page (at most [`PAGE_ROWS`] rows) is handed to the [`Publisher`] in one go (no
//! `await` per send) and its [`DeliveryReport`]s are collected from the report
//! channel; a row's outcome is known when its report arrives, in any order.
//!
//! The producer is the relay's ([`kafka::producer_config`]: idempotent, `acks=all`,
//! the same partitioner, so a replayed event lands on its entity's partition), with
//! one difference: a finite `message.timeout.ms` ([`DELIVERY_TIMEOUT`]). The relay
//! waits forever for an unreachable broker because it must not skip an event; an
//! operator command should end, and a row whose delivery timed out is simply reported
//! as failed and not marked.

use std::time::Duration;

use tokio::sync::mpsc;

use super::report::{Outcome, ReplayedRow};
use super::store::{ORIGINAL_UNAVAILABLE, PoisonRecord};
use crate::config::Config;
use crate::delivery::EventId;
use crate::error::Error;
use crate::kafka::{self, DeliveryReport, Publisher};
use crate::outbox::{OutboxMapper, PayloadFormat};

/// Most rows read (and in flight) per page.
pub(crate) const PAGE_ROWS: usize = 500;

/// `message.timeout.ms` of the replay producer (see the module doc).
pub(crate) const DELIVERY_TIMEOUT: Duration = Duration::from_secs(120);

/// How long the broker may take to answer the start-up metadata request.
const BROKER_CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// How long to wait for a delivery report before saying on stderr that we wait.
const STALL_NOTICE: Duration = Duration::from_secs(10);

/// The producer and its report channel.
#[derive(Debug)]
pub(super) struct Sender {
    publisher: Publisher,
    reports: mpsc::Receiver<DeliveryReport>,
    brokers: String,
}

impl Sender {
    pub(super) async fn connect(config: &Config) -> Result<Sender, Error> {
        let mut cfg = kafka::producer_config(&config.kafka, &config.relay)?;
        // A finite delivery timeout for an operator command (see the module doc).
        cfg.remove("delivery.timeout.ms");
        cfg.set(
            "message.timeout.ms",
            DELIVERY_TIMEOUT.as_millis().to_string(),
        );
        let capacity = kafka::report_capacity(&config.relay).max(PAGE_ROWS);
        let (publisher, reports) = Publisher::new(cfg, capacity)?;
        publisher.check_broker(BROKER_CHECK_TIMEOUT).await?;
        Ok(Sender {
            publisher,
            reports,
            brokers: config.kafka.brokers.clone(),
        })
    }

    /// Publishes one page and collects its reports. Returns the rows and, when the
    /// producer hit a fatal error, its description.
    pub(super) async fn publish_page(
        &mut self,
        mapper: &OutboxMapper,
        page: &[PoisonRecord],
        payload_format: PayloadFormat,
    ) -> Result<(Vec<ReplayedRow>, Option<String>), Error> {
        let mut rows = Vec::with_capacity(page.len());
        let mut awaiting = vec![false; page.len()];
        let mut outstanding = 0usize;
        for (i, rec) in page.iter().enumerate() {
            let mut row = ReplayedRow::new(rec);
            if let Some(reason) = &rec.unavailable {
                row.fail(ORIGINAL_UNAVAILABLE, reason.clone());
                rows.push(row);
                continue;
            }
            match mapper.map_row(
                &rec.outbox_row_placing(payload_format, mapper.placed_columns()),
                rec.lsn,
            ) {
                Err(unmappable) => row.fail(unmappable.error_kind, unmappable.reason),
                Ok(event) => {
                    row.set_event(&event);
                    match self
                        .publisher
                        .send_event(EventId::from_raw(i as u64), &event)
                    {
                        Ok(()) => {
                            awaiting[i] = true;
                            outstanding += 1;
                        }
                        Err(rejected) => {
                            row.fail(kafka::error_kind(rejected.code), rejected.message)
                        }
                    }
                }
            }
            rows.push(row);
        }
        let mut fatal = None;
        while outstanding > 0 {
            let report = match tokio::time::timeout(STALL_NOTICE, self.reports.recv()).await {
                Ok(Some(report)) => report,
                Ok(None) => {
                    return Err(Error::ReplayReportsClosed);
                }
                Err(_) => {
                    eprintln!(
                        "replay: waiting for {outstanding} delivery report(s) from {} \
                         (records time out after {}s)",
                        self.brokers,
                        DELIVERY_TIMEOUT.as_secs()
                    );
                    continue;
                }
            };
            let index = usize::try_from(report.id.get()).unwrap_or(usize::MAX);
            let (Some(row), Some(waiting)) = (rows.get_mut(index), awaiting.get_mut(index)) else {
                continue;
            };
            if !std::mem::replace(waiting, false) {
                continue;
            }
            outstanding -= 1;
            match &report.result {
                Ok((partition, offset)) => row.delivered(*partition, *offset),
                Err((code, message)) => {
                    if report.is_fatal() && fatal.is_none() {
                        fatal = Some(match self.publisher.fatal_error() {
                            Some((c, m)) => format!("Kafka producer failed ({c:?}): {m}"),
                            None => format!("Kafka producer failed ({code:?}): {message}"),
                        });
                    }
                    row.fail(kafka::error_kind(*code), message.clone());
                }
            }
        }
        Ok((rows, fatal))
    }
}

/// Rows of a page as `--dry-run` reports them.
pub(super) fn dry_run_page(
    mapper: &OutboxMapper,
    page: &[PoisonRecord],
    payload_format: PayloadFormat,
) -> Vec<ReplayedRow> {
    page.iter()
        .map(|rec| {
            let mut row = ReplayedRow::new(rec);
            if let Some(reason) = &rec.unavailable {
                row.fail(ORIGINAL_UNAVAILABLE, reason.clone());
                return row;
            }
            match mapper.map_row(
                &rec.outbox_row_placing(payload_format, mapper.placed_columns()),
                rec.lsn,
            ) {
                Ok(event) => {
                    row.set_event(&event);
                    row.outcome = Outcome::WouldPublish;
                }
                Err(unmappable) => row.fail(unmappable.error_kind, unmappable.reason),
            }
            row
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{mapper, original_row, poisoned, text};
    use super::*;
    use crate::lsn::Lsn;
    use crate::outbox::{EnvelopeConfig, OutboxEvent, OutboxRow};

    fn same_record(a: &OutboxEvent, b: &OutboxEvent) {
        assert_eq!(a.key, b.key);
        assert_eq!(a.topic, b.topic);
        assert_eq!(a.payload, b.payload);
        assert_eq!(a.headers, b.headers);
        assert_eq!(a.timestamp_ms, b.timestamp_ms);
        assert_eq!(a.idempotency_key, b.idempotency_key);
    }

    #[test]
    fn a_poisoned_event_replays_as_the_same_record() {
        let m = mapper(None);
        let lsn = Some(Lsn(0x16_B374_D848));
        let (original, rec) = poisoned(&m, &original_row(), lsn);
        let replayed = m
            .map_row(&rec.outbox_row(PayloadFormat::Json), rec.lsn)
            .unwrap();
        same_record(&original, &replayed);
        let names: Vec<&str> = replayed.headers.iter().map(|(n, _)| n.as_ref()).collect();
        assert_eq!(
            names,
            [
                "idempotency_key",
                "event_type",
                "aggregate_type",
                "occurred_at",
                "source_lsn",
                "tenant",
                "trace"
            ]
        );
        assert_eq!(&replayed.headers[0].1[..], b"key-42");
        assert_eq!(replayed.topic, "outbox.event.order");
        // Without an LSN (a row the polling relay poisoned): no source_lsn header.
        let (original, rec) = poisoned(&m, &original_row(), None);
        let replayed = m
            .map_row(&rec.outbox_row(PayloadFormat::Json), None)
            .unwrap();
        same_record(&original, &replayed);
        assert!(replayed.headers.iter().all(|(n, _)| n != "source_lsn"));
    }

    #[test]
    fn envelope_and_bytea_payloads_replay_unchanged() {
        let envelope = EnvelopeConfig {
            producer: "orders".into(),
            schema_version: "1".into(),
        };
        let m = mapper(Some(envelope));
        let (original, rec) = poisoned(&m, &original_row(), None);
        let replayed = m
            .map_row(&rec.outbox_row(PayloadFormat::Json), None)
            .unwrap();
        same_record(&original, &replayed);

        let m = mapper(None);
        let row = OutboxRow {
            payload: text(r"\x00ff10"),
            payload_format: PayloadFormat::ByteaText,
            ..original_row()
        };
        let (original, rec) = poisoned(&m, &row, None);
        assert_eq!(rec.payload.as_deref(), Some(r"\x00ff10"));
        let replayed = m
            .map_row(&rec.outbox_row(PayloadFormat::ByteaText), None)
            .unwrap();
        same_record(&original, &replayed);
        assert_eq!(&replayed.payload[..], [0x00, 0xff, 0x10]);
    }

    #[test]
    fn the_stored_topic_wins_over_the_template() {
        let m = mapper(None);
        let row = OutboxRow {
            topic: text("orders.special"),
            ..original_row()
        };
        let (_, rec) = poisoned(&m, &row, None);
        let replayed = m
            .map_row(&rec.outbox_row(PayloadFormat::Json), None)
            .unwrap();
        assert_eq!(replayed.topic, "orders.special");
        // No stored topic: the template decides.
        let rec = PoisonRecord { topic: None, ..rec };
        let replayed = m
            .map_row(&rec.outbox_row(PayloadFormat::Json), None)
            .unwrap();
        assert_eq!(replayed.topic, "outbox.event.order");
    }

    #[test]
    fn an_unmappable_row_fails_with_the_mappers_reason() {
        let m = mapper(None);
        let rec = PoisonRecord {
            poison_id: 3,
            idempotency_key: Some("k".into()),
            aggregate_type: Some("order".into()),
            event_type: Some("Created".into()),
            payload: Some("{}".into()),
            error_kind: "null_key".into(),
            ..PoisonRecord::default()
        };
        let rows = dry_run_page(&m, std::slice::from_ref(&rec), PayloadFormat::Json);
        assert_eq!(rows[0].outcome, Outcome::Failed);
        assert_eq!(rows[0].error_kind.as_deref(), Some("null_key"));
        assert!(rows[0].error.as_deref().unwrap().contains("aggregate_id"));
        assert_eq!(rows[0].bytes, 0);
        assert_eq!(rows[0].replay_count, 0);
    }
}
