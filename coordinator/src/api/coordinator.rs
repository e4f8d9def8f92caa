//! The `Coordinator` service: begin, enlist, commit, abort, status and
//! linearizable decision reads.

use std::sync::Arc;

use dtx_proto::v1 as pb;
use dtx_proto::v1::coordinator_client::CoordinatorClient;
use dtx_proto::v1::coordinator_server::Coordinator;
use sha2::Digest;
use sha2::Sha256;
use tonic::Request;
use tonic::Response;
use tonic::Status;

use dtx_tls::logtext::clean;

use super::check_id;
use super::check_len;
use super::error::ApiError;
use super::serve_or_forward;
use crate::ctx::now_ms;
use crate::ctx::on_behalf;
use crate::ctx::NodeCtx;
use crate::driver::Driver;
use crate::limits;
use crate::participant_policy::AddressPolicy;
use crate::sm::incarnation::Belonging;
use crate::sm::BranchRefusal;
use crate::sm::BranchView;
use crate::sm::BranchVote;
use crate::sm::Command;
use crate::sm::CommandOk;
use crate::sm::Decision;
use crate::sm::DecisionSource;
use crate::sm::DecisionView;
use crate::sm::Enlistment;
use crate::sm::Outcome;
use crate::sm::Phase;
use crate::sm::TxRecord;
use crate::sm::TxTable;

pub struct CoordinatorService {
    driver: Arc<Driver>,
    /// `participants.allowed_addresses` (ADR 0041).
    policy: Result<AddressPolicy, String>,
}

impl CoordinatorService {
    pub fn new(driver: Arc<Driver>) -> Self {
        // Checked by `Config::validate` before the node starts; a policy
        // that does not parse all the same refuses every address.
        let policy = AddressPolicy::parse(&driver.ctx.config.participants.allowed_addresses);
        CoordinatorService { driver, policy }
    }

    fn ctx(&self) -> &Arc<NodeCtx> {
        &self.driver.ctx
    }

    /// This node reaches participants over TLS.
    fn tls(&self) -> bool {
        self.ctx().channels.tls().is_some()
    }
}

/// The request fingerprint of Begin: everything but the key.
pub fn begin_fingerprint(timeout_ms: u64, description: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"dtx.v1.Begin\0");
    h.update(timeout_ms.to_le_bytes());
    h.update(description);
    h.finalize().into()
}

/// The request fingerprint of BeginAndCommit: everything but the key.
pub fn begin_and_commit_fingerprint(
    timeout_ms: u64,
    description: &[u8],
    participants: &[pb::ParticipantSpec],
) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"dtx.v1.BeginAndCommit\0");
    h.update(timeout_ms.to_le_bytes());
    h.update((description.len() as u64).to_le_bytes());
    h.update(description);
    for p in participants {
        for field in [p.participant_id.as_bytes(), p.address.as_bytes(), &p.payload] {
            h.update((field.len() as u64).to_le_bytes());
            h.update(field);
        }
    }
    h.finalize().into()
}

pub fn outcome_pb(o: Outcome) -> pb::Outcome {
    match o {
        Outcome::Commit => pb::Outcome::Commit,
        Outcome::Abort => pb::Outcome::Abort,
    }
}

pub fn view_pb(v: &DecisionView) -> pb::Outcome {
    match v {
        DecisionView::Pending => pb::Outcome::Pending,
        DecisionView::Decided(o) => outcome_pb(*o),
        DecisionView::Unknown => pb::Outcome::UnknownPresumedAbort,
    }
}

pub fn source_pb(s: DecisionSource) -> pb::DecisionSource {
    match s {
        DecisionSource::Driver => pb::DecisionSource::Driver,
        DecisionSource::Client => pb::DecisionSource::Client,
        DecisionSource::Reaper => pb::DecisionSource::Reaper,
        DecisionSource::Operator => pb::DecisionSource::Operator,
        DecisionSource::OperatorHeuristic => pb::DecisionSource::OperatorHeuristic,
    }
}

pub fn decision_pb(d: &Decision) -> pb::Decision {
    pb::Decision {
        outcome: outcome_pb(d.outcome) as i32,
        source: source_pb(d.source) as i32,
        term: d.term,
        decided_unix_ms: d.decided_ms,
        note: d.note.clone(),
    }
}

