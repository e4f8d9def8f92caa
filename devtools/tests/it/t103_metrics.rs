//! Metrics an operator can aggregate and alert on, on a real three-node
//! cluster and two real `bank-serve` processes with `--metrics-addr`: a
//! scrape of the leader's `/metrics` shows the in-doubt gauges rising while a
//! participant is down and falling back to 0 after it returns; the bank's own
//! in-doubt gauge does the same; HELP lines are there, histograms come with
//! `_bucket{..le=..}` series (so they add up across nodes), API methods are
//! labelled with the gRPC method, and delivery failures with the participant
//! (never a txid).
//!
//! The run: bank-a is paused (SIGSTOP) and a transaction enlisting bank-a
//! and bank-b asks to commit: bank-b votes YES and waits in doubt, bank-a
//! never answers, the transaction stays PREPARING. The test then aborts
//! it (a client Abort) and kills bank-a (kill -9): the ABORT reaches
//! bank-b, not bank-a, so the transaction is decided and undelivered.
//! bank-a is started again on its data directory and the ABORT reaches it.
//! Every wait only polls, within generous bounds; none times anything.

use crate::common;

use std::time::Duration;

use common::bank_run::scrape;
use common::node_ip;
use common::TestCluster;
use dtx_client::TxOutcome;
use dtx_testkit::cluster::free_port;
use dtx_testkit::cluster::BankProcess;
use tokio::time::Instant;

/// The longest any one state may take to show (a loaded machine).
const WAIT: Duration = Duration::from_secs(60);

/// The value of the series `name` whose labels include every `labels` pair
/// (`key="value"`), if the text has it.
fn series(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (key, value) = l.rsplit_once(' ')?;
        let rest = key.strip_prefix(name)?;
        let matches = match rest.strip_prefix('{') {
            Some(ls) => labels
                .iter()
                .all(|want| ls.split(',').any(|have| have.trim_end_matches('}') == *want)),
            None => rest.is_empty() && labels.is_empty(),
        };
        matches.then(|| value.parse().ok()).flatten()
    })
}

/// The metrics address of node `id`.
fn metrics_of(c: &mut TestCluster, id: u64) -> String {
    c.procs.node(id).config.metrics_addr.clone().expect("metrics_addr set")
}

/// The current leader's metrics text.
async fn leader_text(c: &mut TestCluster) -> String {
    let leader = c.leader().await;
    scrape(&metrics_of(c, leader)).await
}

