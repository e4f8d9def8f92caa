//! What `PREPARE TRANSACTION` cannot carry, refused early in a PostgreSQL
//! branch (docs/protocol.md, "Branches"; `postgres::branch`): the guarded
//! methods of `PgBranch` refuse NOTIFY, LISTEN, temporary tables and
//! cursors WITH HOLD before the statement is sent, and `PgBranch::join`
//! finds temporary tables and cursors WITH HOLD the transaction made
//! through the unguarded `tx()` before it prepares. Either way the branch
//! registers NO with a reason naming the restriction (the cluster records
//! ABORT with a NO registration), nothing is prepared or marked, the
//! handler's other work is rolled back, and the participant's own record
//! is aborted. Leftovers of earlier transactions of the pooled session (a
//! temporary table, a held cursor), which do not stop PREPARE, refuse
//! nothing.
//!
//! The cluster is a stand-in node answering RegisterBranch (what the
//! state machine does with a registration is `t120_branches`' and
//! `t121_postgres_branches`'). Without the PostgreSQL server binaries each
//! test prints a loud message and passes, unless DTX_REQUIRE_POSTGRES=1
//! (CI), where it fails.

#![cfg(feature = "postgres")]

use std::sync::Arc;
use std::sync::Mutex;

use dtx_client::Client;
use dtx_client::ClientConfig;
use dtx_pg_server::PgServer;
use dtx_pg_server::PgServerOptions;
use dtx_proto::v1 as pb;
use dtx_proto::v1::coordinator_server::Coordinator;
use dtx_proto::v1::coordinator_server::CoordinatorServer;
use participant_sdk::branch::BranchError;
use participant_sdk::branch::BranchIdentity;
use participant_sdk::branch::Joined;
use participant_sdk::log::Message;
use participant_sdk::log::Refusal;
use participant_sdk::log::Vote;
use participant_sdk::participant::Participant;
use participant_sdk::participant::Verdict;
use participant_sdk::postgres::HandlerError;
use participant_sdk::postgres::PgHandler;
use participant_sdk::postgres::PgOptions;
use participant_sdk::postgres::PgParticipant;
use participant_sdk::postgres::Transaction;
use participant_sdk::store::Reply;
use participant_sdk::store::StoreError;
use participant_sdk::GlobalTxid;
use tonic::Request;
use tonic::Response;
use tonic::Status;

const DB: &str = "shop";
const ID: &str = "stock";
const INC: u64 = 0x5454_5454_5454_5454;

/// Branches only: no Prepare-driven work.
struct NoHandler;

impl PgHandler for NoHandler {
    async fn prepare(&self, _tx: &Transaction<'_>, _txid: GlobalTxid, _p: &[u8]) -> Result<Verdict, HandlerError> {
        Err("branches only".into())
    }
}

/// A stand-in node: records every RegisterBranch (txid, vote, reason) and
/// answers term 1; a NO is the transaction's ABORT, as in the state
/// machine (docs/protocol.md, "The rules").
#[derive(Default)]
struct FakeNode {
    registered: Mutex<Vec<(u64, i32, String)>>,
}

impl FakeNode {
    fn registrations(&self) -> Vec<(u64, i32, String)> {
        self.registered.lock().unwrap().clone()
    }
}

struct Served(Arc<FakeNode>);

type Res<T> = Result<Response<T>, Status>;

#[tonic::async_trait]
impl Coordinator for Served {
    async fn register_branch(&self, r: Request<pb::RegisterBranchRequest>) -> Res<pb::RegisterBranchResponse> {
        let r = r.into_inner();
        self.0.registered.lock().unwrap().push((r.txid, r.vote, r.reason));
        Ok(Response::new(pb::RegisterBranchResponse {
            term: 1,
            incarnation: r.incarnation,
            existing: false,
            deadline_unix_ms: 0,
            participant_count: 1,
        }))
    }
    async fn get_branch_decision(
        &self,
        _: Request<pb::GetBranchDecisionRequest>,
    ) -> Res<pb::GetBranchDecisionResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn get_decisions(&self, _: Request<pb::GetDecisionsRequest>) -> Res<pb::GetDecisionsResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn enlist(&self, _: Request<pb::EnlistRequest>) -> Res<pb::EnlistResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn begin(&self, _: Request<pb::BeginRequest>) -> Res<pb::BeginResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn begin_and_commit(&self, _: Request<pb::BeginAndCommitRequest>) -> Res<pb::BeginAndCommitResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn commit(&self, _: Request<pb::CommitRequest>) -> Res<pb::CommitResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn abort(&self, _: Request<pb::AbortRequest>) -> Res<pb::AbortResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn status(&self, _: Request<pb::StatusRequest>) -> Res<pb::StatusResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn get_decision(&self, _: Request<pb::GetDecisionRequest>) -> Res<pb::GetDecisionResponse> {
        Err(Status::unimplemented("fake"))
    }
}

