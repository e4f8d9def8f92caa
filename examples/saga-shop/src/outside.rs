//! The order saga's outside world (ADR 0034): the payment
//! provider that charges cards and the e-mail sender that sends the
//! confirmations, each its own process (`dtx-dev outside-serve --role
//! payment|email`), beside the step services that call them
//! (`saga-step-serve --role payment --provider ADDR`, `--role email
//! --sender ADDR`). They stand for systems the shop does not run: the
//! step services reach them only over the network and learn what they did
//! only from their answers and their status query.
//!
//! # Protocol
//!
//! TCP, one request line and one reply line per connection, JSON
//! ([`WireRequest`], [`WireReply`]):
//! - `{"key":K,"work":W}`: do work W (a [`Work`]: a charge or an e-mail)
//!   under idempotency key K, at most once per key: the first request acts
//!   and its answer ([`OutsideAnswer`]) is recorded; every later request
//!   with K answers the same (a key reused for another work is refused,
//!   an error, nothing done). A key that was fenced answers `voided`.
//! - `{"key":K,"status":{"fence":F}}`: what K did: its answer, or
//!   `not_done`; with F, a key that did nothing is recorded `voided` first
//!   (a request with it arriving later does nothing and answers `voided`),
//!   so "not done" stays true.
//!
//! With `--lose-replies-percent N`, N% of work replies are lost AFTER the
//! work and its record are durable: the connection closes without an
//! answer, as when a reply times out. Status replies are never lost.
//!
//! # Records
//!
//! Every answer is a checksummed record in an append-only log
//! ([`dtx_durable::wal::Wal`], `<data>/log/`), synced before the reply: a
//! crash or a full disk leaves at most a torn tail, which the next start
//! cuts off (nothing there was answered), never a torn record inside the
//! log. A failed write or sync stops the process (a supervisor starts it
//! again). [`outside_audit`] reads the log of a stopped process: each key
//! once, and each charge and e-mail counted once per order.

use std::collections::BTreeMap;
use std::collections::HashMap;
use std::path::Path;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use dtx_durable::wal::Wal;
use participant_sdk::saga::OutsideStatus;
use participant_sdk::saga::OutsideSystem;
use serde::Deserialize;
use serde::Serialize;
use tokio::io::AsyncBufReadExt;
use tokio::io::AsyncWriteExt;

use crate::Audit;
use crate::BalanceAudit;

/// The log's own directory in an outside process's data directory.
pub const LOG_DIR: &str = "log";
/// A log file is closed and the next one started at this size.
const SEGMENT_BYTES_MAX: u64 = 8 << 20;
/// The longest request line.
const LINE_BYTES_MAX: u64 = 64 << 10;
/// How long a client waits to connect, and for the whole exchange.
pub const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
pub const EXCHANGE_TIMEOUT: Duration = Duration::from_millis(1000);

/// Which outside system a process is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutsideRole {
    /// The payment provider: charges cards (customers' accounts).
    Payment,
    /// The e-mail sender.
    Email,
}

impl OutsideRole {
    pub fn as_str(self) -> &'static str {
        match self {
            OutsideRole::Payment => "payment",
            OutsideRole::Email => "email",
        }
    }

    /// Its name in records, errors and logs.
    pub fn system_name(self) -> &'static str {
        match self {
            OutsideRole::Payment => "payment provider",
            OutsideRole::Email => "e-mail sender",
        }
    }

    /// The name of its audit's role (`payment-provider`, `email-sender`).
    pub fn audit_role(self) -> &'static str {
        match self {
            OutsideRole::Payment => "payment-provider",
            OutsideRole::Email => "email-sender",
        }
    }

    fn log_name(self) -> &'static str {
        match self {
            OutsideRole::Payment => "payment provider log",
            OutsideRole::Email => "e-mail sender log",
        }
    }
}

