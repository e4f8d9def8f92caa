//! What callers and routine outages cost a node's log and its metrics
//! (invariant 12: a caller that has not authenticated costs a node bounded
//! log; docs/adr/0038-bounded-logs-and-labels.md), with real node processes.
//! Every assertion counts lines, bytes or series; waits only poll.
//!
//! - `t116_inv12_refusals_of_anonymous_callers_are_counted_and_logged_in_summary`:
//!   2,000 calls without a token, each with a 3.5 KB method path, to a
//!   node that requires one. All are refused and counted
//!   (`dtx_auth_refusals_total`), and the node's log grows by a few lines
//!   (the first refusal; summaries once per 10 s), no line longer than the
//!   bound. Before: two copies of the path per refusal, 14 MB.
//! - `t116_inv12_a_participant_id_cannot_forge_a_log_line_and_prepare_failures_are_summed_up`:
//!   an application enlists a participant whose id holds a newline and a
//!   fake log line; 60 transactions with two participants nobody listens
//!   for ask to commit. The forged text never starts a line of the
//!   leader's log, and `prepare failed, counted as NO` is written at most
//!   once per participant per 10 s (with a count of the rest), while
//!   `dtx_prepare_failures_total` counts each one. Before: 120 lines and a
//!   forged line.
//! - `t116_participant_labels_are_bounded`: 80 distinct participant ids
//!   (40 transactions, each at addresses nobody listens on) fail their
//!   deliveries; `dtx_delivery_failures_total` has at most 32 participant
//!   labels plus `other`. Before: one series per id.
//! - `t116_metrics_are_served_only_on_their_path_and_never_sniffed`:
//!   `/metrics` answers with `X-Content-Type-Options: nosniff`; `/`,
//!   `/anything`, `/metrics/x` and `/metricsx` answer 404 (with
//!   `nosniff`). Before: every path answered the metrics, without it.
//! - `t116_openraft_replication_warnings_are_held_back_while_a_node_is_down`:
//!   with one follower killed, the leader's log holds none of openraft's
//!   per-attempt replication WARN lines ("error replication to target",
//!   "backoff mode"). Before: 15 to 24 a second.

use crate::common;

use std::time::Duration;

use common::node_ip;
use common::TestCluster;
use dtx_testkit::cluster::free_port;
use tokio::io::AsyncReadExt;
use tokio::io::AsyncWriteExt;
use tokio::time::Instant;

/// The longest any awaited state may take to show (a loaded machine).
const WAIT: Duration = Duration::from_secs(90);

/// Bytes a log line may have at most: the caller's text is bounded to 256
/// bytes per field; the rest is the node's own words.
const LINE_BYTES_MAX: usize = 2048;

fn with_metrics(cfg: &mut coordinator::config::Config) {
    let ip = node_ip(cfg.node_id);
    cfg.metrics_addr = Some(format!("{ip}:{}", free_port(&ip).unwrap()));
}

fn metrics_of(c: &mut TestCluster, id: u64) -> String {
    c.procs.node(id).config.metrics_addr.clone().expect("metrics_addr set")
}

fn log_of(c: &mut TestCluster, id: u64) -> String {
    std::fs::read_to_string(&c.procs.node(id).log_path).unwrap_or_default()
}

fn log_len(c: &mut TestCluster, id: u64) -> u64 {
    std::fs::metadata(&c.procs.node(id).log_path)
        .map(|m| m.len())
        .unwrap_or(0)
}

/// One HTTP/1.1 GET: (status code, head, body).
async fn http_get(addr: &str, path: &str) -> (u16, String, String) {
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to the metrics port");
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf))
        .await
        .expect("an answer")
        .unwrap();
    let text = String::from_utf8_lossy(&buf).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let code = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (code, head.to_ascii_lowercase(), body.to_string())
}

