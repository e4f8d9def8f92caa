//! What the gRPC server ([`crate::server::ParticipantServer`]) and recovery
//! drive: a participant, meaning its durable log together with the resource
//! whose work it prepares, commits and aborts.
//!
//! Two implementations:
//! - [`crate::store::ParticipantStore`]: the resource's data and the log in
//!   the SDK's own sled tree, written in one atomic batch per message (or
//!   per group of messages); its [`crate::store::Resource`] runs
//!   synchronously, one call at a time, and must not touch the network;
//! - `crate::postgres::PgParticipant` (cargo feature `postgres`): the
//!   service's data in its PostgreSQL database, each transaction's work done
//!   by an async handler inside a PostgreSQL transaction that Prepare ends
//!   with `PREPARE TRANSACTION`; transactions run concurrently, each on its
//!   own connection, and PostgreSQL's row locks keep them apart.
//!
//! Every implementation keeps the contract of [`crate::log::step`]: Prepare
//! is idempotent, an Abort before the Prepare leaves a tombstone so a late
//! Prepare votes NO, Commit and Abort are applied exactly once, a message
//! from an older leader term than one already seen is refused, protocol
//! violations are refused and never applied, and nothing is answered before
//! what it reports is durable (invariants 5, 8 and 9).

use std::future::Future;
use std::time::Duration;

use crate::log::GlobalTxid;
use crate::log::LogEntry;
use crate::log::Message;
use crate::log::Refusal;
use crate::log::Vote;

/// A phase-two message as `Participant::apply_decisions` takes them:
/// the decision and the term of the leader that sent it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PhaseTwo {
    Commit { term: u64 },
    Abort { term: u64 },
}

impl From<PhaseTwo> for Message {
    fn from(d: PhaseTwo) -> Message {
        match d {
            PhaseTwo::Commit { term } => Message::Commit { term },
            PhaseTwo::Abort { term } => Message::Abort { term },
        }
    }
}

/// The answer to send to the coordinator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    Vote(Vote),
    /// The decision is durably applied.
    Ack,
}

/// The SDK's error: every participant reports its failures in these
/// terms (the server maps them to gRPC codes).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store could not be opened; `disk_full` when for lack of space.
    #[error("participant store at {path}: {message}")]
    Open {
        path: String,
        message: String,
        disk_full: bool,
    },
    #[error("participant store I/O: {0}")]
    Io(String),
    /// The resource's server (PostgreSQL) cannot be reached now, or the
    /// connection was lost: nothing was decided here; the coordinator
    /// retries (a Prepare it cannot get counts as no YES vote).
    #[error("participant resource unavailable: {0}")]
    Unavailable(String),
    #[error("participant log record for transaction {txid} is damaged: {message}")]
    Damaged { txid: GlobalTxid, message: String },
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// A write failed earlier, so the store takes no more requests (see
    /// `ParticipantStore::stopped`).
    #[error("{0}")]
    Stopped(StoreFailure),
}

impl StoreError {
    /// True when the cause is a full disk (or an exceeded disk quota).
    pub fn is_disk_full(&self) -> bool {
        match self {
            StoreError::Open { disk_full, .. } => *disk_full,
            StoreError::Stopped(f) => f.disk_full,
            _ => false,
        }
    }
}

/// Why a store stopped taking writes: the first write (or fsync) that
/// failed. sled 0.34.7 keeps such an error for the life of the open
/// database, refusing every later write and flush even once the cause is
/// gone (participant-sdk/tests/it/t30_disk_full.rs pins that), so the store
/// cannot go on in place: it acknowledges nothing more, and the service
/// must be restarted (reopening the store), once space is freed for a full
/// disk. What was acknowledged before is on disk (every reply waits for its
/// fsync).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreFailure {
    /// The store's directory.
    pub path: String,
    /// The file system is full (ENOSPC) or over its quota (EDQUOT).
    pub disk_full: bool,
    /// The error as the engine reported it.
    pub detail: String,
}

impl std::fmt::Display for StoreFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.disk_full {
            write!(
                f,
                "participant store at {}: the disk is full ({}); the store stopped and acknowledges nothing more; restart the service once space is freed (a store that failed a write does not write again until it is reopened; everything acknowledged is on disk)",
                self.path, self.detail
            )
        } else {
            write!(
                f,
                "participant store at {}: a write failed ({}); the store stopped and acknowledges nothing more; restart the service (a store that failed a write does not write again until it is reopened; everything acknowledged is on disk)",
                self.path, self.detail
            )
        }
    }
}

