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
//! it (a `read_committed` reader sees nothing of it), its row is reported, and the
//! window is produced again without that row and the later rows of its key. An
//! abortable commit is tried again whole, at most [`TRANSACTION_ATTEMPTS`] times.
//! Each event a run reports as published was committed exactly once by that run.

use std::time::Duration;

use tokio::sync::mpsc;

use crate::config::{Config, DeliveryMode};
use crate::error::{Error, Result};
use crate::kafka::{self, DeliveryReport, Publisher, TransactionError};
use crate::poller::{BatchRow, Delivery, RowResult, publish_holding};

/// `message.timeout.ms` of the at-least-once producer (as `replay`'s).
pub(super) const DELIVERY_TIMEOUT: Duration = Duration::from_secs(120);

/// How long the broker may take to answer the start-up metadata request.
const BROKER_CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// Tries of one window's transaction before the run gives up on it.
pub(super) const TRANSACTION_ATTEMPTS: u32 = 5;

/// Tries of a retriable transactional call.
const CALL_ATTEMPTS: u32 = 3;
const CALL_RETRY_PAUSE: Duration = Duration::from_millis(500);

/// The `transactional.id` of `republish` on outbox `table`: its own, so that a run
/// and the relay (whose id is the slot's) never fence each other, and one per
/// outbox, like the run's lock. A slot name cannot contain a dot, so it cannot
/// collide with a relay's.
#[must_use]
pub(super) fn transactional_id(table: &str) -> String {
    format!("outbox-relay.republish.{table}")
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
    pub(super) async fn connect(config: &Config, window: usize) -> Result<Sender> {
        let mut cfg = kafka::producer_config(&config.kafka, &config.relay)?;
        let transactional = if config.kafka.delivery == DeliveryMode::ExactlyOnce {
            let id = transactional_id(&config.outbox.table);
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
            retrying(|| publisher.init_transactions(id)).await?;
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
                match retrying(|| async { kafka::joined(self.publisher.start_commit(id).await) })
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
            retrying(|| async { kafka::joined(self.publisher.start_abort(id).await) }).await?;
            if attempts >= TRANSACTION_ATTEMPTS {
                return Err(Error::RepublishGaveUp {
                    attempts: TRANSACTION_ATTEMPTS,
                });
            }
            window = self.after_abort(positions, batch, &mut done);
        }
        Ok(done.into_iter().flatten().collect())
    }

    /// After an aborted window: its failed rows, and the later rows of their keys
    /// (held, `Pending`), leave it; the others are produced again.
    fn after_abort(
        &self,
        positions: Vec<usize>,
        batch: Vec<BatchRow>,
        done: &mut [Option<BatchRow>],
    ) -> Vec<(usize, BatchRow)> {
        let mut holding: crate::hashing::HashSet<KeyOf> = Default::default();
        let mut again = Vec::with_capacity(batch.len());
        for (i, mut row) in positions.into_iter().zip(batch) {
            let key = key_of(&row);
            let failed = matches!(delivery(&row), Some(Delivery::Failed { .. }));
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
}

fn delivery(row: &BatchRow) -> Option<&Delivery> {
    match &row.result {
        RowResult::Event { delivery, .. } => Some(delivery),
        RowResult::Unmappable { .. } => None,
    }
}

/// Makes a transactional call again while it is retriable.
async fn retrying<F, Fut>(mut call: F) -> std::result::Result<(), TransactionError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = std::result::Result<(), TransactionError>>,
{
    let mut attempt = 1;
    loop {
        match call().await {
            Err(TransactionError::Retriable { .. }) if attempt < CALL_ATTEMPTS => {
                attempt += 1;
                tokio::time::sleep(CALL_RETRY_PAUSE).await;
            }
            outcome => return outcome,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_transactional_id_is_the_outboxs_and_never_a_slots() {
        let id = transactional_id("public.outbox");
        assert_eq!(id, "outbox-relay.republish.public.outbox");
        // A relay's id is the slot's name, which has no dot.
        assert_ne!(id, kafka::transactional_id("republish"));
        assert!(!kafka::transactional_id("outbox_relay").contains("republish."));
    }
}
