//! Faults injected on purpose, armed through the control listener
//! (`dev-broker --control HOST:PORT`), so that tests can see what a client does
//! when a real cluster misbehaves during a rolling restart, a leader move, a
//! coordinator failover or a stall.
//!
//! # The control protocol
//!
//! Plain text over TCP, one command a line, one reply line a command: `ok`, maybe
//! followed by detail, or `error <why>`. A connection may send several commands.
//! ERROR is a Kafka error name in UPPER_SNAKE (`NOT_LEADER_OR_FOLLOWER`) or a
//! non-zero numeric code; a count defaults to 1.
//!
//! | command | effect |
//! | --- | --- |
//! | `fail-produce <topic> <partition\|*> <ERROR> [count]` | the next `count` Produce requests touching that partition (any partition of the topic for `*`) answer it with ERROR; nothing is appended there |
//! | `delay-acks <ms>` | every Produce response is written `ms` later (0: off) |
//! | `drop-acks <count>` | the next `count` Produce requests (acks ≠ 0) are appended but never answered (0: off) |
//! | `stall <ms>` | no request is read or answered on any broker connection for `ms` (0: ends a stall) |
//! | `abort-transactions` | the coordinator aborts every open transaction as its timeout would; replies `ok <n> aborted` |
//! | `coordinator-error <ERROR> [count]` | the next `count` transaction-coordinator requests answer ERROR without changing state |
//! | `end-txn-error <ERROR> [count]` | the next `count` EndTxn requests answer ERROR without changing state |
//! | `reset` | clears every pending fault (and ends a stall) |
//!
//! Every fault is logged at info when armed and when it fires.
//!
//! # Why each exists, and what librdkafka does with it
//!
//! The client behaviour is librdkafka 2.12's (the version rust-rdkafka bundles):
//! `rd_kafka_handle_Produce_error` and `rd_kafka_err_action` in
//! `rdkafka_request.c`, `rd_kafka_handle_idempotent_Produce_error` in the same
//! file, the `rd_kafka_txn_handle_*` response handlers in `rdkafka_txnmgr.c`,
//! `rd_kafka_idemp_request_pid_failed`/`rd_kafka_idemp_check_error` in
//! `rdkafka_idempotence.c`, and `rd_kafka_broker_timeout_scan` in
//! `rdkafka_broker.c`. *Retriable* means the client retries by itself and the
//! application sees nothing; *permanent* means the message's delivery report
//! carries the error (an idempotent producer then bumps its epoch, KIP-360, and
//! carries on); *abortable* means a transactional producer must
//! `abort_transaction()` and may go on; *fatal* means the producer is unusable and
//! must be recreated.
//!
//! - `fail-produce` imitates a partition whose leader moved or is restarting
//!   (`NOT_LEADER_OR_FOLLOWER`, `UNKNOWN_TOPIC_OR_PARTITION`: metadata refresh,
//!   then retry, *retriable*), a shrunk ISR (`NOT_ENOUGH_REPLICAS`: *retriable*),
//!   a replication timeout (`REQUEST_TIMED_OUT`: *retriable*, possibly persisted),
//!   a damaged request (`CORRUPT_MESSAGE`: *retriable*), and the refusals a broker
//!   gives for good (`MESSAGE_TOO_LARGE`, `INVALID_RECORD`, `POLICY_VIOLATION`,
//!   `TOPIC_AUTHORIZATION_FAILED`: *permanent*; in a transaction, *abortable*).
//!   `OUT_OF_ORDER_SEQUENCE_NUMBER` on the oldest request in flight is the
//!   broker's state diverging from the producer's: *fatal* for an idempotent and
//!   a transactional producer alike. `INVALID_PRODUCER_EPOCH` is *fatal* (fenced)
//!   for a transactional producer.
//! - `delay-acks` imitates slow replication or a loaded broker (acks=all waits
//!   for followers): the records are appended (and readable) at once, the
//!   acknowledgement comes late. The connection reads nothing meanwhile, as Kafka
//!   mutes a connection until its response is sent; other connections, fetches
//!   included, are served. Past the client's request timeout it is timed out as
//!   with `drop-acks`.
//! - `drop-acks` imitates an acknowledgement lost after the append (a broker that
//!   crashed or was partitioned between writing and answering). librdkafka times
//!   the request out (`ERR__TIMED_OUT`: *retriable*, possibly persisted), drops
//!   the connection (`socket.max.fails` = 1), and retries with the same sequence
//!   numbers; the broker recognises the duplicate and answers with the original
//!   offset, so nothing is written twice. The client's timeout of a Produce
//!   request is `socket.timeout.ms` (60 s by default) or the first message's
//!   remaining `message.timeout.ms` if shorter, not `request.timeout.ms` (that
//!   one is sent to the broker as the replication timeout): a test lowers
//!   `socket.timeout.ms` to see the retry soon.
//! - `stall` imitates a broker process paused (a long GC pause, SIGSTOP, a frozen
//!   VM): requests are neither read nor answered; they are answered in order when
//!   it ends. Transaction timeouts do not run meanwhile. Clients see
//!   `ERR__TIMED_OUT` (*retriable*) if it outlasts their request timeout
//!   (`socket.timeout.ms`).
//! - `abort-transactions` imitates the coordinator aborting transactions on
//!   `transaction.timeout.ms` (a producer that stalled, or a coordinator that
//!   moved and timed them out): ABORT markers, and an epoch bump that fences the
//!   producer. Its next Produce or EndTxn gets `INVALID_PRODUCER_EPOCH` or
//!   `PRODUCER_FENCED`: *fatal* (`ERR__FENCED`), the producer must be recreated.
//! - `coordinator-error` imitates a transaction coordinator that moved or is
//!   loading its log after a restart, on FindCoordinator (transactional ids
//!   only), InitProducerId (with a transactional id), AddPartitionsToTxn (every
//!   partition gets the error), AddOffsetsToTxn and EndTxn. `NOT_COORDINATOR`,
//!   `COORDINATOR_NOT_AVAILABLE` (the client looks the coordinator up again),
//!   `COORDINATOR_LOAD_IN_PROGRESS` and `CONCURRENT_TRANSACTIONS` are *retriable*
//!   everywhere; `TRANSACTIONAL_ID_AUTHORIZATION_FAILED`,
//!   `CLUSTER_AUTHORIZATION_FAILED`, `INVALID_PRODUCER_EPOCH`, `PRODUCER_FENCED`
//!   and `INVALID_TXN_STATE` are *fatal* (`INVALID_TRANSACTION_TIMEOUT` too, on
//!   InitProducerId); other codes are *abortable* on AddPartitionsToTxn,
//!   AddOffsetsToTxn and EndTxn, and retried on FindCoordinator and InitProducerId.
//! - `end-txn-error` is the same for EndTxn only: a commit or abort that meets a
//!   coordinator failover. On a retriable error librdkafka resends EndTxn itself;
//!   if that keeps failing, `commit_transaction()` returns a retriable error and
//!   the application may call it again. The transaction stays open meanwhile.
//!
//! Faults are in memory like everything else: a restart forgets them.

