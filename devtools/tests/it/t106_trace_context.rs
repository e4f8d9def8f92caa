//! Tracing (ADR 0018): one W3C trace per transaction, carried from the client
//! through the nodes (a follower forwarding to the leader included) to the
//! participants in the `traceparent` metadata, and every node log line of the
//! transaction naming its txid.

use crate::common;

use std::time::Duration;

use common::participants::Svc;
use common::TestCluster;
use dtx_client::trace;
use dtx_client::trace::TraceContext;
use dtx_client::TxOutcome;
use dtx_testkit::cluster::ProcessCluster;
use participant_sdk::log::LocalState;

/// Three nodes whose logs are JSON lines (`--log-format json`).
fn json_cluster(name: &str) -> TestCluster {
    let dir = common::test_dir();
    let mut procs =
        ProcessCluster::new(common::bin(), dir.path(), name, common::local_plans(3), |_| {}).expect("cluster config");
    procs.env.push(("DTX_LOG_FORMAT".into(), "json".into()));
    procs.start_all().expect("start nodes");
    TestCluster {
        dir,
        procs,
        proxies: Vec::new(),
    }
}

/// The (method, parsed traceparent) of every call `svc` received that
/// carried one.
fn received(svc: &Svc) -> Vec<(String, dtx_proto::trace::TraceParent)> {
    svc.traceparents
        .lock()
        .unwrap()
        .iter()
        .map(|(m, v)| {
            let p = dtx_proto::trace::TraceParent::parse(v).unwrap_or_else(|| panic!("{m} carried a malformed {v:?}"));
            (m.clone(), p)
        })
        .collect()
}

/// `svc` got a prepare (Prepare or PrepareMany) and a commit (Commit or
/// ApplyDecisions) in trace `trace_id`, each with a parent span other than
/// `client_span` (the node's own span, not the client's).
fn assert_traced(svc: &Svc, trace_id: u128, client_span: u64) {
    let got = received(svc);
    for (kinds, what) in [
        (["Prepare", "PrepareMany"], "prepare"),
        (["Commit", "ApplyDecisions"], "commit"),
    ] {
        let hit = got
            .iter()
            .find(|(m, p)| kinds.contains(&m.as_str()) && p.trace_id == trace_id)
            .unwrap_or_else(|| panic!("{}: no {what} in trace {trace_id:032x}; received {got:?}", svc.id));
        assert_ne!(
            hit.1.parent_id, client_span,
            "{}: the node sends its own span as the parent",
            svc.id
        );
    }
}

/// The JSON log lines of node `id`.
fn log_lines(c: &TestCluster, id: u64) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(&c.procs.nodes[(id - 1) as usize].log_path).unwrap_or_default();
    text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

/// The txid a JSON log line names: its own field, or one of its spans'.
fn line_txids(line: &serde_json::Value) -> Vec<u64> {
    let mut out: Vec<u64> = line["fields"]["txid"].as_u64().into_iter().collect();
    if let Some(spans) = line["spans"].as_array() {
        out.extend(spans.iter().filter_map(|s| s["txid"].as_u64()));
    }
    out
}

