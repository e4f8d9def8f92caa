//! The read-only web console on each node's HTTP port, looked at by a real
//! browser: headless Chromium (Debian's `chromium`, installed by
//! scripts/browser-deps) loads the pages of a real three-node cluster, with
//! `--dump-dom` (the DOM after rendering) and `--screenshot`.
//!
//! The cluster holds: three committed transactions, one aborted by a NO
//! vote, one aborted by its client with markup in its reason (it must show
//! as text, never run or render as markup), one ACTIVE, and one decided
//! COMMIT whose participant `gamma` went down before it learned the
//! decision (so it stays decided and waiting for gamma's ack, in doubt).
//!
//! Without a browser the test says "skipped" and passes, unless
//! `DTX_REQUIRE_BROWSER` is set (CI sets it after scripts/browser-deps):
//! then it fails. `DTX_CONSOLE_SCREENSHOT=path/to.png` also writes the
//! stuck transaction's page there (how docs/console.png is made).
//! Every wait only polls, within generous bounds; each browser run is
//! killed (with its helper processes) if it takes longer than
//! `BROWSER_TIMEOUT`, so the test cannot hang on it.

use crate::common;

use std::path::Path;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::node_ip;
use common::participants::Svc;
use common::TestCluster;
use dtx_client::TxOutcome;
use dtx_testkit::cluster::free_port;
use tokio::io::AsyncReadExt;
use tokio::io::AsyncWriteExt;
use tokio::time::Instant;

/// The longest any one state may take to show (a loaded machine).
const WAIT: Duration = Duration::from_secs(60);

/// The longest one browser run may take before it is killed.
const BROWSER_TIMEOUT: Duration = Duration::from_secs(90);

/// A client's abort reason that is markup: the console must show it as
/// text. If it ran, the script would set `data-pwned` on the body; if it
/// rendered, there would be a `<b id="injected">` element.
const EVIL_REASON: &str =
    "<script>document.body.setAttribute('data-pwned','yes')</script><b id=\"injected\">bold</b> & \"quoted\"";

fn with_console(c: &mut coordinator::config::Config) {
    let ip = node_ip(c.node_id);
    c.metrics_addr = Some(format!("{ip}:{}", free_port(&ip).unwrap()));
    // gamma's deliveries fail and are retried; keep the retries frequent
    // so its attempts and last error show soon.
    c.txn.delivery_retry_max_ms = 500;
}

/// A headless Chromium on this machine.
struct Browser {
    bin: PathBuf,
    /// Profiles, outputs, logs and screenshots of the runs (kept with
    /// `DTX_KEEP_TEST_DIRS`, like the cluster's).
    dir: tempfile::TempDir,
}

/// `name` on PATH, if there.
fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(name)).find(|p| p.is_file())
}

/// Chromium, or None (said loudly) when none is installed and
/// `DTX_REQUIRE_BROWSER` is not set; with it set, no browser is a failure.
fn browser_or_skip(test: &str) -> Option<Browser> {
    let found = ["chromium", "chromium-browser"].iter().find_map(|n| on_path(n));
    let required = std::env::var_os("DTX_REQUIRE_BROWSER").is_some_and(|v| !v.is_empty());
    match found {
        Some(bin) => Some(Browser {
            bin,
            dir: common::test_dir(),
        }),
        None if required => panic!(
            "{test}: DTX_REQUIRE_BROWSER is set but there is no chromium or chromium-browser on PATH: run \
             scripts/browser-deps (it installs Debian's chromium package)"
        ),
        None => {
            eprintln!(
                "\n*** {test} skipped: no chromium (scripts/browser-deps installs it; DTX_REQUIRE_BROWSER=1 makes \
                 this a failure)\n"
            );
            None
        }
    }
}

