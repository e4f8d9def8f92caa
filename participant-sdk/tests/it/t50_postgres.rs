//! The PostgreSQL participant (`postgres::PgParticipant`, ADR 0015) against
//! a real PostgreSQL server started by dtx-pg-server: the contract of
//! `log::step` (invariants 5, 8 and 9) kept with PostgreSQL's prepared
//! transactions, across a crash of PostgreSQL, and the start-up checks.
//!
//! Without the PostgreSQL server binaries each test prints a loud message
//! and passes, unless DTX_REQUIRE_POSTGRES=1 (CI), where it fails.

#![cfg(feature = "postgres")]

use std::time::Duration;
use std::time::Instant;

use dtx_pg_server::PgServer;
use dtx_pg_server::PgServerOptions;
use participant_sdk::log::LocalState;
use participant_sdk::log::LogEntry;
use participant_sdk::log::Message;
use participant_sdk::log::Refusal;
use participant_sdk::log::Vote;
use participant_sdk::participant::Answer;
use participant_sdk::participant::Participant;
use participant_sdk::participant::Verdict;
use participant_sdk::postgres::HandlerError;
use participant_sdk::postgres::PgHandler;
use participant_sdk::postgres::PgOptions;
use participant_sdk::postgres::PgParticipant;
use participant_sdk::postgres::Transaction;
use participant_sdk::store::PhaseTwo;
use participant_sdk::store::Reply;
use participant_sdk::store::StoreError;
use participant_sdk::GlobalTxid;

const DB: &str = "bank";
const ID: &str = "acct";

/// The payload `name:+N` / `name:-N` moves N into / out of the account;
/// `read:name` only reads (READ_ONLY). A balance below zero votes NO.
struct Accounts;

impl PgHandler for Accounts {
    async fn prepare(&self, tx: &Transaction<'_>, _txid: GlobalTxid, payload: &[u8]) -> Result<Verdict, HandlerError> {
        let text = std::str::from_utf8(payload)?;
        let (name, amount) = text.split_once(':').ok_or("bad payload")?;
        if name == "unpreparable" {
            // Work PostgreSQL refuses to prepare, then a YES.
            let sql = match amount {
                "temp" => "CREATE TEMP TABLE scratch (x int)",
                "notify" => "NOTIFY balances",
                "hold" => "DECLARE held CURSOR WITH HOLD FOR SELECT id FROM accounts",
                other => return Err(format!("no such case {other}").into()),
            };
            tx.batch_execute("UPDATE accounts SET balance = balance + 1 WHERE id = 'carol'")
                .await?;
            tx.batch_execute(sql).await?;
            return Ok(Verdict::yes());
        }
        if name == "read" {
            tx.query_one("SELECT balance FROM accounts WHERE id = $1", &[&amount])
                .await?;
            return Ok(Verdict::read_only());
        }
        let amount: i64 = amount.parse()?;
        // A row locked by a prepared transaction stays locked until its
        // decision: vote NO after a while instead of waiting for it.
        tx.batch_execute("SET LOCAL lock_timeout = '2s'").await?;
        let row = tx
            .query_one(
                "UPDATE accounts SET balance = balance + $2 WHERE id = $1 RETURNING balance",
                &[&name, &amount],
            )
            .await?;
        let balance: i64 = row.get(0);
        if balance < 0 {
            return Ok(Verdict::no(format!("insufficient funds in {name}: {balance}")));
        }
        Ok(Verdict::yes())
    }
}

/// A server with database `bank` and accounts alice = 100, bob = 0,
/// carol = 50; `None`
/// (after a loud message) when PostgreSQL is not installed and not required.
fn server(opts: PgServerOptions) -> Option<PgServer> {
    let opts = PgServerOptions {
        kill_with_parent_thread: true,
        ..opts
    };
    let s = dtx_pg_server::start_or_skip("t50_postgres", opts)?;
    s.create_database(DB).unwrap();
    s.execute(
        DB,
        "CREATE TABLE accounts (id text PRIMARY KEY, balance bigint NOT NULL);
         INSERT INTO accounts VALUES ('alice', 100), ('bob', 0), ('carol', 50)",
    )
    .unwrap();
    Some(s)
}

fn opts(s: &PgServer) -> PgOptions {
    let mut o = PgOptions::new(ID, s.conn_string(DB));
    o.concurrency = 8;
    o
}

async fn setup() -> Option<(PgServer, PgParticipant<Accounts>)> {
    let s = server(PgServerOptions::default())?;
    let p = PgParticipant::connect(opts(&s), Accounts).await.unwrap();
    Some((s, p))
}

async fn balance(p: &PgParticipant<Accounts>, name: &str) -> i64 {
    let c = p.pool().get().await.unwrap();
    c.query_one("SELECT balance FROM accounts WHERE id = $1", &[&name])
        .await
        .unwrap()
        .get(0)
}

