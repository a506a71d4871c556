//! The simulated Kafka behind the producer port: records go in flight and the
//! schedule's driver resolves them (acked into a partition, failed transiently or
//! permanently, or, for a topic that does not exist yet, refused as a
//! configuration error), in order within a producer's partition as an idempotent
//! producer keeps them; transactions that commit once their records are in, fail
//! when one of them failed, abort (purging what is in flight), and fence older
//! producers of the `transactional.id` at `init_transactions`; a read_committed view
//! of the progress topic.

use std::time::Duration;

use rdkafka::error::RDKafkaErrorCode;
use tokio::sync::mpsc;

use super::world::{
    InFlight, PARTITIONS, Payload, ProducerState, ProgressEntry, Record, RowId, Shared, Txn,
    TxnStatus, World, committed,
};
use crate::cdc::ports::Boxed;
use crate::cdc::ports::clock;
use crate::cdc::ports::producer::{Made, Producer, Producers, ProgressReader};
use crate::cdc::progress_record::ProgressRecord;
use crate::delivery::{EventId, Failure};
use crate::error::Result;
use crate::kafka::{
    BrokerError, DeliveryReport, RecordRef, SendRejected, TransactionCall, TransactionError,
};
use crate::outbox::OutboxEvent;

/// Room for every report a schedule can have outstanding.
const REPORTS: usize = 100_000;

/// The producers' `message.max.bytes`: small, so that an oversize row is cheap.
pub(super) const MAX_MESSAGE_BYTES: usize = 1_000;

/// Makes the simulated producers of one relay process.
pub(super) struct SimProducers {
    pub(super) shared: Shared,
    pub(super) transactional: bool,
    pub(super) progress_topic: String,
    /// `relay.on_config_error = "poison"`.
    pub(super) poison_configuration_errors: bool,
}

impl Producers for SimProducers {
    fn make(&self) -> Result<Made> {
        let (tx, rx) = mpsc::channel(REPORTS);
        let id = register(&self.shared, tx, self.transactional, false);
        Ok((Box::new(self.producer(id)), rx))
    }
}

impl SimProducers {
    fn producer(&self, id: u64) -> SimProducer {
        SimProducer {
            shared: self.shared.clone(),
            id,
            progress_topic: self.progress_topic.clone(),
            poison_configuration_errors: self.poison_configuration_errors,
            transactional: self.transactional,
        }
    }
}

fn register(
    shared: &Shared,
    reports: mpsc::Sender<DeliveryReport>,
    transactional: bool,
    alone: bool,
) -> u64 {
    let mut world = shared.lock();
    let id = world.next_producer;
    world.next_producer += 1;
    world.producers.insert(
        id,
        ProducerState {
            reports,
            transactional,
            fenced: false,
            initialised: false,
            gone: false,
            open_txn: None,
            alone,
        },
    );
    id
}

/// One simulated producer.
pub(super) struct SimProducer {
    shared: Shared,
    id: u64,
    progress_topic: String,
    poison_configuration_errors: bool,
    transactional: bool,
}

fn rejected(code: RDKafkaErrorCode, message: &str) -> SendRejected {
    SendRejected {
        code,
        failure: Failure::Transient,
        message: message.to_owned(),
    }
}

fn fenced(id: &str) -> TransactionError {
    TransactionError::Fenced {
        id: id.to_owned(),
        message: "simulated: a newer producer initialised this transactional.id".to_owned(),
    }
}

/// The open transaction of `producer`, which may still make transactional calls
/// (known and not fenced); `None` when none is open.
fn open_transaction(
    world: &World,
    producer: u64,
    id: &str,
) -> std::result::Result<Option<u64>, TransactionError> {
    match world.producers.get(&producer) {
        Some(state) if !state.fenced => Ok(state.open_txn),
        _ => Err(fenced(id)),
    }
}

