//! The state machine's writes applied in memory and not yet in the engine:
//! the ones waiting to be handed over (`PendingWrites`) and the batches the
//! writer thread has yet to write (`in_flight`). A reader of what lives
//! only on disk (the retained records, ADR 0050) looks here first, so it
//! sees every apply the state in memory has seen.

use std::collections::BTreeMap;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::MutexGuard;

use super::engine::WriteBatch;

/// Applied entries whose state-machine writes may wait in memory before
/// they go to the engine in one batch (see `PendingWrites`).
pub(super) const SM_PENDING_ENTRIES_MAX: u64 = 1024;
/// How long the oldest waiting write may wait, checked at each apply.
const SM_PENDING_AGE_MAX_MS: u64 = 100;

/// Writes by key: `None` deletes.
pub(super) type Ops = BTreeMap<Vec<u8>, Option<Vec<u8>>>;

/// State-machine writes applied in memory and not yet given to the engine.
///
/// The Raft log is the durable record: an entry is applied only after a
/// quorum holds it, and this node's copy was synced before it counted. So
/// the state machine need not write each apply: the writes of many applies
/// are merged here (a later value of a key replaces an earlier one) and go
/// to the engine as one atomic batch, with the last-applied id they bring
/// the stored state to, when `SM_PENDING_ENTRIES_MAX` entries or
/// `SM_PENDING_AGE_MAX_MS` have gathered, before a snapshot is built, and
/// when the store is dropped. A node that stops before that reopens at the
/// older stored state and last-applied id, and openraft applies the
/// entries after it again from the log; the stored state is always the
/// state after some prefix of the log, never a mix. Each sled batch costs
/// log writes of its own, so one per apply was a large part of a node's
/// work (docs/benchmarks.md). A log purge never passes the stored state: it
/// follows a snapshot, and building one writes what is pending first.
#[derive(Debug, Default)]
pub(super) struct PendingWrites {
    pub(super) ops: Ops,
    entries: u64,
    pub(super) since: Option<std::time::Instant>,
}

impl PendingWrites {
    pub(super) fn add(&mut self, batch: WriteBatch, entries: u64) {
        for (k, v) in batch.ops {
            self.ops.insert(k, v);
        }
        self.entries += entries;
        self.since.get_or_insert_with(std::time::Instant::now);
    }

    pub(super) fn due(&self) -> bool {
        self.entries >= SM_PENDING_ENTRIES_MAX
            || self
                .since
                .is_some_and(|t| t.elapsed() >= std::time::Duration::from_millis(SM_PENDING_AGE_MAX_MS))
    }

    pub(super) fn take(&mut self) -> Ops {
        self.entries = 0;
        self.since = None;
        std::mem::take(&mut self.ops)
    }
}

/// The writes not in the engine yet, shared by the store (which adds and
/// hands over), its writer thread (which drops a batch once written) and
/// readers. Lock order: `pending` before `in_flight`.
#[derive(Clone, Debug, Default)]
pub(super) struct Unwritten {
    pending: Arc<Mutex<PendingWrites>>,
    /// Batches handed to the writer thread, oldest first, each dropped
    /// once the engine holds it.
    in_flight: Arc<Mutex<VecDeque<Arc<Ops>>>>,
}

impl Unwritten {
    pub(super) fn pending(&self) -> MutexGuard<'_, PendingWrites> {
        self.pending.lock().expect("pending state-machine writes lock poisoned")
    }

    fn in_flight(&self) -> MutexGuard<'_, VecDeque<Arc<Ops>>> {
        self.in_flight
            .lock()
            .expect("state-machine writes in flight lock poisoned")
    }

    /// Moves what `p` (the pending writes, locked by the caller) holds to
    /// the batches in flight and returns it for the writer thread.
    pub(super) fn start_writing(&self, p: &mut PendingWrites) -> Arc<Ops> {
        let ops = Arc::new(p.take());
        self.in_flight().push_back(ops.clone());
        ops
    }

    /// The writer thread wrote the `n` oldest batches in flight.
    pub(super) fn written(&self, n: usize) {
        let mut f = self.in_flight();
        for _ in 0..n {
            f.pop_front();
        }
    }

    /// The newest unwritten value of `key`: `Some(None)` when it is being
    /// deleted, None when no unwritten write touches it (the engine has
    /// its value). A caller that holds the state lock sees exactly the
    /// applies that state has seen: an apply adds its writes under it, and
    /// the writer drops a batch only after the engine holds it.
    pub(super) fn get(&self, key: &[u8]) -> Option<Option<Vec<u8>>> {
        let p = self.pending();
        if let Some(v) = p.ops.get(key) {
            return Some(v.clone());
        }
        let f = self.in_flight();
        f.iter().rev().find_map(|ops| ops.get(key).cloned())
    }

    /// Every unwritten write with `from <= key < to`, the newest of each
    /// key, in key order.
    pub(super) fn range(&self, from: &[u8], to: &[u8]) -> Ops {
        let p = self.pending();
        let f = self.in_flight();
        let mut out = Ops::new();
        for ops in f.iter() {
            for (k, v) in ops.range(from.to_vec()..to.to_vec()) {
                out.insert(k.clone(), v.clone());
            }
        }
        for (k, v) in p.ops.range(from.to_vec()..to.to_vec()) {
            out.insert(k.clone(), v.clone());
        }
        out
    }
}
