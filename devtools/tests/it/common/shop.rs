//! The shop of `demo --postgres` under test: a PostgreSQL server the test
//! starts, the three shop services (`dtx-dev shop-serve`, real
//! processes) on a test cluster, their databases, and the checks the
//! PostgreSQL tests share (t88 crash points, t89 PostgreSQL restarts).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;
use std::time::Instant;

use dtx_client::DecisionRead;
use dtx_pg_server::PgServer;
use dtx_pg_server::PgServerOptions;
use dtx_shop::Order;
use dtx_shop::Role;
use dtx_shop::Seed;
use dtx_testkit::cluster::ServiceProcess;

use super::TestCluster;

/// A PostgreSQL server, or `None` (said loudly) when its binaries are
/// missing and the environment does not require them.
pub fn postgres_or_skip(test: &str) -> Option<PgServer> {
    dtx_pg_server::start_or_skip(test, PgServerOptions::default())
}

pub struct Shop {
    pub pg: PgServer,
    pub services: BTreeMap<Role, ServiceProcess>,
    pub dbs: BTreeMap<Role, tokio_postgres::Client>,
}

fn service(dir: &Path, pg: &PgServer, role: Role, cluster: &[String]) -> ServiceProcess {
    let port = dtx_testkit::cluster::free_port("127.0.0.1").unwrap();
    let addr = format!("127.0.0.1:{port}");
    let args = dtx_shop::serve_args(role, &addr, &pg.conn_string(role.database()), cluster);
    ServiceProcess::new(super::bin(), dir, role.id(), &addr, args)
}

pub async fn shop(c: &TestCluster, pg: PgServer) -> Shop {
    let mut services = BTreeMap::new();
    for role in Role::ALL {
        pg.create_database(role.database()).unwrap();
        let mut s = service(c.dir.path(), &pg, role, &c.procs.api_addrs());
        s.start(&[]).unwrap();
        s.wait_started().await.unwrap();
        services.insert(role, s);
    }
    let mut shop = Shop {
        pg,
        services,
        dbs: BTreeMap::new(),
    };
    shop.reconnect().await;
    shop
}

impl Shop {
    /// (Re)opens the test's own connection to each database.
    pub async fn reconnect(&mut self) {
        for role in Role::ALL {
            let db = participant_sdk::postgres::connect(&self.pg.conn_string(role.database()))
                .await
                .unwrap();
            self.dbs.insert(role, db);
        }
    }

    pub fn endpoints(&self) -> Vec<dtx_shop::Service> {
        self.services.iter().map(|(r, s)| (*r, s.addr.clone())).collect()
    }

    /// Restarts the payment service with `point` armed (fires once: the
    /// marker file `once` is created when it fires).
    pub async fn arm_payment(&mut self, point: &str, once: &Path) {
        let s = self.services.get_mut(&Role::Payment).unwrap();
        s.stop(Duration::from_secs(5));
        s.start(&[
            ("DTX_FAILPOINT".into(), point.into()),
            ("DTX_FAILPOINT_ONCE".into(), once.display().to_string()),
        ])
        .unwrap();
        s.wait_started().await.unwrap();
    }

    /// Restarts any service that exited (a fired crash point), as a
    /// supervisor would, keeping its environment (the point fires once).
    pub fn supervise(&mut self, env: &[(String, String)]) {
        for s in self.services.values_mut() {
            if !s.is_running() {
                s.start(env).unwrap();
            }
        }
    }

    pub async fn prepared_left(&self) -> i64 {
        let mut n = 0;
        for db in self.dbs.values() {
            n += participant_sdk::postgres::prepared_in_database(db).await.unwrap();
        }
        n
    }

    /// Whether the order's rows are in each database (orders, reservations,
    /// payments).
    pub async fn rows_of(&self, order: &str) -> [bool; 3] {
        let q = |table: &'static str| format!("SELECT count(*) FROM {table} WHERE order_id = $1");
        let mut out = [false; 3];
        for (i, (role, table)) in [
            (Role::Orders, "orders"),
            (Role::Inventory, "reservations"),
            (Role::Payment, "payments"),
        ]
        .into_iter()
        .enumerate()
        {
            let n: i64 = self.dbs[&role].query_one(&q(table), &[&order]).await.unwrap().get(0);
            assert!(n <= 1, "order {order} has {n} rows in {table}: applied twice");
            out[i] = n == 1;
        }
        out
    }

