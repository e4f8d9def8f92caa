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

mod fast;
pub use fast::InFlightView;
mod group;
pub mod health;
mod phase_two;
mod prepare_group;

use std::collections::BTreeSet;
use std::collections::HashMap;
use std::collections::HashSet;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use dtx_client::trace;
use dtx_client::trace::TraceContext;
use dtx_proto::metadata::RefusalKind;
use dtx_proto::tls::logtext::clean;
use dtx_proto::tls::logtext::Clean;
use dtx_proto::tls::logtext::LogSummary;
use dtx_proto::v1 as pb;
use rand::Rng;
use tracing::error;
use tracing::info;
use tracing::warn;
use tracing::Instrument;

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
/// state machine, the channels) and never the other way round.
pub struct Driver {
    pub ctx: Arc<NodeCtx>,
    state: DriverState,
    /// The one-write commit path's txid ranges and in-flight txids.
    fast: fast::FastState,
    /// "prepare failed, counted as NO" lines, one per participant per
    /// `logtext::SUMMARY_INTERVAL` (issue 39): a participant that is down
    /// fails every transaction's prepare.
    prepare_failures: Arc<LogSummary>,
    /// "stopped delivering" lines (issue 39, item 7), one per address per
    /// `logtext::SUMMARY_INTERVAL`.
    given_up_log: Arc<LogSummary>,
}

impl Driver {
    pub fn new(ctx: Arc<NodeCtx>) -> Arc<Driver> {
        let t = &ctx.config.txn;
        let state = DriverState::new(
            Duration::from_millis(t.delivery_retry_base_ms),
            Duration::from_millis(t.delivery_retry_max_ms),
            t.delivery_inflight_calls_max,
        );
        let prepare_failures = Arc::new(LogSummary::default());
        prepare_failures.spawn_flusher(|participant, held| {
            warn!(
                participant,
                held_back = held,
                "{held} more prepares to this participant failed in the last {}s, each counted as NO \
                 (dtx_prepare_failures_total)",
                dtx_proto::tls::logtext::SUMMARY_INTERVAL.as_secs()
            )
        });
        let given_up_log = Arc::new(LogSummary::default());
        given_up_log.spawn_flusher(|address, held| {
            warn!(
                address,
                held_back = held,
                "{held} more transactions stopped calling this never-answering address in the last {}s \
                 (dtx_never_answered_given_up_total)",
                dtx_proto::tls::logtext::SUMMARY_INTERVAL.as_secs()
            )
        });
        Arc::new(Driver {
            ctx,
            state,
            fast: fast::FastState::default(),
            prepare_failures,
            given_up_log,
        })
    }

    /// The delivery attempts to `participant_id` in `txid` this leader has
    /// made, if a delivery task is running for it.
    pub fn delivery_attempts(&self, txid: Txid, participant_id: &str) -> Option<DeliveryAttempts> {
        self.state.delivery_attempts(txid, participant_id)
    }

    /// An operator's heuristic decision of the one-phase commit `txid`
    /// was recorded (its participant `participant_id` declared lost): its
    /// attempts stop being shown, and the decision is logged for the
    /// record.
    pub fn declared_lost(&self, txid: Txid, participant_id: &str, d: &Decision) {
        self.state.forget_attempts(txid, participant_id);
        metrics::counter!("dtx_heuristic_decisions_total", "outcome" => d.outcome.to_string()).increment(1);
        warn!(txid, participant = %Clean(participant_id), outcome = %d.outcome, "heuristic decision recorded: {}", d.note);
    }

    /// Participant addresses that are failing now.
    pub fn failing_participants(&self) -> usize {
        self.state.failing_participants()
    }

    /// Wakes every parked delivery (the term changed: each looks at its
    /// leadership again).
    pub fn wake_all(&self) {
        self.state.wake_all()
    }
}

/// The driver's leader-local state: which transactions have a task
/// running on this node, and what deliveries and re-drives have seen.
struct DriverState {
    delivering: Mutex<HashSet<Txid>>,
    /// Acks waiting to go through Raft together.
    acks: Mutex<AckQueue>,
    /// Being driven (by a client's Commit or a re-drive): the leader loop
    /// does not start a second prepare round for them.
    driving: Mutex<HashSet<Txid>>,
    /// Every participant address deliveries go to, and how it is doing.
    peers: Mutex<health::Peers>,
    /// Per address: wakes deliveries parked on it.
    wakers: Mutex<HashMap<String, Arc<tokio::sync::Notify>>>,
    /// Per (txid, participant id): the delivery attempts so far (for Status).
    attempts: Mutex<HashMap<(Txid, String), DeliveryAttempts>>,
    /// Per address: the decisions waiting for the next ApplyDecisions
    /// message (`phase_two`).
    groups: phase_two::Groups,
    /// Per address: the prepares waiting for the next PrepareMany message
    /// (`prepare_group`).
    prepare_groups: prepare_group::PrepareGroups,
    /// PREPARING transactions whose re-drive ended without a decision: not
    /// re-driven again before their backoff has passed.
    redrive_backoff: Mutex<HashMap<Txid, Backoff>>,
    /// Where the leader loop's scans go on from (invariant 11).
    cursors: Mutex<Cursors>,
    /// Per transaction driven here: the trace context of the request that
    /// drove it, carried on its calls to participants (not replicated).
    traces: Mutex<HashMap<Txid, TraceContext>>,
    /// Addresses that answered a call from this process (issue 39, item 7).
    answered: Mutex<Answered>,
    /// One-phase commits no longer re-sent: their participant's address
    /// never answered within `txn.never_answered_give_up_ms` (per txid,
    /// the address and the participant id). Re-driven again once the
    /// address answers anything.
    one_phase_given_up: Mutex<HashMap<Txid, (String, String)>>,
    retry_base: Duration,
    retry_max: Duration,
}

