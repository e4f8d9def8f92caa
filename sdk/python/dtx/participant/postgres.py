"""A participant whose resource is a PostgreSQL database (psycopg 3, async):
each transaction's work runs in a PostgreSQL transaction that Prepare ends
with ``PREPARE TRANSACTION``, and Commit / Abort end with ``COMMIT
PREPARED`` / ``ROLLBACK PREPARED``. PostgreSQL's prepared transactions
survive a crash of the server, so the durable YES is PostgreSQL's own; this
module keeps the participant table of docs/protocol.md on top of it, with
the rules, tables and gids of the Rust SDK's PostgreSQL participant
(``participant-sdk/src/postgres.rs``, docs/adr/0015-postgresql-participant.md),
so a database's participant log can be served by either SDK.

The service's part
------------------

A :class:`PgResource` runs the service's SQL for one transaction in the
open PostgreSQL transaction it is given (a :class:`PgTx`) and votes: YES
keeps the work (prepared, then committed or rolled back by the decision),
READ_ONLY and NO roll it back. ``raise Refuse(reason)`` votes NO with the
reason; so does any other exception (logged), and PostgreSQL giving up a
wait (the handler's lock timeout, its statement timeout, a deadlock). There
is nothing to write at Commit or Abort: ``COMMIT PREPARED`` makes the work
visible, ``ROLLBACK PREPARED`` drops it.

What is stored
--------------

- The gid of a prepared transaction is ``dtx:v1:<participant>:<txid>:<term>``
  for a txid of incarnation 0 and ``dtx:v2:<participant>:<incarnation as 16
  hex digits>:<txid>:<term>`` otherwise, ``term`` being the term of the
  Prepare that prepared it. Participant ids: non-empty, no ``:``, no control
  characters, at most 128 bytes (the gid stays under PostgreSQL's 200).
  Only gids with this participant's prefixes in the current database are
  ever listed, committed or rolled back.
- ``dtx_participant_log(participant, txid, state, term, decided_ms)`` for
  incarnation 0 and ``dtx_participant_log_inc`` (the same with
  ``incarnation``) for every other; ``state`` is ``committed`` (the marker:
  inserted INSIDE the prepared transaction, so it becomes visible exactly
  when ``COMMIT PREPARED`` commits the work, and a Commit repeated after
  PostgreSQL forgot the gid finds it), ``aborted``, ``tombstone`` or
  ``read_only``. u64 values are stored as bigints holding their bits.
- ``dtx_participant_term_floor(participant, incarnation, term)``: the highest
  term of any message of that incarnation this participant took, raised in
  its own short transaction before anything the message records is written,
  never lowered (log GC keeps it).
- ``dtx_participant_raised_term(participant, incarnation, txid, term)``: a
  prepared transaction cannot be renamed, so when a message of a later term
  than its gid's is accepted (a new leader's repeated Prepare) the term goes
  here (kept in memory too) until the decision; fencing uses the higher of
  the two.
- ``dtx_participant_branch(participant, incarnation, txid, marked_ms)``: a
  branch's mark (:mod:`dtx.participant.pg_branch`), committed before its
  ``PREPARE TRANSACTION`` and removed once the cluster's answer is known.

Sessions
--------

Prepares and one-phase commits (the resource's work) run on one pool of
connections, Commits, Aborts, Inquire and recovery on another, so handlers
waiting on locks never hold up the decisions that would release them.
Messages of one txid are serialised in the process; others run
concurrently. A handler's transaction has ``lock_timeout`` (1 s) and
``statement_timeout`` (30 s) set (:class:`PgOptions`); a handler must not
wait for rows a prepared transaction holds (they stay locked until its
decision, which may itself wait for this Prepare across two databases).
Every commit the SDK acknowledges is flushed before it answers: each session
raises ``synchronous_commit`` from ``off`` to ``on``, and so does each
handler's transaction before its COMMIT or PREPARE TRANSACTION. A message
whose gRPC call is cancelled still runs to its end (its answer is dropped),
so a cancellation never leaves a half-done step behind.

One process serves a participant id at a time (the raised terms and the
term floors are kept in memory as well as in the tables).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus

from dtx.metadata import RefusalKind
from dtx.participant.log import GlobalTxid, Kind, LogEntry, Message, Refusal, State, Vote
from dtx.participant.store import (
    ACK,
    Answer,
    Damaged,
    Inspection,
    Record,
    Refuse,
    Refused,
    ResourceFailed,
    StoreError,
    StoreFailure,
    StoreUnavailable,
    unix_ms,
)

log = logging.getLogger("dtx.participant.postgres")

T = TypeVar("T")

#: The log table of transactions of incarnation 0.
LOG_TABLE = "dtx_participant_log"
#: The log table of transactions of every other incarnation.
LOG_INC_TABLE = "dtx_participant_log_inc"
#: The term floors, one row per (participant, incarnation).
FLOOR_TABLE = "dtx_participant_term_floor"
#: Terms raised while prepared, one row per transaction until its decision.
RAISED_TABLE = "dtx_participant_raised_term"
#: Branches prepared here whose registration with the cluster is not known
#: to be recorded (:mod:`dtx.participant.pg_branch`), one row per
#: (participant, incarnation, txid): the Rust SDK's table.
BRANCH_TABLE = "dtx_participant_branch"
#: The longest participant id: the longest gid stays under PostgreSQL's 200 bytes.
MAX_PARTICIPANT_ID_LEN = 128

#: Run on every new connection: ``synchronous_commit`` raised from ``off``
#: to ``on`` for the session (the other values flush the commit locally).
SESSION_SETUP = (
    "SELECT set_config('synchronous_commit', 'on', false) WHERE current_setting('synchronous_commit') = 'off'"
)
#: Run in a handler's transaction before its COMMIT or PREPARE TRANSACTION.
TRANSACTION_DURABLE = (
    "SELECT set_config('synchronous_commit', 'on', true) WHERE current_setting('synchronous_commit') = 'off'"
)

_DDL = {
    LOG_TABLE: f"""CREATE TABLE IF NOT EXISTS {LOG_TABLE} (
        participant text NOT NULL,
        txid bigint NOT NULL,
        state text NOT NULL,
        term bigint NOT NULL,
        decided_ms bigint NOT NULL,
        PRIMARY KEY (participant, txid));
    CREATE INDEX IF NOT EXISTS {LOG_TABLE}_decided ON {LOG_TABLE} (participant, decided_ms, txid);""",
    LOG_INC_TABLE: f"""CREATE TABLE IF NOT EXISTS {LOG_INC_TABLE} (
        participant text NOT NULL,
        incarnation bigint NOT NULL,
        txid bigint NOT NULL,
        state text NOT NULL,
        term bigint NOT NULL,
        decided_ms bigint NOT NULL,
        PRIMARY KEY (participant, incarnation, txid));
    CREATE INDEX IF NOT EXISTS {LOG_INC_TABLE}_decided
        ON {LOG_INC_TABLE} (participant, decided_ms, incarnation, txid);""",
    FLOOR_TABLE: f"""CREATE TABLE IF NOT EXISTS {FLOOR_TABLE} (
        participant text NOT NULL,
        incarnation bigint NOT NULL,
        term bigint NOT NULL,
        PRIMARY KEY (participant, incarnation));""",
    RAISED_TABLE: f"""CREATE TABLE IF NOT EXISTS {RAISED_TABLE} (
        participant text NOT NULL,
        incarnation bigint NOT NULL,
        txid bigint NOT NULL,
        term bigint NOT NULL,
        PRIMARY KEY (participant, incarnation, txid));""",
    BRANCH_TABLE: f"""CREATE TABLE IF NOT EXISTS {BRANCH_TABLE} (
        participant text NOT NULL,
        incarnation bigint NOT NULL,
        txid bigint NOT NULL,
        marked_ms bigint NOT NULL,
        PRIMARY KEY (participant, incarnation, txid));""",
}

# The state column's values.
COMMITTED = "committed"
ABORTED = "aborted"
TOMBSTONE = "tombstone"
READ_ONLY = "read_only"

_STATE_OF_ROW = {
    COMMITTED: State.COMMITTED,
    ABORTED: State.ABORTED,
    TOMBSTONE: State.TOMBSTONE,
    READ_ONLY: State.PREPARED_READ_ONLY,
}

# SQLSTATEs.
_UNDEFINED_OBJECT = "42704"
_FEATURE_NOT_SUPPORTED = "0A000"
_INSUFFICIENT_PRIVILEGE = "42501"
_UNIQUE_VIOLATION = "23505"
_LOCK_NOT_AVAILABLE = "55P03"
_QUERY_CANCELED = "57014"
_DEADLOCK = "40P01"
_OUT_OF_MEMORY = "53200"


def _s64(u: int) -> int:
    if not 0 <= u < (1 << 64):
        raise ValueError(f"{u} is not a u64")
    return u - (1 << 64) if u >= (1 << 63) else u


def _u64(s: int) -> int:
    return s + (1 << 64) if s < 0 else s


def _ukey(expr: str) -> str:
    """An SQL expression ordering a bigint that holds a u64's bits as the
    u64 (the sign bit flipped)."""
    return f"(({expr}) # (-9223372036854775808)::bigint)"


def _greatest(a: str, b: str) -> str:
    """The greater of two u64s held in bigints, in SQL."""
    return f"CASE WHEN {_ukey(a)} < {_ukey(b)} THEN {b} ELSE {a} END"


def check_participant_id(pid: str) -> None:
    """Raises ValueError unless ``pid`` can be part of a gid."""
    if not pid:
        raise ValueError("participant id is empty")
    if ":" in pid:
        raise ValueError(f"participant id {pid!r} contains ':' (the gid separator)")
    if any(ord(ch) < 32 or 127 <= ord(ch) < 160 for ch in pid):
        raise ValueError(f"participant id {pid!r} contains a control character")
    if len(pid.encode()) > MAX_PARTICIPANT_ID_LEN:
        raise ValueError(
            f"participant id is {len(pid.encode())} bytes; at most {MAX_PARTICIPANT_ID_LEN} keep the gid under "
            "PostgreSQL's 200 bytes"
        )


_DIGITS = re.compile(r"^[0-9]{1,20}$")
_HEX16 = re.compile(r"^[0-9a-fA-F]{16}$")


def _u64_of(text: str) -> int | None:
    if not _DIGITS.match(text):
        return None
    v = int(text)
    return v if v < (1 << 64) else None


def gid_prefix(participant_id: str, txid: GlobalTxid) -> str:
    """The start of every gid of ``txid`` at ``participant_id`` (any term)."""
    if txid.incarnation == 0:
        return f"dtx:v1:{participant_id}:{txid.txid}:"
    return f"dtx:v2:{participant_id}:{txid.incarnation:016x}:{txid.txid}:"


def gid_of(participant_id: str, txid: GlobalTxid, term: int) -> str:
    """The gid a Prepare of ``txid`` at ``term`` prepares under."""
    return f"{gid_prefix(participant_id, txid)}{term}"


def parse_gid(gid: str) -> tuple[str, GlobalTxid, int] | None:
    """(participant, transaction, term) of a dtx gid; None for any other."""
    if gid.startswith("dtx:v1:"):
        parts = gid[len("dtx:v1:") :].split(":")
        if len(parts) != 3 or not parts[0]:
            return None
        txid, term = _u64_of(parts[1]), _u64_of(parts[2])
        if txid is None or term is None:
            return None
        return parts[0], GlobalTxid(0, txid), term
    if gid.startswith("dtx:v2:"):
        parts = gid[len("dtx:v2:") :].split(":")
        if len(parts) != 4 or not parts[0] or not _HEX16.match(parts[1]):
            return None
        inc = int(parts[1], 16)
        txid, term = _u64_of(parts[2]), _u64_of(parts[3])
        if inc == 0 or txid is None or term is None:
            return None
        return parts[0], GlobalTxid(inc, txid), term
    return None


@dataclass
class PgOptions:
    """How the participant uses PostgreSQL."""

    #: Connections for Prepares and one-phase commits (the handlers): how
    #: many run at once; also the least ``max_prepared_transactions``
    #: accepted at open.
    concurrency: int = 8
    #: Connections for Commit, Abort, Inquire and recovery, apart from the
    #: handlers', so handlers waiting on locks never hold up the decisions
    #: that would release them.
    decision_pool_size: int = 4
    #: The longest a message waits for a pooled connection; then it is
    #: answered UNAVAILABLE (the coordinator asks again).
    pool_wait_timeout_s: float = 5.0
    #: ``lock_timeout`` of a handler's transaction (0: none): a handler that
    #: waits longer for a row lock votes NO, saying so.
    handler_lock_timeout_ms: int = 1_000
    #: ``statement_timeout`` of a handler's transaction (0: none).
    handler_statement_timeout_ms: int = 30_000
    #: How long an Abort waits for the log row a Prepare of the same txid in
    #: another session holds, before it looks at pg_prepared_xacts again;
    #: and the marker's insert in a handler's transaction.
    abort_lock_timeout_ms: int = 200
    #: Connection attempts at open before giving up, the first wait between
    #: them (doubled each time, up to ``connect_backoff_max_s``), and the
    #: timeout of one attempt.
    connect_attempts: int = 8
    connect_backoff_s: float = 0.2
    connect_backoff_max_s: float = 5.0
    connect_timeout_s: float = 5.0

    def validate(self) -> None:
        if self.concurrency < 1:
            raise ValueError("PgOptions: concurrency must be at least 1")
        if self.decision_pool_size < 1:
            raise ValueError("PgOptions: decision_pool_size must be at least 1 (phase two and recovery need one)")
        if not 0 < self.pool_wait_timeout_s <= 3600:
            raise ValueError("PgOptions: pool_wait_timeout_s must be in (0, 3600]")
        for name in ("handler_lock_timeout_ms", "handler_statement_timeout_ms"):
            v = getattr(self, name)
            if not 0 <= v <= 2**31 - 1:
                raise ValueError(f"PgOptions: {name} is {v}; 0 (no limit) to {2**31 - 1} (PostgreSQL's limit)")
        if not 1 <= self.abort_lock_timeout_ms <= 2**31 - 1:
            raise ValueError("PgOptions: abort_lock_timeout_ms must be at least 1 (an Abort must look again)")
        if self.connect_attempts < 1:
            raise ValueError("PgOptions: connect_attempts must be at least 1")


_CONTROL = re.compile(
    r"^\s*(BEGIN|START\s+TRANSACTION|COMMIT|END|ABORT|ROLLBACK(?!\s+TO\b)|PREPARE\s+TRANSACTION)\b",
    re.I,
)


class PgTx:
    """The resource's view of the open PostgreSQL transaction: its statements
    are prepared (and committed or rolled back) with the transaction, or
    rolled back with it. Statements that would end it (COMMIT, ROLLBACK,
    PREPARE TRANSACTION, ...) are refused; savepoints are allowed.
    Parameters are psycopg's (``%s`` or ``%(name)s``)."""

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self._conn = conn

    @property
    def connection(self) -> psycopg.AsyncConnection[Any]:
        """The session itself (cursors, COPY); it must not end the
        transaction."""
        return self._conn

    def _check(self, query: Any) -> None:
        text = query if isinstance(query, str) else query.as_string(self._conn) if hasattr(query, "as_string") else ""
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        m = _CONTROL.match(text)
        if m:
            raise psycopg.ProgrammingError(
                f"a resource may not run {m.group(1).upper()}: the SDK owns the transaction"
            )

    async def execute(self, query: Any, params: Any = None) -> psycopg.AsyncCursor[Any]:
        self._check(query)
        return await self._conn.execute(query, params)

    async def executemany(self, query: Any, params_seq: Sequence[Any]) -> None:
        self._check(query)
        async with self._conn.cursor() as cur:
            await cur.executemany(query, params_seq)

    async def one(self, query: Any, params: Any = None) -> Any:
        """The first row of a query, or None."""
        return await (await self.execute(query, params)).fetchone()

    async def all(self, query: Any, params: Any = None) -> list[Any]:
        return await (await self.execute(query, params)).fetchall()


