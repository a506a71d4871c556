-- The outbox table, partitioned by created_at range (outbox.partitioned = true).
-- Used instead of 0001_outbox.sql for very high volume: `outbox-relay retention`
-- drops whole partitions once the relay confirmed every row in them, which costs
-- no DELETE, no dead tuples and no vacuum. The publication is created with
-- publish_via_partition_root = true (0003), so pgoutput describes every insert as
-- an insert into this root table and the relay's mapper needs no change.
--
-- A unique constraint of a partitioned table must contain the partition key, so
-- the primary key is (id, created_at) and idempotency keys are unique per
-- (idempotency_key, created_at): generated keys (UUID v7) are unique anyway; a key
-- given by the writer is only checked within the same created_at.
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
    {{col_id}}              uuid        NOT NULL DEFAULT {{schema}}.outbox_relay_uuid_v7(),
    {{col_idempotency_key}} text        NOT NULL DEFAULT {{schema}}.outbox_relay_uuid_v7()::text,
    {{col_aggregate_type}}  text        NOT NULL,
    -- Nullable on purpose: a row without an entity id cannot be keyed, and the relay
    -- moves it to the poison table instead of failing the whole stream.
    {{col_aggregate_id}}    text,
    {{col_event_type}}      text        NOT NULL,
    {{col_topic}}           text,
    {{col_headers}}         jsonb,
    {{col_payload}}         jsonb       NOT NULL,
    {{col_created_at}}      timestamptz NOT NULL DEFAULT clock_timestamp(),
    sent_at                 timestamptz,
    attempts                integer     NOT NULL DEFAULT 0,
    last_error              text,
    PRIMARY KEY ({{col_id}}, {{col_created_at}}),
    UNIQUE ({{col_idempotency_key}}, {{col_created_at}})
) PARTITION BY RANGE ({{col_created_at}});

CREATE INDEX IF NOT EXISTS {{outbox_unsent_idx}}
    ON {{outbox_table}} ({{col_created_at}}, {{col_id}})
    WHERE sent_at IS NULL;

-- Creates the partition holding now() and `ahead` more, named
-- <table>_pYYYYMMDDtHHMI after their UTC lower bound; existing ones are kept.
-- Returns how many it created. Called here and by every `outbox-relay retention`
-- cycle: an insert whose created_at falls in no partition fails.
CREATE OR REPLACE FUNCTION {{schema}}.outbox_relay_ensure_partitions(
    root regclass, step text, ahead integer) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    lower_utc timestamp := date_trunc(step, clock_timestamp() AT TIME ZONE 'UTC');
    upper_utc timestamp;
    nsp       text;
    rel       text;
    part      text;
    created   integer := 0;
BEGIN
    IF step NOT IN ('hour', 'day', 'week', 'month') THEN
        RAISE EXCEPTION 'partition step must be hour, day, week or month, not %', step;
    END IF;
    SELECT n.nspname, c.relname INTO nsp, rel
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid = root;
    FOR i IN 0..ahead LOOP
        upper_utc := lower_utc + ('1 ' || step)::interval;
        part := left(rel, 45) || '_p' || to_char(lower_utc, 'YYYYMMDD"t"HH24MI');
        IF to_regclass(format('%I.%I', nsp, part)) IS NULL THEN
            EXECUTE format('CREATE TABLE %I.%I PARTITION OF %s FOR VALUES FROM (%L) TO (%L)',
                           nsp, part, root,
                           lower_utc AT TIME ZONE 'UTC', upper_utc AT TIME ZONE 'UTC');
            created := created + 1;
        END IF;
        lower_utc := upper_utc;
    END LOOP;
    RETURN created;
END
$$;

SELECT {{schema}}.outbox_relay_ensure_partitions(
    {{outbox_table_literal}}::regclass, {{partition_interval_literal}}, {{partitions_ahead}});
