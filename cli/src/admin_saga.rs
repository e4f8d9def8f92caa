//! `coordinator admin saga`: sagas (`dtx.v1.SagaService`) for operators:
//! list and show sagas, the manual path for a parked one (retry, skip,
//! compensate, complete), register and list definitions, and start a saga
//! (a drill, or a script's way in).
//!
//! Every node serves SagaService and forwards to the leader, so any
//! `--addr` will do: the next address is tried when one cannot be reached
//! or has no leader. Exit codes as the other admin commands
//! (cli/src/exit_codes.rs): 0 done, 1 another error (a definition file that
//! does not parse), 2 usage, 3 refused (INVALID_ARGUMENT, NOT_FOUND,
//! ALREADY_EXISTS, FAILED_PRECONDITION, PERMISSION_DENIED: nothing
//! changed), 4 outcome unknown (a write was sent and no definite answer
//! came back: UNAVAILABLE, DEADLINE_EXCEEDED or no reply in time), 5
//! unreachable (no node answered; for a write, nothing was sent or the
//! node said it certainly applied nothing).
//!
//! A definition file (`saga register FILE`) is TOML (`.toml`) or JSON
//! (`.json`), the shape of [`DefinitionFile`]; `saga definitions --json`
//! prints definitions in the same shape.

use std::future::Future;
use std::path::Path;
use std::path::PathBuf;
use std::time::Duration;
use std::time::Instant;

use clap::Subcommand;
use dtx_proto::v1 as pb;
use dtx_proto::v1::saga_service_client::SagaServiceClient;
use dtx_transport::channel::Channel;
use serde::Deserialize;
use serde_json::json;
use tonic::Code;
use tonic::Status;

#[path = "admin_saga_view.rs"]
mod view;

use crate::admin_ctx::emit;
use crate::admin_ctx::failure;
use crate::admin_ctx::Ctx;
use crate::admin_ctx::Failure;
use crate::admin_ctx::Outcome;
use crate::exit_codes::EXIT_ERROR;
use crate::exit_codes::EXIT_REFUSED;
use crate::exit_codes::EXIT_UNKNOWN;
use crate::exit_codes::EXIT_UNREACHABLE;
use crate::exit_codes::EXIT_USAGE;

/// A list reads at most this many pages with --all.
const LIST_PAGES_MAX: usize = 1000;
/// One attempt at one node waits at most this long (within --timeout-s).
const ATTEMPT_MAX: Duration = Duration::from_secs(5);

#[derive(Subcommand)]
pub(crate) enum SagaCmd {
    /// Sagas by ascending id, filtered; one page unless --all.
    List {
        /// Only sagas in this state (repeat, or comma-separated).
        #[arg(long = "state", value_delimiter = ',',
              value_parser = ["running", "compensating", "completed", "compensated", "parked"])]
        states: Vec<String>,
        /// Only sagas of this definition (its name).
        #[arg(long)]
        definition: Option<String>,
        /// Start after this saga id (the `next` printed by the previous page).
        #[arg(long, default_value_t = 0)]
        after: u64,
        /// Page size (at most 1000).
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// Every page, not just the first.
        #[arg(long)]
        all: bool,
    },
    /// One saga: state, authorization, every step's forward and
    /// compensation calls, and the operator actions taken on it.
    Show { id: u64 },
    /// A parked saga: resume from where it parked, with a fresh attempt
    /// budget.
    Retry(OperateArgs),
    /// A parked saga: mark the parked step SKIPPED and go on (forward, or
    /// backward while compensating).
    Skip(OperateArgs),
    /// A parked saga: compensate from the parked step (refused past the
    /// pivot).
    Compensate(OperateArgs),
    /// A parked saga: end it as COMPLETED (you finished it by hand).
    Complete(OperateArgs),
    /// A RUNNING saga (or one parked while running): stop going forward
    /// and compensate its done steps, newest first (refused past the
    /// pivot).
    Cancel(OperateArgs),
    /// A saga parked for an approval (its next compensation is
    /// high-impact): approve that compensation; it goes on compensating.
    Approve(OperateArgs),
    /// A step whose forward call answered PENDING (accepted, finished
    /// later): complete it, OK with its output or FAILED, by its operation
    /// id. The same completion again changes nothing.
    CompleteStep {
        /// The saga id.
        id: u64,
        /// The step's index.
        #[arg(long)]
        step: u32,
        /// The forward call's operation id, as the step service received
        /// it (`saga show` lists it).
        #[arg(long)]
        operation: String,
        /// How it ended.
        #[arg(long, value_parser = ["ok", "failed"])]
        outcome: String,
        /// OK: the step's output, JSON text or @FILE for a file's bytes.
        #[arg(long)]
        output: Option<String>,
        /// Why (a FAILED's reason; recorded).
        #[arg(long, default_value = "")]
        reason: String,
        /// Your name, recorded (default: $USER). With authentication on,
        /// the cluster records the authenticated identity instead.
        #[arg(long, env = "USER", default_value = "")]
        who: String,
    },
    /// Register a saga definition from a file: TOML (.toml) or JSON (.json).
    /// Registering the identical definition again changes nothing.
    Register { file: PathBuf },
    /// The registered definitions, newest version of each name first.
    Definitions,
    /// Start a saga of a registered definition; prints its id. The same
    /// --key with the same request answers the same saga.
    Start {
        /// The definition's name.
        #[arg(long)]
        definition: String,
        /// The definition's version.
        #[arg(long)]
        version: u32,
        /// Idempotency key.
        #[arg(long)]
        key: String,
        /// The saga's input, handed to every step: JSON text, or @FILE for
        /// a file's bytes as they are.
        #[arg(long)]
        input: String,
        /// Who asks (the authorization checked before every compensation).
        #[arg(long)]
        principal: Option<String>,
        /// The tenant the saga acts for.
        #[arg(long)]
        tenant: Option<String>,
        /// Unix ms after which the rights may not be used (0: never).
        #[arg(long)]
        expires_at_ms: Option<u64>,
        /// The policy the step services check calls against.
        #[arg(long)]
        policy: Option<String>,
        /// The saga's deadline, in ms after its start: past it, a saga
        /// before its pivot is compensated as if cancelled.
        #[arg(long)]
        deadline_ms: Option<u64>,
    },
}

