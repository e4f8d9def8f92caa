//! What every part of a running node shares: its id and configuration,
//! Raft, the state machine, the batcher and the channels to other nodes and
//! participants, with the Raft-level helpers on top (propose and wait,
//! linearizable reads, the leader hint), and `ApiError`, the error every
//! call on it answers (`api::error` maps it to a gRPC status, in one place).
//! It imports nothing of the API or the 2PC driver: both stand on it, and
//! `node` wires them together.

use std::sync::Arc;
use std::time::Duration;
use std::time::SystemTime;
use std::time::UNIX_EPOCH;

use dtx_transport::channel::Channel;
use openraft::error::CheckIsLeaderError;
use openraft::error::RaftError;

use crate::batcher::Batcher;
use crate::batcher::ProposeError;
use crate::config::Config;
use crate::raft::network::ChannelCache;
use crate::raft::NodeId;
use crate::raft::NodeInfo;
use crate::raft::Raft;
use crate::sm::saga::SagaError;
use crate::sm::Command;
use crate::sm::CommandError;
use crate::sm::CommandOk;
use crate::sm::Txid;
use crate::store::sm_store::SmState;
use crate::store::KvEngine;
use crate::store::StateMachineStore;
use dtx_proto::v1::participant_service_client::ParticipantServiceClient;
use tonic::service::interceptor::InterceptedService;

/// The error of a call on the node: what the API answers (mapped to a gRPC
/// status in `api::error`) and what the driver and the node's loops get
/// from proposing and reading.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    FailedPrecondition(String),
    /// A branch's registration refused (FAILED_PRECONDITION with the kind
    /// under `x-dtx-branch-refusal`); nothing was recorded.
    #[error("{message}")]
    BranchRefused {
        kind: dtx_proto::metadata::BranchRefusalKind,
        message: String,
    },
    /// The authenticated application may not act on this transaction (it
    /// belongs to another); nothing was changed.
    #[error("{0}")]
    PermissionDenied(String),
    /// This node is not the leader. `proposed` tells whether the command was
    /// handed to Raft before that was found out (then it may still apply).
    #[error("{}", not_leader_text(*leader_id, leader_api_addr.as_deref()))]
    NotLeader {
        leader_id: Option<NodeId>,
        leader_api_addr: Option<String>,
        proposed: bool,
    },
    /// No leader is known; nothing was proposed.
    #[error("{0}")]
    NoLeader(String),
    #[error("{0}")]
    Unavailable(String),
    /// The outcome is not known: the command may or may not be applied.
    #[error("outcome unknown: {0}")]
    Unknown(String),
    #[error("{0}")]
    Internal(String),
}

/// A retained record that could not be read is no answer yet (never "not
/// found", which would read as presumed abort): UNAVAILABLE, retried.
impl From<crate::store::retained::RetainedReadError> for ApiError {
    fn from(e: crate::store::retained::RetainedReadError) -> Self {
        ApiError::Unavailable(e.to_string())
    }
}

/// "not the leader" and who is, in words (never Rust's `Some(..)`: the
/// text reaches operators).
fn not_leader_text(leader_id: Option<NodeId>, addr: Option<&str>) -> String {
    match (leader_id, addr) {
        (Some(id), Some(a)) => format!("not the leader; the leader is node {id} at {a}"),
        (Some(id), None) => format!("not the leader; the leader is node {id} (its address is not known here)"),
        (None, _) => "not the leader, and no leader is known (an election may be under way)".to_string(),
    }
}

fn not_owner(txid: Txid, owner: &str, caller: &str) -> ApiError {
    ApiError::PermissionDenied(format!(
        "transaction {txid} belongs to application {owner}; application {caller} may not act on it"
    ))
}

/// `cmd` on behalf of application `caller`, when there is one.
pub fn on_behalf(caller: Option<&str>, cmd: Command) -> Command {
    match caller {
        Some(c) => Command::As {
            caller: c.to_string(),
            command: Box::new(cmd),
        },
        None => cmd,
    }
}

