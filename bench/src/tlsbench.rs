//! `dtx-dev bench --tls`: the transfers again with mutual TLS on every link
//! (what TLS costs), on a second cluster of three nodes and two banks with
//! certificates from a throwaway authority ([`dtx_testkit::pki::DevPki`]),
//! the clients as an application, after the plain-text phases of the same
//! run. The table beside the plain-text transfers gives the throughput,
//! latency and CPU ratios.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use dtx_tls::Role;

use crate::report::TransferPoint;
use dtx_testkit::cluster::ProcessCluster;
use dtx_testkit::pki::DevPki;

/// What the TLS phase needs from the bench.
pub struct Env<'a> {
    pub bin: &'a Path,
    pub dir: &'a Path,
    pub counts: &'a [usize],
    pub measured: Duration,
    pub fsync_per_sec: f64,
}

/// Starts the TLS cluster and banks, measures, stops them.
pub async fn run(env: Env<'_>) -> anyhow::Result<Vec<TransferPoint>> {
    let dir = env.dir.join("tls");
    let pki = DevPki::create(&dir.join("pki"), "dtx bench authority")?;
    let plans = ProcessCluster::plan_local("127.0.0.1", 3)?;
    let mut cluster = ProcessCluster::new(env.bin, &dir.join("cluster"), "dtx-bench-tls", plans, |c| {
        pki.apply_node(c).expect("a node certificate");
    })?;
    cluster.client_tls = Some(pki.client(&pki.issue(Role::Operator, "bench", &[])?)?);
    cluster.start_all()?;
    let leader = cluster
        .leader_within(Duration::from_secs(30))
        .await
        .context("the TLS cluster")?;
    let leader_api = cluster.node(leader).plan.api_listen.clone();
    let api = cluster.api_addrs();
    let mut banks = Vec::new();
    for (id, prefix) in [("bank-a", "a"), ("bank-b", "b")] {
        let flags = |addr: &str| {
            pki.issue(Role::Participant, id, &[addr])
                .map(|f| pki.args(&f).to_flags())
                .expect("a bank certificate")
        };
        banks.push(dtx_testkit::cluster::start_bank_with(
            env.bin, &dir, id, prefix, &api, 10_000, 1_000_000, flags,
        )?);
    }
    for b in &banks {
        b.wait_started().await?;
    }
    println!("TLS cluster up; leader node {leader} at {leader_api}; banks with mutual TLS");
    let (bank_list, meter) = crate::closed_loop::banks_and_meter(&banks, &cluster.nodes);
    let app = pki.client(&pki.issue(Role::Application, "bench", &[])?)?;
    let watch = crate::leader_watch::LeaderWatch::new(api.clone(), cluster.client_tls.clone());
    let rows = crate::closed_loop::measure_transfers(
        &watch,
        Some(&app),
        bank_list,
        &meter,
        env.counts,
        Duration::ZERO,
        env.measured,
        1,
        env.fsync_per_sec,
        "transfers over TLS",
        "xfer-tls",
    )
    .await;
    for b in banks.iter_mut() {
        b.stop(Duration::from_secs(5));
    }
    cluster.stop_all(Duration::from_secs(10));
    Ok(rows)
}

/// The table of the TLS transfers beside the plain-text ones.
pub fn results_text(plain: &[TransferPoint], tls: &[TransferPoint]) -> String {
    let mut t = crate::report::beside_text(
        "transfers with mutual TLS on every link beside plain text (same run; a second cluster and banks, \
         the plain-text one stopped; CPU = all processes per committed transfer)",
        ("plain", plain),
        ("TLS", tls),
    );
    let unknown: u64 = tls.iter().map(|s| s.unknown).sum();
    t.push_str(&format!("\nUNKNOWN outcomes over TLS: {unknown}\n"));
    t
}

/// The same as JSON.
pub fn json(plain: &[TransferPoint], tls: &[TransferPoint]) -> serde_json::Value {
    crate::report::beside_json(plain, tls, "tls_over_plain")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::stats;

    fn point(clients: usize, per_s_ops: u64, cpu_us: u64) -> TransferPoint {
        TransferPoint {
            clients,
            stats: stats((1..=per_s_ops).collect(), Duration::from_secs(1)),
            aborted: 0,
            unknown: 0,
            cpu_us_per_committed_transfer: cpu_us,
            cpu_split: None,
            leader_change: None,
            leader_work: None,
        }
    }

    #[test]
    fn the_table_puts_each_tls_level_beside_its_plain_one() {
        let plain = [point(1, 100, 500), point(16, 1000, 400)];
        let tls = [point(1, 80, 600), point(16, 900, 500)];
        let t = results_text(&plain, &tls);
        assert!(t.contains("| 1 | 100 | 80 | 0.80 |"), "{t}");
        assert!(t.contains("| 16 | 1000 | 900 | 0.90 |"), "{t}");
        assert!(t.contains("| 0.60 ms | 1.20 |"), "{t}");
        let j = json(&plain, &tls);
        assert_eq!(j[1]["throughput_tls_over_plain"], 0.9);
        assert_eq!(crate::report::ratio(1.0, 0.0), None);
    }
}
