//! Sagas for applications (docs/sagas.md, "Saga client"): register a
//! definition, start a saga by idempotency key, read it, wait for its end,
//! list sagas, cancel one, and the operator's actions on a parked one.
//!
//! The rules are the transaction client's ([`Client`]): every call follows
//! the leader's hint to one of the configured endpoints, retries
//! UNAVAILABLE with backoff within [`ClientConfig::call_deadline`], and a
//! write whose outcome could not be learned is [`ClientError::Unknown`],
//! never a failure: it may have been applied. Starting again with the same
//! key and request finds the same saga, so an UNKNOWN start is settled by
//! starting again. A wait that runs out answers
//! [`SagaWait::StillRunning`]: the saga goes on in the cluster whatever the
//! caller's patience.
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use dtx_client::saga::{SagaEnd, SagaWait, StartSaga};
//! use dtx_client::{Client, ClientConfig, ClientError};
//!
//! # async fn order(client: &Client) -> Result<(), ClientError> {
//! let start = StartSaga::new("order", 1, "order-7f3a", br#"{"sku":"s-1"}"#.to_vec())
//!     .with_deadline(Duration::from_secs(30));
//! // UNKNOWN: ask again with the same key; it finds the same saga.
//! let saga = loop {
//!     match client.start_saga(&start).await {
//!         Ok(s) => break s.saga_id,
//!         Err(ClientError::Unknown(_) | ClientError::NotApplied(_)) => continue,
//!         Err(e) => return Err(e),
//!     }
//! };
//! match client.wait_saga(saga, Duration::from_secs(60)).await? {
//!     SagaWait::Ended { end: SagaEnd::Completed, .. } => println!("ordered"),
//!     SagaWait::Ended { end: SagaEnd::Compensated, .. } => println!("undone"),
//!     SagaWait::Ended { end: SagaEnd::Parked, view } => println!("an operator is needed: {}", view.parked_reason),
//!     // Not a failure: it is still going; look again later.
//!     SagaWait::StillRunning { .. } => println!("still running"),
//! }
//! # Ok(())
//! # }
//! ```

use std::time::Duration;

use dtx_proto::v1 as pb;
use dtx_proto::v1::saga_service_client::SagaServiceClient;
use tokio::time::Instant;

use crate::backoff::Backoff;
use crate::backoff::Jitter;
use crate::Client;
#[cfg(doc)]
use crate::ClientConfig;
use crate::ClientError;
use crate::Kind;

/// A saga to start ([`Client::start_saga`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartSaga {
    /// The registered definition's name.
    pub definition: String,
    /// Its version.
    pub version: u32,
    /// The idempotency key: the same key with the same request finds the
    /// same saga; with another request it is refused
    /// ([`ClientError::AlreadyExists`]).
    pub idempotency_key: String,
    /// Handed to every step's forward action and compensation.
    pub input: Vec<u8>,
    /// The rights the saga runs with (checked again before every
    /// compensation); `None`: none given.
    pub authorization: Option<pb::SagaAuthorization>,
    /// Past this time after its start, a saga that has not passed its
    /// point of no return is compensated as if cancelled; `None`: no
    /// deadline. Whole milliseconds count.
    pub deadline: Option<Duration>,
}

impl StartSaga {
    /// A start of `definition`@`version` with `input`, under `idempotency_key`.
    pub fn new(definition: &str, version: u32, idempotency_key: &str, input: Vec<u8>) -> StartSaga {
        StartSaga {
            definition: definition.to_string(),
            version,
            idempotency_key: idempotency_key.to_string(),
            input,
            authorization: None,
            deadline: None,
        }
    }

    /// With the saga's rights.
    pub fn with_authorization(mut self, a: pb::SagaAuthorization) -> StartSaga {
        self.authorization = Some(a);
        self
    }

    /// With a deadline, `after` the saga's start.
    pub fn with_deadline(mut self, after: Duration) -> StartSaga {
        self.deadline = Some(after);
        self
    }

    fn to_pb(&self) -> Result<pb::StartSagaRequest, ClientError> {
        let deadline_ms = match self.deadline {
            None => 0,
            Some(d) => match u64::try_from(d.as_millis()) {
                Ok(0) | Err(_) => {
                    return Err(ClientError::InvalidArgument(format!(
                        "a saga's deadline is at least 1 ms and fits in u64 ms; {d:?} does not"
                    )))
                }
                Ok(ms) => ms,
            },
        };
        Ok(pb::StartSagaRequest {
            definition: self.definition.clone(),
            version: self.version,
            idempotency_key: self.idempotency_key.clone(),
            input: self.input.clone(),
            authorization: self.authorization.clone(),
            deadline_ms,
        })
    }
}

