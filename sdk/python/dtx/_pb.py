"""The generated wire contract (``dtx.v1``), generated first when needed.

Every SDK module imports the protobuf and gRPC modules from here, so the
generation step (``dtx._gen``) runs before the first import of ``dtx.v1``.
"""

from __future__ import annotations

from dtx import _gen

_gen.ensure()

from dtx.v1 import admin_pb2 as admin_pb2  # noqa: E402
from dtx.v1 import admin_pb2_grpc as admin_pb2_grpc  # noqa: E402
from dtx.v1 import coordinator_pb2 as coordinator_pb2  # noqa: E402
from dtx.v1 import coordinator_pb2_grpc as coordinator_pb2_grpc  # noqa: E402
from dtx.v1 import participant_pb2 as participant_pb2  # noqa: E402
from dtx.v1 import participant_pb2_grpc as participant_pb2_grpc  # noqa: E402
from dtx.v1 import saga_pb2 as saga_pb2  # noqa: E402
from dtx.v1 import saga_pb2_grpc as saga_pb2_grpc  # noqa: E402

__all__ = [
    "admin_pb2",
    "admin_pb2_grpc",
    "coordinator_pb2",
    "coordinator_pb2_grpc",
    "participant_pb2",
    "participant_pb2_grpc",
    "saga_pb2",
    "saga_pb2_grpc",
]
