//! The participant conformance kit (docs/conformance.md) against the real
//! bank: `dtx-dev conformance participant` (the `coordinator` binary's
//! command) drives a bank process, on its own store and on PostgreSQL,
//! through every rule of docs/protocol.md's participant tables (the log,
//! fencing and the term floor of invariant 9, one-phase commit, READ_ONLY
//! work (a payload of zero changes), the grouped calls, Inspect) and counts
//! the effects of repeated decisions through the bank's committed balance
//! (exactly once, invariant 4). Every rule passes; the bank holds nothing
//! in doubt afterwards. With
//! `--start` the kit starts the bank itself and runs the crash rules too
//! (kill -9 after a YES, during a Prepare, after and during a Commit, after
//! Aborts, with a term floor, and again during recovery): they pass on
//! both stores. Then
//! `conformance step-service --start` against the order saga's inventory
//! step service, on its own store and on PostgreSQL: every step rule
//! passes (one business change per operation id, Status and Fence,
//! fingerprints, NOOP and STALE compensations, and its replies kept across
//! kill -9). That the rules fail for a participant
//! that breaks them: conformance/tests/kit.rs.

use crate::common;

use common::branch_bank::BranchBank;
use common::sagas::SagaShop;
use common::sagas::ShopFlags;
use common::shop::postgres_or_skip;
use common::TestCluster;
use dtx_proto::v1::participant_service_client::ParticipantServiceClient;
use serde_json::Value;

/// Runs the kit against `bank` with the bank's profile; its JSON report.
fn kit(bank: &BranchBank, args: &[&str]) -> (Option<i32>, String) {
    let effect = format!(
        "{} bank-balance --app {} --account a0",
        common::bin().display(),
        bank.app
    );
    let o = std::process::Command::new(common::bin())
        .args(["conformance", "participant", "--address", &bank.proc_.addr])
        .args([
            "--participant-id",
            bank.id(),
            "--yes-payload",
            "a0:1",
            "--no-payload",
            "nosuch:1",
            "--read-only-payload",
            "a0:0",
        ])
        .args(["--effect-command", &effect])
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run dtx-dev conformance");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o.status.code(), text)
}

