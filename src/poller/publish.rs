//! Publishing a batch: every row's record is handed to the producer at once, then
//! every delivery report is awaited — never one send at a time.
//!
//! Shared by the poller and a cutover. The event ids are `base + row index`, so a
//! report finds its row without a map; a report of an earlier batch (whose id falls
//! outside the batch) is ignored. When librdkafka's local queue is full, the batch
//! waits for some of its own reports before sending the rest. While the broker is
//! down nothing fails (the producer retries forever): the batch stays locked and
//! unmarked, and a warning repeats every 30 s saying why.

use std::time::Duration;

use rdkafka::types::RDKafkaErrorCode;
use tokio::sync::mpsc;
use tracing::warn;

use crate::delivery::EventId;
use crate::error::{Error, Result};
use crate::kafka::{self, BrokerError, BrokerUnavailable, DeliveryReport, Publisher, SendRejected};

use super::row::{BatchRow, Delivery, RowResult};

/// How long acks may be outstanding before a warning (repeated) says why we wait.
const ACK_WAIT_WARNING: Duration = Duration::from_secs(30);

/// Sends every row of the batch, then waits for all reports (never one at a time).
pub(crate) async fn publish(
    publisher: &Publisher,
    reports: &mut mpsc::Receiver<DeliveryReport>,
    base: u64,
    rows: &mut [BatchRow],
) -> Result<()> {
    publish_holding(publisher, reports, base, rows, |_| None::<()>)
        .await
        .map(|_| ())
}

/// [`publish`], except that a row whose key (`key_of(index)`) had a send refused
/// earlier in the batch is not sent: it must not overtake the refused one (a
/// backlog keeps per-key order). Returns, per row, whether it was sent.
pub(crate) async fn publish_holding<K: Eq + std::hash::Hash>(
    publisher: &Publisher,
    reports: &mut mpsc::Receiver<DeliveryReport>,
    base: u64,
    rows: &mut [BatchRow],
    key_of: impl Fn(usize) -> Option<K>,
) -> Result<Vec<bool>> {
    let mut pending = 0usize;
    let mut refused: std::collections::HashSet<K> = std::collections::HashSet::new();
    let mut sent_rows = vec![false; rows.len()];
    for index in 0..rows.len() {
        let key = key_of(index);
        if key.as_ref().is_some_and(|k| refused.contains(k)) {
            continue;
        }
        sent_rows[index] = true;
        let id = EventId::from_raw(base.wrapping_add(index as u64));
        let mut sent = send_row(publisher, id, &rows[index]);
        while let Some(Err(rejected)) = &sent
            && rejected.code == RDKafkaErrorCode::QueueFull
            && pending > 0
        {
            // The local queue is full: let some of the batch drain, then retry.
            if apply_report(publisher, next_report(reports, pending).await?, base, rows)? {
                pending -= 1;
            }
            sent = send_row(publisher, id, &rows[index]);
        }
        match (sent, &mut rows[index].result) {
            (Some(Ok(())), _) => pending += 1,
            (Some(Err(rejected)), RowResult::Event { delivery, .. }) => {
                *delivery = Delivery::Failed {
                    failure: rejected.failure,
                    kind: kafka::error_kind(rejected.code),
                    message: rejected.message,
                };
                refused.extend(key);
            }
            _ => {}
        }
    }
    while pending > 0 {
        let report = next_report(reports, pending).await?;
        if apply_report(publisher, report, base, rows)? {
            pending -= 1;
        }
    }
    Ok(sent_rows)
}

/// Hands one row's record to the producer; `None` for a row that has no record.
fn send_row(
    publisher: &Publisher,
    id: EventId,
    row: &BatchRow,
) -> Option<std::result::Result<(), SendRejected>> {
    let RowResult::Event { event, .. } = &row.result else {
        return None;
    };
    Some(publisher.send_event(id, event))
}

/// The next delivery report, warning now and then while the broker keeps us waiting.
async fn next_report(
    reports: &mut mpsc::Receiver<DeliveryReport>,
    pending: usize,
) -> Result<DeliveryReport> {
    loop {
        match tokio::time::timeout(ACK_WAIT_WARNING, reports.recv()).await {
            Ok(Some(report)) => return Ok(report),
            Ok(None) => return Err(Error::DeliveryChannelClosed),
            Err(_) => warn!(
                pending,
                "still waiting for broker acks (broker down?); the batch stays locked and unmarked"
            ),
        }
    }
}

/// Records a report against its row; `false` for a report of an earlier batch.
fn apply_report(
    publisher: &Publisher,
    report: DeliveryReport,
    base: u64,
    rows: &mut [BatchRow],
) -> Result<bool> {
    if report.is_fatal() {
        let (code, message) = report
            .result
            .err()
            .unwrap_or((RDKafkaErrorCode::Fatal, String::new()));
        return Err(BrokerError::from(BrokerUnavailable::FatalReport { code, message }).into());
    }
    let index = report.id.get().wrapping_sub(base);
    let row = usize::try_from(index).ok().and_then(|i| rows.get_mut(i));
    let Some(BatchRow {
        result: RowResult::Event { delivery, .. },
        ..
    }) = row
    else {
        return Ok(false);
    };
    if !matches!(delivery, Delivery::Pending) {
        return Ok(false);
    }
    *delivery = match report.result {
        Ok(_) => Delivery::Acked,
        Err((code, message)) => Delivery::Failed {
            failure: publisher.classify(code),
            kind: kafka::error_kind(code),
            message,
        },
    };
    Ok(true)
}
