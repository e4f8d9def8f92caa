//! `dtx-dev bench --postgres`: two-participant transfers between two banks on
//! PostgreSQL (`bank-serve --postgres`, one database each on one local
//! server), beside the same two UPDATEs run by `pgbench` on the same server,
//! as plain local transactions and as `PREPARE TRANSACTION` /
//! `COMMIT PREPARED` pairs, at the same client counts, in the same run.
//!
//! Our transfers are measured by the bench's transfer phase
//! ([`crate::closed_loop::measure_transfers`]); pgbench runs as a child process
//! (`-n -M simple -c C -j min(C,2) -T seconds`) with two custom scripts,
//! and its `tps` and `latency average` lines are parsed. Without the
//! PostgreSQL binaries (or `pgbench`) the part is skipped, said loudly.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

use anyhow::Context;
use dtx_pg_server::PgServer;
use dtx_pg_server::PgServerOptions;

use crate::cpu::CpuMeter;
use crate::report::ms;
use crate::report::TransferPoint;
use crate::verify::Check;
use dtx_testkit::cluster::BankProcess;

/// Accounts per bank (as in the sled transfer phase).
pub const ACCOUNTS: usize = 10_000;
/// Every account's initial balance: a transfer moves at most 50, so no
/// debit ever fails for lack of money.
pub const INITIAL: i64 = 1_000_000_000;

/// The database pgbench runs against: both banks' accounts in one table.
const PGBENCH_DB: &str = "pgbench_xfer";

/// pgbench script (a): the debit and the credit in one local transaction.
pub const SCRIPT_PLAIN: &str = "\\set fa random(0, 9999)
\\set ta random(0, 9999)
\\set amount random(1, 50)
BEGIN;
UPDATE accounts SET balance = balance - :amount WHERE name = 'a' || :fa;
UPDATE accounts SET balance = balance + :amount WHERE name = 'b' || :ta;
COMMIT;
";

/// pgbench script (b): the same two UPDATEs, then PREPARE TRANSACTION and
/// COMMIT PREPARED under a gid made of the client id and a random number
/// (pgbench substitutes variables in the text of a simple-protocol query,
/// inside quotes too; each client prepares one transaction at a time, so
/// the client id alone already makes the gid unique among the prepared).
pub const SCRIPT_PREPARED: &str = "\\set fa random(0, 9999)
\\set ta random(0, 9999)
\\set amount random(1, 50)
\\set r random(1, 1000000000000)
BEGIN;
UPDATE accounts SET balance = balance - :amount WHERE name = 'a' || :fa;
UPDATE accounts SET balance = balance + :amount WHERE name = 'b' || :ta;
PREPARE TRANSACTION 'pgb-:client_id-:r';
COMMIT PREPARED 'pgb-:client_id-:r';
";

/// One pgbench run's figures.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PgbenchRun {
    pub tps: f64,
    pub latency_avg_ms: f64,
    pub transactions: u64,
    pub failed: u64,
    /// WAL flushes (pg_stat_wal.wal_sync) during the run, server-wide.
    pub wal_syncs: Option<i64>,
    /// CPU time of the whole machine during the run (all processes).
    pub machine_cpu_us: Option<u64>,
}

/// One client count's row.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PgRow {
    pub clients: usize,
    /// Our transfers through the two PostgreSQL banks.
    pub ours: TransferPoint,
    /// Our committed transfers per second.
    pub ours_committed_per_sec: f64,
    /// WAL flushes (pg_stat_wal.wal_sync, server-wide) from the start of
    /// our measured phase to 2.5 s after it (phase two of the last
    /// transfers included).
    pub ours_wal_syncs: Option<i64>,
    /// CPU time of the whole machine (every process, PostgreSQL's
    /// included) during our measured phase and the 500 ms after it.
    pub ours_machine_cpu_us: Option<u64>,
    /// pgbench, script (a); `Err` says why it has no figures.
    pub plain: Result<PgbenchRun, String>,
    /// pgbench, script (b).
    pub prepared: Result<PgbenchRun, String>,
}

impl PgRow {
    /// Our committed transfers/s ÷ pgbench's prepared tps.
    pub fn ratio(&self) -> Option<f64> {
        match &self.prepared {
            Ok(p) if p.tps > 0.0 => Some(self.ours_committed_per_sec / p.tps),
            _ => None,
        }
    }
}

