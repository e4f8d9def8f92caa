//! `coordinator admin`: the operator's commands against a running cluster.
//!
//! Human tables by default and `--json` everywhere (one JSON document on
//! stdout). Errors go to stderr as one line, without backtraces, and the
//! exit code says what happened, so scripts can tell a refusal from an
//! unknown outcome from a cluster they cannot reach:
//!
//! | code | meaning |
//! |---:|---|
//! | 0 | done (or, for reads, answered) |
//! | 1 | another error (an answer this tool cannot read, a local file) |
//! | 2 | the command line is wrong (clap) |
//! | 3 | refused: nothing changed (invalid, not found, not allowed now, not authorised, or a decision other than the one asked for already stands) |
//! | 4 | outcome unknown: a write may or may not have been applied; look again (`txn show`) |
//! | 5 | unreachable: no node answered in time |
//! | 6 | answered, but not healthy: `status` found no serving leader with a quorum, or `status --check` does not hold |

use std::path::PathBuf;
use std::time::Duration;

use clap::Subcommand;
use dtx_client::Client;
use dtx_client::ClientConfig;
use dtx_client::TxOutcome;
use dtx_proto::v1 as pb;
use dtx_proto::v1::admin_client::AdminClient;
use serde_json::json;

use crate::admin_ctx::emit;
use crate::admin_ctx::failure;
use crate::admin_ctx::list_all;
use crate::admin_ctx::local;
use crate::admin_ctx::Ctx;
use crate::admin_ctx::Failure;
use crate::admin_ctx::Outcome;
use crate::admin_view as view;

use crate::exit_codes::EXIT_ERROR;
use crate::exit_codes::EXIT_OK;
use crate::exit_codes::EXIT_REFUSED;
use crate::exit_codes::EXIT_UNHEALTHY;
use crate::exit_codes::EXIT_UNKNOWN;
use crate::exit_codes::EXIT_UNREACHABLE;
use crate::exit_codes::EXIT_USAGE;

#[derive(clap::Args)]
pub struct AdminArgs {
    /// API address(es) of any node(s), comma-separated.
    #[arg(long, default_value = "127.0.0.1:7201", value_delimiter = ',')]
    addr: Vec<String>,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    /// Give up on a call after this many seconds (a dead node is skipped
    /// after the connect timeout, at most 2 s).
    #[arg(long, default_value_t = 10.0, global = true)]
    timeout_s: f64,
    /// TLS and token settings (an operator's certificate: dtx://operator/<name>).
    #[command(flatten)]
    tls: dtx_tls::args::TlsArgs,
    #[command(subcommand)]
    cmd: AdminCmd,
}

#[derive(Subcommand)]
enum AdminCmd {
    /// Each member's own view (role, serving, term, applied index) beside
    /// the leader's (reach and lag per member). Exit 6 when no serving
    /// leader has a quorum (the view is printed all the same).
    Status {
        /// Only check, for scripts: `serving` (every --addr node serves:
        /// it knows a leader that heard from a majority, and has applied
        /// what it knows to be committed) or `quorum` (the cluster has a
        /// leader that serves, having heard from a majority). One line per
        /// node or one line; exit 0 when it holds, 6 when it does not, 5
        /// when no node answered.
        #[arg(long, value_parser = ["serving", "quorum"])]
        check: Option<String>,
    },
    /// Transactions: list, show, in-doubt report, repairs, and a drill.
    #[command(subcommand)]
    Txn(TxnCmd),
    /// Sagas: list, show, the manual path for a parked saga (retry, skip,
    /// compensate, complete), definitions (register, list), start.
    #[command(subcommand)]
    Saga(crate::admin_saga::SagaCmd),
    /// Add a node (as a learner, then a voter unless --learner).
    AddNode {
        #[arg(long)]
        node_id: u64,
        #[arg(long)]
        raft_addr: String,
        #[arg(long)]
        api_addr: String,
        #[arg(long)]
        learner: bool,
    },
    /// Remove a node from the cluster (its id is never used again).
    RemoveNode {
        #[arg(long)]
        node_id: u64,
    },
    /// Replace a member: add the new node (caught up, then a voter), then
    /// remove the old one. Start the new node first, on an empty data
    /// directory, without --bootstrap.
    ReplaceNode {
        /// The member to replace.
        #[arg(long)]
        old_node_id: u64,
        /// The new node's id (never used before in this cluster).
        #[arg(long)]
        node_id: u64,
        #[arg(long)]
        raft_addr: String,
        #[arg(long)]
        api_addr: String,
    },
    /// Move leadership to another node: not offered by the pinned openraft
    /// (0.9.25); says so and what to do instead.
    TransferLeader {
        #[arg(long)]
        to: u64,
    },
    /// Build a snapshot on the addressed node now.
    Snapshot,
    /// A participant's own view, asked of the participant service at
    /// --address (not the cluster): its log records for --txid, the
    /// transactions it holds in doubt (voted YES, decision unknown: locks
    /// held), its most recent records. Read-only.
    Participant(crate::admin_participant::ParticipantArgs),
    /// Save a consistent backup of the cluster's replicated state to a file
    /// (restore it with `coordinator restore`).
    Backup {
        /// The backup file to write (written beside it, then renamed).
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        opts: crate::backup::SaveOptions,
    },
}

