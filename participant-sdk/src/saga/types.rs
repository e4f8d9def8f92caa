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
        }
    }
}

impl StepCall {
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
        }
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
        }
    }

    /// The outcome's name, for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            StepResult::Ok { .. } => "ok",
            StepResult::Failed { .. } => "failed",
            StepResult::Noop { .. } => "noop",
            StepResult::Stale { .. } => "stale",
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
            } => {
                r.resource_version = resource_version.clone();
                r.downstream_operation_id = downstream_operation_id.clone();
                r.residual = residual.clone();
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
