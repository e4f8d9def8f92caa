//! The vote tally of a prepare round and the deadline rule, as one pure
//! function: no I/O, no clock (`now_ms` is an argument), no spawning.
//!
//! The leader's driver asks it before a prepare round (no votes yet: may a
//! round start?) and after (every vote in: what is the decision?); the state
//! machine holds the reaper's ABORT and its index of expired transactions to
//! the same deadline rule (`deadline_passed`).
//!
//! The rule (docs/protocol.md, "Transaction life"):
//! - Invariant 2: COMMIT only when every voter voted YES or READ_ONLY.
//! - A NO, or a failure to get a vote (counted as NO), aborts, whenever it
//!   arrives: a NO cannot be taken back, and it outranks the deadline as the
//!   reason given.
//! - Invariant 7: the deadline ends the wait. While a vote is missing, the
//!   tally aborts from the deadline on (at `deadline_ms` exactly, it has
//!   passed). Once every vote is in, the votes decide, whatever the clock.
//! - With no voters there is nothing to wait for and nothing to count: the
//!   deadline alone decides (COMMIT before it, ABORT from it on).
//! - READ_ONLY voters need no phase two whatever the decision: both COMMIT
//!   and ABORT name them, so their acks can go into the decision's entry.
//! - A vote from someone not in the voter set is ignored. A voter that
//!   answered more than once counts once, by its strongest answer: a
//!   refusal over YES over READ_ONLY (a YES voter holds locks and must get
//!   phase two, so YES is never taken for READ_ONLY).
//!
//! It imports nothing of the crate: the state machine and the driver both
//! stand on it.

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::fmt;

/// One participant's answer to Prepare, as the driver received it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Vote {
    Yes,
    ReadOnly,
    /// The participant voted NO, with its reason.
    No(String),
    /// No usable answer (unreachable, timed out, an error status, a
    /// malformed vote): counts as NO.
    Failed(String),
}

/// What the votes received so far decide.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Tally {
    /// Votes are missing and the deadline has not passed: wait for
    /// `waiting_for` (in voter order) at most `wait_ms` more.
    Pending { waiting_for: Vec<String>, wait_ms: u64 },
    /// Every voter voted YES or READ_ONLY: `voters` is the whole voter set
    /// (what `Decide(COMMIT)` carries), `read_only_voters` those that need
    /// no phase two.
    Commit {
        voters: Vec<String>,
        read_only_voters: Vec<String>,
    },
    /// ABORT, and why. `read_only_voters`: the voters that voted READ_ONLY
    /// (no phase two for them either).
    Abort {
        reason: AbortReason,
        read_only_voters: Vec<String>,
    },
}

/// Why a tally aborts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AbortReason {
    /// The deadline passed with a vote still missing (invariant 7).
    DeadlinePassed,
    /// At least one voter refused, in voter order.
    Refused(Vec<Refusal>),
}

/// One voter's refusal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// It voted NO.
    No { participant_id: String, reason: String },
    /// No usable vote came from it (counted as NO).
    Failed { participant_id: String, error: String },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::No { participant_id, reason } => write!(f, "{participant_id} voted NO: {reason}"),
            Refusal::Failed { participant_id, error } => write!(f, "{participant_id}: {error}"),
        }
    }
}

/// The decision's note, for humans.
impl fmt::Display for AbortReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AbortReason::DeadlinePassed => f.write_str("deadline passed before the votes were in"),
            AbortReason::Refused(refusals) => {
                for (i, r) in refusals.iter().enumerate() {
                    if i > 0 {
                        f.write_str("; ")?;
                    }
                    write!(f, "{r}")?;
                }
                Ok(())
            }
        }
    }
}

/// True from `deadline_ms` on: at the deadline exactly, it has passed.
pub fn deadline_passed(deadline_ms: u64, now_ms: u64) -> bool {
    now_ms >= deadline_ms
}

/// A voter's vote as counted (its strongest answer).
enum Counted<'a> {
    ReadOnly,
    Yes,
    No(&'a str),
    Failed(&'a str),
}

impl Counted<'_> {
    fn rank(&self) -> u8 {
        match self {
            Counted::ReadOnly => 0,
            Counted::Yes => 1,
            Counted::No(_) | Counted::Failed(_) => 2,
        }
    }
}