impl From<CommandError> for ApiError {
    fn from(e: CommandError) -> Self {
        let m = e.to_string();
        match e {
            CommandError::NotFound { .. } => ApiError::NotFound(m),
            CommandError::KeyConflict { .. } => ApiError::AlreadyExists(m),
            CommandError::Invalid(_) => ApiError::InvalidArgument(m),
            CommandError::TooManyParticipants { .. } => ApiError::InvalidArgument(m),
            CommandError::NotActive { .. }
            | CommandError::ParticipantConflict { .. }
            | CommandError::VotersMismatch { .. }
            | CommandError::DeadlineNotReached { .. }
            | CommandError::NotDecided { .. }
            | CommandError::NotAllAcked { .. }
            | CommandError::UnknownParticipant { .. }
            | CommandError::OnePhaseOnly { .. }
            | CommandError::OperatorCommitNotPrepared { .. }
            | CommandError::SettlementRefused(_)
            | CommandError::Fenced { .. } => ApiError::FailedPrecondition(m),
            CommandError::Saga(e) => ApiError::from(e),
        }
    }
}

impl From<SagaError> for ApiError {
    fn from(e: SagaError) -> Self {
        let m = e.to_string();
        match e {
            SagaError::InvalidDefinition(_) | SagaError::Invalid(_) => ApiError::InvalidArgument(m),
            SagaError::DefinitionConflict { .. } | SagaError::KeyConflict { .. } => ApiError::AlreadyExists(m),
            SagaError::UnknownDefinition { .. } | SagaError::NotFound(_) => ApiError::NotFound(m),
            SagaError::StaleJournal { .. } | SagaError::WrongState { .. } | SagaError::Refused { .. } => {
                ApiError::FailedPrecondition(m)
            }
        }
    }
}

impl From<ProposeError> for ApiError {
    fn from(e: ProposeError) -> Self {
        match e {
            ProposeError::NotLeader { leader_id, leader } => ApiError::NotLeader {
                leader_id,
                leader_api_addr: leader.map(|n| n.api_addr),
                proposed: true,
            },
            ProposeError::TooLarge { .. } => ApiError::InvalidArgument(e.to_string()),
            ProposeError::Overloaded(_) => ApiError::NoLeader(e.to_string()),
            ProposeError::Unavailable(_) => ApiError::Unavailable(e.to_string()),
        }
    }
}

/// Milliseconds since the Unix epoch by this node's clock. Only the leader
/// reads it, to put the time into commands; the state machine never does.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// How a node calls participants (see [`NodeCtx::participant_over`]).
pub type ParticipantClient = ParticipantServiceClient<InterceptedService<Channel, ParticipantGate>>;

/// What every call from this node to a participant or a saga step service
/// passes before it leaves (invariant 13, quorum before action): this node
/// is the leader and has heard from a quorum within the serving rule's
/// limit (`raft.election_timeout_max_ms`, `raft::serving`). openraft 0.9
/// has no check-quorum, so a leader cut off from its followers stays
/// leader in its old term for as long as it is cut off; without this it
/// would go on preparing, re-sending one-phase commits and delivering
/// while another leader decides the same transactions. A call refused
/// here is never sent: it fails UNAVAILABLE at once (a Prepare counts as
/// no vote, a delivery is retried later), and is counted in
/// `dtx_participant_calls_withheld_total`. Then the node's token, if any,
/// is attached.
#[derive(Clone)]
pub struct ParticipantGate {
    bearer: dtx_tls::edge::Bearer,
    raft: Raft,
    me: NodeId,
    silence_ms: u64,
}

impl ParticipantGate {
    pub fn new(bearer: dtx_tls::edge::Bearer, raft: Raft, me: NodeId, config: &Config) -> Self {
        ParticipantGate {
            bearer,
            raft,
            me,
            silence_ms: crate::raft::serving::Limits::of(config).silence_ms,
        }
    }
}

impl tonic::service::Interceptor for ParticipantGate {
    fn call(&mut self, req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Err(why) = quorum_heard(&self.raft, self.me, self.silence_ms) {
            metrics::counter!("dtx_participant_calls_withheld_total").increment(1);
            return Err(tonic::Status::unavailable(format!(
                "not sent to the participant: {why} (invariant 13: a node sends nothing to a participant unless it \
                 leads and heard from a quorum within the serving limit)"
            )));
        }
        self.bearer.call(req)
    }
}

