//! Per-address message groups, shared by phase one (`prepare_group`:
//! `PrepareMany`) and phase two (`phase_two`: `ApplyDecisions`).
//!
//! Each call that wants to reach a participant address queues its item for
//! that address. With no message to the address in flight, the caller that
//! found the queue absent starts a sender task; while a message is in
//! flight, later items queue up and leave together as soon as its answer is
//! in (one message per address in flight at a time). Each item gets its own
//! answer back. An address that answered UNIMPLEMENTED (an SDK from before
//! the grouped message) is remembered for `SINGLE_CALLS_FOR`, and its items
//! are answered `SendAlone`: the caller makes its own single call.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

/// How long an address that answered UNIMPLEMENTED gets single calls before
/// the grouped message is tried again (the participant may have been
/// upgraded).
pub(super) const SINGLE_CALLS_FOR: Duration = Duration::from_secs(600);

/// The grouping state of every participant address (leader-local), for
/// items `I` answered with `A`.
pub(super) struct Groups<I, A> {
    queues: Mutex<HashMap<String, Vec<Waiting<I, A>>>>,
    /// Addresses that answered UNIMPLEMENTED, and until when they get
    /// single calls.
    single_calls: Mutex<HashMap<String, Instant>>,
    /// Addresses whose answer ignored items riding in another kind of
    /// message (ADR 0030: an SDK from before), and until when none ride.
    no_riders: Mutex<HashMap<String, Instant>>,
}

impl<I, A> Default for Groups<I, A> {
    fn default() -> Self {
        Groups {
            queues: Mutex::default(),
            single_calls: Mutex::default(),
            no_riders: Mutex::default(),
        }
    }
}

/// True while `addr` is in `m` and its time there has not run out (an
/// entry whose time ran out is removed).
fn still_remembered(m: &Mutex<HashMap<String, Instant>>, addr: &str) -> bool {
    let mut m = m.lock().expect("lock");
    match m.get(addr) {
        Some(until) if Instant::now() < *until => true,
        Some(_) => {
            m.remove(addr);
            false
        }
        None => false,
    }
}

/// Puts `addr` in `m` for `SINGLE_CALLS_FOR`; true when it was not there.
fn remember(m: &Mutex<HashMap<String, Instant>>, addr: &str) -> bool {
    m.lock()
        .expect("lock")
        .insert(addr.to_string(), Instant::now() + SINGLE_CALLS_FOR)
        .is_none()
}

/// One queued item and where its answer goes.
pub(super) struct Waiting<I, A> {
    pub item: I,
    pub reply: oneshot::Sender<Answer<A>>,
}

/// What became of one queued item.
#[derive(Debug)]
pub(super) enum Answer<A> {
    /// The item's result.
    Done(A),
    /// The address does not serve the grouped message: make the single call.
    SendAlone,
}

impl<I, A> Groups<I, A> {
    /// True while `addr` is known not to serve the grouped message.
    pub fn single_calls(&self, addr: &str) -> bool {
        still_remembered(&self.single_calls, addr)
    }

    /// Remembers that `addr` answered UNIMPLEMENTED; true the first time.
    pub fn remember_single_calls(&self, addr: &str) -> bool {
        remember(&self.single_calls, addr)
    }

    /// True while `addr` is known to ignore riding items.
    pub fn no_riders(&self, addr: &str) -> bool {
        still_remembered(&self.no_riders, addr)
    }

    /// Remembers that `addr` ignored riding items; true the first time.
    pub fn remember_no_riders(&self, addr: &str) -> bool {
        remember(&self.no_riders, addr)
    }

