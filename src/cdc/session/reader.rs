//! The stream reader of a session: asks the server for the stream (the pgoutput
//! options), decodes each frame, maps outbox rows and messages to events and admits
//! them to the core, pauses reading once caught up (`cdc::read_pacing`), and
//! watches the server's silence (`relay.receive_timeout_secs`).
//!
//! pgoutput v1 sends each transaction whole at commit: a `Begin` names its commit
//! LSN and time, which every event of the transaction carries (`source_lsn`, the
//! latency metric, the progress record's names of transactions), then its rows,
//! then its `Commit` (PostgreSQL's `logicalrep_write_begin`/`_commit`,
//! `src/backend/replication/logical/proto.c`).
//!
//! It owns that state and nothing else: the core, the event records, the Kafka
//! transactions and the producer are passed in by the loop.

use std::time::{Duration, Instant};

use super::ends::{FrameError, Lost};
use super::transaction_driver::TransactionDriver;
use super::{Delivery, replication_error};
use crate::cdc::binary::BinaryDecoding;
use crate::cdc::in_flight::{InFlight, order_key};
use crate::cdc::instruments::Instruments;
use crate::cdc::metrics::Health;
use crate::cdc::ports::clock;
use crate::cdc::ports::database::SessionDatabase;
use crate::cdc::ports::stream::WalStream;
use crate::cdc::progress::{Core, ProtocolError, Records, StatusUpdate};
use crate::cdc::read_pacing::ReadPacing;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::lifecycle::Shutdown;
use crate::lsn::Lsn;
use crate::outbox::message::{MessageMapped, is_outbox_prefix};
use crate::outbox::{Mapped, OutboxMapper};
use crate::postgres::pgoutput::{Decoder, LogicalReplicationMessage};
use crate::postgres::replication::ReplicationError;
use crate::postgres::replication::frames::{ServerFrame, StandbyStatus, pg_epoch_micros};

/// pgoutput protocol version requested. v1 sends each transaction whole at commit,
/// which is what the ack tracker models (one transaction at a time).
const PROTO_VERSION: u8 = 1;

/// The parts a frame's messages reach.
pub(super) struct Intake<'a> {
    pub(super) core: &'a mut Core,
    pub(super) records: &'a mut Records<InFlight>,
    /// For the names of the transactions (exactly-once's progress record).
    pub(super) transactions: &'a mut TransactionDriver,
    pub(super) instruments: &'a mut Instruments,
}

/// How a pause in reading ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pause {
    /// It ran its length, or a burst of bytes ended it early.
    Taken,
    /// Shutdown came during it.
    ShutDown,
}

/// What the session last heard from the server ([`StreamReader::watch_server`]).
#[derive(Debug, Clone, Copy)]
struct Hearing {
    /// The last frame read, or the last moment the relay was not reading (a paused
    /// read is no silence of the server's).
    heard_at: Instant,
    /// A keepalive was asked for since then.
    asked: bool,
}

/// See the module documentation.
pub(super) struct StreamReader {
    mapper: OutboxMapper,
    /// Whether sessions ask for binary-format values.
    binary: BinaryDecoding,
    /// Ask pgoutput for logical-decoding messages (heartbeats, the message
    /// outbox); PostgreSQL 14+.
    messages_option: bool,
    /// `postgres.shard`: only shard 0 relays the message outbox.
    shard: u32,
    /// `relay.read_pause_ms`: whether to wait before reading again once caught up.
    pacing: ReadPacing,
    /// Commit LSN of the open transaction (from its Begin), for `source_lsn`.
    current_commit_lsn: Lsn,
    /// Commit time of the open transaction (from its Begin), for the latency metric.
    current_commit_time: i64,
    /// The last status update sent in this session: repeated with `reply_requested`
    /// to make a silent server answer ([`StreamReader::watch_server`]).
    last_status: Option<StatusUpdate>,
    hearing: Hearing,
    /// `relay.receive_timeout_secs`, at least twice the server's
    /// `wal_sender_timeout`; zero when either is off.
    receive_timeout: Duration,
}

impl StreamReader {
    pub(super) fn new(
        config: &Config,
        mapper: OutboxMapper,
        binary: BinaryDecoding,
        messages_option: bool,
        wal_sender_timeout: Duration,
    ) -> StreamReader {
        StreamReader {
            mapper,
            binary,
            messages_option,
            shard: config.postgres.shard,
            pacing: ReadPacing::new(config.relay.read_pause_ms),
            current_commit_lsn: Lsn::ZERO,
            current_commit_time: 0,
            last_status: None,
            hearing: Hearing {
                heard_at: clock::now(),
                asked: false,
            },
            receive_timeout: receive_timeout(
                Duration::from_secs(config.relay.receive_timeout_secs),
                wal_sender_timeout,
            ),
        }
    }

