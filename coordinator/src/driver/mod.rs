//! The leader's two-phase-commit driver.
//!
//! Commit: freeze the participant set (RequestCommit) -> send Prepare to
//! every participant in parallel, bounded by `txn.prepare_timeout_ms` and the
//! transaction's deadline -> record the decision through Raft (COMMIT only
//! with a YES or READ_ONLY from every enlisted participant, invariant 2) ->
//! answer the caller -> deliver the decision in the background. Whether a
//! round may start and what its votes decide is the pure `sm::tally`.
//!
//! The API's handlers call the driver for everything that drives a
//! transaction (commit, BeginAndCommit, a client's abort, an operator's
//! resolve); the driver stands on `ctx` and imports nothing of the API.
//!
//! Ordering rule: a decision is applied in Raft BEFORE any Commit or Abort
//! is sent to a participant: delivery reads the decision from the applied
//! table only.
//!
//! Prepares to one participant address travel together in PrepareMany
//! messages (`prepare_group`): sent at once when none is in flight to it,
//! queued and sent together while one is.
//!
//! Delivery retries with exponential backoff and jitter until the
//! participant acks (each attempt one item of an ApplyDecisions message
//! shared with the other deliveries to that address, `phase_two`), then
//! records the Ack through Raft: acks wait up to
//! `txn.ack_batch_wait_ms` and go in one Raft entry together, so they do not
//! cost the next client write a Raft round of its own. It stops as soon as
//! this node is no longer the leader of the term it started in (invariant
//! 9: every message carries that term; a deposed leader stops sending), or
//! the participant's ack is recorded, or the transaction is forgotten. The
//! leader's loop restarts delivery for every decided, unacked transaction
//! and re-drives every PREPARING one, which is how a new leader resumes.
//!
//! Fairness (invariant 11): the loop scans from a cursor and skips
//! transactions that already have a task here, so any number stuck for good
//! at low txids never starves the others; deliveries to one participant
//! share its health record (`health`): while it fails, one call at a time
//! probes it with backoff, and its failure is logged once per participant.
//! READ_ONLY voters get no phase two: their acks go into the decision's own
//! Raft entry.
//!
//! One owner (ADR 0043): the driver's leader-local state (the marks of
//! the tasks running here, the health records and parked deliveries, the
//! attempts Status shows, the ack queue, the grouped messages' queues, the
//! re-drive backoffs and cursors, the trace contexts, the one-write path's
//! txids and keys) is one pure `book::Book`, held by one task
//! (`owner::Owner`) that applies the messages of one channel to it.
//! Questions carry a oneshot for the answer; everything else is a plain
//! send, which never waits. A mark that says "work runs here" is a value
//! whose drop tells the owner the work ended (`owner::TaskMark`,
//! `owner::DeliveryMark`, `owner::FastMark`), so a mark cannot outlive the
//! work. The owner never waits for I/O; this module, `deliver`, `fast`,
//! `phase_two` and `prepare_group` are the async shell that calls
//! participants and Raft, reads the state machine, and asks the owner.
//!
//! Rules checked in debug builds: a decision is written once (the owner
//! asserts that every outcome work here sees for a transaction is the
//! same, and each delivery that the table's decision is the one it
//! delivers), and the voters of a COMMIT are exactly the enlisted
//! participants (invariant 2).
//!
//! Tracing: the work for one transaction runs in a span with its `txid`
//! (the request's span, and `drive`, `deliver` and `redrive` spans for the
//! tasks it spawns), so every log line of it carries the txid. Each call to
//! a participant about one transaction carries that transaction's W3C trace
//! context (`traceparent`, `tracestate`; kept per txid on this leader from
//! the request that drove it, not replicated: after a leader change the new
//! leader's calls start traces of their own) and its txid (`x-dtx-txid`).
//! A grouped message (PrepareMany, ApplyDecisions) carries the context of
//! its first item in its metadata, runs in a span linked to every item's
//! trace, and logs (at debug) each item's txid with its trace id.

mod answer;
mod book;
mod branches;
mod deliver;
mod fast;
mod group;
pub mod health;
mod owner;
mod phase_two;
mod prepare_group;
mod txids;
pub use txids::InFlightView;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

pub use book::Cursors;
pub use book::DeliveryAttempts;
pub use book::ErrorClass;
use dtx_common::trace;
use dtx_common::trace::TraceContext;
use dtx_proto::v1 as pb;
use dtx_tls::logtext::clean;
use dtx_tls::logtext::Clean;
use dtx_tls::logtext::LogSummary;
use rand::Rng;
use tracing::error;
use tracing::info;
use tracing::warn;
use tracing::Instrument;

pub(crate) use self::answer::truncate_utf8;
use self::answer::DeliveryError;
use self::book::AckReply;
use self::book::Work;
use self::owner::Msg;
use self::owner::TaskMark;
use crate::ctx::now_ms;
use crate::ctx::ApiError;
use crate::ctx::NodeCtx;
use crate::sm::tally;
use crate::sm::tally::Tally;
use crate::sm::tally::Vote;
use crate::sm::Command;
use crate::sm::CommandOk;
use crate::sm::Decision;
use crate::sm::DecisionSource;
use crate::sm::Enlistment;
use crate::sm::Outcome;
use crate::sm::Participant;
use crate::sm::TxRecord;
use crate::sm::Txid;

/// The leader's transaction driver: the one owner of prepare rounds,
/// decisions, delivery, acks and re-drives on this node. The API and the
/// leader loop call it; it stands on the node's shared context (Raft, the
/// state machine, the channels) and never the other way round. Its
/// leader-local state is the owner task's (`owner`), reached through
/// `mailbox`.
pub struct Driver {
    pub ctx: Arc<NodeCtx>,
    /// The owner task of the driver's leader-local state.
    mailbox: owner::Mailbox,
    /// "prepare failed, counted as NO" lines, one per participant per
    /// `logtext::SUMMARY_INTERVAL`: a participant that is down fails every
    /// transaction's prepare.
    prepare_failures: Arc<LogSummary>,
    /// "stopped delivering" lines, one per address per
    /// `logtext::SUMMARY_INTERVAL`.
    given_up_log: Arc<LogSummary>,
}

