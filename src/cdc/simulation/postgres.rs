//! The simulated PostgreSQL behind the database and stream ports: a walsender that
//! sends every transaction committing at or after where it starts (never before
//! the slot's confirmed position, as PostgreSQL moves a start back up to it), a
//! slot that a status update moves forward and a crash rewinds to its last
//! checkpoint, the position row, the poison table and its writer.

use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;

use super::world::{PositionRow, Row, RowId, Shared, Slot, Walsender, World};
use crate::cdc::metrics::Health;
use crate::cdc::ports::Boxed;
use crate::cdc::ports::database::{
    Opened, PositionWrites, Refusal, SaveError, SessionDatabase, Start,
};
use crate::cdc::ports::stream::WalStream;
use crate::cdc::progress::SavePhase;
use crate::cdc::start::{self, Remembered, ServerView, SlotView, StartPlan};
use crate::cdc::wal_identity::{TxNames, Verdict, verdict_of};
use crate::config::{Config, DeliveryMode, SlotLossMode};
use crate::error::{Error, Result};
use crate::hashing::HashSet;
use crate::lsn::Lsn;
use crate::outbox::PayloadFormat;
use crate::outbox::message::{encode_frame, prefix_of};
use crate::outbox::position::{Position, ServerHistory};
use crate::poison::{
    Parked, ParkedKey, PoisonInsertError, PoisonOutcome, PoisonRequest, RecordedPoison,
};
use crate::postgres::pgoutput::testkit::encode;
use crate::postgres::pgoutput::{
    Begin, ColumnValue, Commit, Insert, LogicalDecodingMessage, LogicalReplicationMessage, PgStr,
    Relation, RelationColumn, TupleData,
};
use crate::postgres::prerequisite::Prerequisite;
use crate::postgres::replication::ReplicationError;
use crate::postgres::replication::frames::{ServerFrame, StandbyStatus};

/// The outbox table's relation id.
const RELATION_ID: u32 = 16_385;

/// A walsender with nothing to send sends a keepalive this often.
const KEEPALIVE_EVERY: Duration = Duration::from_secs(5);

/// The database port of one relay process.
pub(super) struct SimDatabase {
    shared: Shared,
    config: Config,
    opened: Option<Opened>,
}

impl SimDatabase {
    pub(super) fn new(shared: Shared, config: Config) -> SimDatabase {
        SimDatabase {
            shared,
            config,
            opened: None,
        }
    }
}

/// PostgreSQL is restarting: a transient error, as a refused connection is.
fn down() -> Error {
    Error::Io(std::io::Error::new(
        std::io::ErrorKind::ConnectionRefused,
        "simulated: PostgreSQL is restarting",
    ))
}

fn server_view(world: &World) -> ServerView {
    ServerView {
        history: world.history,
        wal_end: world.wal_end(),
        forks: world.forks.clone(),
        started: Some(world.server_started),
    }
}

