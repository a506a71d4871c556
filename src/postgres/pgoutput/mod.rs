//! Decoder for the messages of PostgreSQL's `pgoutput` logical decoding plugin.
//!
//! # Framing
//!
//! Every XLogData frame of the replication stream (see [`super::replication::frames`]) carries
//! exactly one `pgoutput` message. A message starts with a one-byte tag (`'B'` Begin,
//! `'I'` Insert, …) followed by fixed fields: integers are big-endian, LSNs are
//! `Int64`, timestamps are `Int64` microseconds since 2000-01-01, strings are
//! NUL-terminated. Nothing in the message says how long it is, so the decoder must
//! know every layout; it consumes the whole buffer and treats bytes left over as an
//! error, because a silent mismatch would mean it misread the fields before them.
//!
//! A plain transaction arrives as `Begin`, then `Relation`/`Type` messages for any
//! table or type the session has not described yet (or whose definition changed),
//! then `Insert`/`Update`/`Delete`/`Truncate`/`Message` in WAL order, then `Commit`.
//! Transactions are sent in commit order, each one only after it committed.
//!
//! # LSNs: what to compare and what to confirm
//!
//! - `Begin.final_lsn` is the LSN of the transaction's commit record and equals the
//!   following `Commit.commit_lsn`; a mismatch means the stream is corrupt.
//! - `Commit.end_lsn` is the position just past the commit record. It is the value
//!   a relay reports as `flush` in the standby status update once every event of the
//!   transaction is acknowledged: on reconnect the walsender skips transactions whose
//!   commit record starts before the confirmed position, so confirming `end_lsn`
//!   skips this transaction, while confirming `commit_lsn` would replay it.
//! - A streamed transaction (v2, below) has no Begin/Commit pair: its
//!   `Stream Commit` carries the same `commit_lsn`/`end_lsn` fields.
//!
//! # Protocol versions and the streamed-transaction `xid`
//!
//! The relay chooses the version with `START_REPLICATION … (proto_version 'N', …)`:
//!
//! - **v1** (PostgreSQL 10+): every message above plus `Origin`; `Message` needs the
//!   `messages 'true'` option (PostgreSQL 14+).
//! - **v2** (PostgreSQL 14+, `streaming 'on'`): a large in-progress transaction may be
//!   sent before it commits, in blocks framed by `Stream Start` / `Stream Stop`, and
//!   is finished later by `Stream Commit` or `Stream Abort`. Inside a block,
//!   `Relation`, `Type`, `Insert`, `Update`, `Delete`, `Truncate` and `Message`
//!   carry an extra `Int32` xid right after the tag — the same tag with a different
//!   layout, which the bytes themselves cannot reveal. So decoding needs to know
//!   whether it is inside a block: [`DecodeContext::in_stream`] says so for the
//!   stateless [`decode`], and [`Decoder`] tracks it from Stream Start / Stream Stop.
//!   The xid is that of the (sub)transaction the change belongs to.
//! - **v3** (PostgreSQL 15+, `two_phase 'on'`): `Begin Prepare`, `Prepare`,
//!   `Commit Prepared`, `Rollback Prepared`, `Stream Prepare` — all decoded here.
//! - **v4** (PostgreSQL 16+, `streaming 'parallel'`): `Stream Abort` gains an abort
//!   LSN and timestamp; they are decoded when present (see [`StreamAbort`]).
//!
//! A message that needs a newer version than the context's is reported as
//! [`DecodeError::UnsupportedMessage`] rather than guessed at.
//!
//! # Tuple data and unchanged TOAST values
//!
//! A row is an `Int16` column count followed, per column, by a kind byte: `'n'` NULL,
//! `'t'` text (the type's output function, e.g. `jsonb` as text), `'b'` binary (the
//! type's send function, only with `binary 'true'`), or `'u'` *unchanged TOAST*: the
//! value is stored out of line and was not modified by this UPDATE, so PostgreSQL did
//! not send it. `'u'` is not NULL — it means "same as before, value unknown here";
//! a consumer that needs the value must already have it. The old tuple of an
//! UPDATE/DELETE is sent as `'K'` (replica-identity key columns only; other columns
//! are `'n'`) or `'O'` (the whole row, with `REPLICA IDENTITY FULL`).
//!
//! # Zero copy, no panics
//!
//! Column values, names and message contents are [`Bytes`] slices of the input
//! buffer: decoding an `Insert` allocates exactly one `Vec` (its columns) and copies
//! no data. `Relation` messages are rare, so their names are validated once into
//! owned `String`s. Every read goes through a bounds-checked cursor that returns a
//! [`DecodeError`]; no input can make the decoder panic or overflow.
//!
//! References:
//! - <https://www.postgresql.org/docs/current/protocol-logicalrep-message-formats.html>
//! - <https://www.postgresql.org/docs/current/protocol-logical-replication.html>
//!   (protocol versions and options)
//! - `src/backend/replication/logical/proto.c`, `src/backend/replication/pgoutput/pgoutput.c`

use std::fmt;

use bytes::Bytes;

use crate::lsn::Lsn;

/// Tag of a Begin message.
pub const BEGIN: u8 = b'B';
/// Tag of a Commit message.
pub const COMMIT: u8 = b'C';
/// Tag of an Origin message.
pub const ORIGIN: u8 = b'O';
/// Tag of a Relation message.
pub const RELATION: u8 = b'R';
/// Tag of a Type message.
pub const TYPE: u8 = b'Y';
/// Tag of an Insert message.
pub const INSERT: u8 = b'I';
/// Tag of an Update message.
pub const UPDATE: u8 = b'U';
/// Tag of a Delete message.
pub const DELETE: u8 = b'D';
/// Tag of a Truncate message.
pub const TRUNCATE: u8 = b'T';
/// Tag of a logical decoding Message (`pg_logical_emit_message`).
pub const MESSAGE: u8 = b'M';
/// Tag of a Stream Start message (v2+).
pub const STREAM_START: u8 = b'S';
/// Tag of a Stream Stop message (v2+).
pub const STREAM_STOP: u8 = b'E';
/// Tag of a Stream Commit message (v2+).
pub const STREAM_COMMIT: u8 = b'c';
/// Tag of a Stream Abort message (v2+).
pub const STREAM_ABORT: u8 = b'A';
/// Tag of a Begin Prepare message (v3+).
pub const BEGIN_PREPARE: u8 = b'b';
/// Tag of a Prepare message (v3+).
pub const PREPARE: u8 = b'P';
/// Tag of a Commit Prepared message (v3+).
pub const COMMIT_PREPARED: u8 = b'K';
/// Tag of a Rollback Prepared message (v3+).
pub const ROLLBACK_PREPARED: u8 = b'r';
/// Tag of a Stream Prepare message (v3+).
pub const STREAM_PREPARE: u8 = b'p';

/// Marker before the new tuple of an Insert or Update.
pub const TUPLE_NEW: u8 = b'N';
/// Marker before an old tuple holding only the replica-identity key columns.
pub const TUPLE_KEY: u8 = b'K';
/// Marker before an old tuple holding the whole row (`REPLICA IDENTITY FULL`).
pub const TUPLE_OLD: u8 = b'O';

/// Tuple column kind: NULL.
pub const COLUMN_NULL: u8 = b'n';
/// Tuple column kind: unchanged TOASTed value, not sent.
pub const COLUMN_UNCHANGED_TOAST: u8 = b'u';
/// Tuple column kind: text format value.
pub const COLUMN_TEXT: u8 = b't';
/// Tuple column kind: binary format value.
pub const COLUMN_BINARY: u8 = b'b';

/// First protocol version with streamed in-progress transactions.
pub const PROTO_STREAMING: u8 = 2;
/// First protocol version with two-phase commit messages.
pub const PROTO_TWO_PHASE: u8 = 3;
/// First protocol version whose Stream Abort may carry abort LSN and time.
pub const PROTO_STREAM_PARALLEL: u8 = 4;

/// What the decoder must know that the bytes do not say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeContext {
    /// The `proto_version` requested in `START_REPLICATION` (1..=4; 0 is not a
    /// version and decodes nothing).
    pub protocol_version: u8,
    /// True between a Stream Start and its Stream Stop: data messages then carry a
    /// leading xid. Ignored for protocol versions below 2.
    pub in_stream: bool,
}

impl DecodeContext {
    /// A context for `protocol_version`, outside any stream block.
    #[must_use]
    pub const fn new(protocol_version: u8) -> Self {
        DecodeContext {
            protocol_version,
            in_stream: false,
        }
    }

    /// The same context, inside (`true`) or outside a stream block.
    #[must_use]
    pub const fn with_in_stream(self, in_stream: bool) -> Self {
        DecodeContext {
            protocol_version: self.protocol_version,
            in_stream,
        }
    }

    /// Whether data messages carry the streamed-transaction xid.
    #[must_use]
    pub const fn has_stream_xid(self) -> bool {
        self.in_stream && self.protocol_version >= PROTO_STREAMING
    }
}

impl Default for DecodeContext {
    /// Protocol version 1, not streaming.
    fn default() -> Self {
        DecodeContext::new(1)
    }
}

/// One decoded `pgoutput` message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LogicalReplicationMessage {
    /// `'B'`: a transaction starts.
    Begin(Begin),
    /// `'C'`: the transaction begun by the last Begin committed.
    Commit(Commit),
    /// `'O'`: the transaction originated on another node (replication origin).
    Origin(Origin),
    /// `'R'`: describes a relation before its first change in this session.
    Relation(Relation),
    /// `'Y'`: describes a non-built-in data type used by a relation.
    Type(Type),
    /// `'I'`: a row was inserted.
    Insert(Insert),
    /// `'U'`: a row was updated.
    Update(Update),
    /// `'D'`: a row was deleted.
    Delete(Delete),
    /// `'T'`: tables were truncated.
    Truncate(Truncate),
    /// `'M'`: a logical decoding message from `pg_logical_emit_message`.
    Message(LogicalDecodingMessage),
    /// `'S'` (v2+): a block of a streamed in-progress transaction starts.
    StreamStart(StreamStart),
    /// `'E'` (v2+): the current stream block ends.
    StreamStop,
    /// `'c'` (v2+): a streamed transaction committed.
    StreamCommit(StreamCommit),
    /// `'A'` (v2+): a streamed (sub)transaction aborted.
    StreamAbort(StreamAbort),
    /// `'b'` (v3+): a prepared transaction starts.
    BeginPrepare(BeginPrepare),
    /// `'P'` (v3+): the transaction begun by Begin Prepare was prepared.
    Prepare(Prepare),
    /// `'K'` (v3+): a prepared transaction was committed.
    CommitPrepared(CommitPrepared),
    /// `'r'` (v3+): a prepared transaction was rolled back.
    RollbackPrepared(RollbackPrepared),
    /// `'p'` (v3+): a streamed transaction was prepared.
    StreamPrepare(Prepare),
}

