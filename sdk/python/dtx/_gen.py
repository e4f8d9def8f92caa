"""Compiles the wire contract, ``proto/dtx/v1/*.proto``, into ``dtx/v1``.

The generated modules (``dtx/v1/coordinator_pb2.py``, ``..._pb2_grpc.py``
and their ``.pyi`` stubs) are never committed: ``sdk/python/.gitignore``
ignores ``dtx/v1/``. They are written

- at the first import of a module that needs them (``dtx._pb``), when the
  repository's ``proto/`` directory is found beside this package (a source
  checkout or an editable install) and the stamp in ``dtx/v1/_stamp.txt``
  does not match the proto files and the grpcio-tools version;
- when a wheel is built (``setup.py`` calls :func:`generate`), so an
  installed package carries them and needs no grpcio-tools;
- by hand: ``python -m dtx._gen`` (``--force`` to regenerate anyway).

``DTX_PROTO_DIR`` names another proto root (the directory holding
``dtx/v1/*.proto``). Generation takes an exclusive ``flock`` on
``dtx/.gen.lock`` and writes into a temporary directory that is renamed into
place, so processes that start at once (a test starting several services)
never see half-written modules.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

#: The proto files compiled, in ``dtx/v1`` of the proto root.
PROTOS: tuple[str, ...] = ("coordinator.proto", "participant.proto", "admin.proto", "saga.proto")

PKG_DIR = Path(__file__).resolve().parent
GEN_DIR = PKG_DIR / "v1"
STAMP = GEN_DIR / "_stamp.txt"
LOCK = PKG_DIR / ".gen.lock"


def proto_root() -> Path | None:
    """The directory holding ``dtx/v1/*.proto``, or None when not found."""
    env = os.environ.get("DTX_PROTO_DIR")
    candidates = [Path(env)] if env else []
    # sdk/python/dtx -> the repository's proto/.
    candidates.append(PKG_DIR.parent.parent.parent / "proto")
    for c in candidates:
        if all((c / "dtx" / "v1" / p).is_file() for p in PROTOS):
            return c
    return None


def _modules() -> list[Path]:
    out = []
    for p in PROTOS:
        stem = p.removesuffix(".proto")
        out += [GEN_DIR / f"{stem}_pb2.py", GEN_DIR / f"{stem}_pb2_grpc.py"]
    return out


def fingerprint(root: Path) -> str:
    """What the generated code depends on: the proto files and the compiler."""
    h = hashlib.sha256()
    for p in PROTOS:
        h.update(p.encode())
        h.update((root / "dtx" / "v1" / p).read_bytes())
    try:
        from importlib.metadata import version

        h.update(version("grpcio-tools").encode())
    except Exception:  # noqa: BLE001 - no grpcio-tools: the stamp says so
        h.update(b"no grpcio-tools")
    return h.hexdigest()


def generated() -> bool:
    """True when every generated module is present (whatever its stamp)."""
    return all(m.is_file() for m in _modules())


def _up_to_date(root: Path) -> bool:
    return generated() and STAMP.is_file() and STAMP.read_text().strip() == fingerprint(root)


def _compile(root: Path) -> None:
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError as e:  # pragma: no cover - said to the user
        raise RuntimeError(
            "dtx: the generated protobuf modules (dtx/v1) are missing or stale and grpcio-tools is not "
            "installed to make them: run scripts/python-deps, or pip install grpcio-tools"
        ) from e
    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    tmp = Path(tempfile.mkdtemp(prefix=".v1-", dir=PKG_DIR))
    try:
        args = [
            "grpc_tools.protoc",
            f"-I{root}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
        ] + [str(root / "dtx" / "v1" / p) for p in PROTOS]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"dtx: grpc_tools.protoc failed with status {rc} on {root}/dtx/v1")
        out = tmp / "dtx" / "v1"
        (out / "__init__.py").write_text('"""Generated from proto/dtx/v1 by dtx._gen: do not edit."""\n')
        (out / "_stamp.txt").write_text(fingerprint(root) + "\n")
        trash = None
        if GEN_DIR.exists():
            trash = Path(tempfile.mkdtemp(prefix=".v1-old-", dir=PKG_DIR))
            os.rename(GEN_DIR, trash / "v1")
        os.rename(out, GEN_DIR)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def generate(force: bool = False) -> bool:
    """Compiles the protos when they are found and the output is stale (or
    ``force``). Returns True when it wrote new modules."""
    root = proto_root()
    if root is None:
        if generated():
            return False
        raise RuntimeError(
            "dtx: the generated protobuf modules (dtx/v1) are missing and no proto/dtx/v1 was found "
            "beside the package; set DTX_PROTO_DIR to the directory holding dtx/v1/*.proto"
        )
    try:
        lock = open(LOCK, "a+")  # noqa: SIM115 - held for the block below
    except OSError:
        # A read-only install: take what is there.
        if generated():
            return False
        raise
    with lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if not force and _up_to_date(root):
            return False
        _compile(root)
        return True


def ensure() -> None:
    """Makes sure ``dtx.v1`` can be imported (see the module doc)."""
    if proto_root() is None and generated():
        return
    generate()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    wrote = generate(force="--force" in args)
    print(f"dtx/v1 {'generated' if wrote else 'up to date'} in {GEN_DIR}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