use std::time::{Duration, Instant};

use kafka_protocol::ResponseError;

/// The longest control line read; a longer one closes the connection.
pub(super) const MAX_LINE: usize = 1024;
/// The largest count a command takes.
const MAX_COUNT: u32 = 1_000_000;
/// The longest delay or stall (one hour).
const MAX_MS: u64 = 3_600_000;

/// One control command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Command {
    FailProduce {
        topic: String,
        /// `None` for `*`: any partition of the topic.
        partition: Option<i32>,
        error: i16,
        count: u32,
    },
    DelayAcks(Duration),
    DropAcks(u32),
    Stall(Duration),
    AbortTransactions,
    CoordinatorError {
        error: i16,
        count: u32,
    },
    EndTxnError {
        error: i16,
        count: u32,
    },
    Reset,
}

/// Why a control line is not a command.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum ParseError {
    #[error("empty command")]
    Empty,
    #[error(
        "unknown command {0:?} (fail-produce, delay-acks, drop-acks, stall, \
         abort-transactions, coordinator-error, end-txn-error, reset)"
    )]
    UnknownCommand(String),
    #[error("usage: {0}")]
    Usage(&'static str),
    #[error(
        "unknown error {0:?}: a Kafka error name in UPPER_SNAKE (e.g. \
         NOT_LEADER_OR_FOLLOWER) or a non-zero numeric code"
    )]
    UnknownError(String),
    #[error("{what} {value:?} is not a whole number in {min}..={max}")]
    Number {
        what: &'static str,
        value: String,
        min: u64,
        max: u64,
    },
}

