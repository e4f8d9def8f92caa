//! A leader that restarts answers reads with every write acknowledged
//! before the restart (invariant 7, linearizable reads; invariant 4
//! as a client sees it: a COMMITTED transaction reads back COMMITTED).
//!
//! openraft 0.9 resumes the leadership of a node whose stored vote is a
//! committed vote for itself, at once, in the same term. Its read index
//! then came from the committed index it stored, which is not flushed on
//! every change and can be older than what it had acknowledged; the newer
//! entries are applied again only once a quorum holds them anew. A read in
//! that window missed them: t21 saw a COMMITTED transaction read back as
//! PREPARING, and a begun one as not found, on a loaded machine. A read
//! floor closed it first (ADR 0023); since ADR 0028 a restarted leader
//! stores its vote back as uncommitted and wins a new term instead, whose
//! blank entry openraft's read index covers. This test checks both the new
//! premise (a new term, the stored state behind the log) and the reads.
//!
//! Here the window is held open with two `failpoints` points, listed in a
//! file the test writes (`DTX_FAILPOINT_REFUSE`): `sm_batch_write`
//! (the state machine's pending writes are never due, so what the nodes
//! stored, the first half of the writes, lags what they acknowledged, as a
//! kill -9 can find it on a loaded machine) and `raft_accept_entries` (the one follower
//! left takes the leader's heartbeats, so reads are confirmed, but not its
//! entries, so nothing newer is committed) until the test removes the file.
//!
//! Run with `cargo test -p dtx-devtools --test it -- t23_restarted_leader_reads::`.

use crate::common;

use std::time::Duration;

use common::replicated;
use common::TestCluster;
use dtx_client::TxOutcome;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t23_a_restarted_leader_reads_every_acknowledged_write() {
    // Long election timeouts: the follower that refuses entries must not
    // call an election while the test holds the window open.
    let mut c = TestCluster::start_with("t23", 3, |cfg| {
        cfg.raft.election_timeout_min_ms = 4_000;
        cfg.raft.election_timeout_max_ms = 5_000;
    });
    c.procs.stop_all(Duration::from_secs(5));
    let refuse = c.dir.path().join("refuse");
    std::fs::write(&refuse, "").unwrap();
    c.procs.env = vec![("DTX_FAILPOINT_REFUSE".into(), refuse.display().to_string())];
    c.procs.start_all().unwrap();
    let leader = c.leader().await;
    let term = c.status_of(leader).await.term;
    let mut others = (1..=3).filter(|id| *id != leader);
    let (behind, gone) = (others.next().unwrap(), others.next().unwrap());

    // One follower stops before the writes: after the restart it holds
    // none of them.
    c.procs.kill9(behind);
    let client = c.client();
    let mut txids = Vec::new();
    for i in 0..20u64 {
        if i == 10 {
            // The first half stored (the state machine's writes are due
            // 100 ms after the oldest; the next apply hands them over),
            // with the committed index: past this term's first entry, so
            // openraft's read index is this stored index, not that entry.
            // The second half held back (the nodes re-read the file within
            // 50 ms).
            tokio::time::sleep(Duration::from_millis(150)).await;
            client.begin("due", 600_000, b"").await.unwrap();
            tokio::time::sleep(Duration::from_millis(100)).await;
            std::fs::write(&refuse, "sm_batch_write\n").unwrap();
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let b = client.begin(&format!("k{i}"), 600_000, b"").await.unwrap();
        txids.push(b.txid);
        if i % 2 == 0 {
            assert_eq!(client.commit(b.txid).await.unwrap(), TxOutcome::Committed);
        } else {
            client.enlist(b.txid, "bank-a", "127.0.0.1:9", b"x").await.unwrap();
        }
    }
    let mut before = Vec::new();
    for t in &txids {
        before.push(replicated(client.status(*t).await.unwrap()));
    }

    // kill -9 the two that hold the writes; restart the leader and the
    // follower without them (the third stays down).
    std::fs::write(&refuse, "sm_batch_write\nraft_accept_entries\n").unwrap();
    c.procs.kill9(leader);
    c.procs.kill9(gone);
    c.procs.start(behind).unwrap();
    c.procs.start(leader).unwrap();
    // The follower votes but takes no entry, so it never hears of the new
    // leader from one: ask the old leader itself. (The follower, whose log
    // is shorter, cannot win.)
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    let s = loop {
        if let Ok(s) = dtx_client::cluster_status_at(&c.api(leader), Duration::from_millis(500)).await {
            if s.role == "Leader" {
                break s;
            }
        }
        assert!(
            tokio::time::Instant::now() < until,
            "node {leader} did not lead again within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // The case under test: the old leader leads again, in a new term (it
    // does not resume term {term}, ADR 0028), and has applied less than
    // its log holds.
    assert!(
        s.term > term,
        "node {leader} resumed its old term {term} after a restart instead of winning a new one ({s:?})"
    );
    assert!(
        s.last_applied_index < s.last_log_index,
        "premise: node {leader} restarted with its stored state behind its log ({s:?})"
    );

    // Newest first. The first read waits until the log is committed and
    // applied again; the test lets entries through after 500 ms.
    let reader = c.client_at(leader);
    let newest = *txids.last().unwrap();
    let first = tokio::spawn(async move { reader.status(newest).await.map(replicated) });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !first.is_finished(),
        "a read was answered before the log it must include was committed again: {:?}",
        first.await
    );
    std::fs::remove_file(&refuse).unwrap();
    let first = first.await.unwrap();
    assert_eq!(
        first.as_ref().ok(),
        before.last(),
        "transaction {newest} read back differently after the leader's restart: {first:?}"
    );
    let client = c.client_at(leader);
    for (t, b) in txids.iter().zip(&before).rev() {
        let after = client.status(*t).await.map(replicated);
        assert_eq!(
            after.as_ref().ok(),
            Some(b),
            "transaction {t} read back differently after the leader's restart: {after:?}"
        );
    }
}