/// The saga, and who and why (both recorded with the action).
#[derive(clap::Args)]
pub(crate) struct OperateArgs {
    /// The saga id.
    id: u64,
    /// Why, recorded with the action.
    #[arg(long)]
    why: String,
    /// Your name, recorded with the action (default: $USER). With
    /// authentication on, the cluster records the authenticated identity
    /// instead.
    #[arg(long, env = "USER", default_value = "")]
    operator: String,
}

/// A saga definition file, TOML or JSON, for `saga register`:
///
/// ```toml
/// name = "order"
/// version = 1
///
/// [[steps]]
/// name = "reserve"
/// kind = "compensable"            # compensable | pivot | retriable
/// service = "127.0.0.1:7301"      # the step service (host:port)
/// action = "reserve"              # the forward action's name
/// compensation = "release"        # required for compensable, else absent
/// status_query = "reservation"    # required
/// versioned = false               # optional (default false)
/// on_failure = ["retry", "compensate"]  # optional: retry | compensate | park
/// retry = { max_attempts = 5, backoff_initial_ms = 100, backoff_max_ms = 5000 }  # optional
/// high_impact = false             # optional: its compensation waits for an approval
/// completion_timeout_ms = 0       # optional: a PENDING forward call parks the saga after this long
/// ```
///
/// Unknown keys are refused (a misspelt key is an error, not a default).
/// The cluster checks the rules (one pivot at most, retriable steps after
/// it, ...) and refuses a definition that breaks them, with the reason.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct DefinitionFile {
    pub name: String,
    pub version: u32,
    pub steps: Vec<StepFile>,
}

/// One step of a [`DefinitionFile`] (fields as `SagaStepDefinition`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct StepFile {
    pub name: String,
    pub kind: KindFile,
    pub service: String,
    pub action: String,
    #[serde(default)]
    pub compensation: String,
    pub status_query: String,
    #[serde(default)]
    pub versioned: bool,
    #[serde(default)]
    pub retry: Option<RetryFile>,
    #[serde(default)]
    pub on_failure: Vec<RecoveryFile>,
    #[serde(default)]
    pub high_impact: bool,
    #[serde(default)]
    pub completion_timeout_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum KindFile {
    Compensable,
    Pivot,
    Retriable,
    #[serde(rename = "read_only")]
    ReadOnly,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum RecoveryFile {
    Retry,
    Compensate,
    Park,
}

/// `retry = {...}`: `RetryPolicy`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RetryFile {
    pub max_attempts: u32,
    #[serde(default)]
    pub backoff_initial_ms: u64,
    #[serde(default)]
    pub backoff_max_ms: u64,
}

impl DefinitionFile {
    /// The definition in `text`, read as TOML or JSON by `path`'s
    /// extension; the error names the file, and the line and column.
    pub fn parse(path: &Path, text: &str) -> Result<DefinitionFile, String> {
        let shown = path.display();
        match path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
            .as_deref()
        {
            Some("toml") => toml::from_str(text).map_err(|e| {
                let at = e.span().map(|s| line_col(text, s.start)).unwrap_or_default();
                format!("{shown}{at}: {}", e.message().trim())
            }),
            Some("json") => serde_json::from_str(text).map_err(|e| {
                // serde_json appends " at line L column C"; say it first.
                let msg = e.to_string();
                let msg = msg.rsplit_once(" at line ").map_or(msg.as_str(), |(m, _)| m);
                format!("{shown}: line {}, column {}: {msg}", e.line(), e.column())
            }),
            _ => Err(format!(
                "{shown}: a definition file is TOML (.toml) or JSON (.json), by its extension"
            )),
        }
    }

    /// The `SagaDefinition` to register.
    pub fn to_proto(&self) -> pb::SagaDefinition {
        pb::SagaDefinition {
            name: self.name.clone(),
            version: self.version,
            steps: self
                .steps
                .iter()
                .map(|s| pb::SagaStepDefinition {
                    name: s.name.clone(),
                    kind: match s.kind {
                        KindFile::Compensable => pb::StepKind::Compensable,
                        KindFile::Pivot => pb::StepKind::Pivot,
                        KindFile::Retriable => pb::StepKind::Retriable,
                        KindFile::ReadOnly => pb::StepKind::ReadOnly,
                    } as i32,
                    service: s.service.clone(),
                    action: s.action.clone(),
                    compensation: s.compensation.clone(),
                    status_query: s.status_query.clone(),
                    versioned: s.versioned,
                    retry: s.retry.as_ref().map(|r| pb::RetryPolicy {
                        max_attempts: r.max_attempts,
                        backoff_initial_ms: r.backoff_initial_ms,
                        backoff_max_ms: r.backoff_max_ms,
                    }),
                    on_failure: s
                        .on_failure
                        .iter()
                        .map(|o| match o {
                            RecoveryFile::Retry => pb::RecoveryOption::Retry as i32,
                            RecoveryFile::Compensate => pb::RecoveryOption::Compensate as i32,
                            RecoveryFile::Park => pb::RecoveryOption::Park as i32,
                        })
                        .collect(),
                    high_impact: s.high_impact,
                    completion_timeout_ms: s.completion_timeout_ms,
                })
                .collect(),
        }
    }
}

