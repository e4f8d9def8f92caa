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
//! let verdict = my_sql(branch.tx(), &input).await?;   // the handler's work
//! let joined = branch.join(verdict, &cluster, &who).await?;
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
//! - what PostgreSQL cannot prepare (SQLSTATE 0A000: a temporary table,
//!   LISTEN/NOTIFY, a cursor WITH HOLD, an exported snapshot) and a server
//!   with no free prepared-transaction slot are a NO, registered with the
//!   reason naming the restriction, before anything is held;
//! - the gid's term is the incarnation's term floor (a branch prepares
//!   before any leader has sent it anything).

use deadpool_postgres::Object;

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

    /// Removes the mark of `txid`'s branch.
    pub(super) async fn drop_mark(&self, txid: GlobalTxid) -> Result<(), StoreError> {
        let c = self.conn().await?;
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
    /// The branch's open PostgreSQL transaction: run the handler's SQL in
    /// it; do not commit or roll it back.
    pub fn tx(&self) -> &Transaction<'c> {
        &self.tx
    }

    /// The transaction this branch works for.
    pub fn txid(&self) -> GlobalTxid {
        self.txid
    }

    /// Ends the handler's work with its `verdict`: YES prepares it
    /// (`PREPARE TRANSACTION`) and registers the branch with the cluster
    /// through `cluster`; NO and READ_ONLY roll it back and register that
    /// vote. Returns once the cluster has the vote; each other way it can
    /// end is a [`BranchError`] (`RolledBack`: nothing of it can commit;
    /// `Unknown`: the work stays prepared, recovery settles it).
    pub async fn join(self, verdict: Verdict, cluster: &Client, who: &BranchIdentity) -> Result<Joined, BranchError> {
        let PgBranch {
            participant: p,
            tx,
            txid,
            running,
        } = self;
        let _serial = p.locks.lock(txid).await;
        let side = p.conn().await?;
        let term = p.floor(&side, txid.incarnation).await?;
        let mut verdict = verdict;
        let mut held = false;
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
                        p.drop_mark(txid).await?;
                        return Err(pg_err("PREPARE TRANSACTION", &e).into());
                    };
                    p.drop_mark(txid).await?;
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
                    p.drop_mark(txid).await?;
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
