"""ctypes access to the fake CUDA driver (libflagcx_mesh_fakecuda.so), for tests.

The fake implements the driver entry points flagcx_mesh loads (csrc/transport/cuda/driver.h)
over host memory: device memory is a memfd the CPU cannot touch (PROT_NONE), streams are FIFOs
served by threads. A process uses it when FLAGCX_MESH_CUDA_DRIVER names it: put ``env()`` in a
rank's environment. In one process, the library and this module share the same loaded copy
(one dlopen of one path), so buffers made here are device memory to the library.
See docs/testing.md, "The fake CUDA driver".
"""

from __future__ import annotations

import ctypes as C
import os
import threading
from typing import Callable, Dict, List, Optional

import testdoubles

LIBRARY_NAME = testdoubles.FAKECUDA_LIBRARY
DRIVER_ENV = "FLAGCX_MESH_CUDA_DRIVER"

# CUresult values the fake answers
SUCCESS, INVALID_VALUE, NOT_INITIALIZED, NO_DEVICE = 0, 1, 3, 100
INVALID_CONTEXT, INVALID_HANDLE, NOT_FOUND, NOT_READY = 201, 400, 500, 600
ILLEGAL_ADDRESS, NOT_PERMITTED, NOT_SUPPORTED = 700, 800, 801
# CUpointer_attribute
ATTR_CONTEXT, ATTR_MEMORY_TYPE, ATTR_DEVICE_ORDINAL, ATTR_LEGACY_IPC = 1, 2, 9, 10
ATTR_RANGE_START, ATTR_RANGE_SIZE, ATTR_HANDLE_TYPES = 11, 12, 14
ATTR_MAPPING_SIZE, ATTR_MAPPING_BASE = 18, 19
MEMORY_HOST, MEMORY_DEVICE = 1, 2
HANDLE_POSIX_FD, HANDLE_FABRIC = 1, 8
STREAM_NON_BLOCKING = 1
WAIT_GEQ, WAIT_EQ = 0, 1

CUdeviceptr = C.c_ulonglong
HOST_FN = C.CFUNCTYPE(None, C.c_void_p)


def library_path() -> str:
    """The fake driver of the test build (testdoubles.py): the installed package holds none."""
    return testdoubles.library(LIBRARY_NAME)


def env(devices: Optional[int] = None, fail: Optional[Dict[str, int]] = None,
        granularity: Optional[int] = None, no_stream_memops: bool = False) -> Dict[str, str]:
    """Environment entries that make a process load the fake driver, with its switches:
    devices (FXM_FAKECUDA_DEVICES), fail={"cuMemCreate": 801} (FXM_FAKECUDA_FAIL),
    granularity in bytes (FXM_FAKECUDA_GRANULARITY), no_stream_memops
    (FXM_FAKECUDA_NO_STREAM_MEMOPS: cuStreamWaitValue64 answers NOT_SUPPORTED)."""
    # FLAGCX_MESH_UCX_LIB emptied: a real UCX with cuda transports (a GPU host's, named there for
    # the ucx steps) loads the real driver, which knows none of the fake's device pointers; it
    # refused the fake regions with errors of its own on stdout, which these tests read
    out = {DRIVER_ENV: library_path(), "FLAGCX_MESH_UCX_LIB": ""}
    if devices is not None:
        out["FXM_FAKECUDA_DEVICES"] = str(devices)
    if fail:
        out["FXM_FAKECUDA_FAIL"] = ",".join(f"{k}={v}" for k, v in fail.items())
    if granularity is not None:
        out["FXM_FAKECUDA_GRANULARITY"] = str(granularity)
    if no_stream_memops:
        out["FXM_FAKECUDA_NO_STREAM_MEMOPS"] = "1"
    return out


def use_in_this_process() -> "FakeCuda":
    """Makes this process's flagcx_mesh load the fake (FLAGCX_MESH_CUDA_DRIVER) and returns the
    shared FakeCuda. The library loads its driver once per process, at its first device call,
    and the fake reads its FXM_FAKECUDA_* switches at its first cuInit: call this (with the
    switches already in os.environ) before either happens."""
    path = library_path()
    if os.environ.get(DRIVER_ENV, path) != path:
        raise RuntimeError(f"{DRIVER_ENV} already names {os.environ[DRIVER_ENV]}")
    os.environ[DRIVER_ENV] = path
    return FakeCuda.get()


