//! Unit tests of the pure transaction state machine.
//!
//! Tests are named after the invariant they check (`invN_...`, numbered as
//! in docs/protocol.md, "Invariants and the mechanisms that keep them"), or
//! after the command behaviour they pin down. Every test asserts on the
//! command result AND on the effects the command emitted.

use std::collections::BTreeMap;
use std::collections::BTreeSet;

use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::Rng;
use rand::SeedableRng;

use super::*;

// ---------------------------------------------------------------- helpers

fn fp(b: u8) -> [u8; 32] {
    [b; 32]
}

/// Applies one command to `t`, returning its result and the effects it emitted.
fn run(t: &mut TxTable, cmd: Command) -> (CommandResult, Vec<Effect>) {
    let mut effects = Vec::new();
    let res = t.apply(&cmd, &mut effects);
    (res, effects)
}

fn begin_cmd(key: &str, fingerprint: [u8; 32], now_ms: u64, timeout_ms: u64) -> Command {
    Command::Begin {
        idempotency_key: key.to_string(),
        fingerprint,
        now_ms,
        timeout_ms,
    }
}

fn enlist_cmd(txid: Txid, id: &str, address: &str, payload: &[u8]) -> Command {
    Command::Enlist {
        txid,
        participant_id: id.to_string(),
        address: address.to_string(),
        payload: payload.to_vec(),
    }
}

fn decide_cmd(txid: Txid, outcome: Outcome, voters: &[&str], source: DecisionSource, now_ms: u64) -> Command {
    Command::Decide {
        txid,
        outcome,
        voters: voters.iter().map(|s| s.to_string()).collect(),
        source,
        term: 7,
        now_ms,
        note: format!("{source:?} {outcome}"),
    }
}

fn ack_cmd(txid: Txid, id: &str) -> Command {
    Command::Ack {
        txid,
        participant_id: id.to_string(),
    }
}

/// Begins a fresh transaction (asserting it is new) and returns its txid.
fn begin_new(t: &mut TxTable, key: &str, now_ms: u64, timeout_ms: u64) -> Txid {
    let (res, eff) = run(t, begin_cmd(key, fp(1), now_ms, timeout_ms));
    match res {
        Ok(CommandOk::Began {
            txid,
            existing: false,
            deadline_ms,
        }) => {
            assert_eq!(deadline_ms, now_ms.saturating_add(timeout_ms));
            assert_eq!(eff, vec![Effect::Put(txid)]);
            txid
        }
        other => panic!("begin {key:?}: unexpected {other:?}"),
    }
}

/// Enlists `id` (address "addr-<id>", payload = id bytes), asserting success.
fn enlist_ok(t: &mut TxTable, txid: Txid, id: &str) {
    let addr = format!("addr-{id}");
    let (res, eff) = run(t, enlist_cmd(txid, id, &addr, id.as_bytes()));
    assert!(
        matches!(res, Ok(CommandOk::Enlisted { .. })),
        "enlist {id} in {txid}: {res:?}"
    );
    assert_eq!(eff, vec![Effect::Put(txid)]);
}

/// A transaction with the given participants, begun at 1000 with a 500 ms timeout.
fn tx_with(t: &mut TxTable, key: &str, ids: &[&str]) -> Txid {
    let txid = begin_new(t, key, 1000, 500);
    for id in ids {
        enlist_ok(t, txid, id);
    }
    txid
}

fn decided_ok(res: &CommandResult) -> (Decision, bool) {
    match res {
        Ok(CommandOk::Decided { decision, recorded }) => (decision.clone(), *recorded),
        other => panic!("expected Decided, got {other:?}"),
    }
}

fn expect_invalid_naming(res: CommandResult, field: &str) {
    match res {
        Err(CommandError::Invalid(msg)) => {
            assert!(msg.contains(field), "message {msg:?} does not name {field:?}")
        }
        other => panic!("expected Invalid naming {field:?}, got {other:?}"),
    }
}

// ---------------------------------------------------------------- Begin

#[test]
fn begin_txids_strictly_increasing_from_1() {
    let mut t = TxTable::new();
    assert_eq!(t.next_txid(), 1);
    let mut prev = 0;
    for i in 0..20u64 {
        let txid = begin_new(&mut t, &format!("k{i}"), 100 + i, 10);
        assert_eq!(txid, i + 1, "txids start at 1 and step by one");
        assert!(txid > prev);
        prev = txid;
        assert_eq!(t.next_txid(), txid + 1);
    }
    assert_eq!(t.len(), 20);
}

#[test]
fn begin_same_key_same_fingerprint_is_idempotent() {
    let mut t = TxTable::new();
    let txid = begin_new(&mut t, "order-1", 1000, 250);
    let _other = begin_new(&mut t, "order-2", 1001, 250);
    let before = t.clone();
    // A retry arrives later with another clock and timeout: same answer.
    let (res, eff) = run(&mut t, begin_cmd("order-1", fp(1), 5000, 99_999));
    assert_eq!(
        res,
        Ok(CommandOk::Began {
            txid,
            existing: true,
            deadline_ms: 1250,
        })
    );
    assert!(eff.is_empty(), "idempotent Begin must emit no effects: {eff:?}");
    assert_eq!(t, before, "idempotent Begin must not change the table");
}

#[test]
fn begin_same_key_other_fingerprint_is_key_conflict() {
    let mut t = TxTable::new();
    let txid = begin_new(&mut t, "order-1", 1000, 250);
    let before = t.clone();
    let (res, eff) = run(&mut t, begin_cmd("order-1", fp(2), 1000, 250));
    assert_eq!(
        res,
        Err(CommandError::KeyConflict {
            key: "order-1".to_string(),
            txid,
        })
    );
    assert!(eff.is_empty());
    assert_eq!(t, before);
    assert_eq!(t.next_txid(), txid + 1, "a refused Begin burns no txid");
}

#[test]
fn begin_records_active_transaction_with_deadline() {
    let mut t = TxTable::new();
    let txid = begin_new(&mut t, "k", 1000, 250);
    let r = t.get(txid).expect("record");
    assert_eq!(r.txid, txid);
    assert_eq!(r.idempotency_key, "k");
    assert_eq!(r.fingerprint, fp(1));
    assert_eq!(r.begun_ms, 1000);
    assert_eq!(r.deadline_ms, 1250);
    assert_eq!(r.phase, Phase::Active);
    assert!(r.participants.is_empty());
    // The deadline saturates instead of wrapping around.
    let (res, _) = run(&mut t, begin_cmd("k2", fp(1), u64::MAX - 1, 10));
    assert!(matches!(
        res,
        Ok(CommandOk::Began {
            deadline_ms: u64::MAX,
            ..
        })
    ));
}

// ---------------------------------------------------------------- limits

#[test]
fn limits_begin_key_empty_or_too_long_is_invalid() {
    let mut t = TxTable::new();
    let (res, eff) = run(&mut t, begin_cmd("", fp(1), 0, 10));
    expect_invalid_naming(res, "idempotency_key");
    assert!(eff.is_empty());

    let long = "k".repeat(limits::ID_BYTES_MAX + 1);
    let (res, eff) = run(&mut t, begin_cmd(&long, fp(1), 0, 10));
    expect_invalid_naming(res, "idempotency_key");
    assert!(eff.is_empty());
    assert!(t.is_empty());
    assert_eq!(t.next_txid(), 1, "refused Begins burn no txid");

    // Exactly at the limit is accepted; bytes count, not chars.
    let at_limit = "k".repeat(limits::ID_BYTES_MAX);
    assert_eq!(begin_new(&mut t, &at_limit, 0, 10), 1);
    let multibyte = "é".repeat(limits::ID_BYTES_MAX / 2 + 1); // 2 bytes each
    let (res, _) = run(&mut t, begin_cmd(&multibyte, fp(1), 0, 10));
    expect_invalid_naming(res, "idempotency_key");
}

#[test]
fn limits_enlist_fields_are_checked_and_named() {
    let mut t = TxTable::new();
    let txid = begin_new(&mut t, "k", 0, 10);
    let before = t.clone();

    let (res, eff) = run(&mut t, enlist_cmd(txid, "", "addr", b"x"));
    expect_invalid_naming(res, "participant_id");
    assert!(eff.is_empty());

    let long_id = "p".repeat(limits::ID_BYTES_MAX + 1);
    let (res, eff) = run(&mut t, enlist_cmd(txid, &long_id, "addr", b"x"));
    expect_invalid_naming(res, "participant_id");
    assert!(eff.is_empty());

    let long_addr = "a".repeat(limits::ADDRESS_BYTES_MAX + 1);
    let (res, eff) = run(&mut t, enlist_cmd(txid, "p1", &long_addr, b"x"));
    expect_invalid_naming(res, "address");
    assert!(eff.is_empty());

    let big = vec![0u8; limits::PAYLOAD_BYTES_MAX + 1];
    let (res, eff) = run(&mut t, enlist_cmd(txid, "p1", "addr", &big));
    expect_invalid_naming(res, "payload");
    assert!(eff.is_empty());

    assert_eq!(t, before, "refused enlistments change nothing");

    // Everything exactly at its limit is accepted.
    let id = "p".repeat(limits::ID_BYTES_MAX);
    let addr = "a".repeat(limits::ADDRESS_BYTES_MAX);
    let payload = vec![7u8; limits::PAYLOAD_BYTES_MAX];
    let (res, eff) = run(&mut t, enlist_cmd(txid, &id, &addr, &payload));
    assert_eq!(res, Ok(CommandOk::Enlisted { participant_count: 1 }));
    assert_eq!(eff, vec![Effect::Put(txid)]);
}

