-- Writer helper: one call inserts an event into the outbox inside the caller's
-- transaction, so the business change and its event commit or roll back together.
--
--   SELECT outbox_enqueue('order', '42', 'order_created', '{"total": 10}');
--   SELECT outbox_enqueue('order', '42', 'order_paid', '{}', '{"trace_id": "t1"}', 'pay-42');
--
-- Returns the idempotency key: the one given, else a new UUID v7 (time ordered, see
-- outbox_relay_uuid_v7 in 0001). A given key that already exists fails with
-- unique_violation (23505): the event was enqueued before.
CREATE OR REPLACE FUNCTION {{schema}}.outbox_enqueue(
    aggregate_type  text,
    aggregate_id    text,
    event_type      text,
    payload         jsonb,
    headers         jsonb DEFAULT NULL,
    idempotency_key text  DEFAULT NULL) RETURNS text
LANGUAGE sql VOLATILE AS $$
    INSERT INTO {{outbox_table}} AS o
        ({{col_aggregate_type}}, {{col_aggregate_id}}, {{col_event_type}},
         {{col_payload}}, {{col_headers}}, {{col_idempotency_key}})
    VALUES ($1, $2, $3, $4, $5, COALESCE($6, {{schema}}.outbox_relay_uuid_v7()::text))
    RETURNING o.{{col_idempotency_key}}
$$;
