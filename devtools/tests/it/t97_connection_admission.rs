//! What a caller who never authenticates costs a node (invariant 12: bounded
//! memory, connections and log; docs/adr/0036-connection-admission.md), with
//! real node processes.
//!
//! - `t97_inv12_silent_tls_connections_are_closed_and_callers_with_a_certificate_are_served`:
//!   300 connections from one address finish their TLS handshake on a
//!   node's API port (client certificates optional, as with tokens) and
//!   then say nothing. While they are held, callers with a certificate are
//!   served; every one of the 300 is closed by the node within the HTTP/2
//!   preface deadline (10 s) plus slack. Before, they stayed open for good.
//! - `t97_inv12_out_of_file_descriptors_the_node_backs_off_and_recovers`:
//!   on a TLS cluster, the leader's file limit is lowered to 32 above what
//!   it holds (`prlimit`), and 400 TCP
//!   connections that say nothing are opened to its API port, so `accept`
//!   fails with EMFILE. The node logs that at most a few times (it waits
//!   between failing accepts; before, it retried at once and wrote
//!   hundreds of thousands of lines a second), and once the connections
//!   are gone it serves calls again.

use crate::common;

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use common::TestCluster;
use dtx_client::Client;
use dtx_client::ClientConfig;
use dtx_testkit::pki::DevPki;
use dtx_tls::Role;
use tokio::io::AsyncReadExt;

/// The attacker's own loopback address, so its connections count against
/// its address and not the test's callers' (a real attacker is elsewhere).
const ATTACKER_IP: &str = "127.0.0.99";
const SILENT_CONNECTIONS: usize = 300;

fn host_port(addr: &str) -> (String, u16) {
    let (h, p) = addr.rsplit_once(':').unwrap();
    (h.to_string(), p.parse().unwrap())
}

