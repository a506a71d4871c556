//! The transactional producer of `kafka.delivery = "exactly-once"`: its settings, its
//! life (init, begin, commit, abort), and what each of librdkafka's transaction errors
//! means for the relay.
//!
//! # Why the `transactional.id` is the slot's name
//!
//! Kafka fences by `transactional.id`: `init_transactions` of a new producer bumps the
//! id's epoch, aborts whatever transaction an older producer left open, and every later
//! request of the older one is refused (`PRODUCER_FENCED`). One slot (one shard) is one
//! stream of events, so its name is the id: a relay restarted after `kill -9`, or a
//! standby that took the slot over, fences the old process and aborts its half-written
//! transaction before it reads the progress record. The relay calls `init_transactions`
//! only once it holds the slot (`START_REPLICATION` succeeded), so a standby that waits
//! for the slot never fences the active relay.
//!
//! # Timeouts
//!
//! At-least-once producers never time a record out (`message.timeout.ms = 0`). In a
//! transaction a record must be delivered before the broker's transaction timeout, so
//! here `message.timeout.ms` is `transaction.timeout.ms` (`kafka.transaction_timeout_ms`,
//! 60 s by default, at most [`TRANSACTION_TIMEOUT`]): a record that times
//! out fails its transaction, which is aborted and produced again in order
//! (`cdc::progress::transactions`); nothing is lost or reordered by it.
//!
//! # Error classes (librdkafka's transactional API)
//!
//! * fatal, and `PRODUCER_FENCED` among them: the producer is unusable. Fenced means
//!   another process holds the stream (this one stops producing at once and exits),
//!   or the coordinator aborted a transaction older than `transaction.timeout.ms`
//!   (the session tells the two apart and replaces the producer).
//!   Any other fatal error replaces the producer, and the next `init_transactions`
//!   aborts what it left open.
//! * abortable (`txn_requires_abort`): the transaction is aborted and its events are
//!   produced again.
//! * retriable (a timeout): the same call is made again.
//!
//! Reference: librdkafka's `rdkafka.h` "Transactional producer API" and KIP-98.

use std::ffi::CStr;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::bindings;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseProducer, Producer};

use super::publisher::{Publisher, RelayContext};

/// The longest `transaction.timeout.ms` (`kafka.transaction_timeout_ms`): how long the
/// broker lets a transaction stay open before it aborts it (Kafka's default, below the
/// brokers' usual 15-minute maximum). The progress record's reader waits past it.
pub const TRANSACTION_TIMEOUT: Duration = Duration::from_secs(60);

/// How long one `init_transactions`, commit or abort may take before it is retried.
pub const TRANSACTION_CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Makes `cfg` (from [`super::producer_config`]) transactional under `id`, with
/// `timeout` as `transaction.timeout.ms` and `message.timeout.ms`.
pub fn transactional_config(cfg: &mut ClientConfig, id: &str, timeout: Duration) {
    let timeout = timeout.min(TRANSACTION_TIMEOUT).as_millis().to_string();
    cfg.set("transactional.id", id)
        .set("transaction.timeout.ms", &timeout)
        .set("message.timeout.ms", &timeout);
}

/// The `transactional.id` of the relay streaming `slot` (shard slots have their own
/// names): the slot's name, prefixed so that it cannot collide with an application's.
#[must_use]
pub fn transactional_id(slot: &str) -> String {
    format!("outbox-relay.{slot}")
}

