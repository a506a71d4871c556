//! The mapping rules: one `pgoutput` `Insert` into the outbox table, or one row
//! given as column text, becomes one Kafka record ([`OutboxEvent`]) or one
//! [`UnmappableRow`].
//!
//! [`OutboxMapper::map_insert`] (the CDC relay) and [`OutboxMapper::map_row`] (the
//! polling relay, `replay`, the cutover) share [`OutboxMapper::build`], so `run`,
//! `poll` and `replay` cannot drift apart (`docs/architecture.md#the-kafka-record`).
//! The mapper is pure — no I/O, no clock, no logging — so the sans-IO core, the
//! benchmarks and the fuzzer drive it directly. The checks run in the order of the
//! record contract (key, idempotency key, payload, topic, `created_at`, envelope,
//! headers), and the first failing one names the row's error kind.
//!
//! # Cost
//!
//! Mapping a row allocates the topic `String`, the headers `Vec` and the two short
//! `occurred_at` / `source_lsn` header values (plus the envelope when configured,
//! the decoded payload for `bytea`, and the names and escaped values of the row's
//! `headers` entries). Key, payload, idempotency key, event id and the
//! `event_type` / `aggregate_type` header values are zero-copy slices of the
//! replication message; each is moved into the record once, so a field costs one
//! reference-count increment. The rendered topic is not cached: a cache hit would
//! still copy the name into the record's `String`, which costs about what
//! rendering a template of a few segments does.

use std::borrow::Cow;
use std::sync::Arc;

use bytes::Bytes;

use super::bytea::decode_bytea_text;
use super::cloudevents::{CloudEvents, is_cloudevents_header};
use super::columns::{FIELD_COUNT, Field, FieldNames};
use super::envelope::{Envelope, build_envelope};
use super::headers::parse_header_object;
use super::message::{self, MessageMapped};
use super::record::{
    EventSource, HEADER_AGGREGATE_TYPE, HEADER_EVENT_TYPE, HEADER_IDEMPOTENCY_KEY,
    HEADER_OCCURRED_AT, HEADER_SOURCE_LSN, HeaderName, MapError, Mapped, OutboxEvent, OutboxRow,
    PayloadFormat, PoisonFields, RESERVED_HEADERS, Reject, RelationStatus, UnmappableRow,
    error_kind, is_reserved_header, lossy, payload_text, poison_timestamp, put_lsn,
};
use super::relation::{
    OutboxRelation, RelationCache, RelationEntry, RowRef, extract_row, poison_from_tuple, status_of,
};
use super::timestamp::{RFC3339_LEN, parse_pg_timestamp, put_rfc3339};
use super::topic::{TopicTemplate, validate_topic_name};
use crate::config::{
    Config, ConfigError, EnvelopeConfig, KafkaConfig, OutboxConfig, Placement, PlacementTarget,
    qualified_name,
};
use crate::lsn::Lsn;
use crate::postgres::pgoutput::{Insert, LogicalDecodingMessage, Relation};

/// Maps outbox inserts to Kafka records; holds the relation cache of one
/// replication session.
#[derive(Debug)]
pub struct OutboxMapper {
    /// One per outbox table, in the config's order (the first is the one
    /// [`OutboxMapper::map_row`] maps).
    outboxes: Vec<Binding>,
    envelope: Option<Envelope>,
    /// `[kafka.cloudevents]` (never together with `envelope`).
    cloudevents: Option<CloudEvents>,
    relations: RelationCache,
}

/// One outbox table the mapper recognises, with its own columns and topic template.
#[derive(Debug)]
struct Binding {
    outbox: OutboxConfig,
    schema: String,
    table: String,
    template: TopicTemplate,
    /// Field names as configured, for [`OutboxMapper::map_row`].
    configured_names: Arc<FieldNames>,
    /// `outbox.additional_placement`, and its columns in the same order.
    placements: Vec<Placement>,
    placed: Vec<Arc<str>>,
    /// The prefix of this outbox's messages (`crate::outbox::message`).
    message_prefix: Arc<str>,
}

