-- The message outbox: an event written to the WAL only, as a transactional logical
-- decoding message, never as a row. It commits or rolls back with the caller's
-- transaction and is decoded in commit order like a row, but costs no heap tuple of
-- the outbox, no index entry, no vacuum and no retention
-- (docs/architecture.md#the-message-outbox).
--
--   SELECT outbox_emit('order', '42', 'order_created', '{"total": 10}');
--   SELECT outbox_emit('order', '42', 'order_paid', '{}', '{"traceparent": "00-…"}', 'pay-42');
--
-- Returns the idempotency key: the one given, else a new UUID. Unlike
-- outbox_enqueue, a key given twice is not refused (there is no table to hold it).
--
-- The message content is a frame the relay reads without copying (see
-- src/outbox/message.rs): a version byte (1), a payload-format byte ('j' json),
-- then eight fields, each a big-endian int4 byte length (-1 = NULL) and UTF-8 bytes:
-- idempotency key, aggregate type, aggregate id, event type, topic, headers (JSON
-- object), payload, created_at (UTC, 'YYYY-MM-DD HH24:MI:SS.US+00'). The prefix names
-- the outbox, so that a relay serving several outboxes routes it.
--
-- outbox_relay_message_ledger counts the events emitted per outbox and entity,
-- in the same transaction: `audit` proves lost = 0 against it, as the table does for
-- rows. One row per entity, updated in place (HOT), never an event's worth of data.
-- Its updates are WAL the walsender decodes too; a writer that prefers the cheapest
-- path to proof sets outbox_relay.message_ledger = 'off' (per session or role) and
-- gives up auditing those events.
CREATE TABLE IF NOT EXISTS {{schema}}.outbox_relay_message_ledger (
    outbox         text   NOT NULL,
    aggregate_id   text   NOT NULL,
    aggregate_type text   NOT NULL,
    -- The topic given to outbox_emit, '' when the topic template decides.
    topic          text   NOT NULL,
    events         bigint NOT NULL,
    CONSTRAINT outbox_relay_message_ledger_pkey
        PRIMARY KEY (outbox, aggregate_id, aggregate_type, topic)
);

CREATE OR REPLACE FUNCTION {{schema}}.outbox_relay_frame(value text) RETURNS bytea
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN value IS NULL THEN '\xffffffff'::bytea
                ELSE int4send(octet_length(convert_to(value, 'UTF8'))) || convert_to(value, 'UTF8')
           END
$$;

CREATE OR REPLACE FUNCTION {{schema}}.outbox_emit(
    aggregate_type  text,
    aggregate_id    text,
    event_type      text,
    payload         jsonb,
    headers         jsonb DEFAULT NULL,
    idempotency_key text  DEFAULT NULL,
    topic           text  DEFAULT NULL) RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    key text := COALESCE(idempotency_key, gen_random_uuid()::text);
BEGIN
    PERFORM pg_logical_emit_message(true, {{message_prefix_literal}},
        '\x016a'::bytea
        || {{schema}}.outbox_relay_frame(key)
        || {{schema}}.outbox_relay_frame(aggregate_type)
        || {{schema}}.outbox_relay_frame(aggregate_id)
        || {{schema}}.outbox_relay_frame(event_type)
        || {{schema}}.outbox_relay_frame(topic)
        || {{schema}}.outbox_relay_frame(headers::text)
        || {{schema}}.outbox_relay_frame(payload::text)
        || {{schema}}.outbox_relay_frame(
               to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US') || '+00'));
    IF current_setting('outbox_relay.message_ledger', true) IS DISTINCT FROM 'off' THEN
        INSERT INTO {{schema}}.outbox_relay_message_ledger AS l
            (outbox, aggregate_id, aggregate_type, topic, events)
        VALUES ({{outbox_name_literal}}, COALESCE(aggregate_id, ''),
                COALESCE(aggregate_type, ''), COALESCE(topic, ''), 1)
        ON CONFLICT ON CONSTRAINT outbox_relay_message_ledger_pkey
        DO UPDATE SET events = l.events + 1;
    END IF;
    RETURN key;
END
$$;
