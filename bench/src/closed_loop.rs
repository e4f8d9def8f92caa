//! Closed-loop load shared by the bench's phases: clients with their own
//! connection to the leader, a phase runner that keeps every client busy
//! for a fixed time, and the two-bank transfer phase that the sled banks
//! and (with `--postgres`) the PostgreSQL banks both use.

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

use dtx_client::Client;
use dtx_client::ClientConfig;
use dtx_client::ClientError;
use dtx_client::TxOutcome;

use crate::cpu::CpuMeter;
use crate::cpu::Part;
use crate::leader_watch::LeaderWatch;
use crate::report::median_transfer;
use crate::report::stats;
use crate::report::Phase;
use crate::report::Stats;
use crate::report::TransferPoint;

/// How long one call may take before its outcome is UNKNOWN (both systems).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// `n` clients, each with its own connection to the first of `endpoints`
/// (the leader, [`crate::leader_watch::LeaderWatch::leader_first`]) and
/// the others to follow a new leader's hint to.
pub fn clients_for(endpoints: &[String], n: usize) -> Vec<Arc<Client>> {
    clients_with(endpoints, n, None)
}

/// As [`clients_for`], over TLS with `tls` (an application's identity)
/// when set.
pub fn clients_with(endpoints: &[String], n: usize, tls: Option<&Arc<dtx_tls::ClientTls>>) -> Vec<Arc<Client>> {
    (0..n)
        .map(|_| {
            let mut cfg = ClientConfig::new(endpoints.to_vec());
            cfg.call_deadline = CALL_TIMEOUT;
            cfg.tls = tls.cloned();
            Arc::new(Client::new(cfg).expect("client"))
        })
        .collect()
}

/// How a transfer phase's banks take part.
pub enum Shape {
    /// Enlisted by the client with their work as payload, prepared by the
    /// coordinator (`dtx_bank::transfer`, one BeginAndCommit): (participant
    /// id, address, account prefix) each.
    Enlisted(Vec<(String, String, String)>),
    /// Enlisted by the client in its own steps (`dtx_bank::transfer_interactive`:
    /// Begin, both Enlists at once, Commit: the coordinator prepares both,
    /// then decides): the shape branches replace.
    Interactive(Vec<(String, String, String)>),
    /// Called by the client inside its transaction, each preparing in its
    /// own request handler and registering with its vote
    /// (`dtx_bank::branch::transfer_as_branches`: Begin, the two calls,
    /// Commit).
    Branches(Vec<dtx_bank::branch::BranchBank>),
}

impl Shape {
    /// One transfer under `key` between accounts of 10,000 per bank.
    async fn transfer(&self, c: &Client, key: &str) -> (Option<u64>, Result<TxOutcome, ClientError>) {
        match self {
            Shape::Enlisted(banks) => dtx_bank::transfer(c, key, banks, 10_000).await,
            Shape::Interactive(banks) => dtx_bank::transfer_interactive(c, key, banks, 10_000).await,
            Shape::Branches(banks) => dtx_bank::branch::transfer_as_branches(c, key, banks, 10_000).await,
        }
    }
}

/// Banks as `measure_transfers` takes them.
pub type BankList = Arc<Shape>;

/// Started banks as `measure_transfers` takes them, and a CPU meter over
/// `nodes`, the banks and this process (every process of a transfer),
/// each named by kind so that a phase's CPU also splits by process.
pub fn banks_and_meter(
    banks: &[dtx_testkit::cluster::BankProcess],
    nodes: &[dtx_testkit::cluster::NodeProc],
) -> (BankList, CpuMeter) {
    let list = Shape::Enlisted(banks.iter().map(|b| b.spec()).collect());
    let pids = nodes
        .iter()
        .filter_map(|n| Some((Part::Node(n.plan.id), n.pid()?)))
        .chain(banks.iter().filter_map(|b| Some((Part::Bank, b.pid()?))))
        .collect();
    (Arc::new(list), CpuMeter::with_parts(pids))
}

/// How one call of a closed-loop phase ended.
pub enum Step {
    /// Completed with a definite answer: counted, latency recorded.
    Done,
    /// Outcome not known (timeout, lost reply): counted apart.
    Unknown(String),
    /// Failed with a definite answer: counted apart.
    Error(String),
    /// This client has no more work.
    Stop,
}

