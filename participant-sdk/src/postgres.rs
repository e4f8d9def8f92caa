//! A participant whose resource is a PostgreSQL database (cargo feature
//! `postgres`): each transaction's work runs in a PostgreSQL transaction
//! that Prepare ends with `PREPARE TRANSACTION`, and Commit / Abort end
//! with `COMMIT PREPARED` / `ROLLBACK PREPARED`. PostgreSQL's prepared
//! transactions survive a crash of the server, so the durable "YES" is
//! PostgreSQL's own; this module keeps the contract of [`crate::log::step`]
//! on top of it (docs/adr/0015-postgresql-participant.md).
//!
//! # The service's part
//!
//! A [`PgHandler`] runs the service's SQL for one transaction inside the
//! open PostgreSQL transaction it is given and returns a [`Verdict`]: YES
//! (keep the work: it is prepared), READ_ONLY (nothing to keep: rolled
//! back) or NO with a reason (rolled back). It may do any I/O. An `Err`
//! from the handler rolls the work back, records nothing and fails the
//! message (the coordinator retries or aborts); a handler that wants a
//! firm NO returns `Ok(Verdict::no(..))`.
//!
//! # What is stored
//!
//! - The global transaction id (gid) of a prepared transaction is
//!   `dtx:v1:<participant_id>:<txid>:<term>` for a txid of incarnation 0
//!   (as before incarnations, so transactions prepared then are still
//!   found) and `dtx:v2:<participant_id>:<incarnation>:<txid>:<term>`
//!   otherwise (the incarnation in 16 lowercase hex digits), `term` being
//!   the term of the Prepare that prepared it. Participant ids are checked
//!   at construction: non-empty, no `:`, no control characters, at most
//!   [`MAX_PARTICIPANT_ID_LEN`] bytes (so the gid stays under PostgreSQL's
//!   200-byte limit). Only gids with this participant's prefixes in the
//!   current database are ever listed, committed or rolled back.
//! - Tables, created when missing:
//!   `dtx_participant_log(participant text, txid bigint, state text,
//!   term bigint, decided_ms bigint, primary key (participant, txid))`,
//!   with an index on `(participant, decided_ms, txid)`, for transactions
//!   of incarnation 0 (unchanged since before incarnations: its rows, and
//!   the markers inside transactions prepared then, keep their meaning);
//!   `dtx_participant_log_inc`, the same with `incarnation bigint` in the
//!   primary key `(participant, incarnation, txid)` and the index, for
//!   every other incarnation (a table of its own rather than a column
//!   added to the first: adding one needs a lock that every transaction
//!   still prepared from before holds against it until its decision,
//!   which only this participant can apply, so an upgrade with
//!   transactions in doubt would never start); and
//!   `dtx_participant_term_floor(participant text, incarnation bigint,
//!   term bigint, primary key (participant, incarnation))`, the term floor
//!   (below). `txid` and `incarnation` hold the u64s' bits as bigints.
//!   `state` is one of
//!   - `committed`: inserted by Prepare INSIDE the prepared transaction
//!     (so it becomes visible exactly when `COMMIT PREPARED` commits the
//!     work: a Commit redelivered after PostgreSQL forgot the gid finds it
//!     and acks), or by a one-phase commit in its own transaction;
//!   - `aborted`: the handler voted NO, or an Abort rolled back the prepared
//!     work;
//!   - `tombstone`: an Abort came before any Prepare (a late Prepare votes
//!     NO);
//!   - `read_only`: the handler voted READ_ONLY (a repeat answers the same).
//!
//!   `decided_ms` is when the row was written (for a `committed` marker:
//!   when it was prepared), for log garbage collection.
//!
//! # Fencing
//!
//! The term recorded for a transaction is, while it is prepared, the gid's
//! or the higher one a later accepted message raised it to (a prepared
//! transaction cannot be renamed, so a Prepare repeated at a higher term
//! writes that term to [`RAISED_TABLE`], kept in memory too, and the row
//! goes once the decision is applied); once decided, the row's (raised by
//! later accepted messages). A message from a lower term is refused
//! ([`Refusal::StaleTerm`]).
//!
//! The term floor of an incarnation is the highest term of any message of
//! it this participant took; a Prepare or CommitOnePhase of a txid with
//! neither gid nor row from a lower term is refused (a deposed leader's,
//! which may re-send a one-phase commit whose row was garbage-collected).
//! It is raised, in its own short transaction, before anything the message
//! records is written (so it is never below a recorded term; a crash in
//! between leaves it at a term a leader really sent), and never lowered:
//! garbage collection leaves it. A database written before the floor
//! existed gets incarnation 0's floor from its rows and prepared gids at
//! the first start.
//!
//! Messages for the same txid are serialised inside the process (one async
//! lock per txid); messages for different txids run concurrently, each on
//! its own pooled connection.
//!
//! # Sessions, pools and TLS (docs/adr/0035-postgresql-sessions-pools-and-tls.md)
//!
//! - Prepares and one-phase commits (the handlers) run on one pool
//!   ([`PgOptions::concurrency`]), Commits, Aborts and recovery on another
//!   ([`PgOptions::decision_pool_size`]), so handlers waiting on locks never
//!   hold up the decisions that would release them; a connection is waited
//!   for at most [`PgOptions::pool_wait_timeout_ms`].
//! - A handler's transaction has a lock and a statement timeout
//!   ([`PgOptions::handler_lock_timeout_ms`],
//!   [`PgOptions::handler_statement_timeout_ms`]); PostgreSQL giving up a
//!   wait (SQLSTATE 55P03, 57014, 40P01) is a NO vote with the reason.
//! - A message whose call is dropped midway cancels its statement and
//!   closes its connection.
//! - Every commit the SDK acknowledges is flushed before it answers,
//!   whatever `synchronous_commit` the role or the handler set (`off` is
//!   raised to `on` per session and per transaction).
//! - No free prepared-transaction slot (SQLSTATE 53200) is a NO vote naming
//!   `max_prepared_transactions`. A handler that did what PostgreSQL cannot
//!   prepare (a temporary table, LISTEN/UNLISTEN/NOTIFY, a cursor WITH
//!   HOLD, an exported snapshot: SQLSTATE 0A000 at PREPARE TRANSACTION) is
//!   a NO vote naming the restriction, recorded like any NO. COMMIT / ROLLBACK PREPARED of another
//!   role's transaction (SQLSTATE 42501, a rotated role) runs as that role
//!   when this one is a member of it, else fails saying how to fix it (the
//!   decision is delivered again).
//! - `sslmode`, `sslrootcert`, `sslcert` and `sslkey` in the connection
//!   string: TLS with rustls, always verified ([`PgOptions::conn_string`]).

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;
use std::time::SystemTime;

use deadpool_postgres::ClientWrapper as Client;
use deadpool_postgres::Pool;
use deadpool_postgres::PoolError;
/// The open PostgreSQL transaction a handler works in: deadpool-postgres's
/// wrapper of `tokio_postgres::Transaction` (every tokio-postgres method
/// through `Deref`), with `prepare_cached`, which parses a statement once
/// per pooled connection instead of on every call (a round trip each).
pub use deadpool_postgres::Transaction;
use tokio_postgres::error::SqlState;

use crate::log::GlobalTxid;
use crate::log::LocalState;
use crate::log::LogEntry;
use crate::log::Message;
use crate::log::Refusal;
use crate::log::Vote;
use crate::participant::Answer;
use crate::participant::InDoubtSummary;
use crate::participant::InspectQuery;
use crate::participant::InspectedRecord;
use crate::participant::Inspection;
use crate::participant::Participant;
use crate::participant::Verdict;
use crate::pg_pool::Endpoint;
use crate::pg_pool::Lease;
use crate::pg_pool::TRANSACTION_DURABLE;
use crate::pg_tls::PgTls;
use crate::store::PhaseTwo;
use crate::store::Reply;
use crate::store::StoreError;

/// The log table's name (transactions of incarnation 0).
pub const LOG_TABLE: &str = "dtx_participant_log";

/// Branches prepared here whose registration is not known to be recorded
/// (docs/protocol.md, "Branches"; [`branch`]).
pub const BRANCH_TABLE: &str = "dtx_participant_branch";

pub mod branch;

/// The log table of transactions of every other incarnation.
pub const LOG_INC_TABLE: &str = "dtx_participant_log_inc";

/// The term floors, one row per (participant, incarnation).
pub const FLOOR_TABLE: &str = "dtx_participant_term_floor";

/// Terms raised while prepared: a message of a later term than its gid's
/// accepted for a prepared transaction (a new leader's repeated Prepare),
/// one row per (participant, incarnation, txid) until the decision. The gid
/// keeps the Prepare's term (a prepared transaction cannot be renamed), so
/// the raised term lives here; fencing uses the higher of the two.
pub const RAISED_TABLE: &str = "dtx_participant_raised_term";

/// The longest participant id: the longest gid, `dtx:v2:`, the id, `:`,
/// 16 hex digits, `:`, 20 digits, `:` and 20 digits (194 bytes), stays
/// under PostgreSQL's 200-byte gid limit.
pub const MAX_PARTICIPANT_ID_LEN: usize = 128;

/// What a handler's failure carries.
pub type HandlerError = Box<dyn std::error::Error + Send + Sync>;

/// The service's work for one transaction, run inside the PostgreSQL
/// transaction that Prepare (or a one-phase commit) ends.
pub trait PgHandler: Send + Sync + 'static {
    /// Runs the transaction's SQL in `tx` and votes. YES keeps the work
    /// (prepared, then committed or rolled back by the decision); READ_ONLY
    /// and NO roll it back. Must not commit or roll back `tx` itself.
    ///
    /// Rows a prepared transaction wrote stay locked until its decision: a
    /// handler that touches them waits at most
    /// [`PgOptions::handler_lock_timeout_ms`] (then the vote is NO, with
    /// the reason), or less if it bounds the wait itself (`SET LOCAL
    /// lock_timeout`, `NOWAIT`, voting NO). A statement is cancelled after
    /// [`PgOptions::handler_statement_timeout_ms`]. Statements run
    /// on every Prepare are best prepared with `tx.prepare_cached(sql)`:
    /// a statement given as text costs an extra round trip each time.
    ///
    /// `txid` names the transaction with its incarnation: a handler that
    /// keys rows by transaction (an apply log) keys them by both.
    fn prepare(
        &self,
        tx: &Transaction<'_>,
        txid: GlobalTxid,
        payload: &[u8],
    ) -> impl Future<Output = Result<Verdict, HandlerError>> + Send;
}

