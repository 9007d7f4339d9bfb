"""Communicator, connections and device connections: thin objects over the C handles."""

from __future__ import annotations

import contextlib
import ctypes
import operator
import os
import struct
import sys
import threading
import warnings
import weakref
from typing import Any, Callable, Iterator, Optional, TypeVar, Union

from . import _interrupt
from . import _native as n
from ._buffer import Buffer, as_buffer
from ._launch import launch_env
from ._native import DEVCONN_BYTES, InvalidArgumentError, InvalidUsageError, MscclppError, Result, Transport

_U64_MAX = (1 << 64) - 1
_U32_MAX = (1 << 32) - 1
# How long close() waits for other threads' calls on the communicator to leave the library
# after its stop released their waits (a bootstrap call is bounded by the bootstrap timeout,
# 30 s by default); past it the communicator is leaked, with a warning, not freed under them.
_CALLS_LEAVE_S = 60.0
_T = TypeVar("_T")


def _stream_handle(stream: Any, call: str) -> int:
    """A ``cudaStream_t`` as an int from what users hold: an int, an object with the
    ``__cuda_stream__`` protocol (``(version, handle)``), a ``torch.cuda.Stream``
    (``.cuda_stream``) or a CuPy stream (``.ptr``)."""
    if hasattr(stream, "__cuda_stream__"):
        handle = stream.__cuda_stream__()[1]
    elif hasattr(stream, "cuda_stream"):
        handle = stream.cuda_stream
    elif hasattr(stream, "ptr") and not isinstance(stream, int):
        handle = stream.ptr
    else:
        handle = stream
    try:
        return _check_int("stream", handle, 2**63 - 1, call)
    except TypeError:
        raise TypeError(
            f"{call}: stream must be an int (a cudaStream_t), a torch.cuda.Stream, a CuPy stream or an "
            f"object with __cuda_stream__, not {type(stream).__name__}"
        ) from None


def _gone(what: str, call: str) -> InvalidUsageError:
    return InvalidUsageError(
        Result.INVALID_USAGE,
        f"the communicator of {what} is gone (its last reference was dropped, which destroyed it): "
        "keep the Communicator while its connections are used",
        call,
    )


def _check_int(name: str, value: Any, hi: int, call: str, lo: int = 0) -> int:
    """``value`` as an int in [lo, hi], else InvalidArgumentError (ctypes would wrap it)."""
    try:
        v = operator.index(value)  # ints and NumPy integers, not floats
    except TypeError:
        raise TypeError(f"{call}: {name} must be an int, not {type(value).__name__}") from None
    if not lo <= v <= hi:
        raise InvalidArgumentError(Result.INVALID_ARGUMENT, f"{name} = {v} is out of range [{lo}, {hi}]", call)
    return v


def _destroy_quietly(handle: Optional[int]) -> None:
    """``mscclppCommDestroy`` where nobody is left to hear its error (an aborted communicator,
    one made after its creation was interrupted)."""
    if handle:
        with contextlib.suppress(MscclppError):
            n.call("mscclppCommDestroy", handle)


class UniqueId(bytes):
    """The 128 bytes of an ``mscclppUniqueId``: rank 0's bootstrap address and a random magic.

    Made by :func:`unique_id` on the process that becomes rank 0; send ``bytes(uid)`` to every
    other rank by any means (a file, ``torch.distributed.broadcast_object_list``, MPI) and pass
    it (or those bytes) to :class:`Communicator`.
    """

    def __new__(cls, data: bytes) -> "UniqueId":
        data = bytes(data)
        if len(data) != n.UNIQUE_ID_BYTES:
            raise InvalidArgumentError(
                Result.INVALID_ARGUMENT, f"a unique id is {n.UNIQUE_ID_BYTES} bytes, got {len(data)}", "UniqueId"
            )
        return super().__new__(cls, data)


def unique_id() -> UniqueId:
    """A new unique id (``mscclppGetUniqueId``). The calling process's host becomes the root:
    rank 0 must run here. ``MSCCLPP_SOCKET_IFNAME`` picks the interface."""
    uid = n.UniqueIdStruct()
    n.call("mscclppGetUniqueId", ctypes.byref(uid))
    return UniqueId(ctypes.string_at(ctypes.addressof(uid), n.UNIQUE_ID_BYTES))


