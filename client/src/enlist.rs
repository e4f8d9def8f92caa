//! Self-enlistment: a service that receives a transaction id from its
//! caller (`dtx_proto::txid_of`) enlists itself in that transaction before
//! doing the work, so the client need not know every participant at begin.

use std::time::Duration;

use dtx_proto::v1 as pb;
use dtx_proto::v1::coordinator_client::CoordinatorClient;

/// Enlists `participant_id` (reachable at `address`) in `txid` through any
/// of the coordinator `endpoints` (followers forward to the leader),
/// trying each in turn. Enlisting again with the same address and payload
/// is a no-op, so retrying is safe. Returns the participant count.
pub async fn enlist_self(
    endpoints: &[String],
    txid: u64,
    participant_id: &str,
    address: &str,
    payload: &[u8],
) -> Result<u32, tonic::Status> {
    let mut last = tonic::Status::unavailable("no coordinator endpoint given");
    for round in 0..3u64 {
        for ep in endpoints {
            let endpoint = dtx_proto::endpoint(ep).map_err(tonic::Status::invalid_argument)?;
            let ch = endpoint.connect_timeout(Duration::from_millis(500)).connect_lazy();
            let mut req = tonic::Request::new(pb::EnlistRequest {
                txid,
                participant_id: participant_id.to_string(),
                address: address.to_string(),
                payload: payload.to_vec(),
            });
            req.set_timeout(Duration::from_secs(3));
            match CoordinatorClient::new(ch).enlist(req).await {
                Ok(r) => return Ok(r.into_inner().participant_count),
                // Definite answers: the transaction is gone, decided, full...
                Err(s) if !matches!(s.code(), tonic::Code::Unavailable | tonic::Code::DeadlineExceeded) => {
                    return Err(s)
                }
                Err(s) => last = s,
            }
        }
        tokio::time::sleep(Duration::from_millis(100 * (round + 1))).await;
    }
    Err(last)
}
