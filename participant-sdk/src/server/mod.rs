//! The gRPC server of `dtx.v1.ParticipantService` on a [`Participant`]
//! (the sled `ParticipantStore`, or the PostgreSQL participant), and
//! recovery: asking the cluster for the decisions of in-doubt
//! transactions and applying them.

use std::sync::Arc;
use std::time::Duration;

use dtx_client::Client;
use dtx_client::ClientConfig;
use dtx_client::DecisionAnswer;
use dtx_client::DecisionRead;
use dtx_proto::v1 as pb;
use dtx_proto::v1::participant_service_server::ParticipantService;
use tonic::Request;
use tonic::Response;
use tonic::Status;
use tracing::error;
use tracing::info;
use tracing::warn;

use crate::log::GlobalTxid;
use crate::log::LocalState;
use crate::log::LogEntry;
use crate::log::Message;
use crate::log::Refusal;
use crate::log::Vote;
use crate::participant::Answer;
use crate::participant::InspectQuery;
use crate::participant::InspectedRecord;
use crate::participant::Participant;
use crate::participant::Verdict;
use crate::store::PhaseTwo;
use crate::store::Reply;
use crate::store::StoreError;

pub struct ParticipantServer<P: Participant> {
    store: Arc<P>,
    participant_id: String,
}

impl<P: Participant> ParticipantServer<P> {
    pub fn new(store: Arc<P>, participant_id: &str) -> Self {
        ParticipantServer {
            store,
            participant_id: participant_id.to_string(),
        }
    }

    fn check_target(&self, id: &str) -> Result<(), Status> {
        if !id.is_empty() && id != self.participant_id {
            return Err(Status::invalid_argument(format!(
                "message for participant {id:?} reached participant {:?}",
                self.participant_id
            )));
        }
        Ok(())
    }

    /// The decisions of one message (`ApplyDecisions`, or those riding in a
    /// `PrepareMany`), checked: at most
    /// `limits::DECISION_DELIVERY_ITEMS_MAX` (else the whole message is
    /// refused), and an item without an outcome or for another participant
    /// answered alone. Returns each item's answer where it has one already
    /// (`None`: the store answers it) and the items for the store, in order.
    #[allow(clippy::type_complexity)]
    fn check_decisions(
        &self,
        items: &[pb::DecisionItem],
        message: &str,
    ) -> Result<(Vec<Option<Result<(), Status>>>, Vec<(GlobalTxid, PhaseTwo)>), Status> {
        let max = dtx_proto::limits::DECISION_DELIVERY_ITEMS_MAX;
        if items.len() > max {
            return Err(Status::invalid_argument(format!(
                "{} decisions in one {message} message; at most {max}",
                items.len()
            )));
        }
        let mut answers = Vec::with_capacity(items.len());
        let mut valid = Vec::with_capacity(items.len());
        for it in items {
            let decision = match pb::DecisionOutcome::try_from(it.outcome) {
                Ok(pb::DecisionOutcome::Commit) => PhaseTwo::Commit { term: it.term },
                Ok(pb::DecisionOutcome::Abort) => PhaseTwo::Abort { term: it.term },
                _ => {
                    answers.push(Some(Err(Status::invalid_argument(format!(
                        "decision item for transaction {} has no outcome (value {})",
                        it.txid, it.outcome
                    )))));
                    continue;
                }
            };
            if let Err(s) = self.check_target(&it.participant_id) {
                answers.push(Some(Err(s)));
                continue;
            }
            answers.push(None);
            valid.push((GlobalTxid::new(it.incarnation, it.txid), decision));
        }
        Ok((answers, valid))
    }

    async fn run(&self, txid: GlobalTxid, msg: Message, payload: &[u8]) -> Result<Answer, Status> {
        self.store
            .handle(txid, msg, payload)
            .await
            .map_err(|e| message_status(txid, e))
    }
}

/// The gRPC status of one message's failure: a refusal (logged: at info
/// for fencing, at warn for a protocol violation) or a store error.
fn message_status(txid: GlobalTxid, e: StoreError) -> Status {
    match e {
        StoreError::Refused(r) => {
            match r {
                Refusal::StaleTerm { .. } => info!(txid = txid.txid, incarnation = txid.incarnation, "refused: {r}"),
                _ => warn!(
                    txid = txid.txid,
                    incarnation = txid.incarnation,
                    "protocol violation refused: {r}"
                ),
            }
            refusal_status(&r)
        }
        other => store_status(other),
    }
}

/// One ApplyDecisions item's result: what its own Commit or Abort call
/// would have answered (`applied`, or the status it would have failed
/// with, its code, refusal kind and text).
fn item_result(answer: Result<(), Status>) -> pb::DecisionItemResult {
    match answer {
        Ok(()) => pb::DecisionItemResult {
            applied: true,
            code: tonic::Code::Ok as i32,
            refusal: String::new(),
            message: String::new(),
        },
        Err(s) => pb::DecisionItemResult {
            applied: false,
            code: s.code() as i32,
            refusal: dtx_proto::metadata::refusal(&s)
                .map(|k| k.as_str().to_string())
                .unwrap_or_default(),
            message: s.message().to_string(),
        },
    }
}

/// Each decision item's result, in order: its answer from the checks
/// (`Some`), or the store's result for it (the `None`s, in the order of
/// `valid`).
fn decision_results(
    answers: Vec<Option<Result<(), Status>>>,
    valid: &[(GlobalTxid, PhaseTwo)],
    applied: Vec<Result<(), StoreError>>,
) -> Vec<pb::DecisionItemResult> {
    let mut applied = valid.iter().zip(applied);
    answers
        .into_iter()
        .map(|a| {
            item_result(a.unwrap_or_else(|| match applied.next() {
                Some(((txid, _), r)) => r.map_err(|e| message_status(*txid, e)),
                None => Err(Status::internal("the store answered fewer items than it was given")),
            }))
        })
        .collect()
}

