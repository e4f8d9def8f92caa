//! TLS, identities and roles on every link (ADR 0016), with real processes:
//! three `coordinator serve` nodes and two `bank-serve` participants, all on
//! TLS with certificates from a throwaway authority made by the test
//! (`dtx_testkit::pki`), and callers built here with other identities, no
//! certificate, a certificate from another authority, an expired certificate,
//! or a token.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::TestCluster;
use dtx_client::Client;
use dtx_client::ClientConfig;
use dtx_client::ClientError;
use dtx_client::TxOutcome;
use dtx_proto::v1 as pb;
use dtx_testkit::cluster::BankProcess;
use dtx_testkit::pki::DevPki;
use dtx_tls::dev::Lifetime;
use dtx_tls::files::KeyPairFiles;
use dtx_tls::ClientTls;
use dtx_tls::Role;

const ACCOUNTS: usize = 10;
const INITIAL: i64 = 1_000;

/// Token settings: an application token (`shop`) and an operator token
/// (`ops`, for the supervisor's status calls). Returns the config tweak
/// and both tokens.
fn token_settings() -> (impl Fn(&mut coordinator::config::Config) + Clone, String, String) {
    let app = dtx_tls::identity::new_token();
    let ops = dtx_tls::identity::new_token();
    let (app_hash, ops_hash) = (
        dtx_tls::identity::token_sha256_hex(&app),
        dtx_tls::identity::token_sha256_hex(&ops),
    );
    let tweak = move |cfg: &mut coordinator::config::Config| {
        cfg.auth.tokens = vec![
            coordinator::config::TokenConfig {
                role: "application".into(),
                name: "shop".into(),
                sha256: app_hash.clone(),
            },
            coordinator::config::TokenConfig {
                role: "operator".into(),
                name: "ops".into(),
                sha256: ops_hash.clone(),
            },
        ];
    };
    (tweak, app, ops)
}

/// [`common::tls::tls_cluster`] whose nodes re-read their certificate
/// files every 500 ms (the reload tests replace them).
fn tls_cluster(
    name: &str,
    pki: &Arc<DevPki>,
    client_auth: &str,
    tune: impl Fn(&mut coordinator::config::Config),
) -> TestCluster {
    common::tls::tls_cluster(name, pki, client_auth, move |cfg| {
        cfg.tls.reload_interval_ms = 500;
        tune(cfg);
    })
}

fn client_with(c: &TestCluster, tls: Option<Arc<ClientTls>>, token: Option<String>) -> Client {
    common::tls::client_with(c.procs.api_addrs(), tls, token)
}

/// One raw call on each of the three kinds of port, with `tls`: the API
/// (GetDecision), Raft (Probe) and a participant (Inquire). Each result is
/// the call's status message, or "ok".
async fn every_port(api: &str, raft: &str, participant: &str, tls: &Arc<ClientTls>) -> Vec<(&'static str, String)> {
    let t = Duration::from_secs(3);
    let ch = |addr: &str| dtx_transport::channel::channel_with(addr, None, t, Some(tls)).unwrap();
    let show = |r: Result<(), tonic::Status>| match r {
        Ok(()) => "ok".to_string(),
        Err(s) => format!("{:?}: {}", s.code(), dtx_client::describe(&s)),
    };
    let a = pb::coordinator_client::CoordinatorClient::new(ch(api))
        .get_decision(pb::GetDecisionRequest {
            txid: 1,
            incarnation: 0,
        })
        .await
        .map(|_| ());
    let r = pb::raft_transport_client::RaftTransportClient::new(ch(raft))
        .probe(pb::ProbeRequest {})
        .await
        .map(|_| ());
    let p = pb::participant_service_client::ParticipantServiceClient::new(ch(participant))
        .inquire(pb::InquireRequest::default())
        .await
        .map(|_| ());
    vec![("api", show(a)), ("raft", show(r)), ("participant", show(p))]
}

/// Five transfers between `banks` by `client` (keys `<prefix>-<i>`); each
/// must get an answer with a txid. Returns how many committed.
async fn committed_of_five(client: &Client, prefix: &str, banks: &[(String, String, String)]) -> usize {
    let mut committed = 0;
    for i in 0..5 {
        let (txid, res) = dtx_bank::transfer(client, &format!("{prefix}-{i}"), banks, ACCOUNTS).await;
        assert!(txid.is_some(), "transfer {i}: {res:?}");
        if res.unwrap() == TxOutcome::Committed {
            committed += 1;
        }
    }
    committed
}

