"""Branches on the SQLite store without a cluster (dtx.participant.branch):
a fake cluster client answers RegisterBranch and GetBranchDecision as the
test says, and each way the flow can end is checked on what the store
holds: the log record, the bank's rows, the branch mark."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from dtx import metadata as md
from dtx.client import (
    BranchDecision,
    BranchDecisionAnswer,
    BranchRegistration,
    BranchVote,
    FailedPrecondition,
    OutcomeUnknown,
    Unavailable,
)
from dtx.participant import GlobalTxid, ParticipantStore, Recovery, RecoveryOptions, State
from dtx.participant.branch import (
    AlreadyPrepared,
    BranchIdentity,
    BranchRolledBack,
    BranchUnknown,
    NoTransaction,
    join,
    transaction_of,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import bank  # noqa: E402

WHO = BranchIdentity("bank-a", "127.0.0.1:1")
T = GlobalTxid(0x1234, 7)


class FakeCluster:
    """Answers a registration with ``register`` (an exception to raise, or
    None: registered), and a branch decision with ``decide``; records the
    calls."""

    def __init__(self) -> None:
        self.register: Exception | None = None
        self.decide: BranchDecisionAnswer | Exception = BranchDecisionAnswer(BranchDecision.ABORT, False, True)
        self.registered: list[tuple[int, str, str, BranchVote, str, int]] = []
        self.asked: list[tuple[int, str, int]] = []
        #: Set while a registration is in flight, released by the test.
        self.hold: asyncio.Event | None = None

    async def register_branch(self, txid: int, pid: str, addr: str, vote: BranchVote, reason: str, inc: int) -> Any:
        self.registered.append((txid, pid, addr, vote, reason, inc))
        if self.hold is not None:
            await self.hold.wait()
        if self.register is not None:
            raise self.register
        return BranchRegistration(term=3, incarnation=inc, existing=False, deadline_unix_ms=0, participant_count=1)

    async def branch_decision(self, txid: int, pid: str, inc: int) -> BranchDecisionAnswer:
        self.asked.append((txid, pid, inc))
        if isinstance(self.decide, Exception):
            raise self.decide
        return self.decide

    async def close(self) -> None:
        pass


async def open_store(tmp_path: Path) -> ParticipantStore:
    return await bank.open_bank(str(tmp_path / "a.db"), "bank-a", "a", 3, 100)


async def state(store: ParticipantStore, txid: GlobalTxid = T) -> dict[str, Any]:
    e = await store.entry(txid)

    def rows(db: Any) -> dict[str, Any]:
        return {
            "balances": dict(db.all("SELECT name, balance FROM bank_accounts")),
            "locks": dict(db.all("SELECT name, holder FROM bank_locks")),
            "pending": [r[0] for r in db.all("SELECT tx FROM bank_pending")],
        }

    out = await store.read(rows)
    out["record"] = None if e is None else e.state
    out["marks"] = await store.branch_marks()
    return out


def recovery(store: ParticipantStore, fake: FakeCluster) -> Recovery:
    rec = Recovery(store, ["127.0.0.1:1"], "bank-a", RecoveryOptions(log_retention_s=None, prepared_age_min_s=0))
    rec.client = fake  # type: ignore[assignment]
    return rec


def test_the_transaction_is_read_from_the_metadata_and_required() -> None:
    assert transaction_of([("x-dtx-txid", "7"), ("x-dtx-incarnation", str(0x1234))]) == T
    with pytest.raises(NoTransaction) as e:
        transaction_of([("x-dtx-incarnation", "1")])
    assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT and "x-dtx-txid" in str(e.value)
    with pytest.raises(NoTransaction) as e:
        transaction_of([("x-dtx-txid", "7")])
    assert "x-dtx-incarnation" in str(e.value)


async def test_a_registered_yes_holds_the_work_and_drops_its_mark(tmp_path: Path) -> None:
    store = await open_store(tmp_path)
    fake = FakeCluster()
    try:
        j = await join(store, fake, WHO, T, b"a0:-5;a1:5;")
        assert (j.vote.name, j.term) == ("YES", 3)
        assert fake.registered == [(7, "bank-a", "127.0.0.1:1", BranchVote.YES, "", 0x1234)]
        s = await state(store)
        assert s["record"] is State.PREPARED_YES and s["marks"] == [] and s["pending"] == [str(T)]
        assert s["locks"] == {"a0": str(T), "a1": str(T)}
        assert s["balances"] == {"a0": 100, "a1": 100, "a2": 100}, "nothing applied before the decision"
        # A second call in the same transaction does nothing.
        with pytest.raises(AlreadyPrepared):
            await join(store, fake, WHO, T, b"a2:-1;")
        assert len(fake.registered) == 1
    finally:
        store.close()


async def test_a_refused_registration_rolls_the_work_back_before_answering(tmp_path: Path) -> None:
    store = await open_store(tmp_path)
    fake = FakeCluster()
    try:
        for i, kind in enumerate([md.BranchRefusalKind.TOO_LATE, md.BranchRefusalKind.FENCED]):
            t = GlobalTxid(0x1234, 100 + i)
            fake.register = FailedPrecondition("refused", grpc.StatusCode.FAILED_PRECONDITION, kind)
            with pytest.raises(BranchRolledBack) as e:
                await join(store, fake, WHO, t, b"a0:-5;")
            assert e.value.code is grpc.StatusCode.ABORTED
            s = await state(store, t)
            assert s["record"] is State.ABORTED and s["marks"] == [] and s["locks"] == {} and s["pending"] == []
        # Reached no node: certainly not recorded either.
        t = GlobalTxid(0x1234, 200)
        fake.register = Unavailable("no node")
        with pytest.raises(BranchRolledBack):
            await join(store, fake, WHO, t, b"a0:-5;")
        assert (await state(store, t))["record"] is State.ABORTED
    finally:
        store.close()


async def test_no_answer_leaves_the_prepared_work_to_recovery_which_asks_by_participant(tmp_path: Path) -> None:
    store = await open_store(tmp_path)
    fake = FakeCluster()
    try:
        fake.register = OutcomeUnknown("timed out")
        with pytest.raises(BranchUnknown) as e:
            await join(store, fake, WHO, T, b"a0:-5;")
        assert e.value.code is grpc.StatusCode.UNKNOWN
        s = await state(store)
        assert s["record"] is State.PREPARED_YES and s["marks"] == [(T, "bank-a")] and s["locks"] == {"a0": str(T)}
        # A conflict with an earlier registration is not known either.
        t2 = GlobalTxid(0x1234, 8)
        fake.register = FailedPrecondition("conflict", grpc.StatusCode.FAILED_PRECONDITION, md.BranchRefusalKind.CONFLICT)
        with pytest.raises(BranchUnknown):
            await join(store, fake, WHO, t2, b"a1:-5;")
        rec = recovery(store, fake)
        # The cluster not answering keeps everything.
        fake.decide = Unavailable("no node")
        await rec.pass_once()
        assert len(await store.branch_marks()) == 2 and (await state(store))["record"] is State.PREPARED_YES
        # Not a member: ABORT, rolled back; a member of a committed one: COMMIT.
        answers = {
            7: BranchDecisionAnswer(BranchDecision.ABORT, False, True),
            8: BranchDecisionAnswer(BranchDecision.COMMIT, True, False),
        }

        async def decide(txid: int, pid: str, inc: int) -> BranchDecisionAnswer:
            fake.asked.append((txid, pid, inc))
            return answers[txid]

        fake.branch_decision = decide  # type: ignore[method-assign]
        fake.asked.clear()
        await rec.pass_once()
        assert sorted(fake.asked) == [(7, "bank-a", 0x1234), (8, "bank-a", 0x1234)]
        s = await state(store)
        assert s["record"] is State.ABORTED and s["marks"] == [] and s["locks"] == {}
        assert (await state(store, t2))["record"] is State.COMMITTED
        assert s["balances"] == {"a0": 100, "a1": 95, "a2": 100}
        # Nothing is asked again.
        fake.asked.clear()
        await rec.pass_once()
        assert fake.asked == []
    finally:
        store.close()


async def test_a_pending_member_becomes_an_ordinary_in_doubt_vote(tmp_path: Path) -> None:
    store = await open_store(tmp_path)
    fake = FakeCluster()
    try:
        fake.register = OutcomeUnknown("timed out")
        with pytest.raises(BranchUnknown):
            await join(store, fake, WHO, T, b"a0:-5;")
        fake.decide = BranchDecisionAnswer(BranchDecision.PENDING, True, False)
        rec = recovery(store, fake)
        # Its in-doubt pass asks GetDecisions of a cluster that is not there: kept.
        rec.client.decisions = _no_answer  # type: ignore[attr-defined]
        await rec.pass_once()
        s = await state(store)
        assert s["marks"] == [] and s["record"] is State.PREPARED_YES and s["locks"] == {"a0": str(T)}
    finally:
        store.close()


async def _no_answer(*_: Any, **__: Any) -> Any:
    raise Unavailable("no node")


async def test_a_no_vote_is_registered_and_holds_nothing(tmp_path: Path) -> None:
    store = await open_store(tmp_path)
    fake = FakeCluster()
    try:
        j = await join(store, fake, WHO, T, b"a0:-500;")
        assert j.vote.name == "NO" and "too little" in j.reason
        assert fake.registered[0][3] is BranchVote.NO and "too little" in fake.registered[0][4]
        s = await state(store)
        assert s["record"] is State.ABORTED and s["marks"] == [] and s["locks"] == {}
    finally:
        store.close()


async def test_recovery_leaves_a_branch_alone_while_its_registration_is_on_its_way(tmp_path: Path) -> None:
    store = await open_store(tmp_path)
    fake = FakeCluster()
    fake.hold = asyncio.Event()
    try:
        flow = asyncio.create_task(join(store, fake, WHO, T, b"a0:-5;"))
        while not fake.registered:
            await asyncio.sleep(0.01)
        assert await store.unregistered_branches() == []
        rec = recovery(store, fake)
        rec.client.decisions = _no_answer  # type: ignore[attr-defined]
        await rec.pass_once()
        assert fake.asked == [], "recovery asked about a branch whose registration is in flight"
        # The handler's call is cancelled: the flow still ends (registered).
        flow.cancel()
        fake.hold.set()
        with pytest.raises(asyncio.CancelledError):
            await flow
        for _ in range(100):
            if not store.branch_running(T):
                break
            await asyncio.sleep(0.01)
        s = await state(store)
        assert s["marks"] == [] and s["record"] is State.PREPARED_YES and not store.branch_running(T)
    finally:
        store.close()
