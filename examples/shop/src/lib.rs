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

/// An order: the payload every participant of its transaction gets.
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
    /// `order=<id>;customer=<c>;sku=<s>;qty=<n>;price=<p>`.
    pub fn payload(&self) -> Vec<u8> {
        format!(
            "order={};customer={};sku={};qty={};price={}",
            self.id, self.customer, self.sku, self.qty, self.price
        )
        .into_bytes()
    }

    /// Reads a payload; the error says what is wrong with it.
    pub fn parse(payload: &[u8]) -> Result<Order, String> {
        let text = std::str::from_utf8(payload).map_err(|_| "the order payload is not UTF-8".to_string())?;
        let mut fields: BTreeMap<&str, &str> = BTreeMap::new();
        for item in text.split(';').filter(|i| !i.is_empty()) {
            let (k, v) = item
                .split_once('=')
                .ok_or_else(|| format!("order payload item {item:?} is not key=value"))?;
            fields.insert(k, v);
        }
        let get = |k: &str| {
            fields
                .get(k)
                .copied()
                .filter(|v| !v.is_empty())
                .ok_or_else(|| format!("order payload has no {k}"))
        };
        let qty: i32 = get("qty")?
            .parse()
            .map_err(|_| format!("order payload qty {:?} is not a number", fields["qty"]))?;
        let price: i64 = get("price")?
            .parse()
            .map_err(|_| format!("order payload price {:?} is not a number", fields["price"]))?;
        if qty <= 0 || price < 0 {
            return Err(format!(
                "order payload has qty {qty} and price {price}; qty must be > 0, price >= 0"
            ));
        }
        Ok(Order {
            id: get("order")?.to_string(),
            customer: get("customer")?.to_string(),
            sku: get("sku")?.to_string(),
            qty,
            price,
        })
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
    let order = match Order::parse(payload) {
        Ok(o) => o,
        Err(why) => return Ok(Verdict::no(why)),
    };
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
    tracing::info!(id, listen = %a.listen, "shop service started");
    participant_sdk::server::serve_guarded(participant, id, listener, a.cluster.clone(), recovery, guard, shutdown)
        .await?;
    Ok(())
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
        assert_eq!(
            Order::parse(b"order=o;customer=c;sku=s;qty=x;price=1"),
            Err("order payload qty \"x\" is not a number".into())
        );
        assert_eq!(
            Order::parse(b"order=o;customer=c;qty=1;price=1"),
            Err("order payload has no sku".into())
        );
        assert!(Order::parse(b"order=o;customer=c;sku=s;qty=0;price=1")
            .unwrap_err()
            .contains("qty must be > 0"));
        assert!(Order::parse(&[0xff]).unwrap_err().contains("UTF-8"));
    }
}
