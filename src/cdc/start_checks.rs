//! What `run` checks once it has a metadata connection and a producer, before it
//! touches the slot.
//!
//! # Why a trait
//!
//! The full deploy check (`outbox-relay check`: privileges, free slots and
//! senders, the publication's options, migrations, topics…) lives with the
//! operator commands, a layer above this one, and reads the migrations list that
//! only `ops::migrate` knows. `run` must perform the same checks and name every
//! failure at once, without this layer importing from above: so the command
//! layer hands the checks in ([`StartChecks`]), and `run` calls them at the one
//! place where both connections are open. Library callers that start a relay
//! directly (the demo, tests) get [`Prerequisites`], the checks `run` always
//! made: `wal_level`, the publication and tables, the broker's answer.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio_postgres::Client;

use crate::config::Config;
use crate::error::Result;
use crate::kafka::Publisher;
use crate::postgres::slot;

/// A boxed future borrowing the check's inputs.
pub type CheckFuture<'a> = Pin<Box<dyn Future<Output = Result<()>> + Send + 'a>>;

/// The checks `run` makes at start, before the slot; an error stops it (its exit
/// code is the error's).
pub trait StartChecks: Send + Sync {
    /// Checks `client`'s server and `publisher`'s brokers for `config`.
    fn check<'a>(
        &'a self,
        client: &'a Client,
        publisher: &'a Publisher,
        config: &'a Config,
    ) -> CheckFuture<'a>;
}

/// How long the broker may take to answer at start.
pub const BROKER_CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// The minimal checks: PostgreSQL's prerequisites first (exit code 3), then the
/// broker (exit code 4), stopping at the first failure.
#[derive(Debug, Clone, Copy, Default)]
pub struct Prerequisites;

impl StartChecks for Prerequisites {
    fn check<'a>(
        &'a self,
        client: &'a Client,
        publisher: &'a Publisher,
        config: &'a Config,
    ) -> CheckFuture<'a> {
        Box::pin(async move {
            slot::check_prerequisites(client, config).await?;
            publisher.check_broker(BROKER_CHECK_TIMEOUT).await?;
            Ok(())
        })
    }
}