#[derive(Subcommand)]
enum TxnCmd {
    /// Transactions by ascending txid, filtered; one page unless --all.
    List {
        /// Only this state: active, preparing or decided.
        #[arg(long, value_parser = ["active", "preparing", "decided"])]
        state: Option<String>,
        /// Only those begun at least this many seconds ago.
        #[arg(long)]
        older_than_s: Option<f64>,
        /// Only those that enlisted this participant id.
        #[arg(long)]
        participant: Option<String>,
        /// Only decided ones still waiting for a participant's ack.
        #[arg(long)]
        unacknowledged: bool,
        /// Only those with a participant dropped from phase two.
        #[arg(long)]
        dropped: bool,
        /// Start after this txid (the `next` printed by the previous page).
        #[arg(long, default_value_t = 0)]
        after: u64,
        /// Page size (at most 1000).
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// Every page, not just the first.
        #[arg(long)]
        all: bool,
    },
    /// One transaction: its timeline and where each participant stands.
    Show { txid: u64 },
    /// Participants left waiting, oldest first: transactions still
    /// preparing, and decided ones not yet acknowledged by a participant.
    InDoubt,
    /// Record a decision by hand (write-once: it never overrides one).
    #[command(group(clap::ArgGroup::new("outcome").required(true).args(["commit", "abort"])))]
    Resolve {
        txid: u64,
        /// Record COMMIT: every participant must hold a YES vote (--voters).
        #[arg(long)]
        commit: bool,
        /// Record ABORT.
        #[arg(long)]
        abort: bool,
        /// Participants known to hold a YES vote (required for --commit).
        #[arg(long, value_delimiter = ',')]
        voters: Vec<String>,
        /// Only for a one-phase commit whose one participant is gone for
        /// good (only its answer could decide it): declare it lost, drop
        /// it, and record --commit or --abort as your heuristic decision,
        /// shown as the operator's, never as the participant's. Needs
        /// --reason.
        #[arg(long, conflicts_with = "voters")]
        participant_lost: bool,
        #[command(flatten)]
        who: Who,
    },
    /// Settle a txid ANOTHER incarnation handed out (after a restore: one
    /// the old cluster handed out after the backup), which participants
    /// otherwise hold in doubt for ever: records --commit or --abort for
    /// (incarnation, txid), write-once, and their recovery applies it. The
    /// leader first asks every --participant: COMMIT needs one that holds
    /// it COMMITTED, or a YES vote from every one (then name them all);
    /// ABORT is refused when one holds it COMMITTED or cannot be asked.
    #[command(group(clap::ArgGroup::new("outcome").required(true).args(["commit", "abort"])))]
    SettleOther {
        /// The incarnation the participant lists for the txid, in hex (as
        /// `admin participant --in-doubt` shows it).
        #[arg(long, value_name = "HEX", value_parser = crate::admin_participant::parse_incarnation)]
        incarnation: u64,
        /// The txid, as numbered in that incarnation.
        #[arg(long)]
        txid: u64,
        /// Record COMMIT.
        #[arg(long)]
        commit: bool,
        /// Record ABORT.
        #[arg(long)]
        abort: bool,
        /// A participant of the transaction and where its service answers,
        /// ID=HOST:PORT; once per participant.
        #[arg(long = "participant", value_name = "ID=ADDR", value_parser = parse_participant, required = true)]
        participants: Vec<(String, String)>,
        #[command(flatten)]
        who: Who,
    },
    /// Stop delivering the decision to a participant gone for good; the
    /// transaction is then marked as needing manual reconciliation there.
    /// `TXID PARTICIPANT` for one transaction; `--participant X --all` for
    /// every decided transaction still waiting for X's ack (with
    /// `--dry-run`: only list and count them).
    #[command(group(clap::ArgGroup::new("which").required(true).args(["txid", "all"])))]
    DropParticipant {
        /// The transaction (or --all).
        #[arg(conflicts_with = "all")]
        txid: Option<u64>,
        /// The participant id, as enlisted (or --participant).
        #[arg(conflicts_with = "participant_flag", required_unless_present = "participant_flag")]
        participant: Option<String>,
        /// The participant id, as enlisted.
        #[arg(long = "participant", id = "participant_flag")]
        participant_flag: Option<String>,
        #[command(flatten)]
        bulk: Bulk,
        #[command(flatten)]
        who: Who,
    },
    /// Forget a decided transaction now (every participant acked or was
    /// dropped; never a COMMIT with a dropped participant). `TXID` for one;
    /// `--participant X --all` for every decided transaction that enlisted
    /// X and may be forgotten (with `--dry-run`: only list and count them).
    #[command(group(clap::ArgGroup::new("which").required(true).args(["txid", "all"])))]
    Forget {
        /// The transaction (or --participant X --all).
        #[arg(conflicts_with = "all")]
        txid: Option<u64>,
        /// With --all: the transactions that enlisted this participant.
        #[arg(long, requires = "all")]
        participant: Option<String>,
        #[command(flatten)]
        bulk: Bulk,
        #[command(flatten)]
        who: Who,
    },
    /// Drill: begin a transaction (it is aborted at its deadline unless
    /// committed).
    Begin {
        /// Idempotency key (the same key finds the same transaction).
        #[arg(long)]
        key: String,
        /// Milliseconds until the deadline (0: the cluster's default).
        #[arg(long, default_value_t = 0)]
        timeout_ms: u64,
    },
    /// Drill: enlist a participant service in an active transaction.
    Enlist {
        txid: u64,
        #[arg(long)]
        participant: String,
        /// The participant's gRPC address (host:port).
        #[arg(long)]
        address: String,
        /// Payload handed to the participant with Prepare (UTF-8 text).
        #[arg(long, default_value = "")]
        payload: String,
    },
    /// Drill: ask for COMMIT and print the decision.
    Commit { txid: u64 },
    /// Drill: ask for ABORT and print the decision.
    Abort {
        txid: u64,
        #[arg(long)]
        reason: String,
    },
}

