"""The participant conformance kit (docs/conformance.md) against the Python
bank, a real process: every rule of docs/protocol.md's participant tables
passes, the READ_ONLY ones included (the Python bank votes READ_ONLY on a
payload that changes nothing), and the exactly-once effects are counted
through the bank's committed balance. Rules the kit cannot run without
starting the service itself (``crash.*``, which need ``--start``) are the
only ones allowed to be skipped; with ``--start`` (a kit that has it) they
run too: the kit kills the bank with SIGKILL at the windows that matter and
starts it again on the same file."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from harness import BANK, LOOPBACK, SDK_DIR, BankProc, ensure_binaries, free_port


def kit(args: list[str], timeout_s: float = 600) -> tuple[int, dict[str, object], str]:
    exe = ensure_binaries()
    p = subprocess.run(
        [str(exe), "conformance", "participant", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**__import__("os").environ, "RUST_LOG": "warn"},
    )
    try:
        report = json.loads(p.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"the kit printed no JSON (exit {p.returncode}):\n{p.stdout}\n{p.stderr}") from None
    return p.returncode, report, p.stderr


def profile(pid: str, addr: str, db: Path) -> list[str]:
    effect = f"{shlex.quote(sys.executable)} {shlex.quote(str(BANK))} balance --db {shlex.quote(str(db))} --account a0"
    return [
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
        effect,
    ]


def verdicts(report: dict[str, object]) -> dict[str, str]:
    rules = report["rules"]
    assert isinstance(rules, list)
    return {r["id"]: r["verdict"] for r in rules}


def explain(report: dict[str, object]) -> str:
    rules = report["rules"]
    assert isinstance(rules, list)
    bad = [r for r in rules if r["verdict"] != "passed"]
    return json.dumps(bad, indent=1)[:20000]


def test_the_python_bank_passes_the_conformance_kit(tmp_path: Path, banks: list[BankProc]) -> None:
    bank = BankProc(tmp_path, "py-bank-k", "a")
    banks.append(bank)
    bank.start()
    code, report, stderr = kit(profile(bank.id, bank.addr, bank.db))
    v = verdicts(report)
    not_passed = {k: x for k, x in v.items() if x != "passed"}
    # Only rules that need the kit to start (and crash) the service itself
    # may be skipped here.
    assert all(k.startswith("crash.") and x == "skipped" for k, x in not_passed.items()), explain(report)
    for must in (
        "prepare.yes",
        "read-only",
        "one-phase.read-only",
        "apply-decisions",
        "prepare-many",
        "inspect",
        "fence.term-floor",
        "effect.commit-once",
        "effect.one-phase-once",
        "effect.abort-nothing",
        "effect.stale-nothing",
    ):
        assert v.get(must) == "passed", f"{must}: {explain(report)}"
    assert code == 0, stderr
    assert report["participant_id"] == bank.id
    # The kit aborted everything it touched: nothing is left in doubt.
    a = bank.audit()
    assert a["in_doubt"] == 0 and a["locks"] == {} and a["pending"] == []
    assert a["applied_twice"] == []


def kit_has_start() -> bool:
    exe = ensure_binaries()
    h = subprocess.run([str(exe), "conformance", "participant", "--help"], capture_output=True, text=True)
    return "--start" in h.stdout


def test_the_python_bank_keeps_the_rules_across_kill_9(tmp_path: Path) -> None:
    if not kit_has_start():
        pytest.skip("this dtx-dev's conformance kit has no --start (crash rules)")
    addr = f"{LOOPBACK}:{free_port()}"
    db = tmp_path / "crash.db"
    start = (
        f"PYTHONPATH={shlex.quote(str(SDK_DIR))} exec {shlex.quote(sys.executable)} {shlex.quote(str(BANK))} serve "
        f"--listen {addr} --id py-bank-c --db {shlex.quote(str(db))}"
    )
    code, report, stderr = kit(
        [*profile("py-bank-c", addr, db), "--start", start, "--start-log", str(tmp_path / "started.log")]
    )
    v = verdicts(report)
    assert [k for k, x in v.items() if x != "passed"] == [], explain(report)
    assert any(k.startswith("crash.") for k in v), "the kit ran its crash rules"
    assert code == 0, stderr
