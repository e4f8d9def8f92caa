"""The participant's log as a pure function (docs/protocol.md, "Participant
log (per txid, at each participant)").

:func:`step` says what a participant must do with a message from the
coordinator given what its durable log holds for the transaction and its
term floor. It does no I/O: the store runs the resource, writes the new
entry together with the resource's change in one SQLite transaction and
answers only after that transaction is durable.

Invariants of docs/design.md kept here:

- 5: a prepared participant never commits or aborts on its own.
- 8: a repeated Prepare answers the recorded vote without the resource; an
  Abort before any Prepare leaves a tombstone so a late Prepare votes NO;
  Commit and Abort are applied once.
- 9: a message from a term older than the record's is refused, and so is a
  Prepare or CommitOnePhase of a transaction without a record from a term
  below the term floor of its incarnation.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from dtx.metadata import RefusalKind


@dataclass(frozen=True, order=True)
class GlobalTxid:
    """A transaction as a participant knows it: the incarnation of the
    cluster that handed the txid out, and the txid. The same txid number of
    two incarnations is two transactions. Shown ``txid`` for incarnation 0
    and ``txid@<16 hex digits>`` otherwise, as the Rust SDK shows it."""

    incarnation: int
    txid: int

    def __str__(self) -> str:
        if self.incarnation == 0:
            return str(self.txid)
        return f"{self.txid}@{self.incarnation:016x}"

    @staticmethod
    def parse(text: str) -> GlobalTxid:
        """The inverse of ``str()``."""
        if "@" in text:
            t, inc = text.split("@", 1)
            return GlobalTxid(int(inc, 16), int(t))
        return GlobalTxid(0, int(text))


class Vote(enum.IntEnum):
    """A participant's vote (the values of ``dtx.v1.Vote``)."""

    YES = 1
    NO = 2
    #: Nothing to commit or abort: no phase two follows.
    READ_ONLY = 3


class State(enum.IntEnum):
    """What the log holds for one transaction (the values of
    ``dtx.v1.LocalRecord``, which Inquire answers)."""

    #: Voted YES, durably, with the prepared work: in doubt, locks held.
    PREPARED_YES = 2
    #: Voted READ_ONLY: nothing to commit or abort.
    PREPARED_READ_ONLY = 3
    #: The decision COMMIT is applied (or a one-phase commit committed).
    COMMITTED = 4
    #: Voted NO, or the decision ABORT is applied.
    ABORTED = 5
    #: An Abort came before any Prepare: a late Prepare votes NO.
    TOMBSTONE = 6


@dataclass(frozen=True)
class LogEntry:
    """One transaction's record: its state and the highest leader term seen
    in a message accepted for it."""

    state: State
    term: int


class Kind(enum.Enum):
    """A coordinator message."""

    PREPARE = "Prepare"
    COMMIT = "Commit"
    ABORT = "Abort"
    #: Prepare and, if the resource agrees, commit at once (the only
    #: participant): the answer is the decision.
    COMMIT_ONE_PHASE = "CommitOnePhase"


@dataclass(frozen=True)
class Message:
    kind: Kind
    term: int


@dataclass(frozen=True)
class Refusal:
    """Why a message is refused; nothing changes."""

    kind: RefusalKind
    #: For STALE_TERM: the message's term and the term already seen (the
    #: record's, or the floor's for a transaction without a record).
    got: int = 0
    seen: int = 0

    def message(self) -> str:
        if self.kind is RefusalKind.STALE_TERM:
            return (
                f"message from term {self.got} is older than term {self.seen} already seen for this "
                "transaction (or by this participant, for a transaction it holds no record of)"
            )
        if self.kind is RefusalKind.COMMIT_WITHOUT_PREPARE:
            return "Commit for a transaction this participant never prepared (protocol violation)"
        if self.kind is RefusalKind.COMMIT_AFTER_ABORT:
            return "Commit for a transaction already aborted here (protocol violation)"
        return "Abort for a transaction already committed here (protocol violation)"


class Do(enum.Enum):
    """What the caller must do."""

    #: Ask the resource to prepare; record its vote (YES with the staged
    #: work, READ_ONLY and NO without it), then answer the vote.
    PREPARE_RESOURCE = "prepare-resource"
    #: One-phase commit of a new transaction: prepare; YES: commit at once
    #: (record COMMITTED with the work); READ_ONLY: record COMMITTED without
    #: work; NO: record ABORTED. Answer committed unless NO.
    ONE_PHASE_RESOURCE = "one-phase-resource"
    #: Commit the prepared work and record COMMITTED in the same write; ack.
    COMMIT_RESOURCE = "commit-resource"
    #: Roll the prepared work back and record ABORTED in the same write; ack.
    ABORT_RESOURCE = "abort-resource"
    #: Record the tombstone; ack.
    RECORD_TOMBSTONE = "record-tombstone"
    #: Answer this vote again (a repeated Prepare; a repeated one-phase
    #: commit that did not commit answers NO).
    VOTE = "vote"
    #: Ack again (or answer committed, for a one-phase commit).
    ACK = "ack"
    #: Refuse; nothing changes.
    REFUSE = "refuse"


