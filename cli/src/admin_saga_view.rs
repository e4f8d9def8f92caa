//! How `coordinator admin saga` shows what the cluster answered: the names
//! of the saga enums, one saga (`SagaView`) and one definition as JSON, and
//! the tables for people. Pure functions of the API's messages.

use dtx_proto::v1 as pb;
use serde_json::json;
use serde_json::Value;

use crate::admin_view::span;
use crate::admin_view::utc;
use crate::admin_view::Table;

/// At most this many characters of a parked reason in `saga list`.
const REASON_WIDTH: usize = 48;

/// A `SagaState` by name: RUNNING, COMPENSATING, COMPLETED, COMPENSATED,
/// PARKED (UNSPECIFIED for 0 or a value this build does not know).
pub fn saga_state_name(v: i32) -> &'static str {
    dtx_proto::names::saga_state(v).unwrap_or("UNSPECIFIED")
}

/// A `StepKind` by name: COMPENSABLE, PIVOT, RETRIABLE (UNSPECIFIED
/// otherwise).
pub fn kind_name(v: i32) -> &'static str {
    dtx_proto::names::step_kind(v).unwrap_or("UNSPECIFIED")
}

/// A `StepOutcome` by name: UNKNOWN, OK, FAILED, NOOP, STALE, SKIPPED
/// (UNSPECIFIED: no outcome recorded).
pub fn outcome_name(v: i32) -> &'static str {
    dtx_proto::names::step_outcome(v).unwrap_or("UNSPECIFIED")
}

/// A step kind as a definition file spells it: compensable, pivot,
/// retriable (unspecified for anything else).
pub fn kind_file_name(v: i32) -> &'static str {
    match pb::StepKind::try_from(v) {
        Ok(pb::StepKind::Compensable) => "compensable",
        Ok(pb::StepKind::Pivot) => "pivot",
        Ok(pb::StepKind::Retriable) => "retriable",
        Ok(pb::StepKind::ReadOnly) => "read_only",
        Ok(pb::StepKind::Unspecified) | Err(_) => "unspecified",
    }
}

/// A recovery option as a definition file spells it: retry, compensate,
/// park (unspecified for anything else).
pub fn recovery_file_name(v: i32) -> &'static str {
    match pb::RecoveryOption::try_from(v) {
        Ok(pb::RecoveryOption::Retry) => "retry",
        Ok(pb::RecoveryOption::Compensate) => "compensate",
        Ok(pb::RecoveryOption::Park) => "park",
        Ok(pb::RecoveryOption::Unspecified) | Err(_) => "unspecified",
    }
}

/// Whether a saga in state `v` is over (nothing more will run).
fn finished(v: i32) -> bool {
    matches!(
        pb::SagaState::try_from(v),
        Ok(pb::SagaState::Completed | pb::SagaState::Compensated)
    )
}

fn parked(s: &pb::SagaView) -> bool {
    s.state == pb::SagaState::Parked as i32
}

/// `name@version`.
pub fn definition_ref(s: &pb::SagaView) -> String {
    format!("{}@{}", s.definition, s.version)
}

fn call_json(c: &pb::StepCallView) -> Value {
    json!({
        "operation_id": c.operation_id,
        "intent_at_ms": c.intent_at_ms,
        "attempts": c.attempts,
        "outcome": outcome_name(c.outcome),
        "reason": c.reason,
        "downstream_operation_id": c.downstream_operation_id,
        "resource_version": c.resource_version,
        "outcome_at_ms": c.outcome_at_ms,
        "unknown_ms": c.unknown_ms,
        "reconciliations": c.reconciliations,
        "unknown_since_ms": c.unknown_since_ms,
        "output": std::str::from_utf8(&c.output).ok(),
        "output_hex": if std::str::from_utf8(&c.output).is_ok() { None } else { Some(hex(&c.output)) },
        "completed_by": c.completed_by,
    })
}

fn step_json(s: &pb::StepJournalView) -> Value {
    json!({
        "step": s.step,
        "name": s.name,
        "kind": kind_name(s.kind),
        "fingerprint": s.fingerprint,
        "forward": s.forward.as_ref().map(call_json),
        "compensation": s.compensation.as_ref().map(call_json),
        "residual": s.residual,
        "compensation_ref": s.compensation_ref,
        "precondition": s.precondition,
        "approved_by": s.approved_by,
    })
}

