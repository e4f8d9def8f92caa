"""A dtx participant: implement a :class:`Resource` on the store's SQLite
database, open a :class:`ParticipantStore` and :func:`serve` it; or, for a
service whose data is in PostgreSQL, a
:class:`dtx.participant.postgres.PgResource` served from a
:class:`dtx.participant.postgres.PgParticipantStore` (that module needs
psycopg 3 and is not imported here).

The SDK keeps the durable participant log of docs/protocol.md in the same
SQLite file as the resource's tables (one SQLite transaction per message,
``synchronous=FULL``), answers every ParticipantService call (Prepare,
Commit, Abort, CommitOnePhase, Inquire, ApplyDecisions, PrepareMany,
Inspect) and, given the cluster's addresses, recovers in-doubt
transactions from the cluster. See docs/python-sdk.md.
"""

from dtx.participant.api import Store
from dtx.participant.log import GlobalTxid, Kind, LogEntry, Message, State, Vote, step
from dtx.participant.server import ParticipantServer, ParticipantServicer, Recovery, RecoveryOptions, serve
from dtx.participant.store import (
    Answer,
    ParticipantStore,
    Refuse,
    Refused,
    Resource,
    SqlTx,
    StoreError,
    StoreFailure,
    StoreStopped,
    StoreUnavailable,
)

__all__ = [
    "Answer",
    "GlobalTxid",
    "Kind",
    "LogEntry",
    "Message",
    "ParticipantServer",
    "ParticipantServicer",
    "ParticipantStore",
    "Recovery",
    "RecoveryOptions",
    "Refuse",
    "Refused",
    "Resource",
    "SqlTx",
    "State",
    "Store",
    "StoreError",
    "StoreFailure",
    "StoreStopped",
    "StoreUnavailable",
    "Vote",
    "serve",
]
