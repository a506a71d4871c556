//! Unit tests of the core, one behaviour each, and a property test of arbitrary
//! (mostly invalid) call sequences.

use std::time::{Duration, Instant};

use super::config::MAX_TIMER;
use super::*;
use crate::delivery::{EventId, Failure};
use crate::lsn::Lsn;

fn cfg() -> CoreConfig {
    CoreConfig {
        max_in_flight_events: 4,
        max_in_flight_bytes: 1_000,
        max_attempts: 3,
        status_interval: Duration::from_secs(10),
        progress_status_interval: Duration::from_secs(1),
        retry_backoff_initial: Duration::from_millis(100),
        retry_backoff_max: Duration::from_secs(1),
        transactions: None,
    }
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn core_at(confirmed: u64) -> (Core, Instant) {
    let now = Instant::now();
    (Core::new(cfg(), Lsn(confirmed), now), now)
}

/// Drained actions; saves are performed at once (a saver that never lags) and left out.
fn drain(core: &mut Core) -> Vec<Action> {
    let mut out = Vec::new();
    while let Some(a) = core.next_action() {
        match a {
            Action::Save { lsn, .. } => {
                let at = core.last_status_at;
                core.saved(lsn, at);
            }
            a => out.push(a),
        }
    }
    core.check_invariants();
    out
}

/// Drained actions without status updates.
fn work(core: &mut Core) -> Vec<Action> {
    drain(core)
        .into_iter()
        .filter(|a| !matches!(a, Action::SendStatus(_)))
        .collect()
}

fn statuses(actions: &[Action]) -> Vec<StatusUpdate> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::SendStatus(s) => Some(*s),
            _ => None,
        })
        .collect()
}

/// One committed transaction `[final, final + 10)` with `n` events, all acked or not.
fn tx(core: &mut Core, final_lsn: u64, n: usize, now: Instant) -> Vec<EventId> {
    core.begin(Lsn(final_lsn), 7).unwrap();
    let ids = (0..n).map(|_| core.admit(10, now).unwrap()).collect();
    core.commit(Lsn(final_lsn), Lsn(final_lsn + 10), now)
        .unwrap();
    core.check_invariants();
    ids
}

#[test]
fn in_order_acks_confirm_each_transaction_end() {
    let (mut core, now) = core_at(50);
    let t1 = tx(&mut core, 100, 2, now);
    let t2 = tx(&mut core, 200, 1, now);
    assert_eq!(
        work(&mut core),
        vec![
            Action::Produce {
                id: t1[0],
                attempt: 1
            },
            Action::Produce {
                id: t1[1],
                attempt: 1
            },
            Action::Produce {
                id: t2[0],
                attempt: 1
            },
        ]
    );
    core.delivered(t1[0], now);
    assert_eq!(core.confirmed(), Lsn(50), "half of tx 1 acked");
    core.delivered(t1[1], now);
    assert_eq!(core.confirmed(), Lsn(110));
    core.delivered(t2[0], now);
    assert_eq!(core.confirmed(), Lsn(210));
    assert!(core.is_idle());
    core.check_invariants();
}

#[test]
fn out_of_order_acks_wait_for_the_oldest_transaction() {
    let (mut core, now) = core_at(50);
    let a = tx(&mut core, 100, 1, now)[0];
    let b = tx(&mut core, 200, 1, now)[0];
    let c = tx(&mut core, 300, 1, now)[0];
    core.delivered(c, now);
    core.delivered(b, now);
    assert_eq!(core.confirmed(), Lsn(50), "tx 1 still pending");
    assert_eq!(
        core.pending_transactions(),
        1,
        "resolved txs merged into tx 1"
    );
    core.check_invariants();
    core.delivered(a, now);
    assert_eq!(core.confirmed(), Lsn(310));
    assert!(core.is_idle());
}

#[test]
fn acks_for_an_open_transaction_count_before_its_commit() {
    let (mut core, now) = core_at(50);
    core.begin(Lsn(1_000), 9).unwrap();
    let a = core.admit(10, now).unwrap();
    let b = core.admit(10, now).unwrap();
    let c = core.admit(10, now).unwrap();
    let d = core.admit(10, now).unwrap();
    assert!(!core.can_read(), "window of 4 is full mid-transaction");
    for id in [a, b, c, d] {
        core.delivered(id, now);
    }
    assert!(
        core.can_read(),
        "acks of the open transaction free the window"
    );
    assert_eq!(
        core.confirmed(),
        Lsn(50),
        "but nothing is confirmed before Commit"
    );
    core.keepalive(Lsn(999), false, now);
    assert_eq!(
        core.confirmed(),
        Lsn(50),
        "no idle advance inside a transaction"
    );
    let e = core.admit(10, now).unwrap();
    core.delivered(e, now);
    core.check_invariants();
    core.commit(Lsn(1_000), Lsn(1_010), now).unwrap();
    assert_eq!(core.confirmed(), Lsn(1_010));
    assert!(core.is_idle());
}

#[test]
fn empty_transactions_resolve_at_commit_and_do_not_pile_up() {
    let (mut core, now) = core_at(50);
    tx(&mut core, 100, 0, now);
    assert_eq!(
        core.confirmed(),
        Lsn(110),
        "nothing before it: resolved at Commit"
    );
    let a = tx(&mut core, 200, 1, now)[0];
    for i in 0..1_000 {
        tx(&mut core, 300 + i * 20, 0, now);
    }
    assert_eq!(
        core.pending_transactions(),
        1,
        "empty txs folded into the pending one"
    );
    assert_eq!(core.confirmed(), Lsn(110));
    core.delivered(a, now);
    assert_eq!(core.confirmed(), Lsn(300 + 999 * 20 + 10));
}

