//! The guard of ADR 0031's read-safety argument.
//!
//! ADR 0031 lets a replication connection answer an AppendEntries without
//! entries itself (`raft::deferred_commit`), and openraft takes such an
//! answer as the follower's acknowledgement. Linearizable reads
//! (`ensure_linearizable`, invariant 7) stay safe only because
//! openraft 0.9.25's read-index round
//! (`RaftCore::handle_check_is_leader_request`) asks the network factory
//! for a new client per follower per round, and a new [`Connection`] has
//! no accepted request, so its heartbeat always leaves. That is an
//! openraft implementation detail; these tests fail when it stops holding.
//!
//! Three openraft nodes run in this process on the node's own stores (in
//! temporary directories) and its real transport ([`Network`],
//! [`Connection`], [`RaftService`] over loopback gRPC). The factory double
//! counts the clients openraft asks for; each follower's service counts
//! the AppendEntries that reached it, and can refuse them all (a follower
//! cut off). openraft's own heartbeats and elections are off, and the
//! deferral window is a minute, so that nothing moves unless a test moves
//! it, and every AppendEntries without entries on a replication connection
//! is answered by the transport.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use dtx_proto::v1::raft_transport_server::RaftTransport;
use dtx_proto::v1::raft_transport_server::RaftTransportServer;
use dtx_proto::v1::ProbeRequest;
use dtx_proto::v1::ProbeResponse;
use dtx_proto::v1::RaftMessage;
use openraft::error::CheckIsLeaderError;
use openraft::error::RaftError;
use openraft::network::RaftNetworkFactory;
use tonic::Request;
use tonic::Response;
use tonic::Status;

use super::open_data_dir;
use super::LogStore;
use super::StateMachineStore;
use crate::raft::log_durability::LogDurability;
use crate::raft::network::Connection;
use crate::raft::network::Network;
use crate::raft::network::NetworkSettings;
use crate::raft::service::RaftService;
use crate::raft::Batch;
use crate::raft::NodeId;
use crate::raft::NodeInfo;
use crate::raft::Raft;
use crate::raft::TypeConfig;

/// The openraft release whose read-index rounds these tests were checked
/// against. Another release must be checked again (ADR 0001, "Upgrading
/// openraft").
const OPENRAFT_CHECKED: &str = "0.9.25";

const CLUSTER: &str = "read-index-rounds";
const LEADER: NodeId = 1;
const FOLLOWERS: [NodeId; 2] = [2, 3];
/// Far longer than any test: every AppendEntries without entries at the
/// follower's match on a replication connection is answered here.
const DEFER_WINDOW: Duration = Duration::from_secs(60);
const ROUNDS: usize = 20;
const WAIT: Duration = Duration::from_secs(10);

/// The factory double: the node's real [`Network`], counting the clients
/// openraft asks it for, per target.
struct CountingNetwork {
    inner: Network,
    clients: Arc<Mutex<BTreeMap<NodeId, u64>>>,
}

impl RaftNetworkFactory<TypeConfig> for CountingNetwork {
    type Network = Connection;

    async fn new_client(&mut self, target: NodeId, node: &NodeInfo) -> Connection {
        *self.clients.lock().unwrap().entry(target).or_default() += 1;
        self.inner.new_client(target, node).await
    }
}

/// What reached one node's Raft transport.
#[derive(Default)]
struct Wire {
    /// AppendEntries that arrived (refused ones included).
    appends: AtomicU64,
    /// Refuse every AppendEntries: the node is cut off from its leader.
    cut_off: AtomicBool,
}

/// The node's [`RaftService`], behind a counter and a switch.
struct CountedService {
    inner: RaftService,
    wire: Arc<Wire>,
}

#[tonic::async_trait]
impl RaftTransport for CountedService {
    async fn append_entries(&self, req: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        self.wire.appends.fetch_add(1, Ordering::SeqCst);
        if self.wire.cut_off.load(Ordering::SeqCst) {
            return Err(Status::unavailable("cut off from its leader by the test"));
        }
        self.inner.append_entries(req).await
    }

    async fn vote(&self, req: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        self.inner.vote(req).await
    }

    async fn install_snapshot(&self, req: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        self.inner.install_snapshot(req).await
    }

    async fn probe(&self, req: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        self.inner.probe(req).await
    }
}

struct Node {
    raft: Raft,
    wire: Arc<Wire>,
    server: tokio::task::JoinHandle<()>,
    _dir: tempfile::TempDir,
}

struct Cluster {
    nodes: BTreeMap<NodeId, Node>,
    /// Clients the leader's factory built, per target.
    clients: Arc<Mutex<BTreeMap<NodeId, u64>>>,
}

