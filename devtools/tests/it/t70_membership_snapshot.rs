//! Membership and log compaction: snapshots build, the log is purged behind
//! them, a new node joins (as learner, then voter) and catches up by
//! installing a snapshot, and a node can be removed. Records stay intact.

use crate::common;

use std::time::Duration;

use common::TestCluster;
use dtx_proto::v1::admin_client::AdminClient;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t70_snapshot_purge_join_by_snapshot_and_remove() {
    let mut c = TestCluster::start_with("t70", 3, |cfg| {
        cfg.raft.snapshot_logs_since_last = 50;
        cfg.raft.logs_to_keep_after_snapshot = 5;
    });
    let leader = c.leader().await;
    let cl = c.client();
    let mut txids = Vec::new();
    for i in 0..150 {
        txids.push(cl.begin(&format!("s{i}"), 600_000, b"").await.unwrap().txid);
    }
    // Explicit snapshot on the leader as well.
    let ch = coordinator::raft::network::channel(&c.api(leader), None, Duration::from_secs(2)).unwrap();
    let snap = AdminClient::new(ch)
        .trigger_snapshot(dtx_proto::v1::TriggerSnapshotRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(snap.snapshot_index > 0);
    let mut st = c.status_of(leader).await;
    for _ in 0..50 {
        if st.purged_index > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        st = c.status_of(leader).await;
    }
    assert!(st.purged_index > 0, "log not purged behind the snapshot: {st:?}");
    let v_purged = st.purged_index;

    // A fourth node joins; the entries it needs are purged, so it must
    // install a snapshot.
    let (_node4, raft, api) = c.start_extra_node(4).await;

    let ch = coordinator::raft::network::channel(&c.api(leader), None, Duration::from_secs(2)).unwrap();
    let r = AdminClient::new(ch.clone())
        .add_node(dtx_proto::v1::AddNodeRequest {
            node_id: 4,
            raft_addr: raft,
            api_addr: api.clone(),
            voter: true,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.voters, vec![1, 2, 3, 4]);
    let mut s4 = dtx_client::cluster_status_at(&api, Duration::from_secs(2))
        .await
        .unwrap();
    for _ in 0..100 {
        if s4.snapshot_index >= v_purged && s4.role == "Follower" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        s4 = dtx_client::cluster_status_at(&api, Duration::from_secs(2))
            .await
            .unwrap();
    }
    assert!(
        s4.snapshot_index >= v_purged,
        "node 4 did not install a snapshot covering the purged log: {s4:?}"
    );
    assert_eq!(s4.transactions, txids.len() as u64);

    // Remove a follower; the cluster keeps working with the other three.
    let victim = (1..=3).find(|i| *i != leader).unwrap();
    let r = AdminClient::new(ch)
        .remove_node(dtx_proto::v1::RemoveNodeRequest { node_id: victim })
        .await;
    let r = match r {
        Ok(r) => r.into_inner(),
        Err(s) => panic!("remove failed: {s:?}"),
    };
    let remaining: Vec<u64> = [1, 2, 3, 4].into_iter().filter(|i| *i != victim).collect();
    assert_eq!(r.voters, remaining);
    c.procs.stop(victim, Duration::from_secs(5));
    let mut addrs: Vec<String> = (1..=3).filter(|i| *i != victim).map(|i| c.api(i)).collect();
    addrs.push(api.clone());
    let cl = dtx_client::Client::new(dtx_client::ClientConfig::new(addrs)).unwrap();
    let again = cl.begin("s7", 600_000, b"").await.unwrap();
    assert_eq!((again.txid, again.existing), (txids[7], true));
}
