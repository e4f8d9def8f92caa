//! The leader's saga orchestrator (ADR 0019): drives every
//! RUNNING or COMPENSATING saga, one task per saga, by the pure plan
//! (`sm::saga::plan::next`) and the journal (`sm::saga`). It does the I/O
//! (calls to step services, journal writes through Raft); every rule is
//! the journal's.
//!
//! The order of one step, each line done before the next starts:
//! 1. journal the intent (operation id, and the compensation it would
//!    need);
//! 2. call the step service with the operation id;
//! 3. journal the outcome (OK, FAILED, or UNKNOWN for a timeout, a lost
//!    reply or an error status);
//! 4. an UNKNOWN (or an intent found on resume: this leader did not make
//!    it, so a call may have gone out) is settled by the step's status
//!    query before anything else: applied gives the call's own answer;
//!    not applied gives a new attempt under the same operation id.
//!
//! A compensation first asks whether the forward action happened (the
//! forward operation id's status, asked with a fence: the step service
//! records "never to run" for an operation it does not have, so a late
//! call of it, from a deposed leader or a delayed request, cannot happen
//! after): if it did not, the compensation is journaled NOOP and never
//! called. A forward call whose last attempt found nothing applied is
//! fenced the same way before it counts as FAILED.
//!
//! A write is planned on the journal it read (`seq`); a deposed leader's
//! or a stale plan's write is refused by the state machine, and the task
//! reads again. The task of a saga ends when this node stops leading the
//! term it started in; the next leader starts its own from the journal.
//!
//! Crash points (the `failpoints` feature): `saga_before_forward_call`
//! (intent journaled, nothing called), `saga_after_reply_before_journal`
//! (the step service answered, nothing journaled), `saga_after_pivot` (the
//! pivot's OK journaled), `saga_mid_compensation` (the compensation's
//! intent journaled and the forward action confirmed, the compensation not
//! called).
//!
//! One owner (ADR 0043): the scan ([`Scan`], one task) alone knows which
//! sagas have a task here and which wait for a slot ([`Slots`], pure). It
//! is fed by one channel: a kick (a saga started, an operator resumed
//! one), the end of a saga's task (sent from a drop, so a task that panics
//! still frees its saga and its slot), the end of a forget pass. It never
//! waits for a call or a Raft write itself: those run in tasks it spawns.

use std::collections::HashSet;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

use dtx_proto::v1 as pb;
use dtx_proto::v1::saga_step_service_client::SagaStepServiceClient;
use tokio::sync::mpsc;
use tracing::info;
use tracing::warn;

use crate::ctx::now_ms;
use crate::ctx::ApiError;
use crate::ctx::NodeCtx;
use crate::sm::saga::plan;
use crate::sm::saga::plan::Move;
use crate::sm::saga::plan::RecoveryPolicy;
use crate::sm::saga::CallOutcome;
use crate::sm::saga::Definition;
use crate::sm::saga::JournalEvent;
use crate::sm::saga::Reply;
use crate::sm::saga::SagaCommand;
use crate::sm::saga::SagaId;
use crate::sm::saga::SagaOk;
use crate::sm::saga::SagaRecord;
use crate::sm::saga::StepKind;
use crate::sm::Command;
use crate::sm::CommandOk;

/// What one saga's task keeps between moves.
#[derive(Default)]
struct Task {
    /// The (operation id, attempts) of an intent this task journaled and
    /// has not called yet: only that one may be called without asking.
    fresh: Option<(String, u32)>,
    /// Journal writes refused in a row.
    refusals: u32,
}

/// The longest error a `QueryFailed` journal write carries (bytes).
const QUERY_ERROR_BYTES_MAX: usize = 512;

/// Ended sagas forgotten per scan at most.
const FORGET_PER_SCAN: usize = 256;

pub struct Orchestrator {
    ctx: Arc<NodeCtx>,
    policy: Arc<dyn RecoveryPolicy>,
    /// The scan's inbox.
    inbox: mpsc::UnboundedSender<Msg>,
}

/// What the scan is told.
#[derive(Debug, PartialEq, Eq)]
enum Msg {
    /// Scan now (a saga started, an operator resumed one).
    Kick,
    /// The task of this saga ended, however it ended.
    Ended(SagaId),
    /// The forget pass ended.
    Forgot,
}

/// Sends its message when dropped: whatever ends the work that holds it
/// (done, failed, panicked, cancelled), the scan hears of it, so a mark
/// cannot outlive the work.
struct Tell {
    inbox: mpsc::UnboundedSender<Msg>,
    msg: Option<Msg>,
}

