//! The `SagaService` (ADR 0019): register definitions, start sagas, read
//! their journals, and the operator's manual path for a parked saga. Every
//! call is served by the leader (a follower forwards it once); reads are
//! linearizable. The journal's rules are the state machine's
//! (`sm::saga`); the leader's orchestrator drives the sagas.

use std::sync::Arc;

use dtx_proto::v1 as pb;
use dtx_proto::v1::saga_service_client::SagaServiceClient;
use dtx_proto::v1::saga_service_server::SagaService;
use dtx_tls::Role;
use sha2::Digest;
use tonic::Request;
use tonic::Response;
use tonic::Status;

use super::check_id;
use super::check_len;
use super::error::ApiError;
use super::serve_or_forward;
use crate::ctx::now_ms;
use crate::ctx::NodeCtx;
use crate::limits;
use crate::orchestrator::Orchestrator;
use crate::sm::saga;
use crate::sm::saga::CallOutcome;
use crate::sm::saga::SagaCommand;
use crate::sm::saga::SagaId;
use crate::sm::saga::SagaOk;
use crate::sm::saga::SagaRecord;
use crate::sm::saga::SagaState;
use crate::sm::Command;
use crate::sm::CommandOk;

pub struct SagaApi {
    ctx: Arc<NodeCtx>,
    /// Woken when a saga starts or an operator resumes one, so it need not
    /// wait for its next scan.
    orchestrator: Arc<Orchestrator>,
}

impl SagaApi {
    pub fn new(ctx: Arc<NodeCtx>, orchestrator: Arc<Orchestrator>) -> Self {
        SagaApi { ctx, orchestrator }
    }

    /// `out`, after waking the orchestrator when it is a success (a saga
    /// started, resumed or completed a step: no need to wait for a scan).
    fn kicked<T>(&self, out: Result<T, Status>) -> Result<T, Status> {
        if out.is_ok() {
            self.orchestrator.kick();
        }
        out
    }
}

fn unexpected(ok: CommandOk) -> ApiError {
    ApiError::Internal(format!("unexpected state-machine result {ok:?}"))
}

async fn propose(ctx: &NodeCtx, c: SagaCommand) -> Result<SagaOk, ApiError> {
    match ctx.propose(Command::Saga(c)).await? {
        CommandOk::Saga(ok) => Ok(ok),
        other => Err(unexpected(other)),
    }
}

// ----- proto <-> state machine ---------------------------------------

fn kind_of(k: i32) -> Result<saga::StepKind, String> {
    match pb::StepKind::try_from(k) {
        Ok(pb::StepKind::Compensable) => Ok(saga::StepKind::Compensable),
        Ok(pb::StepKind::Pivot) => Ok(saga::StepKind::Pivot),
        Ok(pb::StepKind::Retriable) => Ok(saga::StepKind::Retriable),
        Ok(pb::StepKind::ReadOnly) => Ok(saga::StepKind::ReadOnly),
        _ => Err(format!("kind {k} is not COMPENSABLE, PIVOT, RETRIABLE or READ_ONLY")),
    }
}

fn kind_pb(k: saga::StepKind) -> pb::StepKind {
    match k {
        saga::StepKind::Compensable => pb::StepKind::Compensable,
        saga::StepKind::Pivot => pb::StepKind::Pivot,
        saga::StepKind::Retriable => pb::StepKind::Retriable,
        saga::StepKind::ReadOnly => pb::StepKind::ReadOnly,
    }
}

fn recovery_of(o: i32) -> Result<saga::Recovery, String> {
    match pb::RecoveryOption::try_from(o) {
        Ok(pb::RecoveryOption::Retry) => Ok(saga::Recovery::Retry),
        Ok(pb::RecoveryOption::Compensate) => Ok(saga::Recovery::Compensate),
        Ok(pb::RecoveryOption::Park) => Ok(saga::Recovery::Park),
        _ => Err(format!("recovery option {o} is not RETRY, COMPENSATE or PARK")),
    }
}