#[test]
fn acked_transactions_behind_a_stuck_one_keep_the_queue_bounded() {
    let (mut core, now) = core_at(50);
    let stuck = tx(&mut core, 100, 1, now)[0];
    core.delivery_failed(stuck, Failure::Transient, now);
    for i in 0..500 {
        let id = tx(&mut core, 200 + i * 20, 1, now)[0];
        core.delivered(id, now);
        assert!(core.pending_transactions() <= 2);
    }
    assert_eq!(core.confirmed(), Lsn(50));
    core.tick(now + ms(100));
    assert_eq!(
        work(&mut core),
        vec![Action::Produce {
            id: stuck,
            attempt: 2
        }]
    );
    core.delivered(stuck, now + ms(100));
    assert_eq!(core.confirmed(), Lsn(200 + 499 * 20 + 10));
}

#[test]
fn permanent_failures_poison_after_max_attempts_and_only_the_insert_commit_resolves() {
    let (mut core, mut now) = core_at(50);
    let a = tx(&mut core, 100, 1, now)[0];
    assert_eq!(work(&mut core), vec![Action::Produce { id: a, attempt: 1 }]);
    // Retried after a backoff, never at once (no hot loop on a refusing broker).
    for (attempt, delay) in [(2, 100), (3, 200)] {
        core.delivery_failed(a, Failure::Permanent, now);
        assert!(work(&mut core).is_empty(), "no immediate retry");
        now += ms(delay);
        core.tick(now);
        assert_eq!(work(&mut core), vec![Action::Produce { id: a, attempt }]);
    }
    core.delivery_failed(a, Failure::Permanent, now);
    assert_eq!(
        work(&mut core),
        vec![Action::InsertPoison { id: a, attempts: 3 }]
    );
    assert_eq!(
        core.confirmed(),
        Lsn(50),
        "InsertPoison emitted is not resolved"
    );
    assert_eq!(core.in_flight_events(), 1);
    core.delivered(a, now);
    core.delivery_failed(a, Failure::Permanent, now);
    assert_eq!(
        core.confirmed(),
        Lsn(50),
        "stale broker reports do not resolve it"
    );
    assert!(work(&mut core).is_empty());
    core.poison_committed(a, now);
    assert_eq!(core.confirmed(), Lsn(110));
    assert_eq!(core.in_flight_events(), 0);
}

#[test]
fn a_refused_event_is_poisoned_at_once_and_holds_its_key() {
    let (mut core, now) = core_at(50);
    core.begin(Lsn(100), 1).unwrap();
    let big = core.admit_keyed(10, Some(7), now).unwrap();
    let next = core.admit_keyed(10, Some(7), now).unwrap();
    core.commit(Lsn(100), Lsn(110), now).unwrap();
    assert_eq!(work(&mut core).len(), 2);
    core.refuse(big, now);
    assert_eq!(
        work(&mut core),
        vec![Action::InsertPoison {
            id: big,
            attempts: 1
        }]
    );
    core.delivered(next, now);
    core.poison_committed(big, now);
    assert_eq!(core.confirmed(), Lsn(110));
    core.refuse(big, now);
    assert!(
        work(&mut core).is_empty(),
        "a resolved event is not refused again"
    );
}

#[test]
fn a_parked_event_is_resolved_by_its_insert_or_produced_when_its_key_was_released() {
    let (mut core, now) = core_at(50);
    core.begin(Lsn(100), 1).unwrap();
    let a = core.admit_keyed(10, Some(7), now).unwrap();
    let b = core.admit_keyed(10, Some(7), now).unwrap();
    core.commit(Lsn(100), Lsn(110), now).unwrap();
    assert_eq!(work(&mut core).len(), 2);
    core.park(a, now);
    core.park(b, now);
    assert_eq!(
        work(&mut core),
        vec![
            Action::InsertPoison { id: a, attempts: 1 },
            Action::InsertPoison { id: b, attempts: 1 }
        ]
    );
    core.poison_committed(a, now);
    assert_eq!(core.confirmed(), Lsn(50), "b is not resolved yet");
    // b's key was released by replay meanwhile: b is produced, its first produce.
    core.unpark(b, now);
    assert_eq!(work(&mut core), vec![Action::Produce { id: b, attempt: 1 }]);
    core.poison_committed(b, now);
    assert_eq!(core.confirmed(), Lsn(50), "b now waits for its ack");
    core.delivered(b, now);
    assert_eq!(core.confirmed(), Lsn(110));
}

#[test]
fn only_a_first_produce_can_be_parked() {
    let (mut core, now) = core_at(50);
    core.begin(Lsn(100), 1).unwrap();
    let a = core.admit_keyed(10, Some(7), now).unwrap();
    core.commit(Lsn(100), Lsn(110), now).unwrap();
    work(&mut core);
    core.delivery_failed(a, Failure::Transient, now);
    core.tick(now + ms(200));
    assert_eq!(work(&mut core), vec![Action::Produce { id: a, attempt: 2 }]);
    core.park(a, now);
    assert!(
        work(&mut core).is_empty(),
        "a produced event is not taken back"
    );
    core.delivered(a, now);
    assert_eq!(core.confirmed(), Lsn(110));
}