impl Drop for Tell {
    fn drop(&mut self) {
        if let Some(m) = self.msg.take() {
            // The scan is gone only when the node stops.
            let _ = self.inbox.send(m);
        }
    }
}

/// Which sagas have a task on this node, and the slots they share
/// (`saga.sagas_in_flight_max`). Pure: the scan asks it what to start.
#[derive(Debug)]
pub(crate) struct Slots {
    max: usize,
    /// Sagas with a task here: running, or waiting for a slot.
    driving: HashSet<SagaId>,
    /// Those waiting for a slot, oldest first, each with the term it was
    /// found in (its task drives only while this node leads that term).
    waiting: VecDeque<(SagaId, u64)>,
    running: usize,
}

impl Slots {
    pub(crate) fn new(max: usize) -> Slots {
        Slots {
            max,
            driving: HashSet::new(),
            waiting: VecDeque::new(),
            running: 0,
        }
    }

    /// The scan of `term` found `ids` to drive: those without a task get
    /// one; returns the tasks to start now (the others wait for a slot).
    pub(crate) fn found(&mut self, ids: impl IntoIterator<Item = SagaId>, term: u64) -> Vec<(SagaId, u64)> {
        for id in ids {
            if self.driving.insert(id) {
                self.waiting.push_back((id, term));
            }
        }
        self.start()
    }

    /// The task of `id` ended: its slot goes to the next waiting saga.
    pub(crate) fn ended(&mut self, id: SagaId) -> Vec<(SagaId, u64)> {
        debug_assert!(self.driving.contains(&id), "saga {id} ended without a task here");
        if self.driving.remove(&id) {
            self.running = self.running.saturating_sub(1);
        }
        self.start()
    }

    fn start(&mut self) -> Vec<(SagaId, u64)> {
        let mut go = Vec::new();
        while self.running < self.max {
            let Some(next) = self.waiting.pop_front() else { break };
            self.running += 1;
            go.push(next);
        }
        go
    }
}

/// The orchestrator's one task: scans every `saga.scan_interval_ms` (or
/// when kicked) on the leader, starts a task for every driven saga that
/// has none, as slots allow, and hands each ended task's slot on.
pub struct Scan {
    orchestrator: Arc<Orchestrator>,
    inbox: mpsc::UnboundedReceiver<Msg>,
    slots: Slots,
    /// A forget pass is running (one at a time).
    forgetting: bool,
}

/// Which step call an operation is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Forward,
    Compensation,
}

impl Side {
    fn label(self) -> &'static str {
        match self {
            Side::Forward => "forward",
            Side::Compensation => "compensation",
        }
    }
}

/// A call's answer as the orchestrator sees it.
enum Answer {
    Reply(pb::StepReply),
    /// Timeout, lost reply, error status, unreachable: UNKNOWN.
    Unknown(String),
}

impl Orchestrator {
    /// The orchestrator, and its scan (to run in a task of its own).
    pub fn new(ctx: Arc<NodeCtx>, policy: Arc<dyn RecoveryPolicy>) -> (Arc<Orchestrator>, Scan) {
        let (tx, rx) = mpsc::unbounded_channel();
        let max = ctx.config.saga.sagas_in_flight_max;
        let orchestrator = Arc::new(Orchestrator { ctx, policy, inbox: tx });
        let scan = Scan {
            orchestrator: orchestrator.clone(),
            inbox: rx,
            slots: Slots::new(max),
            forgetting: false,
        };
        (orchestrator, scan)
    }

    /// Wakes the scan now (a saga started, an operator resumed one).
    pub fn kick(&self) {
        let _ = self.inbox.send(Msg::Kick);
    }

    /// A mark that tells the scan `msg` when it is dropped.
    fn tell_on_drop(&self, msg: Msg) -> Tell {
        Tell {
            inbox: self.inbox.clone(),
            msg: Some(msg),
        }
    }
}

