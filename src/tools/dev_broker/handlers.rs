//! One function per Kafka API: a decoded request and the broker state in, the
//! response out. The versions each API is implemented for are in [`SUPPORTED`];
//! the kafka-protocol crate encodes and decodes every version in those ranges, so a
//! handler only fills the fields that exist in the versions librdkafka 2.12 uses.

use std::collections::BTreeMap;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use kafka_protocol::ResponseError;
use kafka_protocol::messages::add_offsets_to_txn_request::AddOffsetsToTxnRequest;
use kafka_protocol::messages::add_offsets_to_txn_response::AddOffsetsToTxnResponse;
use kafka_protocol::messages::add_partitions_to_txn_request::AddPartitionsToTxnRequest;
use kafka_protocol::messages::add_partitions_to_txn_response::{
    AddPartitionsToTxnPartitionResult, AddPartitionsToTxnResponse, AddPartitionsToTxnTopicResult,
};
use kafka_protocol::messages::api_versions_response::{ApiVersion, ApiVersionsResponse};
use kafka_protocol::messages::create_topics_request::CreateTopicsRequest;
use kafka_protocol::messages::create_topics_response::{
    CreatableTopicResult, CreateTopicsResponse,
};
use kafka_protocol::messages::delete_topics_request::DeleteTopicsRequest;
use kafka_protocol::messages::delete_topics_response::{
    DeletableTopicResult, DeleteTopicsResponse,
};
use kafka_protocol::messages::describe_configs_request::DescribeConfigsRequest;
use kafka_protocol::messages::describe_configs_response::{
    DescribeConfigsResourceResult, DescribeConfigsResponse, DescribeConfigsResult,
};
use kafka_protocol::messages::end_txn_request::EndTxnRequest;
use kafka_protocol::messages::end_txn_response::EndTxnResponse;
use kafka_protocol::messages::fetch_request::FetchRequest;
use kafka_protocol::messages::fetch_response::{
    AbortedTransaction, FetchResponse, FetchableTopicResponse, PartitionData,
};
use kafka_protocol::messages::find_coordinator_request::FindCoordinatorRequest;
use kafka_protocol::messages::find_coordinator_response::FindCoordinatorResponse;
use kafka_protocol::messages::init_producer_id_request::InitProducerIdRequest;
use kafka_protocol::messages::init_producer_id_response::InitProducerIdResponse;
use kafka_protocol::messages::list_offsets_request::ListOffsetsRequest;
use kafka_protocol::messages::list_offsets_response::{
    ListOffsetsPartitionResponse, ListOffsetsResponse, ListOffsetsTopicResponse,
};
use kafka_protocol::messages::metadata_request::MetadataRequest;
use kafka_protocol::messages::metadata_response::{
    MetadataResponse, MetadataResponseBroker, MetadataResponsePartition, MetadataResponseTopic,
};
use kafka_protocol::messages::offset_commit_request::OffsetCommitRequest;
use kafka_protocol::messages::offset_commit_response::{
    OffsetCommitResponse, OffsetCommitResponsePartition, OffsetCommitResponseTopic,
};
use kafka_protocol::messages::offset_fetch_request::OffsetFetchRequest;
use kafka_protocol::messages::offset_fetch_response::{
    OffsetFetchResponse, OffsetFetchResponsePartition, OffsetFetchResponseTopic,
};
use kafka_protocol::messages::offset_for_leader_epoch_request::OffsetForLeaderEpochRequest;
use kafka_protocol::messages::offset_for_leader_epoch_response::{
    EpochEndOffset, OffsetForLeaderEpochResponse, OffsetForLeaderTopicResult,
};
use kafka_protocol::messages::produce_request::ProduceRequest;
use kafka_protocol::messages::produce_response::{
    PartitionProduceResponse, ProduceResponse, TopicProduceResponse,
};
use kafka_protocol::messages::txn_offset_commit_request::TxnOffsetCommitRequest;
use kafka_protocol::messages::txn_offset_commit_response::{
    TxnOffsetCommitResponse, TxnOffsetCommitResponsePartition, TxnOffsetCommitResponseTopic,
};
use kafka_protocol::messages::{ApiKey, BrokerId, ProducerId, TopicName};
use kafka_protocol::protocol::StrBytes;

use super::batch::{self, BatchError, LEADER_EPOCH};
use super::groups::Committed;
use super::log::AppendError;
use super::sequence::SequenceError;
use super::state::{Broker, NODE_ID};
use super::topics::{Topic, TopicError};
use super::txn::{PendingOffset, TopicPartition, TxnError};

/// The APIs and version ranges implemented (and advertised in ApiVersions): the
/// ranges librdkafka 2.12 uses, within what kafka-protocol 0.18 codes. Fetch stops at
/// 12 (13+ name topics by id), Metadata at 12, OffsetFetch at 7 (8+ batch groups).
pub(super) const SUPPORTED: &[(ApiKey, i16, i16)] = &[
    (ApiKey::Produce, 3, 10),
    (ApiKey::Fetch, 4, 12),
    (ApiKey::ListOffsets, 1, 7),
    (ApiKey::Metadata, 0, 12),
    (ApiKey::OffsetCommit, 2, 8),
    (ApiKey::OffsetFetch, 1, 7),
    (ApiKey::FindCoordinator, 0, 2),
    (ApiKey::ApiVersions, 0, 3),
    (ApiKey::CreateTopics, 2, 4),
    (ApiKey::DeleteTopics, 1, 4),
    (ApiKey::InitProducerId, 0, 4),
    (ApiKey::OffsetForLeaderEpoch, 2, 3),
    (ApiKey::AddPartitionsToTxn, 0, 3),
    (ApiKey::AddOffsetsToTxn, 0, 3),
    (ApiKey::EndTxn, 0, 3),
    (ApiKey::TxnOffsetCommit, 0, 3),
    (ApiKey::DescribeConfigs, 1, 4),
];

/// Whether `version` of `key` is implemented.
pub(super) fn supported(key: ApiKey, version: i16) -> bool {
    SUPPORTED
        .iter()
        .any(|&(k, min, max)| k == key && (min..=max).contains(&version))
}

/// `authorized_operations` when the client did not ask for them.
const OMITTED_OPERATIONS: i32 = i32::MIN;
/// DescribeConfigs `config_source` values.
const SOURCE_TOPIC: i8 = 1;
const SOURCE_DEFAULT: i8 = 5;

