"""The address and size of a caller's buffer, from whichever protocol the object speaks.

In this order: ``__cuda_array_interface__`` (CuPy arrays, PyTorch CUDA tensors, Numba),
the buffer protocol (NumPy arrays, bytearray, mmap, array.array), DLPack (``__dlpack__``:
PyTorch CPU tensors, JAX, anything else that exports one), or an explicit ``(address, nbytes)``
pair. The memory must be contiguous and writable: peers write into it. Whether it is host or
GPU memory the library finds out itself from the address.

The object (and, for DLPack, the capsule that pins the exported tensor) is kept by the
:class:`Buffer`, which the connection keeps: the memory stays alive as long as the connection.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from ._native import InvalidArgumentError, Result


@dataclass(frozen=True)
class Buffer:
    """A contiguous, writable region: ``address`` and ``nbytes``, and what keeps it alive."""

    address: int
    nbytes: int
    kind: str  # "cuda_array_interface", "buffer", "dlpack" or "address"
    # What keeps the memory alive; not part of equality or the hash (a NumPy array is not
    # hashable, and two Buffers over the same region are the same region).
    owner: Any = field(compare=False, hash=False)
    device: str = "unknown"  # "cuda", "cpu" or "unknown" (as the object says; the library checks)
    # The stream the producer said to synchronize with before use (``__cuda_array_interface__``
    # v3 "stream": 1 the legacy default stream, 2 the per-thread one, else a cudaStream_t), or
    # None when it said nothing.
    stream: Optional[int] = None

    def __repr__(self) -> str:
        return f"Buffer(address=0x{self.address:x}, nbytes={self.nbytes}, kind={self.kind!r}, device={self.device!r})"


def _bad(message: str) -> InvalidArgumentError:
    return InvalidArgumentError(Result.INVALID_ARGUMENT, message, "buffer")


def _contiguous(shape: tuple[int, ...], strides: Optional[tuple[int, ...]], itemsize: int) -> bool:
    """Whether byte ``strides`` describe a C-contiguous layout of ``shape`` (size-1 axes free)."""
    if strides is None:
        return True
    expect = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expect:
            return False
        expect *= dim
    return True


def _from_cai(obj: Any) -> Buffer:
    cai = obj.__cuda_array_interface__
    address, readonly = cai["data"]
    if readonly:
        raise _bad("the array is read-only (__cuda_array_interface__): peers write into a connected buffer")
    shape = tuple(int(d) for d in cai["shape"])
    itemsize = int(cai["typestr"][2:])
    strides = cai.get("strides")
    if not _contiguous(shape, None if strides is None else tuple(strides), itemsize):
        raise _bad(f"the array is not contiguous (shape {shape}, strides {strides})")
    stream = cai.get("stream")
    return Buffer(
        int(address or 0),
        math.prod(shape) * itemsize,
        "cuda_array_interface",
        obj,
        "cuda",
        None if stream is None else int(stream),
    )


def _from_buffer_protocol(obj: Any) -> Buffer:
    view = memoryview(obj)
    if view.readonly:
        raise _bad(
            f"{type(obj).__name__} is read-only: peers write into a connected buffer "
            "(use a bytearray or a writable array)"
        )
    if not view.c_contiguous:
        raise _bad(f"{type(obj).__name__} is not C-contiguous")
    nbytes = view.nbytes
    if nbytes == 0:
        return Buffer(0, 0, "buffer", obj, "cpu")
    flat = view.cast("B")
    address = ctypes.addressof(ctypes.c_char.from_buffer(flat))
    return Buffer(address, nbytes, "buffer", (obj, flat), "cpu")


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


# DLDeviceType values: kDLCPU, kDLCUDA, kDLCUDAHost, kDLCUDAManaged.
_DL_DEVICES = {1: "cpu", 2: "cuda", 3: "cpu", 13: "cuda"}

_capsule_get = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get.restype = ctypes.c_void_p
_capsule_get.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _from_dlpack(obj: Any) -> Buffer:
    # A legacy "dltensor" capsule (no max_version asked): its DLManagedTensor starts with the
    # DLTensor. It is not consumed (not renamed "used_dltensor"), so its destructor releases
    # the export when the capsule dies; the Buffer keeps it alive until then.
    capsule = obj.__dlpack__()
    ptr = _capsule_get(capsule, b"dltensor")
    if not ptr:
        raise _bad(f"{type(obj).__name__}.__dlpack__() did not return a 'dltensor' capsule")
    t = _DLTensor.from_address(ptr)
    if t.dtype.bits % 8:
        raise _bad(f"DLPack dtype of {t.dtype.bits} bits is not whole bytes")
    itemsize = t.dtype.bits // 8 * max(1, t.dtype.lanes)
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = None if not t.strides else tuple(t.strides[i] * itemsize for i in range(t.ndim))
    if not _contiguous(shape, strides, itemsize):
        raise _bad(
            f"the tensor is not contiguous (shape {shape}, byte strides {strides})"
        )
    address = (t.data or 0) + t.byte_offset
    device = _DL_DEVICES.get(t.device.device_type, "unknown")
    return Buffer(address, math.prod(shape) * itemsize, "dlpack", (obj, capsule), device)


def as_buffer(obj: Any) -> Buffer:
    """A :class:`Buffer` for ``obj`` (see the module's text for what is accepted).

    Raises:
        InvalidArgumentError: read-only or non-contiguous memory, a bad ``(address, nbytes)``.
        TypeError: an object that exposes none of the protocols.
    """
    if isinstance(obj, Buffer):
        return obj
    if isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(v, int) for v in obj):
        address, nbytes = obj
        if address < 0 or nbytes < 0 or address >= 1 << 64 or nbytes >= 1 << 64:
            raise _bad(f"(address, nbytes) = (0x{address:x}, {nbytes}): out of range")
        return Buffer(address, nbytes, "address", None)
    if hasattr(obj, "__cuda_array_interface__"):
        try:
            return _from_cai(obj)
        except AttributeError:
            pass  # e.g. a CPU torch tensor raises AttributeError from the property
    try:
        memoryview(obj)
    except TypeError:
        pass
    else:
        return _from_buffer_protocol(obj)
    if hasattr(obj, "__dlpack__"):
        return _from_dlpack(obj)
    raise TypeError(
        f"{type(obj).__name__} is not a buffer: pass an object with __cuda_array_interface__, "
        "the buffer protocol or __dlpack__ (CuPy/NumPy arrays, torch tensors, bytearray), "
        "or an (address, nbytes) tuple"
    )
