//! The bank on PostgreSQL: the same accounts, payloads and answers as the
//! sled bank ([`crate::Bank`]), with the balances in a PostgreSQL table and
//! the SDK's PostgreSQL participant (`participant_sdk::postgres`) in place
//! of the participant store. It is the migration of the example from a
//! `Resource` to a `PgHandler`:
//!
//! | sled bank (`Resource`) | PostgreSQL bank (`PgHandler`) |
//! |---|---|
//! | `prepare` stages `lock/<acct>` and `pending/<txid>` with the YES vote | `prepare` locks the account rows (`FOR UPDATE NOWAIT`) and updates them in the open transaction; `PREPARE TRANSACTION` keeps the change and its row locks until the decision |
//! | `commit` applies the pending deltas and frees the locks | nothing to write: `COMMIT PREPARED` makes the update visible and frees the rows |
//! | `abort` frees the locks | nothing to write: `ROLLBACK PREPARED` |
//! | a locked account votes NO | a row held by another transaction votes NO (`NOWAIT`), never waits: waiting on a prepared transaction's row can deadlock across databases |
//! | `ParticipantStore::open(dir, Bank)` | `PgParticipant::connect(PgOptions::new(id, conn), PgBank)` |
//!
//! The server, recovery and the payload format do not change: both serve
//! `participant_sdk::server::ParticipantServer` over the `Participant`
//! trait.
//!
//! The apply log: `prepare` also inserts `(txid, 'COMMIT')` into the
//! `applied` table inside the transaction it prepares, so the row becomes
//! visible exactly when that transaction commits (`COMMIT PREPARED`, or the
//! one-phase commit) and never when it is rolled back. It is what the
//! sled bank's `applied/<txid>` keys are to the jepsen checkers (see
//! [`apply_log`]); an ABORT leaves no row (a rolled-back transaction leaves
//! nothing). The table has no unique key on purpose: a transaction applied
//! twice shows as two rows instead of being refused by the database.

use participant_sdk::participant::Verdict;
use participant_sdk::postgres::HandlerError;
use participant_sdk::postgres::PgHandler;
use participant_sdk::postgres::Transaction;
use participant_sdk::GlobalTxid;
use tokio_postgres::error::SqlState;

use crate::parse_work;

/// The bank's handler on PostgreSQL.
pub struct PgBank;

/// The accounts table.
pub const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS accounts (
    name text PRIMARY KEY,
    balance bigint NOT NULL CHECK (balance >= 0))";

/// The apply log: one row per committed transaction (see the module doc).
pub const APPLIED_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS applied (
    txid bigint NOT NULL,
    outcome text NOT NULL)";

impl PgHandler for PgBank {
    async fn prepare(&self, tx: &Transaction<'_>, txid: GlobalTxid, payload: &[u8]) -> Result<Verdict, HandlerError> {
        let Some(work) = parse_work(payload) else {
            return Ok(Verdict::no(format!(
                "payload is not a list of account:change items separated by ';' ({} bytes)",
                payload.len()
            )));
        };
        if crate::reads_only(&work) {
            // Changes nothing: a read of the accounts, no phase two.
            let read = tx.prepare_cached("SELECT 1 FROM accounts WHERE name = $1").await?;
            for (acct, _) in &work {
                if tx.query_opt(&read, &[acct]).await?.is_none() {
                    return Ok(Verdict::no(format!("no account {acct:?} here")));
                }
            }
            return Ok(Verdict::read_only());
        }
        // Parsed once per pooled connection, not on every Prepare.
        let lock = tx
            .prepare_cached("SELECT balance FROM accounts WHERE name = $1 FOR UPDATE NOWAIT")
            .await?;
        let update = tx
            .prepare_cached("UPDATE accounts SET balance = balance + $2 WHERE name = $1")
            .await?;
        for (acct, delta) in &work {
            let row = tx.query_opt(&lock, &[acct]).await;
            let balance: i64 = match row {
                Ok(Some(r)) => r.get(0),
                Ok(None) => return Ok(Verdict::no(format!("no account {acct:?} here"))),
                Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                    return Ok(Verdict::no(format!(
                        "account {acct:?} is locked by another transfer in progress"
                    )))
                }
                Err(e) => return Err(e.into()),
            };
            if balance + delta < 0 {
                return Ok(Verdict::no(format!(
                    "account {acct:?} has {balance}, too little for a change of {delta}"
                )));
            }
            tx.execute(&update, &[acct, delta]).await?;
        }
        // Visible when (and only when) this transaction commits.
        let applied = tx
            .prepare_cached("INSERT INTO applied (txid, outcome) VALUES ($1, 'COMMIT')")
            .await?;
        // The txid alone: the table predates incarnations, and a service
        // serves one cluster at a time (the gid and the participant log
        // keep the incarnation).
        tx.execute(&applied, &[&(txid.txid as i64)]).await?;
        Ok(Verdict::yes())
    }
}