fn s(text: &str) -> StrBytes {
    StrBytes::from_string(text.to_owned())
}

fn code(e: ResponseError) -> i16 {
    e.code()
}

/// KIP-588: PRODUCER_FENCED only for the versions that know it; older ones get
/// INVALID_PRODUCER_EPOCH (librdkafka treats both as fencing: `rdkafka_txnmgr.c`).
fn fenced_code(producer_fenced_known: bool) -> i16 {
    if producer_fenced_known {
        code(ResponseError::ProducerFenced)
    } else {
        code(ResponseError::InvalidProducerEpoch)
    }
}

fn txn_code(e: &TxnError, producer_fenced_known: bool) -> i16 {
    match e {
        TxnError::UnknownProducerId(_) => code(ResponseError::UnknownProducerId),
        TxnError::Fenced { .. } => fenced_code(producer_fenced_known),
        TxnError::ProducerIdMapping { .. } => code(ResponseError::InvalidProducerIdMapping),
        TxnError::InvalidTimeout(..) => code(ResponseError::InvalidTransactionTimeout),
        TxnError::InvalidState(_) | TxnError::NotInTransaction(_) => {
            code(ResponseError::InvalidTxnState)
        }
    }
}

fn topic_code(e: TopicError) -> i16 {
    match e {
        TopicError::AlreadyExists => code(ResponseError::TopicAlreadyExists),
        TopicError::InvalidName => code(ResponseError::InvalidTopicException),
        TopicError::InvalidPartitions(_) => code(ResponseError::InvalidPartitions),
        TopicError::Unknown => code(ResponseError::UnknownTopicOrPartition),
    }
}

pub(super) fn api_versions(version_supported: bool) -> ApiVersionsResponse {
    let mut r = ApiVersionsResponse::default();
    if !version_supported {
        r.error_code = code(ResponseError::UnsupportedVersion);
    }
    r.api_keys = SUPPORTED
        .iter()
        .map(|&(key, min, max)| {
            ApiVersion::default()
                .with_api_key(key as i16)
                .with_min_version(min)
                .with_max_version(max)
        })
        .collect();
    r.finalized_features_epoch = -1;
    r
}

fn metadata_topic(name: &str, topic: &Topic) -> MetadataResponseTopic {
    let mut t = MetadataResponseTopic::default();
    t.name = Some(TopicName(s(name)));
    t.topic_id = topic.id;
    t.topic_authorized_operations = OMITTED_OPERATIONS;
    t.partitions = (0..topic.partitions.len())
        .filter_map(|i| i32::try_from(i).ok())
        .map(|index| {
            MetadataResponsePartition::default()
                .with_partition_index(index)
                .with_leader_id(BrokerId(NODE_ID))
                .with_leader_epoch(LEADER_EPOCH)
                .with_replica_nodes(vec![BrokerId(NODE_ID)])
                .with_isr_nodes(vec![BrokerId(NODE_ID)])
        })
        .collect();
    t
}

pub(super) fn metadata(b: &mut Broker, req: MetadataRequest, version: i16) -> MetadataResponse {
    let mut r = MetadataResponse::default();
    r.brokers = vec![
        MetadataResponseBroker::default()
            .with_node_id(BrokerId(NODE_ID))
            .with_host(s(&b.settings.host))
            .with_port(b.settings.port),
    ];
    r.cluster_id = Some(s("outbox-relay-dev-broker"));
    r.controller_id = BrokerId(NODE_ID);
    r.cluster_authorized_operations = OMITTED_OPERATIONS;
    let requested = match req.topics {
        // v0: an empty list means every topic; v1+: null does.
        Some(topics) if !(version == 0 && topics.is_empty()) => Some(topics),
        _ => None,
    };
    let Some(requested) = requested else {
        r.topics = b
            .topics
            .iter()
            .map(|(name, topic)| metadata_topic(name, topic))
            .collect();
        return r;
    };
    let may_create =
        b.settings.auto_create_topics && (version < 4 || req.allow_auto_topic_creation);
    for wanted in requested {
        let Some(name) = wanted.name.map(|n| n.0.to_string()) else {
            continue;
        };
        let found = match b.topics.get(&name) {
            Some(topic) => Ok(metadata_topic(&name, topic)),
            None if may_create => b
                .auto_create(&name)
                .map(|topic| metadata_topic(&name, topic)),
            None => Err(TopicError::Unknown),
        };
        r.topics.push(found.unwrap_or_else(|e| {
            let mut t = MetadataResponseTopic::default();
            t.error_code = topic_code(e);
            t.name = Some(TopicName(s(&name)));
            t.topic_authorized_operations = OMITTED_OPERATIONS;
            t
        }));
    }
    r
}

fn batch_code(e: &BatchError) -> i16 {
    match e {
        BatchError::Magic(_) => code(ResponseError::UnsupportedForMessageFormat),
        BatchError::Control | BatchError::Empty => code(ResponseError::InvalidRecord),
        BatchError::Truncated { .. } | BatchError::Invalid(_) => {
            code(ResponseError::CorruptMessage)
        }
    }
}

/// Produces one partition's record set; the base offset of its first batch.
fn produce_partition(
    b: &mut Broker,
    topic: &str,
    partition: i32,
    records: Option<&Bytes>,
) -> Result<i64, (i16, String)> {
    let Some(max_message_bytes) = b.topics.get(topic).map(Topic::max_message_bytes) else {
        return Err((
            code(ResponseError::UnknownTopicOrPartition),
            "unknown topic".into(),
        ));
    };
    if b.topics.partition(topic, partition).is_none() {
        return Err((
            code(ResponseError::UnknownTopicOrPartition),
            "unknown partition".into(),
        ));
    }
    let records =
        records.ok_or_else(|| (code(ResponseError::CorruptMessage), "no records".to_owned()))?;
    let batches = batch::split(records).map_err(|e| (batch_code(&e), e.to_string()))?;
    if batches.len() > 1 && batches.iter().any(|x| x.header.has_producer_id()) {
        return Err((
            code(ResponseError::InvalidRecord),
            "an idempotent produce carries exactly one batch per partition".into(),
        ));
    }
    let tp = TopicPartition {
        topic: topic.to_owned(),
        partition,
    };
    let mut first = None;
    for x in &batches {
        if x.bytes.len() > max_message_bytes {
            return Err((
                code(ResponseError::MessageTooLarge),
                format!("batch of {} bytes", x.bytes.len()),
            ));
        }
        let h = x.header;
        if h.has_producer_id() {
            b.coordinator
                .check_produce(h.producer_id, h.producer_epoch, h.transactional, &tp)
                .map_err(|e| (txn_code(&e, false), e.to_string()))?;
        } else if h.transactional {
            return Err((
                code(ResponseError::InvalidRecord),
                "transactional batch without a producer id".into(),
            ));
        }
        let Some(log) = b.topics.partition_mut(topic, partition) else {
            return Err((
                code(ResponseError::UnknownTopicOrPartition),
                "unknown partition".into(),
            ));
        };
        let appended = log.append(x).map_err(|e| {
            let c = match &e {
                AppendError::Sequence(SequenceError::OutOfOrder { .. }) => {
                    code(ResponseError::OutOfOrderSequenceNumber)
                }
                AppendError::Sequence(SequenceError::StaleEpoch { .. }) => {
                    code(ResponseError::InvalidProducerEpoch)
                }
                AppendError::Batch(be) => batch_code(be),
            };
            (c, e.to_string())
        })?;
        first.get_or_insert(appended.base_offset());
    }
    b.changed();
    first.ok_or_else(|| (code(ResponseError::InvalidRecord), "no batch".into()))
}

