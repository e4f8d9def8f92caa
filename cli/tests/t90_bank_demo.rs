//! The main job as a test: the bank example (two participant services, three
//! coordinator nodes, all real processes) with the leader killed by SIGKILL
//! every 3 s. The audit must pass: total unchanged, nothing locked or in
//! doubt, no transaction committed at one bank and not at the other, every
//! COMMIT a client was told applied at both banks (invariants 3 and 4).

mod common;

use std::process::Command;

#[test]
fn t90_bank_audit_total_unchanged_after_leader_kills() {
    let dir = common::test_dir();
    let out = Command::new(common::bin())
        .args([
            "demo",
            "--seconds",
            "10",
            "--kill-every-secs",
            "3",
            "--clients",
            "6",
            "--dir",
        ])
        .arg(dir.path().join("demo"))
        .env("RUST_LOG", "warn")
        .output()
        .expect("run the demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}");
    assert!(
        out.status.success(),
        "demo failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("audit: OK"), "{stdout}");
    assert!(stdout.contains("kill -9 leader"), "no leader was killed: {stdout}");
    let committed: u64 = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("committed"))
        .and_then(|v| v.trim().parse().ok())
        .expect("summary has a committed count");
    assert!(
        committed > 20,
        "too few transfers committed to mean anything: {committed}"
    );
}
