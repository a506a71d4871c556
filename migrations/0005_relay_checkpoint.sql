-- Checkpoints tie a WAL position to a transaction horizon, so that "the relay
-- confirmed this row" can be decided from the row's xmin alone (see the retention
-- module of outbox-relay). A checkpoint (wal_lsn, snapshot_xmin) is taken in one
-- statement: every transaction with an xid below snapshot_xmin had ended, so its
-- commit record lies before wal_lsn. Once the slot's confirmed_flush_lsn reaches
-- wal_lsn, every outbox row inserted by such a transaction was delivered (or
-- poisoned). Written and pruned by `outbox-relay retention`, read by
-- `outbox-relay poll --after-cdc`. (The column is not called xmin: that name is
-- taken by the system column.)
CREATE TABLE IF NOT EXISTS {{schema}}.outbox_relay_checkpoint (
    slot          text        NOT NULL,
    wal_lsn       pg_lsn      NOT NULL,
    snapshot_xmin xid8        NOT NULL,
    taken_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- The slot's confirmed_flush_lsn when the checkpoint was taken: if the slot is
    -- dropped later, the newest of these still tells what the relay had confirmed.
    slot_confirmed_lsn pg_lsn,
    PRIMARY KEY (slot, wal_lsn)
);
