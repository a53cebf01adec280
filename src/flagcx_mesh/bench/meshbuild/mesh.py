"""Mesh build time against torch.distributed's gloo init.

    python -m flagcx_mesh.bench mesh [-n 8] [--iterations 20] [--contexts 1] [--json PATH]

Full-mesh build time of flagcx_mesh against torch.distributed's gloo
backend (``init_process_group("gloo")`` also builds a full TCP mesh), both
run by the same N local rank processes, alternating iteration by iteration so
that both see the same machine noise. Per iteration the time is that of the
slowest rank (a mesh is usable when every rank has it); the report gives the
median and min over iterations and the ratio gloo / flagcx_mesh. torch is
optional: without it, only flagcx_mesh is measured and the report says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Dict, List, Optional

from .._ranks import run_ranks, save_json


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    m = argparse.ArgumentParser(prog="python -m flagcx_mesh.bench mesh")
    m.add_argument("-n", "--nranks", type=int, default=8, help="ranks (local processes) per mesh (default 8)")
    m.add_argument("--iterations", type=int, default=20, help="meshes built, one after another (default 20)")
    m.add_argument("--contexts", type=int, default=1, help="contexts (independent connection sets) per mesh (default 1)")
    m.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    return m.parse_args(argv)


def _parse_rank(argv: List[str]) -> argparse.Namespace:
    r = argparse.ArgumentParser(prog="python -m flagcx_mesh.bench mesh-rank")
    r.add_argument("--iterations", type=int, required=True)
    r.add_argument("--contexts", type=int, required=True)
    r.add_argument("--out", required=True)
    return r.parse_args(argv)


def _have_torch() -> bool:
    try:
        import torch.distributed as dist  # noqa: F401

        return dist.is_available() and dist.is_gloo_available()
    except ImportError:
        return False


# ---------------------------------------------------------------- rank side

def _time_flagcx(control, nranks: int, contexts: int) -> float:
    """One build timed; its unique id handed out over the control mesh, sealed under the control
    mesh's secret (the launcher's id), so no secret goes on the wire in clear."""
    import os

    from ... import _core
    from ...mesh import Mesh, get_unique_id

    shared = bytes.fromhex(os.environ["FLAGCX_MESH_UNIQUE_ID"])
    sealed = _core.seal_unique_id(shared, get_unique_id()) if control.rank == 0 else b""
    uid = _core.unseal_unique_id(shared, control.allgather(sealed, timeout=60)[0])
    control.barrier(timeout=60)
    t0 = time.perf_counter()
    mesh = Mesh(nranks, uid, control.rank, contexts=contexts, timeout=60)
    elapsed = time.perf_counter() - t0
    mesh.close()
    return elapsed


def _time_gloo(control, store, it: int) -> float:
    import torch.distributed as dist

    control.barrier(timeout=60)
    t0 = time.perf_counter()
    dist.init_process_group("gloo", store=dist.PrefixStore(f"it{it}/", store),
                            rank=control.rank, world_size=control.nranks)
    elapsed = time.perf_counter() - t0
    dist.destroy_process_group()
    return elapsed


def _gloo_store(control):
    """A TCPStore on an ephemeral port of rank 0, its port handed out over the control mesh."""
    import torch.distributed as dist

    host = "127.0.0.1"
    if control.rank == 0:
        store = dist.TCPStore(host, 0, control.nranks, True, wait_for_workers=False)
        control.allgather(str(store.port).encode(), timeout=60)
        return store
    port = int(control.allgather(b"", timeout=60)[0])
    return dist.TCPStore(host, port, control.nranks, False)


def rank_entry(argv: List[str]) -> int:
    args = _parse_rank(argv)
    from ...mesh import Mesh

    with Mesh.from_launcher(timeout=60) as control:
        torch_ok = _have_torch()
        store = _gloo_store(control) if torch_ok else None
        mine: Dict[str, List[float]] = {"flagcx_mesh": [], "gloo": []}
        for it in range(args.iterations):
            mine["flagcx_mesh"].append(_time_flagcx(control, control.nranks, args.contexts))
            if torch_ok:
                mine["gloo"].append(_time_gloo(control, store, it))
        parts = [json.loads(p) for p in control.allgather(json.dumps(mine).encode(), timeout=60)]
        if control.rank == 0:
            with open(args.out, "w") as f:
                json.dump({"ranks": parts, "torch": torch_ok}, f)
    return 0


# ---------------------------------------------------------------- driver side

def _slowest_rank(parts: List[dict], key: str) -> List[float]:
    iters = len(parts[0][key])
    return [max(p[key][i] for p in parts) for i in range(iters)]


def _report_mesh(data: dict, args: argparse.Namespace) -> dict:
    out = {"nranks": args.nranks, "contexts": args.contexts, "iterations": args.iterations}
    print(f"mesh build, {args.nranks} local ranks x {args.contexts} context(s), {args.iterations} iterations "
          f"(slowest rank per iteration, ms)")
    print(f"  {'library':<14}{'median':>10}{'min':>10}{'max':>10}")
    for key in ("flagcx_mesh", "gloo"):
        if not data["ranks"][0][key]:
            continue
        v = [x * 1e3 for x in _slowest_rank(data["ranks"], key)]
        out[key] = {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v)}
        print(f"  {key:<14}{out[key]['median_ms']:>10.2f}{min(v):>10.2f}{max(v):>10.2f}")
    if "gloo" in out:
        out["ratio_gloo_over_flagcx_mesh"] = out["gloo"]["median_ms"] / out["flagcx_mesh"]["median_ms"]
        print(f"  ratio gloo / flagcx_mesh (median): {out['ratio_gloo_over_flagcx_mesh']:.2f}x")
    else:
        print("  gloo: not measured (torch with gloo is not installed: pip install torch)")
    return out


def bench_mesh(args: argparse.Namespace) -> int:
    data = run_ranks("mesh", ["mesh-rank", "--iterations", str(args.iterations), "--contexts", str(args.contexts)],
                     args.nranks, timeout=120 + 10 * args.iterations)
    if data is None:
        return 1
    save_json(_report_mesh(data, args), args.json)
    return 0


def main(argv: List[str]) -> int:
    return bench_mesh(_parse(argv))
