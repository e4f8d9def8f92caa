//! Node ids are never reused: once `admin remove-node` removed a node,
//! `admin add-node` with its id is refused with the reason, through the
//! leader or a follower, and still after every node restarted (the retired
//! ids are replicated state, persisted with the state machine). An id the
//! cluster never used is still accepted.

use crate::common;

use std::process::Output;
use std::time::Duration;

use common::node_ip;
use common::TestCluster;
use dtx_testkit::cluster::free_port;

fn admin(addr: &str, args: &[&str]) -> Output {
    std::process::Command::new(common::bin())
        .args(["admin", "--addr", addr])
        .args(args)
        .output()
        .expect("run coordinator admin")
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout: {}\nstderr: {}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn add_learner(addr: &str, id: u64) -> Output {
    let ip = node_ip(id);
    let raft = format!("{ip}:{}", free_port(&ip).unwrap());
    let api = format!("{ip}:{}", free_port(&ip).unwrap());
    admin(
        addr,
        &[
            "add-node",
            "--node-id",
            &id.to_string(),
            "--raft-addr",
            &raft,
            "--api-addr",
            &api,
            "--learner",
        ],
    )
}

fn assert_refused_as_reused(o: &Output, id: u64) {
    assert!(
        !o.status.success(),
        "add-node {id} of a removed id was accepted: {}",
        text(o)
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(&format!("node id {id} belonged to a node that was removed")) && err.contains("never reused"),
        "the refusal should name the id and the reason: {}",
        text(o)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t71_add_node_refuses_the_id_of_a_removed_node() {
    let mut c = TestCluster::start("t71");
    let leader = c.leader().await;
    let victim = (1..=3).find(|i| *i != leader).unwrap();
    let other = (1..=3).find(|i| *i != leader && *i != victim).unwrap();

    let o = admin(&c.api(leader), &["remove-node", "--node-id", &victim.to_string()]);
    assert!(o.status.success(), "remove-node: {}", text(&o));
    c.procs.stop(victim, Duration::from_secs(5));

    // Through the leader and through the remaining follower (forwarded).
    assert_refused_as_reused(&add_learner(&c.api(leader), victim), victim);
    assert_refused_as_reused(&add_learner(&c.api(other), victim), victim);
    // The membership is unchanged by the refusals.
    let st = c.status_of(leader).await;
    let members: Vec<u64> = st.members.iter().map(|m| m.node_id).collect();
    assert!(!members.contains(&victim), "{members:?}");

    // An id never used is accepted (as a learner: nothing runs there yet,
    // and a learner does not count for the quorum).
    let o = add_learner(&c.api(leader), 9);
    assert!(o.status.success(), "add-node 9: {}", text(&o));

    // Restart the two remaining nodes: the retired id is still known.
    c.procs.stop(leader, Duration::from_secs(5));
    c.procs.stop(other, Duration::from_secs(5));
    c.procs.start(leader).unwrap();
    c.procs.start(other).unwrap();
    let leader = c.leader().await;
    assert_refused_as_reused(&add_learner(&c.api(leader), victim), victim);
}
