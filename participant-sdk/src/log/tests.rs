//! Unit tests of the participant log logic, named after the invariants of docs/design.md.

use rand::rngs::StdRng;
use rand::Rng;
use rand::SeedableRng;

use super::*;

fn run(entry: Option<LogEntry>, msg: Message) -> (Option<LogEntry>, Action) {
    step(entry.as_ref(), msg, 0)
}

fn prepared_yes(term: u64) -> Option<LogEntry> {
    Some(prepared(term, Vote::Yes))
}

#[test]
fn first_prepare_asks_the_resource_and_records_its_vote() {
    assert_eq!(run(None, Message::Prepare { term: 3 }), (None, Action::PrepareResource));
    assert_eq!(prepared(3, Vote::Yes).state, LocalState::Prepared { vote: Vote::Yes });
    assert_eq!(prepared(3, Vote::No).state, LocalState::Aborted { tombstone: false });
    assert_eq!(
        prepared(3, Vote::ReadOnly).state,
        LocalState::Prepared { vote: Vote::ReadOnly }
    );
    assert!(in_doubt(&prepared(3, Vote::Yes)));
    assert!(!in_doubt(&prepared(3, Vote::ReadOnly)));
}

#[test]
fn inv8_duplicate_prepare_returns_the_same_vote_without_the_resource() {
    for vote in [Vote::Yes, Vote::ReadOnly] {
        let e = Some(prepared(3, vote));
        assert_eq!(run(e, Message::Prepare { term: 3 }), (e, Action::Vote(vote)));
    }
    let no = Some(prepared(3, Vote::No));
    assert_eq!(run(no, Message::Prepare { term: 3 }), (no, Action::Vote(Vote::No)));
}

#[test]
fn inv8_abort_before_prepare_leaves_a_tombstone_and_late_prepare_votes_no() {
    let (e, a) = run(None, Message::Abort { term: 2 });
    assert_eq!(a, Action::RecordTombstone);
    assert_eq!(e.unwrap().state, LocalState::Aborted { tombstone: true });
    let (e2, a2) = run(e, Message::Prepare { term: 2 });
    assert_eq!(a2, Action::Vote(Vote::No), "a hanging prepare must vote NO");
    assert_eq!(e2, e);
    // And a Commit for it is a protocol violation, not applied.
    assert_eq!(
        run(e, Message::Commit { term: 2 }).1,
        Action::Refuse(Refusal::CommitAfterAbort)
    );
}

#[test]
fn inv8_commit_is_applied_once_however_often_delivered() {
    let (e, a) = run(prepared_yes(1), Message::Commit { term: 1 });
    assert_eq!(a, Action::CommitResource);
    assert_eq!(e.unwrap().state, LocalState::Committed);
    for term in [1, 2, 5] {
        assert_eq!(run(e, Message::Commit { term }).1, Action::Ack);
    }
    // A late Prepare after the commit does not touch the resource.
    assert_eq!(run(e, Message::Prepare { term: 1 }).1, Action::Vote(Vote::Yes));
}

#[test]
fn inv8_abort_is_applied_once_however_often_delivered() {
    let (e, a) = run(prepared_yes(1), Message::Abort { term: 1 });
    assert_eq!(a, Action::AbortResource);
    assert_eq!(e.unwrap().state, LocalState::Aborted { tombstone: false });
    for term in [1, 4] {
        assert_eq!(run(e, Message::Abort { term }).1, Action::Ack);
    }
}

#[test]
fn inv3_conflicting_decisions_are_refused_not_applied() {
    let committed = Some(LogEntry {
        state: LocalState::Committed,
        term: 1,
    });
    assert_eq!(
        run(committed, Message::Abort { term: 1 }),
        (committed, Action::Refuse(Refusal::AbortAfterCommit))
    );
    let aborted = Some(LogEntry {
        state: LocalState::Aborted { tombstone: false },
        term: 1,
    });
    assert_eq!(
        run(aborted, Message::Commit { term: 1 }),
        (aborted, Action::Refuse(Refusal::CommitAfterAbort))
    );
}

#[test]
fn commit_for_a_transaction_never_prepared_is_a_protocol_violation() {
    assert_eq!(
        run(None, Message::Commit { term: 1 }),
        (None, Action::Refuse(Refusal::CommitWithoutPrepare))
    );
}

