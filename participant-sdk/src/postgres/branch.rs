//! Branches that prepare where they run, on PostgreSQL (docs/protocol.md,
//! "Branches"; docs/adr/0046): the service's request handler does its SQL
//! in a PostgreSQL transaction bound to the txid it was called with, and
//! at its end the SDK prepares it (`PREPARE TRANSACTION`) and registers
//! the branch with its vote, before the handler answers its caller.
//!
//! ```ignore
//! let txid = participant_sdk::branch::transaction_of(&request)?;
//! let mut conn = participant.branch_connection().await?;
//! let branch = participant.begin_branch(&mut conn, txid).await?;
//! branch.execute("UPDATE items SET stock = stock - $1 WHERE id = $2", &[&n, &id]).await?;
//! let left: i64 = branch.query_one("SELECT stock FROM items WHERE id = $1", &[&id]).await?.get(0);
//! let joined = branch.join(Verdict::yes(), &cluster, &who).await?;
//! ```
//!
//! What it keeps, beside the participant's log and gids (the module
//! documentation of `postgres`):
//! - the branch's transaction has the handlers' lock and statement
//!   timeouts (`PgOptions::handler_lock_timeout_ms`, 1 s by default), so a
//!   handler that meets a row another prepared transaction holds fails
//!   fast instead of waiting for that transaction's decision;
//! - a YES writes the `committed` marker inside the transaction (as a
//!   Prepare does), and a **mark** row in `dtx_participant_branch` in its
//!   own committed transaction *before* `PREPARE TRANSACTION`, so there is
//!   never a prepared branch without its mark; the mark goes once the
//!   cluster's answer is known. A mark whose transaction never prepared
//!   (a crash in between) holds nothing and recovery drops it;
//! - what PostgreSQL cannot prepare (a temporary table, LISTEN, UNLISTEN,
//!   NOTIFY, a cursor WITH HOLD, an exported snapshot) is refused early
//!   and clearly, in three places, and is a NO either way:
//!   1. the guarded methods ([`PgBranch::execute`], `query`, `query_one`,
//!      `query_opt`, `batch_execute`, `prepare_cached`) refuse such a
//!      statement before sending it ([`refuse_unpreparable`], a lexical
//!      check that skips literals, quoted identifiers and comments) with
//!      [`BranchError::Unpreparable`], naming the restriction, why and
//!      what to do instead (NOTIFY: the outbox, `crate::outbox::pg`); the
//!      branch then votes NO at `join` whatever the verdict;
//!   2. `join` on a YES first looks in the transaction's own state, in one
//!      query inside it, for temporary relations this transaction created
//!      or changed and cursors WITH HOLD it declared (what earlier
//!      transactions of the pooled session left is not counted: it does
//!      not stop PREPARE) and votes NO naming them;
//!   3. what neither sees (SQL through the unguarded [`PgBranch::tx`] that
//!      leaves no trace before commit: LISTEN, NOTIFY, an exported
//!      snapshot, writing to a temporary table created earlier; SQL in a DO
//!      block or a function) is refused by `PREPARE TRANSACTION` itself
//!      (SQLSTATE 0A000) and is a NO naming the restriction.
//!
//!   Each NO is registered with its reason before anything is marked or
//!   held (the transaction aborts at once), recorded here like a
//!   Prepare's NO, and counted (`dtx_participant_pg_not_preparable_total`);
//!   `join` returns it as `Ok` with the NO, as for the handler's own NO. A
//!   server with no free prepared-transaction slot is a NO the same way;
//! - the gid's term is the incarnation's term floor (a branch prepares
//!   before any leader has sent it anything).

use std::sync::Mutex;

use deadpool_postgres::Object;
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;
use tokio_postgres::Statement;

use super::pg_err;
use super::st;
use super::PgHandler;
use super::PgParticipant;
use super::Transaction;
use super::BRANCH_TABLE;
use crate::branch::certainly_out;
use crate::branch::BranchError;
use crate::branch::BranchIdentity;
use crate::branch::Joined;
use crate::log::GlobalTxid;
use crate::log::Vote;
use crate::participant::StoreError;
use crate::participant::Verdict;
use dtx_client::BranchVote;
use dtx_client::Client;

/// An open branch: the handler's SQL runs in [`PgBranch::tx`]; then
/// [`PgBranch::join`]. Dropped without joining, its transaction rolls back
/// and nothing is recorded.
pub struct PgBranch<'c, H: PgHandler> {
    participant: &'c PgParticipant<H>,
    tx: Transaction<'c>,
    txid: GlobalTxid,
    running: Running<'c, H>,
    /// The first statement the guarded methods refused: [`PgBranch::join`]
    /// votes NO with it, whatever the handler's verdict.
    refused: Mutex<Option<BranchError>>,
}