/// The message of a partition answered with an injected error.
const INJECTED: &str = "injected by the dev broker's fail-produce";

pub(super) fn produce(b: &mut Broker, req: ProduceRequest) -> ProduceResponse {
    let touched: Vec<(String, i32)> = req
        .topic_data
        .iter()
        .flat_map(|t| {
            t.partition_data
                .iter()
                .map(|p| (t.name.0.to_string(), p.index))
        })
        .collect();
    let mut injected = b.faults.take_produce(&touched).into_iter();
    let mut r = ProduceResponse::default();
    for t in req.topic_data {
        let name = t.name.0.to_string();
        let mut tr = TopicProduceResponse::default();
        tr.name = t.name;
        for p in t.partition_data {
            let mut pr = PartitionProduceResponse::default()
                .with_index(p.index)
                .with_log_append_time_ms(-1)
                .with_log_start_offset(0);
            let outcome = match injected.next().flatten() {
                Some(error_code) => Err((error_code, INJECTED.to_owned())),
                None => produce_partition(b, &name, p.index, p.records.as_ref()),
            };
            match outcome {
                Ok(base_offset) => pr.base_offset = base_offset,
                Err((error_code, message)) => {
                    tracing::debug!(topic = %name, partition = p.index, error_code, %message, "produce refused");
                    pr.error_code = error_code;
                    pr.base_offset = -1;
                    pr.error_message = Some(s(&message));
                }
            }
            tr.partition_responses.push(pr);
        }
        r.responses.push(tr);
    }
    r
}

/// A Fetch response and what the long poll needs to know about it.
#[derive(Debug)]
pub(super) struct Fetched {
    pub(super) response: FetchResponse,
    pub(super) bytes: usize,
    pub(super) errors: bool,
}

fn concat(batches: Vec<Bytes>, bytes: usize) -> Bytes {
    if batches.len() == 1 {
        return batches.into_iter().next().unwrap_or_default();
    }
    let mut out = BytesMut::with_capacity(bytes);
    for b in batches {
        out.extend_from_slice(&b);
    }
    out.freeze()
}

pub(super) fn fetch(b: &Broker, req: &FetchRequest) -> Fetched {
    let read_committed = req.isolation_level == 1;
    let mut budget = usize::try_from(req.max_bytes).unwrap_or(0);
    let mut fetched = Fetched {
        response: FetchResponse::default(),
        bytes: 0,
        errors: false,
    };
    for t in &req.topics {
        let name = t.topic.0.as_str();
        let mut tr = FetchableTopicResponse::default();
        tr.topic = t.topic.clone();
        tr.topic_id = t.topic_id;
        for p in &t.partitions {
            let mut pd = PartitionData::default()
                .with_partition_index(p.partition)
                .with_preferred_read_replica(BrokerId(-1))
                .with_records(Some(Bytes::new()));
            let Some(log) = b.topics.partition(name, p.partition) else {
                pd.error_code = code(ResponseError::UnknownTopicOrPartition);
                pd.high_watermark = -1;
                pd.last_stable_offset = -1;
                pd.log_start_offset = -1;
                fetched.errors = true;
                tr.partitions.push(pd);
                continue;
            };
            pd.high_watermark = log.high_watermark();
            pd.last_stable_offset = log.last_stable_offset();
            pd.log_start_offset = log.log_start_offset();
            pd.aborted_transactions = Some(Vec::new());
            if p.fetch_offset < log.log_start_offset() || p.fetch_offset > log.high_watermark() {
                pd.error_code = code(ResponseError::OffsetOutOfRange);
                fetched.errors = true;
                tr.partitions.push(pd);
                continue;
            }
            let limit = usize::try_from(p.partition_max_bytes)
                .unwrap_or(0)
                .min(budget);
            // KIP-74: the first batch of the response is returned whatever the limits.
            if limit > 0 || fetched.bytes == 0 {
                let end = log.end_for(req.isolation_level);
                let read = log.read(p.fetch_offset, end, limit);
                if read_committed {
                    pd.aborted_transactions = Some(
                        log.aborted_between(p.fetch_offset, read.end_offset)
                            .into_iter()
                            .map(|(producer_id, first_offset)| {
                                AbortedTransaction::default()
                                    .with_producer_id(ProducerId(producer_id))
                                    .with_first_offset(first_offset)
                            })
                            .collect(),
                    );
                }
                budget = budget.saturating_sub(read.bytes);
                fetched.bytes += read.bytes;
                pd.records = Some(concat(read.batches, read.bytes));
            }
            tr.partitions.push(pd);
        }
        fetched.response.responses.push(tr);
    }
    fetched
}

