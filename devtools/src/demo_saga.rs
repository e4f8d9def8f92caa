//! `dtx-dev demo --saga`: the order saga (docs/sagas.md). A three-node
//! coordinator cluster, the saga's three step services
//! (`dtx-dev saga-step-serve`) and the outside world they call
//! (`dtx-dev outside-serve`: a payment provider and an e-mail sender), all
//! real processes: inventory (reserve stock: COMPENSABLE), payment (charge
//! the card at the payment provider: the PIVOT; the provider loses 20% of its
//! replies after charging, so the payment service must settle them by asking
//! the provider, ADR 0034) and e-mail (the confirmation through the e-mail
//! sender: RETRIABLE; "mail server busy" 20% of the time). Clients start
//! order sagas (mostly good orders, about 10% above the customer's balance,
//! about 5% out of stock; the idempotency key is the order id, so a start
//! whose answer was lost is simply asked again) while the leader is killed
//! with SIGKILL every `--kill-every-secs`, and, half-way between, a step
//! service (each in turn, restarted a second later). At the end every saga
//! must have ended (or parked, with its reason), and the audit reads the
//! three services' data and the outside world's records: stock and money
//! conserved, every completed order reserved, charged and confirmed exactly
//! once (at the provider and the sender too), every compensated order holding
//! no stock and its card never charged, no forward action applied twice.
//! Exits non-zero if the audit fails.
//!
//! The inventory keeps its stock in PostgreSQL (`saga-step-serve --postgres`,
//! the SDK's `saga_pg` store) on a server the demo starts in a temporary
//! folder, when the PostgreSQL server binaries are installed
//! (`--inventory-store auto`, the default; `postgres` insists, `sled` keeps
//! it in its data directory). PostgreSQL then takes its turn in the kills:
//! SIGKILL of the postmaster and every backend, started again (crash
//! recovery) a second later; meanwhile the inventory's calls fail, which the
//! orchestrator takes as UNKNOWN and settles through Status once it is back.

use std::collections::BTreeMap;
use std::path::Path;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;
use std::time::Instant;

use anyhow::Context;
use dtx_client::saga::SagaEnd;
use dtx_client::saga::SagaFilter;
use dtx_client::saga::SagaWait;
use dtx_client::saga::StartSaga;
use dtx_client::Client;
use dtx_client::ClientConfig;
use dtx_client::ClientError;
use dtx_pg_server::PgServer;
use dtx_proto::v1 as pb;
use dtx_saga_shop::Audit;
use dtx_saga_shop::OrderInput;
use dtx_saga_shop::OutsideRole;
use dtx_saga_shop::Role;
use dtx_testkit::cluster::ProcessCluster;
use dtx_testkit::cluster::ServiceProcess;

use crate::demo_kit::DemoArgs;
use crate::demo_kit::InventoryStore;
use crate::demo_kit::LeaderKills;

/// The payment provider loses this share of its replies (after charging).
const LOSE_REPLIES_PERCENT: u32 = 20;
/// The mail server is busy this share of the time.
const FAIL_FIRST_PERCENT: u32 = 20;
/// The services' seed: large enough that good orders never run out.
const SKUS: u32 = 10;
const STOCK: u64 = 1_000_000;
const CUSTOMERS: u32 = 10;
const BALANCE: u64 = 10_000_000;
/// How long the end waits for the sagas still running.
const END_WAIT: Duration = Duration::from_secs(60);
/// How long a start keeps being asked again (with its key) while its
/// answer is UNKNOWN.
const CALL_BUDGET: Duration = Duration::from_secs(30);
/// One call of the saga client, retries within it included.
const CALL_DEADLINE: Duration = Duration::from_secs(10);

const ROLES: [Role; 3] = [Role::Inventory, Role::Payment, Role::Email];

/// The database the inventory keeps its stock in.
const INVENTORY_DB: &str = "inventory";

/// What kind of order a client places.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Good,
    /// The amount is above any customer's balance: the charge FAILS and the
    /// reservation is released (COMPENSATED).
    Unpayable,
    /// More than a sku's whole stock: the reserve FAILS (COMPENSATED with
    /// nothing to undo).
    OutOfStock,
}

impl Kind {
    fn random() -> Kind {
        match rand::random_range(0..100u32) {
            0..10 => Kind::Unpayable,
            10..15 => Kind::OutOfStock,
            _ => Kind::Good,
        }
    }

    /// What kind an order's input is (from the input alone, so the audit
    /// needs nothing from the clients).
    fn of(o: &OrderInput) -> Kind {
        if o.qty > STOCK {
            Kind::OutOfStock
        } else if o.amount > BALANCE {
            Kind::Unpayable
        } else {
            Kind::Good
        }
    }

