//! The fast commit path (ADR 0012): one replicated write between the
//! participants' votes and the client's answer.
//!
//! `BeginAndCommit` with its whole participant set normally costs two Raft
//! writes in series: the record in PREPARING, then the decision. Here the
//! leader hands the transaction a txid from a range it reserved earlier
//! (`ReserveTxids`, one Raft write per `txn.txid_reserve_count`
//! transactions), sends Prepare at once, and after the votes writes the
//! record, its participant set and its decision in one command
//! (`BeginAndDecide`). DESIGN's second freezing rule: the decision carries
//! the set that voted, and nothing can enlist into a record that is born
//! decided.
//!
//! Until that write is applied the cluster has no record of the
//! transaction, and a participant holding a YES vote asks about it (its
//! recovery pass). The answer must never be "unknown" while the write may
//! still be applied, so:
//! - this leader answers PENDING for every txid it handed out in its
//!   current term whose write has no known result yet (`in_flight`);
//! - the state machine records ABORT instead of COMMIT for a write whose
//!   log entry is of another term than the one the txid was handed out in,
//!   so once a leader of a later term has applied its first entry (every
//!   linearizable read waits for it), an unknown txid handed out earlier
//!   can never be committed, and "unknown: presumed abort" is the truth;
//! - a range is used only in the term it was reserved in, so no txid is
//!   handed out twice.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;

use tokio::sync::watch;
use tracing::info;
use tracing::warn;
use tracing::Instrument;

use super::BegunAndDecided;
use super::Driver;
use super::RoundResult;
use crate::ctx::now_ms;
use crate::ctx::ApiError;
use crate::sm::tally;
use crate::sm::tally::Tally;
use crate::sm::Command;
use crate::sm::CommandOk;
use crate::sm::Enlistment;
use crate::sm::Participant;
use crate::sm::Txid;

/// The fast path's leader-local state (not replicated).
#[derive(Default)]
pub(super) struct FastState {
    inner: Mutex<FastInner>,
    /// One `ReserveTxids` at a time.
    reserving: tokio::sync::Mutex<()>,
}

#[derive(Default)]
struct FastInner {
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
#[derive(Clone, Copy, Debug)]
struct TxidRange {
    term: u64,
    next: Txid,
    end: Txid,
}

struct KeyInFlight {
    fingerprint: [u8; 32],
    done: watch::Receiver<bool>,
}

/// Clears a key's entry (and wakes its waiters) however the call ends.
struct KeyGuard<'a> {
    driver: &'a Driver,
    key: String,
    done: watch::Sender<bool>,
}

impl Drop for KeyGuard<'_> {
    fn drop(&mut self) {
        self.driver.fast.lock().keys.remove(&self.key);
        let _ = self.done.send(true);
    }
}

impl FastState {
    fn lock(&self) -> std::sync::MutexGuard<'_, FastInner> {
        self.inner.lock().expect("fast path lock poisoned")
    }
}

/// What the fast path made of a BeginAndCommit.
pub(super) enum FastOutcome {
    Done(BegunAndDecided),
    /// The idempotency key belongs to a recorded transaction (or did by
    /// the time the write was applied): the recorded one answers, through
    /// the two-write path, which finds it by its key.
    KeyKnown,
}

impl Driver {
    /// Whether a BeginAndCommit of `participants` participants takes the
    /// fast path: on unless `txn.one_write_commit` is off, and not for a
    /// single participant committed in one phase (whose `one_phase` mark
    /// must be recorded before its message is sent, ADR 0006).
    pub(super) fn fast_path_applies(&self, participants: usize) -> bool {
        let t = &self.ctx.config.txn;
        t.one_write_commit && !(participants == 1 && t.one_phase_commit)
    }