#[test]
fn a_halted_event_stops_the_watermark_and_holds_its_key_only() {
    let (mut core, now) = core_at(50);
    core.begin(Lsn(100), 1).unwrap();
    let bad = core.admit_keyed(10, Some(7), now).unwrap();
    core.commit(Lsn(100), Lsn(110), now).unwrap();
    work(&mut core);
    core.refuse(bad, now);
    assert_eq!(
        work(&mut core),
        vec![Action::InsertPoison {
            id: bad,
            attempts: 1
        }]
    );
    core.halt(bad, now);
    assert_eq!(core.halted_events(), 1);
    assert_eq!(core.resolvable_events(), 0);
    core.begin(Lsn(200), 2).unwrap();
    let same_key = core.admit_keyed(10, Some(7), now).unwrap();
    let other = core.admit_keyed(10, Some(8), now).unwrap();
    core.commit(Lsn(200), Lsn(210), now).unwrap();
    assert_eq!(
        work(&mut core),
        vec![Action::Produce {
            id: other,
            attempt: 1
        }],
        "the halted key's later event is held, the other key flows"
    );
    assert_eq!(core.resolvable_events(), 1, "only the other key's event");
    core.delivered(other, now);
    assert_eq!(
        core.resolvable_events(),
        0,
        "same_key waits behind the halted one"
    );
    core.tick(now + Duration::from_secs(3600));
    assert!(work(&mut core).is_empty());
    assert_eq!(
        core.confirmed(),
        Lsn(50),
        "nothing confirms past the halted event"
    );
    assert!(core.is_in_flight(same_key) && core.is_in_flight(bad));
    core.poison_committed(bad, now);
    assert!(
        core.is_in_flight(bad),
        "a halted event is not resolved by a stray report"
    );
}

#[test]
fn a_send_refused_at_once_keeps_the_later_events_of_its_key_queued_with_it_waiting() {
    // Two events of one key, their produces queued together: the producer refuses
    // the first at once (a full queue, a topic it knows to be missing), and the
    // second must not go out before the first one's retry.
    let (mut core, now) = core_at(50);
    core.begin(Lsn(100), 7).unwrap();
    let first = core.admit_keyed(10, Some(1), now).unwrap();
    let second = core.admit_keyed(10, Some(1), now).unwrap();
    let other = core.admit_keyed(10, Some(2), now).unwrap();
    core.commit(Lsn(100), Lsn(110), now).unwrap();
    assert_eq!(
        core.next_action(),
        Some(Action::Produce {
            id: first,
            attempt: 1
        })
    );
    core.delivery_failed(first, Failure::Transient, now);
    assert_eq!(
        work(&mut core),
        vec![Action::Produce {
            id: other,
            attempt: 1
        }],
        "the later event of the refused one's key waits, the other key flows"
    );
    core.tick(now + ms(200));
    assert_eq!(
        work(&mut core),
        vec![Action::Produce {
            id: first,
            attempt: 2
        }]
    );
    core.delivered(first, now + ms(201));
    assert_eq!(
        work(&mut core),
        vec![Action::Produce {
            id: second,
            attempt: 2
        }],
        "retried once the refused event is delivered, as a waiting event is"
    );
}

#[test]
fn unmappable_rows_go_straight_to_poison() {
    let (mut core, now) = core_at(50);
    core.begin(Lsn(100), 1).unwrap();
    let a = core.admit_unmappable(30).unwrap();
    core.commit(Lsn(100), Lsn(110), now).unwrap();
    assert_eq!(
        work(&mut core),
        vec![Action::InsertPoison { id: a, attempts: 1 }]
    );
    assert_eq!((core.in_flight_events(), core.in_flight_bytes()), (1, 30));
    core.delivered(a, now);
    assert_eq!(core.confirmed(), Lsn(50));
    core.poison_committed(a, now);
    assert_eq!(core.confirmed(), Lsn(110));
}

#[test]
fn transient_failures_back_off_exponentially_and_never_poison() {
    let mut c = cfg();
    c.max_attempts = 2;
    c.status_interval = Duration::from_secs(3_600);
    let mut now = Instant::now();
    let mut core = Core::new(c, Lsn(50), now);
    let a = tx(&mut core, 100, 1, now)[0];
    assert_eq!(work(&mut core).len(), 1);
    core.delivery_failed(a, Failure::Permanent, now);
    assert!(
        work(&mut core).is_empty(),
        "a permanent failure backs off too"
    );
    now += ms(100);
    core.tick(now);
    assert_eq!(work(&mut core), vec![Action::Produce { id: a, attempt: 2 }]);
    let expected = [100, 200, 400, 800, 1_000, 1_000, 1_000, 1_000];
    for (n, delay) in expected.into_iter().enumerate() {
        core.delivery_failed(a, Failure::Transient, now);
        assert!(work(&mut core).is_empty(), "no immediate retry");
        assert_eq!(core.next_deadline(), Some(now + ms(delay)));
        core.tick(now + ms(delay - 1));
        assert!(work(&mut core).is_empty(), "not before the deadline");
        now += ms(delay);
        core.tick(now);
        let attempt = 3 + u32::try_from(n).unwrap();
        assert_eq!(work(&mut core), vec![Action::Produce { id: a, attempt }]);
    }
    assert_eq!(core.confirmed(), Lsn(50), "still pending, never poisoned");
    core.delivery_failed(a, Failure::Permanent, now);
    assert_eq!(
        work(&mut core),
        vec![Action::InsertPoison {
            id: a,
            attempts: 10
        }],
        "the second permanent failure poisons; transient ones did not count"
    );
}

