//! The outbox and inbox in the SDK's own participant store
//! (`outbox::store`, ADR 0047): a message is published only if the write
//! that holds it commits (a local write, or a prepared transaction's
//! commit; never after an abort or a NO vote), across a restart; relays
//! running at once (tasks of one process: the store is one process's)
//! publish each message once and each aggregate's messages in version
//! order; a lease keeps other relays off an aggregate until it expires;
//! repeated failures dead-letter a message and block its aggregate until
//! it is requeued or discarded; the inbox skips redelivered and concurrent
//! copies, survives a restart and is pruned by retention; the
//! oldest-unpublished age and its gauge move. Time is a `ManualClock`:
//! nothing waits on a timer.

use std::collections::BTreeMap;
use std::collections::HashSet;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::sync::Mutex;

use participant_sdk::log::Message;
use participant_sdk::log::Vote;
use participant_sdk::outbox::store::StoreInbox;
use participant_sdk::outbox::store::StoreOutbox;
use participant_sdk::outbox::store::OUTBOX_KEY_PREFIX;
use participant_sdk::outbox::Envelope;
use participant_sdk::outbox::ManualClock;
use participant_sdk::outbox::OutboxMessage;
use participant_sdk::outbox::Publisher;
use participant_sdk::outbox::Received;
use participant_sdk::outbox::RelayPass;
use participant_sdk::outbox::RelaySettings;
use participant_sdk::store::ParticipantStore;
use participant_sdk::store::Reply;
use participant_sdk::store::Resource;
use participant_sdk::store::Staged;
use participant_sdk::store::View;
use participant_sdk::GlobalTxid;

const T0: u64 = 1_700_000_000_000;

/// The payload `aggregate:event` sets `order/<aggregate>` to `event` when
/// the transaction commits, and publishes `event` for the aggregate; the
/// event `no` votes NO.
struct Orders {
    outbox: StoreOutbox,
}

fn parse(payload: &[u8]) -> (String, String) {
    let (a, e) = std::str::from_utf8(payload).unwrap().split_once(':').unwrap();
    (a.to_string(), e.to_string())
}

fn pending_key(txid: GlobalTxid) -> Vec<u8> {
    format!("pending/{txid}").into_bytes()
}

impl Resource for Orders {
    fn prepare(&self, view: &View<'_>, txid: GlobalTxid, payload: &[u8], staged: &mut Staged) -> Vote {
        let (aggregate, event) = parse(payload);
        staged.put(&pending_key(txid), payload);
        self.outbox
            .write_prepared(
                view,
                staged,
                txid,
                &OutboxMessage::new(aggregate, "orders", event.as_bytes()),
            )
            .unwrap();
        if event == "no" {
            return staged.refuse("no");
        }
        Vote::Yes
    }

    fn commit(&self, view: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
        if let Some(p) = view.get(&pending_key(txid)).unwrap() {
            let (aggregate, event) = parse(&p);
            staged.put(format!("order/{aggregate}").as_bytes(), event.as_bytes());
        }
        staged.delete(&pending_key(txid));
        self.outbox.release_prepared(view, staged, txid).unwrap();
    }

    fn abort(&self, view: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
        staged.delete(&pending_key(txid));
        self.outbox.discard_prepared(view, staged, txid).unwrap();
    }
}

