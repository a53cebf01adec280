"""Self-test: build the full mesh K times and check every connection.

    python -m flagcx_mesh.selftest [-n N] [--contexts C] [--iterations K]
                                   [--timeout S] [--json PATH]
    python -m flagcx_mesh.selftest --device cuda[:D] [-n N] [--iterations K]
    python -m flagcx_mesh.selftest --builder legacy|ordered|tagged [-n N] [--iterations K]
                                   [--jitter-us J] [--timeout S]

Started plainly, it spawns N local ranks itself (through the embedded
launcher, no MPI needed). Started by ``python -m flagcx_mesh.launch`` (or
another supported launcher) it runs one rank per process instead.

Each iteration builds a mesh with a fresh unique id (made by rank 0 and
handed to the others over the previous mesh), lets the build's wiring check
prove slot j is rank j, then sends a tagged, checksummed payload on every
(peer, context) and verifies what arrives. Rank 0 prints per-phase timings
(listen, rendezvous, connect/accept, wiring check: min / median / max over
all ranks and iterations). Exit status 0 only when every check passed; a
failure names the rank, iteration, peer and phase.

With --device cuda (or cuda:D), each iteration also allocates a device window
on that GPU and a host window, puts a tagged pattern from every rank into every
rank's device window (put_signal, one slot per source), reads each rank's device
window back into host memory with get() and checks every byte; rank 0 prints
the path taken to each peer (cuda-vmm, cuda-ipc, staged, cuda-self).

With --builder, each iteration instead builds the full mesh over the test
adaptor (loopback TCP shaped like FlagCX's IB adaptor: no identity on the
wire) with that builder and proves the wiring (see flagcx_mesh.selftest_net).
legacy, FlagCX's own loop, is expected to FAIL: it reproduces the known hang,
which the deadline (default 5 s here) reports.
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import sys
import time
import zlib
from typing import Dict, List, Optional, Tuple

PHASES = [
    ("listen", "listen"),
    ("rendezvous", "rendezvous"),
    ("connect", "connect/accept"),
    ("wiring", "wiring check"),
    ("total", "mesh build total"),
    ("payload", "payload check"),
]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flagcx_mesh.selftest", description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--nranks", type=int, default=4, help="ranks to spawn when no launcher is around (default 4)")
    p.add_argument("--contexts", type=int, default=1, help="contexts per mesh (default 1)")
    p.add_argument("--iterations", type=int, default=1, help="meshes to build one after another (default 1)")
    p.add_argument("--timeout", type=float, default=None,
                   help="deadline of each mesh build, seconds (default 60; 5 with --builder)")
    p.add_argument("--builder", choices=("legacy", "ordered", "tagged"),
                   help="build over the IB-like test adaptor with this builder instead")
    p.add_argument("--jitter-us", type=int, default=0, help="with --builder: random delay before each "
                   "connect/accept step of the test adaptor, microseconds (default 0)")
    p.add_argument("--device", default=None, help="cuda or cuda:D: also check device windows on that GPU")
    p.add_argument("--payload", type=int, default=256, help="payload bytes per (peer, context) (default 256)")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON to PATH (rank 0)")
    a = p.parse_args(argv)
    if a.timeout is None:
        a.timeout = 5.0 if a.builder else 60.0
    if a.jitter_us < 0:
        p.error("--jitter-us must be >= 0")
    for name in ("nranks", "contexts", "iterations"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1")
    if a.timeout <= 0 or a.payload < 0:
        p.error("--timeout must be > 0 and --payload >= 0")
    return a


class CheckFailed(Exception):
    """A payload or wiring check saw the wrong bytes."""


# ---------------------------------------------------------------- rank side

def _payload(it: int, src: int, dst: int, ctx: int, size: int) -> bytes:
    head = struct.pack("<4sIiii", b"FXST", it, src, dst, ctx)
    seed = (it * 1000003 + src * 8191 + dst * 131 + ctx) & 0xFFFFFFFF
    body = bytes((seed + i * 37) & 0xFF for i in range(size))
    return head + body + struct.pack("<I", zlib.crc32(head + body))


def _check_payloads(mesh, it: int, size: int, timeout: float) -> float:
    """Sends a tagged payload to every (peer, ctx), then verifies each arrival."""
    t0 = time.perf_counter()
    me = mesh.rank
    for peer in range(mesh.nranks):
        for ctx in range(mesh.contexts):
            mesh.send(peer, _payload(it, me, peer, ctx, size), ctx, timeout=timeout)
    for peer in range(mesh.nranks):
        for ctx in range(mesh.contexts):
            got = mesh.recv(peer, ctx, timeout=timeout)
            want = _payload(it, peer, me, ctx, size)
            if got != want:
                tag = struct.unpack("<4sIiii", got[:20]) if len(got) >= 20 else got
                raise CheckFailed(
                    f"rank {me}: iteration {it}: payload from (peer {peer}, ctx {ctx}) is wrong "
                    f"({len(got)} bytes, tag {tag}; expected {len(want)} bytes from rank {peer})")
    return time.perf_counter() - t0


def _check_device(mesh, it: int, device: str, size: int, timeout: float) -> str:
    """Every rank's pattern into every rank's device window, read back and checked; the paths."""
    from .cuda import device_ordinal

    n, me = mesh.nranks, mesh.rank
    size = max(size, 64)
    dev = mesh.alloc_window(n * size, device=device_ordinal(device))
    host = mesh.alloc_window(n * size)
    sig = mesh.signal_window(n)
    buf = host.buffer
    buf[:size] = _payload(it, me, -1, 0, size)[:size]
    for peer in range(n):
        mesh.put_signal(peer, host, 0, dev, me * size, size, slot=me, signal_window=sig)
    mesh.flush(timeout=timeout)
    for src in range(n):
        mesh.wait_signal(src, 1, timeout=timeout, window=sig)
    mesh.get(me, dev, 0, host, 0, n * size)
    mesh.flush(timeout=timeout)
    for src in range(n):
        if bytes(buf[src * size:(src + 1) * size]) != _payload(it, src, -1, 0, size)[:size]:
            raise CheckFailed(f"rank {me}: iteration {it}: the device window's bytes from rank {src} are wrong")
    mesh.barrier(timeout=timeout)
    paths = dev.describe()
    for w in (sig, host, dev):
        w.close()
    return paths


def _next_uid(mesh, uid: bytes) -> bytes:
    """Rank 0 makes the next unique id and hands it out over the current mesh, sealed under
    the current id's secret (the secret of the next mesh never goes on the wire in clear)."""
    from . import _core, get_unique_id

    mine = _core.seal_unique_id(uid, get_unique_id()) if mesh.rank == 0 else b""
    return _core.unseal_unique_id(uid, mesh.allgather(mine, timeout=60)[0])