/// A connection to PostgreSQL (`conn_string` as tokio-postgres reads it,
/// with `sslmode`, `sslrootcert`, `sslcert` and `sslkey` as the
/// participant reads them: see [`PgOptions::conn_string`]), its connection
/// task spawned on the current runtime: for a service's work outside the
/// participant's messages (creating its tables, audits). The participant
/// itself uses its own pools.
pub async fn connect(conn_string: &str) -> Result<tokio_postgres::Client, StoreError> {
    let settings = crate::pg_tls::parse(conn_string).map_err(StoreError::Io)?;
    let (db, connection) = settings.config.connect(settings.tls.clone()).await.map_err(|e| {
        let host = settings
            .config
            .get_hosts()
            .first()
            .map(|h| match h {
                tokio_postgres::config::Host::Tcp(s) => s.clone(),
                tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
            })
            .unwrap_or_default();
        match crate::pg_tls::describe_connect_error(&e, &settings, &host) {
            Some(m) => StoreError::Unavailable(m),
            None => pg_err("connecting", &e),
        }
    })?;
    tokio::spawn(connection);
    Ok(db)
}

/// How many prepared transactions the connected database holds, whoever
/// prepared them: 0 once every decision about them has been applied.
pub async fn prepared_in_database(db: &tokio_postgres::Client) -> Result<i64, tokio_postgres::Error> {
    Ok(db
        .query_one(
            "SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database()",
            &[],
        )
        .await?
        .get(0))
}

/// How to reach PostgreSQL and what to check at start.
#[derive(Clone, Debug)]
pub struct PgOptions {
    /// As enlisted; part of every gid and the key of the log rows.
    pub participant_id: String,
    /// A connection string as tokio-postgres reads it (`host=.. port=..
    /// user=.. dbname=..`, or a `postgresql://` URL), with libpq's TLS
    /// keys: `sslmode` (`disable`, the default: plain text; `prefer`,
    /// `require`, `verify-ca`, `verify-full`), `sslrootcert` (a PEM file of
    /// the authorities that sign the server's certificate; needed by every
    /// mode but `disable`: a TLS connection is always verified), `sslcert`
    /// and `sslkey` (a client certificate). See docs/operations.md,
    /// "PostgreSQL participants", and ADR 0035.
    pub conn_string: String,
    /// The handlers' pool: how many Prepares and one-phase commits run at
    /// once (their handlers included); also the least
    /// `max_prepared_transactions` accepted at start (a floor: prepared
    /// transactions outlive connections, see docs/operations.md).
    pub concurrency: usize,
    /// The decisions' pool: connections for Commit and Abort (phase two)
    /// and recovery, apart from the handlers', so handlers waiting on
    /// locks never hold up the decisions that would release them.
    pub decision_pool_size: usize,
    /// The longest a message waits for a pooled connection before it fails
    /// as unavailable (the coordinator retries it); at least 1.
    pub pool_wait_timeout_ms: u64,
    /// `lock_timeout` of a handler's transaction: a handler waiting longer
    /// for a row lock (one a prepared transaction holds lasts until its
    /// decision) votes NO, saying so. 0: no limit (PostgreSQL's 0). A
    /// handler may set its own (`SET LOCAL lock_timeout`, `NOWAIT`).
    pub handler_lock_timeout_ms: u64,
    /// `statement_timeout` of a handler's transaction: a statement running
    /// longer is cancelled and the vote is NO. 0: no limit.
    pub handler_statement_timeout_ms: u64,
    /// Connection attempts at start before giving up (at least 1).
    pub connect_attempts: u32,
    /// The wait after the first failed attempt, doubled after each, capped
    /// by `connect_backoff_max`.
    pub connect_backoff: Duration,
    pub connect_backoff_max: Duration,
    /// The connect timeout of one attempt (a server that does not answer).
    pub connect_timeout: Duration,
    /// How long an Abort waits for a row lock held by a Prepare of the same
    /// txid in another session before it looks again.
    pub lock_timeout: Duration,
}

/// [`PgOptions::decision_pool_size`] unless set.
pub const DEFAULT_DECISION_POOL_SIZE: usize = 4;
/// [`PgOptions::handler_lock_timeout_ms`] unless set.
pub const DEFAULT_HANDLER_LOCK_TIMEOUT_MS: u64 = 1_000;
/// [`PgOptions::handler_statement_timeout_ms`] unless set.
pub const DEFAULT_HANDLER_STATEMENT_TIMEOUT_MS: u64 = 30_000;

/// The participant's PostgreSQL settings as command-line flags (feature
/// `cli`), for a service's binary: `bank-serve --postgres` and
/// `shop-serve` take them. Each flag sets the [`PgOptions`] field of its
/// name; [`PgOptions::validate`] checks them at start.
#[cfg(feature = "cli")]
#[derive(clap::Args, Clone, Debug)]
pub struct PgTuningArgs {
    /// Connections for Commit, Abort and recovery, apart from the
    /// handlers' (PgOptions::decision_pool_size).
    #[arg(long, default_value_t = DEFAULT_DECISION_POOL_SIZE)]
    pub pg_decision_pool_size: usize,
    /// The longest a message waits for a pooled connection, then fails as
    /// unavailable (PgOptions::pool_wait_timeout_ms).
    #[arg(long, default_value_t = crate::pg_pool::DEFAULT_POOL_WAIT_TIMEOUT_MS)]
    pub pg_pool_wait_timeout_ms: u64,
    /// lock_timeout of a handler's transaction; past it the vote is NO; 0:
    /// no limit (PgOptions::handler_lock_timeout_ms).
    #[arg(long, default_value_t = DEFAULT_HANDLER_LOCK_TIMEOUT_MS)]
    pub pg_handler_lock_timeout_ms: u64,
    /// statement_timeout of a handler's transaction; 0: no limit
    /// (PgOptions::handler_statement_timeout_ms).
    #[arg(long, default_value_t = DEFAULT_HANDLER_STATEMENT_TIMEOUT_MS)]
    pub pg_handler_statement_timeout_ms: u64,
}

#[cfg(feature = "cli")]
impl PgTuningArgs {
    /// Sets these flags' fields of `o`.
    pub fn apply(&self, o: &mut PgOptions) {
        o.decision_pool_size = self.pg_decision_pool_size;
        o.pool_wait_timeout_ms = self.pg_pool_wait_timeout_ms;
        o.handler_lock_timeout_ms = self.pg_handler_lock_timeout_ms;
        o.handler_statement_timeout_ms = self.pg_handler_statement_timeout_ms;
    }
}

impl PgOptions {
    pub fn new(participant_id: impl Into<String>, conn_string: impl Into<String>) -> Self {
        PgOptions {
            participant_id: participant_id.into(),
            conn_string: conn_string.into(),
            concurrency: 16,
            decision_pool_size: DEFAULT_DECISION_POOL_SIZE,
            pool_wait_timeout_ms: crate::pg_pool::DEFAULT_POOL_WAIT_TIMEOUT_MS,
            handler_lock_timeout_ms: DEFAULT_HANDLER_LOCK_TIMEOUT_MS,
            handler_statement_timeout_ms: DEFAULT_HANDLER_STATEMENT_TIMEOUT_MS,
            connect_attempts: 8,
            connect_backoff: Duration::from_millis(200),
            connect_backoff_max: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            lock_timeout: Duration::from_millis(200),
        }
    }

    /// Checks the settings; an error names the setting, its value and what
    /// it may be.
    pub fn validate(&self) -> Result<(), String> {
        check_participant_id(&self.participant_id)?;
        // PostgreSQL's integer settings in ms stop at i32::MAX.
        const PG_MS_MAX: u64 = i32::MAX as u64;
        if self.concurrency == 0 {
            return Err("PgOptions: concurrency is 0; at least 1 (handlers run at once)".into());
        }
        if self.decision_pool_size == 0 {
            return Err("PgOptions: decision_pool_size is 0; at least 1 (phase two and recovery need one)".into());
        }
        if self.pool_wait_timeout_ms == 0 || self.pool_wait_timeout_ms > 3_600_000 {
            return Err(format!(
                "PgOptions: pool_wait_timeout_ms is {}; 1 to 3600000 (how long a message waits for a pooled \
                 connection)",
                self.pool_wait_timeout_ms
            ));
        }
        for (name, v) in [
            ("handler_lock_timeout_ms", self.handler_lock_timeout_ms),
            ("handler_statement_timeout_ms", self.handler_statement_timeout_ms),
        ] {
            if v > PG_MS_MAX {
                return Err(format!(
                    "PgOptions: {name} is {v}; at most {PG_MS_MAX} (PostgreSQL's limit), or 0 for no limit"
                ));
            }
        }
        if self.connect_attempts == 0 {
            return Err("PgOptions: connect_attempts is 0; at least 1".into());
        }
        if self.lock_timeout.is_zero() {
            return Err("PgOptions: lock_timeout is 0 (PostgreSQL's no limit); an Abort must look again".into());
        }
        Ok(())
    }
}

/// Checks a participant id for use in gids (see the module doc).
pub fn check_participant_id(id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err("participant id is empty".into());
    }
    if id.contains(':') {
        return Err(format!("participant id {id:?} contains ':' (the gid separator)"));
    }
    if id.chars().any(|c| c.is_control()) {
        return Err(format!("participant id {id:?} contains a control character"));
    }
    if id.len() > MAX_PARTICIPANT_ID_LEN {
        return Err(format!(
            "participant id is {} bytes; at most {MAX_PARTICIPANT_ID_LEN} keep the gid under PostgreSQL's 200 bytes",
            id.len()
        ));
    }
    Ok(())
}

/// The state column's values.
mod st {
    pub const COMMITTED: &str = "committed";
    pub const ABORTED: &str = "aborted";
    pub const TOMBSTONE: &str = "tombstone";
    pub const READ_ONLY: &str = "read_only";
}

/// A row of the log table.
#[derive(Clone, Debug)]
struct Row {
    state: String,
    term: u64,
}

impl Row {
    fn local_state(&self, txid: GlobalTxid) -> Result<LocalState, StoreError> {
        Ok(match self.state.as_str() {
            st::COMMITTED => LocalState::Committed,
            st::ABORTED => LocalState::Aborted { tombstone: false },
            st::TOMBSTONE => LocalState::Aborted { tombstone: true },
            st::READ_ONLY => LocalState::Prepared { vote: Vote::ReadOnly },
            other => {
                return Err(StoreError::Damaged {
                    txid,
                    message: format!("unknown state {other:?} in {LOG_TABLE}"),
                })
            }
        })
    }
}

/// A prepared transaction of this participant.
#[derive(Clone, Debug)]
struct Prepared {
    gid: String,
    /// The term fencing uses: the gid's, or a later one an accepted
    /// message raised it to ([`RAISED_TABLE`]).
    term: u64,
    /// The term in the gid (the Prepare's; the marker row's once committed).
    gid_term: u64,
}

/// How PostgreSQL gave up a wait of a handler: its lock timeout (or
/// NOWAIT), its statement timeout, or a deadlock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GaveUp {
    LockTimeout,
    StatementTimeout,
    Deadlock,
}

/// The first PostgreSQL error in `e`'s source chain, when it is PostgreSQL
/// giving up a wait (SQLSTATE 55P03, 57014, 40P01); `None` otherwise. The
/// participant turns it into a NO vote, the step store into an error that
/// names the setting.
pub(crate) fn wait_given_up<'e>(
    e: &'e (dyn std::error::Error + 'static),
) -> Option<(GaveUp, &'e tokio_postgres::error::DbError)> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(db) = err
            .downcast_ref::<tokio_postgres::Error>()
            .and_then(|p| p.as_db_error())
        {
            let wait = match db.code() {
                c if c == &SqlState::LOCK_NOT_AVAILABLE => GaveUp::LockTimeout,
                c if c == &SqlState::QUERY_CANCELED => GaveUp::StatementTimeout,
                c if c == &SqlState::T_R_DEADLOCK_DETECTED => GaveUp::Deadlock,
                _ => return None,
            };
            return Some((wait, db));
        }
        cur = err.source();
    }
    None
}

