"""The participant service on the wire (refusals as FAILED_PRECONDITION
with ``x-dtx-refusal`` in the trailing metadata, another participant's
message as INVALID_ARGUMENT), and its recovery and log GC against a fake
coordinator that answers GetDecisions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from dtx import metadata as md
from dtx._pb import coordinator_pb2 as cpb
from dtx._pb import coordinator_pb2_grpc as cgrpc
from dtx._pb import participant_pb2 as ppb
from dtx._pb import participant_pb2_grpc as pgrpc
from dtx.participant import (
    GlobalTxid,
    Kind,
    LogEntry,
    Message,
    ParticipantServer,
    ParticipantStore,
    Recovery,
    RecoveryOptions,
    State,
    Vote,
    serve,
)
from harness import free_port
from test_store import Counter

INC = 0xC0FFEE


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[ParticipantServer, pgrpc.ParticipantServiceStub]]:
    store = ParticipantStore(tmp_path / "p.db", Counter(), "p1")
    server = await serve(store, "p1", "127.0.0.1:0")
    ch = grpc.aio.insecure_channel(server.address)
    try:
        yield server, pgrpc.ParticipantServiceStub(ch)
    finally:
        await ch.close()
        await server.stop(0)
        store.close()


def decision(txid: int, term: int = 5, pid: str = "p1") -> ppb.ParticipantDecisionRequest:
    return ppb.ParticipantDecisionRequest(txid=txid, term=term, participant_id=pid, incarnation=INC)


def prepare(txid: int, payload: bytes, term: int = 5, pid: str = "p1") -> ppb.PrepareRequest:
    return ppb.PrepareRequest(txid=txid, term=term, participant_id=pid, payload=payload, incarnation=INC)


async def refusal_of(call: Any) -> tuple[grpc.StatusCode, str | None]:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    return e.value.code(), md.get(e.value.trailing_metadata(), md.REFUSAL_HEADER)


async def test_refusals_carry_their_kind_in_the_trailing_metadata(served: Any) -> None:
    _, stub = served
    assert await refusal_of(stub.Commit(decision(1))) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "commit-without-prepare",
    )
    r = await stub.Inquire(ppb.InquireRequest(txid=1, participant_id="p1", incarnation=INC))
    assert (r.record, r.term) == (ppb.LOCAL_RECORD_NONE, 0)
    assert (await stub.Prepare(prepare(1, b"3"))).vote == ppb.VOTE_YES
    assert await refusal_of(stub.Commit(decision(1, term=4))) == (grpc.StatusCode.FAILED_PRECONDITION, "stale-term")
    assert (await stub.Commit(decision(1))).applied
    assert await refusal_of(stub.Abort(decision(1))) == (grpc.StatusCode.FAILED_PRECONDITION, "abort-after-commit")
    assert (await stub.Abort(decision(2))).applied
    assert await refusal_of(stub.Commit(decision(2))) == (grpc.StatusCode.FAILED_PRECONDITION, "commit-after-abort")
    r = await stub.Inquire(ppb.InquireRequest(txid=2, participant_id="p1", incarnation=INC))
    assert r.record == ppb.LOCAL_RECORD_TOMBSTONE
    p = await stub.Prepare(prepare(2, b"1"))
    assert p.vote == ppb.VOTE_NO and p.reason


async def test_a_message_for_another_participant_is_invalid_and_records_nothing(served: Any) -> None:
    _, stub = served
    for call in (
        stub.Prepare(prepare(3, b"1", pid="p2")),
        stub.Abort(decision(3, pid="p2")),
        stub.CommitOnePhase(prepare(3, b"1", pid="p2")),
        stub.Inquire(ppb.InquireRequest(txid=3, participant_id="p2", incarnation=INC)),
    ):
        assert await refusal_of(call) == (grpc.StatusCode.INVALID_ARGUMENT, None)
    # An empty id means this participant.
    r = await stub.Inquire(ppb.InquireRequest(txid=3, incarnation=INC))
    assert r.record == ppb.LOCAL_RECORD_NONE
    one = await stub.CommitOnePhase(prepare(3, b"2", pid=""))
    assert one.committed


async def test_group_limits_refuse_the_whole_call(served: Any) -> None:
    _, stub = served
    items = [ppb.DecisionItem(txid=i, term=1, outcome=ppb.DECISION_OUTCOME_ABORT) for i in range(257)]
    assert await refusal_of(stub.ApplyDecisions(ppb.ApplyDecisionsRequest(items=items))) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        None,
    )
    r = await stub.ApplyDecisions(ppb.ApplyDecisionsRequest(items=items[:256]))
    assert len(r.results) == 256 and all(x.applied for x in r.results)


class Decisions(cgrpc.CoordinatorServicer):  # type: ignore[misc]
    """A coordinator that answers GetDecisions from a table."""

    def __init__(self, table: dict[int, tuple[Any, bool]]) -> None:
        self.table: dict[int, tuple[Any, bool]] = table
        self.asked: list[cpb.GetDecisionsRequest] = []

    async def GetDecisions(self, request: cpb.GetDecisionsRequest, context: Any) -> cpb.GetDecisionsResponse:  # noqa: N802
        self.asked.append(request)
        out = []
        for t in request.txids:
            outcome, awaiting = self.table.get(t, (cpb.OUTCOME_PENDING, False))
            out.append(cpb.GetDecisionResponse(txid=t, outcome=outcome, awaiting_ack=awaiting))
        return cpb.GetDecisionsResponse(decisions=out)


@pytest.fixture
async def coordinator() -> AsyncIterator[tuple[str, Decisions]]:
    fake = Decisions({})
    server = grpc.aio.server()
    cgrpc.add_CoordinatorServicer_to_server(fake, server)
    addr = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(addr)
    await server.start()
    yield addr, fake
    await server.stop(0)


class Many(Counter):
    """Every YES payload stages without a lock (for many in-doubt votes)."""

    def prepare(self, db: Any, txid: GlobalTxid, payload: bytes) -> Vote:
        return Vote.YES


async def test_recovery_outcomes_one_by_one(tmp_path: Path, coordinator: tuple[str, Decisions]) -> None:
    addr, fake = coordinator
    store = ParticipantStore(tmp_path / "p.db", Many(), "p1")
    try:
        for t in range(1, 6):
            assert (await store.handle(GlobalTxid(INC, t), Message(Kind.PREPARE, 4), b"")).vote is Vote.YES
        fake.table = {
            1: (cpb.OUTCOME_COMMIT, True),
            2: (cpb.OUTCOME_ABORT, True),
            3: (cpb.OUTCOME_UNKNOWN_PRESUMED_ABORT, False),
            4: (cpb.OUTCOME_PENDING, False),
            5: (cpb.OUTCOME_OTHER_INCARNATION, False),
        }
        rec = Recovery(store, [addr], "p1", RecoveryOptions(log_retention_s=None, prepared_age_min_s=3600))
        await rec.pass_once()
        states = [(await store.entry(GlobalTxid(INC, t))) for t in range(1, 6)]
        assert [s.state if s else None for s in states] == [
            State.COMMITTED,
            State.ABORTED,
            State.ABORTED,
            State.PREPARED_YES,
            State.PREPARED_YES,
        ]
        assert rec.applied == 3
        # Later passes ask only about votes older than prepared_age_min.
        n = len(fake.asked)
        await rec.pass_once()
        assert len(fake.asked) == n
        await rec.client.close()
    finally:
        store.close()


async def test_recovery_without_a_cluster_holds_the_locks(tmp_path: Path) -> None:
    store = ParticipantStore(tmp_path / "p.db", Many(), "p1")
    try:
        await store.handle(GlobalTxid(INC, 1), Message(Kind.PREPARE, 4), b"")
        rec = Recovery(
            store, [f"127.0.0.1:{free_port()}"], "p1", RecoveryOptions(log_retention_s=None, call_deadline_s=0.5)
        )
        await rec.pass_once()
        assert await store.entry(GlobalTxid(INC, 1)) == LogEntry(State.PREPARED_YES, 4)
        await rec.client.close()
    finally:
        store.close()


async def test_log_gc_removes_only_what_the_cluster_is_done_with(
    tmp_path: Path, coordinator: tuple[str, Decisions]
) -> None:
    addr, fake = coordinator
    store = ParticipantStore(tmp_path / "p.db", Many(), "p1")
    try:
        g = [GlobalTxid(INC, t) for t in range(1, 6)]
        for t in g[:4]:
            await store.handle(t, Message(Kind.PREPARE, 4), b"")
        await store.handle(g[0], Message(Kind.COMMIT, 4))  # acked
        await store.handle(g[1], Message(Kind.COMMIT, 4))  # ack not recorded yet
        await store.handle(g[2], Message(Kind.ABORT, 4))  # forgotten by the cluster
        # g[3] stays in doubt; g[4] is a tombstone of an undecided transaction.
        await store.handle(g[4], Message(Kind.ABORT, 4))
        fake.table = {
            1: (cpb.OUTCOME_COMMIT, False),
            2: (cpb.OUTCOME_COMMIT, True),
            3: (cpb.OUTCOME_UNKNOWN_PRESUMED_ABORT, False),
            5: (cpb.OUTCOME_PENDING, False),
        }
        rec = Recovery(store, [addr], "p1", RecoveryOptions(log_retention_s=0))
        assert await rec.collect() == 2
        left = {t.txid: (await store.entry(t)) is not None for t in g}
        assert left == {1: False, 2: True, 3: False, 4: True, 5: True}
        assert await store.term_floor(INC) == 4
        await rec.client.close()
    finally:
        store.close()
