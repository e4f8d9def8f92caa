//! Self-enlistment: a service that receives a transaction id from its
//! caller (in the `x-dtx-txid` metadata, see [`crate::propagate`]) enlists
//! itself in that transaction before doing the work, so the client need not
//! know every participant at begin.
//!
//! A service that enlists on many requests should keep one [`Client`] and
//! call [`Client::enlist`] (one connection per node, the leader remembered);
//! [`enlist_self`] is the one-call form. Both use the client's retry policy
//! (see [`crate::backoff`]). The module documentation of
//! [`crate::propagate`] has a running example.

use crate::Client;
use crate::ClientConfig;
use crate::ClientError;

/// Enlists `participant_id` (reachable at `address`) in `txid` through any
/// of the coordinator `endpoints` (followers forward to the leader), with a
/// client of the default [`ClientConfig`]: retries with backoff at the
/// other nodes until a definite answer or the call deadline. Enlisting
/// again with the same address and payload is a no-op, so retrying is safe.
/// Returns the participant count.
///
/// Errors: a definite refusal (the transaction is gone
/// ([`ClientError::NotFound`]), already committing
/// ([`ClientError::FailedPrecondition`]), or the request is malformed, an
/// address unusable ([`ClientError::InvalidArgument`])), or
/// [`ClientError::Unknown`] when no definite answer came: the service may
/// or may not be enlisted; call again (enlisting is idempotent) or fail the
/// caller's request.
pub async fn enlist_self(
    endpoints: &[String],
    txid: u64,
    participant_id: &str,
    address: &str,
    payload: &[u8],
) -> Result<u32, ClientError> {
    let client = Client::new(ClientConfig::new(endpoints.to_vec()))?;
    client.enlist(txid, participant_id, address, payload).await
}