fn recovery_pb(o: saga::Recovery) -> pb::RecoveryOption {
    match o {
        saga::Recovery::Retry => pb::RecoveryOption::Retry,
        saga::Recovery::Compensate => pb::RecoveryOption::Compensate,
        saga::Recovery::Park => pb::RecoveryOption::Park,
    }
}

/// The state machine's definition from the request's; the rules are
/// checked when it is applied (`Definition::validate`), and before
/// proposing, so a refused one writes nothing.
pub fn definition_of(d: &pb::SagaDefinition) -> Result<saga::Definition, ApiError> {
    let mut steps = Vec::with_capacity(d.steps.len());
    for (i, s) in d.steps.iter().enumerate() {
        let at =
            |e: String| ApiError::InvalidArgument(format!("saga definition refused: step {i} ({:?}): {e}", s.name));
        let retry = match &s.retry {
            Some(r) => saga::RetryPolicy {
                max_attempts: r.max_attempts,
                backoff_initial_ms: r.backoff_initial_ms,
                backoff_max_ms: r.backoff_max_ms,
            },
            None => saga::RetryPolicy::default(),
        };
        let mut on_failure = Vec::new();
        for o in &s.on_failure {
            on_failure.push(recovery_of(*o).map_err(at)?);
        }
        steps.push(saga::StepDef {
            name: s.name.clone(),
            kind: kind_of(s.kind).map_err(at)?,
            service: s.service.clone(),
            action: s.action.clone(),
            compensation: Some(s.compensation.clone()).filter(|c| !c.is_empty()),
            status_query: s.status_query.clone(),
            versioned: s.versioned,
            retry,
            on_failure,
            high_impact: s.high_impact,
            completion_timeout_ms: s.completion_timeout_ms,
        });
    }
    let def = saga::Definition {
        name: d.name.clone(),
        version: d.version,
        steps,
    };
    def.validate()
        .map_err(|e| ApiError::InvalidArgument(format!("saga definition refused: {e}")))?;
    Ok(def)
}

pub fn definition_pb(d: &saga::Definition) -> pb::SagaDefinition {
    pb::SagaDefinition {
        name: d.name.clone(),
        version: d.version,
        steps: d
            .steps
            .iter()
            .map(|s| pb::SagaStepDefinition {
                name: s.name.clone(),
                kind: kind_pb(s.kind) as i32,
                service: s.service.clone(),
                action: s.action.clone(),
                compensation: s.compensation.clone().unwrap_or_default(),
                status_query: s.status_query.clone(),
                versioned: s.versioned,
                retry: Some(pb::RetryPolicy {
                    max_attempts: s.retry.max_attempts,
                    backoff_initial_ms: s.retry.backoff_initial_ms,
                    backoff_max_ms: s.retry.backoff_max_ms,
                }),
                on_failure: s.on_failure.iter().map(|o| recovery_pb(*o) as i32).collect(),
                high_impact: s.high_impact,
                completion_timeout_ms: s.completion_timeout_ms,
            })
            .collect(),
    }
}

pub fn state_pb(s: SagaState) -> pb::SagaState {
    match s {
        SagaState::Running => pb::SagaState::Running,
        SagaState::Compensating => pb::SagaState::Compensating,
        SagaState::Completed => pb::SagaState::Completed,
        SagaState::Compensated => pb::SagaState::Compensated,
        SagaState::Parked => pb::SagaState::Parked,
    }
}

fn state_of(s: i32) -> Result<SagaState, ApiError> {
    match pb::SagaState::try_from(s) {
        Ok(pb::SagaState::Running) => Ok(SagaState::Running),
        Ok(pb::SagaState::Compensating) => Ok(SagaState::Compensating),
        Ok(pb::SagaState::Completed) => Ok(SagaState::Completed),
        Ok(pb::SagaState::Compensated) => Ok(SagaState::Compensated),
        Ok(pb::SagaState::Parked) => Ok(SagaState::Parked),
        _ => Err(ApiError::InvalidArgument(format!(
            "state {s} is not RUNNING, COMPENSATING, COMPLETED, COMPENSATED or PARKED"
        ))),
    }
}

