"""Shared fixtures: the generated protobuf modules before anything starts,
and processes that are always killed at the end of a test."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SDK_DIR = Path(__file__).resolve().parents[1]
if str(SDK_DIR) not in sys.path:
    sys.path.insert(0, str(SDK_DIR))
TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

# Generate dtx/v1 once, in this process, before any test starts a child
# process that imports it.
from dtx import _gen  # noqa: E402

_gen.ensure()

import pg  # noqa: E402
from harness import BankProc, Cluster  # noqa: E402


@pytest.fixture
def banks(tmp_path: Path) -> Iterator[list[BankProc]]:
    """Bank processes a test starts (append to the list); each is killed at
    the end of the test whatever happened."""
    started: list[BankProc] = []
    yield started
    for b in started:
        b.kill9()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A three-node cluster, started; killed at the end of the test."""
    c = Cluster(tmp_path / "cluster")
    c.start_all()
    try:
        yield c
    finally:
        c.stop_all()


@pytest.fixture
def pg_databases() -> Iterator[pg.Databases]:
    """Fresh PostgreSQL databases for a test (``pg_databases.create()``
    returns a connection string), dropped at the end; skips without a
    server unless DTX_REQUIRE_POSTGRES=1 (tests/pg.py)."""
    dbs = pg.Databases(pg.base())
    try:
        yield dbs
    finally:
        dbs.drop_all()


@pytest.fixture
def pg_db(pg_databases: pg.Databases) -> str:
    """One fresh PostgreSQL database's connection string."""
    return pg_databases.create()
