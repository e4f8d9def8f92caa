"""The pure log step against every row and column of docs/protocol.md's
participant tables, and the fencing rules."""

from __future__ import annotations

import pytest

from dtx.metadata import RefusalKind
from dtx.participant.log import (
    Do,
    GlobalTxid,
    Kind,
    LogEntry,
    Message,
    State,
    Vote,
    collectable,
    in_doubt,
    prepared,
    recorded_vote,
    step,
)

T = 10
P, C, A, O = Kind.PREPARE, Kind.COMMIT, Kind.ABORT, Kind.COMMIT_ONE_PHASE


def e(state: State, term: int = T) -> LogEntry:
    return LogEntry(state, term)


# (record before, message) -> (record after, what to do, vote or refusal)
TABLE = [
    # The log holds nothing.
    (None, P, None, Do.PREPARE_RESOURCE, None),
    (None, C, None, Do.REFUSE, RefusalKind.COMMIT_WITHOUT_PREPARE),
    (None, A, e(State.TOMBSTONE), Do.RECORD_TOMBSTONE, None),
    (None, O, None, Do.ONE_PHASE_RESOURCE, None),
    # PREPARED(YES): in doubt.
    (e(State.PREPARED_YES), P, e(State.PREPARED_YES), Do.VOTE, Vote.YES),
    (e(State.PREPARED_YES), C, e(State.COMMITTED), Do.COMMIT_RESOURCE, None),
    (e(State.PREPARED_YES), A, e(State.ABORTED), Do.ABORT_RESOURCE, None),
    (e(State.PREPARED_YES), O, e(State.COMMITTED), Do.COMMIT_RESOURCE, None),
    # PREPARED(READ_ONLY): nothing to commit or abort.
    (e(State.PREPARED_READ_ONLY), P, e(State.PREPARED_READ_ONLY), Do.VOTE, Vote.READ_ONLY),
    (e(State.PREPARED_READ_ONLY), C, e(State.PREPARED_READ_ONLY), Do.ACK, None),
    (e(State.PREPARED_READ_ONLY), A, e(State.PREPARED_READ_ONLY), Do.ACK, None),
    (e(State.PREPARED_READ_ONLY), O, e(State.PREPARED_READ_ONLY), Do.ACK, None),
    # COMMITTED: applied once.
    (e(State.COMMITTED), P, e(State.COMMITTED), Do.VOTE, Vote.YES),
    (e(State.COMMITTED), C, e(State.COMMITTED), Do.ACK, None),
    (e(State.COMMITTED), A, e(State.COMMITTED), Do.REFUSE, RefusalKind.ABORT_AFTER_COMMIT),
    (e(State.COMMITTED), O, e(State.COMMITTED), Do.ACK, None),
    # ABORTED (a NO vote or an abort) and the tombstone.
    (e(State.ABORTED), P, e(State.ABORTED), Do.VOTE, Vote.NO),
    (e(State.ABORTED), C, e(State.ABORTED), Do.REFUSE, RefusalKind.COMMIT_AFTER_ABORT),
    (e(State.ABORTED), A, e(State.ABORTED), Do.ACK, None),
    (e(State.ABORTED), O, e(State.ABORTED), Do.VOTE, Vote.NO),
    (e(State.TOMBSTONE), P, e(State.TOMBSTONE), Do.VOTE, Vote.NO),
    (e(State.TOMBSTONE), C, e(State.TOMBSTONE), Do.REFUSE, RefusalKind.COMMIT_AFTER_ABORT),
    (e(State.TOMBSTONE), A, e(State.TOMBSTONE), Do.ACK, None),
    (e(State.TOMBSTONE), O, e(State.TOMBSTONE), Do.VOTE, Vote.NO),
]


@pytest.mark.parametrize(("before", "kind", "after", "do", "extra"), TABLE)
def test_every_cell_of_the_participant_table(
    before: LogEntry | None, kind: Kind, after: LogEntry | None, do: Do, extra: object
) -> None:
    got_after, action = step(before, Message(kind, T), 0)
    assert got_after == after
    assert action.do is do
    if do is Do.VOTE:
        assert action.vote is extra
    if do is Do.REFUSE:
        assert action.refusal is not None and action.refusal.kind is extra
        assert action.refusal.message()