impl Binding {
    fn new(outbox: &OutboxConfig, topic_template: &str, index: usize) -> Result<Self, ConfigError> {
        let (schema, table) = qualified_name(&outbox.table)
            .map_err(|m| ConfigError::Invalid(format!("outbox.table: {m}")))?;
        let template = TopicTemplate::parse(topic_template).map_err(|m| {
            let key = if outbox.topic_template.is_some() {
                "outbox.topic_template"
            } else {
                "kafka.topic_template"
            };
            ConfigError::Invalid(format!("{key} {topic_template:?} {m}"))
        })?;
        let configured_names = Arc::new(FieldNames {
            names: Field::ALL.map(|f| f.configured(outbox).to_owned()),
            present: [true; FIELD_COUNT],
            outbox: index,
        });
        let placements = outbox.placements()?;
        if let Some(p) = placements
            .iter()
            .find(|p| p.target == PlacementTarget::Header && is_reserved_header(&p.name))
        {
            return Err(ConfigError::Invalid(format!(
                "outbox.additional_placement: header {:?} is one of the relay's own",
                p.name
            )));
        }
        let placed = placements
            .iter()
            .map(|p| Arc::from(p.column.as_str()))
            .collect();
        Ok(Binding {
            outbox: outbox.clone(),
            message_prefix: Arc::from(message::prefix_of(&format!("{schema}.{table}"))),
            schema,
            table,
            template,
            configured_names,
            placements,
            placed,
        })
    }
}

impl OutboxMapper {
    /// Builds a mapper for `outbox.table`, with `kafka.topic_template` and an
    /// optional payload envelope.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Invalid`] when the table name is malformed or the template
    /// has a placeholder other than `{aggregate_type}` / `{event_type}`, unbalanced
    /// braces, or characters that can never appear in a topic name.
    pub fn new(
        outbox: &OutboxConfig,
        kafka: &KafkaConfig,
        envelope: Option<EnvelopeConfig>,
    ) -> Result<Self, ConfigError> {
        let template = outbox
            .topic_template
            .as_deref()
            .unwrap_or(&kafka.topic_template);
        let mut mapper = Self::with_template(outbox, template, envelope)?;
        mapper.cloudevents = kafka.cloudevents.as_ref().map(CloudEvents::new);
        Ok(mapper)
    }

    /// A mapper for every outbox of `config` (`[[outbox]]`), each with its own
    /// columns and topic template: what one replication stream of several outbox
    /// tables needs. [`OutboxMapper::map_row`] maps rows of the first.
    ///
    /// # Errors
    ///
    /// As [`OutboxMapper::new`], for any of the outboxes.
    pub fn for_config(config: &Config) -> Result<Self, ConfigError> {
        let outboxes = config
            .outboxes()
            .enumerate()
            .map(|(i, outbox)| Binding::new(outbox, config.topic_template_of(outbox), i))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(OutboxMapper {
            outboxes,
            envelope: config.kafka.envelope.as_ref().map(Envelope::new),
            cloudevents: config.kafka.cloudevents.as_ref().map(CloudEvents::new),
            relations: RelationCache::default(),
        })
    }

    /// Like [`OutboxMapper::new`], with the topic template given directly.
    ///
    /// # Errors
    ///
    /// As [`OutboxMapper::new`].
    pub fn with_template(
        outbox: &OutboxConfig,
        topic_template: &str,
        envelope: Option<EnvelopeConfig>,
    ) -> Result<Self, ConfigError> {
        Ok(OutboxMapper {
            outboxes: vec![Binding::new(outbox, topic_template, 0)?],
            envelope: envelope.as_ref().map(Envelope::new),
            cloudevents: None,
            relations: RelationCache::default(),
        })
    }

    /// The `outbox.additional_placement` columns of the first outbox (the one
    /// [`OutboxMapper::map_row`] maps), in the order `OutboxRow::extra` holds them.
    #[must_use]
    pub fn placed_columns(&self) -> &[Arc<str>] {
        self.outboxes.first().map_or(&[], |b| &b.placed)
    }

    /// Forgets every relation, for a new replication session (the server describes
    /// each relation again before its first change).
    pub fn reset_session(&mut self) {
        self.relations.clear();
    }

