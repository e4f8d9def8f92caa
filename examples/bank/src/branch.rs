//! The bank's own API, `bank.v1.Bank` (proto/bank/v1/bank.proto): a
//! caller changes balances inside its transaction and gets the new
//! balances back; the bank joins the transaction from the request handler,
//! as a branch (docs/protocol.md, "Branches"), so the coordinator sends it
//! no Prepare at commit time.
//!
//! `bank-serve --app-listen ADDR` serves it beside the participant
//! service (which the cluster calls for the decision), on the own store
//! or on PostgreSQL (`--postgres`: the change is SQL in the branch's
//! PostgreSQL transaction, ended by `PREPARE TRANSACTION`).

use std::sync::Arc;

use dtx_client::Client;
use participant_sdk::branch::BranchError;
use participant_sdk::branch::BranchIdentity;
use participant_sdk::branch::Joined;
use participant_sdk::log::Vote;
use participant_sdk::postgres::PgHandler;
use participant_sdk::postgres::PgParticipant;
use participant_sdk::store::ParticipantStore;
use participant_sdk::store::StoreError;
use tonic::Request;
use tonic::Response;
use tonic::Status;

use crate::pg::PgBank;
use crate::Bank;

/// The generated code of `bank.v1`.
pub mod pb {
    tonic::include_proto!("bank.v1");
}

/// Most changes one call may carry.
pub const CHANGES_PER_CALL_MAX: usize = 64;

/// Where a bank keeps its accounts.
pub enum Accounts {
    /// The participant's own store (`bank-serve --data-dir`).
    Store(Arc<ParticipantStore<Bank>>),
    /// PostgreSQL (`bank-serve --postgres`): the change runs as SQL in
    /// the branch's PostgreSQL transaction, prepared with `PREPARE
    /// TRANSACTION`.
    Postgres(Arc<PgParticipant<PgBank>>),
}

/// The `bank.v1.Bank` service over a bank's accounts.
pub struct BankApi {
    accounts: Accounts,
    cluster: Arc<Client>,
    who: BranchIdentity,
}

impl BankApi {
    /// The API of the bank on `accounts`, which is participant `who` and
    /// registers through `cluster`.
    pub fn new(accounts: Accounts, cluster: Arc<Client>, who: BranchIdentity) -> BankApi {
        BankApi { accounts, cluster, who }
    }

    /// The change on the own store: the resource's prepare, then the
    /// balances the change leaves (the accounts are held by the
    /// transaction until its decision, so they are exact).
    async fn on_store(
        &self,
        store: &ParticipantStore<Bank>,
        txid: participant_sdk::GlobalTxid,
        changes: &[pb::AccountChange],
        work: &[u8],
    ) -> Result<(Joined, Vec<pb::AccountBalance>), BranchError> {
        let joined = participant_sdk::branch::join(store, &self.cluster, &self.who, txid, work).await?;
        let view = store.view();
        let balances = changes
            .iter()
            .map(|c| pb::AccountBalance {
                account: c.account.clone(),
                balance_if_committed: crate::balance(&view, &c.account).unwrap_or(0) + c.delta,
            })
            .collect();
        Ok((joined, balances))
    }

    /// The change on PostgreSQL: the bank's SQL in the branch's
    /// transaction, the balances read in it (after the change), then
    /// PREPARE TRANSACTION and the registration.
    async fn on_postgres(
        &self,
        pg: &PgParticipant<PgBank>,
        txid: participant_sdk::GlobalTxid,
        changes: &[pb::AccountChange],
        work: &[u8],
    ) -> Result<(Joined, Vec<pb::AccountBalance>), BranchError> {
        let mut conn = pg.branch_connection().await?;
        let branch = pg.begin_branch(&mut conn, txid).await?;
        let failed = |e: &dyn std::fmt::Display| StoreError::Io(format!("the bank's SQL failed: {e}"));
        let verdict = PgBank.prepare(branch.tx(), txid, work).await.map_err(|e| failed(&e))?;
        let mut balances = Vec::new();
        if verdict.vote == Vote::Yes {
            let read = branch
                .tx()
                .prepare_cached("SELECT balance FROM accounts WHERE name = $1")
                .await
                .map_err(|e| failed(&e))?;
            for c in changes {
                let row = branch
                    .tx()
                    .query_one(&read, &[&c.account])
                    .await
                    .map_err(|e| failed(&e))?;
                balances.push(pb::AccountBalance {
                    account: c.account.clone(),
                    balance_if_committed: row.get(0),
                });
            }
        }
        let joined = branch.join(verdict, &self.cluster, &self.who).await?;
        Ok((joined, balances))
    }
}

