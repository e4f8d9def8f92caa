//! The client against stand-in coordinator nodes on 127.0.0.1: decision
//! reads (batches, order, participant id, unknown values), the source
//! address, and self-enlistment's retries.

use std::net::IpAddr;
use std::sync::atomic::AtomicU32;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::sync::Mutex;

use dtx_proto::v1::coordinator_server::Coordinator;
use dtx_proto::v1::coordinator_server::CoordinatorServer;
use tonic::Request;
use tonic::Response;

use super::*;

/// One GetDecisions a node saw: txids, participant id, the caller's IP.
type Asked = (Vec<u64>, String, Option<IpAddr>);

/// A stand-in node. Decisions: by `txid % 4` PENDING, COMMIT, ABORT,
/// UNKNOWN_PRESUMED_ABORT; txid 999 gets an outcome value no client knows;
/// `awaiting_ack` for odd txids when a participant id is given.
#[derive(Default)]
struct FakeNode {
    /// Each GetDecisions: (txids, participant_id, peer IP).
    asked: Mutex<Vec<Asked>>,
    /// Answer GetDecisions in reverse order (a broken node).
    reversed: bool,
    /// Answer this many Enlists UNAVAILABLE before accepting one.
    enlist_unavailable: AtomicU32,
    /// Refuse every Enlist with NOT_FOUND.
    enlist_not_found: bool,
    /// Enlist calls seen.
    enlists: AtomicU32,
    /// Status calls seen.
    statuses: AtomicU32,
    /// Answer Status as a follower that forwarded it to the leader at
    /// this address (named in the answer's metadata).
    forwarded_from: Mutex<Option<String>>,
    /// Refuse this many Status calls UNAVAILABLE (not applied) before
    /// answering one, as a follower that cannot forward...
    status_unavailable: AtomicU32,
    /// ... naming the leader at this address in the refusal, if any.
    refusal_hint: Mutex<Option<String>>,
}

fn outcome_of(txid: u64) -> i32 {
    if txid == 999 {
        return 42;
    }
    let o = match txid % 4 {
        0 => pb::Outcome::Pending,
        1 => pb::Outcome::Commit,
        2 => pb::Outcome::Abort,
        _ => pb::Outcome::UnknownPresumedAbort,
    };
    o as i32
}

/// A `FakeNode` as served (the test keeps another handle to look at it).
struct Served(Arc<FakeNode>);

impl std::ops::Deref for Served {
    type Target = FakeNode;

    fn deref(&self) -> &FakeNode {
        &self.0
    }
}

type Res<T> = Result<Response<T>, Status>;

