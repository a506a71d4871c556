#!/usr/bin/env bash
# Regenerates the seed corpora in fuzz/corpus/ from real pgoutput messages.
#
# Needs a PostgreSQL (13+, wal_level=logical) reachable as a superuser, psql,
# python3, and the relay binary (`cargo build` in the main crate) for `migrate`.
#
#   fuzz/make-seeds.sh [BASE_URL] [RELAY_BINARY]
#     BASE_URL      default postgresql://postgres@127.0.0.1:54320 (no database part)
#     RELAY_BINARY  default <repo>/target/debug/outbox-relay
#
# It creates the database `fuzz_seed` and the slots `fuzz_seed` (outbox
# publication) and `fuzz_seed_all` (a FOR ALL TABLES publication, for Update,
# Delete, Truncate, Type, Message and streamed-transaction messages), writes some
# varied rows, peeks the changes with pg_logical_slot_peek_binary_changes, writes
# the corpus files and drops the slots and the database again (also on failure).
# Existing files in fuzz/corpus/<target>/ with the seed prefixes are replaced; files
# the fuzzer added are left alone.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
base="${1:-postgresql://postgres@127.0.0.1:54320}"
relay="${2:-$here/../target/debug/outbox-relay}"
db=fuzz_seed
work="$(mktemp -d)"

psql_admin() { psql -X -q -v ON_ERROR_STOP=1 "$base/postgres" "$@"; }
psql_db() { psql -X -q -v ON_ERROR_STOP=1 "$base/$db" "$@"; }