const USAGE_FAIL_PRODUCE: &str = "fail-produce <topic> <partition|*> <ERROR> [count]";
const USAGE_DELAY_ACKS: &str = "delay-acks <ms>";
const USAGE_DROP_ACKS: &str = "drop-acks <count>";
const USAGE_STALL: &str = "stall <ms>";
const USAGE_ABORT: &str = "abort-transactions";
const USAGE_COORDINATOR: &str = "coordinator-error <ERROR> [count]";
const USAGE_END_TXN: &str = "end-txn-error <ERROR> [count]";
const USAGE_RESET: &str = "reset";

fn number(what: &'static str, value: &str, min: u64, max: u64) -> Result<u64, ParseError> {
    value
        .parse::<u64>()
        .ok()
        .filter(|n| (min..=max).contains(n))
        .ok_or_else(|| ParseError::Number {
            what,
            value: value.to_owned(),
            min,
            max,
        })
}

fn count(value: Option<&str>, min: u32) -> Result<u32, ParseError> {
    let Some(value) = value else { return Ok(1) };
    let n = number("count", value, min.into(), MAX_COUNT.into())?;
    // Within MAX_COUNT, so it fits.
    Ok(u32::try_from(n).unwrap_or(MAX_COUNT))
}

fn millis(value: &str) -> Result<Duration, ParseError> {
    number("milliseconds", value, 0, MAX_MS).map(Duration::from_millis)
}

