//! Saga step services on PostgreSQL (`saga_pg::PgStepStore`, the step
//! inbox and outbox in the service's own database) against a real
//! PostgreSQL server started by dtx-pg-server: each operation id runs once,
//! concurrent duplicates included; only an OK answer changes anything; a
//! compensation asks first (NOOP and a fence when the forward action never
//! happened), refuses a stale version, and runs once; Fence and Status;
//! rights checked on every new call; the outbox written with the business
//! change; all of it across a kill -9 of PostgreSQL; and through gRPC.
//!
//! Without the PostgreSQL server binaries each test prints a loud message
//! and passes, unless DTX_REQUIRE_POSTGRES=1 (CI), where it fails.

#![cfg(feature = "postgres")]

use crate::common::outside;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use dtx_pg_server::PgServer;
use dtx_pg_server::PgServerOptions;
use dtx_proto::v1 as pb;
use dtx_proto::v1::saga_step_service_client::SagaStepServiceClient;
use participant_sdk::outbox::Envelope;
use participant_sdk::outbox::OutboxMessage;
use participant_sdk::outbox::Publisher;
use participant_sdk::outbox::RelaySettings;
use participant_sdk::postgres::HandlerError;
use participant_sdk::saga::step_error_status;
use participant_sdk::saga::Authorization;
use participant_sdk::saga::CallKind;
use participant_sdk::saga::OutsideSystem;
use participant_sdk::saga::StepCall;
use participant_sdk::saga::StepError;
use participant_sdk::saga::StepResult;
use participant_sdk::saga::FENCED_REASON;
use participant_sdk::saga_pg::PgStepHandler;
use participant_sdk::saga_pg::PgStepOptions;
use participant_sdk::saga_pg::PgStepServer;
use participant_sdk::saga_pg::PgStepStore;
use participant_sdk::saga_pg::Transaction;

const DB: &str = "shop";

/// Wallets: `charge` (input `who:amount`) takes money, FAILED when the
/// balance would go below zero (after having written: the store must roll
/// that back); `boom` fails (an error, not an answer); `amend` bumps the
/// version outside any saga. `refund` puts a charge back unless the
/// wallet's version moved on (STALE). Every OK emits an event.
struct Wallets;

fn parse(call: &StepCall) -> Result<(String, i64), HandlerError> {
    let text = std::str::from_utf8(&call.input)?;
    let (who, amount) = text.split_once(':').ok_or("input is who:amount")?;
    Ok((who.to_string(), amount.parse()?))
}

impl PgStepHandler for Wallets {
    async fn forward(
        &self,
        tx: &Transaction<'_>,
        call: &StepCall,
        events: &mut Vec<OutboxMessage>,
    ) -> Result<StepResult, HandlerError> {
        let (who, amount) = parse(call)?;
        match call.action.as_str() {
            "charge" => {
                let row = tx
                    .query_one(
                        "UPDATE wallets SET balance = balance - $2, version = version + 1 WHERE id = $1
                         RETURNING balance, version",
                        &[&who, &amount],
                    )
                    .await?;
                let (balance, version): (i64, i64) = (row.get(0), row.get(1));
                if balance < 0 {
                    return Ok(StepResult::failed(format!(
                        "insufficient funds: {who} would have {balance}"
                    )));
                }
                events.push(OutboxMessage::new(
                    format!("wallet/{who}"),
                    "charged",
                    format!("charged {who} {amount}"),
                ));
                Ok(StepResult::ok(version.to_string()))
            }
            "amend" => {
                tx.execute("UPDATE wallets SET version = version + 1 WHERE id = $1", &[&who])
                    .await?;
                Ok(StepResult::ok(""))
            }
            "boom" => {
                tx.execute("UPDATE wallets SET balance = 0 WHERE id = $1", &[&who])
                    .await?;
                Err("the payment provider is down".into())
            }
            other => Ok(StepResult::failed(format!("no action {other:?}"))),
        }
    }

    async fn compensate(
        &self,
        tx: &Transaction<'_>,
        call: &StepCall,
        events: &mut Vec<OutboxMessage>,
    ) -> Result<StepResult, HandlerError> {
        let (who, amount) = parse(call)?;
        let version: i64 = tx
            .query_one("SELECT version FROM wallets WHERE id = $1 FOR UPDATE", &[&who])
            .await?
            .get(0);
        if let Err(stale) = call.check_precondition(&version.to_string()) {
            return Ok(stale);
        }
        let v: i64 = tx
            .query_one(
                "UPDATE wallets SET balance = balance + $2, version = version + 1 WHERE id = $1 RETURNING version",
                &[&who, &amount],
            )
            .await?
            .get(0);
        events.push(OutboxMessage::new(
            format!("wallet/{who}"),
            "refunded",
            format!("refunded {who} {amount}"),
        ));
        Ok(StepResult::ok(v.to_string()))
    }

