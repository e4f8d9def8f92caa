"""The Python client of the dtx coordinator (``dtx.v1.Coordinator``), on
grpcio's asyncio API.

Semantics follow the Rust client (``client/src/lib.rs``) and docs/api.md:

- **Leader discovery.** A follower that refuses a call names the leader in
  ``x-dtx-leader-addr``; a follower that forwarded a call names it in its
  answer. The client sends its next calls there when that address is one
  of the addresses it was given (compared by host and port), so a client
  given only a proxy keeps going through it; otherwise it tries its
  addresses in turn (any node forwards to the leader).
- **Retries.** Every call is retried with exponential backoff and full
  jitter within one overall deadline (``deadline_s``). Every write is safe
  to retry: Begin and BeginAndCommit are idempotent by key, Enlist is
  idempotent, the decision is write-once.
- **UNKNOWN is not failure.** A write that got no definite answer before
  the deadline (a timeout, a connection lost after the request left, an
  UNAVAILABLE or INTERNAL that does not carry ``x-dtx-not-applied``) is
  UNKNOWN: it may have been applied. :meth:`Client.commit` and
  :meth:`Client.abort` return :attr:`Outcome.UNKNOWN`; the other writes
  raise :class:`OutcomeUnknown`. A timeout is never reported as a failure
  or an abort. Ask again with :meth:`Client.decision` or the same call.
- **Definite failures** are exceptions that say nothing happened:
  :class:`NotApplied` (the cluster refused for now, ``x-dtx-not-applied``),
  :class:`FailedPrecondition`, :class:`InvalidArgument`, ...
"""

from __future__ import annotations

import asyncio
import enum
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import grpc.aio

from dtx import metadata as md
from dtx._pb import coordinator_pb2 as cpb
from dtx._pb import coordinator_pb2_grpc as cgrpc

T = TypeVar("T")

#: At most this many txids per GetDecisions call (limits::DECISION_BATCH_TXIDS_MAX).
DECISION_BATCH_TXIDS_MAX = 1024


class DtxError(Exception):
    """A call failed. Only :class:`OutcomeUnknown` leaves a write's outcome
    open; the other kinds say what happened (or, for reads, that no answer
    came)."""

    #: The last gRPC status code seen, when there was one.
    code: grpc.StatusCode | None = None

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class InvalidArgument(DtxError):
    """The request broke a limit or was malformed; nothing happened."""


class NotFound(DtxError):
    """The transaction has no record (never begun, or forgotten)."""


class AlreadyExists(DtxError):
    """An idempotency key was reused with a different request."""


class FailedPrecondition(DtxError):
    """The transaction's state does not allow the call; nothing happened."""

    def __init__(
        self, message: str, code: grpc.StatusCode | None = None, branch_refusal: md.BranchRefusalKind | None = None
    ) -> None:
        super().__init__(message, code)
        self.branch_refusal = branch_refusal


class Unimplemented(DtxError):
    """The server does not implement the call."""


class OutcomeUnknown(DtxError):
    """The write may or may not have been applied (UNKNOWN). Not a failure:
    ask again (the same call, or the decision)."""


class Unavailable(DtxError):
    """A read got no answer before the deadline, or a write reached no node
    (nothing was sent: it was certainly not applied)."""


class NotApplied(DtxError):
    """The cluster refused the write for now and said it was not applied
    (no leader, no quorum, over a rate limit): nothing changed. A definite
    failure; the same call may be made again later."""


class Internal(DtxError):
    """A storage or invariant fault at the server, or an answer this client
    cannot read."""


class Unauthenticated(DtxError):
    """The cluster does not know who this client is; nothing happened."""


class PermissionDenied(DtxError):
    """This client's identity may not make the call; nothing happened."""


class Outcome(enum.Enum):
    """A commit's or an abort's outcome as the caller sees it."""

    COMMITTED = "committed"
    ABORTED = "aborted"
    #: No definite answer came (a timeout, a lost reply): it may be either.
    #: Never a failure: ask :meth:`Client.decision`.
    UNKNOWN = "unknown"