    /// A new session on a fresh core: the relations of the last one are forgotten.
    pub(super) fn reset_session(&mut self) {
        self.mapper.reset_session();
    }

    /// Starts streaming from `slot` at `start` on `conn`, with the pgoutput options
    /// this server and configuration allow.
    ///
    /// # Errors
    ///
    /// The server refused; [`Error::RelaySlotTaken`] when another walsender holds
    /// the slot.
    pub(super) async fn start(
        &mut self,
        database: &mut dyn SessionDatabase,
        config: &Config,
        slot: &str,
        start: Lsn,
    ) -> Result<Box<dyn WalStream>> {
        let publication = config.postgres.publication_name();
        let publications =
            crate::postgres::replication::publication_names_option(&[publication.as_str()]);
        let version = PROTO_VERSION.to_string();
        let mut options = vec![
            ("proto_version", version.as_str()),
            ("publication_names", publications.as_str()),
        ];
        if self.messages_option {
            options.push(("messages", "true"));
        }
        self.binary.start_session();
        if self.binary.active() {
            options.push(("binary", "true"));
        }
        database
            .start_streaming(slot, start, &options)
            .await
            .map_err(|e| {
                // Lost a race for the slot (e.g. with the walsender of a relay that
                // just died): retry; wait_for_slot applies the busy timeout.
                if e.is_slot_in_use() {
                    Error::RelaySlotTaken(e)
                } else {
                    replication_error(e)
                }
            })
    }

    /// The session's loop starts: nothing sent yet, the server just heard.
    pub(super) fn streaming(&mut self) {
        self.last_status = None;
        self.hearing = Hearing {
            heard_at: clock::now(),
            asked: false,
        };
    }

    /// The loop does not read now (the window is full): no silence of the server's.
    pub(super) fn not_reading(&mut self) {
        self.hearing.heard_at = clock::now();
    }

    /// A status update went out.
    pub(super) fn status_sent(&mut self, status: StatusUpdate) {
        self.last_status = Some(status);
    }

    /// Handles one frame of the CopyBoth stream. An `Err` ends the session (the
    /// stream is inconsistent; restarting from the slot is always safe).
    pub(super) fn on_frame(
        &mut self,
        frame: ServerFrame,
        intake: Intake<'_>,
        health: &Health,
    ) -> std::result::Result<(), FrameError> {
        let now = clock::now();
        if matches!(frame, ServerFrame::XLogData { .. }) {
            self.pacing.frame_read();
        }
        self.hearing.heard_at = now;
        if self.hearing.asked {
            self.hearing.asked = false;
            health.set_alert("replication", None);
        }
        match frame {
            ServerFrame::XLogData { wal_end, data, .. } => {
                intake.core.received(wal_end);
                let message = Decoder::new(PROTO_VERSION)
                    .decode(data)
                    .map_err(FrameError::Decode)?;
                self.on_message(message, intake, now)
            }
            ServerFrame::Keepalive {
                wal_end,
                reply_requested,
                ..
            } => {
                intake.core.keepalive(wal_end, reply_requested, now);
                Ok(())
            }
        }
    }