/// What [`Client::start_saga`] learned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SagaStarted {
    /// The saga's id.
    pub saga_id: u64,
    /// False when the key had started this saga before (a repeat).
    pub created: bool,
}

/// How a saga ended, or stopped for an operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SagaEnd {
    /// Every step done (or an operator marked it complete).
    Completed,
    /// Every step that may have happened and can be undone was undone.
    Compensated,
    /// Waiting for an operator (`parked_reason` says why). It does not go
    /// on by itself; an operator's action may still end it either way.
    Parked,
}

/// What [`Client::wait_saga`] saw.
#[derive(Debug, Clone, PartialEq)]
pub enum SagaWait {
    /// The saga ended or parked; its view then.
    Ended {
        /// Which end.
        end: SagaEnd,
        /// The saga as read.
        view: pb::SagaView,
    },
    /// The wait ran out first. Not a failure: the saga goes on (RUNNING or
    /// COMPENSATING), or it could not be read in time (`last` is `None`
    /// when no read answered). Wait again, or read it later.
    StillRunning {
        /// The last view read, if any.
        last: Option<pb::SagaView>,
        /// Why the wait stopped (the last read's error, if it failed).
        why: String,
    },
}

/// The end a saga in `state` is at, if it is at one.
pub fn end_of(state: i32) -> Option<SagaEnd> {
    match pb::SagaState::try_from(state) {
        Ok(pb::SagaState::Completed) => Some(SagaEnd::Completed),
        Ok(pb::SagaState::Compensated) => Some(SagaEnd::Compensated),
        Ok(pb::SagaState::Parked) => Some(SagaEnd::Parked),
        _ => None,
    }
}

/// Which sagas [`Client::list_sagas`] lists.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SagaFilter {
    /// Only sagas in these states; empty: every state.
    pub states: Vec<pb::SagaState>,
    /// Only sagas of this definition; empty: every definition.
    pub definition: String,
    /// Only sagas with an id above this one (paging).
    pub after_saga_id: u64,
    /// At most this many (0: the cluster's default page, 100; at most
    /// 1000).
    pub limit: u32,
}

/// One page of [`Client::list_sagas`].
#[derive(Debug, Clone, PartialEq)]
pub struct SagaPage {
    /// The sagas, in id order.
    pub sagas: Vec<pb::SagaView>,
    /// Pass as [`SagaFilter::after_saga_id`] for the next page; `None`:
    /// no more.
    pub next_after_saga_id: Option<u64>,
}

/// An action on a saga ([`Client::operate_saga`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SagaAction {
    /// A PARKED saga resumes where it parked, with a fresh attempt budget.
    Retry,
    /// The parked step is marked done (SKIPPED) and the saga goes on.
    Skip,
    /// A saga PARKED while running compensates from the parked step.
    /// Refused past the point of no return.
    Compensate,
    /// A PARKED saga ends as finished by hand.
    MarkComplete,
    /// A RUNNING saga (or one PARKED while running) stops going forward
    /// and compensates what it did, newest first ([`Client::cancel_saga`]).
    Cancel,
    /// A saga PARKED for an approval (`awaiting_approval`: its next
    /// compensation is high-impact) has that compensation approved and
    /// goes on compensating.
    Approve,
}

impl SagaAction {
    fn to_pb(self) -> pb::SagaOperatorAction {
        match self {
            SagaAction::Retry => pb::SagaOperatorAction::Retry,
            SagaAction::Skip => pb::SagaOperatorAction::Skip,
            SagaAction::Compensate => pb::SagaOperatorAction::Compensate,
            SagaAction::MarkComplete => pb::SagaOperatorAction::MarkComplete,
            SagaAction::Cancel => pb::SagaOperatorAction::Cancel,
            SagaAction::Approve => pb::SagaOperatorAction::Approve,
        }
    }

    /// The name the journal records the action under.
    pub fn journal_name(self) -> &'static str {
        match self {
            SagaAction::Retry => "retry",
            SagaAction::Skip => "skip",
            SagaAction::Compensate => "compensate",
            SagaAction::MarkComplete => "mark-complete",
            SagaAction::Cancel => "cancel",
            SagaAction::Approve => "approve",
        }
    }
}