@pytest.mark.parametrize("state", list(State))
@pytest.mark.parametrize("kind", list(Kind))
def test_an_older_term_than_the_record_is_refused_and_changes_nothing(state: State, kind: Kind) -> None:
    before = e(state, 7)
    after, action = step(before, Message(kind, 6), 0)
    assert action.do is Do.REFUSE
    assert action.refusal is not None
    assert action.refusal.kind is RefusalKind.STALE_TERM
    assert (action.refusal.got, action.refusal.seen) == (6, 7)
    assert after == before


def test_an_accepted_message_raises_the_term_and_a_refused_one_does_not() -> None:
    after, action = step(e(State.PREPARED_YES, 5), Message(P, 7), 0)
    assert action.do is Do.VOTE and after == e(State.PREPARED_YES, 7)
    after, action = step(e(State.COMMITTED, 5), Message(C, 9), 0)
    assert action.do is Do.ACK and after == e(State.COMMITTED, 9)
    # A protocol violation at a newer term keeps the record's term.
    after, action = step(e(State.COMMITTED, 5), Message(A, 9), 0)
    assert action.do is Do.REFUSE and after == e(State.COMMITTED, 5)
    after, action = step(e(State.TOMBSTONE, 5), Message(C, 9), 0)
    assert action.do is Do.REFUSE and after == e(State.TOMBSTONE, 5)


def test_below_the_term_floor_a_new_prepare_or_one_phase_commit_is_refused() -> None:
    for kind in (P, O):
        after, action = step(None, Message(kind, 3), 9)
        assert after is None
        assert action.do is Do.REFUSE and action.refusal is not None
        assert action.refusal.kind is RefusalKind.STALE_TERM
        assert (action.refusal.got, action.refusal.seen) == (3, 9)
    # At the floor it prepares.
    assert step(None, Message(P, 9), 9)[1].do is Do.PREPARE_RESOURCE
    # An Abort still leaves its tombstone; a Commit is still without prepare.
    after, action = step(None, Message(A, 3), 9)
    assert action.do is Do.RECORD_TOMBSTONE and after == e(State.TOMBSTONE, 3)
    after, action = step(None, Message(C, 3), 9)
    assert action.do is Do.REFUSE and action.refusal is not None
    assert action.refusal.kind is RefusalKind.COMMIT_WITHOUT_PREPARE
    # The floor says nothing about a transaction that has a record.
    assert step(e(State.PREPARED_YES, 3), Message(P, 3), 9)[1].do is Do.VOTE


def test_prepared_records_the_vote_and_the_helpers_read_it() -> None:
    assert prepared(4, Vote.YES) == e(State.PREPARED_YES, 4)
    assert prepared(4, Vote.READ_ONLY) == e(State.PREPARED_READ_ONLY, 4)
    assert prepared(4, Vote.NO) == e(State.ABORTED, 4)
    assert in_doubt(e(State.PREPARED_YES)) and not in_doubt(e(State.PREPARED_READ_ONLY)) and not in_doubt(None)
    assert recorded_vote(e(State.COMMITTED)) is Vote.YES
    assert recorded_vote(e(State.PREPARED_READ_ONLY)) is Vote.READ_ONLY
    assert recorded_vote(e(State.ABORTED)) is None and recorded_vote(e(State.TOMBSTONE)) is None
    assert not collectable(e(State.PREPARED_YES)) and collectable(e(State.TOMBSTONE))
    assert not collectable(None)


def test_a_sequence_applies_the_work_exactly_once() -> None:
    """Duplicates and reorderings (invariant 8): count the resource actions."""
    entry: LogEntry | None = None
    work = 0
    for kind, term in [(P, 5), (P, 5), (P, 6), (C, 6), (C, 6), (P, 6), (C, 7), (O, 7)]:
        after, action = step(entry, Message(kind, term), 0)
        if action.do is Do.PREPARE_RESOURCE:
            after = prepared(term, Vote.YES)
        if action.do is Do.COMMIT_RESOURCE:
            work += 1
        assert action.do is not Do.REFUSE
        entry = after
    assert work == 1
    assert entry == e(State.COMMITTED, 7)


def test_global_txid_shows_and_parses_like_the_rust_sdk() -> None:
    assert str(GlobalTxid(0, 42)) == "42"
    g = GlobalTxid(0x2E714213E3A14204, 7)
    assert str(g) == "7@2e714213e3a14204"
    assert GlobalTxid.parse(str(g)) == g
    assert GlobalTxid.parse("42") == GlobalTxid(0, 42)
    assert GlobalTxid(1, 5) != GlobalTxid(2, 5)
