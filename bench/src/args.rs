//! The bench's arguments (`dtx-dev bench ...`) and what every part of it
//! takes from them: the node settings they override and the value each
//! transaction carries.

use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Client counts to measure, comma-separated (our Begin and Decide, and
    /// etcd's put-if-absent).
    #[arg(long, default_value = "1,16,64,256", value_parser = client_counts)]
    pub clients: ::std::vec::Vec<usize>,
    /// Seconds per measured phase (Begin, Decide, etcd put-if-absent,
    /// transfers) and client count.
    #[arg(long, default_value_t = 5)]
    pub seconds: u64,
    /// Rounds of each level (each client count of Begin, Decide and
    /// etcd's put-if-absent, the two systems alternating; each transfer
    /// client count): every figure reported is the median of its rounds.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=20))]
    pub rounds: u64,
    /// Seconds of unmeasured warm-up of each system before its measured
    /// phases at each client count.
    #[arg(long, default_value_t = 1)]
    pub warmup: u64,
    /// Where the clusters keep their data (on the disk you want to measure).
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
    /// Override batch.refill_wait_us of the nodes (0: batches never wait to
    /// be refilled under load).
    #[arg(long)]
    pub refill_wait_us: Option<u64>,
    /// Override txn.delivery_batch_wait_us of the nodes (how long phase
    /// two waits for more decisions to one participant before it sends).
    #[arg(long)]
    pub delivery_wait_us: Option<u64>,
    /// Override raft.commit_index_defer_max_ms of the nodes (0: every
    /// AppendEntries that carries only a newer commit index is sent).
    #[arg(long)]
    pub commit_index_defer_max_ms: Option<u64>,
    /// Also measure end-to-end two-participant transfers (bank example) at
    /// these client counts, comma-separated; empty to skip.
    #[arg(long, default_value = "1,16,64", value_parser = client_counts_or_none)]
    pub transfer_clients: ::std::vec::Vec<usize>,
    /// Skip etcd (where it cannot be had): no comparison, said loudly.
    #[arg(long)]
    pub no_etcd: bool,
    /// The etcd binary (default: `etcd` on PATH, from Debian's etcd-server).
    #[arg(long)]
    pub etcd_bin: Option<PathBuf>,
    /// Acknowledged writes per client count re-issued (etcd) or decided the
    /// other way (ours) to check that none is accepted twice.
    #[arg(long, default_value_t = 200)]
    pub recheck: usize,
    /// Results folder (results.txt, results.json, throughput.svg,
    /// latency.svg); default target/bench-results/<unix time>.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// After the other phases, also measure transfers between two banks on
    /// PostgreSQL (`bank-serve --postgres`) at the transfer client counts,
    /// beside pgbench's same two UPDATEs on the same server as plain and as
    /// PREPARE/COMMIT PREPARED transactions. Skipped, said loudly, without
    /// the PostgreSQL binaries or pgbench.
    #[arg(long)]
    pub postgres: bool,
    /// After the other phases, measure the transfers again on a second
    /// cluster and banks with mutual TLS on every link (a throwaway
    /// authority), at the transfer client counts, beside the plain-text
    /// transfers of the same run (the cost of TLS).
    #[arg(long)]
    pub tls: bool,
    /// After the transfers, measure them again on the same cluster and
    /// banks in the client's own steps, twice: coordinator-driven (Begin,
    /// both Enlists, Commit: the coordinator prepares) and as branches (the
    /// client begins, calls each bank's `bank.v1.Bank.Change` with the
    /// txid, which prepares and registers with its vote, then commits), at
    /// the transfer client counts: the tables put branches beside both
    /// coordinator-driven shapes of the run.
    #[arg(long)]
    pub branches: bool,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// After the other phases, measure how the cost grows with retained
    /// transactions (issue 43) at these counts, comma-separated (`1m` =
    /// 1000000): per count a fresh cluster loaded with that many decided,
    /// acknowledged transactions, then memory, disk, Decide/s at 256
    /// clients, a snapshot, a follower's restart and catch-up
    /// (`crate::retained`); empty to skip.
    #[arg(long, default_value = "", value_parser = retained_counts)]
    pub retained: ::std::vec::Vec<u64>,
    /// Run only the --retained measurement (after the disk's fsync rate):
    /// no Begin/Decide levels, etcd, transfers or other parts.
    #[arg(long)]
    pub retained_only: bool,
}

/// Size of every value etcd stores here, and of the description each of
/// our transactions carries.
pub const VALUE_BYTES: usize = 64;