pub(super) fn list_offsets(b: &Broker, req: ListOffsetsRequest) -> ListOffsetsResponse {
    let mut r = ListOffsetsResponse::default();
    for t in req.topics {
        let mut tr = ListOffsetsTopicResponse::default();
        for p in &t.partitions {
            let mut pr = ListOffsetsPartitionResponse::default()
                .with_partition_index(p.partition_index)
                .with_timestamp(-1)
                .with_offset(-1)
                .with_leader_epoch(LEADER_EPOCH);
            match b.topics.partition(t.name.0.as_str(), p.partition_index) {
                None => pr.error_code = code(ResponseError::UnknownTopicOrPartition),
                Some(log) => {
                    let end = log.end_for(req.isolation_level);
                    let found = match p.timestamp {
                        -2 => Some((log.log_start_offset(), -1)),
                        -1 => Some((end, -1)),
                        -3 => log.max_timestamp(),
                        ts => log.offset_for_timestamp(ts),
                    };
                    if let Some((offset, timestamp)) = found.filter(|(o, _)| *o <= end) {
                        pr.offset = offset;
                        pr.timestamp = timestamp;
                    }
                }
            }
            tr.partitions.push(pr);
        }
        tr.name = t.name;
        r.topics.push(tr);
    }
    r
}

pub(super) fn offset_for_leader_epoch(
    b: &Broker,
    req: OffsetForLeaderEpochRequest,
) -> OffsetForLeaderEpochResponse {
    let mut r = OffsetForLeaderEpochResponse::default();
    for t in req.topics {
        let mut tr = OffsetForLeaderTopicResult::default();
        for p in &t.partitions {
            let mut e = EpochEndOffset::default()
                .with_partition(p.partition)
                .with_leader_epoch(-1)
                .with_end_offset(-1);
            match b.topics.partition(t.topic.0.as_str(), p.partition) {
                None => e.error_code = code(ResponseError::UnknownTopicOrPartition),
                // The only epoch ever is 0: it ends at the log end.
                Some(log) if p.leader_epoch <= LEADER_EPOCH => {
                    e.leader_epoch = LEADER_EPOCH;
                    e.end_offset = log.high_watermark();
                }
                Some(_) => {}
            }
            tr.partitions.push(e);
        }
        tr.topic = t.topic;
        r.topics.push(tr);
    }
    r
}

pub(super) fn find_coordinator(
    b: &mut Broker,
    req: &FindCoordinatorRequest,
) -> FindCoordinatorResponse {
    let mut r = FindCoordinatorResponse::default();
    let injected = if req.key_type == 1 {
        b.faults.take_coordinator("FindCoordinator")
    } else {
        None
    };
    // 0: group, 1: transaction; this broker coordinates both.
    if let Some(error_code) = injected {
        r.error_code = error_code;
        r.node_id = BrokerId(-1);
        r.port = -1;
    } else if req.key_type == 0 || req.key_type == 1 {
        r.node_id = BrokerId(NODE_ID);
        r.host = s(&b.settings.host);
        r.port = b.settings.port;
    } else {
        r.error_code = code(ResponseError::InvalidRequest);
        r.node_id = BrokerId(-1);
        r.port = -1;
    }
    r
}

pub(super) fn init_producer_id(
    b: &mut Broker,
    req: &InitProducerIdRequest,
    version: i16,
) -> InitProducerIdResponse {
    let mut r = InitProducerIdResponse::default();
    let tid = req.transactional_id.as_ref().map(|t| t.0.as_str());
    if tid.is_some()
        && let Some(error_code) = b.faults.take_coordinator("InitProducerId")
    {
        r.error_code = error_code;
        r.producer_id = ProducerId(-1);
        r.producer_epoch = -1;
        return r;
    }
    match b.coordinator.init_producer_id(
        tid,
        req.transaction_timeout_ms,
        req.producer_id.0,
        req.producer_epoch,
    ) {
        Ok((issued, aborted)) => {
            if let Some(markers) = aborted {
                tracing::info!(
                    transactional_id = tid.unwrap_or_default(),
                    producer_id = markers.producer_id,
                    "a new producer instance aborted the open transaction of the old one"
                );
                b.end_transaction(&markers, Vec::new());
            }
            tracing::debug!(
                transactional_id = tid.unwrap_or_default(),
                producer_id = issued.producer_id,
                epoch = issued.epoch,
                "producer id issued"
            );
            r.producer_id = ProducerId(issued.producer_id);
            r.producer_epoch = issued.epoch;
        }
        Err(e) => {
            tracing::debug!(error = %e, "InitProducerId refused");
            r.error_code = txn_code(&e, version >= 4);
            r.producer_id = ProducerId(-1);
            r.producer_epoch = -1;
        }
    }
    r
}

pub(super) fn add_partitions_to_txn(
    b: &mut Broker,
    req: AddPartitionsToTxnRequest,
    version: i16,
    now: Instant,
) -> AddPartitionsToTxnResponse {
    let tid = req.v3_and_below_transactional_id.0.to_string();
    let wanted: Vec<TopicPartition> = req
        .v3_and_below_topics
        .iter()
        .flat_map(|t| {
            t.partitions.iter().map(|&partition| TopicPartition {
                topic: t.name.0.to_string(),
                partition,
            })
        })
        .collect();
    let injected = b.faults.take_coordinator("AddPartitionsToTxn");
    let missing = |tp: &TopicPartition| b.topics.partition(&tp.topic, tp.partition).is_none();
    let any_missing = injected.is_none() && wanted.iter().any(missing);
    let mut per_partition: Vec<(TopicPartition, i16)> = if let Some(c) = injected {
        // Request-level: every partition gets it, nothing is added.
        wanted.iter().map(|tp| (tp.clone(), c)).collect()
    } else if any_missing {
        // As Kafka: the unknown ones fail, the others are not attempted.
        wanted
            .iter()
            .map(|tp| {
                let c = if missing(tp) {
                    code(ResponseError::UnknownTopicOrPartition)
                } else {
                    code(ResponseError::OperationNotAttempted)
                };
                (tp.clone(), c)
            })
            .collect()
    } else {
        Vec::new()
    };
    if injected.is_none() && !any_missing {
        let outcome = b.coordinator.add_partitions(
            &tid,
            req.v3_and_below_producer_id.0,
            req.v3_and_below_producer_epoch,
            wanted.iter().cloned(),
            now,
        );
        let c = match &outcome {
            Ok(()) => 0,
            Err(e) => {
                tracing::debug!(transactional_id = %tid, error = %e, "AddPartitionsToTxn refused");
                txn_code(e, version >= 2)
            }
        };
        per_partition = wanted.into_iter().map(|tp| (tp, c)).collect();
    }
    let mut by_topic: BTreeMap<String, Vec<AddPartitionsToTxnPartitionResult>> = BTreeMap::new();
    for (tp, c) in per_partition {
        by_topic.entry(tp.topic).or_default().push(
            AddPartitionsToTxnPartitionResult::default()
                .with_partition_index(tp.partition)
                .with_partition_error_code(c),
        );
    }
    let mut r = AddPartitionsToTxnResponse::default();
    r.results_by_topic_v3_and_below = by_topic
        .into_iter()
        .map(|(topic, results)| {
            AddPartitionsToTxnTopicResult::default()
                .with_name(TopicName(s(&topic)))
                .with_results_by_partition(results)
        })
        .collect();
    r
}