#[test]
fn limits_decide_note_too_long_is_invalid() {
    let mut t = TxTable::new();
    let txid = tx_with(&mut t, "k", &["p1"]);
    let before = t.clone();
    let cmd = Command::Decide {
        txid,
        outcome: Outcome::Abort,
        voters: vec![],
        source: DecisionSource::Operator,
        term: 1,
        now_ms: 1,
        note: "n".repeat(limits::NOTE_BYTES_MAX + 1),
    };
    let (res, eff) = run(&mut t, cmd);
    expect_invalid_naming(res, "note");
    assert!(eff.is_empty());
    assert_eq!(t, before);
    assert_eq!(t.decision_view(txid), DecisionView::Pending);
}

// ---------------------------------------------------------------- Enlist

#[test]
fn enlist_unknown_txid_is_not_found() {
    let mut t = TxTable::new();
    let (res, eff) = run(&mut t, enlist_cmd(42, "p1", "a", b""));
    assert_eq!(res, Err(CommandError::NotFound { txid: 42 }));
    assert!(eff.is_empty());
}

#[test]
fn enlist_counts_participants_and_records_them() {
    let mut t = TxTable::new();
    let txid = begin_new(&mut t, "k", 0, 10);
    for (i, id) in ["p1", "p2", "p3"].iter().enumerate() {
        let (res, eff) = run(&mut t, enlist_cmd(txid, id, &format!("addr-{id}"), b"pl"));
        assert_eq!(
            res,
            Ok(CommandOk::Enlisted {
                participant_count: i as u32 + 1
            })
        );
        assert_eq!(eff, vec![Effect::Put(txid)]);
    }
    let r = t.get(txid).unwrap();
    let ids: Vec<&str> = r.participants.iter().map(|p| p.id.as_str()).collect();
    assert_eq!(ids, ["p1", "p2", "p3"]);
    assert_eq!(r.participants[1].address, "addr-p2");
    assert_eq!(r.participants[1].payload, b"pl");
    assert!(r.participants.iter().all(|p| !p.acked));
}

#[test]
fn enlist_same_id_address_payload_is_idempotent() {
    let mut t = TxTable::new();
    let txid = begin_new(&mut t, "k", 0, 10);
    enlist_ok(&mut t, txid, "p1");
    enlist_ok(&mut t, txid, "p2");
    let before = t.clone();
    let (res, eff) = run(&mut t, enlist_cmd(txid, "p1", "addr-p1", b"p1"));
    assert_eq!(res, Ok(CommandOk::Enlisted { participant_count: 2 }));
    assert!(eff.is_empty(), "duplicate Enlist emits nothing: {eff:?}");
    assert_eq!(t, before);
}

#[test]
fn enlist_same_id_other_address_or_payload_is_participant_conflict() {
    let mut t = TxTable::new();
    let txid = begin_new(&mut t, "k", 0, 10);
    enlist_ok(&mut t, txid, "p1");
    let before = t.clone();
    let conflict = Err(CommandError::ParticipantConflict {
        txid,
        participant_id: "p1".to_string(),
    });

    let (res, eff) = run(&mut t, enlist_cmd(txid, "p1", "other-addr", b"p1"));
    assert_eq!(res, conflict);
    assert!(eff.is_empty());

    let (res, eff) = run(&mut t, enlist_cmd(txid, "p1", "addr-p1", b"other-payload"));
    assert_eq!(res, conflict);
    assert!(eff.is_empty());

    assert_eq!(t, before, "a conflicting Enlist changes nothing");
}

#[test]
fn inv2_enlist_refused_not_active_after_request_commit() {
    let mut t = TxTable::new();
    let txid = tx_with(&mut t, "k", &["p1"]);
    let (res, _) = run(&mut t, Command::RequestCommit { txid });
    assert!(res.is_ok());
    let before = t.clone();
    let (res, eff) = run(&mut t, enlist_cmd(txid, "late", "addr-late", b""));
    assert_eq!(
        res,
        Err(CommandError::NotActive {
            txid,
            phase: "PREPARING".to_string(),
        })
    );
    assert!(eff.is_empty());
    assert_eq!(t, before, "the frozen set did not grow");
    assert_eq!(t.get(txid).unwrap().participants.len(), 1);
}

#[test]
fn inv2_enlist_refused_not_active_after_decide() {
    for outcome in [Outcome::Commit, Outcome::Abort] {
        let mut t = TxTable::new();
        let txid = tx_with(&mut t, "k", &["p1"]);
        let (res, _) = run(&mut t, decide_cmd(txid, outcome, &["p1"], DecisionSource::Driver, 1100));
        assert!(decided_ok(&res).1);
        let before = t.clone();
        let (res, eff) = run(&mut t, enlist_cmd(txid, "late", "addr-late", b""));
        assert_eq!(
            res,
            Err(CommandError::NotActive {
                txid,
                phase: "DECIDED".to_string(),
            }),
            "outcome {outcome}"
        );
        assert!(eff.is_empty());
        assert_eq!(t, before);
    }
}

#[test]
fn enlist_too_many_participants_at_limit() {
    let mut t = TxTable::new();
    let txid = begin_new(&mut t, "k", 0, 10);
    for i in 0..limits::PARTICIPANTS_MAX {
        let (res, eff) = run(&mut t, enlist_cmd(txid, &format!("p{i}"), "a", b""));
        assert_eq!(
            res,
            Ok(CommandOk::Enlisted {
                participant_count: i as u32 + 1
            })
        );
        assert_eq!(eff, vec![Effect::Put(txid)]);
    }
    let before = t.clone();
    let (res, eff) = run(&mut t, enlist_cmd(txid, "one-too-many", "a", b""));
    assert_eq!(
        res,
        Err(CommandError::TooManyParticipants {
            txid,
            limit: limits::PARTICIPANTS_MAX,
        })
    );
    assert!(eff.is_empty());
    assert_eq!(t, before);
    // A duplicate of an already enlisted participant is still idempotent at the limit.
    let (res, eff) = run(&mut t, enlist_cmd(txid, "p0", "a", b""));
    assert_eq!(
        res,
        Ok(CommandOk::Enlisted {
            participant_count: limits::PARTICIPANTS_MAX as u32
        })
    );
    assert!(eff.is_empty());
}

// ---------------------------------------------------------------- RequestCommit

#[test]
fn inv2_request_commit_freezes_set_and_is_idempotent() {
    let mut t = TxTable::new();
    let txid = tx_with(&mut t, "k", &["p1", "p2"]);
    let (res, eff) = run(&mut t, Command::RequestCommit { txid });
    let participants = t.get(txid).unwrap().participants.clone();
    assert_eq!(participants.len(), 2);
    assert_eq!(
        res,
        Ok(CommandOk::CommitRequested {
            participants: participants.clone(),
            decision: None,
            one_phase: false,
        })
    );
    assert_eq!(eff, vec![Effect::Put(txid)]);
    assert_eq!(t.get(txid).unwrap().phase, Phase::Preparing);
    assert_eq!(t.decision_view(txid), DecisionView::Pending);

    let before = t.clone();
    let (res2, eff2) = run(&mut t, Command::RequestCommit { txid });
    assert_eq!(res2, res, "a repeated RequestCommit gives the same answer");
    assert!(eff2.is_empty());
    assert_eq!(t, before);
}

#[test]
fn request_commit_unknown_txid_is_not_found() {
    let mut t = TxTable::new();
    let (res, eff) = run(&mut t, Command::RequestCommit { txid: 9 });
    assert_eq!(res, Err(CommandError::NotFound { txid: 9 }));
    assert!(eff.is_empty());
}

#[test]
fn request_commit_after_decide_returns_decision_without_effects() {
    let mut t = TxTable::new();
    let txid = tx_with(&mut t, "k", &["p1"]);
    let (res, _) = run(
        &mut t,
        decide_cmd(txid, Outcome::Abort, &[], DecisionSource::Client, 1100),
    );
    let (decision, recorded) = decided_ok(&res);
    assert!(recorded);
    let before = t.clone();
    let (res, eff) = run(&mut t, Command::RequestCommit { txid });
    assert_eq!(
        res,
        Ok(CommandOk::CommitRequested {
            participants: before.get(txid).unwrap().participants.clone(),
            decision: Some(decision),
            one_phase: false,
        })
    );
    assert!(eff.is_empty());
    assert_eq!(t, before, "RequestCommit never moves a decided tx back");
}

// ---------------------------------------------------------------- Decide (invariant 1)

#[test]
fn inv1_decide_is_write_once_first_wins() {
    let orders = [
        (Outcome::Commit, Outcome::Commit),
        (Outcome::Commit, Outcome::Abort),
        (Outcome::Abort, Outcome::Commit),
        (Outcome::Abort, Outcome::Abort),
    ];
    for (first, second) in orders {
        for prepared in [false, true] {
            let mut t = TxTable::new();
            let txid = tx_with(&mut t, "k", &["p1", "p2"]);
            if prepared {
                run(&mut t, Command::RequestCommit { txid }).0.unwrap();
            }
            let cmd1 = Command::Decide {
                txid,
                outcome: first,
                voters: vec!["p1".into(), "p2".into()],
                source: DecisionSource::Driver,
                term: 3,
                now_ms: 1100,
                note: "first".into(),
            };
            let (res1, eff1) = run(&mut t, cmd1);
            let (d1, rec1) = decided_ok(&res1);
            assert!(rec1, "{first}->{second}: first Decide records");
            assert_eq!(
                d1,
                Decision {
                    outcome: first,
                    source: DecisionSource::Driver,
                    term: 3,
                    decided_ms: 1100,
                    note: "first".into(),
                }
            );
            assert_eq!(eff1, vec![Effect::Put(txid), Effect::Decided(txid, first)]);
            assert_eq!(t.get(txid).unwrap().phase, Phase::Decided(d1.clone()));
            assert_eq!(t.decision_view(txid), DecisionView::Decided(first));

            let before = t.clone();
            let cmd2 = Command::Decide {
                txid,
                outcome: second,
                voters: vec!["p1".into(), "p2".into()],
                source: DecisionSource::Operator,
                term: 4,
                now_ms: 9999,
                note: "second".into(),
            };
            let (res2, eff2) = run(&mut t, cmd2);
            let (d2, rec2) = decided_ok(&res2);
            assert!(!rec2, "{first}->{second}: second Decide must not record");
            assert_eq!(d2, d1, "{first}->{second}: the first decision is returned");
            assert!(eff2.is_empty(), "{first}->{second}: no effects: {eff2:?}");
            assert_eq!(t, before, "{first}->{second}: table unchanged");
            assert_eq!(t.decision_view(txid), DecisionView::Decided(first));
        }
    }
}

