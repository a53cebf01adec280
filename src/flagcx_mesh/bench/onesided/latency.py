"""Small-message latency from C, per path, beside a raw TCP socket measured in the same run.

    python -m flagcx_mesh.bench latency [--iters 10000] [--warmup 1000] [--blocks 10]
                                        [--transports shm,tcp] [--json PATH] [--keep DIR]

Compiles ``latency.c`` (shipped in this package) against the installed C library with the
flags of ``python -m flagcx_mesh.config --cflags --libs`` (compiler: $CC, default cc) and runs
it on 2 local ranks under the embedded launcher, once per path (FLAGCX_MESH_TRANSPORT=shm, then
tcp). Each run times, in blocks that take turns:

  put_signal  8-byte put_signal -> the peer's wait_signal returns -> it answers alike; one way
              is half the round trip (median and p99 over the iterations)
  socket      the same ping-pong on a raw TCP loopback socket (TCP_NODELAY, blocking
              write/read of 8 bytes), opened between the same two processes
  put_flush   one blocking 4 KiB put + flush (completion at the target)
  socket_ack  a 4 KiB write on the raw socket, read in full by the peer, then an 8-byte ack

and prints the figures with the ratios put_signal/socket and put_flush/socket_ack.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

from ..._paths import cflags, libs
from .._ranks import run_program, save_json

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "latency.c")
TRANSPORTS = ("shm", "tcp")
PAIRS = [("put_signal", "socket", "8 B one way"), ("put_flush", "socket_ack", "4 KiB blocking")]


def _parse(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flagcx_mesh.bench latency")
    p.add_argument("--iters", type=int, default=10000, help="timed iterations per test and path")
    p.add_argument("--warmup", type=int, default=1000, help="untimed iterations first")
    p.add_argument("--blocks", type=int, default=10, help="the tests take turns in this many blocks")
    p.add_argument("--transports", default="shm,tcp", help="paths to measure, comma-separated (default shm,tcp)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per path")
    p.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    p.add_argument("--keep", metavar="DIR", help="build the program in DIR and keep it")
    a = p.parse_args(argv)
    a.transports = [t for t in a.transports.split(",") if t]
    bad = [t for t in a.transports if t not in TRANSPORTS]
    if bad:
        p.error(f"unknown transport(s) {bad}; choose from {list(TRANSPORTS)}")
    for name in ("iters", "warmup", "blocks"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1")
    return a


def compile_program(directory: str, source: str = SOURCE, name: str = "flagcx_mesh_latency",
                    extra: Optional[List[str]] = None) -> str:
    """Builds `source` (a C benchmark of this package) in `directory` against the installed
    library; returns the program."""
    exe = os.path.join(directory, name)
    cc = shlex.split(os.environ.get("CC", "cc"))
    if not cc or shutil.which(cc[0]) is None:
        raise RuntimeError(f"bench {name} needs a C compiler: {cc[:1]} was not found (set CC)")
    cmd = [*cc, "-O2", "-std=c99", source, *cflags(), *libs(), *(extra or []), "-o", exe]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"bench {name}: compiling failed ({' '.join(cmd)}):\n{r.stderr}")
    return exe


def _run_paths(exe: str, args: argparse.Namespace) -> Optional[Dict[str, dict]]:
    cmd = [exe, "--iters", str(args.iters), "--warmup", str(args.warmup), "--blocks", str(args.blocks)]
    out: Dict[str, dict] = {}
    for t in args.transports:
        load = os.getloadavg()[0]  # the figures depend on free cores: say how busy the host was
        data = run_program(f"latency-{t}", cmd, 2, args.timeout, env={"FLAGCX_MESH_TRANSPORT": t})
        if data is None:
            return None
        out[t] = dict(data, cpus=os.cpu_count(), load_before=load)
    return out


def _report(data: Dict[str, dict], args: argparse.Namespace) -> None:
    print(f"latency from C, rank 0 <-> rank 1 on this host, us (median / p99 of {args.iters} iterations "
          f"after {args.warmup} warm-up; raw socket measured in the same run)")
    print(f"  {'path':<5}{'test':<28}{'flagcx_mesh':>20}{'raw socket':>20}{'ratio':>16}")
    for t, run in data.items():
        res = run["results"]
        for ours, peer, what in PAIRS:
            a, b = res[ours], res[peer]
            print(f"  {t:<5}{ours + ' ' + what:<28}"
                  # " / " always: a p99 of 10 ms or more ran into the slash (seen on a loaded host)
                  f"{a['median_us']:>10.2f} / {a['p99_us']:>7.2f}{b['median_us']:>11.2f} / {b['p99_us']:>7.2f}"
                  f"{a['median_us'] / b['median_us']:>9.2f}x / {a['p99_us'] / b['p99_us']:>4.2f}x")
    print("host: " + ", ".join(f"{t} run: {r['cpus']} CPUs, load average {r['load_before']:.1f} before it"
                               for t, r in data.items()))
    print("paths actually used (data, signal): " +
          ", ".join(f"{t} -> {r['data_path']}, {r['signal_path']}" for t, r in data.items()))


def main(argv: List[str]) -> int:
    args = _parse(argv)
    with tempfile.TemporaryDirectory() as tmp:
        directory = args.keep or tmp
        os.makedirs(directory, exist_ok=True)
        try:
            exe = compile_program(directory)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 1
        data = _run_paths(exe, args)
    if data is None:
        return 1
    _report(data, args)
    save_json(data, args.json)
    return 0