#[tonic::async_trait]
impl Coordinator for Served {
    async fn register_branch(
        &self,
        _r: Request<pb::RegisterBranchRequest>,
    ) -> Result<Response<pb::RegisterBranchResponse>, Status> {
        Err(Status::unimplemented("not in this stand-in"))
    }
    async fn get_branch_decision(
        &self,
        _r: Request<pb::GetBranchDecisionRequest>,
    ) -> Result<Response<pb::GetBranchDecisionResponse>, Status> {
        Err(Status::unimplemented("not in this stand-in"))
    }
    async fn get_decisions(&self, r: Request<pb::GetDecisionsRequest>) -> Res<pb::GetDecisionsResponse> {
        let peer = r.remote_addr().map(|a| a.ip());
        let r = r.into_inner();
        if r.txids.len() > DECISION_BATCH_TXIDS_MAX {
            return Err(Status::invalid_argument("too many txids"));
        }
        self.asked
            .lock()
            .unwrap()
            .push((r.txids.clone(), r.participant_id.clone(), peer));
        let mut decisions: Vec<pb::GetDecisionResponse> = r
            .txids
            .iter()
            .map(|&txid| pb::GetDecisionResponse {
                txid,
                outcome: outcome_of(txid),
                awaiting_ack: !r.participant_id.is_empty() && txid % 2 == 1,
                settled_by: String::new(),
            })
            .collect();
        if self.reversed {
            decisions.reverse();
        }
        Ok(Response::new(pb::GetDecisionsResponse { decisions }))
    }
    async fn enlist(&self, r: Request<pb::EnlistRequest>) -> Res<pb::EnlistResponse> {
        self.enlists.fetch_add(1, Ordering::SeqCst);
        if self.enlist_not_found {
            return Err(Status::not_found(format!("transaction {} not found", r.get_ref().txid)));
        }
        let left = self.enlist_unavailable.load(Ordering::SeqCst);
        if left > 0 {
            self.enlist_unavailable.store(left - 1, Ordering::SeqCst);
            let mut s = Status::unavailable("no leader is known yet");
            s.metadata_mut()
                .insert(dtx_proto::metadata::NOT_APPLIED_HEADER, "1".parse().unwrap());
            return Err(s);
        }
        Ok(Response::new(pb::EnlistResponse { participant_count: 1 }))
    }
    async fn begin(&self, _: Request<pb::BeginRequest>) -> Res<pb::BeginResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn begin_and_commit(&self, _: Request<pb::BeginAndCommitRequest>) -> Res<pb::BeginAndCommitResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn commit(&self, _: Request<pb::CommitRequest>) -> Res<pb::CommitResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn abort(&self, _: Request<pb::AbortRequest>) -> Res<pb::AbortResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn status(&self, r: Request<pb::StatusRequest>) -> Res<pb::StatusResponse> {
        self.statuses.fetch_add(1, Ordering::SeqCst);
        let left = self.status_unavailable.load(Ordering::SeqCst);
        if left > 0 {
            self.status_unavailable.store(left - 1, Ordering::SeqCst);
            let mut s = Status::unavailable("not the leader, and cannot forward");
            s.metadata_mut()
                .insert(dtx_proto::metadata::NOT_APPLIED_HEADER, "1".parse().unwrap());
            if let Some(leader) = self.refusal_hint.lock().unwrap().clone() {
                s.metadata_mut()
                    .insert(dtx_proto::metadata::LEADER_ADDR_HEADER, leader.parse().unwrap());
            }
            return Err(s);
        }
        let mut answer = Response::new(pb::StatusResponse {
            txid: r.get_ref().txid,
            ..Default::default()
        });
        if let Some(leader) = self.forwarded_from.lock().unwrap().clone() {
            answer
                .metadata_mut()
                .insert(dtx_proto::metadata::LEADER_ADDR_HEADER, leader.parse().unwrap());
        }
        Ok(answer)
    }
    async fn get_decision(&self, _: Request<pb::GetDecisionRequest>) -> Res<pb::GetDecisionResponse> {
        Err(Status::unimplemented("fake"))
    }
}

/// Serves `node` on 127.0.0.1:0; its address.
async fn serve(node: Arc<FakeNode>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(CoordinatorServer::new(Served(node)))
            .serve_with_incoming(dtx_transport::incoming(listener)),
    );
    addr
}

fn quick(endpoints: Vec<String>) -> ClientConfig {
    let mut cfg = ClientConfig::new(endpoints);
    cfg.call_deadline = Duration::from_secs(5);
    cfg.attempt_timeout = Duration::from_secs(2);
    cfg.backoff_base = Duration::from_millis(1);
    cfg.backoff_max = Duration::from_millis(10);
    cfg
}

#[tokio::test]
async fn decisions_for_asks_in_batches_and_answers_in_order() {
    let node = Arc::new(FakeNode::default());
    let client = Client::new(quick(vec![serve(node.clone()).await])).unwrap();
    let txids: Vec<u64> = (1000..3500).collect(); // not 999
    let answers = client.decisions_for(&txids, "bank-a").await.unwrap();

    let sizes: Vec<usize> = node.asked.lock().unwrap().iter().map(|(t, _, _)| t.len()).collect();
    assert_eq!(sizes, [1024, 1024, 452]);
    assert!(node.asked.lock().unwrap().iter().all(|(_, p, _)| p == "bank-a"));
    assert_eq!(answers.len(), txids.len());
    for (a, t) in answers.iter().zip(&txids) {
        let want = match t % 4 {
            0 => DecisionRead::Pending,
            1 => DecisionRead::Committed,
            2 => DecisionRead::Aborted,
            _ => DecisionRead::UnknownPresumedAbort,
        };
        assert_eq!(
            *a,
            DecisionAnswer {
                txid: *t,
                decision: Some(want),
                awaiting_ack: t % 2 == 1,
                settled_by: String::new(),
            }
        );
    }
    // Without a participant id nothing awaits an ack.
    let plain = client.decision_for(7, "").await.unwrap();
    assert_eq!(
        plain,
        DecisionAnswer {
            txid: 7,
            decision: Some(DecisionRead::UnknownPresumedAbort),
            awaiting_ack: false,
            settled_by: String::new(),
        }
    );
    assert!(client.decisions_for(&[], "bank-a").await.unwrap().is_empty());
}

