"""The client against in-process fake coordinator nodes: leader hints (from
a refusal and from a forwarded answer), what is retried, and UNKNOWN kept
apart from failure: a timeout is never a failure, a node that could not be
reached is "nothing sent", and only ``x-dtx-not-applied`` makes a refused
write a definite NotApplied."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
import pytest

from dtx import metadata as md
from dtx._pb import coordinator_pb2 as cpb
from dtx._pb import coordinator_pb2_grpc as cgrpc
from dtx.client import (
    Client,
    DecisionRead,
    FailedPrecondition,
    NotApplied,
    NotFound,
    Outcome,
    OutcomeUnknown,
    ParticipantSpec,
    Unavailable,
)
from harness import free_port

Behavior = Callable[[str, Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]


class FakeNode(cgrpc.CoordinatorServicer):  # type: ignore[misc]
    """A node whose every call runs ``behavior(method, request, context)``."""

    def __init__(self, behavior: Behavior) -> None:
        self.behavior = behavior
        self.calls: list[str] = []
        self.metadata: list[list[tuple[str, str]]] = []

    async def _do(self, method: str, request: Any, context: Any) -> Any:
        self.calls.append(method)
        self.metadata.append([(m.key, m.value) for m in context.invocation_metadata()])
        return await self.behavior(method, request, context)

    async def Begin(self, request: Any, context: Any) -> Any:  # noqa: N802
        return await self._do("Begin", request, context)

    async def Enlist(self, request: Any, context: Any) -> Any:  # noqa: N802
        return await self._do("Enlist", request, context)

    async def Commit(self, request: Any, context: Any) -> Any:  # noqa: N802
        return await self._do("Commit", request, context)

    async def Abort(self, request: Any, context: Any) -> Any:  # noqa: N802
        return await self._do("Abort", request, context)

    async def BeginAndCommit(self, request: Any, context: Any) -> Any:  # noqa: N802
        return await self._do("BeginAndCommit", request, context)

    async def Status(self, request: Any, context: Any) -> Any:  # noqa: N802
        return await self._do("Status", request, context)

    async def GetDecision(self, request: Any, context: Any) -> Any:  # noqa: N802
        return await self._do("GetDecision", request, context)


ANSWERS: dict[str, Any] = {
    "Begin": cpb.BeginResponse(txid=41, incarnation=0xABC, deadline_unix_ms=5),
    "Enlist": cpb.EnlistResponse(participant_count=1),
    "Commit": cpb.CommitResponse(outcome=cpb.OUTCOME_COMMIT),
    "Abort": cpb.AbortResponse(outcome=cpb.OUTCOME_ABORT),
    "BeginAndCommit": cpb.BeginAndCommitResponse(txid=42, outcome=cpb.OUTCOME_COMMIT),
    "GetDecision": cpb.GetDecisionResponse(txid=41, outcome=cpb.OUTCOME_PENDING),
}


async def answers(method: str, request: Any, context: Any) -> Any:
    return ANSWERS[method]


def refuses(code: grpc.StatusCode, *pairs: tuple[str, str]) -> Behavior:
    async def b(method: str, request: Any, context: Any) -> Any:
        await context.abort(code, f"refused by the fake ({code.name})", trailing_metadata=pairs)

    return b


async def hangs(method: str, request: Any, context: Any) -> Any:
    await asyncio.sleep(3600)


class Nodes:
    def __init__(self) -> None:
        self.servers: list[grpc.aio.Server] = []

    async def add(self, behavior: Behavior) -> tuple[str, FakeNode]:
        node = FakeNode(behavior)
        server = grpc.aio.server()
        cgrpc.add_CoordinatorServicer_to_server(node, server)
        addr = f"127.0.0.1:{free_port()}"
        assert server.add_insecure_port(addr) != 0
        await server.start()
        self.servers.append(server)
        return addr, node


@pytest.fixture
async def nodes() -> AsyncIterator[Nodes]:
    n = Nodes()
    yield n
    for s in n.servers:
        await s.stop(0)


async def test_a_refusal_naming_one_of_the_addresses_is_followed(nodes: Nodes) -> None:
    leader, lnode = await nodes.add(answers)
    follower, fnode = await nodes.add(
        refuses(grpc.StatusCode.UNAVAILABLE, (md.LEADER_ADDR_HEADER, leader), (md.LEADER_ID_HEADER, "2"))
    )
    async with Client([follower, leader], deadline_s=5) as c:
        b = await c.begin("k1")
        assert (b.txid, b.incarnation, b.existing) == (41, 0xABC, False)
        assert c.leader == leader
        assert await c.commit(41) is Outcome.COMMITTED
    assert fnode.calls == ["Begin"]
    assert lnode.calls == ["Begin", "Commit"]


async def test_a_hint_outside_the_addresses_is_not_followed(nodes: Nodes) -> None:
    elsewhere = f"127.0.0.1:{free_port()}"
    follower, fnode = await nodes.add(refuses(grpc.StatusCode.UNAVAILABLE, (md.LEADER_ADDR_HEADER, elsewhere)))
    other, onode = await nodes.add(answers)
    async with Client([follower, other], deadline_s=5) as c:
        assert (await c.begin("k")).txid == 41
        assert c.leader is None
    assert fnode.calls == ["Begin"] and onode.calls == ["Begin"]


async def test_a_forwarded_answer_sends_the_next_calls_to_the_leader(nodes: Nodes) -> None:
    leader, lnode = await nodes.add(answers)

    async def forwards(method: str, request: Any, context: Any) -> Any:
        await context.send_initial_metadata(((md.LEADER_ADDR_HEADER, leader),))
        return ANSWERS[method]

    follower, fnode = await nodes.add(forwards)
    async with Client([follower, leader], deadline_s=5) as c:
        await c.begin("k")
        assert c.leader == leader
        await c.enlist(41, "p", "127.0.0.1:1", b"x")
    assert fnode.calls == ["Begin"] and lnode.calls == ["Enlist"]


async def test_a_timeout_is_unknown_never_a_failure(nodes: Nodes) -> None:
    addr, node = await nodes.add(hangs)
    async with Client([addr], deadline_s=1.0, attempt_timeout_s=0.3) as c:
        t0 = time.monotonic()
        assert await c.commit(7) is Outcome.UNKNOWN
        assert time.monotonic() - t0 < 6.0, "the call keeps to its deadline (1 s; slack for a loaded machine)"
        assert await c.abort(7, "x") is Outcome.UNKNOWN
        with pytest.raises(OutcomeUnknown):
            await c.begin("k")
        with pytest.raises(OutcomeUnknown):
            await c.enlist(7, "p", "127.0.0.1:1", b"")
        one = await c.begin_and_commit("k", [ParticipantSpec("p", "127.0.0.1:1", b"")])
        assert (one.txid, one.outcome) == (None, Outcome.UNKNOWN)
        # A read that gets no answer is unavailable, not unknown.
        with pytest.raises(Unavailable):
            await c.decision(7)
    assert len(node.calls) >= 6


async def test_a_timeout_then_a_not_applied_refusal_is_still_unknown(nodes: Nodes) -> None:
    calls = 0

    async def first_hangs(method: str, request: Any, context: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            await asyncio.sleep(3600)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no leader", trailing_metadata=((md.NOT_APPLIED_HEADER, "1"),))

    addr, _ = await nodes.add(first_hangs)
    async with Client([addr], deadline_s=1.5, attempt_timeout_s=0.3) as c:
        # The first attempt may have been applied: later refusals do not
        # make the outcome definite.
        assert await c.commit(7) is Outcome.UNKNOWN
    assert calls >= 2


async def test_only_not_applied_refusals_make_a_definite_failure(nodes: Nodes) -> None:
    addr, node = await nodes.add(refuses(grpc.StatusCode.UNAVAILABLE, (md.NOT_APPLIED_HEADER, "1")))
    async with Client([addr], deadline_s=2.0) as c:
        with pytest.raises(NotApplied):
            await c.commit(7)
        with pytest.raises(NotApplied):
            await c.begin("k")
    assert len(node.calls) >= 4, "each call retried within its deadline"
    maybe, _ = await nodes.add(refuses(grpc.StatusCode.UNAVAILABLE))
    async with Client([maybe], deadline_s=0.8) as c:
        assert await c.commit(7) is Outcome.UNKNOWN
    internal, _ = await nodes.add(refuses(grpc.StatusCode.INTERNAL))
    async with Client([internal], deadline_s=0.8) as c:
        assert await c.commit(7) is Outcome.UNKNOWN


async def test_no_node_reached_is_nothing_sent_not_unknown() -> None:
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    async with Client(dead, deadline_s=1.0) as c:
        with pytest.raises(Unavailable):
            await c.begin("k")
        with pytest.raises(Unavailable):
            await c.commit(7)


async def test_definite_refusals_are_not_retried(nodes: Nodes) -> None:
    addr, node = await nodes.add(refuses(grpc.StatusCode.FAILED_PRECONDITION))
    async with Client([addr], deadline_s=5) as c:
        with pytest.raises(FailedPrecondition):
            await c.enlist(7, "p", "127.0.0.1:1", b"")
    assert node.calls == ["Enlist"]
    addr, node = await nodes.add(refuses(grpc.StatusCode.NOT_FOUND))
    async with Client([addr], deadline_s=5) as c:
        with pytest.raises(NotFound):
            await c.status(7)
        with pytest.raises(NotFound):
            await c.commit(7)
    assert node.calls == ["Status", "Commit"]


async def test_the_outcomes_and_decisions_as_answered(nodes: Nodes) -> None:
    addr, _ = await nodes.add(answers)
    async with Client([f"http://{addr}"], deadline_s=5) as c:
        assert await c.abort(41) is Outcome.ABORTED
        one = await c.begin_and_commit("k", [ParticipantSpec("p", "127.0.0.1:1", b"x")])
        assert (one.txid, one.outcome) == (42, Outcome.COMMITTED)
        assert await c.decision(41) is DecisionRead.PENDING


async def test_the_txid_travels_in_metadata(nodes: Nodes) -> None:
    seen: list[md.TxidContext | None] = []

    async def reads(method: str, request: Any, context: Any) -> Any:
        seen.append(md.txid_from_context(context))
        return ANSWERS[method]

    addr, _ = await nodes.add(reads)
    async with grpc.aio.insecure_channel(addr, interceptors=[md.TxidClientInterceptor()]) as ch:
        stub = cgrpc.CoordinatorStub(ch)
        await stub.Begin(cpb.BeginRequest(idempotency_key="k"))
        with md.txid_scope(77, 0xFEED):
            await stub.Begin(cpb.BeginRequest(idempotency_key="k"))
            # A txid the call carries already is kept.
            await stub.Begin(cpb.BeginRequest(idempotency_key="k"), metadata=md.attach_txid(None, 5))
    assert seen == [None, md.TxidContext(77, 0xFEED), md.TxidContext(5, 0)]
    pairs = md.attach_txid([("a", "b"), ("x-dtx-txid", "1")], 9, 3)
    assert pairs == [("a", "b"), ("x-dtx-txid", "9"), ("x-dtx-incarnation", "3")]
    assert md.txid_of(pairs) == 9 and md.incarnation_of(pairs) == 3
    assert md.txid_of([("x-dtx-txid", "nine")]) is None
    assert md.txid_of([("x-dtx-txid", str(1 << 64))]) is None