/// One PrepareMany item's result: what its own Prepare call would have
/// answered (the vote and its reason, or the status it would have failed
/// with, its code, refusal kind and text).
fn prepare_item_result(answer: Result<Verdict, Status>) -> pb::PrepareItemResult {
    match answer {
        Ok(v) => {
            let r = prepare_response(v);
            pb::PrepareItemResult {
                vote: r.vote,
                reason: r.reason,
                code: tonic::Code::Ok as i32,
                refusal: String::new(),
                message: String::new(),
            }
        }
        Err(s) => pb::PrepareItemResult {
            vote: pb::Vote::Unspecified as i32,
            reason: String::new(),
            code: s.code() as i32,
            refusal: dtx_proto::metadata::refusal(&s)
                .map(|k| k.as_str().to_string())
                .unwrap_or_default(),
            message: s.message().to_string(),
        },
    }
}

/// The answer to a Prepare that voted `v` (the reason only with NO).
fn prepare_response(v: Verdict) -> pb::PrepareResponse {
    pb::PrepareResponse {
        vote: vote_pb(v.vote) as i32,
        reason: if v.vote == Vote::No { v.reason } else { String::new() },
    }
}

/// The gRPC status of a refused message: FAILED_PRECONDITION, the reason
/// in the message for humans and its kind under `x-dtx-refusal` for the
/// coordinator, which reads the kind and never the text.
fn refusal_status(r: &Refusal) -> Status {
    use dtx_proto::metadata::RefusalKind;
    let kind = match r {
        Refusal::StaleTerm { .. } => RefusalKind::StaleTerm,
        Refusal::CommitWithoutPrepare => RefusalKind::CommitWithoutPrepare,
        Refusal::CommitAfterAbort => RefusalKind::CommitAfterAbort,
        Refusal::AbortAfterCommit => RefusalKind::AbortAfterCommit,
    };
    let mut status = Status::failed_precondition(r.to_string());
    dtx_proto::metadata::set_refusal(&mut status, kind);
    status
}

/// The gRPC status of a store error other than a refusal: a stopped store
/// is RESOURCE_EXHAUSTED when its disk is full (the gRPC code for an
/// exhausted file system) and UNAVAILABLE otherwise; the coordinator
/// retries both later (a restarted participant answers), and a Prepare it
/// could not get counts as no YES vote.
fn store_status(e: StoreError) -> Status {
    match e {
        StoreError::Stopped(f) if f.disk_full => Status::resource_exhausted(f.to_string()),
        StoreError::Stopped(f) => Status::unavailable(f.to_string()),
        StoreError::Unavailable(m) => Status::unavailable(m),
        other => Status::internal(other.to_string()),
    }
}

fn vote_pb(v: Vote) -> pb::Vote {
    match v {
        Vote::Yes => pb::Vote::Yes,
        Vote::No => pb::Vote::No,
        Vote::ReadOnly => pb::Vote::ReadOnly,
    }
}

#[tonic::async_trait]
impl<P: Participant> ParticipantService for ParticipantServer<P> {
    async fn prepare(&self, req: Request<pb::PrepareRequest>) -> Result<Response<pb::PrepareResponse>, Status> {
        let r = req.into_inner();
        self.check_target(&r.participant_id)?;
        let txid = GlobalTxid::new(r.incarnation, r.txid);
        let answer = self.run(txid, Message::Prepare { term: r.term }, &r.payload).await?;
        match answer.reply {
            Reply::Vote(vote) => Ok(Response::new(prepare_response(Verdict {
                vote,
                reason: answer.reason,
            }))),
            Reply::Ack => Err(Status::internal("prepare answered with an ack")),
        }
    }

    async fn commit_one_phase(
        &self,
        req: Request<pb::PrepareRequest>,
    ) -> Result<Response<pb::OnePhaseResponse>, Status> {
        let r = req.into_inner();
        self.check_target(&r.participant_id)?;
        let txid = GlobalTxid::new(r.incarnation, r.txid);
        let answer = self
            .run(txid, Message::CommitOnePhase { term: r.term }, &r.payload)
            .await?;
        match answer.reply {
            Reply::Ack => Ok(Response::new(pb::OnePhaseResponse {
                committed: true,
                reason: String::new(),
            })),
            Reply::Vote(Vote::No) => Ok(Response::new(pb::OnePhaseResponse {
                committed: false,
                reason: answer.reason,
            })),
            Reply::Vote(v) => Err(Status::internal(format!("one-phase commit answered with vote {v:?}"))),
        }
    }

    async fn commit(
        &self,
        req: Request<pb::ParticipantDecisionRequest>,
    ) -> Result<Response<pb::ParticipantDecisionResponse>, Status> {
        let r = req.into_inner();
        self.check_target(&r.participant_id)?;
        let txid = GlobalTxid::new(r.incarnation, r.txid);
        self.run(txid, Message::Commit { term: r.term }, b"").await?;
        Ok(Response::new(pb::ParticipantDecisionResponse { applied: true }))
    }

    async fn abort(
        &self,
        req: Request<pb::ParticipantDecisionRequest>,
    ) -> Result<Response<pb::ParticipantDecisionResponse>, Status> {
        let r = req.into_inner();
        self.check_target(&r.participant_id)?;
        let txid = GlobalTxid::new(r.incarnation, r.txid);
        self.run(txid, Message::Abort { term: r.term }, b"").await?;
        Ok(Response::new(pb::ParticipantDecisionResponse { applied: true }))
    }

