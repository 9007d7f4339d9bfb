"""One rank of a multi-process test: `python ranks.py SCENARIO [ARGS...]`, started by
conftest.run_ranks with the launcher variables set. Exits 0 when every check passed, 1 with
the reason on stdout otherwise; the last line says what happened (some tests read it)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

import mscclpp_rs as m


def pattern(rank: int, nbytes: int, round_: int) -> np.ndarray:
    i = np.arange(nbytes, dtype=np.int64)
    return ((rank * 37 + round_ * 11 + i % 251 + (i >> 12)) % 256).astype(np.uint8)


def check(buf: np.ndarray, nranks: int, chunk: int, round_: int, me: int) -> None:
    for r in range(nranks):
        got = buf[r * chunk : (r + 1) * chunk]
        want = pattern(r, chunk, round_)
        bad = np.flatnonzero(got != want)
        if bad.size:
            raise AssertionError(
                f"rank {me}, round {round_}: {bad.size} wrong bytes in rank {r}'s slice, "
                f"first at {bad[0]}: {got[bad[0]]} != {want[bad[0]]}"
            )


def allgather(transport: str, sizes: str) -> None:
    """Host puts over `transport`, each size in turn, 3 rounds each, every byte checked."""
    with m.Communicator.from_env() as comm:
        n, me = comm.size, comm.rank
        chunks = [int(s) for s in sizes.split(",")]
        buf = np.zeros(n * max(chunks), dtype=np.uint8)
        conns = [comm.connect(p, buf, transport=transport) for p in range(n) if p != me]
        with comm.proxy():
            dc = comm.device_connections()
            assert len(dc) == n - 1 and dc.remote_ranks == [c.remote_rank for c in conns], dc
            round_ = 0
            for chunk in chunks:
                for _ in range(3):
                    round_ += 1
                    buf[:] = 0xEE  # poison: a byte that did not arrive is seen
                    buf[me * chunk : (me + 1) * chunk] = pattern(me, chunk, round_)
                    comm.barrier()  # nobody puts before every rank has poisoned
                    for c in conns:
                        c.put_with_signal(me * chunk, chunk)
                    for c in conns:
                        c.flush()
                    for c in conns:
                        c.wait()
                    check(buf[: n * chunk], n, chunk, round_, me)
                    comm.barrier()  # nobody overwrites before every rank has checked
    print(f"rank {me}: allgather over {transport} ok")


def put_signal_split(transport: str) -> None:
    """put + signal as two calls, put_with_signal_and_flush, and offsets that differ on both
    sides: rank r writes its bytes [0, 1000) to offset 4096 * (r + 1) of every peer."""
    with m.Communicator.from_env() as comm:
        n, me = comm.size, comm.rank
        buf = bytearray(4096 * (n + 1))
        src = pattern(me, 1000, 5).tobytes()
        buf[:1000] = src
        conns = [comm.connect(p, buf, transport=transport) for p in range(n) if p != me]
        with comm.proxy():
            for i, c in enumerate(conns):
                if i % 2:
                    c.put(4096 * (me + 1), 1000, src_offset=0)
                    c.signal()
                    c.flush()
                else:
                    c.put_with_signal_and_flush(4096 * (me + 1), 1000, src_offset=0)
            for c in conns:
                c.wait()
            for c in conns:
                r = c.remote_rank
                got = bytes(buf[4096 * (r + 1) : 4096 * (r + 1) + 1000])
                assert got == pattern(r, 1000, 5).tobytes(), f"rank {me}: bytes from rank {r} differ"
            comm.barrier()
    print(f"rank {me}: split put/signal ok")


def bootstrap(mode: str, tmp: str) -> None:
    """A communicator from a unique id (rank 0 writes it to a file) or from the environment;
    all_gather of bytes of different lengths (one empty), and barriers."""
    env = m.launch_env()
    if mode == "uid":
        path = Path(tmp) / "uid"
        if env.rank == 0:
            uid = m.unique_id()
            (Path(tmp) / "uid.part").write_bytes(bytes(uid))
            os.replace(Path(tmp) / "uid.part", path)
        else:
            deadline = time.monotonic() + 30
            while not path.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError("rank 0 wrote no unique id")
                time.sleep(0.01)
        comm = m.Communicator(m.UniqueId(path.read_bytes()), env.rank, env.nranks)
    else:
        comm = m.Communicator.from_env()
    with comm:
        assert (comm.rank, comm.size) == (env.rank, env.nranks)
        mine = b"" if comm.rank == 1 else bytes([comm.rank]) * (comm.rank * 1000 + 3)
        got = comm.all_gather(mine)
        want = [b"" if r == 1 else bytes([r]) * (r * 1000 + 3) for r in range(comm.size)]
        assert got == want, [len(g) for g in got]
        assert comm.all_gather(b"") == [b""] * comm.size
        for _ in range(3):
            comm.barrier()
    print(f"rank {env.rank}: bootstrap ({mode}) ok")


def registered_write(transport: str) -> None:
    """register_buffer + write: rank r writes 512 bytes to offset 512 * r of every peer."""
    with m.Communicator.from_env() as comm:
        n, me = comm.size, comm.rank
        buf = np.zeros(512 * n, dtype=np.uint8)
        for p in range(n):
            if p != me:
                comm.connect(p, buf, transport=transport)
        with comm.proxy():
            reg = comm.register_buffer(buf)
            src = pattern(me, 512, 9)
            reg.write(src, dst_offset=512 * me)
            # The stream as users hold one (each the default stream here: host memory).
            for stream in (_TorchStream(), _CupyStream(), _ProtocolStream(), 0):
                reg.write(src, dst_offset=512 * me, stream=stream)
            comm.barrier()
            check(_with_mine(buf, src, me), n, 512, 9, me)
            comm.barrier()
    print(f"rank {me}: registered write ok")


def unregister(transport: str) -> None:
    """Two registered buffers on 2 ranks; the first unregistered: its writes are refused, the
    second's still arrive, a second unregister is refused."""
    with m.Communicator.from_env() as comm:
        me = comm.rank
        buf = np.zeros(1024, dtype=np.uint8)
        comm.connect(1 - me, buf, transport=transport)
        a, b = np.zeros(512, dtype=np.uint8), np.zeros(512, dtype=np.uint8)
        with comm.proxy():
            ra, rb = comm.register_buffer(a), comm.register_buffer(b)
            src = pattern(me, 256, 3)
            ra.write(src)
            comm.barrier()
            assert (a[:256] == pattern(1 - me, 256, 3)).all(), "the write before unregister did not arrive"
            ra.unregister()
            for call in (lambda: ra.write(src), ra.unregister):
                try:
                    call()
                except m.InvalidArgumentError as e:
                    assert "unregistered" in e.message, e.message
                else:
                    raise AssertionError("a call with an unregistered buffer did not raise")
            rb.write(src, dst_offset=256)
            comm.barrier()
            assert (b[256:512] == pattern(1 - me, 256, 3)).all(), "the second buffer's write did not arrive"
            rb.unregister()
            # The communicator no longer keeps an unregistered buffer's memory alive.
            import weakref

            gone = weakref.ref(a)
            del a, ra, call  # call: the loop's last, ra.unregister
            assert gone() is None, "an unregistered buffer is still kept alive"
            comm.barrier()
    print(f"rank {me}: unregister ok")