/// What the PostgreSQL part measured, or why it was skipped.
#[derive(Debug, Clone, serde::Serialize)]
pub enum PgReport {
    Skipped(String),
    Measured {
        server_version: String,
        pgbench: String,
        rows: Vec<PgRow>,
    },
}

pub const SKIP_BANNER: &str = "\
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
!!! PostgreSQL part SKIPPED (--postgres): nothing of it was          !!!
!!! measured in this run; the reason follows.                        !!!
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!";

/// Where the run's PostgreSQL phase gets its cluster.
pub(crate) struct Env<'a> {
    pub bin: &'a Path,
    pub dir: &'a Path,
    pub api: Vec<String>,
    pub node_pids: Vec<u32>,
    pub counts: &'a [usize],
    pub warmup: Duration,
    pub measured: Duration,
    pub fsync_per_sec: f64,
}

/// The whole PostgreSQL part; its correctness checks go to `checks`.
pub(crate) async fn run(env: Env<'_>, checks: &mut Vec<Check>) -> anyhow::Result<PgReport> {
    let bin_dir = match dtx_pg_server::find_binaries() {
        Ok(d) => d,
        Err(e) => return Ok(skipped(format!("{e}"))),
    };
    // The bin dir found may hold links (e.g. /usr/local/bin/postgres ->
    // /usr/lib/postgresql/15/bin/postgres): pgbench comes from the
    // directory the server binary really is in.
    let real_dir = std::fs::canonicalize(bin_dir.join("postgres"))
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| bin_dir.clone());
    let pgbench = [real_dir.join("pgbench"), bin_dir.join("pgbench")]
        .into_iter()
        .find(|p| p.is_file())
        .unwrap_or_else(|| real_dir.join("pgbench"));
    println!(
        "PostgreSQL binaries: {} (server in {}); pgbench: {}",
        bin_dir.display(),
        real_dir.display(),
        pgbench.display()
    );
    if !pgbench.is_file() {
        return Ok(skipped(format!(
            "no pgbench in {} (nor in {}) (Debian/Ubuntu: `apt-get install postgresql-contrib` or `postgresql`)",
            real_dir.display(),
            bin_dir.display()
        )));
    }
    let max_clients = env.counts.iter().copied().max().unwrap_or(1) as u32;
    println!("starting PostgreSQL from {} ...", bin_dir.display());
    let opts = PgServerOptions {
        max_prepared_transactions: 128.max(max_clients + 64),
        max_connections: 200.max(max_clients + 100),
        ..PgServerOptions::default()
    };
    let server = tokio::task::spawn_blocking(move || PgServer::start(opts))
        .await?
        .map_err(|e| anyhow::anyhow!("cannot start PostgreSQL: {e}"))?;
    let server_version = Command::new(bin_dir.join("postgres"))
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let pgbench_version = Command::new(&pgbench)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    println!(
        "PostgreSQL up ({server_version}) on port {}, log {}",
        server.port(),
        server.log_path().display()
    );
    let pg = |what: &str, r: dtx_pg_server::Result<()>| r.map_err(|e| anyhow::anyhow!("{what}: {e}"));

    // Two banks, one database each; the accounts table created here in
    // one statement (bank-serve's install leaves an existing table alone).
    let mut procs: Vec<BankProcess> = Vec::new();
    let mut bank_list = Vec::new();
    let mut dbs = Vec::new();
    for (id, prefix) in [("pg-bank-a", "a"), ("pg-bank-b", "b")] {
        let db = format!("bench_{prefix}");
        pg("create database", server.create_database(&db))?;
        pg("create accounts", server.execute(&db, &accounts_sql(&[prefix])))?;
        let port = dtx_testkit::cluster::free_port("127.0.0.1")?;
        let mut s = BankProcess::build(
            env.bin,
            env.dir,
            id,
            prefix,
            "127.0.0.1",
            port,
            env.api.clone(),
            ACCOUNTS,
            INITIAL,
            Some(server.conn_string(&db)),
        );
        s.start(&[])?;
        s.wait_started().await?;
        bank_list.push((id.to_string(), s.addr.clone(), prefix.to_string()));
        dbs.push(dtx_bank::connect_pg(&server.conn_string(&db)).await?);
        procs.push(s);
    }
    println!("PostgreSQL banks up: {bank_list:?}");
    let meter = CpuMeter::new(
        env.node_pids
            .iter()
            .copied()
            .chain(procs.iter().filter_map(|p| p.pid()))
            .collect(),
    );
    // pg_stat_wal.wal_sync (WAL flushes, server-wide) around each measured
    // phase, read 2.5 s after it (the pooled backends report their
    // statistics when idle, at most once a second).
    let stats_db = dtx_bank::connect_pg(&server.conn_string("postgres")).await?;
    let bank_list = Arc::new(crate::closed_loop::Shape::Enlisted(bank_list));
    let watch = crate::leader_watch::LeaderWatch::new(env.api.clone(), None);
    let mut ours = Vec::new();
    let mut ours_syncs = Vec::new();
    for &n in env.counts {
        if !env.warmup.is_zero() {
            crate::closed_loop::measure_transfers(
                &watch,
                None,
                bank_list.clone(),
                &meter,
                &[n],
                Duration::ZERO,
                env.warmup,
                1,
                env.fsync_per_sec,
                "PostgreSQL warm-up (not measured)",
                "pgwarm",
            )
            .await;
        }
        let before = wal_syncs(&stats_db).await;
        let busy_before = machine_busy();
        let mut tp = crate::closed_loop::measure_transfers(
            &watch,
            None,
            bank_list.clone(),
            &meter,
            &[n],
            Duration::ZERO,
            env.measured,
            1,
            env.fsync_per_sec,
            "PostgreSQL transfers",
            "pgxfer",
        )
        .await;
        let busy = busy_delta(busy_before, machine_busy());
        tokio::time::sleep(Duration::from_secs(2)).await;
        let after = wal_syncs(&stats_db).await;
        ours_syncs.push((before.zip(after).map(|(b, a)| a - b), busy));
        ours.append(&mut tp);
    }

    // Checks: once phase two is done nothing is left prepared, and the
    // money is all there.
    let until = Instant::now() + Duration::from_secs(30);
    let left = loop {
        let r = dbs[0]
            .query_one("SELECT count(*) FROM pg_prepared_xacts", &[])
            .await
            .context("counting prepared transactions")?;
        let left: i64 = r.get(0);
        if left == 0 || Instant::now() >= until {
            break left;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    checks.push(one_check(
        "PostgreSQL banks: no prepared transaction left 30 s after the last transfer",
        left == 0,
        format!("{left} prepared transactions left"),
    ));
    let mut total = 0i64;
    let mut rows = 0i64;
    for db in &dbs {
        let (sum, n) = dtx_bank::pg::audit(db).await.context("auditing a bank")?;
        total += sum;
        rows += n;
    }
    let expected = 2 * ACCOUNTS as i64 * INITIAL;
    checks.push(one_check(
        "PostgreSQL banks: total of balances unchanged",
        total == expected && rows == 2 * ACCOUNTS as i64,
        format!(
            "total {total} over {rows} accounts, expected {expected} over {}",
            2 * ACCOUNTS
        ),
    ));
    for c in &checks[checks.len() - 2..] {
        println!("  {}", c.summary());
    }
    drop(dbs);
    for mut p in procs {
        p.stop(Duration::from_secs(5));
    }

    // pgbench, on one database holding both banks' accounts.
    pg("create database", server.create_database(PGBENCH_DB))?;
    pg(
        "create accounts",
        server.execute(PGBENCH_DB, &accounts_sql(&["a", "b"])),
    )?;
    pg("vacuum", server.execute(PGBENCH_DB, "VACUUM ANALYZE accounts"))?;
    let scripts = env.dir.join("pgbench");
    std::fs::create_dir_all(&scripts)?;
    let plain_path = scripts.join("plain.sql");
    let prepared_path = scripts.join("prepared.sql");
    std::fs::write(&plain_path, SCRIPT_PLAIN)?;
    std::fs::write(&prepared_path, SCRIPT_PREPARED)?;
    let mut out = Vec::new();
    for (tp, (syncs, busy)) in ours.into_iter().zip(ours_syncs) {
        let n = tp.clients;
        let mut results = Vec::new();
        for (name, script) in [("plain", &plain_path), ("prepared", &prepared_path)] {
            let port = server.port();
            let run = |secs: u64| {
                let (pgbench, script) = (pgbench.clone(), script.clone());
                tokio::task::spawn_blocking(move || pgbench_run(&pgbench, port, &script, n, secs))
            };
            if env.warmup.as_secs() > 0 {
                let _ = run(env.warmup.as_secs()).await;
            }
            let before = wal_syncs(&stats_db).await;
            let busy_before = machine_busy();
            let mut r = run(env.measured.as_secs().max(1))
                .await
                .unwrap_or_else(|e| Err(format!("pgbench thread: {e}")));
            tokio::time::sleep(Duration::from_millis(500)).await;
            let after = wal_syncs(&stats_db).await;
            let busy = busy_delta(busy_before, machine_busy());
            if let Ok(p) = &mut r {
                p.wal_syncs = before.zip(after).map(|(b, a)| a - b);
                p.machine_cpu_us = busy.map(|d| d.as_micros() as u64);
            }
            match &r {
                Ok(p) => println!(
                    "pgbench {name:>8}, clients {n:>3}: {:>7.0} tps, latency average {:.3} ms ({} transactions, {} failed)",
                    p.tps, p.latency_avg_ms, p.transactions, p.failed
                ),
                Err(e) => println!("pgbench {name:>8}, clients {n:>3}: FAILED: {e}"),
            }
            results.push(r);
        }
        let prepared = results.pop().expect("two runs");
        let plain = results.pop().expect("two runs");
        let committed = tp.stats.ops.saturating_sub(tp.aborted as usize) as f64;
        let ours_committed_per_sec = if tp.stats.ops > 0 {
            tp.stats.per_sec * committed / tp.stats.ops as f64
        } else {
            0.0
        };
        out.push(PgRow {
            clients: n,
            ours: tp,
            ours_committed_per_sec,
            ours_wal_syncs: syncs,
            ours_machine_cpu_us: busy.map(|d| d.as_micros() as u64),
            plain,
            prepared,
        });
    }
    // pgbench's own prepared transactions are all committed too.
    let left_after_pgbench = server
        .execute(PGBENCH_DB, "DO $$ BEGIN IF (SELECT count(*) FROM pg_prepared_xacts) > 0 THEN RAISE EXCEPTION 'prepared transactions left'; END IF; END $$")
        .is_err();
    if left_after_pgbench {
        println!("WARNING: pgbench left prepared transactions behind");
    }
    drop(server);
    Ok(PgReport::Measured {
        server_version,
        pgbench: pgbench_version,
        rows: out,
    })
}

fn skipped(reason: String) -> PgReport {
    println!("{SKIP_BANNER}\n{reason}");
    PgReport::Skipped(reason)
}

fn one_check(name: &str, passed: bool, violation: String) -> Check {
    Check {
        name: name.to_string(),
        checked: 1,
        ok: passed as u64,
        unknown: 0,
        violations: (!passed) as u64,
        examples: if passed { vec![] } else { vec![violation] },
    }
}

/// The accounts table (the bank's schema) with `ACCOUNTS` accounts of
/// `INITIAL` for each prefix.
fn accounts_sql(prefixes: &[&str]) -> String {
    let mut s = format!("{};\n", dtx_bank::pg::SCHEMA);
    for p in prefixes {
        s.push_str(&format!(
            "INSERT INTO accounts (name, balance) SELECT '{p}' || g, {INITIAL} FROM generate_series(0, {}) g;\n",
            ACCOUNTS - 1
        ));
    }
    s
}

/// One pgbench run of `script` at `clients` clients for `secs` seconds.
fn pgbench_run(pgbench: &Path, port: u16, script: &Path, clients: usize, secs: u64) -> Result<PgbenchRun, String> {
    let out = Command::new(pgbench)
        .args(["-n", "-M", "simple", "-h", "127.0.0.1", "-U", dtx_pg_server::SUPERUSER])
        .arg("-p")
        .arg(port.to_string())
        .arg("-c")
        .arg(clients.to_string())
        .arg("-j")
        .arg(clients.clamp(1, 2).to_string())
        .arg("-T")
        .arg(secs.to_string())
        .arg("-f")
        .arg(script)
        .arg(PGBENCH_DB)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", pgbench.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(format!(
            "pgbench exited with {}: {}",
            out.status,
            stderr.lines().take(5).collect::<Vec<_>>().join(" | ")
        ));
    }
    parse_pgbench(&stdout).ok_or_else(|| format!("cannot parse pgbench's output: {stdout}"))
}

