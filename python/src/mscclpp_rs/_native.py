"""Loading libmscclpp.so and calling it: the only module that touches ctypes function pointers.

Every C function is declared once here with its argument and result types, and every call goes
through :func:`call`, which turns a result other than ``mscclppSuccess`` into the exception of
that code carrying the library's own text (``mscclppGetLastError``, read on the calling thread
right after the failing call: the library keeps it per thread). ctypes releases the GIL for the
whole foreign call, so a blocking call (a bootstrap collective, a host ``wait``) never stalls
the interpreter's other threads; each is bounded by the library's timeouts
(``MSCCLPP_BOOTSTRAP_TIMEOUT``, ``MSCCLPP_WAIT_TIMEOUT``).
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import os
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

PACKAGE_DIR = Path(__file__).resolve().parent  # the Python files (and nvrtc/)


def _data_dir() -> Path:
    """The folder that holds what the build installed (lib/, include/): the package's own, or,
    in an editable install (``pip install -e``: scikit-build-core's redirect mode keeps the
    Python files in the source tree and installs the built ones into site-packages, and the
    package's ``__path__`` lists both), the first ``__path__`` entry that has the library."""
    pkg = sys.modules.get(__package__ or "")
    for entry in getattr(pkg, "__path__", None) or []:
        if (Path(entry) / "lib" / "libmscclpp.so.0").exists():
            return Path(entry).resolve()
    return PACKAGE_DIR


DATA_DIR = _data_dir()
LIB_DIR = DATA_DIR / "lib"
LIBRARY_PATH = LIB_DIR / "libmscclpp.so.0"
BUNDLED_LIBFABRIC_DIR = LIB_DIR / "libfabric"

UNIQUE_ID_BYTES = 128
# sizeof(mscclppDevConn_t): pinned by the ABI (static_assert in the header's tests, 2023 layout).
DEVCONN_BYTES = 80


class Result(enum.IntEnum):
    """``mscclppResult_t``: the library's result codes (values as in the 2023 header)."""

    SUCCESS = 0
    UNHANDLED_CUDA_ERROR = 1
    SYSTEM_ERROR = 2
    INTERNAL_ERROR = 3
    INVALID_ARGUMENT = 4
    INVALID_USAGE = 5
    REMOTE_ERROR = 6
    IN_PROGRESS = 7


class Transport(enum.IntEnum):
    """``mscclppTransport_t``: how a connection moves bytes.

    ``P2P``: CUDA IPC between GPUs of one host (GPU buffers). ``SHM``: libfabric's shared-memory
    provider (ranks of one host). ``IB``: libfabric's network providers (tcp, verbs, efa, cxi,
    ...; ``MSCCLPP_NET_PROVIDER`` picks one).
    """

    P2P = 0
    SHM = 1
    IB = 2


class MscclppError(Exception):
    """A failed library call.

    Attributes:
        code: the library's result code.
        message: the library's text for this failure (``mscclppGetLastError``), or ours for a
            misuse caught before any call.
        call: the C function (or Python method) that failed.
    """

    code: Result = Result.INTERNAL_ERROR

    def __init__(self, code: Result, message: str, call: str) -> None:
        self.code = code
        self.message = message
        self.call = call
        # The library's messages start with the C function's name already.
        text = message if message.startswith(call) else f"{call}: {message or 'failed'}"
        super().__init__(f"{text} [{code.name}]")


class UnhandledCudaError(MscclppError):
    """``mscclppUnhandledCudaError``: a CUDA driver call failed."""


class MscclppSystemError(MscclppError, OSError):
    """``mscclppSystemError``: a system or libfabric call failed."""


class InternalError(MscclppError):
    """``mscclppInternalError``: a bug in the library."""


class InvalidArgumentError(MscclppError, ValueError):
    """``mscclppInvalidArgument``: an argument the library (or this package) refused."""


class InvalidUsageError(MscclppError):
    """``mscclppInvalidUsage``: a call out of order (e.g. a host put before setup)."""


class RemoteError(MscclppError):
    """``mscclppRemoteError``: a peer failed, went away, or did not answer in time.

    Timeouts (bootstrap, waits, flushes) are reported with this code; the message says which.
    A call that itself ran out of time raises :class:`MscclppTimeoutError`, a subclass.
    """


class MscclppTimeoutError(RemoteError, TimeoutError):
    """A :class:`RemoteError` whose call ran out of its time (``MSCCLPP_WAIT_TIMEOUT`` for
    waits and flushes): also a built-in ``TimeoutError``, so ``except TimeoutError`` catches it.
    The library's text for it starts with "timed out after N ms"."""


class InProgressError(MscclppError):
    """``mscclppInProgress``."""


_ERRORS: dict[Result, type[MscclppError]] = {
    Result.UNHANDLED_CUDA_ERROR: UnhandledCudaError,
    Result.SYSTEM_ERROR: MscclppSystemError,
    Result.INTERNAL_ERROR: InternalError,
    Result.INVALID_ARGUMENT: InvalidArgumentError,
    Result.INVALID_USAGE: InvalidUsageError,
    Result.REMOTE_ERROR: RemoteError,
    Result.IN_PROGRESS: InProgressError,
}


def error(code: int, message: str, call: str) -> MscclppError:
    """The exception for result ``code`` (an unknown code gives a plain MscclppError)."""
    try:
        res = Result(code)
    except ValueError:
        return MscclppError(Result.INTERNAL_ERROR, f"unknown result code {code}: {message}", call)
    # The library's text is "<call>: <error>"; its timeout error reads "timed out after N ms: ..."
    # (src/error.rs, Error::Timeout).
    if res == Result.REMOTE_ERROR and message.removeprefix(f"{call}: ").startswith("timed out after "):
        return MscclppTimeoutError(res, message, call)
    return _ERRORS.get(res, MscclppError)(res, message, call)


# --- Loading ---------------------------------------------------------------------------------

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_keep: list[ctypes.CDLL] = []  # libraries loaded ahead of libmscclpp, kept for the process


def _load_bundled_libfabric() -> None:
    """Loads the libfabric.so.1 copied into the wheel and the libraries it needs, each by path.

    A library's NEEDED entry is matched against the sonames of libraries already loaded, so
    libmscclpp.so (and this libfabric) then use these copies without any RUNPATH. The copies
    are loaded dependencies first: a pass loads every one whose dependencies are in, until all
    are (at most one pass per library).
    """
    if not BUNDLED_LIBFABRIC_DIR.is_dir():
        raise ImportError(
            f"mscclpp_rs: no libfabric.so.1 on this system and none bundled in {BUNDLED_LIBFABRIC_DIR} "
            "(the wheel was built with MSCCLPP_PY_BUNDLE_LIBFABRIC=OFF): install libfabric "
            "(Debian/Ubuntu: apt-get install libfabric1)"
        )
    todo = sorted(p for p in BUNDLED_LIBFABRIC_DIR.iterdir() if ".so" in p.name)
    last: dict[str, str] = {}
    for _ in range(len(todo) + 1):
        if not todo:
            return
        left = []
        for path in todo:
            try:
                _keep.append(ctypes.CDLL(str(path)))
            except OSError as e:
                last[path.name] = str(e)
                left.append(path)
        if len(left) == len(todo):
            break
        todo = left
    raise ImportError(
        "mscclpp_rs: cannot load the bundled libfabric: "
        + "; ".join(f"{p.name}: {last.get(p.name, '?')}" for p in todo)
    )


# The libfabric API version the library asks for (FI_VERSION(1, 17), src/transport/net/
# fabric.rs): an older libfabric answers every fi_getinfo with -FI_ENOSYS ("Requested version
# is newer than library"), so every IB and SHM endpoint would fail.
LIBFABRIC_API = (1, 17)


def _load_system_libfabric() -> Optional[str]:
    """Loads the system's libfabric.so.1 if it is recent enough (kept for the process); else
    unloads it again and returns why not. Raises OSError when there is none."""
    probe = ctypes.CDLL("libfabric.so.1")
    fn = probe.fi_version
    fn.restype = ctypes.c_uint32
    fn.argtypes = []
    v = fn()
    got = (v >> 16, v & 0xFFFF)
    if got >= LIBFABRIC_API:
        _keep.append(probe)
        return None
    path = libfabric_path() or "libfabric.so.1"
    # Unloaded again, so that libmscclpp's NEEDED libfabric.so.1 is not bound to it (the
    # dynamic linker matches an already-loaded library by its soname).
    import _ctypes

    _ctypes.dlclose(probe._handle)
    return (
        f"the system libfabric {got[0]}.{got[1]} ({path}) is older than "
        f"{LIBFABRIC_API[0]}.{LIBFABRIC_API[1]}, which the library needs"
    )


# Signals whose handlers a library loaded with libfabric may replace (below), 1 to 31 less
# SIGKILL and SIGSTOP.
_SIGNALS = [s for s in range(1, 32) if s not in (9, 19)]


def _action(act: Any) -> tuple[bytes, int]:
    """What a struct sigaction says a signal does: its handler (the first word) and its flags
    (after the handler and the 128-byte mask, on x86-64 and arm64 glibc), less SA_RESTORER,
    which glibc adds to every action it installs."""
    flags = int.from_bytes(act.raw[136:140], sys.byteorder)
    return act.raw[:8], flags & ~0x04000000


@contextlib.contextmanager
def _signal_dispositions_kept() -> Iterator[None]:
    """Puts back every signal disposition that loading the libraries changed.

    Debian's libfabric1 is linked with libpsm-infinipath (its psm provider), whose library
    constructor installs handlers of its own for SIGINT, SIGTERM, SIGSEGV, SIGBUS, SIGILL and
    SIGABRT when it is loaded: they clean up and exit(1) (seen with strace, the handlers'
    address inside libinfinipath.so.4, 2026-11-29). Loaded into Python, it replaces Python's
    SIGINT handler, so that Ctrl-C ended the process with status 1 and no KeyboardInterrupt.
    A package must not change the interpreter's signal handling."""
    libc = ctypes.CDLL(None, use_errno=True)
    # struct sigaction is 152 bytes on x86-64 and arm64 glibc (_action reads it).
    before = {}
    for sig in _SIGNALS:
        act = ctypes.create_string_buffer(256)
        if libc.sigaction(sig, None, act) == 0:
            before[sig] = act
    try:
        yield
    finally:
        for sig, old in before.items():
            now = ctypes.create_string_buffer(256)
            if libc.sigaction(sig, None, now) == 0 and _action(now) != _action(old):
                libc.sigaction(sig, old, None)


def _load() -> ctypes.CDLL:
    with _signal_dispositions_kept():
        return _load_unguarded()


def _load_unguarded() -> ctypes.CDLL:
    mode = os.environ.get("MSCCLPP_PY_LIBFABRIC", "auto")
    if mode not in ("auto", "system", "bundled"):
        raise ImportError(f"MSCCLPP_PY_LIBFABRIC={mode!r}: expected auto, system or bundled")
    if not LIBRARY_PATH.exists():
        raise ImportError(
            f"mscclpp_rs: {LIBRARY_PATH} is missing: install the package with "
            "`pip install ./python` from the repository (or a wheel built from it)"
        )
    why_not: Optional[str] = None  # why the system's libfabric is not used
    if mode != "bundled":
        try:
            why_not = _load_system_libfabric()
        except OSError as e:
            why_not = str(e)
        if why_not is not None and mode == "system":
            raise ImportError(f"mscclpp_rs: MSCCLPP_PY_LIBFABRIC=system: {why_not}")
        if why_not is not None and BUNDLED_LIBFABRIC_DIR.is_dir():
            warnings.warn(f"mscclpp_rs: {why_not}: loading the bundled libfabric", RuntimeWarning, stacklevel=2)
    if mode == "bundled" or why_not is not None:
        _load_bundled_libfabric()
    lib = ctypes.CDLL(str(LIBRARY_PATH))
    _declare(lib)
    return lib


def lib() -> ctypes.CDLL:
    """The loaded library (loaded, with libfabric, on first use)."""
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                _lib = _load()
    return _lib


def libfabric_path() -> Optional[str]:
    """Path of the libfabric.so.1 this process has loaded (None before the library is loaded)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if path.endswith("/libfabric.so.1") or "/libfabric.so.1." in path:
                    return path
    except OSError:
        return None
    return None


# --- Declarations ----------------------------------------------------------------------------

c_int = ctypes.c_int
c_u64 = ctypes.c_uint64
c_voidp = ctypes.c_void_p
c_charp = ctypes.c_char_p


class UniqueIdStruct(ctypes.Structure):
    """``mscclppUniqueId``, passed by value to mscclppCommInitRankFromId."""

    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


class RegisteredMemoryStruct(ctypes.Structure):
    """``mscclppRegisteredMemory``."""

    _fields_ = [("handle", c_u64)]


_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "mscclppGetUniqueId": (c_int, [ctypes.POINTER(UniqueIdStruct)]),
    "mscclppCommInitRank": (c_int, [ctypes.POINTER(c_voidp), c_int, c_charp, c_int]),
    "mscclppCommInitRankFromId": (c_int, [ctypes.POINTER(c_voidp), c_int, UniqueIdStruct, c_int]),
    "mscclppBootstrapAllGather": (c_int, [c_voidp, c_voidp, c_int]),
    "mscclppBootstrapBarrier": (c_int, [c_voidp]),
    "mscclppCommDestroy": (c_int, [c_voidp]),
    "mscclppCommRank": (c_int, [c_voidp, ctypes.POINTER(c_int)]),
    "mscclppCommSize": (c_int, [c_voidp, ctypes.POINTER(c_int)]),
    "mscclppSetBootstrapConnTimeout": (c_int, [c_int]),
    "mscclppGetVersion": (c_int, [ctypes.POINTER(c_int)]),
    "mscclppGetLastError": (c_charp, []),
    "mscclppGetErrorString": (c_charp, [c_int]),
    "mscclppCommGetAsyncError": (c_int, [c_voidp, ctypes.POINTER(c_int)]),
    "mscclppConnect": (c_int, [c_voidp, c_int, c_int, c_voidp, c_u64, c_int, c_charp]),
    "mscclppConnectionSetup": (c_int, [c_voidp]),
    "mscclppGetAllDeviceConnections": (c_int, [c_voidp, ctypes.POINTER(c_voidp), ctypes.POINTER(c_int)]),
    "mscclppGetDeviceConnection": (c_int, [c_voidp, c_int, c_int, ctypes.POINTER(c_voidp)]),
    "mscclppProxyLaunch": (c_int, [c_voidp]),
    "mscclppProxyStop": (c_int, [c_voidp]),
    "mscclppDevConnPut": (c_int, [c_voidp, c_u64, c_u64, c_u64]),
    "mscclppDevConnSignal": (c_int, [c_voidp]),
    "mscclppDevConnPutWithSignal": (c_int, [c_voidp, c_u64, c_u64, c_u64]),
    "mscclppDevConnPutWithSignalAndFlush": (c_int, [c_voidp, c_u64, c_u64, c_u64]),
    "mscclppDevConnFlush": (c_int, [c_voidp]),
    "mscclppDevConnWait": (c_int, [c_voidp]),
    "mscclppRegisterBuffer": (c_int, [c_voidp, c_voidp, ctypes.c_size_t, ctypes.POINTER(RegisteredMemoryStruct)]),
    "mscclppUnregisterBuffer": (c_int, [c_voidp, ctypes.POINTER(RegisteredMemoryStruct)]),
    "mscclppRegisteredBufferWrite": (
        c_int,
        [
            c_voidp,
            ctypes.POINTER(RegisteredMemoryStruct),
            c_voidp,
            ctypes.c_size_t,
            ctypes.c_uint32,
            ctypes.c_uint32,
            ctypes.c_int64,
        ],
    ),
}


def _declare(lib: ctypes.CDLL) -> None:
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


def last_error() -> str:
    """This thread's last failure text from the library ("" if none)."""
    raw = lib().mscclppGetLastError()
    return raw.decode("utf-8", errors="replace") if raw else ""


def call(name: str, *args: Any) -> None:
    """Calls C function ``name``; raises the exception of its result code unless it succeeded."""
    fn: Callable[..., int] = getattr(lib(), name)
    rc = fn(*args)
    if rc != 0:
        raise error(rc, last_error(), name)
