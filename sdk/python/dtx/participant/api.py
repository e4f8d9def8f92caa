"""What the participant server (:mod:`dtx.participant.server`) needs of a
participant's durable store: the SQLite store
(:class:`dtx.participant.store.ParticipantStore`) and the PostgreSQL one
(:class:`dtx.participant.postgres.PgParticipantStore`) both provide it.

Every method answers only what is durable: a vote or an ack is returned
after the write that holds it is committed. Errors are
:class:`~dtx.participant.store.StoreError` subclasses, which the server
maps to gRPC codes: :class:`~dtx.participant.store.Refused`
(FAILED_PRECONDITION with the refusal's kind),
:class:`~dtx.participant.store.StoreUnavailable` (UNAVAILABLE, nothing
changed), :class:`~dtx.participant.store.StoreStopped` (RESOURCE_EXHAUSTED
or UNAVAILABLE), anything else INTERNAL.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from dtx.participant.log import GlobalTxid, Kind, LogEntry, Message
from dtx.participant.store import Answer, Inspection, Record, StoreError, StoreFailure


class Store(Protocol):
    """A participant's durable log and resource, as the server drives it."""

    participant_id: str

    async def handle(self, txid: GlobalTxid, msg: Message, payload: bytes = b"") -> Answer:
        """One coordinator message (Prepare, Commit, Abort, CommitOnePhase)."""
        ...

    async def apply_then_prepare(
        self,
        decisions: Sequence[tuple[GlobalTxid, Kind, int]],
        prepares: Sequence[tuple[GlobalTxid, int, bytes]],
    ) -> tuple[list[Answer | StoreError], list[Answer | StoreError]]:
        """ApplyDecisions and PrepareMany: the decisions first, then the
        prepares; one result per item (its answer, or the error its own
        call would have failed with)."""
        ...

    async def recover(self, txid: GlobalTxid, commit: bool) -> Answer | None:
        """A decision learned from the cluster, applied to an in-doubt
        record at its own term; None when it is not in doubt now."""
        ...

    async def entry(self, txid: GlobalTxid) -> LogEntry | None:
        """The durable record (Inquire)."""
        ...

    async def in_doubt(self, voted_before_ms: int | None = None) -> list[Record]:
        """YES votes without a decision, oldest first (only those voted at
        or before ``voted_before_ms``, ms since the Unix epoch, when given;
        votes from before the store opened always count)."""
        ...

    async def inspect(
        self, incarnation: int, txids: Sequence[int], in_doubt: bool, recent: int, list_max: int = 1000
    ) -> Inspection: ...

    async def gc_candidates(
        self, decided_before_ms: int, after: tuple[int, int, int] | None = None, limit: int = 10_000
    ) -> list[tuple[int, GlobalTxid]]:
        """Decided records (and READ_ONLY votes) last changed at or before
        ``decided_before_ms``, oldest first, after the cursor
        ``(recorded_ms, incarnation, txid)``."""
        ...

    async def forget(self, txids: Sequence[GlobalTxid]) -> int:
        """Removes decided records (the term floors stay); how many."""
        ...

    def failure(self) -> StoreFailure | None:
        """Why the store stopped for good, if it has (None: it runs)."""
        ...


__all__ = ["Store"]
