//! The textbook distributed transaction, on PostgreSQL: placing an order
//! records it at the order service, reserves its stock at the inventory
//! service and charges the customer at the payment service, each service
//! with its own PostgreSQL database, together or not at all.
//!
//! Each service is a PostgreSQL participant of the SDK
//! (`participant_sdk::postgres`): its handler does the order's SQL inside
//! the PostgreSQL transaction that Prepare ends with `PREPARE TRANSACTION`,
//! and refuses (votes NO, with the reason) when the stock or the balance
//! is short. `dtx-dev demo --postgres` runs the three services against
//! a three-node cluster under leader kills and service kill -9, then
//! audits the three databases ([`audit`]).
//!
//! Every participant gets the same payload, [`Order::payload`]; each takes
//! the fields it needs.

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use dtx_client::Client;
use dtx_client::ClientError;
use dtx_client::ParticipantSpec;
use dtx_client::TxOutcome;
use participant_sdk::participant::Verdict;
use participant_sdk::postgres::HandlerError;
use participant_sdk::postgres::PgHandler;
use participant_sdk::postgres::PgOptions;
use participant_sdk::postgres::PgParticipant;
use participant_sdk::postgres::Transaction;
use tonic::transport::Channel;

/// One of the three services.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Role {
    /// The orders table.
    Orders,
    /// Stock and reservations.
    Inventory,
    /// Balances and payments.
    Payment,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::Orders, Role::Inventory, Role::Payment];

    /// The service's participant id (as enlisted) and database name.
    pub fn id(self) -> &'static str {
        match self {
            Role::Orders => "orders",
            Role::Inventory => "inventory",
            Role::Payment => "payment",
        }
    }

    pub fn database(self) -> &'static str {
        match self {
            Role::Orders => "shop_orders",
            Role::Inventory => "shop_inventory",
            Role::Payment => "shop_payment",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.id())
    }
}

/// What the shop starts with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seed {
    /// Products `sku0` .. `sku<n-1>`, each with `stock` units.
    pub skus: usize,
    pub stock: i32,
    /// Customers `c0` .. `c<n-1>`, each with `balance`.
    pub customers: usize,
    pub balance: i64,
}

impl Default for Seed {
    fn default() -> Self {
        Seed {
            skus: 50,
            stock: 500,
            customers: 100,
            balance: 10_000,
        }
    }
}

/// The shop's own APIs and its typed payload (`proto/shop/v1/shop.proto`).
pub mod pb {
    tonic::include_proto!("shop.v1");
}

pub mod branches;

/// An order: what every service of its transaction gets (as a protobuf
/// message, [`Order::payload`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Order {
    pub id: String,
    pub customer: String,
    pub sku: String,
    pub qty: i32,
    /// The whole order's price.
    pub price: i64,
}

impl Order {
    /// The order as the shop's protobuf message (`shop.v1.Order`).
    pub fn to_pb(&self) -> pb::Order {
        pb::Order {
            order_id: self.id.clone(),
            customer: self.customer.clone(),
            sku: self.sku.clone(),
            qty: self.qty,
            price: self.price,
        }
    }

    /// Checks a `shop.v1.Order`; the error says what is wrong with it.
    pub fn from_pb(o: pb::Order) -> Result<Order, String> {
        let id_ok = !o.order_id.is_empty()
            && o.order_id.len() <= 64
            && o.order_id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if !id_ok {
            return Err(format!(
                "order id {:?}: use 1 to 64 letters, digits, '-' or '_'",
                o.order_id
            ));
        }
        for (what, v) in [("customer", &o.customer), ("sku", &o.sku)] {
            if v.is_empty() || v.len() > 64 {
                return Err(format!("order {}: {what} {v:?} must be 1 to 64 bytes", o.order_id));
            }
        }
        if o.qty <= 0 || o.price < 0 {
            return Err(format!(
                "order {} has qty {} and price {}; qty must be > 0, price >= 0",
                o.order_id, o.qty, o.price
            ));
        }
        Ok(Order {
            id: o.order_id,
            customer: o.customer,
            sku: o.sku,
            qty: o.qty,
            price: o.price,
        })
    }