/// Records what it published; fails for the aggregates in `failing`;
/// when `gate` is set, waits at it (after saying so on `entered`).
#[derive(Default)]
struct Recorder {
    published: Mutex<Vec<(String, u64, String)>>,
    failing: Mutex<HashSet<String>>,
    gate: Option<(tokio::sync::Notify, tokio::sync::Notify)>,
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
        if let Some((entered, gate)) = &self.gate {
            entered.notify_one();
            gate.notified().await;
        }
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
        name: "orders".into(),
        max_attempts: 3,
        retry_backoff_ms: 1000,
        retry_backoff_max_ms: 10_000,
        lease_ms: 5_000,
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

fn open(dir: &std::path::Path, outbox: &StoreOutbox) -> Arc<ParticipantStore<Orders>> {
    ParticipantStore::open(dir, Orders { outbox: outbox.clone() }).unwrap()
}

/// Writes one message in a local write of its own; its version.
async fn write_local(store: &ParticipantStore<Orders>, outbox: &StoreOutbox, aggregate: &str, payload: &str) -> u64 {
    let mut v = 0;
    store
        .write_data(|view, staged| {
            v = outbox
                .write(
                    view,
                    staged,
                    &OutboxMessage::new(aggregate, "orders", payload.as_bytes()),
                )
                .unwrap();
        })
        .await
        .unwrap();
    v
}

async fn prepare(store: &ParticipantStore<Orders>, txid: u64, payload: &str) -> Reply {
    store
        .handle(txid, Message::Prepare { term: 1 }, payload.as_bytes())
        .await
        .unwrap()
}

#[tokio::test]
async fn t71_a_message_is_published_only_if_its_write_commits_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let outbox = StoreOutbox::with_clock(Arc::new(clock.clone()));
    let store = open(dir.path(), &outbox);
    let rec = Arc::new(Recorder::default());

    assert_eq!(write_local(&store, &outbox, "order-1", "created").await, 1);
    assert_eq!(prepare(&store, 1, "order-1:paid").await, Reply::Vote(Vote::Yes));
    assert_eq!(prepare(&store, 2, "order-2:cancelled").await, Reply::Vote(Vote::Yes));
    assert_eq!(prepare(&store, 3, "order-3:no").await, Reply::Vote(Vote::No));
    assert_eq!(prepare(&store, 4, "order-4:shipped").await, Reply::Vote(Vote::Yes));

    // Prepared messages are out of the relays' sight.
    let mut relay = outbox.relay(store.clone(), "r1", rec.clone(), settings());
    assert_eq!(relay.run_once().await.unwrap(), pass(1, 1, 0, 0));
    assert_eq!(relay.run_once().await.unwrap(), pass(0, 0, 0, 0));

    store.handle(1, Message::Commit { term: 1 }, b"").await.unwrap();
    store.handle(2, Message::Abort { term: 1 }, b"").await.unwrap();
    assert_eq!(relay.run_once().await.unwrap(), pass(1, 1, 0, 0));
    assert_eq!(
        rec.published(),
        vec![triple("order-1", 1, "created"), triple("order-1", 2, "paid")]
    );

    // Across a restart: the prepared message is kept with its vote and
    // released by the commit that comes after it.
    drop(relay);
    drop(store);
    let store = open(dir.path(), &outbox);
    let mut relay = outbox.relay(store.clone(), "r1", rec.clone(), settings());
    assert_eq!(relay.run_once().await.unwrap(), pass(0, 0, 0, 0));
    store.handle(4, Message::Commit { term: 1 }, b"").await.unwrap();
    assert_eq!(relay.run_once().await.unwrap(), pass(1, 1, 0, 0));
    assert_eq!(relay.run_once().await.unwrap(), pass(0, 0, 0, 0));
    assert_eq!(rec.published().last(), Some(&triple("order-4", 1, "shipped")));
    assert_eq!(rec.published().len(), 3, "the aborted and the NO vote's never");
    assert_eq!(store.view().get(b"order/order-4").unwrap(), Some(b"shipped".to_vec()));

