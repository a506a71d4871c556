//! Kafka topic names: the `kafka.topic_template` and the legality check.
//!
//! The topic of a record is the row's `topic` column when non-NULL and non-empty,
//! else `kafka.topic_template` with `{aggregate_type}` / `{event_type}` replaced by
//! the row's values (the default `outbox.event.{aggregate_type}` is Debezium's
//! `outbox.event.${routedByValue}`). The template is parsed once, at start-up, so a
//! typo (an unknown placeholder, unbalanced braces, characters no topic can
//! contain) stops the relay with a configuration error instead of poisoning every
//! row; what can only be known per row (a NULL or illegal placeholder value, a
//! rendered name over the length limit) makes that row unmappable.
//!
//! Legal names follow Kafka's `Topic.validate`: 1 to 249 characters of ASCII
//! letters, digits, `.`, `_` and `-`, and not `.` or `..` (Kafka uses the name as a
//! directory name; see `clients/src/main/java/org/apache/kafka/common/internals/Topic.java`).
//! The broker would refuse anything else at produce time, and retrying could never
//! help, so the mapper checks before producing.

use std::string::FromUtf8Error;

/// Longest legal Kafka topic name.
pub(super) const MAX_TOPIC_LEN: usize = 249;

/// Why a name is not a legal Kafka topic name; the text is a phrase to follow the
/// name ("is empty", …).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TopicNameError {
    /// The name is empty.
    #[error("is empty")]
    Empty,
    /// More than `MAX_TOPIC_LEN` characters.
    #[error("is {len} characters long, more than Kafka's {MAX_TOPIC_LEN}")]
    TooLong {
        /// The name's length in bytes.
        len: usize,
    },
    /// `.` or `..`.
    #[error("is '.' or '..', which Kafka forbids")]
    Dots,
    /// A character outside ASCII letters, digits, `.`, `_`, `-`.
    #[error("contains {0:?}; topic names allow only ASCII letters, digits, '.', '_' and '-'")]
    IllegalChar(char),
}

/// Why `kafka.topic_template` cannot be used; the text is a phrase to follow the
/// template.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum TemplateError {
    /// The template is empty.
    #[error("is empty")]
    Empty,
    /// A literal part has a character no topic name can contain.
    #[error("contains {0:?}; topic names allow only ASCII letters, digits, '.', '_' and '-'")]
    IllegalChar(char),
    /// A `}` with no `{` before it.
    #[error("has a '}}' without a matching '{{'")]
    UnmatchedClose,
    /// A `{` with no `}` after it.
    #[error("has a '{{' without a matching '}}'")]
    UnmatchedOpen,
    /// A placeholder other than `{aggregate_type}` / `{event_type}`.
    #[error(
        "has the unknown placeholder {{{0}}}; only {{aggregate_type}} and {{event_type}} are replaced"
    )]
    UnknownPlaceholder(String),
    /// The literal parts alone are too long for a topic name.
    #[error("is longer than {MAX_TOPIC_LEN} characters without its placeholders")]
    TooLong,
    /// A template without placeholders that is not a legal topic name.
    #[error(transparent)]
    Name(#[from] TopicNameError),
}

/// Why the template cannot make a topic name of one row's values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum RenderError {
    /// A placeholder's column is NULL.
    #[error("topic template {template:?} needs {placeholder}, which is NULL")]
    Null {
        template: String,
        placeholder: &'static str,
    },
    /// A placeholder's column is the empty string.
    #[error("topic template {template:?} needs {placeholder}, which is empty")]
    Empty {
        template: String,
        placeholder: &'static str,
    },
    /// A placeholder's value has a character no topic name can contain.
    #[error(
        "{placeholder} {value:?} contains {byte:?}, which is not allowed in a topic name (topic template {template:?}; allowed: ASCII letters, digits, '.', '_', '-')"
    )]
    IllegalChar {
        placeholder: &'static str,
        /// The value, lossy UTF-8.
        value: String,
        /// The first offending byte.
        byte: char,
        template: String,
    },
    /// The rendered name is not a legal topic name (too long, `..`).
    #[error("topic {topic:?} rendered from template {template:?} {source}")]
    Invalid {
        /// The rendered name, lossy UTF-8.
        topic: String,
        template: String,
        source: TopicNameError,
    },
    /// Unreachable after the byte checks; kept for the conversion.
    #[error("topic is not UTF-8: {0}")]
    NotUtf8(#[from] FromUtf8Error),
}

/// A part of a template: literal text or a placeholder.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(Box<str>),
    AggregateType,
    EventType,
}

/// A parsed `kafka.topic_template`.
#[derive(Debug, Clone)]
pub(super) struct TopicTemplate {
    source: String,
    segments: Vec<Segment>,
    literal_len: usize,
}

