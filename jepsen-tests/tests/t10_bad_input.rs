//! Bad input to `jepsen-tests run` is refused before anything starts, with
//! an error that says what was wrong (docs/jepsen.md).

use std::process::Command;

fn run(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_jepsen-tests"))
        .args(args)
        .output()
        .expect("run jepsen-tests");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[test]
fn unknown_nemesis_is_named_with_the_known_ones() {
    let (code, err) = run(&[
        "run",
        "--nemesis",
        "kill-leader,meteor-strike",
        "--out",
        "/nonexistent/never",
    ]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("\"meteor-strike\""), "{err}");
    assert!(err.contains("partition-bridge"), "the known names are listed: {err}");
}

#[test]
fn missing_coordinator_binary_says_how_to_build_it() {
    let dir = std::env::temp_dir().join(format!("jepsen-bad-input-{}", std::process::id()));
    let (code, err) = run(&[
        "run",
        "--nemesis",
        "none",
        "--coordinator-bin",
        "/nonexistent/coordinator",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("/nonexistent/coordinator"), "{err}");
    assert!(err.contains("--features failpoints"), "{err}");
    assert!(!dir.exists(), "nothing may be created before the checks pass");
}

#[test]
fn a_port_in_use_is_named_before_anything_starts() {
    // Node 1's Raft address is 127.0.0.11:<base + 10>.
    let base = 27_400u16;
    let held = std::net::TcpListener::bind(("127.0.0.11", base + 10)).expect("bind the port the run wants");
    let dir = std::env::temp_dir().join(format!("jepsen-port-in-use-{}", std::process::id()));
    let this = std::env::current_exe().unwrap();
    let (code, err) = run(&[
        "run",
        "--nemesis",
        "none",
        "--base-port",
        &base.to_string(),
        // Any existing file passes the binary checks; nothing is started.
        "--coordinator-bin",
        this.to_str().unwrap(),
        "--tools-bin",
        this.to_str().unwrap(),
        "--out",
        dir.to_str().unwrap(),
    ]);
    drop(held);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains(&format!("127.0.0.11:{}", base + 10)), "{err}");
    assert!(!dir.exists(), "nothing may be created before the checks pass");
}

#[test]
fn missing_development_binary_says_how_to_build_it() {
    let dir = std::env::temp_dir().join(format!("jepsen-bad-tools-{}", std::process::id()));
    let this = std::env::current_exe().unwrap();
    let (code, err) = run(&[
        "run",
        "--nemesis",
        "none",
        "--coordinator-bin",
        this.to_str().unwrap(),
        "--tools-bin",
        "/nonexistent/dtx-dev",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("/nonexistent/dtx-dev"), "{err}");
    assert!(err.contains("-p dtx-devtools --features failpoints"), "{err}");
    assert!(!dir.exists(), "nothing may be created before the checks pass");
}

#[test]
fn bad_fault_durations_are_refused() {
    let (code, err) = run(&["run", "--fault-s", "5,2", "--out", "/nonexistent/never"]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("--fault-s"), "{err}");
}
