//! kill -9 in a loop (docs/design.md#pinned-libraries: sled is old, so crash
//! tests must prove nothing acknowledged is lost). Clients keep writing
//! Begins and Decides while a seeded schedule SIGKILLs a node (often the
//! leader) and restarts it. At the end every acknowledged Begin maps to the
//! same txid and every decision a client was told is the recorded one
//! (invariants 1 and 4 for the registry). The seed is printed; set DTX_SEED
//! to replay a schedule.

use crate::common;

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use common::TestCluster;
use dtx_client::ClientError;
use dtx_client::DecisionRead;
use dtx_client::TxOutcome;
use rand::rngs::StdRng;
use rand::Rng;
use rand::SeedableRng;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t22_kill9_loop_loses_nothing_acknowledged() {
    let seed: u64 = std::env::var("DTX_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    eprintln!("t22 seed {seed} (DTX_SEED={seed} replays the kill schedule)");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut c = TestCluster::start("t22");
    c.leader().await;
    let client = Arc::new(c.client());

    let begun: Arc<Mutex<BTreeMap<String, u64>>> = Arc::default();
    let told: Arc<Mutex<BTreeMap<u64, TxOutcome>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..6 {
        let (client, begun, told, stop) = (client.clone(), begun.clone(), told.clone(), stop.clone());
        writers.push(tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let key = format!("c{w}-{i}");
                i += 1;
                let b = match client.begin(&key, 600_000, b"").await {
                    Ok(b) => b,
                    Err(ClientError::Unknown(_) | ClientError::Unavailable(_) | ClientError::NotApplied(_)) => continue,
                    Err(e) => panic!("definite failure on {key}: {e}"),
                };
                begun.lock().unwrap().insert(key, b.txid);
                // Half commit (no participants: decided at once), half abort.
                let o = if i.is_multiple_of(2) {
                    client.commit(b.txid).await
                } else {
                    client.abort(b.txid, "loop").await
                };
                match o {
                    Ok(TxOutcome::Unknown)
                    | Err(ClientError::Unknown(_) | ClientError::Unavailable(_) | ClientError::NotApplied(_)) => {}
                    Ok(o) => {
                        told.lock().unwrap().insert(b.txid, o);
                    }
                    Err(e) => panic!("definite failure deciding {}: {e}", b.txid),
                }
            }
        }));
    }

    for round in 0..6 {
        tokio::time::sleep(Duration::from_millis(rng.random_range(400..1000))).await;
        let victim = if rng.random_bool(0.5) {
            c.procs.current_leader().await.unwrap_or(1)
        } else {
            rng.random_range(1..=3)
        };
        eprintln!("round {round}: kill -9 node {victim}");
        c.procs.kill9(victim);
        tokio::time::sleep(Duration::from_millis(rng.random_range(200..700))).await;
        c.procs.start(victim).unwrap();
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }
    c.leader().await;

    let begun = begun.lock().unwrap().clone();
    let told = told.lock().unwrap().clone();
    assert!(begun.len() > 50, "too little traffic to mean anything: {}", begun.len());
    eprintln!("{} begins and {} decisions acknowledged", begun.len(), told.len());
    let check = c.client();
    for (key, txid) in &begun {
        let again = check.begin(key, 600_000, b"").await.expect("begin replay");
        assert_eq!(
            (again.txid, again.existing),
            (*txid, true),
            "acknowledged Begin {key} lost or changed"
        );
    }
    let txids: Vec<u64> = told.keys().copied().collect();
    for chunk in txids.chunks(1000) {
        for (t, d) in check.decisions(chunk).await.unwrap() {
            let want = match told[&t] {
                TxOutcome::Committed => DecisionRead::Committed,
                _ => DecisionRead::Aborted,
            };
            assert_eq!(
                d, want,
                "tx {t}: clients were told {:?}, the cluster says {d:?}",
                told[&t]
            );
        }
    }
}