class CudaError(RuntimeError):
    """A driver call answered something other than CUDA_SUCCESS."""

    def __init__(self, call: str, code: int, name: str):
        super().__init__(f"{call}: {name} ({code})")
        self.call, self.code, self.name = call, code, name


class MemLocation(C.Structure):
    _fields_ = [("type", C.c_int), ("id", C.c_int)]


class MemAllocationProp(C.Structure):
    _fields_ = [("type", C.c_int), ("requested_handle_types", C.c_int), ("location", MemLocation),
                ("win32_metadata", C.c_void_p), ("compression_type", C.c_ubyte),
                ("gpu_direct_rdma_capable", C.c_ubyte), ("usage", C.c_ushort),
                ("reserved", C.c_ubyte * 4)]


class MemAccessDesc(C.Structure):
    _fields_ = [("location", MemLocation), ("flags", C.c_int)]


class IpcMemHandle(C.Structure):
    _fields_ = [("reserved", C.c_char * 64)]


_P, _U, _ULL, _SZ, _I = C.c_void_p, C.c_uint, C.c_ulonglong, C.c_size_t, C.c_int
_ARGTYPES = {
    "cuInit": [_U], "cuDevicePrimaryCtxRetain": [C.POINTER(_P), _I], "cuCtxSetCurrent": [_P],
    "cuGetErrorName": [_I, C.POINTER(C.c_char_p)], "cuDriverGetVersion": [C.POINTER(_I)],
    "cuGetProcAddress_v2": [C.c_char_p, C.POINTER(_P), _I, _ULL, C.POINTER(_I)],
    "cuMemAlloc_v2": [C.POINTER(CUdeviceptr), _SZ], "cuMemFree_v2": [CUdeviceptr],
    "cuMemcpyHtoD_v2": [CUdeviceptr, _P, _SZ], "cuMemcpyDtoH_v2": [_P, CUdeviceptr, _SZ],
    "cuPointerGetAttribute": [_P, _I, CUdeviceptr],
    "cuMemGetAddressRange_v2": [C.POINTER(CUdeviceptr), C.POINTER(_SZ), CUdeviceptr],
    "cuIpcGetMemHandle": [C.POINTER(IpcMemHandle), CUdeviceptr],
    "cuIpcOpenMemHandle_v2": [C.POINTER(CUdeviceptr), IpcMemHandle, _U],
    "cuIpcCloseMemHandle": [CUdeviceptr],
    "cuMemGetAllocationGranularity": [C.POINTER(_SZ), C.POINTER(MemAllocationProp), _I],
    "cuMemCreate": [C.POINTER(_ULL), _SZ, C.POINTER(MemAllocationProp), _ULL],
    "cuMemRelease": [_ULL],
    "cuMemAddressReserve": [C.POINTER(CUdeviceptr), _SZ, _SZ, CUdeviceptr, _ULL],
    "cuMemAddressFree": [CUdeviceptr, _SZ], "cuMemMap": [CUdeviceptr, _SZ, _SZ, _ULL, _ULL],
    "cuMemUnmap": [CUdeviceptr, _SZ],
    "cuMemSetAccess": [CUdeviceptr, _SZ, C.POINTER(MemAccessDesc), _SZ],
    "cuMemRetainAllocationHandle": [C.POINTER(_ULL), _P],
    "cuMemExportToShareableHandle": [_P, _ULL, _I, _ULL],
    "cuMemImportFromShareableHandle": [C.POINTER(_ULL), _P, _I],
    "cuMemHostRegister_v2": [_P, _SZ, _U], "cuMemHostUnregister": [_P],
    "cuMemHostGetDevicePointer_v2": [C.POINTER(CUdeviceptr), _P, _U],
    "cuStreamCreate": [C.POINTER(_P), _U], "cuStreamDestroy_v2": [_P],
    "cuStreamSynchronize": [_P], "cuMemcpyAsync": [CUdeviceptr, CUdeviceptr, _SZ, _P],
    "cuStreamWaitValue64_v2": [_P, CUdeviceptr, C.c_uint64, _U],
    "cuLaunchHostFunc": [_P, HOST_FN, _P], "cuStreamWaitEvent": [_P, _P, _U],
    "cuEventCreate": [C.POINTER(_P), _U], "cuEventRecord": [_P, _P], "cuEventQuery": [_P],
    "cuEventSynchronize": [_P], "cuEventDestroy_v2": [_P], "cuCtxSynchronize": [],
}