/// A transactional call that did not succeed, by what the relay must do about it.
#[derive(Debug, thiserror::Error)]
pub enum TransactionError {
    /// Another producer with the same `transactional.id` started: this one must stop.
    #[error(
        "fenced: another relay initialised transactional.id {id:?} and took over this \
         stream ({message})"
    )]
    Fenced { id: String, message: String },
    /// The broker does not implement transactions.
    #[error(
        "the broker does not support Kafka transactions ({code:?}: {message}); \
         kafka.delivery = \"exactly-once\" needs a broker that does (Apache Kafka 2.5 or \
         later, or a compatible one); use \"at-least-once\" with this broker"
    )]
    Unsupported {
        code: RDKafkaErrorCode,
        message: String,
    },
    /// The cluster refuses this relay's transactions for a reason no retry and no new
    /// producer can change (a timeout above the coordinator's maximum, a missing
    /// ACL): the operator must act.
    #[error("the cluster refuses this relay's Kafka transactions ({code:?}: {message}); {fix}")]
    Refused {
        code: RDKafkaErrorCode,
        message: String,
        fix: &'static str,
    },
    /// The producer is unusable (not fenced): replace it.
    #[error("the transactional producer failed fatally ({code:?}: {message})")]
    Fatal {
        code: RDKafkaErrorCode,
        message: String,
    },
    /// The transaction must be aborted; its events are produced again.
    #[error("the Kafka transaction must be aborted ({code:?}: {message})")]
    Abortable {
        code: RDKafkaErrorCode,
        message: String,
    },
    /// The call may be made again (it timed out, the coordinator moved…).
    #[error("the transactional call can be retried ({code:?}: {message})")]
    Retriable {
        code: RDKafkaErrorCode,
        message: String,
    },
}

impl TransactionError {
    /// Fenced (another relay holds the stream) or unsupported (the broker has no
    /// transactions): nothing the relay can retry; exit code 3.
    #[must_use]
    pub fn needs_operator(&self) -> bool {
        matches!(
            self,
            TransactionError::Fenced { .. }
                | TransactionError::Unsupported { .. }
                | TransactionError::Refused { .. }
        )
    }

    /// Fenced: a producer of the same `transactional.id` with a newer epoch exists,
    /// or the coordinator bumped the epoch itself when it aborted a transaction on
    /// its timeout (the session tells the two apart).
    #[must_use]
    pub fn is_fenced(&self) -> bool {
        matches!(self, TransactionError::Fenced { .. })
    }

    fn classify(id: &str, error: &KafkaError) -> TransactionError {
        let message = error.to_string();
        let Some(code) = error.rdkafka_error_code() else {
            return TransactionError::Fatal {
                code: RDKafkaErrorCode::Fail,
                message,
            };
        };
        let flags = match error {
            KafkaError::Transaction(e) => Flags {
                fatal: e.is_fatal(),
                abortable: e.txn_requires_abort(),
                retriable: e.is_retriable(),
            },
            _ => Flags::default(),
        };
        TransactionError::of(id, code, flags, message)
    }

    fn of(id: &str, code: RDKafkaErrorCode, flags: Flags, message: String) -> TransactionError {
        if let Some(fix) = refusal_fix(code) {
            return TransactionError::Refused { code, message, fix };
        }
        match code {
            RDKafkaErrorCode::ProducerFenced
            | RDKafkaErrorCode::InvalidProducerEpoch
            | RDKafkaErrorCode::Fenced
                if flags.fatal || code == RDKafkaErrorCode::ProducerFenced =>
            {
                TransactionError::Fenced {
                    id: id.to_owned(),
                    message,
                }
            }
            RDKafkaErrorCode::UnsupportedVersion
            | RDKafkaErrorCode::UnsupportedFeature
            | RDKafkaErrorCode::UnsupportedForMessageFormat => {
                TransactionError::Unsupported { code, message }
            }

            _ if flags.fatal => TransactionError::Fatal { code, message },
            _ if flags.abortable => TransactionError::Abortable { code, message },
            _ if flags.retriable || code == RDKafkaErrorCode::OperationTimedOut => {
                TransactionError::Retriable { code, message }
            }
            _ => TransactionError::Abortable { code, message },
        }
    }
}

/// The fix for a refusal no retry can change, or `None` for any other code.
fn refusal_fix(code: RDKafkaErrorCode) -> Option<&'static str> {
    Some(match code {
        RDKafkaErrorCode::InvalidTransactionTimeout => {
            "kafka.transaction_timeout_ms is above the brokers' transaction.max.timeout.ms: \
             lower it, or raise transaction.max.timeout.ms (`outbox-relay check` shows both)"
        }
        RDKafkaErrorCode::TransactionalIdAuthorizationFailed => {
            "grant the relay's principal WRITE and DESCRIBE on the TransactionalId \
             outbox-relay.<slot> (a prefixed ACL on `outbox-relay.` covers every slot)"
        }
        RDKafkaErrorCode::ClusterAuthorizationFailed => {
            "grant the relay's principal IDEMPOTENT_WRITE on the cluster (older brokers need it \
             for transactional producers)"
        }
        _ => return None,
    })
}