async fn gids(p: &PgParticipant<Accounts>) -> Vec<String> {
    let c = p.pool().get().await.unwrap();
    c.query("SELECT gid FROM pg_prepared_xacts ORDER BY gid", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

fn yes() -> Answer {
    Answer::new(Reply::Vote(Vote::Yes))
}

fn ack() -> Answer {
    Answer::new(Reply::Ack)
}

fn refusal(r: Result<Answer, StoreError>) -> Refusal {
    match r {
        Err(StoreError::Refused(r)) => r,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[tokio::test]
async fn inv8_commit_applies_once_and_redelivered_commit_acks_after_gid_is_gone() {
    let Some((_s, p)) = setup().await else { return };
    assert_eq!(
        p.handle(1.into(), Message::Prepare { term: 1 }, b"alice:+10")
            .await
            .unwrap(),
        yes()
    );
    assert_eq!(gids(&p).await, vec![p.gid(1, 1)]);
    assert_eq!(
        p.durable_entry(1.into()).await.unwrap(),
        Some(LogEntry {
            state: LocalState::Prepared { vote: Vote::Yes },
            term: 1
        })
    );
    // Idempotent Prepare: the same vote, nothing prepared twice.
    assert_eq!(
        p.handle(1.into(), Message::Prepare { term: 1 }, b"alice:+10")
            .await
            .unwrap(),
        yes()
    );
    assert_eq!(balance(&p, "alice").await, 100, "not visible before the decision");
    assert_eq!(
        p.handle(1.into(), Message::Commit { term: 1 }, b"").await.unwrap(),
        ack()
    );
    assert_eq!(balance(&p, "alice").await, 110);
    assert!(gids(&p).await.is_empty(), "PostgreSQL forgot the gid");
    // Redelivered in the same term: the gid it names is gone, so the
    // marker row answers; nothing applied twice.
    assert_eq!(
        p.handle(1.into(), Message::Commit { term: 1 }, b"").await.unwrap(),
        ack()
    );
    assert_eq!(balance(&p, "alice").await, 110);
    // Redelivered in a later term: the marker row answers, nothing applied twice.
    assert_eq!(
        p.handle(1.into(), Message::Commit { term: 2 }, b"").await.unwrap(),
        ack()
    );
    assert_eq!(
        p.handle(1.into(), Message::Prepare { term: 2 }, b"alice:+10")
            .await
            .unwrap(),
        yes()
    );
    assert_eq!(balance(&p, "alice").await, 110);
    assert_eq!(
        p.durable_entry(1.into()).await.unwrap(),
        Some(LogEntry {
            state: LocalState::Committed,
            term: 2
        })
    );
    assert_eq!(
        refusal(p.handle(1.into(), Message::Abort { term: 2 }, b"").await),
        Refusal::AbortAfterCommit
    );
}

#[tokio::test]
async fn inv8_abort_before_prepare_leaves_tombstone_and_late_prepare_votes_no() {
    let Some((_s, p)) = setup().await else { return };
    assert_eq!(
        p.handle(2.into(), Message::Abort { term: 1 }, b"").await.unwrap(),
        ack()
    );
    assert_eq!(
        p.durable_entry(2.into()).await.unwrap(),
        Some(LogEntry {
            state: LocalState::Aborted { tombstone: true },
            term: 1
        })
    );
    let a = p
        .handle(2.into(), Message::Prepare { term: 1 }, b"alice:+10")
        .await
        .unwrap();
    assert_eq!(a.reply, Reply::Vote(Vote::No), "{a:?}");
    assert!(gids(&p).await.is_empty());
    assert_eq!(balance(&p, "alice").await, 100);
    assert_eq!(
        p.handle(2.into(), Message::Abort { term: 1 }, b"").await.unwrap(),
        ack()
    );
    assert_eq!(
        refusal(p.handle(2.into(), Message::Commit { term: 1 }, b"").await),
        Refusal::CommitAfterAbort
    );
}

#[tokio::test]
async fn inv8_abort_after_prepare_rolls_back_once() {
    let Some((_s, p)) = setup().await else { return };
    assert_eq!(
        p.handle(3.into(), Message::Prepare { term: 1 }, b"alice:-30")
            .await
            .unwrap(),
        yes()
    );
    assert_eq!(
        p.handle(3.into(), Message::Abort { term: 1 }, b"").await.unwrap(),
        ack()
    );
    assert!(gids(&p).await.is_empty());
    assert_eq!(balance(&p, "alice").await, 100);
    assert_eq!(
        p.handle(3.into(), Message::Abort { term: 1 }, b"").await.unwrap(),
        ack()
    );
    assert_eq!(
        p.handle(3.into(), Message::Prepare { term: 1 }, b"alice:-30")
            .await
            .unwrap()
            .reply,
        Reply::Vote(Vote::No)
    );
    assert_eq!(
        refusal(p.handle(3.into(), Message::Commit { term: 1 }, b"").await),
        Refusal::CommitAfterAbort
    );
    assert_eq!(
        p.durable_entry(3.into()).await.unwrap(),
        Some(LogEntry {
            state: LocalState::Aborted { tombstone: false },
            term: 1
        })
    );
}

#[tokio::test]
async fn inv9_stale_term_commit_refused() {
    let Some((_s, p)) = setup().await else { return };
    assert_eq!(
        p.handle(4.into(), Message::Prepare { term: 5 }, b"alice:+1")
            .await
            .unwrap(),
        yes()
    );
    assert_eq!(
        refusal(p.handle(4.into(), Message::Commit { term: 4 }, b"").await),
        Refusal::StaleTerm { got: 4, seen: 5 }
    );
    assert_eq!(
        refusal(p.handle(4.into(), Message::Abort { term: 4 }, b"").await),
        Refusal::StaleTerm { got: 4, seen: 5 }
    );
    assert_eq!(gids(&p).await, vec![p.gid(4, 5)], "still prepared");
    assert_eq!(balance(&p, "alice").await, 100);
    assert_eq!(
        p.handle(4.into(), Message::Commit { term: 6 }, b"").await.unwrap(),
        ack()
    );
    assert_eq!(balance(&p, "alice").await, 101);
    // Once decided, the row's term (raised by the Commit) fences.
    assert_eq!(
        refusal(p.handle(4.into(), Message::Commit { term: 5 }, b"").await),
        Refusal::StaleTerm { got: 5, seen: 6 }
    );
}

/// A Prepare repeated by a newer leader while prepared raises the term
/// (the gid keeps the first Prepare's): older terms are refused from then
/// on, also by a participant started again on the same database; the
/// decision at the raised term applies once and the raised row goes with
/// it (the conformance kit's rule `fence.raised`, docs/conformance.md).
#[tokio::test]
async fn inv9_a_term_raised_while_prepared_fences_and_survives_a_restart() {
    use participant_sdk::participant::Participant;
    let Some((s, p)) = setup().await else { return };
    let db = participant_sdk::postgres::connect(&s.conn_string(DB)).await.unwrap();
    let raised_rows = || async {
        let n: i64 = db
            .query_one("SELECT count(*) FROM dtx_participant_raised_term", &[])
            .await
            .unwrap()
            .get(0);
        n
    };
    let x: GlobalTxid = 4.into();
    assert_eq!(
        p.handle(x, Message::Prepare { term: 5 }, b"alice:+1").await.unwrap(),
        yes()
    );
    assert_eq!(
        p.handle(x, Message::Prepare { term: 7 }, b"alice:+1").await.unwrap(),
        yes()
    );
    assert_eq!(
        gids(&p).await,
        vec![p.gid(4, 5)],
        "the gid keeps the first Prepare's term"
    );
    assert_eq!(raised_rows().await, 1);
    assert_eq!(
        refusal(p.handle(x, Message::Commit { term: 6 }, b"").await),
        Refusal::StaleTerm { got: 6, seen: 7 }
    );
    // The fast path's gid (term 5) exists, yet the raised term refuses it.
    assert_eq!(
        refusal(p.handle(x, Message::Commit { term: 5 }, b"").await),
        Refusal::StaleTerm { got: 5, seen: 7 }
    );
    drop(p);
    let p = PgParticipant::connect(opts(&s), Accounts).await.unwrap();
    assert_eq!(
        refusal(p.handle(x, Message::Abort { term: 6 }, b"").await),
        Refusal::StaleTerm { got: 6, seen: 7 }
    );
    let entry = p.durable_entry(x).await.unwrap().unwrap();
    assert_eq!(entry.term, 7, "Inquire shows the raised term");
    assert_eq!(balance(&p, "alice").await, 100, "nothing applied by the refusals");
    assert_eq!(p.handle(x, Message::Commit { term: 7 }, b"").await.unwrap(), ack());
    assert_eq!(balance(&p, "alice").await, 101);
    assert_eq!(raised_rows().await, 0, "the raised row goes with the decision");
    assert_eq!(
        refusal(p.handle(x, Message::Commit { term: 6 }, b"").await),
        Refusal::StaleTerm { got: 6, seen: 7 }
    );
    assert_eq!(p.handle(x, Message::Commit { term: 7 }, b"").await.unwrap(), ack());
    assert_eq!(balance(&p, "alice").await, 101, "applied once");
}

#[tokio::test]
async fn no_vote_carries_the_handlers_reason() {
    let Some((_s, p)) = setup().await else { return };
    let a = p
        .handle(5.into(), Message::Prepare { term: 1 }, b"bob:-10")
        .await
        .unwrap();
    assert_eq!(a.reply, Reply::Vote(Vote::No));
    assert!(a.reason.contains("insufficient funds in bob"), "{a:?}");
    assert!(gids(&p).await.is_empty());
    assert_eq!(balance(&p, "bob").await, 0, "rolled back");
    // A redelivered Prepare votes NO again.
    let again = p
        .handle(5.into(), Message::Prepare { term: 1 }, b"bob:-10")
        .await
        .unwrap();
    assert_eq!(again.reply, Reply::Vote(Vote::No));
    assert_eq!(
        refusal(p.handle(5.into(), Message::Commit { term: 1 }, b"").await),
        Refusal::CommitAfterAbort
    );
}

/// What PostgreSQL cannot prepare (a temporary table, NOTIFY, a cursor
/// WITH HOLD) is a firm NO naming the restriction, not an error the
/// coordinator would retry until the deadline: nothing stays prepared, the
/// handler's other work is rolled back, a repeat votes NO again.
#[tokio::test]
async fn what_postgres_cannot_prepare_is_a_no_vote_naming_the_restriction() {
    let Some((_s, p)) = setup().await else { return };
    for (txid, case, says) in [
        (20u64, "temp", "temporary"),
        (21, "notify", "NOTIFY"),
        (22, "hold", "WITH HOLD"),
    ] {
        let payload = format!("unpreparable:{case}");
        let a = p
            .handle(txid.into(), Message::Prepare { term: 1 }, payload.as_bytes())
            .await
            .unwrap();
        assert_eq!(a.reply, Reply::Vote(Vote::No), "{case}: {a:?}");
        assert!(
            a.reason.contains("cannot prepare what the handler did"),
            "{case}: {a:?}"
        );
        assert!(a.reason.contains(says), "{case}: {a:?}");
        assert!(a.reason.contains("SQLSTATE 0A000"), "{case}: {a:?}");
        assert!(gids(&p).await.is_empty(), "{case}: nothing prepared");
        assert_eq!(
            balance(&p, "carol").await,
            50,
            "{case}: the handler's update rolled back"
        );
        let again = p
            .handle(txid.into(), Message::Prepare { term: 1 }, payload.as_bytes())
            .await
            .unwrap();
        assert_eq!(again.reply, Reply::Vote(Vote::No), "{case}: a repeat votes NO");
        assert_eq!(
            refusal(p.handle(txid.into(), Message::Commit { term: 1 }, b"").await),
            Refusal::CommitAfterAbort,
            "{case}"
        );
    }
}

#[tokio::test]
async fn inv8_commit_without_prepare_refused() {
    let Some((_s, p)) = setup().await else { return };
    assert_eq!(
        refusal(p.handle(6.into(), Message::Commit { term: 1 }, b"").await),
        Refusal::CommitWithoutPrepare
    );
    assert_eq!(p.durable_entry(6.into()).await.unwrap(), None);
}

#[tokio::test]
async fn read_only_and_one_phase() {
    let Some((_s, p)) = setup().await else { return };
    let ro = Answer::new(Reply::Vote(Vote::ReadOnly));
    assert_eq!(
        p.handle(7.into(), Message::Prepare { term: 1 }, b"read:alice")
            .await
            .unwrap(),
        ro
    );
    assert_eq!(
        p.handle(7.into(), Message::Prepare { term: 1 }, b"read:alice")
            .await
            .unwrap(),
        ro
    );
    assert!(gids(&p).await.is_empty());
    assert_eq!(
        p.handle(8.into(), Message::CommitOnePhase { term: 1 }, b"alice:+5")
            .await
            .unwrap(),
        ack()
    );
    assert_eq!(
        p.handle(8.into(), Message::CommitOnePhase { term: 1 }, b"alice:+5")
            .await
            .unwrap(),
        ack()
    );
    assert_eq!(balance(&p, "alice").await, 105);
    let no = p
        .handle(9.into(), Message::CommitOnePhase { term: 1 }, b"bob:-1")
        .await
        .unwrap();
    assert_eq!(no.reply, Reply::Vote(Vote::No));
    assert!(no.reason.contains("insufficient"), "{no:?}");
}

#[tokio::test]
async fn inv5_prepared_transaction_survives_postgres_crash_and_commit_resolves_it() {
    let Some((mut s, p)) = setup().await else { return };
    assert_eq!(
        p.handle(10.into(), Message::Prepare { term: 3 }, b"alice:+7")
            .await
            .unwrap(),
        yes()
    );
    s.kill9();
    s.restart().unwrap();
    // The pool's connections died with the server; new ones are made.
    let mut listed = None;
    for _ in 0..20 {
        match p.in_doubt_older_than(Duration::ZERO).await {
            Ok(l) => {
                listed = Some(l);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let prepared = LogEntry {
        state: LocalState::Prepared { vote: Vote::Yes },
        term: 3,
    };
    assert_eq!(listed.unwrap(), vec![(10.into(), prepared)]);
    assert_eq!(gids(&p).await, vec![p.gid(10, 3)]);
    assert_eq!(p.durable_entry(10.into()).await.unwrap(), Some(prepared));
    assert_eq!(balance(&p, "alice").await, 100, "never decided on its own");
    assert_eq!(
        p.handle(10.into(), Message::Commit { term: 3 }, b"").await.unwrap(),
        ack()
    );
    assert_eq!(balance(&p, "alice").await, 107);
    assert!(p.in_doubt_older_than(Duration::ZERO).await.unwrap().is_empty());
}

#[tokio::test]
async fn prepared_gid_of_another_prefix_is_never_listed_or_touched() {
    let Some((s, p)) = setup().await else { return };
    // Another participant (a longer id with ours as its start), something
    // else entirely, and our own prefix in another database.
    s.execute(
        DB,
        "BEGIN; UPDATE accounts SET balance = 1 WHERE id = 'bob'; PREPARE TRANSACTION 'dtx:v1:acct2:11:1'",
    )
    .unwrap();
    s.execute(DB, "BEGIN; PREPARE TRANSACTION 'app-11'").unwrap();
    s.create_database("other").unwrap();
    s.execute("other", "BEGIN; PREPARE TRANSACTION 'dtx:v1:acct:11:1'")
        .unwrap();
    let foreign = vec![
        "app-11".to_string(),
        "dtx:v1:acct2:11:1".to_string(),
        "dtx:v1:acct:11:1".to_string(),
    ];
    assert_eq!(gids(&p).await, foreign);
    assert!(p.in_doubt_older_than(Duration::ZERO).await.unwrap().is_empty());
    assert_eq!(p.durable_entry(11.into()).await.unwrap(), None);
    assert_eq!(
        refusal(p.handle(11.into(), Message::Commit { term: 1 }, b"").await),
        Refusal::CommitWithoutPrepare
    );
    assert_eq!(
        p.handle(11.into(), Message::Abort { term: 1 }, b"").await.unwrap(),
        ack()
    );
    assert_eq!(gids(&p).await, foreign, "untouched");
}

#[tokio::test]
async fn batches_prepare_many_and_apply_decisions_answer_in_order() {
    let Some((_s, p)) = setup().await else { return };
    let items: Vec<(GlobalTxid, u64, &[u8])> = vec![
        (20.into(), 1, b"alice:-10"),
        (21.into(), 1, b"bob:-10"),
        (22.into(), 1, b"read:alice"),
        (23.into(), 1, b"carol:-20"),
    ];
    let v = p.prepare_many(&items).await.unwrap();
    let votes: Vec<Vote> = v.iter().map(|r| r.as_ref().unwrap().vote).collect();
    assert_eq!(votes, vec![Vote::Yes, Vote::No, Vote::ReadOnly, Vote::Yes]);
    let d = p
        .apply_decisions(&[
            (20.into(), PhaseTwo::Commit { term: 1 }),
            (23.into(), PhaseTwo::Abort { term: 1 }),
            (24.into(), PhaseTwo::Commit { term: 1 }),
        ])
        .await
        .unwrap();
    assert!(d[0].is_ok() && d[1].is_ok(), "{d:?}");
    assert!(
        matches!(d[2], Err(StoreError::Refused(Refusal::CommitWithoutPrepare))),
        "{d:?}"
    );
    assert_eq!(balance(&p, "alice").await, 90);
    assert_eq!(balance(&p, "carol").await, 50);
    // Log garbage collection over the decided rows.
    let all = p.gc_candidates_after(None, u64::MAX, 100).await.unwrap();
    let txids: std::collections::BTreeSet<u64> = all.iter().map(|x| x.1.txid).collect();
    assert_eq!(txids, [20, 21, 22, 23].into_iter().collect());
    let first = p.gc_candidates_after(None, u64::MAX, 1).await.unwrap();
    let rest = p.gc_candidates_after(Some(first[0]), u64::MAX, 100).await.unwrap();
    assert_eq!(rest.len(), 3);
    assert_eq!(p.forget_records(&all).await.unwrap(), 4);
    assert_eq!(p.durable_entry(20.into()).await.unwrap(), None);
}

#[tokio::test]
async fn startup_refuses_max_prepared_transactions_zero() {
    let Some(s) = server(PgServerOptions {
        max_prepared_transactions: 0,
        ..PgServerOptions::default()
    }) else {
        return;
    };
    let e = PgParticipant::connect(opts(&s), Accounts).await.err().expect("refused");
    let msg = e.to_string();
    assert!(msg.contains("max_prepared_transactions is 0"), "{msg}");
    assert!(msg.contains("postgresql.conf"), "{msg}");
}

#[tokio::test]
async fn startup_refuses_max_prepared_transactions_below_concurrency() {
    let Some(s) = server(PgServerOptions {
        max_prepared_transactions: 4,
        ..PgServerOptions::default()
    }) else {
        return;
    };
    let e = PgParticipant::connect(opts(&s), Accounts).await.err().expect("refused");
    assert!(e.to_string().contains("below this participant's concurrency 8"), "{e}");
}

#[tokio::test]
async fn startup_unreachable_port_fails_after_bounded_retries() {
    // Needs no PostgreSQL: nothing listens on this port.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut o = PgOptions::new(ID, format!("host=127.0.0.1 port={port} user=postgres dbname={DB}"));
    o.connect_attempts = 3;
    o.connect_backoff = Duration::from_millis(50);
    let began = Instant::now();
    let e = PgParticipant::connect(o, Accounts).await.err().expect("unreachable");
    let msg = e.to_string();
    assert!(
        began.elapsed() < Duration::from_secs(20),
        "bounded: {:?}",
        began.elapsed()
    );
    assert!(msg.contains(&format!("127.0.0.1:{port}")), "{msg}");
    assert!(msg.contains("3 connection attempts"), "{msg}");
}

#[tokio::test]
async fn participant_ids_are_checked() {
    for bad in ["", "a:b", &"x".repeat(200)] {
        let o = PgOptions::new(bad, "host=127.0.0.1 port=1 user=postgres dbname=x");
        assert!(PgParticipant::connect(o, Accounts).await.is_err(), "{bad:?}");
    }
}

/// Accounts, but the handler waits for `gate` after telling `entered`.
struct Gated {
    entered: std::sync::Arc<tokio::sync::Notify>,
    gate: std::sync::Arc<tokio::sync::Notify>,
}

impl PgHandler for Gated {
    async fn prepare(&self, tx: &Transaction<'_>, txid: GlobalTxid, payload: &[u8]) -> Result<Verdict, HandlerError> {
        self.entered.notify_one();
        self.gate.notified().await;
        Accounts.prepare(tx, txid, payload).await
    }
}

#[tokio::test]
async fn inv8_abort_during_prepare_in_another_session_wins_and_prepare_votes_no() {
    let Some((s, b)) = setup().await else { return };
    let entered = std::sync::Arc::new(tokio::sync::Notify::new());
    let gate = std::sync::Arc::new(tokio::sync::Notify::new());
    let a = PgParticipant::connect(
        opts(&s),
        Gated {
            entered: entered.clone(),
            gate: gate.clone(),
        },
    )
    .await
    .unwrap();
    let prepare = a.handle(30.into(), Message::Prepare { term: 1 }, b"alice:+1");
    let abort = async {
        entered.notified().await;
        let r = b.handle(30.into(), Message::Abort { term: 1 }, b"").await;
        gate.notify_one();
        r
    };
    let (p, ab) = tokio::join!(prepare, abort);
    assert_eq!(ab.unwrap(), ack());
    let p = p.unwrap();
    assert_eq!(p.reply, Reply::Vote(Vote::No), "{p:?}");
    assert!(gids(&b).await.is_empty());
    assert_eq!(balance(&b, "alice").await, 100);
    assert_eq!(
        b.durable_entry(30.into()).await.unwrap(),
        Some(LogEntry {
            state: LocalState::Aborted { tombstone: true },
            term: 1
        })
    );
}

#[tokio::test]
async fn inv8_abort_waiting_on_an_unprepared_marker_rolls_back_once_it_is_prepared() {
    let Some((_s, p)) = setup().await else { return };
    // Another session between its marker and PREPARE TRANSACTION.
    let other = p.pool().get().await.unwrap();
    other
        .batch_execute(&format!(
            "BEGIN; UPDATE accounts SET balance = balance + 1 WHERE id = 'alice';
             INSERT INTO dtx_participant_log VALUES ('{ID}', 31, 'committed', 1, 0)"
        ))
        .await
        .unwrap();
    let gid = p.gid(31, 1);
    let prepare_later = async {
        tokio::time::sleep(Duration::from_millis(700)).await;
        other
            .batch_execute(&format!("PREPARE TRANSACTION '{gid}'"))
            .await
            .unwrap();
    };
    let began = Instant::now();
    let (ab, ()) = tokio::join!(p.handle(31.into(), Message::Abort { term: 1 }, b""), prepare_later);
    assert_eq!(ab.unwrap(), ack());
    assert!(began.elapsed() < Duration::from_secs(10));
    assert!(gids(&p).await.is_empty(), "rolled back");
    assert_eq!(balance(&p, "alice").await, 100);
    assert_eq!(
        p.durable_entry(31.into()).await.unwrap(),
        Some(LogEntry {
            state: LocalState::Aborted { tombstone: false },
            term: 1
        })
    );
}

#[tokio::test]
async fn startup_refuses_a_role_without_rights_on_the_log_table() {
    let Some(s) = server(PgServerOptions::default()) else {
        return;
    };
    // PostgreSQL 15 and later: no CREATE on schema public for PUBLIC.
    s.execute(DB, "CREATE ROLE weak LOGIN; REVOKE CREATE ON SCHEMA public FROM PUBLIC")
        .unwrap();
    let weak = |s: &PgServer| {
        let mut o = opts(s);
        o.conn_string = format!("host=127.0.0.1 port={} user=weak dbname={DB}", s.port());
        o
    };
    let e = PgParticipant::connect(weak(&s), Accounts).await.err().expect("refused");
    assert!(e.to_string().contains("cannot create the log table"), "{e}");
    assert!(e.to_string().contains("role weak"), "{e}");
    // The table made by its owner, but no rights on it yet.
    PgParticipant::connect(opts(&s), Accounts).await.unwrap();
    let e = PgParticipant::connect(weak(&s), Accounts).await.err().expect("refused");
    assert!(e.to_string().contains("lacks SELECT, INSERT, UPDATE or DELETE"), "{e}");
    s.execute(
        DB,
        "GRANT SELECT, INSERT, UPDATE, DELETE ON dtx_participant_log, dtx_participant_log_inc,
             dtx_participant_term_floor, dtx_participant_branch, dtx_participant_raised_term TO weak",
    )
    .unwrap();
    PgParticipant::connect(weak(&s), Accounts).await.unwrap();
}

/// Records the last value of every gauge (a metrics recorder for this
/// thread: the test runs on tokio's current-thread runtime).
#[derive(Default)]
struct Gauges(std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<String, f64>>>);

struct GaugeCell(
    String,
    std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<String, f64>>>,
);

impl metrics::GaugeFn for GaugeCell {
    fn increment(&self, v: f64) {
        *self.1.lock().unwrap().entry(self.0.clone()).or_default() += v;
    }
    fn decrement(&self, v: f64) {
        *self.1.lock().unwrap().entry(self.0.clone()).or_default() -= v;
    }
    fn set(&self, v: f64) {
        self.1.lock().unwrap().insert(self.0.clone(), v);
    }
}

impl metrics::Recorder for Gauges {
    fn describe_counter(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_gauge(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_histogram(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn register_counter(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::noop()
    }
    fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::from_arc(std::sync::Arc::new(GaugeCell(key.name().to_string(), self.0.clone())))
    }
    fn register_histogram(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

/// Every listing of the in-doubt transactions (each recovery pass) reports
/// how many of this participant's prepared transactions are open in
/// PostgreSQL and the age of the oldest; both go back to 0 once they are
/// decided.
#[tokio::test]
async fn prepared_transactions_open_and_the_oldest_age_are_reported() {
    let Some((_s, p)) = setup().await else { return };
    let rec = Gauges::default();
    let _guard = metrics::set_default_local_recorder(&rec);
    for (t, work) in [(21, &b"alice:+1"[..]), (22, &b"bob:+1"[..])] {
        assert_eq!(
            p.handle(t.into(), Message::Prepare { term: 1 }, work).await.unwrap(),
            yes()
        );
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(p.in_doubt_older_than(Duration::ZERO).await.unwrap().len(), 2);
    let seen = rec.0.lock().unwrap().clone();
    assert_eq!(seen.get("dtx_participant_pg_prepared_open"), Some(&2.0), "{seen:?}");
    let oldest = seen["dtx_participant_pg_prepared_oldest_age_seconds"];
    assert!((1.0..60.0).contains(&oldest), "oldest age {oldest} s");
    // The same, as the recovery loop's in-doubt gauges read it.
    let summary = p.in_doubt_summary().await.unwrap();
    assert_eq!(summary.count, 2);
    let age = summary.oldest_age.expect("an age").as_secs_f64();
    assert!((1.0..60.0).contains(&age), "oldest age {age} s");
    for t in [21, 22] {
        p.handle(t.into(), Message::Abort { term: 1 }, b"").await.unwrap();
    }
    assert!(p.in_doubt_older_than(Duration::ZERO).await.unwrap().is_empty());
    assert_eq!(
        p.in_doubt_summary().await.unwrap(),
        participant_sdk::participant::InDoubtSummary::default()
    );
    let seen = rec.0.lock().unwrap().clone();
    assert_eq!(seen.get("dtx_participant_pg_prepared_open"), Some(&0.0));
    assert_eq!(seen.get("dtx_participant_pg_prepared_oldest_age_seconds"), Some(&0.0));
}

/// `ParticipantService.Inspect` on the PostgreSQL participant: a prepared
/// transaction (`pg_prepared_xacts`) is in doubt, with its gid's term and
/// PostgreSQL's time; decided rows show their state and term; nothing is
/// written (no row, no tombstone for a txid never seen).
#[tokio::test]
async fn inspect_shows_prepared_transactions_and_log_rows_and_changes_nothing() {
    use dtx_proto::v1 as pb;
    use dtx_proto::v1::participant_service_server::ParticipantService;
    let Some((_s, p)) = setup().await else { return };
    // In term order: a Prepare of a txid with no gid and no row from below
    // the term floor is refused (invariant 9).
    assert_eq!(
        p.handle(2.into(), Message::Prepare { term: 1 }, b"bob:+1")
            .await
            .unwrap(),
        yes()
    );
    let no = p
        .handle(3.into(), Message::Prepare { term: 1 }, b"carol:-1000")
        .await
        .unwrap();
    assert_eq!(no.reply, Reply::Vote(Vote::No));
    assert_eq!(
        p.handle(2.into(), Message::Commit { term: 2 }, b"").await.unwrap(),
        ack()
    );
    assert_eq!(
        p.handle(1.into(), Message::Prepare { term: 3 }, b"alice:+1")
            .await
            .unwrap(),
        yes()
    );
    assert_eq!(
        p.handle(5.into(), Message::Prepare { term: 4 }, b"read:alice")
            .await
            .unwrap(),
        Answer::new(Reply::Vote(Vote::ReadOnly))
    );
    assert_eq!(
        p.handle(4.into(), Message::Abort { term: 5 }, b"").await.unwrap(),
        ack()
    );
    let log = |p: std::sync::Arc<PgParticipant<Accounts>>| async move {
        let c = p.pool().get().await.unwrap();
        c.query(
            "SELECT participant, txid, state, term, decided_ms FROM dtx_participant_log ORDER BY 1, 2",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| {
            format!(
                "{}/{}/{}/{}/{}",
                r.get::<_, String>(0),
                r.get::<_, i64>(1),
                r.get::<_, String>(2),
                r.get::<_, i64>(3),
                r.get::<_, i64>(4)
            )
        })
        .collect::<Vec<_>>()
    };
    let p = std::sync::Arc::new(p);
    let (log_before, gids_before) = (log(p.clone()).await, gids(&p).await);
    let server = participant_sdk::server::ParticipantServer::new(p.clone(), ID);
    let r = server
        .inspect(tonic::Request::new(pb::InspectParticipantRequest {
            txids: vec![1, 2, 3, 4, 5, 99],
            in_doubt: true,
            recent: 10,
            incarnation: 0,
        }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.participant_id, ID);
    let expect = [
        (1, pb::LocalRecord::PreparedYes, pb::Vote::Yes, 3, true),
        (2, pb::LocalRecord::Committed, pb::Vote::Yes, 2, false),
        (3, pb::LocalRecord::Aborted, pb::Vote::Unspecified, 1, false),
        (4, pb::LocalRecord::Tombstone, pb::Vote::Unspecified, 5, false),
        (5, pb::LocalRecord::PreparedReadOnly, pb::Vote::ReadOnly, 4, false),
        (99, pb::LocalRecord::None, pb::Vote::Unspecified, 0, false),
    ];
    assert_eq!(r.records.len(), expect.len(), "{r:?}");
    for (got, (txid, rec, vote, term, doubt)) in r.records.iter().zip(expect) {
        assert_eq!(
            (got.txid, got.record, got.vote, got.term, got.in_doubt),
            (txid, rec as i32, vote as i32, term, doubt),
            "{got:?}"
        );
        assert_eq!(got.recorded_unix_ms > 0, txid != 99, "{got:?}");
    }
    assert_eq!(r.in_doubt.iter().map(|x| x.txid).collect::<Vec<_>>(), vec![1]);
    assert_eq!(r.in_doubt_count, 1);
    assert_eq!(r.records_total, 5, "four rows and one prepared transaction");
    assert!(r.oldest_in_doubt_age_ms < 60_000, "{r:?}");
    let mut recent: Vec<u64> = r.recent.iter().map(|x| x.txid).collect();
    let times: Vec<u64> = r.recent.iter().map(|x| x.recorded_unix_ms).collect();
    assert!(times.windows(2).all(|w| w[0] >= w[1]), "newest first: {r:?}");
    recent.sort();
    assert_eq!(recent, vec![1, 2, 3, 4, 5]);
    assert_eq!(log(p.clone()).await, log_before, "Inspect wrote to the log");
    assert_eq!(gids(&p).await, gids_before);
    assert_eq!(
        p.durable_entry(99.into()).await.unwrap(),
        None,
        "no tombstone for a txid never seen"
    );
    // Decided: no longer in doubt.
    assert_eq!(
        p.handle(1.into(), Message::Commit { term: 3 }, b"").await.unwrap(),
        ack()
    );
    let r = server
        .inspect(tonic::Request::new(pb::InspectParticipantRequest {
            txids: vec![1],
            in_doubt: true,
            recent: 0,
            incarnation: 0,
        }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.records[0].record, pb::LocalRecord::Committed as i32);
    assert!(r.in_doubt.is_empty() && r.in_doubt_count == 0 && r.oldest_in_doubt_age_ms == 0);
}

const INC_A: u64 = 0x0a0a_0a0a_0a0a_0a0a;
const INC_B: u64 = 0x0b0b_0b0b_0b0b_0b0b;

/// The same txid in two incarnations (and in incarnation 0) is three
/// transactions: three gids (`dtx:v1:` for incarnation 0, as before
/// incarnations; `dtx:v2:` with the incarnation otherwise), prepared, listed
/// by recovery and decided independently, with rows of their own; log GC sees
/// both tables.
#[tokio::test]
async fn inv8_the_same_txid_in_two_incarnations_prepares_and_commits_independently() {
    let Some((_s, p)) = setup().await else { return };
    let (a, b) = (GlobalTxid::new(INC_A, 40), GlobalTxid::new(INC_B, 40));
    assert_eq!(
        p.handle(40.into(), Message::Prepare { term: 1 }, b"alice:+1")
            .await
            .unwrap(),
        yes()
    );
    assert_eq!(
        p.handle(a, Message::Prepare { term: 2 }, b"bob:+5").await.unwrap(),
        yes()
    );
    assert_eq!(
        p.handle(b, Message::Prepare { term: 7 }, b"carol:+9").await.unwrap(),
        yes()
    );
    let mut want = vec![p.gid(40, 1), p.gid(a, 2), p.gid(b, 7)];
    want.sort();
    assert_eq!(gids(&p).await, want);
    assert_eq!(p.gid(a, 2), format!("dtx:v2:{ID}:0a0a0a0a0a0a0a0a:40:2"));
    assert_eq!(p.gid(40, 1), format!("dtx:v1:{ID}:40:1"));
    // Recovery lists all three, each with its incarnation and term.
    let mut listed = p.in_doubt_older_than(std::time::Duration::ZERO).await.unwrap();
    listed.sort_by_key(|(t, _)| *t);
    assert_eq!(
        listed.iter().map(|(t, e)| (*t, e.term)).collect::<Vec<_>>(),
        vec![(40.into(), 1), (a, 2), (b, 7)]
    );
    // Commit A's only: bob gets 5; alice and carol wait.
    assert_eq!(p.handle(a, Message::Commit { term: 2 }, b"").await.unwrap(), ack());
    assert_eq!(balance(&p, "bob").await, 5);
    assert_eq!(balance(&p, "carol").await, 50);
    assert_eq!(p.durable_entry(a).await.unwrap().unwrap().state, LocalState::Committed);
    assert_eq!(
        p.durable_entry(b).await.unwrap().unwrap().state,
        LocalState::Prepared { vote: Vote::Yes }
    );
    // Redelivered after the gid is gone: A's own row answers; B's is
    // untouched; incarnation 0's 40 is still in doubt.
    assert_eq!(p.handle(a, Message::Commit { term: 2 }, b"").await.unwrap(), ack());
    assert_eq!(balance(&p, "bob").await, 5);
    assert_eq!(p.handle(b, Message::Abort { term: 7 }, b"").await.unwrap(), ack());
    assert_eq!(balance(&p, "carol").await, 50);
    assert_eq!(gids(&p).await, vec![p.gid(40, 1)]);
    // A Commit of B's (aborted) is refused; of A's acked.
    assert_eq!(
        refusal(p.handle(b, Message::Commit { term: 7 }, b"").await),
        Refusal::CommitAfterAbort
    );
    assert_eq!(
        p.handle(40.into(), Message::Commit { term: 1 }, b"").await.unwrap(),
        ack()
    );
    assert_eq!(balance(&p, "alice").await, 101);
    // GC candidates come from both tables, with their incarnations; forgetting
    // them leaves nothing.
    let c = p.gc_candidates_after(None, u64::MAX, 10).await.unwrap();
    let mut ids: Vec<GlobalTxid> = c.iter().map(|(_, t)| *t).collect();
    ids.sort();
    assert_eq!(ids, vec![40.into(), a, b]);
    let first = p.gc_candidates_after(None, u64::MAX, 1).await.unwrap();
    let rest = p
        .gc_candidates_after(first.last().copied(), u64::MAX, 10)
        .await
        .unwrap();
    assert_eq!(
        first.len() + rest.len(),
        3,
        "the cursor walks both tables: {first:?} {rest:?}"
    );
    assert_eq!(p.forget_records(&c).await.unwrap(), 3);
    for t in [40.into(), a, b] {
        assert_eq!(p.durable_entry(t).await.unwrap(), None);
    }
}

/// A one-phase commit applied at term 4 and its row garbage-collected; the
/// deposed leader of term 3 re-sends it: refused as stale, nothing applied
/// twice; the floor is durable (a new participant on the same database still
/// refuses) and per incarnation.
#[tokio::test]
async fn inv9_a_one_phase_commit_resent_from_an_older_term_after_gc_is_refused() {
    let Some((s, p)) = setup().await else { return };
    let x = GlobalTxid::new(INC_A, 7);
    assert_eq!(
        p.handle(x, Message::CommitOnePhase { term: 4 }, b"alice:+10")
            .await
            .unwrap(),
        ack()
    );
    assert_eq!(balance(&p, "alice").await, 110);
    assert_eq!(p.term_floor(INC_A).await.unwrap(), 4);
    let c = p.gc_candidates_after(None, u64::MAX, 10).await.unwrap();
    assert_eq!(c.iter().map(|(_, t)| *t).collect::<Vec<_>>(), vec![x]);
    assert_eq!(p.forget_records(&c).await.unwrap(), 1);
    assert_eq!(p.durable_entry(x).await.unwrap(), None);
    assert_eq!(
        refusal(p.handle(x, Message::CommitOnePhase { term: 3 }, b"alice:+10").await),
        Refusal::StaleTerm { got: 3, seen: 4 }
    );
    assert_eq!(
        refusal(
            p.handle(GlobalTxid::new(INC_A, 8), Message::Prepare { term: 3 }, b"bob:+1")
                .await
        ),
        Refusal::StaleTerm { got: 3, seen: 4 }
    );
    assert_eq!(balance(&p, "alice").await, 110, "applied once");
    assert!(gids(&p).await.is_empty());
    drop(p);
    // Durable: another participant process on the same database.
    let p = PgParticipant::connect(opts(&s), Accounts).await.unwrap();
    assert_eq!(p.term_floor(INC_A).await.unwrap(), 4);
    assert_eq!(
        refusal(p.handle(x, Message::CommitOnePhase { term: 3 }, b"alice:+10").await),
        Refusal::StaleTerm { got: 3, seen: 4 }
    );
    assert_eq!(balance(&p, "alice").await, 110);
    // Another incarnation's floor is its own.
    assert_eq!(
        p.handle(
            GlobalTxid::new(INC_B, 7),
            Message::CommitOnePhase { term: 3 },
            b"bob:+1"
        )
        .await
        .unwrap(),
        ack()
    );
    assert_eq!(balance(&p, "bob").await, 1);
    // An Abort below the floor still leaves its tombstone.
    assert_eq!(
        p.handle(GlobalTxid::new(INC_A, 9), Message::Abort { term: 1 }, b"")
            .await
            .unwrap(),
        ack()
    );
    assert_eq!(
        p.durable_entry(GlobalTxid::new(INC_A, 9)).await.unwrap().unwrap().state,
        LocalState::Aborted { tombstone: true }
    );
}

/// A database written before term floors: incarnation 0's floor is taken
/// from its rows and prepared gids at the first start.
#[tokio::test]
async fn inv9_the_first_start_takes_incarnation_0s_floor_from_the_existing_log() {
    let Some(s) = server(PgServerOptions::default()) else {
        return;
    };
    {
        let p = PgParticipant::connect(opts(&s), Accounts).await.unwrap();
        assert_eq!(
            p.handle(50.into(), Message::Prepare { term: 6 }, b"alice:+1")
                .await
                .unwrap(),
            yes()
        );
        assert_eq!(
            p.handle(51.into(), Message::Abort { term: 4 }, b"").await.unwrap(),
            ack()
        );
    }
    // As if written before floors existed.
    s.execute(DB, "DELETE FROM dtx_participant_term_floor").unwrap();
    let p = PgParticipant::connect(opts(&s), Accounts).await.unwrap();
    assert_eq!(p.term_floor(0).await.unwrap(), 6, "the prepared gid's term");
    assert_eq!(
        refusal(p.handle(52.into(), Message::Prepare { term: 5 }, b"bob:+1").await),
        Refusal::StaleTerm { got: 5, seen: 6 }
    );
    assert_eq!(
        p.handle(50.into(), Message::Commit { term: 6 }, b"").await.unwrap(),
        ack()
    );
}
