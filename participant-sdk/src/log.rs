//! The participant's local log, as a pure function.
//!
//! `step(entry, message)` says what a participant must do with a message
//! from the coordinator given what its durable log holds for that
//! transaction. It does no I/O; the caller performs the returned action and
//! makes the returned entry durable BEFORE it replies (a YES vote only after
//! the fsync of the prepared record, an ack only after the decision's record).
//!
//! DESIGN invariants kept here:
//! - 5: a prepared participant never commits or aborts on its own; only a
//!   Commit or Abort message (a recorded decision) moves it on.
//! - 8: duplicate, late or reordered messages are harmless. Prepare is
//!   idempotent (the same vote again); an Abort before Prepare leaves a
//!   tombstone so the late Prepare votes NO; Commit and Abort are applied once.
//! - 9: a message from a term older than one already seen for the
//!   transaction is rejected.

use serde::Deserialize;
use serde::Serialize;

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
    #[error("message from term {got} is older than term {seen} already seen for this transaction")]
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
pub fn step(entry: Option<&LogEntry>, msg: Message) -> (Option<LogEntry>, Action) {
    let term = msg.term();
    let Some(e) = entry else {
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
