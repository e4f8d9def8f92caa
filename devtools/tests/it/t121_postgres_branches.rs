//! Branches on PostgreSQL (docs/protocol.md, "Branches"): two bank
//! processes (`dtx-dev bank-serve --postgres .. --app-listen ..`) on a
//! real PostgreSQL server, each changing balances in its own request
//! handler inside the caller's transaction, ending it with `PREPARE
//! TRANSACTION` and registering with its vote. The crash windows abort the
//! bank process (like kill -9) at the SDK's crash points, or a node right
//! after it recorded a registration; each ends with the decision applied
//! at every member and nothing of a non-member applied (invariants 2, 3,
//! 5), audited in the databases: balances, prepared transactions, branch
//! marks and the apply log.
//!
//! Without the PostgreSQL server binaries it says so and passes, unless
//! `DTX_REQUIRE_POSTGRES=1` (CI) makes that a failure.

use crate::common;

use std::time::Duration;

use common::branch_bank::commit_outcome;
use common::branch_bank::BranchBank;
use common::shop::postgres_or_skip;
use common::TestCluster;
use dtx_client::BranchVote;
use dtx_client::Client;
use dtx_client::ClientError;
use dtx_client::TxOutcome;
use dtx_pg_server::PgServer;
use dtx_proto::metadata::BranchRefusalKind;
use dtx_proto::v1::LocalRecord;
use participant_sdk::GlobalTxid;

/// A bank on PostgreSQL serving `bank.v1.Bank` (common::branch_bank), with
/// its database.
struct PgBankProc {
    bank: BranchBank,
    conn: String,
}

impl std::ops::Deref for PgBankProc {
    type Target = BranchBank;
    fn deref(&self) -> &BranchBank {
        &self.bank
    }
}

impl std::ops::DerefMut for PgBankProc {
    fn deref_mut(&mut self) -> &mut BranchBank {
        &mut self.bank
    }
}

impl PgBankProc {
    fn new(c: &TestCluster, pg: &PgServer, test: &str, id: &str, prefix: &str) -> PgBankProc {
        let db = format!("{test}_{prefix}");
        pg.create_database(&db).unwrap();
        let conn = pg.conn_string(&db);
        PgBankProc {
            bank: BranchBank::new(c, id, prefix, Some(conn.clone())),
            conn,
        }
    }

    async fn db(&self) -> tokio_postgres::Client {
        dtx_bank::connect_pg(&self.conn).await.unwrap()
    }

    /// (balance of `account`, prepared dtx transactions, branch marks,
    /// times the apply log shows `txid`).
    async fn audit(&self, account: &str, txid: u64) -> (i64, usize, i64, usize) {
        let db = self.db().await;
        let balances = dtx_bank::pg::balances(&db).await.unwrap();
        let prepared = dtx_bank::pg::prepared(&db).await.unwrap().len();
        let marks = marks(&db).await;
        let applied = dtx_bank::pg::apply_log(&db)
            .await
            .unwrap()
            .into_iter()
            .filter(|(t, _)| *t == txid)
            .count();
        (balances[account], prepared, marks, applied)
    }
}

async fn marks(db: &tokio_postgres::Client) -> i64 {
    db.query_one(
        &format!("SELECT count(*) FROM {}", participant_sdk::postgres::BRANCH_TABLE),
        &[],
    )
    .await
    .unwrap()
    .get(0)
}