fn start_bank(c: &TestCluster, pki: &DevPki, id: &str, prefix: &str) -> BankProcess {
    let ip = "127.0.0.1";
    let port = dtx_testkit::cluster::free_port(ip).unwrap();
    let addr = format!("{ip}:{port}");
    let own = pki.issue(Role::Participant, id, &[&addr]).unwrap();
    let mut b = BankProcess::new(
        common::bin(),
        c.dir.path(),
        id,
        prefix,
        ip,
        port,
        c.procs.api_addrs(),
        ACCOUNTS,
        INITIAL,
    );
    b.service.add_args(pki.args(&own).to_flags());
    b.start(&[]).unwrap();
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t95_mutual_tls_admits_the_cluster_and_refuses_strangers_on_every_port() {
    let dir = common::test_dir();
    let pki = Arc::new(DevPki::create(&dir.path().join("pki"), "t95 authority").unwrap());
    let mut c = tls_cluster("t95a", &pki, "required", |_| {});
    // A leader over TLS: the nodes admit each other's certificates.
    let leader = c.leader().await;
    let a = start_bank(&c, &pki, "bank-a", "a");
    let b = start_bank(&c, &pki, "bank-b", "b");
    a.wait_started().await.unwrap();
    b.wait_started().await.unwrap();
    let banks: Vec<(String, String, String)> = [&a, &b].iter().map(|b| b.spec()).collect();

    // An application with its certificate runs transfers end to end: the
    // leader reaches both banks over TLS with its node certificate.
    let app_files = pki.issue(Role::Application, "shop", &[]).unwrap();
    let app = client_with(&c, Some(pki.client(&app_files).unwrap()), None);
    assert!(
        committed_of_five(&app, "t95", &banks).await >= 1,
        "no transfer committed over TLS"
    );

    let leader_node = &c.procs.nodes[(leader - 1) as usize];
    let (api, raft) = (
        leader_node.plan.api_listen.clone(),
        leader_node.plan.raft_listen.clone(),
    );

    // No client certificate: refused by the handshake on every port.
    let anonymous = dtx_tls::args::TlsArgs {
        tls_ca: Some(pki.ca.clone()),
        ..Default::default()
    }
    .client()
    .unwrap()
    .unwrap();
    for (port, got) in every_port(&api, &raft, &a.addr, &anonymous).await {
        assert!(
            got.starts_with("Unauthenticated") && got.contains("no client certificate"),
            "{port}, no certificate: {got}"
        );
    }

    // A certificate from another authority (the client trusts ours, so only
    // the servers can refuse): refused on every port.
    let other = DevPki::create(&dir.path().join("other"), "another authority").unwrap();
    let stranger = other.issue(Role::Operator, "mallory", &[]).unwrap();
    let stranger_tls = ClientTls::load(dtx_tls::client::ClientTlsFiles {
        ca: pki.ca.clone(),
        own: Some(stranger),
        server_name: None,
    })
    .unwrap();
    for (port, got) in every_port(&api, &raft, &a.addr, &stranger_tls).await {
        assert!(
            got.starts_with("Unauthenticated") && got.contains("not from this server's certificate authority"),
            "{port}, another authority: {got}"
        );
    }

    // An expired certificate from our authority: refused, and the message
    // says it expired.
    let old = pki
        .issue_for(Role::Operator, "expired", &[], Lifetime::Expired)
        .unwrap();
    let expired_tls = ClientTls::load(dtx_tls::client::ClientTlsFiles {
        ca: pki.ca.clone(),
        own: Some(old.clone()),
        server_name: None,
    });
    // Our own loader refuses it first, naming the file.
    let e = expired_tls.unwrap_err().to_string();
    assert!(e.contains("expired at") && e.contains("operator-expired.pem"), "{e}");
    // A client that sends it anyway is refused by the server, which says why.
    let raw = raw_client_tls(&pki.ca, &old);
    for (port, got) in every_port(&api, &raft, &a.addr, &raw).await {
        assert!(
            got.starts_with("Unauthenticated") && got.contains("certificate expired"),
            "{port}, expired: {got}"
        );
    }
    // Each server logged why too: the leader (its API and Raft ports) and
    // the participant.
    let leader_log = std::fs::read_to_string(&leader_node.log_path).unwrap();
    let bank_log = std::fs::read_to_string(&a.log_path).unwrap();
    for why in ["UnknownIssuer", "certificate expired"] {
        for (who, log) in [("leader", &leader_log), ("bank-a", &bank_log)] {
            assert!(
                log.lines()
                    .any(|l| l.contains("client certificate refused") && l.contains(why)),
                "{who}'s log does not say {why:?}"
            );
        }
    }

    // Roles: an application may not call admin methods or resolve.
    match app.cluster_status().await {
        Err(ClientError::PermissionDenied(m)) => assert!(m.contains("application/shop"), "{m}"),
        other => panic!("application on ClusterStatus: {other:?}"),
    }
    match app.resolve(1, false, &[], "shop", "trying").await {
        Err(ClientError::PermissionDenied(m)) => assert!(m.contains("Resolve"), "{m}"),
        other => panic!("application on Resolve: {other:?}"),
    }
    // A participant may read decisions but not begin.
    let bank_files = pki.issue(Role::Participant, "bank-z", &[]).unwrap();
    let as_bank = client_with(&c, Some(pki.client(&bank_files).unwrap()), None);
    as_bank.decisions(&[1]).await.expect("a participant reads decisions");
    match as_bank.begin("t95-bank-begins", 10_000, b"").await {
        Err(ClientError::PermissionDenied(_)) => {}
        other => panic!("participant on Begin: {other:?}"),
    }

    // A participant refuses a Commit (and a Prepare) from anyone but the
    // cluster's nodes, before its store sees it.
    for who in [Role::Application, Role::Operator, Role::Participant] {
        let f = pki.issue(who, "caller", &[]).unwrap();
        let ch =
            dtx_transport::channel::channel_with(&a.addr, None, Duration::from_secs(3), Some(&pki.client(&f).unwrap()))
                .unwrap();
        let mut p = pb::participant_service_client::ParticipantServiceClient::new(ch);
        let s = p
            .commit(pb::ParticipantDecisionRequest {
                txid: 424242,
                participant_id: "bank-a".into(),
                term: 1,
                incarnation: 0,
            })
            .await
            .unwrap_err();
        assert_eq!(s.code(), tonic::Code::PermissionDenied, "{who}: {s:?}");
        let s = p
            .prepare(pb::PrepareRequest {
                txid: 424242,
                term: 1,
                participant_id: "bank-a".into(),
                payload: b"a0:-1".to_vec(),
                incarnation: 0,
            })
            .await
            .unwrap_err();
        assert_eq!(s.code(), tonic::Code::PermissionDenied, "{who}: {s:?}");
    }
    // Every refusal above was counted on the participant.
    let log = std::fs::read_to_string(&a.log_path).unwrap();
    assert!(log.contains("call refused"), "the participant logs refusals");
}

/// A client config that sends `own` without checking it first (our
/// loader refuses expired certificates; a stranger's client would not).
fn raw_client_tls(ca: &std::path::Path, own: &KeyPairFiles) -> Arc<ClientTls> {
    dtx_tls::client::ClientTls::load_without_own_validity_check(dtx_tls::client::ClientTlsFiles {
        ca: ca.to_path_buf(),
        own: Some(own.clone()),
        server_name: None,
    })
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t95_bad_certificates_stop_a_node_at_start_with_the_reason() {
    let dir = common::test_dir();
    let pki = DevPki::create(&dir.path().join("pki"), "t95 authority").unwrap();
    // The expired pair first, moved aside, so node-1's files then hold a
    // valid pair.
    let issued = pki.issue_for(Role::Node, "1", &[], Lifetime::Expired).unwrap();
    let expired = KeyPairFiles {
        cert: dir.path().join("expired-node-1.pem"),
        key: dir.path().join("expired-node-1.key"),
    };
    std::fs::rename(&issued.cert, &expired.cert).unwrap();
    std::fs::rename(&issued.key, &expired.key).unwrap();
    let node = pki.issue(Role::Node, "1", &[]).unwrap();
    let other_node = pki.issue(Role::Node, "2", &[]).unwrap();
    let cases: Vec<(&str, KeyPairFiles, &str)> = vec![
        ("expired", expired, "expired at"),
        (
            "mismatched key",
            KeyPairFiles {
                cert: node.cert.clone(),
                key: other_node.key.clone(),
            },
            "does not match",
        ),
        (
            "another node's certificate",
            other_node.clone(),
            "names node/2, but this is node 1",
        ),
        (
            "missing file",
            KeyPairFiles {
                cert: dir.path().join("nope.pem"),
                key: node.key.clone(),
            },
            "nope.pem",
        ),
    ];
    for (what, files, expect) in cases {
        let ip = "127.0.0.1";
        let out = std::process::Command::new(common::bin())
            .args(["serve", "--node-id", "1"])
            .arg("--data-dir")
            .arg(dir.path().join(format!("data-{}", what.replace(' ', "-"))))
            .arg("--raft-addr")
            .arg(format!("{ip}:{}", dtx_testkit::cluster::free_port(ip).unwrap()))
            .arg("--api-addr")
            .arg(format!("{ip}:{}", dtx_testkit::cluster::free_port(ip).unwrap()))
            .arg("--tls-cert")
            .arg(&files.cert)
            .arg("--tls-key")
            .arg(&files.key)
            .arg("--tls-ca")
            .arg(&pki.ca)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{what}: the node started");
        assert!(err.contains(expect), "{what}: expected {expect:?} in:\n{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t95_a_node_with_another_authoritys_certificate_cannot_join() {
    let dir = common::test_dir();
    let pki = Arc::new(DevPki::create(&dir.path().join("pki"), "t95 authority").unwrap());
    let mut c = tls_cluster("t95c", &pki, "required", |_| {});
    c.leader().await;

    // Node 4 with a certificate from another authority (and trusting only
    // that one).
    let other = DevPki::create(&dir.path().join("other"), "another authority").unwrap();
    let ip = "127.0.0.1";
    let raft = format!("{ip}:{}", dtx_testkit::cluster::free_port(ip).unwrap());
    let api = format!("{ip}:{}", dtx_testkit::cluster::free_port(ip).unwrap());
    let n4 = other.issue(Role::Node, "4", &[]).unwrap();
    // A ServiceProcess: killed when dropped, also when an assertion below
    // fails (a node left running would hold its ports).
    let args: Vec<std::ffi::OsString> = [
        "serve",
        "--node-id",
        "4",
        "--cluster-id",
        "t95c",
        "--raft-addr",
        &raft,
        "--api-addr",
        &api,
    ]
    .iter()
    .map(Into::into)
    .chain([
        "--data-dir".into(),
        dir.path().join("node4").into_os_string(),
        "--tls-cert".into(),
        n4.cert.clone().into_os_string(),
        "--tls-key".into(),
        n4.key.clone().into_os_string(),
        "--tls-ca".into(),
        other.ca.clone().into_os_string(),
    ])
    .collect();
    let mut node4 = dtx_testkit::cluster::ServiceProcess::new(common::bin(), dir.path(), "node4", &api, args);
    node4.start(&[]).unwrap();
    assert!(
        dtx_testkit::cluster::wait_listening(&api, Duration::from_secs(10)).await,
        "node 4 did not start"
    );

    // The operator asks the cluster to add it as a voter: it is added as
    // a learner first, but the leader cannot reach it (each side refuses
    // the other's certificate), so it never catches up and is not made a
    // voter.
    let operator = pki.issue(Role::Operator, "alice", &[]).unwrap();
    let op_tls = pki.client(&operator).unwrap();
    let ch = dtx_transport::channel::channel_with(&c.procs.api_addrs()[0], None, Duration::from_secs(3), Some(&op_tls))
        .unwrap();
    let mut rq = tonic::Request::new(pb::AddNodeRequest {
        node_id: 4,
        raft_addr: raft.clone(),
        api_addr: api.clone(),
        voter: true,
    });
    rq.set_timeout(Duration::from_secs(8));
    let added = pb::admin_client::AdminClient::new(ch).add_node(rq).await;
    assert!(added.is_err(), "node 4 joined: {added:?}");

    // Node 4 never received the cluster's log: asked with its own
    // authority's operator certificate, it knows no leader and applied
    // nothing; and the cluster's voters are still 1, 2, 3.
    let other_op = other.issue(Role::Operator, "bob", &[]).unwrap();
    let s4 = dtx_client::cluster_status_with(&api, Duration::from_secs(3), Some(&other.client(&other_op).unwrap()))
        .await
        .unwrap();
    assert_eq!(s4.last_applied_index, 0, "node 4 applied cluster entries: {s4:?}");
    let s = dtx_client::cluster_status_with(&c.procs.api_addrs()[0], Duration::from_secs(3), Some(&op_tls))
        .await
        .unwrap();
    let voters: Vec<u64> = s.members.iter().filter(|m| m.voter).map(|m| m.node_id).collect();
    assert_eq!(voters, vec![1, 2, 3]);
    drop(node4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t95_tokens_authenticate_where_mutual_tls_is_off() {
    let dir = common::test_dir();
    let pki = Arc::new(DevPki::create(&dir.path().join("pki"), "t95 authority").unwrap());
    let (tokens, token, ops) = token_settings();

    // TLS with client certificates optional on the API port: a client with
    // only the authority and a token.
    let mut c = tls_cluster("t95d", &pki, "optional", tokens.clone());
    c.leader().await;
    let ca_only = dtx_tls::args::TlsArgs {
        tls_ca: Some(pki.ca.clone()),
        ..Default::default()
    }
    .client()
    .unwrap();
    let good = client_with(&c, ca_only.clone(), Some(token.clone()));
    let t = good.begin("t95d-1", 10_000, b"").await.expect("a token admits").txid;
    assert_eq!(good.abort(t, "test").await.unwrap(), TxOutcome::Aborted);
    let wrong = client_with(&c, ca_only.clone(), Some(dtx_tls::identity::new_token()));
    match wrong.begin("t95d-2", 10_000, b"").await {
        Err(ClientError::Unauthenticated(m)) => assert!(m.contains("token"), "{m}"),
        other => panic!("a wrong token: {other:?}"),
    }
    let none = client_with(&c, ca_only, None);
    match none.begin("t95d-3", 10_000, b"").await {
        Err(ClientError::Unauthenticated(m)) => assert!(m.contains("no client certificate and no bearer token"), "{m}"),
        other => panic!("no token: {other:?}"),
    }
    // The token's role counts: an application token cannot change membership.
    match good.cluster_status().await {
        Err(ClientError::PermissionDenied(m)) => assert!(m.contains("application/shop"), "{m}"),
        other => panic!("application token on ClusterStatus: {other:?}"),
    }
    drop(c);

    // Without TLS at all, tokens still authenticate (plain text: for
    // networks that are private already), participants included: the
    // nodes present auth.participant_token_file's token, the banks accept
    // only its hash.
    let node_token = dtx_tls::identity::new_token();
    let node_token_file = dir.path().join("participant.token");
    std::fs::write(&node_token_file, &node_token).unwrap();
    let ntf = node_token_file.clone();
    let mut plain = TestCluster::start_with("t95e", 3, move |cfg| {
        tokens(cfg);
        cfg.auth.participant_token_file = Some(ntf.clone());
    });
    plain.procs.client_token = Some(ops.clone());
    assert!(
        plain.procs.wait_for_leader(Duration::from_secs(20)).await.is_some(),
        "the supervisor, with the operator token, sees a leader"
    );
    let good = client_with(&plain, None, Some(token.clone()));
    good.begin("t95e-1", 10_000, b"")
        .await
        .expect("a token admits without TLS");
    let none = client_with(&plain, None, None);
    assert!(matches!(
        none.begin("t95e-2", 10_000, b"").await,
        Err(ClientError::Unauthenticated(_))
    ));

    let hash = dtx_tls::identity::token_sha256_hex(&node_token);
    let mut banks = Vec::new();
    for (id, prefix) in [("bank-a", "a"), ("bank-b", "b")] {
        let h = hash.clone();
        let b = dtx_testkit::cluster::start_bank_with(
            common::bin(),
            plain.dir.path(),
            id,
            prefix,
            &plain.procs.api_addrs(),
            ACCOUNTS,
            INITIAL,
            move |_| vec!["--accept-node-token-sha256".into(), h],
        )
        .unwrap();
        b.wait_started().await.unwrap();
        banks.push(b);
    }
    let spec: Vec<(String, String, String)> = banks.iter().map(|b| b.spec()).collect();
    assert!(
        committed_of_five(&good, "t95e-x", &spec).await >= 1,
        "no transfer committed with node tokens at the banks"
    );
    // A Commit without the nodes' token, or with an application's, is refused.
    let ch = dtx_transport::channel::channel(&banks[0].addr, None, Duration::from_secs(3)).unwrap();
    for (who, token) in [("no token", None), ("an application's token", Some(token.as_str()))] {
        let rq = dtx_client::request_with_token(
            pb::ParticipantDecisionRequest {
                txid: 424242,
                term: 1,
                participant_id: "bank-a".into(),
                incarnation: 0,
            },
            token,
        );
        let s = pb::participant_service_client::ParticipantServiceClient::new(ch.clone())
            .commit(rq)
            .await
            .unwrap_err();
        assert!(
            matches!(s.code(), tonic::Code::Unauthenticated | tonic::Code::PermissionDenied),
            "{who}: {s:?}"
        );
    }
}

async fn raw_call(addr: &str, path: &'static str, body: Vec<u8>, token: &str) -> Result<Vec<u8>, tonic::Status> {
    let ch = dtx_transport::channel::channel(addr, None, Duration::from_secs(3)).unwrap();
    let mut grpc = tonic::client::Grpc::new(ch).max_encoding_message_size(64 * 1024 * 1024);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let rq = dtx_client::request_with_token(body, Some(token));
    grpc.unary(
        rq,
        http::uri::PathAndQuery::from_static(path),
        common::raw_codec::RawCodec,
    )
    .await
    .map(|r| r.into_inner())
}

/// The edge: undecodable and oversized requests are INVALID_ARGUMENT (they
/// were INTERNAL, which a client must read as "may have been applied"),
/// marked not applied; an identity over its rate is RESOURCE_EXHAUSTED,
/// marked not applied, and the client waits and retries by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t95_the_edge_refuses_undecodable_oversized_and_too_frequent_calls_as_not_applied() {
    let (tokens, token, ops) = token_settings();
    let c = TestCluster::start_with("t95f", 3, move |cfg| {
        tokens(cfg);
        cfg.api.max_message_bytes = 256 * 1024;
        cfg.api.requests_per_s_per_identity = 1;
        cfg.api.request_burst_per_identity = 3;
    });
    // The leader, each node asked less than once a second (the operator's
    // own bucket, 1 call/s): the supervisor's usual polling (every 50 ms)
    // would be over this cluster's limit (a CI run failed so).
    let mut leader = None;
    for _ in 0..20 {
        for id in 1..=3 {
            if let Ok(s) = dtx_client::cluster_status_as(&c.api(id), Duration::from_millis(500), None, Some(&ops)).await
            {
                if s.role == "Leader" && s.leader_id == id {
                    leader = Some(id);
                }
            }
        }
        if leader.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1100)).await;
    }
    let api = c.api(leader.expect("a leader within 20 s"));

    // Bytes that are no BeginRequest.
    let s = raw_call(&api, "/dtx.v1.Coordinator/Begin", vec![0xFF; 16], &token)
        .await
        .unwrap_err();
    assert_eq!(s.code(), tonic::Code::InvalidArgument, "{s:?}");
    assert!(s.message().contains("not a valid message"), "{}", s.message());
    assert!(dtx_proto::metadata::not_applied(&s), "marked not applied: {s:?}");

    // A request larger than api.max_message_bytes (a valid message: one
    // long idempotency key).
    let big = prost::Message::encode_to_vec(&pb::BeginRequest {
        idempotency_key: "k".repeat(300 * 1024),
        timeout_ms: 1_000,
        description: Vec::new(),
    });
    let s = raw_call(&api, "/dtx.v1.Coordinator/Begin", big, &token)
        .await
        .unwrap_err();
    assert_eq!(s.code(), tonic::Code::InvalidArgument, "{s:?}");
    assert!(
        s.message().contains("larger than this server decodes"),
        "{}",
        s.message()
    );
    assert!(dtx_proto::metadata::not_applied(&s));

    // One call a second, bursts of three (two went to the calls above):
    // of twenty calls in a row, no more are admitted than the bucket
    // allows over the time they took, and the others are
    // RESOURCE_EXHAUSTED, each marked not applied. (Bounds from the time
    // measured, not assumed: on a slow machine more are admitted.)
    let read = prost::Message::encode_to_vec(&pb::GetDecisionRequest {
        txid: 1,
        incarnation: 0,
    });
    let mut limited = 0;
    let started = std::time::Instant::now();
    for _ in 0..20 {
        if let Err(s) = raw_call(&api, "/dtx.v1.Coordinator/GetDecision", read.clone(), &token).await {
            assert_eq!(s.code(), tonic::Code::ResourceExhausted, "{s:?}");
            assert!(
                s.message().contains("application/shop is over its limit"),
                "{}",
                s.message()
            );
            assert!(dtx_proto::metadata::not_applied(&s));
            limited += 1;
        }
    }
    let elapsed_s = started.elapsed().as_secs_f64();
    let admitted = 20 - limited;
    assert!(
        (admitted as f64) <= 1.0 + elapsed_s + 1.0,
        "{admitted} of 20 admitted in {elapsed_s:.1} s at 1 call/s with 1 left in the burst"
    );
    assert!(
        limited > 0 || elapsed_s > 15.0,
        "none of 20 calls in {elapsed_s:.1} s was limited"
    );
    // The client waits and asks again by itself: writes still succeed,
    // and none is UNKNOWN.
    let cl = client_with(&c, None, Some(token.clone()));
    for i in 0..4 {
        cl.begin(&format!("t95f-{i}"), 10_000, b"")
            .await
            .expect("the client retries a rate-limited call");
    }
}

/// An application acts on its own transactions only: another application's
/// certificate is PERMISSION_DENIED on Commit, Abort and Enlist of it, and on
/// a Begin or BeginAndCommit that reuses its idempotency key; asked through a
/// follower too (the follower names the caller to the leader). Reading
/// decisions stays open to every application. The owner survives a leader
/// change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t95_an_application_is_refused_on_another_applications_transaction() {
    let dir = common::test_dir();
    let pki = Arc::new(DevPki::create(&dir.path().join("pki"), "t95 authority").unwrap());
    let mut c = tls_cluster("t95g", &pki, "required", |_| {});
    let leader = c.leader().await;
    let as_app = |name: &str| {
        let f = pki.issue(Role::Application, name, &[]).unwrap();
        client_with(&c, Some(pki.client(&f).unwrap()), None)
    };
    let shop = as_app("shop");
    let other = as_app("billing");
    let t = shop.begin("t95g-1", 30_000, b"").await.unwrap().txid;

    let denied = |r: Result<_, ClientError>, what: &str| match r {
        Err(ClientError::PermissionDenied(m)) => {
            assert!(
                m.contains("belongs to application shop") && m.contains("billing"),
                "{what}: {m}"
            )
        }
        other => panic!("{what}: {other:?}"),
    };
    denied(other.commit(t).await.map(|_| ()), "commit");
    denied(other.abort(t, "not mine").await.map(|_| ()), "abort");
    denied(
        other.enlist(t, "bank-x", "127.0.0.1:1", b"").await.map(|_| ()),
        "enlist",
    );
    denied(
        other.begin("t95g-1", 30_000, b"").await.map(|_| ()),
        "begin with its key",
    );
    // Through a follower: the follower forwards on behalf of billing.
    let follower = c
        .procs
        .nodes
        .iter()
        .find(|n| n.plan.id != leader)
        .unwrap()
        .plan
        .api_listen
        .clone();
    let mut cfg = ClientConfig::new(vec![follower]);
    let f = pki.issue(Role::Application, "billing", &[]).unwrap();
    cfg.tls = Some(pki.client(&f).unwrap());
    let via_follower = Client::new(cfg).unwrap();
    denied(
        via_follower.abort(t, "not mine").await.map(|_| ()),
        "abort through a follower",
    );
    // Reading is open.
    other.decision(t).await.expect("any application reads decisions");

    // The owner is kept by the new leader.
    c.procs.kill9(leader);
    c.procs
        .wait_for_leader(Duration::from_secs(20))
        .await
        .expect("a new leader");
    denied(
        other.abort(t, "not mine").await.map(|_| ()),
        "abort after a leader change",
    );
    // The owner itself may.
    assert_eq!(shop.abort(t, "mine").await.unwrap(), TxOutcome::Aborted);
    // The decision records who aborted it, as authenticated.
    let st = shop.status(t).await.unwrap();
    let note = st.decision.map(|d| d.note).unwrap_or_default();
    assert_eq!(note, "application shop: mine");
}

/// Sagas are their application's: a saga's input and rights are its owner's,
/// so another application's certificate is PERMISSION_DENIED on GetSaga of it
/// and on a StartSaga that reuses its key, and its ListSagas pages hold only
/// its own sagas; an operator sees every saga. Asked through a follower too
/// (the follower names the caller to the leader).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t95_an_application_sees_and_starts_only_its_own_sagas() {
    use dtx_proto::v1::saga_service_client::SagaServiceClient;
    use dtx_transport::channel::Channel;

    let dir = common::test_dir();
    let pki = Arc::new(DevPki::create(&dir.path().join("pki"), "t95 authority").unwrap());
    let mut c = tls_cluster("t95h", &pki, "required", |_| {});
    let leader = c.leader().await;
    let api_of = |pick: &dyn Fn(u64) -> bool| {
        c.procs
            .nodes
            .iter()
            .find(|n| pick(n.plan.id))
            .unwrap()
            .plan
            .api_listen
            .clone()
    };
    let (leader_api, follower_api) = (api_of(&|id| id == leader), api_of(&|id| id != leader));
    let saga_client = |role: Role, name: &str, addr: &str| -> SagaServiceClient<Channel> {
        let tls = pki.client(&pki.issue(role, name, &[]).unwrap()).unwrap();
        SagaServiceClient::new(
            dtx_transport::channel::channel_with(addr, None, Duration::from_secs(2), Some(&tls)).unwrap(),
        )
    };
    let mut shop = saga_client(Role::Application, "shop", &leader_api);
    let mut billing = saga_client(Role::Application, "billing", &leader_api);
    let mut ops = saga_client(Role::Operator, "ops", &leader_api);
    let mut billing_via_follower = saga_client(Role::Application, "billing", &follower_api);

    // No step service answers at these addresses: the sagas only need to
    // exist (they park in time).
    let nowhere = "127.0.0.1:9";
    shop.register_definition(pb::RegisterSagaDefinitionRequest {
        definition: Some(dtx_saga_shop::order_saga_definition(nowhere, nowhere, nowhere)),
    })
    .await
    .expect("an application registers a definition");
    let start = |key: &str| pb::StartSagaRequest {
        definition: dtx_saga_shop::ORDER_SAGA.into(),
        version: dtx_saga_shop::ORDER_SAGA_VERSION,
        idempotency_key: key.into(),
        input: dtx_saga_shop::OrderInput {
            order: key.into(),
            sku: "sku-0".into(),
            qty: 1,
            customer: "c-0".into(),
            amount: 5,
        }
        .to_json(),
        authorization: None,
        deadline_ms: 0,
    };
    let mine = shop.start_saga(start("t95h-1")).await.unwrap().into_inner().saga_id;
    let theirs = billing.start_saga(start("t95h-2")).await.unwrap().into_inner().saga_id;

    let denied = |r: Result<(), tonic::Status>, what: &str| match r {
        Err(s) if s.code() == tonic::Code::PermissionDenied => assert!(
            s.message()
                .contains(&format!("saga {mine} belongs to application shop"))
                && s.message().contains("billing"),
            "{what}: {}",
            s.message()
        ),
        other => panic!("{what}: {other:?}"),
    };
    let get = |id| pb::GetSagaRequest { saga_id: id };
    denied(billing.get_saga(get(mine)).await.map(|_| ()), "get");
    denied(
        billing.start_saga(start("t95h-1")).await.map(|_| ()),
        "start with its key",
    );
    denied(
        billing_via_follower.get_saga(get(mine)).await.map(|_| ()),
        "get through a follower",
    );

    async fn listed(c: &mut SagaServiceClient<Channel>) -> Vec<u64> {
        let page = c
            .list_sagas(pb::ListSagasRequest {
                states: vec![],
                definition: String::new(),
                after_saga_id: 0,
                limit: 100,
            })
            .await
            .unwrap()
            .into_inner();
        page.sagas.iter().map(|s| s.saga_id).collect()
    }
    assert_eq!(listed(&mut shop).await, vec![mine]);
    assert_eq!(listed(&mut billing).await, vec![theirs]);
    assert_eq!(listed(&mut billing_via_follower).await, vec![theirs]);
    let mut all = listed(&mut ops).await;
    all.sort_unstable();
    let mut both = vec![mine, theirs];
    both.sort_unstable();
    assert_eq!(all, both, "an operator sees every saga");

    // Each application reads its own; an operator reads any.
    let own = shop.get_saga(get(mine)).await.unwrap().into_inner();
    assert_eq!(own.owner, "shop");
    assert_eq!(
        billing.get_saga(get(theirs)).await.unwrap().into_inner().owner,
        "billing"
    );
    assert_eq!(ops.get_saga(get(mine)).await.unwrap().into_inner().owner, "shop");

    // Acting on a saga: an application may cancel its own, and do nothing
    // else (the operator's actions stay the operators').
    let act = |id, action: pb::SagaOperatorAction| pb::OperateSagaRequest {
        saga_id: id,
        action: action as i32,
        why: "t95 called it off".into(),
        operator: "someone-else".into(),
    };
    denied(
        billing
            .operate_saga(act(mine, pb::SagaOperatorAction::Cancel))
            .await
            .map(|_| ()),
        "cancel another application's saga",
    );
    denied(
        billing_via_follower
            .operate_saga(act(mine, pb::SagaOperatorAction::Cancel))
            .await
            .map(|_| ()),
        "cancel another application's saga through a follower",
    );
    for action in [
        pb::SagaOperatorAction::Retry,
        pb::SagaOperatorAction::Skip,
        pb::SagaOperatorAction::Compensate,
        pb::SagaOperatorAction::MarkComplete,
    ] {
        let s = shop.operate_saga(act(mine, action)).await.unwrap_err();
        assert_eq!(s.code(), tonic::Code::PermissionDenied, "{action:?}: {s:?}");
        assert!(s.message().contains("operator's action"), "{action:?}: {}", s.message());
    }
    let v = shop
        .operate_saga(act(mine, pb::SagaOperatorAction::Cancel))
        .await
        .expect("an application cancels its own saga")
        .into_inner();
    assert_eq!(
        v.cancel_reason, "cancelled by shop: t95 called it off",
        "recorded as the authenticated application, not as the name it gave"
    );
    let state = pb::SagaState::try_from(v.state).unwrap();
    assert!(
        matches!(state, pb::SagaState::Compensating | pb::SagaState::Compensated),
        "{v:#?}"
    );
    let theirs_now = ops.get_saga(get(theirs)).await.unwrap().into_inner();
    assert!(theirs_now.cancel_reason.is_empty(), "the other saga is untouched");
}
