"""The core's cost of issuing one request's device copies, on the fake CUDA driver: two agents in
this process (cuda-self), one `write_blocks` of N rows of 64 bytes (shuffled on both sides; over
--regions regions a side, region after region, or with --alternate the regions in turn, row by
row) and its wait, timed over --reps calls after 3 warm-up calls; no GPU needed. Under callgrind
the instructions of the call alone are counted:

    cd tests && env $(python -c "import fakecuda; print(' '.join(f'{k}={v}' for k, v in fakecuda.env().items()))") \\
        valgrind --tool=callgrind --toggle-collect='*transfer_table*' python issue_cost_probe.py --reps 2

(then callgrind_annotate; the wheel built with -C install.strip=false -C cmake.build-type=RelWithDebInfo
for the names). Prints the path and the median ms of a call and its wait.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from agent_device_prog import make_device, register
from flagcx_mesh.agent import Agent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=41)
    ap.add_argument("--regions", type=int, default=1, help="regions on each side, the rows region after region "
                    "(as the connector's: a region per layer, passed as a list of Regions and of descriptors)")
    ap.add_argument("--alternate", action="store_true", help="row i names region i %% regions on each side")
    args = ap.parse_args()
    n, size, slot = args.rows, 64, 256
    dev = make_device("fake")
    owner, user = Agent("owner", "issue-cost", timeout=20), Agent("user", "issue-cost", timeout=20)
    try:
        k = args.regions
        per = -(-n // k)  # rows (blocks) of each region
        rbufs, lbufs = [dev.buffer("ipc", per * slot) for _ in range(k)], [dev.buffer("ipc", per * slot) for _ in range(k)]
        remotes = [register(owner, b).descriptor for b in rbufs]
        locals_ = [register(user, b) for b in lbufs]
        conn = user.connect(owner.metadata())
        print("path", conn.path_to(remotes[0], locals_[0]), f"{k} region(s) a side", flush=True)
        rng = np.random.default_rng(0)
        rows = np.arange(n, dtype=np.int64)
        index, at = (rows % k, rows // k) if args.alternate else (rows // per, rows % per)  # region, row in it
        table = np.stack([index, rng.permutation(per)[at] * slot, index, rng.permutation(per)[at] * slot,
                          np.full(n, size, np.int64)], axis=1)
        times = []
        for i in range(3 + args.reps):
            t0 = time.perf_counter()
            conn.write_blocks(locals_, remotes, table).wait(20)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        print(f"{n} rows: median {statistics.median(times) * 1e3:.3f} ms a call and its wait", flush=True)
    finally:
        user.close()
        owner.close()


if __name__ == "__main__":
    main()
