//! The connection pools of the PostgreSQL participant and step store
//! (cargo feature `postgres`; ADR 0035): how a pool is opened (the
//! connection string read with its TLS settings, the first connection
//! retried with backoff, problems no retry can fix reported at once), the
//! session settings every pooled connection gets, the bounded wait for a
//! connection, and [`Lease`], a connection that cancels its statement when
//! the call that holds it is dropped.
//!
//! # Durable commits
//!
//! A commit acknowledged by the SDK (a one-phase commit, a tombstone, a
//! term floor, a step's record) must survive a crash of PostgreSQL.
//! `synchronous_commit = off` on the role, the database or the server makes
//! COMMIT return before its WAL is flushed (PREPARE TRANSACTION and COMMIT
//! PREPARED flush whatever it says). So every pooled connection starts with
//! [`SESSION_SETUP`], which raises `off` to `on` (PostgreSQL's default) for
//! the session, and the transactions a handler ran in are committed after
//! [`TRANSACTION_DURABLE`] (the same, `LOCAL`, after the handler: a handler
//! that turned it off for its transaction does not get its way). `local`,
//! `remote_write`, `on` and `remote_apply` are left as the operator set
//! them: each flushes the commit locally before it returns, as PREPARE
//! TRANSACTION does.

use std::ops::Deref;
use std::ops::DerefMut;
use std::time::Duration;
use std::time::Instant;

use deadpool_postgres::ClientWrapper;
use deadpool_postgres::Hook;
use deadpool_postgres::HookError;
use deadpool_postgres::Manager;
use deadpool_postgres::ManagerConfig;
use deadpool_postgres::Object;
use deadpool_postgres::Pool;
use deadpool_postgres::PoolError;
use deadpool_postgres::RecyclingMethod;
use deadpool_postgres::Runtime;
use deadpool_postgres::Transaction;

use crate::pg_tls::ConnSettings;
use crate::pg_tls::PgTls;
use crate::store::StoreError;

/// Run once on every new pooled connection: `synchronous_commit` raised
/// from `off` to `on` for the session (module documentation).
pub const SESSION_SETUP: &str =
    "SELECT set_config('synchronous_commit', 'on', false) WHERE current_setting('synchronous_commit') = 'off'";

/// Run in a transaction before its COMMIT (or PREPARE TRANSACTION): the
/// same for the transaction, whatever its handler set.
pub const TRANSACTION_DURABLE: &str =
    "SELECT set_config('synchronous_commit', 'on', true) WHERE current_setting('synchronous_commit') = 'off'";

/// The default longest wait for a pooled connection, in ms.
pub const DEFAULT_POOL_WAIT_TIMEOUT_MS: u64 = 5_000;

/// Commits `tx` after [`TRANSACTION_DURABLE`]: the acknowledgement that
/// follows is not lost in a crash of PostgreSQL, whatever
/// `synchronous_commit` the role or the handler set.
pub async fn commit_durably(tx: Transaction<'_>) -> Result<(), tokio_postgres::Error> {
    tx.batch_execute(TRANSACTION_DURABLE).await?;
    tx.commit().await
}

/// How a pool's first connection is retried at start.
pub struct ConnectRetry {
    /// Attempts before giving up (at least 1).
    pub attempts: u32,
    /// The wait after the first failed attempt, doubled after each, capped
    /// by `backoff_max`.
    pub backoff: Duration,
    pub backoff_max: Duration,
    /// One attempt's connect timeout (unless the connection string sets
    /// one); also the bound of a whole new connection (TLS and log-in
    /// included).
    pub timeout: Duration,
}

/// Where a pool points, for messages.
pub struct PgTarget {
    pub host: String,
    pub port: u16,
    pub dbname: String,
    pub user: String,
}

impl PgTarget {
    /// `host:port/dbname`.
    pub fn label(&self) -> String {
        format!("{}:{}/{}", self.host, self.port, self.dbname)
    }

    /// A start-up failure against this server.
    pub fn open_err(&self, message: String) -> StoreError {
        StoreError::Open {
            path: format!("postgresql://{}", self.label()),
            message,
            disk_full: false,
        }
    }
}

/// A connection string read (TLS included, see `pg_tls`) with its target.
pub struct Endpoint {
    pub settings: ConnSettings,
    pub target: PgTarget,
    /// The bound of one new connection.
    pub create_timeout: Duration,
}

