//! The leader's two-phase-commit driver.
//!
//! Commit: freeze the participant set (RequestCommit) -> send Prepare to
//! every participant in parallel, bounded by `txn.prepare_timeout_ms` and the
//! transaction's deadline -> record the decision through Raft (COMMIT only
//! with a YES or READ_ONLY from every enlisted participant, invariant 2) ->
//! answer the caller -> deliver the decision in the background.
//!
//! Ordering rule: a decision is applied in Raft BEFORE any Commit or Abort
//! is sent to a participant: delivery reads the decision from the applied
//! table only.
//!
//! Delivery retries with exponential backoff and jitter until the
//! participant acks, then records the Ack through Raft: acks wait up to
//! `txn.ack_batch_wait_ms` and go in one Raft entry together, so they do not
//! cost the next client write a Raft round of its own. It stops as soon as
//! this node is no longer the leader of the term it started in (invariant
//! 9: every message carries that term; a deposed leader stops sending). The
//! leader's loop restarts delivery for every decided, unacked transaction
//! and re-drives every PREPARING one, which is how a new leader resumes.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use dtx_proto::v1 as pb;
use dtx_proto::v1::participant_service_client::ParticipantServiceClient;
use rand::Rng;
use tracing::info;
use tracing::warn;

use crate::api::error::ApiError;
use crate::node::now_ms;
use crate::node::NodeCtx;
use crate::sm::Command;
use crate::sm::CommandOk;
use crate::sm::Decision;
use crate::sm::DecisionSource;
use crate::sm::Outcome;
use crate::sm::Participant;
use crate::sm::Txid;

/// Transactions with a task running on this node.
#[derive(Default)]
pub struct DriverState {
    delivering: Mutex<HashSet<Txid>>,
    /// Acks waiting to go through Raft together.
    acks: Mutex<AckQueue>,
    /// Being driven (by a client's Commit or a re-drive): the leader loop
    /// does not start a second prepare round for them.
    driving: Mutex<HashSet<Txid>>,
}

type AckReply = tokio::sync::oneshot::Sender<Result<(), ApiError>>;

#[derive(Default)]
struct AckQueue {
    waiting: Vec<(Command, AckReply)>,
    /// A task will take `waiting` after `txn.ack_batch_wait_ms`.
    flush_scheduled: bool,
}

/// Which of the driver's "task running here" sets a mark is in.
#[derive(Clone, Copy)]
enum Work {
    Driving,
    Delivering,
}

impl DriverState {
    fn set(&self, work: Work) -> &Mutex<HashSet<Txid>> {
        match work {
            Work::Driving => &self.driving,
            Work::Delivering => &self.delivering,
        }
    }
}

/// Marks a transaction as having a task of one kind on this node until
/// dropped: the mark cannot outlive the work, whether it finishes, fails,
/// panics or is cancelled (a mark left behind would stop the leader loop
/// from ever starting that work again; found by the jepsen harness with a
/// one-phase commit).
struct TaskMark {
    ctx: Arc<NodeCtx>,
    work: Work,
    txid: Txid,
}

impl TaskMark {
    /// Sets the mark, or `None` if a task of this kind already holds it.
    fn try_new(ctx: &Arc<NodeCtx>, work: Work, txid: Txid) -> Option<TaskMark> {
        if !ctx.driver.set(work).lock().expect("lock").insert(txid) {
            return None;
        }
        Some(TaskMark {
            ctx: ctx.clone(),
            work,
            txid,
        })
    }
}

impl Drop for TaskMark {
    fn drop(&mut self) {
        if let Ok(mut d) = self.ctx.driver.set(self.work).lock() {
            d.remove(&self.txid);
        }
    }
}

/// Cuts `s` to at most `max` bytes on a character boundary.
fn truncate_utf8(s: &mut String, max: usize) {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
}

/// What one participant answered to Prepare.
#[derive(Debug, Clone, PartialEq, Eq)]
enum VoteResult {
    Yes,
    ReadOnly,
    No(String),
    /// Unreachable, timed out or malformed: counts as NO.
    Failed(String),
}

impl NodeCtx {
    fn is_leader_of(&self, term: u64) -> bool {
        let rx = self.raft.metrics();
        let m = rx.borrow();
        m.current_leader == Some(self.id) && m.current_term == term
    }

