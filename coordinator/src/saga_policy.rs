//! The saga recovery policy the operators configure (`[[saga.policy_rules]]`,
//! docs/sagas.md "Recovery policy"): a rule set, so the leader's choices
//! about failed steps and high-impact compensations change by
//! configuration, without forking the node. Pure: it reads the saga's
//! record and nothing else.
//!
//! It stays inside the policy boundary (`sm::saga::plan::RecoveryPolicy`):
//! it orders the recovery options a step registered and never adds one
//! (the planner skips an option the step did not register, and the state
//! machine refuses it); it may put an approval gate before a
//! compensation, never take one away (the definition's `high_impact` is
//! checked by the state machine); it may add words to an escalation.
//!
//! The first rule whose `definition`, `step` and (for a failed step)
//! `reason_contains` match decides; empty fields match everything.

use crate::config::SagaPolicyRule;
use crate::sm::saga::plan::RecoveryPolicy;
use crate::sm::saga::Definition;
use crate::sm::saga::Recovery;
use crate::sm::saga::SagaRecord;

/// The configured rules (validated by `config::SagaConfig`).
pub struct RuleSet {
    rules: Vec<SagaPolicyRule>,
}

impl RuleSet {
    pub fn new(rules: Vec<SagaPolicyRule>) -> RuleSet {
        RuleSet { rules }
    }

    /// The first rule about step `step` of `def` that `also` accepts.
    fn first(&self, def: &Definition, step: u32, also: impl Fn(&SagaPolicyRule) -> bool) -> Option<&SagaPolicyRule> {
        let name = def
            .steps
            .get(step as usize)
            .map(|s| s.name.as_str())
            .unwrap_or_default();
        self.rules.iter().find(|r| {
            (r.definition.is_empty() || r.definition == def.name) && (r.step.is_empty() || r.step == name) && also(r)
        })
    }

    /// The failed forward call's reason of `step`.
    fn failure(saga: &SagaRecord, step: u32) -> String {
        saga.step(step)
            .and_then(|j| j.forward.as_ref())
            .map(|c| c.reason.clone())
            .unwrap_or_default()
    }

    /// The first rule about the failure of `step` (its reason matched).
    fn about_failure(
        &self,
        saga: &SagaRecord,
        def: &Definition,
        step: u32,
        also: impl Fn(&SagaPolicyRule) -> bool,
    ) -> Option<&SagaPolicyRule> {
        let reason = Self::failure(saga, step);
        self.first(def, step, |r| {
            (r.reason_contains.is_empty() || reason.contains(&r.reason_contains)) && also(r)
        })
    }
}

/// The option a rule names (`Recovery::name`; the configuration checked
/// the names against `config::SAGA_RECOVERY_NAMES`).
fn recovery_named(name: &str) -> Option<Recovery> {
    [Recovery::Retry, Recovery::Compensate, Recovery::Park]
        .into_iter()
        .find(|r| r.name() == name)
}

impl RecoveryPolicy for RuleSet {
    fn rank(&self, saga: &SagaRecord, def: &Definition, step: u32, registered: &[Recovery]) -> Vec<Recovery> {
        match self.about_failure(saga, def, step, |r| !r.recovery.is_empty()) {
            // The rule's order; the planner takes only registered options.
            Some(rule) => rule.recovery.iter().filter_map(|o| recovery_named(o)).collect(),
            None => registered.to_vec(),
        }
    }

    fn escalation_reason(&self, saga: &SagaRecord, def: &Definition, step: u32, default: String) -> String {
        match self.about_failure(saga, def, step, |r| !r.escalation.is_empty()) {
            Some(rule) => format!("{} ({default})", rule.escalation),
            None => default,
        }
    }