/// What librdkafka says about a transactional error, beside its code.
#[derive(Debug, Default, Clone, Copy)]
struct Flags {
    fatal: bool,
    abortable: bool,
    retriable: bool,
}

/// A commit or an abort running on a blocking thread; await it for its outcome.
pub type TransactionCall = tokio::task::JoinHandle<Result<(), TransactionError>>;

/// Which transactional call to make on the producer's thread.
#[derive(Debug, Clone, Copy)]
enum Call {
    Init,
    Commit,
    Abort,
}

impl Publisher {
    /// `init_transactions`: fences every older producer of this `transactional.id`
    /// and aborts what it left open.
    ///
    /// # Errors
    ///
    /// See [`TransactionError`].
    pub async fn init_transactions(&self, id: &str) -> Result<(), TransactionError> {
        joined(self.transaction_call(id, Call::Init).await)
    }

    /// `begin_transaction`: before the first produce after a commit or an abort.
    ///
    /// # Errors
    ///
    /// See [`TransactionError`].
    pub fn begin_transaction(&self, id: &str) -> Result<(), TransactionError> {
        self.producer()
            .begin_transaction()
            .map_err(|e| TransactionError::classify(id, &e))
    }

    /// Starts `commit_transaction` (flushes what is in flight and commits it).
    #[must_use]
    pub fn start_commit(&self, id: &str) -> TransactionCall {
        self.transaction_call(id, Call::Commit)
    }

    /// Starts `abort_transaction` (purges what is queued and aborts).
    #[must_use]
    pub fn start_abort(&self, id: &str) -> TransactionCall {
        self.transaction_call(id, Call::Abort)
    }

    /// The call on a blocking thread: librdkafka's transactional calls block.
    fn transaction_call(&self, id: &str, call: Call) -> TransactionCall {
        let producer = Arc::clone(self.producer());
        let id = id.to_owned();
        tokio::task::spawn_blocking(move || {
            let result = match call {
                Call::Init => producer.init_transactions(TRANSACTION_CALL_TIMEOUT),
                Call::Commit => return commit(&producer, &id),
                Call::Abort => producer.abort_transaction(TRANSACTION_CALL_TIMEOUT),
            };
            result.map_err(|e| TransactionError::classify(&id, &e))
        })
    }
}

/// `rd_kafka_commit_transaction`, called directly.
///
/// rust-rdkafka's `commit_transaction` first runs its own `flush`, which alternates
/// zero-timeout `rd_kafka_flush` calls with 100 ms `poll`s of the event queue. The
/// publisher's delivery thread polls that queue all the time and takes the last
/// delivery reports, so that `poll` waits out its 100 ms with nothing left to serve:
/// every commit took 100 ms longer, and the relay produces nothing while a commit is
/// outstanding. librdkafka's commit flushes what is in flight itself ("Flushing N
/// outstanding message(s) prior to commit"); it needs the event queue served, which
/// the delivery thread does.
fn commit(producer: &BaseProducer<RelayContext>, id: &str) -> Result<(), TransactionError> {
    let timeout_ms = i32::try_from(TRANSACTION_CALL_TIMEOUT.as_millis()).unwrap_or(i32::MAX);
    // SAFETY: the pointer is the live producer's handle (the caller holds an `Arc` to
    // it for the whole call), and the transactional API may be called from any thread.
    #[allow(unsafe_code)]
    let error = unsafe {
        bindings::rd_kafka_commit_transaction(producer.client().native_ptr(), timeout_ms)
    };
    if error.is_null() {
        return Ok(());
    }
    // SAFETY: `error` is a non-null error object the call handed over to us: it is
    // read here and destroyed exactly once, after its string was copied.
    #[allow(unsafe_code)]
    let (code, flags, message) = unsafe {
        let code = RDKafkaErrorCode::from(bindings::rd_kafka_error_code(error));
        let flags = Flags {
            fatal: bindings::rd_kafka_error_is_fatal(error) != 0,
            abortable: bindings::rd_kafka_error_txn_requires_abort(error) != 0,
            retriable: bindings::rd_kafka_error_is_retriable(error) != 0,
        };
        let text = bindings::rd_kafka_error_string(error);
        let message = if text.is_null() {
            format!("{code:?}")
        } else {
            CStr::from_ptr(text).to_string_lossy().into_owned()
        };
        bindings::rd_kafka_error_destroy(error);
        (code, flags, message)
    };
    Err(TransactionError::of(id, code, flags, message))
}

