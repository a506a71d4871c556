//! Developer tools: [`demo`] (the README's first command: a throwaway PostgreSQL and
//! an embedded broker, events relayed by the real `run` path, then audited),
//! [`bench`](mod@bench) (CDC against the poller and PostgreSQL's own decoding ceiling), and
//! [`workload`], the event writer both of them and the integration tests use.

pub mod bench;
pub mod demo;
pub mod workload;
