"""Branches end to end: a real three-node cluster (``dtx-dev serve``) and
Python banks serving ``bank.v1.Bank`` (``examples/branch_bank.py``) whose
``Change`` joins the caller's transaction as a branch (docs/protocol.md,
"Branches"). A transfer as two branches commits at both banks exactly
once; a branch mixed with an enlisted (Prepare-driven) participant; a bank
killed with SIGKILL after its local prepare and before registering is
rolled back by its recovery (fenced out, told ABORT) and the transaction
commits without it; a registration after the decision is refused and
rolled back before the handler answers; a NO registration aborts the
transaction at once. Every time: money conserved, each committed change
applied once, nothing in doubt, no branch mark left."""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from dtx import metadata as md
from dtx.client import BranchDecision, BranchVote, Client, FailedPrecondition, Outcome
from dtx.participant import GlobalTxid
from harness import BranchBankProc, Cluster, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import bank_api  # noqa: E402

pb, pb_grpc = bank_api.load()

ACCOUNTS = 4
INITIAL = 1000
FAILPOINT = "participant_branch_prepared_before_register"


@pytest.fixture(scope="module")
def bcluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One three-node cluster for this module's tests (each test has its
    own banks and transactions)."""
    c = Cluster(tmp_path_factory.mktemp("branch-cluster"))
    c.start_all()
    try:
        c.wait_leader(60)
        yield c
    finally:
        c.stop_all()


def start_bank(dir: Path, banks: list[Any], cluster: Cluster, pid: str, prefix: str, **env: str) -> BranchBankProc:
    b = BranchBankProc(dir, pid, prefix, cluster.api_addrs, accounts=ACCOUNTS, initial=INITIAL, extra_env=dict(env))
    banks.append(b)
    return b.start()


async def change(b: BranchBankProc, txid: int | None, inc: int, changes: dict[str, int], timeout: float = 15) -> Any:
    """``bank.v1.Bank/Change`` at ``b`` inside ``txid``: the reply, or the
    grpc error."""
    meta = md.attach_txid([], txid, inc) if txid is not None else []
    async with grpc.aio.insecure_channel(b.app) as ch:
        req = pb.ChangeRequest(changes=[pb.AccountChange(account=a, delta=d) for a, d in changes.items()])
        try:
            return await pb_grpc.BankStub(ch).Change(req, metadata=meta, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            return e


def code(r: Any) -> grpc.StatusCode:
    return r.code() if isinstance(r, grpc.aio.AioRpcError) else grpc.StatusCode.OK


async def decided(client: Client, txid: int) -> Outcome:
    out = await client.commit(txid)
    if out is Outcome.UNKNOWN:
        out = await client.settle(txid, give_up_s=60)
    assert out is not Outcome.UNKNOWN, f"txid {txid}: no decision within 60 s"
    return out


async def acked_by_all(client: Client, txid: int, until: float) -> Any:
    """The status of `txid` once it is decided and every participant acked
    (phase two reaches the banks after the decision: an account stays
    locked by the prepared transaction until then)."""
    while True:
        st = await client.status(txid)
        if st.state == "DECIDED" and all(p.acked for p in st.participants):
            return st
        assert time.monotonic() < until, f"txid {txid} not acked by all: {st}"
        await asyncio.sleep(0.05)


async def settled_audit(b: BranchBankProc, within_s: float = 30) -> dict[str, Any]:
    until = time.monotonic() + within_s
    while True:
        a = b.audit()
        if a["in_doubt"] == 0 and a["locks"] == {} and a["pending"] == [] and a["branch_marks"] == 0:
            return a
        assert time.monotonic() < until, f"{b.id} still holds work: {a}"
        await asyncio.sleep(0.2)


async def check_end(
    client: Client, banks: list[BranchBankProc], applied: dict[str, dict[str, int]], txs: dict[int, Outcome], inc: int
) -> None:
    """Each bank's balances are the initial ones plus exactly ``applied``;
    every committed transaction it took part in shows one COMMIT in its
    apply log and an aborted one none; money conserved; nothing held; the
    cluster has every ack."""
    for b in banks:
        a = await settled_audit(b)
        want = {f"{b.prefix}{i}": INITIAL for i in range(ACCOUNTS)}
        for acct, d in applied.get(b.id, {}).items():
            want[acct] += d
        assert a["balances"] == want, (b.id, a)
        assert a["applied_twice"] == [], a
        assert a["total"] == INITIAL * ACCOUNTS, f"{b.id}: money not conserved: {a}"
        for txid, out in txs.items():
            log = a["applog"].get(str(GlobalTxid(inc, txid)), [])
            assert "COMMIT" not in log or (out is Outcome.COMMITTED and log == ["COMMIT"]), (b.id, txid, out, log)
    until = time.monotonic() + 30
    for txid, out in txs.items():
        st = await acked_by_all(client, txid, until)
        assert st.decision is out, (txid, st)


async def test_transfers_as_branches_commit_once_and_mix_with_an_enlisted_participant(
    tmp_path: Path, bcluster: Cluster, banks: list[Any]
) -> None:
    a = start_bank(tmp_path, banks, bcluster, "bank-a", "a")
    b = start_bank(tmp_path, banks, bcluster, "bank-b", "b")
    applied: dict[str, dict[str, int]] = {"bank-a": {}, "bank-b": {}}
    txs: dict[int, Outcome] = {}

    def add(pid: str, changes: dict[str, int]) -> None:
        for k, v in changes.items():
            applied[pid][k] = applied[pid].get(k, 0) + v

    async with Client(bcluster.api_addrs, deadline_s=15) as client:
        # A call outside any transaction is refused before anything is done.
        r = await change(a, None, 0, {"a0": 1})
        assert code(r) is grpc.StatusCode.INVALID_ARGUMENT and "x-dtx-txid" in r.details()
        inc = 0
        for i in range(6):
            amt = 10 + i
            x, y = i % ACCOUNTS, (i + 1) % ACCOUNTS
            ca, cb = {f"a{x}": -amt}, {f"b{y}": amt}
            began = await client.begin(f"branch-transfer-{i}", timeout_ms=20_000)
            inc = began.incarnation
            ra, rb = await asyncio.gather(
                change(a, began.txid, inc, ca), change(b, began.txid, inc, cb)
            )
            assert code(ra) is grpc.StatusCode.OK and code(rb) is grpc.StatusCode.OK, (ra, rb)
            assert ra.balances[0].balance_if_committed == INITIAL + applied["bank-a"].get(f"a{x}", 0) - amt
            st = await client.status(began.txid)
            assert sorted(p.id for p in st.participants) == ["bank-a", "bank-b"], st
            out = await decided(client, began.txid)
            assert out is Outcome.COMMITTED
            txs[began.txid] = out
            add("bank-a", ca)
            add("bank-b", cb)
            # The next transaction takes the same account of bank-a: only
            # once phase two has released it.
            await acked_by_all(client, began.txid, time.monotonic() + 30)
            # Back again, mixed: bank-a as a branch, bank-b enlisted by the
            # client with a payload (Prepare-driven), in one transaction.
            began = await client.begin(f"mixed-transfer-{i}", timeout_ms=20_000)
            ra = await change(a, began.txid, inc, {f"a{x}": amt})
            assert code(ra) is grpc.StatusCode.OK, ra
            await client.enlist(began.txid, "bank-b", b.addr, f"b{y}:{-amt}".encode())
            out = await decided(client, began.txid)
            assert out is Outcome.COMMITTED
            txs[began.txid] = out
            add("bank-a", {f"a{x}": amt})
            add("bank-b", {f"b{y}": -amt})
            await acked_by_all(client, began.txid, time.monotonic() + 30)
        # A change the bank refuses registers NO: the transaction is aborted
        # at once, and the other branch's work is rolled back by phase two.
        began = await client.begin("branch-refused", timeout_ms=20_000)
        ra = await change(a, began.txid, inc, {"a0": -5})
        rb = await change(b, began.txid, inc, {"b0": -10 * INITIAL})
        assert code(ra) is grpc.StatusCode.OK
        assert code(rb) is grpc.StatusCode.FAILED_PRECONDITION and "too little" in rb.details(), rb
        st = await client.status(began.txid)
        assert st.state == "DECIDED" and st.decision is Outcome.ABORTED, st
        assert await client.commit(began.txid) is Outcome.ABORTED
        txs[began.txid] = Outcome.ABORTED
        # The same participant again in the same transaction: ALREADY_EXISTS.
        assert code(await change(a, began.txid, inc, {"a1": 1})) is grpc.StatusCode.ALREADY_EXISTS
        await check_end(client, [a, b], applied, txs, inc)


async def test_a_bank_killed_between_its_prepare_and_registering_is_rolled_back_by_recovery(
    tmp_path: Path, bcluster: Cluster, banks: list[Any]
) -> None:
    a = start_bank(tmp_path, banks, bcluster, "bank-a", "a")
    b = start_bank(tmp_path, banks, bcluster, "bank-b", "b", DTX_PY_FAILPOINTS=f"{FAILPOINT}=stop")
    async with Client(bcluster.api_addrs, deadline_s=15) as client:
        began = await client.begin("branch-crash", timeout_ms=60_000)
        inc, txid = began.incarnation, began.txid
        ra = await change(a, txid, inc, {"a0": -9, "a1": 9})
        assert code(ra) is grpc.StatusCode.OK, ra
        call = asyncio.create_task(change(b, txid, inc, {"b0": -4, "b1": 4}, timeout=60))
        # bank-b prepared durably and stopped itself before registering: kill it.
        await asyncio.to_thread(wait_for, "bank-b at its failpoint", b.stopped_by_itself, 30)
        b.kill9()
        assert code(await call) is not grpc.StatusCode.OK
        g = str(GlobalTxid(inc, txid))
        with sqlite3.connect(b.db) as db:
            assert db.execute("SELECT participant_id FROM dtx_branch_mark").fetchall() == [("bank-b",)]
            assert db.execute("SELECT state FROM dtx_log").fetchall() == [(2,)], "a prepared YES"
            assert db.execute("SELECT tx FROM bank_pending").fetchall() == [(g,)]
        st = await client.status(txid)
        assert [p.id for p in st.participants] == ["bank-a"], "bank-b never registered"
        # Restarted without the failpoint: its recovery asks GetBranchDecision,
        # the cluster fences it out of the open transaction, it rolls back.
        b.extra_env = {}
        b.start()
        after = await settled_audit(b)
        with sqlite3.connect(b.db) as db:
            assert db.execute("SELECT state FROM dtx_log").fetchall() == [(5,)], "rolled back: ABORTED"
        assert "fenced out" in b.log.read_text() or "not in its transaction" in b.log.read_text()
        # A registration now is refused (fenced), and the answer to the
        # branch is ABORT, not a member.
        with pytest.raises(FailedPrecondition) as e:
            await client.register_branch(txid, "bank-b", b.addr, BranchVote.YES, "", inc)
        assert e.value.branch_refusal is md.BranchRefusalKind.FENCED
        d = await client.branch_decision(txid, "bank-b", inc)
        assert (d.decision, d.member) == (BranchDecision.ABORT, False)
        # The caller commits anyway: the transaction commits without
        # bank-b's work, which never applies.
        assert await decided(client, txid) is Outcome.COMMITTED
        assert after["balances"] == {f"b{i}": INITIAL for i in range(ACCOUNTS)}
        await check_end(client, [a, b], {"bank-a": {"a0": -9, "a1": 9}}, {txid: Outcome.COMMITTED}, inc)


async def test_a_registration_after_the_decision_is_refused_and_rolled_back(
    tmp_path: Path, bcluster: Cluster, banks: list[Any]
) -> None:
    a = start_bank(tmp_path, banks, bcluster, "bank-a", "a")
    b = start_bank(tmp_path, banks, bcluster, "bank-b", "b")
    async with Client(bcluster.api_addrs, deadline_s=15) as client:
        began = await client.begin("branch-late", timeout_ms=20_000)
        inc, txid = began.incarnation, began.txid
        assert code(await change(a, txid, inc, {"a2": -3, "a3": 3})) is grpc.StatusCode.OK
        assert await decided(client, txid) is Outcome.COMMITTED
        late = await change(b, txid, inc, {"b2": -3, "b3": 3})
        assert code(late) is grpc.StatusCode.ABORTED and "too-late" in late.details(), late
        # Rolled back before the handler answered: nothing held, no mark.
        audit = b.audit()
        assert (audit["locks"], audit["pending"], audit["branch_marks"]) == ({}, [], 0), audit
        with sqlite3.connect(b.db) as db:
            assert db.execute("SELECT state FROM dtx_log").fetchall() == [(5,)]
        st = await client.status(txid)
        assert [p.id for p in st.participants] == ["bank-a"], st
        await check_end(client, [a, b], {"bank-a": {"a2": -3, "a3": 3}}, {txid: Outcome.COMMITTED}, inc)


async def test_a_bank_killed_after_registering_and_before_answering_commits_once(
    tmp_path: Path, bcluster: Cluster, banks: list[Any]
) -> None:
    a = start_bank(tmp_path, banks, bcluster, "bank-a", "a")
    b = start_bank(
        tmp_path, banks, bcluster, "bank-b", "b", DTX_PY_FAILPOINTS="participant_branch_registered_before_answer=stop"
    )
    async with Client(bcluster.api_addrs, deadline_s=15) as client:
        began = await client.begin("branch-registered-crash", timeout_ms=60_000)
        inc, txid = began.incarnation, began.txid
        assert code(await change(a, txid, inc, {"a0": -6})) is grpc.StatusCode.OK
        call = asyncio.create_task(change(b, txid, inc, {"b0": 6}, timeout=60))
        await asyncio.to_thread(wait_for, "bank-b at its failpoint", b.stopped_by_itself, 30)
        b.kill9()
        assert code(await call) is not grpc.StatusCode.OK, "the caller never got bank-b's answer"
        # bank-b is a member (its registration is recorded): the caller that
        # commits anyway gets its work committed, delivered to the
        # restarted bank and applied once.
        st = await client.status(txid)
        assert sorted(p.id for p in st.participants) == ["bank-a", "bank-b"], st
        b.extra_env = {}
        b.start()
        assert await decided(client, txid) is Outcome.COMMITTED
        # Money moved from bank-a to bank-b: conserved across the two.
        after_a, after_b = await settled_audit(a), await settled_audit(b)
        assert after_a["balances"]["a0"] == INITIAL - 6 and after_b["balances"]["b0"] == INITIAL + 6
        assert after_a["total"] + after_b["total"] == 2 * INITIAL * ACCOUNTS
        g = str(GlobalTxid(inc, txid))
        assert after_a["applog"][g] == ["COMMIT"] and after_b["applog"][g] == ["COMMIT"]
        assert after_b["applied_twice"] == [] and after_b["branch_marks"] == 0
        until = time.monotonic() + 30
        while True:
            st = await client.status(txid)
            if all(p.acked for p in st.participants):
                break
            assert time.monotonic() < until, st
            await asyncio.sleep(0.2)
