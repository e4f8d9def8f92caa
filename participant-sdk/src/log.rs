//! The participant's local log, as a pure function.
//!
//! `step(entry, message)` says what a participant must do with a message
//! from the coordinator given what its durable log holds for that
//! transaction. It does no I/O; the caller performs the returned action and
//! makes the returned entry durable BEFORE it replies (a YES vote only after
//! the fsync of the prepared record, an ack only after the decision's record).
//!
//! Invariants of docs/design.md kept here:
//! - 5: a prepared participant never commits or aborts on its own; only a
//!   Commit or Abort message (a recorded decision) moves it on.
//! - 8: duplicate, late or reordered messages are harmless. Prepare is
//!   idempotent (the same vote again); an Abort before Prepare leaves a
//!   tombstone so the late Prepare votes NO; Commit and Abort are applied once.
//! - 9: a message from a term older than one already seen for the
//!   transaction is rejected; and a Prepare or CommitOnePhase of a
//!   transaction the log holds nothing for, from a term older than the
//!   highest term the participant has recorded in its incarnation (the
//!   durable term floor), is rejected too: a record garbage-collected after
//!   its commit must not let a deposed leader's re-sent one-phase commit
//!   apply the work a second time.
//!
//! A transaction is identified by [`GlobalTxid`]: the txid together with the
//! cluster incarnation that handed it out (docs/adr/0033-cluster-
//! incarnations.md). The same txid number of two incarnations is two
//! independent transactions, each with its own record, term and tombstone.

use serde::Deserialize;
use serde::Serialize;

/// A transaction as a participant knows it: the txid and the incarnation of
/// the cluster that handed it out (`PrepareRequest.incarnation`). A cluster
/// chooses a new random nonzero incarnation when it is created and again
/// after every restore from a backup, so a txid number reused by a restored
/// cluster, or shared by two clusters (staging and production), is another
/// transaction here. Incarnation 0: a coordinator from before incarnations,
/// or a txid handed out before the cluster chose one; such records keep the
/// storage layout of before.
///
/// Ordered by (incarnation, txid); shown as `txid` for incarnation 0 and as
/// `txid@iiiiiiiiiiiiiiii` (the incarnation in 16 hex digits) otherwise.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GlobalTxid {
    pub incarnation: u64,
    pub txid: u64,
}

impl GlobalTxid {
    pub const fn new(incarnation: u64, txid: u64) -> Self {
        GlobalTxid { incarnation, txid }
    }

    /// Bytes that identify the transaction, for a resource's own keys:
    /// the txid's 8 bytes (big-endian) for incarnation 0, as resources
    /// keyed them before incarnations; the incarnation's 8 and then the
    /// txid's 8 otherwise. Distinct transactions get distinct bytes, and
    /// the two forms never collide (different lengths).
    pub fn key_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16);
        if self.incarnation != 0 {
            out.extend_from_slice(&self.incarnation.to_be_bytes());
        }
        out.extend_from_slice(&self.txid.to_be_bytes());
        out
    }

    /// The inverse of [`GlobalTxid::key_bytes`] (8 or 16 bytes).
    pub fn from_key_bytes(b: &[u8]) -> Option<Self> {
        match b.len() {
            8 => Some(GlobalTxid::new(0, u64::from_be_bytes(b.try_into().ok()?))),
            16 => {
                let incarnation = u64::from_be_bytes(b[..8].try_into().ok()?);
                let txid = u64::from_be_bytes(b[8..].try_into().ok()?);
                // Incarnation 0 is always written in the short form.
                (incarnation != 0).then_some(GlobalTxid::new(incarnation, txid))
            }
            _ => None,
        }
    }
}

impl From<u64> for GlobalTxid {
    /// A txid of incarnation 0 (before incarnations).
    fn from(txid: u64) -> Self {
        GlobalTxid { incarnation: 0, txid }
    }
}

/// A bare txid is one of incarnation 0: equal only to that.
impl PartialEq<u64> for GlobalTxid {
    fn eq(&self, txid: &u64) -> bool {
        self.incarnation == 0 && self.txid == *txid
    }
}

impl PartialEq<GlobalTxid> for u64 {
    fn eq(&self, g: &GlobalTxid) -> bool {
        g == self
    }
}