    async fn apply_decisions(
        &self,
        req: Request<pb::ApplyDecisionsRequest>,
    ) -> Result<Response<pb::ApplyDecisionsResponse>, Status> {
        let items = req.into_inner().items;
        let (answers, valid) = self.check_decisions(&items, "ApplyDecisions")?;
        let applied = self.store.apply_decisions(&valid).await.map_err(store_status)?;
        let results = decision_results(answers, &valid, applied);
        Ok(Response::new(pb::ApplyDecisionsResponse { results }))
    }

    async fn prepare_many(
        &self,
        req: Request<pb::PrepareManyRequest>,
    ) -> Result<Response<pb::PrepareManyResponse>, Status> {
        let r = req.into_inner();
        let (items, decisions) = (r.items, r.decisions);
        let max = dtx_proto::limits::PREPARE_GROUP_ITEMS_MAX;
        if items.len() > max {
            return Err(Status::invalid_argument(format!(
                "{} prepares in one PrepareMany message; at most {max}",
                items.len()
            )));
        }
        // Decisions riding along (ADR 0030) are checked as ApplyDecisions
        // checks them.
        let (decision_answers, valid_decisions) = self.check_decisions(&decisions, "PrepareMany")?;
        // Items for another participant are answered alone, as their own
        // Prepare would be; the rest go to the store in one write (with the
        // decisions, before the prepares).
        let mut answers: Vec<Option<Result<Verdict, Status>>> = Vec::with_capacity(items.len());
        let mut valid = Vec::with_capacity(items.len());
        for it in &items {
            if let Err(s) = self.check_target(&it.participant_id) {
                answers.push(Some(Err(s)));
                continue;
            }
            answers.push(None);
            valid.push((GlobalTxid::new(it.incarnation, it.txid), it.term, it.payload.as_slice()));
        }
        let (applied, votes) = self
            .store
            .apply_then_prepare(&valid_decisions, &valid)
            .await
            .map_err(store_status)?;
        let decision_results = decision_results(decision_answers, &valid_decisions, applied);
        let mut votes = valid.iter().zip(votes);
        let results = answers
            .into_iter()
            .map(|a| {
                prepare_item_result(a.unwrap_or_else(|| match votes.next() {
                    Some(((txid, _, _), r)) => r.map_err(|e| message_status(*txid, e)),
                    None => Err(Status::internal("the store answered fewer items than it was given")),
                }))
            })
            .collect();
        Ok(Response::new(pb::PrepareManyResponse {
            results,
            decision_results,
        }))
    }

    async fn inquire(&self, req: Request<pb::InquireRequest>) -> Result<Response<pb::InquireResponse>, Status> {
        let r = req.into_inner();
        self.check_target(&r.participant_id)?;
        // Only what is durable: a record whose write is still being synced
        // (or failed) is not answered.
        let txid = GlobalTxid::new(r.incarnation, r.txid);
        let entry = self.store.durable_entry(txid).await.map_err(store_status)?;
        Ok(Response::new(pb::InquireResponse {
            record: local_record(entry) as i32,
            term: entry.map(|e| e.term).unwrap_or(0),
        }))
    }

    async fn inspect(
        &self,
        req: Request<pb::InspectParticipantRequest>,
    ) -> Result<Response<pb::InspectParticipantResponse>, Status> {
        let r = req.into_inner();
        let max = dtx_proto::limits::INSPECT_RECORDS_MAX;
        if r.txids.len() > max {
            return Err(Status::invalid_argument(format!(
                "{} txids in one Inspect call; at most {max} (limits::INSPECT_RECORDS_MAX)",
                r.txids.len()
            )));
        }
        if r.recent as usize > max {
            return Err(Status::invalid_argument(format!(
                "{} recent records asked of one Inspect call; at most {max} (limits::INSPECT_RECORDS_MAX)",
                r.recent
            )));
        }
        let query = InspectQuery {
            txids: r.txids.iter().map(|&t| GlobalTxid::new(r.incarnation, t)).collect(),
            in_doubt: r.in_doubt,
            recent: r.recent as usize,
            list_max: max,
        };
        let found = self.store.inspect(&query).await.map_err(store_status)?;
        let list = |v: Vec<InspectedRecord>| v.into_iter().map(record_pb).collect();
        Ok(Response::new(pb::InspectParticipantResponse {
            participant_id: self.participant_id.clone(),
            records: list(found.records),
            in_doubt: list(found.in_doubt),
            recent: list(found.recent),
            in_doubt_count: found.in_doubt_summary.count as u64,
            records_total: found.records_total,
            oldest_in_doubt_age_ms: found
                .in_doubt_summary
                .oldest_age
                .map(|a| a.as_millis().min(u64::MAX as u128) as u64)
                .unwrap_or(0),
            now_unix_ms: crate::store::unix_ms(),
        }))
    }
}

/// The wire form of a log record's state (Inquire, Inspect).
fn local_record(entry: Option<LogEntry>) -> pb::LocalRecord {
    match entry.map(|e| e.state) {
        None => pb::LocalRecord::None,
        Some(LocalState::Prepared { vote: Vote::Yes }) => pb::LocalRecord::PreparedYes,
        Some(LocalState::Prepared { vote: Vote::ReadOnly }) => pb::LocalRecord::PreparedReadOnly,
        // A NO vote is recorded as aborted (its work is rolled back).
        Some(LocalState::Prepared { vote: Vote::No }) | Some(LocalState::Aborted { tombstone: false }) => {
            pb::LocalRecord::Aborted
        }
        Some(LocalState::Committed) => pb::LocalRecord::Committed,
        Some(LocalState::Aborted { tombstone: true }) => pb::LocalRecord::Tombstone,
    }
}

/// The vote a record tells of (see `ParticipantRecord.vote`): YES for a
/// YES vote and for COMMITTED, READ_ONLY and NO as recorded; none for an
/// abort (NO vote or ABORT after YES: the log does not say), a tombstone
/// (no vote) or no record.
fn recorded_vote(entry: Option<LogEntry>) -> pb::Vote {
    match entry.map(|e| e.state) {
        Some(LocalState::Prepared { vote }) => vote_pb(vote),
        Some(LocalState::Committed) => pb::Vote::Yes,
        Some(LocalState::Aborted { .. }) | None => pb::Vote::Unspecified,
    }
}