    fn on_message(
        &mut self,
        message: LogicalReplicationMessage,
        intake: Intake<'_>,
        now: Instant,
    ) -> std::result::Result<(), FrameError> {
        match message {
            LogicalReplicationMessage::Begin(begin) => {
                tracing::trace!(xid = begin.xid, final_lsn = %begin.final_lsn, "begin");
                self.current_commit_lsn = begin.final_lsn;
                self.current_commit_time = begin.commit_time;
                intake.transactions.transaction_begun(
                    begin.final_lsn,
                    begin.xid,
                    begin.commit_time,
                );
                Ok(intake.core.begin(begin.final_lsn, begin.xid)?)
            }
            LogicalReplicationMessage::Commit(commit) => {
                tracing::trace!(commit_lsn = %commit.commit_lsn, end_lsn = %commit.end_lsn, "commit");
                intake.transactions.transaction_ended(
                    commit.commit_lsn,
                    commit.end_lsn,
                    intake.core.confirmed(),
                );
                Ok(intake.core.commit(commit.commit_lsn, commit.end_lsn, now)?)
            }
            LogicalReplicationMessage::Relation(relation) => {
                self.binary.check(&relation)?;
                self.mapper.on_relation(&relation);
                Ok(())
            }
            LogicalReplicationMessage::Insert(insert) => {
                let mapped = self.mapper.map_insert(&insert, self.current_commit_lsn)?;
                Ok(self.admit(mapped, intake, now)?)
            }
            LogicalReplicationMessage::Message(message) => {
                intake.instruments.logical_message(&message);
                // Messages pass every shard's publication: only shard 0 relays them
                // (`migrate` installs no `outbox_emit` when sharded).
                if self.shard > 0 && is_outbox_prefix(message.prefix.as_bytes()) {
                    intake
                        .instruments
                        .ignored_message(&MessageMapped::OtherOutbox, &message);
                    return Ok(());
                }
                match self.mapper.map_message(&message, self.current_commit_lsn) {
                    MessageMapped::Outbox(mapped) => Ok(self.admit(mapped, intake, now)?),
                    ignored => {
                        intake.instruments.ignored_message(&ignored, &message);
                        Ok(())
                    }
                }
            }
            // Updates, deletes and truncates of the outbox are not events (the
            // publication normally does not even send them); origins and types
            // carry nothing to relay.
            _ => Ok(()),
        }
    }

    /// Admits an outbox row to the core; the shell keeps the record only while the
    /// core has something to do for it (an event a lost session already resolved is
    /// resolved at admission).
    fn admit(
        &self,
        mapped: Mapped,
        intake: Intake<'_>,
        now: Instant,
    ) -> std::result::Result<(), ProtocolError> {
        let Intake {
            core,
            records,
            instruments,
            ..
        } = intake;
        match mapped {
            Mapped::NotOutbox => Ok(()),
            Mapped::Event(event) => {
                let id = core.admit_keyed(event.byte_size(), Some(order_key(&event)), now)?;
                instruments.received(self.current_commit_lsn, self.current_commit_time);
                records.admitted(
                    core,
                    id,
                    InFlight::Event {
                        event,
                        committed_at: self.current_commit_time,
                        received_at: now,
                        produced_at: now,
                        last_error: None,
                        parked: false,
                        recorded_before: false,
                        alone: false,
                        delivered: None,
                    },
                );
                Ok(())
            }
            Mapped::Unmappable(row) => {
                let size = row.fields.payload.as_ref().map_or(0, String::len);
                let id = core.admit_unmappable(size)?;
                records.admitted(
                    core,
                    id,
                    InFlight::Unmappable {
                        fields: Box::new(row.fields),
                        error_kind: row.error_kind,
                        reason: row.reason,
                        lsn: self.current_commit_lsn,
                    },
                );
                Ok(())
            }
        }
    }

    /// A pause in reading before the loop waits (`cdc::read_pacing`), when the loop
    /// may read (`may_read`) and the stream has nothing more right now; `None`: read
    /// as usual. A pause is taken only where the socket's readiness can be held: one
    /// without it could not be ended by a burst. What the last read produced is sent
    /// first, if few records linger.
    ///
    /// # Errors
    ///
    /// The stream's: checking it, waiting on it or releasing its readiness failed.
    pub(super) async fn pause_if_caught_up(
        &mut self,
        stream: &mut dyn WalStream,
        shutdown: &mut Shutdown,
        may_read: bool,
        delivery: &mut Delivery,
        instruments: &Instruments,
    ) -> std::result::Result<Option<Pause>, ReplicationError> {
        let Some(pause) = self.pacing.pause_if_caught_up(may_read) else {
            return Ok(None);
        };
        if stream.frame_ready()? {
            return Ok(None);
        }
        self.pacing.pausing();
        if !hold_for_pause(stream) {
            return Ok(None);
        }
        if delivery.may_nudge_before_pause() {
            delivery.nudge();
        }
        let paused = pause_reading(stream, shutdown, pause).await?;
        if paused == Pause::Taken {
            instruments.read_pause();
        }
        Ok(Some(paused))
    }