struct Setup {
    _server: PgServer,
    p: PgParticipant<NoHandler>,
    node: Arc<FakeNode>,
    cluster: Client,
    who: BranchIdentity,
}

/// A PostgreSQL server with `items(id, stock)` (apples = 10), the
/// participant, and the stand-in node; `None` when PostgreSQL is missing
/// and not required.
async fn setup(test: &str) -> Option<Setup> {
    let s = dtx_pg_server::start_or_skip(
        test,
        PgServerOptions {
            kill_with_parent_thread: true,
            ..PgServerOptions::default()
        },
    )?;
    s.create_database(DB).unwrap();
    s.execute(
        DB,
        "CREATE TABLE items (id text PRIMARY KEY, stock bigint NOT NULL); INSERT INTO items VALUES ('apples', 10)",
    )
    .unwrap();
    let p = PgParticipant::connect(PgOptions::new(ID, s.conn_string(DB)), NoHandler)
        .await
        .unwrap();
    let node = Arc::new(FakeNode::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(CoordinatorServer::new(Served(node.clone())))
            .serve_with_incoming(dtx_transport::incoming(listener)),
    );
    let cluster = Client::new(ClientConfig::new(vec![addr])).unwrap();
    let who = BranchIdentity {
        participant_id: ID.into(),
        address: "127.0.0.1:9".into(),
    };
    Some(Setup {
        _server: s,
        p,
        node,
        cluster,
        who,
    })
}

impl Setup {
    async fn stock(&self) -> i64 {
        let c = self.p.pool().get().await.unwrap();
        c.query_one("SELECT stock FROM items WHERE id = 'apples'", &[])
            .await
            .unwrap()
            .get(0)
    }

    async fn count(&self, sql: &str) -> i64 {
        let c = self.p.pool().get().await.unwrap();
        c.query_one(sql, &[]).await.unwrap().get(0)
    }

    /// Nothing prepared, nothing marked, the handler's update rolled back,
    /// the branch registered NO with `joined`'s reason (the transaction's
    /// ABORT), and the participant's record aborted: a Commit is refused,
    /// an Abort acknowledged.
    async fn assert_refused_and_aborted(&self, txid: GlobalTxid, joined: &Joined, case: &str) {
        assert_eq!(joined.vote, Vote::No, "{case}: {joined:?}");
        assert_eq!(
            self.count("SELECT count(*) FROM pg_prepared_xacts").await,
            0,
            "{case}: nothing prepared"
        );
        assert_eq!(
            self.count("SELECT count(*) FROM dtx_participant_branch").await,
            0,
            "{case}: no branch mark"
        );
        assert_eq!(self.stock().await, 10, "{case}: the handler's update rolled back");
        let registered = self.node.registrations();
        let last = registered
            .last()
            .unwrap_or_else(|| panic!("{case}: nothing registered"));
        assert_eq!(
            (last.0, last.1, last.2.as_str()),
            (txid.txid, pb::BranchVote::No as i32, joined.reason.as_str()),
            "{case}: registered NO with the reason"
        );
        match self.p.handle(txid, Message::Commit { term: 1 }, b"").await {
            Err(StoreError::Refused(Refusal::CommitAfterAbort)) => {}
            other => panic!("{case}: a Commit after the NO must be refused, got {other:?}"),
        }
        let a = self.p.handle(txid, Message::Abort { term: 1 }, b"").await.unwrap();
        assert_eq!(a.reply, Reply::Ack, "{case}");
    }
}

