//! The main job as a test: the bank example (two participant services, three
//! coordinator nodes, all real processes) with the leader killed by SIGKILL
//! every 3 s. The audit must pass: total unchanged, nothing locked or in
//! doubt, no transaction committed at one bank and not at the other, every
//! COMMIT a client was told applied at both banks (invariants 3 and 4).

mod common;

#[test]
fn t90_bank_audit_total_unchanged_after_leader_kills() {
    let stdout = common::run_demo(&["--seconds", "10", "--kill-every-secs", "3", "--clients", "6"]);
    assert!(stdout.contains("kill -9 leader"), "no leader was killed: {stdout}");
}