/// The replicated record of a transaction as `Status` (and
/// `ListTransactions`, `DropParticipant`) show it: the record, its owner
/// and the participants an operator dropped, all from `table`.
pub(crate) fn status_pb(table: &TxTable, r: &TxRecord) -> pb::StatusResponse {
    pb::StatusResponse {
        txid: r.txid,
        state: match r.phase {
            Phase::Active => pb::TxState::Active,
            Phase::Preparing => pb::TxState::Preparing,
            Phase::Decided(_) => pb::TxState::Decided,
        } as i32,
        participants: r
            .participants
            .iter()
            .map(|p| {
                let dropped = table.drop_of(r.txid, &p.id);
                pb::ParticipantInfo {
                    id: p.id.clone(),
                    address: p.address.clone(),
                    acked: p.acked,
                    dropped: dropped.is_some(),
                    dropped_note: dropped.map(|d| d.note.clone()).unwrap_or_default(),
                    dropped_unix_ms: dropped.map(|d| d.dropped_ms).unwrap_or(0),
                    ..Default::default()
                }
            })
            .collect(),
        begun_unix_ms: r.begun_ms,
        deadline_unix_ms: r.deadline_ms,
        decision: r.decision().map(decision_pb),
        one_phase: r.one_phase,
        owner: table.owner(r.txid).unwrap_or_default().to_string(),
        incarnation: 0,
    }
}

/// `status_pb` with the incarnation that handed the txid out (ADR 0033).
pub(crate) fn status_pb_in(st: &crate::store::sm_store::SmState, r: &TxRecord) -> pb::StatusResponse {
    pb::StatusResponse {
        incarnation: st.incarnations.of_txid(r.txid).unwrap_or(0),
        ..status_pb(&st.table, r)
    }
}

/// Status of a transaction on the one-write path whose record is not
/// written yet: PREPARING, with the participants its Prepares went to.
fn in_flight_status_pb(txid: u64, v: &crate::driver::InFlightView) -> pb::StatusResponse {
    pb::StatusResponse {
        txid,
        state: pb::TxState::Preparing as i32,
        participants: v
            .participants
            .iter()
            .map(|(id, address)| pb::ParticipantInfo {
                id: id.clone(),
                address: address.clone(),
                ..Default::default()
            })
            .collect(),
        begun_unix_ms: v.begun_ms,
        deadline_unix_ms: v.deadline_ms,
        decision: None,
        one_phase: false,
        owner: v.owner.clone().unwrap_or_default(),
        incarnation: 0,
    }
}

/// Who a transaction's delivery errors are shown to (ADR 0041).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Audience {
    /// The Coordinator API's Status: the error's class only
    /// ("unreachable", "refused", "error"), never the transport's text,
    /// which would tell a refused connection from a TLS failure at an
    /// address the application chose.
    Application,
    /// The Admin API (ListTransactions, DropParticipant) and the console:
    /// the error in full.
    Operator,
}

/// Adds this leader's phase-two attempts to each participant of each of
/// `statuses` (leader-local, not replicated; one question to the driver
/// for all), so a transaction stuck on a participant shows why (invariant
/// 11): in full to operators, as a class to applications.
pub(crate) async fn add_delivery_attempts(driver: &Driver, statuses: &mut [pb::StatusResponse], audience: Audience) {
    let keys: Vec<(u64, String)> = statuses
        .iter()
        .flat_map(|s| s.participants.iter().map(|p| (s.txid, p.id.clone())))
        .collect();
    if keys.is_empty() {
        return;
    }
    let mut found = driver.delivery_attempts(keys).await.into_iter();
    for p in statuses.iter_mut().flat_map(|s| s.participants.iter_mut()) {
        if let Some(a) = found.next().flatten() {
            p.delivery_attempts = a.attempts;
            p.last_delivery_error = match audience {
                Audience::Operator => a.last_error,
                Audience::Application => a.last_error_class.map(|c| c.as_str().to_string()).unwrap_or_default(),
            };
            p.next_delivery_unix_ms = a.next_unix_ms;
        }
    }
}