/// The early refusal's reason: the restriction, why, found before PREPARE
/// (PostgreSQL's own refusal says "cannot prepare what the handler did").
fn assert_early(reason: &str, names: &str, case: &str) {
    assert!(reason.contains("not prepared here"), "{case}: {reason}");
    assert!(reason.contains(names), "{case}: {reason}");
    assert!(
        reason.contains("cannot be part of a branch's transaction"),
        "{case}: {reason}"
    );
    assert!(reason.contains("PREPARE TRANSACTION refuses"), "{case}: {reason}");
    assert!(
        !reason.contains("cannot prepare what the handler did"),
        "{case}: found before PREPARE TRANSACTION, not by it: {reason}"
    );
    assert!(
        reason.len() <= 1024,
        "{case}: a registration's reason is at most 1024 bytes"
    );
}

/// A temporary table and a cursor WITH HOLD made through the unguarded
/// `tx()` (also inside a savepoint) are found by `join` in the
/// transaction's state, before PREPARE TRANSACTION.
#[tokio::test]
async fn join_finds_a_temporary_table_or_a_held_cursor_before_preparing() {
    let Some(t) = setup("t54_pg_branch_restrictions").await else {
        return;
    };
    for (n, case, sql, names) in [
        (
            1u64,
            "temporary table",
            "CREATE TEMP TABLE scratch (x int)",
            "a temporary table (scratch)",
        ),
        (
            2,
            "temporary table in a savepoint",
            "SAVEPOINT s; CREATE TEMPORARY TABLE scratch2 (x int) ON COMMIT DROP; RELEASE s",
            "a temporary table (scratch2)",
        ),
        (
            3,
            "cursor WITH HOLD",
            "DECLARE held CURSOR WITH HOLD FOR SELECT id FROM items",
            "a cursor WITH HOLD (held)",
        ),
    ] {
        let txid = GlobalTxid::new(INC, n);
        let mut conn = t.p.branch_connection().await.unwrap();
        let branch = t.p.begin_branch(&mut conn, txid).await.unwrap();
        branch
            .tx()
            .batch_execute("UPDATE items SET stock = stock - 1 WHERE id = 'apples'")
            .await
            .unwrap();
        branch.tx().batch_execute(sql).await.unwrap();
        let joined = branch.join(Verdict::yes(), &t.cluster, &t.who).await.unwrap();
        assert_early(&joined.reason, names, case);
        t.assert_refused_and_aborted(txid, &joined, case).await;
    }
}