impl std::fmt::Display for OutsideRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a step service asks the outside world to do.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "work", rename_all = "snake_case")]
pub enum Work {
    /// Charge `amount` to `customer`'s card for `order`.
    Charge {
        customer: String,
        amount: u64,
        order: String,
    },
    /// Send e-mail `text` to `to` about `order`.
    Send { to: String, order: String, text: String },
}

impl Work {
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("serializable")
    }

    pub fn from_json(b: &[u8]) -> Result<Work, String> {
        serde_json::from_slice(b).map_err(|e| format!("not a request to the outside world: {e}"))
    }

    fn fits(&self, role: OutsideRole) -> bool {
        matches!(
            (self, role),
            (Work::Charge { .. }, OutsideRole::Payment) | (Work::Send { .. }, OutsideRole::Email)
        )
    }
}

/// What one idempotency key got, recorded and answered every time.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "answer", rename_all = "snake_case")]
pub enum OutsideAnswer {
    /// The card was charged.
    Charged {
        charge_id: String,
        customer: String,
        amount: u64,
        order: String,
    },
    /// Not charged, for good (insufficient funds, an unknown customer).
    Declined { reason: String },
    /// The e-mail was sent.
    Sent {
        message_id: String,
        to: String,
        order: String,
    },
    /// The key was fenced before any request with it arrived: nothing was
    /// done, and nothing will be.
    Voided,
}

impl OutsideAnswer {
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("serializable")
    }

    pub fn from_json(b: &[u8]) -> Result<OutsideAnswer, String> {
        serde_json::from_slice(b).map_err(|e| format!("not an answer of the outside world: {e}"))
    }
}

/// A status question.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusQuestion {
    pub fence: bool,
}

/// One request line.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireRequest {
    pub key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub work: Option<Work>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<StatusQuestion>,
}

/// One reply line: exactly one field set.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireReply {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<OutsideAnswer>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub not_done: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One record of the log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "record", rename_all = "snake_case")]
enum LogRecord {
    /// The payment provider's accounts, once, when its log is new.
    Seed { customers: u32, balance: u64 },
    /// What `key` got (`work`: none for a key voided by a fence).
    Key {
        key: String,
        work: Option<Work>,
        answer: OutsideAnswer,
        at_ms: u64,
    },
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// What the log says, replayed.
#[derive(Default)]
struct Books {
    keys: HashMap<String, (Option<Work>, OutsideAnswer)>,
    /// customer -> (initial, balance)
    accounts: BTreeMap<String, (u64, u64)>,
    seeded: bool,
    /// Keys recorded more than once (never, unless the log lies).
    keys_twice: Vec<String>,
    records: u64,
}

impl Books {
    fn apply(&mut self, r: LogRecord) {
        self.records += 1;
        match r {
            LogRecord::Seed { customers, balance } => {
                self.seeded = true;
                for i in 0..customers {
                    self.accounts.insert(format!("c-{i}"), (balance, balance));
                }
            }
            LogRecord::Key { key, work, answer, .. } => {
                if let OutsideAnswer::Charged { customer, amount, .. } = &answer {
                    if let Some(a) = self.accounts.get_mut(customer) {
                        a.1 = a.1.saturating_sub(*amount);
                    }
                }
                if self.keys.insert(key.clone(), (work, answer)).is_some() {
                    self.keys_twice.push(key);
                }
            }
        }
    }