impl SessionDatabase for SimDatabase {
    fn plan(
        &mut self,
        remembered: Option<Remembered>,
        _busy_timeout: Duration,
    ) -> Boxed<'_, Result<StartPlan>> {
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(2)).await;
            let world = self.shared.lock();
            if !world.up {
                return Err(down());
            }
            let server = server_view(&world);
            let active = world
                .active
                .filter(|pid| world.walsenders.get(pid).is_some_and(|w| !w.broken));
            let slot = world.slot.map(|s| SlotView {
                confirmed: s.confirmed,
                invalidated: None,
                active_pid: active,
            });
            let recorded = world.position.map(|p| Position {
                history: p.history,
                confirmed: p.confirmed,
                delivered_xmin: None,
                delivered_lsn: None,
                slot_lost: None,
                resyncs: 0,
            });
            self.opened = Some(Opened {
                server: server.clone(),
                writes_started: server.started,
            });
            let slot_name = self.config.postgres.slot_name();
            Ok(start::plan(
                &slot_name,
                &server,
                recorded.as_ref(),
                slot,
                remembered,
            ))
        })
    }

    fn carry_out<'a>(
        &'a mut self,
        plan: StartPlan,
        _remembered: Option<Remembered>,
        _busy_timeout: Duration,
        _health: &'a Health,
    ) -> Boxed<'a, Result<Start>> {
        Box::pin(async move {
            let mut world = self.shared.lock();
            if !world.up {
                return Err(down());
            }
            let slot = self.config.postgres.slot_name();
            match plan {
                StartPlan::Fresh => {
                    let at = world.wal_end();
                    world.inherited_slot = false;
                    world.slot = Some(Slot {
                        confirmed: at,
                        persisted: at,
                    });
                    world.position = Some(PositionRow {
                        history: world.history,
                        confirmed: at,
                    });
                    Ok(Start {
                        at,
                        fresh_core: true,
                    })
                }
                StartPlan::Resume {
                    from,
                    history_changed,
                    server_restarted,
                    ..
                } => {
                    let history = world.history;
                    match &mut world.position {
                        Some(row) if !history_changed && row.history == history => {
                            row.confirmed = row.confirmed.max(from);
                        }
                        _ => {
                            world.position = Some(PositionRow {
                                history,
                                confirmed: from,
                            });
                        }
                    }
                    Ok(Start {
                        at: from,
                        fresh_core: server_restarted || history_changed,
                    })
                }
                StartPlan::Busy { pid } => Err(Prerequisite::SlotBusy {
                    slot,
                    pid,
                    waited_secs: 0,
                }
                .into()),
                StartPlan::Lost { loss, .. }
                    if self.config.relay.on_slot_loss == SlotLossMode::Fail =>
                {
                    Err(Prerequisite::SlotLost {
                        detail: loss.to_string(),
                    }
                    .into())
                }
                StartPlan::Lost { loss, .. } => {
                    tracing::debug!(target: "sim", %loss, "the slot is lost: resync");
                    let at = super::resync::resync(
                        &mut world,
                        self.config.kafka.delivery == DeliveryMode::ExactlyOnce,
                    );
                    Ok(Start {
                        at,
                        fresh_core: true,
                    })
                }
            }
        })
    }

    fn opened(&self) -> Result<Opened> {
        self.opened.clone().ok_or(Error::RelayNotPlanned)
    }

    fn parked_keys(&mut self) -> Boxed<'_, Result<HashSet<ParkedKey>>> {
        Box::pin(async { Ok(HashSet::default()) })
    }

    fn recorded_poison(&mut self, start: Lsn) -> Boxed<'_, RecordedPoison> {
        Box::pin(async move {
            let mut world = self.shared.lock();
            world.recorded_reads += 1;
            let wal_end = world.wal_end();
            let rows = world
                .poison
                .iter()
                .filter_map(|(_, row)| {
                    let lsn = row.lsn?;
                    (lsn >= start && lsn <= wal_end)
                        .then(|| ((lsn, row.tx_position.unwrap_or(0)), row.clone()))
                })
                .collect::<Vec<_>>();
            tracing::debug!(target: "sim", %start, %wal_end, names = ?rows.iter().map(|(name, r)| (name.0, name.1, r.fields.idempotency_key.clone())).collect::<Vec<_>>(), "recorded poison read");
            RecordedPoison::of_rows(rows, self.config.relay.poison_copy_limit_bytes)
        })
    }

    fn position_writes(
        &self,
        history: ServerHistory,
        server_started: Option<i64>,
    ) -> Box<dyn PositionWrites> {
        Box::new(SimPositionWrites {
            shared: self.shared.clone(),
            history,
            server_started,
        })
    }

    fn start_streaming<'a>(
        &'a mut self,
        _slot: &'a str,
        start: Lsn,
        _options: &'a [(&'a str, &'a str)],
    ) -> Boxed<'a, std::result::Result<Box<dyn WalStream>, ReplicationError>> {
        Box::pin(async move {
            let mut world = self.shared.lock();
            if !world.up {
                return Err(ReplicationError::ConnectionClosed);
            }
            // The relay streams from it: from now on it confirms it.
            world.inherited_slot = false;
            // PostgreSQL starts a slot no earlier than its confirmed position.
            let from = world.slot.map_or(start, |s| start.max(s.confirmed));
            let pid = world.next_pid;
            world.next_pid += 1;
            let walsender = Walsender {
                next_tx: world.first_tx_from(from),
                next_msg: 0,
                relations_sent: 0,
                broken: false,
                sent_end: from,
                cut_after: world
                    .flaky_until
                    .is_some_and(|until| tokio::time::Instant::now() < until)
                    .then(|| 1 + world.rng.below(60)),
            };
            tracing::debug!(target: "sim", pid, %start, %from, next_tx = walsender.next_tx, "start_replication");
            world.walsenders.insert(pid, walsender);
            world.active = Some(pid);
            Ok(Box::new(SimStream {
                shared: self.shared.clone(),
                pid,
            }) as Box<dyn WalStream>)
        })
    }

    fn release(&mut self) {}

    fn wal_end(&mut self) -> Boxed<'_, Result<Lsn>> {
        Box::pin(async move {
            let world = self.shared.lock();
            if world.up {
                Ok(world.wal_end())
            } else {
                Err(down())
            }
        })
    }

    fn slot_active_pid(&self) -> Boxed<'_, Option<Option<i32>>> {
        Box::pin(async move {
            let world = self.shared.lock();
            world.up.then_some(world.active)
        })
    }

    fn wal_identity<'a>(
        &'a mut self,
        names: &'a TxNames,
        confirmed: Lsn,
        start: Lsn,
    ) -> Boxed<'a, Result<Verdict>> {
        // The server keeps every commit time (`track_commit_timestamp = on`).
        Box::pin(async move {
            let world = self.shared.lock();
            Ok(verdict_of(names, confirmed, start, |xid| {
                world.committed_at(xid)
            }))
        })
    }
}

