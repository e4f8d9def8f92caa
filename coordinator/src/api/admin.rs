//! The `Admin` service: cluster status, membership, snapshots, and the
//! operator's write-once `Resolve`.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use dtx_proto::v1 as pb;
use dtx_proto::v1::admin_client::AdminClient;
use dtx_proto::v1::admin_server::Admin;
use openraft::error::ClientWriteError;
use openraft::error::RaftError;
use openraft::ChangeMembers;
use tonic::Request;
use tonic::Response;
use tonic::Status;

use super::check_id;
use super::check_len;
use super::coordinator::outcome_pb;
use super::error::ApiError;
use super::serve_or_forward;
use crate::ctx::NodeCtx;
use crate::driver::Driver;
use crate::limits;
use crate::raft::NodeId;
use crate::raft::NodeInfo;
use crate::sm::Command;
use crate::sm::CommandOk;

/// Membership changes made through this node run one at a time, so an
/// AddNode cannot pass its retired-id check while a RemoveNode of the same id
/// is between recording the id and changing the membership.
static MEMBERSHIP_CHANGES: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

pub struct AdminService {
    driver: Arc<Driver>,
}

impl AdminService {
    pub fn new(driver: Arc<Driver>) -> Self {
        AdminService { driver }
    }

    fn ctx(&self) -> &Arc<NodeCtx> {
        &self.driver.ctx
    }
}

fn membership_error(e: RaftError<NodeId, ClientWriteError<NodeId, NodeInfo>>) -> ApiError {
    match e {
        RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => ApiError::NotLeader {
            leader_id: f.leader_id,
            leader_api_addr: f.leader_node.map(|n| n.api_addr),
            proposed: true,
        },
        RaftError::APIError(ClientWriteError::ChangeMembershipError(c)) => ApiError::FailedPrecondition(c.to_string()),
        RaftError::Fatal(f) => ApiError::Unavailable(f.to_string()),
    }
}

impl AdminService {
    fn voters(&self) -> Vec<u64> {
        self.ctx()
            .raft
            .metrics()
            .borrow()
            .membership_config
            .membership()
            .voter_ids()
            .collect()
    }

    /// This node's view: Raft's position, whether it serves (the same
    /// verdict as its health services, from `raft::serving`), and per
    /// member the matched index and lag (the leader only: openraft's
    /// replication metrics) and the reach (see `serving::member_reach`).
    fn cluster_status(&self, serving: Option<&crate::raft::serving::Monitor>) -> pb::ClusterStatusResponse {
        let m = self.ctx().raft.metrics().borrow().clone();
        let membership = m.membership_config.membership();
        let voters: BTreeSet<u64> = membership.voter_ids().collect();
        let leader_api_addr = m
            .current_leader
            .and_then(|l| membership.get_node(&l))
            .map(|n| n.api_addr.clone())
            .unwrap_or_default();
        let last_log_index = m.last_log_index.unwrap_or(0);
        let (serving_now, not_serving_reason) = match serving {
            Some(s) => {
                let v = s.status().verdict;
                (v.serving, v.reason)
            }
            None => (false, "this node does not track whether it serves".to_string()),
        };
        let member = |id: u64, n: &NodeInfo| {
            let voter = voters.contains(&id);
            // The leader's replication metrics: the matched log id per
            // member (itself included, as its own last log index).
            let matched_index = match &m.replication {
                Some(_) if id == m.id => Some(last_log_index),
                Some(r) => Some(r.get(&id).cloned().flatten().map(|l| l.index).unwrap_or(0)),
                None => None,
            };
            let (reach, last_heard_ms_ago) = match serving {
                Some(s) => s.member_reach(m.id, id, voter, m.current_leader),
                None => (pb::MemberReach::Unspecified, 0),
            };
            pb::NodeStatus {
                node_id: id,
                raft_addr: n.raft_addr.clone(),
                api_addr: n.api_addr.clone(),
                voter,
                matched_index: matched_index.unwrap_or(0),
                lag_entries: matched_index.map(|i| last_log_index.saturating_sub(i)).unwrap_or(0),
                reach: reach as i32,
                last_heard_ms_ago,
            }
        };
        pb::ClusterStatusResponse {
            cluster_id: self.ctx().config.cluster_id.clone(),
            node_id: self.ctx().id,
            role: format!("{:?}", m.state),
            leader_id: m.current_leader.unwrap_or(0),
            leader_api_addr,
            term: m.current_term,
            last_log_index,
            last_applied_index: m.last_applied.map(|l| l.index).unwrap_or(0),
            snapshot_index: m.snapshot.map(|l| l.index).unwrap_or(0),
            purged_index: m.purged.map(|l| l.index).unwrap_or(0),
            members: membership.nodes().map(|(id, n)| member(*id, n)).collect(),
            transactions: self.ctx().sm.state().transactions(),
            next_txid: self.ctx().sm.state().table.next_txid(),
            serving: serving_now,
            not_serving_reason,
            incarnation: self.ctx().sm.state().incarnations.current().unwrap_or(0),
        }
    }