    fn knows_query(&self, query: &str) -> bool {
        query == "charge-status"
    }
}

/// A server with wallets alice = 100, bob = 0, carol = 50 (versions 0);
/// `None` (after a loud message) when PostgreSQL is not installed and not
/// required.
fn server() -> Option<PgServer> {
    let opts = PgServerOptions {
        kill_with_parent_thread: true,
        ..PgServerOptions::default()
    };
    let s = dtx_pg_server::start_or_skip("t61_saga_steps_postgres", opts)?;
    s.create_database(DB).unwrap();
    s.execute(
        DB,
        "CREATE TABLE wallets (id text PRIMARY KEY, balance bigint NOT NULL, version bigint NOT NULL);
         INSERT INTO wallets VALUES ('alice', 100, 0), ('bob', 0, 0), ('carol', 50, 0)",
    )
    .unwrap();
    Some(s)
}

async fn store(s: &PgServer) -> Arc<PgStepStore<Wallets>> {
    let mut o = PgStepOptions::new("payments", s.conn_string(DB));
    o.concurrency = 8;
    PgStepStore::connect(o, Wallets).await.unwrap()
}

fn forward(op: &str, action: &str, input: &str) -> StepCall {
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

fn refund(op: &str, forward_op: &str, input: &str, precondition: &str) -> StepCall {
    StepCall {
        forward_operation_id: forward_op.into(),
        precondition: precondition.into(),
        ..forward(op, "refund", input)
    }
}

async fn wallet(st: &PgStepStore<Wallets>, who: &str) -> (i64, i64) {
    let c = st.pool().get().await.unwrap();
    let r = c
        .query_one("SELECT balance, version FROM wallets WHERE id = $1", &[&who])
        .await
        .unwrap();
    (r.get(0), r.get(1))
}

fn version_of(r: &StepResult) -> String {
    match r {
        StepResult::Ok { resource_version, .. } => resource_version.clone(),
        other => panic!("not OK: {other:?}"),
    }
}

/// What a relay of the step store's outbox published, as
/// `aggregate@version payload`.
#[derive(Default)]
struct Sink(std::sync::Mutex<Vec<String>>);

impl Publisher for Sink {
    async fn publish(&self, m: &Envelope) -> Result<(), String> {
        self.0.lock().unwrap().push(format!(
            "{}@{} {}",
            m.aggregate,
            m.version,
            String::from_utf8_lossy(&m.payload)
        ));
        Ok(())
    }
}

/// Once per operation id (concurrent duplicates included), only OK changes
/// anything, a handler error records nothing, rights are checked on every
/// new call and a refusal is not recorded, and the outbox holds exactly the
/// OK calls' events.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn t61_each_operation_runs_once_and_only_ok_changes_anything() {
    let Some(s) = server() else { return };
    let st = store(&s).await;

    let first = st.forward(&forward("1.0.f", "charge", "alice:30")).await.unwrap();
    assert_eq!(version_of(&first), "1");
    assert_eq!(
        st.forward(&forward("1.0.f", "charge", "alice:30")).await.unwrap(),
        first
    );
    assert_eq!(wallet(&st, "alice").await, (70, 1));
    // Eight concurrent copies of one call: one charge, one answer.
    let copies: Vec<_> = (0..8)
        .map(|_| {
            let st = st.clone();
            tokio::spawn(async move { st.forward(&forward("2.0.f", "charge", "alice:10")).await.unwrap() })
        })
        .collect();
    let mut answers = Vec::new();
    for c in copies {
        answers.push(c.await.unwrap());
    }
    assert!(answers.iter().all(|a| *a == answers[0]), "{answers:?}");
    assert_eq!(wallet(&st, "alice").await, (60, 2));

    // FAILED: recorded (a repeat answers it), the handler's write undone.
    let failed = st.forward(&forward("3.0.f", "charge", "bob:5")).await.unwrap();
    assert!(
        matches!(&failed, StepResult::Failed { reason } if reason.contains("insufficient")),
        "{failed:?}"
    );
    assert_eq!(
        wallet(&st, "bob").await,
        (0, 0),
        "the FAILED call's update is rolled back"
    );
    assert_eq!(st.forward(&forward("3.0.f", "charge", "bob:5")).await.unwrap(), failed);
    // A handler error: nothing recorded, nothing changed.
    let e = st.forward(&forward("4.0.f", "boom", "carol:1")).await;
    assert!(matches!(e, Err(StepError::Store(_))), "{e:?}");
    assert_eq!(st.status("4.0.f").await.unwrap(), None);
    assert_eq!(wallet(&st, "carol").await, (50, 0));
    // The same operation id with another fingerprint (other work under
    // the same id) is refused, not answered with the recorded reply, and
    // nothing runs.
    let reused = StepCall {
        fingerprint: "another".into(),
        ..forward("1.0.f", "charge", "alice:30")
    };
    let e = st.forward(&reused).await;
    assert!(
        matches!(&e, Err(StepError::Conflict(m)) if m.contains("\"1.0.f\"") && m.contains("fingerprint")),
        "{e:?}"
    );
    assert_eq!(wallet(&st, "alice").await, (60, 2), "nothing charged");
    assert_eq!(
        step_error_status(e.unwrap_err()).code(),
        tonic::Code::FailedPrecondition
    );
    // Another kind of call under a forward's operation id is refused.
    let e = st.compensate(&refund("1.0.f", "x", "alice:30", "")).await;
    assert!(
        matches!(&e, Err(StepError::Invalid(m)) if m.contains("not a compensate call")),
        "{e:?}"
    );

    // Expired rights: FAILED, not recorded; renewed, the same id runs.
    let mut expired = forward("5.0.f", "charge", "carol:5");
    expired.authorization = Authorization {
        principal: "agent-7".into(),
        expires_at_ms: 1,
        ..Authorization::default()
    };
    let r = st.forward(&expired).await.unwrap();
    assert!(
        matches!(&r, StepResult::Failed { reason } if reason.contains("authorization refused")),
        "{r:?}"
    );
    assert_eq!(st.status("5.0.f").await.unwrap(), None, "a refusal is not recorded");
    expired.authorization.expires_at_ms = u64::MAX;
    assert!(st.forward(&expired).await.unwrap().is_ok());
    assert_eq!(wallet(&st, "carol").await, (45, 1));

    let stats = st.stats().await.unwrap();
    assert_eq!((stats.forward_records, stats.compensate_records), (4, 0), "{stats:?}");
    assert_eq!(stats.forward_duplicates, 1 + 7 + 1, "{stats:?}");
    // The outbox (the general one, crate::outbox): one message per OK
    // call, published in order per aggregate (a wallet), then gone.
    assert_eq!(stats.outbox_pending, 3, "{stats:?}");
    let sink = Arc::new(Sink::default());
    let mut relay = st.relay(sink.clone(), RelaySettings::default()).await.unwrap();
    let mut published = 0;
    for _ in 0..4 {
        published += relay.run_once().await.unwrap().published;
    }
    assert_eq!(published, 3);
    let mut got = sink.0.lock().unwrap().clone();
    let alice: Vec<&String> = got.iter().filter(|m| m.starts_with("wallet/alice")).collect();
    assert_eq!(
        alice,
        ["wallet/alice@1 charged alice 30", "wallet/alice@2 charged alice 10"],
        "in order per aggregate"
    );
    got.sort();
    assert_eq!(
        got,
        [
            "wallet/alice@1 charged alice 30",
            "wallet/alice@2 charged alice 10",
            "wallet/carol@1 charged carol 5"
        ]
    );
    assert_eq!(st.stats().await.unwrap().outbox_pending, 0);
    assert_eq!(relay.run_once().await.unwrap().published, 0);
}

