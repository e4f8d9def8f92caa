//! The saga step protocol's data as the SDK sees it: a call
//! ([`StepCall`], with its rights, [`Authorization`]), its answer
//! ([`StepResult`]), the inbox record of an answered operation
//! ([`StepRecord`], [`CallKind`]), and why a call got no answer
//! ([`StepError`]).

use dtx_proto::v1 as pb;

use crate::participant::StoreError;

/// The rights a saga runs with (`dtx.v1.SagaAuthorization`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Authorization {
    pub principal: String,
    pub tenant: String,
    /// Unix ms after which these rights may no longer be used; 0: never.
    pub expires_at_ms: u64,
    pub policy: String,
}

impl Authorization {
    /// True when the rights have expired at `now_ms`.
    pub fn expired_at(&self, now_ms: u64) -> bool {
        self.expires_at_ms != 0 && now_ms >= self.expires_at_ms
    }
}

impl From<pb::SagaAuthorization> for Authorization {
    fn from(a: pb::SagaAuthorization) -> Self {
        Authorization {
            principal: a.principal,
            tenant: a.tenant,
            expires_at_ms: a.expires_at_ms,
            policy: a.policy,
        }
    }
}

impl From<Authorization> for pb::SagaAuthorization {
    fn from(a: Authorization) -> Self {
        pb::SagaAuthorization {
            principal: a.principal,
            tenant: a.tenant,
            expires_at_ms: a.expires_at_ms,
            policy: a.policy,
        }
    }
}

/// One call of a step (`dtx.v1.StepCall`): a forward action or a
/// compensation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepCall {
    pub saga_id: u64,
    pub step: u32,
    /// The idempotency key (`"<saga_id>.<step>.f"` / `".c"` from the
    /// orchestrator; any non-empty string here).
    pub operation_id: String,
    /// The forward action's or the compensation's name.
    pub action: String,
    pub input: Vec<u8>,
    pub fingerprint: String,
    /// Compensation: the resource version the forward action reported;
    /// empty for forward calls and unversioned steps.
    pub precondition: String,
    /// Compensation: the forward call's operation id.
    pub forward_operation_id: String,
    pub authorization: Authorization,
    /// The orchestrating leader's Raft term (for logs).
    pub term: u64,
    /// What the earlier steps' forward actions answered with their OK, in
    /// step order (a compensation: its own forward's too), from the saga's
    /// journal: [`StepCall::output_of`].
    pub outputs: Vec<StepOutput>,
}

/// One earlier step's output (`dtx.v1.StepOutput`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepOutput {
    pub step: u32,
    /// The step's name in the saga's definition.
    pub name: String,
    pub output: Vec<u8>,
}

impl From<pb::StepCall> for StepCall {
    fn from(c: pb::StepCall) -> Self {
        StepCall {
            saga_id: c.saga_id,
            step: c.step,
            operation_id: c.operation_id,
            action: c.action,
            input: c.input,
            fingerprint: c.fingerprint,
            precondition: c.precondition,
            forward_operation_id: c.forward_operation_id,
            authorization: c.authorization.map(Into::into).unwrap_or_default(),
            term: c.term,
            outputs: c
                .outputs
                .into_iter()
                .map(|o| StepOutput {
                    step: o.step,
                    name: o.name,
                    output: o.output,
                })
                .collect(),
        }
    }
}

impl From<StepCall> for pb::StepCall {
    fn from(c: StepCall) -> Self {
        pb::StepCall {
            saga_id: c.saga_id,
            step: c.step,
            operation_id: c.operation_id,
            action: c.action,
            input: c.input,
            fingerprint: c.fingerprint,
            precondition: c.precondition,
            forward_operation_id: c.forward_operation_id,
            authorization: Some(c.authorization.into()),
            term: c.term,
            outputs: c
                .outputs
                .into_iter()
                .map(|o| pb::StepOutput {
                    step: o.step,
                    name: o.name,
                    output: o.output,
                })
                .collect(),
        }
    }
}

