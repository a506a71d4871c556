//! Integration tests against the real PostgreSQL and Kafka-protocol broker of
//! `scripts/dev-env` (one test binary, as supabase/etl does: one compile, shared
//! harness). Every test isolates itself in its own database, slot and topic.

mod environment;
mod harness;
