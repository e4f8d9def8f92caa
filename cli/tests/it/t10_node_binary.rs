//! The `coordinator` binary: the node's commands only, and a working
//! cluster of its processes.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use dtx_client::Client;
use dtx_client::ClientConfig;
use dtx_client::TxOutcome;
use dtx_testkit::cluster::ProcessCluster;

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_coordinator"))
}

/// The subcommands `--help` lists.
fn subcommands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect()
}

#[test]
fn the_node_binary_has_the_node_commands_only() {
    let out = Command::new(bin())
        .arg("--help")
        .output()
        .expect("run coordinator --help");
    assert!(out.status.success(), "{out:?}");
    let help = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        subcommands(&help),
        ["serve", "inspect", "admin", "restore", "conformance", "help"],
        "the node's binary lists the node's commands (and the participant conformance kit, which every \
         operator of a cluster has with it) and nothing else:\n{help}"
    );
    // A development tool is an unknown command here (clap's usage error).
    let out = Command::new(bin()).arg("demo").output().expect("run coordinator demo");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unrecognized subcommand 'demo'"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_node_processes_decide_and_answer_admin_status() {
    let dir = tempfile::tempdir().unwrap();
    let plans = ProcessCluster::plan_local("127.0.0.1", 3).unwrap();
    let mut cluster = ProcessCluster::new(bin(), dir.path(), "node-binary", plans, |_| {}).unwrap();
    cluster.start_all().unwrap();
    assert!(
        cluster.wait_serving(1, Duration::from_secs(30)).await,
        "the cluster of `coordinator serve` processes serves"
    );

    let addrs = cluster.api_addrs();
    let out = Command::new(bin())
        .args(["admin", "--addr", &addrs.join(","), "status"])
        .output()
        .expect("run coordinator admin status");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "admin status exits 0: {out:?}");
    assert!(stdout.contains("leader"), "admin status names the leader:\n{stdout}");

    let cl = Client::new(ClientConfig::new(addrs)).unwrap();
    let txid = cl.begin("node-binary", 60_000, b"").await.unwrap().txid;
    assert_eq!(cl.commit(txid).await.unwrap(), TxOutcome::Committed);
    cluster.stop_all(Duration::from_secs(5));
}
