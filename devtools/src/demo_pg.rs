//! `dtx-dev demo --postgres`: the textbook example on PostgreSQL. A
//! throwaway PostgreSQL server (initdb in a temporary folder, a free port
//! on 127.0.0.1, stopped and removed at the end), three databases, a
//! three-node coordinator cluster and three shop services (orders,
//! inventory, payment: `dtx-dev shop-serve`, PostgreSQL participants of
//! the SDK), all real processes. Clients place orders, each reserving stock
//! and charging a customer together or not at all, while the leader and
//! the services are killed with SIGKILL; then the audit of `dtx_shop::audit`
//! runs on the three databases. Exits non-zero if the audit fails.
//!
//! By default the shop runs as branches (`dtx_shop::branches`): clients
//! call the order service's `PlaceOrder`, which begins the transaction,
//! calls the inventory and payment services with its txid, records the
//! order, and commits; each service prepares in its own request handler.
//! With `--prepare-driven`, clients enlist the three services with the
//! order as payload and the coordinator sends them Prepare.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;
use std::time::Instant;

use anyhow::Context;
use dtx_client::Client;
use dtx_client::ClientConfig;
use dtx_client::ClientError;
use dtx_client::TxOutcome;
use dtx_shop::Order;
use dtx_shop::Role;
use dtx_shop::Seed;
use dtx_testkit::cluster::ProcessCluster;
use dtx_testkit::cluster::ServiceProcess;

use crate::demo_kit::decision_eventually;
use crate::demo_kit::Counts;
use crate::demo_kit::DemoArgs;
use crate::demo_kit::LeaderKills;

/// What the clients learned: order id → committed?, and the orders whose
/// outcome they did not learn, by txid.
#[derive(Default)]
struct Told {
    definite: BTreeMap<String, bool>,
    unknown: BTreeMap<u64, String>,
    /// Orders placed through the order service whose call got no answer
    /// and no txid (as branches).
    unknown_orders: Vec<String>,
}

fn start_service(
    bin: &std::path::Path,
    dir: &std::path::Path,
    role: Role,
    pg_conn: &str,
    cluster: &[String],
    apps: Option<&dtx_shop::AppAddrs>,
) -> anyhow::Result<ServiceProcess> {
    let port = dtx_testkit::cluster::free_port("127.0.0.1")?;
    let addr = format!("127.0.0.1:{port}");
    let mut args = dtx_shop::serve_args(role, &addr, pg_conn, cluster);
    if let Some(apps) = apps {
        args.extend(apps.args(role));
    }
    let mut s = ServiceProcess::new(bin, dir, role.id(), &addr, args);
    s.start(&[])?;
    Ok(s)
}

async fn connect(conn: &str) -> anyhow::Result<tokio_postgres::Client> {
    participant_sdk::postgres::connect(conn)
        .await
        .with_context(|| format!("cannot connect to PostgreSQL ({conn})"))
}

async fn prepared_left(dbs: &[tokio_postgres::Client]) -> anyhow::Result<i64> {
    let mut n = 0;
    for db in dbs {
        n += participant_sdk::postgres::prepared_in_database(db).await?;
    }
    Ok(n)
}

