"""Real processes for the integration tests: coordinator nodes (``dtx-dev
serve``) and Python bank participants (``examples/bank.py serve`` on
SQLite, ``examples/pg_bank.py serve`` on PostgreSQL), on loopback
addresses and free ports, killed with SIGKILL where a test is about
crashes."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

SDK_DIR = Path(__file__).resolve().parents[1]
REPO = SDK_DIR.parent.parent
BANK = SDK_DIR / "examples" / "bank.py"
PG_BANK = SDK_DIR / "examples" / "pg_bank.py"
BRANCH_BANK = SDK_DIR / "examples" / "branch_bank.py"
LOOPBACK = "127.0.0.1"


def bin_dir() -> Path:
    return Path(os.environ.get("DTX_BIN_DIR") or (REPO / "target" / "debug"))


def dtx_dev() -> Path:
    return bin_dir() / "dtx-dev"


def ensure_binaries() -> Path:
    """``dtx-dev``, built once with ``cargo build -p dtx-devtools`` when it is
    missing (minutes on a small machine)."""
    exe = dtx_dev()
    if exe.is_file():
        return exe
    if os.environ.get("DTX_BIN_DIR"):
        raise RuntimeError(f"DTX_BIN_DIR={os.environ['DTX_BIN_DIR']} holds no dtx-dev")
    subprocess.run(["cargo", "build", "-p", "dtx-devtools"], cwd=REPO, check=True)
    if not exe.is_file():
        raise RuntimeError(f"cargo build -p dtx-devtools made no {exe}")
    return exe


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_used: set[int] = set()


def free_port(ip: str = LOOPBACK) -> int:
    """A port nothing listens on, below the kernel's ephemeral range (which
    outgoing connections take their local ports from: a port from there
    may be taken between this check and the child's bind)."""
    low, high = 15000, _ephemeral_low() - 1
    for _ in range(1000):
        p = random.randint(low, high)
        if p in _used:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((ip, p))
            except OSError:
                continue
        _used.add(p)
        return p
    raise RuntimeError("no free port")


def wait_for(what: str, cond, timeout_s: float, every_s: float = 0.05):  # type: ignore[no-untyped-def]
    until = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() >= until:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(every_s)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SDK_DIR), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("DTX_PY_LOG", "INFO")
    return env


@dataclass
class BankProc:
    """One Python bank participant process."""

    dir: Path
    id: str
    prefix: str
    cluster: list[str] = field(default_factory=list)
    accounts: int = 10
    initial: int = 1000
    listen: str = ""
    proc: subprocess.Popen[bytes] | None = None
    #: Environment variables of the serving process beside the usual ones
    #: (failpoints: DTX_PY_FAILPOINTS).
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def db(self) -> Path:
        return self.dir / f"{self.id}.db"

    @property
    def log(self) -> Path:
        return self.dir / f"{self.id}.log"

    @property
    def addr(self) -> str:
        return self.listen

    def start(self, timeout_s: float = 30.0) -> BankProc:
        if not self.listen:
            self.listen = f"{LOOPBACK}:{free_port()}"
        ready = self.dir / f"{self.id}.ready"
        ready.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            str(self.script()),
            "serve",
            "--listen",
            self.listen,
            "--id",
            self.id,
            *self.data_args(),
            "--prefix",
            self.prefix,
            "--accounts",
            str(self.accounts),
            "--initial",
            str(self.initial),
            "--ready-file",
            str(ready),
            *self.serve_args(),
        ]
        if self.cluster:
            cmd += ["--cluster", ",".join(self.cluster)]
        out = open(self.log, "ab")  # noqa: SIM115 - the child holds it
        env = _env()
        env.update(self.extra_env)
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        out.close()

        def up() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"bank {self.id} exited with {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            return ready.is_file()

        wait_for(f"bank {self.id} listening", up, timeout_s)
        return self

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill9()
        self.proc = None

    def script(self) -> Path:
        return BANK

    def data_args(self) -> list[str]:
        """Where the bank keeps its data (serve, balance and audit)."""
        return ["--db", str(self.db)]

    def serve_args(self) -> list[str]:
        """More arguments of ``serve``."""
        return []

    def audit(self) -> dict[str, object]:
        out = subprocess.run(
            [sys.executable, str(self.script()), "audit", *self.data_args()],
            capture_output=True,
            env=_env(),
            check=True,
            timeout=60,
        )
        return json.loads(out.stdout)  # type: ignore[no-any-return]


@dataclass
class PgBankProc(BankProc):
    """One Python bank participant process on PostgreSQL (its database's
    connection string in ``postgres``)."""

    postgres: str = ""

    def script(self) -> Path:
        return PG_BANK

    def data_args(self) -> list[str]:
        return ["--postgres", self.postgres]


