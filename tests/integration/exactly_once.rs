//! `kafka.delivery = "exactly-once"` against the in-memory broker with transactions
//! (`outbox-relay dev-broker`: Tansu lists no aborted transactions, librdkafka's mock
//! cluster writes no transaction markers) and the real PostgreSQL; the topics are read
//! with librdkafka at `read_committed`, as the relay's consumers would.

use std::time::{Duration, Instant};

use tokio_postgres::Client;

use crate::harness::{
    self, DevBroker, Record, RelayProcess, TestDb, assert_per_key_order, consume_with, tally,
};

/// Events each writer commits (four writers).
pub(crate) const PER_WRITER: i64 = 600;

/// Writer `w`: `PER_WRITER` events over 13 entities of its own, in transactions of
/// one to four rows, a few milliseconds apart (so kills land mid-stream).
pub(crate) async fn write(client: Client, w: i64) {
    client
        .batch_execute(&format!(
            "DO $$ BEGIN
               FOR g IN 0..{last} LOOP
                 INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('order', 'w{w}-' || (g % 13), 'Created', jsonb_build_object('seq', g));
                 IF g % (1 + g % 4) = 0 THEN
                   COMMIT;
                   PERFORM pg_sleep(0.02);
                 END IF;
               END LOOP;
             END $$",
            last = PER_WRITER - 1
        ))
        .await
        .expect("write events");
}

/// Reads the topic at `read_committed` until every one of `expected` events is
/// there or `limit` passed: as many records as events plus the duplicates seen so
/// far (a reader that stopped at `expected` records would miss events behind
/// duplicates).
pub(crate) async fn read_committed_until_complete(
    brokers: &str,
    topic: &str,
    expected: usize,
    limit: Duration,
) -> Vec<Record> {
    let started = Instant::now();
    let mut want = expected;
    loop {
        let records = consume_with(
            brokers,
            &READ_COMMITTED,
            topic,
            want,
            Duration::from_secs(20),
        )
        .await;
        let (unique, duplicates) = tally(&records);
        if unique >= expected || started.elapsed() > limit {
            return records;
        }
        want = expected + duplicates;
    }
}

/// Every record written to the topic, aborted transactions' included.
async fn read_uncommitted_count(brokers: &str, topic: &str) -> usize {
    let settings = [
        ("isolation.level", "read_uncommitted"),
        ("broker.address.family", "v4"),
    ];
    consume_with(
        brokers,
        &settings,
        topic,
        usize::MAX,
        Duration::from_secs(5),
    )
    .await
    .len()
}

/// The settings of a reader that sees what the relay's consumers see.
const READ_COMMITTED: [(&str, &str); 2] = [
    ("isolation.level", "read_committed"),
    ("broker.address.family", "v4"),
];

/// Four writers, the relay killed with SIGKILL three times while they write (and
/// started again each time): a `read_committed` reader sees every event exactly once,
/// in per-key order. Aborted transactions are there to see (`read_uncommitted` reads
/// more records than `read_committed`), so the kills did cut transactions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_once_for_read_committed_readers_across_kill_9() {
    let broker = DevBroker::start();
    let brokers = broker.address.clone();
    let db = TestDb::create("eos_kill").await;
    harness::create_topic_on(&brokers, &db.topic, 3).await;
    let env = [
        ("OUTBOX_RELAY__KAFKA__BROKERS", brokers.as_str()),
        ("OUTBOX_RELAY__KAFKA__DELIVERY", "exactly-once"),
        ("OUTBOX_RELAY__KAFKA__TRANSACTION_INTERVAL_MS", "50"),
        ("OUTBOX_RELAY__RELAY__MAX_IN_FLIGHT_EVENTS", "500"),
    ];
    // `migrate` creates the progress topic; `check` finds it.
    for (command, expected) in [
        (
            "migrate",
            "kafka.progress_topic outbox_relay_progress exists",
        ),
        ("check", "kafka.delivery: exactly-once"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
            .args([command, "--config", db.config_path.to_str().unwrap()])
            .envs(env)
            .output()
            .expect("run outbox-relay");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.contains(expected), "{command}: {text}");
    }
    let mut writers = Vec::new();
    for w in 0..4 {
        let client = harness::connect(&db.url).await;
        writers.push(tokio::spawn(write(client, w)));
    }
    let mut kills = 0;
    for pause_ms in [1_500, 900, 2_100] {
        let relay = RelayProcess::start(&db.config_path, &env);
        db.wait_streaming(&relay).await;
        tokio::time::sleep(Duration::from_millis(pause_ms)).await;
        assert!(
            relay.log().contains("transactions initialised"),
            "{}",
            relay.log()
        );
        relay.kill9().await;
        kills += 1;
    }
    for w in writers {
        w.await.expect("writer");
    }
    let relay = RelayProcess::start(&db.config_path, &env);
    let expected = usize::try_from(4 * PER_WRITER).unwrap();
    let records =
        read_committed_until_complete(&brokers, &db.topic, expected, Duration::from_secs(90)).await;
    let (unique, duplicates) = tally(&records);
    assert_eq!(
        unique,
        expected,
        "read_committed saw {unique} of {expected}; relay log:\n{}\nbroker log:\n{}",
        relay.log(),
        broker.log()
    );
    assert_eq!(duplicates, 0, "read_committed saw duplicates");
    assert_per_key_order(&records);
    let everything = read_uncommitted_count(&brokers, &db.topic).await;
    eprintln!(
        "exactly-once: {kills} kill -9, {expected} events, read_committed: {unique} once, \
         0 duplicates; read_uncommitted: {everything} records (aborted ones included)"
    );
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