    fn needs_approval(&self, _saga: &SagaRecord, def: &Definition, step: u32, definition_says: bool) -> bool {
        definition_says || self.first(def, step, |r| r.approve_compensation).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sm::saga::Call;
    use crate::sm::saga::CallOutcome;
    use crate::sm::saga::StepJournal;

    fn def(name: &str) -> Definition {
        let step = |n: &str| crate::sm::saga::StepDef {
            name: n.into(),
            kind: crate::sm::saga::StepKind::Compensable,
            service: "svc:1".into(),
            action: "do".into(),
            compensation: Some("undo".into()),
            status_query: "status".into(),
            versioned: false,
            retry: Default::default(),
            on_failure: Vec::new(),
            high_impact: false,
            completion_timeout_ms: 0,
        };
        Definition {
            name: name.into(),
            version: 1,
            steps: vec![step("reserve"), step("charge"), step("email")],
        }
    }

    fn record(definition: &str, failed_step: u32, reason: &str) -> SagaRecord {
        let mut steps = vec![StepJournal::default(); 3];
        steps[failed_step as usize].forward = Some(Call {
            outcome: Some(CallOutcome::Failed),
            reason: reason.to_string(),
            ..Call::default()
        });
        SagaRecord {
            id: 1,
            definition: definition.to_string(),
            version: 1,
            idempotency_key: "k".into(),
            request_fingerprint: [0; 32],
            input: Vec::new(),
            authorization: Default::default(),
            owner: None,
            state: crate::sm::saga::SagaState::Running,
            current: failed_step,
            parked_reason: String::new(),
            parked_from: None,
            started_at_ms: 0,
            ended_at_ms: 0,
            steps,
            operator_actions: Vec::new(),
            seq: 0,
            past_pivot: false,
            deadline_at_ms: 0,
            cancel_reason: String::new(),
            awaiting_approval: None,
        }
    }

    fn rule(definition: &str, step: &str, reason: &str) -> SagaPolicyRule {
        SagaPolicyRule {
            definition: definition.into(),
            step: step.into(),
            reason_contains: reason.into(),
            ..SagaPolicyRule::default()
        }
    }

    const REGISTERED: [Recovery; 2] = [Recovery::Retry, Recovery::Compensate];

    #[test]
    fn the_first_matching_rule_orders_the_options_and_others_keep_the_registered_order() {
        let p = RuleSet::new(vec![
            SagaPolicyRule {
                recovery: vec!["PARK".into()],
                ..rule("order", "charge", "fraud")
            },
            SagaPolicyRule {
                recovery: vec!["COMPENSATE".into(), "RETRY".into()],
                ..rule("order", "charge", "")
            },
        ]);
        let (order, refund) = (def("order"), def("refund"));
        let fraud = record("order", 1, "card flagged: fraud suspected");
        assert_eq!(p.rank(&fraud, &order, 1, &REGISTERED), vec![Recovery::Park]);
        let declined = record("order", 1, "declined");
        assert_eq!(
            p.rank(&declined, &order, 1, &REGISTERED),
            vec![Recovery::Compensate, Recovery::Retry]
        );
        // Another step, another definition: the registered order.
        assert_eq!(
            p.rank(&record("order", 0, "fraud"), &order, 0, &REGISTERED),
            REGISTERED.to_vec()
        );
        assert_eq!(
            p.rank(&record("refund", 1, "fraud"), &refund, 1, &REGISTERED),
            REGISTERED.to_vec()
        );
    }

    #[test]
    fn an_escalation_is_said_first_and_the_orchestrators_words_kept() {
        let p = RuleSet::new(vec![SagaPolicyRule {
            escalation: "call payments on-call".into(),
            ..rule("", "charge", "")
        }]);
        let (r, d) = (record("order", 1, "declined"), def("order"));
        assert_eq!(
            p.escalation_reason(&r, &d, 1, "step 1 failed".into()),
            "call payments on-call (step 1 failed)"
        );
        assert_eq!(p.escalation_reason(&r, &d, 0, "step 0 failed".into()), "step 0 failed");
    }

    #[test]
    fn a_rule_adds_an_approval_gate_and_never_removes_the_definitions() {
        let p = RuleSet::new(vec![SagaPolicyRule {
            approve_compensation: true,
            ..rule("order", "reserve", "")
        }]);
        let (r, d) = (record("order", 1, "declined"), def("order"));
        assert!(p.needs_approval(&r, &d, 0, false), "the rule gates step 0");
        assert!(!p.needs_approval(&r, &d, 1, false), "no rule about step 1");
        assert!(p.needs_approval(&r, &d, 1, true), "the definition's gate stays");
        assert!(!p.needs_approval(&r, &def("refund"), 0, false), "another definition");
        let none = RuleSet::new(Vec::new());
        assert!(none.needs_approval(&r, &d, 2, true));
        assert!(!none.needs_approval(&r, &d, 2, false));
    }
}
