//! A follower's commit index rides in its next AppendEntries (ADR 0031):
//! the leader does not send an AppendEntries that carries only a newer
//! commit index (or a heartbeat) to a follower that accepted one at the same
//! place within `raft.commit_index_defer_max_ms` (50 ms by default).
//!
//! On a real three-node cluster with default settings, one client writes
//! 200 entries one after another (a Begin, then an Abort: a decision), so
//! every commit would have sent each follower a request of its own. Then:
//!
//! - (a) the leader counted deferred requests
//!   (`dtx_raft_appends_deferred_total` > 0 on its metrics port): fails if
//!   every commit-only request still leaves, and the checks below then
//!   prove nothing;
//! - (b) with no more writes, both followers apply the last entry the
//!   leader applied: fails if a deferred commit index never reaches them
//!   (a follower must learn it from the first heartbeat after the window);
//! - (c) for two seconds of quiet afterwards (four election timeouts or
//!   more) no node changes term or leader: fails if the window swallowed
//!   the heartbeats too, so the followers stopped hearing from their leader
//!   and campaigned (invariant 6 wants a leader that stays put when
//!   nothing failed; an election costs every in-doubt participant a
//!   timeout);
//! - (d) every decision reads back through a follower's API (forwarded to
//!   the leader, linearizable: invariant 7) as ABORT: the read-index rounds
//!   that confirm leadership are never answered from the window.
//!
//! Every wait only polls, within generous bounds; none times anything.

use crate::common;

use std::time::Duration;

use common::bank_run::scrape;
use common::node_ip;
use common::TestCluster;
use dtx_client::DecisionRead;
use dtx_client::TxOutcome;
use dtx_testkit::cluster::free_port;

const WRITES: usize = 100;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t25_followers_learn_every_commit_and_keep_their_leader_while_commit_only_appends_wait() {
    let mut c = TestCluster::start_with("t25", 3, |cfg| {
        let ip = node_ip(cfg.node_id);
        cfg.metrics_addr = Some(format!("{ip}:{}", free_port(&ip).unwrap()));
    });
    let leader = c.leader().await;
    let followers: Vec<u64> = (1..=3).filter(|id| *id != leader).collect();
    let cl = c.client();

    let mut txids = Vec::new();
    for i in 0..WRITES {
        let began = cl.begin(&format!("t25-{i}"), 60_000, b"").await.expect("begin");
        let outcome = cl.abort(began.txid, "t25").await.expect("abort");
        assert_eq!(outcome, TxOutcome::Aborted, "txid {}", began.txid);
        txids.push(began.txid);
    }

    let before = c.status_of(leader).await;
    assert_eq!(before.role, "Leader", "node {leader} led through the writes");
    let term = before.term;

    // (a)
    let metrics = c
        .procs
        .node(leader)
        .config
        .metrics_addr
        .clone()
        .expect("metrics_addr set");
    let text = scrape(&metrics).await;
    let deferred: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("dtx_raft_appends_deferred_total ")?.trim().parse().ok())
        .unwrap_or(0.0);
    assert!(
        deferred > 0.0,
        "(a) the leader deferred no commit-only AppendEntries over {} sequential writes",
        2 * WRITES
    );

    // (b)
    let applied = before.last_applied_index;
    for id in &followers {
        assert!(
            c.wait_applied(*id, applied, Duration::from_secs(30)).await,
            "(b) follower {id} never applied index {applied}, the leader's last, with no more writes: status {:?}",
            c.status_of(*id).await
        );
    }

    // (c)
    let quiet_until = tokio::time::Instant::now() + Duration::from_secs(2);
    while tokio::time::Instant::now() < quiet_until {
        for id in 1..=3u64 {
            let s = c.status_of(id).await;
            assert_eq!(
                (s.term, s.leader_id),
                (term, leader),
                "(c) node {id} left term {term} under leader {leader} while nothing failed"
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // (d)
    let through = c.client_at(followers[0]);
    for txid in txids {
        let read = through.decision(txid).await.expect("decision read");
        assert_eq!(
            read,
            DecisionRead::Aborted,
            "(d) txid {txid} read back through node {}",
            followers[0]
        );
    }
}