impl LogicalReplicationMessage {
    /// The message's tag byte.
    #[must_use]
    pub const fn tag(&self) -> u8 {
        match self {
            Self::Begin(_) => BEGIN,
            Self::Commit(_) => COMMIT,
            Self::Origin(_) => ORIGIN,
            Self::Relation(_) => RELATION,
            Self::Type(_) => TYPE,
            Self::Insert(_) => INSERT,
            Self::Update(_) => UPDATE,
            Self::Delete(_) => DELETE,
            Self::Truncate(_) => TRUNCATE,
            Self::Message(_) => MESSAGE,
            Self::StreamStart(_) => STREAM_START,
            Self::StreamStop => STREAM_STOP,
            Self::StreamCommit(_) => STREAM_COMMIT,
            Self::StreamAbort(_) => STREAM_ABORT,
            Self::BeginPrepare(_) => BEGIN_PREPARE,
            Self::Prepare(_) => PREPARE,
            Self::CommitPrepared(_) => COMMIT_PREPARED,
            Self::RollbackPrepared(_) => ROLLBACK_PREPARED,
            Self::StreamPrepare(_) => STREAM_PREPARE,
        }
    }

    /// The message's name as PostgreSQL's documentation spells it.
    #[must_use]
    pub const fn name(&self) -> &'static str {
        message_name(self.tag())
    }
}

/// `'B'`: the start of a transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Begin {
    /// LSN of the commit record; equals the matching [`Commit::commit_lsn`].
    pub final_lsn: Lsn,
    /// Commit time, microseconds since 2000-01-01.
    pub commit_time: i64,
    /// Transaction id.
    pub xid: u32,
}

/// `'C'`: the end of a transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Commit {
    /// Flags; currently always 0.
    pub flags: u8,
    /// LSN of the commit record; equals the matching [`Begin::final_lsn`].
    pub commit_lsn: Lsn,
    /// LSN just past the commit record: the position to confirm once the
    /// transaction's events are durable downstream.
    pub end_lsn: Lsn,
    /// Commit time, microseconds since 2000-01-01.
    pub commit_time: i64,
}

/// `'O'`: the replication origin of the current transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// LSN of the commit on the origin server.
    pub commit_lsn: Lsn,
    /// Origin name.
    pub name: PgStr,
}

/// `'R'`: a relation's schema, sent before its first change and after it changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    /// Present only inside a v2 stream block.
    pub xid: Option<u32>,
    /// Relation OID; later changes refer to it.
    pub id: u32,
    /// Schema name; empty means `pg_catalog`.
    pub namespace: String,
    /// Relation name.
    pub name: String,
    /// `relreplident`: `b'd'` default, `b'n'` nothing, `b'f'` full, `b'i'` index.
    pub replica_identity: u8,
    /// Published columns, in tuple order (dropped and unpublished columns omitted).
    pub columns: Vec<RelationColumn>,
}

/// One column of a [`Relation`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelationColumn {
    /// Bit 1 ([`RelationColumn::FLAG_KEY`]) marks a replica-identity key column.
    pub flags: u8,
    /// Column name.
    pub name: String,
    /// Data type OID.
    pub type_oid: u32,
    /// Type modifier (`atttypmod`), -1 when none.
    pub type_modifier: i32,
}

impl RelationColumn {
    /// Flag bit: the column is part of the replica-identity key.
    pub const FLAG_KEY: u8 = 1;

    /// True when the column is part of the replica-identity key.
    #[must_use]
    pub const fn is_key(&self) -> bool {
        self.flags & Self::FLAG_KEY != 0
    }
}

/// `'Y'`: a data type's name, sent before the first relation that uses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Type {
    /// Present only inside a v2 stream block.
    pub xid: Option<u32>,
    /// Type OID.
    pub type_oid: u32,
    /// Schema name; empty means `pg_catalog`.
    pub namespace: PgStr,
    /// Type name.
    pub name: PgStr,
}

/// `'I'`: a new row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Insert {
    /// Present only inside a v2 stream block.
    pub xid: Option<u32>,
    /// OID of a relation described by an earlier [`Relation`] message.
    pub relation_id: u32,
    /// The inserted row.
    pub tuple: TupleData,
}

/// `'U'`: a changed row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Update {
    /// Present only inside a v2 stream block.
    pub xid: Option<u32>,
    /// OID of a relation described by an earlier [`Relation`] message.
    pub relation_id: u32,
    /// The old key or row, sent only when the key changed or with
    /// `REPLICA IDENTITY FULL`.
    pub old: Option<OldTuple>,
    /// The new row; may contain [`ColumnValue::UnchangedToast`].
    pub new: TupleData,
}

/// `'D'`: a deleted row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delete {
    /// Present only inside a v2 stream block.
    pub xid: Option<u32>,
    /// OID of a relation described by an earlier [`Relation`] message.
    pub relation_id: u32,
    /// The deleted row's key (or whole row with `REPLICA IDENTITY FULL`).
    pub old: OldTuple,
}

/// The "before" image of an updated or deleted row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OldTuple {
    /// `'K'`: replica-identity key columns; the other columns are NULL.
    Key(TupleData),
    /// `'O'`: the whole old row (`REPLICA IDENTITY FULL`).
    Full(TupleData),
}

impl OldTuple {
    /// The tuple, whichever kind it is.
    #[must_use]
    pub const fn tuple(&self) -> &TupleData {
        match self {
            OldTuple::Key(t) | OldTuple::Full(t) => t,
        }
    }

    /// The marker byte on the wire (`'K'` or `'O'`).
    #[must_use]
    pub const fn marker(&self) -> u8 {
        match self {
            OldTuple::Key(_) => TUPLE_KEY,
            OldTuple::Full(_) => TUPLE_OLD,
        }
    }
}

/// `'T'`: one `TRUNCATE` statement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Truncate {
    /// Present only inside a v2 stream block.
    pub xid: Option<u32>,
    /// Option bits: [`Truncate::CASCADE`], [`Truncate::RESTART_IDENTITY`].
    pub options: u8,
    /// OIDs of the truncated relations.
    pub relation_ids: Vec<u32>,
}

impl Truncate {
    /// Option bit: `TRUNCATE … CASCADE`.
    pub const CASCADE: u8 = 1;
    /// Option bit: `TRUNCATE … RESTART IDENTITY`.
    pub const RESTART_IDENTITY: u8 = 2;

    /// True for `CASCADE`.
    #[must_use]
    pub const fn cascade(&self) -> bool {
        self.options & Self::CASCADE != 0
    }

    /// True for `RESTART IDENTITY`.
    #[must_use]
    pub const fn restart_identity(&self) -> bool {
        self.options & Self::RESTART_IDENTITY != 0
    }
}

/// `'M'`: a message written with `pg_logical_emit_message`.
///
/// Non-transactional messages are sent immediately, outside any Begin/Commit, which
/// makes them useful as heartbeats that move the stream forward on an idle database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogicalDecodingMessage {
    /// Present only inside a v2 stream block.
    pub xid: Option<u32>,
    /// Bit 1 ([`LogicalDecodingMessage::TRANSACTIONAL`]): sent inside its transaction.
    pub flags: u8,
    /// LSN of the message.
    pub lsn: Lsn,
    /// The prefix given to `pg_logical_emit_message`.
    pub prefix: PgStr,
    /// The content, a zero-copy slice.
    pub content: Bytes,
}

impl LogicalDecodingMessage {
    /// Flag bit: the message is transactional.
    pub const TRANSACTIONAL: u8 = 1;

    /// True for a transactional message.
    #[must_use]
    pub const fn is_transactional(&self) -> bool {
        self.flags & Self::TRANSACTIONAL != 0
    }
}

/// `'S'` (v2+): a block of a streamed in-progress transaction follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamStart {
    /// Top-level transaction id.
    pub xid: u32,
    /// True for the transaction's first block.
    pub first_segment: bool,
}

/// `'c'` (v2+): a streamed transaction committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamCommit {
    /// Transaction id.
    pub xid: u32,
    /// Flags; currently always 0.
    pub flags: u8,
    /// LSN of the commit record.
    pub commit_lsn: Lsn,
    /// LSN just past the commit record: the position to confirm.
    pub end_lsn: Lsn,
    /// Commit time, microseconds since 2000-01-01.
    pub commit_time: i64,
}

/// `'A'` (v2+): a streamed transaction or one of its subtransactions aborted.
///
/// With protocol v4 and `streaming 'parallel'` the server appends the abort LSN and
/// time; they are decoded whenever the context's version is 4 or more and the bytes
/// are present, and are `None` otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamAbort {
    /// Top-level transaction id.
    pub xid: u32,
    /// Aborted subtransaction id; equals `xid` when the whole transaction aborted.
    pub subxid: u32,
    /// v4 parallel-streaming extra fields.
    pub abort: Option<StreamAbortInfo>,
}

/// The optional v4 tail of a [`StreamAbort`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamAbortInfo {
    /// LSN of the abort.
    pub abort_lsn: Lsn,
    /// Abort time, microseconds since 2000-01-01.
    pub abort_time: i64,
}

/// `'b'` (v3+): a transaction that will be prepared starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BeginPrepare {
    /// LSN of the prepare record.
    pub prepare_lsn: Lsn,
    /// LSN just past the prepare record.
    pub end_lsn: Lsn,
    /// Prepare time, microseconds since 2000-01-01.
    pub prepare_time: i64,
    /// Transaction id.
    pub xid: u32,
    /// The user-defined global transaction id.
    pub gid: PgStr,
}

/// `'P'` Prepare and `'p'` Stream Prepare (v3+).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prepare {
    /// Flags; currently always 0.
    pub flags: u8,
    /// LSN of the prepare record.
    pub prepare_lsn: Lsn,
    /// LSN just past the prepare record.
    pub end_lsn: Lsn,
    /// Prepare time, microseconds since 2000-01-01.
    pub prepare_time: i64,
    /// Transaction id.
    pub xid: u32,
    /// The user-defined global transaction id.
    pub gid: PgStr,
}

/// `'K'` (v3+): a prepared transaction was committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitPrepared {
    /// Flags; currently always 0.
    pub flags: u8,
    /// LSN of the commit-prepared record.
    pub commit_lsn: Lsn,
    /// LSN just past the commit-prepared record.
    pub end_lsn: Lsn,
    /// Commit time, microseconds since 2000-01-01.
    pub commit_time: i64,
    /// Transaction id.
    pub xid: u32,
    /// The user-defined global transaction id.
    pub gid: PgStr,
}

/// `'r'` (v3+): a prepared transaction was rolled back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RollbackPrepared {
    /// Flags; currently always 0.
    pub flags: u8,
    /// End LSN of the prepared transaction.
    pub prepare_end_lsn: Lsn,
    /// End LSN of the rollback-prepared record.
    pub rollback_end_lsn: Lsn,
    /// Prepare time, microseconds since 2000-01-01.
    pub prepare_time: i64,
    /// Rollback time, microseconds since 2000-01-01.
    pub rollback_time: i64,
    /// Transaction id.
    pub xid: u32,
    /// The user-defined global transaction id.
    pub gid: PgStr,
}

/// The columns of one row, in the order of the relation's [`RelationColumn`]s.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TupleData {
    /// One value per column.
    pub columns: Vec<ColumnValue>,
}

impl TupleData {
    /// Number of columns.
    #[must_use]
    pub fn len(&self) -> usize {
        self.columns.len()
    }