def _progress(rank: int, it: int, total: int, last: List[float]) -> None:
    now = time.monotonic()
    if rank == 0 and total >= 10 and (now - last[0] > 2.0 or it + 1 == total):
        print(f"  ... {it + 1}/{total} meshes built and checked", flush=True)
        last[0] = now


def run_rank(rank: int, nranks: int, uid: bytes, args: argparse.Namespace) -> int:
    """One rank's whole self-test; returns the exit status."""
    from . import Mesh

    samples: Dict[str, List[float]] = {k: [] for k, _ in PHASES}
    stats = {"rejected_total": 0, "connect_retries": 0}
    mesh, it, phase, last = None, 0, "build", [time.monotonic()]
    try:
        for it in range(args.iterations):
            phase = "unique id hand-out"
            if mesh is not None:
                uid = _next_uid(mesh, uid)
                mesh.close()
            phase = "build"
            mesh = Mesh(nranks, uid, rank, contexts=args.contexts, timeout=args.timeout)
            for k, v in mesh.timings().items():
                samples[k].append(v)
            phase = "payload check"
            samples["payload"].append(_check_payloads(mesh, it, args.payload, args.timeout))
            if args.device:
                phase = "device window check"
                stats["device_paths"] = _check_device(mesh, it, args.device, args.payload, args.timeout or 60)
            s = mesh.stats()
            stats["rejected_total"] += s["rejected_total"]
            stats["connect_retries"] += s["connect_retries"]
            _progress(rank, it, args.iterations, last)
        phase = "report"
        return _report(mesh, samples, stats, args)
    except Exception as e:  # noqa: BLE001 - every failure is reported, then exits non-zero
        peer = getattr(e, "peer", -1)
        print(f"flagcx_mesh selftest FAILED: rank {rank}, iteration {it}, phase {phase}"
              f"{'' if peer is None or peer < 0 else f', peer {peer}'}: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)
        return 1
    finally:
        if mesh is not None:
            mesh.close()


def _report(mesh, samples, stats, args) -> int:
    """Gathers every rank's samples on rank 0, which prints and writes them."""
    mine = json.dumps({"samples": samples, "stats": stats, "describe": mesh.describe()}).encode()
    parts = [json.loads(p) for p in mesh.allgather(mine, timeout=60)]
    if mesh.rank != 0:
        return 0
    merged = {k: [v for p in parts for v in p["samples"][k]] for k, _ in PHASES}
    rejected = sum(p["stats"]["rejected_total"] for p in parts)
    retries = sum(p["stats"]["connect_retries"] for p in parts)
    summary = _summarise(merged)
    _print_report(mesh, parts[0]["describe"], summary, rejected, retries, args)
    if args.device:
        print(f"device windows on {args.device}: every byte checked; rank 0's {parts[0]['stats']['device_paths']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nranks": mesh.nranks, "contexts": mesh.contexts, "iterations": args.iterations,
                       "payload_bytes": args.payload, "phases_ms": summary,
                       "rejected_connections": rejected, "connect_retries": retries,
                       "passed": True}, f, indent=2)
    return 0


