-- Which relay wrote a poison row: the outbox table the row came from and the slot
-- whose stream it was read from.
--
-- Why. outbox.poison_table defaults to public.poison_outbox whatever the outbox, so
-- two relays (each with its own outbox table and slot) can share one poison table.
-- Their rows were told apart by (outbox_id, lsn) alone, and the relay recognises
-- an event it poisoned before a crash by (commit LSN, ordinal, outbox_id). With ids
-- that run in lockstep (two bigint sequences, one row of each table per
-- transaction) the other relay's event has the same three: its poison insert was
-- taken for a repeat (ON CONFLICT DO NOTHING: no row, event resolved), and after a
-- restart a deliverable event was skipped as "already poisoned". Both are silent
-- losses. Now every writer records its source, the occurrence key includes the
-- outbox table, and a relay only recognises the rows of its own outbox and slot
-- (src/poison/recorded.rs).
--
-- source_table is the outbox as schema.table (unquoted), source_slot the relay's
-- slot (NULL for rows the poller wrote). The slot is not part of the occurrence: an
-- outbox row committed once is one event whichever slot reads it (shards read
-- different rows). Rows written before this migration keep NULL in both: they
-- match no relay (at worst an event poisoned just before the upgrade is produced
-- again, a duplicate, never a loss), and compare as '' in the key, as before.
--
-- Idempotent, for every outbox that shares the table: the columns and the index
-- are created once. The unique index of 0008 is replaced by one under the same
-- name (the old one is found by its definition, so an index an earlier version
-- named otherwise goes too); 0008 applied afterwards for another outbox then finds
-- the name taken and creates nothing. That later 0008 does label rows of different
-- sources with the same (outbox_id, lsn) as duplicate_of, so this migration, which
-- runs right after it, labels the rows that have a source again by the new key:
-- the first row of an occurrence has none, a later one (only possible if one was
-- written between the two migrations) points to the first.

ALTER TABLE {{poison_table}}
    ADD COLUMN IF NOT EXISTS source_table text,
    ADD COLUMN IF NOT EXISTS source_slot  text;

UPDATE {{poison_table}} AS p
SET duplicate_of = d.first
FROM (
    SELECT poison_id,
           NULLIF(min(poison_id) OVER (PARTITION BY outbox_id IS NULL,
                                                    COALESCE(outbox_id, row_sha256),
                                                    COALESCE(lsn, '0/0'::pg_lsn),
                                                    source_table),
                  poison_id) AS first
    FROM {{poison_table}}
    WHERE source_table IS NOT NULL AND COALESCE(outbox_id, row_sha256) IS NOT NULL
      AND (outbox_id IS NULL OR octet_length(outbox_id) <= 2048)
) AS d
WHERE p.poison_id = d.poison_id AND p.duplicate_of IS DISTINCT FROM d.first;

DO $$
DECLARE
    old regclass;
BEGIN
    FOR old IN
        SELECT i.indexrelid::regclass FROM pg_index i
         WHERE i.indrelid = to_regclass({{poison_table_literal}}) AND i.indisunique
           AND pg_get_indexdef(i.indexrelid) LIKE '%row_sha256%'
           AND pg_get_indexdef(i.indexrelid) NOT LIKE '%source_table%'
    LOOP
        EXECUTE format('DROP INDEX %s', old);
    END LOOP;
END
$$;

CREATE UNIQUE INDEX IF NOT EXISTS {{poison_occurrence_key}} ON {{poison_table}} (
    (outbox_id IS NULL),
    (COALESCE(outbox_id, row_sha256)),
    (COALESCE(lsn, '0/0'::pg_lsn)),
    (COALESCE(source_table, ''))
) WHERE duplicate_of IS NULL AND (outbox_id IS NULL OR octet_length(outbox_id) <= 2048);
