//! The inventory on PostgreSQL ([`PgInventory`], on the SDK's
//! [`participant_sdk::saga_pg`] store, ADR 0020): the same actions, answers
//! and version rule as the sled [`crate::services::Inventory`], with the
//! stock in rows of the service's own database, changed in the transaction
//! the store gives each call (the inbox row, the stock and the reservation
//! commit together). `saga-step-serve --role inventory --postgres CONN`
//! serves it; [`audit_pg`] (`saga-step-audit --role inventory --postgres
//! CONN`) reads it into the same [`Audit`] as the sled audit.
//!
//! Tables (created when missing, beside the SDK's `dtx_step_*` tables):
//! - `inventory_skus(sku, initial, stock, reserved, version)`: seeded once,
//!   when the table is empty; `stock + reserved = initial` always;
//! - `inventory_reservations(order_id, operation_id, sku, qty, version)`:
//!   what each reserve holds, deleted by its release;
//! - `inventory_effects(what, order_id, n)`: how many times `reserve` and
//!   `release` were applied per order, never decremented (only the
//!   operation id de-duplicates, so an order reserved twice shows as a
//!   duplicate forward action in the audit).
//!
//! Every database error is an error of the call (`?`), never an answer: the
//! store rolls the call back and the orchestrator takes it as UNKNOWN and
//! asks Status, so an unreachable or killed PostgreSQL never turns a step
//! into FAILED.

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::Context;
use participant_sdk::postgres::HandlerError;
use participant_sdk::saga::StepCall;
use participant_sdk::saga::StepResult;
use participant_sdk::saga_pg::PgStepHandler;
use participant_sdk::saga_pg::PgStepOptions;
use participant_sdk::saga_pg::PgStepStore;
use participant_sdk::saga_pg::Transaction;

use crate::Audit;
use crate::OrderInput;
use crate::ReservationAudit;
use crate::Seed;
use crate::SkuAudit;

/// The service's name in the SDK's shared step tables.
pub const SERVICE: &str = "inventory";

/// The inventory's own tables.
const DDL: &str = "CREATE TABLE IF NOT EXISTS inventory_skus (
        sku text PRIMARY KEY,
        initial bigint NOT NULL,
        stock bigint NOT NULL,
        reserved bigint NOT NULL,
        version bigint NOT NULL);
    CREATE TABLE IF NOT EXISTS inventory_reservations (
        order_id text NOT NULL,
        operation_id text NOT NULL,
        sku text NOT NULL,
        qty bigint NOT NULL,
        version bigint NOT NULL,
        PRIMARY KEY (order_id, operation_id));
    CREATE TABLE IF NOT EXISTS inventory_effects (
        what text NOT NULL,
        order_id text NOT NULL,
        n bigint NOT NULL,
        PRIMARY KEY (what, order_id));";

/// The inventory on PostgreSQL: action [`crate::RESERVE`] (COMPENSABLE,
/// versioned), compensation [`crate::RELEASE`], status query
/// [`crate::RESERVATION`], and [`crate::AMEND`] (a change made outside the
/// saga). See [`crate::services::Inventory`] for the version rule.
#[derive(Clone, Debug, Default)]
pub struct PgInventory;

fn input(call: &StepCall) -> Result<OrderInput, StepResult> {
    serde_json::from_slice(&call.input).map_err(|e| StepResult::failed(format!("the input is not an order: {e}")))
}

fn qty(o: &OrderInput) -> Result<i64, StepResult> {
    i64::try_from(o.qty).map_err(|_| StepResult::failed("out of stock"))
}

async fn bump(tx: &Transaction<'_>, what: &str, order: &str) -> Result<(), HandlerError> {
    tx.execute(
        "INSERT INTO inventory_effects (what, order_id, n) VALUES ($1, $2, 1)
         ON CONFLICT (what, order_id) DO UPDATE SET n = inventory_effects.n + 1",
        &[&what, &order],
    )
    .await?;
    Ok(())
}

impl PgInventory {
    async fn reserve(&self, tx: &Transaction<'_>, call: &StepCall) -> Result<StepResult, HandlerError> {
        let o = match input(call) {
            Ok(o) => o,
            Err(r) => return Ok(r),
        };
        let Some(row) = tx
            .query_opt("SELECT stock FROM inventory_skus WHERE sku = $1 FOR UPDATE", &[&o.sku])
            .await?
        else {
            return Ok(StepResult::failed(format!("unknown sku {:?}", o.sku)));
        };
        let stock: i64 = row.get(0);
        let qty = match qty(&o) {
            Ok(q) if q <= stock => q,
            _ => return Ok(StepResult::failed("out of stock")),
        };
        let version: i64 = tx
            .query_one(
                "UPDATE inventory_skus SET stock = stock - $2, reserved = reserved + $2, version = version + 1
                 WHERE sku = $1 RETURNING version",
                &[&o.sku, &qty],
            )
            .await?
            .get(0);
        tx.execute(
            "INSERT INTO inventory_reservations (order_id, operation_id, sku, qty, version)
             VALUES ($1, $2, $3, $4, $5)",
            &[&o.order, &call.operation_id, &o.sku, &qty, &version],
        )
        .await?;
        bump(tx, "reserve", &o.order).await?;
        Ok(StepResult::ok(version.to_string()))
    }

