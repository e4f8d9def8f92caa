//! Kill -9 the leader of three nodes while clients write (invariants 4 and 6
//! for the registry itself): a new leader serves within 2 s with default
//! settings, every acknowledged write is present afterwards, and the killed
//! node restarts, rejoins and catches up.

use crate::common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;
use std::time::Instant;

use common::TestCluster;
use dtx_client::ClientError;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t20_kill9_leader_while_writing_loses_no_acknowledged_write() {
    let mut c = TestCluster::start("t20");
    let leader = c.leader().await;
    let client = Arc::new(c.client());

    // Acknowledged Begins: key -> txid. Unknown outcomes are kept apart.
    let acked: Arc<Mutex<BTreeMap<String, u64>>> = Arc::default();
    let unknown: Arc<Mutex<Vec<String>>> = Arc::default();
    // (invoked, acknowledged) of every acknowledged write.
    let acked_times: Arc<Mutex<Vec<(Instant, Instant)>>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..8 {
        let (client, acked, unknown, acked_times, stop) = (
            client.clone(),
            acked.clone(),
            unknown.clone(),
            acked_times.clone(),
            stop.clone(),
        );
        writers.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let key = format!("w{w}-{i}");
                let invoked = Instant::now();
                match client.begin(&key, 600_000, b"").await {
                    Ok(b) => {
                        acked.lock().unwrap().insert(key, b.txid);
                        acked_times.lock().unwrap().push((invoked, Instant::now()));
                    }
                    Err(ClientError::Unknown(_) | ClientError::Unavailable(_) | ClientError::NotApplied(_)) => {
                        unknown.lock().unwrap().push(key)
                    }
                    Err(e) => panic!("unexpected definite failure for {key}: {e}"),
                }
                i += 1;
            }
        }));
    }

    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before_kill = acked.lock().unwrap().len();
    assert!(before_kill > 0, "no write was acknowledged before the kill");
    let killed_at = Instant::now();
    c.procs.kill9(leader);

    // A new leader among the survivors.
    let mut new_leader = None;
    while killed_at.elapsed() < Duration::from_secs(10) {
        if let Some(l) = c.procs.current_leader().await {
            if l != leader {
                new_leader = Some(l);
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elected_after = killed_at.elapsed();
    let new_leader = new_leader.expect("no new leader within 10 s");
    // First write invoked after the kill and acknowledged: the end of the
    // window in which the cluster could not serve.
    let mut served_after = None;
    while killed_at.elapsed() < Duration::from_secs(10) {
        let first = acked_times
            .lock()
            .unwrap()
            .iter()
            .filter(|(invoked, _)| *invoked > killed_at)
            .map(|(_, acked)| *acked)
            .min();
        if let Some(t) = first {
            served_after = Some(t.duration_since(killed_at));
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let served_after = served_after.expect("no write acknowledged after the kill");
    eprintln!("leader {leader} killed; node {new_leader} elected after {elected_after:?}; first write served after {served_after:?}");
    assert!(
        served_after < Duration::from_secs(2),
        "the new leader served its first write {served_after:?} after the kill (bound: 2 s)"
    );

    tokio::time::sleep(Duration::from_millis(1000)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }
    let acked = acked.lock().unwrap().clone();
    assert!(acked.len() > before_kill, "no progress after the failover");

    // Every acknowledged Begin is present, with the same txid.
    let mut all_txids: Vec<u64> = acked.values().copied().collect();
    all_txids.sort();
    for chunk in all_txids.chunks(1000) {
        let reads = client.decisions(chunk).await.expect("decision read");
        for (txid, d) in reads {
            assert_eq!(
                d,
                dtx_client::DecisionRead::Pending,
                "acknowledged transaction {txid} is missing"
            );
        }
    }
    for (key, txid) in acked.iter().step_by(7) {
        let again = client.begin(key, 600_000, b"").await.unwrap();
        assert_eq!((again.txid, again.existing), (*txid, true), "key {key}");
    }

    // The killed node restarts, rejoins and catches up.
    c.procs.start(leader).unwrap();
    let target = c.status_of(new_leader).await.last_applied_index;
    assert!(
        c.wait_applied(leader, target, Duration::from_secs(30)).await,
        "restarted node {leader} did not catch up to index {target}"
    );
    let leader_view = c.status_of(new_leader).await;
    let rejoined = c.status_of(leader).await;
    assert_eq!(rejoined.leader_id, new_leader, "restarted node follows the new leader");
    assert!(rejoined.transactions >= acked.len() as u64);
    assert_eq!(
        rejoined.transactions, leader_view.transactions,
        "restarted node holds the same transactions as the leader"
    );
    eprintln!(
        "acknowledged {} begins ({} with unknown outcome); all present",
        acked.len(),
        unknown.lock().unwrap().len()
    );
}