    /// The answer new work under a new key gets.
    fn decide(&self, work: &Work, next: u64) -> OutsideAnswer {
        match work {
            Work::Charge {
                customer,
                amount,
                order,
            } => match self.accounts.get(customer) {
                None => OutsideAnswer::Declined {
                    reason: format!("unknown customer {customer:?}"),
                },
                Some((_, balance)) if balance < amount => OutsideAnswer::Declined {
                    reason: "insufficient funds".into(),
                },
                Some(_) => OutsideAnswer::Charged {
                    charge_id: format!("ch-{next}"),
                    customer: customer.clone(),
                    amount: *amount,
                    order: order.clone(),
                },
            },
            Work::Send { to, order, .. } => OutsideAnswer::Sent {
                message_id: format!("msg-{next}"),
                to: to.clone(),
                order: order.clone(),
            },
        }
    }
}

/// The log and what it says.
struct Ledger {
    wal: Wal,
    books: Books,
    next_index: u64,
}

impl Ledger {
    /// Opens the log in `<data>/log` (cutting a torn tail) and replays it.
    fn open(role: OutsideRole, data: &Path) -> anyhow::Result<Ledger> {
        std::fs::create_dir_all(data).with_context(|| format!("creating {}", data.display()))?;
        let wal = Wal::open(&data.join(LOG_DIR), role.log_name(), SEGMENT_BYTES_MAX)?;
        let mut books = Books::default();
        let mut next_index = 1;
        if let Some((first, last)) = wal.range() {
            for (i, b) in wal.read(first, last + 1)?.into_iter().enumerate() {
                let r: LogRecord = serde_json::from_slice(&b)
                    .with_context(|| format!("{}: record {} does not decode", role.log_name(), first + i as u64))?;
                books.apply(r);
            }
            next_index = last + 1;
        }
        Ok(Ledger { wal, books, next_index })
    }

    /// Appends `r` and syncs it: durable when it returns. A failure stops
    /// the log (and, through `stopped`, the process).
    fn append(&mut self, r: LogRecord) -> anyhow::Result<()> {
        let b = serde_json::to_vec(&r).expect("serializable");
        self.wal.append(&[(self.next_index, b)])?;
        self.wal.sync()?;
        self.next_index += 1;
        self.books.apply(r);
        Ok(())
    }
}

/// `dtx-dev outside-serve`: one outside system until SIGTERM.
#[derive(clap::Args, Clone, Debug)]
pub struct OutsideServeArgs {
    #[arg(long, value_enum)]
    pub role: OutsideRole,
    /// Address to serve on (host:port).
    #[arg(long)]
    pub listen: String,
    /// Its data directory (created when new; the log is in `log/`).
    #[arg(long)]
    pub data: PathBuf,
    /// Lose this percentage of work replies after the work and its record
    /// are durable (the connection closes without an answer).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=100))]
    pub lose_replies_percent: u32,
    /// payment, when its log is new: customers c-0 .. c-(N-1).
    #[arg(long, default_value_t = 10)]
    pub customers: u32,
    /// payment, when its log is new: each customer's balance.
    #[arg(long, default_value_t = 100_000)]
    pub balance: u64,
}

impl OutsideServeArgs {
    pub fn new(role: OutsideRole, listen: &str, data: &Path) -> OutsideServeArgs {
        OutsideServeArgs {
            role,
            listen: listen.into(),
            data: data.into(),
            lose_replies_percent: 0,
            customers: 10,
            balance: 100_000,
        }
    }
}

/// `dtx-dev outside-audit`: the [`outside_audit`] of a stopped outside
/// process's data directory, as JSON.
#[derive(clap::Args, Clone, Debug)]
pub struct OutsideAuditArgs {
    #[arg(long, value_enum)]
    pub role: OutsideRole,
    #[arg(long)]
    pub data: PathBuf,
}

struct Server {
    role: OutsideRole,
    ledger: tokio::sync::Mutex<Ledger>,
    lose_percent: u32,
    lost: AtomicU64,
    /// Set (with why) when a write failed: the process then stops.
    failed: tokio::sync::watch::Sender<Option<String>>,
}

impl Server {
    async fn handle(&self, req: WireRequest) -> (WireReply, bool) {
        let reply = |r: Result<WireReply, String>| match r {
            Ok(r) => r,
            Err(e) => WireReply {
                error: Some(e),
                ..WireReply::default()
            },
        };
        if req.key.is_empty() {
            return (reply(Err("a request needs an idempotency key".into())), false);
        }
        match (req.work, req.status) {
            (Some(work), None) => {
                let r = self.work(&req.key, work).await;
                let lose = r.is_ok() && self.lose_percent > 0 && rand::random_range(0..100u32) < self.lose_percent;
                (reply(r), lose)
            }
            (None, Some(q)) => (reply(self.status(&req.key, q.fence).await), false),
            _ => (
                reply(Err("a request holds either work or a status question".into())),
                false,
            ),
        }
    }

