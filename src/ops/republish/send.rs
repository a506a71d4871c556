//! Publishing one window of rows again: every record handed to the producer at once,
//! then every report awaited (`poller::publish_holding`, the cutover's path), and
//! under exactly-once the window in one Kafka transaction.
//!
//! # The producer
//!
//! The relay's settings ([`kafka::producer_config`]: idempotent, `acks=all`, the
//! same partitioner, so a record lands on the partition its first delivery did).
//! At-least-once: a finite `message.timeout.ms` ([`DELIVERY_TIMEOUT`], as `replay`),
//! because an operator command should end; a row that timed out is reported as
//! failed. Exactly-once: transactional under [`transactional_id`] of the outbox,
//! not the slot's, so a run never fences the relay streaming beside it; its
//! `init_transactions` aborts what a killed run left open.
//!
//! # A window's transaction
//!
//! A window commits only when every record of it was acked; a failed record aborts
//! it (a `read_committed` reader sees nothing of it). A record the broker refused
//! for itself (too large, an unknown topic: not [`Failure::Transient`]) is reported
//! failed, and the window is produced again without its row and the later rows of
//! its key. A transient failure (a timeout, and the `_STATE` refusals librdkafka
//! gives every produce after a transaction turned abortable) keeps its row in the
//! window. A window is produced again at most [`TRANSACTION_ATTEMPTS`] times in a
//! row without a row leaving it, then the run stops. Each event a run reports as
//! published was committed exactly once by that run.

use std::time::Duration;

use tokio::sync::mpsc;

use crate::config::{Config, DeliveryMode};
use crate::delivery::Failure;
use crate::error::{Error, Result};
use crate::kafka::{self, DeliveryReport, Publisher, TransactionError};
use crate::poller::{BatchRow, Delivery, RowResult, publish_holding};

/// `message.timeout.ms` of the at-least-once producer (as `replay`'s).
pub(super) const DELIVERY_TIMEOUT: Duration = Duration::from_secs(120);

/// How long the broker may take to answer the start-up metadata request.
const BROKER_CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// Tries of one window's transaction before the run gives up on it.
pub(super) const TRANSACTION_ATTEMPTS: u32 = 5;

/// The `transactional.id` of `republish` on outbox `table` (`schema.table`) of
/// `database`: its own, so that a run and the relay (whose id is the slot's) never
/// fence each other, and one per outbox, like the run's lock, so that a run's start
/// aborts what a killed run of the same outbox left open. A slot name cannot contain
/// a dot, so it cannot collide with a relay's.
#[must_use]
pub(super) fn transactional_id(database: &str, table: &str) -> String {
    format!("outbox-relay.republish.{database}.{table}")
}

/// The `(topic, key)` a record's order is kept per.
pub(super) type KeyOf = (String, bytes::Bytes);

/// The record key of a mapped row.
pub(super) fn key_of(row: &BatchRow) -> Option<KeyOf> {
    match &row.result {
        RowResult::Event { event, .. } => Some((event.topic.clone(), event.key.clone())),
        RowResult::Unmappable { .. } => None,
    }
}

/// The producer of one run.
pub(super) struct Sender {
    publisher: Publisher,
    reports: mpsc::Receiver<DeliveryReport>,
    transactional: Option<String>,
    /// Event id of the next send (reports of an earlier window are told apart).
    next_id: u64,
    /// Kafka transactions committed.
    pub(super) transactions: u64,
}