#[test]
fn inv9_older_terms_are_rejected_and_change_nothing() {
    let e = prepared_yes(5);
    for msg in [
        Message::Prepare { term: 4 },
        Message::Commit { term: 4 },
        Message::Abort { term: 1 },
    ] {
        assert_eq!(
            run(e, msg),
            (
                e,
                Action::Refuse(Refusal::StaleTerm {
                    got: msg.term(),
                    seen: 5
                })
            )
        );
    }
    // A newer term is accepted and remembered.
    let (e2, a) = run(e, Message::Prepare { term: 7 });
    assert_eq!(a, Action::Vote(Vote::Yes));
    assert_eq!(e2.unwrap().term, 7);
    assert_eq!(
        run(e2, Message::Commit { term: 6 }).1,
        Action::Refuse(Refusal::StaleTerm { got: 6, seen: 7 })
    );
}

#[test]
fn read_only_votes_need_no_phase_two() {
    let e = Some(prepared(2, Vote::ReadOnly));
    assert_eq!(run(e, Message::Commit { term: 2 }).1, Action::Ack);
    assert_eq!(run(e, Message::Abort { term: 2 }).1, Action::Ack);
}

/// Random duplicated, late and reordered messages for one transaction, with
/// one coordinator decision per run: the resource sees at most one of
/// commit/abort, never commit without a YES prepare, and only the recorded
/// decision (invariants 3, 5, 8, 9).
#[test]
fn inv3_inv5_inv8_random_message_orders_apply_the_decision_at_most_once() {
    for seed in 1..=2000u64 {
        // Seeded, so "seed N" in a failure replays that run.
        let mut rng = StdRng::seed_from_u64(seed);
        let decision_commit = rng.random_bool(0.5);
        let resource_votes_yes = rng.random_ratio(3, 4);
        let mut entry: Option<LogEntry> = None;
        let (mut prepares, mut commits, mut aborts) = (0, 0, 0);
        let mut voted_yes = false;
        for _ in 0..12 {
            let term = rng.random_range(1..=4);
            let msg = match rng.random_range(0..3) {
                0 => Message::Prepare { term },
                // A commit is only ever sent after a decision COMMIT, which
                // needs this participant's YES (the coordinator's side).
                1 if decision_commit && voted_yes => Message::Commit { term },
                _ => Message::Abort { term },
            };
            let before = entry;
            let (after, action) = step(entry.as_ref(), msg, 0);
            match action {
                Action::PrepareResource => {
                    prepares += 1;
                    let vote = if resource_votes_yes { Vote::Yes } else { Vote::No };
                    voted_yes |= vote == Vote::Yes;
                    entry = Some(prepared(term, vote));
                    continue;
                }
                Action::CommitResource => commits += 1,
                Action::AbortResource => aborts += 1,
                Action::Refuse(Refusal::StaleTerm { .. }) => assert_eq!(after, before, "seed {seed}"),
                _ => {}
            }
            entry = after;
        }
        assert!(prepares <= 1, "seed {seed}: resource prepared {prepares} times");
        assert!(
            commits + aborts <= 1,
            "seed {seed}: decision applied {} times",
            commits + aborts
        );
        if commits == 1 {
            assert!(
                decision_commit && voted_yes,
                "seed {seed}: committed without the decision or a YES"
            );
        }
        if aborts == 1 {
            assert!(voted_yes, "seed {seed}: rolled back work never prepared");
        }
    }
}

#[test]
fn one_phase_commit_asks_the_resource_once_and_repeats_its_answer() {
    assert_eq!(
        run(None, Message::CommitOnePhase { term: 2 }),
        (None, Action::OnePhaseResource)
    );
    let committed = Some(LogEntry {
        state: LocalState::Committed,
        term: 2,
    });
    assert_eq!(run(committed, Message::CommitOnePhase { term: 3 }).1, Action::Ack);
    let aborted = Some(prepared(2, Vote::No));
    assert_eq!(
        run(aborted, Message::CommitOnePhase { term: 2 }).1,
        Action::Vote(Vote::No)
    );
}