    async fn work(&self, key: &str, work: Work) -> Result<WireReply, String> {
        if !work.fits(self.role) {
            return Err(format!("the {} does not do {work:?}", self.role.system_name()));
        }
        let mut l = self.ledger.lock().await;
        if let Some((done, answer)) = l.books.keys.get(key) {
            return match (done, answer) {
                (_, OutsideAnswer::Voided) => Ok(answered(OutsideAnswer::Voided)),
                (Some(w), a) if *w == work => Ok(answered(a.clone())),
                _ => Err(format!(
                    "idempotency key {key:?} was used for another request; refused, nothing done"
                )),
            };
        }
        let answer = l.books.decide(&work, l.next_index);
        let rec = LogRecord::Key {
            key: key.to_string(),
            work: Some(work),
            answer: answer.clone(),
            at_ms: now_ms(),
        };
        self.write(&mut l, rec)?;
        Ok(answered(answer))
    }

    async fn status(&self, key: &str, fence: bool) -> Result<WireReply, String> {
        let mut l = self.ledger.lock().await;
        if let Some((_, answer)) = l.books.keys.get(key) {
            return Ok(answered(answer.clone()));
        }
        if fence {
            let rec = LogRecord::Key {
                key: key.to_string(),
                work: None,
                answer: OutsideAnswer::Voided,
                at_ms: now_ms(),
            };
            self.write(&mut l, rec)?;
        }
        Ok(WireReply {
            not_done: true,
            ..WireReply::default()
        })
    }

    fn write(&self, l: &mut Ledger, rec: LogRecord) -> Result<(), String> {
        l.append(rec).map_err(|e| {
            let msg = format!("{}: {e:#}", self.role.system_name());
            tracing::error!("{msg}; stopping");
            let _ = self.failed.send(Some(msg.clone()));
            msg
        })
    }
}

fn answered(a: OutsideAnswer) -> WireReply {
    WireReply {
        answer: Some(a),
        ..WireReply::default()
    }
}

/// `dtx-dev outside-serve`: binds `--listen`, then
/// [`serve_outside_listener`].
pub async fn serve_outside(a: OutsideServeArgs, shutdown: impl std::future::Future<Output = ()>) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(&a.listen)
        .await
        .with_context(|| format!("listening on {}", a.listen))?;
    serve_outside_listener(a, listener, shutdown).await
}

/// Serves `a.role` on `listener` until `shutdown`, or until a write fails
/// (then an error, so a supervisor starts it again; the next start cuts
/// any torn tail).
pub async fn serve_outside_listener(
    a: OutsideServeArgs,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let role = a.role;
    let data = a.data.clone();
    let mut ledger = tokio::task::spawn_blocking(move || Ledger::open(role, &data)).await??;
    if role == OutsideRole::Payment && !ledger.books.seeded {
        ledger.append(LogRecord::Seed {
            customers: a.customers,
            balance: a.balance,
        })?;
    }
    let (failed, mut failed_rx) = tokio::sync::watch::channel(None);
    let server = Arc::new(Server {
        role,
        ledger: tokio::sync::Mutex::new(ledger),
        lose_percent: a.lose_replies_percent,
        lost: AtomicU64::new(0),
        failed,
    });
    tracing::info!(
        role = %role,
        listen = %listener.local_addr().map(|x| x.to_string()).unwrap_or_default(),
        data = %a.data.display(),
        lose_replies_percent = a.lose_replies_percent,
        "outside system serving"
    );
    tokio::pin!(shutdown);
    let failure = loop {
        tokio::select! {
            _ = &mut shutdown => break None,
            r = failed_rx.wait_for(|f| f.is_some()) => {
                break r.ok().and_then(|f| f.clone());
            }
            acc = listener.accept() => {
                let Ok((stream, _)) = acc else { continue };
                let server = server.clone();
                tokio::spawn(async move {
                    if let Err(e) = connection(&server, stream).await {
                        tracing::debug!("outside connection: {e}");
                    }
                });
            }
        }
    };
    tracing::info!(lost = server.lost.load(Ordering::Relaxed), "outside system stopping");
    match failure {
        Some(f) => Err(anyhow::anyhow!("{f}")),
        None => Ok(()),
    }
}