#[test]
fn a_failed_poison_insert_is_requested_again_after_backoff() {
    let (mut core, now) = core_at(50);
    core.begin(Lsn(100), 1).unwrap();
    let a = core.admit_unmappable(30).unwrap();
    core.commit(Lsn(100), Lsn(110), now).unwrap();
    assert_eq!(work(&mut core).len(), 1);
    core.poison_insert_failed(a, now);
    core.poison_committed(a, now);
    assert_eq!(core.confirmed(), Lsn(50), "not outstanding: ignored");
    core.tick(now + ms(100));
    assert_eq!(
        work(&mut core),
        vec![Action::InsertPoison { id: a, attempts: 1 }]
    );
    core.poison_committed(a, now + ms(100));
    assert_eq!(core.confirmed(), Lsn(110));
}

#[test]
fn idle_advance_from_keepalive_and_xlogdata() {
    let (mut core, now) = core_at(50);
    core.keepalive(Lsn(500), false, now);
    assert_eq!(core.confirmed(), Lsn(500));
    core.received(Lsn(600));
    assert_eq!(core.confirmed(), Lsn(600));
    core.keepalive(Lsn(400), false, now);
    assert_eq!(core.confirmed(), Lsn(600), "never backwards");
    // Keepalive progress alone is saved once per status interval (so the save's own
    // WAL cannot keep an idle relay saving), and confirmed once saved.
    core.keepalive(Lsn(700), true, now);
    let s = statuses(&drain(&mut core));
    assert_eq!(
        (s[0].flush, s[0].write),
        (Lsn(50), Lsn(700)),
        "not saved yet"
    );
    core.keepalive(Lsn(700), true, now + cfg().status_interval);
    let s = statuses(&drain(&mut core));
    assert_eq!(s.len(), 1);
    assert_eq!((s[0].flush, s[0].write), (Lsn(700), Lsn(700)));
    let a = tx(&mut core, 800, 1, now)[0];
    core.delivered(a, now);
    core.keepalive(Lsn(900), false, now);
    assert_eq!(
        core.confirmed(),
        Lsn(900),
        "idle again once everything resolved"
    );
}

#[test]
fn no_idle_advance_while_a_transaction_is_open_or_an_event_is_pending() {
    let (mut core, now) = core_at(50);
    core.begin(Lsn(1_000), 1).unwrap();
    core.keepalive(Lsn(900), false, now);
    assert_eq!(core.confirmed(), Lsn(50), "empty open transaction");
    let a = core.admit(10, now).unwrap();
    // The XLogData carrying this Commit has wal_end = end_lsn, fed before commit().
    core.received(Lsn(1_010));
    assert_eq!(core.confirmed(), Lsn(50), "open transaction");
    core.commit(Lsn(1_000), Lsn(1_010), now).unwrap();
    core.keepalive(Lsn(2_000), false, now);
    core.received(Lsn(2_100));
    assert_eq!(core.confirmed(), Lsn(50), "pending event");
    core.delivered(a, now);
    assert_eq!(core.confirmed(), Lsn(1_010));
    core.keepalive(Lsn(2_000), false, now);
    assert_eq!(core.confirmed(), Lsn(2_000));
    assert_eq!(core.written(), Lsn(2_100));
}

#[test]
fn reply_requested_gets_a_status_even_when_the_window_is_full() {
    let mut c = cfg();
    c.max_in_flight_events = 1;
    let mut now = Instant::now();
    let mut core = Core::new(c, Lsn(50), now);
    core.begin(Lsn(100), 1).unwrap();
    let a = core.admit(10, now).unwrap();
    assert!(!core.can_read());
    core.keepalive(Lsn(120), true, now);
    let actions = drain(&mut core);
    assert!(
        matches!(actions[0], Action::SendStatus(s) if s.flush == Lsn(50) && s.write == Lsn(120)),
        "status first: {actions:?}"
    );
    assert_eq!(actions[1], Action::Produce { id: a, attempt: 1 });
    // The interval timer fires while the reader stays paused.
    now += Duration::from_secs(10);
    assert_eq!(core.next_deadline(), Some(now));
    core.tick(now);
    assert!(!core.can_read());
    assert_eq!(statuses(&drain(&mut core)).len(), 1);
}

#[test]
fn a_window_of_resolved_events_forces_a_status_at_once() {
    // cfg(): window 4, progress interval 1 s. Four single-event transactions
    // acked within a millisecond: the fourth forces a status without waiting,
    // so the server never trails the acks by more than a window.
    let (mut core, t0) = core_at(50);
    let mut sent = Vec::new();
    for i in 0..4_u64 {
        let now = t0 + Duration::from_micros(i + 1);
        let id = tx(&mut core, 100 + i * 20, 1, now)[0];
        core.delivered(id, now);
        if core.next_deadline().is_some_and(|d| d <= now) {
            core.tick(now);
        }
        sent.extend(statuses(&drain(&mut core)));
    }
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(sent[0].flush, core.confirmed());
}