    async fn add_node(&self, req: pb::AddNodeRequest) -> Result<pb::AddNodeResponse, ApiError> {
        if req.node_id == 0 {
            return Err(ApiError::InvalidArgument("node_id must be > 0".into()));
        }
        for (field, v) in [("raft_addr", &req.raft_addr), ("api_addr", &req.api_addr)] {
            v.parse::<std::net::SocketAddr>()
                .map_err(|e| ApiError::InvalidArgument(format!("{field} = {v:?} is not an IP:port address: {e}")))?;
        }
        let _serial = MEMBERSHIP_CHANGES.lock().await;
        // Node ids are never reused: a removed node may still run with its
        // old log and vote, and Raft would take its messages (and its old
        // vote in a term it already voted in) as the new member's. The read
        // is linearizable, so a removal applied anywhere before is seen.
        let id = req.node_id;
        if self
            .ctx()
            .read_linearizable(|st| st.table.is_retired_node_id(id))
            .await?
        {
            return Err(ApiError::FailedPrecondition(format!(
                "node id {id} belonged to a node that was removed from this cluster, and node ids are never reused \
                 (the removed node may still run with its old log and vote, which Raft would take for the new \
                 node's); start the new node with an id this cluster never used, on an empty data directory"
            )));
        }
        let node = NodeInfo {
            raft_addr: req.raft_addr,
            api_addr: req.api_addr,
        };
        // Learner first: it receives the log (or a snapshot) until it has
        // caught up, then it may become a voter without stalling the quorum.
        // Not openraft's blocking mode: it waits without a time limit when
        // the new node is down. We bound the wait ourselves below.
        self.ctx()
            .raft
            .add_learner(req.node_id, node, false)
            .await
            .map_err(membership_error)?;
        if req.voter {
            // Promote only a learner that has really caught up: a voter that
            // cannot be reached would shrink the fault tolerance to zero.
            let target = self.ctx().raft.metrics().borrow().last_log_index.unwrap_or(0);
            let id = req.node_id;
            let caught_up = self
                .ctx()
                .raft
                .wait(Some(Duration::from_secs(30)))
                .metrics(
                    |m| {
                        m.replication
                            .as_ref()
                            .and_then(|r| r.get(&id).cloned().flatten())
                            .map(|matched| matched.index >= target)
                            .unwrap_or(false)
                    },
                    "learner caught up",
                )
                .await;
            if caught_up.is_err() {
                return Err(ApiError::FailedPrecondition(format!(
                    "node {id} was added as a learner but has not caught up to log index {target} within 30 s; \
                     it stays a learner (check that it runs and is reachable, then retry AddNode)"
                )));
            }
            let ids: BTreeSet<NodeId> = [req.node_id].into();
            self.ctx()
                .raft
                .change_membership(ChangeMembers::AddVoterIds(ids), false)
                .await
                .map_err(membership_error)?;
        }
        Ok(pb::AddNodeResponse { voters: self.voters() })
    }

    async fn remove_node(&self, req: pb::RemoveNodeRequest) -> Result<pb::RemoveNodeResponse, ApiError> {
        let _serial = MEMBERSHIP_CHANGES.lock().await;
        let ids: BTreeSet<NodeId> = [req.node_id].into();
        let membership = self
            .ctx()
            .raft
            .metrics()
            .borrow()
            .membership_config
            .membership()
            .clone();
        if membership.get_node(&req.node_id).is_none() {
            return Err(ApiError::NotFound(format!("node {} is not a member", req.node_id)));
        }
        // Remember the id BEFORE the membership changes, so that a removal
        // that happened is always remembered (a crash in between leaves the
        // id retired and still a member: RemoveNode again finishes it).
        match self
            .ctx()
            .propose(Command::RetireNodeId { node_id: req.node_id })
            .await?
        {
            CommandOk::NodeIdRetired { .. } => {}
            other => return Err(ApiError::Internal(format!("unexpected state-machine result {other:?}"))),
        }
        if membership.voter_ids().any(|v| v == req.node_id) {
            self.ctx()
                .raft
                .change_membership(ChangeMembers::RemoveVoters(ids.clone()), false)
                .await
                .map_err(membership_error)?;
        }
        self.ctx()
            .raft
            .change_membership(ChangeMembers::RemoveNodes(ids), false)
            .await
            .map_err(membership_error)?;
        Ok(pb::RemoveNodeResponse { voters: self.voters() })
    }

