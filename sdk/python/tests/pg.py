"""PostgreSQL for the tests: ``DTX_TEST_POSTGRES`` names a server (a libpq
connection string, ``host=127.0.0.1 port=N user=postgres dbname=...``, as
``cargo test -p dtx-devtools --test it -- t126`` passes it when the server
binaries are installed). Each test gets a database of its own, created from
that connection (the role must be allowed to create databases) and dropped
at the end, after rolling back whatever it left prepared (the
prepared-transaction slots are shared by the whole server).

Without ``DTX_TEST_POSTGRES`` (or without psycopg) the PostgreSQL tests are
skipped, saying why, unless ``DTX_REQUIRE_POSTGRES=1``: then they fail."""

from __future__ import annotations

import os
import secrets
from typing import Any

import pytest

ENV = "DTX_TEST_POSTGRES"
REQUIRE = "DTX_REQUIRE_POSTGRES"


def required() -> bool:
    return os.environ.get(REQUIRE) == "1"


def unavailable(why: str) -> None:
    """Skips the test, or fails it when PostgreSQL is required."""
    if required():
        pytest.fail(f"{REQUIRE}=1 but {why}", pytrace=False)
    pytest.skip(f"no PostgreSQL for the tests: {why}")


def base() -> str:
    """The server's connection string (skips or fails without one)."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        unavailable("psycopg is not installed (scripts/python-deps installs it)")
    dsn = os.environ.get(ENV, "").strip()
    if not dsn:
        unavailable(f"{ENV} is not set (a libpq connection string of a server the tests may create databases on)")
    return dsn


def with_db(dsn: str, dbname: str) -> str:
    from psycopg.conninfo import make_conninfo

    return make_conninfo(dsn, dbname=dbname)


class Databases:
    """Databases a test creates; each dropped at the end with what it left
    prepared rolled back."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.names: list[str] = []

    def create(self, tag: str = "t") -> str:
        import psycopg
        from psycopg import sql

        name = f"dtx_{tag}_{secrets.token_hex(4)}"
        with psycopg.connect(self.dsn, autocommit=True) as c:
            c.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        self.names.append(name)
        return with_db(self.dsn, name)

    def drop_all(self) -> None:
        import psycopg
        from psycopg import sql

        for name in self.names:
            with psycopg.connect(with_db(self.dsn, name), autocommit=True) as c:
                for (gid,) in c.execute(
                    "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
                ).fetchall():
                    c.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
            with psycopg.connect(self.dsn, autocommit=True) as c:
                c.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        self.names.clear()


def query(dsn: str, q: str, params: Any = None) -> list[tuple[Any, ...]]:
    """What another session sees (autocommit)."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as c:
        cur = c.execute(q, params)
        return cur.fetchall() if cur.description is not None else []