def version() -> int:
    """``MSCCLPP_VERSION`` of the loaded library (major * 10000 + minor * 100 + patch)."""
    v = ctypes.c_int()
    n.call("mscclppGetVersion", ctypes.byref(v))
    return v.value


def set_bootstrap_timeout(seconds: int) -> None:
    """Bounds every bootstrap connect, accept and receive of communicators created afterwards,
    process-wide (``mscclppSetBootstrapConnTimeout``; default 30 s or ``MSCCLPP_BOOTSTRAP_TIMEOUT``)."""
    n.call("mscclppSetBootstrapConnTimeout", _check_int("seconds", seconds, 2**31 - 1, "set_bootstrap_timeout"))


def _transport(value: Union[Transport, str, int]) -> Transport:
    if isinstance(value, str):
        try:
            return Transport[value.upper()]
        except KeyError:
            raise InvalidArgumentError(
                Result.INVALID_ARGUMENT, f"transport {value!r}: expected 'p2p', 'shm' or 'ib'", "connect"
            ) from None
    try:
        return Transport(value)
    except ValueError:
        raise InvalidArgumentError(
            Result.INVALID_ARGUMENT, f"transport {value!r}: expected Transport.P2P, SHM or IB", "connect"
        ) from None


class Connection:
    """One side of a connection to ``remote_rank`` over a local buffer (:meth:`Communicator.connect`).

    After setup (:meth:`Communicator.setup`, or entering :meth:`Communicator.proxy`), a host
    thread drives a connection over *host* memory with the methods below, as a kernel does with
    the device methods of ``mscclppDevConn_t``. Offsets are bytes into the two buffers; ``offset``
    is the destination's, ``src_offset`` (keyword-only; default: the same) the source's. Puts and signals
    need the proxies running (inside :meth:`Communicator.proxy`). Each call is bounded by
    ``MSCCLPP_WAIT_TIMEOUT`` where it waits and raises on a proxy error or a dead peer.
    """

    def __init__(
        self,
        comm: "Communicator",
        remote_rank: int,
        tag: int,
        buffer: Buffer,
        transport: Transport,
        ib_dev: Optional[str],
    ) -> None:
        # Weak: the communicator holds its connections, and a strong reference back would make
        # a cycle, so that only a garbage collection (at any time, on any thread) or the
        # interpreter's exit would destroy a dropped communicator.
        self._comm = weakref.ref(comm)
        self.remote_rank = remote_rank
        self.tag = tag
        self.buffer = buffer
        self.transport = transport
        self.ib_dev = ib_dev
        self._devconn: Optional[int] = None  # mscclppDevConn_t*, owned by the communicator

    def __repr__(self) -> str:
        state = "set up" if self._devconn else "declared"
        return (
            f"Connection(remote_rank={self.remote_rank}, tag={self.tag}, transport={self.transport.name}, "
            f"nbytes={self.buffer.nbytes}, {state})"
        )

    @property
    def nbytes(self) -> int:
        """Size of the local buffer of this connection."""
        return self.buffer.nbytes

    @property
    def comm(self) -> "Communicator":
        """The communicator (held weakly: it must be kept by its user while this is used)."""
        c = self._comm()
        if c is None:
            raise _gone(f"the connection to rank {self.remote_rank}", "connection")
        return c

    def _call(self, fn: str, call: str, *args: Any, blocking: bool = False) -> None:
        """``fn(devconn, *args)`` while the communicator is held open (see Communicator._use);
        a ``blocking`` one so that Ctrl-C interrupts it (see Communicator._blocking)."""

        def body(_h: int) -> None:
            if self._devconn is None:
                raise InvalidUsageError(
                    Result.INVALID_USAGE,
                    f"the connection to rank {self.remote_rank} (tag {self.tag}) is not set up: call "
                    "setup() (or enter proxy()) first",
                    call,
                )
            n.call(fn, self._devconn, *args)

        comm = self.comm
        if blocking:
            comm._blocking(call, body)
        else:
            with comm._use(call) as h:
                body(h)

    def _triple(self, offset: int, size: int, src_offset: Optional[int], call: str) -> tuple[int, int, int]:
        dst = _check_int("offset", offset, _U64_MAX, call)
        src = dst if src_offset is None else _check_int("src_offset", src_offset, _U64_MAX, call)
        return dst, src, _check_int("size", size, _U64_MAX, call)

    def put(self, offset: int, size: int, *, src_offset: Optional[int] = None) -> None:
        """Queues a copy of ``size`` bytes from the local buffer at ``src_offset`` to the peer's
        at ``offset`` (``mscclppDevConnPut``). Returns at once; the source must not change until
        :meth:`flush` returns.

        ``src_offset`` is keyword-only: C and CUDA take ``(dst, src, size)``, so a call ported
        from a kernel, ``put(0, 4096, 1024)``, raises TypeError here instead of moving 4096
        bytes from source offset 1024."""
        dst, src, size = self._triple(offset, size, src_offset, "put")
        self._call("mscclppDevConnPut", "put", dst, src, size)

    def signal(self) -> None:
        """The peer's next :meth:`wait` returns once every earlier put has arrived."""
        self._call("mscclppDevConnSignal", "signal")

    def put_with_signal(self, offset: int, size: int, *, src_offset: Optional[int] = None) -> None:
        """:meth:`put` then :meth:`signal`, in one trigger."""
        dst, src, size = self._triple(offset, size, src_offset, "put_with_signal")
        self._call("mscclppDevConnPutWithSignal", "put_with_signal", dst, src, size)

    def put_with_signal_and_flush(self, offset: int, size: int, *, src_offset: Optional[int] = None) -> None:
        """:meth:`put_with_signal`, then waits until both have completed."""
        dst, src, size = self._triple(offset, size, src_offset, "put_with_signal_and_flush")
        self._call(
            "mscclppDevConnPutWithSignalAndFlush", "put_with_signal_and_flush", dst, src, size, blocking=True
        )

    def flush(self) -> None:
        """Returns once every earlier put and signal on this connection has completed (the source
        may change again)."""
        self._call("mscclppDevConnFlush", "flush", blocking=True)

    def wait(self) -> None:
        """Waits for the peer's next signal; the data of every put before it is then readable.
        Consumes one signal per call: use one waiting thread per connection."""
        self._call("mscclppDevConnWait", "wait", blocking=True)


