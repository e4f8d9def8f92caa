//! The outbox and inbox in PostgreSQL (`outbox::pg`, ADR 0047) against a
//! real PostgreSQL server started by dtx-pg-server: a message is published
//! only if the transaction that wrote it commits (also through PREPARE
//! TRANSACTION); relays running at once publish each message once and each
//! aggregate's messages in version order; repeated failures dead-letter a
//! message and block its aggregate until it is requeued or discarded; the
//! inbox skips redelivered and concurrent copies and is pruned by
//! retention; the oldest-unpublished age and its gauge move; a
//! PostgreSQL participant's handler writes messages that follow the
//! transaction's decision. Time is a
//! `ManualClock`: nothing waits on a timer.
//!
//! Without the PostgreSQL server binaries each test prints a loud message
//! and passes, unless DTX_REQUIRE_POSTGRES=1 (CI), where it fails.

#![cfg(feature = "postgres")]

use std::collections::BTreeMap;
use std::collections::HashSet;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::sync::Mutex;

use dtx_pg_server::PgServer;
use dtx_pg_server::PgServerOptions;
use participant_sdk::log::Message;
use participant_sdk::log::Vote;
use participant_sdk::outbox::pg::PgInbox;
use participant_sdk::outbox::pg::PgOutbox;
use participant_sdk::outbox::pg::PgRelay;
use participant_sdk::outbox::Envelope;
use participant_sdk::outbox::ManualClock;
use participant_sdk::outbox::OutboxMessage;
use participant_sdk::outbox::Publisher;
use participant_sdk::outbox::Received;
use participant_sdk::outbox::RelayPass;
use participant_sdk::outbox::RelaySettings;
use participant_sdk::participant::Participant;
use participant_sdk::participant::Verdict;
use participant_sdk::postgres::HandlerError;
use participant_sdk::postgres::PgHandler;
use participant_sdk::postgres::PgOptions;
use participant_sdk::postgres::PgParticipant;
use participant_sdk::postgres::Transaction;
use participant_sdk::store::Reply;
use participant_sdk::GlobalTxid;
use tokio_postgres::Client;

const DB: &str = "shop";
const T0: u64 = 1_700_000_000_000;

fn server(test: &str) -> Option<PgServer> {
    let opts = PgServerOptions {
        kill_with_parent_thread: true,
        ..PgServerOptions::default()
    };
    let s = dtx_pg_server::start_or_skip(test, opts)?;
    s.create_database(DB).unwrap();
    s.execute(
        DB,
        "CREATE TABLE effects (message_id text NOT NULL, note text NOT NULL)",
    )
    .unwrap();
    Some(s)
}

async fn connect(s: &PgServer) -> Client {
    participant_sdk::postgres::connect(&s.conn_string(DB)).await.unwrap()
}

/// An outbox on `clock` with its schema created.
async fn outbox(s: &PgServer, clock: &ManualClock) -> PgOutbox {
    let ob = PgOutbox::with_clock("shop", Arc::new(clock.clone())).unwrap();
    ob.create_schema(&mut connect(s).await).await.unwrap();
    ob
}

/// Writes one message in a transaction of its own and commits it.
async fn write_committed(db: &mut Client, ob: &PgOutbox, aggregate: &str, payload: &str) -> u64 {
    let tx = db.transaction().await.unwrap();
    let v = ob
        .write(&tx, &OutboxMessage::new(aggregate, "orders", payload.as_bytes()))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    v
}

/// Records what it published (aggregate, version, payload, relay); fails
/// for the aggregates in `failing`.
#[derive(Default)]
struct Recorder {
    published: Mutex<Vec<(String, u64, String)>>,
    failing: Mutex<HashSet<String>>,
    attempts: Mutex<Vec<(String, u64)>>,
}

impl Recorder {
    fn published(&self) -> Vec<(String, u64, String)> {
        self.published.lock().unwrap().clone()
    }