    fn order(self, id: String) -> OrderInput {
        let sku = format!("sku-{}", rand::random_range(0..SKUS));
        let customer = format!("c-{}", rand::random_range(0..CUSTOMERS));
        let (qty, amount) = match self {
            Kind::Good => (rand::random_range(1..=3), rand::random_range(100..=5_000)),
            Kind::Unpayable => (rand::random_range(1..=3), BALANCE + rand::random_range(1..=1_000)),
            Kind::OutOfStock => (STOCK + 1, rand::random_range(100..=5_000)),
        };
        OrderInput {
            order: id,
            sku,
            qty,
            customer,
            amount,
        }
    }
}

/// The saga client over every node (`dtx_client::saga`): it follows the
/// leader's hints, retries what may be retried, and keeps UNKNOWN apart
/// from failure.
fn saga_client(addrs: &[String]) -> anyhow::Result<Client> {
    let mut cfg = ClientConfig::new(addrs.to_vec());
    cfg.call_deadline = CALL_DEADLINE;
    cfg.attempt_timeout = Duration::from_secs(5);
    cfg.connect_timeout = Duration::from_millis(500);
    Ok(Client::new(cfg)?)
}

/// Every order saga in `states` (every one when empty).
async fn list(client: &Client, states: &[pb::SagaState]) -> Result<Vec<pb::SagaView>, ClientError> {
    let mut out = Vec::new();
    let mut filter = SagaFilter {
        states: states.to_vec(),
        definition: dtx_saga_shop::ORDER_SAGA.into(),
        after_saga_id: 0,
        limit: 200,
    };
    loop {
        let page = client.list_sagas(&filter).await?;
        out.extend(page.sagas);
        match page.next_after_saga_id {
            Some(n) => filter.after_saga_id = n,
            None => return Ok(out),
        }
    }
}

fn state(v: &pb::SagaView) -> pb::SagaState {
    pb::SagaState::try_from(v.state).unwrap_or(pb::SagaState::Unspecified)
}

/// What the clients saw, counted as they go.
#[derive(Default)]
struct Counts {
    started: AtomicU64,
    completed: AtomicU64,
    compensated: AtomicU64,
    parked: AtomicU64,
    /// Starts that failed at least once (UNKNOWN, UNAVAILABLE) and were
    /// asked again with the same key.
    start_retried: AtomicU64,
    /// Of those, the ones the cluster answered "already started" (the
    /// first attempt had started the saga: same key, same saga).
    start_found: AtomicU64,
    not_started: AtomicU64,
}

impl Counts {
    fn progress(&self, t: u64, leader: Option<u64>) -> String {
        let started = self.started.load(Ordering::Relaxed);
        let completed = self.completed.load(Ordering::Relaxed);
        let compensated = self.compensated.load(Ordering::Relaxed);
        let parked = self.parked.load(Ordering::Relaxed);
        format!(
            "  t={t:>3}s  started {started:>5}  completed {completed:>5}  compensated {compensated:>4}  parked {parked:>2}  running {:>3}  leader {}",
            started.saturating_sub(completed + compensated + parked),
            leader.map_or("none (election)".to_string(), |l| format!("node {l}"))
        )
    }
}

/// An outside process (the payment provider or the e-mail sender).
fn outside(bin: &Path, dir: &Path, role: OutsideRole) -> anyhow::Result<ServiceProcess> {
    let port = dtx_testkit::cluster::free_port("127.0.0.1")?;
    let addr = format!("127.0.0.1:{port}");
    let name = role.audit_role();
    let mut args: Vec<std::ffi::OsString> = vec![
        "outside-serve".into(),
        "--role".into(),
        role.as_str().into(),
        "--listen".into(),
        addr.clone().into(),
        "--data".into(),
        dir.join(name).into(),
    ];
    if role == OutsideRole::Payment {
        let more = [
            "--customers".to_string(),
            CUSTOMERS.to_string(),
            "--balance".into(),
            BALANCE.to_string(),
            "--lose-replies-percent".into(),
            LOSE_REPLIES_PERCENT.to_string(),
        ];
        args.extend(more.into_iter().map(Into::into));
    }
    let mut s = ServiceProcess::new(bin, dir, name, &addr, args);
    s.start(&[])?;
    Ok(s)
}

/// A step service; the inventory on PostgreSQL when `pg` names its
/// database (a connection string).
fn service(
    bin: &Path,
    dir: &Path,
    role: Role,
    outside: &[ServiceProcess],
    pg: Option<&str>,
) -> anyhow::Result<ServiceProcess> {
    let port = dtx_testkit::cluster::free_port("127.0.0.1")?;
    let addr = format!("127.0.0.1:{port}");
    let mut args: Vec<std::ffi::OsString> = vec![
        "saga-step-serve".into(),
        "--role".into(),
        role.as_str().into(),
        "--listen".into(),
        addr.clone().into(),
    ];
    match (role, pg) {
        (Role::Inventory, Some(conn)) => args.extend(["--postgres".into(), conn.into()]),
        _ => args.extend(["--data".into(), dir.join(role.as_str()).into()]),
    }
    let more: Vec<String> = match role {
        Role::Inventory => vec!["--skus".into(), SKUS.to_string(), "--stock".into(), STOCK.to_string()],
        Role::Payment => vec!["--provider".into(), outside[0].addr.clone()],
        Role::Email => vec![
            "--sender".into(),
            outside[1].addr.clone(),
            "--fail-first-percent".into(),
            FAIL_FIRST_PERCENT.to_string(),
        ],
    };
    args.extend(more.into_iter().map(Into::into));
    let mut s = ServiceProcess::new(bin, dir, role.as_str(), &addr, args);
    s.start(&[])?;
    Ok(s)
}

