-- The publication the relay's slot decodes: inserts into the outbox only. Deletes
-- (retention) and updates (the poller's sent_at) are not published, so they can
-- never turn into events. It must exist before the slot is created. A partitioned
-- outbox adds publish_via_partition_root = true: inserts are then published as
-- inserts into the root table, under its name, whatever partition they land in.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = {{publication_literal}}) THEN
        CREATE PUBLICATION {{publication}} FOR TABLE {{outbox_table}} WITH ({{publication_options}});
    END IF;
END
$$;
