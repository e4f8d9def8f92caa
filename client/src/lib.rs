//! The Rust client of the dtx coordinator, for applications that run
//! distributed transactions and for services that take part in them.
//!
//! Embed [`Client`] in an application that begins and commits transactions:
//! give it the API addresses of some or all cluster nodes
//! ([`ClientConfig::new`]), then call [`Client::begin`], [`Client::enlist`]
//! once per participant and [`Client::commit`] (or
//! [`Client::begin_and_commit`] when every participant is known up front).
//! It depends on the wire contract (`dtx-proto`), tonic and tokio only: no
//! Raft, no storage.
//!
//! - **Leader discovery.** It follows the `x-dtx-leader-addr` hint of a
//!   refusal or of a forwarded answer when the hinted address is one of the
//!   configured endpoints (so a client given only a proxy or a load
//!   balancer keeps going through it), and otherwise tries the configured
//!   endpoints in turn (any node forwards to the leader).
//! - **Retries.** Every call retries with exponential backoff and full
//!   jitter ([`backoff`]) within one overall deadline
//!   ([`ClientConfig::call_deadline`]). Every write it exposes is safe to
//!   retry: Begin is idempotent by key, Enlist is idempotent, the decision
//!   is write-once.
//! - **UNKNOWN is not failure.** A write whose outcome could not be learned
//!   before the deadline returns [`ClientError::Unknown`] (or
//!   [`TxOutcome::Unknown`] from commit and abort): it may have been
//!   applied. Ask again ([`Client::decision`], or the same call again).
//! - **Participants.** A participant reads decisions with
//!   [`Client::decisions_for`] (batched, linearizable, with the
//!   `awaiting_ack` flag its log garbage collection needs); the participant
//!   SDK's recovery does this. A service that learns the txid from its
//!   caller enlists itself ([`enlist`]); [`propagate`] carries the txid
//!   across gRPC calls without hand work.
//! - **Sagas.** [`saga`]: register a definition, start a saga by
//!   idempotency key, read it, wait for its end, list, cancel and the
//!   operator's actions, under the same rules (leader hints, retries,
//!   deadlines, UNKNOWN kept apart from failure).
//! - **Tracing.** Each transaction has one W3C trace ([`trace`]): begun in
//!   the application's current trace or a new one, and carried in
//!   `traceparent` on every call about the transaction.
//!
//! # Example
//!
//! A transfer between two participant services, with UNKNOWN handled:
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use dtx_client::{Client, ClientConfig, ClientError, DecisionRead, TxOutcome};
//!
//! /// Moves 25 from account a3 at bank A to b7 at bank B; `Ok(true)` once
//! /// it is committed at both, `Ok(false)` once it is aborted at both.
//! async fn transfer(client: &Client, request_id: &str) -> Result<bool, ClientError> {
//!     // Idempotent by key: after a crash, the same request id finds the
//!     // same transaction (`existing == true`).
//!     let tx = client.begin(request_id, 30_000, b"transfer a3 -> b7").await?;
//!     for (participant, address, work) in [
//!         ("bank-a", "10.0.1.1:7000", &b"a3:-25"[..]),
//!         ("bank-b", "10.0.1.2:7000", &b"b7:25"[..]),
//!     ] {
//!         if let Err(e) = client.enlist(tx.txid, participant, address, work).await {
//!             // Not enlisted (or not known to be): give up on the
//!             // transaction. The decision is write-once, so ask for
//!             // ABORT and go by what is recorded.
//!             eprintln!("enlisting {participant}: {e}");
//!             return match client.abort(tx.txid, "enlist failed").await? {
//!                 TxOutcome::Committed => Ok(true),
//!                 TxOutcome::Aborted => Ok(false),
//!                 TxOutcome::Unknown => settle(client, tx.txid).await,
//!             };
//!         }
//!     }
//!     match client.commit(tx.txid).await? {
//!         TxOutcome::Committed => Ok(true),
//!         TxOutcome::Aborted => Ok(false),
//!         // Not a failure: the decision may be recorded, or be about to.
//!         TxOutcome::Unknown => settle(client, tx.txid).await,
//!     }
//! }
//!
//! /// Reads the decision until it is known.
//! async fn settle(client: &Client, txid: u64) -> Result<bool, ClientError> {
//!     loop {
//!         match client.decision(txid).await {
//!             Ok(DecisionRead::Committed) => return Ok(true),
//!             Ok(DecisionRead::Aborted | DecisionRead::UnknownPresumedAbort) => return Ok(false),
//!             // Another cluster's txid (or the old cluster's, after a
//!             // restore): nothing is known here; ask an operator.
//!             Ok(DecisionRead::OtherIncarnation) => {
//!                 return Err(ClientError::FailedPrecondition(format!("{txid}: another incarnation")))
//!             }
//!             // Still being decided, or no quorum right now: wait.
//!             Ok(DecisionRead::Pending) | Err(ClientError::Unavailable(_)) => {
//!                 tokio::time::sleep(Duration::from_millis(500)).await
//!             }
//!             Err(e) => return Err(e),
//!         }
//!     }
//! }
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), ClientError> {
//! let nodes = ["10.0.0.1:7201", "10.0.0.2:7201", "10.0.0.3:7201"];
//! let client = Client::new(ClientConfig::new(nodes.iter().map(|s| s.to_string()).collect()))?;
//! let committed = transfer(&client, "transfer-7f3a").await?;
//! println!("committed: {committed}");
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

pub mod enlist;
pub mod propagate;
pub mod saga;

// The trace context, the backoff formula and the operators' words live in
// dtx-common, which the node uses too (docs/adr/0044-crate-lines.md); here
// under the paths client users know.
pub use dtx_common::backoff;
pub use dtx_common::trace;
pub use dtx_common::view;

use std::collections::BTreeMap;
use std::future::Future;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

pub use dtx_proto::metadata::BranchRefusalKind;
use dtx_proto::v1 as pb;
use dtx_proto::v1::admin_client::AdminClient;
use dtx_proto::v1::coordinator_client::CoordinatorClient;
use dtx_transport::channel::Channel;
use tokio::time::Instant;
use tonic::Code;
use tonic::Status;

use dtx_proto::limits::DECISION_BATCH_TXIDS_MAX;
use dtx_proto::metadata::leader_hint;
use dtx_proto::metadata::not_applied;
use dtx_transport::channel::channel;
use dtx_transport::channel::ChannelCache;
use dtx_transport::unary::nothing_sent;

use crate::backoff::Backoff;
use crate::backoff::Jitter;
use crate::trace::TraceContext;

/// Where the cluster is and how long a call may take.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// API addresses of cluster nodes (`host:port` or `http://host[:port]`,
    /// see [`dtx_proto::endpoint()`]), any subset of the cluster.
    pub endpoints: Vec<String>,
    /// Overall time budget of one call, all retries included. A write that
    /// got no definite answer within it is UNKNOWN.
    pub call_deadline: Duration,
    /// Time budget of one attempt at one node.
    pub attempt_timeout: Duration,
    /// Time budget of opening a connection to a node (at most
    /// `attempt_timeout` is used).
    pub connect_timeout: Duration,
    /// Ceiling of the first retry delay; it doubles per retry up to
    /// `backoff_max`, with full jitter ([`ClientConfig::backoff`]).
    pub backoff_base: Duration,
    /// Largest retry delay.
    pub backoff_max: Duration,
    /// Source address of the connections to the cluster; `None` lets the
    /// system choose. A service that sets it to its own address is cut off
    /// both ways by network rules on that address.
    pub local_ip: Option<IpAddr>,
    /// TLS settings (the cluster's authority, and this process's
    /// certificate for mutual TLS); `None` speaks plain text.
    pub tls: Option<Arc<dtx_tls::ClientTls>>,
    /// A bearer token sent with every call (`authorization: Bearer …`),
    /// for clusters that accept tokens where mutual TLS is not used.
    pub token: Option<String>,
}

