//! `dtx-dev bench --retained 0,1000000,5000000` (issue 43): how the cost
//! of a node grows with the decided, fully acknowledged transactions it
//! retains (`txn.retention_ms`).
//!
//! For each count N, on a fresh three-node cluster of real node processes
//! (fsync on, the bench's node overrides, `txn.retention_ms` raised so
//! that nothing is forgotten during the run):
//!
//! 1. N transactions are begun and decided (ABORT, no participants: a
//!    record decided and, having no participant, fully acknowledged) by
//!    [`CLIENTS`] closed-loop clients as fast as the cluster takes them,
//!    with a progress line every [`PROGRESS_EVERY`]; then every node's
//!    `dtx_transactions` and `dtx_undelivered_transactions` are checked
//!    (≈ N and 0).
//! 2. After [`SETTLE`], each node's resident memory (`VmRSS` of
//!    `/proc/<pid>/status`) and its data directory's size on disk.
//! 3. Begin and Decide at [`CLIENTS`] clients, `--seconds` each, the
//!    median of `--rounds`, as the bench's Decide phase.
//! 4. A snapshot on the leader (`admin snapshot`), with the leader's
//!    `dtx_snapshot_last_build_seconds` and `dtx_snapshot_last_bytes`
//!    ("n/a" where a node has neither).
//! 5. A follower killed (SIGKILL) and started again: the time from its
//!    start until it serves, and its memory then; killed again, Decide
//!    load without it ([`BEHIND_LOAD`], longer until the leader is more
//!    than `raft.logs_to_keep_after_snapshot` entries ahead of it), a
//!    snapshot on the leader (which purges the log behind it), started
//!    again: the time until it has applied what the leader has, and
//!    whether it caught up by snapshot or from the log.
//!
//! Steps 3 to 5 add transactions of their own (a few seconds of Decide
//! load each): the snapshot, restart and catch-up of a row see N plus
//! those (the snapshot's line says how many the leader held).
//!
//! The table, the goals of issue 43 and the JSON are computed from the
//! measured rows only ([`results_text`], [`goal_lines`]), pure and
//! unit-tested.

use std::collections::HashMap;
use std::path::Path;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;
use std::time::Instant;

use anyhow::Context;

use crate::args::BenchArgs;
use crate::closed_loop::clients_for;
use crate::closed_loop::run_phase;
use crate::closed_loop::Step;
use crate::leader_watch;
use crate::leader_watch::LeaderWatch;
use crate::report::median_phase;
use crate::report::ms;
use crate::report::Phase;
use dtx_client::Client;
use dtx_client::ClientError;
use dtx_client::TxOutcome;
use dtx_testkit::cluster::ProcessCluster;

/// Clients of the loading and of the measured Decide phase.
pub const CLIENTS: usize = 256;
/// `txn.retention_ms` of the nodes of this mode: 30 days, so that no
/// record is forgotten during a run.
pub const RETENTION_MS: u64 = 30 * 24 * 3_600_000;
/// Progress lines while loading.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(10);
/// Quiet time between the loading and the memory reading.
pub const SETTLE: Duration = Duration::from_secs(5);
/// Seconds of Decide load while the follower is down before its catch-up;
/// then [`BEHIND_MORE`] at a time until the leader is
/// `raft.logs_to_keep_after_snapshot` + [`BEHIND_MARGIN`] entries ahead of
/// the follower (so that the snapshot purges what it lacks), for at most
/// [`BEHIND_LOAD_MAX`].
pub const BEHIND_LOAD: Duration = Duration::from_secs(10);
pub const BEHIND_MORE: Duration = Duration::from_secs(5);
pub const BEHIND_MARGIN: u64 = 100;
pub const BEHIND_LOAD_MAX: Duration = Duration::from_secs(120);
/// Longest wait for a restarted node to serve, to catch up, or for a
/// snapshot to be built.
pub const LONG_WAIT: Duration = Duration::from_secs(600);
/// Attempts of one loading transaction (the same key: Begin finds its
/// transaction again, and a second ABORT returns the first).
const LOAD_ATTEMPTS: usize = 3;
/// Goal 1 of issue 43: resident memory per retained transaction.
pub const GOAL_BYTES_PER_TXN: f64 = 200.0;
/// Goal 2: restart to serving with this many retained ...
pub const GOAL_RESTART_AT: u64 = 5_000_000;
/// ... within this long.
pub const GOAL_RESTART_SECONDS: f64 = 3.0;
/// Goal 3: Decide/s at the largest N at least this fraction of N = 0's.
pub const GOAL_THROUGHPUT_RATIO: f64 = 0.90;

/// `VmRSS` of a `/proc/<pid>/status` text, in bytes.
pub fn vm_rss_bytes(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let mut f = line["VmRSS:".len()..].split_whitespace();
    let n: u64 = f.next()?.parse().ok()?;
    let unit = match f.next().map(|u| u.to_ascii_lowercase()) {
        Some(u) if u == "kb" => 1024,
        Some(u) if u == "mb" => 1024 * 1024,
        Some(u) if u == "gb" => 1024 * 1024 * 1024,
        None => 1,
        Some(_) => return None,
    };
    n.checked_mul(unit)
}

/// Resident memory of process `pid` now, in bytes.
pub fn rss_of(pid: u32) -> Option<u64> {
    vm_rss_bytes(&std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?)
}

/// Bytes the files under `dir` take on disk (allocated blocks, as `du`
/// counts them); 0 for a directory that does not exist.
pub fn disk_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut total = 0;
    for e in entries.flatten() {
        let Ok(m) = e.metadata() else { continue };
        if m.is_dir() {
            total += disk_bytes(&e.path());
        } else {
            total += m.blocks() * 512;
        }
    }
    total
}

/// The mean of the values read, or `None` when none was.
pub fn mean(values: &[Option<u64>]) -> Option<f64> {
    let read: Vec<u64> = values.iter().flatten().copied().collect();
    (!read.is_empty()).then(|| read.iter().sum::<u64>() as f64 / read.len() as f64)
}

/// `(rss_n - rss_0) / n` in bytes per retained transaction, or `None`
/// for n = 0 or a figure missing.
pub fn bytes_per_txn(rss_n: Option<f64>, rss_0: Option<f64>, n: u64) -> Option<f64> {
    (n > 0).then_some(())?;
    Some((rss_n? - rss_0?) / n as f64)
}