    fn fail(&self, aggregate: &str, yes: bool) {
        let mut f = self.failing.lock().unwrap();
        if yes {
            f.insert(aggregate.to_string());
        } else {
            f.remove(aggregate);
        }
    }
}

impl Publisher for Recorder {
    async fn publish(&self, msg: &Envelope) -> Result<(), String> {
        self.attempts.lock().unwrap().push((msg.aggregate.clone(), msg.version));
        // Let other relays run between the claim and the record.
        tokio::task::yield_now().await;
        if self.failing.lock().unwrap().contains(&msg.aggregate) {
            return Err(format!("the broker refuses {}", msg.aggregate));
        }
        self.published.lock().unwrap().push((
            msg.aggregate.clone(),
            msg.version,
            String::from_utf8(msg.payload.clone()).unwrap(),
        ));
        Ok(())
    }
}

fn settings() -> RelaySettings {
    RelaySettings {
        name: "shop".into(),
        max_attempts: 3,
        retry_backoff_ms: 1000,
        retry_backoff_max_ms: 10_000,
        ..RelaySettings::default()
    }
}

fn pass(claimed: usize, published: usize, failed: usize, dead_lettered: usize) -> RelayPass {
    RelayPass {
        claimed,
        published,
        failed,
        dead_lettered,
    }
}

