//! The example bank: each participant service holds some accounts in its
//! participant store. A transfer debits an account at one service and
//! credits one at another, under two-phase commit.
//!
//! Accounts touched by a prepared transaction stay locked until the
//! decision; a Prepare that finds a locked account (or too little money)
//! votes NO, so conflicting transfers abort instead of waiting: no
//! distributed deadlock.
//!
//! Payload of a participant's work: `account:delta` items separated by `;`,
//! e.g. `a3:-25`.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use dtx_client::Client;
use dtx_client::ClientError;
use dtx_client::ParticipantSpec;
use dtx_client::TxOutcome;
use participant_sdk::log::Vote;
use participant_sdk::store::ParticipantStore;
use participant_sdk::store::Resource;
use participant_sdk::store::Staged;
use participant_sdk::store::View;
use participant_sdk::GlobalTxid;
use rand::Rng;

pub mod branch;
pub mod pg;

pub struct Bank;

fn acct_key(name: &str) -> Vec<u8> {
    format!("acct/{name}").into_bytes()
}

fn lock_key(name: &str) -> Vec<u8> {
    format!("lock/{name}").into_bytes()
}

/// The apply log: `applog/<txid, 20 digits>/<n>` (incarnation 0) or
/// `applog/<txid, 20 digits>@<incarnation, 16 hex digits>/<n>` -> "COMMIT"
/// or "ABORT", one key per time a decision was applied to the
/// transaction's work (written in the same atomic batch as the work), so a
/// second apply of the same transaction would show as a second key
/// (checked by jepsen-tests), and the same txid of two incarnations is two
/// transactions.
fn applog_prefix(txid: GlobalTxid) -> Vec<u8> {
    if txid.incarnation == 0 {
        format!("applog/{:020}/", txid.txid).into_bytes()
    } else {
        format!("applog/{:020}@{:016x}/", txid.txid, txid.incarnation).into_bytes()
    }
}

fn log_apply(view: &View<'_>, txid: GlobalTxid, outcome: &str, staged: &mut Staged) {
    let n = view.scan(&applog_prefix(txid)).map(|v| v.len()).unwrap_or(0);
    let mut key = applog_prefix(txid);
    key.extend_from_slice(n.to_string().as_bytes());
    staged.put(&key, outcome.as_bytes());
}

/// Every applied decision in the apply log: (txid, "COMMIT" | "ABORT"), in
/// txid order, one item per apply. The txid without its incarnation: a
/// service serves one cluster at a time ([`apply_log_in`] tells them
/// apart).
pub fn apply_log(store: &ParticipantStore<Bank>) -> anyhow::Result<Vec<(u64, String)>> {
    Ok(apply_log_in(store)?
        .into_iter()
        .map(|(t, outcome)| (t.txid, outcome))
        .collect())
}

/// [`apply_log`] with each transaction's incarnation.
pub fn apply_log_in(store: &ParticipantStore<Bank>) -> anyhow::Result<Vec<(GlobalTxid, String)>> {
    let mut out = Vec::new();
    for (k, v) in store.view().scan(b"applog/")? {
        let k = String::from_utf8_lossy(&k).to_string();
        let txid = k
            .split('/')
            .nth(1)
            .and_then(|t| match t.split_once('@') {
                None => Some(GlobalTxid::new(0, t.parse().ok()?)),
                Some((t, inc)) => Some(GlobalTxid::new(u64::from_str_radix(inc, 16).ok()?, t.parse().ok()?)),
            })
            .ok_or_else(|| anyhow::anyhow!("bad apply log key {k:?}"))?;
        out.push((txid, String::from_utf8_lossy(&v).to_string()));
    }
    Ok(out)
}

/// Every account and its balance.
pub fn balances(store: &ParticipantStore<Bank>) -> anyhow::Result<Vec<(String, i64)>> {
    let mut out = Vec::new();
    for (k, v) in store.view().scan(b"acct/")? {
        let name = String::from_utf8_lossy(&k["acct/".len()..]).to_string();
        let bal = i64::from_be_bytes(v.try_into().map_err(|_| anyhow::anyhow!("bad balance of {name}"))?);
        out.push((name, bal));
    }
    Ok(out)
}

