//! Unit tests of the one-write commit path's commands (ADR 0012):
//! `ReserveTxids` and `BeginAndDecide`. Named after the invariant they
//! check where there is one (numbered as in docs/protocol.md, "Invariants
//! and the mechanisms that keep them").

use super::*;

const TERM: u64 = 5;

fn run_in(t: &mut TxTable, term: u64, cmd: Command) -> (CommandResult, Vec<Effect>) {
    let mut effects = Vec::new();
    let res = t.apply_in_term(term, &cmd, &mut effects);
    (res, effects)
}

fn reserve(t: &mut TxTable, count: u64) -> (Txid, Txid) {
    match run_in(t, TERM, Command::ReserveTxids { count }) {
        (Ok(CommandOk::TxidsReserved { first, end }), eff) => {
            assert!(eff.is_empty(), "a reservation changes no record: {eff:?}");
            (first, end)
        }
        other => panic!("reserve: {other:?}"),
    }
}

fn enlistments(ids: &[&str]) -> Vec<Enlistment> {
    ids.iter()
        .map(|id| Enlistment {
            participant_id: id.to_string(),
            address: format!("127.0.0.1:1/{id}"),
            payload: id.as_bytes().to_vec(),
        })
        .collect()
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// A BeginAndDecide of `txid` handed out in `alloc_term`.
fn bad_cmd(txid: Txid, alloc_term: u64, key: &str, outcome: Outcome, voters: &[&str], acked: &[&str]) -> Command {
    Command::BeginAndDecide {
        txid,
        alloc_term,
        idempotency_key: key.to_string(),
        fingerprint: [9; 32],
        begun_ms: 1_000,
        deadline_ms: 31_000,
        participants: enlistments(&["a", "b"]),
        outcome,
        voters: strings(voters),
        acked: strings(acked),
        now_ms: 1_500,
        note: String::new(),
    }
}

fn decided(res: CommandResult) -> (Txid, Decision, bool, Option<Txid>) {
    match res {
        Ok(CommandOk::BegunDecided {
            txid,
            decision,
            recorded,
            key_holder,
        }) => (txid, decision, recorded, key_holder),
        other => panic!("BeginAndDecide: {other:?}"),
    }
}

#[test]
fn inv10_reserved_ranges_never_overlap_each_other_or_begin() {
    let mut t = TxTable::new();
    let (a0, a1) = reserve(&mut t, 100);
    let mut e = Vec::new();
    let began = match t.apply(
        &Command::Begin {
            idempotency_key: "k".into(),
            fingerprint: [1; 32],
            now_ms: 0,
            timeout_ms: 10,
        },
        &mut e,
    ) {
        Ok(CommandOk::Began { txid, .. }) => txid,
        other => panic!("{other:?}"),
    };
    let (b0, b1) = reserve(&mut t, 7);
    assert_eq!((a0, a1), (1, 101));
    assert_eq!(began, 101, "Begin takes the next id after the range");
    assert_eq!((b0, b1), (102, 109));
    assert_eq!(t.next_txid(), 109);
}

#[test]
fn reserve_txids_refuses_zero_and_more_than_the_limit_without_effect() {
    let mut t = TxTable::new();
    for count in [0, limits::TXID_RESERVE_COUNT_MAX + 1] {
        let (res, eff) = run_in(&mut t, TERM, Command::ReserveTxids { count });
        assert!(matches!(res, Err(CommandError::Invalid(_))), "{count}: {res:?}");
        assert!(eff.is_empty());
    }
    assert_eq!(t.next_txid(), 1, "nothing was reserved");
}

#[test]
fn inv2_begin_and_decide_records_the_transaction_decided_in_one_command() {
    let mut t = TxTable::new();
    let (first, _) = reserve(&mut t, 10);
    let (res, eff) = run_in(
        &mut t,
        TERM,
        bad_cmd(first, TERM, "k", Outcome::Commit, &["a", "b"], &[]),
    );
    let (txid, d, recorded, holder) = decided(res);
    assert_eq!((txid, recorded, holder), (first, true, None));
    assert_eq!(d.outcome, Outcome::Commit);
    assert_eq!(d.term, TERM);
    assert_eq!(eff, vec![Effect::Put(first), Effect::Decided(first, Outcome::Commit)]);
    let r = t.get(first).expect("recorded");
    assert_eq!(r.participants.len(), 2);
    assert!(r.participants.iter().all(|p| !p.acked));
    assert_eq!(t.decision_view(first), DecisionView::Decided(Outcome::Commit));
    assert_eq!(t.txid_of_key("k"), Some(first));
    assert_eq!(t.undelivered(10), vec![first], "phase two is owed to both");
    assert!(
        t.expired(u64::MAX, 10).is_empty(),
        "born decided: nothing for the reaper"
    );
}

#[test]
fn inv2_begin_and_decide_commit_needs_every_participant_as_voter() {
    let mut t = TxTable::new();
    let (first, _) = reserve(&mut t, 10);
    for voters in [&["a"][..], &["a", "a"], &["a", "b", "c"], &[]] {
        let (res, eff) = run_in(&mut t, TERM, bad_cmd(first, TERM, "k", Outcome::Commit, voters, &[]));
        assert!(
            matches!(
                res,
                Err(CommandError::VotersMismatch { .. }) | Err(CommandError::UnknownParticipant { .. })
            ),
            "{voters:?}: {res:?}"
        );
        assert!(eff.is_empty());
        assert!(t.get(first).is_none(), "a refused write leaves no record");
    }
}

#[test]
fn read_only_voters_are_recorded_acked_with_the_decision() {
    let mut t = TxTable::new();
    let (first, _) = reserve(&mut t, 10);
    let (res, _) = run_in(
        &mut t,
        TERM,
        bad_cmd(first, TERM, "k", Outcome::Commit, &["a", "b"], &["b"]),
    );
    decided(res);
    let r = t.get(first).unwrap();
    let acked: Vec<(&str, bool)> = r.participants.iter().map(|p| (p.id.as_str(), p.acked)).collect();
    assert_eq!(acked, vec![("a", false), ("b", true)]);
}

#[test]
fn inv7_a_write_recorded_in_another_term_than_its_txid_was_handed_out_in_is_abort() {
    // A leader of a later term may have answered "unknown: presumed abort"
    // for the txid: only ABORT agrees with that.
    let mut t = TxTable::new();
    let (first, _) = reserve(&mut t, 10);
    let (res, eff) = run_in(
        &mut t,
        TERM + 1,
        bad_cmd(first, TERM, "k", Outcome::Commit, &["a", "b"], &[]),
    );
    let (txid, d, recorded, holder) = decided(res);
    assert_eq!((txid, recorded, holder), (first, true, None));
    assert_eq!(d.outcome, Outcome::Abort, "{d:?}");
    assert!(d.note.contains("term 5") && d.note.contains("term 6"), "{}", d.note);
    assert_eq!(eff, vec![Effect::Put(first), Effect::Decided(first, Outcome::Abort)]);
    // The same command in its own term commits.
    let (res, _) = run_in(
        &mut t,
        TERM,
        bad_cmd(first + 1, TERM, "k2", Outcome::Commit, &["a", "b"], &[]),
    );
    assert_eq!(decided(res).1.outcome, Outcome::Commit);
}

#[test]
fn inv1_begin_and_decide_is_write_once() {
    let mut t = TxTable::new();
    let (first, _) = reserve(&mut t, 10);
    let (res, _) = run_in(
        &mut t,
        TERM,
        bad_cmd(first, TERM, "k", Outcome::Commit, &["a", "b"], &[]),
    );
    decided(res);
    let before = t.clone();
    let (res, eff) = run_in(&mut t, TERM, bad_cmd(first, TERM, "k", Outcome::Abort, &[], &[]));
    let (_, d, recorded, _) = decided(res);
    assert!(!recorded);
    assert_eq!(d.outcome, Outcome::Commit, "the first decision stands");
    assert!(eff.is_empty());
    assert_eq!(t, before);
    // A Decide after it reads it back too.
    let mut e = Vec::new();
    let r = t.apply(
        &Command::Decide {
            txid: first,
            outcome: Outcome::Abort,
            voters: vec![],
            source: DecisionSource::Operator,
            term: 9,
            now_ms: 2_000,
            note: String::new(),
        },
        &mut e,
    );
    assert!(matches!(r, Ok(CommandOk::Decided { recorded: false, .. })), "{r:?}");
}

#[test]
fn inv1_a_key_that_belongs_to_another_transaction_records_this_one_as_abort() {
    let mut t = TxTable::new();
    let (first, _) = reserve(&mut t, 10);
    let (res, _) = run_in(
        &mut t,
        TERM,
        bad_cmd(first, TERM, "k", Outcome::Commit, &["a", "b"], &[]),
    );
    decided(res);
    // A second transaction with the same key (a retry that raced the
    // first): recorded, as ABORT, without the key, naming the holder.
    let (res, eff) = run_in(
        &mut t,
        TERM,
        bad_cmd(first + 1, TERM, "k", Outcome::Commit, &["a", "b"], &[]),
    );
    let (txid, d, recorded, holder) = decided(res);
    assert_eq!((txid, recorded, holder), (first + 1, true, Some(first)));
    assert_eq!(d.outcome, Outcome::Abort);
    assert_eq!(
        eff,
        vec![Effect::Put(first + 1), Effect::Decided(first + 1, Outcome::Abort)]
    );
    assert_eq!(t.txid_of_key("k"), Some(first), "the key stays with the first");
    assert_eq!(t.get(first + 1).unwrap().idempotency_key, "");
    // Forgetting the keyless one leaves the key where it is; the table
    // rebuilt from its records agrees.
    for p in ["a", "b"] {
        let mut e = Vec::new();
        t.apply(
            &Command::Ack {
                txid: first + 1,
                participant_id: p.into(),
            },
            &mut e,
        )
        .unwrap();
    }
    let rebuilt = TxTable::from_parts(t.next_txid(), t.records().cloned());
    assert_eq!(rebuilt, t);
    let mut e = Vec::new();
    assert_eq!(
        t.apply(&Command::Forget { txid: first + 1 }, &mut e),
        Ok(CommandOk::Forgotten)
    );
    assert_eq!(t.txid_of_key("k"), Some(first));
}

#[test]
fn inv10_begin_and_decide_refuses_a_txid_never_reserved() {
    let mut t = TxTable::new();
    let (_, end) = reserve(&mut t, 3);
    for txid in [0, end, end + 100] {
        let (res, eff) = run_in(&mut t, TERM, bad_cmd(txid, TERM, "k", Outcome::Abort, &[], &[]));
        assert!(matches!(res, Err(CommandError::Invalid(_))), "{txid}: {res:?}");
        assert!(eff.is_empty());
    }
    assert!(t.is_empty());
}

#[test]
fn begin_and_decide_refuses_bad_participant_sets_and_notes_without_effect() {
    let mut t = TxTable::new();
    let (first, _) = reserve(&mut t, 3);
    let mut cmds = Vec::new();
    let mut twice = bad_cmd(first, TERM, "k", Outcome::Abort, &[], &[]);
    if let Command::BeginAndDecide { participants, .. } = &mut twice {
        participants.push(participants[0].clone());
    }
    cmds.push(twice);
    let mut none = bad_cmd(first, TERM, "k", Outcome::Abort, &[], &[]);
    if let Command::BeginAndDecide { participants, .. } = &mut none {
        participants.clear();
    }
    cmds.push(none);
    let mut long_note = bad_cmd(first, TERM, "k", Outcome::Abort, &[], &[]);
    if let Command::BeginAndDecide { note, .. } = &mut long_note {
        *note = "x".repeat(limits::NOTE_BYTES_MAX + 1);
    }
    cmds.push(long_note);
    cmds.push(bad_cmd(first, TERM, "", Outcome::Abort, &[], &[]));
    cmds.push(bad_cmd(first, TERM, "k", Outcome::Abort, &[], &["stranger"]));
    for cmd in cmds {
        let (res, eff) = run_in(&mut t, TERM, cmd.clone());
        assert!(res.is_err(), "{cmd:?} -> {res:?}");
        assert!(eff.is_empty());
    }
    assert!(t.is_empty());
}

#[test]
fn the_new_commands_keep_the_older_commands_encoding() {
    // A variant index (the first byte after the format version) is part of
    // the stored format: these take the indexes after every older variant,
    // and moving one would need a new `codec::FORMAT_VERSION` (ADR 0042).
    let retire = crate::codec::encode(&Command::RetireNodeId { node_id: 4 }).unwrap();
    assert_eq!(retire, vec![crate::codec::FORMAT_VERSION, 8, 4]);
    let reserve = crate::codec::encode(&Command::ReserveTxids { count: 4 }).unwrap();
    assert_eq!(reserve, vec![crate::codec::FORMAT_VERSION, 9, 4]);
    let cmd = bad_cmd(1, TERM, "k", Outcome::Commit, &["a", "b"], &["b"]);
    let bytes = crate::codec::encode(&cmd).unwrap();
    assert_eq!(&bytes[..2], &[crate::codec::FORMAT_VERSION, 10]);
    assert_eq!(crate::codec::decode::<Command>(&bytes).unwrap(), cmd);
}
