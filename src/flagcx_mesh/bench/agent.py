"""Agents (dynamic peers): set-up costs, request-shaped transfers and churn, per path,
beside memcpy of the same bytes measured in the same run.

    python -m flagcx_mesh.bench agent [--region 256M] [--blocks 64K,256K,2M] [--count 64]
                                      [--transports cma,shm,tcp] [--churn 50] [--json PATH]

Two agents in this process (FLAGCX_MESH_TRANSPORT forced per path; cma and shm work within one
process as between two). Figures:

  setup     agent start, register of a --region host buffer, connect, first write (ms)
  request   --count blocks of each --blocks size written as one batch: pipelined (one handle
            for the batch) and blocking (a wait per block), GB/s, and their ratio to memcpy
  churn     connect + one write + close of a fresh initiator agent, connections per second

Mooncake TE and NIXL are not measured here: neither is installed with this package.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Dict, List, Optional

from ._ranks import save_json
from ._sizes import parse_size, size_name

SECRET = "bench-agent"


def _parse(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flagcx_mesh.bench agent")
    p.add_argument("--region", default="256M")
    p.add_argument("--blocks", default="64K,256K,2M")
    p.add_argument("--count", type=int, default=64)
    p.add_argument("--transports", default="cma,shm,tcp")
    p.add_argument("--churn", type=int, default=50)
    p.add_argument("--json", metavar="PATH")
    return p.parse_args(argv)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def _setup(np, Agent, region: int) -> Dict[str, float]:
    t0 = time.perf_counter()
    target = Agent("bench-target", SECRET)
    start = _ms(t0)
    buf = np.zeros(region, np.uint8)
    t0 = time.perf_counter()
    remote = target.register(buf)
    reg = _ms(t0)
    init = Agent("bench-init", SECRET)
    src = init.register(np.ones(region, np.uint8))
    t0 = time.perf_counter()
    conn = init.connect(target.metadata())
    con = _ms(t0)
    t0 = time.perf_counter()
    conn.write(src, remote, 4096).wait(30)
    first = _ms(t0)
    init.close()
    target.close()
    return {"agent_start_ms": start, "register_ms": reg, "connect_ms": con, "first_write_ms": first}


def _request(np, Agent, block: int, count: int) -> Dict[str, float]:
    with Agent("bench-target", SECRET) as t, Agent("bench-init", SECRET) as a:
        srcbuf = np.ones(block * count, np.uint8)
        if os.environ.get("FLAGCX_MESH_TRANSPORT") == "shm":  # shm reaches memory the agent allocated
            remote = t.alloc(block * count)
            dst = np.frombuffer(remote.view, np.uint8)
        else:
            dst = np.zeros(block * count, np.uint8)
            remote = t.register(dst)
        local = a.register(srcbuf)
        conn = a.connect(t.metadata())
        ops = [(local, i * block, remote, (count - 1 - i) * block, block) for i in range(count)]
        conn.batch_write(ops).wait(60)  # paths chosen, pages touched
        reps = max(1, (256 << 20) // (block * count))
        t0 = time.perf_counter()
        for _ in range(reps):
            conn.batch_write(ops).wait(60)
        pipe = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(reps):
            for op in ops:
                conn.batch_write([op]).wait(60)
        blocking = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(reps):
            dst[:] = srcbuf
        mem = time.perf_counter() - t0
        total = block * count * reps / 1e9
        return {"path": conn.path_to(remote), "pipelined_GBps": total / pipe, "blocking_GBps": total / blocking,
                "memcpy_GBps": total / mem}


def _churn(np, Agent, n: int) -> float:
    with Agent("bench-target", SECRET) as t:
        remote = t.register(np.zeros(4096, np.uint8))
        md = t.metadata()
        t0 = time.perf_counter()
        for i in range(n):
            with Agent(f"churn-{i}", SECRET) as a:
                a.connect(md).write(a.register(np.ones(4096, np.uint8)), remote, 4096).wait(30)
        return n / (time.perf_counter() - t0)


def main(argv: Optional[List[str]] = None) -> int:
    args = _parse(list(argv or []))
    import numpy as np

    from ..agent import Agent

    out: Dict[str, Dict] = {}
    for transport in [t for t in args.transports.split(",") if t]:
        os.environ["FLAGCX_MESH_TRANSPORT"] = transport
        fig: Dict = {"setup": _setup(np, Agent, parse_size(args.region))}
        s = fig["setup"]
        print(f"[{transport}] start {s['agent_start_ms']:.2f} ms, register {args.region} {s['register_ms']:.3f} ms, "
              f"connect {s['connect_ms']:.2f} ms, first write {s['first_write_ms']:.2f} ms")
        for b in [parse_size(x) for x in args.blocks.split(",") if x]:
            r = _request(np, Agent, b, args.count)
            fig[f"request_{size_name(b)}"] = r
            print(f"[{transport}] {args.count} x {size_name(b)} over {r['path']}: pipelined {r['pipelined_GBps']:.2f} GB/s, "
                  f"blocking {r['blocking_GBps']:.2f} GB/s, memcpy {r['memcpy_GBps']:.2f} GB/s "
                  f"(pipelined/memcpy {r['pipelined_GBps'] / r['memcpy_GBps']:.2f})")
        if args.churn:
            fig["churn_per_s"] = _churn(np, Agent, args.churn)
            print(f"[{transport}] churn: {fig['churn_per_s']:.0f} connect+write+close per second")
        out[transport] = fig
    save_json(out, args.json)
    return 0