/// What the answering leader knows of one participant's phase two in one
/// transaction (not replicated; shown by Status).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeliveryAttempts {
    pub attempts: u32,
    /// The last error in full: for operators only (ListTransactions, `admin
    /// txn show`, the console), never the application's Status.
    pub last_error: String,
    /// The last error's class: what the application's Status shows.
    pub last_error_class: Option<ErrorClass>,
    /// When the next attempt is due, ms since the Unix epoch (0: none).
    pub next_unix_ms: u64,
    /// When this leader first saw a call for it fail (one-phase commits:
    /// the clock of the give-up rule, `health::gives_up`).
    pub first_failed: Option<tokio::time::Instant>,
    /// This leader stopped calling the address for this transaction (it
    /// never answered; issue 39, item 7), ms since the Unix epoch (0: not).
    pub given_up_unix_ms: u64,
}

/// What the application's Status says of a participant's last delivery
/// error (issue 39, item 7): a class, never the transport's text, which
/// would tell a refused connection from a TLS failure at an address the
/// application chose. Operators see the text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorClass {
    /// No answer: no connection, a handshake or transport failure, a
    /// timeout, or the participant failing as a whole.
    Unreachable,
    /// The participant answered and refused the message.
    Refused,
    /// Anything else (on the cluster's side, e.g. an ack not recorded yet).
    Error,
}

impl ErrorClass {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::Unreachable => "unreachable",
            ErrorClass::Refused => "refused",
            ErrorClass::Error => "error",
        }
    }
}

/// Participant addresses that answered a call of this node process (issue
/// 39, item 7): the give-up rule spares them. Bounded: when full, every
/// address counts as answered (nothing more is given up).
#[derive(Debug, Default)]
struct Answered {
    set: HashSet<String>,
    full: bool,
}

/// How many answering addresses a node remembers (a deployment has far
/// fewer participants; `participants.allowed_addresses` bounds them).
const ANSWERED_ADDRESSES_MAX: usize = 65_536;

#[derive(Clone, Copy, Debug)]
struct Backoff {
    failures: u32,
    not_before: tokio::time::Instant,
}

/// The txid each background scan took last.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cursors {
    pub undelivered: Txid,
    pub preparing: Txid,
}

/// How often a participant that keeps failing is reported again.
const PEER_WARN_EVERY: Duration = Duration::from_secs(30);

/// The longest a parked delivery sleeps before it looks at its leadership
/// and its record again (it is normally woken sooner: by a freed slot, a
/// free probe turn, the participant answering again, or a new term).
const PARKED_MAX: Duration = Duration::from_secs(10);

impl DriverState {
    /// `inflight_max`: calls in flight to one participant address at most.
    fn new(retry_base: Duration, retry_max: Duration, inflight_max: u32) -> Self {
        DriverState {
            delivering: Mutex::default(),
            acks: Mutex::default(),
            driving: Mutex::default(),
            peers: Mutex::new(health::Peers::new(retry_base, retry_max, PEER_WARN_EVERY, inflight_max)),
            wakers: Mutex::default(),
            attempts: Mutex::default(),
            groups: phase_two::Groups::default(),
            prepare_groups: prepare_group::PrepareGroups::default(),
            redrive_backoff: Mutex::default(),
            cursors: Mutex::default(),
            traces: Mutex::default(),
            answered: Mutex::default(),
            one_phase_given_up: Mutex::default(),
            retry_base,
            retry_max,
        }
    }

    /// The attempts to `participant_id` in `txid` stop being shown (the
    /// work ended). Never panics: it also runs in `Drop`.
    fn forget_attempts(&self, txid: Txid, participant_id: &str) {
        if let Ok(mut m) = self.attempts.lock() {
            m.remove(&(txid, participant_id.to_string()));
        }
    }

    fn delivery_attempts(&self, txid: Txid, participant_id: &str) -> Option<DeliveryAttempts> {
        self.attempts
            .lock()
            .expect("lock")
            .get(&(txid, participant_id.to_string()))
            .cloned()
    }

    fn failing_participants(&self) -> usize {
        self.peers.lock().expect("lock").failing()
    }

    /// `addr` answered a call (any answer of the participant protocol,
    /// refusals included): it is never given up from now on, and
    /// deliveries given up on it go on.
    fn note_answered(&self, addr: &str) {
        let first = {
            let mut a = self.answered.lock().expect("lock");
            if a.full || a.set.contains(addr) {
                false
            } else if a.set.len() >= ANSWERED_ADDRESSES_MAX {
                a.full = true;
                warn!(
                    "{ANSWERED_ADDRESSES_MAX} participant addresses have answered this node: from now on none is \
                     given up (txn.never_answered_give_up_ms no longer applies until a restart)"
                );
                true
            } else {
                a.set.insert(addr.to_string());
                true
            }
        };
        if first {
            self.wake(addr, health::Wake::All);
        }
    }

    /// `addr` answered a call from this process once, at least.
    fn answered_once(&self, addr: &str) -> bool {
        let a = self.answered.lock().expect("lock");
        a.full || a.set.contains(addr)
    }

    /// The notifier of deliveries parked on `addr`.
    fn waker(&self, addr: &str) -> Arc<tokio::sync::Notify> {
        self.wakers
            .lock()
            .expect("lock")
            .entry(addr.to_string())
            .or_default()
            .clone()
    }

    fn wake(&self, addr: &str, wake: health::Wake) {
        match wake {
            health::Wake::Nobody => {}
            health::Wake::One => self.waker(addr).notify_one(),
            health::Wake::All => self.waker(addr).notify_waiters(),
        }
    }

    fn wake_all(&self) {
        for w in self.wakers.lock().expect("lock").values() {
            w.notify_waiters();
        }
    }