/// The snapshot built on the leader on request, as its metrics say.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct SnapshotRead {
    /// The leader, whose snapshot it is.
    pub node: u64,
    /// `dtx_snapshot_last_build_seconds`; `None` when absent or 0.
    pub build_seconds: Option<f64>,
    /// `dtx_snapshot_last_bytes`; `None` when absent or 0.
    pub bytes: Option<u64>,
    /// From the request until the leader's snapshot covered what it had
    /// applied at the request (includes the admin call's own start).
    pub wall_seconds: Option<f64>,
    /// The leader's `dtx_transactions` when it was seen built: N and what
    /// the measured phases added.
    pub transactions: Option<u64>,
    /// Why the snapshot was not seen built, if it was not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A follower killed and started again on its data.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Restart {
    pub node: u64,
    /// From its start until it serves; `None`: not within [`LONG_WAIT`].
    pub seconds: Option<f64>,
    /// Its resident memory when it first served.
    pub rss_bytes: Option<u64>,
}

/// How a restarted follower caught up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CatchUpBy {
    /// It installed a snapshot from the leader (its
    /// `dtx_snapshots_installed_total` rose).
    Snapshot,
    /// From the leader's log.
    Log,
    /// Its metrics could not be read.
    Unknown,
}

impl CatchUpBy {
    pub fn word(self) -> &'static str {
        match self {
            CatchUpBy::Snapshot => "snapshot",
            CatchUpBy::Log => "log",
            CatchUpBy::Unknown => "unknown",
        }
    }
}

/// A follower that fell behind (down during [`BEHIND_LOAD`] of Decide
/// load and a snapshot on the leader), started again.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CatchUp {
    pub node: u64,
    /// From its start until its applied index reached the leader's;
    /// `None`: not within [`LONG_WAIT`].
    pub seconds: Option<f64>,
    pub by: CatchUpBy,
    /// Its applied index when it was killed.
    pub index_at_kill: u64,
    /// The leader's applied and purged index when it was started again.
    pub leader_applied: u64,
    pub leader_purged: u64,
    /// Decides acknowledged while it was down, over this long.
    pub decides_while_down: usize,
    pub load_seconds_while_down: f64,
    /// Its `dtx_snapshot_last_install_seconds` after catching up.
    pub install_seconds: Option<f64>,
}

/// One count of retained transactions, measured.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Row {
    /// N: the transactions asked to be retained.
    pub retained: u64,
    /// Decides acknowledged while loading, the loading's time and the
    /// transactions whose every attempt failed (with the first error).
    pub loaded: u64,
    pub load_seconds: f64,
    pub load_failed: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub load_first_error: Option<String>,
    /// Each node's `dtx_transactions` and `dtx_undelivered_transactions`
    /// after loading (`None`: its metrics not read), by node id.
    pub transactions: Vec<Option<u64>>,
    pub undelivered: Vec<Option<u64>>,
    /// Each node's resident memory at rest after loading, bytes.
    pub rss_bytes: Vec<Option<u64>>,
    /// Each node's data directory on disk, bytes.
    pub disk_bytes: Vec<u64>,
    /// Decide at [`CLIENTS`] clients (median of the rounds).
    pub decide: Phase,
    pub snapshot: SnapshotRead,
    pub restart: Option<Restart>,
    pub catch_up: Option<CatchUp>,
    /// Anything that went wrong or looked off, in words.
    pub notes: Vec<String>,
}

impl Row {
    /// The mean resident memory of the nodes at rest.
    pub fn rss_mean(&self) -> Option<f64> {
        mean(&self.rss_bytes)
    }

    /// Whether every node holds about N records (within 1 % and 100) and
    /// none is undelivered.
    pub fn load_checked(&self) -> bool {
        let slack = (self.retained / 100).max(100);
        !self.transactions.is_empty()
            && self
                .transactions
                .iter()
                .all(|t| t.is_some_and(|t| t.abs_diff(self.retained) <= slack))
            && self.undelivered.iter().all(|u| *u == Some(0))
    }
}

/// What this mode measured.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Report {
    pub clients: usize,
    pub seconds: u64,
    pub rounds: u64,
    pub retention_ms: u64,
    pub rows: Vec<Row>,
}

impl Report {
    fn zero(&self) -> Option<&Row> {
        self.rows.iter().find(|r| r.retained == 0)
    }

    /// Row `r`'s memory per retained transaction against the N = 0 row of
    /// the same run.
    pub fn bytes_per_txn(&self, r: &Row) -> Option<f64> {
        bytes_per_txn(r.rss_mean(), self.zero()?.rss_mean(), r.retained)
    }

    /// Row `r`'s Decide/s over the N = 0 row's.
    pub fn decide_ratio(&self, r: &Row) -> Option<f64> {
        crate::report::ratio(r.decide.stats.per_sec, self.zero()?.decide.stats.per_sec)
    }
}

fn mb(b: u64) -> String {
    format!("{:.0}", b as f64 / 1_048_576.0)
}

fn per_node(v: &[Option<u64>], f: impl Fn(u64) -> String) -> String {
    v.iter()
        .map(|x| x.map(&f).unwrap_or_else(|| "n/a".into()))
        .collect::<Vec<_>>()
        .join(" / ")
}

fn secs(s: Option<f64>) -> String {
    s.map(|s| format!("{s:.2} s")).unwrap_or_else(|| "n/a".into())
}

/// The three goal lines of issue 43, from the measured rows only.
pub fn goal_lines(r: &Report) -> Vec<String> {
    let largest = r.rows.iter().filter(|x| x.retained > 0).max_by_key(|x| x.retained);
    let memory = match (r.zero(), largest.and_then(|x| Some((x, r.bytes_per_txn(x)?)))) {
        (Some(_), Some((x, b))) => format!("{} ({b:.0} B at {} retained)", met(b <= GOAL_BYTES_PER_TXN), x.retained),
        _ => "not measured (needs a 0 row and a larger N, with every node's memory read, in the same run)".into(),
    };
    let restart = match r
        .rows
        .iter()
        .filter(|x| x.retained >= GOAL_RESTART_AT)
        .min_by_key(|x| x.retained)
    {
        None => format!(
            "not measured (no row with {GOAL_RESTART_AT} or more retained; largest {})",
            r.rows.iter().map(|x| x.retained).max().unwrap_or(0)
        ),
        Some(x) => match x.restart.as_ref() {
            None => format!("not measured (no restart at {} retained)", x.retained),
            Some(Restart { seconds: None, .. }) => format!(
                "MISSED (not serving within {} s, at {} retained)",
                LONG_WAIT.as_secs(),
                x.retained
            ),
            Some(Restart { seconds: Some(s), .. }) => format!(
                "{} ({s:.2} s at {} retained)",
                met(*s <= GOAL_RESTART_SECONDS),
                x.retained
            ),
        },
    };
    let throughput = match (r.zero(), largest) {
        (Some(z), Some(x)) => match (&z.decide.leader_change, &x.decide.leader_change, r.decide_ratio(x)) {
            (Some(c), _, _) | (_, Some(c), _) => format!("not judged (a leader change during a measured phase: {c})"),
            (_, _, None) => "not measured (N=0 completed no Decide)".into(),
            (_, _, Some(q)) => format!(
                "{} ({q:.2} at {} retained: {:.0}/s vs {:.0}/s)",
                met(q >= GOAL_THROUGHPUT_RATIO),
                x.retained,
                x.decide.stats.per_sec,
                z.decide.stats.per_sec
            ),
        },
        _ => "not measured (needs a 0 row and a larger N in the same run)".into(),
    };
    vec![
        format!("goal 1 memory: <= {GOAL_BYTES_PER_TXN:.0} B per retained transaction: {memory}"),
        format!("goal 2 restart: <= {GOAL_RESTART_SECONDS:.0} s with 5M retained: {restart}"),
        format!("goal 3 throughput flat: Decide/s at {CLIENTS} with the largest N within 10% of N=0: {throughput}"),
    ]
}