impl Scan {
    /// Runs until `stop`.
    pub async fn run(mut self, mut stop: tokio::sync::watch::Receiver<bool>) {
        let interval = Duration::from_millis(self.orchestrator.ctx.config.saga.scan_interval_ms);
        let mut next_scan = tokio::time::Instant::now() + interval;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(next_scan) => {}
                msg = self.inbox.recv() => match msg {
                    Some(Msg::Kick) => {
                        // Kicks that came together make one scan.
                        while let Ok(Msg::Kick) = self.inbox.try_recv() {}
                    }
                    Some(Msg::Ended(id)) => {
                        let go = self.slots.ended(id);
                        self.start(go);
                        continue;
                    }
                    Some(Msg::Forgot) => {
                        self.forgetting = false;
                        continue;
                    }
                    None => return,
                },
                _ = stop.wait_for(|s| *s) => return,
            }
            next_scan = tokio::time::Instant::now() + interval;
            self.scan();
        }
    }

    /// On the leader: a task for every driven saga that has none, and a
    /// forget pass if none runs.
    fn scan(&mut self) {
        let o = &self.orchestrator;
        if !o.ctx.is_leader() || !o.ctx.caught_up_in_term() {
            return;
        }
        let term = o.ctx.current_term();
        let ids = o.ctx.sm.state().sagas.driven();
        o.report_gauges();
        if !self.forgetting {
            self.forgetting = true;
            let me = o.clone();
            let done = o.tell_on_drop(Msg::Forgot);
            tokio::spawn(async move {
                let _done = done;
                me.forget_ended().await;
            });
        }
        let go = self.slots.found(ids, term);
        self.start(go);
    }

    fn start(&self, go: Vec<(SagaId, u64)>) {
        for (id, term) in go {
            let me = self.orchestrator.clone();
            let ended = me.tell_on_drop(Msg::Ended(id));
            tokio::spawn(async move {
                let _ended = ended;
                me.drive(id, term).await;
            });
        }
    }
}

impl Orchestrator {
    /// Forgets ended sagas past `saga.retention_ms` (at most
    /// `FORGET_PER_SCAN` per scan, in one Raft entry).
    async fn forget_ended(&self) {
        let before = now_ms().saturating_sub(self.ctx.config.saga.retention_ms);
        let ids = self.ctx.sm.state().sagas.forgettable(before, FORGET_PER_SCAN);
        if ids.is_empty() {
            return;
        }
        let cmds = ids
            .iter()
            .map(|&saga_id| {
                Command::Saga(SagaCommand::Forget {
                    saga_id,
                    ended_before_ms: before,
                })
            })
            .collect();
        match self.ctx.propose_together(cmds).await {
            Ok(results) => {
                let n = results
                    .iter()
                    .filter(|r| matches!(r, Ok(CommandOk::Saga(SagaOk::Forgotten { removed: true }))))
                    .count();
                metrics::counter!("dtx_sagas_forgotten_total").increment(n as u64);
            }
            Err(e) => warn!(error = %e, "forgetting ended sagas failed; the next scan tries again"),
        }
    }

    fn report_gauges(&self) {
        use crate::sm::saga::SagaState::*;
        let st = self.ctx.sm.state();
        for s in [Running, Compensating, Parked] {
            metrics::gauge!("dtx_sagas", "state" => s.name()).set(st.sagas.count_in(s) as f64);
        }
    }

    fn read(&self, id: SagaId) -> Option<(SagaRecord, Definition)> {
        let st = self.ctx.sm.state();
        let r = st.sagas.get(id)?.clone();
        let d = st.sagas.definition(&r.definition, r.version)?.clone();
        Some((r, d))
    }

