-- The least privilege `outbox-relay run` (and `status`, `replay`, `audit`) needs.
-- Run it as the owner of the outbox tables, after `outbox-relay migrate` (which
-- needs the owner's rights: it creates the tables, the trigger and the publication).
-- Rename outbox_relay_app, and adjust the table names if [outbox] in the config
-- differs from the defaults. Set a password (SCRAM) with \password in psql.
--
-- What the relay does with each right:
--   LOGIN REPLICATION      the replication connection: CREATE_REPLICATION_SLOT and
--                          START_REPLICATION; and the heartbeat's
--                          pg_logical_emit_message (no table needed).
--
--   REPLICATION is a powerful right, and no GRANT or REVOKE narrows it: it lets the
--   role stream all WAL changes, of every table in every database it can connect to,
--   through logical slots it creates (with any output plugin, no publication
--   needed), and open physical replication connections that stream or copy the
--   whole cluster's WAL (pg_basebackup). It is read access to every change of every
--   table. Protect the password like a superuser's: set a SCRAM password, connect
--   with sslmode=verify-full (the relay warns when the password could be sent in
--   clear), and restrict pg_hba.conf to the relay's hosts, its one database, hostssl
--   and scram-sha-256, with no line for the `replication` keyword (that keyword
--   matches physical replication only; the relay's logical replication connection
--   matches the database's lines), e.g.
--     hostssl  app  outbox_relay_app  10.0.4.17/32  scram-sha-256
--
--   SELECT on the outbox   prerequisite checks; `status` and `audit` counts.
--   SELECT, INSERT on poison_outbox
--                          write poison rows (INSERT … ON CONFLICT DO NOTHING, once
--                          per occurrence); `status`, `audit` and `replay` read them.
--                          The insert calls outbox_relay_try_jsonb and
--                          outbox_relay_try_timestamptz, which PUBLIC may execute.
--   UPDATE (replayed_at, replay_count) on poison_outbox
--                          `replay` marks what it re-published; nothing else can
--                          change (and DELETE is refused by a trigger anyway).
--   SELECT, INSERT, UPDATE on outbox_relay_cutover
--                          `run` records each slot it creates there (with
--                          relay.cutover = "auto", the default) and when the
--                          cutover completed.
--   SELECT, INSERT, UPDATE on outbox_relay_position
--                          `run` saves there how far it has delivered (before it
--                          confirms it to the server) and heals a lost slot from it.
--   SELECT, INSERT, UPDATE on outbox_relay_parked_key
--                          `run` loads the parked keys at start; with
--                          relay.on_poison = "park-key" it parks keys there
--                          (`replay` releases them).
-- Nothing else: no DELETE or UPDATE on the outbox, no superuser, no CREATE.
-- Cutting over from a poller with a backlog also marks the rows it publishes, as
-- the poller does: for that one start, also grant
--   GRANT UPDATE (sent_at, attempts, last_error) ON public.outbox TO outbox_relay_app;
-- (or run `outbox-relay cutover` once as the owner), then revoke it. A resync after
-- a lost slot (relay.on_slot_loss = "resync") marks the rows it publishes the same
-- way, so it needs that grant too; without it the relay stops with exit code 3 and
-- says so, and the resync runs on the next start once granted.
CREATE ROLE outbox_relay_app LOGIN REPLICATION;
GRANT USAGE ON SCHEMA public TO outbox_relay_app;
GRANT SELECT ON public.outbox TO outbox_relay_app;
GRANT SELECT, INSERT ON public.poison_outbox TO outbox_relay_app;
GRANT UPDATE (replayed_at, replay_count) ON public.poison_outbox TO outbox_relay_app;
GRANT SELECT, INSERT, UPDATE ON public.outbox_relay_cutover TO outbox_relay_app;
GRANT SELECT, INSERT, UPDATE ON public.outbox_relay_position TO outbox_relay_app;
GRANT SELECT, INSERT, UPDATE ON public.outbox_relay_parked_key TO outbox_relay_app;
-- Decoding on a standby (postgres.slot_url): creating the slot there waits for a
-- running-transactions record, which the relay asks the primary for at once with
-- pg_log_standby_snapshot() (superusers only by default). Without this grant the
-- creation waits for the primary's own record (every 15 s while it writes).
-- GRANT EXECUTE ON FUNCTION pg_log_standby_snapshot() TO outbox_relay_app;