    pub async fn audit(&self, told: &BTreeMap<String, bool>) {
        let report = dtx_shop::audit(
            &self.dbs[&Role::Orders],
            &self.dbs[&Role::Inventory],
            &self.dbs[&Role::Payment],
            &Seed::default(),
            told,
        )
        .await
        .unwrap();
        assert!(report.passed(), "audit failed: {:#?}", report.problems);
    }
}

/// Waits until `txid` has a decision, every service runs (restarting the
/// ones a crash point stopped), no prepared transaction is left and the
/// order's rows agree with the decision; returns the decision (true =
/// COMMIT). When `env` arms a crash point that has fired, the process that
/// fired it must also be gone: a point after a visible effect (after
/// COMMIT PREPARED, before the ack) aborts just after the rows agree, and
/// the next order would meet a dead service (seen in CI: its Prepare
/// failed, counted as NO, and the order was ABORTED).
pub async fn settle(c: &TestCluster, shop: &mut Shop, env: &[(String, String)], txid: u64, order: &str) -> bool {
    let client = c.client();
    let until = Instant::now() + Duration::from_secs(90);
    loop {
        shop.supervise(env);
        let decision = match client.decision(txid).await {
            Ok(DecisionRead::Committed) => Some(true),
            Ok(DecisionRead::Aborted | DecisionRead::UnknownPresumedAbort) => Some(false),
            _ => None,
        };
        if let Some(committed) = decision {
            let rows = shop.rows_of(order).await;
            let all_running = shop.services.values_mut().all(|s| s.is_running());
            if all_running && shop.prepared_left().await == 0 && rows == [committed; 3] {
                // Every service listening (a restarted one may still be
                // starting) and still running: a crash point that fires
                // just after its effect became visible (after COMMIT
                // PREPARED, before the ack) may take its service down
                // after the check above; it is restarted next round.
                let mut up = true;
                for s in shop.services.values_mut() {
                    if let Err(e) = s.wait_started().await {
                        // Gone (its exit is reaped here, a moment after
                        // its threads are), or it runs and never listened.
                        assert!(s.wait_for_exit(Duration::from_secs(5)).await.is_some(), "{e}");
                        up = false;
                    }
                }
                if up && shop.services.values_mut().all(|s| s.is_running()) && fired_process_replaced(shop, env) {
                    return committed;
                }
            }
        }
        assert!(
            Instant::now() < until,
            "txid {txid} (order {order}) did not settle in 90 s: decision {decision:?}, rows {:?}, prepared left {}; logs in {}",
            shop.rows_of(order).await,
            shop.prepared_left().await,
            c.dir.path().display()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Order `n`: its own customer and product, so no order of a test waits
/// for (or is refused by) the locks of another.
pub fn order(n: usize) -> Order {
    Order {
        id: format!("order-{n}"),
        customer: format!("c{n}"),
        sku: format!("sku{n}"),
        qty: 1,
        price: 25,
    }
}

/// False while the crash point `env` arms (`DTX_FAILPOINT_ONCE`) has fired
/// and its process (the pid it wrote to the file) is still one of the
/// shop's services; true when it has not fired or that process was
/// replaced.
fn fired_process_replaced(shop: &Shop, env: &[(String, String)]) -> bool {
    let Some((_, once)) = env.iter().find(|(k, _)| k == "DTX_FAILPOINT_ONCE") else {
        return true;
    };
    match std::fs::read_to_string(once) {
        Err(_) => true,
        // Created, its pid not written yet: the process is about to abort.
        Ok(pid) => match pid.trim().parse::<u32>() {
            Ok(pid) => shop.services.values().all(|s| s.pid() != Some(pid)),
            Err(_) => false,
        },
    }
}
