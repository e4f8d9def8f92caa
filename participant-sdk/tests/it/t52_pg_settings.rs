//! The PostgreSQL participant and step store against the settings and
//! limits of a real deployment (ADR 0035), on a real PostgreSQL server
//! started by dtx-pg-server:
//! - an acknowledged one-phase commit or step commit survives a crash of
//!   PostgreSQL although the role says `synchronous_commit = off` (or the
//!   handler sets it off for its transaction);
//! - handlers have a default lock timeout (a row a prepared transaction
//!   holds makes the Prepare vote NO, not wait for ever), decisions are
//!   applied on a pool of their own while every handler connection is busy,
//!   a pooled connection is waited for a bounded time, and a call dropped
//!   while its handler runs cancels the handler's statement;
//! - prepared-transaction slots, which outlive connections and are shared
//!   by every database of the server: running out votes NO naming the
//!   limit, and is counted;
//! - a COMMIT / ROLLBACK PREPARED refused after the role was rotated
//!   (SQLSTATE 42501) says whose transaction it is and how to fix it, is
//!   counted, and is applied once the fix is in.
//!
//! Without the PostgreSQL server binaries each test prints a loud message
//! and passes, unless DTX_REQUIRE_POSTGRES=1 (CI), where it fails.

#![cfg(feature = "postgres")]

use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use dtx_pg_server::PgServer;
use dtx_pg_server::PgServerOptions;
use metrics_exporter_prometheus::PrometheusBuilder;
use metrics_exporter_prometheus::PrometheusHandle;
use metrics_exporter_prometheus::PrometheusRecorder;
use participant_sdk::log::LocalState;
use participant_sdk::log::Message;
use participant_sdk::log::Vote;
use participant_sdk::participant::Answer;
use participant_sdk::participant::Participant;
use participant_sdk::participant::Verdict;
use participant_sdk::postgres::HandlerError;
use participant_sdk::postgres::PgHandler;
use participant_sdk::postgres::PgOptions;
use participant_sdk::postgres::PgParticipant;
use participant_sdk::postgres::Transaction;
use participant_sdk::saga::StepCall;
use participant_sdk::saga::StepResult;
use participant_sdk::saga_pg::PgStepHandler;
use participant_sdk::saga_pg::PgStepOptions;
use participant_sdk::saga_pg::PgStepStore;
use participant_sdk::store::Reply;
use participant_sdk::store::StoreError;
use participant_sdk::GlobalTxid;

const DB: &str = "bank";
const ID: &str = "acct";

/// The payloads: `add:<account>:<n>` adds n to the account (waiting for
/// its row as long as PostgreSQL lets it: no lock timeout of its own);
/// `lazy-add:<account>:<n>` the same after `SET LOCAL synchronous_commit =
/// off`; `sleep:<seconds>` runs `pg_sleep`; `gate` waits (holding its
/// connection, outside PostgreSQL) until the test adds a permit. Each
/// counts itself in `entered` first; each votes YES.
#[derive(Clone)]
struct Work {
    entered: Arc<AtomicUsize>,
    gate: Arc<tokio::sync::Semaphore>,
}

impl Work {
    fn new() -> Work {
        Work {
            entered: Arc::new(AtomicUsize::new(0)),
            gate: Arc::new(tokio::sync::Semaphore::new(0)),
        }
    }
}

async fn add(tx: &Transaction<'_>, account: &str, n: &str) -> Result<(), HandlerError> {
    let n: i64 = n.parse()?;
    let changed = tx
        .execute(
            "UPDATE accounts SET balance = balance + $2 WHERE id = $1",
            &[&account, &n],
        )
        .await?;
    if changed != 1 {
        return Err(format!("no account {account:?}").into());
    }
    Ok(())
}

