//! The once-per-operation-id rules both step stores apply (the sled
//! [`StepStore`](super::StepStore) and the PostgreSQL one): which calls are
//! refused, what gets recorded (answers, NOOPs, fences), and the counters
//! of calls and their answers.

use tracing::warn;

use super::types::CallKind;
use super::types::StepCall;
use super::types::StepError;
use super::types::StepRecord;
use super::types::StepResult;
use crate::store::unix_ms;

/// Counts a Forward or Compensate call (`dtx_step_calls_total`) by its
/// answer.
pub(crate) fn count_call(call: &'static str, answer: &Result<StepResult, StepError>) {
    let outcome = match answer {
        Ok(r) => r.label(),
        Err(StepError::Invalid(_)) => "invalid",
        Err(StepError::Conflict(_)) => "conflict",
        Err(StepError::InFlight(_)) => "in_flight",
        Err(StepError::Store(_)) => "error",
    };
    metrics::counter!("dtx_step_calls_total", "call" => call, "outcome" => outcome).increment(1);
}

/// Counts a Fence call (`dtx_step_calls_total`) by its answer.
pub(crate) fn count_fence(answer: &Result<Option<StepRecord>, StepError>) {
    let outcome = match answer {
        Ok(Some(_)) => "applied",
        Ok(None) => "fenced",
        Err(StepError::Invalid(_)) => "invalid",
        Err(StepError::Conflict(_)) => "conflict",
        Err(StepError::InFlight(_)) => "in_flight",
        Err(StepError::Store(_)) => "error",
    };
    metrics::counter!("dtx_step_calls_total", "call" => "fence", "outcome" => outcome).increment(1);
}

/// Counts a Status call (`dtx_step_calls_total`) by its answer.
pub(crate) fn count_lookup(call: &'static str, answer: &Result<Option<StepRecord>, StepError>) {
    let outcome = match answer {
        Ok(Some(_)) => "applied",
        Ok(None) => "not_applied",
        Err(StepError::Invalid(_)) => "invalid",
        Err(StepError::Conflict(_)) => "conflict",
        Err(StepError::InFlight(_)) => "in_flight",
        Err(StepError::Store(_)) => "error",
    };
    metrics::counter!("dtx_step_calls_total", "call" => call, "outcome" => outcome).increment(1);
}

/// Refuses a malformed call: no operation id, or a compensation naming no
/// forward operation id.
pub(crate) fn check_call(kind: CallKind, call: &StepCall) -> Result<(), StepError> {
    if call.operation_id.is_empty() {
        return Err(StepError::Invalid("the call has no operation id".into()));
    }
    if kind == CallKind::Compensate && call.forward_operation_id.is_empty() {
        return Err(StepError::Invalid(
            "the compensation names no forward operation id".into(),
        ));
    }
    Ok(())
}

/// A call whose operation id has record `rec` here: refused when it was
/// the other kind of call, and when both carry a fingerprint and they
/// differ (`StepError::Conflict`: the id names other work; answering the
/// recorded reply would report another request's outcome as this one's).
/// Counts the duplicate.
pub(crate) fn check_repeat(kind: CallKind, call: &StepCall, rec: &StepRecord) -> Result<(), StepError> {
    check_repeat_only(kind, call, rec)?;
    metrics::counter!("dtx_step_duplicates_total", "call" => kind.as_str()).increment(1);
    Ok(())
}

/// [`check_repeat`] without counting the duplicate.
pub(crate) fn check_repeat_only(kind: CallKind, call: &StepCall, rec: &StepRecord) -> Result<(), StepError> {
    if rec.kind != kind {
        return Err(StepError::Invalid(format!(
            "operation id {:?} was a {} call here, not a {} call",
            call.operation_id,
            rec.kind.as_str(),
            kind.as_str()
        )));
    }
    if !call.fingerprint.is_empty() && !rec.fingerprint.is_empty() && call.fingerprint != rec.fingerprint {
        warn!(
            operation_id = %call.operation_id,
            "refused: a repeated operation id carries another fingerprint ({} recorded, {} now)",
            rec.fingerprint,
            call.fingerprint
        );
        metrics::counter!("dtx_step_fingerprint_conflicts_total", "call" => kind.as_str()).increment(1);
        return Err(StepError::Conflict(format!(
            "operation id {:?} is recorded here for another request (fingerprint {} recorded, {} in this call); \
             refused, nothing done",
            call.operation_id, rec.fingerprint, call.fingerprint
        )));
    }
    Ok(())
}