    /// Drives saga `id` while this node leads `term`: plans the next move
    /// on the journal as applied here, does its I/O, journals what it saw,
    /// and plans again.
    async fn drive(&self, id: SagaId, term: u64) {
        let mut t = Task::default();
        loop {
            if !self.ctx.is_leader_of(term) {
                return;
            }
            let Some((r, def)) = self.read(id) else { return };
            let is_fresh = t.fresh.is_some() && current_call(&r) == t.fresh;
            let sd = &def.steps[r.current as usize];
            let ev = match plan::next(&r, &def, is_fresh, now_ms(), self.policy.as_ref()) {
                Move::Idle => return,
                Move::Journal(ev) => {
                    self.before_journaling(&r, &def, &ev).await;
                    ev
                }
                Move::CallForward { step } => {
                    t.fresh = None;
                    self.call_forward(&r, &def, step).await
                }
                Move::QueryForward { step } => {
                    self.after_query_failures(&r).await;
                    self.query_forward(&r, &def, step).await
                }
                Move::AskThenCompensate { step } => {
                    self.after_query_failures(&r).await;
                    self.ask_then_compensate(&r, &def, step, &mut t).await
                }
                Move::QueryCompensation { step } => {
                    self.after_query_failures(&r).await;
                    self.query_compensation(&r, &def, step).await
                }
            };
            let intent = matches!(
                ev,
                JournalEvent::ForwardIntent { .. }
                    | JournalEvent::CompensationIntent { .. }
                    | JournalEvent::Recover {
                        option: crate::sm::saga::Recovery::Retry,
                        ..
                    }
            );
            let pivot_passed = sd.kind == StepKind::Pivot
                && matches!(&ev, JournalEvent::ForwardOutcome { reply, .. } if reply.outcome == CallOutcome::Ok);
            let query_failed = matches!(ev, JournalEvent::QueryFailed { .. });
            let parked = match &ev {
                JournalEvent::Park { reason } => Some(reason.clone()),
                _ => None,
            };
            let deadline = matches!(ev, JournalEvent::DeadlinePassed { .. });
            match self.journal(&r, ev).await {
                Ok(()) => {
                    t.refusals = 0;
                    // Only an intent this task journaled may be called
                    // without asking first (a failed question before it
                    // leaves it uncalled).
                    if intent {
                        t.fresh = self.read(id).and_then(|(r2, _)| current_call(&r2));
                    } else if !query_failed {
                        t.fresh = None;
                    }
                    if let Some(reason) = parked {
                        metrics::counter!("dtx_saga_parked_total").increment(1);
                        warn!(saga = id, step = r.current, reason = %dtx_tls::logtext::Clean(&reason), "saga parked for an operator");
                    }
                    if deadline {
                        info!(
                            saga = id,
                            step = r.current,
                            "the saga's deadline passed before its point of no return: it is compensated"
                        );
                    }
                    if pivot_passed {
                        dtx_failpoint::failpoint!("saga_after_pivot");
                        info!(
                            saga = id,
                            step = r.current,
                            "saga passed its pivot: it only goes forward now"
                        );
                    }
                }
                Err(e) => {
                    t.fresh = None;
                    if !self.after_refusal(id, &e, &mut t.refusals).await {
                        return;
                    }
                }
            }
        }
    }

    /// Before asking a status question again after `n` failed in a row
    /// (the journal's count, so a new leader waits too): 100 ms doubled per
    /// failure, at most 3.2 s.
    async fn after_query_failures(&self, r: &SagaRecord) {
        let n = self.ctx.sm.state().sagas.query_failures(r.id);
        if n > 0 {
            tokio::time::sleep(Duration::from_millis(100u64 << n.min(5))).await;
        }
    }

    /// Before a planned journal write: a retry waits its backoff.
    async fn before_journaling(&self, r: &SagaRecord, def: &Definition, ev: &JournalEvent) {
        let sd = &def.steps[r.current as usize];
        let attempts = current_call(r).map(|c| c.1).unwrap_or(0);
        let retry = match ev {
            JournalEvent::ForwardIntent { .. } | JournalEvent::CompensationIntent { .. } => attempts > 0,
            JournalEvent::Recover { option, .. } => *option == crate::sm::saga::Recovery::Retry,
            _ => false,
        };
        if retry {
            tokio::time::sleep(Duration::from_millis(sd.retry.backoff_ms(attempts))).await;
        }
    }

    /// Calls the forward action whose intent this task journaled; its
    /// outcome (UNKNOWN for no answer).
    async fn call_forward(&self, r: &SagaRecord, def: &Definition, step: u32) -> JournalEvent {
        dtx_failpoint::failpoint!("saga_before_forward_call");
        let a = self.call(r, def, step, Side::Forward).await;
        dtx_failpoint::failpoint!("saga_after_reply_before_journal");
        let reply = forward_reply(reply_of(a, false));
        self.outcome_metrics(Side::Forward, &reply);
        forward_outcome(def, step, reply)
    }

    /// Settles a forward call that is UNKNOWN (or an intent found on
    /// resume) by its status query: applied → its answer; not applied →
    /// a new attempt, or after the last one a fence and FAILED; a failed
    /// query: see [`Orchestrator::query_failed`].
    async fn query_forward(&self, r: &SagaRecord, def: &Definition, step: u32) -> JournalEvent {
        let sd = &def.steps[step as usize];
        let c = r.steps[step as usize].forward.clone().unwrap_or_default();
        let last = c.attempts >= sd.retry.max_attempts;
        // The last attempt is asked with a fence, so "not applied" stays
        // true (a late call of it will never run).
        match self
            .ask(
                &sd.service,
                &self.wire_op_id(r.id, &c.operation_id),
                &sd.status_query,
                last,
            )
            .await
        {
            Ok(s) => {
                if s.applied {
                    self.settled_metrics(Side::Forward, &c);
                    let reply = forward_reply(reply_of(Answer::Reply(s.reply.unwrap_or_default()), true));
                    forward_outcome(def, step, reply)
                } else if !last {
                    JournalEvent::ForwardIntent { step }
                } else {
                    self.settled_metrics(Side::Forward, &c);
                    let mut reply = Reply::of(
                        CallOutcome::Failed,
                        format!("not applied after {} attempts (status query; fenced)", c.attempts),
                    );
                    reply.reconciled = true;
                    JournalEvent::ForwardOutcome { step, reply }
                }
            }
            Err(e) => {
                self.query_failed(r, sd.retry.max_attempts, Side::Forward, &e, true)
                    .await
            }
        }
    }