/// How often a participant that keeps failing is reported again.
const PEER_WARN_EVERY: Duration = Duration::from_secs(30);

impl Driver {
    /// The driver, with its owner task started.
    pub fn new(ctx: Arc<NodeCtx>) -> Arc<Driver> {
        let t = &ctx.config.txn;
        let settings = book::Settings {
            retry_base: Duration::from_millis(t.delivery_retry_base_ms),
            retry_max: Duration::from_millis(t.delivery_retry_max_ms),
            inflight_max: t.delivery_inflight_calls_max,
            warn_every: PEER_WARN_EVERY,
            give_up_after: Duration::from_millis(t.never_answered_give_up_ms),
            ack_batch_wait: Duration::from_millis(t.ack_batch_wait_ms),
            txid_reserve_count: t.txid_reserve_count,
        };
        let prepare_failures = Arc::new(LogSummary::default());
        prepare_failures.spawn_flusher(|participant, held| {
            warn!(
                participant,
                held_back = held,
                "{held} more prepares to this participant failed in the last {}s, each counted as NO \
                 (dtx_prepare_failures_total)",
                dtx_tls::logtext::SUMMARY_INTERVAL.as_secs()
            )
        });
        let given_up_log = Arc::new(LogSummary::default());
        given_up_log.spawn_flusher(|address, held| {
            warn!(
                address,
                held_back = held,
                "{held} more transactions stopped calling this never-answering address in the last {}s \
                 (dtx_never_answered_given_up_total)",
                dtx_tls::logtext::SUMMARY_INTERVAL.as_secs()
            )
        });
        Arc::new_cyclic(|me: &std::sync::Weak<Driver>| {
            let me = me.clone();
            let start: owner::Starter = Box::new(move |s| {
                if let Some(driver) = me.upgrade() {
                    driver.start(s);
                }
            });
            let (owner, mailbox) = owner::Owner::new(start, settings);
            tokio::spawn(owner.run());
            Driver {
                ctx,
                mailbox,
                prepare_failures,
                given_up_log,
            }
        })
    }

    /// The delivery attempts this leader has made to each participant of
    /// `keys` (txid, participant id), where a delivery task is running for
    /// it (or a one-phase commit's calls failed); one question for all.
    pub async fn delivery_attempts(&self, keys: Vec<(Txid, String)>) -> Vec<Option<DeliveryAttempts>> {
        let n = keys.len();
        let answer = self.mailbox.ask(|reply| Msg::Attempts { keys, reply }).await;
        answer.unwrap_or_else(|| vec![None; n])
    }

    /// An operator's heuristic decision of the one-phase commit `txid`
    /// was recorded (its participant `participant_id` declared lost): its
    /// attempts stop being shown, and the decision is logged for the
    /// record.
    pub fn declared_lost(&self, txid: Txid, participant_id: &str, d: &Decision) {
        self.mailbox.tell(Msg::ForgetAttempts {
            key: (txid, participant_id.to_string()),
        });
        metrics::counter!("dtx_heuristic_decisions_total", "outcome" => d.outcome.to_string()).increment(1);
        warn!(txid, participant = %Clean(participant_id), outcome = %d.outcome, "heuristic decision recorded: {}", d.note);
    }

    /// Participant addresses that are failing now.
    pub async fn failing_participants(&self) -> usize {
        self.mailbox.ask(|reply| Msg::Failing { reply }).await.unwrap_or(0)
    }

    /// Wakes every parked delivery (the term changed: each looks at its
    /// leadership again).
    pub fn wake_all(&self) {
        self.mailbox.tell(Msg::WakeAll)
    }

    /// Starts, in a task of its own, the I/O the owner asks for.
    fn start(self: Arc<Self>, s: owner::Start) {
        match s {
            owner::Start::Prepares { addr, first, mark } => {
                tokio::spawn(self.send_prepare_groups(addr, first, mark));
            }
            owner::Start::Decisions { addr, mark } => {
                tokio::spawn(self.send_groups(addr, mark));
            }
            owner::Start::Acks(waiting) => {
                tokio::spawn(async move { self.propose_acks(waiting).await });
            }
        }
    }
}

/// The Prepare (or CommitOnePhase) message for `p`, with its deadline.
fn prepare_request(
    txid: Txid,
    incarnation: u64,
    term: u64,
    p: &Participant,
    timeout: Duration,
) -> tonic::Request<pb::PrepareRequest> {
    let mut req = tonic::Request::new(pb::PrepareRequest {
        txid,
        term,
        participant_id: p.id.clone(),
        payload: p.payload.clone(),
        incarnation,
    });
    req.set_timeout(timeout);
    req
}
/// A span for work on `txid` (a child of the current span).
fn txn_span(work: &'static str, txid: Txid) -> tracing::Span {
    tracing::info_span!("txn", work, txid)
}

impl Driver {
    /// Keeps the current trace context (the driving request's) as the
    /// trace of `txid`'s participant calls, and names `txid` in the current
    /// span (a Begin's request span learns its txid here).
    fn note_trace(&self, txid: Txid) {
        tracing::Span::current().record("txid", txid);
        if let Some(ctx) = trace::current() {
            self.mailbox.tell(Msg::NoteTrace { txid, ctx });
        }
    }

