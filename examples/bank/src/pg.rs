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

use participant_sdk::participant::Verdict;
use participant_sdk::postgres::HandlerError;
use participant_sdk::postgres::PgHandler;
use tokio_postgres::error::SqlState;

use crate::parse_work;

/// The bank's handler on PostgreSQL.
pub struct PgBank;

/// The accounts table.
pub const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS accounts (
    name text PRIMARY KEY,
    balance bigint NOT NULL CHECK (balance >= 0))";

impl PgHandler for PgBank {
    async fn prepare(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        _txid: u64,
        payload: &[u8],
    ) -> Result<Verdict, HandlerError> {
        let Some(work) = parse_work(payload) else {
            return Ok(Verdict::no(format!(
                "payload is not a list of account:change items separated by ';' ({} bytes)",
                payload.len()
            )));
        };
        for (acct, delta) in &work {
            let row = tx
                .query_opt(
                    "SELECT balance FROM accounts WHERE name = $1 FOR UPDATE NOWAIT",
                    &[acct],
                )
                .await;
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
            tx.execute(
                "UPDATE accounts SET balance = balance + $2 WHERE name = $1",
                &[acct, delta],
            )
            .await?;
        }
        Ok(Verdict::yes())
    }
}

/// Creates the accounts table with `accounts` accounts `<prefix>0..` of
/// `initial` each, in one transaction, when the table does not exist yet;
/// touches nothing otherwise (a restarted service must not wait on the row
/// locks of its own prepared transactions, which only its recovery
/// resolves).
pub async fn install(
    db: &mut tokio_postgres::Client,
    prefix: &str,
    accounts: usize,
    initial: i64,
) -> Result<(), tokio_postgres::Error> {
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