class PgResource(abc.ABC):
    """The service's work under two-phase commit, in PostgreSQL."""

    @abc.abstractmethod
    async def prepare(self, tx: PgTx, txid: GlobalTxid, payload: bytes) -> Vote:
        """Runs the transaction's SQL in ``tx`` and votes. YES keeps the work
        (``PREPARE TRANSACTION``; the decision commits or rolls it back);
        READ_ONLY and NO roll it back; ``raise Refuse(reason)`` votes NO
        with the reason. It must not wait for rows that prepared
        transactions hold (``FOR UPDATE NOWAIT``, and vote NO when a row is
        taken): the handler's ``lock_timeout`` bounds such a wait, and
        the vote is then NO. Key rows by ``str(txid)`` (it carries the
        incarnation) when you key them by transaction."""


@dataclass(frozen=True)
class _Prepared:
    gid: str
    #: The term fencing uses: the gid's, or a later one raised to.
    term: int
    #: The term in the gid (the Prepare's).
    gid_term: int


@dataclass(frozen=True)
class _Row:
    state: str
    term: int


class _Pool:
    """A bounded set of connections (autocommit; the SDK sends BEGIN itself).
    A connection given back outside a transaction is kept; any other is
    closed (PostgreSQL rolls back what it had open)."""

    def __init__(self, name: str, store: PgParticipantStore, size: int) -> None:
        self.name = name
        self.size = size
        self._store = store
        self._idle: list[psycopg.AsyncConnection[Any]] = []
        self._sem = asyncio.Semaphore(size)
        self._all: set[psycopg.AsyncConnection[Any]] = set()

    async def _acquire(self) -> psycopg.AsyncConnection[Any]:
        try:
            async with asyncio.timeout(self._store.options.pool_wait_timeout_s):
                await self._sem.acquire()
        except TimeoutError:
            raise StoreUnavailable(
                f"PostgreSQL at {self._store.target}: no free connection in the {self.name} pool ({self.size} "
                f"connections) within {self._store.options.pool_wait_timeout_s} s; the message is retried"
            ) from None
        try:
            while self._idle:
                c = self._idle.pop()
                if not c.closed and c.info.transaction_status == TransactionStatus.IDLE:
                    return c
                self._all.discard(c)
                await _close_quietly(c)
            c = await self._store._connect_once()
            self._all.add(c)
            return c
        except BaseException:
            self._sem.release()
            raise

    def _release(self, c: psycopg.AsyncConnection[Any]) -> None:
        try:
            if not c.closed and c.info.transaction_status == TransactionStatus.IDLE:
                self._idle.append(c)
            else:
                self._all.discard(c)
                if not c.closed:
                    # Closing the socket makes PostgreSQL roll back what is open.
                    with contextlib.suppress(Exception):
                        c.pgconn.finish()
        finally:
            self._sem.release()

    @contextlib.asynccontextmanager
    async def lease(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        c = await self._acquire()
        try:
            yield c
        finally:
            self._release(c)

    async def close(self) -> None:
        conns = list(self._all)
        self._all.clear()
        self._idle.clear()
        for c in conns:
            await _close_quietly(c)


async def _close_quietly(c: psycopg.AsyncConnection[Any]) -> None:
    with contextlib.suppress(Exception):
        await c.close()


class _TxLocks:
    """One asyncio lock per transaction with a message in flight (FIFO, so
    the items of a group keep their order)."""

    def __init__(self) -> None:
        self._locks: dict[GlobalTxid, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, txid: GlobalTxid) -> AsyncIterator[None]:
        lock, n = self._locks.get(txid, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._locks[txid] = (lock, n + 1)
        try:
            async with lock:
                yield
        finally:
            lk, n = self._locks[txid]
            if n <= 1:
                del self._locks[txid]
            else:
                self._locks[txid] = (lk, n - 1)


def _stale(term: int, seen: int) -> None:
    if term < seen:
        raise Refused(Refusal(RefusalKind.STALE_TERM, term, seen))


class PgParticipantStore:
    """The participant log of docs/protocol.md on PostgreSQL, with the
    resource's work in PostgreSQL's prepared transactions. Open it with
    :meth:`open`, serve it with :func:`dtx.participant.serve`, close it with
    :meth:`close`."""

    def __init__(
        self, conninfo: str, resource: PgResource, participant_id: str, options: PgOptions | None = None
    ) -> None:
        check_participant_id(participant_id)
        self.options = options or PgOptions()
        self.options.validate()
        self.conninfo = conninfo
        self.resource = resource
        self.participant_id = participant_id
        self._prefix = f"dtx:v1:{participant_id}:"
        self._prefix_v2 = f"dtx:v2:{participant_id}:"
        self._locks = _TxLocks()
        self._floors: dict[int, int] = {}
        self._raised: dict[GlobalTxid, int] = {}
        #: Branches (dtx.participant.pg_branch) whose flow runs in this
        #: process: recovery leaves them alone (it would fence them out).
        self._branches_running: set[GlobalTxid] = set()
        self._started_ms = 0
        self._closed = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.target = _describe(conninfo)
        o = self.options
        self._limits = (
            f"SET LOCAL lock_timeout = '{int(o.handler_lock_timeout_ms)}ms'; "
            f"SET LOCAL statement_timeout = '{int(o.handler_statement_timeout_ms)}ms'"
        )
        self._marker_limits = f"SET LOCAL lock_timeout = '{int(o.abort_lock_timeout_ms)}ms'; {TRANSACTION_DURABLE}"
        self._handlers = _Pool("handlers", self, o.concurrency)
        self._decisions = _Pool("decisions", self, o.decision_pool_size)

    # -- opening ------------------------------------------------------------

    @classmethod
    async def open(
        cls, conninfo: str, resource: PgResource, participant_id: str, options: PgOptions | None = None
    ) -> PgParticipantStore:
        """Connects (retrying with backoff), checks
        ``max_prepared_transactions`` and the rights on the log tables,
        creates the tables that are missing (only those: a start never
        waits on a lock a prepared transaction holds), and reads the raised
        terms. Raises :class:`StoreError` saying what to fix."""
        store = cls(conninfo, resource, participant_id, options)
        await store._open()
        return store

    async def _connect_once(self) -> psycopg.AsyncConnection[Any]:
        try:
            c = await psycopg.AsyncConnection.connect(
                self.conninfo, autocommit=True, connect_timeout=max(1, int(self.options.connect_timeout_s))
            )
        except psycopg.Error as e:
            raise StoreUnavailable(f"PostgreSQL at {self.target}: cannot connect: {e}") from e
        try:
            await c.execute(SESSION_SETUP)
        except psycopg.Error as e:
            await _close_quietly(c)
            raise _pg_error(self.target, "setting up the session", e) from e
        return c

    async def _first_connection(self) -> psycopg.AsyncConnection[Any]:
        o = self.options
        wait = o.connect_backoff_s
        for attempt in range(1, o.connect_attempts + 1):
            try:
                return await self._connect_once()
            except StoreUnavailable as e:
                if attempt == o.connect_attempts:
                    raise StoreError(
                        f"{e} (gave up after {attempt} attempts; is the server running and the connection "
                        "string right?)"
                    ) from e
                log.warning("PostgreSQL at %s: attempt %d of %d failed: %s", self.target, attempt, o.connect_attempts, e)
                await asyncio.sleep(wait)
                wait = min(wait * 2, o.connect_backoff_max_s)
        raise AssertionError("unreachable")  # pragma: no cover

    def _open_err(self, message: str) -> StoreError:
        return StoreError(f"PostgreSQL participant {self.participant_id} at {self.target}: {message}")

    async def _open(self) -> None:
        c = await self._first_connection()
        try:
            row = await _one(
                c,
                "SELECT current_setting('max_prepared_transactions')::int, (SELECT count(*) FROM pg_prepared_xacts),"
                " (SELECT reset_val FROM pg_settings WHERE name = 'synchronous_commit'), current_user::text,"
                " current_database()::text",
            )
            assert row is not None
            max_prepared, held, sync_default, user, dbname = row
            n = self.options.concurrency
            if max_prepared <= 0 or max_prepared < n:
                raise self._open_err(
                    f"max_prepared_transactions is {max_prepared}, below this participant's concurrency {n} (0 "
                    f"disables PREPARE TRANSACTION): set max_prepared_transactions = {max(n, 64)} (or more) in "
                    "postgresql.conf and restart PostgreSQL; the slots are shared by every database of the server "
                    "and each is held until its transaction's decision"
                )
            if max_prepared - held < n:
                log.warning(
                    "PostgreSQL at %s: %d of max_prepared_transactions = %d free, fewer than this participant's "
                    "concurrency %d; Prepares beyond the free slots vote NO until decisions free some",
                    self.target,
                    max_prepared - held,
                    max_prepared,
                    n,
                )
            if sync_default == "off":
                log.info(
                    "PostgreSQL at %s: role %s has synchronous_commit = off; this participant sets it to on for its "
                    "own sessions and transactions, so what it acknowledges survives a crash",
                    self.target,
                    user,
                )
            for table, ddl in _DDL.items():
                hint = (
                    f"the role {user} needs CREATE on the schema to create {table} (or an owner creates it and "
                    f"grants SELECT, INSERT, UPDATE, DELETE on it to {user})"
                )
                for tries in range(4):
                    exists = (await _one(c, "SELECT to_regclass(%s) IS NOT NULL", (table,)))[0]  # type: ignore[index]
                    if exists:
                        break
                    try:
                        await c.execute(ddl)
                        break
                    except psycopg.Error as e:
                        if e.sqlstate == _INSUFFICIENT_PRIVILEGE:
                            raise self._open_err(f"cannot create the log table {table} in {dbname}: {e}; {hint}") from e
                        # Two processes creating it at once: look again.
                        if e.sqlstate == _UNIQUE_VIOLATION and tries < 3:
                            continue
                        raise self._open_err(f"creating the log table {table}: {e}") from e
                ok = (await _one(c, "SELECT has_table_privilege(%s, 'SELECT, INSERT, UPDATE, DELETE')", (table,)))[0]  # type: ignore[index]
                if not ok:
                    raise self._open_err(f"the role {user} lacks SELECT, INSERT, UPDATE or DELETE on {table}; {hint}")
            self._started_ms = (await _one(c, "SELECT (extract(epoch from now()) * 1000)::bigint"))[0]  # type: ignore[index]
            rows = await _all(
                c, f"SELECT incarnation, txid, term FROM {RAISED_TABLE} WHERE participant = %s", (self.participant_id,)
            )
            self._raised = {GlobalTxid(_u64(i), _u64(t)): _u64(term) for i, t, term in rows}
            await self._init_legacy_floor(c)
        except psycopg.Error as e:
            raise self._open_err(str(e)) from e
        finally:
            await _close_quietly(c)
        log.info("PostgreSQL participant %s opened on %s", self.participant_id, self.target)

    async def _init_legacy_floor(self, c: psycopg.AsyncConnection[Any]) -> None:
        """Incarnation 0's floor of a database written before floors existed
        (by an older Rust SDK): the highest term of its rows and gids."""
        got = await _one(
            c,
            f"SELECT term FROM {FLOOR_TABLE} WHERE participant = %s AND incarnation = 0",
            (self.participant_id,),
        )
        if got is not None:
            return
        r = await _one(c, f"SELECT coalesce(max(term), 0) FROM {LOG_TABLE} WHERE participant = %s", (self.participant_id,))
        floor = max(0, r[0] if r else 0)
        for txid, term in await self._prepared_gids(c):
            if txid.incarnation == 0:
                floor = max(floor, term)
        await self._raise_floor(c, 0, floor)

    # -- gids and rows ------------------------------------------------------

    def gid(self, txid: GlobalTxid, term: int) -> str:
        """The gid a Prepare of ``txid`` at ``term`` prepares under."""
        return gid_of(self.participant_id, txid, term)

    def _parse_gid(self, gid: str) -> tuple[GlobalTxid, int] | None:
        p = parse_gid(gid)
        if p is None or p[0] != self.participant_id:
            return None
        return p[1], p[2]

    async def _prepared_gids(self, c: psycopg.AsyncConnection[Any]) -> list[tuple[GlobalTxid, int]]:
        rows = await _all(
            c,
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
            " AND (starts_with(gid, %s) OR starts_with(gid, %s))",
            (self._prefix, self._prefix_v2),
        )
        out = []
        for (gid,) in rows:
            p = self._parse_gid(gid)
            if p is not None:
                out.append(p)
        return out

    async def _prepared(self, c: psycopg.AsyncConnection[Any], txid: GlobalTxid) -> _Prepared | None:
        rows = await _all(
            c,
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() AND starts_with(gid, %s)",
            (gid_prefix(self.participant_id, txid),),
        )
        best: _Prepared | None = None
        for (gid,) in rows:
            p = self._parse_gid(gid)
            if p is None or p[0] != txid:
                log.warning("ignoring prepared transaction %r: not a gid of this participant", gid)
                continue
            if best is None or best.gid_term < p[1]:
                best = _Prepared(gid, p[1], p[1])
        if best is not None:
            raised = self._raised.get(txid)
            if raised is not None and raised > best.term:
                best = _Prepared(best.gid, raised, best.gid_term)
        return best

    def _key(self, txid: GlobalTxid) -> tuple[str, str, tuple[Any, ...]]:
        """The table of ``txid``'s row, the condition and its parameters."""
        if txid.incarnation == 0:
            return LOG_TABLE, "participant = %s AND txid = %s", (self.participant_id, _s64(txid.txid))
        return (
            LOG_INC_TABLE,
            "participant = %s AND incarnation = %s AND txid = %s",
            (self.participant_id, _s64(txid.incarnation), _s64(txid.txid)),
        )

    def _insert(self, txid: GlobalTxid, state: str, term: int) -> tuple[str, tuple[Any, ...]]:
        now = unix_ms()
        if txid.incarnation == 0:
            return (
                f"INSERT INTO {LOG_TABLE} (participant, txid, state, term, decided_ms) VALUES (%s, %s, %s, %s, %s)",
                (self.participant_id, _s64(txid.txid), state, _s64(term), now),
            )
        return (
            f"INSERT INTO {LOG_INC_TABLE} (participant, incarnation, txid, state, term, decided_ms)"
            " VALUES (%s, %s, %s, %s, %s, %s)",
            (self.participant_id, _s64(txid.incarnation), _s64(txid.txid), state, _s64(term), now),
        )

    async def _row(self, c: psycopg.AsyncConnection[Any], txid: GlobalTxid) -> _Row | None:
        table, cond, params = self._key(txid)
        r = await _one(c, f"SELECT state, term FROM {table} WHERE {cond}", params)
        return None if r is None else _Row(r[0], _u64(r[1]))

    def _state(self, txid: GlobalTxid, row: _Row) -> State:
        try:
            return _STATE_OF_ROW[row.state]
        except KeyError:
            raise Damaged(f"the log row of {txid} holds state {row.state!r}, which this build does not know") from None

    async def _record(self, c: psycopg.AsyncConnection[Any], txid: GlobalTxid, state: str, term: int) -> _Row:
        """Inserts a decided row unless one exists; the row now there."""
        q, params = self._insert(txid, state, term)
        await c.execute(q + " ON CONFLICT DO NOTHING", params)
        row = await self._row(c, txid)
        if row is None:
            raise Damaged(f"the log row of {txid} just written is missing")
        return row

    async def _raise_term(self, c: psycopg.AsyncConnection[Any], txid: GlobalTxid, term: int) -> None:
        table, cond, params = self._key(txid)
        await c.execute(
            f"UPDATE {table} SET term = %s WHERE {cond} AND {_ukey('term')} < {_ukey('%s')}",
            (_s64(term), *params, _s64(term)),
        )

    async def _floor(self, c: psycopg.AsyncConnection[Any], incarnation: int) -> int:
        f = self._floors.get(incarnation)
        if f is not None:
            return f
        r = await _one(
            c,
            f"SELECT term FROM {FLOOR_TABLE} WHERE participant = %s AND incarnation = %s",
            (self.participant_id, _s64(incarnation)),
        )
        term = 0 if r is None else _u64(r[0])
        f = max(self._floors.get(incarnation, 0), term)
        self._floors[incarnation] = f
        return f

    async def _raise_floor(self, c: psycopg.AsyncConnection[Any], incarnation: int, term: int) -> None:
        """Raises the floor of ``incarnation`` to ``term`` (durably, in its
        own statement) unless it is there already; never lowers it, also
        when two messages raise it at once."""
        if self._floors.get(incarnation, -1) >= term:
            return
        r = await _one(
            c,
            f"INSERT INTO {FLOOR_TABLE} AS f (participant, incarnation, term) VALUES (%s, %s, %s)"
            f" ON CONFLICT (participant, incarnation) DO UPDATE SET term = {_greatest('f.term', 'EXCLUDED.term')}"
            " RETURNING term",
            (self.participant_id, _s64(incarnation), _s64(term)),
        )
        now = _u64(r[0]) if r else term
        self._floors[incarnation] = max(self._floors.get(incarnation, 0), now)

    async def term_floor(self, incarnation: int) -> int:
        """The term floor of ``incarnation`` (0: none yet)."""
        async with self._decisions.lease() as c:
            return await self._guard("reading the term floor", self._floor(c, incarnation))

    async def _raise_prepared(self, c: psycopg.AsyncConnection[Any], txid: GlobalTxid, term: int) -> None:
        await c.execute(
            f"INSERT INTO {RAISED_TABLE} AS r (participant, incarnation, txid, term) VALUES (%s, %s, %s, %s)"
            f" ON CONFLICT (participant, incarnation, txid) DO UPDATE SET term = {_greatest('r.term', 'EXCLUDED.term')}",
            (self.participant_id, _s64(txid.incarnation), _s64(txid.txid), _s64(term)),
        )
        self._raised[txid] = max(self._raised.get(txid, 0), term)

    async def _forget_raised(self, c: psycopg.AsyncConnection[Any], txid: GlobalTxid) -> None:
        if txid not in self._raised:
            return
        await c.execute(
            f"DELETE FROM {RAISED_TABLE} WHERE participant = %s AND incarnation = %s AND txid = %s",
            (self.participant_id, _s64(txid.incarnation), _s64(txid.txid)),
        )
        self._raised.pop(txid, None)

    async def _finish(self, c: psycopg.AsyncConnection[Any], txid: GlobalTxid, gid: str, commit: bool) -> None:
        """COMMIT or ROLLBACK PREPARED ``gid`` (as the role that prepared it
        when this one is a member of it), then forgets a raised term. A
        psycopg error is raised as is for the caller to read."""
        verb = "COMMIT PREPARED" if commit else "ROLLBACK PREPARED"
        stmt = sql.SQL(verb + " {}").format(sql.Literal(gid))
        try:
            await c.execute(stmt)
        except psycopg.Error as e:
            if e.sqlstate != _INSUFFICIENT_PRIVILEGE:
                raise
            who = await _one(
                c,
                "SELECT owner::text, current_user::text FROM pg_prepared_xacts"
                " WHERE gid = %s AND database = current_database()",
                (gid,),
            )
            if who is None:
                raise
            owner, me = who
            try:
                await c.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(owner)))
            except psycopg.Error as e2:
                if e2.sqlstate != _INSUFFICIENT_PRIVILEGE:
                    raise
                message = (
                    f"{verb} of transaction {txid} (gid {gid!r}) refused by PostgreSQL at {self.target}: {e} "
                    f"(SQLSTATE 42501). It was prepared by role {owner}; this participant connects as {me}, and "
                    f"only the role that prepared a transaction, a member of it or a superuser may finish it. The "
                    f"decision is kept and delivered again. Fix: GRANT {owner} TO {me}, or run the service as "
                    f"{owner} until no prepared transaction of {owner} remains"
                )
                log.error("%s", message)
                raise ResourceFailed(message) from e2
            try:
                await c.execute(stmt)
            finally:
                await c.execute("RESET ROLE")
            log.info("%s %r as role %s, which prepared it (this participant connects as %s)", verb, gid, owner, me)
        await self._forget_raised(c, txid)

    # -- messages -----------------------------------------------------------

    async def _guard(self, what: str, coro: Awaitable[T]) -> T:
        """Runs ``coro`` turning psycopg's errors into the store's."""
        try:
            return await coro
        except psycopg.Error as e:
            raise _pg_error(self.target, what, e) from e

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """A task that runs to its end even when the caller is cancelled."""
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)

        def done(task: asyncio.Task[T]) -> None:
            self._tasks.discard(task)
            if not task.cancelled():
                task.exception()  # retrieved: an error of a dropped call is not "never retrieved"

        t.add_done_callback(done)
        return t

    async def handle(self, txid: GlobalTxid, msg: Message, payload: bytes = b"") -> Answer:
        """One coordinator message. Raises :class:`Refused` for a refusal and
        another :class:`StoreError` when the store cannot answer. A
        cancelled caller does not stop the work (its answer is dropped)."""
        if self._closed.is_set():
            raise StoreUnavailable("the PostgreSQL participant store is closed")
        return await asyncio.shield(self._spawn(self._handle(txid, msg, payload, False)))  # type: ignore[return-value]

    async def recover(self, txid: GlobalTxid, commit: bool) -> Answer | None:
        msg = Message(Kind.COMMIT if commit else Kind.ABORT, 0)
        return await asyncio.shield(self._spawn(self._handle(txid, msg, b"", True)))

    async def _handle(self, txid: GlobalTxid, msg: Message, payload: bytes, recovery: bool) -> Answer | None:
        async with self._locks.hold(txid):
            pool = self._handlers if msg.kind in (Kind.PREPARE, Kind.COMMIT_ONE_PHASE) else self._decisions
            async with pool.lease() as c:
                try:
                    if recovery:
                        # At the record's own term, only while it is in doubt.
                        p = await self._prepared(c, txid)
                        if p is None:
                            return None
                        msg = Message(msg.kind, p.term)
                    return await self._handle_on(c, txid, msg, payload)
                except psycopg.Error as e:
                    raise _pg_error(self.target, f"{msg.kind.value} of {txid}", e) from e

    async def _handle_on(self, c: psycopg.AsyncConnection[Any], txid: GlobalTxid, msg: Message, payload: bytes) -> Answer:
        # The floor is raised before anything this message records is
        # written (so it is never below a recorded term), and only by a term
        # above it (which no floor check refuses).
        floor = await self._floor(c, txid.incarnation)
        if msg.term > floor:
            await self._raise_floor(c, txid.incarnation, msg.term)
        if msg.kind is Kind.PREPARE:
            return await self._on_prepare(c, txid, msg.term, floor, payload)
        if msg.kind is Kind.COMMIT:
            return await self._on_commit(c, txid, msg.term)
        if msg.kind is Kind.ABORT:
            return await self._on_abort(c, txid, msg.term)
        return await self._on_one_phase(c, txid, msg.term, floor, payload)

    async def _on_prepare(
        self, c: psycopg.AsyncConnection[Any], txid: GlobalTxid, term: int, floor: int, payload: bytes
    ) -> Answer:
        p = await self._prepared(c, txid)
        if p is not None:
            _stale(term, p.term)
            if term > p.term:
                await self._raise_prepared(c, txid, term)
            return Answer(Vote.YES)
        row = await self._row(c, txid)
        if row is not None:
            return await self._repeat_prepare(c, txid, term, row)
        # Nothing here: below the term floor it is a deposed leader's.
        _stale(term, floor)
        vote, reason, open_tx = await self._run_handler(c, txid, term, payload, keep_read_only=False)
        if open_tx:
            try:
                await c.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(self.gid(txid, term))))
                return Answer(Vote.YES)
            except psycopg.Error as e:
                if c.info.transaction_status != TransactionStatus.IDLE:
                    await _rollback_quietly(c)
                why = self._no_slot(txid, e) or self._not_preparable(txid, e)
                if why is None:
                    raise
                vote, reason = Vote.NO, why
        state = READ_ONLY if vote is Vote.READ_ONLY else ABORTED
        row = await self._record(c, txid, state, term)
        if row.state == READ_ONLY:
            return Answer(Vote.READ_ONLY)
        if row.state in (ABORTED, TOMBSTONE) and vote is Vote.NO:
            return Answer(Vote.NO, reason or "the resource refused")
        if row.state == COMMITTED:
            return Answer(Vote.YES)
        return Answer(Vote.NO, f"transaction {txid} was aborted here")

    async def _repeat_prepare(self, c: psycopg.AsyncConnection[Any], txid: GlobalTxid, term: int, row: _Row) -> Answer:
        _stale(term, row.term)
        state = self._state(txid, row)
        await self._raise_term(c, txid, term)
        if state is State.COMMITTED:
            return Answer(Vote.YES)
        if state is State.PREPARED_READ_ONLY:
            return Answer(Vote.READ_ONLY)
        if state is State.TOMBSTONE:
            return Answer(Vote.NO, f"transaction {txid} was aborted here before its Prepare arrived")
        return Answer(Vote.NO, f"transaction {txid} was already aborted here")

    async def _run_handler(
        self, c: psycopg.AsyncConnection[Any], txid: GlobalTxid, term: int, payload: bytes, keep_read_only: bool
    ) -> tuple[Vote, str, bool]:
        """BEGIN, the handler's limits, the handler. On YES (and READ_ONLY
        when ``keep_read_only``) the ``committed`` marker is inserted and the
        transaction left open (True); otherwise it is rolled back."""
        await c.execute("BEGIN")
        try:
            await c.execute(self._limits)
            reason = ""
            try:
                vote = Vote(await self.resource.prepare(PgTx(c), txid, payload))
            except Refuse as r:
                vote, reason = Vote.NO, r.reason or "the resource refused"
            except psycopg.Error as e:
                if c.closed or c.broken or _connection_lost(e):
                    raise
                vote, reason = Vote.NO, self._gave_up(txid, e) or ""
                if not reason:
                    log.exception("the resource's prepare of %s failed; voting NO", txid)
                    reason = f"the resource failed: {e!r}"
            except Exception as e:  # noqa: BLE001 - a resource that fails votes NO, safely
                log.exception("the resource's prepare of %s raised; voting NO", txid)
                vote, reason = Vote.NO, f"the resource failed: {e!r}"
            status = c.info.transaction_status
            if status == TransactionStatus.IDLE:
                raise ResourceFailed(f"the resource's prepare of {txid} ended the SDK's transaction")
            if status == TransactionStatus.INERROR and vote is not Vote.NO:
                vote, reason = Vote.NO, f"a statement of the resource's work for {txid} failed"
            keep = vote is Vote.YES or (keep_read_only and vote is Vote.READ_ONLY)
            if not keep:
                await c.execute("ROLLBACK")
                return vote, reason, False
            # The marker, with synchronous_commit back on if the handler turned
            # it off, under a short lock timeout: a tombstone written
            # concurrently makes it a unique violation (the Abort came first).
            await c.execute(self._marker_limits)
            q, params = self._insert(txid, COMMITTED, term)
            try:
                await c.execute(q, params)
            except psycopg.Error as e:
                if e.sqlstate not in (_UNIQUE_VIOLATION, _LOCK_NOT_AVAILABLE):
                    raise
                await c.execute("ROLLBACK")
                return Vote.NO, f"transaction {txid} was aborted here concurrently (its Abort came first)", False
            return vote, reason, True
        except BaseException:
            await _rollback_quietly(c)
            raise

    def _gave_up(self, txid: GlobalTxid, e: psycopg.Error) -> str | None:
        o = self.options
        if e.sqlstate == _LOCK_NOT_AVAILABLE:
            why = (
                "a row its work needs is held by another transaction (a prepared one holds its rows until its "
                f"decision); the handler waited at most handler_lock_timeout_ms = {o.handler_lock_timeout_ms} ms "
                "(or its own lock_timeout / NOWAIT)"
            )
        elif e.sqlstate == _QUERY_CANCELED:
            why = f"a statement of its work ran past handler_statement_timeout_ms = {o.handler_statement_timeout_ms} ms"
        elif e.sqlstate == _DEADLOCK:
            why = "PostgreSQL found it in a deadlock"
        else:
            return None
        return f"transaction {txid} not prepared here: {why} ({e.diag.message_primary}, SQLSTATE {e.sqlstate})"

    def _no_slot(self, txid: GlobalTxid, e: psycopg.Error) -> str | None:
        if e.sqlstate != _OUT_OF_MEMORY:
            return None
        reason = (
            f"transaction {txid} not prepared here: PostgreSQL at {self.target} has no free prepared-transaction "
            f"slot: {e.diag.message_primary} (SQLSTATE 53200); raise max_prepared_transactions, or resolve prepared "
            "transactions left behind (pg_prepared_xacts)"
        )
        log.warning("%s", reason)
        return reason

    def _not_preparable(self, txid: GlobalTxid, e: psycopg.Error) -> str | None:
        if e.sqlstate != _FEATURE_NOT_SUPPORTED:
            return None
        reason = (
            f"transaction {txid} not prepared here: PostgreSQL at {self.target} cannot prepare what the resource "
            f"did: {e.diag.message_primary} (SQLSTATE 0A000). Its transaction must not use temporary tables, LISTEN, "
            "UNLISTEN or NOTIFY, cursors WITH HOLD or exported snapshots"
        )
        log.warning("%s", reason)
        return reason

    async def _on_commit(self, c: psycopg.AsyncConnection[Any], txid: GlobalTxid, term: int) -> Answer:
        # The usual Commit comes in the term of its Prepare: its gid is known
        # without reading pg_prepared_xacts. A txid is prepared under one gid
        # only, so this commits what the look-up below would find; when there
        # is no such gid PostgreSQL says so, nothing changed, and the look-up
        # decides. A term raised while prepared fences first.
        raised = self._raised.get(txid)
        if raised is not None:
            _stale(term, raised)
        try:
            await self._finish(c, txid, self.gid(txid, term), True)
            return ACK
        except psycopg.Error as e:
            if e.sqlstate not in (_UNDEFINED_OBJECT, _FEATURE_NOT_SUPPORTED):
                raise
        p = await self._prepared(c, txid)
        if p is not None:
            _stale(term, p.term)
            await self._finish(c, txid, p.gid, True)
            if term > p.gid_term:
                await self._raise_term(c, txid, term)
            return ACK
        row = await self._row(c, txid)
        if row is None:
            raise Refused(Refusal(RefusalKind.COMMIT_WITHOUT_PREPARE))
        _stale(term, row.term)
        if self._state(txid, row) in (State.ABORTED, State.TOMBSTONE):
            raise Refused(Refusal(RefusalKind.COMMIT_AFTER_ABORT))
        await self._raise_term(c, txid, term)
        return ACK

    async def _on_abort(self, c: psycopg.AsyncConnection[Any], txid: GlobalTxid, term: int) -> Answer:
        # A Prepare of this txid in another session may hold the row's lock
        # (its marker) until it prepares; then the wait would last until the
        # decision. Wait briefly, then look for its gid again.
        for _ in range(100):
            p = await self._prepared(c, txid)
            if p is not None:
                _stale(term, p.term)
                await self._finish(c, txid, p.gid, False)
                await self._record(c, txid, ABORTED, term)
                await self._raise_term(c, txid, term)
                return ACK
            row = await self._row(c, txid)
            if row is not None:
                _stale(term, row.term)
                if self._state(txid, row) is State.COMMITTED:
                    raise Refused(Refusal(RefusalKind.ABORT_AFTER_COMMIT))
                await self._raise_term(c, txid, term)
                return ACK
            # Nothing here: the tombstone, so that a late Prepare votes NO.
            await c.execute("BEGIN")
            try:
                await c.execute(self._marker_limits)
                q, params = self._insert(txid, TOMBSTONE, term)
                await c.execute(q + " ON CONFLICT DO NOTHING", params)
                await c.execute("COMMIT")
            except psycopg.Error as e:
                await _rollback_quietly(c)
                if e.sqlstate != _LOCK_NOT_AVAILABLE:
                    raise
                log.debug("abort of %s: the log row is locked (a Prepare in flight); looking again", txid)
            except BaseException:
                await _rollback_quietly(c)
                raise
            # Re-read: a marker committed meanwhile wins.
        raise StoreUnavailable(f"abort of transaction {txid}: its log row stayed locked by another session; try again")

    async def _on_one_phase(
        self, c: psycopg.AsyncConnection[Any], txid: GlobalTxid, term: int, floor: int, payload: bytes
    ) -> Answer:
        p = await self._prepared(c, txid)
        if p is not None:
            # Prepared YES, no decision known here: the one-phase commit is
            # the decision.
            _stale(term, p.term)
            await self._finish(c, txid, p.gid, True)
            await self._raise_term(c, txid, term)
            return ACK
        row = await self._row(c, txid)
        if row is not None:
            _stale(term, row.term)
            state = self._state(txid, row)
            await self._raise_term(c, txid, term)
            if state in (State.ABORTED, State.TOMBSTONE):
                return Answer(Vote.NO, f"transaction {txid} was already aborted here")
            return ACK
        # Nothing here: below the floor it is a deposed leader's (whose
        # one-phase commit may have been applied and its row collected).
        _stale(term, floor)
        vote, reason, open_tx = await self._run_handler(c, txid, term, payload, keep_read_only=True)
        if open_tx:
            # The work and its marker, committed together (READ_ONLY too).
            await c.execute("COMMIT")
            return ACK
        row = await self._record(c, txid, ABORTED, term)
        if row.state == COMMITTED:
            return ACK
        return Answer(Vote.NO, reason or f"transaction {txid} was aborted here")

    # -- groups ---------------------------------------------------------------

    async def apply_then_prepare(
        self,
        decisions: Sequence[tuple[GlobalTxid, Kind, int]],
        prepares: Sequence[tuple[GlobalTxid, int, bytes]],
    ) -> tuple[list[Answer | StoreError], list[Answer | StoreError]]:
        """The decisions first (concurrently, each on its own), then the
        prepares (concurrently): each item is what its own message would be
        (items of one txid keep their order). Raises when every item failed
        on PostgreSQL itself."""

        async def one(txid: GlobalTxid, msg: Message, payload: bytes) -> Answer | StoreError:
            try:
                return await self.handle(txid, msg, payload)
            except StoreError as e:
                return e

        done = list(await asyncio.gather(*(one(t, Message(k, term), b"") for t, k, term in decisions)))
        votes = list(await asyncio.gather(*(one(t, Message(Kind.PREPARE, term), p) for t, term, p in prepares)))
        every = done + votes
        if every and all(isinstance(r, StoreUnavailable) for r in every):
            raise every[0]  # type: ignore[misc]
        return done, votes

    # -- reads ----------------------------------------------------------------

    async def entry(self, txid: GlobalTxid) -> LogEntry | None:
        """The durable record (Inquire): the prepared gid, else the row."""
        async with self._locks.hold(txid), self._decisions.lease() as c:
            return await self._guard(f"Inquire of {txid}", self._entry(c, txid))

    async def _entry(self, c: psycopg.AsyncConnection[Any], txid: GlobalTxid) -> LogEntry | None:
        # Prepared first, then the row: a COMMIT PREPARED in between shows
        # the row; the other order could miss both.
        p = await self._prepared(c, txid)
        if p is not None:
            return LogEntry(State.PREPARED_YES, p.term)
        row = await self._row(c, txid)
        return None if row is None else LogEntry(self._state(txid, row), row.term)

    async def _prepared_rows(self, c: psycopg.AsyncConnection[Any]) -> dict[GlobalTxid, tuple[int, int, int]]:
        """This participant's prepared transactions: txid -> (term fencing
        uses, prepared at ms, age ms by PostgreSQL's clock)."""
        rows = await _all(
            c,
            "SELECT gid, (extract(epoch from prepared) * 1000)::bigint,"
            " (extract(epoch from now() - prepared) * 1000)::bigint FROM pg_prepared_xacts"
            " WHERE database = current_database() AND (starts_with(gid, %s) OR starts_with(gid, %s))",
            (self._prefix, self._prefix_v2),
        )
        out: dict[GlobalTxid, tuple[int, int, int, int]] = {}
        for gid, at, age in rows:
            p = self._parse_gid(gid)
            if p is None:
                log.warning("ignoring prepared transaction %r: its gid does not parse", gid)
                continue
            txid, term = p
            if txid not in out or out[txid][3] < term:
                out[txid] = (max(term, self._raised.get(txid, 0)), at, age, term)
        return {t: (v[0], v[1], v[2]) for t, v in out.items()}

    async def in_doubt(self, voted_before_ms: int | None = None) -> list[Record]:
        """This participant's prepared transactions in pg_prepared_xacts,
        oldest first; with ``voted_before_ms``, those at least ``now -
        voted_before_ms`` old by PostgreSQL's clock, and every one prepared
        before the store opened."""
        async with self._decisions.lease() as c:
            rows = await self._guard("reading pg_prepared_xacts", self._prepared_rows(c))
        age_min = None if voted_before_ms is None else max(0, unix_ms() - voted_before_ms)
        out = [
            Record(t, LogEntry(State.PREPARED_YES, term), at)
            for t, (term, at, age) in rows.items()
            if age_min is None or age >= age_min or at < self._started_ms
        ]
        out.sort(key=lambda r: (r.recorded_ms, r.txid))
        return out

    def _union(self) -> str:
        return (
            "SELECT incarnation, txid, state, term, decided_ms FROM ("
            f" SELECT 0::bigint AS incarnation, txid, state, term, decided_ms FROM {LOG_TABLE} WHERE participant = %s"
            " UNION ALL"
            f" SELECT incarnation, txid, state, term, decided_ms FROM {LOG_INC_TABLE} WHERE participant = %s) AS l"
        )

    def _rec(self, inc: int, txid: int, state: str, term: int, ms: int) -> Record:
        g = GlobalTxid(_u64(inc), _u64(txid))
        return Record(g, LogEntry(self._state(g, _Row(state, 0)), _u64(term)), ms)

    async def inspect(
        self, incarnation: int, txids: Sequence[int], in_doubt: bool, recent: int, list_max: int = 1000
    ) -> Inspection:
        """Reads pg_prepared_xacts, then the log rows; writes nothing. A
        prepared transaction wins over a row of the same txid."""
        async with self._decisions.lease() as c:
            return await self._guard("Inspect", self._inspect(c, incarnation, txids, in_doubt, recent, list_max))

    async def _inspect(
        self,
        c: psycopg.AsyncConnection[Any],
        incarnation: int,
        txids: Sequence[int],
        in_doubt: bool,
        recent: int,
        list_max: int,
    ) -> Inspection:
        prepared = await self._prepared_rows(c)
        pid = self.participant_id

        def as_prepared(t: GlobalTxid) -> Record:
            term, at, _ = prepared[t]
            return Record(t, LogEntry(State.PREPARED_YES, term), at)

        records = []
        for n in txids:
            g = GlobalTxid(incarnation, n)
            if g in prepared:
                records.append(as_prepared(g))
                continue
            table, cond, params = self._key(g)
            r = await _one(c, f"SELECT state, term, decided_ms FROM {table} WHERE {cond}", params)
            records.append(Record(g, None, 0) if r is None else self._rec(_s64(incarnation), _s64(n), *r))
        doubt = sorted((as_prepared(t) for t in prepared), key=lambda r: (r.recorded_ms, r.txid))
        newest: list[Record] = []
        if recent > 0:
            for row in await _all(
                c, self._union() + " ORDER BY decided_ms DESC, incarnation DESC, txid DESC LIMIT %s", (pid, pid, recent)
            ):
                rec = self._rec(*row)
                if rec.txid not in prepared:
                    newest.append(rec)
            newest.extend(doubt)
            newest.sort(key=lambda r: (r.recorded_ms, r.txid), reverse=True)
            newest = newest[:recent]
        total = await _one(
            c,
            f"SELECT (SELECT count(*) FROM {LOG_TABLE} WHERE participant = %s)"
            f" + (SELECT count(*) FROM {LOG_INC_TABLE} WHERE participant = %s)",
            (pid, pid),
        )
        oldest = min((at for _, at, _ in prepared.values()), default=None)
        return Inspection(
            records,
            doubt[:list_max] if in_doubt else [],
            newest,
            len(prepared),
            # A prepared transaction's row is inside it, not visible yet.
            int(total[0] if total else 0) + len(prepared),
            oldest,
        )

    # -- log GC ---------------------------------------------------------------

    async def gc_candidates(
        self, decided_before_ms: int, after: tuple[int, int, int] | None = None, limit: int = 10_000
    ) -> list[tuple[int, GlobalTxid]]:
        """Rows (all decided: a prepared transaction's marker is not visible)
        written at or before ``decided_before_ms``, oldest first, after the
        cursor ``(decided_ms, incarnation, txid)``."""
        pid = self.participant_id
        q = self._union() + " WHERE decided_ms <= %s"
        params: list[Any] = [pid, pid, decided_before_ms]
        if after is not None:
            q += " AND (decided_ms, incarnation, txid) > (%s, %s, %s)"
            params += [after[0], _s64(after[1]), _s64(after[2])]
        q += " ORDER BY decided_ms, incarnation, txid LIMIT %s"
        params.append(limit)
        async with self._decisions.lease() as c:
            rows = await self._guard("reading the log", _all(c, q, params))
        return [(ms, GlobalTxid(_u64(inc), _u64(t))) for inc, t, _, _, ms in rows]

    async def forget(self, txids: Sequence[GlobalTxid]) -> int:
        """Removes decided rows; the term floors stay."""
        n = 0
        async with self._decisions.lease() as c:
            for t in txids:
                table, cond, params = self._key(t)
                cur = await self._guard("forgetting log rows", c.execute(f"DELETE FROM {table} WHERE {cond}", params))
                n += max(0, cur.rowcount)
        return n

    # -- branches (dtx.participant.pg_branch) ---------------------------------

    async def _mark_branch(self, c: psycopg.AsyncConnection[Any], txid: GlobalTxid) -> None:
        """The mark of a branch of ``txid``, committed on ``c`` (autocommit)
        before its PREPARE TRANSACTION."""
        await c.execute(
            f"INSERT INTO {BRANCH_TABLE} (participant, incarnation, txid, marked_ms) VALUES (%s, %s, %s, %s)"
            " ON CONFLICT DO NOTHING",
            (self.participant_id, _s64(txid.incarnation), _s64(txid.txid), unix_ms()),
        )

    async def _unmark_branch_on(self, c: psycopg.AsyncConnection[Any], txid: GlobalTxid) -> None:
        await c.execute(
            f"DELETE FROM {BRANCH_TABLE} WHERE participant = %s AND incarnation = %s AND txid = %s",
            (self.participant_id, _s64(txid.incarnation), _s64(txid.txid)),
        )

    async def branch_marks(self) -> list[tuple[GlobalTxid, str]]:
        """Every branch mark of this participant (transaction, participant
        id), running or not, oldest first."""
        async with self._decisions.lease() as c:
            rows = await self._guard(
                "reading the branch marks",
                _all(
                    c,
                    f"SELECT incarnation, txid FROM {BRANCH_TABLE} WHERE participant = %s ORDER BY marked_ms",
                    (self.participant_id,),
                ),
            )
        return [(GlobalTxid(_u64(i), _u64(t)), self.participant_id) for i, t in rows]

    async def unregistered_branches(self) -> list[tuple[GlobalTxid, str]]:
        """The marked branches whose flow does not run in this process now."""
        return [(t, p) for t, p in await self.branch_marks() if t not in self._branches_running]

    def branch_running(self, txid: GlobalTxid) -> bool:
        return txid in self._branches_running

    async def unmark_branch(self, txid: GlobalTxid) -> None:
        """The branch of ``txid`` is settled with the cluster: its mark goes
        (a mark left behind only makes recovery ask again)."""
        async with self._decisions.lease() as c:
            await self._guard("removing the branch mark", self._unmark_branch_on(c, txid))

    async def finish_branch(self, txid: GlobalTxid, settled: bool) -> None:
        """The branch flow of ``txid`` in this process ended: ``settled``
        when the cluster's answer is known (its mark goes); otherwise the
        mark stays for recovery."""
        self._branches_running.discard(txid)
        if settled:
            await self.unmark_branch(txid)

    # -- the service's own work ----------------------------------------------

    async def write(self, fn: Callable[[PgTx], Awaitable[T]]) -> T:
        """Runs ``fn`` in a transaction of its own (creating the service's
        tables, initial rows), committed durably; with the handler's
        ``lock_timeout``, so a start never waits for rows a prepared
        transaction holds (it fails saying so instead)."""
        async with self._decisions.lease() as c:
            await c.execute("BEGIN")
            try:
                await c.execute(self._limits)
                out = await fn(PgTx(c))
                await c.execute(TRANSACTION_DURABLE)
                await c.execute("COMMIT")
                return out
            except BaseException:
                await _rollback_quietly(c)
                raise

    async def read(self, fn: Callable[[PgTx], Awaitable[T]]) -> T:
        """Runs ``fn`` in a read-only transaction (one snapshot)."""
        async with self._decisions.lease() as c:
            await c.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            try:
                out = await fn(PgTx(c))
                await c.execute("COMMIT")
                return out
            except BaseException:
                await _rollback_quietly(c)
                raise

    def failure(self) -> StoreFailure | None:
        """Always None: a PostgreSQL error fails its message only (the
        server keeps what it acknowledged; nothing here can be left half
        written)."""
        return None

    async def stopped(self) -> StoreFailure:
        """Resolves never while the store is open (see :meth:`failure`); for
        a service written against either store."""
        await self._closed.wait()
        raise StoreUnavailable("the PostgreSQL participant store was closed")

    async def close(self) -> None:
        """Waits for the messages under way, then closes every connection."""
        self._closed.set()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await self._handlers.close()
        await self._decisions.close()