/// Checks one participant's fields (Enlist and BeginAndCommit): their
/// form (INVALID_ARGUMENT), then the address policy (PERMISSION_DENIED).
fn check_participant(
    id: &str,
    address: &str,
    payload: &[u8],
    tls: bool,
    policy: &Result<AddressPolicy, String>,
) -> Result<(), ApiError> {
    check_id("participant_id", id)?;
    if address.is_empty() {
        return Err(ApiError::InvalidArgument(format!(
            "participant {id:?}: address must not be empty"
        )));
    }
    check_len("address", address.len(), limits::ADDRESS_BYTES_MAX)?;
    // The parser the driver connects with: what is accepted here can be
    // reached at commit time, and a mistake shows now, not as an ABORT
    // later. (Only here, not in the state machine: the state machine must
    // decide the same on every node and every version, and this parser is
    // tonic's.)
    dtx_transport::channel::check_address(address, tls)
        .map_err(|e| ApiError::InvalidArgument(format!("participant {id:?}: field address: {e}")))?;
    check_len("payload", payload.len(), limits::PAYLOAD_BYTES_MAX)?;
    // The operators' policy (ADR 0041): checked here, where the
    // leader serves the call, before anything is proposed. The refusal
    // names the key, never the allowed entries, and quotes the address
    // escaped and cut.
    let allowed = match policy {
        Ok(p) => p.allows_address(address),
        Err(_) => false,
    };
    if !allowed {
        return Err(ApiError::PermissionDenied(format!(
            "participant \"{}\": address \"{}\" is not allowed by {} in the nodes' configuration; \
             ask the cluster's operators to allow it",
            clean(id),
            clean(address),
            crate::participant_policy::KEY,
        )));
    }
    Ok(())
}

/// The authenticated application a call is made for (on behalf of whom a
/// forwarding node calls, too); None for other roles and without
/// authentication. Transactions it begins are its own, and only it may
/// enlist in (as the application), commit or abort them.
fn app_caller<T>(req: &Request<T>) -> Option<String> {
    crate::security::caller(req)
        .filter(|id| id.role == dtx_tls::Role::Application)
        .map(|id| id.name)
}

fn unexpected(ok: CommandOk) -> ApiError {
    ApiError::Internal(format!("unexpected state-machine result {ok:?}"))
}

impl CoordinatorService {
    /// Checks what Begin and BeginAndCommit share; returns the timeout to use.
    fn check_begin(&self, key: &str, timeout_ms: u64, description: &[u8]) -> Result<u64, ApiError> {
        check_id("idempotency_key", key)?;
        check_len("description", description.len(), limits::DESCRIPTION_BYTES_MAX)?;
        let t = &self.ctx().config.txn;
        if timeout_ms > t.max_timeout_ms {
            return Err(ApiError::InvalidArgument(format!(
                "timeout_ms is {timeout_ms}; the limit is txn.max_timeout_ms = {} ms",
                t.max_timeout_ms
            )));
        }
        Ok(if timeout_ms == 0 {
            t.default_timeout_ms
        } else {
            timeout_ms
        })
    }

    async fn begin(&self, req: pb::BeginRequest, app: Option<&str>) -> Result<pb::BeginResponse, ApiError> {
        let timeout_ms = self.check_begin(&req.idempotency_key, req.timeout_ms, &req.description)?;
        let cmd = Command::Begin {
            fingerprint: begin_fingerprint(req.timeout_ms, &req.description),
            idempotency_key: req.idempotency_key,
            now_ms: now_ms(),
            timeout_ms,
        };
        let began = self.ctx().propose(on_behalf(app, cmd)).await?;
        dtx_failpoint::failpoint!("coordinator_after_begin");
        match began {
            CommandOk::Began {
                txid,
                existing,
                deadline_ms,
            } => {
                // The key may be another application's.
                self.ctx().check_owner_applied(txid, app)?;
                Ok(pb::BeginResponse {
                    txid,
                    existing,
                    deadline_unix_ms: deadline_ms,
                    incarnation: self.ctx().incarnation_of(txid),
                })
            }
            other => Err(unexpected(other)),
        }
    }

    async fn begin_and_commit(
        &self,
        req: pb::BeginAndCommitRequest,
        app: Option<&str>,
    ) -> Result<pb::BeginAndCommitResponse, ApiError> {
        let timeout_ms = self.check_begin(&req.idempotency_key, req.timeout_ms, &req.description)?;
        if req.participants.is_empty() {
            return Err(ApiError::InvalidArgument(
                "participants must name at least one participant".into(),
            ));
        }
        for p in &req.participants {
            check_participant(&p.participant_id, &p.address, &p.payload, self.tls(), &self.policy)?;
        }
        let fingerprint = begin_and_commit_fingerprint(req.timeout_ms, &req.description, &req.participants);
        let participants = req
            .participants
            .into_iter()
            .map(|p| Enlistment {
                participant_id: p.participant_id,
                address: p.address,
                payload: p.payload,
            })
            .collect();
        let done = self
            .driver
            .begin_and_commit(req.idempotency_key, fingerprint, timeout_ms, participants, app)
            .await?;
        Ok(pb::BeginAndCommitResponse {
            txid: done.txid,
            outcome: outcome_pb(done.decision.outcome) as i32,
            existing: done.existing,
        })
    }

