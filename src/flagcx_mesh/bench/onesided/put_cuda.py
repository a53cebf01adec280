"""GPU put bandwidth per path and stream-wait latency, against local copies in the same run.

    python -m flagcx_mesh.bench put --device cuda [--sizes 4K,1M,16M,64M,256M]
                                    [--paths cuda-vmm,cuda-ipc,staged] [--iters 200] [--json PATH] [--plot PNG]

Two local ranks on one GPU (needs torch with CUDA). For each path (forced with
FLAGCX_MESH_CUDA_PATH) rank 0 puts ``size`` bytes into rank 1's device window
repeatedly, then flushes; bandwidth is bytes / time, without a stream and with
one. cuda-vmm windows are cuMem allocations (``alloc_window(device=0)``),
cuda-ipc and staged ones torch tensors. In the same run rank 0 measures a
local device-to-device copy (torch ``copy_``) and, for staged, a pinned
device-to-host plus host-to-device copy, and prints the ratios.

Gets: rank 0 gets ``size`` bytes from rank 1's source window into its own target window
repeatedly, then flushes (the "get" column, with its ratio to the same reference).

Blocking: each put is followed by its flush (a connector that waits per
request), beside a blocking local copy of the same size (``copy_`` then
``torch.cuda.synchronize()``), and the ratio; then the latency of an 8-byte
put + flush (median of ``--iters``) beside an 8-byte blocking local copy.

Stream-wait latency: rank 1 queues ``wait_signal(stream=s)`` and an event on
``s``; rank 0 (after the stream is surely waiting) takes the time and
signals; rank 1 waits for the event (cudaEventSynchronize) and takes the time
when it completes (both clocks are CLOCK_MONOTONIC of one host), so the
figure includes a Python call on each side. The median over ``--iters``
is how long after a host-side signal the waiting stream passes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Dict, List, Optional

from .._plot import save_plot
from .._ranks import run_ranks, save_json
from .._sizes import parse_size, size_name

TARGET_BYTES = 2 << 30  # per size and path


def parse(argv: List[str], rank: bool = False) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flagcx_mesh.bench put --device cuda")
    p.add_argument("--device", choices=("cuda",), default="cuda")
    p.add_argument("--sizes", default="4K,1M,16M,64M,256M")
    p.add_argument("--paths", default="cuda-vmm,cuda-ipc,staged")
    p.add_argument("--iters", type=int, default=200, help="stream-wait latency samples")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PNG", help="a plot of the bandwidth tables (needs matplotlib)")
    if rank:
        p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    a.sizes = [parse_size(s) for s in a.sizes.split(",") if s]
    a.paths = [x for x in a.paths.split(",") if x]
    return a


def _reps(size: int, path: str) -> int:
    budget = TARGET_BYTES // (8 if path == "staged" else 1)
    return max(3, min(2000, budget // max(size, 1)))


def _windows(mesh, torch, path: str, nbytes: int):
    os.environ["FLAGCX_MESH_CUDA_PATH"] = path
    try:
        if path == "cuda-vmm":
            src, dst = mesh.alloc_window(nbytes, device=0), mesh.alloc_window(nbytes, device=0)
            torch.as_tensor(src, device="cuda").fill_(1)
            return src, dst, None
        keep = [torch.ones(nbytes, dtype=torch.uint8, device="cuda"),
                torch.zeros(nbytes, dtype=torch.uint8, device="cuda")]
        return mesh.register_window(keep[0]), mesh.register_window(keep[1]), keep
    finally:
        os.environ.pop("FLAGCX_MESH_CUDA_PATH", None)


def _bandwidth(mesh, torch, size: int, path: str, op, blocking: bool = False) -> Optional[float]:
    """GB/s of rank 0 calling op() (one transfer of `size` bytes to or from rank 1) repeatedly
    after a warm-up: then one flush, or (blocking) a flush after each call. Others return None."""
    mesh.barrier()
    if mesh.rank != 0:
        mesh.barrier()
        return None
    torch.cuda.synchronize()
    op()  # warm-up
    mesh.flush(1, timeout=120)
    reps = _reps(size, path)
    t0 = time.perf_counter()
    for _ in range(reps):
        op()
        if blocking:
            mesh.flush(1, timeout=120)
    if not blocking:
        mesh.flush(1, timeout=300)
    dt = time.perf_counter() - t0
    mesh.barrier()
    return reps * size / dt / 1e9


def put_bandwidth(mesh, torch, src, dst, size: int, path: str, stream) -> Optional[float]:
    """GB/s of puts by rank 0 into rank 1's target window (on `stream` unless None), then a flush."""
    return _bandwidth(mesh, torch, size, path, lambda: mesh.put(1, src, 0, dst, 0, size, stream=stream))