    /// True when the tuple has no columns.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.columns.is_empty()
    }

    /// The value of column `index`, if the tuple has that many columns.
    #[must_use]
    pub fn get(&self, index: usize) -> Option<&ColumnValue> {
        self.columns.get(index)
    }
}

/// One column of a [`TupleData`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ColumnValue {
    /// `'n'`: SQL NULL.
    Null,
    /// `'u'`: an unchanged out-of-line (TOASTed) value that was not sent. Not NULL:
    /// the value is whatever it was before this UPDATE.
    UnchangedToast,
    /// `'t'`: the value in the type's text output format (zero-copy).
    Text(Bytes),
    /// `'b'`: the value in the type's binary send format (zero-copy).
    Binary(Bytes),
}

impl ColumnValue {
    /// The raw bytes of a text or binary value; `None` for NULL and unchanged TOAST.
    #[must_use]
    pub const fn bytes(&self) -> Option<&Bytes> {
        match self {
            ColumnValue::Text(b) | ColumnValue::Binary(b) => Some(b),
            ColumnValue::Null | ColumnValue::UnchangedToast => None,
        }
    }

    /// The kind byte on the wire.
    #[must_use]
    pub const fn kind(&self) -> u8 {
        match self {
            ColumnValue::Null => COLUMN_NULL,
            ColumnValue::UnchangedToast => COLUMN_UNCHANGED_TOAST,
            ColumnValue::Text(_) => COLUMN_TEXT,
            ColumnValue::Binary(_) => COLUMN_BINARY,
        }
    }
}

/// A NUL-terminated protocol string, kept as a zero-copy slice (terminator removed).
///
/// PostgreSQL sends names in the connection's `client_encoding`; [`PgStr::as_str`]
/// checks that they are UTF-8 when the caller needs text.
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct PgStr(Bytes);

impl PgStr {
    /// Wraps bytes that contain no NUL.
    ///
    /// # Errors
    ///
    /// Returns the bytes back when they contain a NUL, which the wire format cannot
    /// carry.
    pub fn new(bytes: Bytes) -> Result<Self, Bytes> {
        if bytes.contains(&0) {
            Err(bytes)
        } else {
            Ok(PgStr(bytes))
        }
    }

    /// The string as UTF-8.
    ///
    /// # Errors
    ///
    /// When the bytes are not valid UTF-8.
    pub fn as_str(&self) -> Result<&str, std::str::Utf8Error> {
        std::str::from_utf8(&self.0)
    }

    /// The raw bytes, without the terminator.
    #[must_use]
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The underlying buffer slice.
    #[must_use]
    pub fn into_bytes(self) -> Bytes {
        self.0
    }

    /// Length in bytes, without the terminator.
    #[must_use]
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True for the empty string.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for PgStr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&String::from_utf8_lossy(&self.0), f)
    }
}

impl fmt::Display for PgStr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&String::from_utf8_lossy(&self.0), f)
    }
}

impl PartialEq<str> for PgStr {
    fn eq(&self, other: &str) -> bool {
        self.0 == other.as_bytes()
    }
}

impl PartialEq<&str> for PgStr {
    fn eq(&self, other: &&str) -> bool {
        self.0 == other.as_bytes()
    }
}

/// Why a `pgoutput` message could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The XLogData body was empty.
    #[error("empty pgoutput message")]
    Empty,
    /// The tag is not a `pgoutput` message.
    #[error("unknown pgoutput message tag {}", TagDisplay(*tag))]
    UnknownTag {
        /// The tag byte received.
        tag: u8,
    },
    /// The message exists only in a newer protocol version than the one decoded.
    #[error(
        "pgoutput {} message needs protocol version {required}, stream uses {protocol_version}",
        message_name(*tag)
    )]
    UnsupportedMessage {
        /// The tag byte received.
        tag: u8,
        /// The context's protocol version.
        protocol_version: u8,
        /// The first version that defines the message.
        required: u8,
    },
    /// The message ended before a field.
    #[error(
        "truncated pgoutput {message} message: {field} needs {needed} bytes, {remaining} remain"
    )]
    Truncated {
        /// Message name.
        message: &'static str,
        /// Field being read.
        field: &'static str,
        /// Bytes the field needs.
        needed: usize,
        /// Bytes left in the message.
        remaining: usize,
    },
    /// A string field has no NUL terminator before the end of the message.
    #[error("pgoutput {message} message: string {field} is not NUL-terminated")]
    UnterminatedString {
        /// Message name.
        message: &'static str,
        /// Field being read.
        field: &'static str,
    },
    /// A name that is kept as `String` is not UTF-8.
    #[error("pgoutput {message} message: {field} is not valid UTF-8")]
    InvalidUtf8 {
        /// Message name.
        message: &'static str,
        /// Field being read.
        field: &'static str,
    },
    /// A count or length is negative.
    #[error("pgoutput {message} message: invalid {field} {value}")]
    InvalidLength {
        /// Message name.
        message: &'static str,
        /// Field being read.
        field: &'static str,
        /// The value received.
        value: i64,
    },
    /// A tuple column kind is not `'n'`, `'u'`, `'t'` or `'b'`.
    #[error("pgoutput {message} message: unknown tuple column kind {}", TagDisplay(*kind))]
    UnknownColumnKind {
        /// Message name.
        message: &'static str,
        /// The kind byte received.
        kind: u8,
    },
    /// A tuple marker (`'N'`, `'K'`, `'O'`) is missing or wrong.
    #[error(
        "pgoutput {message} message: expected tuple marker {expected}, found {}",
        TagDisplay(*found)
    )]
    UnexpectedTupleMarker {
        /// Message name.
        message: &'static str,
        /// What was acceptable, e.g. `'K', 'O' or 'N'`.
        expected: &'static str,
        /// The byte received.
        found: u8,
    },
    /// Bytes remain after a complete message.
    #[error("pgoutput {message} message has {extra} trailing bytes")]
    TrailingBytes {
        /// Message name.
        message: &'static str,
        /// Bytes left over.
        extra: usize,
    },
    /// Stream Start inside a stream block, or Stream Stop outside one ([`Decoder`]).
    #[error("pgoutput {} message {} a stream block", message_name(*tag), if *in_stream { "inside" } else { "outside" })]
    StreamBoundary {
        /// The tag byte received.
        tag: u8,
        /// Whether the decoder was inside a stream block.
        in_stream: bool,
    },
}

/// Decodes one `pgoutput` message (the body of one XLogData frame).
///
/// Column values, strings and message content are zero-copy slices of `buf`.
///
/// # Errors
///
/// [`DecodeError`] for an empty buffer, an unknown tag, a message newer than
/// `ctx.protocol_version`, a truncated or over-long message, or invalid field values.
pub fn decode(buf: Bytes, ctx: DecodeContext) -> Result<LogicalReplicationMessage, DecodeError> {
    let Some(&tag) = buf.first() else {
        return Err(DecodeError::Empty);
    };
    let required = match tag {
        STREAM_START | STREAM_STOP | STREAM_COMMIT | STREAM_ABORT => PROTO_STREAMING,
        BEGIN_PREPARE | PREPARE | COMMIT_PREPARED | ROLLBACK_PREPARED | STREAM_PREPARE => {
            PROTO_TWO_PHASE
        }
        _ => 1,
    };
    if ctx.protocol_version < required {
        return Err(DecodeError::UnsupportedMessage {
            tag,
            protocol_version: ctx.protocol_version,
            required,
        });
    }
    let mut cur = Cursor {
        buf,
        pos: 1,
        message: message_name(tag),
    };
    let msg = match tag {
        BEGIN => LogicalReplicationMessage::Begin(Begin {
            final_lsn: cur.get_lsn("final_lsn")?,
            commit_time: cur.get_i64("commit_time")?,
            xid: cur.get_u32("xid")?,
        }),
        COMMIT => LogicalReplicationMessage::Commit(Commit {
            flags: cur.get_u8("flags")?,
            commit_lsn: cur.get_lsn("commit_lsn")?,
            end_lsn: cur.get_lsn("end_lsn")?,
            commit_time: cur.get_i64("commit_time")?,
        }),
        ORIGIN => LogicalReplicationMessage::Origin(Origin {
            commit_lsn: cur.get_lsn("commit_lsn")?,
            name: cur.get_pgstr("name")?,
        }),
        RELATION => LogicalReplicationMessage::Relation(decode_relation(&mut cur, ctx)?),
        TYPE => LogicalReplicationMessage::Type(Type {
            xid: cur.get_stream_xid(ctx)?,
            type_oid: cur.get_u32("type_oid")?,
            namespace: cur.get_pgstr("namespace")?,
            name: cur.get_pgstr("name")?,
        }),
        INSERT => LogicalReplicationMessage::Insert(decode_insert(&mut cur, ctx)?),
        UPDATE => LogicalReplicationMessage::Update(decode_update(&mut cur, ctx)?),
        DELETE => LogicalReplicationMessage::Delete(decode_delete(&mut cur, ctx)?),
        TRUNCATE => LogicalReplicationMessage::Truncate(decode_truncate(&mut cur, ctx)?),
        MESSAGE => LogicalReplicationMessage::Message(decode_message(&mut cur, ctx)?),
        STREAM_START => LogicalReplicationMessage::StreamStart(StreamStart {
            xid: cur.get_u32("xid")?,
            first_segment: cur.get_u8("first_segment")? == 1,
        }),
        STREAM_STOP => LogicalReplicationMessage::StreamStop,
        STREAM_COMMIT => LogicalReplicationMessage::StreamCommit(StreamCommit {
            xid: cur.get_u32("xid")?,
            flags: cur.get_u8("flags")?,
            commit_lsn: cur.get_lsn("commit_lsn")?,
            end_lsn: cur.get_lsn("end_lsn")?,
            commit_time: cur.get_i64("commit_time")?,
        }),
        STREAM_ABORT => LogicalReplicationMessage::StreamAbort(decode_stream_abort(&mut cur, ctx)?),
        BEGIN_PREPARE => LogicalReplicationMessage::BeginPrepare(BeginPrepare {
            prepare_lsn: cur.get_lsn("prepare_lsn")?,
            end_lsn: cur.get_lsn("end_lsn")?,
            prepare_time: cur.get_i64("prepare_time")?,
            xid: cur.get_u32("xid")?,
            gid: cur.get_pgstr("gid")?,
        }),
        PREPARE => LogicalReplicationMessage::Prepare(decode_prepare(&mut cur)?),
        STREAM_PREPARE => LogicalReplicationMessage::StreamPrepare(decode_prepare(&mut cur)?),
        COMMIT_PREPARED => LogicalReplicationMessage::CommitPrepared(CommitPrepared {
            flags: cur.get_u8("flags")?,
            commit_lsn: cur.get_lsn("commit_lsn")?,
            end_lsn: cur.get_lsn("end_lsn")?,
            commit_time: cur.get_i64("commit_time")?,
            xid: cur.get_u32("xid")?,
            gid: cur.get_pgstr("gid")?,
        }),
        ROLLBACK_PREPARED => LogicalReplicationMessage::RollbackPrepared(RollbackPrepared {
            flags: cur.get_u8("flags")?,
            prepare_end_lsn: cur.get_lsn("prepare_end_lsn")?,
            rollback_end_lsn: cur.get_lsn("rollback_end_lsn")?,
            prepare_time: cur.get_i64("prepare_time")?,
            rollback_time: cur.get_i64("rollback_time")?,
            xid: cur.get_u32("xid")?,
            gid: cur.get_pgstr("gid")?,
        }),
        other => return Err(DecodeError::UnknownTag { tag: other }),
    };
    cur.finish()?;
    Ok(msg)
}