/// One record of an Inspect answer.
fn record_pb(r: InspectedRecord) -> pb::ParticipantRecord {
    pb::ParticipantRecord {
        txid: r.txid.txid,
        incarnation: r.txid.incarnation,
        record: local_record(r.entry) as i32,
        vote: recorded_vote(r.entry) as i32,
        term: r.entry.map(|e| e.term).unwrap_or(0),
        recorded_unix_ms: r.recorded_unix_ms.unwrap_or(0),
        in_doubt: r.entry.as_ref().is_some_and(crate::log::in_doubt),
    }
}

/// Asks the cluster (any node of `endpoints`; reads are linearizable and
/// forwarded to the leader) for the decisions of every in-doubt transaction
/// and applies the known ones. Returns how many were resolved; undecided
/// ones stay in doubt with their locks held (invariant 5). An error means
/// the cluster could not be asked (no quorum): keep waiting and retry.
/// Asks with the [`RecoveryOptions::client_config`] of the default options.
pub async fn recover_once<P: Participant>(store: &P, endpoints: &[String]) -> Result<usize, String> {
    recover_older_than(store, endpoints, Duration::ZERO, None).await
}

/// `recover_once` for the in-doubt transactions whose YES vote is at least
/// `age_min` old (see `ParticipantStore::in_doubt_older_than`), asking from
/// `local_ip` when set.
pub async fn recover_older_than<P: Participant>(
    store: &P,
    endpoints: &[String],
    age_min: Duration,
    local_ip: Option<std::net::IpAddr>,
) -> Result<usize, String> {
    recover_with(store, endpoints, age_min, &RecoveryOptions::with_local_ip(local_ip)).await
}

/// `recover_older_than` asking with `opts`'s client settings (its TLS
/// settings and token included).
pub async fn recover_with<P: Participant>(
    store: &P,
    endpoints: &[String],
    age_min: Duration,
    opts: &RecoveryOptions,
) -> Result<usize, String> {
    let in_doubt = store.in_doubt_older_than(age_min).await.map_err(|e| e.to_string())?;
    if in_doubt.is_empty() {
        return Ok(0);
    }
    let client = opts.client(endpoints)?;
    resolve_in_doubt(store, &in_doubt, &client).await
}

/// The transactions of `items` by incarnation (ascending), each group in
/// the order given: the cluster is asked once per incarnation.
fn by_incarnation<T: Copy>(items: &[T], txid: impl Fn(&T) -> GlobalTxid) -> Vec<(u64, Vec<T>)> {
    let mut groups: std::collections::BTreeMap<u64, Vec<T>> = std::collections::BTreeMap::new();
    for it in items {
        groups.entry(txid(it).incarnation).or_default().push(*it);
    }
    groups.into_iter().collect()
}

/// Asks the cluster about `in_doubt` and applies the known decisions:
/// once per incarnation (`Client::decisions_in`), since a txid means a
/// transaction only together with the incarnation that handed it out. A
/// transaction the cluster says another incarnation handed out
/// (`DecisionRead::OtherIncarnation`: another cluster's, or the cluster's
/// from after the backup it was restored from) keeps its record and its
/// locks: nothing is presumed about it; it is logged and counted
/// (`dtx_participant_recovery_lookups_total{outcome="other_incarnation"}`)
/// for an operator. An incarnation the cluster could not be asked about
/// is an error once the others are done.
async fn resolve_in_doubt<P: Participant>(
    store: &P,
    in_doubt: &[(GlobalTxid, LogEntry)],
    client: &Client,
) -> Result<usize, String> {
    let mut resolved = 0;
    let mut failed = None;
    for (incarnation, group) in by_incarnation(in_doubt, |(t, _)| *t) {
        match resolve_group(store, incarnation, &group, client, in_doubt.len(), &mut resolved).await {
            Ok(()) => {}
            Err(e) => failed = Some(e),
        }
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(resolved),
    }
}

