"""Where one agent call of a request's blocks spends its time: `write_blocks` of N blocks of a
size between two processes, timed as the call's issue (it returns) and the wait for its handle,
without and with a notification (with one after device copies the call itself waits for them
before the notification leaves), for blocks of 64 KiB, 16 KiB and 16 bytes (16 bytes: no copy
time to speak of, the per-op and completion costs alone); then `notify` alone. Medians of
--reps calls. scripts/test-gpu.sh runs it on CUDA tensors; --device cpu runs it on host memory
(the path chosen as usual, or FLAGCX_MESH_TRANSPORT).

    python tests/write_blocks_probe.py [--device cuda|cpu] [--blocks 4096] [--reps 15]

Prints one line per (size, notification) and one for notify; exit status 0 when every call
completed.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

SECRET = "write-blocks-probe"
SIZES = (65536, 16384, 16)


def target(args) -> int:
    import torch

    from flagcx_mesh.agent import Agent

    with Agent("probe-target", SECRET) as a:
        buf = torch.zeros(args.blocks * SIZES[0], dtype=torch.uint8, device=args.device)
        region = a.register(buf)
        print(a.metadata().hex(), region.descriptor.hex(), flush=True)
        sys.stdin.readline()  # until the prober is done
    return 0


def median_ms(values) -> float:
    return statistics.median(values) * 1e3


def probe(args) -> int:
    import torch

    from flagcx_mesh.agent import Agent

    child = subprocess.Popen([sys.executable, __file__, "--role", "target", "--device", args.device,
                              "--blocks", str(args.blocks)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        md, desc = child.stdout.readline().split()
        with Agent("probe-initiator", SECRET) as a:
            src = torch.ones(args.blocks * SIZES[0], dtype=torch.uint8, device=args.device)
            local = a.register(src)
            conn = a.connect(bytes.fromhex(md))
            remote = bytes.fromhex(desc)
            print(f"path {conn.path_to(remote, local)}, {args.blocks} blocks, device {args.device}", flush=True)
            g = torch.Generator().manual_seed(0)
            for size in SIZES:
                table = torch.zeros((args.blocks, 3), dtype=torch.int64)
                table[:, 0] = torch.randperm(args.blocks, generator=g) * SIZES[0]
                table[:, 1] = torch.randperm(args.blocks, generator=g) * SIZES[0]
                table[:, 2] = size
                for note in (None, b"done"):
                    issue, wait = [], []
                    for _ in range(args.reps):
                        t0 = time.perf_counter()
                        h = conn.write_blocks(local, remote, table, notification=note)
                        t1 = time.perf_counter()
                        h.wait(60)
                        issue.append(t1 - t0)
                        wait.append(time.perf_counter() - t1)
                    print(f"write_blocks {args.blocks} x {size} B, notification {'yes' if note else 'no '}: "
                          f"issue {median_ms(issue):.3f} ms, wait {median_ms(wait):.3f} ms (medians of {args.reps})",
                          flush=True)
            notes = []
            for _ in range(200):
                t0 = time.perf_counter()
                conn.notify(b"x" * 300)
                notes.append(time.perf_counter() - t0)
            print(f"notify 300 B: median {median_ms(notes) * 1e3:.1f} us", flush=True)
    finally:
        child.stdin.write("bye\n")
        child.stdin.flush()
        child.wait(timeout=60)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--blocks", type=int, default=4096)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--role", default="probe", help=argparse.SUPPRESS)
    args = p.parse_args()
    return target(args) if args.role == "target" else probe(args)


if __name__ == "__main__":
    sys.exit(main())