    async fn enlist(
        &self,
        req: pb::EnlistRequest,
        caller: Option<&dtx_tls::Identity>,
    ) -> Result<pb::EnlistResponse, ApiError> {
        check_participant(
            &req.participant_id,
            &req.address,
            &req.payload,
            self.tls(),
            &self.policy,
        )?;
        match caller {
            Some(id) if id.role == dtx_tls::Role::Participant => {
                self.check_self_enlist(req.txid, &id.name, &req.participant_id).await?
            }
            Some(id) if id.role == dtx_tls::Role::Application => {
                self.ctx().check_owner(req.txid, Some(&id.name)).await?
            }
            // A node acting for itself (a current member), or no
            // authentication.
            _ => {}
        }
        let cmd = Command::Enlist {
            txid: req.txid,
            participant_id: req.participant_id,
            address: req.address,
            payload: req.payload,
        };
        match self.ctx().propose(cmd).await? {
            CommandOk::Enlisted { participant_count } => Ok(pb::EnlistResponse { participant_count }),
            other => Err(unexpected(other)),
        }
    }

    /// A participant identity enlists only itself (its id is its name),
    /// and only in a transaction whose owner allowed it (ADR 0037): the
    /// owner's application is listed with it in `auth.self_enlist`, or the
    /// owner enlisted it already (then this Enlist repeats or conflicts
    /// with that one, as the state machine decides).
    async fn check_self_enlist(&self, txid: u64, name: &str, participant_id: &str) -> Result<(), ApiError> {
        if participant_id != name {
            return Err(ApiError::PermissionDenied(format!(
                "participant/{name} may enlist only itself (participant id {name:?}), not participant id {participant_id:?}"
            )));
        }
        let look = |st: &crate::store::sm_store::SmState| {
            st.with_txid(txid, |t| {
                t.get(txid).map(|r| {
                    (
                        t.owner(txid).map(str::to_string),
                        r.participants.iter().any(|p| p.id == name),
                    )
                })
            })
        };
        let local = look(&self.ctx().sm.state())?;
        let found = match local {
            Some(f) => Some(f),
            None => self.ctx().read_linearizable(look).await??,
        };
        // Not begun yet (or forgotten): refused here rather than left to
        // the state machine, so a Begin applied in between cannot give the
        // participant a transaction its owner did not allow.
        let Some((owner, enlisted)) = found else {
            return Err(ApiError::NotFound(format!(
                "transaction {txid} not found (never begun here, or forgotten)"
            )));
        };
        let allowed = |app: &str| {
            self.ctx()
                .config
                .auth
                .self_enlist
                .iter()
                .any(|e| e.participant == name && e.applications.iter().any(|a| a == app))
        };
        match owner {
            _ if enlisted => Ok(()),
            Some(app) if allowed(&app) => Ok(()),
            Some(app) => Err(ApiError::PermissionDenied(format!(
                "transaction {txid} belongs to application {app}, which has not allowed participant {name} to enlist itself \
                 (the nodes' auth.self_enlist lists the applications each participant may enlist with; or the application enlists it)"
            ))),
            None => Err(ApiError::PermissionDenied(format!(
                "transaction {txid} has no owning application (begun without authentication); participant {name} may not enlist itself in it"
            ))),
        }
    }

    async fn commit(&self, req: pb::CommitRequest, app: Option<&str>) -> Result<pb::CommitResponse, ApiError> {
        self.ctx().check_owner(req.txid, app).await?;
        let d = self.driver.drive_commit(req.txid).await?;
        Ok(pb::CommitResponse {
            outcome: outcome_pb(d.outcome) as i32,
        })
    }

    async fn abort(&self, req: pb::AbortRequest, app: Option<&str>) -> Result<pb::AbortResponse, ApiError> {
        check_len("reason", req.reason.len(), limits::REASON_BYTES_MAX)?;
        self.ctx().check_owner(req.txid, app).await?;
        // The decision records who aborted, when authentication says so.
        let note = match app {
            Some(name) => format!("application {name}: {}", req.reason),
            None => req.reason,
        };
        let d = self.driver.abort(req.txid, note).await?;
        Ok(pb::AbortResponse {
            outcome: outcome_pb(d.outcome) as i32,
        })
    }

