"""Single-process tests: arguments, errors, buffers, launcher variables, paths and flags."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import free_port

import mscclpp_rs as m


@pytest.fixture
def comm1():
    """A one-rank communicator on a free loopback port."""
    with m.Communicator(f"127.0.0.1:{free_port()}", 0, 1) as c:
        yield c


def test_version_and_unique_id() -> None:
    assert m.version() == 100  # 0.1.0
    uid = m.unique_id()
    assert isinstance(uid, m.UniqueId) and len(uid) == 128
    assert m.unique_id() != uid  # a fresh magic each time


def test_errors_carry_code_and_library_message() -> None:
    with pytest.raises(m.InvalidArgumentError) as e:
        m.Communicator(f"127.0.0.1:{free_port()}", 2, 2)
    assert e.value.code == m.Result.INVALID_ARGUMENT
    assert e.value.call == "mscclppCommInitRank"
    assert "rank 2 is outside [0, 2)" in e.value.message  # the library's own text
    assert isinstance(e.value, ValueError) and isinstance(e.value, m.MscclppError)
    with pytest.raises(m.InvalidArgumentError, match="missing :port"):
        m.Communicator("nonsense", 0, 1)
    with pytest.raises(m.InvalidArgumentError, match="must be > 0"):
        m.set_bootstrap_timeout(0)
    with pytest.raises(m.InvalidArgumentError, match="128 bytes"):
        m.Communicator(b"short", 0, 1)
    with pytest.raises(TypeError):
        m.Communicator(42, 0, 1)  # type: ignore[arg-type]


def test_connect_bad_arguments(comm1) -> None:
    buf = np.zeros(64, np.uint8)
    with pytest.raises(m.InvalidArgumentError, match="not another rank") as e:
        comm1.connect(0, buf)  # itself
    assert e.value.call == "mscclppConnect"
    with pytest.raises(m.InvalidArgumentError, match="not another rank"):
        comm1.connect(5, buf)
    with pytest.raises(m.InvalidArgumentError, match="read-only"):
        comm1.connect(0, b"abc")
    with pytest.raises(m.InvalidArgumentError, match="contiguous"):
        comm1.connect(0, buf[::2])
    with pytest.raises(TypeError, match="not a buffer"):
        comm1.connect(0, 42)
    with pytest.raises(m.InvalidArgumentError, match="transport 'x'"):
        comm1.connect(0, buf, transport="x")
    with pytest.raises(m.InvalidArgumentError, match="transport 7"):
        comm1.connect(0, buf, transport=7)
    with pytest.raises(m.InvalidArgumentError, match="out of range"):
        comm1.connect(0, buf, nbytes=65)
    with pytest.raises(m.InvalidArgumentError, match="out of range"):
        comm1.connect(1 << 40, buf)


def test_closed_communicator_and_unset_connection(comm1) -> None:
    conn = m.Connection(comm1, 1, 0, m.as_buffer(bytearray(8)), m.Transport.IB, None)
    with pytest.raises(m.InvalidUsageError, match="not set up") as e:
        conn.put(0, 8)
    assert e.value.code == m.Result.INVALID_USAGE
    with pytest.raises(m.InvalidArgumentError, match="offset = -1"):
        conn.put(-1, 8)
    # C and CUDA order (dst, src, size) does not silently mean (dst, size, src) here.
    for method in (conn.put, conn.put_with_signal, conn.put_with_signal_and_flush):
        with pytest.raises(TypeError, match="positional"):
            method(0, 4096, 1024)  # type: ignore[misc]
    with pytest.raises(m.InvalidUsageError, match="not set up"):
        conn.put(0, 8, src_offset=4)
    comm1.close()
    comm1.close()  # idempotent
    assert comm1.closed
    with pytest.raises(m.InvalidUsageError, match="closed"):
        comm1.barrier()
    with pytest.raises(m.InvalidUsageError, match="closed"):
        conn.wait()


@pytest.fixture
def calls():
    """The names of the package's C calls during the test."""
    from calls import count_calls

    names, restore = count_calls()
    try:
        yield names
    finally:
        restore()


