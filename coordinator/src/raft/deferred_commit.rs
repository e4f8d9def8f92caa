//! A follower's commit index rides in its next AppendEntries
//! ([ADR 0031](../../../docs/adr/0031-commit-index-rides-the-next-append.md)).
//!
//! openraft 0.9.25's replication stream sends a follower an AppendEntries
//! without entries after every commit, only to carry the new commit index
//! (`ReplicationCore::process_event`, `Replicate::Committed`), and another
//! one every heartbeat. At one client that is a second request and answer
//! per entry for each follower, and it is not configurable in 0.9.
//!
//! [`DeferredCommit`] decides, per replication connection, when such a
//! request need not leave: it carries no entries, it is of the same leader
//! (vote) and ends at the same log id as a request this follower accepted,
//! and that request left less than `raft.commit_index_defer_max_ms` ago.
//! The connection then answers openraft itself with what the follower
//! answered then (`Success`: its log still matches up to that log id), and
//! the follower learns the commit index from its next AppendEntries: the
//! next entries, or the first heartbeat after the window.
//!
//! What this costs, and why it is safe:
//! - No log entry is ever skipped, and nothing the leader counts toward a
//!   quorum changes: the skipped request carried no entries, and its answer
//!   repeats a match the leader already counted.
//! - openraft takes any answer as the follower's acknowledgement of the
//!   leader at the request's sending time (`update_leader_clock`), so the
//!   leader's "quorum acknowledged me" age can be up to the window younger
//!   than the truth (the serving rule's limit is an election timeout).
//! - A deposed leader hears of the newer term at its next request that
//!   leaves, at most a window plus a heartbeat later; it can commit nothing
//!   meanwhile, since entries always leave.
//! - A follower hears from the leader at least every window plus a
//!   heartbeat interval, which `RaftConfig::commit_index_defer_window`
//!   keeps below the election timeout, so it never campaigns for want of
//!   these requests.
//! - A follower applies an entry when the next request arrives (at most a
//!   window plus a heartbeat after its commit when no more come).
//! - openraft's read-index rounds (`ensure_linearizable`) ask for a new
//!   client each time; a new connection has no accepted request, so their
//!   requests always leave and linearizable reads keep a real quorum. That
//!   is an openraft 0.9.25 detail, guarded by `store::read_index_rounds`
//!   (ADR 0001, "Upgrading openraft").

use std::time::Duration;
use std::time::Instant;

use openraft::LogId;
use openraft::Vote;

use super::NodeId;

/// The last AppendEntries this follower accepted on this connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Accepted {
    vote: Vote<NodeId>,
    /// The last log id it covered (its last entry, or its prev_log_id).
    end: Option<LogId<NodeId>>,
    sent_at: Instant,
}

/// Per replication connection: whether an AppendEntries without entries
/// may be answered here instead of sent. Pure: the caller passes the time.
#[derive(Debug)]
pub struct DeferredCommit {
    window: Duration,
    accepted: Option<Accepted>,
}

impl DeferredCommit {
    /// `window` zero: every request leaves.
    pub fn new(window: Duration) -> Self {
        DeferredCommit { window, accepted: None }
    }

    /// True when a request of `vote` with `prev_log_id` and no entries (an
    /// `entries_empty` request) need not leave at `now`.
    pub fn may_skip(
        &self,
        vote: &Vote<NodeId>,
        prev_log_id: Option<&LogId<NodeId>>,
        entries_empty: bool,
        now: Instant,
    ) -> bool {
        let Some(a) = &self.accepted else { return false };
        entries_empty
            && !self.window.is_zero()
            && a.vote == *vote
            && a.end.as_ref() == prev_log_id
            && now.saturating_duration_since(a.sent_at) < self.window
    }

    /// A request is leaving: the last acceptance is forgotten until this
    /// one is accepted. So after any other answer (a conflict, a partial or
    /// higher-vote answer, an error, a call cut off by a timeout, which
    /// never reports) the next request leaves too.
    pub fn sending(&mut self) {
        self.accepted = None;
    }