/// Compensation asks first: NOOP and a fence when the forward action never
/// happened (a late forward call of it then answers FAILED and never
/// runs), NOOP after a FAILED forward, STALE when the version moved on
/// (nothing undone), once per operation id otherwise. Fence and Status.
/// Then PostgreSQL is killed with -9 and restarted: every answer and
/// business change is still there, and repeats still run nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t61_compensations_ask_first_refuse_stale_versions_and_survive_a_postgres_crash() {
    let Some(mut s) = server() else { return };
    let st = store(&s).await;

    // Never happened: NOOP, fenced; the late forward is refused.
    let noop = st.compensate(&refund("1.0.c", "1.0.f", "carol:5", "")).await.unwrap();
    assert!(
        matches!(&noop, StepResult::Noop { reason } if reason.contains("now fenced")),
        "{noop:?}"
    );
    let late = st.forward(&forward("1.0.f", "charge", "carol:5")).await.unwrap();
    assert_eq!(late, StepResult::failed(FENCED_REASON));
    assert_eq!(wallet(&st, "carol").await, (50, 0));
    // After a FAILED forward: NOOP naming it.
    st.forward(&forward("2.0.f", "charge", "bob:5")).await.unwrap();
    let r = st.compensate(&refund("2.0.c", "2.0.f", "bob:5", "")).await.unwrap();
    assert!(
        matches!(&r, StepResult::Noop { reason } if reason.contains("answered failed")),
        "{r:?}"
    );

    // Happened: undone once.
    let charged = st.forward(&forward("3.0.f", "charge", "carol:20")).await.unwrap();
    assert_eq!(wallet(&st, "carol").await, (30, 1));
    let undone = st
        .compensate(&refund("3.0.c", "3.0.f", "carol:20", &version_of(&charged)))
        .await
        .unwrap();
    assert!(undone.is_ok(), "{undone:?}");
    assert_eq!(
        st.compensate(&refund("3.0.c", "3.0.f", "carol:20", &version_of(&charged)))
            .await
            .unwrap(),
        undone
    );
    assert_eq!(wallet(&st, "carol").await, (50, 2));
    // Stale: the wallet changed after the charge; nothing undone.
    let charged = st.forward(&forward("4.0.f", "charge", "alice:40")).await.unwrap();
    st.forward(&forward("amend-1", "amend", "alice:0")).await.unwrap();
    let stale = st
        .compensate(&refund("4.0.c", "4.0.f", "alice:40", &version_of(&charged)))
        .await
        .unwrap();
    assert!(matches!(stale, StepResult::Stale { .. }), "{stale:?}");
    assert_eq!(wallet(&st, "alice").await, (60, 2));

    // Fence and Status.
    assert_eq!(st.fence("5.0.f").await.unwrap(), None);
    assert_eq!(
        st.forward(&forward("5.0.f", "charge", "alice:1")).await.unwrap(),
        StepResult::failed(FENCED_REASON)
    );
    assert_eq!(
        st.fence("3.0.f").await.unwrap().map(|r| r.result),
        Some(charged_ok(&st, "3.0.f").await)
    );
    assert_eq!(st.status("never").await.unwrap(), None);

    // kill -9 of PostgreSQL; the store reconnects once it is back.
    let before = st.records().await.unwrap();
    s.kill9();
    let e = st.status("3.0.f").await;
    assert!(e.is_err(), "PostgreSQL is down: {e:?}");
    s.restart().unwrap();
    let mut after = None;
    for _ in 0..50 {
        if let Ok(r) = st.records().await {
            after = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(after.as_ref(), Some(&before), "every answer survived the crash");
    assert_eq!(wallet(&st, "carol").await, (50, 2));
    assert_eq!(wallet(&st, "alice").await, (60, 2));
    assert_eq!(
        st.forward(&forward("3.0.f", "charge", "carol:20")).await.unwrap(),
        charged_ok(&st, "3.0.f").await
    );
    assert_eq!(
        wallet(&st, "carol").await,
        (50, 2),
        "a repeat after the crash ran nothing"
    );
}

async fn charged_ok(st: &PgStepStore<Wallets>, op: &str) -> StepResult {
    st.status(op).await.unwrap().expect("recorded").result
}

/// The same through gRPC (`PgStepServer`): Forward twice charges once,
/// Status and Fence answer, an unknown status query is INVALID_ARGUMENT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t61_the_grpc_server_keeps_the_same_promises() {
    let Some(s) = server() else { return };
    let st = store(&s).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(participant_sdk::saga::serve_steps(
        PgStepServer::new(st.clone()),
        listener,
        async {
            let _ = stopped.await;
        },
    ));
    let mut c = SagaStepServiceClient::connect(format!("http://{addr}")).await.unwrap();
    let call: pb::StepCall = forward("1.0.f", "charge", "alice:25").into();
    let a = c.forward(call.clone()).await.unwrap().into_inner();
    let b = c.forward(call).await.unwrap().into_inner();
    assert_eq!(a, b);
    assert_eq!(a.outcome, pb::StepOutcome::Ok as i32);
    assert_eq!(wallet(&st, "alice").await, (75, 1));
    let q = |op: &str, query: &str| pb::StepStatusRequest {
        operation_id: op.into(),
        query: query.into(),
    };
    let st1 = c.status(q("1.0.f", "charge-status")).await.unwrap().into_inner();
    assert!(st1.applied);
    assert_eq!(st1.reply, Some(a));
    let f = c.fence(q("2.0.f", "charge-status")).await.unwrap().into_inner();
    assert!(!f.applied);
    let e = c.status(q("1.0.f", "refund-status")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let _ = stop.send(());
    serving.await.unwrap().unwrap();
}

/// A server that does not answer: a clear error after the attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t61_an_unreachable_server_is_a_clear_error() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut o = PgStepOptions::new(
        "payments",
        format!("host=127.0.0.1 port={port} user=nobody dbname=shop"),
    );
    o.connect_attempts = 2;
    o.connect_backoff = Duration::from_millis(10);
    let e = PgStepStore::connect(o, Wallets).await.err().expect("refused");
    let m = e.to_string();
    assert!(m.contains("unreachable") && m.contains("2 connection attempts"), "{m}");
    let bad = PgStepStore::connect(PgStepOptions::new("", "host=127.0.0.1"), Wallets)
        .await
        .err()
        .expect("refused");
    assert!(bad.to_string().contains("step service name"), "{bad}");
}

