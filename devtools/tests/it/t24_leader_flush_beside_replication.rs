//! The leader sends new entries to its followers while its own fsync runs,
//! and still no decision is acknowledged, and no entry applied anywhere,
//! before the leader's own log holds it; an acknowledged decision survives a
//! kill -9 of every node (invariant 4, durability: a caller told
//! COMMITTED reads back COMMITTED; invariant 7 for the linearizable read
//! after the restart).
//!
//! openraft 0.9 flushed the leader's log and only then replicated. Now the
//! two overlap, which is safe only together with three rules: a node's
//! state machine applies an entry (and the leader answers its client) only
//! once the node's own log has it durable; the `leader_commit` the leader
//! sends is clamped to the last entry durable in its own log; and a node
//! restarted with a committed vote for itself stores it back as
//! uncommitted, so it wins a new term instead of resuming its old one.
//!
//! The window is held open with the `failpoints` refusal point
//! `raft_log_flush`, listed in a file (`DTX_FAILPOINT_REFUSE`) that only the
//! leader's process reads: each node is started with its own file, and only
//! the leader's gets the line. While it is there the leader's log flusher
//! holds its next fsync: entries reach the log files, nothing is reported
//! durable. With one Commit in flight, the test checks, sampling for a while:
//!
//! - (a) both followers' logs reach the new entry, and the leader has heard
//!   so (their matched index): the overlap itself. Fails if the leader still
//!   flushes before it replicates (and then the checks below prove nothing);
//!   with the leader's early reports turned off, its followers even stop
//!   hearing from it and call an election, which the test reports as such.
//! - (b) the leader has not applied the entry: catches a leader that applies
//!   an entry its own log has not made durable (the two followers make it
//!   committed), whose stored state could then run ahead of its log.
//! - (b) neither follower has applied it: catches a `leader_commit` that is
//!   not clamped, which lets followers apply an entry the leader has not
//!   synced.
//! - (b) the Commit has not returned: catches a decision acknowledged before
//!   the leader's own log holds it.
//!
//! Then the test removes the line: the Commit answers COMMITTED and every
//! node applies the entry. Last, it kill -9s all three nodes and restarts
//! them: the new leader's term is greater than the term before the kill
//! (catches a restarted leader resuming its old term, where it could write
//! other entries at indexes its followers already hold from that term, two
//! entries with one log id), and the decision reads back as before.
//!
//! A second test holds the leader's fsync and does not release it: a leader
//! whose disk hangs must still be replaced (invariant 6: with one
//! node's disk hung, an in-doubt transaction is resolved within about an
//! election; invariant 4: an acknowledged decision is never lost). While
//! openraft's core waited for every sync, such a leader's heartbeats stopped
//! and its followers elected another; with its appends reported before their
//! sync, the transport stops its AppendEntries (heartbeats included) once
//! the sync has waited longer than `raft.election_timeout_min_ms`. With a
//! Commit of a transaction sent to the leader behind the held fsync, the test
//! checks, on short election timeouts (500-1000 ms):
//!
//! - (c) both followers hold the Commit's entry while still in the old term
//!   (a premise: it makes COMMIT the only outcome a new leader may record).
//! - (d) within 20 s the two followers agree on a new leader, not the old
//!   one, in a later term: fails if a leader whose log sync stalls keeps
//!   heartbeating (the transport without its stall check), so the followers
//!   never time out and the transaction waits for the hung disk.
//! - (e) while the old leader's fsync is still held, the new leader reports
//!   the transaction decided, and COMMIT (it re-drives the PREPARING
//!   transaction the old leader's entry left): fails if the decision waits
//!   for the hung disk, or if the entry the followers held were lost or
//!   decided otherwise. And the old leader, now a follower, still has not
//!   applied that entry: catches a node that applies, once it no longer
//!   leads, an entry its own log has not synced.
//! - (f) the Commit sent to the old leader answers nothing definite other
//!   than that COMMIT (UNKNOWN, unavailable, or COMMIT after forwarding):
//!   catches a stalled leader that answers an outcome it did not record.
//!
//! Then it removes the line: the old leader's sync goes through, all three
//! nodes name the new leader, the old one is not Leader, all apply the same
//! last index, and a linearizable Status read through each node's API
//! answers the same COMMIT: catches an old leader that resumes leading, or
//! whose log (stuck behind the held sync) diverges from the others'.
//!
//! Run with `cargo test -p dtx-devtools --test it -- t24_leader_flush_beside_replication::`.

