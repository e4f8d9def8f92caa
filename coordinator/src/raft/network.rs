//! openraft's network client over the `RaftTransport` gRPC service.
//!
//! Outgoing connections are bound to this node's own IP (when it has a
//! specific one), so that firewall rules or test proxies can tell the nodes
//! apart by source address (docs/adr/0005-two-addresses-per-node.md).

use std::net::IpAddr;
use std::time::Duration;

use dtx_proto::v1::raft_transport_client::RaftTransportClient;
use dtx_proto::v1::RaftMessage;
use dtx_transport::channel::Channel;
use openraft::error::InstallSnapshotError;
use openraft::error::NetworkError;
use openraft::error::RPCError;
use openraft::error::RaftError;
use openraft::error::RemoteError;
use openraft::error::Unreachable;
use openraft::network::RPCOption;
use openraft::network::RaftNetwork;
use openraft::network::RaftNetworkFactory;
use openraft::raft::AppendEntriesRequest;
use openraft::raft::AppendEntriesResponse;
use openraft::raft::InstallSnapshotRequest;
use openraft::raft::InstallSnapshotResponse;
use openraft::raft::VoteRequest;
use openraft::raft::VoteResponse;
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::deferred_commit::DeferredCommit;
use super::NodeId;
use super::NodeInfo;
use super::TypeConfig;
use crate::codec;

/// Metadata keys on every Raft call.
pub use dtx_proto::metadata::CLUSTER_ID_HEADER;
pub use dtx_proto::metadata::FROM_NODE_HEADER;
pub use dtx_transport::channel::channel;
pub use dtx_transport::channel::ChannelCache;

#[derive(Clone)]
pub struct NetworkSettings {
    pub cluster_id: String,
    pub self_id: NodeId,
    /// Source IP for outgoing connections (None: let the OS choose).
    pub local_ip: Option<IpAddr>,
    pub max_message_bytes: usize,
    pub connect_timeout: Duration,
    /// TLS (with this node's certificate) for calls to other nodes.
    pub tls: Option<std::sync::Arc<dtx_tls::ClientTls>>,
    /// This node's Raft log: the commit index told to followers never
    /// passes what it has on disk (`raft::log_durability`, rule 2).
    pub log_durability: std::sync::Arc<super::log_durability::LogDurability>,
    /// No AppendEntries (heartbeats included) leaves while the log's sync
    /// has stalled for longer than this (`raft.election_timeout_min_ms`),
    /// so a leader whose disk hangs is replaced.
    pub log_sync_stall_max: Duration,
    /// `raft.commit_index_defer_max_ms`: an AppendEntries without entries
    /// to a follower that accepted one at the same place less than this
    /// long ago is answered here, not sent (`raft::deferred_commit`, ADR
    /// 0031). Zero: every one leaves.
    pub commit_index_defer_max: Duration,
}

/// Builds one `Connection` per target node. Channels are cached per address:
/// openraft asks for a new client for every read-index round, and a fresh
/// TCP + HTTP/2 handshake each time would cost more than the round itself.
#[derive(Clone)]
pub struct Network {
    pub settings: NetworkSettings,
    channels: std::sync::Arc<ChannelCache>,
}

impl Network {
    pub fn new(settings: NetworkSettings) -> Self {
        let channels = std::sync::Arc::new(
            ChannelCache::new(settings.local_ip, settings.connect_timeout).with_tls(settings.tls.clone()),
        );
        Network { settings, channels }
    }
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = Connection;

    async fn new_client(&mut self, target: NodeId, node: &NodeInfo) -> Connection {
        let client = self.channels.get(&node.raft_addr).ok().map(|ch| {
            RaftTransportClient::new(ch)
                .max_decoding_message_size(self.settings.max_message_bytes)
                .max_encoding_message_size(self.settings.max_message_bytes)
        });
        Connection {
            target,
            addr: node.raft_addr.clone(),
            client,
            deferred: DeferredCommit::new(self.settings.commit_index_defer_max),
            settings: self.settings.clone(),
        }
    }
}