/// A repair of many transactions at once.
#[derive(clap::Args, Clone, Copy)]
struct Bulk {
    /// Every transaction the selection finds (needs --participant).
    #[arg(long)]
    all: bool,
    /// With --all: list and count what would be repaired; change nothing.
    #[arg(long, requires = "all")]
    dry_run: bool,
}

/// Who makes a repair and why (both recorded). With authentication on,
/// the cluster records the authenticated identity instead of --operator.
#[derive(clap::Args)]
struct Who {
    /// Your name, recorded with the repair (default: $USER, else $LOGNAME,
    /// else this process's uid).
    #[arg(long)]
    operator: Option<String>,
    /// Why, recorded with the repair.
    #[arg(long)]
    reason: String,
}

impl Who {
    /// The name recorded: --operator, else the first of $USER and
    /// $LOGNAME that is set and not empty, else the user of this process
    /// (never empty, so a repair is not refused for an empty $USER).
    fn operator(&self) -> String {
        let given = self.operator.clone().filter(|o| !o.trim().is_empty());
        given
            .or_else(|| {
                ["USER", "LOGNAME"]
                    .iter()
                    .filter_map(|v| std::env::var(v).ok())
                    .find(|v| !v.trim().is_empty())
            })
            .unwrap_or_else(process_user)
    }
}

/// This process's user as `uid N` (the owner of /proc/self), else
/// "unknown user": never empty.
fn process_user() -> String {
    use std::os::unix::fs::MetadataExt;
    match std::fs::metadata("/proc/self") {
        Ok(m) => format!("uid {}", m.uid()),
        Err(_) => "unknown user".to_string(),
    }
}

/// Runs one admin command; the process's exit code.
pub async fn run(a: AdminArgs) -> i32 {
    match run_inner(a).await {
        Ok(()) => EXIT_OK,
        Err(f) => {
            eprintln!("error: {}", f.message);
            f.code
        }
    }
}

async fn run_inner(a: AdminArgs) -> Outcome {
    if !(a.timeout_s.is_finite() && a.timeout_s > 0.0) {
        return Err(failure(
            2,
            format!("--timeout-s must be a positive number of seconds, not {}", a.timeout_s),
        ));
    }
    let timeout = Duration::from_secs_f64(a.timeout_s);
    let mut cfg = ClientConfig::new(a.addr.clone());
    cfg.call_deadline = timeout;
    cfg.attempt_timeout = timeout.min(Duration::from_secs(5));
    cfg.connect_timeout = timeout.min(Duration::from_secs(2));
    cfg.tls = a.tls.client().map_err(local)?;
    cfg.token = a.tls.token().map_err(local)?;
    let ctx = Ctx {
        addrs: a.addr,
        json: a.json,
        timeout,
        tls: cfg.tls.clone(),
        token: cfg.token.clone(),
        client: Client::new(cfg).map_err(Failure::from)?,
    };
    match a.cmd {
        AdminCmd::Status { check: None } => status(&ctx).await,
        AdminCmd::Status { check: Some(c) } if c == "serving" => check_serving(&ctx).await,
        AdminCmd::Status { check: Some(_) } => check_quorum(&ctx).await,
        AdminCmd::Txn(cmd) => txn(&ctx, cmd).await,
        AdminCmd::Saga(cmd) => crate::admin_saga::run(&ctx, cmd).await,
        AdminCmd::AddNode {
            node_id,
            raft_addr,
            api_addr,
            learner,
        } => {
            let voters = add_node(&ctx, node_id, raft_addr, api_addr, !learner).await?;
            emit(&ctx, json!({"added": node_id, "voters": voters}), || {
                format!("node {node_id} added; voters now: {voters:?}")
            });
            Ok(())
        }
        AdminCmd::RemoveNode { node_id } => {
            let voters = remove_node(&ctx, node_id).await?;
            emit(&ctx, json!({"removed": node_id, "voters": voters}), || {
                format!("node {node_id} removed; voters now: {voters:?}")
            });
            Ok(())
        }
        AdminCmd::ReplaceNode {
            old_node_id,
            node_id,
            raft_addr,
            api_addr,
        } => {
            if old_node_id == node_id {
                return Err(failure(
                    EXIT_REFUSED,
                    "the new node needs an id of its own (node ids are never reused)",
                ));
            }
            add_node(&ctx, node_id, raft_addr, api_addr, true).await?;
            let voters = remove_node(&ctx, old_node_id).await.map_err(|mut f| {
                f.message = format!(
                    "node {node_id} was added as a voter, but removing node {old_node_id} failed (run remove-node \
                     --node-id {old_node_id} again): {}",
                    f.message
                );
                f
            })?;
            emit(&ctx, json!({"added": node_id, "removed": old_node_id, "voters": voters}), || {
                format!("node {node_id} replaced node {old_node_id}; voters now: {voters:?}")
            });
            Ok(())
        }
        AdminCmd::TransferLeader { to } => Err(failure(
            EXIT_REFUSED,
            format!(
                "leadership transfer is not offered by the pinned openraft (0.9.25), so node {to} cannot be made leader \
                 directly; to move leadership off a node, restart it (kill -TERM, then start it again): the others \
                 elect a leader within about an election timeout, and clients follow (docs/operations.md)"
            ),
        )),
        AdminCmd::Participant(args) => {
            crate::admin_participant::run(args, ctx.json, ctx.timeout, ctx.tls.clone(), ctx.token.clone())
                .await
                .map_err(|(code, message)| failure(code, message))
        }
        AdminCmd::Snapshot => {
            let r = first_answer(&ctx, |ch| {
                let rq = dtx_client::request_with_token(pb::TriggerSnapshotRequest {}, ctx.token.as_deref());
                async move { AdminClient::new(ch).trigger_snapshot(rq).await }
            })
            .await?;
            emit(&ctx, json!({"snapshot_index": r.snapshot_index}), || {
                format!("snapshot built at log index {}", r.snapshot_index)
            });
            Ok(())
        }
        AdminCmd::Backup { out, opts } => {
            // A local path is checked here, before any node is asked, so
            // its error names no node.
            let folder = match out.parent() {
                Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                _ => PathBuf::from("."),
            };
            if !folder.is_dir() {
                return Err(failure(
                    EXIT_ERROR,
                    format!(
                        "--out {}: the folder {} does not exist on this machine (create it first); no node was asked",
                        out.display(),
                        folder.display()
                    ),
                ));
            }
            // The first address that answers; a failed attempt leaves no
            // file under `out`.
            let mut last = failure(EXIT_UNREACHABLE, "no address given");
            for addr in &ctx.addrs {
                match crate::backup::save(addr, ctx.tls.clone(), ctx.token.clone(), &out, opts).await {
                    Ok(summary) => {
                        emit(&ctx, json!({"file": out.display().to_string(), "summary": summary}), || {
                            summary.clone()
                        });
                        return Ok(());
                    }
                    Err(e) => last = backup_failure(addr, e),
                }
                if last.code != EXIT_UNREACHABLE {
                    break;
                }
            }
            Err(last)
        }
    }
}