class DeviceConnections:
    """The ``mscclppDevConn_t`` array of a communicator, in :meth:`Communicator.connect` order:
    what a kernel needs to put, signal, flush and wait.

    ``bytes(dc)`` is the array (``len(dc) * 80`` bytes); :meth:`to_cupy` and :meth:`to_torch`
    copy it to GPU memory, where a kernel takes it as ``const mscclppDevConn_t*`` (or copy the
    bytes into a ``__constant__ mscclppDevConn_t conns[N]``). ``host_address`` is the library's
    own host array. The structs point into the communicator's memory (its FIFOs, epoch blocks,
    peers' mappings): this object keeps the communicator alive (``communicator``); copies made
    by :meth:`to_cupy` / :meth:`to_torch` do not, so keep this object (or the communicator)
    while a kernel uses them.
    """

    def __init__(
        self, data: bytes, host_address: int, remote_ranks: list[int], comm: Optional["Communicator"] = None
    ) -> None:
        self.data = data
        self.host_address = host_address
        self.remote_ranks = remote_ranks
        self._comm = comm  # strong: the structs are valid only while it lives

    @property
    def communicator(self) -> Optional["Communicator"]:
        """The communicator these connections belong to (kept alive by this object)."""
        return self._comm

    def __len__(self) -> int:
        return len(self.data) // DEVCONN_BYTES

    def __bytes__(self) -> bytes:
        return self.data

    @property
    def nbytes(self) -> int:
        """``len(self) * 80``."""
        return len(self.data)

    def __repr__(self) -> str:
        return f"DeviceConnections({len(self)} connections to ranks {self.remote_ranks})"

    def to_cupy(self) -> Any:
        """A CuPy ``uint8`` array on the current device holding the array."""
        import cupy  # optional dependency
        import numpy

        return cupy.asarray(numpy.frombuffer(self.data, dtype=numpy.uint8))

    def to_torch(self, device: Any = "cuda") -> Any:
        """A PyTorch ``uint8`` tensor on ``device`` holding the array."""
        import torch  # optional dependency

        return torch.frombuffer(bytearray(self.data), dtype=torch.uint8).to(device)