fn triple(a: &str, v: u64, p: &str) -> (String, u64, String) {
    (a.to_string(), v, p.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t70_a_message_is_published_only_if_its_transaction_commits_prepared_or_not() {
    let Some(s) = server("t70_outbox_postgres") else { return };
    let clock = ManualClock::new(T0);
    let ob = outbox(&s, &clock).await;
    let rec = Arc::new(Recorder::default());
    let mut relay = PgRelay::new(ob.clone(), connect(&s).await, rec.clone(), settings());
    let mut db = connect(&s).await;

    assert_eq!(write_committed(&mut db, &ob, "order-1", "created").await, 1);

    // Rolled back: gone, and its version with it.
    let tx = db.transaction().await.unwrap();
    ob.write(&tx, &OutboxMessage::new("order-1", "orders", &b"rolled back"[..]))
        .await
        .unwrap();
    tx.rollback().await.unwrap();

    // Prepared, then rolled back / committed by another session.
    let prepare = |aggregate: &'static str, payload: &'static str, gid: &'static str| {
        let ob = ob.clone();
        let s = &s;
        async move {
            let mut c = connect(s).await;
            let tx = c.transaction().await.unwrap();
            ob.write(&tx, &OutboxMessage::new(aggregate, "orders", payload.as_bytes()))
                .await
                .unwrap();
            tx.batch_execute(&format!("PREPARE TRANSACTION '{gid}'")).await.unwrap();
            // PREPARE ended the session's transaction: no ROLLBACK on drop.
            std::mem::forget(tx);
        }
    };
    prepare("order-2", "prepared, rolled back", "t70-rb").await;
    prepare("order-3", "prepared, committed", "t70-c").await;

    // While prepared, neither is visible to a relay.
    assert_eq!(relay.run_once().await.unwrap(), pass(1, 1, 0, 0));
    assert_eq!(relay.run_once().await.unwrap(), pass(0, 0, 0, 0));
    assert_eq!(rec.published(), vec![triple("order-1", 1, "created")]);

    db.batch_execute("ROLLBACK PREPARED 't70-rb'").await.unwrap();
    db.batch_execute("COMMIT PREPARED 't70-c'").await.unwrap();
    assert_eq!(write_committed(&mut db, &ob, "order-1", "paid").await, 2);
    assert_eq!(relay.run_once().await.unwrap(), pass(2, 2, 0, 0));
    assert_eq!(relay.run_once().await.unwrap(), pass(0, 0, 0, 0));
    assert_eq!(
        rec.published(),
        vec![
            triple("order-1", 1, "created"),
            triple("order-3", 1, "prepared, committed"),
            triple("order-1", 2, "paid"),
        ]
    );
    // The rolled-back ones left no row, and no version behind.
    let n: i64 = db
        .query_one(
            "SELECT count(*) FROM shop_outbox WHERE aggregate = 'order-2' OR payload = 'rolled back'::bytea",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 0);
    assert_eq!(write_committed(&mut db, &ob, "order-2", "first").await, 1);
    assert_eq!(ob.pending_count(&db).await.unwrap(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn t70_three_relays_at_once_publish_each_message_once_in_version_order() {
    let Some(s) = server("t70_outbox_postgres") else { return };
    let clock = ManualClock::new(T0);
    let ob = outbox(&s, &clock).await;
    let rec = Arc::new(Recorder::default());
    const AGGREGATES: usize = 4;
    const PER_AGGREGATE: u64 = 25;

    // Some messages before the relays start, the rest while they run.
    let mut writer_db = connect(&s).await;
    for a in 0..AGGREGATES {
        write_committed(&mut writer_db, &ob, &format!("agg-{a}"), "1").await;
    }
    let writing = Arc::new(AtomicBool::new(true));
    let writer = {
        let ob = ob.clone();
        let writing = writing.clone();
        tokio::spawn(async move {
            for v in 2..=PER_AGGREGATE {
                for a in 0..AGGREGATES {
                    let got = write_committed(&mut writer_db, &ob, &format!("agg-{a}"), &v.to_string()).await;
                    assert_eq!(got, v);
                }
            }
            writing.store(false, Ordering::SeqCst);
        })
    };
    let check = Arc::new(connect(&s).await);
    let mut relays = Vec::new();
    for r in 0..3 {
        let mut relay = PgRelay::new(
            ob.clone(),
            connect(&s).await,
            rec.clone(),
            RelaySettings {
                name: format!("relay-{r}"),
                batch_max: 3,
                ..settings()
            },
        );
        let (ob, check, writing) = (ob.clone(), check.clone(), writing.clone());
        relays.push(tokio::spawn(async move {
            let mut published = 0;
            loop {
                let p = relay.run_once().await.unwrap();
                assert_eq!(p.failed + p.dead_lettered, 0);
                published += p.published;
                if p.claimed == 0 {
                    if !writing.load(Ordering::SeqCst) && ob.pending_count(&check).await.unwrap() == 0 {
                        return published;
                    }
                    tokio::task::yield_now().await;
                }
            }
        }));
    }
    writer.await.unwrap();
    let mut total = 0;
    for r in relays {
        total += r.await.unwrap();
    }
    let published = rec.published();
    assert_eq!(total, AGGREGATES * PER_AGGREGATE as usize);
    assert_eq!(published.len(), total, "each message published once");
    let mut by_aggregate: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for (a, v, payload) in &published {
        assert_eq!(payload, &v.to_string(), "the payload written as version {v}");
        by_aggregate.entry(a.clone()).or_default().push(*v);
    }
    for (a, versions) in by_aggregate {
        assert_eq!(
            versions,
            (1..=PER_AGGREGATE).collect::<Vec<_>>(),
            "{a}: received in version order, each once"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t70_repeated_failures_dead_letter_a_message_and_its_aggregate_waits_until_requeued_or_discarded() {
    let Some(s) = server("t70_outbox_postgres") else { return };
    let clock = ManualClock::new(T0);
    let ob = outbox(&s, &clock).await;
    let rec = Arc::new(Recorder::default());
    let mut relay = PgRelay::new(ob.clone(), connect(&s).await, rec.clone(), settings());
    let mut db = connect(&s).await;
    write_committed(&mut db, &ob, "a", "a1").await;
    write_committed(&mut db, &ob, "a", "a2").await;
    write_committed(&mut db, &ob, "b", "b1").await;
    rec.fail("a", true);

    // Attempt 1 fails; b goes on; a2 waits behind a1.
    assert_eq!(relay.run_once().await.unwrap(), pass(2, 1, 1, 0));
    assert_eq!(relay.run_once().await.unwrap(), pass(0, 0, 0, 0));
    // Backoff 1000 ms, then 2000 ms.
    clock.advance(999);
    assert_eq!(relay.run_once().await.unwrap(), pass(0, 0, 0, 0));
    clock.advance(1);
    assert_eq!(relay.run_once().await.unwrap(), pass(1, 0, 1, 0));
    clock.advance(1999);
    assert_eq!(relay.run_once().await.unwrap(), pass(0, 0, 0, 0));
    clock.advance(1);
    // Attempt 3 of 3: dead-lettered.
    assert_eq!(relay.run_once().await.unwrap(), pass(1, 0, 0, 1));
    // The aggregate stays blocked, however long.
    clock.advance(1_000_000);
    assert_eq!(relay.run_once().await.unwrap(), pass(0, 0, 0, 0));
    let dead = ob.dead_letters(&db, 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].aggregate.as_str(), dead[0].version), ("a", 1));
    assert_eq!(dead[0].attempts, 3);
    assert_eq!(dead[0].last_error, "the broker refuses a");
    assert_eq!(dead[0].payload, b"a1");
    assert_eq!(
        ob.oldest_unpublished_age_ms(&db).await.unwrap(),
        Some(1_003_000),
        "a dead-lettered message counts as unpublished"
    );
    assert_eq!(
        *rec.attempts.lock().unwrap(),
        vec![("a".into(), 1), ("b".into(), 1), ("a".into(), 1), ("a".into(), 1)]
    );

    // Requeued: a1, then a2.
    rec.fail("a", false);
    assert!(ob.requeue(&db, "a", 1).await.unwrap());
    assert!(!ob.requeue(&db, "a", 1).await.unwrap(), "only a dead-lettered one");
    assert!(!ob.requeue(&db, "a", 2).await.unwrap(), "only a dead-lettered one");
    assert_eq!(relay.run_once().await.unwrap(), pass(1, 1, 0, 0));
    assert_eq!(relay.run_once().await.unwrap(), pass(1, 1, 0, 0));
    assert_eq!(
        rec.published(),
        vec![triple("b", 1, "b1"), triple("a", 1, "a1"), triple("a", 2, "a2")]
    );
    assert!(ob.dead_letters(&db, 10).await.unwrap().is_empty());

    // Discarded: c1 is never published, c2 goes on.
    write_committed(&mut db, &ob, "c", "c1").await;
    write_committed(&mut db, &ob, "c", "c2").await;
    rec.fail("c", true);
    for (wait, expected) in [
        (0, pass(1, 0, 1, 0)),
        (1000, pass(1, 0, 1, 0)),
        (2000, pass(1, 0, 0, 1)),
    ] {
        clock.advance(wait);
        assert_eq!(relay.run_once().await.unwrap(), expected);
    }
    rec.fail("c", false);
    assert!(!ob.discard(&db, "c", 2).await.unwrap(), "only a dead-lettered one");
    assert!(ob.discard(&db, "c", 1).await.unwrap());
    assert_eq!(relay.run_once().await.unwrap(), pass(1, 1, 0, 0));
    assert_eq!(rec.published().last(), Some(&triple("c", 2, "c2")));
    assert!(!rec.published().contains(&triple("c", 1, "c1")));
    assert_eq!(ob.oldest_unpublished_age_ms(&db).await.unwrap(), None);

    // Published and discarded rows are pruned after their retention.
    clock.advance(10_000);
    write_committed(&mut db, &ob, "d", "d1").await;
    assert_eq!(relay.run_once().await.unwrap(), pass(1, 1, 0, 0));
    assert_eq!(ob.prune_published(&db, 5_000).await.unwrap(), 5);
    let left: i64 = db
        .query_one("SELECT count(*) FROM shop_outbox", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 1, "d1, published just now, is kept");
}

/// Records the message in `effects` within the inbox's transaction.
async fn receive(inbox: &PgInbox, db: &mut Client, id: &str, note: &str) -> Received<()> {
    let (id2, note) = (id.to_string(), note.to_string());
    inbox
        .receive(db, id, move |tx| {
            Box::pin(async move {
                tx.execute("INSERT INTO effects VALUES ($1, $2)", &[&id2, &note])
                    .await?;
                Ok(())
            })
        })
        .await
        .unwrap()
}

async fn effects(db: &Client, id: &str) -> i64 {
    db.query_one("SELECT count(*) FROM effects WHERE message_id = $1", &[&id])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn t70_the_inbox_skips_redelivered_and_concurrent_copies_and_is_pruned_by_retention() {
    let Some(s) = server("t70_outbox_postgres") else { return };
    let clock = ManualClock::new(T0);
    outbox(&s, &clock).await;
    let inbox = PgInbox::new("shop", "shop", Arc::new(clock.clone())).unwrap();
    let mut db = connect(&s).await;

    assert_eq!(receive(&inbox, &mut db, "m1", "first").await, Received::Handled(()));
    assert_eq!(receive(&inbox, &mut db, "m1", "again").await, Received::Duplicate);
    assert_eq!(effects(&db, "m1").await, 1);

    // A handler error rolls back the id with the effects: the message is
    // handled when it comes again.
    let failed = inbox
        .receive(&mut db, "m2", |tx| {
            Box::pin(async move {
                tx.execute("INSERT INTO effects VALUES ('m2', 'half')", &[]).await?;
                Err::<(), _>("the handler gave up".into())
            })
        })
        .await;
    assert_eq!(failed.unwrap_err().to_string(), "the handler gave up");
    assert_eq!(effects(&db, "m2").await, 0);
    assert_eq!(receive(&inbox, &mut db, "m2", "retried").await, Received::Handled(()));

    // Eight copies delivered at once on eight connections: one handled.
    let mut copies = Vec::new();
    for i in 0..8 {
        let inbox = inbox.clone();
        let mut c = connect(&s).await;
        copies.push(tokio::spawn(async move {
            receive(&inbox, &mut c, "m3", &format!("copy {i}")).await
        }));
    }
    let mut handled = 0;
    for c in copies {
        if c.await.unwrap() == Received::Handled(()) {
            handled += 1;
        }
    }
    assert_eq!(handled, 1);
    assert_eq!(effects(&db, "m3").await, 1);

    // Inside the caller's own transaction.
    let tx = db.transaction().await.unwrap();
    assert!(inbox.seen(&tx, "m3").await.unwrap());
    assert!(!inbox.seen(&tx, "m4").await.unwrap());
    tx.commit().await.unwrap();

    // Retention: ids older than it go, newer ones stay.
    clock.advance(10_000);
    assert_eq!(receive(&inbox, &mut db, "m5", "later").await, Received::Handled(()));
    assert_eq!(inbox.prune(&db, 5_000).await.unwrap(), 4);
    assert_eq!(receive(&inbox, &mut db, "m5", "again").await, Received::Duplicate);
    assert_eq!(
        receive(&inbox, &mut db, "m1", "after its retention").await,
        Received::Handled(()),
        "an id pruned is handled again: the retention must outlast redelivery"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn t70_the_oldest_unpublished_age_and_its_gauge_move() {
    let Some(s) = server("t70_outbox_postgres") else { return };
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let _local = metrics::set_default_local_recorder(&recorder);
    let clock = ManualClock::new(T0);
    let ob = outbox(&s, &clock).await;
    let rec = Arc::new(Recorder::default());
    let mut relay = PgRelay::new(ob.clone(), connect(&s).await, rec.clone(), settings());
    let mut db = connect(&s).await;

    assert_eq!(ob.oldest_unpublished_age_ms(&db).await.unwrap(), None);
    write_committed(&mut db, &ob, "x", "x1").await;
    clock.advance(1_500);
    write_committed(&mut db, &ob, "y", "y1").await;
    clock.advance(3_500);
    assert_eq!(ob.oldest_unpublished_age_ms(&db).await.unwrap(), Some(5_000));

    rec.fail("x", true);
    assert_eq!(relay.run_once().await.unwrap(), pass(2, 1, 1, 0));
    let text = handle.render();
    for line in [
        r#"dtx_outbox_oldest_unpublished_age_seconds{outbox="shop"} 5"#,
        r#"dtx_outbox_published_total{outbox="shop"} 1"#,
        r#"dtx_outbox_publish_failures_total{outbox="shop"} 1"#,
    ] {
        assert!(text.contains(line), "{line:?} missing from {text}");
    }
    clock.advance(1_000);
    rec.fail("x", false);
    assert_eq!(relay.run_once().await.unwrap(), pass(1, 1, 0, 0));
    assert_eq!(ob.oldest_unpublished_age_ms(&db).await.unwrap(), None);
    let text = handle.render();
    for line in [
        r#"dtx_outbox_oldest_unpublished_age_seconds{outbox="shop"} 0"#,
        r#"dtx_outbox_published_total{outbox="shop"} 2"#,
    ] {
        assert!(text.contains(line), "{line:?} missing from {text}");
    }
}

/// A PostgreSQL participant's handler: the payload `order:event` records
/// the event and writes its message in the handler's transaction; the
/// event `no` votes NO.
struct OrderEvents {
    outbox: PgOutbox,
}

impl PgHandler for OrderEvents {
    async fn prepare(&self, tx: &Transaction<'_>, txid: GlobalTxid, payload: &[u8]) -> Result<Verdict, HandlerError> {
        let (order, event) = std::str::from_utf8(payload)?.split_once(':').ok_or("bad payload")?;
        tx.execute("INSERT INTO effects VALUES ($1, $2)", &[&txid.to_string(), &event])
            .await?;
        // The handler's transaction dereferences to tokio-postgres's.
        self.outbox
            .write(tx, &OutboxMessage::new(order, "orders", event.as_bytes()))
            .await?;
        if event == "no" {
            return Ok(Verdict::no("refused"));
        }
        Ok(Verdict::yes())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t70_a_pg_participant_s_messages_follow_its_decision() {
    let Some(s) = server("t70_outbox_postgres") else { return };
    let clock = ManualClock::new(T0);
    let ob = outbox(&s, &clock).await;
    let mut o = PgOptions::new("orders", s.conn_string(DB));
    o.concurrency = 4;
    let p = PgParticipant::connect(o, OrderEvents { outbox: ob.clone() })
        .await
        .unwrap();
    let rec = Arc::new(Recorder::default());
    let mut relay = PgRelay::new(ob.clone(), connect(&s).await, rec.clone(), settings());
    let vote = |v| Reply::Vote(v);
    let prepare = |txid: u64, payload: &'static str| {
        let p = &p;
        async move {
            p.handle(txid.into(), Message::Prepare { term: 1 }, payload.as_bytes())
                .await
                .unwrap()
                .reply
        }
    };

    assert_eq!(prepare(1, "o1:placed").await, vote(Vote::Yes));
    assert_eq!(prepare(2, "o2:placed").await, vote(Vote::Yes));
    assert_eq!(prepare(3, "o3:no").await, vote(Vote::No));
    // Prepared (PREPARE TRANSACTION): not published yet.
    assert_eq!(relay.run_once().await.unwrap(), pass(0, 0, 0, 0));

    p.handle(1.into(), Message::Commit { term: 1 }, b"").await.unwrap();
    p.handle(2.into(), Message::Abort { term: 1 }, b"").await.unwrap();
    assert_eq!(relay.run_once().await.unwrap(), pass(1, 1, 0, 0));
    assert_eq!(relay.run_once().await.unwrap(), pass(0, 0, 0, 0));
    assert_eq!(rec.published(), vec![triple("o1", 1, "placed")]);
    let db = connect(&s).await;
    let rows: i64 = db
        .query_one("SELECT count(*) FROM shop_outbox", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 1, "the aborted and the refused transactions' messages are gone");
}