class _TorchStream:
    """The attribute a torch.cuda.Stream has (PyTorch is not installed where this runs)."""

    cuda_stream = 0


class _CupyStream:
    """The attribute a CuPy stream has."""

    ptr = 0


class _ProtocolStream:
    """The __cuda_stream__ protocol (version, handle)."""

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, 0)


def _with_mine(buf: np.ndarray, src: np.ndarray, me: int) -> np.ndarray:
    out = buf.copy()
    out[512 * me : 512 * (me + 1)] = src  # a rank writes only to its peers
    return out


def dead_peer(transport: str, when: str) -> None:
    """Rank 1 dies (os._exit, no goodbye) `when` = "wait": while rank 0 waits for its signal;
    "bootstrap": before joining at all. Rank 0 reports the exception it got and how long the
    failing call took."""
    env = m.launch_env()
    if when == "bootstrap":
        if env.rank == 1:
            os._exit(3)
        t0 = time.monotonic()
        try:
            m.Communicator.from_env()
        except m.MscclppError as e:
            print(f"RESULT {type(e).__name__} {e.code.name} {time.monotonic() - t0:.1f}s: {e}")
            return
        raise AssertionError("the communicator formed without rank 1")
    with m.Communicator.from_env() as comm:
        buf = np.zeros(4096, dtype=np.uint8)
        conn = comm.connect(1 - comm.rank, buf, transport=transport)
        with comm.proxy():
            comm.barrier()
            if comm.rank == 1:
                os._exit(3)
            t0 = time.monotonic()
            try:
                conn.wait()
            except m.MscclppError as e:
                print(f"RESULT {type(e).__name__} {e.code.name} {time.monotonic() - t0:.1f}s: {e}")
                comm.close()  # proxy stop + destroy must not hang either
                print(f"closed after {time.monotonic() - t0:.1f}s")
                return
    raise AssertionError("wait() returned although the peer died")