    /// A compensation whose intent this task journaled: asks (with a
    /// fence) whether the forward action happened; calls the compensation
    /// only if it did, else journals NOOP. A failed question: see
    /// [`Orchestrator::query_failed`] (the intent stays this task's,
    /// nothing was called).
    async fn ask_then_compensate(&self, r: &SagaRecord, def: &Definition, step: u32, t: &mut Task) -> JournalEvent {
        let sd = &def.steps[step as usize];
        let fwd = r.steps[step as usize].forward.clone().unwrap_or_default();
        let happened = match self
            .ask(
                &sd.service,
                &self.wire_op_id(r.id, &fwd.operation_id),
                &sd.status_query,
                true,
            )
            .await
        {
            // A PENDING forward call was accepted: it may complete, so
            // it is undone (the compensation cancels it).
            Ok(s) => {
                s.applied
                    && matches!(
                        s.reply.as_ref().map(|x| pb::StepOutcome::try_from(x.outcome)),
                        Some(Ok(pb::StepOutcome::Ok | pb::StepOutcome::Pending))
                    )
            }
            Err(e) => {
                // The intent stays this task's (nothing was called): see
                // `drive`, which keeps it fresh across a QueryFailed.
                return self
                    .query_failed(r, sd.retry.max_attempts, Side::Compensation, &e, false)
                    .await;
            }
        };
        t.fresh = None;
        let reply = if happened {
            dtx_failpoint::failpoint!("saga_mid_compensation");
            reply_of(self.call(r, def, step, Side::Compensation).await, false)
        } else {
            Reply::of(
                CallOutcome::Noop,
                format!(
                    "the forward action {} never happened at {}: nothing to undo",
                    fwd.operation_id, sd.service
                ),
            )
        };
        self.outcome_metrics(Side::Compensation, &reply);
        JournalEvent::CompensationOutcome { step, reply }
    }

    /// Settles a compensation that is UNKNOWN (or an intent found on
    /// resume) by its status query: applied → its answer; not applied → a
    /// new attempt, or after the last one the saga parks.
    async fn query_compensation(&self, r: &SagaRecord, def: &Definition, step: u32) -> JournalEvent {
        let sd = &def.steps[step as usize];
        let c = r.steps[step as usize].compensation.clone().unwrap_or_default();
        match self
            .status(&sd.service, &self.wire_op_id(r.id, &c.operation_id), &sd.status_query)
            .await
        {
            Ok(s) => {
                if s.applied {
                    self.settled_metrics(Side::Compensation, &c);
                    let reply = reply_of(Answer::Reply(s.reply.unwrap_or_default()), true);
                    JournalEvent::CompensationOutcome { step, reply }
                } else if c.attempts < sd.retry.max_attempts {
                    JournalEvent::CompensationIntent { step }
                } else {
                    JournalEvent::Park {
                        reason: format!(
                            "the compensation of step {step} ({:?}) was not applied after {} attempts",
                            sd.name, c.attempts
                        ),
                    }
                }
            }
            Err(e) => {
                self.query_failed(r, sd.retry.max_attempts, Side::Compensation, &e, true)
                    .await
            }
        }
    }