/// Kills a step service with SIGKILL half-way between leader kills (each
/// role in turn, then PostgreSQL when the inventory is on it) and starts
/// it again a second later, as a supervisor would: its inbox must answer
/// the orchestrator's repeats and status queries after the restart.
struct ServiceKills {
    every: u64,
    next: u64,
    turn: usize,
    /// The index killed (`ROLES.len()`: PostgreSQL) and when to restart it.
    restart_at: Option<(usize, Instant)>,
    kills: u64,
    pg_kills: u64,
}

/// Starts what `ServiceKills` killed: a service, or PostgreSQL (crash
/// recovery; the blocking restart waits until it accepts connections).
fn restart_killed(services: &mut [ServiceProcess], pg: Option<&mut PgServer>, i: usize) -> anyhow::Result<String> {
    match (services.get_mut(i), pg) {
        (Some(s), _) => {
            s.start(&[])?;
            Ok(format!("step service {}", ROLES[i]))
        }
        (None, Some(pg)) => {
            let t = Instant::now();
            pg.restart()
                .map_err(|e| anyhow::anyhow!("restarting PostgreSQL: {e}"))?;
            Ok(format!(
                "PostgreSQL (crash recovery, accepting connections after {} ms)",
                t.elapsed().as_millis()
            ))
        }
        (None, None) => Ok(String::new()),
    }
}

impl ServiceKills {
    fn new(every: u64) -> Self {
        ServiceKills {
            every,
            next: if every > 0 { (every / 2).max(1) } else { u64::MAX },
            turn: 0,
            restart_at: None,
            kills: 0,
            pg_kills: 0,
        }
    }

    fn tick(&mut self, services: &mut [ServiceProcess], mut pg: Option<&mut PgServer>, t: u64) -> anyhow::Result<()> {
        if let Some((i, at)) = self.restart_at {
            if Instant::now() >= at {
                let what = restart_killed(services, pg.as_deref_mut(), i)?;
                println!("  t={t:>3}s  {what} restarted");
                self.restart_at = None;
            }
        }
        if t >= self.next && self.restart_at.is_none() {
            let targets = services.len() + usize::from(pg.is_some());
            let i = self.turn % targets;
            self.turn += 1;
            match (services.get_mut(i), pg) {
                (Some(s), _) => {
                    s.kill9();
                    self.kills += 1;
                    println!("  t={t:>3}s  kill -9 step service {}", ROLES[i]);
                }
                (None, Some(pg)) => {
                    let pid = pg.pid().unwrap_or(0);
                    pg.kill9();
                    self.pg_kills += 1;
                    println!("  t={t:>3}s  kill -9 PostgreSQL (pid {pid} and its backends)");
                }
                (None, None) => {}
            }
            self.restart_at = Some((i, Instant::now() + Duration::from_secs(1)));
            self.next = t + self.every;
        }
        Ok(())
    }

    /// Starts what is still down, if anything.
    fn finish(&mut self, services: &mut [ServiceProcess], pg: Option<&mut PgServer>) -> anyhow::Result<()> {
        if let Some((i, _)) = self.restart_at.take() {
            let what = restart_killed(services, pg, i)?;
            println!("  {what} restarted");
        }
        Ok(())
    }
}

/// One client: starts an order saga, follows it until it ends (or parks)
/// or `stop`, then the next.
async fn client(
    w: usize,
    sagas: Arc<Client>,
    counts: Arc<Counts>,
    told: Arc<Mutex<Vec<(u64, String)>>>,
    stop: Arc<AtomicBool>,
) {
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let order = Kind::random().order(format!("o-{w}-{i}"));
        i += 1;
        let start = StartSaga::new(
            dtx_saga_shop::ORDER_SAGA,
            dtx_saga_shop::ORDER_SAGA_VERSION,
            &order.order,
            order.to_json(),
        );
        // No definite answer (UNKNOWN, or no node reached): ask again with
        // the same key, which finds the saga if the first call started it.
        let until = Instant::now() + CALL_BUDGET;
        let mut asked_again = false;
        let started = loop {
            match sagas.start_saga(&start).await {
                Err(e @ (ClientError::Unknown(_) | ClientError::Unavailable(_) | ClientError::NotApplied(_)))
                    if Instant::now() < until =>
                {
                    tracing::debug!(order = %order.order, "start asked again: {e}");
                    asked_again = true;
                }
                other => break other,
            }
        };
        let id = match started {
            Ok(r) => {
                counts.started.fetch_add(1, Ordering::Relaxed);
                if asked_again {
                    counts.start_retried.fetch_add(1, Ordering::Relaxed);
                    if !r.created {
                        counts.start_found.fetch_add(1, Ordering::Relaxed);
                    }
                }
                told.lock().expect("lock").push((r.saga_id, order.order.clone()));
                r.saga_id
            }
            Err(e) => {
                // Still unknown after the whole budget: the end lists the
                // cluster's sagas, so one that did start is counted there.
                tracing::warn!(order = %order.order, "start not answered: {e}");
                counts.not_started.fetch_add(1, Ordering::Relaxed);
                continue;
            }
        };
        while !stop.load(Ordering::Relaxed) {
            // A wait that runs out says "still running", never failed.
            let Ok(SagaWait::Ended { end, .. }) = sagas.wait_saga(id, Duration::from_secs(1)).await else {
                continue;
            };
            let c = match end {
                SagaEnd::Completed => &counts.completed,
                SagaEnd::Compensated => &counts.compensated,
                SagaEnd::Parked => &counts.parked,
            };
            c.fetch_add(1, Ordering::Relaxed);
            break;
        }
    }
}

