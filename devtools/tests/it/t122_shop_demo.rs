//! `dtx-dev demo --postgres`, the shop written both ways, as real
//! processes on a real PostgreSQL under leader kills and service kill -9:
//! as branches (the default: clients call the order service, which calls
//! inventory and payment inside its transaction; each service prepares in
//! its own request handler and answers with what the order leaves) and
//! Prepare-driven (`--prepare-driven`: the order, typed as `shop.v1.Order`,
//! as every participant's payload). Each run must end with the audit
//! clean: stock and money conserved, every order with its reservation and
//! payment written by one transaction and none without, every order a
//! client was told about as told, no prepared transaction left
//! (invariants 1 to 3 and 5 end to end).
//!
//! Without the PostgreSQL server binaries it says so and passes, unless
//! `DTX_REQUIRE_POSTGRES=1` (CI) makes that a failure.

use crate::common;

fn postgres_binaries(test: &str) -> bool {
    if dtx_pg_server::binaries_present() {
        return true;
    }
    assert_ne!(
        std::env::var("DTX_REQUIRE_POSTGRES").as_deref(),
        Ok("1"),
        "{test}: the PostgreSQL server binaries are missing"
    );
    eprintln!("\n*** {test} SKIPPED: no PostgreSQL server binaries (scripts/postgres-deps installs them)\n");
    false
}

#[test]
fn t122_the_shop_as_branches_passes_its_audit_under_kills() {
    if !postgres_binaries("t122 shop demo as branches") {
        return;
    }
    let out = common::run_demo(&[
        "--postgres",
        "--seconds",
        "16",
        "--clients",
        "4",
        "--kill-every-secs",
        "4",
    ]);
    assert!(out.contains("as branches"), "{out}");
    // The leader and a service were killed at least once.
    assert!(out.contains("kill -9 leader"), "{out}");
    assert!(
        out.contains("service kill(s)") && !out.contains(" 0 service kill(s)"),
        "{out}"
    );
}

#[test]
fn t122_the_shop_prepare_driven_passes_its_audit_under_kills() {
    if !postgres_binaries("t122 shop demo Prepare-driven") {
        return;
    }
    let out = common::run_demo(&[
        "--postgres",
        "--prepare-driven",
        "--seconds",
        "10",
        "--clients",
        "4",
        "--kill-every-secs",
        "4",
    ]);
    assert!(out.contains("Prepare-driven"), "{out}");
}