/// Ok when `me` leads and a quorum acknowledged it within `silence_ms`
/// (openraft's `millis_since_quorum_ack`, as the serving rule reads it);
/// otherwise why not.
pub(crate) fn quorum_heard(raft: &Raft, me: NodeId, silence_ms: u64) -> Result<(), String> {
    let rx = raft.metrics();
    let m = rx.borrow();
    if m.current_leader != Some(me) {
        return Err("this node is not the leader".to_string());
    }
    match m.millis_since_quorum_ack {
        Some(ms) if ms <= silence_ms => Ok(()),
        Some(ms) => Err(format!(
            "this leader has heard from no quorum for {ms} ms, over the limit of {silence_ms} ms (cut off? another \
             leader may be elected)"
        )),
        None => Err("this leader has not heard from a quorum yet".to_string()),
    }
}

/// Everything a request handler needs; shared by the services.
pub struct NodeCtx {
    pub id: NodeId,
    pub config: Config,
    pub raft: Raft,
    pub sm: StateMachineStore,
    pub batcher: Batcher,
    pub engine: Arc<dyn KvEngine>,
    pub(crate) channels: ChannelCache,
    /// Every call to a participant or step service passes it: the quorum
    /// check of invariant 13, then the bearer token
    /// (`auth.participant_token_file`) for participants that accept a token
    /// where mutual TLS is not used.
    pub(crate) participant_gate: ParticipantGate,
}

impl NodeCtx {
    /// The leader this node knows of, with its advertised addresses.
    pub fn leader(&self) -> Option<(NodeId, Option<NodeInfo>)> {
        let rx = self.raft.metrics();
        let m = rx.borrow();
        let id = m.current_leader?;
        let node = m.membership_config.membership().get_node(&id).cloned();
        Some((id, node))
    }

    pub fn current_term(&self) -> u64 {
        self.raft.metrics().borrow().current_term
    }

    pub fn not_leader(&self) -> ApiError {
        match self.leader() {
            Some((id, node)) if id != self.id => ApiError::NotLeader {
                leader_id: Some(id),
                leader_api_addr: node.map(|n| n.api_addr),
                proposed: false,
            },
            _ => ApiError::NoLeader("no leader is known yet (election in progress or no quorum)".into()),
        }
    }

    /// For a leader that has not heard from a quorum for longer than twice
    /// the longest election timeout (a majority has likely elected another
    /// leader): how long, in ms. `None` otherwise.
    fn quorum_silence_ms(&self) -> Option<u64> {
        let rx = self.raft.metrics();
        let m = rx.borrow();
        let limit_ms = self.config.raft.election_timeout_max_ms.saturating_mul(2);
        match (m.current_leader == Some(self.id), m.millis_since_quorum_ack) {
            (true, Some(ms)) if ms > limit_ms => Some(ms),
            _ => None,
        }
    }

    /// True while this node is the leader of `term` (a delivery or drive
    /// that started in `term` stops once it is not, invariant 9).
    pub fn is_leader_of(&self, term: u64) -> bool {
        let rx = self.raft.metrics();
        let m = rx.borrow();
        m.current_leader == Some(self.id) && m.current_term == term
    }

    /// True once this node has applied an entry of its current term (a
    /// leader's first is the blank entry of its election): its table then
    /// holds every write of the terms before, so work that starts from the
    /// table (resumed deliveries, re-drives, sagas) waits for it. A leader
    /// always starts a term of its own, even after a restart (ADR 0028).
    pub fn caught_up_in_term(&self) -> bool {
        let m = self.raft.metrics();
        let m = m.borrow();
        m.last_applied.is_some_and(|l| l.leader_id.get_term() == m.current_term)
    }

    pub(crate) fn is_leader(&self) -> bool {
        self.raft.metrics().borrow().current_leader == Some(self.id)
    }

    /// Proposes one command through the batcher and waits until it is
    /// applied. A write that does not finish in time is UNKNOWN.
    pub async fn propose(&self, cmd: Command) -> Result<CommandOk, ApiError> {
        self.propose_together(vec![cmd])
            .await?
            .pop()
            .unwrap_or_else(|| Err(ApiError::Internal("the state machine returned no result".into())))
    }

