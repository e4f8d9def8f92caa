"""Branches that prepare where they run, on the PostgreSQL participant
(docs/protocol.md, "Branches"; docs/adr/0046), as the Rust SDK's
``PgParticipant::begin_branch`` / ``PgBranch::join``
(``participant-sdk/src/postgres/branch.rs``), with the same tables and gids.

The service's request handler does its SQL in a PostgreSQL transaction
bound to the txid it was called with (a connection of the handlers' pool,
with the handlers' ``lock_timeout`` and ``statement_timeout``); at its end
:meth:`PgBranch.join` prepares it (``PREPARE TRANSACTION``) and registers
the branch with its vote (``RegisterBranch``) before the handler answers
its caller::

    txid = transaction_of(context)
    async with begin_branch(store, txid) as branch:
        row = await branch.tx.one("SELECT qty FROM stock WHERE sku = %s FOR UPDATE NOWAIT", (sku,))
        await branch.tx.execute("UPDATE stock SET qty = qty - %s WHERE sku = %s", (n, sku))
        joined = await branch.join(client, who)          # or join(client, who, Vote.NO, reason)

or, with the work as a function voting as :meth:`PgResource.prepare` does
(``raise Refuse(reason)`` for a NO)::

    joined = await run_branch(store, client, who, txid, lambda tx: work(tx))

What :meth:`PgBranch.join` keeps:

- a YES writes the ``committed`` marker inside the transaction (as a
  Prepare does), then a **mark** row in ``dtx_participant_branch``
  committed on another connection *before* ``PREPARE TRANSACTION``, so no
  prepared branch is ever without its mark (a mark whose transaction never
  prepared holds nothing: recovery drops it); the gid is the participant's
  (``dtx:v1:..`` / ``dtx:v2:..``) at the incarnation's term floor;
- what PostgreSQL cannot prepare is refused early and becomes a NO naming
  the restriction, registered before anything is marked or held: the
  guarded :attr:`PgBranch.tx` refuses NOTIFY, LISTEN, UNLISTEN,
  ``pg_notify``, ``pg_export_snapshot``, temporary tables and cursors WITH
  HOLD before sending them (:func:`refuse_unpreparable`, a lexical check
  that skips literals, quoted identifiers and comments) with
  :class:`Unpreparable`; a YES first looks inside the transaction for
  temporary relations it created or changed and cursors WITH HOLD it
  declared; what neither sees is refused by ``PREPARE TRANSACTION`` itself
  (SQLSTATE 0A000), as is a server without a free slot (53200): a NO too;
- the registration and its outcomes are :func:`dtx.participant.branch.register_vote`'s,
  shared with the SQLite branches (registered: the mark goes; refused
  or certainly not sent: ``ROLLBACK PREPARED`` here before
  :class:`BranchRolledBack`; no definite answer: work and mark left for
  recovery, :class:`BranchUnknown`);
- while the flow runs, the txid is in the store's running set (from
  :func:`begin_branch` on), so the participant's recovery neither asks about
  it by branch nor in its in-doubt pass; once it ends, recovery settles a
  mark left behind with ``GetBranchDecision``.

A branch left without :meth:`PgBranch.join` (the handler raised, or was
cancelled) is rolled back and records nothing. :meth:`PgBranch.join` itself
is shielded from the handler's cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus

from dtx.participant.branch import (
    AlreadyPrepared,
    BranchError,
    BranchIdentity,
    BranchStoreError,
    Joined,
    register_vote,
)
from dtx.participant.log import GlobalTxid, LogEntry, State, Vote
from dtx.participant.postgres import (
    _LOCK_NOT_AVAILABLE,
    _UNIQUE_VIOLATION,
    ABORTED,
    COMMITTED,
    READ_ONLY,
    PgParticipantStore,
    PgTx,
    _connection_lost,
    _pg_error,
    _rollback_quietly,
)
from dtx.participant.store import Refuse, StoreError

log = logging.getLogger("dtx.participant.pg_branch")

# -- what PREPARE TRANSACTION cannot carry ------------------------------------

_WHAT = {
    "notify": "NOTIFY (or pg_notify)",
    "listen": "LISTEN",
    "unlisten": "UNLISTEN",
    "temp": "a temporary table",
    "hold": "a cursor WITH HOLD",
    "snapshot": "an exported snapshot (pg_export_snapshot)",
}
_WHY = {
    "notify": "PREPARE TRANSACTION refuses a transaction that executed NOTIFY (SQLSTATE 0A000), so the branch could "
    "never vote YES. Write the message to an outbox table in the branch's transaction instead: published once the "
    "transaction commits, never if it aborts",
    "listen": "PREPARE TRANSACTION refuses a transaction that executed LISTEN or UNLISTEN (SQLSTATE 0A000), so the "
    "branch could never vote YES. Listen on a connection of its own, outside any branch",
    "temp": "PREPARE TRANSACTION refuses a transaction that operated on temporary objects (SQLSTATE 0A000): they "
    "belong to the session, which a prepared transaction outlives. Use a common table expression, a regular table "
    "keyed by the txid (emptied after the decision), or keep the rows in the handler",
    "hold": "PREPARE TRANSACTION refuses a transaction that created a cursor WITH HOLD (SQLSTATE 0A000): it would "
    "outlive the transaction in the session. Use a cursor without HOLD and close it before join, or read the rows "
    "with a query",
    "snapshot": "PREPARE TRANSACTION refuses a transaction that exported a snapshot (SQLSTATE 0A000). Export "
    "snapshots from a transaction of their own, outside any branch",
}
_WHY["unlisten"] = _WHY["listen"]


class Unpreparable(BranchError):
    """The branch's SQL does what ``PREPARE TRANSACTION`` cannot carry: the
    statement was not sent, and the branch votes NO at :meth:`PgBranch.join`
    whatever the handler says."""

    code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what} cannot be part of a branch: {why}")
        self.what = what
        self.why = why


def _ident_start(ch: str) -> bool:
    return ch.isascii() and (ch.isalpha() or ch == "_") or not ch.isascii()


def _ident_char(ch: str) -> bool:
    return ch.isascii() and (ch.isalnum() or ch in "_$") or not ch.isascii()


# Tokens: ("w", word lowercased), ("q", quoted identifier), ("p", punct), ("o", "").
def _tokens(text: str) -> list[tuple[str, str]]:
    c, n, i = text, len(text), 0
    out: list[tuple[str, str]] = []

    def quoted_end(i: int, escapes: bool) -> int:
        i += 1
        while i < n:
            if escapes and c[i] == "\\":
                i += 2
            elif c[i] == "'":
                if i + 1 < n and c[i + 1] == "'":
                    i += 2
                else:
                    return i + 1
            else:
                i += 1
        return n

    while i < n:
        ch = c[i]
        if ch.isspace():
            i += 1
        elif c.startswith("--", i):
            j = c.find("\n", i)
            i = n if j < 0 else j
        elif c.startswith("/*", i):
            depth = 0
            while i < n:
                if c.startswith("/*", i):
                    depth += 1
                    i += 2
                elif c.startswith("*/", i):
                    depth -= 1
                    i += 2
                    if depth == 0:
                        break
                else:
                    i += 1
        elif ch == "'":
            i = quoted_end(i, False)
            out.append(("o", ""))
        elif ch == '"':
            name = []
            i += 1
            while i < n:
                if c[i] == '"':
                    if c.startswith('""', i):
                        name.append('"')
                        i += 2
                        continue
                    i += 1
                    break
                name.append(c[i])
                i += 1
            out.append(("q", "".join(name)))
        elif ch == "$":
            j = i + 1
            if j < n and _ident_start(c[j]):
                while j < n and _ident_char(c[j]) and c[j] != "$":
                    j += 1
            if j < n and c[j] == "$":
                tag = c[i : j + 1]
                k = c.find(tag, j + 1)
                i = n if k < 0 else k + len(tag)
            else:
                i += 1
                while i < n and c[i].isdigit():
                    i += 1
            out.append(("o", ""))
        elif _ident_start(ch):
            start = i
            while i < n and _ident_char(c[i]):
                i += 1
            word = c[start:i].lower()
            if i < n and c[i] == "'" and word in ("e", "b", "x", "n"):
                i = quoted_end(i, word == "e")
                out.append(("o", ""))
            elif word == "u" and c.startswith("&", i) and i + 1 < n and c[i + 1] in "'\"":
                i += 1
            else:
                out.append(("w", word))
        elif ch.isdigit():
            while i < n and (_ident_char(c[i]) or c[i] == "."):
                i += 1
            out.append(("o", ""))
        elif ch in ";(),.":
            out.append(("p", ch))
            i += 1
        else:
            out.append(("o", ""))
            i += 1
    return out


_NOT_A_NAME = {
    "from", "where", "group", "having", "window", "order", "limit", "offset", "fetch", "for",
    "union", "intersect", "except", "as", "options",
}  # fmt: skip


def _restriction_of_statement(st: list[tuple[str, str]]) -> str | None:
    def word(i: int) -> str | None:
        return st[i][1] if 0 <= i < len(st) and st[i][0] == "w" else None

    def named(i: int, name: str) -> bool:
        return 0 <= i < len(st) and st[i][0] in ("w", "q") and st[i][1] == name

    first = word(0)
    if first in ("notify", "listen", "unlisten"):
        return first
    if first == "create":
        i = 1
        while word(i) in ("or", "replace", "global", "local"):
            i += 1
        if word(i) in ("temp", "temporary"):
            return "temp"
    if first == "declare":
        end = next((i for i in range(1, len(st)) if word(i) == "for"), len(st))
        if any(word(i) == "with" and word(i + 1) == "hold" for i in range(1, end)):
            return "hold"
    for i in range(len(st)):
        call = i + 1 < len(st) and st[i + 1] == ("p", "(")
        if call and named(i, "pg_notify"):
            return "notify"
        if call and named(i, "pg_export_snapshot"):
            return "snapshot"
        if named(i, "pg_temp") and i + 1 < len(st) and st[i + 1] == ("p", "."):
            return "temp"
        # SELECT .. INTO [GLOBAL | LOCAL] {TEMP | TEMPORARY} [TABLE] name
        # (not INSERT INTO or MERGE INTO, where `temp` can be a table).
        if word(i) == "into" and word(i - 1) not in ("insert", "merge"):
            j = i + 1
            if word(j) in ("global", "local"):
                j += 1
            if word(j) in ("temp", "temporary") and j + 1 < len(st):
                kind, w = st[j + 1]
                if kind == "q" or (kind == "w" and w not in _NOT_A_NAME):
                    return "temp"
    return None


def _restriction_in(text: str) -> str | None:
    st: list[tuple[str, str]] = []
    for t in [*_tokens(text), ("p", ";")]:
        if t == ("p", ";"):
            r = _restriction_of_statement(st)
            if r is not None:
                return r
            st = []
        else:
            st.append(t)
    return None


def _error(r: str) -> Unpreparable:
    return Unpreparable(_WHAT[r], _WHY[r])


def refuse_unpreparable(text: str) -> None:
    """Raises :class:`Unpreparable` when ``text`` does what ``PREPARE
    TRANSACTION`` refuses: NOTIFY, LISTEN, UNLISTEN, ``pg_notify(..)``,
    ``pg_export_snapshot()``, creating a temporary table (``CREATE TEMP``,
    ``SELECT .. INTO TEMP``), naming ``pg_temp``, ``DECLARE .. WITH HOLD``.
    A lexical check of each ``;``-separated statement that skips literals,
    quoted identifiers and comments (the Rust SDK's)."""
    r = _restriction_in(text)
    if r is not None:
        raise _error(r)


_UNPREPARABLE_STATE = """SELECT
   (SELECT pg_catalog.string_agg(pg_catalog.quote_ident(n), ', ') FROM (
      SELECT c.relname::text AS n FROM pg_catalog.pg_class c
      WHERE pg_catalog.pg_my_temp_schema() <> 0
        AND c.relnamespace = pg_catalog.pg_my_temp_schema()
        AND pg_catalog.age(c.xmin) <= 0
      ORDER BY 1 LIMIT 5) t),
   (SELECT pg_catalog.string_agg(pg_catalog.quote_ident(n), ', ') FROM (
      SELECT k.name AS n FROM pg_catalog.pg_cursors k
      WHERE k.is_holdable AND k.creation_time >= pg_catalog.transaction_timestamp()
      ORDER BY 1 LIMIT 5) t)"""


async def _unpreparable_state(c: psycopg.AsyncConnection[Any]) -> Unpreparable | None:
    """Temporary relations this transaction created or changed, and cursors
    WITH HOLD it declared (what earlier transactions of the pooled session
    left does not stop PREPARE and is not counted)."""
    row = await (await c.execute(_UNPREPARABLE_STATE)).fetchone()
    temp, hold = (row or (None, None))[:2]
    if temp:
        return Unpreparable(f"{_WHAT['temp']} ({temp})", _WHY["temp"])
    if hold:
        return Unpreparable(f"{_WHAT['hold']} ({hold})", _WHY["hold"])
    return None


# -- the branch ----------------------------------------------------------------


class BranchTx(PgTx):
    """The branch's open transaction, guarded: statements PREPARE
    TRANSACTION cannot carry are refused before they are sent
    (:class:`Unpreparable`) and remembered, so the branch votes NO."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], branch: PgBranch) -> None:
        super().__init__(conn)
        self._branch = branch

    def _check(self, query: Any) -> None:
        super()._check(query)
        if isinstance(query, str):
            text = query
        elif hasattr(query, "as_string"):
            text = query.as_string(self._conn)
        else:
            text = query.decode("utf-8", "replace") if isinstance(query, bytes) else ""
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        r = _restriction_in(text)
        if r is not None:
            if self._branch.refused is None:
                self._branch.refused = _error(r)
            raise _error(r)


class PgBranch:
    """An open branch of :attr:`txid`: run its SQL through :attr:`tx`, then
    :meth:`join`. Opened by :func:`begin_branch`."""

    def __init__(self, store: PgParticipantStore, txid: GlobalTxid, conn: psycopg.AsyncConnection[Any]) -> None:
        self.store = store
        self.txid = txid
        self._conn = conn
        self.tx = BranchTx(conn, self)
        #: The first statement the guarded transaction refused.
        self.refused: Unpreparable | None = None
        self._joining = False

    async def join(self, client: Any, who: BranchIdentity, vote: Vote = Vote.YES, reason: str = "") -> Joined:
        """Ends the handler's work with its vote: YES prepares it (the marker
        inside, the mark committed first, ``PREPARE TRANSACTION``) and
        registers it; NO and READ_ONLY roll it back, are recorded as a
        Prepare's would be, and are registered. Work PostgreSQL cannot
        prepare is a NO naming the restriction (returned like the handler's
        own NO). Returns once the cluster has the vote; each other way it
        ends is a :class:`BranchError` (the table of docs/python-sdk.md).
        Shielded from the caller's cancellation."""
        if self._joining:
            raise BranchError(f"the branch of {self.txid} was joined already")
        self._joining = True
        return await asyncio.shield(self.store._spawn(self._join(client, who, Vote(vote), reason)))

    async def _join(self, client: Any, who: BranchIdentity, vote: Vote, reason: str) -> Joined:
        store, txid, c = self.store, self.txid, self._conn
        held = False
        try:
            try:
                vote, reason, held = await self._prepare(vote, reason)
            finally:
                # The session's transaction is over (prepared, rolled back,
                # or the connection is lost): back to the pool.
                await _rollback_quietly(c)
                store._handlers._release(c)
            return await register_vote(store, client, who, txid, vote, reason, held)
        finally:
            if not held:
                store._branches_running.discard(txid)

    async def _prepare(self, vote: Vote, reason: str) -> tuple[Vote, str, bool]:
        """The local half: (the vote, its reason, whether a YES is held)."""
        store, txid, c = self.store, self.txid, self._conn
        async with store._locks.hold(txid), store._decisions.lease() as side:
            try:
                term = await store._floor(side, txid.incarnation)
                early: BranchError | None = self.refused
                if vote is Vote.YES and early is None and c.info.transaction_status == TransactionStatus.INTRANS:
                    early = await _unpreparable_state(c)
                if early is not None and vote is not Vote.NO:
                    vote, reason = Vote.NO, f"transaction {txid} not prepared here: {early}"
                    log.warning("%s", reason)
                if vote is Vote.YES and c.info.transaction_status != TransactionStatus.INTRANS:
                    vote, reason = Vote.NO, f"a statement of the branch's work for {txid} failed"
                if vote is Vote.NO and not reason:
                    reason = "the branch refused"
                if vote is Vote.YES:
                    await c.execute(store._marker_limits)
                    q, params = store._insert(txid, COMMITTED, term)
                    try:
                        await c.execute(q, params)
                    except psycopg.Error as e:
                        if e.sqlstate not in (_UNIQUE_VIOLATION, _LOCK_NOT_AVAILABLE):
                            raise
                        await c.execute("ROLLBACK")
                        raise AlreadyPrepared(txid, LogEntry(State.ABORTED, term)) from None
                    # The mark before the prepared transaction: never one without it.
                    await store._mark_branch(side, txid)
                    try:
                        await c.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(store.gid(txid, term))))
                        return vote, "", True
                    except psycopg.Error as e:
                        if _connection_lost(e):
                            # Prepared or not, nobody can say: the mark stays
                            # (recovery drops it if nothing was prepared).
                            raise
                        await _rollback_quietly(c)
                        why = store._no_slot(txid, e) or store._not_preparable(txid, e)
                        await store._unmark_branch_on(side, txid)
                        if why is None:
                            raise
                        vote, reason = Vote.NO, why
                else:
                    await _rollback_quietly(c)
                # Recorded like a Prepare's NO or READ_ONLY, so a repeat (or
                # a Prepare sent after all) answers the same.
                await store._record(side, txid, READ_ONLY if vote is Vote.READ_ONLY else ABORTED, term)
                return vote, reason, False
            except psycopg.Error as e:
                raise BranchStoreError(_pg_error(store.target, f"the branch of {txid}", e)) from e
            except StoreError as e:
                raise BranchStoreError(e) from e


