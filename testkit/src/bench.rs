//! `coordinator bench`: Begin and Decide throughput and latency on a local
//! three-node cluster of real node processes (fsync on), at several client
//! counts, next to this disk's fsync rate measured by the same binary in the
//! same run, so the ratio means something on any machine.
//!
//! Run it from a release build: `cargo run --release -- bench`.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

use anyhow::Context;

use crate::cluster::ProcessCluster;
use dtx_client::Client;
use dtx_client::ClientConfig;
use dtx_client::TxOutcome;

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Client counts to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
    pub clients: Vec<usize>,
    /// Seconds per phase (Begin, then Decide) and client count.
    #[arg(long, default_value_t = 5)]
    pub seconds: u64,
    /// Where the cluster keeps its data (on the disk you want to measure).
    #[arg(long, default_value = "target/dtx-bench")]
    pub dir: PathBuf,
    /// fsyncs in the disk measurement.
    #[arg(long, default_value_t = 2000)]
    pub fsyncs: usize,
    /// Override batch.inflight_max of the nodes (default: the config default).
    #[arg(long)]
    pub inflight_max: Option<usize>,
    /// Override batch.wait_us of the nodes.
    #[arg(long)]
    pub wait_us: Option<u64>,
    /// Also measure end-to-end two-participant transfers (bank example) at
    /// these client counts, comma-separated; empty to skip.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    pub transfer_clients: Vec<usize>,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Stats {
    pub ops: usize,
    pub per_sec: f64,
    pub p50_us: u64,
    pub p99_us: u64,
}

fn stats(mut lat_us: Vec<u64>, elapsed: Duration) -> Stats {
    lat_us.sort_unstable();
    let pick = |q: f64| {
        if lat_us.is_empty() {
            0
        } else {
            lat_us[((lat_us.len() - 1) as f64 * q).round() as usize]
        }
    };
    Stats {
        ops: lat_us.len(),
        per_sec: lat_us.len() as f64 / elapsed.as_secs_f64(),
        p50_us: pick(0.50),
        p99_us: pick(0.99),
    }
}

/// Single-threaded fsync rate of the disk under `dir`: write 512 bytes at
/// the end of a file and `fdatasync`, `n` times; and the same through sled
/// (insert + flush), the store the nodes use.
pub fn measure_fsync(dir: &std::path::Path, n: usize) -> anyhow::Result<(Stats, Stats)> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join("fsync-probe.bin");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(&path)?;
    let buf = [7u8; 512];
    let mut lat = Vec::with_capacity(n);
    let start = Instant::now();
    for _ in 0..n {
        let t = Instant::now();
        f.write_all(&buf)?;
        f.sync_data()?;
        lat.push(t.elapsed().as_micros() as u64);
    }
    let raw = stats(lat, start.elapsed());
    drop(f);
    let _ = std::fs::remove_file(&path);

    let sled_dir = dir.join("fsync-probe-sled");
    let _ = std::fs::remove_dir_all(&sled_dir);
    let db = sled::Config::new().path(&sled_dir).flush_every_ms(None).open()?;
    let mut lat = Vec::with_capacity(n);
    let start = Instant::now();
    for i in 0..n as u64 {
        let t = Instant::now();
        db.insert(i.to_be_bytes(), &buf[..])?;
        db.flush()?;
        lat.push(t.elapsed().as_micros() as u64);
    }
    let sled_stats = stats(lat, start.elapsed());
    drop(db);
    let _ = std::fs::remove_dir_all(&sled_dir);
    Ok((raw, sled_stats))
}

/// `n` clients, each with its own connection to the leader.
fn clients_for(leader_api: &str, n: usize) -> Vec<Arc<Client>> {
    (0..n)
        .map(|_| {
            let mut cfg = ClientConfig::new(vec![leader_api.to_string()]);
            cfg.call_deadline = Duration::from_secs(30);
            Arc::new(Client::new(cfg).expect("client"))
        })
        .collect()
}

async fn run_phase<F, Fut>(clients: &[Arc<Client>], seconds: u64, work: F) -> Stats
where
    F: Fn(Arc<Client>, usize, usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let start = Instant::now();
    let until = start + Duration::from_secs(seconds);
    let mut tasks = Vec::new();
    for (w, c) in clients.iter().enumerate() {
        let c = c.clone();
        let work = work.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut i = 0;
            while Instant::now() < until {
                let t = Instant::now();
                if !work(c.clone(), w, i).await {
                    break;
                }
                lat.push(t.elapsed().as_micros() as u64);
                i += 1;
            }
            lat
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap_or_default());
    }
    stats(all, start.elapsed())
}

