//! Unit tests of the pure saga state machine (docs/sagas.md):
//! the definition rules, the journal's apply rules, the operator's actions,
//! and the orchestrator's next move (`plan::next`).
//!
//! Tests are named after what they check. A refused command is checked to
//! change nothing (the book is compared before and after) and to emit no
//! effect.

use rand::rngs::StdRng;
use rand::Rng;
use rand::SeedableRng;

use super::plan::Move;
use super::plan::RecoveryPolicy;
use super::plan::RegisteredOrder;
use super::*;

// ---------------------------------------------------------------- helpers

const C: StepKind = StepKind::Compensable;
const P: StepKind = StepKind::Pivot;
const R: StepKind = StepKind::Retriable;
const RO: StepKind = StepKind::ReadOnly;

/// A valid step of `kind` named `name`: a COMPENSABLE step names its
/// compensation, the others none; the kind's default recovery.
fn step(name: &str, kind: StepKind) -> StepDef {
    StepDef {
        name: name.to_string(),
        kind,
        service: format!("{name}.svc:7000"),
        action: format!("do_{name}"),
        compensation: (kind == StepKind::Compensable).then(|| format!("undo_{name}")),
        status_query: format!("status_{name}"),
        versioned: false,
        retry: RetryPolicy::default(),
        on_failure: Vec::new(),
        high_impact: false,
        completion_timeout_ms: 0,
    }
}

/// Definition "shop"@1 with steps named s0, s1, ... of the given kinds.
fn def_of(kinds: &[StepKind]) -> Definition {
    Definition {
        name: "shop".to_string(),
        version: 1,
        steps: kinds
            .iter()
            .enumerate()
            .map(|(i, k)| step(&format!("s{i}"), *k))
            .collect(),
    }
}

/// `d` with step `i` changed by `f`.
fn with_step(mut d: Definition, i: usize, f: impl FnOnce(&mut StepDef)) -> Definition {
    f(&mut d.steps[i]);
    d
}

/// The refusal of an invalid definition, checked to be the same through
/// `validate` and through `Register` (which changes nothing).
fn refusal(d: &Definition) -> String {
    let err = d.validate().expect_err("the definition must be refused");
    let mut book = SagaBook::default();
    let mut effects = Vec::new();
    let res = book.apply(&SagaCommand::Register { definition: d.clone() }, &mut effects);
    assert_eq!(res, Err(SagaError::InvalidDefinition(err.clone())));
    assert!(effects.is_empty());
    assert_eq!(book, SagaBook::default());
    err
}

/// How `validate` names step `i`.
fn at(i: usize, name: &str) -> String {
    format!("step {i} ({name:?})")
}

fn auth(expires_at_ms: u64) -> Authorization {
    Authorization {
        principal: "alice".to_string(),
        tenant: "t1".to_string(),
        expires_at_ms,
        policy: "p".to_string(),
    }
}

fn reply(outcome: CallOutcome) -> Reply {
    Reply::of(outcome, format!("said {}", outcome.name()))
}

fn reconciled(outcome: CallOutcome) -> Reply {
    Reply {
        reconciled: true,
        ..Reply::of(outcome, format!("status query said {}", outcome.name()))
    }
}

fn fi(step: u32) -> JournalEvent {
    JournalEvent::ForwardIntent { step }
}

fn fo(step: u32, outcome: CallOutcome) -> JournalEvent {
    JournalEvent::ForwardOutcome {
        step,
        reply: reply(outcome),
    }
}

fn ci(step: u32) -> JournalEvent {
    JournalEvent::CompensationIntent { step }
}

fn co(step: u32, outcome: CallOutcome) -> JournalEvent {
    JournalEvent::CompensationOutcome {
        step,
        reply: reply(outcome),
    }
}

fn recover(step: u32, option: Recovery) -> JournalEvent {
    JournalEvent::Recover {
        step,
        option,
        reason: format!("chose {}", option.name()),
    }
}

fn park(reason: &str) -> JournalEvent {
    JournalEvent::Park {
        reason: reason.to_string(),
    }
}

/// A book with a clock: every write happens 10 ms after the previous one
/// unless `now` is set.
struct H {
    book: SagaBook,
    now: u64,
}

impl H {
    fn new(defs: &[&Definition]) -> H {
        let mut h = H {
            book: SagaBook::default(),
            now: 1_000,
        };
        for d in defs {
            let (res, _) = h.apply(SagaCommand::Register {
                definition: (*d).clone(),
            });
            assert_eq!(res, Ok(SagaOk::Registered { created: true }));
        }
        h
    }

    fn apply(&mut self, cmd: SagaCommand) -> (Result<SagaOk, SagaError>, Vec<SagaEffect>) {
        let mut effects = Vec::new();
        let res = self.book.apply(&cmd, &mut effects);
        (res, effects)
    }

    fn start_cmd(&self, d: &Definition, key: &str, fingerprint: u8, input: &[u8], a: Authorization) -> SagaCommand {
        SagaCommand::Start {
            idempotency_key: key.to_string(),
            fingerprint: [fingerprint; 32],
            definition: d.name.clone(),
            version: d.version,
            input: input.to_vec(),
            authorization: a,
            owner: Some("app".to_string()),
            now_ms: self.now,
            deadline_ms: 0,
        }
    }

    fn start(&mut self, d: &Definition, key: &str) -> SagaId {
        self.start_with(d, key, auth(0))
    }

    fn start_with(&mut self, d: &Definition, key: &str, a: Authorization) -> SagaId {
        let cmd = self.start_cmd(d, key, 1, b"order-42", a);
        match self.apply(cmd) {
            (Ok(SagaOk::Started { saga_id, created: true }), effects) => {
                assert_eq!(effects, vec![SagaEffect::Put(saga_id)]);
                saga_id
            }
            other => panic!("start refused: {other:?}"),
        }
    }

    fn rec(&self, id: SagaId) -> SagaRecord {
        self.book.get(id).expect("saga exists").clone()
    }

    /// A journal write planned on the journal as it is now.
    fn write(&mut self, id: SagaId, ev: JournalEvent) -> Result<SagaOk, SagaError> {
        let seq = self.rec(id).seq;
        self.write_at(id, seq, ev)
    }

    fn write_at(&mut self, id: SagaId, seq: u64, ev: JournalEvent) -> Result<SagaOk, SagaError> {
        let before = self.book.clone();
        let (res, effects) = self.apply(SagaCommand::Journal {
            saga_id: id,
            seq,
            now_ms: self.now,
            event: ev,
        });
        match &res {
            Ok(SagaOk::Journaled { seq: n, state }) => {
                assert_eq!(effects, vec![SagaEffect::Put(id)]);
                assert_eq!(*n, seq + 1);
                assert_eq!(*n, self.rec(id).seq);
                assert_eq!(*state, self.rec(id).state);
            }
            Ok(other) => panic!("a journal write answered {other:?}"),
            Err(_) => {
                assert!(effects.is_empty(), "a refused write emits nothing");
                assert_eq!(self.book, before, "a refused write changes nothing");
            }
        }
        self.now += 10;
        res
    }

    /// A write that must be accepted.
    fn ok(&mut self, id: SagaId, ev: JournalEvent) -> SagaState {
        match self.write(id, ev.clone()) {
            Ok(SagaOk::Journaled { state, .. }) => state,
            other => panic!("{ev:?} refused: {other:?}"),
        }
    }

    fn operate(&mut self, id: SagaId, action: OperatorAction, who: &str, why: &str) -> Result<SagaOk, SagaError> {
        let before = self.book.clone();
        let (res, effects) = self.apply(SagaCommand::Operate {
            saga_id: id,
            action,
            who: who.to_string(),
            why: why.to_string(),
            now_ms: self.now,
        });
        match &res {
            Ok(SagaOk::Operated { state }) => {
                assert_eq!(effects, vec![SagaEffect::Put(id)]);
                assert_eq!(*state, self.rec(id).state);
                assert_eq!(
                    self.rec(id).seq,
                    before.get(id).unwrap().seq + 1,
                    "an operator's action is a write"
                );
            }
            Ok(other) => panic!("an operator's action answered {other:?}"),
            Err(_) => {
                assert!(effects.is_empty(), "a refused action emits nothing");
                assert_eq!(self.book, before, "a refused action changes nothing");
            }
        }
        self.now += 10;
        res
    }

    /// Step `step` called and answered `outcome`.
    fn forward(&mut self, id: SagaId, step: u32, outcome: CallOutcome) -> SagaState {
        self.ok(id, fi(step));
        self.ok(id, fo(step, outcome))
    }

    fn compensate(&mut self, id: SagaId, step: u32, outcome: CallOutcome) -> SagaState {
        self.ok(id, ci(step));
        self.ok(id, co(step, outcome))
    }

    fn plan(&self, id: SagaId, fresh: bool) -> Move {
        let r = self.rec(id);
        let d = self.book.definition(&r.definition, r.version).unwrap().clone();
        plan::next(&r, &d, fresh, self.now, &RegisteredOrder)
    }
}

fn fwd(r: &SagaRecord, i: u32) -> Call {
    r.steps[i as usize].forward.clone().expect("forward call journaled")
}

fn comp(r: &SagaRecord, i: u32) -> Call {
    r.steps[i as usize]
        .compensation
        .clone()
        .expect("compensation journaled")
}

fn refused_with(res: Result<SagaOk, SagaError>, needle: &str) -> SagaError {
    let e = res.expect_err("must be refused");
    assert!(e.to_string().contains(needle), "{e} should mention {needle:?}");
    e
}

// ------------------------------------------------- definition validation

#[test]
fn definition_without_steps_is_refused() {
    let e = refusal(&def_of(&[]));
    assert!(e.contains("at least one step"), "{e}");
}

#[test]
fn definition_with_more_steps_than_the_limit_is_refused_and_the_limit_is_accepted() {
    let kinds = vec![R; limits::SAGA_STEPS_MAX + 1];
    let e = refusal(&def_of(&kinds));
    assert!(e.contains("saga_steps_max"), "{e}");
    assert_eq!(def_of(&kinds[1..]).validate(), Ok(()));
}

#[test]
fn definition_name_and_version_are_checked() {
    let mut d = def_of(&[C, P]);
    d.name.clear();
    assert!(refusal(&d).contains("definition name must not be empty"));
    let mut d = def_of(&[C, P]);
    d.version = 0;
    assert!(refusal(&d).contains("version must be at least 1"));
}

#[test]
fn second_pivot_is_refused_naming_both() {
    let e = refusal(&def_of(&[C, P, P]));
    assert!(e.contains(&at(2, "s2")), "{e}");
    assert!(e.contains("second pivot") && e.contains("\"s1\""), "{e}");
}

#[test]
fn compensable_step_after_the_pivot_is_refused() {
    let e = refusal(&def_of(&[C, P, R, C]));
    assert!(e.contains(&at(3, "s3")), "{e}");
    assert!(e.contains("after the pivot \"s1\" only RETRIABLE"), "{e}");
    let e = refusal(&def_of(&[P, C]));
    assert!(e.contains(&at(1, "s1")) && e.contains("after the pivot"), "{e}");
}

#[test]
fn retriable_step_before_the_pivot_is_refused() {
    let e = refusal(&def_of(&[C, R, P]));
    assert!(e.contains(&at(2, "s2")), "{e}");
    assert!(e.contains("cannot follow the RETRIABLE step \"s1\""), "{e}");
}

#[test]
fn compensable_step_after_a_retriable_step_is_refused() {
    let e = refusal(&def_of(&[C, R, C]));
    assert!(e.contains(&at(2, "s2")), "{e}");
    assert!(e.contains("cannot follow the RETRIABLE step \"s1\""), "{e}");
}

#[test]
fn compensable_step_without_compensation_is_refused() {
    let d = with_step(def_of(&[C, C, P]), 1, |s| s.compensation = None);
    let e = refusal(&d);
    assert!(
        e.contains(&at(1, "s1")) && e.contains("must name its compensation"),
        "{e}"
    );
    let d = with_step(def_of(&[C, P]), 0, |s| s.compensation = Some(String::new()));
    let e = refusal(&d);
    assert!(
        e.contains(&at(0, "s0")) && e.contains("compensation must not be empty"),
        "{e}"
    );
}

#[test]
fn pivot_or_retriable_step_with_compensation_is_refused() {
    let d = with_step(def_of(&[C, P, R]), 1, |s| s.compensation = Some("undo".into()));
    let e = refusal(&d);
    assert!(
        e.contains(&at(1, "s1")) && e.contains("a PIVOT step cannot have a compensation"),
        "{e}"
    );
    let d = with_step(def_of(&[C, P, R]), 2, |s| s.compensation = Some("undo".into()));
    let e = refusal(&d);
    assert!(
        e.contains(&at(2, "s2")) && e.contains("a RETRIABLE step cannot have a compensation"),
        "{e}"
    );
}

#[test]
fn step_without_status_query_is_refused() {
    let d = with_step(def_of(&[C, P, R]), 2, |s| s.status_query.clear());
    let e = refusal(&d);
    assert!(
        e.contains(&at(2, "s2")) && e.contains("a status query is required"),
        "{e}"
    );
}

#[test]
fn step_with_empty_service_or_action_or_name_is_refused() {
    let d = with_step(def_of(&[C, P]), 1, |s| s.service.clear());
    let e = refusal(&d);
    assert!(
        e.contains(&at(1, "s1")) && e.contains("service must not be empty"),
        "{e}"
    );
    let d = with_step(def_of(&[C, P]), 0, |s| s.action.clear());
    let e = refusal(&d);
    assert!(
        e.contains(&at(0, "s0")) && e.contains("action must not be empty"),
        "{e}"
    );
    let d = with_step(def_of(&[C, P]), 1, |s| s.name.clear());
    let e = refusal(&d);
    assert!(e.contains("step 1 (\"\"): name must not be empty"), "{e}");
    let d = with_step(def_of(&[C, P]), 1, |s| {
        s.service = "x".repeat(limits::ADDRESS_BYTES_MAX + 1)
    });
    assert!(refusal(&d).contains(&at(1, "s1")));
}

#[test]
fn compensate_option_on_a_retriable_step_is_refused() {
    let d = with_step(def_of(&[C, P, R]), 2, |s| {
        s.on_failure = vec![Recovery::Retry, Recovery::Compensate]
    });
    let e = refusal(&d);
    assert!(e.contains(&at(2, "s2")), "{e}");
    assert!(
        e.contains("COMPENSATE is not a recovery option of a RETRIABLE step"),
        "{e}"
    );
    // The same option on the pivot and before it is fine.
    let d = with_step(def_of(&[C, P, R]), 1, |s| {
        s.on_failure = vec![Recovery::Compensate, Recovery::Park]
    });
    let d = with_step(d, 0, |s| s.on_failure = vec![Recovery::Retry, Recovery::Compensate]);
    assert_eq!(d.validate(), Ok(()));
}