    /// Records a Relation message. A second message for the same OID (after
    /// `ALTER TABLE`, or a new session) replaces the first, so later inserts use
    /// the new column positions and types.
    pub fn on_relation(&mut self, rel: &Relation) -> RelationStatus<'_> {
        let binding = self
            .outboxes
            .iter()
            .position(|b| rel.namespace == b.schema && rel.name == b.table);
        let entry = match binding {
            Some(i) => RelationEntry::Outbox(Box::new(OutboxRelation::resolve(
                rel,
                &self.outboxes[i].outbox,
                i,
                &self.outboxes[i].placed,
            ))),
            None => RelationEntry::NotOutbox,
        };
        status_of(self.relations.insert(rel.id, entry))
    }

    /// How the mapper sees relation `relation_id`, if it was described.
    #[must_use]
    pub fn relation_status(&self, relation_id: u32) -> Option<RelationStatus<'_>> {
        self.relations.get(relation_id).map(status_of)
    }

    /// Maps one Insert of the replication stream; `commit_lsn` is its transaction's
    /// commit LSN (the `source_lsn` header).
    ///
    /// # Errors
    ///
    /// [`MapError`] when the Insert contradicts the session's Relation messages.
    pub fn map_insert(&self, insert: &Insert, commit_lsn: Lsn) -> Result<Mapped, MapError> {
        let rel = match self.relations.get(insert.relation_id) {
            None => {
                return Err(MapError::UnknownRelation {
                    relation_id: insert.relation_id,
                });
            }
            Some(RelationEntry::NotOutbox) => return Ok(Mapped::NotOutbox),
            Some(RelationEntry::Outbox(rel)) => rel,
        };
        if insert.tuple.len() != rel.columns.len() {
            return Err(MapError::ColumnCount {
                relation_id: insert.relation_id,
                expected: rel.columns.len(),
                actual: insert.tuple.len(),
            });
        }
        let result = match &rel.problem {
            Some(problem) => Err(problem.clone()),
            None => extract_row(rel, &insert.tuple)
                .and_then(|row| self.build(row, &rel.names, Some(commit_lsn))),
        };
        Ok(match result {
            Ok(event) => Mapped::Event(event),
            Err(reject) => Mapped::Unmappable(UnmappableRow {
                reason: reject.reason,
                error_kind: reject.kind,
                fields: poison_from_tuple(rel, &insert.tuple, commit_lsn),
            }),
        })
    }

    /// Maps one logical decoding message of the replication stream (the message
    /// outbox, see [`crate::outbox::message`]); `commit_lsn` is its transaction's
    /// commit LSN. A frame is mapped by the rules of a row of the outbox its prefix
    /// names; an unreadable one becomes an unmappable row that keeps the whole
    /// content.
    #[must_use]
    pub fn map_message(&self, message: &LogicalDecodingMessage, commit_lsn: Lsn) -> MessageMapped {
        let prefix = message.prefix.as_bytes();
        if !message::is_outbox_prefix(prefix) {
            return MessageMapped::Foreign;
        }
        let Some(binding) = self
            .outboxes
            .iter()
            .position(|b| b.message_prefix.as_bytes() == prefix)
        else {
            return MessageMapped::OtherOutbox;
        };
        if message.flags & LogicalDecodingMessage::TRANSACTIONAL == 0 {
            return MessageMapped::NotTransactional;
        }
        let names = &self.outboxes[binding].configured_names;
        let mapped = match message::decode_frame(&message.content) {
            Ok(row) => match self.build(RowRef::of(&row), names, Some(commit_lsn)) {
                Ok(mut event) => {
                    event.source.message = Some((
                        Arc::clone(&self.outboxes[binding].message_prefix),
                        message.lsn,
                    ));
                    Mapped::Event(event)
                }
                Err(reject) => {
                    let mut fields = poison_from_row(names, &[], &row, Some(commit_lsn));
                    fields.outbox_id = None;
                    fields.columns.push(message::poison_marker(
                        &self.outboxes[binding].message_prefix,
                        message.lsn,
                    ));
                    Mapped::Unmappable(UnmappableRow {
                        reason: reject.reason,
                        error_kind: reject.kind,
                        fields,
                    })
                }
            },
            Err(e) => Mapped::Unmappable(unreadable_message(
                message,
                &self.outboxes[binding].message_prefix,
                &e,
                commit_lsn,
                binding,
            )),
        };
        MessageMapped::Outbox(mapped)
    }

    /// Maps one outbox row given as column text (the polling relay, `replay`),
    /// with the same rules as [`OutboxMapper::map_insert`]. `source_lsn` is `None`
    /// outside CDC (no `source_lsn` header).
    ///
    /// # Errors
    ///
    /// The row cannot become a record; the error carries its poison data.
    pub fn map_row(
        &self,
        row: &OutboxRow,
        source_lsn: Option<Lsn>,
    ) -> Result<OutboxEvent, Box<UnmappableRow>> {
        let names = &self.outboxes[0].configured_names;
        self.build(RowRef::of(row), names, source_lsn)
            .map_err(|reject| {
                Box::new(UnmappableRow {
                    reason: reject.reason,
                    error_kind: reject.kind,
                    fields: poison_from_row(names, &self.outboxes[0].placed, row, source_lsn),
                })
            })
    }

    /// The mapping rules proper. Every value ends up in the event at most once
    /// (moved out of `row`), so a field costs one reference-count increment.
    fn build(
        &self,
        row: RowRef<'_>,
        names: &Arc<FieldNames>,
        source_lsn: Option<Lsn>,
    ) -> Result<OutboxEvent, Reject> {
        let RowRef {
            id,
            idempotency_key,
            aggregate_type,
            aggregate_id,
            event_type,
            topic,
            headers: row_headers,
            payload,
            payload_format,
            created_at,
            extra,
        } = row;
        let binding = &self.outboxes[names.outbox];

        // Key: the entity id.
        let key = match aggregate_id {
            None => {
                return Err(Reject::new(
                    error_kind::NULL_KEY,
                    format!(
                        "{} is NULL: an event without an entity id has no Kafka key",
                        names.describe(Field::AggregateId)
                    ),
                ));
            }
            Some(k) if k.is_empty() => {
                return Err(Reject::new(
                    error_kind::EMPTY_KEY,
                    format!(
                        "{} is empty: an event without an entity id has no Kafka key",
                        names.describe(Field::AggregateId)
                    ),
                ));
            }
            Some(k) => k.into_owned(),
        };

        // Idempotency key: the idempotency_key column, else the id.
        let (idempotency_key, key_field) = match (idempotency_key, &id) {
            (Some(k), _) => (k.into_owned(), Field::IdempotencyKey),
            (None, Some(id)) => (Bytes::clone(id), Field::Id),
            (None, None) => {
                return Err(Reject::new(
                    error_kind::NULL_IDEMPOTENCY_KEY,
                    format!(
                        "no idempotency key: {} and {} are NULL",
                        names.describe(Field::IdempotencyKey),
                        names.describe(Field::Id)
                    ),
                ));
            }
        };
        if idempotency_key.is_empty() {
            return Err(Reject::new(
                error_kind::EMPTY_IDEMPOTENCY_KEY,
                format!(
                    "{} is empty: consumers could not deduplicate the event",
                    names.describe(key_field)
                ),
            ));
        }

        // Payload, as PostgreSQL gave it; NULL is a tombstone when the outbox says so.
        let tombstone = payload.is_none() && binding.outbox.tombstone_on_empty_payload;
        let raw_payload = match payload {
            Some(payload) => payload,
            None if tombstone => Cow::Owned(Bytes::new()),
            None => {
                return Err(Reject::new(
                    error_kind::NULL_PAYLOAD,
                    format!("{} is NULL", names.describe(Field::Payload)),
                ));
            }
        };
        let (value, payload_format) = match payload_format {
            _ if tombstone => (Bytes::new(), payload_format),
            PayloadFormat::Json | PayloadFormat::Text | PayloadFormat::Raw => {
                (raw_payload.into_owned(), payload_format)
            }
            PayloadFormat::ByteaText => {
                let bytes = decode_bytea_text(&raw_payload).map_err(|e| {
                    Reject::new(
                        error_kind::BAD_PAYLOAD,
                        format!(
                            "{} is not bytea text output: {e}",
                            names.describe(Field::Payload)
                        ),
                    )
                })?;
                (bytes, PayloadFormat::Raw)
            }
        };

        // Topic: the row's, else the template's.
        let topic = match topic.as_deref() {
            Some(t) if !t.is_empty() => {
                validate_topic_name(t).map_err(|e| {
                    Reject::new(
                        error_kind::INVALID_TOPIC,
                        format!(
                            "topic {:?} from the {} {e}",
                            String::from_utf8_lossy(t),
                            names.describe(Field::Topic)
                        ),
                    )
                })?;
                String::from_utf8(t.to_vec()).map_err(|e| {
                    Reject::new(
                        error_kind::INVALID_TOPIC,
                        format!("topic is not UTF-8: {e}"),
                    )
                })?
            }
            _ => binding
                .template
                .render(
                    aggregate_type.as_deref().map(|b| &b[..]),
                    event_type.as_deref().map(|b| &b[..]),
                )
                .map_err(|e| Reject::new(error_kind::INVALID_TOPIC, e.to_string()))?,
        };

        // created_at → CreateTime and occurred_at.
        let created_at_micros = match &created_at {
            None => None,
            Some(text) => Some(parse_pg_timestamp(text).map_err(|e| {
                Reject::new(
                    error_kind::BAD_TIMESTAMP,
                    format!("{}: {e}", names.describe(Field::CreatedAt)),
                )
            })?),
        };
        let occurred_at = created_at_micros.map(|micros| {
            let mut buf = Vec::with_capacity(RFC3339_LEN);
            put_rfc3339(&mut buf, micros);
            Bytes::from(buf)
        });

        let has_id = id.is_some();
        let event_id = match id {
            Some(id) => id.into_owned(),
            None => idempotency_key.clone(),
        };

        let mut cloudevent_headers = Vec::new();
        let (payload, raw_payload) = match (&self.envelope, &self.cloudevents) {
            // A tombstone has no value to wrap: a compaction marker, not an event.
            _ if tombstone => (value, None),
            (None, Some(cloudevents)) => {
                let formed = cloudevents
                    .form(
                        &idempotency_key,
                        event_type.as_deref(),
                        occurred_at.as_ref(),
                        value.clone(),
                        payload_format,
                    )
                    .map_err(|e| Reject::new(error_kind::BAD_VALUE, e.to_string()))?;
                cloudevent_headers = formed.headers;
                // Structured mode wraps the payload; the poison row keeps it bare.
                let raw = (formed.value != value).then_some(value);
                (formed.value, raw)
            }
            (None, None) => (value, None),
            (Some(envelope), _) => {
                let fields: Vec<(&str, Option<&[u8]>)> = binding
                    .placements
                    .iter()
                    .zip(extra.iter().map(Some).chain(std::iter::repeat(None)))
                    .filter(|(p, _)| p.target == PlacementTarget::Envelope)
                    .map(|(p, v)| {
                        (
                            p.name.as_str(),
                            v.and_then(|v| v.as_deref()).map(|b| &b[..]),
                        )
                    })
                    .collect();
                let wrapped = build_envelope(
                    envelope,
                    &event_id,
                    event_type.as_deref().map(|b| &b[..]),
                    occurred_at.as_deref(),
                    &fields,
                    &value,
                    payload_format,
                )
                .map_err(|e| {
                    Reject::new(
                        error_kind::BAD_PAYLOAD,
                        format!("{}: {e}", names.describe(Field::Payload)),
                    )
                })?;
                (wrapped, Some(value))
            }
        };

        // Headers, in contract order.
        let mut headers: Vec<(HeaderName, Bytes)> =
            Vec::with_capacity(RESERVED_HEADERS.len() + if row_headers.is_some() { 4 } else { 0 });
        headers.push((
            Cow::Borrowed(HEADER_IDEMPOTENCY_KEY),
            idempotency_key.clone(),
        ));
        if let Some(v) = event_type {
            headers.push((Cow::Borrowed(HEADER_EVENT_TYPE), v.into_owned()));
        }
        if let Some(v) = aggregate_type {
            headers.push((Cow::Borrowed(HEADER_AGGREGATE_TYPE), v.into_owned()));
        }
        if let Some(v) = occurred_at {
            headers.push((Cow::Borrowed(HEADER_OCCURRED_AT), v));
        }
        if let Some(lsn) = source_lsn {
            let mut buf = Vec::with_capacity(17);
            put_lsn(&mut buf, lsn);
            headers.push((Cow::Borrowed(HEADER_SOURCE_LSN), Bytes::from(buf)));
        }
        // Columns placed as headers, after the relay's own.
        for (placement, value) in binding.placements.iter().zip(&extra) {
            if let (PlacementTarget::Header, Some(value)) = (placement.target, value) {
                headers.push((Cow::Owned(placement.name.clone()), Bytes::clone(value)));
            }
        }
        let relay_headers = headers.len();
        if let Some(text) = &row_headers {
            parse_header_object(text, &mut headers).map_err(|e| {
                Reject::new(
                    error_kind::BAD_HEADERS,
                    format!("{}: {e}", names.describe(Field::Headers)),
                )
            })?;
        }
        // A row header with a placed header's name would shadow it for readers that
        // take the last of a name (as reserved names would).
        if let Some((name, _)) = headers[relay_headers..].iter().find(|(name, _)| {
            binding
                .placements
                .iter()
                .any(|p| p.target == PlacementTarget::Header && p.name == *name)
        }) {
            return Err(Reject::new(
                error_kind::BAD_HEADERS,
                format!(
                    "{} has a {name:?} entry, the name of a column placed as a header",
                    names.describe(Field::Headers)
                ),
            ));
        }
        if !cloudevent_headers.is_empty() {
            if let Some((name, _)) = headers[relay_headers..]
                .iter()
                .find(|(name, _)| is_cloudevents_header(name))
            {
                return Err(Reject::new(
                    error_kind::BAD_HEADERS,
                    format!(
                        "{} has a {name:?} entry, which would shadow the CloudEvents header",
                        names.describe(Field::Headers)
                    ),
                ));
            }
            headers.splice(relay_headers..relay_headers, cloudevent_headers);
        }

        let timestamp_ms = created_at_micros
            .map(|m| m.div_euclid(1000))
            .filter(|ms| *ms >= 0);

        Ok(OutboxEvent {
            key,
            topic,
            payload,
            tombstone,
            headers,
            timestamp_ms,
            idempotency_key,
            event_id,
            source_lsn,
            source: EventSource {
                names: Arc::clone(names),
                has_id,
                headers: row_headers.map(Cow::into_owned),
                raw_payload,
                payload_format,
                created_at_micros,
                extra: binding
                    .placed
                    .iter()
                    .zip(
                        extra
                            .into_iter()
                            .map(|v| v.map(Cow::into_owned))
                            .chain(std::iter::repeat(None)),
                    )
                    .map(|(name, value)| (Arc::clone(name), value))
                    .collect(),
                message: None,
            },
        })
    }
}

