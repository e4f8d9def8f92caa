//! What of this node's Raft log is on its disk, and the three rules that
//! let the leader send an entry to its followers while its own `fdatasync`
//! of that entry runs (ADR 0028).
//!
//! openraft 0.9's leader replicates an entry only once its log store
//! reports it flushed, so the leader's fsync and a follower's run in
//! series. Here the log store reports the leader's own appends at once and
//! syncs them in the background; openraft then counts the leader's copy
//! toward a quorum before it is on disk. Nothing acts on that count until
//! the copy is on disk:
//!
//! 1. **Apply** waits for the node's own log to hold the entry durably
//!    ([`LogDurability::wait_durable`]): a client is answered (and a read
//!    sees the entry) only when the leader's copy and a follower's are both
//!    synced, a majority of three.
//! 2. **The commit index sent to followers** is clamped to the leader's
//!    durable end ([`LogDurability::clamp_commit`]), and so is the one the
//!    log store saves: no follower applies, and no restart re-applies, an
//!    entry the leader's disk may lose.
//! 3. **A restarted leader never resumes its old term**
//!    (`LogStore::open_for_node` stores its committed vote back as
//!    uncommitted): it could otherwise write a different entry under the
//!    log id of one it lost and a follower kept, which breaks Raft's log
//!    matching.
//!
//! Membership entries are never reported early (openraft acts on their
//! commit at once: the next step of a change, a removed leader's exit), nor
//! is anything appended after one until that one is synced.
//!
//! A leader whose disk stalls must still lose its leadership, as it did
//! when its core waited for every sync (its heartbeats then stopped): the
//! transport sends no AppendEntries while the log has written entries and
//! no sync has finished for longer than the shortest election timeout
//! ([`LogDurability::sync_stalled_for`]), so the followers elect another
//! leader if the stall goes on for an election timeout more (a shorter
//! limit would make a slow fsync cost a replication backoff as well).

use std::sync::Mutex;
use std::time::Duration;
use std::time::Instant;

use tokio::sync::watch;

use super::LogId;
use super::NodeId;
use super::Vote;

/// What the node's log has on disk, as its watchers see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durable {
    /// Every entry up to this one (none: an empty log) is synced.
    UpTo(Option<LogId>),
    /// A sync failed: the log is stopped and nothing more becomes durable.
    Failed,
}

/// Why an entry will never become durable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("the Raft log stopped (a sync of its files failed) before entry {index} was on disk")]
pub struct LogStopped {
    pub index: u64,
}

#[derive(Debug)]
struct Inner {
    /// This node, once it runs as one (`None`: appends are always reported
    /// after their sync, as in tools that open a data directory).
    node_id: Option<NodeId>,
    /// The vote the log store last saved or read.
    vote: Option<Vote>,
    /// The last entry written to the log files.
    appended: Option<LogId>,
    /// Bumped by every truncation: a sync that started before one cannot
    /// tell which of the entries it covered are still in the log.
    epoch: u64,
    /// The index of the last membership entry written and not yet known
    /// synced.
    membership_unsynced: Option<u64>,
    /// When a sync last moved the durable end, or an append found nothing
    /// waiting for one (the start of the current wait).
    progress_at: Instant,
}

/// Shared by the log store (appends, truncations, votes), its flusher
/// thread (syncs), the state machine (applies) and the Raft transport
/// (commit indexes sent).
#[derive(Debug)]
pub struct LogDurability {
    inner: Mutex<Inner>,
    durable: watch::Sender<Durable>,
}