    /// The payload a Prepare-driven participant gets: the order encoded as
    /// `shop.v1.Order`.
    pub fn payload(&self) -> Vec<u8> {
        use prost::Message;
        self.to_pb().encode_to_vec()
    }

    /// Reads a payload; the error says what is wrong with it.
    pub fn parse(payload: &[u8]) -> Result<Order, String> {
        use prost::Message;
        let o = pb::Order::decode(payload).map_err(|e| format!("the payload is not a shop.v1.Order: {e}"))?;
        Order::from_pb(o)
    }

    /// A random order of `qty` 1..=3 units at 10..=40 each.
    pub fn random(id: String, seed: &Seed) -> Order {
        use rand::Rng;
        let mut rng = rand::rng();
        let qty = rng.random_range(1..=3);
        Order {
            id,
            customer: format!("c{}", rng.random_range(0..seed.customers)),
            sku: format!("sku{}", rng.random_range(0..seed.skus)),
            qty,
            price: i64::from(qty) * rng.random_range(10..=40),
        }
    }
}

/// The service's tables, created when missing (one statement each).
pub fn schema(role: Role) -> &'static [&'static str] {
    match role {
        Role::Orders => &["CREATE TABLE IF NOT EXISTS orders (
                order_id text PRIMARY KEY,
                customer text NOT NULL,
                sku text NOT NULL,
                qty integer NOT NULL CHECK (qty > 0),
                price bigint NOT NULL CHECK (price >= 0),
                txid bigint NOT NULL)"],
        Role::Inventory => &[
            "CREATE TABLE IF NOT EXISTS stock (
                sku text PRIMARY KEY,
                available integer NOT NULL CHECK (available >= 0),
                reserved integer NOT NULL CHECK (reserved >= 0))",
            "CREATE TABLE IF NOT EXISTS reservations (
                order_id text PRIMARY KEY,
                sku text NOT NULL,
                qty integer NOT NULL,
                txid bigint NOT NULL)",
        ],
        Role::Payment => &[
            "CREATE TABLE IF NOT EXISTS balances (
                customer text PRIMARY KEY,
                amount bigint NOT NULL CHECK (amount >= 0))",
            "CREATE TABLE IF NOT EXISTS payments (
                order_id text PRIMARY KEY,
                customer text NOT NULL,
                amount bigint NOT NULL,
                txid bigint NOT NULL)",
        ],
    }
}

/// The tables of `role`, as named in [`schema`].
fn tables(role: Role) -> &'static [&'static str] {
    match role {
        Role::Orders => &["orders"],
        Role::Inventory => &["stock", "reservations"],
        Role::Payment => &["balances", "payments"],
    }
}

/// Creates the service's tables and its initial rows (stock or balances)
/// in one local transaction, the first time; does nothing (touches no
/// table) once they exist. A restarted service must not wait here: its
/// prepared transactions, which only its own recovery resolves, hold row
/// locks that a seeding insert would wait for.
pub async fn install(db: &mut tokio_postgres::Client, role: Role, seed: &Seed) -> Result<(), tokio_postgres::Error> {
    let mut missing = false;
    for t in tables(role) {
        let exists: bool = db.query_one("SELECT to_regclass($1) IS NOT NULL", &[t]).await?.get(0);
        missing |= !exists;
    }
    if !missing {
        return Ok(());
    }
    let tx = db.transaction().await?;
    for stmt in schema(role) {
        tx.batch_execute(stmt).await?;
    }
    match role {
        Role::Orders => {}
        Role::Inventory => {
            for i in 0..seed.skus {
                tx.execute(
                    "INSERT INTO stock (sku, available, reserved) VALUES ($1, $2, 0) ON CONFLICT DO NOTHING",
                    &[&format!("sku{i}"), &seed.stock],
                )
                .await?;
            }
        }
        Role::Payment => {
            for i in 0..seed.customers {
                tx.execute(
                    "INSERT INTO balances (customer, amount) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                    &[&format!("c{i}"), &seed.balance],
                )
                .await?;
            }
        }
    }
    tx.commit().await
}

