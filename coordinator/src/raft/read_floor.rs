//! The read floor of a leader that restarts in its old term.
//!
//! openraft 0.9 lets a node whose stored vote is a committed vote for
//! itself start as the leader of that term again, at once, without an
//! election and without a new blank entry. Its read index for linearizable
//! reads is then the larger of its term's first entry (long committed) and
//! the committed index it read back from storage, which is not flushed on
//! every change and so may be older than what the cluster had committed
//! and acknowledged before the restart. A read served before the restarted
//! leader has committed and applied its log again would miss acknowledged
//! writes (DESIGN invariant 7; seen as t21 reading a COMMITTED transaction
//! back as PREPARING after a kill -9 of every node).
//!
//! Every entry committed before the restart is in the leader's own log
//! (it synced each one before it counted toward a quorum, and no other
//! leader existed in its term), so a floor of the last index its log held
//! at the restart closes the gap: linearizable reads, and the leader's own
//! work that starts from the table (resuming deliveries and re-drives),
//! wait until that index is applied. The floor holds only in the term the
//! node restarted in: a leader of a later term has its own blank entry,
//! which openraft's read index covers.

use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;

use super::NodeId;
use super::Vote;

/// See the module's text.
#[derive(Debug)]
pub struct RestartReadFloor {
    /// (term, index): the term this node restarted leading, and the last
    /// index its log held then. None: it did not restart as a leader.
    floor: Option<(u64, u64)>,
    /// Set once the floor was applied in its term, or the term moved on.
    passed: AtomicBool,
}

impl RestartReadFloor {
    /// The floor of a node `self_id` whose storage holds `vote` and a log
    /// ending at `last_log_index`.
    pub fn at_open(self_id: NodeId, vote: Option<&Vote>, last_log_index: Option<u64>) -> Self {
        let floor = match (vote, last_log_index) {
            (Some(v), Some(index)) if v.is_committed() && v.leader_id().voted_for() == Some(self_id) => {
                Some((v.leader_id().get_term(), index))
            }
            _ => None,
        };
        RestartReadFloor {
            floor,
            passed: AtomicBool::new(floor.is_none()),
        }
    }

    /// True once nothing more is needed (the common case: one atomic load,
    /// so callers may skip reading the metrics).
    pub fn passed(&self) -> bool {
        self.passed.load(Ordering::Acquire)
    }

    /// The index that must be applied before this node, leading `term` with
    /// `applied` applied, answers from its state machine; None when
    /// nothing more is needed (and from then on).
    pub fn pending(&self, term: u64, applied: Option<u64>) -> Option<u64> {
        if self.passed() {
            return None;
        }
        let (floor_term, index) = self.floor?;
        if term != floor_term || applied >= Some(index) {
            self.passed.store(true, Ordering::Release);
            return None;
        }
        Some(index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn committed_vote(term: u64, node: NodeId) -> Vote {
        Vote::new_committed(term, node)
    }

    #[test]
    fn a_leader_restarting_in_its_term_waits_for_its_whole_log() {
        let f = RestartReadFloor::at_open(1, Some(&committed_vote(4, 1)), Some(120));
        assert_eq!(f.pending(4, Some(90)), Some(120));
        assert_eq!(f.pending(4, None), Some(120));
        assert_eq!(f.pending(4, Some(119)), Some(120));
        assert_eq!(f.pending(4, Some(120)), None);
        // Once passed, for good (the applied index only grows).
        assert_eq!(f.pending(4, Some(3)), None);
    }

    #[test]
    fn a_later_term_ends_the_floor() {
        let f = RestartReadFloor::at_open(1, Some(&committed_vote(4, 1)), Some(120));
        assert_eq!(f.pending(5, Some(90)), None);
        assert_eq!(f.pending(4, Some(90)), None);
    }

    #[test]
    fn no_floor_unless_restarting_as_the_leader() {
        // Another node's leadership, an uncommitted vote (a candidate), no
        // vote, no log: an election, if any, makes a blank entry.
        let other = RestartReadFloor::at_open(1, Some(&committed_vote(4, 2)), Some(120));
        assert_eq!(other.pending(4, Some(0)), None);
        let candidate = RestartReadFloor::at_open(1, Some(&Vote::new(4, 1)), Some(120));
        assert_eq!(candidate.pending(4, Some(0)), None);
        assert_eq!(RestartReadFloor::at_open(1, None, Some(120)).pending(4, None), None);
        let empty = RestartReadFloor::at_open(1, Some(&committed_vote(4, 1)), None);
        assert_eq!(empty.pending(4, None), None);
    }
}
