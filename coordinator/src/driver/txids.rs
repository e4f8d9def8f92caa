//! The one-write path's leader-local book (ADR 0012, `fast`): the txid
//! ranges this leader reserved, the txids it handed out whose one write has
//! no known result yet (a decision read answers PENDING for them), and the
//! idempotency keys in flight. Pure: the driver's owner holds it (in
//! `book::Book`) and applies its messages to it; `fast` is the async shell.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::oneshot;
use tokio::sync::watch;

use crate::sm::Txid;

/// The fast path's leader-local state (not replicated), held by the
/// driver's owner.
#[derive(Default)]
pub(super) struct FastBook {
    /// The range txids are handed out from, and the one reserved ahead to
    /// follow it.
    range: Option<TxidRange>,
    spare: Option<TxidRange>,
    /// Handed out here, and not yet known to be applied or refused: a
    /// decision read answers PENDING for them, Status PREPARING.
    in_flight: HashMap<Txid, InFlight>,
    /// BeginAndCommit calls on the fast path here, by idempotency key: a
    /// retry with the same key waits for the first instead of starting a
    /// second transaction.
    keys: HashMap<String, KeyInFlight>,
    /// A `ReserveTxids` is out; these wait for it.
    reserving: Option<Vec<oneshot::Sender<()>>>,
}

/// A txid in flight on the fast path: the term it was handed out in, and
/// what Status shows of it until its record exists.
struct InFlight {
    term: u64,
    view: Arc<InFlightView>,
}

/// A transaction on the fast path before its one write: Prepares sent to
/// these participants, no record in the cluster yet.
#[derive(Clone, Debug)]
pub struct InFlightView {
    /// (participant id, address), in the order given.
    pub participants: Vec<(String, String)>,
    pub begun_ms: u64,
    pub deadline_ms: u64,
    /// The application it is for, when authentication is on.
    pub owner: Option<String>,
}

/// Txids `[next, end)` of a range reserved in `term`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct TxidRange {
    term: u64,
    next: Txid,
    end: Txid,
}

struct KeyInFlight {
    fingerprint: [u8; 32],
    txid: Txid,
    /// Dropped when the call ends: its waiters go on.
    done: watch::Sender<()>,
}

/// What [`FastBook::begin`] found.
pub(super) enum Begin {
    /// `txid` is this call's: its key is registered, its txid in flight.
    Begun(Txid),
    /// The same key is in flight here (with this request fingerprint):
    /// wait for it to end, then its record answers.
    Waiting {
        fingerprint: [u8; 32],
        done: watch::Receiver<()>,
    },
    /// No txid left in this term's ranges: reserve, then ask again.
    NoTxid,
}

/// What [`FastBook::reserve`] says.
pub(super) enum Reserve {
    /// Nothing to reserve.
    NotNeeded,
    /// This caller reserves; it tells the owner the range when done.
    Go,
    /// Another caller reserves: wait for it, then look again.
    Wait(oneshot::Receiver<()>),
}

impl FastBook {
    /// Some work of this path on `txid` runs here.
    pub fn in_flight_here(&self, txid: Txid) -> bool {
        self.in_flight.contains_key(&txid)
    }

    /// A BeginAndCommit with `key` in `term`: the next txid of this term's
    /// range (moving on to the spare when it is used up), in flight in
    /// `term` and shown as `view`, with the key registered; or the call
    /// of the same key in flight here; or nothing left to hand out.
    pub fn begin(&mut self, key: &str, fingerprint: [u8; 32], term: u64, view: Arc<InFlightView>) -> Begin {
        if let Some(k) = self.keys.get(key) {
            return Begin::Waiting {
                fingerprint: k.fingerprint,
                done: k.done.subscribe(),
            };
        }
        if self.range.is_none_or(|r| r.term != term || r.next >= r.end) {
            self.range = self.spare.take().filter(|r| r.term == term);
        }
        let Some(r) = self.range.as_mut().filter(|r| r.term == term && r.next < r.end) else {
            return Begin::NoTxid;
        };
        let txid = r.next;
        r.next += 1;
        self.in_flight.insert(txid, InFlight { term, view });
        let (done, _) = watch::channel(());
        self.keys.insert(
            key.to_string(),
            KeyInFlight {
                fingerprint,
                txid,
                done,
            },
        );
        Begin::Begun(txid)
    }

