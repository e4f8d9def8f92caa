//! An outbox and an inbox for any service (docs/outbox.md,
//! docs/adr/0047-outbox-and-inbox.md).
//!
//! **Outbox.** A service writes a message in the same transaction as its
//! business rows: it is published if, and only if, that transaction
//! commits. Each message belongs to an *aggregate* (an order, an account)
//! and gets the next *version* of that aggregate when it is written. A
//! *relay* claims the lowest unpublished version of each aggregate, hands
//! it to the service's [`Publisher`] and marks it published; on an error it
//! retries with backoff, and after [`RelaySettings::max_attempts`] moves
//! the message to the *dead-letter* state. A dead-lettered message keeps
//! blocking the later versions of its aggregate until an operator requeues
//! or discards it, so a consumer never sees version 3 of an order before
//! version 2. Delivery is at least once (a relay that dies between the
//! publisher's OK and its own record publishes again): consumers
//! de-duplicate with an inbox.
//!
//! **Inbox.** A consumer records a message's id in the same transaction as
//! the effects of handling it; a redelivered message finds its id and is
//! skipped. Ids older than a retention are pruned.
//!
//! Two homes for both:
//! - [`pg`] (feature `postgres`): tables in the service's own PostgreSQL
//!   database, written inside the caller's tokio-postgres transaction
//!   (committed, or prepared with `PREPARE TRANSACTION` and then committed).
//!   Relays in any number of processes share the table: a claim is a row
//!   lock taken with `FOR UPDATE SKIP LOCKED`.
//! - [`store`]: keys in the SDK's own participant store
//!   ([`crate::store::ParticipantStore`]), written in the same atomic batch
//!   as the resource's own writes. The store belongs to one process, so
//!   its relays are tasks of that process; a claim is a lease (an owner
//!   and an expiry) held in memory.

#[cfg(feature = "postgres")]
pub mod pg;
pub mod store;

/// The examples of docs/outbox.md, compiled as doc tests (with the
/// `postgres` feature, which its PostgreSQL example needs).
#[cfg(all(doctest, feature = "postgres"))]
#[doc = include_str!("../../../docs/outbox.md")]
pub struct OutboxGuideExamples;

use std::future::Future;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// A message to write into an outbox.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxMessage {
    /// What the message is about (an order id, an account): the unit of
    /// ordering. Messages of one aggregate are published in the order
    /// they were written (the order their transactions committed).
    pub aggregate: String,
    /// Where it goes (a queue, a subject, an event type).
    pub topic: String,
    pub payload: Vec<u8>,
}

impl OutboxMessage {
    pub fn new(aggregate: impl Into<String>, topic: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        OutboxMessage {
            aggregate: aggregate.into(),
            topic: topic.into(),
            payload: payload.into(),
        }
    }
}

/// A message as a relay hands it to the [`Publisher`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Envelope {
    pub aggregate: String,
    /// 1 for the aggregate's first message, then 2, 3, ... without gaps.
    pub version: u64,
    pub topic: String,
    pub payload: Vec<u8>,
    /// Failed attempts before this one.
    pub attempts: u32,
    /// When it was written (ms since the Unix epoch, by the outbox's
    /// clock).
    pub created_ms: u64,
}

impl Envelope {
    /// An id for the consumer's inbox: the aggregate and the version,
    /// unique within one outbox (`order-7@3`). A consumer fed by several
    /// outboxes prefixes it with the producer's name.
    pub fn message_id(&self) -> String {
        format!("{}@{}", self.aggregate, self.version)
    }
}

/// Where a relay publishes (a broker, a webhook, another service).
pub trait Publisher: Send + Sync + 'static {
    /// Publishes `msg`: `Ok` once the destination has it, `Err` with the
    /// reason otherwise (kept with the message as its last error). It may
    /// see a message again (after an error it reported, or when a relay
    /// died after its OK), so the consumer de-duplicates
    /// ([`Envelope::message_id`]).
    fn publish(&self, msg: &Envelope) -> impl Future<Output = Result<(), String>> + Send;
}

