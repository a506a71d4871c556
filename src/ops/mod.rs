//! Operator commands beside `run`: [`migrate`] (schema), [`status`] (slot and
//! backlog), [`replay`] (poisoned events back to Kafka), [`retention`] (deleting
//! delivered rows) and [`audit`] (what reached the topic, compared with the outbox).

pub mod audit;
pub(crate) mod meter;
pub mod migrate;
pub mod replay;
pub mod retention;
pub mod status;
