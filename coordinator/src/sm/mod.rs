//! The replicated transaction state machine, as a pure function.
//!
//! `TxTable::apply(command)` returns the command's result and the list of
//! effects; it does no I/O, reads no clock (time arrives inside commands, from
//! the proposing leader) and spawns nothing. The storage layer persists the
//! records named by the effects; the leader's loops react to `Decided`.
//!
//! Ordering rule: a decision is *applied* in Raft BEFORE anyone may deliver it
//! to a participant; delivery code only ever reads decisions from this table.
//!
//! Transaction life (docs/protocol.md, "Transaction life"): ACTIVE ->
//! PREPARING -> DECIDED -> forgotten.
//!
//! `tally`: the vote tally of a prepare round and the deadline rule, pure
//! too; the driver decides by it, and the reaper's ABORT is held to its
//! deadline rule here.
//!
//! `operator`: what an operator does to records: drop a participant gone for
//! good from phase two, forget a transaction before its retention, and the
//! filtered listing of records.
//!
//! `branch`: branches that prepare where they run (ADR 0046): a branch's
//! registration with its vote, and the fence that keeps a branch that did
//! not register out of the decision.
//!
//! `settlement`: an operator's settlement of another incarnation's txid
//! (ADR 0040), kept beside the table like `incarnation`.

pub mod branch;
pub mod incarnation;
pub mod operator;
pub mod saga;
pub mod settlement;
pub mod tally;

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::collections::HashMap;
use std::fmt;

use serde::Deserialize;
use serde::Serialize;

use self::tally::deadline_passed;
use crate::limits;

pub type Txid = u64;

/// A recorded two-phase-commit decision outcome.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Commit,
    Abort,
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Outcome::Commit => "COMMIT",
            Outcome::Abort => "ABORT",
        })
    }
}

/// Who recorded a decision.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecisionSource {
    Driver,
    Client,
    Reaper,
    Operator,
    /// An operator declared the one participant of a one-phase commit lost
    /// and chose the outcome (`Command::DeclareLost`, ADR 0039): a
    /// heuristic decision, the operator's, never the participant's answer.
    /// Appended last: older records keep their encoding.
    OperatorHeuristic,
}

impl DecisionSource {
    /// The name operators see (`admin txn show`, `inspect`).
    pub fn name(self) -> &'static str {
        match self {
            DecisionSource::Driver => "driver",
            DecisionSource::Client => "client",
            DecisionSource::Reaper => "reaper",
            DecisionSource::Operator => "operator",
            DecisionSource::OperatorHeuristic => "operator-heuristic",
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub outcome: Outcome,
    pub source: DecisionSource,
    /// Term of the leader that proposed it.
    pub term: u64,
    /// Proposing leader's clock, ms since the Unix epoch.
    pub decided_ms: u64,
    pub note: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum Phase {
    Active,
    Preparing,
    Decided(Decision),
}

impl Phase {
    pub fn name(&self) -> &'static str {
        match self {
            Phase::Active => "ACTIVE",
            Phase::Preparing => "PREPARING",
            Phase::Decided(_) => "DECIDED",
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Participant {
    pub id: String,
    pub address: String,
    pub payload: Vec<u8>,
    pub acked: bool,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct TxRecord {
    pub txid: Txid,
    pub idempotency_key: String,
    pub fingerprint: [u8; 32],
    pub begun_ms: u64,
    pub deadline_ms: u64,
    pub phase: Phase,
    pub participants: Vec<Participant>,
    /// Committing in one phase: the single participant was asked to
    /// prepare-and-commit at once, so only its answer may decide (no reaper,
    /// client or operator ABORT: it may already have committed).
    pub one_phase: bool,
}

impl TxRecord {
    pub fn decision(&self) -> Option<&Decision> {
        match &self.phase {
            Phase::Decided(d) => Some(d),
            _ => None,
        }
    }

    pub fn all_acked(&self) -> bool {
        self.participants.iter().all(|p| p.acked)
    }
}

/// One state-machine command. Several travel in one Raft entry (group commit).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// Start a transaction, or find the one begun with the same key.
    Begin {
        idempotency_key: String,
        /// Hash of everything else in the request; same key + other
        /// fingerprint is refused.
        fingerprint: [u8; 32],
        now_ms: u64,
        timeout_ms: u64,
    },
    Enlist {
        txid: Txid,
        participant_id: String,
        address: String,
        payload: Vec<u8>,
    },
    /// ACTIVE -> PREPARING: freezes the participant set before votes count.
    RequestCommit { txid: Txid },
    /// Like `RequestCommit`, but with exactly one participant the commit runs
    /// in one phase (`TxRecord::one_phase`); with more it is `RequestCommit`.
    RequestCommitOnePhase { txid: Txid },
    /// Begin with the whole participant set and request the commit in the
    /// same command: the record starts in PREPARING (one Raft write for what
    /// Begin + Enlist + RequestCommit do). The same key returns the existing
    /// transaction in whatever phase it is now.
    BeginAndCommit {
        idempotency_key: String,
        fingerprint: [u8; 32],
        now_ms: u64,
        timeout_ms: u64,
        participants: Vec<Enlistment>,
        one_phase_allowed: bool,
    },
    /// Write-once decision (invariant 1). `voters` must equal the enlisted set
    /// for COMMIT (invariant 2).
    Decide {
        txid: Txid,
        outcome: Outcome,
        voters: Vec<String>,
        source: DecisionSource,
        term: u64,
        now_ms: u64,
        note: String,
    },
    /// A participant acknowledged the decision.
    Ack { txid: Txid, participant_id: String },
    /// Garbage-collect a decided, fully acked record (invariant 10).
    Forget { txid: Txid },
    /// Remember that node `node_id` left the cluster, so the id is never
    /// used again (AddNode refuses it). Recorded by RemoveNode BEFORE the
    /// membership change, so a removal that happened is always remembered.
    /// Idempotent. Appended last: older log entries keep their encoding.
    RetireNodeId { node_id: u64 },
    /// Hands the proposing leader `count` txids, `[first, first + count)`,
    /// which it gives to `BeginAndDecide` transactions without a Raft write
    /// each. Ranges never overlap each other or Begin's ids: all come from
    /// `next_txid`, which only grows (invariant 10). ADR 0012.
    ReserveTxids { count: u64 },
    /// The one replicated write of a transaction committed on the fast path
    /// (ADR 0012): its record, participant set and decision at once, written
    /// after the votes. `txid` comes from a range the leader of `alloc_term`
    /// reserved. Recorded as ABORT instead of `outcome` when the entry
    /// carrying it is of another term than `alloc_term` (a leader of a
    /// later term may have answered "unknown" for `txid` meanwhile), or when
    /// the idempotency key already belongs to another transaction (the
    /// caller's answer is then that one's). Write-once like `Decide`.
    BeginAndDecide {
        txid: Txid,
        alloc_term: u64,
        idempotency_key: String,
        fingerprint: [u8; 32],
        begun_ms: u64,
        deadline_ms: u64,
        participants: Vec<Enlistment>,
        outcome: Outcome,
        /// Must equal the participant set for COMMIT (invariant 2).
        voters: Vec<String>,
        /// Participants that need no phase two (READ_ONLY voters): recorded
        /// as acked with the decision.
        acked: Vec<String>,
        now_ms: u64,
        note: String,
    },
    /// `command` on behalf of the authenticated application `caller`
    /// (ADR 0016): a transaction it creates (Begin,
    /// BeginAndCommit, BeginAndDecide) records `caller` as its owner, whom
    /// the API then holds later calls on it to. Other commands are applied
    /// as they are. Appended last: older log entries keep their encoding.
    As { caller: String, command: Box<Command> },
    /// An operator stops phase two to `participant_id` of the decided
    /// `txid` (gone for good): kept in the table's side map of drops with
    /// `note` ("operator <name>: <reason>") and `now_ms` (the proposing
    /// leader's clock), the record itself unchanged. Refused (as
    /// `CommandOk::OperatorRefused`) for an unknown or undecided
    /// transaction, a participant not enlisted, or one that acked; a
    /// second drop keeps the first one's note and time. Appended last: older
    /// log entries keep their encoding.
    DropParticipant {
        txid: Txid,
        participant_id: String,
        note: String,
        now_ms: u64,
    },
    /// An operator forgets the decided `txid` now rather than after the
    /// retention: only when every participant acked or was dropped, and not
    /// for a COMMIT with a dropped participant that never acked (invariant
    /// 10). `note` says who and why (logged by every node that applies it).
    /// A txid with no record is answered "nothing forgotten". Appended last:
    /// older log entries keep their encoding.
    ForgetByOperator { txid: Txid, note: String },
    /// A write to the saga journal: applied by `saga::SagaBook`, beside the
    /// transaction table, never to a transaction. Appended last: older log
    /// entries keep their encoding.
    Saga(saga::SagaCommand),
    /// The proposing leader opens a new cluster incarnation (ADR 0033):
    /// every txid and saga id handed out from the next ones on belongs to
    /// it. Applied by the store to `incarnation::Incarnations`, beside the
    /// table. A no-op while one is open; refused for 0 or an incarnation of
    /// the history. Appended last: older log entries keep their encoding.
    OpenIncarnation { incarnation: u64 },
    /// An operator declares `participant_id`, the one participant of the
    /// undecided one-phase commit `txid`, lost for good and records
    /// `outcome` as a heuristic decision (source `OperatorHeuristic`, with
    /// `note`: who and why) in `term` at `now_ms`. The participant is
    /// dropped with the same note (no delivery, never counted as its ack):
    /// only its answer could decide a one-phase commit, and it will never
    /// give one. A decision already recorded stays (write-once). Refused
    /// for a transaction that is not a one-phase commit and for another
    /// participant (ADR 0039). Appended last: older log entries keep
    /// their encoding.
    DeclareLost {
        txid: Txid,
        participant_id: String,
        outcome: Outcome,
        term: u64,
        now_ms: u64,
        note: String,
    },
    /// An operator settles `txid` of ANOTHER incarnation `incarnation` (a
    /// txid the old cluster handed out after the backup this cluster was
    /// restored from, or another cluster's) with `outcome`, `note` (who,
    /// why, and the evidence the leader saw), `term` and `now_ms`: the
    /// decision read then answers it with `outcome` instead of
    /// OTHER_INCARNATION, so the participant's recovery applies it
    /// (invariant 5). Applied by the store to `settlement::Settlements`,
    /// beside the table. Write-once (a later one reads the first back);
    /// refused for incarnation 0 and for a txid of this cluster's own
    /// history. ADR 0040. Appended last: older log
    /// entries keep their encoding.
    SettleOther {
        incarnation: u64,
        txid: Txid,
        outcome: Outcome,
        term: u64,
        now_ms: u64,
        note: String,
    },
    /// A branch that prepared where it ran joins the ACTIVE `txid` with
    /// its vote (ADR 0046): enlisted (or found enlisted) at `address`, its
    /// vote recorded write-once, so the driver sends it no Prepare. A NO
    /// decides ABORT in the same command (`reason` in the note). `now_ms`
    /// is the proposing leader's clock, checked against the deadline.
    /// Refused (`CommandOk::BranchRefused`) once the participant set is
    /// frozen, past the deadline, or for a fenced branch. The term it
    /// answers is the entry's. Appended last: older log entries keep their
    /// encoding.
    RegisterBranch {
        txid: Txid,
        participant_id: String,
        address: String,
        vote: BranchVote,
        reason: String,
        now_ms: u64,
    },
    /// Fences `participant_id` out of the ACTIVE `txid` when it is not a
    /// member, so no later registration can make it one: asked by a
    /// branch that prepared and does not know whether it registered. A
    /// member, or a transaction no longer ACTIVE, is left unchanged; the
    /// answer is what the branch does either way (`BranchView`). Appended
    /// last: older log entries keep their encoding.
    ExcludeBranch { txid: Txid, participant_id: String },
}

/// A branch's vote (`Command::RegisterBranch`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BranchVote {
    /// Prepared durably where it ran.
    Yes,
    /// Cannot commit: its work is rolled back, the transaction aborts.
    No,
    /// Changed nothing: acked with the decision.
    ReadOnly,
}

impl fmt::Display for BranchVote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BranchVote::Yes => "YES",
            BranchVote::No => "NO",
            BranchVote::ReadOnly => "READ_ONLY",
        })
    }
}