/// How a PENDING step ended ([`Client::complete_step`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StepEnd {
    /// Done.
    Ok {
        /// The step's output, handed to the later steps (at most
        /// `dtx_proto::limits::SAGA_STEP_OUTPUT_BYTES_MAX` bytes).
        output: Vec<u8>,
    },
    /// Not done: the saga takes the step's recovery path.
    Failed {
        /// Why, recorded in the journal.
        reason: String,
    },
}

/// The first wait between two reads of [`Client::wait_saga`]; it doubles
/// up to [`WAIT_POLL_MAX`], with full jitter.
pub const WAIT_POLL_FIRST: Duration = Duration::from_millis(50);
/// The longest wait between two reads of [`Client::wait_saga`].
pub const WAIT_POLL_MAX: Duration = Duration::from_secs(1);

/// The name a cancel is recorded under when the cluster does not
/// authenticate callers (with authentication, the caller's own name is).
pub const CANCEL_WHO: &str = "application";

impl Client {
    /// Registers `definition`. True when this call registered it, false
    /// when the identical definition was registered already (so a repeat
    /// is harmless). Another definition under a (name, version) already
    /// taken is [`ClientError::AlreadyExists`]; one that breaks the rules
    /// is [`ClientError::InvalidArgument`] with the step and the rule.
    pub async fn register_saga_definition(&self, definition: &pb::SagaDefinition) -> Result<bool, ClientError> {
        let req = pb::RegisterSagaDefinitionRequest {
            definition: Some(definition.clone()),
        };
        let r = self
            .call(Kind::Write, |ch, t| {
                let rq = self.request(req.clone(), t);
                async move { SagaServiceClient::new(ch).register_definition(rq).await }
            })
            .await?;
        Ok(r.created)
    }

    /// The registered definitions, newest version of each name first.
    pub async fn saga_definitions(&self) -> Result<Vec<pb::SagaDefinition>, ClientError> {
        let r = self
            .call(Kind::Read, |ch, t| {
                let rq = self.request(pb::ListSagaDefinitionsRequest {}, t);
                async move { SagaServiceClient::new(ch).list_definitions(rq).await }
            })
            .await?;
        Ok(r.definitions)
    }

    /// Starts a saga, idempotent by [`StartSaga::idempotency_key`]: the
    /// same key with the same request answers the same saga
    /// ([`SagaStarted::created`] false); the same key with another request
    /// (another input, definition, version, rights or deadline) is
    /// [`ClientError::AlreadyExists`], naming the saga the key started.
    /// [`ClientError::Unknown`]: the saga may or may not have started;
    /// start again with the same request to learn which. An unregistered
    /// definition is [`ClientError::NotFound`].
    pub async fn start_saga(&self, start: &StartSaga) -> Result<SagaStarted, ClientError> {
        let req = start.to_pb()?;
        let r = self
            .call(Kind::Write, |ch, t| {
                let rq = self.request(req.clone(), t);
                async move { SagaServiceClient::new(ch).start_saga(rq).await }
            })
            .await?;
        Ok(SagaStarted {
            saga_id: r.saga_id,
            created: r.created,
        })
    }

    /// Saga `saga_id`: its state and its whole journal (linearizable).
    /// [`ClientError::NotFound`] for a saga that never started here or was
    /// forgotten after its retention.
    pub async fn saga(&self, saga_id: u64) -> Result<pb::SagaView, ClientError> {
        self.call(Kind::Read, |ch, t| {
            let rq = self.request(pb::GetSagaRequest { saga_id }, t);
            async move { SagaServiceClient::new(ch).get_saga(rq).await }
        })
        .await
    }