/// The service's part of placing an order, inside the transaction that
/// Prepare then prepares: YES with its rows written (the stock reserved,
/// the customer charged, the order recorded), or NO with the reason (short
/// stock, short balance, unknown product or customer, a bad payload, or a
/// product or customer row held by another order in progress: see
/// [`lock_row`]). The row locks keep concurrent orders for the same product
/// or customer apart until the decision.
pub async fn prepare(
    role: Role,
    tx: &Transaction<'_>,
    txid: u64,
    payload: &[u8],
) -> Result<Verdict, tokio_postgres::Error> {
    match Order::parse(payload) {
        Ok(order) => prepare_order(role, tx, txid, &order).await,
        Err(why) => Ok(Verdict::no(why)),
    }
}

/// [`prepare`] for an order already read: the SQL of `role`'s part, the
/// same in both shapes (a Prepare's handler, or a branch's request
/// handler, [`branches`]).
pub async fn prepare_order(
    role: Role,
    tx: &Transaction<'_>,
    txid: u64,
    order: &Order,
) -> Result<Verdict, tokio_postgres::Error> {
    let txid = txid as i64;
    match role {
        Role::Orders => {
            let n = tx
                .execute(
                    "INSERT INTO orders (order_id, customer, sku, qty, price, txid) VALUES ($1, $2, $3, $4, $5, $6)
                     ON CONFLICT (order_id) DO NOTHING",
                    &[&order.id, &order.customer, &order.sku, &order.qty, &order.price, &txid],
                )
                .await?;
            if n == 0 {
                return Ok(Verdict::no(format!("order {} exists already", order.id)));
            }
        }
        Role::Inventory => {
            let available = match lock_row(
                tx,
                "SELECT available FROM stock WHERE sku = $1 FOR UPDATE NOWAIT",
                &order.sku,
            )
            .await?
            {
                Locked::Busy => {
                    return Ok(Verdict::no(format!(
                        "{} is held by another order being placed",
                        order.sku
                    )))
                }
                Locked::Missing => return Ok(Verdict::no(format!("no product {:?}", order.sku))),
                Locked::Row(r) => r.get::<_, i32>(0),
            };
            if available < order.qty {
                return Ok(Verdict::no(format!(
                    "{} has {available} available, the order wants {}",
                    order.sku, order.qty
                )));
            }
            tx.execute(
                "UPDATE stock SET available = available - $2, reserved = reserved + $2 WHERE sku = $1",
                &[&order.sku, &order.qty],
            )
            .await?;
            let n = tx
                .execute(
                    "INSERT INTO reservations (order_id, sku, qty, txid) VALUES ($1, $2, $3, $4)
                     ON CONFLICT (order_id) DO NOTHING",
                    &[&order.id, &order.sku, &order.qty, &txid],
                )
                .await?;
            if n == 0 {
                return Ok(Verdict::no(format!("order {} is reserved already", order.id)));
            }
        }
        Role::Payment => {
            let amount = match lock_row(
                tx,
                "SELECT amount FROM balances WHERE customer = $1 FOR UPDATE NOWAIT",
                &order.customer,
            )
            .await?
            {
                Locked::Busy => {
                    return Ok(Verdict::no(format!(
                        "{} is paying for another order being placed",
                        order.customer
                    )))
                }
                Locked::Missing => return Ok(Verdict::no(format!("no customer {:?}", order.customer))),
                Locked::Row(r) => r.get::<_, i64>(0),
            };
            if amount < order.price {
                return Ok(Verdict::no(format!(
                    "{} has {amount}, the order costs {}",
                    order.customer, order.price
                )));
            }
            tx.execute(
                "UPDATE balances SET amount = amount - $2 WHERE customer = $1",
                &[&order.customer, &order.price],
            )
            .await?;
            let n = tx
                .execute(
                    "INSERT INTO payments (order_id, customer, amount, txid) VALUES ($1, $2, $3, $4)
                     ON CONFLICT (order_id) DO NOTHING",
                    &[&order.id, &order.customer, &order.price, &txid],
                )
                .await?;
            if n == 0 {
                return Ok(Verdict::no(format!("order {} is paid already", order.id)));
            }
        }
    }
    Ok(Verdict::yes())
}

/// A service's handler: [`prepare`] for its role.
pub struct ShopHandler(pub Role);

impl PgHandler for ShopHandler {
    async fn prepare(
        &self,
        tx: &Transaction<'_>,
        txid: participant_sdk::GlobalTxid,
        payload: &[u8],
    ) -> Result<Verdict, HandlerError> {
        // The rows note the txid alone (for people reading them); the order
        // id keys them, and the gid and the log keep the incarnation.
        Ok(prepare(self.0, tx, txid.txid, payload).await?)
    }
}

