//! Rust client for the coordinator API.
//!
//! - Leader discovery: it follows the `x-dtx-leader-addr` hint and otherwise
//!   tries the configured endpoints in turn (any node forwards to the leader).
//! - Retries with exponential backoff and full jitter, within one overall
//!   deadline per call. Every write we expose is safe to retry: Begin is
//!   idempotent by key, Enlist is idempotent, Decide is write-once.
//! - A write whose outcome could not be learned before the deadline returns
//!   UNKNOWN (`ClientError::Unknown` or `TxOutcome::Unknown`), never a
//!   failure: it may have been applied.

pub mod enlist;

use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use dtx_proto::v1 as pb;
use dtx_proto::v1::admin_client::AdminClient;
use dtx_proto::v1::coordinator_client::CoordinatorClient;
use rand::Rng;
use tokio::time::Instant;
use tonic::transport::Channel;
use tonic::Code;
use tonic::Status;

use dtx_proto::channel::channel;
use dtx_proto::channel::ChannelCache;
use dtx_proto::metadata::leader_hint;
use dtx_proto::metadata::not_applied;

#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// API addresses of cluster nodes (`host:port`), any subset.
    pub endpoints: Vec<String>,
    /// Overall time budget of one call, all retries included.
    pub call_deadline: Duration,
    /// Time budget of one attempt.
    pub attempt_timeout: Duration,
    /// First retry delay; doubles up to `backoff_max`, with full jitter.
    pub backoff_base: Duration,
    pub backoff_max: Duration,
}

impl ClientConfig {
    pub fn new(endpoints: Vec<String>) -> Self {
        ClientConfig {
            endpoints,
            // Longer than the default txn.prepare_timeout_ms (5 s), so a
            // Commit is not cut off while the leader collects votes.
            call_deadline: Duration::from_secs(15),
            attempt_timeout: Duration::from_secs(8),
            backoff_base: Duration::from_millis(20),
            backoff_max: Duration::from_millis(500),
        }
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum ClientError {
    /// The request broke a limit or was malformed; nothing happened.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("not found: {0}")]
    NotFound(String),
    /// Idempotency key reused with a different request.
    #[error("already exists: {0}")]
    AlreadyExists(String),
    #[error("failed precondition: {0}")]
    FailedPrecondition(String),
    #[error("unimplemented: {0}")]
    Unimplemented(String),
    /// The outcome is not known: the write may or may not have been applied.
    #[error("outcome unknown: {0}")]
    Unknown(String),
    /// A read (or a write known not to be applied) could not be served
    /// before the deadline.
    #[error("unavailable: {0}")]
    Unavailable(String),
    #[error("internal error: {0}")]
    Internal(String),
}

/// Outcome of commit/abort as a caller sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxOutcome {
    Committed,
    Aborted,
    /// Timeout or lost reply: it may be either. Ask again with `decision`.
    Unknown,
}

/// A linearizable decision read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecisionRead {
    Pending,
    Committed,
    Aborted,
    /// No record (never begun, or forgotten after all acks): presumed abort.
    UnknownPresumedAbort,
}

impl DecisionRead {
    fn from_pb(v: i32) -> Result<Self, ClientError> {
        match pb::Outcome::try_from(v) {
            Ok(pb::Outcome::Pending) => Ok(DecisionRead::Pending),
            Ok(pb::Outcome::Commit) => Ok(DecisionRead::Committed),
            Ok(pb::Outcome::Abort) => Ok(DecisionRead::Aborted),
            Ok(pb::Outcome::UnknownPresumedAbort) => Ok(DecisionRead::UnknownPresumedAbort),
            _ => Err(ClientError::Internal(format!("server sent outcome value {v}"))),
        }
    }
}

fn tx_outcome(v: i32) -> Result<TxOutcome, ClientError> {
    match pb::Outcome::try_from(v) {
        Ok(pb::Outcome::Commit) => Ok(TxOutcome::Committed),
        Ok(pb::Outcome::Abort) => Ok(TxOutcome::Aborted),
        _ => Err(ClientError::Internal(format!("server sent decision value {v}"))),
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Began {
    pub txid: u64,
    pub existing: bool,
    pub deadline_unix_ms: u64,
}

/// A participant for `begin_and_commit`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParticipantSpec {
    pub participant_id: String,
    pub address: String,
    pub payload: Vec<u8>,
}

/// What `begin_and_commit` learned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OneShot {
    /// The transaction's id; `None` when no answer came back (then
    /// `outcome` is `Unknown`; calling again with the same key finds it).
    pub txid: Option<u64>,
    pub outcome: TxOutcome,
}