/// `NotLeaderOrFollower` → `NOT_LEADER_OR_FOLLOWER`.
fn upper_snake(camel: &str) -> String {
    let mut out = String::with_capacity(camel.len() + 8);
    for (i, c) in camel.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

/// The codes the kafka-protocol crate names (it numbers them -1 and 1 up).
fn named_errors() -> impl Iterator<Item = ResponseError> {
    (-1..=i16::from(u8::MAX))
        .filter_map(ResponseError::try_from_code)
        .filter(|e| !matches!(e, ResponseError::Unknown(_)))
}

/// A Kafka error code from its UPPER_SNAKE name (any case) or its number (not 0).
pub(super) fn error_code(text: &str) -> Result<i16, ParseError> {
    if let Ok(n) = text.parse::<i16>() {
        return if n == 0 {
            Err(ParseError::UnknownError(text.to_owned()))
        } else {
            Ok(n)
        };
    }
    let wanted = text.to_ascii_uppercase();
    named_errors()
        .find(|e| upper_snake(&e.to_string()) == wanted)
        .map(|e| e.code())
        .ok_or_else(|| ParseError::UnknownError(text.to_owned()))
}

/// `NOT_LEADER_OR_FOLLOWER (6)`, or the bare number for a code without a name.
pub(super) fn error_name(code: i16) -> String {
    match ResponseError::try_from_code(code) {
        Some(ResponseError::Unknown(_)) | None => code.to_string(),
        Some(e) => format!("{} ({code})", upper_snake(&e.to_string())),
    }
}

/// Parses one control line (surrounding whitespace ignored).
pub(super) fn parse(line: &str) -> Result<Command, ParseError> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let Some((&name, args)) = words.split_first() else {
        return Err(ParseError::Empty);
    };
    match name {
        "fail-produce" => {
            let u = || ParseError::Usage(USAGE_FAIL_PRODUCE);
            let (topic, partition, error, rest) = match args {
                [t, p, e] => (t, p, e, None),
                [t, p, e, c] => (t, p, e, Some(*c)),
                _ => return Err(u()),
            };
            let partition = match *partition {
                "*" => None,
                p => Some(
                    i32::try_from(number("partition", p, 0, i32::MAX.unsigned_abs().into())?)
                        .map_err(|_| u())?,
                ),
            };
            Ok(Command::FailProduce {
                topic: (*topic).to_owned(),
                partition,
                error: error_code(error)?,
                count: count(rest, 1)?,
            })
        }
        "delay-acks" => match args {
            [ms] => Ok(Command::DelayAcks(millis(ms)?)),
            _ => Err(ParseError::Usage(USAGE_DELAY_ACKS)),
        },
        "drop-acks" => match args {
            [n] => Ok(Command::DropAcks(count(Some(n), 0)?)),
            _ => Err(ParseError::Usage(USAGE_DROP_ACKS)),
        },
        "stall" => match args {
            [ms] => Ok(Command::Stall(millis(ms)?)),
            _ => Err(ParseError::Usage(USAGE_STALL)),
        },
        "abort-transactions" => match args {
            [] => Ok(Command::AbortTransactions),
            _ => Err(ParseError::Usage(USAGE_ABORT)),
        },
        "coordinator-error" | "end-txn-error" => {
            let (error, rest) = match args {
                [e] => (e, None),
                [e, c] => (e, Some(*c)),
                _ if name == "end-txn-error" => return Err(ParseError::Usage(USAGE_END_TXN)),
                _ => return Err(ParseError::Usage(USAGE_COORDINATOR)),
            };
            let (error, count) = (error_code(error)?, count(rest, 1)?);
            Ok(if name == "end-txn-error" {
                Command::EndTxnError { error, count }
            } else {
                Command::CoordinatorError { error, count }
            })
        }
        "reset" => match args {
            [] => Ok(Command::Reset),
            _ => Err(ParseError::Usage(USAGE_RESET)),
        },
        other => Err(ParseError::UnknownCommand(other.chars().take(64).collect())),
    }
}

/// A `fail-produce` still to fire.
#[derive(Debug)]
struct ProduceFault {
    topic: String,
    partition: Option<i32>,
    error: i16,
    remaining: u32,
}

impl ProduceFault {
    fn matches(&self, topic: &str, partition: i32) -> bool {
        self.topic == topic && self.partition.is_none_or(|p| p == partition)
    }
}

/// An error for the next `remaining` requests of a kind.
#[derive(Debug, Clone, Copy)]
struct Armed {
    error: i16,
    remaining: u32,
}

impl Armed {
    /// The error, once, if armed.
    fn take(slot: &mut Option<Armed>) -> Option<(i16, u32)> {
        let armed = slot.as_mut()?;
        armed.remaining = armed.remaining.saturating_sub(1);
        let out = (armed.error, armed.remaining);
        if armed.remaining == 0 {
            *slot = None;
        }
        Some(out)
    }
}

/// What becomes of a Produce response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ack {
    /// Written after `delay` (zero: at once).
    Send { delay: Duration },
    /// Never written (`drop-acks`).
    Drop,
}

/// The faults armed and not yet spent.
#[derive(Debug, Default)]
pub(super) struct Faults {
    produce: Vec<ProduceFault>,
    ack_delay: Duration,
    drop_acks: u32,
    stall_until: Option<Instant>,
    /// Whether the current stall has held a request yet (logged once a stall).
    stall_held: bool,
    coordinator: Option<Armed>,
    end_txn: Option<Armed>,
}