#[tokio::test]
async fn an_unknown_outcome_value_is_undecided_for_participants_and_an_error_for_decisions() {
    let node = Arc::new(FakeNode::default());
    let client = Client::new(quick(vec![serve(node).await])).unwrap();
    let a = client.decisions_for(&[1, 999], "bank-a").await.unwrap();
    assert_eq!(a[0].decision, Some(DecisionRead::Committed));
    assert_eq!(a[1].decision, None);
    match client.decisions(&[1, 999]).await {
        Err(ClientError::Internal(m)) => assert!(m.contains("999"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        client.decisions(&[1, 2]).await.unwrap(),
        [(1, DecisionRead::Committed), (2, DecisionRead::Aborted)]
    );
}

#[tokio::test]
async fn an_answer_out_of_order_is_retried_at_another_node_never_taken() {
    let broken = Arc::new(FakeNode {
        reversed: true,
        ..FakeNode::default()
    });
    let good = Arc::new(FakeNode::default());
    let client = Client::new(quick(vec![serve(broken.clone()).await, serve(good.clone()).await])).unwrap();
    let answers = client.decisions_for(&[1, 2, 3], "").await.unwrap();
    let got: Vec<u64> = answers.iter().map(|a| a.txid).collect();
    assert_eq!(got, [1, 2, 3]);
    assert_eq!(broken.asked.lock().unwrap().len(), 1);
    assert_eq!(good.asked.lock().unwrap().len(), 1);

    // With only the broken node: no answer, an error.
    let only_broken = Client::new(ClientConfig {
        call_deadline: Duration::from_millis(300),
        ..quick(vec![serve(broken).await])
    })
    .unwrap();
    match only_broken.decisions_for(&[1, 2, 3], "").await {
        Err(ClientError::Unavailable(m)) => assert!(m.contains("not in request order"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn connections_come_from_local_ip() {
    let node = Arc::new(FakeNode::default());
    let addr = serve(node.clone()).await;
    let source: IpAddr = "127.0.0.2".parse().unwrap();
    let client = Client::new(ClientConfig {
        local_ip: Some(source),
        ..quick(vec![addr.clone()])
    })
    .unwrap();
    client.decision_for(1, "bank-a").await.unwrap();
    let any = Client::new(quick(vec![addr])).unwrap();
    any.decision_for(1, "bank-a").await.unwrap();
    let peers: Vec<Option<IpAddr>> = node.asked.lock().unwrap().iter().map(|(_, _, ip)| *ip).collect();
    assert_eq!(peers, [Some(source), Some("127.0.0.1".parse().unwrap())]);
}

#[tokio::test]
async fn enlist_self_retries_until_a_node_answers() {
    let down = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let down_addr = down.local_addr().unwrap().to_string();
    drop(down); // connection refused
    let node = Arc::new(FakeNode {
        enlist_unavailable: AtomicU32::new(3),
        ..FakeNode::default()
    });
    let endpoints = vec![down_addr, serve(node.clone()).await];
    let n = enlist::enlist_self(&endpoints, 5, "inventory", "127.0.0.1:7300", b"w")
        .await
        .unwrap();
    assert_eq!(n, 1);
    assert_eq!(
        node.enlists.load(Ordering::SeqCst),
        4,
        "three refusals, then the enlist"
    );
}

#[tokio::test]
async fn enlist_self_returns_a_definite_refusal_at_once() {
    let node = Arc::new(FakeNode {
        enlist_not_found: true,
        ..FakeNode::default()
    });
    let endpoints = vec![serve(node.clone()).await];
    match enlist::enlist_self(&endpoints, 5, "inventory", "127.0.0.1:7300", b"w").await {
        Err(ClientError::NotFound(m)) => assert!(m.contains("transaction 5"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(node.enlists.load(Ordering::SeqCst), 1);
    assert!(matches!(
        enlist::enlist_self(&[], 5, "inventory", "127.0.0.1:7300", b"w").await,
        Err(ClientError::InvalidArgument(_))
    ));
}

/// A follower's forwarded answer names the leader: the client's next calls
/// go to the leader directly, when it is one of the client's endpoints
/// (given in another form, the client's form is kept); a leader that is
/// not one of them (the client goes through a proxy) is not adopted.
#[tokio::test]
async fn a_forwarded_answer_sends_the_next_calls_to_the_leader() {
    let follower = Arc::new(FakeNode::default());
    let leader = Arc::new(FakeNode::default());
    let follower_addr = serve(follower.clone()).await;
    let leader_addr = serve(leader.clone()).await;
    *follower.forwarded_from.lock().unwrap() = Some(leader_addr.clone());
    // The leader given with a scheme: the hint names it without one.
    let c = Client::new(quick(vec![follower_addr.clone(), format!("http://{leader_addr}")])).unwrap();
    for t in 1..=5 {
        assert_eq!(c.status(t).await.unwrap().txid, t);
    }
    assert_eq!(
        follower.statuses.load(Ordering::SeqCst),
        1,
        "only the first call went to the follower"
    );
    assert_eq!(leader.statuses.load(Ordering::SeqCst), 4);

    // Given only the follower (a proxy in front of the cluster): the
    // leader it names is not one of the endpoints, so calls stay there.
    let proxy = Arc::new(FakeNode::default());
    let proxy_addr = serve(proxy.clone()).await;
    *proxy.forwarded_from.lock().unwrap() = Some(leader_addr.clone());
    let c = Client::new(quick(vec![proxy_addr])).unwrap();
    for t in 1..=3 {
        c.status(t).await.unwrap();
    }
    assert_eq!(proxy.statuses.load(Ordering::SeqCst), 3);
    assert_eq!(
        leader.statuses.load(Ordering::SeqCst),
        4,
        "the leader was not reached around the proxy"
    );
}

/// A refusal that names the leader sends the next attempt there when it is
/// one of the client's endpoints (given in another form, the client's form
/// is kept), not to the next endpoint in turn.
#[tokio::test]
async fn a_refusal_naming_one_of_the_endpoints_is_followed() {
    let follower = Arc::new(FakeNode::default());
    let other = Arc::new(FakeNode::default());
    let leader = Arc::new(FakeNode::default());
    let follower_addr = serve(follower.clone()).await;
    let other_addr = serve(other.clone()).await;
    let leader_addr = serve(leader.clone()).await;
    follower.status_unavailable.store(1, Ordering::SeqCst);
    *follower.refusal_hint.lock().unwrap() = Some(leader_addr.clone());
    // The leader given with a scheme: the hint names it without one.
    let c = Client::new(quick(vec![follower_addr, other_addr, format!("http://{leader_addr}")])).unwrap();
    for t in 1..=3 {
        assert_eq!(c.status(t).await.unwrap().txid, t);
    }
    assert_eq!(follower.statuses.load(Ordering::SeqCst), 1, "refused once");
    assert_eq!(
        other.statuses.load(Ordering::SeqCst),
        0,
        "the next attempt went to the hinted leader, not the next endpoint"
    );
    assert_eq!(leader.statuses.load(Ordering::SeqCst), 3);
    assert_eq!(*c.leader.lock().unwrap(), Some(format!("http://{leader_addr}")));
}

/// A refusal that names a leader which is not one of the client's
/// endpoints (the client goes through a proxy) is not followed: the client
/// forgets its leader and goes round its endpoints, never around the proxy.
#[tokio::test]
async fn a_refusal_naming_an_address_outside_the_endpoints_is_not_followed() {
    let proxy = Arc::new(FakeNode::default());
    let outside = Arc::new(FakeNode::default());
    let proxy_addr = serve(proxy.clone()).await;
    let outside_addr = serve(outside.clone()).await;
    proxy.status_unavailable.store(2, Ordering::SeqCst);
    *proxy.refusal_hint.lock().unwrap() = Some(outside_addr);
    let c = Client::new(quick(vec![proxy_addr])).unwrap();
    for t in 1..=3 {
        assert_eq!(c.status(t).await.unwrap().txid, t);
    }
    assert_eq!(
        proxy.statuses.load(Ordering::SeqCst),
        5,
        "two refusals, then three answers"
    );
    assert_eq!(
        outside.statuses.load(Ordering::SeqCst),
        0,
        "the hinted address outside the endpoints was never called"
    );
    assert_eq!(*c.leader.lock().unwrap(), None);
}
