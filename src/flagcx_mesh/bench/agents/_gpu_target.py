"""The target process of `bench agent --device cuda` (agent_gpu.py starts it):

    python -m flagcx_mesh.bench agent-gpu-target --tool flagcx|mooncake|nixl --memory torch|driver
                                                 --size N --kind ipc|vmm --rfd R --wfd W

It starts the tool's endpoint (an agent, a transfer engine), allocates N zeroed bytes of device
memory (kind "ipc": cudaMalloc-like, "vmm": cuMem with a POSIX fd handle; "host": host memory,
the staged-host path's) and registers them,
timing both, then answers one JSON line per request read from fd R on fd W:

    {"op": "info"}           -> {"ok": true, "start_ms", "register_ms", "info": {what a peer needs},
                                 "gpu": its device's PCI bus id (None where unknown),
                                 "visible_devices": its CUDA_VISIBLE_DEVICES (None: unset)}
    {"op": "crc", "chunk": C} -> {"ok": true, "crcs": [crc32 of each C bytes of the buffer]}
    {"op": "staged-waits"}   -> {"ok": true, "waits": flagcx_mesh.cuda.staged_waits() of this process}
    {"op": "mesh", "uid": H} -> {"ok": true} at once; then (flagcx_mesh only) it joins a 2-rank mesh
                                of unique id H as rank 1 and registers its buffer as window 0
    {"op": "mesh-close"}     -> closes that mesh (the bench closes its rank meanwhile), {"ok": true}
    {"op": "bye"}            -> {"ok": true}, then it exits

A failure answers {"ok": false, "error": "..."} and exits non-zero. The pipe carries nothing
else (the tools' logs go to this process's stdout/stderr, which the bench keeps in a file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import zlib
from typing import Dict, List

from .. import _gpumem
from ._gpu_peers import mooncake_engine, nixl_agent, nixl_register

SECRET = "bench-agent-gpu"


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


class FlagcxTarget:
    def __init__(self, buf_factory):
        from ...agent import Agent

        t0 = time.perf_counter()
        self.agent = Agent("bench-gpu-target", SECRET)
        self.start_ms = _ms(t0)
        self.buf = buf_factory()
        t0 = time.perf_counter()
        self.region = self.agent.register(self.buf.obj)
        self.register_ms = _ms(t0)
        self.info = {"metadata": self.agent.metadata().hex(), "descriptor": self.region.descriptor.hex()}

    def mesh_open(self, uid: bytes) -> None:
        """Joins the bench's 2-rank mesh on a thread (the build is collective: this loop answers meanwhile)."""
        import threading

        from ...mesh import Mesh

        def join():
            try:
                self.mesh = Mesh(2, uid, 1, timeout=60)
                self.mesh.register_window(self.buf.obj)
            except BaseException as e:  # reported by mesh-close; the bench's side fails on its own
                self.mesh_error = e

        self.mesh, self.mesh_error = None, None
        self.mesh_thread = threading.Thread(target=join, daemon=True)
        self.mesh_thread.start()

    def mesh_close(self) -> None:
        self.mesh_thread.join(120)
        if self.mesh_error is not None or self.mesh is None:
            raise RuntimeError(f"joining the mesh: {self.mesh_error!r}")
        self.mesh.close()

    def close(self) -> None:
        self.agent.close()


class MooncakeTarget:
    def __init__(self, buf_factory, protocol: str):
        t0 = time.perf_counter()
        self.engine, session = mooncake_engine(protocol)
        self.start_ms = _ms(t0)
        self.buf = buf_factory()
        t0 = time.perf_counter()
        rc = self.engine.register_memory(self.buf.ptr, self.buf.nbytes)
        self.register_ms = _ms(t0)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory of {self.buf.nbytes} bytes of GPU memory returned {rc}")
        self.info = {"session": session, "ptr": self.buf.ptr}

    def close(self) -> None:
        self.engine.unregister_memory(self.buf.ptr)


class NixlTarget:
    def __init__(self, buf_factory):
        t0 = time.perf_counter()
        self.agent = nixl_agent("bench-gpu-target")
        self.start_ms = _ms(t0)
        self.buf = buf_factory()
        t0 = time.perf_counter()
        self.reg = nixl_register(self.agent, self.buf)
        self.register_ms = _ms(t0)
        self.info = {"metadata": self.agent.get_agent_metadata().hex(), "ptr": self.buf.ptr}

    def close(self) -> None:
        self.agent.deregister_memory(self.reg)


def _crcs(buf, chunk: int) -> List[int]:
    data = buf.read()
    return [zlib.crc32(data[o:o + chunk]) for o in range(0, len(data), chunk)]


def _answer(w, msg: Dict) -> None:
    os.write(w, (json.dumps(msg) + "\n").encode())


def _requests(r):
    pending = b""
    while True:
        chunk = os.read(r, 65536)
        if not chunk:
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            yield json.loads(line)


def _make(args):
    mem = _gpumem.make(args.memory)

    def factory():
        return mem.buffer(args.size, args.kind)

    if args.tool == "flagcx_mesh":
        target = FlagcxTarget(factory)
    elif args.tool == "mooncake":
        target = MooncakeTarget(factory, args.mooncake_protocol)
    elif args.tool == "nixl":
        target = NixlTarget(factory)
    else:
        raise ValueError(f"unknown --tool {args.tool!r}")
    target.gpu = mem.gpu() if args.kind != "host" else None  # (staged-host: no GPU work there)
    return target


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m flagcx_mesh.bench agent-gpu-target")
    p.add_argument("--tool", required=True)
    p.add_argument("--memory", default="torch")
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--kind", default="ipc", choices=("ipc", "vmm", "host"))
    p.add_argument("--mooncake-protocol", default="nvlink_intra")
    p.add_argument("--rfd", type=int, required=True)
    p.add_argument("--wfd", type=int, required=True)
    args = p.parse_args(argv)
    try:
        target = _make(args)
    except BaseException as e:  # the bench prints the reason; the traceback goes to the log
        traceback.print_exc()
        _answer(args.wfd, {"ok": False, "error": f"target start: {type(e).__name__}: {e}"})
        return 1
    try:
        for req in _requests(args.rfd):
            if req["op"] == "info":
                _answer(args.wfd, {"ok": True, "start_ms": target.start_ms, "register_ms": target.register_ms,
                                   "info": target.info, "gpu": target.gpu,
                                   "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")})
            elif req["op"] == "crc":
                _answer(args.wfd, {"ok": True, "crcs": _crcs(target.buf, int(req["chunk"]))})
            elif req["op"] == "staged-waits":
                from ...cuda import staged_waits

                _answer(args.wfd, {"ok": True, "waits": staged_waits()})
            elif req["op"] == "mesh":
                target.mesh_open(bytes.fromhex(req["uid"]))
                _answer(args.wfd, {"ok": True})
            elif req["op"] == "mesh-close":
                target.mesh_close()
                _answer(args.wfd, {"ok": True})
            elif req["op"] == "bye":
                target.close()
                _answer(args.wfd, {"ok": True})
                return 0
            else:
                raise ValueError(f"unknown request {req!r}")
    except BaseException as e:
        traceback.print_exc()
        _answer(args.wfd, {"ok": False, "error": f"target: {type(e).__name__}: {e}"})
        return 1
    return 0  # the bench went away: nothing more to serve


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
