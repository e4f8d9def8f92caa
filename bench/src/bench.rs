//! `dtx-dev bench`: Begin and Decide throughput and latency on a local
//! three-node cluster of real node processes (fsync on), at several client
//! counts, next to this disk's fsync rate measured by the same binary in the
//! same run, so the ratio means something on any machine; end-to-end
//! two-participant transfers; and, in the same run, the same closed-loop
//! write-once workload against a local three-member etcd cluster
//! ([`crate::etcd`]), with the correctness checks of [`crate::verify`] and
//! the comparison of [`crate::report`] (table, results.json, SVG plots in a
//! results folder).
//!
//! Run it from a release build: `cargo run --release -- bench`
//! (`scripts/bench`).

use std::collections::HashMap;
use std::path::Path;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::Context;

use crate::args::apply_node_overrides;
use crate::args::overrides;
pub use crate::args::value_for;
pub use crate::args::BenchArgs;
pub use crate::args::VALUE_BYTES;
use crate::closed_loop::clients_for;
use crate::closed_loop::measure_transfers;
use crate::closed_loop::run_phase;
use crate::closed_loop::Step;
use crate::closed_loop::CALL_TIMEOUT;
use crate::cpu::CpuMeter;
pub use crate::disk::measure_fsync;
use crate::etcd::EtcdCluster;
use crate::etcd::EtcdKv;
use crate::etcd::PutIfAbsent;
use crate::leader_watch;
use crate::leader_watch::LeaderWatch;
use crate::report::median_phase;
pub use crate::report::stats;
use crate::report::Phase;
pub use crate::report::Stats;
use crate::report::Summary;
use crate::report::TransferPoint;
use crate::verify::AckedPut;
use crate::verify::Check;
use dtx_client::Client;
use dtx_client::ClientError;
use dtx_client::DecisionRead;
use dtx_client::TxOutcome;
use dtx_testkit::cluster::ProcessCluster;

/// Every key the bench writes to etcd starts with this.
pub const ETCD_PREFIX: &str = "dtxbench/";

/// `n` etcd clients, each with its own connection to the leader.
fn etcd_clients_for(leader: &str, n: usize) -> anyhow::Result<Vec<EtcdKv>> {
    (0..n).map(|_| EtcdKv::new(leader, CALL_TIMEOUT)).collect()
}

/// The phase's line for the console.
fn phase_line(p: &Phase) -> String {
    let mut s = format!(
        "{:>8.0}/s p50 {:>6} us p99 {:>6} us",
        p.stats.per_sec, p.stats.p50_us, p.stats.p99_us
    );
    if let Some(c) = p.cpu_us_per_op {
        s.push_str(&format!(", CPU {c} us/op"));
    }
    if p.unknown > 0 || p.errors > 0 {
        s.push_str(&format!(
            " [{} UNKNOWN, {} errors; first: {}]",
            p.unknown,
            p.errors,
            p.first_error.as_deref().unwrap_or("")
        ));
    }
    s
}

/// What the run measured and checked, for the results folder.
struct Outcome {
    started_unix: u64,
    raw: Stats,
    sled_sync: Stats,
    rpc: Stats,
    read: Stats,
    rows: Vec<(usize, Phase, Phase)>,
    etcd_version: Option<String>,
    summary: Summary,
    checks: Vec<Check>,
    /// With `--postgres`: the comparison with pgbench, or why it was skipped.
    postgres: Option<crate::pgbench::PgReport>,
    /// With `--tls`: the transfers over TLS.
    tls: Option<Vec<TransferPoint>>,
    /// With `--branches`: the transfers in the client's own steps,
    /// coordinator-driven and as branches.
    branches: Option<BranchRows>,
    /// With `--retained`: the cost of retained state (`crate::retained`).
    retained: Option<crate::retained::Report>,
    /// What the machine was when the run started (`crate::machine`).
    machine: crate::machine::Machine,
}

const SKIP_BANNER: &str = "\
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
!!! etcd SKIPPED (--no-etcd): this run has NO etcd comparison; every !!!
!!! goal measured against etcd is \"not measured\".                    !!!
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!";

/// Runs the bench. Ctrl-C stops it, and every process it started, at
/// once: dropping the run drops the clusters, whose `Drop` kills them.
pub async fn run(a: BenchArgs) -> anyhow::Result<()> {
    tokio::select! {
        r = run_inner(a) => r,
        _ = tokio::signal::ctrl_c() => {
            anyhow::bail!("interrupted: the bench stopped its nodes, banks and etcd members")
        }
    }
}

