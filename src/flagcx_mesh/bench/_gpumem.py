"""Device memory for `bench agent --device cuda`, from one of two sources:

  torch   torch CUDA tensors (the caching allocator: cudaMalloc memory, or cuMem memory with a
          POSIX fd handle when PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
  driver  the CUDA driver the library loads (FLAGCX_MESH_CUDA_DRIVER, else libcuda.so.1) through
          ctypes: cuMemAlloc ("ipc" memory) or cuMemCreate + cuMemMap with a POSIX fd handle
          ("vmm" memory); no torch needed (it is how the bench runs on the fake driver in CI)

Each buffer has `ptr`, `nbytes`, `obj` (what Agent.register takes), `write(data)` (host bytes
in at offset 0) and `read()` (all its bytes out, as numpy uint8).
"""

from __future__ import annotations

import ctypes as C
import os
from typing import Optional

DRIVER_ENV = "FLAGCX_MESH_CUDA_DRIVER"


class _Location(C.Structure):
    _fields_ = [("type", C.c_int), ("id", C.c_int)]


class _AllocProp(C.Structure):  # CUmemAllocationProp
    _fields_ = [("type", C.c_int), ("handle_types", C.c_int), ("location", _Location),
                ("win32_metadata", C.c_void_p), ("compression", C.c_ubyte), ("rdma", C.c_ubyte),
                ("usage", C.c_ushort), ("reserved", C.c_ubyte * 4)]


class _AccessDesc(C.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", C.c_int)]


_DEVICE, _PINNED, _POSIX_FD, _READ_WRITE = 1, 1, 1, 3


class _DriverBuf:
    def __init__(self, mem: "DriverMem", ptr: int, nbytes: int, release):
        self.mem, self.ptr, self.nbytes, self._release = mem, ptr, nbytes, release

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3}

    @property
    def obj(self):
        return self

    def write(self, data) -> None:
        self.mem.call("cuMemcpyHtoD_v2", C.c_ulonglong(self.ptr), C.c_void_p(data.ctypes.data), C.c_size_t(data.nbytes))

    def read(self):
        import numpy as np

        out = np.empty(self.nbytes, np.uint8)
        self.mem.call("cuMemcpyDtoH_v2", C.c_void_p(out.ctypes.data), C.c_ulonglong(self.ptr), C.c_size_t(self.nbytes))
        return out

    def free(self) -> None:
        if self._release:
            self._release()
            self._release = None


class DriverMem:
    """Device memory straight from the CUDA driver, device 0's primary context."""

    name = "driver"

    def __init__(self):
        path = os.environ.get(DRIVER_ENV) or "libcuda.so.1"
        try:
            self.lib = C.CDLL(path)
        except OSError as e:
            raise RuntimeError(f"--memory driver: cannot load the CUDA driver {path}: {e}") from e
        self.call("cuInit", 0)
        self.ctx = C.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", C.byref(self.ctx), 0)

    def call(self, name: str, *args) -> None:
        if name not in ("cuInit", "cuDevicePrimaryCtxRetain"):
            self.lib.cuCtxSetCurrent(self.ctx)
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} failed: CUresult {rc}")

    def gpu(self) -> Optional[str]:
        """Device 0's PCI bus id (which GPU of the host this process uses), None where the driver has no
        cuDeviceGetPCIBusId."""
        out = C.create_string_buffer(32)
        try:
            self.call("cuDeviceGetPCIBusId", out, 32, 0)
        except (AttributeError, RuntimeError):
            return None
        return out.value.decode()

    def buffer(self, nbytes: int, kind: str) -> _DriverBuf:
        """Zeroed device memory: kind "ipc" (cuMemAlloc) or "vmm" (cuMem, POSIX fd handle); "host":
        host memory."""
        import numpy as np

        if kind == "host":
            return _HostBuf(nbytes)
        if kind == "vmm":
            buf = self._cumem(nbytes)
        else:
            ptr = C.c_ulonglong()
            self.call("cuMemAlloc_v2", C.byref(ptr), C.c_size_t(nbytes))
            buf = _DriverBuf(self, ptr.value, nbytes, lambda: self.call("cuMemFree_v2", ptr))
        buf.write(np.zeros(nbytes, np.uint8))
        return buf

    def _cumem(self, nbytes: int) -> _DriverBuf:
        prop = _AllocProp()
        prop.type, prop.handle_types, prop.location = _PINNED, _POSIX_FD, _Location(_DEVICE, 0)
        g = C.c_size_t()
        self.call("cuMemGetAllocationGranularity", C.byref(g), C.byref(prop), 0)
        size = (nbytes + g.value - 1) // g.value * g.value
        handle, ptr = C.c_ulonglong(), C.c_ulonglong()
        self.call("cuMemCreate", C.byref(handle), C.c_size_t(size), C.byref(prop), C.c_ulonglong(0))
        self.call("cuMemAddressReserve", C.byref(ptr), C.c_size_t(size), C.c_size_t(0), C.c_ulonglong(0), C.c_ulonglong(0))
        self.call("cuMemMap", ptr, C.c_size_t(size), C.c_size_t(0), handle, C.c_ulonglong(0))
        desc = _AccessDesc(_Location(_DEVICE, 0), _READ_WRITE)
        self.call("cuMemSetAccess", ptr, C.c_size_t(size), C.byref(desc), C.c_size_t(1))

        def release():
            self.call("cuMemUnmap", ptr, C.c_size_t(size))
            self.call("cuMemAddressFree", ptr, C.c_size_t(size))
            self.call("cuMemRelease", handle)

        return _DriverBuf(self, ptr.value, nbytes, release)

    def copy_gbps(self, nbytes: int) -> Optional[float]:
        return None  # no local device copy reference without torch

    def sync(self) -> None:
        self.call("cuCtxSynchronize")