    /// For a decision read on this leader in `term`, per txid of `txids`:
    /// true when it was handed out here in `term` and its one write has no
    /// known result yet (the answer is PENDING). A txid of this term's
    /// range not handed out yet is skipped for good, so the "unknown"
    /// answered for it stays true. One lock for the whole batch.
    pub fn fast_in_flight(&self, txids: &[Txid], term: u64) -> Vec<bool> {
        let mut g = self.fast.lock();
        let g = &mut *g;
        txids
            .iter()
            .map(|&txid| {
                if g.in_flight.get(&txid).is_some_and(|f| f.term == term) {
                    return true;
                }
                for r in [g.range.as_mut(), g.spare.as_mut()].into_iter().flatten() {
                    if r.term == term && txid >= r.next && txid < r.end {
                        r.next = txid + 1;
                    }
                }
                false
            })
            .collect()
    }

    /// The leader loop's care of the fast path: drops what an older term
    /// left (its range, its in-flight txids, whose writes can no longer
    /// apply after this term's first entry) and whatever is recorded now,
    /// and reserves the next range ahead of need, so only the first
    /// transaction of a term waits for a `ReserveTxids`.
    pub(super) fn fast_housekeeping(self: &Arc<Self>, term: u64) {
        if !self.ctx.config.txn.one_write_commit {
            return;
        }
        let low = {
            let mut g = self.fast.lock();
            if g.range.is_some_and(|r| r.term != term) {
                g.range = None;
            }
            if g.spare.is_some_and(|r| r.term != term) {
                g.spare = None;
            }
            let st = self.ctx.sm.state();
            g.in_flight.retain(|t, f| f.term == term && st.table.get(*t).is_none());
            let count = self.ctx.config.txn.txid_reserve_count;
            // Only once the fast path is in use in this term (its first
            // transaction reserves): a cluster that never takes it spends
            // no txids.
            g.spare.is_none() && g.range.is_some_and(|r| r.end - r.next < count.div_ceil(4))
        };
        if low && self.ctx.is_leader_of(term) {
            let driver = self.clone();
            tokio::spawn(async move {
                if let Err(e) = driver.reserve_txids(term, true).await {
                    warn!("txids not reserved ahead: {e}");
                }
            });
        }
    }

    /// Reserves a range for `term` (one `ReserveTxids` at a time): the
    /// current one when there is none, else the spare that follows it.
    /// With `ahead`, only when the current one runs low and there is no
    /// spare; otherwise only when nothing is left to hand out.
    async fn reserve_txids(&self, term: u64, ahead: bool) -> Result<(), ApiError> {
        let _one = self.fast.reserving.lock().await;
        let count = self.ctx.config.txn.txid_reserve_count;
        let needed = {
            let g = self.fast.lock();
            let left = |r: Option<TxidRange>| r.filter(|r| r.term == term).map_or(0, |r| r.end - r.next);
            let (current, spare) = (left(g.range), left(g.spare));
            if ahead {
                spare == 0 && current < count.div_ceil(4)
            } else {
                current == 0 && spare == 0
            }
        };
        if !needed {
            return Ok(());
        }
        let (first, end) = match self.ctx.propose(Command::ReserveTxids { count }).await? {
            CommandOk::TxidsReserved { first, end } => (first, end),
            other => return Err(ApiError::Internal(format!("unexpected state-machine result {other:?}"))),
        };
        dtx_failpoint::failpoint!("coordinator_after_reserve");
        metrics::counter!("dtx_txid_ranges_reserved_total").increment(1);
        if self.ctx.current_term() != term {
            // Reserved across a leader change: left unused (a gap of
            // txids is harmless; handing one out twice is not).
            return Err(ApiError::Unavailable(format!(
                "leadership changed while txids were reserved in term {term}"
            )));
        }
        let reserved = TxidRange { term, next: first, end };
        let mut g = self.fast.lock();
        match g.range {
            Some(r) if r.term == term && r.next < r.end => g.spare = Some(reserved),
            _ => g.range = Some(reserved),
        }
        Ok(())
    }

    /// What Status shows of `txid` while it is in flight here in `term`
    /// (no record yet, Prepares sent); `None` otherwise. Like
    /// [`Self::fast_in_flight`], asked before the read of the table.
    pub fn fast_in_flight_view(&self, txid: Txid, term: u64) -> Option<Arc<InFlightView>> {
        let g = self.fast.lock();
        g.in_flight
            .get(&txid)
            .filter(|f| f.term == term)
            .map(|f| f.view.clone())
    }

