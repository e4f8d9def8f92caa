//! A node refuses to start on another cluster's data or with a conflicting
//! node id, and says why; a damaged data directory is reported, the node
//! stops, and the directory is left untouched (never silently reset).

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::bin;
use common::dir_digest;
use common::walk;
use common::TestCluster;

fn serve_once(config: &std::path::Path, extra: &[&str]) -> (bool, String) {
    let out = Command::new(bin())
        .arg("serve")
        .arg("--config")
        .arg(config)
        .args(extra)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run coordinator");
    (out.status.success(), String::from_utf8_lossy(&out.stderr).to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t50_foreign_cluster_conflicting_id_and_damage_are_refused() {
    let mut c = TestCluster::start("t50");
    c.leader().await;
    c.client().begin("keep-me", 600_000, b"").await.unwrap();
    c.procs.stop_all(Duration::from_secs(10));
    let cfg_path = c.procs.nodes[1].config_path.clone();
    let data_dir = c.procs.nodes[1].config.data_dir.clone();

    // Another cluster's data.
    let (ok, err) = serve_once(&cfg_path, &["--cluster-id", "someone-else"]);
    assert!(!ok, "node started on another cluster's data");
    assert!(
        err.contains("belongs to cluster \"t50\"") && err.contains("someone-else"),
        "{err}"
    );

    // A conflicting node id.
    let (ok, err) = serve_once(&cfg_path, &["--node-id", "7"]);
    assert!(!ok, "node started with a conflicting node id");
    assert!(err.contains("belongs to node 2") && err.contains("node 7"), "{err}");

    // Damage: overwrite the middle of sled's data files with garbage.
    let before_damage = dir_digest(&data_dir);
    for f in walk(&data_dir) {
        let name = f.file_name().unwrap().to_string_lossy().to_string();
        if name == "db" || name.starts_with("snap.") {
            let mut bytes = std::fs::read(&f).unwrap();
            if bytes.len() > 64 {
                let mid = bytes.len() / 2;
                let end = (mid + 4096).min(bytes.len());
                for b in &mut bytes[32..end] {
                    *b ^= 0x5a;
                }
                std::fs::write(&f, &bytes).unwrap();
            }
        }
    }
    let damaged = dir_digest(&data_dir);
    assert_ne!(before_damage, damaged, "the test did not damage anything");
    let (ok, err) = serve_once(&cfg_path, &[]);
    assert!(!ok, "node started on a damaged data directory");
    assert!(
        err.contains("damaged") || err.contains("corrupt"),
        "damage not reported: {err}"
    );
    assert_eq!(dir_digest(&data_dir), damaged, "the damaged directory was modified");

    // The other two nodes still hold the data and serve (quorum of 2).
    c.procs.start(1).unwrap();
    c.procs.start(3).unwrap();
    let cl = c.client_at(1);
    let again = cl.begin("keep-me", 600_000, b"").await.unwrap();
    assert!(again.existing);
}
