//! Many concurrent two-bank transfers against real node and bank processes,
//! the leader's metrics, and the audit of the stopped banks' stores: what
//! the grouped-message tests (t86 phase two, t87 prepares) share.

use std::collections::BTreeMap;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use dtx_client::TxOutcome;
use dtx_testkit::cluster::BankProcess;
use participant_sdk::log::LocalState;

use super::TestCluster;

pub use dtx_testkit::node_metrics::sample;

/// The Prometheus text of the node whose exporter listens on `addr`.
pub async fn scrape(addr: &str) -> String {
    dtx_testkit::node_metrics::scrape(addr)
        .await
        .unwrap_or_else(|e| panic!("metrics endpoint {addr}: {e}"))
}

/// Waits until the cluster has recorded every participant's ack of each of
/// `txids`; returns those still not acked.
pub async fn wait_all_acked(cl: &dtx_client::Client, txids: &[u64], timeout: Duration) -> Vec<u64> {
    let until = tokio::time::Instant::now() + timeout;
    let mut left: Vec<u64> = txids.to_vec();
    while !left.is_empty() && tokio::time::Instant::now() < until {
        let mut still = Vec::new();
        for t in left {
            match cl.status(t).await {
                Ok(st) if st.participants.iter().all(|p| p.acked) => {}
                // Forgotten: every participant acked.
                Err(e) if e.to_string().to_lowercase().contains("not found") => {}
                _ => still.push(t),
            }
        }
        left = still;
        if !left.is_empty() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    left
}

/// Accounts per bank. Each transfer locks one account at each bank from
/// its Prepare until its decision is applied there, so with 32 clients the
/// share of transfers voted NO on a held lock depends on this: with 10 it
/// was most of them once BeginAndCommit through a follower was forwarded
/// at once (before, a follower's "no leader" made the client back off,
/// which throttled the run).
const ACCOUNTS: usize = 100;
const INITIAL: i64 = 1_000;

/// A finished run of `BankRun::transfers`.
pub struct BankRun {
    pub c: TestCluster,
    /// The leader the run started with.
    pub leader: u64,
    pub banks: Vec<BankProcess>,
    /// What each client was told, by txid.
    pub told: HashMap<u64, TxOutcome>,
    /// The txids told COMMITTED.
    pub committed: Vec<u64>,
}

impl BankRun {
    /// A 3-node cluster `name` (metrics exported, acks grouped for 20 ms)
    /// and two bank processes; `clients` clients run `each` two-bank
    /// transfers (BeginAndCommit) each, all at once. Checks that every
    /// transfer got an answer with a txid, that at least 50 committed, and
    /// that every transaction ends acked within 30 s.
    pub async fn transfers(name: &str, clients: usize, each: usize) -> BankRun {
        let mut c = TestCluster::start_with(name, 3, |cfg| {
            let ip = super::node_ip(cfg.node_id);
            let port = dtx_testkit::cluster::free_port(&ip).unwrap();
            cfg.metrics_addr = Some(format!("{ip}:{port}"));
            cfg.txn.ack_batch_wait_ms = 20;
        });
        let leader = c.leader().await;
        let api = c.procs.api_addrs();
        let mut banks = Vec::new();
        for (id, prefix) in [("bank-a", "a"), ("bank-b", "b")] {
            let b = dtx_testkit::cluster::start_bank(super::bin(), c.dir.path(), id, prefix, &api, ACCOUNTS, INITIAL)
                .unwrap();
            b.wait_started().await.unwrap();
            banks.push(b);
        }
        let spec: Vec<(String, String, String)> = banks.iter().map(|b| b.spec()).collect();
        let cl = Arc::new(c.client());
        let mut tasks = Vec::new();
        for client in 0..clients {
            let (cl, spec, name) = (cl.clone(), spec.clone(), name.to_string());
            tasks.push(tokio::spawn(async move {
                let mut out = Vec::new();
                for i in 0..each {
                    let key = format!("{name}-{client}-{i}");
                    let (txid, res) = dtx_bank::transfer(&cl, &key, &spec, ACCOUNTS).await;
                    out.push((txid, res.map_err(|e| e.to_string())));
                }
                out
            }));
        }
        let mut told: HashMap<u64, TxOutcome> = HashMap::new();
        for t in tasks {
            for (txid, res) in t.await.unwrap() {
                let outcome = res.expect("a transfer failed outright");
                let txid = txid.expect("every transfer has a txid");
                told.insert(txid, outcome);
            }
        }
        let committed: Vec<u64> = told
            .iter()
            .filter(|(_, o)| **o == TxOutcome::Committed)
            .map(|(t, _)| *t)
            .collect();
        assert!(
            committed.len() >= 50,
            "too few transfers committed: {}",
            committed.len()
        );
        let txids: Vec<u64> = told.keys().copied().collect();
        let left = wait_all_acked(&cl, &txids, Duration::from_secs(30)).await;
        assert!(left.is_empty(), "not acked within 30 s: {left:?}");
        BankRun {
            c,
            leader,
            banks,
            told,
            committed,
        }
    }

    /// The sum and count of the leader's histogram `name`, checking that
    /// the leader did not change during the run (the metrics are its own).
    pub async fn leader_histogram(&mut self, name: &str) -> (f64, f64) {
        assert_eq!(
            self.c.leader().await,
            self.leader,
            "the leader changed: the metrics are its own"
        );
        let addr = self.c.procs.node(self.leader).config.metrics_addr.clone().unwrap();
        let text = scrape(&addr).await;
        (
            sample(&text, &format!("{name}_sum")),
            sample(&text, &format!("{name}_count")),
        )
    }

    /// Stops both banks and audits their stores: each COMMIT a client was
    /// told is applied once, as COMMIT, at both banks (invariants 3 and 4),
    /// no transaction is applied differently at the two, nothing is locked
    /// or in doubt, and the money is neither made nor lost.
    pub async fn audit_banks(&mut self) {
        let mut logs = Vec::new();
        let mut sum = 0;
        for b in &mut self.banks {
            b.stop(Duration::from_secs(10));
            let store = dtx_bank::open_bank(&b.data_dir, &b.prefix, ACCOUNTS, INITIAL)
                .await
                .unwrap();
            let (total, n, locked) = dtx_bank::audit(&store).unwrap();
            assert_eq!(n, ACCOUNTS);
            assert_eq!(locked, 0, "{}: accounts still locked", b.id);
            assert!(store.in_doubt().unwrap().is_empty(), "{}: transactions in doubt", b.id);
            sum += total;
            let mut applied: BTreeMap<u64, Vec<String>> = BTreeMap::new();
            for (txid, what) in dtx_bank::apply_log(&store).unwrap() {
                applied.entry(txid).or_default().push(what);
            }
            for t in &self.committed {
                assert_eq!(
                    store.entries_for_txid(*t).unwrap().first().map(|(_, e)| e.state),
                    Some(LocalState::Committed),
                    "{}: transfer {t} was reported committed",
                    b.id
                );
            }
            logs.push(applied);
        }
        assert_eq!(sum, 2 * ACCOUNTS as i64 * INITIAL, "money made or lost");
        for t in &self.committed {
            for (b, log) in self.banks.iter().zip(&logs) {
                assert_eq!(
                    log.get(t).map(Vec::as_slice),
                    Some(&["COMMIT".to_string()][..]),
                    "{}: transfer {t} must be applied once, as COMMIT",
                    b.id
                );
            }
        }
        for (t, a) in &logs[0] {
            if let Some(b) = logs[1].get(t) {
                assert_eq!(a, b, "transfer {t}: the banks applied different decisions");
            }
            assert_eq!(a.len(), 1, "bank-a applied transfer {t} more than once: {a:?}");
        }
    }
}