class DecisionRead(enum.Enum):
    """A linearizable decision read."""

    #: Not decided yet: keep waiting, never act on it.
    PENDING = "pending"
    COMMITTED = "committed"
    ABORTED = "aborted"
    #: No record (never begun here, or forgotten after every ack): presumed abort.
    UNKNOWN_PRESUMED_ABORT = "unknown-presumed-abort"
    #: Asked with an incarnation that did not hand out this txid here:
    #: nothing is known and nothing may be presumed.
    OTHER_INCARNATION = "other-incarnation"


_DECISIONS = {
    cpb.OUTCOME_PENDING: DecisionRead.PENDING,
    cpb.OUTCOME_COMMIT: DecisionRead.COMMITTED,
    cpb.OUTCOME_ABORT: DecisionRead.ABORTED,
    cpb.OUTCOME_UNKNOWN_PRESUMED_ABORT: DecisionRead.UNKNOWN_PRESUMED_ABORT,
    cpb.OUTCOME_OTHER_INCARNATION: DecisionRead.OTHER_INCARNATION,
}


def _outcome(v: int) -> Outcome:
    if v == cpb.OUTCOME_COMMIT:
        return Outcome.COMMITTED
    if v == cpb.OUTCOME_ABORT:
        return Outcome.ABORTED
    raise Internal(f"the server sent decision value {v}")


@dataclass(frozen=True)
class Began:
    """What :meth:`Client.begin` learned."""

    txid: int
    #: True when the idempotency key already named this transaction.
    existing: bool
    #: When the cluster aborts it if commit was not asked for (ms since the epoch).
    deadline_unix_ms: int
    #: The incarnation that handed out ``txid``: pass it on with the txid.
    incarnation: int


@dataclass(frozen=True)
class ParticipantSpec:
    """A participant for :meth:`Client.begin_and_commit`."""

    participant_id: str
    address: str
    payload: bytes


@dataclass(frozen=True)
class OneShot:
    """What :meth:`Client.begin_and_commit` learned."""

    #: None when no answer came (then ``outcome`` is UNKNOWN; calling again
    #: with the same key finds the transaction).
    txid: int | None
    outcome: Outcome
    existing: bool = False


@dataclass(frozen=True)
class DecisionAnswer:
    """One transaction's answer to a batched decision read."""

    txid: int
    #: None when the server sent an outcome this client does not know.
    decision: DecisionRead | None
    #: Only when asked with a participant id: the cluster still waits for
    #: that participant's ack (it will deliver the decision again).
    awaiting_ack: bool = False
    settled_by: str = ""


@dataclass(frozen=True)
class ParticipantStatus:
    id: str
    address: str
    acked: bool
    dropped: bool


@dataclass(frozen=True)
class TxStatus:
    """The replicated record of one transaction (Status)."""

    txid: int
    #: "ACTIVE", "PREPARING" or "DECIDED".
    state: str
    participants: list[ParticipantStatus]
    #: The decision when DECIDED, else None.
    decision: Outcome | None
    one_phase: bool
    incarnation: int
    deadline_unix_ms: int
    raw: cpb.StatusResponse = field(repr=False)


class BranchVote(enum.IntEnum):
    """A branch's vote as registered (``dtx.v1.BranchVote``)."""

    YES = 1
    NO = 2
    READ_ONLY = 3


@dataclass(frozen=True)
class BranchRegistration:
    """What :meth:`Client.register_branch` learned."""

    #: The term of the leader that recorded the registration.
    term: int
    #: The incarnation that handed out the txid.
    incarnation: int
    #: True when the same registration was found recorded before (a retry).
    existing: bool
    deadline_unix_ms: int
    participant_count: int