impl StepCall {
    /// The output of the earlier step named `step` (its forward action's
    /// result), if it ended OK with one.
    ///
    /// ```
    /// # use participant_sdk::saga::{StepCall, StepOutput};
    /// let call = StepCall {
    ///     outputs: vec![StepOutput { step: 0, name: "reserve".into(), output: b"r-7".to_vec() }],
    ///     ..StepCall::default()
    /// };
    /// assert_eq!(call.output_of("reserve"), Some(&b"r-7"[..]));
    /// assert_eq!(call.output_of("charge"), None);
    /// ```
    pub fn output_of(&self, step: &str) -> Option<&[u8]> {
        self.outputs
            .iter()
            .find(|o| o.name == step)
            .map(|o| o.output.as_slice())
    }

    /// The precondition rule of a compensation: `Err(Stale)` when the call
    /// carries a precondition (the version the forward action left) and
    /// the resource's `current_version` is another one (it moved on since:
    /// someone else changed it, so undoing could destroy their change).
    /// An empty precondition (an unversioned step) always holds.
    ///
    /// ```
    /// # use participant_sdk::saga::{StepCall, StepResult};
    /// let call = StepCall { precondition: "7".into(), ..StepCall::default() };
    /// assert!(call.check_precondition("7").is_ok());
    /// assert!(matches!(call.check_precondition("8"), Err(StepResult::Stale { .. })));
    /// ```
    pub fn check_precondition(&self, current_version: &str) -> Result<(), StepResult> {
        if self.precondition.is_empty() || self.precondition == current_version {
            return Ok(());
        }
        Err(StepResult::Stale {
            reason: format!(
                "the resource's version is {current_version:?}, not {:?} as the forward action left it: it moved on, so it is not undone",
                self.precondition
            ),
            residual: String::new(),
        })
    }
}

/// What a forward action or a compensation answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StepResult {
    /// Done. `resource_version`: the resource's version after it (versioned
    /// steps; the compensation's precondition). `downstream_operation_id`:
    /// the service's own id of the operation (the store fills in the
    /// operation id when empty). `residual`: for a compensation, what it
    /// could not undo (empty: everything).
    Ok {
        resource_version: String,
        downstream_operation_id: String,
        residual: String,
        /// A forward action's result, handed to the saga's later steps
        /// (`StepCall::outputs`) and journaled; at most
        /// `dtx_proto::limits::SAGA_STEP_OUTPUT_BYTES_MAX` bytes (a larger
        /// one is answered FAILED and nothing changes).
        output: Vec<u8>,
    },
    /// A forward action accepted and completed later (a callback from an
    /// outside system, a person's approval): its writes are kept, the saga
    /// waits at the step until someone completes it with the cluster
    /// (`SagaService.CompleteStep`, by the call's operation id). A
    /// repeat answers PENDING again; a compensation of it runs (it may
    /// complete, so it is undone: the compensation cancels it). Forward
    /// calls only (a compensation that answers it is recorded FAILED).
    Pending {
        note: String,
        downstream_operation_id: String,
    },
    /// Not done, and nothing changed.
    Failed { reason: String },
    /// A compensation with nothing to undo.
    Noop { reason: String },
    /// A compensation refused: the resource's version moved on; nothing
    /// changed. `residual`: what therefore stays in place.
    Stale { reason: String, residual: String },
}

impl StepResult {
    /// OK with the resource's version (empty for unversioned steps).
    pub fn ok(resource_version: impl Into<String>) -> StepResult {
        StepResult::Ok {
            resource_version: resource_version.into(),
            downstream_operation_id: String::new(),
            residual: String::new(),
            output: Vec::new(),
        }
    }

    /// This OK with `output` as the step's result (no change to another
    /// answer: only an OK carries one).
    pub fn with_output(mut self, output: impl Into<Vec<u8>>) -> StepResult {
        if let StepResult::Ok { output: o, .. } = &mut self {
            *o = output.into();
        }
        self
    }

    /// Accepted, completed later (see [`StepResult::Pending`]).
    pub fn pending(note: impl Into<String>) -> StepResult {
        StepResult::Pending {
            note: note.into(),
            downstream_operation_id: String::new(),
        }
    }

    /// The call's work happened here (OK) or was accepted and may still
    /// complete (PENDING): its writes are kept, and a compensation of it
    /// has something to undo.
    pub fn happened(&self) -> bool {
        matches!(self, StepResult::Ok { .. } | StepResult::Pending { .. })
    }

    pub fn failed(reason: impl Into<String>) -> StepResult {
        StepResult::Failed { reason: reason.into() }
    }

    pub fn noop(reason: impl Into<String>) -> StepResult {
        StepResult::Noop { reason: reason.into() }
    }