    async fn release(&self, tx: &Transaction<'_>, call: &StepCall) -> Result<StepResult, HandlerError> {
        let o = match input(call) {
            Ok(o) => o,
            Err(r) => return Ok(r),
        };
        let Some(row) = tx
            .query_opt(
                "SELECT sku, qty, version FROM inventory_reservations
                 WHERE order_id = $1 AND operation_id = $2 FOR UPDATE",
                &[&o.order, &call.forward_operation_id],
            )
            .await?
        else {
            return Ok(StepResult::noop(format!(
                "no reservation of order {} by {} is held (released before)",
                o.order, call.forward_operation_id
            )));
        };
        let (sku, qty, version): (String, i64, i64) = (row.get(0), row.get(1), row.get(2));
        if let Err(stale) = call.check_precondition(&version.to_string()) {
            return Ok(match stale {
                StepResult::Stale { reason, .. } => StepResult::Stale {
                    reason,
                    residual: format!("{qty} of {sku} stay reserved for order {}", o.order),
                },
                other => other,
            });
        }
        let Some(row) = tx
            .query_opt(
                "UPDATE inventory_skus SET stock = stock + $2, reserved = greatest(reserved - $2, 0),
                     version = version + 1
                 WHERE sku = $1 RETURNING version",
                &[&sku, &qty],
            )
            .await?
        else {
            return Ok(StepResult::failed(format!("unknown sku {sku:?}")));
        };
        let sku_version: i64 = row.get(0);
        tx.execute(
            "DELETE FROM inventory_reservations WHERE order_id = $1 AND operation_id = $2",
            &[&o.order, &call.forward_operation_id],
        )
        .await?;
        bump(tx, "release", &o.order).await?;
        Ok(StepResult::ok(sku_version.to_string()))
    }

    /// [`crate::AMEND`]: the order's reservation changed to the input's
    /// `qty` outside the saga; a later release planned on the reserve's
    /// version is then STALE.
    async fn amend(&self, tx: &Transaction<'_>, call: &StepCall) -> Result<StepResult, HandlerError> {
        let o = match input(call) {
            Ok(o) => o,
            Err(r) => return Ok(r),
        };
        let Some(row) = tx
            .query_opt(
                "SELECT operation_id, sku, qty FROM inventory_reservations WHERE order_id = $1
                 ORDER BY operation_id LIMIT 1 FOR UPDATE",
                &[&o.order],
            )
            .await?
        else {
            return Ok(StepResult::failed(format!("order {} holds no reservation", o.order)));
        };
        let (op, sku, held): (String, String, i64) = (row.get(0), row.get(1), row.get(2));
        let stock: i64 = tx
            .query_one("SELECT stock FROM inventory_skus WHERE sku = $1 FOR UPDATE", &[&sku])
            .await?
            .get(0);
        let new = match qty(&o) {
            Ok(q) if q <= stock + held => q,
            _ => return Ok(StepResult::failed("out of stock")),
        };
        let version: i64 = tx
            .query_one(
                "UPDATE inventory_skus SET stock = stock + $2 - $3, reserved = reserved - $2 + $3,
                     version = version + 1
                 WHERE sku = $1 RETURNING version",
                &[&sku, &held, &new],
            )
            .await?
            .get(0);
        tx.execute(
            "UPDATE inventory_reservations SET qty = $3, version = $4 WHERE order_id = $1 AND operation_id = $2",
            &[&o.order, &op, &new, &version],
        )
        .await?;
        Ok(StepResult::ok(version.to_string()))
    }
}

impl PgStepHandler for PgInventory {
    async fn forward(
        &self,
        tx: &Transaction<'_>,
        call: &StepCall,
        _events: &mut Vec<participant_sdk::outbox::OutboxMessage>,
    ) -> Result<StepResult, HandlerError> {
        match call.action.as_str() {
            crate::RESERVE => self.reserve(tx, call).await,
            crate::AMEND => self.amend(tx, call).await,
            other => Ok(StepResult::failed(format!("the inventory has no action {other:?}"))),
        }
    }

    async fn compensate(
        &self,
        tx: &Transaction<'_>,
        call: &StepCall,
        _events: &mut Vec<participant_sdk::outbox::OutboxMessage>,
    ) -> Result<StepResult, HandlerError> {
        if call.action != crate::RELEASE {
            return Ok(StepResult::failed(format!(
                "the inventory has no compensation {:?}",
                call.action
            )));
        }
        self.release(tx, call).await
    }

    fn knows_query(&self, query: &str) -> bool {
        query == crate::RESERVATION
    }
}