/// `: line L, column C` of byte offset `at` in `text` (both from 1).
fn line_col(text: &str, at: usize) -> String {
    let before = &text[..at.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    format!(": line {line}, column {col}")
}

/// The bytes of `--input`: `@FILE` reads the file as it is; anything else
/// must be JSON text (so a quoting mistake in the shell is caught here).
fn input_bytes(arg: &str) -> Result<Vec<u8>, Failure> {
    bytes_arg("--input", arg)
}

/// The bytes of option `flag`'s `arg`, as [`input_bytes`] reads them.
fn bytes_arg(flag: &str, arg: &str) -> Result<Vec<u8>, Failure> {
    if let Some(file) = arg.strip_prefix('@') {
        return std::fs::read(file).map_err(|e| failure(EXIT_ERROR, format!("{flag} @{file}: {e}")));
    }
    serde_json::from_str::<serde_json::Value>(arg).map_err(|e| {
        failure(
            EXIT_USAGE,
            format!("{flag} is not JSON ({e}); give JSON text, or @FILE for a file's bytes"),
        )
    })?;
    Ok(arg.as_bytes().to_vec())
}

fn state_of(name: &str) -> pb::SagaState {
    match name {
        "running" => pb::SagaState::Running,
        "compensating" => pb::SagaState::Compensating,
        "completed" => pb::SagaState::Completed,
        "compensated" => pb::SagaState::Compensated,
        "parked" => pb::SagaState::Parked,
        _ => pb::SagaState::Unspecified,
    }
}

/// Whether a call may change something: a write's lost answer is an
/// unknown outcome, a read's is only a node that did not answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Read,
    Write,
}