impl Cluster {
    /// Three voters, node 1 the leader, one entry written and matched on
    /// both followers. Then the replication connections to both followers
    /// hold an accepted request at the followers' match.
    async fn start() -> Cluster {
        let mut listeners = BTreeMap::new();
        let mut members = BTreeMap::new();
        for id in [LEADER, FOLLOWERS[0], FOLLOWERS[1]] {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap().to_string();
            members.insert(
                id,
                NodeInfo {
                    raft_addr: addr.clone(),
                    api_addr: addr,
                },
            );
            listeners.insert(id, listener);
        }
        let config = Arc::new(
            openraft::Config {
                cluster_name: CLUSTER.into(),
                heartbeat_interval: 500,
                election_timeout_min: 3_000,
                election_timeout_max: 4_000,
                // Nothing but the test's own calls moves: no periodic
                // heartbeat, no election (node 1 elects itself at
                // `initialize`).
                enable_heartbeat: false,
                enable_elect: false,
                ..Default::default()
            }
            .validate()
            .unwrap(),
        );
        let clients = Arc::new(Mutex::new(BTreeMap::new()));
        let mut nodes = BTreeMap::new();
        for (id, listener) in listeners {
            let dir = tempfile::tempdir().unwrap();
            let engine = open_data_dir(dir.path(), CLUSTER, id).unwrap();
            let mut log_store = LogStore::open(engine.clone(), dir.path()).unwrap();
            log_store.open_for_node(id).await.unwrap();
            let durability: Arc<LogDurability> = log_store.durability();
            let sm = StateMachineStore::open(engine)
                .unwrap()
                .applying_only_durable(durability.clone());
            let network = CountingNetwork {
                inner: Network::new(NetworkSettings {
                    cluster_id: CLUSTER.into(),
                    self_id: id,
                    local_ip: None,
                    max_message_bytes: 16 << 20,
                    connect_timeout: Duration::from_secs(2),
                    tls: None,
                    log_durability: durability,
                    log_sync_stall_max: Duration::from_secs(30),
                    commit_index_defer_max: DEFER_WINDOW,
                }),
                // Only the leader's count is read.
                clients: if id == LEADER { clients.clone() } else { Arc::default() },
            };
            let raft = Raft::new(id, config.clone(), network, log_store, sm).await.unwrap();
            let wire = Arc::new(Wire::default());
            let service = CountedService {
                inner: RaftService {
                    raft: raft.clone(),
                    cluster_id: CLUSTER.into(),
                },
                wire: wire.clone(),
            };
            let server = tokio::spawn(async move {
                tonic::transport::Server::builder()
                    .add_service(RaftTransportServer::new(service))
                    .serve_with_incoming(dtx_transport::incoming(listener))
                    .await
                    .unwrap();
            });
            nodes.insert(
                id,
                Node {
                    raft,
                    wire,
                    server,
                    _dir: dir,
                },
            );
        }
        let cluster = Cluster { nodes, clients };
        let leader = cluster.leader();
        leader.initialize(members).await.unwrap();
        leader
            .wait(Some(WAIT))
            .metrics(|m| m.current_leader == Some(LEADER), "node 1 leads")
            .await
            .unwrap();
        let written = leader.client_write(Batch { commands: vec![] }).await.unwrap().log_id;
        leader
            .wait(Some(WAIT))
            .metrics(
                |m| {
                    m.replication
                        .as_ref()
                        .is_some_and(|r| FOLLOWERS.iter().all(|f| r.get(f) == Some(&Some(written))))
                },
                "both followers match the entry written",
            )
            .await
            .unwrap();
        cluster
    }

    fn leader(&self) -> &Raft {
        &self.nodes[&LEADER].raft
    }

    fn wire(&self, id: NodeId) -> &Wire {
        &self.nodes[&id].wire
    }

    fn appends(&self) -> BTreeMap<NodeId, u64> {
        FOLLOWERS
            .iter()
            .map(|&f| (f, self.wire(f).appends.load(Ordering::SeqCst)))
            .collect()
    }

    fn clients(&self) -> BTreeMap<NodeId, u64> {
        let c = self.clients.lock().unwrap();
        FOLLOWERS.iter().map(|f| (*f, c.get(f).copied().unwrap_or(0))).collect()
    }

    /// Has the leader its replication streams send a heartbeat, and waits
    /// until openraft takes a quorum's answer to it: the leader's last
    /// quorum acknowledgement is then younger than `younger_than`.
    async fn heartbeat_acknowledged(&self, younger_than: Duration) {
        self.leader().trigger().heartbeat().await.unwrap();
        let limit = younger_than.as_millis() as u64;
        self.leader()
            .wait(Some(WAIT))
            .metrics(
                |m| m.millis_since_quorum_ack.is_some_and(|ms| ms < limit),
                "the leader takes a quorum's answer to its heartbeat",
            )
            .await
            .unwrap();
    }

    async fn stop(self) {
        for node in self.nodes.values() {
            node.raft.shutdown().await.unwrap();
            node.server.abort();
        }
    }
}