pub struct Client {
    cfg: ClientConfig,
    leader: Mutex<Option<String>>,
    next: Mutex<usize>,
    channels: ChannelCache,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Read,
    Write,
}

impl Client {
    pub fn new(cfg: ClientConfig) -> Result<Client, ClientError> {
        let attempt_timeout = cfg.attempt_timeout;
        if cfg.endpoints.is_empty() {
            return Err(ClientError::InvalidArgument(
                "the client needs at least one endpoint".into(),
            ));
        }
        Ok(Client {
            cfg,
            leader: Mutex::new(None),
            next: Mutex::new(0),
            channels: ChannelCache::new(None, attempt_timeout),
        })
    }

    pub fn config(&self) -> &ClientConfig {
        &self.cfg
    }

    fn target(&self) -> String {
        if let Some(l) = self.leader.lock().expect("lock").clone() {
            return l;
        }
        let mut n = self.next.lock().expect("lock");
        let addr = self.cfg.endpoints[*n % self.cfg.endpoints.len()].clone();
        *n += 1;
        addr
    }

    /// One cached (multiplexed HTTP/2) channel per node address.
    fn channel(&self, addr: &str) -> Result<Channel, ClientError> {
        self.channels.get(addr).map_err(ClientError::InvalidArgument)
    }

    fn backoff(&self, attempt: u32) -> Duration {
        let exp = self.cfg.backoff_base.saturating_mul(1u32 << attempt.min(16));
        let cap = exp.min(self.cfg.backoff_max);
        let ms = cap.as_millis().max(1) as u64;
        Duration::from_millis(rand::rng().random_range(0..=ms))
    }

