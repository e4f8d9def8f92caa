//! Unit tests of branches that prepare where they run (ADR 0046):
//! `RegisterBranch`, `ExcludeBranch` and `TxTable::branch_view`. Named
//! after the invariant they check where there is one (numbered as in
//! docs/protocol.md, "Invariants and the mechanisms that keep them").

use super::*;

const TERM: u64 = 7;
const BEGUN_MS: u64 = 1_000;
const TIMEOUT_MS: u64 = 10_000;

fn run_in(t: &mut TxTable, term: u64, cmd: Command) -> (CommandResult, Vec<Effect>) {
    let mut effects = Vec::new();
    let res = t.apply_in_term(term, &cmd, &mut effects);
    (res, effects)
}

fn run(t: &mut TxTable, cmd: Command) -> CommandResult {
    run_in(t, TERM, cmd).0
}

fn begin(t: &mut TxTable, key: &str) -> Txid {
    match run(
        t,
        Command::Begin {
            idempotency_key: key.to_string(),
            fingerprint: [1; 32],
            now_ms: BEGUN_MS,
            timeout_ms: TIMEOUT_MS,
        },
    ) {
        Ok(CommandOk::Began { txid, .. }) => txid,
        other => panic!("begin: {other:?}"),
    }
}

fn addr(id: &str) -> String {
    format!("127.0.0.1:7{}", id.len())
}

fn register_at(txid: Txid, id: &str, vote: BranchVote, now_ms: u64) -> Command {
    Command::RegisterBranch {
        txid,
        participant_id: id.to_string(),
        address: addr(id),
        vote,
        reason: if vote == BranchVote::No {
            "out of stock".to_string()
        } else {
            String::new()
        },
        now_ms,
    }
}

fn register(txid: Txid, id: &str, vote: BranchVote) -> Command {
    register_at(txid, id, vote, BEGUN_MS + 10)
}

fn registered(res: CommandResult) -> (u64, bool, Option<Decision>) {
    match res {
        Ok(CommandOk::BranchRegistered {
            term,
            existing,
            decision,
            ..
        }) => (term, existing, decision),
        other => panic!("expected a registration, got {other:?}"),
    }
}