    /// The trace context of `txid`'s participant calls: the current one
    /// (the driving request's, which `note_trace` kept), else the one kept
    /// for it here (a re-drive's or a delivery's task has none of its own).
    async fn trace_of(&self, txid: Txid) -> Option<TraceContext> {
        match trace::current() {
            Some(ctx) => Some(ctx),
            None => self.mailbox.ask(|reply| Msg::TraceOf { txid, reply }).await.flatten(),
        }
    }

    /// Puts `txid` and its trace context into the metadata of a call to a
    /// participant about it.
    async fn mark_call<T>(&self, txid: Txid, req: &mut tonic::Request<T>) {
        dtx_proto::attach_txid(req, txid);
        if let Some(ctx) = self.trace_of(txid).await {
            ctx.attach(req.metadata_mut());
        }
    }

    /// Tells the owner what work on `txid` saw as its recorded decision
    /// (checked there: a decision is written once). Debug builds only.
    fn saw_decision(&self, txid: Txid, outcome: Outcome) {
        if cfg!(debug_assertions) {
            self.mailbox.tell(Msg::SawDecision { txid, outcome });
        }
    }

    /// Marks `txid` as having a task of `work` here: the mark, or `None`
    /// if another task has it.
    async fn claim(&self, work: Work, txid: Txid) -> Option<TaskMark> {
        self.mailbox
            .ask(|reply| Msg::Mark { work, txid, reply })
            .await
            .flatten()
    }
}

/// For a grouped message carrying the transactions of `traces` (each with
/// the trace kept for it): its first item's trace context into `req`'s
/// metadata, a link from `span` to every item's trace, and a debug line
/// naming each item's txid and trace id.
fn mark_group_call<T>(span: &tracing::Span, traces: &[(Txid, Option<TraceContext>)], req: &mut tonic::Request<T>) {
    if let Some(first) = traces.first().and_then(|(_, c)| c.as_ref()) {
        first.attach(req.metadata_mut());
        span.record("trace_id", first.trace_id_hex());
    }
    for (_, ctx) in traces {
        if let Some(c) = ctx {
            trace::link(span, c);
        }
    }
    span.in_scope(|| {
        tracing::debug!(
            items = ?traces
                .iter()
                .map(|(t, c)| format!("{t}:{}", c.as_ref().map(|c| c.trace_id_hex()).unwrap_or_default()))
                .collect::<Vec<_>>(),
            "grouped message: txid:trace_id of each item"
        )
    });
}

/// What a decision's note says of a participant whose Prepare brought no
/// usable vote: never the transport's text (ADR 0041).
const FAILED_VOTE_NOTE: &str = "no usable vote (unreachable or failed; the leader's log has the error)";

/// Cuts a decision note to `limits::NOTE_BYTES_MAX` bytes.
fn truncate_note(note: &mut String) {
    truncate_utf8(note, crate::limits::NOTE_BYTES_MAX);
}

impl Driver {
    /// What `p` answered to Prepare (no usable answer counts as NO), within
    /// `timeout`: one item of a PrepareMany message shared with the other
    /// prepares to its address (`prepare_group`), or a Prepare call of its
    /// own for a participant that does not serve PrepareMany.
    async fn prepare_one(self: &Arc<Self>, txid: Txid, term: u64, p: &Participant, timeout: Duration) -> Vote {
        let mut req = prepare_request(txid, self.ctx.incarnation_of(txid), term, p, timeout);
        if let Some(v) = self.prepare_grouped(&p.address, req.get_ref().clone(), timeout).await {
            return v;
        }
        self.mark_call(txid, &mut req).await;
        let ch = match self.ctx.api_channel(&p.address) {
            Ok(c) => c,
            Err(e) => return Vote::Failed(e.to_string()),
        };
        let res = tokio::time::timeout(timeout, self.ctx.participant_over(ch).prepare(req)).await;
        match res {
            Err(_) => Vote::Failed(format!("no vote within {} ms", timeout.as_millis())),
            Ok(Err(s)) => {
                if matches!(DeliveryError::from_status(&s), DeliveryError::Refused { .. }) {
                    self.note_answered(&p.address);
                }
                Vote::Failed(format!("{}: {}", s.code(), s.message()))
            }
            Ok(Ok(r)) => {
                self.note_answered(&p.address);
                let r = r.into_inner();
                answer::vote_of(r.vote, r.reason)
            }
        }
    }

    /// Drives a commit to its decision and returns the recorded decision
    /// (which may be another, earlier one: decisions are write-once).
    pub async fn drive_commit(self: &Arc<Self>, txid: Txid) -> Result<Decision, ApiError> {
        self.note_trace(txid);
        self.drive_detached(txid, None).await
    }

    /// BeginAndCommit: records the begin, the participants and PREPARING in
    /// one command, then drives the transaction to its decision (no
    /// RequestCommit needed). A retry with the same key finds the first
    /// call's transaction: its recorded decision, or, still undecided (the
    /// first call or a re-drive may still be running), a drive again, which
    /// is idempotent.
    pub async fn begin_and_commit(
        self: &Arc<Self>,
        idempotency_key: String,
        fingerprint: [u8; 32],
        timeout_ms: u64,
        participants: Vec<Enlistment>,
        app: Option<&str>,
    ) -> Result<BegunAndDecided, ApiError> {
        if self.fast_path_applies(participants.len()) {
            // One Raft write between the votes and the answer (ADR 0012).
            // A key that is known already is answered below, by its record.
            let answered = self
                .fast_begin_and_commit(
                    idempotency_key.clone(),
                    fingerprint,
                    timeout_ms,
                    participants.clone(),
                    app.map(str::to_string),
                )
                .await?;
            if let Some(done) = answered {
                return Ok(done);
            }
        }
        let cmd = Command::BeginAndCommit {
            fingerprint,
            idempotency_key,
            now_ms: now_ms(),
            timeout_ms,
            participants,
            one_phase_allowed: self.ctx.config.txn.one_phase_commit,
        };
        let (txid, existing, participants, decision, one_phase) =
            match self.ctx.propose(crate::ctx::on_behalf(app, cmd)).await? {
                CommandOk::BegunCommitting {
                    txid,
                    existing,
                    participants,
                    decision,
                    one_phase,
                    ..
                } => (txid, existing, participants, decision, one_phase),
                other => return Err(ApiError::Internal(format!("unexpected state-machine result {other:?}"))),
            };
        // A key that is another application's: its transaction is not
        // this caller's to drive or to be told about.
        self.ctx.check_owner_applied(txid, app)?;
        self.note_trace(txid);
        dtx_failpoint::failpoint!("coordinator_after_begin");
        let decision = match decision {
            Some(d) => {
                self.spawn_delivery(txid);
                d
            }
            None if existing => self.drive_commit(txid).await?,
            None => self.drive_detached(txid, Some((participants, one_phase))).await?,
        };
        Ok(BegunAndDecided {
            txid,
            existing,
            decision,
        })
    }