    /// Up to `max` queued items of `addr`, oldest first, to ride in a
    /// message of another kind that is leaving now (ADR 0030); none while
    /// the address is known to ignore them or to take single calls. Unlike
    /// [`Groups::take`] it never removes the queue: the address's sender
    /// task (waiting, or with a message in flight) still owns it, and ends
    /// when it finds it empty.
    pub fn take_along(&self, addr: &str, max: usize) -> Vec<Waiting<I, A>> {
        if self.no_riders(addr) || self.single_calls(addr) {
            return Vec::new();
        }
        let mut queues = self.queues.lock().expect("lock");
        let Some(q) = queues.get_mut(addr) else {
            return Vec::new();
        };
        q.retain(|w| !w.reply.is_closed());
        let n = q.len().min(max);
        q.drain(..n).collect()
    }

    /// Queues `item` for `addr`; true when no sender task runs for `addr`
    /// (the caller must start one).
    pub fn push(&self, addr: &str, item: I, reply: oneshot::Sender<Answer<A>>) -> bool {
        let mut queues = self.queues.lock().expect("lock");
        let start = !queues.contains_key(addr);
        queues
            .entry(addr.to_string())
            .or_default()
            .push(Waiting { item, reply });
        start
    }

    /// The next message's items for `addr`, oldest first: at most `max`, and
    /// while their `cost` adds up to at most `cost_max` (the first item is
    /// always taken); items whose caller has gone away (its task ended or
    /// its time ran out) are dropped. Empty: nothing is left, and the queue
    /// is removed, so the next item starts a new sender.
    pub fn take(&self, addr: &str, max: usize, cost_max: usize, cost: impl Fn(&I) -> usize) -> Vec<Waiting<I, A>> {
        let mut queues = self.queues.lock().expect("lock");
        let Some(q) = queues.get_mut(addr) else {
            return Vec::new();
        };
        q.retain(|w| !w.reply.is_closed());
        if q.is_empty() {
            queues.remove(addr);
            return Vec::new();
        }
        let mut n = 0;
        let mut spent = 0usize;
        for w in q.iter().take(max) {
            spent = spent.saturating_add(cost(&w.item));
            if n > 0 && spent > cost_max {
                break;
            }
            n += 1;
        }
        q.drain(..n).collect()
    }

    /// A sender task ended without emptying its queue (it panicked or was
    /// cancelled): its waiting items are dropped, so their callers see no
    /// answer (and, next time, a new sender starts).
    fn abandon(&self, addr: &str) {
        if let Ok(mut queues) = self.queues.lock() {
            queues.remove(addr);
        }
    }