#[test]
fn status_interval_and_progress_statuses_are_rate_limited() {
    let t0 = Instant::now();
    // A window larger than the run, so only the time rule applies.
    let c = CoreConfig {
        max_in_flight_events: 100_000,
        ..cfg()
    };
    let mut core = Core::new(c, Lsn(50), t0);
    core.tick(t0 + ms(9_999));
    assert!(drain(&mut core).is_empty(), "nothing before the interval");
    core.tick(t0 + ms(10_000));
    assert_eq!(statuses(&drain(&mut core)).len(), 1);
    let start = t0 + ms(10_000);
    // 1,500 transactions confirmed one per millisecond: one status per
    // interval/10 (1 s), never one per event.
    let mut sent = Vec::new();
    for i in 0..1_500_u64 {
        let now = start + ms(i + 1);
        let id = tx(&mut core, 100 + i * 20, 1, now)[0];
        core.delivered(id, now);
        if core.next_deadline().is_some_and(|d| d <= now) {
            core.tick(now);
        }
        sent.extend(statuses(&drain(&mut core)));
    }
    assert_eq!(sent.len(), 1, "one progress status at +1 s: {sent:?}");
    assert!(sent[0].flush > Lsn(50));
    // The remaining progress is reported interval/10 after that one.
    let last = start + ms(1_000);
    assert_eq!(core.next_deadline(), Some(last + ms(1_000)));
    core.tick(last + ms(1_000));
    let s = statuses(&drain(&mut core));
    assert_eq!(s.len(), 1);
    assert_eq!(s[0].flush, core.confirmed());
    assert_eq!(core.confirmed(), Lsn(100 + 1_499 * 20 + 10));
    // Nothing new: back to the full interval.
    assert_eq!(core.next_deadline(), Some(last + ms(11_000)));
}

#[test]
fn status_flush_is_monotonic_and_write_never_below_flush() {
    let (mut core, now) = core_at(500);
    let first = core.shutdown_status();
    assert_eq!(
        first,
        StatusUpdate {
            write: Lsn(500),
            flush: Lsn(500),
            apply: Lsn(500),
            reply_requested: false
        }
    );
    core.keepalive(Lsn(900), true, now + cfg().status_interval);
    let s = statuses(&drain(&mut core))[0];
    assert_eq!((s.write, s.flush, s.apply), (Lsn(900), Lsn(900), Lsn(900)));
    // A reconnect whose slot is behind (its position was not yet persisted) does not
    // make the statuses go back: what this process confirmed stays confirmed.
    let mut core = core.restart(Lsn(600), now);
    assert_eq!(core.confirmed(), Lsn(900));
    let again = core.shutdown_status();
    assert!(again.flush >= s.flush && again.write >= again.flush);
}

#[test]
fn window_counts_events_and_bytes() {
    let mut c = cfg();
    c.max_in_flight_events = 3;
    c.max_in_flight_bytes = 100;
    let now = Instant::now();
    let mut core = Core::new(c, Lsn(50), now);
    core.begin(Lsn(100), 1).unwrap();
    let a = core.admit(50, now).unwrap();
    assert!(core.can_read());
    core.admit(50, now).unwrap();
    assert!(!core.can_read(), "bytes full");
    assert_eq!(
        core.admit(1, now),
        Err(ProtocolError::WindowFull {
            events: 2,
            bytes: 100
        })
    );
    assert_eq!(
        core.admit_unmappable(1).map(|_| ()),
        core.admit(1, now).map(|_| ())
    );
    core.delivered(a, now);
    assert!(core.can_read());
    core.admit(1, now).unwrap();
    assert!(core.can_read());
    core.admit_unmappable(1).unwrap();
    assert!(!core.can_read(), "events full");
    assert_eq!((core.in_flight_events(), core.in_flight_bytes()), (3, 52));
    core.check_invariants();
}

#[test]
fn an_event_larger_than_the_byte_window_is_admitted_into_an_empty_window() {
    let (mut core, now) = core_at(50);
    core.begin(Lsn(100), 1).unwrap();
    let big = core.admit(1_000_000, now).unwrap();
    assert!(!core.can_read());
    core.delivered(big, now);
    assert!(core.can_read());
    core.commit(Lsn(100), Lsn(110), now).unwrap();
    assert_eq!(core.confirmed(), Lsn(110));
}

#[test]
fn protocol_errors_are_typed_and_leave_the_state_usable() {
    let (mut core, now) = core_at(50);
    assert_eq!(
        core.commit(Lsn(100), Lsn(110), now),
        Err(ProtocolError::CommitWithoutBegin {
            commit_lsn: Lsn(100),
            end_lsn: Lsn(110)
        })
    );
    assert_eq!(
        core.admit(1, now),
        Err(ProtocolError::ChangeOutsideTransaction)
    );
    assert_eq!(
        core.admit_unmappable(1),
        Err(ProtocolError::ChangeOutsideTransaction)
    );
    core.begin(Lsn(100), 1).unwrap();
    assert_eq!(
        core.begin(Lsn(200), 2),
        Err(ProtocolError::BeginInsideTransaction {
            open_xid: 1,
            open_final_lsn: Lsn(100),
            xid: 2,
            final_lsn: Lsn(200)
        })
    );
    let a = core.admit(1, now).unwrap();
    assert_eq!(
        core.commit(Lsn(101), Lsn(110), now),
        Err(ProtocolError::CommitLsnMismatch {
            xid: 1,
            final_lsn: Lsn(100),
            commit_lsn: Lsn(101)
        })
    );
    assert_eq!(
        core.commit(Lsn(100), Lsn(100), now),
        Err(ProtocolError::CommitEndNotAfterCommit {
            xid: 1,
            commit_lsn: Lsn(100),
            end_lsn: Lsn(100)
        })
    );
    core.check_invariants();
    core.commit(Lsn(100), Lsn(110), now).unwrap();
    assert_eq!(
        core.begin(Lsn(105), 3),
        Err(ProtocolError::CommitLsnWentBackwards {
            xid: 3,
            final_lsn: Lsn(105),
            previous_end: Lsn(110)
        })
    );
    assert!(!core.in_transaction());
    core.delivered(a, now);
    assert_eq!(core.confirmed(), Lsn(110));
    // Messages are readable.
    let msg = ProtocolError::CommitLsnMismatch {
        xid: 1,
        final_lsn: Lsn(0x16_B374_D848),
        commit_lsn: Lsn(1),
    }
    .to_string();
    assert!(msg.contains("16/B374D848"), "{msg}");
}