async def _one(c: psycopg.AsyncConnection[Any], q: Any, params: Any = None) -> Any:
    return await (await c.execute(q, params)).fetchone()


async def _all(c: psycopg.AsyncConnection[Any], q: Any, params: Any = None) -> list[Any]:
    return await (await c.execute(q, params)).fetchall()


async def _rollback_quietly(c: psycopg.AsyncConnection[Any]) -> None:
    if c.closed:
        return
    try:
        if c.info.transaction_status != TransactionStatus.IDLE:
            await c.execute("ROLLBACK")
    except Exception:  # noqa: BLE001 - the pool closes a connection left in a transaction
        log.debug("rollback failed; the connection will be closed")


def _connection_lost(e: psycopg.Error) -> bool:
    """The connection failed (or the server is shutting down or starting),
    rather than a statement."""
    st = e.sqlstate
    if st:
        return st.startswith("08") or st in ("57P01", "57P02", "57P03")
    return isinstance(e, (psycopg.OperationalError, psycopg.InterfaceError))


def _pg_error(target: str, what: str, e: psycopg.Error) -> StoreError:
    """A PostgreSQL error as the store's: a lost or refused connection (no
    SQLSTATE, class 08, the server shutting down or starting) is
    UNAVAILABLE (nothing decided; the coordinator retries); any other is
    INTERNAL."""
    text = f"PostgreSQL at {target}, {what}: {e}" + (f" (SQLSTATE {e.sqlstate})" if e.sqlstate else "")
    if _connection_lost(e):
        return StoreUnavailable(text)
    return StoreError(text)