/// A failed backup: unreachable when the cause is a gRPC UNAVAILABLE
/// (another address may answer), else what the status or error says.
fn backup_failure(addr: &str, e: anyhow::Error) -> Failure {
    match e.chain().find_map(|c| c.downcast_ref::<tonic::Status>()) {
        Some(s) => {
            let mut f = Failure::from(s.clone());
            f.message = format!("{addr}: {e:#}");
            f
        }
        // A local file error (the backup file or its folder): not the
        // node's doing, so the node is not named.
        None if e.chain().any(|c| {
            c.downcast_ref::<std::io::Error>().is_some()
                || matches!(
                    c.downcast_ref::<coordinator::backup::BackupError>(),
                    Some(coordinator::backup::BackupError::Exists { .. })
                )
        }) =>
        {
            failure(EXIT_ERROR, format!("on this machine: {e:#}"))
        }
        None => failure(EXIT_ERROR, format!("{addr}: {e:#}")),
    }
}

/// The first node of --addr that answers `f` (a call served where it
/// lands or forwarded by the node to the leader); the last failure if none
/// does.
async fn first_answer<T, F, Fut>(ctx: &Ctx, f: F) -> Result<T, Failure>
where
    F: Fn(dtx_transport::channel::Channel) -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let mut last = failure(EXIT_UNREACHABLE, "no address given");
    for addr in &ctx.addrs {
        let ch =
            dtx_transport::channel::channel_with(addr, None, ctx.timeout.min(Duration::from_secs(2)), ctx.tls.as_ref())
                .map_err(|e| failure(EXIT_USAGE, format!("--addr {addr}: {e}")))?;
        match tokio::time::timeout(ctx.timeout, f(ch)).await {
            Ok(Ok(r)) => return Ok(r.into_inner()),
            // Not reached, or refused for now (no leader, no quorum): ask
            // the next address. A refusal marked not applied is definite
            // (exit 3); a node not reached is exit 5.
            Ok(Err(s)) if s.code() == tonic::Code::Unavailable => {
                let refused = dtx_proto::metadata::not_applied(&s) && !dtx_transport::unary::nothing_sent(&s);
                // An earlier attempt's unknown outcome stands.
                if last.code != EXIT_UNKNOWN && (refused || last.code != EXIT_REFUSED) {
                    let code = if refused { EXIT_REFUSED } else { EXIT_UNREACHABLE };
                    last = failure(code, format!("{addr}: {}", dtx_client::describe(&s)));
                }
            }
            Ok(Err(s)) => {
                let mut f = Failure::from(s);
                f.message = format!("{addr}: {}", f.message);
                return Err(f);
            }
            Err(_) => {
                last = failure(
                    EXIT_UNKNOWN,
                    format!(
                        "{addr}: no answer within {:?} (a write may or may not have been applied)",
                        ctx.timeout
                    ),
                )
            }
        }
    }
    Err(last)
}

/// Adds a node through the first address that answers; the voters after.
async fn add_node(
    ctx: &Ctx,
    node_id: u64,
    raft_addr: String,
    api_addr: String,
    voter: bool,
) -> Result<Vec<u64>, Failure> {
    let r = first_answer(ctx, |ch| {
        let rq = dtx_client::request_with_token(
            pb::AddNodeRequest {
                node_id,
                raft_addr: raft_addr.clone(),
                api_addr: api_addr.clone(),
                voter,
            },
            ctx.token.as_deref(),
        );
        async move { AdminClient::new(ch).add_node(rq).await }
    })
    .await?;
    Ok(r.voters)
}

/// Removes a node through the first address that answers; the voters after.
async fn remove_node(ctx: &Ctx, node_id: u64) -> Result<Vec<u64>, Failure> {
    let r = first_answer(ctx, |ch| {
        let rq = dtx_client::request_with_token(pb::RemoveNodeRequest { node_id }, ctx.token.as_deref());
        async move { AdminClient::new(ch).remove_node(rq).await }
    })
    .await?;
    Ok(r.voters)
}

