//! Health shows whether a node serves: `grpc.health.v1` on both gRPC ports,
//! `ClusterStatus.serving`, the metrics port's `/health` and the gauges tell
//! the same truth (`coordinator::raft::serving`).
//!
//! The operator's drill: a leader cut off from its majority kept reporting
//! role Leader, `dtx_raft_is_leader 1` and `/health OK` while the others
//! elected a new leader at a higher term. Here the leader is cut off by the
//! test proxies (both directions, from outside the nodes; the test itself
//! still reaches every node's ports directly), and every surface must turn
//! to not serving. Bounds are generous and only polled: each wait fails
//! only if the state is never reached within it.

use crate::common;

use std::time::Duration;

use common::node_ip;
use common::TestCluster;
use dtx_proto::v1::ClusterStatusResponse;
use dtx_proto::v1::MemberReach;
use dtx_testkit::cluster::free_port;
use dtx_testkit::cluster::ProcessCluster;
use dtx_transport::channel::Channel;
use tokio::io::AsyncReadExt;
use tokio::io::AsyncWriteExt;
use tokio::time::Instant;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

/// How long any one state may take to show: far above the ~1 s an
/// election and the 500 ms serving limit take, for a loaded machine.
const WAIT: Duration = Duration::from_secs(30);

/// The services each port reports, "" (the whole server) first.
const API_SERVICES: &[&str] = &["", "dtx.v1.Coordinator", "dtx.v1.Admin"];
const RAFT_SERVICES: &[&str] = &["", "dtx.v1.RaftTransport"];

fn with_metrics(c: &mut coordinator::config::Config) {
    let ip = node_ip(c.node_id);
    c.metrics_addr = Some(format!("{ip}:{}", free_port(&ip).unwrap()));
}

async fn channel(addr: &str) -> Result<Channel, String> {
    dtx_transport::channel::channel(addr, None, Duration::from_secs(1))
}

/// `grpc.health.v1.Health/Check` of `service` at `addr`, with no identity.
async fn health(addr: &str, service: &str) -> Result<ServingStatus, String> {
    health_on(channel(addr).await?, service).await
}

/// The check, given up after 2 s.
async fn health_on(ch: Channel, service: &str) -> Result<ServingStatus, String> {
    let mut h = HealthClient::new(ch);
    let check = h.check(HealthCheckRequest {
        service: service.to_string(),
    });
    let r = tokio::time::timeout(Duration::from_secs(2), check)
        .await
        .map_err(|_| "no answer within 2 s".to_string())?
        .map_err(|s| format!("{:?}: {}", s.code(), s.message()))?;
    ServingStatus::try_from(r.get_ref().status).map_err(|e| e.to_string())
}

/// An HTTP/1.1 GET on the metrics port: (status code, body).
async fn http_get(addr: &str, path: &str) -> Result<(u16, String), String> {
    let mut s = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut out = String::new();
    s.read_to_string(&mut out).await.map_err(|e| e.to_string())?;
    let code = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("not an HTTP answer: {out:?}"))?;
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((code, body))
}

fn gauge(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (n, v) = l.split_once(' ')?;
        (n == name).then(|| v.trim().parse().ok()).flatten()
    })
}

/// What one node shows on every surface at one moment.
#[derive(Debug)]
struct Surfaces {
    api_health: Vec<Result<ServingStatus, String>>,
    raft_health: Vec<Result<ServingStatus, String>>,
    status: Result<ClusterStatusResponse, String>,
    http_health: Result<(u16, String), String>,
    /// (dtx_serving, dtx_raft_is_leader)
    gauges: Option<(Option<f64>, Option<f64>)>,
}

impl Surfaces {
    async fn of(c: &TestCluster, id: u64) -> Surfaces {
        let n = &c.procs.nodes[(id - 1) as usize];
        let (api, raft) = (n.plan.api_listen.clone(), n.plan.raft_listen.clone());
        let metrics = n.config.metrics_addr.clone();
        let mut api_health = Vec::new();
        for s in API_SERVICES {
            api_health.push(health(&api, s).await);
        }
        let mut raft_health = Vec::new();
        for s in RAFT_SERVICES {
            raft_health.push(health(&raft, s).await);
        }
        let status = dtx_client::cluster_status_at(&api, Duration::from_secs(2))
            .await
            .map_err(|e| e.to_string());
        let (http_health, gauges) = match &metrics {
            Some(m) => (
                http_get(m, "/health").await,
                http_get(m, "/metrics")
                    .await
                    .ok()
                    .map(|(_, t)| (gauge(&t, "dtx_serving"), gauge(&t, "dtx_raft_is_leader"))),
            ),
            None => (Err("no metrics port".into()), None),
        };
        Surfaces {
            api_health,
            raft_health,
            status,
            http_health,
            gauges,
        }
    }

    fn health_all(&self, want: ServingStatus) -> bool {
        self.api_health
            .iter()
            .chain(&self.raft_health)
            .all(|h| h.as_ref().is_ok_and(|s| *s == want))
    }