impl Faults {
    /// Arms (or clears) what `command` says; the detail of the `ok` reply.
    /// `abort-transactions` acts on the coordinator, not here: see
    /// [`super::state::Broker::control`].
    pub(super) fn arm(&mut self, command: Command, now: Instant) -> String {
        match command {
            Command::FailProduce {
                topic,
                partition,
                error,
                count,
            } => {
                let at = partition.map_or_else(|| "*".to_owned(), |p| p.to_string());
                tracing::info!(%topic, partition = %at, error = %error_name(error), count, "fault armed: fail-produce");
                let detail = format!("{topic} {at} {} x{count}", error_name(error));
                self.produce.push(ProduceFault {
                    topic,
                    partition,
                    error,
                    remaining: count,
                });
                detail
            }
            Command::DelayAcks(delay) => {
                tracing::info!(delay_ms = delay.as_millis(), "fault armed: delay-acks");
                self.ack_delay = delay;
                format!("{} ms", delay.as_millis())
            }
            Command::DropAcks(count) => {
                tracing::info!(count, "fault armed: drop-acks");
                self.drop_acks = count;
                format!("x{count}")
            }
            Command::Stall(duration) => {
                tracing::info!(stall_ms = duration.as_millis(), "fault armed: stall");
                self.stall_until = (!duration.is_zero()).then(|| now + duration);
                self.stall_held = false;
                format!("{} ms", duration.as_millis())
            }
            Command::CoordinatorError { error, count } => {
                tracing::info!(error = %error_name(error), count, "fault armed: coordinator-error");
                self.coordinator = Some(Armed {
                    error,
                    remaining: count,
                });
                format!("{} x{count}", error_name(error))
            }
            Command::EndTxnError { error, count } => {
                tracing::info!(error = %error_name(error), count, "fault armed: end-txn-error");
                self.end_txn = Some(Armed {
                    error,
                    remaining: count,
                });
                format!("{} x{count}", error_name(error))
            }
            Command::Reset => {
                tracing::info!("faults reset");
                *self = Faults::default();
                String::new()
            }
            Command::AbortTransactions => String::new(),
        }
    }

    /// The injected error of each partition a Produce request touches (`touched`,
    /// in request order), `None` where it is to be appended. Each armed
    /// `fail-produce` that matches spends one of its count for the request.
    pub(super) fn take_produce(&mut self, touched: &[(String, i32)]) -> Vec<Option<i16>> {
        let mut out = vec![None; touched.len()];
        if self.produce.is_empty() {
            return out;
        }
        for fault in &mut self.produce {
            let mut fired = false;
            for (slot, (topic, partition)) in out.iter_mut().zip(touched) {
                if slot.is_none() && fault.matches(topic, *partition) {
                    *slot = Some(fault.error);
                    fired = true;
                    tracing::info!(%topic, partition, error = %error_name(fault.error), remaining = fault.remaining.saturating_sub(1), "fault fired: fail-produce");
                }
            }
            if fired {
                fault.remaining = fault.remaining.saturating_sub(1);
            }
        }
        self.produce.retain(|f| f.remaining > 0);
        out
    }

    /// What becomes of the response of a Produce request that wants one.
    pub(super) fn produce_ack(&mut self) -> Ack {
        if self.drop_acks > 0 {
            self.drop_acks -= 1;
            tracing::info!(
                remaining = self.drop_acks,
                "fault fired: drop-acks (appended, not answered)"
            );
            return Ack::Drop;
        }
        if !self.ack_delay.is_zero() {
            tracing::info!(
                delay_ms = self.ack_delay.as_millis(),
                "fault fired: delay-acks"
            );
        }
        Ack::Send {
            delay: self.ack_delay,
        }
    }