    async fn prepare_one(&self, txid: Txid, term: u64, p: &Participant, timeout: Duration) -> VoteResult {
        let ch = match self.api_channel(&p.address) {
            Ok(c) => c,
            Err(e) => return VoteResult::Failed(e.to_string()),
        };
        let mut req = tonic::Request::new(pb::PrepareRequest {
            txid,
            term,
            participant_id: p.id.clone(),
            payload: p.payload.clone(),
        });
        req.set_timeout(timeout);
        let res = tokio::time::timeout(timeout, ParticipantServiceClient::new(ch).prepare(req)).await;
        match res {
            Err(_) => VoteResult::Failed(format!("no vote within {} ms", timeout.as_millis())),
            Ok(Err(s)) => VoteResult::Failed(format!("{}: {}", s.code(), s.message())),
            Ok(Ok(r)) => {
                let r = r.into_inner();
                match pb::Vote::try_from(r.vote) {
                    Ok(pb::Vote::Yes) => VoteResult::Yes,
                    Ok(pb::Vote::ReadOnly) => VoteResult::ReadOnly,
                    Ok(pb::Vote::No) => VoteResult::No(r.reason),
                    _ => VoteResult::Failed(format!("malformed vote value {}", r.vote)),
                }
            }
        }
    }

    /// Drives a commit to its decision and returns the recorded decision
    /// (which may be another, earlier one: decisions are write-once).
    pub async fn drive_commit(self: &Arc<Self>, txid: Txid) -> Result<Decision, ApiError> {
        self.drive_detached(txid, None).await
    }

    /// Drives a transaction that BeginAndCommit has just recorded in
    /// PREPARING with `participants` (no RequestCommit needed).
    pub async fn drive_begun(
        self: &Arc<Self>,
        txid: Txid,
        participants: Vec<Participant>,
        one_phase: bool,
    ) -> Result<Decision, ApiError> {
        self.drive_detached(txid, Some((participants, one_phase))).await
    }

    /// Runs the drive in its own task, so a caller that goes away (its RPC
    /// cancelled on a client timeout) does not stop it halfway: the decision
    /// is still recorded now rather than at the next re-drive. The txid is
    /// marked as being driven for exactly as long as the task runs (a guard
    /// clears the mark however the task ends), so the leader loop re-drives
    /// it if it stops without a decision.
    async fn drive_detached(
        self: &Arc<Self>,
        txid: Txid,
        known: Option<(Vec<Participant>, bool)>,
    ) -> Result<Decision, ApiError> {
        // If a re-drive already holds the mark, this drive runs alongside it
        // (every step is idempotent) and leaves the mark to its owner.
        let guard = TaskMark::try_new(self, Work::Driving, txid);
        let ctx = self.clone();
        let task = tokio::spawn(async move {
            let _guard = guard;
            match known {
                Some((participants, one_phase)) => ctx.drive_preparing(txid, participants, one_phase).await,
                None => ctx.drive_commit_inner(txid).await,
            }
        });
        task.await
            .map_err(|e| ApiError::Internal(format!("the driver of {txid} stopped: {e}")))?
    }

    async fn drive_commit_inner(self: &Arc<Self>, txid: Txid) -> Result<Decision, ApiError> {
        let request = if self.config.txn.one_phase_commit {
            Command::RequestCommitOnePhase { txid }
        } else {
            Command::RequestCommit { txid }
        };
        let (participants, one_phase) = match self.propose(request).await? {
            CommandOk::CommitRequested { decision: Some(d), .. } => {
                self.spawn_delivery(txid);
                return Ok(d);
            }
            CommandOk::CommitRequested {
                participants,
                one_phase,
                ..
            } => (participants, one_phase),
            other => return Err(ApiError::Internal(format!("unexpected result {other:?}"))),
        };
        self.drive_preparing(txid, participants, one_phase).await
    }

    async fn drive_preparing(
        self: &Arc<Self>,
        txid: Txid,
        participants: Vec<Participant>,
        one_phase: bool,
    ) -> Result<Decision, ApiError> {
        // From here on the transaction is PREPARING: whatever goes wrong, the
        // outcome is not known to the caller (a new leader re-drives it).
        let res = match (one_phase, participants.first()) {
            (true, Some(only)) => self.commit_one_phase(txid, only).await,
            _ => self.prepare_and_decide(txid, participants).await,
        };
        res.map_err(|e| match e {
            ApiError::NotLeader { .. } | ApiError::NoLeader(_) | ApiError::Unavailable(_) => {
                ApiError::Unknown(format!(
                    "commit of {txid} was interrupted after it started ({e}); the decision will be recorded by the \
                 leader: ask again"
                ))
            }
            other => other,
        })
    }

