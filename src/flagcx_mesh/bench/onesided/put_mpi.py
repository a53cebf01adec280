"""flagcx_mesh put against MPI_Put through mpi4py, in the same run.

    mpiexec -n 2 python -m flagcx_mesh.bench put-mpi [--sizes 4K,64K,1M,16M,64M] [--json PATH]

MPI side: MPI.Win.Allocate on both ranks, rank 0 does Lock(1), N x Put,
Flush(1), Unlock(1) (passive target, remote completion) per size; the
flagcx_mesh side uses the same sizes and repetition counts with put + flush
over each transport. Prints GB/s and the ratio flagcx_mesh / MPI_Put.
"""

from __future__ import annotations

import json
import time
from typing import Dict, List

from . import put as P


def mpi_put_bandwidth(MPI, comm, size: int, win, buf) -> float:
    comm.Barrier()
    bw = 0.0
    if comm.rank == 0:
        reps = P._reps(size)
        win.Lock(1)
        win.Put(buf[:size], 1)
        win.Flush(1)
        t0 = time.perf_counter()
        for _ in range(reps):
            win.Put(buf[:size], 1)
        win.Flush(1)
        bw = reps * size / (time.perf_counter() - t0) / 1e9
        win.Unlock(1)
    comm.Barrier()
    return bw


def _mesh_from_comm(comm):
    from ...mesh import Mesh, get_unique_id

    uid = comm.bcast(get_unique_id() if comm.rank == 0 else None, root=0)
    return Mesh(comm.size, uid, comm.rank, timeout=60)


def mpi_entry(argv: List[str]) -> int:
    args = P._parse(argv, "put-mpi")  # (first: --help needs no MPI)
    from mpi4py import MPI

    P.set_bytes_per_figure(args.bytes)
    comm = MPI.COMM_WORLD
    if comm.size != 2:
        print("put-mpi needs exactly 2 MPI ranks (mpiexec -n 2)")
        return 2
    nbytes = max(args.sizes)
    win = MPI.Win.Allocate(nbytes, 1, comm=comm)
    import numpy as np

    buf = np.ones(nbytes, np.uint8)
    out: Dict[str, Dict[str, float]] = {"mpi_put": {}}
    for s in args.sizes:
        out["mpi_put"][str(s)] = mpi_put_bandwidth(MPI, comm, s, win, buf)
    win.Free()
    with _mesh_from_comm(comm) as mesh:
        for t in args.transports:
            src, dst = P._windows(mesh, t, nbytes)
            out[t] = {str(s): P.put_bandwidth(mesh, src, dst, s) for s in args.sizes}
            src.close()
            dst.close()
    if comm.rank == 0:
        _report(MPI, out, args)
    return 0


def _report(MPI, out, args) -> None:
    name = MPI.Get_library_version().splitlines()[0].strip()
    print(f"put bandwidth vs MPI_Put ({name}), rank 0 -> rank 1, GB/s")
    ts = args.transports
    print(f"  {'size':>8}{'MPI_Put':>9}" + "".join(f"{t:>9}" for t in ts) + "".join(f"{t + '/MPI':>10}" for t in ts))
    for s in args.sizes:
        k = str(s)
        mpi = out["mpi_put"][k]
        line = f"  {P.size_name(s):>8}{mpi:>9.2f}" + "".join(f"{out[t][k]:>9.2f}" for t in ts)
        print(line + "".join(f"{out[t][k] / mpi:>10.2f}" for t in ts))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
