//! The orchestrator's next move for one saga, as a pure function of its
//! journal (so the rules are unit-tested without a network): what to
//! journal, what to call, what to ask. The orchestrator does the I/O and
//! journals what it saw; a new leader runs the same function on the same
//! journal and so resumes where the old one stopped.

use super::CallOutcome;
use super::Definition;
use super::JournalEvent;
use super::Recovery;
use super::SagaRecord;
use super::SagaState;

/// The next move.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Move {
    /// Nothing to do: the saga ended or waits for an operator.
    Idle,
    /// Write this to the journal (then plan again).
    Journal(JournalEvent),
    /// Call the step's forward action (its intent is journaled).
    CallForward { step: u32 },
    /// Ask the step service what the forward call's operation id did: its
    /// outcome is UNKNOWN, or its intent was journaled by an earlier leader
    /// (or before a restart) that may have called.
    QueryForward { step: u32 },
    /// Ask whether the forward action happened, then (if it did) call the
    /// compensation (whose intent is journaled): a compensation never runs
    /// for an action that did not happen.
    AskThenCompensate { step: u32 },
    /// Ask what the compensation's operation id did (UNKNOWN, or a
    /// compensation intent journaled by an earlier leader).
    QueryCompensation { step: u32 },
}

/// Ranks the registered recovery options of a failed step (the policy
/// boundary): it may order them and say why, never add one. The orchestrator
/// takes the first option the journal admits; the state machine refuses an
/// option the definition did not register.
pub trait RecoveryPolicy: Send + Sync {
    fn rank(&self, saga: &SagaRecord, def: &Definition, step: u32, registered: &[Recovery]) -> Vec<Recovery>;

    /// The reason a failed step's saga parks with (an escalation to an
    /// operator), given the orchestrator's own; by default that one. A
    /// policy may say more (whom to call, what it tried); it changes only
    /// the words recorded, never what runs.
    fn escalation_reason(&self, _saga: &SagaRecord, _def: &Definition, _step: u32, default: String) -> String {
        default
    }

    /// Whether the compensation of `step` waits for an approval first,
    /// given what the definition says (`high_impact`). A policy may add
    /// the gate to a step, never take it away: the state machine refuses
    /// a high-impact step's compensation without an approval whatever the
    /// policy answers.
    fn needs_approval(&self, _saga: &SagaRecord, _def: &Definition, _step: u32, definition_says: bool) -> bool {
        definition_says
    }
}

/// The registered order, as is.
pub struct RegisteredOrder;

impl RecoveryPolicy for RegisteredOrder {
    fn rank(&self, _: &SagaRecord, _: &Definition, _: u32, registered: &[Recovery]) -> Vec<Recovery> {
        registered.to_vec()
    }
}