/// The position saver's writes to the simulated position row.
struct SimPositionWrites {
    shared: Shared,
    history: ServerHistory,
    server_started: Option<i64>,
}

impl PositionWrites for SimPositionWrites {
    fn save(&mut self, target: Lsn) -> Boxed<'_, std::result::Result<(), SaveError>> {
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(1)).await;
            let mut world = self.shared.lock();
            if !world.up {
                return Err(SaveError {
                    message: "simulated: PostgreSQL is restarting".to_owned(),
                    phase: SavePhase::Connecting,
                    sqlstate: Some("57P03".to_owned()),
                    refused: None,
                });
            }
            if self.server_started != Some(world.server_started) {
                return Err(SaveError {
                    message: "simulated: the server restarted since this session started"
                        .to_owned(),
                    phase: SavePhase::Connecting,
                    sqlstate: None,
                    refused: Some(Refusal::ServerRestarted),
                });
            }
            let history = self.history;
            tracing::debug!(target: "sim", %target, "position saved");
            match &mut world.position {
                Some(row) if row.history == history => {
                    row.confirmed = row.confirmed.max(target);
                    Ok(())
                }
                Some(row) => Err(SaveError {
                    message: format!("simulated: the row belongs to {}", row.history),
                    phase: SavePhase::Statement,
                    sqlstate: None,
                    refused: Some(Refusal::NotOurs),
                }),
                None => {
                    world.position = Some(PositionRow {
                        history,
                        confirmed: target,
                    });
                    Ok(())
                }
            }
        })
    }
}

/// A walsender's stream.
struct SimStream {
    shared: Shared,
    pid: i32,
}

