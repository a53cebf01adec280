"""How long after a host-side signal a waiting CUDA stream passes, measured from C.

    python -m flagcx_mesh.bench stream-wait [--iters 2000] [--json PATH]

Compiles ``stream_wait.c`` (shipped in this package) against the installed C library (and
libdl; the CUDA driver is opened at run time) and runs it on 2 local ranks: rank 1 queues
``flagcx_mesh_wait_signal_on_stream`` and an event on its stream, rank 0 signals 200 us later,
and the time from the signal to the event's completion is reported (median, p10, p90). Needs a
CUDA driver (FLAGCX_MESH_CUDA_DRIVER names another one, e.g. the test suite's fake).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import List

from .._ranks import run_program, save_json
from .latency import compile_program

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stream_wait.c")


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m flagcx_mesh.bench stream-wait")
    p.add_argument("--iters", type=int, default=2000, help="signals timed (default 2000)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds the measuring program may run (default 300)")
    p.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        exe = compile_program(tmp, SOURCE, "flagcx_mesh_stream_wait", ["-ldl"])
        data = run_program("stream-wait", [exe, "--iters", str(args.iters)], 2, args.timeout)
    if data is None:
        return 1
    print(f"stream wait from C: a waiting stream passes {data['median_us']:.2f} us after a host-side signal "
          f"(median of {data['iters']}; p10 {data['p10_us']:.2f}, p90 {data['p90_us']:.2f})")
    save_json(data, args.json)
    return 0