    /// A client's Abort: records ABORT (write-once: an earlier decision
    /// stands and is returned) and delivers the recorded decision.
    pub async fn abort(self: &Arc<Self>, txid: Txid, reason: String) -> Result<Decision, ApiError> {
        self.note_trace(txid);
        let (d, _) = self
            .decide(txid, Outcome::Abort, Vec::new(), DecisionSource::Client, reason)
            .await?;
        self.spawn_delivery(txid);
        Ok(d)
    }

    /// An operator's Resolve: records `outcome` with `note` (write-once: an
    /// earlier decision stands and is returned, `false`) and delivers the
    /// recorded decision. Invariant 2 binds operators too: a COMMIT needs
    /// the voters the operator names, if any, to be exactly the enlisted
    /// participants, and every participant to hold a durable YES or
    /// READ_ONLY vote when asked; READ_ONLY voters are
    /// acked with the decision.
    pub async fn resolve(
        self: &Arc<Self>,
        txid: Txid,
        outcome: Outcome,
        named_voters: &[String],
        note: String,
    ) -> Result<(Decision, bool), ApiError> {
        self.note_trace(txid);
        let mut note = note;
        let (voters, read_only) = match outcome {
            Outcome::Abort => (Vec::new(), Vec::new()),
            Outcome::Commit => {
                // The leader asks each participant (a read-only Inquire) and
                // refuses otherwise, naming who and why. Voters an operator
                // names must be exactly the enlisted participants.
                // A linearizable read: on a follower (whose table may lag
                // behind an Enlist the leader applied) this is "not the
                // leader", and the call is forwarded, never judged on a
                // stale record.
                let record = self
                    .ctx
                    .read_linearizable(|st| st.record(txid).map(|r| r.map(std::borrow::Cow::into_owned)))
                    .await??;
                let enlisted: Option<Vec<String>> = record
                    .as_ref()
                    .filter(|r| r.decision().is_none())
                    .map(|r| r.participants.iter().map(|p| p.id.clone()).collect());
                if let Some(enlisted) = enlisted.filter(|_| !named_voters.is_empty()) {
                    let named: BTreeSet<&str> = named_voters.iter().map(String::as_str).collect();
                    let set: BTreeSet<&str> = enlisted.iter().map(String::as_str).collect();
                    if named != set || named.len() != named_voters.len() {
                        return Err(ApiError::FailedPrecondition(format!(
                            "COMMIT of transaction {} refused: voters {:?} differ from enlisted participants {:?}",
                            txid, named_voters, enlisted
                        )));
                    }
                }
                let confirmed = self.confirm_votes(txid, record).await?;
                note = format!("{note} ({})", confirmed.note);
                (confirmed.all, confirmed.read_only)
            }
        };
        truncate_note(&mut note);
        let (d, recorded) = self
            .decide_with_acks(txid, outcome, voters, DecisionSource::Operator, note, &read_only)
            .await?;
        self.spawn_delivery(txid);
        Ok((d, recorded))
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
        let driver = self.clone();
        let task = tokio::spawn(
            trace::with_current(async move {
                // If a re-drive already holds the mark, this drive runs
                // alongside it (every step is idempotent) and leaves the
                // mark to its owner.
                let _mark = driver.claim(Work::Driving, txid).await;
                match known {
                    Some((participants, one_phase)) => driver.drive_preparing(txid, participants, one_phase).await,
                    None => driver.drive_commit_inner(txid).await,
                }
            })
            .instrument(txn_span("drive", txid)),
        );
        // A drive that panicked or was cancelled may have recorded a
        // decision before it stopped: its outcome is not known.
        task.await.map_err(|e| {
            ApiError::Unknown(format!(
                "the driver of {txid} stopped ({e}); the decision may or may not be recorded: ask again"
            ))
        })?
    }

