//! Log levels an operator can alert on.
//!
//! openraft 0.9 logs at ERROR every failed replication or vote request to
//! a peer that is down or cut off: hundreds of lines a minute while one
//! node of three is away, which is routine and needs nobody. ERROR must
//! mean "act now", so those lines are held back here and summed up as one
//! WARN line every [`SUMMARY_EVERY`] while they keep coming. The same holds
//! for openraft's WARN lines about the same failures ("error replication to
//! target=..", "backoff mode: drain events ..": 15 to 24 a second while one
//! node is down). Everything else, openraft's other errors included (a fatal
//! storage error stops the node and is logged by it at ERROR too), passes
//! unchanged.

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tracing::field::Field;
use tracing::field::Visit;
use tracing::Event;
use tracing::Level;
use tracing::Metadata;
use tracing_subscriber::layer::Context;
use tracing_subscriber::layer::Filter;

/// How often the held-back lines are summed up (while there are any).
pub const SUMMARY_EVERY: Duration = Duration::from_secs(30);

/// How the messages of openraft's routine peer-unreachable errors begin
/// (0.9.25: replication/mod.rs and core/raft_core.rs).
const ROUTINE: &[&str] = &[
    "error replication to target",
    "RPCError",
    "timeout while confirming leadership for read request",
    "timeout",
    "while requesting vote",
];

/// Words inside the messages of openraft's routine WARN lines about a
/// peer it cannot reach (0.9.25: replication/mod.rs; the backoff line
/// starts with a function's path).
const ROUTINE_WITHIN: &[&str] = &[
    "backoff mode: drain events without processing them",
    "backoff exhausted",
];

/// Holds back openraft's routine peer errors and counts them.
#[derive(Clone, Default)]
pub struct RoutineRaftErrors {
    held: Arc<AtomicU64>,
}

impl RoutineRaftErrors {
    /// Lines held back since the last call.
    pub fn take(&self) -> u64 {
        self.held.swap(0, Ordering::Relaxed)
    }

    fn is_routine(event: &Event<'_>) -> bool {
        let meta = event.metadata();
        if !matches!(*meta.level(), Level::ERROR | Level::WARN) || !meta.target().starts_with("openraft") {
            return false;
        }
        let mut m = Message(None);
        event.record(&mut m);
        m.0.is_some_and(|text| {
            ROUTINE.iter().any(|r| text.starts_with(r)) || ROUTINE_WITHIN.iter().any(|r| text.contains(r))
        })
    }
}

struct Message(Option<String>);

impl Visit for Message {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0 = Some(value.to_string());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = Some(format!("{value:?}"));
        }
    }
}

impl<S> Filter<S> for RoutineRaftErrors {
    fn enabled(&self, _meta: &Metadata<'_>, _cx: &Context<'_, S>) -> bool {
        true
    }

    fn event_enabled(&self, event: &Event<'_>, _cx: &Context<'_, S>) -> bool {
        if Self::is_routine(event) {
            self.held.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        true
    }
}

/// Logs, every [`SUMMARY_EVERY`], how many routine lines were held back (a
/// thread of its own: a log line cannot be written from inside the filter).
pub fn spawn_summary(filter: RoutineRaftErrors) {
    let _ = std::thread::Builder::new()
        .name("log-summary".into())
        .spawn(move || loop {
            std::thread::sleep(SUMMARY_EVERY);
            let n = filter.take();
            if n > 0 {
                tracing::warn!(
                    held_back = n,
                    "raft: {n} replication or vote requests to peers failed in the last {}s (routine while a \
                     node is down or cut off; `admin status` shows which); openraft's ERROR and WARN lines for \
                     them are not printed",
                    SUMMARY_EVERY.as_secs()
                );
            }
        });
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::Layer;

    use super::*;

    /// Collects the messages that got through.
    #[derive(Clone, Default)]
    struct Seen(Arc<Mutex<Vec<String>>>);

    impl<S: tracing::Subscriber> Layer<S> for Seen {
        fn on_event(&self, event: &Event<'_>, _cx: tracing_subscriber::layer::Context<'_, S>) {
            let mut m = Message(None);
            event.record(&mut m);
            self.0.lock().unwrap().push(m.0.unwrap_or_default());
        }
    }

    #[test]
    fn routine_raft_peer_errors_are_held_back_and_counted_and_nothing_else_is() {
        let filter = RoutineRaftErrors::default();
        let seen = Seen::default();
        let subscriber = tracing_subscriber::registry().with(seen.clone().with_filter(filter.clone()));
        tracing::subscriber::with_default(subscriber, || {
            tracing::error!(target: "openraft::replication", error = "connection refused", "error replication to target={}", 2);
            tracing::error!(target: "openraft::replication", err = "unreachable", "RPCError");
            tracing::error!(target: "openraft::core::raft_core", target_node = 3, "while requesting vote");
            // openraft's WARN lines about the same failures.
            tracing::warn!(target: "openraft::replication", error = "unreachable", "error replication to target={}", 2);
            tracing::warn!(
                target: "openraft::replication",
                interval = 500,
                "{} backoff mode: drain events without processing them",
                "openraft::replication::ReplicationCore<C,N,LS>::backoff_drain_events"
            );
            // Not routine: openraft's other errors, our own errors, and
            // the same words below WARN.
            tracing::error!(target: "openraft::core::raft_core", "quit RaftCore::main on error");
            tracing::error!(target: "coordinator::node", "RPCError");
            tracing::info!(target: "openraft::replication", "RPCError");
            tracing::warn!(target: "openraft::core::raft_core", "leader has removed target: 3");
        });
        let seen = seen.0.lock().unwrap().clone();
        assert_eq!(
            seen,
            [
                "quit RaftCore::main on error",
                "RPCError",
                "RPCError",
                "leader has removed target: 3"
            ]
        );
        assert_eq!(filter.take(), 5, "the five routine ones are counted");
        assert_eq!(filter.take(), 0);
    }
}
