//! Participant and node identities (ADR 0037), with real processes on mutual
//! TLS: three `coordinator serve` nodes with certificates from a throwaway
//! authority made by the test (`dtx_testkit::pki`), and callers built here
//! with participant, node, application and operator certificates, bad
//! certificates and tokens.
//!
//! - A participant certificate enlists only its own id, and only in a
//!   transaction whose owner allowed it (`auth.self_enlist`, or the owner
//!   enlisted it): the probe's "bank-z into appA's transaction" and "32
//!   junk participants fill appA's transaction" are PERMISSION_DENIED.
//! - A node certificate counts only for a current member: a never-member
//!   (`dtx://node/9`) and a removed member are refused on the Raft port and
//!   on the API port, where their `x-dtx-on-behalf-of` aborted nothing.
//! - A token beside a refused certificate is refused with the
//!   certificate's reason.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::TestCluster;
use dtx_client::Client;
use dtx_client::ClientError;
use dtx_client::TxOutcome;
use dtx_proto::v1 as pb;
use dtx_testkit::pki::DevPki;
use dtx_tls::dev::Lifetime;
use dtx_tls::files::KeyPairFiles;
use dtx_tls::ClientTls;
use dtx_tls::Role;

/// A client of the whole cluster with a certificate for `role`/`name`.
fn as_identity(c: &TestCluster, pki: &DevPki, role: Role, name: &str) -> Client {
    let f = pki.issue(role, name, &[]).unwrap();
    common::tls::client_with(c.procs.api_addrs(), Some(pki.client(&f).unwrap()), None)
}

fn api_of(c: &TestCluster, id: u64) -> String {
    c.procs.nodes[(id - 1) as usize].plan.api_listen.clone()
}

fn raft_of(c: &TestCluster, id: u64) -> String {
    c.procs.nodes[(id - 1) as usize].plan.raft_listen.clone()
}

fn channel(addr: &str, tls: &Arc<ClientTls>) -> dtx_transport::channel::Channel {
    dtx_transport::channel::channel_with(addr, None, Duration::from_secs(3), Some(tls)).unwrap()
}

#[track_caller]
fn denied<T: std::fmt::Debug>(r: Result<T, ClientError>, what: &str, says: &str) {
    match r {
        Err(ClientError::PermissionDenied(m)) => assert!(m.contains(says), "{what}: {m}"),
        other => panic!("{what}: expected PERMISSION_DENIED, got {other:?}"),
    }
}

/// The probe's two cases: a `dtx://participant/p1` certificate enlisted
/// "bank-z" into application appA's transaction, and 32 junk participants
/// filled another of appA's transactions so that appA's own Enlist failed.
/// Both are PERMISSION_DENIED now, through the leader and through a follower,
/// and appA's transaction keeps only what appA enlisted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t114_a_participant_certificate_enlists_no_other_id_and_fills_no_transaction() {
    let dir = common::test_dir();
    let pki = Arc::new(DevPki::create(&dir.path().join("pki"), "t114 authority").unwrap());
    let mut c = common::tls::tls_cluster("t114a", &pki, "required", |_| {});
    let leader = c.leader().await;
    let app = as_identity(&c, &pki, Role::Application, "appA");
    let p1 = as_identity(&c, &pki, Role::Participant, "p1");

    // Case 1: p1 enlists "bank-z" into appA's transaction.
    let t1 = app.begin("t114a-1", 60_000, b"").await.unwrap().txid;
    denied(
        p1.enlist(t1, "bank-z", "127.0.0.1:9", b"").await,
        "p1 enlists bank-z",
        "participant/p1 may enlist only itself",
    );
    // Through a follower (which forwards on behalf of participant/p1).
    let follower = (1..=3).find(|&id| id != leader).unwrap();
    let f = pki.issue(Role::Participant, "p1", &[]).unwrap();
    let p1_via_follower = common::tls::client_with(vec![api_of(&c, follower)], Some(pki.client(&f).unwrap()), None);
    denied(
        p1_via_follower.enlist(t1, "bank-z", "127.0.0.1:9", b"").await,
        "p1 enlists bank-z through a follower",
        "participant/p1 may enlist only itself",
    );
    // Nor may p1 enlist itself where appA did not allow it.
    denied(
        p1.enlist(t1, "p1", "127.0.0.1:9", b"").await,
        "p1 enlists itself unasked",
        "has not allowed participant p1",
    );

    // Case 2: 32 junk participants at an address nothing listens on.
    let t2 = app.begin("t114a-2", 60_000, b"").await.unwrap().txid;
    for i in 0..32 {
        denied(
            p1.enlist(t2, &format!("junk-{i}"), "127.0.0.1:9", b"").await,
            &format!("junk-{i}"),
            "may enlist only itself",
        );
    }
    // appA's own Enlist still succeeds, and its transactions hold only
    // what appA enlisted.
    assert_eq!(app.enlist(t2, "bank-a", "127.0.0.1:9", b"").await.unwrap(), 1);
    let ids = |s: pb::StatusResponse| s.participants.into_iter().map(|p| p.id).collect::<Vec<_>>();
    assert_eq!(ids(app.status(t2).await.unwrap()), vec!["bank-a".to_string()]);
    assert!(ids(app.status(t1).await.unwrap()).is_empty());
    assert_eq!(app.abort(t1, "test").await.unwrap(), TxOutcome::Aborted);
    assert_eq!(app.abort(t2, "test").await.unwrap(), TxOutcome::Aborted);
}