/// The next move for `r`. `fresh` says the current call's INTENDED was
/// journaled by this orchestrator in this term and not called yet (so
/// calling is safe without asking first); otherwise an INTENDED call may
/// have been made and is asked about first. `now_ms` is the leader's clock.
pub fn next(r: &SagaRecord, def: &Definition, fresh: bool, now_ms: u64, policy: &dyn RecoveryPolicy) -> Move {
    let step = r.current;
    let sd = &def.steps[step as usize];
    let j = &r.steps[step as usize];
    // Past its deadline and still before its point of no return: stop
    // going forward, compensate what may have happened (the current
    // step's forward call is asked about and fenced first, as for every
    // compensation).
    if r.state == SagaState::Running && r.past_deadline(now_ms) && super::point_of_no_return(r, def).is_none() {
        return Move::Journal(JournalEvent::DeadlinePassed {
            reason: format!(
                "its deadline passed at {} ms with step {step} ({:?}) next: compensated as if cancelled",
                r.deadline_at_ms, sd.name
            ),
        });
    }
    match r.state {
        SagaState::Running => match j.forward.as_ref().map(|c| (c.outcome(), c.attempts)) {
            None => Move::Journal(JournalEvent::ForwardIntent { step }),
            Some((CallOutcome::Intended, _)) if fresh => Move::CallForward { step },
            // Accepted, completed later by operation id (`Complete`):
            // nothing to do until then (a cancel or the deadline may still
            // turn the saga back), unless the step's completion timeout
            // passed: then an operator decides.
            Some((CallOutcome::Pending, _)) => {
                let since = j.forward.as_ref().map_or(0, |c| c.outcome_at_ms);
                let limit = sd.completion_timeout_ms;
                if limit > 0 && now_ms >= since.saturating_add(limit) {
                    Move::Journal(JournalEvent::Park {
                        reason: format!(
                            "step {step} ({:?}) answered PENDING at {since} ms and was not completed within completion_timeout_ms = {limit} ms: complete it (saga complete-step), cancel the saga, or retry to wait again",
                            sd.name
                        ),
                    })
                } else {
                    Move::Idle
                }
            }
            Some((CallOutcome::Intended | CallOutcome::Unknown, _)) => Move::QueryForward { step },
            Some((CallOutcome::Failed, attempts)) => {
                let registered = sd.recovery();
                let reason = j.forward.as_ref().map(|c| c.reason.clone()).unwrap_or_default();
                for o in policy.rank(r, def, step, &registered) {
                    if !registered.contains(&o) {
                        continue;
                    }
                    let admitted = match o {
                        Recovery::Retry => attempts < sd.retry.max_attempts,
                        Recovery::Compensate => !r.past_pivot,
                        Recovery::Park => true,
                    };
                    if admitted {
                        let why = match o {
                            Recovery::Park => policy.escalation_reason(
                                r,
                                def,
                                step,
                                format!("step {step} ({:?}) failed after {attempts} attempts: {reason}", sd.name),
                            ),
                            _ => reason,
                        };
                        return Move::Journal(JournalEvent::Recover {
                            step,
                            option: o,
                            reason: why,
                        });
                    }
                }
                Move::Journal(JournalEvent::Park {
                    reason: policy.escalation_reason(
                        r,
                        def,
                        step,
                        format!(
                            "step {step} ({:?}) failed after {attempts} attempts and no registered recovery option is left: {reason}",
                            sd.name
                        ),
                    ),
                })
            }
            // OK and SKIPPED move the saga on when journaled.
            Some(_) => Move::Idle,
        },
        SagaState::Compensating => {
            if r.authorization.expired(now_ms) {
                return Move::Journal(JournalEvent::Park {
                    reason: format!(
                        "the saga's rights (principal {:?}) expired at {} ms before the compensation of step {step} ({:?}): escalated, not compensated",
                        r.authorization.principal, r.authorization.expires_at_ms, sd.name
                    ),
                });
            }
            match j.compensation.as_ref().map(|c| (c.outcome(), c.attempts)) {
                None if j.approved_by.is_empty() && policy.needs_approval(r, def, step, sd.high_impact) => {
                    Move::Journal(JournalEvent::AwaitApproval {
                        step,
                        reason: format!(
                            "the compensation of step {step} ({:?}) is high-impact: it waits for an approval (saga approve), a skip, or the saga marked compensated",
                            sd.name
                        ),
                    })
                }
                None => Move::Journal(JournalEvent::CompensationIntent { step }),
                Some((CallOutcome::Intended, _)) if fresh => Move::AskThenCompensate { step },
                Some((CallOutcome::Intended | CallOutcome::Unknown, _)) => Move::QueryCompensation { step },
                Some((CallOutcome::Failed, attempts)) => {
                    if attempts < sd.retry.max_attempts {
                        Move::Journal(JournalEvent::CompensationIntent { step })
                    } else {
                        let reason = j.compensation.as_ref().map(|c| c.reason.clone()).unwrap_or_default();
                        Move::Journal(JournalEvent::Park {
                            reason: format!(
                                "the compensation of step {step} ({:?}) failed after {attempts} attempts: {reason}",
                                sd.name
                            ),
                        })
                    }
                }
                Some(_) => Move::Idle,
            }
        }
        _ => Move::Idle,
    }
}
