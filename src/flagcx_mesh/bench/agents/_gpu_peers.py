"""The initiators `bench agent --device cuda` drives (agent_gpu.py), one per tool, each against
a target in another process (_gpu_target.py) on the same GPU:

  flagcx_mesh  an Agent; connect(metadata); batch_write of (region, offset) ops
  mooncake     Mooncake TE (mooncake-transfer-engine-cuda13), P2PHANDSHAKE, its intra-node
               NVLink transport ("nvlink_intra", cudaIpc between processes); no connect call
               (the first transfer opens the peer's segment); batch_transfer_sync_write
  nixl         a NIXL agent (nixl-cu13), UCX backend, "VRAM" descriptors; add_remote_agent +
               make_connection; one prepared transfer handle per batch, posted and polled

Each gives: start(name) -> endpoint, register(ep, buf) -> local, connect(ep, info) -> conn,
prepare(ep, conn, local, buf, info, pairs, block) -> a call that moves those blocks and returns
once they landed, path(conn, local, info), close(ep, local). A tool that cannot run raises with
the reason at construction or at the step that failed; the bench reports it and goes on.
"""

from __future__ import annotations

import os
import time
from typing import Callable, List, Tuple

from ._peers import _version

SECRET = "bench-agent-gpu"
XFER_TIMEOUT = 60.0  # seconds a NIXL transfer may stay in PROC


# ---------------------------------------------------------------- shared with the target process

def mooncake_engine(protocol: str):
    """A started TransferEngine on 127.0.0.1 (P2P handshake: no metadata server) and its session."""
    import mooncake.engine as mc

    if protocol == "nvlink_intra" and not getattr(mc, "SUPPORT_INTRA_NVLINK", False):
        raise RuntimeError("this mooncake.engine was built without the intra-node NVLink transport "
                           "(SUPPORT_INTRA_NVLINK is false)")
    e = mc.TransferEngine()
    rc = e.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize(127.0.0.1, P2PHANDSHAKE, {protocol}) returned {rc}")
    return e, f"127.0.0.1:{e.get_rpc_port()}"


def nixl_agent(name: str):
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from nixl._api import nixl_agent as make, nixl_agent_config

    a = make(f"{name}-{os.getpid()}-{time.monotonic_ns()}", nixl_agent_config(backends=["UCX"]))
    if "UCX" not in getattr(a, "backends", {"UCX": None}):
        raise RuntimeError("NIXL's UCX backend did not start")
    return a


def nixl_register(agent, buf):
    reg = agent.register_memory([(buf.ptr, buf.nbytes, 0, "")], "VRAM")
    if reg is None:
        raise RuntimeError(f"NIXL register_memory of {buf.nbytes} bytes of VRAM failed")
    return reg


# ---------------------------------------------------------------- initiators

class FlagcxTool:
    name, like = "flagcx_mesh", None

    def __init__(self):
        from ... import __version__
        from ...agent import Agent

        self.Agent, self.version, self.how = Agent, f"flagcx_mesh {__version__}", "agents"

    def start(self, name: str):
        return self.Agent(name, SECRET)

    def register(self, ep, buf):
        return ep.register(buf.obj)

    def connect(self, ep, info):
        return ep.connect(bytes.fromhex(info["metadata"]))

    def prepare(self, ep, conn, local, buf, info, pairs, block) -> Callable[[], None]:
        remote = bytes.fromhex(info["descriptor"])
        if len(pairs) == 1:  # a blocking block: the one call that issues and waits
            (s, d), = pairs
            return lambda: conn.write_sync(local, remote, block, s, d, timeout=XFER_TIMEOUT)
        ops = [(local, s, remote, d, block) for s, d in pairs]
        return lambda: conn.batch_write(ops).wait(XFER_TIMEOUT)

    def path(self, conn, local, info) -> str:
        return conn.path_to(bytes.fromhex(info["descriptor"]), local)

    def close(self, ep, local) -> None:
        ep.close()