/// The outcome of a finished [`TransactionCall`].
pub fn joined(
    outcome: Result<Result<(), TransactionError>, tokio::task::JoinError>,
) -> Result<(), TransactionError> {
    outcome.unwrap_or_else(|join| {
        Err(TransactionError::Fatal {
            code: RDKafkaErrorCode::Fail,
            message: format!("the transactional call's thread failed: {join}"),
        })
    })
}

/// Tries of a retriable transactional call ([`retrying`]).
const CALL_ATTEMPTS: u32 = 3;
const CALL_RETRY_PAUSE: Duration = Duration::from_millis(500);

/// Makes a transactional call (`init_transactions`, a commit, an abort) again while
/// it fails as retriable, three times at most, half a second apart; any
/// other outcome is returned as it is.
///
/// # Errors
///
/// The call's last error.
pub async fn retrying<F, Fut>(mut call: F) -> Result<(), TransactionError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), TransactionError>>,
{
    let mut attempt = 1;
    loop {
        match call().await {
            Err(TransactionError::Retriable { .. }) if attempt < CALL_ATTEMPTS => {
                attempt += 1;
                tokio::time::sleep(CALL_RETRY_PAUSE).await;
            }
            outcome => return outcome,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_transactional_settings_time_records_out_with_the_transaction() {
        let mut cfg = ClientConfig::new();
        cfg.set("message.timeout.ms", "0");
        transactional_config(
            &mut cfg,
            &transactional_id("outbox_relay_shard1"),
            TRANSACTION_TIMEOUT,
        );
        assert_eq!(
            cfg.get("transactional.id"),
            Some("outbox-relay.outbox_relay_shard1")
        );
        assert_eq!(cfg.get("transaction.timeout.ms"), Some("60000"));
        assert_eq!(cfg.get("message.timeout.ms"), Some("60000"));
    }

    #[test]
    fn errors_are_classified_by_what_the_relay_does_next() {
        let unsupported = KafkaError::Global(RDKafkaErrorCode::UnsupportedVersion);
        assert!(matches!(
            TransactionError::classify("t", &unsupported),
            TransactionError::Unsupported { .. }
        ));
        let timeout = KafkaError::Global(RDKafkaErrorCode::OperationTimedOut);
        assert!(matches!(
            TransactionError::classify("t", &timeout),
            TransactionError::Retriable { .. }
        ));
        let fenced = KafkaError::Global(RDKafkaErrorCode::ProducerFenced);
        assert!(matches!(
            TransactionError::classify("t", &fenced),
            TransactionError::Fenced { .. }
        ));
    }

    #[test]
    fn refusals_no_retry_can_fix_end_the_process_with_their_fix() {
        for (code, fix) in [
            (
                RDKafkaErrorCode::InvalidTransactionTimeout,
                "transaction.max.timeout.ms",
            ),
            (
                RDKafkaErrorCode::TransactionalIdAuthorizationFailed,
                "TransactionalId",
            ),
            (
                RDKafkaErrorCode::ClusterAuthorizationFailed,
                "IDEMPOTENT_WRITE",
            ),
        ] {
            let e = TransactionError::classify("t", &KafkaError::Global(code));
            assert!(e.needs_operator(), "{code:?}: {e}");
            assert!(e.to_string().contains(fix), "{code:?}: {e}");
        }
    }
}