/// What one failed attempt at one node means.
enum Verdict {
    /// Nothing happened there (not reached, no leader, a read not
    /// answered): ask the next node; this message if none answers.
    Elsewhere(String),
    /// The answer: fail with it.
    Fail(Failure),
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// What a failed attempt at `addr` means for a call of `kind`; `unknown`
/// says what to do about an unknown outcome.
fn classify(kind: Kind, addr: &str, s: &Status, unknown: &str) -> Verdict {
    let text = one_line(&format!("{addr}: {:?}: {}", s.code(), dtx_client::describe(s)));
    let not_applied = dtx_proto::metadata::not_applied(s) || dtx_transport::unary::nothing_sent(s);
    let unknown_outcome = || {
        Verdict::Fail(failure(
            EXIT_UNKNOWN,
            format!("{text} (the outcome is unknown: it may or may not have been applied; {unknown})"),
        ))
    };
    match s.code() {
        _ if dtx_transport::unary::nothing_sent(s) => Verdict::Elsewhere(text),
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown => {
            if kind == Kind::Read || not_applied {
                Verdict::Elsewhere(text)
            } else {
                unknown_outcome()
            }
        }
        Code::Internal | Code::DataLoss if kind == Kind::Write && !not_applied => unknown_outcome(),
        Code::ResourceExhausted if not_applied => Verdict::Elsewhere(text),
        _ => {
            let mut f = Failure::from(s.clone());
            f.message = one_line(&format!("{addr}: {}", f.message));
            Verdict::Fail(f)
        }
    }
}

/// Runs `f` at the nodes of --addr (and a leader a node names) until one
/// answers definitely or --timeout-s runs out; see [`classify`].
async fn call<T, F, Fut>(ctx: &Ctx, kind: Kind, unknown: &str, f: F) -> Result<T, Failure>
where
    F: Fn(SagaServiceClient<Channel>, Duration) -> Fut,
    Fut: Future<Output = Result<tonic::Response<T>, Status>>,
{
    let deadline = Instant::now() + ctx.timeout;
    let mut addrs = ctx.addrs.clone();
    let mut last = String::from("no address given");
    let mut round = 0u32;
    let mut refused = false;
    loop {
        let mut i = 0;
        while i < addrs.len() {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            let budget = (deadline - now).min(ATTEMPT_MAX);
            let addr = addrs[i].clone();
            i += 1;
            let ch =
                dtx_transport::channel::channel_with(&addr, None, budget.min(Duration::from_secs(2)), ctx.tls.as_ref())
                    .map_err(|e| failure(EXIT_USAGE, format!("--addr {addr}: {e}")))?;
            let s = match tokio::time::timeout(budget, f(SagaServiceClient::new(ch), budget)).await {
                Ok(Ok(r)) => return Ok(r.into_inner()),
                Ok(Err(s)) => s,
                Err(_) => Status::deadline_exceeded(format!("no answer within {budget:?}")),
            };
            match classify(kind, &addr, &s, unknown) {
                Verdict::Fail(f) => return Err(f),
                Verdict::Elsewhere(m) => last = m,
            }
            if kind == Kind::Write && dtx_proto::metadata::not_applied(&s) && !dtx_transport::unary::nothing_sent(&s) {
                refused = true;
            }
            if let Some(leader) = dtx_proto::metadata::leader_hint(&s) {
                if !addrs.contains(&leader) {
                    addrs.push(leader);
                }
            }
        }
        let now = Instant::now();
        if now >= deadline && refused {
            // A node answered that the write was not applied: a refusal
            // (nothing changed), not an unreachable cluster.
            return Err(failure(
                EXIT_REFUSED,
                format!(
                    "refused, not applied: no node could take the write within {:?} (no leader or no quorum); the \
                     last said: {last}",
                    ctx.timeout
                ),
            ));
        }
        if now >= deadline {
            return Err(failure(
                EXIT_UNREACHABLE,
                format!("no node answered within {:?}; the last said: {last}", ctx.timeout),
            ));
        }
        // No leader anywhere yet (an election), or nothing reachable:
        // wait a little and ask again.
        let pause = Duration::from_millis(100 << round.min(3)).min(deadline - now);
        tokio::time::sleep(pause).await;
        round += 1;
    }
}

/// A request with the token and the attempt's deadline.
fn request<T>(ctx: &Ctx, msg: T, budget: Duration) -> tonic::Request<T> {
    let mut rq = dtx_client::request_with_token(msg, ctx.token.as_deref());
    rq.set_timeout(budget);
    rq
}

async fn list_page(ctx: &Ctx, req: pb::ListSagasRequest) -> Result<pb::ListSagasResponse, Failure> {
    call(ctx, Kind::Read, "", |mut c, t| {
        let rq = request(ctx, req.clone(), t);
        async move { c.list_sagas(rq).await }
    })
    .await
}

/// Runs one `admin saga` command.
pub(crate) async fn run(ctx: &Ctx, cmd: SagaCmd) -> Outcome {
    match cmd {
        SagaCmd::List {
            states,
            definition,
            after,
            limit,
            all,
        } => {
            let mut req = pb::ListSagasRequest {
                states: states.iter().map(|s| state_of(s) as i32).collect(),
                definition: definition.unwrap_or_default(),
                after_saga_id: after,
                limit,
            };
            let mut sagas = Vec::new();
            let mut next = 0;
            for _ in 0..if all { LIST_PAGES_MAX } else { 1 } {
                let page = list_page(ctx, req.clone()).await?;
                sagas.extend(page.sagas);
                next = page.next_after_saga_id;
                if next == 0 {
                    break;
                }
                req.after_saga_id = next;
            }
            if ctx.json {
                let v = json!({
                    "next_after_saga_id": next,
                    "sagas": sagas.iter().map(view::saga_json).collect::<Vec<_>>(),
                });
                outln!("{}", serde_json::to_string_pretty(&v).expect("JSON"));
            } else {
                outln!("{}", view::list_table(&sagas));
                if next != 0 {
                    outln!("(more: --after {next}, or --all)");
                } else {
                    outln!("({} sagas)", sagas.len());
                }
            }
            Ok(())
        }
        SagaCmd::Show { id } => {
            let s = call(ctx, Kind::Read, "", |mut c, t| {
                let rq = request(ctx, pb::GetSagaRequest { saga_id: id }, t);
                async move { c.get_saga(rq).await }
            })
            .await?;
            emit(ctx, view::saga_json(&s), || view::show_text(&s));
            Ok(())
        }
        SagaCmd::Retry(a) => operate(ctx, a, pb::SagaOperatorAction::Retry, "retry").await,
        SagaCmd::Skip(a) => operate(ctx, a, pb::SagaOperatorAction::Skip, "skip").await,
        SagaCmd::Compensate(a) => operate(ctx, a, pb::SagaOperatorAction::Compensate, "compensate").await,
        SagaCmd::Complete(a) => operate(ctx, a, pb::SagaOperatorAction::MarkComplete, "complete").await,
        SagaCmd::Cancel(a) => operate(ctx, a, pb::SagaOperatorAction::Cancel, "cancel").await,
        SagaCmd::Approve(a) => operate(ctx, a, pb::SagaOperatorAction::Approve, "approve").await,
        SagaCmd::CompleteStep {
            id,
            step,
            operation,
            outcome,
            output,
            reason,
            who,
        } => {
            let output = match &output {
                Some(o) if outcome == "ok" => bytes_arg("--output", o)?,
                Some(_) => return Err(failure(EXIT_USAGE, "--output goes with --outcome ok only")),
                None => Vec::new(),
            };
            let req = pb::CompleteStepRequest {
                saga_id: id,
                step,
                operation_id: operation,
                outcome: if outcome == "ok" {
                    pb::StepOutcome::Ok
                } else {
                    pb::StepOutcome::Failed
                } as i32,
                output,
                reason,
                resource_version: String::new(),
                downstream_operation_id: String::new(),
                who,
            };
            let unknown =
                format!("saga show {id} shows whether step {step} completed; the same completion again is safe");
            let s = call(ctx, Kind::Write, &unknown, |mut c, t| {
                let rq = request(ctx, req.clone(), t);
                async move { c.complete_step(rq).await }
            })
            .await
            .map_err(|mut f| {
                if f.code == EXIT_REFUSED {
                    f.message = format!("saga {id}: completing step {step} refused: {}", f.message);
                }
                f
            })?;
            emit(ctx, view::saga_json(&s), || {
                format!(
                    "saga {id}: step {step} completed {}; now {}",
                    outcome.to_uppercase(),
                    view::saga_state_name(s.state)
                )
            });
            Ok(())
        }
        SagaCmd::Register { file } => {
            let text =
                std::fs::read_to_string(&file).map_err(|e| failure(EXIT_ERROR, format!("{}: {e}", file.display())))?;
            let def = DefinitionFile::parse(&file, &text).map_err(|m| failure(EXIT_ERROR, one_line(&m)))?;
            let d = def.to_proto();
            let r = call(
                ctx,
                Kind::Write,
                "register it again: the identical definition is a no-op",
                |mut c, t| {
                    let rq = request(
                        ctx,
                        pb::RegisterSagaDefinitionRequest {
                            definition: Some(d.clone()),
                        },
                        t,
                    );
                    async move { c.register_definition(rq).await }
                },
            )
            .await?;
            let v = json!({"definition": d.name, "version": d.version, "steps": d.steps.len(), "created": r.created});
            emit(ctx, v, || {
                if r.created {
                    format!(
                        "definition {}@{} registered ({} steps)",
                        d.name,
                        d.version,
                        d.steps.len()
                    )
                } else {
                    format!(
                        "definition {}@{} already registered (identical; nothing changed)",
                        d.name, d.version
                    )
                }
            });
            Ok(())
        }
        SagaCmd::Definitions => {
            let r = call(ctx, Kind::Read, "", |mut c, t| {
                let rq = request(ctx, pb::ListSagaDefinitionsRequest {}, t);
                async move { c.list_definitions(rq).await }
            })
            .await?;
            let v = json!({"definitions": r.definitions.iter().map(view::definition_json).collect::<Vec<_>>()});
            emit(ctx, v, || {
                if r.definitions.is_empty() {
                    "no definitions registered".into()
                } else {
                    view::definitions_table(&r.definitions)
                }
            });
            Ok(())
        }
        SagaCmd::Start {
            definition,
            version,
            key,
            input,
            principal,
            tenant,
            expires_at_ms,
            policy,
            deadline_ms,
        } => {
            if key.is_empty() {
                return Err(failure(EXIT_USAGE, "--key must not be empty"));
            }
            let input = input_bytes(&input)?;
            let authorization =
                (principal.is_some() || tenant.is_some() || expires_at_ms.is_some() || policy.is_some()).then(|| {
                    pb::SagaAuthorization {
                        principal: principal.unwrap_or_default(),
                        tenant: tenant.unwrap_or_default(),
                        expires_at_ms: expires_at_ms.unwrap_or(0),
                        policy: policy.unwrap_or_default(),
                    }
                });
            let req = pb::StartSagaRequest {
                definition: definition.clone(),
                version,
                idempotency_key: key.clone(),
                input,
                authorization,
                deadline_ms: deadline_ms.unwrap_or(0),
            };
            let unknown = format!("start it again with the same --key {key}: it answers the same saga");
            let r = call(ctx, Kind::Write, &unknown, |mut c, t| {
                let rq = request(ctx, req.clone(), t);
                async move { c.start_saga(rq).await }
            })
            .await?;
            emit(ctx, json!({"saga_id": r.saga_id, "created": r.created}), || {
                if r.created {
                    format!("saga {} started ({definition}@{version}, key {key})", r.saga_id)
                } else {
                    format!("saga {} (started before with key {key}; nothing new)", r.saga_id)
                }
            });
            Ok(())
        }
    }
}

/// The operator's manual path: `action` on a parked saga, with why.
async fn operate(ctx: &Ctx, a: OperateArgs, action: pb::SagaOperatorAction, name: &str) -> Outcome {
    if a.why.trim().is_empty() {
        return Err(failure(
            EXIT_USAGE,
            "--why must say why (it is recorded with the action)",
        ));
    }
    let id = a.id;
    let unknown = format!("saga show {id} lists the operator actions recorded");
    let s = call(ctx, Kind::Write, &unknown, |mut c, t| {
        let rq = request(
            ctx,
            pb::OperateSagaRequest {
                saga_id: id,
                action: action as i32,
                why: a.why.clone(),
                operator: a.operator.clone(),
            },
            t,
        );
        async move { c.operate_saga(rq).await }
    })
    .await
    .map_err(|mut f| {
        if f.code == EXIT_REFUSED {
            f.message = format!("saga {id}: {name} refused: {}", f.message);
        }
        f
    })?;
    emit(ctx, view::saga_json(&s), || {
        let mut line = format!("saga {id}: {name} recorded; now {}", view::saga_state_name(s.state));
        if !s.parked_reason.is_empty() && s.state == pb::SagaState::Parked as i32 {
            line.push_str(&format!(" ({})", view::truncate(&s.parked_reason, 200)));
        }
        line
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOML: &str = r#"
name = "order"
version = 3

[[steps]]
name = "reserve"
kind = "compensable"
service = "127.0.0.1:7301"
action = "reserve"
compensation = "release"
status_query = "reservation"
versioned = true
on_failure = ["retry", "compensate"]
retry = { max_attempts = 5, backoff_initial_ms = 100, backoff_max_ms = 5000 }

[[steps]]
name = "charge"
kind = "pivot"
service = "127.0.0.1:7302"
action = "charge"
status_query = "payment"

[[steps]]
name = "ship"
kind = "retriable"
service = "127.0.0.1:7303"
action = "ship"
status_query = "shipment"
on_failure = ["retry", "park"]
"#;

    fn parsed() -> DefinitionFile {
        DefinitionFile::parse(Path::new("order.toml"), TOML).expect("parses")
    }

    #[test]
    fn a_toml_definition_becomes_the_proto() {
        let d = parsed().to_proto();
        assert_eq!((d.name.as_str(), d.version, d.steps.len()), ("order", 3, 3));
        let r = &d.steps[0];
        assert_eq!(r.kind, pb::StepKind::Compensable as i32);
        assert_eq!(r.service, "127.0.0.1:7301");
        assert_eq!(r.compensation, "release");
        assert_eq!(r.status_query, "reservation");
        assert!(r.versioned);
        assert_eq!(
            r.on_failure,
            vec![pb::RecoveryOption::Retry as i32, pb::RecoveryOption::Compensate as i32]
        );
        assert_eq!(
            r.retry,
            Some(pb::RetryPolicy {
                max_attempts: 5,
                backoff_initial_ms: 100,
                backoff_max_ms: 5000
            })
        );
        assert_eq!(d.steps[1].kind, pb::StepKind::Pivot as i32);
        assert_eq!(d.steps[1].compensation, "");
        assert_eq!(d.steps[1].retry, None);
        assert!(d.steps[1].on_failure.is_empty());
        assert_eq!(d.steps[2].kind, pb::StepKind::Retriable as i32);
        assert_eq!(d.steps[2].on_failure[1], pb::RecoveryOption::Park as i32);
    }

    #[test]
    fn the_same_definition_in_json_reads_the_same_and_definitions_json_reads_back() {
        let json = r#"{"name": "order", "version": 3, "steps": [
            {"name": "reserve", "kind": "compensable", "service": "127.0.0.1:7301", "action": "reserve",
             "compensation": "release", "status_query": "reservation", "versioned": true,
             "on_failure": ["retry", "compensate"],
             "retry": {"max_attempts": 5, "backoff_initial_ms": 100, "backoff_max_ms": 5000}},
            {"name": "charge", "kind": "pivot", "service": "127.0.0.1:7302", "action": "charge",
             "status_query": "payment"},
            {"name": "ship", "kind": "retriable", "service": "127.0.0.1:7303", "action": "ship",
             "status_query": "shipment", "on_failure": ["retry", "park"]}]}"#;
        let d = DefinitionFile::parse(Path::new("order.JSON"), json).expect("parses");
        assert_eq!(d, parsed());
        // `saga definitions --json` prints what `saga register` reads.
        let out = view::definition_json(&d.to_proto()).to_string();
        let back = DefinitionFile::parse(Path::new("again.json"), &out).expect("reads back");
        assert_eq!(back, d);
    }

    #[test]
    fn a_bad_kind_is_named_with_where_it_is() {
        let bad = TOML.replace("kind = \"pivot\"", "kind = \"pivott\"");
        let e = DefinitionFile::parse(Path::new("order.toml"), &bad).unwrap_err();
        assert!(e.starts_with("order.toml: line 18, column 8: "), "{e}");
        assert!(e.contains("pivott"), "{e}");
        assert!(
            e.contains("compensable") && e.contains("retriable"),
            "says what is accepted: {e}"
        );

        let e = DefinitionFile::parse(
            Path::new("d.json"),
            r#"{"name": "x", "version": 1, "steps": [{"name": "a", "kind": "COMPENSATE", "service": "s",
                "action": "a", "status_query": "q"}]}"#,
        )
        .unwrap_err();
        assert!(e.starts_with("d.json: line 1, column "), "{e}");
        assert!(e.contains("unknown variant `COMPENSATE`"), "{e}");
        assert!(e.contains("`compensable`, `pivot`, `retriable`"), "{e}");
    }

    #[test]
    fn other_mistakes_in_a_file_are_refused_too() {
        // A misspelt key.
        let e = DefinitionFile::parse(
            Path::new("o.toml"),
            &TOML.replace("status_query = \"payment\"", "statusquery = \"payment\""),
        )
        .unwrap_err();
        assert!(e.contains("statusquery"), "{e}");
        // A bad recovery option.
        let e = DefinitionFile::parse(Path::new("o.toml"), &TOML.replace("\"park\"]", "\"abort\"]")).unwrap_err();
        assert!(e.contains("abort") && e.contains("compensate"), "{e}");
        // No version.
        let e = DefinitionFile::parse(Path::new("o.toml"), &TOML.replace("version = 3", "")).unwrap_err();
        assert!(e.contains("version"), "{e}");
        // Neither TOML nor JSON.
        let e = DefinitionFile::parse(Path::new("o.yaml"), TOML).unwrap_err();
        assert!(e.contains(".toml") && e.contains(".json"), "{e}");
    }

    #[test]
    fn input_is_json_text_or_a_file() {
        let ok = |r: Result<Vec<u8>, Failure>| r.unwrap_or_else(|f| panic!("{}", f.message));
        assert_eq!(ok(input_bytes(r#"{"a":1}"#)), br#"{"a":1}"#);
        let f = input_bytes("{a:1}").unwrap_err();
        assert_eq!(f.code, EXIT_USAGE, "{}", f.message);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("in.bin");
        std::fs::write(&p, [0xffu8, 0x01]).unwrap();
        assert_eq!(ok(input_bytes(&format!("@{}", p.display()))), vec![0xff, 0x01]);
        let f = input_bytes("@/nonexistent/x").unwrap_err();
        assert_eq!(f.code, EXIT_ERROR);
    }

    fn code(v: Verdict) -> i32 {
        match v {
            Verdict::Fail(f) => {
                assert!(!f.message.contains('\n'), "one line: {:?}", f.message);
                f.code
            }
            Verdict::Elsewhere(_) => 0,
        }
    }

    #[test]
    fn failures_map_to_the_admin_exit_codes() {
        let na = |mut s: Status| {
            s.metadata_mut()
                .insert(dtx_proto::metadata::NOT_APPLIED_HEADER, "1".parse().unwrap());
            s
        };
        let w = |s: Status| code(classify(Kind::Write, "n1", &s, "look"));
        let r = |s: Status| code(classify(Kind::Read, "n1", &s, ""));
        for s in [
            Status::invalid_argument("bad\ninput"),
            Status::not_found("no saga 9"),
            Status::already_exists("key taken"),
            Status::failed_precondition("not parked"),
            Status::permission_denied("operators only"),
        ] {
            assert_eq!(w(s.clone()), EXIT_REFUSED, "{s:?}");
            assert_eq!(r(s.clone()), EXIT_REFUSED, "{s:?}");
        }
        // A write sent and not answered definitely: unknown.
        assert_eq!(w(Status::unavailable("lost")), EXIT_UNKNOWN);
        assert_eq!(w(Status::deadline_exceeded("slow")), EXIT_UNKNOWN);
        assert_eq!(w(Status::internal("stream reset")), EXIT_UNKNOWN);
        // Certainly not applied (no leader): ask elsewhere.
        assert_eq!(w(na(Status::unavailable("no leader"))), 0);
        // Not connected: nothing was sent.
        let refused = Status::from_error(Box::new(tonic::ConnectError(Box::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionRefused,
        )))));
        assert_eq!(refused.code(), Code::Unavailable);
        assert_eq!(w(refused), 0);
        // Reads are asked elsewhere.
        assert_eq!(r(Status::unavailable("lost")), 0);
        assert_eq!(r(Status::deadline_exceeded("slow")), 0);
        assert_eq!(r(Status::internal("bug")), EXIT_ERROR);
        // The message is the server's, on one line.
        let Verdict::Fail(f) = classify(
            Kind::Write,
            "n1",
            &Status::failed_precondition("saga 9\nis RUNNING"),
            "",
        ) else {
            panic!()
        };
        assert_eq!(f.message, "n1: FailedPrecondition: saga 9 is RUNNING");
    }

    /// A SagaService that answers from a script, and what it was asked.
    #[derive(Default)]
    struct Fake {
        asked: std::sync::Mutex<Vec<String>>,
    }

    impl Fake {
        fn note(&self, what: String) {
            self.asked.lock().unwrap().push(what);
        }
    }

    fn saga(id: u64, state: pb::SagaState) -> pb::SagaView {
        let mut s = view::tests::sample();
        s.saga_id = id;
        s.state = state as i32;
        s
    }

    #[tonic::async_trait]
    impl pb::saga_service_server::SagaService for Fake {
        async fn complete_step(
            &self,
            rq: tonic::Request<pb::CompleteStepRequest>,
        ) -> Result<tonic::Response<pb::SagaView>, Status> {
            let r = rq.into_inner();
            self.note(format!(
                "complete {} {} {} {} {} {}",
                r.saga_id,
                r.step,
                r.operation_id,
                r.outcome,
                String::from_utf8_lossy(&r.output),
                r.who
            ));
            Ok(tonic::Response::new(saga(r.saga_id, pb::SagaState::Running)))
        }
        async fn register_definition(
            &self,
            rq: tonic::Request<pb::RegisterSagaDefinitionRequest>,
        ) -> Result<tonic::Response<pb::RegisterSagaDefinitionResponse>, Status> {
            let d = rq.into_inner().definition.unwrap_or_default();
            self.note(format!("register {}@{} {}", d.name, d.version, d.steps.len()));
            Ok(tonic::Response::new(pb::RegisterSagaDefinitionResponse {
                created: d.version == 3,
            }))
        }
        async fn start_saga(
            &self,
            rq: tonic::Request<pb::StartSagaRequest>,
        ) -> Result<tonic::Response<pb::StartSagaResponse>, Status> {
            let r = rq.into_inner();
            let a = r.authorization.unwrap_or_default();
            self.note(format!(
                "start {}@{} {} {} {} {}",
                r.definition,
                r.version,
                r.idempotency_key,
                String::from_utf8_lossy(&r.input),
                a.principal,
                r.deadline_ms
            ));
            Ok(tonic::Response::new(pb::StartSagaResponse {
                saga_id: 5,
                created: true,
            }))
        }
        async fn get_saga(
            &self,
            rq: tonic::Request<pb::GetSagaRequest>,
        ) -> Result<tonic::Response<pb::SagaView>, Status> {
            match rq.into_inner().saga_id {
                42 => Ok(tonic::Response::new(saga(42, pb::SagaState::Parked))),
                n => Err(Status::not_found(format!("no saga {n}"))),
            }
        }
        async fn list_sagas(
            &self,
            rq: tonic::Request<pb::ListSagasRequest>,
        ) -> Result<tonic::Response<pb::ListSagasResponse>, Status> {
            let r = rq.into_inner();
            self.note(format!(
                "list {:?} {} {} {}",
                r.states, r.definition, r.after_saga_id, r.limit
            ));
            let (id, next) = if r.after_saga_id == 0 { (1, 1) } else { (2, 0) };
            Ok(tonic::Response::new(pb::ListSagasResponse {
                sagas: vec![saga(id, pb::SagaState::Running)],
                next_after_saga_id: next,
            }))
        }
        async fn operate_saga(
            &self,
            rq: tonic::Request<pb::OperateSagaRequest>,
        ) -> Result<tonic::Response<pb::SagaView>, Status> {
            let r = rq.into_inner();
            self.note(format!("operate {} {} {} {}", r.saga_id, r.action, r.why, r.operator));
            match r.saga_id {
                42 => Ok(tonic::Response::new(saga(42, pb::SagaState::Running))),
                7 => Err(Status::failed_precondition("saga 7 is not parked\n(it is RUNNING)")),
                9 => Err(Status::unavailable("leader lost after proposing")),
                _ => {
                    let mut s = Status::unavailable("no leader");
                    s.metadata_mut()
                        .insert(dtx_proto::metadata::NOT_APPLIED_HEADER, "1".parse().unwrap());
                    Err(s)
                }
            }
        }
        async fn list_definitions(
            &self,
            _: tonic::Request<pb::ListSagaDefinitionsRequest>,
        ) -> Result<tonic::Response<pb::ListSagaDefinitionsResponse>, Status> {
            Ok(tonic::Response::new(pb::ListSagaDefinitionsResponse {
                definitions: vec![parsed().to_proto()],
            }))
        }
    }

    /// The fake's address, a dead one (nothing listens there), and the fake.
    async fn serve() -> (String, String, std::sync::Arc<Fake>) {
        let fake = std::sync::Arc::new(Fake::default());
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let svc = pb::saga_service_server::SagaServiceServer::from_arc(fake.clone());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(dtx_transport::incoming(l)),
        );
        let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let dead_addr = dead.local_addr().unwrap().to_string();
        drop(dead);
        (addr, dead_addr, fake)
    }

    fn operate_args(id: u64) -> OperateArgs {
        OperateArgs {
            id,
            why: "card service restarted".into(),
            operator: "alice".into(),
        }
    }

    fn exit(o: Outcome) -> i32 {
        match o {
            Ok(()) => 0,
            Err(f) => {
                assert!(!f.message.contains('\n'), "one line: {:?}", f.message);
                f.code
            }
        }
    }

    #[tokio::test]
    async fn commands_against_a_fake_service_send_what_they_say_and_exit_as_documented() {
        let (addr, dead, fake) = serve().await;
        // The dead address first: nothing is sent there, so even a write
        // goes on to the next.
        let ctx = Ctx::for_tests(vec![dead.clone(), addr.clone()], false, Duration::from_secs(3));
        assert_eq!(exit(run(&ctx, SagaCmd::Retry(operate_args(42))).await), 0);
        assert_eq!(exit(run(&ctx, SagaCmd::Show { id: 42 }).await), 0);
        assert_eq!(exit(run(&ctx, SagaCmd::Show { id: 8 }).await), EXIT_REFUSED);
        let f = run(&ctx, SagaCmd::Compensate(operate_args(7)))
            .await
            .expect_err("refused");
        assert_eq!(f.code, EXIT_REFUSED);
        assert!(
            f.message.contains("saga 7 is not parked (it is RUNNING)"),
            "{}",
            f.message
        );
        // Sent, and the answer lost: unknown, and not sent again.
        let f = run(&ctx, SagaCmd::Skip(operate_args(9))).await.expect_err("unknown");
        assert_eq!(f.code, EXIT_UNKNOWN, "{}", f.message);
        assert!(f.message.contains("saga show 9"), "{}", f.message);
        let list = run(
            &ctx,
            SagaCmd::List {
                states: vec!["parked".into(), "running".into()],
                definition: Some("order".into()),
                after: 0,
                limit: 10,
                all: true,
            },
        );
        assert_eq!(exit(list.await), 0);
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("order.toml");
        std::fs::write(&file, TOML).unwrap();
        assert_eq!(exit(run(&ctx, SagaCmd::Register { file: file.clone() }).await), 0);
        std::fs::write(&file, TOML.replace("pivot", "pivott")).unwrap();
        assert_eq!(exit(run(&ctx, SagaCmd::Register { file }).await), EXIT_ERROR);
        assert_eq!(exit(run(&ctx, SagaCmd::Definitions).await), 0);
        let start = SagaCmd::Start {
            definition: "order".into(),
            version: 3,
            key: "order-7".into(),
            input: r#"{"order":7}"#.into(),
            principal: Some("alice".into()),
            tenant: None,
            expires_at_ms: None,
            policy: None,
            deadline_ms: Some(30_000),
        };
        assert_eq!(exit(run(&ctx, start).await), 0);
        assert_eq!(exit(run(&ctx, SagaCmd::Cancel(operate_args(42))).await), 0);
        assert_eq!(exit(run(&ctx, SagaCmd::Approve(operate_args(42))).await), 0);
        let complete = |outcome: &str, output: Option<&str>| SagaCmd::CompleteStep {
            id: 42,
            step: 1,
            operation: "42.1.f1".into(),
            outcome: outcome.into(),
            output: output.map(Into::into),
            reason: String::new(),
            who: "approver".into(),
        };
        assert_eq!(exit(run(&ctx, complete("ok", Some(r#"{"ok":1}"#))).await), 0);
        // Checked before anything is sent: an output with a FAILED, and
        // an output that is not JSON.
        assert_eq!(exit(run(&ctx, complete("failed", Some("{}"))).await), EXIT_USAGE);
        assert_eq!(exit(run(&ctx, complete("ok", Some("not json"))).await), EXIT_USAGE);
        let asked = fake.asked.lock().unwrap().clone();
        assert_eq!(
            asked,
            [
                "operate 42 1 card service restarted alice",
                "operate 7 3 card service restarted alice",
                "operate 9 2 card service restarted alice",
                "list [5, 1] order 0 10",
                "list [5, 1] order 1 10",
                "register order@3 3",
                "start order@3 order-7 {\"order\":7} alice 30000",
                "operate 42 5 card service restarted alice",
                "operate 42 6 card service restarted alice",
                "complete 42 1 42.1.f1 2 {\"ok\":1} approver",
            ]
        );

        // Certainly not applied anywhere (no leader): asked again until the
        // timeout, then a definite refusal, exit 3 (a write every node
        // refused as not applied is not "unreachable").
        let ctx = Ctx::for_tests(vec![addr], true, Duration::from_millis(700));
        let f = run(&ctx, SagaCmd::Complete(operate_args(10)))
            .await
            .expect_err("no leader");
        assert_eq!(f.code, EXIT_REFUSED, "{}", f.message);
        assert!(f.message.contains("not applied"), "{}", f.message);
        assert!(fake.asked.lock().unwrap().len() > asked.len() + 1, "asked again");
        // Nothing listening at all: unreachable.
        let ctx = Ctx::for_tests(vec![dead], false, Duration::from_millis(500));
        assert_eq!(exit(run(&ctx, SagaCmd::Definitions).await), EXIT_UNREACHABLE);
    }
}