class _HostBuf:
    """Zeroed host memory (numpy): a target region in host memory ("host" kind), as a CPU tier of
    a KV cache is."""

    def __init__(self, nbytes: int):
        import numpy as np

        self.arr = np.zeros(nbytes, np.uint8)
        self.ptr, self.nbytes = self.arr.ctypes.data, nbytes

    @property
    def obj(self):
        return self.arr

    def write(self, data) -> None:
        self.arr[:] = data

    def read(self):
        return self.arr.copy()

    def free(self) -> None:
        self.arr = None


class _TorchBuf:
    def __init__(self, t):
        self.t, self.ptr, self.nbytes = t, t.data_ptr(), t.numel()

    @property
    def obj(self):
        return self.t

    def write(self, data) -> None:
        import torch

        self.t.copy_(torch.from_numpy(data))
        torch.cuda.synchronize()

    def read(self):
        return self.t.cpu().numpy()

    def free(self) -> None:
        self.t = None


class TorchMem:
    """torch CUDA tensors on device 0 ("vmm" memory: only with expandable segments, which the
    process must have set in PYTORCH_CUDA_ALLOC_CONF before torch started)."""

    name = "torch"

    def __init__(self):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("--memory torch: torch sees no CUDA device (a CPU build, or no GPU)")
        self.torch = torch

    def gpu(self) -> Optional[str]:
        """Device 0's PCI bus id (which GPU of the host this process uses)."""
        p = self.torch.cuda.get_device_properties(0)
        bus = getattr(p, "pci_bus_id", None)
        if bus is None:
            return None
        return f"{getattr(p, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(p, 'pci_device_id', 0):02x}.0"

    def buffer(self, nbytes: int, kind: str):
        if kind == "host":
            return _HostBuf(nbytes)
        if kind == "vmm" and "expandable_segments:True" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            raise RuntimeError("vmm memory from torch needs PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
        return _TorchBuf(self.torch.zeros(nbytes, dtype=self.torch.uint8, device="cuda"))

    def copy_gbps(self, nbytes: int, reps: int = 20) -> Optional[float]:
        """A local device-to-device copy_ of nbytes, GB/s (the reference every path is read by)."""
        import time

        torch = self.torch
        a = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
        b = torch.zeros_like(a)
        b.copy_(a)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            b.copy_(a)
        torch.cuda.synchronize()
        return nbytes * reps / (time.perf_counter() - t0) / 1e9

    def pinned_gbps(self, nbytes: int, reps: int = 10):
        """(device -> pinned host, pinned host -> device) GB/s of nbytes copies (the staged path's two stages)."""
        import time

        torch = self.torch
        dev = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        out = []
        for dst, src in ((host, dev), (dev, host)):
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            out.append(nbytes * reps / (time.perf_counter() - t0) / 1e9)
        return tuple(out)

    def sync(self) -> None:
        self.torch.cuda.synchronize()


def make(name: str):
    if name == "torch":
        return TorchMem()
    if name == "driver":
        return DriverMem()
    raise ValueError(f"unknown --memory {name!r} (torch or driver)")
