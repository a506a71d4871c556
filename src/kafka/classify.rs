//! The classification table: what the relay does with each broker error code
//! ([`error_class`], [`classify`], [`error_kind`]).
//!
//! It is kept apart from the publisher because three readers share it: the publisher's
//! delivery callback (to count transient errors and spot a broken client), the
//! sans-IO core's caller (retry, back off or poison an event), and the poison table's
//! `error_kind` column and metrics labels, which must stay stable across releases.
//!
//! In the style of Vector's Kafka sink, one explicit `match` lists every error code we
//! have an opinion about; everything else is transient, because misclassifying a
//! transient error as permanent sends good events to `poison_outbox`, while the reverse
//! only keeps retrying (visible, and fixable without data surgery).
//!
//! | class | codes | why |
//! |---|---|---|
//! | poison ([`Failure::Permanent`]) | `MessageSizeTooLarge`, `InvalidMessageSize`, `MessageBatchTooLarge` (Java's `RECORD_LIST_TOO_LARGE`), `InvalidRecord`, `InvalidMessage` (`CORRUPT_MESSAGE`), `PolicyViolation`, `UnsupportedForMessageFormat`, `InvalidTopic` (Java's `TopicException`) | the record itself is at fault: the same bytes to the same topic fail again. The core still retries up to `max_attempts`, which also covers a one-off corrupt batch on the wire. |
//! | configuration ([`Failure::Configuration`], see [`is_configuration`]) | `UnknownTopicOrPartition`, `UnknownTopic`, `UnknownPartition`, `UnknownTopicId`, `TopicAuthorizationFailed`, `InvalidTimestamp` | the topic's or the cluster's setup is at fault (the topic does not exist yet, no ACL, a timestamp outside the topic's window): fixing the setup makes the very same record deliverable. Under `relay.on_config_error = "block"` (the default, [`Failure::under`]) they are retried forever like transient errors, and the shell blocks the topic and alerts; under `"poison"` they count as poison. [`error_class`] still says [`ErrorClass::Poison`] for them: their class under `"poison"`. |
//! | fatal ([`ErrorClass::Fatal`], reported as [`Failure::Transient`]) | `Fatal`, `ClusterAuthorizationFailed`, `Authentication`, `SaslAuthenticationFailed`, `UnsupportedSASLMechanism`, `IllegalSASLState`, `SSL`, `InvalidRequiredAcks`, `TransactionalIdAuthorizationFailed` | the *client* is broken, not the record. Poisoning would drain the whole outbox into the poison table, so the event is never poisoned; the shell should stop with a clear message (check [`Publisher::fatal_error`](super::Publisher::fatal_error)) and a restart resumes from the slot. |
//! | transient | everything else: transport, `AllBrokersDown`, `NotLeaderForPartition`, `LeaderNotAvailable`, `RequestTimedOut`, `MessageTimedOut`, `QueueFull`, `NotEnoughReplicas(AfterAppend)`, `InvalidDifferentRecord` (*another* record in the batch was bad), `PurgeQueue`/`PurgeInflight` (shutdown), … | the broker or the network is at fault: retry forever, never poison. |

use rdkafka::types::RDKafkaErrorCode;

use crate::delivery::{ErrorClass, Failure};

/// The classification table: how the relay treats a broker error code. See the module
/// doc for the reasoning; the unit tests pin every row.
#[must_use]
pub(crate) fn error_class(code: RDKafkaErrorCode) -> ErrorClass {
    table(code).0
}

/// The outcome the core needs: [`Failure::Configuration`] for the codes of
/// [`is_configuration`] (which `relay.on_config_error` turns into a transient or a
/// permanent failure, [`Failure::under`]), [`Failure::Permanent`] for the other poison
/// codes, else [`Failure::Transient`] (fatal codes included: a broken client is not the
/// event's fault).
#[must_use]
pub(crate) fn classify(code: RDKafkaErrorCode) -> Failure {
    if is_configuration(code) {
        return Failure::Configuration;
    }
    match error_class(code) {
        ErrorClass::Poison => Failure::Permanent,
        ErrorClass::Transient | ErrorClass::Fatal => Failure::Transient,
    }
}

/// Errors that say how the topic or the cluster is set up, not what the event is:
/// the topic (or partition) does not exist yet, the relay may not write to it, or
/// the record's timestamp is outside the topic's `message.timestamp.*` window (after
/// a long outage). Fixing the setup makes the very same record deliverable, so they
/// block by default instead of poisoning (`relay.on_config_error`).
#[must_use]
pub(crate) fn is_configuration(code: RDKafkaErrorCode) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        code,
        C::TopicAuthorizationFailed
            | C::UnknownTopicOrPartition
            | C::UnknownTopic
            | C::UnknownPartition
            | C::UnknownTopicId
            | C::InvalidTimestamp
    )
}