impl Endpoint {
    pub fn parse(conn_string: &str, retry: &ConnectRetry) -> Result<Endpoint, StoreError> {
        let mut settings = crate::pg_tls::parse(conn_string).map_err(StoreError::Io)?;
        if settings.config.get_connect_timeout().is_none() {
            settings.config.connect_timeout(retry.timeout);
        }
        let cfg = &settings.config;
        let target = PgTarget {
            host: cfg
                .get_hosts()
                .first()
                .map(|h| match h {
                    tokio_postgres::config::Host::Tcp(s) => s.clone(),
                    tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
                })
                .unwrap_or_else(|| "localhost".into()),
            port: cfg.get_ports().first().copied().unwrap_or(5432),
            dbname: cfg.get_dbname().unwrap_or("(default)").to_string(),
            user: cfg.get_user().unwrap_or("(default)").to_string(),
        };
        // TCP connect, TLS and log-in: a server that accepts and then says
        // nothing must not hold a pool's slot for ever.
        let create_timeout = (*cfg.get_connect_timeout().unwrap_or(&retry.timeout)).max(Duration::from_secs(1)) * 2;
        Ok(Endpoint {
            settings,
            target,
            create_timeout,
        })
    }

    /// A pool of `size` connections, each set up with [`SESSION_SETUP`];
    /// a connection is waited for at most `wait`.
    pub fn pool(&self, size: usize, wait: Duration) -> Result<Pool, StoreError> {
        let mgr = Manager::from_config(
            self.settings.config.clone(),
            self.settings.tls.clone(),
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        Pool::builder(mgr)
            .max_size(size.max(1))
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(wait))
            .create_timeout(Some(self.create_timeout))
            .post_create(Hook::async_fn(|client: &mut ClientWrapper, _| {
                Box::pin(async move { client.batch_execute(SESSION_SETUP).await.map_err(HookError::Backend) })
            }))
            .build()
            .map_err(|e| self.target.open_err(format!("building the connection pool: {e}")))
    }

    /// The first connection of `pool`, retried with backoff (a server
    /// still starting, a network blip); a problem no retry fixes (the
    /// server's certificate, TLS refused, the log-in refused) at once, and
    /// after the last attempt an error naming the server, the attempts and
    /// the last failure.
    pub async fn first_connection(&self, pool: &Pool, retry: &ConnectRetry) -> Result<Object, StoreError> {
        let at = &self.target;
        let attempts = retry.attempts.max(1);
        let mut wait = retry.backoff;
        let began = Instant::now();
        let mut n = 1;
        loop {
            let e = match pool.get().await {
                Ok(c) => return Ok(c),
                Err(e) => e,
            };
            if let Some(m) = self.lasting_problem(&e) {
                tracing::error!("PostgreSQL at {}:{}: {m}", at.host, at.port);
                return Err(at.open_err(m));
            }
            if n >= attempts {
                tracing::error!(
                    "PostgreSQL at {}:{}: connection attempt {n}/{attempts} failed: {e}; giving up",
                    at.host,
                    at.port
                );
                return Err(at.open_err(format!(
                    "PostgreSQL at {}:{} (database {}) unreachable: {attempts} connection attempts over {:?} failed, the last with: {}",
                    at.host,
                    at.port,
                    at.dbname,
                    began.elapsed(),
                    error_text(&e)
                )));
            }
            tracing::warn!(
                "PostgreSQL at {}:{} (database {}): connection attempt {n}/{attempts} failed: {}; retrying in {wait:?}",
                at.host,
                at.port,
                at.dbname,
                error_text(&e)
            );
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(retry.backoff_max);
            n += 1;
        }
    }

    /// What is wrong, when trying again cannot help.
    fn lasting_problem(&self, e: &PoolError) -> Option<String> {
        let pg = match e {
            PoolError::Backend(e) | PoolError::PostCreateHook(HookError::Backend(e)) => e,
            _ => return None,
        };
        let host = format!("{}:{}", self.target.host, self.target.port);
        if let Some(m) = crate::pg_tls::describe_connect_error(pg, &self.settings, &host) {
            return Some(m);
        }
        let db = pg.as_db_error()?;
        // Class 28: invalid authorization (pg_hba.conf, a password, a
        // client certificate asked for).
        db.code().code().starts_with("28").then(|| {
            format!(
                "PostgreSQL at {host} refused the log-in of role {} to database {}: {} (SQLSTATE {}; {})",
                self.target.user,
                self.target.dbname,
                db.message(),
                db.code().code(),
                self.settings.describe()
            )
        })
    }
}