    /// The receive timeout (`relay.receive_timeout_secs`): from half of it without a
    /// message the server is asked for a keepalive at every watchdog tick (the last
    /// status again, with `reply_requested`) and `/readyz` turns 503; after all of it
    /// the session is lost. A server that stops answering without closing the
    /// connection (a network partition drops packets, sends no RST) is noticed within
    /// the timeout, whatever TCP does.
    pub(super) async fn watch_server(
        &mut self,
        stream: &mut dyn WalStream,
        health: &Health,
    ) -> Option<Lost> {
        let timeout = self.receive_timeout;
        if timeout.is_zero() {
            return None;
        }
        let silent = clock::elapsed(self.hearing.heard_at);
        if silent >= timeout {
            return Some(Lost::ServerSilent {
                silent_secs: silent.as_secs(),
            });
        }
        if silent < timeout / 2 {
            return None;
        }
        if !self.hearing.asked {
            self.hearing.asked = true;
            tracing::warn!(
                silent_secs = silent.as_secs(),
                "no message from PostgreSQL; asking for keepalives"
            );
            health.set_alert(
                "replication",
                Some(format!(
                    "no message from PostgreSQL for {}s on the replication connection",
                    silent.as_secs()
                )),
            );
        }
        let status = self.last_status?;
        let ask = StatusUpdate {
            reply_requested: true,
            ..status
        };
        send_status(stream, ask).await.err().map(Lost::from)
    }
}

/// The receive timeout: never below twice the server's `wal_sender_timeout` (a
/// walsender replaying a large transaction it filters out reads its client's
/// messages only every half of that, so an answer can take that long); zero (off)
/// when `configured` is, or when the server's timeout is off (it then promises
/// nothing).
fn receive_timeout(configured: Duration, wal_sender_timeout: Duration) -> Duration {
    if configured.is_zero() || wal_sender_timeout.is_zero() {
        return Duration::ZERO;
    }
    configured.max(wal_sender_timeout * 2)
}

/// Sends `status` as a standby status update.
///
/// # Errors
///
/// The connection's.
pub(super) async fn send_status(
    stream: &mut dyn WalStream,
    status: StatusUpdate,
) -> std::result::Result<(), ReplicationError> {
    let frame = StandbyStatus {
        write: status.write,
        flush: status.flush,
        apply: status.apply,
        client_time_micros: pg_epoch_micros(std::time::SystemTime::now()),
        reply_requested: status.reply_requested,
    };
    stream.send_status(&frame).await
}

/// Raises the socket's low-water mark for a pause; `false` where that cannot be
/// done (a Unix socket, a kernel before Linux 4.18, a failed `setsockopt`), and then
/// no pause is taken and the producer's idle flush keeps its usual rules.
fn hold_for_pause(stream: &dyn WalStream) -> bool {
    stream.hold_readiness().unwrap_or_else(|e| {
        tracing::debug!(error = %e, "cannot hold the replication socket's readiness; not pausing");
        false
    })
}

/// A pause in reading (`cdc::read_pacing`), the socket's readiness held
/// ([`hold_for_pause`]): waits `pause`, or until shutdown, or until the socket holds
/// so much that reading at once is better, without being woken by each segment the
/// server sends meanwhile; then releases the readiness.
///
/// # Errors
///
/// The socket failed, or its readiness could not be released (its reads could then
/// wait for ever): the connection is given up.
async fn pause_reading(
    stream: &mut dyn WalStream,
    shutdown: &mut Shutdown,
    pause: Duration,
) -> std::result::Result<Pause, ReplicationError> {
    let outcome = tokio::select! {
        biased;
        () = &mut *shutdown => Ok(Pause::ShutDown),
        () = tokio::time::sleep(pause) => Ok(Pause::Taken),
        read = stream.read_more() => read.map(|()| Pause::Taken),
    };
    match (stream.release_readiness(), outcome) {
        // Stopping anyway (the finished shutdown future must not be polled again):
        // the shutdown goes on, its final reads bounded by their own timeout.
        (Err(e), Ok(Pause::ShutDown)) => {
            tracing::warn!(error = %e, "cannot release the replication socket's readiness at shutdown");
            Ok(Pause::ShutDown)
        }
        (Err(e), _) => Err(e),
        (Ok(()), outcome) => outcome,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_receive_timeout_is_at_least_twice_the_servers_and_off_with_either() {
        let s = Duration::from_secs;
        assert_eq!(receive_timeout(s(30), s(60)), s(120));
        assert_eq!(receive_timeout(s(300), s(60)), s(300));
        assert_eq!(receive_timeout(Duration::ZERO, s(60)), Duration::ZERO);
        assert_eq!(receive_timeout(s(30), Duration::ZERO), Duration::ZERO);
    }
}