def get_bandwidth(mesh, torch, src, dst, size: int, path: str) -> Optional[float]:
    """GB/s of gets by rank 0 from rank 1's source window into its own target window, then a flush."""
    return _bandwidth(mesh, torch, size, path, lambda: mesh.get(1, src, 0, dst, 0, size))


def blocking_put(mesh, torch, src, dst, size: int, path: str) -> Optional[float]:
    """GB/s of put + flush, one op at a time (each waits for the last)."""
    return _bandwidth(mesh, torch, size, path, lambda: mesh.put(1, src, 0, dst, 0, size), blocking=True)


def small_put_latency(mesh, torch, src, dst, iters: int) -> Optional[List[float]]:
    """Microseconds of an 8-byte put + flush, per sample (rank 0)."""
    mesh.barrier()
    if mesh.rank != 0:
        mesh.barrier()
        return None
    torch.cuda.synchronize()
    out: List[float] = []
    for i in range(iters + 10):
        t0 = time.perf_counter_ns()
        mesh.put(1, src, 0, dst, 0, 8)
        mesh.flush(1, timeout=120)
        if i >= 10:  # warm-up
            out.append((time.perf_counter_ns() - t0) / 1e3)
    mesh.barrier()
    return out


def local_copy_latency(torch, iters: int) -> List[float]:
    """Microseconds of an 8-byte local D2D copy_ + synchronize, per sample."""
    a = torch.ones(8, dtype=torch.uint8, device="cuda")
    b = torch.zeros(8, dtype=torch.uint8, device="cuda")
    out: List[float] = []
    for i in range(iters + 10):
        t0 = time.perf_counter_ns()
        b.copy_(a)
        torch.cuda.synchronize()
        if i >= 10:
            out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def local_copy(torch, size: int, blocking: bool = False) -> float:
    """GB/s of local D2D copies: pipelined (one synchronize at the end), or each waited for
    (`blocking`: copy_ then synchronize every time, what a blocking put+flush is set against)."""
    a = torch.ones(size, dtype=torch.uint8, device="cuda")
    b = torch.zeros(size, dtype=torch.uint8, device="cuda")
    b.copy_(a)
    torch.cuda.synchronize()
    reps = _reps(size, "local")
    t0 = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
        if blocking:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return reps * size / (time.perf_counter() - t0) / 1e9


def pinned_round(torch, size: int) -> float:
    """GB/s of a device-to-host then host-to-device copy through pinned memory (one byte counted once)."""
    d = torch.ones(size, dtype=torch.uint8, device="cuda")
    h = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    reps = _reps(size, "staged")
    h.copy_(d)
    d.copy_(h)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        h.copy_(d, non_blocking=True)
        d.copy_(h, non_blocking=True)
    torch.cuda.synchronize()
    return reps * size / (time.perf_counter() - t0) / 1e9


def stream_wait_latency(mesh, torch, iters: int) -> Optional[List[float]]:
    """Microseconds from rank 0's host signal to rank 1's waiting stream passing, per sample."""
    sig = mesh.signal_window(2)
    stream = torch.cuda.Stream()
    passed: List[int] = []
    sent: List[int] = []
    mesh.barrier()
    for i in range(1, iters + 1):
        if mesh.rank == 1:
            mesh.wait_signal(0, i, window=sig, stream=stream)
            ev = torch.cuda.Event()
            ev.record(stream)
            mesh.signal(0, 1, signal_window=sig)  # "waiting now"
            ev.synchronize()  # the driver's wait for the event (spins), not a Python loop
            passed.append(time.perf_counter_ns())
        else:
            mesh.wait_signal(1, i, timeout=30, window=sig)
            time.sleep(0.0002)  # the stream is surely blocked in its wait by now
            sent.append(time.perf_counter_ns())
            mesh.signal(1, 0, signal_window=sig)
    parts = mesh.allgather(json.dumps(sent if mesh.rank == 0 else passed).encode())
    sig.close()
    if mesh.rank != 0:
        return None
    t_sent, t_passed = json.loads(parts[0]), json.loads(parts[1])
    return [(b - a) / 1e3 for a, b in zip(t_sent, t_passed)]