/// A row's placed values, NULL past the end (a row read without them).
fn placed_values(extra: &[Option<Bytes>]) -> impl Iterator<Item = Option<Bytes>> + '_ {
    extra.iter().cloned().chain(std::iter::repeat(None))
}

/// Poison data of a row given as text.
/// The poison row of a message whose content is not a frame: the content itself,
/// as `bytea` hex text, so that nothing of it is lost.
fn unreadable_message(
    message: &LogicalDecodingMessage,
    prefix: &str,
    error: &message::FrameError,
    commit_lsn: Lsn,
    outbox: usize,
) -> UnmappableRow {
    // Once, in `payload`: in row_data too it would double what a large message costs.
    let content = payload_text(&message.content, PayloadFormat::Raw);
    UnmappableRow {
        reason: format!("message {} is not an outbox frame: {error}", message.lsn),
        error_kind: error_kind::BAD_MESSAGE,
        fields: PoisonFields {
            payload: Some(content),
            columns: vec![message::poison_marker(prefix, message.lsn)],
            lsn: Some(commit_lsn),
            outbox,
            ..PoisonFields::default()
        },
    }
}

fn poison_from_row(
    names: &FieldNames,
    placed: &[Arc<str>],
    row: &OutboxRow,
    lsn: Option<Lsn>,
) -> PoisonFields {
    let text = |b: &Option<Bytes>| b.as_deref().map(lossy);
    let payload = row.payload.as_ref().map(|p| match row.payload_format {
        PayloadFormat::Raw => payload_text(p, PayloadFormat::Raw),
        _ => lossy(p),
    });
    let created_at = text(&row.created_at).map(|t| poison_timestamp(&t));
    let values = [
        (Field::Id, text(&row.id)),
        (Field::IdempotencyKey, text(&row.idempotency_key)),
        (Field::AggregateType, text(&row.aggregate_type)),
        (Field::AggregateId, text(&row.aggregate_id)),
        (Field::EventType, text(&row.event_type)),
        (Field::Topic, text(&row.topic)),
        (Field::Headers, text(&row.headers)),
        (Field::Payload, payload.clone()),
        (Field::CreatedAt, text(&row.created_at)),
    ];
    PoisonFields {
        outbox_id: text(&row.id),
        idempotency_key: text(&row.idempotency_key).or_else(|| text(&row.id)),
        aggregate_type: text(&row.aggregate_type),
        aggregate_id: text(&row.aggregate_id),
        event_type: text(&row.event_type),
        topic: text(&row.topic),
        headers: text(&row.headers),
        payload,
        created_at,
        columns: values
            .into_iter()
            .map(|(f, v)| (names.get(f).to_owned(), v))
            .chain(
                placed
                    .iter()
                    .zip(placed_values(&row.extra))
                    .map(|(name, value)| (name.to_string(), value.map(|v| lossy(&v)))),
            )
            .collect(),
        lsn,
        outbox: names.outbox,
    }
}

#[cfg(test)]
mod tests;