#[test]
fn inv1_later_decide_cannot_override_even_from_reaper_or_with_bad_voters() {
    // COMMIT recorded; a reaper ABORT long past the deadline and a Decide with
    // nonsense voters both read the COMMIT back.
    let mut t = TxTable::new();
    let txid = tx_with(&mut t, "k", &["p1"]);
    let (res, _) = run(
        &mut t,
        decide_cmd(txid, Outcome::Commit, &["p1"], DecisionSource::Driver, 1100),
    );
    let (d, _) = decided_ok(&res);
    let before = t.clone();
    for cmd in [
        decide_cmd(txid, Outcome::Abort, &[], DecisionSource::Reaper, 1_000_000),
        decide_cmd(txid, Outcome::Abort, &["zz"], DecisionSource::Client, 1),
        decide_cmd(txid, Outcome::Commit, &["zz", "zz"], DecisionSource::Operator, 1),
        decide_cmd(txid, Outcome::Commit, &[], DecisionSource::Reaper, 1),
    ] {
        let (res, eff) = run(&mut t, cmd);
        assert_eq!(
            res,
            Ok(CommandOk::Decided {
                decision: d.clone(),
                recorded: false
            })
        );
        assert!(eff.is_empty());
        assert_eq!(t, before);
    }
}

#[test]
fn decide_unknown_txid_is_not_found() {
    let mut t = TxTable::new();
    let (res, eff) = run(&mut t, decide_cmd(5, Outcome::Abort, &[], DecisionSource::Client, 0));
    assert_eq!(res, Err(CommandError::NotFound { txid: 5 }));
    assert!(eff.is_empty());
    assert!(t.is_empty());
}

// ---------------------------------------------------------------- Decide (invariant 2)

#[test]
fn inv2_commit_requires_voters_equal_enlisted() {
    let mut t = TxTable::new();
    let txid = tx_with(&mut t, "k", &["p1", "p2"]);
    run(&mut t, Command::RequestCommit { txid }).0.unwrap();
    let before = t.clone();
    let bad: [&[&str]; 6] = [
        &[],                 // nobody voted
        &["p1"],             // missing voter
        &["p1", "p2", "p3"], // extra voter
        &["p1", "p3"],       // wrong voter
        &["p1", "p1"],       // duplicated voter instead of p2
        &["p1", "p2", "p2"], // duplicated voter
    ];
    for voters in bad {
        for source in [DecisionSource::Driver, DecisionSource::Client, DecisionSource::Operator] {
            let (res, eff) = run(&mut t, decide_cmd(txid, Outcome::Commit, voters, source, 1100));
            assert_eq!(
                res,
                Err(CommandError::VotersMismatch {
                    txid,
                    voters: voters.iter().map(|s| s.to_string()).collect(),
                    enlisted: vec!["p1".into(), "p2".into()],
                }),
                "voters {voters:?} source {source:?}"
            );
            assert!(eff.is_empty(), "refused COMMIT emits nothing: {eff:?}");
            assert_eq!(t, before, "refused COMMIT records nothing");
            assert_eq!(t.decision_view(txid), DecisionView::Pending);
        }
    }
    // The exact set, in any order, commits.
    let (res, eff) = run(
        &mut t,
        decide_cmd(txid, Outcome::Commit, &["p2", "p1"], DecisionSource::Driver, 1100),
    );
    let (d, rec) = decided_ok(&res);
    assert!(rec);
    assert_eq!(d.outcome, Outcome::Commit);
    assert_eq!(eff, vec![Effect::Put(txid), Effect::Decided(txid, Outcome::Commit)]);
    assert_eq!(t.decision_view(txid), DecisionView::Decided(Outcome::Commit));
}

#[test]
fn inv2_commit_checks_enlisted_set_even_without_request_commit() {
    // The set may be frozen by Decide(COMMIT) itself (docs/protocol.md): a voter set
    // that misses a participant enlisted after the votes were collected is refused.
    let mut t = TxTable::new();
    let txid = tx_with(&mut t, "k", &["p1"]);
    enlist_ok(&mut t, txid, "p2");
    let (res, eff) = run(
        &mut t,
        decide_cmd(txid, Outcome::Commit, &["p1"], DecisionSource::Driver, 1100),
    );
    assert!(matches!(res, Err(CommandError::VotersMismatch { .. })), "{res:?}");
    assert!(eff.is_empty());
    assert_eq!(t.get(txid).unwrap().phase, Phase::Active);
}

#[test]
fn inv2_commit_with_zero_participants_and_empty_voters_allowed() {
    let mut t = TxTable::new();
    let txid = begin_new(&mut t, "k", 0, 10);
    let before = t.clone();
    // Non-empty voters for an empty set is a mismatch.
    let (res, eff) = run(
        &mut t,
        decide_cmd(txid, Outcome::Commit, &["ghost"], DecisionSource::Driver, 1),
    );
    assert!(matches!(res, Err(CommandError::VotersMismatch { .. })), "{res:?}");
    assert!(eff.is_empty());
    assert_eq!(t, before);

    let (res, eff) = run(
        &mut t,
        decide_cmd(txid, Outcome::Commit, &[], DecisionSource::Driver, 1),
    );
    let (d, rec) = decided_ok(&res);
    assert!(rec);
    assert_eq!(d.outcome, Outcome::Commit);
    assert_eq!(eff, vec![Effect::Put(txid), Effect::Decided(txid, Outcome::Commit)]);
    assert!(t.get(txid).unwrap().all_acked(), "nobody to ack");
}

#[test]
fn inv2_voters_mismatch_does_not_block_a_later_abort() {
    let mut t = TxTable::new();
    let txid = tx_with(&mut t, "k", &["p1", "p2"]);
    let (res, _) = run(
        &mut t,
        decide_cmd(txid, Outcome::Commit, &["p1"], DecisionSource::Driver, 1100),
    );
    assert!(res.is_err());
    // ABORT needs no votes at all.
    let (res, eff) = run(
        &mut t,
        decide_cmd(txid, Outcome::Abort, &["p1"], DecisionSource::Driver, 1100),
    );
    let (d, rec) = decided_ok(&res);
    assert!(rec);
    assert_eq!(d.outcome, Outcome::Abort);
    assert_eq!(eff, vec![Effect::Put(txid), Effect::Decided(txid, Outcome::Abort)]);
}

/// An operator's COMMIT of a transaction that never had a prepare round
/// recorded (ACTIVE) is refused, even with the exact voter set: no
/// participant can hold a YES vote, so the others would commit and the one
/// that never prepared would refuse (a split, invariants 2 and 3).
/// From PREPARING it is accepted (the leader has asked every participant for
/// its durable YES first); ABORT stays allowed from ACTIVE.
#[test]
fn inv2_inv3_operator_commit_refused_without_a_prepare_round() {
    let mut t = TxTable::new();
    let txid = tx_with(&mut t, "k", &["p1", "p2"]);
    let before = t.clone();
    let (res, eff) = run(
        &mut t,
        decide_cmd(txid, Outcome::Commit, &["p1", "p2"], DecisionSource::Operator, 1100),
    );
    assert_eq!(
        res,
        Err(CommandError::OperatorCommitNotPrepared {
            txid,
            phase: "ACTIVE".into()
        })
    );
    assert!(res.unwrap_err().to_string().contains("no participant can hold a YES"));
    assert!(eff.is_empty());
    assert_eq!(t, before, "a refused operator COMMIT records nothing");

    // After RequestCommit (PREPARING) the operator's COMMIT with every
    // participant is recorded.
    run(&mut t, Command::RequestCommit { txid }).0.unwrap();
    let (res, eff) = run(
        &mut t,
        decide_cmd(txid, Outcome::Commit, &["p1", "p2"], DecisionSource::Operator, 1100),
    );
    let (d, rec) = decided_ok(&res);
    assert!(rec);
    assert_eq!((d.outcome, d.source), (Outcome::Commit, DecisionSource::Operator));
    assert_eq!(eff, vec![Effect::Put(txid), Effect::Decided(txid, Outcome::Commit)]);

    // An operator ABORT needs no prepare round.
    let other = tx_with(&mut t, "k2", &["p1"]);
    let (res, _) = run(
        &mut t,
        decide_cmd(other, Outcome::Abort, &[], DecisionSource::Operator, 1100),
    );
    assert!(decided_ok(&res).1);
}

/// Invariant 11: the cursor scans over PREPARING and undelivered
/// transactions start after the cursor and wrap around, each id once, so a
/// caller taking a few per round reaches every one in turn.
#[test]
fn inv11_background_scans_start_after_the_cursor_and_wrap_around() {
    let mut t = TxTable::new();
    let ids: Vec<Txid> = (0..5).map(|i| tx_with(&mut t, &format!("k{i}"), &["p1"])).collect();
    for &id in &ids {
        run(&mut t, Command::RequestCommit { txid: id }).0.unwrap();
    }
    let all = |it: &mut dyn Iterator<Item = Txid>| it.collect::<Vec<_>>();
    assert_eq!(all(&mut t.preparing_after(0)), ids);
    assert_eq!(
        all(&mut t.preparing_after(ids[2])),
        vec![ids[3], ids[4], ids[0], ids[1], ids[2]]
    );
    assert_eq!(all(&mut t.preparing_after(Txid::MAX)), ids, "no duplicates at the top");
    // Decided, unacked: in the undelivered scan, out of the preparing one.
    for &id in &ids[..3] {
        run(
            &mut t,
            decide_cmd(id, Outcome::Abort, &[], DecisionSource::Client, 1100),
        )
        .0
        .unwrap();
    }
    assert_eq!(all(&mut t.preparing_after(ids[4])), vec![ids[3], ids[4]]);
    assert_eq!(all(&mut t.undelivered_after(ids[1])), vec![ids[2], ids[0], ids[1]]);
    assert_eq!((t.undelivered_count(), t.preparing_count()), (3, 2));
    // Taking one per round and moving the cursor visits each in turn.
    let mut cursor = 0;
    let mut seen = Vec::new();
    for _ in 0..3 {
        let next = t.undelivered_after(cursor).next().unwrap();
        seen.push(next);
        cursor = next;
    }
    assert_eq!(seen, ids[..3].to_vec());
}

