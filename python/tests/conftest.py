"""Multi-process harness: ranks are real processes (tests/ranks.py) on loopback."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
RANKS = HERE / "ranks.py"


def free_port() -> int:
    """A loopback TCP port below the ephemeral range (as scripts/free-port.sh picks them): no
    connect() or bind(0) elsewhere is handed it before the root binds it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = random.randrange(10000, max(low, 11000))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


@dataclass
class Rank:
    rank: int
    returncode: Optional[int]
    out: str
    seconds: float


def run_ranks(
    nranks: int, *args: str, timeout: float = 90, env: Optional[dict] = None, script: Path = RANKS
) -> list[Rank]:
    """Runs ``nranks`` processes of ``python script args`` (for ranks.py: a scenario and its
    arguments) with the launcher variables of scripts/run-local-ranks.sh; waits for all
    (killing what is left after ``timeout`` s)."""
    root = f"127.0.0.1:{free_port()}"
    procs = []
    start = time.monotonic()
    for r in range(nranks):
        e = dict(os.environ)
        e.update(
            MSCCLPP_RANK=str(r),
            MSCCLPP_NRANKS=str(nranks),
            MSCCLPP_LOCAL_RANK=str(r),
            MSCCLPP_ROOT=root,
            PYTHONUNBUFFERED="1",
        )
        # Bounded: a rank that fails is noticed by the others within these, not at 30 s.
        e.setdefault("MSCCLPP_BOOTSTRAP_TIMEOUT", "20")
        e.setdefault("MSCCLPP_WAIT_TIMEOUT", "20")
        e.update(env or {})
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args], env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    results = []
    for r, p in enumerate(procs):
        left = max(1.0, timeout - (time.monotonic() - start))
        try:
            out, _ = p.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += f"\n[killed after {timeout} s]"
        results.append(Rank(r, p.returncode, out, time.monotonic() - start))
    return results


def assert_all_ok(results: list[Rank]) -> None:
    bad = [r for r in results if r.returncode != 0]
    assert not bad, "\n".join(f"--- rank {r.rank} exited {r.returncode}:\n{r.out}" for r in bad)


@pytest.fixture
def ranks():
    return run_ranks