fn pending_key(txid: GlobalTxid) -> Vec<u8> {
    format!("pending/{txid}").into_bytes()
}

pub fn parse_work(payload: &[u8]) -> Option<Vec<(String, i64)>> {
    let s = std::str::from_utf8(payload).ok()?;
    s.split(';')
        .filter(|p| !p.is_empty())
        .map(|item| {
            let (a, d) = item.split_once(':')?;
            Some((a.to_string(), d.parse().ok()?))
        })
        .collect()
}

/// True when `work` changes no balance (every change 0): the bank votes
/// READ_ONLY on it (the accounts must exist), so it takes no part in phase
/// two.
pub fn reads_only(work: &[(String, i64)]) -> bool {
    !work.is_empty() && work.iter().all(|(_, d)| *d == 0)
}

/// The work `txid` prepared here (empty if none).
fn pending_work(view: &View<'_>, txid: GlobalTxid) -> Vec<(String, i64)> {
    view.get(&pending_key(txid))
        .ok()
        .flatten()
        .and_then(|p| parse_work(&p))
        .unwrap_or_default()
}

fn balance(view: &View<'_>, name: &str) -> Option<i64> {
    view.get(&acct_key(name))
        .ok()
        .flatten()
        .and_then(|v| v.try_into().ok().map(i64::from_be_bytes))
}

impl Resource for Bank {
    fn prepare(&self, view: &View<'_>, txid: GlobalTxid, payload: &[u8], staged: &mut Staged) -> Vote {
        let Some(work) = parse_work(payload) else {
            return staged.refuse(format!(
                "payload is not a list of account:change items separated by ';' ({} bytes)",
                payload.len()
            ));
        };
        if reads_only(&work) {
            // Changes nothing: a read of the accounts, no phase two.
            if let Some((acct, _)) = work.iter().find(|(a, _)| balance(view, a).is_none()) {
                return staged.refuse(format!("no account {acct:?} here"));
            }
            return Vote::ReadOnly;
        }
        for (acct, delta) in &work {
            let Some(bal) = balance(view, acct) else {
                return staged.refuse(format!("no account {acct:?} here"));
            };
            if let Ok(Some(holder)) = view.get(&lock_key(acct)) {
                if holder != txid.key_bytes() {
                    let by = <[u8; 8]>::try_from(holder.as_slice()).map(u64::from_be_bytes);
                    return staged.refuse(match by {
                        Ok(other) => format!("account {acct:?} is locked by prepared transaction {other}"),
                        Err(_) => format!("account {acct:?} is locked by another prepared transaction"),
                    });
                }
            }
            if bal + delta < 0 {
                return staged.refuse(format!(
                    "account {acct:?} has {bal}, too little for a change of {delta}"
                ));
            }
            staged.put(&lock_key(acct), &txid.key_bytes());
        }
        staged.put(&pending_key(txid), payload);
        Vote::Yes
    }

    fn commit(&self, view: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
        for (acct, delta) in pending_work(view, txid) {
            let bal = balance(view, &acct).unwrap_or(0);
            staged.put(&acct_key(&acct), &(bal + delta).to_be_bytes());
            staged.delete(&lock_key(&acct));
        }
        staged.delete(&pending_key(txid));
        log_apply(view, txid, "COMMIT", staged);
    }

    fn abort(&self, view: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
        for (acct, _) in pending_work(view, txid) {
            if view.get(&lock_key(&acct)).ok().flatten().as_deref() == Some(&txid.key_bytes()[..]) {
                staged.delete(&lock_key(&acct));
            }
        }
        staged.delete(&pending_key(txid));
        log_apply(view, txid, "ABORT", staged);
    }
}