use crate::common;

use std::path::PathBuf;
use std::time::Duration;

use common::replicated;
use common::TestCluster;
use dtx_client::TxOutcome;
use dtx_proto::v1::ClusterStatusResponse;
use dtx_testkit::cluster::ProcessCluster;

/// The refusal file of node `id`: each node reads its own.
fn refuse_file(c: &TestCluster, id: u64) -> PathBuf {
    c.dir.path().join(format!("refuse-node{id}"))
}

/// Starts node `id` with `DTX_FAILPOINT_REFUSE` naming its own file
/// (`ProcessCluster::start` passes the `env` it holds at the call).
fn start_node(c: &mut TestCluster, id: u64) {
    let file = refuse_file(c, id).display().to_string();
    c.procs.env = vec![("DTX_FAILPOINT_REFUSE".into(), file)];
    c.procs.start(id).unwrap();
}

/// Node `id`'s status, or `None` if it does not answer within 500 ms.
async fn status(c: &TestCluster, id: u64) -> Option<ClusterStatusResponse> {
    dtx_client::cluster_status_at(&c.api(id), Duration::from_millis(500))
        .await
        .ok()
}

/// The index the leader's view says member `id` holds (0 if not listed).
fn matched(leader: &ClusterStatusResponse, id: u64) -> u64 {
    leader
        .members
        .iter()
        .find(|m| m.node_id == id)
        .map(|m| m.matched_index)
        .unwrap_or(0)
}

/// A three-node cluster (tuned by `tune`, each node with its own refusal
/// file) whose leader's log fsync is held, and the Commit of one begun
/// transaction sent to that leader: the first write behind the held fsync.
struct Held {
    c: TestCluster,
    leader: u64,
    followers: Vec<u64>,
    txid: u64,
    /// The leader's term when its fsync was held.
    term: u64,
    /// The index of the first entry behind the held fsync.
    target: u64,
    write: tokio::task::JoinHandle<Result<TxOutcome, dtx_client::ClientError>>,
}