    pub fn is_ok(&self) -> bool {
        matches!(self, StepResult::Ok { .. })
    }

    pub fn outcome(&self) -> pb::StepOutcome {
        match self {
            StepResult::Ok { .. } => pb::StepOutcome::Ok,
            StepResult::Failed { .. } => pb::StepOutcome::Failed,
            StepResult::Noop { .. } => pb::StepOutcome::Noop,
            StepResult::Stale { .. } => pb::StepOutcome::Stale,
            StepResult::Pending { .. } => pb::StepOutcome::Pending,
        }
    }

    /// The outcome's name, for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            StepResult::Ok { .. } => "ok",
            StepResult::Failed { .. } => "failed",
            StepResult::Noop { .. } => "noop",
            StepResult::Stale { .. } => "stale",
            StepResult::Pending { .. } => "pending",
        }
    }

    pub fn to_reply(&self) -> pb::StepReply {
        let mut r = pb::StepReply {
            outcome: self.outcome() as i32,
            ..Default::default()
        };
        match self {
            StepResult::Ok {
                resource_version,
                downstream_operation_id,
                residual,
                output,
            } => {
                r.resource_version = resource_version.clone();
                r.downstream_operation_id = downstream_operation_id.clone();
                r.residual = residual.clone();
                r.output = output.clone();
            }
            StepResult::Pending {
                note,
                downstream_operation_id,
            } => {
                r.reason = note.clone();
                r.downstream_operation_id = downstream_operation_id.clone();
            }
            StepResult::Failed { reason } | StepResult::Noop { reason } => r.reason = reason.clone(),
            StepResult::Stale { reason, residual } => {
                r.reason = reason.clone();
                r.residual = residual.clone();
            }
        }
        r
    }

    /// The result a reply carries; `None` for an outcome a step service
    /// never answers (UNSPECIFIED, UNKNOWN, SKIPPED).
    pub fn from_reply(r: &pb::StepReply) -> Option<StepResult> {
        Some(match pb::StepOutcome::try_from(r.outcome).ok()? {
            pb::StepOutcome::Ok => StepResult::Ok {
                resource_version: r.resource_version.clone(),
                downstream_operation_id: r.downstream_operation_id.clone(),
                residual: r.residual.clone(),
                output: r.output.clone(),
            },
            pb::StepOutcome::Pending => StepResult::Pending {
                note: r.reason.clone(),
                downstream_operation_id: r.downstream_operation_id.clone(),
            },
            pb::StepOutcome::Failed => StepResult::failed(r.reason.clone()),
            pb::StepOutcome::Noop => StepResult::noop(r.reason.clone()),
            pb::StepOutcome::Stale => StepResult::Stale {
                reason: r.reason.clone(),
                residual: r.residual.clone(),
            },
            _ => return None,
        })
    }
}

/// Which call an inbox record answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallKind {
    Forward,
    Compensate,
}

impl CallKind {
    pub fn as_str(self) -> &'static str {
        match self {
            CallKind::Forward => "forward",
            CallKind::Compensate => "compensate",
        }
    }
}

/// An inbox record: what one operation id answered here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepRecord {
    pub kind: CallKind,
    pub result: StepResult,
    /// Unix ms when it was recorded.
    pub at_ms: u64,
    pub saga_id: u64,
    pub step: u32,
    pub action: String,
    pub fingerprint: String,
}

/// Why a call got no reply.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// The store could not read, write or sync (or stopped): whether the
    /// call was applied is not known to the caller (UNKNOWN); Status tells
    /// once the store answers again.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The call is malformed (empty operation id; an operation id recorded
    /// for the other kind of call); nothing was done.
    #[error("{0}")]
    Invalid(String),
    /// The operation id is recorded here for another request: a repeat
    /// whose fingerprint differs from the recorded one (the same id reused
    /// for other work: another saga's, another cluster's, or a cluster's
    /// from before a restore). Refused, nothing done, never answered with
    /// the other request's reply (FAILED_PRECONDITION).
    #[error("{0}")]
    Conflict(String),
    /// The operation's outside call is in flight and its outcome is not
    /// known here: the outside system gave no answer, or its status hook
    /// could not tell (ADR 0034). UNKNOWN to the orchestrator, never
    /// FAILED; nothing is fenced (UNAVAILABLE).
    #[error("{0}")]
    InFlight(String),
}
