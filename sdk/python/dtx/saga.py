"""Saga step services (docs/sagas.md, "Step services"): a
``dtx.v1.SagaStepService`` server on an **inbox** in SQLite.

A step service implements :class:`StepHandler` (``forward`` and
``compensate``, on its own tables in the store's SQLite file) and serves a
:class:`StepStore` with :func:`serve_steps`. The SDK keeps the rules of
the Rust SDK's step stores (``participant-sdk/src/saga``):

- **Once per operation id.** Each call's answer is recorded in the inbox
  (``dtx_step_inbox``, keyed by operation id) in the same SQLite
  transaction as the handler's business writes, and the reply leaves only
  after that transaction is committed (``synchronous=FULL``). A repeated
  operation id answers the stored reply and never runs the handler again.
  Only OK (and PENDING, for a forward action) keeps the handler's writes;
  FAILED, NOOP and STALE answers are recorded without them.
- **Fingerprints.** A repeated operation id whose call carries another
  fingerprint than the recorded one (both non-empty) is refused
  FAILED_PRECONDITION and changes nothing: the id names other work. An
  operation id recorded for the other kind of call (a forward id reused for
  a compensation) is refused FAILED_PRECONDITION too.
- **Compensations.** One whose forward operation did not answer OK (or
  PENDING) here answers NOOP without running the handler; when the
  forward operation id is not in the inbox at all, it is **fenced** in the
  same write (recorded FAILED), so a late forward call of it answers
  FAILED and never runs. A handler checks its precondition with
  :meth:`StepCall.check_precondition` and answers STALE (changing nothing)
  when the resource moved on.
- **Status and Fence.** Status answers what an operation id did (nothing
  yet: not applied) and changes nothing; Fence does the same and makes
  "not applied" permanent by recording the operation FAILED ("fenced").
- A call without an operation id (or a compensation naming no forward
  operation) is INVALID_ARGUMENT; a handler that raises rolls everything
  back, records nothing and answers INTERNAL (UNKNOWN to the
  orchestrator, which asks the status query); a store whose write failed
  stops (UNAVAILABLE) until the service restarts.

Not built here: outside calls in flight (ADR 0034), the outbox, TLS and
node tokens on the step port.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import enum
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import grpc
import grpc.aio

from dtx._pb import saga_pb2 as spb
from dtx._pb import saga_pb2_grpc as sgrpc
from dtx.participant.store import SqlTx

log = logging.getLogger("dtx.saga")

T = TypeVar("T")

#: limits::SAGA_STEP_OUTPUT_BYTES_MAX: the largest output an OK may carry.
STEP_OUTPUT_BYTES_MAX = 16 * 1024
#: The reason a fenced operation answers FAILED with (the Rust SDK's).
FENCED_REASON = "fenced: the orchestrator found this operation not applied and settled it as never to run"
SCHEMA_VERSION = "1"


def unix_ms() -> int:
    return time.time_ns() // 1_000_000


class Outcome(enum.IntEnum):
    """What a step call answered (the values of ``dtx.v1.StepOutcome``)."""

    OK = 2
    FAILED = 3
    #: A compensation that found no forward action to undo.
    NOOP = 4
    #: A compensation refused because the resource's version moved on.
    STALE = 5
    #: A forward call accepted and completed later (SagaService.CompleteStep).
    PENDING = 7


@dataclass(frozen=True)
class StepResult:
    """A forward action's or a compensation's answer."""

    outcome: Outcome
    reason: str = ""
    resource_version: str = ""
    downstream_operation_id: str = ""
    #: A compensation's effects that could not be undone.
    residual: str = ""
    #: A forward action's result with its OK, handed to the later steps.
    output: bytes = b""

    @staticmethod
    def ok(
        resource_version: str = "", downstream_operation_id: str = "", output: bytes = b"", residual: str = ""
    ) -> StepResult:
        return StepResult(Outcome.OK, "", resource_version, downstream_operation_id, residual, output)

    @staticmethod
    def failed(reason: str) -> StepResult:
        return StepResult(Outcome.FAILED, reason)

    @staticmethod
    def noop(reason: str) -> StepResult:
        return StepResult(Outcome.NOOP, reason)

    @staticmethod
    def stale(reason: str, residual: str = "") -> StepResult:
        return StepResult(Outcome.STALE, reason, residual=residual)

    @staticmethod
    def pending(reason: str = "", downstream_operation_id: str = "") -> StepResult:
        return StepResult(Outcome.PENDING, reason, downstream_operation_id=downstream_operation_id)

    def happened(self) -> bool:
        """OK or PENDING: the work is (or may become) done here."""
        return self.outcome in (Outcome.OK, Outcome.PENDING)

    def to_reply(self) -> spb.StepReply:
        return spb.StepReply(
            outcome=int(self.outcome),
            reason=self.reason,
            downstream_operation_id=self.downstream_operation_id,
            resource_version=self.resource_version,
            residual=self.residual,
            output=self.output,
        )


class CallKind(enum.Enum):
    FORWARD = "forward"
    COMPENSATE = "compensate"


@dataclass(frozen=True)
class Authorization:
    principal: str = ""
    tenant: str = ""
    #: Unix ms after which the rights may no longer be used; 0: never.
    expires_at_ms: int = 0
    policy: str = ""


@dataclass(frozen=True)
class StepCall:
    """One call of one step (``dtx.v1.StepCall``)."""

    saga_id: int
    step: int
    operation_id: str
    action: str
    input: bytes
    fingerprint: str = ""
    #: Compensation: the resource version the forward action left.
    precondition: str = ""
    #: Compensation: the forward call's operation id.
    forward_operation_id: str = ""
    authorization: Authorization = field(default_factory=Authorization)
    term: int = 0
    #: The earlier steps' outputs: (step, name, output), in step order.
    outputs: tuple[tuple[int, str, bytes], ...] = ()

    @staticmethod
    def from_pb(c: spb.StepCall) -> StepCall:
        a = c.authorization
        return StepCall(
            c.saga_id,
            c.step,
            c.operation_id,
            c.action,
            bytes(c.input),
            c.fingerprint,
            c.precondition,
            c.forward_operation_id,
            Authorization(a.principal, a.tenant, a.expires_at_ms, a.policy),
            c.term,
            tuple((o.step, o.name, bytes(o.output)) for o in c.outputs),
        )

    def check_precondition(self, current_version: str) -> StepResult | None:
        """None when the compensation may go ahead (no precondition, or the
        resource is still at it); else the STALE answer to give."""
        if not self.precondition or self.precondition == current_version:
            return None
        return StepResult.stale(
            f"the resource's version is {current_version!r}, not {self.precondition!r} as the forward action left "
            "it: it moved on, so it is not undone"
        )


@dataclass(frozen=True)
class StepRecord:
    """An inbox record: what an operation id answered here."""

    kind: CallKind
    result: StepResult
    at_ms: int
    saga_id: int
    step: int
    action: str
    fingerprint: str


class StepError(Exception):
    """A call that got no reply (answered with a gRPC status)."""

    code = grpc.StatusCode.INTERNAL


class InvalidCall(StepError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class Conflict(StepError):
    """The operation id is recorded here for other work (another
    fingerprint, or the other kind of call): nothing done."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class StepStoreStopped(StepError):
    code = grpc.StatusCode.UNAVAILABLE