/// A message in the dead-letter state: it failed
/// [`RelaySettings::max_attempts`] times. Its aggregate's later messages
/// wait until it is requeued or discarded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetter {
    pub aggregate: String,
    pub version: u64,
    pub topic: String,
    pub payload: Vec<u8>,
    pub attempts: u32,
    pub last_error: String,
    pub created_ms: u64,
}

/// How a relay works.
#[derive(Clone, Debug)]
pub struct RelaySettings {
    /// The outbox's name in metrics (the `outbox` label).
    pub name: String,
    /// Messages one pass claims at most (at most one per aggregate).
    pub batch_max: usize,
    /// Failed attempts after which a message is dead-lettered.
    pub max_attempts: u32,
    /// The wait after the first failed attempt; doubled after each next
    /// one, up to `retry_backoff_max_ms`.
    pub retry_backoff_ms: u64,
    pub retry_backoff_max_ms: u64,
    /// How long a publisher call may take; longer counts as a failed
    /// attempt ("timed out").
    pub publish_timeout_ms: u64,
    /// The own store's relays: how long a claim holds an aggregate. A
    /// relay that has not finished by then may find its message published
    /// by another one as well (at least once).
    pub lease_ms: u64,
    /// The wait of [`spawn_relay`]'s loop after a pass that found nothing
    /// to do.
    pub idle_poll_ms: u64,
}

impl Default for RelaySettings {
    fn default() -> Self {
        RelaySettings {
            name: "outbox".into(),
            batch_max: 100,
            max_attempts: 10,
            retry_backoff_ms: 500,
            retry_backoff_max_ms: 60_000,
            publish_timeout_ms: 10_000,
            lease_ms: 30_000,
            idle_poll_ms: 200,
        }
    }
}

impl RelaySettings {
    /// The wait before the next attempt after `attempts` failed ones.
    pub fn backoff_ms(&self, attempts: u32) -> u64 {
        let shift = attempts.saturating_sub(1).min(32);
        self.retry_backoff_ms
            .saturating_mul(1u64 << shift)
            .min(self.retry_backoff_max_ms.max(self.retry_backoff_ms))
    }
}

/// What one relay pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RelayPass {
    /// Messages claimed (handed to the publisher).
    pub claimed: usize,
    pub published: usize,
    /// Failed attempts that will be retried.
    pub failed: usize,
    /// Failed attempts that were the last ones: dead-lettered.
    pub dead_lettered: usize,
}

/// What an inbox did with a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Received<T> {
    /// First seen: the handler ran and its effects are recorded with the
    /// id.
    Handled(T),
    /// Seen before: the handler did not run.
    Duplicate,
}

/// Time for the outbox and inbox, in ms since the Unix epoch: injected so
/// tests move it by hand ([`ManualClock`]).
pub trait Clock: Send + Sync + 'static {
    fn now_ms(&self) -> u64;
}

/// The system's wall clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        crate::store::unix_ms()
    }
}

/// A clock that moves only when told (tests).
#[derive(Clone, Debug, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    pub fn new(now_ms: u64) -> Self {
        ManualClock(Arc::new(AtomicU64::new(now_ms)))
    }

    pub fn set(&self, now_ms: u64) {
        self.0.store(now_ms, Ordering::SeqCst);
    }

    pub fn advance(&self, ms: u64) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// Calls `publisher` for `msg` within the settings' timeout.
async fn publish_within<P: Publisher>(publisher: &P, msg: &Envelope, settings: &RelaySettings) -> Result<(), String> {
    let timeout = std::time::Duration::from_millis(settings.publish_timeout_ms);
    match tokio::time::timeout(timeout, publisher.publish(msg)).await {
        Ok(Ok(())) => Ok(()),
        // Kept as the message's last error and logged: escaped and bounded.
        Ok(Err(reason)) => Err(dtx_tls::logtext::clean(&reason)),
        Err(_) => Err(format!("timed out after {} ms", settings.publish_timeout_ms)),
    }
}