    /// A status query failed: the call's outcome is (or stays) UNKNOWN.
    /// After `max` failures in a row (the journal's count, kept across
    /// leaders, this one included) the saga parks. Otherwise the first
    /// failure of an INTENDED call journals it UNKNOWN when `mark_unknown`
    /// (its dwell time starts; the count starts after it), and any other
    /// failure is journaled as `QueryFailed` (the count goes up; the next
    /// question waits `after_query_failures`).
    async fn query_failed(&self, r: &SagaRecord, max: u32, side: Side, e: &str, mark_unknown: bool) -> JournalEvent {
        let step = r.current;
        let failures = self.ctx.sm.state().sagas.query_failures(r.id) + 1;
        if failures >= max.max(1) {
            return JournalEvent::Park {
                reason: format!(
                    "step {step}: the {} outcome is UNKNOWN and its status query failed {failures} times in a row: {e}",
                    side.label()
                ),
            };
        }
        let call = match side {
            Side::Forward => r.steps[step as usize].forward.as_ref(),
            Side::Compensation => r.steps[step as usize].compensation.as_ref(),
        };
        if mark_unknown && call.map(|c| c.outcome()) == Some(CallOutcome::Intended) {
            let reply = Reply::of(CallOutcome::Unknown, format!("status query failed: {e}"));
            return match side {
                Side::Forward => JournalEvent::ForwardOutcome { step, reply },
                Side::Compensation => JournalEvent::CompensationOutcome { step, reply },
            };
        }
        let mut error = e.to_string();
        if error.len() > QUERY_ERROR_BYTES_MAX {
            let mut at = QUERY_ERROR_BYTES_MAX;
            while !error.is_char_boundary(at) {
                at -= 1;
            }
            error.truncate(at);
        }
        JournalEvent::QueryFailed { step, error }
    }

    /// After a refused or unknown journal write: read again (true), or end
    /// the task (false) when this node no longer leads or the refusals go
    /// on (the next scan starts a new task).
    async fn after_refusal(&self, id: SagaId, e: &ApiError, refusals: &mut u32) -> bool {
        *refusals += 1;
        match e {
            ApiError::NotLeader { .. } | ApiError::NoLeader(_) => false,
            _ if *refusals > 20 => {
                warn!(saga = id, error = %e, "saga journal writes keep failing; the next scan starts over");
                false
            }
            _ => {
                tokio::time::sleep(Duration::from_millis(20 * u64::from(*refusals))).await;
                true
            }
        }
    }

    async fn journal(&self, r: &SagaRecord, event: JournalEvent) -> Result<(), ApiError> {
        let cmd = Command::Saga(SagaCommand::Journal {
            saga_id: r.id,
            seq: r.seq,
            now_ms: now_ms(),
            event,
        });
        match self.ctx.propose(cmd).await? {
            CommandOk::Saga(SagaOk::Journaled { .. }) => Ok(()),
            other => Err(ApiError::Internal(format!("unexpected state-machine result {other:?}"))),
        }
    }