/// FNV-1a: the partition of a key, the same in every run.
pub(super) fn partition_of(key: &[u8]) -> usize {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in key {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    usize::try_from(hash % PARTITIONS as u64).unwrap_or(0)
}

impl Producer for SimProducer {
    fn send(&self, id: EventId, record: RecordRef<'_>) -> std::result::Result<(), SendRejected> {
        let mut world = self.shared.lock();
        let world = &mut *world;
        let Some(state) = world.producers.get(&self.id) else {
            return Err(rejected(
                RDKafkaErrorCode::Fail,
                "simulated: unknown producer",
            ));
        };
        let (fenced, txn) = (state.fenced, state.open_txn);
        if fenced || (self.transactional && timed_out(world, self.id)) {
            return Err(rejected(RDKafkaErrorCode::Fenced, "simulated: fenced"));
        }
        if self.transactional && txn.is_none() {
            return Err(rejected(
                RDKafkaErrorCode::State,
                "simulated: no transaction is open",
            ));
        }
        if world.rng.percent(1) {
            return Err(rejected(
                RDKafkaErrorCode::QueueFull,
                "simulated: queue full",
            ));
        }
        let (partition, payload) = if record.topic == self.progress_topic {
            let entry = ProgressEntry {
                key: String::from_utf8_lossy(record.key).into_owned(),
                value: record.payload.to_vec(),
                txn,
            };
            // A partition of its own topic: its order is not the outbox's.
            (PARTITIONS, Payload::Progress(entry))
        } else {
            let named = record
                .headers
                .iter()
                .find(|(name, _)| *name == "idempotency_key")
                .and_then(|(_, value)| std::str::from_utf8(value).ok())
                .and_then(RowId::parse);
            let Some(row) = named else {
                panic!("a record without a simulated row's idempotency key: {record:?}");
            };
            let record = Record {
                row,
                entity: record.key.to_vec(),
                txn,
                read: world.recorded_reads,
            };
            (
                partition_of(record.entity.as_slice()),
                Payload::Outbox(record),
            )
        };
        tracing::debug!(target: "sim", producer = self.id, %id, ?payload, ?txn, "send");
        world.in_flight.push(InFlight {
            producer: self.id,
            id,
            partition,
            payload,
            txn,
        });
        Ok(())
    }

    fn send_event(
        &self,
        id: EventId,
        event: &OutboxEvent,
    ) -> std::result::Result<(), SendRejected> {
        crate::kafka::with_event_record(event, |record| self.send(id, record))
    }

    fn classify(&self, code: RDKafkaErrorCode) -> Failure {
        crate::kafka::classify(code).under(self.poison_configuration_errors)
    }

    fn max_message_bytes(&self) -> usize {
        MAX_MESSAGE_BYTES
    }

    fn compresses(&self) -> bool {
        false
    }

    fn in_flight(&self) -> i32 {
        let world = self.shared.lock();
        let count = world
            .in_flight
            .iter()
            .filter(|r| r.producer == self.id)
            .count();
        i32::try_from(count).unwrap_or(i32::MAX)
    }

    fn stream_idle(&self) {}

    fn fatal_error(&self) -> Option<(RDKafkaErrorCode, String)> {
        None
    }

    fn check_broker(&self, _timeout: Duration) -> Boxed<'_, std::result::Result<(), BrokerError>> {
        Box::pin(async { Ok(()) })
    }

    fn alone(&self) -> std::result::Result<Box<dyn Producer>, BrokerError> {
        let reports = {
            let world = self.shared.lock();
            world.producers.get(&self.id).map(|p| p.reports.clone())
        };
        let Some(reports) = reports else {
            return Err(BrokerError::ProducerCreation(
                "simulated: unknown producer".to_owned(),
            ));
        };
        let id = register(&self.shared, reports, self.transactional, true);
        Ok(Box::new(SimProducer {
            shared: self.shared.clone(),
            id,
            progress_topic: self.progress_topic.clone(),
            poison_configuration_errors: self.poison_configuration_errors,
            transactional: self.transactional,
        }))
    }

    fn init_transactions(&self, _id: &str) -> Boxed<'_, std::result::Result<(), TransactionError>> {
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(2)).await;
            let mut world = self.shared.lock();
            let world = &mut *world;
            if let Some(state) = world.producers.get_mut(&self.id) {
                state.initialised = true;
            }
            let by = self.id;
            fence(world, |id, _| id != by);
            Ok(())
        })
    }

    fn begin_transaction(&self, id: &str) -> std::result::Result<(), TransactionError> {
        let mut world = self.shared.lock();
        let world = &mut *world;
        let txn = world.next_txn;
        if open_transaction(world, self.id, id)?.is_some() {
            return Err(TransactionError::Fatal {
                code: RDKafkaErrorCode::State,
                message: "simulated: a transaction is already open".to_owned(),
            });
        }
        if let Some(state) = world.producers.get_mut(&self.id) {
            state.open_txn = Some(txn);
        }
        tracing::debug!(target: "sim", producer = self.id, txn, "begin");
        world.next_txn += 1;
        world.txns.insert(
            txn,
            Txn {
                producer: self.id,
                status: TxnStatus::Open,
                committing: false,
                failed: false,
                began: tokio::time::Instant::now(),
            },
        );
        Ok(())
    }

    fn start_commit(&self, id: &str) -> TransactionCall {
        tokio::spawn(commit(self.shared.clone(), self.id, id.to_owned()))
    }

    fn start_abort(&self, id: &str) -> TransactionCall {
        tokio::spawn(abort(self.shared.clone(), self.id, id.to_owned()))
    }

    fn retire(self: Box<Self>) {
        drop(self);
    }
}

