//! Developer tools: [`demo`] (the README's first command: a throwaway PostgreSQL and
//! an embedded broker, events relayed by the real `run` path, then audited),
//! [`bench`](mod@bench) (CDC against the poller and PostgreSQL's own decoding ceiling),
//! [`dev_broker`] (an in-memory Kafka-protocol broker with real transactions, for
//! trying and testing exactly-once delivery), and [`workload`], the event writer the
//! tools and the integration tests use.

pub mod bench;
pub mod demo;
pub mod dev_broker;
pub mod workload;