    async fn status(&self, req: pb::StatusRequest) -> Result<pb::StatusResponse, ApiError> {
        let txid = req.txid;
        // A txid on the one-write path before its write has no record yet,
        // but is not "not found": its Prepares are out (PREPARING). Asked
        // before the read, as for GetDecisions (ADR 0012).
        let in_flight = self.driver.fast_in_flight_view(txid, self.ctx().current_term()).await?;
        let mut status = match self
            .ctx()
            .read_linearizable(|st| st.record(txid).map(|r| r.map(|r| status_pb_in(st, &r))))
            .await??
        {
            Some(s) => s,
            None => match in_flight {
                Some(v) => in_flight_status_pb(txid, &v),
                None => {
                    return Err(ApiError::NotFound(format!(
                        "transaction {txid} not found (never begun here, or forgotten after every participant acked)"
                    )))
                }
            },
        };
        add_delivery_attempts(&self.driver, std::slice::from_mut(&mut status), Audience::Application).await;
        Ok(status)
    }

    /// A branch that prepared where it ran joins the transaction with its
    /// vote (ADR 0046): one Raft write. Who may register is who may
    /// enlist: a participant identity only itself, in a transaction its
    /// owner allowed it to join; an application only in its own.
    async fn register_branch(
        &self,
        req: pb::RegisterBranchRequest,
        caller: Option<&dtx_tls::Identity>,
    ) -> Result<pb::RegisterBranchResponse, ApiError> {
        check_participant(&req.participant_id, &req.address, b"", self.tls(), &self.policy)?;
        check_len("reason", req.reason.len(), limits::REASON_BYTES_MAX)?;
        let vote = match pb::BranchVote::try_from(req.vote) {
            Ok(pb::BranchVote::Yes) => BranchVote::Yes,
            Ok(pb::BranchVote::No) => BranchVote::No,
            Ok(pb::BranchVote::ReadOnly) => BranchVote::ReadOnly,
            _ => {
                return Err(ApiError::InvalidArgument(format!(
                    "vote {} is not a branch vote: give BRANCH_VOTE_YES (1), BRANCH_VOTE_NO (2) or \
                     BRANCH_VOTE_READ_ONLY (3)",
                    req.vote
                )))
            }
        };
        match caller {
            Some(id) if id.role == dtx_tls::Role::Participant => {
                self.check_self_enlist(req.txid, &id.name, &req.participant_id).await?
            }
            Some(id) if id.role == dtx_tls::Role::Application => {
                self.ctx().check_owner(req.txid, Some(&id.name)).await?
            }
            _ => {}
        }
        let txid = req.txid;
        // Which incarnation handed out a txid never changes once it is
        // handed out; this node is the leader here, which applied the
        // Begin before anyone could learn the txid.
        if self.ctx().sm.state().incarnations.belonging(req.incarnation, txid) == Belonging::Other {
            metrics::counter!("dtx_branch_refusals_total", "kind" => "too-late").increment(1);
            return Err(ApiError::BranchRefused {
                kind: dtx_proto::metadata::BranchRefusalKind::TooLate,
                message: format!(
                    "txid {txid} was not handed out by incarnation {:016x} here: participant {:?} prepared work for \
                     another cluster's transaction and must roll it back",
                    req.incarnation, req.participant_id
                ),
            });
        }
        let cmd = Command::RegisterBranch {
            txid,
            participant_id: req.participant_id.clone(),
            address: req.address,
            vote,
            reason: req.reason,
            now_ms: now_ms(),
        };
        match self.ctx().propose(cmd).await? {
            CommandOk::BranchRegistered {
                term,
                existing,
                deadline_ms,
                participant_count,
                decision,
            } => {
                // Recorded, not answered: the branch's reply is lost.
                dtx_failpoint::failpoint!("coordinator_branch_registered_before_reply");
                if !existing {
                    metrics::counter!("dtx_branch_registrations_total", "vote" => vote.to_string()).increment(1);
                }
                if decision.is_some() {
                    // A NO decided ABORT: the other branches learn it now,
                    // not when the client gets round to it.
                    self.driver.spawn_delivery(txid);
                }
                Ok(pb::RegisterBranchResponse {
                    term,
                    incarnation: self.ctx().incarnation_of(txid),
                    existing,
                    deadline_unix_ms: deadline_ms,
                    participant_count,
                })
            }
            CommandOk::BranchRefused(r) => {
                use dtx_proto::metadata::BranchRefusalKind as Kind;
                let kind = match &r {
                    BranchRefusal::Fenced { .. } => Kind::Fenced,
                    BranchRefusal::VoteConflict { .. } | BranchRefusal::AddressConflict { .. } => Kind::Conflict,
                    BranchRefusal::TooLate { .. }
                    | BranchRefusal::PastDeadline { .. }
                    | BranchRefusal::Forgotten { .. } => Kind::TooLate,
                };
                metrics::counter!("dtx_branch_refusals_total", "kind" => kind.as_str()).increment(1);
                Err(ApiError::BranchRefused {
                    kind,
                    message: r.to_string(),
                })
            }
            other => Err(unexpected(other)),
        }
    }