impl Drop for SimProducer {
    /// The producer is gone: what it has in flight lands or not, unreported.
    fn drop(&mut self) {
        let mut world = self.shared.lock();
        if let Some(state) = world.producers.get_mut(&self.id) {
            state.gone = true;
        }
        settle_gone(&mut world);
    }
}

/// What gone producers had in flight lands now or never, unreported, in order
/// within a partition: once one record of a partition is lost, the later ones are
/// too (an idempotent producer's sequence has a gap there).
pub(super) fn settle_gone(world: &mut World) {
    let mut lost: Vec<(u64, usize)> = Vec::new();
    let in_flight = std::mem::take(&mut world.in_flight);
    for record in in_flight {
        if world.reports_to(record.producer).is_some() {
            world.in_flight.push(record);
            continue;
        }
        let queue = (record.producer, record.partition);
        if !lost.contains(&queue) && refusal(world, &record).is_none() && world.rng.percent(50) {
            tracing::debug!(target: "sim", producer = record.producer, id = %record.id, "lands unreported");
            land(world, &record);
            world.stats.landed_unreported += 1;
        } else {
            lost.push(queue);
        }
    }
}

/// `commit_transaction`: waits until the transaction's records are in, then
/// commits, or fails (abortable) when one of them failed or, now and then, on its
/// own.
async fn commit(
    shared: Shared,
    producer: u64,
    id: String,
) -> std::result::Result<(), TransactionError> {
    loop {
        let notify = shared.notify.clone();
        let notified = notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        {
            let mut world = shared.lock();
            let world = &mut *world;
            let open = open_transaction(world, producer, &id)?;
            if world.reports_to(producer).is_none() {
                // The process is gone: whether its commit reached the
                // coordinator is decided where it went (`Schedule::kill`).
                return Err(TransactionError::Fatal {
                    code: RDKafkaErrorCode::Fatal,
                    message: "simulated: the producer is gone".to_owned(),
                });
            }
            let Some(txn) = open else {
                return Err(TransactionError::Fatal {
                    code: RDKafkaErrorCode::State,
                    message: "simulated: no transaction to commit".to_owned(),
                });
            };
            if let Some(t) = world.txns.get_mut(&txn) {
                t.committing = true;
            }
            if timed_out(world, producer) {
                return Err(fenced(&id));
            }
            let waiting = world.in_flight.iter().any(|r| r.txn == Some(txn));
            if !waiting {
                let failed = world.txns.get(&txn).is_none_or(|t| t.failed);
                if failed || world.rng.percent(2) {
                    tracing::debug!(target: "sim", producer, txn, failed, "commit fails");
                    return Err(TransactionError::Abortable {
                        code: RDKafkaErrorCode::InvalidTransactionalState,
                        message: "simulated: a record of the transaction failed".to_owned(),
                    });
                }
                end(world, producer, txn, TxnStatus::Committed);
                return Ok(());
            }
        }
        notified.await;
    }
}

