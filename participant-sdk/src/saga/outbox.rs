//! The outbox relay: what it needs of a step store ([`Outbox`]), where it
//! delivers ([`OutboxSink`]), one pass ([`relay_once`]) and the loop that
//! delivers every event at least once ([`spawn_outbox_relay`]).

use std::sync::Arc;
use std::time::Duration;

use tracing::debug;
use tracing::warn;

use crate::participant::StoreError;
use crate::participant::StoreFailure;

/// Events one relay pass hands to the sink at most.
const RELAY_BATCH_MAX: usize = 100;

/// Where the outbox relay delivers events (a mail server, a queue, a
/// webhook). `Ok` means the sink has them: they are removed from the
/// outbox. A sink may see an event again (after an error, or a crash
/// between its `Ok` and the removal), so it should de-duplicate by the
/// event's number when that matters.
#[tonic::async_trait]
pub trait OutboxSink: Send + Sync {
    /// Delivers `events` (number, event), oldest first.
    async fn deliver(&self, events: &[(u64, Vec<u8>)]) -> Result<(), String>;
}

/// What the outbox relay needs of a step store: the sled
/// [`StepStore`](super::StepStore), and the PostgreSQL one
/// (`saga_pg::PgStepStore`, feature `postgres`).
#[tonic::async_trait]
pub trait Outbox: Send + Sync {
    /// Up to `max` events not delivered yet, oldest first (number, event).
    async fn pending(&self, max: usize) -> Result<Vec<(u64, Vec<u8>)>, StoreError>;
    /// Makes the events `pending` returned durable before they leave (the
    /// sled store fsyncs; what PostgreSQL returns is committed already).
    async fn make_durable(&self) -> Result<(), StoreError>;
    /// Removes delivered events, durably.
    async fn remove(&self, seqs: &[u64]) -> Result<(), StoreError>;
    /// Why the store stopped, if it has (the relay then ends).
    fn stopped_by(&self) -> Option<StoreFailure>;
}

/// One relay pass: makes the events durable (only durable events leave
/// the service), hands up to 100 pending events to `sink`, and removes
/// them once it said OK. Returns how many were delivered.
pub async fn relay_once<O: Outbox + ?Sized>(store: &O, sink: &dyn OutboxSink) -> Result<usize, String> {
    let events = store.pending(RELAY_BATCH_MAX).await.map_err(|e| e.to_string())?;
    if events.is_empty() {
        return Ok(0);
    }
    store.make_durable().await.map_err(|e| e.to_string())?;
    sink.deliver(&events).await?;
    let seqs: Vec<u64> = events.iter().map(|(s, _)| *s).collect();
    store.remove(&seqs).await.map_err(|e| e.to_string())?;
    Ok(seqs.len())
}

/// Delivers the outbox to `sink` at least once: every `interval` (at once
/// again while events remain), one pass of [`relay_once`]; a sink error is
/// logged and the same events are tried again after `interval`. Ends when
/// the store stops or the handle is aborted.
pub fn spawn_outbox_relay<O: Outbox + 'static>(
    store: Arc<O>,
    sink: Arc<dyn OutboxSink>,
    interval: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            if let Some(f) = store.stopped_by() {
                tracing::error!("outbox relay stopped: {f}");
                return;
            }
            match relay_once(store.as_ref(), sink.as_ref()).await {
                Ok(n) if n >= RELAY_BATCH_MAX => continue,
                Ok(n) => {
                    if n > 0 {
                        debug!(delivered = n, "outbox events delivered");
                    }
                }
                Err(e) => warn!("outbox delivery failed; retrying in {interval:?}: {e}"),
            }
            tokio::time::sleep(interval).await;
        }
    })
}