/// A checkout whose charge is an outside call to the stand-in payment
/// provider (`common/outside.rs`, ADR 0034): `charge` (input `who:amount`)
/// is planned in the call's transaction, recorded in flight, sent with no
/// connection held, and finished in a second transaction that inserts the
/// charge into `charges` (with an event).
struct PgCheckout {
    provider: Arc<outside::Provider>,
}

impl PgStepHandler for PgCheckout {
    async fn forward(
        &self,
        _tx: &Transaction<'_>,
        call: &StepCall,
        _events: &mut Vec<OutboxMessage>,
    ) -> Result<StepResult, HandlerError> {
        Ok(StepResult::failed(format!("no local action {:?}", call.action)))
    }

    async fn compensate(
        &self,
        _tx: &Transaction<'_>,
        call: &StepCall,
        _events: &mut Vec<OutboxMessage>,
    ) -> Result<StepResult, HandlerError> {
        Ok(StepResult::failed(format!("no compensation {:?}", call.action)))
    }

    fn knows_query(&self, query: &str) -> bool {
        query == "charge-status"
    }

    fn outside(&self) -> Option<&dyn OutsideSystem> {
        Some(self.provider.as_ref())
    }

    async fn outside_request(
        &self,
        tx: &Transaction<'_>,
        kind: CallKind,
        call: &StepCall,
    ) -> Result<Result<Option<Vec<u8>>, StepResult>, HandlerError> {
        let (who, amount) = parse(call)?;
        if kind != CallKind::Forward || call.action != "charge" {
            return Ok(Err(StepResult::failed("only charges go outside")));
        }
        // A write while planning is rolled back by the store.
        tx.execute("UPDATE wallets SET version = version + 100 WHERE id = $1", &[&who])
            .await?;
        Ok(Ok(Some(format!("charge:{who}:{amount}").into_bytes())))
    }