impl ClientConfig {
    /// The defaults for `endpoints`: 15 s per call, 8 s per attempt (and
    /// per connect), retries after 20 ms doubling up to 500 ms, any source
    /// address.
    pub fn new(endpoints: Vec<String>) -> Self {
        ClientConfig {
            endpoints,
            // Longer than the default txn.prepare_timeout_ms (5 s), so a
            // Commit is not cut off while the leader collects votes.
            call_deadline: Duration::from_secs(15),
            attempt_timeout: Duration::from_secs(8),
            connect_timeout: Duration::from_secs(8),
            backoff_base: Duration::from_millis(20),
            backoff_max: Duration::from_millis(500),
            local_ip: None,
            tls: None,
            token: None,
        }
    }

    /// The retry delays: from `backoff_base` doubling up to `backoff_max`,
    /// with full jitter.
    pub fn backoff(&self) -> Backoff {
        Backoff::new(self.backoff_base, self.backoff_max, Jitter::Full)
    }
}

/// Why a call failed. Only [`ClientError::Unknown`] leaves the outcome of a
/// write open; the others say what happened (or, for reads, that no answer
/// came).
#[derive(Debug, Clone, thiserror::Error)]
pub enum ClientError {
    /// The request broke a limit or was malformed; nothing happened.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The transaction has no record (never begun, or forgotten).
    #[error("not found: {0}")]
    NotFound(String),
    /// Idempotency key reused with a different request.
    #[error("already exists: {0}")]
    AlreadyExists(String),
    /// The transaction's state does not allow the call (for example Enlist
    /// after commit was requested); nothing happened.
    #[error("failed precondition: {0}")]
    FailedPrecondition(String),
    /// The server does not implement the call.
    #[error("unimplemented: {0}")]
    Unimplemented(String),
    /// The outcome is not known: the write may or may not have been applied.
    #[error("outcome unknown: {0}")]
    Unknown(String),
    /// A read could not be served before the deadline, or a write reached
    /// no node (nothing was sent: it was certainly not applied).
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// The cluster refused the write for now and said it was not applied
    /// (no leader known, no quorum, a leader cut off from its majority):
    /// nothing changed. A definite failure, never an unknown outcome; the
    /// same call may be made again later (every write is idempotent or
    /// write-once).
    #[error("refused, not applied: {0}")]
    NotApplied(String),
    /// A storage or invariant fault at the server, or an answer this client
    /// cannot read.
    #[error("internal error: {0}")]
    Internal(String),
    /// The cluster does not know who this client is (no client
    /// certificate and no accepted token); nothing happened.
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),
    /// This client's identity may not make the call; nothing happened.
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    /// The cluster refused a branch's registration
    /// ([`Client::register_branch`]); nothing was recorded.
    /// [`BranchRefusalKind::must_roll_back`] says whether the branch must
    /// roll its prepared work back (the participant set is frozen without
    /// it, or it was fenced out) or conflicts with its own earlier
    /// registration, which stands.
    #[error("branch refused ({}): {message}", kind.as_str())]
    BranchRefused {
        /// Which refusal (`x-dtx-branch-refusal`).
        kind: BranchRefusalKind,
        /// The cluster's words.
        message: String,
    },
}

/// Outcome of commit/abort as a caller sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxOutcome {
    /// Decided COMMIT.
    Committed,
    /// Decided ABORT.
    Aborted,
    /// Timeout or lost reply: it may be either. Ask again with `decision`.
    Unknown,
}

/// A linearizable decision read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecisionRead {
    /// Not decided yet: keep waiting, never act on it.
    Pending,
    /// Decided COMMIT.
    Committed,
    /// Decided ABORT.
    Aborted,
    /// No record (never begun, or forgotten after all acks): presumed abort.
    UnknownPresumedAbort,
    /// Asked with an incarnation that did not hand out this txid here
    /// (another cluster's transaction, or one handed out after the backup
    /// this cluster was restored from): nothing is known and nothing may be
    /// presumed. Keep the record and its locks; an operator resolves it.
    OtherIncarnation,
}

/// One transaction's answer to a batched decision read
/// ([`Client::decisions_for`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecisionAnswer {
    /// The transaction.
    pub txid: u64,
    /// The decision; `None` when the server sent an outcome value this
    /// client does not know (a newer server): count it as undecided.
    pub decision: Option<DecisionRead>,
    /// Only when asked with a participant id: that participant is enlisted,
    /// the decision is recorded and its ack is not, so the leader will
    /// still deliver the decision to it.
    pub awaiting_ack: bool,
    /// Not empty when the txid was asked with another incarnation than the
    /// one that handed it out here and an operator settled it
    /// (`coordinator admin txn settle-other`, docs/adr/0040): the decision
    /// is that settlement's, and this says who settled it, why, with what
    /// evidence and when (a participant logs it).
    pub settled_by: String,
}