// ---------------------------------------------------------------- Decide (invariant 7)

#[test]
fn inv7_reaper_cannot_commit() {
    let mut t = TxTable::new();
    let txid = tx_with(&mut t, "k", &["p1"]);
    run(&mut t, Command::RequestCommit { txid }).0.unwrap();
    let before = t.clone();
    // Even with the exact voter set and far past the deadline.
    let (res, eff) = run(
        &mut t,
        decide_cmd(txid, Outcome::Commit, &["p1"], DecisionSource::Reaper, 1_000_000),
    );
    assert!(matches!(res, Err(CommandError::Invalid(_))), "{res:?}");
    assert!(eff.is_empty());
    assert_eq!(t, before);
    assert_eq!(t.decision_view(txid), DecisionView::Pending);
}

#[test]
fn inv7_reaper_abort_only_past_deadline() {
    let mut t = TxTable::new();
    // begun at 1000 with 500 ms: deadline 1500.
    let txid = tx_with(&mut t, "k", &["p1"]);
    run(&mut t, Command::RequestCommit { txid }).0.unwrap();
    let before = t.clone();
    for now in [0, 1000, 1499] {
        let (res, eff) = run(
            &mut t,
            decide_cmd(txid, Outcome::Abort, &[], DecisionSource::Reaper, now),
        );
        assert_eq!(
            res,
            Err(CommandError::DeadlineNotReached {
                txid,
                deadline_ms: 1500,
                now_ms: now,
            })
        );
        assert!(eff.is_empty());
        assert_eq!(t, before);
        assert_eq!(t.decision_view(txid), DecisionView::Pending);
    }
    // At the deadline exactly it is allowed.
    let (res, eff) = run(
        &mut t,
        decide_cmd(txid, Outcome::Abort, &[], DecisionSource::Reaper, 1500),
    );
    let (d, rec) = decided_ok(&res);
    assert!(rec);
    assert_eq!(d.outcome, Outcome::Abort);
    assert_eq!(d.source, DecisionSource::Reaper);
    assert_eq!(d.decided_ms, 1500);
    assert_eq!(eff, vec![Effect::Put(txid), Effect::Decided(txid, Outcome::Abort)]);
    assert_eq!(t.decision_view(txid), DecisionView::Decided(Outcome::Abort));

    // After the deadline too (an ACTIVE transaction this time).
    let txid2 = tx_with(&mut t, "k2", &["p1"]);
    let (res, eff) = run(
        &mut t,
        decide_cmd(txid2, Outcome::Abort, &[], DecisionSource::Reaper, 2000),
    );
    assert!(decided_ok(&res).1);
    assert_eq!(eff, vec![Effect::Put(txid2), Effect::Decided(txid2, Outcome::Abort)]);
}

#[test]
fn inv7_non_reaper_abort_allowed_before_deadline() {
    for source in [DecisionSource::Driver, DecisionSource::Client, DecisionSource::Operator] {
        let mut t = TxTable::new();
        let txid = tx_with(&mut t, "k", &["p1"]);
        let (res, eff) = run(&mut t, decide_cmd(txid, Outcome::Abort, &[], source, 0));
        let (d, rec) = decided_ok(&res);
        assert!(rec, "{source:?}");
        assert_eq!(d.source, source);
        assert_eq!(eff, vec![Effect::Put(txid), Effect::Decided(txid, Outcome::Abort)]);
    }
}

// ---------------------------------------------------------------- Ack

#[test]
fn ack_refused_before_decision() {
    let mut t = TxTable::new();
    let txid = tx_with(&mut t, "k", &["p1"]);
    for prepare in [false, true] {
        if prepare {
            run(&mut t, Command::RequestCommit { txid }).0.unwrap();
        }
        let before = t.clone();
        let (res, eff) = run(&mut t, ack_cmd(txid, "p1"));
        assert_eq!(res, Err(CommandError::NotDecided { txid }));
        assert!(eff.is_empty());
        assert_eq!(t, before);
    }
    let (res, eff) = run(&mut t, ack_cmd(77, "p1"));
    assert_eq!(res, Err(CommandError::NotFound { txid: 77 }));
    assert!(eff.is_empty());
}

#[test]
fn ack_unknown_participant_refused() {
    let mut t = TxTable::new();
    let txid = tx_with(&mut t, "k", &["p1"]);
    run(&mut t, decide_cmd(txid, Outcome::Abort, &[], DecisionSource::Client, 1))
        .0
        .unwrap();
    let before = t.clone();
    let (res, eff) = run(&mut t, ack_cmd(txid, "stranger"));
    assert_eq!(
        res,
        Err(CommandError::UnknownParticipant {
            txid,
            participant_id: "stranger".to_string(),
        })
    );
    assert!(eff.is_empty());
    assert_eq!(t, before);
}

#[test]
fn ack_sets_all_acked_flag_and_is_idempotent() {
    let mut t = TxTable::new();
    let txid = tx_with(&mut t, "k", &["p1", "p2"]);
    run(
        &mut t,
        decide_cmd(txid, Outcome::Commit, &["p1", "p2"], DecisionSource::Driver, 1),
    )
    .0
    .unwrap();

    let (res, eff) = run(&mut t, ack_cmd(txid, "p1"));
    assert_eq!(res, Ok(CommandOk::Acked { all_acked: false }));
    assert_eq!(eff, vec![Effect::Put(txid)]);
    assert!(t.get(txid).unwrap().participants[0].acked);
    assert!(!t.get(txid).unwrap().all_acked());

    let before = t.clone();
    let (res, eff) = run(&mut t, ack_cmd(txid, "p1"));
    assert_eq!(res, Ok(CommandOk::Acked { all_acked: false }));
    assert!(eff.is_empty(), "a duplicate ack emits nothing");
    assert_eq!(t, before);

    let (res, eff) = run(&mut t, ack_cmd(txid, "p2"));
    assert_eq!(res, Ok(CommandOk::Acked { all_acked: true }));
    assert_eq!(eff, vec![Effect::Put(txid)]);
    assert!(t.get(txid).unwrap().all_acked());
    // Acks do not touch the decision.
    assert_eq!(t.decision_view(txid), DecisionView::Decided(Outcome::Commit));
}

// ---------------------------------------------------------------- Forget (invariant 10)

#[test]
fn inv10_forget_only_after_all_acked() {
    let mut t = TxTable::new();
    let txid = tx_with(&mut t, "k", &["p1", "p2"]);

    // Refused before any decision (ACTIVE and PREPARING).
    for prepare in [false, true] {
        if prepare {
            run(&mut t, Command::RequestCommit { txid }).0.unwrap();
        }
        let before = t.clone();
        let (res, eff) = run(&mut t, Command::Forget { txid });
        assert_eq!(res, Err(CommandError::NotDecided { txid }));
        assert!(eff.is_empty());
        assert_eq!(t, before);
    }

    run(
        &mut t,
        decide_cmd(txid, Outcome::Commit, &["p1", "p2"], DecisionSource::Driver, 1),
    )
    .0
    .unwrap();

    // Refused while acks are missing, naming the ones missing.
    let before = t.clone();
    let (res, eff) = run(&mut t, Command::Forget { txid });
    assert_eq!(
        res,
        Err(CommandError::NotAllAcked {
            txid,
            pending: vec!["p1".into(), "p2".into()],
        })
    );
    assert!(eff.is_empty());
    assert_eq!(t, before);

    run(&mut t, ack_cmd(txid, "p2")).0.unwrap();
    let before = t.clone();
    let (res, eff) = run(&mut t, Command::Forget { txid });
    assert_eq!(
        res,
        Err(CommandError::NotAllAcked {
            txid,
            pending: vec!["p1".into()],
        })
    );
    assert!(eff.is_empty());
    assert_eq!(t, before);
    assert_eq!(t.decision_view(txid), DecisionView::Decided(Outcome::Commit));

    // All acked: forgotten.
    run(&mut t, ack_cmd(txid, "p1")).0.unwrap();
    let (res, eff) = run(&mut t, Command::Forget { txid });
    assert_eq!(res, Ok(CommandOk::Forgotten));
    assert_eq!(eff, vec![Effect::Remove(txid)]);
    assert!(t.get(txid).is_none());
    assert!(t.is_empty());
    assert_eq!(t.decision_view(txid), DecisionView::Unknown);

    // A second Forget (or anything else) finds nothing.
    let (res, eff) = run(&mut t, Command::Forget { txid });
    assert_eq!(res, Err(CommandError::NotFound { txid }));
    assert!(eff.is_empty());
    let (res, eff) = run(&mut t, ack_cmd(txid, "p1"));
    assert_eq!(res, Err(CommandError::NotFound { txid }));
    assert!(eff.is_empty());
}