/// tps, latency average, transactions and failures from pgbench's report.
pub fn parse_pgbench(out: &str) -> Option<PgbenchRun> {
    let mut tps = None;
    let mut lat = None;
    let mut transactions = None;
    let mut failed = 0;
    let first_number = |s: &str| -> Option<f64> {
        s.split_whitespace()
            .next()
            .and_then(|w| w.trim_end_matches(|c: char| !c.is_ascii_digit()).parse().ok())
    };
    for line in out.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("tps = ") {
            // "tps = 1234.5 (without initial connection time)"; older
            // versions print two lines, the second "excluding connections".
            if tps.is_none() || line.contains("without") || line.contains("excluding") {
                tps = first_number(rest);
            }
        } else if let Some(rest) = line.strip_prefix("latency average = ") {
            lat = first_number(rest);
        } else if let Some(rest) = line.strip_prefix("number of transactions actually processed: ") {
            transactions = first_number(rest.split('/').next().unwrap_or(rest)).map(|v| v as u64);
        } else if let Some(rest) = line.strip_prefix("number of failed transactions: ") {
            failed = first_number(rest).map(|v| v as u64).unwrap_or(0);
        }
    }
    Some(PgbenchRun {
        tps: tps?,
        latency_avg_ms: lat?,
        transactions: transactions?,
        failed,
        wal_syncs: None,
        machine_cpu_us: None,
    })
}

