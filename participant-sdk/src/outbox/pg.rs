//! The outbox and inbox in the service's PostgreSQL database.
//!
//! Tables, for a prefix `p` ([`PgOutbox::new`], default `dtx`):
//! - `p_outbox`: one row per message: `id` (bigserial), `aggregate`,
//!   `version` (unique per aggregate), `topic`, `payload` (bytea),
//!   `created_ms`, `state` (0 pending, 1 published, 2 dead-lettered,
//!   3 discarded), `attempts`, `last_error`, `next_attempt_ms`, `done_ms`
//!   (when published or discarded);
//! - `p_outbox_versions`: the last version of each aggregate. [`PgOutbox::write`]
//!   raises it with an upsert, which locks the aggregate's row until the
//!   writing transaction ends (commits, rolls back, or is prepared and
//!   then decided), so versions follow commit order and a rolled-back
//!   message leaves no gap;
//! - `p_inbox`: the ids of messages received, with when
//!   (`received_ms`, indexed for [`PgInbox::prune`]).
//!
//! A relay ([`PgRelay`]) runs one transaction per pass: it claims with
//! `FOR UPDATE OF o SKIP LOCKED` the pending, due messages that have no
//! earlier version pending or dead-lettered (the lowest open version of
//! each aggregate), publishes them one by one while holding their row
//! locks, records each outcome, and commits. Another relay skips the
//! locked rows, and cannot take version n + 1 of an aggregate while
//! version n is open, so each message is handed out once per pass and an
//! aggregate's messages in version order, whatever number of relays run.
//! Times are the relay's clock ([`super::Clock`]), not PostgreSQL's, so
//! tests move them by hand.

use std::sync::Arc;

use tokio_postgres::Client;
use tokio_postgres::Transaction;

use dtx_tls::logtext::Clean;

use super::publish_within;
use super::report_duplicate;
use super::report_pass;
use super::Clock;
use super::DeadLetter;
use super::Envelope;
use super::OutboxMessage;
use super::Publisher;
use super::Received;
use super::RelayOnce;
use super::RelayPass;
use super::RelaySettings;
use super::SystemClock;
use crate::postgres::HandlerError;

const PENDING: i16 = 0;
const PUBLISHED: i16 = 1;
const DEAD: i16 = 2;
const DISCARDED: i16 = 3;

/// A table prefix: a lowercase letter or `_`, then lowercase letters,
/// digits or `_`, at most 40 characters (the names are put into SQL text).
fn check_prefix(prefix: &str) -> Result<(), String> {
    let ok = !prefix.is_empty()
        && prefix.len() <= 40
        && prefix.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && prefix
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "outbox table prefix {prefix:?}: use 1 to 40 lowercase letters, digits or _, starting with a letter or _"
        ))
    }
}

/// The outbox's tables and the calls that write and administer them.
#[derive(Clone)]
pub struct PgOutbox {
    prefix: String,
    clock: Arc<dyn Clock>,
}

impl PgOutbox {
    /// The outbox in tables named `<prefix>_outbox` and
    /// `<prefix>_outbox_versions` (and the inbox's `<prefix>_inbox`), on
    /// the system clock.
    pub fn new(prefix: &str) -> Result<Self, String> {
        Self::with_clock(prefix, Arc::new(SystemClock))
    }

