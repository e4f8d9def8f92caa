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

/// A stand-in binary whose `--version` says `version` (a shell script): the
/// binary checks run it, and nothing else is started in these tests.
fn fake_binary(name: &str, version: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    // A folder per stand-in: the tests run in parallel, and two of them
    // write a `coordinator` that says different things.
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // Under the build's own scratch folder (target/tmp), which goes with
    // the build, not under /tmp, where every run would leave its scripts.
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("fake-bin-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\necho '{name} {version}'\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// A stand-in for a binary built with crash points.
fn with_crash_points(name: &str) -> std::path::PathBuf {
    fake_binary(name, &format!("0.1.0 {}", dtx_failpoint::VERSION_MARK))
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
    let node = with_crash_points("coordinator");
    let tools = with_crash_points("dtx-dev");
    let (code, err) = run(&[
        "run",
        "--nemesis",
        "none",
        "--base-port",
        &base.to_string(),
        // Stand-ins pass the binary checks; nothing is started.
        "--coordinator-bin",
        node.to_str().unwrap(),
        "--tools-bin",
        tools.to_str().unwrap(),
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
    let node = with_crash_points("coordinator");
    let (code, err) = run(&[
        "run",
        "--nemesis",
        "none",
        "--coordinator-bin",
        node.to_str().unwrap(),
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
fn a_binary_without_crash_points_is_refused() {
    // A build without the failpoints feature would run, and its crash
    // points would never fire: the run would look valid and test less.
    let dir = std::env::temp_dir().join(format!("jepsen-no-crash-points-{}", std::process::id()));
    let plain = fake_binary("coordinator", "0.1.0");
    let tools = with_crash_points("dtx-dev");
    let (code, err) = run(&[
        "run",
        "--nemesis",
        "none",
        "--coordinator-bin",
        plain.to_str().unwrap(),
        "--tools-bin",
        tools.to_str().unwrap(),
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("has no crash points"), "{err}");
    assert!(err.contains(plain.to_str().unwrap()), "{err}");
    assert!(err.contains("-p dtx-cli --features failpoints"), "{err}");
    assert!(!dir.exists(), "nothing may be created before the checks pass");
}

#[test]
fn bad_fault_durations_are_refused() {
    let (code, err) = run(&["run", "--fault-s", "5,2", "--out", "/nonexistent/never"]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("--fault-s"), "{err}");
}