pub(super) fn add_offsets_to_txn(
    b: &mut Broker,
    req: &AddOffsetsToTxnRequest,
    version: i16,
    now: Instant,
) -> AddOffsetsToTxnResponse {
    let mut r = AddOffsetsToTxnResponse::default();
    if let Some(error_code) = b.faults.take_coordinator("AddOffsetsToTxn") {
        r.error_code = error_code;
        return r;
    }
    if let Err(e) = b.coordinator.add_offsets(
        req.transactional_id.0.as_str(),
        req.producer_id.0,
        req.producer_epoch,
        now,
    ) {
        r.error_code = txn_code(&e, version >= 2);
    }
    r
}

pub(super) fn txn_offset_commit(
    b: &mut Broker,
    req: TxnOffsetCommitRequest,
    version: i16,
) -> TxnOffsetCommitResponse {
    let group = req.group_id.0.to_string();
    let pending: Vec<PendingOffset> = req
        .topics
        .iter()
        .flat_map(|t| {
            t.partitions.iter().map(|p| PendingOffset {
                group: group.clone(),
                topic: t.name.0.to_string(),
                partition: p.partition_index,
                offset: p.committed_offset,
                metadata: p.committed_metadata.as_ref().map(|m| m.to_string()),
            })
        })
        .collect();
    let c = match b.coordinator.txn_offset_commit(
        req.transactional_id.0.as_str(),
        req.producer_id.0,
        req.producer_epoch,
        pending,
    ) {
        Ok(()) => 0,
        Err(e) => txn_code(&e, version >= 3),
    };
    let mut r = TxnOffsetCommitResponse::default();
    r.topics = req
        .topics
        .into_iter()
        .map(|t| {
            TxnOffsetCommitResponseTopic::default()
                .with_partitions(
                    t.partitions
                        .iter()
                        .map(|p| {
                            TxnOffsetCommitResponsePartition::default()
                                .with_partition_index(p.partition_index)
                                .with_error_code(c)
                        })
                        .collect(),
                )
                .with_name(t.name)
        })
        .collect();
    r
}

pub(super) fn end_txn(b: &mut Broker, req: &EndTxnRequest, version: i16) -> EndTxnResponse {
    let mut r = EndTxnResponse::default();
    let tid = req.transactional_id.0.as_str();
    if let Some(error_code) = b.faults.take_end_txn() {
        r.error_code = error_code;
        return r;
    }
    match b
        .coordinator
        .end_txn(tid, req.producer_id.0, req.producer_epoch, req.committed)
    {
        Ok(ended) => {
            if let Some(markers) = &ended.markers {
                b.end_transaction(markers, ended.offsets);
            }
        }
        Err(e) => {
            tracing::debug!(transactional_id = tid, error = %e, "EndTxn refused");
            r.error_code = txn_code(&e, version >= 2);
        }
    }
    r
}

pub(super) fn offset_commit(b: &mut Broker, req: OffsetCommitRequest) -> OffsetCommitResponse {
    let group = req.group_id.0.to_string();
    let mut r = OffsetCommitResponse::default();
    for t in req.topics {
        let name = t.name.0.to_string();
        let mut tr = OffsetCommitResponseTopic::default();
        for p in t.partitions {
            let mut pr =
                OffsetCommitResponsePartition::default().with_partition_index(p.partition_index);
            if b.topics.partition(&name, p.partition_index).is_some() {
                b.offsets.commit(
                    &group,
                    &name,
                    p.partition_index,
                    Committed {
                        offset: p.committed_offset,
                        metadata: p.committed_metadata.map(|m| m.to_string()),
                    },
                );
            } else {
                pr.error_code = code(ResponseError::UnknownTopicOrPartition);
            }
            tr.partitions.push(pr);
        }
        tr.name = t.name;
        r.topics.push(tr);
    }
    r
}

fn fetched_offset(partition: i32, c: Option<&Committed>) -> OffsetFetchResponsePartition {
    OffsetFetchResponsePartition::default()
        .with_partition_index(partition)
        .with_committed_offset(c.map_or(-1, |c| c.offset))
        .with_committed_leader_epoch(-1)
        .with_metadata(Some(s(c.and_then(|c| c.metadata.as_deref()).unwrap_or(""))))
}

pub(super) fn offset_fetch(b: &Broker, req: OffsetFetchRequest) -> OffsetFetchResponse {
    let group = req.group_id.0.as_str();
    let mut r = OffsetFetchResponse::default();
    match req.topics {
        Some(topics) => {
            for t in topics {
                let mut tr = OffsetFetchResponseTopic::default();
                tr.partitions = t
                    .partition_indexes
                    .iter()
                    .map(|&p| fetched_offset(p, b.offsets.get(group, t.name.0.as_str(), p)))
                    .collect();
                tr.name = t.name;
                r.topics.push(tr);
            }
        }
        None => {
            let mut by_topic: BTreeMap<&str, Vec<OffsetFetchResponsePartition>> = BTreeMap::new();
            for (topic, partition, c) in b.offsets.all(group) {
                by_topic
                    .entry(topic)
                    .or_default()
                    .push(fetched_offset(partition, Some(c)));
            }
            r.topics = by_topic
                .into_iter()
                .map(|(topic, partitions)| {
                    OffsetFetchResponseTopic::default()
                        .with_name(TopicName(s(topic)))
                        .with_partitions(partitions)
                })
                .collect();
        }
    }
    r
}