/// `transaction.timeout.ms` on the coordinator (`World::transaction_timeout`): a
/// transaction of `producer` open longer is aborted there, and the epoch bumped, so
/// the producer is fenced. `true` when so.
fn timed_out(world: &mut World, producer: u64) -> bool {
    let Some(txn) = world.producers.get(&producer).and_then(|p| p.open_txn) else {
        return false;
    };
    let old = world.txns.get(&txn).is_some_and(|t| {
        t.status == TxnStatus::Open && t.began.elapsed() > world.transaction_timeout
    });
    if !old {
        return false;
    }
    tracing::debug!(target: "sim", producer, txn, "the coordinator aborts the transaction for its age and fences the producer");
    world.stats.timeouts += 1;
    purge(world, txn, RDKafkaErrorCode::InvalidProducerEpoch);
    end(world, producer, txn, TxnStatus::Aborted);
    if let Some(state) = world.producers.get_mut(&producer) {
        state.fenced = true;
    }
    true
}

/// A newer producer of the `transactional.id` takes it: every other transactional
/// producer `which` names, not fenced yet, is fenced, and the transaction it left
/// open aborts.
pub(super) fn fence(world: &mut World, which: impl Fn(u64, &ProducerState) -> bool) {
    let mut fenced_open = Vec::new();
    for (id, producer) in &mut world.producers {
        if !producer.transactional || producer.fenced || !which(*id, producer) {
            continue;
        }
        producer.fenced = true;
        tracing::debug!(target: "sim", fenced = *id, "fenced by a newer producer");
        fenced_open.extend(producer.open_txn.take());
    }
    for txn in fenced_open {
        if world
            .txns
            .get(&txn)
            .is_some_and(|t| t.status == TxnStatus::Open)
        {
            world.aborted(txn);
        }
    }
}

/// Fails the records of `txn` still in flight with `code`.
fn purge(world: &mut World, txn: u64, code: RDKafkaErrorCode) {
    let (purged, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut world.in_flight)
        .into_iter()
        .partition(|r| r.txn == Some(txn));
    world.in_flight = kept;
    for record in purged {
        report(world, &record, Err((code, format!("simulated: {code:?}"))));
    }
}

/// `abort_transaction`: purges what is in flight (reported as purged) and aborts.
async fn abort(
    shared: Shared,
    producer: u64,
    id: String,
) -> std::result::Result<(), TransactionError> {
    tokio::time::sleep(Duration::from_millis(1)).await;
    let mut world = shared.lock();
    let world = &mut *world;
    let Some(txn) = open_transaction(world, producer, &id)? else {
        return Ok(());
    };
    purge(world, txn, RDKafkaErrorCode::PurgeQueue);
    end(world, producer, txn, TxnStatus::Aborted);
    Ok(())
}

/// Ends `producer`'s transaction `txn` as `status`.
fn end(world: &mut World, producer: u64, txn: u64, status: TxnStatus) {
    tracing::debug!(target: "sim", producer, txn, ?status, "transaction ended");
    if let Some(state) = world.producers.get_mut(&producer) {
        state.open_txn = None;
    }
    match status {
        TxnStatus::Committed => world.committed(txn),
        TxnStatus::Aborted => world.aborted(txn),
        TxnStatus::Open => {}
    }
}

/// Sends the report of `record` to its producer, if it still listens.
fn report(
    world: &World,
    record: &InFlight,
    result: std::result::Result<(i32, i64), (RDKafkaErrorCode, String)>,
) {
    tracing::debug!(target: "sim", producer = record.producer, id = %record.id, ?result, "report");
    if let Some(reports) = world.reports_to(record.producer) {
        let sent = reports.try_send(DeliveryReport {
            id: record.id,
            result,
            reported_at: clock::now(),
        });
        // The relay dropped the channel (a replaced producer): nobody listens.
        drop(sent);
    }
}

/// The broker answers for up to `n` records: each time the first record in flight
/// of a producer's partition (an idempotent producer keeps that order).
pub(super) fn answer(world: &mut World, n: usize) {
    for _ in 0..n {
        if world.in_flight.is_empty() {
            return;
        }
        let pick = world.rng.index(world.in_flight.len());
        let (producer, partition) = (
            world.in_flight[pick].producer,
            world.in_flight[pick].partition,
        );
        let Some(head) = world
            .in_flight
            .iter()
            .position(|r| r.producer == producer && r.partition == partition)
        else {
            return;
        };
        let record = world.in_flight.remove(head);
        resolve(world, record);
    }
}