impl std::fmt::Display for GlobalTxid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.incarnation == 0 {
            write!(f, "{}", self.txid)
        } else {
            write!(f, "{}@{:016x}", self.txid, self.incarnation)
        }
    }
}

/// A participant's vote.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Vote {
    Yes,
    No,
    /// Nothing to commit or abort: no phase two will follow.
    ReadOnly,
}

/// What the log holds for one transaction.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LocalState {
    /// Voted YES (or READ_ONLY) and made the work durable; waiting for the
    /// decision. For YES this is "in doubt": locks stay held.
    Prepared { vote: Vote },
    /// The decision COMMIT is applied.
    Committed,
    /// ABORT is applied, or the participant voted NO (its work rolled back),
    /// or an Abort arrived before any Prepare (`tombstone`).
    Aborted { tombstone: bool },
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogEntry {
    pub state: LocalState,
    /// Highest leader term seen in a message for this transaction.
    pub term: u64,
}

/// A message from the coordinator, with the sending leader's term.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Message {
    Prepare {
        term: u64,
    },
    Commit {
        term: u64,
    },
    Abort {
        term: u64,
    },
    /// One-phase commit (this participant is the only one): prepare and,
    /// if the resource agrees, commit at once. The answer is the decision.
    CommitOnePhase {
        term: u64,
    },
}

impl Message {
    pub fn term(&self) -> u64 {
        match self {
            Message::Prepare { term }
            | Message::Commit { term }
            | Message::Abort { term }
            | Message::CommitOnePhase { term } => *term,
        }
    }
}

/// Why a message is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// A message from a term older than one already seen: for this
    /// transaction, or (a Prepare or CommitOnePhase of a transaction with
    /// no record) the participant's durable term floor.
    #[error("message from term {got} is older than term {seen} already seen for this transaction (or by this participant, for a transaction it holds no record of)")]
    StaleTerm { got: u64, seen: u64 },
    /// Protocol violation: Commit for a transaction never prepared here.
    #[error("Commit for a transaction this participant never prepared (protocol violation)")]
    CommitWithoutPrepare,
    /// Protocol violation: Commit after a NO vote, Abort, or tombstone.
    #[error("Commit for a transaction already aborted here (protocol violation)")]
    CommitAfterAbort,
    /// Protocol violation: Abort after Commit was applied.
    #[error("Abort for a transaction already committed here (protocol violation)")]
    AbortAfterCommit,
}

/// What the caller must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Ask the resource to prepare. If it can, record `Prepared` with its
    /// vote together with the prepared work, durably, then vote; if it
    /// cannot, roll back, record `Aborted`, then vote NO.
    PrepareResource,
    /// Apply COMMIT to the prepared work and record `Committed` in the same
    /// durable write, then ack.
    CommitResource,
    /// Roll back the prepared work and record `Aborted` in the same durable
    /// write, then ack.
    AbortResource,
    /// One-phase commit of a transaction not seen before: ask the resource
    /// to prepare; YES: record `Prepared` with the prepared work, then
    /// apply COMMIT and record `Committed` (one fsync covers both), answer
    /// committed; NO: roll back, record `Aborted`, answer not committed.
    OnePhaseResource,
    /// Record the tombstone `Aborted { tombstone: true }` durably, then ack:
    /// a later Prepare of this transaction will vote NO.
    RecordTombstone,
    /// Answer this vote again; nothing changes (idempotent Prepare).
    Vote(Vote),
    /// Ack again; nothing changes (the decision is already applied).
    Ack,
    /// Refuse; nothing changes.
    Refuse(Refusal),
}