/// CPU time spent by the whole machine so far (every core, every
/// process: user, nice, system, irq, softirq, steal from /proc/stat).
fn machine_busy() -> Option<Duration> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    let line = text.lines().next()?.strip_prefix("cpu ")?;
    let f: Vec<u64> = line.split_whitespace().filter_map(|v| v.parse().ok()).collect();
    if f.len() < 8 {
        return None;
    }
    let busy = f[0] + f[1] + f[2] + f[5] + f[6] + f[7];
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| Duration::from_micros(busy * 1_000_000 / hz as u64))
}

/// `after - before`, if both were read.
fn busy_delta(before: Option<Duration>, after: Option<Duration>) -> Option<Duration> {
    before.zip(after).map(|(b, a)| a.saturating_sub(b))
}

/// The server's WAL flushes so far (`pg_stat_wal.wal_sync`), if readable.
async fn wal_syncs(db: &tokio_postgres::Client) -> Option<i64> {
    db.query_one("SELECT wal_sync FROM pg_stat_wal", &[])
        .await
        .ok()
        .map(|r| r.get(0))
}

/// The section of results.txt.
pub fn results_text(r: &PgReport) -> String {
    let mut t = String::new();
    match r {
        PgReport::Skipped(reason) => {
            t.push_str(SKIP_BANNER);
            t.push_str(&format!("\n{reason}\n"));
        }
        PgReport::Measured {
            server_version,
            pgbench,
            rows,
        } => {
            t.push_str(&format!(
                "PostgreSQL participants beside pgbench ({server_version}, {pgbench}; one server, fsync on; \
                 ours: two bank-serve --postgres of {ACCOUNTS} accounts each, closed-loop transfers, rate = committed \
                 transfers/s; pgbench: -n -M simple -j min(C,2), the same two UPDATEs on one database, tps (latency \
                 average))\n\n"
            ));
            t.push_str(
                "| clients | our PG transfers/s | p50 | p99 | aborted | pgbench plain tps | pgbench prepared tps | ours ÷ prepared |\n",
            );
            t.push_str("|---:|---:|---:|---:|---:|---:|---:|---:|\n");
            let cell = |r: &Result<PgbenchRun, String>| match r {
                Ok(p) => format!("{:.0} ({:.2} ms)", p.tps, p.latency_avg_ms),
                Err(_) => "FAILED".to_string(),
            };
            for row in rows {
                t.push_str(&format!(
                    "| {} | {:.0} | {} | {} | {} | {} | {} | {} |\n",
                    row.clients,
                    row.ours_committed_per_sec,
                    ms(row.ours.stats.p50_us),
                    ms(row.ours.stats.p99_us),
                    row.ours.aborted,
                    cell(&row.plain),
                    cell(&row.prepared),
                    row.ratio().map(|r| format!("{r:.2}")).unwrap_or_else(|| "–".into())
                ));
            }
            t.push_str(
                "\nper committed transaction: WAL flushes (pg_stat_wal.wal_sync, server-wide, group commit \
                 included; ours: phase two of the last transfers included) and CPU time of the whole machine \
                 (every process: nodes, banks, PostgreSQL, pgbench, the bench client):\n\n\
                 | clients | ours: WAL flushes | pgbench plain: WAL flushes | pgbench prepared: WAL flushes \
                 | ours: machine CPU | pgbench plain: machine CPU | pgbench prepared: machine CPU |\n",
            );
            t.push_str("|---:|---:|---:|---:|---:|---:|---:|\n");
            let per = |syncs: Option<i64>, n: u64| match syncs {
                Some(s) if n > 0 => format!("{:.2} ({s} for {n})", s as f64 / n as f64),
                _ => "–".to_string(),
            };
            let cpu = |us: Option<u64>, n: u64| match us {
                Some(us) if n > 0 => ms(us / n),
                _ => "–".to_string(),
            };
            for row in rows {
                let committed = (row.ours.stats.ops as u64).saturating_sub(row.ours.aborted);
                let pgb = |r: &Result<PgbenchRun, String>| match r {
                    Ok(p) => (per(p.wal_syncs, p.transactions), cpu(p.machine_cpu_us, p.transactions)),
                    Err(_) => ("–".to_string(), "–".to_string()),
                };
                let (plain_w, plain_c) = pgb(&row.plain);
                let (prep_w, prep_c) = pgb(&row.prepared);
                t.push_str(&format!(
                    "| {} | {} | {plain_w} | {prep_w} | {} | {plain_c} | {prep_c} |\n",
                    row.clients,
                    per(row.ours_wal_syncs, committed),
                    cpu(row.ours_machine_cpu_us, committed),
                ));
            }
            t.push('\n');
            for row in rows {
                for (name, r) in [("plain", &row.plain), ("prepared", &row.prepared)] {
                    if let Err(e) = r {
                        t.push_str(&format!("pgbench {name} at {} clients FAILED: {e}\n", row.clients));
                    }
                }
                if row.ours.unknown > 0 {
                    t.push_str(&format!(
                        "ours at {} clients: {} UNKNOWN outcomes (not counted)\n",
                        row.clients, row.ours.unknown
                    ));
                }
            }
            t.push_str(&goal_line(rows));
            t.push('\n');
        }
    }
    t
}