/// `resolve_in_doubt` for the transactions of one incarnation.
async fn resolve_group<P: Participant>(
    store: &P,
    incarnation: u64,
    in_doubt: &[(GlobalTxid, LogEntry)],
    client: &Client,
    total: usize,
    resolved: &mut usize,
) -> Result<(), String> {
    let txids: Vec<u64> = in_doubt.iter().map(|(t, _)| t.txid).collect();
    let answers = match ask(client, incarnation, &txids, "").await {
        Ok(a) => a,
        Err(e) => {
            metrics::counter!("dtx_participant_recovery_lookups_total", "outcome" => "error")
                .increment(txids.len() as u64);
            return Err(e);
        }
    };
    let mut other: Vec<u64> = Vec::new();
    for (answer, (txid, entry)) in answers.into_iter().zip(in_doubt) {
        if !answer.settled_by.is_empty() {
            // Another incarnation's txid that an operator of the cluster
            // settled (ADR 0040): a recorded decision all the same
            // (invariant 5), applied below and counted as its outcome;
            // said apart, with who and why.
            warn!(
                txid = txid.txid,
                incarnation = format!("{:016x}", txid.incarnation),
                settled_by = %dtx_proto::tls::logtext::Clean(&answer.settled_by),
                "in-doubt transaction of another incarnation settled by an operator of the cluster: applying {:?}",
                answer.decision
            );
        }
        let (msg, outcome) = match answer.decision {
            Some(DecisionRead::Committed) => (Message::Commit { term: entry.term }, "commit"),
            Some(DecisionRead::Aborted) => (Message::Abort { term: entry.term }, "abort"),
            // The cluster has no record: it never decided COMMIT, and
            // never will (invariant 7), so the transaction is aborted; said
            // apart, since a prepared transaction the cluster does not know
            // is worth an operator's look.
            Some(DecisionRead::UnknownPresumedAbort) => {
                warn!(
                    txid = txid.txid,
                    incarnation = txid.incarnation,
                    "in-doubt transaction unknown to the cluster: presumed abort, rolling it back"
                );
                (Message::Abort { term: entry.term }, "unknown_presumed_abort")
            }
            // Not a transaction of the cluster asked: nothing may be
            // presumed (it may be committed where it was handed out).
            Some(DecisionRead::OtherIncarnation) => {
                metrics::counter!("dtx_participant_recovery_lookups_total", "outcome" => "other_incarnation")
                    .increment(1);
                other.push(txid.txid);
                continue;
            }
            // Still undecided, or an outcome this SDK does not know: keep
            // waiting.
            Some(DecisionRead::Pending) | None => {
                metrics::counter!("dtx_participant_recovery_lookups_total", "outcome" => "pending").increment(1);
                continue;
            }
        };
        metrics::counter!("dtx_participant_recovery_lookups_total", "outcome" => outcome).increment(1);
        match store.handle(*txid, msg, b"").await {
            Ok(_) => {
                info!(
                    txid = txid.txid,
                    incarnation = txid.incarnation,
                    "in-doubt transaction resolved by recovery: {msg:?}"
                );
                *resolved += 1;
                if *resolved < total {
                    dtx_failpoint::failpoint!("participant_mid_recovery");
                }
            }
            Err(e) => warn!(
                txid = txid.txid,
                incarnation = txid.incarnation,
                "recovery could not apply {msg:?}: {e}"
            ),
        }
    }
    if !other.is_empty() {
        const SHOWN: usize = 8;
        warn!(
            incarnation = format!("{incarnation:016x}"),
            count = other.len(),
            txids = ?&other[..other.len().min(SHOWN)],
            "in-doubt transactions the cluster did not hand out in this incarnation (another cluster's, or \
             from after the backup this cluster was restored from): nothing is presumed, their records and \
             locks are kept; resolve them with the cluster that handed them out"
        );
    }
    Ok(())
}

/// The cluster's answer for each of `txids` of `incarnation`, in order
/// ([`Client::decisions_in`]: linearizable, batched, any node, with the
/// client's retries); an error (no answer before the client's deadline)
/// as text.
async fn ask(
    client: &Client,
    incarnation: u64,
    txids: &[u64],
    participant_id: &str,
) -> Result<Vec<DecisionAnswer>, String> {
    client
        .decisions_in(incarnation, txids, participant_id)
        .await
        .map_err(|e| e.to_string())
}

/// Garbage-collects log records (decided ones and READ_ONLY votes) that
/// became so at or before `decided_before_ms`, at most `max`, but only
/// those for which the cluster will send nothing more to `participant_id`
/// (this participant, as enlisted):
/// - COMMIT or ABORT with this participant's ack recorded
///   (`awaiting_ack == false`). While its ack is not recorded the leader
///   keeps delivering the decision, and only the record makes that
///   delivery a repeat (acked) instead of a commit without prepare
///   (refused forever): the case of a decision learned by recovery before
///   the leader's delivery got through;
/// - UNKNOWN_PRESUMED_ABORT: forgotten, which the cluster does only after
///   every participant acked.
///
/// A record whose transaction still reads PENDING is kept: a READ_ONLY vote
/// of an undecided transaction, or a one-phase commit whose answer never
/// reached the coordinator, which keeps re-sending `CommitOnePhase` (only
/// the record turns a re-send into a repeat instead of a second commit).
/// Returns how many were removed; an error means the cluster could not be
/// asked (or `participant_id` is empty), and nothing was removed.
pub async fn collect_decided<P: Participant>(
    store: &P,
    endpoints: &[String],
    participant_id: &str,
    decided_before_ms: u64,
    max: usize,
    local_ip: Option<std::net::IpAddr>,
) -> Result<usize, String> {
    let mut from_the_start = GcCursor::default();
    collect_decided_from(
        store,
        endpoints,
        participant_id,
        decided_before_ms,
        max,
        local_ip,
        &mut from_the_start,
    )
    .await
}

/// Where the next garbage-collection pass goes on from: after the last
/// candidate the previous pass looked at, back to the start once a pass
/// reached the end of what is old enough. Records the cluster still needs
/// are kept at the front of the index; without the cursor, `max` of them
/// would hide every later record from every pass (invariant 11).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GcCursor(Option<(u64, GlobalTxid)>);

impl GcCursor {
    /// Moves on after a pass that looked at `candidates` out of at most `max`.
    pub fn advance(&mut self, candidates: &[(u64, GlobalTxid)], max: usize) {
        self.0 = if candidates.len() < max {
            None
        } else {
            candidates.last().copied()
        };
    }

    /// The candidate the next pass starts after (`None`: from the start).
    pub fn after(&self) -> Option<(u64, GlobalTxid)> {
        self.0
    }
}

/// `collect_decided` for the candidates after `cursor`, which it moves on.
pub async fn collect_decided_from<P: Participant>(
    store: &P,
    endpoints: &[String],
    participant_id: &str,
    decided_before_ms: u64,
    max: usize,
    local_ip: Option<std::net::IpAddr>,
    cursor: &mut GcCursor,
) -> Result<usize, String> {
    let opts = RecoveryOptions::with_local_ip(local_ip);
    collect_with(
        store,
        || opts.client(endpoints),
        participant_id,
        decided_before_ms,
        max,
        cursor,
    )
    .await
}