/// One branch's registration: write-once per (txid, participant id).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    pub vote: BranchVote,
    /// The term of the entry that recorded it: the branch's term floor.
    pub term: u64,
    /// The proposing leader's clock, ms since the Unix epoch.
    pub registered_ms: u64,
}

/// The branches of one transaction: who registered with which vote, and
/// who was fenced out. Kept beside the record (like drops), removed with
/// it, so the encoding of `TxRecord` and `Participant` is unchanged.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct Branches {
    pub registered: BTreeMap<String, Registration>,
    /// Participant ids fenced out while the transaction was ACTIVE: never
    /// members of it (`Command::ExcludeBranch`).
    pub fenced: BTreeSet<String>,
}

/// Why a branch's registration is refused (nothing recorded). The
/// messages are the ones the branch's service logs.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BranchRefusal {
    #[error(
        "transaction {txid} is {phase}: its participant set is frozen without participant {participant_id:?}, \
         which must roll its prepared work back"
    )]
    TooLate {
        txid: Txid,
        participant_id: String,
        phase: String,
    },
    #[error(
        "transaction {txid} passed its deadline ({deadline_ms} ms since the Unix epoch, now {now_ms}): \
         participant {participant_id:?} must roll its prepared work back"
    )]
    PastDeadline {
        txid: Txid,
        participant_id: String,
        deadline_ms: u64,
        now_ms: u64,
    },
    #[error(
        "transaction {txid} is not known here any more (forgotten after its decision): participant \
         {participant_id:?} was not in it and must roll its prepared work back"
    )]
    Forgotten { txid: Txid, participant_id: String },
    #[error(
        "participant {participant_id:?} was fenced out of transaction {txid} (its decision was asked before it \
         registered): it must roll its prepared work back"
    )]
    Fenced { txid: Txid, participant_id: String },
    #[error(
        "participant {participant_id:?} registered in transaction {txid} with vote {recorded} before; that vote stands"
    )]
    VoteConflict {
        txid: Txid,
        participant_id: String,
        recorded: BranchVote,
    },
    #[error(
        "participant {participant_id:?} is in transaction {txid} with address {recorded:?}, not {asked:?}; the \
         recorded address stands"
    )]
    AddressConflict {
        txid: Txid,
        participant_id: String,
        recorded: String,
        asked: String,
    },
}

impl BranchRefusal {
    /// True when the branch is certainly not a member and must roll its
    /// prepared work back (as opposed to a conflict with its own earlier
    /// registration).
    pub fn must_roll_back(&self) -> bool {
        !matches!(
            self,
            BranchRefusal::VoteConflict { .. } | BranchRefusal::AddressConflict { .. }
        )
    }
}

/// What a branch does with its prepared work, by (txid, participant id).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BranchView {
    /// A member: the transaction's decision, or PENDING.
    Member(DecisionView),
    /// Not a member of an ACTIVE transaction and not fenced yet: fence it
    /// (`Command::ExcludeBranch`) before answering ABORT.
    Unfenced,
    /// Not a member, and never to be one: ABORT, whatever the
    /// transaction's own decision.
    Outside,
}

/// One participant named at BeginAndCommit.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Enlistment {
    pub participant_id: String,
    pub address: String,
    pub payload: Vec<u8>,
}