impl Browser {
    /// Runs Chromium headless with `args` then `url`, in a fresh profile,
    /// bounded by `BROWSER_TIMEOUT`; returns its stdout.
    async fn run(&self, what: &str, args: &[String], url: &str) -> String {
        let run = tempfile::tempdir_in(self.dir.path()).expect("tempdir");
        let out_path = run.path().join("stdout");
        let err_path = run.path().join("stderr");
        let mut cmd = tokio::process::Command::new(&self.bin);
        cmd.arg("--headless=new")
            // Chromium refuses to run as root with its sandbox; the test
            // runs as root in CI containers.
            .arg("--no-sandbox")
            .arg("--disable-gpu")
            .arg("--disable-dev-shm-usage")
            .arg("--no-first-run")
            .arg("--no-default-browser-check")
            .arg("--disable-extensions")
            .arg("--hide-scrollbars")
            .arg(format!("--user-data-dir={}", run.path().join("profile").display()))
            .args(args)
            .arg(url)
            .stdin(std::process::Stdio::null())
            .stdout(std::fs::File::create(&out_path).unwrap())
            .stderr(std::fs::File::create(&err_path).unwrap())
            // Its own process group, so its helpers go with it.
            .process_group(0)
            .kill_on_drop(true);
        let started = Instant::now();
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.bin.display()));
        let pid = child.id().expect("a running child") as i32;
        let status = tokio::time::timeout(BROWSER_TIMEOUT, child.wait()).await;
        // Whatever happened, nothing of this run stays behind.
        // SAFETY: kill(2) on the process group this test started.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
        let stderr = || {
            let e = std::fs::read_to_string(&err_path).unwrap_or_default();
            let tail: Vec<&str> = e.lines().rev().take(30).collect();
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        };
        match status {
            Err(_) => panic!(
                "{what}: chromium did not finish within {BROWSER_TIMEOUT:?} on {url} (killed); its stderr:\n{}",
                stderr()
            ),
            Ok(Err(e)) => panic!("{what}: waiting for chromium failed: {e}"),
            Ok(Ok(s)) if !s.success() => panic!("{what}: chromium exited with {s} on {url}; its stderr:\n{}", stderr()),
            Ok(Ok(_)) => {}
        }
        eprintln!("{what}: chromium took {:?}", started.elapsed());
        std::fs::read_to_string(&out_path).unwrap()
    }

    /// The DOM of `url` after the browser rendered it.
    async fn dom(&self, what: &str, url: &str) -> String {
        let dom = self.run(what, &["--dump-dom".to_string()], url).await;
        assert!(dom.contains("<html"), "{what}: no DOM from {url}: {dom:?}");
        dom
    }

    /// A 1280x900 PNG of `url`, written to `to`; returns its size.
    async fn screenshot(&self, what: &str, url: &str, to: &Path) -> usize {
        let _ = std::fs::remove_file(to);
        self.run(
            what,
            &[
                format!("--screenshot={}", to.display()),
                "--window-size=1280,900".to_string(),
            ],
            url,
        )
        .await;
        let png = std::fs::read(to).unwrap_or_else(|e| panic!("{what}: no screenshot at {}: {e}", to.display()));
        assert!(
            png.starts_with(b"\x89PNG\r\n\x1a\n"),
            "{what}: {} is not a PNG",
            to.display()
        );
        assert!(
            png.len() > 10_000,
            "{what}: the screenshot is only {} bytes: a blank page?",
            png.len()
        );
        png.len()
    }
}