/// `collect_decided_from`, asking through the client `client()` gives (made
/// only when there is something to ask about).
async fn collect_with<P: Participant>(
    store: &P,
    client: impl FnOnce() -> Result<Arc<Client>, String>,
    participant_id: &str,
    decided_before_ms: u64,
    max: usize,
    cursor: &mut GcCursor,
) -> Result<usize, String> {
    if participant_id.is_empty() {
        return Err(
            "log garbage collection needs this participant's id (as enlisted) to ask whether the cluster still awaits its ack".into(),
        );
    }
    let candidates = store
        .gc_candidates_after(cursor.0, decided_before_ms, max)
        .await
        .map_err(|e| e.to_string())?;
    if candidates.is_empty() {
        cursor.advance(&candidates, max);
        return Ok(0);
    }
    let client = client()?;
    let mut safe: Vec<(u64, GlobalTxid)> = Vec::new();
    for (incarnation, group) in by_incarnation(&candidates, |(_, t)| *t) {
        let txids: Vec<u64> = group.iter().map(|(_, t)| t.txid).collect();
        let answers = ask(&client, incarnation, &txids, participant_id).await?;
        safe.extend(group.iter().zip(answers).filter(|(_, a)| gc_safe(a)).map(|(c, _)| *c));
    }
    let kept = candidates.len() - safe.len();
    if kept > 0 {
        warn!(
            kept,
            "decided log records kept past retention: the cluster has not recorded their outcome or this participant's ack yet"
        );
    }
    let removed = store.forget_records(&safe).await.map_err(|e| e.to_string())?;
    cursor.advance(&candidates, max);
    Ok(removed)
}

/// True when the cluster will send nothing more for the transaction to the
/// participant that asked (see `collect_decided`). A transaction the
/// cluster says its incarnation did not hand out
/// (`DecisionRead::OtherIncarnation`) is never safe: the cluster that did
/// may still send to it, and without the record a re-sent message would be
/// taken as the first.
pub fn gc_safe(a: &DecisionAnswer) -> bool {
    match a.decision {
        Some(DecisionRead::Committed | DecisionRead::Aborted) => !a.awaiting_ack,
        Some(DecisionRead::UnknownPresumedAbort) => true,
        Some(DecisionRead::Pending | DecisionRead::OtherIncarnation) | None => false,
    }
}

/// How the recovery loop runs.
#[derive(Clone, Debug)]
pub struct RecoveryOptions {
    /// Time between passes.
    pub interval: Duration,
    /// After the first pass (which asks about every in-doubt transaction),
    /// ask only about YES votes at least this old: younger ones are normally
    /// still in the coordinator's hands.
    pub prepared_age_min: Duration,
    /// Decided log records and READ_ONLY votes older than this are
    /// garbage-collected once the cluster will send nothing more for them
    /// (`collect_decided`); `None` keeps them forever. Keep it far above any
    /// transaction timeout.
    pub log_retention: Option<Duration>,
    /// Time between garbage-collection passes (each may ask the cluster
    /// about up to 10,000 records).
    pub gc_interval: Duration,
    /// Source address for the connections to the cluster (the service's
    /// own address, so network rules on it apply both ways); `None` lets
    /// the system choose.
    pub local_ip: Option<std::net::IpAddr>,
    /// This participant's id, as enlisted (the one given to
    /// `ParticipantServer::new`): log garbage collection asks the cluster
    /// whether it still awaits this participant's ack. Empty: no garbage
    /// collection (said once at start, at error level).
    pub participant_id: String,
    /// Time budget of one question to the cluster (one batch of up to 1024
    /// txids), retries at other nodes included. When it runs out the pass
    /// logs that the cluster is not answering, and the next pass asks
    /// again.
    pub ask_timeout: Duration,
    /// TLS settings of the calls to the cluster (its authority, and this
    /// service's certificate, `dtx://participant/<name>`).
    pub tls: Option<std::sync::Arc<dtx_proto::tls::ClientTls>>,
    /// A bearer token for the calls to the cluster, where it accepts
    /// tokens instead of client certificates.
    pub token: Option<String>,
}

impl Default for RecoveryOptions {
    fn default() -> Self {
        RecoveryOptions {
            interval: Duration::from_millis(500),
            prepared_age_min: Duration::from_secs(1),
            log_retention: Some(Duration::from_secs(24 * 3600)),
            gc_interval: Duration::from_secs(10),
            local_ip: None,
            participant_id: String::new(),
            ask_timeout: Duration::from_secs(2),
            tls: None,
            token: None,
        }
    }
}

impl RecoveryOptions {
    /// The options of a service that is participant `participant_id` and
    /// listens on `listen`: passes every 500 ms, asking the cluster from
    /// the listening address's IP (unless it is unspecified), so network
    /// rules on that address cut the service both ways.
    pub fn for_service(participant_id: &str, listen: &str) -> Self {
        let local_ip = listen
            .parse::<std::net::SocketAddr>()
            .ok()
            .map(|sa| sa.ip())
            .filter(|ip| !ip.is_unspecified());
        RecoveryOptions {
            interval: Duration::from_millis(500),
            local_ip,
            participant_id: participant_id.to_string(),
            ..RecoveryOptions::default()
        }
    }

    fn with_local_ip(local_ip: Option<std::net::IpAddr>) -> Self {
        RecoveryOptions {
            local_ip,
            ..RecoveryOptions::default()
        }
    }

    /// The settings of the [`Client`] that recovery and garbage collection
    /// ask the cluster (`endpoints`) with: the client's retry policy
    /// (leader hints, other nodes, backoff with jitter) within
    /// `ask_timeout` per question, connections opened within 500 ms, from
    /// `local_ip`.
    pub fn client_config(&self, endpoints: Vec<String>) -> ClientConfig {
        let mut cfg = ClientConfig::new(endpoints);
        cfg.call_deadline = self.ask_timeout;
        cfg.attempt_timeout = self.ask_timeout;
        cfg.connect_timeout = Duration::from_millis(500);
        cfg.local_ip = self.local_ip;
        cfg.tls = self.tls.clone();
        cfg.token = self.token.clone();
        cfg
    }