/// Successful results, one per command.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum CommandOk {
    Began {
        txid: Txid,
        existing: bool,
        deadline_ms: u64,
    },
    Enlisted {
        participant_count: u32,
    },
    CommitRequested {
        participants: Vec<Participant>,
        decision: Option<Decision>,
        one_phase: bool,
    },
    /// BeginAndCommit: the transaction (new or found by key) is PREPARING
    /// or already decided.
    BegunCommitting {
        txid: Txid,
        existing: bool,
        deadline_ms: u64,
        participants: Vec<Participant>,
        decision: Option<Decision>,
        one_phase: bool,
    },
    Decided {
        decision: Decision,
        /// True when this command recorded it; false when it already existed.
        recorded: bool,
    },
    Acked {
        all_acked: bool,
    },
    Forgotten,
    /// `RetireNodeId`: `newly` is false when the id was retired before.
    NodeIdRetired {
        newly: bool,
    },
    /// `ReserveTxids`: the range `[first, end)` is the proposer's.
    TxidsReserved {
        first: Txid,
        end: Txid,
    },
    /// `BeginAndDecide`: the decision recorded for `txid` (or, on a repeat,
    /// the one recorded before, `recorded` false). `key_holder` names the
    /// transaction the idempotency key already belonged to, if another:
    /// `txid` was then recorded as ABORT and the caller's request is that
    /// one.
    BegunDecided {
        txid: Txid,
        decision: Decision,
        recorded: bool,
        key_holder: Option<Txid>,
    },
    /// `DropParticipant`: `recorded` is false when it was dropped before.
    ParticipantDropped {
        recorded: bool,
    },
    /// `ForgetByOperator`: the outcome of the record forgotten, None when
    /// there was no record (never begun, or forgotten before).
    ForgottenByOperator {
        outcome: Option<Outcome>,
    },
    /// An operator command (`DropParticipant`, `ForgetByOperator`) refused
    /// by the state it met at apply. A result rather than a
    /// `CommandError`: its gRPC code and message are the operator API's own
    /// (`OperatorRefusal::not_found`), where a `CommandError` has one
    /// mapping for every command.
    OperatorRefused(OperatorRefusal),
    /// What a `Command::Saga` did.
    Saga(saga::SagaOk),
    /// `OpenIncarnation`: the incarnation open now; `newly` is false when
    /// one was open already (it stays, and this is it).
    IncarnationOpened {
        incarnation: u64,
        newly: bool,
    },
    /// `SettleOther`: the settlement standing after the command; `recorded`
    /// is false when one stood before (it stays, whatever this one asked).
    Settled {
        settlement: Settlement,
        recorded: bool,
    },
    /// `RegisterBranch`: the registration standing after the command
    /// (`existing` when it was recorded before), in the entry term `term`;
    /// `decision` is the ABORT a NO registration recorded (or found).
    BranchRegistered {
        term: u64,
        existing: bool,
        deadline_ms: u64,
        participant_count: u32,
        decision: Option<Decision>,
    },
    /// `RegisterBranch` refused by the state it met at apply; nothing
    /// changed. A result rather than a `CommandError`: the API answers it
    /// with its own refusal kind (`x-dtx-branch-refusal`).
    BranchRefused(BranchRefusal),
    /// `ExcludeBranch`: what the branch does now. A member follows the
    /// transaction (`decided` None: PENDING); a branch that is not one
    /// aborts (`decided` ABORT). `fenced_now` when this command fenced it.
    BranchExcluded {
        member: bool,
        decided: Option<Outcome>,
        fenced_now: bool,
    },
}

/// Refusals. They are part of the replicated result, so they are data.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CommandError {
    #[error("transaction {txid} not found (never begun here, or forgotten)")]
    NotFound { txid: Txid },
    #[error("idempotency key {key:?} was used for transaction {txid} with a different request")]
    KeyConflict { key: String, txid: Txid },
    #[error("transaction {txid} is {phase}, not ACTIVE")]
    NotActive { txid: Txid, phase: String },
    #[error("transaction {txid} already has {limit} participants (limit participants_max)")]
    TooManyParticipants { txid: Txid, limit: usize },
    #[error(
        "participant {participant_id:?} is already enlisted in transaction {txid} with another address or payload"
    )]
    ParticipantConflict { txid: Txid, participant_id: String },
    #[error("COMMIT of transaction {txid} refused: voters {voters:?} differ from enlisted participants {enlisted:?}")]
    VotersMismatch {
        txid: Txid,
        voters: Vec<String>,
        enlisted: Vec<String>,
    },
    #[error("transaction {txid} deadline {deadline_ms} not reached at {now_ms}")]
    DeadlineNotReached { txid: Txid, deadline_ms: u64, now_ms: u64 },
    #[error("transaction {txid} has no decision yet")]
    NotDecided { txid: Txid },
    #[error("transaction {txid} has participants that did not ack: {pending:?}")]
    NotAllAcked { txid: Txid, pending: Vec<String> },
    #[error("participant {participant_id:?} is not enlisted in transaction {txid}")]
    UnknownParticipant { txid: Txid, participant_id: String },
    #[error(
        "transaction {txid} is committing in one phase: only its participant's answer decides it (bring the participant back; if it is gone for good, declare it lost: admin txn resolve {txid} --abort|--commit --participant-lost --reason ...)"
    )]
    OnePhaseOnly { txid: Txid },
    #[error(
        "operator COMMIT of transaction {txid} refused: it is {phase}, so no prepare round was recorded and no participant can hold a YES vote (invariant 2); resolve it with ABORT"
    )]
    OperatorCommitNotPrepared { txid: Txid, phase: String },
    #[error("{0}")]
    Invalid(String),
    /// A `Command::Saga` refused; nothing changed.
    #[error("{0}")]
    Saga(saga::SagaError),
    /// A `Command::SettleOther` refused; nothing changed.
    #[error("{0}")]
    SettlementRefused(SettlementRefusal),
    /// An Enlist of a participant fenced out of the transaction
    /// (`Command::ExcludeBranch`). Appended last.
    #[error("participant {participant_id:?} was fenced out of transaction {txid}: it cannot join it any more")]
    Fenced { txid: Txid, participant_id: String },
}

pub type CommandResult = Result<CommandOk, CommandError>;

/// What changed, for the storage layer and the leader's loops.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect {
    /// The record of `txid`, or what is kept beside it (its owner, its
    /// drops), was created or changed: persist them.
    Put(Txid),
    /// The record of `txid` was removed (with its owner and drops): delete
    /// them.
    Remove(Txid),
    /// A decision was recorded (only on first recording).
    Decided(Txid, Outcome),
    /// The set of retired node ids changed: persist it.
    RetiredNodeIdsChanged,
}

/// All replicated transaction state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TxTable {
    /// The next id Begin hands out. Only grows: ids are never reused
    /// (invariant 10), also not after Forget or across leaders.
    next_txid: Txid,
    txs: BTreeMap<Txid, TxRecord>,
    /// Derived index: idempotency key -> txid. Hashed, not ordered: it is
    /// only looked up, and keys often share long prefixes, which an ordered
    /// map compares byte by byte at every level.
    keys: HashMap<String, Txid>,
    /// Derived index: (deadline, txid) of every undecided transaction, so the
    /// reaper finds expired ones without scanning the table.
    deadlines: BTreeSet<(u64, Txid)>,
    /// Derived index: (decided_ms, txid) of every decided transaction whose
    /// participants all acked: the candidates for Forget.
    done: BTreeSet<(u64, Txid)>,
    /// Derived index: transactions in PREPARING (a new leader re-drives them).
    preparing: BTreeSet<Txid>,
    /// Derived index: decided transactions with a participant that has not
    /// acked (the leader delivers their decision).
    undelivered: BTreeSet<Txid>,
    /// Ids of nodes removed from the cluster: never to be used again.
    retired_node_ids: BTreeSet<u64>,
    /// The application that created each transaction created through
    /// `Command::As`; write-once, removed with the record.
    owners: BTreeMap<Txid, String>,
    /// Participants an operator dropped from phase two
    /// (`Command::DropParticipant`), per transaction; kept (also after a
    /// dropped participant acks) until the record is removed.
    dropped: BTreeMap<Txid, Drops>,
    /// The branches of each transaction that has any (`sm::branch`); kept
    /// until the record is removed.
    branches: BTreeMap<Txid, Branches>,
}

/// An operator's drop of one participant from phase two.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Dropped {
    /// Who and why: "operator <name>: <reason>".
    pub note: String,
    /// The proposing leader's clock, ms since the Unix epoch.
    pub dropped_ms: u64,
}

/// The drops of one transaction, by participant id.
pub type Drops = BTreeMap<String, Dropped>;