cleanup() {
    psql_admin -c "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name IN ('fuzz_seed', 'fuzz_seed_all')" >/dev/null || true
    psql_admin -c "DROP DATABASE IF EXISTS $db" >/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

[ -x "$relay" ] || { echo "no relay binary at $relay: run cargo build first" >&2; exit 1; }
cleanup
work="$(mktemp -d)"
psql_admin -c "CREATE DATABASE $db"

cat >"$work/relay.toml" <<EOF
[postgres]
url = "$base/$db"
[kafka]
brokers = "127.0.0.1:1"
EOF
"$relay" migrate --config "$work/relay.toml" 2>/dev/null

psql_db >/dev/null <<'SQL'
SELECT pg_create_logical_replication_slot('fuzz_seed', 'pgoutput');
CREATE TYPE fuzz_mood AS ENUM ('sad', 'ok', 'happy');
CREATE TABLE fuzz_other (id int PRIMARY KEY, t text, b bytea, n numeric, m fuzz_mood);
CREATE TABLE fuzz_full (k text, v int);
ALTER TABLE fuzz_full REPLICA IDENTITY FULL;
CREATE PUBLICATION fuzz_seed_all FOR ALL TABLES;
SELECT pg_create_logical_replication_slot('fuzz_seed_all', 'pgoutput');

-- 1: a plain event with defaults
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
VALUES ('order', 'order-1', 'OrderCreated', '{"id": 1, "total": 12.50, "items": [1, 2]}');
-- 2: NULL key (poison), headers object, explicit topic
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, topic, headers, payload)
VALUES ('order', NULL, 'OrderCreated', 'orders.v2', '{"trace-id": "abc123", "n": 7, "nested": {"a": [true, null]}}', '{"k": null}');
-- 3: unicode everywhere, explicit idempotency key
INSERT INTO outbox (idempotency_key, aggregate_type, aggregate_id, event_type, headers, payload)
VALUES ('ключ-💡-1', 'Bestellung', 'Kunde-Ä/ø/日本', 'Überweisung', '{"grüße": "😀 tab\t quote\" backslash\\"}', '{"text": "héllo wörld — ∑ 😀", "emoji": "\ud83d\ude00"}');
-- 4: big payload (~26 KB jsonb, TOASTed on disk, sent in full)
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
SELECT 'blob', 'blob-1', 'BigThing', jsonb_build_object('data', repeat('x0123456789abcdef', 1500), 'arr', (SELECT jsonb_agg(g) FROM generate_series(1, 200) g));
-- 5: one transaction of edge rows: empty key, headers array, illegal topic,
--    infinite / BC / year-20000 timestamps, a reserved header name
BEGIN;
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('user', '', 'Empty', '[]');
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, headers, payload) VALUES ('user', 'u-2', 'HdrArray', '[1, 2]', '"just a string"');
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, topic, payload) VALUES ('user', 'u-3', 'BadTopic', 'not a/valid topic!', '0');
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at) VALUES ('user', 'u-4', 'Infinite', '{}', 'infinity');
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at) VALUES ('user', 'u-5', 'Ancient', '{}', '0044-03-15 12:00:00 BC');
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at) VALUES ('user', 'u-6', 'Future', '{}', '20000-01-01 00:00:00.123456+00');
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, headers, payload) VALUES ('a{b}', 'u-7', 'Reserved', '{"idempotency_key": "x"}', '{"n": 1e400}');
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at) VALUES ('user.with-dots_ok', 'u-8', 'Pre1970', '{"t": 1}', '1969-07-20 20:17:40.5-05');
COMMIT;
-- 6: the template renders a topic longer than 249 characters
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES (repeat('t', 260), 'u-9', 'LongTopic', '{}');
-- message kinds only the fuzz_seed_all slot sees
INSERT INTO fuzz_other VALUES (1, 'one', '\xdeadbeef', 3.14159, 'happy'), (2, NULL, NULL, NULL, NULL);
UPDATE fuzz_other SET t = 'uno', m = 'ok' WHERE id = 1;
UPDATE fuzz_other SET id = 3 WHERE id = 2;
DELETE FROM fuzz_other WHERE id = 3;
INSERT INTO fuzz_full VALUES ('a', 1), ('b', NULL);
UPDATE fuzz_full SET v = 2 WHERE k = 'a';
DELETE FROM fuzz_full WHERE k = 'b';
TRUNCATE fuzz_full, fuzz_other RESTART IDENTITY CASCADE;
SELECT pg_logical_emit_message(true, 'fuzz.prefix', 'transactional content');
SELECT pg_logical_emit_message(false, 'fuzz.nontx', '\x00ff00'::bytea);
-- a transaction larger than logical_decoding_work_mem (64kB when peeked), with an
-- aborted subtransaction: Stream Start/Stop/Abort/Commit with proto_version 2
BEGIN;
INSERT INTO fuzz_full SELECT repeat('s', 120) || g, g FROM generate_series(1, 700) g;
SAVEPOINT sp;
INSERT INTO fuzz_full SELECT repeat('r', 120) || g, g FROM generate_series(1, 700) g;
ROLLBACK TO SAVEPOINT sp;
INSERT INTO fuzz_full VALUES ('tail', -1);
COMMIT;
SQL

peek="SELECT lsn::text, xid, encode(data, 'hex') FROM pg_logical_slot_peek_binary_changes"
psql_db -c "\\copy ($peek('fuzz_seed', NULL, NULL, 'proto_version', '1', 'publication_names', 'outbox_relay_pub')) TO '$work/outbox_v1.csv' csv"
psql_db -c "\\copy ($peek('fuzz_seed_all', NULL, NULL, 'proto_version', '1', 'publication_names', 'fuzz_seed_all', 'messages', 'true')) TO '$work/all_v1.csv' csv"
psql_db -c "SET logical_decoding_work_mem = '64kB'" \
    -c "\\copy ($peek('fuzz_seed_all', NULL, NULL, 'proto_version', '2', 'publication_names', 'fuzz_seed_all', 'messages', 'true', 'streaming', 'on')) TO '$work/all_v2.csv' csv"

python3 - "$work" "$here/corpus" <<'PY'
import csv, hashlib, os, struct, sys

work, corpus = sys.argv[1], sys.argv[2]
SEP = b"\xff\xfe\xfd\xfc"          # message separator of the sequence inputs
SEND_TIME = 849_000_000_000_000     # 2026-11-26, microseconds since 2000-01-01

def load(name):
    out = []
    for lsn, xid, data in csv.reader(open(os.path.join(work, name))):
        hi, lo = lsn.split("/")
        out.append(((int(hi, 16) << 32) | int(lo, 16), int(xid), bytes.fromhex(data)))
    return out

