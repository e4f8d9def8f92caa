//! Saga step services whose business data lives in PostgreSQL (cargo
//! feature `postgres`; ADR 0020: the step inbox and outbox in the service's
//! database): the same guarantees as the sled [`crate::saga::StepStore`],
//! kept by one PostgreSQL transaction per call instead of one sled batch.
//!
//! A step service
//! 1. implements [`PgStepHandler`]: `forward` and `compensate` run the
//!    service's SQL inside the transaction they are given and answer a
//!    [`StepResult`], pushing outbox events as they go. A call to a system
//!    outside the service (a payment provider, a mail sender) is NOT made
//!    there: the handler declares it ([`PgStepHandler::outside_request`])
//!    and the store makes it outside any transaction, recorded in flight
//!    before and answered after (see "Outside calls" below, ADR 0034);
//! 2. opens a [`PgStepStore`] with [`PgStepOptions`] (a connection string
//!    and the service's name; the tables are created when missing);
//! 3. serves [`PgStepServer`] with [`crate::saga::serve_steps`] (or the
//!    guarded variants), and, when it emits messages, runs relays of its
//!    outbox ([`PgStepStore::relay`]: the general PostgreSQL outbox of
//!    [`crate::outbox`], so several replicas relay at once, in order per
//!    aggregate, with dead letters and the oldest-unpublished metric).
//!
//! # What one call does
//!
//! In ONE PostgreSQL transaction:
//! 1. claims the operation id: a placeholder row in the inbox
//!    (`INSERT .. ON CONFLICT DO NOTHING`). When the id is taken, the call
//!    is a repeat: the transaction is rolled back and the recorded reply
//!    answered (a concurrent duplicate waits on the row until the first
//!    call commits, then answers its reply). The handler never runs twice
//!    for one operation id.
//! 2. checks the rights ([`PgStepHandler::authorize`]); a refusal answers
//!    FAILED and is NOT recorded (rolled back), as in the sled store;
//! 3. for a compensation, claims the forward operation id too: when it has
//!    no record, a FAILED "fenced" record is written for it (a late
//!    forward call of it then answers FAILED and never runs) and the
//!    answer is NOOP without running the handler; when it has a record
//!    other than an OK forward, NOOP; otherwise the handler compensates;
//! 4. runs the handler after a savepoint; any answer but OK rolls back to
//!    the savepoint (only an OK answer changes anything) and drops the
//!    events;
//! 5. records the reply in the inbox and the messages in the outbox
//!    ([`PgOutbox::write`]), and commits. The reply is sent only after the commit, which PostgreSQL
//!    makes durable (with the default `synchronous_commit = on`).
//!
//! A handler error (`Err`) or a lost connection rolls everything back and
//! answers an error status: the orchestrator takes it as UNKNOWN and asks
//! Status, which finds nothing recorded. Status reads the inbox; Fence
//! writes the fenced record when there is none. (So a handler must never
//! call an outside system itself: a call that acted and then lost its
//! reply would be rolled back here and fenced as never done.)
//!
//! # Outside calls
//!
//! When [`PgStepHandler::outside_request`] asks for one, step 4 instead
//! writes the operation's IN-FLIGHT record (kind 3: the call and the exact
//! request) and commits; then, holding no connection, the store sends the
//! request with [`OutsideSystem::call`] under the operation id as
//! idempotency key; then, in a second transaction that locks the inbox
//! row, [`PgStepHandler::finish_outside`] turns the answer into the step's
//! result and the reply replaces the in-flight record (with the events).
//! No answer leaves the record in flight (an error: UNKNOWN). Status and
//! Fence of an in-flight operation ask [`OutsideSystem::status`]: done →
//! finished and answered; not done → Status answers "not applied" (a
//! repeated call sends the same request under the same key), Fence (which
//! asked the outside system to refuse the key) records it FAILED (fenced);
//! cannot tell → an error, nothing recorded, never fenced. A repeated call
//! of an in-flight operation sends its request again.
//!
//! Calls with different operation ids run concurrently, each on its own
//! pooled connection: the handler serialises what it must with the
//! database's row locks (`SELECT .. FOR UPDATE`), not with a lock of the
//! store's.
//!
//! # Tables
//!
//! Created when missing, shared by every service of a database (each row
//! carries the service's name):
//! - `dtx_step_inbox(service text, operation_id text, kind smallint, saga_id
//!   bigint, step integer, record bytea, recorded_ms bigint, primary key
//!   (service, operation_id))`: `kind` 0 while a call holds the placeholder
//!   (never committed), 1 forward, 2 compensation, 3 in flight; `record`
//!   is [`StepRecord::encode`] (kind 3: [`InFlight::encode`]).
//! - the service's outbox: [`crate::outbox::pg`]'s tables under
//!   [`PgStepOptions::outbox_prefix`] (by default `dtx_step_` and the
//!   service's name in lowercase letters, digits and `_`: one outbox per
//!   service, so a service's relays publish only its own messages).
//! - `dtx_step_counters(service text, name text, value bigint, primary key
//!   (service, name))`: repeated operation ids seen.

use std::future::Future;
use std::time::Duration;

use deadpool_postgres::GenericClient;
use deadpool_postgres::Pool;
pub use deadpool_postgres::Transaction;
use std::sync::Arc;
use tracing::debug;