impl PgHandler for Work {
    async fn prepare(&self, tx: &Transaction<'_>, _txid: GlobalTxid, payload: &[u8]) -> Result<Verdict, HandlerError> {
        self.entered.fetch_add(1, Ordering::SeqCst);
        let text = std::str::from_utf8(payload)?;
        let parts: Vec<&str> = text.split(':').collect();
        match parts.as_slice() {
            ["add", account, n] => add(tx, account, n).await?,
            ["lazy-add", account, n] => {
                tx.batch_execute("SET LOCAL synchronous_commit = off").await?;
                add(tx, account, n).await?
            }
            ["sleep", secs] => {
                let secs: f64 = secs.parse()?;
                tx.execute("SELECT pg_sleep($1)", &[&secs]).await?;
            }
            ["gate"] => {
                let _permit = self.gate.acquire().await?;
            }
            _ => return Err(format!("bad payload {text:?}").into()),
        }
        Ok(Verdict::yes())
    }
}

/// A step service: `add` (input `<account>:<n>`) adds n to the account;
/// `lazy-add` the same after `SET LOCAL synchronous_commit = off`.
struct Steps;

impl Steps {
    async fn run(&self, tx: &Transaction<'_>, call: &StepCall) -> Result<StepResult, HandlerError> {
        let text = std::str::from_utf8(&call.input)?;
        if call.action == "sleep" {
            let secs: f64 = text.parse()?;
            tx.execute("SELECT pg_sleep($1)", &[&secs]).await?;
            return Ok(StepResult::ok(""));
        }
        let (account, n) = text.split_once(':').ok_or("input is account:n")?;
        if call.action == "lazy-add" {
            tx.batch_execute("SET LOCAL synchronous_commit = off").await?;
        }
        add(tx, account, n).await?;
        Ok(StepResult::ok(""))
    }
}

impl PgStepHandler for Steps {
    async fn forward(
        &self,
        tx: &Transaction<'_>,
        call: &StepCall,
        _events: &mut Vec<participant_sdk::outbox::OutboxMessage>,
    ) -> Result<StepResult, HandlerError> {
        self.run(tx, call).await
    }

    async fn compensate(
        &self,
        _tx: &Transaction<'_>,
        _call: &StepCall,
        _events: &mut Vec<participant_sdk::outbox::OutboxMessage>,
    ) -> Result<StepResult, HandlerError> {
        Ok(StepResult::failed("no compensation here"))
    }
}

fn step(op: &str, action: &str, input: &str) -> StepCall {
    StepCall {
        saga_id: 1,
        step: 0,
        operation_id: op.into(),
        action: action.into(),
        input: input.as_bytes().to_vec(),
        fingerprint: format!("fp-{op}"),
        ..StepCall::default()
    }
}