pub async fn run(a: BenchArgs) -> anyhow::Result<()> {
    let dir = a.dir.clone();
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let dir = dir.canonicalize()?;
    println!("measuring fsync on {} ({} syncs)...", dir.display(), a.fsyncs);
    let (raw, sled_sync) = measure_fsync(&dir, a.fsyncs)?;
    println!(
        "disk: fdatasync {:.0}/s (p50 {} us); sled insert+flush {:.0}/s (p50 {} us)",
        raw.per_sec, raw.p50_us, sled_sync.per_sec, sled_sync.p50_us
    );

    let bin = std::env::current_exe().context("cannot find the coordinator binary")?;
    let plans = ProcessCluster::plan_local("127.0.0.1", 3)?;
    let (inflight, wait) = (a.inflight_max, a.wait_us);
    let mut cluster = ProcessCluster::new(&bin, &dir.join("cluster"), "dtx-bench", plans, |c| {
        if let Some(v) = inflight {
            c.batch.inflight_max = v;
        }
        if let Some(v) = wait {
            c.batch.wait_us = v;
        }
    })?;
    cluster.start_all()?;
    let leader = cluster
        .wait_for_leader(Duration::from_secs(30))
        .await
        .context("no leader within 30 s")?;
    let leader_api = cluster.node(leader).plan.api_listen.clone();
    println!("cluster up; leader node {leader} at {leader_api}");

    // Latency budget at one client: a bare API round trip (no Raft), and a
    // linearizable read (round trip + one heartbeat round to a quorum).
    let one = clients_for(&leader_api, 1);
    let rpc = run_phase(&one, 2, |c, _, _| async move { c.cluster_status().await.is_ok() }).await;
    let read = run_phase(&one, 2, |c, _, _| async move { c.decision(1).await.is_ok() }).await;
    println!(
        "budget at 1 client: API round trip p50 {} us; linearizable read p50 {} us; fsync p50 {} us",
        rpc.p50_us, read.p50_us, raw.p50_us
    );

    let mut rows = Vec::new();
    for &n in &a.clients {
        let clients = clients_for(&leader_api, n);
        // Warm up connections.
        for c in &clients {
            let _ = c.cluster_status().await;
        }
        // Phase 1: Begin (each creates a transaction, kept for phase 2).
        let made: Arc<Vec<std::sync::Mutex<Vec<u64>>>> = Arc::new((0..n).map(|_| Default::default()).collect());
        let m = made.clone();
        let begin = run_phase(&clients, a.seconds, move |c, w, i| {
            let m = m.clone();
            async move {
                match c.begin(&format!("bench-{n}-{w}-{i}"), 3_600_000, b"").await {
                    Ok(b) => {
                        m[w].lock().expect("lock").push(b.txid);
                        true
                    }
                    Err(_) => false,
                }
            }
        })
        .await;
        // Phase 2: Decide (ABORT, write-once) each of them once.
        let m = made.clone();
        let decide = run_phase(&clients, a.seconds, move |c, w, i| {
            let m = m.clone();
            async move {
                let txid = m[w].lock().expect("lock").get(i).copied();
                match txid {
                    Some(t) => matches!(c.abort(t, "bench").await, Ok(TxOutcome::Aborted)),
                    None => false,
                }
            }
        })
        .await;
        println!(
            "clients {n:>4}: begin {:>8.0}/s p50 {:>6} us p99 {:>6} us | decide {:>8.0}/s p50 {:>6} us p99 {:>6} us ({:.1}x fsync rate)",
            begin.per_sec,
            begin.p50_us,
            begin.p99_us,
            decide.per_sec,
            decide.p50_us,
            decide.p99_us,
            decide.per_sec / raw.per_sec
        );
        rows.push((n, begin, decide));
    }
    // End-to-end transfers: begin, enlist two bank services, commit (the
    // participants prepare and fsync, the decision goes through Raft, phase
    // two runs in the background). 10,000 accounts per bank keep lock
    // conflicts rare.
    let mut transfer_rows = Vec::new();
    if !a.transfer_clients.is_empty() {
        let api = cluster.api_addrs();
        let banks = vec![
            crate::cluster::start_bank(&bin, &dir, "bank-a", "a", &api, 10_000, 1_000_000)?,
            crate::cluster::start_bank(&bin, &dir, "bank-b", "b", &api, 10_000, 1_000_000)?,
        ];
        for b in &banks {
            b.wait_started().await?;
        }
        let bank_list: Arc<Vec<(String, String, String)>> = Arc::new(
            banks
                .iter()
                .map(|b| (b.id.to_string(), b.addr.clone(), b.prefix.to_string()))
                .collect(),
        );
        // CPU time summed over every process of the run: the three nodes,
        // the two banks and this client.
        let meter = crate::cpu::CpuMeter::new(
            cluster
                .nodes
                .iter()
                .filter_map(|n| n.pid())
                .chain(banks.iter().filter_map(|b| b.pid()))
                .collect(),
        );
        for &n in &a.transfer_clients {
            let clients = clients_for(&leader_api, n);
            let aborted = Arc::new(std::sync::atomic::AtomicU64::new(0));
            let committed = Arc::new(std::sync::atomic::AtomicU64::new(0));
            let (bl, ab, co) = (bank_list.clone(), aborted.clone(), committed.clone());
            let cpu_before = meter.sample();
            let st = run_phase(&clients, a.seconds, move |c, w, i| {
                let (bl, ab, co) = (bl.clone(), ab.clone(), co.clone());
                async move {
                    let key = format!("xfer-{n}-{w}-{i}");
                    match dtx_bank::transfer(&c, &key, &bl, 10_000).await {
                        (_, Ok(TxOutcome::Committed)) => {
                            co.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            true
                        }
                        (_, Ok(TxOutcome::Aborted)) => {
                            ab.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            true
                        }
                        _ => false,
                    }
                }
            })
            .await;
            // Phase two of the last transfers finishes in the background;
            // its work belongs to them, so let it run before reading.
            tokio::time::sleep(Duration::from_millis(500)).await;
            let cpu = meter.sample().saturating_sub(cpu_before);
            let ab = aborted.load(std::sync::atomic::Ordering::Relaxed);
            let co = committed.load(std::sync::atomic::Ordering::Relaxed);
            let cpu_us_per_commit = (cpu.as_micros() as u64).checked_div(co).unwrap_or(0);
            println!(
                "transfers, clients {n:>3}: {:>7.0}/s p50 {:>6} us p99 {:>6} us ({ab} aborted by lock conflicts; {:.2}x fsync rate); CPU {:.2} ms per committed transfer, all processes ({:.1} s for {co})",
                st.per_sec,
                st.p50_us,
                st.p99_us,
                st.per_sec / raw.per_sec,
                cpu_us_per_commit as f64 / 1000.0,
                cpu.as_secs_f64()
            );
            transfer_rows.push((n, st, ab, cpu_us_per_commit));
        }
    }
    cluster.stop_all(Duration::from_secs(10));

    println!();
    println!("| clients | Decide/s | Decide p50 | Decide p99 | Decide/s ÷ fsync/s | Begin/s | Begin p50 | Begin p99 |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (n, b, d) in &rows {
        println!(
            "| {n} | {:.0} | {:.2} ms | {:.2} ms | {:.1} | {:.0} | {:.2} ms | {:.2} ms |",
            d.per_sec,
            d.p50_us as f64 / 1000.0,
            d.p99_us as f64 / 1000.0,
            d.per_sec / raw.per_sec,
            b.per_sec,
            b.p50_us as f64 / 1000.0,
            b.p99_us as f64 / 1000.0
        );
    }
    println!();
    println!(
        "disk: fdatasync {:.0}/s, p50 {:.3} ms; sled insert+flush {:.0}/s, p50 {:.3} ms",
        raw.per_sec,
        raw.p50_us as f64 / 1000.0,
        sled_sync.per_sec,
        sled_sync.p50_us as f64 / 1000.0
    );
    if let Some(one) = rows.iter().find(|(n, _, _)| *n == 1) {
        let budget_us = 3 * raw.p50_us + 500;
        println!(
            "goal check: Decide p50 at 1 client {:.3} ms vs 3 fsync p50 + 0.5 ms = {:.3} ms",
            one.2.p50_us as f64 / 1000.0,
            budget_us as f64 / 1000.0
        );
    }
    if let Some(r) = rows.iter().find(|(n, _, _)| *n == 64) {
        println!(
            "goal check: Decide/s at 64 clients = {:.1} x the single-threaded fsync rate (goal: >= 5)",
            r.2.per_sec / raw.per_sec
        );
    }
    if !transfer_rows.is_empty() {
        println!();
        println!("| clients | transfers/s | p50 | p99 | ÷ fsync/s | aborted | CPU per committed transfer |");
        println!("|---:|---:|---:|---:|---:|---:|---:|");
        for (n, st, ab, cpu_us) in &transfer_rows {
            println!(
                "| {n} | {:.0} | {:.2} ms | {:.2} ms | {:.2} | {ab} | {:.2} ms |",
                st.per_sec,
                st.p50_us as f64 / 1000.0,
                st.p99_us as f64 / 1000.0,
                st.per_sec / raw.per_sec,
                *cpu_us as f64 / 1000.0
            );
        }
        if let Some((_, one, _, _)) = transfer_rows.iter().find(|(n, _, _, _)| *n == 1) {
            println!(
                "goal check: transfer p50 at 1 client {:.3} ms vs 3 fsync p50 + 1 ms = {:.3} ms",
                one.p50_us as f64 / 1000.0,
                (3 * raw.p50_us + 1000) as f64 / 1000.0
            );
        }
        if let Some((_, r, _, _)) = transfer_rows.iter().find(|(n, _, _, _)| *n == 64) {
            println!(
                "goal check: transfers/s at 64 clients = {:.2} x the fsync rate (goal: >= 1.5)",
                r.per_sec / raw.per_sec
            );
        }
    }
    if let Some(path) = &a.json {
        let v = serde_json::json!({
            "fsync": raw, "sled_flush": sled_sync,
            "levels": rows.iter().map(|(n, b, d)| serde_json::json!({"clients": n, "begin": b, "decide": d})).collect::<Vec<_>>(),
            "transfers": transfer_rows.iter().map(|(n, st, ab, cpu_us)| serde_json::json!({
                "clients": n, "stats": st, "aborted": ab, "cpu_us_per_committed_transfer": cpu_us,
            })).collect::<Vec<_>>(),
        });
        std::fs::write(path, serde_json::to_string_pretty(&v)?)?;
    }
    Ok(())
}