/// A branch's vote ([`Client::register_branch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BranchVote {
    /// Its work is prepared durably where it ran.
    Yes,
    /// It cannot commit (its work is rolled back): the transaction aborts.
    No,
    /// It changed nothing: it needs no phase two.
    ReadOnly,
}

impl BranchVote {
    fn to_pb(self) -> i32 {
        (match self {
            BranchVote::Yes => pb::BranchVote::Yes,
            BranchVote::No => pb::BranchVote::No,
            BranchVote::ReadOnly => pb::BranchVote::ReadOnly,
        }) as i32
    }
}

/// What [`Client::register_branch`] learned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BranchRegistration {
    /// The term of the leader that recorded the registration: the
    /// branch's term floor for the txid (older phase-two messages are
    /// refused).
    pub term: u64,
    /// The incarnation that handed out the txid: the branch keeps its
    /// work under (incarnation, txid).
    pub incarnation: u64,
    /// True when the same registration was recorded before (a retry).
    pub existing: bool,
    /// The transaction's deadline, ms since the Unix epoch.
    pub deadline_unix_ms: u64,
}

/// What a branch does with its work prepared for a transaction
/// ([`Client::branch_decision`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BranchDecision {
    /// A member of a transaction decided COMMIT: commit the prepared work.
    Commit,
    /// Roll the prepared work back: the transaction aborted, or the branch
    /// is not a member (`member` false: it never registered before the set
    /// was frozen, and was fenced out if the transaction is still open).
    Abort {
        /// The branch is in the transaction's participant set.
        member: bool,
    },
    /// A member of an undecided transaction: keep the work prepared and
    /// ask again.
    Pending,
    /// Asked with an incarnation that did not hand out this txid here:
    /// nothing is known and nothing may be presumed (as
    /// [`DecisionRead::OtherIncarnation`]).
    OtherIncarnation,
}

impl DecisionRead {
    fn from_pb(v: i32) -> Result<Self, ClientError> {
        match pb::Outcome::try_from(v) {
            Ok(pb::Outcome::Pending) => Ok(DecisionRead::Pending),
            Ok(pb::Outcome::Commit) => Ok(DecisionRead::Committed),
            Ok(pb::Outcome::Abort) => Ok(DecisionRead::Aborted),
            Ok(pb::Outcome::UnknownPresumedAbort) => Ok(DecisionRead::UnknownPresumedAbort),
            Ok(pb::Outcome::OtherIncarnation) => Ok(DecisionRead::OtherIncarnation),
            _ => Err(ClientError::Internal(format!("server sent outcome value {v}"))),
        }
    }
}

/// The outcome an operator's request asks for: COMMIT when `commit`,
/// else ABORT.
fn operator_outcome(commit: bool) -> i32 {
    if commit {
        pb::Outcome::Commit as i32
    } else {
        pb::Outcome::Abort as i32
    }
}

fn tx_outcome(v: i32) -> Result<TxOutcome, ClientError> {
    match pb::Outcome::try_from(v) {
        Ok(pb::Outcome::Commit) => Ok(TxOutcome::Committed),
        Ok(pb::Outcome::Abort) => Ok(TxOutcome::Aborted),
        _ => Err(ClientError::Internal(format!("server sent decision value {v}"))),
    }
}

/// What [`Client::begin`] learned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Began {
    /// The transaction's id.
    pub txid: u64,
    /// True when the idempotency key already named this transaction (a
    /// retry found it).
    pub existing: bool,
    /// When the cluster aborts the transaction if commit was not asked for
    /// (ms since the Unix epoch).
    pub deadline_unix_ms: u64,
    /// The cluster incarnation that handed out `txid`: pass it on with
    /// the txid ([`propagate::scope_in`]) to services that join as
    /// branches.
    pub incarnation: u64,
}

/// A participant for `begin_and_commit`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParticipantSpec {
    /// Stable participant identity, unique within the transaction.
    pub participant_id: String,
    /// Where the coordinator reaches its `ParticipantService`.
    pub address: String,
    /// Opaque bytes handed to the participant's Prepare.
    pub payload: Vec<u8>,
}

/// What `begin_and_commit` learned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OneShot {
    /// The transaction's id; `None` when no answer came back (then
    /// `outcome` is `Unknown`; calling again with the same key finds it).
    pub txid: Option<u64>,
    /// COMMITTED, ABORTED, or UNKNOWN.
    pub outcome: TxOutcome,
}

/// A client of the coordinator cluster: one cached HTTP/2 channel per node,
/// the leader it last heard of, and the retry policy of its
/// [`ClientConfig`]. Share one per process (behind an `Arc`): its calls may
/// run concurrently.
pub struct Client {
    cfg: ClientConfig,
    leader: Mutex<Option<String>>,
    next: Mutex<usize>,
    channels: ChannelCache,
    /// The trace of each transaction begun here, until its decision is
    /// known (at most `TRACES_MAX`, the oldest txids dropped first).
    traces: Mutex<BTreeMap<u64, TraceContext>>,
}

/// How many transactions' traces a [`Client`] remembers.
const TRACES_MAX: usize = 10_000;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Read,
    Write,
}

impl Client {
    /// A client for `cfg` (connections are opened lazily, at the first
    /// call). Fails only without endpoints.
    pub fn new(cfg: ClientConfig) -> Result<Client, ClientError> {
        let connect_timeout = cfg.connect_timeout.min(cfg.attempt_timeout);
        if cfg.endpoints.is_empty() {
            return Err(ClientError::InvalidArgument(
                "the client needs at least one endpoint".into(),
            ));
        }
        Ok(Client {
            leader: Mutex::new(None),
            next: Mutex::new(0),
            channels: ChannelCache::new(cfg.local_ip, connect_timeout).with_tls(cfg.tls.clone()),
            cfg,
            traces: Mutex::new(BTreeMap::new()),
        })
    }