class RegisteredMemory:
    """A buffer registered with every connected peer (:meth:`Communicator.register_buffer`)."""

    def __init__(self, comm: "Communicator", buffer: Buffer, handle: n.RegisteredMemoryStruct) -> None:
        self._comm = weakref.ref(comm)  # weak, as Connection's
        self.buffer = buffer
        self._handle = handle

    @property
    def comm(self) -> "Communicator":
        """The communicator (held weakly, as a connection's)."""
        c = self._comm()
        if c is None:
            raise _gone("a registered buffer", "write")
        return c

    def write(
        self, src: Any, size: Optional[int] = None, src_offset: int = 0, dst_offset: int = 0, stream: Any = None
    ) -> None:
        """Writes ``size`` bytes (default: all of ``src`` from ``src_offset``) of ``src`` at
        ``src_offset`` to ``dst_offset`` of every connected peer's registered buffer, and returns
        once they arrived (``mscclppRegisteredBufferWrite``; for CUDA memory, work queued on
        ``stream`` completes first: a ``cudaStream_t`` as an int, a ``torch.cuda.Stream``, a
        CuPy stream or any object with ``__cuda_stream__``; by default the stream ``src``'s
        ``__cuda_array_interface__`` names, else the default stream). The peers' proxies must
        run."""
        buf = as_buffer(src)
        so = _check_int("src_offset", src_offset, _U32_MAX, "write")
        do = _check_int("dst_offset", dst_offset, _U32_MAX, "write")
        size = buf.nbytes - so if size is None else _check_int("size", size, _U64_MAX, "write")
        if so + size > buf.nbytes:
            raise InvalidArgumentError(
                Result.INVALID_ARGUMENT,
                f"src_offset {so} + size {size} is past the source's {buf.nbytes} bytes",
                "write",
            )
        st = _stream_handle(stream, "write") if stream is not None else (buf.stream or 0)
        self.comm._blocking(
            "write",
            lambda h: n.call(
                "mscclppRegisteredBufferWrite", h, ctypes.byref(self._handle), buf.address, size, so, do, st
            ),
        )

    def unregister(self) -> None:
        """Releases the registration on this rank and every connected peer
        (``mscclppUnregisterBuffer``; collective between the connected peers, each
        unregistering this same registration): when it returns, no peer writes into this
        buffer through it, the library holds nothing of it, and the buffer may be freed. A
        buffer that is also a connection's stays registered for the connection. Afterwards
        :meth:`write` and another ``unregister`` raise InvalidArgumentError. Bounded by the
        bootstrap timeout; on a failure (a peer unregistered another one, or none in time) the
        handle is dead all the same and the library keeps its registration until the
        communicator is destroyed."""
        comm = self.comm
        try:
            comm._blocking("unregister", lambda h: n.call("mscclppUnregisterBuffer", h, ctypes.byref(self._handle)))
        finally:
            # Dead either way (the library says so for a failed one too): the communicator no
            # longer keeps the buffer's owner alive, so that the memory can go.
            with contextlib.suppress(ValueError):
                comm._registered.remove(self)


Root = Union[str, bytes, UniqueId]


