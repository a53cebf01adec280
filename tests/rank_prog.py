"""One rank of a flagcx_mesh test job, run as its own process.

Started either by ``python -m flagcx_mesh.launch -n N -- python tests/rank_prog.py ...``
(rank, size and unique id from the launcher's environment) or directly with
``--rank R --nranks N`` and the unique id from ``--uid-hex`` or ``--uid-file``.

It builds the mesh, exchanges a tagged payload on every (peer, context) (self included),
checks an allgather and a barrier, and prints exactly one line ``RESULT {json}`` on stdout:

    {"rank", "ok": true, "nranks", "contexts", "mesh_id", "timings", "stats", "elapsed"}
    {"rank", "ok": false, "type", "code", "peer", "errno", "message", "elapsed"}

Exit status: 0 on success, 3 when a flagcx_mesh.MeshError was raised, 1 otherwise.
Fault injection: ``--die-at PHASE`` SIGKILLs this process from the on_phase hook,
``--stop-at PHASE`` SIGSTOPs it (a frozen rank).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import flagcx_mesh  # the tests put the package they test first on PYTHONPATH
from flagcx_mesh import Mesh, MeshError

PHASES = ("listen", "rendezvous", "connect", "wiring")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, help="this rank (default: from the launcher)")
    p.add_argument("--nranks", type=int, help="number of ranks (default: from the launcher)")
    p.add_argument("--uid-hex", help="the unique id as hex")
    p.add_argument("--uid-file", help="read the unique id (hex) from this file, waiting for it")
    p.add_argument("--make-uid", action="store_true",
                   help="make the unique id here (this process hosts the root) and write it to "
                        "--uid-file")
    p.add_argument("--contexts", type=int, default=1)
    p.add_argument("--timeout", type=float, default=30.0, help="mesh build timeout, seconds")
    p.add_argument("--header-timeout", type=float, default=5.0)
    p.add_argument("--iterations", type=int, default=1, help="payload rounds after the build")
    p.add_argument("--size", type=int, default=64, help="payload bytes (small: sent before recv)")
    p.add_argument("--die-at", choices=PHASES, help="SIGKILL this process at that phase")
    p.add_argument("--stop-at", choices=PHASES, help="SIGSTOP this process at that phase")
    p.add_argument("--delay", type=float, default=0.0,
                   help="sleep this long before building the mesh (a late rank)")
    return p.parse_args(argv)


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, path)


def read_uid_file(path: str, wait_s: float = 30.0) -> bytes:
    deadline = time.monotonic() + wait_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"rank_prog: {path} did not appear within {wait_s} s")
        time.sleep(0.01)
    with open(path) as f:
        return bytes.fromhex(f.read().strip())


def identity(args):
    """(rank, nranks, uid) from the arguments or the launcher's environment."""
    if args.rank is None:
        from flagcx_mesh.launch import ranks_from_env
        found = ranks_from_env()
        if found is None:
            raise SystemExit("rank_prog: give --rank/--nranks or run under flagcx_mesh.launch")
        return found
    if args.make_uid:
        uid = flagcx_mesh.get_unique_id()
        write_atomic(args.uid_file, uid.hex())
    elif args.uid_file:
        uid = read_uid_file(args.uid_file)
    else:
        uid = bytes.fromhex(args.uid_hex)
    return args.rank, args.nranks, uid


def make_hook(args):
    def hook(phase: str) -> None:
        if phase == args.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if phase == args.stop_at:
            os.kill(os.getpid(), signal.SIGSTOP)
    return hook


def payload(mesh_id: str, src: int, dst: int, ctx: int, it: int, size: int) -> bytes:
    head = f"{mesh_id}|{src}->{dst}|ctx{ctx}|it{it}|".encode()
    body = bytes((src * 31 + dst * 7 + ctx + it + k) % 256 for k in range(max(0, size - len(head))))
    return head + body


def exchange(m: Mesh, iterations: int, size: int) -> None:
    n, contexts = m.nranks, m.contexts
    for it in range(iterations):
        for p in range(n):
            for c in range(contexts):
                m.send(p, payload(m.mesh_id, m.rank, p, c, it, size), c)
        for p in range(n):
            for c in range(contexts):
                got = m.recv(p, c, timeout=20)
                want = payload(m.mesh_id, p, m.rank, c, it, size)
                assert got == want, (f"rank {m.rank}: wrong payload from peer {p} ctx {c} "
                                     f"iteration {it}: {got[:80]!r}")
    parts = m.allgather(f"rank {m.rank}".encode(), timeout=20)
    assert parts == [f"rank {k}".encode() for k in range(n)], f"rank {m.rank}: allgather returned {parts!r}"
    m.barrier(timeout=20)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, nranks, uid = identity(args)
    out = {"rank": rank, "pid": os.getpid()}
    time.sleep(args.delay)
    t0 = time.monotonic()
    code = 0
    try:
        with Mesh(nranks, uid, rank, contexts=args.contexts, timeout=args.timeout,
                  header_timeout=args.header_timeout, _on_phase=make_hook(args)) as m:
            out["elapsed_build"] = time.monotonic() - t0
            exchange(m, args.iterations, args.size)
            out.update(ok=True, nranks=m.nranks, contexts=m.contexts, mesh_id=m.mesh_id,
                       timings=m.timings(), stats=m.stats())
    except MeshError as e:
        out.update(ok=False, type=type(e).__name__, code=e.code, peer=e.peer, errno=e.errno,
                   message=str(e))
        code = 3
    except Exception as e:  # noqa: BLE001 - reported as a result line
        out.update(ok=False, type=type(e).__name__, code=None, peer=None, errno=None,
                   message=str(e))
        code = 1
    out["elapsed"] = time.monotonic() - t0
    print("RESULT " + json.dumps(out), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