    /// Hands out the next txid of this term's range (moving on to the
    /// spare, or reserving, when it is used up) and marks it in flight in
    /// `term`, shown as `view`.
    async fn hand_out_txid(&self, term: u64, view: &Arc<InFlightView>) -> Result<Txid, ApiError> {
        for _ in 0..3 {
            {
                let mut g = self.fast.lock();
                let g = &mut *g;
                if g.range.is_none_or(|r| r.term != term || r.next >= r.end) {
                    g.range = g.spare.take().filter(|r| r.term == term);
                }
                if let Some(r) = g.range.as_mut().filter(|r| r.term == term && r.next < r.end) {
                    let t = r.next;
                    r.next += 1;
                    g.in_flight.insert(
                        t,
                        InFlight {
                            term,
                            view: view.clone(),
                        },
                    );
                    return Ok(t);
                }
            }
            self.reserve_txids(term, false).await?;
        }
        Err(ApiError::Unavailable(
            "no txid range could be reserved for this term".into(),
        ))
    }

    /// BeginAndCommit on the fast path. The drive runs in its own task, so
    /// a client that goes away does not stop it between the Prepares and
    /// the one write.
    pub(super) async fn fast_begin_and_commit(
        self: &Arc<Self>,
        idempotency_key: String,
        fingerprint: [u8; 32],
        timeout_ms: u64,
        participants: Vec<Enlistment>,
        app: Option<String>,
    ) -> Result<FastOutcome, ApiError> {
        if self.ctx.sm.state().table.txid_of_key(&idempotency_key).is_some() {
            return Ok(FastOutcome::KeyKnown);
        }
        if !self.ctx.is_leader() {
            // Certainly not proposed: the caller's error says where to go
            // (NotLeader with the leader's address, so the call is
            // forwarded like every other; found by t106).
            return Err(self.ctx.not_leader());
        }
        if let Err(why) = self.ctx.quorum_heard() {
            // Invariant 13: a leader cut off from its quorum hands out no
            // txid and locks no participant (its Prepares would hold locks
            // that make the client's retry at the real leader vote NO).
            // Certainly not begun: the caller tries another node.
            metrics::counter!("dtx_writes_refused_no_quorum_total").increment(1);
            return Err(ApiError::NoLeader(format!("not begun here: {why}; try another node")));
        }
        // Either this call registers the key (and drives), or it finds the
        // same key in flight here (and waits for it).
        let registered = {
            let mut g = self.fast.lock();
            match g.keys.get(&idempotency_key) {
                Some(k) => Err((k.fingerprint, k.done.clone())),
                None => {
                    let (tx, rx) = watch::channel(false);
                    g.keys
                        .insert(idempotency_key.clone(), KeyInFlight { fingerprint, done: rx });
                    Ok(tx)
                }
            }
        };
        let waiting = match registered {
            Err(waiting) => waiting,
            Ok(tx) => {
                let driver = self.clone();
                // The request's span and trace go with the drive's task.
                let task = tokio::spawn(
                    dtx_client::trace::with_current(async move {
                        let _key = KeyGuard {
                            driver: &driver,
                            key: idempotency_key.clone(),
                            done: tx,
                        };
                        driver
                            .fast_drive(idempotency_key, fingerprint, timeout_ms, participants, app)
                            .await
                    })
                    .in_current_span(),
                );
                return task.await.map_err(|e| {
                    ApiError::Unknown(format!(
                        "the fast commit driver stopped ({e}); the decision may or may not be recorded: ask again with the same key"
                    ))
                })?;
            }
        };
        let (first_fingerprint, mut done) = waiting;
        if first_fingerprint != fingerprint {
            return Err(ApiError::AlreadyExists(format!(
                "idempotency key {idempotency_key:?} is being used for another transaction with a different request"
            )));
        }
        // The same request is being committed here: its outcome answers.
        let _ = done.wait_for(|d| *d).await;
        Ok(FastOutcome::KeyKnown)
    }