/// Why an operator's `DropParticipant` or `ForgetByOperator` is refused.
/// The messages are the ones the operator sees.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OperatorRefusal {
    #[error(
        "transaction {txid} not found: never begun here, or forgotten (it may have been forgotten already, after \
         every participant acked or by an operator)"
    )]
    UnknownTransaction { txid: Txid },
    #[error("transaction {txid} is not decided; resolve it first (admin txn resolve)")]
    NotDecided { txid: Txid },
    #[error("participant {participant_id:?} is not enlisted in transaction {txid}; its participants are {enlisted:?}")]
    NotEnlisted {
        txid: Txid,
        participant_id: String,
        enlisted: Vec<String>,
    },
    #[error(
        "participant {participant_id:?} acked the {outcome} of transaction {txid}: it has the decision, so there is \
         nothing to drop"
    )]
    AlreadyAcked {
        txid: Txid,
        participant_id: String,
        outcome: Outcome,
    },
    #[error(
        "transaction {txid} is still being delivered: {pending:?} did not ack its decision yet; forget it once they \
         ack, or drop those that are gone for good first (admin txn drop-participant)"
    )]
    StillDelivering { txid: Txid, pending: Vec<String> },
    #[error(
        "transaction {txid} was decided COMMIT and its dropped participants {dropped:?} never acked: if one of them \
         came back, the cluster would answer \"unknown: presumed abort\" for a forgotten transaction and it would \
         abort while the others committed, breaking atomicity (invariants 3 and 10, docs/protocol.md); the record is kept so \
         that it learns COMMIT"
    )]
    CommitWithDroppedUnacked { txid: Txid, dropped: Vec<String> },
    #[error(
        "transaction {txid} is not a one-phase commit: declaring its participant lost is only for a one-phase \
         commit, which only its participant could decide; resolve it instead (admin txn resolve --abort, or \
         --commit when every participant holds a YES), then drop the participants that are gone"
    )]
    NotOnePhase { txid: Txid },
}

impl OperatorRefusal {
    /// NOT_FOUND (the transaction or the participant does not exist);
    /// otherwise FAILED_PRECONDITION.
    pub fn not_found(&self) -> bool {
        matches!(
            self,
            OperatorRefusal::UnknownTransaction { .. } | OperatorRefusal::NotEnlisted { .. }
        )
    }
}

/// True when `r` is decided and a participant that is not in `drops` has
/// not acked: the leader owes it phase two.
fn owes_delivery(r: &TxRecord, drops: Option<&Drops>) -> bool {
    r.decision().is_some()
        && r.participants
            .iter()
            .any(|p| !p.acked && !drops.is_some_and(|d| d.contains_key(&p.id)))
}

/// An operator's settlement of one txid of another incarnation.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Settlement {
    pub outcome: Outcome,
    /// Who and why, with the evidence the leader saw:
    /// "operator <name>: <reason> (evidence: ...)".
    pub note: String,
    /// The proposing leader's clock, ms since the Unix epoch.
    pub settled_ms: u64,
    /// The proposing leader's term.
    pub term: u64,
}

impl Settlement {
    /// What a participant is told with the outcome (and logs):
    /// `GetDecisionResponse.settled_by`.
    pub fn describe(&self) -> String {
        format!(
            "settled {} by an operator of the cluster (admin txn settle-other) in term {} at {} ms since the Unix \
             epoch: {}",
            self.outcome, self.term, self.settled_ms, self.note
        )
    }
}

/// Why a settlement is refused (nothing recorded). The messages are the
/// ones the operator sees.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SettlementRefusal {
    #[error(
        "incarnation 0 means \"before incarnations\": a participant asking about txid {txid} with incarnation 0 is \
         answered from this cluster's own transaction table, so a settlement would never be read; give the \
         incarnation the participant lists for it (admin participant --address P --in-doubt)"
    )]
    IncarnationZero { txid: Txid },
    #[error(
        "txid {txid} of incarnation {incarnation:016x} was handed out by this cluster (or will be, in its open \
         incarnation): participants are answered from its transaction table, not from settlements; see admin txn \
         show {txid}, and resolve it there (admin txn resolve) if it is undecided"
    )]
    OwnTxid { incarnation: u64, txid: Txid },
}

/// What a reader learns about a decision (linearizable reads return this).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecisionView {
    Pending,
    Decided(Outcome),
    /// No record: never begun, or forgotten (after all acks, or by an
    /// operator when nothing could contradict an abort). Presumed abort.
    Unknown,
}

impl Default for TxTable {
    fn default() -> Self {
        TxTable::new()
    }
}

impl TxTable {
    pub fn new() -> Self {
        TxTable {
            next_txid: 1,
            txs: BTreeMap::new(),
            keys: HashMap::new(),
            deadlines: BTreeSet::new(),
            done: BTreeSet::new(),
            preparing: BTreeSet::new(),
            undelivered: BTreeSet::new(),
            retired_node_ids: BTreeSet::new(),
            owners: BTreeMap::new(),
            dropped: BTreeMap::new(),
            branches: BTreeMap::new(),
        }
    }

    /// Keeps the derived `deadlines` and `done` indexes in step with one
    /// record (call after every change to it; `None` = removed).
    fn reindex(&mut self, txid: Txid, before: Option<(u64, Option<u64>, bool)>) {
        if let Some((deadline, decided, acked)) = before {
            self.deadlines.remove(&(deadline, txid));
            if let (Some(d), true) = (decided, acked) {
                self.done.remove(&(d, txid));
            }
        }
        self.preparing.remove(&txid);
        self.undelivered.remove(&txid);
        if let Some(r) = self.txs.get(&txid) {
            match r.decision() {
                None => {
                    // A one-phase commit is never aborted for its deadline
                    // (the participant may have committed): it is re-driven.
                    if !r.one_phase {
                        self.deadlines.insert((r.deadline_ms, txid));
                    }
                    if r.phase == Phase::Preparing {
                        self.preparing.insert(txid);
                    }
                }
                Some(d) if r.all_acked() => {
                    self.done.insert((d.decided_ms, txid));
                }
                Some(_) if owes_delivery(r, self.dropped.get(&txid)) => {
                    self.undelivered.insert(txid);
                }
                // Every participant left to ack was dropped by an operator:
                // nothing to deliver, and not forgotten by the leader loop
                // (an operator forgets it, `ForgetByOperator`).
                Some(_) => {}
            }
        }
    }

    fn index_key(&self, txid: Txid) -> Option<(u64, Option<u64>, bool)> {
        self.txs
            .get(&txid)
            .map(|r| (r.deadline_ms, r.decision().map(|d| d.decided_ms), r.all_acked()))
    }

    /// Undecided transactions whose deadline has passed at `now_ms` (the
    /// tally's rule: at or before it), earliest first, at most `max`.
    pub fn expired(&self, now_ms: u64, max: usize) -> Vec<Txid> {
        self.deadlines
            .iter()
            .take_while(|(d, _)| deadline_passed(*d, now_ms))
            .take(max)
            .map(|(_, t)| *t)
            .collect()
    }

    /// Decided, fully acked transactions decided at or before
    /// `decided_before_ms`, oldest first, at most `max`.
    pub fn forgettable(&self, decided_before_ms: u64, max: usize) -> Vec<Txid> {
        self.done
            .iter()
            .take_while(|(d, _)| *d <= decided_before_ms)
            .take(max)
            .map(|(_, t)| *t)
            .collect()
    }

    /// Transactions in PREPARING, at most `max`, lowest txid first.
    pub fn preparing(&self, max: usize) -> Vec<Txid> {
        self.preparing_after(0).take(max).collect()
    }

    /// Decided transactions with a participant still to ack (one an
    /// operator did not drop), at most `max`.
    pub fn undelivered(&self, max: usize) -> Vec<Txid> {
        self.undelivered_after(0).take(max).collect()
    }

