-- Progress of a cutover from a polling relay, one row per replication slot.
--
-- A cutover creates the slot with an exported snapshot, publishes the rows the
-- poller had not sent as of that snapshot, and only then streams from the slot.
-- The slot therefore exists before the backlog is published, so its existence alone
-- does not say the cutover finished: this row does. `run` streams from a slot only
-- when it has no row here (created without a cutover) or a row with completed_at set;
-- a row without completed_at means the cutover was interrupted: the slot (which was
-- never streamed from) is dropped and the cutover starts over, re-sending only what
-- was published but not yet marked sent.
CREATE TABLE IF NOT EXISTS {{schema}}.outbox_relay_cutover (
    slot_name        text        PRIMARY KEY,
    started_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- The slot's consistent point: backlog rows committed before it, the stream after.
    consistent_point pg_lsn,
    published        bigint      NOT NULL DEFAULT 0,
    poisoned         bigint      NOT NULL DEFAULT 0,
    completed_at     timestamptz
);
