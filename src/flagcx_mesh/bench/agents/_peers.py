"""The peers `bench agent` measures flagcx_mesh's agents beside: Mooncake's transfer engine and
NIXL, each driven through its own Python package on host memory, two endpoints in this process
as for the agents. Each peer gives the same figures as the agents' measurement:

  setup(region)          start, register, connect, first 4 KiB write (ms)
  request(block, count)  pipelined (one batch) and blocking (a wait per block) GB/s
  churn(n)               a fresh initiator: start, connect, one write, gone; per second

Neither package is a dependency of flagcx_mesh: `load(name)` imports one and says why it
cannot run when it cannot (a missing package, a shared library it needs, a backend absent).
"""

from __future__ import annotations

import os
import time
from importlib import metadata
from typing import Dict, List, Tuple


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def layout(block: int, count: int, limit: int) -> Tuple[int, List[Tuple[int, int]]]:
    """Buffer size and (local, remote) offsets of `count` blocks, remote ones reversed; the
    blocks wrap within `limit` bytes (a large block x count needs no more memory than that)."""
    size = min(block * count, max(block, limit - limit % block))
    slots = size // block
    return size, [((i % slots) * block, ((count - 1 - i) % slots) * block) for i in range(count)]


def _version(*dists: str) -> str:
    for d in dists:
        try:
            return f"{d} {metadata.version(d)}"
        except metadata.PackageNotFoundError:
            continue
    return "unknown version"


class Mooncake:
    """Mooncake TE over its tcp transport (P2P handshake: no metadata server), host memory."""

    name = "mooncake"
    like = "tcp"  # the flagcx_mesh path its figures compare with
    how = "tcp transport, P2PHANDSHAKE, host memory"
    # Its tcp transport refuses a batch beyond 1024 queued (+1024 waiting) transfers a peer by
    # default (a request's 4096 blocks fail whole: "TCP lane queue-full rejection"); deployments
    # raise both to their maximum, as here unless already set.
    QUEUE_LIMITS = ("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER")

    def __init__(self, np):
        for k in self.QUEUE_LIMITS:
            os.environ.setdefault(k, "65535")
        self.how = f"{Mooncake.how}, " + ", ".join(f"{k}={os.environ[k]}" for k in self.QUEUE_LIMITS)
        from mooncake.engine import TransferEngine  # noqa: F401 (raises what is missing)

        self.np, self.TE = np, TransferEngine
        self.version = _version("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")

    def _engine(self):
        e = self.TE()
        if e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("TransferEngine.initialize(127.0.0.1, P2PHANDSHAKE, tcp) failed")
        return e, f"127.0.0.1:{e.get_rpc_port()}"

    def _pair(self, size: int):
        np = self.np
        target, where = self._engine()
        init, _ = self._engine()
        src, dst = np.ones(size, np.uint8), np.zeros(size, np.uint8)
        for e, b in ((target, dst), (init, src)):
            if e.register_memory(b.ctypes.data, b.nbytes) != 0:
                raise RuntimeError("register_memory failed")
        return target, init, where, src, dst

    def _write(self, e, where, src, dst, size, s_off=0, d_off=0):
        if e.transfer_sync_write(where, src.ctypes.data + s_off, dst.ctypes.data + d_off, size) != 0:
            raise RuntimeError(f"transfer_sync_write of {size} bytes failed")

    def setup(self, region: int) -> Dict[str, float]:
        np = self.np
        t0 = time.perf_counter()
        target, where = self._engine()
        start = _ms(t0)
        dst = np.zeros(region, np.uint8)
        t0 = time.perf_counter()
        target.register_memory(dst.ctypes.data, dst.nbytes)
        reg = _ms(t0)
        init, _ = self._engine()
        src = np.ones(region, np.uint8)
        init.register_memory(src.ctypes.data, src.nbytes)
        t0 = time.perf_counter()  # no connect call: the first transfer to a peer opens its segment
        self._write(init, where, src, dst, 4096)
        first = _ms(t0)
        return {"agent_start_ms": start, "register_ms": reg, "connect_ms": None, "first_write_ms": first}

    def request(self, block: int, count: int, limit: int, reps: int) -> Dict[str, float]:
        size, offs = layout(block, count, limit)
        target, init, where, src, dst = self._pair(size)
        s0, d0 = src.ctypes.data, dst.ctypes.data
        srcs, dsts, lens = [s0 + s for s, _ in offs], [d0 + d for _, d in offs], [block] * count

        def batch():
            if init.batch_transfer_sync_write(where, srcs, dsts, lens) != 0:
                raise RuntimeError("batch_transfer_sync_write failed")

        batch()
        t0 = time.perf_counter()
        for _ in range(reps):
            batch()
        pipe = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(reps):
            for s, d in offs:
                self._write(init, where, src, dst, block, s, d)
        blocking = time.perf_counter() - t0
        total = block * count * reps / 1e9
        return {"path": "tcp", "pipelined_GBps": total / pipe, "blocking_GBps": total / blocking}

    def churn(self, n: int) -> float:
        np = self.np
        target, where = self._engine()
        dst = np.zeros(4096, np.uint8)
        target.register_memory(dst.ctypes.data, dst.nbytes)
        t0 = time.perf_counter()
        for _ in range(n):
            e, _ = self._engine()
            src = np.ones(4096, np.uint8)
            e.register_memory(src.ctypes.data, src.nbytes)
            self._write(e, where, src, dst, 4096)
            e.unregister_memory(src.ctypes.data)
            del e
        return n / (time.perf_counter() - t0)


