"""``dtx.v1.ParticipantService`` on a participant's store (the SQLite
:class:`ParticipantStore`, the PostgreSQL
:class:`dtx.participant.postgres.PgParticipantStore`, or anything that
provides :class:`dtx.participant.api.Store`), and the participant's
recovery loop (docs/protocol.md, "Recovery at participants").

Replies on the wire, as the Rust SDK's (``participant-sdk/src/server``):
Prepare answers the vote (a NO with its reason); Commit and Abort answer
``applied = true``, the ack; CommitOnePhase answers ``committed``. A
refusal of the log is FAILED_PRECONDITION with its kind under the trailing
metadata key ``x-dtx-refusal``; a message whose non-empty
``participant_id`` names another participant is INVALID_ARGUMENT; a stopped
store is RESOURCE_EXHAUSTED (disk full) or UNAVAILABLE, and so is a store
that cannot answer now (its database locked or out of reach); a damaged
record or a failing resource is INTERNAL. Every answer is sent only after
the transaction that holds it is committed.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
import grpc.aio

from dtx import metadata as md
from dtx._pb import participant_pb2 as ppb
from dtx._pb import participant_pb2_grpc as pgrpc
from dtx.participant.api import Store
from dtx.participant.log import GlobalTxid, Kind, LogEntry, Message, State, Vote, recorded_vote
from dtx.participant.store import (
    Answer,
    Damaged,
    Record,
    Refused,
    ResourceFailed,
    StoreError,
    StoreStopped,
    StoreUnavailable,
    unix_ms,
)

log = logging.getLogger("dtx.participant")

#: limits::DECISION_DELIVERY_ITEMS_MAX
DECISION_DELIVERY_ITEMS_MAX = 256
#: limits::PREPARE_GROUP_ITEMS_MAX
PREPARE_GROUP_ITEMS_MAX = 256
#: limits::INSPECT_RECORDS_MAX
INSPECT_RECORDS_MAX = 1000


@dataclass(frozen=True)
class _Status:
    """A gRPC status a call (or a group's item) fails with."""

    code: grpc.StatusCode
    message: str
    refusal: str = ""


def _status_of(e: StoreError) -> _Status:
    if isinstance(e, Refused):
        if e.refusal.kind is md.RefusalKind.STALE_TERM:
            log.info("refused: %s", e)
        else:
            log.warning("protocol violation refused: %s", e)
        return _Status(grpc.StatusCode.FAILED_PRECONDITION, str(e), e.refusal.kind.value)
    if isinstance(e, StoreStopped):
        code = grpc.StatusCode.RESOURCE_EXHAUSTED if e.failure.disk_full else grpc.StatusCode.UNAVAILABLE
        return _Status(code, str(e))
    if isinstance(e, StoreUnavailable):
        return _Status(grpc.StatusCode.UNAVAILABLE, str(e))
    if isinstance(e, (Damaged, ResourceFailed)):
        return _Status(grpc.StatusCode.INTERNAL, str(e))
    return _Status(grpc.StatusCode.INTERNAL, str(e))


def _code_value(code: grpc.StatusCode) -> int:
    return int(code.value[0])


def _local_record(entry: LogEntry | None) -> Any:
    """The wire value of a record's state (``dtx.v1.LocalRecord``)."""
    if entry is None:
        return ppb.LOCAL_RECORD_NONE
    return int(entry.state)


def _vote_pb(vote: Vote | None) -> Any:
    """The wire value of a vote (``dtx.v1.Vote``)."""
    return ppb.VOTE_UNSPECIFIED if vote is None else int(vote)


def _record_pb(r: Record) -> ppb.ParticipantRecord:
    v = recorded_vote(r.entry)
    return ppb.ParticipantRecord(
        txid=r.txid.txid,
        incarnation=r.txid.incarnation,
        record=_local_record(r.entry),
        vote=_vote_pb(v),
        term=r.entry.term if r.entry is not None else 0,
        recorded_unix_ms=r.recorded_ms if r.entry is not None else 0,
        in_doubt=r.entry is not None and r.entry.state is State.PREPARED_YES,
    )


def _prepare_response(a: Answer) -> ppb.PrepareResponse:
    assert a.vote is not None
    return ppb.PrepareResponse(vote=_vote_pb(a.vote), reason=a.reason if a.vote is Vote.NO else "")


class ParticipantServicer(pgrpc.ParticipantServiceServicer):  # type: ignore[misc]
    """The gRPC service on a store, serving as ``participant_id``."""

    def __init__(self, store: Store, participant_id: str) -> None:
        self.store = store
        self.participant_id = participant_id

    def _other(self, pid: str) -> _Status | None:
        if pid and pid != self.participant_id:
            return _Status(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"message for participant {pid!r} reached participant {self.participant_id!r}",
            )
        return None

    async def _abort(self, context: grpc.aio.ServicerContext[Any, Any], s: _Status) -> NoReturn:
        trailing: tuple[tuple[str, str], ...] = ((md.REFUSAL_HEADER, s.refusal),) if s.refusal else ()
        await context.abort(s.code, s.message, trailing_metadata=trailing)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _run(self, context: Any, pid: str, txid: GlobalTxid, msg: Message, payload: bytes) -> Answer:
        other = self._other(pid)
        if other is not None:
            await self._abort(context, other)
        try:
            return await self.store.handle(txid, msg, payload)
        except StoreError as e:
            await self._abort(context, _status_of(e))

    async def Prepare(self, request: ppb.PrepareRequest, context: Any) -> ppb.PrepareResponse:  # noqa: N802
        txid = GlobalTxid(request.incarnation, request.txid)
        a = await self._run(context, request.participant_id, txid, Message(Kind.PREPARE, request.term), request.payload)
        if a.vote is None:
            await self._abort(context, _Status(grpc.StatusCode.INTERNAL, "prepare answered with an ack"))
        return _prepare_response(a)

    async def CommitOnePhase(self, request: ppb.PrepareRequest, context: Any) -> ppb.OnePhaseResponse:  # noqa: N802
        txid = GlobalTxid(request.incarnation, request.txid)
        msg = Message(Kind.COMMIT_ONE_PHASE, request.term)
        a = await self._run(context, request.participant_id, txid, msg, request.payload)
        if a.ack:
            return ppb.OnePhaseResponse(committed=True)
        if a.vote is Vote.NO:
            return ppb.OnePhaseResponse(committed=False, reason=a.reason)
        await self._abort(context, _Status(grpc.StatusCode.INTERNAL, f"one-phase commit answered vote {a.vote}"))

    async def Commit(self, request: ppb.ParticipantDecisionRequest, context: Any) -> ppb.ParticipantDecisionResponse:  # noqa: N802
        txid = GlobalTxid(request.incarnation, request.txid)
        await self._run(context, request.participant_id, txid, Message(Kind.COMMIT, request.term), b"")
        return ppb.ParticipantDecisionResponse(applied=True)

    async def Abort(self, request: ppb.ParticipantDecisionRequest, context: Any) -> ppb.ParticipantDecisionResponse:  # noqa: N802
        txid = GlobalTxid(request.incarnation, request.txid)
        await self._run(context, request.participant_id, txid, Message(Kind.ABORT, request.term), b"")
        return ppb.ParticipantDecisionResponse(applied=True)

    async def Inquire(self, request: ppb.InquireRequest, context: Any) -> ppb.InquireResponse:  # noqa: N802
        other = self._other(request.participant_id)
        if other is not None:
            await self._abort(context, other)
        try:
            e = await self.store.entry(GlobalTxid(request.incarnation, request.txid))
        except StoreError as err:
            await self._abort(context, _status_of(err))
        return ppb.InquireResponse(record=_local_record(e), term=e.term if e is not None else 0)

    def _check_decisions(
        self, items: Sequence[ppb.DecisionItem], what: str
    ) -> tuple[list[_Status | None], list[tuple[GlobalTxid, Kind, int]]]:
        """Each item's answer where the checks give one (None: the store
        answers it), and the items for the store, in order."""
        answers: list[_Status | None] = []
        valid: list[tuple[GlobalTxid, Kind, int]] = []
        for it in items:
            if it.outcome == ppb.DECISION_OUTCOME_COMMIT:
                kind = Kind.COMMIT
            elif it.outcome == ppb.DECISION_OUTCOME_ABORT:
                kind = Kind.ABORT
            else:
                answers.append(
                    _Status(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"decision item for transaction {it.txid} has no outcome (value {it.outcome})",
                    )
                )
                continue
            other = self._other(it.participant_id)
            if other is not None:
                answers.append(other)
                continue
            answers.append(None)
            valid.append((GlobalTxid(it.incarnation, it.txid), kind, it.term))
        return answers, valid

    @staticmethod
    def _decision_results(
        answers: list[_Status | None], applied: list[Answer | StoreError]
    ) -> list[ppb.DecisionItemResult]:
        out = []
        it = iter(applied)
        for a in answers:
            s = a
            if s is None:
                r = next(it, None)
                if r is None:
                    s = _Status(grpc.StatusCode.INTERNAL, "the store answered fewer items than it was given")
                elif isinstance(r, StoreError):
                    s = _status_of(r)
                elif not r.ack:
                    s = _Status(grpc.StatusCode.INTERNAL, f"a decision answered vote {r.vote}")
            if s is None:
                out.append(ppb.DecisionItemResult(applied=True, code=0))
            else:
                out.append(
                    ppb.DecisionItemResult(
                        applied=False, code=_code_value(s.code), refusal=s.refusal, message=s.message
                    )
                )
        return out

    async def ApplyDecisions(self, request: ppb.ApplyDecisionsRequest, context: Any) -> ppb.ApplyDecisionsResponse:  # noqa: N802
        items = list(request.items)
        if len(items) > DECISION_DELIVERY_ITEMS_MAX:
            await self._abort(
                context,
                _Status(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{len(items)} decisions in one ApplyDecisions message; at most {DECISION_DELIVERY_ITEMS_MAX}",
                ),
            )
        answers, valid = self._check_decisions(items, "ApplyDecisions")
        try:
            applied, _ = await self.store.apply_then_prepare(valid, [])
        except StoreError as e:
            await self._abort(context, _status_of(e))
        return ppb.ApplyDecisionsResponse(results=self._decision_results(answers, applied))

    async def PrepareMany(self, request: ppb.PrepareManyRequest, context: Any) -> ppb.PrepareManyResponse:  # noqa: N802
        items = list(request.items)
        if len(items) > PREPARE_GROUP_ITEMS_MAX:
            await self._abort(
                context,
                _Status(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{len(items)} prepares in one PrepareMany message; at most {PREPARE_GROUP_ITEMS_MAX}",
                ),
            )
        if len(request.decisions) > DECISION_DELIVERY_ITEMS_MAX:
            await self._abort(
                context,
                _Status(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{len(request.decisions)} decisions in one PrepareMany message; "
                    f"at most {DECISION_DELIVERY_ITEMS_MAX}",
                ),
            )
        d_answers, d_valid = self._check_decisions(list(request.decisions), "PrepareMany")
        p_answers: list[_Status | None] = []
        p_valid: list[tuple[GlobalTxid, int, bytes]] = []
        for it in items:
            other = self._other(it.participant_id)
            p_answers.append(other)
            if other is None:
                p_valid.append((GlobalTxid(it.incarnation, it.txid), it.term, it.payload))
        try:
            applied, votes = await self.store.apply_then_prepare(d_valid, p_valid)
        except StoreError as e:
            await self._abort(context, _status_of(e))
        results = []
        vit = iter(votes)
        for a in p_answers:
            s = a
            vote: Answer | None = None
            if s is None:
                r = next(vit, None)
                if r is None:
                    s = _Status(grpc.StatusCode.INTERNAL, "the store answered fewer items than it was given")
                elif isinstance(r, StoreError):
                    s = _status_of(r)
                elif r.vote is None:
                    s = _Status(grpc.StatusCode.INTERNAL, "a prepare answered with an ack")
                else:
                    vote = r
            if vote is not None:
                p = _prepare_response(vote)
                results.append(ppb.PrepareItemResult(vote=p.vote, reason=p.reason, code=0))
            else:
                assert s is not None
                results.append(
                    ppb.PrepareItemResult(
                        vote=ppb.VOTE_UNSPECIFIED, code=_code_value(s.code), refusal=s.refusal, message=s.message
                    )
                )
        return ppb.PrepareManyResponse(results=results, decision_results=self._decision_results(d_answers, applied))

    async def Inspect(self, request: ppb.InspectParticipantRequest, context: Any) -> ppb.InspectParticipantResponse:  # noqa: N802
        if len(request.txids) > INSPECT_RECORDS_MAX:
            await self._abort(
                context,
                _Status(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{len(request.txids)} txids in one Inspect call; at most {INSPECT_RECORDS_MAX} "
                    "(limits::INSPECT_RECORDS_MAX)",
                ),
            )
        if request.recent > INSPECT_RECORDS_MAX:
            await self._abort(
                context,
                _Status(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{request.recent} recent records asked of one Inspect call; at most {INSPECT_RECORDS_MAX} "
                    "(limits::INSPECT_RECORDS_MAX)",
                ),
            )
        try:
            found = await self.store.inspect(
                request.incarnation, list(request.txids), request.in_doubt, request.recent, INSPECT_RECORDS_MAX
            )
        except StoreError as e:
            await self._abort(context, _status_of(e))
        now = unix_ms()
        return ppb.InspectParticipantResponse(
            participant_id=self.participant_id,
            records=[_record_pb(r) for r in found.records],
            in_doubt=[_record_pb(r) for r in found.in_doubt],
            recent=[_record_pb(r) for r in found.recent],
            in_doubt_count=found.in_doubt_count,
            records_total=found.records_total,
            oldest_in_doubt_age_ms=max(0, now - found.oldest_in_doubt_ms) if found.oldest_in_doubt_ms else 0,
            now_unix_ms=now,
        )


@dataclass
class RecoveryOptions:
    """The participant's recovery loop (docs/protocol.md, "Recovery at
    participants")."""

    #: Time between passes.
    interval_s: float = 0.5
    #: After the first pass, ask only about YES votes at least this old.
    prepared_age_min_s: float = 1.0
    #: Decided records (and READ_ONLY votes) older than this are removed
    #: once the cluster will send nothing more for them; None keeps them.
    log_retention_s: float | None = 24 * 3600.0
    #: Time between log GC passes.
    gc_interval_s: float = 10.0
    #: One call's budget (GetDecisions).
    call_deadline_s: float = 3.0


class Recovery:
    """Asks the cluster about the transactions this participant holds in
    doubt and applies the decisions (COMMIT, ABORT, or presumed abort);
    PENDING and OTHER_INCARNATION keep the record and its locks. Also
    collects decided records past ``log_retention_s`` that the cluster is
    done with (COMMIT or ABORT whose ack is recorded, or forgotten)."""

    def __init__(
        self,
        store: Store,
        cluster: Sequence[str],
        participant_id: str,
        options: RecoveryOptions | None = None,
    ) -> None:
        from dtx.client import Client

        self.store = store
        self.participant_id = participant_id
        self.options = options or RecoveryOptions()
        self.client = Client(list(cluster), deadline_s=self.options.call_deadline_s, attempt_timeout_s=1.0)
        self._first = True
        self._gc_cursor: tuple[int, int, int] | None = None
        self._last_gc = 0.0
        #: Decisions applied by recovery (for tests and logs).
        self.applied = 0
        self.collected = 0

    async def run(self) -> None:
        """Passes until cancelled (or the store stops)."""
        try:
            while self.store.failure() is None:
                try:
                    await self.pass_once()
                except StoreError as e:
                    log.error("recovery pass could not read the log: %s", e)
                except Exception:  # noqa: BLE001 - the loop goes on
                    log.exception("recovery pass failed")
                await asyncio.sleep(self.options.interval_s)
        finally:
            await self.client.close()

    async def pass_once(self) -> None:
        from dtx.client import DecisionRead, DtxError

        loop = asyncio.get_running_loop()
        if self.options.log_retention_s is not None and (
            self._first or loop.time() - self._last_gc >= self.options.gc_interval_s
        ):
            self._last_gc = loop.time()
            await self.collect()
        before = None if self._first else unix_ms() - int(self.options.prepared_age_min_s * 1000)
        # Branches first (both stores keep marks; a store without
        # `branch_marks` has none): every marked txid, its flow running or
        # not, is left out of the ordinary in-doubt pass, whose decision is
        # not a branch's to apply unless it is a member.
        marked: set[GlobalTxid] = set()
        if hasattr(self.store, "branch_marks"):
            marks = await self.store.branch_marks()
            marked = {t for t, _ in marks}
            await self.resolve_branches([(t, pid) for t, pid in marks if not self.store.branch_running(t)])
        doubt = [r for r in await self.store.in_doubt(before) if r.txid not in marked]
        self._first = False
        if not doubt:
            return
        by_inc: dict[int, list[int]] = defaultdict(list)
        for r in doubt:
            by_inc[r.txid.incarnation].append(r.txid.txid)
        for inc, txids in by_inc.items():
            try:
                answers = await self.client.decisions(txids, self.participant_id, inc)
            except DtxError as e:
                log.warning(
                    "cluster not answering; holding locks and waiting (%d in doubt): %s", len(txids), e
                )
                return
            other = []
            for a in answers:
                g = GlobalTxid(inc, a.txid)
                if a.decision is DecisionRead.COMMITTED:
                    commit = True
                elif a.decision in (DecisionRead.ABORTED, DecisionRead.UNKNOWN_PRESUMED_ABORT):
                    commit = False
                else:
                    if a.decision is DecisionRead.OTHER_INCARNATION:
                        other.append(a.txid)
                    continue
                if a.settled_by:
                    log.warning("in-doubt transaction %s of another incarnation settled by an operator: %s", g, a.settled_by)
                try:
                    if await self.store.recover(g, commit) is not None:
                        self.applied += 1
                        log.info("recovered %s: %s", g, "COMMIT" if commit else "ABORT")
                except Refused as e:
                    log.info("recovery of %s refused (decided meanwhile): %s", g, e)
            if other:
                log.warning(
                    "in-doubt transactions of incarnation %016x are not this cluster's; keeping them and their "
                    "locks for an operator: %s",
                    inc,
                    other,
                )

    async def resolve_branches(self, branches: Sequence[tuple[GlobalTxid, str]]) -> int:
        """Settles branches prepared here whose registration is not known to
        be recorded, asking the cluster by (txid, participant)
        (GetBranchDecision): a member of a decided transaction applies its
        decision; a member of an undecided one becomes an ordinary in-doubt
        vote (its mark goes); a branch that is not a member rolls back, also
        when the transaction committed without it (the cluster fences it
        out of an open one first). Another incarnation's txid keeps its
        work and mark; no answer keeps everything. Returns how many were
        settled."""
        from dtx.client import BranchDecision, DtxError

        settled = 0
        for txid, pid in branches:
            # The local record first: a mark whose work is decided here
            # already asks nothing (asking would fence a member).
            e = await self.store.entry(txid)
            if e is None or e.state is not State.PREPARED_YES:
                await self.store.unmark_branch(txid)
                continue
            try:
                a = await self.client.branch_decision(txid.txid, pid, txid.incarnation)
            except DtxError as err:
                log.warning("branch %s of %s: cluster not answering; holding its work: %s", pid, txid, err)
                continue
            if a.decision is BranchDecision.PENDING:
                await self.store.unmark_branch(txid)
                continue
            if a.decision is BranchDecision.OTHER_INCARNATION:
                log.warning(
                    "branch of %s: the cluster did not hand this txid out in this incarnation; its work and locks "
                    "are kept: resolve it with the cluster that handed it out",
                    txid,
                )
                continue
            commit = a.decision is BranchDecision.COMMIT
            if not a.member:
                log.info(
                    "branch %s of %s is not in its transaction's participant set%s: rolling its prepared work back",
                    pid,
                    txid,
                    " (fenced out now)" if a.fenced_now else "",
                )
            try:
                if await self.store.recover(txid, commit) is not None:
                    settled += 1
                    self.applied += 1
                    log.info("branch %s settled by recovery: %s", txid, "COMMIT" if commit else "ABORT")
            except Refused as err:
                log.warning("recovery of branch %s refused; its mark stays: %s", txid, err)
                continue
            await self.store.unmark_branch(txid)
        return settled

    async def collect(self) -> int:
        """One log GC pass; returns how many records it removed."""
        from dtx.client import DecisionRead, DtxError

        assert self.options.log_retention_s is not None
        if not self.participant_id:
            return 0
        before = unix_ms() - int(self.options.log_retention_s * 1000)
        cands = await self.store.gc_candidates(before, self._gc_cursor, 10_000)
        if not cands:
            self._gc_cursor = None
            return 0
        last_ms, last = cands[-1]
        self._gc_cursor = (last_ms, last.incarnation, last.txid)
        by_inc: dict[int, list[int]] = defaultdict(list)
        for _, g in cands:
            by_inc[g.incarnation].append(g.txid)
        done: list[GlobalTxid] = []
        kept = 0
        for inc, txids in by_inc.items():
            try:
                answers = await self.client.decisions(txids, self.participant_id, inc)
            except DtxError as e:
                log.info("log GC: cluster not answering, nothing removed: %s", e)
                self._gc_cursor = None
                return 0
            for a in answers:
                safe = (
                    a.decision in (DecisionRead.COMMITTED, DecisionRead.ABORTED) and not a.awaiting_ack
                ) or a.decision is DecisionRead.UNKNOWN_PRESUMED_ABORT
                if safe:
                    done.append(GlobalTxid(inc, a.txid))
                else:
                    kept += 1
        n = await self.store.forget(done) if done else 0
        self.collected += n
        if n:
            log.info("decided log records garbage-collected: %d", n)
        if kept:
            log.warning("decided log records kept past retention: %d", kept)
        return n


class ParticipantServer:
    """A running participant: the gRPC server and, with cluster addresses,
    its recovery loop."""

    def __init__(
        self,
        store: Store,
        participant_id: str,
        listen: str,
        cluster: Sequence[str] = (),
        recovery: RecoveryOptions | None = None,
    ) -> None:
        self.store = store
        self.participant_id = participant_id
        self.listen = listen
        self.cluster = list(cluster)
        self.recovery_options = recovery
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.recovery: Recovery | None = None
        self._recovery_task: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        """``host:port`` as bound (the port the system chose for port 0)."""
        host = self.listen.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    async def start(self) -> ParticipantServer:
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", 8 * 1024 * 1024),
                ("grpc.so_reuseport", 0),
            ]
        )
        pgrpc.add_ParticipantServiceServicer_to_server(ParticipantServicer(self.store, self.participant_id), server)
        self.port = server.add_insecure_port(self.listen)
        if self.port == 0:
            raise OSError(f"cannot listen on {self.listen}")
        await server.start()
        self.server = server
        if self.cluster:
            self.recovery = Recovery(self.store, self.cluster, self.participant_id, self.recovery_options)
            self._recovery_task = asyncio.create_task(self.recovery.run(), name="dtx-recovery")
        elif not self.participant_id:
            log.error("participant served without an id: log GC is off")
        log.info("participant %s serves on %s", self.participant_id, self.address)
        return self

    async def stop(self, grace_s: float | None = 1.0) -> None:
        if self._recovery_task is not None:
            self._recovery_task.cancel()
            try:
                await self._recovery_task
            except asyncio.CancelledError:
                pass
            self._recovery_task = None
        if self.server is not None:
            await self.server.stop(grace_s)
            self.server = None

    async def wait(self) -> None:
        """Until the server stops."""
        if self.server is not None:
            await self.server.wait_for_termination()


async def serve(
    store: Store,
    participant_id: str,
    listen: str,
    cluster: Sequence[str] = (),
    recovery: RecoveryOptions | None = None,
) -> ParticipantServer:
    """Starts serving ``store`` as ``participant_id`` on ``listen``
    (``host:port``; port 0 lets the system choose, see
    :attr:`ParticipantServer.address`), with recovery against ``cluster``
    when given. Stop it with :meth:`ParticipantServer.stop`."""
    return await ParticipantServer(store, participant_id, listen, cluster, recovery).start()
