//! Unit tests of the operator's commands on records (`operator`):
//! `DropParticipant`, `ForgetByOperator`, `DeclareLost` and
//! `TxTable::list`. Named after the invariant they guard where one applies
//! (numbered as in docs/protocol.md, "Invariants and the mechanisms that
//! keep them").

use super::operator::ListFilter;
use super::operator::ListPage;
use super::operator::StateFilter;
use super::*;

fn run(t: &mut TxTable, cmd: Command) -> (CommandResult, Vec<Effect>) {
    let mut effects = Vec::new();
    let res = t.apply(&cmd, &mut effects);
    (res, effects)
}

/// A transaction begun at `now_ms` with `ids` enlisted, undecided.
fn tx(t: &mut TxTable, key: &str, now_ms: u64, ids: &[&str]) -> Txid {
    let txid = match run(
        t,
        Command::Begin {
            idempotency_key: key.into(),
            fingerprint: [1; 32],
            now_ms,
            timeout_ms: 1_000,
        },
    )
    .0
    {
        Ok(CommandOk::Began { txid, .. }) => txid,
        other => panic!("begin: {other:?}"),
    };
    for id in ids {
        let r = run(
            t,
            Command::Enlist {
                txid,
                participant_id: id.to_string(),
                address: format!("addr-{id}"),
                payload: vec![],
            },
        );
        assert!(r.0.is_ok(), "{r:?}");
    }
    txid
}

fn decide(t: &mut TxTable, txid: Txid, outcome: Outcome, voters: &[&str]) {
    let (r, _) = run(
        t,
        Command::Decide {
            txid,
            outcome,
            voters: voters.iter().map(|s| s.to_string()).collect(),
            source: DecisionSource::Driver,
            term: 1,
            now_ms: 2_000,
            note: String::new(),
        },
    );
    assert!(matches!(r, Ok(CommandOk::Decided { recorded: true, .. })), "{r:?}");
}

/// A decided transaction with participants `ids`, all unacked.
fn decided(t: &mut TxTable, key: &str, outcome: Outcome, ids: &[&str]) -> Txid {
    let txid = tx(t, key, 1_000, ids);
    decide(t, txid, outcome, ids);
    txid
}

fn ack(t: &mut TxTable, txid: Txid, id: &str) -> CommandResult {
    run(
        t,
        Command::Ack {
            txid,
            participant_id: id.into(),
        },
    )
    .0
}

fn drop_cmd(txid: Txid, id: &str, note: &str, now_ms: u64) -> Command {
    Command::DropParticipant {
        txid,
        participant_id: id.into(),
        note: note.into(),
        now_ms,
    }
}

fn forget_cmd(txid: Txid) -> Command {
    Command::ForgetByOperator {
        txid,
        note: "operator alice: reconciled by hand".into(),
    }
}