    /// A client of [`client_config`](RecoveryOptions::client_config).
    fn client(&self, endpoints: &[String]) -> Result<Arc<Client>, String> {
        Client::new(self.client_config(endpoints.to_vec()))
            .map(Arc::new)
            .map_err(|e| e.to_string())
    }
}

/// Serves participant `participant_id` (as enlisted) on `listener`
/// (`dtx.v1.ParticipantService`, TCP_NODELAY and keep-alive on every
/// connection) with its recovery loop (`spawn_recovery_with`, asking
/// `cluster`), until `shutdown` completes; then stops recovery. A service
/// whose participant can stop by itself (the sled store on a failed write)
/// makes that part of `shutdown`. Plain text; [`serve_with_tls`] for TLS.
pub async fn serve<P: Participant>(
    participant: Arc<P>,
    participant_id: &str,
    listener: tokio::net::TcpListener,
    cluster: Vec<String>,
    recovery: RecoveryOptions,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    serve_with_tls(participant, participant_id, listener, cluster, recovery, None, shutdown).await
}

/// As [`serve`], over TLS when `tls` is set. Then every caller must
/// present a certificate from the authority (mutual TLS), and only the
/// cluster's nodes (`dtx://node/<id>`) may send Prepare, Commit, Abort and
/// the grouped calls; `Inquire` and `Inspect` also take operators. Anyone else is
/// refused (`UNAUTHENTICATED` or `PERMISSION_DENIED`, logged and counted
/// in `dtx_auth_refusals_total{server="participant"}`) before the
/// participant sees the message.
pub async fn serve_with_tls<P: Participant>(
    participant: Arc<P>,
    participant_id: &str,
    listener: tokio::net::TcpListener,
    cluster: Vec<String>,
    recovery: RecoveryOptions,
    tls: Option<Arc<dtx_proto::tls::ServerTls>>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let guard = Guard {
        tls,
        node_tokens: dtx_proto::tls::Tokens::default(),
    };
    serve_guarded(
        participant,
        participant_id,
        listener,
        cluster,
        recovery,
        guard,
        shutdown,
    )
    .await
}

/// Who may call a participant service: with `tls`, callers with a node's
/// certificate; with `node_tokens` (where mutual TLS is not used), callers
/// presenting one of those tokens (`authorization: Bearer`, the nodes'
/// `auth.participant_token_file`). With neither, anyone (plain text, no
/// check).
#[derive(Clone, Debug, Default)]
pub struct Guard {
    pub tls: Option<Arc<dtx_proto::tls::ServerTls>>,
    /// Tokens with the node role.
    pub node_tokens: dtx_proto::tls::Tokens,
}

/// As [`serve_with_tls`], with a [`Guard`]: TLS, node tokens, or both.
pub async fn serve_guarded<P: Participant>(
    participant: Arc<P>,
    participant_id: &str,
    listener: tokio::net::TcpListener,
    cluster: Vec<String>,
    recovery: RecoveryOptions,
    guard: Guard,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let Guard { tls, node_tokens } = guard;
    // Certificates are read again when their files change (every 10 s),
    // as a node's are: a rotation needs no restart.
    let mut reloaders = Vec::new();
    if let Some(t) = &tls {
        reloaders.push(t.spawn_reloader(TLS_RELOAD_INTERVAL, "participant"));
    }
    if let Some(t) = &recovery.tls {
        reloaders.push(t.spawn_reloader(TLS_RELOAD_INTERVAL, "participant's calls to the cluster"));
    }
    let recovery = spawn_recovery_with(participant.clone(), cluster, recovery);
    let policy: dtx_proto::tls::AuthPolicy = if tls.is_some() || !node_tokens.is_empty() {
        participant_policy
    } else {
        |_| dtx_proto::tls::Access::Open
    };
    let served = tonic::transport::Server::builder()
        .layer(
            dtx_proto::tls::EdgeLayer::new("participant", node_tokens, policy)
                .marking_not_applied(dtx_proto::metadata::NOT_APPLIED_HEADER),
        )
        // Each call from the cluster runs in an `rpc` span with its `txid`
        // (`x-dtx-txid`) and the W3C trace it continues (`traceparent`).
        .layer(dtx_client::propagate::InboundTxidLayer)
        .add_service(
            dtx_proto::v1::participant_service_server::ParticipantServiceServer::new(ParticipantServer::new(
                participant,
                participant_id,
            )),
        )
        .serve_with_incoming_shutdown(dtx_proto::tls::incoming(listener, tls), shutdown)
        .await;
    recovery.abort();
    for r in reloaders {
        r.abort();
    }
    served
}

/// How often a participant served with TLS looks at its certificate files.
pub const TLS_RELOAD_INTERVAL: Duration = Duration::from_secs(10);

/// Who may call each method of a participant served with TLS (or node
/// tokens): the cluster's nodes; the read-only `Inquire` and `Inspect`
/// (which reveals business transaction ids) also operators. A method
/// missing here is refused for everyone.
pub fn participant_policy(path: &str) -> dtx_proto::tls::Access {
    use dtx_proto::tls::Access;
    use dtx_proto::tls::Role;
    match path.strip_prefix("/dtx.v1.ParticipantService/") {
        Some("Inquire" | "Inspect") => Access::Roles(&[Role::Node, Role::Operator]),
        Some("Prepare" | "Commit" | "Abort" | "CommitOnePhase" | "ApplyDecisions" | "PrepareMany") => {
            Access::Roles(&[Role::Node])
        }
        _ => Access::Roles(&[]),
    }
}

