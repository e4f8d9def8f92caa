//! Invariants 2 and 10 (ADR 0009): a READ_ONLY voter gets no phase two, and
//! no delivery outlives its transaction. Its ack used to wait for the ack
//! batch while delivery read the pending set at once, so it got a Commit
//! anyway; and a delivery task never re-read the record, so one that the
//! participant refused went on after the transaction was forgotten.

use crate::common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::participants::Svc;
use common::TestCluster;
use dtx_client::DecisionRead;
use dtx_client::ParticipantSpec;
use dtx_client::TxOutcome;
use participant_sdk::log::LocalState;
use participant_sdk::log::Vote;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t83_read_only_voter_receives_no_commit_and_nothing_after_forget() {
    let mut c = TestCluster::start_with("t83", 3, |cfg| {
        // A wide ack window made the race certain in the old code.
        cfg.txn.ack_batch_wait_ms = 200;
        cfg.txn.retention_ms = 300;
        cfg.txn.reaper_interval_ms = 100;
        cfg.txn.delivery_retry_max_ms = 200;
    });
    c.leader().await;
    let cl = c.client();
    let reader = Svc::new("reader").await;
    let writer = Svc::new("writer").await;
    // The reader refuses any phase-two message it gets, so a delivery to it
    // would be retried for as long as it runs.
    reader.hold_decisions.store(true, Ordering::SeqCst);
    let both = vec![
        ParticipantSpec {
            participant_id: reader.id.clone(),
            address: reader.addr.clone(),
            payload: b"ro".to_vec(),
        },
        ParticipantSpec {
            participant_id: writer.id.clone(),
            address: writer.addr.clone(),
            payload: b"w".to_vec(),
        },
    ];
    let r = cl.begin_and_commit("ro", 30_000, b"", &both).await.unwrap();
    assert_eq!(r.outcome, TxOutcome::Committed);
    let t = r.txid.unwrap();
    assert!(
        writer
            .wait_state(t, LocalState::Committed, Duration::from_secs(10))
            .await
    );
    // Acked by both (the reader with its vote), then forgotten.
    let mut forgotten = false;
    for _ in 0..100 {
        if cl.decision(t).await.unwrap() == DecisionRead::UnknownPresumedAbort {
            forgotten = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(forgotten, "never forgotten: {:?}", cl.status(t).await);
    let after_forget = reader.decisions_received.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let later = reader.decisions_received.load(Ordering::SeqCst);
    assert_eq!(reader.state(t), Some(LocalState::Prepared { vote: Vote::ReadOnly }));
    assert_eq!(
        (after_forget, later),
        (0, 0),
        "Commit/Abort calls that reached the READ_ONLY voter (at forget, 1 s later)"
    );
}