    /// As `new`, with times from `clock`.
    pub fn with_clock(prefix: &str, clock: Arc<dyn Clock>) -> Result<Self, String> {
        check_prefix(prefix)?;
        Ok(PgOutbox {
            prefix: prefix.to_string(),
            clock,
        })
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn t(&self) -> String {
        format!("{}_outbox", self.prefix)
    }

    /// Creates the outbox's and the inbox's tables if they are missing
    /// (under an advisory lock, so replicas starting together do not race).
    pub async fn create_schema(&self, db: &mut Client) -> Result<(), tokio_postgres::Error> {
        let p = &self.prefix;
        let tx = db.transaction().await?;
        tx.execute(
            "SELECT pg_advisory_xact_lock(hashtext($1))",
            &[&format!("dtx-outbox-schema-{p}")],
        )
        .await?;
        tx.batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS {p}_outbox (
                 id bigserial PRIMARY KEY,
                 aggregate text NOT NULL,
                 version bigint NOT NULL,
                 topic text NOT NULL,
                 payload bytea NOT NULL,
                 created_ms bigint NOT NULL,
                 state smallint NOT NULL DEFAULT 0,
                 attempts integer NOT NULL DEFAULT 0,
                 last_error text,
                 next_attempt_ms bigint NOT NULL,
                 done_ms bigint,
                 UNIQUE (aggregate, version)
             );
             CREATE INDEX IF NOT EXISTS {p}_outbox_open ON {p}_outbox (aggregate, version) WHERE state IN (0, 2);
             CREATE INDEX IF NOT EXISTS {p}_outbox_done ON {p}_outbox (done_ms) WHERE state IN (1, 3);
             CREATE TABLE IF NOT EXISTS {p}_outbox_versions (
                 aggregate text PRIMARY KEY,
                 last_version bigint NOT NULL
             );
             CREATE TABLE IF NOT EXISTS {p}_inbox (
                 message_id text PRIMARY KEY,
                 received_ms bigint NOT NULL
             );
             CREATE INDEX IF NOT EXISTS {p}_inbox_received ON {p}_inbox (received_ms);"
        ))
        .await?;
        tx.commit().await
    }

    /// Writes `msg` inside `tx`, the caller's transaction with the business
    /// rows: it is published only if `tx` commits (directly, or prepared
    /// and then committed). Returns the version it got: one more than the
    /// aggregate's last. Until `tx` ends, other writers of the same
    /// aggregate wait for it (the version row is locked).
    pub async fn write(&self, tx: &Transaction<'_>, msg: &OutboxMessage) -> Result<u64, tokio_postgres::Error> {
        let p = &self.prefix;
        let row = tx
            .query_one(
                &format!(
                    "INSERT INTO {p}_outbox_versions AS v (aggregate, last_version) VALUES ($1, 1)
                     ON CONFLICT (aggregate) DO UPDATE SET last_version = v.last_version + 1
                     RETURNING last_version"
                ),
                &[&msg.aggregate],
            )
            .await?;
        let version: i64 = row.get(0);
        let now = self.clock.now_ms() as i64;
        tx.execute(
            &format!(
                "INSERT INTO {p}_outbox (aggregate, version, topic, payload, created_ms, next_attempt_ms)
                 VALUES ($1, $2, $3, $4, $5, $5)"
            ),
            &[&msg.aggregate, &version, &msg.topic, &msg.payload, &now],
        )
        .await?;
        Ok(version as u64)
    }

    /// How long the oldest message not published yet (pending or
    /// dead-lettered) has waited, by the outbox's clock; `None` when there
    /// is none.
    pub async fn oldest_unpublished_age_ms(&self, db: &Client) -> Result<Option<u64>, tokio_postgres::Error> {
        let row = db
            .query_one(
                &format!("SELECT min(created_ms) FROM {} WHERE state IN (0, 2)", self.t()),
                &[],
            )
            .await?;
        let oldest: Option<i64> = row.get(0);
        Ok(oldest.map(|c| self.clock.now_ms().saturating_sub(c.max(0) as u64)))
    }

    /// Messages pending (not published, not dead-lettered).
    pub async fn pending_count(&self, db: &Client) -> Result<u64, tokio_postgres::Error> {
        let row = db
            .query_one(&format!("SELECT count(*) FROM {} WHERE state = 0", self.t()), &[])
            .await?;
        Ok(row.get::<_, i64>(0) as u64)
    }

    /// Up to `limit` dead-lettered messages, oldest first.
    pub async fn dead_letters(&self, db: &Client, limit: i64) -> Result<Vec<DeadLetter>, tokio_postgres::Error> {
        let rows = db
            .query(
                &format!(
                    "SELECT aggregate, version, topic, payload, attempts, coalesce(last_error, ''), created_ms
                     FROM {} WHERE state = 2 ORDER BY id LIMIT $1",
                    self.t()
                ),
                &[&limit],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| DeadLetter {
                aggregate: r.get(0),
                version: r.get::<_, i64>(1) as u64,
                topic: r.get(2),
                payload: r.get(3),
                attempts: r.get::<_, i32>(4) as u32,
                last_error: r.get(5),
                created_ms: r.get::<_, i64>(6) as u64,
            })
            .collect())
    }

    /// Puts a dead-lettered message back to pending, due now, with its
    /// attempts reset (its last error kept until the next attempt). False
    /// when it is not dead-lettered.
    pub async fn requeue(&self, db: &Client, aggregate: &str, version: u64) -> Result<bool, tokio_postgres::Error> {
        let now = self.clock.now_ms() as i64;
        let n = db
            .execute(
                &format!(
                    "UPDATE {} SET state = {PENDING}, attempts = 0, next_attempt_ms = $3
                     WHERE aggregate = $1 AND version = $2 AND state = {DEAD}",
                    self.t()
                ),
                &[&aggregate, &(version as i64), &now],
            )
            .await?;
        Ok(n == 1)
    }

    /// Gives up a dead-lettered message for good (kept as discarded until
    /// pruned): the aggregate's later messages go on. False when it is not
    /// dead-lettered.
    pub async fn discard(&self, db: &Client, aggregate: &str, version: u64) -> Result<bool, tokio_postgres::Error> {
        let now = self.clock.now_ms() as i64;
        let n = db
            .execute(
                &format!(
                    "UPDATE {} SET state = {DISCARDED}, done_ms = $3
                     WHERE aggregate = $1 AND version = $2 AND state = {DEAD}",
                    self.t()
                ),
                &[&aggregate, &(version as i64), &now],
            )
            .await?;
        Ok(n == 1)
    }

    /// Deletes published and discarded messages done more than
    /// `retention_ms` ago; returns how many.
    pub async fn prune_published(&self, db: &Client, retention_ms: u64) -> Result<u64, tokio_postgres::Error> {
        let before = self.clock.now_ms().saturating_sub(retention_ms) as i64;
        db.execute(
            &format!(
                "DELETE FROM {} WHERE state IN ({PUBLISHED}, {DISCARDED}) AND done_ms < $1",
                self.t()
            ),
            &[&before],
        )
        .await
    }
}