/// Waits (at most 10 s) until no `pg_sleep` statement runs on `s`: a
/// dropped call's statement was cancelled.
async fn assert_no_pg_sleep_runs(s: &PgServer) {
    let audit = participant_sdk::postgres::connect(&s.conn_string(DB)).await.unwrap();
    let mut running = i64::MAX;
    for _ in 0..200 {
        running = audit
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep%' AND state = 'active'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if running == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(running, 0, "the dropped call's pg_sleep still runs");
}

/// A server with database `bank` (or `dbs`) and accounts alice = 100, bob
/// = 0, carol = 0;
/// `None` (after a loud message) when PostgreSQL is not installed and not
/// required.
fn server_in(test: &str, opts: PgServerOptions, dbs: &[&str]) -> Option<PgServer> {
    let opts = PgServerOptions {
        kill_with_parent_thread: true,
        ..opts
    };
    let s = dtx_pg_server::start_or_skip(test, opts)?;
    for db in dbs {
        s.create_database(db).unwrap();
        s.execute(
            db,
            "CREATE TABLE accounts (id text PRIMARY KEY, balance bigint NOT NULL);
             INSERT INTO accounts VALUES ('alice', 100), ('bob', 0), ('carol', 0)",
        )
        .unwrap();
    }
    Some(s)
}

fn server(test: &str) -> Option<PgServer> {
    server_in(test, PgServerOptions::default(), &[DB])
}

fn opts_as(s: &PgServer, db: &str, user: &str) -> PgOptions {
    let mut o = PgOptions::new(ID, format!("host=127.0.0.1 port={} user={user} dbname={db}", s.port()));
    o.concurrency = 2;
    o
}

async fn balance(s: &PgServer, name: &str) -> i64 {
    let c = participant_sdk::postgres::connect(&s.conn_string(DB)).await.unwrap();
    c.query_one("SELECT balance FROM accounts WHERE id = $1", &[&name])
        .await
        .unwrap()
        .get(0)
}

fn yes() -> Answer {
    Answer::new(Reply::Vote(Vote::Yes))
}

fn ack() -> Answer {
    Answer::new(Reply::Ack)
}

/// A Prometheus recorder for this thread (the tests run on tokio's
/// current-thread runtime, so everything the SDK records lands here).
fn recorder() -> (PrometheusRecorder, PrometheusHandle) {
    let r = PrometheusBuilder::new().build_recorder();
    let h = r.handle();
    (r, h)
}

/// The value of the sample `series` (name with its labels, as rendered),
/// if any.
fn sample(h: &PrometheusHandle, series: &str) -> Option<f64> {
    h.render().lines().find_map(|l| {
        let (name, value) = l.rsplit_once(' ')?;
        (name == series).then(|| value.parse().ok())?
    })
}

/// Crashes PostgreSQL at once after `work` with its WAL writer stopped (so
/// nothing but the commit itself flushes the commit record), restarts it,
/// and returns what `work` answered.
async fn crash_right_after<T>(s: &mut PgServer, work: impl std::future::Future<Output = T>) -> T {
    // Everything so far on disk; from here on only a synchronous commit
    // flushes WAL.
    s.execute("postgres", "CHECKPOINT").unwrap();
    s.stop_wal_writer().unwrap();
    let out = work.await;
    s.kill9();
    s.restart().unwrap();
    out
}

/// An acknowledged one-phase commit, and an acknowledged step, survive a
/// crash of PostgreSQL although the role's `synchronous_commit` is off, and
/// although the handler turns it off for its own transaction.
#[tokio::test]
async fn acknowledged_commits_survive_a_crash_whatever_synchronous_commit_says() {
    let Some(mut s) = server("t52 synchronous_commit") else {
        return;
    };
    s.execute(
        "postgres",
        "CREATE ROLE lazy LOGIN SUPERUSER; ALTER ROLE lazy SET synchronous_commit = off",
    )
    .unwrap();
    // The SDK's tables made (and on disk) before the crashes.
    let usual = PgParticipant::connect(opts_as(&s, DB, "postgres"), Work::new())
        .await
        .unwrap();
    let lazy = PgParticipant::connect(opts_as(&s, DB, "lazy"), Work::new())
        .await
        .unwrap();
    let steps_as = |user: &str| {
        let mut o = PgStepOptions::new(
            "ledger",
            format!("host=127.0.0.1 port={} user={user} dbname={DB}", s.port()),
        );
        o.concurrency = 2;
        o
    };
    let usual_steps = PgStepStore::connect(steps_as("postgres"), Steps).await.unwrap();
    let lazy_steps = PgStepStore::connect(steps_as("lazy"), Steps).await.unwrap();

    // 1. The role says off.
    let a = crash_right_after(
        &mut s,
        lazy.handle(1.into(), Message::CommitOnePhase { term: 1 }, b"add:alice:1"),
    )
    .await;
    assert_eq!(a.unwrap(), ack());
    assert_eq!(
        balance(&s, "alice").await,
        101,
        "a one-phase commit acknowledged to a role with synchronous_commit = off was lost in the crash"
    );
    // 2. The handler says off for its transaction.
    let a = crash_right_after(
        &mut s,
        usual.handle(2.into(), Message::CommitOnePhase { term: 1 }, b"lazy-add:alice:10"),
    )
    .await;
    assert_eq!(a.unwrap(), ack());
    assert_eq!(
        balance(&s, "alice").await,
        111,
        "a one-phase commit whose handler set synchronous_commit = off was lost in the crash"
    );
    assert_eq!(
        usual.durable_entry(2.into()).await.unwrap().map(|e| e.state),
        Some(LocalState::Committed)
    );
    // 3. A step, the role says off.
    let r = crash_right_after(&mut s, lazy_steps.forward(&step("s1", "add", "bob:5"))).await;
    assert!(r.unwrap().is_ok());
    assert_eq!(
        balance(&s, "bob").await,
        5,
        "a step acknowledged to a role with synchronous_commit = off was lost in the crash"
    );
    assert!(usual_steps.status("s1").await.unwrap().is_some(), "its record too");
    // 4. A step whose handler says off.
    let r = crash_right_after(&mut s, usual_steps.forward(&step("s2", "lazy-add", "bob:7"))).await;
    assert!(r.unwrap().is_ok());
    assert_eq!(
        balance(&s, "bob").await,
        12,
        "a step whose handler set synchronous_commit = off was lost in the crash"
    );
    assert!(lazy_steps.status("s2").await.unwrap().is_some(), "its record too");
}

/// Every handler connection busy (handlers waiting on something that takes
/// long): the decision that would let them go on is still applied, on a
/// pool of its own.
#[tokio::test]
async fn decisions_are_applied_while_every_handler_connection_is_busy() {
    let Some(s) = server("t52 decisions pool") else {
        return;
    };
    let work = Work::new();
    let p = Arc::new(
        PgParticipant::connect(opts_as(&s, DB, "postgres"), work.clone())
            .await
            .unwrap(),
    );
    assert_eq!(
        p.handle(1.into(), Message::Prepare { term: 1 }, b"add:alice:1")
            .await
            .unwrap(),
        yes()
    );
    // Both handler connections (concurrency 2) held by handlers that wait.
    let busy = {
        let p = p.clone();
        tokio::spawn(async move {
            tokio::join!(
                p.handle(2.into(), Message::Prepare { term: 1 }, b"gate"),
                p.handle(3.into(), Message::Prepare { term: 1 }, b"gate")
            )
        })
    };
    while work.entered.load(Ordering::SeqCst) < 3 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let commit = tokio::time::timeout(
        Duration::from_secs(20),
        p.handle(1.into(), Message::Commit { term: 1 }, b""),
    )
    .await
    .expect("the Commit waited for a connection that the busy handlers hold: decisions starved");
    assert_eq!(commit.unwrap(), ack());
    assert_eq!(balance(&s, "alice").await, 101);
    // Recovery's reads too.
    let listed = tokio::time::timeout(Duration::from_secs(20), p.in_doubt_older_than(Duration::ZERO))
        .await
        .expect("recovery waited for a handler connection");
    assert!(listed.unwrap().is_empty());
    work.gate.add_permits(2);
    let (a, b) = busy.await.unwrap();
    assert_eq!(a.unwrap(), yes());
    assert_eq!(b.unwrap(), yes());
    for t in [2, 3] {
        p.handle(t.into(), Message::Abort { term: 1 }, b"").await.unwrap();
    }
}

/// A handler that waits for a row a prepared transaction holds (a wait
/// that lasts until that transaction's decision, which may itself wait for
/// this Prepare) gives up after the default handler lock timeout and votes
/// NO, saying why.
#[tokio::test]
async fn a_handler_waiting_on_a_prepared_row_votes_no_after_the_default_lock_timeout() {
    let Some(s) = server("t52 handler lock timeout") else {
        return;
    };
    let p = PgParticipant::connect(opts_as(&s, DB, "postgres"), Work::new())
        .await
        .unwrap();
    assert_eq!(
        p.handle(1.into(), Message::Prepare { term: 1 }, b"add:alice:1")
            .await
            .unwrap(),
        yes()
    );
    let second = tokio::time::timeout(
        Duration::from_secs(30),
        p.handle(2.into(), Message::Prepare { term: 1 }, b"add:alice:2"),
    )
    .await
    .expect("the handler waited on the prepared row's lock with no timeout")
    .unwrap();
    assert_eq!(second.reply, Reply::Vote(Vote::No), "{second:?}");
    let reason = second.reason;
    assert!(reason.contains("handler_lock_timeout_ms"), "{reason}");
    assert_eq!(
        p.durable_entry(2.into()).await.unwrap().map(|e| e.state),
        Some(LocalState::Aborted { tombstone: false }),
        "the NO is recorded: a repeat answers the same"
    );
    assert_eq!(
        p.handle(1.into(), Message::Commit { term: 1 }, b"").await.unwrap(),
        ack()
    );
    assert_eq!(balance(&s, "alice").await, 101);
}

/// The step store too: a step whose handler waits on a row another
/// transaction holds fails after the default lock timeout, naming the setting
/// and recording nothing (the same operation id then runs once the row is
/// free), instead of waiting for ever.
#[tokio::test]
async fn a_step_waiting_on_a_held_row_fails_after_the_default_lock_timeout() {
    let Some(s) = server("t52 step lock timeout") else {
        return;
    };
    let mut o = PgStepOptions::new("ledger", s.conn_string(DB));
    o.concurrency = 2;
    let steps = PgStepStore::connect(o, Steps).await.unwrap();
    let mut holder = participant_sdk::postgres::connect(&s.conn_string(DB)).await.unwrap();
    let held = holder.transaction().await.unwrap();
    held.execute("SELECT balance FROM accounts WHERE id = 'alice' FOR UPDATE", &[])
        .await
        .unwrap();
    let r = tokio::time::timeout(Duration::from_secs(30), steps.forward(&step("lk1", "add", "alice:1")))
        .await
        .expect("the step waited on the held row with no timeout");
    let e = r.expect_err("a step that could not lock its row is an error, not an answer");
    assert!(e.to_string().contains("handler_lock_timeout_ms"), "{e}");
    assert_eq!(steps.status("lk1").await.unwrap(), None, "nothing recorded");
    held.rollback().await.unwrap();
    assert!(steps.forward(&step("lk1", "add", "alice:1")).await.unwrap().is_ok());
    assert_eq!(balance(&s, "alice").await, 101);
}

/// A step call dropped while its handler's statement runs (the orchestrator
/// gave up on it) cancels that statement and does not hand its connection
/// to the next call.
#[tokio::test]
async fn a_step_call_dropped_while_its_handler_runs_cancels_the_statement() {
    let Some(s) = server("t52 step cancel on drop") else {
        return;
    };
    let mut o = PgStepOptions::new("ledger", s.conn_string(DB));
    o.concurrency = 1;
    let steps = PgStepStore::connect(o, Steps).await.unwrap();
    let dropped = tokio::time::timeout(Duration::from_millis(500), steps.forward(&step("sl1", "sleep", "600"))).await;
    assert!(dropped.is_err(), "still running when dropped");
    assert_no_pg_sleep_runs(&s).await;
    let next = tokio::time::timeout(Duration::from_secs(20), steps.forward(&step("add1", "add", "bob:1")))
        .await
        .expect("the next call waited behind the dropped call's statement");
    assert!(next.unwrap().is_ok());
    assert_eq!(balance(&s, "bob").await, 1);
    assert_eq!(steps.status("sl1").await.unwrap(), None, "nothing recorded");
}

/// A call dropped while its handler's statement runs (the coordinator gave
/// up on it) cancels that statement and does not hand its connection to the
/// next message.
#[tokio::test]
async fn a_call_dropped_while_its_handler_runs_cancels_the_statement() {
    let Some(s) = server("t52 cancel on drop") else {
        return;
    };
    let mut o = opts_as(&s, DB, "postgres");
    o.concurrency = 1;
    let p = PgParticipant::connect(o, Work::new()).await.unwrap();
    let dropped = tokio::time::timeout(
        Duration::from_millis(500),
        p.handle(1.into(), Message::Prepare { term: 1 }, b"sleep:600"),
    )
    .await;
    assert!(dropped.is_err(), "still running when dropped");
    assert_no_pg_sleep_runs(&s).await;
    // The only handler connection is usable at once by the next message.
    let next = tokio::time::timeout(
        Duration::from_secs(20),
        p.handle(2.into(), Message::CommitOnePhase { term: 1 }, b"add:bob:1"),
    )
    .await
    .expect("the next message waited behind the dropped call's statement");
    assert_eq!(next.unwrap(), ack());
    assert_eq!(balance(&s, "bob").await, 1);
    assert_eq!(p.durable_entry(1.into()).await.unwrap(), None, "nothing recorded");
}

/// No pooled connection free: the message waits a bounded time, then fails
/// as unavailable (the coordinator retries), saying which setting bounds
/// the wait, and is counted.
#[tokio::test]
async fn the_wait_for_a_pooled_connection_is_bounded_and_counted() {
    let Some(s) = server("t52 pool wait") else {
        return;
    };
    let (rec, h) = recorder();
    let _g = metrics::set_default_local_recorder(&rec);
    let mut o = opts_as(&s, DB, "postgres");
    o.concurrency = 1;
    let p = PgParticipant::connect(o, Work::new()).await.unwrap();
    let held = p.pool().get().await.unwrap();
    let r = tokio::time::timeout(
        Duration::from_secs(60),
        p.handle(1.into(), Message::Prepare { term: 1 }, b"add:alice:1"),
    )
    .await
    .expect("waited for a pooled connection with no bound");
    match r {
        Err(StoreError::Unavailable(m)) => assert!(m.contains("pool_wait_timeout_ms"), "{m}"),
        other => panic!("expected unavailable, got {other:?}"),
    }
    assert_eq!(
        sample(
            &h,
            r#"dtx_participant_pg_pool_wait_timeouts_total{participant="acct",pool="handlers"}"#
        ),
        Some(1.0),
        "{}",
        h.render()
    );
    drop(held);
    assert_eq!(
        p.handle(1.into(), Message::Prepare { term: 1 }, b"add:alice:1")
            .await
            .unwrap(),
        yes()
    );
    p.handle(1.into(), Message::Abort { term: 1 }, b"").await.unwrap();
}

/// Prepared transactions hold a slot of `max_prepared_transactions` until
/// their decision, whichever connection made them, and every database of
/// the server shares the slots: two participants with 2 connections each
/// fill 4 slots; the next Prepare votes NO saying which limit to raise, is
/// counted, and the free slots are reported.
#[tokio::test]
async fn running_out_of_prepared_transaction_slots_votes_no_names_the_limit_and_is_counted() {
    let Some(s) = server_in(
        "t52 prepared slots",
        PgServerOptions {
            max_prepared_transactions: 4,
            ..PgServerOptions::default()
        },
        &["bank_a", "bank_b"],
    ) else {
        return;
    };
    let (rec, h) = recorder();
    let _g = metrics::set_default_local_recorder(&rec);
    let a = PgParticipant::connect(
        PgOptions {
            participant_id: "a".into(),
            ..opts_as(&s, "bank_a", "postgres")
        },
        Work::new(),
    )
    .await
    .unwrap();
    let b = PgParticipant::connect(
        PgOptions {
            participant_id: "b".into(),
            ..opts_as(&s, "bank_b", "postgres")
        },
        Work::new(),
    )
    .await
    .unwrap();
    // Different rows: a prepared transaction keeps its row locks.
    for (t, work) in [(1u64, &b"add:alice:1"[..]), (2, b"add:bob:1"), (3, b"add:carol:1")] {
        assert_eq!(
            a.handle(t.into(), Message::Prepare { term: 1 }, work).await.unwrap(),
            yes(),
            "more prepared transactions than connections"
        );
    }
    assert_eq!(
        b.handle(1.into(), Message::Prepare { term: 1 }, b"add:alice:1")
            .await
            .unwrap(),
        yes()
    );
    let full = b.handle(2.into(), Message::Prepare { term: 1 }, b"add:bob:1").await;
    let full = match full {
        Ok(a) => a,
        Err(e) => panic!("expected a NO vote naming the limit, got the error {e}"),
    };
    assert_eq!(full.reply, Reply::Vote(Vote::No), "{full:?}");
    let reason = full.reason;
    assert!(reason.contains("max_prepared_transactions"), "{reason}");
    assert!(reason.contains("every database"), "{reason}");
    assert_eq!(
        sample(
            &h,
            r#"dtx_participant_pg_prepared_slots_exhausted_total{participant="b"}"#
        ),
        Some(1.0),
        "{}",
        h.render()
    );
    assert_eq!(
        b.durable_entry(2.into()).await.unwrap().map(|e| e.state),
        Some(LocalState::Aborted { tombstone: false })
    );
    b.in_doubt_older_than(Duration::ZERO).await.unwrap();
    assert_eq!(
        sample(&h, r#"dtx_participant_pg_prepared_slots_free{participant="b"}"#),
        Some(0.0),
        "{}",
        h.render()
    );
    // A slot freed by a decision in the other database is usable here.
    assert_eq!(
        a.handle(1.into(), Message::Commit { term: 1 }, b"").await.unwrap(),
        ack()
    );
    assert_eq!(
        b.handle(3.into(), Message::Prepare { term: 1 }, b"add:bob:1")
            .await
            .unwrap(),
        yes()
    );
    b.in_doubt_older_than(Duration::ZERO).await.unwrap();
    assert_eq!(
        sample(&h, r#"dtx_participant_pg_prepared_slots_free{participant="b"}"#),
        Some(0.0)
    );
    for t in [2, 3] {
        a.handle(t.into(), Message::Abort { term: 1 }, b"").await.unwrap();
    }
    for t in [1, 3] {
        b.handle(t.into(), Message::Abort { term: 1 }, b"").await.unwrap();
    }
}

/// After the service's database role is rotated, PostgreSQL refuses COMMIT
/// PREPARED and ROLLBACK PREPARED of the transactions the old role
/// prepared (SQLSTATE 42501). The error names both roles and the fix, each
/// refusal is counted, nothing is dropped (the decision stays to be
/// retried), and once the new role is granted the old one the decisions
/// are applied.
#[tokio::test]
async fn a_decision_refused_after_a_role_rotation_says_how_to_fix_it_and_applies_once_fixed() {
    let Some(s) = server("t52 role rotation") else {
        return;
    };
    let (rec, h) = recorder();
    let _g = metrics::set_default_local_recorder(&rec);
    // The tables, made by their owner; both roles may use them.
    PgParticipant::connect(opts_as(&s, DB, "postgres"), Work::new())
        .await
        .unwrap();
    s.execute(
        DB,
        "CREATE ROLE svc_v1 LOGIN; CREATE ROLE svc_v2 LOGIN;
         GRANT SELECT, INSERT, UPDATE, DELETE ON accounts, dtx_participant_log, dtx_participant_log_inc,
             dtx_participant_term_floor, dtx_participant_branch, dtx_participant_raised_term TO svc_v1, svc_v2",
    )
    .unwrap();
    let old = PgParticipant::connect(opts_as(&s, DB, "svc_v1"), Work::new())
        .await
        .unwrap();
    for (t, work) in [(1u64, &b"add:alice:1"[..]), (2, &b"add:bob:3"[..])] {
        assert_eq!(
            old.handle(t.into(), Message::Prepare { term: 1 }, work).await.unwrap(),
            yes()
        );
    }
    drop(old);
    let new = PgParticipant::connect(opts_as(&s, DB, "svc_v2"), Work::new())
        .await
        .unwrap();
    for (t, msg, stmt) in [
        (1u64, Message::Commit { term: 1 }, "commit_prepared"),
        (2, Message::Abort { term: 1 }, "rollback_prepared"),
    ] {
        let e = new.handle(t.into(), msg, b"").await.expect_err("refused by PostgreSQL");
        let m = e.to_string();
        for part in ["svc_v1", "svc_v2", "GRANT svc_v1 TO svc_v2", "42501"] {
            assert!(m.contains(part), "{part:?} missing from: {m}");
        }
        assert!(
            !matches!(e, StoreError::Refused(_)),
            "a refusal would never be retried: {e:?}"
        );
        assert_eq!(
            sample(
                &h,
                &format!(r#"dtx_participant_pg_permission_denied_total{{participant="acct",statement="{stmt}"}}"#)
            ),
            Some(1.0),
            "{}",
            h.render()
        );
    }
    // Still in doubt, nothing applied.
    assert_eq!(new.in_doubt_older_than(Duration::ZERO).await.unwrap().len(), 2);
    assert_eq!(balance(&s, "alice").await, 100);
    s.execute(DB, "GRANT svc_v1 TO svc_v2").unwrap();
    assert_eq!(
        new.handle(1.into(), Message::Commit { term: 1 }, b"").await.unwrap(),
        ack()
    );
    assert_eq!(
        new.handle(2.into(), Message::Abort { term: 1 }, b"").await.unwrap(),
        ack()
    );
    assert!(new.in_doubt_older_than(Duration::ZERO).await.unwrap().is_empty());
    assert_eq!(balance(&s, "alice").await, 101);
    assert_eq!(balance(&s, "bob").await, 0);
    // The connection went back to its own role.
    let c = new.pool().get().await.unwrap();
    let who: String = c.query_one("SELECT current_user::text", &[]).await.unwrap().get(0);
    assert_eq!(who, "svc_v2");
}

/// The settings with units in their names are checked at start, before
/// any connection, each refusal naming the setting and what it may be.
#[tokio::test]
async fn the_pool_and_handler_settings_are_checked_with_clear_errors() {
    let base = || PgOptions::new(ID, "host=127.0.0.1 port=1 user=postgres dbname=x");
    assert_eq!(base().validate(), Ok(()));
    for (o, says) in [
        (
            PgOptions {
                pool_wait_timeout_ms: 0,
                ..base()
            },
            "pool_wait_timeout_ms is 0",
        ),
        (
            PgOptions {
                decision_pool_size: 0,
                ..base()
            },
            "decision_pool_size is 0",
        ),
        (
            PgOptions {
                concurrency: 0,
                ..base()
            },
            "concurrency is 0",
        ),
        (
            PgOptions {
                handler_lock_timeout_ms: 1 << 40,
                ..base()
            },
            "handler_lock_timeout_ms is 1099511627776; at most 2147483647",
        ),
        (
            PgOptions {
                handler_statement_timeout_ms: 1 << 40,
                ..base()
            },
            "handler_statement_timeout_ms",
        ),
    ] {
        let e = PgParticipant::connect(o, Work::new())
            .await
            .err()
            .unwrap_or_else(|| panic!("{says}: accepted"))
            .to_string();
        assert!(e.contains(says), "{says:?} missing from: {e}");
    }
}

/// A handler statement running past `handler_statement_timeout_ms` is
/// cancelled; the Prepare (and a one-phase commit) votes NO saying so,
/// counted; with a handler lock timeout of 0 (no limit) a lock is waited
/// for as long as it is held.
#[tokio::test]
async fn a_handler_statement_past_its_timeout_votes_no() {
    let Some(s) = server("t52 handler statement timeout") else {
        return;
    };
    let (rec, h) = recorder();
    let _g = metrics::set_default_local_recorder(&rec);
    let mut o = opts_as(&s, DB, "postgres");
    o.handler_statement_timeout_ms = 300;
    let p = PgParticipant::connect(o, Work::new()).await.unwrap();
    for (t, msg) in [
        (1u64, Message::Prepare { term: 1 }),
        (2, Message::CommitOnePhase { term: 1 }),
    ] {
        let a = tokio::time::timeout(Duration::from_secs(30), p.handle(t.into(), msg, b"sleep:600"))
            .await
            .expect("the statement ran on")
            .unwrap();
        assert_eq!(a.reply, Reply::Vote(Vote::No), "{a:?}");
        assert!(a.reason.contains("handler_statement_timeout_ms = 300"), "{}", a.reason);
    }
    assert_eq!(
        sample(
            &h,
            r#"dtx_participant_pg_handler_timeouts_total{participant="acct",kind="statement_timeout"}"#
        ),
        Some(2.0),
        "{}",
        h.render()
    );
    // No lock limit (0): a wait on a row locked in another session lasts
    // until that session lets go, past the default 1 s.
    let mut o = opts_as(&s, DB, "postgres");
    o.handler_lock_timeout_ms = 0;
    let p = PgParticipant::connect(o, Work::new()).await.unwrap();
    let mut other = participant_sdk::postgres::connect(&s.conn_string(DB)).await.unwrap();
    let locker = other.transaction().await.unwrap();
    locker
        .execute("UPDATE accounts SET balance = balance WHERE id = 'carol'", &[])
        .await
        .unwrap();
    let (a, ()) = tokio::join!(
        p.handle(4.into(), Message::CommitOnePhase { term: 1 }, b"add:carol:1"),
        async {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            locker.commit().await.unwrap();
        }
    );
    assert_eq!(a.unwrap(), ack(), "waited past the default 1 s lock timeout");
    assert_eq!(balance(&s, "carol").await, 1);
}