async fn conforms(bank: &BranchBank) {
    let (code, out) = kit(bank, &["--json"]);
    let report: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"));
    let verdicts: Vec<(String, String)> = report["rules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["id"].as_str().unwrap().to_string(),
                r["verdict"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    // Skipped: only the crash rules (the kit did not start it: see
    // crash_rules_pass, where they pass too).
    let not_passed: Vec<&(String, String)> = verdicts.iter().filter(|(_, v)| v != "passed").collect();
    let skipped: Vec<&str> = dtx_conformance::RULES
        .iter()
        .map(|r| r.id)
        .filter(|id| id.starts_with("crash."))
        .collect();
    let want: Vec<(String, String)> = skipped
        .iter()
        .map(|id| (id.to_string(), "skipped".to_string()))
        .collect();
    assert_eq!(
        not_passed,
        want.iter().collect::<Vec<_>>(),
        "{}",
        serde_json::to_string_pretty(&report).unwrap()
    );
    assert_eq!(verdicts.len(), dtx_conformance::RULES.len());
    assert_eq!(code, Some(0), "{out}");
    // The text report says the same, one line per rule.
    let (code, text) = kit(bank, &["--only", "effect.,fence."]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("0 failed"), "{text}");
    assert_eq!(text.lines().filter(|l| l.starts_with("pass ")).count(), 7, "{text}");
    // Nothing of the kit's is left in doubt (its locks released).
    let mut p = ParticipantServiceClient::connect(format!("http://{}", bank.proc_.addr))
        .await
        .unwrap();
    let seen = p
        .inspect(dtx_proto::v1::InspectParticipantRequest {
            in_doubt: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(seen.in_doubt_count, 0, "{seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t125_the_bank_on_its_own_store_passes_the_conformance_kit() {
    let mut c = TestCluster::start("t125a");
    c.leader().await;
    let mut bank = BranchBank::new(&c, "bank-a", "a", None);
    bank.start(None).await;
    conforms(&bank).await;
    // A wrong profile is the kit's usage error, not a verdict.
    let (code, out) = kit(&bank, &["--only", "no-such-rule"]);
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("names no rule"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t125_the_bank_on_postgresql_passes_the_conformance_kit() {
    let Some(pg) = postgres_or_skip("t125 conformance of the PostgreSQL bank") else {
        return;
    };
    let mut c = TestCluster::start("t125b");
    c.leader().await;
    pg.create_database("t125b_a").unwrap();
    let mut bank = BranchBank::new(&c, "bank-a", "a", Some(pg.conn_string("t125b_a")));
    bank.start(None).await;
    conforms(&bank).await;
}

/// `conformance step-service --start` of the order saga's inventory on
/// its own store (or on PostgreSQL at `postgres`), with its profile; the
/// exit status and the JSON report.
fn step_kit(dir: &std::path::Path, postgres: Option<String>) -> (Option<i32>, Value) {
    let ip = "127.0.0.1";
    let addr = format!("{ip}:{}", dtx_testkit::cluster::free_port(ip).unwrap());
    let store = match &postgres {
        Some(conn) => format!("--postgres '{conn}'"),
        None => format!("--data '{}'", dir.join("inventory").display()),
    };
    let start = format!(
        "RUST_LOG=warn exec '{}' saga-step-serve --role inventory --listen {addr} {store}",
        common::bin().display()
    );
    let input = r#"{"order":"kit-{saga}","sku":"sku-0","qty":1,"customer":"c-0","amount":1}"#;
    let failed = r#"{"order":"kit-{saga}","sku":"sku-0","qty":1000000,"customer":"c-0","amount":1}"#;
    let o = std::process::Command::new(common::bin())
        .args([
            "conformance",
            "step-service",
            "--address",
            &addr,
            "--json",
            "--versioned",
        ])
        .args([
            "--forward-action",
            dtx_saga_shop::RESERVE,
            "--compensate-action",
            dtx_saga_shop::RELEASE,
        ])
        .args([
            "--status-query",
            dtx_saga_shop::RESERVATION,
            "--input",
            input,
            "--failed-input",
            failed,
        ])
        .args(["--start", &start, "--start-log"])
        .arg(dir.join("inventory-kit.log"))
        .env("RUST_LOG", "warn")
        .output()
        .expect("run dtx-dev conformance step-service");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let report = serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {out}{}", String::from_utf8_lossy(&o.stderr)));
    (o.status.code(), report)
}

fn every_step_rule_passes(code: Option<i32>, report: &Value) {
    let rules = report["rules"].as_array().unwrap();
    let not_passed: Vec<&Value> = rules.iter().filter(|r| r["verdict"] != "passed").collect();
    assert!(
        not_passed.is_empty(),
        "{}",
        serde_json::to_string_pretty(report).unwrap()
    );
    assert_eq!(rules.len(), dtx_conformance::STEP_RULES.len());
    let crashed = rules
        .iter()
        .filter(|r| {
            r["transcript"]
                .as_array()
                .unwrap()
                .iter()
                .any(|l| l.as_str().unwrap().starts_with("kill -9"))
        })
        .count();
    assert_eq!(crashed, 4, "the four crash rules crash it");
    assert_eq!(code, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t125_the_inventory_step_service_passes_the_step_rules_on_both_stores() {
    let dir = common::test_dir();
    let (code, report) = step_kit(dir.path(), None);
    every_step_rule_passes(code, &report);

    let Some(pg) = postgres_or_skip("t125 conformance of the PostgreSQL inventory") else {
        return;
    };
    pg.create_database("t125_inventory").unwrap();
    let (code, report) = step_kit(dir.path(), Some(pg.conn_string("t125_inventory")));
    every_step_rule_passes(code, &report);
}

/// `conformance participant --start` of a bank on its own store (or on
/// PostgreSQL at `postgres`): the kit starts it, crashes it and starts it
/// again; the crash rules (and every other) pass.
fn crash_rules_pass(c: &TestCluster, id: &str, postgres: Option<String>) {
    let ip = "127.0.0.1";
    let addr = format!("{ip}:{}", dtx_testkit::cluster::free_port(ip).unwrap());
    let app = format!("{ip}:{}", dtx_testkit::cluster::free_port(ip).unwrap());
    let store = match &postgres {
        Some(conn) => format!("--postgres '{conn}'"),
        None => format!("--data-dir '{}'", c.dir.path().join(id).display()),
    };
    let start = format!(
        "RUST_LOG=warn exec '{}' bank-serve --id {id} --prefix a --listen {addr} --app-listen {app} \
         --cluster {} --accounts 10 --initial 1000 {store}",
        common::bin().display(),
        c.procs.api_addrs().join(",")
    );
    let effect = format!("{} bank-balance --app {app} --account a0", common::bin().display());
    let log = c.dir.path().join(format!("{id}-kit.log"));
    let o = std::process::Command::new(common::bin())
        .args(["conformance", "participant", "--address", &addr, "--participant-id", id])
        .args([
            "--yes-payload",
            "a0:1",
            "--no-payload",
            "nosuch:1",
            "--read-only-payload",
            "a0:0",
            "--effect-command",
            &effect,
        ])
        .args(["--start", &start, "--start-log"])
        .arg(&log)
        .arg("--json")
        .env("RUST_LOG", "warn")
        .output()
        .expect("run dtx-dev conformance --start");
    let out = String::from_utf8_lossy(&o.stdout);
    let report: Value = serde_json::from_str(&out).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {out}{}\nthe bank's output:\n{}",
            String::from_utf8_lossy(&o.stderr),
            std::fs::read_to_string(&log).unwrap_or_default()
        )
    });
    let rules = report["rules"].as_array().unwrap();
    let crash: Vec<&Value> = rules
        .iter()
        .filter(|r| r["id"].as_str().unwrap().starts_with("crash."))
        .collect();
    assert_eq!(crash.len(), 7, "{report}");
    let not_passed: Vec<(&str, &str)> = rules
        .iter()
        .filter(|r| r["verdict"] != "passed")
        .map(|r| (r["id"].as_str().unwrap(), r["verdict"].as_str().unwrap()))
        .collect();
    assert_eq!(
        not_passed,
        Vec::<(&str, &str)>::new(),
        "{}\nthe bank's output:\n{}",
        serde_json::to_string_pretty(&report).unwrap(),
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    assert_eq!(o.status.code(), Some(0));
    // Every crash rule did crash it.
    for r in crash {
        let killed = r["transcript"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l.as_str().unwrap().starts_with("kill -9"));
        assert!(killed, "{r}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t125_the_bank_keeps_the_rules_across_kill_9_on_both_stores() {
    let mut c = TestCluster::start("t125d");
    c.leader().await;
    crash_rules_pass(&c, "bank-a", None);
    let Some(pg) = postgres_or_skip("t125 crash rules of the PostgreSQL bank") else {
        return;
    };
    pg.create_database("t125d_a").unwrap();
    crash_rules_pass(&c, "bank-p", Some(pg.conn_string("t125d_a")));
}

/// `conformance step-service` (no --start) against a running step service
/// of the order saga; the exit status and the JSON report.
fn running_step_kit(addr: &str, profile: &[&str]) -> (Option<i32>, Value) {
    let o = std::process::Command::new(common::bin())
        .args(["conformance", "step-service", "--address", addr, "--json"])
        .args(profile)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run dtx-dev conformance step-service");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let report = serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {out}{}", String::from_utf8_lossy(&o.stderr)));
    (o.status.code(), report)
}

/// The rules of `report` that did not pass, with their verdicts.
fn not_passed(report: &Value) -> Vec<(String, String)> {
    report["rules"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["verdict"] != "passed")
        .map(|r| {
            (
                r["id"].as_str().unwrap().to_string(),
                r["verdict"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// The payment (PIVOT: a charge at the payment provider, an outside call
/// recorded in flight) and e-mail (RETRIABLE: a message through the
/// e-mail sender) step services, running beside their outside world, pass
/// every step rule that applies to a step without a compensation; the
/// compensation and crash rules are skipped, and say why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t125_the_payment_and_email_step_services_pass_the_step_rules() {
    let dir = common::test_dir();
    let shop = SagaShop::start(dir.path(), ShopFlags::default()).await;
    let order = |customer: &str| {
        format!(r#"{{"order":"kit-{{saga}}","sku":"sku-0","qty":1,"customer":"{customer}","amount":1}}"#)
    };
    let (ok, declined) = (order("c-0"), order("nobody"));
    let cases = [
        (
            "payment",
            vec![
                "--forward-action",
                dtx_saga_shop::CHARGE,
                "--status-query",
                dtx_saga_shop::CHARGE_STATUS,
                "--input",
                &ok,
                "--failed-input",
                &declined,
            ],
            Vec::<&str>::new(),
        ),
        (
            "email",
            vec![
                "--forward-action",
                dtx_saga_shop::SEND_CONFIRMATION,
                "--status-query",
                dtx_saga_shop::EMAIL_STATUS,
                "--input",
                &ok,
            ],
            // The sender never refuses a message: no FAILED input.
            vec!["step.failed-repeat", "step.compensate-after-failed"],
        ),
    ];
    for (role, profile, no_failed_input) in cases {
        let (code, report) = running_step_kit(&shop.addr(role), &profile);
        let skipped_ok = |id: &str| {
            id == "step.kind"
                || id.starts_with("step.compensate-")
                || id == "step.stale"
                || id.starts_with("step.crash.")
                || no_failed_input.contains(&id)
        };
        let left = not_passed(&report);
        assert!(
            left.iter().all(|(id, v)| v == "skipped" && skipped_ok(id)),
            "{role}: {}",
            serde_json::to_string_pretty(&report).unwrap()
        );
        let passed = report["passed"].as_u64().unwrap();
        assert!(passed >= 6, "{role}: {passed} rules passed");
        assert_eq!(code, Some(0), "{role}");
    }
}