#[test]
fn inv8_one_phase_commit_after_an_abort_tombstone_is_not_committed() {
    let (tomb, _) = run(None, Message::Abort { term: 1 });
    let (after, a) = run(tomb, Message::CommitOnePhase { term: 1 });
    assert_eq!(a, Action::Vote(Vote::No));
    assert_eq!(after.unwrap().state, LocalState::Aborted { tombstone: true });
}

#[test]
fn one_phase_commit_finishes_a_prepared_entry_left_by_a_crash() {
    let (e, a) = run(prepared_yes(4), Message::CommitOnePhase { term: 4 });
    assert_eq!(a, Action::CommitResource);
    assert_eq!(e.unwrap().state, LocalState::Committed);
}

#[test]
fn inv9_one_phase_commit_from_an_older_term_is_refused() {
    let (e, a) = run(prepared_yes(5), Message::CommitOnePhase { term: 4 });
    assert_eq!(e, prepared_yes(5));
    assert_eq!(a, Action::Refuse(Refusal::StaleTerm { got: 4, seen: 5 }));
}

#[test]
fn inv9_prepare_or_one_phase_of_an_unknown_txid_below_the_term_floor_is_refused() {
    for msg in [Message::Prepare { term: 4 }, Message::CommitOnePhase { term: 4 }] {
        assert_eq!(
            step(None, msg, 5),
            (None, Action::Refuse(Refusal::StaleTerm { got: 4, seen: 5 })),
            "{msg:?}: nothing recorded, the resource not asked"
        );
    }
    // At or above the floor: as without one.
    assert_eq!(step(None, Message::Prepare { term: 5 }, 5).1, Action::PrepareResource);
    assert_eq!(
        step(None, Message::CommitOnePhase { term: 6 }, 5).1,
        Action::OnePhaseResource
    );
    // An Abort of an unknown txid still leaves its tombstone, whatever its
    // term; a Commit of one is still a commit without prepare.
    let (tomb, a) = step(None, Message::Abort { term: 1 }, 5);
    assert_eq!(a, Action::RecordTombstone);
    assert_eq!(tomb.unwrap().state, LocalState::Aborted { tombstone: true });
    assert_eq!(
        step(None, Message::Commit { term: 1 }, 5).1,
        Action::Refuse(Refusal::CommitWithoutPrepare)
    );
    // A known txid is judged by its own record's term, not the floor: a
    // repeat from its own (older) term still answers.
    let e = prepared(3, Vote::Yes);
    assert_eq!(
        step(Some(&e), Message::Prepare { term: 3 }, 9).1,
        Action::Vote(Vote::Yes)
    );
    assert_eq!(step(Some(&e), Message::Commit { term: 3 }, 9).1, Action::CommitResource);
}

/// A double apply at the participant: a one-phase commit applied at term
/// T+1, its record forgotten by GC, and the deposed leader of term T
/// re-sending it.
#[test]
fn inv9_one_phase_commit_resent_by_a_deposed_leader_after_gc_is_not_applied_again() {
    let (e, a) = step(None, Message::CommitOnePhase { term: 8 }, 0);
    assert_eq!(a, Action::OnePhaseResource);
    assert_eq!(e, None);
    // Recorded committed at term 8, so the floor is 8; GC forgets the record.
    let floor = 8;
    assert_eq!(
        step(None, Message::CommitOnePhase { term: 7 }, floor).1,
        Action::Refuse(Refusal::StaleTerm { got: 7, seen: 8 })
    );
}

#[test]
fn global_txids_order_and_show_by_incarnation() {
    let old = GlobalTxid::from(7);
    assert_eq!(old, GlobalTxid::new(0, 7));
    assert_eq!(old.to_string(), "7");
    let g = GlobalTxid::new(0xab, 7);
    assert_eq!(g.to_string(), "7@00000000000000ab");
    assert!(old < g && GlobalTxid::new(0xab, 6) < g && g < GlobalTxid::new(0xac, 1));
    for t in [old, g, GlobalTxid::new(u64::MAX, u64::MAX)] {
        assert_eq!(GlobalTxid::from_key_bytes(&t.key_bytes()), Some(t));
    }
    assert_eq!(old.key_bytes(), 7u64.to_be_bytes().to_vec());
    assert_eq!(
        GlobalTxid::from_key_bytes(&[0; 16]),
        None,
        "incarnation 0 has the short form only"
    );
    assert_ne!(old.key_bytes(), g.key_bytes());
}