    /// The configuration this client was built with.
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

    /// A request with the attempt's timeout, the bearer token, if any, and
    /// the current trace context ([`trace::current`]), if any.
    fn request<T>(&self, msg: T, timeout: Duration) -> tonic::Request<T> {
        let mut rq = request_with_token(msg, self.cfg.token.as_deref());
        rq.set_timeout(timeout);
        if let Some(ctx) = trace::current() {
            ctx.attach(rq.metadata_mut());
        }
        rq
    }

    /// The trace the calls about `txid` carry: the caller's current one
    /// ([`trace::scope`]), else the one `txid` was begun in by this client.
    pub fn trace_of(&self, txid: u64) -> Option<TraceContext> {
        trace::current().or_else(|| self.traces.lock().expect("lock").get(&txid).cloned())
    }

    /// Runs `call` (calls about `txid`) in the transaction's trace.
    async fn in_trace<T>(&self, txid: u64, call: impl Future<Output = T>) -> T {
        trace::scope_opt(self.trace_of(txid), call).await
    }

    fn remember_trace(&self, txid: u64, ctx: TraceContext) {
        let mut traces = self.traces.lock().expect("lock");
        traces.insert(txid, ctx);
        while traces.len() > TRACES_MAX {
            traces.pop_first();
        }
    }

    fn forget_trace(&self, txid: u64, outcome: &Result<TxOutcome, ClientError>) {
        if matches!(outcome, Ok(TxOutcome::Committed | TxOutcome::Aborted)) {
            self.traces.lock().expect("lock").remove(&txid);
        }
    }

    /// The configured endpoint that `hint` (a leader address a node named)
    /// is, compared by host and port; `None` when it is none of them (or
    /// does not parse). The endpoint is returned as this client was given
    /// it (its scheme kept). Both ways of learning the leader (a forwarded
    /// answer, [`Client::learn_leader`], and a refusal, in `call`) go
    /// through here, so a client given only a proxy or a load balancer is
    /// never sent around it.
    fn endpoint_named(&self, hint: &str) -> Option<String> {
        let host_port = |a: &str| {
            dtx_proto::endpoint::parse(a)
                .ok()
                .and_then(|p| p.endpoint.uri().authority().map(|x| x.as_str().to_ascii_lowercase()))
        };
        let wanted = host_port(hint)?;
        self.cfg
            .endpoints
            .iter()
            .find(|e| host_port(e).as_ref() == Some(&wanted))
            .cloned()
    }

    /// A follower that forwarded the call to the leader names it in its
    /// answer: the next calls go to the leader directly, saving the hop,
    /// when it is one of this client's endpoints ([`Client::endpoint_named`];
    /// a client given only a proxy or a load balancer keeps going through
    /// it).
    fn learn_leader(&self, md: &tonic::metadata::MetadataMap) {
        let Some(hint) = dtx_proto::metadata::leader_addr_in(md) else {
            return;
        };
        if let Some(e) = self.endpoint_named(&hint) {
            *self.leader.lock().expect("lock") = Some(e);
        }
    }

    /// One cached (multiplexed HTTP/2) channel per node address.
    fn channel(&self, addr: &str) -> Result<Channel, ClientError> {
        self.channels.get(addr).map_err(ClientError::InvalidArgument)
    }