use crate::outbox::pg::PgOutbox;
use crate::outbox::pg::PgRelay;
use crate::outbox::OutboxMessage;
use crate::outbox::Publisher;
use crate::outbox::RelaySettings;
use crate::participant::StoreError;
use crate::pg_tls::PgTls;
use crate::postgres::open_pool;
use crate::postgres::pg_err;
use crate::postgres::ConnectRetry;
use crate::postgres::GaveUp;
use crate::postgres::HandlerError;
use crate::saga::authorization_current;
use crate::saga::check_query;
use crate::saga::check_repeat;
use crate::saga::fence_record;
use crate::saga::fenced_in_flight;
use crate::saga::noop_for;
use crate::saga::outside::check_resend;
use crate::saga::outside::count_outside;
use crate::saga::outside::in_flight_message;
use crate::saga::record_of;
use crate::saga::vet;
use crate::saga::CallKind;
use crate::saga::InFlight;
use crate::saga::InboxEntry;
use crate::saga::OutsideStatus;
use crate::saga::OutsideSystem;
use crate::saga::StepBackend;
use crate::saga::StepCall;
use crate::saga::StepError;
use crate::saga::StepRecord;
use crate::saga::StepResult;
use crate::saga::StepServer;
use crate::saga::StepStats;
use crate::store::unix_ms;

pub const INBOX_TABLE: &str = "dtx_step_inbox";
pub const COUNTERS_TABLE: &str = "dtx_step_counters";
/// The longest service name.
pub const SERVICE_NAME_BYTES_MAX: usize = 128;

/// What a PostgreSQL step service implements.
pub trait PgStepHandler: Send + Sync + 'static {
    /// Runs the forward action `call.action` in `tx` (dispatch on it; an
    /// unknown name should answer FAILED) and pushes the events it emits
    /// onto `events`. Only an OK answer keeps its writes and events. Must
    /// not commit or roll back `tx`. An `Err` rolls everything back and
    /// records nothing (the orchestrator asks again).
    fn forward(
        &self,
        tx: &Transaction<'_>,
        call: &StepCall,
        events: &mut Vec<OutboxMessage>,
    ) -> impl Future<Output = Result<StepResult, HandlerError>> + Send;

    /// Undoes the forward action `call.forward_operation_id` (which the
    /// store has checked answered OK here) with compensation `call.action`,
    /// comparing the resource's version with `call.precondition`
    /// ([`StepCall::check_precondition`]) before changing anything.
    fn compensate(
        &self,
        tx: &Transaction<'_>,
        call: &StepCall,
        events: &mut Vec<OutboxMessage>,
    ) -> impl Future<Output = Result<StepResult, HandlerError>> + Send;

    /// Whether the call's rights allow it (checked before every new call);
    /// `Err(why)` answers FAILED with `why`, unrecorded. Default: refused
    /// once the rights expired.
    fn authorize(&self, call: &StepCall) -> Result<(), String> {
        authorization_current(call, unix_ms())
    }

    /// Whether `query` names a status query of this service. Default: any.
    fn knows_query(&self, _query: &str) -> bool {
        true
    }

    /// Whether status query `query` answers for operations of `action`
    /// (see [`crate::saga::StepHandler::query_answers`]). Default:
    /// [`PgStepHandler::knows_query`].
    fn query_answers(&self, query: &str, _action: &str) -> bool {
        self.knows_query(query)
    }

    /// The system outside this service that its outside calls go to, and
    /// whose status hook settles them. Default: none.
    fn outside(&self) -> Option<&dyn OutsideSystem> {
        None
    }

    /// Whether `call` calls the outside system, and with what request (as
    /// [`crate::saga::StepHandler::outside_request`]): `Ok(None)` a local
    /// call (`forward` / `compensate` run), `Ok(Some(request))` an outside
    /// call (see "Outside calls" in the module documentation),
    /// `Err(result)` answered without calling. Runs in the call's
    /// transaction; whatever it writes is rolled back. Default: `Ok(None)`.
    fn outside_request(
        &self,
        _tx: &Transaction<'_>,
        _kind: CallKind,
        _call: &StepCall,
    ) -> impl Future<Output = Result<Result<Option<Vec<u8>>, StepResult>, HandlerError>> + Send {
        async { Ok(Ok(None)) }
    }

    /// The outside system answered `answer` to in-flight call `call`
    /// (straight away, or through the status hook, maybe after a restart):
    /// the step's result, written in `tx` with the events it pushes (kept
    /// only for an OK). Must accept every answer the outside system can
    /// give, a refusal of a fenced key included (FAILED). An `Err` records
    /// nothing (the operation stays in flight). Default: FAILED.
    fn finish_outside(
        &self,
        _tx: &Transaction<'_>,
        kind: CallKind,
        call: &StepCall,
        _answer: &[u8],
        _events: &mut Vec<OutboxMessage>,
    ) -> impl Future<Output = Result<StepResult, HandlerError>> + Send {
        let r = StepResult::failed(format!(
            "{} {:?} got an outside answer, but this service finishes no outside calls",
            kind.as_str(),
            call.action
        ));
        async move { Ok(r) }
    }
}

/// How to reach PostgreSQL.
#[derive(Clone, Debug)]
pub struct PgStepOptions {
    /// The service's name: the key of its rows in the shared tables.
    pub service: String,
    /// A tokio-postgres connection string.
    pub conn_string: String,
    /// Pooled connections: how many calls run at once.
    pub concurrency: usize,
    /// Connection attempts at start before giving up (at least 1), the
    /// wait after the first failed one (doubled after each, capped), and
    /// one attempt's connect timeout.
    pub connect_attempts: u32,
    pub connect_backoff: Duration,
    pub connect_backoff_max: Duration,
    pub connect_timeout: Duration,
    /// `lock_timeout` of a step's transaction (the handler's and the
    /// store's statements): a row held longer makes the call an error
    /// (nothing recorded, the orchestrator asks again later) instead of a
    /// wait without end; 0 = no limit. A handler may set its own (`SET
    /// LOCAL lock_timeout`, `NOWAIT`). ADR 0035.
    pub handler_lock_timeout_ms: u64,
    /// `statement_timeout` of a step's transaction; 0 = no limit.
    pub handler_statement_timeout_ms: u64,
    /// The prefix of the service's outbox tables ([`PgOutbox::new`]);
    /// by default [`default_outbox_prefix`] of the service's name. Two
    /// services whose names give the same default share an outbox (and
    /// publish each other's messages): give them their own.
    pub outbox_prefix: String,
}

