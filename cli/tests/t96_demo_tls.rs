//! The main job with `--tls` as a test (issue 12, item 4), in a file of its
//! own so it does not run at the same time as `t90_bank_demo` (two demos
//! of five processes each at once would only load the machine).

mod common;

use std::process::Command;

/// The same main job with `--tls` (issue 12, item 4): every node, bank and
/// client with a certificate from the demo's throwaway authority, mutual
/// TLS on every link, the leader killed; the audit must pass.
#[test]
fn t90_bank_demo_with_tls_passes_its_audit() {
    let dir = common::test_dir();
    let out = Command::new(common::bin())
        .args([
            "demo",
            "--tls",
            "--seconds",
            "8",
            "--kill-every-secs",
            "3",
            "--clients",
            "4",
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
        "demo --tls failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("mutual TLS on every link"), "{stdout}");
    assert!(stdout.contains("audit: OK"), "{stdout}");
    let committed: u64 = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("committed"))
        .and_then(|v| v.trim().parse().ok())
        .expect("summary has a committed count");
    assert!(committed > 20, "too few transfers committed over TLS: {committed}");
}