class StepHandler(abc.ABC):
    """What a step service implements, on its own tables in the store's
    SQLite file. Calls run one at a time on the store's thread, inside the
    store's transaction (no network calls, no COMMIT/ROLLBACK: the
    :class:`SqlTx` refuses them). Only an OK (or PENDING) answer keeps the
    writes."""

    def setup(self, db: SqlTx) -> None:  # noqa: B027 - optional
        """Creates the service's tables (``CREATE TABLE IF NOT EXISTS``);
        called at every open, in a transaction of its own."""

    @abc.abstractmethod
    def forward(self, db: SqlTx, call: StepCall) -> StepResult:
        """Runs the forward action ``call.action`` (an unknown one should
        answer FAILED)."""

    @abc.abstractmethod
    def compensate(self, db: SqlTx, call: StepCall) -> StepResult:
        """Undoes forward operation ``call.forward_operation_id`` (the store
        has checked it answered OK here) with compensation ``call.action``;
        checks ``call.check_precondition(current_version)`` first and
        answers STALE when the resource moved on."""

    def authorize(self, call: StepCall) -> str | None:
        """Why the call's rights do not allow it (answered FAILED, not
        recorded: the rights may be renewed), or None. Default: refused once
        they expired."""
        exp = call.authorization.expires_at_ms
        now = unix_ms()
        if exp and exp <= now:
            return (
                f"the saga's rights (principal {call.authorization.principal!r}) expired at {exp} ms, "
                f"now is {now} ms"
            )
        return None

    def knows_query(self, query: str) -> bool:
        """Whether ``query`` names a status query of this service (another
        is INVALID_ARGUMENT). Default: any."""
        return True