/// Tallies `votes` (participant id, vote; in the order they arrived) of the
/// prepare round of a transaction whose frozen participant set is `voters`
/// (distinct ids) and whose deadline is `deadline_ms`, at `now_ms`. See the
/// module documentation for the rule.
pub fn tally(voters: &[&str], votes: &[(&str, Vote)], deadline_ms: u64, now_ms: u64) -> Tally {
    let enlisted: BTreeSet<&str> = voters.iter().copied().collect();
    let mut counted: BTreeMap<&str, Counted<'_>> = BTreeMap::new();
    for (id, vote) in votes {
        let Some(&id) = enlisted.get(id) else {
            continue; // Not a voter: ignored.
        };
        let this = match vote {
            Vote::Yes => Counted::Yes,
            Vote::ReadOnly => Counted::ReadOnly,
            Vote::No(reason) => Counted::No(reason),
            Vote::Failed(error) => Counted::Failed(error),
        };
        // The strongest answer counts; among refusals, the first.
        match counted.get(id) {
            Some(seen) if seen.rank() >= this.rank() => {}
            _ => {
                counted.insert(id, this);
            }
        }
    }
    let mut waiting_for = Vec::new();
    let mut read_only_voters = Vec::new();
    let mut refusals = Vec::new();
    for &id in voters {
        match counted.get(id) {
            None => waiting_for.push(id.to_string()),
            Some(Counted::Yes) => {}
            Some(Counted::ReadOnly) => read_only_voters.push(id.to_string()),
            Some(Counted::No(reason)) => refusals.push(Refusal::No {
                participant_id: id.to_string(),
                reason: reason.to_string(),
            }),
            Some(Counted::Failed(error)) => refusals.push(Refusal::Failed {
                participant_id: id.to_string(),
                error: error.to_string(),
            }),
        }
    }
    if !refusals.is_empty() {
        return Tally::Abort {
            reason: AbortReason::Refused(refusals),
            read_only_voters,
        };
    }
    let all_in = waiting_for.is_empty() && !voters.is_empty();
    if deadline_passed(deadline_ms, now_ms) && !all_in {
        return Tally::Abort {
            reason: AbortReason::DeadlinePassed,
            read_only_voters,
        };
    }
    if !waiting_for.is_empty() {
        return Tally::Pending {
            waiting_for,
            wait_ms: deadline_ms - now_ms,
        };
    }
    Tally::Commit {
        voters: voters.iter().map(|id| id.to_string()).collect(),
        read_only_voters,
    }
}

/// The note an ABORT from a tally records (ADR 0039): the reason,
/// then every other voter's part, so an operator reading `txn show` sees
/// each participant's vote or why none came, not only the first refusal.
/// `voters` and `votes` as given to [`tally`]; voters are named in voter
/// order, a voter that answered more than once by its strongest answer.
/// For example `b voted NO: locked; YES from a; READ_ONLY from c` or
/// `deadline passed before the votes were in; no vote from b; YES from a`.
pub fn abort_note(voters: &[&str], votes: &[(&str, Vote)], reason: &AbortReason) -> String {
    let mut note = reason.to_string();
    let mut yes = Vec::new();
    let mut read_only = Vec::new();
    let mut missing = Vec::new();
    for &id in voters {
        let answers = votes.iter().filter(|(v, _)| *v == id).map(|(_, vote)| vote);
        let mut strongest: Option<&Vote> = None;
        for a in answers {
            let rank = |v: &Vote| match v {
                Vote::ReadOnly => 0,
                Vote::Yes => 1,
                Vote::No(_) | Vote::Failed(_) => 2,
            };
            if strongest.is_none_or(|s| rank(a) > rank(s)) {
                strongest = Some(a);
            }
        }
        match strongest {
            None => missing.push(id),
            Some(Vote::Yes) => yes.push(id),
            Some(Vote::ReadOnly) => read_only.push(id),
            // Named by the reason already.
            Some(Vote::No(_) | Vote::Failed(_)) => {}
        }
    }
    for (what, ids) in [
        ("no vote from", &missing),
        ("YES from", &yes),
        ("READ_ONLY from", &read_only),
    ] {
        if !ids.is_empty() {
            note.push_str("; ");
            note.push_str(what);
            note.push(' ');
            note.push_str(&ids.join(", "));
        }
    }
    note
}