impl Sender {
    /// Connects and checks the broker (exit code 4 when it does not answer); under
    /// exactly-once, initialises the transactions.
    pub(super) async fn connect(config: &Config, database: &str, window: usize) -> Result<Sender> {
        let mut cfg = kafka::producer_config(&config.kafka, &config.relay)?;
        let transactional = if config.kafka.delivery == DeliveryMode::ExactlyOnce {
            let id = transactional_id(database, &crate::poison::source_table(&config.outbox));
            kafka::transactional_config(
                &mut cfg,
                &id,
                Duration::from_millis(config.kafka.transaction_timeout_ms),
            );
            Some(id)
        } else {
            cfg.remove("delivery.timeout.ms");
            cfg.set(
                "message.timeout.ms",
                DELIVERY_TIMEOUT.as_millis().to_string(),
            );
            None
        };
        let capacity = kafka::report_capacity(&config.relay).max(window);
        let (publisher, reports) = Publisher::new(cfg, capacity)?;
        publisher.check_broker(BROKER_CHECK_TIMEOUT).await?;
        if let Some(id) = &transactional {
            kafka::retrying(|| publisher.init_transactions(id)).await?;
        }
        Ok(Sender {
            publisher,
            reports,
            transactional,
            next_id: 0,
            transactions: 0,
        })
    }

    /// Publishes `rows` (mapped events) and gives them back in their order, each
    /// row's delivery `Acked`, `Failed`, or `Pending` when it was held behind a
    /// failed row of its key.
    pub(super) async fn publish(&mut self, mut rows: Vec<BatchRow>) -> Result<Vec<BatchRow>> {
        match self.transactional.clone() {
            None => {
                self.send_window(&mut rows).await?;
                Ok(rows)
            }
            Some(id) => self.publish_in_transactions(&id, rows).await,
        }
    }

    /// Sends every row and awaits their reports (one refused at once holds its key's
    /// later rows, which stay `Pending`).
    async fn send_window(&mut self, rows: &mut [BatchRow]) -> Result<()> {
        let base = self.next_id;
        self.next_id = self.next_id.wrapping_add(rows.len() as u64);
        let keys: Vec<Option<KeyOf>> = rows.iter().map(key_of).collect();
        publish_holding(&self.publisher, &mut self.reports, base, rows, |i| {
            keys[i].clone()
        })
        .await?;
        Ok(())
    }

