-- Rows that could never be delivered (too large, no key, topic refused, ...) land
-- here with the error, how often it was tried and where in the WAL it was. They are
-- never deleted: `outbox-relay replay` re-publishes them with their original
-- idempotency key and records replayed_at / replay_count.
CREATE TABLE IF NOT EXISTS {{poison_table}} (
    poison_id        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- The outbox row as it was (text forms, so a row of unexpected types still fits).
    outbox_id        text,
    idempotency_key  text,
    aggregate_type   text,
    aggregate_id     text,
    event_type       text,
    topic            text,
    headers          jsonb,
    payload          text,
    created_at       timestamptz,
    -- Every column of the original row by name, for rows that could not be mapped.
    row_data         jsonb       NOT NULL DEFAULT '{}'::jsonb,
    error            text        NOT NULL,
    error_kind       text        NOT NULL,
    attempts         integer     NOT NULL,
    lsn              pg_lsn,
    failed_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    replayed_at      timestamptz,
    replay_count     integer     NOT NULL DEFAULT 0
);

-- A poison row is evidence: an event that was not delivered. Refuse to lose it.
CREATE OR REPLACE FUNCTION {{schema}}.outbox_relay_refuse_poison_delete() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'rows of % are never deleted: replay them with outbox-relay replay', TG_TABLE_NAME
        USING ERRCODE = 'insufficient_privilege';
END
$$;

DROP TRIGGER IF EXISTS outbox_relay_refuse_delete ON {{poison_table}};
CREATE TRIGGER outbox_relay_refuse_delete
    BEFORE DELETE ON {{poison_table}}
    FOR EACH ROW EXECUTE FUNCTION {{schema}}.outbox_relay_refuse_poison_delete();

DROP TRIGGER IF EXISTS outbox_relay_refuse_truncate ON {{poison_table}};
CREATE TRIGGER outbox_relay_refuse_truncate
    BEFORE TRUNCATE ON {{poison_table}}
    FOR EACH STATEMENT EXECUTE FUNCTION {{schema}}.outbox_relay_refuse_poison_delete();

CREATE INDEX IF NOT EXISTS {{poison_key_idx}} ON {{poison_table}} (idempotency_key);
