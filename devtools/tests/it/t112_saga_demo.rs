//! The saga demo as a test: `dtx-dev demo --saga`, the order saga over
//! three step services and the outside world they call (a payment provider
//! that loses its replies, a mail server that is busy) with the leader
//! killed by SIGKILL every 3 s, and a step service in between (restarted a
//! second later). It does not run at the same time as the other demos
//! (`common::DEMO_LOCK`). The audit must pass (stock and money conserved,
//! every completed order reserved, charged and confirmed exactly once,
//! every compensated order holding nothing and never charged, no duplicate
//! forward action), and the summary must show both endings and lost replies
//! settled by the status query.
//!
//! Run twice: with the inventory on its sled data directory
//! (`--inventory-store sled`), and on PostgreSQL (`--inventory-store
//! postgres`: `saga-step-serve --postgres` on the SDK's `saga_pg` store, a
//! server the demo starts and kills with SIGKILL in turn with the services;
//! the audit reads the inventory's database). Without the PostgreSQL server
//! binaries the second says so and passes, unless `DTX_REQUIRE_POSTGRES=1`
//! (CI) makes that a failure.

use crate::common;

/// Runs the demo with the inventory on `store` and checks its summary.
fn saga_demo(store: &str, seconds: &str) -> String {
    let stdout = common::run_demo_audited(&[
        "--saga",
        "--inventory-store",
        store,
        "--seconds",
        seconds,
        "--kill-every-secs",
        "3",
        "--clients",
        "4",
    ]);
    assert!(stdout.contains("kill -9 leader"), "no leader was killed: {stdout}");
    assert!(
        stdout.contains("kill -9 step service"),
        "no step service was killed: {stdout}"
    );
    let completed = common::summary_count(&stdout, "completed");
    let compensated = common::summary_count(&stdout, "compensated");
    let reconciled = common::summary_count(&stdout, "lost replies reconciled");
    let started = common::summary_count(&stdout, "sagas started");
    assert!(completed > 0, "no order completed: {stdout}");
    assert!(
        compensated > 0,
        "no order compensated (about 15% are unpayable or out of stock): {stdout}"
    );
    assert!(
        reconciled > 0,
        "the payment provider loses 20% of its replies, yet none was reconciled: {stdout}"
    );
    let parked = common::summary_count(&stdout, "parked");
    assert_eq!(
        completed + compensated + parked,
        started,
        "every saga ends or parks: {stdout}"
    );
    stdout
}

#[test]
fn t112_saga_demo_passes_its_audit_under_leader_kills() {
    let stdout = saga_demo("sled", "10");
    assert!(stdout.contains("inventory store           sled"), "{stdout}");
}

#[test]
fn t112_saga_demo_with_the_inventory_on_postgres_passes_its_audit_under_kills() {
    let test = "t112 saga demo with the inventory on PostgreSQL";
    if !dtx_pg_server::binaries_present() {
        assert_ne!(
            std::env::var(dtx_pg_server::REQUIRE_ENV).as_deref(),
            Ok("1"),
            "{test}: the PostgreSQL server binaries are missing"
        );
        eprintln!("\n*** {test} SKIPPED: no PostgreSQL server binaries (scripts/postgres-deps installs them)\n");
        return;
    }
    // Kills at 1, 4, 7 and 10 s: inventory, payment, email, then
    // PostgreSQL.
    let stdout = saga_demo("postgres", "12");
    assert!(stdout.contains("inventory store           PostgreSQL"), "{stdout}");
    assert!(
        stdout.contains("kill -9 PostgreSQL"),
        "PostgreSQL was not killed: {stdout}"
    );
    assert!(
        stdout.contains("summary after 12 s") && stdout.contains("1 PostgreSQL kill(s)"),
        "{stdout}"
    );
}