    /// One-phase commit: the only participant prepares and commits on one
    /// message, and its answer is recorded as the decision (which also acks
    /// it). No answer is not a NO: it may have committed, so the outcome is
    /// UNKNOWN and the transaction stays PREPARING for the leader to re-send.
    async fn commit_one_phase(self: &Arc<Self>, txid: Txid, p: &Participant) -> Result<Decision, ApiError> {
        let term = self.current_term();
        let timeout = Duration::from_millis(self.config.txn.prepare_timeout_ms);
        participant_sdk::failpoint!("coordinator_before_prepare");
        let ch = self.api_channel(&p.address)?;
        let mut req = tonic::Request::new(pb::PrepareRequest {
            txid,
            term,
            participant_id: p.id.clone(),
            payload: p.payload.clone(),
        });
        req.set_timeout(timeout);
        let answer = tokio::time::timeout(timeout, ParticipantServiceClient::new(ch).commit_one_phase(req)).await;
        let (outcome, note) = match answer {
            Ok(Ok(r)) => {
                let r = r.into_inner();
                if r.committed {
                    (Outcome::Commit, String::new())
                } else {
                    let mut note = format!("{} refused the one-phase commit: {}", p.id, r.reason);
                    truncate_utf8(&mut note, crate::limits::REASON_BYTES_MAX);
                    (Outcome::Abort, note)
                }
            }
            Ok(Err(s)) => {
                return Err(ApiError::Unknown(format!(
                    "one-phase commit of {txid}: participant {} answered {}: {}; only it can decide, the leader will ask again",
                    p.id,
                    s.code(),
                    s.message()
                )))
            }
            Err(_) => {
                return Err(ApiError::Unknown(format!(
                    "one-phase commit of {txid}: no answer from participant {} within {} ms; only it can decide, the leader will ask again",
                    p.id,
                    timeout.as_millis()
                )))
            }
        };
        participant_sdk::failpoint!("coordinator_votes_in_before_decide");
        let (d, recorded) = self
            .decide(txid, outcome, vec![p.id.clone()], DecisionSource::Driver, note)
            .await?;
        if recorded {
            metrics::counter!("dtx_one_phase_commits_total", "outcome" => outcome.to_string()).increment(1);
            info!(txid, outcome = %d.outcome, "one-phase decision recorded");
        }
        Ok(d)
    }