/// The legitimate flow kept: a participant enlists itself (its certificate's
/// name as its id) in the transactions of an application `auth.self_enlist`
/// lists with it, or where the owner enlisted it already; not in another
/// application's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t114_a_participant_enlists_itself_where_the_owner_allowed_it() {
    let dir = common::test_dir();
    let pki = Arc::new(DevPki::create(&dir.path().join("pki"), "t114 authority").unwrap());
    let mut c = common::tls::tls_cluster("t114b", &pki, "required", |cfg| {
        cfg.auth.self_enlist = vec![coordinator::config::SelfEnlistConfig {
            participant: "inventory".into(),
            applications: vec!["appA".into()],
        }];
    });
    c.leader().await;
    let app_a = as_identity(&c, &pki, Role::Application, "appA");
    let app_b = as_identity(&c, &pki, Role::Application, "appB");
    let inventory = as_identity(&c, &pki, Role::Participant, "inventory");
    let p1 = as_identity(&c, &pki, Role::Participant, "p1");

    let ta = app_a.begin("t114b-a", 60_000, b"").await.unwrap().txid;
    let tb = app_b.begin("t114b-b", 60_000, b"").await.unwrap().txid;
    // Listed for appA: enlists itself (the SDK's self-enlist call), and
    // again (a no-op).
    assert_eq!(inventory.enlist(ta, "inventory", "127.0.0.1:9", b"w").await.unwrap(), 1);
    assert_eq!(inventory.enlist(ta, "inventory", "127.0.0.1:9", b"w").await.unwrap(), 1);
    // Not listed for appB.
    denied(
        inventory.enlist(tb, "inventory", "127.0.0.1:9", b"w").await,
        "inventory in appB's transaction",
        "belongs to application appB, which has not allowed participant inventory",
    );
    // Still only itself where it is allowed.
    denied(
        inventory.enlist(ta, "bank-z", "127.0.0.1:9", b"").await,
        "inventory enlists bank-z",
        "may enlist only itself",
    );
    // Where the owner enlisted it, its own Enlist is the same enlistment.
    assert_eq!(app_b.enlist(tb, "p1", "127.0.0.1:9", b"x").await.unwrap(), 1);
    assert_eq!(p1.enlist(tb, "p1", "127.0.0.1:9", b"x").await.unwrap(), 1);
    denied(
        p1.enlist(ta, "p1", "127.0.0.1:9", b"x").await,
        "p1 in appA's transaction",
        "has not allowed participant p1",
    );
    // A transaction that does not exist is NOT_FOUND, not a chance to
    // enlist in the next one begun.
    match inventory.enlist(ta + 1000, "inventory", "127.0.0.1:9", b"w").await {
        Err(ClientError::NotFound(m)) => assert!(m.contains("not found"), "{m}"),
        other => panic!("enlist in a transaction never begun: {other:?}"),
    }
    let st = app_a.status(ta).await.unwrap();
    assert_eq!(
        st.participants.iter().map(|p| p.id.as_str()).collect::<Vec<_>>(),
        vec!["inventory"]
    );
    assert_eq!(app_a.abort(ta, "test").await.unwrap(), TxOutcome::Aborted);
    assert_eq!(app_b.abort(tb, "test").await.unwrap(), TxOutcome::Aborted);
}