/// Creates the accounts table with `accounts` accounts `<prefix>0..` of
/// `initial` each, in one transaction, when the table does not exist yet;
/// touches nothing otherwise (a restarted service must not wait on the row
/// locks of its own prepared transactions, which only its recovery
/// resolves). Creates the `applied` table when it is missing (also beside
/// an accounts table made by someone else).
pub async fn install(
    db: &mut tokio_postgres::Client,
    prefix: &str,
    accounts: usize,
    initial: i64,
) -> Result<(), tokio_postgres::Error> {
    let applied: bool = db
        .query_one("SELECT to_regclass('applied') IS NOT NULL", &[])
        .await?
        .get(0);
    if !applied {
        db.batch_execute(APPLIED_SCHEMA).await?;
    }
    let exists: bool = db
        .query_one("SELECT to_regclass('accounts') IS NOT NULL", &[])
        .await?
        .get(0);
    if exists {
        return Ok(());
    }
    let tx = db.transaction().await?;
    tx.batch_execute(SCHEMA).await?;
    for i in 0..accounts {
        tx.execute(
            "INSERT INTO accounts (name, balance) VALUES ($1, $2)",
            &[&format!("{prefix}{i}"), &initial],
        )
        .await?;
    }
    tx.commit().await
}

/// The sum and count of every balance.
pub async fn audit(db: &tokio_postgres::Client) -> Result<(i64, i64), tokio_postgres::Error> {
    let r = db
        .query_one("SELECT COALESCE(sum(balance), 0)::bigint, count(*) FROM accounts", &[])
        .await?;
    Ok((r.get(0), r.get(1)))
}

/// Every account's balance, by name.
pub async fn balances(
    db: &tokio_postgres::Client,
) -> Result<std::collections::BTreeMap<String, i64>, tokio_postgres::Error> {
    let rows = db
        .query("SELECT name, balance FROM accounts ORDER BY name", &[])
        .await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// The apply log: (txid, outcome) of every committed transaction, in txid
/// order (a txid applied twice shows twice). Empty when the table is
/// missing (a database made before the apply log existed).
pub async fn apply_log(db: &tokio_postgres::Client) -> Result<Vec<(u64, String)>, tokio_postgres::Error> {
    let exists: bool = db
        .query_one("SELECT to_regclass('applied') IS NOT NULL", &[])
        .await?
        .get(0);
    if !exists {
        return Ok(Vec::new());
    }
    let rows = db.query("SELECT txid, outcome FROM applied ORDER BY txid", &[]).await?;
    Ok(rows.iter().map(|r| (r.get::<_, i64>(0) as u64, r.get(1))).collect())
}

/// The transactions of this database PostgreSQL holds prepared with a dtx
/// gid (`dtx:v1:<participant>:<txid>:<term>`, or `dtx:v2:<participant>:
/// <incarnation>:<txid>:<term>` for a txid of a cluster incarnation):
/// (participant, txid, term), in txid order. Each is prepared and undecided
/// at this participant.
pub async fn prepared(db: &tokio_postgres::Client) -> Result<Vec<(String, u64, u64)>, tokio_postgres::Error> {
    let rows = db
        .query(
            "SELECT gid FROM pg_prepared_xacts
             WHERE database = current_database() AND (starts_with(gid, 'dtx:v1:') OR starts_with(gid, 'dtx:v2:'))",
            &[],
        )
        .await?;
    let mut out: Vec<(String, u64, u64)> = rows
        .iter()
        .filter_map(|r| {
            let gid: String = r.get(0);
            let (rest, fields) = match gid.strip_prefix("dtx:v1:") {
                Some(rest) => (rest, 3),
                None => (gid.strip_prefix("dtx:v2:")?, 4),
            };
            let mut parts = rest.rsplitn(fields, ':');
            let term = parts.next()?.parse().ok()?;
            let txid = parts.next()?.parse().ok()?;
            if fields == 4 {
                parts.next()?; // the incarnation
            }
            let participant = parts.next()?.to_string();
            Some((participant, txid, term))
        })
        .collect();
    out.sort_by_key(|(_, t, _)| *t);
    Ok(out)
}