#[test]
fn inv10_forget_decided_tx_without_participants() {
    let mut t = TxTable::new();
    let txid = begin_new(&mut t, "k", 0, 10);
    run(
        &mut t,
        decide_cmd(txid, Outcome::Abort, &[], DecisionSource::Reaper, 10),
    )
    .0
    .unwrap();
    let (res, eff) = run(&mut t, Command::Forget { txid });
    assert_eq!(res, Ok(CommandOk::Forgotten));
    assert_eq!(eff, vec![Effect::Remove(txid)]);
    assert_eq!(t.decision_view(txid), DecisionView::Unknown);
}

#[test]
fn inv10_txid_never_reused_after_forget() {
    let mut t = TxTable::new();
    let _a = tx_with(&mut t, "a", &[]);
    let txid = tx_with(&mut t, "order", &["p1"]);
    assert_eq!(txid, 2, "the forgotten tx holds the highest txid");
    run(
        &mut t,
        decide_cmd(txid, Outcome::Commit, &["p1"], DecisionSource::Driver, 1),
    )
    .0
    .unwrap();
    run(&mut t, ack_cmd(txid, "p1")).0.unwrap();
    run(&mut t, Command::Forget { txid }).0.unwrap();
    assert_eq!(t.next_txid(), 3, "Forget never lowers next_txid");

    // The idempotency key went with the record: the same key and request begin
    // a NEW transaction with a larger txid (not the forgotten one).
    let (res, eff) = run(&mut t, begin_cmd("order", fp(1), 5000, 100));
    match res {
        Ok(CommandOk::Began {
            txid: new,
            existing,
            deadline_ms,
        }) => {
            assert!(!existing);
            assert!(new > txid, "txid {new} reused or went backwards (forgot {txid})");
            assert_eq!(new, 3);
            assert_eq!(deadline_ms, 5100);
            assert_eq!(eff, vec![Effect::Put(new)]);
            let r = t.get(new).unwrap();
            assert_eq!(r.phase, Phase::Active);
            assert!(r.participants.is_empty());
        }
        other => panic!("unexpected {other:?}"),
    }
    // The forgotten txid stays unknown.
    assert_eq!(t.decision_view(txid), DecisionView::Unknown);
}

// ---------------------------------------------------------------- reads and rebuild

#[test]
fn decision_view_pending_decided_unknown() {
    let mut t = TxTable::new();
    assert_eq!(t.decision_view(1), DecisionView::Unknown, "never begun");
    let a = tx_with(&mut t, "a", &["p1"]);
    let c = tx_with(&mut t, "c", &["p1"]);
    assert_eq!(t.decision_view(a), DecisionView::Pending);
    run(&mut t, Command::RequestCommit { txid: a }).0.unwrap();
    assert_eq!(t.decision_view(a), DecisionView::Pending);
    run(&mut t, decide_cmd(a, Outcome::Abort, &[], DecisionSource::Client, 1))
        .0
        .unwrap();
    run(
        &mut t,
        decide_cmd(c, Outcome::Commit, &["p1"], DecisionSource::Driver, 1),
    )
    .0
    .unwrap();
    assert_eq!(t.decision_view(a), DecisionView::Decided(Outcome::Abort));
    assert_eq!(t.decision_view(c), DecisionView::Decided(Outcome::Commit));
    assert_eq!(t.decision_view(c + 1), DecisionView::Unknown);
    assert_eq!(t.decision_view(0), DecisionView::Unknown);
}

#[test]
fn from_parts_rebuilds_key_index() {
    let mut t = TxTable::new();
    let a = tx_with(&mut t, "a", &["p1"]);
    let b = tx_with(&mut t, "b", &["p1", "p2"]);
    let c = tx_with(&mut t, "c", &[]);
    run(
        &mut t,
        decide_cmd(b, Outcome::Commit, &["p1", "p2"], DecisionSource::Driver, 1),
    )
    .0
    .unwrap();
    run(&mut t, decide_cmd(c, Outcome::Abort, &[], DecisionSource::Client, 1))
        .0
        .unwrap();
    run(&mut t, Command::Forget { txid: c }).0.unwrap();

    let mut r = TxTable::from_parts(t.next_txid(), t.records().cloned().collect::<Vec<_>>());
    assert_eq!(r, t, "rebuilt table equals the original, key index included");
    assert_eq!(r.next_txid(), 4);
    assert_eq!(r.len(), 2);

    // Idempotent Begin still works after the rebuild...
    let (res, eff) = run(&mut r, begin_cmd("a", fp(1), 0, 0));
    assert_eq!(
        res,
        Ok(CommandOk::Began {
            txid: a,
            existing: true,
            deadline_ms: 1500,
        })
    );
    assert!(eff.is_empty());
    // ...and so does the key conflict check.
    let (res, eff) = run(&mut r, begin_cmd("b", fp(9), 0, 0));
    assert_eq!(
        res,
        Err(CommandError::KeyConflict {
            key: "b".into(),
            txid: b,
        })
    );
    assert!(eff.is_empty());
    // A forgotten key begins anew, with the next txid.
    let (res, eff) = run(&mut r, begin_cmd("c", fp(1), 0, 0));
    assert!(matches!(
        res,
        Ok(CommandOk::Began {
            txid: 4,
            existing: false,
            ..
        })
    ));
    assert_eq!(eff, vec![Effect::Put(4)]);
}

#[test]
fn from_parts_empty_starts_at_txid_1() {
    let t = TxTable::from_parts(0, Vec::new());
    assert_eq!(t.next_txid(), 1);
    assert_eq!(t, TxTable::new());
    let t = TxTable::from_parts(1, Vec::new());
    assert_eq!(t, TxTable::new());
}