    /// Proposes `cmds` in one Raft entry. The outer error means none was
    /// applied (or, for UNKNOWN, that it is not known whether they were);
    /// otherwise each command has its own result, in order.
    pub async fn propose_together(&self, cmds: Vec<Command>) -> Result<Vec<Result<CommandOk, ApiError>>, ApiError> {
        if !self.is_leader() {
            return Err(self.not_leader());
        }
        if let Some(ms) = self.quorum_silence_ms() {
            // Cut off from the majority: the write could only wait out its
            // timeout. Refuse it now (certainly not applied), so the caller
            // tries another node, where a new leader is being elected.
            metrics::counter!("dtx_writes_refused_no_quorum_total").increment(1);
            return Err(ApiError::NoLeader(format!(
                "this leader has heard from no quorum for {ms} ms (cut off?); try another node"
            )));
        }
        if cmds.iter().any(crate::sm::hands_out_ids) {
            self.open_incarnation().await?;
        }
        let timeout = Duration::from_millis(self.config.api.write_timeout_ms);
        match tokio::time::timeout(timeout, self.batcher.propose_together(cmds)).await {
            Ok(Ok(results)) => Ok(results.into_iter().map(|r| r.map_err(ApiError::from)).collect()),
            Ok(Err(e)) => Err(ApiError::from(e)),
            Err(_) => Err(ApiError::Unknown(format!(
                "not applied within api.write_timeout_ms = {} ms; it may still be applied",
                self.config.api.write_timeout_ms
            ))),
        }
    }

    /// The incarnation that handed out `txid` (ADR 0033), sent with it to
    /// participants. 0 for a txid from before incarnations (and for one
    /// this cluster cannot place, which it never drives).
    pub fn incarnation_of(&self, txid: Txid) -> u64 {
        self.sm.state().incarnations.of_txid(txid).unwrap_or(0)
    }

    /// The incarnation ids are handed out in (ADR 0033). When none is open
    /// (a new cluster, one from before incarnations, or one just restored
    /// from a backup), opens one with a random id first: the state machine
    /// keeps the first that is applied, so leaders that race agree.
    pub async fn open_incarnation(&self) -> Result<u64, ApiError> {
        if let Some(i) = self.sm.state().incarnations.current() {
            return Ok(i);
        }
        let incarnation = loop {
            let r: u64 = rand::random();
            if r != 0 {
                break r;
            }
        };
        let cmd = Command::OpenIncarnation { incarnation };
        let timeout = Duration::from_millis(self.config.api.write_timeout_ms);
        let applied = match tokio::time::timeout(timeout, self.batcher.propose_together(vec![cmd])).await {
            Ok(Ok(mut results)) => results.pop(),
            Ok(Err(e)) => return Err(ApiError::from(e)),
            Err(_) => {
                return Err(ApiError::Unavailable(format!(
                    "this cluster is choosing its incarnation and that write was not applied within \
                     api.write_timeout_ms = {} ms; nothing else was proposed: retry",
                    self.config.api.write_timeout_ms
                )))
            }
        };
        match applied {
            Some(Ok(CommandOk::IncarnationOpened { incarnation, .. })) => Ok(incarnation),
            Some(Err(e)) => Err(ApiError::Internal(format!("opening an incarnation was refused: {e}"))),
            other => Err(ApiError::Internal(format!(
                "unexpected state-machine result {other:?} for OpenIncarnation"
            ))),
        }
    }

