//! The two servers a relay may talk to: the one its replication slot lives on and
//! the one its writes go to.
//!
//! **Why two.** Logical decoding costs the server that runs the walsender CPU per
//! commit, whatever the client does. Since PostgreSQL 16 a logical slot can live on
//! a physical standby (`postgres.slot_url`), with the walsender on the standby's
//! CPU, while the primary only ships WAL as it does anyway. A standby is read-only:
//! the relay's own writes (its position, poison rows, backlog marks, heartbeats,
//! advisory locks) still go to the primary (`postgres.url`). With one URL both are
//! the same connection, as before.
//!
//! **Which reads go where.** The slot's row, the WAL end and the server's start
//! time describe the server that decodes: they are read there. The position row,
//! the poison rows and the marks are read where they are written, the primary, so
//! that a standby's replay lag never shows the relay an older state of its own
//! writes. The order arguments of `cdc::start` (read the slot, then the record:
//! the slot can only look behind the record) still hold: the relay saves on the
//! primary before it confirms to the standby's walsender.
//!
//! References: PostgreSQL documentation, "Logical Decoding" (Replication Slot
//! Synchronization and decoding on a standby, 16+), and `pg_log_standby_snapshot`.

use std::time::{Duration, Instant};

use tokio_postgres::Client;

use super::PgError;
use crate::lsn::Lsn;

/// How long the standby may take to replay the primary's WAL up to a position the
/// relay needs ([`wait_replayed`]) before the step fails, transiently.
pub const REPLAY_WAIT: Duration = Duration::from_secs(60);

/// A session's metadata connections: the slot's server and, when it is another
/// one, the server the writes go to.
pub struct ServerPair<'a> {
    /// The server the writes go to (the slot's own when `slot` is `None`).
    writes: &'a mut Client,
    /// The slot's server when it is not `writes`'s.
    slot: Option<&'a Client>,
}

impl std::fmt::Debug for ServerPair<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerPair")
            .field("split", &self.split())
            .finish_non_exhaustive()
    }
}

impl<'a> ServerPair<'a> {
    /// One server for everything (`postgres.url` alone).
    pub fn one(client: &'a mut Client) -> ServerPair<'a> {
        ServerPair {
            writes: client,
            slot: None,
        }
    }

    /// The slot on `slot`'s server, the writes on `writes`'s; `writes` `None`:
    /// both on `slot`'s.
    pub fn of(slot: &'a mut Client, writes: Option<&'a mut Client>) -> ServerPair<'a> {
        match writes {
            Some(writes) => ServerPair {
                writes,
                slot: Some(slot),
            },
            None => ServerPair::one(slot),
        }
    }

    /// The server the slot lives on: its row, the WAL end, its start time.
    #[must_use]
    pub fn slot(&self) -> &Client {
        self.slot.unwrap_or(&*self.writes)
    }

    /// The server the relay's writes go to, and the reads of what it wrote.
    pub fn writes(&mut self) -> &mut Client {
        self.writes
    }

    /// Whether the slot lives on another server than the writes.
    #[must_use]
    pub fn split(&self) -> bool {
        self.slot.is_some()
    }

    /// With the slot on a standby: waits until the standby has replayed everything
    /// the primary has flushed now, the relay's writes so far included. Before a
    /// slot is created there with an exported snapshot: the snapshot must see the
    /// marks and poison rows just written on the primary, or their rows are
    /// published again. Nothing to wait for on one server.
    ///
    /// # Errors
    ///
    /// [`PgError::StandbyBehind`] after [`REPLAY_WAIT`], or a query's error.
    pub async fn wait_replayed(&self) -> Result<(), PgError> {
        let Some(standby) = self.slot else {
            return Ok(());
        };
        let flushed = crate::postgres::wal_end(&*self.writes)
            .await
            .map_err(|source| PgError::SlotQuery {
                context: "cannot read the primary's WAL position: ",
                source,
            })?;
        wait_replayed(standby, flushed).await
    }
}