impl SimStream {
    /// The next message the walsender has for the relay, if any.
    fn take(&self) -> std::result::Result<Option<ServerFrame>, ReplicationError> {
        let mut world = self.shared.lock();
        let world = &mut *world;
        let Some(walsender) = world.walsenders.get(&self.pid) else {
            return Err(ReplicationError::ConnectionClosed);
        };
        if walsender.broken {
            return Err(ReplicationError::ConnectionClosed);
        }
        if walsender.next_tx >= world.wal.len() {
            return Ok(None);
        }
        if world.rng.percent(2) {
            return Ok(Some(keepalive(world, self.pid, true)));
        }
        // A connection cut in the middle of the stream, mid-transaction too (a
        // session lost while it re-reads what a lost session left unresolved).
        if world.rng.below(1_000) < 3 {
            if let Some(w) = world.walsenders.get_mut(&self.pid) {
                w.broken = true;
            }
            world.stats.cuts += 1;
            tracing::debug!(target: "sim", pid = self.pid, "connection cut mid-stream");
            return Err(ReplicationError::ConnectionClosed);
        }
        let Some(walsender) = world.walsenders.get_mut(&self.pid) else {
            return Err(ReplicationError::ConnectionClosed);
        };
        match &mut walsender.cut_after {
            Some(0) => {
                walsender.broken = true;
                world.stats.cuts += 1;
                world.stats.flaky_cuts += 1;
                tracing::debug!(target: "sim", pid = self.pid, "a flaky walsender drops the connection");
                return Err(ReplicationError::ConnectionClosed);
            }
            Some(left) => *left -= 1,
            None => {}
        }
        let tx = &world.wal[walsender.next_tx];
        let rows = tx.rows.len();
        let (lsn, message) = if walsender.next_msg == 0 {
            walsender.next_msg = 1;
            (
                Lsn(tx.final_lsn.0.saturating_sub(1)),
                LogicalReplicationMessage::Begin(Begin {
                    final_lsn: tx.final_lsn,
                    commit_time: tx.commit_time,
                    xid: tx.xid,
                }),
            )
        } else if walsender.next_msg <= rows
            && !tx.rows[walsender.next_msg - 1].message
            && walsender.relations_sent & (1 << tx.rows[walsender.next_msg - 1].table) == 0
        {
            // Before a table's first row in the stream, its Relation.
            let table = tx.rows[walsender.next_msg - 1].table;
            walsender.relations_sent |= 1 << table;
            (
                tx.final_lsn,
                LogicalReplicationMessage::Relation(relation(table)),
            )
        } else if walsender.next_msg <= rows {
            let ordinal = walsender.next_msg - 1;
            walsender.next_msg += 1;
            let row = RowId {
                tx: tx.seq,
                ordinal: u32::try_from(ordinal).unwrap_or(u32::MAX),
            };
            let written = &tx.rows[ordinal];
            let change = if written.message {
                LogicalReplicationMessage::Message(message(row, written, tx.final_lsn))
            } else {
                LogicalReplicationMessage::Insert(insert(row, written))
            };
            (tx.final_lsn, change)
        } else {
            walsender.next_tx += 1;
            walsender.next_msg = 0;
            walsender.sent_end = tx.end_lsn;
            (
                tx.end_lsn,
                LogicalReplicationMessage::Commit(Commit {
                    flags: 0,
                    commit_lsn: tx.final_lsn,
                    end_lsn: tx.end_lsn,
                    commit_time: tx.commit_time,
                }),
            )
        };
        Ok(Some(ServerFrame::XLogData {
            wal_start: lsn,
            wal_end: lsn,
            send_time: 0,
            data: encode(&message),
        }))
    }
}

/// A keepalive whose `wal_end` never passes a commit not sent yet.
fn keepalive(world: &World, pid: i32, reply_requested: bool) -> ServerFrame {
    let wal_end = match world.walsenders.get(&pid) {
        Some(w) if w.next_tx >= world.wal.len() => world.wal_end(),
        Some(w) => w.sent_end,
        None => Lsn::ZERO,
    };
    ServerFrame::Keepalive {
        wal_end,
        send_time: 0,
        reply_requested,
    }
}

