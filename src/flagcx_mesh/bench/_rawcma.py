"""The kernel's own cost of a request's blocks over cma, no library between: ``process_vm_writev``
called through ctypes with the blocks' iovecs (IOV_MAX a call), beside the same bytes as one
iovec per layer, between the same two processes' buffers. Scattered / contiguous here is the
ceiling of any library's batch / contiguous over cma on that machine: each remote iovec pays the
kernel's page pinning, whoever issues it."""

from __future__ import annotations

import ctypes
import os
import time
from typing import List, Sequence, Tuple

IOV_MAX = 1024

Span = Tuple[int, int, int]  # (local address, remote address, bytes)


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_writev.restype = ctypes.c_ssize_t
_libc.process_vm_writev.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                                    ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]


def prepare(spans: Sequence[Span]) -> List[Tuple[ctypes.Array, ctypes.Array, int]]:
    """The spans as iovec arrays of up to IOV_MAX each (made before the clock starts, as a
    library's prepared lists are): (local iovecs, remote iovecs, bytes)."""
    calls = []
    for at in range(0, len(spans), IOV_MAX):
        part = spans[at:at + IOV_MAX]
        local = (_Iovec * len(part))(*[_Iovec(s[0], s[2]) for s in part])
        remote = (_Iovec * len(part))(*[_Iovec(s[1], s[2]) for s in part])
        calls.append((local, remote, sum(s[2] for s in part)))
    return calls


def write_seconds(pid: int, calls) -> float:
    """Seconds to write every prepared call into process ``pid``; OSError on a failed or short
    call (a short one would need the rest moved, which this reference does not do)."""
    t0 = time.perf_counter()
    for local, remote, nbytes in calls:
        got = _libc.process_vm_writev(pid, local, len(local), remote, len(remote), 0)
        if got != nbytes:
            err = ctypes.get_errno() if got < 0 else 0
            raise OSError(err, f"process_vm_writev moved {got} of {nbytes} bytes: {os.strerror(err) if err else 'short'}")
    return time.perf_counter() - t0
