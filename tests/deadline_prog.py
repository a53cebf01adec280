"""One rank of a deadline job on device windows: calls that wait end at their one deadline.

Run under the embedded launcher (see gpu_prog.py for --device)::

    python -m flagcx_mesh.launch -n 2 --timeout T -- python tests/deadline_prog.py SCENARIO --device fake

Scenarios (a failing rank prints ``FAIL rank R SCENARIO: why`` and exits 1; a passing one ends
with ``OK rank R SCENARIO``):

    batch_deadline  (FLAGCX_MESH_CUDA_PATH=staged, copies out of device memory slower than half
                    the mesh timeout) rank 0's batch_put of 3 entries to rank 1, each staged
                    through a slow copy: the batch fails with MeshTimeout within one mesh
                    timeout, after its first entry (rank 1 finds exactly that entry landed),
                    instead of giving every entry a timeout of its own
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from flagcx_mesh import Mesh, MeshTimeout

from gpu_prog import FakeDevice, TorchDevice, check, check_paths, pattern

CHUNK = 4096


def scenario_batch_deadline(mesh: Mesh, dev, args) -> None:
    entries = 3
    win = mesh.alloc_window(entries * CHUNK, device=0)
    check_paths(mesh, win, "staged", "device")
    data = pattern(7, entries * CHUNK)
    if mesh.rank == 0:
        dev.window_bytes(win).write(0, data)
    mesh.barrier(timeout=60)
    if mesh.rank == 0:
        try:
            mesh.batch_put(1, win, win, [(k * CHUNK, k * CHUNK, CHUNK) for k in range(entries)])
            outcome = "the batch returned"
        except MeshTimeout as e:
            outcome = f"MeshTimeout: {e}"
        print(f"rank 0 batch_put: {outcome}", flush=True)
        mesh.flush(timeout=60)  # what was issued lands
    mesh.barrier(timeout=60)
    if mesh.rank == 0:
        check(outcome.startswith("MeshTimeout"), f"a batch whose entries each wait most of a timeout: {outcome}")
    else:
        got = dev.window_bytes(win).read(0, entries * CHUNK)
        landed = [k for k in range(entries) if got[k * CHUNK:(k + 1) * CHUNK] == data[k * CHUNK:(k + 1) * CHUNK]]
        print(f"rank 1 entries landed: {landed}", flush=True)
        check(landed == [0], f"entries landed {landed}, expected only the first (the batch's deadline came "
                             f"during the second)")
    mesh.barrier(timeout=60)


SCENARIOS = {"batch_deadline": scenario_batch_deadline}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=sorted(SCENARIOS))
    ap.add_argument("--device", choices=("fake", "torch"), default="fake")
    ap.add_argument("--mesh-timeout", type=float, default=60, help="the mesh's timeout in seconds")
    args = ap.parse_args()
    dev = FakeDevice() if args.device == "fake" else TorchDevice()
    with Mesh.from_launcher(timeout=args.mesh_timeout) as mesh:
        try:
            SCENARIOS[args.scenario](mesh, dev, args)
        except Exception as e:  # noqa: BLE001
            print(f"FAIL rank {mesh.rank} {args.scenario}: {e}", flush=True)
            traceback.print_exc()
            sys.stdout.flush()
            os._exit(1)
        print(f"OK rank {mesh.rank} {args.scenario}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