    /// Every transaction in PREPARING, starting after `cursor` and wrapping
    /// around: a caller that takes a few per round and moves its cursor to
    /// the last one taken visits each in turn, so transactions stuck for good
    /// at low txids never starve the others (invariant 11).
    pub fn preparing_after(&self, cursor: Txid) -> impl Iterator<Item = Txid> + '_ {
        wrapped_after(&self.preparing, cursor)
    }

    /// Every decided transaction with a participant still to ack, starting
    /// after `cursor` and wrapping around (see `preparing_after`).
    pub fn undelivered_after(&self, cursor: Txid) -> impl Iterator<Item = Txid> + '_ {
        wrapped_after(&self.undelivered, cursor)
    }

    /// How many decided transactions wait for at least one ack (of a
    /// participant not dropped).
    pub fn undelivered_count(&self) -> usize {
        self.undelivered.len()
    }

    /// How many transactions are in PREPARING.
    pub fn preparing_count(&self) -> usize {
        self.preparing.len()
    }

    /// Rebuilds a table from persisted parts (keys are derived).
    pub fn from_parts(next_txid: Txid, records: impl IntoIterator<Item = TxRecord>) -> Self {
        let mut t = TxTable {
            next_txid: next_txid.max(1),
            ..TxTable::new()
        };
        for r in records {
            // Never hand out a txid a record already holds (invariant 10),
            // even if the persisted next_txid lags behind the records.
            t.next_txid = t.next_txid.max(r.txid.saturating_add(1));
            if !r.idempotency_key.is_empty() {
                // A BeginAndDecide whose key belonged to another transaction
                // is recorded without one.
                t.keys.insert(r.idempotency_key.clone(), r.txid);
            }
            let txid = r.txid;
            t.txs.insert(txid, r);
            t.reindex(txid, None);
        }
        t
    }

    pub fn next_txid(&self) -> Txid {
        self.next_txid
    }

    /// The application that created `txid`, if it was created on behalf
    /// of one (`Command::As`). Write-once: once a record is applied here,
    /// its owner never changes.
    pub fn owner(&self, txid: Txid) -> Option<&str> {
        self.owners.get(&txid).map(String::as_str)
    }

    /// Every recorded owner (for snapshots and persistence).
    pub fn owners(&self) -> &BTreeMap<Txid, String> {
        &self.owners
    }

    /// Adds the persisted owners (at start or from a snapshot); those of
    /// transactions without a record are dropped.
    pub fn with_owners(mut self, owners: impl IntoIterator<Item = (Txid, String)>) -> Self {
        for (t, o) in owners {
            if self.txs.contains_key(&t) {
                self.owners.insert(t, o);
            }
        }
        self
    }

    pub fn get(&self, txid: Txid) -> Option<&TxRecord> {
        self.txs.get(&txid)
    }

    /// The transaction an idempotency key belongs to, if any.
    pub fn txid_of_key(&self, key: &str) -> Option<Txid> {
        self.keys.get(key).copied()
    }

    pub fn len(&self) -> usize {
        self.txs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.txs.is_empty()
    }

    pub fn records(&self) -> impl Iterator<Item = &TxRecord> {
        self.txs.values()
    }

    pub fn decision_view(&self, txid: Txid) -> DecisionView {
        match self.txs.get(&txid) {
            None => DecisionView::Unknown,
            Some(r) => match &r.phase {
                Phase::Decided(d) => DecisionView::Decided(d.outcome),
                _ => DecisionView::Pending,
            },
        }
    }

    /// Applies one command of a term-0 entry (tests of commands whose result
    /// does not depend on the entry's term); see `apply_in_term`.
    pub fn apply(&mut self, cmd: &Command, effects: &mut Vec<Effect>) -> CommandResult {
        self.apply_in_term(0, cmd, effects)
    }

    /// Applies one command carried by a log entry of term `entry_term`.
    /// Pure: the same table, term and command always give the same result,
    /// effects and new table.
    pub fn apply_in_term(&mut self, entry_term: u64, cmd: &Command, effects: &mut Vec<Effect>) -> CommandResult {
        let first_effect = effects.len();
        let txid = command_txid(cmd);
        let before = txid.and_then(|t| self.index_key(t));
        let result = self.apply_inner(entry_term, cmd, effects);
        if effects.len() > first_effect {
            // Begin creates its txid: index whatever the effects name.
            let changed: BTreeSet<Txid> = effects[first_effect..]
                .iter()
                .filter_map(|e| match e {
                    Effect::Put(t) | Effect::Remove(t) => Some(*t),
                    Effect::Decided(..) | Effect::RetiredNodeIdsChanged => None,
                })
                .collect();
            for t in changed {
                let b = if Some(t) == txid { before } else { None };
                self.reindex(t, b);
            }
        }
        result
    }

    fn apply_inner(&mut self, entry_term: u64, cmd: &Command, effects: &mut Vec<Effect>) -> CommandResult {
        match cmd {
            Command::Begin {
                idempotency_key,
                fingerprint,
                now_ms,
                timeout_ms,
            } => self.begin(idempotency_key, fingerprint, *now_ms, *timeout_ms, effects),
            Command::Enlist {
                txid,
                participant_id,
                address,
                payload,
            } => self.enlist(*txid, participant_id, address, payload, effects),
            Command::RequestCommit { txid } => self.request_commit(*txid, false, effects),
            Command::RequestCommitOnePhase { txid } => self.request_commit(*txid, true, effects),
            Command::BeginAndCommit {
                idempotency_key,
                fingerprint,
                now_ms,
                timeout_ms,
                participants,
                one_phase_allowed,
            } => self.begin_and_commit(
                idempotency_key,
                fingerprint,
                (*now_ms, *timeout_ms),
                participants,
                *one_phase_allowed,
                effects,
            ),
            Command::Decide {
                txid,
                outcome,
                voters,
                source,
                term,
                now_ms,
                note,
            } => {
                let decision = Decision {
                    outcome: *outcome,
                    source: *source,
                    term: *term,
                    decided_ms: *now_ms,
                    note: note.clone(),
                };
                self.decide(*txid, decision, voters, effects)
            }
            Command::Ack { txid, participant_id } => self.ack(*txid, participant_id, effects),
            Command::Forget { txid } => self.forget(*txid, effects),
            Command::RetireNodeId { node_id } => self.retire_node_id(*node_id, effects),
            Command::ReserveTxids { count } => self.reserve_txids(*count),
            Command::BeginAndDecide {
                txid,
                alloc_term,
                idempotency_key,
                fingerprint,
                begun_ms,
                deadline_ms,
                participants,
                outcome,
                voters,
                acked,
                now_ms,
                note,
            } => self.begin_and_decide(
                entry_term,
                FastRecord {
                    txid: *txid,
                    alloc_term: *alloc_term,
                    key: idempotency_key,
                    fingerprint,
                    begun_ms: *begun_ms,
                    deadline_ms: *deadline_ms,
                    participants,
                },
                (*outcome, voters, acked),
                (*now_ms, note),
                effects,
            ),
            Command::DropParticipant {
                txid,
                participant_id,
                note,
                now_ms,
            } => self.drop_participant(*txid, participant_id, note, *now_ms, effects),
            Command::ForgetByOperator { txid, note } => self.forget_by_operator(*txid, note, effects),
            Command::DeclareLost {
                txid,
                participant_id,
                outcome,
                term,
                now_ms,
                note,
            } => {
                let decision = Decision {
                    outcome: *outcome,
                    source: DecisionSource::OperatorHeuristic,
                    term: *term,
                    decided_ms: *now_ms,
                    note: note.clone(),
                };
                self.declare_lost(*txid, participant_id, decision, effects)
            }
            Command::RegisterBranch {
                txid,
                participant_id,
                address,
                vote,
                reason,
                now_ms,
            } => self.register_branch(
                entry_term,
                *txid,
                (participant_id, address),
                (*vote, reason),
                *now_ms,
                effects,
            ),
            Command::ExcludeBranch { txid, participant_id } => self.exclude_branch(*txid, participant_id, effects),
            // The store applies saga commands to its `SagaBook`.
            Command::Saga(_) => Err(CommandError::Invalid(
                "a saga command is applied to the saga journal, not to the transaction table".to_string(),
            )),
            // The store applies it to the incarnations, beside the table.
            Command::OpenIncarnation { .. } => Err(CommandError::Invalid(
                "an incarnation is opened in the state machine's history, not in the transaction table".to_string(),
            )),
            // The store applies it to the settlements, beside the table.
            Command::SettleOther { .. } => Err(CommandError::Invalid(
                "another incarnation's transaction is settled beside the transaction table, not in it".to_string(),
            )),
            Command::As { caller, command } => {
                let result = self.apply_inner(entry_term, command, effects)?;
                let created = match (&**command, &result) {
                    (
                        Command::Begin { .. },
                        CommandOk::Began {
                            txid, existing: false, ..
                        },
                    )
                    | (
                        Command::BeginAndCommit { .. },
                        CommandOk::BegunCommitting {
                            txid, existing: false, ..
                        },
                    )
                    | (
                        Command::BeginAndDecide { .. },
                        CommandOk::BegunDecided {
                            txid, recorded: true, ..
                        },
                    ) => Some(*txid),
                    _ => None,
                };
                if let Some(t) = created {
                    if self.txs.contains_key(&t) && !self.owners.contains_key(&t) {
                        self.owners.insert(t, caller.clone());
                        effects.push(Effect::Put(t));
                    }
                }
                Ok(result)
            }
        }
    }

    fn begin(
        &mut self,
        key: &str,
        fingerprint: &[u8; 32],
        now_ms: u64,
        timeout_ms: u64,
        effects: &mut Vec<Effect>,
    ) -> CommandResult {
        check_id("idempotency_key", key)?;
        if let Some(&txid) = self.keys.get(key) {
            let r = &self.txs[&txid];
            if &r.fingerprint != fingerprint {
                return Err(CommandError::KeyConflict {
                    key: key.to_string(),
                    txid,
                });
            }
            return Ok(CommandOk::Began {
                txid,
                existing: true,
                deadline_ms: r.deadline_ms,
            });
        }
        let txid = self.next_txid;
        self.next_txid += 1;
        let deadline_ms = now_ms.saturating_add(timeout_ms);
        self.txs.insert(
            txid,
            TxRecord {
                txid,
                idempotency_key: key.to_string(),
                fingerprint: *fingerprint,
                begun_ms: now_ms,
                deadline_ms,
                phase: Phase::Active,
                participants: Vec::new(),
                one_phase: false,
            },
        );
        self.keys.insert(key.to_string(), txid);
        effects.push(Effect::Put(txid));
        Ok(CommandOk::Began {
            txid,
            existing: false,
            deadline_ms,
        })
    }

    fn enlist(
        &mut self,
        txid: Txid,
        participant_id: &str,
        address: &str,
        payload: &[u8],
        effects: &mut Vec<Effect>,
    ) -> CommandResult {
        check_id("participant_id", participant_id)?;
        check_len("address", address.len(), limits::ADDRESS_BYTES_MAX)?;
        check_len("payload", payload.len(), limits::PAYLOAD_BYTES_MAX)?;
        if self.is_fenced(txid, participant_id) {
            return Err(CommandError::Fenced {
                txid,
                participant_id: participant_id.to_string(),
            });
        }
        let r = self.txs.get_mut(&txid).ok_or(CommandError::NotFound { txid })?;
        if let Some(p) = r.participants.iter().find(|p| p.id == participant_id) {
            if p.address == address && p.payload == payload {
                return Ok(CommandOk::Enlisted {
                    participant_count: r.participants.len() as u32,
                });
            }
            return Err(CommandError::ParticipantConflict {
                txid,
                participant_id: participant_id.to_string(),
            });
        }
        if r.phase != Phase::Active {
            return Err(CommandError::NotActive {
                txid,
                phase: r.phase.name().to_string(),
            });
        }
        if r.participants.len() >= limits::PARTICIPANTS_MAX {
            return Err(CommandError::TooManyParticipants {
                txid,
                limit: limits::PARTICIPANTS_MAX,
            });
        }
        r.participants.push(Participant {
            id: participant_id.to_string(),
            address: address.to_string(),
            payload: payload.to_vec(),
            acked: false,
        });
        effects.push(Effect::Put(txid));
        Ok(CommandOk::Enlisted {
            participant_count: r.participants.len() as u32,
        })
    }

    fn request_commit(&mut self, txid: Txid, one_phase_allowed: bool, effects: &mut Vec<Effect>) -> CommandResult {
        // A branch that registered has voted: its commit needs no Prepare,
        // so never one phase.
        let any_registered = self.branches.get(&txid).is_some_and(|b| !b.registered.is_empty());
        let r = self.txs.get_mut(&txid).ok_or(CommandError::NotFound { txid })?;
        if r.phase == Phase::Active {
            r.phase = Phase::Preparing;
            r.one_phase = one_phase_allowed && r.participants.len() == 1 && !any_registered;
            effects.push(Effect::Put(txid));
        }
        Ok(CommandOk::CommitRequested {
            participants: r.participants.clone(),
            decision: r.decision().cloned(),
            one_phase: r.one_phase,
        })
    }

    fn begin_and_commit(
        &mut self,
        key: &str,
        fingerprint: &[u8; 32],
        (now_ms, timeout_ms): (u64, u64),
        participants: &[Enlistment],
        one_phase_allowed: bool,
        effects: &mut Vec<Effect>,
    ) -> CommandResult {
        // Validate everything before anything changes: a refused command
        // leaves no trace (not even a used txid).
        check_id("idempotency_key", key)?;
        check_enlistments(participants)?;
        let (txid, existing, deadline_ms) = match self.begin(key, fingerprint, now_ms, timeout_ms, effects)? {
            CommandOk::Began {
                txid,
                existing,
                deadline_ms,
            } => (txid, existing, deadline_ms),
            other => return Err(CommandError::Invalid(format!("unexpected begin result {other:?}"))),
        };
        self.begin_and_commit_rest(txid, existing, deadline_ms, participants, one_phase_allowed)
    }

    fn begin_and_commit_rest(
        &mut self,
        txid: Txid,
        existing: bool,
        deadline_ms: u64,
        participants: &[Enlistment],
        one_phase_allowed: bool,
    ) -> CommandResult {
        let r = self.txs.get_mut(&txid).ok_or(CommandError::NotFound { txid })?;
        if !existing {
            r.participants = participants
                .iter()
                .map(|p| Participant {
                    id: p.participant_id.clone(),
                    address: p.address.clone(),
                    payload: p.payload.clone(),
                    acked: false,
                })
                .collect();
            r.phase = Phase::Preparing;
            r.one_phase = one_phase_allowed && r.participants.len() == 1;
        }
        Ok(CommandOk::BegunCommitting {
            txid,
            existing,
            deadline_ms,
            participants: r.participants.clone(),
            decision: r.decision().cloned(),
            one_phase: r.one_phase,
        })
    }

    fn reserve_txids(&mut self, count: u64) -> CommandResult {
        if count == 0 || count > limits::TXID_RESERVE_COUNT_MAX {
            return Err(CommandError::Invalid(format!(
                "ReserveTxids of {count} txids; it takes 1 to txid_reserve_count_max = {}",
                limits::TXID_RESERVE_COUNT_MAX
            )));
        }
        let first = self.next_txid;
        let end = first
            .checked_add(count)
            .ok_or_else(|| CommandError::Invalid("the txid space is used up".to_string()))?;
        self.next_txid = end;
        Ok(CommandOk::TxidsReserved { first, end })
    }

    /// `BeginAndDecide` (see the command). Validation refuses before
    /// anything changes; every other path records the transaction decided.
    fn begin_and_decide(
        &mut self,
        entry_term: u64,
        rec: FastRecord<'_>,
        (outcome, voters, acked): (Outcome, &[String], &[String]),
        (now_ms, note): (u64, &str),
        effects: &mut Vec<Effect>,
    ) -> CommandResult {
        let txid = rec.txid;
        check_id("idempotency_key", rec.key)?;
        check_enlistments(rec.participants)?;
        check_len("note", note.len(), limits::NOTE_BYTES_MAX)?;
        let enlisted: BTreeSet<&str> = rec.participants.iter().map(|p| p.participant_id.as_str()).collect();
        if let Some(stranger) = voters.iter().chain(acked).find(|v| !enlisted.contains(v.as_str())) {
            return Err(CommandError::UnknownParticipant {
                txid,
                participant_id: stranger.clone(),
            });
        }
        if txid == 0 || txid >= self.next_txid {
            return Err(CommandError::Invalid(format!(
                "txid {txid} was never reserved (the next unreserved txid is {})",
                self.next_txid
            )));
        }
        if let Some(r) = self.txs.get(&txid) {
            // Write-once (invariant 1): a repeat reads the first back.
            return match r.decision() {
                Some(d) => Ok(CommandOk::BegunDecided {
                    txid,
                    decision: d.clone(),
                    recorded: false,
                    key_holder: None,
                }),
                None => Err(CommandError::Invalid(format!(
                    "transaction {txid} exists undecided; BeginAndDecide only creates"
                ))),
            };
        }
        let mut outcome = outcome;
        let mut note = note.to_string();
        let key_holder = self.keys.get(rec.key).copied();
        if let Some(holder) = key_holder {
            outcome = Outcome::Abort;
            note = format!("its idempotency key already belongs to transaction {holder}");
        } else if rec.alloc_term != entry_term {
            // A leader of a later term may have answered "unknown: presumed
            // abort" for this txid; only ABORT agrees with that (ADR 0012).
            outcome = Outcome::Abort;
            note = format!(
                "handed out in term {} but recorded in term {entry_term}: a leader change came between",
                rec.alloc_term
            );
        }
        if outcome == Outcome::Commit {
            // Invariant 2: every participant voted YES (or READ_ONLY).
            let voted: BTreeSet<&str> = voters.iter().map(String::as_str).collect();
            if voted != enlisted || voted.len() != voters.len() {
                return Err(CommandError::VotersMismatch {
                    txid,
                    voters: voters.to_vec(),
                    enlisted: enlisted.iter().map(|s| s.to_string()).collect(),
                });
            }
        }
        let decision = Decision {
            outcome,
            source: DecisionSource::Driver,
            term: rec.alloc_term,
            decided_ms: now_ms,
            note,
        };
        let kept_key = if key_holder.is_none() {
            rec.key.to_string()
        } else {
            String::new()
        };
        self.txs.insert(
            txid,
            TxRecord {
                txid,
                idempotency_key: kept_key.clone(),
                fingerprint: *rec.fingerprint,
                begun_ms: rec.begun_ms,
                deadline_ms: rec.deadline_ms,
                phase: Phase::Decided(decision.clone()),
                participants: rec
                    .participants
                    .iter()
                    .map(|p| Participant {
                        id: p.participant_id.clone(),
                        address: p.address.clone(),
                        payload: p.payload.clone(),
                        acked: acked.contains(&p.participant_id),
                    })
                    .collect(),
                one_phase: false,
            },
        );
        if !kept_key.is_empty() {
            self.keys.insert(kept_key, txid);
        }
        effects.push(Effect::Put(txid));
        effects.push(Effect::Decided(txid, outcome));
        Ok(CommandOk::BegunDecided {
            txid,
            decision,
            recorded: true,
            key_holder,
        })
    }

    fn decide(
        &mut self,
        txid: Txid,
        decision: Decision,
        voters: &[String],
        effects: &mut Vec<Effect>,
    ) -> CommandResult {
        check_len("note", decision.note.len(), limits::NOTE_BYTES_MAX)?;
        let r = self.txs.get_mut(&txid).ok_or(CommandError::NotFound { txid })?;
        // Invariant 1: write-once. The first Decide wins; later ones (even
        // conflicting) read the recorded decision back.
        if let Some(existing) = r.decision() {
            return Ok(CommandOk::Decided {
                decision: existing.clone(),
                recorded: false,
            });
        }
        if r.one_phase {
            // Only the single participant's own answer, reported by the
            // driver, decides a one-phase commit; it has applied that answer
            // already, so it is also its ack.
            let only = r.participants.first().map(|p| p.id.as_str());
            if decision.source != DecisionSource::Driver || voters.len() != 1 || only != Some(voters[0].as_str()) {
                return Err(CommandError::OnePhaseOnly { txid });
            }
        }
        match (decision.outcome, decision.source) {
            (Outcome::Commit, DecisionSource::Reaper) => {
                return Err(CommandError::Invalid("the reaper may only decide ABORT".to_string()));
            }
            (Outcome::Commit, DecisionSource::Operator) if r.phase != Phase::Preparing => {
                // Invariant 2 binds operators too: their COMMIT needs every
                // participant's durable YES, which the leader confirms by
                // asking each one before proposing; without a recorded
                // prepare round no participant can hold one. (The driver
                // may decide COMMIT from ACTIVE with the voter set it
                // collected: Decide itself may freeze the set, docs/protocol.md.)
                return Err(CommandError::OperatorCommitNotPrepared {
                    txid,
                    phase: r.phase.name().to_string(),
                });
            }
            (Outcome::Commit, _) => {
                // Invariant 2: COMMIT only with a YES from every enlisted
                // participant. The set that voted must equal the set enlisted.
                let voted: BTreeSet<&str> = voters.iter().map(String::as_str).collect();
                let enlisted: BTreeSet<&str> = r.participants.iter().map(|p| p.id.as_str()).collect();
                if voted != enlisted || voted.len() != voters.len() {
                    return Err(CommandError::VotersMismatch {
                        txid,
                        voters: voters.to_vec(),
                        enlisted: enlisted.iter().map(|s| s.to_string()).collect(),
                    });
                }
            }
            (Outcome::Abort, DecisionSource::Reaper) => {
                // Invariant 7: presumed abort only past the deadline (the
                // rule the driver's tally applies), and only as a recorded
                // decision.
                if !deadline_passed(r.deadline_ms, decision.decided_ms) {
                    return Err(CommandError::DeadlineNotReached {
                        txid,
                        deadline_ms: r.deadline_ms,
                        now_ms: decision.decided_ms,
                    });
                }
            }
            (Outcome::Abort, _) => {}
        }
        let outcome = decision.outcome;
        if r.one_phase {
            for p in &mut r.participants {
                p.acked = true;
            }
        }
        r.phase = Phase::Decided(decision.clone());
        effects.push(Effect::Put(txid));
        effects.push(Effect::Decided(txid, outcome));
        Ok(CommandOk::Decided {
            decision,
            recorded: true,
        })
    }

    fn ack(&mut self, txid: Txid, participant_id: &str, effects: &mut Vec<Effect>) -> CommandResult {
        let r = self.txs.get_mut(&txid).ok_or(CommandError::NotFound { txid })?;
        if r.decision().is_none() {
            return Err(CommandError::NotDecided { txid });
        }
        let p = r
            .participants
            .iter_mut()
            .find(|p| p.id == participant_id)
            .ok_or_else(|| CommandError::UnknownParticipant {
                txid,
                participant_id: participant_id.to_string(),
            })?;
        if !p.acked {
            p.acked = true;
            effects.push(Effect::Put(txid));
        }
        Ok(CommandOk::Acked {
            all_acked: r.all_acked(),
        })
    }

    fn forget(&mut self, txid: Txid, effects: &mut Vec<Effect>) -> CommandResult {
        let r = self.txs.get(&txid).ok_or(CommandError::NotFound { txid })?;
        if r.decision().is_none() {
            return Err(CommandError::NotDecided { txid });
        }
        // Invariant 10: only after every participant acked the decision.
        let pending: Vec<String> = r
            .participants
            .iter()
            .filter(|p| !p.acked)
            .map(|p| p.id.clone())
            .collect();
        if !pending.is_empty() {
            return Err(CommandError::NotAllAcked { txid, pending });
        }
        self.remove_record(txid, effects);
        Ok(CommandOk::Forgotten)
    }

    /// Removes the record of `txid` with everything kept beside it (key,
    /// owner, drops, branches). `next_txid` is untouched: the id is never handed out
    /// again (invariant 10).
    fn remove_record(&mut self, txid: Txid, effects: &mut Vec<Effect>) {
        let Some(r) = self.txs.remove(&txid) else { return };
        self.owners.remove(&txid);
        self.dropped.remove(&txid);
        self.branches.remove(&txid);
        if self.keys.get(&r.idempotency_key) == Some(&txid) {
            self.keys.remove(&r.idempotency_key);
        }
        effects.push(Effect::Remove(txid));
    }

    /// True while `participant_id` is enlisted in `txid`, its decision is
    /// recorded and that participant's ack is not: the leader will still
    /// deliver the decision to it. A participant keeps its log record while
    /// this holds, since only the record makes a redelivered COMMIT a repeat
    /// (acked) rather than a commit without prepare (refused). False for an
    /// unknown (forgotten) transaction, and for a participant an operator
    /// dropped (nothing more is delivered to it).
    pub fn awaiting_ack(&self, txid: Txid, participant_id: &str) -> bool {
        self.txs.get(&txid).is_some_and(|r| {
            r.decision().is_some()
                && r.participants.iter().any(|p| p.id == participant_id && !p.acked)
                && !self.is_dropped(txid, participant_id)
        })
    }
}

