//! Per-address message groups, shared by phase one (`prepare_group`:
//! `PrepareMany`) and phase two (`phase_two`: `ApplyDecisions`). Pure: the
//! driver's owner task holds them (`owner`), and the time comes in as an
//! argument.
//!
//! Each call that wants to reach a participant address queues its item for
//! that address. With no message to the address in flight, the item that
//! finds the queue absent starts a sender task; while a message is in
//! flight, later items queue up and leave together as soon as its answer is
//! in (one message per address in flight at a time). Each item gets its own
//! answer back. An address that answered UNIMPLEMENTED (an SDK from before
//! the grouped message) is remembered for `SINGLE_CALLS_FOR`, and its items
//! are answered `SendAlone`: the caller makes its own single call.

use std::collections::HashMap;
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
    queues: HashMap<String, Queue<I, A>>,
    /// Addresses that answered UNIMPLEMENTED, and until when they get
    /// single calls.
    single_calls: HashMap<String, Instant>,
    /// Addresses whose answer ignored items riding in another kind of
    /// message (ADR 0030: an SDK from before), and until when none ride.
    no_riders: HashMap<String, Instant>,
    /// The number the next sender gets.
    next_sender: u64,
}

/// One address's queue, and the number of the sender task that owns it.
struct Queue<I, A> {
    sender: u64,
    items: Vec<Waiting<I, A>>,
}

impl<I, A> Default for Groups<I, A> {
    fn default() -> Self {
        Groups {
            queues: HashMap::new(),
            single_calls: HashMap::new(),
            no_riders: HashMap::new(),
            next_sender: 1,
        }
    }
}

/// True while `addr` is in `m` at `now` (an entry whose time ran out is
/// removed).
fn still_remembered(m: &mut HashMap<String, Instant>, addr: &str, now: Instant) -> bool {
    match m.get(addr) {
        Some(until) if now < *until => true,
        Some(_) => {
            m.remove(addr);
            false
        }
        None => false,
    }
}