pub async fn run(a: DemoArgs, shutdown: impl std::future::Future<Output = ()>) -> anyhow::Result<()> {
    if !dtx_pg_server::binaries_present() {
        anyhow::bail!(
            "demo --postgres starts its own PostgreSQL server and needs its binaries (initdb, postgres), which are not installed; \
             on Debian or Ubuntu: sudo apt-get install postgresql (or run scripts/postgres-deps); elsewhere put initdb on PATH"
        );
    }
    let (dir, bin) = crate::demo_kit::fresh_workdir(&a.dir)?;

    let pg = dtx_pg_server::PgServer::start(dtx_pg_server::PgServerOptions::default())
        .map_err(|e| anyhow::anyhow!("{e}"))
        .context("starting PostgreSQL")?;
    for role in Role::ALL {
        pg.create_database(role.database())
            .map_err(|e| anyhow::anyhow!("{e}"))
            .with_context(|| format!("creating database {}", role.database()))?;
    }
    let conns: BTreeMap<Role, String> = Role::ALL.iter().map(|r| (*r, pg.conn_string(r.database()))).collect();

    let plans = ProcessCluster::plan_local("127.0.0.1", 3)?;
    let mut cluster = ProcessCluster::new(&bin, &dir.join("cluster"), "dtx-demo", plans, |_| {})?;
    cluster.start_all()?;
    let api = cluster.api_addrs();
    let free =
        || -> anyhow::Result<String> { Ok(format!("127.0.0.1:{}", dtx_testkit::cluster::free_port("127.0.0.1")?)) };
    let apps = if a.prepare_driven {
        None
    } else {
        Some(dtx_shop::AppAddrs {
            orders: free()?,
            inventory: free()?,
            payment: free()?,
        })
    };
    let mut services: Vec<ServiceProcess> = Vec::new();
    for role in Role::ALL {
        services.push(start_service(&bin, &dir, role, &conns[&role], &api, apps.as_ref())?);
    }
    println!(
        "dtx demo --postgres: PostgreSQL on 127.0.0.1:{}, 3 coordinator nodes, 3 shop services ({}), {} clients, {} s",
        pg.port(),
        if apps.is_some() {
            "as branches: clients call the order service, each service prepares in its own handler"
        } else {
            "Prepare-driven: clients enlist the services with the order as payload"
        },
        a.clients,
        a.seconds
    );
    println!("  working directory: {}", dir.display());
    let mut leader = cluster.leader_within(Duration::from_secs(30)).await?;
    for s in &services {
        s.wait_started().await?;
    }
    let endpoints: Arc<Vec<dtx_shop::Service>> = Arc::new(
        Role::ALL
            .iter()
            .zip(&services)
            .map(|(r, s)| (*r, s.addr.clone()))
            .collect(),
    );
    println!(
        "  leader: node {leader}; services: {}",
        endpoints
            .iter()
            .map(|(r, a)| format!("{r} {a}"))
            .collect::<Vec<_>>()
            .join(", ")
    );

    let seed = Seed::default();
    let counts = Arc::new(Counts::default());
    let told: Arc<Mutex<Told>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let orders_api = match &apps {
        Some(apps) => Some(
            tonic::transport::Endpoint::from_shared(format!("http://{}", apps.orders))?
                .connect_timeout(Duration::from_millis(500))
                .connect_lazy(),
        ),
        None => None,
    };
    let mut workers = Vec::new();
    for w in 0..a.clients {
        let (counts, told, stop, endpoints, api, orders_api) = (
            counts.clone(),
            told.clone(),
            stop.clone(),
            endpoints.clone(),
            api.clone(),
            orders_api.clone(),
        );
        workers.push(tokio::spawn(async move {
            let mut cfg = ClientConfig::new(api);
            cfg.call_deadline = Duration::from_secs(8);
            let client = Client::new(cfg).expect("client");
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let order = Order::random(format!("o-{w}-{i}"), &seed);
                i += 1;
                let (txid, res) = match &orders_api {
                    Some(ch) => {
                        // PlaceOrder is idempotent by order id: an answer
                        // that did not come (the order service killed, a
                        // leader change) is asked for again with the same
                        // order, which answers its decision once it has one.
                        let (mut txid, mut outcome, _) = dtx_shop::place_order_via_api(ch, &order).await;
                        while outcome == TxOutcome::Unknown && !stop.load(Ordering::Relaxed) {
                            tokio::time::sleep(Duration::from_millis(300)).await;
                            let again = dtx_shop::place_order_via_api(ch, &order).await;
                            txid = again.0.or(txid);
                            outcome = again.1;
                        }
                        if txid.is_none() && outcome == TxOutcome::Unknown {
                            // No txid learned: found again by the order id.
                            told.lock().expect("lock").unknown_orders.push(order.id.clone());
                            counts.unknown.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        (txid, Ok(outcome))
                    }
                    None => dtx_shop::place_order(&client, &order.id, &order, &endpoints).await,
                };
                let mut t = told.lock().expect("lock");
                match (txid, res) {
                    (_, Ok(TxOutcome::Committed)) => {
                        counts.committed.fetch_add(1, Ordering::Relaxed);
                        t.definite.insert(order.id, true);
                    }
                    (_, Ok(TxOutcome::Aborted)) => {
                        counts.aborted.fetch_add(1, Ordering::Relaxed);
                        t.definite.insert(order.id, false);
                    }
                    (txid, Ok(TxOutcome::Unknown)) | (txid, Err(ClientError::Unknown(_))) => {
                        counts.unknown.fetch_add(1, Ordering::Relaxed);
                        if let Some(txid) = txid {
                            t.unknown.insert(txid, order.id);
                        }
                    }
                    _ => {
                        counts.failed_to_start.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }

    let started = Instant::now();
    let every = a.kill_every_secs;
    let mut leader_kills = LeaderKills::new(every);
    // Services are killed between leader kills, and restarted 1 s later.
    let mut next_service_kill = if every > 0 { every / 2 + 1 } else { u64::MAX };
    let mut service_restart: Option<(usize, Instant)> = None;
    let mut service_kills = 0;
    while started.elapsed() < Duration::from_secs(a.seconds) {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let t = started.elapsed().as_secs();
        leader_kills.tick(&mut cluster, t).await?;
        if let Some((i, at)) = service_restart {
            if Instant::now() >= at {
                services[i].start(&[])?;
                println!("  t={t:>3}s  {} restarted", services[i].id);
                service_restart = None;
            }
        }
        if t >= next_service_kill && service_restart.is_none() {
            let i = rand::random_range(0..services.len());
            services[i].kill9();
            service_kills += 1;
            println!("  t={t:>3}s  kill -9 {} service", services[i].id);
            service_restart = Some((i, Instant::now() + Duration::from_secs(1)));
            next_service_kill = t + every;
        }
        if let Some(l) = cluster.current_leader().await {
            leader = l;
        }
        println!("{}", counts.progress(t, leader));
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.await;
    }
    if let Some((i, _)) = service_restart {
        services[i].start(&[])?;
    }
    leader_kills.finish(&mut cluster).await?;
    let leader_kills = leader_kills.kills;

    // Outcomes the clients did not learn: asked again (decided by now, or
    // aborted by the reaper at their deadline).
    let check = Client::new(ClientConfig::new(api.clone()))?;
    let unknown: Vec<(u64, String)> = told.lock().expect("lock").unknown.clone().into_iter().collect();
    for (txid, order) in unknown {
        if let Some(committed) = decision_eventually(&check, txid).await {
            told.lock().expect("lock").definite.insert(order, committed);
        }
    }
    // The order id is the transaction's idempotency key: the same Begin
    // (same key, timeout and description) finds the transaction if the
    // order service began one; if it had not, this begins one that
    // nobody commits, and the cluster aborts it at its deadline.
    let lost: Vec<String> = std::mem::take(&mut told.lock().expect("lock").unknown_orders);
    let check = Arc::new(check);
    let mut finding = Vec::new();
    for order in lost {
        let (check, told) = (check.clone(), told.clone());
        finding.push(tokio::spawn(async move {
            let began = check
                .begin(&order, dtx_shop::branches::ORDER_TIMEOUT_MS, b"order")
                .await
                .with_context(|| format!("finding order {order}'s transaction"))?;
            if let Some(committed) = decision_eventually(&check, began.txid).await {
                told.lock().expect("lock").definite.insert(order, committed);
            }
            anyhow::Ok(())
        }));
    }
    for f in finding {
        f.await??;
    }

    if a.keep_serving {
        println!("orders stopped; everything keeps serving until Ctrl-C");
        println!("  coordinator API: {}", api.join(","));
        println!("  PostgreSQL: {}", conns[&Role::Orders]);
        shutdown.await;
    }

    // Phase two and the services' recovery finish what is prepared.
    let dbs = vec![
        connect(&conns[&Role::Orders]).await?,
        connect(&conns[&Role::Inventory]).await?,
        connect(&conns[&Role::Payment]).await?,
    ];
    let until = Instant::now() + Duration::from_secs(60);
    while prepared_left(&dbs).await? > 0 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    for s in services.iter_mut() {
        s.stop(Duration::from_secs(5));
    }
    cluster.stop_all(Duration::from_secs(10));

    let told = std::mem::take(&mut *told.lock().expect("lock"));
    let report = dtx_shop::audit(&dbs[0], &dbs[1], &dbs[2], &seed, &told.definite).await?;
    println!();
    println!(
        "summary after {} s, {leader_kills} leader kill(s), {service_kills} service kill(s):",
        a.seconds
    );
    println!(
        "  committed                 {}",
        counts.committed.load(Ordering::Relaxed)
    );
    println!("  aborted                   {}", counts.aborted.load(Ordering::Relaxed));
    println!(
        "  unknown to the client     {} (resolved later: {})",
        counts.unknown.load(Ordering::Relaxed),
        told.definite.len() as u64 - counts.committed.load(Ordering::Relaxed) - counts.aborted.load(Ordering::Relaxed)
    );
    println!(
        "  not started               {}",
        counts.failed_to_start.load(Ordering::Relaxed)
    );
    println!(
        "  orders / reservations / payments in the databases: {} / {} / {}",
        report.orders, report.reservations, report.payments
    );
    println!("  prepared transactions left {}", report.prepared_left);
    if report.passed() {
        println!("audit: OK (stock + reserved = initial for every product; balances + payments = initial; every order with its reservation and payment, none without; no prepared transaction left)");
        Ok(())
    } else {
        for p in &report.problems {
            println!("  problem: {p}");
        }
        println!("audit: FAILED");
        anyhow::bail!(
            "the audit failed ({}); logs are in {}",
            report.problems.join("; "),
            dir.display()
        )
    }
}