/// A Raft Probe (of this cluster) and an Abort of `txid` on behalf of
/// application appA, both to node `id` with `tls`; each the call's status,
/// or Ok.
async fn as_node(
    c: &TestCluster,
    id: u64,
    tls: &Arc<ClientTls>,
    txid: u64,
) -> (Result<(), tonic::Status>, Result<(), tonic::Status>) {
    let (raft, api) = (raft_of(c, id), api_of(c, id));
    let mut rq = tonic::Request::new(pb::ProbeRequest {});
    rq.metadata_mut()
        .insert("x-dtx-cluster-id", c.procs.nodes[0].config.cluster_id.parse().unwrap());
    let probe = pb::raft_transport_client::RaftTransportClient::new(channel(&raft, tls))
        .probe(rq)
        .await
        .map(|_| ());
    let mut rq = tonic::Request::new(pb::AbortRequest {
        txid,
        reason: "as appA".into(),
    });
    rq.metadata_mut()
        .insert("x-dtx-on-behalf-of", "application/appA".parse().unwrap());
    let abort = pb::coordinator_client::CoordinatorClient::new(channel(&api, tls))
        .abort(rq)
        .await
        .map(|_| ());
    (probe, abort)
}

#[track_caller]
fn refused_as_non_member(r: Result<(), tonic::Status>, what: &str, id: u64) {
    match r {
        Err(s) if s.code() == tonic::Code::PermissionDenied => assert!(
            s.message().contains(&format!("node {id} is not a member")),
            "{what}: {}",
            s.message()
        ),
        other => panic!("{what}: expected PERMISSION_DENIED, got {other:?}"),
    }
}

fn admin(pki: &DevPki, addr: &str) -> pb::admin_client::AdminClient<dtx_transport::channel::Channel> {
    let op = pki.issue(Role::Operator, "alice", &[]).unwrap();
    pb::admin_client::AdminClient::new(channel(addr, &pki.client(&op).unwrap()))
}

/// A node certificate counts only for a current member. `dtx://node/9` (never
/// a member) is refused on the leader's Raft port (it passed the Probe and
/// reached AppendEntries' decoder) and on its API port, where its
/// `x-dtx-on-behalf-of: application/appA` aborted appA's transaction; a node
/// that joins is honoured once it is a member (the join works: the new node,
/// a member of nothing yet, admits the leader), and is refused again once
/// removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t114_a_node_certificate_counts_only_for_a_current_member() {
    let dir = common::test_dir();
    let pki = Arc::new(DevPki::create(&dir.path().join("pki"), "t114 authority").unwrap());
    let mut c = common::tls::tls_cluster("t114n", &pki, "required", |_| {});
    let leader = c.leader().await;
    let app = as_identity(&c, &pki, Role::Application, "appA");
    let t = app.begin("t114n-1", 60_000, b"").await.unwrap().txid;

    // A never-member.
    let n9 = pki.issue(Role::Node, "9", &[]).unwrap();
    let n9_tls = pki.client(&n9).unwrap();
    let (probe, abort) = as_node(&c, leader, &n9_tls, t).await;
    refused_as_non_member(probe, "node 9's Raft probe", 9);
    refused_as_non_member(abort, "node 9's abort on behalf of appA", 9);
    let st = app.status(t).await.unwrap();
    assert_eq!(
        st.state,
        pb::TxState::Active as i32,
        "appA's transaction was decided: {st:?}"
    );

    // A node that joins: node 4, on an empty data directory, with its
    // certificate.
    let ip = common::node_ip(4);
    let raft4 = format!("{ip}:{}", dtx_testkit::cluster::free_port(&ip).unwrap());
    let api4 = format!("{ip}:{}", dtx_testkit::cluster::free_port(&ip).unwrap());
    let mut cfg = c.procs.nodes[0].config.clone();
    cfg.node_id = 4;
    cfg.data_dir = c.dir.path().join("node4");
    cfg.raft_addr = raft4.clone();
    cfg.api_addr = api4.clone();
    cfg.bootstrap.enabled = false;
    pki.apply_node(&mut cfg).unwrap();
    let cfg_path = c.dir.path().join("node4.toml");
    std::fs::write(&cfg_path, toml::to_string(&cfg).unwrap()).unwrap();
    let mut node4 = dtx_testkit::cluster::ServiceProcess::new(
        common::bin(),
        c.dir.path(),
        "node4",
        &api4,
        vec!["serve".into(), "--config".into(), cfg_path.into_os_string()],
    );
    node4.start(&[]).unwrap();
    assert!(
        dtx_testkit::cluster::wait_listening(&api4, Duration::from_secs(10)).await,
        "node 4 did not start"
    );
    let n4_tls = pki
        .client(&KeyPairFiles {
            cert: cfg.tls.cert.clone().unwrap(),
            key: cfg.tls.key.clone().unwrap(),
        })
        .unwrap();
    // Not a member yet: refused.
    let (probe, _) = as_node(&c, leader, &n4_tls, 0).await;
    refused_as_non_member(probe, "node 4's Raft probe before it joined", 4);
    let mut rq = tonic::Request::new(pb::AddNodeRequest {
        node_id: 4,
        raft_addr: raft4.clone(),
        api_addr: api4.clone(),
        voter: false,
    });
    rq.set_timeout(Duration::from_secs(20));
    admin(&pki, &api_of(&c, leader))
        .add_node(rq)
        .await
        .expect("node 4 joins as a learner over TLS");
    // A member now: the leader honours its certificate.
    let (probe, _) = as_node(&c, leader, &n4_tls, 0).await;
    probe.expect("a member's Raft probe");

    // Removed: refused again, on both ports.
    let mut rq = tonic::Request::new(pb::RemoveNodeRequest { node_id: 4 });
    rq.set_timeout(Duration::from_secs(20));
    admin(&pki, &api_of(&c, leader))
        .remove_node(rq)
        .await
        .expect("node 4 removed");
    let (probe, abort) = as_node(&c, leader, &n4_tls, t).await;
    refused_as_non_member(probe, "removed node 4's Raft probe", 4);
    refused_as_non_member(abort, "removed node 4's abort on behalf of appA", 4);
    let st = app.status(t).await.unwrap();
    assert_eq!(
        st.state,
        pb::TxState::Active as i32,
        "appA's transaction was decided: {st:?}"
    );
    // Members still forward for their callers: appA through a follower.
    let follower = (1..=3).find(|&id| id != leader).unwrap();
    let f = pki.issue(Role::Application, "appA", &[]).unwrap();
    let via_follower = common::tls::client_with(vec![api_of(&c, follower)], Some(pki.client(&f).unwrap()), None);
    assert_eq!(via_follower.abort(t, "mine").await.unwrap(), TxOutcome::Aborted);
    drop(node4);
}

