//! `dtx-dev dev` says once that a node exited, with its log and how to
//! start it again (Enter), instead of repeating "node N exited" every second;
//! Enter starts the node again on its kept data; SIGTERM stops everything.

use crate::common;

use std::io::BufRead;
use std::io::Write;
use std::process::Child;
use std::process::Command;
use std::process::Stdio;
use std::sync::mpsc;
use std::time::Duration;
use std::time::Instant;

/// A base port whose nine dev ports (base+1..3, +101..103, +201..203) are
/// free on loopback right now.
fn free_base_port() -> u16 {
    for _ in 0..200 {
        let base = 20_000 + (rand_u16() % 20_000);
        let all_free = [1u16, 2, 3, 101, 102, 103, 201, 202, 203]
            .iter()
            .all(|o| std::net::TcpListener::bind(("127.0.0.1", base + o)).is_ok());
        if all_free {
            return base;
        }
    }
    panic!("no free base port for the dev cluster");
}

fn rand_u16() -> u16 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    (nanos ^ std::process::id().wrapping_mul(2_654_435_761)) as u16
}

/// Pids of node processes started from `dir` (their command line names a
/// config file in it).
fn node_pids(dir: &std::path::Path, file: &str) -> Vec<i32> {
    let needle = dir.join(file).display().to_string();
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.contains(" serve ") && cmd.contains(&needle) {
                pids.push(pid);
            }
        }
    }
    pids
}

/// Stops the dev supervisor and any node it left behind, even on failure.
struct Dev {
    child: Child,
    dir: std::path::PathBuf,
}

impl Drop for Dev {
    fn drop(&mut self) {
        // SAFETY: kill(2) on pids we started; no memory is touched.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let until = Instant::now() + Duration::from_secs(15);
        while Instant::now() < until {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        for pid in node_pids(&self.dir, "") {
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
}

/// The lines a child prints on `stdout`, read on a thread of their own
/// (until the receiver is dropped or the pipe closes).
fn lines_of(stdout: std::process::ChildStdout) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in std::io::BufReader::new(stdout).lines() {
            let Ok(l) = l else { return };
            if tx.send(l).is_err() {
                return;
            }
        }
    });
    rx
}

/// Waits for a stdout line containing `what`; returns every line read.
fn wait_line(rx: &mpsc::Receiver<String>, seen: &mut Vec<String>, what: &str, timeout: Duration) -> bool {
    let until = Instant::now() + timeout;
    if seen.iter().any(|l| l.contains(what)) {
        return true;
    }
    while let Some(left) = until.checked_duration_since(Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(l) => {
                let hit = l.contains(what);
                seen.push(l);
                if hit {
                    return true;
                }
            }
            Err(_) => return false,
        }
    }
    false
}

