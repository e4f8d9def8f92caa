//! Stop all three nodes (kill -9, no flush on the way out) and restart them:
//! every transaction record is intact (invariant 4 for the registry;
//! invariant 10: txids are not reused after the restart).

use crate::common;

use std::time::Duration;

use common::replicated;
use common::TestCluster;
use dtx_client::TxOutcome;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t21_kill_all_and_restart_keeps_every_record() {
    let mut c = TestCluster::start("t21");
    c.leader().await;
    let client = c.client();

    let mut txids = Vec::new();
    for i in 0..60u64 {
        let b = client
            .begin(&format!("k{i}"), 600_000, format!("d{i}").as_bytes())
            .await
            .unwrap();
        txids.push(b.txid);
        match i % 5 {
            0 => {}
            1 => {
                client.enlist(b.txid, "bank-a", "127.0.0.1:9", b"x").await.unwrap();
                client.enlist(b.txid, "bank-b", "127.0.0.1:9", b"y").await.unwrap();
            }
            2 => assert_eq!(client.abort(b.txid, "test").await.unwrap(), TxOutcome::Aborted),
            3 => {
                // Decided with participants that never ack (nothing
                // listens there): the driver's ABORT, with its note. (Two,
                // so it is not a one-phase commit, which nobody but its
                // participant could decide.)
                client.enlist(b.txid, "bank-a", "127.0.0.1:9", b"").await.unwrap();
                client.enlist(b.txid, "bank-b", "127.0.0.1:9", b"").await.unwrap();
                assert_eq!(client.commit(b.txid).await.unwrap(), TxOutcome::Aborted);
            }
            _ => assert_eq!(client.commit(b.txid).await.unwrap(), TxOutcome::Committed),
        }
    }
    let mut before = Vec::new();
    for t in &txids {
        before.push(replicated(client.status(*t).await.unwrap()));
    }

    for id in 1..=3 {
        c.procs.kill9(id);
    }
    c.procs.start_all().unwrap();
    c.leader().await;
    let client = c.client();
    for (t, b) in txids.iter().zip(&before) {
        let after = replicated(client.status(*t).await.unwrap());
        assert_eq!(&after, b, "record of transaction {t} changed across the restart");
    }
    // The id counter survived too: a new Begin gets a larger txid.
    let next = client.begin("after-restart", 0, b"").await.unwrap();
    assert!(next.txid > *txids.iter().max().unwrap());
    // And an old key still maps to its transaction.
    let again = client.begin("k5", 600_000, b"d5").await.unwrap();
    assert_eq!((again.txid, again.existing), (txids[5], true));

    // A graceful stop (SIGTERM) exits 0 and loses nothing either.
    let leader = c.leader().await;
    let st = c.procs.stop(leader, Duration::from_secs(10));
    assert!(
        st.map(|s| s.success()).unwrap_or(false),
        "SIGTERM did not stop node {leader} cleanly: {st:?}"
    );
    c.procs.start(leader).unwrap();
    c.leader().await;
    assert_eq!(replicated(c.client().status(txids[3]).await.unwrap()), before[3]);
}