/// A decided record every participant acked, with everything kept beside
/// it: what the store keeps on disk only, out of memory, until the record
/// is forgotten (ADR 0050). Nothing about it changes any more but its
/// removal.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct RetainedRecord {
    pub record: TxRecord,
    pub owner: Option<String>,
    pub drops: Option<Drops>,
    pub branches: Option<Branches>,
}

impl RetainedRecord {
    /// When it was decided (ms since the Unix epoch): the forget loop's
    /// order.
    pub fn decided_ms(&self) -> u64 {
        self.record.decision().map_or(0, |d| d.decided_ms)
    }
}

/// Moving records between memory and the store's retained records (ADR
/// 0050). Neither is a change of replicated state: a table with a record
/// released and admitted again answers every command as before, so these
/// make no effects.
impl TxTable {
    /// Every decided transaction whose participants all acked (the ones
    /// `release` takes), oldest decision first.
    pub fn done_txids(&self) -> Vec<Txid> {
        self.done.iter().map(|(_, t)| *t).collect()
    }

    /// Takes the record of `txid` out of the table with its owner, drops
    /// and branches, when it is decided and every participant acked;
    /// otherwise None and the table is unchanged.
    pub fn release(&mut self, txid: Txid) -> Option<RetainedRecord> {
        let before = self.index_key(txid)?;
        if !matches!(before, (_, Some(_), true)) {
            return None;
        }
        let record = self.txs.remove(&txid)?;
        if self.keys.get(&record.idempotency_key) == Some(&txid) {
            self.keys.remove(&record.idempotency_key);
        }
        self.reindex(txid, Some(before));
        Some(RetainedRecord {
            record,
            owner: self.owners.remove(&txid),
            drops: self.dropped.remove(&txid),
            branches: self.branches.remove(&txid),
        })
    }