    /// What the branch `participant_id` does with its work prepared for
    /// `txid` (ADR 0046): a member follows the transaction's decision; a
    /// branch that is not a member is fenced out of an ACTIVE transaction
    /// first (a replicated write), then told ABORT, also when the
    /// transaction committed without it. The read is linearizable; the
    /// fence is a Raft write, so a leader cut off from its quorum answers
    /// neither.
    async fn get_branch_decision(
        &self,
        req: pb::GetBranchDecisionRequest,
        caller: Option<&dtx_tls::Identity>,
    ) -> Result<pb::GetBranchDecisionResponse, ApiError> {
        check_id("participant_id", &req.participant_id)?;
        if let Some(id) = caller.filter(|id| id.role == dtx_tls::Role::Participant) {
            if id.name != req.participant_id {
                return Err(ApiError::PermissionDenied(format!(
                    "participant/{} may ask only about its own branches (participant id {:?}), not participant id {:?}",
                    id.name, id.name, req.participant_id
                )));
            }
        }
        let (txid, pid, incarnation) = (req.txid, req.participant_id, req.incarnation);
        let (other, view) = self
            .ctx()
            .read_linearizable(|st| {
                (
                    st.incarnations.belonging(incarnation, txid) == Belonging::Other,
                    st.with_txid(txid, |t| t.branch_view(txid, &pid)),
                )
            })
            .await?;
        let view = view?;
        let answer = |outcome: pb::Outcome, member: bool, fenced_now: bool| pb::GetBranchDecisionResponse {
            txid,
            outcome: outcome as i32,
            member,
            fenced_now,
        };
        if other {
            // Another incarnation's txid: nothing here says what it was.
            return Ok(answer(pb::Outcome::OtherIncarnation, false, false));
        }
        match view {
            BranchView::Member(v) => Ok(answer(view_pb(&v), true, false)),
            BranchView::Outside => Ok(answer(pb::Outcome::Abort, false, false)),
            BranchView::Unfenced => {
                let cmd = Command::ExcludeBranch {
                    txid,
                    participant_id: pid,
                };
                match self.ctx().propose(cmd).await? {
                    CommandOk::BranchExcluded {
                        member,
                        decided,
                        fenced_now,
                    } => {
                        if fenced_now {
                            metrics::counter!("dtx_branch_fences_total").increment(1);
                        }
                        let outcome = decided.map(outcome_pb).unwrap_or(pb::Outcome::Pending);
                        Ok(answer(outcome, member, fenced_now))
                    }
                    other => Err(unexpected(other)),
                }
            }
        }
    }