    /// Runs `f` on the state machine after a read-index round on the leader:
    /// linearizable (invariant 7). A node that cannot confirm its
    /// leadership with a quorum does not answer.
    pub async fn read_linearizable<T>(&self, f: impl FnOnce(&SmState) -> T) -> Result<T, ApiError> {
        if !self.is_leader() {
            return Err(self.not_leader());
        }
        let timeout = Duration::from_millis(self.config.api.read_timeout_ms);
        // openraft's read index is at least the blank entry of this
        // leader's term, so every write acknowledged before is covered.
        let read_index = self.raft.ensure_linearizable();
        match tokio::time::timeout(timeout, read_index).await {
            Ok(Ok(_)) => Ok(f(&self.sm.state())),
            Ok(Err(RaftError::APIError(CheckIsLeaderError::ForwardToLeader(fw)))) => Err(ApiError::NotLeader {
                leader_id: fw.leader_id,
                leader_api_addr: fw.leader_node.map(|n| n.api_addr),
                proposed: false,
            }),
            Ok(Err(RaftError::APIError(CheckIsLeaderError::QuorumNotEnough(q)))) => {
                let got: Vec<String> = q.got.iter().map(|n| n.to_string()).collect();
                Err(ApiError::Unavailable(format!(
                    "no quorum confirmed this leader: only node(s) {} answered, and a majority of the voters must \
                     (the others are down or cut off; ask another node)",
                    got.join(", ")
                )))
            }
            Ok(Err(RaftError::Fatal(f))) => Err(ApiError::Unavailable(format!("raft stopped: {f}"))),
            Err(_) => Err(ApiError::Unavailable(format!(
                "no quorum confirmed this leader within api.read_timeout_ms = {} ms",
                self.config.api.read_timeout_ms
            ))),
        }
    }

    /// Refuses when `txid` belongs to another application than `caller`
    /// (None: not an application, or authentication off: no check). The
    /// owner is write-once, so a record applied here answers for good;
    /// otherwise a linearizable read asks (on a follower: "not the leader",
    /// and the call is forwarded). A transaction without a record, or
    /// begun without an owner, passes: the command itself then decides.
    pub async fn check_owner(&self, txid: Txid, caller: Option<&str>) -> Result<(), ApiError> {
        let Some(me) = caller else { return Ok(()) };
        let local = {
            let st = self.sm.state();
            st.with_txid(txid, |t| t.get(txid).map(|_| t.owner(txid).map(str::to_string)))?
        };
        let owner = match local {
            Some(o) => o,
            None => self.read_linearizable(|st| st.owner(txid)).await??,
        };
        match owner {
            Some(o) if o != me => Err(not_owner(txid, &o, me)),
            _ => Ok(()),
        }
    }

    /// After a Begin-like command returned `txid` (new, or found by its
    /// key): refuses when it belongs to another application than `caller`.
    /// Its record is applied here (in memory or retained, ADR 0050), so
    /// the local state answers.
    pub fn check_owner_applied(&self, txid: Txid, caller: Option<&str>) -> Result<(), ApiError> {
        let Some(me) = caller else { return Ok(()) };
        match self.sm.state().owner(txid)? {
            Some(o) if o != me => Err(not_owner(txid, &o, me)),
            _ => Ok(()),
        }
    }

    /// A client of a participant service over `ch`, with the node's token
    /// (if configured) on every call.
    pub fn participant_over(&self, ch: Channel) -> ParticipantClient {
        ParticipantServiceClient::with_interceptor(ch, self.participant_gate.clone())
    }

    /// Ok when this node may act towards participants now (invariant 13):
    /// it leads and heard from a quorum within the serving limit.
    pub fn quorum_heard(&self) -> Result<(), String> {
        quorum_heard(
            &self.raft,
            self.id,
            crate::raft::serving::Limits::of(&self.config).silence_ms,
        )
    }

    /// A cached channel to another node's API or to a participant service,
    /// bound to our own IP.
    pub fn api_channel(&self, addr: &str) -> Result<Channel, ApiError> {
        self.channels.get(addr).map_err(ApiError::Unavailable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An operator read "leader is Some(3) at Some(\"10.0.0.3:7201\")"; the
    /// text says it in words.
    #[test]
    fn not_the_leader_names_the_leader_in_words_never_rust_options() {
        let cases = [
            (
                Some(3),
                Some("10.0.0.3:7201".to_string()),
                "the leader is node 3 at 10.0.0.3:7201",
            ),
            (Some(3), None, "the leader is node 3"),
            (None, None, "no leader is known"),
        ];
        for (leader_id, leader_api_addr, want) in cases {
            let text = ApiError::NotLeader {
                leader_id,
                leader_api_addr,
                proposed: false,
            }
            .to_string();
            assert!(text.contains(want), "{text}");
            assert!(!text.contains("Some(") && !text.contains("None"), "{text}");
        }
    }
}