/// The changes as the bank's prepared-work payload (`account:delta` items
/// separated by `;`, what `Bank::prepare` reads), or what is wrong with
/// them.
pub fn work_of(changes: &[pb::AccountChange]) -> Result<Vec<u8>, String> {
    if changes.is_empty() {
        return Err("no changes: give at least one account and delta".into());
    }
    if changes.len() > CHANGES_PER_CALL_MAX {
        return Err(format!(
            "{} changes in one call; at most {CHANGES_PER_CALL_MAX}",
            changes.len()
        ));
    }
    let mut seen = std::collections::BTreeSet::new();
    let mut out = String::new();
    for c in changes {
        let ok_name = !c.account.is_empty()
            && c.account.len() <= 64
            && c.account
                .chars()
                .all(|ch| ch.is_ascii_alphanumeric() || ch == '-' || ch == '_');
        if !ok_name {
            return Err(format!(
                "account name {:?}: use 1 to 64 letters, digits, '-' or '_'",
                c.account
            ));
        }
        if c.delta == 0 {
            return Err(format!("account {:?}: a change of 0 changes nothing", c.account));
        }
        if !seen.insert(c.account.as_str()) {
            return Err(format!("account {:?} appears twice; give each account once", c.account));
        }
        out.push_str(&format!("{}:{};", c.account, c.delta));
    }
    Ok(out.into_bytes())
}

#[tonic::async_trait]
impl pb::bank_server::Bank for BankApi {
    async fn change(&self, req: Request<pb::ChangeRequest>) -> Result<Response<pb::ChangeReply>, Status> {
        let txid = participant_sdk::branch::transaction_of(&req).map_err(Status::from)?;
        let changes = req.into_inner().changes;
        let work = work_of(&changes).map_err(Status::invalid_argument)?;
        let (joined, balances) = match &self.accounts {
            Accounts::Store(store) => self.on_store(store, txid, &changes, &work).await,
            Accounts::Postgres(pg) => self.on_postgres(pg, txid, &changes, &work).await,
        }
        .map_err(Status::from)?;
        match joined.vote {
            Vote::Yes => {}
            // Registered as NO: the transaction aborts.
            Vote::No | Vote::ReadOnly => {
                return Err(Status::failed_precondition(format!(
                    "{} refused the change: {}",
                    self.who.participant_id, joined.reason
                )))
            }
        }
        Ok(Response::new(pb::ChangeReply { balances }))
    }

    async fn balances(&self, req: Request<pb::BalancesRequest>) -> Result<Response<pb::BalancesReply>, Status> {
        let accounts = req.into_inner().accounts;
        if accounts.is_empty() || accounts.len() > CHANGES_PER_CALL_MAX {
            return Err(Status::invalid_argument(format!(
                "{} accounts asked; ask for 1 to {CHANGES_PER_CALL_MAX}",
                accounts.len()
            )));
        }
        let mut balances = Vec::with_capacity(accounts.len());
        for account in accounts {
            let balance = match &self.accounts {
                Accounts::Store(store) => crate::balance(&store.view(), &account),
                Accounts::Postgres(pg) => {
                    let conn = pg
                        .pool()
                        .get()
                        .await
                        .map_err(|e| Status::unavailable(format!("PostgreSQL: {e}")))?;
                    conn.query_opt("SELECT balance FROM accounts WHERE name = $1", &[&account])
                        .await
                        .map_err(|e| Status::unavailable(format!("PostgreSQL: {e}")))?
                        .map(|row| row.get(0))
                }
            };
            let Some(balance) = balance else {
                return Err(Status::not_found(format!(
                    "no account {account:?} at {}",
                    self.who.participant_id
                )));
            };
            balances.push(pb::CommittedBalance { account, balance });
        }
        Ok(Response::new(pb::BalancesReply { balances }))
    }
}