def rank_entry(argv: List[str]) -> int:
    import torch

    from ...mesh import Mesh

    args = parse(argv, rank=True)
    torch.cuda.init()
    out: Dict[str, object] = {"paths": {}}
    with Mesh.from_launcher(timeout=120) as mesh:
        for path in args.paths:
            src, dst, keep = _windows(mesh, torch, path, max(args.sizes))
            side = torch.cuda.Stream()
            row = {"path": dst.paths[1 - mesh.rank][0], "why": dst.paths[1 - mesh.rank][1],
                   "gbs": {str(s): put_bandwidth(mesh, torch, src, dst, s, path, None) for s in args.sizes},
                   "gbs_stream": {str(s): put_bandwidth(mesh, torch, src, dst, s, path, side) for s in args.sizes},
                   "gbs_blocking": {str(s): blocking_put(mesh, torch, src, dst, s, path) for s in args.sizes},
                   "gbs_get": {str(s): get_bandwidth(mesh, torch, src, dst, s, path) for s in args.sizes},
                   "put8_us": small_put_latency(mesh, torch, src, dst, args.iters)}
            out["paths"][path] = row
            src.close()
            dst.close()
            del keep
        lat = stream_wait_latency(mesh, torch, args.iters)
        if mesh.rank == 0:
            out["stream_wait_us"] = lat
            out["local_d2d_gbs"] = {str(s): local_copy(torch, s) for s in args.sizes}
            out["local_d2d_blocking_gbs"] = {str(s): local_copy(torch, s, blocking=True) for s in args.sizes}
            out["local_copy8_us"] = local_copy_latency(torch, args.iters)
            out["pinned_round_gbs"] = {str(s): pinned_round(torch, s) for s in args.sizes}
            out["gpu"] = torch.cuda.get_device_name(0)
            with open(args.out, "w") as f:
                json.dump(out, f)
        mesh.barrier()
    return 0


def _quantiles(samples: List[float]) -> str:
    lat = sorted(samples)
    q = lambda f: lat[min(len(lat) - 1, int(f * len(lat)))]  # noqa: E731
    return f"{statistics.median(lat):.1f} us (median of {len(lat)}; p10 {q(0.1):.1f}, p90 {q(0.9):.1f})"


def report(data: dict, args) -> None:
    print(f"GPU put bandwidth, rank 0 -> rank 1 on one {data['gpu']} (GB/s, flush included)")
    blocking_ref = data["local_d2d_blocking_gbs"]
    for path, row in data["paths"].items():
        peer = "local D2D" if path != "staged" else "pinned D2H+H2D"
        ref = data["local_d2d_gbs"] if path != "staged" else data["pinned_round_gbs"]
        why = f" ({row['why']})" if row["why"] else ""
        print(f"  {path}: path taken {row['path']}{why}")
        print(f"  {'size':>9}{'put':>9}{'on stream':>11}{peer:>16}{'ratio':>8}"
              f"{'blocking':>10}{'blocking D2D':>14}{'ratio':>8}{'get':>9}{'ratio':>8}")
        for s in args.sizes:
            k = str(s)
            blk = row["gbs_blocking"][k]
            get = row.get("gbs_get", {}).get(k) or 0.0
            print(f"  {size_name(s):>9}{row['gbs'][k]:>9.1f}{row['gbs_stream'][k]:>11.1f}{ref[k]:>16.1f}"
                  f"{row['gbs'][k] / ref[k]:>8.2f}{blk:>10.1f}{blocking_ref[k]:>14.1f}{blk / blocking_ref[k]:>8.2f}"
                  f"{get:>9.1f}{get / ref[k]:>8.2f}")
        print(f"  8-byte put + flush: {_quantiles(row['put8_us'])}")
    print(f"8-byte local copy_ + synchronize: {_quantiles(data['local_copy8_us'])}")
    print(f"stream wait: a waiting stream passes {_quantiles(data['stream_wait_us'])} after a host-side signal")


def main(argv: List[str]) -> int:
    args = parse(argv)
    data = run_ranks("put-cuda", ["put-cuda-rank", *argv], 2, timeout=900)
    if data is None:
        return 1
    report(data, args)
    save_json(data, args.json)
    plot(data, args)
    return 0


def plot(data: dict, args) -> bool:
    """--plot: pipelined puts (with the local copy and pinned round trip) and blocking puts."""
    piped = {p: row["gbs"] for p, row in data["paths"].items()}
    piped["ref: local D2D"] = data["local_d2d_gbs"]
    piped["ref: pinned D2H+H2D"] = data["pinned_round_gbs"]
    blocking = {p: row["gbs_blocking"] for p, row in data["paths"].items()}
    blocking["ref: blocking local D2D"] = data["local_d2d_blocking_gbs"]
    return save_plot(args.plot, f"flagcx_mesh GPU put bandwidth, 2 ranks on one {data['gpu']}",
                     [("pipelined puts, then one flush", piped), ("blocking: each put + flush", blocking)])
