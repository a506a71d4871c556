//! Operator commands beside `run`: [`check`] (is this deploy ready?), [`migrate`] (schema), [`status`] (slot and
//! backlog), [`replay`] (poisoned events back to Kafka), [`retention`] (deleting
//! delivered rows), [`audit`] (what reached the topic, compared with the outbox) and
//! [`health`] (a container's probe of a running relay).

pub mod audit;
pub mod check;
pub mod health;
pub(crate) mod meter;
pub mod migrate;
pub mod replay;
pub mod retention;
pub mod status;