/// The txid in the participant's running set while its flow runs here.
struct Running<'c, H: PgHandler> {
    participant: &'c PgParticipant<H>,
    txid: GlobalTxid,
}

impl<H: PgHandler> Drop for Running<'_, H> {
    fn drop(&mut self) {
        self.participant
            .branches_running
            .lock()
            .expect("branches lock")
            .remove(&self.txid);
    }
}

impl<H: PgHandler> PgParticipant<H> {
    /// A connection of the handlers' pool for a branch
    /// ([`PgParticipant::begin_branch`]): waited for at most
    /// `PgOptions::pool_wait_timeout_ms`.
    pub async fn branch_connection(&self) -> Result<Object, StoreError> {
        self.get(&self.pool, "handlers").await
    }

    /// Opens the branch of `txid` on `conn`: a PostgreSQL transaction with
    /// the handlers' lock and statement timeouts. Refused when this
    /// participant already has work for `txid` (prepared, decided, or a
    /// branch of it running here).
    pub async fn begin_branch<'c>(
        &'c self,
        conn: &'c mut Object,
        txid: GlobalTxid,
    ) -> Result<PgBranch<'c, H>, BranchError> {
        if !self.branches_running.lock().expect("branches lock").insert(txid) {
            return Err(BranchError::AlreadyPrepared {
                txid,
                state: "a branch of it is running here".into(),
            });
        }
        let running = Running {
            participant: self,
            txid,
        };
        let (prepared, row) = tokio::try_join!(self.prepared(conn, txid), self.row(conn, txid))?;
        if prepared.is_some() {
            return Err(BranchError::AlreadyPrepared {
                txid,
                state: "prepared".into(),
            });
        }
        if let Some(row) = row {
            return Err(BranchError::AlreadyPrepared { txid, state: row.state });
        }
        let tx = conn.transaction().await.map_err(|e| pg_err("BEGIN", &e))?;
        tx.batch_execute(&self.handler_limits)
            .await
            .map_err(|e| pg_err("SET LOCAL lock_timeout, statement_timeout", &e))?;
        Ok(PgBranch {
            participant: self,
            tx,
            txid,
            running,
            refused: Mutex::new(None),
        })
    }

    /// The mark of a branch of `txid` (its own committed transaction).
    async fn mark_branch(&self, c: &Object, txid: GlobalTxid) -> Result<(), StoreError> {
        c.execute(
            &format!(
                "INSERT INTO {BRANCH_TABLE} (participant, incarnation, txid, marked_ms) VALUES ($1, $2, $3, $4)
                 ON CONFLICT DO NOTHING"
            ),
            &[
                &self.id,
                &(txid.incarnation as i64),
                &(txid.txid as i64),
                &super::now_ms(),
            ],
        )
        .await
        .map_err(|e| pg_err("writing the branch mark", &e))?;
        Ok(())
    }

    /// The marked branches whose flow does not run here now.
    pub(super) async fn branch_marks(&self) -> Result<Vec<(GlobalTxid, String)>, StoreError> {
        let c = self.conn().await?;
        let rows = c
            .query(
                &format!("SELECT incarnation, txid FROM {BRANCH_TABLE} WHERE participant = $1 ORDER BY marked_ms"),
                &[&self.id],
            )
            .await
            .map_err(|e| pg_err("reading the branch marks", &e))?;
        let running = self.branches_running.lock().expect("branches lock").clone();
        Ok(rows
            .into_iter()
            .map(|r| GlobalTxid::new(r.get::<_, i64>(0) as u64, r.get::<_, i64>(1) as u64))
            .filter(|t| !running.contains(t))
            .map(|t| (t, self.id.clone()))
            .collect())
    }

    /// Removes the mark of `txid`'s branch (on a connection of its own).
    pub(super) async fn drop_mark(&self, txid: GlobalTxid) -> Result<(), StoreError> {
        let c = self.conn().await?;
        self.drop_mark_on(&c, txid).await
    }

    /// Removes the mark of `txid`'s branch on `c`, a connection the caller
    /// holds already (so one join never waits for a second connection of
    /// the decisions pool while holding one: joins failing together could
    /// otherwise exhaust it between them).
    async fn drop_mark_on(&self, c: &Object, txid: GlobalTxid) -> Result<(), StoreError> {
        c.execute(
            &format!("DELETE FROM {BRANCH_TABLE} WHERE participant = $1 AND incarnation = $2 AND txid = $3"),
            &[&self.id, &(txid.incarnation as i64), &(txid.txid as i64)],
        )
        .await
        .map_err(|e| pg_err("removing the branch mark", &e))?;
        Ok(())
    }
}