async fn connection(server: &Server, stream: tokio::net::TcpStream) -> std::io::Result<()> {
    use tokio::io::AsyncReadExt;
    let (r, mut w) = stream.into_split();
    let mut line = String::new();
    let n = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::io::BufReader::new(r.take(LINE_BYTES_MAX)).read_line(&mut line),
    )
    .await
    .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no request line"))??;
    if n == 0 {
        return Ok(());
    }
    let (reply, lose) = match serde_json::from_str::<WireRequest>(line.trim_end()) {
        Ok(req) => server.handle(req).await,
        Err(e) => (
            WireReply {
                error: Some(format!("not a request: {e}")),
                ..WireReply::default()
            },
            false,
        ),
    };
    if lose {
        let n = server.lost.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::info!(lost = n, "simulated: the reply is lost (the work is done and recorded)");
        return Ok(());
    }
    let mut out = serde_json::to_vec(&reply).expect("serializable");
    out.push(b'\n');
    w.write_all(&out).await?;
    w.shutdown().await
}

/// A step service's way to an outside process: the call and the status
/// hook ([`OutsideSystem`]), each one connection, bounded by
/// [`EXCHANGE_TIMEOUT`].
#[derive(Clone, Debug)]
pub struct OutsideClient {
    pub addr: String,
    pub role: OutsideRole,
}

impl OutsideClient {
    pub fn new(role: OutsideRole, addr: &str) -> OutsideClient {
        OutsideClient {
            addr: addr.to_string(),
            role,
        }
    }

    async fn exchange(&self, req: &WireRequest) -> Result<WireReply, String> {
        let mut line = serde_json::to_vec(req).expect("serializable");
        line.push(b'\n');
        let talk = async {
            let stream = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(&self.addr))
                .await
                .map_err(|_| format!("no connection to {} within {CONNECT_TIMEOUT:?}", self.addr))?
                .map_err(|e| format!("cannot connect to {}: {e}", self.addr))?;
            let (r, mut w) = stream.into_split();
            w.write_all(&line).await.map_err(|e| format!("sending: {e}"))?;
            let mut reply = String::new();
            tokio::io::BufReader::new(r)
                .read_line(&mut reply)
                .await
                .map_err(|e| format!("reading the reply: {e}"))?;
            if reply.is_empty() {
                return Err("the connection closed without a reply".to_string());
            }
            serde_json::from_str::<WireReply>(reply.trim_end()).map_err(|e| format!("an unreadable reply: {e}"))
        };
        tokio::time::timeout(EXCHANGE_TIMEOUT, talk)
            .await
            .map_err(|_| format!("no reply within {EXCHANGE_TIMEOUT:?}"))?
    }
}

#[tonic::async_trait]
impl OutsideSystem for OutsideClient {
    fn name(&self) -> &str {
        self.role.system_name()
    }

    async fn call(&self, key: &str, request: &[u8]) -> Result<Vec<u8>, String> {
        let req = WireRequest {
            key: key.to_string(),
            work: Some(Work::from_json(request)?),
            status: None,
        };
        let reply = self.exchange(&req).await?;
        match (reply.answer, reply.error) {
            (Some(a), _) => Ok(a.to_json()),
            (None, Some(e)) => Err(format!("the {} refused: {e}", self.name())),
            (None, None) => Err(format!("the {} answered nothing", self.name())),
        }
    }