/// NOTIFY, LISTEN, a temporary table and a cursor WITH HOLD through the
/// guarded methods: refused before they are sent, with the restriction,
/// why and what instead; `join` then votes NO with it, even on a YES.
#[tokio::test]
async fn the_guarded_methods_refuse_before_sending_and_join_votes_no() {
    let Some(t) = setup("t54_pg_branch_restrictions").await else {
        return;
    };
    for (n, case, sql, says) in [
        (11u64, "NOTIFY", "NOTIFY orders, 'paid'", "outbox"),
        (12, "pg_notify", "SELECT pg_notify('orders', 'paid')", "outbox"),
        (13, "LISTEN", "LISTEN orders", "connection of its own"),
        (14, "temporary table", "CREATE TEMP TABLE scratch (x int)", "temporary"),
        (
            15,
            "cursor WITH HOLD",
            "DECLARE held CURSOR WITH HOLD FOR SELECT id FROM items",
            "WITH HOLD",
        ),
    ] {
        let txid = GlobalTxid::new(INC, n);
        let mut conn = t.p.branch_connection().await.unwrap();
        let branch = t.p.begin_branch(&mut conn, txid).await.unwrap();
        let changed = branch
            .execute("UPDATE items SET stock = stock - 1 WHERE id = 'apples'", &[])
            .await
            .unwrap();
        assert_eq!(changed, 1, "{case}");
        // In a batch with an allowed statement: nothing of it is sent.
        let batch = format!("UPDATE items SET stock = stock - 100 WHERE id = 'apples'; {sql}");
        let e = branch.batch_execute(&batch).await.unwrap_err();
        assert!(matches!(e, BranchError::Unpreparable { .. }), "{case}: {e:?}");
        let text = e.to_string();
        assert!(text.contains("PREPARE TRANSACTION refuses"), "{case}: {text}");
        assert!(text.contains(says), "{case}: {text}");
        assert_eq!(Status::from(e).code(), tonic::Code::FailedPrecondition, "{case}");
        let e = branch.query(sql, &[]).await.unwrap_err();
        assert!(matches!(e, BranchError::Unpreparable { .. }), "{case}: {e:?}");
        let left: i64 = branch
            .query_one("SELECT stock FROM items WHERE id = 'apples'", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(left, 9, "{case}: the refused batch was not sent");
        let joined = branch.join(Verdict::yes(), &t.cluster, &t.who).await.unwrap();
        assert_early(&joined.reason, says, case);
        t.assert_refused_and_aborted(txid, &joined, case).await;
    }

    // A handler that answers with the refusal (`?`) drops its branch:
    // rolled back, nothing prepared, recorded or registered (its caller
    // gets FAILED_PRECONDITION and aborts).
    let before = t.node.registrations().len();
    let txid = GlobalTxid::new(INC, 16);
    {
        let mut conn = t.p.branch_connection().await.unwrap();
        let branch = t.p.begin_branch(&mut conn, txid).await.unwrap();
        branch
            .execute("UPDATE items SET stock = stock - 1 WHERE id = 'apples'", &[])
            .await
            .unwrap();
        let e = branch.execute("NOTIFY orders", &[]).await.unwrap_err();
        assert!(e.to_string().starts_with("NOTIFY"), "{e}");
    }
    assert_eq!(t.node.registrations().len(), before, "nothing registered");
    assert_eq!(t.count("SELECT count(*) FROM pg_prepared_xacts").await, 0);
    assert_eq!(t.stock().await, 10);
}

/// LISTEN through the unguarded `tx()` is not visible in the transaction
/// (PostgreSQL applies it at commit): PREPARE TRANSACTION's own refusal
/// (SQLSTATE 0A000) still makes it a NO naming the restriction.
#[tokio::test]
async fn listen_through_the_unguarded_transaction_is_still_a_no() {
    let Some(t) = setup("t54_pg_branch_restrictions").await else {
        return;
    };
    let txid = GlobalTxid::new(INC, 21);
    let mut conn = t.p.branch_connection().await.unwrap();
    let branch = t.p.begin_branch(&mut conn, txid).await.unwrap();
    branch
        .tx()
        .batch_execute("UPDATE items SET stock = stock - 1 WHERE id = 'apples'; LISTEN orders")
        .await
        .unwrap();
    let joined = branch.join(Verdict::yes(), &t.cluster, &t.who).await.unwrap();
    assert!(
        joined.reason.contains("cannot prepare what the handler did"),
        "{joined:?}"
    );
    assert!(joined.reason.contains("SQLSTATE 0A000"), "{joined:?}");
    t.assert_refused_and_aborted(txid, &joined, "LISTEN at PREPARE").await;
}

/// A temporary table and a cursor WITH HOLD left in the pooled session by
/// earlier transactions do not stop PREPARE TRANSACTION, and the check at
/// `join` does not refuse them: the branch prepares and votes YES.
#[tokio::test]
async fn leftovers_of_earlier_transactions_in_the_session_refuse_nothing() {
    let Some(t) = setup("t54_pg_branch_restrictions").await else {
        return;
    };
    let txid = GlobalTxid::new(INC, 31);
    let mut conn = t.p.branch_connection().await.unwrap();
    conn.batch_execute(
        "CREATE TEMP TABLE old_scratch (x int);
         BEGIN; DECLARE old_held CURSOR WITH HOLD FOR SELECT 1; COMMIT",
    )
    .await
    .unwrap();
    let branch = t.p.begin_branch(&mut conn, txid).await.unwrap();
    branch
        .execute("UPDATE items SET stock = stock - 1 WHERE id = 'apples'", &[])
        .await
        .unwrap();
    let joined = branch.join(Verdict::yes(), &t.cluster, &t.who).await.unwrap();
    assert_eq!(joined.vote, Vote::Yes, "{joined:?}");
    assert_eq!(t.count("SELECT count(*) FROM pg_prepared_xacts").await, 1);
    let registered = t.node.registrations();
    assert_eq!(registered.last().map(|r| r.1), Some(pb::BranchVote::Yes as i32));
    let a = t.p.handle(txid, Message::Commit { term: 1 }, b"").await.unwrap();
    assert_eq!(a.reply, Reply::Ack);
    assert_eq!(t.stock().await, 9, "committed");
    assert_eq!(t.count("SELECT count(*) FROM pg_prepared_xacts").await, 0);
}