/// Puts `addr` in `m` for `SINGLE_CALLS_FOR` from `now`; true when it was
/// not there.
fn remember(m: &mut HashMap<String, Instant>, addr: &str, now: Instant) -> bool {
    m.insert(addr.to_string(), now + SINGLE_CALLS_FOR).is_none()
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
    pub fn single_calls(&mut self, addr: &str, now: Instant) -> bool {
        still_remembered(&mut self.single_calls, addr, now)
    }

    /// Remembers that `addr` answered UNIMPLEMENTED; true the first time.
    pub fn remember_single_calls(&mut self, addr: &str, now: Instant) -> bool {
        remember(&mut self.single_calls, addr, now)
    }

    /// True while `addr` is known to ignore riding items.
    pub fn no_riders(&mut self, addr: &str, now: Instant) -> bool {
        still_remembered(&mut self.no_riders, addr, now)
    }

    /// Remembers that `addr` ignored riding items; true the first time.
    pub fn remember_no_riders(&mut self, addr: &str, now: Instant) -> bool {
        remember(&mut self.no_riders, addr, now)
    }

    /// Up to `max` queued items of `addr`, oldest first, to ride in a
    /// message of another kind that is leaving now (ADR 0030); none while
    /// the address is known to ignore them or to take single calls. Unlike
    /// [`Groups::take`] it never removes the queue: the address's sender
    /// task (waiting, or with a message in flight) still owns it, and ends
    /// when it finds it empty.
    pub fn take_along(&mut self, addr: &str, max: usize, now: Instant) -> Vec<Waiting<I, A>> {
        if self.no_riders(addr, now) || self.single_calls(addr, now) {
            return Vec::new();
        }
        let Some(q) = self.queues.get_mut(addr) else {
            return Vec::new();
        };
        q.items.retain(|w| !w.reply.is_closed());
        let n = q.items.len().min(max);
        q.items.drain(..n).collect()
    }

    /// Queues `item` for `addr`; `Some(sender)` when no sender task runs
    /// for `addr`: the caller must start one, with that number.
    pub fn push(&mut self, addr: &str, item: I, reply: oneshot::Sender<Answer<A>>) -> Option<u64> {
        let w = Waiting { item, reply };
        if let Some(q) = self.queues.get_mut(addr) {
            q.items.push(w);
            return None;
        }
        let sender = self.next_sender;
        self.next_sender += 1;
        self.queues.insert(addr.to_string(), Queue { sender, items: vec![w] });
        Some(sender)
    }

    /// The next message's items for `addr`, oldest first: at most `max`, and
    /// while their `cost` adds up to at most `cost_max` (the first item is
    /// always taken); items whose caller has gone away (its task ended or
    /// its time ran out) are dropped. Empty: nothing is left, and the queue
    /// is removed, so the next item starts a new sender.
    pub fn take(&mut self, addr: &str, max: usize, cost_max: usize, cost: impl Fn(&I) -> usize) -> Vec<Waiting<I, A>> {
        let Some(q) = self.queues.get_mut(addr) else {
            return Vec::new();
        };
        q.items.retain(|w| !w.reply.is_closed());
        if q.items.is_empty() {
            self.queues.remove(addr);
            return Vec::new();
        }
        let mut n = 0;
        let mut spent = 0usize;
        for w in q.items.iter().take(max) {
            spent = spent.saturating_add(cost(&w.item));
            if n > 0 && spent > cost_max {
                break;
            }
            n += 1;
        }
        q.items.drain(..n).collect()
    }

    /// The sender task `sender` of `addr` ended without emptying its queue
    /// (it panicked or was cancelled): its waiting items are dropped, so
    /// their callers see no answer (and the next item starts a new
    /// sender). A later sender's queue stays.
    pub fn abandon(&mut self, addr: &str, sender: u64) {
        if self.queues.get(addr).is_some_and(|q| q.sender == sender) {
            self.queues.remove(addr);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_queue_is_taken_oldest_first_up_to_the_limits_and_skips_gone_callers() {
        let mut g: Groups<u64, ()> = Groups::default();
        let mut rxs = Vec::new();
        for t in 0..5 {
            let (tx, rx) = oneshot::channel();
            assert_eq!(
                g.push("a", t, tx).is_some(),
                t == 0,
                "only the first item starts a sender"
            );
            rxs.push(rx);
        }
        drop(rxs.remove(1)); // txid 1's caller went away
        let first: Vec<u64> = g.take("a", 2, usize::MAX, |_| 0).into_iter().map(|w| w.item).collect();
        assert_eq!(first, vec![0, 2]);
        let (tx, _rx) = oneshot::channel();
        assert!(g.push("a", 9, tx).is_none(), "a sender still runs for a");
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
        assert!(
            g.push("a", 10, tx).is_some(),
            "the emptied queue is gone: a new sender starts"
        );
    }

    #[tokio::test]
    async fn an_abandoned_queue_goes_but_never_a_later_senders() {
        let mut g: Groups<u64, ()> = Groups::default();
        let (tx, rx) = oneshot::channel();
        let first = g.push("a", 1, tx).expect("a sender starts");
        g.abandon("a", first);
        assert!(rx.await.is_err(), "its caller sees no answer");
        let (tx, _rx) = oneshot::channel();
        let second = g.push("a", 2, tx).expect("a new sender starts");
        g.abandon("a", first);
        let left: Vec<u64> = g.take("a", 10, usize::MAX, |_| 0).into_iter().map(|w| w.item).collect();
        assert_eq!(left, vec![2], "the first sender's end leaves the second's queue");
        assert_ne!(first, second);
    }

    #[test]
    fn single_calls_are_remembered_per_address() {
        let mut g: Groups<u64, ()> = Groups::default();
        let now = Instant::now();
        assert!(!g.single_calls("a", now));
        assert!(g.remember_single_calls("a", now));
        assert!(!g.remember_single_calls("a", now), "said once");
        assert!(g.single_calls("a", now));
        assert!(!g.single_calls("b", now));
        assert!(
            !g.single_calls("a", now + SINGLE_CALLS_FOR),
            "tried again after a while"
        );
    }

    #[tokio::test]
    async fn riders_are_taken_without_ending_the_queue_and_never_from_an_address_that_ignores_them() {
        let mut g: Groups<u64, ()> = Groups::default();
        let now = Instant::now();
        assert!(g.take_along("a", 10, now).is_empty(), "no queue: nothing rides");
        let mut rxs = Vec::new();
        for t in 0..4 {
            let (tx, rx) = oneshot::channel();
            g.push("a", t, tx);
            rxs.push(rx);
        }
        drop(rxs.remove(0)); // txid 0's caller went away
        let riders: Vec<u64> = g.take_along("a", 2, now).into_iter().map(|w| w.item).collect();
        assert_eq!(
            riders,
            vec![1, 2],
            "oldest first, up to the limit, gone callers skipped"
        );
        let rest: Vec<u64> = g.take_along("a", 10, now).into_iter().map(|w| w.item).collect();
        assert_eq!(rest, vec![3]);
        // The queue is empty but still there: its sender still runs, so a
        // new item starts none; the sender's own take then ends it.
        let (tx, _rx) = oneshot::channel();
        assert!(g.push("a", 4, tx).is_none(), "the sender still owns the queue");
        assert!(g.remember_no_riders("a", now));
        assert!(!g.remember_no_riders("a", now), "said once");
        assert!(
            g.take_along("a", 10, now).is_empty(),
            "an address that ignores riders gets none"
        );
        let left: Vec<u64> = g.take("a", 10, usize::MAX, |_| 0).into_iter().map(|w| w.item).collect();
        assert_eq!(left, vec![4], "its items wait for their own message");
        assert!(g.take("a", 10, usize::MAX, |_| 0).is_empty());
        let (tx, _rx) = oneshot::channel();
        assert!(
            g.push("a", 5, tx).is_some(),
            "the sender ended the queue: a new one starts"
        );
        g.remember_single_calls("b", now);
        let (tx, _rx) = oneshot::channel();
        g.push("b", 1, tx);
        assert!(
            g.take_along("b", 10, now).is_empty(),
            "nor an address that takes single calls"
        );
    }
}
