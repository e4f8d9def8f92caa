//! The order saga's step services (docs/sagas.md, "The order saga"): three
//! services on the participant SDK's saga module ([`participant_sdk::saga`]),
//! one process each, all reading the same input, an [`OrderInput`] as JSON:
//! `{"order":"o-17","sku":"sku-3","qty":2,"customer":"c-5","amount":1200}`.
//!
//! - **inventory** ([`services::Inventory`]): [`RESERVE`] takes `qty` of
//!   `sku` out of stock into the order's reservation (COMPENSABLE,
//!   versioned: it reports the sku's version), FAILED "out of stock";
//!   [`RELEASE`] puts it back, STALE when the reservation changed since
//!   (see the type's documentation); status query [`RESERVATION`].
//! - **payment** ([`services::Payment`]): [`CHARGE`] charges `amount` to
//!   the customer's card at the payment provider (PIVOT), FAILED when the
//!   provider declines ("insufficient funds"); status query
//!   [`CHARGE_STATUS`]. The charge is an outside call (ADR 0034): recorded
//!   in flight before it leaves, sent with the operation id as the
//!   provider's idempotency key, settled by asking the provider when its
//!   reply is lost. With `--lose-replies-percent N` this service's own
//!   gRPC replies are lost N% of the time after the call was recorded
//!   ([`LosingReplies`]), so the orchestrator must reconcile through
//!   Status too.
//! - **email** ([`services::Email`]): [`SEND_CONFIRMATION`] sends the
//!   confirmation e-mail "confirmation for order X" through the e-mail
//!   sender (RETRIABLE; an outside call like the charge); with
//!   `--fail-first-percent N` it answers FAILED "mail server busy" N% of
//!   the time before sending anything; status query [`EMAIL_STATUS`].
//!
//! The payment provider and the e-mail sender are the outside world
//! ([`outside`]): separate processes (`dtx-dev outside-serve --role
//! payment|email`) with idempotency keys, a status query that can fence a
//! key, replies lost at a given percentage, and records in a checksummed
//! append-only log; [`outside::outside_audit`] counts each charge and
//! e-mail once per order.
//!
//! [`order_saga_definition`] is the saga the orchestrator runs over them.
//! [`audit`] reads a stopped service's data directory: what a checker needs
//! to say that stock and money are conserved and that no business effect
//! was applied more than once per order (`duplicate_forward_actions`, must
//! be 0). Seeded when the data directory is new ([`Seed`]).
//!
//! The inventory can keep its stock in PostgreSQL instead ([`pg`], the
//! SDK's [`participant_sdk::saga_pg`] store, ADR 0020): `saga-step-serve
//! --role inventory --postgres CONN`, audited with `saga-step-audit --role
//! inventory --postgres CONN` ([`pg::audit_pg`]) into the same [`Audit`].
//!
//! The commands: `dtx-dev saga-step-serve` ([`StepServeArgs`],
//! [`serve`]), `dtx-dev saga-step-audit` ([`StepAuditArgs`]),
//! `dtx-dev outside-serve` ([`OutsideServeArgs`], [`serve_outside`])
//! and `dtx-dev outside-audit` ([`OutsideAuditArgs`]).

pub mod outside;
pub mod pg;
pub mod services;

pub use outside::outside_audit;
pub use outside::serve_outside;
pub use outside::serve_outside_listener;
pub use outside::OutsideAuditArgs;
pub use outside::OutsideClient;
pub use outside::OutsideRole;
pub use outside::OutsideServeArgs;

use std::collections::BTreeMap;
use std::path::Path;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use anyhow::Context;
use dtx_proto::v1 as pb;
use dtx_proto::v1::saga_step_service_server::SagaStepService;
use participant_sdk::saga::StepHandler;
use participant_sdk::saga::StepServer;
use participant_sdk::saga::StepStaged;
use participant_sdk::saga::StepStore;
use participant_sdk::saga::StepView;
use serde::Deserialize;
use serde::Serialize;
use tonic::Request;
use tonic::Response;
use tonic::Status;

use crate::services::ChargeRecord;
use crate::services::Email;
use crate::services::Inventory;
use crate::services::Payment;
use crate::services::ReservationRecord;
use crate::services::SkuRecord;