    /// The exactly-once path of [`Sender::publish`] (module doc).
    async fn publish_in_transactions(
        &mut self,
        id: &str,
        rows: Vec<BatchRow>,
    ) -> Result<Vec<BatchRow>> {
        let mut done: Vec<Option<BatchRow>> = Vec::with_capacity(rows.len());
        done.resize_with(rows.len(), || None);
        let mut window: Vec<(usize, BatchRow)> = rows.into_iter().enumerate().collect();
        let mut attempts = 0;
        while !window.is_empty() {
            attempts += 1;
            self.publisher.begin_transaction(id)?;
            let (positions, mut batch): (Vec<usize>, Vec<BatchRow>) = window.into_iter().unzip();
            self.send_window(&mut batch).await?;
            let clean = batch
                .iter()
                .all(|r| matches!(delivery(r), Some(Delivery::Acked)));
            if clean {
                match kafka::retrying(|| async {
                    kafka::joined(self.publisher.start_commit(id).await)
                })
                .await
                {
                    Ok(()) => {
                        self.transactions += 1;
                        for (i, row) in positions.into_iter().zip(batch) {
                            done[i] = Some(row);
                        }
                        break;
                    }
                    Err(TransactionError::Abortable { code, message })
                        if attempts < TRANSACTION_ATTEMPTS =>
                    {
                        tracing::warn!(?code, %message,
                            "republish: the window's Kafka transaction cannot commit; aborting it and producing the window again");
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            kafka::retrying(|| async { kafka::joined(self.publisher.start_abort(id).await) })
                .await?;
            let before = positions.len();
            window = after_abort(positions, batch, &mut done);
            if window.len() < before {
                // Rows left: the next attempt is another window.
                attempts = 0;
            } else if attempts >= TRANSACTION_ATTEMPTS {
                return Err(Error::RepublishGaveUp {
                    attempts: TRANSACTION_ATTEMPTS,
                });
            }
        }
        Ok(done.into_iter().flatten().collect())
    }
}

/// After an aborted window: the rows that failed for themselves, and the later rows
/// of their keys (held, `Pending`), leave it; the others are produced again.
fn after_abort(
    positions: Vec<usize>,
    batch: Vec<BatchRow>,
    done: &mut [Option<BatchRow>],
) -> Vec<(usize, BatchRow)> {
    let mut holding: crate::hashing::HashSet<KeyOf> = Default::default();
    let mut again = Vec::with_capacity(batch.len());
    for (i, mut row) in positions.into_iter().zip(batch) {
        let key = key_of(&row);
        let failed = matches!(
            delivery(&row),
            Some(Delivery::Failed { failure, .. }) if *failure != Failure::Transient
        );
        let held = key.as_ref().is_some_and(|k| holding.contains(k));
        if failed || held {
            holding.extend(key);
            if held && let RowResult::Event { delivery, .. } = &mut row.result {
                *delivery = Delivery::Pending;
            }
            done[i] = Some(row);
        } else {
            if let RowResult::Event { delivery, .. } = &mut row.result {
                *delivery = Delivery::Pending;
            }
            again.push((i, row));
        }
    }
    again
}

fn delivery(row: &BatchRow) -> Option<&Delivery> {
    match &row.result {
        RowResult::Event { delivery, .. } => Some(delivery),
        RowResult::Unmappable { .. } => None,
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::config::{KafkaConfig, OutboxConfig};
    use crate::outbox::{OutboxMapper, OutboxRow, PayloadFormat};
    use crate::poller::Polled;

    fn row(id: &str, entity: &str, delivery: Delivery) -> BatchRow {
        let mut kafka = toml::Table::new();
        kafka.insert("brokers".into(), "k:9092".into());
        let kafka: KafkaConfig = kafka.try_into().unwrap();
        let mapper = OutboxMapper::new(&OutboxConfig::default(), &kafka, None).unwrap();
        let text = |s: &str| Some(Bytes::copy_from_slice(s.as_bytes()));
        let outbox_row = OutboxRow {
            id: text(id),
            idempotency_key: text(id),
            aggregate_type: text("order"),
            aggregate_id: text(entity),
            event_type: text("Created"),
            topic: None,
            headers: None,
            payload: text("{}"),
            payload_format: PayloadFormat::Json,
            created_at: text("2026-12-07 10:00:00+00"),
            extra: Vec::new(),
        };
        let event = mapper.map_row(&outbox_row, None).unwrap();
        BatchRow {
            polled: Polled {
                id: id.into(),
                attempts: 0,
                last_error: None,
            },
            result: RowResult::Event { event, delivery },
        }
    }

    fn failed(failure: Failure) -> Delivery {
        Delivery::Failed {
            failure,
            kind: "x",
            message: String::new(),
        }
    }

    #[test]
    fn after_an_abort_only_rows_refused_for_themselves_leave_with_their_keys_later_rows() {
        let batch = vec![
            row("a", "k1", failed(Failure::Permanent)),
            row("b", "k1", Delivery::Acked),
            // librdkafka refuses every produce after the transaction turned abortable.
            row("c", "k2", failed(Failure::Transient)),
            row("d", "k2", Delivery::Acked),
            row("e", "k3", Delivery::Acked),
        ];
        let mut done: Vec<Option<BatchRow>> = (0..5).map(|_| None).collect();
        let again = after_abort((0..5).collect(), batch, &mut done);
        let ids: Vec<&str> = again.iter().map(|(_, r)| r.polled.id.as_str()).collect();
        assert_eq!(ids, ["c", "d", "e"]);
        assert!(
            again
                .iter()
                .all(|(_, r)| matches!(delivery(r), Some(Delivery::Pending)))
        );
        assert!(matches!(
            done[0].as_ref().and_then(delivery),
            Some(Delivery::Failed { .. })
        ));
        assert!(matches!(
            done[1].as_ref().and_then(delivery),
            Some(Delivery::Pending)
        ));
        assert!(done[2..].iter().all(Option::is_none));
    }

    #[test]
    fn the_transactional_id_is_the_outboxs_and_never_a_slots() {
        let id = transactional_id("app", "public.outbox");
        assert_eq!(id, "outbox-relay.republish.app.public.outbox");
        // A relay's id is the slot's name, which has no dot.
        assert_ne!(id, kafka::transactional_id("republish"));
        assert!(!kafka::transactional_id("outbox_relay").contains("republish."));
    }
}