/// A running service as clients enlist it: (role, address).
pub type Service = (Role, String);

/// Places `order` as one `BeginAndCommit` under `key` with the three
/// services (each gets the order's payload); returns the txid if one is
/// known and the caller's view of the outcome (UNKNOWN is never reported
/// as a failure; the same key and request find the transaction again, so
/// an answerless UNKNOWN is asked a few more times).
pub async fn place_order(
    client: &Client,
    key: &str,
    order: &Order,
    services: &[Service],
) -> (Option<u64>, Result<TxOutcome, ClientError>) {
    let parts: Vec<ParticipantSpec> = services
        .iter()
        .map(|(role, addr)| ParticipantSpec {
            participant_id: role.id().to_string(),
            address: addr.clone(),
            payload: order.payload(),
        })
        .collect();
    // UNKNOWN without a txid (no answer at all): the same key and request
    // find the transaction again, so ask a few more times.
    let res = client
        .begin_and_commit_retrying(key, 10_000, b"order", &parts, 3, Duration::from_millis(500))
        .await;
    match res {
        Ok(r) => (r.txid, Ok(r.outcome)),
        Err(e) => (None, Err(e)),
    }
}

/// The arguments of `dtx-dev shop-serve` for `role` listening on
/// `addr`, on the database of `pg_conn`, recovering through `cluster`.
pub fn serve_args(role: Role, addr: &str, pg_conn: &str, cluster: &[String]) -> Vec<std::ffi::OsString> {
    [
        "shop-serve",
        "--role",
        role.id(),
        "--listen",
        addr,
        "--postgres",
        pg_conn,
        "--cluster",
        &cluster.join(","),
    ]
    .iter()
    .map(Into::into)
    .collect()
}

/// Where the shop written as branches serves its own APIs.
#[derive(Clone, Debug)]
pub struct AppAddrs {
    pub orders: String,
    pub inventory: String,
    pub payment: String,
}

impl AppAddrs {
    /// The API address of `role`.
    pub fn of(&self, role: Role) -> &str {
        match role {
            Role::Orders => &self.orders,
            Role::Inventory => &self.inventory,
            Role::Payment => &self.payment,
        }
    }

    /// The extra `shop-serve` arguments of `role` serving its API (the
    /// order service also names the other two).
    pub fn args(&self, role: Role) -> Vec<std::ffi::OsString> {
        let mut v: Vec<std::ffi::OsString> = vec!["--app-listen".into(), self.of(role).into()];
        if role == Role::Orders {
            v.extend([
                "--inventory-api".into(),
                self.inventory.clone().into(),
                "--payment-api".into(),
                self.payment.clone().into(),
            ]);
        }
        v
    }
}

/// Places `order` through the order service's API at `orders_api` (the
/// shop written as branches): the txid if the service began one, and the
/// outcome (UNKNOWN when the call got no answer: the order may still
/// commit, ask again by its id).
pub async fn place_order_via_api(orders_api: &Channel, order: &Order) -> (Option<u64>, TxOutcome, String) {
    let mut api = pb::order_service_client::OrderServiceClient::new(orders_api.clone());
    let mut req = tonic::Request::new(pb::PlaceOrderRequest {
        order: Some(order.to_pb()),
    });
    req.set_timeout(Duration::from_secs(20));
    match api.place_order(req).await {
        Ok(r) => {
            let r = r.into_inner();
            let outcome = match r.outcome() {
                pb::OrderOutcome::Committed => TxOutcome::Committed,
                pb::OrderOutcome::Aborted => TxOutcome::Aborted,
                pb::OrderOutcome::Unknown | pb::OrderOutcome::Unspecified => TxOutcome::Unknown,
            };
            ((r.txid != 0).then_some(r.txid), outcome, r.reason)
        }
        Err(s) => (None, TxOutcome::Unknown, format!("{}: {}", s.code(), s.message())),
    }
}