/// Waits until the server of `standby` has replayed WAL up to `needed` (a server
/// not in recovery: written it), polling, for at most [`REPLAY_WAIT`].
///
/// **Why.** A standby that restarts accepts connections once its replay is
/// consistent, still behind what it had replayed before; for a moment its WAL ends
/// below the position the relay saved on the primary. Judged then, the saved
/// position would look like one of a server restored in place (`cdc::start`), and
/// an exactly-once progress record like a restored one: the relay would stream
/// from older positions and publish again what it had delivered.
///
/// # Errors
///
/// [`PgError::StandbyBehind`] after [`REPLAY_WAIT`], or a query's error.
pub async fn wait_replayed(standby: &Client, needed: Lsn) -> Result<(), PgError> {
    let started = Instant::now();
    let mut logged = false;
    loop {
        let replayed =
            crate::postgres::wal_end(standby)
                .await
                .map_err(|source| PgError::SlotQuery {
                    context: "cannot read the standby's replay position: ",
                    source,
                })?;
        if replayed >= needed {
            return Ok(());
        }
        if started.elapsed() >= REPLAY_WAIT {
            return Err(PgError::StandbyBehind {
                needed,
                replayed,
                waited_secs: REPLAY_WAIT.as_secs(),
            });
        }
        if !logged {
            tracing::info!(%needed, %replayed, "waiting for the standby to replay the primary's WAL");
            logged = true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// While a slot is created on a standby: asks the primary for a running-transactions
/// record (`pg_log_standby_snapshot()`) every [`STANDBY_SNAPSHOT_INTERVAL`], until
/// dropped.
///
/// **Why.** Creating a logical slot on a standby waits until the standby replays a
/// running-transactions record written after the slot reserved its WAL. A primary
/// writes one on its own only every 15 s, and only while it has other WAL to write:
/// an idle primary would keep the creation waiting. The call needs the right to
/// execute the function (superusers by default; `config/least-privilege.sql`
/// grants it); without it the creation waits for the primary's own records, and
/// that is said once.
#[derive(Debug)]
pub struct StandbySnapshots(tokio::task::JoinHandle<()>);

/// How often [`StandbySnapshots`] asks.
pub const STANDBY_SNAPSHOT_INTERVAL: std::time::Duration = std::time::Duration::from_millis(500);

impl StandbySnapshots {
    /// Starts asking when the slot's server is a standby (`on_standby`) and the
    /// primary is known (`primary`); `None` otherwise.
    #[must_use]
    pub fn start(
        on_standby: bool,
        primary: Option<&crate::postgres::conninfo::ConnInfo>,
    ) -> Option<StandbySnapshots> {
        let primary = primary.filter(|_| on_standby)?.clone();
        Some(StandbySnapshots(tokio::spawn(async move {
            let mut client: Option<Client> = None;
            let mut warned = false;
            loop {
                if client.as_ref().is_none_or(Client::is_closed) {
                    client = crate::postgres::connect_info(&primary).await.ok();
                }
                if let Some(c) = &client
                    && let Err(e) = c.execute("SELECT pg_log_standby_snapshot()", &[]).await
                {
                    let refused =
                        e.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE);
                    if !warned {
                        tracing::warn!(error = %crate::postgres::describe_error(&e),
                            "cannot ask the primary for a standby snapshot (pg_log_standby_snapshot); \
                             the slot on the standby is created when the primary logs one on its own \
                             (every 15 s while it writes)");
                        warned = true;
                    }
                    if refused {
                        // Asking again will not help.
                        return;
                    }
                    client = None;
                }
                tokio::time::sleep(STANDBY_SNAPSHOT_INTERVAL).await;
            }
        })))
    }
}

impl Drop for StandbySnapshots {
    fn drop(&mut self) {
        self.0.abort();
    }
}