class FakeCuda:
    """The fake driver in this process, initialised, device `device`'s primary context made
    current on every calling thread. Methods raise CudaError; rc() answers the raw code."""

    _shared: Optional["FakeCuda"] = None
    _shared_lock = threading.Lock()

    def __init__(self, device: int = 0, path: Optional[str] = None):
        self.lib = C.CDLL(path or library_path())
        for name, args in _ARGTYPES.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = args, C.c_int
        self._callbacks: List[HOST_FN] = []  # host functions queued: kept alive
        self.call("cuInit", 0)
        ctx = _P()
        self.call("cuDevicePrimaryCtxRetain", C.byref(ctx), device)
        self.ctx = ctx

    @classmethod
    def get(cls) -> "FakeCuda":
        """One FakeCuda per process (device 0)."""
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    # ---------------------------------------------------------------- calls
    def rc(self, name: str, *args) -> int:
        """The raw CUresult of one call (the context made current on this thread first)."""
        if name not in ("cuInit", "cuDevicePrimaryCtxRetain") and getattr(self, "ctx", None):
            self.lib.cuCtxSetCurrent(self.ctx)
        return getattr(self.lib, name)(*args)

    def call(self, name: str, *args) -> None:
        code = self.rc(name, *args)
        if code != SUCCESS:
            raise CudaError(name, code, self.error_name(code))

    def calls(self, name: str) -> int:
        """How often this process called the entry point ``name`` (base name, e.g. "cuEventRecord")."""
        fn = self.lib.fakecuda_call_count
        fn.argtypes, fn.restype = [C.c_char_p], C.c_ulonglong
        return fn(name.encode())

    def thread_calls(self, name: str) -> int:
        """How often the calling thread called the entry point ``name`` (base name)."""
        fn = self.lib.fakecuda_thread_call_count
        fn.argtypes, fn.restype = [C.c_char_p], C.c_ulonglong
        return fn(name.encode())

    def error_name(self, code: int) -> str:
        text = C.c_char_p()
        if self.lib.cuGetErrorName(code, C.byref(text)) != SUCCESS:
            return "unknown error"
        return text.value.decode()

    # ---------------------------------------------------------------- memory
    def alloc(self, nbytes: int) -> int:
        ptr = CUdeviceptr()
        self.call("cuMemAlloc_v2", C.byref(ptr), nbytes)
        return ptr.value

    def free(self, ptr: int) -> None:
        self.call("cuMemFree_v2", ptr)

    def write(self, ptr: int, data: bytes) -> None:
        self.call("cuMemcpyHtoD_v2", ptr, data, len(data))

    def read(self, ptr: int, nbytes: int) -> bytes:
        buf = C.create_string_buffer(nbytes)
        self.call("cuMemcpyDtoH_v2", buf, ptr, nbytes)
        return buf.raw

    def attribute(self, ptr: int, attr: int) -> int:
        """cuPointerGetAttribute into a zeroed 8-byte slot."""
        out = C.c_ulonglong(0)
        self.call("cuPointerGetAttribute", C.byref(out), attr, ptr)
        return out.value

    def address_range(self, ptr: int):
        base, size = CUdeviceptr(), C.c_size_t()
        self.call("cuMemGetAddressRange_v2", C.byref(base), C.byref(size), ptr)
        return base.value, size.value

    def host_register(self, addr: int, nbytes: int, flags: int = 0) -> None:
        self.call("cuMemHostRegister_v2", addr, nbytes, flags)

    def host_unregister(self, addr: int) -> None:
        self.call("cuMemHostUnregister", addr)

    # ---------------------------------------------------------------- legacy IPC
    def ipc_handle(self, ptr: int) -> bytes:
        h = IpcMemHandle()
        self.call("cuIpcGetMemHandle", C.byref(h), ptr)
        return bytes(h)

    def ipc_open(self, handle: bytes) -> int:
        ptr = CUdeviceptr()
        self.call("cuIpcOpenMemHandle_v2", C.byref(ptr), IpcMemHandle.from_buffer_copy(handle), 1)
        return ptr.value

    def ipc_close(self, ptr: int) -> None:
        self.call("cuIpcCloseMemHandle", ptr)

    # ---------------------------------------------------------------- VMM
    @staticmethod
    def prop(handle_types: int = HANDLE_POSIX_FD, device: int = 0) -> MemAllocationProp:
        p = MemAllocationProp()
        p.type, p.requested_handle_types = 1, handle_types
        p.location.type, p.location.id = 1, device
        return p

    def granularity(self) -> int:
        g = C.c_size_t()
        self.call("cuMemGetAllocationGranularity", C.byref(g), C.byref(self.prop()), 0)
        return g.value

    def mem_create(self, size: int, handle_types: int = HANDLE_POSIX_FD) -> int:
        h = C.c_ulonglong()
        self.call("cuMemCreate", C.byref(h), size, C.byref(self.prop(handle_types)), 0)
        return h.value

    def map(self, handle: int, size: int) -> int:
        """Reserve `size` bytes, map `handle` there, grant read-write access; the address."""
        ptr = CUdeviceptr()
        self.call("cuMemAddressReserve", C.byref(ptr), size, 0, 0, 0)
        self.call("cuMemMap", ptr.value, size, 0, handle, 0)
        desc = MemAccessDesc(MemLocation(1, 0), 3)
        self.call("cuMemSetAccess", ptr.value, size, C.byref(desc), 1)
        return ptr.value

    def unmap(self, ptr: int, size: int) -> None:
        self.call("cuMemUnmap", ptr, size)
        self.call("cuMemAddressFree", ptr, size)

    def export_fd(self, handle: int) -> int:
        fd = C.c_int(-1)
        self.call("cuMemExportToShareableHandle", C.byref(fd), handle, HANDLE_POSIX_FD, 0)
        return fd.value

    def import_fd(self, fd: int) -> int:
        h = C.c_ulonglong()
        self.call("cuMemImportFromShareableHandle", C.byref(h), fd, HANDLE_POSIX_FD)
        return h.value

    # ---------------------------------------------------------------- streams and events
    def stream(self, flags: int = STREAM_NON_BLOCKING) -> int:
        s = _P()
        self.call("cuStreamCreate", C.byref(s), flags)
        return s.value

    def stream_destroy(self, stream: int) -> None:
        self.call("cuStreamDestroy_v2", stream)

    def synchronize(self, stream: Optional[int] = None) -> None:
        self.call("cuStreamSynchronize", stream)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: Optional[int] = None) -> None:
        self.call("cuMemcpyAsync", dst, src, nbytes, stream)

    def wait_value64(self, stream: Optional[int], addr: int, value: int, flags: int = WAIT_GEQ) -> None:
        self.call("cuStreamWaitValue64_v2", stream, addr, value, flags)

    def launch_host_func(self, stream: Optional[int], fn: Callable[[], None]) -> None:
        cb = HOST_FN(lambda _: fn())
        self._callbacks.append(cb)
        self.call("cuLaunchHostFunc", stream, cb, None)

    def event(self) -> int:
        e = _P()
        self.call("cuEventCreate", C.byref(e), 2)
        return e.value

    def record(self, event: int, stream: Optional[int] = None) -> None:
        self.call("cuEventRecord", event, stream)

    def event_query(self, event: int) -> int:
        return self.rc("cuEventQuery", event)

    def set_not_ready_query_delay(self, seconds: float) -> None:
        """From now on a cuEventQuery that answers CUDA_ERROR_NOT_READY (the state when it was
        called) takes `seconds`: a slow poll of pending work (0: none). A switch of the fake for
        tests, not a driver call."""
        fn = self.lib.fxmFakeSetNotReadyQueryDelay
        fn.argtypes, fn.restype = [C.c_long], None
        fn(int(seconds * 1e6))


class DeviceBuffer:
    """nbytes of fake device memory (cuMemAlloc) with __cuda_array_interface__, so that it can
    be handed to Mesh.register_window like a CUDA tensor."""

    def __init__(self, nbytes: int, cuda: Optional[FakeCuda] = None):
        self.cuda = cuda or FakeCuda.get()
        self.nbytes = nbytes
        self.ptr = self.cuda.alloc(nbytes)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"version": 3, "shape": (self.nbytes,), "typestr": "|u1",
                "data": (self.ptr, False), "strides": None}

    def write(self, data: bytes, offset: int = 0) -> None:
        self.cuda.write(self.ptr + offset, data)

    def read(self, nbytes: Optional[int] = None, offset: int = 0) -> bytes:
        return self.cuda.read(self.ptr + offset, self.nbytes - offset if nbytes is None else nbytes)

    def free(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            self.cuda.free(ptr)

    def __del__(self) -> None:  # like a CUDA tensor: freed when dropped (a window keeps it)
        try:
            self.free()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __enter__(self) -> "DeviceBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.free()