pub fn outcome_pb(o: CallOutcome) -> pb::StepOutcome {
    match o {
        // Journaled before the call, no answer seen: not known.
        CallOutcome::Intended | CallOutcome::Unknown => pb::StepOutcome::Unknown,
        CallOutcome::Ok => pb::StepOutcome::Ok,
        CallOutcome::Failed => pb::StepOutcome::Failed,
        CallOutcome::Noop => pb::StepOutcome::Noop,
        CallOutcome::Stale => pb::StepOutcome::Stale,
        CallOutcome::Skipped => pb::StepOutcome::Skipped,
        CallOutcome::Pending => pb::StepOutcome::Pending,
    }
}

fn call_pb(c: &saga::Call) -> pb::StepCallView {
    pb::StepCallView {
        operation_id: c.operation_id.clone(),
        intent_at_ms: c.intent_at_ms,
        attempts: c.attempts,
        outcome: outcome_pb(c.outcome()) as i32,
        reason: c.reason.clone(),
        downstream_operation_id: c.downstream_operation_id.clone(),
        resource_version: c.resource_version.clone(),
        outcome_at_ms: c.outcome_at_ms,
        unknown_ms: c.unknown_ms,
        reconciliations: c.reconciliations,
        unknown_since_ms: c.unknown_since_ms,
        output: c.output.clone(),
        completed_by: c.completed_by.clone(),
    }
}

fn auth_pb(a: &saga::Authorization) -> pb::SagaAuthorization {
    pb::SagaAuthorization {
        principal: a.principal.clone(),
        tenant: a.tenant.clone(),
        expires_at_ms: a.expires_at_ms,
        policy: a.policy.clone(),
    }
}

/// The view of saga `r` of `book` (its definition's step names and kinds,
/// its count of failed status queries).
pub fn view_pb(r: &SagaRecord, book: &saga::SagaBook) -> pb::SagaView {
    let def = book.definition(&r.definition, r.version);
    pb::SagaView {
        query_failures: book.query_failures(r.id),
        saga_id: r.id,
        definition: r.definition.clone(),
        version: r.version,
        state: state_pb(r.state) as i32,
        current_step: r.current,
        parked_reason: r.parked_reason.clone(),
        parked_from: r.parked_from.map(|s| state_pb(s) as i32).unwrap_or_default(),
        authorization: Some(auth_pb(&r.authorization)),
        owner: r.owner.clone().unwrap_or_default(),
        started_at_ms: r.started_at_ms,
        ended_at_ms: r.ended_at_ms,
        steps: r
            .steps
            .iter()
            .enumerate()
            .map(|(i, j)| {
                let sd = def.and_then(|d| d.steps.get(i));
                pb::StepJournalView {
                    step: i as u32,
                    name: sd.map(|s| s.name.clone()).unwrap_or_default(),
                    kind: sd.map(|s| kind_pb(s.kind) as i32).unwrap_or_default(),
                    fingerprint: j.fingerprint.clone(),
                    forward: j.forward.as_ref().map(call_pb),
                    compensation: j.compensation.as_ref().map(call_pb),
                    residual: j.residual.clone(),
                    compensation_ref: j.compensation_ref.clone(),
                    precondition: j.precondition.clone(),
                    approved_by: j.approved_by.clone(),
                }
            })
            .collect(),
        operator_actions: r
            .operator_actions
            .iter()
            .map(|o| pb::SagaOperatorActionView {
                action: o.action.name().to_string(),
                who: o.who.clone(),
                why: o.why.clone(),
                at_ms: o.at_ms,
                step: o.step,
            })
            .collect(),
        input: r.input.clone(),
        idempotency_key: r.idempotency_key.clone(),
        past_pivot: r.past_pivot,
        journal_seq: r.seq,
        deadline_at_ms: r.deadline_at_ms,
        cancel_reason: r.cancel_reason.clone(),
        awaiting_approval: r.awaiting_approval.is_some(),
    }
}