/// What `admin status` learned: the addressed node's own view (the first
/// of --addr that answered), the leader's (when it answers as leader),
/// each member's own answer, and the serving leader with a quorum, if any.
struct Gathered {
    addressed: pb::ClusterStatusResponse,
    leader: Option<pb::ClusterStatusResponse>,
    /// Why the leader the addressed node names gave no leader's view.
    leader_error: Option<String>,
    members: Vec<pb::NodeStatus>,
    answers: Vec<Result<pb::ClusterStatusResponse, String>>,
}

impl Gathered {
    /// The serving leader of the highest term among every answer: it has
    /// heard from a majority within the serving limit.
    fn quorum_leader(&self) -> Option<&pb::ClusterStatusResponse> {
        std::iter::once(&self.addressed)
            .chain(self.leader.as_ref())
            .chain(self.answers.iter().filter_map(|a| a.as_ref().ok()))
            .filter(|s| s.role == "Leader" && s.leader_id == s.node_id && s.serving)
            .max_by_key(|s| s.term)
    }

    /// One line: the cluster has a quorum (and which leader), or why not.
    fn quorum_line(&self) -> String {
        if let Some(l) = self.quorum_leader() {
            return format!(
                "quorum: yes (leader {} in term {} serves: it heard from a majority)",
                l.node_id, l.term
            );
        }
        let a = &self.addressed;
        let why = match (&self.leader, &self.leader_error) {
            _ if a.leader_id == 0 => format!("node {} knows no leader ({})", a.node_id, a.not_serving_reason),
            (Some(l), _) => format!("leader {} does not serve: {}", l.node_id, l.not_serving_reason),
            (None, Some(e)) => format!(
                "node {} names leader {}, which does not answer as leader: {e}",
                a.node_id, a.leader_id
            ),
            (None, None) => format!("no member answers as a serving leader ({})", a.not_serving_reason),
        };
        format!("NO QUORUM: {why}")
    }
}

async fn gather(ctx: &Ctx) -> Result<Gathered, Failure> {
    let addressed = ctx.client.cluster_status().await.map_err(Failure::from)?;
    // The leader's view has reach and lag: ask it when one is named.
    let (leader, leader_error) = if addressed.role == "Leader" && addressed.leader_id == addressed.node_id {
        (Some(addressed.clone()), None)
    } else if addressed.leader_api_addr.is_empty() {
        (None, None)
    } else {
        match member_status(ctx, &addressed.leader_api_addr).await {
            Ok(s) if s.role == "Leader" && s.leader_id == s.node_id => (Some(s), None),
            Ok(s) => (
                None,
                Some(format!(
                    "it answers as {} (term {}, leader {})",
                    s.role,
                    s.term,
                    if s.leader_id == 0 {
                        "none known".to_string()
                    } else {
                        s.leader_id.to_string()
                    }
                )),
            ),
            Err(e) => (None, Some(e)),
        }
    };
    let members = leader.as_ref().unwrap_or(&addressed).members.clone();
    let answers = futures_join_all(ctx, &members).await;
    Ok(Gathered {
        addressed,
        leader,
        leader_error,
        members,
        answers,
    })
}

/// `admin status`: the addressed node's view, the leader's view of the
/// members (reach, lag) beside each member's own answer (each bounded by
/// the timeout, all at once). Exit 6 without a serving leader.
async fn status(ctx: &Ctx) -> Outcome {
    let g = gather(ctx).await?;
    let quorum = g.quorum_leader().is_some();
    if ctx.json {
        let nodes: Vec<serde_json::Value> = g
            .members
            .iter()
            .zip(&g.answers)
            .map(|(m, a)| match a {
                Ok(s) => json!({"node_id": m.node_id, "status": view::status_json(s)}),
                Err(e) => json!({"node_id": m.node_id, "error": e}),
            })
            .collect();
        // The top level is the addressed node's own view (`--addr X`
        // describes X); the leader's is under "leader".
        let mut v = view::status_json(&g.addressed);
        v["quorum"] = quorum.into();
        v["quorum_line"] = g.quorum_line().into();
        v["leader"] = g
            .leader
            .as_ref()
            .map(view::status_json)
            .unwrap_or(serde_json::Value::Null);
        v["nodes"] = serde_json::Value::Array(nodes);
        outln!("{}", serde_json::to_string_pretty(&v).expect("JSON"));
    } else {
        let views: Vec<view::MemberView<'_>> = g
            .members
            .iter()
            .zip(&g.answers)
            .map(|(m, a)| view::MemberView {
                member: m,
                own: a.as_ref().map_err(|e| e.clone()),
            })
            .collect();
        outln!(
            "{}",
            view::status_table(&g.addressed, g.leader.as_ref(), &g.quorum_line(), &views)
        );
    }
    if quorum {
        Ok(())
    } else {
        Err(failure(EXIT_UNHEALTHY, g.quorum_line()))
    }
}

/// `admin status --check quorum`: one line; exit 0 with a serving leader,
/// 6 without.
async fn check_quorum(ctx: &Ctx) -> Outcome {
    let g = gather(ctx).await?;
    let leader = g.quorum_leader();
    emit(
        ctx,
        json!({"check": "quorum", "ok": leader.is_some(), "leader_id": leader.map(|l| l.node_id),
            "term": leader.map(|l| l.term), "line": g.quorum_line()}),
        || g.quorum_line(),
    );
    match leader {
        Some(_) => Ok(()),
        None => Err(failure(EXIT_UNHEALTHY, g.quorum_line())),
    }
}

