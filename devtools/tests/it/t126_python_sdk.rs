//! The Python SDK (`sdk/python`, docs/python-sdk.md) passes its own tests:
//! `python3 -m pytest sdk/python/tests -q` with `DTX_BIN_DIR` set to the
//! directory of this build's `dtx-dev`. Those tests run the unit tests of
//! the participant log's pure step and of the SQLite store, the client
//! against fake nodes (leader hints, UNKNOWN kept apart from failure), the
//! conformance kit (`dtx-dev conformance participant`) against the Python
//! bank as a real process, and transfers between two Python banks through
//! the Python client on a real three-node cluster with its leader killed
//! (SIGKILL) mid-run, and with a bank killed and restarted.
//!
//! Without Python or its packages (grpcio, grpcio-tools, protobuf, pytest,
//! pytest-asyncio; `scripts/python-deps` installs them) the test says
//! "skipped" loudly and passes, unless `DTX_REQUIRE_PYTHON=1`, where it
//! fails.

use std::path::Path;
use std::path::PathBuf;
use std::process::Command;

use crate::common;

/// The Python modules the SDK's tests import.
const PYTHON_MODULES: &str = "import grpc, grpc_tools, google.protobuf, pytest, pytest_asyncio";

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("devtools has a parent")
        .to_path_buf()
}

/// Why the Python packages cannot be used, or None when they can.
fn python_missing() -> Option<String> {
    match Command::new("python3").args(["-c", PYTHON_MODULES]).output() {
        Err(e) => Some(format!("python3 does not run: {e}")),
        Ok(o) if !o.status.success() => {
            let stderr = String::from_utf8_lossy(&o.stderr);
            // The traceback's last line names the module.
            let last = stderr.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").trim();
            Some(format!("python3 lacks a package the SDK's tests need ({last})"))
        }
        Ok(_) => None,
    }
}

#[test]
fn t126_python_sdk_passes_its_tests() {
    let test = "t126_python_sdk_passes_its_tests";
    let required = std::env::var("DTX_REQUIRE_PYTHON").is_ok_and(|v| v == "1");
    if let Some(why) = python_missing() {
        if required {
            panic!("{test}: DTX_REQUIRE_PYTHON=1 but {why}; run scripts/python-deps");
        }
        eprintln!(
            "\n*** {test} SKIPPED: {why} (scripts/python-deps installs the packages; DTX_REQUIRE_PYTHON=1 \
             makes this a failure)\n"
        );
        return;
    }
    let root = repo_root();
    let bin_dir = common::bin().parent().expect("dtx-dev has a directory").to_path_buf();
    let out = Command::new("python3")
        .args(["-m", "pytest", "sdk/python/tests", "-q", "-p", "no:cacheprovider"])
        .current_dir(&root)
        .env("DTX_BIN_DIR", &bin_dir)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("RUST_LOG", "warn")
        .output()
        .expect("run python3 -m pytest");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}{stderr}");
    assert!(
        out.status.success(),
        "python3 -m pytest sdk/python/tests failed ({}); its output is above",
        out.status
    );
    // pytest's closing line: "N passed in S s" (and nothing failed).
    let last = stdout.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
    assert!(
        last.contains(" passed") && !last.contains("failed") && !last.contains("error"),
        "pytest's summary line does not say every test passed: {last:?}"
    );
}