#[cfg(test)]
mod tests {
    //! Each test pins one branch of the rule with the whole result, so a
    //! change of the rule fails one of them. Invariant numbers as in
    //! docs/protocol.md.

    use super::*;

    const DEADLINE: u64 = 1_000;

    fn no(id: &str, why: &str) -> Refusal {
        Refusal::No {
            participant_id: id.into(),
            reason: why.into(),
        }
    }

    fn failed(id: &str, why: &str) -> Refusal {
        Refusal::Failed {
            participant_id: id.into(),
            error: why.into(),
        }
    }

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn commit(voters: &[&str], read_only: &[&str]) -> Tally {
        Tally::Commit {
            voters: ids(voters),
            read_only_voters: ids(read_only),
        }
    }

    fn abort(reason: AbortReason, read_only: &[&str]) -> Tally {
        Tally::Abort {
            reason,
            read_only_voters: ids(read_only),
        }
    }

    #[test]
    fn deadline_passes_at_the_deadline_exactly() {
        assert!(!deadline_passed(DEADLINE, DEADLINE - 1));
        assert!(deadline_passed(DEADLINE, DEADLINE));
        assert!(deadline_passed(DEADLINE, DEADLINE + 1));
        assert!(deadline_passed(0, 0));
        assert!(!deadline_passed(u64::MAX, u64::MAX - 1));
    }

    #[test]
    fn inv7_no_votes_before_the_deadline_waits_for_every_voter_until_it() {
        assert_eq!(
            tally(&["a", "b"], &[], DEADLINE, 400),
            Tally::Pending {
                waiting_for: ids(&["a", "b"]),
                wait_ms: 600,
            }
        );
        assert_eq!(
            tally(&["a"], &[], DEADLINE, DEADLINE - 1),
            Tally::Pending {
                waiting_for: ids(&["a"]),
                wait_ms: 1,
            }
        );
    }

    #[test]
    fn pending_names_only_the_missing_voters_in_voter_order() {
        let votes = [("c", Vote::ReadOnly), ("a", Vote::Yes)];
        assert_eq!(
            tally(&["a", "b", "c", "d"], &votes, DEADLINE, 0),
            Tally::Pending {
                waiting_for: ids(&["b", "d"]),
                wait_ms: DEADLINE,
            }
        );
    }

    #[test]
    fn inv7_deadline_exactly_now_with_votes_missing_aborts() {
        assert_eq!(
            tally(&["a", "b"], &[], DEADLINE, DEADLINE),
            abort(AbortReason::DeadlinePassed, &[])
        );
        assert_eq!(
            tally(&["a", "b"], &[("a", Vote::Yes)], DEADLINE, DEADLINE),
            abort(AbortReason::DeadlinePassed, &[])
        );
    }

    #[test]
    fn inv7_past_the_deadline_a_missing_vote_aborts_and_read_only_voters_stay_named() {
        let votes = [("a", Vote::ReadOnly), ("c", Vote::Yes)];
        assert_eq!(
            tally(&["a", "b", "c"], &votes, DEADLINE, DEADLINE + 5_000),
            abort(AbortReason::DeadlinePassed, &["a"])
        );
    }

    #[test]
    fn inv2_every_yes_commits_with_the_whole_voter_set() {
        let votes = [("b", Vote::Yes), ("a", Vote::Yes)];
        assert_eq!(tally(&["a", "b"], &votes, DEADLINE, 0), commit(&["a", "b"], &[]));
    }

    #[test]
    fn inv2_all_read_only_commits_and_names_every_voter_read_only() {
        let votes = [("a", Vote::ReadOnly), ("b", Vote::ReadOnly)];
        assert_eq!(
            tally(&["a", "b"], &votes, DEADLINE, 0),
            commit(&["a", "b"], &["a", "b"])
        );
    }

    #[test]
    fn inv2_yes_and_read_only_commit_naming_only_the_read_only_voters() {
        let votes = [("c", Vote::ReadOnly), ("a", Vote::Yes), ("b", Vote::ReadOnly)];
        assert_eq!(
            tally(&["a", "b", "c"], &votes, DEADLINE, 0),
            commit(&["a", "b", "c"], &["b", "c"])
        );
    }

