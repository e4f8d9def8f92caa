//! The replicated saga journal (docs/protocol.md, "Sagas"), as a pure state
//! machine beside the transaction table: registered definitions, and per
//! saga its state and the journal of every step's forward call and
//! compensation. Like `TxTable`, it does no I/O and reads no clock (time
//! arrives inside commands, from the proposing leader).
//!
//! Saga life:
//! ```text
//! Start ─> RUNNING ──every step OK──────────────────────────> COMPLETED
//!             │ a step FAILED, recovery COMPENSATE (before the pivot)
//!             └──> COMPENSATING ──every done step undone───> COMPENSATED
//! RUNNING / COMPENSATING ──limit reached, stale version, expired rights──> PARKED
//! PARKED ──operator: retry | skip | compensate | mark complete──> ...
//! RUNNING (or PARKED from it) ──cancel, or past its deadline, before the
//!     point of no return──> COMPENSATING
//! ```
//! The rules the journal keeps (docs/sagas.md): a call's intent (with the
//! compensation it would need) is journaled before the call; its outcome
//! before the next step; an UNKNOWN outcome stays UNKNOWN until a status
//! query settles it (an intent journaled again after UNKNOWN records that
//! the query found nothing applied); COMPENSATE is only chosen before the
//! pivot and only when the step's definition registered it; a stale
//! compensation parks the saga rather than erase a newer change.
//!
//! Every journal write names the journal length it was planned on
//! (`seq`): a write planned on an older journal (a deposed leader's
//! orchestrator, an operator's action in between) is refused and changes
//! nothing.
//!
//! `definition`: the definitions and their registration rules. `plan`: the
//! orchestrator's next move for a saga, as a pure function of its record.

pub mod definition;
pub mod plan;

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;
use serde::Serialize;
use sha2::Digest;

pub use self::definition::Definition;
pub use self::definition::Recovery;
pub use self::definition::RetryPolicy;
pub use self::definition::StepDef;
pub use self::definition::StepKind;
use crate::limits;

pub type SagaId = u64;

/// What a call (a forward action or a compensation) is known to have done.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallOutcome {
    /// Journaled before the call; no outcome seen yet.
    Intended,
    /// A timeout, a lost reply or a service that could not tell: it may or
    /// may not have happened. Never the same as FAILED.
    Unknown,
    Ok,
    Failed,
    /// A compensation that found no forward action to undo.
    Noop,
    /// A compensation refused: the resource's version moved on.
    Stale,
    /// An operator skipped it.
    Skipped,
    /// The step service accepted the forward call and completes it later
    /// (a callback, a person's approval): the saga waits at the step until
    /// a `Complete` command journals its end (OK or FAILED), by operation
    /// id. It may have happened (so a cancel compensates it). Appended
    /// last: older log entries keep their encoding.
    Pending,
}

impl CallOutcome {
    pub fn name(self) -> &'static str {
        match self {
            CallOutcome::Intended => "INTENDED",
            CallOutcome::Unknown => "UNKNOWN",
            CallOutcome::Ok => "OK",
            CallOutcome::Failed => "FAILED",
            CallOutcome::Noop => "NOOP",
            CallOutcome::Stale => "STALE",
            CallOutcome::Skipped => "SKIPPED",
            CallOutcome::Pending => "PENDING",
        }
    }

    /// The forward action may have happened (so it may need undoing).
    fn may_have_happened(self) -> bool {
        matches!(
            self,
            CallOutcome::Intended | CallOutcome::Unknown | CallOutcome::Ok | CallOutcome::Pending
        )
    }

    fn unsettled(self) -> bool {
        matches!(self, CallOutcome::Intended | CallOutcome::Unknown)
    }
}

/// One call of a step, as journaled.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct Call {
    /// The idempotency key sent downstream: "<saga>.<step>.f<generation>"
    /// or "<saga>.<step>.c<generation>". A new generation only after a
    /// FAILED outcome (the service remembers FAILED for the old key).
    pub operation_id: String,
    pub generation: u32,
    /// When the (latest) intent was journaled.
    pub intent_at_ms: u64,
    /// Calls intended so far for this step, over every generation, since
    /// the saga started or an operator's retry.
    pub attempts: u32,
    pub outcome: Option<CallOutcome>,
    pub reason: String,
    pub downstream_operation_id: String,
    pub resource_version: String,
    pub outcome_at_ms: u64,
    /// Time spent UNKNOWN, summed over every UNKNOWN spell.
    pub unknown_ms: u64,
    /// Status queries that settled an UNKNOWN or a resumed intent.
    pub reconciliations: u32,
    /// Start of the current UNKNOWN spell; 0 when not UNKNOWN.
    pub unknown_since_ms: u64,
    /// What the call answered with its OK (a forward action's result,
    /// handed to every later step's calls and to its own compensation);
    /// at most `limits::SAGA_STEP_OUTPUT_BYTES_MAX` bytes.
    pub output: Vec<u8>,
    /// Who completed a PENDING call (`SagaCommand::Complete`); empty when
    /// the call's own reply (or its status query) settled it.
    pub completed_by: String,
}

impl Call {
    pub fn outcome(&self) -> CallOutcome {
        self.outcome.unwrap_or(CallOutcome::Intended)
    }

    fn new(saga: SagaId, step: u32, tag: char, generation: u32, attempts: u32, now_ms: u64) -> Call {
        Call {
            operation_id: format!("{saga}.{step}.{tag}{generation}"),
            generation,
            intent_at_ms: now_ms,
            attempts,
            outcome: Some(CallOutcome::Intended),
            ..Call::default()
        }
    }

    /// Ends an UNKNOWN spell (if one is running) at `now_ms`; `reconciled`:
    /// a status query settled it (counted), not an operator.
    fn settle_unknown(&mut self, now_ms: u64, reconciled: bool) {
        if self.outcome() == CallOutcome::Unknown {
            self.unknown_ms += now_ms.saturating_sub(self.unknown_since_ms);
            self.unknown_since_ms = 0;
        }
        if reconciled {
            self.reconciliations += 1;
        }
    }

    /// A new generation of this call (after FAILED or STALE), keeping what
    /// the earlier generations measured.
    fn next_generation(&self, saga: SagaId, step: u32, tag: char, attempts: u32, now_ms: u64) -> Call {
        let mut n = Call::new(saga, step, tag, self.generation + 1, attempts, now_ms);
        n.unknown_ms = self.unknown_ms;
        n.reconciliations = self.reconciliations;
        n
    }

