"""Recognising CUDA memory, devices and streams passed to flagcx_mesh.

No CUDA package is imported here: torch tensors, objects with
``__cuda_array_interface__`` and DLPack exporters on a CUDA device are read
through their own protocols; the library loads the CUDA driver itself.
"""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple, Optional

_KDL_CUDA = 2  # DLPack device types on a CUDA device: CUDA, CUDA host-pinned is not device
_KDL_CUDA_MANAGED = 13


class DeviceBuffer(NamedTuple):
    ptr: int
    nbytes: int
    keepalive: Any  # objects that must live as long as the window


def _itemsize(typestr: str) -> int:
    return int(typestr[2:]) if typestr[2:].isdigit() else 1


def _from_array_interface(obj, what: str) -> DeviceBuffer:
    cai = obj.__cuda_array_interface__
    ptr = int(cai["data"][0])
    shape = tuple(cai.get("shape", ()))
    itemsize = _itemsize(cai.get("typestr", "|u1"))
    strides = cai.get("strides")
    n = 1
    for d in shape:
        n *= int(d)
    if strides is not None:
        expect, ok = itemsize, True
        for dim, stride in zip(reversed(shape), reversed(strides)):
            ok = ok and (dim == 1 or stride == expect)
            expect *= dim
        if not ok:
            raise ValueError(f"{what}: the CUDA array must be C-contiguous (strides {strides})")
    if cai["data"][1]:
        raise ValueError(f"{what}: the CUDA array is read-only")
    return DeviceBuffer(ptr, n * itemsize, obj)


def _from_torch(t, what: str) -> DeviceBuffer:
    if not t.is_contiguous():
        raise ValueError(f"{what}: a CUDA tensor must be contiguous")
    return DeviceBuffer(int(t.data_ptr()), int(t.numel()) * int(t.element_size()), t)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


def _from_dlpack(obj, what: str) -> DeviceBuffer:
    capsule = obj.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    t = _DLTensor.from_address(get(capsule, b"dltensor"))  # DLManagedTensor starts with its DLTensor
    n = 1
    for i in range(t.ndim):
        n *= t.shape[i]
    if t.strides:
        expect = 1
        for i in reversed(range(t.ndim)):
            if t.shape[i] != 1 and t.strides[i] != expect:
                raise ValueError(f"{what}: the DLPack tensor must be C-contiguous")
            expect *= t.shape[i]
    nbytes = n * ((t.bits * t.lanes + 7) // 8)
    return DeviceBuffer(int(t.data or 0) + int(t.byte_offset), nbytes, (obj, capsule))


def device_buffer(obj, what: str) -> Optional[DeviceBuffer]:
    """The CUDA memory ``obj`` exposes, or None when it is not on a CUDA device."""
    if hasattr(obj, "is_cuda") and hasattr(obj, "data_ptr"):  # torch.Tensor
        return _from_torch(obj, what) if obj.is_cuda else None
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_array_interface(obj, what)
    if hasattr(obj, "__dlpack_device__") and hasattr(obj, "__dlpack__"):
        dev_type, _ = obj.__dlpack_device__()
        if int(dev_type) in (_KDL_CUDA, _KDL_CUDA_MANAGED):
            return _from_dlpack(obj, what)
    return None


def device_ordinal(device) -> int:
    """A CUDA device ordinal from 3, "cuda", "cuda:1" or a torch.device."""
    if isinstance(device, bool):
        raise ValueError(f"device must be a CUDA device, got {device!r}")
    if isinstance(device, int):
        return device
    kind = getattr(device, "type", None)
    if kind is not None:  # torch.device
        if kind != "cuda":
            raise ValueError(f"device must be a CUDA device, got {device!r}")
        return device.index or 0
    text = str(device)
    if text == "cuda":
        return 0
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    raise ValueError(f"device must be an int, 'cuda', 'cuda:N' or a torch.device, got {device!r}")


def stream_handle(stream) -> Optional[int]:
    """The CUDA stream handle of ``stream``: None, an int (0: the legacy default
    stream; a small int other than 0, 1, 2 is refused: it is no stream pointer), a
    torch.cuda.Stream (``cuda_stream``) or an object with ``__cuda_stream__``."""
    if stream is None:
        return None
    if isinstance(stream, bool):
        raise TypeError(f"stream must be a CUDA stream, got {stream!r}")
    if isinstance(stream, int):
        if 3 <= stream < 4096:  # 0, 1, 2 are the driver's special streams; others are pointers
            raise TypeError(f"stream {stream} is not a CUDA stream handle (a timeout passed positionally?)")
        return stream
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    if hasattr(stream, "cuda_stream"):
        return int(stream.cuda_stream)
    raise TypeError(f"stream must be an int handle, a torch.cuda.Stream or have __cuda_stream__, got {stream!r}")


def staged_waits() -> dict:
    """Where this process's staged path (GPU memory through pinned staging and the tcp lanes)
    waited since the process started, each kind a count and its microseconds: ``slot_waits`` /
    ``slot_us`` (the caller filling a staged batch or put waited for a ring slot: the lanes sent
    slower than it gathered), ``gather_waits`` / ``gather_us`` (it waited for a chunk's copy out of
    device memory: the device was behind), ``starved`` / ``starved_us`` (a lane had sent every
    gathered byte and waited for more: the filler was behind), ``landing_waits`` / ``landing_us``
    (at the target, a lane waited for a landing buffer whose copy into device memory had not
    completed). A wait counts however it ended (a deadline too); ``starved_us`` adds up over the
    lanes. Take it before and after a transfer: the difference says which side a staged transfer
    waited on (docs/gpu.md, "Where a staged batch waits")."""
    from . import _core

    return dict(_core.staged_waits())