@contextlib.asynccontextmanager
async def begin_branch(store: PgParticipantStore, txid: GlobalTxid) -> AsyncIterator[PgBranch]:
    """Opens the branch of ``txid`` on a connection of the handlers' pool:
    a PostgreSQL transaction with the handlers' lock and statement
    timeouts. Refused with :class:`AlreadyPrepared` when this participant
    already has work for ``txid`` (prepared, recorded, or a branch of it
    running here). Left without :meth:`PgBranch.join`, the transaction is
    rolled back and nothing is recorded."""
    if store._closed.is_set():
        raise BranchStoreError(StoreError("the PostgreSQL participant store is closed"))
    if txid in store._branches_running:
        raise AlreadyPrepared(txid, LogEntry(State.PREPARED_YES, 0))
    store._branches_running.add(txid)
    branch: PgBranch | None = None
    c: psycopg.AsyncConnection[Any] | None = None
    try:
        try:
            c = await store._handlers._acquire()
            found = await store._entry(c, txid)
            if found is not None:
                raise AlreadyPrepared(txid, found)
            await c.execute("BEGIN")
            await c.execute(store._limits)
        except psycopg.Error as e:
            raise BranchStoreError(_pg_error(store.target, f"opening the branch of {txid}", e)) from e
        except StoreError as e:
            raise BranchStoreError(e) from e
        branch = PgBranch(store, txid, c)
        yield branch
    finally:
        if branch is None or not branch._joining:
            store._branches_running.discard(txid)
            if c is not None:
                await _rollback_quietly(c)
                store._handlers._release(c)