    /// Puts a record `release` took out back in (a command or a reader is
    /// about to look at it). A txid already in the table is left as it is.
    pub fn admit(&mut self, r: RetainedRecord) {
        let txid = r.record.txid;
        if self.txs.contains_key(&txid) {
            return;
        }
        self.next_txid = self.next_txid.max(txid.saturating_add(1));
        if !r.record.idempotency_key.is_empty() {
            self.keys.insert(r.record.idempotency_key.clone(), txid);
        }
        self.txs.insert(txid, r.record);
        if let Some(o) = r.owner {
            self.owners.insert(txid, o);
        }
        if let Some(d) = r.drops.filter(|d| !d.is_empty()) {
            self.dropped.insert(txid, d);
        }
        if let Some(b) = r.branches.filter(|b| !b.registered.is_empty() || !b.fenced.is_empty()) {
            self.branches.insert(txid, b);
        }
        self.reindex(txid, None);
    }

    /// The txids of the records in memory above `after`, lowest first.
    pub fn txids_after(&self, after: Txid) -> impl Iterator<Item = Txid> + '_ {
        use std::ops::Bound;
        self.txs
            .range((Bound::Excluded(after), Bound::Unbounded))
            .map(|(t, _)| *t)
    }
}

/// The members of `set` above `cursor`, then those up to and including it.
fn wrapped_after(set: &BTreeSet<Txid>, cursor: Txid) -> impl Iterator<Item = Txid> + '_ {
    use std::ops::Bound;
    set.range((Bound::Excluded(cursor), Bound::Unbounded))
        .chain(set.range(..=cursor))
        .copied()
}