impl LogDurability {
    /// A log whose entries up to `last` are on disk and whose stored vote
    /// is `vote`.
    pub fn new(last: Option<LogId>, vote: Option<Vote>) -> Self {
        LogDurability {
            inner: Mutex::new(Inner {
                node_id: None,
                vote,
                appended: last,
                epoch: 0,
                membership_unsynced: None,
                progress_at: Instant::now(),
            }),
            durable: watch::Sender::new(Durable::UpTo(last)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// From now on the log belongs to node `id`: its own appends as the
    /// leader may be reported before their sync.
    pub fn set_node_id(&self, id: NodeId) {
        self.lock().node_id = Some(id);
    }

    /// The log store saved `vote`.
    pub fn vote_saved(&self, vote: Vote) {
        self.lock().vote = Some(vote);
    }

    /// Entries up to `last` were written to the log files (not synced);
    /// `membership` if one of them is a membership entry. Returns whether
    /// openraft may be told at once that they are flushed: only when they
    /// are this node's own entries as the leader of its current term, none
    /// is a membership entry, and no earlier membership entry awaits its
    /// sync.
    pub fn appended(&self, last: LogId, membership: bool) -> bool {
        let mut g = self.lock();
        let durable_index = self.durable_index();
        if index_of(g.appended) <= durable_index {
            g.progress_at = Instant::now();
        }
        g.appended = Some(last);
        if g.membership_unsynced.is_some_and(|m| Some(m) <= durable_index) {
            g.membership_unsynced = None;
        }
        if membership {
            g.membership_unsynced = Some(last.index);
            return false;
        }
        let own_leadership = match (g.node_id, g.vote) {
            (Some(id), Some(v)) => {
                v.is_committed() && v.leader_id().voted_for() == Some(id) && *v.leader_id() == last.leader_id
            }
            _ => false,
        };
        own_leadership && g.membership_unsynced.is_none()
    }

    /// Taken by the flusher just before a sync: what the sync will cover.
    pub fn before_sync(&self) -> (Option<LogId>, u64) {
        let g = self.lock();
        (g.appended, g.epoch)
    }

    /// The sync that started at `(covered, epoch)` (from
    /// [`before_sync`](Self::before_sync)) returned.
    pub fn synced(&self, covered: Option<LogId>, epoch: u64) {
        let mut g = self.lock();
        if g.epoch != epoch {
            // A truncation came in between; it made what it kept durable
            // itself, and what was appended after it has its own sync.
            return;
        }
        g.progress_at = Instant::now();
        self.durable.send_if_modified(|d| match d {
            Durable::UpTo(cur) if index_of(*cur) < index_of(covered) => {
                *d = Durable::UpTo(covered);
                true
            }
            _ => false,
        });
    }

    /// A sync failed: nothing more becomes durable.
    pub fn failed(&self) {
        let _g = self.lock();
        self.durable.send_replace(Durable::Failed);
    }

    /// The log was cut after `last_kept` and what it kept was synced.
    pub fn truncated(&self, last_kept: Option<LogId>) {
        let mut g = self.lock();
        g.epoch += 1;
        g.progress_at = Instant::now();
        g.appended = last_kept;
        if g.membership_unsynced > index_of(last_kept) {
            g.membership_unsynced = None;
        }
        self.durable.send_if_modified(|d| match d {
            Durable::UpTo(_) => {
                *d = Durable::UpTo(last_kept);
                true
            }
            Durable::Failed => false,
        });
    }

    /// The log was purged up to `upto` after a snapshot covering it was
    /// stored: those entries are durable in the state machine's stored
    /// state, even in a log that never held them (a restore, a follower
    /// that installed a snapshot).
    pub fn purged(&self, upto: LogId) {
        let mut g = self.lock();
        g.progress_at = Instant::now();
        if index_of(g.appended) < Some(upto.index) {
            g.appended = Some(upto);
        }
        self.durable.send_if_modified(|d| match d {
            Durable::UpTo(cur) if index_of(*cur) < Some(upto.index) => {
                *d = Durable::UpTo(Some(upto));
                true
            }
            _ => false,
        });
    }

    /// What is on disk now.
    pub fn durable(&self) -> Durable {
        *self.durable.borrow()
    }

    fn durable_index(&self) -> Option<u64> {
        match *self.durable.borrow() {
            Durable::UpTo(l) => index_of(l),
            Durable::Failed => None,
        }
    }

    /// `committed` as far as this node's disk holds it: the smaller of the
    /// two (by index; the durable entry is in the same log, so its id is
    /// the one at that index).
    pub fn clamp_commit(&self, committed: Option<LogId>) -> Option<LogId> {
        match self.durable() {
            Durable::UpTo(d) if index_of(d) < index_of(committed) => d,
            Durable::UpTo(_) => committed,
            // The log stopped: no commit is told any more (a follower
            // never moves its commit index back).
            Durable::Failed => None,
        }
    }

    /// How long written entries have waited for a sync that moves the
    /// durable end (None: nothing waits). The transport stops this node's
    /// AppendEntries, heartbeats included, while it exceeds the shortest
    /// election timeout, so a leader whose disk stalls is replaced.
    pub fn sync_stalled_for(&self, now: Instant) -> Option<Duration> {
        let g = self.lock();
        let waiting = match self.durable() {
            Durable::UpTo(d) => index_of(g.appended) > index_of(d),
            Durable::Failed => true,
        };
        waiting.then(|| now.saturating_duration_since(g.progress_at))
    }

    /// Waits until the entry at `index` is on disk.
    pub async fn wait_durable(&self, index: u64) -> Result<(), LogStopped> {
        let mut rx = self.durable.subscribe();
        let res = rx
            .wait_for(|d| match d {
                Durable::UpTo(l) => index_of(*l) >= Some(index),
                Durable::Failed => true,
            })
            .await
            .map(|d| *d);
        match res {
            Ok(Durable::UpTo(_)) => Ok(()),
            _ => Err(LogStopped { index }),
        }
    }
}

fn index_of(l: Option<LogId>) -> Option<u64> {
    l.map(|l| l.index)
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::CommittedLeaderId;

    fn log_id(term: u64, node: NodeId, index: u64) -> LogId {
        LogId::new(CommittedLeaderId::new(term, node), index)
    }

    fn leading(term: u64, node: NodeId) -> LogDurability {
        let d = LogDurability::new(Some(log_id(term, node, 3)), Some(Vote::new_committed(term, node)));
        d.set_node_id(node);
        d
    }

    #[test]
    fn only_the_leaders_own_entries_of_its_term_are_reported_at_once() {
        let d = leading(4, 1);
        assert!(d.appended(log_id(4, 1, 4), false), "the leader's own entry");
        // An entry of an earlier term of the same node (sent back to it by
        // a later leader), or of another leader.
        assert!(!d.appended(log_id(3, 1, 5), false));
        assert!(!d.appended(log_id(4, 2, 5), false));
        // A follower: its vote is the leader's committed vote.
        let f = LogDurability::new(None, Some(Vote::new_committed(4, 2)));
        f.set_node_id(1);
        assert!(!f.appended(log_id(4, 2, 1), false));
        // A candidate's vote is not committed.
        let c = LogDurability::new(None, Some(Vote::new(4, 1)));
        c.set_node_id(1);
        assert!(!c.appended(log_id(4, 1, 1), false));
        // Without a node id (a tool on a data directory): never.
        let t = LogDurability::new(None, Some(Vote::new_committed(4, 1)));
        assert!(!t.appended(log_id(4, 1, 1), false));
        // A vote saved later changes it.
        d.vote_saved(Vote::new_committed(5, 2));
        assert!(!d.appended(log_id(4, 1, 6), false));
    }

    #[test]
    fn nothing_is_reported_early_behind_an_unsynced_membership_entry() {
        let d = leading(4, 1);
        assert!(
            !d.appended(log_id(4, 1, 4), true),
            "a membership entry waits for its sync"
        );
        assert!(!d.appended(log_id(4, 1, 5), false), "and so does what follows it");
        let (covered, epoch) = d.before_sync();
        d.synced(covered, epoch);
        assert_eq!(d.durable(), Durable::UpTo(Some(log_id(4, 1, 5))));
        assert!(d.appended(log_id(4, 1, 6), false), "once it is synced, early again");
    }

    #[test]
    fn a_sync_makes_durable_what_was_written_before_it_started() {
        let d = leading(4, 1);
        d.appended(log_id(4, 1, 4), false);
        let (covered, epoch) = d.before_sync();
        d.appended(log_id(4, 1, 5), false);
        d.synced(covered, epoch);
        assert_eq!(d.durable(), Durable::UpTo(Some(log_id(4, 1, 4))));
        // An older sync finishing late never moves it back.
        d.synced(Some(log_id(4, 1, 2)), epoch);
        assert_eq!(d.durable(), Durable::UpTo(Some(log_id(4, 1, 4))));
    }

    #[test]
    fn a_truncation_voids_a_sync_that_started_before_it() {
        let d = LogDurability::new(Some(log_id(2, 2, 3)), Some(Vote::new_committed(2, 2)));
        d.set_node_id(1);
        d.appended(log_id(2, 2, 9), false);
        let (covered, epoch) = d.before_sync();
        // A new leader cuts the log after 6 and sends other entries.
        d.truncated(Some(log_id(2, 2, 6)));
        assert_eq!(d.durable(), Durable::UpTo(Some(log_id(2, 2, 6))));
        d.appended(log_id(3, 3, 8), false);
        d.synced(covered, epoch);
        assert_eq!(
            d.durable(),
            Durable::UpTo(Some(log_id(2, 2, 6))),
            "index 9 of the old sync is not the entry now at 8"
        );
        let (covered, epoch) = d.before_sync();
        d.synced(covered, epoch);
        assert_eq!(d.durable(), Durable::UpTo(Some(log_id(3, 3, 8))));
    }

    #[test]
    fn a_purge_point_counts_as_durable() {
        let d = LogDurability::new(None, None);
        d.purged(log_id(3, 2, 40));
        assert_eq!(d.durable(), Durable::UpTo(Some(log_id(3, 2, 40))));
        assert_eq!(d.clamp_commit(Some(log_id(3, 2, 40))), Some(log_id(3, 2, 40)));
        // A purge behind the durable end changes nothing.
        d.purged(log_id(3, 2, 10));
        assert_eq!(d.durable(), Durable::UpTo(Some(log_id(3, 2, 40))));
        // What a later sync covers starts after the purge point.
        assert_eq!(d.before_sync().0, Some(log_id(3, 2, 40)));
    }

    #[test]
    fn a_stall_is_the_time_since_the_durable_end_last_moved_with_writes_waiting() {
        let d = leading(4, 1);
        let t0 = Instant::now();
        assert_eq!(d.sync_stalled_for(t0), None, "nothing written waits");
        d.appended(log_id(4, 1, 4), false);
        let later = Instant::now() + Duration::from_millis(500);
        let stalled = d.sync_stalled_for(later).expect("entry 4 waits");
        assert!(stalled >= Duration::from_millis(500), "{stalled:?}");
        // A second append while the first waits does not restart the clock.
        d.appended(log_id(4, 1, 5), false);
        assert!(d.sync_stalled_for(later).unwrap() >= Duration::from_millis(500));
        // A sync that moves the durable end does.
        let (covered, epoch) = d.before_sync();
        d.synced(covered, epoch);
        assert_eq!(d.sync_stalled_for(later), None);
        d.appended(log_id(4, 1, 6), false);
        assert!(d.sync_stalled_for(later).unwrap() < Duration::from_millis(500));
        d.failed();
        assert!(d.sync_stalled_for(later).is_some(), "a stopped log waits for good");
    }

    #[test]
    fn the_commit_told_is_never_past_the_disk() {
        let d = leading(4, 1);
        assert!(d.appended(log_id(4, 1, 7), false));
        // openraft counts 7 committed (this copy and a follower's); the
        // disk holds up to 3.
        assert_eq!(d.clamp_commit(Some(log_id(4, 1, 7))), Some(log_id(4, 1, 3)));
        assert_eq!(d.clamp_commit(Some(log_id(4, 1, 2))), Some(log_id(4, 1, 2)));
        assert_eq!(d.clamp_commit(None), None);
        let (covered, epoch) = d.before_sync();
        d.synced(covered, epoch);
        assert_eq!(d.clamp_commit(Some(log_id(4, 1, 7))), Some(log_id(4, 1, 7)));
        d.failed();
        assert_eq!(d.clamp_commit(Some(log_id(4, 1, 7))), None);
    }

    #[tokio::test]
    async fn apply_waits_for_the_disk_and_fails_when_the_log_stops() {
        let d = std::sync::Arc::new(leading(4, 1));
        assert_eq!(d.wait_durable(3).await, Ok(()), "already durable: no wait");
        d.appended(log_id(4, 1, 5), false);
        let waiter = tokio::spawn({
            let d = d.clone();
            async move { d.wait_durable(5).await }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "entry 5 is not synced yet");
        let (covered, epoch) = d.before_sync();
        d.synced(covered, epoch);
        assert_eq!(waiter.await.unwrap(), Ok(()));

        d.appended(log_id(4, 1, 6), false);
        let waiter = tokio::spawn({
            let d = d.clone();
            async move { d.wait_durable(6).await }
        });
        tokio::task::yield_now().await;
        d.failed();
        assert_eq!(waiter.await.unwrap(), Err(LogStopped { index: 6 }));
    }
}