/// `v` without its steps' outputs: a page of sagas stays small (up to
/// `SAGA_STEPS_MAX` outputs of 16 KiB each per saga); GetSaga has them.
fn without_outputs(mut v: pb::SagaView) -> pb::SagaView {
    for s in &mut v.steps {
        for c in [s.forward.as_mut(), s.compensation.as_mut()].into_iter().flatten() {
            c.output.clear();
        }
    }
    v
}

/// The fingerprint of a StartSaga request: everything but the key.
fn start_fingerprint(r: &pb::StartSagaRequest) -> [u8; 32] {
    let mut h = sha2::Sha256::new();
    h.update(r.definition.as_bytes());
    h.update([0]);
    h.update(r.version.to_be_bytes());
    h.update((r.input.len() as u64).to_be_bytes());
    h.update(&r.input);
    if let Some(a) = &r.authorization {
        for f in [&a.principal, &a.tenant, &a.policy] {
            h.update((f.len() as u64).to_be_bytes());
            h.update(f.as_bytes());
        }
        h.update(a.expires_at_ms.to_be_bytes());
    }
    // Only when set, so a request without one keeps the fingerprint it had
    // before deadlines existed.
    if r.deadline_ms != 0 {
        h.update(b"deadline");
        h.update(r.deadline_ms.to_be_bytes());
    }
    h.finalize().into()
}

// ----- the handlers (leader side) -----------------------------------

async fn register(
    ctx: &NodeCtx,
    r: pb::RegisterSagaDefinitionRequest,
) -> Result<pb::RegisterSagaDefinitionResponse, ApiError> {
    let Some(d) = r.definition.as_ref() else {
        return Err(ApiError::InvalidArgument("definition is missing".into()));
    };
    let definition = definition_of(d)?;
    match propose(ctx, SagaCommand::Register { definition }).await? {
        SagaOk::Registered { created } => Ok(pb::RegisterSagaDefinitionResponse { created }),
        other => Err(ApiError::Internal(format!("unexpected saga result {other:?}"))),
    }
}

/// The view of saga `id` as applied here, after `what` (a write this
/// leader proposed, so its record is applied here).
fn view_after(ctx: &NodeCtx, id: SagaId, what: &str) -> Result<pb::SagaView, ApiError> {
    let st = ctx.sm.state();
    let s = st
        .sagas
        .get(id)
        .ok_or_else(|| ApiError::Internal(format!("saga {id} vanished after {what}")))?;
    Ok(view_pb(s, &st.sagas))
}

/// The caller's name when it is an authenticated application: it may see
/// and start only its own sagas (their input and rights are its own).
/// Operators and nodes see every saga; without authentication, everyone
/// does.
fn application<T>(req: &Request<T>) -> Option<String> {
    crate::security::caller(req)
        .filter(|id| id.role == Role::Application)
        .map(|id| id.name)
}

/// Who an action is recorded with: with authentication on, the
/// authenticated caller; without it, the name the request gives
/// (`given`), or `default` when it gives none.
fn recorded_who<T>(req: &Request<T>, given: &str, default: &str) -> String {
    match crate::security::caller(req) {
        Some(id) => id.name,
        None if given.is_empty() => default.to_string(),
        None => given.to_string(),
    }
}

/// Refuses application `app` a saga another application started.
fn check_saga_owner(id: SagaId, owner: Option<&str>, app: Option<&str>) -> Result<(), ApiError> {
    match (owner, app) {
        (Some(o), Some(me)) if o != me => Err(ApiError::PermissionDenied(format!(
            "saga {id} belongs to application {o}; application {me} may not see, start or cancel it"
        ))),
        _ => Ok(()),
    }
}

