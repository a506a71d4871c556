-- Fresher checkpoints for the relay position (see docs/architecture.md, "Healing a
-- lost slot"), so a resync sends again only what was delivered shortly before the
-- last save, and a checkpoint survives a failover when it lies before the fork.
--
-- 0007 kept one candidate checkpoint: each save took one at the WAL head and
-- promoted the previous one once the confirmed position passed it, so while the
-- relay lagged, delivered_xmin trailed by about twice the lag. A save now takes a
-- candidate every time and keeps up to 16 not yet passed (the newest is replaced
-- when full), in two parallel arrays ordered by LSN; a save promotes the newest one
-- the confirmed position has passed, so delivered_xmin trails by about the lag.
--
-- delivered_lsn is the WAL position of the promoted checkpoint: after a promotion
-- to a new timeline, delivered_xmin still holds when delivered_lsn is at or before
-- the point where the new timeline forked off the old one (the transactions below
-- it are the same on both).
ALTER TABLE {{schema}}.outbox_relay_position
    ADD COLUMN IF NOT EXISTS delivered_lsn   pg_lsn,
    ADD COLUMN IF NOT EXISTS candidate_lsns  pg_lsn[] NOT NULL DEFAULT '{}',
    ADD COLUMN IF NOT EXISTS candidate_xmins xid8[]   NOT NULL DEFAULT '{}';

-- The single candidate of 0007 becomes the first of the list.
UPDATE {{schema}}.outbox_relay_position
   SET candidate_lsns = ARRAY[candidate_lsn], candidate_xmins = ARRAY[candidate_xmin],
       candidate_lsn = NULL, candidate_xmin = NULL
 WHERE candidate_lsn IS NOT NULL AND candidate_xmin IS NOT NULL
   AND cardinality(candidate_lsns) = 0;