@dataclass(frozen=True)
class Action:
    do: Do
    vote: Vote | None = None
    refusal: Refusal | None = None


def step(entry: LogEntry | None, msg: Message, floor: int) -> tuple[LogEntry | None, Action]:
    """The entry after ``msg`` and what to do. When the entry differs from
    ``entry`` it must be made durable (with the resource's change, for the
    resource actions) before the answer. A refusal returns ``entry``
    unchanged.

    ``floor`` is the participant's durable term floor of the transaction's
    incarnation (0 when none): a Prepare or CommitOnePhase of a transaction
    without a record from a term below it is refused; an Abort of such a
    transaction still leaves its tombstone, and a Commit is still a commit
    without prepare. The caller raises the floor to the term of every
    record it writes, in the same write.
    """
    term = msg.term
    if entry is None:
        if msg.kind in (Kind.PREPARE, Kind.COMMIT_ONE_PHASE) and term < floor:
            return None, Action(Do.REFUSE, refusal=Refusal(RefusalKind.STALE_TERM, term, floor))
        if msg.kind is Kind.PREPARE:
            return None, Action(Do.PREPARE_RESOURCE)
        if msg.kind is Kind.COMMIT_ONE_PHASE:
            return None, Action(Do.ONE_PHASE_RESOURCE)
        if msg.kind is Kind.COMMIT:
            return None, Action(Do.REFUSE, refusal=Refusal(RefusalKind.COMMIT_WITHOUT_PREPARE))
        return LogEntry(State.TOMBSTONE, term), Action(Do.RECORD_TOMBSTONE)

    if term < entry.term:
        return entry, Action(Do.REFUSE, refusal=Refusal(RefusalKind.STALE_TERM, term, entry.term))

    def raised(state: State) -> LogEntry:
        return LogEntry(state, term)

    s = entry.state
    aborted = s in (State.ABORTED, State.TOMBSTONE)
    if msg.kind is Kind.PREPARE:
        if s is State.PREPARED_YES or s is State.COMMITTED:
            return raised(s), Action(Do.VOTE, vote=Vote.YES)
        if s is State.PREPARED_READ_ONLY:
            return raised(s), Action(Do.VOTE, vote=Vote.READ_ONLY)
        return raised(s), Action(Do.VOTE, vote=Vote.NO)
    if msg.kind is Kind.COMMIT:
        if s is State.PREPARED_YES:
            return raised(State.COMMITTED), Action(Do.COMMIT_RESOURCE)
        if aborted:
            return entry, Action(Do.REFUSE, refusal=Refusal(RefusalKind.COMMIT_AFTER_ABORT))
        return raised(s), Action(Do.ACK)
    if msg.kind is Kind.ABORT:
        if s is State.PREPARED_YES:
            return raised(State.ABORTED), Action(Do.ABORT_RESOURCE)
        if s is State.COMMITTED:
            return entry, Action(Do.REFUSE, refusal=Refusal(RefusalKind.ABORT_AFTER_COMMIT))
        return raised(s), Action(Do.ACK)
    # CommitOnePhase: a repeat answers what the first did. A YES-prepared
    # record is left by a one-phase commit that stopped between its prepare
    # and its commit, or by an ordinary Prepare (the leader re-drives the
    # one-phase record): finish it.
    if s is State.PREPARED_YES:
        return raised(State.COMMITTED), Action(Do.COMMIT_RESOURCE)
    if aborted:
        return raised(s), Action(Do.VOTE, vote=Vote.NO)
    return raised(s), Action(Do.ACK)


def prepared(term: int, vote: Vote) -> LogEntry:
    """The entry to record after the resource answered a Prepare."""
    if vote is Vote.YES:
        return LogEntry(State.PREPARED_YES, term)
    if vote is Vote.READ_ONLY:
        return LogEntry(State.PREPARED_READ_ONLY, term)
    return LogEntry(State.ABORTED, term)


def in_doubt(entry: LogEntry | None) -> bool:
    """True while the participant holds a YES vote without the decision."""
    return entry is not None and entry.state is State.PREPARED_YES


def recorded_vote(entry: LogEntry | None) -> Vote | None:
    """The vote a record tells of (Inspect's ``vote``): YES for a YES vote
    and for COMMITTED, READ_ONLY for a READ_ONLY vote, none otherwise."""
    if entry is None:
        return None
    if entry.state in (State.PREPARED_YES, State.COMMITTED):
        return Vote.YES
    if entry.state is State.PREPARED_READ_ONLY:
        return Vote.READ_ONLY
    return None


def collectable(entry: LogEntry | None) -> bool:
    """Records that never change again and that log GC may remove once the
    cluster will send nothing more for them: decided ones and READ_ONLY
    votes. An in-doubt YES vote never is."""
    return entry is not None and entry.state is not State.PREPARED_YES