/// One saga as JSON: the API's field names, enums by name (`"RUNNING"`,
/// `"COMPENSABLE"`, `"OK"`), times in Unix ms (0: not set). The input is
/// `input` when it is UTF-8 text, else `null` with `input_hex`.
pub fn saga_json(s: &pb::SagaView) -> Value {
    let mut v = json!({
        "saga_id": s.saga_id,
        "definition": s.definition,
        "version": s.version,
        "state": saga_state_name(s.state),
        "current_step": s.current_step,
        "parked_reason": s.parked_reason,
        "parked_from": saga_state_name(s.parked_from),
        "authorization": s.authorization.as_ref().map(|a| json!({
            "principal": a.principal,
            "tenant": a.tenant,
            "expires_at_ms": a.expires_at_ms,
            "policy": a.policy,
        })),
        "owner": s.owner,
        "started_at_ms": s.started_at_ms,
        "ended_at_ms": s.ended_at_ms,
        "past_pivot": s.past_pivot,
        "journal_seq": s.journal_seq,
        "query_failures": s.query_failures,
        "deadline_at_ms": s.deadline_at_ms,
        "cancel_reason": s.cancel_reason,
        "awaiting_approval": s.awaiting_approval,
        "idempotency_key": s.idempotency_key,
        "input": std::str::from_utf8(&s.input).ok(),
        "steps": s.steps.iter().map(step_json).collect::<Vec<_>>(),
        "operator_actions": s.operator_actions.iter().map(|a| json!({
            "action": a.action,
            "who": a.who,
            "why": a.why,
            "at_ms": a.at_ms,
            "step": a.step,
        })).collect::<Vec<_>>(),
    });
    if std::str::from_utf8(&s.input).is_err() {
        v["input_hex"] = hex(&s.input).into();
    }
    v
}

