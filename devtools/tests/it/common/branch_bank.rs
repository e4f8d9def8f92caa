//! A bank process serving its own API (`dtx-dev bank-serve --app-listen`,
//! `bank.v1.Bank`) for the branch tests (t120 on the bank's own store,
//! t121 on PostgreSQL), optionally armed to abort once at a crash point,
//! and the caller's side of its API.
#![allow(dead_code)]

use std::time::Duration;

use dtx_bank::branch::pb;
use dtx_client::Client;
use dtx_client::TxOutcome;
use dtx_proto::v1::participant_service_client::ParticipantServiceClient;
use dtx_proto::v1::LocalRecord;
use participant_sdk::GlobalTxid;

use super::TestCluster;

pub struct BranchBank {
    pub proc_: dtx_testkit::cluster::BankProcess,
    /// Where its `bank.v1.Bank` listens.
    pub app: String,
    once: std::path::PathBuf,
    /// How long it may take to listen after a start, and a record to
    /// reach the state waited for: longer on PostgreSQL (the bank connects
    /// and checks its tables first).
    listen_within: Duration,
    record_within: Duration,
}

impl BranchBank {
    /// Bank `id` with accounts `prefix`0..9 of 1000 each, on its own store,
    /// or on PostgreSQL (`postgres`: a connection string) when given.
    pub fn new(c: &TestCluster, id: &str, prefix: &str, postgres: Option<String>) -> BranchBank {
        let port = dtx_testkit::cluster::free_port("127.0.0.1").unwrap();
        let mut proc_ = dtx_testkit::cluster::BankProcess::build(
            super::bin(),
            c.dir.path(),
            id,
            prefix,
            "127.0.0.1",
            port,
            c.procs.api_addrs(),
            10,
            1000,
            postgres.clone(),
        );
        let (listen_within, record_within) = match postgres {
            Some(_) => (Duration::from_secs(20), Duration::from_secs(30)),
            None => (Duration::from_secs(10), Duration::from_secs(20)),
        };
        let app = format!("127.0.0.1:{}", dtx_testkit::cluster::free_port("127.0.0.1").unwrap());
        proc_.add_args(["--app-listen".to_string(), app.clone()]);
        BranchBank {
            app,
            once: c.dir.path().join(format!("{id}-fired")),
            proc_,
            listen_within,
            record_within,
        }
    }

    pub fn id(&self) -> &str {
        &self.proc_.id
    }

    /// Starts it (armed to abort once at `armed_at`) and waits until both
    /// its ports listen.
    pub async fn start(&mut self, armed_at: Option<&str>) {
        let mut env = vec![("RUST_LOG".to_string(), "warn".to_string())];
        if let Some(point) = armed_at {
            env.push(("DTX_FAILPOINT".into(), point.into()));
            env.push(("DTX_FAILPOINT_ONCE".into(), self.once.display().to_string()));
        }
        self.proc_.start(&env).unwrap();
        for addr in [&self.proc_.addr, &self.app] {
            let listening = dtx_testkit::cluster::wait_listening(addr, self.listen_within).await;
            assert!(listening, "{} did not start listening on {addr}", self.proc_.id);
        }
    }

    /// The caller's side: `changes` at this bank inside transaction `g`.
    pub async fn change(&self, g: GlobalTxid, changes: &[(&str, i64)]) -> Result<pb::ChangeReply, tonic::Status> {
        let mut api = pb::bank_client::BankClient::connect(format!("http://{}", self.app))
            .await
            .unwrap();
        let mut req = tonic::Request::new(pb::ChangeRequest {
            changes: changes
                .iter()
                .map(|(a, d)| pb::AccountChange {
                    account: a.to_string(),
                    delta: *d,
                })
                .collect(),
        });
        dtx_proto::attach_txid(&mut req, g.txid);
        dtx_proto::attach_incarnation(&mut req, g.incarnation);
        api.change(req).await.map(|r| r.into_inner())
    }

    /// Waits for the process to abort at its crash point.
    pub async fn wait_crashed(&mut self) {
        let status = self.proc_.wait_for_exit(Duration::from_secs(30)).await;
        let status = status.unwrap_or_else(|| panic!("{}: still running after its crash point", self.proc_.id));
        assert!(!status.success());
        assert!(self.once.exists(), "{}: crash point not reached", self.proc_.id);
    }

    /// What the running bank's log holds for `g` (its Inquire).
    pub async fn record(&self, g: GlobalTxid) -> LocalRecord {
        let mut p = ParticipantServiceClient::connect(format!("http://{}", self.proc_.addr))
            .await
            .unwrap();
        p.inquire(dtx_proto::v1::InquireRequest {
            txid: g.txid,
            participant_id: self.proc_.id.clone(),
            incarnation: g.incarnation,
        })
        .await
        .unwrap()
        .into_inner()
        .record()
    }

    /// Waits for its record of `g` to be `want`.
    pub async fn wait_record(&self, g: GlobalTxid, want: LocalRecord) {
        let until = tokio::time::Instant::now() + self.record_within;
        loop {
            let got = self.record(g).await;
            if got == want {
                return;
            }
            assert!(
                tokio::time::Instant::now() < until,
                "{}: record of {g} is {got:?}, not {want:?}",
                self.proc_.id
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The decision of `txid`, asking Commit again (up to `attempts` times,
/// 300 ms apart) while the answer is UNKNOWN or an error (Commit is
/// idempotent).
pub async fn commit_outcome(cl: &Client, txid: u64, attempts: usize) -> TxOutcome {
    for _ in 0..attempts {
        match cl.commit(txid).await {
            Ok(TxOutcome::Unknown) | Err(_) => tokio::time::sleep(Duration::from_millis(300)).await,
            Ok(o) => return o,
        }
    }
    panic!("no decision for {txid}");
}