def _running_pair(transport: str) -> tuple[m.Communicator, m.Connection]:
    """Two ranks' communicator, each connected to the other over 4 KiB, set up, proxies
    running, past a barrier."""
    comm = m.Communicator.from_env()
    buf = np.zeros(4096, dtype=np.uint8)
    conn = comm.connect(1 - comm.rank, buf, transport=transport)
    comm.setup()
    comm.launch_proxy()
    comm.barrier()
    return comm, conn


def _quiet_close(comm: m.Communicator) -> None:
    """Stop and close, whatever they say (after a test that failed the communicator)."""
    import contextlib

    with contextlib.suppress(m.MscclppError):
        comm.stop_proxy()
    with contextlib.suppress(m.MscclppError):
        comm.close()


def dropped(transport: str) -> None:
    """A communicator whose connections the user still holds is destroyed as soon as its last
    reference goes, once, on this thread; the kept connection then says so."""
    import weakref

    from calls import count_calls

    calls, _ = count_calls()
    comm = m.Communicator.from_env()
    buf = np.zeros(4096, dtype=np.uint8)
    conn = comm.connect(1 - comm.rank, buf, transport=transport)
    comm.setup()
    comm.barrier()
    ref = weakref.ref(comm)
    del comm  # no gc.collect(): reference counting alone
    assert ref() is None, "the communicator outlived its last reference (a reference cycle?)"
    assert calls.count("mscclppCommDestroy") == 1, calls
    try:
        conn.put(0, 8)
    except m.InvalidUsageError as e:
        assert "is gone" in e.message, e
    else:
        raise AssertionError("a put on a destroyed communicator's connection did not raise")
    import gc

    gc.collect()
    assert calls.count("mscclppCommDestroy") == 1, calls
    print(f"rank {m.launch_env().rank}: dropped communicator destroyed at once, once")


def close_while_waiting(transport: str) -> None:
    """Rank 0 closes its communicator while another of its threads waits on a connection: the
    wait ends with an error well before the wait timeout, and close returns."""
    import threading

    comm, conn = _running_pair(transport)
    if comm.rank == 1:
        # Rank 0 closes meanwhile; what our own stop and close then say does not matter here.
        time.sleep(3)
        _quiet_close(comm)
        return
    ended: list[object] = []

    def waiter() -> None:
        t0 = time.monotonic()
        try:
            conn.wait()
            ended.append("returned")
        except m.MscclppError as e:
            ended.append((type(e).__name__, round(time.monotonic() - t0, 1)))

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    comm.close()
    t.join(30)
    assert not t.is_alive(), "the wait did not end after close()"
    print(f"RESULT closed {time.monotonic() - t0:.1f}s, the wait: {ended}")
    assert ended and ended[0] != "returned", ended


def wait_timeout(transport: str) -> None:
    """Rank 0 waits for a signal that never comes (MSCCLPP_WAIT_TIMEOUT set small by the test):
    the error is a TimeoutError as well as a RemoteError."""
    comm, conn = _running_pair(transport)
    if comm.rank == 0:
        t0 = time.monotonic()
        try:
            conn.wait()
        except TimeoutError as e:
            assert isinstance(e, m.RemoteError) and isinstance(e, m.MscclppTimeoutError), repr(e)
            assert e.code == m.Result.REMOTE_ERROR and "timed out after" in e.message, e.message
            print(f"RESULT timeout {time.monotonic() - t0:.1f}s: {e}")
        else:
            raise AssertionError("wait() returned without a signal")
    comm.barrier()  # rank 1 stays until rank 0's wait has ended
    _quiet_close(comm)