#[test]
fn t91_dev_reports_an_exit_once_and_enter_starts_the_node_again() {
    let tmp = common::test_dir();
    std::fs::create_dir_all(tmp.path().join("dev")).unwrap();
    let dir = tmp.path().join("dev").canonicalize().unwrap();
    let base = free_base_port();
    let mut child = Command::new(common::bin())
        .args(["dev", "--base-port", &base.to_string(), "--data-dir"])
        .arg(&dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut dev = Dev {
        child,
        dir: dir.clone(),
    };
    let rx = lines_of(stdout);
    let mut seen = Vec::new();
    assert!(
        wait_line(&rx, &mut seen, "Serving until Ctrl-C", Duration::from_secs(60)),
        "dev did not come up: {seen:#?}"
    );
    let pids = node_pids(&dir, "node2.toml");
    assert_eq!(pids.len(), 1, "node 2's process: {pids:?}");
    // SAFETY: kill(2) on a node process this test started.
    unsafe {
        libc::kill(pids[0], libc::SIGKILL);
    }
    assert!(
        wait_line(&rx, &mut seen, "node 2 exited", Duration::from_secs(10)),
        "dev did not report the exit: {seen:#?}"
    );
    // The supervisor checks every second: five more checks must not repeat it.
    let _ = wait_line(&rx, &mut seen, "never printed", Duration::from_secs(5));
    let reports: Vec<&String> = seen.iter().filter(|l| l.contains("node 2 exited")).collect();
    assert_eq!(
        reports.len(),
        1,
        "the exit was reported {} times: {seen:#?}",
        reports.len()
    );
    assert!(
        reports[0].contains("node2.log") && reports[0].contains("Press Enter"),
        "the report should name the log and say how to start the node again: {}",
        reports[0]
    );

    // Enter starts it again, on its kept data, and it answers.
    stdin.write_all(b"\n").unwrap();
    stdin.flush().unwrap();
    assert!(
        wait_line(&rx, &mut seen, "node 2: started again", Duration::from_secs(10)),
        "{seen:#?}"
    );
    let api = format!("127.0.0.1:{}", base + 102);
    let rt = common::tokio_rt();
    let up = rt.block_on(async {
        for _ in 0..100 {
            if let Ok(s) = dtx_client::cluster_status_at(&api, Duration::from_millis(500)).await {
                if s.leader_id != 0 {
                    return true;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    });
    assert!(up, "node 2 did not come back with a known leader");
    assert_eq!(node_pids(&dir, "node2.toml").len(), 1);

    // SIGTERM (as Ctrl-C) stops every node and keeps the data.
    // SAFETY: kill(2) on the supervisor this test started.
    unsafe {
        libc::kill(dev.child.id() as i32, libc::SIGTERM);
    }
    assert!(
        wait_line(&rx, &mut seen, "stopped; data kept", Duration::from_secs(40)),
        "{seen:#?}"
    );
    let status = dev.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(node_pids(&dir, "").is_empty(), "nodes left running after dev stopped");
}

/// `dtx-dev dev --tls`: the flags it prints work. The operator's certificate
/// reads the cluster status; the application's token is admitted but may not
/// (PERMISSION_DENIED); a plain-text admin gets no answer.
#[test]
fn t91_dev_tls_prints_flags_that_work() {
    let tmp = common::test_dir();
    std::fs::create_dir_all(tmp.path().join("dev")).unwrap();
    let dir = tmp.path().join("dev").canonicalize().unwrap();
    let base = free_base_port();
    let mut child = Command::new(common::bin())
        .args(["dev", "--tls", "--base-port", &base.to_string(), "--data-dir"])
        .arg(&dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let dev = Dev {
        child,
        dir: dir.clone(),
    };
    let rx = lines_of(stdout);
    let mut seen = Vec::new();
    assert!(
        wait_line(&rx, &mut seen, "or its token", Duration::from_secs(60)),
        "dev --tls did not come up: {seen:#?}"
    );
    // "try: coordinator admin --addr A --tls-ca .. --tls-cert .. --tls-key .. status"
    let try_line = seen
        .iter()
        .find(|l| l.starts_with("try: coordinator admin"))
        .expect("a try line")
        .clone();
    let admin = |args: &[&str]| {
        Command::new(common::bin())
            .args(args)
            .env("RUST_BACKTRACE", "0")
            .output()
            .unwrap()
    };
    let words: Vec<&str> = try_line
        .trim_start_matches("try: coordinator ")
        .split_whitespace()
        .collect();
    let out = admin(&words);
    assert!(
        out.status.success(),
        "{try_line}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("cluster dtx-dev "),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    // The application's token: admitted, but not to admin calls.
    let token_line = seen.iter().find(|l| l.contains("or its token")).unwrap();
    let flags = token_line.split("): ").nth(1).expect("flags after the colon");
    let addr = words[2];
    let mut args = vec!["admin", "--addr", addr];
    args.extend(flags.split_whitespace());
    args.push("status");
    let out = admin(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("permission denied") && err.contains("application/dev-token-app"),
        "{err}"
    );

    // Plain text against the TLS ports: no answer.
    let out = admin(&["admin", "--addr", addr, "status"]);
    assert!(!out.status.success());
    // Nobody reads its output any more (a closed terminal): SIGTERM still
    // stops every node in order, and the supervisor exits cleanly.
    drop(rx);
    let mut dev = dev;
    // SAFETY: kill(2) on the supervisor this test started.
    unsafe {
        libc::kill(dev.child.id() as i32, libc::SIGTERM);
    }
    let until = Instant::now() + Duration::from_secs(40);
    let status = loop {
        if let Some(s) = dev.child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < until, "dev did not stop within 40 s");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
    assert!(node_pids(&dir, "").is_empty(), "nodes left running");
}