    async fn drive_commit_inner(self: &Arc<Self>, txid: Txid) -> Result<Decision, ApiError> {
        // Every participant registered its vote as a branch: one write.
        if let Some(d) = self.commit_registered(txid).await? {
            return Ok(d);
        }
        let request = if self.ctx.config.txn.one_phase_commit {
            Command::RequestCommitOnePhase { txid }
        } else {
            Command::RequestCommit { txid }
        };
        let (participants, one_phase) = match self.ctx.propose(request).await? {
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
        let term = self.ctx.current_term();
        let timeout = Duration::from_millis(self.ctx.config.txn.prepare_timeout_ms);
        dtx_failpoint::failpoint!("coordinator_before_prepare");
        let ch = self.ctx.api_channel(&p.address)?;
        let mut req = prepare_request(txid, self.ctx.incarnation_of(txid), term, p, timeout);
        self.mark_call(txid, &mut req).await;
        let answer = tokio::time::timeout(timeout, self.ctx.participant_over(ch).commit_one_phase(req)).await;
        let (outcome, note) = match answer {
            Ok(Ok(r)) => {
                self.note_answered(&p.address);
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
                // Shown by `txn show`: what keeps the
                // transaction PREPARING; the application's Status and this
                // answer say only its class (ADR 0041).
                let error = format!("{}: {}", s.code(), s.message());
                let class = match DeliveryError::from_status(&s) {
                    DeliveryError::Refused { .. } => {
                        self.note_answered(&p.address);
                        ErrorClass::Refused
                    }
                    DeliveryError::NoAnswer(_) => ErrorClass::Unreachable,
                };
                self.note_one_phase_failure(txid, p, class, error);
                return Err(ApiError::Unknown(format!(
                    "one-phase commit of {txid}: participant {} did not commit it ({}); only it can decide, the leader will ask again",
                    Clean(&p.id),
                    class.as_str(),
                )));
            }
            Err(_) => {
                let error = format!("no answer within {} ms", timeout.as_millis());
                self.note_one_phase_failure(txid, p, ErrorClass::Unreachable, error);
                return Err(ApiError::Unknown(format!(
                    "one-phase commit of {txid}: no answer from participant {} within {} ms; only it can decide, the leader will ask again",
                    p.id,
                    timeout.as_millis()
                )));
            }
        };
        dtx_failpoint::failpoint!("coordinator_votes_in_before_decide");
        let (d, recorded) = self
            .decide(txid, outcome, vec![p.id.clone()], DecisionSource::Driver, note)
            .await?;
        self.mailbox.tell(Msg::ForgetAttempts {
            key: (txid, p.id.clone()),
        });
        if d.source == DecisionSource::OperatorHeuristic && d.outcome != outcome {
            // The participant answered after all, after an operator had
            // declared it lost: the decision stands (write-once), and the
            // participant did the other thing. Someone must reconcile it.
            metrics::counter!("dtx_heuristic_contradictions_total").increment(1);
            error!(
                txid,
                participant = %Clean(&p.id),
                "heuristic decision contradicted: an operator recorded {} after declaring {} lost, and it has now \
                 answered {outcome}; reconcile its data by hand ({})",
                d.outcome,
                p.id,
                d.note
            );
        }
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
        let term = self.ctx.current_term();
        let deadline_ms = self.ctx.sm.state().table.get(txid).map(|r| r.deadline_ms).unwrap_or(0);
        let voters: Vec<&str> = participants.iter().map(|p| p.id.as_str()).collect();
        let round_started_ms = now_ms();
        // The tally of no votes yet: past the deadline no new prepare round
        // starts, the transaction aborts (invariant 7).
        let wait_ms = match tally::tally(&voters, &[], deadline_ms, round_started_ms) {
            Tally::Abort { reason, .. } => {
                let mut note = tally::abort_note(&voters, &[], &reason);
                truncate_utf8(&mut note, crate::limits::REASON_BYTES_MAX);
                let (d, _) = self
                    .decide(txid, Outcome::Abort, Vec::new(), DecisionSource::Driver, note)
                    .await?;
                self.spawn_delivery(txid);
                return Ok(d);
            }
            Tally::Pending { wait_ms, .. } => wait_ms,
            // No voters: nothing to ask.
            Tally::Commit { .. } => 0,
        };
        // Branches that registered their votes get no Prepare (ADR 0046).
        // The set is frozen (PREPARING), so no registration comes after
        // this read.
        let registered = branches::registered_votes(&self.ctx.sm.state().table, txid, &participants);
        let RoundResult {
            outcome,
            voters: decided_voters,
            note,
            read_only,
        } = self
            .prepare_round(
                txid,
                term,
                (&participants, &registered),
                deadline_ms,
                round_started_ms,
                wait_ms,
            )
            .await?;
        debug_assert_commit_voters(txid, outcome, &decided_voters, &participants);
        // READ_ONLY voters need no phase two, whatever the decision: their
        // acks go into the decision's own Raft entry, so delivery never
        // sees them pending.
        dtx_failpoint::failpoint!("coordinator_votes_in_before_decide");
        let (d, recorded) = self
            .decide_with_acks(txid, outcome, decided_voters, DecisionSource::Driver, note, &read_only)
            .await?;
        dtx_failpoint::failpoint!("coordinator_decided_before_delivery");
        if recorded {
            info!(txid, outcome = %d.outcome, "decision recorded");
        }
        self.spawn_delivery(txid);
        Ok(d)
    }

    /// One prepare round: Prepare to every participant in parallel, each
    /// bounded by `wait_ms` (the time left to the deadline) and
    /// `txn.prepare_timeout_ms`, then the tally as of `round_started_ms`.
    /// Shared by the two-write path and the one-write path (`fast.rs`); the
    /// crash points `coordinator_before_prepare` and
    /// `coordinator_mid_prepare` fire here.
    async fn prepare_round(
        self: &Arc<Self>,
        txid: Txid,
        term: u64,
        (participants, known): (&[Participant], &[(String, Vote)]),
        deadline_ms: u64,
        round_started_ms: u64,
        wait_ms: u64,
    ) -> Result<RoundResult, ApiError> {
        let voters: Vec<&str> = participants.iter().map(|p| p.id.as_str()).collect();
        // Those with a known vote (a branch's registration) are not asked.
        let asked: Vec<&Participant> = participants
            .iter()
            .filter(|p| !known.iter().any(|(id, _)| *id == p.id))
            .collect();
        let timeout = Duration::from_millis(wait_ms.min(self.ctx.config.txn.prepare_timeout_ms).max(1));
        dtx_failpoint::failpoint!("coordinator_before_prepare");
        let votes = futures::future::join_all(asked.iter().enumerate().map(|(i, p)| async move {
            let v = self.prepare_one(txid, term, p, timeout).await;
            if i == 0 {
                dtx_failpoint::failpoint!("coordinator_mid_prepare");
            }
            v
        }))
        .await;
        for (p, v) in asked.iter().zip(&votes) {
            if let Vote::Failed(why) = v {
                metrics::counter!("dtx_prepare_failures_total", "participant" => crate::metrics::participant_label(&p.id))
                    .increment(1);
                let participant = clean(&p.id);
                match self.prepare_failures.note(&participant) {
                    None => {}
                    Some(0) => warn!(txid, participant = %participant, "prepare failed, counted as NO: {}", Clean(why)),
                    Some(held) => warn!(
                        txid,
                        participant = %participant,
                        held_back = held,
                        "prepare failed, counted as NO: {} ({held} more such failures were not logged)",
                        Clean(why)
                    ),
                }
            }
        }
        // The decision's note is replicated and shown by the application's
        // Status: a failed vote says no more than that (ADR 0041);
        // its error is in the line above (and `dtx_prepare_failures_total`).
        let votes: Vec<(&str, Vote)> = asked
            .iter()
            .map(|p| p.id.as_str())
            .zip(votes)
            .map(|(id, v)| match v {
                Vote::Failed(_) => (id, Vote::Failed(FAILED_VOTE_NOTE.to_string())),
                v => (id, v),
            })
            .chain(known.iter().map(|(id, v)| (id.as_str(), v.clone())))
            .collect();
        // Every voter has its vote now. Each wait above ended by the
        // deadline, so a vote not in by then is already a failure (counted
        // as NO): the tally is taken as of the round's start, when the
        // deadline was checked.
        match tally::tally(&voters, &votes, deadline_ms, round_started_ms) {
            Tally::Commit {
                voters,
                read_only_voters,
            } => Ok(RoundResult {
                outcome: Outcome::Commit,
                voters,
                note: String::new(),
                read_only: read_only_voters,
            }),
            Tally::Abort {
                reason,
                read_only_voters,
            } => {
                let mut note = tally::abort_note(&voters, &votes, &reason);
                truncate_utf8(&mut note, crate::limits::REASON_BYTES_MAX);
                Ok(RoundResult {
                    outcome: Outcome::Abort,
                    voters: Vec::new(),
                    note,
                    read_only: read_only_voters,
                })
            }
            Tally::Pending { waiting_for, .. } => Err(ApiError::Internal(format!(
                "prepare round of {txid} ended without the votes of {waiting_for:?}"
            ))),
        }
    }

    /// Records a decision through Raft (write-once) and returns the recorded
    /// one, which may be an earlier, different decision.
    async fn decide(
        &self,
        txid: Txid,
        outcome: Outcome,
        voters: Vec<String>,
        source: DecisionSource,
        note: String,
    ) -> Result<(Decision, bool), ApiError> {
        self.decide_with_acks(txid, outcome, voters, source, note, &[]).await
    }

    /// Records a decision (write-once) and, in the same Raft entry, the acks
    /// of `acked`: participants that need no phase two (READ_ONLY voters,
    /// who have nothing to do for either outcome). Returns the recorded
    /// decision, which may be an earlier, different one.
    async fn decide_with_acks(
        &self,
        txid: Txid,
        outcome: Outcome,
        voters: Vec<String>,
        source: DecisionSource,
        note: String,
        acked: &[String],
    ) -> Result<(Decision, bool), ApiError> {
        let mut cmds = vec![Command::Decide {
            txid,
            outcome,
            voters,
            source,
            term: self.ctx.current_term(),
            now_ms: now_ms(),
            note,
        }];
        cmds.extend(acked.iter().map(|id| Command::Ack {
            txid,
            participant_id: id.clone(),
        }));
        let mut results = self.ctx.propose_together(cmds).await?.into_iter();
        let decided = results
            .next()
            .unwrap_or_else(|| Err(ApiError::Internal("the state machine returned no result".into())))?;
        for (r, id) in results.zip(acked) {
            if let Err(e) = r {
                warn!(txid, participant = %Clean(id), "ack recorded with the decision refused: {e}");
            }
        }
        match decided {
            CommandOk::Decided { decision, recorded } => {
                self.saw_decision(txid, decision.outcome);
                Ok((decision, recorded))
            }
            other => Err(ApiError::Internal(format!("unexpected state-machine result {other:?}"))),
        }
    }

    /// Asks every participant of `txid` what its durable log holds (the
    /// read-only `Inquire` call), for an operator's COMMIT: it is allowed
    /// only when each one holds a YES (or READ_ONLY) vote (invariant 2 binds
    /// operators too). Returns the participants and the READ_ONLY ones, or
    /// a refusal that names every participant whose vote is not a known
    /// YES, and why.
    async fn confirm_votes(self: &Arc<Self>, txid: Txid, record: Option<TxRecord>) -> Result<ConfirmedVotes, ApiError> {
        let record = record
            .ok_or_else(|| ApiError::NotFound(format!("transaction {txid} not found (never begun, or forgotten)")))?;
        if let Some(d) = record.decision() {
            // Write-once: the caller reads the recorded decision back.
            return Ok(ConfirmedVotes {
                all: record.participants.iter().map(|p| p.id.clone()).collect(),
                read_only: Vec::new(),
                note: format!("already decided {}", d.outcome),
            });
        }
        let timeout = Duration::from_millis(self.ctx.config.txn.prepare_timeout_ms);
        let answers = futures::future::join_all(record.participants.iter().map(|p| async move {
            let res = async {
                let ch = self.ctx.api_channel(&p.address).map_err(|e| e.to_string())?;
                let mut req = tonic::Request::new(pb::InquireRequest {
                    txid,
                    participant_id: p.id.clone(),
                    incarnation: self.ctx.incarnation_of(txid),
                });
                req.set_timeout(timeout);
                self.mark_call(txid, &mut req).await;
                match tokio::time::timeout(timeout, self.ctx.participant_over(ch).inquire(req)).await {
                    Err(_) => Err(format!("no answer within {} ms", timeout.as_millis())),
                    Ok(Err(s)) => Err(format!("{}: {}", s.code(), s.message())),
                    Ok(Ok(r)) => {
                        self.note_answered(&p.address);
                        Ok(pb::LocalRecord::try_from(r.into_inner().record).unwrap_or_default())
                    }
                }
            }
            .await;
            (p.id.clone(), res)
        }))
        .await;
        let mut refusals = Vec::new();
        let mut seen = Vec::new();
        let mut read_only = Vec::new();
        for (id, res) in &answers {
            match res {
                Ok(pb::LocalRecord::PreparedYes) => seen.push(format!("{id}=YES")),
                Ok(pb::LocalRecord::PreparedReadOnly) => {
                    seen.push(format!("{id}=READ_ONLY"));
                    read_only.push(id.clone());
                }
                Ok(other) => refusals.push(format!("{id} holds no YES vote (its log says {})", other.as_str_name())),
                Err(e) => refusals.push(format!("{id} could not be asked for its vote ({e})")),
            }
        }
        if !refusals.is_empty() {
            let mut why = format!(
                "operator COMMIT of transaction {txid} refused: every participant must hold a durable YES vote                  (invariant 2): {}; resolve it with ABORT, or bring the participants back and retry",
                refusals.join("; ")
            );
            truncate_utf8(&mut why, crate::limits::REASON_BYTES_MAX);
            return Err(ApiError::FailedPrecondition(why));
        }
        Ok(ConfirmedVotes {
            all: record.participants.iter().map(|p| p.id.clone()).collect(),
            read_only,
            note: format!("votes confirmed by inquiry: {}", seen.join(", ")),
        })
    }

    /// Records through Raft that `participant_id` applied the decision of
    /// `txid`. The ack waits up to `txn.ack_batch_wait_ms` for others and
    /// they are proposed together; the result is this ack's own.
    async fn record_ack(&self, txid: Txid, participant_id: String) -> Result<(), ApiError> {
        let cmd = Command::Ack { txid, participant_id };
        self.mailbox
            .ask(|reply| Msg::Ack { cmd, reply })
            .await
            .unwrap_or_else(|| {
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
        let b = &self.ctx.config.batch;
        let per_entry = b.entries_max.min(b.bytes_max / ACK_BYTES_MAX).max(1);
        let mut waiting = waiting.into_iter();
        let chunks: Vec<Vec<(Command, AckReply)>> = std::iter::from_fn(|| {
            let chunk: Vec<_> = waiting.by_ref().take(per_entry).collect();
            (!chunk.is_empty()).then_some(chunk)
        })
        .collect();
        futures::future::join_all(chunks.into_iter().map(|chunk| async move {
            let (cmds, replies): (Vec<Command>, Vec<AckReply>) = chunk.into_iter().unzip();
            match self.ctx.propose_together(cmds).await {
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

    /// Re-drives a PREPARING transaction (after a leader change, or a caller
    /// that went away) unless one is already running here. A re-drive that
    /// ends without a decision (a one-phase participant that does not
    /// answer) backs off before the next, and a one-phase commit whose
    /// address never answered stops being re-sent after
    /// `txn.never_answered_give_up_ms` (ADR 0041; `health::gives_up`): the
    /// transaction stays PREPARING, shown to operators, and is re-driven
    /// again once the address answers any call.
    pub fn spawn_redrive(self: &Arc<Self>, txid: Txid) {
        let driver = self.clone();
        tokio::spawn(
            async move {
                let Some(_mark) = driver.claim(Work::Driving, txid).await else {
                    return;
                };
                driver.redrive(txid).await;
            }
            .instrument(txn_span("redrive", txid)),
        );
    }

    async fn redrive(self: &Arc<Self>, txid: Txid) {
        // Already PREPARING with a frozen set: no RequestCommit write.
        let known = self
            .ctx
            .sm
            .state()
            .table
            .get(txid)
            .and_then(|r| (r.phase == crate::sm::Phase::Preparing).then(|| (r.participants.clone(), r.one_phase)));
        let only = known
            .as_ref()
            .and_then(|(participants, one_phase)| one_phase.then(|| participants.first().cloned()).flatten());
        let res = match known {
            Some((participants, one_phase)) => self.drive_preparing(txid, participants, one_phase).await,
            None => self.drive_commit_inner(txid).await,
        };
        let one_phase = only.as_ref().map(|p| (p.address.clone(), p.id.clone()));
        let failed = res.is_err();
        let u = rand::rng().random_range(0.0..=1.0);
        let report = self
            .mailbox
            .ask(|reply| Msg::RedriveEnded {
                txid,
                failed,
                one_phase,
                u,
                reply,
            })
            .await
            .unwrap_or_default();
        if let (true, Some(p)) = (report.gave_up, &only) {
            self.log_given_up(txid, p, health::Retried::OnePhaseCommit);
        }
        if let (Err(e), Some(failures)) = (res, report.failures) {
            if failures.is_power_of_two() {
                warn!(txid, failures, "re-drive of a PREPARING transaction not finished: {e}");
            }
        }
    }

    /// One round of the leader's background work, at `now_ms` in `term`
    /// (called by the node's leader loop every `txn.reaper_interval_ms`
    /// while it leads):
    /// - phase two for every decided, unacked transaction and a re-drive of
    ///   every PREPARING one without a task here (this is how a new leader
    ///   resumes the old one's work);
    /// - the deadline reaper: `Decide(ABORT)` with source `REAPER` for
    ///   undecided transactions past their deadline (invariant 7; the state
    ///   machine checks the deadline again, and a decision recorded first
    ///   stays);
    /// - `Forget` for decided, fully acked ones past `txn.retention_ms`
    ///   (invariant 10).
    ///
    /// The reaper's and the forget lists are cut to `txn.reaper_batch_max`.
    pub async fn background_round(self: &Arc<Self>, term: u64, now_ms: u64) {
        self.fast_housekeeping(term).await;
        let retention = self.ctx.config.txn.retention_ms;
        let max = self.ctx.config.txn.reaper_batch_max;
        let (expired, forgettable) = {
            let st = self.ctx.sm.state();
            (
                st.table.expired(now_ms, max),
                // In memory or retained (ADR 0050); a read that fails is
                // said and the next round tries again.
                st.forgettable(now_ms.saturating_sub(retention), max)
                    .unwrap_or_else(|e| {
                        tracing::warn!("the forget loop could not read the retained records: {e}");
                        Vec::new()
                    }),
            )
        };
        // Phase two for every decided, unacked transaction, and a re-drive
        // of every PREPARING one: this is also how a new leader resumes the
        // work of the old one. Every one without a task here gets one, at
        // once (not `max` per round: a new leader would then walk through
        // every stuck transaction before reaching live ones); a stuck one
        // keeps its parked task and is skipped after that, so stuck ones
        // never starve the rest (invariant 11). Calls to each participant
        // are limited by txn.delivery_inflight_calls_max.
        let (undelivered, preparing) = self.pick_background_work().await;
        for txid in undelivered {
            self.spawn_delivery(txid);
        }
        for txid in preparing {
            self.spawn_redrive(txid);
        }
        let mut cmds: Vec<Command> = expired
            .into_iter()
            .map(|txid| Command::Decide {
                txid,
                outcome: Outcome::Abort,
                voters: Vec::new(),
                source: DecisionSource::Reaper,
                term,
                now_ms,
                note: "deadline passed without a decision".into(),
            })
            .collect();
        cmds.extend(forgettable.into_iter().map(|txid| Command::Forget { txid }));
        if cmds.is_empty() {
            return;
        }
        let results = futures::future::join_all(cmds.into_iter().map(|c| self.ctx.propose(c))).await;
        for r in results {
            match r {
                Ok(CommandOk::Decided { recorded: true, .. }) => {
                    metrics::counter!("dtx_reaper_aborts_total").increment(1);
                }
                Ok(CommandOk::Forgotten) => metrics::counter!("dtx_forgotten_total").increment(1),
                Ok(_) => {}
                Err(e) => warn!("leader loop proposal not applied: {e}"),
            }
        }
    }

    /// The leader loop's background work for one round: every decided,
    /// unacked transaction to deliver and every PREPARING one to re-drive,
    /// among those with no task here (and no re-drive backing off), so even
    /// a new leader's first round reaches every transaction, whatever
    /// number is stuck. A stuck transaction keeps its task (parked, at no
    /// cost) and is then skipped, so stuck ones never starve the others
    /// (invariant 11). Each scan starts after the last txid it took and
    /// wraps around, so the order tasks start in rotates between rounds.
    async fn pick_background_work(&self) -> (Vec<Txid>, Vec<Txid>) {
        let (mut undelivered, mut preparing) = {
            let st = self.ctx.sm.state();
            (
                st.table.undelivered_after(0).collect::<Vec<_>>(),
                st.table.preparing_after(0).collect::<Vec<_>>(),
            )
        };
        // Ascending (txid 0, if any, comes last from a scan after 0).
        undelivered.sort_unstable();
        preparing.sort_unstable();
        self.mailbox
            .ask(|reply| Msg::Pick {
                undelivered,
                preparing,
                reply,
            })
            .await
            .unwrap_or_default()
    }

    /// `addr` answered a call (any answer of the participant protocol,
    /// refusals included): it is never given up from now on.
    fn note_answered(&self, addr: &str) {
        self.mailbox.tell(Msg::Answered { addr: addr.to_string() });
    }

    /// A one-phase commit's call to `p` failed: shown by `txn show`, and
    /// the clock of the give-up rule.
    fn note_one_phase_failure(&self, txid: Txid, p: &Participant, class: ErrorClass, error: String) {
        self.mailbox.tell(Msg::NoteAttempt {
            key: (txid, p.id.clone()),
            error: Some((class, error)),
            next_in: None,
        });
    }
}

/// Invariant 2: the voters a COMMIT names are exactly the enlisted
/// participants (each once).
fn debug_assert_commit_voters(txid: Txid, outcome: Outcome, voters: &[String], participants: &[Participant]) {
    if outcome == Outcome::Commit {
        debug_assert!(
            voters.len() == participants.len()
                && voters.iter().map(String::as_str).collect::<BTreeSet<_>>()
                    == participants.iter().map(|p| p.id.as_str()).collect::<BTreeSet<_>>(),
            "the voters {voters:?} of the COMMIT of {txid} are not its enlisted participants"
        );
    }
}

/// What a prepare round decided: the outcome, the voters a COMMIT names
/// (empty for ABORT), the note and the READ_ONLY voters (acked with the
/// decision, whatever it is).
struct RoundResult {
    outcome: Outcome,
    voters: Vec<String>,
    note: String,
    read_only: Vec<String>,
}

/// What `Driver::begin_and_commit` recorded.
#[derive(Debug, Clone)]
pub struct BegunAndDecided {
    pub txid: Txid,
    /// The idempotency key found a transaction begun before.
    pub existing: bool,
    /// The recorded decision.
    pub decision: Decision,
}

/// What an operator's COMMIT learned from asking every participant.
#[derive(Debug, Clone)]
struct ConfirmedVotes {
    /// Every enlisted participant (the voter set of the COMMIT).
    pub all: Vec<String>,
    /// Those that voted READ_ONLY (acked with the decision).
    pub read_only: Vec<String>,
    /// What was found, for the decision's note.
    pub note: String,
}