    /// Runs `f` against the leader (or any node), retrying until a definite
    /// answer or the call deadline.
    async fn call<T, F, Fut>(&self, kind: Kind, f: F) -> Result<T, ClientError>
    where
        F: Fn(Channel, Duration) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        self.call_until(kind, Instant::now() + self.cfg.call_deadline, f).await
    }

    /// [`Client::call`] with the overall deadline `deadline` (a caller's
    /// wait that ends before the call deadline would).
    async fn call_until<T, F, Fut>(&self, kind: Kind, deadline: Instant, f: F) -> Result<T, ClientError>
    where
        F: Fn(Channel, Duration) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let mut maybe_applied = false;
        // A node answered that the write was not applied (rather than no
        // node being reached at all).
        let mut refused = false;
        let mut last = String::from("no attempt finished");
        let mut attempt = 0u32;
        loop {
            let now = Instant::now();
            if now >= deadline {
                return Err(if kind == Kind::Write && maybe_applied {
                    ClientError::Unknown(last)
                } else if kind == Kind::Write && refused {
                    ClientError::NotApplied(last)
                } else {
                    ClientError::Unavailable(last)
                });
            }
            let budget = (deadline - now).min(self.cfg.attempt_timeout);
            let addr = self.target();
            let ch = self.channel(&addr)?;
            let res = tokio::time::timeout(budget, f(ch, budget)).await;
            let (status, timed_out) = match res {
                Ok(Ok(answer)) => {
                    self.learn_leader(answer.metadata());
                    return Ok(answer.into_inner());
                }
                // The request's own timeout (tonic's, from `budget`) fired
                // first: the same as ours below.
                Ok(Err(s)) => {
                    let own_timeout = is_timeout(&s);
                    (s, own_timeout)
                }
                Err(_) => (
                    Status::deadline_exceeded(format!("no reply from {addr} within {budget:?}")),
                    true,
                ),
            };
            // An attempt that the call's deadline cut short says less than
            // the failure before it: keep that one in the message (on a busy
            // machine the last attempt may get well under a millisecond).
            last = if timed_out && budget < self.cfg.attempt_timeout && attempt > 0 {
                format!("{last}; then the call's deadline ran out during an attempt at {addr}")
            } else {
                let hint = if self.cfg.tls.is_none() && status.message().contains("h2 protocol error") {
                    " (a plain-text client gets this from a port that requires TLS: give the cluster's authority, --tls-ca)"
                } else {
                    ""
                };
                format!("{addr}: {}: {}{hint}", status.code(), describe(&status))
            };
            match status.code() {
                Code::InvalidArgument => return Err(ClientError::InvalidArgument(status.message().into())),
                Code::NotFound => return Err(ClientError::NotFound(status.message().into())),
                Code::AlreadyExists => return Err(ClientError::AlreadyExists(status.message().into())),
                Code::FailedPrecondition => {
                    return Err(match dtx_proto::metadata::branch_refusal(&status) {
                        Some(kind) => ClientError::BranchRefused {
                            kind,
                            message: status.message().into(),
                        },
                        None => ClientError::FailedPrecondition(status.message().into()),
                    })
                }
                Code::Unimplemented => return Err(ClientError::Unimplemented(status.message().into())),
                // Refused before anything ran: definite, and asking again
                // with the same credentials would be refused again.
                Code::Unauthenticated => return Err(ClientError::Unauthenticated(status.message().into())),
                Code::PermissionDenied => return Err(ClientError::PermissionDenied(status.message().into())),
                // Not connected (refused, no route, TLS handshake failed):
                // nothing was sent, so nothing can have been applied there.
                // Go round the endpoints.
                _ if nothing_sent(&status) => {
                    *self.leader.lock().expect("lock") = None;
                }
                Code::Internal | Code::DataLoss if kind == Kind::Read || not_applied(&status) => {
                    return Err(ClientError::Internal(last))
                }
                Code::Internal | Code::DataLoss => {
                    // tonic reports an HTTP/2 reset or a broken stream as
                    // INTERNAL, and a server may fail after it proposed: a
                    // write may have been applied. Ask again (every write is
                    // idempotent or write-once); if no definite answer comes,
                    // the outcome is UNKNOWN.
                    maybe_applied = true;
                    *self.leader.lock().expect("lock") = None;
                }
                Code::ResourceExhausted if not_applied(&status) => {
                    // Over the server's rate limit: refused before anything
                    // ran; wait (the backoff below) and ask again.
                    refused = true;
                }
                Code::Unavailable => {
                    // Redirected or refused; it may still have been applied
                    // unless the server says it certainly was not. Follow
                    // the hint only to one of the endpoints (as a forwarded
                    // answer's, `learn_leader`); otherwise, or without a
                    // hint, forget the leader and go round the endpoints.
                    if not_applied(&status) {
                        refused = true;
                    } else {
                        maybe_applied = true;
                    }
                    *self.leader.lock().expect("lock") = leader_hint(&status).and_then(|h| self.endpoint_named(&h));
                }
                _ => {
                    // DEADLINE_EXCEEDED, CANCELLED, UNKNOWN, ...: the write
                    // may have been applied.
                    maybe_applied = true;
                    *self.leader.lock().expect("lock") = None;
                }
            }
            tokio::time::sleep(self.cfg.backoff().sample(attempt)).await;
            attempt += 1;
        }
    }

    /// Begins a transaction that the cluster aborts if commit is not asked
    /// for within `timeout_ms`. Idempotent by `idempotency_key`: the same
    /// key with the same request finds the same transaction
    /// ([`Began::existing`]); with another request it is
    /// [`ClientError::AlreadyExists`].
    ///
    /// The transaction's trace ([`trace`]) is the caller's current one, or
    /// a new one; every later call of this client about the txid carries it.
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
        let ctx = trace::current().unwrap_or_else(TraceContext::new_root);
        let r = trace::scope(
            ctx.clone(),
            self.call(Kind::Write, |ch, t| {
                let rq = self.request(req.clone(), t);
                async move { CoordinatorClient::new(ch).begin(rq).await }
            }),
        )
        .await?;
        self.remember_trace(r.txid, ctx);
        Ok(Began {
            txid: r.txid,
            existing: r.existing,
            deadline_unix_ms: r.deadline_unix_ms,
            incarnation: r.incarnation,
        })
    }

    /// Adds participant `participant_id`, reachable at `address`, to
    /// `txid`, with `payload` for its Prepare. Enlisting again with the same
    /// address and payload is a no-op, so retrying is safe. Returns how many
    /// participants the transaction has.
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
            .in_trace(
                txid,
                self.call(Kind::Write, |ch, t| {
                    let rq = self.request(req.clone(), t);
                    async move { CoordinatorClient::new(ch).enlist(rq).await }
                }),
            )
            .await?;
        Ok(r.participant_count)
    }

    /// Registers `participant_id`, reachable at `address` for phase two,
    /// as a branch of `txid` that prepared where it ran (under
    /// `incarnation`, which the cluster checks unless it is 0), with its `vote`
    /// (`reason` for a NO), in one Raft write (docs/protocol.md,
    /// "Branches"). Idempotent: the same registration again answers the
    /// same ([`BranchRegistration::existing`]), so retrying is safe.
    ///
    /// Errors: [`ClientError::BranchRefused`] when the set is frozen
    /// without the branch, it was fenced out, or it registered otherwise
    /// before; [`ClientError::NotFound`] for a txid never begun here;
    /// [`ClientError::Unknown`] when no definite answer came: the
    /// registration may or may not be recorded: register again, or ask
    /// [`Client::branch_decision`] (which settles it).
    pub async fn register_branch(
        &self,
        (incarnation, txid): (u64, u64),
        participant_id: &str,
        address: &str,
        vote: BranchVote,
        reason: &str,
    ) -> Result<BranchRegistration, ClientError> {
        let req = pb::RegisterBranchRequest {
            incarnation,
            txid,
            participant_id: participant_id.to_string(),
            address: address.to_string(),
            vote: vote.to_pb(),
            reason: reason.to_string(),
        };
        let r = self
            .in_trace(
                txid,
                self.call(Kind::Write, |ch, t| {
                    let rq = self.request(req.clone(), t);
                    async move { CoordinatorClient::new(ch).register_branch(rq).await }
                }),
            )
            .await?;
        Ok(BranchRegistration {
            term: r.term,
            incarnation: r.incarnation,
            existing: r.existing,
            deadline_unix_ms: r.deadline_unix_ms,
        })
    }

    /// What branch `participant_id` does with its work prepared for `txid`
    /// (received with `incarnation`; 0 when the branch never learned it).
    /// A member follows the transaction's decision; a branch that is not
    /// one is fenced out of an open transaction (a write, so this call is
    /// retried like one) and told to abort, also when the transaction
    /// committed without it. An error means no answer: keep the work
    /// prepared and ask again.
    pub async fn branch_decision(
        &self,
        txid: u64,
        participant_id: &str,
        incarnation: u64,
    ) -> Result<BranchDecision, ClientError> {
        let req = pb::GetBranchDecisionRequest {
            txid,
            participant_id: participant_id.to_string(),
            incarnation,
        };
        let r = self
            .call(Kind::Write, |ch, t| {
                let rq = self.request(req.clone(), t);
                async move { CoordinatorClient::new(ch).get_branch_decision(rq).await }
            })
            .await?;
        match pb::Outcome::try_from(r.outcome) {
            Ok(pb::Outcome::Commit) if r.member => Ok(BranchDecision::Commit),
            Ok(pb::Outcome::Abort) => Ok(BranchDecision::Abort { member: r.member }),
            Ok(pb::Outcome::Pending) if r.member => Ok(BranchDecision::Pending),
            Ok(pb::Outcome::OtherIncarnation) => Ok(BranchDecision::OtherIncarnation),
            _ => Err(ClientError::Internal(format!(
                "the server sent outcome value {} (member {}) for branch {participant_id:?} of txid {txid}",
                r.outcome, r.member
            ))),
        }
    }

    /// Begins a transaction with every participant and commits it in one
    /// call (one Raft write instead of Begin + Enlists + commit request).
    /// Idempotent by key: call again with the same key and request to learn
    /// the outcome of an earlier UNKNOWN.
    ///
    /// COMMITTED, ABORTED, or UNKNOWN when the outcome could not be learned.
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
        // One call: the caller's trace, or a new one.
        let ctx = trace::current().unwrap_or_else(TraceContext::new_root);
        let res = trace::scope(
            ctx,
            self.call(Kind::Write, |ch, t| {
                let rq = self.request(req.clone(), t);
                async move { CoordinatorClient::new(ch).begin_and_commit(rq).await }
            }),
        )
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

    /// `begin_and_commit`, called again with the same key and request (so
    /// it finds the same transaction) up to `retries` more times, `pause`
    /// apart, while the answer is UNKNOWN without a txid (no answer at
    /// all); the last answer otherwise. An UNKNOWN with a txid is returned
    /// as is: its decision can be looked up by txid.
    pub async fn begin_and_commit_retrying(
        &self,
        idempotency_key: &str,
        timeout_ms: u64,
        description: &[u8],
        participants: &[ParticipantSpec],
        retries: u32,
        pause: Duration,
    ) -> Result<OneShot, ClientError> {
        let mut res = self
            .begin_and_commit(idempotency_key, timeout_ms, description, participants)
            .await;
        for _ in 0..retries {
            match &res {
                Ok(r) if r.outcome == TxOutcome::Unknown && r.txid.is_none() => {
                    tokio::time::sleep(pause).await;
                    res = self
                        .begin_and_commit(idempotency_key, timeout_ms, description, participants)
                        .await;
                }
                _ => break,
            }
        }
        res
    }

    /// Asks for COMMIT and returns the recorded decision: COMMITTED, or
    /// ABORTED (a participant voted NO or did not answer in time, or the
    /// transaction had been aborted), or UNKNOWN when the outcome could not
    /// be learned before the deadline (it may still commit: ask again).
    pub async fn commit(&self, txid: u64) -> Result<TxOutcome, ClientError> {
        let res = self
            .in_trace(
                txid,
                self.call(Kind::Write, |ch, t| {
                    let rq = self.request(pb::CommitRequest { txid }, t);
                    async move { CoordinatorClient::new(ch).commit(rq).await }
                }),
            )
            .await;
        let outcome = match res {
            Ok(r) => tx_outcome(r.outcome),
            Err(ClientError::Unknown(_)) => Ok(TxOutcome::Unknown),
            Err(e) => Err(e),
        };
        self.forget_trace(txid, &outcome);
        outcome
    }

    /// The recorded decision after asking for ABORT (COMMIT if it was already
    /// committed), or UNKNOWN.
    pub async fn abort(&self, txid: u64, reason: &str) -> Result<TxOutcome, ClientError> {
        let req = pb::AbortRequest {
            txid,
            reason: reason.to_string(),
        };
        let res = self
            .in_trace(
                txid,
                self.call(Kind::Write, |ch, t| {
                    let rq = self.request(req.clone(), t);
                    async move { CoordinatorClient::new(ch).abort(rq).await }
                }),
            )
            .await;
        let outcome = match res {
            Ok(r) => tx_outcome(r.outcome),
            Err(ClientError::Unknown(_)) => Ok(TxOutcome::Unknown),
            Err(e) => Err(e),
        };
        self.forget_trace(txid, &outcome);
        outcome
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
            outcome: operator_outcome(commit),
            voters: voters.to_vec(),
            operator: operator.to_string(),
            reason: reason.to_string(),
            participant_lost: false,
        };
        self.resolve_request(req).await
    }

    /// An operator's heuristic decision of a one-phase commit whose one
    /// participant is gone for good (ADR 0039): the participant is
    /// declared lost and dropped, and `commit` (true: COMMIT, false: ABORT)
    /// recorded as the operator's decision, never as the participant's
    /// answer. Write-once like `resolve`; refused for a transaction that is
    /// not a one-phase commit.
    pub async fn declare_lost(
        &self,
        txid: u64,
        commit: bool,
        operator: &str,
        reason: &str,
    ) -> Result<(TxOutcome, bool), ClientError> {
        let req = pb::ResolveRequest {
            txid,
            outcome: operator_outcome(commit),
            voters: Vec::new(),
            operator: operator.to_string(),
            reason: reason.to_string(),
            participant_lost: true,
        };
        self.resolve_request(req).await
    }

    /// Operator: settles `txid` of ANOTHER incarnation `incarnation` (after
    /// a restore, one the old cluster handed out after the backup) with
    /// COMMIT (`commit`) or ABORT, so that participants' recovery applies it
    /// (docs/adr/0040-settling-another-incarnations-txid.md). `participants`
    /// are (id, address) pairs, each asked for its record first. Write-once:
    /// a settlement that stands is returned with `recorded` false, whatever
    /// was asked. Refused (`FailedPrecondition`) for incarnation 0, for a
    /// txid this cluster handed out, and when the participants' records do
    /// not support the outcome.
    pub async fn settle_other(
        &self,
        incarnation: u64,
        txid: u64,
        commit: bool,
        participants: &[(String, String)],
        operator: &str,
        reason: &str,
    ) -> Result<pb::SettleOtherResponse, ClientError> {
        let req = pb::SettleOtherRequest {
            incarnation,
            txid,
            outcome: operator_outcome(commit),
            participants: participants
                .iter()
                .map(|(id, address)| pb::SettleParticipant {
                    participant_id: id.clone(),
                    address: address.clone(),
                })
                .collect(),
            operator: operator.to_string(),
            reason: reason.to_string(),
        };
        self.call(Kind::Write, |ch, t| {
            let rq = self.request(req.clone(), t);
            async move { AdminClient::new(ch).settle_other(rq).await }
        })
        .await
    }

    async fn resolve_request(&self, req: pb::ResolveRequest) -> Result<(TxOutcome, bool), ClientError> {
        let r = self
            .call(Kind::Write, |ch, t| {
                let rq = self.request(req.clone(), t);
                async move { AdminClient::new(ch).resolve(rq).await }
            })
            .await?;
        Ok((tx_outcome(r.outcome)?, r.recorded))
    }

    /// One page of the transaction records the cluster holds, by ascending
    /// txid, filtered as `req` says (operator's `ListTransactions`: a
    /// linearizable read on the leader). Pass the answer's
    /// `next_after_txid` as `after_txid` for the next page until it is 0; a
    /// page may hold fewer than `limit` records before the end.
    pub async fn list_transactions(
        &self,
        req: pb::ListTransactionsRequest,
    ) -> Result<pb::ListTransactionsResponse, ClientError> {
        self.call(Kind::Read, |ch, t| {
            let rq = self.request(req.clone(), t);
            async move { AdminClient::new(ch).list_transactions(rq).await }
        })
        .await
    }

    /// Operator: stops delivering the decision of `txid` to `participant_id`
    /// (gone for good; the decision must be reconciled there by hand).
    /// `recorded` is false when it was dropped before, which is also what
    /// a retry after a lost reply answers. With authentication on, the
    /// cluster records the authenticated identity instead of `operator`.
    /// UNKNOWN surfaces as `ClientError::Unknown`.
    pub async fn drop_participant(
        &self,
        txid: u64,
        participant_id: &str,
        operator: &str,
        reason: &str,
    ) -> Result<pb::DropParticipantResponse, ClientError> {
        let req = pb::DropParticipantRequest {
            txid,
            participant_id: participant_id.to_string(),
            operator: operator.to_string(),
            reason: reason.to_string(),
        };
        self.call(Kind::Write, |ch, t| {
            let rq = self.request(req.clone(), t);
            async move { AdminClient::new(ch).drop_participant(rq).await }
        })
        .await
    }

    /// Operator: forgets the decided `txid` now; true when this call forgot
    /// it, false when there was no record (never begun, or forgotten before,
    /// which is also what a retry after a lost reply answers). Refused
    /// (`FailedPrecondition`) while a participant that was not dropped has
    /// not acked, and for a COMMIT a dropped participant never acked.
    /// UNKNOWN surfaces as `ClientError::Unknown`.
    pub async fn forget_transaction(&self, txid: u64, operator: &str, reason: &str) -> Result<bool, ClientError> {
        let req = pb::ForgetTransactionRequest {
            txid,
            operator: operator.to_string(),
            reason: reason.to_string(),
        };
        let r = self
            .call(Kind::Write, |ch, t| {
                let rq = self.request(req.clone(), t);
                async move { AdminClient::new(ch).forget_transaction(rq).await }
            })
            .await?;
        Ok(r.forgotten)
    }

    /// The whole replicated record of `txid` (linearizable read).
    pub async fn status(&self, txid: u64) -> Result<pb::StatusResponse, ClientError> {
        self.in_trace(
            txid,
            self.call(Kind::Read, |ch, t| {
                let rq = self.request(pb::StatusRequest { txid }, t);
                async move { CoordinatorClient::new(ch).status(rq).await }
            }),
        )
        .await
    }

    /// The decision of `txid` (linearizable read).
    pub async fn decision(&self, txid: u64) -> Result<DecisionRead, ClientError> {
        let r = self
            .in_trace(
                txid,
                self.call(Kind::Read, |ch, t| {
                    let rq = self.request(pb::GetDecisionRequest { txid, incarnation: 0 }, t);
                    async move { CoordinatorClient::new(ch).get_decision(rq).await }
                }),
            )
            .await?;
        DecisionRead::from_pb(r.outcome)
    }

    /// The decisions of `txids`, in order: one linearizable `GetDecisions`
    /// read, so at most `DECISION_BATCH_TXIDS_MAX` (1024) txids; more are
    /// refused by the cluster with [`ClientError::InvalidArgument`] naming
    /// the limit (use [`decisions_for`](Client::decisions_for) to ask for
    /// any number in batches). An outcome value this client does not know
    /// is [`ClientError::Internal`].
    pub async fn decisions(&self, txids: &[u64]) -> Result<Vec<(u64, DecisionRead)>, ClientError> {
        self.decisions_batch(0, txids, "")
            .await?
            .into_iter()
            .map(|a| match a.decision {
                Some(d) => Ok((a.txid, d)),
                None => Err(ClientError::Internal(format!(
                    "the server sent an outcome value this client does not know for txid {}",
                    a.txid
                ))),
            })
            .collect()
    }

    /// The decision of `txid` as participant `participant_id` asks for it:
    /// with [`DecisionAnswer::awaiting_ack`] (see
    /// [`decisions_for`](Client::decisions_for)).
    pub async fn decision_for(&self, txid: u64, participant_id: &str) -> Result<DecisionAnswer, ClientError> {
        self.decisions_for(&[txid], participant_id)
            .await?
            .pop()
            .ok_or_else(|| ClientError::Internal("an empty answer to a decision read".into()))
    }

    /// One answer per txid of `txids`, in order: the decision and, when
    /// `participant_id` is not empty, whether the cluster still awaits that
    /// participant's ack (a participant keeps its log record until it does
    /// not). Linearizable reads (`GetDecisions`) at any node, in batches of
    /// at most 1024 txids, each batch with this client's retries; a node
    /// whose answer does not match the batch is retried elsewhere. An error
    /// means no answer came for some batch before the call deadline (no
    /// quorum, say) and nothing is returned.
    pub async fn decisions_for(&self, txids: &[u64], participant_id: &str) -> Result<Vec<DecisionAnswer>, ClientError> {
        self.decisions_in(0, txids, participant_id).await
    }

    /// [`decisions_for`](Client::decisions_for) for txids a participant
    /// received with `incarnation` (`PrepareRequest.incarnation`): a txid
    /// that incarnation did not hand out at this cluster is answered
    /// [`DecisionRead::OtherIncarnation`], never presumed aborted.
    /// Incarnation 0 asks as an SDK from before incarnations did.
    pub async fn decisions_in(
        &self,
        incarnation: u64,
        txids: &[u64],
        participant_id: &str,
    ) -> Result<Vec<DecisionAnswer>, ClientError> {
        let mut out = Vec::with_capacity(txids.len());
        for chunk in txids.chunks(DECISION_BATCH_TXIDS_MAX) {
            out.extend(self.decisions_batch(incarnation, chunk, participant_id).await?);
        }
        Ok(out)
    }

    /// One `GetDecisions` read of `txids` (as many as given: the cluster
    /// refuses more than its limit), with this client's retries; an answer
    /// that does not match the request is retried at another node.
    async fn decisions_batch(
        &self,
        incarnation: u64,
        txids: &[u64],
        participant_id: &str,
    ) -> Result<Vec<DecisionAnswer>, ClientError> {
        let req = pb::GetDecisionsRequest {
            txids: txids.to_vec(),
            participant_id: participant_id.to_string(),
            incarnation,
        };
        let decisions = self
            .call(Kind::Read, |ch, t| {
                let rq = self.request(req.clone(), t);
                async move {
                    let answer = CoordinatorClient::new(ch).get_decisions(rq).await?;
                    let ds = &answer.get_ref().decisions;
                    if ds.len() != txids.len() || ds.iter().zip(txids).any(|(d, t)| d.txid != *t) {
                        // Retried (at another node), not taken.
                        return Err(Status::unknown(format!(
                            "{} decisions for {} txids, or not in request order",
                            ds.len(),
                            txids.len()
                        )));
                    }
                    Ok(answer.map(|a| a.decisions))
                }
            })
            .await?;
        Ok(decisions
            .into_iter()
            .map(|d| DecisionAnswer {
                txid: d.txid,
                decision: DecisionRead::from_pb(d.outcome).ok(),
                awaiting_ack: d.awaiting_ack,
                settled_by: d.settled_by,
            })
            .collect())
    }

    /// Cluster status as seen by the first endpoint that answers.
    pub async fn cluster_status(&self) -> Result<pb::ClusterStatusResponse, ClientError> {
        self.call(Kind::Read, |ch, t| {
            let rq = self.request(pb::ClusterStatusRequest {}, t);
            async move { AdminClient::new(ch).cluster_status(rq).await }
        })
        .await
    }
}