outbox, all1, all2 = load("outbox_v1.csv"), load("all_v1.csv"), load("all_v2.csv")
written = {}

def put(target, prefix, data):
    d = os.path.join(corpus, target)
    os.makedirs(d, exist_ok=True)
    name = f"{prefix}-{hashlib.sha1(data).hexdigest()[:12]}"
    if (target, data) in written:
        return
    written[(target, data)] = name
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)

for t in ("pgoutput_decode", "replication_frame", "outbox_map"):
    d = os.path.join(corpus, t)
    if os.path.isdir(d):
        for f in os.listdir(d):
            if f.split("-")[0] in ("pg", "seq", "syn", "xlog", "keepalive", "standby", "map"):
                os.remove(os.path.join(d, f))

def txns(rows):
    """Groups messages into transactions (Begin ... Commit); others stand alone."""
    cur, out = None, []
    for lsn, xid, m in rows:
        if m[:1] == b"B":
            cur = [m]
        elif m[:1] == b"C" and cur is not None:
            cur.append(m); out.append(cur); cur = None
        elif cur is not None:
            cur.append(m)
        else:
            out.append([m])
    return out

# ---- pgoutput_decode: context byte (version | 0x80 in-stream) + message(s) ----
for lsn, xid, m in outbox:
    put("pgoutput_decode", "pg", b"\x01" + m)
for t in txns(outbox):
    put("pgoutput_decode", "seq", b"\x01" + SEP.join(t))
# the other kinds of messages: a few of each tag from the all-tables slot
seen = {}
for lsn, xid, m in all1:
    tag = m[:1]
    if seen.get(tag, 0) < 3 and m not in {x[2] for x in outbox}:
        seen[tag] = seen.get(tag, 0) + 1
        put("pgoutput_decode", "pg", b"\x01" + m)
# streamed transactions (v2): messages inside a block carry the xid
inside, seq, seq_inside, seen = False, [], 0, {}
for lsn, xid, m in all2:
    tag = m[:1]
    ctx = 0x02 | (0x80 if inside else 0)
    if seen.get((tag, inside), 0) < 2:
        seen[(tag, inside)] = seen.get((tag, inside), 0) + 1
        put("pgoutput_decode", "pg", bytes([ctx]) + m)
    # one sequence: every block (a few of its changes), the Stream Abort and Commit
    if tag in (b"S", b"E", b"A", b"c") or (tag in (b"R", b"Y") and inside):
        seq.append(m)
    elif inside and tag == b"I" and seq_inside < 4:
        seq_inside += 1
        seq.append(m)
    if tag == b"S":
        inside = True
    elif tag == b"E":
        inside = False
put("pgoutput_decode", "seq", b"\x02" + SEP.join(seq))
put("pgoutput_decode", "seq", b"\x04" + SEP.join(seq))

# synthetic: two-phase (v3), v4 Stream Abort, Origin, Stream Prepare
def cstr(s): return s + b"\x00"
lsn1, lsn2, t = struct.pack(">Q", 0x7F1E_0000), struct.pack(">Q", 0x7F1E_0040), struct.pack(">q", SEND_TIME)
xid = struct.pack(">I", 106_500)
syn = [
    (0x03, b"b" + lsn1 + lsn2 + t + xid + cstr(b"gid-1")),
    (0x03, b"P" + b"\x00" + lsn1 + lsn2 + t + xid + cstr(b"gid-1")),
    (0x03, b"K" + b"\x00" + lsn1 + lsn2 + t + xid + cstr(b"gid-1")),
    (0x03, b"r" + b"\x00" + lsn1 + lsn2 + t + t + xid + cstr(b"gid-1")),
    (0x03, b"p" + b"\x00" + lsn1 + lsn2 + t + xid + cstr(b"gid-2")),
    (0x04, b"A" + xid + xid + lsn2 + t),
    (0x01, b"O" + lsn1 + cstr(b"pg_origin_1")),
    (0x82, b"M" + xid + b"\x01" + lsn1 + cstr(b"pfx") + struct.pack(">i", 3) + b"abc"),
    (0x01, b"T" + struct.pack(">i", 2) + b"\x03" + struct.pack(">II", 16385, 16386)),
]
# hostile lengths and counts: each must be rejected without allocating what it claims
relid = struct.pack(">I", 31909)
big32, big16 = struct.pack(">i", 0x7FFF_FFFF), struct.pack(">h", 0x7FFF)
syn += [
    (0x01, b"I" + relid + b"N" + struct.pack(">h", 1) + b"t" + big32 + b"abc"),
    (0x01, b"I" + relid + b"N" + big16 + b"n"),
    (0x01, b"T" + big32 + b"\x00" + relid),
    (0x01, b"M" + b"\x01" + lsn1 + cstr(b"p") + big32 + b"x"),
    (0x01, b"R" + relid + cstr(b"public") + cstr(b"outbox") + b"d" + big16
           + b"\x01" + cstr(b"id") + struct.pack(">Ii", 2950, -1)),
    (0x01, b"U" + relid + b"O" + big16 + b"n"),
]
for ctx, m in syn:
    put("pgoutput_decode", "syn", bytes([ctx]) + m)