    fn client(
        &self,
        service: &str,
    ) -> Result<
        SagaStepServiceClient<
            tonic::service::interceptor::InterceptedService<
                dtx_transport::channel::Channel,
                crate::ctx::ParticipantGate,
            >,
        >,
        String,
    > {
        let ch = self.ctx.api_channel(service).map_err(|e| e.to_string())?;
        Ok(SagaStepServiceClient::with_interceptor(
            ch,
            self.ctx.participant_gate.clone(),
        ))
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.ctx.config.saga.call_timeout_ms)
    }

    /// The operation id a step service receives for the journal's `op` of
    /// saga `saga` (ADR 0033): `op` itself for a saga started before this
    /// cluster chose an incarnation (so its step services still find its
    /// calls), otherwise `op@<incarnation>`, so a step service shared with
    /// another cluster, or with the cluster before a restore, never takes
    /// this saga's call for one of theirs that reused the saga id.
    fn wire_op_id(&self, saga: SagaId, op: &str) -> String {
        match self.ctx.sm.state().incarnations.of_saga(saga).unwrap_or(0) {
            0 => op.to_string(),
            inc => format!("{op}@{inc:016x}"),
        }
    }

    async fn call(&self, r: &SagaRecord, def: &Definition, step: u32, side: Side) -> Answer {
        let sd = &def.steps[step as usize];
        let j = &r.steps[step as usize];
        let (call, action, precondition, fwd_op) = match side {
            Side::Forward => (
                j.forward.clone().unwrap_or_default(),
                sd.action.clone(),
                String::new(),
                String::new(),
            ),
            Side::Compensation => (
                j.compensation.clone().unwrap_or_default(),
                sd.compensation.clone().unwrap_or_default(),
                j.precondition.clone(),
                j.forward.as_ref().map(|c| c.operation_id.clone()).unwrap_or_default(),
            ),
        };
        let req = pb::StepCall {
            saga_id: r.id,
            step,
            operation_id: self.wire_op_id(r.id, &call.operation_id),
            action,
            input: r.input.clone(),
            fingerprint: j.fingerprint.clone(),
            precondition,
            forward_operation_id: if fwd_op.is_empty() {
                fwd_op
            } else {
                self.wire_op_id(r.id, &fwd_op)
            },
            authorization: Some(pb::SagaAuthorization {
                principal: r.authorization.principal.clone(),
                tenant: r.authorization.tenant.clone(),
                expires_at_ms: r.authorization.expires_at_ms,
                policy: r.authorization.policy.clone(),
            }),
            term: self.ctx.current_term(),
            outputs: outputs_for(r, def, step, side),
        };
        let mut client = match self.client(&sd.service) {
            Ok(c) => c,
            Err(e) => return Answer::Unknown(e),
        };
        let mut request = tonic::Request::new(req);
        request.set_timeout(self.timeout());
        let fut = async {
            match side {
                Side::Forward => client.forward(request).await,
                Side::Compensation => client.compensate(request).await,
            }
        };
        match tokio::time::timeout(self.timeout(), fut).await {
            Ok(Ok(resp)) => Answer::Reply(resp.into_inner()),
            Ok(Err(s)) => Answer::Unknown(format!("{}: {}", code_name(s.code()), s.message())),
            Err(_) => Answer::Unknown(format!(
                "no answer within saga.call_timeout_ms = {} ms",
                self.ctx.config.saga.call_timeout_ms
            )),
        }
    }

    async fn status(&self, service: &str, operation_id: &str, query: &str) -> Result<pb::StepStatusReply, String> {
        self.ask(service, operation_id, query, false).await
    }

    /// The status query of `operation_id`; with `fence`, the Fence call
    /// (the same answer, and "not applied" recorded as final).
    async fn ask(
        &self,
        service: &str,
        operation_id: &str,
        query: &str,
        fence: bool,
    ) -> Result<pb::StepStatusReply, String> {
        let started = Instant::now();
        let mut client = self.client(service)?;
        let mut request = tonic::Request::new(pb::StepStatusRequest {
            operation_id: operation_id.to_string(),
            query: query.to_string(),
        });
        request.set_timeout(self.timeout());
        let call = async {
            if fence {
                client.fence(request).await
            } else {
                client.status(request).await
            }
        };
        let out = match tokio::time::timeout(self.timeout(), call).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(format!("{}: {}", code_name(s.code()), s.message())),
            Err(_) => Err(format!(
                "no answer within saga.call_timeout_ms = {} ms",
                self.ctx.config.saga.call_timeout_ms
            )),
        };
        metrics::histogram!("dtx_saga_status_query_seconds").record(started.elapsed().as_secs_f64());
        out
    }

    fn outcome_metrics(&self, side: Side, reply: &Reply) {
        if reply.outcome == CallOutcome::Unknown {
            info!(call = side.label(), reason = %dtx_tls::logtext::Clean(&reply.reason), "saga step call outcome UNKNOWN: its status query settles it");
        }
        metrics::counter!("dtx_saga_calls_total", "call" => side.label(), "outcome" => reply.outcome.name())
            .increment(1);
    }

    /// A status query settled `c`: count the reconciliation and, for an
    /// UNKNOWN, the time it stayed UNKNOWN.
    fn settled_metrics(&self, side: Side, c: &crate::sm::saga::Call) {
        metrics::counter!("dtx_saga_reconciliations_total", "call" => side.label()).increment(1);
        if c.outcome() == CallOutcome::Unknown && c.unknown_since_ms > 0 {
            let s = now_ms().saturating_sub(c.unknown_since_ms) as f64 / 1000.0;
            metrics::histogram!("dtx_saga_unknown_seconds", "call" => side.label()).record(s);
        }
    }
}

/// The (operation id, attempts) of the call the saga's current step waits
/// on (its forward call while RUNNING, its compensation while
/// COMPENSATING).
fn current_call(r: &SagaRecord) -> Option<(String, u32)> {
    use crate::sm::saga::SagaState;
    let j = r.step(r.current)?;
    let c = match r.state {
        SagaState::Running => j.forward.as_ref()?,
        SagaState::Compensating => j.compensation.as_ref()?,
        _ => return None,
    };
    Some((c.operation_id.clone(), c.attempts))
}