    /// The decisions of `txids`; with a `participant_id` (not empty), also
    /// whether the cluster still awaits that participant's ack of each, so
    /// the participant keeps its log record until then (invariant 10).
    ///
    /// `incarnation` is the one the asker received with every txid (0:
    /// asked without one, by an SDK from before incarnations): a txid that
    /// incarnation did not hand out here is OTHER_INCARNATION, never
    /// presumed aborted (invariant 10, ADR 0033).
    async fn get_decisions(
        &self,
        incarnation: u64,
        txids: Vec<u64>,
        participant_id: &str,
    ) -> Result<Vec<pb::GetDecisionResponse>, ApiError> {
        if txids.len() > limits::DECISION_BATCH_TXIDS_MAX {
            return Err(ApiError::InvalidArgument(format!(
                "txids has {} ids; the limit is {} per call",
                txids.len(),
                limits::DECISION_BATCH_TXIDS_MAX
            )));
        }
        if !participant_id.is_empty() {
            check_id("participant_id", participant_id)?;
        }
        // A txid this leader handed out on the one-write path whose write
        // has no known result yet is PENDING, not unknown: the write may
        // still be applied. Asked BEFORE the read, whose table then holds
        // every write whose result became known (ADR 0012).
        let term = self.ctx().current_term();
        let in_flight = self.driver.fast_in_flight(&txids, term).await?;
        Ok(self
            .ctx()
            .read_linearizable(|st| {
                txids
                    .iter()
                    .zip(in_flight)
                    .map(|(&txid, in_flight)| {
                        if st.incarnations.belonging(incarnation, txid) == Belonging::Other {
                            // Another incarnation's: only an operator's
                            // settlement is known of it (ADR 0040); it
                            // is never acked or delivered.
                            return Ok(match st.settlements.get(incarnation, txid) {
                                Some(s) => pb::GetDecisionResponse {
                                    txid,
                                    outcome: outcome_pb(s.outcome) as i32,
                                    awaiting_ack: false,
                                    settled_by: s.describe(),
                                },
                                None => pb::GetDecisionResponse {
                                    txid,
                                    outcome: pb::Outcome::OtherIncarnation as i32,
                                    awaiting_ack: false,
                                    settled_by: String::new(),
                                },
                            });
                        }
                        // A retained record is read from disk (ADR 0050).
                        st.with_txid(txid, |t| pb::GetDecisionResponse {
                            txid,
                            outcome: if in_flight {
                                pb::Outcome::Pending as i32
                            } else {
                                view_pb(&t.decision_view(txid)) as i32
                            },
                            awaiting_ack: !participant_id.is_empty() && t.awaiting_ack(txid, participant_id),
                            settled_by: String::new(),
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .await??)
    }
}

#[tonic::async_trait]
impl Coordinator for CoordinatorService {
    async fn begin(&self, req: Request<pb::BeginRequest>) -> Result<Response<pb::BeginResponse>, Status> {
        let app = app_caller(&req);
        serve_or_forward(
            self.ctx(),
            req,
            |r| async move { self.begin(r, app.as_deref()).await },
            |ch, r| async move { CoordinatorClient::new(ch).begin(r).await },
        )
        .await
    }

    async fn begin_and_commit(
        &self,
        req: Request<pb::BeginAndCommitRequest>,
    ) -> Result<Response<pb::BeginAndCommitResponse>, Status> {
        let app = app_caller(&req);
        serve_or_forward(
            self.ctx(),
            req,
            |r| async move { self.begin_and_commit(r, app.as_deref()).await },
            |ch, r| async move { CoordinatorClient::new(ch).begin_and_commit(r).await },
        )
        .await
    }

    async fn enlist(&self, req: Request<pb::EnlistRequest>) -> Result<Response<pb::EnlistResponse>, Status> {
        let caller = crate::security::caller(&req);
        serve_or_forward(
            self.ctx(),
            req,
            |r| async move { self.enlist(r, caller.as_ref()).await },
            |ch, r| async move { CoordinatorClient::new(ch).enlist(r).await },
        )
        .await
    }

    async fn commit(&self, req: Request<pb::CommitRequest>) -> Result<Response<pb::CommitResponse>, Status> {
        let app = app_caller(&req);
        serve_or_forward(
            self.ctx(),
            req,
            |r| async move { self.commit(r, app.as_deref()).await },
            |ch, r| async move { CoordinatorClient::new(ch).commit(r).await },
        )
        .await
    }

    async fn abort(&self, req: Request<pb::AbortRequest>) -> Result<Response<pb::AbortResponse>, Status> {
        let app = app_caller(&req);
        serve_or_forward(
            self.ctx(),
            req,
            |r| async move { self.abort(r, app.as_deref()).await },
            |ch, r| async move { CoordinatorClient::new(ch).abort(r).await },
        )
        .await
    }

    async fn status(&self, req: Request<pb::StatusRequest>) -> Result<Response<pb::StatusResponse>, Status> {
        serve_or_forward(
            self.ctx(),
            req,
            |r| async move { self.status(r).await },
            |ch, r| async move { CoordinatorClient::new(ch).status(r).await },
        )
        .await
    }

    async fn get_decision(
        &self,
        req: Request<pb::GetDecisionRequest>,
    ) -> Result<Response<pb::GetDecisionResponse>, Status> {
        serve_or_forward(
            self.ctx(),
            req,
            |r| async move {
                let mut v = self.get_decisions(r.incarnation, vec![r.txid], "").await?;
                v.pop().ok_or_else(|| ApiError::Internal("empty decision read".into()))
            },
            |ch, r| async move { CoordinatorClient::new(ch).get_decision(r).await },
        )
        .await
    }

    async fn register_branch(
        &self,
        req: Request<pb::RegisterBranchRequest>,
    ) -> Result<Response<pb::RegisterBranchResponse>, Status> {
        let caller = crate::security::caller(&req);
        serve_or_forward(
            self.ctx(),
            req,
            |r| async move { self.register_branch(r, caller.as_ref()).await },
            |ch, r| async move { CoordinatorClient::new(ch).register_branch(r).await },
        )
        .await
    }

    async fn get_branch_decision(
        &self,
        req: Request<pb::GetBranchDecisionRequest>,
    ) -> Result<Response<pb::GetBranchDecisionResponse>, Status> {
        let caller = crate::security::caller(&req);
        serve_or_forward(
            self.ctx(),
            req,
            |r| async move { self.get_branch_decision(r, caller.as_ref()).await },
            |ch, r| async move { CoordinatorClient::new(ch).get_branch_decision(r).await },
        )
        .await
    }

    async fn get_decisions(
        &self,
        req: Request<pb::GetDecisionsRequest>,
    ) -> Result<Response<pb::GetDecisionsResponse>, Status> {
        serve_or_forward(
            self.ctx(),
            req,
            |r| async move {
                Ok(pb::GetDecisionsResponse {
                    decisions: self.get_decisions(r.incarnation, r.txids, &r.participant_id).await?,
                })
            },
            |ch, r| async move { CoordinatorClient::new(ch).get_decisions(r).await },
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::check_participant;
    use crate::api::error::ApiError;
    use crate::participant_policy::AddressPolicy;

    fn any() -> Result<AddressPolicy, String> {
        Ok(AddressPolicy::default())
    }

    /// An address outside `participants.allowed_addresses` is
    /// PERMISSION_DENIED, naming the key, with the address escaped and cut;
    /// the form is checked first (INVALID_ARGUMENT); a policy that did not
    /// parse refuses everything.
    #[test]
    fn enlist_refuses_an_address_outside_the_policy() {
        let policy = AddressPolicy::parse(&["10.0.0.0/8".to_string(), "bank-*.internal".to_string()]);
        for ok in ["10.0.0.7:7000", "bank-a.internal:7000"] {
            check_participant("bank-a", ok, b"", false, &policy).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for no in ["127.0.0.1:7000", "db.internal:5432", "[::1]:7000"] {
            match check_participant("bank-a", no, b"", false, &policy) {
                Err(ApiError::PermissionDenied(m)) => assert!(
                    m.contains("participants.allowed_addresses") && m.contains(no) && !m.contains("10.0.0.0/8"),
                    "{no}: {m}"
                ),
                other => panic!("{no}: expected PERMISSION_DENIED, got {other:?}"),
            }
        }
        assert!(matches!(
            check_participant("bank-a", "10.0.0.7", b"", false, &policy),
            Err(ApiError::InvalidArgument(_))
        ));
        let long = format!("h{}.example:7000", "a".repeat(200));
        match check_participant("bank-a", &long, b"", false, &policy) {
            Err(ApiError::PermissionDenied(m)) => assert!(m.len() < 600, "{m}"),
            other => panic!("expected PERMISSION_DENIED, got {other:?}"),
        }
        assert!(matches!(
            check_participant("bank-a", "10.0.0.7:7000", b"", false, &Err("bad".into())),
            Err(ApiError::PermissionDenied(_))
        ));
    }

    #[test]
    fn enlist_refuses_an_address_the_driver_could_not_use() {
        for (addr, why) in [
            ("https://10.0.0.7:7000", "TLS"),
            ("10.0.0.7", "no port"),
            ("bank a:7000", "whitespace"),
            ("grpc://10.0.0.7:7000", "unsupported scheme"),
            ("10.0.0.7:70000", "not a number"),
        ] {
            match check_participant("bank-a", addr, b"", false, &any()) {
                Err(ApiError::InvalidArgument(m)) => {
                    assert!(
                        m.contains("\"bank-a\"") && m.contains("address") && m.contains(why),
                        "{addr}: {m}"
                    )
                }
                other => panic!("{addr}: expected INVALID_ARGUMENT, got {other:?}"),
            }
        }
        for addr in ["10.0.0.7:7000", "http://10.0.0.7:7000", "bank-a.internal:7000"] {
            check_participant("bank-a", addr, b"", false, &any()).unwrap_or_else(|e| panic!("{addr}: {e}"));
        }
        // With TLS the driver speaks TLS: https:// and host:port are
        // reachable, http:// (plain text) is refused.
        for addr in ["https://10.0.0.7:7000", "10.0.0.7:7000"] {
            check_participant("bank-a", addr, b"", true, &any()).unwrap_or_else(|e| panic!("{addr}: {e}"));
        }
        match check_participant("bank-a", "http://10.0.0.7:7000", b"", true, &any()) {
            Err(ApiError::InvalidArgument(m)) => assert!(m.contains("plain text"), "{m}"),
            other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
        }
    }
}
