"""gRPC metadata keys of the wire contract (``proto/src/metadata.rs``) and
the txid propagation helpers.

A transaction id travels between services in ``x-dtx-txid``, and beside it
the cluster incarnation that handed it out in ``x-dtx-incarnation``
(docs/protocol.md, "Txid propagation and self-enlistment"). The calling
side attaches them (:func:`attach_txid`, or :class:`TxidClientInterceptor`
inside :func:`txid_scope`); the serving side reads them (:func:`txid_of`,
:func:`incarnation_of`, or :func:`txid_from_context` in a handler).
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

TXID_METADATA_KEY = "x-dtx-txid"
INCARNATION_METADATA_KEY = "x-dtx-incarnation"
#: On a refusal by a follower: the id of the leader it knows.
LEADER_ID_HEADER = "x-dtx-leader-id"
#: On a refusal by a follower, and on an answer a follower forwarded: the
#: leader's API address.
LEADER_ADDR_HEADER = "x-dtx-leader-addr"
#: Set by a node on a call it forwards to the leader.
FORWARDED_HEADER = "x-dtx-forwarded"
#: On a refusal that happened before anything was proposed: the call
#: certainly had no effect.
NOT_APPLIED_HEADER = "x-dtx-not-applied"
#: On a participant's refusal (FAILED_PRECONDITION): its kind.
REFUSAL_HEADER = "x-dtx-refusal"
#: On a refusal of RegisterBranch: its kind.
BRANCH_REFUSAL_HEADER = "x-dtx-branch-refusal"


class RefusalKind(enum.StrEnum):
    """Why a participant refused a message (the value under ``x-dtx-refusal``)."""

    #: The message's term is older than one already seen (fencing).
    STALE_TERM = "stale-term"
    #: Commit for a transaction never prepared here.
    COMMIT_WITHOUT_PREPARE = "commit-without-prepare"
    #: Commit after a NO vote, an Abort or a tombstone.
    COMMIT_AFTER_ABORT = "commit-after-abort"
    #: Abort after the Commit was applied.
    ABORT_AFTER_COMMIT = "abort-after-commit"

    @classmethod
    def parse(cls, value: str | None) -> RefusalKind | None:
        """The kind ``value`` names exactly, None for anything else."""
        for k in cls:
            if k.value == value:
                return k
        return None


class BranchRefusalKind(enum.StrEnum):
    """Why the cluster refused a branch's registration."""

    TOO_LATE = "too-late"
    FENCED = "fenced"
    CONFLICT = "conflict"

    @classmethod
    def parse(cls, value: str | None) -> BranchRefusalKind | None:
        for k in cls:
            if k.value == value:
                return k
        return None


#: Metadata as grpc gives it or takes it: pairs, ``grpc.aio.Metadata``, or
#: the ``_Metadatum`` objects of ``context.invocation_metadata()``.
MetadataLike = Iterable[Any] | None


def _pairs(md: MetadataLike) -> Iterator[tuple[str, str | bytes]]:
    if md is None:
        return
    for item in md:
        if isinstance(item, tuple):
            yield item[0], item[1]
        else:
            yield item.key, item.value


def get(md: MetadataLike, key: str) -> str | None:
    """The first value of ``key`` in ``md`` (as text), or None."""
    for k, v in _pairs(md):
        if k.lower() == key:
            return v.decode("utf-8", "replace") if isinstance(v, bytes) else v
    return None


def _u64(value: str | None) -> int | None:
    if value is None:
        return None
    v = value.strip()
    if not v.isdigit():
        return None
    n = int(v)
    return n if n < (1 << 64) else None


def txid_of(md: MetadataLike) -> int | None:
    """The txid ``md`` carries (``x-dtx-txid``), if any and well-formed."""
    return _u64(get(md, TXID_METADATA_KEY))


def incarnation_of(md: MetadataLike) -> int | None:
    """The incarnation ``md`` carries (``x-dtx-incarnation``), if any."""
    return _u64(get(md, INCARNATION_METADATA_KEY))


def attach_txid(md: MetadataLike, txid: int, incarnation: int | None = None) -> list[tuple[str, str]]:
    """``md`` (any form) as a list of pairs with ``x-dtx-txid`` (and
    ``x-dtx-incarnation`` when given) set, replacing earlier values."""
    drop = {TXID_METADATA_KEY} | ({INCARNATION_METADATA_KEY} if incarnation is not None else set())
    out: list[tuple[str, str]] = [
        (k, v if isinstance(v, str) else v.decode("utf-8", "replace"))
        for k, v in _pairs(md)
        if k.lower() not in drop
    ]
    out.append((TXID_METADATA_KEY, str(txid)))
    if incarnation is not None:
        out.append((INCARNATION_METADATA_KEY, str(incarnation)))
    return out


def leader_addr(md: MetadataLike) -> str | None:
    """The leader's API address ``md`` names (a refusal's or a forwarded
    answer's), if any."""
    return get(md, LEADER_ADDR_HEADER)


def not_applied(md: MetadataLike) -> bool:
    """True when a refusal's metadata says it certainly had no effect."""
    return get(md, NOT_APPLIED_HEADER) is not None


@dataclass(frozen=True)
class TxidContext:
    """A transaction as it travels: its txid and the incarnation that
    handed it out (0: unknown or before incarnations)."""

    txid: int
    incarnation: int = 0


_CURRENT: contextvars.ContextVar[TxidContext | None] = contextvars.ContextVar("dtx_current_txid", default=None)


def current() -> TxidContext | None:
    """The transaction of the current task (:func:`txid_scope`), if any."""
    return _CURRENT.get()


@contextlib.contextmanager
def txid_scope(txid: int, incarnation: int = 0) -> Iterator[TxidContext]:
    """Inside the block, calls through a channel with
    :class:`TxidClientInterceptor` carry this transaction."""
    ctx = TxidContext(txid, incarnation)
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def txid_from_context(context: grpc.aio.ServicerContext[Any, Any] | grpc.ServicerContext) -> TxidContext | None:
    """In a handler: the transaction the call carries, if any."""
    md = context.invocation_metadata()
    txid = txid_of(md)
    if txid is None:
        return None
    return TxidContext(txid, incarnation_of(md) or 0)


class TxidClientInterceptor(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Adds the current transaction (:func:`txid_scope`) to every unary
    call; a txid the call already carries is kept. Use it with
    ``grpc.aio.insecure_channel(addr, interceptors=[TxidClientInterceptor()])``."""

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        cur = current()
        if cur is not None and txid_of(client_call_details.metadata) is None:
            pairs = attach_txid(
                client_call_details.metadata,
                cur.txid,
                cur.incarnation if cur.incarnation else None,
            )
            client_call_details = client_call_details._replace(metadata=grpc.aio.Metadata(*pairs))
        return await continuation(client_call_details, request)
