//! Integration tests against the real PostgreSQL and Kafka-protocol broker of
//! `scripts/dev-env` (one test binary, as supabase/etl does: one compile, shared
//! harness). Every test isolates itself in its own database, slot and topic.

// Test code: a failed unwrap is a failed test, with its location.
#![allow(clippy::unwrap_used)]
// The harness is `pub` for the test modules; the test crate exports nothing.
#![allow(unreachable_pub)]

mod adopt;
mod audit;
mod bench;
mod check;
mod cloudevents;
mod cutover;
mod demo;
mod deploy;
mod dev_broker;
mod enqueue;
mod environment;
mod exactly_once;
mod exactly_once_aborts;
mod exactly_once_cluster;
mod fault_drill;
mod harness;
mod huge_transaction;
mod inbox;
mod kafka_publisher;
mod kafka_security;
mod message_outbox;
mod migrate_names;
mod monitoring;
mod operations;
mod parking;
mod pg17_failover;
mod poison;
mod poller;
mod progress;
mod relay;
mod replay;
mod replication_connection;
mod republish;
mod resync;
mod retention;
mod secrets;
mod several_outboxes;
mod shards;
mod sizes;
mod standby_decoding;
mod tls_proxy;
mod traces;