def _describe(conninfo: str) -> str:
    """``host:port/dbname`` of a connection string, for messages."""
    try:
        d = psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.Error:
        return "(unparsable connection string)"
    return f"{d.get('host', 'localhost')}:{d.get('port', 5432)}/{d.get('dbname', d.get('user', ''))}"


def prepared_in_database(conninfo: str) -> list[tuple[str, GlobalTxid, int]]:
    """Every dtx gid prepared in that database, whoever's: (participant,
    transaction, term). For tools and tests (synchronous)."""
    with psycopg.connect(conninfo, autocommit=True) as c:
        rows = c.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
            " AND (starts_with(gid, 'dtx:v1:') OR starts_with(gid, 'dtx:v2:'))"
        ).fetchall()
    out = [p for (g,) in rows if (p := parse_gid(g)) is not None]
    out.sort(key=lambda p: (p[0], p[1]))
    return out


__all__ = [
    "BRANCH_TABLE",
    "COMMITTED",
    "FLOOR_TABLE",
    "LOG_INC_TABLE",
    "LOG_TABLE",
    "MAX_PARTICIPANT_ID_LEN",
    "PgOptions",
    "PgParticipantStore",
    "PgResource",
    "PgTx",
    "RAISED_TABLE",
    "Refuse",
    "check_participant_id",
    "gid_of",
    "gid_prefix",
    "parse_gid",
    "prepared_in_database",
]