class Nixl:
    """NIXL agents with the UCX backend (UCX picks its own transport: UCX_TLS), host memory."""

    name = "nixl"
    like = "cma"  # on one host UCX copies between processes' memory, as cma does
    how = "UCX backend, DRAM, metadata exchanged in process"

    def __init__(self, np):
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        from nixl._api import nixl_agent, nixl_agent_config  # noqa: F401 (raises what is missing)

        self.np, self.make, self.config = np, nixl_agent, nixl_agent_config
        self.version = _version("nixl-cu13", "nixl-cu12", "nixl")
        self.serial = 0

    def _agent(self, prefix: str):
        self.serial += 1
        a = self.make(f"{prefix}-{self.serial}", self.config(backends=["UCX"]))
        if "UCX" not in a.backends:
            raise RuntimeError("the UCX backend did not start")
        return a

    def _register(self, a, buf):
        return a.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")

    def _connect(self, init, target):
        name = init.add_remote_agent(target.get_agent_metadata())
        init.make_connection(name)
        return name

    def _write(self, init, peer, local, remote):
        h = init.initialize_xfer("WRITE", local, remote, peer)
        state = init.transfer(h)
        while state == "PROC":
            state = init.check_xfer_state(h)
        init.release_xfer_handle(h)
        if state != "DONE":
            raise RuntimeError(f"a NIXL WRITE ended {state}")

    def _descs(self, a, base, offs, size):
        return a.get_xfer_descs([(base + o, size, 0) for o in offs], "DRAM")

    def setup(self, region: int) -> Dict[str, float]:
        np = self.np
        t0 = time.perf_counter()
        target = self._agent("bench-target")
        start = _ms(t0)
        dst = np.zeros(region, np.uint8)
        t0 = time.perf_counter()
        self._register(target, dst)
        reg = _ms(t0)
        init = self._agent("bench-init")
        src = np.ones(region, np.uint8)
        self._register(init, src)
        t0 = time.perf_counter()
        peer = self._connect(init, target)
        con = _ms(t0)
        t0 = time.perf_counter()
        self._write(init, peer, self._descs(init, src.ctypes.data, [0], 4096),
                    self._descs(target, dst.ctypes.data, [0], 4096))
        first = _ms(t0)
        return {"agent_start_ms": start, "register_ms": reg, "connect_ms": con, "first_write_ms": first}

    def request(self, block: int, count: int, limit: int, reps: int) -> Dict[str, float]:
        np = self.np
        size, offs = layout(block, count, limit)
        target, init = self._agent("bench-target"), self._agent("bench-init")
        src, dst = np.ones(size, np.uint8), np.zeros(size, np.uint8)
        self._register(target, dst)
        self._register(init, src)
        peer = self._connect(init, target)
        local = self._descs(init, src.ctypes.data, [s for s, _ in offs], block)
        remote = self._descs(target, dst.ctypes.data, [d for _, d in offs], block)
        one = [(self._descs(init, src.ctypes.data, [s], block), self._descs(target, dst.ctypes.data, [d], block))
               for s, d in offs]
        self._write(init, peer, local, remote)
        t0 = time.perf_counter()
        for _ in range(reps):
            self._write(init, peer, local, remote)
        pipe = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(reps):
            for lo, re in one:
                self._write(init, peer, lo, re)
        blocking = time.perf_counter() - t0
        total = block * count * reps / 1e9
        return {"path": "ucx", "pipelined_GBps": total / pipe, "blocking_GBps": total / blocking}

    def churn(self, n: int) -> float:
        np = self.np
        target = self._agent("bench-target")
        dst = np.zeros(4096, np.uint8)
        self._register(target, dst)
        remote = self._descs(target, dst.ctypes.data, [0], 4096)
        t0 = time.perf_counter()
        for _ in range(n):
            a = self._agent("churn")
            src = np.ones(4096, np.uint8)
            self._register(a, src)
            peer = self._connect(a, target)
            self._write(a, peer, self._descs(a, src.ctypes.data, [0], 4096), remote)
            a.remove_remote_agent(peer)
            del a
        return n / (time.perf_counter() - t0)


PEERS = {"mooncake": Mooncake, "nixl": Nixl}


def load(name: str, np):
    """The peer `name`, ready to measure; raises with the reason it cannot run here."""
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r} (known: {', '.join(PEERS)})")
    return PEERS[name](np)