impl WalStream for SimStream {
    fn next_frame(
        &mut self,
    ) -> Boxed<'_, std::result::Result<Option<ServerFrame>, ReplicationError>> {
        Box::pin(async move {
            loop {
                let notify = self.shared.notify.clone();
                let notified = notify.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if let Some(frame) = self.take()? {
                    return Ok(Some(frame));
                }
                tokio::select! {
                    biased;
                    () = notified => {}
                    () = tokio::time::sleep(KEEPALIVE_EVERY) => {
                        let world = self.shared.lock();
                        return Ok(Some(keepalive(&world, self.pid, false)));
                    }
                }
            }
        })
    }

    fn frame_ready(&mut self) -> std::result::Result<bool, ReplicationError> {
        let world = self.shared.lock();
        match world.walsenders.get(&self.pid) {
            Some(w) if !w.broken => Ok(w.next_tx < world.wal.len()),
            _ => Err(ReplicationError::ConnectionClosed),
        }
    }

    fn read_more(&mut self) -> Boxed<'_, std::result::Result<(), ReplicationError>> {
        Box::pin(std::future::pending())
    }

    fn hold_readiness(&self) -> std::result::Result<bool, ReplicationError> {
        // No socket to hold: the relay never pauses its reads here.
        Ok(false)
    }

    fn release_readiness(&self) -> std::result::Result<(), ReplicationError> {
        Ok(())
    }

    fn send_status<'a>(
        &'a mut self,
        status: &'a StandbyStatus,
    ) -> Boxed<'a, std::result::Result<(), ReplicationError>> {
        Box::pin(async move {
            let mut world = self.shared.lock();
            match world.walsenders.get(&self.pid) {
                Some(w) if !w.broken => {}
                _ => return Err(ReplicationError::ConnectionClosed),
            }
            if world.active == Some(self.pid)
                && let Some(slot) = &mut world.slot
            {
                slot.confirmed = slot.confirmed.max(status.flush);
                tracing::debug!(target: "sim", pid = self.pid, flush = %status.flush, "status");
            }
            Ok(())
        })
    }

    fn backend_pid(&self) -> Option<i32> {
        Some(self.pid)
    }

    fn finish(self: Box<Self>) -> Boxed<'static, std::result::Result<(), ReplicationError>> {
        // Dropping it closes the connection.
        Box::pin(async { Ok(()) })
    }
}

impl Drop for SimStream {
    /// The connection closes: the walsender exits and lets go of the slot.
    fn drop(&mut self) {
        let mut world = self.shared.lock();
        if let Some(w) = world.walsenders.get_mut(&self.pid) {
            w.broken = true;
        }
        if world.active == Some(self.pid) {
            world.active = None;
        }
    }
}

/// The Relation of outbox table `table`: `public.outbox`, or `public.outbox_b`,
/// both with the columns of `migrations/0001_outbox.sql`.
fn relation(table: u8) -> Relation {
    let column = |name: &str, type_oid: u32| RelationColumn {
        flags: 0,
        name: name.into(),
        type_oid,
        type_modifier: -1,
    };
    const UUID: u32 = 2950;
    const TEXT: u32 = 25;
    const JSONB: u32 = 3802;
    const TIMESTAMPTZ: u32 = 1184;
    const INT4: u32 = 23;
    Relation {
        xid: None,
        id: RELATION_ID + u32::from(table),
        namespace: "public".into(),
        name: if table == 0 { "outbox" } else { "outbox_b" }.into(),
        replica_identity: b'd',
        columns: vec![
            column("id", UUID),
            column("idempotency_key", TEXT),
            column("aggregate_type", TEXT),
            column("aggregate_id", TEXT),
            column("event_type", TEXT),
            column("topic", TEXT),
            column("headers", JSONB),
            column("payload", JSONB),
            column("created_at", TIMESTAMPTZ),
            column("sent_at", TIMESTAMPTZ),
            column("attempts", INT4),
            column("last_error", TEXT),
        ],
    }
}

