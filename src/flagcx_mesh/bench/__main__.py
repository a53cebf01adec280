"""Benchmarks that print figures and ratios against a peer measured in the same run.

Building a mesh (flagcx_mesh.bench.meshbuild):
    python -m flagcx_mesh.bench mesh [-n 8] [--iterations 20] [--contexts 1] [--json PATH]
    python -m flagcx_mesh.bench race [--trials 200] [-n 4] [--jitter-us 2000] [--builders legacy,ordered,tagged]
                                     [--timeout 1.0]   (FlagCX's full-mesh loop vs the fixed builders)
    python -m flagcx_mesh.bench soak [--builds 10000] [--max-ranks 32] [--kill 0.2] [--json PATH]
                                     (ranks as threads: jitter, foreign traffic, killed ranks;
                                     counts hangs, miswirings, failures by class)

The mesh's one-sided data path (flagcx_mesh.bench.onesided):
    python -m flagcx_mesh.bench put  [--sizes 4K,64K,1M,16M,64M] [--transports shm,cma,tcp] [--json PATH]
    python -m flagcx_mesh.bench put --device cuda [--sizes ...] [--paths cuda-vmm,cuda-ipc,staged]
                                     (GPU windows per path vs a local D2D copy; stream-wait latency)
    mpiexec -n 2 python -m flagcx_mesh.bench put-mpi [--sizes ...]   (flagcx_mesh vs MPI_Put, same run)
    python -m flagcx_mesh.bench latency [--iters 10000] [--transports shm,tcp] [--json PATH]
                                     (from C: put_signal / put+flush vs a raw socket, same run)
    python -m flagcx_mesh.bench stream-wait [--iters 2000] [--json PATH]
                                     (from C: a waiting CUDA stream passes how long after a signal)

Agents (flagcx_mesh.bench.agents):
    python -m flagcx_mesh.bench agent [--region 256M] [--blocks 64K,256K,2M] [--transports cma,shm,tcp]
                                     [--peers mooncake,nixl | none]
                                     (agents: setup, request-shaped batches, churn; vs memcpy, and vs
                                     Mooncake TE and NIXL in the same run where they are installed)
    python -m flagcx_mesh.bench agent --device cuda [--memory torch|driver] [--paths cuda-ipc,cuda-vmm,staged,ucx]
                                     [--peers mooncake,nixl | none]   (GPU memory, the target in a child
                                     process; vs Mooncake TE, NIXL and the mesh's own puts, same run)
    python -m flagcx_mesh.bench p2p [--blocks 4K,64K,1M] [--count 64] [--layers 4] [--transports cma,tcp]
                                     (the P2P engine form's batch_write_sync vs the agent's batch, same run)
    python -m flagcx_mesh.bench notify [--device cpu|cuda] [--paths cma,tcp,cuda-ipc,cuda-vmm] [--iters 1000]
                                     [--rounds 5] [--peers nixl | none]   (an 8-byte write and its
                                     notification, ping-pong between two processes: one way, median and
                                     p99, vs NIXL's make_prepped_xfer + get_new_notifs, same run)

The vLLM connector (flagcx_mesh.bench.kv):
    python -m flagcx_mesh.bench kv [--device cpu|cuda] [--tokens 2048,8192] [--paths cma,tcp]
                                     (one request's KV through the vLLM connector's transfer part, 8B-model
                                     shape, vs a contiguous agent write of the same bytes, same run)

No benchmark asserts a speed: each prints figures and ratios against a peer
measured in the same run (gloo init, memcpy, raw loopback sockets, MPI_Put, Mooncake TE, NIXL).
"""

from __future__ import annotations

import importlib
import sys
from typing import List, Optional

from .._cli import run_naming_extras

# command -> (module under bench/, function); imported on use (put needs numpy: pip install flagcx_mesh[bench])
COMMANDS = {
    "mesh": ("meshbuild.mesh", "main"),
    "mesh-rank": ("meshbuild.mesh", "rank_entry"),
    "race": ("meshbuild.race", "main"),
    "race-rank": ("meshbuild.race", "rank_entry"),
    "soak": ("meshbuild.soak", "main"),
    "put": ("onesided.put", "main"),
    "put-rank": ("onesided.put", "rank_entry"),
    "put-cuda-rank": ("onesided.put_cuda", "rank_entry"),
    "put-mpi": ("onesided.put_mpi", "mpi_entry"),
    "latency": ("onesided.latency", "main"),
    "stream-wait": ("onesided.stream_wait", "main"),
    "agent": ("agents.agent", "main"),
    "agent-gpu-target": ("agents._gpu_target", "main"),
    "p2p": ("agents.p2p", "main"),
    "notify": ("agents.notify", "main"),
    "kv": ("kv", "main"),
}


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if not argv or argv[0] not in COMMANDS:
        if argv:
            print(f"python -m flagcx_mesh.bench: unknown benchmark {argv[0]!r}", file=sys.stderr)
        print(__doc__, file=sys.stderr)
        return 2
    module, func = COMMANDS[argv[0]]
    command = f"python -m flagcx_mesh.bench {argv[0]}"
    # (the benchmark's module is imported inside: a module-level numpy import is named too)
    return run_naming_extras(command, lambda rest: getattr(
        importlib.import_module(f"{__package__}.{module}"), func)(rest), argv[1:])


if __name__ == "__main__":
    sys.exit(main())