/// A PostgreSQL error as the SDK's: a lost or refused connection (no
/// server error, SQLSTATE class 08, or the server shutting down or starting)
/// is `Unavailable` (retried by the coordinator, nothing decided); any
/// other is `Io`.
pub(crate) fn pg_err(what: &str, e: &tokio_postgres::Error) -> StoreError {
    match e.as_db_error() {
        Some(db) => {
            let code = db.code().code();
            let text = format!("PostgreSQL, {what}: {} (SQLSTATE {code})", db.message());
            if code.starts_with("08") || matches!(code, "57P01" | "57P02" | "57P03") {
                StoreError::Unavailable(text)
            } else {
                StoreError::Io(text)
            }
        }
        // tokio-postgres's text leaves the cause out ("error connecting to
        // server").
        None => match std::error::Error::source(e) {
            Some(cause) => StoreError::Unavailable(format!("PostgreSQL, {what}: {e}: {cause}")),
            None => StoreError::Unavailable(format!("PostgreSQL, {what}: {e}")),
        },
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// `'text'` as an SQL string literal (gids cannot be bound parameters).
fn literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// `name` as an SQL identifier (a role name in `SET ROLE`).
fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// How `finish_prepared` failed.
enum Finish {
    /// PostgreSQL's error, for the caller to read or report.
    Pg(tokio_postgres::Error),
    /// Refused for lack of rights, with the message that says what to do.
    Refused(StoreError),
    /// Finished, and then the bookkeeping after it failed.
    Store(StoreError),
}

impl Finish {
    fn into_store(self, what: &str) -> StoreError {
        match self {
            Finish::Pg(e) => pg_err(what, &e),
            Finish::Refused(e) | Finish::Store(e) => e,
        }
    }
}

fn stale(got: u64, seen: u64) -> Result<(), StoreError> {
    if got < seen {
        Err(StoreError::Refused(Refusal::StaleTerm { got, seen }))
    } else {
        Ok(())
    }
}

/// One async lock per transaction with a message in flight.
#[derive(Default)]
struct TxLocks {
    map: Mutex<HashMap<GlobalTxid, Arc<tokio::sync::Mutex<()>>>>,
}

struct TxGuard<'a> {
    locks: &'a TxLocks,
    txid: GlobalTxid,
    lock: Arc<tokio::sync::Mutex<()>>,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl TxLocks {
    async fn lock(&self, txid: GlobalTxid) -> TxGuard<'_> {
        let lock = {
            let mut map = self.map.lock().expect("txid lock map");
            map.entry(txid).or_default().clone()
        };
        let guard = lock.clone().lock_owned().await;
        TxGuard {
            locks: self,
            txid,
            lock,
            guard: Some(guard),
        }
    }
}

impl Drop for TxGuard<'_> {
    fn drop(&mut self) {
        let mut map = self.locks.map.lock().expect("txid lock map");
        self.guard.take();
        // Clones are only made under the map's lock: two references (the
        // map's and ours) mean nobody else waits for this txid.
        if Arc::strong_count(&self.lock) == 2 {
            map.remove(&self.txid);
        }
    }
}

/// A [`Participant`] whose resource is a PostgreSQL database.
pub struct PgParticipant<H: PgHandler> {
    /// Prepares and one-phase commits (the handlers).
    pool: Pool,
    /// Commits, Aborts and recovery.
    decisions: Pool,
    /// For cancel requests.
    tls: PgTls,
    /// `SET LOCAL lock_timeout ..; SET LOCAL statement_timeout ..` of a
    /// handler's transaction.
    handler_limits: String,
    handler_lock_timeout_ms: u64,
    handler_statement_timeout_ms: u64,
    pool_wait_timeout_ms: u64,
    handler: H,
    id: String,
    /// `dtx:v1:<id>:` (incarnation 0)
    prefix: String,
    /// `dtx:v2:<id>:` (every other incarnation)
    prefix_v2: String,
    locks: TxLocks,
    /// The term floor of each incarnation as last read or written (one
    /// process serves a participant id).
    floors: Mutex<HashMap<u64, u64>>,
    /// Every row of [`RAISED_TABLE`] of this participant, read at start and
    /// kept with each write (one process serves a participant id), so the
    /// usual message reads nothing more.
    raised: Mutex<HashMap<GlobalTxid, u64>>,
    /// The server's clock at start, in ms: votes prepared before it count as
    /// old for recovery.
    started_ms: i64,
    lock_timeout: Duration,
    /// `host:port/dbname`, for messages.
    target: String,
    /// Branches whose flow runs in this process now ([`branch`]):
    /// recovery leaves their marks alone.
    branches_running: Mutex<std::collections::HashSet<GlobalTxid>>,
}

// The step store opens its pool through these.
pub(crate) use crate::pg_pool::open_pool;
pub(crate) use crate::pg_pool::ConnectRetry;