/// Counts a pass and sets the oldest-unpublished gauge (`age_ms`: `None`
/// when nothing is unpublished).
pub(crate) fn report_pass(name: &str, pass: &RelayPass, age_ms: Option<u64>) {
    let label = name.to_string();
    if pass.published > 0 {
        metrics::counter!("dtx_outbox_published_total", "outbox" => label.clone()).increment(pass.published as u64);
    }
    let failures = (pass.failed + pass.dead_lettered) as u64;
    if failures > 0 {
        metrics::counter!("dtx_outbox_publish_failures_total", "outbox" => label.clone()).increment(failures);
    }
    if pass.dead_lettered > 0 {
        metrics::counter!("dtx_outbox_dead_lettered_total", "outbox" => label.clone())
            .increment(pass.dead_lettered as u64);
    }
    report_oldest(name, age_ms);
}

/// Sets `dtx_outbox_oldest_unpublished_age_seconds{outbox}` (0 when
/// nothing is unpublished).
pub fn report_oldest(name: &str, age_ms: Option<u64>) {
    let secs = age_ms.unwrap_or(0) as f64 / 1000.0;
    metrics::gauge!("dtx_outbox_oldest_unpublished_age_seconds", "outbox" => name.to_string()).set(secs);
}

/// Counts a duplicate an inbox skipped.
pub(crate) fn report_duplicate(name: &str) {
    metrics::counter!("dtx_inbox_duplicates_total", "inbox" => name.to_string()).increment(1);
}

/// A relay of either home, for [`spawn_relay`].
pub trait RelayOnce: Send + 'static {
    /// One pass: claim, publish, record.
    fn run_once(&mut self) -> impl Future<Output = Result<RelayPass, String>> + Send;
    /// The settings it runs with.
    fn settings(&self) -> &RelaySettings;
}

/// Runs `relay` until the handle is aborted: pass after pass while there
/// is work, [`RelaySettings::idle_poll_ms`] apart when there is none or a
/// pass failed (logged).
pub fn spawn_relay<R: RelayOnce>(mut relay: R) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let idle = std::time::Duration::from_millis(relay.settings().idle_poll_ms);
            match relay.run_once().await {
                Ok(p) if p.claimed > 0 => continue,
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(outbox = %dtx_tls::logtext::Clean(&relay.settings().name), "outbox relay pass failed: {}", dtx_tls::logtext::Clean(&e))
                }
            }
            tokio::time::sleep(idle).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_cap() {
        let s = RelaySettings {
            retry_backoff_ms: 100,
            retry_backoff_max_ms: 1000,
            ..RelaySettings::default()
        };
        let waits: Vec<u64> = (1..=6).map(|a| s.backoff_ms(a)).collect();
        assert_eq!(waits, vec![100, 200, 400, 800, 1000, 1000]);
        assert_eq!(s.backoff_ms(200), 1000);
    }

    #[test]
    fn the_outbox_metrics_render() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            crate::metrics::describe();
            let pass = RelayPass {
                claimed: 4,
                published: 2,
                failed: 1,
                dead_lettered: 1,
            };
            report_pass("orders", &pass, Some(1500));
            report_duplicate("payments");
        });
        let text = handle.render();
        for line in [
            r#"dtx_outbox_published_total{outbox="orders"} 2"#,
            r#"dtx_outbox_publish_failures_total{outbox="orders"} 2"#,
            r#"dtx_outbox_dead_lettered_total{outbox="orders"} 1"#,
            r#"dtx_outbox_oldest_unpublished_age_seconds{outbox="orders"} 1.5"#,
            r#"dtx_inbox_duplicates_total{inbox="payments"} 1"#,
            "# HELP dtx_outbox_oldest_unpublished_age_seconds ",
        ] {
            assert!(text.contains(line), "{line:?} missing from {text}");
        }
    }
}
