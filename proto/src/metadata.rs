//! gRPC metadata keys of the wire contract and their readers. Every key a
//! node, a client or a participant sets or reads is named here once.

use tonic::Status;

/// gRPC metadata key that carries a transaction id from a client to the
/// services it calls, so a service can do its work under that transaction
/// and enlist itself (see `dtx_client::enlist`).
pub const TXID_METADATA_KEY: &str = "x-dtx-txid";

/// Puts `txid` into a request's metadata.
pub fn attach_txid<T>(req: &mut tonic::Request<T>, txid: u64) {
    req.metadata_mut().insert(TXID_METADATA_KEY, txid.into());
}

/// The transaction id a request carries, if any (and if well-formed).
pub fn txid_of<T>(req: &tonic::Request<T>) -> Option<u64> {
    req.metadata()
        .get(TXID_METADATA_KEY)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse().ok())
}

/// On a refusal by a follower: the id of the leader it knows.
pub const LEADER_ID_HEADER: &str = "x-dtx-leader-id";
/// On a refusal by a follower: the API address of the leader it knows.
pub const LEADER_ADDR_HEADER: &str = "x-dtx-leader-addr";
/// Set by a node on a call it forwards to the leader (a forwarded call is
/// never forwarded again).
pub const FORWARDED_HEADER: &str = "x-dtx-forwarded";
/// Set on a refusal that happened before anything was proposed: the call
/// certainly had no effect (a client may report it as a plain failure).
pub const NOT_APPLIED_HEADER: &str = "x-dtx-not-applied";
/// On every Raft transport call: the cluster id of the sender.
pub const CLUSTER_ID_HEADER: &str = "x-dtx-cluster-id";
/// On every Raft transport call: the node id of the sender.
pub const FROM_NODE_HEADER: &str = "x-dtx-from-node";

/// True when the status says the call certainly had no effect.
pub fn not_applied(status: &Status) -> bool {
    status.metadata().get(NOT_APPLIED_HEADER).is_some()
}

/// The leader's API address a refusal names, if any.
pub fn leader_hint(status: &Status) -> Option<String> {
    status
        .metadata()
        .get(LEADER_ADDR_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}