/// Every client runs `work` in a closed loop for `length`.
pub async fn run_phase<C, F, Fut>(clients: &[C], length: Duration, work: F) -> PhaseOut
where
    C: Clone + Send + 'static,
    F: Fn(C, usize, usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Step> + Send,
{
    let start = Instant::now();
    let until = start + length;
    let mut tasks = Vec::new();
    for (w, c) in clients.iter().enumerate() {
        let c = c.clone();
        let work = work.clone();
        tasks.push(tokio::spawn(async move {
            let mut out = (Vec::new(), 0u64, 0u64, None::<String>);
            let mut i = 0;
            while Instant::now() < until {
                let t = Instant::now();
                match work(c.clone(), w, i).await {
                    Step::Done => out.0.push(t.elapsed().as_micros() as u64),
                    Step::Unknown(e) => {
                        out.1 += 1;
                        out.3.get_or_insert(format!("UNKNOWN: {e}"));
                    }
                    Step::Error(e) => {
                        out.2 += 1;
                        out.3.get_or_insert(format!("error: {e}"));
                    }
                    Step::Stop => break,
                }
                i += 1;
            }
            out
        }));
    }
    let (mut lat, mut unknown, mut errors, mut first_error) = (Vec::new(), 0, 0, None);
    for t in tasks {
        if let Ok((l, u, e, f)) = t.await {
            lat.extend(l);
            unknown += u;
            errors += e;
            if first_error.is_none() {
                first_error = f;
            }
        }
    }
    PhaseOut {
        stats: stats(lat, start.elapsed()),
        unknown,
        errors,
        first_error,
    }
}

pub struct PhaseOut {
    pub stats: Stats,
    pub unknown: u64,
    pub errors: u64,
    pub first_error: Option<String>,
}

impl PhaseOut {
    /// With the CPU time spent during the phase, if measured, and the
    /// leader change during it, if any ([`crate::leader_watch::change`]).
    pub fn phase(self, cpu: Option<Duration>, leader_change: Option<String>) -> Phase {
        let ops = self.stats.ops as u64;
        Phase {
            cpu_us_per_op: cpu.and_then(|c| (c.as_micros() as u64).checked_div(ops)),
            stats: self.stats,
            unknown: self.unknown,
            errors: self.errors,
            first_error: self.first_error,
            leader_change,
            leader_work: None,
        }
    }
}

/// ` round 2/3` in a console line, or nothing when a level has one round.
pub fn round_label(r: u64, rounds: u64) -> String {
    if rounds > 1 {
        format!(" round {r}/{rounds}")
    } else {
        String::new()
    }
}

/// Closed-loop two-participant transfers (`dtx_bank::transfer`) between
/// `bank_list` (each `(participant id, address, account prefix)`, 10,000
/// accounts each) at each of `counts` clients, each client with its own
/// connection to the leader (found by `watch` before each count, and again
/// after it: a phase whose leader changed is marked so): an unmeasured warm-up of `warmup` (none if
/// zero), then `measured`, `rounds` times per count (the point is the
/// median of the rounds, [`median_transfer`]); CPU per committed transfer from `meter`
/// (sampled before the phase and 500 ms after it). `label` names the
/// console lines, `key_prefix` the transactions' keys (unique per call in
/// one run: a key already used finds its transaction again). Used for the
/// sled banks, (with `--postgres`) the PostgreSQL banks, and (with
/// `--tls`) the sled banks over TLS, the clients with `client_tls`.
#[allow(clippy::too_many_arguments)]
pub async fn measure_transfers(
    watch: &LeaderWatch,
    client_tls: Option<&Arc<dtx_tls::ClientTls>>,
    bank_list: BankList,
    meter: &CpuMeter,
    counts: &[usize],
    warmup: Duration,
    measured: Duration,
    rounds: u64,
    fsync_per_sec: f64,
    label: &'static str,
    key_prefix: &'static str,
) -> Vec<TransferPoint> {
    let mut transfer_rows = Vec::new();
    for &n in counts {
        let mut points = Vec::new();
        for r in 1..=rounds {
            let round = round_label(r, rounds);
            let leader = watch.find().await;
            let clients = clients_with(&watch.leader_first(leader.as_ref()), n, client_tls);
            if !warmup.is_zero() {
                let bl = bank_list.clone();
                run_phase(&clients, warmup, move |c, w, i| {
                    let bl = bl.clone();
                    async move {
                        let key = format!("{key_prefix}-warm-{n}-{r}-{w}-{i}");
                        match bl.transfer(&c, &key).await {
                            (_, Ok(_)) => Step::Done,
                            (_, Err(e)) => Step::Error(e.to_string()),
                        }
                    }
                })
                .await;
            }
            let aborted = Arc::new(AtomicU64::new(0));
            let committed = Arc::new(AtomicU64::new(0));
            let (bl, ab, co) = (bank_list.clone(), aborted.clone(), committed.clone());
            let work = watch.work_from(leader.as_ref()).await;
            let cpu_before = meter.sample_parts();
            let st = run_phase(&clients, measured, move |c, w, i| {
                let (bl, ab, co) = (bl.clone(), ab.clone(), co.clone());
                async move {
                    let key = format!("{key_prefix}-{n}-{r}-{w}-{i}");
                    match bl.transfer(&c, &key).await {
                        (_, Ok(TxOutcome::Committed)) => {
                            co.fetch_add(1, Ordering::Relaxed);
                            Step::Done
                        }
                        (_, Ok(TxOutcome::Aborted)) => {
                            ab.fetch_add(1, Ordering::Relaxed);
                            Step::Done
                        }
                        (t, Ok(TxOutcome::Unknown)) => Step::Unknown(format!("transfer {key} (txid {t:?})")),
                        (_, Err(ClientError::Unknown(e))) => Step::Unknown(e),
                        (_, Err(e)) => Step::Error(e.to_string()),
                    }
                }
            })
            .await;
            let leader_work = work.until_now(watch, leader.as_ref(), "BeginAndCommit").await;
            // Phase two of the last transfers finishes in the background;
            // its work belongs to them, so let it run before reading.
            tokio::time::sleep(Duration::from_millis(500)).await;
            let cpu_after = meter.sample_parts();
            let cpu = cpu_after.total().saturating_sub(cpu_before.total());
            let leader_change = crate::leader_watch::change(leader.as_ref(), watch.find().await.as_ref());
            let ab = aborted.load(Ordering::Relaxed);
            let co = committed.load(Ordering::Relaxed);
            let cpu_split = leader
                .as_ref()
                .and_then(|l| cpu_after.split_since(&cpu_before, l.id, co));
            let cpu_us_per_commit = (cpu.as_micros() as u64).checked_div(co).unwrap_or(0);
            println!(
            "{label}, clients {n:>3}{round}: {:>7.0}/s p50 {:>6} us p99 {:>6} us ({ab} aborted by lock conflicts; {} UNKNOWN; {:.2}x fsync rate); CPU {:.2} ms per committed transfer, all processes ({:.1} s for {co})",
            st.stats.per_sec,
            st.stats.p50_us,
            st.stats.p99_us,
            st.unknown,
            st.stats.per_sec / fsync_per_sec,
            cpu_us_per_commit as f64 / 1000.0,
            cpu.as_secs_f64()
        );
            if let Some(w) = &leader_work {
                println!("{label}, clients {n:>3}{round}: {}", w.line("BeginAndCommit"));
            }
            if let Some(c) = &cpu_split {
                println!(
                    "{label}, clients {n:>3}{round}: CPU per committed transfer by process: {}",
                    c.line()
                );
            }
            if let Some(c) = &leader_change {
                println!("{label}, clients {n:>3}{round}: NOT A FAIR MEASURE: {c}");
            }
            points.push(TransferPoint {
                clients: n,
                stats: st.stats,
                aborted: ab,
                unknown: st.unknown,
                cpu_us_per_committed_transfer: cpu_us_per_commit,
                cpu_split,
                leader_change,
                leader_work,
            });
        }
        let point = median_transfer(&points);
        if rounds > 1 {
            println!(
                "{label}, clients {n:>3}: median of {rounds} rounds: {:.0}/s p50 {} us p99 {} us; CPU {:.2} ms per committed transfer",
                point.stats.per_sec,
                point.stats.p50_us,
                point.stats.p99_us,
                point.cpu_us_per_committed_transfer as f64 / 1000.0
            );
        }
        transfer_rows.push(point);
    }
    transfer_rows
}
