//! The bank's PostgreSQL handler (`dtx_bank::pg::PgBank`) against a real
//! PostgreSQL server the test starts (skipped with a loud note when the
//! server binaries are missing, unless `DTX_REQUIRE_POSTGRES=1`).
//!
//! What a payload of several items does: an account named twice is
//! checked against its balance after the earlier change; a NO changes
//! nothing; a commit applies every change and one apply-log row.

use dtx_bank::pg;
use dtx_pg_server::PgServer;
use dtx_pg_server::PgServerOptions;
use participant_sdk::log::Message;
use participant_sdk::log::Vote;
use participant_sdk::participant::Participant;
use participant_sdk::postgres::PgOptions;
use participant_sdk::postgres::PgParticipant;
use participant_sdk::store::Reply;

const DB: &str = "bank";

fn server() -> Option<PgServer> {
    let opts = PgServerOptions {
        kill_with_parent_thread: true,
        ..PgServerOptions::default()
    };
    let s = dtx_pg_server::start_or_skip("t10_pg_handler", opts)?;
    s.create_database(DB).unwrap();
    Some(s)
}

async fn balance(db: &tokio_postgres::Client, name: &str) -> i64 {
    db.query_one("SELECT balance FROM accounts WHERE name = $1", &[&name])
        .await
        .unwrap()
        .get(0)
}

async fn applied(db: &tokio_postgres::Client, txid: u64) -> i64 {
    db.query_one("SELECT count(*) FROM applied WHERE txid = $1", &[&(txid as i64)])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn an_account_named_twice_is_checked_after_its_first_change() {
    let Some(s) = server() else { return };
    let mut db = participant_sdk::postgres::connect(&s.conn_string(DB)).await.unwrap();
    pg::install(&mut db, "a", 2, 100).await.unwrap();
    let p = PgParticipant::connect(PgOptions::new("bank-a", s.conn_string(DB)), pg::PgBank)
        .await
        .unwrap();

    // a1: 100 - 60 = 40, then 40 - 60 < 0: NO, though each change alone
    // fits the balance read before the first.
    let a = p
        .handle(1.into(), Message::Prepare { term: 1 }, b"a1:-60;a1:-60")
        .await
        .unwrap();
    assert_eq!(a.reply, Reply::Vote(Vote::No), "{a:?}");
    assert!(a.reason.contains("too little"), "{}", a.reason);
    assert_eq!(balance(&db, "a1").await, 100, "a NO changes nothing");
    assert_eq!(applied(&db, 1).await, 0);

    // a0: 100 + 50 = 150, then 150 - 120 = 30: YES; both changes and one
    // apply-log row land with the commit.
    let a = p
        .handle(2.into(), Message::Prepare { term: 1 }, b"a0:+50;a0:-120")
        .await
        .unwrap();
    assert_eq!(a.reply, Reply::Vote(Vote::Yes), "{a:?}");
    assert_eq!(balance(&db, "a0").await, 100, "not visible before the decision");
    let a = p.handle(2.into(), Message::Commit { term: 1 }, b"").await.unwrap();
    assert_eq!(a.reply, Reply::Ack);
    assert_eq!(balance(&db, "a0").await, 30);
    assert_eq!(applied(&db, 2).await, 1);

    // Two accounts: both changed, one apply-log row.
    let a = p
        .handle(3.into(), Message::Prepare { term: 1 }, b"a0:-30;a1:+30")
        .await
        .unwrap();
    assert_eq!(a.reply, Reply::Vote(Vote::Yes), "{a:?}");
    p.handle(3.into(), Message::Commit { term: 1 }, b"").await.unwrap();
    assert_eq!((balance(&db, "a0").await, balance(&db, "a1").await), (0, 130));
    assert_eq!(applied(&db, 3).await, 1);
}