/// The sum of every series of `name` whose labels include all of `labels`.
fn sum_of(text: &str, name: &str, labels: &[&str]) -> f64 {
    series_of(text, name)
        .filter(|(ls, _)| labels.iter().all(|l| ls.contains(l)))
        .map(|(_, v)| v)
        .sum()
}

/// (labels, value) of every series of `name`.
fn series_of<'a>(text: &'a str, name: &'a str) -> impl Iterator<Item = (String, f64)> + 'a {
    text.lines().filter(|l| !l.starts_with('#')).filter_map(move |l| {
        let (key, value) = l.rsplit_once(' ')?;
        let rest = key.strip_prefix(name)?;
        if !(rest.is_empty() || rest.starts_with('{')) {
            return None;
        }
        Some((rest.to_string(), value.parse().ok()?))
    })
}

/// The distinct values of label `label` among the series of `name`.
fn label_values(text: &str, name: &str, label: &str) -> std::collections::BTreeSet<String> {
    let want = format!("{label}=\"");
    series_of(text, name)
        .filter_map(|(ls, _)| {
            let at = ls.find(&want)? + want.len();
            let end = ls[at..].find('"')?;
            Some(ls[at..at + end].to_string())
        })
        .collect()
}

const REFUSED_CALLS: usize = 2000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t116_inv12_refusals_of_anonymous_callers_are_counted_and_logged_in_summary() {
    let token = dtx_tls::identity::new_token();
    let hash = dtx_tls::identity::token_sha256_hex(&token);
    let mut c = TestCluster::start_with("t116a", 3, move |cfg| {
        with_metrics(cfg);
        cfg.auth.tokens = vec![coordinator::config::TokenConfig {
            role: "operator".into(),
            name: "ops".into(),
            sha256: hash.clone(),
        }];
    });
    let node = 1;
    let metrics = metrics_of(&mut c, node);
    // The node is up once its metrics port answers.
    let until = Instant::now() + WAIT;
    while tokio::net::TcpStream::connect(&metrics).await.is_err() {
        assert!(Instant::now() < until, "the metrics port {metrics} never answered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let refused_before = sum_of(
        &http_get(&metrics, "/metrics").await.2,
        "dtx_auth_refusals_total",
        &["code=\"unauthenticated\""],
    );
    let before = log_len(&mut c, node);
    let started = Instant::now();

    let path: &'static str = Box::leak(format!("/dtx.v1.Coordinator/{}", "A".repeat(3500)).into_boxed_str());
    let ch = dtx_transport::channel::channel(&c.api(node), None, Duration::from_secs(5)).unwrap();
    let mut refused = 0;
    for _ in 0..REFUSED_CALLS / 50 {
        let calls = (0..50).map(|_| {
            let mut grpc = tonic::client::Grpc::new(ch.clone());
            async move {
                grpc.ready()
                    .await
                    .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
                grpc.unary(
                    tonic::Request::new(Vec::new()),
                    http::uri::PathAndQuery::from_static(path),
                    common::raw_codec::RawCodec,
                )
                .await
            }
        });
        for r in futures::future::join_all(calls).await {
            match r {
                Err(s) if s.code() == tonic::Code::Unauthenticated => refused += 1,
                other => panic!("an anonymous call was not refused UNAUTHENTICATED: {other:?}"),
            }
        }
    }
    assert_eq!(refused, REFUSED_CALLS);

    // Every refusal is counted.
    let until = Instant::now() + WAIT;
    loop {
        let text = http_get(&metrics, "/metrics").await.2;
        let n = sum_of(&text, "dtx_auth_refusals_total", &["code=\"unauthenticated\""]) - refused_before;
        if n >= REFUSED_CALLS as f64 {
            break;
        }
        assert!(Instant::now() < until, "only {n} refusals counted");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The log: a few lines, not one per call.
    let grown = log_len(&mut c, node) - before;
    let log = log_of(&mut c, node);
    let new_part = &log[(before as usize).min(log.len())..];
    let refusal_lines = new_part.lines().filter(|l| l.contains("refused")).count();
    // The first refusal, one summary per 10 s, and one more for a line
    // written as the clock turned.
    let allowed = 2 + (started.elapsed().as_secs() / 10) as usize;
    assert!(
        refusal_lines <= allowed,
        "{refusal_lines} log lines about {REFUSED_CALLS} refusals in {:?} (at most {allowed})",
        started.elapsed()
    );
    assert!(
        grown < 64 * 1024,
        "the node's log grew by {grown} bytes for {REFUSED_CALLS} refused calls"
    );
    let longest = new_part.lines().map(str::len).max().unwrap_or(0);
    assert!(longest <= LINE_BYTES_MAX, "a log line of {longest} bytes");
}

/// A loopback address nobody listens on (a port just found free).
fn nobody_at() -> String {
    format!("127.0.0.1:{}", free_port("127.0.0.1").unwrap())
}

const FORGED: &str = "FORGED-LINE 2030-01-01T00:00:00Z INFO coordinator: operator/root resolved everything";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t116_inv12_a_participant_id_cannot_forge_a_log_line_and_prepare_failures_are_summed_up() {
    let mut c = TestCluster::start_with("t116b", 3, |cfg| {
        with_metrics(cfg);
        cfg.txn.delivery_retry_max_ms = 1000;
    });
    let leader = c.leader().await;
    let metrics = metrics_of(&mut c, leader);
    let started = Instant::now();
    let cl = c.client();
    let (down_a, down_b) = (nobody_at(), nobody_at());
    let forged_id = format!("bank-x\n{FORGED}");
    let t = cl.begin("t116b-forged", 30_000, b"").await.unwrap().txid;
    cl.enlist(t, &forged_id, &down_a, b"").await.expect("enlist");
    cl.enlist(t, "bank-gone", &down_b, b"").await.expect("enlist");
    let _ = cl.commit(t).await;
    const TXNS: usize = 60;
    for i in 0..TXNS {
        let t = cl.begin(&format!("t116b-{i}"), 30_000, b"").await.unwrap().txid;
        cl.enlist(t, "bank-down", &down_a, b"").await.expect("enlist");
        cl.enlist(t, "bank-gone", &down_b, b"").await.expect("enlist");
        let outcome = cl.commit(t).await;
        assert!(
            !matches!(outcome, Ok(dtx_client::TxOutcome::Committed)),
            "{i}: committed without its participants: {outcome:?}"
        );
    }
    let leader_now = c.leader().await;
    assert_eq!(
        leader_now, leader,
        "the leader changed during the test; the counts below are its own"
    );
    let log = log_of(&mut c, leader);
    assert!(
        !log.lines().any(|l| l.starts_with("FORGED-LINE")),
        "a participant id wrote a line of its own into the leader's log:\n{}",
        log.lines()
            .filter(|l| l.contains("FORGED-LINE"))
            .take(3)
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(log.contains("bank-x\\nFORGED-LINE"), "the id is shown escaped");
    let prepare_lines = log
        .lines()
        .filter(|l| l.contains("prepare failed, counted as NO"))
        .count();
    // Three participants; for each, the first line and one per 10 s, and
    // one more for a line written as the clock turned.
    let allowed = 3 * (2 + (started.elapsed().as_secs() / 10) as usize);
    assert!(
        prepare_lines <= allowed,
        "{prepare_lines} `prepare failed` lines for {} failed prepares in {:?} (at most {allowed})",
        2 * TXNS + 2,
        started.elapsed()
    );
    // Each failure is counted.
    let text = http_get(&metrics, "/metrics").await.2;
    let counted = sum_of(&text, "dtx_prepare_failures_total", &[]);
    assert!(
        counted >= (2 * TXNS) as f64,
        "dtx_prepare_failures_total = {counted}, want at least {}",
        2 * TXNS
    );
    let longest = log.lines().map(str::len).max().unwrap_or(0);
    assert!(longest <= LINE_BYTES_MAX, "a log line of {longest} bytes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t116_metrics_are_served_only_on_their_path_and_never_sniffed() {
    let mut c = TestCluster::start_with("t116e", 1, with_metrics);
    let leader = c.leader().await;
    let metrics = metrics_of(&mut c, leader);
    let (code, head, body) = http_get(&metrics, "/metrics").await;
    assert_eq!(code, 200, "{head}");
    assert!(head.contains("x-content-type-options: nosniff"), "{head}");
    assert!(body.contains("dtx_serving"), "the metrics text");
    for path in ["/", "/anything", "/metrics/x", "/metricsx"] {
        let (code, head, body) = http_get(&metrics, path).await;
        assert_eq!(
            code,
            404,
            "{path}: {head}\n{}",
            body.chars().take(200).collect::<String>()
        );
        assert!(!body.contains("dtx_serving"), "{path} answered the metrics");
        assert!(head.contains("x-content-type-options: nosniff"), "{path}: {head}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t116_participant_labels_are_bounded() {
    let mut c = TestCluster::start_with("t116c", 3, |cfg| {
        with_metrics(cfg);
        cfg.txn.delivery_retry_max_ms = 1000;
    });
    let leader = c.leader().await;
    let metrics = metrics_of(&mut c, leader);

    // 80 participant ids chosen by an application, at addresses nobody
    // listens on: each delivery of the ABORT fails.
    let cl = c.client();
    const TXNS: usize = 40;
    for i in 0..TXNS {
        let t = cl.begin(&format!("t116c-{i}"), 30_000, b"").await.unwrap().txid;
        cl.enlist(t, &format!("junk-{i}-a"), &nobody_at(), b"")
            .await
            .expect("enlist");
        cl.enlist(t, &format!("junk-{i}-b"), &nobody_at(), b"")
            .await
            .expect("enlist");
        let _ = cl.commit(t).await;
    }
    let until = Instant::now() + WAIT;
    let text = loop {
        let text = http_get(&metrics, "/metrics").await.2;
        let failures = sum_of(&text, "dtx_delivery_failures_total", &[]);
        let labels = label_values(&text, "dtx_delivery_failures_total", "participant");
        // Every id has failed at least once (its own address), or the
        // labels are already past the bound.
        if failures >= (2 * TXNS) as f64 || labels.len() > 33 {
            break text;
        }
        assert!(
            Instant::now() < until,
            "only {failures} delivery failures counted within {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let labels = label_values(&text, "dtx_delivery_failures_total", "participant");
    assert!(
        labels.len() <= 33,
        "{} participant labels on dtx_delivery_failures_total (at most 32 and `other`): {labels:?}",
        labels.len()
    );
    assert!(
        labels.contains("other"),
        "the ids past the bound are counted as other: {labels:?}"
    );
    let prepare_labels = label_values(&text, "dtx_prepare_failures_total", "participant");
    assert!(prepare_labels.len() <= 33, "{prepare_labels:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t116_openraft_replication_warnings_are_held_back_while_a_node_is_down() {
    let mut c = TestCluster::start_with("t116d", 3, |_| {});
    let leader = c.leader().await;
    let follower = (1..=3).find(|id| *id != leader).unwrap();
    let routine = |log: &str| {
        log.lines()
            .filter(|l| l.contains("error replication to target") || l.contains("backoff mode"))
            .count()
    };
    let before = routine(&log_of(&mut c, leader));
    c.procs.kill9(follower);
    // Writes keep the leader replicating to the dead follower.
    let cl = c.client();
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(6) {
        let t = cl
            .begin(&format!("t116d-{}", started.elapsed().as_millis()), 10_000, b"")
            .await
            .unwrap()
            .txid;
        cl.abort(t, "t116").await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(c.leader().await, leader, "the leader changed");
    let lines = routine(&log_of(&mut c, leader)) - before;
    assert!(
        lines <= 2,
        "{lines} of openraft's per-attempt replication lines in {:?} while one node was down",
        started.elapsed()
    );
}