/// The inventory's forward action, compensation and status query.
pub const RESERVE: &str = "reserve";
pub const RELEASE: &str = "release";
pub const RESERVATION: &str = "reservation";
/// Not a saga step: a change to an order's reservation made outside the
/// saga (customer service), which makes a later release STALE.
pub const AMEND: &str = "amend";
/// The payment service's forward action and status query.
pub const CHARGE: &str = "charge";
pub const CHARGE_STATUS: &str = "charge_status";
/// The e-mail service's forward action and status query.
pub const SEND_CONFIRMATION: &str = "send_confirmation";
pub const EMAIL_STATUS: &str = "email_status";

/// The saga definition's name and version ([`order_saga_definition`]).
pub const ORDER_SAGA: &str = "order";
pub const ORDER_SAGA_VERSION: u32 = 1;
/// Its steps' names.
pub const STEP_RESERVE_STOCK: &str = "reserve_stock";
pub const STEP_CHARGE_CARD: &str = "charge_card";
pub const STEP_SEND_CONFIRMATION: &str = "send_confirmation";

/// The input every step of the order saga gets (as JSON).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct OrderInput {
    pub order: String,
    pub sku: String,
    pub qty: u64,
    pub customer: String,
    pub amount: u64,
}

impl OrderInput {
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("serializable")
    }
}

/// The order saga (name [`ORDER_SAGA`], version [`ORDER_SAGA_VERSION`])
/// over step services at these addresses (host:port): reserve_stock
/// (COMPENSABLE, versioned) → charge_card (PIVOT) → send_confirmation
/// (RETRIABLE); each retried up to 8 calls, backing off 50 ms to 1 s; the
/// default recovery options.
pub fn order_saga_definition(inventory: &str, payment: &str, email: &str) -> pb::SagaDefinition {
    let retry = Some(pb::RetryPolicy {
        max_attempts: 8,
        backoff_initial_ms: 50,
        backoff_max_ms: 1000,
    });
    let step = |name: &str, kind: pb::StepKind, service: &str, action: &str, compensation: &str, query: &str| {
        pb::SagaStepDefinition {
            name: name.into(),
            kind: kind as i32,
            service: service.into(),
            action: action.into(),
            compensation: compensation.into(),
            status_query: query.into(),
            versioned: kind == pb::StepKind::Compensable,
            retry,
            on_failure: vec![],
            high_impact: false,
            completion_timeout_ms: 0,
        }
    };
    pb::SagaDefinition {
        name: ORDER_SAGA.into(),
        version: ORDER_SAGA_VERSION,
        steps: vec![
            step(
                STEP_RESERVE_STOCK,
                pb::StepKind::Compensable,
                inventory,
                RESERVE,
                RELEASE,
                RESERVATION,
            ),
            step(
                STEP_CHARGE_CARD,
                pb::StepKind::Pivot,
                payment,
                CHARGE,
                "",
                CHARGE_STATUS,
            ),
            step(
                STEP_SEND_CONFIRMATION,
                pb::StepKind::Retriable,
                email,
                SEND_CONFIRMATION,
                "",
                EMAIL_STATUS,
            ),
        ],
    }
}

/// Which service a process runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Inventory,
    Payment,
    Email,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Inventory => "inventory",
            Role::Payment => "payment",
            Role::Email => "email",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a new inventory data directory starts with: skus `sku-0` ..
/// with `stock` each. (The customers' accounts are the payment
/// provider's: `outside-serve --customers --balance`.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seed {
    pub skus: u32,
    pub stock: u64,
}

impl Default for Seed {
    fn default() -> Self {
        Seed { skus: 10, stock: 100 }
    }
}

/// `dtx-dev saga-step-serve`: one step service of the order saga until
/// SIGTERM.
#[derive(clap::Args, Clone, Debug)]
pub struct StepServeArgs {
    #[arg(long, value_enum)]
    pub role: Role,
    /// Address to serve `dtx.v1.SagaStepService` on (host:port).
    #[arg(long)]
    pub listen: String,
    /// The service's data directory (created and seeded when new).
    #[arg(long, required_unless_present = "postgres")]
    pub data: Option<PathBuf>,
    /// inventory only: keep the stock in this PostgreSQL database instead
    /// of a data directory (a tokio-postgres connection string; the tables
    /// are created and seeded when missing). PostgreSQL out of reach makes
    /// calls fail (UNKNOWN to the orchestrator), never FAILED.
    #[arg(long, conflicts_with = "data")]
    pub postgres: Option<String>,
    /// Lose this percentage of Forward and Compensate replies after
    /// applying the call durably (answering UNAVAILABLE "reply lost").
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=100))]
    pub lose_replies_percent: u32,
    /// email: answer FAILED "mail server busy" this percentage of the time,
    /// before doing anything.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=100))]
    pub fail_first_percent: u32,
    /// inventory seed: skus sku-0 .. sku-(N-1).
    #[arg(long, default_value_t = 10)]
    pub skus: u32,
    /// inventory seed: the stock of each sku.
    #[arg(long, default_value_t = 100)]
    pub stock: u64,
    /// payment: the payment provider's address (`outside-serve --role
    /// payment`; required).
    #[arg(long)]
    pub provider: Option<String>,
    /// email: the e-mail sender's address (`outside-serve --role email`;
    /// required).
    #[arg(long)]
    pub sender: Option<String>,
    #[command(flatten)]
    pub tls: dtx_tls::args::TlsArgs,
}