fn met(yes: bool) -> &'static str {
    if yes {
        "MET"
    } else {
        "MISSED"
    }
}

/// The section of results.txt: the table, each row's loading and
/// catch-up in words, the notes and the goal lines.
pub fn results_text(r: &Report) -> String {
    let mut t = format!(
        "retained state (issue 43): per N, a fresh 3-node cluster, txn.retention_ms {}; N transactions begun and \
         decided (ABORT, no participants) by {} clients; memory (VmRSS) and disk per node after {} s at rest \
         (node 1 / 2 / 3); Decide at {} clients, --seconds {}, median of {} rounds; snapshot on the leader; a \
         follower killed and started (restart = from its start until it serves), then killed again, {} s or more \
         of load (until the leader is past the log it keeps behind a snapshot) and a snapshot on the leader without \
         it, and started (catch-up = from its start until it applied what the leader had)\n\n",
        r.retention_ms,
        r.clients,
        SETTLE.as_secs(),
        r.clients,
        r.seconds,
        r.rounds,
        BEHIND_LOAD.as_secs()
    );
    t.push_str(
        "| retained | RSS per node (MB) | B per retained txn | disk per node (MB) | Decide/s | ÷ N=0 | p50 | p99 \
         | snapshot build | snapshot size (MB) | restart to serving | RSS after restart (MB) | catch-up |\n",
    );
    t.push_str("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for row in &r.rows {
        let disk: Vec<Option<u64>> = row.disk_bytes.iter().map(|b| Some(*b)).collect();
        t.push_str(&format!(
            "| {} | {} | {} | {} | {:.0} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            row.retained,
            per_node(&row.rss_bytes, mb),
            r.bytes_per_txn(row)
                .map(|b| format!("{b:.0}"))
                .unwrap_or_else(|| "n/a".into()),
            per_node(&disk, mb),
            row.decide.stats.per_sec,
            r.decide_ratio(row)
                .map(|q| format!("{q:.2}"))
                .unwrap_or_else(|| "n/a".into()),
            ms(row.decide.stats.p50_us),
            ms(row.decide.stats.p99_us),
            secs(row.snapshot.build_seconds),
            row.snapshot.bytes.map(mb).unwrap_or_else(|| "n/a".into()),
            secs(row.restart.as_ref().and_then(|x| x.seconds)),
            row.restart
                .as_ref()
                .and_then(|x| x.rss_bytes)
                .map(mb)
                .unwrap_or_else(|| "n/a".into()),
            row.catch_up
                .as_ref()
                .map(|c| format!("{} ({})", secs(c.seconds), c.by.word()))
                .unwrap_or_else(|| "n/a".into()),
        ));
    }
    t.push('\n');
    for row in &r.rows {
        t.push_str(&format!(
            "- N={}: loaded {} in {:.1} s ({:.0}/s, {} failed); dtx_transactions {}; undelivered {} ({}); snapshot \
             on node {} ({} transactions then) seen built {} after the request\n",
            row.retained,
            row.loaded,
            row.load_seconds,
            row.loaded as f64 / row.load_seconds.max(1e-9),
            row.load_failed,
            per_node(&row.transactions, |x| x.to_string()),
            per_node(&row.undelivered, |x| x.to_string()),
            if row.load_checked() { "check OK" } else { "CHECK FAILED" },
            row.snapshot.node,
            row.snapshot
                .transactions
                .map(|t| t.to_string())
                .unwrap_or_else(|| "n/a".into()),
            secs(row.snapshot.wall_seconds),
        ));
        if let Some(c) = &row.catch_up {
            t.push_str(&format!(
                "  catch-up of node {}: applied {} when killed, {} Decides in {:.0} s without it; the leader at {} \
                 applied, log purged to {}; caught up by {} in {}{}\n",
                c.node,
                c.index_at_kill,
                c.decides_while_down,
                c.load_seconds_while_down,
                c.leader_applied,
                c.leader_purged,
                c.by.word(),
                secs(c.seconds),
                c.install_seconds
                    .map(|s| format!(" (its snapshot install {s:.2} s)"))
                    .unwrap_or_default()
            ));
        }
        for n in &row.notes {
            t.push_str(&format!("  note: {n}\n"));
        }
    }
    t.push('\n');
    for g in goal_lines(r) {
        t.push_str(&g);
        t.push('\n');
    }
    t
}

/// The JSON of the mode (`"retained"` in results.json): the rows and the
/// figures derived from them.
pub fn json(r: &Report) -> serde_json::Value {
    serde_json::json!({
        "clients": r.clients,
        "seconds": r.seconds,
        "rounds": r.rounds,
        "retention_ms": r.retention_ms,
        "rows": r.rows.iter().map(|row| {
            let mut v = serde_json::to_value(row).unwrap_or_default();
            v["rss_mean_bytes"] = serde_json::json!(row.rss_mean());
            v["bytes_per_retained_txn"] = serde_json::json!(r.bytes_per_txn(row));
            v["decide_over_zero"] = serde_json::json!(r.decide_ratio(row));
            v["load_checked"] = serde_json::json!(row.load_checked());
            v
        }).collect::<Vec<_>>(),
        "goals": goal_lines(r),
    })
}

/// Runs the mode: one fresh cluster per count of `a.retained`, under
/// `dir` (its node data removed after each count, its logs kept).
pub async fn measure(a: &BenchArgs, bin: &Path, dir: &Path) -> anyhow::Result<Report> {
    let mut rows = Vec::new();
    for &n in &a.retained {
        println!("retained N={n}: starting a fresh cluster");
        let row = measure_one(a, bin, &cluster_dir(dir, n), n).await?;
        rows.push(row);
    }
    Ok(Report {
        clients: CLIENTS,
        seconds: a.seconds,
        rounds: a.rounds,
        retention_ms: RETENTION_MS,
        rows,
    })
}