    /// The backoff after `failures` failures, with equal jitter.
    fn backoff(&self, failures: u32) -> Duration {
        let u = rand::rng().random_range(0.0..=1.0);
        health::backoff(self.retry_base, self.retry_max, failures.saturating_add(1), u)
    }
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
    driver: Arc<Driver>,
    work: Work,
    txid: Txid,
}

impl TaskMark {
    /// Sets the mark, or `None` if a task of this kind already holds it.
    fn try_new(driver: &Arc<Driver>, work: Work, txid: Txid) -> Option<TaskMark> {
        if !driver.state.set(work).lock().expect("lock").insert(txid) {
            return None;
        }
        Some(TaskMark {
            driver: driver.clone(),
            work,
            txid,
        })
    }
}

impl Drop for TaskMark {
    fn drop(&mut self) {
        if let Ok(mut d) = self.driver.state.set(self.work).lock() {
            d.remove(&self.txid);
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

/// How many transactions' trace contexts a leader keeps (those of
/// transactions no longer in the table are dropped first).
const TRACES_MAX: usize = 65_536;

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
        let Some(ctx) = trace::current() else { return };
        let mut traces = self.state.traces.lock().expect("lock");
        if traces.len() >= TRACES_MAX && !traces.contains_key(&txid) {
            let st = self.ctx.sm.state();
            traces.retain(|t, _| st.table.get(*t).is_some());
            if traces.len() >= TRACES_MAX {
                traces.clear();
            }
        }
        traces.insert(txid, ctx);
    }

    /// The trace context of `txid`'s participant calls: the one kept for it
    /// here, else the current one.
    fn trace_of(&self, txid: Txid) -> Option<TraceContext> {
        let kept = self.state.traces.lock().expect("lock").get(&txid).cloned();
        kept.or_else(trace::current)
    }

    /// Puts `txid` and its trace context into the metadata of a call to a
    /// participant about it.
    fn mark_call<T>(&self, txid: Txid, req: &mut tonic::Request<T>) {
        dtx_proto::attach_txid(req, txid);
        if let Some(ctx) = self.trace_of(txid) {
            ctx.attach(req.metadata_mut());
        }
    }

    /// For a grouped message carrying `txids`: its first item's trace
    /// context into `req`'s metadata, a link from `span` to every item's
    /// trace, and a debug line naming each item's txid and trace id.
    fn mark_group_call<T>(&self, span: &tracing::Span, txids: &[Txid], req: &mut tonic::Request<T>) {
        let traces: Vec<(Txid, Option<TraceContext>)> = {
            let kept = self.state.traces.lock().expect("lock");
            txids.iter().map(|t| (*t, kept.get(t).cloned())).collect()
        };
        if let Some(first) = traces.first().and_then(|(_, c)| c.as_ref()) {
            first.attach(req.metadata_mut());
            span.record("trace_id", first.trace_id_hex());
        }
        for (_, ctx) in &traces {
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

    /// Forgets the trace context of `txid` (its delivery ended here).
    fn forget_trace(&self, txid: Txid) {
        self.state.traces.lock().expect("lock").remove(&txid);
    }
}

/// What a decision's note says of a participant whose Prepare brought no
/// usable vote: never the transport's text (issue 39, item 7).
const FAILED_VOTE_NOTE: &str = "no usable vote (unreachable or failed; the leader's log has the error)";

/// Cuts a decision note to `limits::NOTE_BYTES_MAX` bytes.
fn truncate_note(note: &mut String) {
    truncate_utf8(note, crate::limits::NOTE_BYTES_MAX);
}

/// Cuts `s` to at most `max` bytes on a character boundary.
pub(crate) fn truncate_utf8(s: &mut String, max: usize) {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
}

impl Driver {
    /// What `p` answered to Prepare (no usable answer counts as NO), within
    /// `timeout`: one item of a PrepareMany message shared with the other
    /// prepares to its address (`prepare_group`), or a Prepare call of its
    /// own for a participant that does not serve PrepareMany.
    async fn prepare_one(self: &Arc<Self>, txid: Txid, term: u64, p: &Participant, timeout: Duration) -> Vote {
        let mut req = prepare_request(txid, self.ctx.incarnation_of(txid), term, p, timeout);
        self.mark_call(txid, &mut req);
        if let Some(v) = self.prepare_grouped(&p.address, req.get_ref().clone(), timeout).await {
            return v;
        }
        let ch = match self.ctx.api_channel(&p.address) {
            Ok(c) => c,
            Err(e) => return Vote::Failed(e.to_string()),
        };
        let res = tokio::time::timeout(timeout, self.ctx.participant_over(ch).prepare(req)).await;
        match res {
            Err(_) => Vote::Failed(format!("no vote within {} ms", timeout.as_millis())),
            Ok(Err(s)) => {
                if matches!(DeliveryError::from_status(&s), DeliveryError::Refused { .. }) {
                    self.state.note_answered(&p.address);
                }
                Vote::Failed(format!("{}: {}", s.code(), s.message()))
            }
            Ok(Ok(r)) => {
                self.state.note_answered(&p.address);
                let r = r.into_inner();
                prepare_group::vote_of(r.vote, r.reason)
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
            let fast = self
                .fast_begin_and_commit(
                    idempotency_key.clone(),
                    fingerprint,
                    timeout_ms,
                    participants.clone(),
                    app.map(str::to_string),
                )
                .await?;
            if let fast::FastOutcome::Done(done) = fast {
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
    /// READ_ONLY vote when asked (issue 8, defect 5); READ_ONLY voters are
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
                let record = self.ctx.read_linearizable(|st| st.table.get(txid).cloned()).await?;
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
        // If a re-drive already holds the mark, this drive runs alongside it
        // (every step is idempotent) and leaves the mark to its owner.
        let guard = TaskMark::try_new(self, Work::Driving, txid);
        let driver = self.clone();
        let task = tokio::spawn(
            trace::with_current(async move {
                let _guard = guard;
                match known {
                    Some((participants, one_phase)) => driver.drive_preparing(txid, participants, one_phase).await,
                    None => driver.drive_commit_inner(txid).await,
                }
            })
            .instrument(txn_span("drive", txid)),
        );
        // A drive that panicked or was cancelled may have recorded a
        // decision before it stopped: its outcome is not known (defect 6).
        task.await.map_err(|e| {
            ApiError::Unknown(format!(
                "the driver of {txid} stopped ({e}); the decision may or may not be recorded: ask again"
            ))
        })?
    }

    async fn drive_commit_inner(self: &Arc<Self>, txid: Txid) -> Result<Decision, ApiError> {
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
        self.mark_call(txid, &mut req);
        let answer = tokio::time::timeout(timeout, self.ctx.participant_over(ch).commit_one_phase(req)).await;
        let (outcome, note) = match answer {
            Ok(Ok(r)) => {
                self.state.note_answered(&p.address);
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
                // Shown by `txn show` (issue 39, item 8): what keeps the
                // transaction PREPARING; the application's Status and this
                // answer say only its class (item 7).
                let error = format!("{}: {}", s.code(), s.message());
                let class = match DeliveryError::from_status(&s) {
                    DeliveryError::Refused { .. } => {
                        self.state.note_answered(&p.address);
                        ErrorClass::Refused
                    }
                    DeliveryError::NoAnswer(_) => ErrorClass::Unreachable,
                };
                self.note_attempt(txid, p, Some((class, &error)), None);
                return Err(ApiError::Unknown(format!(
                    "one-phase commit of {txid}: participant {} did not commit it ({}); only it can decide, the leader will ask again",
                    Clean(&p.id),
                    class.as_str(),
                )));
            }
            Err(_) => {
                let error = format!("no answer within {} ms", timeout.as_millis());
                self.note_attempt(txid, p, Some((ErrorClass::Unreachable, &error)), None);
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
        self.state.forget_attempts(txid, &p.id);
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
        let RoundResult {
            outcome,
            voters: decided_voters,
            note,
            read_only,
        } = self
            .prepare_round(txid, term, &participants, deadline_ms, round_started_ms, wait_ms)
            .await?;
        // READ_ONLY voters need no phase two, whatever the decision: their
        // acks go into the decision's own Raft entry, so delivery never
        // sees them pending (defect 4).
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
        participants: &[Participant],
        deadline_ms: u64,
        round_started_ms: u64,
        wait_ms: u64,
    ) -> Result<RoundResult, ApiError> {
        let voters: Vec<&str> = participants.iter().map(|p| p.id.as_str()).collect();
        let timeout = Duration::from_millis(wait_ms.min(self.ctx.config.txn.prepare_timeout_ms).max(1));
        dtx_failpoint::failpoint!("coordinator_before_prepare");
        let votes = futures::future::join_all(participants.iter().enumerate().map(|(i, p)| async move {
            let v = self.prepare_one(txid, term, p, timeout).await;
            if i == 0 {
                dtx_failpoint::failpoint!("coordinator_mid_prepare");
            }
            v
        }))
        .await;
        for (p, v) in participants.iter().zip(&votes) {
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
        // Status: a failed vote says no more than that (issue 39, item 7);
        // its error is in the line above (and `dtx_prepare_failures_total`).
        let votes: Vec<(&str, Vote)> = voters
            .iter()
            .copied()
            .zip(votes)
            .map(|(id, v)| match v {
                Vote::Failed(_) => (id, Vote::Failed(FAILED_VOTE_NOTE.to_string())),
                v => (id, v),
            })
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
            CommandOk::Decided { decision, recorded } => Ok((decision, recorded)),
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
                self.mark_call(txid, &mut req);
                match tokio::time::timeout(timeout, self.ctx.participant_over(ch).inquire(req)).await {
                    Err(_) => Err(format!("no answer within {} ms", timeout.as_millis())),
                    Ok(Err(s)) => Err(format!("{}: {}", s.code(), s.message())),
                    Ok(Ok(r)) => {
                        self.state.note_answered(&p.address);
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
    async fn record_ack(self: &Arc<Self>, txid: Txid, participant_id: String) -> Result<(), ApiError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let schedule = {
            let mut q = self.state.acks.lock().expect("lock");
            q.waiting.push((Command::Ack { txid, participant_id }, tx));
            !std::mem::replace(&mut q.flush_scheduled, true)
        };
        if schedule {
            let driver = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(driver.ctx.config.txn.ack_batch_wait_ms)).await;
                let waiting = {
                    let mut q = driver.state.acks.lock().expect("lock");
                    q.flush_scheduled = false;
                    std::mem::take(&mut q.waiting)
                };
                metrics::histogram!("dtx_ack_batch_acks").record(waiting.len() as f64);
                driver.propose_acks(waiting).await;
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

    /// Starts phase two for `txid` unless it is already running here.
    pub fn spawn_delivery(self: &Arc<Self>, txid: Txid) {
        let Some(guard) = TaskMark::try_new(self, Work::Delivering, txid) else {
            return;
        };
        let driver = self.clone();
        tokio::spawn(
            async move {
                let _guard = guard;
                driver.deliver(txid).await;
                driver.forget_trace(txid);
            }
            .instrument(txn_span("deliver", txid)),
        );
    }

    /// Re-drives a PREPARING transaction (after a leader change, or a caller
    /// that went away) unless one is already running here. A re-drive that
    /// ends without a decision (a one-phase participant that does not
    /// answer) backs off before the next.
    pub fn spawn_redrive(self: &Arc<Self>, txid: Txid) {
        let Some(guard) = TaskMark::try_new(self, Work::Driving, txid) else {
            return;
        };
        let driver = self.clone();
        let span = txn_span("redrive", txid);
        tokio::spawn(
            async move {
                let _guard = guard;
                // Already PREPARING with a frozen set: no RequestCommit write.
                let known = driver.ctx.sm.state().table.get(txid).and_then(|r| {
                    (r.phase == crate::sm::Phase::Preparing).then(|| (r.participants.clone(), r.one_phase))
                });
                let only = known
                    .as_ref()
                    .and_then(|(participants, one_phase)| one_phase.then(|| participants.first().cloned()).flatten());
                let res = match known {
                    Some((participants, one_phase)) => driver.drive_preparing(txid, participants, one_phase).await,
                    None => driver.drive_commit_inner(txid).await,
                };
                if let (Err(_), Some(p)) = (&res, &only) {
                    driver.maybe_give_up_one_phase(txid, p);
                }
                let mut backoff = driver.state.redrive_backoff.lock().expect("lock");
                match res {
                    Ok(_) => {
                        backoff.remove(&txid);
                    }
                    Err(e) => {
                        let failures = backoff.get(&txid).map(|b| b.failures).unwrap_or(0).saturating_add(1);
                        let wait = driver.state.backoff(failures);
                        backoff.insert(
                            txid,
                            Backoff {
                                failures,
                                not_before: tokio::time::Instant::now() + wait,
                            },
                        );
                        if failures.is_power_of_two() {
                            warn!(txid, failures, "re-drive of a PREPARING transaction not finished: {e}");
                        }
                    }
                }
            }
            .instrument(span),
        );
    }

    /// After a re-drive of the one-phase commit `txid` to `p` ended without
    /// an answer: stops re-sending it when the give-up rule says so (issue
    /// 39, item 7; `health::gives_up`): the transaction stays PREPARING,
    /// shown to operators, and is re-driven again once the address answers
    /// any call.
    fn maybe_give_up_one_phase(&self, txid: Txid, p: &Participant) {
        let bound = Duration::from_millis(self.ctx.config.txn.never_answered_give_up_ms);
        let trying_for = self
            .state
            .attempts
            .lock()
            .expect("lock")
            .get(&(txid, p.id.clone()))
            .and_then(|a| a.first_failed)
            .map(|t| t.elapsed())
            .unwrap_or_default();
        let answered_once = self.state.answered_once(&p.address);
        if !health::gives_up(health::Retried::OnePhaseCommit, answered_once, trying_for, bound) {
            return;
        }
        let first = self
            .state
            .one_phase_given_up
            .lock()
            .expect("lock")
            .insert(txid, (p.address.clone(), p.id.clone()))
            .is_none();
        if first {
            self.note_given_up(txid, p, health::Retried::OnePhaseCommit);
        }
    }

    /// The one-phase commit `txid` is not re-driven: given up on an
    /// address that has not answered since (issue 39, item 7).
    fn one_phase_given_up(&self, txid: Txid) -> bool {
        let mut given_up = self.state.one_phase_given_up.lock().expect("lock");
        let Some((addr, pid)) = given_up.get(&txid) else {
            return false;
        };
        if !self.state.answered_once(addr) {
            return true;
        }
        if let Some(a) = self.state.attempts.lock().expect("lock").get_mut(&(txid, pid.clone())) {
            a.given_up_unix_ms = 0;
        }
        given_up.remove(&txid);
        false
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
        self.fast_housekeeping(term);
        let retention = self.ctx.config.txn.retention_ms;
        let max = self.ctx.config.txn.reaper_batch_max;
        let (expired, forgettable) = {
            let st = self.ctx.sm.state();
            (
                st.table.expired(now_ms, max),
                st.table.forgettable(now_ms.saturating_sub(retention), max),
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
        let (undelivered, preparing) = self.pick_background_work();
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
    fn pick_background_work(&self) -> (Vec<Txid>, Vec<Txid>) {
        let now = tokio::time::Instant::now();
        let mut cursors = self.state.cursors.lock().expect("lock");
        let st = self.ctx.sm.state();
        let undelivered: Vec<Txid> = {
            let busy = self.state.delivering.lock().expect("lock");
            st.table
                .undelivered_after(cursors.undelivered)
                .filter(|t| !busy.contains(t))
                .collect()
        };
        let preparing: Vec<Txid> = {
            let busy = self.state.driving.lock().expect("lock");
            let mut backoff = self.state.redrive_backoff.lock().expect("lock");
            // Forget backoffs of transactions no longer PREPARING.
            if backoff.len() > st.table.preparing_count() {
                backoff.retain(|t, _| st.table.get(*t).is_some_and(|r| r.phase == crate::sm::Phase::Preparing));
            }
            {
                let mut given_up = self.state.one_phase_given_up.lock().expect("lock");
                if given_up.len() > st.table.preparing_count() {
                    given_up.retain(|t, _| st.table.get(*t).is_some_and(|r| r.phase == crate::sm::Phase::Preparing));
                }
            }
            st.table
                .preparing_after(cursors.preparing)
                .filter(|t| {
                    !busy.contains(t)
                        && backoff.get(t).is_none_or(|b| b.not_before <= now)
                        && !self.one_phase_given_up(*t)
                })
                .collect()
        };
        if let Some(&t) = undelivered.last() {
            cursors.undelivered = t;
        }
        if let Some(&t) = preparing.last() {
            cursors.preparing = t;
        }
        (undelivered, preparing)
    }

    async fn deliver(self: &Arc<Self>, txid: Txid) {
        let term = self.ctx.current_term();
        let (decision, pending) = {
            let st = self.ctx.sm.state();
            let Some(r) = st.table.get(txid) else { return };
            let Some(d) = r.decision() else { return };
            // Not to a participant an operator dropped (gone for good).
            let pending: Vec<Participant> = r
                .participants
                .iter()
                .filter(|p| st.table.awaiting_ack(txid, &p.id))
                .cloned()
                .collect();
            (d.outcome, pending)
        };
        futures::future::join_all(pending.iter().map(|p| self.deliver_one(txid, term, decision, p))).await;
    }

    /// True while the applied record of `txid` still waits for the ack of
    /// `participant_id` (false once acked, once an operator dropped it, or
    /// once the transaction is forgotten).
    fn awaits_ack(&self, txid: Txid, participant_id: &str) -> bool {
        self.ctx.sm.state().table.awaiting_ack(txid, participant_id)
    }

    fn note_attempt(&self, txid: Txid, p: &Participant, error: Option<(ErrorClass, &str)>, next_in: Option<Duration>) {
        let mut map = self.state.attempts.lock().expect("lock");
        let a = map.entry((txid, p.id.clone())).or_default();
        if let Some((class, e)) = error {
            a.attempts = a.attempts.saturating_add(1);
            a.last_error = e.to_string();
            a.last_error_class = Some(class);
            a.first_failed.get_or_insert_with(tokio::time::Instant::now);
        }
        a.next_unix_ms = next_in
            .map(|d| now_ms().saturating_add(d.as_millis() as u64))
            .unwrap_or(0);
    }

    /// Marks `p`'s calls in `txid` as given up (issue 39, item 7): shown to
    /// operators with the last error, counted, logged once per address
    /// per summary interval.
    fn note_given_up(&self, txid: Txid, p: &Participant, what: health::Retried) {
        let bound_ms = self.ctx.config.txn.never_answered_give_up_ms;
        let doing = match what {
            health::Retried::OnePhaseCommit => "re-sending the one-phase commit",
            _ => "delivering the ABORT",
        };
        {
            let mut map = self.state.attempts.lock().expect("lock");
            let a = map.entry((txid, p.id.clone())).or_default();
            a.given_up_unix_ms = now_ms();
            a.next_unix_ms = 0;
            a.last_error = format!(
                "stopped {doing}: address {} never answered this leader within txn.never_answered_give_up_ms \
                 ({bound_ms} ms), so it is not called again for this transaction unless it answers a call; \
                 drop the participant or resolve the transaction. Last error: {}",
                clean(&p.address),
                a.last_error
            );
            truncate_utf8(&mut a.last_error, crate::limits::REASON_BYTES_MAX);
        }
        let kind = match what {
            health::Retried::OnePhaseCommit => "one_phase_commit",
            _ => "abort_delivery",
        };
        metrics::counter!("dtx_never_answered_given_up_total", "kind" => kind).increment(1);
        let address = clean(&p.address);
        match self.given_up_log.note(&address) {
            None => {}
            Some(held) => warn!(
                txid,
                participant = %Clean(&p.id),
                address = %address,
                held_back = held,
                "stopped {doing}: the address never answered this leader within {bound_ms} ms \
                 (txn.never_answered_give_up_ms); an operator drops the participant or resolves the transaction"
            ),
        }
    }

    async fn deliver_one(self: &Arc<Self>, txid: Txid, term: u64, outcome: Outcome, p: &Participant) {
        /// Whatever ends this task: its attempts stop being shown, and a
        /// probe turn it holds passes on.
        struct Leaving<'a> {
            driver: &'a Driver,
            key: (Txid, String),
            addr: &'a str,
            holder: bool,
        }
        impl Drop for Leaving<'_> {
            fn drop(&mut self) {
                self.driver.state.forget_attempts(self.key.0, &self.key.1);
                if self.holder {
                    let wake = match self.driver.state.peers.lock() {
                        Ok(mut peers) => peers.release(self.addr),
                        Err(_) => health::Wake::Nobody,
                    };
                    self.driver.state.wake(self.addr, wake);
                }
            }
        }
        let mut leaving = Leaving {
            driver: self,
            key: (txid, p.id.clone()),
            addr: &p.address,
            holder: false,
        };
        let waker = self.state.waker(&p.address);
        let mut refusals: u32 = 0;
        // The give-up rule (issue 39, item 7): how long this delivery has
        // been trying, and whether it stopped calling.
        let started = tokio::time::Instant::now();
        let bound = Duration::from_millis(self.ctx.config.txn.never_answered_give_up_ms);
        let retried = match outcome {
            Outcome::Commit => health::Retried::CommitDelivery,
            Outcome::Abort => health::Retried::AbortDelivery,
        };
        let mut given_up = false;
        loop {
            if !self.ctx.is_leader_of(term) {
                return; // The new leader delivers (invariant 9).
            }
            if !self.awaits_ack(txid, &p.id) {
                return; // Acked (e.g. with a READ_ONLY vote), dropped, or forgotten (defect 4).
            }
            // Registered before asking, so a wake-up between the answer
            // and the wait is not lost.
            let parked = waker.notified();
            tokio::pin!(parked);
            parked.as_mut().enable();
            let answered_once = self.state.answered_once(&p.address);
            if health::gives_up(retried, answered_once, started.elapsed(), bound) {
                if !given_up {
                    given_up = true;
                    // The probe turn passes on (to a delivery that still
                    // tries, if any).
                    if std::mem::take(&mut leaving.holder) {
                        let wake = self.state.peers.lock().expect("lock").release(&p.address);
                        self.state.wake(&p.address, wake);
                    }
                    self.note_given_up(txid, p, retried);
                }
                // The task stays, parked, so the leader loop does not start
                // it over; it goes on if the address answers any call.
                tokio::select! {
                    _ = &mut parked => {}
                    _ = tokio::time::sleep(PARKED_MAX) => {}
                }
                continue;
            }
            if given_up {
                // The address answered meanwhile: deliver again.
                given_up = false;
                if let Some(a) = self.state.attempts.lock().expect("lock").get_mut(&(txid, p.id.clone())) {
                    a.given_up_unix_ms = 0;
                }
            }
            let turn =
                self.state
                    .peers
                    .lock()
                    .expect("lock")
                    .turn(&p.address, tokio::time::Instant::now(), leaving.holder);
            let probe = match turn {
                health::Turn::Go { probe } => {
                    leaving.holder = probe;
                    probe
                }
                health::Turn::Hold(wait) => {
                    // This delivery probes the failing participant next.
                    leaving.holder = true;
                    self.note_attempt(txid, p, None, Some(wait));
                    tokio::time::sleep(wait).await;
                    continue;
                }
                health::Turn::Park => {
                    // Another delivery probes it, or the in-flight limit is
                    // reached: wait to be woken, at no cost.
                    leaving.holder = false;
                    self.note_attempt(txid, p, None, None);
                    tokio::select! {
                        _ = &mut parked => {}
                        _ = tokio::time::sleep(PARKED_MAX) => {}
                    }
                    continue;
                }
            };
            let sent = {
                // A call that does not report (its task cancelled) must
                // not keep its slot or the probe turn.
                struct InFlight<'a>(&'a Driver, &'a str, Option<bool>);
                impl Drop for InFlight<'_> {
                    fn drop(&mut self) {
                        if let Some(probe) = self.2 {
                            let wake = match self.0.state.peers.lock() {
                                Ok(mut peers) => peers.abandon(self.1, probe),
                                Err(_) => health::Wake::Nobody,
                            };
                            self.0.state.wake(self.1, wake);
                        }
                    }
                }
                let mut call = InFlight(self, &p.address, Some(probe));
                let sent = self.send_decision_grouped(txid, term, outcome, p).await;
                let seen = match &sent {
                    Err(DeliveryError::NoAnswer(e)) => health::Seen::Failed(e.clone()),
                    _ => {
                        self.state.note_answered(&p.address);
                        health::Seen::Answered
                    }
                };
                let u = rand::rng().random_range(0.0..=1.0);
                let (event, wake) = self.state.peers.lock().expect("lock").report(
                    &p.address,
                    probe,
                    seen,
                    tokio::time::Instant::now(),
                    u,
                );
                call.2 = None;
                self.state.wake(&p.address, wake);
                log_peer_event(&p.id, &p.address, event);
                sent
            };
            match sent {
                Ok(()) => {
                    leaving.holder = false;
                    match self.record_ack(txid, p.id.clone()).await {
                        Ok(_) => {
                            metrics::counter!("dtx_deliveries_total", "outcome" => outcome.to_string()).increment(1);
                            dtx_failpoint::failpoint!("coordinator_mid_delivery");
                            return;
                        }
                        Err(e) => {
                            warn!(txid, participant = %Clean(&p.id), "ack not recorded yet: {e}");
                            let wait = self.state.backoff(0);
                            self.note_attempt(
                                txid,
                                p,
                                Some((ErrorClass::Error, &format!("ack not recorded: {e}"))),
                                Some(wait),
                            );
                            tokio::time::sleep(wait).await;
                        }
                    }
                }
                Err(DeliveryError::NoAnswer(e)) => {
                    // Logged once per participant by its health record; the
                    // next attempt waits for the probe turn or its backoff.
                    metrics::counter!("dtx_delivery_failures_total", "kind" => "no_answer", "participant" => crate::metrics::participant_label(&p.id))
                        .increment(1);
                    self.note_attempt(txid, p, Some((ErrorClass::Unreachable, &e)), None);
                }
                Err(DeliveryError::Refused { message, stale_term }) => {
                    // The participant answered and refused this message:
                    // about this transaction only (others go on).
                    leaving.holder = false;
                    metrics::counter!("dtx_delivery_failures_total", "kind" => "refused", "participant" => crate::metrics::participant_label(&p.id))
                        .increment(1);
                    refusals = refusals.saturating_add(1);
                    if !stale_term {
                        metrics::counter!("dtx_participant_protocol_errors_total").increment(1);
                        if refusals.is_power_of_two() {
                            warn!(txid, participant = %Clean(&p.id), refusals, "participant refused {outcome}: {}", Clean(&message));
                        }
                    }
                    let wait = self.state.backoff(refusals);
                    self.note_attempt(txid, p, Some((ErrorClass::Refused, &message)), Some(wait));
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }

    async fn send_decision(
        &self,
        txid: Txid,
        term: u64,
        outcome: Outcome,
        p: &Participant,
    ) -> Result<(), DeliveryError> {
        let ch = self.ctx.api_channel(&p.address).map_err(|e| DeliveryError::Refused {
            message: format!("bad participant address {:?}: {e}", p.address),
            stale_term: false,
        })?;
        let mut client = self.ctx.participant_over(ch);
        let body = pb::ParticipantDecisionRequest {
            txid,
            term,
            participant_id: p.id.clone(),
            incarnation: self.ctx.incarnation_of(txid),
        };
        let timeout = Duration::from_millis(self.ctx.config.txn.prepare_timeout_ms);
        let mut req = tonic::Request::new(body);
        req.set_timeout(timeout);
        self.mark_call(txid, &mut req);
        let call = async {
            match outcome {
                Outcome::Commit => client.commit(req).await,
                Outcome::Abort => client.abort(req).await,
            }
        };
        match tokio::time::timeout(timeout, call).await {
            Err(_) => Err(DeliveryError::NoAnswer(format!(
                "no answer within {} ms",
                timeout.as_millis()
            ))),
            Ok(Err(s)) => Err(DeliveryError::from_status(&s)),
            Ok(Ok(r)) if r.get_ref().applied => Ok(()),
            Ok(Ok(_)) => Err(DeliveryError::Refused {
                message: "participant answered applied = false".into(),
                stale_term: false,
            }),
        }
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

/// Why one delivery call did not end in an ack.
#[derive(Debug, Clone, PartialEq, Eq)]
enum DeliveryError {
    /// No answer (no connection, a timeout, a transport failure) or the
    /// participant failed as a whole (INTERNAL, e.g. its disk is full):
    /// about the participant, shared by every delivery to it.
    NoAnswer(String),
    /// The participant answered and refused this message: about this
    /// transaction only. `stale_term`: it has seen a newer leader's term
    /// (fencing at work, invariant 9), not a protocol error.
    Refused { message: String, stale_term: bool },
}

impl DeliveryError {
    /// Sorts a participant's error answer by its code, and a refusal by the
    /// kind it carries in its metadata (`x-dtx-refusal`), never by its text.
    fn from_status(s: &tonic::Status) -> DeliveryError {
        use tonic::Code;
        let message = format!("{}: {}", s.code(), s.message());
        match s.code() {
            Code::FailedPrecondition
            | Code::InvalidArgument
            | Code::NotFound
            | Code::AlreadyExists
            | Code::OutOfRange => DeliveryError::Refused {
                stale_term: dtx_proto::metadata::refusal(s) == Some(RefusalKind::StaleTerm),
                message,
            },
            _ => DeliveryError::NoAnswer(message),
        }
    }
}

fn log_peer_event(id: &str, addr: &str, event: Option<health::Event>) {
    match event {
        None => {}
        Some(health::Event::StartedFailing { error, retry_in }) => {
            metrics::counter!("dtx_participant_outages_total").increment(1);
            warn!(
                participant = %Clean(id),
                address = %Clean(addr),
                "participant not answering deliveries ({}); deliveries to it now wait, one probe every {} ms at most",
                Clean(&error),
                retry_in.as_millis()
            );
        }
        Some(health::Event::StillFailing {
            for_,
            failures,
            error,
            retry_in,
        }) => warn!(
            participant = %Clean(id),
            address = %Clean(addr),
            failures,
            "participant still not answering deliveries after {} s ({}); next probe in {} ms",
            for_.as_secs(),
            Clean(&error),
            retry_in.as_millis()
        ),
        Some(health::Event::Recovered { after, failures }) => info!(
            participant = %Clean(id),
            address = %Clean(addr),
            failures,
            "participant answers deliveries again after {} ms",
            after.as_millis()
        ),
    }
}

#[cfg(test)]
mod tests {
    use dtx_proto::metadata::set_refusal;
    use dtx_proto::metadata::RefusalKind;
    use tonic::Code;
    use tonic::Status;

    use super::DeliveryError;

    /// The text the participant SDK puts on a stale-term refusal.
    const STALE_TEXT: &str = "message from term 3 is older than term 4 already seen for this transaction";

    fn status(code: Code, text: &str, kind: Option<RefusalKind>) -> Status {
        let mut s = Status::new(code, text);
        if let Some(k) = kind {
            set_refusal(&mut s, k);
        }
        s
    }

    fn refused(code: Code, text: &str, stale_term: bool) -> DeliveryError {
        DeliveryError::Refused {
            message: format!("{code}: {text}"),
            stale_term,
        }
    }

    /// Invariant 9: a participant that saw a newer leader's term refuses
    /// this leader's message; that is fencing at work, not a protocol
    /// error. The driver knows it by the kind the SDK puts in the metadata
    /// (`x-dtx-refusal`), never by the message text.
    #[test]
    fn inv9_a_stale_term_refusal_is_known_by_its_metadata_not_its_text() {
        let fp = Code::FailedPrecondition;
        assert_eq!(
            DeliveryError::from_status(&status(fp, STALE_TEXT, Some(RefusalKind::StaleTerm))),
            refused(fp, STALE_TEXT, true)
        );
        assert_eq!(
            DeliveryError::from_status(&status(fp, "reworded", Some(RefusalKind::StaleTerm))),
            refused(fp, "reworded", true),
            "the text may change"
        );
        assert_eq!(
            DeliveryError::from_status(&status(fp, STALE_TEXT, None)),
            refused(fp, STALE_TEXT, false),
            "the text alone is not read"
        );
    }

    #[test]
    fn protocol_refusals_are_refused_and_not_stale() {
        for kind in [
            RefusalKind::CommitWithoutPrepare,
            RefusalKind::CommitAfterAbort,
            RefusalKind::AbortAfterCommit,
        ] {
            assert_eq!(
                DeliveryError::from_status(&status(Code::FailedPrecondition, "violation", Some(kind))),
                refused(Code::FailedPrecondition, "violation", false),
                "{kind:?}"
            );
        }
        for code in [
            Code::InvalidArgument,
            Code::NotFound,
            Code::AlreadyExists,
            Code::OutOfRange,
        ] {
            assert_eq!(
                DeliveryError::from_status(&status(code, "no", None)),
                refused(code, "no", false),
                "{code:?}"
            );
        }
    }

    /// An answer about the participant as a whole (down, disk full, an
    /// internal failure) is no refusal of this message, whatever it
    /// carries: it goes to the participant's shared health record.
    #[test]
    fn failures_of_the_participant_are_no_answer() {
        for code in [
            Code::Unavailable,
            Code::ResourceExhausted,
            Code::Internal,
            Code::DeadlineExceeded,
            Code::Unknown,
            Code::Cancelled,
        ] {
            assert_eq!(
                DeliveryError::from_status(&status(code, STALE_TEXT, Some(RefusalKind::StaleTerm))),
                DeliveryError::NoAnswer(format!("{code}: {STALE_TEXT}")),
                "{code:?}"
            );
        }
    }
}