    #[test]
    fn inv2_a_no_aborts_naming_it_and_read_only_voters_keep_no_phase_two() {
        let votes = [
            ("a", Vote::Yes),
            ("b", Vote::No("locked".into())),
            ("c", Vote::ReadOnly),
        ];
        let t = tally(&["a", "b", "c"], &votes, DEADLINE, 0);
        assert_eq!(t, abort(AbortReason::Refused(vec![no("b", "locked")]), &["c"]));
        let Tally::Abort { reason, .. } = t else { unreachable!() };
        assert_eq!(reason.to_string(), "b voted NO: locked");
    }

    #[test]
    fn inv2_a_failure_to_vote_counts_as_no() {
        let votes = [("a", Vote::Yes), ("b", Vote::Failed("no vote within 5 ms".into()))];
        let t = tally(&["a", "b"], &votes, DEADLINE, 0);
        assert_eq!(
            t,
            abort(AbortReason::Refused(vec![failed("b", "no vote within 5 ms")]), &[])
        );
        let Tally::Abort { reason, .. } = t else { unreachable!() };
        assert_eq!(reason.to_string(), "b: no vote within 5 ms");
    }

    #[test]
    fn refusals_are_listed_in_voter_order_whatever_order_they_arrived_in() {
        let votes = [
            ("c", Vote::Failed("Unavailable: down".into())),
            ("b", Vote::Yes),
            ("a", Vote::No("x".into())),
        ];
        let t = tally(&["a", "b", "c"], &votes, DEADLINE, 0);
        assert_eq!(
            t,
            abort(
                AbortReason::Refused(vec![no("a", "x"), failed("c", "Unavailable: down")]),
                &[]
            )
        );
        let Tally::Abort { reason, .. } = t else { unreachable!() };
        assert_eq!(reason.to_string(), "a voted NO: x; c: Unavailable: down");
    }

    #[test]
    fn a_no_aborts_before_the_other_votes_are_in() {
        let votes = [("b", Vote::No("x".into()))];
        assert_eq!(
            tally(&["a", "b"], &votes, DEADLINE, 0),
            abort(AbortReason::Refused(vec![no("b", "x")]), &[])
        );
    }

    #[test]
    fn inv7_a_no_arriving_after_the_deadline_aborts_for_the_no() {
        // Every vote in: the NO is the reason, not the clock.
        let votes = [("a", Vote::Yes), ("b", Vote::No("late".into()))];
        assert_eq!(
            tally(&["a", "b"], &votes, DEADLINE, DEADLINE + 1),
            abort(AbortReason::Refused(vec![no("b", "late")]), &[])
        );
        // A vote still missing as well: the NO still outranks the deadline.
        let votes = [("b", Vote::No("late".into()))];
        assert_eq!(
            tally(&["a", "b", "c"], &votes, DEADLINE, DEADLINE),
            abort(AbortReason::Refused(vec![no("b", "late")]), &[])
        );
    }

    #[test]
    fn inv7_every_vote_in_decides_even_past_the_deadline() {
        let votes = [("a", Vote::Yes), ("b", Vote::ReadOnly)];
        assert_eq!(
            tally(&["a", "b"], &votes, DEADLINE, DEADLINE),
            commit(&["a", "b"], &["b"])
        );
        assert_eq!(
            tally(&["a", "b"], &votes, DEADLINE, u64::MAX),
            commit(&["a", "b"], &["b"])
        );
    }