async fn hold_the_leaders_flush(cluster_id: &str, tune: impl Fn(&mut coordinator::config::Config)) -> Held {
    let dir = common::test_dir();
    let procs = ProcessCluster::new(common::bin(), dir.path(), cluster_id, common::local_plans(3), tune)
        .expect("cluster config");
    let mut c = TestCluster {
        dir,
        procs,
        proxies: Vec::new(),
    };
    for id in 1..=3 {
        start_node(&mut c, id);
    }
    let leader = c.leader().await;
    let followers: Vec<u64> = (1..=3).filter(|id| *id != leader).collect();

    // Ordinary writes, applied everywhere.
    let client = c.client();
    for i in 0..5u64 {
        let b = client.begin(&format!("warm{i}"), 600_000, b"").await.unwrap();
        assert_eq!(client.commit(b.txid).await.unwrap(), TxOutcome::Committed);
    }
    // The transaction whose Commit is the write under test; its deadline
    // is far away, so no reaper decides it.
    let txid = client.begin("held", 600_000, b"").await.unwrap().txid;
    let before = c.status_of(leader).await;
    for id in 1..=3 {
        assert!(
            c.wait_applied(id, before.last_log_index, Duration::from_secs(20)).await,
            "node {id} did not apply index {} within 20 s",
            before.last_log_index
        );
    }

    // Hold the leader's flush (its process re-reads the file within 50 ms;
    // a flush under way finishes).
    std::fs::write(refuse_file(&c, leader), "raft_log_flush\n").unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let held = c.status_of(leader).await;
    assert_eq!(
        (held.role.as_str(), held.term),
        ("Leader", before.term),
        "premise: node {leader} still leads term {} ({held:?})",
        before.term
    );
    // Nothing new since everything was applied: the next entry, whatever
    // proposes it, is the first one behind the held fsync.
    let target = held.last_log_index + 1;
    for id in 1..=3 {
        let s = status(&c, id).await.expect("status while nothing is held yet");
        assert!(
            s.last_applied_index < target && s.last_log_index < target,
            "premise: nothing past index {} on node {id} before the write ({s:?})",
            held.last_log_index
        );
    }

    let committer = c.client_at(leader);
    let write = tokio::spawn(async move { committer.commit(txid).await });
    Held {
        c,
        leader,
        followers,
        txid,
        term: held.term,
        target,
        write,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t24_the_leader_replicates_beside_its_flush_and_acknowledges_only_after_it() {
    // Long election timeouts: the held flush must not start an election
    // (heartbeats still go out, until the sync has waited longer than the
    // shortest election timeout, 4 s, far more than this hold; nothing else
    // should need the leader's fsync, but a vote written behind the held
    // one would be stuck too).
    let Held {
        mut c,
        leader,
        followers,
        txid,
        term,
        target,
        write,
    } = hold_the_leaders_flush("t24", |cfg| {
        cfg.raft.election_timeout_min_ms = 4_000;
        cfg.raft.election_timeout_max_ms = 5_000;
    })
    .await;

    // (a) while (b): poll until both followers hold the entry (and the
    // leader knows it), then keep sampling for 1.5 s more.
    let until = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut overlap_seen_at: Option<tokio::time::Instant> = None;
    let mut samples_after_overlap = 0;
    loop {
        let mut views = Vec::new();
        for id in 1..=3 {
            views.push((id, status(&c, id).await));
        }
        // The term first: a new leader applies its own first entry, which
        // says nothing about the held one.
        for (id, s) in views.iter().filter_map(|(id, s)| Some((id, s.as_ref()?))) {
            assert!(
                s.term == term,
                "premise: no election while the leader's flush is held, but node {id} is in term {} (was {}): does \
                 the leader stop its heartbeats behind its held fsync, so it does not replicate beside it? (or the \
                 machine is too slow for 4-5 s election timeouts) ({s:?})",
                s.term,
                term
            );
        }
        for (id, s) in views.iter().filter_map(|(id, s)| Some((id, s.as_ref()?))) {
            assert!(
                s.last_applied_index < target,
                "node {id} applied index {target} while the leader (node {leader}) had not made it durable in its own \
                 log ({s:?})"
            );
        }
        assert!(
            !write.is_finished(),
            "the Commit of transaction {txid} returned while the leader's log had not made it durable: {:?}",
            write.await
        );
        let leader_view = views[(leader - 1) as usize].1.as_ref();
        let overlap = followers.iter().all(|f| {
            let in_log = views[(*f - 1) as usize]
                .1
                .as_ref()
                .is_some_and(|s| s.last_log_index >= target);
            let acked = leader_view.is_some_and(|l| matched(l, *f) >= target);
            in_log && acked
        });
        if overlap && overlap_seen_at.is_none() {
            overlap_seen_at = Some(tokio::time::Instant::now());
        }
        if let Some(at) = overlap_seen_at {
            samples_after_overlap += 1;
            if at.elapsed() >= Duration::from_millis(1_500) && samples_after_overlap >= 5 {
                break;
            }
        }
        assert!(
            tokio::time::Instant::now() < until,
            "the followers {followers:?} did not receive index {target} within 20 s while the leader (node \
             {leader}) held its flush: does the leader still flush before it replicates? ({views:?})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Release: the Commit answers, every node applies the entry.
    std::fs::remove_file(refuse_file(&c, leader)).unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(30), write)
        .await
        .expect("the Commit returns within 30 s of the flush being released")
        .unwrap();
    assert_eq!(outcome.unwrap(), TxOutcome::Committed);
    let after = c.status_of(leader).await;
    assert!(after.last_log_index >= target, "{after:?}");
    for id in 1..=3 {
        assert!(
            c.wait_applied(id, after.last_log_index, Duration::from_secs(20)).await,
            "node {id} did not apply index {} within 20 s of the release",
            after.last_log_index
        );
    }
    let decided = replicated(c.client().status(txid).await.unwrap());
    assert_eq!(
        decided.decision.as_ref().map(|d| d.outcome),
        Some(dtx_proto::v1::Outcome::Commit as i32),
        "{decided:?}"
    );

    // kill -9 every node and restart them all: a new term, and the
    // acknowledged decision reads back.
    let term = c.status_of(leader).await.term;
    for id in 1..=3 {
        c.procs.kill9(id);
    }
    for id in 1..=3 {
        start_node(&mut c, id);
    }
    let new_leader = c.leader().await;
    let s = c.status_of(new_leader).await;
    assert!(
        s.term > term,
        "node {new_leader} leads term {} after a full restart, not a term after {term}: a restarted leader resumed \
         its old term ({s:?})",
        s.term
    );
    let read = c.client().status(txid).await.map(replicated);
    assert_eq!(
        read.as_ref().ok(),
        Some(&decided),
        "the acknowledged COMMIT of transaction {txid} read back differently after a full restart: {read:?}"
    );
}

/// Prints every node's log tail, then panics with `msg`.
fn fail(c: &TestCluster, msg: String) -> ! {
    c.dump_logs();
    panic!("{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t24_a_leader_whose_log_sync_stalls_is_replaced() {
    // Short election timeouts: the replacement is what the test waits for.
    // The stall limit is the shortest election timeout (500 ms); a follower
    // calls an election openraft's leader lease (the longest election
    // timeout, 1000 ms) plus one of its election timeouts (500-1000 ms)
    // after the last heartbeat it heard. The leader's flush stays held
    // until step 5.
    let Held {
        c,
        leader: old_leader,
        followers,
        txid,
        term: old_term,
        target,
        write,
    } = hold_the_leaders_flush("t24b", |cfg| {
        cfg.raft.heartbeat_interval_ms = 100;
        cfg.raft.election_timeout_min_ms = 500;
        cfg.raft.election_timeout_max_ms = 1_000;
    })
    .await;

    // (c) and (d): poll the followers until they agree on a new leader.
    let until = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut held_in_old_term = [false; 2];
    let new_leader = loop {
        let views = [status(&c, followers[0]).await, status(&c, followers[1]).await];
        for (seen, view) in held_in_old_term.iter_mut().zip(&views) {
            if let Some(s) = view {
                *seen |= s.term == old_term && s.last_log_index >= target;
            }
        }
        if let [Some(a), Some(b)] = &views {
            let candidate = a.leader_id;
            let leads = |s: &ClusterStatusResponse| s.node_id != candidate || s.role == "Leader";
            if candidate != 0
                && candidate != old_leader
                && b.leader_id == candidate
                && a.term > old_term
                && a.term == b.term
                && leads(a)
                && leads(b)
            {
                break candidate;
            }
        }
        if tokio::time::Instant::now() >= until {
            let old = status(&c, old_leader).await;
            fail(
                &c,
                format!(
                    "(d) the followers {followers:?} elected no new leader within 20 s while the log sync of the \
                     leader (node {old_leader}, term {old_term}) was held: does a leader whose log sync stalls keep \
                     sending heartbeats? followers: {views:?}; old leader: {old:?}"
                ),
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        held_in_old_term.iter().all(|h| *h),
        "(c) premise: the followers {followers:?} were not both seen holding index {target} (the Commit's entry) \
         in term {old_term} before the election (seen: {held_in_old_term:?}); the Commit's entry may not have left \
         the stalled leader, so COMMIT is not the only possible state below"
    );

    // (e) the new leader decides the transaction while the old leader's disk
    // is still hung.
    let reader = c.client_at(new_leader);
    let until = tokio::time::Instant::now() + Duration::from_secs(20);
    let decided = loop {
        let read = reader.status(txid).await;
        if let Ok(s) = &read {
            if s.decision.is_some() {
                break replicated(s.clone());
            }
        }
        if tokio::time::Instant::now() >= until {
            fail(
                &c,
                format!(
                    "(e) transaction {txid} was not decided within 20 s by the new leader (node {new_leader}) while \
                     node {old_leader}'s log sync was held; last read: {read:?}"
                ),
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        (decided.state, decided.decision.as_ref().map(|d| d.outcome)),
        (
            dtx_proto::v1::TxState::Decided as i32,
            Some(dtx_proto::v1::Outcome::Commit as i32)
        ),
        "(e) the followers held the Commit's entry of transaction {txid}, so only COMMIT may be recorded: {decided:?}"
    );
    // (e) the old leader counted the entry committed while it led (its own
    // early report and the followers' copies), and the new leader has
    // committed it since; its own log still has not synced it, so it must
    // not have applied it. Its Raft core may be blocked (a follower's
    // append waits for its sync) and not answer; what it answers counts.
    for _ in 0..5 {
        if let Some(s) = status(&c, old_leader).await {
            assert!(
                s.last_applied_index < target,
                "(e) node {old_leader} applied index {target} while its log sync was still held ({s:?})"
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // (f) what the stalled leader answered, if it has answered yet.
    let check_answer = |c: &TestCluster, answer: &Result<TxOutcome, dtx_client::ClientError>| match answer {
        Ok(TxOutcome::Committed) | Ok(TxOutcome::Unknown) => {}
        Err(
            dtx_client::ClientError::Unavailable(_)
            | dtx_client::ClientError::NotApplied(_)
            | dtx_client::ClientError::Unknown(_),
        ) => {}
        other => fail(
            c,
            format!(
                "(f) the Commit of transaction {txid} sent to the stalled leader (node {old_leader}) answered \
                 {other:?}, but the new leader (node {new_leader}) recorded COMMIT"
            ),
        ),
    };
    let answered_while_held = write.is_finished();
    let mut write = Some(write);
    if answered_while_held {
        let answer = write.take().unwrap().await.unwrap();
        eprintln!("the Commit sent to node {old_leader} answered while its sync was held: {answer:?}");
        check_answer(&c, &answer);
    }

    // Release: the old leader's sync goes through and it follows the new one.
    std::fs::remove_file(refuse_file(&c, old_leader)).unwrap();
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    let views = loop {
        let mut views = Vec::new();
        for id in 1..=3 {
            views.push((id, status(&c, id).await));
        }
        let all: Vec<&ClusterStatusResponse> = views.iter().filter_map(|(_, s)| s.as_ref()).collect();
        let settled = all.len() == 3
            && all.iter().all(|s| {
                s.leader_id == new_leader
                    && s.term == all[0].term
                    && s.last_applied_index == s.last_log_index
                    && s.last_applied_index == all[0].last_applied_index
            });
        if settled {
            break views;
        }
        if tokio::time::Instant::now() >= until {
            fail(
                &c,
                format!(
                    "after node {old_leader}'s log sync was released, the three nodes did not all follow node \
                     {new_leader} with the same applied last index within 30 s: {views:?}"
                ),
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let old_view = views[(old_leader - 1) as usize].1.as_ref().unwrap();
    assert_ne!(old_view.role, "Leader", "node {old_leader} leads again: {old_view:?}");
    let new_view = views[(new_leader - 1) as usize].1.as_ref().unwrap();
    assert_eq!(new_view.role, "Leader", "{new_view:?}");
    assert!(new_view.last_applied_index > target, "{new_view:?}");
    // At one applied index every node's own state holds the same records
    // (the Status reads below are all answered by the leader).
    let counts: Vec<(u64, u64)> = views
        .iter()
        .map(|(_, s)| s.as_ref().map(|s| (s.transactions, s.next_txid)).unwrap())
        .collect();
    assert!(
        counts.iter().all(|c| *c == counts[0]),
        "the nodes' applied states differ at one applied index: (transactions, next_txid) by node {counts:?}"
    );

    // Every node's API reads the same decision (linearizable).
    for id in 1..=3 {
        let read = c.client_at(id).status(txid).await.map(replicated);
        assert_eq!(
            read.as_ref().ok(),
            Some(&decided),
            "a Status read of transaction {txid} through node {id} differs from the decision node {new_leader} \
             recorded: {read:?}"
        );
    }

    // (f) for a Commit that had not answered while the sync was held. The
    // client gives up within its 15 s call deadline; one still pending
    // after 30 s has answered nothing, which (f) allows: it is stopped and
    // reported.
    if let Some(mut write) = write {
        match tokio::time::timeout(Duration::from_secs(30), &mut write).await {
            Ok(answer) => {
                let answer = answer.unwrap();
                eprintln!("the Commit sent to node {old_leader} answered after its sync was released: {answer:?}");
                check_answer(&c, &answer);
            }
            Err(_) => {
                write.abort();
                eprintln!(
                    "note: the Commit of transaction {txid} sent to node {old_leader} had not returned 30 s after the \
                     release (its client's call deadline is 15 s); stopped"
                );
            }
        }
    }
}