/// `--retained-only`: the disk's fsync rate, then this mode alone, its
/// results printed and written to `out` (results.txt, results.json).
pub async fn run_only(a: &BenchArgs, out: &Path, started_unix: u64) -> anyhow::Result<()> {
    let dir = a.dir.clone();
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let dir = dir.canonicalize()?;
    let machine = crate::machine::Machine::read();
    println!("machine: {}", machine.line());
    println!("measuring fsync on {} ({} syncs)...", dir.display(), a.fsyncs);
    let (raw, sled_sync) = crate::disk::measure_fsync(&dir, a.fsyncs)?;
    println!(
        "disk: fdatasync {:.0}/s (p50 {} us); sled insert+flush {:.0}/s (p50 {} us)",
        raw.per_sec, raw.p50_us, sled_sync.per_sec, sled_sync.p50_us
    );
    let bin = std::env::current_exe().context("cannot find the coordinator binary")?;
    let report = measure(a, &bin, &dir).await?;
    let mut text = format!(
        "dtx-dev bench --retained-only, unix time {started_unix}; --retained {:?} --seconds {} --warmup {} --rounds {}{}\n\
         machine: {}\ndisk: fdatasync {:.0}/s, p50 {}; sled insert+flush {:.0}/s\n\n",
        a.retained,
        a.seconds,
        a.warmup,
        a.rounds,
        crate::args::overrides(a),
        machine.line(),
        raw.per_sec,
        ms(raw.p50_us),
        sled_sync.per_sec
    );
    text.push_str(&results_text(&report));
    println!();
    print!("{text}");
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    std::fs::write(out.join("results.txt"), &text)?;
    let v = serde_json::json!({
        "started_unix": started_unix,
        "cpus": machine.cpus,
        "machine": machine,
        "args": {
            "retained": a.retained, "retained_only": true, "seconds": a.seconds, "warmup": a.warmup,
            "rounds": a.rounds, "dir": a.dir,
            "inflight_max": a.inflight_max, "wait_us": a.wait_us, "refill_wait_us": a.refill_wait_us,
            "delivery_wait_us": a.delivery_wait_us, "commit_index_defer_max_ms": a.commit_index_defer_max_ms,
        },
        "fsync": raw, "sled_flush": sled_sync,
        "retained": json(&report),
    });
    let body = serde_json::to_string_pretty(&v)?;
    std::fs::write(out.join("results.json"), &body)?;
    if let Some(p) = &a.json {
        std::fs::write(p, &body).with_context(|| format!("cannot write {}", p.display()))?;
    }
    println!("results: {}", out.display());
    let empty: Vec<String> = report
        .rows
        .iter()
        .filter(|r| r.decide.stats.ops == 0)
        .map(|r| format!("Decide at N={}: no call completed", r.retained))
        .collect();
    anyhow::ensure!(empty.is_empty(), "nothing measured:\n{}", empty.join("\n"));
    Ok(())
}

/// Each node's metrics port, by node id.
fn metrics_addrs(c: &ProcessCluster) -> HashMap<u64, String> {
    c.nodes
        .iter()
        .filter_map(|n| Some((n.plan.id, n.config.metrics_addr.clone()?)))
        .collect()
}

async fn samples(addr: Option<&String>) -> Option<HashMap<String, f64>> {
    let text = dtx_testkit::node_metrics::scrape(addr?).await.ok()?;
    Some(dtx_testkit::node_metrics::samples(&text))
}

/// A gauge that is there and positive.
fn positive(s: Option<&HashMap<String, f64>>, name: &str) -> Option<f64> {
    s?.get(name).copied().filter(|v| *v > 0.0 && v.is_finite())
}

async fn status(addr: &str) -> Option<(u64, u64, u64)> {
    let s = dtx_client::cluster_status_at(addr, Duration::from_secs(2)).await.ok()?;
    Some((s.last_applied_index, s.snapshot_index, s.purged_index))
}