    async fn fast_drive(
        self: &Arc<Self>,
        idempotency_key: String,
        fingerprint: [u8; 32],
        timeout_ms: u64,
        enlisted: Vec<Enlistment>,
        app: Option<String>,
    ) -> Result<FastOutcome, ApiError> {
        let term = self.ctx.current_term();
        let begun_ms = now_ms();
        let deadline_ms = begun_ms.saturating_add(timeout_ms);
        let view = Arc::new(InFlightView {
            participants: enlisted
                .iter()
                .map(|p| (p.participant_id.clone(), p.address.clone()))
                .collect(),
            begun_ms,
            deadline_ms,
            owner: app.clone(),
        });
        let txid = self.hand_out_txid(term, &view).await?;
        self.note_trace(txid);
        // Until its write has a known result, `txid` stays in flight (a
        // decision read answers PENDING); `keep` leaves it there when the
        // result is not known (the write may still be applied in this term;
        // the leader loop drops it once recorded or the term is over).
        let mut keep = false;
        let result = async {
            dtx_failpoint::failpoint!("coordinator_after_begin");
            let participants: Vec<Participant> = enlisted
                .iter()
                .map(|p| Participant {
                    id: p.participant_id.clone(),
                    address: p.address.clone(),
                    payload: p.payload.clone(),
                    acked: false,
                })
                .collect();
            let voters: Vec<&str> = participants.iter().map(|p| p.id.as_str()).collect();
            let wait_ms = match tally::tally(&voters, &[], deadline_ms, begun_ms) {
                Tally::Pending { wait_ms, .. } => wait_ms,
                // A timeout of 0 ms: the deadline has passed already.
                _ => 0,
            };
            let RoundResult {
                outcome,
                voters: decided_voters,
                note,
                read_only,
            } = self
                .prepare_round(txid, term, &participants, deadline_ms, begun_ms, wait_ms)
                .await?;
            dtx_failpoint::failpoint!("coordinator_votes_in_before_decide");
            let cmd = Command::BeginAndDecide {
                txid,
                alloc_term: term,
                idempotency_key,
                fingerprint,
                begun_ms,
                deadline_ms,
                participants: enlisted,
                outcome,
                voters: decided_voters,
                acked: read_only,
                now_ms: now_ms(),
                note,
            };
            // The application it is for becomes the owner (ADR 0016).
            match self.ctx.propose(crate::ctx::on_behalf(app.as_deref(), cmd)).await {
                Ok(CommandOk::BegunDecided {
                    txid,
                    decision,
                    recorded,
                    key_holder,
                }) => {
                    dtx_failpoint::failpoint!("coordinator_decided_before_delivery");
                    if recorded {
                        metrics::counter!("dtx_one_write_commits_total", "outcome" => decision.outcome.to_string())
                            .increment(1);
                        info!(txid, outcome = %decision.outcome, "decision recorded with the transaction (one write)");
                    }
                    self.spawn_delivery(txid);
                    Ok(match key_holder {
                        Some(_) => FastOutcome::KeyKnown,
                        None => FastOutcome::Done(BegunAndDecided {
                            txid,
                            existing: false,
                            decision,
                        }),
                    })
                }
                Ok(other) => Err(ApiError::Internal(format!("unexpected state-machine result {other:?}"))),
                Err(e @ ApiError::Unknown(_)) => {
                    keep = true;
                    Err(ApiError::Unknown(format!(
                        "commit of {txid}: {e}; ask again with the same idempotency key"
                    )))
                }
                Err(e @ (ApiError::NotLeader { .. } | ApiError::NoLeader(_) | ApiError::Unavailable(_))) => {
                    Err(ApiError::Unknown(format!(
                        "commit of {txid} was interrupted after its prepare round ({e}); ask again with the same idempotency key"
                    )))
                }
                Err(e) => Err(e),
            }
        }
        .await;
        if !keep {
            self.fast.lock().in_flight.remove(&txid);
        }
        result
    }
}