def _summarise(merged: Dict[str, List[float]]) -> Dict[str, Dict[str, float]]:
    out = {}
    for key, _ in PHASES:
        v = merged[key]
        out[key] = {"min": min(v) * 1e3, "median": statistics.median(v) * 1e3, "max": max(v) * 1e3}
    return out


def _print_report(mesh, describe, summary, rejected, retries, args) -> None:
    n, c, k = mesh.nranks, mesh.contexts, args.iterations
    print(f"flagcx_mesh selftest: {n} ranks x {c} context(s), {k} iteration(s)")
    print(f"  {describe}")
    print(f"  {'phase':<18}{'min ms':>10}{'median ms':>12}{'max ms':>10}   ({n * k} samples each)")
    for key, label in PHASES:
        s = summary[key]
        print(f"  {label:<18}{s['min']:>10.2f}{s['median']:>12.2f}{s['max']:>10.2f}")
    print(f"  foreign connections rejected: {rejected}; connect retries: {retries}")
    checked = n * n * c * k
    print(f"PASS: {k} mesh(es) built; wiring proved and {checked} tagged payloads "
          f"({args.payload} B) verified over {n * c} (peer, context) pairs per rank", flush=True)


# ------------------------------------------------------------- entry point

def detect_rank(timeout: Optional[float] = None) -> Optional[Tuple[int, int, bytes, str]]:
    """(rank, nranks, unique_id, launcher name) when started by a launcher, else None.

    Recognises python -m flagcx_mesh.launch, torchrun (the unique id goes through the
    launcher's store, joined as a client), mpiexec of MPICH / Open MPI (broadcast over
    MPI with mpi4py) and a plain RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT environment.
    Looks at environment variables first: without MPI around, mpi4py is never imported.
    """
    from .bootstrap import detect_launch, unique_id_from_env

    if detect_launch() is None:
        return None
    return unique_id_from_env(timeout)


def spawn(args: argparse.Namespace, argv: List[str]) -> int:
    """No launcher around: start N ranks of this same command locally."""
    from .launch import launch

    print(f"flagcx_mesh selftest: spawning {args.nranks} local ranks (embedded launcher)", flush=True)
    cmd = [sys.executable, "-m", "flagcx_mesh.selftest", *argv]
    return launch(cmd, args.nranks, prefix=False, timeout=args.timeout * (args.iterations + 2) + 60)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        found = detect_rank(timeout=args.timeout)
    except Exception as e:  # noqa: BLE001 - a bootstrap failure is reported, then exits non-zero
        print(f"flagcx_mesh selftest FAILED: bootstrap: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    if found is None:
        return spawn(args, argv)
    rank, nranks, uid, launcher = found
    if rank == 0:
        print(f"flagcx_mesh selftest: launcher: {launcher}; {nranks} ranks, one per process", flush=True)
    if args.builder:
        from .selftest_net import run_rank as run_builder_rank

        return run_builder_rank(rank, nranks, uid, args)
    return run_rank(rank, nranks, uid, args)


if __name__ == "__main__":
    sys.exit(main())
