//! A node cut off from the quorum does not campaign, so its term does not
//! climb, and when it comes back it does not depose the leader
//! (docs/adr/0008-disruptive-rejoins.md). openraft 0.9 has no pre-vote: a
//! returning node with a higher term answers the leader's AppendEntries with
//! that term, the leader adopts it and steps down, and the cluster cannot
//! write until a new election ends. The quorum probe
//! (`raft.quorum_probe_interval_ms`) switches a node's elections off while it
//! cannot reach a quorum of voters.
//!
//! Partitions are made by the test proxies (both directions, from outside
//! the nodes). The bound asserted is derived from the configured timeouts:
//! a follower's first election comes no sooner than
//! `election_timeout_max_ms` (openraft's leader lease) +
//! `election_timeout_min_ms` = 800 ms after the last heartbeat, while the
//! probe switches elections off within one probe interval plus one probe
//! timeout (100 + 200 ms), so a cut-off follower never campaigns: its term
//! must not move at all. Related to invariant 6 (the cluster keeps
//! serving with one node cut off; healing it must not cost an election).

use crate::common;

use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

use common::TestCluster;

/// The longest time, in ms, between two successful writes while `run` is
/// set, and how many writes succeeded: a client writing one transaction
/// after another, as an application would.
fn start_writer(c: &TestCluster, run: Arc<AtomicBool>) -> tokio::task::JoinHandle<(u64, u64, Vec<Instant>)> {
    let mut cfg = dtx_client::ClientConfig::new(c.procs.api_addrs());
    cfg.call_deadline = Duration::from_secs(2);
    let cl = dtx_client::Client::new(cfg).unwrap();
    tokio::spawn(async move {
        let mut ok = Vec::new();
        let mut i = 0u64;
        while run.load(Ordering::SeqCst) {
            i += 1;
            if cl.begin(&format!("w{i}"), 600_000, b"").await.is_ok() {
                ok.push(Instant::now());
            }
        }
        let gap = ok
            .windows(2)
            .map(|w| (w[1] - w[0]).as_millis() as u64)
            .max()
            .unwrap_or(0);
        (gap, ok.len() as u64, ok)
    })
}

async fn term_of(c: &TestCluster, id: u64) -> u64 {
    c.status_of(id).await.term
}

/// Samples `id`'s term every 250 ms for `d`; returns (first, last).
async fn watch_term(c: &TestCluster, id: u64, d: Duration) -> (u64, u64) {
    let first = term_of(c, id).await;
    let until = Instant::now() + d;
    let mut last = first;
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(250)).await;
        last = term_of(c, id).await;
    }
    (first, last)
}