class MooncakeTool:
    name, like = "mooncake", "cuda-ipc"  # cudaIpc handles opened by the peer, as cuda-ipc does

    def __init__(self, protocol: str = "nvlink_intra"):
        import mooncake.engine  # noqa: F401 (raises what is missing: the package, libcuda, ...)

        self.protocol = protocol
        self.version = _version("mooncake-transfer-engine-cuda13", "mooncake-transfer-engine")
        self.how = f"{protocol} transport, P2PHANDSHAKE, GPU memory, target in another process"

    def start(self, name: str):
        return mooncake_engine(self.protocol)[0]

    def register(self, ep, buf):
        rc = ep.register_memory(buf.ptr, buf.nbytes)
        if rc != 0:
            raise RuntimeError(f"register_memory of {buf.nbytes} bytes of GPU memory returned {rc}")
        return buf.ptr

    def connect(self, ep, info):
        return None  # no connect call: the first transfer opens the peer's segment

    def prepare(self, ep, conn, local, buf, info, pairs, block) -> Callable[[], None]:
        session, base = info["session"], int(info["ptr"])
        srcs = [local + s for s, _ in pairs]
        dsts = [base + d for _, d in pairs]
        lens = [block] * len(pairs)

        def run():
            rc = ep.batch_transfer_sync_write(session, srcs, dsts, lens)
            if rc != 0:
                raise RuntimeError(f"batch_transfer_sync_write of {len(pairs)} x {block} bytes returned {rc}")
        return run

    def path(self, conn, local, info) -> str:
        return self.protocol

    def close(self, ep, local) -> None:
        if local is not None:
            ep.unregister_memory(local)


class NixlTool:
    name, like = "nixl", "cuda-ipc"  # UCX's cuda_ipc transport between processes of one GPU

    def __init__(self):
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        from nixl._api import nixl_agent  # noqa: F401 (raises what is missing)

        self.version = _version("nixl-cu13", "nixl-cu12", "nixl")
        self.how = "UCX backend, VRAM, metadata passed over a pipe, target in another process"
        self.handles: List[Tuple[object, object]] = []

    def start(self, name: str):
        return nixl_agent(name)

    def register(self, ep, buf):
        return (nixl_register(ep, buf), buf.ptr)

    def connect(self, ep, info):
        peer = ep.add_remote_agent(bytes.fromhex(info["metadata"]))
        ep.make_connection(peer)
        return peer

    def prepare(self, ep, conn, local, buf, info, pairs, block) -> Callable[[], None]:
        base = int(info["ptr"])
        lo = ep.get_xfer_descs([(local[1] + s, block, 0) for s, _ in pairs], "VRAM")
        re = ep.get_xfer_descs([(base + d, block, 0) for _, d in pairs], "VRAM")
        h = ep.initialize_xfer("WRITE", lo, re, conn)
        self.handles.append((ep, h))

        def run():
            state = ep.transfer(h)
            end = time.monotonic() + XFER_TIMEOUT
            while state == "PROC":
                if time.monotonic() > end:
                    raise TimeoutError(f"a NIXL WRITE of {len(pairs)} x {block} bytes stayed PROC {XFER_TIMEOUT} s")
                state = ep.check_xfer_state(h)
            if state != "DONE":
                raise RuntimeError(f"a NIXL WRITE of {len(pairs)} x {block} bytes ended {state}")
        return run

    def path(self, conn, local, info) -> str:
        return "ucx"

    def close(self, ep, local) -> None:
        for owner, h in [x for x in self.handles if x[0] is ep]:
            owner.release_xfer_handle(h)
        self.handles = [x for x in self.handles if x[0] is not ep]
        if local is not None:
            ep.deregister_memory(local[0])


def load(name: str, mooncake_protocol: str):
    """The initiator of peer `name`; raises with the reason it cannot run here."""
    if name == "mooncake":
        return MooncakeTool(mooncake_protocol)
    if name == "nixl":
        return NixlTool()
    raise ValueError(f"unknown peer {name!r} (known: mooncake, nixl)")