#[test]
fn unknown_and_duplicate_reports_are_ignored() {
    let (mut core, now) = core_at(50);
    let ids = tx(&mut core, 100, 2, now);
    let (a, b) = (ids[0], ids[1]);
    core.delivered(a, now);
    // A duplicate ack for `a` must not resolve `b`'s slot in the count.
    core.delivered(a, now);
    core.delivery_failed(a, Failure::Permanent, now);
    core.poison_committed(a, now);
    core.poison_insert_failed(a, now);
    for bogus in [EventId::from_raw(0), EventId::from_raw(u64::MAX)] {
        core.delivered(bogus, now);
        core.delivery_failed(bogus, Failure::Transient, now);
        core.poison_committed(bogus, now);
    }
    assert_eq!(core.confirmed(), Lsn(50));
    assert_eq!(core.in_flight_events(), 1);
    // `b` waits for a retry: a report now matches no outstanding produce.
    core.delivery_failed(b, Failure::Transient, now);
    core.delivered(b, now);
    core.delivery_failed(b, Failure::Transient, now);
    assert_eq!(core.confirmed(), Lsn(50));
    core.check_invariants();
    core.tick(now + ms(100));
    assert_eq!(
        work(&mut core),
        vec![Action::Produce { id: b, attempt: 2 }],
        "requests made stale by later reports are skipped"
    );
    core.delivered(b, now + ms(100));
    assert_eq!(core.confirmed(), Lsn(110));
}

#[test]
fn restart_continues_event_ids_so_late_reports_are_ignored() {
    let (mut core, now) = core_at(50);
    let done = tx(&mut core, 100, 1, now)[0];
    core.delivered(done, now);
    core.begin(Lsn(200), 2).unwrap();
    let old = core.admit(10, now).unwrap();
    let mut core = core.restart(Lsn(50), now);
    assert_eq!(
        core.confirmed(),
        Lsn(110),
        "what was confirmed stays confirmed"
    );
    assert!(core.is_idle());
    core.begin(Lsn(200), 2).unwrap();
    let new = core.admit(10, now).unwrap();
    assert!(new > old);
    core.commit(Lsn(200), Lsn(210), now).unwrap();
    core.delivered(old, now);
    assert_eq!(
        core.confirmed(),
        Lsn(110),
        "the old core's ack is not the new event's"
    );
    core.delivered(new, now);
    assert_eq!(core.confirmed(), Lsn(210));
}

#[test]
fn next_deadline_is_the_earliest_timer() {
    let (mut core, t0) = core_at(50);
    assert_eq!(core.next_deadline(), Some(t0 + Duration::from_secs(10)));
    let a = tx(&mut core, 100, 1, t0)[0];
    core.delivery_failed(a, Failure::Transient, t0 + ms(5));
    assert_eq!(core.next_deadline(), Some(t0 + ms(105)));
    core.tick(t0 + ms(105));
    assert_eq!(core.next_deadline(), Some(t0 + Duration::from_secs(10)));
    core.keepalive(Lsn(60), true, t0 + ms(200));
    assert_eq!(core.next_deadline(), None, "a status is due: drain first");
    drain(&mut core);
    assert_eq!(core.next_deadline(), Some(t0 + ms(10_200)));
}

#[test]
fn degenerate_config_is_normalised_without_deadlock() {
    let now = Instant::now();
    let zero = CoreConfig {
        max_in_flight_events: 0,
        max_in_flight_bytes: 0,
        max_attempts: 0,
        status_interval: Duration::ZERO,
        progress_status_interval: Duration::ZERO,
        retry_backoff_initial: Duration::MAX,
        retry_backoff_max: Duration::MAX,
        transactions: None,
    };
    let mut core = Core::new(zero, Lsn(50), now);
    assert!(core.can_read());
    assert!(core.next_deadline().is_some_and(|d| d > now));
    core.begin(Lsn(100), 1).unwrap();
    let a = core.admit(5, now).unwrap();
    assert!(!core.can_read());
    core.delivery_failed(a, Failure::Transient, now);
    assert_eq!(
        core.next_deadline(),
        Some(now + ms(1)),
        "status timer first"
    );
    core.delivery_failed(a, Failure::Permanent, now);
    core.tick(now + MAX_TIMER);
    let w = work(&mut core);
    assert_eq!(w, vec![Action::Produce { id: a, attempt: 2 }]);
    core.delivery_failed(a, Failure::Permanent, now);
    assert_eq!(
        work(&mut core),
        vec![Action::InsertPoison { id: a, attempts: 2 }]
    );
    assert_eq!(
        Core::new(CoreConfig::default(), Lsn(1), now)
            .config()
            .max_attempts,
        5
    );
}

