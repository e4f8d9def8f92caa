"""Python SDK of dtx, the distributed-transaction coordinator.

- :mod:`dtx.client`: begin, enlist, commit and abort transactions on a
  coordinator cluster (leader discovery, retries within one deadline, and an
  UNKNOWN outcome kept apart from failure).
- :mod:`dtx.participant`: serve ``dtx.v1.ParticipantService`` for a
  resource of your own, with a durable participant log in SQLite.
- :mod:`dtx.metadata`: the metadata keys of the wire contract and the txid
  propagation helpers.

The protobuf modules are generated from ``proto/dtx/v1`` (see
:mod:`dtx._gen`); docs/python-sdk.md tells how to install and test.
"""

__version__ = "0.1.0"