#[test]
fn recovery_option_named_twice_is_refused() {
    let d = with_step(def_of(&[C, P]), 0, |s| {
        s.on_failure = vec![Recovery::Retry, Recovery::Compensate, Recovery::Retry]
    });
    let e = refusal(&d);
    assert!(
        e.contains(&at(0, "s0")) && e.contains("recovery option RETRY is named twice"),
        "{e}"
    );
}

#[test]
fn zero_max_attempts_is_refused() {
    let d = with_step(def_of(&[C, P, R]), 2, |s| s.retry.max_attempts = 0);
    let e = refusal(&d);
    assert!(
        e.contains(&at(2, "s2")) && e.contains("max_attempts must be at least 1"),
        "{e}"
    );
}

#[test]
fn backoff_initial_above_max_is_refused() {
    let d = with_step(def_of(&[C, P]), 1, |s| {
        s.retry.backoff_initial_ms = 10;
        s.retry.backoff_max_ms = 5;
    });
    let e = refusal(&d);
    assert!(
        e.contains(&at(1, "s1")) && e.contains("backoff_initial_ms (10) is above"),
        "{e}"
    );
    // Equal is fine.
    let d = with_step(def_of(&[C, P]), 1, |s| {
        s.retry.backoff_initial_ms = 5;
        s.retry.backoff_max_ms = 5;
    });
    assert_eq!(d.validate(), Ok(()));
}

#[test]
fn duplicate_step_names_are_refused() {
    let d = with_step(def_of(&[C, C, P]), 2, |s| s.name = "s0".into());
    let e = refusal(&d);
    assert!(e.contains(&at(2, "s0")) && e.contains("used by an earlier step"), "{e}");
}

#[test]
fn valid_shapes_are_accepted() {
    for kinds in [
        &[C, C, P, R, R][..],
        &[C],
        &[P, R],
        &[R],
        &[C, C, R],
        &[P],
        &[C, P],
        &[R, R],
    ] {
        assert_eq!(def_of(kinds).validate(), Ok(()), "{kinds:?}");
    }
}

#[test]
fn default_recovery_follows_the_kind_and_a_registered_list_replaces_it() {
    assert_eq!(step("a", C).recovery(), vec![Recovery::Compensate]);
    assert_eq!(step("a", P).recovery(), vec![Recovery::Compensate]);
    assert_eq!(step("a", R).recovery(), vec![Recovery::Retry, Recovery::Park]);
    let mut s = step("a", C);
    s.on_failure = vec![Recovery::Park, Recovery::Retry];
    assert_eq!(s.recovery(), vec![Recovery::Park, Recovery::Retry]);
}

#[test]
fn backoff_doubles_from_the_initial_and_stops_at_the_maximum() {
    let p = RetryPolicy {
        max_attempts: 10,
        backoff_initial_ms: 100,
        backoff_max_ms: 1_000,
    };
    let got: Vec<u64> = (0..7).map(|a| p.backoff_ms(a)).collect();
    assert_eq!(got, vec![100, 100, 200, 400, 800, 1_000, 1_000]);
    assert_eq!(p.backoff_ms(u32::MAX), 1_000, "no overflow");
}

// ---------------------------------------------------------------- register

#[test]
fn registering_the_same_definition_twice_is_not_created_again() {
    let d = def_of(&[C, P, R]);
    let mut h = H::new(&[]);
    let (res, effects) = h.apply(SagaCommand::Register { definition: d.clone() });
    assert_eq!(res, Ok(SagaOk::Registered { created: true }));
    assert_eq!(effects, vec![SagaEffect::Definition("shop".into(), 1)]);
    let (res, effects) = h.apply(SagaCommand::Register { definition: d.clone() });
    assert_eq!(res, Ok(SagaOk::Registered { created: false }));
    assert!(effects.is_empty());
    assert_eq!(h.book.definitions().count(), 1);
    assert_eq!(h.book.definition("shop", 1), Some(&d));
}

#[test]
fn registering_other_content_under_a_registered_name_and_version_conflicts() {
    let d = def_of(&[C, P, R]);
    let mut h = H::new(&[&d]);
    let before = h.book.clone();
    let other = with_step(d.clone(), 2, |s| s.retry.max_attempts = 9);
    let (res, effects) = h.apply(SagaCommand::Register {
        definition: other.clone(),
    });
    assert_eq!(
        res,
        Err(SagaError::DefinitionConflict {
            name: "shop".into(),
            version: 1
        })
    );
    assert!(effects.is_empty());
    assert_eq!(h.book, before);
    // A new version of it is another definition.
    let v2 = Definition { version: 2, ..other };
    let (res, _) = h.apply(SagaCommand::Register { definition: v2.clone() });
    assert_eq!(res, Ok(SagaOk::Registered { created: true }));
    assert_eq!(h.book.definition("shop", 1), Some(&d));
    assert_eq!(h.book.definition("shop", 2), Some(&v2));
}

#[test]
fn start_with_an_unknown_definition_is_refused() {
    let d = def_of(&[C, P]);
    let mut h = H::new(&[&d]);
    let before = h.book.clone();
    let other_version = Definition {
        version: 2,
        ..d.clone()
    };
    let cmd = h.start_cmd(&other_version, "k", 1, b"", auth(0));
    let (res, effects) = h.apply(cmd);
    let e = res.unwrap_err();
    assert_eq!(
        e,
        SagaError::UnknownDefinition {
            name: "shop".into(),
            version: 2
        }
    );
    assert!(e.not_found());
    assert!(effects.is_empty());
    assert_eq!(h.book, before);
    let unknown = Definition {
        name: "nope".into(),
        ..d.clone()
    };
    let cmd = h.start_cmd(&unknown, "k", 1, b"", auth(0));
    assert!(matches!(h.apply(cmd).0, Err(SagaError::UnknownDefinition { .. })));
}

// -------------------------------------------------------------------- start

#[test]
fn start_with_the_same_key_and_fingerprint_returns_the_same_saga() {
    let d = def_of(&[C, P]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "order-42");
    h.forward(id, 0, CallOutcome::Ok);
    let before = h.book.clone();
    let cmd = h.start_cmd(&d, "order-42", 1, b"order-42", auth(0));
    let (res, effects) = h.apply(cmd);
    assert_eq!(
        res,
        Ok(SagaOk::Started {
            saga_id: id,
            created: false
        })
    );
    assert!(effects.is_empty());
    assert_eq!(h.book, before, "the repeat changes nothing");
}

#[test]
fn start_with_the_same_key_and_another_fingerprint_conflicts() {
    let d = def_of(&[C, P]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "order-42");
    let before = h.book.clone();
    let cmd = h.start_cmd(&d, "order-42", 2, b"order-42", auth(0));
    let (res, effects) = h.apply(cmd);
    assert_eq!(
        res,
        Err(SagaError::KeyConflict {
            key: "order-42".into(),
            saga_id: id
        })
    );
    assert!(effects.is_empty());
    assert_eq!(h.book, before);
}

#[test]
fn saga_ids_start_at_one_and_increase() {
    let d = def_of(&[C, P]);
    let mut h = H::new(&[&d]);
    assert_eq!(h.book.next_saga_id(), 1);
    let ids: Vec<SagaId> = (0..4).map(|i| h.start(&d, &format!("k{i}"))).collect();
    assert_eq!(ids, vec![1, 2, 3, 4]);
    assert_eq!(h.book.next_saga_id(), 5);
}

#[test]
fn a_started_saga_runs_from_step_zero_with_its_request_recorded() {
    let d = def_of(&[C, C, P, R]);
    let mut h = H::new(&[&d]);
    h.now = 777;
    let id = h.start_with(&d, "k", auth(5_000));
    let r = h.rec(id);
    assert_eq!(r.state, SagaState::Running);
    assert_eq!((r.current, r.seq, r.past_pivot), (0, 0, false));
    assert_eq!(r.started_at_ms, 777);
    assert_eq!(r.input, b"order-42".to_vec());
    assert_eq!(r.authorization, auth(5_000));
    assert_eq!(r.owner.as_deref(), Some("app"));
    assert_eq!(r.idempotency_key, "k");
    assert_eq!(r.steps.len(), 4);
    assert!(r.steps.iter().all(|s| s.forward.is_none() && s.compensation.is_none()));
    let refs: Vec<&str> = r.steps.iter().map(|s| s.compensation_ref.as_str()).collect();
    assert_eq!(refs, vec!["shop@1:undo_s0", "shop@1:undo_s1", "", ""]);
    assert_eq!(h.book.driven(), vec![id]);
}