/// The payload of event `row`, written as `written`: NULL when unmappable, padded
/// past the producer's limit when oversize.
fn payload(row: RowId, written: &Row) -> Option<String> {
    if written.unmappable {
        None
    } else if written.oversize {
        let pad = "x".repeat(super::kafka::MAX_MESSAGE_BYTES);
        Some(format!(
            "{{\"row\":\"{}\",\"pad\":\"{pad}\"}}",
            row.key_text()
        ))
    } else {
        Some(format!("{{\"row\":\"{}\"}}", row.key_text()))
    }
}

/// The message `outbox_emit` writes for event `row` (the frame of
/// `outbox::message`): the fields of [`insert`]'s row, in its table's prefix.
fn message(row: RowId, written: &Row, lsn: Lsn) -> LogicalDecodingMessage {
    let key = row.key_text();
    let entity = format!("e{}", written.entity);
    let payload = payload(row, written);
    let fields: [Option<&[u8]>; 8] = [
        Some(key.as_bytes()),
        Some(b"Order"),
        Some(entity.as_bytes()),
        Some(b"OrderChanged"),
        None,
        None,
        payload.as_deref().map(str::as_bytes),
        Some(b"2026-12-07 00:00:00+00"),
    ];
    let table = if written.table == 0 {
        "public.outbox"
    } else {
        "public.outbox_b"
    };
    LogicalDecodingMessage {
        xid: None,
        flags: LogicalDecodingMessage::TRANSACTIONAL,
        lsn,
        prefix: PgStr::new(Bytes::from(prefix_of(table))).unwrap_or_default(),
        content: Bytes::from(encode_frame(PayloadFormat::Json, fields)),
    }
}

/// The Insert of outbox row `row`, written as `written` (a NULL payload when
/// unmappable).
fn insert(row: RowId, written: &Row) -> Insert {
    let text = |s: String| ColumnValue::Text(Bytes::from(s));
    let entity = written.entity;
    let payload = payload(row, written).map_or(ColumnValue::Null, text);
    Insert {
        xid: None,
        relation_id: RELATION_ID + u32::from(written.table),
        tuple: TupleData {
            columns: vec![
                text(row.uuid()),
                text(row.key_text()),
                text("Order".to_owned()),
                text(format!("e{entity}")),
                text("OrderChanged".to_owned()),
                ColumnValue::Null,
                ColumnValue::Null,
                payload,
                text("2026-12-07 00:00:00+00".to_owned()),
                ColumnValue::Null,
                text("0".to_owned()),
                ColumnValue::Null,
            ],
        },
    }
}

/// The poison writer: commits each row to the simulated poison table (or fails,
/// now and then, as an insert can), and says so.
pub(super) async fn poison_writer(
    shared: Shared,
    mut requests: mpsc::Receiver<PoisonRequest>,
    outcomes: mpsc::Sender<PoisonOutcome>,
) {
    while let Some(PoisonRequest { id, row }) = requests.recv().await {
        let named = row.fields.idempotency_key.as_deref().and_then(RowId::parse);
        let Some(named) = named else {
            panic!("a poison row without a simulated row's key: {row:?}");
        };
        // The insert is on its way to the server until it commits: a kill in
        // between may leave its backend to commit it later (`Schedule::kill`).
        let (token, pause) = {
            let mut world = shared.lock();
            let token = world.next_poison_token;
            world.next_poison_token += 1;
            world.poison_pending.insert(token, (named, row.clone()));
            (token, Duration::from_millis(1 + world.rng.below(20)))
        };
        tokio::time::sleep(pause).await;
        let result = {
            let mut world = shared.lock();
            world.poison_pending.remove(&token);
            if !world.up || world.rng.percent(3) {
                Err(PoisonInsertError::Batch(
                    "simulated: the insert failed".to_owned(),
                ))
            } else {
                world.poison_committed(named, row, None);
                Ok(Parked::Recorded)
            }
        };
        if outcomes.send(PoisonOutcome { id, result }).await.is_err() {
            return;
        }
    }
}