def from_torch(port: str) -> None:
    """Communicators from torch.distributed process groups (gloo, on CPU): the whole job, and
    a group of ranks 1.. (its rank 0 is global rank 1, the broadcast's source)."""
    import torch.distributed as dist

    env = m.launch_env()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=env.rank, world_size=env.nranks)
    try:
        with m.Communicator.from_torch() as comm:
            assert (comm.rank, comm.size) == (env.rank, env.nranks), comm
            assert comm.all_gather(bytes([comm.rank]) * 3) == [bytes([r]) * 3 for r in range(comm.size)]
        tail = dist.new_group(list(range(1, env.nranks)))  # collective: every rank calls it
        if env.rank >= 1:
            with m.Communicator.from_torch(tail) as comm:
                assert (comm.rank, comm.size) == (env.rank - 1, env.nranks - 1), comm
                got = comm.all_gather(bytes([env.rank]))
                assert got == [bytes([r]) for r in range(1, env.nranks)], got
    finally:
        dist.destroy_process_group()
    print(f"rank {env.rank}: from_torch ok")


def from_mpi() -> None:
    """A communicator from mpi4py's COMM_WORLD (run under mpiexec)."""
    from mpi4py import MPI

    with m.Communicator.from_mpi() as comm:
        w = MPI.COMM_WORLD
        assert (comm.rank, comm.size) == (w.Get_rank(), w.Get_size()), comm
        assert comm.all_gather(bytes([comm.rank])) == [bytes([r]) for r in range(comm.size)]
    print(f"rank {w.Get_rank()}: from_mpi ok")


def async_text(transport: str) -> None:
    """Rank 0 puts past rank 1's buffer: its proxy refuses it, and async_error() carries the
    library's text for that, not only the code."""
    comm, conn = _running_pair(transport)
    if comm.rank == 0:
        conn.put(4000, 200)  # accepted here; the proxy checks the peer's range
        try:
            conn.flush()
        except m.RemoteError:
            pass
        e = comm.async_error()
        assert isinstance(e, m.InvalidArgumentError) and "put refused" in e.message, repr(e)
        print(f"RESULT async_error: {e}")
    else:
        deadline = time.monotonic() + 20
        while comm.async_error() is None:  # the peer's abort arrives in milliseconds
            assert time.monotonic() < deadline, "rank 0's abort never arrived"
            time.sleep(0.01)
    _quiet_close(comm)


def _failed_wait(conn: m.Connection) -> str:
    """A wait for a signal that never comes, which must end with an error: "Error after S s"."""
    t0 = time.monotonic()
    try:
        conn.wait()
    except m.MscclppError as e:
        return f"{type(e).__name__} after {time.monotonic() - t0:.1f}s"
    raise AssertionError("wait() returned without a signal")


def _interrupt_self_after(seconds: float) -> None:
    """SIGINT to this process in ``seconds`` (as Ctrl-C in its terminal sends it), from a
    thread, while the main thread is inside a library call. Python's own SIGINT handler
    first, as a Python started from a terminal has it: one started in the background by a
    non-interactive shell (`cmd &`, as CI may run us) inherits SIGINT ignored, and never
    raises KeyboardInterrupt, library or not."""
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT)).start()


def interrupt_wait(transport: str) -> None:
    """Ctrl-C while rank 0's main thread waits for a signal that never comes: KeyboardInterrupt
    at once (not at the wait timeout), the communicator aborted; rank 1 then sees its peer
    go (its own wait ends with an error, not a hang)."""
    comm, conn = _running_pair(transport)
    if comm.rank == 1:
        print(f"RESULT peer {_failed_wait(conn)}")
        _quiet_close(comm)
        return
    _interrupt_self_after(1.0)
    t0 = time.monotonic()
    try:
        conn.wait()
    except KeyboardInterrupt as e:
        took = time.monotonic() - t0
        notes = getattr(e, "__notes__", [])
        assert sys.version_info < (3, 11) or any("was aborted" in x for x in notes), notes
    else:
        raise AssertionError("wait() returned without a signal")
    assert comm.closed and comm.aborted == "Ctrl-C interrupted wait()", comm.aborted
    try:
        comm.barrier()
    except m.InvalidUsageError as e:
        assert "aborted (Ctrl-C interrupted wait())" in e.message, e.message
    else:
        raise AssertionError("a call on an aborted communicator did not raise")
    print(f"RESULT interrupted {took:.1f}s")