/// Tansu commits no Kafka transaction (its EndTxn answers UNSUPPORTED_FEATURE or
/// fails): exactly-once mode refuses to start with exit code 3 and says why, rather
/// than failing at the first commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_without_transactions_is_refused_at_start() {
    let db = TestDb::create("eos_tansu").await;
    harness::create_progress_topic_on(&harness::env().brokers).await;
    let env = [("OUTBOX_RELAY__KAFKA__DELIVERY", "exactly-once")];
    let mut relay = RelayProcess::start(&db.config_path, &env);
    let status = relay.wait(Duration::from_secs(90)).await;
    let log = relay.log();
    assert_eq!(status.code(), Some(3), "{log}");
    assert!(log.contains("does not support Kafka transactions"), "{log}");
    db.drop_slot().await;
}

/// Writer `w` of the drill: events `w{w}-{seq % 13}` in transactions of one to four
/// rows, until `stop`; survives PostgreSQL restarts (it reconnects and continues
/// after the last row it committed). Returns how many events it committed.
async fn drill_writer(
    url: String,
    w: i64,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> i64 {
    loop {
        let Ok((client, conn)) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        tokio::spawn(conn);
        // Where the last connection left off (a commit may have landed unanswered).
        let mut next = match client
            .query_one(
                "SELECT coalesce(max((payload->>'seq')::bigint), -1) FROM outbox
                 WHERE aggregate_id LIKE $1",
                &[&format!("w{w}-%")],
            )
            .await
        {
            Ok(row) => row.get::<_, i64>(0) + 1,
            Err(_) => continue,
        };
        loop {
            if stop.load(std::sync::atomic::Ordering::Acquire) {
                return next;
            }
            let rows = 1 + next % 4;
            let batch = format!(
                "BEGIN; INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                 SELECT 'order', 'w{w}-' || (g % 13), 'Created', jsonb_build_object('seq', g)
                 FROM generate_series({next}, {last}) g; COMMIT;",
                last = next + rows - 1
            );
            if client.batch_execute(&batch).await.is_err() {
                break;
            }
            next += rows;
            tokio::time::sleep(Duration::from_millis(15)).await;
        }
    }
}

/// `n` events for `topic` (the row's `topic` column), on three entities of their
/// own, 50 ms apart: the drill's topic that is created late.
async fn late_writer(url: String, topic: String, n: i64) -> i64 {
    let client = harness::connect(&url).await;
    for g in 0..n {
        client
            .execute(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, topic)
                 VALUES ('order', 'late-' || ($1::bigint % 3), 'Created',
                         jsonb_build_object('seq', $1::bigint), $2)",
                &[&g, &topic],
            )
            .await
            .expect("write a late-topic event");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    n
}

/// The relay as the drill runs it: transactions time out after 3 s (the drill
/// stalls the broker past that), and a record for a missing topic fails after
/// half a second.
fn drill_relay(db: &TestDb, brokers: &str) -> RelayProcess {
    RelayProcess::start(
        &db.config_path,
        &[
            ("OUTBOX_RELAY__KAFKA__BROKERS", brokers),
            ("OUTBOX_RELAY__KAFKA__DELIVERY", "exactly-once"),
            ("OUTBOX_RELAY__KAFKA__TRANSACTION_INTERVAL_MS", "50"),
            ("OUTBOX_RELAY__KAFKA__TRANSACTION_TIMEOUT_MS", "3000"),
            ("OUTBOX_RELAY__RELAY__MAX_IN_FLIGHT_EVENTS", "500"),
            ("OUTBOX_RELAY__RELAY__SLOT_BUSY_TIMEOUT_SECS", "600"),
        ],
    )
}

/// Until the relay logs that it streams (`n`-th time).
async fn until_streaming(relay: &RelayProcess, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(90);
    while relay
        .log()
        .matches("INFO outbox_relay::cdc::session: streaming")
        .count()
        < n
    {
        assert!(
            Instant::now() < deadline,
            "no streaming; log:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The exactly-once drill: four writers on a private PostgreSQL, the relay killed
/// with SIGKILL `OUTBOX_RELAY_EOS_KILLS` times (3 here; 10 in the full drill), the
/// server restarted `OUTBOX_RELAY_EOS_PG_RESTARTS` times (1; 2 in the full drill,
/// immediate and fast), and a standby taking over from a killed active relay; between
/// them, transactions aborted in session: a topic created after its first events,
/// the broker stopped (SIGSTOP) past the transaction timeout, records the broker
/// refuses. A `read_committed` reader sees every committed event exactly once, in
/// per-key order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drill_kills_restarts_and_takes_over_without_duplicates() {
    let count = |name: &str, default: usize| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let kills = count("OUTBOX_RELAY_EOS_KILLS", 3);
    let restarts = count("OUTBOX_RELAY_EOS_PG_RESTARTS", 1);
    let broker = DevBroker::start_with(&["--auto-create-topics", "false"]);
    let brokers = broker.address.clone();
    let cluster = harness::PrivateCluster::start("logical").await;
    let db = TestDb::create_in(
        &cluster.url,
        "eos_drill",
        3,
        "\n[kafka.producer]\n\"topic.metadata.propagation.max.ms\" = \"500\"\n",
    )
    .await;
    let late_topic = format!("{}.late", db.name);
    harness::create_topic_on(&brokers, &db.topic, 3).await;
    harness::create_progress_topic_on(&brokers).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writers: Vec<_> = (0..4)
        .map(|w| tokio::spawn(drill_writer(db.url.clone(), w, stop.clone())))
        .collect();
    let mut active = drill_relay(&db, &brokers);
    until_streaming(&active, 1).await;
    // The standby waits for the slot, then takes over from the killed active relay.
    let standby = drill_relay(&db, &brokers);
    tokio::time::sleep(Duration::from_secs(2)).await;
    active.kill9().await;
    until_streaming(&standby, 1).await;
    active = standby;
    // In-session aborts: a topic that does not exist yet, a stalled broker, refused
    // records; then the topic is created.
    let late = tokio::spawn(late_writer(db.url.clone(), late_topic.clone(), 40));
    tokio::time::sleep(Duration::from_secs(1)).await;
    broker.signal("-STOP");
    tokio::time::sleep(Duration::from_secs(5)).await;
    broker.signal("-CONT");
    broker
        .control(&format!("fail-produce {} * INVALID_RECORD 2", db.topic))
        .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    harness::create_topic_on(&brokers, &late_topic, 1).await;
    let mut restarted = 0;
    for cycle in 0..kills {
        tokio::time::sleep(Duration::from_millis(700 + 400 * (cycle as u64 % 3))).await;
        if restarted < restarts && cycle % 2 == 1 {
            let mode = if restarted % 2 == 0 {
                "immediate"
            } else {
                "fast"
            };
            cluster.restart(mode).await;
            restarted += 1;
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        active.kill9().await;
        active = drill_relay(&db, &brokers);
        until_streaming(&active, 1).await;
    }
    while restarted < restarts {
        cluster
            .restart(if restarted % 2 == 0 {
                "immediate"
            } else {
                "fast"
            })
            .await;
        restarted += 1;
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Release);
    let mut expected = 0_usize;
    for w in writers {
        expected += usize::try_from(w.await.expect("writer")).unwrap();
    }
    let late_expected = usize::try_from(late.await.expect("late writer")).unwrap();
    let late_records = read_committed_until_complete(
        &brokers,
        &late_topic,
        late_expected,
        Duration::from_secs(120),
    )
    .await;
    assert_eq!(
        tally(&late_records),
        (late_expected, 0),
        "the late topic at read_committed; relay log:\n{}",
        active.log()
    );
    assert_per_key_order(&late_records);
    let records =
        read_committed_until_complete(&brokers, &db.topic, expected, Duration::from_secs(180))
            .await;
    let (unique, duplicates) = tally(&records);
    assert_eq!(
        unique,
        expected,
        "read_committed saw {unique} of {expected}; relay log:\n{}",
        active.log()
    );
    assert_eq!(duplicates, 0, "read_committed saw duplicates");
    assert_per_key_order(&records);
    let everything = read_uncommitted_count(&brokers, &db.topic).await;
    eprintln!(
        "exactly-once drill: {kills} kill -9, {restarted} PostgreSQL restarts, 1 standby \
         takeover, a 5 s broker stall, refused records, a topic created late ({late_expected} \
         events), 4 writers, {expected} events: read_committed saw each once, in per-key \
         order, 0 duplicates; read_uncommitted: {everything} records (aborted ones included)"
    );
    active.terminate(Duration::from_secs(30)).await;
}

/// A standby relay reads the server's WAL end when it connects, then waits for the
/// slot while the active relay commits Kafka transactions past that end. After the
/// active relay is killed, the standby must resume from the last progress record:
/// judged by the WAL end it saw before its wait, the record looked written past the
/// server's WAL (a restore in place), was dropped, and everything since the last
/// saved position was published a second time (seen as 3 to 64 duplicates in the
/// drill on a loaded machine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_that_waited_for_the_slot_resumes_from_the_progress_record() {
    let broker = DevBroker::start();
    let brokers = broker.address.clone();
    let db = TestDb::create("eos_standby_wait").await;
    harness::create_topic_on(&brokers, &db.topic, 3).await;
    harness::create_progress_topic_on(&brokers).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writers: Vec<_> = (0..2)
        .map(|w| tokio::spawn(drill_writer(db.url.clone(), w, stop.clone())))
        .collect();
    let active = drill_relay(&db, &brokers);
    until_streaming(&active, 1).await;
    let standby = drill_relay(&db, &brokers);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !standby
        .log()
        .contains("replication slot is active in another process")
    {
        assert!(
            Instant::now() < deadline,
            "the standby never waited for the slot; log:\n{}",
            standby.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The active relay commits transactions (and progress records) past the WAL
    // end the standby saw: everything written from now on is delivered first.
    let marker_from = {
        let client = harness::connect(&db.url).await;
        let row = client
            .query_one("SELECT count(*) FROM outbox", &[])
            .await
            .expect("count the outbox");
        usize::try_from(row.get::<_, i64>(0)).expect("a count")
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let _ =
        read_committed_until_complete(&brokers, &db.topic, marker_from, Duration::from_secs(60))
            .await;
    active.kill9().await;
    until_streaming(&standby, 1).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, std::sync::atomic::Ordering::Release);
    let mut expected = 0_usize;
    for w in writers {
        expected += usize::try_from(w.await.expect("writer")).unwrap();
    }
    let records =
        read_committed_until_complete(&brokers, &db.topic, expected, Duration::from_secs(120))
            .await;
    let (unique, duplicates) = tally(&records);
    let log = standby.log();
    assert_eq!(
        unique, expected,
        "read_committed saw {unique} of {expected}; standby log:\n{log}"
    );
    assert!(
        log.contains("resuming from the last committed progress record"),
        "the standby did not resume from the progress record; its log:\n{log}"
    );
    assert_eq!(
        duplicates, 0,
        "read_committed saw duplicates; standby log:\n{log}"
    );
    assert_per_key_order(&records);
    standby.terminate(Duration::from_secs(30)).await;
}

/// Creates `db`'s topic and the progress topic on `brokers`; the environment of an
/// exactly-once relay that writes to them (`window`: `relay.max_in_flight_events`).
pub(crate) async fn exactly_once_on<'b>(
    brokers: &'b str,
    db: &TestDb,
    window: Option<&'b str>,
) -> Vec<(&'static str, &'b str)> {
    harness::create_topic_on(brokers, &db.topic, 3).await;
    harness::create_progress_topic_on(brokers).await;
    let mut env = vec![
        ("OUTBOX_RELAY__KAFKA__BROKERS", brokers),
        ("OUTBOX_RELAY__KAFKA__DELIVERY", "exactly-once"),
        ("OUTBOX_RELAY__KAFKA__TRANSACTION_INTERVAL_MS", "50"),
    ];
    env.extend(window.map(|w| ("OUTBOX_RELAY__RELAY__MAX_IN_FLIGHT_EVENTS", w)));
    env
}

/// A trigger that refuses every `sent_at` mark: a backlog fails right after a
/// round's Kafka commit (`DROP TRIGGER refuse_marks ON outbox` lifts it).
const REFUSE_MARKS: &str = "
    CREATE FUNCTION refuse_marks() RETURNS trigger LANGUAGE plpgsql AS $$
      BEGIN RAISE EXCEPTION 'sent_at marks refused by the test'; END $$;
    CREATE TRIGGER refuse_marks BEFORE UPDATE OF sent_at ON outbox
      FOR EACH ROW EXECUTE FUNCTION refuse_marks();";

/// Waits until `relay`'s backlog had a round's marks refused (its Kafka commit
/// done), then kills it with SIGKILL; returns its log.
async fn killed_when_its_marks_are_refused(relay: RelayProcess) -> String {
    let deadline = Instant::now() + Duration::from_secs(90);
    while !relay.log().contains("sent_at marks refused by the test") {
        assert!(
            Instant::now() < deadline,
            "the backlog never tried to mark its first round; log:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let log = relay.log();
    relay.kill9().await;
    log
}

/// A backlog in exactly-once mode whose process dies between a round's Kafka commit
/// and the `sent_at` marks of that round (the marks are refused by a trigger, then
/// the relay is killed): the next relay reads the round's progress record, marks its
/// rows before it reads the backlog again, and a `read_committed` reader sees every
/// row once. (At-least-once published the round's rows a second time.)
/// `lose_slot`: the backlog is a resync after a lost slot, else the cutover of rows
/// written before the relay's first start.
async fn backlog_cut_between_its_kafka_commit_and_its_marks(prefix: &str, lose_slot: bool) {
    const ROWS: usize = 1_000;
    let broker = DevBroker::start();
    let brokers = broker.address.clone();
    let mut db = TestDb::create(prefix).await;
    if lose_slot {
        db.append_config("\n[relay]\ncutover = \"off\"\n");
    }
    let env = exactly_once_on(&brokers, &db, Some("200")).await;
    if lose_slot {
        // The relay records its position once, then its slot is lost.
        let relay = RelayProcess::start(&db.config_path, &env);
        db.wait_streaming(&relay).await;
        relay.terminate(Duration::from_secs(30)).await;
        db.drop_slot().await;
    }
    db.client
        .batch_execute(&format!(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'k' || (g % 7), 'Created', jsonb_build_object('seq', g)
             FROM generate_series(0, {last}) g;
             {REFUSE_MARKS}",
            last = ROWS - 1
        ))
        .await
        .expect("write the backlog and refuse its marks");
    let first = killed_when_its_marks_are_refused(RelayProcess::start(&db.config_path, &env)).await;
    db.client
        .batch_execute("DROP TRIGGER refuse_marks ON outbox")
        .await
        .expect("drop the trigger");
    let relay = RelayProcess::start(&db.config_path, &env);
    let records =
        read_committed_until_complete(&brokers, &db.topic, ROWS, Duration::from_secs(120)).await;
    let (unique, duplicates) = tally(&records);
    let log = relay.log();
    assert_eq!(unique, ROWS, "first relay:\n{first}\nsecond relay:\n{log}");
    assert_eq!(
        duplicates, 0,
        "read_committed saw rows twice; first relay:\n{first}\nsecond relay:\n{log}"
    );
    assert_per_key_order(&records);
    assert!(
        log.contains("marked the rows of the last committed backlog transaction sent"),
        "{log}"
    );
    // The last round's marks follow its Kafka commit, which the reader may see first.
    harness::wait_until(
        Duration::from_secs(30),
        "every backlog row marked sent",
        || async {
            let unsent: i64 = db
                .client
                .query_one("SELECT count(*) FROM outbox WHERE sent_at IS NULL", &[])
                .await
                .unwrap()
                .get(0);
            unsent == 0
        },
    )
    .await;
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resync_cut_between_its_kafka_commit_and_its_marks_publishes_each_row_once() {
    backlog_cut_between_its_kafka_commit_and_its_marks("eos_resync", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cutover_cut_between_its_kafka_commit_and_its_marks_publishes_each_row_once() {
    backlog_cut_between_its_kafka_commit_and_its_marks("eos_cutover", false).await;
}

/// The slot of a running exactly-once relay is dropped under it: the same process
/// resyncs (its backlog's transactional producer would fence the stream's, which the
/// session replaces first) and streams on; every row is read once, those written
/// after the loss (by the resync, then by the stream) and those streamed just before
/// it. A transaction held open from before the first rows keeps every delivered
/// checkpoint below them, so the resync reads all of them again: it must find their
/// records in the topic and mark them sent instead of publishing them a second time
/// (it did publish all 100 again before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_lost_under_a_running_relay_is_resynced_by_the_same_process() {
    let broker = DevBroker::start();
    let brokers = broker.address.clone();
    let db = TestDb::create("eos_heal").await;
    let env = exactly_once_on(&brokers, &db, None).await;
    let insert = |entity: &'static str| {
        format!(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', '{entity}' || (g % 5), 'Created', jsonb_build_object('seq', g)
             FROM generate_series(0, 99) g"
        )
    };
    let mut relay = RelayProcess::start(&db.config_path, &env);
    db.wait_streaming(&relay).await;
    // An xid older than the rows', running while they are delivered: every checkpoint
    // taken meanwhile has its xmin below them.
    let holder = harness::connect(&db.url).await;
    holder
        .batch_execute("BEGIN; CREATE TEMP TABLE hold_xmin (x int)")
        .await
        .unwrap();
    db.client.batch_execute(&insert("a")).await.unwrap();
    read_committed_until_complete(&brokers, &db.topic, 100, Duration::from_secs(60)).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !relay.log().contains("replication slot lost") {
        assert!(
            Instant::now() < deadline,
            "the slot could not be taken away; log:\n{}",
            relay.log()
        );
        let _ = db
            .client
            .batch_execute(&format!(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
                 WHERE slot_name = '{slot}' AND active_pid IS NOT NULL;
                 SELECT pg_drop_replication_slot('{slot}');",
                slot = db.slot
            ))
            .await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The new slot waits for the held transaction to end.
    holder.batch_execute("ROLLBACK").await.unwrap();
    db.client.batch_execute(&insert("b")).await.unwrap();
    // Then it streams again, on a producer the backlog's did not fence.
    until_streaming(&relay, 2).await;
    db.client.batch_execute(&insert("c")).await.unwrap();
    let records =
        read_committed_until_complete(&brokers, &db.topic, 300, Duration::from_secs(90)).await;
    let log = relay.log();
    assert!(log.contains("resync complete"), "{log}");
    assert!(relay.is_running(), "the relay exited; log:\n{log}");
    let (unique, duplicates) = tally(&records);
    assert_eq!(unique, 300, "{log}");
    assert_eq!(duplicates, 0, "read_committed saw rows twice; log:\n{log}");
    assert!(log.contains("rows the topic already held"), "{log}");
    for written_after_the_loss in [b"b", b"c"] {
        let once = records
            .iter()
            .filter(|r| {
                r.key
                    .as_deref()
                    .is_some_and(|k| k.starts_with(written_after_the_loss))
            })
            .count();
        assert_eq!(
            once, 100,
            "rows written after the loss are read once; log:\n{log}"
        );
    }
    assert_per_key_order(&records);
    eprintln!("slot lost under a running exactly-once relay: {unique} events, 0 duplicates");
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

/// Zombie fencing: another producer initialises the relay's `transactional.id`
/// while the relay streams (as a relay that took the stream over would): the relay
/// stops producing and exits with code 3, saying it was fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_fenced_by_another_producer_exits_with_code_3() {
    use rdkafka::producer::{BaseProducer, Producer};
    let broker = DevBroker::start();
    let brokers = broker.address.clone();
    let db = TestDb::create("eos_fenced").await;
    let env = exactly_once_on(&brokers, &db, None).await;
    let insert = "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                  SELECT 'order', 'k' || (g % 3), 'Created', jsonb_build_object('seq', g)
                  FROM generate_series(0, 9) g";
    let mut relay = RelayProcess::start(&db.config_path, &env);
    db.wait_streaming(&relay).await;
    db.client.batch_execute(insert).await.unwrap();
    read_committed_until_complete(&brokers, &db.topic, 10, Duration::from_secs(60)).await;
    let id = format!("outbox-relay.{}", db.slot);
    let fencer_brokers = brokers.clone();
    let fencer = tokio::task::spawn_blocking(move || {
        let producer: BaseProducer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &fencer_brokers)
            .set("broker.address.family", "v4")
            .set("transactional.id", &id)
            .create()
            .expect("a transactional producer");
        producer
            .init_transactions(Duration::from_secs(30))
            .expect("init_transactions fences the relay");
        producer
    })
    .await
    .expect("fencer");
    db.client.batch_execute(insert).await.unwrap();
    let status = relay.wait(Duration::from_secs(60)).await;
    let log = relay.log();
    assert_eq!(status.code(), Some(3), "{log}");
    assert!(log.contains("fenced"), "{log}");
    drop(fencer);
    db.drop_slot().await;
}

/// A backlog round committed to Kafka whose marks were never written, then the
/// database restored in place to before the round's rows: the sequence hands their
/// ids to new rows, and new writes carry the WAL past the round's consistent point.
/// The next backlog must not mark those new rows with the old round's ids (the
/// server restarted since the round): every new row is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_round_left_unmarked_before_a_restore_marks_no_new_row() {
    let broker = DevBroker::start();
    let brokers = broker.address.clone();
    let cluster = harness::PrivateCluster::start("logical").await;
    let mut db = TestDb::create_in(&cluster.url, "eos_restore", 3, "").await;
    db.append_config("\n[relay]\ncutover = \"off\"\n");
    let env = exactly_once_on(&brokers, &db, Some("200")).await;
    let relay = RelayProcess::start(&db.config_path, &env);
    db.wait_streaming(&relay).await;
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
    cluster.snapshot("before_the_backlog").await;
    // The same ids in both generations, as a sequence (an adopted layout's bigserial)
    // hands them out again after a restore; the idempotency keys differ.
    let rows = |generation: i64| {
        format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
             SELECT ('00000000-0000-7000-8000-' || lpad(g::text, 12, '0'))::uuid,
                    'order', 'k' || (g % 7), 'Created',
                    jsonb_build_object('seq', g, 'generation', {generation})
             FROM generate_series(0, 999) g"
        )
    };
    let client = harness::connect(&db.url).await;
    client
        .batch_execute(&format!(
            "{};
             {REFUSE_MARKS}",
            rows(1)
        ))
        .await
        .unwrap();
    let first = killed_when_its_marks_are_refused(RelayProcess::start(&db.config_path, &env)).await;
    let consistent_point = first
        .lines()
        .find(|l| l.contains("slot created again"))
        .and_then(|l| l.split("consistent_point=").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .map(harness::parse_lsn)
        .expect("the resync's consistent point in the log");
    cluster.restore("before_the_backlog").await;
    let client = harness::connect(&db.url).await;
    client.batch_execute(&rows(2)).await.unwrap();
    // More WAL than the first attempt wrote: the restored server passes the round's
    // consistent point again.
    client
        .batch_execute("CREATE TABLE padding AS SELECT g FROM generate_series(1, 200000) g")
        .await
        .unwrap();
    let wal: String = client
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    assert!(
        harness::parse_lsn(&wal) > consistent_point,
        "the WAL must pass the round's consistent point, or this test proves nothing"
    );
    let keys: std::collections::HashSet<String> = client
        .query("SELECT idempotency_key::text FROM outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(keys.len(), 1_000);
    let relay = RelayProcess::start(&db.config_path, &env);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let records = consume_with(
            &brokers,
            &READ_COMMITTED,
            &db.topic,
            usize::MAX,
            Duration::from_secs(3),
        )
        .await;
        let seen: std::collections::HashSet<&str> = records
            .iter()
            .filter_map(|r| r.header("idempotency_key"))
            .collect();
        let missing = keys.iter().filter(|k| !seen.contains(k.as_str())).count();
        if missing == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{missing} of the rows written after the restore were never published; log:\n{}",
            relay.log()
        );
    }
    assert!(
        relay.log().contains("before the server restarted"),
        "{}",
        relay.log()
    );
    relay.terminate(Duration::from_secs(30)).await;
}

/// An event poisoned just before the relay is killed, in a PostgreSQL transaction
/// whose other event was written in the Kafka transaction still open (so neither the
/// slot nor a progress record has passed it), then deliverable when a relay starts
/// again: it stays in the poison table only, and a `read_committed` reader sees the
/// other event once and never the poisoned one. (Before, the restarted relay
/// produced it again: in the topic *and* in the poison table, which `replay` would
/// publish a second time.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_poisoned_just_before_a_kill_is_not_published_after_the_restart() {
    let broker = DevBroker::start();
    let brokers = broker.address.clone();
    let mut db = TestDb::create("eos_poison_kill").await;
    let base = std::fs::read_to_string(&db.config_path).expect("read the config");
    db.append_config("\n[kafka.producer]\n\"message.max.bytes\" = \"100000\"\n");
    let mut env = exactly_once_on(&brokers, &db, None).await;
    // Nothing commits on its own for a minute: the kill comes first.
    let slow = [
        ("OUTBOX_RELAY__KAFKA__TRANSACTION_INTERVAL_MS", "50000"),
        ("OUTBOX_RELAY__KAFKA__TRANSACTION_MAX_EVENTS", "100000"),
    ];
    let first = RelayProcess::start(&db.config_path, &[env.clone(), slow.to_vec()].concat());
    db.wait_streaming(&first).await;
    let delivered = "'written'";
    db.client
        .batch_execute(&format!(
            "BEGIN;
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', 'b', 'Created', jsonb_build_object('seq', 0, 'what', {delivered}));
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', 'a', 'Created', '{}'::jsonb);
             COMMIT;",
            harness::oversize_payload(0)
        ))
        .await
        .expect("write the two events");
    harness::wait_until(
        Duration::from_secs(60),
        "the oversize event poisoned",
        || async {
            let n: i64 = db
                .client
                .query_one("SELECT count(*) FROM poison_outbox", &[])
                .await
                .unwrap()
                .get(0);
            n == 1
        },
    )
    .await;
    let first_log = first.log();
    first.kill9().await;
    let poisoned_key: String = db
        .client
        .query_one("SELECT idempotency_key FROM poison_outbox", &[])
        .await
        .unwrap()
        .get(0);

    // The event fits now; a later event shows the relay went past it.
    std::fs::write(&db.config_path, base).expect("restore the config");
    env.push(("OUTBOX_RELAY__KAFKA__TRANSACTION_MAX_EVENTS", "1000"));
    let relay = RelayProcess::start(&db.config_path, &env);
    db.wait_streaming(&relay).await;
    db.client
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', 'a', 'Created', jsonb_build_object('seq', 1))",
        )
        .await
        .expect("write the later event");
    let records =
        read_committed_until_complete(&brokers, &db.topic, 2, Duration::from_secs(60)).await;
    let log = relay.log();
    let (unique, duplicates) = tally(&records);
    assert!(
        records
            .iter()
            .all(|r| r.header("idempotency_key") != Some(poisoned_key.as_str())),
        "the poisoned event was published after the restart; first relay:\n{first_log}\n\
         second relay:\n{log}"
    );
    assert_eq!(
        (unique, duplicates),
        (2, 0),
        "first relay:\n{first_log}\nsecond relay:\n{log}"
    );
    assert!(log.contains("not produced again"), "{log}");
    let rows: i64 = db
        .client
        .query_one("SELECT count(*) FROM poison_outbox", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 1, "the poisoned event is recorded once");
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

/// A trigger that refuses every save that moves the relay's position: the
/// position row, and the `saved` of every progress record, stay where they are
/// (a session start writes the position it starts from, which is let through).
const REFUSE_SAVES: &str = "
    CREATE FUNCTION refuse_saves() RETURNS trigger LANGUAGE plpgsql AS $$
      BEGIN
        IF NEW.confirmed_lsn > OLD.confirmed_lsn THEN
          RAISE EXCEPTION 'position saves refused by the test';
        END IF;
        RETURN NEW;
      END $$;
    CREATE TRIGGER refuse_saves BEFORE UPDATE ON outbox_relay_position
      FOR EACH ROW EXECUTE FUNCTION refuse_saves();";

/// `rows` events of `entity` (seq `first..first + rows`), one transaction each.
async fn one_per_transaction(client: &Client, entity: &str, first: i64, rows: i64) {
    client
        .batch_execute(&format!(
            "DO $$ BEGIN
               FOR g IN {first}..{last} LOOP
                 INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('order', '{entity}', 'Created', jsonb_build_object('seq', g));
                 COMMIT;
               END LOOP;
             END $$",
            last = first + rows - 1
        ))
        .await
        .unwrap();
}

/// The current WAL insert position.
async fn wal_lsn(client: &Client) -> u64 {
    let row = client
        .query_one("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint", &[])
        .await
        .unwrap();
    u64::try_from(row.get::<_, i64>(0)).unwrap()
}

/// A data directory restored in place to a point between the relay's saved
/// position and its progress record's watermark, then written past the watermark
/// before the relay starts again: the two signs of a restore (a start below the
/// record's saved position, a WAL ending before its watermark) both miss it, and
/// the new commits take LSNs below the watermark. The relay resolved them as the
/// record's, without a produce: every one of them was lost. The record now names
/// its watermark transaction by xid and commit time, which the restored server
/// does not have (`track_commit_timestamp = on`), and the record is not used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_written_past_the_progress_record_loses_nothing() {
    let broker = DevBroker::start();
    let brokers = broker.address.clone();
    let cluster = harness::PrivateCluster::start("logical").await;
    harness::connect(&cluster.url)
        .await
        .batch_execute("ALTER SYSTEM SET track_commit_timestamp = on")
        .await
        .unwrap();
    cluster.restart("fast").await;
    let db = TestDb::create_in(&cluster.url, "eos_restore", 1, "").await;
    let env = exactly_once_on(&brokers, &db, None).await;
    let relay = RelayProcess::start(&db.config_path, &env);
    db.wait_streaming(&relay).await;
    one_per_transaction(&db.client, "a", 0, 50).await;
    read_committed_until_complete(&brokers, &db.topic, 50, Duration::from_secs(60)).await;
    let end = wal_lsn(&db.client).await;
    harness::wait_until(Duration::from_secs(60), "the relay to confirm", || async {
        harness::confirmed_flush(&db.client, &db.slot).await + 4_096 >= end
    })
    .await;
    relay.kill9().await;
    db.client.batch_execute(REFUSE_SAVES).await.unwrap();
    cluster.snapshot("before").await;

    // Streamed and committed to Kafka with the relay's position unsaved: every
    // progress record has the snapshot's saved position and a watermark past the
    // snapshot's WAL end.
    let client = harness::connect(&db.url).await;
    let relay = RelayProcess::start(&db.config_path, &env);
    until_streaming(&relay, 1).await;
    one_per_transaction(&client, "b", 0, 300).await;
    read_committed_until_complete(&brokers, &db.topic, 350, Duration::from_secs(90)).await;
    let watermark_at_most = wal_lsn(&client).await;
    relay.kill9().await;

    cluster.restore("before").await;
    let client = harness::connect(&db.url).await;
    client
        .batch_execute("DROP TRIGGER refuse_saves ON outbox_relay_position")
        .await
        .unwrap();
    let mut written = 0;
    while wal_lsn(&client).await <= watermark_at_most + 8_192 {
        one_per_transaction(&client, "c", written, 100).await;
        written += 100;
    }
    let relay = RelayProcess::start(&db.config_path, &env);
    until_streaming(&relay, 1).await;
    let expected = usize::try_from(350 + written).unwrap();
    let records =
        read_committed_until_complete(&brokers, &db.topic, expected, Duration::from_secs(90)).await;
    let log = relay.log();
    let (unique, duplicates) = tally(&records);
    let c = harness::key_sequence(&records, "c");
    assert_eq!(
        c,
        (0..written).collect::<Vec<i64>>(),
        "every event written after the restore, in order ({unique} unique, {duplicates} duplicates); log:\n{log}"
    );
    assert!(
        log.contains("are not this server's"),
        "the relay says why it does not use the record; log:\n{log}"
    );
    eprintln!(
        "restore written past the record: {written} new events, {unique} unique, {duplicates} duplicates"
    );
    relay.terminate(Duration::from_secs(30)).await;
}
