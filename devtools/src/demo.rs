//! `dtx-dev demo`, the main job: a three-node coordinator cluster and two
//! bank participant services, all real processes; clients transfer money
//! between the banks under two-phase commit while the leader is killed with
//! SIGKILL every few seconds. It prints live progress and ends with a summary
//! and an audit: the total of all balances must be unchanged, no account
//! locked, no transaction in doubt, and no transaction committed at one bank
//! but not at the other. It exits non-zero if the audit fails.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

use participant_sdk::log::LocalState;

use dtx_client::Client;
use dtx_client::ClientConfig;
use dtx_client::ClientError;
use dtx_client::TxOutcome;
use dtx_testkit::cluster::ProcessCluster;
use dtx_testkit::pki::DevPki;
use dtx_tls::Role;

use crate::demo_kit::decision_eventually;
use crate::demo_kit::Counts;
use crate::demo_kit::DemoArgs;
use crate::demo_kit::LeaderKills;

pub async fn run(a: DemoArgs, shutdown: impl std::future::Future<Output = ()>) -> anyhow::Result<()> {
    let (dir, bin) = crate::demo_kit::fresh_workdir(&a.dir)?;
    let plans = ProcessCluster::plan_local("127.0.0.1", 3)?;
    let pki = if a.tls {
        Some(DevPki::create(&dir.join("tls"), "dtx demo authority")?)
    } else {
        None
    };
    let mut cluster = ProcessCluster::new(&bin, &dir.join("cluster"), "dtx-demo", plans, |c| {
        if let Some(p) = &pki {
            p.apply_node(c).expect("a node certificate");
        }
    })?;
    // The clients' identities: an application for transfers, an operator
    // for the supervisor's status calls.
    let (app_tls, operator_tls) = match &pki {
        Some(p) => (
            Some(p.client(&p.issue(Role::Application, "demo", &[])?)?),
            Some(p.client(&p.issue(Role::Operator, "demo-supervisor", &[])?)?),
        ),
        None => (None, None),
    };
    cluster.client_tls = operator_tls;
    cluster.start_all()?;
    let api = cluster.api_addrs();
    let mut banks_procs = Vec::new();
    for (id, prefix) in [("bank-a", "a"), ("bank-b", "b")] {
        let flags = |addr: &str| match &pki {
            Some(p) => p
                .issue(Role::Participant, id, &[addr])
                .map(|f| p.args(&f).to_flags())
                .expect("a bank certificate"),
            None => Vec::new(),
        };
        banks_procs.push(dtx_testkit::cluster::start_bank_with(
            &bin, &dir, id, prefix, &api, a.accounts, a.initial, flags,
        )?);
    }
    println!(
        "dtx demo: 3 coordinator nodes, 2 bank services, {} clients, {} s{}",
        a.clients,
        a.seconds,
        if a.tls { ", mutual TLS on every link" } else { "" }
    );
    println!("  working directory: {}", dir.display());
    let mut leader = cluster.leader_within(Duration::from_secs(30)).await?;
    for b in &banks_procs {
        b.wait_started().await?;
    }
    println!(
        "  leader: node {leader}; banks: bank-a {} / bank-b {}",
        banks_procs[0].addr, banks_procs[1].addr
    );
    let expected_total = 2 * a.accounts as i64 * a.initial;
    let banks: Arc<Vec<(String, String, String)>> = Arc::new(banks_procs.iter().map(|b| b.spec()).collect());

    let counts = Arc::new(Counts::default());
    let unknown: Arc<std::sync::Mutex<Vec<u64>>> = Arc::default();
    let told: Arc<std::sync::Mutex<BTreeMap<u64, TxOutcome>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..a.clients {
        let (counts, unknown, told, stop, banks, api) = (
            counts.clone(),
            unknown.clone(),
            told.clone(),
            stop.clone(),
            banks.clone(),
            api.clone(),
        );
        let app_tls = app_tls.clone();
        let accounts = a.accounts;
        workers.push(tokio::spawn(async move {
            let mut cfg = ClientConfig::new(api);
            cfg.call_deadline = Duration::from_secs(8);
            cfg.tls = app_tls;
            let client = Client::new(cfg).expect("client");
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let key = format!("demo-{w}-{i}");
                i += 1;
                let (txid, res) = dtx_bank::transfer(&client, &key, &banks, accounts).await;
                match (txid, res) {
                    (Some(t), Ok(TxOutcome::Committed)) => {
                        counts.committed.fetch_add(1, Ordering::Relaxed);
                        told.lock().expect("lock").insert(t, TxOutcome::Committed);
                    }
                    (Some(t), Ok(TxOutcome::Aborted)) => {
                        counts.aborted.fetch_add(1, Ordering::Relaxed);
                        told.lock().expect("lock").insert(t, TxOutcome::Aborted);
                    }
                    (Some(t), Ok(TxOutcome::Unknown)) | (Some(t), Err(ClientError::Unknown(_))) => {
                        counts.unknown.fetch_add(1, Ordering::Relaxed);
                        unknown.lock().expect("lock").push(t);
                    }
                    // Still no txid: unknown to the client; the audit at
                    // both banks still covers it.
                    (None, Ok(TxOutcome::Unknown)) | (None, Err(ClientError::Unknown(_))) => {
                        counts.unknown.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {
                        counts.failed_to_start.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }

    let started = Instant::now();
    let mut kills = LeaderKills::new(a.kill_every_secs);
    while started.elapsed() < Duration::from_secs(a.seconds) {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let t = started.elapsed().as_secs();
        kills.tick(&mut cluster, t).await?;
        if let Some(l) = cluster.current_leader().await {
            leader = l;
        }
        println!("{}", counts.progress(t, leader));
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.await;
    }
    kills.finish(&mut cluster).await?;
    let kills = kills.kills;

    // Unknown outcomes are asked again: they have a decision by now (or the
    // reaper records ABORT at their deadline).
    let mut check = ClientConfig::new(api.clone());
    check.tls = app_tls.clone();
    let check = Client::new(check)?;
    let mut resolved_unknown = BTreeMap::new();
    let unknown_txids: Vec<u64> = unknown.lock().expect("lock").clone();
    for t in unknown_txids {
        if let Some(committed) = decision_eventually(&check, t).await {
            resolved_unknown.insert(t, if committed { "COMMIT" } else { "ABORT" });
        }
    }

    if a.keep_serving {
        println!("transfers stopped; everything keeps serving until Ctrl-C");
        println!("  coordinator API: {}", api.join(","));
        shutdown.await;
    }

    // Stop the banks and audit their stores; whatever phase two did not
    // deliver yet is learned by recovery, as a restarted service would.
    let mut banks_procs = banks_procs;
    let mut in_doubt_left = 0;
    let mut totals = Vec::new();
    let mut per_bank: Vec<BTreeMap<u64, LocalState>> = Vec::new();
    for b in banks_procs.iter_mut() {
        b.stop(Duration::from_secs(5));
    }
    // Recovery asks as the bank would (its certificate, when TLS is on).
    let mut recovery = Vec::new();
    for b in &banks_procs {
        let mut opts = participant_sdk::server::RecoveryOptions::default();
        if let Some(p) = &pki {
            opts.tls = p.client(&p.issue(Role::Participant, &b.id, &[])?).map(Some)?;
        }
        recovery.push(opts);
    }
    for (b, opts) in banks_procs.iter().zip(&recovery) {
        let store = dtx_bank::open_bank(&b.data_dir, &b.prefix, a.accounts, a.initial).await?;
        // Anything still in doubt asks the cluster, as a restarted service does.
        for _ in 0..40 {
            if store.in_doubt()?.is_empty() {
                break;
            }
            let _ = participant_sdk::server::recover_with(&store, &api, Duration::ZERO, opts).await;
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        in_doubt_left += store.in_doubt()?.len();
        totals.push(dtx_bank::audit(&store)?);
        per_bank.push(store.entries()?.into_iter().map(|(t, e)| (t.txid, e.state)).collect());
    }
    cluster.stop_all(Duration::from_secs(10));

    let mut split = Vec::new();
    let mut lost_commit = Vec::new();
    let all_txids: std::collections::BTreeSet<u64> = per_bank.iter().flat_map(|m| m.keys().copied()).collect();
    for t in all_txids {
        let c0 = per_bank[0].get(&t) == Some(&LocalState::Committed);
        let c1 = per_bank[1].get(&t) == Some(&LocalState::Committed);
        if c0 != c1 {
            split.push(t);
        }
    }
    for (t, o) in told.lock().expect("lock").iter() {
        if *o == TxOutcome::Committed && per_bank.iter().any(|m| m.get(t) != Some(&LocalState::Committed)) {
            lost_commit.push(*t);
        }
    }
    let total: i64 = totals.iter().map(|(t, _, _)| t).sum();
    let locked: usize = totals.iter().map(|(_, _, l)| l).sum();
    println!();
    println!("summary after {} s, {kills} leader kill(s):", a.seconds);
    println!(
        "  committed                 {}",
        counts.committed.load(Ordering::Relaxed)
    );
    println!("  aborted                   {}", counts.aborted.load(Ordering::Relaxed));
    println!(
        "  unknown to the client     {} (later: {} COMMIT, {} ABORT)",
        counts.unknown.load(Ordering::Relaxed),
        resolved_unknown.values().filter(|v| **v == "COMMIT").count(),
        resolved_unknown.values().filter(|v| **v == "ABORT").count()
    );
    println!(
        "  not started (begin/enlist refused or timed out) {}",
        counts.failed_to_start.load(Ordering::Relaxed)
    );
    println!("  in doubt at the end       {in_doubt_left}");
    println!("  accounts still locked     {locked}");
    println!("  split outcomes            {}", split.len());
    println!("  acknowledged COMMIT not applied everywhere {}", lost_commit.len());
    println!("  audit: total {total}, expected {expected_total}");
    let ok = total == expected_total && in_doubt_left == 0 && locked == 0 && split.is_empty() && lost_commit.is_empty();
    if ok {
        println!("audit: OK");
        Ok(())
    } else {
        println!("audit: FAILED (split {split:?}, lost {lost_commit:?})");
        anyhow::bail!("the audit failed; logs and data are in {}", dir.display())
    }
}