impl StepServeArgs {
    /// Plain text, no failures, the default seed, no outside system.
    pub fn new(role: Role, listen: &str, data: &Path) -> StepServeArgs {
        let seed = Seed::default();
        StepServeArgs {
            role,
            listen: listen.into(),
            data: Some(data.into()),
            postgres: None,
            lose_replies_percent: 0,
            fail_first_percent: 0,
            skus: seed.skus,
            stock: seed.stock,
            provider: None,
            sender: None,
            tls: Default::default(),
        }
    }

    /// The inventory on PostgreSQL at `conn` (no data directory).
    pub fn new_postgres(listen: &str, conn: &str) -> StepServeArgs {
        StepServeArgs {
            data: None,
            postgres: Some(conn.into()),
            ..StepServeArgs::new(Role::Inventory, listen, Path::new("-"))
        }
    }

    pub fn seed(&self) -> Seed {
        Seed {
            skus: self.skus,
            stock: self.stock,
        }
    }
}

/// `dtx-dev saga-step-audit`: the [`Audit`] of a stopped service's data
/// directory, as JSON.
#[derive(clap::Args, Clone, Debug)]
pub struct StepAuditArgs {
    #[arg(long, value_enum)]
    pub role: Role,
    #[arg(long, required_unless_present = "postgres")]
    pub data: Option<PathBuf>,
    /// inventory only: the PostgreSQL database the service keeps its stock
    /// in (`saga-step-serve --postgres`).
    #[arg(long, conflicts_with = "data")]
    pub postgres: Option<String>,
}

/// A step service wrapper whose Forward and Compensate replies get lost
/// `percent`% of the time AFTER the call was applied (and made durable):
/// the caller gets UNAVAILABLE "reply lost" and cannot tell what happened
/// but through Status, which never loses its replies.
pub struct LosingReplies<S> {
    inner: S,
    percent: u32,
    lost: AtomicU64,
}

impl<S: SagaStepService> LosingReplies<S> {
    pub fn new(inner: S, percent: u32) -> Self {
        LosingReplies {
            inner,
            percent: percent.min(100),
            lost: AtomicU64::new(0),
        }
    }

    /// Replies lost so far.
    pub fn lost(&self) -> u64 {
        self.lost.load(Ordering::Relaxed)
    }

    fn maybe_lose(
        &self,
        call: &'static str,
        reply: Result<Response<pb::StepReply>, Status>,
    ) -> Result<Response<pb::StepReply>, Status> {
        let reply = reply?;
        if self.percent > 0 && rand::random_range(0..100u32) < self.percent {
            let n = self.lost.fetch_add(1, Ordering::Relaxed) + 1;
            tracing::info!(call, lost = n, "simulated: the reply is lost (the call was applied)");
            return Err(Status::unavailable("reply lost"));
        }
        Ok(reply)
    }
}

#[tonic::async_trait]
impl<S: SagaStepService> SagaStepService for LosingReplies<S> {
    async fn forward(&self, req: Request<pb::StepCall>) -> Result<Response<pb::StepReply>, Status> {
        let r = self.inner.forward(req).await;
        self.maybe_lose("forward", r)
    }

    async fn compensate(&self, req: Request<pb::StepCall>) -> Result<Response<pb::StepReply>, Status> {
        let r = self.inner.compensate(req).await;
        self.maybe_lose("compensate", r)
    }

    async fn status(&self, req: Request<pb::StepStatusRequest>) -> Result<Response<pb::StepStatusReply>, Status> {
        self.inner.status(req).await
    }

    async fn fence(&self, req: Request<pb::StepStatusRequest>) -> Result<Response<pb::StepStatusReply>, Status> {
        self.inner.fence(req).await
    }
}