async fn measure_one(a: &BenchArgs, bin: &Path, dir: &Path, n: u64) -> anyhow::Result<Row> {
    let _ = std::fs::remove_dir_all(dir);
    let plans = ProcessCluster::plan_local("127.0.0.1", 3)?;
    let mut cluster = ProcessCluster::new(bin, dir, "dtx-bench-retained", plans, |c| {
        c.metrics_addr = dtx_testkit::cluster::free_port("127.0.0.1")
            .ok()
            .map(|p| format!("127.0.0.1:{p}"));
        crate::args::apply_node_overrides(a, c);
        c.txn.retention_ms = RETENTION_MS;
    })?;
    cluster.start_all()?;
    let leader = cluster.leader_within(Duration::from_secs(30)).await?;
    anyhow::ensure!(
        cluster.wait_serving(leader, Duration::from_secs(30)).await,
        "N={n}: the new cluster's leader (node {leader}) did not serve within 30 s; logs in {}",
        dir.display()
    );
    let maddr = metrics_addrs(&cluster);
    let watch = LeaderWatch::new(cluster.api_addrs(), None).with_metrics(maddr.clone());
    let ids: Vec<u64> = cluster.nodes.iter().map(|x| x.plan.id).collect();
    let mut notes = Vec::new();

    // 1. Load.
    let l = watch.find().await;
    let clients = clients_for(&watch.leader_first(l.as_ref()), CLIENTS);
    let load = load(&clients, n, &format!("ret{n}")).await;
    println!(
        "N={n}: loaded {} in {:.1} s ({:.0}/s), {} failed{}",
        load.done,
        load.seconds,
        load.done as f64 / load.seconds.max(1e-9),
        load.failed,
        load.first_error
            .as_deref()
            .map(|e| format!(" (first error: {e})"))
            .unwrap_or_default()
    );
    if load.failed > 0 {
        notes.push(format!("{} loading transactions failed every attempt", load.failed));
    }
    // Every node holds what was loaded (gauges refreshed every second).
    let until = Instant::now() + Duration::from_secs(60);
    let (transactions, undelivered) = loop {
        let mut t = Vec::new();
        let mut u = Vec::new();
        for id in &ids {
            let s = samples(maddr.get(id)).await;
            t.push(s.as_ref().and_then(|s| s.get("dtx_transactions")).map(|v| *v as u64));
            u.push(
                s.as_ref()
                    .and_then(|s| s.get("dtx_undelivered_transactions"))
                    .map(|v| *v as u64),
            );
        }
        let done = t.iter().all(|x| x.is_some_and(|x| x >= load.done)) && u.iter().all(|x| *x == Some(0));
        if done || Instant::now() >= until {
            break (t, u);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    println!(
        "N={n}: dtx_transactions per node {}; dtx_undelivered_transactions {}",
        per_node(&transactions, |x| x.to_string()),
        per_node(&undelivered, |x| x.to_string())
    );

    // 2. At rest: memory and disk.
    tokio::time::sleep(SETTLE).await;
    let rss_bytes: Vec<Option<u64>> = cluster.nodes.iter().map(|x| x.pid().and_then(rss_of)).collect();
    let disk: Vec<u64> = cluster.nodes.iter().map(|x| disk_bytes(&x.config.data_dir)).collect();
    println!(
        "N={n}: at rest: RSS per node {} MB; data on disk per node {} MB",
        per_node(&rss_bytes, mb),
        disk.iter().map(|b| mb(*b)).collect::<Vec<_>>().join(" / ")
    );

    // 3. Decide at CLIENTS clients.
    let decide = decide_rounds(&watch, a, n).await;

    // 4. Snapshot on the leader.
    let leader = watch.find().await;
    let snapshot = match &leader {
        Some(l) => snapshot(bin, l, maddr.get(&l.id)).await,
        None => SnapshotRead {
            error: Some("no leader found".into()),
            ..Default::default()
        },
    };
    println!(
        "N={n}: snapshot on node {} ({} transactions): build {} (dtx_snapshot_last_build_seconds), {} bytes, seen \
         built {} after the request{}",
        snapshot.node,
        snapshot
            .transactions
            .map(|t| t.to_string())
            .unwrap_or_else(|| "n/a".into()),
        secs(snapshot.build_seconds),
        snapshot.bytes.map(|b| b.to_string()).unwrap_or_else(|| "n/a".into()),
        secs(snapshot.wall_seconds),
        snapshot.error.as_deref().map(|e| format!(" ({e})")).unwrap_or_default()
    );
    if let Some(e) = &snapshot.error {
        notes.push(format!("snapshot: {e}"));
    }

    // 5. Restart a follower, then its catch-up.
    let (restart, catch_up) = match leader {
        Some(l) => match ids.iter().copied().find(|id| *id != l.id) {
            Some(f) => {
                let r = restart(&mut cluster, f).await?;
                println!(
                    "N={n}: node {f} killed and started: serving after {}; RSS then {} MB",
                    secs(r.seconds),
                    r.rss_bytes.map(mb).unwrap_or_else(|| "n/a".into())
                );
                let c = catch_up(&mut cluster, &watch, bin, f, &maddr, n).await?;
                if let Some(c) = &c {
                    println!(
                        "N={n}: node {f} caught up by {} in {} ({} Decides while it was down)",
                        c.by.word(),
                        secs(c.seconds),
                        c.decides_while_down
                    );
                }
                (Some(r), c)
            }
            None => (None, None),
        },
        None => {
            notes.push("no leader after the snapshot: no restart measured".into());
            (None, None)
        }
    };

    cluster.stop_all(Duration::from_secs(10));
    for node in &cluster.nodes {
        let _ = std::fs::remove_dir_all(&node.config.data_dir);
    }
    let row = Row {
        retained: n,
        loaded: load.done,
        load_seconds: load.seconds,
        load_failed: load.failed,
        load_first_error: load.first_error,
        transactions,
        undelivered,
        rss_bytes,
        disk_bytes: disk,
        decide,
        snapshot,
        restart,
        catch_up,
        notes,
    };
    if !row.load_checked() {
        println!("N={n}: WARNING: the nodes do not hold about {n} decided, acknowledged transactions (see above)");
    }
    Ok(row)
}

struct Load {
    done: u64,
    failed: u64,
    seconds: f64,
    first_error: Option<String>,
}

/// One transaction begun under `key` and decided ABORT.
async fn begin_and_abort(c: &Client, key: &str) -> Result<(), String> {
    let b = c
        .begin(key, 3_600_000, &crate::args::value_for(key.as_bytes()))
        .await
        .map_err(|e| e.to_string())?;
    match c.abort(b.txid, "bench").await {
        Ok(TxOutcome::Aborted) => Ok(()),
        other => Err(format!("Abort of txid {}: {other:?}", b.txid)),
    }
}

/// `n` transactions begun and decided by every client in a closed loop,
/// each tried up to [`LOAD_ATTEMPTS`] times, with a progress line every
/// [`PROGRESS_EVERY`].
async fn load(clients: &[Arc<Client>], n: u64, tag: &str) -> Load {
    let next = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let first_error: Arc<Mutex<Option<String>>> = Arc::default();
    let start = Instant::now();
    let progress = {
        let (done, tag) = (done.clone(), tag.to_string());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(PROGRESS_EVERY).await;
                let d = done.load(Ordering::Relaxed);
                let rate = d as f64 / start.elapsed().as_secs_f64();
                let left = n.saturating_sub(d) as f64 / rate.max(1e-9);
                println!(
                    "{tag}: loading: {d} of {n} ({:.1} %), {rate:.0}/s, about {left:.0} s left",
                    100.0 * d as f64 / n.max(1) as f64
                );
            }
        })
    };
    let tasks: Vec<_> = clients
        .iter()
        .cloned()
        .map(|c| {
            let (next, done, failed, first_error, tag) = (
                next.clone(),
                done.clone(),
                failed.clone(),
                first_error.clone(),
                tag.to_string(),
            );
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    let key = format!("{tag}-{i}");
                    let mut ok = false;
                    for _ in 0..LOAD_ATTEMPTS {
                        match begin_and_abort(&c, &key).await {
                            Ok(()) => {
                                ok = true;
                                break;
                            }
                            Err(e) => {
                                first_error.lock().expect("lock").get_or_insert(e);
                            }
                        }
                    }
                    let counter = if ok { &done } else { &failed };
                    counter.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for t in tasks {
        let _ = t.await;
    }
    progress.abort();
    let first_error = first_error.lock().expect("lock").clone();
    Load {
        done: done.load(Ordering::Relaxed),
        failed: failed.load(Ordering::Relaxed),
        seconds: start.elapsed().as_secs_f64(),
        first_error,
    }
}

/// Begin, then Decide (ABORT) what was begun, at [`CLIENTS`] clients for
/// `--seconds` each, `--rounds` times, after `--warmup` of both: the
/// median Decide phase.
async fn decide_rounds(watch: &LeaderWatch, a: &BenchArgs, n: u64) -> Phase {
    let measured = Duration::from_secs(a.seconds);
    let mut phases = Vec::new();
    for r in 1..=a.rounds {
        let round = crate::closed_loop::round_label(r, a.rounds);
        let before = watch.find().await;
        let clients = clients_for(&watch.leader_first(before.as_ref()), CLIENTS);
        for c in &clients {
            let _ = c.cluster_status().await;
        }
        run_phase(&clients, Duration::from_secs(a.warmup), move |c, w, i| async move {
            match begin_and_abort(&c, &format!("ret{n}-warm-{r}-{w}-{i}")).await {
                Ok(()) => Step::Done,
                Err(e) => Step::Error(e),
            }
        })
        .await;
        let made: Arc<Vec<Mutex<Vec<u64>>>> = Arc::new((0..CLIENTS).map(|_| Default::default()).collect());
        let m = made.clone();
        run_phase(&clients, measured, move |c, w, i| {
            let m = m.clone();
            async move {
                let key = format!("ret{n}-begin-{r}-{w}-{i}");
                match c.begin(&key, 3_600_000, &crate::args::value_for(key.as_bytes())).await {
                    Ok(b) => {
                        m[w].lock().expect("lock").push(b.txid);
                        Step::Done
                    }
                    Err(ClientError::Unknown(e)) => Step::Unknown(e),
                    Err(e) => Step::Error(e.to_string()),
                }
            }
        })
        .await;
        let between = watch.find().await;
        let m = made.clone();
        let decide = run_phase(&clients, measured, move |c, w, i| {
            let m = m.clone();
            async move {
                let Some(t) = m[w].lock().expect("lock").get(i).copied() else {
                    return Step::Stop;
                };
                match c.abort(t, "bench").await {
                    Ok(TxOutcome::Aborted) => Step::Done,
                    Ok(TxOutcome::Unknown) => Step::Unknown(format!("Decide of txid {t}")),
                    Ok(TxOutcome::Committed) => Step::Error(format!("Abort of fresh txid {t} returned COMMITTED")),
                    Err(e) => Step::Error(e.to_string()),
                }
            }
        })
        .await;
        let after = watch.find().await;
        let p = decide.phase(None, leader_watch::change(between.as_ref(), after.as_ref()));
        println!(
            "N={n}{round}: decide at {CLIENTS} clients {:.0}/s p50 {} p99 {}{}",
            p.stats.per_sec,
            ms(p.stats.p50_us),
            ms(p.stats.p99_us),
            p.leader_change
                .as_deref()
                .map(|c| format!(" NOT A FAIR MEASURE: {c}"))
                .unwrap_or_default()
        );
        phases.push(p);
    }
    median_phase(&phases)
}

/// `admin snapshot` on `leader` (the CLI of `bin`, as an operator runs
/// it), then its metrics until its built-snapshot counter rose and its
/// snapshot covers what it had applied at the request.
async fn snapshot(bin: &Path, leader: &leader_watch::Leader, metrics: Option<&String>) -> SnapshotRead {
    let before = samples(metrics).await;
    let built = |s: Option<&HashMap<String, f64>>| s.and_then(|s| s.get("dtx_snapshots_built_total").copied());
    let built_before = built(before.as_ref()).unwrap_or(0.0);
    let target = status(&leader.addr).await.map(|s| s.0).unwrap_or(0);
    let start = Instant::now();
    let out = tokio::process::Command::new(bin)
        .args(["admin", "--addr", &leader.addr, "--timeout-s"])
        .arg(LONG_WAIT.as_secs().to_string())
        .args(["--json", "snapshot"])
        .kill_on_drop(true)
        .output()
        .await;
    let call_ok = matches!(&out, Ok(o) if o.status.success());
    let mut call_error = match &out {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!(
            "admin snapshot exited {}: {}",
            o.status,
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Some(format!("cannot run admin snapshot: {e}")),
    };
    let until = start + LONG_WAIT;
    loop {
        let s = samples(metrics).await;
        let covered = status(&leader.addr).await.is_some_and(|st| st.1 >= target);
        let rose = built(s.as_ref()).is_some_and(|b| b > built_before);
        if covered && (rose || call_ok) {
            return SnapshotRead {
                node: leader.id,
                build_seconds: positive(s.as_ref(), "dtx_snapshot_last_build_seconds"),
                bytes: positive(s.as_ref(), "dtx_snapshot_last_bytes").map(|b| b as u64),
                transactions: s.as_ref().and_then(|s| s.get("dtx_transactions")).map(|v| *v as u64),
                wall_seconds: Some(start.elapsed().as_secs_f64()),
                // The call may give up (the node waits 30 s) while the
                // build goes on: it was seen built all the same.
                error: call_error
                    .take()
                    .map(|e| format!("{e} (the snapshot was seen built all the same)")),
            };
        }
        if Instant::now() >= until {
            return SnapshotRead {
                node: leader.id,
                error: Some(call_error.unwrap_or_else(|| format!("not seen built within {} s", LONG_WAIT.as_secs()))),
                ..Default::default()
            };
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Follower `f` killed (SIGKILL) and started again: the time from its
/// start until it serves, and its memory then.
async fn restart(cluster: &mut ProcessCluster, f: u64) -> anyhow::Result<Restart> {
    cluster.kill9(f);
    let start = Instant::now();
    cluster.start(f)?;
    let serving = cluster.wait_serving(f, LONG_WAIT).await;
    let seconds = serving.then(|| start.elapsed().as_secs_f64());
    let rss_bytes = cluster.node(f).pid().and_then(rss_of);
    Ok(Restart {
        node: f,
        seconds,
        rss_bytes,
    })
}

/// Follower `f` killed, [`BEHIND_LOAD`] of Begin + Decide without it, a
/// snapshot on the leader (the log is purged behind it), then `f`
/// started: the time until its applied index reaches the leader's.
async fn catch_up(
    cluster: &mut ProcessCluster,
    watch: &LeaderWatch,
    bin: &Path,
    f: u64,
    maddr: &HashMap<u64, String>,
    n: u64,
) -> anyhow::Result<Option<CatchUp>> {
    let f_api = cluster.node(f).plan.api_listen.clone();
    let index_at_kill = status(&f_api).await.map(|s| s.0).unwrap_or(0);
    cluster.kill9(f);
    let Some(l) = watch.find().await else {
        println!("N={n}: no leader with node {f} down: no catch-up measured");
        return Ok(None);
    };
    let clients = clients_for(&watch.leader_first(Some(&l)), CLIENTS);
    // Load until the leader is more than the log it keeps behind a
    // snapshot ahead of the follower, so that the snapshot below purges
    // what the follower lacks: it then has to catch up by snapshot.
    let keep = cluster.node(l.id).config.raft.logs_to_keep_after_snapshot;
    let far_enough = index_at_kill + keep + BEHIND_MARGIN;
    let started = Instant::now();
    let mut decides = 0;
    let mut round = 0;
    loop {
        let length = if round == 0 { BEHIND_LOAD } else { BEHIND_MORE };
        let behind = run_phase(&clients, length, move |c, w, i| async move {
            match begin_and_abort(&c, &format!("ret{n}-behind-{round}-{w}-{i}")).await {
                Ok(()) => Step::Done,
                Err(e) => Step::Error(e),
            }
        })
        .await;
        decides += behind.stats.ops;
        round += 1;
        let applied = status(&l.addr).await.map(|s| s.0).unwrap_or(0);
        if applied >= far_enough || started.elapsed() >= BEHIND_LOAD_MAX {
            break;
        }
    }
    let behind_seconds = started.elapsed().as_secs_f64();
    let s = snapshot(bin, &l, maddr.get(&l.id)).await;
    if let Some(e) = &s.error {
        println!("N={n}: the snapshot before the catch-up: {e}");
    }
    // The purge follows the snapshot; give it a moment.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (leader_applied, _, leader_purged) = status(&l.addr).await.unwrap_or_default();
    let start = Instant::now();
    cluster.start(f)?;
    let until = start + LONG_WAIT;
    let seconds = loop {
        if let (Some(fs), Some(ls)) = (status(&f_api).await, status(&l.addr).await) {
            if fs.0 >= ls.0 && fs.0 > 0 {
                break Some(start.elapsed().as_secs_f64());
            }
        }
        if Instant::now() >= until {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let fm = samples(maddr.get(&f)).await;
    let by = match fm.as_ref() {
        None => CatchUpBy::Unknown,
        Some(m) if m.get("dtx_snapshots_installed_total").is_some_and(|v| *v > 0.0) => CatchUpBy::Snapshot,
        Some(_) => CatchUpBy::Log,
    };
    Ok(Some(CatchUp {
        node: f,
        seconds,
        by,
        index_at_kill,
        leader_applied,
        leader_purged,
        decides_while_down: decides,
        load_seconds_while_down: behind_seconds,
        install_seconds: positive(fm.as_ref(), "dtx_snapshot_last_install_seconds"),
    }))
}

/// Where this mode keeps a count's cluster under `dir`.
pub fn cluster_dir(dir: &Path, n: u64) -> PathBuf {
    dir.join(format!("retained-{n}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::check_args;
    use crate::args::parse;
    use crate::args::retained_counts;

    #[test]
    fn retained_counts_are_a_sorted_list_with_suffixes_and_none_by_default() {
        let d = parse(&[]).unwrap();
        assert!(d.retained.is_empty() && !d.retained_only);
        assert_eq!(check_args(&d), Ok(()));
        let a = parse(&["--retained", "5m, 0,1_000_000", "--retained-only"]).unwrap();
        assert_eq!(a.retained, vec![0, 1_000_000, 5_000_000]);
        assert!(a.retained_only);
        assert_eq!(check_args(&a), Ok(()));
        assert_eq!(retained_counts("50k,2K").unwrap(), vec![2_000, 50_000]);
        assert_eq!(retained_counts(" ").unwrap(), Vec::<u64>::new());
        let bad = parse(&["--retained", "0,lots"]).unwrap_err();
        assert!(bad.contains("\"lots\" is not a count of transactions"), "{bad}");
        for s in ["-1", "1.5m", "m", "1e6", "0,,1", "99999999999999999999"] {
            assert!(retained_counts(s).is_err(), "{s}");
        }
        let twice = retained_counts("1m,1000000").unwrap_err();
        assert!(twice.contains("1000000 is given twice"), "{twice}");
        let alone = parse(&["--retained-only"]).unwrap();
        assert!(check_args(&alone).unwrap_err().contains("needs --retained"));
    }

    #[test]
    fn resident_memory_is_read_from_a_proc_status_text() {
        let status = "Name:\tdtx-dev\nUmask:\t0022\nState:\tS (sleeping)\nVmPeak:\t 2170848 kB\n\
                      VmSize:\t 2105312 kB\nVmHWM:\t  160224 kB\nVmRSS:\t  151432 kB\nRssAnon:\t  120000 kB\n\
                      Threads:\t12\n";
        assert_eq!(vm_rss_bytes(status), Some(151_432 * 1024));
        assert_eq!(vm_rss_bytes("VmRSS: 7 mB\n"), Some(7 * 1024 * 1024));
        // A kernel thread has no VmRSS line; a garbled one is no answer.
        assert_eq!(vm_rss_bytes("Name:\tkthreadd\nState:\tS (sleeping)\n"), None);
        assert_eq!(vm_rss_bytes("VmRSS:\t lots kB\n"), None);
        assert_eq!(vm_rss_bytes("VmRSS:\t 12 parsecs\n"), None);
        // This process has one.
        assert!(rss_of(std::process::id()).is_some_and(|b| b > 0));
    }

    #[test]
    fn memory_per_retained_transaction_is_the_mean_growth_over_n() {
        assert_eq!(mean(&[Some(100), None, Some(300)]), Some(200.0));
        assert_eq!(mean(&[None, None]), None);
        // 3 nodes at 50 MB with none, 250 MB with 1M: 200 MiB / 1M.
        let zero = mean(&[Some(50 << 20); 3]);
        let million = mean(&[Some(240 << 20), Some(250 << 20), Some(260 << 20)]);
        let b = bytes_per_txn(million, zero, 1_000_000).unwrap();
        assert!((b - 209.715_2).abs() < 1e-6, "{b}");
        assert_eq!(bytes_per_txn(zero, zero, 0), None);
        assert_eq!(bytes_per_txn(None, zero, 10), None);
        // Less memory than at 0 is reported as it is (negative), not hidden.
        assert_eq!(bytes_per_txn(Some(90.0), Some(100.0), 10), Some(-1.0));
    }

    #[test]
    fn disk_bytes_counts_every_file_below_the_directory() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("a/b")).unwrap();
        std::fs::write(d.path().join("a/b/f"), vec![1u8; 10_000]).unwrap();
        std::fs::write(d.path().join("g"), vec![1u8; 5_000]).unwrap();
        let b = disk_bytes(d.path());
        assert!(b >= 15_000, "{b}");
        assert_eq!(disk_bytes(&d.path().join("missing")), 0);
    }

    fn phase(per_sec: f64, leader_change: Option<&str>) -> Phase {
        Phase {
            stats: crate::report::Stats {
                ops: per_sec as usize,
                per_sec,
                p50_us: 12_000,
                p99_us: 40_000,
            },
            unknown: 0,
            errors: 0,
            first_error: None,
            cpu_us_per_op: None,
            leader_change: leader_change.map(String::from),
            leader_work: None,
        }
    }

    fn row(n: u64, rss_mb: u64, per_sec: f64, restart_s: Option<f64>) -> Row {
        Row {
            retained: n,
            loaded: n,
            load_seconds: 10.0,
            load_failed: 0,
            load_first_error: None,
            transactions: vec![Some(n); 3],
            undelivered: vec![Some(0); 3],
            rss_bytes: vec![Some(rss_mb << 20); 3],
            disk_bytes: vec![3 << 20; 3],
            decide: phase(per_sec, None),
            snapshot: SnapshotRead {
                node: 1,
                build_seconds: Some(1.5),
                bytes: Some(20 << 20),
                wall_seconds: Some(1.7),
                transactions: Some(n + 30_000),
                error: None,
            },
            restart: Some(Restart {
                node: 2,
                seconds: restart_s,
                rss_bytes: Some(rss_mb << 20),
            }),
            catch_up: Some(CatchUp {
                node: 2,
                seconds: Some(2.5),
                by: CatchUpBy::Snapshot,
                index_at_kill: 100,
                leader_applied: 900,
                leader_purged: 500,
                decides_while_down: 40_000,
                load_seconds_while_down: 10.0,
                install_seconds: Some(0.8),
            }),
            notes: Vec::new(),
        }
    }

    fn report(rows: Vec<Row>) -> Report {
        Report {
            clients: CLIENTS,
            seconds: 5,
            rounds: 3,
            retention_ms: RETENTION_MS,
            rows,
        }
    }

    #[test]
    fn the_goal_lines_read_the_largest_n_against_the_zero_row() {
        // 1M: +100 MiB = 104.9 B each; 5M: +500 MiB = 104.9 B each.
        let r = report(vec![
            row(0, 50, 10_000.0, Some(0.5)),
            row(1_000_000, 150, 9_800.0, Some(1.2)),
            row(5_000_000, 550, 9_500.0, Some(2.9)),
        ]);
        assert_eq!(
            goal_lines(&r),
            [
                "goal 1 memory: <= 200 B per retained transaction: MET (105 B at 5000000 retained)",
                "goal 2 restart: <= 3 s with 5M retained: MET (2.90 s at 5000000 retained)",
                "goal 3 throughput flat: Decide/s at 256 with the largest N within 10% of N=0: MET (0.95 at \
                 5000000 retained: 9500/s vs 10000/s)",
            ]
        );
        let r = report(vec![
            row(0, 50, 10_000.0, Some(0.5)),
            row(5_000_000, 2050, 8_000.0, Some(7.25)),
        ]);
        let g = goal_lines(&r);
        assert!(g[0].ends_with("MISSED (419 B at 5000000 retained)"), "{}", g[0]);
        assert!(g[1].ends_with("MISSED (7.25 s at 5000000 retained)"), "{}", g[1]);
        assert!(g[2].contains("MISSED (0.80 at 5000000 retained"), "{}", g[2]);
        let mut slow = row(5_000_000, 60, 9_999.0, None);
        slow.decide = phase(
            9_999.0,
            Some("leader changed during the phase: term 2 -> 3, leader 1 -> 2"),
        );
        let g = goal_lines(&report(vec![row(0, 50, 10_000.0, None), slow]));
        assert!(
            g[1].ends_with("MISSED (not serving within 600 s, at 5000000 retained)"),
            "{}",
            g[1]
        );
        assert!(g[2].contains("not judged (a leader change"), "{}", g[2]);
    }

    #[test]
    fn without_a_zero_row_or_a_5m_row_the_goals_say_not_measured() {
        let g = goal_lines(&report(vec![row(50_000, 60, 9_000.0, Some(0.4))]));
        assert!(g[0]
            .ends_with("not measured (needs a 0 row and a larger N, with every node's memory read, in the same run)"));
        assert!(
            g[1].ends_with("not measured (no row with 5000000 or more retained; largest 50000)"),
            "{}",
            g[1]
        );
        assert!(
            g[2].ends_with("not measured (needs a 0 row and a larger N in the same run)"),
            "{}",
            g[2]
        );
        let g = goal_lines(&report(vec![row(0, 50, 9_000.0, Some(0.4))]));
        assert!(g.iter().all(|l| l.contains("not measured")), "{g:?}");
    }

    #[test]
    fn the_table_has_one_row_per_n_with_the_derived_figures() {
        let r = report(vec![
            row(0, 50, 10_000.0, Some(0.5)),
            row(1_000_000, 150, 9_000.0, Some(1.25)),
        ]);
        let t = results_text(&r);
        assert!(
            t.contains(
                "| 0 | 50 / 50 / 50 | n/a | 3 / 3 / 3 | 10000 | 1.00 | 12.00 ms | 40.00 ms | 1.50 s | 20 | 0.50 s | 50 \
                 | 2.50 s (snapshot) |"
            ),
            "{t}"
        );
        assert!(
            t.contains("| 1000000 | 150 / 150 / 150 | 105 | 3 / 3 / 3 | 9000 | 0.90 | 12.00 ms | 40.00 ms |"),
            "{t}"
        );
        assert!(
            t.contains("- N=1000000: loaded 1000000 in 10.0 s (100000/s, 0 failed)"),
            "{t}"
        );
        assert!(
            t.contains("(check OK); snapshot on node 1 (1030000 transactions then) seen built 1.70 s"),
            "{t}"
        );
        assert!(
            t.contains("caught up by snapshot in 2.50 s (its snapshot install 0.80 s)"),
            "{t}"
        );
        assert!(t.contains("goal 3 throughput flat:"), "{t}");
        let v = json(&r);
        assert_eq!(
            v["rows"][1]["bytes_per_retained_txn"].as_f64().map(|b| b.round()),
            Some(105.0)
        );
        assert_eq!(v["rows"][1]["decide_over_zero"], serde_json::json!(0.9));
        assert_eq!(v["rows"][0]["catch_up"]["by"], "snapshot");
    }

    #[test]
    fn a_gauge_absent_or_zero_is_not_available() {
        let mut r = row(10, 50, 1.0, None);
        r.snapshot.build_seconds = positive(Some(&HashMap::new()), "dtx_snapshot_last_build_seconds");
        let zero: HashMap<String, f64> = [("dtx_snapshot_last_bytes".to_string(), 0.0)].into();
        r.snapshot.bytes = positive(Some(&zero), "dtx_snapshot_last_bytes").map(|b| b as u64);
        let t = results_text(&report(vec![r]));
        assert!(t.contains("| n/a | n/a | n/a |"), "{t}");
    }

    #[test]
    fn the_load_check_wants_about_n_records_on_every_node_and_none_undelivered() {
        let mut r = row(1_000_000, 1, 1.0, None);
        assert!(r.load_checked());
        r.transactions[1] = Some(995_000);
        assert!(r.load_checked(), "within 1 %");
        r.transactions[1] = Some(900_000);
        assert!(!r.load_checked());
        r.transactions[1] = Some(1_000_000);
        r.undelivered[2] = Some(3);
        assert!(!r.load_checked());
        r.undelivered[2] = None;
        assert!(!r.load_checked(), "a node not read is not checked");
        let mut z = row(0, 1, 1.0, None);
        z.transactions = vec![Some(40); 3];
        assert!(z.load_checked(), "slack of 100 records at small N");
    }
}