/// What a call of `step` is handed of the earlier steps' results: the
/// output of every forward call before it that ended OK (a compensation:
/// its own forward's too), in step order.
fn outputs_for(r: &SagaRecord, def: &Definition, step: u32, side: Side) -> Vec<pb::StepOutput> {
    let upto = match side {
        Side::Forward => step as usize,
        Side::Compensation => step as usize + 1,
    };
    r.steps
        .iter()
        .zip(&def.steps)
        .take(upto)
        .enumerate()
        .filter_map(|(i, (j, sd))| {
            let c = j.forward.as_ref().filter(|c| c.outcome() == CallOutcome::Ok)?;
            Some(pb::StepOutput {
                step: i as u32,
                name: sd.name.clone(),
                output: c.output.clone(),
            })
        })
        .collect()
}

/// The journal write for a forward call's answer: its outcome, or, for an
/// OK whose output is over `limits::SAGA_STEP_OUTPUT_BYTES_MAX`, a park
/// (the action happened but its result cannot be journaled: an operator
/// decides; the call stays unsettled, so a compensation asks first).
fn forward_outcome(def: &Definition, step: u32, reply: Reply) -> JournalEvent {
    let max = crate::limits::SAGA_STEP_OUTPUT_BYTES_MAX;
    if reply.output.len() > max {
        return JournalEvent::Park {
            reason: format!(
                "step {step} ({:?}) answered OK with an output of {} bytes; the limit is saga_step_output_bytes_max = {max} bytes: not journaled (its action happened; skip the step or compensate)",
                def.steps[step as usize].name,
                reply.output.len()
            ),
        };
    }
    JournalEvent::ForwardOutcome { step, reply }
}

/// A forward call answers OK, FAILED or PENDING; anything else (NOOP,
/// STALE) is a service's mistake, journaled as FAILED with what it said.
fn forward_reply(mut r: Reply) -> Reply {
    if matches!(r.outcome, CallOutcome::Noop | CallOutcome::Stale | CallOutcome::Skipped) {
        r.reason = format!(
            "the service answered {} to a forward call: {}",
            r.outcome.name(),
            r.reason
        );
        r.outcome = CallOutcome::Failed;
    }
    r
}

fn code_name(c: tonic::Code) -> String {
    format!("{c:?}")
}

fn reply_of(a: Answer, reconciled: bool) -> Reply {
    match a {
        Answer::Unknown(reason) => Reply {
            reconciled,
            ..Reply::of(CallOutcome::Unknown, reason)
        },
        Answer::Reply(r) => {
            let outcome = match pb::StepOutcome::try_from(r.outcome) {
                Ok(pb::StepOutcome::Ok) => CallOutcome::Ok,
                Ok(pb::StepOutcome::Failed) => CallOutcome::Failed,
                Ok(pb::StepOutcome::Noop) => CallOutcome::Noop,
                Ok(pb::StepOutcome::Stale) => CallOutcome::Stale,
                Ok(pb::StepOutcome::Pending) => CallOutcome::Pending,
                // A service that answers something else could not tell.
                _ => CallOutcome::Unknown,
            };
            let clip = |s: String| -> String {
                let max = crate::limits::REASON_BYTES_MAX;
                if s.len() <= max {
                    return s;
                }
                let mut end = max;
                while !s.is_char_boundary(end) {
                    end -= 1;
                }
                s[..end].to_string()
            };
            Reply {
                outcome,
                reason: clip(r.reason),
                downstream_operation_id: clip(r.downstream_operation_id),
                resource_version: clip(r.resource_version),
                residual: clip(r.residual),
                reconciled,
                // Only an OK carries one (checked by the journal).
                output: if outcome == CallOutcome::Ok {
                    r.output
                } else {
                    Vec::new()
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Slots;

    #[test]
    fn sagas_get_a_task_once_and_wait_for_a_free_slot_in_order() {
        let mut s = Slots::new(2);
        assert_eq!(s.found([1, 2, 3], 5), vec![(1, 5), (2, 5)], "two slots");
        assert_eq!(s.found([1, 2, 3, 4], 6), Vec::new(), "each saga has its task already");
        assert_eq!(s.ended(2), vec![(3, 5)], "the slot goes to the oldest waiting");
        assert_eq!(s.ended(1), vec![(4, 6)]);
        assert_eq!(s.found([1], 7), Vec::new(), "no free slot");
        assert_eq!(s.ended(3), vec![(1, 7)], "an ended saga found again gets a new task");
        assert_eq!(s.ended(4), Vec::new());
        assert_eq!(s.ended(1), Vec::new());
        assert_eq!(s.found([9, 8], 8), vec![(9, 8), (8, 8)], "all slots free again");
    }
}