/// The trace ids of a JSON log line's spans.
fn line_traces(line: &serde_json::Value) -> Vec<String> {
    line["spans"]
        .as_array()
        .map(|spans| {
            spans
                .iter()
                .filter_map(|s| s["trace_id"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// Checks the leader's log holds a line of transaction `txid` in trace
/// `trace_hex`, and that every line in that trace names the txid.
async fn assert_logged(c: &TestCluster, leader: u64, txid: u64, trace_hex: &str) {
    // Written by the node as it happens: wait for the line to be there.
    let mut lines = Vec::new();
    for _ in 0..100 {
        lines = log_lines(c, leader)
            .into_iter()
            .filter(|l| line_traces(l).iter().any(|t| t == trace_hex))
            .collect();
        if lines.iter().any(|l| line_txids(l).contains(&txid)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        !lines.is_empty(),
        "node {leader} logged no line in trace {trace_hex}; see {}",
        c.procs.nodes[(leader - 1) as usize].log_path.display()
    );
    for l in &lines {
        assert!(
            line_txids(l).contains(&txid),
            "a line of trace {trace_hex} without txid {txid}: {l}"
        );
    }
}

/// A transaction begun inside the application's trace (Begin in
/// `trace::scope`), then enlisted and committed outside it: the client
/// remembers the transaction's trace, and both participants' Prepare and
/// Commit (or the grouped PrepareMany / ApplyDecisions) carry its trace id,
/// with the leader's span as their parent; the leader's JSON log lines of
/// that trace all carry the txid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t106_a_clients_trace_reaches_the_participants_and_the_logs_name_the_txid() {
    let mut c = json_cluster("t106a");
    let leader = c.leader().await;
    let a = Svc::new("a").await;
    let b = Svc::new("b").await;
    let cl = c.client();
    // The W3C specification's example context, as an application would
    // hold it from its own caller.
    let app = TraceContext::from_traceparent(
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        Some("rojo=00f067aa0ba902b7"),
    )
    .unwrap();
    let began = trace::scope(app.clone(), cl.begin("t106a-1", 30_000, b"traced"))
        .await
        .unwrap();
    let txid = began.txid;
    assert_eq!(
        cl.trace_of(txid),
        Some(app.clone()),
        "the client keeps the transaction's trace"
    );
    cl.enlist(txid, &a.id, &a.addr, b"x").await.unwrap();
    cl.enlist(txid, &b.id, &b.addr, b"y").await.unwrap();
    assert_eq!(cl.commit(txid).await.unwrap(), TxOutcome::Committed);
    for svc in [&a, &b] {
        assert!(
            svc.wait_state(txid, LocalState::Committed, Duration::from_secs(20))
                .await,
            "{} did not commit {txid}",
            svc.id
        );
        assert_traced(svc, app.trace_id, app.span_id);
    }
    assert_logged(&c, leader, txid, &app.trace_id_hex()).await;
}

/// A transaction run entirely through a follower (Begin, Enlist, Commit):
/// the follower forwards each call with its own span as the parent, the
/// leader continues the same trace, and the participants' calls carry it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t106_the_trace_survives_a_follower_forwarding_to_the_leader() {
    let mut c = json_cluster("t106b");
    let leader = c.leader().await;
    let follower = (1..=3).find(|&id| id != leader).unwrap();
    let a = Svc::new("a").await;
    let b = Svc::new("b").await;
    let cl = c.client_at(follower);
    let app = TraceContext::from_traceparent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", None).unwrap();
    let txid = trace::scope(app.clone(), async {
        let txid = cl.begin("t106b-1", 30_000, b"traced").await.unwrap().txid;
        cl.enlist(txid, &a.id, &a.addr, b"x").await.unwrap();
        cl.enlist(txid, &b.id, &b.addr, b"y").await.unwrap();
        assert_eq!(cl.commit(txid).await.unwrap(), TxOutcome::Committed);
        txid
    })
    .await;
    for svc in [&a, &b] {
        assert!(
            svc.wait_state(txid, LocalState::Committed, Duration::from_secs(20))
                .await,
            "{} did not commit {txid}",
            svc.id
        );
        assert_traced(svc, app.trace_id, app.span_id);
    }
    // The leader served it as a forwarded request of that trace.
    let trace_hex = app.trace_id_hex();
    assert_logged(&c, leader, txid, &trace_hex).await;
    let forwarded = log_lines(&c, leader).into_iter().any(|l| {
        l["spans"].as_array().is_some_and(|spans| {
            spans.iter().any(|s| {
                s["name"] == "request" && s["forwarded"] == true && s["trace_id"].as_str() == Some(trace_hex.as_str())
            })
        })
    });
    assert!(
        forwarded,
        "no line of the leader's forwarded request span in trace {trace_hex}"
    );

    // A BeginAndCommit through the follower is forwarded too (the one-write
    // path used to answer "no leader" without the leader's address, so a
    // client knowing only this follower retried until its deadline).
    let spec = |s: &Svc| dtx_client::ParticipantSpec {
        participant_id: s.id.clone(),
        address: s.addr.clone(),
        payload: b"z".to_vec(),
    };
    let r = cl
        .begin_and_commit("t106b-2", 30_000, b"one write", &[spec(&a), spec(&b)])
        .await
        .unwrap();
    assert_eq!(r.outcome, TxOutcome::Committed, "{r:?}");
}