    // Nothing of the aborted or refused transactions is left: only the
    // aggregates' version counters.
    let left: Vec<Vec<u8>> = store
        .view()
        .scan(OUTBOX_KEY_PREFIX)
        .unwrap()
        .into_iter()
        .map(|(k, _)| k[OUTBOX_KEY_PREFIX.len()..].to_vec())
        .collect();
    assert_eq!(left, vec![b"vorder-1".to_vec(), b"vorder-4".to_vec()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn t71_three_relays_at_once_publish_each_message_once_in_version_order() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let outbox = StoreOutbox::with_clock(Arc::new(clock.clone()));
    let store = open(dir.path(), &outbox);
    let rec = Arc::new(Recorder::default());
    const AGGREGATES: usize = 4;
    const PER_AGGREGATE: u64 = 25;

    for a in 0..AGGREGATES {
        write_local(&store, &outbox, &format!("agg-{a}"), "1").await;
    }
    let writing = Arc::new(AtomicBool::new(true));
    let writer = {
        let (store, outbox, writing) = (store.clone(), outbox.clone(), writing.clone());
        tokio::spawn(async move {
            for v in 2..=PER_AGGREGATE {
                for a in 0..AGGREGATES {
                    let got = write_local(&store, &outbox, &format!("agg-{a}"), &v.to_string()).await;
                    assert_eq!(got, v);
                }
            }
            writing.store(false, Ordering::SeqCst);
        })
    };
    let mut relays = Vec::new();
    for r in 0..3 {
        let mut relay = outbox.relay(
            store.clone(),
            format!("relay-{r}"),
            rec.clone(),
            RelaySettings {
                batch_max: 3,
                ..settings()
            },
        );
        let (store, outbox, writing) = (store.clone(), outbox.clone(), writing.clone());
        relays.push(tokio::spawn(async move {
            let mut published = 0;
            loop {
                let p = relay.run_once().await.unwrap();
                assert_eq!(p.failed + p.dead_lettered, 0);
                published += p.published;
                if p.claimed == 0 {
                    if !writing.load(Ordering::SeqCst) && outbox.pending_count(&store.view()).unwrap() == 0 {
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
        assert_eq!(payload, &v.to_string());
        by_aggregate.entry(a.clone()).or_default().push(*v);
    }
    for (a, versions) in by_aggregate {
        assert_eq!(versions, (1..=PER_AGGREGATE).collect::<Vec<_>>(), "{a}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t71_a_lease_keeps_other_relays_off_an_aggregate_until_it_expires() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let outbox = StoreOutbox::with_clock(Arc::new(clock.clone()));
    let store = open(dir.path(), &outbox);
    write_local(&store, &outbox, "a", "a1").await;
    write_local(&store, &outbox, "a", "a2").await;

    let slow = Arc::new(Recorder {
        gate: Some(Default::default()),
        ..Recorder::default()
    });
    let fast = Arc::new(Recorder::default());
    let mut stuck = outbox.relay(store.clone(), "stuck", slow.clone(), settings());
    let stuck = tokio::spawn(async move { stuck.run_once().await.unwrap() });
    // The stuck relay holds a1 (inside its publisher).
    slow.gate.as_ref().unwrap().0.notified().await;

    let mut other = outbox.relay(store.clone(), "other", fast.clone(), settings());
    assert_eq!(other.run_once().await.unwrap(), pass(0, 0, 0, 0), "a is leased");
    clock.advance(4_999);
    assert_eq!(other.run_once().await.unwrap(), pass(0, 0, 0, 0), "a is leased");
    clock.advance(1);
    // The lease ended: another relay takes the aggregate over.
    assert_eq!(other.run_once().await.unwrap(), pass(1, 1, 0, 0));
    // The stuck one finishes late: its message was recorded already, so
    // it records nothing (a1 went out twice: at least once).
    slow.gate.as_ref().unwrap().1.notify_one();
    assert_eq!(stuck.await.unwrap(), pass(1, 0, 0, 0));
    assert_eq!(other.run_once().await.unwrap(), pass(1, 1, 0, 0));
    assert_eq!(fast.published(), vec![triple("a", 1, "a1"), triple("a", 2, "a2")]);
    assert_eq!(slow.published(), vec![triple("a", 1, "a1")]);
}

#[tokio::test]
async fn t71_repeated_failures_dead_letter_a_message_and_its_aggregate_waits_until_requeued_or_discarded() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let outbox = StoreOutbox::with_clock(Arc::new(clock.clone()));
    let store = open(dir.path(), &outbox);
    let rec = Arc::new(Recorder::default());
    let mut relay = outbox.relay(store.clone(), "r1", rec.clone(), settings());
    write_local(&store, &outbox, "a", "a1").await;
    write_local(&store, &outbox, "a", "a2").await;
    write_local(&store, &outbox, "b", "b1").await;
    rec.fail("a", true);

    assert_eq!(relay.run_once().await.unwrap(), pass(2, 1, 1, 0));
    assert_eq!(relay.run_once().await.unwrap(), pass(0, 0, 0, 0));
    clock.advance(999);
    assert_eq!(relay.run_once().await.unwrap(), pass(0, 0, 0, 0));
    clock.advance(1);
    assert_eq!(relay.run_once().await.unwrap(), pass(1, 0, 1, 0));
    clock.advance(2000);
    assert_eq!(relay.run_once().await.unwrap(), pass(1, 0, 0, 1));
    clock.advance(1_000_000);
    assert_eq!(relay.run_once().await.unwrap(), pass(0, 0, 0, 0), "a2 waits behind a1");
    let dead = outbox.dead_letters(&store.view()).unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].aggregate.as_str(), dead[0].version), ("a", 1));
    assert_eq!(dead[0].attempts, 3);
    assert_eq!(dead[0].last_error, "the broker refuses a");
    assert_eq!(
        outbox.oldest_unpublished_age_ms(&store.view()).unwrap(),
        Some(1_003_000)
    );

    // A restart keeps the dead letter and the block.
    drop(relay);
    drop(store);
    let store = open(dir.path(), &outbox);
    let mut relay = outbox.relay(store.clone(), "r1", rec.clone(), settings());
    assert_eq!(relay.run_once().await.unwrap(), pass(0, 0, 0, 0));
    assert_eq!(outbox.dead_letters(&store.view()).unwrap(), dead);

    rec.fail("a", false);
    assert!(outbox.requeue(&store, "a", 1).await.unwrap());
    assert!(!outbox.requeue(&store, "a", 1).await.unwrap());
    assert!(!outbox.requeue(&store, "a", 2).await.unwrap());
    assert_eq!(relay.run_once().await.unwrap(), pass(1, 1, 0, 0));
    assert_eq!(relay.run_once().await.unwrap(), pass(1, 1, 0, 0));
    assert_eq!(
        rec.published(),
        vec![triple("b", 1, "b1"), triple("a", 1, "a1"), triple("a", 2, "a2")]
    );

    write_local(&store, &outbox, "c", "c1").await;
    write_local(&store, &outbox, "c", "c2").await;
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
    assert!(!outbox.discard(&store, "c", 2).await.unwrap());
    assert!(outbox.discard(&store, "c", 1).await.unwrap());
    assert_eq!(relay.run_once().await.unwrap(), pass(1, 1, 0, 0));
    assert_eq!(rec.published().last(), Some(&triple("c", 2, "c2")));
    assert!(!rec.published().contains(&triple("c", 1, "c1")));
    assert_eq!(outbox.oldest_unpublished_age_ms(&store.view()).unwrap(), None);
}

/// Sets `effect/<id>` to `note` with the id.
async fn receive(inbox: &StoreInbox, store: &ParticipantStore<Orders>, id: &str, note: &str) -> Received<()> {
    inbox
        .receive(store, id, |view, staged| {
            let k = format!("effect/{id}");
            let n = view.get(k.as_bytes()).unwrap().map_or(0, |v| v.len());
            staged.put(k.as_bytes(), format!("{}{note}", "+".repeat(n)).as_bytes());
            Ok(())
        })
        .await
        .unwrap()
        .unwrap()
}

fn effect(store: &ParticipantStore<Orders>, id: &str) -> Option<String> {
    store
        .view()
        .get(format!("effect/{id}").as_bytes())
        .unwrap()
        .map(|v| String::from_utf8(v).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn t71_the_inbox_skips_redelivered_and_concurrent_copies_and_is_pruned_by_retention() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let outbox = StoreOutbox::with_clock(Arc::new(clock.clone()));
    let store = open(dir.path(), &outbox);
    let inbox = StoreInbox::new("payments", Arc::new(clock.clone())).unwrap();

    assert_eq!(receive(&inbox, &store, "m1", "first").await, Received::Handled(()));
    assert_eq!(receive(&inbox, &store, "m1", "again").await, Received::Duplicate);
    assert_eq!(effect(&store, "m1").as_deref(), Some("first"));

    // A handler error writes nothing: handled when it comes again.
    let failed = inbox
        .receive(&store, "m2", |_, staged| {
            staged.put(b"effect/m2", b"half");
            Err::<(), _>("the handler gave up".to_string())
        })
        .await
        .unwrap();
    assert_eq!(failed, Err("the handler gave up".to_string()));
    assert_eq!(effect(&store, "m2"), None);
    assert_eq!(receive(&inbox, &store, "m2", "retried").await, Received::Handled(()));

    // Eight copies at once: one handled.
    let mut copies = Vec::new();
    for i in 0..8 {
        let (inbox, store) = (inbox.clone(), store.clone());
        copies.push(tokio::spawn(async move {
            receive(&inbox, &store, "m3", &format!("copy {i}")).await
        }));
    }
    let mut handled = 0;
    for c in copies {
        if c.await.unwrap() == Received::Handled(()) {
            handled += 1;
        }
    }
    assert_eq!(handled, 1);
    assert!(!effect(&store, "m3").unwrap().starts_with('+'), "the handler ran once");

    // Inside the caller's own write, e.g. a resource's commit.
    let mut seen = (false, false);
    store
        .write_data(|view, staged| {
            seen = (
                inbox.seen(view, staged, "m3").unwrap(),
                inbox.seen(view, staged, "m4").unwrap(),
            );
            assert!(inbox.seen(view, staged, "m4").unwrap(), "seen within the same write");
        })
        .await
        .unwrap();
    assert_eq!(seen, (true, false));

    // Durable: still duplicates after a restart.
    drop(store);
    let store = open(dir.path(), &outbox);
    assert_eq!(receive(&inbox, &store, "m4", "again").await, Received::Duplicate);

    clock.advance(10_000);
    assert_eq!(receive(&inbox, &store, "m5", "later").await, Received::Handled(()));
    assert_eq!(inbox.prune(&store, 5_000).await.unwrap(), 4);
    assert_eq!(receive(&inbox, &store, "m5", "again").await, Received::Duplicate);
    assert_eq!(
        receive(&inbox, &store, "m1", "after its retention").await,
        Received::Handled(()),
        "an id pruned is handled again: the retention must outlast redelivery"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn t71_the_oldest_unpublished_age_and_its_gauge_move() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let _local = metrics::set_default_local_recorder(&recorder);
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let outbox = StoreOutbox::with_clock(Arc::new(clock.clone()));
    let store = open(dir.path(), &outbox);
    let rec = Arc::new(Recorder::default());
    let mut relay = outbox.relay(store.clone(), "r1", rec.clone(), settings());
    let inbox = StoreInbox::new("payments", Arc::new(clock.clone())).unwrap();

    assert_eq!(outbox.oldest_unpublished_age_ms(&store.view()).unwrap(), None);
    write_local(&store, &outbox, "x", "x1").await;
    clock.advance(1_500);
    write_local(&store, &outbox, "y", "y1").await;
    clock.advance(3_500);
    assert_eq!(outbox.oldest_unpublished_age_ms(&store.view()).unwrap(), Some(5_000));
    rec.fail("x", true);
    assert_eq!(relay.run_once().await.unwrap(), pass(2, 1, 1, 0));
    receive(&inbox, &store, "m1", "one").await;
    receive(&inbox, &store, "m1", "two").await;
    let text = handle.render();
    for line in [
        r#"dtx_outbox_oldest_unpublished_age_seconds{outbox="orders"} 5"#,
        r#"dtx_outbox_published_total{outbox="orders"} 1"#,
        r#"dtx_outbox_publish_failures_total{outbox="orders"} 1"#,
        r#"dtx_inbox_duplicates_total{inbox="payments"} 1"#,
    ] {
        assert!(text.contains(line), "{line:?} missing from {text}");
    }
    clock.advance(1_000);
    rec.fail("x", false);
    assert_eq!(relay.run_once().await.unwrap(), pass(1, 1, 0, 0));
    assert_eq!(outbox.oldest_unpublished_age_ms(&store.view()).unwrap(), None);
    let text = handle.render();
    for line in [
        r#"dtx_outbox_oldest_unpublished_age_seconds{outbox="orders"} 0"#,
        r#"dtx_outbox_published_total{outbox="orders"} 2"#,
    ] {
        assert!(text.contains(line), "{line:?} missing from {text}");
    }
}