/// What the three services have in common here.
trait ShopService: StepHandler {
    fn seed(seed: &Seed, staged: &mut StepStaged);
    fn audit(view: &StepView<'_>, data: &Path, audit: &mut Audit) -> anyhow::Result<()>;
}

impl ShopService for Inventory {
    fn seed(seed: &Seed, staged: &mut StepStaged) {
        Inventory::seed(seed, staged)
    }

    fn audit(view: &StepView<'_>, _data: &Path, a: &mut Audit) -> anyhow::Result<()> {
        let mut held: BTreeMap<String, u64> = BTreeMap::new();
        for (k, v) in view.scan(b"reservation/")? {
            let (order, _op) = split_order(&k, "reservation/")?;
            let r: ReservationRecord = serde_json::from_slice(&v).context("a reservation record")?;
            a.reservations.entry(order).or_default().reserved_qty += r.qty;
            *held.entry(r.sku).or_default() += r.qty;
        }
        for (order, n) in counts(view, "reserve")? {
            a.reservations.entry(order).or_default().reserves_applied = n;
        }
        for (order, n) in counts(view, "release")? {
            a.reservations.entry(order).or_default().releases_applied = n;
        }
        for (k, v) in view.scan(b"sku/")? {
            let sku = String::from_utf8_lossy(&k["sku/".len()..]).into_owned();
            let r: SkuRecord = serde_json::from_slice(&v).context("a sku record")?;
            let conserved = r.stock + r.reserved == r.initial;
            if !conserved {
                a.problems.push(format!(
                    "{sku}: stock {} + reserved {} != initial {}",
                    r.stock, r.reserved, r.initial
                ));
            }
            let h = held.remove(&sku).unwrap_or(0);
            if h != r.reserved {
                a.problems
                    .push(format!("{sku}: {} reserved, but the reservations hold {h}", r.reserved));
            }
            a.skus.insert(
                sku,
                SkuAudit {
                    initial: r.initial,
                    stock: r.stock,
                    reserved: r.reserved,
                    conserved,
                },
            );
        }
        for (sku, h) in held {
            a.problems.push(format!("reservations hold {h} of unknown sku {sku}"));
        }
        a.duplicate_forward_actions = a
            .reservations
            .values()
            .map(|r| r.reserves_applied.saturating_sub(1))
            .sum();
        Ok(())
    }
}

impl ShopService for Payment {
    fn seed(_seed: &Seed, _staged: &mut StepStaged) {}

    fn audit(view: &StepView<'_>, _data: &Path, a: &mut Audit) -> anyhow::Result<()> {
        for (k, v) in view.scan(b"charge/")? {
            let (order, _op) = split_order(&k, "charge/")?;
            let c: ChargeRecord = serde_json::from_slice(&v).context("a charge record")?;
            a.charges.entry(order).or_default().amount += c.amount;
        }
        for (order, n) in counts(view, "charge")? {
            a.charges.entry(order).or_default().charges_applied = n;
        }
        a.duplicate_forward_actions = a.charges.values().map(|c| c.charges_applied.saturating_sub(1)).sum();
        Ok(())
    }
}

impl ShopService for Email {
    fn seed(_seed: &Seed, _staged: &mut StepStaged) {}

    fn audit(view: &StepView<'_>, _data: &Path, a: &mut Audit) -> anyhow::Result<()> {
        for (order, n) in counts(view, "confirm")? {
            a.confirmations.entry(order).or_default().applied = n;
        }
        a.duplicate_forward_actions = a.confirmations.values().map(|c| c.applied.saturating_sub(1)).sum();
        Ok(())
    }
}

/// `what/<order>/<op>` -> (order, op).
fn split_order(key: &[u8], prefix: &str) -> anyhow::Result<(String, String)> {
    let rest = String::from_utf8_lossy(&key[prefix.len()..]).into_owned();
    let (order, op) = rest
        .split_once('/')
        .with_context(|| format!("a key {prefix}{rest} without an operation id"))?;
    Ok((order.to_string(), op.to_string()))
}

/// The per-order counts of effect `what`.
fn counts(view: &StepView<'_>, what: &str) -> anyhow::Result<Vec<(String, u64)>> {
    let prefix = format!("effects/{what}/");
    let mut out = Vec::new();
    for (k, v) in view.scan(prefix.as_bytes())? {
        let order = String::from_utf8_lossy(&k[prefix.len()..]).into_owned();
        let n = std::str::from_utf8(&v)
            .ok()
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("the count of {what} for {order}"))?;
        out.push((order, n));
    }
    Ok(out)
}

