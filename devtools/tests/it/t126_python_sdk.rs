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
//! With the PostgreSQL server binaries installed, it also starts a
//! throwaway server (`dtx_pg_server`, loopback, a free port), creates a
//! database and hands its connection string to pytest in
//! `DTX_TEST_POSTGRES`: then the PostgreSQL participant's tests run too
//! (its store against the server, the conformance kit against the
//! PostgreSQL bank with `--start`, and transfers between a PostgreSQL and
//! a SQLite bank on a real cluster, through a leader kill and a kill of the
//! PostgreSQL bank). Without the binaries those tests are skipped (said
//! loudly here, and by pytest), unless `DTX_REQUIRE_POSTGRES=1`: then this
//! test fails, and so do they (also without psycopg).
//!
//! Without Python or its packages (grpcio, grpcio-tools, protobuf, pytest,
//! pytest-asyncio, psycopg; `scripts/python-deps` installs them) the test
//! says "skipped" loudly and passes, unless `DTX_REQUIRE_PYTHON=1`, where
//! it fails.

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
    // A throwaway PostgreSQL for the PostgreSQL participant's tests (each
    // creates databases of its own on it); None, said loudly, without the
    // binaries, unless DTX_REQUIRE_POSTGRES=1 (then start_or_skip fails).
    let pg = dtx_pg_server::start_or_skip(
        test,
        dtx_pg_server::PgServerOptions {
            max_connections: 200,
            kill_with_parent_thread: true,
            ..Default::default()
        },
    );
    let mut pytest = Command::new("python3");
    pytest
        .args([
            "-m",
            "pytest",
            "sdk/python/tests",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rs",
        ])
        .current_dir(&root)
        .env("DTX_BIN_DIR", &bin_dir)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("RUST_LOG", "warn")
        .env_remove("DTX_TEST_POSTGRES");
    if let Some(pg) = &pg {
        pg.create_database("dtx_pytest")
            .unwrap_or_else(|e| panic!("{test}: creating the database dtx_pytest: {e}"));
        pytest.env("DTX_TEST_POSTGRES", pg.conn_string("dtx_pytest"));
    }
    let out = pytest.output().expect("run python3 -m pytest");
    let had_postgres = pg.is_some();
    drop(pg);
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
    // With a server, none of the PostgreSQL tests may have been skipped
    // (tests/pg.py's reason, listed by -rs).
    assert!(
        !had_postgres || !stdout.contains("no PostgreSQL for the tests"),
        "a PostgreSQL test was skipped although DTX_TEST_POSTGRES was set; the output is above"
    );
}
