"""Window and region descriptors built and taken apart byte by byte, for tests that forge them.

The layouts are WindowDesc::encode() (csrc/transport/path.cc) and RegionDesc::encode()
(csrc/agent/region.cc); seal() is window_seal() (csrc/transport/binding.cc), which a process that
forges a description of its own memory must publish at the description's cookie address.
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
from dataclasses import dataclass, field, replace
from typing import List, Tuple

M64 = (1 << 64) - 1
UCX_BLOCK = 0x55  # the tag of a description's optional UCX block (csrc/transport/path.cc)


def _s(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


@dataclass
class Win:
    kind: int = 1
    size: int = 0
    addr: int = 0
    pid: int = 0
    host: bytes = b""
    ns: bytes = b""
    shm_name: bytes = b""
    cookie_addr: int = 0
    cookie: int = 0
    ordinal: int = -1
    ipc: bool = False
    ipc_handle: bytes = bytes(64)
    ipc_offset: int = 0
    vmm: List[Tuple[int, int]] = field(default_factory=list)
    why_no_ipc: bytes = b""
    why_no_vmm: bytes = b""
    fd_socket: bytes = b""
    fd_token: int = 0
    # The optional UCX block (transport/ucx): present only when ucx_rkey is not empty.
    ucx_rkey: bytes = b""
    ucx_transports: bytes = b""
    ucx_worker: bytes = b""

    def encode(self) -> bytes:
        return self.encode_fixed() + self.encode_ucx()

    def encode_ucx(self) -> bytes:
        if not self.ucx_rkey:
            return b""
        return bytes([UCX_BLOCK]) + _s(self.ucx_rkey) + _s(self.ucx_transports) + _s(self.ucx_worker)

    def encode_fixed(self) -> bytes:
        return (struct.pack("<IQQi", self.kind, self.size, self.addr, self.pid) + _s(self.host) + _s(self.ns) +
                _s(self.shm_name) + struct.pack("<QQiB", self.cookie_addr, self.cookie, self.ordinal, self.ipc) +
                self.ipc_handle + struct.pack("<QI", self.ipc_offset, len(self.vmm)) +
                b"".join(struct.pack("<qQ", o, n) for o, n in self.vmm) + _s(self.why_no_ipc) +
                _s(self.why_no_vmm) + _s(self.fd_socket) + struct.pack("<Q", self.fd_token))

    @staticmethod
    def decode(b: bytes) -> "Win":
        kind, size, addr, pid = struct.unpack_from("<IQQi", b, 0)
        off = 24
        strs = []

        def string():
            nonlocal off
            (n,) = struct.unpack_from("<I", b, off)
            off += 4 + n
            return b[off - n:off]

        host, ns, shm = string(), string(), string()
        cookie_addr, cookie, ordinal, ipc = struct.unpack_from("<QQiB", b, off)
        off += 21
        handle = b[off:off + 64]
        off += 64
        ipc_offset, nmaps = struct.unpack_from("<QI", b, off)
        off += 12
        vmm = []
        for _ in range(nmaps):
            vmm.append(struct.unpack_from("<qQ", b, off))
            off += 16
        why_ipc, why_vmm, sock = string(), string(), string()
        (token,) = struct.unpack_from("<Q", b, off)
        off += 8
        del strs
        ucx = [b"", b"", b""]
        if off < len(b) and b[off] == UCX_BLOCK:
            off += 1
            ucx = [string(), string(), string()]
        return Win(kind, size, addr, pid, host, ns, shm, cookie_addr, cookie, ordinal, bool(ipc), handle, ipc_offset,
                   vmm, why_ipc, why_vmm, sock, token, *ucx)

    def seal(self, index: int) -> int:
        enc = self.encode()  # canonical: the IPC flag 0 or 1
        h = hashlib.sha256(b"flagcx_mesh window seal v2\0")
        h.update(struct.pack("<QQ", index & M64, len(enc)))
        h.update(enc)
        v = struct.unpack("<Q", h.digest()[:8])[0]
        return v or 1


class SealCell:
    """A u64 of this process holding the seal of a forged description of its own memory."""

    def __init__(self):
        self.cell = ctypes.c_uint64(0)
        self.addr = ctypes.addressof(self.cell)

    def publish(self, w: Win, index: int) -> Win:
        w = replace(w, cookie_addr=self.addr)
        self.cell.value = w.seal(index)
        return w


REGION_MAGIC = 0x52415846


@dataclass
class Region:
    agent: bytes
    incarnation: bytes
    index: int
    size: int
    kind: int
    window: bytes

    def encode(self) -> bytes:
        return (struct.pack("<I", REGION_MAGIC) + _s(self.agent) + self.incarnation +
                struct.pack("<IQII", self.index, self.size, self.kind, len(self.window)) + self.window)

    @staticmethod
    def decode(b: bytes) -> "Region":
        (n,) = struct.unpack_from("<I", b, 4)
        agent = b[8:8 + n]
        off = 8 + n
        inc = b[off:off + 16]
        index, size, kind, wlen = struct.unpack_from("<IQII", b, off + 16)
        window = b[off + 36:off + 36 + wlen]
        return Region(agent, inc, index, size, kind, window)

    def win(self) -> Win:
        return Win.decode(self.window)

    def with_win(self, w: Win, **kw) -> "Region":
        return replace(self, window=w.encode(), **kw)
