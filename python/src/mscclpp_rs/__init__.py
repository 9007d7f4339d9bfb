"""mscclpp_rs: Python bindings of libmscclpp (the Rust implementation of the 2023 MSCCL++ C API).

A thin layer over the C API through ctypes: the communicator, connections over any buffer
(CuPy/NumPy arrays, torch tensors, bytearray), the proxy as a context manager, the device
connections for kernels, host-side put/signal/flush/wait, and the bootstrap's all-gather and
barrier. The wheel carries ``libmscclpp.so`` and the headers: :func:`include_dir` and
:func:`compile_flags` give what a kernel that includes ``mscclpp.h`` needs.

A blocking call made on the main thread (a wait, a flush, a barrier, setup, communicator
creation) is interruptible by Ctrl-C, which aborts its communicator (:meth:`Communicator.abort`);
:func:`set_interruptible` turns that off.

Every failed library call raises a :class:`MscclppError` subclass carrying the library's result
code (``.code``) and message (``.message``). The library is loaded on first use.

Named ``mscclpp_rs`` so that it can be installed next to MSCCL++'s own ``mscclpp``.
"""

from __future__ import annotations

from typing import Optional

from . import _native
from ._buffer import Buffer, as_buffer
from ._interrupt import interruptible, set_interruptible
from ._comm import (
    Communicator,
    Connection,
    DeviceConnections,
    RegisteredMemory,
    UniqueId,
    set_bootstrap_timeout,
    unique_id,
    version,
)
from ._launch import LaunchEnv, launch_env
from ._native import (
    DEVCONN_BYTES,
    InProgressError,
    InternalError,
    InvalidArgumentError,
    InvalidUsageError,
    MscclppError,
    MscclppSystemError,
    MscclppTimeoutError,
    RemoteError,
    Result,
    Transport,
    UnhandledCudaError,
)

__version__ = "0.1.0"

__all__ = [
    "Buffer",
    "Communicator",
    "Connection",
    "DEVCONN_BYTES",
    "DeviceConnections",
    "InProgressError",
    "InternalError",
    "InvalidArgumentError",
    "InvalidUsageError",
    "LaunchEnv",
    "MscclppError",
    "MscclppSystemError",
    "RegisteredMemory",
    "MscclppTimeoutError",
    "RemoteError",
    "Result",
    "Transport",
    "UnhandledCudaError",
    "UniqueId",
    "as_buffer",
    "compile_flags",
    "include_dir",
    "interruptible",
    "launch_env",
    "lib_dir",
    "libfabric_path",
    "library_path",
    "link_flags",
    "set_bootstrap_timeout",
    "set_interruptible",
    "unique_id",
    "version",
]


def include_dir() -> str:
    """The folder holding ``mscclpp.h`` and ``mscclpp/`` (pass it as ``-I``)."""
    return str(_native.DATA_DIR / "include")


def lib_dir() -> str:
    """The folder holding ``libmscclpp.so.0``."""
    return str(_native.LIB_DIR)


def library_path() -> str:
    """The path of ``libmscclpp.so.0``, the library this package loads."""
    return str(_native.LIBRARY_PATH)


def libfabric_path() -> Optional[str]:
    """The ``libfabric.so.1`` this process uses: the system's, or the copy in the wheel where the
    system has none (``MSCCLPP_PY_LIBFABRIC=system|bundled`` forces one). Loads the library."""
    _native.lib()
    return _native.libfabric_path()


def compile_flags(compiler: str = "nvcc") -> list[str]:
    """The flags a CUDA or C++ source that includes ``mscclpp.h`` needs (device code only: the
    device methods are inline and need no library at link time).

    Args:
        compiler: ``"nvcc"`` (also for ``torch.utils.cpp_extension`` and CuPy's
            ``backend="nvcc"``), or ``"nvrtc"`` (CuPy's default ``RawKernel`` backend). NVRTC has
            no C library headers and takes unannotated functions as host code, which it refuses:
            its flags add this package's ``stdint.h``/``stddef.h`` for NVRTC and
            ``--device-as-default-execution-space``, so the header's host declarations become
            device declarations that are never called.
    """
    flags = ["-I" + include_dir()]
    if compiler == "nvrtc":
        flags += ["-I" + str(_native.PACKAGE_DIR / "nvrtc"), "--device-as-default-execution-space"]
    elif compiler != "nvcc":
        raise ValueError(f"compiler {compiler!r}: expected 'nvcc' or 'nvrtc'")
    return flags


def link_flags() -> list[str]:
    """Flags to link host code that calls the C API against this package's library (gcc/nvcc):
    the library by path and a run path to its folder."""
    return [library_path(), "-Wl,-rpath," + lib_dir()]