pub(super) fn create_topics(b: &mut Broker, req: CreateTopicsRequest) -> CreateTopicsResponse {
    let mut r = CreateTopicsResponse::default();
    for t in req.topics {
        let name = t.name.0.to_string();
        let partitions = match (t.num_partitions, t.assignments.len()) {
            (-1, 0) => b.settings.default_partitions,
            (-1, n) => i32::try_from(n).unwrap_or(i32::MAX),
            (n, _) => n,
        };
        let overrides: BTreeMap<String, String> = t
            .configs
            .iter()
            .filter_map(|c| Some((c.name.to_string(), c.value.as_ref()?.to_string())))
            .collect();
        let mut result = CreatableTopicResult::default()
            .with_num_partitions(partitions)
            .with_replication_factor(1);
        let outcome = if t.replication_factor != -1 && t.replication_factor != 1 {
            Err((
                code(ResponseError::InvalidReplicationFactor),
                format!(
                    "replication factor {} on a single broker",
                    t.replication_factor
                ),
            ))
        } else if req.validate_only {
            if b.topics.get(&name).is_some() {
                Err((topic_code(TopicError::AlreadyExists), "exists".to_owned()))
            } else {
                Ok(())
            }
        } else {
            b.topics
                .create(&name, partitions, overrides)
                .map(|topic| result.topic_id = topic.id)
                .map_err(|e| (topic_code(e), e.to_string()))
        };
        match outcome {
            Ok(()) => tracing::info!(topic = %name, partitions, "topic created"),
            Err((c, message)) => {
                result.error_code = c;
                result.error_message = Some(s(&message));
            }
        }
        result.name = t.name;
        r.topics.push(result);
    }
    r
}

pub(super) fn delete_topics(b: &mut Broker, req: DeleteTopicsRequest) -> DeleteTopicsResponse {
    let mut r = DeleteTopicsResponse::default();
    for name in req.topic_names {
        let mut result = DeletableTopicResult::default();
        match b.topics.delete(name.0.as_str()) {
            Ok(_) => tracing::info!(topic = %name.0.as_str(), "topic deleted"),
            Err(e) => result.error_code = topic_code(e),
        }
        result.name = Some(name);
        r.responses.push(result);
    }
    b.changed();
    r
}

/// Broker-level configs reported for DescribeConfigs(BROKER).
fn broker_configs(b: &Broker) -> Vec<(String, String, bool)> {
    vec![
        (
            "auto.create.topics.enable".to_owned(),
            b.settings.auto_create_topics.to_string(),
            true,
        ),
        ("message.max.bytes".to_owned(), "1048588".to_owned(), true),
        (
            "transaction.max.timeout.ms".to_owned(),
            b.coordinator.max_timeout_ms().to_string(),
            b.coordinator.max_timeout_ms() == super::txn::MAX_TRANSACTION_TIMEOUT_MS,
        ),
    ]
}