fn increase(before: &BTreeMap<NodeId, u64>, after: &BTreeMap<NodeId, u64>) -> BTreeMap<NodeId, u64> {
    after.iter().map(|(id, n)| (*id, n - before[id])).collect()
}

/// The replication stream's heartbeats are answered by the transport (the
/// deferral is live here), yet every read-index round builds a new client
/// per follower and its heartbeats reach a quorum (and, the followers
/// being up, each follower).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn read_index_rounds_use_new_clients_whose_heartbeats_reach_the_followers() {
    let cluster = Cluster::start().await;

    // Control: the replication streams' heartbeats never reach a follower,
    // and openraft takes the transport's answers as acknowledgements.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let before = cluster.appends();
    cluster.heartbeat_acknowledged(Duration::from_millis(200)).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        increase(&before, &cluster.appends()),
        BTreeMap::from([(2, 0), (3, 0)]),
        "the replication streams' heartbeats were to be answered by the transport (ADR 0031); \
         if they left, this test no longer checks the read-index rounds against the deferral"
    );

    for round in 0..ROUNDS {
        let clients = cluster.clients();
        let appends = cluster.appends();
        cluster
            .leader()
            .ensure_linearizable()
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        let new_clients = increase(&clients, &cluster.clients());
        assert_eq!(
            new_clients,
            BTreeMap::from([(2, 1), (3, 1)]),
            "round {round}: openraft no longer asks for a new client per follower per read-index \
             round; ADR 0031's deferral then may answer the round's heartbeats (ADR 0001, \"Upgrading openraft\")"
        );
        // The leader and one follower are a quorum: a follower that helped
        // confirm the leader must have received the round's heartbeat.
        let reached = increase(&appends, &cluster.appends());
        assert!(
            reached.values().filter(|n| **n > 0).count() >= 1,
            "round {round}: ensure_linearizable returned Ok but no follower received its heartbeat \
             ({reached:?} AppendEntries reached followers 2 and 3): the transport answered the \
             read-index round (ADR 0031); reads are not linearizable"
        );
        // The other heartbeat may still be on its way.
        let deadline = tokio::time::Instant::now() + WAIT;
        while increase(&appends, &cluster.appends()).values().any(|n| *n == 0) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "round {round}: a follower never received the round's heartbeat: {:?}",
                increase(&appends, &cluster.appends())
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    cluster.stop().await;
}

/// The safety consequence: a leader cut off from both followers is told by
/// its transport that they acknowledged its heartbeats, and still refuses
/// a linearizable read.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leader_cut_off_refuses_reads_though_its_transport_answers_its_heartbeats() {
    let cluster = Cluster::start().await;
    for f in FOLLOWERS {
        cluster.wire(f).cut_off.store(true, Ordering::SeqCst);
    }

    tokio::time::sleep(Duration::from_millis(400)).await;
    let before = cluster.appends();
    cluster.heartbeat_acknowledged(Duration::from_millis(200)).await;
    assert_eq!(
        increase(&before, &cluster.appends()),
        BTreeMap::from([(2, 0), (3, 0)]),
        "the replication streams' heartbeats were to be answered by the transport (ADR 0031)"
    );

    let before = cluster.appends();
    let read = tokio::time::timeout(WAIT, cluster.leader().ensure_linearizable())
        .await
        .expect("the read-index round ends");
    match read {
        Err(RaftError::APIError(CheckIsLeaderError::QuorumNotEnough(q))) => {
            assert_eq!(q.got.into_iter().collect::<Vec<_>>(), vec![LEADER]);
        }
        other => panic!(
            "a leader cut off from both followers confirmed its leadership for a read: {other:?}; \
             the transport answered the read-index round's heartbeats (ADR 0031) and reads are not \
             linearizable (invariant 7)"
        ),
    }
    let tried = increase(&before, &cluster.appends());
    assert!(
        tried.values().all(|n| *n >= 1),
        "the read-index round's heartbeats were to reach both followers (and be refused): {tried:?}"
    );
    cluster.stop().await;
}

/// ADR 0031's read-index argument was checked against one openraft release.
#[test]
fn openraft_is_the_release_adr_0031_was_checked_against() {
    let lock = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.lock")).unwrap();
    let versions: Vec<&str> = lock
        .split("[[package]]")
        .filter(|p| p.lines().any(|l| l.trim() == "name = \"openraft\""))
        .filter_map(|p| p.lines().find_map(|l| l.trim().strip_prefix("version = ")))
        .map(|v| v.trim_matches('"'))
        .collect();
    assert_eq!(
        versions,
        vec![OPENRAFT_CHECKED],
        "Cargo.lock pins openraft {versions:?}, not {OPENRAFT_CHECKED}: re-check ADR 0031's read-index \
         assumption (see ADR 0001, \"Upgrading openraft\") before changing openraft, then update \
         OPENRAFT_CHECKED in coordinator/src/store/read_index_rounds.rs"
    );
}