impl<H: PgHandler> PgParticipant<H> {
    /// Connects (retrying with backoff up to `opts.connect_attempts`),
    /// checks `max_prepared_transactions` and the log table's rights, and
    /// creates the table when missing.
    pub async fn connect(opts: PgOptions, handler: H) -> Result<Self, StoreError> {
        opts.validate().map_err(StoreError::Io)?;
        let concurrency = opts.concurrency;
        let retry = ConnectRetry {
            attempts: opts.connect_attempts,
            backoff: opts.connect_backoff,
            backoff_max: opts.connect_backoff_max,
            timeout: opts.connect_timeout,
        };
        let ep = Endpoint::parse(&opts.conn_string, &retry)?;
        let wait = Duration::from_millis(opts.pool_wait_timeout_ms);
        let pool = ep.pool(concurrency, wait)?;
        let decisions = ep.pool(opts.decision_pool_size, wait)?;
        let client = ep.first_connection(&decisions, &retry).await?;
        let tls = ep.settings.tls.clone();
        let at = ep.target;
        let crate::pg_pool::PgTarget {
            host,
            port,
            dbname,
            user,
        } = &at;
        let open_err = |message: String| at.open_err(message);
        let target = at.label();

        // PREPARE TRANSACTION needs max_prepared_transactions > 0, and at
        // least one slot per concurrent Prepare. That is a floor, not what
        // is needed: a prepared transaction holds its slot until its
        // decision, whichever connection made it, and every database of the
        // server shares the slots; what is free now is logged, and each
        // recovery pass reports it (dtx_participant_pg_prepared_slots_free).
        let row = client
            .query_one(
                "SELECT current_setting('max_prepared_transactions')::int,
                        (SELECT count(*) FROM pg_prepared_xacts),
                        (SELECT coalesce(string_agg(database || ': ' || n, ', ' ORDER BY n DESC), '')
                           FROM (SELECT database, count(*) AS n FROM pg_prepared_xacts GROUP BY database) AS d),
                        (SELECT reset_val FROM pg_settings WHERE name = 'synchronous_commit')",
                &[],
            )
            .await
            .map_err(|e| open_err(format!("reading max_prepared_transactions: {e}")))?;
        let max_prepared: i32 = row.get(0);
        let held: i64 = row.get(1);
        let by_database: String = row.get(2);
        let sync_default: String = row.get(3);
        if max_prepared <= 0 || (max_prepared as usize) < concurrency {
            return Err(open_err(format!(
                "max_prepared_transactions is {max_prepared} on {host}:{port}, below this participant's concurrency \
                 {concurrency} (0 disables PREPARE TRANSACTION): set `max_prepared_transactions = {}` (or more) in \
                 postgresql.conf and restart PostgreSQL; the slots are shared by every database of the server and \
                 each is held until its transaction's decision, so count every participant on it",
                concurrency.max(64)
            )));
        }
        let free = i64::from(max_prepared) - held;
        if free < concurrency as i64 {
            tracing::warn!(
                "PostgreSQL at {host}:{port}: {free} of max_prepared_transactions = {max_prepared} free ({held} held: \
                 {by_database}), fewer than this participant's concurrency {concurrency}; Prepares beyond the free \
                 slots vote NO until decisions free some: raise max_prepared_transactions (shared by every database \
                 of the server) or resolve the prepared transactions left behind"
            );
        }
        if sync_default == "off" {
            tracing::info!(
                "PostgreSQL at {host}:{port}: role {user} (or its database or server) has synchronous_commit = off; \
                 this participant sets it to on for its own sessions and transactions, so what it acknowledges \
                 survives a crash"
            );
        }

        // The tables: each created when missing, then the rights on them
        // checked.
        let ddl_log = format!(
            "CREATE TABLE IF NOT EXISTS {LOG_TABLE} (
                 participant text NOT NULL,
                 txid bigint NOT NULL,
                 state text NOT NULL,
                 term bigint NOT NULL,
                 decided_ms bigint NOT NULL,
                 PRIMARY KEY (participant, txid));
             CREATE INDEX IF NOT EXISTS {LOG_TABLE}_decided ON {LOG_TABLE} (participant, decided_ms, txid);"
        );
        let ddl_inc = format!(
            "CREATE TABLE IF NOT EXISTS {LOG_INC_TABLE} (
                 participant text NOT NULL,
                 incarnation bigint NOT NULL,
                 txid bigint NOT NULL,
                 state text NOT NULL,
                 term bigint NOT NULL,
                 decided_ms bigint NOT NULL,
                 PRIMARY KEY (participant, incarnation, txid));
             CREATE INDEX IF NOT EXISTS {LOG_INC_TABLE}_decided
                 ON {LOG_INC_TABLE} (participant, decided_ms, incarnation, txid);"
        );
        let ddl_floor = format!(
            "CREATE TABLE IF NOT EXISTS {FLOOR_TABLE} (
                 participant text NOT NULL,
                 incarnation bigint NOT NULL,
                 term bigint NOT NULL,
                 PRIMARY KEY (participant, incarnation));"
        );
        let ddl_raised = format!(
            "CREATE TABLE IF NOT EXISTS {RAISED_TABLE} (
                 participant text NOT NULL,
                 incarnation bigint NOT NULL,
                 txid bigint NOT NULL,
                 term bigint NOT NULL,
                 PRIMARY KEY (participant, incarnation, txid));"
        );
        let ddl_branch = format!(
            "CREATE TABLE IF NOT EXISTS {BRANCH_TABLE} (
                 participant text NOT NULL,
                 incarnation bigint NOT NULL,
                 txid bigint NOT NULL,
                 marked_ms bigint NOT NULL,
                 PRIMARY KEY (participant, incarnation, txid));"
        );
        let mut started_ms = 0;
        for (table, ddl) in [
            (LOG_TABLE, &ddl_log),
            (LOG_INC_TABLE, &ddl_inc),
            (FLOOR_TABLE, &ddl_floor),
            (BRANCH_TABLE, &ddl_branch),
            (RAISED_TABLE, &ddl_raised),
        ] {
            let rights_hint = format!(
                "the role {user} needs CREATE on the schema to create {table} (or an owner creates it and grants \
                 SELECT, INSERT, UPDATE, DELETE on it to {user})"
            );
            // Created only when missing: CREATE ... IF NOT EXISTS checks the
            // right to create in the schema even when the table exists, and a
            // role may have been granted just the rows of an existing table.
            let mut tries = 0;
            loop {
                let exists: bool = client
                    .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table])
                    .await
                    .map_err(|e| open_err(format!("looking for the log table {table}: {e}")))?
                    .get(0);
                if exists {
                    break;
                }
                match client.batch_execute(ddl).await {
                    Ok(()) => break,
                    Err(e) if e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) => {
                        return Err(open_err(format!(
                            "cannot create the log table {table} in {dbname}: {}; {rights_hint}",
                            e.as_db_error()
                                .map(|d| d.message().to_string())
                                .unwrap_or(e.to_string())
                        )));
                    }
                    // Two processes creating it at once: the loser sees a
                    // unique violation in the catalog; look again.
                    Err(e) if e.code() == Some(&SqlState::UNIQUE_VIOLATION) && tries < 3 => tries += 1,
                    Err(e) => return Err(open_err(format!("creating the log table {table}: {e}"))),
                }
            }
            let row = client
                .query_one(
                    "SELECT has_table_privilege($1, 'SELECT, INSERT, UPDATE, DELETE'),
                            (extract(epoch from now()) * 1000)::bigint",
                    &[&table],
                )
                .await
                .map_err(|e| open_err(format!("checking the rights on {table}: {e}")))?;
            let allowed: bool = row.get(0);
            if !allowed {
                return Err(open_err(format!(
                    "the role {user} lacks SELECT, INSERT, UPDATE or DELETE on {table}; {rights_hint}"
                )));
            }
            started_ms = row.get(1);
        }
        let raised: HashMap<GlobalTxid, u64> = client
            .query(
                &format!("SELECT incarnation, txid, term FROM {RAISED_TABLE} WHERE participant = $1"),
                &[&opts.participant_id],
            )
            .await
            .map_err(|e| open_err(format!("reading {RAISED_TABLE}: {e}")))?
            .iter()
            .map(|r| {
                let txid = GlobalTxid {
                    incarnation: r.get::<_, i64>(0) as u64,
                    txid: r.get::<_, i64>(1) as u64,
                };
                (txid, r.get::<_, i64>(2) as u64)
            })
            .collect();
        let participant = PgParticipant {
            pool,
            decisions,
            tls,
            handler_limits: format!(
                "SET LOCAL lock_timeout = '{}ms'; SET LOCAL statement_timeout = '{}ms'",
                opts.handler_lock_timeout_ms, opts.handler_statement_timeout_ms
            ),
            handler_lock_timeout_ms: opts.handler_lock_timeout_ms,
            handler_statement_timeout_ms: opts.handler_statement_timeout_ms,
            pool_wait_timeout_ms: opts.pool_wait_timeout_ms,
            handler,
            prefix: format!("dtx:v1:{}:", opts.participant_id),
            prefix_v2: format!("dtx:v2:{}:", opts.participant_id),
            id: opts.participant_id,
            locks: TxLocks::default(),
            floors: Mutex::new(HashMap::new()),
            raised: Mutex::new(raised),
            started_ms,
            lock_timeout: opts.lock_timeout,
            target,
            branches_running: Mutex::new(std::collections::HashSet::new()),
        };
        participant
            .init_legacy_floor(&client)
            .await
            .map_err(|e| open_err(format!("setting the term floor of incarnation 0: {e}")))?;
        drop(client);
        Ok(participant)
    }

    /// Incarnation 0's term floor of a database written before floors
    /// existed: the highest term of its rows and prepared gids, once (when
    /// it has no floor row yet).
    async fn init_legacy_floor(&self, c: &Client) -> Result<(), StoreError> {
        let exists = c
            .query_opt(
                &format!("SELECT term FROM {FLOOR_TABLE} WHERE participant = $1 AND incarnation = 0"),
                &[&self.id],
            )
            .await
            .map_err(|e| pg_err("reading the term floor", &e))?
            .is_some();
        if exists {
            return Ok(());
        }
        let from_rows: i64 = c
            .query_one(
                &format!("SELECT coalesce(max(term), 0) FROM {LOG_TABLE} WHERE participant = $1"),
                &[&self.id],
            )
            .await
            .map_err(|e| pg_err("reading the log", &e))?
            .get(0);
        let mut floor = from_rows.max(0) as u64;
        for (txid, term) in self.prepared_gids(c).await? {
            if txid.incarnation == 0 {
                floor = floor.max(term);
            }
        }
        self.raise_floor(c, 0, floor).await
    }

    pub fn participant_id(&self) -> &str {
        &self.id
    }

    /// The handler, e.g. for the service's own queries.
    pub fn handler(&self) -> &H {
        &self.handler
    }

    /// The handlers' connection pool (the service may use it for its own
    /// reads).
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The pool of phase two (Commit, Abort) and recovery.
    pub fn decision_pool(&self) -> &Pool {
        &self.decisions
    }

    /// The gid a Prepare of `txid` at `term` uses: `dtx:v1:<id>:<txid>:
    /// <term>` for incarnation 0 (as before incarnations), `dtx:v2:<id>:
    /// <incarnation, 16 hex digits>:<txid>:<term>` otherwise. A `u64` is
    /// a txid of incarnation 0.
    pub fn gid(&self, txid: impl Into<GlobalTxid>, term: u64) -> String {
        format!("{}{term}", self.gid_prefix(txid.into()))
    }

    /// The start of every gid of `txid` (any term).
    fn gid_prefix(&self, txid: GlobalTxid) -> String {
        if txid.incarnation == 0 {
            format!("{}{}:", self.prefix, txid.txid)
        } else {
            format!("{}{:016x}:{}:", self.prefix_v2, txid.incarnation, txid.txid)
        }
    }

    /// (transaction, term) of a gid with one of this participant's
    /// prefixes.
    fn parse_gid(&self, gid: &str) -> Option<(GlobalTxid, u64)> {
        if let Some(rest) = gid.strip_prefix(&self.prefix) {
            let (txid, term) = rest.split_once(':')?;
            return Some((GlobalTxid::new(0, txid.parse().ok()?), term.parse().ok()?));
        }
        let rest = gid.strip_prefix(&self.prefix_v2)?;
        let mut parts = rest.split(':');
        let (inc, txid, term) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || inc.len() != 16 {
            return None;
        }
        let incarnation = u64::from_str_radix(inc, 16).ok().filter(|&i| i != 0)?;
        Some((GlobalTxid::new(incarnation, txid.parse().ok()?), term.parse().ok()?))
    }

    /// Every prepared transaction of this participant in the current
    /// database, as (transaction, term).
    async fn prepared_gids(&self, c: &Client) -> Result<Vec<(GlobalTxid, u64)>, StoreError> {
        let rows = c
            .query(
                "SELECT gid FROM pg_prepared_xacts
                 WHERE database = current_database() AND (starts_with(gid, $1) OR starts_with(gid, $2))",
                &[&self.prefix, &self.prefix_v2],
            )
            .await
            .map_err(|e| pg_err("reading pg_prepared_xacts", &e))?;
        Ok(rows
            .into_iter()
            .filter_map(|r| self.parse_gid(&r.get::<_, String>(0)))
            .collect())
    }

    /// The term floor of `incarnation` (0: none yet), read once per
    /// incarnation and then kept in memory (raised with every write).
    async fn floor(&self, c: &Client, incarnation: u64) -> Result<u64, StoreError> {
        if let Some(&f) = self.floors.lock().expect("floors").get(&incarnation) {
            return Ok(f);
        }
        let st = c
            .prepare_cached(&format!(
                "SELECT term FROM {FLOOR_TABLE} WHERE participant = $1 AND incarnation = $2"
            ))
            .await
            .map_err(|e| pg_err("reading the term floor", &e))?;
        let term = c
            .query_opt(&st, &[&self.id, &(incarnation as i64)])
            .await
            .map_err(|e| pg_err("reading the term floor", &e))?
            .map(|r| r.get::<_, i64>(0) as u64)
            .unwrap_or(0);
        let mut floors = self.floors.lock().expect("floors");
        let f = floors.entry(incarnation).or_insert(term);
        *f = (*f).max(term);
        Ok(*f)
    }

    /// Raises the term floor of `incarnation` to `term` (durably, in its
    /// own transaction) unless it is there already.
    async fn raise_floor(&self, c: &Client, incarnation: u64, term: u64) -> Result<(), StoreError> {
        if self
            .floors
            .lock()
            .expect("floors")
            .get(&incarnation)
            .is_some_and(|&f| f >= term)
        {
            return Ok(());
        }
        let st = c
            .prepare_cached(&format!(
                "INSERT INTO {FLOOR_TABLE} AS f (participant, incarnation, term) VALUES ($1, $2, $3)
                 ON CONFLICT (participant, incarnation) DO UPDATE SET term = GREATEST(f.term, EXCLUDED.term)
                 RETURNING term"
            ))
            .await
            .map_err(|e| pg_err("raising the term floor", &e))?;
        let now: i64 = c
            .query_one(&st, &[&self.id, &(incarnation as i64), &(term as i64)])
            .await
            .map_err(|e| pg_err("raising the term floor", &e))?
            .get(0);
        let mut floors = self.floors.lock().expect("floors");
        let f = floors.entry(incarnation).or_insert(0);
        *f = (*f).max(now as u64);
        Ok(())
    }

    /// The current term floor of `incarnation`, as known in this process
    /// (for tests and tools).
    pub async fn term_floor(&self, incarnation: u64) -> Result<u64, StoreError> {
        let obj = self.conn().await?;
        self.floor(&obj, incarnation).await
    }

    /// A connection of the decisions' pool (phase two, recovery).
    async fn conn(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.get(&self.decisions, "decisions").await
    }

    async fn get(&self, pool: &Pool, name: &'static str) -> Result<deadpool_postgres::Object, StoreError> {
        pool.get().await.map_err(|e| match e {
            PoolError::Timeout(deadpool_postgres::TimeoutType::Wait) => {
                metrics::counter!(
                    "dtx_participant_pg_pool_wait_timeouts_total",
                    "participant" => self.id.clone(),
                    "pool" => name
                )
                .increment(1);
                StoreError::Unavailable(format!(
                    "PostgreSQL at {}: no free connection in the {name} pool ({} connections) within \
                     pool_wait_timeout_ms = {}; the message is retried",
                    self.target,
                    pool.status().max_size,
                    self.pool_wait_timeout_ms
                ))
            }
            other => StoreError::Unavailable(format!("PostgreSQL at {}: no connection: {other}", self.target)),
        })
    }

    async fn prepared(&self, c: &Client, txid: GlobalTxid) -> Result<Option<Prepared>, StoreError> {
        let prefix = self.gid_prefix(txid);
        let st = c
            .prepare_cached(
                "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() AND starts_with(gid, $1)",
            )
            .await
            .map_err(|e| pg_err("reading pg_prepared_xacts", &e))?;
        let rows = c
            .query(&st, &[&prefix])
            .await
            .map_err(|e| pg_err("reading pg_prepared_xacts", &e))?;
        let mut best: Option<Prepared> = None;
        for r in rows {
            let gid: String = r.get(0);
            match self.parse_gid(&gid) {
                Some((t, term)) if t == txid => {
                    if best.as_ref().is_none_or(|b| b.gid_term < term) {
                        best = Some(Prepared {
                            gid,
                            term,
                            gid_term: term,
                        });
                    }
                }
                _ => tracing::warn!("ignoring prepared transaction {gid:?}: not a gid of this participant"),
            }
        }
        if let (Some(p), Some(raised)) = (best.as_mut(), self.raised_term(txid)) {
            p.term = p.term.max(raised);
        }
        Ok(best)
    }

    /// The term `txid` was raised to while prepared, if any.
    fn raised_term(&self, txid: GlobalTxid) -> Option<u64> {
        self.raised.lock().expect("raised").get(&txid).copied()
    }

    /// Raises the term of prepared `txid` to `term` (an accepted message of
    /// a later term than its gid's), durably before the answer.
    async fn raise_prepared(&self, c: &Client, txid: GlobalTxid, term: u64) -> Result<(), StoreError> {
        let st = c
            .prepare_cached(&format!(
                "INSERT INTO {RAISED_TABLE} AS r (participant, incarnation, txid, term) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (participant, incarnation, txid) DO UPDATE SET term = GREATEST(r.term, EXCLUDED.term)"
            ))
            .await
            .map_err(|e| pg_err("raising a prepared transaction's term", &e))?;
        c.execute(
            &st,
            &[
                &self.id,
                &(txid.incarnation as i64),
                &(txid.txid as i64),
                &(term as i64),
            ],
        )
        .await
        .map_err(|e| pg_err("raising a prepared transaction's term", &e))?;
        let mut raised = self.raised.lock().expect("raised");
        let t = raised.entry(txid).or_insert(term);
        *t = (*t).max(term);
        Ok(())
    }

    /// Forgets the raised term of `txid` once its decision is applied (the
    /// decided row carries the term from then on). A crash before this
    /// leaves a row whose term no message below it may pass anyway.
    async fn forget_raised(&self, c: &Client, txid: GlobalTxid) -> Result<(), StoreError> {
        if self.raised_term(txid).is_none() {
            return Ok(());
        }
        c.execute(
            &format!("DELETE FROM {RAISED_TABLE} WHERE participant = $1 AND incarnation = $2 AND txid = $3"),
            &[&self.id, &(txid.incarnation as i64), &(txid.txid as i64)],
        )
        .await
        .map_err(|e| pg_err("forgetting a raised term", &e))?;
        self.raised.lock().expect("raised").remove(&txid);
        Ok(())
    }

    async fn row(&self, c: &Client, txid: GlobalTxid) -> Result<Option<Row>, StoreError> {
        let (table, key) = log_key(txid);
        let st = c
            .prepare_cached(&format!("SELECT state, term FROM {table} WHERE {key}"))
            .await
            .map_err(|e| pg_err("reading the log", &e))?;
        let r = c
            .query_opt(&st, &[&self.id, &(txid.txid as i64), &(txid.incarnation as i64)])
            .await
            .map_err(|e| pg_err("reading the log", &e))?;
        Ok(r.map(|r| Row {
            state: r.get(0),
            term: r.get::<_, i64>(1) as u64,
        }))
    }

    /// Inserts a decided row unless one exists; returns the row now there.
    async fn record(&self, c: &Client, txid: GlobalTxid, state: &str, term: u64) -> Result<Row, StoreError> {
        c.execute(
            &format!("{} ON CONFLICT DO NOTHING", log_insert(txid)),
            &[
                &self.id,
                &(txid.txid as i64),
                &(txid.incarnation as i64),
                &state,
                &(term as i64),
                &now_ms(),
            ],
        )
        .await
        .map_err(|e| pg_err("writing the log", &e))?;
        self.row(c, txid).await?.ok_or_else(|| StoreError::Damaged {
            txid,
            message: format!("the row just written to {LOG_TABLE} is missing"),
        })
    }

    /// Raises the row's term to `term` (after an accepted message).
    async fn raise_term(&self, c: &Client, txid: GlobalTxid, term: u64) -> Result<(), StoreError> {
        let (table, key) = log_key(txid);
        c.execute(
            &format!("UPDATE {table} SET term = $4 WHERE {key} AND term < $4"),
            &[
                &self.id,
                &(txid.txid as i64),
                &(txid.incarnation as i64),
                &(term as i64),
            ],
        )
        .await
        .map_err(|e| pg_err("writing the log", &e))?;
        Ok(())
    }

    /// Runs the handler in a fresh transaction; on YES (and READ_ONLY when
    /// `keep_read_only`) inserts the `committed` marker in it and returns
    /// the open transaction, else rolls back.
    async fn run_handler<'c>(
        &self,
        c: &'c mut Client,
        txid: GlobalTxid,
        term: u64,
        payload: &[u8],
        keep_read_only: bool,
    ) -> Result<(Verdict, Option<Transaction<'c>>), StoreError> {
        let tx = c.transaction().await.map_err(|e| pg_err("BEGIN", &e))?;
        // The handler's lock and statement timeouts, sent ahead of its
        // first statement in the same round trip (biased: polled first,
        // so sent first; PostgreSQL runs them in order). A handler may set
        // its own after.
        let (limits, verdict) = tokio::join!(
            biased;
            tx.batch_execute(&self.handler_limits),
            self.handler.prepare(&tx, txid, payload)
        );
        if let Err(e) = limits {
            let _ = tx.rollback().await;
            return Err(pg_err("SET LOCAL lock_timeout, statement_timeout", &e));
        }
        let verdict = match verdict {
            Ok(v) => v,
            Err(e) => {
                let _ = tx.rollback().await;
                if let Some(reason) = self.gave_up(txid, &*e) {
                    return Ok((Verdict::no(reason), None));
                }
                return Err(StoreError::Io(format!(
                    "the handler failed for transaction {txid}: {e}"
                )));
            }
        };
        let keep = verdict.vote == Vote::Yes || (keep_read_only && verdict.vote == Vote::ReadOnly);
        if !keep {
            tx.rollback().await.map_err(|e| pg_err("ROLLBACK", &e))?;
            return Ok((verdict, None));
        }
        match self.insert_marker(&tx, txid, term).await {
            Ok(true) => Ok((verdict, Some(tx))),
            Ok(false) => {
                let _ = tx.rollback().await;
                Ok((
                    Verdict::no(format!(
                        "transaction {txid} was aborted here concurrently (its Abort came first)"
                    )),
                    None,
                ))
            }
            Err(e) => {
                let _ = tx.rollback().await;
                Err(e)
            }
        }
    }

    /// Inserts the `committed` marker of `txid` in `tx`, the transaction
    /// that will be prepared: visible when (and only if) the work commits.
    /// False when a tombstone written concurrently is in the way (an
    /// Abort came first: the vote must be NO); the caller rolls `tx` back
    /// on anything but true.
    async fn insert_marker(&self, tx: &Transaction<'_>, txid: GlobalTxid, term: u64) -> Result<bool, StoreError> {
        // A tombstone written concurrently makes it a unique violation; a
        // wait on it is bounded.
        // With `synchronous_commit` back on if the handler turned it off:
        // the commit (one-phase) is acknowledged, so it must be flushed.
        let set = format!(
            "SET LOCAL lock_timeout = '{}ms'; {TRANSACTION_DURABLE}",
            self.lock_timeout.as_millis().max(1)
        );
        let insert = tx
            .prepare_cached(&log_insert(txid))
            .await
            .map_err(|e| pg_err("writing the commit marker", &e))?;
        // One round trip for both: tokio-postgres sends the two in the
        // order they are first polled (the SET first) and PostgreSQL runs
        // them in that order; the INSERT's result is read after the SET's.
        let (txid_i, inc_i, term_i, at_ms) = (txid.txid as i64, txid.incarnation as i64, term as i64, now_ms());
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 6] =
            [&self.id, &txid_i, &inc_i, &st::COMMITTED, &term_i, &at_ms];
        let (set_done, inserted) = tokio::join!(tx.batch_execute(&set), tx.execute(&insert, &params));
        set_done.map_err(|e| pg_err("SET LOCAL", &e))?;
        match inserted {
            Ok(_) => Ok(true),
            Err(e)
                if e.code() == Some(&SqlState::UNIQUE_VIOLATION) || e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) =>
            {
                Ok(false)
            }
            Err(e) => Err(pg_err("writing the commit marker", &e)),
        }
    }

    async fn on_prepare(
        &self,
        c: &mut Client,
        txid: GlobalTxid,
        term: u64,
        floor: u64,
        payload: &[u8],
    ) -> Result<Answer, StoreError> {
        // Both look-ups in one round trip (pipelined on the connection);
        // a prepared transaction wins over the row, as if read in turn.
        let (prepared, row) = tokio::try_join!(self.prepared(c, txid), self.row(c, txid))?;
        if let Some(p) = prepared {
            stale(term, p.term)?;
            if term > p.term {
                self.raise_prepared(c, txid, term).await?;
            }
            return Ok(Answer::new(Reply::Vote(Vote::Yes)));
        }
        if let Some(row) = row {
            return self.repeat_prepare(c, txid, term, row).await;
        }
        // Nothing here: below the term floor it is a deposed leader's.
        stale(term, floor)?;
        let (verdict, tx) = self.run_handler(c, txid, term, payload, false).await?;
        let mut refused = None;
        if let (Vote::Yes, Some(tx)) = (verdict.vote, tx) {
            let gid = self.gid(txid, term);
            dtx_failpoint::failpoint!("participant_before_durable_prepare");
            let prepared = tx
                .batch_execute(&format!("PREPARE TRANSACTION {}", literal(&gid)))
                .await;
            // PREPARE ended the session's transaction (a failed one is a
            // ROLLBACK); the handle must not send the ROLLBACK it sends
            // when dropped unfinished (a round trip, and a "no transaction
            // in progress" warning in every service's log). It owns nothing
            // else to release.
            std::mem::forget(tx);
            match prepared {
                Ok(()) => {
                    dtx_failpoint::failpoint!("participant_after_prepare_before_reply");
                    return Ok(Answer::new(Reply::Vote(Vote::Yes)));
                }
                Err(e) => refused = Some(e),
            }
        }
        if let Some(e) = refused {
            let Some(reason) = self.no_slot(txid, &e).or_else(|| self.not_preparable(txid, &e)) else {
                return Err(pg_err("PREPARE TRANSACTION", &e));
            };
            // A firm NO, recorded so that a repeat answers the same.
            let row = self.record(c, txid, st::ABORTED, term).await?;
            return match row.state.as_str() {
                st::ABORTED | st::TOMBSTONE => Ok(Answer::no(reason)),
                _ => self.repeat_prepare(c, txid, term, row).await,
            };
        }
        let vote = verdict.vote;
        let state = if vote == Vote::ReadOnly {
            st::READ_ONLY
        } else {
            st::ABORTED
        };
        let row = self.record(c, txid, state, term).await?;
        match row.state.as_str() {
            st::READ_ONLY => Ok(Answer::new(Reply::Vote(Vote::ReadOnly))),
            _ if vote == Vote::No => Ok(Answer::no(verdict.reason)),
            _ => Ok(Answer::no(format!("transaction {txid} was aborted here"))),
        }
    }

    /// A Prepare that finds a decided row.
    async fn repeat_prepare(&self, c: &Client, txid: GlobalTxid, term: u64, row: Row) -> Result<Answer, StoreError> {
        stale(term, row.term)?;
        self.raise_term(c, txid, term).await?;
        Ok(match row.local_state(txid)? {
            LocalState::Committed => Answer::new(Reply::Vote(Vote::Yes)),
            LocalState::Prepared { vote } => Answer::new(Reply::Vote(vote)),
            LocalState::Aborted { tombstone: true } => Answer::no(format!(
                "transaction {txid} was aborted here before its Prepare arrived"
            )),
            LocalState::Aborted { .. } => Answer::no(format!("transaction {txid} was already aborted here")),
        })
    }

    async fn on_commit(&self, c: &Client, txid: GlobalTxid, term: u64) -> Result<Answer, StoreError> {
        // The usual Commit comes in the term of its Prepare: its gid is
        // known without reading pg_prepared_xacts (one round trip, and no
        // scan of every prepared transaction). A txid is prepared under one
        // gid only, so this commits what the look-up below would find. If
        // there is no such gid (another term, already committed, never
        // prepared), PostgreSQL says so and nothing changed: the look-up
        // decides, as before. A term raised while prepared fences first
        // (the gid still carries the older term).
        if let Some(raised) = self.raised_term(txid) {
            stale(term, raised)?;
        }
        match self.finish_prepared(c, txid, &self.gid(txid, term), true).await {
            Ok(()) => {
                dtx_failpoint::failpoint!("participant_after_decision_before_ack");
                return Ok(Answer::new(Reply::Ack));
            }
            // No such gid; or one of another database (a prefix used in
            // two databases, which the look-up below does not see either).
            Err(Finish::Pg(e))
                if e.code() == Some(&SqlState::UNDEFINED_OBJECT)
                    || e.code() == Some(&SqlState::FEATURE_NOT_SUPPORTED) => {}
            Err(e) => return Err(e.into_store("COMMIT PREPARED")),
        }
        if let Some(p) = self.prepared(c, txid).await? {
            stale(term, p.term)?;
            self.finish_prepared(c, txid, &p.gid, true)
                .await
                .map_err(|e| e.into_store("COMMIT PREPARED"))?;
            dtx_failpoint::failpoint!("participant_after_decision_before_ack");
            // The marker committed with the prepare's term; a Commit of a
            // later term raises it (the usual Commit has the same term: no
            // round trip).
            if term > p.gid_term {
                self.raise_term(c, txid, term).await?;
            }
            return Ok(Answer::new(Reply::Ack));
        }
        let Some(row) = self.row(c, txid).await? else {
            return Err(StoreError::Refused(Refusal::CommitWithoutPrepare));
        };
        stale(term, row.term)?;
        match row.local_state(txid)? {
            LocalState::Aborted { .. } => Err(StoreError::Refused(Refusal::CommitAfterAbort)),
            LocalState::Committed | LocalState::Prepared { .. } => {
                self.raise_term(c, txid, term).await?;
                Ok(Answer::new(Reply::Ack))
            }
        }
    }

    async fn on_abort(&self, c: &mut Client, txid: GlobalTxid, term: u64) -> Result<Answer, StoreError> {
        // A Prepare of this txid in another session may hold the row's
        // lock (its marker) until it prepares; then the wait would last
        // until the decision. Wait briefly, then look for its gid again.
        for _ in 0..100 {
            if let Some(p) = self.prepared(c, txid).await? {
                stale(term, p.term)?;
                self.finish_prepared(c, txid, &p.gid, false)
                    .await
                    .map_err(|e| e.into_store("ROLLBACK PREPARED"))?;
                self.record(c, txid, st::ABORTED, term).await?;
                dtx_failpoint::failpoint!("participant_after_decision_before_ack");
                self.raise_term(c, txid, term).await?;
                return Ok(Answer::new(Reply::Ack));
            }
            if let Some(row) = self.row(c, txid).await? {
                stale(term, row.term)?;
                return match row.local_state(txid)? {
                    LocalState::Committed => Err(StoreError::Refused(Refusal::AbortAfterCommit)),
                    LocalState::Aborted { .. } | LocalState::Prepared { .. } => {
                        self.raise_term(c, txid, term).await?;
                        Ok(Answer::new(Reply::Ack))
                    }
                };
            }
            // Nothing here: the tombstone, so a late Prepare votes NO.
            let tx = c.transaction().await.map_err(|e| pg_err("BEGIN", &e))?;
            let set = format!(
                "SET LOCAL lock_timeout = '{}ms'; {TRANSACTION_DURABLE}",
                self.lock_timeout.as_millis().max(1)
            );
            tx.batch_execute(&set).await.map_err(|e| pg_err("SET LOCAL", &e))?;
            let res = tx
                .execute(
                    &format!("{} ON CONFLICT DO NOTHING", log_insert(txid)),
                    &[
                        &self.id,
                        &(txid.txid as i64),
                        &(txid.incarnation as i64),
                        &st::TOMBSTONE,
                        &(term as i64),
                        &now_ms(),
                    ],
                )
                .await;
            match res {
                Ok(_) => {
                    tx.commit().await.map_err(|e| pg_err("COMMIT", &e))?;
                    // Re-read: a marker committed meanwhile wins.
                    continue;
                }
                Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                    let _ = tx.rollback().await;
                    tracing::debug!("abort of {txid}: the log row is locked (a Prepare in flight); looking again");
                    continue;
                }
                Err(e) => {
                    let _ = tx.rollback().await;
                    return Err(pg_err("writing the tombstone", &e));
                }
            }
        }
        Err(StoreError::Io(format!(
            "abort of transaction {txid}: its log row stayed locked by another session; try again"
        )))
    }

    /// A handler error that is PostgreSQL giving up on a wait (the
    /// handler's lock or statement timeout, its own NOWAIT, a deadlock): a
    /// NO vote with the reason, counted. `None` for any other error.
    fn gave_up(&self, txid: GlobalTxid, e: &(dyn std::error::Error + 'static)) -> Option<String> {
        let (wait, db) = wait_given_up(e)?;
        let (kind, why) = match wait {
            GaveUp::LockTimeout => (
                "lock_timeout",
                format!(
                    "a row its work needs is held by another transaction (a prepared one holds its rows until its \
                     decision); the handler waited at most handler_lock_timeout_ms = {} ms (or its own lock_timeout \
                     / NOWAIT)",
                    self.handler_lock_timeout_ms
                ),
            ),
            GaveUp::StatementTimeout => (
                "statement_timeout",
                format!(
                    "a statement of its work ran past handler_statement_timeout_ms = {} ms",
                    self.handler_statement_timeout_ms
                ),
            ),
            GaveUp::Deadlock => ("deadlock", "PostgreSQL found it in a deadlock".to_string()),
        };
        metrics::counter!(
            "dtx_participant_pg_handler_timeouts_total",
            "participant" => self.id.clone(),
            "kind" => kind
        )
        .increment(1);
        Some(format!(
            "transaction {txid} not prepared here: {why} ({}, SQLSTATE {})",
            db.message(),
            db.code().code()
        ))
    }

    /// A failed PREPARE TRANSACTION because the handler's transaction did
    /// something PostgreSQL cannot prepare (SQLSTATE 0A000: a temporary
    /// table, LISTEN/UNLISTEN/NOTIFY, a cursor WITH HOLD, an exported
    /// snapshot): the NO vote's reason, naming what to change in the
    /// handler, logged and counted. The same handler would fail the same
    /// way on every attempt, so it is a firm NO, not a failure to retry.
    /// `None` for other errors.
    fn not_preparable(&self, txid: GlobalTxid, e: &tokio_postgres::Error) -> Option<String> {
        let db = e
            .as_db_error()
            .filter(|d| d.code() == &SqlState::FEATURE_NOT_SUPPORTED)?;
        metrics::counter!("dtx_participant_pg_not_preparable_total", "participant" => self.id.clone()).increment(1);
        let reason = format!(
            "transaction {txid} not prepared here: PostgreSQL at {} cannot prepare what the handler did: {} (SQLSTATE \
             0A000). A handler's transaction must not use temporary tables, LISTEN, UNLISTEN or NOTIFY, cursors WITH \
             HOLD or exported snapshots: PREPARE TRANSACTION refuses them. Do that work outside the handler's \
             transaction (a NOTIFY after the decision, for example)",
            self.target,
            db.message()
        );
        tracing::warn!("{reason}");
        Some(reason)
    }

    /// A failed PREPARE TRANSACTION for want of a slot (SQLSTATE 53200):
    /// the NO vote's reason, logged and counted. `None` for other errors.
    fn no_slot(&self, txid: GlobalTxid, e: &tokio_postgres::Error) -> Option<String> {
        let db = e.as_db_error().filter(|d| d.code() == &SqlState::OUT_OF_MEMORY)?;
        let hint = db.hint().map(|h| format!(" ({h})")).unwrap_or_default();
        let reason = if db.message().contains("prepared transactions") {
            metrics::counter!("dtx_participant_pg_prepared_slots_exhausted_total", "participant" => self.id.clone())
                .increment(1);
            format!(
                "transaction {txid} not prepared here: PostgreSQL at {} has no free prepared-transaction slot: {}{hint} \
                 (SQLSTATE 53200). A prepared transaction holds a slot of max_prepared_transactions until its \
                 decision is applied, whichever connection prepared it, and every database of the server shares the \
                 slots: raise max_prepared_transactions in postgresql.conf (PostgreSQL must restart) to cover every \
                 participant on the server, or resolve prepared transactions left behind (pg_prepared_xacts)",
                self.target,
                db.message()
            )
        } else {
            format!(
                "transaction {txid} not prepared here: PostgreSQL at {} is out of shared memory: {}{hint} (SQLSTATE \
                 53200)",
                self.target,
                db.message()
            )
        };
        tracing::warn!("{reason}");
        Some(reason)
    }

    /// `COMMIT PREPARED` (`commit`) or `ROLLBACK PREPARED` of `gid`. A
    /// transaction another role prepared (the service's database role was
    /// rotated while it was in doubt) is finished as that role when this
    /// one may act as it (`SET ROLE`: a member of it); otherwise the
    /// refusal (SQLSTATE 42501) says whose it is and how to fix it, is
    /// logged and counted, and the message fails so that the decision is
    /// delivered again (it is never dropped).
    async fn finish_prepared(&self, c: &Client, txid: GlobalTxid, gid: &str, commit: bool) -> Result<(), Finish> {
        self.finish_prepared_as_owner(c, txid, gid, commit).await?;
        self.forget_raised(c, txid).await.map_err(Finish::Store)
    }

    /// COMMIT or ROLLBACK PREPARED `gid`, as the role that prepared it when
    /// this one may not.
    async fn finish_prepared_as_owner(
        &self,
        c: &Client,
        txid: GlobalTxid,
        gid: &str,
        commit: bool,
    ) -> Result<(), Finish> {
        let verb = if commit { "COMMIT PREPARED" } else { "ROLLBACK PREPARED" };
        let sql = format!("{verb} {}", literal(gid));
        let e = match c.batch_execute(&sql).await {
            Ok(()) => return Ok(()),
            Err(e) if e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) => e,
            Err(e) => return Err(Finish::Pg(e)),
        };
        let who = c
            .query_opt(
                "SELECT owner::text, current_user::text FROM pg_prepared_xacts
                 WHERE gid = $1 AND database = current_database()",
                &[&gid],
            )
            .await
            .map_err(Finish::Pg)?;
        let Some(who) = who else {
            // Finished by someone else meanwhile: as if it never was.
            return Err(Finish::Pg(e));
        };
        let (owner, me): (String, String) = (who.get(0), who.get(1));
        match c.batch_execute(&format!("SET ROLE {}", ident(&owner))).await {
            Ok(()) => {
                let done = c.batch_execute(&sql).await;
                let reset = c.batch_execute("RESET ROLE").await;
                done.map_err(Finish::Pg)?;
                reset.map_err(Finish::Pg)?;
                tracing::info!(
                    %txid,
                    "{verb} {gid:?} as role {owner}, which prepared it (this participant connects as {me}, a member of {owner})"
                );
                return Ok(());
            }
            Err(e) if e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) => {}
            Err(e) => return Err(Finish::Pg(e)),
        }
        let statement = if commit { "commit_prepared" } else { "rollback_prepared" };
        metrics::counter!(
            "dtx_participant_pg_permission_denied_total",
            "participant" => self.id.clone(),
            "statement" => statement
        )
        .increment(1);
        let message = format!(
            "{verb} of transaction {txid} (gid {gid:?}) refused by PostgreSQL at {}: {} (SQLSTATE 42501). The \
             transaction was prepared by role {owner}; this participant connects as role {me}, and PostgreSQL lets \
             only the role that prepared a transaction, a member of it or a superuser finish it (was the service's \
             role rotated while transactions were in doubt?). The decision is kept and delivered again. Fix: GRANT \
             {owner} TO {me} (the participant then finishes them as {owner}), or run the service as {owner} until \
             no prepared transaction of {owner} remains (SELECT gid FROM pg_prepared_xacts WHERE owner = \
             '{owner}'); do not drop {owner} before",
            self.target,
            e.as_db_error()
                .map(|d| d.message().to_string())
                .unwrap_or_else(|| e.to_string())
        );
        tracing::error!("{message}");
        Err(Finish::Refused(StoreError::Io(message)))
    }

    /// One message on connection `c`.
    async fn handle_on(
        &self,
        c: &mut Client,
        txid: GlobalTxid,
        msg: Message,
        payload: &[u8],
    ) -> Result<Answer, StoreError> {
        // The floor is raised before anything this message records is
        // written (never below a recorded term), and only by a term above
        // it (which no floor check refuses).
        let floor = self.floor(c, txid.incarnation).await?;
        if msg.term() > floor {
            self.raise_floor(c, txid.incarnation, msg.term()).await?;
        }
        match msg {
            Message::Prepare { term } => self.on_prepare(c, txid, term, floor, payload).await,
            Message::Commit { term } => self.on_commit(c, txid, term).await,
            Message::Abort { term } => self.on_abort(c, txid, term).await,
            Message::CommitOnePhase { term } => self.on_one_phase(c, txid, term, floor, payload).await,
        }
    }

    async fn on_one_phase(
        &self,
        c: &mut Client,
        txid: GlobalTxid,
        term: u64,
        floor: u64,
        payload: &[u8],
    ) -> Result<Answer, StoreError> {
        if let Some(p) = self.prepared(c, txid).await? {
            // Prepared YES, no decision known here: the one-phase commit is
            // the decision.
            stale(term, p.term)?;
            self.finish_prepared(c, txid, &p.gid, true)
                .await
                .map_err(|e| e.into_store("COMMIT PREPARED"))?;
            self.raise_term(c, txid, term).await?;
            return Ok(Answer::new(Reply::Ack));
        }
        if let Some(row) = self.row(c, txid).await? {
            stale(term, row.term)?;
            self.raise_term(c, txid, term).await?;
            return Ok(match row.local_state(txid)? {
                LocalState::Committed | LocalState::Prepared { .. } => Answer::new(Reply::Ack),
                LocalState::Aborted { .. } => Answer::no(format!("transaction {txid} was already aborted here")),
            });
        }
        // Nothing here: below the term floor it is a deposed leader's
        // (whose one-phase commit may have been applied and its row
        // collected since).
        stale(term, floor)?;
        let (verdict, tx) = self.run_handler(c, txid, term, payload, true).await?;
        if let Some(tx) = tx {
            tx.commit().await.map_err(|e| pg_err("COMMIT", &e))?;
            return Ok(Answer::new(Reply::Ack));
        }
        drop(tx);
        let row = self.record(c, txid, st::ABORTED, term).await?;
        if row.state == st::COMMITTED {
            return Ok(Answer::new(Reply::Ack));
        }
        Ok(Answer::no(verdict.reason))
    }
}