/// Applies `cmd` expecting a refusal: no effect, no change to the table.
fn refused(t: &mut TxTable, cmd: Command) -> OperatorRefusal {
    let before = t.clone();
    match run(t, cmd) {
        (Ok(CommandOk::OperatorRefused(r)), fx) => {
            assert!(fx.is_empty(), "a refusal emitted {fx:?}");
            assert_eq!(*t, before, "a refusal changed the table");
            r
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn rebuilt(t: &TxTable) -> TxTable {
    TxTable::from_parts(t.next_txid(), t.records().cloned())
        .with_owners(t.owners().clone())
        .with_drops(t.drops().clone())
}

// ---------------------------------------------------------------- drop

/// Invariant 3: phase two stops only once the decision it would deliver
/// exists; before it, an operator resolves, not drops.
#[test]
fn invariant_3_drop_is_refused_before_the_decision_and_for_unknown_transactions() {
    let mut t = TxTable::new();
    let active = tx(&mut t, "a", 1_000, &["p1"]);
    let r = refused(&mut t, drop_cmd(active, "p1", "operator o: gone", 5));
    assert_eq!(r, OperatorRefusal::NotDecided { txid: active });
    assert_eq!(
        r.to_string(),
        format!("transaction {active} is not decided; resolve it first (admin txn resolve)")
    );
    assert!(!r.not_found());
    run(&mut t, Command::RequestCommit { txid: active }).0.unwrap();
    assert_eq!(
        refused(&mut t, drop_cmd(active, "p1", "operator o: gone", 5)),
        OperatorRefusal::NotDecided { txid: active },
        "PREPARING is not decided either"
    );
    let r = refused(&mut t, drop_cmd(99, "p1", "operator o: gone", 5));
    assert_eq!(r, OperatorRefusal::UnknownTransaction { txid: 99 });
    assert!(r.not_found());
    assert!(r.to_string().contains("forgotten"), "{r}");
}

/// Invariant 3: only a participant that has not acked can be dropped (one
/// that acked has the decision), and only one that is enlisted.
#[test]
fn invariant_3_drop_is_refused_for_an_acked_or_unknown_participant() {
    let mut t = TxTable::new();
    let txid = decided(&mut t, "k", Outcome::Commit, &["p1", "p2"]);
    ack(&mut t, txid, "p1").unwrap();
    let r = refused(&mut t, drop_cmd(txid, "p1", "operator o: gone", 5));
    assert_eq!(
        r,
        OperatorRefusal::AlreadyAcked {
            txid,
            participant_id: "p1".into(),
            outcome: Outcome::Commit
        }
    );
    assert!(!r.not_found());
    let r = refused(&mut t, drop_cmd(txid, "p9", "operator o: gone", 5));
    assert!(r.not_found());
    let m = r.to_string();
    assert!(
        m.contains("\"p9\"") && m.contains("\"p1\"") && m.contains("\"p2\""),
        "{m}"
    );
    // Bad input is refused as such.
    assert!(matches!(
        run(&mut t, drop_cmd(txid, "", "operator o: gone", 5)).0,
        Err(CommandError::Invalid(_))
    ));
    let long = "n".repeat(limits::NOTE_BYTES_MAX + 1);
    assert!(matches!(
        run(&mut t, drop_cmd(txid, "p2", &long, 5)).0,
        Err(CommandError::Invalid(_))
    ));
}

/// Invariant 11: a participant gone for good no longer costs phase two
/// (the delivery index, the undelivered count and `awaiting_ack` leave it
/// out), and invariant 10: the record is not garbage-collected while the
/// dropped participant never acked; it stays visible to operators.
#[test]
fn invariant_11_a_dropped_participant_leaves_delivery_and_invariant_10_the_record_stays() {
    let mut t = TxTable::new();
    let txid = decided(&mut t, "k", Outcome::Commit, &["p1", "p2"]);
    let other = decided(&mut t, "other", Outcome::Commit, &["p1"]);
    ack(&mut t, txid, "p1").unwrap();
    assert_eq!(t.undelivered(10), vec![txid, other]);
    assert!(t.awaiting_ack(txid, "p2"));

    let (r, fx) = run(&mut t, drop_cmd(txid, "p2", "operator alice: bank-b is gone", 5_000));
    assert_eq!(r, Ok(CommandOk::ParticipantDropped { recorded: true }));
    assert_eq!(fx, vec![Effect::Put(txid)]);
    assert_eq!(t.undelivered(10), vec![other], "no more phase two for it");
    assert_eq!(t.undelivered_count(), 1);
    assert!(!t.awaiting_ack(txid, "p2"));
    assert!(t.awaiting_ack(other, "p1"), "other transactions are untouched");
    assert!(t.needs_reconciliation(txid));
    assert_eq!(
        t.drop_of(txid, "p2"),
        Some(&Dropped {
            note: "operator alice: bank-b is gone".into(),
            dropped_ms: 5_000
        })
    );
    assert!(!t.get(txid).unwrap().participants[1].acked, "the record is unchanged");
    // Never forgotten by the leader loop's GC.
    assert_eq!(t.forgettable(u64::MAX, 10), Vec::<Txid>::new());
    assert!(matches!(
        run(&mut t, Command::Forget { txid }).0,
        Err(CommandError::NotAllAcked { .. })
    ));
    assert_eq!(t.decision_view(txid), DecisionView::Decided(Outcome::Commit));

    // A second drop is answered, and the first one's note and time stay.
    let (r, fx) = run(&mut t, drop_cmd(txid, "p2", "operator bob: again", 9_000));
    assert_eq!(r, Ok(CommandOk::ParticipantDropped { recorded: false }));
    assert!(fx.is_empty());
    assert_eq!(t.drop_of(txid, "p2").unwrap().dropped_ms, 5_000);

    // The indexes are what a rebuild from the persisted parts gives.
    assert_eq!(rebuilt(&t), t);
    let without_drops = TxTable::from_parts(t.next_txid(), t.records().cloned());
    assert_eq!(
        without_drops.undelivered(10),
        vec![txid, other],
        "the drops are what keeps it out"
    );
}

/// Invariant 10: a dropped participant that acks after all applied the
/// decision: it is marked acked, needs no reconciliation, and the record is
/// garbage-collected as usual.
#[test]
fn invariant_10_a_late_ack_of_a_dropped_participant_restores_normal_forgetting() {
    let mut t = TxTable::new();
    let txid = decided(&mut t, "k", Outcome::Commit, &["p1", "p2"]);
    ack(&mut t, txid, "p1").unwrap();
    run(&mut t, drop_cmd(txid, "p2", "operator o: gone", 5)).0.unwrap();
    assert_eq!(ack(&mut t, txid, "p2"), Ok(CommandOk::Acked { all_acked: true }));
    assert!(t.get(txid).unwrap().all_acked());
    assert!(!t.needs_reconciliation(txid));
    assert!(t.is_dropped(txid, "p2"), "the drop is still on record");
    assert_eq!(t.forgettable(u64::MAX, 10), vec![txid]);
    assert_eq!(rebuilt(&t), t);
    let (r, fx) = run(&mut t, Command::Forget { txid });
    assert_eq!(r, Ok(CommandOk::Forgotten));
    assert_eq!(fx, vec![Effect::Remove(txid)]);
    assert!(t.dropped(txid).is_none(), "the drops go with the record");
    assert!(t.drops().is_empty());
}

// ---------------------------------------------------------------- forget

/// Invariant 10: an ABORT agrees with "unknown: presumed abort", so an
/// operator may forget an aborted transaction whose remaining participant
/// was dropped; the txid is never handed out again.
#[test]
fn invariant_10_operator_forgets_an_abort_with_a_dropped_participant() {
    let mut t = TxTable::new();
    let txid = decided(&mut t, "k", Outcome::Abort, &["p1", "p2"]);
    ack(&mut t, txid, "p1").unwrap();
    run(&mut t, drop_cmd(txid, "p2", "operator o: gone", 5)).0.unwrap();
    let next = t.next_txid();
    let (r, fx) = run(&mut t, forget_cmd(txid));
    assert_eq!(
        r,
        Ok(CommandOk::ForgottenByOperator {
            outcome: Some(Outcome::Abort)
        })
    );
    assert_eq!(fx, vec![Effect::Remove(txid)]);
    assert_eq!(t.decision_view(txid), DecisionView::Unknown);
    assert!(t.dropped(txid).is_none());
    assert_eq!(t.txid_of_key("k"), None);
    assert_eq!(t.undelivered(10), Vec::<Txid>::new());
    assert_eq!(t.forgettable(u64::MAX, 10), Vec::<Txid>::new());
    // Never reused: not by Begin, not after a rebuild.
    assert_eq!(t.next_txid(), next);
    let again = tx(&mut t, "k", 3_000, &[]);
    assert!(again > txid, "txid {again} reused or below {txid}");
    assert_eq!(rebuilt(&t), t);
    // Forgetting it again: nothing to forget, no effect.
    let (r, fx) = run(&mut t, forget_cmd(txid));
    assert_eq!(r, Ok(CommandOk::ForgottenByOperator { outcome: None }));
    assert!(fx.is_empty());
}

/// Invariants 3 and 10: forgetting a COMMIT that a dropped participant
/// never acked would make the cluster answer "unknown: presumed abort" to
/// it, so it would abort while the others committed.
#[test]
fn invariant_10_operator_forget_is_refused_for_a_commit_with_a_dropped_unacked_participant() {
    let mut t = TxTable::new();
    let txid = decided(&mut t, "k", Outcome::Commit, &["p1", "p2"]);
    ack(&mut t, txid, "p1").unwrap();
    run(&mut t, drop_cmd(txid, "p2", "operator o: gone", 5)).0.unwrap();
    let r = refused(&mut t, forget_cmd(txid));
    assert_eq!(
        r,
        OperatorRefusal::CommitWithDroppedUnacked {
            txid,
            dropped: vec!["p2".into()]
        }
    );
    let m = r.to_string();
    assert!(
        m.contains("presumed abort") && m.contains("atomicity") && m.contains("\"p2\""),
        "{m}"
    );
    assert!(!r.not_found());
    assert_eq!(t.check_forget_by_operator(txid), Err(r));
    // Once it acks after all, the COMMIT may be forgotten.
    ack(&mut t, txid, "p2").unwrap();
    assert_eq!(
        run(&mut t, forget_cmd(txid)).0,
        Ok(CommandOk::ForgottenByOperator {
            outcome: Some(Outcome::Commit)
        })
    );
}

/// Invariant 10: not while phase two still goes on to a participant that
/// was not dropped, and not before the decision.
#[test]
fn invariant_10_operator_forget_is_refused_while_a_participant_is_unacked_and_not_dropped() {
    let mut t = TxTable::new();
    let undecided = tx(&mut t, "u", 1_000, &["p1"]);
    assert_eq!(
        refused(&mut t, forget_cmd(undecided)),
        OperatorRefusal::NotDecided { txid: undecided }
    );
    for outcome in [Outcome::Abort, Outcome::Commit] {
        let key = format!("k-{outcome}");
        let txid = decided(&mut t, &key, outcome, &["p1", "p2", "p3"]);
        run(&mut t, drop_cmd(txid, "p3", "operator o: gone", 5)).0.unwrap();
        let r = refused(&mut t, forget_cmd(txid));
        assert_eq!(
            r,
            OperatorRefusal::StillDelivering {
                txid,
                pending: vec!["p1".into(), "p2".into()]
            }
        );
        assert!(r.to_string().contains("\"p1\""), "{r}");
    }
    // Unknown: nothing to forget (answered, not refused).
    assert_eq!(
        run(&mut t, forget_cmd(1_000)).0,
        Ok(CommandOk::ForgottenByOperator { outcome: None })
    );
    // A fully acked COMMIT without drops may be forgotten before its
    // retention.
    let done = decided(&mut t, "done", Outcome::Commit, &["p1"]);
    ack(&mut t, done, "p1").unwrap();
    assert_eq!(
        run(&mut t, forget_cmd(done)).0,
        Ok(CommandOk::ForgottenByOperator {
            outcome: Some(Outcome::Commit)
        })
    );
    assert!(matches!(
        run(
            &mut t,
            Command::ForgetByOperator {
                txid: done,
                note: "n".repeat(limits::NOTE_BYTES_MAX + 1)
            }
        )
        .0,
        Err(CommandError::Invalid(_))
    ));
}

/// A command's variant index (the byte after the format version) is part of
/// the stored format: these commands come after every older variant, and
/// moving one would need a new `codec::FORMAT_VERSION` (ADR 0042).
#[test]
fn operator_commands_are_appended_so_older_commands_keep_their_encoding() {
    let v = crate::codec::FORMAT_VERSION;
    assert_eq!(
        crate::codec::encode(&Command::Forget { txid: 5 }).unwrap(),
        vec![v, 7, 5]
    );
    let drop = crate::codec::encode(&drop_cmd(5, "p", "n", 1)).unwrap();
    assert_eq!(&drop[..3], &[v, 12, 5]);
    let forget = crate::codec::encode(&forget_cmd(5)).unwrap();
    assert_eq!(&forget[..3], &[v, 13, 5]);
    assert_eq!(
        crate::codec::decode::<Command>(&drop).unwrap(),
        drop_cmd(5, "p", "n", 1)
    );
    assert_eq!(crate::codec::decode::<Command>(&forget).unwrap(), forget_cmd(5));
}

// ---------------------------------------------------------------- list

fn ids(p: &ListPage) -> Vec<Txid> {
    p.txids.clone()
}

#[test]
fn list_pages_by_ascending_txid_and_ands_its_filters() {
    let mut t = TxTable::new();
    let active = tx(&mut t, "a", 1_000, &["p1"]); // 1
    let preparing = tx(&mut t, "b", 2_000, &["p1", "p2"]); // 2
    run(&mut t, Command::RequestCommit { txid: preparing }).0.unwrap();
    let delivering = decided(&mut t, "c", Outcome::Commit, &["p1", "p2"]); // 3, begun 1000
    let dropped = decided(&mut t, "d", Outcome::Abort, &["p2", "p3"]); // 4
    ack(&mut t, dropped, "p3").unwrap();
    run(&mut t, drop_cmd(dropped, "p2", "operator o: gone", 5)).0.unwrap();
    let done = decided(&mut t, "e", Outcome::Commit, &["p3"]); // 5
    ack(&mut t, done, "p3").unwrap();
    let all = ListFilter::default();

    let p = t.list(&all, 0, 100, usize::MAX);
    assert_eq!(ids(&p), vec![active, preparing, delivering, dropped, done]);
    assert_eq!(p.next_after, 0, "nothing follows");
    // Paging: the next page starts after the last txid of this one.
    let p = t.list(&all, 0, 2, usize::MAX);
    assert_eq!((ids(&p), p.next_after), (vec![active, preparing], preparing));
    let p = t.list(&all, p.next_after, 2, usize::MAX);
    assert_eq!((ids(&p), p.next_after), (vec![delivering, dropped], dropped));
    let p = t.list(&all, p.next_after, 2, usize::MAX);
    assert_eq!((ids(&p), p.next_after), (vec![done], 0));
    assert_eq!(t.list(&all, done, 2, usize::MAX), ListPage::default());

    let with = |f: ListFilter| ids(&t.list(&f, 0, 100, usize::MAX));
    assert_eq!(
        with(ListFilter {
            state: Some(StateFilter::Preparing),
            ..Default::default()
        }),
        vec![preparing]
    );
    assert_eq!(
        with(ListFilter {
            state: Some(StateFilter::Decided),
            ..Default::default()
        }),
        vec![delivering, dropped, done]
    );
    assert_eq!(
        with(ListFilter {
            state: Some(StateFilter::Active),
            ..Default::default()
        }),
        vec![active]
    );
    assert_eq!(
        with(ListFilter {
            participant: Some("p2".into()),
            ..Default::default()
        }),
        vec![preparing, delivering, dropped]
    );
    assert_eq!(
        with(ListFilter {
            unacknowledged: true,
            ..Default::default()
        }),
        vec![delivering],
        "a dropped participant is not waited for"
    );
    assert_eq!(
        with(ListFilter {
            dropped: true,
            ..Default::default()
        }),
        vec![dropped]
    );
    // Ages against the leader's clock: begun at 1000 or 2000.
    let aged = |min_age_ms, now_ms| {
        with(ListFilter {
            min_age_ms,
            now_ms,
            ..Default::default()
        })
    };
    assert_eq!(aged(1_500, 3_000), vec![active, delivering, dropped, done]);
    assert_eq!(aged(1_000, 3_000), vec![active, preparing, delivering, dropped, done]);
    assert_eq!(aged(2_001, 3_000), Vec::<Txid>::new());
    assert_eq!(aged(0, 0), vec![active, preparing, delivering, dropped, done]);
    // ANDed.
    assert_eq!(
        with(ListFilter {
            participant: Some("p2".into()),
            state: Some(StateFilter::Decided),
            min_age_ms: 1,
            now_ms: 1_500,
            ..Default::default()
        }),
        vec![delivering, dropped]
    );
    assert_eq!(
        with(ListFilter {
            participant: Some("p1".into()),
            dropped: true,
            ..Default::default()
        }),
        Vec::<Txid>::new()
    );
    // Once the dropped participant acks it needs no reconciliation.
    ack(&mut t, dropped, "p2").unwrap();
    assert_eq!(
        ids(&t.list(
            &ListFilter {
                dropped: true,
                ..Default::default()
            },
            0,
            100,
            usize::MAX
        )),
        Vec::<Txid>::new()
    );
}

/// Invariant 11: a listing never holds the state for a scan of the whole
/// table: it looks at `scan_max` candidates at most and says where to go on.
#[test]
fn invariant_11_list_stops_after_scan_max_candidates_and_says_where_to_go_on() {
    let mut t = TxTable::new();
    let txids: Vec<Txid> = (0..10).map(|i| tx(&mut t, &format!("k{i}"), 1_000, &["p1"])).collect();
    let only_last = ListFilter {
        participant: Some("nobody".into()),
        ..Default::default()
    };
    let p = t.list(&only_last, 0, 100, 4);
    assert_eq!((ids(&p), p.next_after), (vec![], txids[3]));
    let p = t.list(&only_last, p.next_after, 100, 4);
    assert_eq!((ids(&p), p.next_after), (vec![], txids[7]));
    let p = t.list(&only_last, p.next_after, 100, 4);
    assert_eq!((ids(&p), p.next_after), (vec![], 0), "the end");
    // Limit 0 is taken as 1 (the API never asks for it).
    assert_eq!(ids(&t.list(&ListFilter::default(), 0, 0, 100)), vec![txids[0]]);
}

// ---------------------------------------------------------------- declare lost

fn lost_cmd(txid: Txid, id: &str, outcome: Outcome) -> Command {
    Command::DeclareLost {
        txid,
        participant_id: id.into(),
        outcome,
        term: 3,
        now_ms: 7_000,
        note: "operator alice: bank-x disk destroyed".into(),
    }
}

/// Invariants 1 and 3 (ADR 0039): a one-phase commit whose one
/// participant is gone for good gets the operator's heuristic decision,
/// shown as such and never as the participant's answer: the participant is
/// dropped, not acked, so nothing is delivered to it and no one reads its
/// vote into the record; a later answer of the participant changes nothing
/// (write-once).
#[test]
fn invariant_1_a_lost_one_phase_participant_gets_a_heuristic_decision_once() {
    let mut t = TxTable::new();
    let txid = tx(&mut t, "one", 1_000, &["bank-x"]);
    let (r, _) = run(&mut t, Command::RequestCommitOnePhase { txid });
    assert!(
        matches!(r, Ok(CommandOk::CommitRequested { one_phase: true, .. })),
        "{r:?}"
    );
    // The operator's plain ABORT is refused, naming the way out.
    let (r, _) = run(
        &mut t,
        Command::Decide {
            txid,
            outcome: Outcome::Abort,
            voters: vec![],
            source: DecisionSource::Operator,
            term: 3,
            now_ms: 6_000,
            note: "operator alice: gone".into(),
        },
    );
    let e = r.unwrap_err();
    assert_eq!(e, CommandError::OnePhaseOnly { txid });
    assert!(e.to_string().contains("--participant-lost"), "{e}");
    // Another participant id is refused, changing nothing.
    assert!(matches!(
        refused(&mut t, lost_cmd(txid, "bank-y", Outcome::Abort)),
        OperatorRefusal::NotEnlisted { .. }
    ));
    let (r, fx) = run(&mut t, lost_cmd(txid, "bank-x", Outcome::Abort));
    let Ok(CommandOk::Decided {
        decision,
        recorded: true,
    }) = r
    else {
        panic!("{r:?}")
    };
    assert_eq!(decision.source, DecisionSource::OperatorHeuristic);
    assert_eq!(decision.outcome, Outcome::Abort);
    assert_eq!(decision.term, 3);
    assert_eq!(fx, vec![Effect::Put(txid), Effect::Decided(txid, Outcome::Abort)]);
    let rec = t.get(txid).unwrap();
    assert!(!rec.participants[0].acked, "the participant never answered: no ack");
    assert!(t.is_dropped(txid, "bank-x"));
    assert_eq!(
        t.drop_of(txid, "bank-x").unwrap().note,
        "operator alice: bank-x disk destroyed"
    );
    assert!(
        !t.awaiting_ack(txid, "bank-x"),
        "nothing is delivered to a lost participant"
    );
    // The participant's own answer arriving late: the decision stands.
    let (r, fx) = run(
        &mut t,
        Command::Decide {
            txid,
            outcome: Outcome::Commit,
            voters: vec!["bank-x".into()],
            source: DecisionSource::Driver,
            term: 4,
            now_ms: 8_000,
            note: String::new(),
        },
    );
    assert!(
        matches!(&r, Ok(CommandOk::Decided { decision, recorded: false }) if decision.source == DecisionSource::OperatorHeuristic && decision.outcome == Outcome::Abort),
        "{r:?}"
    );
    assert!(fx.is_empty());
    // A second declaration reads the first back.
    let (r, fx) = run(&mut t, lost_cmd(txid, "bank-x", Outcome::Commit));
    assert!(matches!(&r, Ok(CommandOk::Decided { decision, recorded: false }) if decision.outcome == Outcome::Abort));
    assert!(fx.is_empty());
    // A heuristic ABORT can be forgotten (the participant was dropped);
    // the drop survives a rebuild from the persisted parts.
    assert_eq!(rebuilt(&t), t);
    assert_eq!(t.check_forget_by_operator(txid), Ok(Some(Outcome::Abort)));
}

/// Only a one-phase commit: a two-phase transaction is resolved, not
/// declared lost (an ABORT needs no participant's answer there).
#[test]
fn declaring_a_participant_lost_is_refused_for_a_two_phase_transaction() {
    let mut t = TxTable::new();
    let two = tx(&mut t, "two", 1_000, &["p1", "p2"]);
    run(&mut t, Command::RequestCommit { txid: two }).0.unwrap();
    let r = refused(&mut t, lost_cmd(two, "p1", Outcome::Abort));
    assert_eq!(r, OperatorRefusal::NotOnePhase { txid: two });
    assert!(r.to_string().contains("admin txn resolve --abort"), "{r}");
    assert_eq!(
        refused(&mut t, lost_cmd(99, "p1", Outcome::Abort)),
        OperatorRefusal::UnknownTransaction { txid: 99 }
    );
}