async fn start(
    ctx: &NodeCtx,
    r: pb::StartSagaRequest,
    owner: Option<String>,
    app: Option<String>,
) -> Result<pb::StartSagaResponse, ApiError> {
    check_id("definition", &r.definition)?;
    check_id("idempotency_key", &r.idempotency_key)?;
    check_len("input", r.input.len(), limits::PAYLOAD_BYTES_MAX)?;
    let a = r.authorization.clone().unwrap_or_default();
    for (f, v) in [
        ("principal", &a.principal),
        ("tenant", &a.tenant),
        ("policy", &a.policy),
    ] {
        check_len(f, v.len(), limits::ID_BYTES_MAX)?;
    }
    let cmd = SagaCommand::Start {
        idempotency_key: r.idempotency_key.clone(),
        fingerprint: start_fingerprint(&r),
        definition: r.definition.clone(),
        version: r.version,
        input: r.input.clone(),
        authorization: saga::Authorization {
            principal: a.principal,
            tenant: a.tenant,
            expires_at_ms: a.expires_at_ms,
            policy: a.policy,
        },
        owner,
        now_ms: now_ms(),
        deadline_ms: r.deadline_ms,
    };
    match propose(ctx, cmd).await? {
        SagaOk::Started { saga_id, created } => {
            // The key may be another application's saga's. Its record is
            // applied here, so the local state answers.
            let st = ctx.sm.state();
            check_saga_owner(
                saga_id,
                st.sagas.get(saga_id).and_then(|s| s.owner.as_deref()),
                app.as_deref(),
            )?;
            Ok(pb::StartSagaResponse { saga_id, created })
        }
        other => Err(ApiError::Internal(format!("unexpected saga result {other:?}"))),
    }
}

async fn get(ctx: &NodeCtx, r: pb::GetSagaRequest, app: Option<String>) -> Result<pb::SagaView, ApiError> {
    let id = r.saga_id;
    ctx.read_linearizable(move |st| {
        st.sagas
            .get(id)
            .map(|s| check_saga_owner(id, s.owner.as_deref(), app.as_deref()).map(|()| view_pb(s, &st.sagas)))
    })
    .await?
    .ok_or_else(|| ApiError::NotFound(format!("saga {id} does not exist")))?
}

/// A page of sagas; an application's pages hold only its own.
async fn list(ctx: &NodeCtx, r: pb::ListSagasRequest, app: Option<String>) -> Result<pb::ListSagasResponse, ApiError> {
    let limit = match r.limit as usize {
        0 => limits::LIST_SAGAS_PAGE_DEFAULT,
        n if n > limits::LIST_SAGAS_PAGE_MAX => {
            return Err(ApiError::InvalidArgument(format!(
                "limit is {n}; the limit is {} sagas per page",
                limits::LIST_SAGAS_PAGE_MAX
            )))
        }
        n => n,
    };
    let mut states = Vec::new();
    for s in &r.states {
        states.push(state_of(*s)?);
    }
    ctx.read_linearizable(move |st| {
        let (page, next) = st.sagas.list(r.after_saga_id, limit, |s| {
            (states.is_empty() || states.contains(&s.state))
                && (r.definition.is_empty() || s.definition == r.definition)
                && (app.is_none() || s.owner.as_deref() == app.as_deref())
        });
        pb::ListSagasResponse {
            sagas: page
                .into_iter()
                .map(|s| without_outputs(view_pb(s, &st.sagas)))
                .collect(),
            next_after_saga_id: next,
        }
    })
    .await
}