/// The table of `txid`'s log row and the condition that selects it, on
/// the parameters $1 participant, $2 txid, $3 incarnation (always bound;
/// incarnation 0's table has no such column, and its condition checks
/// the parameter is 0).
fn log_key(txid: GlobalTxid) -> (&'static str, &'static str) {
    if txid.incarnation == 0 {
        (LOG_TABLE, "participant = $1 AND txid = $2 AND $3::bigint = 0")
    } else {
        (LOG_INC_TABLE, "participant = $1 AND txid = $2 AND incarnation = $3")
    }
}

/// An INSERT of `txid`'s log row on $1 participant, $2 txid, $3
/// incarnation, $4 state, $5 term, $6 decided_ms (in its incarnation's
/// table); `ON CONFLICT ...` may follow.
fn log_insert(txid: GlobalTxid) -> String {
    if txid.incarnation == 0 {
        format!(
            "INSERT INTO {LOG_TABLE} (participant, txid, state, term, decided_ms)
             SELECT $1::text, $2::bigint, $4::text, $5::bigint, $6::bigint WHERE $3::bigint = 0"
        )
    } else {
        format!(
            "INSERT INTO {LOG_INC_TABLE} (participant, txid, incarnation, state, term, decided_ms)
             VALUES ($1, $2, $3, $4, $5, $6)"
        )
    }
}

