"""The P2P engine form (compat.p2p) against the agent it runs on, in the same run.

    python -m flagcx_mesh.bench p2p [--blocks 4K,64K,1M] [--count 64] [--layers 4]
                                    [--transports cma,tcp] [--reps 0] [--json PATH]

Two engines in this process (FLAGCX_MESH_TRANSPORT forced per path). The target registers
--layers KV layers of --count blocks each, the writer the same; one request writes every block of
every layer, the blocks scattered (block i to block count-1-i, so no run coalesces): --layers x
--count entries in one call. Figures per block size:

  get_conn   connect + the region-table request and answer (ms, first session)
  p2p        conn.batch_write_sync(src_vas, dst_vas, sizes): absolute addresses mapped to
             regions on both sides, then one agent call and its wait (GB/s, median us per call)
  agent      conn.write_blocks(local, remote, table).wait() with the (n, 5) table built
             beforehand: the same bytes, without the mapping (GB/s, median us per call)
The two are called in alternation, --reps times each.
  mapping    the address mapping alone (checks, both tables, the agent call's arguments built:
             the numpy table from 16 entries, per-entry ops below or when an entry spans two
             registrations), us per entry
  ratio      p2p / agent throughput
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Dict, List, Optional

from .._ranks import save_json
from .._sizes import parse_size, size_name

SECRET = "bench-p2p"


def _parse(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flagcx_mesh.bench p2p")
    p.add_argument("--blocks", default="4K,64K,1M", help="block sizes, comma-separated (default 4K,64K,1M)")
    p.add_argument("--count", type=int, default=64, help="blocks per layer in one call (default 64)")
    p.add_argument("--layers", type=int, default=4, help="layers (regions) per call (default 4)")
    p.add_argument("--transports", default="cma,tcp", help="host paths to measure, comma-separated (default cma,tcp)")
    p.add_argument("--reps", type=int, default=0, help="calls of each per figure (0: about 256 MiB moved, 9..101)")
    p.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    return p.parse_args(argv)


def _medians(a, b, reps: int):
    """Median seconds per call of a and of b, called in alternation (drift hits both alike)."""
    ta, tb = [], []
    for _ in range(reps):
        for fn, out in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return sorted(ta)[reps // 2], sorted(tb)[reps // 2]


def _one(np, p2p, block: int, count: int, layers: int, reps: int) -> Dict[str, float]:
    target = p2p.engine_create(secret=SECRET, timeout=120)
    writer = p2p.engine_create(secret=SECRET, timeout=120)
    try:
        target.start_rpc_server()
        dst = [np.zeros(block * count, np.uint8) for _ in range(layers)]
        src = [np.ones(block * count, np.uint8) for _ in range(layers)]
        for d, s in zip(dst, src):
            target.register(d)
            writer.register(s)
        t0 = time.perf_counter()
        conn = writer.get_conn(f"{target.host}:{target.get_rpc_port()}")
        get_conn_ms = (time.perf_counter() - t0) * 1e3
        src_vas, dst_vas = [], []
        for d, s in zip(dst, src):
            src_vas += [s.ctypes.data + i * block for i in range(count)]
            dst_vas += [d.ctypes.data + (count - 1 - i) * block for i in range(count)]
        sizes = [block] * len(src_vas)
        regs_t = [s.descriptor for s in target._local.spans()]
        regs_w = [s.descriptor for s in writer._local.spans()]
        index_t = {s.base: i for i, s in enumerate(target._local.spans())}
        index_w = {s.base: i for i, s in enumerate(writer._local.spans())}
        rows = np.array([(index_w[s.ctypes.data], i * block, index_t[d.ctypes.data], (count - 1 - i) * block, block)
                         for d, s in zip(dst, src) for i in range(count)], dtype=np.int64)
        agent_conn = conn._agent_conn
        conn.batch_write_sync(src_vas, dst_vas, sizes)  # paths chosen, pages touched
        if reps <= 0:
            reps = max(9, min(101, (256 << 20) // (block * len(sizes))))
        p2p_s, agent_s = _medians(lambda: conn.batch_write_sync(src_vas, dst_vas, sizes),
                                  lambda: agent_conn.write_blocks(regs_w, regs_t, rows).wait(120), reps)
        map_s = _medians(lambda: conn._blocks(src_vas, dst_vas, sizes) or conn._ops("bench", src_vas, dst_vas, sizes),
                         lambda: None, reps)[0]
        nbytes = block * len(sizes)
        return {"path": agent_conn.path_to(regs_t[0]), "entries": len(sizes), "reps": reps,
                "get_conn_ms": get_conn_ms, "p2p_GBps": nbytes / p2p_s / 1e9, "agent_GBps": nbytes / agent_s / 1e9,
                "p2p_us": p2p_s * 1e6, "agent_us": agent_s * 1e6,
                "mapping_us_per_entry": map_s * 1e6 / len(sizes)}
    finally:
        writer.destroy()
        target.destroy()


def main(argv: Optional[List[str]] = None) -> int:
    args = _parse(list(argv or []))
    import numpy as np

    from ...compat import p2p

    out: Dict[str, Dict] = {}
    for transport in [t for t in args.transports.split(",") if t]:
        os.environ["FLAGCX_MESH_TRANSPORT"] = transport
        fig: Dict = {}
        for b in [parse_size(x) for x in args.blocks.split(",") if x]:
            r = _one(np, p2p, b, args.count, args.layers, args.reps)
            fig[size_name(b)] = r
            print(f"[{transport}] {r['entries']} x {size_name(b)} over {r['path']} ({r['reps']} calls): "
                  f"get_conn {r['get_conn_ms']:.2f} ms; p2p {r['p2p_GBps']:.2f} GB/s ({r['p2p_us']:.0f} us/call), "
                  f"agent {r['agent_GBps']:.2f} GB/s ({r['agent_us']:.0f} us/call); p2p/agent "
                  f"{r['p2p_GBps'] / r['agent_GBps']:.2f}, mapping {r['mapping_us_per_entry']:.2f} us/entry",
                  flush=True)
        out[transport] = fig
    save_json(out, args.json)
    return 0