/// The log entry after the message, and what to do. When the entry differs
/// from the one passed in, it must be made durable before replying.
///
/// `floor` is the participant's durable term floor for the transaction's
/// incarnation: the highest leader term it has recorded in any message of
/// that incarnation (0 when none). A Prepare or CommitOnePhase of a
/// transaction with no record (`entry` is `None`) from a term below it is
/// refused: it comes from a deposed leader, and the record that would make
/// it a repeat may have been garbage-collected (invariant 9). An Abort of
/// an unknown transaction still leaves its tombstone, and a Commit of one
/// is still a commit without prepare. The caller raises the floor to the
/// term of every record it writes, in the same durable write.
pub fn step(entry: Option<&LogEntry>, msg: Message, floor: u64) -> (Option<LogEntry>, Action) {
    let term = msg.term();
    let Some(e) = entry else {
        if matches!(msg, Message::Prepare { .. } | Message::CommitOnePhase { .. }) && term < floor {
            return (None, Action::Refuse(Refusal::StaleTerm { got: term, seen: floor }));
        }
        return match msg {
            // The resource decides the vote; the caller records the result.
            Message::Prepare { .. } => (None, Action::PrepareResource),
            Message::CommitOnePhase { .. } => (None, Action::OnePhaseResource),
            Message::Commit { .. } => (None, Action::Refuse(Refusal::CommitWithoutPrepare)),
            Message::Abort { .. } => (
                Some(LogEntry {
                    state: LocalState::Aborted { tombstone: true },
                    term,
                }),
                Action::RecordTombstone,
            ),
        };
    };
    if term < e.term {
        return (
            Some(*e),
            Action::Refuse(Refusal::StaleTerm {
                got: term,
                seen: e.term,
            }),
        );
    }
    let with = |state: LocalState| Some(LogEntry { state, term });
    match (e.state, msg) {
        (LocalState::Prepared { vote }, Message::Prepare { .. }) => (with(e.state), Action::Vote(vote)),
        (LocalState::Committed, Message::Prepare { .. }) => (with(e.state), Action::Vote(Vote::Yes)),
        (LocalState::Aborted { .. }, Message::Prepare { .. }) => (with(e.state), Action::Vote(Vote::No)),

        (LocalState::Prepared { vote: Vote::Yes }, Message::Commit { .. }) => {
            (with(LocalState::Committed), Action::CommitResource)
        }
        (LocalState::Prepared { .. }, Message::Commit { .. }) => (with(e.state), Action::Ack),
        (LocalState::Committed, Message::Commit { .. }) => (with(e.state), Action::Ack),
        (LocalState::Aborted { .. }, Message::Commit { .. }) => (Some(*e), Action::Refuse(Refusal::CommitAfterAbort)),

        (LocalState::Prepared { vote: Vote::Yes }, Message::Abort { .. }) => {
            (with(LocalState::Aborted { tombstone: false }), Action::AbortResource)
        }
        (LocalState::Prepared { .. }, Message::Abort { .. }) => (with(e.state), Action::Ack),
        (LocalState::Aborted { .. }, Message::Abort { .. }) => (with(e.state), Action::Ack),
        (LocalState::Committed, Message::Abort { .. }) => (Some(*e), Action::Refuse(Refusal::AbortAfterCommit)),

        // One phase: a repeat answers what the first one did (committed =
        // Ack, not committed = Vote(No)). A YES-prepared entry is left by a
        // one-phase commit that crashed between its two writes: finish it.
        (LocalState::Prepared { vote: Vote::Yes }, Message::CommitOnePhase { .. }) => {
            (with(LocalState::Committed), Action::CommitResource)
        }
        (LocalState::Prepared { vote: Vote::ReadOnly }, Message::CommitOnePhase { .. }) => (with(e.state), Action::Ack),
        (LocalState::Prepared { vote: Vote::No }, Message::CommitOnePhase { .. }) => {
            (with(e.state), Action::Vote(Vote::No))
        }
        (LocalState::Committed, Message::CommitOnePhase { .. }) => (with(e.state), Action::Ack),
        (LocalState::Aborted { .. }, Message::CommitOnePhase { .. }) => (with(e.state), Action::Vote(Vote::No)),
    }
}

/// The entry to record after the resource answered a Prepare.
pub fn prepared(term: u64, vote: Vote) -> LogEntry {
    LogEntry {
        state: match vote {
            Vote::No => LocalState::Aborted { tombstone: false },
            v => LocalState::Prepared { vote: v },
        },
        term,
    }
}

/// True while the participant holds a YES vote without knowing the decision
/// (it must ask the cluster and keep its locks).
pub fn in_doubt(entry: &LogEntry) -> bool {
    entry.state == LocalState::Prepared { vote: Vote::Yes }
}

#[cfg(test)]
mod tests;