/// Membership memory: node ids that must never be used again.
/// Kept in the same replicated table so it travels in the same snapshots.
impl TxTable {
    fn retire_node_id(&mut self, node_id: u64, effects: &mut Vec<Effect>) -> CommandResult {
        if node_id == 0 {
            return Err(CommandError::Invalid("node id 0 is not a node".to_string()));
        }
        let newly = self.retired_node_ids.insert(node_id);
        if newly {
            effects.push(Effect::RetiredNodeIdsChanged);
        }
        Ok(CommandOk::NodeIdRetired { newly })
    }

    /// True when `node_id` was removed from the cluster (never to be reused).
    pub fn is_retired_node_id(&self, node_id: u64) -> bool {
        self.retired_node_ids.contains(&node_id)
    }

    /// Every retired node id, lowest first.
    pub fn retired_node_ids(&self) -> &BTreeSet<u64> {
        &self.retired_node_ids
    }

    /// This table with `ids` as its retired node ids (rebuilding from
    /// persisted parts; see `from_parts`).
    pub fn with_retired_node_ids(mut self, ids: BTreeSet<u64>) -> Self {
        self.retired_node_ids = ids;
        self
    }
}

/// The existing transaction a command is about (Begin creates one).
pub fn command_txid(cmd: &Command) -> Option<Txid> {
    match cmd {
        Command::Begin { .. }
        | Command::BeginAndCommit { .. }
        | Command::RetireNodeId { .. }
        | Command::ReserveTxids { .. } => None,
        Command::BeginAndDecide { txid, .. } => Some(*txid),
        Command::As { command, .. } => command_txid(command),
        Command::Enlist { txid, .. }
        | Command::RequestCommit { txid }
        | Command::RequestCommitOnePhase { txid }
        | Command::Decide { txid, .. }
        | Command::Ack { txid, .. }
        | Command::Forget { txid }
        | Command::DropParticipant { txid, .. }
        | Command::ForgetByOperator { txid, .. }
        | Command::DeclareLost { txid, .. }
        | Command::RegisterBranch { txid, .. }
        | Command::ExcludeBranch { txid, .. } => Some(*txid),
        // A settlement's txid is another incarnation's, never a record here.
        Command::Saga(_) | Command::OpenIncarnation { .. } | Command::SettleOther { .. } => None,
    }
}

/// The idempotency key a command looks up (a Begin of any kind), if any.
pub fn command_key(cmd: &Command) -> Option<&str> {
    match cmd {
        Command::Begin { idempotency_key, .. }
        | Command::BeginAndCommit { idempotency_key, .. }
        | Command::BeginAndDecide { idempotency_key, .. } => {
            (!idempotency_key.is_empty()).then_some(idempotency_key.as_str())
        }
        Command::As { command, .. } => command_key(command),
        _ => None,
    }
}

/// True when applying `cmd` may hand out a txid or a saga id: the leader
/// opens an incarnation before it proposes one (ADR 0033), so every id
/// handed out belongs to a known incarnation.
pub fn hands_out_ids(cmd: &Command) -> bool {
    match cmd {
        Command::Begin { .. } | Command::BeginAndCommit { .. } | Command::ReserveTxids { .. } => true,
        Command::Saga(saga::SagaCommand::Start { .. }) => true,
        Command::As { command, .. } => hands_out_ids(command),
        _ => false,
    }
}

/// The parts of a `BeginAndDecide` that make the record.
struct FastRecord<'a> {
    txid: Txid,
    alloc_term: u64,
    key: &'a str,
    fingerprint: &'a [u8; 32],
    begun_ms: u64,
    deadline_ms: u64,
    participants: &'a [Enlistment],
}

/// Checks a participant set named at once (BeginAndCommit, BeginAndDecide):
/// not empty, within `limits::PARTICIPANTS_MAX`, each id named once and
/// every field within its limit.
pub fn check_enlistments(participants: &[Enlistment]) -> Result<(), CommandError> {
    if participants.is_empty() {
        return Err(CommandError::Invalid(
            "participants must not be empty: nothing would be committed".to_string(),
        ));
    }
    if participants.len() > limits::PARTICIPANTS_MAX {
        return Err(CommandError::Invalid(format!(
            "{} participants; the limit is participants_max = {}",
            participants.len(),
            limits::PARTICIPANTS_MAX
        )));
    }
    let mut ids = BTreeSet::new();
    for p in participants {
        check_id("participant_id", &p.participant_id)?;
        check_len("address", p.address.len(), limits::ADDRESS_BYTES_MAX)?;
        check_len("payload", p.payload.len(), limits::PAYLOAD_BYTES_MAX)?;
        if !ids.insert(p.participant_id.as_str()) {
            return Err(CommandError::Invalid(format!(
                "participant {:?} is named twice",
                p.participant_id
            )));
        }
    }
    Ok(())
}

/// Checks a non-empty id against `limits::ID_BYTES_MAX` (shared with the API
/// layer, which maps the error to INVALID_ARGUMENT).
pub fn check_id(field: &str, v: &str) -> Result<(), CommandError> {
    if v.is_empty() {
        return Err(CommandError::Invalid(format!("{field} must not be empty")));
    }
    check_len(field, v.len(), limits::ID_BYTES_MAX)
}

/// Checks a length against a limit; the message names the field and limit.
pub fn check_len(field: &str, len: usize, max: usize) -> Result<(), CommandError> {
    if len > max {
        return Err(CommandError::Invalid(format!(
            "{field} is {len} bytes; the limit is {max} bytes"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod admin_tests;
#[cfg(test)]
mod branch_tests;
#[cfg(test)]
mod one_write_tests;
#[cfg(test)]
mod tests;