/// Polls the leader's metrics until `ok` holds; panics with the last
/// scrape after `WAIT`.
async fn until_leader(c: &mut TestCluster, what: &str, ok: impl Fn(&str) -> bool) -> String {
    let until = Instant::now() + WAIT;
    loop {
        let text = leader_text(c).await;
        if ok(&text) {
            return text;
        }
        if Instant::now() > until {
            c.dump_logs();
            panic!("leader metrics: never {what} within {WAIT:?}; last scrape:\n{text}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Polls a bank's metrics endpoint until `ok` holds.
async fn until_bank(addr: &str, what: &str, ok: impl Fn(&str) -> bool) -> String {
    let until = Instant::now() + WAIT;
    loop {
        let text = scrape(addr).await;
        if ok(&text) {
            return text;
        }
        assert!(
            Instant::now() <= until,
            "bank metrics at {addr}: never {what} within {WAIT:?}; last scrape:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Polls until a gauge read by `get` is above 0 in one scrape and higher in
/// a later one (the age keeps growing while the state lasts).
async fn until_rising(
    c: &mut TestCluster,
    what: &str,
    get: impl Fn(&str) -> Option<f64>,
    also: impl Fn(&str) -> bool,
) -> (f64, f64) {
    let first = until_leader(c, &format!("{what} > 0"), |t| {
        get(t).is_some_and(|v| v > 0.0) && also(t)
    })
    .await;
    let a = get(&first).unwrap();
    let later = until_leader(c, &format!("{what} above {a}"), |t| {
        get(t).is_some_and(|v| v > a) && also(t)
    })
    .await;
    (a, get(&later).unwrap())
}

fn start_bank(c: &TestCluster, id: &str, prefix: &str) -> (BankProcess, String) {
    let metrics = format!("127.0.0.1:{}", free_port("127.0.0.1").unwrap());
    let m = metrics.clone();
    let bank = dtx_testkit::cluster::start_bank_with(
        common::bin(),
        c.dir.path(),
        id,
        prefix,
        &c.procs.api_addrs(),
        10,
        1_000,
        move |_| vec!["--metrics-addr".to_string(), m],
    )
    .unwrap();
    (bank, metrics)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t103_in_doubt_gauges_rise_while_a_participant_is_down_and_fall_after() {
    let mut c = TestCluster::start_with("t103", 3, |cfg| {
        let ip = node_ip(cfg.node_id);
        cfg.metrics_addr = Some(format!("{ip}:{}", free_port(&ip).unwrap()));
        // The prepare to the paused bank waits far beyond the test: only
        // the test's Abort ends the PREPARING phase.
        cfg.txn.prepare_timeout_ms = 120_000;
        cfg.txn.delivery_retry_max_ms = 500;
    });
    c.leader().await;
    let (mut bank_a, metrics_a) = start_bank(&c, "bank-a", "a");
    let (bank_b, metrics_b) = start_bank(&c, "bank-b", "b");
    bank_a.wait_started().await.unwrap();
    bank_b.wait_started().await.unwrap();
    dtx_testkit::cluster::wait_listening(&metrics_b, WAIT).await;

    // bank-a down (paused: it accepts connections and answers nothing);
    // bank-b votes YES and waits.
    bank_a.signal(libc::SIGSTOP);
    let cl = c.client();
    let txid = cl.begin("t103-1", 300_000, b"t103").await.unwrap().txid;
    cl.enlist(txid, "bank-a", &bank_a.addr, b"a0:-10").await.unwrap();
    cl.enlist(txid, "bank-b", &bank_b.addr, b"b0:10").await.unwrap();
    let commit = tokio::spawn({
        let cl = c.client();
        async move { cl.commit(txid).await }
    });

    // The coordinator: one transaction PREPARING, in doubt, growing older.
    let (a, b) = until_rising(
        &mut c,
        "dtx_oldest_in_doubt_age_seconds",
        |t| series(t, "dtx_oldest_in_doubt_age_seconds", &[]),
        |t| series(t, "dtx_preparing_transactions", &[]).is_some_and(|v| v >= 1.0),
    )
    .await;
    eprintln!("PREPARING with bank-a paused: oldest in-doubt age {a} s, then {b} s");
    // bank-b: in doubt, growing older, seen by its own metrics.
    let b_id = r#"participant="bank-b""#;
    let first = until_bank(&metrics_b, "bank-b in doubt", |t| {
        series(t, "dtx_participant_in_doubt", &[b_id]).is_some_and(|v| v >= 1.0)
            && series(t, "dtx_participant_oldest_in_doubt_age_seconds", &[b_id]).is_some_and(|v| v > 0.0)
    })
    .await;
    let age = series(&first, "dtx_participant_oldest_in_doubt_age_seconds", &[b_id]).unwrap();
    until_bank(&metrics_b, "bank-b's in-doubt age rising", |t| {
        series(t, "dtx_participant_oldest_in_doubt_age_seconds", &[b_id]).is_some_and(|v| v > age)
    })
    .await;
    // Its recovery asks the cluster, which has no decision yet.
    let text = until_bank(&metrics_b, "a pending recovery look-up at bank-b", |t| {
        series(t, "dtx_participant_recovery_lookups_total", &[r#"outcome="pending""#]).is_some_and(|v| v >= 1.0)
    })
    .await;
    for help in [
        "# HELP dtx_participant_in_doubt ",
        "# HELP dtx_participant_oldest_in_doubt_age_seconds ",
        "# HELP dtx_participant_recovery_lookups_total ",
    ] {
        assert!(text.contains(help), "{help:?} missing from bank-b's metrics:\n{text}");
    }

    // Decided while bank-a is down: ABORT (the client's), bank-a killed.
    assert_eq!(
        cl.abort(txid, "t103: bank-a is down").await.unwrap(),
        TxOutcome::Aborted
    );
    bank_a.kill9();
    let (a, b) = until_rising(
        &mut c,
        "dtx_oldest_undelivered_age_seconds",
        |t| series(t, "dtx_oldest_undelivered_age_seconds", &[]),
        |t| {
            series(t, "dtx_undelivered_transactions", &[]).is_some_and(|v| v >= 1.0)
                && series(t, "dtx_oldest_in_doubt_age_seconds", &[]).is_some_and(|v| v > 0.0)
        },
    )
    .await;
    eprintln!("decided, bank-a down: oldest undelivered age {a} s, then {b} s");
    // Delivery failures counted by participant (the id as enlisted).
    let text = until_leader(&mut c, "a delivery failure counted for bank-a", |t| {
        series(
            t,
            "dtx_delivery_failures_total",
            &[r#"kind="no_answer""#, r#"participant="bank-a""#],
        )
        .is_some_and(|v| v >= 1.0)
    })
    .await;
    // bank-b got its ABORT: nothing in doubt there any more.
    until_bank(&metrics_b, "bank-b out of doubt", |t| {
        series(t, "dtx_participant_in_doubt", &[b_id]) == Some(0.0)
            && series(t, "dtx_participant_oldest_in_doubt_age_seconds", &[b_id]) == Some(0.0)
    })
    .await;

    // HELP text, histograms with buckets, methods named after gRPC.
    for line in [
        "# HELP dtx_undelivered_transactions ",
        "# HELP dtx_oldest_undelivered_age_seconds ",
        "# HELP dtx_oldest_in_doubt_age_seconds ",
        "# HELP dtx_preparing_transactions ",
        "# HELP dtx_delivery_failures_total ",
        "# HELP dtx_api_request_seconds ",
        "# TYPE dtx_api_request_seconds histogram",
        "# TYPE dtx_oldest_in_doubt_age_seconds gauge",
    ] {
        assert!(
            text.contains(line),
            "{line:?} missing from the leader's metrics:\n{text}"
        );
    }
    for method in ["Begin", "Enlist", "Commit", "Abort"] {
        let bucket = format!(r#"dtx_api_request_seconds_bucket{{method="{method}","#);
        assert!(
            text.lines()
                .any(|l| l.starts_with(&bucket) && l.contains(r#"le="0.005""#)),
            "no {bucket}..le=\"0.005\"}} series:\n{text}"
        );
        assert!(
            series(&text, "dtx_api_requests_total", &[&format!(r#"method="{method}""#)]).is_some(),
            "no dtx_api_requests_total for {method}:\n{text}"
        );
    }
    assert!(
        !text.contains("quantile="),
        "a histogram rendered as a summary:\n{text}"
    );
    assert!(!text.contains("txid="), "a label carries a txid:\n{text}");

    // bank-a back: the ABORT reaches it and every gauge falls to 0.
    bank_a.start(&[]).unwrap();
    bank_a.wait_started().await.unwrap();
    let text = until_leader(&mut c, "every in-doubt gauge at 0", |t| {
        [
            "dtx_undelivered_transactions",
            "dtx_preparing_transactions",
            "dtx_oldest_in_doubt_age_seconds",
            "dtx_oldest_undelivered_age_seconds",
        ]
        .iter()
        .all(|g| series(t, g, &[]) == Some(0.0))
    })
    .await;
    eprintln!(
        "bank-a back: undelivered {:?}, oldest in-doubt age {:?}",
        series(&text, "dtx_undelivered_transactions", &[]),
        series(&text, "dtx_oldest_in_doubt_age_seconds", &[])
    );
    let a_id = r#"participant="bank-a""#;
    until_bank(&metrics_a, "bank-a with nothing in doubt", |t| {
        series(t, "dtx_participant_in_doubt", &[a_id]) == Some(0.0)
    })
    .await;
    // The commit call ended with the recorded ABORT (or UNKNOWN, if its
    // prepare wait outlived the client's deadline), never COMMITTED.
    commit.abort();
    if let Ok(Ok(o)) = commit.await {
        assert_ne!(o, TxOutcome::Committed);
    }
}