/// One definition as JSON, in the shape of a definition file (`saga
/// register` reads it back): kinds and recovery options in lower case.
pub fn definition_json(d: &pb::SagaDefinition) -> Value {
    let steps: Vec<Value> = d
        .steps
        .iter()
        .map(|s| {
            let mut v = json!({
                "name": s.name,
                "kind": kind_file_name(s.kind),
                "service": s.service,
                "action": s.action,
                "compensation": s.compensation,
                "status_query": s.status_query,
                "versioned": s.versioned,
                "on_failure": s.on_failure.iter().map(|o| recovery_file_name(*o)).collect::<Vec<_>>(),
                "high_impact": s.high_impact,
                "completion_timeout_ms": s.completion_timeout_ms,
            });
            if let Some(r) = &s.retry {
                v["retry"] = json!({
                    "max_attempts": r.max_attempts,
                    "backoff_initial_ms": r.backoff_initial_ms,
                    "backoff_max_ms": r.backoff_max_ms,
                });
            }
            v
        })
        .collect();
    json!({"name": d.name, "version": d.version, "steps": steps})
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// `s` cut to at most `n` characters, with `…` when cut; newlines become
/// spaces (a table row stays one line).
pub fn truncate(s: &str, n: usize) -> String {
    let flat: String = s.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    if flat.chars().count() <= n {
        return flat;
    }
    let mut out: String = flat.chars().take(n.saturating_sub(1)).collect();
    out.push('…');
    out
}

/// The step a saga is at: `2 charge` (`-` once it is over).
fn step_cell(s: &pb::SagaView) -> String {
    if finished(s.state) {
        return "-".into();
    }
    match s.steps.iter().find(|j| j.step == s.current_step) {
        Some(j) => format!("{} {}", s.current_step, j.name),
        None => s.current_step.to_string(),
    }
}

/// `saga list`: one row per saga.
pub fn list_table(sagas: &[pb::SagaView]) -> String {
    let mut t = Table::new(&["ID", "DEFINITION", "STATE", "STEP", "STARTED", "PARKED REASON"]);
    for s in sagas {
        let state = if parked(s) {
            format!("PARKED (from {})", saga_state_name(s.parked_from))
        } else {
            saga_state_name(s.state).to_string()
        };
        t.row(vec![
            s.saga_id.to_string(),
            definition_ref(s),
            state,
            step_cell(s),
            utc(s.started_at_ms),
            if s.parked_reason.is_empty() || !parked(s) {
                "-".into()
            } else {
                truncate(&s.parked_reason, REASON_WIDTH)
            },
        ]);
    }
    t.render()
}

fn or_dash(s: &str) -> String {
    if s.is_empty() {
        "-".into()
    } else {
        s.to_string()
    }
}

/// An outcome cell: `-` when none is recorded.
fn outcome_cell(v: i32) -> String {
    match outcome_name(v) {
        "UNSPECIFIED" => "-".into(),
        n => n.into(),
    }
}

/// Time spent UNKNOWN: the sum of the settled spells, and the current
/// spell's start (time of day, UTC) if the outcome is UNKNOWN now.
fn unknown_cell(c: &pb::StepCallView) -> String {
    match (c.unknown_ms, c.unknown_since_ms) {
        (0, 0) => "-".into(),
        (ms, 0) => span(ms),
        (0, since) => format!("since {}", time_of_day(since)),
        (ms, since) => format!("{} + since {}", span(ms), time_of_day(since)),
    }
}

/// `19:35:01.432Z` of `utc(ms)`.
fn time_of_day(ms: u64) -> String {
    let t = utc(ms);
    t.split_once('T').map_or(t.clone(), |(_, tod)| tod.to_string())
}

fn authorization_line(a: Option<&pb::SagaAuthorization>) -> String {
    let Some(a) = a else {
        return "none".into();
    };
    format!(
        "principal {}, tenant {}, expires {}, policy {}",
        or_dash(&a.principal),
        or_dash(&a.tenant),
        if a.expires_at_ms == 0 {
            "never".to_string()
        } else {
            utc(a.expires_at_ms)
        },
        or_dash(&a.policy)
    )
}

fn input_line(b: &[u8]) -> String {
    match std::str::from_utf8(b) {
        Ok("") => "(empty)".into(),
        Ok(t) => format!("{} ({} bytes)", truncate(t, 80), b.len()),
        Err(_) => format!("{} bytes, not UTF-8 (--json shows them in hex)", b.len()),
    }
}

/// `saga show`: the saga's state and authorization, one row per step
/// (forward and compensation), the reasons given, the operator's actions.
pub fn show_text(s: &pb::SagaView) -> String {
    let mut head = format!("saga {}: {}", s.saga_id, saga_state_name(s.state));
    if parked(s) {
        head.push_str(&format!(
            " (from {}, at step {})",
            saga_state_name(s.parked_from),
            step_cell(s)
        ));
    } else if !finished(s.state) {
        head.push_str(&format!(" (at step {})", step_cell(s)));
    }
    let mut out = vec![head];
    let mut field = |k: &str, v: String| out.push(format!("  {k:<15}{v}"));
    field("definition", definition_ref(s));
    if !s.parked_reason.is_empty() {
        let label = if parked(s) { "parked reason" } else { "last parked" };
        field(label, truncate(&s.parked_reason, 400));
    }
    field(
        "past pivot",
        if s.past_pivot { "yes (only goes forward)" } else { "no" }.into(),
    );
    if !s.cancel_reason.is_empty() {
        field("stopped", truncate(&s.cancel_reason, 400));
    }
    if s.awaiting_approval {
        field(
            "approval",
            format!(
                "the compensation of step {} waits for an approval: saga approve {} --why ...",
                step_cell(s),
                s.saga_id
            ),
        );
    }
    field("started", utc(s.started_at_ms));
    if s.deadline_at_ms != 0 {
        field("deadline", utc(s.deadline_at_ms));
    }
    field("ended", utc(s.ended_at_ms));
    field("authorization", authorization_line(s.authorization.as_ref()));
    field("owner", or_dash(&s.owner));
    field("key", or_dash(&s.idempotency_key));
    field("input", input_line(&s.input));
    field("journal seq", s.journal_seq.to_string());
    if s.query_failures > 0 {
        field("status queries", format!("failed {} times in a row", s.query_failures));
    }
    let mut out = out.join("\n");

    out.push_str("\n\nsteps:\n");
    let mut t = Table::new(&[
        "#",
        "STEP",
        "KIND",
        "FWD OP",
        "FWD",
        "TRIES",
        "UNKNOWN",
        "RECONCILED",
        "VERSION",
        "COMP OP",
        "COMP",
        "TRIES",
        "RESIDUAL",
    ]);
    let mut reasons = Vec::new();
    let mut outputs = Vec::new();
    for j in &s.steps {
        let (f, c) = (j.forward.as_ref(), j.compensation.as_ref());
        let cell = |c: Option<&pb::StepCallView>, get: &dyn Fn(&pb::StepCallView) -> String| c.map_or("-".into(), get);
        t.row(vec![
            j.step.to_string(),
            j.name.clone(),
            kind_name(j.kind).to_string(),
            cell(f, &|c| or_dash(&c.operation_id)),
            cell(f, &|c| outcome_cell(c.outcome)),
            cell(f, &|c| c.attempts.to_string()),
            cell(f, &unknown_cell),
            cell(f, &|c| c.reconciliations.to_string()),
            cell(f, &|c| or_dash(&c.resource_version)),
            cell(c, &|c| or_dash(&c.operation_id)),
            cell(c, &|c| outcome_cell(c.outcome)),
            cell(c, &|c| c.attempts.to_string()),
            if j.residual.is_empty() {
                "-".into()
            } else {
                truncate(&j.residual, 60)
            },
        ]);
        if let Some(f) = f.filter(|f| !f.output.is_empty()) {
            outputs.push(format!("  step {} {}: {}", j.step, j.name, input_line(&f.output)));
        }
        if let Some(by) = f.map(|f| f.completed_by.as_str()).filter(|b| !b.is_empty()) {
            reasons.push(format!("  step {} {} forward completed by {by}", j.step, j.name));
        }
        if !j.approved_by.is_empty() {
            reasons.push(format!(
                "  step {} {} compensation approved by {}",
                j.step, j.name, j.approved_by
            ));
        }
        for (what, call) in [("forward", f), ("compensation", c)] {
            if let Some(call) = call.filter(|c| !c.reason.is_empty()) {
                reasons.push(format!(
                    "  step {} {} {} {}: {}",
                    j.step,
                    j.name,
                    what,
                    outcome_name(call.outcome),
                    truncate(&call.reason, 200)
                ));
            }
        }
    }
    if s.steps.is_empty() {
        out.push_str("  (none journaled yet)");
    } else {
        out.push_str(&t.render());
    }
    if !reasons.is_empty() {
        out.push_str("\n\nreasons:\n");
        out.push_str(&reasons.join("\n"));
    }
    if !outputs.is_empty() {
        out.push_str("\n\noutputs:\n");
        out.push_str(&outputs.join("\n"));
    }

    out.push_str("\n\noperator actions:\n");
    if s.operator_actions.is_empty() {
        out.push_str("  (none)");
    } else {
        let mut t = Table::new(&["AT", "WHO", "ACTION", "STEP", "WHY"]);
        for a in &s.operator_actions {
            t.row(vec![
                utc(a.at_ms),
                or_dash(&a.who),
                a.action.clone(),
                a.step.to_string(),
                truncate(&a.why, 200),
            ]);
        }
        out.push_str(&t.render());
    }
    out
}

/// `saga definitions`: one row per (name, version), the steps in order as
/// `name:kind`.
pub fn definitions_table(defs: &[pb::SagaDefinition]) -> String {
    let mut t = Table::new(&["NAME", "VERSION", "STEPS"]);
    for d in defs {
        let steps: Vec<String> = d
            .steps
            .iter()
            .map(|s| format!("{}:{}", s.name, kind_file_name(s.kind)))
            .collect();
        t.row(vec![d.name.clone(), d.version.to_string(), steps.join(" ")]);
    }
    t.render()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A parked saga with one compensable step done, a pivot that went
    /// UNKNOWN then FAILED, and one operator action.
    pub(crate) fn sample() -> pb::SagaView {
        pb::SagaView {
            saga_id: 42,
            definition: "order".into(),
            version: 3,
            state: pb::SagaState::Parked as i32,
            current_step: 1,
            parked_reason: "charge: card service answered FAILED 5 times\nthen gave up".into(),
            parked_from: pb::SagaState::Running as i32,
            authorization: Some(pb::SagaAuthorization {
                principal: "alice".into(),
                tenant: "acme".into(),
                expires_at_ms: 1_796_140_800_000,
                policy: "orders-rw".into(),
            }),
            owner: "dtx://operator/alice".into(),
            started_at_ms: 1_796_137_200_000,
            ended_at_ms: 0,
            steps: vec![
                pb::StepJournalView {
                    step: 0,
                    name: "reserve".into(),
                    kind: pb::StepKind::Compensable as i32,
                    fingerprint: "ab12".into(),
                    forward: Some(pb::StepCallView {
                        operation_id: "42.0.f".into(),
                        intent_at_ms: 1_796_137_200_010,
                        attempts: 1,
                        outcome: pb::StepOutcome::Ok as i32,
                        resource_version: "v7".into(),
                        outcome_at_ms: 1_796_137_200_020,
                        output: br#"{"reservation":"r-7"}"#.to_vec(),
                        ..Default::default()
                    }),
                    compensation: None,
                    residual: String::new(),
                    compensation_ref: "order@3:release".into(),
                    precondition: String::new(),
                    approved_by: String::new(),
                },
                pb::StepJournalView {
                    step: 1,
                    name: "charge".into(),
                    kind: pb::StepKind::Pivot as i32,
                    fingerprint: "cd34".into(),
                    forward: Some(pb::StepCallView {
                        operation_id: "42.1.f".into(),
                        attempts: 5,
                        outcome: pb::StepOutcome::Failed as i32,
                        reason: "card declined".into(),
                        unknown_ms: 12_400,
                        reconciliations: 2,
                        ..Default::default()
                    }),
                    compensation: None,
                    residual: String::new(),
                    compensation_ref: String::new(),
                    precondition: String::new(),
                    approved_by: String::new(),
                },
            ],
            operator_actions: vec![pb::SagaOperatorActionView {
                action: "RETRY".into(),
                who: "dtx://operator/bob".into(),
                why: "card service restarted".into(),
                at_ms: 1_796_137_300_000,
                step: 1,
            }],
            input: br#"{"order":7}"#.to_vec(),
            idempotency_key: "order-7".into(),
            past_pivot: false,
            journal_seq: 17,
            query_failures: 0,
            deadline_at_ms: 0,
            cancel_reason: String::new(),
            awaiting_approval: false,
        }
    }

    #[test]
    fn saga_json_names_enums_and_keeps_the_api_field_names() {
        let v = saga_json(&sample());
        assert_eq!(v["saga_id"], 42);
        assert_eq!(v["definition"], "order");
        assert_eq!(v["version"], 3);
        assert_eq!(v["state"], "PARKED");
        assert_eq!(v["parked_from"], "RUNNING");
        assert_eq!(v["authorization"]["principal"], "alice");
        assert_eq!(v["authorization"]["tenant"], "acme");
        assert_eq!(v["authorization"]["expires_at_ms"], 1_796_140_800_000u64);
        assert_eq!(v["owner"], "dtx://operator/alice");
        assert_eq!(v["past_pivot"], false);
        assert_eq!(v["input"], r#"{"order":7}"#);
        assert!(v.get("input_hex").is_none());
        let steps = v["steps"].as_array().unwrap();
        assert_eq!(steps.len(), 2);
        assert_eq!(steps[0]["kind"], "COMPENSABLE");
        assert_eq!(steps[0]["forward"]["outcome"], "OK");
        assert_eq!(steps[0]["forward"]["resource_version"], "v7");
        assert!(steps[0]["compensation"].is_null());
        assert_eq!(steps[1]["kind"], "PIVOT");
        assert_eq!(steps[1]["forward"]["outcome"], "FAILED");
        assert_eq!(steps[1]["forward"]["unknown_ms"], 12_400);
        assert_eq!(steps[1]["forward"]["reconciliations"], 2);
        assert_eq!(v["operator_actions"][0]["who"], "dtx://operator/bob");
        assert_eq!(v["operator_actions"][0]["action"], "RETRY");

        // Bytes that are not UTF-8 come as hex; no authorization is null.
        let mut s = sample();
        s.input = vec![0xff, 0x00, 0x10];
        s.authorization = None;
        let v = saga_json(&s);
        assert!(v["input"].is_null());
        assert_eq!(v["input_hex"], "ff0010");
        assert!(v["authorization"].is_null());
    }

    #[test]
    fn list_table_has_one_row_per_saga_with_the_key_fields() {
        let mut done = sample();
        done.saga_id = 43;
        done.state = pb::SagaState::Completed as i32;
        done.parked_reason.clear();
        let t = list_table(&[sample(), done]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3, "{t}");
        assert!(lines[0].starts_with("ID"), "{t}");
        for want in [
            "42",
            "order@3",
            "PARKED (from RUNNING)",
            "1 charge",
            "2026-",
            "charge: card service",
        ] {
            assert!(lines[1].contains(want), "{want:?} missing from {:?}", lines[1]);
        }
        // The reason is cut and kept on one line.
        assert!(lines[1].ends_with('…'), "{:?}", lines[1]);
        assert!(lines[2].contains("43") && lines[2].contains("COMPLETED"), "{t}");
        // A reason left from an earlier park is not shown for a saga that
        // is not parked.
        let mut running = sample();
        running.state = pb::SagaState::Running as i32;
        let t = list_table(&[running]);
        assert!(!t.contains("card service"), "{t}");
        assert!(show_text(&sample()).contains("parked reason"));
        let mut c = pb::StepCallView::default();
        assert_eq!(unknown_cell(&c), "-");
        c.unknown_since_ms = 1_796_137_200_432;
        assert_eq!(unknown_cell(&c), "since 15:00:00.432Z");
        c.unknown_ms = 2_000;
        assert_eq!(unknown_cell(&c), "2.0s + since 15:00:00.432Z");
    }

    #[test]
    fn show_text_has_state_authorization_steps_and_actions() {
        let t = show_text(&sample());
        for want in [
            "saga 42: PARKED (from RUNNING, at step 1 charge)",
            "order@3",
            "charge: card service answered FAILED 5 times then gave up",
            "principal alice, tenant acme",
            "policy orders-rw",
            "dtx://operator/alice",
            "past pivot",
            "42.0.f",
            "42.1.f",
            "COMPENSABLE",
            "PIVOT",
            "12.4s",
            "v7",
            "step 1 charge forward FAILED: card declined",
            "dtx://operator/bob",
            "card service restarted",
            r#"{"order":7} (11 bytes)"#,
            r#"step 0 reserve: {"reservation":"r-7"} (21 bytes)"#,
        ] {
            assert!(t.contains(want), "{want:?} missing from:\n{t}");
        }
        let step_row = t.lines().find(|l| l.starts_with("1 ")).expect("step 1 row");
        for want in ["charge", "PIVOT", "FAILED", "5", "2"] {
            assert!(step_row.contains(want), "{want:?} missing from {step_row:?}");
        }
    }

    #[test]
    fn definitions_table_lists_steps_with_kinds() {
        let d = pb::SagaDefinition {
            name: "order".into(),
            version: 2,
            steps: vec![
                pb::SagaStepDefinition {
                    name: "reserve".into(),
                    kind: pb::StepKind::Compensable as i32,
                    ..Default::default()
                },
                pb::SagaStepDefinition {
                    name: "charge".into(),
                    kind: pb::StepKind::Pivot as i32,
                    ..Default::default()
                },
            ],
        };
        let t = definitions_table(&[d]);
        assert!(t.contains("order"), "{t}");
        assert!(t.contains("reserve:compensable charge:pivot"), "{t}");
    }

    #[test]
    fn truncate_cuts_on_characters_and_flattens_lines() {
        assert_eq!(truncate("short", 10), "short");
        assert_eq!(truncate("a\nb", 10), "a b");
        assert_eq!(truncate("ééééé", 3), "éé…");
    }
}