async fn wait_caught_up(c: &TestCluster, id: u64, leader: u64) {
    let target = c.status_of(leader).await.last_applied_index;
    assert!(
        c.wait_applied(id, target, Duration::from_secs(20)).await,
        "node {id} did not catch up to index {target} after the heal"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t72_cut_off_follower_keeps_its_term_and_rejoins_without_an_election() {
    let mut c = TestCluster::start_partitionable("t72a", |_| {}).await;
    let leader = c.leader().await;
    let follower = (1..=3).find(|i| *i != leader).unwrap();
    let term = term_of(&c, leader).await;
    assert_eq!(term_of(&c, follower).await, term);

    // Ten election timeouts (500 ms max each) cut off, while the majority
    // keeps writing, so the follower's log falls behind too.
    c.isolate(follower);
    let run = Arc::new(AtomicBool::new(true));
    let writer = start_writer(&c, run.clone());
    let (_, cut_off_term) = watch_term(&c, follower, Duration::from_millis(5_000)).await;
    c.heal();
    wait_caught_up(&c, follower, leader).await;
    // A few more election timeouts for any campaign to play out.
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    run.store(false, Ordering::SeqCst);
    let (_, writes, _) = writer.await.unwrap();
    assert!(writes > 0, "no write succeeded");

    let st = c.status_of(leader).await;
    let fs = c.status_of(follower).await;
    if cut_off_term != term || st.term != term || st.role != "Leader" {
        c.dump_logs();
    }
    assert_eq!(
        cut_off_term, term,
        "the cut-off follower {follower} campaigned: its term went from {term} to {cut_off_term}"
    );
    assert_eq!(
        (st.role.as_str(), st.leader_id, st.term),
        ("Leader", leader, term),
        "the rejoining follower {follower} disturbed leader {leader} (term {term} -> {})",
        st.term
    );
    assert_eq!(
        (fs.leader_id, fs.term),
        (leader, term),
        "follower's view after the heal"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t72_lone_survivor_keeps_its_term_and_the_cluster_recovers() {
    let mut c = TestCluster::start_partitionable("t72b", |_| {}).await;
    let leader = c.leader().await;
    let term = term_of(&c, leader).await;
    let survivor = (1..=3).find(|i| *i != leader).unwrap();
    let others: Vec<u64> = (1..=3).filter(|i| *i != survivor).collect();
    for id in &others {
        c.procs.kill9(*id);
    }
    let (_, lone_term) = watch_term(&c, survivor, Duration::from_millis(5_000)).await;
    assert_eq!(
        lone_term, term,
        "the lone survivor {survivor} campaigned: its term went from {term} to {lone_term}"
    );
    // Elections come back with the quorum: the cluster elects a leader
    // and writes again.
    for id in &others {
        c.procs.start(*id).unwrap();
    }
    c.leader().await;
    c.client().begin("after", 60_000, b"").await.unwrap();
}

/// The measurement behind docs/adr/0008-disruptive-rejoins.md (run by hand:
/// `cargo test -p dtx-devtools --test it -- t72_isolated_node_rejoins_quietly::
/// --ignored --nocapture`; `DTX_T72_PROBE_MS=0` measures without the probe).
/// Prints numbers, asserts nothing about them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn t72_measure_cut_off_and_lone_survivor() {
    let probe_ms: Option<u64> = std::env::var("DTX_T72_PROBE_MS").ok().map(|v| v.parse().unwrap());
    let secs: u64 = std::env::var("DTX_T72_SECS").map(|v| v.parse().unwrap()).unwrap_or(30);
    let tune = move |cfg: &mut coordinator::config::Config| {
        if let Some(ms) = probe_ms {
            cfg.raft.quorum_probe_interval_ms = ms;
        }
    };
    let rounds: u64 = std::env::var("DTX_T72_ROUNDS").map(|v| v.parse().unwrap()).unwrap_or(1);
    for round in 0..rounds {
        // A cut-off follower, then the heal.
        let mut c = TestCluster::start_partitionable(&format!("t72m{round}"), tune).await;
        let leader = c.leader().await;
        let follower = (1..=3).find(|i| *i != leader).unwrap();
        let run = Arc::new(AtomicBool::new(true));
        let writer = start_writer(&c, run.clone());
        tokio::time::sleep(Duration::from_secs(2)).await;
        c.isolate(follower);
        let (t0, t1) = watch_term(&c, follower, Duration::from_secs(secs)).await;
        let heal_at = Instant::now();
        c.heal();
        tokio::time::sleep(Duration::from_secs(10)).await;
        run.store(false, Ordering::SeqCst);
        let (_, writes, ok) = writer.await.unwrap();
        // The longest stretch without a successful write from 1 s before
        // the heal to 10 s after it.
        let from = heal_at - Duration::from_secs(1);
        let near: Vec<Instant> = ok.into_iter().filter(|t| *t >= from).collect();
        let mut gap = near.first().map(|t| (*t - from).as_millis() as u64).unwrap_or(11_000);
        for w in near.windows(2) {
            gap = gap.max((w[1] - w[0]).as_millis() as u64);
        }
        let after = c.leader().await;
        let lt = term_of(&c, after).await;
        println!(
            "MEASURE round {round} probe_ms={probe_ms:?}: cut-off follower {follower}: term {t0} -> {t1} in {secs} s \
             = {:.0} terms/min; after heal: leader {leader} -> {after}, leader term -> {lt}; longest write gap around \
             the heal {gap} ms; {writes} writes",
            (t1 - t0) as f64 * 60.0 / secs as f64
        );
        drop(c);

        // A lone survivor.
        let mut c = TestCluster::start_partitionable(&format!("t72n{round}"), tune).await;
        let leader = c.leader().await;
        let survivor = (1..=3).find(|i| *i != leader).unwrap();
        for id in (1..=3).filter(|i| *i != survivor) {
            c.procs.kill9(id);
        }
        let (t0, t1) = watch_term(&c, survivor, Duration::from_secs(secs)).await;
        let back = Instant::now();
        for id in (1..=3).filter(|i| *i != survivor) {
            c.procs.start(id).unwrap();
        }
        let l = c.leader().await;
        println!(
            "MEASURE round {round} probe_ms={probe_ms:?}: lone survivor {survivor}: term {t0} -> {t1} in {secs} s \
             = {:.0} terms/min; leader {l} {} ms after the others were started again",
            (t1 - t0) as f64 * 60.0 / secs as f64,
            back.elapsed().as_millis()
        );
    }
}