    /// Runs `f` against the leader (or any node), retrying until a definite
    /// answer or the call deadline.
    async fn call<T, F, Fut>(&self, kind: Kind, f: F) -> Result<T, ClientError>
    where
        F: Fn(Channel, Duration) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        let deadline = Instant::now() + self.cfg.call_deadline;
        let mut maybe_applied = false;
        let mut last = String::from("no attempt finished");
        let mut attempt = 0u32;
        loop {
            let now = Instant::now();
            if now >= deadline {
                return Err(if kind == Kind::Write && maybe_applied {
                    ClientError::Unknown(last)
                } else {
                    ClientError::Unavailable(last)
                });
            }
            let budget = (deadline - now).min(self.cfg.attempt_timeout);
            let addr = self.target();
            let ch = self.channel(&addr)?;
            let res = tokio::time::timeout(budget, f(ch, budget)).await;
            let status = match res {
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(s)) => s,
                Err(_) => Status::deadline_exceeded(format!("no reply from {addr} within {budget:?}")),
            };
            last = format!("{addr}: {}: {}", status.code(), status.message());
            match status.code() {
                Code::InvalidArgument => return Err(ClientError::InvalidArgument(status.message().into())),
                Code::NotFound => return Err(ClientError::NotFound(status.message().into())),
                Code::AlreadyExists => return Err(ClientError::AlreadyExists(status.message().into())),
                Code::FailedPrecondition => return Err(ClientError::FailedPrecondition(status.message().into())),
                Code::Unimplemented => return Err(ClientError::Unimplemented(status.message().into())),
                Code::Internal | Code::DataLoss if kind == Kind::Read || not_applied(&status) => {
                    return Err(ClientError::Internal(status.message().into()))
                }
                Code::Internal | Code::DataLoss => {
                    // tonic reports an HTTP/2 reset or a broken stream as
                    // INTERNAL, and a server may fail after it proposed: a
                    // write may have been applied (issue 8, defect 6). Ask
                    // again (every write is idempotent or write-once); if
                    // no definite answer comes, the outcome is UNKNOWN.
                    maybe_applied = true;
                    *self.leader.lock().expect("lock") = None;
                }
                Code::Unavailable => {
                    // Redirected or refused; it may still have been applied
                    // unless the server says it certainly was not.
                    if !not_applied(&status) {
                        maybe_applied = true;
                    }
                    *self.leader.lock().expect("lock") = leader_hint(&status);
                }
                _ => {
                    // DEADLINE_EXCEEDED, CANCELLED, UNKNOWN, ...: the write
                    // may have been applied.
                    maybe_applied = true;
                    *self.leader.lock().expect("lock") = None;
                }
            }
            tokio::time::sleep(self.backoff(attempt)).await;
            attempt += 1;
        }
    }

    pub async fn begin(
        &self,
        idempotency_key: &str,
        timeout_ms: u64,
        description: &[u8],
    ) -> Result<Began, ClientError> {
        let req = pb::BeginRequest {
            idempotency_key: idempotency_key.to_string(),
            timeout_ms,
            description: description.to_vec(),
        };
        let r = self
            .call(Kind::Write, |ch, t| {
                let mut rq = tonic::Request::new(req.clone());
                rq.set_timeout(t);
                async move { CoordinatorClient::new(ch).begin(rq).await.map(|r| r.into_inner()) }
            })
            .await?;
        Ok(Began {
            txid: r.txid,
            existing: r.existing,
            deadline_unix_ms: r.deadline_unix_ms,
        })
    }

    pub async fn enlist(
        &self,
        txid: u64,
        participant_id: &str,
        address: &str,
        payload: &[u8],
    ) -> Result<u32, ClientError> {
        let req = pb::EnlistRequest {
            txid,
            participant_id: participant_id.to_string(),
            address: address.to_string(),
            payload: payload.to_vec(),
        };
        let r = self
            .call(Kind::Write, |ch, t| {
                let mut rq = tonic::Request::new(req.clone());
                rq.set_timeout(t);
                async move { CoordinatorClient::new(ch).enlist(rq).await.map(|r| r.into_inner()) }
            })
            .await?;
        Ok(r.participant_count)
    }

    /// COMMITTED, ABORTED, or UNKNOWN when the outcome could not be learned.
    /// Begins a transaction with every participant and commits it in one
    /// call (one Raft write instead of Begin + Enlists + commit request).
    /// Idempotent by key: call again with the same key and request to learn
    /// the outcome of an earlier UNKNOWN.
    pub async fn begin_and_commit(
        &self,
        idempotency_key: &str,
        timeout_ms: u64,
        description: &[u8],
        participants: &[ParticipantSpec],
    ) -> Result<OneShot, ClientError> {
        let req = pb::BeginAndCommitRequest {
            idempotency_key: idempotency_key.to_string(),
            timeout_ms,
            description: description.to_vec(),
            participants: participants
                .iter()
                .map(|p| pb::ParticipantSpec {
                    participant_id: p.participant_id.clone(),
                    address: p.address.clone(),
                    payload: p.payload.clone(),
                })
                .collect(),
        };
        let res = self
            .call(Kind::Write, |ch, t| {
                let mut rq = tonic::Request::new(req.clone());
                rq.set_timeout(t);
                async move {
                    CoordinatorClient::new(ch)
                        .begin_and_commit(rq)
                        .await
                        .map(|r| r.into_inner())
                }
            })
            .await;
        match res {
            Ok(r) => Ok(OneShot {
                txid: Some(r.txid),
                outcome: tx_outcome(r.outcome)?,
            }),
            Err(ClientError::Unknown(_)) => Ok(OneShot {
                txid: None,
                outcome: TxOutcome::Unknown,
            }),
            Err(e) => Err(e),
        }
    }

    pub async fn commit(&self, txid: u64) -> Result<TxOutcome, ClientError> {
        let res = self
            .call(Kind::Write, |ch, t| {
                let mut rq = tonic::Request::new(pb::CommitRequest { txid });
                rq.set_timeout(t);
                async move { CoordinatorClient::new(ch).commit(rq).await.map(|r| r.into_inner()) }
            })
            .await;
        match res {
            Ok(r) => tx_outcome(r.outcome),
            Err(ClientError::Unknown(_)) => Ok(TxOutcome::Unknown),
            Err(e) => Err(e),
        }
    }

    /// The recorded decision after asking for ABORT (COMMIT if it was already
    /// committed), or UNKNOWN.
    pub async fn abort(&self, txid: u64, reason: &str) -> Result<TxOutcome, ClientError> {
        let req = pb::AbortRequest {
            txid,
            reason: reason.to_string(),
        };
        let res = self
            .call(Kind::Write, |ch, t| {
                let mut rq = tonic::Request::new(req.clone());
                rq.set_timeout(t);
                async move { CoordinatorClient::new(ch).abort(rq).await.map(|r| r.into_inner()) }
            })
            .await;
        match res {
            Ok(r) => tx_outcome(r.outcome),
            Err(ClientError::Unknown(_)) => Ok(TxOutcome::Unknown),
            Err(e) => Err(e),
        }
    }

    /// Operator resolution (write-once; returns the recorded decision and
    /// whether this call recorded it). UNKNOWN surfaces as `ClientError::Unknown`.
    pub async fn resolve(
        &self,
        txid: u64,
        commit: bool,
        voters: &[String],
        operator: &str,
        reason: &str,
    ) -> Result<(TxOutcome, bool), ClientError> {
        let req = pb::ResolveRequest {
            txid,
            outcome: if commit {
                pb::Outcome::Commit
            } else {
                pb::Outcome::Abort
            } as i32,
            voters: voters.to_vec(),
            operator: operator.to_string(),
            reason: reason.to_string(),
        };
        let r = self
            .call(Kind::Write, |ch, t| {
                let mut rq = tonic::Request::new(req.clone());
                rq.set_timeout(t);
                async move { AdminClient::new(ch).resolve(rq).await.map(|r| r.into_inner()) }
            })
            .await?;
        Ok((tx_outcome(r.outcome)?, r.recorded))
    }

    pub async fn status(&self, txid: u64) -> Result<pb::StatusResponse, ClientError> {
        self.call(Kind::Read, |ch, t| {
            let mut rq = tonic::Request::new(pb::StatusRequest { txid });
            rq.set_timeout(t);
            async move { CoordinatorClient::new(ch).status(rq).await.map(|r| r.into_inner()) }
        })
        .await
    }

    pub async fn decision(&self, txid: u64) -> Result<DecisionRead, ClientError> {
        let r = self
            .call(Kind::Read, |ch, t| {
                let mut rq = tonic::Request::new(pb::GetDecisionRequest { txid });
                rq.set_timeout(t);
                async move {
                    CoordinatorClient::new(ch)
                        .get_decision(rq)
                        .await
                        .map(|r| r.into_inner())
                }
            })
            .await?;
        DecisionRead::from_pb(r.outcome)
    }

    pub async fn decisions(&self, txids: &[u64]) -> Result<Vec<(u64, DecisionRead)>, ClientError> {
        let req = pb::GetDecisionsRequest {
            txids: txids.to_vec(),
            participant_id: String::new(),
        };
        let r = self
            .call(Kind::Read, |ch, t| {
                let mut rq = tonic::Request::new(req.clone());
                rq.set_timeout(t);
                async move {
                    CoordinatorClient::new(ch)
                        .get_decisions(rq)
                        .await
                        .map(|r| r.into_inner())
                }
            })
            .await?;
        r.decisions
            .into_iter()
            .map(|d| Ok((d.txid, DecisionRead::from_pb(d.outcome)?)))
            .collect()
    }

    /// Cluster status as seen by the first endpoint that answers.
    pub async fn cluster_status(&self) -> Result<pb::ClusterStatusResponse, ClientError> {
        self.call(Kind::Read, |ch, t| {
            let mut rq = tonic::Request::new(pb::ClusterStatusRequest {});
            rq.set_timeout(t);
            async move { AdminClient::new(ch).cluster_status(rq).await.map(|r| r.into_inner()) }
        })
        .await
    }
}