#[test]
fn inv10_from_parts_never_reuses_a_live_txid() {
    // Even if the persisted next_txid lags behind the records (e.g. a torn
    // write), Begin must never hand out the txid of an existing record and
    // overwrite it.
    let mut t = TxTable::new();
    let a = tx_with(&mut t, "a", &["p1"]);
    let b = tx_with(&mut t, "b", &["p1"]);
    run(
        &mut t,
        decide_cmd(b, Outcome::Commit, &["p1"], DecisionSource::Driver, 1),
    )
    .0
    .unwrap();
    let mut r = TxTable::from_parts(1, t.records().cloned().collect::<Vec<_>>());
    assert!(r.next_txid() > b, "next_txid {} <= live txid {b}", r.next_txid());
    let (res, _) = run(&mut r, begin_cmd("new", fp(1), 0, 0));
    match res {
        Ok(CommandOk::Began { txid, existing, .. }) => {
            assert!(!existing);
            assert!(txid > b && txid != a);
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(r.decision_view(b), DecisionView::Decided(Outcome::Commit));
    assert_eq!(r.get(a).unwrap().idempotency_key, "a");
}

// ---------------------------------------------------------------- property-style

const PIDS: [&str; 4] = ["p0", "p1", "p2", "p3"];
const KEYS: [&str; 5] = ["k0", "k1", "k2", "k3", "k4"];

/// One random command. It may peek at `t` (the reference table) to aim COMMIT
/// voters at the enlisted set half of the time; the commands themselves are
/// then applied identically to every table. `rng` is seeded (StdRng), so a
/// seed replays the same commands.
fn random_command(rng: &mut StdRng, t: &TxTable, now_ms: u64) -> Command {
    // Mostly live txids, sometimes any id up to one past the end (forgotten,
    // never begun, 0).
    let live: Vec<Txid> = t.records().map(|r| r.txid).collect();
    let txid = if !live.is_empty() && rng.random_ratio(4, 5) {
        *live.choose(rng).unwrap()
    } else {
        rng.random_range(0..=t.next_txid())
    };
    match rng.random_range(0..100) {
        0..=14 => Command::Begin {
            idempotency_key: KEYS.choose(rng).unwrap().to_string(),
            fingerprint: fp(rng.random_range(0..2)),
            now_ms,
            timeout_ms: rng.random_range(0..60),
        },
        15..=34 => Command::Enlist {
            txid,
            participant_id: PIDS.choose(rng).unwrap().to_string(),
            address: format!("a{}", rng.random_range(0..2)),
            payload: vec![rng.random_range(0..2)],
        },
        35..=44 => Command::RequestCommit { txid },
        45..=74 => {
            let outcome = if rng.random_bool(0.5) {
                Outcome::Commit
            } else {
                Outcome::Abort
            };
            let source = *[
                DecisionSource::Driver,
                DecisionSource::Client,
                DecisionSource::Reaper,
                DecisionSource::Operator,
            ]
            .choose(rng)
            .unwrap();
            let voters: Vec<String> = match (rng.random_bool(0.5), t.get(txid)) {
                (true, Some(r)) => {
                    // The enlisted set, sometimes with one voter dropped,
                    // added or duplicated.
                    let mut v: Vec<String> = r.participants.iter().map(|p| p.id.clone()).collect();
                    match rng.random_range(0..6) {
                        0 if !v.is_empty() => {
                            let i = rng.random_range(0..v.len());
                            v.remove(i);
                        }
                        1 => v.push(PIDS.choose(rng).unwrap().to_string()),
                        _ => {}
                    }
                    v
                }
                _ => (0..rng.random_range(0..5))
                    .map(|_| PIDS.choose(rng).unwrap().to_string())
                    .collect(),
            };
            Command::Decide {
                txid,
                outcome,
                voters,
                source,
                term: rng.random_range(0..4),
                now_ms,
                note: format!("n{}", rng.random_range(0..3)),
            }
        }
        75..=89 => Command::Ack {
            txid,
            participant_id: PIDS.choose(rng).unwrap().to_string(),
        },
        90..=94 => Command::Forget { txid },
        95..=97 => Command::DropParticipant {
            txid,
            participant_id: PIDS.choose(rng).unwrap().to_string(),
            note: format!("operator o: n{}", rng.random_range(0..3)),
            now_ms,
        },
        _ => Command::ForgetByOperator {
            txid,
            note: "operator o: why".to_string(),
        },
    }
}

#[test]
fn prop_random_commands_are_deterministic_and_keep_inv1_inv2_inv10() {
    for seed in [0x9E37_79B9_7F4A_7C15u64, 1, 0xDEAD_BEEF, 42] {
        // Every failure below names its step; this line (shown with the
        // failure's output) names the seed to replay.
        println!("prop_random_commands: seed {seed:#x}");
        let mut rng = StdRng::seed_from_u64(seed);
        let mut a = TxTable::new();
        let mut b = TxTable::new();
        let mut now_ms = 0u64;
        // First decision ever recorded per txid (survives Forget).
        let mut first: BTreeMap<Txid, Decision> = BTreeMap::new();
        // Participant set (ids) when a tx left ACTIVE: it must never change.
        let mut frozen: BTreeMap<Txid, Vec<Participant>> = BTreeMap::new();
        let mut forgotten: BTreeSet<Txid> = BTreeSet::new();
        let mut max_txid: Txid = 0;
        let (mut commits, mut aborts, mut forgets, mut drops) = (0, 0, 0, 0);

        for step in 0..5000 {
            now_ms += rng.random_range(0..20);
            let cmd = random_command(&mut rng, &a, now_ms);
            let pre = a.clone();

            let mut ea = Vec::new();
            let ra = a.apply(&cmd, &mut ea);
            let mut eb = Vec::new();
            let rb = b.apply(&cmd, &mut eb);

            // The derived reaper/forget indexes equal a brute-force scan.
            let brute_expired: Vec<Txid> = {
                let mut v: Vec<(u64, Txid)> = a
                    .records()
                    .filter(|r| r.decision().is_none() && r.deadline_ms <= now_ms)
                    .map(|r| (r.deadline_ms, r.txid))
                    .collect();
                v.sort();
                v.into_iter().map(|(_, t)| t).collect()
            };
            assert_eq!(
                a.expired(now_ms, usize::MAX),
                brute_expired,
                "seed {seed:#x} step {step}: expired index"
            );
            let brute_done: Vec<Txid> = {
                let mut v: Vec<(u64, Txid)> = a
                    .records()
                    .filter(|r| r.all_acked())
                    .filter_map(|r| r.decision().map(|d| (d.decided_ms, r.txid)))
                    .filter(|(d, _)| *d <= now_ms)
                    .collect();
                v.sort();
                v.into_iter().map(|(_, t)| t).collect()
            };
            assert_eq!(
                a.forgettable(now_ms, usize::MAX),
                brute_done,
                "seed {seed:#x} step {step}: forget index"
            );
            let brute_preparing: Vec<Txid> = a
                .records()
                .filter(|r| r.phase == Phase::Preparing)
                .map(|r| r.txid)
                .collect();
            assert_eq!(
                a.preparing(usize::MAX),
                brute_preparing,
                "seed {seed:#x} step {step}: preparing index"
            );
            // Not waiting for a participant an operator dropped.
            let brute_undelivered: Vec<Txid> = a
                .records()
                .filter(|r| {
                    r.decision().is_some() && r.participants.iter().any(|p| !p.acked && !a.is_dropped(r.txid, &p.id))
                })
                .map(|r| r.txid)
                .collect();
            assert_eq!(
                a.undelivered(usize::MAX),
                brute_undelivered,
                "seed {seed:#x} step {step}: delivery index"
            );

            // Determinism: same result, same effects, same table.
            assert_eq!(ra, rb, "seed {seed:#x} step {step}: results differ for {cmd:?}");
            assert_eq!(ea, eb, "seed {seed:#x} step {step}: effects differ");
            assert_eq!(a, b, "seed {seed:#x} step {step}: tables differ");

            // Drops are kept only beside a record.
            assert!(
                a.drops().keys().all(|t| a.get(*t).is_some()),
                "seed {seed:#x} step {step}: drops of a forgotten record"
            );

            // A refused command changes nothing and emits nothing.
            if ra.is_err() || matches!(ra, Ok(CommandOk::OperatorRefused(_))) {
                assert!(ea.is_empty(), "step {step}: error with effects {ea:?}");
                assert_eq!(a, pre, "step {step}: error changed the table: {ra:?}");
            }
            // Effects name exactly what changed.
            for e in &ea {
                match e {
                    Effect::Put(id) => assert!(a.get(*id).is_some(), "step {step}: Put({id}) of absent record"),
                    Effect::Remove(id) => assert!(a.get(*id).is_none(), "step {step}: Remove({id}) of present record"),
                    Effect::Decided(id, o) => {
                        assert_eq!(a.decision_view(*id), DecisionView::Decided(*o));
                        assert!(pre.get(*id).unwrap().decision().is_none());
                    }
                    Effect::RetiredNodeIdsChanged => assert_ne!(a.retired_node_ids(), pre.retired_node_ids()),
                }
            }
            let changed: BTreeSet<Txid> = pre
                .records()
                .chain(a.records())
                .map(|r| r.txid)
                .filter(|id| pre.get(*id) != a.get(*id) || pre.dropped(*id) != a.dropped(*id))
                .collect();
            let named: BTreeSet<Txid> = ea
                .iter()
                .filter_map(|e| match e {
                    Effect::Put(id) | Effect::Remove(id) => Some(*id),
                    Effect::Decided(..) | Effect::RetiredNodeIdsChanged => None,
                })
                .collect();
            assert_eq!(
                changed, named,
                "step {step}: changed records vs Put/Remove effects for {cmd:?}"
            );

            // Invariant 10: txids only grow and are never reused.
            assert!(a.next_txid() >= pre.next_txid());
            if let Ok(CommandOk::Began {
                txid, existing: false, ..
            }) = &ra
            {
                assert!(*txid > max_txid, "step {step}: txid {txid} not above {max_txid}");
                assert!(!forgotten.contains(txid));
                max_txid = *txid;
            }
            if let Command::Forget { txid } = &cmd {
                if ra.is_ok() {
                    let r = pre.get(*txid).unwrap();
                    assert!(r.decision().is_some(), "forgot an undecided tx");
                    assert!(r.all_acked(), "forgot a tx with unacked participants");
                    forgotten.insert(*txid);
                    forgets += 1;
                }
            }
            if ra == Ok(CommandOk::ParticipantDropped { recorded: true }) {
                drops += 1;
            }
            if let (Command::ForgetByOperator { txid, .. }, Ok(CommandOk::ForgottenByOperator { outcome: Some(o) })) =
                (&cmd, &ra)
            {
                // Invariant 10: only what nothing more is delivered to, and
                // never a COMMIT a participant (dropped) did not ack.
                let r = pre.get(*txid).unwrap();
                assert_eq!(r.decision().map(|d| d.outcome), Some(*o));
                for p in r.participants.iter().filter(|p| !p.acked) {
                    assert!(
                        pre.is_dropped(*txid, &p.id),
                        "step {step}: forgot {txid} owing {}",
                        p.id
                    );
                    assert_eq!(*o, Outcome::Abort, "step {step}: forgot a COMMIT {} never acked", p.id);
                }
                forgotten.insert(*txid);
                forgets += 1;
            }

            if let Command::Decide {
                txid,
                outcome,
                voters,
                source,
                ..
            } = &cmd
            {
                if let Ok(CommandOk::Decided { decision, recorded }) = &ra {
                    assert_eq!(
                        ea.contains(&Effect::Decided(*txid, decision.outcome)),
                        *recorded,
                        "step {step}: Decided effect iff recorded"
                    );
                    if *recorded {
                        assert_eq!(decision.outcome, *outcome);
                        match outcome {
                            Outcome::Commit => commits += 1,
                            Outcome::Abort => aborts += 1,
                        }
                        // Invariant 2: no COMMIT while an enlisted participant
                        // is missing from the voters (nor any stranger voted).
                        if *outcome == Outcome::Commit {
                            assert_ne!(*source, DecisionSource::Reaper, "reaper committed");
                            let enlisted: BTreeSet<&str> = pre
                                .get(*txid)
                                .unwrap()
                                .participants
                                .iter()
                                .map(|p| p.id.as_str())
                                .collect();
                            let voted: BTreeSet<&str> = voters.iter().map(String::as_str).collect();
                            for p in &enlisted {
                                assert!(
                                    voted.contains(p),
                                    "step {step}: COMMIT of {txid} without a vote from {p}"
                                );
                            }
                            assert_eq!(enlisted, voted);
                        }
                        // Invariant 7: a reaper ABORT only at/after the deadline.
                        if *source == DecisionSource::Reaper {
                            assert!(decision.decided_ms >= pre.get(*txid).unwrap().deadline_ms);
                        }
                    } else {
                        assert!(ea.is_empty());
                    }
                }
            }

            // Invariant 1: a recorded decision never changes afterwards.
            for r in a.records() {
                if let Some(d) = r.decision() {
                    let f = first.entry(r.txid).or_insert_with(|| d.clone());
                    assert_eq!(f, d, "seed {seed:#x} step {step}: decision of {} changed", r.txid);
                    // Once decided, the view never reads Pending again.
                    assert_eq!(a.decision_view(r.txid), DecisionView::Decided(f.outcome));
                } else {
                    assert!(
                        !first.contains_key(&r.txid),
                        "step {step}: tx {} lost its decision",
                        r.txid
                    );
                }
                // The participant set is frozen once the tx leaves ACTIVE.
                if r.phase != Phase::Active {
                    let ids = r
                        .participants
                        .iter()
                        .map(|p| Participant {
                            acked: false,
                            ..p.clone()
                        })
                        .collect::<Vec<_>>();
                    let f = frozen.entry(r.txid).or_insert_with(|| ids.clone());
                    assert_eq!(*f, ids, "step {step}: participant set of {} changed", r.txid);
                }
            }
            for id in &forgotten {
                assert_eq!(a.decision_view(*id), DecisionView::Unknown);
            }
        }

        // The rebuilt table is the same table.
        let rebuilt =
            TxTable::from_parts(a.next_txid(), a.records().cloned().collect::<Vec<_>>()).with_drops(a.drops().clone());
        assert_eq!(rebuilt, a, "seed {seed:#x}: from_parts round trip");

        // The generator really exercised the interesting paths.
        assert!(commits > 10, "seed {seed:#x}: only {commits} commits");
        assert!(aborts > 10, "seed {seed:#x}: only {aborts} aborts");
        assert!(forgets > 3, "seed {seed:#x}: only {forgets} forgets");
        assert!(drops > 3, "seed {seed:#x}: only {drops} drops");
    }
}

#[test]
fn inv7_inv10_reaper_and_forget_indexes_follow_the_records() {
    let mut t = TxTable::new();
    let a = begin_new(&mut t, "a", 0, 100); // deadline 100
    let b = begin_new(&mut t, "b", 0, 50); // deadline 50
    let c = tx_with(&mut t, "c", &["p"]);
    assert_eq!(t.expired(49, 10), Vec::<Txid>::new());
    assert_eq!(t.expired(100, 10), vec![b, a]);
    assert_eq!(t.expired(100, 1), vec![b], "bounded by max");
    // Deciding removes from the reaper index; a decided tx without
    // participants is immediately forgettable.
    run(&mut t, decide_cmd(b, Outcome::Abort, &[], DecisionSource::Reaper, 60))
        .0
        .unwrap();
    assert_eq!(t.expired(100, 10), vec![a]);
    assert_eq!(t.forgettable(59, 10), Vec::<Txid>::new());
    assert_eq!(t.forgettable(60, 10), vec![b]);
    // A decided tx with an unacked participant is not forgettable until ack.
    run(
        &mut t,
        decide_cmd(c, Outcome::Commit, &["p"], DecisionSource::Driver, 70),
    )
    .0
    .unwrap();
    assert_eq!(t.forgettable(1000, 10), vec![b]);
    run(&mut t, ack_cmd(c, "p")).0.unwrap();
    assert_eq!(t.forgettable(1000, 10), vec![b, c]);
    run(&mut t, Command::Forget { txid: b }).0.unwrap();
    assert_eq!(t.forgettable(1000, 10), vec![c]);
    // Rebuilt tables carry the same indexes.
    let rebuilt = TxTable::from_parts(t.next_txid(), t.records().cloned().collect::<Vec<_>>());
    assert_eq!(rebuilt, t);
}

// ---- one-phase commit and BeginAndCommit ----

fn bac_cmd(key: &str, ids: &[&str], now_ms: u64, one_phase_allowed: bool) -> Command {
    Command::BeginAndCommit {
        idempotency_key: key.to_string(),
        fingerprint: fp(3),
        now_ms,
        timeout_ms: 500,
        participants: ids
            .iter()
            .map(|id| Enlistment {
                participant_id: id.to_string(),
                address: format!("{id}:1"),
                payload: b"w".to_vec(),
            })
            .collect(),
        one_phase_allowed,
    }
}

#[test]
fn begin_and_commit_records_a_preparing_transaction_in_one_command() {
    let mut t = TxTable::new();
    let (res, eff) = run(&mut t, bac_cmd("k", &["p1", "p2"], 1000, true));
    let txid = match res {
        Ok(CommandOk::BegunCommitting {
            txid,
            existing: false,
            deadline_ms: 1500,
            participants,
            decision: None,
            one_phase: false,
        }) => {
            assert_eq!(participants.len(), 2);
            txid
        }
        other => panic!("unexpected {other:?}"),
    };
    assert_eq!(eff, vec![Effect::Put(txid)]);
    assert_eq!(t.get(txid).unwrap().phase, Phase::Preparing);
    assert_eq!(t.preparing(10), vec![txid], "a new leader re-drives it");
    // Invariant 2: the set is frozen; a later Enlist is refused.
    let (res, _) = run(&mut t, enlist_cmd(txid, "p3", "p3:1", b"w"));
    assert!(matches!(res, Err(CommandError::NotActive { .. })), "{res:?}");
    // The same key again finds the same transaction, unchanged.
    let before = t.clone();
    let (res, eff) = run(&mut t, bac_cmd("k", &["p1", "p2"], 1200, true));
    assert!(
        matches!(res, Ok(CommandOk::BegunCommitting { txid: x, existing: true, .. }) if x == txid),
        "{res:?}"
    );
    assert!(eff.is_empty());
    assert_eq!(t, before);
}

#[test]
fn begin_and_commit_refuses_bad_participant_sets_without_using_a_txid() {
    let mut t = TxTable::new();
    let next = t.next_txid();
    for (cmd, field) in [
        (bac_cmd("k", &[], 1000, true), "participants"),
        (bac_cmd("k", &["p1", "p1"], 1000, true), "named twice"),
        (bac_cmd("k", &[""], 1000, true), "participant_id"),
    ] {
        let (res, eff) = run(&mut t, cmd);
        expect_invalid_naming(res, field);
        assert!(eff.is_empty());
    }
    assert_eq!(t.next_txid(), next, "a refused command uses no txid");
    assert!(t.is_empty());
}

#[test]
fn one_phase_is_chosen_only_for_a_single_participant() {
    let mut t = TxTable::new();
    let one = tx_with(&mut t, "a", &["p1"]);
    let two = tx_with(&mut t, "b", &["p1", "p2"]);
    let (r1, _) = run(&mut t, Command::RequestCommitOnePhase { txid: one });
    let (r2, _) = run(&mut t, Command::RequestCommitOnePhase { txid: two });
    assert!(
        matches!(r1, Ok(CommandOk::CommitRequested { one_phase: true, .. })),
        "{r1:?}"
    );
    assert!(
        matches!(r2, Ok(CommandOk::CommitRequested { one_phase: false, .. })),
        "{r2:?}"
    );
    let (r3, _) = run(&mut t, bac_cmd("c", &["p1"], 1000, false));
    assert!(
        matches!(r3, Ok(CommandOk::BegunCommitting { one_phase: false, .. })),
        "{r3:?}"
    );
}

#[test]
fn inv3_inv7_one_phase_commit_is_never_aborted_by_reaper_client_or_operator() {
    let mut t = TxTable::new();
    let txid = match run(&mut t, bac_cmd("k", &["p1"], 1000, true)).0 {
        Ok(CommandOk::BegunCommitting {
            txid, one_phase: true, ..
        }) => txid,
        other => panic!("unexpected {other:?}"),
    };
    // Past its deadline it is not an expiry candidate: the participant may
    // have committed, so only its answer decides.
    assert!(t.expired(u64::MAX, 10).is_empty());
    for source in [DecisionSource::Reaper, DecisionSource::Client, DecisionSource::Operator] {
        let (res, eff) = run(&mut t, decide_cmd(txid, Outcome::Abort, &["p1"], source, 9999));
        assert_eq!(res, Err(CommandError::OnePhaseOnly { txid }), "{source:?}");
        assert!(eff.is_empty());
    }
    // The driver's report without the participant's name is refused too.
    let (res, _) = run(
        &mut t,
        decide_cmd(txid, Outcome::Abort, &[], DecisionSource::Driver, 9999),
    );
    assert_eq!(res, Err(CommandError::OnePhaseOnly { txid }));
    assert_eq!(t.decision_view(txid), DecisionView::Pending);
}

#[test]
fn one_phase_answer_is_the_decision_and_the_ack() {
    let mut t = TxTable::new();
    let txid = match run(&mut t, bac_cmd("k", &["p1"], 1000, true)).0 {
        Ok(CommandOk::BegunCommitting { txid, .. }) => txid,
        other => panic!("unexpected {other:?}"),
    };
    let (res, _) = run(
        &mut t,
        decide_cmd(txid, Outcome::Commit, &["p1"], DecisionSource::Driver, 1100),
    );
    let (d, recorded) = decided_ok(&res);
    assert!(recorded);
    assert_eq!(d.outcome, Outcome::Commit);
    assert!(t.get(txid).unwrap().all_acked(), "nothing left to deliver");
    assert!(t.undelivered(10).is_empty());
    assert_eq!(t.forgettable(1100, 10), vec![txid]);
}

// ---------------------------------------------------------------- awaiting_ack

/// Invariant 10 at participants: `awaiting_ack` tells a participant whether
/// the cluster still owes it the decision, so it keeps its log record: true
/// only once decided, only for an enlisted participant, and no longer once
/// that participant's ack is recorded or the transaction is forgotten.
#[test]
fn inv10_awaiting_ack_is_true_only_between_the_decision_and_that_participants_ack() {
    let mut t = TxTable::new();
    let txid = tx_with(&mut t, "gc", &["p1", "p2"]);
    assert!(!t.awaiting_ack(txid, "p1"), "undecided: nothing to deliver yet");
    run(&mut t, Command::RequestCommit { txid }).0.unwrap();
    assert!(!t.awaiting_ack(txid, "p1"), "preparing: nothing to deliver yet");
    let (res, _) = run(
        &mut t,
        decide_cmd(txid, Outcome::Commit, &["p1", "p2"], DecisionSource::Driver, 1200),
    );
    decided_ok(&res);
    assert!(t.awaiting_ack(txid, "p1"));
    assert!(t.awaiting_ack(txid, "p2"));
    assert!(!t.awaiting_ack(txid, "stranger"), "not enlisted: nothing is sent to it");
    run(&mut t, ack_cmd(txid, "p1")).0.unwrap();
    assert!(!t.awaiting_ack(txid, "p1"), "acked");
    assert!(t.awaiting_ack(txid, "p2"), "one ack says nothing about another");
    run(&mut t, ack_cmd(txid, "p2")).0.unwrap();
    assert!(!t.awaiting_ack(txid, "p2"));
    run(&mut t, Command::Forget { txid }).0.unwrap();
    assert_eq!(t.decision_view(txid), DecisionView::Unknown);
    assert!(!t.awaiting_ack(txid, "p1"), "forgotten");
    assert!(!t.awaiting_ack(txid + 100, "p1"), "never begun");

    // ABORT is delivered too: awaited until acked.
    let aborted = tx_with(&mut t, "gc-abort", &["p1"]);
    let (res, _) = run(
        &mut t,
        decide_cmd(aborted, Outcome::Abort, &[], DecisionSource::Client, 1300),
    );
    decided_ok(&res);
    assert!(t.awaiting_ack(aborted, "p1"));
    run(&mut t, ack_cmd(aborted, "p1")).0.unwrap();
    assert!(!t.awaiting_ack(aborted, "p1"));
}

// ------------------------------------------------ retired node ids

#[test]
fn retire_node_id_is_remembered_idempotent_and_touches_no_transaction() {
    let mut t = TxTable::new();
    let (r, _) = run(&mut t, begin_cmd("k", fp(1), 0, 1_000));
    assert!(r.is_ok());
    let before: Vec<TxRecord> = t.records().cloned().collect();
    assert!(!t.is_retired_node_id(4));

    let (r, e) = run(&mut t, Command::RetireNodeId { node_id: 4 });
    assert_eq!(r, Ok(CommandOk::NodeIdRetired { newly: true }));
    assert_eq!(e, vec![Effect::RetiredNodeIdsChanged]);
    assert!(t.is_retired_node_id(4));
    assert!(!t.is_retired_node_id(3));

    // Again: the same answer, marked not new, and nothing to persist.
    let (r, e) = run(&mut t, Command::RetireNodeId { node_id: 4 });
    assert_eq!(r, Ok(CommandOk::NodeIdRetired { newly: false }));
    assert!(e.is_empty());
    assert_eq!(t.retired_node_ids(), &BTreeSet::from([4]));

    // Transactions and the txid counter are untouched (invariant 10: the
    // counter only moves on Begin).
    assert_eq!(t.records().cloned().collect::<Vec<_>>(), before);
    assert_eq!(t.next_txid(), 2);
}

#[test]
fn retire_node_id_zero_is_refused_without_effect() {
    let mut t = TxTable::new();
    let (r, e) = run(&mut t, Command::RetireNodeId { node_id: 0 });
    assert!(
        matches!(r, Err(CommandError::Invalid(ref m)) if m.contains("node id 0")),
        "{r:?}"
    );
    assert!(e.is_empty());
    assert!(t.retired_node_ids().is_empty());
}

#[test]
fn retired_node_ids_are_deterministic_and_kept_when_rebuilt() {
    // Two replicas applying the same commands agree; a table rebuilt from
    // persisted parts keeps the set (the store adds it back).
    let cmds = [
        Command::RetireNodeId { node_id: 2 },
        begin_cmd("k", fp(1), 0, 1_000),
        Command::RetireNodeId { node_id: 7 },
        Command::RetireNodeId { node_id: 2 },
    ];
    let (mut a, mut b) = (TxTable::new(), TxTable::new());
    for c in &cmds {
        assert_eq!(run(&mut a, c.clone()), run(&mut b, c.clone()));
    }
    assert_eq!(a, b);
    let rebuilt =
        TxTable::from_parts(a.next_txid(), a.records().cloned()).with_retired_node_ids(a.retired_node_ids().clone());
    assert_eq!(rebuilt, a);
}

#[test]
fn older_commands_keep_their_encoding_after_retire_node_id_was_added() {
    // A variant index (the first byte after the format version) is part of
    // the stored format: RetireNodeId comes after Forget, and moving either
    // would need a new `codec::FORMAT_VERSION` (ADR 0042).
    let forget = crate::codec::encode(&Command::Forget { txid: 5 }).unwrap();
    assert_eq!(forget, vec![crate::codec::FORMAT_VERSION, 7, 5]);
    let retire = crate::codec::encode(&Command::RetireNodeId { node_id: 4 }).unwrap();
    assert_eq!(retire, vec![crate::codec::FORMAT_VERSION, 8, 4]);
    assert_eq!(
        crate::codec::decode::<Command>(&forget).unwrap(),
        Command::Forget { txid: 5 }
    );
}

// ---------------------------------------------------------------- owners

fn as_app(caller: &str, cmd: Command) -> Command {
    Command::As {
        caller: caller.to_string(),
        command: Box::new(cmd),
    }
}

#[test]
fn a_transaction_begun_on_behalf_of_an_application_records_it_once() {
    let mut t = TxTable::new();
    let (r, fx) = run(&mut t, as_app("shop", begin_cmd("k", fp(1), 0, 1_000)));
    let txid = match r {
        Ok(CommandOk::Began {
            txid, existing: false, ..
        }) => txid,
        other => panic!("{other:?}"),
    };
    assert_eq!(t.owner(txid), Some("shop"));
    assert!(
        fx.contains(&Effect::Put(txid)),
        "the owner is persisted with the record"
    );

    // The same key on behalf of another application finds the same
    // transaction (the API refuses it then) and leaves the owner alone.
    let (r, _) = run(&mut t, as_app("billing", begin_cmd("k", fp(1), 0, 1_000)));
    assert!(matches!(r, Ok(CommandOk::Began { existing: true, .. })), "{r:?}");
    assert_eq!(t.owner(txid), Some("shop"));

    // Commands on an existing transaction never set or change an owner.
    let (r, _) = run(&mut t, as_app("billing", enlist_cmd(txid, "a", "127.0.0.1:1", b"")));
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(t.owner(txid), Some("shop"));

    // Without As there is no owner; a refused As command records none.
    let (r, _) = run(&mut t, begin_cmd("plain", fp(2), 0, 1_000));
    let plain = match r {
        Ok(CommandOk::Began { txid, .. }) => txid,
        other => panic!("{other:?}"),
    };
    assert_eq!(t.owner(plain), None);
    let next = t.next_txid();
    let (r, _) = run(&mut t, as_app("shop", begin_cmd("", fp(3), 0, 1_000)));
    assert!(r.is_err(), "an empty key is refused");
    assert_eq!(t.owner(next), None);

    // Forgotten with its record.
    let (r, _) = run(&mut t, decide_cmd(txid, Outcome::Abort, &[], DecisionSource::Client, 1));
    assert!(r.is_ok(), "{r:?}");
    let (r, _) = run(&mut t, ack_cmd(txid, "a"));
    assert!(r.is_ok(), "{r:?}");
    let (r, _) = run(&mut t, Command::Forget { txid });
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(t.owner(txid), None);
    assert!(!t.owners().contains_key(&txid));
}

#[test]
fn begin_and_commit_and_the_one_write_path_record_their_owner() {
    let mut t = TxTable::new();
    let parts = vec![Enlistment {
        participant_id: "a".into(),
        address: "127.0.0.1:1".into(),
        payload: vec![],
    }];
    let (r, _) = run(
        &mut t,
        as_app(
            "shop",
            Command::BeginAndCommit {
                idempotency_key: "bc".into(),
                fingerprint: fp(1),
                now_ms: 0,
                timeout_ms: 1_000,
                participants: parts.clone(),
                one_phase_allowed: false,
            },
        ),
    );
    let txid = match r {
        Ok(CommandOk::BegunCommitting { txid, .. }) => txid,
        other => panic!("{other:?}"),
    };
    assert_eq!(t.owner(txid), Some("shop"));

    let (r, _) = run(&mut t, Command::ReserveTxids { count: 4 });
    let first = match r {
        Ok(CommandOk::TxidsReserved { first, .. }) => first,
        other => panic!("{other:?}"),
    };
    let one_write = Command::BeginAndDecide {
        txid: first,
        alloc_term: 0,
        idempotency_key: "bd".into(),
        fingerprint: fp(2),
        begun_ms: 0,
        deadline_ms: 1_000,
        participants: parts,
        outcome: Outcome::Commit,
        voters: vec!["a".into()],
        acked: vec![],
        now_ms: 1,
        note: String::new(),
    };
    let (r, _) = run(&mut t, as_app("billing", one_write));
    assert!(matches!(r, Ok(CommandOk::BegunDecided { recorded: true, .. })), "{r:?}");
    assert_eq!(t.owner(first), Some("billing"));
    assert_eq!(command_txid(&as_app("x", Command::Forget { txid: 9 })), Some(9));
}

/// ADR 0050: `release` takes only a decided, fully acked record out (with
/// its owner, drops and branches, without effects), and `admit` puts it
/// back: the table is then equal to the one before, so a command about a
/// retained record is applied exactly as if it had never left memory.
#[test]
fn released_records_admitted_again_leave_the_table_as_it_was() {
    let mut t = TxTable::new();
    let done = tx_with(&mut t, "done", &["a", "b"]);
    let waiting = tx_with(&mut t, "waiting", &["a"]);
    let active = tx_with(&mut t, "active", &["a"]);
    for txid in [done, waiting] {
        run(&mut t, Command::RequestCommit { txid }).0.unwrap();
        let ids: &[&str] = if txid == done { &["a", "b"] } else { &["a"] };
        decided_ok(
            &run(
                &mut t,
                decide_cmd(txid, Outcome::Commit, ids, DecisionSource::Driver, 5),
            )
            .0,
        );
    }
    run(&mut t, ack_cmd(done, "a")).0.unwrap();
    run(&mut t, ack_cmd(done, "b")).0.unwrap();
    let before = t.clone();
    assert_eq!(t.done_txids(), vec![done]);
    assert!(t.release(waiting).is_none(), "still owed an ack");
    assert!(t.release(active).is_none(), "undecided");
    assert_eq!(t, before);
    let r = t.release(done).expect("decided and acked");
    assert_eq!((r.record.txid, r.decided_ms()), (done, 5));
    assert!(t.get(done).is_none() && t.txid_of_key("done").is_none() && t.done_txids().is_empty());
    assert_eq!(t.forgettable(u64::MAX, 10), Vec::<Txid>::new());
    t.admit(r);
    assert_eq!(t, before, "admitted again, the table is the one before");
}