/// One sku (inventory).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct SkuAudit {
    pub initial: u64,
    pub stock: u64,
    pub reserved: u64,
    /// `stock + reserved == initial`.
    pub conserved: bool,
}

/// One order's reservations (inventory).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ReservationAudit {
    /// Reserves applied (must be at most 1).
    pub reserves_applied: u64,
    pub releases_applied: u64,
    /// Still reserved for the order.
    pub reserved_qty: u64,
}

/// One order's charges (payment: the step service's records of the
/// provider's answers; payment-provider: the cards charged).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ChargeAudit {
    /// Charges applied (must be at most 1).
    pub charges_applied: u64,
    /// Their total.
    pub amount: u64,
}

/// One customer's account at the payment provider.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct BalanceAudit {
    pub initial: u64,
    pub balance: u64,
    /// What the charges recorded took (`initial - balance` when money is
    /// conserved).
    pub charged: u64,
}

/// One order's confirmations (email: the step service's records;
/// email-sender: the e-mails sent).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ConfirmationAudit {
    /// Confirmations applied (must be at most 1).
    pub applied: u64,
    /// email-sender: records of e-mails sent for the order (one per
    /// idempotency key).
    pub sent_lines: u64,
    /// email-sender: distinct e-mails sent for the order.
    pub sent_events: u64,
}

/// What a stopped service's data directory holds ([`audit`]).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Audit {
    pub role: String,
    /// Where the service keeps its data: empty (its sled data directory)
    /// or "postgres".
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub store: String,
    /// Inbox records: operation ids answered, by kind.
    pub inbox_forward: u64,
    pub inbox_compensate: u64,
    /// Repeated operation ids answered from the inbox (the durable
    /// `dtx_step_duplicates_total`): harmless repeats.
    pub forward_duplicates_seen: u64,
    pub compensate_duplicates_seen: u64,
    /// Outbox events not delivered yet.
    pub outbox_pending: u64,
    /// Step services: operations whose outside call is still in flight
    /// (UNKNOWN: never counted as failed).
    #[serde(default)]
    pub in_flight: u64,
    /// Outside processes: records in their log, keys they declined and
    /// keys voided by a fence.
    #[serde(default)]
    pub outside_records: u64,
    #[serde(default)]
    pub outside_declined: u64,
    #[serde(default)]
    pub outside_voided: u64,
    /// Business effects applied more than once for one order (the extra
    /// applications, summed over orders): MUST be 0.
    pub duplicate_forward_actions: u64,
    /// Broken invariants (stock or money not conserved, a confirmation sent
    /// that was never applied), one sentence each: MUST be empty.
    pub problems: Vec<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub skus: BTreeMap<String, SkuAudit>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub reservations: BTreeMap<String, ReservationAudit>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub charges: BTreeMap<String, ChargeAudit>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub balances: BTreeMap<String, BalanceAudit>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub confirmations: BTreeMap<String, ConfirmationAudit>,
}

impl Audit {
    /// No problem and no duplicate forward action.
    pub fn ok(&self) -> bool {
        self.problems.is_empty() && self.duplicate_forward_actions == 0
    }
}

/// The audit of `role`'s stopped service in `data` (opens its store: the
/// service must not run).
pub fn audit(role: Role, data: &Path) -> anyhow::Result<Audit> {
    anyhow::ensure!(
        data.join("db").exists(),
        "{} holds no step service's data",
        data.display()
    );
    match role {
        Role::Inventory => audit_with(role, data, Inventory),
        Role::Payment => audit_with(role, data, Payment::default()),
        Role::Email => audit_with(role, data, Email::default()),
    }
}

fn audit_with<H: ShopService>(role: Role, data: &Path, handler: H) -> anyhow::Result<Audit> {
    let store = StepStore::open(data, handler)?;
    let stats = store.stats()?;
    let mut a = Audit {
        role: role.to_string(),
        inbox_forward: stats.forward_records,
        inbox_compensate: stats.compensate_records,
        forward_duplicates_seen: stats.forward_duplicates,
        compensate_duplicates_seen: stats.compensate_duplicates,
        outbox_pending: stats.outbox_pending,
        in_flight: stats.in_flight,
        ..Audit::default()
    };
    H::audit(&store.view(), data, &mut a)?;
    Ok(a)
}