/// Whether `status` is a request's own timeout running out (tonic answers
/// CANCELLED "Timeout expired" when the timeout it was given fires, or
/// DEADLINE_EXCEEDED), not an answer of the server.
fn is_timeout(status: &Status) -> bool {
    match status.code() {
        Code::DeadlineExceeded => true,
        Code::Cancelled => status.message().contains("Timeout expired"),
        _ => false,
    }
}

/// A status's message and the chain of errors under it: a transport
/// failure says only "transport error" by itself, and the TLS alert or
/// refused connection that caused it is in the chain.
pub fn describe(status: &Status) -> String {
    let mut out = status.message().to_string();
    let mut cause = std::error::Error::source(status);
    while let Some(c) = cause {
        let text = c.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cause = c.source();
    }
    out
}

/// A request carrying `token` as its bearer token (`authorization: Bearer
/// …`), for callers that build their own calls.
pub fn request_with_token<T>(msg: T, token: Option<&str>) -> tonic::Request<T> {
    let mut rq = tonic::Request::new(msg);
    if let Some(v) = token.and_then(|t| format!("Bearer {t}").parse().ok()) {
        rq.metadata_mut().insert("authorization", v);
    }
    rq
}

/// One attempt at one node, no retries (for tests and tools that must talk
/// to a particular node, e.g. to prove a cut-off node does not answer).
pub async fn decision_at(addr: &str, txid: u64, timeout: Duration) -> Result<DecisionRead, Status> {
    let ch = channel(addr, None, timeout).map_err(Status::invalid_argument)?;
    let mut rq = tonic::Request::new(pb::GetDecisionRequest { txid, incarnation: 0 });
    rq.set_timeout(timeout);
    let r = tokio::time::timeout(timeout, CoordinatorClient::new(ch).get_decision(rq))
        .await
        .map_err(|_| Status::deadline_exceeded("no reply"))??;
    DecisionRead::from_pb(r.into_inner().outcome).map_err(|e| Status::internal(e.to_string()))
}