    async fn status(&self, key: &str, _request: &[u8], fence: bool) -> OutsideStatus {
        let req = WireRequest {
            key: key.to_string(),
            work: None,
            status: Some(StatusQuestion { fence }),
        };
        match self.exchange(&req).await {
            Ok(WireReply { answer: Some(a), .. }) => OutsideStatus::Done(a.to_json()),
            Ok(WireReply { not_done: true, .. }) => OutsideStatus::NotDone,
            Ok(WireReply { error: Some(e), .. }) => OutsideStatus::Unknown(e),
            Ok(_) => OutsideStatus::Unknown("an empty reply".into()),
            Err(e) => OutsideStatus::Unknown(e),
        }
    }
}

/// The audit of a stopped outside process's data directory (opening its
/// log cuts a torn tail, as a start would): each charge and e-mail per
/// order (`charges` and `confirmations`: `charges_applied` / `applied` is
/// how many keys charged or e-mailed the order, so more than 1 is a
/// duplicate), the accounts, and problems (a key recorded twice, money not
/// conserved).
pub fn outside_audit(role: OutsideRole, data: &Path) -> anyhow::Result<Audit> {
    anyhow::ensure!(
        data.join(LOG_DIR).exists(),
        "{} holds no {}'s log",
        data.display(),
        role.system_name()
    );
    let ledger = Ledger::open(role, data)?;
    let books = &ledger.books;
    let mut a = Audit {
        role: role.audit_role().to_string(),
        outside_records: books.records,
        ..Audit::default()
    };
    let mut charged: BTreeMap<String, u64> = BTreeMap::new();
    for (_, answer) in books.keys.values() {
        match answer {
            OutsideAnswer::Charged {
                customer,
                amount,
                order,
                ..
            } => {
                let c = a.charges.entry(order.clone()).or_default();
                c.charges_applied += 1;
                c.amount += amount;
                *charged.entry(customer.clone()).or_default() += amount;
            }
            OutsideAnswer::Sent { order, .. } => {
                let c = a.confirmations.entry(order.clone()).or_default();
                c.applied += 1;
                c.sent_events += 1;
                c.sent_lines += 1;
            }
            OutsideAnswer::Declined { .. } => a.outside_declined += 1,
            OutsideAnswer::Voided => a.outside_voided += 1,
        }
    }
    for key in &books.keys_twice {
        a.problems.push(format!("idempotency key {key:?} is recorded twice"));
    }
    for (customer, (initial, balance)) in &books.accounts {
        let c = charged.remove(customer).unwrap_or(0);
        if initial.checked_sub(*balance) != Some(c) {
            a.problems.push(format!(
                "{customer}: initial {initial} - balance {balance} != charged {c}"
            ));
        }
        a.balances.insert(
            customer.clone(),
            BalanceAudit {
                initial: *initial,
                balance: *balance,
                charged: c,
            },
        );
    }
    for (customer, c) in charged {
        a.problems.push(format!("{c} charged to unknown customer {customer}"));
    }
    a.duplicate_forward_actions = a
        .charges
        .values()
        .map(|c| c.charges_applied.saturating_sub(1))
        .sum::<u64>()
        + a.confirmations
            .values()
            .map(|c| c.applied.saturating_sub(1))
            .sum::<u64>();
    Ok(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn charge(customer: &str, amount: u64, order: &str) -> Work {
        Work::Charge {
            customer: customer.into(),
            amount,
            order: order.into(),
        }
    }

    #[test]
    fn wire_messages_round_trip_as_one_line() {
        let req = WireRequest {
            key: "3.1.f0@00ab".into(),
            work: Some(charge("c-1", 5, "o-1")),
            status: None,
        };
        let line = serde_json::to_string(&req).unwrap();
        assert!(!line.contains('\n'));
        assert_eq!(serde_json::from_str::<WireRequest>(&line).unwrap(), req);
        let reply = WireReply {
            not_done: true,
            ..WireReply::default()
        };
        assert_eq!(serde_json::to_string(&reply).unwrap(), r#"{"not_done":true}"#);
        let a = OutsideAnswer::Sent {
            message_id: "m".into(),
            to: "c-1".into(),
            order: "o-1\nx".into(),
        };
        assert_eq!(OutsideAnswer::from_json(&a.to_json()).unwrap(), a);
    }

    /// A torn line, `3586\tconfirmation for3586\tconfirmation for order
    /// o-c3-769`: a record cut by a crash (or a full disk) in the middle,
    /// then the same work done again. Here the cut record is a torn tail
    /// (nothing in it was answered), cut off at the next open; the work
    /// done again is recorded once, and the audit reads every record whole
    /// and counts each e-mail once.
    #[test]
    fn a_torn_tail_is_cut_at_open_and_work_done_again_is_counted_once() {
        let dir = tempfile::tempdir().unwrap();
        let send = |order: &str| Work::Send {
            to: "c-1".into(),
            order: order.into(),
            text: format!("confirmation for order {order}"),
        };
        let record = |l: &Ledger, key: &str, order: &str| LogRecord::Key {
            key: key.into(),
            work: Some(send(order)),
            answer: l.books.decide(&send(order), l.next_index),
            at_ms: 1,
        };
        let mut l = Ledger::open(OutsideRole::Email, dir.path()).unwrap();
        for (k, o) in [("k1", "o-1"), ("k2", "o-2")] {
            let r = record(&l, k, o);
            l.append(r).unwrap();
        }
        let r = record(&l, "k3", "o-c3-769");
        l.append(r).unwrap();
        drop(l);
        // Cut the last record in the middle of its payload.
        let file = std::fs::read_dir(dir.path().join(LOG_DIR))
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        let bytes = std::fs::read(&file).unwrap();
        let at = bytes
            .windows(b"o-c3-769".len())
            .position(|w| w == b"o-c3-769")
            .expect("the record is in the file");
        let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
        f.set_len(at as u64).unwrap();
        drop(f);

        let mut l = Ledger::open(OutsideRole::Email, dir.path()).unwrap();
        assert_eq!(l.books.keys.len(), 2, "the torn record is cut off");
        assert!(!l.books.keys.contains_key("k3"));
        // The same work again (a resend under the same key).
        let r = record(&l, "k3", "o-c3-769");
        l.append(r).unwrap();
        drop(l);
        let a = outside_audit(OutsideRole::Email, dir.path()).unwrap();
        assert!(a.ok(), "{a:#?}");
        assert_eq!(a.confirmations.len(), 3);
        assert_eq!(a.confirmations["o-c3-769"].applied, 1);
        assert_eq!(a.outside_records, 3);
    }

    #[test]
    fn books_decide_charges_and_declines_and_replay_the_same() {
        let mut b = Books::default();
        b.apply(LogRecord::Seed {
            customers: 2,
            balance: 10,
        });
        assert!(matches!(
            b.decide(&charge("c-0", 11, "o"), 1),
            OutsideAnswer::Declined { .. }
        ));
        assert!(matches!(
            b.decide(&charge("c-9", 1, "o"), 1),
            OutsideAnswer::Declined { .. }
        ));
        let a = b.decide(&charge("c-0", 4, "o-1"), 2);
        assert!(matches!(a, OutsideAnswer::Charged { amount: 4, .. }));
        b.apply(LogRecord::Key {
            key: "k".into(),
            work: Some(charge("c-0", 4, "o-1")),
            answer: a,
            at_ms: 0,
        });
        assert_eq!(b.accounts["c-0"], (10, 6));
        b.apply(LogRecord::Key {
            key: "k".into(),
            work: None,
            answer: OutsideAnswer::Voided,
            at_ms: 0,
        });
        assert_eq!(b.keys_twice, vec!["k".to_string()]);
    }
}
