"""The example bank's own API, ``bank.v1.Bank``
(``examples/bank/proto/bank/v1/bank.proto`` at the repository's root, the
Rust bank's), compiled with grpcio-tools the way ``dtx._gen`` compiles
the dtx protos: at the first import, when the stamp in
``examples/_gen/_stamp.txt`` does not match the proto file and the
grpcio-tools version; into ``sdk/python/examples/_gen/``, which
``sdk/python/.gitignore`` ignores; under an ``flock`` and renamed into
place, so processes starting together never import half-written modules.

The modules are top-level ``bank_pb2`` and ``bank_pb2_grpc`` (compiled
from the proto's own directory, so they do not shadow ``bank.py``); the
services keep their proto names (``/bank.v1.Bank/Change``).
``BANK_PROTO`` names another copy of ``bank.proto``.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
GEN_DIR = HERE / "_gen"
STAMP = GEN_DIR / "_stamp.txt"
LOCK = HERE / ".gen.lock"


def proto_file() -> Path:
    env = os.environ.get("BANK_PROTO")
    p = Path(env) if env else HERE.parent.parent.parent / "examples" / "bank" / "proto" / "bank" / "v1" / "bank.proto"
    if not p.is_file():
        raise RuntimeError(f"no bank.proto at {p}; set BANK_PROTO to the file")
    return p


def _fingerprint(p: Path) -> str:
    h = hashlib.sha256(p.read_bytes())
    try:
        from importlib.metadata import version

        h.update(version("grpcio-tools").encode())
    except Exception:  # noqa: BLE001 - the stamp says so
        h.update(b"no grpcio-tools")
    return h.hexdigest()


def _up_to_date(p: Path) -> bool:
    return (
        (GEN_DIR / "bank_pb2.py").is_file()
        and (GEN_DIR / "bank_pb2_grpc.py").is_file()
        and STAMP.is_file()
        and STAMP.read_text().strip() == _fingerprint(p)
    )


def generate(force: bool = False) -> bool:
    """Compiles bank.proto when the output is stale (or ``force``); True
    when it wrote new modules."""
    p = proto_file()
    with open(LOCK, "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if not force and _up_to_date(p):
            return False
        import grpc_tools
        from grpc_tools import protoc

        well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
        tmp = Path(tempfile.mkdtemp(prefix=".gen-", dir=HERE))
        try:
            out = tmp / "_gen"
            out.mkdir()
            rc = protoc.main(
                [
                    "grpc_tools.protoc",
                    f"-I{p.parent}",
                    f"-I{well_known}",
                    f"--python_out={out}",
                    f"--pyi_out={out}",
                    f"--grpc_python_out={out}",
                    str(p),
                ]
            )
            if rc != 0:
                raise RuntimeError(f"grpc_tools.protoc failed with status {rc} on {p}")
            (out / "_stamp.txt").write_text(_fingerprint(p) + "\n")
            trash = None
            if GEN_DIR.exists():
                trash = Path(tempfile.mkdtemp(prefix=".gen-old-", dir=HERE))
                os.rename(GEN_DIR, trash / "_gen")
            os.rename(out, GEN_DIR)
            if trash is not None:
                shutil.rmtree(trash, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return True


def load() -> tuple[ModuleType, ModuleType]:
    """``(bank_pb2, bank_pb2_grpc)``, generated first when needed."""
    generate()
    if str(GEN_DIR) not in sys.path:
        sys.path.append(str(GEN_DIR))
    import bank_pb2
    import bank_pb2_grpc

    return bank_pb2, bank_pb2_grpc


if __name__ == "__main__":
    print(f"bank.v1 {'generated' if generate('--force' in sys.argv) else 'up to date'} in {GEN_DIR}")