    fn record(&mut self, r: &Reply, now_ms: u64) {
        if r.outcome == CallOutcome::Unknown {
            if self.outcome() != CallOutcome::Unknown {
                self.unknown_since_ms = now_ms;
            }
            self.outcome = Some(CallOutcome::Unknown);
            self.reason = r.reason.clone();
            return;
        }
        self.settle_unknown(now_ms, r.reconciled);
        self.outcome = Some(r.outcome);
        self.reason = r.reason.clone();
        if !r.downstream_operation_id.is_empty() || r.outcome != CallOutcome::Ok {
            self.downstream_operation_id = r.downstream_operation_id.clone();
        }
        if !r.resource_version.is_empty() {
            self.resource_version = r.resource_version.clone();
        }
        if r.outcome == CallOutcome::Ok {
            self.output = r.output.clone();
        }
        self.outcome_at_ms = now_ms;
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct StepJournal {
    /// sha256 over (definition, version, step, input), hex: the request
    /// fingerprint sent with every call of the step.
    pub fingerprint: String,
    pub forward: Option<Call>,
    pub compensation: Option<Call>,
    /// What could not be undone.
    pub residual: String,
    /// The compensation journaled with the forward intent:
    /// "<definition>@<version>:<compensation>"; empty for steps without one.
    pub compensation_ref: String,
    /// The precondition the compensation carries: the version the forward
    /// action left.
    pub precondition: String,
    /// Who approved the compensation of this high-impact step (the
    /// approval gate); empty while nobody has.
    pub approved_by: String,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SagaState {
    Running,
    Compensating,
    Completed,
    Compensated,
    Parked,
}

impl SagaState {
    pub fn name(self) -> &'static str {
        match self {
            SagaState::Running => "RUNNING",
            SagaState::Compensating => "COMPENSATING",
            SagaState::Completed => "COMPLETED",
            SagaState::Compensated => "COMPENSATED",
            SagaState::Parked => "PARKED",
        }
    }

    pub fn ended(self) -> bool {
        matches!(self, SagaState::Completed | SagaState::Compensated)
    }

    /// The orchestrator drives it.
    pub fn driven(self) -> bool {
        matches!(self, SagaState::Running | SagaState::Compensating)
    }
}

/// The rights a saga runs with, checked again before every compensation.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct Authorization {
    pub principal: String,
    pub tenant: String,
    /// Unix ms after which the rights may not be used; 0: no expiry.
    pub expires_at_ms: u64,
    pub policy: String,
}

impl Authorization {
    pub fn expired(&self, now_ms: u64) -> bool {
        self.expires_at_ms != 0 && now_ms >= self.expires_at_ms
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum OperatorAction {
    Retry,
    Skip,
    Compensate,
    MarkComplete,
    /// Stop a RUNNING saga (or one PARKED from RUNNING) before its point
    /// of no return and compensate what it did, newest first. Also the
    /// application's own (it started the saga). Appended last: older log
    /// entries keep their encoding.
    Cancel,
    /// Approve the high-impact compensation a PARKED saga waits for
    /// (`JournalEvent::AwaitApproval`): it goes on compensating. Appended
    /// last.
    Approve,
}

impl OperatorAction {
    pub fn name(self) -> &'static str {
        match self {
            OperatorAction::Retry => "retry",
            OperatorAction::Skip => "skip",
            OperatorAction::Compensate => "compensate",
            OperatorAction::MarkComplete => "mark-complete",
            OperatorAction::Cancel => "cancel",
            OperatorAction::Approve => "approve",
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct OperatorEntry {
    pub action: OperatorAction,
    pub who: String,
    pub why: String,
    pub at_ms: u64,
    pub step: u32,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct SagaRecord {
    pub id: SagaId,
    pub definition: String,
    pub version: u32,
    pub idempotency_key: String,
    pub request_fingerprint: [u8; 32],
    pub input: Vec<u8>,
    pub authorization: Authorization,
    /// The authenticated identity that started it.
    pub owner: Option<String>,
    pub state: SagaState,
    /// The step driven now (or parked at).
    pub current: u32,
    pub parked_reason: String,
    pub parked_from: Option<SagaState>,
    pub started_at_ms: u64,
    pub ended_at_ms: u64,
    pub steps: Vec<StepJournal>,
    pub operator_actions: Vec<OperatorEntry>,
    /// Journal writes applied so far: the fence of the next one.
    pub seq: u64,
    pub past_pivot: bool,
    /// Unix ms past which the saga, unless beyond its point of no return,
    /// is compensated as if cancelled; 0: no deadline.
    pub deadline_at_ms: u64,
    /// Why it stopped going forward, when a cancel or its deadline made
    /// it compensate; empty otherwise.
    pub cancel_reason: String,
    /// The step whose compensation the saga, PARKED, waits to have
    /// approved (the approval gate, `JournalEvent::AwaitApproval`).
    pub awaiting_approval: Option<u32>,
}

impl SagaRecord {
    pub fn step(&self, i: u32) -> Option<&StepJournal> {
        self.steps.get(i as usize)
    }

    /// Its deadline passed at `now_ms`.
    pub fn past_deadline(&self, now_ms: u64) -> bool {
        self.deadline_at_ms != 0 && now_ms >= self.deadline_at_ms
    }
}

/// An outcome as a journal event carries it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    pub outcome: CallOutcome,
    pub reason: String,
    pub downstream_operation_id: String,
    pub resource_version: String,
    /// Compensations: what could not be undone.
    pub residual: String,
    /// Learnt from a status query, not from the call's own reply.
    pub reconciled: bool,
    /// An OK forward call's result (see `Call::output`).
    pub output: Vec<u8>,
}

impl Reply {
    pub fn of(outcome: CallOutcome, reason: impl Into<String>) -> Reply {
        Reply {
            outcome,
            reason: reason.into(),
            downstream_operation_id: String::new(),
            resource_version: String::new(),
            residual: String::new(),
            reconciled: false,
            output: Vec::new(),
        }
    }
}

/// One write to a saga's journal, planned by the orchestrator on the
/// journal of length `seq`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum JournalEvent {
    /// Before a forward call of `step`. First intent: generation 1. After
    /// INTENDED or UNKNOWN (a status query found it not applied): the same
    /// operation id, one more attempt.
    ForwardIntent { step: u32 },
    /// What the forward call (or its status query) answered: OK, FAILED or
    /// UNKNOWN.
    ForwardOutcome { step: u32, reply: Reply },
    /// The orchestrator's choice after a FAILED forward step, among the
    /// options the step registered. RETRY starts a new generation (its
    /// intent); COMPENSATE starts compensating; PARK parks.
    Recover {
        step: u32,
        option: Recovery,
        reason: String,
    },
    /// Before a compensation call of `step` (after FAILED: a new
    /// generation; after INTENDED or UNKNOWN: the same operation id).
    CompensationIntent { step: u32 },
    /// What the compensation (or the status queries) answered: OK, NOOP,
    /// FAILED, STALE or UNKNOWN.
    CompensationOutcome { step: u32, reply: Reply },
    /// Stop for an operator with the reason.
    Park { reason: String },
    /// A status query of `step` (or the question asked before a
    /// compensation) failed: the outcome stays as it is. Counted per saga
    /// ([`SagaBook::query_failures`]) until the next other journal write or
    /// operator action, so the limit of failures in a row holds across
    /// leaders (a new leader's orchestrator continues the count).
    QueryFailed { step: u32, error: String },
    /// The saga's deadline passed before its point of no return: it stops
    /// going forward and compensates what it did, as a cancel does
    /// (`reason` is recorded as its `cancel_reason`). Refused before the
    /// deadline (by the write's `now_ms`) and past the point of no return.
    /// Appended last: older log entries keep their encoding.
    DeadlinePassed { reason: String },
    /// The next compensation, of `step`, is high-impact (its definition
    /// says so, or the leader's recovery policy does): the saga parks
    /// until someone approves it (`OperatorAction::Approve`) or decides
    /// otherwise (skip it, mark the saga done). Appended last.
    AwaitApproval { step: u32, reason: String },
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum SagaCommand {
    Register {
        definition: Definition,
    },
    Start {
        idempotency_key: String,
        fingerprint: [u8; 32],
        definition: String,
        version: u32,
        input: Vec<u8>,
        authorization: Authorization,
        owner: Option<String>,
        now_ms: u64,
        /// The saga's deadline, in ms after `now_ms`; 0: none.
        deadline_ms: u64,
    },
    Journal {
        saga_id: SagaId,
        seq: u64,
        now_ms: u64,
        event: JournalEvent,
    },
    Operate {
        saga_id: SagaId,
        action: OperatorAction,
        who: String,
        why: String,
        now_ms: u64,
    },
    /// Removes an ended (COMPLETED or COMPENSATED) saga whose end is at or
    /// before `ended_before_ms` (the leader's clock minus the retention),
    /// and frees its idempotency key. Its id is never handed out again.
    /// Appended last: older log entries keep their encoding.
    Forget {
        saga_id: SagaId,
        ended_before_ms: u64,
    },
    /// Completes the PENDING forward call `operation_id` of step `step`
    /// (a callback arrived, a person approved): `reply` is its end, OK
    /// (with its output) or FAILED, recorded with `who`. Also accepted
    /// while the call is INTENDED or UNKNOWN (the completion may overtake
    /// the call's own reply: it is the authoritative end). The same
    /// completion again changes nothing; another one is refused, and so
    /// is a completion of a call the saga no longer waits on (cancelled,
    /// compensating, parked). Appended last.
    Complete {
        saga_id: SagaId,
        step: u32,
        operation_id: String,
        reply: Reply,
        who: String,
        now_ms: u64,
    },
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum SagaOk {
    Registered {
        created: bool,
    },
    Started {
        saga_id: SagaId,
        created: bool,
    },
    /// The journal now has `seq` writes.
    Journaled {
        seq: u64,
        state: SagaState,
    },
    Operated {
        state: SagaState,
    },
    /// Removed (false: there was no such saga: nothing to do).
    Forgotten {
        removed: bool,
    },
    /// A PENDING call completed (`changed` false: this completion was
    /// recorded before).
    Completed {
        state: SagaState,
        changed: bool,
    },
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SagaError {
    #[error("saga definition refused: {0}")]
    InvalidDefinition(String),
    #[error("saga definition {name}@{version} is already registered with other content; register a new version")]
    DefinitionConflict { name: String, version: u32 },
    #[error("no saga definition {name}@{version} is registered")]
    UnknownDefinition { name: String, version: u32 },
    #[error("idempotency key {key:?} already started saga {saga_id} with another request")]
    KeyConflict { key: String, saga_id: SagaId },
    #[error("saga {0} does not exist")]
    NotFound(SagaId),
    #[error("saga {saga_id}: the write was planned on journal length {planned}, the journal has {actual}")]
    StaleJournal { saga_id: SagaId, planned: u64, actual: u64 },
    #[error("saga {saga_id} is {state}: {what}")]
    WrongState {
        saga_id: SagaId,
        state: String,
        what: String,
    },
    #[error("saga {saga_id} step {step}: {what}")]
    Refused { saga_id: SagaId, step: u32, what: String },
    #[error("{0}")]
    Invalid(String),
}

impl SagaError {
    pub fn not_found(&self) -> bool {
        matches!(self, SagaError::NotFound(_) | SagaError::UnknownDefinition { .. })
    }
}

/// What changed, for the store to persist.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SagaEffect {
    Put(SagaId),
    Remove(SagaId),
    Definition(String, u32),
}

/// Definitions and sagas.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SagaBook {
    next_saga_id: SagaId,
    definitions: BTreeMap<(String, u32), Definition>,
    sagas: BTreeMap<SagaId, SagaRecord>,
    keys: BTreeMap<String, SagaId>,
    /// Status queries failed in a row (`JournalEvent::QueryFailed`) since
    /// the saga's last other journal write or operator action; absent: 0.
    query_failures: BTreeMap<SagaId, u32>,
}

/// Everything a snapshot keeps of the book.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct SagaBookData {
    pub next_saga_id: SagaId,
    pub definitions: Vec<Definition>,
    pub sagas: Vec<SagaRecord>,
    /// Each saga's count of status queries failed in a row
    /// (`JournalEvent::QueryFailed`), where it is not 0.
    pub query_failures: Vec<(SagaId, u32)>,
}

/// The fingerprint of step `step` of a saga of `definition`@`version` over
/// `input`, hex.
pub fn step_fingerprint(definition: &str, version: u32, step: u32, input: &[u8]) -> String {
    let mut h = sha2::Sha256::new();
    h.update(definition.as_bytes());
    h.update([0]);
    h.update(version.to_be_bytes());
    h.update(step.to_be_bytes());
    h.update(input);
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

impl SagaBook {
    pub fn from_parts(
        next_saga_id: SagaId,
        definitions: impl IntoIterator<Item = Definition>,
        sagas: impl IntoIterator<Item = SagaRecord>,
    ) -> SagaBook {
        let mut b = SagaBook {
            next_saga_id,
            ..SagaBook::default()
        };
        for d in definitions {
            b.definitions.insert((d.name.clone(), d.version), d);
        }
        for s in sagas {
            b.keys.insert(s.idempotency_key.clone(), s.id);
            b.next_saga_id = b.next_saga_id.max(s.id + 1);
            b.sagas.insert(s.id, s);
        }
        b
    }

    pub fn data(&self) -> SagaBookData {
        SagaBookData {
            next_saga_id: self.next_saga_id,
            definitions: self.definitions.values().cloned().collect(),
            sagas: self.sagas.values().cloned().collect(),
            query_failures: self.query_failures.iter().map(|(id, n)| (*id, *n)).collect(),
        }
    }

    pub fn from_data(d: SagaBookData) -> SagaBook {
        SagaBook::from_parts(d.next_saga_id, d.definitions, d.sagas).with_query_failures(d.query_failures)
    }

    /// With the counts of failed status queries (as persisted); counts of
    /// sagas the book does not hold, and zeros, are dropped.
    pub fn with_query_failures(mut self, counts: impl IntoIterator<Item = (SagaId, u32)>) -> SagaBook {
        for (id, n) in counts {
            if n > 0 && self.sagas.contains_key(&id) {
                self.query_failures.insert(id, n);
            }
        }
        self
    }

    /// How many status queries of saga `id` failed in a row (see
    /// `JournalEvent::QueryFailed`).
    pub fn query_failures(&self, id: SagaId) -> u32 {
        self.query_failures.get(&id).copied().unwrap_or(0)
    }

    pub fn next_saga_id(&self) -> SagaId {
        self.next_saga_id.max(1)
    }

    pub fn get(&self, id: SagaId) -> Option<&SagaRecord> {
        self.sagas.get(&id)
    }

    pub fn definition(&self, name: &str, version: u32) -> Option<&Definition> {
        self.definitions.get(&(name.to_string(), version))
    }

    pub fn definitions(&self) -> impl Iterator<Item = &Definition> {
        self.definitions.values()
    }

    pub fn sagas(&self) -> impl Iterator<Item = &SagaRecord> {
        self.sagas.values()
    }

    pub fn sagas_after(&self, after: SagaId) -> impl Iterator<Item = &SagaRecord> {
        self.sagas.range(after.saturating_add(1)..).map(|(_, s)| s)
    }

    /// A page of sagas: those above `after` that `keep` accepts, in id
    /// order, at most `limit`; and the id to list on after (0: nothing
    /// follows). The listing of `ListSagas` and the console.
    pub fn list(&self, after: SagaId, limit: usize, keep: impl Fn(&SagaRecord) -> bool) -> (Vec<&SagaRecord>, SagaId) {
        let mut out = Vec::new();
        for s in self.sagas_after(after).filter(|s| keep(s)) {
            if out.len() == limit {
                let last = out.last().map_or(0, |l: &&SagaRecord| l.id);
                return (out, last);
            }
            out.push(s);
        }
        (out, 0)
    }

    /// The sagas the orchestrator drives (RUNNING or COMPENSATING).
    pub fn driven(&self) -> Vec<SagaId> {
        self.sagas.values().filter(|s| s.state.driven()).map(|s| s.id).collect()
    }

    pub fn count_in(&self, state: SagaState) -> usize {
        self.sagas.values().filter(|s| s.state == state).count()
    }

    pub fn apply(&mut self, cmd: &SagaCommand, effects: &mut Vec<SagaEffect>) -> Result<SagaOk, SagaError> {
        match cmd {
            SagaCommand::Register { definition } => self.register(definition, effects),
            SagaCommand::Start {
                idempotency_key,
                fingerprint,
                definition,
                version,
                input,
                authorization,
                owner,
                now_ms,
                deadline_ms,
            } => self.start(
                idempotency_key,
                fingerprint,
                (definition, *version),
                input,
                authorization,
                owner.clone(),
                (*now_ms, *deadline_ms),
                effects,
            ),
            SagaCommand::Journal {
                saga_id,
                seq,
                now_ms,
                event,
            } => self.journal(*saga_id, *seq, *now_ms, event, effects),
            SagaCommand::Operate {
                saga_id,
                action,
                who,
                why,
                now_ms,
            } => self.operate(*saga_id, *action, who, why, *now_ms, effects),
            SagaCommand::Forget {
                saga_id,
                ended_before_ms,
            } => self.forget(*saga_id, *ended_before_ms, effects),
            SagaCommand::Complete {
                saga_id,
                step,
                operation_id,
                reply,
                who,
                now_ms,
            } => self.complete(*saga_id, *step, operation_id, reply, who, *now_ms, effects),
        }
    }

    fn forget(&mut self, id: SagaId, ended_before_ms: u64, effects: &mut Vec<SagaEffect>) -> Result<SagaOk, SagaError> {
        let Some(r) = self.sagas.get(&id) else {
            return Ok(SagaOk::Forgotten { removed: false });
        };
        if !r.state.ended() {
            return Err(SagaError::WrongState {
                saga_id: id,
                state: r.state.name().into(),
                what: "only an ended saga (COMPLETED or COMPENSATED) is forgotten".into(),
            });
        }
        if r.ended_at_ms > ended_before_ms {
            return Err(SagaError::Refused {
                saga_id: id,
                step: r.current,
                what: format!(
                    "it ended at {} ms, after {ended_before_ms} ms: its retention has not passed",
                    r.ended_at_ms
                ),
            });
        }
        let key = r.idempotency_key.clone();
        self.sagas.remove(&id);
        self.keys.remove(&key);
        self.query_failures.remove(&id);
        effects.push(SagaEffect::Remove(id));
        Ok(SagaOk::Forgotten { removed: true })
    }

    /// Ended sagas whose end is at or before `ended_before_ms`, lowest ids
    /// first, at most `max`.
    pub fn forgettable(&self, ended_before_ms: u64, max: usize) -> Vec<SagaId> {
        self.sagas
            .values()
            .filter(|s| s.state.ended() && s.ended_at_ms <= ended_before_ms)
            .take(max)
            .map(|s| s.id)
            .collect()
    }

    /// The definition saga `rec` runs (registered definitions are never
    /// removed, so it is there).
    fn definition_of(&self, rec: &SagaRecord) -> Result<Definition, SagaError> {
        self.definition(&rec.definition, rec.version)
            .cloned()
            .ok_or_else(|| SagaError::UnknownDefinition {
                name: rec.definition.clone(),
                version: rec.version,
            })
    }

    fn register(&mut self, d: &Definition, effects: &mut Vec<SagaEffect>) -> Result<SagaOk, SagaError> {
        d.validate().map_err(SagaError::InvalidDefinition)?;
        let k = (d.name.clone(), d.version);
        if let Some(old) = self.definitions.get(&k) {
            if old == d {
                return Ok(SagaOk::Registered { created: false });
            }
            return Err(SagaError::DefinitionConflict {
                name: d.name.clone(),
                version: d.version,
            });
        }
        self.definitions.insert(k, d.clone());
        effects.push(SagaEffect::Definition(d.name.clone(), d.version));
        Ok(SagaOk::Registered { created: true })
    }

    #[allow(clippy::too_many_arguments)]
    fn start(
        &mut self,
        key: &str,
        fingerprint: &[u8; 32],
        (name, version): (&str, u32),
        input: &[u8],
        authorization: &Authorization,
        owner: Option<String>,
        (now_ms, deadline_ms): (u64, u64),
        effects: &mut Vec<SagaEffect>,
    ) -> Result<SagaOk, SagaError> {
        if key.is_empty() || key.len() > limits::ID_BYTES_MAX {
            return Err(SagaError::Invalid(format!(
                "idempotency_key must be 1 to {} bytes",
                limits::ID_BYTES_MAX
            )));
        }
        if input.len() > limits::PAYLOAD_BYTES_MAX {
            return Err(SagaError::Invalid(format!(
                "input is {} bytes; the limit is {} bytes",
                input.len(),
                limits::PAYLOAD_BYTES_MAX
            )));
        }
        if let Some(&id) = self.keys.get(key) {
            let s = &self.sagas[&id];
            if &s.request_fingerprint == fingerprint {
                return Ok(SagaOk::Started {
                    saga_id: id,
                    created: false,
                });
            }
            return Err(SagaError::KeyConflict {
                key: key.to_string(),
                saga_id: id,
            });
        }
        let Some(def) = self.definition(name, version) else {
            return Err(SagaError::UnknownDefinition {
                name: name.to_string(),
                version,
            });
        };
        let id = self.next_saga_id();
        let steps = def
            .steps
            .iter()
            .enumerate()
            .map(|(i, s)| StepJournal {
                fingerprint: step_fingerprint(name, version, i as u32, input),
                compensation_ref: s
                    .compensation
                    .as_ref()
                    .map(|c| format!("{}:{c}", def.label()))
                    .unwrap_or_default(),
                ..StepJournal::default()
            })
            .collect();
        let rec = SagaRecord {
            id,
            definition: name.to_string(),
            version,
            idempotency_key: key.to_string(),
            request_fingerprint: *fingerprint,
            input: input.to_vec(),
            authorization: authorization.clone(),
            owner,
            state: SagaState::Running,
            current: 0,
            parked_reason: String::new(),
            parked_from: None,
            started_at_ms: now_ms,
            ended_at_ms: 0,
            steps,
            operator_actions: Vec::new(),
            seq: 0,
            past_pivot: false,
            deadline_at_ms: if deadline_ms == 0 {
                0
            } else {
                now_ms.saturating_add(deadline_ms)
            },
            cancel_reason: String::new(),
            awaiting_approval: None,
        };
        self.next_saga_id = id + 1;
        self.keys.insert(key.to_string(), id);
        self.sagas.insert(id, rec);
        effects.push(SagaEffect::Put(id));
        Ok(SagaOk::Started {
            saga_id: id,
            created: true,
        })
    }

    fn journal(
        &mut self,
        id: SagaId,
        seq: u64,
        now_ms: u64,
        ev: &JournalEvent,
        effects: &mut Vec<SagaEffect>,
    ) -> Result<SagaOk, SagaError> {
        let Some(rec) = self.sagas.get(&id) else {
            return Err(SagaError::NotFound(id));
        };
        if rec.seq != seq {
            return Err(SagaError::StaleJournal {
                saga_id: id,
                planned: seq,
                actual: rec.seq,
            });
        }
        if !rec.state.driven() {
            return Err(SagaError::WrongState {
                saga_id: id,
                state: rec.state.name().into(),
                what: "only a RUNNING or COMPENSATING saga takes journal writes".into(),
            });
        }
        let def = self.definition_of(rec)?;
        // Work on a copy: a refused write changes nothing.
        let mut r = rec.clone();
        apply_event(&mut r, &def, now_ms, ev)?;
        r.seq += 1;
        let out = SagaOk::Journaled {
            seq: r.seq,
            state: r.state,
        };
        self.sagas.insert(id, r);
        if matches!(ev, JournalEvent::QueryFailed { .. }) {
            *self.query_failures.entry(id).or_default() += 1;
        } else {
            self.query_failures.remove(&id);
        }
        effects.push(SagaEffect::Put(id));
        Ok(out)
    }

    fn operate(
        &mut self,
        id: SagaId,
        action: OperatorAction,
        who: &str,
        why: &str,
        now_ms: u64,
        effects: &mut Vec<SagaEffect>,
    ) -> Result<SagaOk, SagaError> {
        let Some(rec) = self.sagas.get(&id) else {
            return Err(SagaError::NotFound(id));
        };
        if who.is_empty() || why.is_empty() {
            return Err(SagaError::Invalid(
                "an operator's action records who and why: both must be given".into(),
            ));
        }
        if action == OperatorAction::Cancel {
            return self.cancel(id, who, why, now_ms, effects);
        }
        if rec.state != SagaState::Parked {
            return Err(SagaError::WrongState {
                saga_id: id,
                state: rec.state.name().into(),
                what: format!("only a PARKED saga takes an operator's {}", action.name()),
            });
        }
        let def = self.definition_of(rec)?;
        let mut r = rec.clone();
        let from = r.parked_from.unwrap_or(SagaState::Running);
        let step = r.current;
        // Whatever the operator does, the saga no longer waits for an
        // approval (approving is one of the ways out).
        let awaiting = r.awaiting_approval.take();
        match action {
            OperatorAction::Approve => {
                if awaiting != Some(step) {
                    return Err(SagaError::WrongState {
                        saga_id: id,
                        state: "PARKED".into(),
                        what: "it does not wait for an approval: approve is only for a high-impact compensation".into(),
                    });
                }
                r.steps[step as usize].approved_by = who.to_string();
                r.parked_reason.clear();
                r.parked_from = None;
                r.state = SagaState::Compensating;
            }
            OperatorAction::Retry if awaiting.is_some() => {
                return Err(SagaError::WrongState {
                    saga_id: id,
                    state: "PARKED for an approval".into(),
                    what: format!(
                        "the compensation of step {step} ({:?}) waits for an approval: approve it, skip it, or mark the saga compensated",
                        def.steps[step as usize].name
                    ),
                });
            }
            OperatorAction::Retry => {
                r.state = from;
                r.parked_reason.clear();
                r.parked_from = None;
                let call = if from == SagaState::Compensating {
                    r.steps[step as usize].compensation.as_mut()
                } else {
                    r.steps[step as usize].forward.as_mut()
                };
                let tag = if from == SagaState::Compensating { 'c' } else { 'f' };
                if let Some(c) = call {
                    // A fresh attempt budget; a FAILED or STALE call needs a
                    // new operation id (the service remembers the old one's
                    // answer).
                    if matches!(c.outcome(), CallOutcome::Failed | CallOutcome::Stale) {
                        *c = c.next_generation(id, step, tag, 1, now_ms);
                    } else {
                        c.attempts = 0;
                    }
                    // A PENDING call waits again, its completion timeout
                    // counted from now.
                    if c.outcome() == CallOutcome::Pending {
                        c.outcome_at_ms = now_ms;
                    }
                }
            }
            OperatorAction::Skip => {
                r.parked_reason.clear();
                r.parked_from = None;
                if from == SagaState::Compensating {
                    let j = &mut r.steps[step as usize];
                    let c = j
                        .compensation
                        .get_or_insert_with(|| Call::new(id, step, 'c', 1, 0, now_ms));
                    c.settle_unknown(now_ms, false);
                    c.outcome = Some(CallOutcome::Skipped);
                    c.outcome_at_ms = now_ms;
                    if j.residual.is_empty() {
                        j.residual = format!("compensation skipped by operator {who}: {why}");
                    }
                    r.state = SagaState::Compensating;
                    next_compensation(&mut r, &def, step.checked_sub(1), now_ms);
                } else {
                    let c = r.steps[step as usize]
                        .forward
                        .get_or_insert_with(|| Call::new(id, step, 'f', 1, 0, now_ms));
                    c.settle_unknown(now_ms, false);
                    c.outcome = Some(CallOutcome::Skipped);
                    c.outcome_at_ms = now_ms;
                    r.state = SagaState::Running;
                    advance(&mut r, &def, now_ms);
                }
            }
            OperatorAction::Compensate => {
                if let Some(why) = beyond_return(&r, &def) {
                    return Err(SagaError::WrongState {
                        saga_id: id,
                        state: why,
                        what: "past its point of no return a saga only goes forward; retry, skip or mark it complete"
                            .into(),
                    });
                }
                if from == SagaState::Compensating {
                    return Err(SagaError::WrongState {
                        saga_id: id,
                        state: "PARKED while compensating".into(),
                        what: "it is compensating already; retry or skip the compensation".into(),
                    });
                }
                r.parked_reason.clear();
                r.parked_from = None;
                r.state = SagaState::Compensating;
                next_compensation(&mut r, &def, Some(step), now_ms);
            }
            OperatorAction::Cancel => unreachable!("a cancel is handled above"),
            OperatorAction::MarkComplete => {
                // Finished by hand: forward (COMPLETED), or the undoing
                // (COMPENSATED) when it parked while compensating.
                r.parked_reason.clear();
                r.parked_from = None;
                r.state = if from == SagaState::Compensating {
                    SagaState::Compensated
                } else {
                    SagaState::Completed
                };
                r.ended_at_ms = now_ms;
            }
        }
        Ok(self.record_operated(r, action, who, why, now_ms, step, effects))
    }

    /// `SagaCommand::Complete`: the end of a PENDING forward call.
    #[allow(clippy::too_many_arguments)]
    fn complete(
        &mut self,
        id: SagaId,
        step: u32,
        operation_id: &str,
        reply: &Reply,
        who: &str,
        now_ms: u64,
        effects: &mut Vec<SagaEffect>,
    ) -> Result<SagaOk, SagaError> {
        let Some(rec) = self.sagas.get(&id) else {
            return Err(SagaError::NotFound(id));
        };
        if who.is_empty() || who.len() > limits::ID_BYTES_MAX {
            return Err(SagaError::Invalid(format!(
                "a completion records who completed it: 1 to {} bytes",
                limits::ID_BYTES_MAX
            )));
        }
        if !matches!(reply.outcome, CallOutcome::Ok | CallOutcome::Failed) {
            return Err(SagaError::Invalid(format!(
                "a step completes OK or FAILED, not {}",
                reply.outcome.name()
            )));
        }
        check_reply(rec, step, reply, &[CallOutcome::Ok, CallOutcome::Failed])?;
        let Some(fwd) = rec.step(step).and_then(|j| j.forward.as_ref()) else {
            return Err(refused(rec, step, "no forward call of this step was made"));
        };
        if fwd.operation_id != operation_id {
            return Err(refused(
                rec,
                step,
                format!(
                    "operation {operation_id:?} is not the step's forward call (that is {:?})",
                    fwd.operation_id
                ),
            ));
        }
        // Completed before: the same completion again is answered as it
        // was; another one cannot change what is journaled.
        if !fwd.completed_by.is_empty() {
            if fwd.outcome() == reply.outcome && fwd.output == reply.output {
                return Ok(SagaOk::Completed {
                    state: rec.state,
                    changed: false,
                });
            }
            return Err(refused(
                rec,
                step,
                format!(
                    "operation {operation_id:?} was completed {} by {} already",
                    fwd.outcome().name(),
                    fwd.completed_by
                ),
            ));
        }
        // Waiting at the step: RUNNING, or PARKED from running there (its
        // completion timeout passed: a late completion still ends it).
        let waiting = rec.current == step
            && (rec.state == SagaState::Running
                || (rec.state == SagaState::Parked && rec.parked_from == Some(SagaState::Running)));
        if !waiting {
            return Err(SagaError::WrongState {
                saga_id: id,
                state: rec.state.name().into(),
                what: format!(
                    "it no longer waits for step {step} (it is at step {}): the completion is refused and changes nothing",
                    rec.current
                ),
            });
        }
        if !matches!(
            fwd.outcome(),
            CallOutcome::Pending | CallOutcome::Intended | CallOutcome::Unknown
        ) {
            return Err(refused(
                rec,
                step,
                format!(
                    "its forward call is {}: only a PENDING (or not yet answered) call is completed",
                    fwd.outcome().name()
                ),
            ));
        }
        let def = self.definition_of(rec)?;
        let mut r = rec.clone();
        if r.state == SagaState::Parked {
            r.state = SagaState::Running;
            r.parked_reason.clear();
            r.parked_from = None;
        }
        let c = r.steps[step as usize].forward.as_mut().expect("checked above");
        c.record(reply, now_ms);
        c.completed_by = who.to_string();
        if reply.outcome == CallOutcome::Ok {
            r.steps[step as usize].precondition = c.resource_version.clone();
            advance(&mut r, &def, now_ms);
        }
        r.seq += 1;
        let state = r.state;
        self.sagas.insert(id, r);
        self.query_failures.remove(&id);
        effects.push(SagaEffect::Put(id));
        Ok(SagaOk::Completed { state, changed: true })
    }

    /// Records an operator's action on `r` (its entry, the journal's next
    /// sequence number) and stores the record: what every accepted action
    /// ends with.
    #[allow(clippy::too_many_arguments)]
    fn record_operated(
        &mut self,
        mut r: SagaRecord,
        action: OperatorAction,
        who: &str,
        why: &str,
        now_ms: u64,
        step: u32,
        effects: &mut Vec<SagaEffect>,
    ) -> SagaOk {
        r.operator_actions.push(OperatorEntry {
            action,
            who: who.to_string(),
            why: why.to_string(),
            at_ms: now_ms,
            step,
        });
        r.seq += 1;
        let id = r.id;
        let state = r.state;
        self.sagas.insert(id, r);
        self.query_failures.remove(&id);
        effects.push(SagaEffect::Put(id));
        SagaOk::Operated { state }
    }
}

impl SagaBook {
    /// A cancel: a RUNNING saga (or one PARKED while running) before its
    /// point of no return starts compensating from its current step (whose
    /// forward call, if it may have happened, is asked about and fenced
    /// before anything is undone, as for every compensation). A saga
    /// already cancelled answers as it is and changes nothing (a repeated
    /// cancel, a client's retry).
    fn cancel(
        &mut self,
        id: SagaId,
        who: &str,
        why: &str,
        now_ms: u64,
        effects: &mut Vec<SagaEffect>,
    ) -> Result<SagaOk, SagaError> {
        let rec = &self.sagas[&id];
        let from = match rec.state {
            SagaState::Parked => rec.parked_from.unwrap_or(SagaState::Running),
            s => s,
        };
        // Stopped already (by a cancel or its deadline): what was asked
        // for is under way or done.
        if !rec.cancel_reason.is_empty() && from != SagaState::Running {
            return Ok(SagaOk::Operated { state: rec.state });
        }
        if from != SagaState::Running {
            let state = if rec.state == SagaState::Parked {
                "PARKED while compensating".to_string()
            } else {
                rec.state.name().to_string()
            };
            return Err(SagaError::WrongState {
                saga_id: id,
                state,
                what: "only a RUNNING saga (or one PARKED while running) can be cancelled".into(),
            });
        }
        let def = self.definition_of(rec)?;
        if let Some(state) = beyond_return(rec, &def) {
            return Err(SagaError::WrongState {
                saga_id: id,
                state,
                what: "a saga past its point of no return cannot be cancelled: it only goes forward".into(),
            });
        }
        let mut r = rec.clone();
        let step = r.current;
        r.parked_reason.clear();
        r.parked_from = None;
        r.cancel_reason = format!("cancelled by {who}: {why}");
        r.state = SagaState::Compensating;
        next_compensation(&mut r, &def, Some(step), now_ms);
        Ok(self.record_operated(r, OperatorAction::Cancel, who, why, now_ms, step, effects))
    }
}

/// Why saga `r` may no longer be compensated (it passed its point of no
/// return), if it may not; `None`: a cancel or its deadline may still
/// turn it back.
pub fn point_of_no_return(r: &SagaRecord, def: &Definition) -> Option<String> {
    beyond_return(r, def)
}

fn refused(r: &SagaRecord, step: u32, what: impl fmt::Display) -> SagaError {
    SagaError::Refused {
        saga_id: r.id,
        step,
        what: what.to_string(),
    }
}

/// Why the saga may no longer be compensated, if it may not: it passed its
/// pivot, or a step that cannot be undone (the pivot, or a RETRIABLE step
/// of a saga without one) may have happened (its outcome OK, UNKNOWN or
/// only intended: a compensation then would leave it done).
fn beyond_return(r: &SagaRecord, def: &Definition) -> Option<String> {
    if r.past_pivot {
        return Some("past its pivot".into());
    }
    for (i, (sd, j)) in def.steps.iter().zip(&r.steps).enumerate() {
        // Undoable, or nothing to undo.
        if matches!(sd.kind, StepKind::Compensable | StepKind::ReadOnly) {
            continue;
        }
        if let Some(c) = j.forward.as_ref().filter(|c| c.outcome().may_have_happened()) {
            return Some(format!(
                "past its point of no return: step {i} ({:?}, {}) is {}",
                sd.name,
                sd.kind.name(),
                c.outcome().name()
            ));
        }
    }
    None
}

fn park(r: &mut SagaRecord, reason: &str) {
    r.parked_from = Some(r.state);
    r.state = SagaState::Parked;
    r.parked_reason = reason.to_string();
}

/// After step `r.current` went forward (OK or skipped): the next step, or
/// COMPLETED.
fn advance(r: &mut SagaRecord, def: &Definition, now_ms: u64) {
    if def.steps[r.current as usize].kind == StepKind::Pivot {
        r.past_pivot = true;
    }
    if (r.current as usize) + 1 >= def.steps.len() {
        r.state = SagaState::Completed;
        r.ended_at_ms = now_ms;
    } else {
        r.current += 1;
    }
}

/// Moves a COMPENSATING saga to the newest step at or below `from` that
/// may need undoing (a COMPENSABLE step whose forward action may have
/// happened and whose compensation is not done), or ends it COMPENSATED.
fn next_compensation(r: &mut SagaRecord, def: &Definition, from: Option<u32>, now_ms: u64) {
    let mut j = from;
    while let Some(i) = j {
        let s = &r.steps[i as usize];
        let may = s.forward.as_ref().is_some_and(|c| c.outcome().may_have_happened());
        let done = s
            .compensation
            .as_ref()
            .is_some_and(|c| matches!(c.outcome(), CallOutcome::Ok | CallOutcome::Noop | CallOutcome::Skipped));
        if def.steps[i as usize].kind == StepKind::Compensable && may && !done {
            r.current = i;
            return;
        }
        j = i.checked_sub(1);
    }
    r.state = SagaState::Compensated;
    r.ended_at_ms = now_ms;
}

fn apply_event(r: &mut SagaRecord, def: &Definition, now_ms: u64, ev: &JournalEvent) -> Result<(), SagaError> {
    let id = r.id;
    let check_step = |r: &SagaRecord, step: u32, want: SagaState| -> Result<(), SagaError> {
        if r.state != want {
            return Err(SagaError::WrongState {
                saga_id: id,
                state: r.state.name().into(),
                what: format!("this write needs it {}", want.name()),
            });
        }
        if step != r.current {
            return Err(refused(r, step, format!("the saga is at step {}", r.current)));
        }
        Ok(())
    };
    match ev {
        JournalEvent::ForwardIntent { step } => {
            check_step(r, *step, SagaState::Running)?;
            let max = def.steps[*step as usize].retry.max_attempts;
            let j = &mut r.steps[*step as usize];
            match j.forward.as_mut() {
                None => j.forward = Some(Call::new(id, *step, 'f', 1, 1, now_ms)),
                Some(c) if c.outcome().unsettled() => {
                    if c.attempts >= max {
                        return Err(refused(r, *step, format!("the forward call had its {max} attempts")));
                    }
                    // A status query found it not applied: settle the
                    // UNKNOWN spell, call again under the same key.
                    c.settle_unknown(now_ms, true);
                    c.outcome = Some(CallOutcome::Intended);
                    c.attempts += 1;
                    c.intent_at_ms = now_ms;
                }
                Some(c) => {
                    let o = c.outcome();
                    return Err(refused(
                        r,
                        *step,
                        format!("the forward call is {}: a new intent needs a recovery choice", o.name()),
                    ));
                }
            }
            if j.compensation_ref.is_empty() {
                if let Some(c) = &def.steps[*step as usize].compensation {
                    j.compensation_ref = format!("{}:{c}", def.label());
                }
            }
        }
        JournalEvent::ForwardOutcome { step, reply } => {
            check_step(r, *step, SagaState::Running)?;
            check_reply(
                r,
                *step,
                reply,
                &[
                    CallOutcome::Ok,
                    CallOutcome::Failed,
                    CallOutcome::Unknown,
                    CallOutcome::Pending,
                ],
            )?;
            let j = &mut r.steps[*step as usize];
            let Some(c) = j.forward.as_mut().filter(|c| c.outcome().unsettled()) else {
                return Err(refused(r, *step, "no forward call is waiting for an outcome"));
            };
            c.record(reply, now_ms);
            if reply.outcome == CallOutcome::Ok {
                j.precondition = c.resource_version.clone();
                advance(r, def, now_ms);
            }
        }
        JournalEvent::Recover { step, option, reason } => {
            check_step(r, *step, SagaState::Running)?;
            let sd = &def.steps[*step as usize];
            let failed = r.steps[*step as usize]
                .forward
                .as_ref()
                .is_some_and(|c| c.outcome() == CallOutcome::Failed);
            if !failed {
                return Err(refused(r, *step, "recovery is chosen only for a FAILED forward call"));
            }
            if !sd.recovery().contains(option) {
                return Err(refused(
                    r,
                    *step,
                    format!(
                        "{} is not among the recovery options the definition registered for step {:?}",
                        option.name(),
                        sd.name
                    ),
                ));
            }
            match option {
                Recovery::Retry => {
                    let c = r.steps[*step as usize].forward.as_mut().expect("checked above");
                    if c.attempts >= sd.retry.max_attempts {
                        return Err(refused(
                            r,
                            *step,
                            format!("the forward call had its {} attempts", sd.retry.max_attempts),
                        ));
                    }
                    *c = c.next_generation(id, *step, 'f', c.attempts + 1, now_ms);
                }
                Recovery::Compensate => {
                    if let Some(why) = beyond_return(r, def) {
                        return Err(refused(r, *step, format!("the saga only goes forward: it is {why}")));
                    }
                    r.state = SagaState::Compensating;
                    next_compensation(r, def, step.checked_sub(1), now_ms);
                }
                Recovery::Park => {
                    if reason.is_empty() {
                        return Err(SagaError::Invalid("a saga parks with its reason".into()));
                    }
                    park(r, reason)
                }
            }
        }
        JournalEvent::CompensationIntent { step } => {
            check_step(r, *step, SagaState::Compensating)?;
            let sd = &def.steps[*step as usize];
            if sd.high_impact && r.steps[*step as usize].approved_by.is_empty() {
                return Err(refused(
                    r,
                    *step,
                    format!(
                        "the compensation of {:?} is high-impact: it runs only after an approval",
                        sd.name
                    ),
                ));
            }
            let max = sd.retry.max_attempts;
            let j = &mut r.steps[*step as usize];
            match j.compensation.as_mut() {
                None => j.compensation = Some(Call::new(id, *step, 'c', 1, 1, now_ms)),
                Some(c) if c.outcome().unsettled() || c.outcome() == CallOutcome::Failed => {
                    if c.attempts >= max {
                        return Err(refused(r, *step, format!("the compensation had its {max} attempts")));
                    }
                    if c.outcome() == CallOutcome::Failed {
                        *c = c.next_generation(id, *step, 'c', c.attempts + 1, now_ms);
                    } else {
                        c.settle_unknown(now_ms, true);
                        c.outcome = Some(CallOutcome::Intended);
                        c.attempts += 1;
                        c.intent_at_ms = now_ms;
                    }
                }
                Some(c) => {
                    let o = c.outcome();
                    return Err(refused(r, *step, format!("the compensation is {}", o.name())));
                }
            }
        }
        JournalEvent::CompensationOutcome { step, reply } => {
            check_step(r, *step, SagaState::Compensating)?;
            check_reply(
                r,
                *step,
                reply,
                &[
                    CallOutcome::Ok,
                    CallOutcome::Noop,
                    CallOutcome::Failed,
                    CallOutcome::Stale,
                    CallOutcome::Unknown,
                ],
            )?;
            let j = &mut r.steps[*step as usize];
            let Some(c) = j.compensation.as_mut().filter(|c| c.outcome().unsettled()) else {
                return Err(refused(r, *step, "no compensation is waiting for an outcome"));
            };
            c.record(reply, now_ms);
            if !reply.residual.is_empty() {
                j.residual = reply.residual.clone();
            }
            match reply.outcome {
                CallOutcome::Ok | CallOutcome::Noop => next_compensation(r, def, step.checked_sub(1), now_ms),
                CallOutcome::Stale => {
                    if j.residual.is_empty() {
                        j.residual = format!("not undone: {}", reply.reason);
                    }
                    let why = format!(
                        "step {step} ({:?}): compensation refused, the resource's version moved on since the forward action: {}",
                        def.steps[*step as usize].name, reply.reason
                    );
                    park(r, &why);
                }
                _ => {}
            }
        }
        JournalEvent::Park { reason } => {
            if reason.is_empty() {
                return Err(SagaError::Invalid("a saga parks with its reason".into()));
            }
            park(r, reason);
        }
        JournalEvent::DeadlinePassed { reason } => {
            if r.state != SagaState::Running {
                return Err(SagaError::WrongState {
                    saga_id: id,
                    state: r.state.name().into(),
                    what: "only a RUNNING saga is stopped by its deadline".into(),
                });
            }
            if !r.past_deadline(now_ms) {
                return Err(refused(
                    r,
                    r.current,
                    format!("its deadline is {} ms, not passed at {now_ms} ms", r.deadline_at_ms),
                ));
            }
            if let Some(why) = beyond_return(r, def) {
                return Err(refused(
                    r,
                    r.current,
                    format!("its deadline passed, but it is {why}: it only goes forward"),
                ));
            }
            if reason.is_empty() || reason.len() > limits::REASON_BYTES_MAX {
                return Err(SagaError::Invalid(format!(
                    "a deadline's reason must be 1 to {} bytes",
                    limits::REASON_BYTES_MAX
                )));
            }
            r.cancel_reason = reason.clone();
            r.state = SagaState::Compensating;
            next_compensation(r, def, Some(r.current), now_ms);
        }
        JournalEvent::AwaitApproval { step, reason } => {
            check_step(r, *step, SagaState::Compensating)?;
            let j = &r.steps[*step as usize];
            if j.compensation.is_some() || !j.approved_by.is_empty() {
                return Err(refused(
                    r,
                    *step,
                    "its compensation was approved or started already: nothing to wait for",
                ));
            }
            if reason.is_empty() || reason.len() > limits::REASON_BYTES_MAX {
                return Err(SagaError::Invalid(format!(
                    "an approval's reason must be 1 to {} bytes",
                    limits::REASON_BYTES_MAX
                )));
            }
            park(r, reason);
            r.awaiting_approval = Some(*step);
        }
        JournalEvent::QueryFailed { step, error } => {
            if *step != r.current {
                return Err(refused(r, *step, format!("the saga is at step {}", r.current)));
            }
            if error.len() > limits::REASON_BYTES_MAX {
                return Err(SagaError::Invalid(format!(
                    "error is {} bytes; the limit is {} bytes",
                    error.len(),
                    limits::REASON_BYTES_MAX
                )));
            }
        }
    }
    Ok(())
}

fn check_reply(r: &SagaRecord, step: u32, reply: &Reply, allowed: &[CallOutcome]) -> Result<(), SagaError> {
    if !allowed.contains(&reply.outcome) {
        return Err(refused(
            r,
            step,
            format!("{} is not an outcome of this call", reply.outcome.name()),
        ));
    }
    for (field, v) in [
        ("reason", &reply.reason),
        ("residual", &reply.residual),
        ("downstream_operation_id", &reply.downstream_operation_id),
        ("resource_version", &reply.resource_version),
    ] {
        if v.len() > limits::REASON_BYTES_MAX {
            return Err(SagaError::Invalid(format!(
                "{field} is {} bytes; the limit is {} bytes",
                v.len(),
                limits::REASON_BYTES_MAX
            )));
        }
    }
    check_output(reply)
}

/// A reply's output fits `limits::SAGA_STEP_OUTPUT_BYTES_MAX`, and only
/// an OK carries one.
fn check_output(reply: &Reply) -> Result<(), SagaError> {
    if reply.output.len() > limits::SAGA_STEP_OUTPUT_BYTES_MAX {
        return Err(SagaError::Invalid(format!(
            "the step's output is {} bytes; the limit is saga_step_output_bytes_max = {} bytes",
            reply.output.len(),
            limits::SAGA_STEP_OUTPUT_BYTES_MAX
        )));
    }
    if !reply.output.is_empty() && reply.outcome != CallOutcome::Ok {
        return Err(SagaError::Invalid(format!(
            "only an OK carries an output, not {}",
            reply.outcome.name()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