/// Opens a bank's store, creating `accounts` accounts with `initial` each
/// the first time (one durable write).
pub async fn open_bank(
    dir: &Path,
    prefix: &str,
    accounts: usize,
    initial: i64,
) -> anyhow::Result<Arc<ParticipantStore<Bank>>> {
    std::fs::create_dir_all(dir)?;
    let store = ParticipantStore::open(dir, Bank).with_context(|| format!("bank store {}", dir.display()))?;
    if store.view().scan(b"acct/")?.is_empty() {
        store
            .write_data(|_, staged| {
                for i in 0..accounts {
                    staged.put(&acct_key(&format!("{prefix}{i}")), &initial.to_be_bytes());
                }
            })
            .await?;
    }
    Ok(store)
}

/// Sum and count of every balance, and the accounts still locked.
pub fn audit(store: &ParticipantStore<Bank>) -> anyhow::Result<(i64, usize, usize)> {
    let view = store.view();
    let mut total = 0;
    let mut n = 0;
    for (_, v) in view.scan(b"acct/")? {
        total += i64::from_be_bytes(v.try_into().map_err(|_| anyhow::anyhow!("bad balance"))?);
        n += 1;
    }
    let locked = view.scan(b"lock/")?.len();
    Ok((total, n, locked))
}

#[derive(clap::Args, Debug)]
pub struct BankServeArgs {
    /// Participant id (as enlisted), e.g. bank-a.
    #[arg(long)]
    pub id: String,
    /// Account name prefix, e.g. a (accounts a0, a1, ...).
    #[arg(long)]
    pub prefix: String,
    #[arg(long)]
    pub listen: String,
    /// The participant store's directory (the sled bank).
    #[arg(long, required_unless_present = "postgres")]
    pub data_dir: Option<std::path::PathBuf>,
    /// Keep the accounts in this PostgreSQL database instead (a
    /// tokio-postgres connection string: `host=.. port=.. user=..
    /// dbname=..`); see the `pg` module.
    #[arg(long, conflicts_with = "data_dir")]
    pub postgres: Option<String>,
    /// With --postgres: the PostgreSQL participant's pool and handler
    /// limits.
    #[command(flatten)]
    pub pg: participant_sdk::postgres::PgTuningArgs,
    /// Coordinator API addresses, comma-separated (for recovery).
    #[arg(long, value_delimiter = ',')]
    pub cluster: Vec<String>,
    #[arg(long, default_value_t = 10)]
    pub accounts: usize,
    #[arg(long, default_value_t = 1000)]
    pub initial: i64,
    /// Serve Prometheus metrics over HTTP on this address (every path
    /// answers the text, e.g. `http://IP:PORT/metrics`): the participant's
    /// in-doubt gauges, recovery look-ups and the rest of
    /// `participant_sdk::metrics::METRICS`.
    #[arg(long)]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Serve the bank's own API (`bank.v1.Bank`, branch::BankApi) on this
    /// address: callers change balances inside their transactions and the
    /// bank joins them from its handler, as a branch.
    #[arg(long)]
    pub app_listen: Option<String>,
    #[command(flatten)]
    pub tls: dtx_tls::args::TlsArgs,
}

