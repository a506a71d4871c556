-- The outbox table. Applications insert one row per event in the same transaction
-- as their business change; the CDC relay reads the inserts from the WAL, the
-- polling relay reads rows with sent_at IS NULL.
--
-- Double-brace placeholders are filled from the config by `outbox-relay migrate`, so
-- the table and column names follow [outbox] in the config file.

-- UUID version 7 (RFC 9562): 48-bit Unix milliseconds, then random bits. Time
-- ordered, so ids and idempotency keys index well. PostgreSQL 18 has uuidv7();
-- this works on 13+.
CREATE OR REPLACE FUNCTION {{schema}}.outbox_relay_uuid_v7() RETURNS uuid
LANGUAGE sql VOLATILE AS $$
  SELECT encode(
    set_bit(set_bit(
      overlay(uuid_send(gen_random_uuid())
              placing substring(int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
              FROM 1 FOR 6),
      52, 1), 53, 1),
    'hex')::uuid
$$;

CREATE TABLE IF NOT EXISTS {{outbox_table}} (
    {{col_id}}              uuid        PRIMARY KEY DEFAULT {{schema}}.outbox_relay_uuid_v7(),
    {{col_idempotency_key}} text        NOT NULL UNIQUE DEFAULT {{schema}}.outbox_relay_uuid_v7()::text,
    {{col_aggregate_type}}  text        NOT NULL,
    -- Nullable on purpose: a row without an entity id cannot be keyed, and the relay
    -- moves it to the poison table instead of failing the whole stream.
    {{col_aggregate_id}}    text,
    {{col_event_type}}      text        NOT NULL,
    -- Optional per-row topic; when NULL the topic comes from kafka.topic_template.
    {{col_topic}}           text,
    {{col_headers}}         jsonb,
    {{col_payload}}         jsonb       NOT NULL,
    {{col_created_at}}      timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- Used by the polling relay only; the CDC relay never updates rows.
    sent_at                 timestamptz,
    attempts                integer     NOT NULL DEFAULT 0,
    last_error              text
);

-- What the poller scans: unsent rows in (created_at, id) order. Partial, so it
-- stays small however large the table grows.
CREATE INDEX IF NOT EXISTS {{outbox_unsent_idx}}
    ON {{outbox_table}} ({{col_created_at}}, {{col_id}})
    WHERE sent_at IS NULL;