pub(super) fn describe_configs(b: &Broker, req: DescribeConfigsRequest) -> DescribeConfigsResponse {
    let mut r = DescribeConfigsResponse::default();
    for res in req.resources {
        let mut result = DescribeConfigsResult::default()
            .with_resource_type(res.resource_type)
            .with_resource_name(res.resource_name.clone());
        let all: Option<Vec<(String, String, bool)>> = match res.resource_type {
            2 => b.topics.get(res.resource_name.as_str()).map(Topic::configs),
            4 => Some(broker_configs(b)),
            _ => {
                result.error_code = code(ResponseError::InvalidRequest);
                result.error_message = Some(s("only TOPIC and BROKER resources"));
                r.results.push(result);
                continue;
            }
        };
        let Some(all) = all else {
            result.error_code = code(ResponseError::UnknownTopicOrPartition);
            result.error_message = Some(s("unknown topic"));
            r.results.push(result);
            continue;
        };
        let wanted = |k: &str| {
            res.configuration_keys
                .as_ref()
                .is_none_or(|keys| keys.iter().any(|w| w.as_str() == k))
        };
        result.configs = all
            .into_iter()
            .filter(|(k, _, _)| wanted(k))
            .map(|(k, v, default)| {
                DescribeConfigsResourceResult::default()
                    .with_name(s(&k))
                    .with_value(Some(s(&v)))
                    .with_config_source(if default {
                        SOURCE_DEFAULT
                    } else {
                        SOURCE_TOPIC
                    })
            })
            .collect();
        r.results.push(result);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::super::batch::tests::produced;
    use super::super::state::Settings;
    use super::*;
    use kafka_protocol::messages::TransactionalId;
    use kafka_protocol::messages::fetch_request::{FetchPartition, FetchTopic};
    use kafka_protocol::messages::produce_request::{PartitionProduceData, TopicProduceData};

    fn broker() -> Broker {
        let mut b = Broker::new(Settings {
            host: "127.0.0.1".into(),
            port: 9092,
            default_partitions: 2,
            auto_create_topics: true,
            transaction_max_timeout_ms: super::super::txn::MAX_TRANSACTION_TIMEOUT_MS,
        });
        b.auto_create("t").expect("create");
        b
    }

    fn produce_one(b: &mut Broker, partition: i32, records: Bytes) -> (i16, i64) {
        let req = ProduceRequest::default()
            .with_acks(-1)
            .with_topic_data(vec![
                TopicProduceData::default()
                    .with_name(TopicName(s("t")))
                    .with_partition_data(vec![
                        PartitionProduceData::default()
                            .with_index(partition)
                            .with_records(Some(records)),
                    ]),
            ]);
        let r = produce(b, req);
        let p = &r.responses[0].partition_responses[0];
        (p.error_code, p.base_offset)
    }

    fn fetch_one(b: &Broker, partition: i32, offset: i64, isolation_level: i8) -> PartitionData {
        let req = FetchRequest::default()
            .with_max_bytes(1 << 20)
            .with_isolation_level(isolation_level)
            .with_topics(vec![
                FetchTopic::default()
                    .with_topic(TopicName(s("t")))
                    .with_partitions(vec![
                        FetchPartition::default()
                            .with_partition(partition)
                            .with_fetch_offset(offset)
                            .with_partition_max_bytes(1 << 20),
                    ]),
            ]);
        fetch(b, &req).response.responses[0].partitions[0].clone()
    }

    fn init(b: &mut Broker, tid: &str) -> (i64, i16) {
        let req = InitProducerIdRequest::default()
            .with_transactional_id(Some(TransactionalId(s(tid))))
            .with_transaction_timeout_ms(60_000)
            .with_producer_id(ProducerId(-1))
            .with_producer_epoch(-1);
        let r = init_producer_id(b, &req, 4);
        assert_eq!(r.error_code, 0);
        (r.producer_id.0, r.producer_epoch)
    }

    #[test]
    fn advertises_only_what_it_implements() {
        let r = api_versions(true);
        assert_eq!(r.api_keys.len(), SUPPORTED.len());
        for &(key, min, max) in SUPPORTED {
            let valid = key.valid_versions();
            assert!(
                valid.min <= min && max <= valid.max,
                "{key:?} {min}..={max}"
            );
        }
        assert!(supported(ApiKey::Fetch, 12));
        assert!(!supported(ApiKey::Fetch, 13));
        assert!(!supported(ApiKey::JoinGroup, 0));
    }

    #[test]
    fn transactional_produce_needs_add_partitions_and_fetch_honours_isolation() {
        let mut b = broker();
        let (pid, epoch) = init(&mut b, "x");
        let (err, _) = produce_one(&mut b, 0, produced(pid, epoch, 0, 2, true));
        assert_eq!(err, code(ResponseError::InvalidTxnState));
        b.coordinator
            .add_partitions(
                "x",
                pid,
                epoch,
                [TopicPartition {
                    topic: "t".into(),
                    partition: 0,
                }],
                Instant::now(),
            )
            .expect("add");
        assert_eq!(
            produce_one(&mut b, 0, produced(pid, epoch, 0, 2, true)),
            (0, 0)
        );
        // A retry is answered with the original offset.
        assert_eq!(
            produce_one(&mut b, 0, produced(pid, epoch, 0, 2, true)),
            (0, 0)
        );
        let committed = fetch_one(&b, 0, 0, 1);
        assert_eq!(
            (committed.high_watermark, committed.last_stable_offset),
            (2, 0)
        );
        assert_eq!(committed.records.map(|r| r.len()), Some(0));
        let uncommitted = fetch_one(&b, 0, 0, 0);
        assert!(uncommitted.records.is_some_and(|r| !r.is_empty()));
        // Abort: the range is reported to read_committed readers.
        let r = end_txn(
            &mut b,
            &EndTxnRequest::default()
                .with_transactional_id(TransactionalId(s("x")))
                .with_producer_id(ProducerId(pid))
                .with_producer_epoch(epoch)
                .with_committed(false),
            1,
        );
        assert_eq!(r.error_code, 0);
        let after = fetch_one(&b, 0, 0, 1);
        assert_eq!((after.high_watermark, after.last_stable_offset), (3, 3));
        let aborted = after.aborted_transactions.unwrap_or_default();
        assert_eq!(aborted.len(), 1);
        assert_eq!(
            (aborted[0].producer_id.0, aborted[0].first_offset),
            (pid, 0)
        );
    }

    #[test]
    fn unknown_producer_and_sequence_gap_are_refused() {
        let mut b = broker();
        let (err, _) = produce_one(&mut b, 0, produced(99, 0, 0, 1, false));
        assert_eq!(err, code(ResponseError::UnknownProducerId));
        let (issued, _) = b
            .coordinator
            .init_producer_id(None, 0, -1, -1)
            .expect("init");
        let pid = issued.producer_id;
        assert_eq!(
            produce_one(&mut b, 1, produced(pid, 0, 0, 3, false)),
            (0, 0)
        );
        let (err, _) = produce_one(&mut b, 1, produced(pid, 0, 5, 1, false));
        assert_eq!(err, code(ResponseError::OutOfOrderSequenceNumber));
        // KIP-360 local bump: a new epoch restarts at 0.
        assert_eq!(
            produce_one(&mut b, 1, produced(pid, 1, 0, 1, false)),
            (0, 3)
        );
        let (err, _) = produce_one(&mut b, 1, produced(pid, 0, 3, 1, false));
        assert_eq!(err, code(ResponseError::InvalidProducerEpoch));
    }

    #[test]
    fn fenced_codes_depend_on_the_version() {
        let mut b = broker();
        let (pid, epoch) = init(&mut b, "x");
        init(&mut b, "x");
        let req = EndTxnRequest::default()
            .with_transactional_id(TransactionalId(s("x")))
            .with_producer_id(ProducerId(pid))
            .with_producer_epoch(epoch)
            .with_committed(true);
        assert_eq!(
            end_txn(&mut b, &req, 1).error_code,
            code(ResponseError::InvalidProducerEpoch)
        );
        assert_eq!(
            end_txn(&mut b, &req, 2).error_code,
            code(ResponseError::ProducerFenced)
        );
    }

    #[test]
    fn fetch_out_of_range_and_unknown_partition() {
        let b = broker();
        assert_eq!(
            fetch_one(&b, 0, 5, 0).error_code,
            code(ResponseError::OffsetOutOfRange)
        );
        assert_eq!(
            fetch_one(&b, 7, 0, 0).error_code,
            code(ResponseError::UnknownTopicOrPartition)
        );
    }

    fn arm(b: &mut Broker, line: &str) -> String {
        let command = super::super::faults::parse(line).expect(line);
        b.control(command, Instant::now())
    }

    fn add_partitions(b: &mut Broker, tid: &str, pid: i64, epoch: i16) -> Vec<i16> {
        let req = AddPartitionsToTxnRequest::default()
            .with_v3_and_below_transactional_id(TransactionalId(s(tid)))
            .with_v3_and_below_producer_id(ProducerId(pid))
            .with_v3_and_below_producer_epoch(epoch)
            .with_v3_and_below_topics(vec![
                kafka_protocol::messages::add_partitions_to_txn_request::AddPartitionsToTxnTopic::default()
                    .with_name(TopicName(s("t")))
                    .with_partitions(vec![0, 1]),
            ]);
        add_partitions_to_txn(b, req, 3, Instant::now())
            .results_by_topic_v3_and_below
            .iter()
            .flat_map(|t| {
                t.results_by_partition
                    .iter()
                    .map(|p| p.partition_error_code)
            })
            .collect()
    }

    fn end(b: &mut Broker, tid: &str, pid: i64, epoch: i16, commit: bool) -> i16 {
        let req = EndTxnRequest::default()
            .with_transactional_id(TransactionalId(s(tid)))
            .with_producer_id(ProducerId(pid))
            .with_producer_epoch(epoch)
            .with_committed(commit);
        end_txn(b, &req, 3).error_code
    }

    #[test]
    fn fail_produce_answers_the_error_once_then_appends() {
        let mut b = broker();
        let (issued, _) = b
            .coordinator
            .init_producer_id(None, 0, -1, -1)
            .expect("init");
        let pid = issued.producer_id;
        let reply = arm(&mut b, "fail-produce t 0 NOT_LEADER_OR_FOLLOWER");
        assert_eq!(reply, "t 0 NOT_LEADER_OR_FOLLOWER (6) x1");
        // The other partition is not touched.
        assert_eq!(
            produce_one(&mut b, 1, produced(pid, 0, 0, 1, false)),
            (0, 0)
        );
        assert_eq!(
            produce_one(&mut b, 0, produced(pid, 0, 0, 2, false)),
            (code(ResponseError::NotLeaderOrFollower), -1)
        );
        assert_eq!(fetch_one(&b, 0, 0, 0).high_watermark, 0, "nothing appended");
        // The retry (same sequence) is appended, at offset 0.
        assert_eq!(
            produce_one(&mut b, 0, produced(pid, 0, 0, 2, false)),
            (0, 0)
        );
        assert_eq!(fetch_one(&b, 0, 0, 0).high_watermark, 2);
        // Numeric codes, `*`, counts.
        arm(&mut b, "fail-produce t * 44 2");
        for _ in 0..2 {
            assert_eq!(
                produce_one(&mut b, 1, produced(pid, 0, 1, 1, false)),
                (44, -1)
            );
        }
        assert_eq!(
            produce_one(&mut b, 1, produced(pid, 0, 1, 1, false)),
            (0, 1)
        );
    }

    #[test]
    fn end_txn_error_leaves_the_transaction_open() {
        let mut b = broker();
        let (pid, epoch) = init(&mut b, "x");
        assert_eq!(add_partitions(&mut b, "x", pid, epoch), vec![0, 0]);
        assert_eq!(
            produce_one(&mut b, 0, produced(pid, epoch, 0, 1, true)),
            (0, 0)
        );
        arm(&mut b, "end-txn-error CONCURRENT_TRANSACTIONS 2");
        for commit in [true, false] {
            assert_eq!(
                end(&mut b, "x", pid, epoch, commit),
                code(ResponseError::ConcurrentTransactions)
            );
        }
        let open = fetch_one(&b, 0, 0, 1);
        assert_eq!((open.high_watermark, open.last_stable_offset), (1, 0));
        // Still open: more records go in, then the commit goes through.
        assert_eq!(
            produce_one(&mut b, 1, produced(pid, epoch, 0, 1, true)),
            (0, 0)
        );
        assert_eq!(end(&mut b, "x", pid, epoch, true), 0);
        let committed = fetch_one(&b, 0, 0, 1);
        assert_eq!(
            (committed.high_watermark, committed.last_stable_offset),
            (2, 2)
        );
    }

    #[test]
    fn coordinator_error_changes_no_state() {
        let mut b = broker();
        let (pid, epoch) = init(&mut b, "x");
        arm(&mut b, "coordinator-error NOT_COORDINATOR 5");
        let not_coordinator = code(ResponseError::NotCoordinator);
        // Group lookups and idempotent producers are not the transaction
        // coordinator's: untouched, and they spend nothing.
        let group = FindCoordinatorRequest::default().with_key_type(0);
        assert_eq!(find_coordinator(&mut b, &group).error_code, 0);
        let idempotent = InitProducerIdRequest::default()
            .with_transactional_id(None)
            .with_producer_id(ProducerId(-1))
            .with_producer_epoch(-1);
        assert_eq!(init_producer_id(&mut b, &idempotent, 4).error_code, 0);

        let txn = FindCoordinatorRequest::default()
            .with_key_type(1)
            .with_key(s("x"));
        let found = find_coordinator(&mut b, &txn);
        assert_eq!((found.error_code, found.node_id.0), (not_coordinator, -1));
        let req = InitProducerIdRequest::default()
            .with_transactional_id(Some(TransactionalId(s("x"))))
            .with_transaction_timeout_ms(60_000)
            .with_producer_id(ProducerId(-1))
            .with_producer_epoch(-1);
        assert_eq!(
            init_producer_id(&mut b, &req, 4).error_code,
            not_coordinator
        );
        assert_eq!(
            add_partitions(&mut b, "x", pid, epoch),
            vec![not_coordinator, not_coordinator]
        );
        // Not added: a transactional produce is refused.
        assert_eq!(
            produce_one(&mut b, 0, produced(pid, epoch, 0, 1, true)).0,
            code(ResponseError::InvalidTxnState)
        );
        let offsets = AddOffsetsToTxnRequest::default()
            .with_transactional_id(TransactionalId(s("x")))
            .with_producer_id(ProducerId(pid))
            .with_producer_epoch(epoch);
        assert_eq!(
            add_offsets_to_txn(&mut b, &offsets, 3, Instant::now()).error_code,
            not_coordinator
        );
        assert_eq!(end(&mut b, "x", pid, epoch, false), not_coordinator);
        // Spent: the epoch was not bumped by the refused InitProducerId.
        assert_eq!(add_partitions(&mut b, "x", pid, epoch), vec![0, 0]);
        assert_eq!(find_coordinator(&mut b, &txn).error_code, 0);
    }

    #[test]
    fn abort_transactions_aborts_and_fences() {
        let mut b = broker();
        let (pid, epoch) = init(&mut b, "x");
        assert_eq!(arm(&mut b, "abort-transactions"), "0 aborted");
        add_partitions(&mut b, "x", pid, epoch);
        assert_eq!(
            produce_one(&mut b, 0, produced(pid, epoch, 0, 1, true)),
            (0, 0)
        );
        assert_eq!(arm(&mut b, "abort-transactions"), "1 aborted");
        let after = fetch_one(&b, 0, 0, 1);
        // The record and the ABORT marker, both settled.
        assert_eq!((after.high_watermark, after.last_stable_offset), (2, 2));
        assert_eq!(after.aborted_transactions.map(|a| a.len()), Some(1));
        assert_eq!(
            end(&mut b, "x", pid, epoch, true),
            code(ResponseError::ProducerFenced)
        );
    }

    #[test]
    fn describe_configs_reports_the_size_limit() {
        let b = broker();
        let req = DescribeConfigsRequest::default().with_resources(vec![
            kafka_protocol::messages::describe_configs_request::DescribeConfigsResource::default()
                .with_resource_type(2)
                .with_resource_name(s("t"))
                .with_configuration_keys(None),
        ]);
        let r = describe_configs(&b, req);
        let configs = &r.results[0].configs;
        assert!(
            configs
                .iter()
                .any(|c| c.name.as_str() == "max.message.bytes"
                    && c.value.as_ref().map(|v| v.as_str()) == Some("1048588"))
        );
    }
}