/// With `client_auth = "optional"`, a token was taken beside a certificate
/// the node refused. The certificate is refused as such now (UNAUTHENTICATED
/// with its reason); the token alone still admits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t114_a_token_beside_a_refused_certificate_is_refused() {
    let dir = common::test_dir();
    let pki = Arc::new(DevPki::create(&dir.path().join("pki"), "t114 authority").unwrap());
    let token = dtx_tls::identity::new_token();
    let hash = dtx_tls::identity::token_sha256_hex(&token);
    let mut c = common::tls::tls_cluster("t114t", &pki, "optional", move |cfg| {
        cfg.auth.tokens = vec![coordinator::config::TokenConfig {
            role: "application".into(),
            name: "shop".into(),
            sha256: hash.clone(),
        }];
    });
    c.leader().await;
    let addrs = c.procs.api_addrs();

    // An expired certificate of our authority, sent as it is (our loader
    // refuses it), with a good token.
    let old = pki
        .issue_for(Role::Application, "expired", &[], Lifetime::Expired)
        .unwrap();
    let expired = ClientTls::load_without_own_validity_check(dtx_tls::client::ClientTlsFiles {
        ca: pki.ca.clone(),
        own: Some(old),
        server_name: None,
    })
    .unwrap();
    match common::tls::client_with(addrs.clone(), Some(expired), Some(token.clone()))
        .begin("t114t-1", 10_000, b"")
        .await
    {
        Err(ClientError::Unauthenticated(m)) => assert!(
            m.contains("certificate expired") && m.contains("not replaced by a bearer token"),
            "{m}"
        ),
        other => panic!("expired certificate and a token: {other:?}"),
    }
    // A certificate from another authority, with a good token.
    let other = DevPki::create(&dir.path().join("other"), "another authority").unwrap();
    let stranger = other.issue(Role::Application, "shop", &[]).unwrap();
    let stranger_tls = ClientTls::load(dtx_tls::client::ClientTlsFiles {
        ca: pki.ca.clone(),
        own: Some(stranger),
        server_name: None,
    })
    .unwrap();
    match common::tls::client_with(addrs.clone(), Some(stranger_tls), Some(token.clone()))
        .begin("t114t-2", 10_000, b"")
        .await
    {
        Err(ClientError::Unauthenticated(m)) => {
            assert!(m.contains("not from this server's certificate authority"), "{m}")
        }
        other => panic!("another authority's certificate and a token: {other:?}"),
    }
    // The token alone (no certificate) still admits.
    let ca_only = dtx_tls::args::TlsArgs {
        tls_ca: Some(pki.ca.clone()),
        ..Default::default()
    }
    .client()
    .unwrap();
    let good = common::tls::client_with(addrs, ca_only, Some(token));
    let t = good.begin("t114t-3", 10_000, b"").await.expect("a token admits").txid;
    assert_eq!(good.abort(t, "test").await.unwrap(), TxOutcome::Aborted);
}