async fn run_inner(a: BenchArgs) -> anyhow::Result<()> {
    let started_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let out_dir = a
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("target/bench-results/{started_unix}")));
    crate::args::check_args(&a).map_err(anyhow::Error::msg)?;
    if a.retained_only {
        return crate::retained::run_only(&a, &out_dir, started_unix).await;
    }
    // Before anything runs: no etcd binary fails the run at once.
    let etcd_bin = if a.no_etcd {
        println!("{SKIP_BANNER}");
        None
    } else {
        let bin = crate::etcd::find_binary(a.etcd_bin.as_deref()).with_context(|| {
            format!(
                "no etcd binary ({}): install Debian's etcd-server (`apt-get install -y etcd-server`; \
                 scripts/bench does it when etcd is missing), pass --etcd-bin, or run with --no-etcd",
                a.etcd_bin
                    .as_ref()
                    .map(|p| format!("{} is not a file", p.display()))
                    .unwrap_or_else(|| "none on PATH".into())
            )
        })?;
        Some(bin)
    };

    let dir = a.dir.clone();
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let dir = dir.canonicalize()?;
    let machine = crate::machine::Machine::read();
    println!("machine: {}", machine.line());
    println!("measuring fsync on {} ({} syncs)...", dir.display(), a.fsyncs);
    let (raw, sled_sync) = measure_fsync(&dir, a.fsyncs)?;
    println!(
        "disk: fdatasync {:.0}/s (p50 {} us); sled insert+flush {:.0}/s (p50 {} us)",
        raw.per_sec, raw.p50_us, sled_sync.per_sec, sled_sync.p50_us
    );

    let bin = std::env::current_exe().context("cannot find the coordinator binary")?;
    let plans = ProcessCluster::plan_local("127.0.0.1", 3)?;
    let mut cluster = ProcessCluster::new(&bin, &dir.join("cluster"), "dtx-bench", plans, |c| {
        // Each node's metrics port: the leader's counters say how many
        // Raft entries a phase took and how long its handler held a call.
        c.metrics_addr = dtx_testkit::cluster::free_port("127.0.0.1")
            .ok()
            .map(|p| format!("127.0.0.1:{p}"));
        apply_node_overrides(&a, c);
    })?;
    cluster.start_all()?;
    let leader = cluster.leader_within(Duration::from_secs(30)).await?;
    let leader_api = cluster.node(leader).plan.api_listen.clone();
    println!("cluster up; leader node {leader} at {leader_api}");
    // The leader is found again before each measured phase and after it:
    // clients start at the leader of the moment, and a phase whose leader
    // changed is marked (and no goal is judged on it).
    let watch = LeaderWatch::new(cluster.api_addrs(), None).with_metrics(
        cluster
            .nodes
            .iter()
            .filter_map(|n| Some((n.plan.id, n.config.metrics_addr.clone()?))),
    );
    let mut last_leader = watch.find().await;

    // etcd: three members on loopback, data on the same disk as our nodes'.
    let mut etcd = None;
    let mut etcd_version = None;
    let mut etcd_leader = String::new();
    if let Some(bin) = &etcd_bin {
        let version = crate::etcd::binary_version(bin)?;
        let mut e = EtcdCluster::plan_local(bin, &dir.join("etcd"), 3)?;
        e.start_all().context("cannot start etcd")?;
        etcd_leader = e.wait_ready(Duration::from_secs(30)).await?;
        println!(
            "etcd up ({version}, {}); leader at {etcd_leader}; data under {}",
            bin.display(),
            e.dir.display()
        );
        etcd_version = Some(version);
        etcd = Some(e);
    }

    // Latency budget at one client: a bare API round trip (no Raft), and a
    // linearizable read (round trip + one heartbeat round to a quorum).
    let one = clients_for(&watch.leader_first(last_leader.as_ref()), 1);
    let two_s = Duration::from_secs(2);
    let ok = |r: bool| if r { Step::Done } else { Step::Error("failed".into()) };
    let rpc = run_phase(&one, two_s, move |c, _, _| async move {
        ok(c.cluster_status().await.is_ok())
    })
    .await
    .stats;
    let read = run_phase(
        &one,
        two_s,
        move |c, _, _| async move { ok(c.decision(1).await.is_ok()) },
    )
    .await
    .stats;
    println!(
        "budget at 1 client: API round trip p50 {} us; linearizable read p50 {} us; fsync p50 {} us",
        rpc.p50_us, read.p50_us, raw.p50_us
    );

    let node_pids: Vec<u32> = cluster.nodes.iter().filter_map(|n| n.pid()).collect();
    let warmup = Duration::from_secs(a.warmup);
    let measured = Duration::from_secs(a.seconds);
    let mut rows = Vec::new();
    let mut etcd_points = Vec::new();
    let mut etcd_acked: Vec<Vec<AckedPut>> = Vec::new();
    let mut checks = Vec::new();
    for &n in &a.clients {
        let (mut begins, mut decides, mut puts) = (Vec::new(), Vec::new(), Vec::new());
        let mut level_acked: Vec<AckedPut> = Vec::new();
        // Rounds alternate the two systems, so that a noisy minute of the
        // machine falls on both; each figure of the level is the median of
        // its rounds (report::median_phase).
        for r in 1..=a.rounds {
            let round = crate::closed_loop::round_label(r, a.rounds);
            // ---- ours ----
            let before = watch.find().await;
            say_if_new_leader("ours", &last_leader, &before);
            let clients = clients_for(&watch.leader_first(before.as_ref()), n);
            for c in &clients {
                let _ = c.cluster_status().await;
            }
            // Warm-up: Begin + Decide pairs, not measured.
            run_phase(&clients, warmup, move |c, w, i| async move {
                match c.begin(&format!("bench-warm-{n}-{r}-{w}-{i}"), 3_600_000, b"").await {
                    Ok(b) => match c.abort(b.txid, "bench").await {
                        Ok(TxOutcome::Aborted) => Step::Done,
                        other => Step::Error(format!("{other:?}")),
                    },
                    Err(e) => Step::Error(e.to_string()),
                }
            })
            .await;
            // Phase 1: Begin (each creates a transaction, kept for phase 2).
            let made: Arc<Vec<Mutex<Vec<u64>>>> = Arc::new((0..n).map(|_| Default::default()).collect());
            let m = made.clone();
            let begin = run_phase(&clients, measured, move |c, w, i| {
                let m = m.clone();
                async move {
                    let key = format!("bench-{n}-{r}-{w}-{i}");
                    let description = value_for(key.as_bytes());
                    match c.begin(&key, 3_600_000, &description).await {
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
            let begin = begin.phase(None, leader_watch::change(before.as_ref(), between.as_ref()));
            // Phase 2: Decide (ABORT, write-once) each of them once.
            let decided: Arc<Vec<Mutex<Vec<u64>>>> = Arc::new((0..n).map(|_| Default::default()).collect());
            let (m, d) = (made.clone(), decided.clone());
            let meter = CpuMeter::new(node_pids.clone());
            let work = watch.work_from(between.as_ref()).await;
            let cpu_before = meter.sample();
            let decide = run_phase(&clients, measured, move |c, w, i| {
                let (m, d) = (m.clone(), d.clone());
                async move {
                    let Some(t) = m[w].lock().expect("lock").get(i).copied() else {
                        return Step::Stop;
                    };
                    match c.abort(t, "bench").await {
                        Ok(TxOutcome::Aborted) => {
                            d[w].lock().expect("lock").push(t);
                            Step::Done
                        }
                        Ok(TxOutcome::Unknown) => Step::Unknown(format!("Decide of txid {t}")),
                        Ok(TxOutcome::Committed) => Step::Error(format!("Abort of fresh txid {t} returned COMMITTED")),
                        Err(e) => Step::Error(e.to_string()),
                    }
                }
            })
            .await;
            let cpu = meter.sample().saturating_sub(cpu_before);
            let leader_work = work.until_now(&watch, between.as_ref(), "Abort").await;
            let after = watch.find().await;
            let mut decide = decide.phase(Some(cpu), leader_watch::change(between.as_ref(), after.as_ref()));
            decide.leader_work = leader_work;
            last_leader = after;
            println!(
                "clients {n:>4}{round}: begin {} | decide {} ({:.1}x fsync rate)",
                phase_line(&begin),
                phase_line(&decide),
                decide.stats.per_sec / raw.per_sec
            );
            if let Some(w) = &decide.leader_work {
                println!("clients {n:>4}{round}: decide: {}", w.line("Abort"));
            }
            for (what, p) in [("begin", &begin), ("decide", &decide)] {
                if let Some(c) = &p.leader_change {
                    println!("clients {n:>4}{round}: {what}: NOT A FAIR MEASURE: {c}");
                }
            }
            // Checks, right away (a decided record is forgotten after
            // txn.retention_ms): every acknowledged Decide reads back, and a
            // conflicting Decide (Commit) returns the first decision.
            let acked: Vec<u64> = decided.iter().flat_map(|v| v.lock().expect("lock").clone()).collect();
            checks.extend(check_our_decides(&one[0], n, &acked, a.recheck).await);
            begins.push(begin);
            decides.push(decide);

            // ---- etcd, same client count ----
            if let Some(e) = &etcd {
                let before = e.leader().await;
                let kvs = etcd_clients_for(before.as_ref().map(|l| l.addr.as_str()).unwrap_or(&etcd_leader), n)?;
                let acked: Arc<Vec<Mutex<Vec<AckedPut>>>> = Arc::new((0..n).map(|_| Default::default()).collect());
                run_phase(
                    &kvs,
                    warmup,
                    put_if_absent_work(format!("n{n}-r{r}-warm"), acked.clone()),
                )
                .await;
                let meter = CpuMeter::new(e.pids());
                let cpu_before = meter.sample();
                let put = run_phase(&kvs, measured, put_if_absent_work(format!("n{n}-r{r}"), acked.clone())).await;
                let cpu = meter.sample().saturating_sub(cpu_before);
                let put = put.phase(
                    Some(cpu),
                    leader_watch::change(before.as_ref(), e.leader().await.as_ref()),
                );
                println!("clients {n:>4}{round}: etcd put-if-absent {}", phase_line(&put));
                if let Some(c) = &put.leader_change {
                    println!("clients {n:>4}{round}: etcd: NOT A FAIR MEASURE: {c}");
                }
                level_acked.extend(acked.iter().flat_map(|v| v.lock().expect("lock").clone()));
                puts.push(put);
            }
        }
        let (begin, decide) = (median_phase(&begins), median_phase(&decides));
        if a.rounds > 1 {
            println!(
                "clients {n:>4}: median of {} rounds: begin {} | decide {}",
                a.rounds,
                phase_line(&begin),
                phase_line(&decide)
            );
        }
        rows.push((n, begin, decide));
        if !puts.is_empty() {
            let put = median_phase(&puts);
            if a.rounds > 1 {
                println!(
                    "clients {n:>4}: median of {} rounds: etcd put-if-absent {}",
                    a.rounds,
                    phase_line(&put)
                );
            }
            etcd_acked.push(level_acked);
            etcd_points.push((n, put));
        }
    }
    // etcd's checks at the end of its runs: every acknowledged put is read
    // back; a sample of them re-issued must be refused.
    // Its data stays until the end of the run: removing it now would load
    // the disk our nodes sync to while their transfers are measured.
    let mut etcd_stopped = None;
    if let Some(mut e) = etcd.take() {
        checks.extend(check_etcd_puts(&etcd_leader, &etcd_acked, a.recheck).await);
        e.stop_members(Duration::from_secs(10));
        println!("etcd stopped (its data is removed at the end of the run)");
        etcd_stopped = Some(e);
    }

    // End-to-end transfers: begin, enlist two bank services, commit (the
    // participants prepare and fsync, the decision goes through Raft, phase
    // two runs in the background). 10,000 accounts per bank keep lock
    // conflicts rare.
    let mut transfer_rows = Vec::new();
    let mut branch_rows = None;
    if !a.transfer_clients.is_empty() {
        let api = cluster.api_addrs();
        // Each bank also serves its own API (for --branches).
        let mut apps = Vec::new();
        let mut banks = Vec::new();
        for (id, prefix) in [("bank-a", "a"), ("bank-b", "b")] {
            let app = format!("127.0.0.1:{}", dtx_testkit::cluster::free_port("127.0.0.1")?);
            banks.push(dtx_testkit::cluster::start_bank_with(
                &bin,
                &dir,
                id,
                prefix,
                &api,
                10_000,
                1_000_000,
                |_| vec!["--app-listen".to_string(), app.clone()],
            )?);
            apps.push((prefix, app));
        }
        for b in &banks {
            b.wait_started().await?;
        }
        // CPU time summed over every process of the run: the three nodes,
        // the two banks and this client.
        let (bank_list, meter) = crate::closed_loop::banks_and_meter(&banks, &cluster.nodes);
        // Every shape on the same cluster, banks, meter and levels.
        let measure = |shape: crate::closed_loop::BankList, label: &'static str, key_prefix: &'static str| {
            measure_transfers(
                &watch,
                None,
                shape,
                &meter,
                &a.transfer_clients,
                Duration::ZERO,
                measured,
                a.rounds,
                raw.per_sec,
                label,
                key_prefix,
            )
        };
        transfer_rows = measure(bank_list, "transfers", "xfer").await;
        if a.branches {
            let specs = banks.iter().map(|b| b.spec()).collect();
            let interactive = measure(
                std::sync::Arc::new(crate::closed_loop::Shape::Interactive(specs)),
                "transfers in the client's steps (Begin, Enlist, Commit)",
                "steps",
            )
            .await;
            let list = apps
                .iter()
                .map(|(prefix, app)| dtx_bank::branch::BranchBank::new(prefix, app))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let branches = measure(
                std::sync::Arc::new(crate::closed_loop::Shape::Branches(list)),
                "transfers as branches",
                "branch",
            )
            .await;
            branch_rows = Some(BranchRows { interactive, branches });
        }
    }
    // PostgreSQL participants beside pgbench, on the same cluster.
    let postgres = if a.postgres {
        let env = crate::pgbench::Env {
            bin: &bin,
            dir: &dir,
            api: cluster.api_addrs(),
            node_pids: node_pids.clone(),
            counts: &a.transfer_clients,
            warmup,
            measured,
            fsync_per_sec: raw.per_sec,
        };
        Some(crate::pgbench::run(env, &mut checks).await?)
    } else {
        None
    };
    cluster.stop_all(Duration::from_secs(10));
    if let Some(mut e) = etcd_stopped.take() {
        e.stop_all(Duration::from_secs(10));
        println!("etcd's data removed (its logs stay under {})", e.dir.display());
    }
    // The same transfers over TLS, on a cluster of their own (the
    // plain-text one is stopped: nothing else runs meanwhile).
    let tls = if a.tls && !a.transfer_clients.is_empty() {
        let env = crate::tlsbench::Env {
            bin: &bin,
            dir: &dir,
            counts: &a.transfer_clients,
            measured,
            fsync_per_sec: raw.per_sec,
        };
        Some(crate::tlsbench::run(env).await?)
    } else {
        None
    };

    // Retained state (issue 43), each count on a cluster of its own.
    let retained = if a.retained.is_empty() {
        None
    } else {
        Some(crate::retained::measure(&a, &bin, &dir).await?)
    };

    let summary = Summary {
        fsync_p50_us: raw.p50_us,
        decide: rows.iter().map(|(n, _, d)| (*n, d.clone())).collect(),
        etcd: etcd_points,
        transfers: transfer_rows,
    };
    let outcome = Outcome {
        started_unix,
        raw,
        sled_sync,
        rpc,
        read,
        rows,
        etcd_version,
        summary,
        checks,
        postgres,
        tls,
        branches: branch_rows,
        retained,
        machine,
    };
    let text = results_text(&a, &outcome);
    println!();
    print!("{text}");
    write_results(&a, &out_dir, &outcome, &text)?;
    println!("results: {}", out_dir.display());
    if outcome.etcd_version.is_none() {
        println!("{SKIP_BANNER}");
    }
    if let Some(crate::pgbench::PgReport::Skipped(reason)) = &outcome.postgres {
        println!("{}\n{reason}", crate::pgbench::SKIP_BANNER);
    }

    let failed: Vec<&Check> = outcome.checks.iter().filter(|c| !c.passed()).collect();
    if !failed.is_empty() {
        anyhow::bail!(
            "correctness check failed:\n{}",
            failed.iter().map(|c| c.summary()).collect::<Vec<_>>().join("\n")
        );
    }
    // A system that completed nothing at some level (every call UNKNOWN or
    // failed) was not measured: fail rather than report zeros.
    let empty: Vec<String> = outcome
        .rows
        .iter()
        .map(|(n, _, d)| (format!("our Decide at {n} clients"), d))
        .chain(
            outcome
                .summary
                .etcd
                .iter()
                .map(|(n, p)| (format!("etcd put-if-absent at {n} clients"), p)),
        )
        .filter(|(_, p)| p.stats.ops == 0)
        .map(|(what, p)| format!("{what}: no call completed ({})", p.first_error.as_deref().unwrap_or("")))
        .collect();
    anyhow::ensure!(empty.is_empty(), "nothing measured:\n{}", empty.join("\n"));
    Ok(())
}

/// Says so when the leader before a phase is not the one last seen.
fn say_if_new_leader(system: &str, last: &Option<leader_watch::Leader>, now: &Option<leader_watch::Leader>) {
    match (last, now) {
        (Some(l), Some(n)) if l.id == n.id && l.term == n.term => {}
        (_, Some(n)) => println!("{system}: leader is now {} at {} (term {})", n.id, n.addr, n.term),
        (_, None) => println!("{system}: no leader found before the phase"),
    }
}

/// The closed-loop etcd work: put-if-absent of a fresh key
/// `dtxbench/<tag>/<client>/<i>` with its 64-byte value; acknowledged ones
/// are kept for the checks.
fn put_if_absent_work(
    tag: String,
    acked: Arc<Vec<Mutex<Vec<AckedPut>>>>,
) -> impl Fn(EtcdKv, usize, usize) -> std::pin::Pin<Box<dyn std::future::Future<Output = Step> + Send>>
       + Clone
       + Send
       + 'static {
    move |kv, w, i| {
        let key = format!("{ETCD_PREFIX}{tag}/{w}/{i}").into_bytes();
        let acked = acked.clone();
        Box::pin(async move {
            let value = value_for(&key);
            match kv.put_if_absent(&key, &value).await {
                Ok(PutIfAbsent::Written { revision }) => {
                    acked[w].lock().expect("lock").push(AckedPut { key, value, revision });
                    Step::Done
                }
                // Every key is fresh: a refusal means a key the bench never
                // wrote (or wrote once before) already existed.
                Ok(PutIfAbsent::Refused) => Step::Error(format!(
                    "put-if-absent of the fresh key {} was refused",
                    String::from_utf8_lossy(&key)
                )),
                Err(s) => Step::Unknown(format!("{}: {}", s.code(), s.message())),
            }
        })
    }
}

/// Our checks for one client count: the decision lookups of every
/// acknowledged Decide, and a conflicting Decide (Commit) on a sample.
async fn check_our_decides(client: &Client, n: usize, acked: &[u64], recheck: usize) -> Vec<Check> {
    let mut readback = match client.decisions_for(acked, "").await {
        Ok(answers) => {
            let read: Vec<(u64, Option<DecisionRead>)> = answers.iter().map(|a| (a.txid, a.decision)).collect();
            crate::verify::readback_decisions(acked, DecisionRead::Aborted, &read)
        }
        Err(e) => {
            println!("WARNING: the decision lookups got no answer ({e}): {n} clients' Decides UNVERIFIED");
            crate::verify::unverified("ours: every acknowledged Decide read back", acked.len() as u64)
        }
    };
    let mut results = Vec::new();
    for j in crate::verify::sample_evenly(acked.len(), recheck) {
        let t = acked[j];
        let r = match client.commit(t).await {
            Ok(o) => Ok(o),
            Err(ClientError::Unknown(_) | ClientError::Unavailable(_) | ClientError::NotApplied(_)) => {
                Ok(TxOutcome::Unknown)
            }
            Err(e) => Err(e.to_string()),
        };
        results.push((t, r));
    }
    let mut conflicting = crate::verify::conflicting_decides(TxOutcome::Aborted, &results);
    let at = if n == 1 {
        "1 client".to_string()
    } else {
        format!("{n} clients")
    };
    readback.name = format!("{} ({at})", readback.name);
    conflicting.name = format!("{} ({at})", conflicting.name);
    println!("  {}", readback.summary());
    println!("  {}", conflicting.summary());
    vec![readback, conflicting]
}

/// etcd's checks after all its runs: a linearizable read of every key the
/// bench wrote against every acknowledged put, then a sample of each
/// client count's acknowledged keys put-if-absent again (another value),
/// each of which must be refused.
async fn check_etcd_puts(leader: &str, acked: &[Vec<AckedPut>], recheck: usize) -> Vec<Check> {
    let all: Vec<AckedPut> = acked.iter().flatten().cloned().collect();
    let name = "etcd: every acknowledged put-if-absent read back";
    let kv = match EtcdKv::new(leader, CALL_TIMEOUT) {
        Ok(kv) => kv,
        Err(e) => {
            println!("WARNING: cannot connect to etcd for the checks ({e}): etcd UNVERIFIED");
            return vec![crate::verify::unverified(name, all.len() as u64)];
        }
    };
    let readback = match kv.read_prefix(ETCD_PREFIX.as_bytes(), 5000).await {
        Ok(kvs) => {
            let read: HashMap<Vec<u8>, crate::etcd::Seen> = kvs.into_iter().collect();
            crate::verify::readback_puts(&all, &read)
        }
        Err(e) => {
            println!("WARNING: the etcd read-back got no answer ({e:#}): etcd's puts UNVERIFIED");
            crate::verify::unverified(name, all.len() as u64)
        }
    };
    println!("  {}", readback.summary());
    let mut results = Vec::new();
    for level in acked {
        for j in crate::verify::sample_evenly(level.len(), recheck) {
            let key = &level[j].key;
            let r = match kv.put_if_absent(key, b"a second put-if-absent of this key").await {
                Ok(PutIfAbsent::Refused) => Some(false),
                Ok(PutIfAbsent::Written { .. }) => Some(true),
                Err(_) => None,
            };
            results.push((key.clone(), r));
        }
    }
    let twice = crate::verify::reissued_puts(&results);
    println!("  {}", twice.summary());
    vec![readback, twice]
}

/// The text the run prints at the end and writes to results.txt.
fn results_text(a: &BenchArgs, o: &Outcome) -> String {
    let mut t = String::new();
    let ms = crate::report::ms;
    if o.summary.etcd.is_empty() {
        t.push_str(SKIP_BANNER);
        t.push_str("\n\n");
    }
    t.push_str(&format!(
        "dtx-dev bench, {} (unix time {}); --clients {:?} --transfer-clients {:?} --seconds {} --warmup {} --rounds {}{} (each figure the median of the rounds)\nmachine: {}\n",
        o.etcd_version
            .as_deref()
            .map(|v| format!("against {v}"))
            .unwrap_or_else(|| "etcd skipped".into()),
        o.started_unix,
        a.clients,
        a.transfer_clients,
        a.seconds,
        a.warmup,
        a.rounds,
        overrides(a),
        o.machine.line()
    ));
    t.push_str(&format!(
        "disk: fdatasync {:.0}/s, p50 {:.3} ms, p99 {:.3} ms; sled insert+flush {:.0}/s, p50 {:.3} ms\n",
        o.raw.per_sec,
        o.raw.p50_us as f64 / 1000.0,
        o.raw.p99_us as f64 / 1000.0,
        o.sled_sync.per_sec,
        o.sled_sync.p50_us as f64 / 1000.0
    ));
    t.push_str(&format!(
        "at 1 client: API round trip p50 {:.3} ms; linearizable read p50 {:.3} ms\n\n",
        o.rpc.p50_us as f64 / 1000.0,
        o.read.p50_us as f64 / 1000.0
    ));

    t.push_str(
        "| clients | Decide/s | Decide p50 | Decide p99 | Decide/s ÷ fsync/s | Begin/s | Begin p50 | Begin p99 |\n",
    );
    t.push_str("|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (n, b, d) in &o.rows {
        t.push_str(&format!(
            "| {n} | {:.0} | {} | {} | {:.1} | {:.0} | {} | {} |\n",
            d.stats.per_sec,
            ms(d.stats.p50_us),
            ms(d.stats.p99_us),
            d.stats.per_sec / o.raw.per_sec,
            b.stats.per_sec,
            ms(b.stats.p50_us),
            ms(b.stats.p99_us)
        ));
    }
    if let Some((_, _, d)) = o.rows.iter().find(|(n, _, _)| *n == 1) {
        t.push_str(&format!(
            "goal check: Decide p50 at 1 client {} vs 3 fsync p50 + 0.5 ms = {}\n",
            ms(d.stats.p50_us),
            ms(3 * o.raw.p50_us + 500)
        ));
    }
    if let Some((_, _, d)) = o.rows.iter().find(|(n, _, _)| *n == 64) {
        t.push_str(&format!(
            "goal check: Decide/s at 64 clients = {:.1} x the single-threaded fsync rate (goal: >= 5)\n",
            d.stats.per_sec / o.raw.per_sec
        ));
    }
    if !o.summary.transfers.is_empty() {
        t.push('\n');
        t.push_str(
            "| clients | transfers/s | p50 | p99 | ÷ fsync/s | aborted | UNKNOWN | CPU per committed transfer |\n",
        );
        t.push_str("|---:|---:|---:|---:|---:|---:|---:|---:|\n");
        for tp in &o.summary.transfers {
            t.push_str(&format!(
                "| {} | {:.0} | {} | {} | {:.2} | {} | {} | {} |\n",
                tp.clients,
                tp.stats.per_sec,
                ms(tp.stats.p50_us),
                ms(tp.stats.p99_us),
                tp.stats.per_sec / o.raw.per_sec,
                tp.aborted,
                tp.unknown,
                ms(tp.cpu_us_per_committed_transfer)
            ));
        }
        if let Some(tp) = o.summary.transfers.iter().find(|tp| tp.clients == 64) {
            t.push_str(&format!(
                "goal check: transfers/s at 64 clients = {:.2} x the fsync rate (goal: >= 1.5)\n",
                tp.stats.per_sec / o.raw.per_sec
            ));
        }
    }

    t.push_str(&format!(
        "\netcd side by side ({}; both: 3 replicas on this machine, fsync on every log write, each client its own \
         connection to the leader, {VALUE_BYTES}-byte values; CPU = user + system time of the three servers \
         and the bench client, per completed operation)\n\n",
        o.etcd_version.as_deref().unwrap_or("etcd SKIPPED")
    ));
    t.push_str(&crate::report::comparison_text(&o.summary));
    t.push_str("\ngoals against etcd:\n");
    t.push_str(&crate::report::goals_text(&crate::report::goals(&o.summary)));
    t.push_str(&leader_changes_text(o));
    t.push_str(&leader_work_text(o));
    t.push_str(&cpu_split_text(&o.summary.transfers));
    if let Some(pg) = &o.postgres {
        t.push('\n');
        t.push_str(&crate::pgbench::results_text(pg));
    }
    if let Some(tls) = &o.tls {
        t.push('\n');
        t.push_str(&crate::tlsbench::results_text(&o.summary.transfers, tls));
    }
    if let Some(branches) = &o.branches {
        t.push('\n');
        t.push_str(&branches_text(&o.summary.transfers, branches));
    }
    if let Some(r) = &o.retained {
        t.push('\n');
        t.push_str(&crate::retained::results_text(r));
    }
    t.push_str("\ncorrectness checks (UNKNOWN outcomes are neither successes nor failures):\n");
    for c in &o.checks {
        t.push_str(&format!("- {}\n", c.summary()));
    }
    let unknown: u64 = o
        .rows
        .iter()
        .map(|(_, b, d)| b.unknown + d.unknown)
        .chain(o.summary.etcd.iter().map(|(_, p)| p.unknown))
        .chain(o.summary.transfers.iter().map(|tp| tp.unknown))
        .sum();
    t.push_str(&format!(
        "UNKNOWN outcomes in measured phases: {unknown} (not counted in any rate or latency)\n"
    ));
    t
}

/// The transfers a client makes in its own steps (`--branches`).
pub struct BranchRows {
    /// Begin, both Enlists, Commit: the coordinator prepares.
    pub interactive: Vec<TransferPoint>,
    /// Begin, each bank's Change (prepared there, registered), Commit.
    pub branches: Vec<TransferPoint>,
}

/// The one-client goal line of branches beside `name`'s points.
fn goal_line(name: &str, other: &[TransferPoint], branches: &[TransferPoint]) -> String {
    let one = |v: &[TransferPoint]| v.iter().find(|p| p.clients == 1).map(|p| p.stats.p50_us);
    match (one(other), one(branches)) {
        (Some(p), Some(b)) => format!(
            "goal check: one-client p50 as branches {} vs {name} {} ({:.2} x; goal: lower) {}\n",
            crate::report::ms(b),
            crate::report::ms(p),
            b as f64 / p.max(1) as f64,
            if b < p { "MET" } else { "NOT MET" }
        ),
        _ => String::new(),
    }
}

/// The transfers as branches beside the coordinator-driven ones of the
/// same run, in the client's own steps and as one BeginAndCommit, with
/// the goal line for each: a lower p50 at one client.
fn branches_text(prepared: &[TransferPoint], rows: &BranchRows) -> String {
    let branches = &rows.branches;
    let mut t = crate::report::beside_text(
        "transfers as branches (Begin, each bank's Change with the txid: prepared in its handler and \
         registered with its vote, then Commit: no Prepare) beside coordinator-driven transfers in the \
         client's own steps (Begin, both Enlists with their work, Commit: Prepare to both banks, then the \
         decision); same cluster and banks, same run; CPU = all processes per committed transfer",
        ("Prepare", &rows.interactive),
        ("branches", branches),
    );
    t.push_str(&goal_line(
        "coordinator-driven in the client's steps",
        &rows.interactive,
        branches,
    ));
    t.push('\n');
    t.push_str(&crate::report::beside_text(
        "the same branches beside one BeginAndCommit (Prepare to both banks, then the decision, in one \
         write: the work fixed up front, nothing returned to the client)",
        ("BeginAndCommit", prepared),
        ("branches", branches),
    ));
    t.push_str(&goal_line("one BeginAndCommit", prepared, branches));
    let unknown: u64 = branches.iter().chain(&rows.interactive).map(|s| s.unknown).sum();
    t.push_str(&format!(
        "UNKNOWN outcomes in the client's steps (both shapes): {unknown}\n"
    ));
    t
}

/// `1 client`, `64 clients`.
fn clients(n: usize) -> String {
    if n == 1 {
        "1 client".into()
    } else {
        format!("{n} clients")
    }
}

/// Our leader's Raft entries and handler time in each Decide and transfer
/// level (medians of the rounds), where its metrics could be read.
fn leader_work_text(o: &Outcome) -> String {
    let decides = o.rows.iter().filter_map(|(n, _, d)| {
        let w = d.leader_work.as_ref()?;
        Some(format!("- Decide at {}: {}", clients(*n), w.line("Abort")))
    });
    let transfers = o.summary.transfers.iter().filter_map(|t| {
        let w = t.leader_work.as_ref()?;
        Some(format!(
            "- transfers at {}: {}",
            clients(t.clients),
            w.line("BeginAndCommit")
        ))
    });
    let lines: Vec<String> = decides.chain(transfers).collect();
    if lines.is_empty() {
        return String::new();
    }
    format!(
        "\nthe leader during the phases (its own metrics; the client's latency minus the handler's time was spent outside it):\n{}\n",
        lines.join("\n")
    )
}

/// The CPU per committed transfer of each level split by process
/// (medians of the rounds), where it could be.
fn cpu_split_text(transfers: &[crate::report::TransferPoint]) -> String {
    let lines: Vec<String> = transfers
        .iter()
        .filter_map(|t| Some(format!("- at {}: {}", clients(t.clients), t.cpu_split.as_ref()?.line())))
        .collect();
    if lines.is_empty() {
        return String::new();
    }
    format!(
        "\nCPU per committed transfer by process (user + system time over the phase):\n{}\n",
        lines.join("\n")
    )
}

/// Every measured phase whose Raft leader or term changed, one line each,
/// or a line saying none did.
fn leader_changes_text(o: &Outcome) -> String {
    let mut lines = Vec::new();
    for (n, b, d) in &o.rows {
        for (what, p) in [("our Begin", b), ("our Decide", d)] {
            if let Some(c) = &p.leader_change {
                lines.push(format!("- {what} at {}: {c}", clients(*n)));
            }
        }
    }
    for (n, p) in &o.summary.etcd {
        if let Some(c) = &p.leader_change {
            lines.push(format!("- etcd at {}: {c}", clients(*n)));
        }
    }
    let transfers = o.summary.transfers.iter().map(|t| ("transfers", t));
    let tls = o.tls.iter().flatten().map(|t| ("transfers over TLS", t));
    for (what, t) in transfers.chain(tls) {
        if let Some(c) = &t.leader_change {
            lines.push(format!("- {what} at {}: {c}", clients(t.clients)));
        }
    }
    if lines.is_empty() {
        "leader changes during measured phases: none (each kept one leader and term)\n".into()
    } else {
        format!(
            "leader changes during measured phases (not fair measures; the goals reading them are not judged):\n{}\n",
            lines.join("\n")
        )
    }
}

/// results.txt, results.json and the two plots into `out`, and the JSON
/// also to `--json` if given.
fn write_results(a: &BenchArgs, out: &Path, o: &Outcome, text: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let write = |name: &str, body: &str| {
        let p = out.join(name);
        std::fs::write(&p, body).with_context(|| format!("cannot write {}", p.display()))
    };
    write("results.txt", text)?;
    let goals = crate::report::goals(&o.summary);
    let v = serde_json::json!({
        "started_unix": o.started_unix,
        "cpus": o.machine.cpus,
        "machine": o.machine,
        "args": {
            "clients": a.clients, "transfer_clients": a.transfer_clients, "seconds": a.seconds,
            "warmup": a.warmup, "rounds": a.rounds, "recheck": a.recheck, "dir": a.dir, "postgres": a.postgres, "tls": a.tls,
            "inflight_max": a.inflight_max, "wait_us": a.wait_us, "refill_wait_us": a.refill_wait_us,
            "delivery_wait_us": a.delivery_wait_us, "commit_index_defer_max_ms": a.commit_index_defer_max_ms,
            "retained": a.retained,
        },
        "etcd": { "skipped": o.etcd_version.is_none(), "version": o.etcd_version },
        "fsync": o.raw, "sled_flush": o.sled_sync,
        "api_round_trip": o.rpc, "linearizable_read": o.read,
        "levels": o.rows.iter().map(|(n, b, d)| {
            let e = o.summary.etcd.iter().find(|(m, _)| m == n).map(|(_, p)| p);
            serde_json::json!({"clients": n, "begin": b, "decide": d, "etcd_put_if_absent": e,
                "decide_over_etcd": crate::report::decide_over_etcd(&o.summary, *n)})
        }).collect::<Vec<_>>(),
        "transfers": o.summary.transfers.iter().map(|tp| serde_json::json!({
            "clients": tp.clients, "stats": tp.stats, "aborted": tp.aborted, "unknown": tp.unknown,
            "cpu_us_per_committed_transfer": tp.cpu_us_per_committed_transfer,
            "cpu_split": tp.cpu_split,
            "transfers_over_etcd": crate::report::transfers_over_etcd(&o.summary, tp.clients),
        })).collect::<Vec<_>>(),
        "goals": goals,
        "postgres": o.postgres.as_ref().map(|pg| match pg {
            crate::pgbench::PgReport::Skipped(reason) => serde_json::json!({"skipped": true, "reason": reason}),
            crate::pgbench::PgReport::Measured { server_version, pgbench, rows } => serde_json::json!({
                "skipped": false, "server_version": server_version, "pgbench": pgbench, "rows": rows,
                "goal": crate::pgbench::goal_line(rows),
            }),
        }),
        "tls": o.tls.as_ref().map(|tls| crate::tlsbench::json(&o.summary.transfers, tls)),
        "branches": o.branches.as_ref().map(|b| serde_json::json!({
            "interactive": crate::report::beside_json(&o.summary.transfers, &b.interactive, "interactive_over_begin_and_commit"),
            "branches": crate::report::beside_json(&b.interactive, &b.branches, "branches_over_interactive"),
            "branches_beside_begin_and_commit": crate::report::beside_json(&o.summary.transfers, &b.branches, "branches_over_begin_and_commit"),
        })),
        "retained": o.retained.as_ref().map(crate::retained::json),
        "checks": o.checks,
    });
    let json = serde_json::to_string_pretty(&v)?;
    write("results.json", &json)?;
    write(
        "throughput.svg",
        &crate::plot::throughput_svg(&o.summary).map_err(anyhow::Error::msg)?,
    )?;
    write(
        "latency.svg",
        &crate::plot::latency_svg(&o.summary).map_err(anyhow::Error::msg)?,
    )?;
    if let Some(path) = &a.json {
        std::fs::write(path, &json).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::parse;

    fn point(clients: usize, p50_us: u64) -> TransferPoint {
        TransferPoint {
            clients,
            stats: crate::report::stats(vec![p50_us; 10], Duration::from_secs(1)),
            aborted: 0,
            unknown: 0,
            cpu_us_per_committed_transfer: 1000,
            cpu_split: None,
            leader_change: None,
            leader_work: None,
        }
    }

    #[test]
    fn branches_sit_beside_the_prepare_driven_transfers_with_the_one_client_goal() {
        let prepared = [point(1, 1500), point(16, 3000)];
        let rows = |branches: Vec<TransferPoint>| BranchRows {
            interactive: vec![point(1, 2400), point(16, 4000)],
            branches,
        };
        let t = branches_text(&prepared, &rows(vec![point(1, 1200), point(16, 3300)]));
        assert!(t.contains("| 1 | 10 | 10 | 1.00 | 2.40 ms | 1.20 ms |"), "{t}");
        assert!(t.contains("| 1 | 10 | 10 | 1.00 | 1.50 ms | 1.20 ms |"), "{t}");
        assert!(t.contains("| 16 |"), "{t}");
        assert!(
            t.contains("vs coordinator-driven in the client's steps 2.40 ms (0.50 x; goal: lower) MET"),
            "{t}"
        );
        assert!(
            t.contains("vs one BeginAndCommit 1.50 ms (0.80 x; goal: lower) MET"),
            "{t}"
        );
        let t = branches_text(&prepared, &rows(vec![point(1, 1600)]));
        assert!(t.contains("(0.67 x; goal: lower) MET"), "{t}");
        assert!(t.contains("(1.07 x; goal: lower) NOT MET"), "{t}");
    }

    #[test]
    fn client_counts_are_a_comma_separated_list_and_transfers_may_have_none() {
        let d = parse(&[]).unwrap();
        assert_eq!((d.clients, d.transfer_clients), (vec![1, 16, 64, 256], vec![1, 16, 64]));
        let a = parse(&["--clients", "64, 256", "--transfer-clients", ""]).unwrap();
        assert_eq!((a.clients, a.transfer_clients), (vec![64, 256], vec![]));
        assert_eq!(parse(&["--transfer-clients", "1"]).unwrap().transfer_clients, vec![1]);
        let none = parse(&["--clients", ""]).unwrap_err();
        assert!(none.contains("at least one client count"), "{none}");
        let bad = parse(&["--transfer-clients", "1,x"]).unwrap_err();
        assert!(bad.contains("\"x\" is not a client count"), "{bad}");
        let zero = parse(&["--clients", "0"]).unwrap_err();
        assert!(zero.contains("0 measures nothing"), "{zero}");
    }

    #[test]
    fn rounds_default_to_three_and_must_be_one_to_twenty() {
        assert_eq!(parse(&[]).unwrap().rounds, 3);
        assert_eq!(parse(&["--rounds", "1"]).unwrap().rounds, 1);
        let zero = parse(&["--rounds", "0"]).unwrap_err();
        assert!(zero.contains("--rounds") && zero.contains("not in 1..=20"), "{zero}");
        assert!(parse(&["--rounds", "21"]).is_err());
    }

    #[test]
    fn node_settings_a_run_overrode_are_named_in_its_header() {
        assert_eq!(overrides(&parse(&[]).unwrap()), "");
        let a = parse(&["--delivery-wait-us", "0", "--inflight-max", "2"]).unwrap();
        assert_eq!(a.delivery_wait_us, Some(0));
        assert_eq!(overrides(&a), " --inflight-max 2 --delivery-wait-us 0");
        let a = parse(&["--commit-index-defer-max-ms", "0"]).unwrap();
        assert_eq!(overrides(&a), " --commit-index-defer-max-ms 0");
    }

    #[test]
    fn values_are_64_bytes_made_from_the_key() {
        let v = value_for(b"dtxbench/n1/0/0");
        assert_eq!(v.len(), VALUE_BYTES);
        assert!(v.starts_with(b"dtxbench/n1/0/0dtxbench"));
        assert_ne!(value_for(b"a"), value_for(b"b"));
    }

    #[test]
    fn percentiles_pick_from_the_sorted_latencies() {
        let s = stats((1..=100).rev().collect(), Duration::from_secs(2));
        assert_eq!((s.ops, s.p50_us, s.p99_us), (100, 51, 99));
        assert_eq!(s.per_sec, 50.0);
        let empty = stats(vec![], Duration::from_secs(1));
        assert_eq!((empty.ops, empty.p50_us), (0, 0));
    }
}
