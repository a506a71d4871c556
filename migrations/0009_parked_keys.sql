-- relay.on_poison = "park-key": the later events of a poisoned event's entity are
-- held back, durably, until `outbox-relay replay` delivers the poisoned one.
--
-- Why durable and in the poison table. The relay must confirm the slot past a
-- parked event (or WAL piles up while the key waits for an operator), so the event
-- has to live somewhere else first: it is written to the poison table like a
-- poisoned one, with parked = true, in a transaction that checks the key is still
-- parked. The key itself is a row of outbox_relay_parked_key, inserted in the same
-- transaction as the poisoned event that parks it. `replay` delivers the poisoned
-- row, then the parked rows of its key in their original order (commit LSN, then
-- tx_position, the row's place among its transaction's outbox rows), and releases
-- the key by setting released_at while it holds the key's row lock: a relay that
-- parks an event takes the same row FOR SHARE, so an event is either parked before
-- the release (and `replay` sends it too) or sees the key released (and the relay
-- produces it itself).
--
-- A key is (topic, record_key): per-key order is what Kafka keeps per partition,
-- and the record key's partition depends on the topic.

ALTER TABLE {{poison_table}}
    -- A deliverable event held back behind a poisoned event of its key.
    ADD COLUMN IF NOT EXISTS parked      boolean NOT NULL DEFAULT false,
    -- A poisoned event that parked its key (written while relay.on_poison = "park-key").
    ADD COLUMN IF NOT EXISTS holds_key   boolean NOT NULL DEFAULT false,
    -- The row's place among its transaction's outbox rows (from 0), for the order
    -- within one commit; NULL outside the replication stream.
    ADD COLUMN IF NOT EXISTS tx_position integer;

-- What `replay` and the relay ask of a key: its unreplayed rows, in order.
CREATE INDEX IF NOT EXISTS {{poison_key_order_idx}}
    ON {{poison_table}} (topic, aggregate_id, lsn, tx_position, poison_id)
    WHERE replayed_at IS NULL AND (parked OR holds_key);

CREATE TABLE IF NOT EXISTS {{schema}}.outbox_relay_parked_key (
    topic        text        NOT NULL,
    record_key   text        NOT NULL,
    -- The poisoned row that parked the key (the first one, when several did).
    poison_id    bigint,
    parked_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- Set by `replay` once every row of the key was delivered; a later poisoned
    -- event of the key parks it again (released_at back to NULL).
    released_at  timestamptz,
    PRIMARY KEY (topic, record_key)
);