    async fn prepare_and_decide(
        self: &Arc<Self>,
        txid: Txid,
        participants: Vec<Participant>,
    ) -> Result<Decision, ApiError> {
        let term = self.current_term();
        let deadline_ms = self.sm.state().table.get(txid).map(|r| r.deadline_ms).unwrap_or(0);
        if now_ms() >= deadline_ms {
            // Past the deadline: no new prepare round; ABORT (invariant 7).
            let (d, _) = self
                .decide(
                    txid,
                    Outcome::Abort,
                    Vec::new(),
                    DecisionSource::Driver,
                    "deadline passed before the votes were in".into(),
                )
                .await?;
            self.spawn_delivery(txid);
            return Ok(d);
        }
        let left_ms = deadline_ms.saturating_sub(now_ms());
        let timeout = Duration::from_millis(left_ms.min(self.config.txn.prepare_timeout_ms).max(1));
        participant_sdk::failpoint!("coordinator_before_prepare");
        let votes = futures::future::join_all(participants.iter().enumerate().map(|(i, p)| async move {
            let v = self.prepare_one(txid, term, p, timeout).await;
            if i == 0 {
                participant_sdk::failpoint!("coordinator_mid_prepare");
            }
            v
        }))
        .await;
        let mut refusals = Vec::new();
        for (p, v) in participants.iter().zip(&votes) {
            match v {
                VoteResult::Yes | VoteResult::ReadOnly => {}
                VoteResult::No(why) => refusals.push(format!("{} voted NO: {why}", p.id)),
                VoteResult::Failed(why) => {
                    warn!(txid, participant = %p.id, "prepare failed, counted as NO: {why}");
                    refusals.push(format!("{}: {why}", p.id));
                }
            }
        }
        let (outcome, voters, note) = if refusals.is_empty() {
            (
                Outcome::Commit,
                participants.iter().map(|p| p.id.clone()).collect(),
                String::new(),
            )
        } else {
            let mut note = refusals.join("; ");
            truncate_utf8(&mut note, crate::limits::REASON_BYTES_MAX);
            (Outcome::Abort, Vec::new(), note)
        };
        participant_sdk::failpoint!("coordinator_votes_in_before_decide");
        let (d, recorded) = self.decide(txid, outcome, voters, DecisionSource::Driver, note).await?;
        participant_sdk::failpoint!("coordinator_decided_before_delivery");
        if recorded {
            info!(txid, outcome = %d.outcome, "decision recorded");
        }
        // READ_ONLY voters need no phase two: record their acks, off the
        // caller's path. Should delivery reach one before its ack is
        // recorded, the participant answers the decision with an ack anyway.
        if d.outcome == outcome {
            for (p, v) in participants.iter().zip(&votes) {
                if *v == VoteResult::ReadOnly {
                    let ctx = self.clone();
                    let id = p.id.clone();
                    tokio::spawn(async move {
                        if let Err(e) = ctx.record_ack(txid, id.clone()).await {
                            warn!(txid, participant = %id, "READ_ONLY ack not recorded yet (delivery will ack it): {e}");
                        }
                    });
                }
            }
        }
        self.spawn_delivery(txid);
        Ok(d)
    }