    #[test]
    fn a_duplicate_vote_counts_once_by_its_strongest_answer() {
        // The same YES twice: one voter, counted once.
        let votes = [("a", Vote::Yes), ("a", Vote::Yes)];
        assert_eq!(
            tally(&["a", "b"], &votes, DEADLINE, 0),
            Tally::Pending {
                waiting_for: ids(&["b"]),
                wait_ms: DEADLINE,
            }
        );
        let votes = [("a", Vote::Yes), ("b", Vote::Yes), ("a", Vote::Yes)];
        assert_eq!(tally(&["a", "b"], &votes, DEADLINE, 0), commit(&["a", "b"], &[]));
        // A NO cannot be taken back by a later YES, nor hidden by an earlier one.
        for votes in [
            [("a", Vote::No("x".into())), ("a", Vote::Yes)],
            [("a", Vote::Yes), ("a", Vote::No("x".into()))],
        ] {
            assert_eq!(
                tally(&["a"], &votes, DEADLINE, 0),
                abort(AbortReason::Refused(vec![no("a", "x")]), &[]),
                "{votes:?}"
            );
        }
        // Two refusals from one voter: named once, by the first.
        let votes = [("a", Vote::Failed("timeout".into())), ("a", Vote::No("x".into()))];
        assert_eq!(
            tally(&["a"], &votes, DEADLINE, 0),
            abort(AbortReason::Refused(vec![failed("a", "timeout")]), &[])
        );
        // YES and READ_ONLY from one voter: YES (it gets phase two).
        for votes in [
            [("a", Vote::ReadOnly), ("a", Vote::Yes)],
            [("a", Vote::Yes), ("a", Vote::ReadOnly)],
        ] {
            assert_eq!(tally(&["a"], &votes, DEADLINE, 0), commit(&["a"], &[]), "{votes:?}");
        }
    }

    #[test]
    fn a_vote_from_a_non_voter_is_ignored() {
        // Its YES does not stand in for a missing voter...
        let votes = [("x", Vote::Yes), ("a", Vote::Yes)];
        assert_eq!(
            tally(&["a", "b"], &votes, DEADLINE, 0),
            Tally::Pending {
                waiting_for: ids(&["b"]),
                wait_ms: DEADLINE,
            }
        );
        // ...its NO does not abort, and its READ_ONLY is not acked.
        let votes = [
            ("x", Vote::No("not mine".into())),
            ("y", Vote::ReadOnly),
            ("a", Vote::Yes),
            ("b", Vote::Yes),
        ];
        assert_eq!(tally(&["a", "b"], &votes, DEADLINE, 0), commit(&["a", "b"], &[]));
        // ...and past the deadline it completes nothing.
        assert_eq!(
            tally(&["a"], &[("x", Vote::Yes)], DEADLINE, DEADLINE),
            abort(AbortReason::DeadlinePassed, &[])
        );
    }

    #[test]
    fn no_voters_the_deadline_alone_decides() {
        assert_eq!(tally(&[], &[], DEADLINE, DEADLINE - 1), commit(&[], &[]));
        assert_eq!(
            tally(&[], &[], DEADLINE, DEADLINE),
            abort(AbortReason::DeadlinePassed, &[])
        );
        assert_eq!(
            tally(&[], &[("x", Vote::Yes)], DEADLINE, DEADLINE + 1),
            abort(AbortReason::DeadlinePassed, &[])
        );
    }

    #[test]
    fn the_deadline_note_is_the_one_the_driver_always_recorded() {
        assert_eq!(
            AbortReason::DeadlinePassed.to_string(),
            "deadline passed before the votes were in"
        );
    }

    #[test]
    fn abort_note_names_every_voter_s_part() {
        let votes = [
            ("a", Vote::Yes),
            ("b", Vote::No("locked".into())),
            ("c", Vote::ReadOnly),
            ("a", Vote::Yes),
        ];
        let voters = ["a", "b", "c", "d"];
        let Tally::Abort { reason, .. } = tally(&voters, &votes, DEADLINE, 0) else {
            panic!("a NO aborts")
        };
        assert_eq!(
            abort_note(&voters, &votes, &reason),
            "b voted NO: locked; no vote from d; YES from a; READ_ONLY from c"
        );
        // Past the deadline with votes missing: who did not vote.
        let votes = [("a", Vote::Yes)];
        let Tally::Abort { reason, .. } = tally(&voters, &votes, DEADLINE, DEADLINE) else {
            panic!("the deadline aborts")
        };
        assert_eq!(
            abort_note(&voters, &votes, &reason),
            "deadline passed before the votes were in; no vote from b, c, d; YES from a"
        );
        // A YES then a refusal from one voter: the refusal counts, once.
        let votes = [("a", Vote::Yes), ("a", Vote::Failed("gone".into()))];
        let Tally::Abort { reason, .. } = tally(&["a"], &votes, DEADLINE, 0) else {
            panic!("a failure aborts")
        };
        assert_eq!(abort_note(&["a"], &votes, &reason), "a: gone");
    }
}