/// Whether the broker refused a record for its size. A broker refuses a whole
/// batch (a produce request's record set for one partition) when it exceeds the
/// topic's `max.message.bytes`, and librdkafka reports that error for every record
/// in it without splitting the batch: the record may be innocent. The relay retries
/// such a record alone before counting it against the event.
#[must_use]
pub(crate) fn is_size_error(code: RDKafkaErrorCode) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        code,
        C::MessageSizeTooLarge | C::MessageBatchTooLarge | C::InvalidMessageSize
    )
}

/// What an operator should do about a configuration error (for the log line).
#[must_use]
pub(crate) fn configuration_fix(code: RDKafkaErrorCode) -> &'static str {
    use RDKafkaErrorCode as C;
    match code {
        C::TopicAuthorizationFailed => {
            "grant the relay's principal WRITE (and DESCRIBE) on the topic"
        }
        C::InvalidTimestamp => {
            "the record's timestamp (created_at) is outside the topic's \
             message.timestamp.before/after.max.ms window: widen it, or use \
             message.timestamp.type=LogAppendTime"
        }
        _ => "create the topic (or fix kafka.topic_template / the row's topic)",
    }
}

/// A stable `snake_case` name for the error, for the poison table's error column and
/// for metrics labels. Codes without an entry are `"broker_error"`.
#[must_use]
pub(crate) fn error_kind(code: RDKafkaErrorCode) -> &'static str {
    table(code).1
}