/// A three-node TLS cluster (client certificates `client_auth` on the API
/// port) and a client with an application certificate.
fn tls_cluster(name: &str, dir: &std::path::Path, client_auth: &str) -> (TestCluster, Arc<DevPki>, Client) {
    let pki = Arc::new(DevPki::create(&dir.join("pki"), "t97 authority").unwrap());
    let p = pki.clone();
    let auth = client_auth.to_string();
    let mut c = TestCluster::start_with(name, 3, move |cfg| {
        p.apply_node(cfg).expect("node certificate");
        cfg.tls.client_auth = auth.clone();
    });
    let operator = pki.issue(Role::Operator, "supervisor", &[]).unwrap();
    c.procs.client_tls = Some(pki.client(&operator).unwrap());
    let app = pki.issue(Role::Application, "shop", &[]).unwrap();
    let mut cfg = ClientConfig::new(c.procs.api_addrs());
    cfg.tls = Some(pki.client(&app).unwrap());
    cfg.call_deadline = Duration::from_secs(5);
    (c, pki, Client::new(cfg).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t97_inv12_silent_tls_connections_are_closed_and_callers_with_a_certificate_are_served() {
    let dir = common::test_dir();
    let (mut c, pki, client) = tls_cluster("t97", dir.path(), "optional");
    let leader = c.leader().await;
    let (host, port) = host_port(&c.api(leader));

    // A caller that trusts the authority but has no certificate of its own.
    let anonymous = dtx_tls::args::TlsArgs {
        tls_ca: Some(pki.ca.clone()),
        ..Default::default()
    }
    .client()
    .unwrap()
    .unwrap();
    let attacker_ip: IpAddr = ATTACKER_IP.parse().unwrap();
    let opened_at = tokio::time::Instant::now();
    let mut held = Vec::new();
    for _ in 0..SILENT_CONNECTIONS {
        let s = tokio::time::timeout(
            Duration::from_secs(5),
            dtx_tls::client::connect_tls(&anonymous, &host, port, Some(attacker_ip)),
        )
        .await
        .expect("a TLS handshake within 5 s")
        .expect("the TLS handshake (no client certificate: allowed on this port)");
        held.push(s);
    }

    // While they are held, callers with a certificate are served.
    let t = client
        .begin("t97-served", 10_000, b"")
        .await
        .expect("a caller with a certificate is served while 300 silent connections are held")
        .txid;
    client.abort(t, "t97").await.unwrap();

    // Every silent connection is closed by the node: a read ends (EOF or
    // an error) instead of waiting.
    let deadline = Duration::from_secs(10) + Duration::from_secs(10);
    let mut still_open = 0;
    let reads = held.into_iter().map(|mut s| async move {
        let mut buf = [0u8; 64];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return true,
                // The server's HTTP/2 settings would come only after a
                // preface; anything read is read past.
                Ok(_) => continue,
            }
        }
    });
    let closed = tokio::time::timeout_at(opened_at + deadline, futures::future::join_all(reads)).await;
    match closed {
        Ok(all) => still_open += all.iter().filter(|c| !**c).count(),
        Err(_) => still_open = SILENT_CONNECTIONS,
    }
    assert_eq!(
        still_open, 0,
        "silent connections still open {deadline:?} after they were opened"
    );
    // And the node still serves.
    let t = client.begin("t97-after", 10_000, b"").await.unwrap().txid;
    client.abort(t, "t97").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t97_inv12_out_of_file_descriptors_the_node_backs_off_and_recovers() {
    let dir = common::test_dir();
    let (mut c, _pki, cl) = tls_cluster("t97b", dir.path(), "required");
    let leader = c.leader().await;
    let pid = c.procs.node(leader).pid().expect("the leader runs");
    // A few dozen descriptors above what it holds now: its own files and
    // peer connections keep working; callers' connections run out.
    let open_now = std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count();
    let limit = open_now + 32;
    let o = std::process::Command::new("prlimit")
        .args(["--pid", &pid.to_string(), &format!("--nofile={limit}:{limit}")])
        .output()
        .expect("prlimit (util-linux)");
    assert!(o.status.success(), "{}", common::output_text(&o));
    let log_path = c.procs.node(leader).log_path.clone();
    let accept_lines = || {
        std::fs::read_to_string(&log_path)
            .unwrap_or_default()
            .matches("accepting a connection failed")
            .count()
    };
    let before = accept_lines();

    let addr: std::net::SocketAddr = c.api(leader).parse().unwrap();
    let attacker_ip: IpAddr = ATTACKER_IP.parse().unwrap();
    let started = tokio::time::Instant::now();
    // All at once: the kernel completes connections into the listen
    // backlog even when the node cannot accept them; beyond the backlog a
    // connect waits, and is given up after a second.
    let connects = (0..400).map(|_| async move {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind((attacker_ip, 0).into()).unwrap();
        tokio::time::timeout(Duration::from_secs(1), sock.connect(addr))
            .await
            .ok()
            .and_then(|r| r.ok())
    });
    let held: Vec<tokio::net::TcpStream> = futures::future::join_all(connects)
        .await
        .into_iter()
        .flatten()
        .collect();
    assert!(held.len() > 32, "only {} connections opened", held.len());
    // Let the node run into the file limit for a few seconds.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let logged = accept_lines() - before;
    // One line per 10 s, and one more for a line written as the clock
    // turned.
    let allowed = 2 + (started.elapsed().as_secs() / 10) as usize;
    assert!(
        (1..=allowed).contains(&logged),
        "{logged} log lines about failing accepts in {:?} (want one per 10 s, and at least one: the limit was reached):\n{}",
        started.elapsed(),
        std::fs::read_to_string(&log_path)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("accepting a connection failed"))
            .take(10)
            .collect::<Vec<_>>()
            .join("\n")
    );
    drop(held);
    // Once the silent connections are gone (closed by the caller here, or
    // by the handshake deadline), the node serves again.
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match cl.begin("t97b-after", 10_000, b"").await {
            Ok(b) => {
                cl.abort(b.txid, "t97").await.unwrap();
                break;
            }
            Err(e) => {
                assert!(
                    tokio::time::Instant::now() < until,
                    "the node does not serve again: {e}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    assert!(
        accept_lines() - before <= 5,
        "the log kept growing: {} lines",
        accept_lines() - before
    );
}