class Communicator:
    """A communicator of ``nranks`` processes (``mscclppComm_t``).

    Create it on every rank with the same root: an ``"ip:port"`` (``"[ipv6]:port"``,
    ``"host:port"``) where rank 0 listens, or a :class:`UniqueId` made by :func:`unique_id` on
    rank 0; or from the launcher's environment with :meth:`from_env`. Creation returns once
    every rank has joined, or raises within the bootstrap timeout.

    Use it as a context manager (or call :meth:`close`) to free it: that stops the proxies and
    frees every connection. Typical use::

        with Communicator.from_env() as comm:
            conns = [comm.connect(p, buf, transport="shm") for p in range(comm.size) if p != comm.rank]
            with comm.proxy():          # setup, proxy launch ... proxy stop
                ...                     # kernels with comm.device_connections(), or host puts

    Collective calls (creation, :meth:`all_gather`, :meth:`barrier`, :meth:`setup`,
    :meth:`register_buffer`) must be made in the same order on every rank, from one thread at a
    time. The library serialises calls on one communicator.
    """

    def __init__(self, root: Root, rank: int, nranks: int) -> None:
        rank = _check_int("rank", rank, 2**31 - 1, "Communicator", lo=-(2**31))
        nranks = _check_int("nranks", nranks, 2**31 - 1, "Communicator", lo=-(2**31))
        init: Callable[[], Optional[int]]
        if isinstance(root, str):
            addr = root.encode()

            def init() -> Optional[int]:
                handle = ctypes.c_void_p()
                n.call("mscclppCommInitRank", ctypes.byref(handle), nranks, addr, rank)
                return handle.value

        elif isinstance(root, (bytes, bytearray, memoryview)):
            uid = n.UniqueIdStruct()
            ctypes.memmove(ctypes.addressof(uid), UniqueId(bytes(root)), n.UNIQUE_ID_BYTES)

            def init() -> Optional[int]:
                handle = ctypes.c_void_p()
                n.call("mscclppCommInitRankFromId", ctypes.byref(handle), nranks, uid, rank)
                return handle.value

        else:
            raise TypeError(f"root must be an 'ip:port' str or a UniqueId, not {type(root).__name__}")
        # Returns once every rank joined: Ctrl-C ends the wait (nothing to abort yet), and a
        # communicator made after the interrupt after all is destroyed by the worker.
        self._handle: Optional[int] = _interrupt.call(init, lambda: None, late=_destroy_quietly)
        self._pid = os.getpid()  # a fork child must not destroy (or use) its parent's communicator
        self._lock = threading.Lock()
        # Calls inside the library on the handle now (_use); close() waits for them to leave.
        self._calls = 0
        self._idle = threading.Condition(self._lock)
        # Set by abort(): why later calls are refused, and the handle that the last call to
        # leave the library destroys.
        self._aborted: Optional[str] = None
        self._doomed: Optional[int] = None
        self._connections: list[Connection] = []
        self._pending: list[Connection] = []
        self._registered: list[RegisteredMemory] = []
        # Held by connect() and setup() for their whole call: a connection declared in C while
        # setup() runs would be set up there but dropped from _pending here, and stay "not set
        # up" for good.
        self._declare = threading.Lock()
        self.rank: int = self._query("mscclppCommRank")
        """This process's rank."""
        self.size: int = self._query("mscclppCommSize")
        """The number of ranks."""

    @classmethod
    def from_env(cls, root: Optional[str] = None) -> "Communicator":
        """A communicator from the launcher's environment (torchrun, mpirun, srun,
        scripts/run-local-ranks.sh): see :func:`launch_env` for the variables read."""
        env = launch_env(root)
        return cls(env.root, env.rank, env.nranks)

    @classmethod
    def from_torch(cls, group: Any = None) -> "Communicator":
        """A communicator of the ranks of a ``torch.distributed`` process group (default: the
        whole job), in the group's rank order, for a job whose process group is up already
        (``torch.distributed.init_process_group``, any backend): the group's rank 0 makes the
        unique id (:func:`unique_id`; its host becomes the bootstrap root) and the group
        broadcasts it (``broadcast_object_list``). Collective over the group."""
        import torch.distributed as dist  # optional dependency

        rank, size = dist.get_rank(group), dist.get_world_size(group)
        obj: list[Any] = [bytes(unique_id()) if rank == 0 else None]
        # The broadcast's source is a global rank: the group's rank 0's.
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(obj, src=src, group=group)
        return cls(UniqueId(obj[0]), rank, size)

    @classmethod
    def from_mpi(cls, comm: Any = None) -> "Communicator":
        """A communicator of the ranks of an mpi4py communicator (default ``MPI.COMM_WORLD``), in
        its rank order: its rank 0 makes the unique id and ``comm.bcast`` hands it to the
        others. Collective over ``comm``."""
        if comm is None:
            from mpi4py import MPI  # optional dependency

            comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
        uid = comm.bcast(bytes(unique_id()) if rank == 0 else None, root=0)
        return cls(UniqueId(uid), rank, size)

    def _query(self, name: str) -> int:
        v = ctypes.c_int()
        with self._use(name) as h:
            n.call(name, h, ctypes.byref(v))
        return v.value

    @contextlib.contextmanager
    def _use(self, call: str) -> Iterator[int]:
        """The handle, held open for the body: :meth:`close` on another thread does not free the
        communicator (or its connection array, which the connections' calls read) until every
        body has left. Raises if it is closed, or if this process is a fork child of the one
        that made it."""
        with self._lock:
            if self._handle is None:
                why = f"aborted ({self._aborted})" if self._aborted else "closed"
                raise InvalidUsageError(Result.INVALID_USAGE, f"the communicator is {why}", call)
            if os.getpid() != self._pid:
                raise InvalidUsageError(
                    Result.INVALID_USAGE,
                    f"the communicator was made by process {self._pid}; this is a fork child "
                    f"({os.getpid()}): make a communicator of its own",
                    call,
                )
            self._calls += 1
            h = self._handle
        try:
            yield h
        finally:
            self._leave()

    def _leave(self) -> None:
        """One call left the library; the last one out destroys an aborted communicator."""
        with self._lock:
            self._calls -= 1
            doomed = None
            if self._calls == 0:
                self._idle.notify_all()
                doomed, self._doomed = self._doomed, None
        if doomed is not None:
            _destroy_quietly(doomed)

    def _blocking(self, call: str, body: Callable[[int], _T]) -> _T:
        """``body(handle)`` inside :meth:`_use`, for a call that may block (a wait, a flush, a
        collective): made on the main thread, Ctrl-C interrupts it, which aborts the
        communicator (:meth:`abort`: the call itself cannot be taken back) and raises
        KeyboardInterrupt at once."""

        def run() -> _T:
            with self._use(call) as h:
                return body(h)

        def interrupted() -> str:
            self.abort(f"Ctrl-C interrupted {call}()")
            return f"mscclpp_rs: the communicator (rank {self.rank}) was aborted: Ctrl-C interrupted {call}()"

        return _interrupt.call(run, interrupted)  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        state = "closed" if self._handle is None else f"{len(self._connections)} connections"
        return f"Communicator(rank={getattr(self, 'rank', '?')}, size={getattr(self, 'size', '?')}, {state})"

    # --- Bootstrap -------------------------------------------------------------------------

    def all_gather(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` (any length, lengths may differ), indexed by rank, over the
        bootstrap sockets. Collective; bounded by the bootstrap timeout."""
        data = bytes(data)

        def body(h: int) -> list[bytes]:
            lengths = self._gather_fixed(h, struct.pack("<Q", len(data)))
            sizes = [struct.unpack("<Q", x)[0] for x in lengths]
            width = max(sizes)
            if width == 0:
                return [b""] * self.size
            if width > 2**31 - 1:
                raise InvalidArgumentError(
                    Result.INVALID_ARGUMENT, f"{width} bytes per rank: at most 2^31 - 1", "all_gather"
                )
            padded = self._gather_fixed(h, data.ljust(width, b"\0"))
            return [chunk[:size] for chunk, size in zip(padded, sizes)]

        return self._blocking("all_gather", body)

    def _gather_fixed(self, h: int, mine: bytes) -> list[bytes]:
        width = len(mine)
        buf = ctypes.create_string_buffer(width * self.size)
        ctypes.memmove(ctypes.addressof(buf) + self.rank * width, mine, width)
        n.call("mscclppBootstrapAllGather", h, buf, width)
        raw = buf.raw
        return [raw[r * width : (r + 1) * width] for r in range(self.size)]

    def barrier(self) -> None:
        """Returns once every rank has called it (bounded by the bootstrap timeout)."""
        self._blocking("barrier", lambda h: n.call("mscclppBootstrapBarrier", h))

    # --- Connections -----------------------------------------------------------------------

    def connect(
        self,
        remote_rank: int,
        buffer: Any,
        *,
        tag: int = 0,
        transport: Union[Transport, str] = Transport.IB,
        ib_dev: Optional[str] = None,
        nbytes: Optional[int] = None,
    ) -> Connection:
        """Declares a connection to ``remote_rank`` over ``buffer`` (``mscclppConnect``).

        Args:
            remote_rank: the peer, which declares the counterpart with the same ``tag`` and
                transport.
            buffer: a CuPy/NumPy array, a torch tensor, a bytearray, any object with
                ``__cuda_array_interface__``, the buffer protocol or ``__dlpack__``, or an
                ``(address, nbytes)`` tuple; contiguous and writable. It is kept alive by the
                connection.
            tag: tells apart several connections to one peer.
            transport: :class:`Transport` or ``"p2p"``, ``"shm"``, ``"ib"``.
            ib_dev: for ``IB``, a libfabric domain (``None``: the library's choice); must be
                ``None`` for the others.
            nbytes: connect only the first ``nbytes`` of the buffer.

        Nothing is created until :meth:`setup`.
        """
        buf = as_buffer(buffer)
        size = buf.nbytes
        if nbytes is not None:
            size = _check_int("nbytes", nbytes, buf.nbytes, "connect")
            buf = Buffer(buf.address, size, buf.kind, buf.owner, buf.device)
        t = _transport(transport)
        peer = _check_int("remote_rank", remote_rank, 2**31 - 1, "connect", lo=-(2**31))
        tag = _check_int("tag", tag, 2**31 - 1, "connect", lo=-(2**31))
        if ib_dev is not None and not isinstance(ib_dev, str):
            raise TypeError(f"ib_dev must be a str or None, not {type(ib_dev).__name__}")
        with self._declare, self._use("connect") as h:
            n.call(
                "mscclppConnect",
                h,
                peer,
                tag,
                buf.address or None,
                size,
                int(t),
                ib_dev.encode() if ib_dev is not None else None,
            )
            conn = Connection(self, peer, tag, buf, t, ib_dev)
            self._connections.append(conn)
            self._pending.append(conn)
        return conn

    @property
    def connections(self) -> list[Connection]:
        """Every connection declared, in :meth:`connect` order."""
        return list(self._connections)

    def setup(self) -> None:
        """Establishes every connection declared since the last setup (``mscclppConnectionSetup``,
        collective between the peers of each connection). Bounded by the bootstrap timeout."""

        def body(h: int) -> None:
            with self._declare:
                n.call("mscclppConnectionSetup", h)
                for conn in self._pending:
                    ptr = ctypes.c_void_p()
                    n.call("mscclppGetDeviceConnection", h, conn.remote_rank, conn.tag, ctypes.byref(ptr))
                    conn._devconn = ptr.value
                self._pending = []

        self._blocking("setup", body)

    def device_connections(self) -> DeviceConnections:
        """The ``mscclppDevConn_t`` array of every connection set up, in :meth:`connect` order
        (``mscclppGetAllDeviceConnections``): hand it to a kernel (see :class:`DeviceConnections`)."""
        ptr = ctypes.c_void_p()
        count = ctypes.c_int()
        with self._use("device_connections") as h:
            n.call("mscclppGetAllDeviceConnections", h, ctypes.byref(ptr), ctypes.byref(count))
            data = ctypes.string_at(ptr.value or 0, count.value * DEVCONN_BYTES) if count.value else b""
        ranks = [struct.unpack_from("<i", data, i * DEVCONN_BYTES)[0] for i in range(count.value)]
        return DeviceConnections(data, ptr.value or 0, ranks, self)

    def launch_proxy(self) -> None:
        """Starts the proxy threads (``mscclppProxyLaunch``), after :meth:`setup`."""
        with self._use("launch_proxy") as h:
            n.call("mscclppProxyLaunch", h)

    def stop_proxy(self) -> None:
        """Lets the proxies finish what was pushed, joins them, and raises the first error any of
        them met (``mscclppProxyStop``)."""
        with self._use("stop_proxy") as h:
            n.call("mscclppProxyStop", h)

    @contextlib.contextmanager
    def proxy(self) -> Iterator["Communicator"]:
        """Sets up the connections declared (if any are new), runs the proxies for the body, and
        stops them after it: on a clean exit a proxy's error is raised; when the body raised,
        its exception is the one that propagates. A :meth:`close` in the body stops them too."""
        if self._pending:
            self.setup()
        self.launch_proxy()
        try:
            yield self
        except BaseException:
            if not self.closed:
                with contextlib.suppress(MscclppError):
                    self.stop_proxy()
            raise
        if not self.closed:  # close() in the body stopped the proxies already
            self.stop_proxy()

    def async_error(self) -> Optional[MscclppError]:
        """A proxy thread's sticky error (``mscclppCommGetAsyncError``) as an exception with the
        library's text for it, or None. Does not stop the proxies."""
        code = ctypes.c_int()
        with self._use("async_error") as h:
            n.call("mscclppCommGetAsyncError", h, ctypes.byref(code))
            # The library sets this thread's last-error text to the error it reports.
            text = n.last_error() if code.value != 0 else ""
        if code.value == 0:
            return None
        return n.error(code.value, text or "a proxy thread failed", "mscclppCommGetAsyncError")

    def register_buffer(self, buffer: Any) -> RegisteredMemory:
        """Registers ``buffer`` with every connection and exchanges it with the connected peers
        (``mscclppRegisterBuffer``; collective, after :meth:`setup`)."""
        buf = as_buffer(buffer)
        handle = n.RegisteredMemoryStruct()
        self._blocking(
            "register_buffer", lambda h: n.call("mscclppRegisterBuffer", h, buf.address, buf.nbytes, ctypes.byref(handle))
        )
        reg = RegisteredMemory(self, buf, handle)
        self._registered.append(reg)
        return reg

    # --- Lifetime --------------------------------------------------------------------------

    def abort(self, reason: str = "abort() was called") -> None:
        """Ends the communicator now, from any thread, without waiting for anything.

        Every later call raises InvalidUsageError ("the communicator is aborted"). Waits and
        flushes of other threads end with an error (the proxies are stopped, which releases
        them); a bootstrap call in progress (barrier, setup, ...) ends at the latest at the
        bootstrap timeout. The communicator is destroyed by the last of those calls to leave
        the library, or by a thread of its own if none is inside. Its peers see this rank's connections fail
        (their waits end with an error, at the latest at their wait timeout). A Ctrl-C during
        a blocking call on the main thread aborts the communicator this way."""
        with self._lock:
            h, self._handle = self._handle, None
            if h is None:
                return
            self._aborted = reason
            busy = self._calls > 0
            if busy:
                self._doomed = h
                self._calls += 1  # the stop below, so that nobody destroys under it
        for c in self._connections:
            c._devconn = None
        if os.getpid() != self._pid:
            with self._lock:
                self._doomed = None  # the parent's to destroy
            return
        if not busy:
            # On a thread of its own: a destroy may wait for CUDA IPC peers to close their
            # mappings (up to the wait timeout), and abort() returns at once.
            threading.Thread(target=_destroy_quietly, args=(h,), name="mscclpp_rs abort", daemon=True).start()
            return

        def stop() -> None:
            # The stop releases the waits and flushes; it takes the library's lock of the
            # communicator, so it runs here, not on the caller's thread, to not wait behind a
            # bootstrap call that holds it.
            try:
                with contextlib.suppress(MscclppError):
                    n.call("mscclppProxyStop", h)
            finally:
                self._leave()

        threading.Thread(target=stop, name="mscclpp_rs abort", daemon=True).start()

    @property
    def aborted(self) -> Optional[str]:
        """Why :meth:`abort` ended the communicator, or None."""
        return self._aborted

    def close(self) -> None:
        """Stops the proxies and frees the communicator and its connections
        (``mscclppCommDestroy``). Idempotent. The connections' buffers may be freed after it.

        Calls of other threads on it that are inside the library then end (a wait or flush with
        an error: the stop releases them) before it is freed. Dropping the last reference to the
        communicator closes it at once (connections hold it weakly). In a fork child it only
        forgets the handle: the parent's communicator is the parent's to destroy."""
        with self._lock:
            h, self._handle = self._handle, None
            busy = self._calls
        if h is None:
            return
        for c in self._connections:
            c._devconn = None
        if os.getpid() != self._pid:
            return
        if busy:
            if sys.is_finalizing():
                # The interpreter is ending: threads inside calls (daemons) run no more, so
                # none would leave; the process's exit ends the communicator.
                return
            # Their waits end on the stop's abort; a stop that fails (none running) is fine.
            with contextlib.suppress(MscclppError):
                n.call("mscclppProxyStop", h)
            try:
                with self._lock:
                    # Ends when the last call left, or at the bound.
                    left = self._idle.wait_for(lambda: self._calls == 0, timeout=_CALLS_LEAVE_S)
            except BaseException:
                # Interrupted (Ctrl-C): the last call to leave destroys it, as after abort().
                self._destroy_when_idle(h)
                raise
            if not left:
                warnings.warn(
                    f"mscclpp_rs: a call on the communicator did not leave the library within "
                    f"{_CALLS_LEAVE_S:.0f} s of close(): it is destroyed when that call leaves",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self._destroy_when_idle(h)
                return
        n.call("mscclppCommDestroy", h)

    def _destroy_when_idle(self, h: int) -> None:
        """Destroys handle `h` now if no call is inside the library, else hands it to the last
        call to leave (_leave)."""
        with self._lock:
            now = self._calls == 0
            if not now:
                self._doomed = h
        if now:
            _destroy_quietly(h)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` or :meth:`abort` ran."""
        return self._handle is None

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        # At interpreter exit the module globals may be gone already: nothing to report then.
        with contextlib.suppress(Exception):
            self.close()