    /// The sender task of `addr`: waits `wait` first (none when zero), then
    /// sends its queued items (copies) with `send`, one message at a time (`take`
    /// with `max`, `cost_max` and `cost`), until none is left; items of an
    /// address known to take single calls are answered `SendAlone`.
    pub async fn run_sender<F, Fut>(
        &self,
        addr: &str,
        wait: Duration,
        (max, cost_max, cost): (usize, usize, fn(&I) -> usize),
        mut send: F,
    ) where
        I: Clone,
        F: FnMut(Vec<I>) -> Fut,
        Fut: Future<Output = Vec<Answer<A>>>,
    {
        /// Whatever ends the task before its queue is empty drops what is
        /// left, so no caller waits for an answer that never comes.
        struct Guard<'a, I, A> {
            groups: &'a Groups<I, A>,
            addr: &'a str,
            done: bool,
        }
        impl<I, A> Drop for Guard<'_, I, A> {
            fn drop(&mut self) {
                if !self.done {
                    self.groups.abandon(self.addr);
                }
            }
        }
        let mut guard = Guard {
            groups: self,
            addr,
            done: false,
        };
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        loop {
            let batch = self.take(addr, max, cost_max, cost);
            if batch.is_empty() {
                guard.done = true;
                return;
            }
            let answers = if self.single_calls(addr) {
                batch.iter().map(|_| Answer::SendAlone).collect()
            } else {
                send(batch.iter().map(|w| w.item.clone()).collect()).await
            };
            for (w, a) in batch.into_iter().zip(answers) {
                let _ = w.reply.send(a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_queue_is_taken_oldest_first_up_to_the_limits_and_skips_gone_callers() {
        let g: Groups<u64, ()> = Groups::default();
        let mut rxs = Vec::new();
        for t in 0..5 {
            let (tx, rx) = oneshot::channel();
            assert_eq!(g.push("a", t, tx), t == 0, "only the first item starts a sender");
            rxs.push(rx);
        }
        drop(rxs.remove(1)); // txid 1's caller went away
        let first: Vec<u64> = g.take("a", 2, usize::MAX, |_| 0).into_iter().map(|w| w.item).collect();
        assert_eq!(first, vec![0, 2]);
        let (tx, _rx) = oneshot::channel();
        assert!(!g.push("a", 9, tx), "a sender still runs for a");
        // A cost limit: 3 and 4 cost 3 and 4; at most 5 in all, but the
        // first item always goes.
        let one: Vec<u64> = g
            .take("a", 10, 5, |&i| i as usize)
            .into_iter()
            .map(|w| w.item)
            .collect();
        assert_eq!(one, vec![3]);
        let big: Vec<u64> = g
            .take("a", 10, 2, |&i| i as usize)
            .into_iter()
            .map(|w| w.item)
            .collect();
        assert_eq!(big, vec![4], "an item over the cost limit alone still goes");
        let rest: Vec<u64> = g.take("a", 10, usize::MAX, |_| 0).into_iter().map(|w| w.item).collect();
        assert_eq!(rest, vec![9]);
        assert!(g.take("a", 10, usize::MAX, |_| 0).is_empty());
        let (tx, _rx) = oneshot::channel();
        assert!(g.push("a", 10, tx), "the emptied queue is gone: a new sender starts");
    }

    #[test]
    fn single_calls_are_remembered_per_address() {
        let g: Groups<u64, ()> = Groups::default();
        assert!(!g.single_calls("a"));
        assert!(g.remember_single_calls("a"));
        assert!(!g.remember_single_calls("a"), "said once");
        assert!(g.single_calls("a"));
        assert!(!g.single_calls("b"));
    }

    #[tokio::test]
    async fn riders_are_taken_without_ending_the_queue_and_never_from_an_address_that_ignores_them() {
        let g: Groups<u64, ()> = Groups::default();
        assert!(g.take_along("a", 10).is_empty(), "no queue: nothing rides");
        let mut rxs = Vec::new();
        for t in 0..4 {
            let (tx, rx) = oneshot::channel();
            g.push("a", t, tx);
            rxs.push(rx);
        }
        drop(rxs.remove(0)); // txid 0's caller went away
        let riders: Vec<u64> = g.take_along("a", 2).into_iter().map(|w| w.item).collect();
        assert_eq!(
            riders,
            vec![1, 2],
            "oldest first, up to the limit, gone callers skipped"
        );
        let rest: Vec<u64> = g.take_along("a", 10).into_iter().map(|w| w.item).collect();
        assert_eq!(rest, vec![3]);
        // The queue is empty but still there: its sender still runs, so a
        // new item starts none; the sender's own take then ends it.
        let (tx, _rx) = oneshot::channel();
        assert!(!g.push("a", 4, tx), "the sender still owns the queue");
        assert!(g.remember_no_riders("a"));
        assert!(!g.remember_no_riders("a"), "said once");
        assert!(
            g.take_along("a", 10).is_empty(),
            "an address that ignores riders gets none"
        );
        let left: Vec<u64> = g.take("a", 10, usize::MAX, |_| 0).into_iter().map(|w| w.item).collect();
        assert_eq!(left, vec![4], "its items wait for their own message");
        assert!(g.take("a", 10, usize::MAX, |_| 0).is_empty());
        let (tx, _rx) = oneshot::channel();
        assert!(g.push("a", 5, tx), "the sender ended the queue: a new one starts");
        g.remember_single_calls("b");
        let (tx, _rx) = oneshot::channel();
        g.push("b", 1, tx);
        assert!(
            g.take_along("b", 10).is_empty(),
            "nor an address that takes single calls"
        );
    }
}
