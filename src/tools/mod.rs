//! Developer tools: [`demo`] (the README's first command: a throwaway PostgreSQL and
//! an embedded broker, events relayed by the real `run` path, then audited) and
//! [`bench`] (CDC against the poller and PostgreSQL's own decoding ceiling).

pub mod bench;
pub mod demo;