impl<'c, H: PgHandler> PgBranch<'c, H> {
    /// The branch's open PostgreSQL transaction, unguarded: for SQL the
    /// guarded methods ([`PgBranch::execute`] and the others) do not take
    /// (a statement prepared elsewhere, code shared with a [`PgHandler`]);
    /// check text you build with [`refuse_unpreparable`]. Do not commit or
    /// roll it back.
    pub fn tx(&self) -> &Transaction<'c> {
        &self.tx
    }

    /// Refuses `sql` when it does what `PREPARE TRANSACTION` cannot carry
    /// ([`refuse_unpreparable`]), and remembers the first refusal so that
    /// [`PgBranch::join`] votes NO with it.
    fn guard(&self, sql: &str) -> Result<(), BranchError> {
        let Some(r) = restriction_in(sql) else {
            return Ok(());
        };
        self.refused
            .lock()
            .expect("refused lock")
            .get_or_insert_with(|| r.error());
        Err(r.error())
    }

    /// Runs `sql` in the branch's transaction and returns the rows it
    /// changed. SQL a branch cannot prepare (NOTIFY, LISTEN, UNLISTEN, a
    /// temporary table, a cursor WITH HOLD, an exported snapshot:
    /// [`refuse_unpreparable`]) is refused before it is sent, with
    /// [`BranchError::Unpreparable`], and the branch then votes NO at
    /// [`PgBranch::join`]. A PostgreSQL error is a [`BranchError::Store`]
    /// whose text has the SQLSTATE.
    pub async fn execute(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<u64, BranchError> {
        self.guard(sql)?;
        self.tx.execute(sql, params).await.map_err(|e| sql_err(&e))
    }

    /// Runs the query `sql` in the branch's transaction, guarded as
    /// [`PgBranch::execute`].
    pub async fn query(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<Vec<Row>, BranchError> {
        self.guard(sql)?;
        self.tx.query(sql, params).await.map_err(|e| sql_err(&e))
    }

    /// The one row of `sql` (an error when there are none or several),
    /// guarded as [`PgBranch::execute`].
    pub async fn query_one(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<Row, BranchError> {
        self.guard(sql)?;
        self.tx.query_one(sql, params).await.map_err(|e| sql_err(&e))
    }

    /// The row of `sql` if there is one (an error when there are several),
    /// guarded as [`PgBranch::execute`].
    pub async fn query_opt(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<Option<Row>, BranchError> {
        self.guard(sql)?;
        self.tx.query_opt(sql, params).await.map_err(|e| sql_err(&e))
    }

    /// Runs statements without parameters (`;`-separated), guarded as
    /// [`PgBranch::execute`]: one refused statement refuses them all.
    pub async fn batch_execute(&self, sql: &str) -> Result<(), BranchError> {
        self.guard(sql)?;
        self.tx.batch_execute(sql).await.map_err(|e| sql_err(&e))
    }

    /// `sql` prepared on the branch's connection (cached per connection),
    /// guarded as [`PgBranch::execute`]: run it with `branch.tx()`
    /// (`execute(&statement, ..)`), its text already checked.
    pub async fn prepare_cached(&self, sql: &str) -> Result<Statement, BranchError> {
        self.guard(sql)?;
        self.tx.prepare_cached(sql).await.map_err(|e| sql_err(&e))
    }

    /// The transaction this branch works for.
    pub fn txid(&self) -> GlobalTxid {
        self.txid
    }

    /// Ends the handler's work with its `verdict`: YES prepares it
    /// (`PREPARE TRANSACTION`) and registers the branch with the cluster
    /// through `cluster`; NO and READ_ONLY roll it back and register that
    /// vote. Work PostgreSQL cannot prepare (a statement a guarded method
    /// refused, a temporary table or a cursor WITH HOLD this transaction
    /// made, or PREPARE TRANSACTION's own refusal: the module
    /// documentation) is rolled back and registered as a NO naming the
    /// restriction, returned as `Ok` like the handler's own NO. Returns
    /// once the cluster has the vote; each other way it can end is a
    /// [`BranchError`] (`RolledBack`: nothing of it can commit; `Unknown`:
    /// the work stays prepared, recovery settles it).
    pub async fn join(self, verdict: Verdict, cluster: &Client, who: &BranchIdentity) -> Result<Joined, BranchError> {
        let PgBranch {
            participant: p,
            tx,
            txid,
            running,
            refused,
        } = self;
        let _serial = p.locks.lock(txid).await;
        let side = p.conn().await?;
        let term = p.floor(&side, txid.incarnation).await?;
        let mut verdict = verdict;
        let mut held = false;
        // What PREPARE TRANSACTION would refuse, found before it: a
        // statement the guarded methods refused (whatever the verdict but
        // a NO: the handler's work is not what it meant), or the
        // transaction's own state (a YES only). A NO with the reason,
        // before anything is marked or held.
        let mut early = refused.into_inner().expect("refused lock");
        if early.is_none() && verdict.vote == Vote::Yes {
            early = match unpreparable_state(&tx).await {
                Ok(found) => found,
                Err(e) => {
                    let _ = tx.rollback().await;
                    return Err(e.into());
                }
            };
        }
        if let (Some(e), false) = (&early, verdict.vote == Vote::No) {
            metrics::counter!("dtx_participant_pg_not_preparable_total", "participant" => p.id.clone()).increment(1);
            let reason = format!("transaction {txid} not prepared here: {e}");
            tracing::warn!("{reason}");
            verdict = Verdict::no(reason);
        }
        if verdict.vote == Vote::Yes {
            match p.insert_marker(&tx, txid, term).await {
                Ok(true) => {}
                Ok(false) => {
                    let _ = tx.rollback().await;
                    return Err(BranchError::AlreadyPrepared {
                        txid,
                        state: "aborted here meanwhile".into(),
                    });
                }
                Err(e) => {
                    let _ = tx.rollback().await;
                    return Err(e.into());
                }
            }
            // The mark before the prepared transaction: never one without it.
            if let Err(e) = p.mark_branch(&side, txid).await {
                let _ = tx.rollback().await;
                return Err(e.into());
            }
            let gid = p.gid(txid, term);
            let prepared = tx
                .batch_execute(&format!("PREPARE TRANSACTION {}", super::literal(&gid)))
                .await;
            // PREPARE ended the session's transaction (a failed one is a
            // ROLLBACK): nothing for the handle to roll back when dropped.
            std::mem::forget(tx);
            match prepared {
                Ok(()) => held = true,
                Err(e) => {
                    let Some(reason) = p.no_slot(txid, &e).or_else(|| p.not_preparable(txid, &e)) else {
                        // No answer from the server (the connection
                        // failed): whether it prepared is not known here,
                        // so the mark stays and recovery settles it by
                        // branch; never a prepared branch without its mark
                        // (an unmarked one would be asked about by txid
                        // alone). The Python SDK's authors noticed it.
                        if e.as_db_error().is_none() {
                            return Err(pg_err("PREPARE TRANSACTION (outcome unknown: the mark stays)", &e).into());
                        }
                        p.drop_mark_on(&side, txid).await?;
                        return Err(pg_err("PREPARE TRANSACTION", &e).into());
                    };
                    p.drop_mark_on(&side, txid).await?;
                    verdict = Verdict::no(reason);
                }
            }
        } else {
            tx.rollback().await.map_err(|e| pg_err("ROLLBACK", &e))?;
        }
        if !held {
            // Recorded like a Prepare's NO or READ_ONLY, so a repeat (or a
            // Prepare sent after all) answers the same.
            let state = if verdict.vote == Vote::ReadOnly {
                st::READ_ONLY
            } else {
                st::ABORTED
            };
            p.record(&side, txid, state, term).await?;
        } else {
            dtx_failpoint::failpoint!("participant_branch_prepared_before_register");
        }
        drop(side);
        let vote = match verdict.vote {
            Vote::Yes => BranchVote::Yes,
            Vote::No => BranchVote::No,
            Vote::ReadOnly => BranchVote::ReadOnly,
        };
        let registered = cluster
            .register_branch(
                (txid.incarnation, txid.txid),
                &who.participant_id,
                &who.address,
                vote,
                &verdict.reason,
            )
            .await;
        let result = match registered {
            Ok(r) => {
                if held {
                    p.drop_mark(txid).await?;
                    dtx_failpoint::failpoint!("participant_branch_registered_before_answer");
                }
                Ok(Joined {
                    vote: verdict.vote,
                    reason: verdict.reason,
                    term: r.term,
                })
            }
            Err(e) if certainly_out(&e) => {
                if held {
                    let mut c = p.conn().await?;
                    p.on_abort(&mut c, txid, term).await?;
                    p.drop_mark_on(&c, txid).await?;
                }
                Err(BranchError::RolledBack {
                    txid,
                    why: e.to_string(),
                })
            }
            Err(e) => Err(BranchError::Unknown {
                txid,
                why: e.to_string(),
            }),
        };
        drop(running);
        result
    }
}

/// A PostgreSQL error of the handler's SQL run through a guarded method.
fn sql_err(e: &tokio_postgres::Error) -> BranchError {
    pg_err("the branch's SQL", e).into()
}

/// What the branch's transaction did that `PREPARE TRANSACTION` would
/// refuse, as far as its state shows it, in one query inside it: temporary
/// relations created or changed by this transaction (their catalog row's
/// `xmin` is this transaction's or one of its subtransactions': `age` 0 or
/// less; those of earlier transactions of the pooled session, which do not
/// stop PREPARE, are older), and cursors WITH HOLD declared in it (created
/// since the transaction began; older ones do not stop PREPARE either).
/// PostgreSQL shows nothing of LISTEN, UNLISTEN or NOTIFY before commit,
/// of an exported snapshot, or of a temporary table only written to: the
/// guarded methods refuse those statements, and PREPARE TRANSACTION's own
/// refusal (SQLSTATE 0A000) still catches the rest.
async fn unpreparable_state(tx: &Transaction<'_>) -> Result<Option<BranchError>, StoreError> {
    let row = tx
        .query_one(
            "SELECT
               (SELECT pg_catalog.string_agg(pg_catalog.quote_ident(n), ', ') FROM (
                  SELECT c.relname::text AS n FROM pg_catalog.pg_class c
                  WHERE pg_catalog.pg_my_temp_schema() <> 0
                    AND c.relnamespace = pg_catalog.pg_my_temp_schema()
                    AND pg_catalog.age(c.xmin) <= 0
                  ORDER BY 1 LIMIT 5) t),
               (SELECT pg_catalog.string_agg(pg_catalog.quote_ident(n), ', ') FROM (
                  SELECT k.name AS n FROM pg_catalog.pg_cursors k
                  WHERE k.is_holdable AND k.creation_time >= pg_catalog.transaction_timestamp()
                  ORDER BY 1 LIMIT 5) t)",
            &[],
        )
        .await
        .map_err(|e| pg_err("looking for what PREPARE TRANSACTION refuses", &e))?;
    let temp: Option<String> = row.get(0);
    let hold: Option<String> = row.get(1);
    let (r, names) = match (temp, hold) {
        (Some(names), _) => (Restriction::Temp, names),
        (None, Some(names)) => (Restriction::Hold, names),
        (None, None) => return Ok(None),
    };
    Ok(Some(BranchError::Unpreparable {
        what: format!("{} ({names})", r.what()),
        why: r.why().to_string(),
    }))
}

/// Refuses SQL that a branch's transaction cannot carry to `PREPARE
/// TRANSACTION`, before it is sent: NOTIFY, LISTEN and UNLISTEN
/// statements, `pg_notify(..)` and `pg_export_snapshot()` calls, creating
/// a temporary table, view or sequence (`CREATE TEMP ..`, `CREATE
/// TEMPORARY ..`, `SELECT .. INTO TEMP ..`), anything named in the
/// `pg_temp` schema, and `DECLARE .. WITH HOLD`. The error
/// ([`BranchError::Unpreparable`]) names the restriction, why PREPARE
/// refuses it and what to do instead.
///
/// A lexical check of every `;`-separated statement: string literals
/// (`'..'`, `E'..'`, dollar-quoted bodies), quoted identifiers and comments
/// are skipped, so a column or table named `temp`, a literal `'NOTIFY'` or
/// a comment never trips it. What it cannot see (SQL inside a DO block or
/// a function, a temporary table created earlier in the session and only
/// written to) is found at [`PgBranch::join`] by the transaction's state,
/// or by PREPARE TRANSACTION itself; either way the branch votes NO with
/// the reason.
pub fn refuse_unpreparable(sql: &str) -> Result<(), BranchError> {
    match restriction_in(sql) {
        Some(r) => Err(r.error()),
        None => Ok(()),
    }
}

/// What `PREPARE TRANSACTION` refuses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Restriction {
    Notify,
    Listen,
    Unlisten,
    Temp,
    Hold,
    ExportSnapshot,
}

impl Restriction {
    fn what(self) -> &'static str {
        match self {
            Restriction::Notify => "NOTIFY (or pg_notify)",
            Restriction::Listen => "LISTEN",
            Restriction::Unlisten => "UNLISTEN",
            Restriction::Temp => "a temporary table",
            Restriction::Hold => "a cursor WITH HOLD",
            Restriction::ExportSnapshot => "an exported snapshot (pg_export_snapshot)",
        }
    }

    fn why(self) -> &'static str {
        match self {
            Restriction::Notify => {
                "PREPARE TRANSACTION refuses a transaction that executed NOTIFY (SQLSTATE 0A000), so the branch could \
                 never vote YES. Write the message to an outbox in the branch's transaction instead \
                 (participant_sdk::outbox::pg::PgOutbox::write): it is published once the transaction commits, and \
                 never if it aborts"
            }
            Restriction::Listen | Restriction::Unlisten => {
                "PREPARE TRANSACTION refuses a transaction that executed LISTEN or UNLISTEN (SQLSTATE 0A000), so the \
                 branch could never vote YES. Listen on a connection of its own, outside any branch"
            }
            Restriction::Temp => {
                "PREPARE TRANSACTION refuses a transaction that operated on temporary objects (SQLSTATE 0A000): they \
                 belong to the session, which a prepared transaction outlives. Use a common table expression, a \
                 regular table keyed by the txid (emptied after the decision), or keep the rows in the handler"
            }
            Restriction::Hold => {
                "PREPARE TRANSACTION refuses a transaction that created a cursor WITH HOLD (SQLSTATE 0A000): it \
                 would outlive the transaction in the session. Use a cursor without HOLD and close it before join, \
                 or read the rows with a query"
            }
            Restriction::ExportSnapshot => {
                "PREPARE TRANSACTION refuses a transaction that exported a snapshot (SQLSTATE 0A000). Export \
                 snapshots from a transaction of their own, outside any branch"
            }
        }
    }

    fn error(self) -> BranchError {
        BranchError::Unpreparable {
            what: self.what().to_string(),
            why: self.why().to_string(),
        }
    }
}

