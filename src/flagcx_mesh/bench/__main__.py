"""Benchmarks that print figures and ratios against a peer measured in the same run.

    python -m flagcx_mesh.bench mesh [-n 8] [--iterations 20] [--contexts 1] [--json PATH]
    python -m flagcx_mesh.bench put  [--sizes 4K,64K,1M,16M,64M] [--transports shm,cma,tcp] [--json PATH]
    mpiexec -n 2 python -m flagcx_mesh.bench put-mpi [--sizes ...]   (flagcx_mesh vs MPI_Put, same run)

No benchmark asserts a speed: each prints figures and ratios against a peer
measured in the same run (gloo init, memcpy, raw loopback sockets, MPI_Put).
"""

from __future__ import annotations

import sys
from typing import List, Optional

from . import mesh as mesh_bench
from . import put as put_bench

COMMANDS = {
    "mesh": mesh_bench.main,
    "mesh-rank": mesh_bench.rank_entry,
    "put": put_bench.main,
    "put-rank": put_bench.rank_entry,
    "put-mpi": put_bench.mpi_entry,
}


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
