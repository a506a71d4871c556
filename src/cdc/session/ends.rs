//! How a replication session ends, and what the relay makes of it: a graceful
//! shutdown, or a lost session (the reason logged, whether the producer is replaced)
//! after which the relay reconnects and restarts from the slot, which is always safe.

use rdkafka::error::RDKafkaErrorCode;

use crate::cdc::binary::BinaryRefused;
use crate::cdc::progress::{MissingRecord, ProtocolError};
use crate::error::Result;
use crate::lsn::Lsn;
use crate::outbox::MapError;
use crate::postgres::pgoutput::DecodeError;
use crate::postgres::replication::ReplicationError;

/// Why a replication session ended.
#[derive(Debug)]
pub(super) enum SessionEnd {
    /// Graceful shutdown finished.
    Shutdown,
    /// Reconnect after this (transient) reason.
    Lost(Lost),
}

/// Why a session was lost: the relay reconnects and restarts from the slot, which is
/// always safe. The text is the reason logged with "replication session lost".
#[derive(Debug, thiserror::Error)]
pub(super) enum Lost {
    /// The connection failed (transiently) or a status update could not be sent.
    #[error(transparent)]
    Connection(#[from] ReplicationError),
    /// The server ended the CopyBoth stream.
    #[error("the server ended the replication stream")]
    StreamEnded,
    /// A frame could not be trusted.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// Events in flight, the broker reachable, and no delivery report for this long.
    #[error(
        "the Kafka producer sent no delivery report for {silent_secs}s with {in_flight} messages \
         in flight while the broker answers: replacing it"
    )]
    ProducerStalled { silent_secs: u64, in_flight: i32 },
    /// The producer hit a fatal error (e.g. an idempotence sequence it cannot repair).
    #[error("the Kafka producer failed fatally ({code:?}: {message}): replacing it")]
    ProducerFatal {
        code: RDKafkaErrorCode,
        message: String,
    },
    /// A Kafka transaction call failed fatally (not fenced): the producer is
    /// replaced, and its successor's `init_transactions` aborts what it left open.
    #[error("{0}: replacing the producer")]
    Transaction(crate::kafka::TransactionError),
    /// The relay position row is not this session's to write any more (another
    /// relay is resyncing the slot, or it belongs to another history): the session
    /// ends and the start plan decides again.
    #[error("{reason}")]
    PositionRefused { reason: String },
    /// PostgreSQL is shutting down (a new connection was refused with 57P03): the
    /// session ends so that the walsender, which waits for its client, exits and
    /// the shutdown completes with the slot at the last saved position.
    #[error("PostgreSQL is shutting down ({reason}): ending the session")]
    ServerStopping { reason: String },
    /// Nothing came from the server for `relay.receive_timeout_secs` while the relay
    /// read, not even the keepalive it asked for: a silent network partition.
    #[error(
        "no message from PostgreSQL for {silent_secs}s, not even the keepalive asked for \
         (relay.receive_timeout_secs): the connection is taken as lost"
    )]
    ServerSilent { silent_secs: u64 },
    /// The core asked for a produce the shell holds no record of (a broken
    /// invariant, `progress::records`): the session ends and the server sends the
    /// event's transaction again, instead of the event being resolved unsent.
    #[error(transparent)]
    MissingRecord(#[from] MissingRecord),
    /// The coordinator fenced the producer while no other relay held the slot: it
    /// aborted the transaction itself on its timeout (`TransactionDriver::failure`).
    #[error(
        "the Kafka transaction coordinator aborted the open transaction on its timeout and \
         fenced the producer ({0}); no other relay holds the slot: replacing the producer"
    )]
    CoordinatorAborted(crate::kafka::TransactionError),
}

impl Lost {
    /// Whether the producer has to be replaced before the next session.
    pub(super) fn needs_new_producer(&self) -> bool {
        matches!(
            self,
            Lost::ProducerStalled { .. }
                | Lost::ProducerFatal { .. }
                | Lost::Transaction(_)
                | Lost::CoordinatorAborted(_)
        )
    }
}

/// What one wait of a drain (`Relay::await_in_flight`) came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Drain {
    /// Something resolved or a timer ran: go on while events are in flight.
    Progress,
    /// A channel closed or the producer failed fatally: stop draining.
    Ended,
    /// The drain's deadline passed.
    TimedOut,
}

/// Sessions that ended without progress, at one confirmed position.
#[derive(Debug, Default)]
pub(super) struct FailureStreak {
    pub(super) at: Lsn,
    pub(super) count: u32,
}

impl FailureStreak {
    /// A session ended at `confirmed`; returns how many in a row ended there without
    /// progress.
    pub(super) fn ended(&mut self, confirmed: Lsn, progressed: bool) -> u32 {
        if progressed {
            self.count = 0;
        } else if confirmed == self.at {
            self.count = self.count.saturating_add(1);
        } else {
            self.count = 1;
        }
        self.at = confirmed;
        self.count
    }
}

/// A replication frame the relay cannot make sense of: the stream is inconsistent
/// from here on, so the session ends (see `StreamReader::on_frame`).
#[derive(Debug, thiserror::Error)]
pub(super) enum FrameError {
    /// The XLogData payload is not a pgoutput message.
    #[error("undecodable pgoutput message: {0}")]
    Decode(#[source] DecodeError),
    /// An Insert does not match the relation it names.
    #[error(transparent)]
    Map(#[from] MapError),
    /// The transaction framing was violated (or the window contract, by us).
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// A relation with a column the relay does not read in binary format, in a
    /// binary session: the next session streams in text.
    #[error(transparent)]
    Binary(#[from] BinaryRefused),
}

/// A transactional failure ends the session (the producer is replaced) or, fenced,
/// unsupported or refused, the process.
pub(super) fn session_or_process(e: crate::kafka::TransactionError) -> Result<Lost> {
    if e.needs_operator() {
        Err(e.into())
    } else {
        Ok(Lost::Transaction(e))
    }
}