/// What a handler's answer stands for: an OK whose output is over
/// `SAGA_STEP_OUTPUT_BYTES_MAX` is FAILED (the cluster could not journal
/// it), and so is a compensation that answers PENDING (only a forward
/// action completes later). Applied before the handler's writes are kept
/// or dropped, so a FAILED here changes nothing.
pub(crate) fn vet(kind: CallKind, result: StepResult) -> StepResult {
    let max = dtx_proto::limits::SAGA_STEP_OUTPUT_BYTES_MAX;
    match result {
        StepResult::Ok { output, .. } if output.len() > max => StepResult::failed(format!(
            "the step's output is {} bytes; the limit is saga_step_output_bytes_max = {max} bytes: answered FAILED, nothing changed",
            output.len()
        )),
        StepResult::Pending { .. } if kind == CallKind::Compensate => StepResult::failed(
            "the compensation answered PENDING: only a forward action completes later; nothing changed",
        ),
        other => other,
    }
}

/// The inbox record of `call` answered `result` now (vetted: [`vet`]); an
/// OK without a downstream operation id gets the call's operation id.
pub(crate) fn record_of(kind: CallKind, call: &StepCall, result: StepResult) -> StepRecord {
    let result = match vet(kind, result) {
        StepResult::Ok {
            resource_version,
            downstream_operation_id,
            residual,
            output,
        } => StepResult::Ok {
            resource_version,
            downstream_operation_id: if downstream_operation_id.is_empty() {
                call.operation_id.clone()
            } else {
                downstream_operation_id
            },
            residual,
            output,
        },
        other => other,
    };
    StepRecord {
        kind,
        result,
        at_ms: unix_ms(),
        saga_id: call.saga_id,
        step: call.step,
        action: call.action.clone(),
        fingerprint: call.fingerprint.clone(),
    }
}

/// The NOOP a compensation answers when its forward operation did not
/// answer OK here: `forward` is that operation's record (a FAILED, fenced
/// or other answer), or `None` when it has none (and is now fenced).
pub(crate) fn noop_for(forward_operation_id: &str, forward: Option<&StepRecord>) -> StepResult {
    let what = match forward {
        None => "is not in the inbox (now fenced)".to_string(),
        Some(f) if f.kind == CallKind::Compensate => "is a compensation".to_string(),
        Some(f) => match &f.result {
            StepResult::Failed { reason } | StepResult::Noop { reason } | StepResult::Stale { reason, .. } => {
                format!("answered {}: {reason}", f.result.label())
            }
            StepResult::Ok { .. } => "answered ok".to_string(),
            StepResult::Pending { .. } => "is pending".to_string(),
        },
    };
    StepResult::noop(format!(
        "the forward action never happened here: operation {forward_operation_id:?} {what}"
    ))
}

/// The record that fences a forward operation id that never ran here.
pub(crate) fn fence_record(saga_id: u64, step: u32) -> StepRecord {
    StepRecord {
        kind: CallKind::Forward,
        result: StepResult::failed(FENCED_REASON),
        at_ms: unix_ms(),
        saga_id,
        step,
        action: String::new(),
        fingerprint: String::new(),
    }
}

/// The reason a fenced operation answers FAILED with.
pub const FENCED_REASON: &str =
    "fenced: the orchestrator found this operation not applied and settled it as never to run";

/// The reason an in-flight operation fenced by its outside system answers
/// FAILED with.
pub const FENCED_OUTSIDE_REASON: &str = "fenced: the outside system never did this operation and now refuses its \
     idempotency key; settled as never to run";
