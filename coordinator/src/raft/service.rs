//! The `RaftTransport` gRPC service: decodes openraft messages, hands them to
//! the local Raft, encodes the result. Calls for another cluster are refused.

use dtx_proto::v1::raft_transport_server::RaftTransport;
use dtx_proto::v1::ProbeRequest;
use dtx_proto::v1::ProbeResponse;
use dtx_proto::v1::RaftMessage;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tonic::Request;
use tonic::Response;
use tonic::Status;

use super::network::CLUSTER_ID_HEADER;
use super::Raft;
use crate::codec;

pub struct RaftService {
    pub raft: Raft,
    pub cluster_id: String,
}

impl RaftService {
    fn check_and_decode<T: DeserializeOwned>(&self, req: Request<RaftMessage>) -> Result<T, Status> {
        self.check_cluster(&req)?;
        codec::decode(&req.into_inner().payload)
            .map_err(|e| Status::invalid_argument(format!("undecodable raft message: {e}")))
    }

    /// Refuses a call that does not come from this cluster.
    fn check_cluster<T>(&self, req: &Request<T>) -> Result<(), Status> {
        let cluster = req
            .metadata()
            .get(CLUSTER_ID_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if cluster != self.cluster_id {
            metrics::counter!("dtx_raft_foreign_cluster_calls_total").increment(1);
            return Err(Status::failed_precondition(format!(
                "this node belongs to cluster {:?}, the call came from cluster {:?}",
                self.cluster_id, cluster
            )));
        }
        Ok(())
    }
}

fn reply<T: Serialize>(value: &T) -> Result<Response<RaftMessage>, Status> {
    let payload = codec::encode(value).map_err(|e| Status::internal(format!("cannot encode raft reply: {e}")))?;
    Ok(Response::new(RaftMessage { payload }))
}

#[tonic::async_trait]
impl RaftTransport for RaftService {
    async fn append_entries(&self, req: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        let rpc: openraft::raft::AppendEntriesRequest<crate::raft::TypeConfig> = self.check_and_decode(req)?;
        // A follower that takes heartbeats but no entries, as behind a
        // lossy link that drops the large messages (tests only,
        // `failpoints`: t23).
        if !rpc.entries.is_empty() && dtx_failpoint::refused("raft_accept_entries") {
            return Err(Status::unavailable("entries refused at failpoint raft_accept_entries"));
        }
        reply(&self.raft.append_entries(rpc).await)
    }

    async fn vote(&self, req: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        let rpc = self.check_and_decode(req)?;
        reply(&self.raft.vote(rpc).await)
    }

    async fn install_snapshot(&self, req: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        let rpc = self.check_and_decode(req)?;
        reply(&self.raft.install_snapshot(rpc).await)
    }

    async fn probe(&self, req: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        self.check_cluster(&req)?;
        let node_id = self.raft.metrics().borrow().id;
        Ok(Response::new(ProbeResponse { node_id }))
    }
}