#[test]
fn step_fingerprints_differ_per_step_and_per_input() {
    let d = def_of(&[C, C, P, R]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    let r = h.rec(id);
    let fps: Vec<&str> = r.steps.iter().map(|s| s.fingerprint.as_str()).collect();
    for (i, f) in fps.iter().enumerate() {
        assert_eq!(f.len(), 64, "sha256 hex");
        assert_eq!(*f, step_fingerprint("shop", 1, i as u32, b"order-42"));
        for g in &fps[i + 1..] {
            assert_ne!(f, g, "every step has its own fingerprint");
        }
    }
    assert_ne!(
        step_fingerprint("shop", 1, 0, b"a"),
        step_fingerprint("shop", 1, 0, b"b")
    );
    assert_ne!(
        step_fingerprint("shop", 1, 0, b"a"),
        step_fingerprint("shop", 2, 0, b"a")
    );
    assert_ne!(
        step_fingerprint("shop", 1, 0, b"a"),
        step_fingerprint("shoe", 1, 0, b"a")
    );
}

#[test]
fn start_refuses_an_empty_or_long_key_and_an_oversized_input() {
    let d = def_of(&[C, P]);
    let mut h = H::new(&[&d]);
    let before = h.book.clone();
    for (key, input) in [
        (String::new(), vec![]),
        ("k".repeat(limits::ID_BYTES_MAX + 1), vec![]),
        ("k".to_string(), vec![0u8; limits::PAYLOAD_BYTES_MAX + 1]),
    ] {
        let cmd = h.start_cmd(&d, &key, 1, &input, auth(0));
        let (res, effects) = h.apply(cmd);
        assert!(matches!(res, Err(SagaError::Invalid(_))), "{res:?}");
        assert!(effects.is_empty());
    }
    assert_eq!(h.book, before);
}

// ------------------------------------------------------------ journal fence

#[test]
fn write_planned_on_a_stale_journal_is_refused_and_changes_nothing() {
    let d = def_of(&[C, P, R]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.ok(id, fi(0));
    // Planned on the journal of length 0; it has 1 write now.
    let e = h.write_at(id, 0, fo(0, CallOutcome::Ok)).unwrap_err();
    assert_eq!(
        e,
        SagaError::StaleJournal {
            saga_id: id,
            planned: 0,
            actual: 1
        }
    );
    // Nor a write planned on a journal it has not got yet.
    let e = h.write_at(id, 5, fo(0, CallOutcome::Ok)).unwrap_err();
    assert!(matches!(
        e,
        SagaError::StaleJournal {
            planned: 5,
            actual: 1,
            ..
        }
    ));
    assert_eq!(fwd(&h.rec(id), 0).outcome(), CallOutcome::Intended);
    // Planned on the current journal, the same write goes in.
    assert_eq!(
        h.write_at(id, 1, fo(0, CallOutcome::Ok)),
        Ok(SagaOk::Journaled {
            seq: 2,
            state: SagaState::Running
        })
    );
}

#[test]
fn an_operators_action_fences_out_a_write_planned_before_it() {
    let d = with_step(def_of(&[C, P]), 0, |s| {
        s.on_failure = vec![Recovery::Park, Recovery::Retry]
    });
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Failed);
    h.ok(id, recover(0, Recovery::Park));
    let planned = h.rec(id).seq;
    h.operate(id, OperatorAction::Retry, "op", "service fixed").unwrap();
    // The orchestrator had planned (on the parked journal) a write.
    let e = h.write_at(id, planned, fo(0, CallOutcome::Ok)).unwrap_err();
    assert!(matches!(e, SagaError::StaleJournal { .. }), "{e}");
    assert_eq!(h.rec(id).seq, planned + 1);
}

#[test]
fn journal_writes_to_a_missing_or_ended_saga_are_refused() {
    let d = def_of(&[R]);
    let mut h = H::new(&[&d]);
    assert_eq!(
        h.apply(SagaCommand::Journal {
            saga_id: 9,
            seq: 0,
            now_ms: 1,
            event: fi(0)
        })
        .0,
        Err(SagaError::NotFound(9))
    );
    let id = h.start(&d, "k");
    assert_eq!(h.forward(id, 0, CallOutcome::Ok), SagaState::Completed);
    refused_with(h.write(id, park("late")), "only a RUNNING or COMPENSATING saga");
    assert!(h.book.driven().is_empty());
}

#[test]
fn writes_out_of_order_are_refused_and_change_nothing() {
    let d = def_of(&[C, P, R]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    // An outcome with no intent.
    refused_with(h.write(id, fo(0, CallOutcome::Ok)), "no forward call is waiting");
    // Another step than the current one.
    refused_with(h.write(id, fi(1)), "the saga is at step 0");
    // A compensation while running.
    refused_with(h.write(id, ci(0)), "this write needs it COMPENSATING");
    h.ok(id, fi(0));
    // Outcomes a forward call cannot have.
    for o in [
        CallOutcome::Noop,
        CallOutcome::Stale,
        CallOutcome::Skipped,
        CallOutcome::Intended,
    ] {
        refused_with(h.write(id, fo(0, o)), "is not an outcome of this call");
    }
    // A reply field over the limit.
    let mut big = reply(CallOutcome::Ok);
    big.reason = "x".repeat(limits::REASON_BYTES_MAX + 1);
    refused_with(
        h.write(id, JournalEvent::ForwardOutcome { step: 0, reply: big }),
        "the limit is",
    );
    // Recovery for a call that did not fail.
    refused_with(
        h.write(id, recover(0, Recovery::Compensate)),
        "only for a FAILED forward call",
    );
    // A park with no reason.
    let e = h.write(id, park("")).unwrap_err();
    assert!(matches!(e, SagaError::Invalid(_)), "{e}");
    h.ok(id, fo(0, CallOutcome::Ok));
    // A second outcome for the same call.
    refused_with(h.write(id, fo(0, CallOutcome::Failed)), "the saga is at step 1");
}

// --------------------------------------------------------------- happy path

#[test]
fn happy_path_c_p_r_completes_past_the_pivot() {
    let d = def_of(&[C, P, R]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    for i in 0..3u32 {
        assert_eq!(h.plan(id, false), Move::Journal(fi(i)));
        h.now = 2_000 + u64::from(i) * 100;
        h.ok(id, fi(i));
        let c = fwd(&h.rec(id), i);
        assert_eq!(c.operation_id, format!("{id}.{i}.f1"));
        assert_eq!((c.generation, c.attempts, c.intent_at_ms), (1, 1, h.now - 10));
        assert_eq!(c.outcome(), CallOutcome::Intended);
        assert_eq!(h.plan(id, true), Move::CallForward { step: i });
        let state = h.ok(id, fo(i, CallOutcome::Ok));
        let r = h.rec(id);
        assert_eq!(r.past_pivot, i >= 1, "past the pivot once the pivot went forward");
        if i < 2 {
            assert_eq!((state, r.current), (SagaState::Running, i + 1));
        } else {
            assert_eq!(state, SagaState::Completed);
        }
    }
    let r = h.rec(id);
    assert_eq!(r.state, SagaState::Completed);
    assert_eq!(r.ended_at_ms, h.now - 10);
    assert_eq!(r.seq, 6);
    assert!(r
        .steps
        .iter()
        .all(|s| s.compensation.is_none() && s.residual.is_empty()));
    assert!(r.operator_actions.is_empty());
    assert_eq!(h.plan(id, false), Move::Idle);
    assert!(h.book.driven().is_empty());
    assert_eq!(h.book.count_in(SagaState::Completed), 1);
}

#[test]
fn a_forward_ok_records_the_resource_version_as_the_compensations_precondition() {
    let d = with_step(def_of(&[C, P]), 0, |s| s.versioned = true);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.ok(id, fi(0));
    let mut rep = reply(CallOutcome::Ok);
    rep.resource_version = "v7".into();
    rep.downstream_operation_id = "down-1".into();
    h.ok(id, JournalEvent::ForwardOutcome { step: 0, reply: rep });
    let r = h.rec(id);
    assert_eq!(r.steps[0].precondition, "v7");
    assert_eq!(fwd(&r, 0).resource_version, "v7");
    assert_eq!(fwd(&r, 0).downstream_operation_id, "down-1");
    assert_eq!(fwd(&r, 0).outcome_at_ms, h.now - 10);
}

// ------------------------------------------------------------------ UNKNOWN

#[test]
fn unknown_then_reconciled_ok_adds_the_unknown_time_and_one_reconciliation() {
    let d = def_of(&[C, P]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.ok(id, fi(0));
    h.now = 5_000;
    h.ok(id, fo(0, CallOutcome::Unknown));
    let c = fwd(&h.rec(id), 0);
    assert_eq!(
        (c.outcome(), c.unknown_since_ms, c.unknown_ms),
        (CallOutcome::Unknown, 5_000, 0)
    );
    assert_eq!(h.rec(id).current, 0, "UNKNOWN does not move the saga on");
    // Asked again, still UNKNOWN: the spell goes on from its start.
    h.now = 5_100;
    h.ok(id, fo(0, CallOutcome::Unknown));
    assert_eq!(fwd(&h.rec(id), 0).unknown_since_ms, 5_000);
    h.now = 5_250;
    h.ok(
        id,
        JournalEvent::ForwardOutcome {
            step: 0,
            reply: reconciled(CallOutcome::Ok),
        },
    );
    let r = h.rec(id);
    let c = fwd(&r, 0);
    assert_eq!(c.outcome(), CallOutcome::Ok);
    assert_eq!(c.unknown_ms, 250);
    assert_eq!(c.reconciliations, 1);
    assert_eq!(c.unknown_since_ms, 0);
    assert_eq!(c.operation_id, format!("{id}.0.f1"));
    assert_eq!(r.current, 1);
}

#[test]
fn intent_again_after_unknown_keeps_the_operation_id_and_counts_the_attempt() {
    let d = with_step(def_of(&[C, P]), 0, |s| s.retry.max_attempts = 3);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.ok(id, fi(0));
    h.now = 1_000;
    h.ok(id, fo(0, CallOutcome::Unknown));
    // The status query found nothing applied: call again under the same key.
    h.now = 1_400;
    h.ok(id, fi(0));
    let c = fwd(&h.rec(id), 0);
    assert_eq!(c.operation_id, format!("{id}.0.f1"));
    assert_eq!((c.generation, c.attempts), (1, 2));
    assert_eq!(c.outcome(), CallOutcome::Intended);
    assert_eq!((c.unknown_ms, c.reconciliations, c.intent_at_ms), (400, 1, 1_400));
    h.ok(id, fo(0, CallOutcome::Unknown));
    h.ok(id, fi(0));
    assert_eq!(fwd(&h.rec(id), 0).attempts, 3);
    h.ok(id, fo(0, CallOutcome::Unknown));
    // Three attempts made: a fourth intent is refused, the call stays UNKNOWN.
    refused_with(h.write(id, fi(0)), "had its 3 attempts");
    assert_eq!(fwd(&h.rec(id), 0).outcome(), CallOutcome::Unknown);
}

#[test]
fn intent_again_after_an_unanswered_intent_is_a_reconciled_attempt() {
    let d = def_of(&[C, P]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.ok(id, fi(0));
    // A new leader asked, found nothing applied, and calls again.
    h.ok(id, fi(0));
    let c = fwd(&h.rec(id), 0);
    assert_eq!(
        (c.operation_id.as_str(), c.attempts, c.reconciliations, c.unknown_ms),
        ("1.0.f1", 2, 1, 0)
    );
}

#[test]
fn unknown_is_not_failed_recovery_is_refused_until_it_is_settled() {
    let d = with_step(def_of(&[C, P]), 0, |s| {
        s.on_failure = vec![Recovery::Compensate, Recovery::Retry]
    });
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.ok(id, fi(0));
    h.ok(id, fo(0, CallOutcome::Unknown));
    for o in [Recovery::Compensate, Recovery::Retry] {
        refused_with(h.write(id, recover(0, o)), "only for a FAILED forward call");
    }
    assert_eq!(h.plan(id, true), Move::QueryForward { step: 0 });
}

// ------------------------------------------------------------- compensation

#[test]
fn failure_before_the_pivot_compensates_the_done_steps_newest_first() {
    let d = def_of(&[C, C, C, P, R]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    h.forward(id, 1, CallOutcome::Ok);
    h.forward(id, 2, CallOutcome::Failed);
    // The default recovery of a COMPENSABLE step.
    assert_eq!(
        h.plan(id, false),
        Move::Journal(recover(2, Recovery::Compensate)).with_reason("said FAILED")
    );
    assert_eq!(h.ok(id, recover(2, Recovery::Compensate)), SagaState::Compensating);
    let r = h.rec(id);
    assert_eq!(
        r.current, 1,
        "the newest step that went forward; the failed one did not"
    );
    for i in [1u32, 0] {
        assert_eq!(h.plan(id, false), Move::Journal(ci(i)));
        h.ok(id, ci(i));
        let c = comp(&h.rec(id), i);
        assert_eq!(c.operation_id, format!("{id}.{i}.c1"));
        assert_eq!((c.generation, c.attempts), (1, 1));
        assert_eq!(h.plan(id, true), Move::AskThenCompensate { step: i });
        h.ok(id, co(i, CallOutcome::Ok));
    }
    let r = h.rec(id);
    assert_eq!(r.state, SagaState::Compensated);
    assert_eq!(r.ended_at_ms, h.now - 10);
    assert!(r.steps[2].compensation.is_none(), "the failed step did nothing to undo");
    assert!(r.steps[3].forward.is_none() && r.steps[3].compensation.is_none());
    assert!(r.steps[4].forward.is_none() && r.steps[4].compensation.is_none());
    assert!(!r.past_pivot);
    assert_eq!(h.plan(id, false), Move::Idle);
}

impl Move {
    /// For comparing a planned `Recover` whose reason is the call's.
    fn with_reason(self, reason: &str) -> Move {
        match self {
            Move::Journal(JournalEvent::Recover { step, option, .. }) => Move::Journal(JournalEvent::Recover {
                step,
                option,
                reason: reason.to_string(),
            }),
            m => m,
        }
    }
}

#[test]
fn failure_of_the_pivot_compensates_the_steps_before_it() {
    let d = def_of(&[C, P, R]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    h.forward(id, 1, CallOutcome::Failed);
    assert_eq!(
        h.plan(id, false),
        Move::Journal(recover(1, Recovery::Compensate)).with_reason("said FAILED")
    );
    h.ok(id, recover(1, Recovery::Compensate));
    assert_eq!(h.rec(id).current, 0);
    assert_eq!(h.compensate(id, 0, CallOutcome::Noop), SagaState::Compensated);
}

#[test]
fn failure_of_the_first_step_ends_compensated_with_nothing_compensated() {
    let d = def_of(&[C, P]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Failed);
    assert_eq!(h.ok(id, recover(0, Recovery::Compensate)), SagaState::Compensated);
    assert!(h.rec(id).steps.iter().all(|s| s.compensation.is_none()));
}

#[test]
fn steps_never_started_are_not_compensated() {
    let d = def_of(&[C, C, C, P]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    h.forward(id, 1, CallOutcome::Ok);
    // Parked at step 2 before its intent.
    h.ok(id, park("held by an operator"));
    h.operate(id, OperatorAction::Compensate, "op", "cancel the order")
        .unwrap();
    let r = h.rec(id);
    assert_eq!((r.state, r.current), (SagaState::Compensating, 1));
    h.compensate(id, 1, CallOutcome::Ok);
    h.compensate(id, 0, CallOutcome::Ok);
    let r = h.rec(id);
    assert_eq!(r.state, SagaState::Compensated);
    assert!(r.steps[2].compensation.is_none() && r.steps[3].compensation.is_none());
}

#[test]
fn a_step_whose_forward_outcome_is_unknown_is_compensated() {
    let d = def_of(&[C, C, P]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    h.ok(id, fi(1));
    h.ok(id, fo(1, CallOutcome::Unknown));
    h.ok(id, park("status query keeps timing out"));
    h.operate(id, OperatorAction::Compensate, "op", "give up").unwrap();
    let r = h.rec(id);
    assert_eq!(
        (r.state, r.current),
        (SagaState::Compensating, 1),
        "it may have happened"
    );
    // The orchestrator asks first; the service says it never happened.
    assert_eq!(h.compensate(id, 1, CallOutcome::Noop), SagaState::Compensating);
    assert_eq!(h.rec(id).current, 0);
    assert_eq!(h.compensate(id, 0, CallOutcome::Ok), SagaState::Compensated);
}

#[test]
fn a_failed_compensation_is_intended_again_under_a_new_generation() {
    let d = with_step(def_of(&[C, P]), 0, |s| s.retry.max_attempts = 2);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    h.forward(id, 1, CallOutcome::Failed);
    h.ok(id, recover(1, Recovery::Compensate));
    h.compensate(id, 0, CallOutcome::Failed);
    assert_eq!(h.plan(id, false), Move::Journal(ci(0)));
    h.ok(id, ci(0));
    let c = comp(&h.rec(id), 0);
    assert_eq!((c.operation_id.as_str(), c.generation, c.attempts), ("1.0.c2", 2, 2));
    h.ok(id, co(0, CallOutcome::Failed));
    // Two attempts made: no third, the orchestrator parks.
    refused_with(h.write(id, ci(0)), "the compensation had its 2 attempts");
    match h.plan(id, false) {
        Move::Journal(JournalEvent::Park { reason }) => {
            assert!(
                reason.contains("compensation of step 0") && reason.contains("2 attempts"),
                "{reason}"
            )
        }
        m => panic!("{m:?}"),
    }
}

#[test]
fn an_unknown_compensation_is_intended_again_under_the_same_operation_id() {
    let d = def_of(&[C, P]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    h.forward(id, 1, CallOutcome::Failed);
    h.ok(id, recover(1, Recovery::Compensate));
    h.ok(id, ci(0));
    h.now = 9_000;
    h.ok(id, co(0, CallOutcome::Unknown));
    assert_eq!(h.plan(id, true), Move::QueryCompensation { step: 0 });
    h.now = 9_300;
    h.ok(id, ci(0));
    let c = comp(&h.rec(id), 0);
    assert_eq!(
        (c.operation_id.as_str(), c.attempts, c.unknown_ms, c.reconciliations),
        ("1.0.c1", 2, 300, 1)
    );
    // Outcomes a compensation cannot have.
    refused_with(
        h.write(id, co(0, CallOutcome::Skipped)),
        "is not an outcome of this call",
    );
    refused_with(
        h.write(id, co(0, CallOutcome::Intended)),
        "is not an outcome of this call",
    );
    h.ok(id, co(0, CallOutcome::Ok));
    assert_eq!(h.rec(id).state, SagaState::Compensated);
}

// --------------------------------------------------------- policy boundary

#[test]
fn recover_with_an_option_the_step_did_not_register_is_refused() {
    let d = with_step(def_of(&[C, P, R]), 0, |s| s.on_failure = vec![Recovery::Compensate]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Failed);
    let e = refused_with(
        h.write(id, recover(0, Recovery::Retry)),
        "RETRY is not among the recovery options",
    );
    assert!(e.to_string().contains("\"s0\""), "{e}");
    refused_with(
        h.write(id, recover(0, Recovery::Park)),
        "PARK is not among the recovery options",
    );
    // A RETRIABLE step's default is retry, then park: no compensation.
    let d2 = Definition {
        name: "r".into(),
        ..def_of(&[R])
    };
    let mut h2 = H::new(&[&d2]);
    let id2 = h2.start(&d2, "k");
    h2.forward(id2, 0, CallOutcome::Failed);
    refused_with(
        h2.write(id2, recover(0, Recovery::Compensate)),
        "COMPENSATE is not among",
    );
}

#[test]
fn recover_compensate_past_the_pivot_is_refused() {
    let d = def_of(&[C, P, R]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    h.forward(id, 1, CallOutcome::Ok);
    h.forward(id, 2, CallOutcome::Failed);
    assert!(h.rec(id).past_pivot);
    refused_with(h.write(id, recover(2, Recovery::Compensate)), "COMPENSATE is not among");
    // Even with a definition that slipped COMPENSATE onto a step past the
    // pivot (not through `Register`), the journal refuses it.
    let bad = with_step(def_of(&[C, P, R]), 2, |s| {
        s.on_failure = vec![Recovery::Compensate, Recovery::Park]
    });
    assert!(bad.validate().is_err());
    let rec = h.rec(id);
    let mut h2 = H {
        book: SagaBook::from_parts(2, [bad.clone()], [rec]),
        now: h.now,
    };
    refused_with(
        h2.write(id, recover(2, Recovery::Compensate)),
        "the saga only goes forward",
    );
    // And the plan never picks it there.
    let r = h2.rec(id);
    assert_eq!(
        plan::next(&r, &bad, false, h2.now, &RegisteredOrder).with_reason("x"),
        Move::Journal(recover(2, Recovery::Park)).with_reason("x")
    );
}

/// A policy that ranks as it is told, registered or not.
struct Ranks(Vec<Recovery>);

impl RecoveryPolicy for Ranks {
    fn rank(&self, _: &SagaRecord, _: &Definition, _: u32, _: &[Recovery]) -> Vec<Recovery> {
        self.0.clone()
    }
}

#[test]
fn plan_never_returns_an_option_the_step_did_not_register() {
    let d = with_step(def_of(&[C, P, R]), 0, |s| s.on_failure = vec![Recovery::Compensate]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Failed);
    let r = h.rec(id);
    let pick = |p: Vec<Recovery>| plan::next(&r, &d, false, 0, &Ranks(p));
    assert_eq!(
        pick(vec![Recovery::Retry, Recovery::Park, Recovery::Compensate]),
        Move::Journal(recover(0, Recovery::Compensate)).with_reason("said FAILED")
    );
    // Only unregistered options offered: the saga parks, never retries.
    match pick(vec![Recovery::Retry, Recovery::Park]) {
        Move::Journal(JournalEvent::Park { reason }) => {
            assert!(reason.contains("no registered recovery option is left"), "{reason}")
        }
        m => panic!("{m:?}"),
    }
    // Nothing ranked at all: parks too.
    assert!(matches!(pick(vec![]), Move::Journal(JournalEvent::Park { .. })));
}

#[test]
fn plan_takes_the_policys_order_among_registered_options() {
    let d = with_step(def_of(&[C, P]), 0, |s| {
        s.on_failure = vec![Recovery::Retry, Recovery::Compensate, Recovery::Park]
    });
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Failed);
    let r = h.rec(id);
    let pick = |p: Vec<Recovery>| plan::next(&r, &d, false, 0, &Ranks(p));
    assert_eq!(
        pick(vec![Recovery::Park, Recovery::Retry]),
        Move::Journal(JournalEvent::Recover {
            step: 0,
            option: Recovery::Park,
            reason: "step 0 (\"s0\") failed after 1 attempts: said FAILED".into()
        })
    );
    assert_eq!(
        pick(vec![Recovery::Compensate, Recovery::Retry]),
        Move::Journal(recover(0, Recovery::Compensate)).with_reason("said FAILED")
    );
    assert_eq!(
        plan::next(&r, &d, false, 0, &RegisteredOrder),
        Move::Journal(recover(0, Recovery::Retry)).with_reason("said FAILED")
    );
}

// -------------------------------------------------------------------- retry

#[test]
fn recover_retry_starts_a_new_generation_with_one_more_attempt() {
    let d = with_step(def_of(&[R]), 0, |s| s.retry.max_attempts = 3);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.ok(id, fi(0));
    h.now = 100;
    h.ok(id, fo(0, CallOutcome::Unknown));
    h.now = 160;
    h.ok(
        id,
        JournalEvent::ForwardOutcome {
            step: 0,
            reply: reconciled(CallOutcome::Failed),
        },
    );
    assert_eq!(
        h.plan(id, false),
        Move::Journal(recover(0, Recovery::Retry)).with_reason("status query said FAILED")
    );
    h.now = 500;
    h.ok(id, recover(0, Recovery::Retry));
    let c = fwd(&h.rec(id), 0);
    assert_eq!(c.operation_id, format!("{id}.0.f2"));
    assert_eq!((c.generation, c.attempts, c.intent_at_ms), (2, 2, 500));
    assert_eq!(c.outcome(), CallOutcome::Intended);
    assert_eq!((c.unknown_ms, c.reconciliations), (60, 1), "carried over generations");
    assert!(c.reason.is_empty());
    assert_eq!(h.plan(id, true), Move::CallForward { step: 0 });
    h.ok(id, fo(0, CallOutcome::Failed));
    h.ok(id, recover(0, Recovery::Retry));
    assert_eq!(fwd(&h.rec(id), 0).operation_id, format!("{id}.0.f3"));
    h.ok(id, fo(0, CallOutcome::Failed));
    // Three attempts: no fourth.
    refused_with(h.write(id, recover(0, Recovery::Retry)), "had its 3 attempts");
    assert_eq!(
        h.plan(id, false),
        Move::Journal(JournalEvent::Recover {
            step: 0,
            option: Recovery::Park,
            reason: "step 0 (\"s0\") failed after 3 attempts: said FAILED".into()
        })
    );
    h.ok(id, recover(0, Recovery::Park));
    let r = h.rec(id);
    assert_eq!(r.state, SagaState::Parked);
    assert_eq!(r.parked_from, Some(SagaState::Running));
    assert_eq!(r.parked_reason, "chose PARK");
}

// -------------------------------------------------------------------- stale

#[test]
fn a_stale_compensation_parks_the_saga_with_its_residual() {
    let d = with_step(def_of(&[C, C, P]), 1, |s| s.versioned = true);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    h.ok(id, fi(1));
    let mut rep = reply(CallOutcome::Ok);
    rep.resource_version = "v3".into();
    h.ok(id, JournalEvent::ForwardOutcome { step: 1, reply: rep });
    h.forward(id, 2, CallOutcome::Failed);
    h.ok(id, recover(2, Recovery::Compensate));
    h.ok(id, ci(1));
    let stale = Reply::of(CallOutcome::Stale, "precondition v3, resource at v5");
    assert_eq!(
        h.ok(id, JournalEvent::CompensationOutcome { step: 1, reply: stale }),
        SagaState::Parked
    );
    let r = h.rec(id);
    assert_eq!(r.parked_from, Some(SagaState::Compensating));
    assert_eq!(r.current, 1);
    assert!(r.parked_reason.contains("version moved on"), "{}", r.parked_reason);
    assert!(r.parked_reason.contains("\"s1\"") && r.parked_reason.contains("resource at v5"));
    assert_eq!(r.steps[1].residual, "not undone: precondition v3, resource at v5");
    assert_eq!(r.steps[1].precondition, "v3");
    assert_eq!(comp(&r, 1).outcome(), CallOutcome::Stale);
    assert!(r.steps[0].compensation.is_none(), "not compensated past the stale step");
    assert_eq!(h.plan(id, false), Move::Idle);
    assert!(h.book.driven().is_empty());
    refused_with(h.write(id, ci(1)), "only a RUNNING or COMPENSATING saga");
}

#[test]
fn a_residual_named_by_the_compensation_is_recorded() {
    let d = def_of(&[C, P]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    h.forward(id, 1, CallOutcome::Failed);
    h.ok(id, recover(1, Recovery::Compensate));
    h.ok(id, ci(0));
    let mut rep = reply(CallOutcome::Stale);
    rep.residual = "2 items shipped".into();
    h.ok(id, JournalEvent::CompensationOutcome { step: 0, reply: rep });
    assert_eq!(h.rec(id).steps[0].residual, "2 items shipped");
    // A partial undo that succeeded also keeps its residual.
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    h.forward(id, 1, CallOutcome::Failed);
    h.ok(id, recover(1, Recovery::Compensate));
    h.ok(id, ci(0));
    let mut rep = reply(CallOutcome::Ok);
    rep.residual = "fee kept".into();
    h.ok(id, JournalEvent::CompensationOutcome { step: 0, reply: rep });
    let r = h.rec(id);
    assert_eq!(
        (r.state, r.steps[0].residual.as_str()),
        (SagaState::Compensated, "fee kept")
    );
}

// ---------------------------------------------------------------- operator

/// A C,P,R saga parked at step `at` (whose forward FAILED; the steps
/// before went forward), every step registered [Park, Retry] and one
/// attempt.
fn parked_at(at: u32) -> (H, SagaId, Definition) {
    let mut d = def_of(&[C, P, R]);
    for s in &mut d.steps {
        s.on_failure = vec![Recovery::Park, Recovery::Retry];
        s.retry.max_attempts = 1;
    }
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    for i in 0..at {
        h.forward(id, i, CallOutcome::Ok);
    }
    h.forward(id, at, CallOutcome::Failed);
    assert_eq!(
        h.plan(id, false).with_reason("x"),
        Move::Journal(recover(at, Recovery::Park)).with_reason("x")
    );
    h.ok(id, recover(at, Recovery::Park));
    assert_eq!(h.rec(id).state, SagaState::Parked);
    (h, id, d)
}

#[test]
fn operator_retry_of_a_failed_call_gives_a_fresh_budget_and_a_new_generation() {
    let (mut h, id, _) = parked_at(0);
    assert_eq!(fwd(&h.rec(id), 0).attempts, 1);
    h.now = 7_000;
    assert_eq!(
        h.operate(id, OperatorAction::Retry, "bob", "limit raised"),
        Ok(SagaOk::Operated {
            state: SagaState::Running
        })
    );
    let r = h.rec(id);
    assert!(r.parked_reason.is_empty() && r.parked_from.is_none());
    let c = fwd(&r, 0);
    assert_eq!(c.operation_id, format!("{id}.0.f2"));
    assert_eq!((c.generation, c.attempts, c.intent_at_ms), (2, 1, 7_000));
    assert_eq!(c.outcome(), CallOutcome::Intended);
    // The intent was journaled by the operator, not by this orchestrator:
    // ask first.
    assert_eq!(h.plan(id, false), Move::QueryForward { step: 0 });
    assert_eq!(h.ok(id, fo(0, CallOutcome::Ok)), SagaState::Running);
    assert_eq!(h.rec(id).current, 1);
}

#[test]
fn operator_retry_of_an_unknown_call_keeps_its_operation_id_and_resets_attempts() {
    let d = with_step(def_of(&[C, P]), 0, |s| s.retry.max_attempts = 1);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.ok(id, fi(0));
    h.ok(id, fo(0, CallOutcome::Unknown));
    refused_with(h.write(id, fi(0)), "had its 1 attempts");
    h.ok(id, park("status query found nothing, attempts spent"));
    h.operate(id, OperatorAction::Retry, "bob", "try once more").unwrap();
    let c = fwd(&h.rec(id), 0);
    assert_eq!(
        (c.operation_id.as_str(), c.attempts, c.outcome()),
        ("1.0.f1", 0, CallOutcome::Unknown)
    );
    assert_eq!(h.plan(id, true), Move::QueryForward { step: 0 });
    h.ok(id, fi(0));
    assert_eq!(fwd(&h.rec(id), 0).attempts, 1);
}

#[test]
fn operator_retry_of_a_stale_compensation_makes_a_new_generation() {
    let d = def_of(&[C, P]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    h.forward(id, 1, CallOutcome::Failed);
    h.ok(id, recover(1, Recovery::Compensate));
    h.compensate(id, 0, CallOutcome::Stale);
    assert_eq!(
        h.operate(id, OperatorAction::Retry, "bob", "version restored"),
        Ok(SagaOk::Operated {
            state: SagaState::Compensating
        })
    );
    let c = comp(&h.rec(id), 0);
    assert_eq!((c.operation_id.as_str(), c.generation, c.attempts), ("1.0.c2", 2, 1));
    assert_eq!(h.plan(id, false), Move::QueryCompensation { step: 0 });
    assert_eq!(h.ok(id, co(0, CallOutcome::Ok)), SagaState::Compensated);
}

#[test]
fn operator_skip_of_a_forward_step_moves_the_saga_on() {
    let (mut h, id, _) = parked_at(0);
    assert_eq!(
        h.operate(id, OperatorAction::Skip, "bob", "done by hand"),
        Ok(SagaOk::Operated {
            state: SagaState::Running
        })
    );
    let r = h.rec(id);
    assert_eq!((r.current, r.past_pivot), (1, false));
    assert_eq!(fwd(&r, 0).outcome(), CallOutcome::Skipped);
    assert_eq!(h.plan(id, false), Move::Journal(fi(1)));
}

#[test]
fn operator_skip_of_the_pivot_sets_past_pivot() {
    let (mut h, id, _) = parked_at(1);
    h.operate(id, OperatorAction::Skip, "bob", "pivot done by hand")
        .unwrap();
    let r = h.rec(id);
    assert_eq!((r.state, r.current, r.past_pivot), (SagaState::Running, 2, true));
}

#[test]
fn operator_skip_of_the_last_step_completes_the_saga() {
    let (mut h, id, _) = parked_at(2);
    h.now = 8_000;
    assert_eq!(
        h.operate(id, OperatorAction::Skip, "bob", "shipped by hand"),
        Ok(SagaOk::Operated {
            state: SagaState::Completed
        })
    );
    assert_eq!(h.rec(id).ended_at_ms, 8_000);
}

#[test]
fn operator_skip_of_an_unknown_forward_call_settles_it() {
    let d = def_of(&[C, P]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.ok(id, fi(0));
    h.now = 1_000;
    h.ok(id, fo(0, CallOutcome::Unknown));
    h.ok(id, park("cannot tell"));
    h.now = 1_500;
    h.operate(id, OperatorAction::Skip, "bob", "checked by hand").unwrap();
    let c = fwd(&h.rec(id), 0);
    assert_eq!(
        (c.outcome(), c.unknown_ms, c.unknown_since_ms),
        (CallOutcome::Skipped, 500, 0)
    );
}

/// A C,C,P saga compensating at step 1, with rights expiring at 50_000.
fn compensating_with_rights_until_50s() -> (H, SagaId) {
    let d = def_of(&[C, C, P]);
    let mut h = H::new(&[&d]);
    let id = h.start_with(&d, "k", auth(50_000));
    h.forward(id, 0, CallOutcome::Ok);
    h.forward(id, 1, CallOutcome::Ok);
    h.forward(id, 2, CallOutcome::Failed);
    h.ok(id, recover(2, Recovery::Compensate));
    assert_eq!(h.rec(id).current, 1);
    (h, id)
}

#[test]
fn operator_skip_of_a_compensation_records_the_residual_and_moves_on() {
    let (mut h, id) = compensating_with_rights_until_50s();
    h.now = 50_000;
    let Move::Journal(ev) = h.plan(id, false) else { panic!() };
    h.ok(id, ev);
    let r = h.rec(id);
    assert_eq!(
        (r.state, r.parked_from),
        (SagaState::Parked, Some(SagaState::Compensating))
    );
    assert_eq!(
        h.operate(id, OperatorAction::Skip, "carol", "undone by hand"),
        Ok(SagaOk::Operated {
            state: SagaState::Compensating
        })
    );
    let r = h.rec(id);
    assert_eq!(r.current, 0);
    assert_eq!(comp(&r, 1).outcome(), CallOutcome::Skipped);
    assert_eq!(
        r.steps[1].residual,
        "compensation skipped by operator carol: undone by hand"
    );
    // Step 0: parked again (the rights are still expired), skipped again:
    // nothing left, COMPENSATED.
    let Move::Journal(ev) = h.plan(id, false) else { panic!() };
    h.ok(id, ev);
    assert_eq!(
        h.operate(id, OperatorAction::Skip, "carol", "also by hand"),
        Ok(SagaOk::Operated {
            state: SagaState::Compensated
        })
    );
    let r = h.rec(id);
    assert!(r.steps[0].residual.contains("skipped by operator carol"));
    assert_eq!(r.ended_at_ms, h.now - 10);
}

#[test]
fn operator_skip_of_a_stale_compensation_keeps_what_was_not_undone() {
    let d = def_of(&[C, C, P]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    h.forward(id, 1, CallOutcome::Ok);
    h.forward(id, 2, CallOutcome::Failed);
    h.ok(id, recover(2, Recovery::Compensate));
    h.compensate(id, 1, CallOutcome::Stale);
    h.operate(id, OperatorAction::Skip, "carol", "newer change wins")
        .unwrap();
    let r = h.rec(id);
    assert_eq!((r.state, r.current), (SagaState::Compensating, 0));
    assert_eq!(comp(&r, 1).outcome(), CallOutcome::Skipped);
    assert!(!r.steps[1].residual.is_empty(), "the residual says what was not undone");
    let last = r.operator_actions.last().unwrap();
    assert_eq!(
        (last.action, last.step, last.who.as_str()),
        (OperatorAction::Skip, 1, "carol")
    );
}

#[test]
fn operator_compensate_is_refused_past_the_pivot() {
    let (mut h, id, _) = parked_at(2);
    assert!(h.rec(id).past_pivot);
    let e = refused_with(
        h.operate(id, OperatorAction::Compensate, "bob", "undo all"),
        "only goes forward",
    );
    assert!(matches!(e, SagaError::WrongState { .. }));
    // Mark complete is the way out.
    assert_eq!(
        h.operate(id, OperatorAction::MarkComplete, "bob", "finished by hand"),
        Ok(SagaOk::Operated {
            state: SagaState::Completed
        })
    );
}

#[test]
fn operator_compensate_is_refused_when_parked_while_compensating() {
    let (mut h, id) = compensating_with_rights_until_50s();
    h.ok(id, park("held"));
    refused_with(
        h.operate(id, OperatorAction::Compensate, "bob", "undo"),
        "compensating already",
    );
}

#[test]
fn operator_compensate_before_the_pivot_compensates_from_the_parked_step() {
    let (mut h, id, _) = parked_at(1);
    assert_eq!(
        h.operate(id, OperatorAction::Compensate, "bob", "cancel"),
        Ok(SagaOk::Operated {
            state: SagaState::Compensating
        })
    );
    // The failed pivot did not happen: compensation starts at step 0.
    assert_eq!(h.rec(id).current, 0);
    assert_eq!(h.compensate(id, 0, CallOutcome::Ok), SagaState::Compensated);
}

#[test]
fn operator_mark_complete_completes_a_parked_saga() {
    let (mut h, id, _) = parked_at(0);
    h.now = 4_242;
    assert_eq!(
        h.operate(id, OperatorAction::MarkComplete, "bob", "settled offline"),
        Ok(SagaOk::Operated {
            state: SagaState::Completed
        })
    );
    let r = h.rec(id);
    assert!(r.parked_reason.is_empty() && r.parked_from.is_none());
    assert_eq!(r.ended_at_ms, 4_242);
    assert_eq!(h.plan(id, false), Move::Idle);
}

#[test]
fn operator_actions_are_refused_unless_the_saga_is_parked() {
    let d = def_of(&[C, P]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    for a in [
        OperatorAction::Retry,
        OperatorAction::Skip,
        OperatorAction::Compensate,
        OperatorAction::MarkComplete,
    ] {
        refused_with(h.operate(id, a, "bob", "why"), "only a PARKED saga");
    }
    h.forward(id, 0, CallOutcome::Ok);
    h.forward(id, 1, CallOutcome::Ok);
    assert_eq!(h.rec(id).state, SagaState::Completed);
    refused_with(h.operate(id, OperatorAction::Retry, "bob", "why"), "only a PARKED saga");
    assert_eq!(
        h.apply(SagaCommand::Operate {
            saga_id: 99,
            action: OperatorAction::Retry,
            who: "bob".into(),
            why: "why".into(),
            now_ms: 0
        })
        .0,
        Err(SagaError::NotFound(99))
    );
}

#[test]
fn operator_actions_need_who_and_why() {
    let (mut h, id, _) = parked_at(0);
    for (who, why) in [("", "why"), ("bob", ""), ("", "")] {
        let e = h.operate(id, OperatorAction::MarkComplete, who, why).unwrap_err();
        assert!(matches!(e, SagaError::Invalid(_)), "{e}");
    }
    assert_eq!(h.rec(id).state, SagaState::Parked);
}

#[test]
fn every_operator_action_is_recorded_with_who_why_step_and_time() {
    let (mut h, id, _) = parked_at(0);
    h.now = 100;
    h.operate(id, OperatorAction::Retry, "bob", "one more").unwrap();
    h.ok(id, fo(0, CallOutcome::Failed));
    h.ok(id, recover(0, Recovery::Park));
    h.now = 300;
    h.operate(id, OperatorAction::Skip, "carol", "by hand").unwrap();
    h.forward(id, 1, CallOutcome::Failed);
    h.ok(id, recover(1, Recovery::Park));
    h.now = 500;
    h.operate(id, OperatorAction::MarkComplete, "dave", "closed").unwrap();
    let got = h.rec(id).operator_actions;
    assert_eq!(
        got,
        vec![
            OperatorEntry {
                action: OperatorAction::Retry,
                who: "bob".into(),
                why: "one more".into(),
                at_ms: 100,
                step: 0
            },
            OperatorEntry {
                action: OperatorAction::Skip,
                who: "carol".into(),
                why: "by hand".into(),
                at_ms: 300,
                step: 0
            },
            OperatorEntry {
                action: OperatorAction::MarkComplete,
                who: "dave".into(),
                why: "closed".into(),
                at_ms: 500,
                step: 1
            },
        ]
    );
}

// -------------------------------------------------------------- plan::next

#[test]
fn plan_forward_moves() {
    let d = with_step(def_of(&[C, P]), 0, |s| s.retry.max_attempts = 2);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    // No intent: journal one, fresh or not.
    assert_eq!(h.plan(id, false), Move::Journal(fi(0)));
    assert_eq!(h.plan(id, true), Move::Journal(fi(0)));
    h.ok(id, fi(0));
    // Intended by this orchestrator: call. By an earlier one: ask.
    assert_eq!(h.plan(id, true), Move::CallForward { step: 0 });
    assert_eq!(h.plan(id, false), Move::QueryForward { step: 0 });
    h.ok(id, fo(0, CallOutcome::Unknown));
    // UNKNOWN: always ask.
    assert_eq!(h.plan(id, true), Move::QueryForward { step: 0 });
    assert_eq!(h.plan(id, false), Move::QueryForward { step: 0 });
    h.ok(id, fo(0, CallOutcome::Ok));
    assert_eq!(h.plan(id, false), Move::Journal(fi(1)));
}

#[test]
fn plan_after_a_failed_step_retries_while_attempts_remain_then_parks() {
    let mut d = def_of(&[R]);
    d.steps[0].retry.max_attempts = 2;
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Failed);
    assert_eq!(
        h.plan(id, false),
        Move::Journal(recover(0, Recovery::Retry)).with_reason("said FAILED")
    );
    h.ok(id, recover(0, Recovery::Retry));
    h.ok(id, fo(0, CallOutcome::Failed));
    assert_eq!(
        h.plan(id, false),
        Move::Journal(JournalEvent::Recover {
            step: 0,
            option: Recovery::Park,
            reason: "step 0 (\"s0\") failed after 2 attempts: said FAILED".into()
        })
    );
    // With retry as the only option: a plain park with the reason.
    let d = Definition {
        name: "only-retry".into(),
        ..with_step(def_of(&[R]), 0, |s| {
            s.retry.max_attempts = 1;
            s.on_failure = vec![Recovery::Retry];
        })
    };
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Failed);
    match h.plan(id, false) {
        Move::Journal(JournalEvent::Park { reason }) => {
            assert!(
                reason.contains("failed after 1 attempts") && reason.contains("said FAILED"),
                "{reason}"
            );
            h.ok(id, park(&reason));
        }
        m => panic!("{m:?}"),
    }
    assert_eq!(h.rec(id).state, SagaState::Parked);
}

#[test]
fn plan_parks_a_compensation_whose_rights_expired() {
    let (mut h, id) = compensating_with_rights_until_50s();
    h.now = 49_999;
    assert_eq!(h.plan(id, false), Move::Journal(ci(1)));
    h.now = 50_000;
    match h.plan(id, false) {
        Move::Journal(JournalEvent::Park { reason }) => {
            assert!(reason.contains("expired") && reason.contains("\"alice\""), "{reason}");
            assert!(reason.contains("step 1"), "{reason}");
        }
        m => panic!("{m:?}"),
    }
    // Also with a compensation under way.
    h.now = 40_000;
    h.ok(id, ci(1));
    h.now = 60_000;
    assert!(matches!(h.plan(id, true), Move::Journal(JournalEvent::Park { .. })));
    // Rights that never expire (0) never park.
    assert!(!auth(0).expired(u64::MAX));
}

#[test]
fn plan_compensation_moves() {
    let d = with_step(def_of(&[C, P]), 0, |s| s.retry.max_attempts = 2);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    h.forward(id, 1, CallOutcome::Failed);
    h.ok(id, recover(1, Recovery::Compensate));
    assert_eq!(h.plan(id, false), Move::Journal(ci(0)));
    assert_eq!(h.plan(id, true), Move::Journal(ci(0)));
    h.ok(id, ci(0));
    assert_eq!(h.plan(id, true), Move::AskThenCompensate { step: 0 });
    assert_eq!(h.plan(id, false), Move::QueryCompensation { step: 0 });
    h.ok(id, co(0, CallOutcome::Unknown));
    assert_eq!(h.plan(id, true), Move::QueryCompensation { step: 0 });
    h.ok(id, co(0, CallOutcome::Failed));
    assert_eq!(h.plan(id, false), Move::Journal(ci(0)), "under the limit");
    h.ok(id, ci(0));
    h.ok(id, co(0, CallOutcome::Failed));
    assert!(
        matches!(h.plan(id, false), Move::Journal(JournalEvent::Park { .. })),
        "over the limit"
    );
}

#[test]
fn plan_is_idle_for_ended_and_parked_sagas() {
    let d = def_of(&[C, P]);
    let mut h = H::new(&[&d]);
    let done = h.start(&d, "a");
    h.forward(done, 0, CallOutcome::Ok);
    h.forward(done, 1, CallOutcome::Ok);
    let undone = h.start(&d, "b");
    h.forward(undone, 0, CallOutcome::Failed);
    h.ok(undone, recover(0, Recovery::Compensate));
    let parked = h.start(&d, "c");
    h.ok(parked, park("held"));
    for (id, state) in [
        (done, SagaState::Completed),
        (undone, SagaState::Compensated),
        (parked, SagaState::Parked),
    ] {
        assert_eq!(h.rec(id).state, state);
        assert_eq!(h.plan(id, false), Move::Idle);
        assert_eq!(h.plan(id, true), Move::Idle);
    }
    assert!(h.book.driven().is_empty());
    assert_eq!(h.book.count_in(SagaState::Parked), 1);
}

// ------------------------------------------------ failed status queries

/// `QueryFailed` counts a saga's failed status queries in a row, so the
/// orchestrator's limit holds across leaders: it changes nothing in the
/// record but its seq, any other write resets it, it is in the snapshot
/// data, and it is refused at another step or with an error above the
/// limit (changing nothing, the count included).
#[test]
fn query_failures_count_in_a_row_until_the_next_other_write() {
    let d = def_of(&[C, P, R]);
    let mut h = H::new(&[&d]);
    let a = h.start(&d, "a");
    h.ok(a, fi(0));
    h.ok(a, fo(0, CallOutcome::Unknown));
    let qf = |step: u32, e: &str| JournalEvent::QueryFailed {
        step,
        error: e.to_string(),
    };
    assert_eq!(h.book.query_failures(a), 0);
    let before = h.rec(a);
    h.ok(a, qf(0, "unavailable"));
    h.ok(a, qf(0, "unavailable"));
    assert_eq!(h.book.query_failures(a), 2);
    let after = h.rec(a);
    assert_eq!(after.seq, before.seq + 2);
    assert_eq!(
        SagaRecord {
            seq: before.seq,
            ..after
        },
        before,
        "only the seq moved"
    );

    refused_with(h.write(a, qf(1, "x")), "at step 0");
    let long = "e".repeat(limits::REASON_BYTES_MAX + 1);
    assert!(matches!(h.write(a, qf(0, &long)), Err(SagaError::Invalid(_))));
    assert_eq!(h.book.query_failures(a), 2);

    let back = SagaBook::from_data(h.book.data());
    assert_eq!(back.query_failures(a), 2);
    assert_eq!(back, h.book);

    // Another saga's count is its own; another write resets this one.
    let b = h.start(&d, "b");
    h.ok(b, fi(0));
    h.ok(b, qf(0, "down"));
    h.ok(a, fo(0, CallOutcome::Ok));
    assert_eq!((h.book.query_failures(a), h.book.query_failures(b)), (0, 1));
    // A park (the orchestrator's at the limit) resets it too.
    h.ok(b, park("the status query failed 8 times in a row"));
    assert_eq!(h.book.query_failures(b), 0);
    assert_eq!(h.rec(b).state, SagaState::Parked);
}

// ------------------------------------------------------------ persistence

#[test]
fn the_book_round_trips_through_its_snapshot_data() {
    let d = def_of(&[C, P, R]);
    let mut h = H::new(&[&d]);
    let a = h.start(&d, "a");
    h.forward(a, 0, CallOutcome::Ok);
    let b = h.start(&d, "b");
    h.ok(b, fi(0));
    let back = SagaBook::from_data(h.book.data());
    assert_eq!(back, h.book);
    assert_eq!(back.next_saga_id(), 3);
    // Idempotency keys are rebuilt: the same start finds its saga.
    let mut h2 = H { book: back, now: h.now };
    let cmd = h2.start_cmd(&d, "b", 1, b"order-42", auth(0));
    assert_eq!(
        h2.apply(cmd).0,
        Ok(SagaOk::Started {
            saga_id: b,
            created: false
        })
    );
    // A resumed orchestrator plans the same move (asks about the intent).
    assert_eq!(h2.plan(b, false), Move::QueryForward { step: 0 });
    let ids: Vec<SagaId> = h2.book.sagas_after(1).map(|s| s.id).collect();
    assert_eq!(ids, vec![2]);
}

#[test]
fn from_parts_never_hands_out_an_id_in_use() {
    let d = def_of(&[R]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "a");
    let rec = h.rec(id);
    let mut h2 = H {
        book: SagaBook::from_parts(0, [d.clone()], [SagaRecord { id: 41, ..rec }]),
        now: 0,
    };
    assert_eq!(h2.start(&d, "b"), 42);
}

// ------------------------------------------------------- random drives

/// What a step service does, drawn at random.
fn pick<T: Copy>(rng: &mut StdRng, xs: &[T]) -> T {
    xs[rng.random_range(0..xs.len())]
}

/// Drives one saga with `plan::next` against randomly answering services
/// and a random operator, checking that the state machine never refuses a
/// write the plan asked for, that the journal's rules hold after every
/// write, and that the saga ends.
fn drive(seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let n_c = rng.random_range(0..3usize);
    let pivot = rng.random_bool(0.6);
    let n_r = rng.random_range(0..3usize);
    let mut kinds = vec![C; n_c];
    if pivot {
        kinds.push(P);
    }
    kinds.extend(vec![R; n_r]);
    if kinds.is_empty() {
        kinds.push(C);
    }
    let mut d = def_of(&kinds);
    for s in &mut d.steps {
        s.retry.max_attempts = rng.random_range(1..4);
        if s.kind == StepKind::Retriable && rng.random_bool(0.3) {
            s.on_failure = vec![Recovery::Retry];
        }
    }
    let expires = if rng.random_bool(0.2) {
        1_000 + rng.random_range(0..400)
    } else {
        0
    };
    let mut h = H::new(&[&d]);
    let id = h.start_with(&d, "k", auth(expires));
    let mut fresh = false;
    let mut writes = 0u64;
    let mut marked_complete = false;
    let ctx = |h: &H| format!("seed {seed}, {kinds:?}: {:#?}", h.rec(id));
    for _ in 0..3_000 {
        let r = h.rec(id);
        if r.state.ended() {
            break;
        }
        let mv = plan::next(&r, &d, fresh, h.now, &RegisteredOrder);
        fresh = false;
        let step = r.current;
        let max = d.steps[step as usize].retry.max_attempts;
        let ev = match mv {
            Move::Journal(ev) => {
                fresh = matches!(
                    ev,
                    JournalEvent::ForwardIntent { .. } | JournalEvent::CompensationIntent { .. }
                );
                Some(ev)
            }
            Move::CallForward { step } => Some(fo(
                step,
                pick(&mut rng, &[CallOutcome::Ok, CallOutcome::Failed, CallOutcome::Unknown]),
            )),
            Move::QueryForward { step } => match rng.random_range(0..4) {
                0 => Some(JournalEvent::ForwardOutcome {
                    step,
                    reply: reconciled(CallOutcome::Ok),
                }),
                1 => Some(JournalEvent::ForwardOutcome {
                    step,
                    reply: reconciled(CallOutcome::Failed),
                }),
                2 => Some(fo(step, CallOutcome::Unknown)),
                _ if fwd(&r, step).attempts < max => {
                    fresh = true;
                    Some(fi(step))
                }
                _ => Some(park("not applied and no attempt left")),
            },
            Move::AskThenCompensate { step } => {
                let happened = fwd(&r, step).outcome() == CallOutcome::Ok || rng.random_bool(0.5);
                if happened {
                    let o = pick(
                        &mut rng,
                        &[
                            CallOutcome::Ok,
                            CallOutcome::Failed,
                            CallOutcome::Unknown,
                            CallOutcome::Stale,
                        ],
                    );
                    Some(co(step, o))
                } else {
                    Some(co(step, CallOutcome::Noop))
                }
            }
            Move::QueryCompensation { step } => match rng.random_range(0..5) {
                0 => Some(co(step, CallOutcome::Ok)),
                1 => Some(co(step, CallOutcome::Noop)),
                2 => Some(co(step, CallOutcome::Failed)),
                3 => Some(co(step, CallOutcome::Unknown)),
                _ if comp(&r, step).attempts < max => {
                    fresh = true;
                    Some(ci(step))
                }
                _ => Some(park("compensation not applied and no attempt left")),
            },
            Move::Idle => {
                assert_eq!(r.state, SagaState::Parked, "{}", ctx(&h));
                assert!(!r.parked_reason.is_empty(), "{}", ctx(&h));
                let a = pick(
                    &mut rng,
                    &[
                        OperatorAction::Retry,
                        OperatorAction::Retry,
                        OperatorAction::Skip,
                        OperatorAction::Compensate,
                        OperatorAction::MarkComplete,
                    ],
                );
                let res = h.operate(id, a, "op", "random");
                // Compensate is refused past the point of no return: the
                // pivot passed, or a step that cannot be undone may have
                // happened.
                let no_return = r.past_pivot
                    || r.steps.iter().enumerate().any(|(i, s)| {
                        d.steps[i].kind != StepKind::Compensable
                            && s.forward.as_ref().is_some_and(|c| c.outcome().may_have_happened())
                    });
                let may_refuse =
                    a == OperatorAction::Compensate && (no_return || r.parked_from == Some(SagaState::Compensating));
                assert_eq!(res.is_err(), may_refuse, "{a:?}: {res:?} {}", ctx(&h));
                if res.is_ok() {
                    writes += 1;
                    marked_complete |= a == OperatorAction::MarkComplete;
                }
                None
            }
        };
        if let Some(ev) = ev {
            if let Err(e) = h.write(id, ev.clone()) {
                panic!("{ev:?} refused: {e} {}", ctx(&h));
            }
            writes += 1;
        }
        // The journal's rules.
        let r = h.rec(id);
        assert_eq!(r.seq, writes, "{}", ctx(&h));
        if r.past_pivot {
            assert!(
                !matches!(r.state, SagaState::Compensating | SagaState::Compensated),
                "past the pivot only forward: {}",
                ctx(&h)
            );
        }
        if r.state == SagaState::Compensating {
            assert_eq!(d.steps[r.current as usize].kind, StepKind::Compensable, "{}", ctx(&h));
        }
        for (i, s) in r.steps.iter().enumerate() {
            if let Some(c) = &s.forward {
                assert_eq!(c.operation_id, format!("{id}.{i}.f{}", c.generation), "{}", ctx(&h));
                assert!(c.attempts <= d.steps[i].retry.max_attempts, "{}", ctx(&h));
            } else if r.state == SagaState::Running {
                assert!(
                    i as u32 >= r.current,
                    "a step before the current one went forward: {}",
                    ctx(&h)
                );
            }
            if let Some(c) = &s.compensation {
                assert_eq!(d.steps[i].kind, StepKind::Compensable, "{}", ctx(&h));
                assert_eq!(c.operation_id, format!("{id}.{i}.c{}", c.generation), "{}", ctx(&h));
                assert!(c.attempts <= d.steps[i].retry.max_attempts, "{}", ctx(&h));
            }
            if s.forward.is_none() && s.compensation.is_some() {
                panic!("a compensation for a step never started: {}", ctx(&h));
            }
        }
        // An operator's mark-complete of a saga parked while compensating
        // ends it COMPENSATED by the operator's word: not checked here.
        if r.state == SagaState::Compensated && !marked_complete {
            for (i, s) in r.steps.iter().enumerate() {
                let may = s.forward.as_ref().is_some_and(|c| c.outcome().may_have_happened());
                if d.steps[i].kind == StepKind::Compensable && may {
                    let done = s.compensation.as_ref().map(|c| c.outcome());
                    assert!(
                        matches!(done, Some(CallOutcome::Ok | CallOutcome::Noop | CallOutcome::Skipped)),
                        "step {i} may have happened and is not undone: {}",
                        ctx(&h)
                    );
                }
            }
        }
        if r.state == SagaState::Completed && !marked_complete {
            for s in &r.steps {
                let o = s.forward.as_ref().map(|c| c.outcome());
                assert!(
                    matches!(o, Some(CallOutcome::Ok | CallOutcome::Skipped)),
                    "completed with a step not done: {}",
                    ctx(&h)
                );
            }
        }
    }
    assert!(h.rec(id).state.ended(), "the saga did not end: {}", ctx(&h));
}

#[test]
fn random_drives_never_have_a_planned_write_refused_and_keep_the_journal_rules() {
    for seed in 0..400 {
        drive(seed);
    }
}

// -------------------------------------------------------------- known bugs

/// A saga without a pivot: by the definition's own rule the last
/// COMPENSABLE step acts as the pivot, so RETRIABLE steps after it only go
/// forward. An operator's COMPENSATE at a parked RETRIABLE step would undo
/// the earlier steps while the RETRIABLE step's action may have happened.
#[test]
fn operator_compensate_is_refused_at_a_retriable_step_of_a_saga_without_pivot() {
    let d = def_of(&[C, R]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    h.ok(id, fi(1));
    h.ok(id, fo(1, CallOutcome::Unknown));
    h.ok(id, park("cannot tell"));
    assert!(h.operate(id, OperatorAction::Compensate, "bob", "undo").is_err());
}

/// The pivot's outcome is UNKNOWN (it may have happened): compensating the
/// steps before it would end the saga COMPENSATED with the pivot's action
/// possibly done. The rule (docs/sagas.md): an UNKNOWN outcome is
/// reconciled through the step's status query before retry or compensation.
#[test]
fn operator_compensate_is_refused_while_the_pivot_may_have_happened() {
    let d = def_of(&[C, P, R]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    h.ok(id, fi(1));
    h.ok(id, fo(1, CallOutcome::Unknown));
    h.ok(id, park("status query keeps timing out"));
    let res = h.operate(id, OperatorAction::Compensate, "bob", "undo");
    assert!(res.is_err(), "accepted: {res:?}, now {:?}", h.rec(id).state);
}

/// `Park` refuses an empty reason ("parks for an operator, never
/// silently"), but `Recover { option: Park }` parks with whatever reason
/// it carries, empty included.
#[test]
fn recover_park_with_an_empty_reason_is_refused() {
    let d = def_of(&[R]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Failed);
    let res = h.write(
        id,
        JournalEvent::Recover {
            step: 0,
            option: Recovery::Park,
            reason: String::new(),
        },
    );
    assert!(res.is_err(), "parked with reason {:?}", h.rec(id).parked_reason);
}

/// `Call::unknown_ms` is "summed over every UNKNOWN spell" and a
/// `Recover { Retry }` carries it (and the reconciliations) into the new
/// generation; an operator's retry of a FAILED call starts the new
/// generation from `Call::new` and loses both.
#[test]
fn operator_retry_keeps_the_time_spent_unknown() {
    let d = with_step(def_of(&[R]), 0, |s| s.on_failure = vec![Recovery::Park]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.ok(id, fi(0));
    h.now = 2_000;
    h.ok(id, fo(0, CallOutcome::Unknown));
    h.now = 2_300;
    h.ok(
        id,
        JournalEvent::ForwardOutcome {
            step: 0,
            reply: reconciled(CallOutcome::Failed),
        },
    );
    h.ok(id, recover(0, Recovery::Park));
    let before = fwd(&h.rec(id), 0);
    assert_eq!((before.unknown_ms, before.reconciliations), (300, 1));
    h.operate(id, OperatorAction::Retry, "bob", "again").unwrap();
    let after = fwd(&h.rec(id), 0);
    assert_eq!(after.generation, 2);
    assert_eq!((after.unknown_ms, after.reconciliations), (300, 1));
}

/// `Call::reconciliations` counts "status queries that settled an UNKNOWN
/// or a resumed intent"; an operator's skip is no status query, yet
/// `settle_unknown(now, false)` counts one for an UNKNOWN call.
#[test]
fn operator_skip_is_not_counted_as_a_reconciliation() {
    let d = def_of(&[C, P]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.ok(id, fi(0));
    h.ok(id, fo(0, CallOutcome::Unknown));
    h.ok(id, park("cannot tell"));
    h.operate(id, OperatorAction::Skip, "bob", "checked by hand").unwrap();
    assert_eq!(fwd(&h.rec(id), 0).reconciliations, 0);
}

// ------------------------------------------------------------- forgetting

#[test]
fn only_ended_sagas_past_their_retention_are_forgotten_and_their_ids_are_never_reused() {
    let d = def_of(&[C, P]);
    let mut h = H::new(&[&d]);
    let done = h.start(&d, "done");
    h.forward(done, 0, CallOutcome::Ok);
    assert_eq!(h.forward(done, 1, CallOutcome::Ok), SagaState::Completed);
    let ended_at = h.rec(done).ended_at_ms;
    let running = h.start(&d, "running");
    h.forward(running, 0, CallOutcome::Ok);
    assert_eq!(h.book.forgettable(ended_at, 10), vec![done]);
    assert!(h.book.forgettable(ended_at - 1, 10).is_empty());

    // A running saga, and an ended one inside its retention: refused.
    let before = h.book.clone();
    let forget = |id, ended_before_ms| SagaCommand::Forget {
        saga_id: id,
        ended_before_ms,
    };
    let (res, fx) = h.apply(forget(running, u64::MAX));
    assert!(matches!(res, Err(SagaError::WrongState { .. })), "{res:?}");
    let (res2, fx2) = h.apply(forget(done, ended_at - 1));
    assert!(
        matches!(&res2, Err(SagaError::Refused { what, .. }) if what.contains("retention")),
        "{res2:?}"
    );
    assert!(fx.is_empty() && fx2.is_empty());
    assert_eq!(h.book, before, "refusals change nothing");

    // Past it: removed with its key; a second forget finds nothing.
    let (res, fx) = h.apply(forget(done, ended_at));
    assert_eq!(res, Ok(SagaOk::Forgotten { removed: true }));
    assert_eq!(fx, vec![SagaEffect::Remove(done)]);
    assert!(h.book.get(done).is_none());
    let (res, fx) = h.apply(forget(done, ended_at));
    assert_eq!(res, Ok(SagaOk::Forgotten { removed: false }));
    assert!(fx.is_empty());

    // The key is free again and starts a new saga with a new id.
    let again = h.start(&d, "done");
    assert!(again > running, "ids only grow: {again}");
    // And the numbering survives the book's snapshot data.
    let restored = SagaBook::from_data(h.book.data());
    assert_eq!(restored.next_saga_id(), again + 1);
}

/// A policy that ranks PARK first and says whom it escalates to.
struct Pager;

impl RecoveryPolicy for Pager {
    fn rank(&self, _: &SagaRecord, _: &Definition, _: u32, registered: &[Recovery]) -> Vec<Recovery> {
        let mut v = registered.to_vec();
        v.sort_by_key(|o| *o != Recovery::Park);
        v
    }

    fn escalation_reason(&self, saga: &SagaRecord, _: &Definition, step: u32, default: String) -> String {
        format!("paged the payments on-call for saga {} step {step}: {default}", saga.id)
    }
}

#[test]
fn a_policy_may_word_the_escalation_but_only_among_registered_options() {
    let d = with_step(def_of(&[C, P, R]), 1, |s| {
        s.on_failure = vec![Recovery::Compensate, Recovery::Park]
    });
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    h.forward(id, 1, CallOutcome::Failed);
    let r = h.rec(id);
    let def = h.book.definition("shop", 1).unwrap().clone();
    match plan::next(&r, &def, false, h.now, &Pager) {
        Move::Journal(JournalEvent::Recover {
            option: Recovery::Park,
            reason,
            ..
        }) => {
            assert!(
                reason.starts_with("paged the payments on-call for saga 1 step 1: step 1"),
                "{reason}"
            );
        }
        other => panic!("{other:?}"),
    }
    // A step that did not register PARK: the policy's ranking of it is
    // ignored and the registered option runs.
    let d2 = Definition {
        name: "other".into(),
        ..with_step(def_of(&[C, P, R]), 1, |s| s.on_failure = vec![Recovery::Compensate])
    };
    let mut h2 = H::new(&[&d2]);
    let id2 = h2.start(&d2, "k");
    h2.forward(id2, 0, CallOutcome::Ok);
    h2.forward(id2, 1, CallOutcome::Failed);
    let r2 = h2.rec(id2);
    let def2 = h2.book.definition("other", 1).unwrap().clone();
    assert!(matches!(
        plan::next(&r2, &def2, false, h2.now, &Pager),
        Move::Journal(JournalEvent::Recover {
            option: Recovery::Compensate,
            ..
        })
    ));
}

#[test]
fn a_list_page_stops_at_its_limit_and_names_where_to_go_on() {
    let d = def_of(&[C, P]);
    let mut h = H::new(&[&d]);
    let ids: Vec<SagaId> = (0..5).map(|i| h.start(&d, &format!("k{i}"))).collect();
    h.forward(ids[1], 0, CallOutcome::Failed);
    let ended = h.ok(
        ids[1],
        JournalEvent::Recover {
            step: 0,
            option: Recovery::Compensate,
            reason: "out of stock".into(),
        },
    );
    assert_eq!(ended, SagaState::Compensated);
    let all = |_: &SagaRecord| true;
    let (page, next) = h.book.list(0, 2, all);
    assert_eq!(page.iter().map(|s| s.id).collect::<Vec<_>>(), ids[..2]);
    assert_eq!(next, ids[1]);
    let (page, next) = h.book.list(next, 10, all);
    assert_eq!(page.iter().map(|s| s.id).collect::<Vec<_>>(), ids[2..]);
    assert_eq!(next, 0, "nothing follows");
    // Exactly `limit` left: no next page is promised.
    assert_eq!(h.book.list(ids[2], 2, all).1, 0);
    let (page, _) = h.book.list(0, 10, |s| s.state == SagaState::Compensated);
    assert_eq!(page.iter().map(|s| s.id).collect::<Vec<_>>(), vec![ids[1]]);
}

// ------------------------------------------------- cancel and deadline

/// The cancel of saga `id` by alice, through `apply` (a repeat changes
/// nothing and so does not fit `H::operate`'s checks).
fn cancel_cmd(h: &H, id: SagaId) -> SagaCommand {
    SagaCommand::Operate {
        saga_id: id,
        action: OperatorAction::Cancel,
        who: "alice".into(),
        why: "the customer called it off".into(),
        now_ms: h.now,
    }
}

#[test]
fn a_cancel_before_the_pivot_compensates_done_steps_newest_first_and_asks_about_the_step_in_flight() {
    let d = def_of(&[C, C, P, R]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    h.ok(id, fi(1));
    let planned = h.rec(id).seq;
    let res = h.operate(id, OperatorAction::Cancel, "alice", "the customer called it off");
    assert_eq!(
        res,
        Ok(SagaOk::Operated {
            state: SagaState::Compensating
        })
    );
    let r = h.rec(id);
    assert_eq!(
        r.current, 1,
        "the step in flight may have happened: it is settled first"
    );
    assert_eq!(r.cancel_reason, "cancelled by alice: the customer called it off");
    let last = r.operator_actions.last().unwrap();
    assert_eq!(
        (last.action, last.who.as_str(), last.step),
        (OperatorAction::Cancel, "alice", 1)
    );
    assert_eq!(
        fwd(&r, 1).outcome(),
        CallOutcome::Intended,
        "the forward call in flight is not taken as failed"
    );
    // The orchestrator's outcome of the call in flight, planned before the
    // cancel, is refused: the journal moved on.
    let e = h.write_at(id, planned, fo(1, CallOutcome::Ok)).unwrap_err();
    assert!(matches!(e, SagaError::StaleJournal { .. }), "{e}");
    // Nothing goes forward: the compensation of step 1 asks first
    // (fencing the forward operation), then step 0 is undone.
    assert_eq!(h.plan(id, false), Move::Journal(ci(1)));
    h.ok(id, ci(1));
    assert_eq!(h.plan(id, true), Move::AskThenCompensate { step: 1 });
    h.ok(id, co(1, CallOutcome::Noop));
    assert_eq!(h.rec(id).current, 0);
    assert_eq!(h.compensate(id, 0, CallOutcome::Ok), SagaState::Compensated);
    let r = h.rec(id);
    assert!(
        r.steps[2].forward.is_none() && r.steps[3].forward.is_none(),
        "nothing ran past the cancel"
    );
    assert_eq!(r.cancel_reason, "cancelled by alice: the customer called it off");
}

#[test]
fn a_cancel_keeps_an_unknown_forward_unknown_and_settles_it_by_asking() {
    let d = def_of(&[C, P]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Unknown);
    h.operate(id, OperatorAction::Cancel, "alice", "too slow").unwrap();
    let r = h.rec(id);
    assert_eq!((r.state, r.current), (SagaState::Compensating, 0));
    assert_eq!(fwd(&r, 0).outcome(), CallOutcome::Unknown, "UNKNOWN is never FAILED");
    h.ok(id, ci(0));
    // Asked (and fenced) before anything is undone.
    assert_eq!(h.plan(id, true), Move::AskThenCompensate { step: 0 });
    // The status query found it applied: undone.
    h.ok(id, co(0, CallOutcome::Ok));
    assert_eq!(h.rec(id).state, SagaState::Compensated);
}

#[test]
fn a_cancel_before_any_call_ends_compensated_with_nothing_to_undo() {
    let d = def_of(&[C, P]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    let res = h.operate(id, OperatorAction::Cancel, "alice", "changed my mind");
    assert_eq!(
        res,
        Ok(SagaOk::Operated {
            state: SagaState::Compensated
        })
    );
    let r = h.rec(id);
    assert!(r.steps[0].forward.is_none() && r.steps[0].compensation.is_none());
    assert_eq!(r.ended_at_ms, r.operator_actions[0].at_ms);
}

#[test]
fn a_cancel_is_refused_past_the_point_of_no_return() {
    let d = def_of(&[C, P, R]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    // The pivot's call may be in flight: it may have happened.
    h.ok(id, fi(1));
    let e = refused_with(
        h.operate(id, OperatorAction::Cancel, "alice", "late"),
        "point of no return",
    );
    assert!(e.to_string().contains("cannot be cancelled"), "{e}");
    assert!(e.to_string().contains("PIVOT"), "{e}");
    h.ok(id, fo(1, CallOutcome::Ok));
    let e = refused_with(
        h.operate(id, OperatorAction::Cancel, "alice", "later"),
        "past its pivot",
    );
    assert!(matches!(e, SagaError::WrongState { .. }), "{e}");
    assert_eq!(h.rec(id).state, SagaState::Running);
    assert!(h.rec(id).cancel_reason.is_empty());
    // A saga without a pivot whose forward-only step may have happened.
    let d2 = Definition {
        name: "no-pivot".into(),
        ..def_of(&[C, R, R])
    };
    let mut h = H::new(&[&d2]);
    let id = h.start(&d2, "k2");
    h.forward(id, 0, CallOutcome::Ok);
    h.forward(id, 1, CallOutcome::Unknown);
    refused_with(h.operate(id, OperatorAction::Cancel, "alice", "x"), "RETRIABLE");
}

#[test]
fn a_repeated_cancel_changes_nothing_and_other_states_refuse_one() {
    let d = def_of(&[C, C, P]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    h.operate(id, OperatorAction::Cancel, "alice", "first").unwrap();
    let before = h.book.clone();
    let (res, effects) = h.apply(cancel_cmd(&h, id));
    assert_eq!(
        res,
        Ok(SagaOk::Operated {
            state: SagaState::Compensating
        })
    );
    assert!(effects.is_empty());
    assert_eq!(h.book, before, "a repeated cancel is no write");
    // Parked while compensating the cancel: a repeat still answers.
    h.ok(id, park("the compensation keeps failing"));
    let (res, effects) = h.apply(cancel_cmd(&h, id));
    assert_eq!(
        res,
        Ok(SagaOk::Operated {
            state: SagaState::Parked
        })
    );
    assert!(effects.is_empty());

    // Compensating because a step failed (not cancelled): refused.
    let id2 = h.start(&d, "k2");
    h.forward(id2, 0, CallOutcome::Ok);
    h.forward(id2, 1, CallOutcome::Failed);
    h.ok(id2, recover(1, Recovery::Compensate));
    assert_eq!(h.rec(id2).state, SagaState::Compensating);
    refused_with(
        h.operate(id2, OperatorAction::Cancel, "alice", "x"),
        "only a RUNNING saga",
    );
    // Ended: refused.
    let id3 = h.start(&d, "k3");
    h.forward(id3, 0, CallOutcome::Ok);
    h.forward(id3, 1, CallOutcome::Ok);
    h.forward(id3, 2, CallOutcome::Ok);
    assert_eq!(h.rec(id3).state, SagaState::Completed);
    refused_with(h.operate(id3, OperatorAction::Cancel, "alice", "x"), "COMPLETED");
    // Who and why are required, as for every operator's action.
    let id4 = h.start(&d, "k4");
    assert!(matches!(
        h.operate(id4, OperatorAction::Cancel, "alice", ""),
        Err(SagaError::Invalid(_))
    ));
    // Parked while running: a cancel compensates from the parked step.
    h.forward(id4, 0, CallOutcome::Ok);
    h.ok(id4, fi(1));
    h.ok(id4, park("status query keeps failing"));
    let res = h.operate(id4, OperatorAction::Cancel, "alice", "give up");
    assert_eq!(
        res,
        Ok(SagaOk::Operated {
            state: SagaState::Compensating
        })
    );
    let r = h.rec(id4);
    assert_eq!((r.current, r.parked_reason.as_str(), r.parked_from), (1, "", None));
}

/// Saga "k" of `d` started at 1 000 ms with a deadline of 500 ms.
fn start_with_deadline(h: &mut H, d: &Definition, key: &str) -> SagaId {
    let mut cmd = h.start_cmd(d, key, 1, b"order-42", auth(0));
    if let SagaCommand::Start { deadline_ms, .. } = &mut cmd {
        *deadline_ms = 500;
    }
    match h.apply(cmd) {
        (Ok(SagaOk::Started { saga_id, created: true }), _) => saga_id,
        other => panic!("start refused: {other:?}"),
    }
}

#[test]
fn past_its_deadline_a_saga_before_its_pivot_is_compensated_as_if_cancelled() {
    let d = def_of(&[C, C, P, R]);
    let mut h = H::new(&[&d]);
    h.now = 1_000;
    let id = start_with_deadline(&mut h, &d, "k");
    assert_eq!(h.rec(id).deadline_at_ms, 1_500);
    h.forward(id, 0, CallOutcome::Ok);
    assert_eq!(
        h.plan(id, false),
        Move::Journal(fi(1)),
        "before its deadline it goes on"
    );
    // Written before the deadline (by its own clock): refused.
    let early = JournalEvent::DeadlinePassed { reason: "early".into() };
    refused_with(h.write(id, early), "not passed");
    h.now = 1_500;
    let Move::Journal(ev @ JournalEvent::DeadlinePassed { .. }) = h.plan(id, false) else {
        panic!("the plan past the deadline: {:?}", h.plan(id, false))
    };
    let JournalEvent::DeadlinePassed { reason } = &ev else {
        unreachable!()
    };
    assert!(
        reason.contains("deadline passed at 1500 ms") && reason.contains("\"s1\""),
        "{reason}"
    );
    assert_eq!(h.ok(id, ev.clone()), SagaState::Compensating);
    let r = h.rec(id);
    assert_eq!(r.current, 0, "step 1 never started: only step 0 is undone");
    assert_eq!(&r.cancel_reason, reason, "the journal records why it stopped");
    assert_eq!(h.compensate(id, 0, CallOutcome::Ok), SagaState::Compensated);
    // A cancel after it answers as it is.
    let (res, effects) = h.apply(cancel_cmd(&h, id));
    assert_eq!(
        res,
        Ok(SagaOk::Operated {
            state: SagaState::Compensated
        })
    );
    assert!(effects.is_empty());
}

#[test]
fn past_its_deadline_a_saga_beyond_its_pivot_goes_on_forward() {
    let d = def_of(&[C, P, R]);
    let mut h = H::new(&[&d]);
    h.now = 1_000;
    let id = start_with_deadline(&mut h, &d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    h.ok(id, fi(1));
    h.now = 5_000;
    // The pivot's call may have happened: no deadline turns it back.
    assert_eq!(h.plan(id, false), Move::QueryForward { step: 1 });
    let ev = JournalEvent::DeadlinePassed { reason: "late".into() };
    refused_with(h.write(id, ev.clone()), "only goes forward");
    h.ok(id, fo(1, CallOutcome::Ok));
    assert_eq!(h.plan(id, false), Move::Journal(fi(2)));
    refused_with(h.write(id, ev), "past its pivot");
    // Without a deadline, no time is too late.
    let id2 = h.start(&d, "k2");
    h.now = u64::MAX / 2;
    assert_eq!(h.rec(id2).deadline_at_ms, 0);
    assert_eq!(h.plan(id2, false), Move::Journal(fi(0)));
}

#[test]
fn a_deadline_and_a_cancel_reason_round_trip_through_the_snapshot_data() {
    let d = def_of(&[C, P]);
    let mut h = H::new(&[&d]);
    let a = start_with_deadline(&mut h, &d, "a");
    let b = h.start(&d, "b");
    h.forward(b, 0, CallOutcome::Ok);
    h.operate(b, OperatorAction::Cancel, "alice", "stop").unwrap();
    let back = SagaBook::from_data(h.book.data());
    assert_eq!(back, h.book);
    assert_eq!(back.get(a).unwrap().deadline_at_ms, 1_500);
    assert_eq!(back.get(b).unwrap().cancel_reason, "cancelled by alice: stop");
}

// ------------------------------------------------------ READ_ONLY steps

#[test]
fn read_only_steps_stand_anywhere_and_name_no_compensation() {
    for kinds in [
        vec![RO, C, P, R],
        vec![C, RO, P, R],
        vec![C, P, RO, R],
        vec![C, P, R, RO],
        vec![RO],
        vec![RO, RO, P],
    ] {
        assert_eq!(def_of(&kinds).validate(), Ok(()), "{kinds:?}");
    }
    let d = with_step(def_of(&[C, RO, P]), 1, |s| s.compensation = Some("undo".into()));
    assert_eq!(
        refusal(&d),
        format!(
            "{}: a READ_ONLY step cannot have a compensation (it is never undone)",
            at(1, "s1")
        )
    );
    assert_eq!(step("a", RO).recovery(), vec![Recovery::Retry, Recovery::Park]);
}

#[test]
fn compensate_option_on_a_read_only_step_only_before_the_point_of_no_return() {
    let before = with_step(def_of(&[C, RO, P]), 1, |s| s.on_failure = vec![Recovery::Compensate]);
    assert_eq!(before.validate(), Ok(()));
    for kinds in [[C, P, RO], [C, R, RO]] {
        let d = with_step(def_of(&kinds), 2, |s| s.on_failure = vec![Recovery::Compensate]);
        let e = refusal(&d);
        assert!(
            e.starts_with(&format!(
                "{}: COMPENSATE is not a recovery option of a READ_ONLY step after",
                at(2, "s2")
            )),
            "{e}"
        );
    }
}

#[test]
fn a_read_only_check_that_says_no_compensates_the_steps_before_it_and_nothing_of_its_own() {
    // reserve (C), check (RO, COMPENSATE registered), charge (P).
    let d = with_step(def_of(&[C, RO, P]), 1, |s| s.on_failure = vec![Recovery::Compensate]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    h.forward(id, 1, CallOutcome::Failed);
    assert_eq!(
        h.plan(id, false),
        Move::Journal(recover(1, Recovery::Compensate)).with_reason("said FAILED")
    );
    assert_eq!(h.ok(id, recover(1, Recovery::Compensate)), SagaState::Compensating);
    // Straight to the COMPENSABLE step: the check has nothing to undo.
    assert_eq!(h.rec(id).current, 0);
    assert_eq!(h.compensate(id, 0, CallOutcome::Ok), SagaState::Compensated);
    assert!(h.rec(id).steps[1].compensation.is_none());
}

#[test]
fn a_read_only_step_done_is_no_point_of_no_return() {
    // A saga without a pivot: a READ_ONLY step that ran does not stop a
    // cancel from compensating, where a RETRIABLE one would.
    let d = def_of(&[C, RO, C]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    h.forward(id, 1, CallOutcome::Ok);
    assert_eq!(
        h.operate(id, OperatorAction::Cancel, "alice", "customer asked")
            .map(|_| h.rec(id).state),
        Ok(SagaState::Compensating)
    );
    let d = def_of(&[C, R, R]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    h.forward(id, 1, CallOutcome::Ok);
    refused_with(
        h.operate(id, OperatorAction::Cancel, "alice", "customer asked"),
        "point of no return",
    );
}

// ------------------------- outputs, PENDING steps and approvals (issue 41)

fn ok_with(output: &[u8]) -> Reply {
    Reply {
        output: output.to_vec(),
        ..reply(CallOutcome::Ok)
    }
}

impl H {
    fn complete(&mut self, id: SagaId, step: u32, op: &str, reply: Reply, who: &str) -> Result<SagaOk, SagaError> {
        let before = self.book.clone();
        let (res, effects) = self.apply(SagaCommand::Complete {
            saga_id: id,
            step,
            operation_id: op.to_string(),
            reply,
            who: who.to_string(),
            now_ms: self.now,
        });
        match &res {
            Ok(SagaOk::Completed { changed: true, state }) => {
                assert_eq!(effects, vec![SagaEffect::Put(id)]);
                assert_eq!(*state, self.rec(id).state);
                assert_eq!(
                    self.rec(id).seq,
                    before.get(id).unwrap().seq + 1,
                    "a completion is a write"
                );
            }
            Ok(SagaOk::Completed { changed: false, .. }) | Err(_) => {
                assert!(effects.is_empty(), "a repeated or refused completion emits nothing");
                assert_eq!(self.book, before, "a repeated or refused completion changes nothing");
            }
            Ok(other) => panic!("a completion answered {other:?}"),
        }
        self.now += 10;
        res
    }
}

#[test]
fn a_forward_output_is_journaled_with_its_ok_and_only_an_ok_carries_one() {
    let d = def_of(&[C, P, R]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.ok(id, fi(0));
    h.ok(
        id,
        JournalEvent::ForwardOutcome {
            step: 0,
            reply: ok_with(b"reservation r-7"),
        },
    );
    assert_eq!(fwd(&h.rec(id), 0).output, b"reservation r-7");
    // And it survives the book's snapshot data.
    assert_eq!(
        SagaBook::from_data(h.book.data()).get(id).unwrap().steps[0]
            .forward
            .as_ref()
            .unwrap()
            .output,
        b"reservation r-7"
    );
    h.ok(id, fi(1));
    let failed_with_output = JournalEvent::ForwardOutcome {
        step: 1,
        reply: Reply {
            output: b"x".to_vec(),
            ..reply(CallOutcome::Failed)
        },
    };
    refused_with(h.write(id, failed_with_output), "only an OK carries an output");
    let too_big = JournalEvent::ForwardOutcome {
        step: 1,
        reply: ok_with(&vec![7; limits::SAGA_STEP_OUTPUT_BYTES_MAX + 1]),
    };
    refused_with(h.write(id, too_big), "saga_step_output_bytes_max");
    let at_limit = JournalEvent::ForwardOutcome {
        step: 1,
        reply: ok_with(&vec![7; limits::SAGA_STEP_OUTPUT_BYTES_MAX]),
    };
    h.ok(id, at_limit);
    assert_eq!(fwd(&h.rec(id), 1).output.len(), limits::SAGA_STEP_OUTPUT_BYTES_MAX);
}

#[test]
fn a_pending_step_waits_until_its_completion_and_the_plan_does_nothing_meanwhile() {
    let d = def_of(&[C, P, R]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    assert_eq!(h.forward(id, 0, CallOutcome::Pending), SagaState::Running);
    let r = h.rec(id);
    assert_eq!((r.current, fwd(&r, 0).outcome()), (0, CallOutcome::Pending));
    assert_eq!(
        h.plan(id, false),
        Move::Idle,
        "nothing is asked or called while PENDING"
    );
    assert_eq!(h.plan(id, true), Move::Idle);
    // A second reply for it (a duplicate) is refused: PENDING is settled.
    refused_with(h.write(id, fo(0, CallOutcome::Ok)), "no forward call is waiting");
    let op = fwd(&r, 0).operation_id;
    refused_with(
        h.complete(id, 0, "1.0.f9", ok_with(b"o"), "cb"),
        "is not the step's forward call",
    );
    refused_with(
        h.complete(id, 1, &op, ok_with(b"o"), "cb"),
        "no forward call of this step",
    );
    refused_with(h.complete(id, 0, &op, reply(CallOutcome::Noop), "cb"), "OK or FAILED");
    refused_with(h.complete(id, 0, &op, ok_with(b"o"), ""), "records who");
    let seq = h.rec(id).seq;
    assert!(matches!(
        h.complete(id, 0, &op, ok_with(b"approved by ann"), "callback"),
        Ok(SagaOk::Completed {
            changed: true,
            state: SagaState::Running
        })
    ));
    let r = h.rec(id);
    assert_eq!(r.current, 1, "the saga went on");
    let c = fwd(&r, 0);
    assert_eq!(
        (c.outcome(), c.output.as_slice(), c.completed_by.as_str()),
        (CallOutcome::Ok, &b"approved by ann"[..], "callback")
    );
    // A write planned before the completion is fenced by it.
    refused_with(h.write_at(id, seq, fo(0, CallOutcome::Ok)), "planned on journal length");
    // The same completion again: answered, nothing changes; another is refused.
    assert!(matches!(
        h.complete(id, 0, &op, ok_with(b"approved by ann"), "callback"),
        Ok(SagaOk::Completed { changed: false, .. })
    ));
    refused_with(
        h.complete(id, 0, &op, reply(CallOutcome::Failed), "callback"),
        "was completed OK by callback already",
    );
}

#[test]
fn a_completion_may_overtake_the_calls_own_reply_and_a_failed_one_takes_the_recovery_path() {
    let d = def_of(&[C, P, R]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.ok(id, fi(0));
    let op = fwd(&h.rec(id), 0).operation_id;
    // INTENDED: the callback arrived before the reply was journaled.
    assert!(matches!(
        h.complete(id, 0, &op, reply(CallOutcome::Failed), "callback"),
        Ok(SagaOk::Completed { changed: true, .. })
    ));
    // The reply (PENDING) comes late: refused, nothing waits for it.
    refused_with(h.write(id, fo(0, CallOutcome::Pending)), "no forward call is waiting");
    // FAILED: the registered recovery (COMPENSATE: nothing before step 0).
    assert_eq!(
        h.plan(id, false),
        Move::Journal(recover(0, Recovery::Compensate)).with_reason("said FAILED")
    );
}

#[test]
fn a_cancel_of_a_pending_step_compensates_it_and_a_late_completion_is_refused() {
    let d = def_of(&[C, C, P]);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    h.forward(id, 1, CallOutcome::Pending);
    let op = fwd(&h.rec(id), 1).operation_id;
    assert!(h
        .operate(id, OperatorAction::Cancel, "app", "customer changed their mind")
        .is_ok());
    let r = h.rec(id);
    assert_eq!(
        (r.state, r.current),
        (SagaState::Compensating, 1),
        "the PENDING step may have happened: it is undone first"
    );
    assert_eq!(h.plan(id, false), Move::Journal(ci(1)));
    refused_with(
        h.complete(id, 1, &op, ok_with(b"late"), "callback"),
        "no longer waits for step 1",
    );
    // A pending pivot is a point of no return: no cancel.
    let d2 = def_of(&[C, P, R]);
    let mut h2 = H::new(&[&d2]);
    let id2 = h2.start(&d2, "k2");
    h2.forward(id2, 0, CallOutcome::Ok);
    h2.forward(id2, 1, CallOutcome::Pending);
    refused_with(
        h2.operate(id2, OperatorAction::Cancel, "app", "too late"),
        "point of no return",
    );
}

/// A saga of `d` (C, C, P) whose step 1 failed and that compensates:
/// step 0's compensation comes next.
fn compensating_from_step_1(d: &Definition) -> (H, SagaId) {
    let mut h = H::new(&[d]);
    let id = h.start(d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    h.forward(id, 1, CallOutcome::Failed);
    h.ok(id, recover(1, Recovery::Compensate));
    (h, id)
}

#[test]
fn a_high_impact_compensation_waits_for_an_approval_and_the_journal_enforces_it() {
    let d = with_step(def_of(&[C, C, P]), 0, |s| s.high_impact = true);
    let (mut h, id) = compensating_from_step_1(&d);
    assert_eq!(h.rec(id).current, 0);
    // The journal refuses the compensation without an approval, whoever plans it.
    refused_with(h.write(id, ci(0)), "high-impact");
    let Move::Journal(ev @ JournalEvent::AwaitApproval { step: 0, .. }) = h.plan(id, false) else {
        panic!("the plan waits for an approval: {:?}", h.plan(id, false))
    };
    assert_eq!(h.ok(id, ev), SagaState::Parked);
    let r = h.rec(id);
    assert_eq!(r.awaiting_approval, Some(0));
    assert!(r.parked_reason.contains("high-impact"), "{}", r.parked_reason);
    // A retry would only ask again: refused with what to do.
    refused_with(
        h.operate(id, OperatorAction::Retry, "ops", "go"),
        "waits for an approval",
    );
    assert!(h
        .operate(id, OperatorAction::Approve, "ann", "refund checked with finance")
        .is_ok());
    let r = h.rec(id);
    assert_eq!((r.state, r.awaiting_approval), (SagaState::Compensating, None));
    assert_eq!(r.steps[0].approved_by, "ann");
    assert_eq!(
        r.operator_actions.last().map(|a| a.action),
        Some(OperatorAction::Approve)
    );
    assert_eq!(h.plan(id, false), Move::Journal(ci(0)));
    assert_eq!(h.compensate(id, 0, CallOutcome::Ok), SagaState::Compensated);
    // Approve is only for a saga that waits for one.
    let id2 = h.start(&d, "k2");
    h.forward(id2, 0, CallOutcome::Ok);
    h.ok(id2, park("stop"));
    refused_with(
        h.operate(id2, OperatorAction::Approve, "ann", "x"),
        "does not wait for an approval",
    );
}

#[test]
fn skipping_an_awaited_approval_records_the_residual_and_goes_on() {
    let d = with_step(def_of(&[C, C, P]), 0, |s| s.high_impact = true);
    let (mut h, id) = compensating_from_step_1(&d);
    let Move::Journal(ev) = h.plan(id, false) else { panic!() };
    h.ok(id, ev);
    assert!(h.operate(id, OperatorAction::Skip, "ann", "refunded by hand").is_ok());
    let r = h.rec(id);
    assert_eq!((r.state, r.awaiting_approval), (SagaState::Compensated, None));
    assert!(r.steps[0].residual.contains("skipped"), "{}", r.steps[0].residual);
}

/// Gates every compensation (as a configured rule may).
struct GateAll;

impl RecoveryPolicy for GateAll {
    fn rank(&self, _: &SagaRecord, _: &Definition, _: u32, registered: &[Recovery]) -> Vec<Recovery> {
        registered.to_vec()
    }

    fn needs_approval(&self, _: &SagaRecord, _: &Definition, _: u32, _: bool) -> bool {
        true
    }
}

#[test]
fn a_policy_may_gate_a_compensation_the_definition_did_not_mark() {
    let d = def_of(&[C, C, P]);
    let (h, id) = compensating_from_step_1(&d);
    let r = h.rec(id);
    assert!(matches!(
        plan::next(&r, &d, false, h.now, &GateAll),
        Move::Journal(JournalEvent::AwaitApproval { step: 0, .. })
    ));
    assert_eq!(plan::next(&r, &d, false, h.now, &RegisteredOrder), Move::Journal(ci(0)));
}

#[test]
fn a_high_impact_mark_on_a_step_without_a_compensation_is_refused() {
    let d = with_step(def_of(&[C, P, R]), 1, |s| s.high_impact = true);
    assert!(
        refusal(&d).contains("only a COMPENSABLE step can be high-impact"),
        "{}",
        refusal(&d)
    );
}

#[test]
fn a_pending_step_past_its_completion_timeout_parks_and_a_late_completion_still_ends_it() {
    let d = with_step(def_of(&[C, C, P]), 1, |s| s.completion_timeout_ms = 5_000);
    let mut h = H::new(&[&d]);
    let id = h.start(&d, "k");
    h.forward(id, 0, CallOutcome::Ok);
    h.forward(id, 1, CallOutcome::Pending);
    let since = fwd(&h.rec(id), 1).outcome_at_ms;
    h.now = since + 4_999;
    assert_eq!(h.plan(id, false), Move::Idle, "within its timeout it waits");
    h.now = since + 5_000;
    let Move::Journal(ev @ JournalEvent::Park { .. }) = h.plan(id, false) else {
        panic!("past its timeout it parks: {:?}", h.plan(id, false))
    };
    assert_eq!(h.ok(id, ev), SagaState::Parked);
    assert!(
        h.rec(id).parked_reason.contains("completion_timeout_ms = 5000"),
        "{}",
        h.rec(id).parked_reason
    );
    // A retry waits again, the timeout counted from the retry.
    assert!(h
        .operate(id, OperatorAction::Retry, "ops", "the approver is back")
        .is_ok());
    let retried = h.rec(id);
    assert_eq!(retried.state, SagaState::Running);
    assert_eq!(fwd(&retried, 1).outcome(), CallOutcome::Pending);
    assert_eq!(h.plan(id, false), Move::Idle);
    // Parked by the timeout again, a late completion ends the wait and
    // the saga goes on.
    h.now += 5_000;
    let Move::Journal(ev) = h.plan(id, false) else { panic!() };
    h.ok(id, ev);
    let op = fwd(&h.rec(id), 1).operation_id;
    assert!(matches!(
        h.complete(id, 1, &op, ok_with(b"approved late"), "ann"),
        Ok(SagaOk::Completed {
            changed: true,
            state: SagaState::Running
        })
    ));
    let r = h.rec(id);
    assert_eq!((r.current, r.parked_reason.as_str(), r.parked_from), (2, "", None));
    // Without a timeout a PENDING step waits however long it takes.
    let d2 = def_of(&[C, C, P]);
    let mut h2 = H::new(&[&d2]);
    let id2 = h2.start(&d2, "k2");
    h2.forward(id2, 0, CallOutcome::Ok);
    h2.forward(id2, 1, CallOutcome::Pending);
    h2.now += 365 * 24 * 3_600_000;
    assert_eq!(h2.plan(id2, false), Move::Idle);
}
