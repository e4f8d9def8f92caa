//! Many clients race conflicting Decides on the same transactions
//! (invariant 1): exactly one decision per transaction; every racer is told
//! that same decision; every node reads it identically, both through the API
//! (linearizable reads) and from its own data directory after the run.
//!
//! The transactions are PREPARING with a durable YES from both participants
//! (p2's votes are recorded but its replies are slow), so an operator's
//! COMMIT is allowed (invariant 2 binds operators: the leader asks every
//! participant first) and races the clients' ABORTs and the driver's own
//! decision.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::participants::Svc;
use common::TestCluster;
use dtx_client::DecisionRead;
use dtx_client::TxOutcome;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t30_conflicting_decides_yield_exactly_one_decision() {
    let mut c = TestCluster::start_with("t30", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 30_000;
    });
    c.leader().await;
    let setup = c.client();
    let p1 = Svc::new("p1").await;
    let p2 = Svc::new("p2").await;
    p2.prepare_reply_delay_ms
        .store(8_000, std::sync::atomic::Ordering::SeqCst);
    // One Prepare call per transaction (no PrepareMany), so every one of
    // the 20 votes is durable while its reply is held: a PrepareMany whose
    // reply is held would hold the next prepares to p2 back in the leader's
    // queue until it is answered (one message in flight per address).
    p2.old_sdk.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut txids = Vec::new();
    let mut drivers = Vec::new();
    for i in 0..20 {
        let b = setup.begin(&format!("race-{i}"), 600_000, b"").await.unwrap();
        setup.enlist(b.txid, &p1.id, &p1.addr, b"x").await.unwrap();
        setup.enlist(b.txid, &p2.id, &p2.addr, b"y").await.unwrap();
        txids.push(b.txid);
        let client = c.client();
        let t = b.txid;
        drivers.push(tokio::spawn(async move { (t, client.commit(t).await) }));
    }
    // Both participants hold a durable YES for every transaction.
    for &t in &txids {
        let mut voted = false;
        for _ in 0..200 {
            if p1.state(t).is_some() && p2.state(t).is_some() {
                voted = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(voted, "tx {t}: the participants never prepared");
    }

    // 24 racers, each bound to one node (so followers forward), alternating
    // COMMIT (operator resolve with the full voter set) and ABORT.
    let mut racers = Vec::new();
    for r in 0..24u64 {
        let client = Arc::new(c.client_at(r % 3 + 1));
        let txids = txids.clone();
        racers.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            // Each racer starts at another transaction, so COMMITs and ABORTs
            // really meet on every one of them.
            let n = txids.len();
            for &t in txids.iter().cycle().skip((r as usize * 7) % n).take(n) {
                let o = if r % 2 == 0 {
                    client
                        .resolve(t, true, &["p1".into(), "p2".into()], &format!("racer{r}"), "race")
                        .await
                        .map(|(o, _)| o)
                } else {
                    client.abort(t, &format!("racer{r}")).await
                };
                seen.push((t, o.expect("decide answered")));
            }
            seen
        }));
    }
    let mut answers: std::collections::BTreeMap<u64, Vec<TxOutcome>> = Default::default();
    for r in racers {
        for (t, o) in r.await.unwrap() {
            answers.entry(t).or_default().push(o);
        }
    }
    // The drivers' own Commit calls are told the same decision.
    for d in drivers {
        let (t, o) = d.await.unwrap();
        answers.entry(t).or_default().push(o.expect("commit answered"));
    }
    let mut decided = std::collections::BTreeMap::new();
    for (t, outs) in &answers {
        assert!(
            outs.iter().all(|o| *o != TxOutcome::Unknown),
            "tx {t}: an unknown answer on a healthy cluster"
        );
        assert!(
            outs.windows(2).all(|w| w[0] == w[1]),
            "tx {t}: racers were told different decisions: {outs:?}"
        );
        decided.insert(*t, outs[0]);
    }
    let commits = decided.values().filter(|o| **o == TxOutcome::Committed).count();
    eprintln!(
        "{} transactions: {commits} committed, {} aborted",
        decided.len(),
        decided.len() - commits
    );

    // Linearizable reads through every node agree with what racers were told.
    for id in 1..=3 {
        let reads = c.client_at(id).decisions(&txids).await.unwrap();
        for (t, d) in reads {
            let want = match decided[&t] {
                TxOutcome::Committed => DecisionRead::Committed,
                _ => DecisionRead::Aborted,
            };
            assert_eq!(d, want, "node {id} reads tx {t} differently");
        }
    }

    // Each node's own replica: wait until all applied the same index, stop
    // them, and read the data directories.
    let leader = c.leader().await;
    let target = c.status_of(leader).await.last_applied_index;
    for id in 1..=3 {
        assert!(c.wait_applied(id, target, Duration::from_secs(10)).await);
    }
    c.procs.stop_all(Duration::from_secs(10));
    for id in 1..=3 {
        let v = c.inspect(id);
        for rec in v["transactions"].as_array().unwrap() {
            let t = rec["txid"].as_u64().unwrap();
            if let Some(want) = decided.get(&t) {
                let want = match want {
                    TxOutcome::Committed => "COMMIT",
                    _ => "ABORT",
                };
                assert_eq!(
                    rec["decision"]["outcome"].as_str(),
                    Some(want),
                    "node {id} replica of tx {t}"
                );
            }
        }
        let n = v["transactions"].as_array().unwrap().len();
        assert_eq!(n, txids.len(), "node {id} holds {n} records");
    }
}