/// `app`: the caller is this authenticated application (not an
/// operator): it may only cancel, and only its own sagas.
async fn operate(
    ctx: &NodeCtx,
    r: pb::OperateSagaRequest,
    who: String,
    app: Option<String>,
) -> Result<pb::SagaView, ApiError> {
    let action = match pb::SagaOperatorAction::try_from(r.action) {
        Ok(pb::SagaOperatorAction::Retry) => saga::OperatorAction::Retry,
        Ok(pb::SagaOperatorAction::Skip) => saga::OperatorAction::Skip,
        Ok(pb::SagaOperatorAction::Compensate) => saga::OperatorAction::Compensate,
        Ok(pb::SagaOperatorAction::MarkComplete) => saga::OperatorAction::MarkComplete,
        Ok(pb::SagaOperatorAction::Cancel) => saga::OperatorAction::Cancel,
        Ok(pb::SagaOperatorAction::Approve) => saga::OperatorAction::Approve,
        _ => {
            return Err(ApiError::InvalidArgument(format!(
                "action {} is not RETRY, SKIP, COMPENSATE, MARK_COMPLETE, CANCEL or APPROVE",
                r.action
            )))
        }
    };
    if let Some(me) = app.as_deref() {
        if action != saga::OperatorAction::Cancel {
            return Err(ApiError::PermissionDenied(format!(
                "application {me} may cancel its own sagas; {} is an operator's action",
                action.name()
            )));
        }
        // The owner is applied here (the leader serves this), so the local
        // state answers; a saga that does not exist is refused below.
        let owner = ctx.sm.state().sagas.get(r.saga_id).and_then(|s| s.owner.clone());
        check_saga_owner(r.saga_id, owner.as_deref(), Some(me))?;
    }
    if r.why.is_empty() {
        return Err(ApiError::InvalidArgument(
            "why must not be empty: say why (it is recorded)".into(),
        ));
    }
    check_len("why", r.why.len(), limits::REASON_BYTES_MAX)?;
    check_id("operator", &who)?;
    let cmd = SagaCommand::Operate {
        saga_id: r.saga_id,
        action,
        who,
        why: r.why.clone(),
        now_ms: now_ms(),
    };
    propose(ctx, cmd).await?;
    view_after(ctx, r.saga_id, "an operator's action")
}

/// `CompleteStep`: the end of a PENDING forward call. `app`: the caller
/// is this authenticated application (it may complete only its own
/// sagas' steps).
async fn complete(
    ctx: &NodeCtx,
    r: pb::CompleteStepRequest,
    who: String,
    app: Option<String>,
) -> Result<pb::SagaView, ApiError> {
    let outcome = match pb::StepOutcome::try_from(r.outcome) {
        Ok(pb::StepOutcome::Ok) => CallOutcome::Ok,
        Ok(pb::StepOutcome::Failed) => CallOutcome::Failed,
        _ => {
            return Err(ApiError::InvalidArgument(format!(
                "outcome {} is not STEP_OUTCOME_OK or STEP_OUTCOME_FAILED: a step completes with its end",
                r.outcome
            )))
        }
    };
    if outcome != CallOutcome::Ok && !r.output.is_empty() {
        return Err(ApiError::InvalidArgument(
            "only an OK completion carries an output".into(),
        ));
    }
    check_len("output", r.output.len(), limits::SAGA_STEP_OUTPUT_BYTES_MAX)?;
    for (f, v) in [
        ("reason", &r.reason),
        ("resource_version", &r.resource_version),
        ("downstream_operation_id", &r.downstream_operation_id),
    ] {
        check_len(f, v.len(), limits::REASON_BYTES_MAX)?;
    }
    check_id("who", &who)?;
    check_id("operation_id", &r.operation_id)?;
    // The step service got the operation id with this cluster's
    // incarnation appended (ADR 0033); the journal names it without.
    let (operation_id, incarnation) = {
        let st = ctx.sm.state();
        let s = st
            .sagas
            .get(r.saga_id)
            .ok_or_else(|| ApiError::NotFound(format!("saga {} does not exist", r.saga_id)))?;
        check_saga_owner(r.saga_id, s.owner.as_deref(), app.as_deref())?;
        let inc = st.incarnations.of_saga(r.saga_id).unwrap_or(0);
        match r.operation_id.rsplit_once('@') {
            Some((op, sfx)) => (op.to_string(), Some((sfx.to_string(), inc))),
            None => (r.operation_id.clone(), None),
        }
    };
    if let Some((sfx, inc)) = incarnation {
        if sfx != format!("{inc:016x}") {
            return Err(ApiError::FailedPrecondition(format!(
                "operation {:?} belongs to another incarnation of saga {} (this cluster's is {inc:016x}): it is not this saga's call",
                r.operation_id, r.saga_id
            )));
        }
    }
    let cmd = SagaCommand::Complete {
        saga_id: r.saga_id,
        step: r.step,
        operation_id,
        reply: saga::Reply {
            outcome,
            reason: r.reason.clone(),
            downstream_operation_id: r.downstream_operation_id.clone(),
            resource_version: r.resource_version.clone(),
            residual: String::new(),
            reconciled: false,
            output: r.output.clone(),
        },
        who,
        now_ms: now_ms(),
    };
    propose(ctx, cmd).await?;
    view_after(ctx, r.saga_id, "a completion")
}