/// A stateful decoder that tracks stream blocks, so callers need not.
///
/// It sets [`DecodeContext::in_stream`] after a Stream Start and clears it after a
/// Stream Stop, and rejects a Stream Start inside a block or a Stream Stop outside
/// one. A failed decode leaves the state unchanged.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Decoder {
    ctx: DecodeContext,
}

impl Decoder {
    /// A decoder for `protocol_version`, outside any stream block.
    #[must_use]
    pub const fn new(protocol_version: u8) -> Self {
        Decoder {
            ctx: DecodeContext::new(protocol_version),
        }
    }

    /// The context the next message will be decoded with.
    #[must_use]
    pub const fn context(&self) -> DecodeContext {
        self.ctx
    }

    /// Decodes the next message of the stream and updates the stream-block state.
    ///
    /// # Errors
    ///
    /// Everything [`decode`] returns, plus [`DecodeError::StreamBoundary`].
    pub fn decode(&mut self, buf: Bytes) -> Result<LogicalReplicationMessage, DecodeError> {
        let msg = decode(buf, self.ctx)?;
        let in_stream = self.ctx.in_stream;
        match (&msg, in_stream) {
            (LogicalReplicationMessage::StreamStart(_), false) => self.ctx.in_stream = true,
            (LogicalReplicationMessage::StreamStop, true) => self.ctx.in_stream = false,
            (
                LogicalReplicationMessage::StreamStart(_) | LogicalReplicationMessage::StreamStop,
                _,
            ) => {
                return Err(DecodeError::StreamBoundary {
                    tag: msg.tag(),
                    in_stream,
                });
            }
            _ => {}
        }
        Ok(msg)
    }
}

fn decode_insert(cur: &mut Cursor, ctx: DecodeContext) -> Result<Insert, DecodeError> {
    let xid = cur.get_stream_xid(ctx)?;
    let relation_id = cur.get_u32("relation_id")?;
    cur.expect_new_marker("tuple marker")?;
    Ok(Insert {
        xid,
        relation_id,
        tuple: cur.get_tuple()?,
    })
}

fn decode_update(cur: &mut Cursor, ctx: DecodeContext) -> Result<Update, DecodeError> {
    let xid = cur.get_stream_xid(ctx)?;
    let relation_id = cur.get_u32("relation_id")?;
    let old = match cur.get_u8("tuple marker")? {
        TUPLE_KEY => Some(OldTuple::Key(cur.get_tuple()?)),
        TUPLE_OLD => Some(OldTuple::Full(cur.get_tuple()?)),
        TUPLE_NEW => None,
        other => return Err(cur.unexpected_marker("'K', 'O' or 'N'", other)),
    };
    if old.is_some() {
        cur.expect_new_marker("new tuple marker")?;
    }
    Ok(Update {
        xid,
        relation_id,
        old,
        new: cur.get_tuple()?,
    })
}

fn decode_delete(cur: &mut Cursor, ctx: DecodeContext) -> Result<Delete, DecodeError> {
    let xid = cur.get_stream_xid(ctx)?;
    let relation_id = cur.get_u32("relation_id")?;
    let old = match cur.get_u8("tuple marker")? {
        TUPLE_KEY => OldTuple::Key(cur.get_tuple()?),
        TUPLE_OLD => OldTuple::Full(cur.get_tuple()?),
        other => return Err(cur.unexpected_marker("'K' or 'O'", other)),
    };
    Ok(Delete {
        xid,
        relation_id,
        old,
    })
}

fn decode_truncate(cur: &mut Cursor, ctx: DecodeContext) -> Result<Truncate, DecodeError> {
    let xid = cur.get_stream_xid(ctx)?;
    let count = cur.get_count_i32("relation count")?;
    let options = cur.get_u8("options")?;
    let mut relation_ids = Vec::with_capacity(cur.capacity_for(count, 4));
    for _ in 0..count {
        relation_ids.push(cur.get_u32("relation_id")?);
    }
    Ok(Truncate {
        xid,
        options,
        relation_ids,
    })
}

fn decode_message(
    cur: &mut Cursor,
    ctx: DecodeContext,
) -> Result<LogicalDecodingMessage, DecodeError> {
    let xid = cur.get_stream_xid(ctx)?;
    let flags = cur.get_u8("flags")?;
    let lsn = cur.get_lsn("lsn")?;
    let prefix = cur.get_pgstr("prefix")?;
    let len = cur.get_count_i32("content length")?;
    Ok(LogicalDecodingMessage {
        xid,
        flags,
        lsn,
        prefix,
        content: cur.get_bytes(len, "content")?,
    })
}

fn decode_stream_abort(cur: &mut Cursor, ctx: DecodeContext) -> Result<StreamAbort, DecodeError> {
    let xid = cur.get_u32("xid")?;
    let subxid = cur.get_u32("subxid")?;
    // The v4 tail is present only with `streaming 'parallel'`; its absence is valid.
    let abort = if ctx.protocol_version >= PROTO_STREAM_PARALLEL && cur.remaining() > 0 {
        Some(StreamAbortInfo {
            abort_lsn: cur.get_lsn("abort_lsn")?,
            abort_time: cur.get_i64("abort_time")?,
        })
    } else {
        None
    };
    Ok(StreamAbort { xid, subxid, abort })
}

fn decode_relation(cur: &mut Cursor, ctx: DecodeContext) -> Result<Relation, DecodeError> {
    let xid = cur.get_stream_xid(ctx)?;
    let id = cur.get_u32("relation_id")?;
    let namespace = cur.get_string("namespace")?;
    let name = cur.get_string("name")?;
    let replica_identity = cur.get_u8("replica_identity")?;
    let count = cur.get_count_i16("column count")?;
    // flags (1) + name terminator (1) + type OID (4) + type modifier (4).
    let mut columns = Vec::with_capacity(cur.capacity_for(count, 10));
    for _ in 0..count {
        columns.push(RelationColumn {
            flags: cur.get_u8("column flags")?,
            name: cur.get_string("column name")?,
            type_oid: cur.get_u32("column type_oid")?,
            type_modifier: cur.get_i32("column type_modifier")?,
        });
    }
    Ok(Relation {
        xid,
        id,
        namespace,
        name,
        replica_identity,
        columns,
    })
}

fn decode_prepare(cur: &mut Cursor) -> Result<Prepare, DecodeError> {
    Ok(Prepare {
        flags: cur.get_u8("flags")?,
        prepare_lsn: cur.get_lsn("prepare_lsn")?,
        end_lsn: cur.get_lsn("end_lsn")?,
        prepare_time: cur.get_i64("prepare_time")?,
        xid: cur.get_u32("xid")?,
        gid: cur.get_pgstr("gid")?,
    })
}

/// The documented name of the message with `tag`, for errors and logs.
const fn message_name(tag: u8) -> &'static str {
    match tag {
        BEGIN => "Begin",
        COMMIT => "Commit",
        ORIGIN => "Origin",
        RELATION => "Relation",
        TYPE => "Type",
        INSERT => "Insert",
        UPDATE => "Update",
        DELETE => "Delete",
        TRUNCATE => "Truncate",
        MESSAGE => "Message",
        STREAM_START => "Stream Start",
        STREAM_STOP => "Stream Stop",
        STREAM_COMMIT => "Stream Commit",
        STREAM_ABORT => "Stream Abort",
        BEGIN_PREPARE => "Begin Prepare",
        PREPARE => "Prepare",
        COMMIT_PREPARED => "Commit Prepared",
        ROLLBACK_PREPARED => "Rollback Prepared",
        STREAM_PREPARE => "Stream Prepare",
        _ => "unknown",
    }
}

/// Shows a tag byte as `0x42 ('B')`.
struct TagDisplay(u8);

impl fmt::Display for TagDisplay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#04x} ({:?})", self.0, char::from(self.0))
    }
}

/// A bounds-checked reader over one message. Every getter checks the remaining
/// length first and returns [`DecodeError`] instead of panicking; slices share the
/// input buffer.
struct Cursor {
    buf: Bytes,
    pos: usize,
    message: &'static str,
}

impl Cursor {
    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn truncated(&self, field: &'static str, needed: usize) -> DecodeError {
        DecodeError::Truncated {
            message: self.message,
            field,
            needed,
            remaining: self.remaining(),
        }
    }

    fn unexpected_marker(&self, expected: &'static str, found: u8) -> DecodeError {
        DecodeError::UnexpectedTupleMarker {
            message: self.message,
            expected,
            found,
        }
    }

    /// Reads a tuple marker that must be `'N'` (new tuple follows).
    fn expect_new_marker(&mut self, field: &'static str) -> Result<(), DecodeError> {
        match self.get_u8(field)? {
            TUPLE_NEW => Ok(()),
            other => Err(self.unexpected_marker("'N'", other)),
        }
    }