class BranchDecision(enum.Enum):
    """What a branch does with its prepared work (:meth:`Client.branch_decision`)."""

    #: A member of a committed transaction: commit.
    COMMIT = "commit"
    #: Roll back: the transaction aborted, or the branch is not a member
    #: (fenced out of an open transaction, or left out of a decided one).
    ABORT = "abort"
    #: A member of an undecided transaction: keep the work, its decision comes.
    PENDING = "pending"
    #: The txid was not handed out by this incarnation: keep everything.
    OTHER_INCARNATION = "other-incarnation"


@dataclass(frozen=True)
class BranchDecisionAnswer:
    decision: BranchDecision
    #: True when the branch is in the transaction's participant set.
    member: bool
    #: True when this call fenced the branch out of an ACTIVE transaction.
    fenced_now: bool


class _Kind(enum.Enum):
    READ = "read"
    WRITE = "write"


def _host_port(addr: str) -> str | None:
    a = addr.strip()
    if a.startswith("http://"):
        a = a[len("http://") :]
    a = a.rstrip("/")
    if not a or "/" in a or "://" in a:
        return None
    return a.lower()


def _target(addr: str) -> str:
    """A grpc target for a node's API address (``host:port`` or ``http://host[:port]``)."""
    a = addr.strip()
    if a.startswith("https://"):
        raise InvalidArgument(f"{addr!r}: https:// is not served yet (the cluster speaks plain text here)")
    if a.startswith("http://"):
        a = a[len("http://") :].rstrip("/")
        if ":" not in a.rsplit("]", 1)[-1]:
            a += ":80"
    return a


def _nothing_sent(e: grpc.aio.AioRpcError) -> bool:
    """True when the call never left this process: no connection could be
    made to the address, so nothing can have been applied there."""
    if e.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    d = (e.details() or "").lower()
    return "failed to connect to all addresses" in d or "dns resolution failed" in d


def _all_md(e: grpc.aio.AioRpcError) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for m in (e.initial_metadata(), e.trailing_metadata()):
        if m:
            out.extend((k, v) for k, v in m)
    return out