/// `dtx-dev bank-serve`: one bank participant service until SIGTERM.
///
/// If its store stops (a write failed: the disk is full, say), the service
/// stops too and returns the store's message (the process exits non-zero
/// with it), so a supervisor starts it again: the store does not write
/// again without being reopened, and a start reopens it on what is on disk,
/// which holds everything acknowledged.
pub async fn serve(a: BankServeArgs, shutdown: impl std::future::Future<Output = ()>) -> anyhow::Result<()> {
    if let Some(addr) = a.metrics_addr {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()
            .with_context(|| format!("metrics listener on {addr}"))?;
        participant_sdk::metrics::describe();
    }
    // Recovery connects from the service's own address, so network rules on
    // that address (the jepsen partitions) cut it both ways.
    let mut opts = participant_sdk::server::RecoveryOptions::for_service(&a.id, &a.listen);
    opts.tls = a.tls.client().context("TLS of the calls to the cluster")?;
    opts.token = a.tls.token()?;
    let guard = participant_sdk::server::Guard {
        tls: a.tls.server().context("TLS of the participant service")?,
        node_tokens: a.tls.node_tokens()?,
    };
    let listener = tokio::net::TcpListener::bind(&a.listen)
        .await
        .with_context(|| format!("cannot listen on {}", a.listen))?;
    if let Some(conn) = &a.postgres {
        let mut db = connect_pg(conn).await?;
        pg::install(&mut db, &a.prefix, a.accounts, a.initial)
            .await
            .context("creating the accounts table")?;
        let mut pg_opts = participant_sdk::postgres::PgOptions::new(a.id.clone(), conn.clone());
        a.pg.apply(&mut pg_opts);
        let participant = participant_sdk::postgres::PgParticipant::connect(pg_opts, pg::PgBank)
            .await
            .with_context(|| format!("{}: PostgreSQL participant", a.id))?;
        tracing::info!(id = %a.id, listen = %a.listen, "bank service started on PostgreSQL");
        let participant = Arc::new(participant);
        let app = match &a.app_listen {
            Some(addr) => Some(
                serve_app(
                    &a,
                    addr,
                    branch::Accounts::Postgres(participant.clone()),
                    &opts,
                    guard.tls.clone(),
                )
                .await?,
            ),
            None => None,
        };
        let served = participant_sdk::server::serve_guarded(
            participant,
            &a.id,
            listener,
            a.cluster.clone(),
            opts,
            guard,
            shutdown,
        )
        .await;
        if let Some(app) = app {
            app.abort();
        }
        served?;
        return Ok(());
    }
    let data_dir = a.data_dir.clone().context("--data-dir or --postgres is required")?;
    let store = open_bank(&data_dir, &a.prefix, a.accounts, a.initial).await?;
    tracing::info!(id = %a.id, listen = %a.listen, data_dir = %data_dir.display(), "bank service started");
    let stop = {
        let store = store.clone();
        async move {
            tokio::select! {
                _ = shutdown => {}
                f = store.stopped() => tracing::error!("bank service stopping: {f}"),
            }
        }
    };
    let app = match &a.app_listen {
        Some(addr) => Some(
            serve_app(
                &a,
                addr,
                branch::Accounts::Store(store.clone()),
                &opts,
                guard.tls.clone(),
            )
            .await?,
        ),
        None => None,
    };
    let served =
        participant_sdk::server::serve_guarded(store.clone(), &a.id, listener, a.cluster.clone(), opts, guard, stop)
            .await;
    if let Some(app) = app {
        app.abort();
    }
    served?;
    if let Some(f) = store.failure() {
        anyhow::bail!("{f}");
    }
    store.flush().await?;
    Ok(())
}

/// Starts the bank's own API (`bank.v1.Bank`) on `addr`, registering
/// branches with the cluster through a client of the recovery settings
/// `opts` (the same TLS and token); the task serves until aborted.
async fn serve_app(
    a: &BankServeArgs,
    addr: &str,
    accounts: branch::Accounts,
    opts: &participant_sdk::server::RecoveryOptions,
    tls: Option<Arc<dtx_tls::ServerTls>>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let client = Client::new(opts.client_config(a.cluster.clone())).context("the client that registers branches")?;
    let who = participant_sdk::branch::BranchIdentity {
        participant_id: a.id.clone(),
        address: a.listen.clone(),
    };
    let api = branch::BankApi::new(accounts, Arc::new(client), who);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr} (--app-listen)"))?;
    tracing::info!(id = %a.id, app_listen = %addr, "bank API started");
    let server = tonic::transport::Server::builder()
        .layer(dtx_client::propagate::InboundTxidLayer)
        .add_service(branch::pb::bank_server::BankServer::new(api))
        .serve_with_incoming(dtx_tls::incoming(listener, tls));
    Ok(tokio::spawn(async move {
        if let Err(e) = server.await {
            tracing::error!("bank API stopped: {e}");
        }
    }))
}

/// A connection to PostgreSQL (its connection task spawned).
pub async fn connect_pg(conn: &str) -> anyhow::Result<tokio_postgres::Client> {
    participant_sdk::postgres::connect(conn)
        .await
        .with_context(|| format!("cannot connect to PostgreSQL ({conn})"))
}

