//! The saga enums by the names people read (the console, `coordinator
//! admin saga`): the proto names without their prefixes. `None` for 0
//! (unspecified) and for a value this build does not know; each caller
//! says what it shows then.

use crate::v1 as pb;

/// RUNNING, COMPENSATING, COMPLETED, COMPENSATED or PARKED.
pub fn saga_state(v: i32) -> Option<&'static str> {
    match pb::SagaState::try_from(v).ok()? {
        pb::SagaState::Running => Some("RUNNING"),
        pb::SagaState::Compensating => Some("COMPENSATING"),
        pb::SagaState::Completed => Some("COMPLETED"),
        pb::SagaState::Compensated => Some("COMPENSATED"),
        pb::SagaState::Parked => Some("PARKED"),
        pb::SagaState::Unspecified => None,
    }
}

/// COMPENSABLE, PIVOT, RETRIABLE or READ_ONLY.
pub fn step_kind(v: i32) -> Option<&'static str> {
    match pb::StepKind::try_from(v).ok()? {
        pb::StepKind::Compensable => Some("COMPENSABLE"),
        pb::StepKind::Pivot => Some("PIVOT"),
        pb::StepKind::Retriable => Some("RETRIABLE"),
        pb::StepKind::ReadOnly => Some("READ_ONLY"),
        pb::StepKind::Unspecified => None,
    }
}

/// UNKNOWN, OK, FAILED, NOOP, STALE, SKIPPED or PENDING.
pub fn step_outcome(v: i32) -> Option<&'static str> {
    match pb::StepOutcome::try_from(v).ok()? {
        pb::StepOutcome::Unknown => Some("UNKNOWN"),
        pb::StepOutcome::Ok => Some("OK"),
        pb::StepOutcome::Failed => Some("FAILED"),
        pb::StepOutcome::Noop => Some("NOOP"),
        pb::StepOutcome::Stale => Some("STALE"),
        pb::StepOutcome::Skipped => Some("SKIPPED"),
        pb::StepOutcome::Pending => Some("PENDING"),
        pb::StepOutcome::Unspecified => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_the_proto_names_without_their_prefix() {
        for (v, name) in [(pb::SagaState::Running, "RUNNING"), (pb::SagaState::Parked, "PARKED")] {
            assert_eq!(saga_state(v as i32), Some(name));
            assert_eq!(v.as_str_name(), format!("SAGA_STATE_{name}"));
        }
        assert_eq!(step_kind(pb::StepKind::Pivot as i32), Some("PIVOT"));
        assert_eq!(step_outcome(pb::StepOutcome::Noop as i32), Some("NOOP"));
        for f in [saga_state, step_kind, step_outcome] {
            assert_eq!(f(0), None, "unspecified");
            assert_eq!(f(99), None, "a value this build does not know");
        }
    }
}