/// The answer to one coordinator message, with the reason for a NO vote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    pub reply: Reply,
    /// Why the vote is NO (for the coordinator's log and the operator);
    /// empty for any other reply.
    pub reason: String,
}

impl Answer {
    pub fn new(reply: Reply) -> Self {
        Answer {
            reply,
            reason: String::new(),
        }
    }

    /// A NO vote, and why.
    pub fn no(reason: impl Into<String>) -> Self {
        Answer {
            reply: Reply::Vote(Vote::No),
            reason: reason.into(),
        }
    }
}

/// A vote with its reason (the reason is empty unless the vote is NO).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub vote: Vote,
    pub reason: String,
}

/// What [`Participant::apply_then_prepare`] answers: one result per
/// decision (as `apply_decisions`), then one per prepare (as
/// `prepare_many`).
pub type AcksAndVerdicts = (Vec<Result<(), StoreError>>, Vec<Result<Verdict, StoreError>>);

impl Verdict {
    pub fn yes() -> Self {
        Verdict {
            vote: Vote::Yes,
            reason: String::new(),
        }
    }

    pub fn read_only() -> Self {
        Verdict {
            vote: Vote::ReadOnly,
            reason: String::new(),
        }
    }

    pub fn no(reason: impl Into<String>) -> Self {
        Verdict {
            vote: Vote::No,
            reason: reason.into(),
        }
    }
}

/// The transactions a participant holds in doubt (a YES vote, no known
/// decision): how many, and the age of the oldest vote when known (`None`:
/// none in doubt, or the participant cannot tell).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InDoubtSummary {
    pub count: usize,
    pub oldest_age: Option<Duration>,
}

/// What an operator asks a participant's log (`Participant::inspect`,
/// served as `ParticipantService.Inspect`). The server checks the sizes
/// against `dtx_proto::limits::INSPECT_RECORDS_MAX` first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InspectQuery {
    /// Transactions to look up, answered in this order.
    pub txids: Vec<GlobalTxid>,
    /// List the transactions held in doubt (at most `list_max`).
    pub in_doubt: bool,
    /// List this many of the most recent records (0: none).
    pub recent: usize,
    /// The most in-doubt records to list (the rest are only counted).
    pub list_max: usize,
}

/// One record as `Participant::inspect` shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InspectedRecord {
    pub txid: GlobalTxid,
    /// The durable record; `None` when there is none.
    pub entry: Option<LogEntry>,
    /// When the record got its current state (ms since the Unix epoch),
    /// if the log keeps it.
    pub recorded_unix_ms: Option<u64>,
}

/// What `Participant::inspect` answers: only what is durable, read
/// without changing anything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Inspection {
    /// One per asked txid, in the query's order.
    pub records: Vec<InspectedRecord>,
    /// When asked: the in-doubt transactions, oldest vote first (those
    /// whose time is not kept first), at most `InspectQuery::list_max`.
    pub in_doubt: Vec<InspectedRecord>,
    /// When asked: the most recently recorded first; records without a
    /// kept time last.
    pub recent: Vec<InspectedRecord>,
    /// How many are in doubt now (all of them), and the oldest's age.
    pub in_doubt_summary: InDoubtSummary,
    /// How many records the log holds, in every state.
    pub records_total: u64,
}