/// `admin status --check serving`: each node of --addr asked itself; exit
/// 0 when every one serves, 6 when one answered that it does not, 5 when
/// one did not answer (and none said it does not serve).
async fn check_serving(ctx: &Ctx) -> Outcome {
    let mut rows = Vec::new();
    let (mut not_serving, mut silent) = (0, 0);
    for addr in &ctx.addrs {
        match member_status(ctx, addr).await {
            Ok(s) if s.serving => {
                rows.push((
                    json!({"addr": addr, "node_id": s.node_id, "serving": true, "role": s.role, "term": s.term}),
                    format!("{addr}: node {} serves ({}, term {})", s.node_id, s.role, s.term),
                ));
            }
            Ok(s) => {
                not_serving += 1;
                rows.push((
                    json!({"addr": addr, "node_id": s.node_id, "serving": false, "role": s.role, "term": s.term,
                        "not_serving_reason": s.not_serving_reason}),
                    format!(
                        "{addr}: node {} does NOT serve ({}, term {}): {}",
                        s.node_id, s.role, s.term, s.not_serving_reason
                    ),
                ));
            }
            Err(e) => {
                silent += 1;
                rows.push((
                    json!({"addr": addr, "serving": false, "error": e}),
                    format!("{addr}: no answer: {e}"),
                ));
            }
        }
    }
    let ok = not_serving == 0 && silent == 0;
    emit(
        ctx,
        json!({"check": "serving", "ok": ok, "nodes": rows.iter().map(|r| r.0.clone()).collect::<Vec<_>>()}),
        || rows.iter().map(|r| r.1.as_str()).collect::<Vec<_>>().join("\n"),
    );
    if not_serving > 0 {
        Err(failure(
            EXIT_UNHEALTHY,
            format!("{not_serving} of {} node(s) do not serve", ctx.addrs.len()),
        ))
    } else if silent > 0 {
        Err(failure(
            EXIT_UNREACHABLE,
            format!("{silent} of {} node(s) did not answer", ctx.addrs.len()),
        ))
    } else {
        Ok(())
    }
}

async fn member_status(ctx: &Ctx, addr: &str) -> Result<pb::ClusterStatusResponse, String> {
    dtx_client::cluster_status_as(
        addr,
        ctx.timeout.min(Duration::from_secs(3)),
        ctx.tls.as_ref(),
        ctx.token.as_deref(),
    )
    .await
    .map_err(|s| format!("{:?}: {}", s.code(), dtx_client::describe(&s)))
}

async fn futures_join_all(ctx: &Ctx, members: &[pb::NodeStatus]) -> Vec<Result<pb::ClusterStatusResponse, String>> {
    let mut tasks = tokio::task::JoinSet::new();
    for (i, m) in members.iter().enumerate() {
        let addr = m.api_addr.clone();
        let (timeout, tls, token) = (
            ctx.timeout.min(Duration::from_secs(3)),
            ctx.tls.clone(),
            ctx.token.clone(),
        );
        tasks.spawn(async move {
            let r = dtx_client::cluster_status_as(&addr, timeout, tls.as_ref(), token.as_deref())
                .await
                .map_err(|s| format!("{:?}: {}", s.code(), dtx_client::describe(&s)));
            (i, r)
        });
    }
    let mut out: Vec<Result<pb::ClusterStatusResponse, String>> =
        members.iter().map(|_| Err("not asked".to_string())).collect();
    while let Some(Ok((i, r))) = tasks.join_next().await {
        out[i] = r;
    }
    out
}

/// One page of `req` (the retrying client: follows the leader, rides out
/// an election within the timeout).
async fn list_page(ctx: &Ctx, req: pb::ListTransactionsRequest) -> Result<pb::ListTransactionsResponse, Failure> {
    Ok(ctx.client.list_transactions(req).await?)
}