def _vet(kind: CallKind, r: StepResult) -> StepResult:
    if r.outcome is Outcome.OK and len(r.output) > STEP_OUTPUT_BYTES_MAX:
        return StepResult.failed(
            f"the step's output is {len(r.output)} bytes; the limit is saga_step_output_bytes_max = "
            f"{STEP_OUTPUT_BYTES_MAX} bytes: answered FAILED, nothing changed"
        )
    if r.outcome is Outcome.PENDING and kind is CallKind.COMPENSATE:
        return StepResult.failed("the compensation answered PENDING: only a forward action completes later; nothing changed")
    return r


def _noop_for(forward_op: str, f: StepRecord | None) -> StepResult:
    if f is None:
        what = "is not in the inbox (now fenced)"
    elif f.kind is CallKind.COMPENSATE:
        what = "is a compensation"
    else:
        what = f"answered {f.result.outcome.name.lower()}: {f.result.reason}"
    return StepResult.noop(f"the forward action never happened here: operation {forward_op!r} {what}")


class StepStore:
    """The inbox and the service's tables in one SQLite file (WAL,
    ``synchronous=FULL``), one call at a time on the store's thread."""

    def __init__(self, path: str | os.PathLike[str], handler: StepHandler, busy_timeout_ms: int = 5000) -> None:
        self.path = Path(path)
        self.handler = handler
        self._busy_timeout_ms = busy_timeout_ms
        self._conn: sqlite3.Connection | None = None
        self._failure: str | None = None
        self._closed = False
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtx-step")
        self._pool.submit(self._open).result()

    # -- the worker thread --------------------------------------------------

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(self.path), isolation_level=None, timeout=self._busy_timeout_ms / 1000)
        self._conn = conn
        conn.execute(f"PRAGMA busy_timeout={int(self._busy_timeout_ms)}")
        if str(conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]).lower() != "wal":
            raise StepError(f"{self.path}: SQLite refused journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS dtx_step_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID"
            )
            conn.execute(
                "CREATE TABLE IF NOT EXISTS dtx_step_inbox ("
                " operation_id TEXT PRIMARY KEY, kind TEXT NOT NULL, outcome INTEGER NOT NULL,"
                " reason TEXT NOT NULL, resource_version TEXT NOT NULL, downstream_operation_id TEXT NOT NULL,"
                " residual TEXT NOT NULL, output BLOB NOT NULL, saga_id INTEGER NOT NULL, step INTEGER NOT NULL,"
                " action TEXT NOT NULL, fingerprint TEXT NOT NULL, at_ms INTEGER NOT NULL) WITHOUT ROWID"
            )
            row = conn.execute("SELECT value FROM dtx_step_meta WHERE key = 'schema_version'").fetchone()
            if row is None:
                conn.execute("INSERT INTO dtx_step_meta VALUES ('schema_version', ?)", (SCHEMA_VERSION,))
            elif row[0] != SCHEMA_VERSION:
                raise StepError(f"{self.path}: step inbox schema version {row[0]}; this build reads {SCHEMA_VERSION}")
            self.handler.setup(SqlTx(conn))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            conn.close()
            self._conn = None
            raise

    @property
    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StepError("the step store is closed")
        return self._conn

    def _check_running(self) -> None:
        if self._failure is not None:
            raise StepStoreStopped(self._failure)

    def _sql(self, q: str, params: Sequence[Any] = ()) -> sqlite3.Cursor:
        try:
            return self._db.execute(q, params)
        except sqlite3.Error as e:
            self._stop(e)
            raise StepStoreStopped(self._failure or str(e)) from e

    def _stop(self, e: sqlite3.Error) -> None:
        if self._failure is None:
            self._failure = f"step store {self.path}: a write failed ({e}); stopped: restart the service"
            log.error("%s", self._failure)

    def _record(self, op: str) -> StepRecord | None:
        r = self._sql(
            "SELECT kind, outcome, reason, resource_version, downstream_operation_id, residual, output, saga_id,"
            " step, action, fingerprint, at_ms FROM dtx_step_inbox WHERE operation_id = ?",
            (op,),
        ).fetchone()
        if r is None:
            return None
        try:
            res = StepResult(Outcome(r[1]), r[2], r[3], r[4], r[5], bytes(r[6]))
            saga_id = r[7] + (1 << 64) if r[7] < 0 else r[7]
            return StepRecord(CallKind(r[0]), res, r[11], saga_id, r[8], r[9], r[10])
        except ValueError as e:
            raise StepError(f"the inbox record of operation {op!r} is damaged: {e}") from e

    def _put(self, op: str, rec: StepRecord) -> None:
        r = rec.result
        self._sql(
            "INSERT INTO dtx_step_inbox (operation_id, kind, outcome, reason, resource_version,"
            " downstream_operation_id, residual, output, saga_id, step, action, fingerprint, at_ms)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                op,
                rec.kind.value,
                int(r.outcome),
                r.reason,
                r.resource_version,
                r.downstream_operation_id,
                r.residual,
                r.output,
                rec.saga_id - (1 << 64) if rec.saga_id >= (1 << 63) else rec.saga_id,
                rec.step,
                rec.action,
                rec.fingerprint,
                rec.at_ms,
            ),
        )

    def _in_tx(self, fn: Callable[[], T]) -> T:
        self._check_running()
        self._sql("BEGIN IMMEDIATE")
        try:
            out = fn()
        except BaseException:
            try:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
            except sqlite3.Error as e:  # pragma: no cover
                self._stop(e)
            raise
        try:
            self._db.execute("COMMIT")
        except sqlite3.Error as e:
            self._stop(e)
            raise StepStoreStopped(self._failure or str(e)) from e
        return out

    @staticmethod
    def _check_repeat(kind: CallKind, call: StepCall, rec: StepRecord) -> None:
        if rec.kind is not kind:
            raise Conflict(
                f"operation id {call.operation_id!r} was a {rec.kind.value} call here, not a {kind.value} call"
            )
        if call.fingerprint and rec.fingerprint and call.fingerprint != rec.fingerprint:
            log.warning(
                "refused: operation id %r repeated with another fingerprint (%s recorded, %s now)",
                call.operation_id,
                rec.fingerprint,
                call.fingerprint,
            )
            raise Conflict(
                f"operation id {call.operation_id!r} is recorded here for another request (fingerprint "
                f"{rec.fingerprint} recorded, {call.fingerprint} in this call); refused, nothing done"
            )

    def _run_handler(self, kind: CallKind, call: StepCall) -> StepResult:
        """The handler's answer in a savepoint whose writes are kept only
        when it happened; an exception rolls back and propagates."""
        self._sql("SAVEPOINT dtx_step")
        try:
            fn = self.handler.forward if kind is CallKind.FORWARD else self.handler.compensate
            r = fn(SqlTx(self._db), call)
            if not isinstance(r, StepResult):
                raise StepError(f"the handler's {kind.value} returned {r!r}, not a StepResult")
            r = _vet(kind, r)
        except BaseException:
            if self._db.in_transaction:
                self._sql("ROLLBACK TO dtx_step")
                self._sql("RELEASE dtx_step")
            raise
        if not self._db.in_transaction:
            raise StepError(f"the handler's {kind.value} ended the store's transaction")
        if not r.happened():
            self._sql("ROLLBACK TO dtx_step")
        self._sql("RELEASE dtx_step")
        return r

    def _call_sync(self, kind: CallKind, call: StepCall) -> StepResult:
        if not call.operation_id:
            raise InvalidCall("the call has no operation id")
        if kind is CallKind.COMPENSATE and not call.forward_operation_id:
            raise InvalidCall("the compensation names no forward operation id")

        def work() -> StepResult:
            rec = self._record(call.operation_id)
            if rec is not None:
                self._check_repeat(kind, call, rec)
                log.debug("repeated %s %r answered from the inbox", kind.value, call.operation_id)
                return rec.result
            why = self.handler.authorize(call)
            if why is not None:
                # Not recorded: the rights may be renewed.
                return StepResult.failed(f"authorization refused: {why}")
            fence: str | None = None
            if kind is CallKind.FORWARD:
                result = self._run_handler(kind, call)
            else:
                f = self._record(call.forward_operation_id)
                if f is not None and f.kind is CallKind.FORWARD and f.result.happened():
                    result = self._run_handler(kind, call)
                else:
                    if f is None:
                        fence = call.forward_operation_id
                    result = _noop_for(call.forward_operation_id, f)
            if result.outcome is Outcome.OK and not result.downstream_operation_id:
                result = StepResult(
                    result.outcome,
                    result.reason,
                    result.resource_version,
                    call.operation_id,
                    result.residual,
                    result.output,
                )
            now = unix_ms()
            self._put(
                call.operation_id, StepRecord(kind, result, now, call.saga_id, call.step, call.action, call.fingerprint)
            )
            if fence is not None:
                self._put(fence, StepRecord(CallKind.FORWARD, StepResult.failed(FENCED_REASON), now, 0, 0, "", ""))
            return result

        return self._in_tx(work)

    def _lookup_sync(self, op: str, fence: bool) -> StepRecord | None:
        if not op:
            raise InvalidCall(f"the {'fence' if fence else 'status query'} names no operation id")
        if not fence:
            self._check_running()
            return self._record(op)

        def work() -> StepRecord | None:
            rec = self._record(op)
            if rec is None:
                self._put(op, StepRecord(CallKind.FORWARD, StepResult.failed(FENCED_REASON), unix_ms(), 0, 0, "", ""))
            return rec

        return self._in_tx(work)

    def _read_sync(self, fn: Callable[[SqlTx], T]) -> T:
        self._check_running()
        return fn(SqlTx(self._db))

    def _write_sync(self, fn: Callable[[SqlTx], T]) -> T:
        return self._in_tx(lambda: fn(SqlTx(self._db)))

    # -- the async API --------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise StepStoreStopped("the step store is closed")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def forward(self, call: StepCall) -> StepResult:
        """A forward call, once per operation id."""
        return await self._run(self._call_sync, CallKind.FORWARD, call)

    async def compensate(self, call: StepCall) -> StepResult:
        """A compensation, once per operation id (NOOP when the forward
        action did not happen here, fencing it when it is unknown)."""
        return await self._run(self._call_sync, CallKind.COMPENSATE, call)

    async def status(self, operation_id: str) -> StepRecord | None:
        """What ``operation_id`` did here (None: nothing yet)."""
        return await self._run(self._lookup_sync, operation_id, False)

    async def fence(self, operation_id: str) -> StepRecord | None:
        """As :meth:`status`; when nothing, records it FAILED ("fenced") so
        that a late call never runs, and answers None."""
        return await self._run(self._lookup_sync, operation_id, True)

    async def read(self, fn: Callable[[SqlTx], T]) -> T:
        return await self._run(self._read_sync, fn)

    async def write(self, fn: Callable[[SqlTx], T]) -> T:
        """Runs ``fn`` in a transaction of its own (initial rows)."""
        return await self._run(self._write_sync, fn)

    def failure(self) -> str | None:
        return self._failure

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if threading.current_thread().name.startswith("dtx-step"):  # pragma: no cover
            raise StepError("close() called from the store's own thread")

        def shut() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        self._pool.submit(shut).result()
        self._pool.shutdown(wait=True)