/// An HTTP/1.1 request on the metrics port: (status, head, body).
async fn http(addr: &str, method: &str, path: &str) -> (u16, String, String) {
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.write_all(
        format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {out:?}"));
    (code, head.to_ascii_lowercase(), body.to_string())
}

fn metrics_of(c: &TestCluster, id: u64) -> String {
    c.procs.nodes[(id - 1) as usize]
        .config
        .metrics_addr
        .clone()
        .expect("metrics_addr set")
}

/// Polls `GET path` on `addr` until the body meets `ok`; panics with the
/// last body after `WAIT`.
async fn until_page(c: &TestCluster, addr: &str, path: &str, what: &str, ok: impl Fn(u16, &str) -> bool) -> String {
    let until = Instant::now() + WAIT;
    loop {
        let (code, _, body) = http(addr, "GET", path).await;
        if ok(code, &body) {
            return body;
        }
        if Instant::now() > until {
            c.dump_logs();
            panic!("{addr}{path}: never {what} within {WAIT:?}; last answer ({code}):\n{body}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The table row of `txid` in a list page's DOM (from its link to the end
/// of the row).
fn row_of(dom: &str, txid: u64) -> &str {
    let link = format!("<a href=\"/console/txn/{txid}\">{txid}</a>");
    let at = dom
        .find(&link)
        .unwrap_or_else(|| panic!("no row for transaction {txid} in:\n{dom}"));
    let end = dom[at..].find("</tr>").map(|e| at + e).unwrap_or(dom.len());
    &dom[at..end]
}

fn has_row(dom: &str, txid: u64) -> bool {
    dom.contains(&format!("<a href=\"/console/txn/{txid}\">{txid}</a>"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t104_console_pages_show_the_cluster_in_a_real_browser() {
    let test_started = Instant::now();
    let Some(browser) = browser_or_skip("t104_console_pages_show_the_cluster_in_a_real_browser") else {
        return;
    };
    let mut c = TestCluster::start_with("t104", 3, with_console);
    let leader = c.leader().await;
    let follower = (1..=3).find(|i| *i != leader).unwrap();
    let (lm, fm) = (metrics_of(&c, leader), metrics_of(&c, follower));
    let alpha = Svc::new("alpha").await;
    let beta = Svc::new("beta").await;
    let gamma = Svc::new("gamma").await;
    let cl = c.client();

    let mut committed = Vec::new();
    for i in 0..3 {
        let r = cl
            .begin_and_commit(
                &format!("t104-ok-{i}"),
                30_000,
                b"t104",
                &[alpha.spec(b"a"), beta.spec(b"b")],
            )
            .await
            .unwrap();
        assert_eq!(r.outcome, TxOutcome::Committed);
        committed.push(r.txid.unwrap());
    }
    let voted_no = cl
        .begin_and_commit("t104-no", 30_000, b"t104", &[alpha.spec(b"a"), beta.spec(b"no")])
        .await
        .unwrap();
    assert_eq!(voted_no.outcome, TxOutcome::Aborted);
    let voted_no = voted_no.txid.unwrap();
    let client_aborted = cl.begin("t104-abort", 60_000, b"t104").await.unwrap().txid;
    cl.enlist(client_aborted, "alpha", &alpha.addr, b"a").await.unwrap();
    assert_eq!(cl.abort(client_aborted, EVIL_REASON).await.unwrap(), TxOutcome::Aborted);
    let active = cl.begin("t104-active", 600_000, b"t104").await.unwrap().txid;
    cl.enlist(active, "alpha", &alpha.addr, b"a").await.unwrap();
    // gamma votes YES, then goes down before it hears the decision.
    gamma.hold_decisions.store(true, Ordering::SeqCst);
    let stuck = cl
        .begin_and_commit("t104-stuck", 30_000, b"t104", &[alpha.spec(b"a"), gamma.spec(b"g")])
        .await
        .unwrap();
    assert_eq!(stuck.outcome, TxOutcome::Committed);
    let stuck = stuck.txid.unwrap();
    let gamma_addr = gamma.addr.clone();
    drop(gamma);

    // Plain HTTP first, to wait for the state the browser must show: the
    // leader retrying gamma with an error, every other delivery acked, and
    // the follower having applied all of it.
    until_page(
        &c,
        &lm,
        "/console/in-doubt",
        "show gamma's failing deliveries",
        |code, b| code == 200 && b.contains(&format!("/console/txn/{stuck}\"")) && b.contains("gamma ("),
    )
    .await;
    until_page(&c, &lm, "/console", "count every other transaction acked", |_, b| {
        b.contains(
            "<td>decided, waiting for ack</td><td class=\"n\"><a href=\"/console/transactions?unacknowledged=1\">1</a>",
        )
    })
    .await;
    until_page(
        &c,
        &fm,
        &format!("/console/txn/{stuck}"),
        "apply the stuck transaction",
        |code, b| code == 200 && b.contains("waiting for ack"),
    )
    .await;
    until_page(
        &c,
        &fm,
        &format!("/console/txn/{active}"),
        "apply the ACTIVE transaction",
        |code, _| code == 200,
    )
    .await;

    // --- The overview, on the leader and on a follower.
    let url = |addr: &str, path: &str| format!("http://{addr}{path}");
    let dom = browser.dom("leader overview", &url(&lm, "/console")).await;
    let api_addrs = c.procs.api_addrs();
    for want in [
        format!("Rendered by <b>node {leader}</b> (Leader,"),
        "this node's applied state".to_string(),
        "This node is the leader.".to_string(),
        "<span class=\"ok\">SERVING</span>".to_string(),
        format!("<td>{leader} (leader) (this node)</td>"),
        // Every member, reachable from the leader.
        "<span class=\"ok\">reachable</span>".to_string(),
        "<td>ACTIVE</td><td class=\"n\"><a href=\"/console/transactions?state=active\">1</a>".to_string(),
        "<td>DECIDED</td><td class=\"n\"><a href=\"/console/transactions?state=decided\">6</a>".to_string(),
        "<a href=\"/console/in-doubt\">1</a>".to_string(),
    ]
    .into_iter()
    .chain(api_addrs.iter().cloned())
    {
        assert!(dom.contains(&want), "leader overview: {want:?} missing from:\n{dom}");
    }
    let dom = browser.dom("follower overview", &url(&fm, "/console")).await;
    for want in [
        format!("Rendered by <b>node {follower}</b> (Follower,"),
        "A follower may lag the leader by a few entries".to_string(),
        format!(
            "the leader: node {leader} at <span class=\"mono\">{}</span>",
            c.api(leader)
        ),
        format!("<td>{leader} (leader)</td>"),
        format!("<td>{follower} (this node)</td>"),
    ] {
        assert!(dom.contains(&want), "follower overview: {want:?} missing from:\n{dom}");
    }

    // --- In doubt: the stuck transaction alone, waiting on gamma.
    let dom = browser.dom("in-doubt", &url(&lm, "/console/in-doubt")).await;
    let row = row_of(&dom, stuck);
    assert!(row.contains("DECIDED COMMIT"), "{row}");
    assert!(row.contains("1/2 acked"), "{row}");
    let waiting = row.split("<td class=\"waiting\">").nth(1).unwrap_or_default();
    assert!(
        waiting.starts_with("gamma ("),
        "in-doubt: the stuck row must wait on gamma alone: {row}"
    );
    for t in committed.iter().chain([&voted_no, &client_aborted, &active]) {
        assert!(!has_row(&dom, *t), "in-doubt: transaction {t} is not in doubt:\n{dom}");
    }
    assert!(dom.contains("(1 transactions, oldest first)"), "{dom}");

    // --- The stuck transaction's timeline, on the leader (with its
    // delivery attempts) and on a follower (without).
    let dom = browser
        .dom("stuck txn", &url(&lm, &format!("/console/txn/{stuck}")))
        .await;
    for want in [
        format!("<h1>Transaction {stuck}</h1>"),
        "DECIDED COMMIT".to_string(),
        "begin (deadline ".to_string(),
        format!("enlisted alpha at {}, gamma at {gamma_addr}", alpha.addr),
        "votes: YES from every participant (alpha, gamma): COMMIT needs them all".to_string(),
        "decided COMMIT by the ".to_string(),
        ">acked<".to_string(),
        ">waiting for ack<".to_string(),
        "this leader's own".to_string(),
    ] {
        assert!(dom.contains(&want), "stuck txn page: {want:?} missing from:\n{dom}");
    }
    let gamma_row = &dom[dom.find("<tr><td>gamma</td>").expect("a row for gamma")..];
    let gamma_row = &gamma_row[..gamma_row.find("</tr>").unwrap()];
    assert!(
        !gamma_row.contains("<td class=\"n\">-</td>"),
        "the leader counts gamma's attempts: {gamma_row}"
    );
    let dom = browser
        .dom("stuck txn on a follower", &url(&fm, &format!("/console/txn/{stuck}")))
        .await;
    assert!(dom.contains("waiting for ack"), "{dom}");
    assert!(dom.contains("this node does not lead"), "{dom}");

    // --- Aborted ones: by the votes, and by the client with markup in its
    // reason (shown as text: no script ran, no element rendered).
    let dom = browser
        .dom("NO vote", &url(&lm, &format!("/console/txn/{voted_no}")))
        .await;
    assert!(dom.contains("DECIDED ABORT"), "{dom}");
    assert!(dom.contains("decided ABORT by the "), "{dom}");
    let dom = browser
        .dom("client abort", &url(&fm, &format!("/console/txn/{client_aborted}")))
        .await;
    assert!(dom.contains("decided ABORT by the client"), "{dom}");
    assert!(dom.contains("&lt;script&gt;document.body.setAttribute"), "{dom}");
    assert!(
        dom.contains("&lt;b id=\"injected\"&gt;bold&lt;/b&gt; &amp; \"quoted\""),
        "{dom}"
    );
    assert!(!dom.contains("data-pwned=\""), "the reason's script ran:\n{dom}");
    assert!(
        !dom.contains("<b id=\"injected\">"),
        "the reason rendered as markup:\n{dom}"
    );

    // --- The list, with ListTransactions' filters and paging words.
    let list = |q: &str| url(&fm, &format!("/console/transactions{q}"));
    let dom = browser.dom("all", &list("")).await;
    for t in committed.iter().chain([&voted_no, &client_aborted, &active, &stuck]) {
        assert!(has_row(&dom, *t), "all: {t} missing:\n{dom}");
    }
    assert!(dom.contains("the last page"), "{dom}");
    let dom = browser.dom("ACTIVE", &list("?state=active")).await;
    assert!(has_row(&dom, active) && !has_row(&dom, stuck), "{dom}");
    let dom = browser.dom("decided", &list("?state=decided")).await;
    assert!(
        has_row(&dom, stuck) && has_row(&dom, committed[0]) && !has_row(&dom, active),
        "{dom}"
    );
    let dom = browser.dom("unacknowledged", &list("?unacknowledged=1")).await;
    assert!(has_row(&dom, stuck) && !has_row(&dom, committed[0]), "{dom}");
    let dom = browser.dom("participant", &list("?participant=gamma")).await;
    assert!(has_row(&dom, stuck) && !has_row(&dom, committed[0]), "{dom}");
    let dom = browser.dom("after", &list(&format!("?after={}", committed[2]))).await;
    assert!(!has_row(&dom, committed[0]) && has_row(&dom, stuck), "{dom}");

    // --- An unknown txid.
    let dom = browser.dom("unknown txid", &url(&lm, "/console/txn/999999")).await;
    assert!(
        dom.contains("transaction 999999 not found: never begun here, or forgotten after every participant acked"),
        "{dom}"
    );

    // --- Plain HTTP: statuses, headers, and the metrics port unchanged.
    let (code, head, _) = http(&lm, "GET", "/console/txn/999999").await;
    assert_eq!(code, 404, "{head}");
    let (code, head, body) = http(&lm, "GET", "/console").await;
    assert_eq!(code, 200, "{head}");
    assert!(head.contains("content-type: text/html; charset=utf-8"), "{head}");
    assert!(head.contains("content-security-policy: default-src 'none'"), "{head}");
    assert!(body.contains("<meta http-equiv=\"refresh\" content=\"5\">"));
    for m in ["POST", "PUT", "DELETE"] {
        let (code, head, _) = http(&lm, m, "/console").await;
        assert_eq!(code, 405, "{m}: {head}");
        assert!(head.contains("allow: get"), "{head}");
    }
    let (code, _, body) = http(&lm, "GET", "/console/transactions?state=done").await;
    assert_eq!(code, 400);
    assert!(
        body.contains("state &quot;done&quot; is not one of active, preparing, decided"),
        "{body}"
    );
    let (code, _, body) = http(&lm, "GET", "/health").await;
    assert_eq!((code, body.as_str()), (200, "SERVING\n"));
    let (code, head, body) = http(&lm, "GET", "/metrics").await;
    assert_eq!(code, 200);
    assert!(head.contains("content-type: text/plain\r\n"), "{head}");
    assert!(body.contains("dtx_raft_term"), "{body}");

    // --- Screenshots: the overview and the stuck transaction's page.
    let shots = browser.dir.path();
    let overview_png = shots.join("overview.png");
    let n = browser
        .screenshot("overview", &url(&lm, "/console"), &overview_png)
        .await;
    eprintln!("overview screenshot: {n} bytes");
    let txn_png = shots.join("txn.png");
    let n = browser
        .screenshot("txn", &url(&lm, &format!("/console/txn/{stuck}")), &txn_png)
        .await;
    eprintln!("transaction screenshot: {n} bytes");
    if let Some(to) = std::env::var_os("DTX_CONSOLE_SCREENSHOT").filter(|v| !v.is_empty()) {
        std::fs::copy(&txn_png, &to).unwrap_or_else(|e| panic!("cannot write {}: {e}", Path::new(&to).display()));
        eprintln!(
            "wrote the transaction page's screenshot to {}",
            Path::new(&to).display()
        );
    }
    drop(alpha);
    drop(beta);
    eprintln!("t104: done in {:?}", test_started.elapsed());
}

/// `console_enabled = false`: `/console...` answers 404, the rest of the
/// port is unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t104_console_off_answers_404_and_keeps_health_and_metrics() {
    let mut c = TestCluster::start_with("t104-off", 1, |cfg| {
        with_console(cfg);
        cfg.console_enabled = false;
    });
    c.leader().await;
    let m = metrics_of(&c, 1);
    until_page(&c, &m, "/health", "serve", |code, _| code == 200).await;
    for path in ["/console", "/console/in-doubt", "/console/txn/1"] {
        let (code, _, body) = http(&m, "GET", path).await;
        assert_eq!(code, 404, "{path}: {body}");
        assert!(body.contains("console_enabled = false"), "{body}");
        assert!(!body.contains("<html"), "{body}");
    }
    let (code, _, body) = http(&m, "GET", "/metrics").await;
    assert_eq!(code, 200);
    assert!(body.contains("dtx_raft_term"), "{body}");
}