fn refused(res: CommandResult) -> BranchRefusal {
    match res {
        Ok(CommandOk::BranchRefused(r)) => r,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn decide(txid: Txid, outcome: Outcome, voters: &[&str]) -> Command {
    Command::Decide {
        txid,
        outcome,
        voters: voters.iter().map(|s| s.to_string()).collect(),
        source: DecisionSource::Driver,
        term: TERM,
        now_ms: BEGUN_MS + 20,
        note: String::new(),
    }
}

fn exclude(txid: Txid, id: &str) -> Command {
    Command::ExcludeBranch {
        txid,
        participant_id: id.to_string(),
    }
}

fn excluded(res: CommandResult) -> (bool, Option<Outcome>, bool) {
    match res {
        Ok(CommandOk::BranchExcluded {
            member,
            decided,
            fenced_now,
        }) => (member, decided, fenced_now),
        other => panic!("expected an exclusion answer, got {other:?}"),
    }
}

#[test]
fn a_registration_enlists_the_branch_with_its_vote_and_answers_the_entry_term() {
    let mut t = TxTable::new();
    let txid = begin(&mut t, "k");
    let (res, effects) = run_in(&mut t, TERM, register(txid, "stock", BranchVote::Yes));
    let (term, existing, decision) = registered(res);
    assert_eq!((term, existing, decision), (TERM, false, None));
    assert_eq!(effects, vec![Effect::Put(txid)]);
    let r = t.get(txid).unwrap();
    assert_eq!(r.phase, Phase::Active);
    assert_eq!(r.participants.len(), 1);
    assert_eq!(r.participants[0].address, addr("stock"));
    assert!(r.participants[0].payload.is_empty());
    assert_eq!(t.registered_vote(txid, "stock"), Some(BranchVote::Yes));
    assert_eq!(t.branch_view(txid, "stock"), BranchView::Member(DecisionView::Pending));
}

/// Idempotent: the same registration in a later term answers the term
/// recorded first (the branch's term floor does not move), and changes
/// nothing.
#[test]
fn inv9_a_repeated_registration_answers_the_first_term_and_changes_nothing() {
    let mut t = TxTable::new();
    let txid = begin(&mut t, "k");
    registered(run_in(&mut t, TERM, register(txid, "stock", BranchVote::Yes)).0);
    let before = t.clone();
    let (res, effects) = run_in(&mut t, TERM + 2, register(txid, "stock", BranchVote::Yes));
    assert_eq!(registered(res), (TERM, true, None));
    assert!(effects.is_empty(), "a repeat writes nothing: {effects:?}");
    assert_eq!(t, before);
}

/// Write-once per (txid, participant): another vote or another address
/// is refused with the recorded one, which stands.
#[test]
fn inv1_a_registration_is_write_once_per_participant() {
    let mut t = TxTable::new();
    let txid = begin(&mut t, "k");
    registered(run(&mut t, register(txid, "stock", BranchVote::Yes)));
    let r = refused(run(&mut t, register(txid, "stock", BranchVote::No)));
    assert_eq!(
        r,
        BranchRefusal::VoteConflict {
            txid,
            participant_id: "stock".into(),
            recorded: BranchVote::Yes
        }
    );
    assert!(
        !r.must_roll_back(),
        "its own earlier YES stands: the branch keeps its work"
    );
    let mut other_addr = register(txid, "stock", BranchVote::Yes);
    if let Command::RegisterBranch { address, .. } = &mut other_addr {
        *address = "127.0.0.1:9".into();
    }
    assert!(matches!(
        refused(run(&mut t, other_addr)),
        BranchRefusal::AddressConflict { recorded, .. } if recorded == addr("stock")
    ));
    assert_eq!(
        t.get(txid).unwrap().phase,
        Phase::Active,
        "a refused NO decided nothing"
    );
    assert_eq!(t.registered_vote(txid, "stock"), Some(BranchVote::Yes));
}

/// A NO decides ABORT in the same command (the other branches' locks go
/// at once); the decision is write-once like any other.
#[test]
fn inv1_a_no_registration_decides_abort_in_the_same_command() {
    let mut t = TxTable::new();
    let txid = begin(&mut t, "k");
    registered(run(&mut t, register(txid, "pay", BranchVote::Yes)));
    let (res, effects) = run_in(&mut t, TERM, register(txid, "stock", BranchVote::No));
    let (_, _, decision) = registered(res);
    let d = decision.expect("a NO records the decision");
    assert_eq!(d.outcome, Outcome::Abort);
    assert_eq!(d.term, TERM);
    assert!(
        d.note.contains("stock") && d.note.contains("out of stock"),
        "{}",
        d.note
    );
    assert!(effects.contains(&Effect::Decided(txid, Outcome::Abort)), "{effects:?}");
    assert_eq!(t.decision_view(txid), DecisionView::Decided(Outcome::Abort));
    assert_eq!(t.undelivered(10), vec![txid], "the YES branch is owed its ABORT");
    // A later COMMIT reads the ABORT back.
    match run(&mut t, decide(txid, Outcome::Commit, &["pay", "stock"])) {
        Ok(CommandOk::Decided { decision, recorded }) => {
            assert_eq!((decision.outcome, recorded), (Outcome::Abort, false))
        }
        other => panic!("{other:?}"),
    }
    // Repeating the NO answers the same decision.
    let (_, existing, again) = registered(run(&mut t, register(txid, "stock", BranchVote::No)));
    assert!(existing);
    assert_eq!(again.map(|d| d.outcome), Some(Outcome::Abort));
}

/// Too late is refused, never queued: PREPARING, decided, past the
/// deadline, forgotten. Never begun is NOT_FOUND. Nothing changes.
#[test]
fn inv2_a_registration_after_the_set_is_frozen_is_refused() {
    let mut t = TxTable::new();
    let preparing = begin(&mut t, "p");
    run(&mut t, Command::RequestCommit { txid: preparing }).unwrap();
    assert!(matches!(
        refused(run(&mut t, register(preparing, "late", BranchVote::Yes))),
        BranchRefusal::TooLate { phase, .. } if phase == "PREPARING"
    ));
    let decided = begin(&mut t, "d");
    run(&mut t, decide(decided, Outcome::Commit, &[])).unwrap();
    assert!(matches!(
        refused(run(&mut t, register(decided, "late", BranchVote::Yes))),
        BranchRefusal::TooLate { phase, .. } if phase == "DECIDED"
    ));
    let old = begin(&mut t, "o");
    let r = refused(run(
        &mut t,
        register_at(old, "late", BranchVote::Yes, BEGUN_MS + TIMEOUT_MS),
    ));
    assert!(matches!(r, BranchRefusal::PastDeadline { .. }), "{r:?}");
    assert!(r.must_roll_back());
    assert!(t.get(old).unwrap().participants.is_empty());
    // Forgotten: decided, acked by nobody (no participants), forgotten.
    run(&mut t, Command::Forget { txid: decided }).unwrap();
    assert!(matches!(
        refused(run(&mut t, register(decided, "late", BranchVote::Yes))),
        BranchRefusal::Forgotten { .. }
    ));
    let never = t.next_txid();
    assert!(matches!(
        run(&mut t, register(never, "x", BranchVote::Yes)),
        Err(CommandError::NotFound { .. })
    ));
    for txid in [preparing, decided, old] {
        assert_eq!(t.registered_vote(txid, "late"), None);
    }
}

/// Registration and commit race: Raft orders them. Registration first:
/// a member, counted in the decision (a COMMIT without its vote is
/// refused). Commit first: TooLate.
#[test]
fn inv2_a_registration_racing_the_commit_is_either_counted_or_refused() {
    let mut t = TxTable::new();
    let first = begin(&mut t, "a");
    registered(run(&mut t, register(first, "pay", BranchVote::Yes)));
    registered(run(&mut t, register(first, "stock", BranchVote::Yes)));
    assert!(matches!(
        run(&mut t, decide(first, Outcome::Commit, &["pay"])),
        Err(CommandError::VotersMismatch { .. })
    ));
    match run(&mut t, decide(first, Outcome::Commit, &["pay", "stock"])) {
        Ok(CommandOk::Decided {
            decision,
            recorded: true,
        }) => assert_eq!(decision.outcome, Outcome::Commit),
        other => panic!("{other:?}"),
    }
    let second = begin(&mut t, "b");
    registered(run(&mut t, register(second, "pay", BranchVote::Yes)));
    run(&mut t, decide(second, Outcome::Commit, &["pay"])).unwrap();
    refused(run(&mut t, register(second, "stock", BranchVote::Yes)));
    assert_eq!(
        t.branch_view(second, "stock"),
        BranchView::Outside,
        "committed without it: the late branch is told ABORT"
    );
}

/// The branch's presumed abort (invariant 7): a branch that is not a
/// member is fenced out of an ACTIVE transaction through a command, so
/// no later registration or Enlist can make it one, and it is told ABORT
/// even after the transaction commits.
#[test]
fn inv7_a_fenced_branch_never_becomes_a_member() {
    let mut t = TxTable::new();
    let txid = begin(&mut t, "k");
    registered(run(&mut t, register(txid, "pay", BranchVote::Yes)));
    assert_eq!(t.branch_view(txid, "stock"), BranchView::Unfenced);
    let (res, effects) = run_in(&mut t, TERM, exclude(txid, "stock"));
    assert_eq!(excluded(res), (false, Some(Outcome::Abort), true));
    assert_eq!(effects, vec![Effect::Put(txid)]);
    assert!(t.is_fenced(txid, "stock"));
    // A second fence changes nothing.
    let (res, effects) = run_in(&mut t, TERM, exclude(txid, "stock"));
    assert_eq!(excluded(res), (false, Some(Outcome::Abort), false));
    assert!(effects.is_empty());
    let r = refused(run(&mut t, register(txid, "stock", BranchVote::Yes)));
    assert!(matches!(r, BranchRefusal::Fenced { .. }) && r.must_roll_back(), "{r:?}");
    assert!(matches!(
        run(
            &mut t,
            Command::Enlist {
                txid,
                participant_id: "stock".into(),
                address: addr("stock"),
                payload: vec![],
            }
        ),
        Err(CommandError::Fenced { .. })
    ));
    run(&mut t, decide(txid, Outcome::Commit, &["pay"])).unwrap();
    assert_eq!(t.branch_view(txid, "stock"), BranchView::Outside);
    assert_eq!(
        t.branch_view(txid, "pay"),
        BranchView::Member(DecisionView::Decided(Outcome::Commit))
    );
}

/// A fence leaves a member alone: it follows the transaction's decision.
#[test]
fn inv3_excluding_a_member_changes_nothing_and_answers_its_decision() {
    let mut t = TxTable::new();
    let txid = begin(&mut t, "k");
    registered(run(&mut t, register(txid, "pay", BranchVote::Yes)));
    let (res, effects) = run_in(&mut t, TERM, exclude(txid, "pay"));
    assert_eq!(excluded(res), (true, None, false));
    assert!(effects.is_empty());
    run(&mut t, decide(txid, Outcome::Commit, &["pay"])).unwrap();
    assert_eq!(
        excluded(run(&mut t, exclude(txid, "pay"))),
        (true, Some(Outcome::Commit), false)
    );
    // Not ACTIVE: a stranger is told ABORT without a fence.
    let (res, effects) = run_in(&mut t, TERM, exclude(txid, "stranger"));
    assert_eq!(excluded(res), (false, Some(Outcome::Abort), false));
    assert!(effects.is_empty());
    // No record at all: ABORT.
    assert_eq!(t.branch_view(t.next_txid() + 5, "x"), BranchView::Outside);
}

/// A participant its client enlisted may register its vote (found in the
/// set), only at the same address; the branch of a mixed transaction
/// with a Prepare-driven participant keeps that one's payload.
#[test]
fn a_branch_its_client_enlisted_registers_at_the_same_address_only() {
    let mut t = TxTable::new();
    let txid = begin(&mut t, "k");
    for (id, payload) in [("stock", vec![]), ("legacy", b"debit 5".to_vec())] {
        run(
            &mut t,
            Command::Enlist {
                txid,
                participant_id: id.into(),
                address: addr(id),
                payload,
            },
        )
        .unwrap();
    }
    let mut moved = register(txid, "stock", BranchVote::Yes);
    if let Command::RegisterBranch { address, .. } = &mut moved {
        *address = "127.0.0.1:1".into();
    }
    assert!(matches!(
        refused(run(&mut t, moved)),
        BranchRefusal::AddressConflict { .. }
    ));
    registered(run(&mut t, register(txid, "stock", BranchVote::Yes)));
    let r = t.get(txid).unwrap();
    assert_eq!(r.participants.len(), 2, "found, not added again");
    assert_eq!(r.participants[1].payload, b"debit 5");
    assert_eq!(
        t.registered_vote(txid, "legacy"),
        None,
        "the Prepare-driven one has no vote yet"
    );
}

/// A registered branch has voted: its commit never runs in one phase
/// (a CommitOnePhase would ask it to prepare work it already prepared).
#[test]
fn a_registered_branch_is_never_committed_in_one_phase() {
    let mut t = TxTable::new();
    let txid = begin(&mut t, "k");
    registered(run(&mut t, register(txid, "only", BranchVote::Yes)));
    match run(&mut t, Command::RequestCommitOnePhase { txid }) {
        Ok(CommandOk::CommitRequested { one_phase, .. }) => assert!(!one_phase),
        other => panic!("{other:?}"),
    }
    // Without a registration the same command does run in one phase.
    let plain = begin(&mut t, "p");
    run(
        &mut t,
        Command::Enlist {
            txid: plain,
            participant_id: "only".into(),
            address: addr("only"),
            payload: vec![1],
        },
    )
    .unwrap();
    match run(&mut t, Command::RequestCommitOnePhase { txid: plain }) {
        Ok(CommandOk::CommitRequested { one_phase, .. }) => assert!(one_phase),
        other => panic!("{other:?}"),
    }
}

#[test]
fn registrations_count_toward_the_participant_limit() {
    let mut t = TxTable::new();
    let txid = begin(&mut t, "k");
    for i in 0..limits::PARTICIPANTS_MAX {
        registered(run(&mut t, register(txid, &format!("p{i}"), BranchVote::Yes)));
    }
    assert!(matches!(
        run(&mut t, register(txid, "one-more", BranchVote::Yes)),
        Err(CommandError::TooManyParticipants { .. })
    ));
}

/// Invariant 10: a record's branches go with it, and a table rebuilt from
/// persisted parts keeps only those of records it holds.
#[test]
fn inv10_branches_go_with_their_record_and_are_rebuilt_with_it() {
    let mut t = TxTable::new();
    let kept = begin(&mut t, "a");
    registered(run(&mut t, register(kept, "pay", BranchVote::Yes)));
    run(&mut t, exclude(kept, "stock")).unwrap();
    let gone = begin(&mut t, "b");
    registered(run(&mut t, register(gone, "pay", BranchVote::ReadOnly)));
    run(&mut t, decide(gone, Outcome::Commit, &["pay"])).unwrap();
    run(
        &mut t,
        Command::Ack {
            txid: gone,
            participant_id: "pay".into(),
        },
    )
    .unwrap();
    let (res, effects) = run_in(&mut t, TERM, Command::Forget { txid: gone });
    res.unwrap();
    assert_eq!(effects, vec![Effect::Remove(gone)]);
    assert!(t.branches_of(gone).is_none());
    let rebuilt = TxTable::from_parts(t.next_txid(), t.records().cloned())
        .with_branches(t.branches().clone().into_iter().chain([(999, Branches::default())]));
    assert_eq!(rebuilt.branches(), t.branches());
    assert_eq!(rebuilt.registered_vote(kept, "pay"), Some(BranchVote::Yes));
    assert!(rebuilt.is_fenced(kept, "stock"));
}

#[test]
fn bad_registrations_are_refused_naming_the_field() {
    let mut t = TxTable::new();
    let txid = begin(&mut t, "k");
    let mut long = register(txid, "x", BranchVote::No);
    if let Command::RegisterBranch { reason, .. } = &mut long {
        *reason = "r".repeat(limits::REASON_BYTES_MAX + 1);
    }
    match run(&mut t, long) {
        Err(CommandError::Invalid(m)) => assert!(m.contains("reason"), "{m}"),
        other => panic!("{other:?}"),
    }
    match run(&mut t, register(txid, "", BranchVote::Yes)) {
        Err(CommandError::Invalid(m)) => assert!(m.contains("participant_id"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(t.get(txid).unwrap().participants.is_empty());
}
