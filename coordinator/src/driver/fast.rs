//! The fast commit path (ADR 0012): one replicated write between the
//! participants' votes and the client's answer.
//!
//! `BeginAndCommit` with its whole participant set normally costs two Raft
//! writes in series: the record in PREPARING, then the decision. Here the
//! leader hands the transaction a txid from a range it reserved earlier
//! (`ReserveTxids`, one Raft write per `txn.txid_reserve_count`
//! transactions), sends Prepare at once, and after the votes writes the
//! record, its participant set and its decision in one command
//! (`BeginAndDecide`). The second way to freeze the participant set
//! (docs/design.md, transaction life): the decision carries the set that
//! voted, and nothing can enlist into a record that is born decided.
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
//!
//! The ranges, the in-flight txids and the keys in flight are the owner's
//! (`txids::FastBook`, pure, in the driver's `book::Book`): one question hands a
//! BeginAndCommit its txid, registers its key and keeps its trace
//! (`Msg::FastBegin`), and the answer's mark (`owner::FastMark`) takes them
//! back when the drive ends, however it ends. One `ReserveTxids` runs at a
//! time: the owner lets one caller reserve and the others wait for it.

use std::sync::Arc;

use tracing::info;
use tracing::warn;
use tracing::Instrument;

use super::owner::Begun;
use super::owner::FastMark;
use super::owner::Msg;
use super::owner::Reserving;
use super::txids::InFlightView;
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
    /// known result yet (the answer is PENDING); see `txids::FastBook::pending`.
    /// One question for the whole batch, asked before the read of the
    /// table.
    pub async fn fast_in_flight(&self, txids: &[Txid], term: u64) -> Result<Vec<bool>, ApiError> {
        let txids = txids.to_vec();
        self.mailbox
            .ask(|reply| Msg::FastInFlight { txids, term, reply })
            .await
            .ok_or_else(owner_gone)
    }

    /// What Status shows of `txid` while it is in flight here in `term`
    /// (no record yet, Prepares sent); `None` otherwise. Like
    /// [`Self::fast_in_flight`], asked before the read of the table.
    pub async fn fast_in_flight_view(&self, txid: Txid, term: u64) -> Result<Option<Arc<InFlightView>>, ApiError> {
        self.mailbox
            .ask(|reply| Msg::FastView { txid, term, reply })
            .await
            .ok_or_else(owner_gone)
    }

    /// The leader loop's care of the fast path: drops what an older term
    /// left and whatever is recorded now, and reserves the next range
    /// ahead of need, so only the first transaction of a term waits for a
    /// `ReserveTxids`.
    pub(super) async fn fast_housekeeping(self: &Arc<Self>, term: u64) {
        if !self.ctx.config.txn.one_write_commit {
            return;
        }
        let Some((in_flight, low)) = self.mailbox.ask(|reply| Msg::FastHousekeeping { term, reply }).await else {
            return;
        };
        let recorded: Vec<Txid> = {
            let st = self.ctx.sm.state();
            // In memory or retained (ADR 0050); one that cannot be read is
            // kept in flight, asked about again next round.
            in_flight
                .into_iter()
                .filter(|t| st.record(*t).is_ok_and(|r| r.is_some()))
                .collect()
        };
        if !recorded.is_empty() {
            self.mailbox.tell(Msg::FastRecorded { txids: recorded });
        }
        if low && self.ctx.is_leader_of(term) {
            let driver = self.clone();
            tokio::spawn(async move {
                if let Err(e) = driver.reserve_txids(term, true).await {
                    warn!("txids not reserved ahead: {e}");
                }
            });
        }
    }

    /// Reserves a range for `term` (one `ReserveTxids` at a time: another
    /// caller's running, this one waits for it): the current one when there
    /// is none, else the spare that follows it. With `ahead`, only when the
    /// current one runs low and there is no spare; otherwise only when
    /// nothing is left to hand out.
    async fn reserve_txids(&self, term: u64, ahead: bool) -> Result<(), ApiError> {
        let mut mark = match self.mailbox.ask(|reply| Msg::Reserve { term, ahead, reply }).await {
            None => return Err(owner_gone()),
            Some(Reserving::NotNeeded) => return Ok(()),
            Some(Reserving::Wait(done)) => {
                let _ = done.await;
                return Ok(());
            }
            Some(Reserving::Go(mark)) => mark,
        };
        let count = self.ctx.config.txn.txid_reserve_count;
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
        mark.range = Some((first, end));
        Ok(())
    }

    /// Hands out the next txid of `term` for `key` (reserving a range when
    /// none is left), or finds the same key in flight here.
    async fn fast_begin(
        &self,
        key: &str,
        fingerprint: [u8; 32],
        term: u64,
        view: &Arc<InFlightView>,
    ) -> Result<Begun, ApiError> {
        for _ in 0..3 {
            let (key, view, trace) = (key.to_string(), view.clone(), dtx_common::trace::current());
            let begun = self
                .mailbox
                .ask(|reply| Msg::FastBegin {
                    key,
                    fingerprint,
                    term,
                    view,
                    trace,
                    reply,
                })
                .await
                .ok_or_else(owner_gone)?;
            match begun {
                Begun::NoTxid => self.reserve_txids(term, false).await?,
                other => return Ok(other),
            }
        }
        Err(ApiError::Unavailable(
            "no txid range could be reserved for this term".into(),
        ))
    }

    /// BeginAndCommit on the fast path: its answer, or `None` when the
    /// idempotency key belongs to a recorded transaction (or did by the
    /// time the write was applied): the recorded one answers, through the
    /// two-write path, which finds it by its key. The drive runs in its own
    /// task, so a client that goes away does not stop it between the
    /// Prepares and the one write.
    pub(super) async fn fast_begin_and_commit(
        self: &Arc<Self>,
        idempotency_key: String,
        fingerprint: [u8; 32],
        timeout_ms: u64,
        participants: Vec<Enlistment>,
        app: Option<String>,
    ) -> Result<Option<BegunAndDecided>, ApiError> {
        // A key in use (in memory or retained, ADR 0050), or one that cannot
        // be looked up, takes the usual path: the state machine answers.
        if !self
            .ctx
            .sm
            .state()
            .txid_of_key(&idempotency_key)
            .is_ok_and(|t| t.is_none())
        {
            return Ok(None);
        }
        if !self.ctx.is_leader() {
            // Certainly not proposed: the caller's error says where to go
            // (NotLeader with the leader's address, so the call is
            // forwarded like every other).
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
        let term = self.ctx.current_term();
        let begun_ms = now_ms();
        let deadline_ms = begun_ms.saturating_add(timeout_ms);
        let view = Arc::new(InFlightView {
            participants: participants
                .iter()
                .map(|p| (p.participant_id.clone(), p.address.clone()))
                .collect(),
            begun_ms,
            deadline_ms,
            owner: app.clone(),
        });
        // Either this call registers the key with its txid (and drives),
        // or it finds the same key in flight here (and waits for it).
        let mark = match self.fast_begin(&idempotency_key, fingerprint, term, &view).await? {
            Begun::Drive(mark) => mark,
            Begun::Waiting {
                fingerprint: first,
                mut done,
            } => {
                if first != fingerprint {
                    return Err(ApiError::AlreadyExists(format!(
                        "idempotency key {idempotency_key:?} is being used for another transaction with a different request"
                    )));
                }
                // The same request is being committed here: its outcome
                // answers.
                let _ = done.changed().await;
                return Ok(None);
            }
            Begun::NoTxid => unreachable!("fast_begin reserves"),
        };
        tracing::Span::current().record("txid", mark.txid);
        let driver = self.clone();
        let drive = FastDrive {
            key: idempotency_key,
            fingerprint,
            term,
            begun_ms,
            deadline_ms,
            enlisted: participants,
            app,
        };
        // The request's span and trace go with the drive's task.
        let task = tokio::spawn(
            dtx_common::trace::with_current(async move { driver.fast_drive(mark, drive).await }).in_current_span(),
        );
        task.await.map_err(|e| {
            ApiError::Unknown(format!(
                "the fast commit driver stopped ({e}); the decision may or may not be recorded: ask again with the same key"
            ))
        })?
    }

    /// Prepares, then the one write. Until the write has a known result,
    /// the txid stays in flight (a decision read answers PENDING): `mark`
    /// keeps it there when the result is not known (the write may still
    /// be applied in this term; the leader loop drops it once recorded or
    /// the term is over). `None`, as for `fast_begin_and_commit`: another
    /// call holds the key, and its record answers.
    async fn fast_drive(
        self: &Arc<Self>,
        mut mark: FastMark,
        drive: FastDrive,
    ) -> Result<Option<BegunAndDecided>, ApiError> {
        let FastDrive {
            key,
            fingerprint,
            term,
            begun_ms,
            deadline_ms,
            enlisted,
            app,
        } = drive;
        let txid = mark.txid;
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
            .prepare_round(txid, term, (&participants, &[]), deadline_ms, begun_ms, wait_ms)
            .await?;
        super::debug_assert_commit_voters(txid, outcome, &decided_voters, &participants);
        dtx_failpoint::failpoint!("coordinator_votes_in_before_decide");
        let cmd = Command::BeginAndDecide {
            txid,
            alloc_term: term,
            idempotency_key: key,
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
        // From here until the result is known, the write may be applied.
        mark.keep = true;
        // The application it is for becomes the owner (ADR 0016).
        let result = self.ctx.propose(crate::ctx::on_behalf(app.as_deref(), cmd)).await;
        mark.keep = matches!(result, Err(ApiError::Unknown(_)));
        match result {
            Ok(CommandOk::BegunDecided {
                txid,
                decision,
                recorded,
                key_holder,
            }) => {
                dtx_failpoint::failpoint!("coordinator_decided_before_delivery");
                self.saw_decision(txid, decision.outcome);
                if recorded {
                    metrics::counter!("dtx_one_write_commits_total", "outcome" => decision.outcome.to_string())
                        .increment(1);
                    info!(txid, outcome = %decision.outcome, "decision recorded with the transaction (one write)");
                }
                self.spawn_delivery(txid);
                Ok(match key_holder {
                    Some(_) => None,
                    None => Some(BegunAndDecided {
                        txid,
                        existing: false,
                        decision,
                    }),
                })
            }
            Ok(other) => Err(ApiError::Internal(format!("unexpected state-machine result {other:?}"))),
            Err(e @ ApiError::Unknown(_)) => Err(ApiError::Unknown(format!(
                "commit of {txid}: {e}; ask again with the same idempotency key"
            ))),
            Err(e @ (ApiError::NotLeader { .. } | ApiError::NoLeader(_) | ApiError::Unavailable(_))) => {
                Err(ApiError::Unknown(format!(
                    "commit of {txid} was interrupted after its prepare round ({e}); ask again with the same idempotency key"
                )))
            }
            Err(e) => Err(e),
        }
    }
}

/// What a fast drive needs besides its mark.
struct FastDrive {
    key: String,
    fingerprint: [u8; 32],
    term: u64,
    begun_ms: u64,
    deadline_ms: u64,
    enlisted: Vec<Enlistment>,
    app: Option<String>,
}

fn owner_gone() -> ApiError {
    ApiError::Internal("the driver's owner task stopped".into())
}