    /// Every surface says SERVING.
    fn serving(&self) -> bool {
        self.health_all(ServingStatus::Serving)
            && self
                .status
                .as_ref()
                .is_ok_and(|s| s.serving && s.not_serving_reason.is_empty())
            && self
                .http_health
                .as_ref()
                .is_ok_and(|(code, body)| *code == 200 && body.trim() == "SERVING")
            && self.gauges.is_some_and(|(s, _)| s == Some(1.0))
    }

    /// Every surface says NOT_SERVING, ClusterStatus and `/health` with a
    /// reason containing `why`.
    fn not_serving(&self, why: &str) -> bool {
        self.health_all(ServingStatus::NotServing)
            && self
                .status
                .as_ref()
                .is_ok_and(|s| !s.serving && s.not_serving_reason.contains(why))
            && self
                .http_health
                .as_ref()
                .is_ok_and(|(code, body)| *code == 503 && body.starts_with("NOT_SERVING: ") && body.contains(why))
            && self.gauges.is_some_and(|(s, l)| s == Some(0.0) && l != Some(1.0))
    }
}

/// Polls `id`'s surfaces until `ok` holds (at most [`WAIT`]); returns them.
async fn until(c: &TestCluster, id: u64, what: &str, ok: impl Fn(&Surfaces) -> bool) -> Surfaces {
    let start = Instant::now();
    loop {
        let s = Surfaces::of(c, id).await;
        if ok(&s) {
            eprintln!("node {id} {what} after {:?}", start.elapsed());
            return s;
        }
        if start.elapsed() > WAIT {
            c.dump_logs();
            panic!("node {id} never {what} within {WAIT:?}; last seen: {s:#?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn reach_of(s: &ClusterStatusResponse, id: u64) -> (MemberReach, u64) {
    let m = s.members.iter().find(|m| m.node_id == id).expect("member listed");
    (MemberReach::try_from(m.reach).unwrap(), m.last_heard_ms_ago)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t101_a_leader_cut_off_from_its_majority_shows_not_serving_everywhere_and_serves_again_after_healing() {
    let mut c = TestCluster::start_partitionable("t101", with_metrics).await;
    let old = c.leader().await;
    // A few entries, so the replication columns mean something.
    let cl = c.client();
    for i in 0..3 {
        cl.begin(&format!("h{i}"), 600_000, b"").await.unwrap();
    }

    // Caught up: every node serves, on both ports and everywhere else.
    for id in 1..=3 {
        until(&c, id, "serves on every surface", Surfaces::serving).await;
    }
    // The leader's view of the members: itself, then the others reached
    // recently, with their replication position.
    let s = until(&c, old, "shows every member reachable", |s| {
        s.status.as_ref().is_ok_and(|st| {
            st.members
                .iter()
                .filter(|m| m.node_id != old)
                .all(|m| m.reach == MemberReach::Reachable as i32 && m.matched_index > 0)
        })
    })
    .await;
    let st = s.status.unwrap();
    assert_eq!(st.role, "Leader");
    assert_eq!(reach_of(&st, old).0, MemberReach::Self_);
    assert_eq!(s.gauges.unwrap().1, Some(1.0), "the serving leader counts as leader");
    let old_term = st.term;
    // A follower knows the leader's reach only.
    let follower = (1..=3).find(|i| *i != old).unwrap();
    let fs = c.status_of(follower).await;
    assert_eq!(reach_of(&fs, follower).0, MemberReach::Self_);
    assert_eq!(reach_of(&fs, old).0, MemberReach::Reachable);
    let third = (1..=3).find(|i| *i != old && *i != follower).unwrap();
    assert_eq!(reach_of(&fs, third), (MemberReach::Unspecified, 0));
    assert!(
        fs.members.iter().all(|m| m.matched_index == 0 && m.lag_entries == 0),
        "{fs:?}"
    );

    // Cut the leader off from both followers.
    c.isolate(old);
    let cut = until(&c, old, "shows it is not serving", |s| {
        s.not_serving("leader has not heard from a majority for")
    })
    .await;
    let st = cut.status.unwrap();
    eprintln!(
        "cut-off node {old}: role {} term {}: {}",
        st.role, st.term, st.not_serving_reason
    );
    for m in st.members.iter().filter(|m| m.node_id != old) {
        assert_eq!(m.reach, MemberReach::Unreachable as i32, "{m:?}");
    }
    // The majority elects a new leader at a higher term, and it serves.
    let majority: Vec<u64> = (1..=3).filter(|i| *i != old).collect();
    let start = Instant::now();
    let new = loop {
        let mut found = None;
        for id in &majority {
            if let Ok(s) = dtx_client::cluster_status_at(&c.api(*id), Duration::from_secs(2)).await {
                if s.role == "Leader" && s.serving && s.term > old_term {
                    found = Some(*id);
                }
            }
        }
        if let Some(id) = found {
            break id;
        }
        assert!(start.elapsed() < WAIT, "the majority elected no serving leader");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    until(&c, new, "serves as the new leader", Surfaces::serving).await;

    // Heal: the old leader learns the newer term, follows, and serves.
    c.heal();
    let back = until(&c, old, "serves again after the heal", Surfaces::serving).await;
    let st = back.status.unwrap();
    assert_eq!(st.leader_id, new);
    assert_eq!(st.role, "Follower");
    assert_eq!(back.gauges.unwrap().1, Some(0.0));

    // Reflection lists the API's services, without the protos, to any
    // caller here (authentication is off).
    let listed = list_services(channel(&c.api(old)).await.unwrap())
        .await
        .expect("reflection answers");
    for s in ["dtx.v1.Coordinator", "dtx.v1.Admin", "grpc.health.v1.Health"] {
        assert!(listed.iter().any(|l| l == s), "{s} not in {listed:?}");
    }
    assert!(
        !listed.iter().any(|l| l == "dtx.v1.RaftTransport"),
        "the API port does not serve the Raft transport: {listed:?}"
    );
    c.procs.stop_all(Duration::from_secs(5));
}

/// `grpc.reflection.v1` ListServices.
async fn list_services(ch: Channel) -> Result<Vec<String>, tonic::Status> {
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    let mut r = ServerReflectionClient::new(ch);
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = r
        .server_reflection_info(futures::stream::iter([req]))
        .await?
        .into_inner();
    match answers.message().await? {
        Some(a) => match a.message_response {
            Some(MessageResponse::ListServicesResponse(l)) => Ok(l.service.into_iter().map(|s| s.name).collect()),
            other => panic!("not a service list: {other:?}"),
        },
        None => panic!("no reflection answer"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t101_nodes_without_a_leader_do_not_serve_until_the_cluster_is_bootstrapped() {
    let dir = common::test_dir();
    let plans = common::local_plans(3);
    // Node 1 is the one that bootstraps; it starts last.
    let procs = ProcessCluster::new(common::bin(), dir.path(), "t101b", plans, with_metrics).unwrap();
    let mut c = TestCluster {
        dir,
        procs,
        proxies: Vec::new(),
    };
    c.procs.start(2).unwrap();
    c.procs.start(3).unwrap();
    for id in [2, 3] {
        let s = until(&c, id, "answers, not serving", |s| {
            s.not_serving("no leader known: this node holds no cluster state")
        })
        .await;
        let st = s.status.unwrap();
        assert_eq!((st.leader_id, st.term), (0, 0), "{st:?}");
        assert!(st.members.is_empty(), "no membership yet: {st:?}");
    }
    c.procs.start(1).unwrap();
    for id in 1..=3 {
        until(&c, id, "serves once a leader is elected", Surfaces::serving).await;
    }
    c.procs.stop_all(Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t101_with_mutual_tls_required_health_needs_no_certificate_and_reflection_needs_an_identity() {
    use dtx_tls::Role;
    let dir = common::test_dir();
    let pki = std::sync::Arc::new(dtx_testkit::pki::DevPki::create(&dir.path().join("pki"), "t101 authority").unwrap());
    let p = pki.clone();
    let mut c = TestCluster::start_with("t101c", 3, move |cfg| {
        p.apply_node(cfg).expect("node certificate");
        cfg.tls.client_auth = "required".into();
    });
    let operator = pki.issue(Role::Operator, "supervisor", &[]).unwrap();
    c.procs.client_tls = Some(pki.client(&operator).unwrap());
    let leader = c.leader().await;
    let node = &c.procs.nodes[(leader - 1) as usize].plan;
    let (api, raft) = (node.api_listen.clone(), node.raft_listen.clone());

    // A caller with the authority only (TLS, no client certificate, no
    // token), as a probe would be.
    let ca_only = dtx_tls::args::TlsArgs {
        tls_ca: Some(pki.ca.clone()),
        ..Default::default()
    }
    .client()
    .unwrap()
    .expect("TLS settings");
    let ch = |addr: &str, tls: &std::sync::Arc<dtx_tls::ClientTls>| {
        dtx_transport::channel::channel_with(addr, None, Duration::from_secs(2), Some(tls)).unwrap()
    };
    let start = Instant::now();
    loop {
        let a = health_on(ch(&api, &ca_only), "").await;
        let r = health_on(ch(&raft, &ca_only), "").await;
        if a == Ok(ServingStatus::Serving) && r == Ok(ServingStatus::Serving) {
            break;
        }
        assert!(
            start.elapsed() < WAIT,
            "health of the leader without a certificate: api {a:?}, raft {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Anything else on that connection is refused: it has no identity.
    match list_services(ch(&api, &ca_only)).await {
        Err(s) => assert_eq!(s.code(), tonic::Code::Unauthenticated, "{s:?}"),
        Ok(l) => panic!("reflection answered an anonymous caller: {l:?}"),
    }
    // Any authenticated role may use reflection.
    let app = pki.issue(Role::Application, "shop", &[]).unwrap();
    let listed = list_services(ch(&api, &pki.client(&app).unwrap()))
        .await
        .expect("reflection answers an application");
    assert!(listed.iter().any(|l| l == "dtx.v1.Coordinator"), "{listed:?}");
    c.procs.stop_all(Duration::from_secs(5));
}