def test_device_connections_keep_their_communicator(calls) -> None:
    import weakref

    comm = m.Communicator(f"127.0.0.1:{free_port()}", 0, 1)
    comm.setup()
    dc = comm.device_connections()
    ref = weakref.ref(comm)
    del comm
    assert ref() is not None and dc.communicator is ref(), "DeviceConnections let its communicator go"
    assert calls.count("mscclppCommDestroy") == 0
    del dc
    assert ref() is None and calls.count("mscclppCommDestroy") == 1


def test_fork_child_neither_uses_nor_destroys(calls) -> None:
    comm = m.Communicator(f"127.0.0.1:{free_port()}", 0, 1)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's handlers
        ok = 0
        try:
            try:
                comm.barrier()
            except m.InvalidUsageError as e:
                ok = "fork child" in e.message
            comm.close()
            del comm
            import gc

            gc.collect()
            ok = ok and calls.count("mscclppCommDestroy") == 0 and "mscclppBootstrapBarrier" not in calls
        finally:
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.waitpid(pid, 0)
    assert got == b"1", "the fork child used or destroyed its parent's communicator"
    comm.barrier()  # still the parent's, intact
    comm.close()
    assert calls.count("mscclppCommDestroy") == 1


def test_loading_keeps_the_signal_handlers() -> None:
    # Debian's libfabric loads libpsm-infinipath, whose constructor replaces the handlers of
    # SIGINT, SIGTERM, SIGSEGV, ... with its own (exit(1)): the package puts them back, so that
    # Ctrl-C is still Python's KeyboardInterrupt. A fresh interpreter: loading happens once.
    code = """
import ctypes, signal, sys
# Python's handler, as a Python started from a terminal has it (one started in the background
# by a non-interactive shell inherits SIGINT ignored).
signal.signal(signal.SIGINT, signal.default_int_handler)
import mscclpp_rs as m
libc = ctypes.CDLL(None)
def handler(sig):
    a = ctypes.create_string_buffer(256)
    assert libc.sigaction(sig, None, a) == 0
    return a.raw[:8]
sigs = [signal.SIGINT, signal.SIGTERM, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGABRT]
before = [handler(s) for s in sigs]
m.version()  # loads the library and libfabric
after = [handler(s) for s in sigs]
changed = [s.name for s, b, a in zip(sigs, before, after) if b != a]
assert not changed, f"loading the library changed the handlers of {changed}"
assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
print("kept")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "kept" in out.stdout, out.stdout + out.stderr


def test_stream_arguments() -> None:
    from mscclpp_rs._comm import _stream_handle

    class Torchish:
        cuda_stream = 0x7F00

    class Protocol:
        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, 0x7F10)

    assert _stream_handle(Torchish(), "write") == 0x7F00
    assert _stream_handle(Protocol(), "write") == 0x7F10
    assert _stream_handle(2, "write") == 2
    with pytest.raises(TypeError, match="torch.cuda.Stream"):
        _stream_handle("s1", "write")
    # A CUDA array's producer stream (__cuda_array_interface__ v3) is kept with the buffer.
    assert m.as_buffer(_CAI(0x1000, (4,), "|u1")).stream is None
    cai = _CAI(0x1000, (4,), "|u1")
    cai.__cuda_array_interface__["stream"] = 2
    assert m.as_buffer(cai).stream == 2


def test_one_rank_collectives(comm1) -> None:
    assert (comm1.rank, comm1.size) == (0, 1)
    assert comm1.all_gather(b"abc") == [b"abc"]
    comm1.barrier()
    comm1.setup()  # no connections: nothing to do
    assert len(comm1.device_connections()) == 0
    with comm1.proxy():
        pass
    assert comm1.async_error() is None


class _CAI:
    def __init__(self, address: int, shape, typestr: str, strides=None, readonly=False) -> None:
        self.__cuda_array_interface__ = {
            "data": (address, readonly),
            "shape": shape,
            "typestr": typestr,
            "strides": strides,
            "version": 3,
        }


class _OnlyDLPack:
    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr

    def __dlpack__(self, *args, **kwargs):
        return self.arr.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()


def test_buffers_hash_and_compare_by_region() -> None:
    a = np.zeros(64, dtype=np.uint8)
    b1, b2 = m.as_buffer(a), m.as_buffer(a)
    assert b1 == b2 and hash(b1) == hash(b2)  # a NumPy owner is not hashable
    assert m.as_buffer(a[:32]) != b1


def test_buffers_from_every_protocol() -> None:
    arr = np.zeros((4, 8), np.float32)
    b = m.as_buffer(arr)
    assert (b.address, b.nbytes, b.kind, b.device) == (arr.ctypes.data, 128, "buffer", "cpu")
    ba = bytearray(100)
    assert m.as_buffer(ba).address == ctypes.addressof(ctypes.c_char.from_buffer(ba))
    view = memoryview(ba)[10:30]
    assert m.as_buffer(view).nbytes == 20
    assert m.as_buffer(view).address == m.as_buffer(ba).address + 10
    d = m.as_buffer(_OnlyDLPack(arr[1:]))
    assert (d.address, d.nbytes, d.kind, d.device) == (arr.ctypes.data + 32, 96, "dlpack", "cpu")
    with pytest.raises(m.InvalidArgumentError, match="contiguous"):
        m.as_buffer(_OnlyDLPack(arr[:, ::2]))
    c = m.as_buffer(_CAI(0x7000_0000_0000, (3, 5), "<f8"))
    assert (c.address, c.nbytes, c.kind, c.device) == (0x7000_0000_0000, 120, "cuda_array_interface", "cuda")
    assert m.as_buffer(_CAI(0x1000, (3, 5), "<f8", strides=(40, 8))).nbytes == 120
    with pytest.raises(m.InvalidArgumentError, match="contiguous"):
        m.as_buffer(_CAI(0x1000, (3, 5), "<f8", strides=(80, 16)))
    with pytest.raises(m.InvalidArgumentError, match="read-only"):
        m.as_buffer(_CAI(0x1000, (3,), "<f8", readonly=True))
    assert m.as_buffer((0x1234, 10)).nbytes == 10
    with pytest.raises(m.InvalidArgumentError):
        m.as_buffer((-1, 10))


def test_launch_env() -> None:
    e = m.launch_env(
        environ={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"}
    )
    assert e == m.LaunchEnv(1, 2, 1, "10.1.2.3:29501", "torchrun")
    e = m.launch_env(environ={"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "MSCCLPP_ROOT": "h:5"})
    assert e == m.LaunchEnv(3, 4, 3, "h:5", "mpirun")
    e = m.launch_env(
        "a:1", environ={"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0", "MSCCLPP_ROOT": "ignored:2"}
    )
    assert e == m.LaunchEnv(0, 8, 0, "a:1", "Slurm")
    # The first launcher in launch_env.h's order wins.
    e = m.launch_env(
        environ={"MSCCLPP_RANK": "0", "MSCCLPP_NRANKS": "2", "RANK": "5", "WORLD_SIZE": "9", "MSCCLPP_ROOT": "r:1"}
    )
    assert (e.rank, e.nranks, e.source) == (0, 2, "MSCCLPP_RANK/MSCCLPP_NRANKS")
    # torchrun inside Slurm (srun torchrun, or an sbatch script that runs torchrun): every worker
    # also inherits the Slurm task's variables; torchrun's, the innermost, win.
    slurm_torchrun = {
        "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
        "RANK": "13", "WORLD_SIZE": "16", "LOCAL_RANK": "5", "TORCHELASTIC_RUN_ID": "job7",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
    }
    assert m.launch_env(environ=slurm_torchrun) == m.LaunchEnv(13, 16, 5, "10.0.0.1:29501", "torchrun")
    # Without torchrun's marker, RANK/WORLD_SIZE are names other tools set too: Slurm's win.
    del slurm_torchrun["TORCHELASTIC_RUN_ID"]
    assert (m.launch_env(environ=slurm_torchrun).rank, m.launch_env(environ=slurm_torchrun).source) == (1, "Slurm")
    assert (
        m.launch_env(environ={"PMI_RANK": "1", "PMI_SIZE": "2", "MASTER_ADDR": "::1", "MASTER_PORT": "7"}).root
        == "[::1]:8"
    )
    with pytest.raises(ValueError, match="no launcher"):
        m.launch_env(environ={})
    with pytest.raises(ValueError, match="rank < nranks"):
        m.launch_env(environ={"RANK": "2", "WORLD_SIZE": "2", "MSCCLPP_ROOT": "r:1"})
    with pytest.raises(ValueError, match="not a non-negative integer"):
        m.launch_env(environ={"RANK": "x", "WORLD_SIZE": "2", "MSCCLPP_ROOT": "r:1"})
    with pytest.raises(ValueError, match="no root address"):
        m.launch_env(environ={"RANK": "0", "WORLD_SIZE": "2"})


def test_paths_headers_and_flags(tmp_path: Path) -> None:
    inc = Path(m.include_dir())
    assert (inc / "mscclpp.h").is_file() and (inc / "mscclpp" / "devconn_methods.inc").is_file()
    assert Path(m.library_path()).is_file()
    assert m.compile_flags() == ["-I" + str(inc)]
    assert "--device-as-default-execution-space" in m.compile_flags("nvrtc")
    with pytest.raises(ValueError):
        m.compile_flags("clang")
    # Host C++ that includes the header and calls the library, built with the package's flags.
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = tmp_path / "v.cpp"
    src.write_text(
        "#include <mscclpp.h>\n#include <cstdio>\nint main(){int v=0;"
        "if(mscclppGetVersion(&v)!=mscclppSuccess) return 1;"
        'static_assert(sizeof(mscclppDevConn_t)==80,"");std::printf("%d\\n",v);}\n'
    )
    exe = tmp_path / "v"
    subprocess.run([cxx, "-std=c++17", *m.compile_flags(), str(src), "-o", str(exe), *m.link_flags()], check=True)
    assert subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.strip() == "100"


def test_kernel_source_compiles_with_nvcc(tmp_path: Path) -> None:
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc")
    if not nvcc:
        pytest.skip("no nvcc (set NVCC)")
    kernel = Path(__file__).resolve().parent.parent / "examples" / "allgather_kernel.cuh"
    src = tmp_path / "k.cu"
    src.write_text(f'#include "{kernel}"\n')
    subprocess.run([nvcc, "-arch=sm_90", *m.compile_flags(), "-c", str(src), "-o", str(tmp_path / "k.o")], check=True)


def _old_libfabric(tmp_path: Path) -> Path:
    """A directory holding a libfabric.so.1 whose fi_version() says 1.11 (Ubuntu 22.04's),
    built with the system's C compiler; skips where there is none."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a stand-in for an old libfabric")
    src = tmp_path / "old.c"
    src.write_text("unsigned fi_version(void) { return (1u << 16) | 11u; }\n")
    subprocess.run(
        [cc, "-shared", "-fPIC", "-Wl,-soname,libfabric.so.1", "-o", str(tmp_path / "libfabric.so.1"), str(src)],
        check=True,
    )
    return tmp_path


def test_old_system_libfabric_is_refused(tmp_path: Path) -> None:
    # libfabric 1.11 answers the library's FI_VERSION(1, 17) with -FI_ENOSYS on every endpoint.
    env = dict(os.environ, LD_LIBRARY_PATH=str(_old_libfabric(tmp_path)), MSCCLPP_PY_LIBFABRIC="system")
    code = "import mscclpp_rs as m; m.version()"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "libfabric 1.11" in out.stderr and "older than 1.17" in out.stderr, out.stderr


def test_old_system_libfabric_falls_back_to_the_bundled(tmp_path: Path) -> None:
    if not (Path(m.__file__).parent / "lib" / "libfabric").is_dir():
        pytest.skip("this install bundles no libfabric")
    env = dict(os.environ, LD_LIBRARY_PATH=str(_old_libfabric(tmp_path)), MSCCLPP_PY_LIBFABRIC="auto")
    code = "import mscclpp_rs as m; assert m.version() == 100; print(m.libfabric_path())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "/mscclpp_rs/lib/libfabric/" in out.stdout, out.stdout
    assert "older than 1.17" in out.stderr and "loading the bundled libfabric" in out.stderr, out.stderr


def test_bundled_libfabric_loads() -> None:
    # A process that takes the wheel's libfabric even where the system has one.
    code = (
        "import mscclpp_rs as m; p = m.libfabric_path(); print(p); "
        "assert p and '/mscclpp_rs/lib/libfabric/' in p, p; assert m.version() == 100"
    )
    env = dict(os.environ, MSCCLPP_PY_LIBFABRIC="bundled")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