    /// The call that took `txid` for `key` ended: its key goes (its
    /// waiters go on), and its txid too unless `keep`.
    pub fn end(&mut self, key: &str, txid: Txid, keep: bool) {
        if self.keys.get(key).is_some_and(|k| k.txid == txid) {
            self.keys.remove(key);
        }
        if !keep {
            self.in_flight.remove(&txid);
        }
    }

    /// For a decision read on this leader in `term`, per txid of `txids`:
    /// true when it was handed out here in `term` and its one write has no
    /// known result yet (the answer is PENDING). A txid of this term's
    /// range not handed out yet is skipped for good, so the "unknown"
    /// answered for it stays true.
    pub fn pending(&mut self, txids: &[Txid], term: u64) -> Vec<bool> {
        txids
            .iter()
            .map(|&txid| {
                if self.in_flight.get(&txid).is_some_and(|f| f.term == term) {
                    return true;
                }
                for r in [self.range.as_mut(), self.spare.as_mut()].into_iter().flatten() {
                    if r.term == term && txid >= r.next && txid < r.end {
                        r.next = txid + 1;
                    }
                }
                false
            })
            .collect()
    }

    /// What Status shows of `txid` while it is in flight here in `term`.
    pub fn view(&self, txid: Txid, term: u64) -> Option<Arc<InFlightView>> {
        self.in_flight
            .get(&txid)
            .filter(|f| f.term == term)
            .map(|f| f.view.clone())
    }

    /// The leader loop's care in `term`: drops what an older term left
    /// (its ranges, and its in-flight txids, whose writes can no longer
    /// apply after this term's first entry). Returns this term's in-flight
    /// txids (those recorded by now go too: [`FastBook::recorded`]) and
    /// whether the next range should be reserved ahead (the current one
    /// runs low, with `count` txids per range). Only once the fast path is
    /// in use in this term (its first transaction reserves): a cluster
    /// that never takes it spends no txids.
    pub fn housekeeping(&mut self, term: u64, count: u64) -> (Vec<Txid>, bool) {
        if self.range.is_some_and(|r| r.term != term) {
            self.range = None;
        }
        if self.spare.is_some_and(|r| r.term != term) {
            self.spare = None;
        }
        self.in_flight.retain(|_, f| f.term == term);
        let low = self.spare.is_none() && self.range.is_some_and(|r| r.end - r.next < count.div_ceil(4));
        (self.in_flight.keys().copied().collect(), low)
    }

    /// These in-flight txids are recorded now.
    pub fn recorded(&mut self, txids: &[Txid]) {
        for t in txids {
            self.in_flight.remove(t);
        }
    }

    /// Whether a range must be reserved for `term` (with `count` txids per
    /// range): with `ahead`, when the current one runs low and there is no
    /// spare; otherwise when nothing is left to hand out. One reservation
    /// at a time: while one is out, the caller waits for it.
    pub fn reserve(&mut self, term: u64, ahead: bool, count: u64) -> Reserve {
        if let Some(waiters) = &mut self.reserving {
            let (tx, rx) = oneshot::channel();
            waiters.push(tx);
            return Reserve::Wait(rx);
        }
        let left = |r: Option<TxidRange>| r.filter(|r| r.term == term).map_or(0, |r| r.end - r.next);
        let (current, spare) = (left(self.range), left(self.spare));
        let needed = if ahead {
            spare == 0 && current < count.div_ceil(4)
        } else {
            current == 0 && spare == 0
        };
        if !needed {
            return Reserve::NotNeeded;
        }
        self.reserving = Some(Vec::new());
        Reserve::Go
    }

    /// The reservation for `term` ended with `range` (`[first, end)`;
    /// none if it failed): it becomes the current range, or the spare
    /// while the current one has txids left. Its waiters go on.
    pub fn reserved(&mut self, term: u64, range: Option<(Txid, Txid)>) {
        if let Some((first, end)) = range {
            let reserved = TxidRange { term, next: first, end };
            match self.range {
                Some(r) if r.term == term && r.next < r.end => self.spare = Some(reserved),
                _ => self.range = Some(reserved),
            }
        }
        for w in self.reserving.take().unwrap_or_default() {
            let _ = w.send(());
        }
    }
}