async def run_branch(
    store: PgParticipantStore,
    client: Any,
    who: BranchIdentity,
    txid: GlobalTxid,
    work: Callable[[PgTx], Awaitable[Vote]],
) -> Joined:
    """:func:`begin_branch`, ``work(tx)`` (voting as
    :meth:`PgResource.prepare` does: ``raise Refuse(reason)`` for a NO; any
    other exception, PostgreSQL giving up a wait included, is a NO saying
    why), then :meth:`PgBranch.join` with its vote."""
    async with begin_branch(store, txid) as branch:
        reason = ""
        try:
            vote = Vote(await work(branch.tx))
        except Refuse as r:
            vote, reason = Vote.NO, r.reason or "the branch refused"
        except Unpreparable as e:
            vote, reason = Vote.NO, f"transaction {txid} not prepared here: {e}"
        except psycopg.Error as e:
            if branch._conn.closed or branch._conn.broken or _connection_lost(e):
                raise BranchStoreError(_pg_error(store.target, f"the branch of {txid}", e)) from e
            vote, reason = Vote.NO, store._gave_up(txid, e) or ""
            if not reason:
                log.exception("the branch's work for %s failed; voting NO", txid)
                reason = f"the branch's work failed: {e!r}"
        except Exception as e:  # noqa: BLE001 - work that fails votes NO, safely
            log.exception("the branch's work for %s raised; voting NO", txid)
            vote, reason = Vote.NO, f"the branch's work failed: {e!r}"
        return await branch.join(client, who, vote, reason)


__all__ = [
    "BranchTx",
    "PgBranch",
    "Unpreparable",
    "begin_branch",
    "refuse_unpreparable",
    "run_branch",
]