/// The journals' story, over every saga.
#[derive(Default)]
struct Journals {
    by_state: BTreeMap<&'static str, u64>,
    compensated_by_kind: BTreeMap<Kind, u64>,
    parked_reasons: BTreeMap<String, u64>,
    reconciliations: u64,
    unknown_ms_total: u64,
    unknown_ms_max: u64,
    calls_retried: u64,
    extra_attempts: u64,
}

fn journals(sagas: &[pb::SagaView]) -> Journals {
    let mut j = Journals::default();
    for v in sagas {
        let s = state(v);
        *j.by_state.entry(s.as_str_name()).or_default() += 1;
        if s == pb::SagaState::Compensated {
            if let Ok(o) = serde_json::from_slice::<OrderInput>(&v.input) {
                *j.compensated_by_kind.entry(Kind::of(&o)).or_default() += 1;
            }
        }
        if s == pb::SagaState::Parked {
            *j.parked_reasons.entry(v.parked_reason.clone()).or_default() += 1;
        }
        for c in v
            .steps
            .iter()
            .flat_map(|s| [s.forward.as_ref(), s.compensation.as_ref()])
            .flatten()
        {
            j.reconciliations += u64::from(c.reconciliations);
            j.unknown_ms_total += c.unknown_ms;
            j.unknown_ms_max = j.unknown_ms_max.max(c.unknown_ms);
            if c.attempts > 1 {
                j.calls_retried += 1;
                j.extra_attempts += u64::from(c.attempts - 1);
            }
        }
    }
    j
}

/// The audits of the three step services and of the outside world.
#[derive(Clone, Default)]
struct Audits {
    inv: Audit,
    pay: Audit,
    mail: Audit,
    /// The payment provider's: the cards charged.
    provider: Audit,
    /// The e-mail sender's: the e-mails sent.
    sender: Audit,
}