def _await_destroy(calls: list[str]) -> None:
    """Until the package has called mscclppCommDestroy (an aborted communicator is destroyed by
    the last call to leave the library, on its thread), 20 s at most."""
    deadline = time.monotonic() + 20
    while calls.count("mscclppCommDestroy") == 0:
        assert time.monotonic() < deadline, "the aborted communicator was never destroyed"
        time.sleep(0.01)


def abort_calls(transport: str) -> None:
    """abort() from another thread: a wait of the main thread ends with an error, a barrier
    that holds the communicator does not hold up abort(), and the communicator is destroyed
    once, by the last call to leave."""
    import threading

    from calls import count_calls

    calls, _ = count_calls()
    comm, conn = _running_pair(transport)
    if comm.rank == 1:
        # Not a wait: a peer's destroy (abort's included) does not end its peers' waits
        # before their wait timeout; only its process's exit does (interrupt_wait).
        time.sleep(3)
        _quiet_close(comm)
        return
    t = threading.Timer(0.5, comm.abort)
    t.start()
    print(f"RESULT wait ended by abort(): {_failed_wait(conn)}")
    t.join()
    _await_destroy(calls)  # the stop's thread leaves last
    comm.abort()  # again: nothing
    comm.close()
    assert calls.count("mscclppCommDestroy") == 1, calls

    # With nothing inside the library, abort() destroys it (on a thread of its own).
    solo = m.Communicator(m.unique_id(), 0, 1)
    calls.clear()
    solo.abort()
    _await_destroy(calls)  # by abort()'s own thread
    assert calls.count("mscclppCommDestroy") == 1, calls
    print("RESULT abort ok")


def abort_barrier(transport: str) -> None:
    """Rank 0's main thread is in a barrier that rank 1 never enters (it holds the library's
    lock of the communicator until the bootstrap timeout, 3 s here): abort() from another
    thread returns at once all the same, and the communicator is destroyed once the barrier
    has left."""
    import threading

    from calls import count_calls

    calls, _ = count_calls()
    comm, _conn = _running_pair(transport)
    if comm.rank == 1:
        time.sleep(6)  # past rank 0's barrier timeout
        _quiet_close(comm)
        return
    took: list[float] = []

    def abort() -> None:
        t0 = time.monotonic()
        comm.abort()
        took.append(time.monotonic() - t0)

    t = threading.Timer(0.5, abort)
    t.start()
    try:
        comm.barrier()
    except m.MscclppError as e:
        print(f"RESULT barrier ended: {type(e).__name__}")
    else:
        raise AssertionError("a barrier of one rank of two returned")
    t.join()
    print(f"RESULT abort took {took[0]:.2f}s")
    _await_destroy(calls)
    assert calls.count("mscclppCommDestroy") == 1, calls


def interrupt_bootstrap(port: str) -> None:
    """Ctrl-C while rank 0 waits at creation for a rank that never comes."""
    _interrupt_self_after(1.0)
    t0 = time.monotonic()
    try:
        m.Communicator(f"127.0.0.1:{port}", 0, 2)
    except KeyboardInterrupt:
        print(f"RESULT interrupted {time.monotonic() - t0:.1f}s")
    else:
        raise AssertionError("a communicator of 2 was made by one rank")


SCENARIOS = {
    "interrupt_wait": interrupt_wait,
    "interrupt_bootstrap": interrupt_bootstrap,
    "abort_calls": abort_calls,
    "unregister": unregister,
    "abort_barrier": abort_barrier,
    "async_text": async_text,
    "from_torch": from_torch,
    "from_mpi": from_mpi,
    "wait_timeout": wait_timeout,
    "dropped": dropped,
    "close_while_waiting": close_while_waiting,
    "allgather": allgather,
    "put_signal_split": put_signal_split,
    "bootstrap": bootstrap,
    "registered_write": registered_write,
    "dead_peer": dead_peer,
}

if __name__ == "__main__":
    try:
        SCENARIOS[sys.argv[1]](*sys.argv[2:])
    except BaseException as e:  # noqa: BLE001: the harness reads the reason from stdout
        import traceback

        traceback.print_exc(file=sys.stdout)
        print(f"FAILED: {type(e).__name__}: {e}")
        sys.exit(1)