/// Opens (seeding it when new) the store of a service.
async fn open_store<H: ShopService>(data: &Path, handler: H, seed: &Seed) -> anyhow::Result<Arc<StepStore<H>>> {
    std::fs::create_dir_all(data).with_context(|| format!("creating {}", data.display()))?;
    let store = StepStore::open(data, handler)?;
    if store.view().get(services::SEEDED_KEY)?.is_none() {
        store
            .write_data(|_, staged| {
                H::seed(seed, staged);
                staged.put(services::SEEDED_KEY, b"1");
            })
            .await?;
    }
    Ok(store)
}

/// `dtx-dev saga-step-serve`: binds `--listen`, then [`serve_listener`].
pub async fn serve(a: StepServeArgs, shutdown: impl std::future::Future<Output = ()>) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(&a.listen)
        .await
        .with_context(|| format!("listening on {}", a.listen))?;
    serve_listener(a, listener, shutdown).await
}

/// Serves `a.role` on `listener` until `shutdown`, or until its store stops
/// (a write failed: then an error, so a supervisor restarts it).
pub async fn serve_listener(
    a: StepServeArgs,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let required = |addr: &Option<String>, flag: &str, what: &str| {
        addr.clone()
            .with_context(|| format!("--role {} needs {flag} (the {what}'s address, `outside-serve`)", a.role))
    };
    if let Some(conn) = &a.postgres {
        anyhow::ensure!(
            a.role == Role::Inventory,
            "--postgres: only the inventory keeps its data in PostgreSQL (not --role {})",
            a.role
        );
        return run_pg(conn, &a, listener, shutdown).await;
    }
    match a.role {
        Role::Inventory => run(Inventory, &a, listener, shutdown).await,
        Role::Payment => {
            let provider = required(&a.provider, "--provider", "payment provider")?;
            let payment = Payment {
                provider: Some(OutsideClient::new(OutsideRole::Payment, &provider)),
            };
            run(payment, &a, listener, shutdown).await
        }
        Role::Email => {
            let sender = required(&a.sender, "--sender", "e-mail sender")?;
            let email = Email {
                fail_first_percent: a.fail_first_percent,
                sender: Some(OutsideClient::new(OutsideRole::Email, &sender)),
            };
            run(email, &a, listener, shutdown).await
        }
    }
}

async fn run<H: ShopService>(
    handler: H,
    a: &StepServeArgs,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let data = a
        .data
        .as_deref()
        .context("--data (the service's data directory) is required")?;
    let store = open_store(data, handler, &a.seed()).await?;
    let guard = participant_sdk::server::Guard {
        tls: a.tls.server().context("TLS of the step service")?,
        node_tokens: a.tls.node_tokens()?,
    };
    let stop = {
        let store = store.clone();
        let role = a.role;
        async move {
            tokio::select! {
                _ = shutdown => {}
                f = store.stopped() => tracing::error!(%role, "stopping: {f}"),
            }
        }
    };
    tracing::info!(
        role = %a.role,
        listen = %listener.local_addr().map(|x| x.to_string()).unwrap_or_default(),
        data = %data.display(),
        lose_replies_percent = a.lose_replies_percent,
        fail_first_percent = a.fail_first_percent,
        outside = a.provider.as_deref().or(a.sender.as_deref()).unwrap_or(""),
        in_flight = store.stats().map(|s| s.in_flight).unwrap_or(0),
        "saga step service serving"
    );
    let service = LosingReplies::new(StepServer::new(store.clone()), a.lose_replies_percent);
    let served = participant_sdk::saga::serve_steps_guarded(service, listener, guard, stop).await;
    served.context("serving")?;
    match store.failure() {
        Some(f) => Err(anyhow::anyhow!("{f}")),
        None => Ok(()),
    }
}

/// The inventory on PostgreSQL ([`pg`]) on `listener` until `shutdown`. A
/// lost PostgreSQL does not stop it: calls fail (UNKNOWN to the
/// orchestrator) until the server is back.
async fn run_pg(
    conn: &str,
    a: &StepServeArgs,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let store = pg::open(conn, &a.seed()).await?;
    let guard = participant_sdk::server::Guard {
        tls: a.tls.server().context("TLS of the step service")?,
        node_tokens: a.tls.node_tokens()?,
    };
    tracing::info!(
        role = %a.role,
        listen = %listener.local_addr().map(|x| x.to_string()).unwrap_or_default(),
        postgres = %pg::redact(conn),
        lose_replies_percent = a.lose_replies_percent,
        "saga step service serving"
    );
    let service = LosingReplies::new(
        participant_sdk::saga_pg::PgStepServer::new(store),
        a.lose_replies_percent,
    );
    participant_sdk::saga::serve_steps_guarded(service, listener, guard, shutdown)
        .await
        .context("serving")
}