/// A pool error with its cause (deadpool's own text leaves it out).
fn error_text(e: &PoolError) -> String {
    match e {
        PoolError::Backend(pg) | PoolError::PostCreateHook(HookError::Backend(pg)) => match pg.as_db_error() {
            Some(db) => format!("{pg}: {} (SQLSTATE {})", db.message(), db.code().code()),
            None => match std::error::Error::source(pg) {
                Some(cause) => format!("{pg}: {cause}"),
                None => pg.to_string(),
            },
        },
        other => other.to_string(),
    }
}

/// A pool of `concurrency` connections to `conn_string` and its first
/// connection (see [`Endpoint::first_connection`]); a connection is waited
/// for at most [`DEFAULT_POOL_WAIT_TIMEOUT_MS`]. With the TLS connector, for
/// cancel requests ([`Lease`]).
pub async fn open_pool(
    conn_string: &str,
    concurrency: usize,
    retry: &ConnectRetry,
) -> Result<(Pool, Object, PgTarget, PgTls), StoreError> {
    let ep = Endpoint::parse(conn_string, retry)?;
    let pool = ep.pool(concurrency, Duration::from_millis(DEFAULT_POOL_WAIT_TIMEOUT_MS))?;
    let first = ep.first_connection(&pool, retry).await?;
    Ok((pool, first, ep.target, ep.settings.tls.clone()))
}

/// A pooled connection held for one call. Dropped before [`Lease::finish`]
/// (the call's future was dropped: the caller gave up, a deadline passed),
/// it cancels the statement it may be running (a cancel request to the
/// server, as `pg_cancel_backend` would) and closes the connection instead
/// of handing it to the next call: the statement may be waiting on a lock
/// for a long time, and its transaction's locks and the pool's slot with
/// it. Whatever the call had not finished is rolled back by PostgreSQL; a
/// PREPARE TRANSACTION or COMMIT PREPARED it had sent either happened or
/// did not, as after a crash.
pub struct Lease {
    obj: Option<Object>,
    tls: PgTls,
    participant: String,
    /// What the call is about, for the log (a txid, an operation id).
    call: String,
    finished: bool,
}

impl Lease {
    /// `participant`: the participant id or step service name (the
    /// metric's label); `call`: what the call is about, for the log.
    pub fn new(obj: Object, tls: PgTls, participant: &str, call: impl std::fmt::Display) -> Lease {
        Lease {
            obj: Some(obj),
            tls,
            participant: participant.to_string(),
            call: call.to_string(),
            finished: false,
        }
    }

    /// The pooled connection, for code generic over `GenericClient`.
    pub fn object(&self) -> &Object {
        self.obj.as_ref().expect("a lease holds its connection until dropped")
    }

    /// The call is over: the connection goes back to the pool.
    pub fn finish(mut self) {
        self.finished = true;
    }
}

impl Deref for Lease {
    type Target = ClientWrapper;

    fn deref(&self) -> &ClientWrapper {
        self.obj.as_ref().expect("a lease holds its connection until dropped")
    }
}

impl DerefMut for Lease {
    fn deref_mut(&mut self) -> &mut ClientWrapper {
        self.obj.as_mut().expect("a lease holds its connection until dropped")
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let Some(obj) = self.obj.take() else { return };
        metrics::counter!("dtx_participant_pg_calls_cancelled_total", "participant" => self.participant.clone())
            .increment(1);
        tracing::info!(
            call = %self.call,
            "the call was dropped while its PostgreSQL work ran: cancelling its statement and closing its connection"
        );
        // Out of the pool for good: its session may be mid-statement.
        let client = Object::take(obj);
        let token = client.cancel_token();
        let tls = self.tls.clone();
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move {
                    if let Err(e) = token.cancel_query(tls).await {
                        tracing::warn!("cancelling a dropped call's statement: {e}");
                    }
                    // Closes the connection: PostgreSQL rolls back what was
                    // left open.
                    drop(client);
                });
            }
            Err(_) => drop(client),
        }
    }
}