    async fn finish_outside(
        &self,
        tx: &Transaction<'_>,
        _kind: CallKind,
        call: &StepCall,
        answer: &[u8],
        events: &mut Vec<OutboxMessage>,
    ) -> Result<StepResult, HandlerError> {
        let answer = String::from_utf8_lossy(answer).into_owned();
        if !answer.starts_with("charged:") {
            return Ok(StepResult::failed(format!("the provider answered {answer:?}")));
        }
        tx.execute(
            "INSERT INTO charges (op, answer) VALUES ($1, $2)",
            &[&call.operation_id, &answer],
        )
        .await?;
        events.push(OutboxMessage::new(format!("saga/{}", call.saga_id), "charged", answer));
        Ok(StepResult::ok(""))
    }
}

async fn charges_table(st: &PgStepStore<PgCheckout>) -> i64 {
    let c = st.pool().get().await.unwrap();
    c.query_one("SELECT count(*) FROM charges", &[]).await.unwrap().get(0)
}

/// The lost reply of ADR 0034, on PostgreSQL: the provider charges and its
/// reply is lost: the operation stays in flight (an error, UNKNOWN), eight
/// concurrent resends charge once, the fence asks the provider and records OK
/// (never FAILED); while the provider cannot tell, Status and Fence are
/// errors and nothing is fenced; a request that never arrived is fenced only
/// once the provider voided its key. Before ADR 0034 the handler made the
/// call inside the step's transaction, its error rolled everything back, and
/// the fence recorded FAILED with the card charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn t61_an_outside_call_is_in_flight_until_the_provider_settles_it() {
    let Some(s) = server() else { return };
    s.execute(DB, "CREATE TABLE charges (op text PRIMARY KEY, answer text NOT NULL)")
        .unwrap();
    let provider = Arc::new(outside::Provider::with_accounts(&[("alice", 100)]));
    let mut o = PgStepOptions::new("checkout", s.conn_string(DB));
    o.concurrency = 8;
    let st = PgStepStore::connect(
        o,
        PgCheckout {
            provider: provider.clone(),
        },
    )
    .await
    .unwrap();
    let in_flight =
        |e: &Result<StepResult, StepError>| matches!(e, Err(StepError::InFlight(m)) if m.contains("in flight"));

    provider.lose_replies.store(true, Ordering::SeqCst);
    let e = st.forward(&forward("1.1.f", "charge", "alice:30")).await;
    assert!(in_flight(&e), "{e:?}");
    let copies: Vec<_> = (0..8)
        .map(|_| {
            let st = st.clone();
            tokio::spawn(async move { st.forward(&forward("1.1.f", "charge", "alice:30")).await })
        })
        .collect();
    for c in copies {
        let e = c.await.unwrap();
        assert!(in_flight(&e), "{e:?}");
    }
    assert_eq!((provider.charges(), provider.balance("alice")), (1, 70));
    assert_eq!(st.stats().await.unwrap().in_flight, 1);
    assert_eq!(st.in_flight().await.unwrap()[0].1.request, b"charge:alice:30");
    let (_, version) = wallet_of(&st, "alice").await;
    assert_eq!(version, 0, "the planning's write was rolled back");

    let f = st.fence("1.1.f").await.unwrap().expect("the provider says charged");
    assert!(f.result.is_ok(), "{f:?}");
    assert_eq!(charges_table(&st).await, 1);
    assert_eq!(st.stats().await.unwrap().in_flight, 0);
    provider.lose_replies.store(false, Ordering::SeqCst);
    assert!(st
        .forward(&forward("1.1.f", "charge", "alice:30"))
        .await
        .unwrap()
        .is_ok());
    assert_eq!((provider.charges(), charges_table(&st).await), (1, 1));

    // The provider cannot tell: in flight it stays.
    provider.lose_replies.store(true, Ordering::SeqCst);
    provider.status_down.store(true, Ordering::SeqCst);
    let e = st.forward(&forward("1.2.f", "charge", "alice:5")).await;
    assert!(in_flight(&e), "{e:?}");
    let e = st.status("1.2.f").await;
    assert!(matches!(e, Err(StepError::InFlight(_))), "{e:?}");
    let e = st.fence("1.2.f").await;
    assert!(matches!(e, Err(StepError::InFlight(_))), "{e:?}");
    assert_eq!(st.stats().await.unwrap().in_flight, 1);
    provider.status_down.store(false, Ordering::SeqCst);
    assert!(st.status("1.2.f").await.unwrap().unwrap().result.is_ok());
    assert_eq!((provider.charges(), charges_table(&st).await), (2, 2));

    // Never arrived, fenced: FAILED here, voided there, a late copy
    // refused.
    provider.lose_replies.store(false, Ordering::SeqCst);
    provider.drop_requests.store(true, Ordering::SeqCst);
    let e = st.forward(&forward("1.3.f", "charge", "alice:7")).await;
    assert!(in_flight(&e), "{e:?}");
    assert_eq!(
        st.status("1.3.f").await.unwrap(),
        None,
        "not done: not applied, still in flight"
    );
    assert_eq!(st.fence("1.3.f").await.unwrap(), None);
    assert_eq!(provider.arrive("1.3.f", b"charge:alice:7").unwrap(), outside::VOIDED);
    provider.drop_requests.store(false, Ordering::SeqCst);
    let r = st.forward(&forward("1.3.f", "charge", "alice:7")).await.unwrap();
    assert!(
        matches!(&r, StepResult::Failed { reason } if reason.contains("fenced")),
        "{r:?}"
    );
    assert_eq!(
        (provider.charges(), provider.balance("alice"), charges_table(&st).await),
        (2, 65, 2)
    );
}

async fn wallet_of(st: &PgStepStore<PgCheckout>, who: &str) -> (i64, i64) {
    let c = st.pool().get().await.unwrap();
    let r = c
        .query_one("SELECT balance, version FROM wallets WHERE id = $1", &[&who])
        .await
        .unwrap();
    (r.get(0), r.get(1))
}