impl PgBankProc {
    /// Waits until no branch mark is left: a recovery pass drops the mark
    /// of a branch settled after its decision reached it (a pass every
    /// 500 ms).
    async fn wait_marks_gone(&self) {
        let db = self.db().await;
        let until = tokio::time::Instant::now() + Duration::from_secs(20);
        while marks(&db).await > 0 {
            assert!(
                tokio::time::Instant::now() < until,
                "{}: a branch mark stays",
                self.id()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

async fn begin(cl: &Client, key: &str) -> GlobalTxid {
    let b = cl.begin(key, 60_000, b"").await.unwrap();
    GlobalTxid::new(b.incarnation, b.txid)
}

fn cluster(name: &str) -> TestCluster {
    TestCluster::start_with(name, 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 2_000;
    })
}

/// Killed after PREPARE TRANSACTION and before registering: the prepared
/// transaction and its mark are in the database; the restarted bank's
/// recovery is fenced out of the open transaction and rolls it back; the
/// transaction commits with the other bank's branch. Then a registration
/// racing the decision and losing: refused, rolled back before answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t121_pg_branch_killed_between_prepare_and_registration_rolls_back() {
    let Some(pg) = postgres_or_skip("t121 PostgreSQL branches") else {
        return;
    };
    let mut c = cluster("t121a");
    c.leader().await;
    let cl = c.client();
    let mut a = PgBankProc::new(&c, &pg, "t121a", "bank-a", "a");
    let mut b = PgBankProc::new(&c, &pg, "t121a", "bank-b", "b");
    a.start(Some("participant_branch_prepared_before_register")).await;
    b.start(None).await;

    let g = begin(&cl, "pg-crash-before-register").await;
    let lost = a.change(g, &[("a0", -30)]).await;
    assert!(lost.is_err(), "bank-a answered past its crash point: {lost:?}");
    a.wait_crashed().await;
    // The window: prepared in PostgreSQL, marked, unknown to the cluster.
    let (a0, prepared, marks, _) = a.audit("a0", g.txid).await;
    assert_eq!((a0, prepared, marks), (1000, 1, 1));
    let reply = b.change(g, &[("b0", 30)]).await.unwrap();
    assert_eq!(reply.balances[0].balance_if_committed, 1030);

    a.start(None).await;
    a.wait_record(g, LocalRecord::Aborted).await;
    let late = cl
        .register_branch((g.incarnation, g.txid), a.id(), &a.proc_.addr, BranchVote::Yes, "")
        .await;
    assert!(
        matches!(
            &late,
            Err(ClientError::BranchRefused {
                kind: BranchRefusalKind::Fenced,
                ..
            })
        ),
        "{late:?}"
    );
    assert_eq!(commit_outcome(&cl, g.txid, 20).await, TxOutcome::Committed);
    b.wait_record(g, LocalRecord::Committed).await;
    let st = cl.status(g.txid).await.unwrap();
    assert_eq!(
        st.participants.iter().map(|p| p.id.as_str()).collect::<Vec<_>>(),
        ["bank-b"]
    );

    // Racing the decision, and losing it: too late, rolled back here.
    let g2 = begin(&cl, "pg-too-late").await;
    b.change(g2, &[("b1", -10)]).await.unwrap();
    assert_eq!(commit_outcome(&cl, g2.txid, 20).await, TxOutcome::Committed);
    let late = a.change(g2, &[("a1", 10)]).await.unwrap_err();
    assert_eq!(late.code(), tonic::Code::Aborted, "{late:?}");
    a.wait_record(g2, LocalRecord::Aborted).await;
    b.wait_record(g2, LocalRecord::Committed).await;

    a.wait_marks_gone().await;
    assert_eq!(
        a.audit("a0", g.txid).await,
        (1000, 0, 0, 0),
        "bank-a: a0, prepared, marks, applied"
    );
    assert_eq!(a.audit("a1", g2.txid).await, (1000, 0, 0, 0));
    assert_eq!(b.audit("b0", g.txid).await, (1030, 0, 0, 1));
    assert_eq!(b.audit("b1", g2.txid).await, (990, 0, 0, 1));
}

/// Killed after registering and before answering the caller: the caller
/// commits; the restarted bank gets the COMMIT and applies it once. A
/// branch that refuses (too little money) registers NO and the
/// transaction aborts, with nothing left prepared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t121_pg_branch_killed_between_registration_and_answer_commits() {
    let Some(pg) = postgres_or_skip("t121 PostgreSQL branches") else {
        return;
    };
    let mut c = cluster("t121b");
    c.leader().await;
    let cl = c.client();
    let mut a = PgBankProc::new(&c, &pg, "t121b", "bank-a", "a");
    let mut b = PgBankProc::new(&c, &pg, "t121b", "bank-b", "b");
    a.start(Some("participant_branch_registered_before_answer")).await;
    b.start(None).await;

    let g = begin(&cl, "pg-crash-after-register").await;
    let reply = b.change(g, &[("b0", -100)]).await.unwrap();
    assert_eq!(reply.balances[0].balance_if_committed, 900);
    let lost = a.change(g, &[("a0", 100)]).await;
    assert!(lost.is_err(), "bank-a answered past its crash point: {lost:?}");
    a.wait_crashed().await;
    assert_eq!(commit_outcome(&cl, g.txid, 20).await, TxOutcome::Committed);
    b.wait_record(g, LocalRecord::Committed).await;
    a.start(None).await;
    a.wait_record(g, LocalRecord::Committed).await;

    let g2 = begin(&cl, "pg-refused").await;
    b.change(g2, &[("b1", -10)]).await.unwrap();
    let no = a.change(g2, &[("a1", -5_000)]).await.unwrap_err();
    assert_eq!(no.code(), tonic::Code::FailedPrecondition, "{no:?}");
    assert!(no.message().contains("too little"), "{no:?}");
    assert_eq!(commit_outcome(&cl, g2.txid, 20).await, TxOutcome::Aborted);
    b.wait_record(g2, LocalRecord::Aborted).await;

    a.wait_marks_gone().await;
    assert_eq!(
        a.audit("a0", g.txid).await,
        (1100, 0, 0, 1),
        "bank-a: a0, prepared, marks, applied"
    );
    assert_eq!(b.audit("b0", g.txid).await, (900, 0, 0, 1));
    assert_eq!(a.audit("a1", g2.txid).await, (1000, 0, 0, 0));
    assert_eq!(b.audit("b1", g2.txid).await, (1000, 0, 0, 0));
}

/// The registration's reply is lost: the node that recorded it aborts
/// before answering. The bank's client registers again at the next leader
/// (the same registration answers the same), or, if its call runs out
/// first, its recovery finds it a member; either way the commit reaches it
/// and is applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t121_pg_branch_registration_reply_lost_commits_once() {
    let Some(pg) = postgres_or_skip("t121 PostgreSQL branches") else {
        return;
    };
    let mut c = cluster("t121c");
    // Restart the nodes with the crash point armed (once in total).
    c.procs.stop_all(Duration::from_secs(5));
    let fired = c.dir.path().join("node-fired");
    c.procs.env = vec![
        (
            "DTX_FAILPOINT".into(),
            "coordinator_branch_registered_before_reply".into(),
        ),
        ("DTX_FAILPOINT_ONCE".into(), fired.display().to_string()),
    ];
    c.procs.start_all().unwrap();
    c.leader().await;
    let cl = c.client();
    let mut a = PgBankProc::new(&c, &pg, "t121c", "bank-a", "a");
    let mut b = PgBankProc::new(&c, &pg, "t121c", "bank-b", "b");
    a.start(None).await;
    b.start(None).await;

    let g = begin(&cl, "pg-lost-reply").await;
    // The first registration (whichever bank) crashes the leader after it
    // recorded it; the answer to the caller may then be an error.
    let first = a.change(g, &[("a0", -40)]).await;
    assert!(fired.exists(), "no node reached its crash point");
    let second = b.change(g, &[("b0", 40)]).await;
    let members: Vec<String> = cl
        .status(g.txid)
        .await
        .unwrap()
        .participants
        .into_iter()
        .map(|p| p.id)
        .collect();
    assert!(
        members.contains(&"bank-a".to_string()),
        "the registration recorded before the crash is lost: {members:?} ({first:?})"
    );
    assert!(second.is_ok(), "{second:?}");
    assert_eq!(commit_outcome(&cl, g.txid, 20).await, TxOutcome::Committed);
    a.wait_record(g, LocalRecord::Committed).await;
    b.wait_record(g, LocalRecord::Committed).await;
    a.wait_marks_gone().await;
    b.wait_marks_gone().await;
    assert_eq!(
        a.audit("a0", g.txid).await,
        (960, 0, 0, 1),
        "bank-a: a0, prepared, marks, applied"
    );
    assert_eq!(b.audit("b0", g.txid).await, (1040, 0, 0, 1));
}
