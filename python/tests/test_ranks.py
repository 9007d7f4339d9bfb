"""Multi-process tests on host memory: 2 to 4 ranks over libfabric tcp (IB) and shm (SHM)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import RANKS, assert_all_ok, free_port, run_ranks


@pytest.mark.parametrize(
    "nranks,transport",
    [(2, "ib"), (2, "shm"), (4, "ib"), (3, "shm")],
)
def test_allgather_every_byte(nranks: int, transport: str) -> None:
    # 1 byte, an odd size, 1 MiB per rank; three rounds each with fresh patterns.
    assert_all_ok(run_ranks(nranks, "allgather", transport, "1,4093,1048576"))


@pytest.mark.parametrize("transport", ["ib", "shm"])
def test_put_signal_flush_separately(transport: str) -> None:
    assert_all_ok(run_ranks(3, "put_signal_split", transport))


@pytest.mark.parametrize("mode", ["uid", "env"])
def test_bootstrap_all_gather_and_barrier(mode: str, tmp_path) -> None:
    assert_all_ok(run_ranks(3, "bootstrap", mode, str(tmp_path)))


def test_registered_buffer_write() -> None:
    assert_all_ok(run_ranks(2, "registered_write", "ib"))


def _result(out: str) -> tuple[str, str, float]:
    m = re.search(r"^RESULT (\w+) (\w+) ([\d.]+)s", out, re.M)
    assert m, out
    return m.group(1), m.group(2), float(m.group(3))


@pytest.mark.parametrize("transport", ["ib", "shm"])
def test_dead_peer_raises_in_time(transport: str) -> None:
    # MSCCLPP_WAIT_TIMEOUT is 20 s (conftest); a peer whose connection closes is noticed sooner.
    # The bound is a hang bound, not a timing claim.
    r0, r1 = run_ranks(2, "dead_peer", transport, "wait", timeout=60)
    assert r1.returncode == 3, r1.out
    assert r0.returncode == 0, r0.out
    kind, code, seconds = _result(r0.out)
    assert kind == "RemoteError" and code == "REMOTE_ERROR", r0.out
    assert seconds < 25, r0.out
    assert "closed after" in r0.out, r0.out


def test_missing_peer_at_bootstrap_raises_in_time() -> None:
    r0, r1 = run_ranks(2, "dead_peer", "ib", "bootstrap", env={"MSCCLPP_BOOTSTRAP_TIMEOUT": "3"}, timeout=60)
    assert r1.returncode == 3, r1.out
    assert r0.returncode == 0, r0.out
    kind, code, seconds = _result(r0.out)
    assert kind == "RemoteError" and code == "REMOTE_ERROR", r0.out
    assert seconds < 15, r0.out


def test_dropped_communicator_is_destroyed_at_once() -> None:
    # Connections hold their communicator weakly: dropping it destroys it then and there (not
    # at a later garbage collection on some other thread), once.
    assert_all_ok(run_ranks(2, "dropped", "shm"))


def _seconds_of(out: str, what: str) -> float:
    """The seconds of a rank's ``RESULT <what> <s>s`` line."""
    m = re.search(rf"^RESULT {what} ([\d.]+)s", out, re.M)
    assert m, out
    return float(m.group(1))


def test_close_while_another_thread_waits() -> None:
    r0, r1 = run_ranks(2, "close_while_waiting", "ib", timeout=60)
    assert_all_ok([r0, r1])
    assert _seconds_of(r0.out, "closed") < 10, r0.out  # a hang bound (the wait timeout is 20 s)


def test_a_wait_past_its_timeout_is_a_timeout_error() -> None:
    r0, r1 = run_ranks(2, "wait_timeout", "ib", env={"MSCCLPP_WAIT_TIMEOUT": "2"}, timeout=60)
    assert r0.returncode == 0, r0.out
    assert r1.returncode == 0, r1.out
    assert "RESULT timeout" in r0.out, r0.out


@pytest.mark.parametrize("transport", ["ib", "shm"])
def test_unregister_buffer(transport: str) -> None:
    assert_all_ok(run_ranks(2, "unregister", transport))


def test_ctrl_c_interrupts_a_wait_and_aborts() -> None:
    # MSCCLPP_WAIT_TIMEOUT is 20 s (conftest): KeyboardInterrupt must come long before it.
    r0, r1 = run_ranks(2, "interrupt_wait", "ib", timeout=60)
    assert_all_ok([r0, r1])
    assert _seconds_of(r0.out, "interrupted") < 10, r0.out  # a hang bound (the wait timeout is 20 s)
    assert "RESULT peer" in r1.out, r1.out


def test_ctrl_c_interrupts_communicator_creation() -> None:
    # One rank of two: creation waits for the other up to the bootstrap timeout (60 s here).
    (r0,) = run_ranks(
        1, "interrupt_bootstrap", str(free_port()), env={"MSCCLPP_BOOTSTRAP_TIMEOUT": "60"}, timeout=40
    )
    assert r0.returncode == 0, r0.out
    m = re.search(r"^RESULT interrupted ([\d.]+)s", r0.out, re.M)
    assert m and float(m.group(1)) < 10, r0.out


def test_abort_releases_calls_and_destroys_once() -> None:
    assert_all_ok(run_ranks(2, "abort_calls", "ib", timeout=60))


def test_abort_does_not_wait_behind_a_barrier() -> None:
    r0, r1 = run_ranks(2, "abort_barrier", "ib", env={"MSCCLPP_BOOTSTRAP_TIMEOUT": "3"}, timeout=60)
    assert r0.returncode == 0, r0.out
    assert r1.returncode == 0, r1.out
    m = re.search(r"^RESULT abort took ([\d.]+)s", r0.out, re.M)
    assert m and float(m.group(1)) < 1.5, r0.out  # the barrier holds the lock for 3 s


def test_from_torch_distributed() -> None:
    # Where PyTorch is installed (the GPU machine's python3; not CI's venv).
    pytest.importorskip("torch.distributed")
    assert_all_ok(run_ranks(3, "from_torch", str(free_port())))


def test_from_mpi4py() -> None:
    # Where mpi4py and an MPI launcher are installed.
    pytest.importorskip("mpi4py")
    mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
    if mpiexec is None:
        pytest.skip("no mpiexec")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    out = subprocess.run(
        [mpiexec, "-n", "2", sys.executable, str(RANKS), "from_mpi"], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("from_mpi ok") == 2, out.stdout


def test_async_error_carries_the_library_text() -> None:
    r0, r1 = run_ranks(2, "async_text", "ib", timeout=60)
    assert r0.returncode == 0, r0.out
    assert r1.returncode == 0, r1.out
    assert "RESULT async_error" in r0.out, r0.out