    /// Records through Raft that `participant_id` applied the decision of
    /// `txid`. The ack waits up to `txn.ack_batch_wait_ms` for others and
    /// they are proposed together; the result is this ack's own.
    async fn record_ack(self: &Arc<Self>, txid: Txid, participant_id: String) -> Result<(), ApiError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let schedule = {
            let mut q = self.driver.acks.lock().expect("lock");
            q.waiting.push((Command::Ack { txid, participant_id }, tx));
            !std::mem::replace(&mut q.flush_scheduled, true)
        };
        if schedule {
            let ctx = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(ctx.config.txn.ack_batch_wait_ms)).await;
                let waiting = {
                    let mut q = ctx.driver.acks.lock().expect("lock");
                    q.flush_scheduled = false;
                    std::mem::take(&mut q.waiting)
                };
                metrics::histogram!("dtx_ack_batch_acks").record(waiting.len() as f64);
                ctx.propose_acks(waiting).await;
            });
        }
        rx.await.unwrap_or_else(|_| {
            Err(ApiError::Unavailable(
                "the ack batch was dropped before it was proposed".into(),
            ))
        })
    }

    /// Proposes waiting acks, as few Raft entries as `batch.entries_max` and
    /// `batch.bytes_max` allow, and answers each waiter.
    async fn propose_acks(&self, waiting: Vec<(Command, AckReply)>) {
        // Recorded participant ids are at most ID_BYTES_MAX bytes, so every
        // encoded Ack fits ACK_BYTES_MAX: counting acks keeps each entry
        // within bytes_max without encoding them here.
        const ACK_BYTES_MAX: usize = crate::limits::ID_BYTES_MAX + 32;
        let b = &self.config.batch;
        let per_entry = b.entries_max.min(b.bytes_max / ACK_BYTES_MAX).max(1);
        let mut waiting = waiting.into_iter();
        let chunks: Vec<Vec<(Command, AckReply)>> = std::iter::from_fn(|| {
            let chunk: Vec<_> = waiting.by_ref().take(per_entry).collect();
            (!chunk.is_empty()).then_some(chunk)
        })
        .collect();
        futures::future::join_all(chunks.into_iter().map(|chunk| async move {
            let (cmds, replies): (Vec<Command>, Vec<AckReply>) = chunk.into_iter().unzip();
            match self.propose_together(cmds).await {
                Ok(results) => {
                    for (r, reply) in results.into_iter().zip(replies) {
                        let _ = reply.send(r.map(|_| ()));
                    }
                }
                Err(e) => {
                    for reply in replies {
                        let _ = reply.send(Err(e.clone()));
                    }
                }
            }
        }))
        .await;
    }

    /// Starts phase two for `txid` unless it is already running here.
    pub fn spawn_delivery(self: &Arc<Self>, txid: Txid) {
        let Some(guard) = TaskMark::try_new(self, Work::Delivering, txid) else {
            return;
        };
        let ctx = self.clone();
        tokio::spawn(async move {
            let _guard = guard;
            ctx.deliver(txid).await;
        });
    }

    /// Re-drives a PREPARING transaction (after a leader change, or a caller
    /// that went away) unless one is already running here.
    pub fn spawn_redrive(self: &Arc<Self>, txid: Txid) {
        let Some(guard) = TaskMark::try_new(self, Work::Driving, txid) else {
            return;
        };
        let ctx = self.clone();
        tokio::spawn(async move {
            let _guard = guard;
            if let Err(e) = ctx.drive_commit_inner(txid).await {
                warn!(txid, "re-drive of a PREPARING transaction not finished: {e}");
            }
        });
    }

    async fn deliver(self: &Arc<Self>, txid: Txid) {
        let term = self.current_term();
        let (decision, pending) = {
            let st = self.sm.state();
            let Some(r) = st.table.get(txid) else { return };
            let Some(d) = r.decision() else { return };
            let pending: Vec<Participant> = r.participants.iter().filter(|p| !p.acked).cloned().collect();
            (d.outcome, pending)
        };
        futures::future::join_all(pending.iter().map(|p| self.deliver_one(txid, term, decision, p))).await;
    }

    async fn deliver_one(self: &Arc<Self>, txid: Txid, term: u64, outcome: Outcome, p: &Participant) {
        let base = self.config.txn.delivery_retry_base_ms;
        let max = self.config.txn.delivery_retry_max_ms;
        let mut attempt: u32 = 0;
        loop {
            if !self.is_leader_of(term) {
                return; // The new leader delivers (invariant 9).
            }
            match self.send_decision(txid, term, outcome, p).await {
                Ok(()) => match self.record_ack(txid, p.id.clone()).await {
                    Ok(_) => {
                        metrics::counter!("dtx_deliveries_total", "outcome" => outcome.to_string()).increment(1);
                        participant_sdk::failpoint!("coordinator_mid_delivery");
                        return;
                    }
                    Err(e) => warn!(txid, participant = %p.id, "ack not recorded yet: {e}"),
                },
                Err(e) => {
                    if attempt.is_multiple_of(10) {
                        warn!(txid, participant = %p.id, attempt, "{outcome} not delivered yet: {e}");
                    }
                    metrics::counter!("dtx_delivery_failures_total").increment(1);
                }
            }
            let exp = base.saturating_mul(1u64 << attempt.min(20)).min(max);
            let wait = rand::rng().random_range(exp / 2..=exp.max(1));
            tokio::time::sleep(Duration::from_millis(wait)).await;
            attempt = attempt.saturating_add(1);
        }
    }

    async fn send_decision(&self, txid: Txid, term: u64, outcome: Outcome, p: &Participant) -> Result<(), String> {
        let ch = self.api_channel(&p.address).map_err(|e| e.to_string())?;
        let mut client = ParticipantServiceClient::new(ch);
        let body = pb::ParticipantDecisionRequest {
            txid,
            term,
            participant_id: p.id.clone(),
        };
        let timeout = Duration::from_millis(self.config.txn.prepare_timeout_ms);
        let mut req = tonic::Request::new(body);
        req.set_timeout(timeout);
        let call = async {
            match outcome {
                Outcome::Commit => client.commit(req).await,
                Outcome::Abort => client.abort(req).await,
            }
        };
        match tokio::time::timeout(timeout, call).await {
            Err(_) => Err("timed out".into()),
            Ok(Err(s)) => {
                // A refusal for an older term is fencing at work (a newer
                // leader talked to it); anything else is a protocol error.
                if s.code() == tonic::Code::FailedPrecondition && !s.message().contains("older than term") {
                    metrics::counter!("dtx_participant_protocol_errors_total").increment(1);
                    warn!(txid, participant = %p.id, "participant refused {outcome}: {}", s.message());
                }
                Err(format!("{}: {}", s.code(), s.message()))
            }
            Ok(Ok(r)) if r.get_ref().applied => Ok(()),
            Ok(Ok(_)) => Err("participant answered applied = false".into()),
        }
    }
}