@dataclass
class BranchBankProc(BankProc):
    """One Python bank serving ``bank.v1.Bank`` (``examples/branch_bank.py``)
    on ``app`` beside its participant service on ``listen``."""

    app: str = ""

    def script(self) -> Path:
        return BRANCH_BANK

    def serve_args(self) -> list[str]:
        if not self.app:
            self.app = f"{LOOPBACK}:{free_port()}"
        return ["--app-listen", self.app]

    def stopped_by_itself(self) -> bool:
        """True when the process stopped itself (SIGSTOP at a failpoint)."""
        if self.proc is None:
            return False
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] == "T"


@dataclass
class PgBranchBankProc(BranchBankProc):
    """``examples/branch_bank.py --postgres``: the bank on PostgreSQL whose
    ``Change`` is a PostgreSQL branch (its database in ``postgres``)."""

    postgres: str = ""

    def data_args(self) -> list[str]:
        return ["--postgres", self.postgres]


@dataclass
class Node:
    id: int
    raft: str
    api: str
    config: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None


class Cluster:
    """Three coordinator nodes (``dtx-dev serve --config``) on loopback;
    node 1 bootstraps the cluster."""

    def __init__(self, dir: Path, n: int = 3, cluster_id: str = "pytest") -> None:
        self.dir = dir
        dir.mkdir(parents=True, exist_ok=True)
        self.bin = ensure_binaries()
        self.nodes: list[Node] = []
        for i in range(1, n + 1):
            self.nodes.append(
                Node(
                    i,
                    f"{LOOPBACK}:{free_port()}",
                    f"{LOOPBACK}:{free_port()}",
                    dir / f"node{i}.toml",
                    dir / f"node{i}.log",
                )
            )
        members = ",\n".join(
            f'  {{ id = {m.id}, raft_addr = "{m.raft}", api_addr = "{m.api}" }}' for m in self.nodes
        )
        for nd in self.nodes:
            nd.config.write_text(
                f'node_id = {nd.id}\ncluster_id = "{cluster_id}"\ndata_dir = "{dir / f"node{nd.id}"}"\n'
                f'raft_addr = "{nd.raft}"\napi_addr = "{nd.api}"\n'
                f"[bootstrap]\nenabled = {'true' if nd.id == 1 else 'false'}\nmembers = [\n{members},\n]\n"
            )

    @property
    def api_addrs(self) -> list[str]:
        return [n.api for n in self.nodes]

    def node(self, id: int) -> Node:
        return next(n for n in self.nodes if n.id == id)

    def start(self, id: int) -> None:
        nd = self.node(id)
        if nd.proc is not None and nd.proc.poll() is None:
            return
        out = open(nd.log, "ab")  # noqa: SIM115 - the child holds it
        env = dict(os.environ)
        env.setdefault("RUST_LOG", "info,openraft=warn")
        nd.proc = subprocess.Popen(
            [str(self.bin), "serve", "--config", str(nd.config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        out.close()

    def start_all(self) -> None:
        for n in self.nodes:
            self.start(n.id)

    def kill9(self, id: int) -> None:
        nd = self.node(id)
        if nd.proc is not None and nd.proc.poll() is None:
            nd.proc.send_signal(signal.SIGKILL)
            nd.proc.wait()
        nd.proc = None

    def running(self) -> list[Node]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def status(self, nd: Node):  # type: ignore[no-untyped-def]
        from dtx._pb import admin_pb2, admin_pb2_grpc

        with grpc.insecure_channel(nd.api) as ch:
            return admin_pb2_grpc.AdminStub(ch).ClusterStatus(admin_pb2.ClusterStatusRequest(), timeout=0.5)

    def leader(self) -> int | None:
        """The id of the leader every running node agrees on and that
        serves, or None."""
        seen = []
        for nd in self.running():
            try:
                s = self.status(nd)
            except grpc.RpcError:
                return None
            seen.append((nd.id, s.leader_id, s.role, s.serving))
        leaders = [i for i, lid, role, serving in seen if i == lid and role == "Leader" and serving]
        if len(leaders) == 1 and all(lid == leaders[0] for _, lid, _, _ in seen):
            return leaders[0]
        return None

    def wait_leader(self, timeout_s: float = 30.0) -> int:
        try:
            return wait_for("a serving leader", self.leader, timeout_s, 0.1)  # type: ignore[no-any-return]
        except AssertionError:
            tails = "\n".join(f"--- node {n.id}:\n{n.log.read_text()[-2000:]}" for n in self.nodes if n.log.exists())
            raise AssertionError(f"no serving leader within {timeout_s} s\n{tails}") from None

    def stop_all(self) -> None:
        for n in self.nodes:
            self.kill9(n.id)