    /// Reads saga `saga_id` until it ends (COMPLETED or COMPENSATED) or
    /// parks for an operator, waiting [`WAIT_POLL_FIRST`] doubling up to
    /// [`WAIT_POLL_MAX`] between reads, for at most `within`. When `within`
    /// runs out first, or no read answered in it, the answer is
    /// [`SagaWait::StillRunning`], never an error: the saga goes on. A
    /// definite refusal (the saga does not exist, the caller may not see
    /// it) is an error.
    pub async fn wait_saga(&self, saga_id: u64, within: Duration) -> Result<SagaWait, ClientError> {
        let until = Instant::now() + within;
        let poll = Backoff::new(WAIT_POLL_FIRST, WAIT_POLL_MAX, Jitter::Full);
        let mut last = None;
        let mut why;
        let mut attempt = 0u32;
        loop {
            let read_until = until.min(Instant::now() + self.cfg.call_deadline);
            let res = self
                .call_until(Kind::Read, read_until, |ch, t| {
                    let rq = self.request(pb::GetSagaRequest { saga_id }, t);
                    async move { SagaServiceClient::new(ch).get_saga(rq).await }
                })
                .await;
            match res {
                Ok(v) => {
                    if let Some(end) = end_of(v.state) {
                        return Ok(SagaWait::Ended { end, view: v });
                    }
                    why = format!(
                        "the wait ran out with the saga {}",
                        pb::SagaState::try_from(v.state).map_or("in an unknown state", |s| s.as_str_name())
                    );
                    last = Some(v);
                }
                // No answer in time (no leader, no quorum, a node down):
                // not an answer about the saga; ask again while there is time.
                Err(ClientError::Unavailable(e) | ClientError::NotApplied(e) | ClientError::Unknown(e)) => {
                    why = format!("no read of the saga answered: {e}");
                }
                Err(e) => return Err(e),
            }
            let now = Instant::now();
            if now >= until {
                return Ok(SagaWait::StillRunning { last, why });
            }
            tokio::time::sleep(poll.sample(attempt).min(until - now)).await;
            attempt = attempt.saturating_add(1);
            // A read with no time left would only say so; the last one's
            // answer says more.
            if Instant::now() >= until {
                return Ok(SagaWait::StillRunning { last, why });
            }
        }
    }

    /// A page of sagas ([`SagaFilter`]). An authenticated application
    /// sees only its own sagas.
    pub async fn list_sagas(&self, filter: &SagaFilter) -> Result<SagaPage, ClientError> {
        let req = pb::ListSagasRequest {
            states: filter.states.iter().map(|s| *s as i32).collect(),
            definition: filter.definition.clone(),
            after_saga_id: filter.after_saga_id,
            limit: filter.limit,
        };
        let r = self
            .call(Kind::Read, |ch, t| {
                let rq = self.request(req.clone(), t);
                async move { SagaServiceClient::new(ch).list_sagas(rq).await }
            })
            .await?;
        Ok(SagaPage {
            sagas: r.sagas,
            next_after_saga_id: Some(r.next_after_saga_id).filter(|n| *n != 0),
        })
    }

    /// Stops saga `saga_id` going forward and compensates what it did,
    /// newest step first; `why` is recorded. The step in flight is settled
    /// as every compensation settles it: its forward call is asked about
    /// (and fenced) first, and undone only if it happened.
    ///
    /// Answers the saga's view (COMPENSATING, or COMPENSATED when nothing
    /// needed undoing; [`Client::wait_saga`] waits for the end). Cancelling
    /// again answers the same. Refused with
    /// [`ClientError::FailedPrecondition`] past the point of no return (its
    /// pivot, or a step that cannot be undone, may have happened), or when
    /// it ended or compensates for another reason. [`ClientError::Unknown`]:
    /// the cancel may or may not be recorded; cancel again.
    pub async fn cancel_saga(&self, saga_id: u64, why: &str) -> Result<pb::SagaView, ClientError> {
        self.operate_saga(saga_id, SagaAction::Cancel, CANCEL_WHO, why).await
    }

    /// Completes step `step` of saga `saga_id`, whose forward call
    /// `operation_id` (as the step service received it) answered PENDING:
    /// a callback arrived, a person decided. `who` is recorded (replaced by
    /// the authenticated caller's name when the cluster authenticates).
    /// Answers the saga's view. The same completion again answers the view
    /// and changes nothing, so an [`ClientError::Unknown`] is retried
    /// as is; another end for a completed call, or a completion the saga
    /// no longer waits for (cancelled, past its deadline), is
    /// [`ClientError::FailedPrecondition`] with what it found.
    pub async fn complete_step(
        &self,
        saga_id: u64,
        step: u32,
        operation_id: &str,
        end: StepEnd,
        who: &str,
    ) -> Result<pb::SagaView, ClientError> {
        let (outcome, output, reason) = match end {
            StepEnd::Ok { output } => (pb::StepOutcome::Ok, output, String::new()),
            StepEnd::Failed { reason } => (pb::StepOutcome::Failed, Vec::new(), reason),
        };
        let req = pb::CompleteStepRequest {
            saga_id,
            step,
            operation_id: operation_id.to_string(),
            outcome: outcome as i32,
            output,
            reason,
            resource_version: String::new(),
            downstream_operation_id: String::new(),
            who: who.to_string(),
        };
        self.call(Kind::Write, |ch, t| {
            let rq = self.request(req.clone(), t);
            async move { SagaServiceClient::new(ch).complete_step(rq).await }
        })
        .await
    }