/// The audit: the services' data and the outside world's records against
/// the cluster's journals. Returns the problems found (empty: OK).
fn audit(sagas: &[pb::SagaView], told: &[(u64, String)], a: &Audits) -> Vec<String> {
    let (inv, pay, mail) = (&a.inv, &a.pay, &a.mail);
    let mut problems = Vec::new();
    for a in [inv, pay, mail, &a.provider, &a.sender] {
        for p in &a.problems {
            problems.push(format!("{}: {p}", a.role));
        }
        if a.duplicate_forward_actions > 0 {
            problems.push(format!(
                "{}: {} duplicate forward action(s)",
                a.role, a.duplicate_forward_actions
            ));
        }
    }
    let mut by_key: BTreeMap<&str, Vec<&pb::SagaView>> = BTreeMap::new();
    for v in sagas {
        by_key.entry(v.idempotency_key.as_str()).or_default().push(v);
    }
    for (key, vs) in &by_key {
        if vs.len() > 1 {
            problems.push(format!("order {key} has {} sagas (one key, one saga)", vs.len()));
        }
    }
    let by_id: BTreeMap<u64, &pb::SagaView> = sagas.iter().map(|v| (v.saga_id, v)).collect();
    for (id, order) in told {
        match by_id.get(id) {
            Some(v) if v.idempotency_key == *order => {}
            Some(v) => problems.push(format!(
                "saga {id} was started for order {order} but holds {}",
                v.idempotency_key
            )),
            None => problems.push(format!(
                "saga {id} (order {order}) was started but is not in the cluster"
            )),
        }
    }
    for v in sagas {
        let id = v.saga_id;
        let Ok(o) = serde_json::from_slice::<OrderInput>(&v.input) else {
            problems.push(format!("saga {id}: its input is not an order"));
            continue;
        };
        let resv = inv.reservations.get(&o.order).cloned().unwrap_or_default();
        let charge = pay.charges.get(&o.order).cloned().unwrap_or_default();
        let confirm = mail.confirmations.get(&o.order).cloned().unwrap_or_default();
        let card = a.provider.charges.get(&o.order).cloned().unwrap_or_default();
        let sent = a.sender.confirmations.get(&o.order).cloned().unwrap_or_default();
        match state(v) {
            pb::SagaState::Completed => {
                if Kind::of(&o) != Kind::Good {
                    problems.push(format!("order {} ({:?}) COMPLETED", o.order, Kind::of(&o)));
                }
                if (resv.reserves_applied, resv.releases_applied, resv.reserved_qty) != (1, 0, o.qty) {
                    problems.push(format!(
                        "completed order {}: {} reserve(s), {} release(s), {} of {} held",
                        o.order, resv.reserves_applied, resv.releases_applied, resv.reserved_qty, o.qty
                    ));
                }
                if (charge.charges_applied, charge.amount) != (1, o.amount) {
                    problems.push(format!(
                        "completed order {}: {} charge(s) of {} in all, expected one of {}",
                        o.order, charge.charges_applied, charge.amount, o.amount
                    ));
                }
                if confirm.applied != 1 {
                    problems.push(format!(
                        "completed order {}: {} confirmation(s)",
                        o.order, confirm.applied
                    ));
                }
                if (card.charges_applied, card.amount) != (1, o.amount) {
                    problems.push(format!(
                        "completed order {}: the provider charged the card {} time(s), {} in all, expected once {}",
                        o.order, card.charges_applied, card.amount, o.amount
                    ));
                }
                if sent.applied != 1 {
                    problems.push(format!(
                        "completed order {}: the sender sent {} e-mail(s)",
                        o.order, sent.applied
                    ));
                }
            }
            pb::SagaState::Compensated => {
                if resv.reserved_qty != 0 || resv.reserves_applied != resv.releases_applied {
                    problems.push(format!(
                        "compensated order {}: {} reserve(s), {} release(s), {} still held",
                        o.order, resv.reserves_applied, resv.releases_applied, resv.reserved_qty
                    ));
                }
                if charge.charges_applied != 0 || charge.amount != 0 {
                    problems.push(format!(
                        "compensated order {}: charged {} time(s), {} in all",
                        o.order, charge.charges_applied, charge.amount
                    ));
                }
                if confirm.applied != 0 {
                    problems.push(format!("compensated order {}: confirmed", o.order));
                }
                if card.charges_applied != 0 {
                    problems.push(format!(
                        "compensated order {}: the card is charged at the provider ({} in all)",
                        o.order, card.amount
                    ));
                }
                if sent.applied != 0 {
                    problems.push(format!("compensated order {}: an e-mail was sent", o.order));
                }
            }
            // An operator's business; its reason is in the summary.
            pb::SagaState::Parked => {}
            s => problems.push(format!("saga {id} (order {}) is still {}", o.order, s.as_str_name())),
        }
    }
    // No business effect without a saga.
    let orders = inv
        .reservations
        .keys()
        .chain(pay.charges.keys())
        .chain(mail.confirmations.keys())
        .chain(a.provider.charges.keys())
        .chain(a.sender.confirmations.keys());
    let mut strays: Vec<&String> = orders.filter(|o| !by_key.contains_key(o.as_str())).collect();
    strays.sort();
    strays.dedup();
    for o in strays {
        problems.push(format!("order {o} has effects at the services but no saga"));
    }
    problems
}