/// A relay over a [`PgOutbox`]'s table, on a connection of its own. Any
/// number of them, in one process or many, may run on one table.
pub struct PgRelay<P: Publisher> {
    outbox: PgOutbox,
    db: Client,
    publisher: Arc<P>,
    settings: RelaySettings,
}

impl<P: Publisher> PgRelay<P> {
    pub fn new(outbox: PgOutbox, db: Client, publisher: Arc<P>, settings: RelaySettings) -> Self {
        PgRelay {
            outbox,
            db,
            publisher,
            settings,
        }
    }

    /// One pass: claims the lowest open version of up to
    /// [`RelaySettings::batch_max`] aggregates (due, not locked by another
    /// relay), publishes each, records the outcomes and commits; then sets
    /// the metrics.
    pub async fn run_once(&mut self) -> Result<RelayPass, String> {
        let pass = self.pass().await.map_err(|e| e.to_string())?;
        let age = self
            .outbox
            .oldest_unpublished_age_ms(&self.db)
            .await
            .map_err(|e| e.to_string())?;
        report_pass(&self.settings.name, &pass, age);
        Ok(pass)
    }

    async fn pass(&mut self) -> Result<RelayPass, tokio_postgres::Error> {
        let t = self.outbox.t();
        let now = self.outbox.clock.now_ms() as i64;
        let tx = self.db.transaction().await?;
        let rows = tx
            .query(
                &format!(
                    "SELECT o.id, o.aggregate, o.version, o.topic, o.payload, o.attempts, o.created_ms
                     FROM {t} o
                     WHERE o.state = {PENDING} AND o.next_attempt_ms <= $1
                       AND NOT EXISTS (SELECT 1 FROM {t} e
                                       WHERE e.aggregate = o.aggregate AND e.version < o.version
                                         AND e.state IN ({PENDING}, {DEAD}))
                     ORDER BY o.id
                     LIMIT $2
                     FOR UPDATE OF o SKIP LOCKED"
                ),
                &[&now, &(self.settings.batch_max as i64)],
            )
            .await?;
        let mut pass = RelayPass {
            claimed: rows.len(),
            ..RelayPass::default()
        };
        for r in &rows {
            let id: i64 = r.get(0);
            let msg = Envelope {
                aggregate: r.get(1),
                version: r.get::<_, i64>(2) as u64,
                topic: r.get(3),
                payload: r.get(4),
                attempts: r.get::<_, i32>(5) as u32,
                created_ms: r.get::<_, i64>(6) as u64,
            };
            match publish_within(self.publisher.as_ref(), &msg, &self.settings).await {
                Ok(()) => {
                    tx.execute(
                        &format!("UPDATE {t} SET state = {PUBLISHED}, done_ms = $2 WHERE id = $1"),
                        &[&id, &(self.outbox.clock.now_ms() as i64)],
                    )
                    .await?;
                    pass.published += 1;
                }
                Err(reason) => {
                    let attempts = msg.attempts + 1;
                    let state = if attempts >= self.settings.max_attempts {
                        pass.dead_lettered += 1;
                        tracing::warn!(outbox = %self.settings.name, aggregate = %Clean(&msg.aggregate), version = msg.version,
                            "outbox message dead-lettered after {attempts} attempts: {reason}");
                        DEAD
                    } else {
                        pass.failed += 1;
                        PENDING
                    };
                    let next = now.saturating_add(self.settings.backoff_ms(attempts) as i64);
                    tx.execute(
                        &format!(
                            "UPDATE {t} SET state = $2, attempts = $3, last_error = $4, next_attempt_ms = $5 WHERE id = $1"
                        ),
                        &[&id, &state, &(attempts as i32), &reason, &next],
                    )
                    .await?;
                }
            }
        }
        tx.commit().await?;
        Ok(pass)
    }
}