/// One attempt at one node, no retries (for tests and tools that must talk
/// to a particular node, e.g. to prove a cut-off node does not answer).
pub async fn decision_at(addr: &str, txid: u64, timeout: Duration) -> Result<DecisionRead, Status> {
    let ch = channel(addr, None, timeout).map_err(Status::invalid_argument)?;
    let mut rq = tonic::Request::new(pb::GetDecisionRequest { txid });
    rq.set_timeout(timeout);
    let r = tokio::time::timeout(timeout, CoordinatorClient::new(ch).get_decision(rq))
        .await
        .map_err(|_| Status::deadline_exceeded("no reply"))??;
    DecisionRead::from_pb(r.into_inner().outcome).map_err(|e| Status::internal(e.to_string()))
}

/// Cluster status of one particular node.
pub async fn cluster_status_at(addr: &str, timeout: Duration) -> Result<pb::ClusterStatusResponse, Status> {
    let ch = channel(addr, None, timeout).map_err(Status::invalid_argument)?;
    let mut rq = tonic::Request::new(pb::ClusterStatusRequest {});
    rq.set_timeout(timeout);
    tokio::time::timeout(timeout, AdminClient::new(ch).cluster_status(rq))
        .await
        .map_err(|_| Status::deadline_exceeded("no reply"))?
        .map(|r| r.into_inner())
}