#[derive(clap::Args, Debug)]
pub struct ShopServeArgs {
    /// Which service this is.
    #[arg(long, value_enum)]
    pub role: Role,
    #[arg(long)]
    pub listen: String,
    /// The service's PostgreSQL database, as a tokio-postgres connection
    /// string (`host=127.0.0.1 port=5432 user=.. dbname=shop_orders`).
    #[arg(long)]
    pub postgres: String,
    /// Coordinator API addresses, comma-separated (for recovery).
    #[arg(long, value_delimiter = ',')]
    pub cluster: Vec<String>,
    /// Messages handled at once (pooled connections); PostgreSQL's
    /// `max_prepared_transactions` must be at least this.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// The PostgreSQL participant's pool and handler limits.
    #[command(flatten)]
    pub pg: participant_sdk::postgres::PgTuningArgs,
    #[arg(long, default_value_t = Seed::default().skus)]
    pub skus: usize,
    #[arg(long, default_value_t = Seed::default().stock)]
    pub stock: i32,
    #[arg(long, default_value_t = Seed::default().customers)]
    pub customers: usize,
    #[arg(long, default_value_t = Seed::default().balance)]
    pub balance: i64,
    /// Serve the shop's own API on this address (the shop written as
    /// branches, [`branches`]): the role's `shop.v1` service
    /// (OrderService, InventoryService or PaymentService), plain text.
    #[arg(long)]
    pub app_listen: Option<String>,
    /// With --role orders and --app-listen: the inventory service's API
    /// address.
    #[arg(long, requires = "app_listen")]
    pub inventory_api: Option<String>,
    /// With --role orders and --app-listen: the payment service's API
    /// address.
    #[arg(long, requires = "app_listen")]
    pub payment_api: Option<String>,
    #[command(flatten)]
    pub tls: dtx_tls::args::TlsArgs,
}

/// `dtx-dev shop-serve`: one shop service on its PostgreSQL database
/// until SIGTERM: creates its tables (and initial rows) when missing,
/// checks PostgreSQL at start (see `PgParticipant::connect`), runs
/// recovery (which also resolves prepared transactions a crash left
/// behind) and serves the participant API.
pub async fn serve(a: ShopServeArgs, shutdown: impl std::future::Future<Output = ()>) -> anyhow::Result<()> {
    let seed = Seed {
        skus: a.skus,
        stock: a.stock,
        customers: a.customers,
        balance: a.balance,
    };
    let id = a.role.id();
    let mut opts = PgOptions::new(id, a.postgres.clone());
    opts.concurrency = a.concurrency;
    a.pg.apply(&mut opts);
    let participant = Arc::new(
        PgParticipant::connect(opts, ShopHandler(a.role))
            .await
            .with_context(|| format!("{id}: PostgreSQL participant"))?,
    );
    let mut db = participant_sdk::postgres::connect(&a.postgres)
        .await
        .with_context(|| format!("{id}: cannot connect to PostgreSQL to create the tables"))?;
    install(&mut db, a.role, &seed)
        .await
        .with_context(|| format!("{id}: creating the tables"))?;
    drop(db);
    let mut recovery = participant_sdk::server::RecoveryOptions::for_service(id, &a.listen);
    recovery.tls = a.tls.client().context("TLS of the calls to the cluster")?;
    recovery.token = a.tls.token()?;
    let guard = participant_sdk::server::Guard {
        tls: a.tls.server().context("TLS of the participant service")?,
        node_tokens: a.tls.node_tokens()?,
    };
    let listener = tokio::net::TcpListener::bind(&a.listen)
        .await
        .with_context(|| format!("cannot listen on {}", a.listen))?;
    let app = match &a.app_listen {
        Some(addr) => Some(serve_app(&a, addr, participant.clone(), &recovery).await?),
        None => None,
    };
    tracing::info!(id, listen = %a.listen, "shop service started");
    let served =
        participant_sdk::server::serve_guarded(participant, id, listener, a.cluster.clone(), recovery, guard, shutdown)
            .await;
    if let Some(app) = app {
        app.abort();
    }
    served?;
    Ok(())
}

