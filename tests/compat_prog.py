"""One rank of a flagcx_mesh.compat job under the embedded launcher (not collected).

    python tests/compat_prog.py [--timeout S]

Every rank: comm_init_from_env; registers a data window (a user buffer), a library window
and the signal buffer (one slot per rank), in that order, and checks the indices; then to every
rank (itself included) a put_signal of its pattern into the peer's window at offset
rank * CHUNK, ADD 1 on slot `rank`, followed by `rank + 1` more signal() ADDs and a
size-0 put_signal ADD of 1. Each rank waits until its slot p reaches p + 3 (the ADDs of
rank p) for every p and checks the data; refuses a few bad calls (FlagcxError,
InvalidArgument, nothing written); prints "OK rank R compat" and exits 0.
"""
import argparse
import sys

import numpy as np

from flagcx_mesh import compat as fc

CHUNK = 4096


def pattern(rank: int) -> np.ndarray:
    return ((np.arange(CHUNK) * (rank + 7) + rank) % 251).astype(np.uint8)


def exchange(comm: fc.Comm, kv: int, timeout: float) -> None:
    r, n = comm.rank, comm.nranks
    for p in range(n):
        comm.put_signal(p, 0, r * CHUNK, CHUNK, r * 8, 0, kv, 1)
        for _ in range(r + 1):
            comm.signal(p, r * 8, 1)
        comm.put_signal(p, 0, 0, 0, r * 8, 0, kv, 1)  # size 0: signal only
    for p in range(n):
        comm.wait_signal(p, p * 8, p + 3, timeout=timeout)


def bad_calls(comm: fc.Comm, kv: int) -> int:
    r, n = comm.rank, comm.nranks
    calls = [
        lambda: comm.put(n, 0, 0, 1, 0, kv),
        lambda: comm.put((r + 1) % n, 0, n * CHUNK, 1, 0, kv),
        lambda: comm.put_signal((r + 1) % n, 0, 0, 8, 4, 0, kv, 1),
        lambda: comm.put_signal((r + 1) % n, 0, 0, 8, n * 8, 0, kv, 1),
        lambda: comm.put((r + 1) % n, 0, 0, 8, 0, 9),
    ]
    for call in calls:
        try:
            call()
        except fc.FlagcxError as e:
            assert e.code == fc.Result.InvalidArgument and f"rank {r}" in str(e), e
        else:
            raise AssertionError("a bad call was accepted")
    return len(calls)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=30.0)
    a = ap.parse_args()
    with fc.comm_init_from_env(timeout=a.timeout) as comm:
        n, r = comm.nranks, comm.rank
        src = pattern(r)
        dst = np.zeros(n * CHUNK, np.uint8)
        assert comm.one_side_register(src) == 0
        kv = comm.one_side_register(dst)
        assert kv == 1 and comm.one_side_register(64) == 2
        comm.signal_register(8 * n)
        exchange(comm, kv, a.timeout)
        for p in range(n):
            assert (dst[p * CHUNK:(p + 1) * CHUNK] == pattern(p)).all(), f"data from rank {p} differs"
            assert comm.read_signal(p * 8) == p + 3, (p, comm.read_signal(p * 8))
        comm.flush(timeout=a.timeout)
        comm.mesh.barrier(timeout=a.timeout)
        before, counter = dst.copy(), comm.read_counter()
        refused = bad_calls(comm, kv)
        comm.mesh.barrier(timeout=a.timeout)
        assert (dst == before).all() and comm.read_counter() == counter, "a refused call wrote something"
        print(f"OK rank {r} compat: {n} peers, {refused} bad calls refused, counter {counter}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
