//! The `pgoutput` messages as Rust values: one type per message, the tag and marker
//! bytes, and the zero-copy column values and strings they hold.
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
//! - A streamed transaction (protocol v2, see [`super`]) has no Begin/Commit pair: its
//!   `Stream Commit` carries the same `commit_lsn`/`end_lsn` fields.
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
//! # References
//!
//! - <https://www.postgresql.org/docs/current/protocol-logicalrep-message-formats.html>
//! - `src/include/replication/logicalproto.h`, `src/backend/replication/logical/proto.c`

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
pub struct PgStr(pub(super) Bytes);

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

/// The documented name of the message with `tag`, for errors and logs.
pub(super) const fn message_name(tag: u8) -> &'static str {
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