/// Starts the role's `shop.v1` API on `addr` (the shop written as
/// branches), registering through a client of the recovery settings'
/// TLS and token with an order's deadlines; it serves until aborted.
async fn serve_app(
    a: &ShopServeArgs,
    addr: &str,
    participant: Arc<PgParticipant<ShopHandler>>,
    recovery: &participant_sdk::server::RecoveryOptions,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let mut cfg = recovery.client_config(a.cluster.clone());
    cfg.call_deadline = Duration::from_secs(8);
    cfg.attempt_timeout = Duration::from_secs(4);
    let cluster = Arc::new(Client::new(cfg).context("the client of the shop's API")?);
    let api = branches::ServiceApi::new(a.role, participant, cluster, &a.listen);
    let router = match a.role {
        Role::Inventory => tonic::transport::Server::builder()
            .layer(dtx_client::propagate::InboundTxidLayer)
            .add_service(pb::inventory_service_server::InventoryServiceServer::new(api)),
        Role::Payment => tonic::transport::Server::builder()
            .layer(dtx_client::propagate::InboundTxidLayer)
            .add_service(pb::payment_service_server::PaymentServiceServer::new(api)),
        Role::Orders => {
            let (Some(inventory), Some(payment)) = (&a.inventory_api, &a.payment_api) else {
                anyhow::bail!("--role orders with --app-listen needs --inventory-api and --payment-api");
            };
            let orders = branches::OrdersApi::new(api, inventory, payment)?;
            tonic::transport::Server::builder()
                .layer(dtx_client::propagate::InboundTxidLayer)
                .add_service(pb::order_service_server::OrderServiceServer::new(orders))
        }
    };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr} (--app-listen)"))?;
    tracing::info!(role = %a.role, app_listen = %addr, "shop API started");
    let server = router.serve_with_incoming(dtx_tls::incoming(listener, None));
    Ok(tokio::spawn(async move {
        if let Err(e) = server.await {
            tracing::error!("shop API stopped: {e}");
        }
    }))
}

/// A row read `FOR UPDATE NOWAIT`.
enum Locked {
    Row(tokio_postgres::Row),
    Missing,
    /// Another transaction holds it: in a distributed transaction that is
    /// another order being placed (prepared, or still preparing here).
    Busy,
}

/// Locks the row `query` (one `$1` parameter, `FOR UPDATE NOWAIT`) finds.
/// A row held by another transaction is refused at once rather than waited
/// for: the holder may be a prepared transaction waiting for its decision,
/// and that decision may wait for this one (a deadlock across databases
/// that no single PostgreSQL can see), so the order votes NO instead.
async fn lock_row(tx: &Transaction<'_>, query: &str, key: &str) -> Result<Locked, tokio_postgres::Error> {
    match tx.query_opt(query, &[&key]).await {
        Ok(Some(r)) => Ok(Locked::Row(r)),
        Ok(None) => Ok(Locked::Missing),
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) => Ok(Locked::Busy),
        Err(e) => Err(e),
    }
}

/// What the audit found; `problems` empty means it passed.
#[derive(Debug, Default)]
pub struct AuditReport {
    pub orders: usize,
    pub reservations: usize,
    pub payments: usize,
    /// Prepared transactions still open in the three databases.
    pub prepared_left: i64,
    pub problems: Vec<String>,
}

impl AuditReport {
    pub fn passed(&self) -> bool {
        self.problems.is_empty()
    }
}