/// A participant as the server and recovery see it. Every method may do
/// I/O; none may answer before what its answer reports is durable.
pub trait Participant: Send + Sync + 'static {
    /// One coordinator message (Prepare, Commit, Abort, CommitOnePhase) for
    /// `txid` (of its incarnation: see [`GlobalTxid`]), with the Prepare's or CommitOnePhase's payload (empty for
    /// the others), handled as [`crate::log::step`] says. A refusal is
    /// `Err(StoreError::Refused(_))`.
    fn handle(
        &self,
        txid: GlobalTxid,
        msg: Message,
        payload: &[u8],
    ) -> impl Future<Output = Result<Answer, StoreError>> + Send;

    /// Many Prepares (transaction, term, payload) at once: one result per item, in
    /// order, each what the item's own Prepare would have answered. The
    /// call fails as a whole only when nothing could be prepared.
    fn prepare_many(
        &self,
        items: &[(GlobalTxid, u64, &[u8])],
    ) -> impl Future<Output = Result<Vec<Result<Verdict, StoreError>>, StoreError>> + Send;

    /// Many decisions at once: one result per item, in order, each what the
    /// item's own Commit or Abort would have answered.
    fn apply_decisions(
        &self,
        items: &[(GlobalTxid, PhaseTwo)],
    ) -> impl Future<Output = Result<Vec<Result<(), StoreError>>, StoreError>> + Send;

    /// Decisions and prepares that came in one PrepareMany message (ADR
    /// 0030): the decisions' results as [`Participant::apply_decisions`]
    /// gives them, then the prepares' as [`Participant::prepare_many`].
    /// The decisions come first: a prepare of the message must find what a
    /// decision of it frees already free (protocol.md; run at the same
    /// time, a PostgreSQL prepare could find a row the riding `COMMIT
    /// PREPARED` was about to free still held, and vote NO: the
    /// conformance kit's rule `prepare-many` caught it). The default
    /// applies them, then prepares (no `apply_decisions` without
    /// decisions); a participant that can write both in one durable write
    /// should. The call fails as a whole when either part does.
    fn apply_then_prepare(
        &self,
        decisions: &[(GlobalTxid, PhaseTwo)],
        prepares: &[(GlobalTxid, u64, &[u8])],
    ) -> impl Future<Output = Result<AcksAndVerdicts, StoreError>> + Send {
        async move {
            let acks = async {
                if decisions.is_empty() {
                    Ok(Vec::new())
                } else {
                    self.apply_decisions(decisions).await
                }
            };
            let acks = acks.await?;
            Ok((acks, self.prepare_many(prepares).await?))
        }
    }

    /// The record of `txid` as it is durably (for the coordinator's
    /// Inquire): `None` when there is none.
    fn durable_entry(&self, txid: GlobalTxid) -> impl Future<Output = Result<Option<LogEntry>, StoreError>> + Send;

    /// The transactions holding a YES vote without a known decision, whose
    /// vote is at least `age_min` old (votes from before this process
    /// started count as old): recovery asks the cluster about these.
    fn in_doubt_older_than(
        &self,
        age_min: Duration,
    ) -> impl Future<Output = Result<Vec<(GlobalTxid, LogEntry)>, StoreError>> + Send;

    /// How many transactions hold a YES vote without a known decision now,
    /// and how long the oldest has held it (for the gauges
    /// `dtx_participant_in_doubt` and
    /// `dtx_participant_oldest_in_doubt_age_seconds`, set by the recovery
    /// loop). The default counts [`Participant::in_doubt_older_than`] and
    /// knows no age.
    fn in_doubt_summary(&self) -> impl Future<Output = Result<InDoubtSummary, StoreError>> + Send {
        async move {
            let all = self.in_doubt_older_than(Duration::ZERO).await?;
            Ok(InDoubtSummary {
                count: all.len(),
                oldest_age: None,
            })
        }
    }

    /// Decided records (and READ_ONLY votes) that became so at or before
    /// `decided_before_ms` (ms since the Unix epoch), after the cursor
    /// `after`, oldest first, at most `max`, as `(decided_ms, txid)`:
    /// candidates for [`Participant::forget_records`].
    fn gc_candidates_after(
        &self,
        after: Option<(u64, GlobalTxid)>,
        decided_before_ms: u64,
        max: usize,
    ) -> impl Future<Output = Result<Vec<(u64, GlobalTxid)>, StoreError>> + Send;

    /// Removes the given records (from `gc_candidates_after`) that are still
    /// collectable; returns how many. Only once the cluster will send
    /// nothing more for them (`server::collect_decided` checks).
    fn forget_records(&self, records: &[(u64, GlobalTxid)]) -> impl Future<Output = Result<usize, StoreError>> + Send;

    /// Branches that prepared here and whose registration with the
    /// cluster is not known to be recorded (docs/protocol.md,
    /// "Branches"), with their participant ids, leaving out those whose
    /// flow runs in this process now. Recovery asks the cluster about each
    /// by (txid, participant) and never by the txid alone, whose decision
    /// may be a COMMIT without the branch. None by default.
    fn unregistered_branches(&self) -> impl Future<Output = Result<Vec<(GlobalTxid, String)>, StoreError>> + Send {
        async { Ok(Vec::new()) }
    }

    /// Branches whose flow runs in this process now (registering with the
    /// cluster): recovery leaves their transactions alone altogether, in
    /// the in-doubt pass too, since until the cluster answers the branch
    /// is not known to be a member and its transaction's decision may be
    /// a COMMIT without it. None by default.
    fn branches_in_flight(&self) -> Vec<GlobalTxid> {
        Vec::new()
    }

    /// The branch of `txid` is settled with the cluster (a member, whose
    /// decision then comes as any participant's, or resolved here): its
    /// mark goes. Nothing by default.
    fn unmark_branch(&self, txid: GlobalTxid) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = txid;
        async { Ok(()) }
    }

    /// Why the participant stopped taking requests for good (a store that
    /// can no longer write), if it has: recovery then stops too, and the
    /// service is expected to exit and be restarted. `None` by default.
    fn stopped_because(&self) -> Option<String> {
        None
    }

    /// What the durable log holds for an operator (`ParticipantService.
    /// Inspect`): the records of `query.txids`, the in-doubt ones and the
    /// most recent ones when asked, and the counts. Read-only: it writes
    /// nothing (no tombstone for a txid never seen, no term), and answers
    /// only what is durable.
    fn inspect(&self, query: &InspectQuery) -> impl Future<Output = Result<Inspection, StoreError>> + Send;
}