/// A random transfer between two of `banks` banks: the debited bank and
/// account, the credited bank (the next one) and account, and an amount of
/// 1 to 50.
pub(crate) struct Pick {
    pub from: usize,
    pub to: usize,
    pub amount: i64,
    pub fa: usize,
    pub ta: usize,
}

impl Pick {
    pub(crate) fn random(banks: usize, accounts: usize) -> Pick {
        let mut rng = rand::rng();
        let from = rng.random_range(0..banks);
        Pick {
            from,
            to: (from + 1) % banks,
            amount: rng.random_range(1..=50i64),
            fa: rng.random_range(0..accounts),
            ta: rng.random_range(0..accounts),
        }
    }

    /// The two banks' indexes and their work as payloads (`account:delta`
    /// on each bank's account prefix, `banks` as [`transfer`] takes
    /// them): (from, to, debit, credit).
    fn payloads(&self, banks: &[(String, String, String)]) -> (usize, usize, String, String) {
        let Pick {
            from,
            to,
            amount,
            fa,
            ta,
        } = self;
        (
            *from,
            *to,
            format!("{}{fa}:-{amount}", banks[*from].2),
            format!("{}{ta}:{amount}", banks[*to].2),
        )
    }
}

/// One transfer as [`transfer`] makes it, but in the client's own steps
/// (the interactive coordinator-driven shape): `begin` under `key`, both
/// banks enlisted at once with their work as payload, then `commit` (the
/// coordinator prepares both, then decides), `abort` when an enlistment
/// was refused. The txid if one is known and the outcome: a commit or
/// abort without a definite answer is UNKNOWN, never a failure. The shape
/// a branch transfer ([`branch::transfer_as_branches`]) replaces.
pub async fn transfer_interactive(
    client: &Client,
    key: &str,
    banks: &[(String, String, String)],
    accounts: usize,
) -> (Option<u64>, Result<TxOutcome, ClientError>) {
    let (from, to, debit, credit) = Pick::random(banks.len(), accounts).payloads(banks);
    let began = match client.begin(key, 10_000, b"transfer").await {
        Ok(b) => b,
        Err(e) => return (None, Err(e)),
    };
    let enlist = |i: usize, payload: String| {
        let (id, address) = (banks[i].0.clone(), banks[i].1.clone());
        async move { client.enlist(began.txid, &id, &address, payload.as_bytes()).await }
    };
    let (d, c) = tokio::join!(enlist(from, debit), enlist(to, credit));
    let outcome = match (d, c) {
        (Ok(_), Ok(_)) => client.commit(began.txid).await,
        (Err(e), _) | (_, Err(e)) => client.abort(began.txid, &e.to_string()).await,
    };
    (Some(began.txid), outcome)
}

/// One transfer of a random amount between random accounts of two of
/// `banks` (each `(participant id, address, account prefix)`), as one
/// `BeginAndCommit` under `key`; returns the txid if one is known and the
/// caller's view of the outcome (UNKNOWN is never reported as a failure).
pub async fn transfer(
    client: &Client,
    key: &str,
    banks: &[(String, String, String)],
    accounts: usize,
) -> (Option<u64>, Result<TxOutcome, ClientError>) {
    let (from, to, debit, credit) = Pick::random(banks.len(), accounts).payloads(banks);
    // Both participants are known up front: one BeginAndCommit call (one
    // Raft write for begin, enlistment and the commit request).
    let spec = |i: usize, payload: String| ParticipantSpec {
        participant_id: banks[i].0.clone(),
        address: banks[i].1.clone(),
        payload: payload.into_bytes(),
    };
    let parts = [spec(from, debit), spec(to, credit)];
    // UNKNOWN without a txid (no answer at all): the same key and request
    // find the transaction again, so ask a few more times.
    let res = client
        .begin_and_commit_retrying(key, 10_000, b"transfer", &parts, 3, Duration::from_millis(500))
        .await;
    match res {
        Ok(r) => (r.txid, Ok(r.outcome)),
        Err(e) => (None, Err(e)),
    }
}