/// The committed balance of `account` at the bank whose API listens on
/// `addr` (`bank.v1.Bank.Balances`).
pub async fn committed_balance(addr: &str, account: &str) -> anyhow::Result<i64> {
    let api = BranchBank::new("", addr)?.api;
    let reply = pb::bank_client::BankClient::new(api)
        .balances(pb::BalancesRequest {
            accounts: vec![account.to_string()],
        })
        .await
        .map_err(|s| anyhow::anyhow!("{addr}: {:?}: {}", s.code(), s.message()))?;
    reply
        .into_inner()
        .balances
        .first()
        .map(|b| b.balance)
        .ok_or_else(|| anyhow::anyhow!("{addr} answered no balance for {account:?}"))
}

/// A bank as a caller of [`transfer_as_branches`] reaches it: its account
/// prefix and its `bank.v1.Bank` API.
#[derive(Clone, Debug)]
pub struct BranchBank {
    pub prefix: String,
    pub api: tonic::transport::Channel,
}

impl BranchBank {
    /// The bank with accounts `prefix..` whose API listens on `addr`
    /// (connected at the first call).
    pub fn new(prefix: &str, addr: &str) -> anyhow::Result<BranchBank> {
        let api = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
            .connect_timeout(std::time::Duration::from_millis(500))
            .connect_lazy();
        Ok(BranchBank {
            prefix: prefix.to_string(),
            api,
        })
    }
}

/// One transfer of a random amount between random accounts of two of
/// `banks`, as branches: `begin` under `key`, then `Change` at both banks
/// at once with the txid (each prepares and registers with its vote),
/// then `commit` when both answered, `abort` otherwise. The txid if one
/// is known and the outcome: a commit or abort without a definite answer
/// is UNKNOWN, never a failure.
pub async fn transfer_as_branches(
    client: &Client,
    key: &str,
    banks: &[BranchBank],
    accounts: usize,
) -> (Option<u64>, Result<dtx_client::TxOutcome, dtx_client::ClientError>) {
    let crate::Pick {
        from,
        to,
        amount,
        fa,
        ta,
    } = crate::Pick::random(banks.len(), accounts);
    let began = match client.begin(key, 10_000, b"transfer").await {
        Ok(b) => b,
        Err(e) => return (None, Err(e)),
    };
    let change = |bank: &BranchBank, account: String, delta: i64| {
        let mut api = pb::bank_client::BankClient::new(bank.api.clone());
        let mut req = Request::new(pb::ChangeRequest {
            changes: vec![pb::AccountChange { account, delta }],
        });
        dtx_proto::attach_txid(&mut req, began.txid);
        dtx_proto::attach_incarnation(&mut req, began.incarnation);
        async move { api.change(req).await }
    };
    let (debit, credit) = tokio::join!(
        change(&banks[from], format!("{}{fa}", banks[from].prefix), -amount),
        change(&banks[to], format!("{}{ta}", banks[to].prefix), amount),
    );
    let outcome = match (debit, credit) {
        (Ok(_), Ok(_)) => client.commit(began.txid).await,
        (Err(s), _) | (_, Err(s)) => client.abort(began.txid, s.message()).await,
    };
    (Some(began.txid), outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ch(account: &str, delta: i64) -> pb::AccountChange {
        pb::AccountChange {
            account: account.into(),
            delta,
        }
    }

    #[test]
    fn changes_become_the_prepared_work_and_bad_ones_say_what_is_wrong() {
        assert_eq!(work_of(&[ch("a1", -5), ch("a2", 5)]).unwrap(), b"a1:-5;a2:5;".to_vec());
        assert_eq!(
            crate::parse_work(&work_of(&[ch("a1", -5)]).unwrap()),
            Some(vec![("a1".to_string(), -5)])
        );
        let cases: [(&[pb::AccountChange], &str); 5] = [
            (&[], "no changes"),
            (&[ch("a;1", 1)], "account name"),
            (&[ch("", 1)], "account name"),
            (&[ch("a1", 0)], "changes nothing"),
            (&[ch("a1", 1), ch("a1", 2)], "appears twice"),
        ];
        for (changes, want) in cases {
            let err = work_of(changes).unwrap_err();
            assert!(err.contains(want), "{changes:?}: {err}");
        }
        let many: Vec<_> = (0..=CHANGES_PER_CALL_MAX).map(|i| ch(&format!("a{i}"), 1)).collect();
        assert!(work_of(&many).unwrap_err().contains("at most"));
    }
}