pub async fn run(a: DemoArgs, shutdown: impl std::future::Future<Output = ()>) -> anyhow::Result<()> {
    let (dir, bin) = crate::demo_kit::fresh_workdir(&a.dir)?;
    let on_pg = match a.inventory_store {
        InventoryStore::Sled => false,
        InventoryStore::Postgres => true,
        InventoryStore::Auto => {
            let present = dtx_pg_server::binaries_present();
            if !present {
                println!(
                    "dtx demo --saga: the PostgreSQL server binaries are not installed (Debian: apt-get install postgresql, or scripts/postgres-deps), so the inventory keeps its stock in its sled data directory"
                );
            }
            present
        }
    };
    let mut pg = if on_pg {
        let pg = PgServer::start(dtx_pg_server::PgServerOptions::default())
            .map_err(|e| anyhow::anyhow!("--inventory-store postgres: starting PostgreSQL: {e}"))?;
        pg.create_database(INVENTORY_DB)
            .map_err(|e| anyhow::anyhow!("creating database {INVENTORY_DB}: {e}"))?;
        Some(pg)
    } else {
        None
    };
    let inventory_conn = pg.as_ref().map(|p| p.conn_string(INVENTORY_DB));
    let plans = ProcessCluster::plan_local("127.0.0.1", 3)?;
    // The audit reads every saga's journal at the end: none may be
    // forgotten before (saga.retention_ms).
    let mut cluster = ProcessCluster::new(&bin, &dir.join("cluster"), "dtx-demo", plans, |c| {
        c.saga.retention_ms = c.saga.retention_ms.max(3_600_000);
    })?;
    cluster.start_all()?;
    let api = cluster.api_addrs();
    let shop_dir: PathBuf = dir.join("saga-shop");
    std::fs::create_dir_all(&shop_dir)?;
    let mut world = Vec::new();
    for role in [OutsideRole::Payment, OutsideRole::Email] {
        world.push(outside(&bin, &shop_dir, role)?);
    }
    for w in &world {
        w.wait_started().await?;
    }
    let mut services = Vec::new();
    for role in ROLES {
        services.push(service(&bin, &shop_dir, role, &world, inventory_conn.as_deref())?);
    }
    println!(
        "dtx demo --saga: 3 coordinator nodes, 3 step services (inventory, payment, e-mail busy {FAIL_FIRST_PERCENT}% of the time) and the outside world they call (a payment provider losing {LOSE_REPLIES_PERCENT}% of its replies after charging, an e-mail sender), {} clients, {} s",
        a.clients, a.seconds
    );
    println!("  working directory: {}", dir.display());
    match &pg {
        Some(pg) => println!(
            "  inventory on PostgreSQL: database {INVENTORY_DB} at 127.0.0.1:{} (pid {}, log {}); killed with SIGKILL in turn with the step services",
            pg.port(),
            pg.pid().unwrap_or(0),
            pg.log_path().display()
        ),
        None => println!("  inventory on its sled data directory"),
    }
    let leader = cluster.leader_within(Duration::from_secs(30)).await?;
    for s in &services {
        s.wait_started().await?;
    }
    let sagas = Arc::new(saga_client(&api)?);
    let definition = dtx_saga_shop::order_saga_definition(&services[0].addr, &services[1].addr, &services[2].addr);
    sagas
        .register_saga_definition(&definition)
        .await
        .context("registering the order saga")?;
    println!(
        "  leader: node {leader}; services: {}; saga: reserve_stock (compensable) -> charge_card (pivot) -> send_confirmation (retriable)",
        ROLES
            .iter()
            .zip(&services)
            .map(|(r, s)| format!("{r} {}", s.addr))
            .collect::<Vec<_>>()
            .join(", ")
    );

    let counts = Arc::new(Counts::default());
    let told: Arc<Mutex<Vec<(u64, String)>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..a.clients)
        .map(|w| tokio::spawn(client(w, sagas.clone(), counts.clone(), told.clone(), stop.clone())))
        .collect();

    let started = Instant::now();
    let mut kills = LeaderKills::new(a.kill_every_secs);
    let mut service_kills = ServiceKills::new(a.kill_every_secs);
    while started.elapsed() < Duration::from_secs(a.seconds) {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let t = started.elapsed().as_secs();
        kills.tick(&mut cluster, t).await?;
        service_kills.tick(&mut services, pg.as_mut(), t)?;
        let leader = cluster.current_leader().await;
        println!("{}", counts.progress(t, leader));
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.await;
    }
    kills.finish(&mut cluster).await?;
    service_kills.finish(&mut services, pg.as_mut())?;
    let kills = kills.kills;
    let pg_kills = service_kills.pg_kills;
    let service_kills = service_kills.kills;

    // Every saga ends (or parks) by itself: the orchestrator of whichever
    // node leads drives them from the journal.
    let waited = Instant::now();
    let mut last_said = Instant::now();
    loop {
        let open = list(&sagas, &[pb::SagaState::Running, pb::SagaState::Compensating])
            .await
            .map(|v| v.len())
            .unwrap_or(usize::MAX);
        if open == 0 || waited.elapsed() >= END_WAIT {
            break;
        }
        if last_said.elapsed() >= Duration::from_secs(2) {
            if open != usize::MAX {
                println!("  waiting for {open} saga(s) still running");
            }
            last_said = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    if a.keep_serving {
        println!("orders stopped; everything keeps serving until Ctrl-C");
        println!("  coordinator API: {}", api.join(","));
        println!("  try: coordinator admin --addr {} saga list", api.join(","));
        shutdown.await;
    }

    // The journals (read after --keep-serving: an operator may have acted
    // meanwhile); then the services stop (their stores are then free to
    // read) and are audited.
    let sagas = list(&sagas, &[]).await.context("listing the sagas")?;
    for s in services.iter_mut().chain(world.iter_mut()) {
        s.stop(Duration::from_secs(5));
    }
    cluster.stop_all(Duration::from_secs(10));
    let step_audit = |role: Role| {
        dtx_saga_shop::audit(role, &shop_dir.join(role.as_str())).with_context(|| format!("the audit of {role}"))
    };
    let outside_audit = |role: OutsideRole| {
        dtx_saga_shop::outside_audit(role, &shop_dir.join(role.audit_role()))
            .with_context(|| format!("the audit of the {}", role.system_name()))
    };
    let inv = match &inventory_conn {
        Some(conn) => dtx_saga_shop::pg::audit_pg(conn)
            .await
            .context("the audit of inventory (PostgreSQL)")?,
        None => step_audit(Role::Inventory)?,
    };
    drop(pg);
    let all = Audits {
        inv,
        pay: step_audit(Role::Payment)?,
        mail: step_audit(Role::Email)?,
        provider: outside_audit(OutsideRole::Payment)?,
        sender: outside_audit(OutsideRole::Email)?,
    };
    let (inv, mail) = (&all.inv, &all.mail);
    let audits = [&all.inv, &all.pay, &all.mail, &all.provider, &all.sender];
    let told = std::mem::take(&mut *told.lock().expect("lock"));
    let j = journals(&sagas);
    let problems = audit(&sagas, &told, &all);

    let n = |s: pb::SagaState| j.by_state.get(s.as_str_name()).copied().unwrap_or(0);
    let kind = |k: Kind| j.compensated_by_kind.get(&k).copied().unwrap_or(0);
    let stock_initial: u64 = inv.skus.values().map(|s| s.initial).sum();
    let stock_now: u64 = inv.skus.values().map(|s| s.stock + s.reserved).sum();
    let money_initial: u64 = all.provider.balances.values().map(|b| b.initial).sum();
    let money_now: u64 = all.provider.balances.values().map(|b| b.balance + b.charged).sum();
    let forward_dups: u64 = audits.iter().map(|a| a.forward_duplicates_seen).sum();
    println!();
    println!(
        "summary after {} s, {kills} leader kill(s), {service_kills} step service kill(s), {pg_kills} PostgreSQL kill(s):",
        a.seconds
    );
    println!(
        "  inventory store           {}",
        if inventory_conn.is_some() { "PostgreSQL" } else { "sled" }
    );
    println!(
        "  sagas started             {} (clients were told {}; {} start(s) not answered)",
        sagas.len(),
        counts.started.load(Ordering::Relaxed),
        counts.not_started.load(Ordering::Relaxed)
    );
    println!("  completed                 {}", n(pb::SagaState::Completed));
    println!(
        "  compensated               {} (unpayable {}, out of stock {}, other {})",
        n(pb::SagaState::Compensated),
        kind(Kind::Unpayable),
        kind(Kind::OutOfStock),
        kind(Kind::Good)
    );
    println!("  parked                    {}", n(pb::SagaState::Parked));
    for (reason, count) in &j.parked_reasons {
        println!("    {count} x {reason}");
    }
    let still = n(pb::SagaState::Running) + n(pb::SagaState::Compensating);
    if still > 0 {
        println!("  still running after {} s  {still}", END_WAIT.as_secs());
    }
    println!(
        "  lost replies reconciled   {} (UNKNOWN outcomes settled by a status query)",
        j.reconciliations
    );
    println!(
        "  UNKNOWN dwell             total {} ms, max {} ms",
        j.unknown_ms_total, j.unknown_ms_max
    );
    println!(
        "  calls retried             {} (attempts > 1; {} extra attempts)",
        j.calls_retried, j.extra_attempts
    );
    println!(
        "  starts asked again        {} (UNKNOWN/UNAVAILABLE; same key: {} had already started their saga)",
        counts.start_retried.load(Ordering::Relaxed),
        counts.start_found.load(Ordering::Relaxed)
    );
    println!("  repeated calls answered from the step services' inboxes {forward_dups}");
    println!(
        "  cards charged             {} (provider keys voided by a fence {}, declined {})",
        all.provider.charges.values().map(|c| c.charges_applied).sum::<u64>(),
        all.provider.outside_voided,
        all.provider.outside_declined
    );
    println!(
        "  confirmations sent        {} (recorded by the e-mail service: {})",
        all.sender.confirmations.values().map(|c| c.applied).sum::<u64>(),
        mail.confirmations.values().map(|c| c.applied).sum::<u64>()
    );
    println!(
        "  outside calls in flight   {} (UNKNOWN at the end: never counted as failed)",
        all.pay.in_flight + all.mail.in_flight
    );
    println!(
        "  audit: stock {stock_now} of {stock_initial} (stock + reserved), money {money_now} of {money_initial} (balances + charges, at the provider), duplicate forward actions {}",
        audits.iter().map(|a| a.duplicate_forward_actions).sum::<u64>()
    );
    if problems.is_empty() {
        println!("audit: OK (stock and money conserved; every completed order reserved, charged and confirmed exactly once; every compensated order holds no stock and its card was never charged; no forward action applied twice)");
        Ok(())
    } else {
        for p in problems.iter().take(20) {
            println!("  problem: {p}");
        }
        if problems.len() > 20 {
            println!("  ... and {} more", problems.len() - 20);
        }
        println!("audit: FAILED: {} problem(s)", problems.len());
        anyhow::bail!("the audit failed; logs and data are in {}", dir.display())
    }
}

#[cfg(test)]
mod tests {
    use dtx_saga_shop::ChargeAudit;
    use dtx_saga_shop::ConfirmationAudit;
    use dtx_saga_shop::ReservationAudit;

    use super::*;

    fn saga(id: u64, o: &OrderInput, s: pb::SagaState) -> pb::SagaView {
        pb::SagaView {
            saga_id: id,
            state: s as i32,
            input: o.to_json(),
            idempotency_key: o.order.clone(),
            ..Default::default()
        }
    }

    fn order(id: &str, kind: Kind) -> OrderInput {
        kind.order(id.into())
    }

    /// The audits of a completed `good` order and a compensated `unpaid`
    /// one, as they should be.
    fn clean(good: &OrderInput, unpaid: &OrderInput) -> Audits {
        let mut inv = Audit::default();
        inv.reservations.insert(
            good.order.clone(),
            ReservationAudit {
                reserves_applied: 1,
                releases_applied: 0,
                reserved_qty: good.qty,
            },
        );
        inv.reservations.insert(
            unpaid.order.clone(),
            ReservationAudit {
                reserves_applied: 1,
                releases_applied: 1,
                reserved_qty: 0,
            },
        );
        let mut pay = Audit::default();
        let charged = ChargeAudit {
            charges_applied: 1,
            amount: good.amount,
        };
        pay.charges.insert(good.order.clone(), charged.clone());
        let mut mail = Audit::default();
        let sent = ConfirmationAudit {
            applied: 1,
            sent_lines: 1,
            sent_events: 1,
        };
        mail.confirmations.insert(good.order.clone(), sent.clone());
        let mut provider = Audit::default();
        provider.charges.insert(good.order.clone(), charged);
        let mut sender = Audit::default();
        sender.confirmations.insert(good.order.clone(), sent);
        Audits {
            inv,
            pay,
            mail,
            provider,
            sender,
        }
    }

    #[test]
    fn the_audit_passes_clean_data_and_names_each_broken_rule() {
        let good = order("o-1", Kind::Good);
        let unpaid = order("o-2", Kind::Unpayable);
        assert_eq!(Kind::of(&good), Kind::Good);
        assert_eq!(Kind::of(&unpaid), Kind::Unpayable);
        assert_eq!(Kind::of(&order("o-3", Kind::OutOfStock)), Kind::OutOfStock);
        let sagas = vec![
            saga(1, &good, pb::SagaState::Completed),
            saga(2, &unpaid, pb::SagaState::Compensated),
        ];
        let told = vec![(1, good.order.clone()), (2, unpaid.order.clone())];
        let all = clean(&good, &unpaid);
        assert_eq!(audit(&sagas, &told, &all), Vec::<String>::new());

        // Charged twice.
        let mut a = all.clone();
        a.pay.charges.get_mut(&good.order).unwrap().charges_applied = 2;
        assert!(audit(&sagas, &told, &a)[0].contains("2 charge(s)"));
        // A compensated order that was charged anyway.
        let mut a = all.clone();
        a.pay.charges.insert(
            unpaid.order.clone(),
            ChargeAudit {
                charges_applied: 1,
                amount: 1,
            },
        );
        assert!(audit(&sagas, &told, &a)[0].contains("compensated order o-2: charged"));
        // A compensated order whose card the provider charged (the step
        // service recorded nothing; ADR 0034).
        let mut a = all.clone();
        a.provider.charges.insert(
            unpaid.order.clone(),
            ChargeAudit {
                charges_applied: 1,
                amount: 1,
            },
        );
        assert!(audit(&sagas, &told, &a)[0].contains("the card is charged at the provider"));
        // A completed order the provider charged twice, or never e-mailed.
        let mut a = all.clone();
        a.provider.charges.get_mut(&good.order).unwrap().charges_applied = 2;
        assert!(audit(&sagas, &told, &a)[0].contains("charged the card 2 time(s)"));
        let mut a = all.clone();
        a.sender.confirmations.clear();
        assert!(audit(&sagas, &told, &a)[0].contains("sent 0 e-mail(s)"));
        // A compensated order whose stock is still held.
        let mut a = all.clone();
        a.inv.reservations.get_mut(&unpaid.order).unwrap().reserved_qty = 2;
        assert!(audit(&sagas, &told, &a)[0].contains("still held"));
        // Never confirmed.
        let mut a = all.clone();
        a.mail.confirmations.clear();
        assert!(audit(&sagas, &told, &a)[0].contains("0 confirmation(s)"));
        // A service's own problem, and a duplicate forward action.
        let mut a = all.clone();
        a.inv.role = "inventory".into();
        a.inv.problems.push("sku-1: stock 1 + reserved 1 != initial 3".into());
        a.inv.duplicate_forward_actions = 1;
        assert_eq!(audit(&sagas, &told, &a).len(), 2);
        // Two sagas for one key; a saga a client was told of that is gone;
        // effects without a saga; a saga still running.
        let mut twice = sagas.clone();
        twice.push(saga(3, &good, pb::SagaState::Completed));
        assert!(audit(&twice, &told, &all)[0].contains("has 2 sagas"));
        let p = audit(&sagas[..1], &told, &all);
        assert!(p.iter().any(|p| p.contains("not in the cluster")), "{p:?}");
        assert!(p.iter().any(|p| p.contains("o-2 has effects")), "{p:?}");
        let mut running = sagas.clone();
        running[1].state = pb::SagaState::Running as i32;
        assert!(audit(&running, &told, &all)
            .iter()
            .any(|p| p.contains("still SAGA_STATE_RUNNING")));
    }
}
