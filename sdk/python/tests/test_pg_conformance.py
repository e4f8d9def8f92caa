"""The participant conformance kit (docs/conformance.md) against the Python
bank on PostgreSQL (``examples/pg_bank.py``), a real process the kit starts
itself (``--start``) and kills with SIGKILL at the moments that matter:
every rule passes, the READ_ONLY ones (the bank votes READ_ONLY on a
payload that changes nothing) and the crash ones included; the
exactly-once effects are counted through the committed balance. Then
nothing is left prepared in the database. Skipped without
``DTX_TEST_POSTGRES`` unless ``DTX_REQUIRE_POSTGRES=1`` (tests/pg.py)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from harness import LOOPBACK, PG_BANK, SDK_DIR, PgBankProc, free_port
from test_conformance import explain, kit, kit_has_start, verdicts


def test_the_postgresql_bank_passes_every_rule_of_the_kit_across_kill_9(tmp_path: Path, pg_db: str) -> None:
    assert kit_has_start(), "this dtx-dev's conformance kit has no --start"
    pid = "py-pg-bank-k"
    addr = f"{LOOPBACK}:{free_port()}"
    py, bank, dsn = shlex.quote(sys.executable), shlex.quote(str(PG_BANK)), shlex.quote(pg_db)
    start = (
        f"PYTHONPATH={shlex.quote(str(SDK_DIR))} exec {py} {bank} serve --listen {addr} --id {pid} --postgres {dsn}"
    )
    code, report, stderr = kit(
        [
            "--address",
            addr,
            "--participant-id",
            pid,
            "--yes-payload",
            "a0:1",
            "--no-payload",
            "nosuch:1",
            "--read-only-payload",
            "a0:0",
            "--effect-command",
            f"PYTHONPATH={shlex.quote(str(SDK_DIR))} {py} {bank} balance --postgres {dsn} --account a0",
            "--start",
            start,
            "--start-log",
            str(tmp_path / "started.log"),
        ]
    )
    v = verdicts(report)
    assert [k for k, x in v.items() if x != "passed"] == [], explain(report)
    for must in ("read-only", "fence.raised", "fence.term-floor", "prepare-many", "inspect", "effect.commit-once"):
        assert v.get(must) == "passed", must
    assert sum(k.startswith("crash.") for k in v) >= 7, "the kit ran its crash rules"
    assert code == 0, stderr
    assert report["participant_id"] == pid
    # The kit aborted everything it touched: nothing is left prepared, no
    # account is held, nothing was applied twice.
    a = PgBankProc(tmp_path, pid, "a", postgres=pg_db).audit()
    assert a["in_doubt"] == 0 and a["locks"] == {} and a["pending"] == [], a
    assert a["applied_twice"] == []