impl<H: PgHandler> Participant for PgParticipant<H> {
    /// Prepare and CommitOnePhase run on the handlers' pool, Commit and
    /// Abort on the decisions' pool; a call dropped midway cancels its
    /// statement (`pg_pool::Lease`).
    async fn handle(&self, txid: GlobalTxid, msg: Message, payload: &[u8]) -> Result<Answer, StoreError> {
        let _serial = self.locks.lock(txid).await;
        let obj = match msg {
            Message::Prepare { .. } | Message::CommitOnePhase { .. } => self.get(&self.pool, "handlers").await?,
            Message::Commit { .. } | Message::Abort { .. } => self.get(&self.decisions, "decisions").await?,
        };
        let mut lease = Lease::new(obj, self.tls.clone(), &self.id, txid);
        let answer = self.handle_on(&mut lease, txid, msg, payload).await;
        lease.finish();
        answer
    }

    async fn prepare_many(
        &self,
        items: &[(GlobalTxid, u64, &[u8])],
    ) -> Result<Vec<Result<Verdict, StoreError>>, StoreError> {
        let results = futures::future::join_all(items.iter().map(|&(txid, term, payload)| async move {
            let a = self.handle(txid, Message::Prepare { term }, payload).await?;
            match a.reply {
                Reply::Vote(vote) => Ok(Verdict { vote, reason: a.reason }),
                Reply::Ack => Err(StoreError::Io(format!("Prepare of {txid} answered an ack"))),
            }
        }))
        .await;
        // Every item failed on PostgreSQL itself: the call fails as a whole
        // (as the sled store's does when it cannot write).
        let all_failed = !results.is_empty()
            && results
                .iter()
                .all(|r| matches!(r, Err(StoreError::Io(_) | StoreError::Unavailable(_))));
        if all_failed {
            return Err(results.into_iter().find_map(Result::err).expect("every item failed"));
        }
        Ok(results)
    }