/// Arbitrary (mostly invalid) call sequences: never a panic, invariants hold.
mod arbitrary {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Begin(u64, u32),
        Admit(usize, Option<u64>),
        Unmappable(usize),
        Commit(u64, u64),
        CommitOpen(u64),
        Delivered(u64),
        Failed(u64, bool),
        PoisonCommitted(u64),
        PoisonFailed(u64),
        Park(u64),
        Unpark(u64),
        Halt(u64),
        Keepalive(u64, bool),
        Received(u64),
        Tick(u64),
        Drain,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..10_000_u64, any::<u32>()).prop_map(|(l, x)| Op::Begin(l, x)),
            (0..300_usize, proptest::option::of(0..3_u64)).prop_map(|(b, k)| Op::Admit(b, k)),
            (0..300_usize).prop_map(Op::Unmappable),
            (0..10_000_u64, 0..10_000_u64).prop_map(|(a, b)| Op::Commit(a, b)),
            (1..100_u64).prop_map(Op::CommitOpen),
            (0..24_u64).prop_map(Op::Delivered),
            (0..24_u64, any::<bool>()).prop_map(|(i, p)| Op::Failed(i, p)),
            (0..24_u64).prop_map(Op::PoisonCommitted),
            (0..24_u64).prop_map(Op::PoisonFailed),
            (0..24_u64).prop_map(Op::Park),
            (0..24_u64).prop_map(Op::Unpark),
            (0..24_u64).prop_map(Op::Halt),
            (0..20_000_u64, any::<bool>()).prop_map(|(l, r)| Op::Keepalive(l, r)),
            (0..20_000_u64).prop_map(Op::Received),
            (0..2_000_u64).prop_map(Op::Tick),
            Just(Op::Drain),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn arbitrary_calls_never_panic_and_keep_invariants(
            ops in proptest::collection::vec(op(), 0..200)
        ) {
            let t0 = Instant::now();
            let mut now = t0;
            let c = CoreConfig {
                max_in_flight_events: 3,
                max_in_flight_bytes: 500,
                max_attempts: 2,
                status_interval: Duration::from_millis(500),
                progress_status_interval: Duration::from_millis(50),
                retry_backoff_initial: Duration::from_millis(10),
                retry_backoff_max: Duration::from_millis(80),
                transactions: None,
            };
            let mut core = Core::new(c, Lsn(100), now);
            let mut open_final: Option<u64> = None;
            let mut last_flush = Lsn(100);
            let mut last_confirmed = core.confirmed();
            for op in ops {
                match op {
                    Op::Begin(l, x) => {
                        if core.begin(Lsn(l), x).is_ok() {
                            open_final = Some(l);
                        }
                    }
                    Op::Admit(b, k) => { let _ = core.admit_keyed(b, k, now); }
                    Op::Unmappable(b) => { let _ = core.admit_unmappable(b); }
                    Op::Commit(a, b) => {
                        if core.commit(Lsn(a), Lsn(b), now).is_ok() {
                            open_final = None;
                        }
                    }
                    Op::CommitOpen(d) => {
                        if let Some(f) = open_final.take() {
                            prop_assert!(core.commit(Lsn(f), Lsn(f + d), now).is_ok());
                        }
                    }
                    Op::Delivered(i) => core.delivered(EventId::from_raw(i), now),
                    Op::Failed(i, p) => {
                        let f = if p { Failure::Permanent } else { Failure::Transient };
                        core.delivery_failed(EventId::from_raw(i), f, now);
                    }
                    Op::PoisonCommitted(i) => core.poison_committed(EventId::from_raw(i), now),
                    Op::PoisonFailed(i) => core.poison_insert_failed(EventId::from_raw(i), now),
                    Op::Park(i) => core.park(EventId::from_raw(i), now),
                    Op::Unpark(i) => core.unpark(EventId::from_raw(i), now),
                    Op::Halt(i) => core.halt(EventId::from_raw(i), now),
                    Op::Keepalive(l, r) => core.keepalive(Lsn(l), r, now),
                    Op::Received(l) => core.received(Lsn(l)),
                    Op::Tick(d) => {
                        now += Duration::from_millis(d);
                        core.tick(now);
                        prop_assert!(core.next_deadline().is_none_or(|d| d > now));
                    }
                    Op::Drain => {
                        while let Some(a) = core.next_action() {
                            if let Action::SendStatus(s) = a {
                                prop_assert!(s.flush >= last_flush);
                                prop_assert!(s.write >= s.flush && s.apply == s.flush);
                                last_flush = s.flush;
                            }
                        }
                    }
                }
                core.check_invariants();
                prop_assert!(core.confirmed() >= last_confirmed);
                last_confirmed = core.confirmed();
                prop_assert_eq!(core.in_transaction(), open_final.is_some());
            }
        }
    }
}

/// Drains without saving: the saves asked for, and the statuses sent.
fn drain_unsaved(core: &mut Core) -> (Vec<Lsn>, Vec<StatusUpdate>) {
    let (mut saves, mut statuses) = (Vec::new(), Vec::new());
    while let Some(a) = core.next_action() {
        match a {
            Action::Save { lsn, .. } => saves.push(lsn),
            Action::SendStatus(s) => statuses.push(s),
            _ => {}
        }
    }
    core.check_invariants();
    (saves, statuses)
}

#[test]
fn statuses_never_confirm_past_the_saved_position() {
    let (mut core, now) = core_at(50);
    let ids = tx(&mut core, 100, 1, now);
    core.delivered(ids[0], now);
    core.tick(now + ms(1_000));
    let (saves, statuses) = drain_unsaved(&mut core);
    assert_eq!(saves, [Lsn(110)], "the watermark is saved first");
    assert!(statuses.iter().all(|s| s.flush == Lsn(50)), "{statuses:?}");
    core.saved(Lsn(110), now + ms(1_010));
    let (_, statuses) = drain_unsaved(&mut core);
    assert_eq!(
        statuses.last().map(|s| s.flush),
        Some(Lsn(110)),
        "a status follows the save at once"
    );
}