/// The 64-byte value written under `key`: the key's bytes repeated.
pub fn value_for(key: &[u8]) -> Vec<u8> {
    key.iter().cycle().take(VALUE_BYTES).copied().collect()
}

/// The node settings of the options that override them (`--inflight-max`
/// and the others [`overrides`] names), on one node's config.
pub(crate) fn apply_node_overrides(a: &BenchArgs, c: &mut coordinator::config::Config) {
    if let Some(v) = a.inflight_max {
        c.batch.inflight_max = v;
    }
    if let Some(v) = a.wait_us {
        c.batch.wait_us = v;
    }
    if let Some(v) = a.refill_wait_us {
        c.batch.refill_wait_us = v;
    }
    if let Some(v) = a.delivery_wait_us {
        c.txn.delivery_batch_wait_us = v;
    }
    if let Some(v) = a.commit_index_defer_max_ms {
        c.raft.commit_index_defer_max_ms = v;
    }
}

/// The node settings this run overrode, as the options that set them
/// (` --delivery-wait-us 0`), or nothing: a run's figures are only
/// comparable with runs of the same settings.
pub(crate) fn overrides(a: &BenchArgs) -> String {
    let mut s = String::new();
    let mut add = |flag: &str, v: Option<u64>| {
        if let Some(v) = v {
            s.push_str(&format!(" --{flag} {v}"));
        }
    };
    add("inflight-max", a.inflight_max.map(|v| v as u64));
    add("wait-us", a.wait_us);
    add("refill-wait-us", a.refill_wait_us);
    add("delivery-wait-us", a.delivery_wait_us);
    add("commit-index-defer-max-ms", a.commit_index_defer_max_ms);
    s
}

/// `--clients`: one or more client counts, comma-separated. (The
/// fully-qualified `Vec` in the fields keeps clap from taking the list as
/// repeated values, so that an empty one can mean "none".)
fn client_counts(s: &str) -> Result<Vec<usize>, String> {
    let counts = client_counts_or_none(s)?;
    if counts.is_empty() {
        return Err("give at least one client count, for example 1,16,64,256".into());
    }
    Ok(counts)
}

/// `--transfer-clients`: client counts, comma-separated, or empty for none.
fn client_counts_or_none(s: &str) -> Result<Vec<usize>, String> {
    if s.trim().is_empty() {
        return Ok(Vec::new());
    }
    s.split(',')
        .map(|c| match c.trim().parse::<usize>() {
            Ok(0) => Err("a client count of 0 measures nothing; give counts of 1 or more".to_string()),
            Ok(n) => Ok(n),
            Err(_) => Err(format!("{c:?} is not a client count (a whole number, such as 64)")),
        })
        .collect()
}

/// `--retained`: counts of retained transactions, comma-separated, each a
/// whole number with optional `_` separators or a `k` / `m` suffix
/// (`0,1m,5m` = `0,1000000,5000000`); empty for none. Sorted ascending;
/// a count given twice is refused.
pub fn retained_counts(s: &str) -> Result<Vec<u64>, String> {
    if s.trim().is_empty() {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for part in s.split(',') {
        let n = one_count(part.trim()).ok_or_else(|| {
            format!("{part:?} is not a count of transactions (a whole number, such as 1000000 or 1m)")
        })?;
        if out.contains(&n) {
            return Err(format!("the count {n} is given twice"));
        }
        out.push(n);
    }
    out.sort_unstable();
    Ok(out)
}

fn one_count(s: &str) -> Option<u64> {
    let s = s.replace('_', "");
    let (digits, unit) = match s.chars().last()? {
        'k' | 'K' => (&s[..s.len() - 1], 1_000),
        'm' | 'M' => (&s[..s.len() - 1], 1_000_000),
        _ => (&s[..], 1),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse::<u64>().ok()?.checked_mul(unit)
}

/// The arguments of this mode make sense together: `--retained-only`
/// needs `--retained`.
pub fn check_args(a: &BenchArgs) -> Result<(), String> {
    if a.retained_only && a.retained.is_empty() {
        return Err("--retained-only needs --retained (for example --retained 0,1000000,5000000)".into());
    }
    Ok(())
}

/// `dtx-dev bench ARGS` parsed as the command line would be (tests).
#[cfg(test)]
pub(crate) fn parse(args: &[&str]) -> Result<BenchArgs, String> {
    use clap::Parser;
    #[derive(clap::Parser)]
    struct Cmd {
        #[command(flatten)]
        bench: BenchArgs,
    }
    let argv = std::iter::once("bench").chain(args.iter().copied());
    Cmd::try_parse_from(argv).map(|c| c.bench).map_err(|e| e.to_string())
}
