"""One rank of a two-rank job of striped puts over tcp lanes, run as its own process.

    python tests/lanes_prog.py --rank R --uid-file F [--make-uid] [--lanes 4] [--size 8M bytes]
                               [--count 4] [--op-timeout 30] [--die-after-queue | --die-on-bytes]
                               [--go-file G]

Both ranks build a 2-rank mesh (tcp forced by the caller's FLAGCX_MESH_TRANSPORT=tcp, lanes by
FLAGCX_MESH_TCP_LANES), check that the mesh uses --lanes, then for round i = 1..count rank 0
fills its source with pattern i and put_signals it (one striped put) into rank 1's window;
rank 1 waits for the signal, checks every byte and signals back; at the end rank 0 gets the
window back and checks it. Every wait is bounded by --op-timeout. It prints exactly one line
``RESULT {json}``:

    {"rank", "ok": true, "lanes", "rounds", "elapsed", "built_at", "round_at"}
    {"rank", "ok": false, "type", "peer", "message", "signal", "rounds", "elapsed", ...}

(built_at: seconds from the start to the mesh built and past the first barrier; round_at: to
the end of each round.)

A mismatch is {"ok": false, "type": "Mismatch", ...}. With --go-file G each rank, once its
mesh is built (every lane connected and wiring-checked) and past the first barrier, creates
G.built<rank> and starts the transfer only once G exists (waiting at most --op-timeout): the
caller can break the link under the transfer without touching the build (tests/netns_faults.py
one_transfer). Fault injection: --die-after-queue (rank 0) SIGKILLs itself right after queuing
8 striped puts and a put_signal (count and size as given), --die-on-bytes (rank 1) SIGKILLs
itself once the first bytes of those landed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import numpy as np

import flagcx_mesh
from flagcx_mesh import Mesh, MeshError


def pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def read_uid(path: str, make: bool) -> bytes:
    if make:
        uid = flagcx_mesh.get_unique_id()
        with open(path + ".tmp", "w") as f:
            f.write(uid.hex())
        os.rename(path + ".tmp", path)
        return uid
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"lanes_prog: {path} did not appear within 30 s")
        time.sleep(0.01)
    with open(path) as f:
        return bytes.fromhex(f.read().strip())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--uid-file", required=True)
    p.add_argument("--make-uid", action="store_true")
    p.add_argument("--lanes", type=int, default=4)
    p.add_argument("--size", type=int, default=8 << 20)
    p.add_argument("--count", type=int, default=4)
    p.add_argument("--timeout", type=float, default=30.0, help="mesh build timeout")
    p.add_argument("--op-timeout", type=float, default=30.0)
    p.add_argument("--die-after-queue", action="store_true")
    p.add_argument("--die-on-bytes", action="store_true")
    p.add_argument("--go-file", default=None, help="report built as GO_FILE.built<rank>, then wait for GO_FILE")
    a = p.parse_args()
    t0 = time.monotonic()
    out = {"rank": a.rank, "rounds": 0}
    m = None
    try:
        m = Mesh(2, read_uid(a.uid_file, a.make_uid), a.rank, timeout=a.timeout)
        if m.tcp_lanes != a.lanes:
            raise SystemExit(f"lanes_prog: the mesh uses {m.tcp_lanes} lanes, not {a.lanes}: {m.describe()}")
        dst = m.register_window(np.zeros(a.size, np.uint8))
        src = m.register_window(np.zeros(a.size, np.uint8))
        m.signal_window(2)
        m.barrier(timeout=a.op_timeout)
        out["built_at"] = time.monotonic() - t0
        if a.go_file:
            with open(f"{a.go_file}.built{a.rank}", "w"):
                pass
            go_by = time.monotonic() + a.op_timeout
            while not os.path.exists(a.go_file):
                if time.monotonic() > go_by:
                    raise SystemExit(f"lanes_prog: {a.go_file} did not appear within {a.op_timeout} s")
                time.sleep(0.005)
        s = np.frombuffer(src.buffer, np.uint8)
        d = np.frombuffer(dst.buffer, np.uint8)
        if a.die_after_queue or a.die_on_bytes:
            if a.rank == 0:
                s[:] = 7
                for _ in range(7):
                    m.put(1, src, 0, dst, 0, a.size)
                m.put_signal(1, src, 0, dst, 0, a.size, 0, 1)
                if a.die_after_queue:
                    os.kill(os.getpid(), signal.SIGKILL)
                m.flush(timeout=a.op_timeout)
            else:
                if a.die_on_bytes:
                    while not d[::4096].any() and time.monotonic() - t0 < a.op_timeout:
                        time.sleep(0.0005)
                    os.kill(os.getpid(), signal.SIGKILL)
                m.wait_signal(0, 1, timeout=a.op_timeout)
            out.update(ok=True, lanes=m.tcp_lanes)
        else:
            for i in range(1, a.count + 1):
                if a.rank == 0:
                    s[:] = pattern(a.size, i)
                    m.put_signal(1, src, 0, dst, 0, a.size, 0, 1)
                    m.wait_signal(1, i, timeout=a.op_timeout)
                else:
                    m.wait_signal(0, i, timeout=a.op_timeout)
                    if not np.array_equal(d, pattern(a.size, i)):
                        bad = int(np.flatnonzero(d != pattern(a.size, i))[0])
                        raise AssertionError(f"round {i}: byte {bad} differs")
                    m.signal(0, 1, 1)
                out["rounds"] = i
                out.setdefault("round_at", []).append(round(time.monotonic() - t0, 2))
            if a.rank == 0:
                back = np.frombuffer(src.buffer, np.uint8)
                back[:] = 0
                m.get(1, dst, 0, src, 0, a.size)
                m.flush(timeout=a.op_timeout)
                if not np.array_equal(back, pattern(a.size, a.count)):
                    raise AssertionError("the get back differs")
            m.barrier(timeout=a.op_timeout)
            # Neither leaves before the other is past the barrier: rank 0 hosts the bootstrap root,
            # and over a lossy link its exit could reset rank 1's barrier reply still in flight.
            if a.rank == 1:
                m.signal(0, 1, 1)
                m.flush(timeout=a.op_timeout)  # rank 0 applied it
            else:
                m.wait_signal(1, a.count + 1, timeout=a.op_timeout)
            out.update(ok=True, lanes=m.tcp_lanes)
    except MeshError as e:
        out.update(ok=False, type=type(e).__name__, peer=getattr(e, "peer", None), message=str(e))
    except AssertionError as e:
        out.update(ok=False, type="Mismatch", message=str(e))
    if m is not None and not out["ok"]:
        try:
            out["signal"] = m.read_signal(0)
        except MeshError:
            pass
    out["elapsed"] = time.monotonic() - t0
    print("RESULT " + json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0 if out["ok"] else 3)  # a lost peer's mesh is not closed: nothing waits on it


if __name__ == "__main__":
    sys.exit(main())