/// A shared participant is one too (so `&Arc<P>` can be passed wherever a
/// participant is taken).
impl<P: Participant> Participant for std::sync::Arc<P> {
    fn handle(
        &self,
        txid: GlobalTxid,
        msg: Message,
        payload: &[u8],
    ) -> impl Future<Output = Result<Answer, StoreError>> + Send {
        P::handle(self, txid, msg, payload)
    }

    fn prepare_many(
        &self,
        items: &[(GlobalTxid, u64, &[u8])],
    ) -> impl Future<Output = Result<Vec<Result<Verdict, StoreError>>, StoreError>> + Send {
        P::prepare_many(self, items)
    }

    fn apply_decisions(
        &self,
        items: &[(GlobalTxid, PhaseTwo)],
    ) -> impl Future<Output = Result<Vec<Result<(), StoreError>>, StoreError>> + Send {
        P::apply_decisions(self, items)
    }

    fn apply_then_prepare(
        &self,
        decisions: &[(GlobalTxid, PhaseTwo)],
        prepares: &[(GlobalTxid, u64, &[u8])],
    ) -> impl Future<Output = Result<AcksAndVerdicts, StoreError>> + Send {
        P::apply_then_prepare(self, decisions, prepares)
    }

    fn durable_entry(&self, txid: GlobalTxid) -> impl Future<Output = Result<Option<LogEntry>, StoreError>> + Send {
        P::durable_entry(self, txid)
    }

    fn in_doubt_older_than(
        &self,
        age_min: Duration,
    ) -> impl Future<Output = Result<Vec<(GlobalTxid, LogEntry)>, StoreError>> + Send {
        P::in_doubt_older_than(self, age_min)
    }

    fn in_doubt_summary(&self) -> impl Future<Output = Result<InDoubtSummary, StoreError>> + Send {
        P::in_doubt_summary(self)
    }

    fn gc_candidates_after(
        &self,
        after: Option<(u64, GlobalTxid)>,
        decided_before_ms: u64,
        max: usize,
    ) -> impl Future<Output = Result<Vec<(u64, GlobalTxid)>, StoreError>> + Send {
        P::gc_candidates_after(self, after, decided_before_ms, max)
    }

    fn forget_records(&self, records: &[(u64, GlobalTxid)]) -> impl Future<Output = Result<usize, StoreError>> + Send {
        P::forget_records(self, records)
    }

    fn unregistered_branches(&self) -> impl Future<Output = Result<Vec<(GlobalTxid, String)>, StoreError>> + Send {
        P::unregistered_branches(self)
    }

    fn unmark_branch(&self, txid: GlobalTxid) -> impl Future<Output = Result<(), StoreError>> + Send {
        P::unmark_branch(self, txid)
    }

    fn branches_in_flight(&self) -> Vec<GlobalTxid> {
        P::branches_in_flight(self)
    }

    fn stopped_because(&self) -> Option<String> {
        P::stopped_because(self)
    }

    fn inspect(&self, query: &InspectQuery) -> impl Future<Output = Result<Inspection, StoreError>> + Send {
        P::inspect(self, query)
    }
}