/// `dtx_step_` and the service's name in lowercase ASCII letters, digits
/// and `_` (anything else becomes `_`), at most 40 characters.
pub fn default_outbox_prefix(service: &str) -> String {
    let mut p = String::from("dtx_step_");
    p.extend(service.chars().map(|c| {
        let c = c.to_ascii_lowercase();
        if c.is_ascii_lowercase() || c.is_ascii_digit() {
            c
        } else {
            '_'
        }
    }));
    p.truncate(40);
    p
}

impl PgStepOptions {
    pub fn new(service: impl Into<String>, conn_string: impl Into<String>) -> Self {
        let service = service.into();
        PgStepOptions {
            outbox_prefix: default_outbox_prefix(&service),
            service,
            conn_string: conn_string.into(),
            concurrency: 16,
            connect_attempts: 8,
            connect_backoff: Duration::from_millis(200),
            connect_backoff_max: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            handler_lock_timeout_ms: 1_000,
            handler_statement_timeout_ms: 30_000,
        }
    }
}

/// The step store on PostgreSQL; see the module documentation.
pub struct PgStepStore<H: PgStepHandler> {
    pool: Pool,
    /// For cancelling the statement of a dropped call (`pg_pool::Lease`).
    tls: PgTls,
    handler: H,
    service: String,
    target: String,
    /// `SET LOCAL` of the handler limits, sent first in every step's
    /// transaction.
    limits_sql: String,
    lock_timeout_ms: u64,
    statement_timeout_ms: u64,
    /// The service's outbox (its messages are written in the step's
    /// transaction).
    outbox: PgOutbox,
    /// For the relays' own connections.
    conn_string: String,
}

/// What a step's transaction leaves to do once its connection is back.
enum Next {
    Answer(StepResult),
    /// Send (or send again) the outside call recorded in flight.
    Outside(Box<InFlight>),
}

/// What the claim of an operation id found (short-lived: its size does
/// not matter).
#[allow(clippy::large_enum_variant)]
enum Claim {
    /// Ours now (the placeholder row is written in the transaction).
    New,
    /// Recorded before: its answer, or its in-flight outside call.
    Taken(InboxEntry),
}

fn damaged(op: &str, m: String) -> StoreError {
    StoreError::Io(format!("inbox record of operation {op:?} is damaged: {m}"))
}