/// A token of SQL text as the check sees it: literals, numbers, parameters
/// and operators are `Other` (they only separate the tokens around them).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Tok {
    /// An unquoted identifier or keyword, in lowercase.
    Word(String),
    /// A quoted identifier, as written between the quotes (never a keyword).
    Quoted(String),
    Punct(char),
    Other,
}

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || !c.is_ascii()
}

fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '$' || !c.is_ascii()
}

/// Splits `sql` into tokens, leaving out comments (`--`, nested `/* */`)
/// and the contents of literals. Unterminated literals and comments run to
/// the end (the server refuses such text anyway).
fn tokens(sql: &str) -> Vec<Tok> {
    let c: Vec<char> = sql.chars().collect();
    let n = c.len();
    let mut out = Vec::new();
    let mut i = 0;
    // The end of a '..' literal starting at `i` (its opening quote);
    // `escapes`: backslash escapes (E'..').
    let quoted_end = |mut i: usize, escapes: bool| -> usize {
        i += 1;
        while i < n {
            if escapes && c[i] == '\\' {
                i += 2;
            } else if c[i] == '\'' {
                if i + 1 < n && c[i + 1] == '\'' {
                    i += 2;
                } else {
                    return i + 1;
                }
            } else {
                i += 1;
            }
        }
        n
    };
    while i < n {
        let ch = c[i];
        if ch.is_whitespace() {
            i += 1;
        } else if ch == '-' && c.get(i + 1) == Some(&'-') {
            while i < n && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && c.get(i + 1) == Some(&'*') {
            let mut depth = 0usize;
            while i < n {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if ch == '\'' {
            i = quoted_end(i, false);
            out.push(Tok::Other);
        } else if ch == '"' {
            let mut name = String::new();
            i += 1;
            while i < n {
                if c[i] == '"' {
                    if c.get(i + 1) == Some(&'"') {
                        name.push('"');
                        i += 2;
                        continue;
                    }
                    i += 1;
                    break;
                }
                name.push(c[i]);
                i += 1;
            }
            out.push(Tok::Quoted(name));
        } else if ch == '$' {
            // $1 (a parameter) or $tag$ .. $tag$ (a dollar-quoted literal).
            let mut j = i + 1;
            if c.get(j).is_some_and(|&d| is_ident_start(d)) {
                while j < n && is_ident_char(c[j]) && c[j] != '$' {
                    j += 1;
                }
            }
            if c.get(j) == Some(&'$') {
                let tag = &c[i..=j];
                let mut k = j + 1;
                while k < n && !c[k..].starts_with(tag) {
                    k += 1;
                }
                i = (k + tag.len()).min(n);
            } else {
                i += 1;
                while i < n && c[i].is_ascii_digit() {
                    i += 1;
                }
            }
            out.push(Tok::Other);
        } else if is_ident_start(ch) {
            let start = i;
            while i < n && is_ident_char(c[i]) {
                i += 1;
            }
            let word: String = c[start..i].iter().collect::<String>().to_ascii_lowercase();
            // E'..' (escapes), B'..', X'..', N'..', U&'..': one literal.
            if c.get(i) == Some(&'\'') && matches!(word.as_str(), "e" | "b" | "x" | "n") {
                i = quoted_end(i, word == "e");
                out.push(Tok::Other);
            } else if word == "u" && c.get(i) == Some(&'&') && matches!(c.get(i + 1), Some('\'') | Some('"')) {
                // U&'..' or U&"..": the same as without the prefix.
                i += 1;
            } else {
                out.push(Tok::Word(word));
            }
        } else if ch.is_ascii_digit() {
            while i < n && (is_ident_char(c[i]) || c[i] == '.') {
                i += 1;
            }
            out.push(Tok::Other);
        } else if matches!(ch, ';' | '(' | ')' | '.' | ',') {
            out.push(Tok::Punct(ch));
            i += 1;
        } else {
            out.push(Tok::Other);
            i += 1;
        }
    }
    out
}

/// The first restriction `sql` runs into, statement by statement.
fn restriction_in(sql: &str) -> Option<Restriction> {
    tokens(sql)
        .split(|t| *t == Tok::Punct(';'))
        .find_map(restriction_of_statement)
}

fn restriction_of_statement(st: &[Tok]) -> Option<Restriction> {
    let word = |i: usize| match st.get(i) {
        Some(Tok::Word(w)) => Some(w.as_str()),
        _ => None,
    };
    let is = |i: usize, w: &str| word(i) == Some(w);
    // A name in pg_catalog's sense: an unquoted word, or exactly this
    // quoted one.
    let named = |i: usize, name: &str| match st.get(i) {
        Some(Tok::Word(w)) | Some(Tok::Quoted(w)) => w == name,
        _ => false,
    };
    match word(0) {
        Some("notify") => return Some(Restriction::Notify),
        Some("listen") => return Some(Restriction::Listen),
        Some("unlisten") => return Some(Restriction::Unlisten),
        Some("create") => {
            // CREATE [OR REPLACE] [GLOBAL | LOCAL] {TEMP | TEMPORARY} ..
            let mut i = 1;
            while matches!(word(i), Some("or" | "replace" | "global" | "local")) {
                i += 1;
            }
            if matches!(word(i), Some("temp" | "temporary")) {
                return Some(Restriction::Temp);
            }
        }
        Some("declare") => {
            // DECLARE name [options] CURSOR [WITH HOLD | WITHOUT HOLD] FOR ..
            let end = (1..st.len()).find(|&i| is(i, "for")).unwrap_or(st.len());
            if (1..end).any(|i| is(i, "with") && is(i + 1, "hold")) {
                return Some(Restriction::Hold);
            }
        }
        _ => {}
    }
    for i in 0..st.len() {
        let call = st.get(i + 1) == Some(&Tok::Punct('('));
        if call && named(i, "pg_notify") {
            return Some(Restriction::Notify);
        }
        if call && named(i, "pg_export_snapshot") {
            return Some(Restriction::ExportSnapshot);
        }
        // pg_temp.name: the session's temporary schema.
        if named(i, "pg_temp") && st.get(i + 1) == Some(&Tok::Punct('.')) {
            return Some(Restriction::Temp);
        }
        // SELECT .. INTO [GLOBAL | LOCAL] {TEMP | TEMPORARY} [TABLE] name
        // (not INSERT INTO or MERGE INTO, where `temp` can be a table).
        if is(i, "into") && !(i > 0 && matches!(word(i - 1), Some("insert" | "merge"))) {
            let mut j = i + 1;
            if matches!(word(j), Some("global" | "local")) {
                j += 1;
            }
            if matches!(word(j), Some("temp" | "temporary")) {
                let name_follows = match st.get(j + 1) {
                    Some(Tok::Quoted(_)) => true,
                    Some(Tok::Word(w)) => !matches!(
                        w.as_str(),
                        "from"
                            | "where"
                            | "group"
                            | "having"
                            | "window"
                            | "order"
                            | "limit"
                            | "offset"
                            | "fetch"
                            | "for"
                            | "union"
                            | "intersect"
                            | "except"
                            | "as"
                            | "options"
                    ),
                    _ => false,
                };
                if name_follows {
                    return Some(Restriction::Temp);
                }
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::refuse_unpreparable;
    use super::restriction_in;
    use super::Restriction;
    use super::Restriction::*;
    use crate::branch::BranchError;

    /// A handler's future holds `&PgBranch` across awaits and must be
    /// `Send`: the refusal the branch keeps is `Send + Sync`.
    #[test]
    fn the_kept_refusal_can_cross_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<std::sync::Mutex<Option<BranchError>>>();
    }

    fn check(cases: &[(&str, Option<Restriction>)]) {
        for (sql, want) in cases {
            assert_eq!(restriction_in(sql), *want, "{sql}");
        }
    }

    #[test]
    fn notify_listen_and_unlisten_statements_are_refused() {
        check(&[
            ("NOTIFY orders", Some(Notify)),
            ("notify orders, 'paid'", Some(Notify)),
            ("  /* first */ -- then\n Notify orders", Some(Notify)),
            ("LISTEN orders", Some(Listen)),
            ("UNLISTEN *", Some(Unlisten)),
            ("SELECT pg_notify('orders', 'paid')", Some(Notify)),
            ("SELECT pg_catalog.pg_notify ('orders', $1)", Some(Notify)),
            ("SELECT \"pg_notify\"('orders', 'x')", Some(Notify)),
            ("SELECT pg_export_snapshot()", Some(ExportSnapshot)),
            // Any statement of a batch.
            ("UPDATE a SET x = 1; NOTIFY orders", Some(Notify)),
            ("UPDATE a SET x = 1;LISTEN x;", Some(Listen)),
        ]);
    }

    #[test]
    fn temporary_objects_and_held_cursors_are_refused() {
        check(&[
            ("CREATE TEMP TABLE scratch (x int)", Some(Temp)),
            ("create temporary table scratch (x int) on commit drop", Some(Temp)),
            ("CREATE LOCAL TEMP TABLE s AS SELECT 1", Some(Temp)),
            ("CREATE GLOBAL TEMPORARY TABLE s (x int)", Some(Temp)),
            ("CREATE OR REPLACE TEMP VIEW v AS SELECT 1", Some(Temp)),
            ("CREATE TEMP SEQUENCE s", Some(Temp)),
            ("CREATE TABLE pg_temp.scratch (x int)", Some(Temp)),
            ("INSERT INTO pg_temp.scratch VALUES (1)", Some(Temp)),
            ("SELECT * INTO TEMP scratch FROM accounts", Some(Temp)),
            ("SELECT id INTO TEMPORARY TABLE scratch FROM accounts", Some(Temp)),
            ("SELECT id INTO LOCAL TEMP \"Scratch\" FROM accounts", Some(Temp)),
            ("DECLARE c CURSOR WITH HOLD FOR SELECT 1", Some(Hold)),
            ("declare c binary no scroll cursor with hold for select 1", Some(Hold)),
        ]);
    }

    #[test]
    fn literals_comments_and_identifiers_do_not_trip_it() {
        check(&[
            ("SELECT 'NOTIFY x; LISTEN y'", None),
            ("SELECT E'it\\'s; NOTIFY x'", None),
            ("SELECT 'it''s; NOTIFY x'", None),
            ("SELECT $$; NOTIFY x; CREATE TEMP TABLE t (x int)$$", None),
            ("SELECT $body$ pg_notify('a', 'b') $body$, $1", None),
            ("-- NOTIFY x\nSELECT 1", None),
            ("/* outer /* NOTIFY x */ CREATE TEMP TABLE t */ SELECT 1", None),
            ("SELECT \"NOTIFY\" FROM t", None),
            ("SELECT notify, listen FROM events", None),
            ("UPDATE events SET notify = true WHERE listen", None),
            // A column, table or schema called temp.
            ("CREATE TABLE readings (temp numeric, temporary int)", None),
            ("SELECT temp FROM readings", None),
            ("INSERT INTO temp VALUES (1)", None),
            ("INSERT INTO temp (x) SELECT 1", None),
            (
                "MERGE INTO temp t USING s ON t.id = s.id WHEN MATCHED THEN DELETE",
                None,
            ),
            ("SELECT x INTO temp FROM readings", None),
            ("SELECT temp.x FROM temp", None),
            ("SELECT pg_temp FROM t", None),
            ("CREATE INDEX ON readings (temp)", None),
            // Not called: a column named like the functions.
            ("SELECT pg_notify FROM t", None),
            ("SELECT 'pg_notify('", None),
            // Cursors without HOLD.
            ("DECLARE c CURSOR FOR SELECT * FROM t WITH hold", None),
            ("DECLARE c CURSOR WITHOUT HOLD FOR SELECT 1", None),
            ("WITH hold AS (SELECT 1) SELECT * FROM hold", None),
            // An unterminated literal or comment hides the rest.
            ("SELECT 'NOTIFY x", None),
            ("SELECT 1 /* NOTIFY x", None),
            ("", None),
        ]);
    }

    #[test]
    fn the_refusal_names_the_restriction_why_and_what_instead() {
        let e = refuse_unpreparable("NOTIFY orders").unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, BranchError::Unpreparable { .. }), "{e:?}");
        assert!(text.starts_with("NOTIFY"), "{text}");
        assert!(text.contains("PREPARE TRANSACTION refuses"), "{text}");
        assert!(text.contains("outbox"), "{text}");
        let status = tonic::Status::from(e);
        assert_eq!(status.code(), tonic::Code::FailedPrecondition);
        let e = refuse_unpreparable("CREATE TEMP TABLE t (x int)").unwrap_err();
        assert!(e.to_string().contains("temporary"), "{e}");
        let e = refuse_unpreparable("DECLARE c CURSOR WITH HOLD FOR SELECT 1").unwrap_err();
        assert!(e.to_string().contains("WITH HOLD"), "{e}");
        assert!(refuse_unpreparable("SELECT 1").is_ok());
    }
}