fn resolve(world: &mut World, record: InFlight) {
    if world.reports_to(record.producer).is_none() {
        // A gone producer's records were settled when it went (`settle_gone`).
        return;
    }
    let outbox = matches!(record.payload, Payload::Outbox(_));
    let failure = if let Some(code) = refusal(world, &record) {
        Some(code)
    } else {
        match world.rng.below(100) {
            0..8 => Some(RDKafkaErrorCode::RequestTimedOut),
            8..10 if outbox => Some(RDKafkaErrorCode::InvalidRecord),
            _ => None,
        }
    };
    if world
        .producers
        .get(&record.producer)
        .is_some_and(|p| p.alone)
        && failure.is_none()
    {
        world.stats.alone_acks += 1;
    }
    if failure == Some(RDKafkaErrorCode::MessageSizeTooLarge) {
        world.stats.size_refusals += 1;
    }
    match failure {
        None => {
            let offset = land(world, &record);
            world.stats.acks += 1;
            report(world, &record, Ok((record_partition(&record), offset)));
        }
        Some(code) => {
            // The later records of the partition fail with it (idempotence keeps
            // their order by failing them).
            let (later, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut world.in_flight)
                .into_iter()
                .partition(|r| r.producer == record.producer && r.partition == record.partition);
            world.in_flight = kept;
            for failed in std::iter::once(record).chain(later) {
                world.stats.failures += 1;
                if let Some(txn) = failed.txn.and_then(|t| world.txns.get_mut(&t)) {
                    txn.failed = true;
                }
                report(world, &failed, Err((code, format!("simulated: {code:?}"))));
            }
        }
    }
}

/// Why the broker refuses `record` whenever it is sent: its topic does not exist
/// yet, or the record breaks a policy.
fn refusal(world: &World, record: &InFlight) -> Option<RDKafkaErrorCode> {
    let Payload::Outbox(r) = &record.payload else {
        return None;
    };
    if world.topic_missing {
        return Some(RDKafkaErrorCode::UnknownTopicOrPartition);
    }
    let row = world
        .any_tx(r.row.tx)
        .and_then(|tx| tx.rows.get(usize::try_from(r.row.ordinal).ok()?))?;
    // Its batch is too large when other records of the partition travel with it
    // (the record resolved is out of `in_flight` already).
    let alone = world
        .producers
        .get(&record.producer)
        .is_some_and(|p| p.alone);
    let with_others = world
        .in_flight
        .iter()
        .any(|r| r.producer == record.producer && r.partition == record.partition);
    if row.big_batch && with_others && !alone {
        return Some(RDKafkaErrorCode::MessageSizeTooLarge);
    }
    row.refused.then_some(RDKafkaErrorCode::PolicyViolation)
}

fn record_partition(record: &InFlight) -> i32 {
    match record.payload {
        Payload::Outbox(_) => i32::try_from(record.partition).unwrap_or(0),
        Payload::Progress(_) => 0,
    }
}

/// Appends `record` to its partition; returns its offset.
fn land(world: &mut World, record: &InFlight) -> i64 {
    match &record.payload {
        Payload::Outbox(r) => {
            match r.txn {
                None => {
                    world.resolved.insert(r.row);
                }
                Some(txn) => world.txn_rows.entry(txn).or_default().push(r.row),
            }
            let log = &mut world.partitions[record.partition];
            log.push(r.clone());
            i64::try_from(log.len() - 1).unwrap_or(i64::MAX)
        }
        Payload::Progress(entry) => {
            world.progress.push(entry.clone());
            i64::try_from(world.progress.len() - 1).unwrap_or(i64::MAX)
        }
    }
}

/// The progress record read back, read_committed.
pub(super) struct SimProgressReader {
    pub(super) shared: Shared,
}

impl ProgressReader for SimProgressReader {
    fn read_latest<'a>(
        &'a self,
        _topic: &'a str,
        slot: &'a str,
    ) -> Boxed<'a, Result<Option<ProgressRecord>>> {
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(2)).await;
            let world = self.shared.lock();
            let latest = world
                .progress
                .iter()
                .rev()
                .find(|e| e.key == slot && committed(&world, e.txn));
            match latest {
                None => Ok(None),
                Some(entry) => Ok(Some(ProgressRecord::decode(&entry.value)?)),
            }
        })
    }
}