/// How often the recovery loop sets the in-doubt gauges
/// (`crate::metrics::report_in_doubt`).
const IN_DOUBT_GAUGES_INTERVAL: Duration = Duration::from_secs(1);

/// `spawn_recovery_with` with the default options, the given interval and
/// this participant's id (as enlisted).
pub fn spawn_recovery<P: Participant>(
    store: Arc<P>,
    endpoints: Vec<String>,
    participant_id: &str,
    interval: Duration,
) -> tokio::task::JoinHandle<()> {
    let opts = RecoveryOptions {
        interval,
        participant_id: participant_id.to_string(),
        ..RecoveryOptions::default()
    };
    spawn_recovery_with(store, endpoints, opts)
}

/// Asks about every in-doubt transaction now, then every `interval` about
/// those older than `prepared_age_min`, logging while the cluster cannot
/// answer (the locks stay held: invariant 5); also garbage-collects decided
/// and READ_ONLY records past `log_retention` (see `collect_decided`). Ends
/// when the returned handle is aborted. Every pass asks through one
/// [`Client`] ([`RecoveryOptions::client_config`]), which keeps its
/// connections and the leader it last heard of.
pub fn spawn_recovery_with<P: Participant>(
    store: Arc<P>,
    endpoints: Vec<String>,
    opts: RecoveryOptions,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let client = opts.client(&endpoints);
        if let Err(e) = &client {
            error!("recovery cannot ask the cluster: {e}");
        }
        let mut age_min = Duration::ZERO;
        let mut next_gc = tokio::time::Instant::now();
        let mut gc_cursor = GcCursor::default();
        let mut next_gauges = tokio::time::Instant::now();
        let mut retention = opts.log_retention;
        if retention.is_some() && opts.participant_id.is_empty() {
            error!(
                "participant log garbage collection is off: RecoveryOptions.participant_id is empty (set it to the id this participant is enlisted with)"
            );
            retention = None;
        }
        loop {
            if let Some(f) = store.stopped_because() {
                // Nothing can be applied any more; the service is expected
                // to stop (`ParticipantStore::stopped`) and be restarted.
                error!("recovery stopped: {f}");
                return;
            }
            if let Some(keep) = retention.filter(|_| tokio::time::Instant::now() >= next_gc) {
                next_gc = tokio::time::Instant::now() + opts.gc_interval;
                let before = crate::store::unix_ms().saturating_sub(keep.as_millis() as u64);
                let gc = collect_with(
                    store.as_ref(),
                    || client.clone(),
                    &opts.participant_id,
                    before,
                    10_000,
                    &mut gc_cursor,
                );
                match gc.await {
                    Ok(0) => {}
                    Ok(n) => info!(forgotten = n, "decided log records garbage-collected"),
                    Err(e) => warn!("log garbage collection waits for the cluster: {e}"),
                }
            }
            if tokio::time::Instant::now() >= next_gauges {
                // At most once a second: a PostgreSQL participant asks its
                // database for these.
                next_gauges = tokio::time::Instant::now() + IN_DOUBT_GAUGES_INTERVAL;
                match store.in_doubt_summary().await {
                    Ok(s) => crate::metrics::report_in_doubt(&opts.participant_id, &s),
                    // The listing below fails too, and says so.
                    Err(e) => tracing::debug!("in-doubt gauges not updated: {e}"),
                }
            }
            let in_doubt = match store.in_doubt_older_than(age_min).await {
                Ok(v) => v,
                Err(e) => {
                    // Never taken as "nothing in doubt": said, counted and
                    // tried again on the next pass.
                    metrics::counter!("dtx_participant_recovery_errors_total").increment(1);
                    error!("recovery pass could not list the in-doubt transactions; trying again: {e}");
                    tokio::time::sleep(opts.interval).await;
                    continue;
                }
            };
            let doubt = in_doubt.len();
            if doubt > 0 {
                let pass = match &client {
                    Ok(c) => resolve_in_doubt(store.as_ref(), &in_doubt, c).await,
                    Err(e) => Err(e.clone()),
                };
                match pass {
                    Ok(n) if n > 0 => info!(resolved = n, in_doubt = doubt, "recovery pass"),
                    Ok(_) => {}
                    Err(e) => warn!(
                        in_doubt = doubt,
                        "cluster not answering; holding locks and waiting: {e}"
                    ),
                }
            }
            age_min = opts.prepared_age_min;
            tokio::time::sleep(opts.interval).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use dtx_proto::tls::Access;
    use dtx_proto::tls::Role;

    use super::participant_policy;

    #[test]
    fn only_nodes_send_decisions_and_every_method_has_an_entry() {
        let text = include_str!("../../proto/dtx/v1/participant.proto");
        let mut seen = 0;
        for line in text.lines() {
            let Some(rest) = line.trim().strip_prefix("rpc ") else {
                continue;
            };
            let method = rest.split('(').next().unwrap().trim();
            let Access::Roles(roles) = participant_policy(&format!("/dtx.v1.ParticipantService/{method}")) else {
                panic!("{method} is open")
            };
            assert!(roles.contains(&Role::Node), "{method}: nodes must be admitted");
            assert!(
                !roles.contains(&Role::Application),
                "{method}: applications must not be"
            );
            assert!(
                !roles.contains(&Role::Participant),
                "{method}: participants must not be"
            );
            assert_eq!(
                roles.contains(&Role::Operator),
                matches!(method, "Inquire" | "Inspect"),
                "{method}: only the read-only calls admit operators"
            );
            seen += 1;
        }
        assert!(seen >= 8, "{seen} methods found in participant.proto");
        assert_eq!(
            participant_policy("/dtx.v1.ParticipantService/Inspect"),
            Access::Roles(&[Role::Node, Role::Operator])
        );
        assert_eq!(
            participant_policy("/dtx.v1.ParticipantService/Nope"),
            Access::Roles(&[])
        );
    }
}