    /// The follower took all of a request of `vote` ending at `end`, sent
    /// at `sent_at` (it answered `Success`).
    pub fn accepted(&mut self, vote: Vote<NodeId>, end: Option<LogId<NodeId>>, sent_at: Instant) {
        self.accepted = Some(Accepted { vote, end, sent_at });
    }
}

#[cfg(test)]
mod tests {
    use openraft::CommittedLeaderId;

    use super::*;

    fn vote(term: u64) -> Vote<NodeId> {
        Vote::new_committed(term, 1)
    }

    fn log_id(term: u64, index: u64) -> LogId<NodeId> {
        LogId::new(CommittedLeaderId::new(term, 1), index)
    }

    const WINDOW: Duration = Duration::from_millis(50);

    #[test]
    fn a_new_connection_sends_everything() {
        let d = DeferredCommit::new(WINDOW);
        assert!(!d.may_skip(&vote(2), Some(&log_id(2, 7)), true, Instant::now()));
    }

    #[test]
    fn an_empty_request_right_after_an_accepted_one_at_the_same_place_is_skipped() {
        let t0 = Instant::now();
        let mut d = DeferredCommit::new(WINDOW);
        d.accepted(vote(2), Some(log_id(2, 7)), t0);
        assert!(d.may_skip(&vote(2), Some(&log_id(2, 7)), true, t0 + Duration::from_millis(1)));
        assert!(d.may_skip(&vote(2), Some(&log_id(2, 7)), true, t0 + Duration::from_millis(49)));
    }

    #[test]
    fn entries_always_leave() {
        let t0 = Instant::now();
        let mut d = DeferredCommit::new(WINDOW);
        d.accepted(vote(2), Some(log_id(2, 7)), t0);
        assert!(!d.may_skip(&vote(2), Some(&log_id(2, 7)), false, t0));
    }

    #[test]
    fn after_the_window_the_request_leaves_so_the_follower_hears_from_its_leader() {
        let t0 = Instant::now();
        let mut d = DeferredCommit::new(WINDOW);
        d.accepted(vote(2), Some(log_id(2, 7)), t0);
        assert!(!d.may_skip(&vote(2), Some(&log_id(2, 7)), true, t0 + WINDOW));
        assert!(!d.may_skip(&vote(2), Some(&log_id(2, 7)), true, t0 + Duration::from_secs(5)));
    }

    #[test]
    fn another_vote_or_another_place_in_the_log_leaves() {
        let t0 = Instant::now();
        let mut d = DeferredCommit::new(WINDOW);
        d.accepted(vote(2), Some(log_id(2, 7)), t0);
        let soon = t0 + Duration::from_millis(1);
        assert!(!d.may_skip(&vote(3), Some(&log_id(2, 7)), true, soon), "a new term");
        assert!(
            !d.may_skip(&vote(2), Some(&log_id(2, 6)), true, soon),
            "behind the match"
        );
        assert!(!d.may_skip(&vote(2), Some(&log_id(2, 8)), true, soon), "past the match");
        assert!(!d.may_skip(&vote(2), None, true, soon), "from the start");
    }

    #[test]
    fn a_request_that_leaves_forgets_the_match_until_it_is_accepted() {
        let t0 = Instant::now();
        let mut d = DeferredCommit::new(WINDOW);
        d.accepted(vote(2), Some(log_id(2, 7)), t0);
        // Out, or answered with anything but Success: nothing is skipped.
        d.sending();
        assert!(!d.may_skip(&vote(2), Some(&log_id(2, 7)), true, t0));
        d.accepted(vote(2), Some(log_id(2, 7)), t0);
        assert!(d.may_skip(&vote(2), Some(&log_id(2, 7)), true, t0));
    }

    #[test]
    fn a_zero_window_sends_everything() {
        let t0 = Instant::now();
        let mut d = DeferredCommit::new(Duration::ZERO);
        d.accepted(vote(2), Some(log_id(2, 7)), t0);
        assert!(!d.may_skip(&vote(2), Some(&log_id(2, 7)), true, t0));
    }
}