    /// An action on saga `saga_id`, recorded with `operator` (replaced by
    /// the authenticated caller's name when the cluster authenticates) and
    /// `why` (required). Operators only, but for [`SagaAction::Cancel`],
    /// which the application that started the saga may also take.
    ///
    /// A call repeated after an answer was lost may find its own action
    /// recorded already; the cluster then refuses the repeat
    /// (FAILED_PRECONDITION), and this answers the saga's view when the
    /// journal's last action is this one with this `why`.
    pub async fn operate_saga(
        &self,
        saga_id: u64,
        action: SagaAction,
        operator: &str,
        why: &str,
    ) -> Result<pb::SagaView, ClientError> {
        let req = pb::OperateSagaRequest {
            saga_id,
            action: action.to_pb() as i32,
            why: why.to_string(),
            operator: operator.to_string(),
        };
        let res = self
            .call(Kind::Write, |ch, t| {
                let rq = self.request(req.clone(), t);
                async move { SagaServiceClient::new(ch).operate_saga(rq).await }
            })
            .await;
        match res {
            Err(ClientError::FailedPrecondition(refusal)) => {
                // Our own earlier attempt (its answer lost) may be what
                // the saga's state now refuses a repeat of. A read that
                // fails tells nothing: the refusal stands.
                match self.saga(saga_id).await {
                    Ok(v)
                        if v.operator_actions
                            .last()
                            .is_some_and(|a| a.action == action.journal_name() && a.why == why) =>
                    {
                        Ok(v)
                    }
                    _ => Err(ClientError::FailedPrecondition(refusal)),
                }
            }
            other => other,
        }
    }
}

#[cfg(test)]
mod stand_in_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_completed_compensated_and_parked_are_ends() {
        assert_eq!(end_of(pb::SagaState::Completed as i32), Some(SagaEnd::Completed));
        assert_eq!(end_of(pb::SagaState::Compensated as i32), Some(SagaEnd::Compensated));
        assert_eq!(end_of(pb::SagaState::Parked as i32), Some(SagaEnd::Parked));
        for s in [
            pb::SagaState::Running,
            pb::SagaState::Compensating,
            pb::SagaState::Unspecified,
        ] {
            assert_eq!(end_of(s as i32), None, "{s:?}");
        }
        assert_eq!(end_of(99), None, "a state this client does not know is no end");
    }

    #[test]
    fn a_start_carries_its_deadline_in_whole_ms_and_refuses_none_or_zero() {
        let s = StartSaga::new("order", 2, "k", b"in".to_vec());
        let p = s.to_pb().unwrap();
        assert_eq!((p.definition.as_str(), p.version, p.deadline_ms), ("order", 2, 0));
        let p = s.clone().with_deadline(Duration::from_millis(1500)).to_pb().unwrap();
        assert_eq!(p.deadline_ms, 1500);
        for d in [Duration::ZERO, Duration::from_micros(999), Duration::MAX] {
            let e = s.clone().with_deadline(d).to_pb().unwrap_err();
            assert!(matches!(e, ClientError::InvalidArgument(_)), "{d:?}: {e}");
        }
    }

    #[test]
    fn actions_map_to_the_wire_and_to_the_journals_names() {
        for (a, w, n) in [
            (SagaAction::Retry, pb::SagaOperatorAction::Retry, "retry"),
            (SagaAction::Skip, pb::SagaOperatorAction::Skip, "skip"),
            (SagaAction::Compensate, pb::SagaOperatorAction::Compensate, "compensate"),
            (
                SagaAction::MarkComplete,
                pb::SagaOperatorAction::MarkComplete,
                "mark-complete",
            ),
            (SagaAction::Cancel, pb::SagaOperatorAction::Cancel, "cancel"),
        ] {
            assert_eq!((a.to_pb(), a.journal_name()), (w, n));
        }
    }
}