/// The store's options for the inventory at `conn`.
fn options(conn: &str) -> PgStepOptions {
    PgStepOptions::new(SERVICE, conn)
}

/// Connects the inventory's store at `conn` (retrying while PostgreSQL is
/// not up yet), creates its tables when missing and seeds them when empty.
pub async fn open(conn: &str, seed: &Seed) -> anyhow::Result<Arc<PgStepStore<PgInventory>>> {
    let store = PgStepStore::connect(options(conn), PgInventory)
        .await
        .with_context(|| format!("the inventory's database ({})", redact(conn)))?;
    let mut c = store
        .pool()
        .get()
        .await
        .context("a connection to the inventory's database")?;
    c.batch_execute(DDL).await.context("creating the inventory's tables")?;
    let tx = c.transaction().await?;
    tx.execute("LOCK TABLE inventory_skus IN EXCLUSIVE MODE", &[]).await?;
    let n: i64 = tx.query_one("SELECT count(*) FROM inventory_skus", &[]).await?.get(0);
    if n == 0 {
        let stock = i64::try_from(seed.stock).context("--stock")?;
        for i in 0..seed.skus {
            tx.execute(
                "INSERT INTO inventory_skus (sku, initial, stock, reserved, version) VALUES ($1, $2, $2, 0, 0)",
                &[&crate::services::sku_name(i), &stock],
            )
            .await?;
        }
    }
    tx.commit().await.context("seeding the inventory")?;
    Ok(store)
}

/// A connection string without its password (for messages).
pub fn redact(conn: &str) -> String {
    conn.split_whitespace()
        .map(|kv| {
            if kv.starts_with("password=") {
                "password=..."
            } else {
                kv
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The audit of the inventory's database at `conn` (the service may run;
/// for a settled count, stop it first): the same [`Audit`] as the sled
/// audit's ([`crate::audit`]), with `store` "postgres".
pub async fn audit_pg(conn: &str) -> anyhow::Result<Audit> {
    let mut o = options(conn);
    o.connect_attempts = 3;
    o.concurrency = 2;
    let store = PgStepStore::connect(o, PgInventory)
        .await
        .with_context(|| format!("the inventory's database ({})", redact(conn)))?;
    let stats = store.stats().await?;
    let mut a = Audit {
        role: crate::Role::Inventory.to_string(),
        store: "postgres".into(),
        inbox_forward: stats.forward_records,
        inbox_compensate: stats.compensate_records,
        forward_duplicates_seen: stats.forward_duplicates,
        compensate_duplicates_seen: stats.compensate_duplicates,
        outbox_pending: stats.outbox_pending,
        in_flight: stats.in_flight,
        ..Audit::default()
    };
    let c = store
        .pool()
        .get()
        .await
        .context("a connection to the inventory's database")?;
    let present: bool = c
        .query_one("SELECT to_regclass('inventory_skus') IS NOT NULL", &[])
        .await?
        .get(0);
    anyhow::ensure!(present, "{} holds no inventory (no table inventory_skus)", redact(conn));
    let n = |v: i64| u64::try_from(v).unwrap_or(0);
    let mut held: BTreeMap<String, u64> = BTreeMap::new();
    for r in c
        .query("SELECT order_id, sku, qty FROM inventory_reservations", &[])
        .await?
    {
        let (order, sku, qty): (String, String, i64) = (r.get(0), r.get(1), r.get(2));
        if qty < 0 {
            a.problems
                .push(format!("order {order}: a reservation of {qty} of {sku}"));
        }
        a.reservations.entry(order).or_default().reserved_qty += n(qty);
        *held.entry(sku).or_default() += n(qty);
    }
    for r in c.query("SELECT what, order_id, n FROM inventory_effects", &[]).await? {
        let (what, order, count): (String, String, i64) = (r.get(0), r.get(1), r.get(2));
        let e: &mut ReservationAudit = a.reservations.entry(order).or_default();
        match what.as_str() {
            "reserve" => e.reserves_applied = n(count),
            "release" => e.releases_applied = n(count),
            other => a.problems.push(format!("an effect count of unknown kind {other:?}")),
        }
    }
    for r in c
        .query(
            "SELECT sku, initial, stock, reserved FROM inventory_skus ORDER BY sku",
            &[],
        )
        .await?
    {
        let (sku, initial, stock, reserved): (String, i64, i64, i64) = (r.get(0), r.get(1), r.get(2), r.get(3));
        let conserved = stock >= 0 && reserved >= 0 && stock + reserved == initial;
        if !conserved {
            a.problems.push(format!(
                "{sku}: stock {stock} + reserved {reserved} != initial {initial}"
            ));
        }
        let h = held.remove(&sku).unwrap_or(0);
        if h != n(reserved) {
            a.problems
                .push(format!("{sku}: {reserved} reserved, but the reservations hold {h}"));
        }
        a.skus.insert(
            sku,
            SkuAudit {
                initial: n(initial),
                stock: n(stock),
                reserved: n(reserved),
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
    Ok(a)
}