impl<H: PgStepHandler> PgStepStore<H> {
    /// Connects (retrying with backoff up to `opts.connect_attempts`) and
    /// creates the tables when missing; a clear error says what is wrong
    /// (an unreachable server, missing rights, a bad service name).
    pub async fn connect(opts: PgStepOptions, handler: H) -> Result<Arc<Self>, StoreError> {
        let name = &opts.service;
        if name.is_empty() || name.len() > SERVICE_NAME_BYTES_MAX || name.chars().any(|c| c.is_control()) {
            return Err(StoreError::Io(format!(
                "step service name {name:?} must be 1 to {SERVICE_NAME_BYTES_MAX} bytes without control characters"
            )));
        }
        let outbox = PgOutbox::new(&opts.outbox_prefix).map_err(StoreError::Io)?;
        let (pool, mut client, at, tls) = open_pool(
            &opts.conn_string,
            opts.concurrency,
            &ConnectRetry {
                attempts: opts.connect_attempts,
                backoff: opts.connect_backoff,
                backoff_max: opts.connect_backoff_max,
                timeout: opts.connect_timeout,
            },
        )
        .await?;
        let user = &at.user;
        let open_err = |message: String| at.open_err(message);
        let target = format!("postgresql://{}", at.label());
        let ddl = format!(
            "CREATE TABLE IF NOT EXISTS {INBOX_TABLE} (
                 service text NOT NULL,
                 operation_id text NOT NULL,
                 kind smallint NOT NULL,
                 saga_id bigint NOT NULL,
                 step integer NOT NULL,
                 record bytea NOT NULL,
                 recorded_ms bigint NOT NULL,
                 PRIMARY KEY (service, operation_id));
             CREATE TABLE IF NOT EXISTS {COUNTERS_TABLE} (
                 service text NOT NULL,
                 name text NOT NULL,
                 value bigint NOT NULL,
                 PRIMARY KEY (service, name));"
        );
        let hint = format!(
            "the role {user} needs CREATE on the schema to create {INBOX_TABLE}, {COUNTERS_TABLE} and the \
             outbox's tables {p}_outbox and {p}_outbox_versions (or an owner creates them and grants SELECT, \
             INSERT, UPDATE, DELETE on them, and USAGE on the outbox's sequence, to {user})",
            p = outbox.prefix()
        );
        let missing: bool = client
            .query_one(
                "SELECT to_regclass($1) IS NULL OR to_regclass($2) IS NULL",
                &[&INBOX_TABLE, &COUNTERS_TABLE],
            )
            .await
            .map_err(|e| open_err(format!("looking for the step tables: {e}")))?
            .get(0);
        if missing {
            let mut tries = 0;
            loop {
                match client.batch_execute(&ddl).await {
                    Ok(()) => break,
                    Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) => {
                        return Err(open_err(format!("cannot create the step tables: {e}; {hint}")));
                    }
                    // Two services creating them at once: look again.
                    Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION) && tries < 3 => {
                        tries += 1
                    }
                    Err(e) => return Err(open_err(format!("creating the step tables: {e}"))),
                }
            }
        }
        outbox.create_schema(&mut client).await.map_err(|e| {
            if e.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) {
                open_err(format!("cannot create the outbox's tables: {e}; {hint}"))
            } else {
                open_err(format!("creating the outbox's tables: {e}"))
            }
        })?;
        let allowed: bool = client
            .query_one(
                "SELECT has_table_privilege($1, 'SELECT, INSERT, UPDATE, DELETE')
                    AND has_table_privilege($2, 'SELECT, INSERT, UPDATE')
                    AND has_table_privilege($3, 'SELECT, INSERT, UPDATE, DELETE')",
                &[&INBOX_TABLE, &COUNTERS_TABLE, &format!("{}_outbox", outbox.prefix())],
            )
            .await
            .map_err(|e| open_err(format!("checking the rights on the step tables: {e}")))?
            .get(0);
        if !allowed {
            return Err(open_err(format!(
                "the role {user} lacks rights on the step tables; {hint}"
            )));
        }
        drop(client);
        let limits_sql = format!(
            "SET LOCAL lock_timeout = {}; SET LOCAL statement_timeout = {}",
            opts.handler_lock_timeout_ms, opts.handler_statement_timeout_ms
        );
        Ok(Arc::new(PgStepStore {
            pool,
            tls,
            handler,
            service: opts.service,
            target,
            limits_sql,
            lock_timeout_ms: opts.handler_lock_timeout_ms,
            statement_timeout_ms: opts.handler_statement_timeout_ms,
            outbox,
            conn_string: opts.conn_string,
        }))
    }

    /// The service's outbox (to administer: dead letters, requeue,
    /// prune; [`PgOutbox`]).
    pub fn outbox(&self) -> &PgOutbox {
        &self.outbox
    }

    /// A relay of the service's outbox on a connection of its own, handing
    /// messages to `publisher` (run it with
    /// [`crate::outbox::spawn_relay`]). Any number of relays, in this
    /// process or in the service's other replicas, may run at once: each
    /// aggregate's messages go out one at a time, in version order.
    pub async fn relay<P: Publisher>(
        &self,
        publisher: Arc<P>,
        settings: RelaySettings,
    ) -> Result<PgRelay<P>, StoreError> {
        let client = crate::postgres::connect(&self.conn_string).await?;
        Ok(PgRelay::new(self.outbox.clone(), client, publisher, settings))
    }

    pub fn handler(&self) -> &H {
        &self.handler
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    pub fn service(&self) -> &str {
        &self.service
    }

    async fn conn(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.pool
            .get()
            .await
            .map_err(|e| StoreError::Unavailable(format!("PostgreSQL at {}: {e}", self.target)))
    }

    /// Runs a forward call once per operation id (see the module
    /// documentation). Answers only after the commit.
    pub async fn forward(&self, call: &StepCall) -> Result<StepResult, StepError> {
        self.call(CallKind::Forward, call).await
    }

    /// Runs a compensation once per operation id: NOOP without running the
    /// handler when the forward operation did not answer OK here (fenced
    /// when it has no record).
    pub async fn compensate(&self, call: &StepCall) -> Result<StepResult, StepError> {
        self.call(CallKind::Compensate, call).await
    }

    async fn call(&self, kind: CallKind, call: &StepCall) -> Result<StepResult, StepError> {
        let answer = self.call_inner(kind, call).await;
        crate::saga::count_call(kind.as_str(), &answer);
        answer
    }

    async fn call_inner(&self, kind: CallKind, call: &StepCall) -> Result<StepResult, StepError> {
        crate::saga::check_call(kind, call)?;
        if kind == CallKind::Compensate {
            // A compensation of a forward action whose outside call is in
            // flight: settled first by the status hook, with a fence.
            let c = self.conn().await?;
            let fwd = self.read_entry(&c, &call.forward_operation_id).await?;
            drop(c);
            if let Some(InboxEntry::InFlight(f)) = fwd {
                self.settle(&call.forward_operation_id, f, true).await?;
            }
        }
        // A call dropped midway (the orchestrator gave up on it) cancels
        // its statement and closes the connection (ADR 0035).
        let mut lease =
            crate::pg_pool::Lease::new(self.conn().await?, self.tls.clone(), &self.service, &call.operation_id);
        let next = self.step_on(&mut lease, kind, call).await;
        lease.finish();
        match next? {
            Next::Answer(r) => Ok(r),
            Next::Outside(f) => self.call_outside(kind, *f).await,
        }
    }

    /// When a handler error is PostgreSQL giving up a wait, what bounded
    /// it (appended to the error; nothing was recorded, so the same
    /// operation id may be sent again); empty otherwise.
    fn wait_given_up(&self, e: &(dyn std::error::Error + 'static)) -> String {
        match crate::postgres::wait_given_up(e) {
            Some((GaveUp::LockTimeout, _)) => format!(
                " (a row it needs is held by another transaction; it waited at most handler_lock_timeout_ms = {} \
                 ms; nothing recorded: ask again)",
                self.lock_timeout_ms
            ),
            Some((GaveUp::StatementTimeout, _)) => format!(
                " (a statement ran past handler_statement_timeout_ms = {} ms; nothing recorded: ask again)",
                self.statement_timeout_ms
            ),
            Some((GaveUp::Deadlock, _)) | None => String::new(),
        }
    }

    /// The step's transaction on `conn`: the claim, the handler, the
    /// record; what is left to do once the connection is back.
    async fn step_on(
        &self,
        conn: &mut crate::pg_pool::Lease,
        kind: CallKind,
        call: &StepCall,
    ) -> Result<Next, StepError> {
        let tx = conn
            .transaction()
            .await
            .map_err(|e| pg_err("beginning a step's transaction", &e))?;
        tx.batch_execute(&self.limits_sql)
            .await
            .map_err(|e| pg_err("setting the step's lock and statement timeouts", &e))?;
        match self.claim(&tx, &call.operation_id, call.saga_id, call.step).await? {
            Claim::New => {}
            Claim::Taken(InboxEntry::Answered(rec)) => {
                drop(tx);
                return self.repeat(conn.object(), kind, call, rec).await.map(Next::Answer);
            }
            Claim::Taken(InboxEntry::InFlight(f)) => {
                // Sent out before: send the same request again (same key).
                drop(tx);
                check_resend(kind, call, &f)?;
                return Ok(Next::Outside(Box::new(f)));
            }
        }
        if let Err(why) = self.handler.authorize(call) {
            // Not recorded: the rights may be renewed and the same
            // operation id sent again. Dropping `tx` rolls back.
            return Ok(Next::Answer(StepResult::failed(format!(
                "authorization refused: {why}"
            ))));
        }
        // A compensation: did its forward operation answer OK here?
        let noop = match kind {
            CallKind::Forward => None,
            CallKind::Compensate => match self
                .claim(&tx, &call.forward_operation_id, call.saga_id, call.step)
                .await?
            {
                Claim::Taken(InboxEntry::Answered(f)) if f.kind == CallKind::Forward && f.result.happened() => None,
                Claim::Taken(InboxEntry::Answered(f)) => Some(noop_for(&call.forward_operation_id, Some(&f))),
                Claim::Taken(InboxEntry::InFlight(f)) => {
                    // Settled above, in flight again: never NOOP (nor
                    // fence) what may have happened. Dropping `tx` rolls
                    // back.
                    return Err(StepError::InFlight(in_flight_message(
                        &call.forward_operation_id,
                        &f,
                        "the compensation of it waits until it is settled",
                    )));
                }
                Claim::New => {
                    // Fenced in this transaction: a late forward call of it
                    // must never run after this NOOP.
                    self.write_record(&tx, &call.forward_operation_id, &fence_record(call.saga_id, call.step))
                        .await?;
                    Some(noop_for(&call.forward_operation_id, None))
                }
            },
        };
        let mut events = Vec::new();
        let result = match noop {
            Some(n) => n,
            None => {
                tx.batch_execute("SAVEPOINT dtx_step_handler")
                    .await
                    .map_err(|e| pg_err("setting the handler's savepoint", &e))?;
                let plan = self.handler.outside_request(&tx, kind, call).await.map_err(|e| {
                    StoreError::Io(format!("the {} handler's outside request failed: {e}", kind.as_str()))
                })?;
                let r = match plan {
                    Ok(Some(request)) => {
                        // Recorded in flight and committed before anything
                        // leaves; the planning wrote nothing.
                        tx.batch_execute("ROLLBACK TO SAVEPOINT dtx_step_handler")
                            .await
                            .map_err(|e| pg_err("rolling back the handler's planning", &e))?;
                        let Some(system) = self.handler.outside() else {
                            return Err(StepError::Invalid(format!(
                                "{} {:?} asks for an outside call, but the handler names no outside system",
                                kind.as_str(),
                                call.action
                            )));
                        };
                        let f = InFlight {
                            kind,
                            call: call.clone(),
                            system: system.name().to_string(),
                            request,
                            since_ms: unix_ms(),
                        };
                        self.write_in_flight(&tx, &call.operation_id, &f).await?;
                        crate::pg_pool::commit_durably(tx)
                            .await
                            .map_err(|e| pg_err("committing an in-flight record", &e))?;
                        return Ok(Next::Outside(Box::new(f)));
                    }
                    Ok(None) => match kind {
                        CallKind::Forward => self.handler.forward(&tx, call, &mut events).await,
                        CallKind::Compensate => self.handler.compensate(&tx, call, &mut events).await,
                    }
                    .map_err(|e| {
                        StoreError::Io(format!(
                            "the {} handler failed: {e}{}",
                            kind.as_str(),
                            self.wait_given_up(&*e)
                        ))
                    })?,
                    Err(answer) => answer,
                };
                let r = vet(kind, r);
                if !r.happened() {
                    // Only an OK (or PENDING: accepted) answer changes
                    // anything.
                    events.clear();
                    tx.batch_execute("ROLLBACK TO SAVEPOINT dtx_step_handler")
                        .await
                        .map_err(|e| pg_err("rolling back the handler's work", &e))?;
                }
                r
            }
        };
        let record = record_of(kind, call, result);
        self.write_record(&tx, &call.operation_id, &record).await?;
        self.write_events(&tx, &events).await?;
        crate::pg_pool::commit_durably(tx)
            .await
            .map_err(|e| pg_err("committing a step's transaction", &e))?;
        match kind {
            CallKind::Forward => dtx_failpoint::failpoint!("step_forward_after_commit_before_reply"),
            CallKind::Compensate => dtx_failpoint::failpoint!("step_compensation_after_commit_before_reply"),
        }
        debug!(
            saga_id = call.saga_id,
            step = call.step,
            operation_id = %call.operation_id,
            action = %call.action,
            outcome = record.result.label(),
            "{} recorded",
            kind.as_str()
        );
        Ok(Next::Answer(record.result))
    }

    /// Writes the outbox messages of a call in `tx`.
    async fn write_events(&self, tx: &Transaction<'_>, events: &[OutboxMessage]) -> Result<(), StoreError> {
        if events.is_empty() {
            return Ok(());
        }
        for msg in events {
            self.outbox
                .write(tx, msg)
                .await
                .map_err(|e| pg_err("writing an outbox message", &e))?;
        }
        Ok(())
    }

    /// Sends in-flight call `f` to the outside system (no connection
    /// held) and records its answer; no answer leaves it in flight (an
    /// error: UNKNOWN to the orchestrator).
    async fn call_outside(&self, kind: CallKind, f: InFlight) -> Result<StepResult, StepError> {
        let op = f.call.operation_id.clone();
        let Some(system) = self.handler.outside() else {
            return Err(StepError::InFlight(in_flight_message(
                &op,
                &f,
                "this service names no outside system to send it to",
            )));
        };
        match system.call(&op, &f.request).await {
            Ok(answer) => {
                count_outside("call", "answered");
                let rec = self.finish(&op, &answer).await?;
                match kind {
                    CallKind::Forward => dtx_failpoint::failpoint!("step_forward_after_commit_before_reply"),
                    CallKind::Compensate => {
                        dtx_failpoint::failpoint!("step_compensation_after_commit_before_reply")
                    }
                }
                debug!(operation_id = %op, outcome = rec.result.label(), "outside call answered and recorded");
                Ok(rec.result)
            }
            Err(why) => {
                count_outside("call", "no_answer");
                let msg = in_flight_message(&op, &f, &format!("no answer from the {}: {why}", system.name()));
                tracing::info!("{msg}");
                Err(StepError::InFlight(msg))
            }
        }
    }

    /// Records the outside system's `answer` to in-flight operation `op`,
    /// in a transaction that locks its inbox row: the handler's result,
    /// its writes and events, unless something settled it first. Its
    /// record, once committed.
    async fn finish(&self, op: &str, answer: &[u8]) -> Result<StepRecord, StepError> {
        let mut conn = self.conn().await?;
        let tx = conn
            .transaction()
            .await
            .map_err(|e| pg_err("beginning the finish of an outside call", &e))?;
        let f = match self.lock_entry(&tx, op).await? {
            Some(InboxEntry::Answered(rec)) => return Ok(rec),
            None => return Err(StoreError::Io(format!("operation {op:?} was in flight and has no record now")).into()),
            Some(InboxEntry::InFlight(f)) => f,
        };
        tx.batch_execute("SAVEPOINT dtx_step_handler")
            .await
            .map_err(|e| pg_err("setting the handler's savepoint", &e))?;
        let mut events = Vec::new();
        let result = self
            .handler
            .finish_outside(&tx, f.kind, &f.call, answer, &mut events)
            .await
            .map_err(|e| StoreError::Io(format!("finishing outside call {op:?} failed: {e}")))?;
        let result = vet(f.kind, result);
        if !result.happened() {
            events.clear();
            tx.batch_execute("ROLLBACK TO SAVEPOINT dtx_step_handler")
                .await
                .map_err(|e| pg_err("rolling back the handler's work", &e))?;
        }
        let record = record_of(f.kind, &f.call, result);
        self.write_record(&tx, op, &record).await?;
        self.write_events(&tx, &events).await?;
        crate::pg_pool::commit_durably(tx)
            .await
            .map_err(|e| pg_err("committing the finish of an outside call", &e))?;
        Ok(record)
    }

    /// Settles in-flight operation `op` by the outside system's status hook
    /// (with `fence`: "not done" made final there, and recorded FAILED
    /// here): its record, `None` when not done, an error while the outside
    /// system cannot tell.
    async fn settle(&self, op: &str, f: InFlight, fence: bool) -> Result<Option<StepRecord>, StepError> {
        let Some(system) = self.handler.outside() else {
            return Err(StepError::InFlight(in_flight_message(
                op,
                &f,
                "this service names no outside system whose status hook could settle it",
            )));
        };
        match system.status(op, &f.request, fence).await {
            OutsideStatus::Done(answer) => {
                count_outside("status", "done");
                self.finish(op, &answer).await.map(Some)
            }
            OutsideStatus::NotDone if !fence => {
                count_outside("status", "not_done");
                Ok(None)
            }
            OutsideStatus::NotDone => {
                count_outside("fence", "not_done");
                let mut conn = self.conn().await?;
                let tx = conn.transaction().await.map_err(|e| pg_err("beginning a fence", &e))?;
                let existing = match self.lock_entry(&tx, op).await? {
                    Some(InboxEntry::Answered(rec)) => Some(rec),
                    _ => {
                        self.write_record(&tx, op, &fenced_in_flight(&f)).await?;
                        None
                    }
                };
                tx.commit().await.map_err(|e| pg_err("committing a fence", &e))?;
                Ok(existing)
            }
            OutsideStatus::Unknown(why) => {
                count_outside(if fence { "fence" } else { "status" }, "unknown");
                Err(StepError::InFlight(in_flight_message(
                    op,
                    &f,
                    &format!("the {}'s status hook cannot tell: {why}", system.name()),
                )))
            }
        }
    }

    /// Claims `op` in `tx`: a placeholder row (kind 0) when it has none
    /// (held until the transaction ends; a concurrent claim of it waits),
    /// else its committed record (an answer, or an in-flight call).
    async fn claim(&self, tx: &Transaction<'_>, op: &str, saga_id: u64, step: u32) -> Result<Claim, StoreError> {
        let insert = tx
            .prepare_cached(&format!(
                "INSERT INTO {INBOX_TABLE} (service, operation_id, kind, saga_id, step, record, recorded_ms)
                 VALUES ($1, $2, 0, $3, $4, '\\x', $5) ON CONFLICT DO NOTHING"
            ))
            .await
            .map_err(|e| pg_err("preparing the inbox claim", &e))?;
        let n = tx
            .execute(
                &insert,
                &[
                    &self.service,
                    &op,
                    &(saga_id as i64),
                    &(step as i32),
                    &(unix_ms() as i64),
                ],
            )
            .await
            .map_err(|e| pg_err("claiming an operation id", &e))?;
        if n == 1 {
            return Ok(Claim::New);
        }
        match self.read_entry(tx, op).await? {
            Some(e) => Ok(Claim::Taken(e)),
            // Taken by a transaction that then rolled back between our
            // insert and read: not possible (ON CONFLICT waited for it to
            // end); a damaged table if it happens.
            None => Err(StoreError::Io(format!(
                "operation {op:?} is neither free nor recorded in {INBOX_TABLE}"
            ))),
        }
    }

    /// What the inbox holds under `op` (committed: an answer or an
    /// in-flight call).
    async fn read_entry<C: GenericClient + Sync>(&self, c: &C, op: &str) -> Result<Option<InboxEntry>, StoreError> {
        let select = c
            .prepare_cached(&format!(
                "SELECT record FROM {INBOX_TABLE} WHERE service = $1 AND operation_id = $2 AND kind <> 0"
            ))
            .await
            .map_err(|e| pg_err("preparing the inbox read", &e))?;
        let row = c
            .query_opt(&select, &[&self.service, &op])
            .await
            .map_err(|e| pg_err("reading the inbox", &e))?;
        row.map(|r| InboxEntry::decode(r.get::<_, &[u8]>(0)).map_err(|m| damaged(op, m)))
            .transpose()
    }

    /// As `read_entry`, locking the row until `tx` ends (a concurrent
    /// finish or fence of the same in-flight operation waits).
    async fn lock_entry(&self, tx: &Transaction<'_>, op: &str) -> Result<Option<InboxEntry>, StoreError> {
        let select = tx
            .prepare_cached(&format!(
                "SELECT record FROM {INBOX_TABLE} WHERE service = $1 AND operation_id = $2 AND kind <> 0 FOR UPDATE"
            ))
            .await
            .map_err(|e| pg_err("preparing the inbox lock", &e))?;
        let row = tx
            .query_opt(&select, &[&self.service, &op])
            .await
            .map_err(|e| pg_err("locking an inbox row", &e))?;
        row.map(|r| InboxEntry::decode(r.get::<_, &[u8]>(0)).map_err(|m| damaged(op, m)))
            .transpose()
    }

    /// Writes `op`'s in-flight record over its placeholder (kind 3).
    async fn write_in_flight(&self, tx: &Transaction<'_>, op: &str, f: &InFlight) -> Result<(), StoreError> {
        let update = tx
            .prepare_cached(&format!(
                "UPDATE {INBOX_TABLE} SET kind = 3, record = $3, recorded_ms = $4
                 WHERE service = $1 AND operation_id = $2"
            ))
            .await
            .map_err(|e| pg_err("preparing the in-flight write", &e))?;
        tx.execute(&update, &[&self.service, &op, &f.encode(), &(f.since_ms as i64)])
            .await
            .map_err(|e| pg_err("writing an in-flight record", &e))?;
        Ok(())
    }

    async fn write_record(&self, tx: &Transaction<'_>, op: &str, rec: &StepRecord) -> Result<(), StoreError> {
        let update = tx
            .prepare_cached(&format!(
                "UPDATE {INBOX_TABLE} SET kind = $3, record = $4, recorded_ms = $5
                 WHERE service = $1 AND operation_id = $2"
            ))
            .await
            .map_err(|e| pg_err("preparing the inbox write", &e))?;
        let kind: i16 = match rec.kind {
            CallKind::Forward => 1,
            CallKind::Compensate => 2,
        };
        tx.execute(
            &update,
            &[&self.service, &op, &kind, &rec.encode(), &(rec.at_ms as i64)],
        )
        .await
        .map_err(|e| pg_err("writing the inbox", &e))?;
        Ok(())
    }

    /// A repeated operation id: its recorded reply (committed, so durable).
    async fn repeat<C: GenericClient + Sync>(
        &self,
        c: &C,
        kind: CallKind,
        call: &StepCall,
        rec: StepRecord,
    ) -> Result<StepResult, StepError> {
        check_repeat(kind, call, &rec)?;
        let bump = c
            .prepare_cached(&format!(
                "INSERT INTO {COUNTERS_TABLE} (service, name, value) VALUES ($1, $2, 1)
                 ON CONFLICT (service, name) DO UPDATE SET value = {COUNTERS_TABLE}.value + 1"
            ))
            .await
            .map_err(|e| pg_err("preparing the duplicate counter", &e))?;
        let name = format!("duplicates-{}", kind.as_str());
        c.execute(&bump, &[&self.service, &name])
            .await
            .map_err(|e| pg_err("counting a duplicate", &e))?;
        debug!(
            operation_id = %call.operation_id,
            outcome = rec.result.label(),
            "repeated {} answered from the inbox",
            kind.as_str()
        );
        Ok(rec.result)
    }

    /// What `operation_id` did here: `None` when nothing (yet), else its
    /// record. An operation in flight is settled by the outside system's
    /// status hook (see the module documentation); otherwise changes
    /// nothing.
    pub async fn status(&self, operation_id: &str) -> Result<Option<StepRecord>, StepError> {
        self.status_of(operation_id, None).await
    }

    /// [`PgStepStore::status`] for status query `query` (when given,
    /// refused unless it answers for the operation's action).
    pub async fn status_of(&self, operation_id: &str, query: Option<&str>) -> Result<Option<StepRecord>, StepError> {
        let answer = async {
            if operation_id.is_empty() {
                return Err(StepError::Invalid("the status query has no operation id".into()));
            }
            let c = self.conn().await?;
            let entry = self.read_entry(&c, operation_id).await?;
            drop(c);
            if let (Some(q), Some(e)) = (query, &entry) {
                check_query(|q, a| self.handler.query_answers(q, a), operation_id, q, e)?;
            }
            match entry {
                None => Ok(None),
                Some(InboxEntry::Answered(rec)) => Ok(Some(rec)),
                Some(InboxEntry::InFlight(f)) => self.settle(operation_id, f, false).await,
            }
        }
        .await;
        crate::saga::count_lookup("status", &answer);
        answer
    }

    /// As [`PgStepStore::status`]; when nothing, records `operation_id` as
    /// a FAILED forward call ("fenced") and answers `None`, so "not
    /// applied" stays true. An operation in flight is fenced only when the
    /// outside system's status hook says it never happened (and now
    /// refuses its key); while it cannot tell, an error and nothing
    /// recorded.
    pub async fn fence(&self, operation_id: &str) -> Result<Option<StepRecord>, StepError> {
        self.fence_of(operation_id, None).await
    }

    /// [`PgStepStore::fence`] for status query `query` (see
    /// [`PgStepStore::status_of`]).
    pub async fn fence_of(&self, operation_id: &str, query: Option<&str>) -> Result<Option<StepRecord>, StepError> {
        let answer = self.fence_inner(operation_id, query).await;
        crate::saga::count_fence(&answer);
        answer
    }

    async fn fence_inner(&self, operation_id: &str, query: Option<&str>) -> Result<Option<StepRecord>, StepError> {
        if operation_id.is_empty() {
            return Err(StepError::Invalid("the fence names no operation id".into()));
        }
        let mut conn = self.conn().await?;
        let tx = conn.transaction().await.map_err(|e| pg_err("beginning a fence", &e))?;
        let existing = match self.claim(&tx, operation_id, 0, 0).await? {
            Claim::Taken(e) => {
                drop(tx);
                drop(conn);
                if let Some(q) = query {
                    check_query(|q, a| self.handler.query_answers(q, a), operation_id, q, &e)?;
                }
                return match e {
                    InboxEntry::Answered(rec) => Ok(Some(rec)),
                    InboxEntry::InFlight(f) => self.settle(operation_id, f, true).await,
                };
            }
            Claim::New => {
                self.write_record(&tx, operation_id, &fence_record(0, 0)).await?;
                None
            }
        };
        tx.commit().await.map_err(|e| pg_err("committing a fence", &e))?;
        Ok(existing)
    }

    /// Every answered inbox record of this service (operation id,
    /// record), in operation id order (operations in flight:
    /// [`PgStepStore::in_flight`]).
    pub async fn records(&self) -> Result<Vec<(String, StepRecord)>, StoreError> {
        let c = self.conn().await?;
        let rows = c
            .query(
                &format!(
                    "SELECT operation_id, record FROM {INBOX_TABLE} WHERE service = $1 AND kind IN (1, 2)
                     ORDER BY operation_id"
                ),
                &[&self.service],
            )
            .await
            .map_err(|e| pg_err("listing the inbox", &e))?;
        rows.iter()
            .map(|r| {
                let op: String = r.get(0);
                let rec = StepRecord::decode(r.get::<_, &[u8]>(1)).map_err(|m| damaged(&op, m))?;
                Ok((op, rec))
            })
            .collect()
    }

    /// Every operation of this service whose outside call is in flight, in
    /// operation id order.
    pub async fn in_flight(&self) -> Result<Vec<(String, InFlight)>, StoreError> {
        let c = self.conn().await?;
        let rows = c
            .query(
                &format!(
                    "SELECT operation_id, record FROM {INBOX_TABLE} WHERE service = $1 AND kind = 3
                     ORDER BY operation_id"
                ),
                &[&self.service],
            )
            .await
            .map_err(|e| pg_err("listing the operations in flight", &e))?;
        rows.iter()
            .map(|r| {
                let op: String = r.get(0);
                let f = InFlight::decode(r.get::<_, &[u8]>(1)).map_err(|m| damaged(&op, m))?;
                Ok((op, f))
            })
            .collect()
    }

    /// Counts of the inbox, the duplicates seen and the outbox.
    pub async fn stats(&self) -> Result<StepStats, StoreError> {
        let c = self.conn().await?;
        let row = c
            .query_one(
                &format!(
                    "SELECT (SELECT count(*) FROM {INBOX_TABLE} WHERE service = $1 AND kind = 1),
                            (SELECT count(*) FROM {INBOX_TABLE} WHERE service = $1 AND kind = 2),
                            (SELECT coalesce(max(value), 0) FROM {COUNTERS_TABLE}
                               WHERE service = $1 AND name = 'duplicates-forward'),
                            (SELECT coalesce(max(value), 0) FROM {COUNTERS_TABLE}
                               WHERE service = $1 AND name = 'duplicates-compensate'),
                            (SELECT count(*) FROM {INBOX_TABLE} WHERE service = $1 AND kind = 3)"
                ),
                &[&self.service],
            )
            .await
            .map_err(|e| pg_err("counting the inbox and outbox", &e))?;
        let n = |i: usize| row.get::<_, i64>(i).max(0) as u64;
        let outbox_pending = self
            .outbox
            .pending_count(&c)
            .await
            .map_err(|e| pg_err("counting the outbox", &e))?;
        Ok(StepStats {
            forward_records: n(0),
            compensate_records: n(1),
            forward_duplicates: n(2),
            compensate_duplicates: n(3),
            outbox_pending,
            in_flight: n(4),
        })
    }
}

/// `dtx.v1.SagaStepService` on a [`PgStepStore`].
pub type PgStepServer<H> = StepServer<PgStepStore<H>>;

#[tonic::async_trait]
impl<H: PgStepHandler> StepBackend for PgStepStore<H> {
    async fn forward(&self, call: &StepCall) -> Result<StepResult, StepError> {
        PgStepStore::forward(self, call).await
    }

    async fn compensate(&self, call: &StepCall) -> Result<StepResult, StepError> {
        PgStepStore::compensate(self, call).await
    }

    async fn status(&self, operation_id: &str, query: &str) -> Result<Option<StepRecord>, StepError> {
        PgStepStore::status_of(self, operation_id, Some(query)).await
    }

    async fn fence(&self, operation_id: &str, query: &str) -> Result<Option<StepRecord>, StepError> {
        PgStepStore::fence_of(self, operation_id, Some(query)).await
    }

    fn knows_query(&self, query: &str) -> bool {
        self.handler.knows_query(query)
    }
}