pub struct Connection {
    target: NodeId,
    addr: String,
    client: Option<RaftTransportClient<Channel>>,
    settings: NetworkSettings,
    deferred: DeferredCommit,
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct TransportError(String);

impl Connection {
    async fn call<Req, Resp, E>(
        &mut self,
        kind: &'static str,
        req: &Req,
        option: &RPCOption,
    ) -> Result<Resp, RPCError<NodeId, NodeInfo, RaftError<NodeId, E>>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let Some(client) = self.client.as_mut() else {
            let e = TransportError(format!(
                "node {} has an invalid raft address {:?}",
                self.target, self.addr
            ));
            return Err(RPCError::Unreachable(Unreachable::new(&e)));
        };
        let payload = codec::encode(req).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        let mut request = tonic::Request::new(RaftMessage { payload });
        request.set_timeout(option.hard_ttl());
        let md = request.metadata_mut();
        md.insert(
            CLUSTER_ID_HEADER,
            self.settings
                .cluster_id
                .parse()
                .expect("cluster id is ASCII (validated)"),
        );
        md.insert(FROM_NODE_HEADER, self.settings.self_id.into());
        let result = match kind {
            "append" => client.append_entries(request).await,
            "vote" => client.vote(request).await,
            _ => client.install_snapshot(request).await,
        };
        let reply = result.map_err(|status| {
            let e = TransportError(format!("{kind} to node {} at {}: {status}", self.target, self.addr));
            match status.code() {
                tonic::Code::Unavailable | tonic::Code::Cancelled => RPCError::Unreachable(Unreachable::new(&e)),
                _ => RPCError::Network(NetworkError::new(&e)),
            }
        })?;
        let decoded: Result<Resp, RaftError<NodeId, E>> =
            codec::decode(&reply.into_inner().payload).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        decoded.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }
}

impl RaftNetwork<TypeConfig> for Connection {
    async fn append_entries(
        &mut self,
        mut rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, NodeInfo, RaftError<NodeId>>> {
        let durability = &self.settings.log_durability;
        if let Some(stalled) = durability
            .sync_stalled_for(std::time::Instant::now())
            .filter(|s| *s > self.settings.log_sync_stall_max)
        {
            metrics::counter!("dtx_raft_appends_held_for_log_sync_total").increment(1);
            let e = TransportError(format!(
                "append to node {} not sent: this node's Raft log has waited {} ms for its fsync (more than raft.election_timeout_min_ms = {} ms); the followers elect another leader if it goes on",
                self.target,
                stalled.as_millis(),
                self.settings.log_sync_stall_max.as_millis()
            ));
            return Err(RPCError::Unreachable(Unreachable::new(&e)));
        }
        rpc.leader_commit = durability.clamp_commit(rpc.leader_commit);
        let now = std::time::Instant::now();
        if self
            .deferred
            .may_skip(&rpc.vote, rpc.prev_log_id.as_ref(), rpc.entries.is_empty(), now)
        {
            // The commit index rides in this follower's next AppendEntries.
            metrics::counter!("dtx_raft_appends_deferred_total").increment(1);
            return Ok(AppendEntriesResponse::Success);
        }
        let end = rpc.entries.last().map(|e| e.log_id).or(rpc.prev_log_id);
        let vote = rpc.vote;
        self.deferred.sending();
        let answer = self.call("append", &rpc, &option).await;
        if matches!(answer, Ok(AppendEntriesResponse::Success)) {
            self.deferred.accepted(vote, end, now);
        }
        answer
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<InstallSnapshotResponse<NodeId>, RPCError<NodeId, NodeInfo, RaftError<NodeId, InstallSnapshotError>>>
    {
        self.call("snapshot", &rpc, &option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, NodeInfo, RaftError<NodeId>>> {
        self.call("vote", &rpc, &option).await
    }

    fn backoff(&self) -> openraft::network::Backoff {
        // Retry an unreachable peer every 200 ms rather than openraft's 500 ms,
        // so a restarted node catches up quickly.
        openraft::network::Backoff::new(std::iter::repeat(Duration::from_millis(200)))
    }
}
