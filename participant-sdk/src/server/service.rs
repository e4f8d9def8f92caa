//! The gRPC service `dtx.v1.ParticipantService` on a [`Participant`]:
//! [`ParticipantServer`] turns each message into a call of the participant
//! and its answer (or refusal, or store error) into the wire reply.

use std::sync::Arc;

use dtx_proto::v1 as pb;
use dtx_proto::v1::participant_service_server::ParticipantService;
use tonic::Request;
use tonic::Response;
use tonic::Status;
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
