//! Releasing parked keys (`relay.on_poison = "park-key"`) once their poisoned
//! events are delivered.
//!
//! # Why a second phase
//!
//! A parked event must not reach the topic before the poisoned event of its key
//! that it waits for. So the main pass (`mod.rs`) publishes the selected rows
//! except the parked ones; this pass then takes each parked key whose poisoned
//! rows are all delivered now (by this run or an earlier one), publishes its parked
//! rows in the order the relay read them (`crate::poison::parking`), a page at a
//! time with every ack awaited, and releases the key. A relay running meanwhile may
//! park more events of the key; the release finds them (it checks under the key's
//! row lock) and they are published before the key is released. From then on the
//! relay produces the key's events itself.
//!
//! A key whose poisoned row failed again stays parked, and so does a key one of
//! whose parked rows fails: its later rows (already published in that page are
//! delivered; the failed one waits) keep the key parked until the next replay.

use super::ReplayReport;
use super::publish::{Sender, dry_run_page};
use super::report::{KeyOutcome, Outcome, ParkedKeyReport};
use super::store::{Originals, PoisonStore};
use crate::config::Config;
use crate::error::Error;
use crate::outbox::{OutboxMapper, PayloadFormat};
use crate::poison::ParkedKey;

/// What the release pass needs from the replay run.
pub(super) struct Release<'a> {
    pub(super) config: &'a Config,
    pub(super) mapper: &'a OutboxMapper,
    pub(super) store: &'a PoisonStore,
    pub(super) payload_format: PayloadFormat,
    pub(super) page_rows: usize,
}

impl Release<'_> {
    /// Releases every key in `keys` that can be, adding its rows and its outcome to
    /// `report`. `sender` is `None` for a dry run.
    pub(super) async fn run(
        &self,
        keys: &[ParkedKey],
        mut sender: Option<&mut Sender>,
        report: &mut ReplayReport,
    ) -> Result<(), Error> {
        let mut originals = Originals::default();
        for key in keys {
            let outcome = if let Some(blocker) = self.store.blocker(key).await? {
                KeyOutcome::StillParked {
                    reason: format!(
                        "poison row {blocker} of this key is not delivered yet: fix its cause \
                         and replay it"
                    ),
                }
            } else {
                match sender.as_deref_mut() {
                    Some(sender) => self.release(key, sender, &mut originals, report).await?,
                    None => self.dry_run(key, report).await?,
                }
            };
            if report.aborted.is_some() {
                return Ok(());
            }
            report.keys.push(ParkedKeyReport {
                topic: key.topic.clone(),
                key: key.key.clone(),
                outcome,
            });
        }
        Ok(())
    }

    /// Publishes the key's parked rows in order and releases it.
    async fn release(
        &self,
        key: &ParkedKey,
        sender: &mut Sender,
        originals: &mut Originals,
        report: &mut ReplayReport,
    ) -> Result<KeyOutcome, Error> {
        let mut delivered = 0;
        loop {
            let mut page = self.store.key_page(key, 0, self.page_rows).await?;
            if page.is_empty() {
                if self.store.release(key).await? {
                    tracing::info!(topic = %key.topic, key = %key.key, delivered, "key released");
                    return Ok(KeyOutcome::Released { delivered });
                }
                continue;
            }
            self.store
                .restore_originals(&self.config.outbox, originals, &mut page)
                .await?;
            let (rows, fatal) = sender
                .publish_page(self.mapper, &page, self.payload_format)
                .await?;
            let acked: Vec<i64> = rows
                .iter()
                .filter(|r| r.outcome == Outcome::Published)
                .map(|r| r.poison_id)
                .collect();
            self.store.mark_replayed(&acked).await?;
            let failed = rows.iter().find(|r| r.outcome == Outcome::Failed).cloned();
            delivered += acked.len() as u64;
            report.selected += rows.len() as u64;
            for row in rows {
                report.add(row);
            }
            if let Some(reason) = fatal {
                report.aborted = Some(reason);
                return Ok(KeyOutcome::StillParked {
                    reason: "the replay stopped".into(),
                });
            }
            if let Some(row) = failed {
                return Ok(KeyOutcome::StillParked {
                    reason: format!(
                        "parked row {} could not be delivered: {}",
                        row.poison_id,
                        row.error.unwrap_or_default()
                    ),
                });
            }
        }
    }

    /// Lists what a release would publish; changes nothing.
    async fn dry_run(
        &self,
        key: &ParkedKey,
        report: &mut ReplayReport,
    ) -> Result<KeyOutcome, Error> {
        let mut offset = 0;
        loop {
            let page = self.store.key_page(key, offset, self.page_rows).await?;
            if page.is_empty() {
                return Ok(KeyOutcome::WouldRelease {
                    rows: offset as u64,
                });
            }
            offset += page.len();
            let rows = dry_run_page(self.mapper, &page, self.payload_format);
            report.selected += rows.len() as u64;
            for row in rows {
                report.add(row);
            }
        }
    }
}