/// Cluster status of one particular node.
pub async fn cluster_status_at(addr: &str, timeout: Duration) -> Result<pb::ClusterStatusResponse, Status> {
    cluster_status_with(addr, timeout, None).await
}

/// As [`cluster_status_at`], over TLS when `tls` is set.
pub async fn cluster_status_with(
    addr: &str,
    timeout: Duration,
    tls: Option<&Arc<dtx_tls::ClientTls>>,
) -> Result<pb::ClusterStatusResponse, Status> {
    cluster_status_as(addr, timeout, tls, None).await
}

/// As [`cluster_status_with`], with a bearer token (an operator's).
pub async fn cluster_status_as(
    addr: &str,
    timeout: Duration,
    tls: Option<&Arc<dtx_tls::ClientTls>>,
    token: Option<&str>,
) -> Result<pb::ClusterStatusResponse, Status> {
    let ch = dtx_transport::channel::channel_with(addr, None, timeout, tls).map_err(Status::invalid_argument)?;
    let mut rq = request_with_token(pb::ClusterStatusRequest {}, token);
    rq.set_timeout(timeout);
    tokio::time::timeout(timeout, AdminClient::new(ch).cluster_status(rq))
        .await
        .map_err(|_| Status::deadline_exceeded("no reply"))?
        .map(|r| r.into_inner())
}

#[cfg(test)]
mod tests;
