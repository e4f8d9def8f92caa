//! Phase one in groups (ADR 0014): the leader sends the Prepares for one
//! participant address in `PrepareMany` messages, many transactions per
//! message while one is in flight, and every transfer still ends applied at
//! both banks (invariants 2, 3 and 4) with the money neither made nor lost; a
//! participant whose SDK predates the message gets Prepare calls.

use crate::common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::bank_run::wait_all_acked;
use common::bank_run::BankRun;
use common::participants::Svc;
use common::TestCluster;
use dtx_client::TxOutcome;
use participant_sdk::log::LocalState;

/// 32 clients run two-bank BeginAndCommit transfers at once against real
/// node and bank processes: the leader's PrepareMany messages carry several
/// prepares each (`dtx_prepare_batch_items`: at least 1.25 per message on
/// average), every transaction ends acked,
/// and the stopped banks' stores show each COMMIT a client was told applied
/// once at both banks, no transaction committed at one and aborted at the
/// other, nothing locked or in doubt, and the total unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t87_prepares_travel_grouped_and_every_transfer_applies_at_both_banks() {
    let mut run = BankRun::transfers("t87a", 32, 10).await;
    // Grouped: the leader sent far fewer PrepareMany messages than
    // prepares.
    let (items, messages) = run.leader_histogram("dtx_prepare_batch_items").await;
    let transfers = run.told.len();
    eprintln!(
        "{transfers} transfers ({} committed): {items} prepares sent in {messages} PrepareMany messages",
        run.committed.len()
    );
    assert!(
        items >= 2.0 * transfers as f64,
        "every transfer is prepared at both banks: {items} items for {transfers} transfers"
    );
    // One call per prepare would be exactly one item per message; 1.6 to
    // 2.2 were measured here (the groups form only while a message is in
    // flight, so how big they get depends on the machine's speed).
    assert!(
        messages > 0.0 && items / messages >= 1.25,
        "prepares did not travel grouped: {items} items in {messages} messages"
    );
    run.audit_banks().await;
}

/// A participant whose SDK predates PrepareMany answers it UNIMPLEMENTED:
/// the leader remembers that for its address and sends it Prepare calls,
/// while the other participant of the same transactions keeps getting
/// PrepareMany; everything commits (and the NO vote aborts) at both, with
/// concurrent transactions too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t87_a_participant_without_prepare_many_gets_single_prepare_calls() {
    let mut c = TestCluster::start("t87b");
    c.leader().await;
    let cl = Arc::new(c.client());
    let old = Arc::new(Svc::new("old-sdk").await);
    old.old_sdk.store(true, Ordering::SeqCst);
    let new = Arc::new(Svc::new("new-sdk").await);
    let mut tasks = Vec::new();
    for i in 0..12 {
        let (cl, old, new) = (cl.clone(), old.clone(), new.clone());
        tasks.push(tokio::spawn(async move {
            let no = i == 5;
            let parts = vec![old.spec(b"x"), new.spec(if no { b"no" } else { b"y" })];
            let r = cl
                .begin_and_commit(&format!("t87b-{i}"), 30_000, b"", &parts)
                .await
                .unwrap();
            (no, r)
        }));
    }
    let mut txids = Vec::new();
    for t in tasks {
        let (no, r) = t.await.unwrap();
        let want = if no { TxOutcome::Aborted } else { TxOutcome::Committed };
        assert_eq!(r.outcome, want);
        let txid = r.txid.unwrap();
        let want = if no {
            LocalState::Aborted { tombstone: false }
        } else {
            LocalState::Committed
        };
        assert!(
            old.wait_state(txid, want, Duration::from_secs(10)).await,
            "old-sdk: {txid} {:?}",
            old.state(txid)
        );
        if !no {
            assert!(
                new.wait_state(txid, want, Duration::from_secs(10)).await,
                "new-sdk: {txid}"
            );
        }
        txids.push(txid);
    }
    let left = wait_all_acked(&cl, &txids, Duration::from_secs(10)).await;
    assert!(left.is_empty(), "not acked: {left:?}");
    assert_eq!(old.prepare_many_calls.load(Ordering::SeqCst), 0);
    assert!(
        old.prepares_received.load(Ordering::SeqCst) >= 12,
        "old-sdk got its prepares as single calls"
    );
    assert!(
        new.prepare_many_calls.load(Ordering::SeqCst) >= 1,
        "new-sdk keeps getting PrepareMany"
    );
    assert!(new.prepares_received.load(Ordering::SeqCst) >= 12);
}