    /// The next `N` bytes as an array.
    fn take<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], DecodeError> {
        let chunk = self
            .buf
            .get(self.pos..)
            .and_then(<[u8]>::first_chunk::<N>)
            .copied()
            .ok_or_else(|| self.truncated(field, N))?;
        self.pos = self.pos.saturating_add(N);
        Ok(chunk)
    }

    fn get_u8(&mut self, field: &'static str) -> Result<u8, DecodeError> {
        self.take::<1>(field).map(|[b]| b)
    }

    fn get_i16(&mut self, field: &'static str) -> Result<i16, DecodeError> {
        self.take(field).map(i16::from_be_bytes)
    }

    fn get_i32(&mut self, field: &'static str) -> Result<i32, DecodeError> {
        self.take(field).map(i32::from_be_bytes)
    }

    fn get_u32(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        self.take(field).map(u32::from_be_bytes)
    }

    fn get_i64(&mut self, field: &'static str) -> Result<i64, DecodeError> {
        self.take(field).map(i64::from_be_bytes)
    }

    fn get_lsn(&mut self, field: &'static str) -> Result<Lsn, DecodeError> {
        self.take(field).map(|b| Lsn(u64::from_be_bytes(b)))
    }

    /// The streamed-transaction xid, read only when the context says it is present.
    fn get_stream_xid(&mut self, ctx: DecodeContext) -> Result<Option<u32>, DecodeError> {
        if ctx.has_stream_xid() {
            self.get_u32("xid").map(Some)
        } else {
            Ok(None)
        }
    }

    fn invalid_length(&self, field: &'static str, value: i64) -> DecodeError {
        DecodeError::InvalidLength {
            message: self.message,
            field,
            value,
        }
    }

    /// An `Int16` count; negative is an error.
    fn get_count_i16(&mut self, field: &'static str) -> Result<usize, DecodeError> {
        let n = self.get_i16(field)?;
        usize::try_from(n).map_err(|_| self.invalid_length(field, i64::from(n)))
    }

    /// An `Int32` count or length; negative is an error.
    fn get_count_i32(&mut self, field: &'static str) -> Result<usize, DecodeError> {
        let n = self.get_i32(field)?;
        usize::try_from(n).map_err(|_| self.invalid_length(field, i64::from(n)))
    }

    /// How many elements of at least `min_size` bytes can still fit, capped at
    /// `count`: a preallocation bound that a hostile count cannot inflate.
    fn capacity_for(&self, count: usize, min_size: usize) -> usize {
        count.min(self.remaining().checked_div(min_size).unwrap_or(0))
    }

    /// The next `len` bytes as a zero-copy slice.
    fn get_bytes(&mut self, len: usize, field: &'static str) -> Result<Bytes, DecodeError> {
        let end = self
            .pos
            .checked_add(len)
            .filter(|&end| end <= self.buf.len())
            .ok_or_else(|| self.truncated(field, len))?;
        let out = self.buf.slice(self.pos..end);
        self.pos = end;
        Ok(out)
    }

    /// A NUL-terminated string as a zero-copy slice, terminator consumed.
    fn get_cstr(&mut self, field: &'static str) -> Result<Bytes, DecodeError> {
        let nul = self
            .buf
            .get(self.pos..)
            .and_then(|rest| rest.iter().position(|&b| b == 0))
            .ok_or(DecodeError::UnterminatedString {
                message: self.message,
                field,
            })?;
        let out = self.get_bytes(nul, field)?;
        self.pos = self.pos.saturating_add(1);
        Ok(out)
    }

    fn get_pgstr(&mut self, field: &'static str) -> Result<PgStr, DecodeError> {
        self.get_cstr(field).map(PgStr)
    }

    /// A NUL-terminated string validated into an owned `String`.
    fn get_string(&mut self, field: &'static str) -> Result<String, DecodeError> {
        let raw = self.get_cstr(field)?;
        std::str::from_utf8(&raw)
            .map(str::to_owned)
            .map_err(|_| DecodeError::InvalidUtf8 {
                message: self.message,
                field,
            })
    }

    /// `TupleData`: an `Int16` column count, then a kind byte (and for text and
    /// binary an `Int32` length and the bytes) per column.
    fn get_tuple(&mut self) -> Result<TupleData, DecodeError> {
        let count = self.get_count_i16("tuple column count")?;
        // Every column takes at least its kind byte.
        let mut columns = Vec::with_capacity(self.capacity_for(count, 1));
        for _ in 0..count {
            let value = match self.get_u8("column kind")? {
                COLUMN_NULL => ColumnValue::Null,
                COLUMN_UNCHANGED_TOAST => ColumnValue::UnchangedToast,
                COLUMN_TEXT => {
                    let len = self.get_count_i32("column length")?;
                    ColumnValue::Text(self.get_bytes(len, "column value")?)
                }
                COLUMN_BINARY => {
                    let len = self.get_count_i32("column length")?;
                    ColumnValue::Binary(self.get_bytes(len, "column value")?)
                }
                kind => {
                    return Err(DecodeError::UnknownColumnKind {
                        message: self.message,
                        kind,
                    });
                }
            };
            columns.push(value);
        }
        Ok(TupleData { columns })
    }

    /// Rejects bytes left after a complete message.
    fn finish(&self) -> Result<(), DecodeError> {
        match self.remaining() {
            0 => Ok(()),
            extra => Err(DecodeError::TrailingBytes {
                message: self.message,
                extra,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::{BufMut, BytesMut};
    use proptest::prelude::*;

    // ---- a small test encoder, the mirror of `decode` ----

    fn put_cstr(out: &mut BytesMut, s: &[u8]) {
        out.put_slice(s);
        out.put_u8(0);
    }

    fn put_xid(out: &mut BytesMut, xid: Option<u32>) {
        if let Some(xid) = xid {
            out.put_u32(xid);
        }
    }

    fn put_tuple(out: &mut BytesMut, tuple: &TupleData) {
        let count = i16::try_from(tuple.columns.len()).expect("test tuples are small");
        out.put_i16(count);
        for value in &tuple.columns {
            out.put_u8(value.kind());
            if let Some(bytes) = value.bytes() {
                out.put_i32(i32::try_from(bytes.len()).expect("test values are small"));
                out.put_slice(bytes);
            }
        }
    }

    fn put_prepare(out: &mut BytesMut, p: &Prepare) {
        out.put_u8(p.flags);
        out.put_u64(p.prepare_lsn.0);
        out.put_u64(p.end_lsn.0);
        out.put_i64(p.prepare_time);
        out.put_u32(p.xid);
        put_cstr(out, p.gid.as_bytes());
    }

    fn encode(msg: &LogicalReplicationMessage) -> Bytes {
        use LogicalReplicationMessage as M;
        let mut out = BytesMut::new();
        out.put_u8(msg.tag());
        match msg {
            M::Begin(b) => {
                out.put_u64(b.final_lsn.0);
                out.put_i64(b.commit_time);
                out.put_u32(b.xid);
            }
            M::Commit(c) => {
                out.put_u8(c.flags);
                out.put_u64(c.commit_lsn.0);
                out.put_u64(c.end_lsn.0);
                out.put_i64(c.commit_time);
            }
            M::Origin(o) => {
                out.put_u64(o.commit_lsn.0);
                put_cstr(&mut out, o.name.as_bytes());
            }
            M::Relation(r) => {
                put_xid(&mut out, r.xid);
                out.put_u32(r.id);
                put_cstr(&mut out, r.namespace.as_bytes());
                put_cstr(&mut out, r.name.as_bytes());
                out.put_u8(r.replica_identity);
                out.put_i16(i16::try_from(r.columns.len()).expect("few columns"));
                for c in &r.columns {
                    out.put_u8(c.flags);
                    put_cstr(&mut out, c.name.as_bytes());
                    out.put_u32(c.type_oid);
                    out.put_i32(c.type_modifier);
                }
            }
            M::Type(t) => {
                put_xid(&mut out, t.xid);
                out.put_u32(t.type_oid);
                put_cstr(&mut out, t.namespace.as_bytes());
                put_cstr(&mut out, t.name.as_bytes());
            }
            M::Insert(i) => {
                put_xid(&mut out, i.xid);
                out.put_u32(i.relation_id);
                out.put_u8(TUPLE_NEW);
                put_tuple(&mut out, &i.tuple);
            }
            M::Update(u) => {
                put_xid(&mut out, u.xid);
                out.put_u32(u.relation_id);
                if let Some(old) = &u.old {
                    out.put_u8(old.marker());
                    put_tuple(&mut out, old.tuple());
                }
                out.put_u8(TUPLE_NEW);
                put_tuple(&mut out, &u.new);
            }
            M::Delete(d) => {
                put_xid(&mut out, d.xid);
                out.put_u32(d.relation_id);
                out.put_u8(d.old.marker());
                put_tuple(&mut out, d.old.tuple());
            }
            M::Truncate(t) => {
                put_xid(&mut out, t.xid);
                out.put_i32(i32::try_from(t.relation_ids.len()).expect("few relations"));
                out.put_u8(t.options);
                for id in &t.relation_ids {
                    out.put_u32(*id);
                }
            }
            M::Message(m) => {
                put_xid(&mut out, m.xid);
                out.put_u8(m.flags);
                out.put_u64(m.lsn.0);
                put_cstr(&mut out, m.prefix.as_bytes());
                out.put_i32(i32::try_from(m.content.len()).expect("small content"));
                out.put_slice(&m.content);
            }
            M::StreamStart(s) => {
                out.put_u32(s.xid);
                out.put_u8(u8::from(s.first_segment));
            }
            M::StreamStop => {}
            M::StreamCommit(c) => {
                out.put_u32(c.xid);
                out.put_u8(c.flags);
                out.put_u64(c.commit_lsn.0);
                out.put_u64(c.end_lsn.0);
                out.put_i64(c.commit_time);
            }
            M::StreamAbort(a) => {
                out.put_u32(a.xid);
                out.put_u32(a.subxid);
                if let Some(info) = a.abort {
                    out.put_u64(info.abort_lsn.0);
                    out.put_i64(info.abort_time);
                }
            }
            M::BeginPrepare(b) => {
                out.put_u64(b.prepare_lsn.0);
                out.put_u64(b.end_lsn.0);
                out.put_i64(b.prepare_time);
                out.put_u32(b.xid);
                put_cstr(&mut out, b.gid.as_bytes());
            }
            M::Prepare(p) | M::StreamPrepare(p) => put_prepare(&mut out, p),
            M::CommitPrepared(c) => {
                out.put_u8(c.flags);
                out.put_u64(c.commit_lsn.0);
                out.put_u64(c.end_lsn.0);
                out.put_i64(c.commit_time);
                out.put_u32(c.xid);
                put_cstr(&mut out, c.gid.as_bytes());
            }
            M::RollbackPrepared(r) => {
                out.put_u8(r.flags);
                out.put_u64(r.prepare_end_lsn.0);
                out.put_u64(r.rollback_end_lsn.0);
                out.put_i64(r.prepare_time);
                out.put_i64(r.rollback_time);
                out.put_u32(r.xid);
                put_cstr(&mut out, r.gid.as_bytes());
            }
        }
        out.freeze()
    }

    /// The streamed-transaction xid of a data message, if it has one.
    fn stream_xid(msg: &LogicalReplicationMessage) -> Option<u32> {
        use LogicalReplicationMessage as M;
        match msg {
            M::Relation(m) => m.xid,
            M::Type(m) => m.xid,
            M::Insert(m) => m.xid,
            M::Update(m) => m.xid,
            M::Delete(m) => m.xid,
            M::Truncate(m) => m.xid,
            M::Message(m) => m.xid,
            _ => None,
        }
    }

    /// The lowest protocol version that can carry `msg` as built.
    fn min_version(msg: &LogicalReplicationMessage) -> u8 {
        use LogicalReplicationMessage as M;
        match msg {
            M::StreamAbort(StreamAbort { abort: Some(_), .. }) => PROTO_STREAM_PARALLEL,
            M::StreamStart(_) | M::StreamStop | M::StreamCommit(_) | M::StreamAbort(_) => {
                PROTO_STREAMING
            }
            M::BeginPrepare(_)
            | M::Prepare(_)
            | M::CommitPrepared(_)
            | M::RollbackPrepared(_)
            | M::StreamPrepare(_) => PROTO_TWO_PHASE,
            _ if stream_xid(msg).is_some() => PROTO_STREAMING,
            _ => 1,
        }
    }

    /// The context `msg` must be decoded with (at least `version`).
    fn ctx_for(msg: &LogicalReplicationMessage, version: u8) -> DecodeContext {
        DecodeContext::new(version.max(min_version(msg))).with_in_stream(stream_xid(msg).is_some())
    }

    fn b(s: &'static str) -> Bytes {
        Bytes::from_static(s.as_bytes())
    }

    fn pgstr(s: &'static str) -> PgStr {
        PgStr(b(s))
    }

    fn outbox_tuple() -> TupleData {
        TupleData {
            columns: vec![
                ColumnValue::Text(b("0190f5c2-7d4e-7a3b-9c1d-2e3f4a5b6c7d")),
                ColumnValue::Text(b("order-42")),
                ColumnValue::Null,
                ColumnValue::Text(b(r#"{"total": 12.5}"#)),
                ColumnValue::Binary(Bytes::from_static(&[0, 1, 2, 0xff])),
                ColumnValue::Text(Bytes::new()),
            ],
        }
    }

    /// One valid instance of every message kind, with the context to decode it.
    fn samples() -> Vec<(LogicalReplicationMessage, DecodeContext)> {
        use LogicalReplicationMessage as M;
        let msgs = vec![
            M::Begin(Begin {
                final_lsn: Lsn(0x16_B374_D848),
                commit_time: 774_000_000_000_000,
                xid: 771,
            }),
            M::Commit(Commit {
                flags: 0,
                commit_lsn: Lsn(0x16_B374_D848),
                end_lsn: Lsn(0x16_B374_D878),
                commit_time: 774_000_000_000_000,
            }),
            M::Origin(Origin {
                commit_lsn: Lsn(5),
                name: pgstr("pg_16399"),
            }),
            M::Relation(Relation {
                xid: None,
                id: 16_384,
                namespace: "public".into(),
                name: "outbox".into(),
                replica_identity: b'd',
                columns: vec![
                    RelationColumn {
                        flags: 1,
                        name: "id".into(),
                        type_oid: 2950,
                        type_modifier: -1,
                    },
                    RelationColumn {
                        flags: 0,
                        name: "payload".into(),
                        type_oid: 3802,
                        type_modifier: -1,
                    },
                ],
            }),
            M::Relation(Relation {
                xid: Some(900),
                id: 1,
                namespace: String::new(),
                name: "t".into(),
                replica_identity: b'f',
                columns: vec![],
            }),
            M::Type(Type {
                xid: None,
                type_oid: 16_500,
                namespace: pgstr("public"),
                name: pgstr("mood"),
            }),
            M::Insert(Insert {
                xid: None,
                relation_id: 16_384,
                tuple: outbox_tuple(),
            }),
            M::Insert(Insert {
                xid: Some(901),
                relation_id: 16_384,
                tuple: TupleData::default(),
            }),
            M::Update(Update {
                xid: None,
                relation_id: 16_384,
                old: None,
                new: TupleData {
                    columns: vec![ColumnValue::Text(b("1")), ColumnValue::UnchangedToast],
                },
            }),
            M::Update(Update {
                xid: Some(902),
                relation_id: 16_384,
                old: Some(OldTuple::Key(TupleData {
                    columns: vec![ColumnValue::Text(b("1")), ColumnValue::Null],
                })),
                new: TupleData {
                    columns: vec![ColumnValue::Text(b("2")), ColumnValue::Text(b("x"))],
                },
            }),
            M::Update(Update {
                xid: None,
                relation_id: 7,
                old: Some(OldTuple::Full(outbox_tuple())),
                new: outbox_tuple(),
            }),
            M::Delete(Delete {
                xid: None,
                relation_id: 16_384,
                old: OldTuple::Key(TupleData {
                    columns: vec![ColumnValue::Text(b("1")), ColumnValue::Null],
                }),
            }),
            M::Delete(Delete {
                xid: Some(903),
                relation_id: 16_384,
                old: OldTuple::Full(outbox_tuple()),
            }),
            M::Truncate(Truncate {
                xid: None,
                options: Truncate::CASCADE | Truncate::RESTART_IDENTITY,
                relation_ids: vec![16_384, 16_390],
            }),
            M::Message(LogicalDecodingMessage {
                xid: None,
                flags: 0,
                lsn: Lsn(0x1_0000_0000),
                prefix: pgstr("outbox_relay.heartbeat"),
                content: b("tick"),
            }),
            M::Message(LogicalDecodingMessage {
                xid: Some(904),
                flags: LogicalDecodingMessage::TRANSACTIONAL,
                lsn: Lsn(9),
                prefix: PgStr::default(),
                content: Bytes::new(),
            }),
            M::StreamStart(StreamStart {
                xid: 905,
                first_segment: true,
            }),
            M::StreamStop,
            M::StreamCommit(StreamCommit {
                xid: 905,
                flags: 0,
                commit_lsn: Lsn(100),
                end_lsn: Lsn(148),
                commit_time: 1,
            }),
            M::StreamAbort(StreamAbort {
                xid: 905,
                subxid: 906,
                abort: None,
            }),
            M::StreamAbort(StreamAbort {
                xid: 905,
                subxid: 905,
                abort: Some(StreamAbortInfo {
                    abort_lsn: Lsn(200),
                    abort_time: -1,
                }),
            }),
            M::BeginPrepare(BeginPrepare {
                prepare_lsn: Lsn(300),
                end_lsn: Lsn(348),
                prepare_time: 2,
                xid: 907,
                gid: pgstr("gid-1"),
            }),
            M::Prepare(Prepare {
                flags: 0,
                prepare_lsn: Lsn(300),
                end_lsn: Lsn(348),
                prepare_time: 2,
                xid: 907,
                gid: pgstr("gid-1"),
            }),
            M::StreamPrepare(Prepare {
                flags: 0,
                prepare_lsn: Lsn(400),
                end_lsn: Lsn(448),
                prepare_time: 3,
                xid: 908,
                gid: pgstr("gid-2"),
            }),
            M::CommitPrepared(CommitPrepared {
                flags: 0,
                commit_lsn: Lsn(500),
                end_lsn: Lsn(548),
                commit_time: 4,
                xid: 907,
                gid: pgstr("gid-1"),
            }),
            M::RollbackPrepared(RollbackPrepared {
                flags: 0,
                prepare_end_lsn: Lsn(448),
                rollback_end_lsn: Lsn(600),
                prepare_time: 3,
                rollback_time: 5,
                xid: 908,
                gid: pgstr("gid-2"),
            }),
        ];
        msgs.into_iter()
            .map(|m| {
                let ctx = ctx_for(&m, 1);
                (m, ctx)
            })
            .collect()
    }

    // ---- round trips ----

    #[test]
    fn every_sample_round_trips() {
        let samples = samples();
        // Every message kind is covered.
        let mut tags: Vec<u8> = samples.iter().map(|(m, _)| m.tag()).collect();
        tags.sort_unstable();
        tags.dedup();
        assert_eq!(tags.len(), 19);
        for (msg, ctx) in samples {
            let bytes = encode(&msg);
            assert_eq!(decode(bytes, ctx).as_ref(), Ok(&msg), "{}", msg.name());
        }
    }

    #[test]
    fn newer_versions_decode_older_messages() {
        for (msg, _) in samples() {
            let bytes = encode(&msg);
            for version in min_version(&msg)..=PROTO_STREAM_PARALLEL {
                let ctx = ctx_for(&msg, version);
                assert_eq!(decode(bytes.clone(), ctx).as_ref(), Ok(&msg), "v{version}");
            }
        }
    }

    #[test]
    fn insert_decodes_from_hand_built_bytes() {
        let mut buf = BytesMut::new();
        buf.put_u8(b'I');
        buf.put_u32(16_384);
        buf.put_u8(b'N');
        buf.put_i16(3);
        buf.put_u8(b't');
        buf.put_i32(2);
        buf.put_slice(b"42");
        buf.put_u8(b'n');
        buf.put_u8(b'b');
        buf.put_i32(1);
        buf.put_u8(0xAB);
        let buf = buf.freeze();
        let msg = decode(buf.clone(), DecodeContext::default()).expect("valid Insert");
        let LogicalReplicationMessage::Insert(insert) = msg else {
            panic!("expected Insert, got {msg:?}");
        };
        assert_eq!(insert.relation_id, 16_384);
        assert_eq!(insert.xid, None);
        assert_eq!(insert.tuple.len(), 3);
        assert_eq!(insert.tuple.get(0), Some(&ColumnValue::Text(b("42"))));
        assert_eq!(insert.tuple.get(1), Some(&ColumnValue::Null));
        assert_eq!(
            insert.tuple.get(2),
            Some(&ColumnValue::Binary(Bytes::from_static(&[0xAB])))
        );
        assert_eq!(insert.tuple.get(3), None);
    }

    #[test]
    fn values_and_names_are_zero_copy() {
        let msg = LogicalReplicationMessage::Insert(Insert {
            xid: None,
            relation_id: 1,
            tuple: outbox_tuple(),
        });
        let bytes = encode(&msg);
        let range = bytes.as_ptr_range();
        let decoded = decode(bytes.clone(), DecodeContext::default()).expect("valid");
        let LogicalReplicationMessage::Insert(insert) = decoded else {
            panic!("expected Insert");
        };
        for value in insert.tuple.columns.iter().filter_map(ColumnValue::bytes) {
            if !value.is_empty() {
                assert!(range.contains(&value.as_ptr()), "value copied: {value:?}");
            }
        }

        let origin = LogicalReplicationMessage::Origin(Origin {
            commit_lsn: Lsn(1),
            name: pgstr("node_a"),
        });
        let bytes = encode(&origin);
        let range = bytes.as_ptr_range();
        let Ok(LogicalReplicationMessage::Origin(o)) =
            decode(bytes.clone(), DecodeContext::default())
        else {
            panic!("expected Origin");
        };
        assert!(range.contains(&o.name.as_bytes().as_ptr()));
        assert_eq!(o.name, "node_a");
        assert_eq!(o.name.as_str(), Ok("node_a"));
    }

    // ---- the v2 streamed-transaction xid ----

    #[test]
    fn stream_xid_changes_the_layout() {
        let msg = LogicalReplicationMessage::Insert(Insert {
            xid: Some(7),
            relation_id: 16_384,
            tuple: outbox_tuple(),
        });
        let bytes = encode(&msg);
        let in_stream = DecodeContext::new(2).with_in_stream(true);
        assert_eq!(decode(bytes.clone(), in_stream).as_ref(), Ok(&msg));
        // Read as a non-streamed Insert, the xid becomes the relation id and the
        // relation id's first byte is taken for the tuple marker.
        assert_eq!(
            decode(bytes.clone(), DecodeContext::new(2)),
            Err(DecodeError::UnexpectedTupleMarker {
                message: "Insert",
                expected: "'N'",
                found: 0,
            })
        );
        // In protocol v1 the in_stream flag is ignored: no xid is read.
        let plain = LogicalReplicationMessage::Insert(Insert {
            xid: None,
            relation_id: 16_384,
            tuple: outbox_tuple(),
        });
        let v1_in_stream = DecodeContext::new(1).with_in_stream(true);
        assert!(!v1_in_stream.has_stream_xid());
        assert_eq!(decode(encode(&plain), v1_in_stream), Ok(plain));
    }

    #[test]
    fn decoder_tracks_stream_blocks() {
        use LogicalReplicationMessage as M;
        let mut decoder = Decoder::new(2);
        let start = encode(&M::StreamStart(StreamStart {
            xid: 10,
            first_segment: true,
        }));
        let streamed = M::Insert(Insert {
            xid: Some(10),
            relation_id: 1,
            tuple: outbox_tuple(),
        });
        let plain = M::Insert(Insert {
            xid: None,
            relation_id: 1,
            tuple: outbox_tuple(),
        });
        let stop = encode(&M::StreamStop);

        assert!(!decoder.context().in_stream);
        assert!(matches!(
            decoder.decode(start.clone()),
            Ok(M::StreamStart(_))
        ));
        assert!(decoder.context().in_stream);
        assert_eq!(decoder.decode(encode(&streamed)), Ok(streamed));
        assert_eq!(
            decoder.decode(start.clone()),
            Err(DecodeError::StreamBoundary {
                tag: STREAM_START,
                in_stream: true
            })
        );
        assert!(
            decoder.context().in_stream,
            "a failed decode changes nothing"
        );
        assert_eq!(decoder.decode(stop.clone()), Ok(M::StreamStop));
        assert!(!decoder.context().in_stream);
        assert_eq!(decoder.decode(encode(&plain)), Ok(plain));
        assert_eq!(
            decoder.decode(stop),
            Err(DecodeError::StreamBoundary {
                tag: STREAM_STOP,
                in_stream: false
            })
        );
        let err = DecodeError::StreamBoundary {
            tag: STREAM_STOP,
            in_stream: false,
        };
        assert_eq!(
            err.to_string(),
            "pgoutput Stream Stop message outside a stream block"
        );
    }

    // ---- errors ----

    #[test]
    fn every_truncation_of_an_insert_is_an_error() {
        for xid in [None, Some(77)] {
            let msg = LogicalReplicationMessage::Insert(Insert {
                xid,
                relation_id: 16_384,
                tuple: outbox_tuple(),
            });
            let ctx = ctx_for(&msg, 1);
            let full = encode(&msg);
            for len in 0..full.len() {
                let result = decode(full.slice(..len), ctx);
                assert!(result.is_err(), "prefix of {len} bytes decoded: {result:?}");
            }
        }
    }

    #[test]
    fn every_truncation_of_every_message_is_an_error() {
        for (msg, ctx) in samples() {
            let full = encode(&msg);
            for len in 0..full.len() {
                // A v4 Stream Abort without its optional tail is itself valid.
                let optional_tail = matches!(
                    msg,
                    LogicalReplicationMessage::StreamAbort(StreamAbort { abort: Some(_), .. })
                ) && len == 9;
                let result = decode(full.slice(..len), ctx);
                assert_eq!(
                    result.is_ok(),
                    optional_tail,
                    "{} prefix of {len} bytes: {result:?}",
                    msg.name()
                );
            }
        }
    }

    #[test]
    fn trailing_bytes_are_an_error() {
        for (msg, ctx) in samples() {
            let mut long = BytesMut::from(&encode(&msg)[..]);
            long.put_u8(0);
            let result = decode(long.freeze(), ctx);
            let ok = match &result {
                Err(DecodeError::TrailingBytes { extra: 1, .. }) => true,
                // A v4 Stream Abort reads a following byte as the start of its tail.
                Err(DecodeError::Truncated { message, .. }) => *message == "Stream Abort",
                _ => false,
            };
            assert!(ok, "{}: {result:?}", msg.name());
        }
    }

    #[test]
    fn empty_and_unknown_tags() {
        let ctx = DecodeContext::new(4);
        assert_eq!(decode(Bytes::new(), ctx), Err(DecodeError::Empty));
        assert_eq!(
            decode(Bytes::from_static(b"Z\x00\x00"), ctx),
            Err(DecodeError::UnknownTag { tag: b'Z' })
        );
        assert_eq!(
            DecodeError::UnknownTag { tag: b'Z' }.to_string(),
            "unknown pgoutput message tag 0x5a ('Z')"
        );
    }

    #[test]
    fn messages_newer_than_the_protocol_are_rejected() {
        for (msg, _) in samples() {
            let required = min_version(&msg);
            // The stream xid is a context matter, not a message-kind one.
            if stream_xid(&msg).is_some() || required == PROTO_STREAM_PARALLEL {
                continue;
            }
            for version in 0..required {
                assert_eq!(
                    decode(encode(&msg), DecodeContext::new(version)),
                    Err(DecodeError::UnsupportedMessage {
                        tag: msg.tag(),
                        protocol_version: version,
                        required,
                    }),
                    "{} in v{version}",
                    msg.name()
                );
            }
        }
        // A v3 decoder reads the v4 Stream Abort tail as trailing bytes.
        let abort = LogicalReplicationMessage::StreamAbort(StreamAbort {
            xid: 1,
            subxid: 2,
            abort: Some(StreamAbortInfo {
                abort_lsn: Lsn(3),
                abort_time: 4,
            }),
        });
        assert_eq!(
            decode(encode(&abort), DecodeContext::new(3)),
            Err(DecodeError::TrailingBytes {
                message: "Stream Abort",
                extra: 16
            })
        );
    }

    /// An Insert header (`'I'`, relation id, `'N'`) followed by `tail`.
    fn insert_with(tail: &[u8]) -> Bytes {
        let mut buf = BytesMut::new();
        buf.put_u8(INSERT);
        buf.put_u32(1);
        buf.put_u8(TUPLE_NEW);
        buf.put_slice(tail);
        buf.freeze()
    }

    #[test]
    fn tuple_errors() {
        let ctx = DecodeContext::default();
        // Unknown column kind.
        assert_eq!(
            decode(insert_with(&[0, 1, b'x']), ctx),
            Err(DecodeError::UnknownColumnKind {
                message: "Insert",
                kind: b'x'
            })
        );
        // Negative column count.
        assert_eq!(
            decode(insert_with(&[0xff, 0xff]), ctx),
            Err(DecodeError::InvalidLength {
                message: "Insert",
                field: "tuple column count",
                value: -1
            })
        );
        // Negative value length.
        assert_eq!(
            decode(insert_with(&[0, 1, b't', 0xff, 0xff, 0xff, 0xfe]), ctx),
            Err(DecodeError::InvalidLength {
                message: "Insert",
                field: "column length",
                value: -2
            })
        );
        // Length past the end of the message.
        assert_eq!(
            decode(
                insert_with(&[0, 1, b't', 0x7f, 0xff, 0xff, 0xff, b'a']),
                ctx
            ),
            Err(DecodeError::Truncated {
                message: "Insert",
                field: "column value",
                needed: 0x7fff_ffff,
                remaining: 1
            })
        );
        // A huge column count with no columns behind it.
        assert!(matches!(
            decode(insert_with(&[0x7f, 0xff]), ctx),
            Err(DecodeError::Truncated {
                field: "column kind",
                ..
            })
        ));
    }

    #[test]
    fn tuple_marker_errors() {
        let ctx = DecodeContext::default();
        let mut insert = BytesMut::new();
        insert.put_u8(INSERT);
        insert.put_u32(1);
        insert.put_u8(TUPLE_KEY);
        insert.put_i16(0);
        assert_eq!(
            decode(insert.freeze(), ctx),
            Err(DecodeError::UnexpectedTupleMarker {
                message: "Insert",
                expected: "'N'",
                found: b'K'
            })
        );

        let mut update = BytesMut::new();
        update.put_u8(UPDATE);
        update.put_u32(1);
        update.put_u8(b'X');
        assert!(matches!(
            decode(update.freeze(), ctx),
            Err(DecodeError::UnexpectedTupleMarker { found: b'X', .. })
        ));

        // Old tuple followed by something other than the new tuple.
        let mut update = BytesMut::new();
        update.put_u8(UPDATE);
        update.put_u32(1);
        update.put_u8(TUPLE_OLD);
        update.put_i16(0);
        update.put_u8(TUPLE_KEY);
        update.put_i16(0);
        assert!(matches!(
            decode(update.freeze(), ctx),
            Err(DecodeError::UnexpectedTupleMarker {
                message: "Update",
                found: b'K',
                ..
            })
        ));

        let mut delete = BytesMut::new();
        delete.put_u8(DELETE);
        delete.put_u32(1);
        delete.put_u8(TUPLE_NEW);
        delete.put_i16(0);
        assert!(matches!(
            decode(delete.freeze(), ctx),
            Err(DecodeError::UnexpectedTupleMarker {
                message: "Delete",
                expected: "'K' or 'O'",
                found: b'N'
            })
        ));
    }

    #[test]
    fn string_errors() {
        let ctx = DecodeContext::default();
        // Missing NUL terminator.
        let mut origin = BytesMut::new();
        origin.put_u8(ORIGIN);
        origin.put_u64(1);
        origin.put_slice(b"no-terminator");
        assert_eq!(
            decode(origin.freeze(), ctx),
            Err(DecodeError::UnterminatedString {
                message: "Origin",
                field: "name"
            })
        );

        // Invalid UTF-8 in a relation name.
        let mut rel = BytesMut::new();
        rel.put_u8(RELATION);
        rel.put_u32(1);
        put_cstr(&mut rel, b"public");
        put_cstr(&mut rel, b"bad\xff");
        rel.put_u8(b'd');
        rel.put_i16(0);
        assert_eq!(
            decode(rel.freeze(), ctx),
            Err(DecodeError::InvalidUtf8 {
                message: "Relation",
                field: "name"
            })
        );

        // Non-UTF-8 bytes are fine in a PgStr until someone asks for text.
        let mut ty = BytesMut::new();
        ty.put_u8(TYPE);
        ty.put_u32(1);
        put_cstr(&mut ty, b"ns");
        put_cstr(&mut ty, b"\xfe");
        let Ok(LogicalReplicationMessage::Type(t)) = decode(ty.freeze(), ctx) else {
            panic!("expected Type");
        };
        assert!(t.name.as_str().is_err());
        assert_eq!(t.name.as_bytes(), b"\xfe");
        assert_eq!(format!("{:?}", t.namespace), "\"ns\"");
    }

    #[test]
    fn negative_counts_are_errors() {
        let ctx = DecodeContext::default();
        let mut rel = BytesMut::new();
        rel.put_u8(RELATION);
        rel.put_u32(1);
        put_cstr(&mut rel, b"public");
        put_cstr(&mut rel, b"t");
        rel.put_u8(b'd');
        rel.put_i16(-3);
        assert!(matches!(
            decode(rel.freeze(), ctx),
            Err(DecodeError::InvalidLength {
                field: "column count",
                value: -3,
                ..
            })
        ));

        let mut truncate = BytesMut::new();
        truncate.put_u8(TRUNCATE);
        truncate.put_i32(i32::MIN);
        truncate.put_u8(0);
        assert!(matches!(
            decode(truncate.freeze(), ctx),
            Err(DecodeError::InvalidLength {
                field: "relation count",
                value: -2_147_483_648,
                ..
            })
        ));

        let mut message = BytesMut::new();
        message.put_u8(MESSAGE);
        message.put_u8(0);
        message.put_u64(1);
        put_cstr(&mut message, b"p");
        message.put_i32(-1);
        assert!(matches!(
            decode(message.freeze(), ctx),
            Err(DecodeError::InvalidLength {
                field: "content length",
                value: -1,
                ..
            })
        ));
    }

    #[test]
    fn accessors() {
        let col = RelationColumn {
            flags: RelationColumn::FLAG_KEY,
            name: "id".into(),
            type_oid: 23,
            type_modifier: -1,
        };
        assert!(col.is_key());
        let t = Truncate {
            xid: None,
            options: Truncate::RESTART_IDENTITY,
            relation_ids: vec![],
        };
        assert!(!t.cascade() && t.restart_identity());
        assert_eq!(PgStr::new(b("a\0b")), Err(b("a\0b")));
        assert_eq!(PgStr::new(b("ab")).map(|s| s.len()), Ok(2));
        assert_eq!(ColumnValue::UnchangedToast.bytes(), None);
        assert_eq!(
            OldTuple::Full(TupleData::default()).tuple(),
            &TupleData::default()
        );
        assert_eq!(LogicalReplicationMessage::StreamStop.name(), "Stream Stop");
    }

    // ---- property tests ----

    fn arb_lsn() -> impl Strategy<Value = Lsn> {
        any::<u64>().prop_map(Lsn)
    }

    fn arb_pgstr() -> impl Strategy<Value = PgStr> {
        proptest::collection::vec(1u8..=255, 0..12).prop_map(|v| PgStr(Bytes::from(v)))
    }

    fn arb_name() -> impl Strategy<Value = String> {
        "[^\u{0}]{0,12}"
    }

    fn arb_bytes() -> impl Strategy<Value = Bytes> {
        proptest::collection::vec(any::<u8>(), 0..24).prop_map(Bytes::from)
    }

    fn arb_xid() -> impl Strategy<Value = Option<u32>> {
        proptest::option::of(any::<u32>())
    }

    fn arb_tuple() -> impl Strategy<Value = TupleData> {
        let value = prop_oneof![
            Just(ColumnValue::Null),
            Just(ColumnValue::UnchangedToast),
            arb_bytes().prop_map(ColumnValue::Text),
            arb_bytes().prop_map(ColumnValue::Binary),
        ];
        proptest::collection::vec(value, 0..8).prop_map(|columns| TupleData { columns })
    }

    fn arb_old() -> impl Strategy<Value = OldTuple> {
        prop_oneof![
            arb_tuple().prop_map(OldTuple::Key),
            arb_tuple().prop_map(OldTuple::Full)
        ]
    }

    fn arb_prepare() -> impl Strategy<Value = Prepare> {
        (
            any::<u8>(),
            arb_lsn(),
            arb_lsn(),
            any::<i64>(),
            any::<u32>(),
            arb_pgstr(),
        )
            .prop_map(
                |(flags, prepare_lsn, end_lsn, prepare_time, xid, gid)| Prepare {
                    flags,
                    prepare_lsn,
                    end_lsn,
                    prepare_time,
                    xid,
                    gid,
                },
            )
    }

    fn arb_message() -> impl Strategy<Value = LogicalReplicationMessage> {
        use LogicalReplicationMessage as M;
        let column = (any::<u8>(), arb_name(), any::<u32>(), any::<i32>()).prop_map(
            |(flags, name, type_oid, type_modifier)| RelationColumn {
                flags,
                name,
                type_oid,
                type_modifier,
            },
        );
        prop_oneof![
            (arb_lsn(), any::<i64>(), any::<u32>()).prop_map(|(final_lsn, commit_time, xid)| {
                M::Begin(Begin {
                    final_lsn,
                    commit_time,
                    xid,
                })
            }),
            (any::<u8>(), arb_lsn(), arb_lsn(), any::<i64>()).prop_map(
                |(flags, commit_lsn, end_lsn, commit_time)| M::Commit(Commit {
                    flags,
                    commit_lsn,
                    end_lsn,
                    commit_time,
                })
            ),
            (arb_lsn(), arb_pgstr())
                .prop_map(|(commit_lsn, name)| M::Origin(Origin { commit_lsn, name })),
            (
                arb_xid(),
                any::<u32>(),
                arb_name(),
                arb_name(),
                any::<u8>(),
                proptest::collection::vec(column, 0..6)
            )
                .prop_map(|(xid, id, namespace, name, replica_identity, columns)| {
                    M::Relation(Relation {
                        xid,
                        id,
                        namespace,
                        name,
                        replica_identity,
                        columns,
                    })
                }),
            (arb_xid(), any::<u32>(), arb_pgstr(), arb_pgstr()).prop_map(
                |(xid, type_oid, namespace, name)| M::Type(Type {
                    xid,
                    type_oid,
                    namespace,
                    name,
                })
            ),
            (arb_xid(), any::<u32>(), arb_tuple()).prop_map(|(xid, relation_id, tuple)| {
                M::Insert(Insert {
                    xid,
                    relation_id,
                    tuple,
                })
            }),
            (
                arb_xid(),
                any::<u32>(),
                proptest::option::of(arb_old()),
                arb_tuple()
            )
                .prop_map(|(xid, relation_id, old, new)| M::Update(Update {
                    xid,
                    relation_id,
                    old,
                    new,
                })),
            (arb_xid(), any::<u32>(), arb_old()).prop_map(|(xid, relation_id, old)| {
                M::Delete(Delete {
                    xid,
                    relation_id,
                    old,
                })
            }),
            (
                arb_xid(),
                any::<u8>(),
                proptest::collection::vec(any::<u32>(), 0..6)
            )
                .prop_map(|(xid, options, relation_ids)| M::Truncate(Truncate {
                    xid,
                    options,
                    relation_ids,
                })),
            (arb_xid(), any::<u8>(), arb_lsn(), arb_pgstr(), arb_bytes()).prop_map(
                |(xid, flags, lsn, prefix, content)| M::Message(LogicalDecodingMessage {
                    xid,
                    flags,
                    lsn,
                    prefix,
                    content,
                })
            ),
            (any::<u32>(), any::<bool>()).prop_map(|(xid, first_segment)| {
                M::StreamStart(StreamStart { xid, first_segment })
            }),
            Just(M::StreamStop),
            (
                any::<u32>(),
                any::<u8>(),
                arb_lsn(),
                arb_lsn(),
                any::<i64>()
            )
                .prop_map(|(xid, flags, commit_lsn, end_lsn, commit_time)| {
                    M::StreamCommit(StreamCommit {
                        xid,
                        flags,
                        commit_lsn,
                        end_lsn,
                        commit_time,
                    })
                }),
            (
                any::<u32>(),
                any::<u32>(),
                proptest::option::of((arb_lsn(), any::<i64>()))
            )
                .prop_map(|(xid, subxid, abort)| M::StreamAbort(StreamAbort {
                    xid,
                    subxid,
                    abort: abort.map(|(abort_lsn, abort_time)| StreamAbortInfo {
                        abort_lsn,
                        abort_time,
                    }),
                })),
            (
                arb_lsn(),
                arb_lsn(),
                any::<i64>(),
                any::<u32>(),
                arb_pgstr()
            )
                .prop_map(|(prepare_lsn, end_lsn, prepare_time, xid, gid)| {
                    M::BeginPrepare(BeginPrepare {
                        prepare_lsn,
                        end_lsn,
                        prepare_time,
                        xid,
                        gid,
                    })
                }),
            arb_prepare().prop_map(M::Prepare),
            arb_prepare().prop_map(M::StreamPrepare),
            (
                any::<u8>(),
                arb_lsn(),
                arb_lsn(),
                any::<i64>(),
                any::<u32>(),
                arb_pgstr()
            )
                .prop_map(|(flags, commit_lsn, end_lsn, commit_time, xid, gid)| {
                    M::CommitPrepared(CommitPrepared {
                        flags,
                        commit_lsn,
                        end_lsn,
                        commit_time,
                        xid,
                        gid,
                    })
                }),
            (
                any::<u8>(),
                arb_lsn(),
                arb_lsn(),
                any::<i64>(),
                any::<i64>(),
                any::<u32>(),
                arb_pgstr()
            )
                .prop_map(
                    |(
                        flags,
                        prepare_end_lsn,
                        rollback_end_lsn,
                        prepare_time,
                        rollback_time,
                        xid,
                        gid,
                    )| {
                        M::RollbackPrepared(RollbackPrepared {
                            flags,
                            prepare_end_lsn,
                            rollback_end_lsn,
                            prepare_time,
                            rollback_time,
                            xid,
                            gid,
                        })
                    }
                ),
        ]
    }

    fn arb_ctx() -> impl Strategy<Value = DecodeContext> {
        (0u8..=5, any::<bool>()).prop_map(|(v, s)| DecodeContext::new(v).with_in_stream(s))
    }

    /// Every known tag, to steer random bodies into the message decoders.
    const TAGS: [u8; 19] = [
        BEGIN,
        COMMIT,
        ORIGIN,
        RELATION,
        TYPE,
        INSERT,
        UPDATE,
        DELETE,
        TRUNCATE,
        MESSAGE,
        STREAM_START,
        STREAM_STOP,
        STREAM_COMMIT,
        STREAM_ABORT,
        BEGIN_PREPARE,
        PREPARE,
        COMMIT_PREPARED,
        ROLLBACK_PREPARED,
        STREAM_PREPARE,
    ];

    proptest! {
        #[test]
        fn decode_never_panics_on_arbitrary_bytes(
            bytes in proptest::collection::vec(any::<u8>(), 0..128),
            ctx in arb_ctx(),
        ) {
            let _ = decode(Bytes::from(bytes), ctx);
        }

        #[test]
        fn decode_never_panics_on_tagged_garbage(
            tag in proptest::sample::select(TAGS.to_vec()),
            body in proptest::collection::vec(any::<u8>(), 0..96),
            ctx in arb_ctx(),
        ) {
            let mut bytes = vec![tag];
            bytes.extend_from_slice(&body);
            let _ = decode(Bytes::from(bytes), ctx);
        }

        #[test]
        fn decode_never_panics_on_mutated_messages(
            msg in arb_message(),
            version in 1u8..=4,
            flips in proptest::collection::vec((any::<proptest::sample::Index>(), any::<u8>()), 1..4),
            cut in any::<proptest::sample::Index>(),
        ) {
            let ctx = ctx_for(&msg, version);
            let mut bytes = encode(&msg).to_vec();
            for (at, value) in flips {
                let i = at.index(bytes.len());
                if let Some(b) = bytes.get_mut(i) {
                    *b = value;
                }
            }
            let len = cut.index(bytes.len().saturating_add(1));
            bytes.truncate(len);
            let _ = decode(Bytes::from(bytes), ctx);
        }

        #[test]
        fn valid_messages_round_trip(msg in arb_message(), version in 1u8..=4) {
            let ctx = ctx_for(&msg, version);
            let bytes = encode(&msg);
            prop_assert_eq!(decode(bytes.clone(), ctx), Ok(msg));
        }

        #[test]
        fn decoder_never_panics_on_arbitrary_sequences(
            frames in proptest::collection::vec(
                (proptest::sample::select(TAGS.to_vec()), proptest::collection::vec(any::<u8>(), 0..32)),
                0..16,
            ),
            version in 0u8..=5,
        ) {
            let mut decoder = Decoder::new(version);
            for (tag, body) in frames {
                let mut bytes = vec![tag];
                bytes.extend_from_slice(&body);
                let _ = decoder.decode(Bytes::from(bytes));
            }
        }
    }
}