/// The goal against pgbench (docs/benchmarks.md), in one line.
pub fn goal_line(rows: &[PgRow]) -> String {
    match rows.iter().find(|r| r.clients == 16) {
        None => "goal check: at 16 clients ours ≥ 0.5 × pgbench prepared: not measured (16 is not among \
                 the transfer client counts)"
            .to_string(),
        Some(row) => match (&row.prepared, row.ratio()) {
            (Ok(p), Some(r)) => format!(
                "goal check: at 16 clients ours ≥ 0.5 × pgbench prepared: {:.0} vs {:.0} = {:.2}: {}",
                row.ours_committed_per_sec,
                p.tps,
                r,
                if r >= 0.5 { "met" } else { "NOT met" }
            ),
            _ => "goal check: at 16 clients ours ≥ 0.5 × pgbench prepared: not measured (pgbench failed)".to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_pgbench_15_output() {
        let out = "transaction type: plain.sql
scaling factor: 1
query mode: simple
number of clients: 16
number of threads: 2
maximum number of tries: 1
duration: 5 s
number of transactions actually processed: 12345
number of failed transactions: 0 (0.000%)
latency average = 6.480 ms
initial connection time = 21.345 ms
tps = 2469.155000 (without initial connection time)
";
        let r = parse_pgbench(out).unwrap();
        assert_eq!(r.transactions, 12345);
        assert_eq!(r.failed, 0);
        assert!((r.tps - 2469.155).abs() < 1e-6);
        assert!((r.latency_avg_ms - 6.48).abs() < 1e-9);
        assert!(parse_pgbench("pgbench: error: connection refused").is_none());
    }

    #[test]
    fn scripts_quote_the_gid_with_variables() {
        assert!(SCRIPT_PREPARED.contains("PREPARE TRANSACTION 'pgb-:client_id-:r';"));
        assert!(SCRIPT_PREPARED.contains("COMMIT PREPARED 'pgb-:client_id-:r';"));
        assert!(accounts_sql(&["a", "b"]).contains("SELECT 'b' || g, 1000000000 FROM generate_series(0, 9999)"));
    }
}