    /// The error for a transaction-coordinator request (`api` names it in the
    /// log), if `coordinator-error` is armed.
    pub(super) fn take_coordinator(&mut self, api: &'static str) -> Option<i16> {
        let (error, remaining) = Armed::take(&mut self.coordinator)?;
        tracing::info!(api, error = %error_name(error), remaining, "fault fired: coordinator-error");
        Some(error)
    }

    /// The error for an EndTxn request: `end-txn-error` first, else
    /// `coordinator-error`.
    pub(super) fn take_end_txn(&mut self) -> Option<i16> {
        let Some((error, remaining)) = Armed::take(&mut self.end_txn) else {
            return self.take_coordinator("EndTxn");
        };
        tracing::info!(error = %error_name(error), remaining, "fault fired: end-txn-error");
        Some(error)
    }

    /// When the current stall ends, if one is under way at `now`.
    pub(super) fn stalled(&self, now: Instant) -> Option<Instant> {
        self.stall_until.filter(|&until| until > now)
    }

    /// [`Faults::stalled`] for a request about to be held: logs the first one of
    /// a stall, and forgets a stall that is over.
    pub(super) fn hold(&mut self, now: Instant) -> Option<Instant> {
        let Some(until) = self.stalled(now) else {
            if self.stall_until.take().is_some() && self.stall_held {
                tracing::info!("stall over: answering the held requests");
            }
            self.stall_held = false;
            return None;
        };
        if !self.stall_held {
            self.stall_held = true;
            tracing::info!(
                remaining_ms = until.saturating_duration_since(now).as_millis(),
                "fault fired: stall (holding requests)"
            );
        }
        Some(until)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tp(topic: &str, partition: i32) -> (String, i32) {
        (topic.to_owned(), partition)
    }

    #[test]
    fn parses_every_command() {
        assert_eq!(
            parse("fail-produce t 0 NOT_LEADER_OR_FOLLOWER"),
            Ok(Command::FailProduce {
                topic: "t".into(),
                partition: Some(0),
                error: 6,
                count: 1
            })
        );
        assert_eq!(
            parse("  fail-produce  orders * 10 3 \r\n"),
            Ok(Command::FailProduce {
                topic: "orders".into(),
                partition: None,
                error: 10,
                count: 3
            })
        );
        assert_eq!(
            parse("delay-acks 250"),
            Ok(Command::DelayAcks(Duration::from_millis(250)))
        );
        assert_eq!(
            parse("delay-acks 0"),
            Ok(Command::DelayAcks(Duration::ZERO))
        );
        assert_eq!(parse("drop-acks 2"), Ok(Command::DropAcks(2)));
        assert_eq!(
            parse("stall 1500"),
            Ok(Command::Stall(Duration::from_millis(1500)))
        );
        assert_eq!(parse("abort-transactions"), Ok(Command::AbortTransactions));
        assert_eq!(
            parse("coordinator-error NOT_COORDINATOR 2"),
            Ok(Command::CoordinatorError {
                error: 16,
                count: 2
            })
        );
        assert_eq!(
            parse("end-txn-error concurrent_transactions"),
            Ok(Command::EndTxnError {
                error: 51,
                count: 1
            })
        );
        assert_eq!(parse("reset"), Ok(Command::Reset));
    }

    #[test]
    fn error_names_and_codes() {
        for (name, code) in [
            ("NOT_LEADER_OR_FOLLOWER", 6),
            ("UNKNOWN_TOPIC_OR_PARTITION", 3),
            ("MESSAGE_TOO_LARGE", 10),
            ("INVALID_RECORD", 87),
            ("OUT_OF_ORDER_SEQUENCE_NUMBER", 45),
            ("CORRUPT_MESSAGE", 2),
            ("REQUEST_TIMED_OUT", 7),
            ("NOT_ENOUGH_REPLICAS", 19),
            ("POLICY_VIOLATION", 44),
            ("TOPIC_AUTHORIZATION_FAILED", 29),
            ("NOT_COORDINATOR", 16),
            ("COORDINATOR_NOT_AVAILABLE", 15),
            ("COORDINATOR_LOAD_IN_PROGRESS", 14),
            ("CONCURRENT_TRANSACTIONS", 51),
            ("PRODUCER_FENCED", 90),
            ("UNKNOWN_SERVER_ERROR", -1),
        ] {
            assert_eq!(error_code(name), Ok(code), "{name}");
            assert_eq!(error_name(code), format!("{name} ({code})"));
        }
        assert_eq!(error_code("-1"), Ok(-1));
        assert_eq!(error_code("6"), Ok(6));
        // A code the crate does not name is still a code.
        assert_eq!(error_code("999"), Ok(999));
        assert_eq!(error_name(999), "999");
        for bad in [
            "0",
            "NOPE",
            "NOT_LEADER",
            "",
            "99999",
            "6.0",
            "NotLeaderOrFollower",
        ] {
            assert!(
                matches!(error_code(bad), Err(ParseError::UnknownError(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn garbage_is_a_clear_error() {
        let cases: &[(&str, &str)] = &[
            ("", "empty command"),
            ("   \t ", "empty command"),
            ("explode", "unknown command"),
            ("FAIL-PRODUCE t 0 6", "unknown command"),
            ("fail-produce", "usage: fail-produce"),
            ("fail-produce t 0", "usage: fail-produce"),
            ("fail-produce t 0 6 1 extra", "usage: fail-produce"),
            ("fail-produce t -1 6", "partition \"-1\""),
            ("fail-produce t x 6", "partition \"x\""),
            ("fail-produce t 99999999999 6", "partition"),
            ("fail-produce t 0 NOPE", "unknown error \"NOPE\""),
            ("fail-produce t 0 6 0", "count \"0\""),
            ("fail-produce t 0 6 -2", "count"),
            ("fail-produce t 0 6 1000001", "count"),
            ("delay-acks", "usage: delay-acks"),
            ("delay-acks -5", "milliseconds"),
            ("delay-acks 1.5", "milliseconds"),
            ("delay-acks 3600001", "milliseconds"),
            ("drop-acks", "usage: drop-acks"),
            ("drop-acks many", "count"),
            ("stall", "usage: stall"),
            ("stall 18446744073709551616", "milliseconds"),
            ("abort-transactions now", "usage: abort-transactions"),
            ("coordinator-error", "usage: coordinator-error"),
            ("coordinator-error 16 1 2", "usage: coordinator-error"),
            ("end-txn-error", "usage: end-txn-error"),
            ("end-txn-error 0", "unknown error"),
            ("reset now", "usage: reset"),
            ("\u{0}\u{7f}\u{fffd}", "unknown command"),
        ];
        for (line, want) in cases {
            let e = parse(line).expect_err(line);
            assert!(e.to_string().contains(want), "{line:?}: {e}");
        }
        // A long unknown word is cut in the reply.
        let long = "x".repeat(5000);
        assert!(parse(&long).expect_err("long").to_string().len() < 300);
    }

    #[test]
    fn fail_produce_fires_count_times_on_its_partitions_only() {
        let mut f = Faults::default();
        let now = Instant::now();
        f.arm(
            parse("fail-produce t 1 NOT_LEADER_OR_FOLLOWER 2").expect("parse"),
            now,
        );
        let touched = [tp("t", 0), tp("t", 1), tp("u", 1)];
        assert_eq!(f.take_produce(&touched), vec![None, Some(6), None]);
        assert_eq!(f.take_produce(&[tp("t", 0)]), vec![None]);
        assert_eq!(f.take_produce(&[tp("t", 1)]), vec![Some(6)]);
        assert_eq!(f.take_produce(&[tp("t", 1)]), vec![None]);
        // `*`: every partition of the topic in the request, one count a request.
        f.arm(parse("fail-produce t * 10").expect("parse"), now);
        assert_eq!(f.take_produce(&touched), vec![Some(10), Some(10), None]);
        assert_eq!(f.take_produce(&touched), vec![None, None, None]);
        // Two faults on one partition fire one after the other.
        f.arm(parse("fail-produce t 0 6").expect("parse"), now);
        f.arm(parse("fail-produce t 0 7").expect("parse"), now);
        assert_eq!(f.take_produce(&[tp("t", 0)]), vec![Some(6)]);
        assert_eq!(f.take_produce(&[tp("t", 0)]), vec![Some(7)]);
        assert_eq!(f.take_produce(&[tp("t", 0)]), vec![None]);
    }

    #[test]
    fn acks_are_dropped_then_delayed() {
        let mut f = Faults::default();
        let now = Instant::now();
        assert_eq!(
            f.produce_ack(),
            Ack::Send {
                delay: Duration::ZERO
            }
        );
        f.arm(Command::DropAcks(2), now);
        f.arm(Command::DelayAcks(Duration::from_millis(40)), now);
        assert_eq!(f.produce_ack(), Ack::Drop);
        assert_eq!(f.produce_ack(), Ack::Drop);
        let delayed = Ack::Send {
            delay: Duration::from_millis(40),
        };
        assert_eq!(f.produce_ack(), delayed);
        assert_eq!(f.produce_ack(), delayed);
        f.arm(Command::DelayAcks(Duration::ZERO), now);
        assert_eq!(
            f.produce_ack(),
            Ack::Send {
                delay: Duration::ZERO
            }
        );
    }

    #[test]
    fn stall_holds_until_it_ends() {
        let mut f = Faults::default();
        let now = Instant::now();
        assert_eq!(f.hold(now), None);
        f.arm(Command::Stall(Duration::from_millis(500)), now);
        let until = now + Duration::from_millis(500);
        assert_eq!(f.hold(now), Some(until));
        assert_eq!(f.stalled(now + Duration::from_millis(499)), Some(until));
        assert_eq!(f.hold(until), None);
        assert_eq!(f.stalled(now), None, "forgotten once over");
        // `stall 0` and `reset` end a stall early.
        f.arm(Command::Stall(Duration::from_secs(60)), now);
        f.arm(Command::Stall(Duration::ZERO), now);
        assert_eq!(f.hold(now), None);
        f.arm(Command::Stall(Duration::from_secs(60)), now);
        f.arm(Command::Reset, now);
        assert_eq!(f.hold(now), None);
    }

    #[test]
    fn end_txn_errors_come_before_coordinator_errors() {
        let mut f = Faults::default();
        let now = Instant::now();
        f.arm(
            parse("coordinator-error NOT_COORDINATOR 2").expect("parse"),
            now,
        );
        f.arm(
            parse("end-txn-error CONCURRENT_TRANSACTIONS").expect("parse"),
            now,
        );
        assert_eq!(f.take_end_txn(), Some(51));
        assert_eq!(f.take_end_txn(), Some(16));
        assert_eq!(f.take_coordinator("AddOffsetsToTxn"), Some(16));
        assert_eq!(f.take_coordinator("AddOffsetsToTxn"), None);
        assert_eq!(f.take_end_txn(), None);
    }

    #[test]
    fn reset_clears_everything() {
        let mut f = Faults::default();
        let now = Instant::now();
        for line in [
            "fail-produce t * 6 5",
            "delay-acks 100",
            "drop-acks 3",
            "stall 10000",
            "coordinator-error 16 4",
            "end-txn-error 51 4",
            "reset",
        ] {
            f.arm(parse(line).expect(line), now);
        }
        assert_eq!(f.take_produce(&[tp("t", 0)]), vec![None]);
        assert_eq!(
            f.produce_ack(),
            Ack::Send {
                delay: Duration::ZERO
            }
        );
        assert_eq!(f.hold(now), None);
        assert_eq!(f.take_coordinator("EndTxn"), None);
        assert_eq!(f.take_end_txn(), None);
    }
}