impl<P: Publisher> RelayOnce for PgRelay<P> {
    async fn run_once(&mut self) -> Result<RelayPass, String> {
        PgRelay::run_once(self).await
    }

    fn settings(&self) -> &RelaySettings {
        &self.settings
    }
}

/// What a PostgreSQL inbox's handler returns: its result, in a boxed
/// future borrowing the transaction.
pub type InboxFuture<'a, T> = futures::future::BoxFuture<'a, Result<T, HandlerError>>;

/// The inbox in `<prefix>_inbox` ([`PgOutbox::create_schema`] creates it).
#[derive(Clone)]
pub struct PgInbox {
    prefix: String,
    name: String,
    clock: Arc<dyn Clock>,
}

impl PgInbox {
    /// `name` labels its metrics (`inbox`).
    pub fn new(prefix: &str, name: &str, clock: Arc<dyn Clock>) -> Result<Self, String> {
        check_prefix(prefix)?;
        Ok(PgInbox {
            prefix: prefix.to_string(),
            name: name.to_string(),
            clock,
        })
    }

    /// Records `message_id` in `tx`: false when it is new (recorded now;
    /// the caller goes on and its effects commit with the id), true when
    /// it was recorded before (a duplicate: skip it). A concurrent
    /// transaction that recorded the same id first makes this wait for
    /// it: its commit makes this a duplicate, its rollback a new one.
    pub async fn seen(&self, tx: &Transaction<'_>, message_id: &str) -> Result<bool, tokio_postgres::Error> {
        let n = tx
            .execute(
                &format!(
                    "INSERT INTO {}_inbox (message_id, received_ms) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                    self.prefix
                ),
                &[&message_id, &(self.clock.now_ms() as i64)],
            )
            .await?;
        let dup = n == 0;
        if dup {
            report_duplicate(&self.name);
        }
        Ok(dup)
    }

    /// Handles `message_id` once: in a new transaction on `db`, records the
    /// id and runs `handler` in the same transaction, then commits; a
    /// duplicate commits nothing and does not run the handler. A handler
    /// error rolls everything back (the message may come again).
    pub async fn receive<T, F>(
        &self,
        db: &mut Client,
        message_id: &str,
        handler: F,
    ) -> Result<Received<T>, HandlerError>
    where
        F: for<'a> FnOnce(&'a Transaction<'a>) -> InboxFuture<'a, T>,
    {
        let tx = db.transaction().await?;
        if self.seen(&tx, message_id).await? {
            tx.rollback().await?;
            return Ok(Received::Duplicate);
        }
        let out = handler(&tx).await?;
        tx.commit().await?;
        Ok(Received::Handled(out))
    }

    /// Deletes the ids received more than `retention_ms` ago; returns how
    /// many. A message redelivered after that is handled again, so the
    /// retention must exceed the longest redelivery delay.
    pub async fn prune(&self, db: &Client, retention_ms: u64) -> Result<u64, tokio_postgres::Error> {
        let before = self.clock.now_ms().saturating_sub(retention_ms) as i64;
        db.execute(
            &format!("DELETE FROM {}_inbox WHERE received_ms < $1", self.prefix),
            &[&before],
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_that_go_into_sql_are_checked() {
        for ok in ["dtx", "orders_1", "_x"] {
            assert!(check_prefix(ok).is_ok(), "{ok}");
        }
        for bad in ["", "1x", "Orders", "x;drop", "a b", &"x".repeat(41)] {
            assert!(check_prefix(bad).is_err(), "{bad}");
        }
    }
}