impl TopicTemplate {
    /// Parses and checks a template (start-up).
    ///
    /// # Errors
    ///
    /// [`TemplateError`]: the template can never render a legal topic name.
    pub(super) fn parse(template: &str) -> Result<Self, TemplateError> {
        if template.is_empty() {
            return Err(TemplateError::Empty);
        }
        let mut segments = Vec::new();
        let mut literal_len = 0;
        let mut rest = template;
        while !rest.is_empty() {
            let literal_end = rest.find(['{', '}']).unwrap_or(rest.len());
            let literal = &rest[..literal_end];
            if !literal.is_empty() {
                if let Some(c) = literal
                    .chars()
                    .find(|c| !c.is_ascii() || !is_topic_byte(*c as u8))
                {
                    return Err(TemplateError::IllegalChar(c));
                }
                literal_len += literal.len();
                segments.push(Segment::Literal(literal.into()));
            }
            rest = &rest[literal_end..];
            if rest.starts_with('}') {
                return Err(TemplateError::UnmatchedClose);
            }
            if let Some(after) = rest.strip_prefix('{') {
                let Some(close) = after.find('}') else {
                    return Err(TemplateError::UnmatchedOpen);
                };
                segments.push(match &after[..close] {
                    "aggregate_type" => Segment::AggregateType,
                    "event_type" => Segment::EventType,
                    other => {
                        return Err(TemplateError::UnknownPlaceholder(other.to_owned()));
                    }
                });
                rest = &after[close + 1..];
            }
        }
        if literal_len > MAX_TOPIC_LEN {
            return Err(TemplateError::TooLong);
        }
        let has_placeholder = segments.iter().any(|s| !matches!(s, Segment::Literal(_)));
        if !has_placeholder {
            validate_topic_name(template.as_bytes())?;
        }
        Ok(TopicTemplate {
            source: template.to_owned(),
            segments,
            literal_len,
        })
    }

    /// The topic for one row's `aggregate_type` and `event_type`.
    ///
    /// # Errors
    ///
    /// [`RenderError`]: a needed value is NULL, empty or makes an illegal name.
    pub(super) fn render(
        &self,
        aggregate_type: Option<&[u8]>,
        event_type: Option<&[u8]>,
    ) -> Result<String, RenderError> {
        let value = |seg: &Segment| -> Result<Option<&[u8]>, RenderError> {
            let (placeholder, v) = match seg {
                Segment::Literal(_) => return Ok(None),
                Segment::AggregateType => ("aggregate_type", aggregate_type),
                Segment::EventType => ("event_type", event_type),
            };
            let v = v.ok_or_else(|| RenderError::Null {
                template: self.source.clone(),
                placeholder,
            })?;
            if v.is_empty() {
                return Err(RenderError::Empty {
                    template: self.source.clone(),
                    placeholder,
                });
            }
            if let Some(&b) = v.iter().find(|b| !is_topic_byte(**b)) {
                return Err(RenderError::IllegalChar {
                    placeholder,
                    value: String::from_utf8_lossy(v).into_owned(),
                    byte: char::from(b),
                    template: self.source.clone(),
                });
            }
            Ok(Some(v))
        };
        let mut len = self.literal_len;
        for seg in &self.segments {
            if let Some(v) = value(seg)? {
                len += v.len();
            }
        }
        let mut out = Vec::with_capacity(len);
        for seg in &self.segments {
            match seg {
                Segment::Literal(l) => out.extend_from_slice(l.as_bytes()),
                other => out.extend_from_slice(value(other)?.unwrap_or_default()),
            }
        }
        validate_topic_name(&out).map_err(|source| RenderError::Invalid {
            topic: String::from_utf8_lossy(&out).into_owned(),
            template: self.source.clone(),
            source,
        })?;
        Ok(String::from_utf8(out)?)
    }
}

fn is_topic_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')
}

/// Checks a Kafka topic name: 1 to 249 of ASCII letters, digits, `.`, `_`, `-`,
/// and not `.` or `..` (Kafka's `Topic.validate`).
///
/// # Errors
///
/// [`TopicNameError`] says what is wrong; its text is a phrase to follow the name
/// ("is empty", …).
pub fn validate_topic_name(name: &[u8]) -> Result<(), TopicNameError> {
    if name.is_empty() {
        return Err(TopicNameError::Empty);
    }
    if name.len() > MAX_TOPIC_LEN {
        return Err(TopicNameError::TooLong { len: name.len() });
    }
    if name == b"." || name == b".." {
        return Err(TopicNameError::Dots);
    }
    if let Some(&b) = name.iter().find(|b| !is_topic_byte(**b)) {
        return Err(TopicNameError::IllegalChar(char::from(b)));
    }
    Ok(())
}