    async fn apply_decisions(
        &self,
        items: &[(GlobalTxid, PhaseTwo)],
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let results = futures::future::join_all(
            items
                .iter()
                .map(|&(txid, d)| async move { self.handle(txid, d.into(), &[]).await.map(|_| ()) }),
        )
        .await;
        Ok(results)
    }

    async fn unregistered_branches(&self) -> Result<Vec<(GlobalTxid, String)>, StoreError> {
        self.branch_marks().await
    }

    async fn unmark_branch(&self, txid: GlobalTxid) -> Result<(), StoreError> {
        self.drop_mark(txid).await
    }

    fn branches_in_flight(&self) -> Vec<GlobalTxid> {
        self.branches_running
            .lock()
            .expect("branches lock")
            .iter()
            .copied()
            .collect()
    }

    async fn durable_entry(&self, txid: GlobalTxid) -> Result<Option<LogEntry>, StoreError> {
        let obj = self.conn().await?;
        if let Some(p) = self.prepared(&obj, txid).await? {
            return Ok(Some(LogEntry {
                state: LocalState::Prepared { vote: Vote::Yes },
                term: p.term,
            }));
        }
        match self.row(&obj, txid).await? {
            Some(row) => Ok(Some(LogEntry {
                state: row.local_state(txid)?,
                term: row.term,
            })),
            None => Ok(None),
        }
    }

    /// This participant's prepared transactions in `pg_prepared_xacts`
    /// (the same ones `in_doubt_older_than` lists) and the oldest's age,
    /// by PostgreSQL's clock.
    async fn in_doubt_summary(&self) -> Result<InDoubtSummary, StoreError> {
        let obj = self.conn().await?;
        let row = obj
            .query_one(
                "SELECT count(*), coalesce(max((extract(epoch from now() - prepared) * 1000)::bigint), -1)
                 FROM pg_prepared_xacts
                 WHERE database = current_database() AND (starts_with(gid, $1) OR starts_with(gid, $2))",
                &[&self.prefix, &self.prefix_v2],
            )
            .await
            .map_err(|e| pg_err("counting pg_prepared_xacts", &e))?;
        let count: i64 = row.get(0);
        let oldest_ms: i64 = row.get(1);
        Ok(InDoubtSummary {
            count: count.max(0) as usize,
            oldest_age: (oldest_ms >= 0).then(|| Duration::from_millis(oldest_ms as u64)),
        })
    }

