//! `relay.on_poison`: what the relay does with an event the core decided to poison,
//! and with the later events of its key.
//!
//! The core (`cdc::progress`) decides *that* an event is undeliverable; this module
//! decides what that means, because the answer needs the record's key and topic,
//! which the core does not see (it only keeps a hash for per-key order):
//!
//! * `skip`: the event is written to the poison table; later events of its key are
//!   delivered. Per-key order is broken when the poisoned event is replayed.
//! * `park-key`: the poison row *parks* the key (`crate::poison::parking` explains
//!   the protocol). The relay remembers the parked keys — loaded at start, added
//!   when it parks one, dropped when the writer finds one released — and writes
//!   every later event of a parked key to the poison table as parked instead of
//!   producing it. Only first produces are parked: an event already produced
//!   cannot be taken back.
//! * `halt`: nothing is written; the event stays unresolved, so the slot is not
//!   confirmed past it, later events of its key stay held, and `/readyz` turns 503
//!   with an alert naming the event, until someone fixes the cause (or chooses
//!   another policy) and restarts the relay, which then tries the event again.

use crate::hashing::{HashMap, HashSet};
use std::borrow::Cow;

use crate::cdc::in_flight::InFlight;
use crate::cdc::metrics as m;
use crate::config::ConfigError;
use crate::config::{Config, PoisonKeyMode};
use crate::error::Result;
use crate::outbox::OutboxEvent;
use crate::poison::{ParkedKey, Parking};
use crate::postgres::prerequisite::Prerequisite;

/// What to do with an event the core wants poisoned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Disposal {
    /// Write its poison row with this part in parking.
    Insert(Parking),
    /// Do not write it: the relay halts on it.
    Halt,
}

/// The policy and the keys it has parked.
#[derive(Debug)]
pub(crate) struct PoisonPolicy {
    mode: PoisonKeyMode,
    /// Parked record keys by topic (looked up per event without allocating).
    parked: HashMap<String, HashSet<String>>,
    count: usize,
}

impl PoisonPolicy {
    /// `mode`, with the keys parked when the relay started.
    #[must_use]
    pub(crate) fn new(mode: PoisonKeyMode, parked: HashSet<ParkedKey>) -> PoisonPolicy {
        let mut policy = PoisonPolicy {
            mode,
            parked: HashMap::default(),
            count: 0,
        };
        for key in parked {
            policy.insert(key);
        }
        policy.publish();
        policy
    }

    /// Whether `event`, about to be produced for the first time, is parked instead.
    /// Parked keys are honoured whatever the mode: a key parked under `park-key`
    /// stays parked until `replay` releases it.
    #[must_use]
    pub(crate) fn parks(&self, event: &OutboxEvent) -> bool {
        self.count > 0
            && self
                .parked
                .get(event.topic.as_str())
                .is_some_and(|keys| keys.contains(key_text(&event.key).as_ref()))
    }

    /// What to do with `pending`, which the core wants poisoned; under `park-key`
    /// its key is parked from now on.
    pub(crate) fn dispose(&mut self, pending: &InFlight) -> Disposal {
        match (self.mode, pending) {
            (_, InFlight::Event { parked: true, .. }) => Disposal::Insert(Parking::Parked),
            (PoisonKeyMode::Halt, _) => Disposal::Halt,
            (PoisonKeyMode::ParkKey, InFlight::Event { event, .. }) => {
                if self.insert(key_of(event)) {
                    self.publish();
                }
                Disposal::Insert(Parking::HoldsKey)
            }
            _ => Disposal::Insert(Parking::None),
        }
    }

    /// `replay` released the key of `event` (the writer found it so).
    pub(crate) fn released(&mut self, event: &OutboxEvent) {
        let removed = self
            .parked
            .get_mut(event.topic.as_str())
            .is_some_and(|keys| keys.remove(key_text(&event.key).as_ref()));
        if removed {
            self.count -= 1;
            self.parked.retain(|_, keys| !keys.is_empty());
            self.publish();
        }
    }

    fn insert(&mut self, key: ParkedKey) -> bool {
        let added = self.parked.entry(key.topic).or_default().insert(key.key);
        self.count += usize::from(added);
        added
    }

    fn publish(&self) {
        // Exact: far fewer keys than 2^53.
        #[allow(clippy::cast_precision_loss)]
        ::metrics::gauge!(m::PARKED_KEYS).set(self.count as f64);
    }
}

/// The parked-key identity of an event: its topic and its record key as text (as
/// the poison table stores it).
pub(crate) fn key_of(event: &OutboxEvent) -> ParkedKey {
    ParkedKey {
        topic: event.topic.clone(),
        key: key_text(&event.key).into_owned(),
    }
}

/// A record key as the poison table's text (lossy for bytes that are not UTF-8).
fn key_text(key: &[u8]) -> Cow<'_, str> {
    String::from_utf8_lossy(key)
}

/// Whether `parked_keys` holds an unreleased key with an unreplayed parked (or
/// parking) row in `poison_table`.
async fn holds_parked_keys(
    client: &tokio_postgres::Client,
    parked_keys: &str,
    poison_table: &str,
) -> Result<bool> {
    let sql = format!(
        "SELECT EXISTS (SELECT 1 FROM {parked_keys} k WHERE k.released_at IS NULL
            AND EXISTS (SELECT 1 FROM {} p WHERE p.topic = k.topic
                         AND p.aggregate_id = k.record_key AND p.replayed_at IS NULL
                         AND (p.parked OR p.holds_key)))",
        crate::config::quote_qualified(poison_table)
    );
    Ok(client.query_one(&sql, &[]).await?.try_get(0)?)
}

/// The keys parked now (loaded when the relay starts, and after a backlog, which
/// may park keys). Without the
/// parked-key table (migration `0009`) there are none, unless `park-key` needs it.
pub(crate) async fn parked_keys(
    client: &tokio_postgres::Client,
    config: &Config,
) -> Result<HashSet<crate::poison::ParkedKey>> {
    if config.serves_several_outboxes() {
        // Parking is refused with several outboxes; keys an earlier `park-key` run
        // left parked would hold back the events of every table on their topic.
        // Only keys whose parked or parking rows are in this relay's poison tables:
        // the parked-key table is per schema, and another relay may park its own.
        for outbox in config.outboxes() {
            let table = crate::poison::parked_key_table(outbox);
            if crate::postgres::table_exists(client, &table).await?
                && holds_parked_keys(client, &table, &outbox.poison_table).await?
            {
                return Err(ConfigError::Invalid(format!(
                    "{table} holds keys an earlier relay.on_poison = \"park-key\" run parked; \
                     with several [[outbox]] entries no key is parked: release them first \
                     (`outbox-relay replay --all` with the config of that run)"
                ))
                .into());
            }
        }
        return Ok(HashSet::default());
    }
    let table = crate::poison::parked_key_table(&config.outbox);
    if crate::postgres::table_exists(client, &table).await? {
        return Ok(crate::poison::load_parked_keys(client, &table).await?);
    }
    if config.relay.on_poison == PoisonKeyMode::ParkKey {
        return Err(Prerequisite::ParkedKeyTableMissing { table }.into());
    }
    Ok(HashSet::default())
}