#[tonic::async_trait]
impl SagaService for SagaApi {
    async fn complete_step(&self, req: Request<pb::CompleteStepRequest>) -> Result<Response<pb::SagaView>, Status> {
        let ctx = &self.ctx;
        let who = recorded_who(&req, &req.get_ref().who, "anonymous");
        let app = application(&req);
        let out = serve_or_forward(
            ctx,
            req,
            |r| async move { complete(ctx, r, who, app).await },
            |ch, r| async move { SagaServiceClient::new(ch).complete_step(r).await },
        )
        .await;
        self.kicked(out)
    }

    async fn register_definition(
        &self,
        req: Request<pb::RegisterSagaDefinitionRequest>,
    ) -> Result<Response<pb::RegisterSagaDefinitionResponse>, Status> {
        let ctx = &self.ctx;
        serve_or_forward(
            ctx,
            req,
            |r| async move { register(ctx, r).await },
            |ch, r| async move { SagaServiceClient::new(ch).register_definition(r).await },
        )
        .await
    }

    async fn start_saga(&self, req: Request<pb::StartSagaRequest>) -> Result<Response<pb::StartSagaResponse>, Status> {
        let ctx = &self.ctx;
        let owner = crate::security::caller(&req).map(|id| id.name);
        let app = application(&req);
        let out = serve_or_forward(
            ctx,
            req,
            |r| async move { start(ctx, r, owner, app).await },
            |ch, r| async move { SagaServiceClient::new(ch).start_saga(r).await },
        )
        .await;
        self.kicked(out)
    }

    async fn get_saga(&self, req: Request<pb::GetSagaRequest>) -> Result<Response<pb::SagaView>, Status> {
        let ctx = &self.ctx;
        let app = application(&req);
        serve_or_forward(
            ctx,
            req,
            |r| async move { get(ctx, r, app).await },
            |ch, r| async move { SagaServiceClient::new(ch).get_saga(r).await },
        )
        .await
    }

    async fn list_sagas(&self, req: Request<pb::ListSagasRequest>) -> Result<Response<pb::ListSagasResponse>, Status> {
        let ctx = &self.ctx;
        let app = application(&req);
        serve_or_forward(
            ctx,
            req,
            |r| async move { list(ctx, r, app).await },
            |ch, r| async move { SagaServiceClient::new(ch).list_sagas(r).await },
        )
        .await
    }

    async fn operate_saga(&self, req: Request<pb::OperateSagaRequest>) -> Result<Response<pb::SagaView>, Status> {
        let ctx = &self.ctx;
        let who = recorded_who(&req, &req.get_ref().operator, "operator");
        let app = application(&req);
        let out = serve_or_forward(
            ctx,
            req,
            |r| async move { operate(ctx, r, who, app).await },
            |ch, r| async move { SagaServiceClient::new(ch).operate_saga(r).await },
        )
        .await;
        self.kicked(out)
    }

    async fn list_definitions(
        &self,
        req: Request<pb::ListSagaDefinitionsRequest>,
    ) -> Result<Response<pb::ListSagaDefinitionsResponse>, Status> {
        let ctx = &self.ctx;
        serve_or_forward(
            ctx,
            req,
            |_| async move {
                ctx.read_linearizable(|st| {
                    let mut definitions: Vec<pb::SagaDefinition> = st.sagas.definitions().map(definition_pb).collect();
                    definitions.sort_by(|a, b| a.name.cmp(&b.name).then(b.version.cmp(&a.version)));
                    pb::ListSagaDefinitionsResponse { definitions }
                })
                .await
            },
            |ch, r| async move { SagaServiceClient::new(ch).list_definitions(r).await },
        )
        .await
    }
}
