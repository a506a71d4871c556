-- A poison table that always accepts: de-duplication by event occurrence through a
-- unique index, and columns for content that jsonb or a size limit refuses.
--
-- Why. Until now a writer skipped its insert when a row with the same idempotency
-- key and commit LSN existed (WHERE NOT EXISTS … IS NOT DISTINCT FROM …). That
-- cannot use an index, so every insert scanned the table (quadratic under mass
-- poisoning), and two different rows of one transaction with the same or no
-- idempotency key collapsed into one while the slot confirmed past both. And an
-- insert whose content failed a cast (a \u0000 in a json headers column, which
-- jsonb refuses) or exceeded jsonb's size limits failed forever, holding the slot.
--
-- What identifies an occurrence of an event is the outbox row and the commit that
-- inserted it: (outbox_id, lsn). lsn is NULL outside the replication stream (rows
-- written by the poller or a cutover) and compares as 0/0, which no commit has.
-- outbox_id is NULL when the outbox has no id column or the row's id was NULL; then
-- the row's content stands in for it (row_sha256, the hash of every column), and
-- (outbox_id IS NULL) keeps an id from ever meeting a hash. The expressions treat
-- NULLs as equal on every supported server (NULLS NOT DISTINCT needs 15+). Writers
-- insert with ON CONFLICT DO NOTHING and cut identifiers to 2048 bytes, so a key
-- always fits a btree entry (2704 bytes at most).

-- Casts that cannot fail: NULL instead of an error, so the writer stores the text.
-- (pg_input_is_valid would do without a subtransaction, but needs PostgreSQL 16.)
CREATE OR REPLACE FUNCTION {{schema}}.outbox_relay_try_jsonb(value text)
RETURNS jsonb LANGUAGE plpgsql STABLE STRICT AS $$
BEGIN
    RETURN value::jsonb;
EXCEPTION WHEN OTHERS THEN
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION {{schema}}.outbox_relay_try_timestamptz(value text)
RETURNS timestamptz LANGUAGE plpgsql STABLE STRICT AS $$
BEGIN
    RETURN value::timestamptz;
EXCEPTION WHEN OTHERS THEN
    RETURN NULL;
END
$$;

ALTER TABLE {{poison_table}}
    -- The headers as received when they are not storable as jsonb (not JSON, a
    -- \u0000, or cut to the copy limit); headers is NULL then.
    ADD COLUMN IF NOT EXISTS headers_text  text,
    -- row_data as JSON text when it is not storable as jsonb (over the copy limit:
    -- its first bytes only; or refused by jsonb); row_data is NULL then.
    ADD COLUMN IF NOT EXISTS row_data_text text,
    -- Size in bytes and sha256 (hex) of the complete row_data text, every column of
    -- the original row; NULL for rows written before this migration.
    ADD COLUMN IF NOT EXISTS row_bytes     bigint,
    ADD COLUMN IF NOT EXISTS row_sha256    text,
    -- Some value was longer than the copy limit (relay.poison_copy_limit_bytes) and
    -- only its first bytes are stored (or held a NUL byte, which text cannot). The
    -- original row stays in the outbox; `replay` reads it from there by outbox_id.
    ADD COLUMN IF NOT EXISTS truncated     boolean NOT NULL DEFAULT false,
    -- Set by this migration only: the poison_id of an earlier row recorded for the
    -- same occurrence, before occurrences were de-duplicated.
    ADD COLUMN IF NOT EXISTS duplicate_of  bigint;

ALTER TABLE {{poison_table}} ALTER COLUMN row_data DROP NOT NULL;

-- Rows recorded before this migration may already repeat an occurrence (the old
-- check raced between concurrent writers, and keyed on the idempotency key). None is
-- removed or changed: each repeat after the first gets duplicate_of, and the unique
-- index covers only rows without it. Rows that cannot be identified (no outbox_id
-- and no row_sha256, both from before this migration) have a NULL key and never
-- conflict; an old outbox_id longer than a btree entry can hold stays outside the
-- index too.
UPDATE {{poison_table}} AS p
SET duplicate_of = d.first
FROM (
    SELECT poison_id,
           min(poison_id) OVER (PARTITION BY outbox_id, COALESCE(lsn, '0/0'::pg_lsn)) AS first
    FROM {{poison_table}}
    WHERE outbox_id IS NOT NULL AND octet_length(outbox_id) <= 2048
) AS d
WHERE p.poison_id = d.poison_id AND d.first <> d.poison_id AND p.duplicate_of IS NULL;

CREATE UNIQUE INDEX IF NOT EXISTS {{poison_occurrence_key}} ON {{poison_table}} (
    (outbox_id IS NULL),
    (COALESCE(outbox_id, row_sha256)),
    (COALESCE(lsn, '0/0'::pg_lsn))
) WHERE duplicate_of IS NULL AND (outbox_id IS NULL OR octet_length(outbox_id) <= 2048);