fn table(code: RDKafkaErrorCode) -> (ErrorClass, &'static str) {
    use ErrorClass::{Fatal, Poison, Transient};
    use RDKafkaErrorCode as C;
    match code {
        // --- poison: this record, or its topic, is at fault (the topic's codes are
        // configuration errors first, `is_configuration`: poison only under
        // `relay.on_config_error = "poison"`) ---------------------------------------
        C::MessageSizeTooLarge => (Poison, "message_size_too_large"),
        C::InvalidMessageSize => (Poison, "invalid_message_size"),
        C::MessageBatchTooLarge => (Poison, "record_list_too_large"),
        C::InvalidRecord => (Poison, "invalid_record"),
        C::InvalidMessage => (Poison, "corrupt_message"),
        C::InvalidTimestamp => (Poison, "invalid_timestamp"),
        C::PolicyViolation => (Poison, "policy_violation"),
        C::UnsupportedForMessageFormat => (Poison, "unsupported_for_message_format"),
        C::TopicAuthorizationFailed => (Poison, "topic_authorization_failed"),
        C::UnknownTopicOrPartition => (Poison, "unknown_topic_or_partition"),
        C::UnknownTopic => (Poison, "unknown_topic"),
        C::UnknownPartition => (Poison, "unknown_partition"),
        C::UnknownTopicId => (Poison, "unknown_topic_id"),
        C::InvalidTopic => (Poison, "invalid_topic"),
        // --- fatal: the client is broken; never poison, stop and restart -------------
        C::Fatal => (Fatal, "fatal"),
        C::ClusterAuthorizationFailed => (Fatal, "cluster_authorization_failed"),
        C::TransactionalIdAuthorizationFailed => (Fatal, "transactional_id_authorization_failed"),
        C::Authentication => (Fatal, "authentication"),
        C::SaslAuthenticationFailed => (Fatal, "sasl_authentication_failed"),
        C::UnsupportedSASLMechanism => (Fatal, "unsupported_sasl_mechanism"),
        C::IllegalSASLState => (Fatal, "illegal_sasl_state"),
        C::SSL => (Fatal, "ssl"),
        C::InvalidRequiredAcks => (Fatal, "invalid_required_acks"),
        // --- transient: the broker or the network; retried forever -------------------
        C::InvalidDifferentRecord => (Transient, "invalid_different_record"),
        C::QueueFull => (Transient, "queue_full"),
        C::MessageTimedOut => (Transient, "message_timed_out"),
        C::RequestTimedOut => (Transient, "request_timed_out"),
        C::OperationTimedOut => (Transient, "operation_timed_out"),
        C::TimedOutQueue => (Transient, "timed_out_queue"),
        C::AllBrokersDown => (Transient, "all_brokers_down"),
        C::BrokerTransportFailure => (Transient, "broker_transport_failure"),
        C::Resolve => (Transient, "resolve"),
        C::NetworkException => (Transient, "network_exception"),
        C::BrokerNotAvailable => (Transient, "broker_not_available"),
        C::LeaderNotAvailable => (Transient, "leader_not_available"),
        C::NotLeaderForPartition => (Transient, "not_leader_for_partition"),
        C::NotEnoughReplicas => (Transient, "not_enough_replicas"),
        C::NotEnoughReplicasAfterAppend => (Transient, "not_enough_replicas_after_append"),
        C::KafkaStorageError => (Transient, "kafka_storage_error"),
        C::ThrottlingQuotaExceeded => (Transient, "throttling_quota_exceeded"),
        C::OutOfOrderSequenceNumber => (Transient, "out_of_order_sequence_number"),
        C::UnknownProducerId => (Transient, "unknown_producer_id"),
        C::InvalidProducerEpoch => (Transient, "invalid_producer_epoch"),
        C::PurgeQueue => (Transient, "purge_queue"),
        C::PurgeInflight => (Transient, "purge_inflight"),
        _ => (Transient, "broker_error"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A broker's refusal for size is what decides about a record the relay cannot
    /// measure in advance (a compressed batch, `cdc::session::too_large`): it must
    /// count against the event, whatever `relay.on_config_error` says, so the usual
    /// retries and then the poison table apply, and never hold the stream.
    #[test]
    fn size_refusals_are_permanent() {
        use RDKafkaErrorCode as C;
        for code in [
            C::MessageSizeTooLarge,
            C::MessageBatchTooLarge,
            C::InvalidMessageSize,
        ] {
            assert!(is_size_error(code), "{code:?}");
            assert!(!is_configuration(code), "{code:?}");
            assert_eq!(classify(code), Failure::Permanent, "{code:?}");
            for poison_configuration_errors in [false, true] {
                assert_eq!(
                    classify(code).under(poison_configuration_errors),
                    Failure::Permanent,
                    "{code:?}"
                );
            }
        }
        assert_eq!(error_kind(C::MessageSizeTooLarge), "message_size_too_large");
        assert_eq!(error_kind(C::MessageBatchTooLarge), "record_list_too_large");
    }

    #[test]
    fn classification_table() {
        use RDKafkaErrorCode as C;
        let poison = [
            C::MessageSizeTooLarge,
            C::InvalidMessageSize,
            C::MessageBatchTooLarge,
            C::InvalidRecord,
            C::InvalidMessage,
            C::InvalidTimestamp,
            C::PolicyViolation,
            C::UnsupportedForMessageFormat,
            C::TopicAuthorizationFailed,
            C::UnknownTopicOrPartition,
            C::UnknownTopic,
            C::UnknownPartition,
            C::UnknownTopicId,
            C::InvalidTopic,
        ];
        let fatal = [
            C::Fatal,
            C::ClusterAuthorizationFailed,
            C::TransactionalIdAuthorizationFailed,
            C::Authentication,
            C::SaslAuthenticationFailed,
            C::UnsupportedSASLMechanism,
            C::IllegalSASLState,
            C::SSL,
            C::InvalidRequiredAcks,
        ];
        let transient = [
            C::InvalidDifferentRecord,
            C::QueueFull,
            C::MessageTimedOut,
            C::RequestTimedOut,
            C::OperationTimedOut,
            C::TimedOutQueue,
            C::AllBrokersDown,
            C::BrokerTransportFailure,
            C::Resolve,
            C::NetworkException,
            C::BrokerNotAvailable,
            C::LeaderNotAvailable,
            C::NotLeaderForPartition,
            C::NotEnoughReplicas,
            C::NotEnoughReplicasAfterAppend,
            C::KafkaStorageError,
            C::ThrottlingQuotaExceeded,
            C::OutOfOrderSequenceNumber,
            C::UnknownProducerId,
            C::InvalidProducerEpoch,
            C::PurgeQueue,
            C::PurgeInflight,
        ];
        for code in poison {
            assert_eq!(error_class(code), ErrorClass::Poison, "{code:?}");
            let expected = if is_configuration(code) {
                Failure::Configuration
            } else {
                Failure::Permanent
            };
            assert_eq!(classify(code), expected, "{code:?}");
        }
        // Not the event's fault: the setup of the topic or the cluster.
        for code in [
            C::TopicAuthorizationFailed,
            C::UnknownTopicOrPartition,
            C::UnknownTopic,
            C::UnknownPartition,
            C::UnknownTopicId,
            C::InvalidTimestamp,
        ] {
            assert_eq!(classify(code), Failure::Configuration, "{code:?}");
            assert_eq!(classify(code).under(false), Failure::Transient);
            assert_eq!(classify(code).under(true), Failure::Permanent);
            assert!(!configuration_fix(code).is_empty());
        }
        for code in [C::MessageSizeTooLarge, C::InvalidRecord] {
            assert_eq!(classify(code).under(false), Failure::Permanent, "{code:?}");
        }
        for code in fatal {
            assert_eq!(error_class(code), ErrorClass::Fatal, "{code:?}");
            assert_eq!(
                classify(code),
                Failure::Transient,
                "{code:?} is never poisoned"
            );
        }
        for code in transient {
            assert_eq!(error_class(code), ErrorClass::Transient, "{code:?}");
            assert_eq!(classify(code), Failure::Transient, "{code:?}");
        }
        // Every listed code has its own stable name; the rest share one.
        let mut names = std::collections::BTreeSet::new();
        for code in poison.iter().chain(&fatal).chain(&transient) {
            let kind = error_kind(*code);
            assert_ne!(kind, "broker_error", "{code:?}");
            assert!(
                kind.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{kind}"
            );
            assert!(names.insert(kind), "duplicate kind {kind}");
        }
        assert_eq!(error_kind(C::OffsetOutOfRange), "broker_error");
        assert_eq!(classify(C::Unknown), Failure::Transient);
        assert_eq!(classify(C::Fail), Failure::Transient);
    }
}
