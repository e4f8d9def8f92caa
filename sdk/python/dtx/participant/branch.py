"""Branches that prepare where they run, on the SQLite store
(docs/protocol.md, "Branches"; docs/adr/0046), as the Rust SDK's
``participant_sdk::branch``.

A service called inside a transaction (its txid and incarnation in the
call's metadata, ``x-dtx-txid`` and ``x-dtx-incarnation``) does the work
in its own handler and joins the transaction with its vote in one call:
:func:`join` runs the resource's ``prepare`` on the handler's input,
writes the vote durably (a YES with a mark "not registered yet", in the
same SQLite transaction), registers it with the cluster
(``Coordinator.RegisterBranch``), and returns only then, so the handler
answers its caller after the cluster has the vote. The coordinator sends
such a branch no Prepare; its Commit or Abort arrives at the participant
service as any participant's.

How it ends:

- registered: the branch is a member; its mark goes; the decision comes
  in phase two (or from recovery, as for any in-doubt vote);
- refused (the transaction is PREPARING, decided, forgotten or past its
  deadline, or the branch was fenced out), or certainly never sent: the
  prepared work is rolled back here before :func:`join` raises
  :class:`BranchRolledBack`;
- no definite answer (a timeout, a lost reply, a conflict with an earlier
  registration): the work stays prepared and marked, :func:`join` raises
  :class:`BranchUnknown` (the caller should abort), and the participant's
  recovery (:class:`dtx.participant.server.Recovery`) asks the cluster
  with ``GetBranchDecision``: a member follows the decision; a branch that
  is not one is fenced out and rolls back, also when the transaction
  committed without it.

A NO vote (``Refuse`` in ``prepare``) is recorded aborted here (nothing is
held, no mark) and registered as NO, which aborts the transaction at
once; :func:`join` returns it (``Joined.vote``). READ_ONLY is registered
as READ_ONLY.

The flow runs to its end even when the handler's call is cancelled (its
caller went away): only the answer is lost, never the mark's bookkeeping.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from dtx import metadata as md
from dtx.participant.log import GlobalTxid, LogEntry, Vote
from dtx.participant.store import Answer, ParticipantStore, StoreError, StoreStopped, StoreUnavailable

log = logging.getLogger("dtx.participant.branch")

#: The failpoints of the flow (``DTX_PY_FAILPOINTS=name=action,...``;
#: actions ``stop``: the process stops itself with SIGSTOP, for a test to
#: kill it with SIGKILL; ``exit``: it exits at once without cleanup).
FAILPOINT_PREPARED_BEFORE_REGISTER = "participant_branch_prepared_before_register"
FAILPOINT_REGISTERED_BEFORE_ANSWER = "participant_branch_registered_before_answer"


def failpoint(name: str) -> None:
    """Stops or ends the process when ``DTX_PY_FAILPOINTS`` names ``name``
    (tests of the crash windows; nothing happens otherwise)."""
    spec = os.environ.get("DTX_PY_FAILPOINTS", "")
    if not spec:
        return
    for item in spec.split(","):
        key, _, action = item.partition("=")
        if key.strip() != name:
            continue
        action = action.strip() or "stop"
        log.warning("failpoint %s: %s", name, action)
        if action == "exit":
            os._exit(86)
        if action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)


@dataclass(frozen=True)
class BranchIdentity:
    """Who the branch is: its participant id and where the cluster reaches
    its ``ParticipantService`` for phase two."""

    participant_id: str
    address: str


@dataclass(frozen=True)
class Joined:
    """A branch that joined: its vote is recorded in the transaction."""

    #: YES (work prepared, held until the decision), READ_ONLY (nothing to
    #: do), or NO (the work was refused and rolled back; the transaction aborts).
    vote: Vote
    #: The reason of a NO.
    reason: str
    #: The term of the leader that recorded the registration.
    term: int
    #: True when the registration was found recorded already (a retry).
    existing: bool = False


class BranchError(Exception):
    """Why a branch did not join. :attr:`code` is what a handler answers
    its caller (the table of docs/writing-a-service.md)."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class NoTransaction(BranchError):
    """The call carried no txid (or no incarnation): nothing was done."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, key: str) -> None:
        super().__init__(
            f"the call carries no {key}: a branch runs only inside a transaction "
            "(attach x-dtx-txid and x-dtx-incarnation, dtx.metadata.attach_txid)"
        )
        self.key = key


class BranchRolledBack(BranchError):
    """The cluster refused the registration, or certainly never recorded
    it: the prepared work was rolled back here. The caller's transaction
    cannot commit this work."""

    code = grpc.StatusCode.ABORTED

    def __init__(self, txid: GlobalTxid, why: str) -> None:
        super().__init__(f"transaction {txid}: the branch did not join and its work was rolled back: {why}")
        self.txid = txid
        self.why = why


class BranchUnknown(BranchError):
    """No definite answer from the cluster: the work stays prepared and
    marked, and recovery settles it. Answer the caller with an error; it
    should abort. Never a failure of the transaction by itself."""

    code = grpc.StatusCode.UNKNOWN

    def __init__(self, txid: GlobalTxid, why: str) -> None:
        super().__init__(
            f"transaction {txid}: whether the branch's registration was recorded is not known ({why}); "
            "its prepared work is left to recovery"
        )
        self.txid = txid
        self.why = why


class AlreadyPrepared(BranchError):
    """The transaction already has a record here (a repeated call, or the
    same participant enlisted by its client as well): nothing done."""

    code = grpc.StatusCode.ALREADY_EXISTS

    def __init__(self, txid: GlobalTxid, entry: LogEntry) -> None:
        super().__init__(
            f"transaction {txid} already has a record here ({entry.state.name}); a branch prepares once per transaction"
        )
        self.txid = txid
        self.entry = entry


class BranchStoreError(BranchError):
    """The participant's store failed (UNAVAILABLE when it cannot answer
    now, INTERNAL otherwise); what it says is in the cause."""

    def __init__(self, e: StoreError) -> None:
        super().__init__(str(e))
        self.code = (
            grpc.StatusCode.UNAVAILABLE
            if isinstance(e, (StoreUnavailable, StoreStopped))
            else grpc.StatusCode.INTERNAL
        )


def transaction_of(context: Any) -> GlobalTxid:
    """The transaction the handler serving ``context`` runs in (a
    ``grpc.aio.ServicerContext``, or metadata pairs): its txid and
    incarnation. Raises :class:`NoTransaction` without either."""
    metadata = context.invocation_metadata() if hasattr(context, "invocation_metadata") else context
    txid = md.txid_of(metadata)
    if txid is None:
        raise NoTransaction(md.TXID_METADATA_KEY)
    incarnation = md.incarnation_of(metadata)
    if incarnation is None:
        raise NoTransaction(md.INCARNATION_METADATA_KEY)
    return GlobalTxid(incarnation, txid)


def certainly_out(e: Exception) -> bool:
    """True when the registration's error says it is not recorded and can
    never be: a refusal that freezes the branch out (too-late, fenced), a
    txid never begun, a request refused before anything ran, or one that
    reached no node. A conflict with an earlier registration of this
    participant, an UNKNOWN outcome or an internal error are not."""
    from dtx import client as c

    if isinstance(e, c.FailedPrecondition):
        kind = e.branch_refusal
        return kind is None or kind in (md.BranchRefusalKind.TOO_LATE, md.BranchRefusalKind.FENCED)
    return isinstance(
        e,
        (
            c.NotFound,
            c.InvalidArgument,
            c.PermissionDenied,
            c.Unauthenticated,
            c.Unimplemented,
            c.NotApplied,
            c.Unavailable,
        ),
    )


async def join(
    store: ParticipantStore,
    client: Any,
    who: BranchIdentity,
    txid: GlobalTxid,
    payload: bytes,
) -> Joined:
    """Runs the branch of ``txid`` on ``store``: the resource prepares
    ``payload`` (the handler's input), the vote is written durably, then
    registered with the cluster through ``client`` (a
    :class:`dtx.client.Client`), and returned once the cluster has it. See
    the module's documentation for each way it ends. Shielded from the
    handler's cancellation."""
    return await asyncio.shield(_join(store, client, who, txid, payload))


async def _join(
    store: ParticipantStore, client: Any, who: BranchIdentity, txid: GlobalTxid, payload: bytes
) -> Joined:
    try:
        prepared = await store.prepare_branch(txid, who.participant_id, payload)
    except StoreError as e:
        raise BranchStoreError(e) from e
    if isinstance(prepared, LogEntry):
        raise AlreadyPrepared(txid, prepared)
    answer: Answer = prepared
    if answer.vote is None:
        raise BranchStoreError(StoreError("a branch's prepare answered with an ack"))
    vote = answer.vote
    return await register_vote(
        store, client, who, txid, vote, answer.reason if vote is Vote.NO else "", held=vote is Vote.YES
    )


class BranchStore(Protocol):
    """What :func:`register_vote` needs of a participant's store: the
    SQLite :class:`ParticipantStore` and the PostgreSQL
    :class:`dtx.participant.postgres.PgParticipantStore` provide it."""

    async def recover(self, txid: GlobalTxid, commit: bool) -> Answer | None: ...

    async def finish_branch(self, txid: GlobalTxid, settled: bool) -> None: ...


async def register_vote(
    store: BranchStore,
    client: Any,
    who: BranchIdentity,
    txid: GlobalTxid,
    vote: Vote,
    reason: str,
    held: bool,
) -> Joined:
    """The second half of a branch's flow, shared by the SQLite and the
    PostgreSQL branches: the vote is durable here already (``held``: a YES
    prepared and marked, ``txid`` in the store's running set); registers it
    (``RegisterBranch``) and ends as the module's documentation says: a
    definite refusal rolls the prepared work back here
    (``store.recover(txid, False)``) before :class:`BranchRolledBack`; no
    definite answer keeps work and mark for recovery
    (:class:`BranchUnknown`); either way ``store.finish_branch`` ends the
    flow of a held branch (the mark goes when the answer is known). The
    failpoints of the crash windows are here."""
    from dtx.client import BranchVote, DtxError

    settled = registered = False
    try:
        if held:
            failpoint(FAILPOINT_PREPARED_BEFORE_REGISTER)
        try:
            r = await client.register_branch(
                txid.txid,
                who.participant_id,
                who.address,
                BranchVote(int(vote)),
                reason if vote is Vote.NO else "",
                txid.incarnation,
            )
        except DtxError as e:
            kind = getattr(e, "branch_refusal", None)
            what = f"refused ({kind.value})" if kind is not None else type(e).__name__
            if not certainly_out(e):
                raise BranchUnknown(txid, f"{what}: {e}") from e
            if held:
                try:
                    await store.recover(txid, False)
                except StoreError as se:
                    # Not rolled back: the mark stays; recovery asks, and
                    # the cluster answers ABORT (not a member).
                    raise BranchUnknown(txid, f"{e}; then the local rollback failed: {se}") from se
            settled = True
            raise BranchRolledBack(txid, f"{what}: {e}") from e
        settled = registered = True
        if held:
            log.info("branch %s of %s registered (term %d)", who.participant_id, txid, r.term)
        return Joined(vote, reason if vote is Vote.NO else "", r.term, r.existing)
    finally:
        if held:
            try:
                await store.finish_branch(txid, settled)
            except StoreError as e:
                # A mark left behind only makes recovery ask again.
                log.warning("branch %s: the mark could not be removed: %s", txid, e)
            if registered:
                failpoint(FAILPOINT_REGISTERED_BEFORE_ANSWER)


__all__ = [
    "AlreadyPrepared",
    "BranchError",
    "BranchIdentity",
    "BranchRolledBack",
    "BranchStore",
    "BranchStoreError",
    "BranchUnknown",
    "Joined",
    "NoTransaction",
    "certainly_out",
    "failpoint",
    "join",
    "register_vote",
    "transaction_of",
]
