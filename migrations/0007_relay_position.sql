-- The CDC relay's own record of what it has delivered, one row per replication
-- slot (see docs/architecture.md, "Relay-owned progress").
--
-- A slot's confirmed_flush_lsn is not enough: before PostgreSQL 17 it is saved to
-- disk only at checkpoints, so after a restart or crash the slot rewinds and the
-- server re-sends everything after the last checkpoint; and a slot that is dropped
-- or invalidated takes its position with it. The relay writes this row before it
-- tells the server anything (a status update never confirms past confirmed_lsn), so
-- it is always at or ahead of the slot's own position, and it survives the slot.
--
-- system_identifier and timeline say which server history confirmed_lsn belongs to:
-- after a failover to another timeline or cluster the position is not comparable
-- and the relay starts from the new server's slot instead.
--
-- delivered_xmin ties the position to rows: every outbox row inserted by a
-- transaction whose xid is below it was delivered or poisoned (the checkpoint rule
-- of the retention module). The relay promotes candidate_xmin to it once
-- confirmed_lsn reaches candidate_lsn. When the slot is lost, the rows to publish
-- again are exactly those at or above delivered_xmin that were committed before
-- the new slot's consistent point.
--
-- slot_lost_at is set while a lost slot is being healed, and cleared when the
-- resync finished; a relay that crashes in between starts the resync over.
CREATE TABLE IF NOT EXISTS {{schema}}.outbox_relay_position (
    slot_name         text        PRIMARY KEY,
    system_identifier text        NOT NULL,
    timeline          integer     NOT NULL,
    confirmed_lsn     pg_lsn      NOT NULL,
    delivered_xmin    xid8,
    candidate_lsn     pg_lsn,
    candidate_xmin    xid8,
    slot_lost_at      timestamptz,
    slot_lost_reason  text,
    resyncs           bigint      NOT NULL DEFAULT 0,
    updated_at        timestamptz NOT NULL DEFAULT clock_timestamp()
);