class SagaStepServicer(sgrpc.SagaStepServiceServicer):  # type: ignore[misc]
    """``dtx.v1.SagaStepService`` on a :class:`StepStore`."""

    def __init__(self, store: StepStore) -> None:
        self.store = store

    async def _fail(self, context: Any, e: StepError) -> NoReturn:
        await context.abort(e.code, str(e))
        raise AssertionError("unreachable")  # pragma: no cover

    async def _call(self, kind: CallKind, request: spb.StepCall, context: Any) -> spb.StepReply:
        call = StepCall.from_pb(request)
        try:
            if kind is CallKind.FORWARD:
                r = await self.store.forward(call)
            else:
                r = await self.store.compensate(call)
        except StepError as e:
            await self._fail(context, e)
        except Exception as e:  # noqa: BLE001 - a failing handler: nothing recorded, UNKNOWN to the orchestrator
            log.exception("step %s of operation %r failed; nothing recorded", kind.value, call.operation_id)
            await self._fail(context, StepError(f"the step's {kind.value} failed, nothing recorded: {e!r}"))
        return r.to_reply()

    async def Forward(self, request: spb.StepCall, context: Any) -> spb.StepReply:  # noqa: N802
        return await self._call(CallKind.FORWARD, request, context)

    async def Compensate(self, request: spb.StepCall, context: Any) -> spb.StepReply:  # noqa: N802
        return await self._call(CallKind.COMPENSATE, request, context)

    async def _lookup(self, request: spb.StepStatusRequest, context: Any, fence: bool) -> spb.StepStatusReply:
        if not self.store.handler.knows_query(request.query):
            await self._fail(context, InvalidCall(f"this service has no status query {request.query!r}"))
        try:
            rec = await (self.store.fence if fence else self.store.status)(request.operation_id)
        except StepError as e:
            await self._fail(context, e)
        if rec is None:
            return spb.StepStatusReply(applied=False)
        return spb.StepStatusReply(applied=True, reply=rec.result.to_reply())

    async def Status(self, request: spb.StepStatusRequest, context: Any) -> spb.StepStatusReply:  # noqa: N802
        return await self._lookup(request, context, False)

    async def Fence(self, request: spb.StepStatusRequest, context: Any) -> spb.StepStatusReply:  # noqa: N802
        return await self._lookup(request, context, True)


class StepServer:
    """A running step service (stop it with :meth:`stop`)."""

    def __init__(self, server: grpc.aio.Server, listen: str, port: int) -> None:
        self.server = server
        self.listen = listen
        self.port = port

    @property
    def address(self) -> str:
        return f"{self.listen.rsplit(':', 1)[0]}:{self.port}"

    async def stop(self, grace_s: float | None = 1.0) -> None:
        await self.server.stop(grace_s)


async def serve_steps(store: StepStore, listen: str) -> StepServer:
    """Serves ``store`` on ``listen`` (``host:port``; port 0: any, see
    :attr:`StepServer.address`)."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    sgrpc.add_SagaStepServiceServicer_to_server(SagaStepServicer(store), server)
    port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    return StepServer(server, listen, port)


__all__ = [
    "FENCED_REASON",
    "Authorization",
    "CallKind",
    "Conflict",
    "InvalidCall",
    "Outcome",
    "SagaStepServicer",
    "StepCall",
    "StepError",
    "StepHandler",
    "StepRecord",
    "StepResult",
    "StepServer",
    "StepStore",
    "StepStoreStopped",
    "serve_steps",
]