#[test]
fn a_healthy_servers_57p_errors_do_not_let_statuses_pass_the_saved_position() {
    // pg_terminate_backend of the saver (57P01 on its statement), a crash of another
    // backend (57P02), a refused connection without a code: the server is not stopping.
    let failures = [
        (SavePhase::Statement, Some("57P01")),
        (SavePhase::Statement, Some("57P02")),
        (SavePhase::Statement, Some("57P03")),
        (SavePhase::Connecting, Some("57P01")),
        (SavePhase::Connecting, None),
        (SavePhase::Statement, None),
    ];
    for (phase, sqlstate) in failures {
        let (mut core, now) = core_at(50);
        let ids = tx(&mut core, 100, 1, now);
        core.delivered(ids[0], now);
        core.save_failed(phase, sqlstate);
        core.tick(now + cfg().status_interval);
        let (_, statuses) = drain_unsaved(&mut core);
        assert!(!core.server_stopping(), "{phase:?} {sqlstate:?}");
        assert!(!statuses.is_empty(), "a status is due");
        assert!(
            statuses.iter().all(|s| s.flush <= core.saved_position()),
            "{phase:?} {sqlstate:?}: {statuses:?}"
        );
    }
}

#[test]
fn a_connection_refused_during_shutdown_ends_the_session_and_confirms_nothing_unsaved() {
    let (mut core, now) = core_at(50);
    let ids = tx(&mut core, 100, 1, now);
    core.delivered(ids[0], now);
    core.save_failed(SavePhase::Connecting, Some("57P03"));
    assert!(
        core.server_stopping(),
        "the shell must close the connection"
    );
    core.tick(now + ms(1_000));
    let (_, statuses) = drain_unsaved(&mut core);
    assert!(
        statuses.iter().all(|s| s.flush == Lsn(50)),
        "not saved, not confirmed: {statuses:?}"
    );
    // The next session starts from what was saved or remembered, and saves it.
    let core = core.restart(Lsn(110), now);
    assert!(!core.server_stopping());
    assert_eq!(core.saved_position(), Lsn(110));
}

#[test]
fn reading_pauses_between_transactions_while_a_window_waits_for_a_save() {
    let (mut core, now) = core_at(50);
    for n in 0..4_u64 {
        let ids = tx(&mut core, 100 + 20 * n, 1, now);
        core.delivered(ids[0], now);
    }
    assert_eq!(core.unsaved_events(), 4);
    core.tick(now + ms(1_000));
    let (saves, _) = drain_unsaved(&mut core);
    assert!(
        !core.can_read(),
        "a window of resolved events waits for a save"
    );
    core.saved(*saves.last().unwrap(), now + ms(30));
    assert_eq!(core.unsaved_events(), 0);
    assert!(core.can_read());
}

#[test]
fn a_reconnect_does_not_produce_what_the_lost_session_resolved() {
    let (mut core, now) = core_at(50);
    core.begin(Lsn(100), 7).unwrap();
    let first: Vec<_> = (0..4).map(|_| core.admit(10, now).unwrap()).collect();
    work(&mut core);
    core.delivered(first[0], now);
    core.delivered(first[1], now);
    // Lost mid-transaction with events 2 and 3 unresolved.
    let mut core = core.restart(Lsn(50), now);
    core.begin(Lsn(100), 7).unwrap();
    let second: Vec<_> = (0..2).map(|_| core.admit(10, now).unwrap()).collect();
    assert!(
        second.iter().all(|&id| core.origin(id).is_none()),
        "resolved before"
    );
    assert!(work(&mut core).is_empty(), "nothing produced again");
    // Lost again before reaching 2 and 3: they must still be produced.
    let mut core = core.restart(Lsn(50), now);
    core.begin(Lsn(100), 7).unwrap();
    let third: Vec<_> = (0..4).map(|_| core.admit(10, now).unwrap()).collect();
    let produced: Vec<_> = work(&mut core)
        .into_iter()
        .filter_map(|a| match a {
            Action::Produce { id, .. } => Some(id),
            _ => None,
        })
        .collect();
    assert_eq!(produced, third[2..].to_vec());
}

#[test]
fn failed_events_of_one_key_are_retried_oldest_first_and_never_past_a_halted_one() {
    let (mut core, now) = core_at(50);
    core.begin(Lsn(100), 7).unwrap();
    let a = core.admit_keyed(10, Some(1), now).unwrap();
    let b = core.admit_keyed(10, Some(1), now).unwrap();
    core.commit(Lsn(100), Lsn(110), now).unwrap();
    work(&mut core);
    // Both were produced before the first failure was reported; both fail.
    core.delivery_failed(a, Failure::Permanent, now);
    core.delivery_failed(b, Failure::Transient, now);
    core.tick(now + ms(1_000));
    let retried: Vec<EventId> = work(&mut core)
        .into_iter()
        .filter_map(|action| match action {
            Action::Produce { id, .. } => Some(id),
            _ => None,
        })
        .collect();
    assert_eq!(retried, [a], "b waits for a's retry to resolve");
    // a fails for good and is halted (relay.on_poison = "halt"): b is never produced.
    core.delivery_failed(a, Failure::Permanent, now + ms(1_000));
    core.tick(now + ms(3_000));
    core.delivery_failed(a, Failure::Permanent, now + ms(3_000));
    assert_eq!(
        work(&mut core),
        vec![Action::InsertPoison { id: a, attempts: 3 }]
    );
    core.halt(a, now + ms(3_000));
    core.tick(now + ms(10_000));
    assert!(
        work(&mut core).is_empty(),
        "nothing of key 1 past a halted event"
    );
    assert_eq!(core.resolvable_events(), 0);
}
