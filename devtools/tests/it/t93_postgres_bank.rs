//! The example bank on PostgreSQL (`bank-serve --postgres`, the migration
//! of the sled bank to `PgHandler`, `dtx_bank::pg`): two real bank
//! processes, each with its own database on a PostgreSQL server the test
//! starts, and concurrent transfers between them through the cluster.
//! Money is conserved, no outcome is UNKNOWN, conflicting transfers vote
//! NO instead of waiting (they abort; nothing hangs), and no prepared
//! transaction is left once phase two is done.
//!
//! Without the PostgreSQL server binaries it says so and passes, unless
//! `DTX_REQUIRE_POSTGRES=1` (CI) makes that a failure.

use crate::common;

use std::time::Duration;
use std::time::Instant;

use common::shop::postgres_or_skip;
use common::TestCluster;
use dtx_client::TxOutcome;
use dtx_testkit::cluster::BankProcess;

const ACCOUNTS: usize = 10;
const INITIAL: i64 = 1_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t93_inv1_postgres_banks_conserve_money_under_concurrent_transfers() {
    let Some(pg) = postgres_or_skip("t93 PostgreSQL banks") else {
        return;
    };
    let mut c = TestCluster::start("t93");
    c.leader().await;
    let api = c.procs.api_addrs();
    let mut banks = Vec::new();
    let mut dbs = Vec::new();
    // The services run until the end of the test (killed when dropped).
    let mut procs: Vec<BankProcess> = Vec::new();
    for (id, prefix) in [("bank-a", "a"), ("bank-b", "b")] {
        let db = format!("t93_{prefix}");
        pg.create_database(&db).unwrap();
        let port = dtx_testkit::cluster::free_port("127.0.0.1").unwrap();
        let mut s = BankProcess::build(
            common::bin(),
            c.dir.path(),
            id,
            prefix,
            "127.0.0.1",
            port,
            api.clone(),
            ACCOUNTS,
            INITIAL,
            Some(pg.conn_string(&db)),
        );
        s.start(&[]).unwrap();
        s.wait_started().await.unwrap();
        banks.push((id.to_string(), s.addr.clone(), prefix.to_string()));
        dbs.push(dtx_bank::connect_pg(&pg.conn_string(&db)).await.unwrap());
        procs.push(s);
    }

    // 8 clients, 25 transfers each, over 10 accounts per bank: conflicts
    // are frequent and must end as NO votes, never as waits or splits.
    let mut workers = Vec::new();
    for w in 0..8 {
        let (banks, client) = (banks.clone(), c.client());
        workers.push(tokio::spawn(async move {
            let mut outcomes = Vec::new();
            for i in 0..25 {
                let (_, res) = dtx_bank::transfer(&client, &format!("t93-{w}-{i}"), &banks, ACCOUNTS).await;
                outcomes.push(res.unwrap());
            }
            outcomes
        }));
    }
    let mut committed = 0;
    let mut aborted = 0;
    for w in workers {
        for o in w.await.unwrap() {
            match o {
                TxOutcome::Committed => committed += 1,
                TxOutcome::Aborted => aborted += 1,
                TxOutcome::Unknown => panic!("an UNKNOWN outcome without faults"),
            }
        }
    }
    assert!(committed > 0, "no transfer committed ({aborted} aborted)");

    // Phase two finishes after the answers: wait until nothing is prepared.
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let mut left = 0;
        for db in &dbs {
            left += participant_sdk::postgres::prepared_in_database(db).await.unwrap();
        }
        if left == 0 {
            break;
        }
        assert!(Instant::now() < until, "{left} prepared transactions left after 30 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut total = 0;
    for db in &dbs {
        let (sum, n) = dtx_bank::pg::audit(db).await.unwrap();
        assert_eq!(n, ACCOUNTS as i64);
        total += sum;
    }
    assert_eq!(
        total,
        2 * ACCOUNTS as i64 * INITIAL,
        "money not conserved ({committed} committed, {aborted} aborted)"
    );
    eprintln!("t93: {committed} committed, {aborted} aborted (lock conflicts vote NO)");
    drop(procs);
    drop(pg);
}

/// `bank-serve --postgres` takes the PostgreSQL participant's settings as
/// flags (they were once reachable only from code): a value out of range
/// stops the service at start with the setting named, and valid ones start
/// it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t93_the_postgresql_settings_are_flags_checked_at_start() {
    let Some(pg) = postgres_or_skip("t93 PostgreSQL flags") else {
        return;
    };
    pg.create_database("t93_flags").unwrap();
    let conn = pg.conn_string("t93_flags");
    let port = dtx_testkit::cluster::free_port("127.0.0.1").unwrap();
    let listen = format!("127.0.0.1:{port}");
    let run = |extra: &[&str]| {
        std::process::Command::new(common::bin())
            .args(["bank-serve", "--id", "bank-f", "--prefix", "f", "--listen", &listen])
            .args(["--postgres", &conn, "--cluster", "127.0.0.1:1"])
            .args(extra)
            .output()
            .expect("run bank-serve")
    };
    let o = run(&["--pg-pool-wait-timeout-ms", "0"]);
    assert!(!o.status.success(), "{}", common::output_text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("pool_wait_timeout_ms is 0"), "{}", common::output_text(&o));
    let o = run(&["--pg-handler-statement-timeout-ms", "99999999999"]);
    assert!(!o.status.success(), "{}", common::output_text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("handler_statement_timeout_ms"),
        "{}",
        common::output_text(&o)
    );
    // Valid values: the service starts and serves.
    let mut child = std::process::Command::new(common::bin())
        .args(["bank-serve", "--id", "bank-f", "--prefix", "f", "--listen", &listen])
        .args(["--postgres", &conn, "--cluster", "127.0.0.1:1"])
        .args(["--pg-handler-lock-timeout-ms", "250", "--pg-decision-pool-size", "2"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    while tokio::net::TcpStream::connect(&listen).await.is_err() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "bank-serve exited with valid flags"
        );
        assert!(Instant::now() < until, "bank-serve never listened on {listen}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    child.kill().unwrap();
    child.wait().unwrap();
}