class Client:
    """A client of a coordinator cluster: one channel per node address, the
    leader it last heard of, and the retry policy. Use one per process and
    event loop; its calls may run concurrently. Close it with
    :meth:`close` (or ``async with``).

    ``addrs``: API addresses of some or all nodes (``host:port`` or
    ``http://host[:port]``). ``deadline_s``: the overall budget of one call,
    retries included (a write with no definite answer within it is
    UNKNOWN); ``attempt_timeout_s``: the budget of one attempt at one node.
    """

    def __init__(
        self,
        addrs: Sequence[str],
        deadline_s: float = 15.0,
        attempt_timeout_s: float = 8.0,
        backoff_base_s: float = 0.02,
        backoff_max_s: float = 0.5,
        token: str | None = None,
    ) -> None:
        if not addrs:
            raise InvalidArgument("the client needs at least one address")
        self.addrs = [a.strip() for a in addrs]
        for a in self.addrs:
            _target(a)
        self.deadline_s = deadline_s
        self.attempt_timeout_s = attempt_timeout_s
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.token = token
        self._leader: str | None = None
        self._next = 0
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        chans, self._channels = self._channels, {}
        for ch in chans.values():
            await ch.close()

    @property
    def leader(self) -> str | None:
        """The address the next call goes to first, if a leader is known."""
        return self._leader

    def _pick(self) -> str:
        if self._leader is not None:
            return self._leader
        addr = self.addrs[self._next % len(self.addrs)]
        self._next += 1
        return addr

    def _channel(self, addr: str) -> grpc.aio.Channel:
        ch = self._channels.get(addr)
        if ch is None:
            ch = grpc.aio.insecure_channel(
                _target(addr),
                options=[
                    # A node that went away is tried again soon after it
                    # comes back (grpc's default waits up to 120 s).
                    ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000),
                    ("grpc.enable_retries", 0),
                ],
            )
            self._channels[addr] = ch
        return ch

    def endpoint_named(self, hint: str) -> str | None:
        """The configured address ``hint`` names (by host and port), as it
        was given; None when it is none of them."""
        want = _host_port(hint)
        if want is None:
            return None
        for a in self.addrs:
            if _host_port(a) == want:
                return a
        return None

    def _metadata(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self.token:
            out.append(("authorization", f"Bearer {self.token}"))
        return out

    def _backoff(self, attempt: int) -> float:
        cap = min(self.backoff_max_s, self.backoff_base_s * (2 ** min(attempt, 30)))
        return random.uniform(0, cap)

    async def _call(
        self,
        kind: _Kind,
        invoke: Callable[[grpc.aio.Channel, float, list[tuple[str, str]]], Any],
    ) -> Any:
        """Runs ``invoke(channel, timeout, metadata)`` (a grpc.aio unary call
        object) against the leader or any node, retrying until a definite
        answer or the deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.deadline_s
        maybe_applied = False
        refused = False
        last = "no attempt finished"
        attempt = 0
        while True:
            now = loop.time()
            if now >= deadline:
                if kind is _Kind.WRITE and maybe_applied:
                    raise OutcomeUnknown(last, grpc.StatusCode.DEADLINE_EXCEEDED)
                if kind is _Kind.WRITE and refused:
                    raise NotApplied(last, grpc.StatusCode.UNAVAILABLE)
                raise Unavailable(last, grpc.StatusCode.UNAVAILABLE)
            budget = min(deadline - now, self.attempt_timeout_s)
            addr = self._pick()
            ch = self._channel(addr)
            state = await self._connected(ch, budget)
            if state is not grpc.ChannelConnectivity.READY:
                # No connection: the request was never sent, so nothing
                # can have been applied there. Go round the addresses.
                # An earlier attempt's failure says more: keep it.
                gone = f"{addr}: not connected ({state.name})"
                last = f"{last}; then {gone}" if maybe_applied else gone
                self._leader = None
                pause = min(self._backoff(attempt), max(0.0, deadline - loop.time()))
                await asyncio.sleep(pause)
                attempt += 1
                continue
            budget = min(max(deadline - loop.time(), 0.001), self.attempt_timeout_s)
            call = invoke(ch, budget, self._metadata())
            try:
                answer = await asyncio.wait_for(call, timeout=budget + 1.0)
            except grpc.aio.AioRpcError as e:
                code = e.code()
                emd = _all_md(e)
                last = f"{addr}: {code.name}: {e.details()}"
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidArgument(e.details() or "", code) from e
                if code == grpc.StatusCode.NOT_FOUND:
                    raise NotFound(e.details() or "", code) from e
                if code == grpc.StatusCode.ALREADY_EXISTS:
                    raise AlreadyExists(e.details() or "", code) from e
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    raise FailedPrecondition(
                        e.details() or "", code, md.BranchRefusalKind.parse(md.get(emd, md.BRANCH_REFUSAL_HEADER))
                    ) from e
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    raise Unimplemented(e.details() or "", code) from e
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    raise Unauthenticated(e.details() or "", code) from e
                if code == grpc.StatusCode.PERMISSION_DENIED:
                    raise PermissionDenied(e.details() or "", code) from e
                if _nothing_sent(e):
                    # Not connected: nothing can have been applied there.
                    self._leader = None
                elif code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.DATA_LOSS):
                    if kind is _Kind.READ or md.not_applied(emd):
                        raise Internal(last, code) from e
                    # A reset stream or a fault after the proposal: a write
                    # may have been applied. Ask again; UNKNOWN at the end.
                    maybe_applied = True
                    self._leader = None
                elif code == grpc.StatusCode.RESOURCE_EXHAUSTED and md.not_applied(emd):
                    refused = True
                elif code == grpc.StatusCode.UNAVAILABLE:
                    if md.not_applied(emd):
                        refused = True
                    else:
                        maybe_applied = True
                    hint = md.leader_addr(emd)
                    self._leader = self.endpoint_named(hint) if hint else None
                else:
                    # DEADLINE_EXCEEDED, CANCELLED, UNKNOWN, ...: the write
                    # may have been applied.
                    maybe_applied = True
                    self._leader = None
            except (asyncio.TimeoutError, TimeoutError):
                call.cancel()
                last = f"{addr}: no reply within {budget:.3f} s"
                maybe_applied = True
                self._leader = None
            else:
                try:
                    initial = await call.initial_metadata()
                except Exception:  # noqa: BLE001 - the answer stands without it
                    initial = None
                hint = md.leader_addr(initial)
                if hint:
                    named = self.endpoint_named(hint)
                    if named is not None:
                        self._leader = named
                return answer
            pause = min(self._backoff(attempt), max(0.0, deadline - loop.time()))
            await asyncio.sleep(pause)
            attempt += 1

    @staticmethod
    async def _connected(ch: grpc.aio.Channel, budget: float) -> grpc.ChannelConnectivity:
        """Waits (at most ``budget``) until ``ch`` has a connection; the
        state it ends in. A channel whose last connect failed
        (TRANSIENT_FAILURE) is answered at once, so a dead node costs no
        wait. A call is made only on a READY channel, so an attempt that
        finds none certainly sent nothing."""
        loop = asyncio.get_running_loop()
        until = loop.time() + budget
        state = ch.get_state(try_to_connect=True)
        while state is not grpc.ChannelConnectivity.READY:
            if state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN):
                return state
            left = until - loop.time()
            if left <= 0:
                return state
            try:
                await asyncio.wait_for(ch.wait_for_state_change(state), left)
            except (asyncio.TimeoutError, TimeoutError):
                return ch.get_state(try_to_connect=False)
            state = ch.get_state(try_to_connect=True)
        return state

    def _stub(self, ch: grpc.aio.Channel) -> cgrpc.CoordinatorStub:
        return cgrpc.CoordinatorStub(ch)

    async def begin(self, idempotency_key: str, timeout_ms: int = 0, description: bytes = b"") -> Began:
        """Begins a transaction that the cluster aborts if commit is not
        asked for within ``timeout_ms`` (0: the cluster's default).
        Idempotent by key: the same key and request finds the same
        transaction (``existing``); another request with the key is
        :class:`AlreadyExists`. Raises :class:`OutcomeUnknown` when no
        definite answer came (call again with the same key)."""
        req = cpb.BeginRequest(idempotency_key=idempotency_key, timeout_ms=timeout_ms, description=description)
        r = await self._call(_Kind.WRITE, lambda ch, t, m: self._stub(ch).Begin(req, timeout=t, metadata=m))
        return Began(r.txid, r.existing, r.deadline_unix_ms, r.incarnation)

    async def enlist(self, txid: int, participant_id: str, address: str, payload: bytes) -> int:
        """Adds a participant reachable at ``address`` with ``payload`` for
        its Prepare; enlisting again the same way is a no-op. Returns how
        many participants the transaction has."""
        req = cpb.EnlistRequest(txid=txid, participant_id=participant_id, address=address, payload=payload)
        r = await self._call(_Kind.WRITE, lambda ch, t, m: self._stub(ch).Enlist(req, timeout=t, metadata=m))
        return int(r.participant_count)

    async def commit(self, txid: int) -> Outcome:
        """Asks for COMMIT: COMMITTED, ABORTED (a NO vote, the deadline, an
        abort), or UNKNOWN when no definite answer came (never a failure:
        ask :meth:`decision`)."""
        req = cpb.CommitRequest(txid=txid)
        try:
            r = await self._call(_Kind.WRITE, lambda ch, t, m: self._stub(ch).Commit(req, timeout=t, metadata=m))
        except OutcomeUnknown:
            return Outcome.UNKNOWN
        return _outcome(r.outcome)

    async def abort(self, txid: int, reason: str = "") -> Outcome:
        """Asks for ABORT; the recorded decision wins (COMMITTED when it
        committed first). UNKNOWN when no definite answer came."""
        req = cpb.AbortRequest(txid=txid, reason=reason)
        try:
            r = await self._call(_Kind.WRITE, lambda ch, t, m: self._stub(ch).Abort(req, timeout=t, metadata=m))
        except OutcomeUnknown:
            return Outcome.UNKNOWN
        return _outcome(r.outcome)

    async def begin_and_commit(
        self,
        idempotency_key: str,
        participants: Sequence[ParticipantSpec],
        timeout_ms: int = 0,
        description: bytes = b"",
    ) -> OneShot:
        """Begin with every participant and commit, in one call (one Raft
        write). With one participant the cluster may commit in one phase.
        UNKNOWN (``txid`` None) when no definite answer came: call again
        with the same key, which finds the same transaction."""
        req = cpb.BeginAndCommitRequest(
            idempotency_key=idempotency_key,
            timeout_ms=timeout_ms,
            description=description,
            participants=[
                cpb.ParticipantSpec(participant_id=p.participant_id, address=p.address, payload=p.payload)
                for p in participants
            ],
        )
        try:
            r = await self._call(
                _Kind.WRITE, lambda ch, t, m: self._stub(ch).BeginAndCommit(req, timeout=t, metadata=m)
            )
        except OutcomeUnknown:
            return OneShot(None, Outcome.UNKNOWN)
        return OneShot(r.txid, _outcome(r.outcome), r.existing)

    async def register_branch(
        self,
        txid: int,
        participant_id: str,
        address: str,
        vote: BranchVote,
        reason: str = "",
        incarnation: int = 0,
    ) -> BranchRegistration:
        """Registers branch ``participant_id`` (phase two reaches it at
        ``address``) in ``txid`` with its vote, in one Raft write
        (docs/protocol.md, "Branches"). The same registration again answers
        the same term (``existing``), so this is retried like every write.
        Raises :class:`FailedPrecondition` with ``branch_refusal`` set for a
        refusal (too-late and fenced: roll back; conflict: an earlier
        registration stands) and :class:`OutcomeUnknown` when no definite
        answer came."""
        req = cpb.RegisterBranchRequest(
            txid=txid,
            participant_id=participant_id,
            address=address,
            vote=int(vote),
            reason=reason,
            incarnation=incarnation,
        )
        r = await self._call(_Kind.WRITE, lambda ch, t, m: self._stub(ch).RegisterBranch(req, timeout=t, metadata=m))
        return BranchRegistration(r.term, r.incarnation, r.existing, r.deadline_unix_ms, r.participant_count)

    async def branch_decision(self, txid: int, participant_id: str, incarnation: int = 0) -> BranchDecisionAnswer:
        """What branch ``participant_id`` does with its work prepared for
        ``txid``: a member follows the transaction's decision (or PENDING);
        a branch that is not one is fenced out of an open transaction (a
        replicated write, so this is retried as one) and told ABORT, also
        when the transaction committed without it. An error means no
        answer: keep the work prepared and ask again."""
        req = cpb.GetBranchDecisionRequest(txid=txid, participant_id=participant_id, incarnation=incarnation)
        r = await self._call(
            _Kind.WRITE, lambda ch, t, m: self._stub(ch).GetBranchDecision(req, timeout=t, metadata=m)
        )
        if r.outcome == cpb.OUTCOME_COMMIT and r.member:
            d = BranchDecision.COMMIT
        elif r.outcome == cpb.OUTCOME_ABORT:
            d = BranchDecision.ABORT
        elif r.outcome == cpb.OUTCOME_PENDING and r.member:
            d = BranchDecision.PENDING
        elif r.outcome == cpb.OUTCOME_OTHER_INCARNATION:
            d = BranchDecision.OTHER_INCARNATION
        else:
            raise Internal(
                f"the server sent outcome value {r.outcome} (member {r.member}) for branch "
                f"{participant_id!r} of txid {txid}"
            )
        return BranchDecisionAnswer(d, r.member, r.fenced_now)

    async def status(self, txid: int) -> TxStatus:
        """The replicated record of ``txid`` (:class:`NotFound` without one)."""
        req = cpb.StatusRequest(txid=txid)
        r: cpb.StatusResponse = await self._call(
            _Kind.READ, lambda ch, t, m: self._stub(ch).Status(req, timeout=t, metadata=m)
        )
        decision = None
        if r.state == cpb.TX_STATE_DECIDED and r.HasField("decision"):
            decision = _outcome(r.decision.outcome)
        return TxStatus(
            txid=r.txid,
            state=cpb.TxState.Name(r.state).removeprefix("TX_STATE_"),
            participants=[ParticipantStatus(p.id, p.address, p.acked, p.dropped) for p in r.participants],
            decision=decision,
            one_phase=r.one_phase,
            incarnation=r.incarnation,
            deadline_unix_ms=r.deadline_unix_ms,
            raw=r,
        )

    async def decision(self, txid: int, incarnation: int = 0) -> DecisionRead:
        """The decision of ``txid`` (linearizable)."""
        req = cpb.GetDecisionRequest(txid=txid, incarnation=incarnation)
        r = await self._call(_Kind.READ, lambda ch, t, m: self._stub(ch).GetDecision(req, timeout=t, metadata=m))
        d = _DECISIONS.get(r.outcome)
        if d is None:
            raise Internal(f"the server sent outcome value {r.outcome} for txid {txid}")
        return d

    async def decisions(
        self, txids: Sequence[int], participant_id: str = "", incarnation: int = 0
    ) -> list[DecisionAnswer]:
        """The decisions of many transactions of one incarnation, in order
        (batched, linearizable). With ``participant_id`` each answer also
        says whether the cluster still waits for that participant's ack."""
        out: list[DecisionAnswer] = []
        ids = list(txids)
        for i in range(0, len(ids), DECISION_BATCH_TXIDS_MAX):
            chunk = ids[i : i + DECISION_BATCH_TXIDS_MAX]
            req = cpb.GetDecisionsRequest(txids=chunk, participant_id=participant_id, incarnation=incarnation)

            def invoke(ch: grpc.aio.Channel, t: float, m: list[tuple[str, str]]) -> Awaitable[Any]:
                return self._stub(ch).GetDecisions(req, timeout=t, metadata=m)

            r = await self._call(_Kind.READ, invoke)
            if len(r.decisions) != len(chunk) or any(d.txid != t for d, t in zip(r.decisions, chunk, strict=False)):
                raise Internal(f"{len(r.decisions)} decisions for {len(chunk)} txids, or not in request order")
            out.extend(
                DecisionAnswer(d.txid, _DECISIONS.get(d.outcome), d.awaiting_ack, d.settled_by) for d in r.decisions
            )
        return out

    async def settle(self, txid: int, poll_s: float = 0.2, give_up_s: float = 60.0) -> Outcome:
        """Reads the decision of ``txid`` until it is known: COMMITTED or
        ABORTED (presumed abort counts as ABORTED), or UNKNOWN when it is
        still not known after ``give_up_s`` (never a failure)."""
        until = time.monotonic() + give_up_s
        while True:
            try:
                d = await self.decision(txid)
            except (Unavailable, OutcomeUnknown):
                d = DecisionRead.PENDING
            if d is DecisionRead.COMMITTED:
                return Outcome.COMMITTED
            if d in (DecisionRead.ABORTED, DecisionRead.UNKNOWN_PRESUMED_ABORT):
                return Outcome.ABORTED
            if d is DecisionRead.OTHER_INCARNATION:
                raise FailedPrecondition(f"txid {txid} belongs to another incarnation: ask an operator")
            if time.monotonic() >= until:
                return Outcome.UNKNOWN
            await asyncio.sleep(poll_s)


__all__ = [
    "AlreadyExists",
    "Began",
    "BranchDecision",
    "BranchDecisionAnswer",
    "BranchRegistration",
    "BranchVote",
    "Client",
    "DecisionAnswer",
    "DecisionRead",
    "DtxError",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "NotApplied",
    "NotFound",
    "OneShot",
    "Outcome",
    "OutcomeUnknown",
    "ParticipantSpec",
    "ParticipantStatus",
    "PermissionDenied",
    "TxStatus",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
]
