"""Agents (dynamic peers): set-up costs, request-shaped transfers and churn, per path, beside
memcpy of the same bytes and beside Mooncake TE and NIXL, all measured in the same run.

    python -m flagcx_mesh.bench agent --device cuda ...   (GPU memory, two processes: agent_gpu.py)
    python -m flagcx_mesh.bench agent [--region 256M] [--blocks 64K,256K,2M] [--count 256]
                                      [--transports cma,shm,tcp] [--churn 50] [--connects 50] [--setups 3]
                                      [--peers mooncake,nixl | none] [--json PATH]

Two endpoints in this process for each (FLAGCX_MESH_TRANSPORT forced per path for flagcx_mesh;
cma and shm work within one process as between two). Figures:

  setup     start, register of a --region host buffer, connect, first 4 KiB write (ms), each
            the median of --setups runs; for flagcx_mesh also the median and 90th percentile of
            --connects connects of a fresh agent and the median of their first 4 KiB write (ms)
  request   --count blocks of each --blocks size (wrapping within --region) written pipelined
            (one batch, one wait) and blocking (a wait per block), GB/s, beside memcpy
  mesh      (flagcx_mesh) the mesh's own puts of the same blocks over the same path, beside the
            agent's writes (_mesh.py; --mesh-put off leaves them out); "goals" in the JSON
            is the agent over the mesh per path, block size and mode
  churn     a fresh initiator: start, connect, one 4 KiB write, close; per second

Each peer in --peers (_peers.py) runs the same figures, and the ratio flagcx_mesh / peer is
printed against the flagcx_mesh path the peer's own transport matches. A peer that cannot run
(not installed, a library or backend missing) is reported with its reason, never left out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Dict, List, Optional

from . import _peers
from .._ranks import save_json
from .._sizes import parse_size, size_name

SECRET = "bench-agent"


def _parse(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flagcx_mesh.bench agent")
    p.add_argument("--region", default="256M", help="bytes of the registered region on each side (default 256M)")
    p.add_argument("--blocks", default="64K,256K,2M", help="block sizes of the request-shaped batches, comma-separated (default 64K,256K,2M)")
    p.add_argument("--count", type=int, default=256, help="blocks per batch (default 256)")
    p.add_argument("--transports", default="cma,shm,tcp", help="host paths to measure, comma-separated (default cma,shm,tcp)")
    p.add_argument("--churn", type=int, default=50, help="register/deregister cycles timed (default 50)")
    p.add_argument("--connects", type=int, default=50, help="connect/close cycles timed (default 50)")
    p.add_argument("--setups", type=int, default=3, help="set-up runs; each figure is their median")
    p.add_argument("--peers", default="mooncake,nixl", help="comma-separated, or none")
    p.add_argument("--mesh-put", choices=("on", "off"), default="on",
                   help="off: leave out the mesh's own puts beside the agent's writes")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: GPU memory between two processes (agent_gpu.py)")
    p.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    return p.parse_args(argv)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def _reps(block: int, count: int) -> int:
    return max(1, (256 << 20) // (block * count))


class Flagcx:
    """flagcx_mesh's agents, on the path FLAGCX_MESH_TRANSPORT forces."""

    name = "flagcx_mesh"

    def __init__(self, np, mesh_put: bool = True):
        from ... import __version__
        from ...agent import Agent

        self.np, self.Agent, self.version = np, Agent, f"flagcx_mesh {__version__}"
        self.mesh_put = mesh_put

    def setup(self, region: int, connects: int) -> Dict[str, float]:
        np, Agent = self.np, self.Agent
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
        times, firsts = [], []
        for i in range(connects):
            with Agent(f"bench-connect-{i}", SECRET) as a:
                mine = a.register(np.ones(4096, np.uint8))
                t0 = time.perf_counter()
                c = a.connect(target.metadata())
                times.append(_ms(t0))
                t0 = time.perf_counter()
                c.write(mine, remote, 4096).wait(30)
                firsts.append(_ms(t0))
            target.notifications(0)  # prunes the connections of the agents that left
        target.close()
        out = {"agent_start_ms": start, "register_ms": reg, "connect_ms": con, "first_write_ms": first}
        if times:
            times.sort()
            out["connect_median_ms"] = statistics.median(times)
            out["connect_p90_ms"] = times[min(len(times) - 1, int(0.9 * len(times)))]
            out["first_write_median_ms"] = statistics.median(firsts)
        return out

    def request(self, block: int, count: int, limit: int, reps: int) -> Dict[str, float]:
        np, Agent = self.np, self.Agent
        size, offs = _peers.layout(block, count, limit)
        with Agent("bench-target", SECRET) as t, Agent("bench-init", SECRET) as a:
            srcbuf = np.ones(size, np.uint8)
            if os.environ.get("FLAGCX_MESH_TRANSPORT") == "shm":  # shm reaches memory the agent allocated
                remote = t.alloc(size)
                dst = np.frombuffer(remote.view, np.uint8)
            else:
                dst = np.zeros(size, np.uint8)
                remote = t.register(dst)
            local = a.register(srcbuf)
            conn = a.connect(t.metadata())
            ops = [(local, s, remote, d, block) for s, d in offs]
            mesh = self._mesh_beside(srcbuf, dst)
            conn.batch_write(ops).wait(60)  # paths chosen, pages touched
            t0 = time.perf_counter()
            for _ in range(reps):
                conn.batch_write(ops).wait(60)
            pipe = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(reps):
                for s, d in offs:  # a blocking block: the one call that issues and waits
                    conn.write_sync(local, remote, block, s, d, timeout=60)
            blocking = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(reps * block * count // size):
                dst[:] = srcbuf
            mem = time.perf_counter() - t0
            total = block * count * reps / 1e9
            row = {"path": conn.path_to(remote), "pipelined_GBps": total / pipe, "blocking_GBps": total / blocking,
                   "memcpy_GBps": size * (reps * block * count // size) / 1e9 / mem}
            if mesh is not None:
                try:
                    row["mesh"] = {"path": mesh.path(), **mesh.figures(offs, block, reps)}
                finally:
                    mesh.close()
            return row

    def _mesh_beside(self, src, dst):
        """The mesh's puts beside the agent's writes (_mesh.py), unless --mesh-put off."""
        if not self.mesh_put:
            return None
        from ._mesh import HostMeshBeside

        return HostMeshBeside(src, dst, shm=os.environ.get("FLAGCX_MESH_TRANSPORT") == "shm")

    def churn(self, n: int) -> float:
        np, Agent = self.np, self.Agent
        with Agent("bench-target", SECRET) as t:
            remote = t.register(np.zeros(4096, np.uint8))
            md = t.metadata()
            t0 = time.perf_counter()
            for i in range(n):
                with Agent(f"churn-{i}", SECRET) as a:
                    a.connect(md).write(a.register(np.ones(4096, np.uint8)), remote, 4096).wait(30)
            return n / (time.perf_counter() - t0)


def _fmt(v: Optional[float], unit: str, digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:.{digits}f} {unit}"


def _measure(tool, args, label: str, blocks: List[int], region: int) -> Dict:
    """setup, request per block size and churn of one tool, printed as they come."""
    fig: Dict = {"version": tool.version}
    runs = []
    for k in range(max(1, args.setups)):
        runs.append(tool.setup(region, args.connects if k == 0 else 0) if isinstance(tool, Flagcx) else tool.setup(region))
    s = {key: (None if runs[0][key] is None else statistics.median(r[key] for r in runs if key in r)) for key in runs[0]}
    fig["setup"] = s
    extra = ""
    if "connect_median_ms" in s:
        extra = (f" (fresh agents, median of {args.connects}: connect {s['connect_median_ms']:.2f} ms, p90 "
                 f"{s['connect_p90_ms']:.2f} ms, first write {s['first_write_median_ms']:.2f} ms)")
    print(f"[{label}] start {s['agent_start_ms']:.2f} ms, register {args.region} {s['register_ms']:.3f} ms, "
          f"connect {_fmt(s['connect_ms'], 'ms')}{extra}, first write {s['first_write_ms']:.2f} ms", flush=True)
    for b in blocks:
        r = tool.request(b, args.count, region, _reps(b, args.count))
        fig[f"request_{size_name(b)}"] = r
        mem = f", memcpy {r['memcpy_GBps']:.2f} GB/s" if "memcpy_GBps" in r else ""
        m = r.get("mesh")
        beside = (f"; the mesh's puts beside it over {m['path']}: pipelined {m['pipelined_GBps']:.2f} GB/s, "
                  f"blocking {m['blocking_GBps']:.2f} GB/s (agent / mesh {r['pipelined_GBps'] / m['pipelined_GBps']:.2f}x"
                  f" / {r['blocking_GBps'] / m['blocking_GBps']:.2f}x)" if m else "")
        print(f"[{label}] {args.count} x {size_name(b)} over {r['path']}: pipelined {r['pipelined_GBps']:.2f} GB/s, "
              f"blocking {r['blocking_GBps']:.2f} GB/s{mem}{beside}", flush=True)
    if args.churn:
        fig["churn_per_s"] = tool.churn(args.churn)
        print(f"[{label}] churn: {fig['churn_per_s']:.0f} start+connect+write+close per second", flush=True)
    return fig


def _compare(ours: Dict, peer: Dict, blocks: List[int], label: str) -> Dict[str, Optional[float]]:
    """flagcx_mesh / peer for every figure (times inverted: above 1 means flagcx_mesh is faster)."""
    out: Dict[str, Optional[float]] = {}
    so, sp = ours["setup"], peer["setup"]
    for key in ("agent_start_ms", "register_ms"):
        out[key] = sp[key] / so[key] if so[key] else None
    ours_cw = (so["connect_ms"] or 0) + so["first_write_ms"]
    peer_cw = (sp["connect_ms"] or 0) + sp["first_write_ms"]
    out["connect_first_write"] = peer_cw / ours_cw
    for b in blocks:
        k = f"request_{size_name(b)}"
        for mode in ("pipelined_GBps", "blocking_GBps"):
            out[f"{k}_{mode}"] = ours[k][mode] / peer[k][mode]
    if "churn_per_s" in ours and "churn_per_s" in peer:
        out["churn_per_s"] = ours["churn_per_s"] / peer["churn_per_s"]
    parts = [f"{k} {'n/a' if v is None else f'{v:.2f}'}" for k, v in out.items()]
    print(f"[{label}] flagcx_mesh / peer (above 1: flagcx_mesh better): " + ", ".join(parts), flush=True)
    return out


def _wants_cuda(argv: List[str]) -> bool:
    return any(a in ("--device=cuda",) or (a == "--device" and argv[i + 1:i + 2] == ["cuda"])
               for i, a in enumerate(argv))


def main(argv: Optional[List[str]] = None) -> int:
    if _wants_cuda(list(argv or [])):
        from . import agent_gpu

        return agent_gpu.main(list(argv or []))
    args = _parse(list(argv or []))
    import numpy as np

    region = parse_size(args.region)
    blocks = [parse_size(x) for x in args.blocks.split(",") if x]
    out: Dict[str, Dict] = {"flagcx_mesh": {}, "peers": {}}
    ours = Flagcx(np, mesh_put=args.mesh_put == "on")
    print(f"versions: {ours.version}", flush=True)
    for transport in [t for t in args.transports.split(",") if t]:
        os.environ["FLAGCX_MESH_TRANSPORT"] = transport
        out["flagcx_mesh"][transport] = _measure(ours, args, transport, blocks, region)
    os.environ.pop("FLAGCX_MESH_TRANSPORT", None)
    names = [] if args.peers.strip() == "none" else [p for p in args.peers.split(",") if p]
    for name in names:
        try:
            peer = _peers.load(name, np)
            print(f"[{name}] running {peer.version} ({peer.how})", flush=True)
            fig = _measure(peer, args, name, blocks, region)
        except Exception as e:  # reported, not hidden: the run goes on with the other peers
            why = f"{type(e).__name__}: {e}"
            print(f"[{name}] NOT RUN: {why}", flush=True)
            out["peers"][name] = {"error": why}
            continue
        like = peer.like if peer.like in out["flagcx_mesh"] else next(iter(out["flagcx_mesh"]), None)
        if like is not None:
            fig["ratio_vs"] = like
            fig["ratio"] = _compare(out["flagcx_mesh"][like], fig, blocks, f"{name} vs flagcx_mesh {like}")
        out["peers"][name] = fig
    if args.mesh_put == "off":
        print("[mesh put] NOT RUN: --mesh-put off", flush=True)
    out["goals"] = _goals(out["flagcx_mesh"], blocks)
    save_json(out, args.json)
    return 0


def _goals(ours: Dict, blocks: List[int]) -> Dict[str, Dict[str, Optional[float]]]:
    """Per path: the agent's GB/s over the mesh's own puts beside it (goal: at least 1), per block size and mode."""
    out: Dict[str, Dict[str, Optional[float]]] = {}
    for path, fig in ours.items():
        g = out[path] = {}
        for b in blocks:
            r = fig[f"request_{size_name(b)}"]
            for mode in ("pipelined_GBps", "blocking_GBps"):
                m = r.get("mesh")
                g[f"{size_name(b)}_{mode}_over_mesh_put"] = r[mode] / m[mode] if m else None
    return out