    async fn trigger_snapshot(&self) -> Result<pb::TriggerSnapshotResponse, ApiError> {
        let target = self
            .ctx()
            .raft
            .metrics()
            .borrow()
            .last_applied
            .map(|l| l.index)
            .unwrap_or(0);
        self.ctx()
            .raft
            .trigger()
            .snapshot()
            .await
            .map_err(|e| ApiError::Unavailable(e.to_string()))?;
        let wait = self
            .ctx()
            .raft
            .wait(Some(Duration::from_secs(30)))
            .metrics(|m| m.snapshot.map(|s| s.index).unwrap_or(0) >= target, "snapshot built")
            .await;
        let m = wait.map_err(|e| ApiError::Unavailable(format!("snapshot not built in time: {e}")))?;
        Ok(pb::TriggerSnapshotResponse {
            snapshot_index: m.snapshot.map(|s| s.index).unwrap_or(0),
        })
    }

    async fn resolve(&self, req: pb::ResolveRequest) -> Result<pb::ResolveResponse, ApiError> {
        if req.participant_lost {
            return super::admin_txn::declare_lost(&self.driver, req).await;
        }
        check_id("operator", &req.operator)?;
        check_len("reason", req.reason.len(), limits::REASON_BYTES_MAX)?;
        let outcome = super::operator_outcome(req.outcome)?;
        for v in &req.voters {
            check_id("voters", v)?;
        }
        let note = format!("operator {}: {}", req.operator, req.reason);
        let (d, recorded) = self.driver.resolve(req.txid, outcome, &req.voters, note).await?;
        Ok(pb::ResolveResponse {
            outcome: outcome_pb(d.outcome) as i32,
            recorded,
        })
    }
}

#[tonic::async_trait]
impl Admin for AdminService {
    async fn cluster_status(
        &self,
        req: Request<pb::ClusterStatusRequest>,
    ) -> Result<Response<pb::ClusterStatusResponse>, Status> {
        // The node's serving monitor rides in the request (put there by
        // the layer `node` builds the servers with).
        let serving = req.extensions().get::<crate::raft::serving::Monitor>();
        Ok(Response::new(self.cluster_status(serving)))
    }

    async fn add_node(&self, req: Request<pb::AddNodeRequest>) -> Result<Response<pb::AddNodeResponse>, Status> {
        serve_or_forward(
            self.ctx(),
            req,
            |r| async move { self.add_node(r).await },
            |ch, r| async move { AdminClient::new(ch).add_node(r).await },
        )
        .await
    }

    async fn remove_node(
        &self,
        req: Request<pb::RemoveNodeRequest>,
    ) -> Result<Response<pb::RemoveNodeResponse>, Status> {
        serve_or_forward(
            self.ctx(),
            req,
            |r| async move { self.remove_node(r).await },
            |ch, r| async move { AdminClient::new(ch).remove_node(r).await },
        )
        .await
    }

    async fn trigger_snapshot(
        &self,
        _req: Request<pb::TriggerSnapshotRequest>,
    ) -> Result<Response<pb::TriggerSnapshotResponse>, Status> {
        Ok(Response::new(self.trigger_snapshot().await?))
    }

    async fn resolve(&self, mut req: Request<pb::ResolveRequest>) -> Result<Response<pb::ResolveResponse>, Status> {
        // With authentication on, the decision records who proved to be
        // calling, not a name the caller typed.
        if let Some(id) = crate::security::caller(&req) {
            req.get_mut().operator = id.name;
        }
        serve_or_forward(
            self.ctx(),
            req,
            |r| async move { self.resolve(r).await },
            |ch, r| async move { AdminClient::new(ch).resolve(r).await },
        )
        .await
    }

    async fn list_transactions(
        &self,
        req: Request<pb::ListTransactionsRequest>,
    ) -> Result<Response<pb::ListTransactionsResponse>, Status> {
        super::admin_txn::list_transactions(&self.driver, req).await
    }

    async fn drop_participant(
        &self,
        req: Request<pb::DropParticipantRequest>,
    ) -> Result<Response<pb::DropParticipantResponse>, Status> {
        super::admin_txn::drop_participant(&self.driver, req).await
    }

    async fn forget_transaction(
        &self,
        req: Request<pb::ForgetTransactionRequest>,
    ) -> Result<Response<pb::ForgetTransactionResponse>, Status> {
        super::admin_txn::forget_transaction(&self.driver, req).await
    }

    async fn settle_other(
        &self,
        req: Request<pb::SettleOtherRequest>,
    ) -> Result<Response<pb::SettleOtherResponse>, Status> {
        super::admin_settle::settle_other(&self.driver, req).await
    }

    type BackupStream = tonic::codegen::BoxStream<pb::BackupChunk>;

    async fn backup(&self, req: Request<pb::BackupRequest>) -> Result<Response<Self::BackupStream>, Status> {
        super::backup::backup(self.ctx(), req.into_inner()).await
    }
}