put("pgoutput_decode", "seq", b"\x03" + SEP.join(m for _, m in syn[:4]))

# ---- replication_frame: XLogData ('w' + wal_start + wal_end + send time) ----
def xlog(lsn, m):
    return b"w" + struct.pack(">QQq", lsn, lsn, SEND_TIME) + m
for lsn, xid, m in outbox:
    # Relation (and Type) messages are non-final writes: sent with 0/0
    put("replication_frame", "xlog", xlog(0 if m[:1] in b"RY" else lsn, m))
for lsn, xid, m in all2:
    if m[:1] in (b"S", b"E", b"A", b"c", b"M", b"T"):
        put("replication_frame", "xlog", xlog(lsn, m))
last = outbox[-1][0]
for wal_end, reply in ((last, 0), (last, 1), (0, 0), (2**64 - 1, 2)):
    put("replication_frame", "keepalive", b"k" + struct.pack(">Qq", wal_end, SEND_TIME) + bytes([reply]))
put("replication_frame", "keepalive", b"k" + struct.pack(">Qq", last, -(2**63)) + b"\x00")
for flush, reply in ((last, 0), (last, 1), (0, 0)):
    put("replication_frame", "standby", b"r" + struct.pack(">QQQq", flush, flush, flush, SEND_TIME) + bytes([reply]))

# ---- outbox_map: flag byte + Begin/Relation/Insert.../Commit of one transaction ----
relation = next(m for _, _, m in outbox if m[:1] == b"R")
for t in txns(outbox):
    if relation not in t:
        t = t[:1] + [relation] + t[1:]
    put("outbox_map", "map", b"\x00" + SEP.join(t))
    put("outbox_map", "map", b"\x02" + SEP.join(t))       # with the envelope mapper
first = txns(outbox)[0]
inserts = [m for m in first if m[:1] == b"I"]
for flags in (0x01, 0x05, 0x09, 0x0D, 0x0F):               # canonical relation, payload types
    put("outbox_map", "map", bytes([flags]) + SEP.join(inserts))
# the canonical relation's 12 columns, the payload claiming 2 GB
cols = b"n" * 7 + b"t" + big32 + b"{}" + b"n" * 4
put("outbox_map", "map", b"\x01" + b"I" + relid + b"N" + struct.pack(">h", 12) + cols)
# another table's Relation + Insert (NotOutbox), and a streamed transaction
for t in txns(all1):
    if any(b"fuzz_other\x00" in m for m in t) and any(m[:1] == b"I" for m in t):
        put("outbox_map", "map", b"\x00" + SEP.join(t))
        break
put("outbox_map", "map", b"\x00" + SEP.join(seq))

for t in ("pgoutput_decode", "replication_frame", "outbox_map"):
    n = sum(1 for (tt, _) in written if tt == t)
    size = sum(len(d) for (tt, d) in written if tt == t)
    print(f"{t}: {n} seed files, {size} bytes")
PY