async fn txn(ctx: &Ctx, cmd: TxnCmd) -> Outcome {
    match cmd {
        TxnCmd::List {
            state,
            older_than_s,
            participant,
            unacknowledged,
            dropped,
            after,
            limit,
            all,
        } => {
            let state = match state.as_deref() {
                Some("active") => pb::TxState::Active,
                Some("preparing") => pb::TxState::Preparing,
                Some("decided") => pb::TxState::Decided,
                _ => pb::TxState::Unspecified,
            };
            let min_age_ms = match older_than_s {
                Some(s) if s.is_finite() && s >= 0.0 => (s * 1000.0) as u64,
                Some(s) => {
                    return Err(failure(
                        EXIT_USAGE,
                        format!("--older-than-s must be 0 or more seconds, not {s}"),
                    ))
                }
                None => 0,
            };
            let req = pb::ListTransactionsRequest {
                state: state as i32,
                min_age_ms,
                participant: participant.unwrap_or_default(),
                unacknowledged,
                dropped,
                after_txid: after,
                limit,
            };
            let (txs, now, next) = if all {
                let (txs, now) = list_all(ctx, req).await?;
                (txs, now, 0)
            } else {
                let page = list_page(ctx, req).await?;
                (page.transactions, page.now_unix_ms, page.next_after_txid)
            };
            if ctx.json {
                let v = json!({
                    "now_unix_ms": now,
                    "next_after_txid": next,
                    "transactions": txs.iter().map(view::tx_json).collect::<Vec<_>>(),
                });
                outln!("{}", serde_json::to_string_pretty(&v).expect("JSON"));
            } else {
                outln!("{}", view::tx_table(&txs, now));
                if next != 0 {
                    outln!("(more: --after {next}, or --all)");
                } else {
                    outln!("({} transactions)", txs.len());
                }
            }
            Ok(())
        }
        TxnCmd::Show { txid } => {
            let page = list_page(
                ctx,
                pb::ListTransactionsRequest {
                    after_txid: txid.saturating_sub(1),
                    limit: 1,
                    ..Default::default()
                },
            )
            .await?;
            let Some(t) = page.transactions.into_iter().find(|t| t.txid == txid) else {
                return Err(failure(
                    EXIT_REFUSED,
                    format!(
                        "transaction {txid} not found: never begun here, or forgotten (after every participant \
                         acked, or by an operator's txn forget, which drops a record once every participant acked \
                         or was dropped); a participant asking about it is told: unknown, presumed abort"
                    ),
                ));
            };
            emit(ctx, view::tx_json(&t), || view::tx_timeline(&t, page.now_unix_ms));
            Ok(())
        }
        TxnCmd::InDoubt => {
            let (mut txs, now) = list_all(
                ctx,
                pb::ListTransactionsRequest {
                    state: pb::TxState::Preparing as i32,
                    limit: 1000,
                    ..Default::default()
                },
            )
            .await?;
            let (unacked, now2) = list_all(
                ctx,
                pb::ListTransactionsRequest {
                    unacknowledged: true,
                    limit: 1000,
                    ..Default::default()
                },
            )
            .await?;
            txs.extend(unacked);
            txs.sort_by_key(|t| (t.begun_unix_ms, t.txid));
            let now = now.max(now2);
            if ctx.json {
                let v: Vec<serde_json::Value> = txs
                    .iter()
                    .map(|t| {
                        let mut v = view::tx_json(t);
                        v["age_ms"] = now.saturating_sub(t.begun_unix_ms).into();
                        v["waiting"] = view::waiting_on(t)
                            .iter()
                            .map(|p| p.id.clone())
                            .collect::<Vec<_>>()
                            .into();
                        v
                    })
                    .collect();
                outln!(
                    "{}",
                    serde_json::to_string_pretty(&json!({"now_unix_ms": now, "in_doubt": v})).expect("JSON")
                );
            } else if txs.is_empty() {
                outln!("nothing in doubt: no transaction is preparing and every decision is acknowledged");
            } else {
                outln!("{}", view::tx_table(&txs, now));
                outln!("({} transactions, oldest first)", txs.len());
            }
            Ok(())
        }
        TxnCmd::Resolve {
            txid,
            commit,
            abort: _,
            voters,
            participant_lost,
            who,
        } => {
            let asked = if commit {
                TxOutcome::Committed
            } else {
                TxOutcome::Aborted
            };
            let (outcome, recorded) = if participant_lost {
                ctx.client
                    .declare_lost(txid, commit, &who.operator(), &who.reason)
                    .await?
            } else {
                ctx.client
                    .resolve(txid, commit, &voters, &who.operator(), &who.reason)
                    .await?
            };
            let name = |o: TxOutcome| match o {
                TxOutcome::Committed => "COMMIT",
                TxOutcome::Aborted => "ABORT",
                TxOutcome::Unknown => "UNKNOWN",
            };
            let v = json!({"txid": txid, "outcome": name(outcome), "recorded": recorded});
            if recorded {
                emit(ctx, v, || format!("recorded {} for transaction {txid}", name(outcome)));
                Ok(())
            } else if outcome == asked {
                emit(ctx, v, || {
                    format!(
                        "transaction {txid} was already decided {} (as asked; nothing changed)",
                        name(outcome)
                    )
                });
                Ok(())
            } else {
                if ctx.json {
                    outln!("{}", serde_json::to_string_pretty(&v).expect("JSON"));
                }
                Err(failure(
                    EXIT_REFUSED,
                    format!(
                        "transaction {txid} was already decided {}; decisions are write-once, so your {} was not \
                         recorded (txn show {txid} says who decided and why)",
                        name(outcome),
                        name(asked)
                    ),
                ))
            }
        }
        TxnCmd::SettleOther {
            incarnation,
            txid,
            commit,
            abort: _,
            participants,
            who,
        } => settle_other(ctx, incarnation, txid, commit, &participants, &who).await,
        TxnCmd::DropParticipant {
            txid,
            participant,
            participant_flag,
            bulk,
            who,
        } => {
            let Some(participant) = participant.or(participant_flag) else {
                return Err(failure(EXIT_USAGE, "name the participant (--participant X)"));
            };
            match txid {
                Some(txid) => drop_one(ctx, txid, &participant, &who).await,
                None => {
                    crate::admin_bulk::drop_all(ctx, &participant, bulk.dry_run, &who.operator(), &who.reason).await
                }
            }
        }
        TxnCmd::Forget {
            txid,
            participant,
            bulk,
            who,
        } => match (txid, participant) {
            (Some(txid), _) => forget_one(ctx, txid, &who).await,
            (None, Some(p)) => crate::admin_bulk::forget_all(ctx, &p, bulk.dry_run, &who.operator(), &who.reason).await,
            (None, None) => Err(failure(
                EXIT_USAGE,
                "--all forgets the transactions of one participant: give --participant X",
            )),
        },
        TxnCmd::Begin { key, timeout_ms } => {
            let b = ctx.client.begin(&key, timeout_ms, b"").await?;
            emit(
                ctx,
                json!({"txid": b.txid, "existing": b.existing, "deadline_unix_ms": b.deadline_unix_ms}),
                || {
                    format!(
                        "transaction {}{} (deadline {})",
                        b.txid,
                        if b.existing { ", begun before with this key" } else { "" },
                        view::utc(b.deadline_unix_ms)
                    )
                },
            );
            Ok(())
        }
        TxnCmd::Enlist {
            txid,
            participant,
            address,
            payload,
        } => {
            ctx.client
                .enlist(txid, &participant, &address, payload.as_bytes())
                .await?;
            emit(ctx, json!({"txid": txid, "enlisted": participant}), || {
                format!("{participant} enlisted in transaction {txid}")
            });
            Ok(())
        }
        TxnCmd::Commit { txid } => decided(ctx, txid, ctx.client.commit(txid).await?),
        TxnCmd::Abort { txid, reason } => decided(ctx, txid, ctx.client.abort(txid, &reason).await?),
    }
}