async fn order_ids(db: &tokio_postgres::Client, table: &str) -> Result<BTreeMap<String, i64>, tokio_postgres::Error> {
    let rows = db.query(&format!("SELECT order_id, txid FROM {table}"), &[]).await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// Checks the three databases (quiet: nothing in flight) against the seed
/// and against what the clients were told:
/// - stock: for each product, available + reserved = the initial stock, and
///   reserved = the units of its reservations;
/// - money: balances + payments = the initial balances;
/// - every order has its reservation and its payment, and neither exists
///   without its order, all written by the same transaction;
/// - no prepared transaction is left in any of the three databases;
/// - every order a client was told committed is there, and none it was
///   told aborted (`told`: order id → committed?).
pub async fn audit(
    orders_db: &tokio_postgres::Client,
    inventory_db: &tokio_postgres::Client,
    payment_db: &tokio_postgres::Client,
    seed: &Seed,
    told: &BTreeMap<String, bool>,
) -> Result<AuditReport, tokio_postgres::Error> {
    let mut r = AuditReport::default();
    let orders = order_ids(orders_db, "orders").await?;
    let reservations = order_ids(inventory_db, "reservations").await?;
    let payments = order_ids(payment_db, "payments").await?;
    r.orders = orders.len();
    r.reservations = reservations.len();
    r.payments = payments.len();

    for row in inventory_db
        .query(
            "SELECT s.sku, s.available, s.reserved, COALESCE((SELECT sum(qty) FROM reservations v WHERE v.sku = s.sku), 0)::integer
             FROM stock s ORDER BY s.sku",
            &[],
        )
        .await?
    {
        let (sku, available, reserved, in_reservations): (String, i32, i32, i32) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        if available + reserved != seed.stock {
            r.problems.push(format!(
                "{sku}: available {available} + reserved {reserved} = {}, not the initial {}",
                available + reserved,
                seed.stock
            ));
        }
        if reserved != in_reservations {
            r.problems.push(format!(
                "{sku}: reserved {reserved} but its reservations hold {in_reservations}"
            ));
        }
    }
    let money = payment_db
        .query_one(
            "SELECT (SELECT COALESCE(sum(amount), 0) FROM balances)::bigint,
                    (SELECT COALESCE(sum(amount), 0) FROM payments)::bigint",
            &[],
        )
        .await?;
    let (balances, paid): (i64, i64) = (money.get(0), money.get(1));
    let initial = seed.customers as i64 * seed.balance;
    if balances + paid != initial {
        r.problems.push(format!(
            "money: balances {balances} + payments {paid} = {}, not the initial {initial}",
            balances + paid
        ));
    }

    let all: BTreeSet<&String> = orders
        .keys()
        .chain(reservations.keys())
        .chain(payments.keys())
        .collect();
    for id in all {
        let (o, v, p) = (orders.get(id), reservations.get(id), payments.get(id));
        if o.is_none() || v.is_none() || p.is_none() {
            r.problems.push(format!(
                "order {id}: order {}, reservation {}, payment {} (all three or none)",
                present(o),
                present(v),
                present(p)
            ));
        } else if !(o == v && v == p) {
            r.problems.push(format!(
                "order {id}: written by different transactions (order {o:?}, reservation {v:?}, payment {p:?})"
            ));
        }
    }
    for (id, committed) in told {
        match (committed, orders.contains_key(id)) {
            (true, false) => r.problems.push(format!(
                "order {id}: the client was told COMMITTED, but it is not there"
            )),
            (false, true) => r
                .problems
                .push(format!("order {id}: the client was told ABORTED, but it is there")),
            _ => {}
        }
    }
    for (role, db) in [
        (Role::Orders, orders_db),
        (Role::Inventory, inventory_db),
        (Role::Payment, payment_db),
    ] {
        let left = participant_sdk::postgres::prepared_in_database(db).await?;
        if left > 0 {
            r.problems.push(format!(
                "{role}: {left} prepared transaction(s) left in {}",
                role.database()
            ));
        }
        r.prepared_left += left;
    }
    Ok(r)
}

fn present(x: Option<&i64>) -> String {
    match x {
        Some(t) => format!("by transaction {t}"),
        None => "missing".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payload_reads_back_as_the_order_it_was_made_from() {
        let o = Order {
            id: "o-1-2".into(),
            customer: "c3".into(),
            sku: "sku4".into(),
            qty: 2,
            price: 60,
        };
        assert_eq!(Order::parse(&o.payload()), Ok(o));
    }

    #[test]
    fn a_bad_payload_is_refused_with_what_is_wrong() {
        let good = Order {
            id: "o".into(),
            customer: "c".into(),
            sku: "s".into(),
            qty: 1,
            price: 1,
        };
        let with = |f: &dyn Fn(&mut pb::Order)| {
            let mut o = good.to_pb();
            f(&mut o);
            use prost::Message;
            Order::parse(&o.encode_to_vec()).unwrap_err()
        };
        assert!(with(&|o| o.qty = 0).contains("qty must be > 0"));
        assert!(with(&|o| o.price = -1).contains("price >= 0"));
        assert!(with(&|o| o.sku.clear()).contains("sku"));
        assert!(with(&|o| o.order_id = "a;b".into()).contains("order id"));
        assert!(Order::parse(&[0xff, 0xff]).unwrap_err().contains("not a shop.v1.Order"));
    }
}