    async fn in_doubt_older_than(&self, age_min: Duration) -> Result<Vec<(GlobalTxid, LogEntry)>, StoreError> {
        let obj = self.conn().await?;
        // With the slots left on the whole server (one round trip: the two
        // are pipelined).
        let prefixes: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&self.prefix, &self.prefix_v2];
        let (rows, free) = tokio::try_join!(
            obj.query(
                "SELECT gid, (extract(epoch from prepared) * 1000)::bigint,
                        (extract(epoch from now() - prepared) * 1000)::bigint
                 FROM pg_prepared_xacts
                 WHERE database = current_database() AND (starts_with(gid, $1) OR starts_with(gid, $2))
                 ORDER BY prepared",
                &prefixes,
            ),
            obj.query_one(
                "SELECT current_setting('max_prepared_transactions')::bigint - (SELECT count(*) FROM pg_prepared_xacts)",
                &[],
            )
        )
        .map_err(|e| pg_err("reading pg_prepared_xacts", &e))?;
        let free: i64 = free.get(0);
        metrics::gauge!("dtx_participant_pg_prepared_slots_free", "participant" => self.id.clone()).set(free as f64);
        let age_min_ms = age_min.as_millis().min(i64::MAX as u128) as i64;
        // Every recovery pass lists them: what is open now, and how old the
        // oldest is (ordered by `prepared`), for the operator.
        let oldest_ms = rows.first().map(|r| r.get::<_, i64>(2)).unwrap_or(0);
        metrics::gauge!("dtx_participant_pg_prepared_open", "participant" => self.id.clone()).set(rows.len() as f64);
        metrics::gauge!("dtx_participant_pg_prepared_oldest_age_seconds", "participant" => self.id.clone())
            .set(oldest_ms.max(0) as f64 / 1000.0);
        let mut out = Vec::new();
        for r in rows {
            let gid: String = r.get(0);
            let at_ms: i64 = r.get(1);
            let age_ms: i64 = r.get(2);
            let Some((txid, term)) = self.parse_gid(&gid) else {
                tracing::warn!("ignoring prepared transaction {gid:?}: its gid does not parse");
                continue;
            };
            if age_ms >= age_min_ms || at_ms < self.started_ms {
                out.push((
                    txid,
                    LogEntry {
                        state: LocalState::Prepared { vote: Vote::Yes },
                        term,
                    },
                ));
            }
        }
        Ok(out)
    }

    async fn gc_candidates_after(
        &self,
        after: Option<(u64, GlobalTxid)>,
        decided_before_ms: u64,
        max: usize,
    ) -> Result<Vec<(u64, GlobalTxid)>, StoreError> {
        let obj = self.conn().await?;
        let (a_ms, a_inc, a_txid, has_after) = match after {
            Some((ms, t)) => (ms as i64, t.incarnation as i64, t.txid as i64, true),
            None => (0, 0, 0, false),
        };
        // Both tables, in one order: (decided_ms, incarnation, txid), the
        // cursor compared in the same order.
        let rows = obj
            .query(
                &format!(
                    "SELECT decided_ms, incarnation, txid FROM (
                         SELECT decided_ms, 0::bigint AS incarnation, txid FROM {LOG_TABLE}
                          WHERE participant = $1 AND decided_ms <= $2
                         UNION ALL
                         SELECT decided_ms, incarnation, txid FROM {LOG_INC_TABLE}
                          WHERE participant = $1 AND decided_ms <= $2) AS l
                     WHERE NOT $3 OR (decided_ms, incarnation, txid) > ($4, $5, $6)
                     ORDER BY decided_ms, incarnation, txid LIMIT $7"
                ),
                &[
                    &self.id,
                    &(decided_before_ms.min(i64::MAX as u64) as i64),
                    &has_after,
                    &a_ms,
                    &a_inc,
                    &a_txid,
                    &(max.min(i64::MAX as usize) as i64),
                ],
            )
            .await
            .map_err(|e| pg_err("reading the log", &e))?;
        Ok(rows
            .into_iter()
            .map(|r| {
                (
                    r.get::<_, i64>(0) as u64,
                    GlobalTxid::new(r.get::<_, i64>(1) as u64, r.get::<_, i64>(2) as u64),
                )
            })
            .collect())
    }

    /// Reads `pg_prepared_xacts` (this participant's prepared
    /// transactions: in doubt, with PostgreSQL's time of each) and the log
    /// table; writes nothing. A prepared transaction wins over a row of the
    /// same txid, as in `durable_entry`.
    async fn inspect(&self, q: &InspectQuery) -> Result<Inspection, StoreError> {
        let obj = self.conn().await?;
        // Prepared first, then the rows (a COMMIT PREPARED in between shows
        // the row; the other order could miss both).
        let prepared_rows = obj
            .query(
                "SELECT gid, (extract(epoch from prepared) * 1000)::bigint,
                        (extract(epoch from now() - prepared) * 1000)::bigint
                 FROM pg_prepared_xacts
                 WHERE database = current_database() AND (starts_with(gid, $1) OR starts_with(gid, $2))",
                &[&self.prefix, &self.prefix_v2],
            )
            .await
            .map_err(|e| pg_err("reading pg_prepared_xacts", &e))?;
        // txid -> (term, prepared ms, age ms): the highest term's gid.
        let mut prepared: HashMap<GlobalTxid, (u64, i64, i64)> = HashMap::new();
        for r in prepared_rows {
            let gid: String = r.get(0);
            let Some((txid, term)) = self.parse_gid(&gid) else {
                continue;
            };
            let (at, age): (i64, i64) = (r.get(1), r.get(2));
            if prepared.get(&txid).is_none_or(|p| p.0 < term) {
                prepared.insert(txid, (term, at, age));
            }
        }
        let as_prepared = |txid: GlobalTxid, (gid_term, at, _): (u64, i64, i64)| InspectedRecord {
            txid,
            entry: Some(LogEntry {
                state: LocalState::Prepared { vote: Vote::Yes },
                term: gid_term.max(self.raised_term(txid).unwrap_or(0)),
            }),
            recorded_unix_ms: u64::try_from(at).ok(),
        };
        let as_row =
            |txid: GlobalTxid, state: String, term: i64, decided_ms: i64| -> Result<InspectedRecord, StoreError> {
                let row = Row {
                    state,
                    term: term as u64,
                };
                Ok(InspectedRecord {
                    txid,
                    entry: Some(LogEntry {
                        state: row.local_state(txid)?,
                        term: row.term,
                    }),
                    recorded_unix_ms: u64::try_from(decided_ms).ok(),
                })
            };
        // Both tables as one: (incarnation, txid, state, term, decided_ms).
        let select = format!(
            "SELECT incarnation, txid, state, term, decided_ms FROM (
                 SELECT 0::bigint AS incarnation, txid, state, term, decided_ms FROM {LOG_TABLE}
                  WHERE participant = $1
                 UNION ALL
                 SELECT incarnation, txid, state, term, decided_ms FROM {LOG_INC_TABLE}
                  WHERE participant = $1) AS l"
        );
        let txid_of = |r: &tokio_postgres::Row| GlobalTxid::new(r.get::<_, i64>(0) as u64, r.get::<_, i64>(1) as u64);
        let mut rows: HashMap<GlobalTxid, InspectedRecord> = HashMap::new();
        let (unprepared_inc, unprepared_txid): (Vec<i64>, Vec<i64>) = q
            .txids
            .iter()
            .filter(|t| !prepared.contains_key(t))
            .map(|t| (t.incarnation as i64, t.txid as i64))
            .unzip();
        if !unprepared_txid.is_empty() {
            for r in obj
                .query(
                    &format!(
                        "{select} WHERE (incarnation, txid) IN (SELECT * FROM unnest($2::bigint[], $3::bigint[]))"
                    ),
                    &[&self.id, &unprepared_inc, &unprepared_txid],
                )
                .await
                .map_err(|e| pg_err("reading the log", &e))?
            {
                let txid = txid_of(&r);
                rows.insert(txid, as_row(txid, r.get(2), r.get(3), r.get(4))?);
            }
        }
        let records = q
            .txids
            .iter()
            .map(|&txid| match prepared.get(&txid) {
                Some(&p) => as_prepared(txid, p),
                None => rows.get(&txid).copied().unwrap_or(InspectedRecord {
                    txid,
                    entry: None,
                    recorded_unix_ms: None,
                }),
            })
            .collect();
        let mut doubt: Vec<InspectedRecord> = prepared.iter().map(|(&t, &p)| as_prepared(t, p)).collect();
        doubt.sort_by_key(|r| (r.recorded_unix_ms, r.txid));
        let mut recent = Vec::new();
        if q.recent > 0 {
            let limit = q.recent.min(i64::MAX as usize) as i64;
            for r in obj
                .query(
                    &format!("{select} ORDER BY decided_ms DESC, incarnation DESC, txid DESC LIMIT $2"),
                    &[&self.id, &limit],
                )
                .await
                .map_err(|e| pg_err("reading the log", &e))?
            {
                let txid = txid_of(&r);
                if !prepared.contains_key(&txid) {
                    recent.push(as_row(txid, r.get(2), r.get(3), r.get(4))?);
                }
            }
            recent.extend(doubt.iter().copied());
            recent.sort_by_key(|r| std::cmp::Reverse((r.recorded_unix_ms, r.txid)));
            recent.truncate(q.recent);
        }
        let rows_total: i64 = obj
            .query_one(
                &format!(
                    "SELECT (SELECT count(*) FROM {LOG_TABLE} WHERE participant = $1)
                          + (SELECT count(*) FROM {LOG_INC_TABLE} WHERE participant = $1)"
                ),
                &[&self.id],
            )
            .await
            .map_err(|e| pg_err("counting the log", &e))?
            .get(0);
        let in_doubt_summary = InDoubtSummary {
            count: prepared.len(),
            oldest_age: prepared
                .values()
                .map(|p| p.2)
                .max()
                .map(|ms| Duration::from_millis(ms.max(0) as u64)),
        };
        let in_doubt = if q.in_doubt {
            doubt.truncate(q.list_max);
            doubt
        } else {
            Vec::new()
        };
        Ok(Inspection {
            records,
            in_doubt,
            recent,
            in_doubt_summary,
            // A prepared transaction's row is inside it, not visible yet.
            records_total: rows_total.max(0) as u64 + prepared.len() as u64,
        })
    }

    /// The term floors are kept.
    async fn forget_records(&self, records: &[(u64, GlobalTxid)]) -> Result<usize, StoreError> {
        let obj = self.conn().await?;
        let mut n = 0;
        for &(ms, txid) in records {
            let (table, key) = log_key(txid);
            n += obj
                .execute(
                    &format!("DELETE FROM {table} WHERE {key} AND decided_ms = $4"),
                    &[&self.id, &(txid.txid as i64), &(txid.incarnation as i64), &(ms as i64)],
                )
                .await
                .map_err(|e| pg_err("forgetting log records", &e))? as usize;
        }
        Ok(n)
    }
}