/// A `--participant ID=ADDR` of `txn settle-other`.
fn parse_participant(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((id, addr)) if !id.trim().is_empty() && !addr.trim().is_empty() => {
            Ok((id.trim().to_string(), addr.trim().to_string()))
        }
        _ => Err(format!(
            "{s:?} is not ID=ADDR: give the participant's id as enlisted and where its service answers, for \
             example bank-b=10.0.2.5:7301"
        )),
    }
}

/// `txn settle-other` (ADR 0040): a settlement recorded, or the one that
/// stands read back (exit 0 when it is the outcome asked, 3 otherwise).
async fn settle_other(
    ctx: &Ctx,
    incarnation: u64,
    txid: u64,
    commit: bool,
    participants: &[(String, String)],
    who: &Who,
) -> Outcome {
    let r = ctx
        .client
        .settle_other(incarnation, txid, commit, participants, &who.operator(), &who.reason)
        .await?;
    let name = |o: i32| match pb::Outcome::try_from(o) {
        Ok(pb::Outcome::Commit) => "COMMIT",
        Ok(pb::Outcome::Abort) => "ABORT",
        _ => "UNKNOWN",
    };
    let asked = if commit { "COMMIT" } else { "ABORT" };
    let got = name(r.outcome);
    let inc = format!("{incarnation:016x}");
    let v = json!({"incarnation": inc, "txid": txid, "outcome": got, "recorded": r.recorded,
        "note": r.note, "settled_unix_ms": r.settled_unix_ms, "term": r.term});
    if r.recorded {
        emit(ctx, v, || {
            format!(
                "recorded {got} for txid {txid} of incarnation {inc}: participants' recovery applies it \
                 (admin participant --address P --in-doubt no longer lists it once applied)\n  note: {}",
                r.note
            )
        });
        Ok(())
    } else if got == asked {
        emit(ctx, v, || {
            format!(
                "txid {txid} of incarnation {inc} was already settled {got} (as asked; nothing changed), in term \
                 {} at {}\n  note: {}",
                r.term,
                view::utc(r.settled_unix_ms),
                r.note
            )
        });
        Ok(())
    } else {
        if ctx.json {
            outln!("{}", serde_json::to_string_pretty(&v).expect("JSON"));
        }
        Err(failure(
            EXIT_REFUSED,
            format!(
                "txid {txid} of incarnation {inc} was already settled {got} (in term {} at {}: {}); settlements \
                 are write-once, so your {asked} was not recorded",
                r.term,
                view::utc(r.settled_unix_ms),
                r.note
            ),
        ))
    }
}

async fn drop_one(ctx: &Ctx, txid: u64, participant: &str, who: &Who) -> Outcome {
    let r = ctx
        .client
        .drop_participant(txid, participant, &who.operator(), &who.reason)
        .await?;
    let v = json!({"txid": txid, "participant": participant, "recorded": r.recorded,
        "transaction": r.transaction.as_ref().map(view::tx_json)});
    emit(ctx, v, || {
        if r.recorded {
            format!(
                "participant {participant} dropped from phase two of transaction {txid}: the decision must be \
                 applied there by hand (txn show {txid})"
            )
        } else {
            format!("participant {participant} of transaction {txid} was dropped before (nothing changed)")
        }
    });
    Ok(())
}

async fn forget_one(ctx: &Ctx, txid: u64, who: &Who) -> Outcome {
    let forgotten = ctx
        .client
        .forget_transaction(txid, &who.operator(), &who.reason)
        .await?;
    emit(ctx, json!({"txid": txid, "forgotten": forgotten}), || {
        if forgotten {
            format!("transaction {txid} forgotten")
        } else {
            format!("transaction {txid} has no record (never begun, or forgotten before); nothing changed")
        }
    });
    Ok(())
}

/// Prints a commit's or abort's answer; UNKNOWN is its own exit code.
fn decided(ctx: &Ctx, txid: u64, o: TxOutcome) -> Outcome {
    let name = match o {
        TxOutcome::Committed => "COMMITTED",
        TxOutcome::Aborted => "ABORTED",
        TxOutcome::Unknown => "UNKNOWN",
    };
    emit(ctx, json!({"txid": txid, "outcome": name}), || {
        format!("transaction {txid}: {name}")
    });
    if o == TxOutcome::Unknown {
        return Err(failure(
            EXIT_UNKNOWN,
            format!("the outcome of transaction {txid} is not known yet (it may still commit): txn show {txid}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod settle_other_tests {
    use super::parse_participant;

    /// `--participant ID=ADDR`: both parts required, and a bad one says
    /// what was wrong.
    #[test]
    fn a_participant_is_id_equals_address() {
        assert_eq!(
            parse_participant("bank-b=10.0.2.5:7301").unwrap(),
            ("bank-b".to_string(), "10.0.2.5:7301".to_string())
        );
        for bad in ["bank-b", "=10.0.2.5:7301", "bank-b=", " = "] {
            let e = parse_participant(bad).unwrap_err();
            assert!(e.contains("is not ID=ADDR"), "{bad}: {e}");
        }
    }
}
