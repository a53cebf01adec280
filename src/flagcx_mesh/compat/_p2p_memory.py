"""What the P2P engine's register calls were given: an absolute address and a size (as FlagCX's
``flagcxP2pRegister(engine, addr, size)``), or a buffer (numpy array, bytearray, torch tensor on
the CPU or a CUDA device, ``__cuda_array_interface__`` / DLPack object). Either way the result is
the range's address, its size, whether it is device memory, and the object handed to
``Agent.register`` (the buffer itself, or a view made over the address range)."""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple, Optional

from .. import _core
from .. import cuda as _cuda
from .._args import _as_int
from ._checks import _is_int

_U64 = 1 << 64


class Memory(NamedTuple):
    addr: int
    size: int
    on_device: bool
    buffer: Any  # what Agent.register receives


class _CudaRange:
    """A device address range shown as a CUDA array of bytes (``__cuda_array_interface__``), so
    the agent's register receives device memory in the form it takes buffers in."""

    def __init__(self, addr: int, size: int):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (addr, False),
                                         "strides": None, "version": 3}


def _host_address(obj) -> int:
    data = getattr(obj, "data_ptr", None)  # a torch CPU tensor
    if callable(data):
        return int(data())
    view = memoryview(obj)
    if view.readonly:
        raise ValueError("the buffer is read-only")
    if view.nbytes == 0:
        raise ValueError("the buffer is empty")
    return ctypes.addressof(ctypes.c_char.from_buffer(view.cast("B")))


def _host_nbytes(obj) -> int:
    if callable(getattr(obj, "data_ptr", None)):
        return int(obj.numel()) * int(obj.element_size())
    return memoryview(obj).nbytes


def device_of(addr: int) -> int:
    """The CUDA device of the memory at ``addr``, -1 for host memory (or without a CUDA driver)."""
    return _core.device_of(addr)


def resolve(data, size: Optional[int]) -> Memory:
    """The memory of a register call; ValueError naming what is wrong."""
    data = _as_int(data)
    if _is_int(data):
        if size is None or not _is_int(_as_int(size)):
            raise ValueError(f"size {size!r} must be an int number of bytes with an address")
        size = _as_int(size)
        if not 0 < data < _U64 or not 0 < size <= _U64 - data:
            raise ValueError(f"[{data:#x}, +{size}) is no range of memory (address and size must be > 0)")
        if device_of(data) >= 0:
            return Memory(data, size, True, _CudaRange(data, size))
        return Memory(data, size, False, (ctypes.c_char * size).from_address(data))
    dev = _cuda.device_buffer(data, "register")
    if dev is not None:
        addr, nbytes = dev.ptr, dev.nbytes
        on_device = True
    else:
        try:
            addr, nbytes = _host_address(data), _host_nbytes(data)
        except (TypeError, BufferError) as e:
            raise ValueError(f"not an address nor a buffer: {e}") from None
        on_device = False
    if size is not None and _as_int(size) != nbytes:
        raise ValueError(f"size {size!r} differs from the buffer's {nbytes} bytes")
    if nbytes == 0:
        raise ValueError("the buffer is empty")
    return Memory(addr, nbytes, on_device, data)
