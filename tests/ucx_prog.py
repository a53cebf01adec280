"""The ucx path between two agent processes, for tests/test_ucx.py (FLAGCX_MESH_TRANSPORT=ucx and
UCX_TLS set by the test).

    ucx_prog.py target         registers a region of SIZE zero bytes, prints one JSON line (its
                               metadata and descriptor, hex), then waits for the initiator's
                               notifications: those of "sha:<hex>" carry the sha256 the region
                               must have once they arrive (the data is ordered before them, and
                               the initiator sends nothing more but "done"); prints "target ok N" after
                               the notification "done", exits non-zero on a mismatch
    ucx_prog.py initiator SCENARIO   reads the target's line from stdin, connects, and runs:
        integrity  random sizes and offsets, single writes and batches, every byte read back
                   and compared with a model; notifications with the model's sha256
        order      200 writes of value i over the same bytes, then one batch whose ops overlap:
                   the last one wins at the target
        kill       prints "issued" after its first batch, then batches until one fails (the test
                   kills the target): it must fail with PeerLost naming the target, and a later
                   write must fail at once
    ucx_prog.py fuzz           two agents in this process: every byte of a ucx region's descriptor
                               flipped (tests/test_peer_binding.py's fuzz, on the ucx path)
    ucx_prog.py device-fake    two agents in this process with device regions of the fake CUDA
                               driver (FLAGCX_MESH_CUDA_DRIVER set by the test), whose memory UCX
                               cannot reach (no cuda transport here): with FLAGCX_MESH_TRANSPORT=ucx
                               every pair with device memory on either side is refused naming why
                               (device memory is no longer left to the cuda paths), host -> host
                               still takes ucx; without it (FLAGCX_MESH_UCX_LIB: automatic) the
                               device pairs keep cuda-self and the device region is not handed
                               to UCX
Each prints "<scenario> ok" when it passed; any failure exits non-zero.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import time

import numpy as np

from flagcx_mesh import MeshError, PeerLost
from flagcx_mesh.agent import Agent

SECRET = "ucx-prog-secret"
SIZE = 4 << 20


def fail(msg: str) -> None:
    print("FAIL", msg, flush=True)
    sys.exit(1)


def target() -> None:
    buf = np.zeros(SIZE, np.uint8)
    with Agent("target", SECRET, timeout=30) as a:
        region = a.register(buf)
        print(json.dumps({"meta": a.metadata().hex(), "region": region.descriptor.hex()}), flush=True)
        checked = 0
        while True:
            n = a.wait_notification("initiator", timeout=120)
            if n.data == b"done":
                print(f"target ok {checked}", flush=True)
                return
            if not n.data.startswith(b"sha:"):
                continue  # a batch's own notification (more data may land after it)
            want = n.data[4:].decode()
            got = hashlib.sha256(buf.tobytes()).hexdigest()
            if got != want:
                fail(f"target: after notification {checked} the region's sha256 is {got}, not {want}")
            checked += 1


def sha(model) -> bytes:
    """The notification that says what the target's region must hold once it arrives."""
    return b"sha:" + hashlib.sha256(model.tobytes()).hexdigest().encode()


def connect():
    line = json.loads(sys.stdin.readline())
    a = Agent("initiator", SECRET, timeout=20)
    conn = a.connect(bytes.fromhex(line["meta"]), timeout=20)
    return a, conn, bytes.fromhex(line["region"])


def integrity(a, conn, remote) -> None:
    rng = random.Random(37)
    src = np.frombuffer(rng.randbytes(SIZE), np.uint8).copy()
    local = a.register(src)
    model = np.zeros(SIZE, np.uint8)
    if conn.path_to(remote) != "ucx":
        fail(f"path {conn.path_to(remote)!r}, not ucx")
    for step in range(60):
        if step % 3 == 2:
            ops = []
            for _ in range(rng.randint(2, 64)):
                n = rng.randint(1, 64 << 10)
                lo, ro = rng.randrange(SIZE - n), rng.randrange(SIZE - n)
                ops.append((local, lo, remote, ro, n))
            # within one batch, later ops win where ops overlap: write the model in order
            for _, lo, _, ro, n in ops:
                model[ro:ro + n] = src[lo:lo + n]
            conn.batch_write(ops, notification=b"batch %d" % step).wait(30)
        else:
            n = rng.choice([1, 7, 4096, rng.randint(1, 1 << 20)])
            lo, ro = rng.randrange(SIZE - n + 1), rng.randrange(SIZE - n + 1)
            conn.write(local, remote, n, lo, ro).wait(30)
            model[ro:ro + n] = src[lo:lo + n]
    back = np.zeros(SIZE, np.uint8)
    back_region = a.register(back)
    conn.read(back_region, remote, SIZE).wait(30)
    if not np.array_equal(back, model):
        bad = np.flatnonzero(back != model)
        fail(f"read back: {bad.size} bytes differ, first at {bad[0]}")
    for _ in range(50):  # reads at random offsets into random places
        n = rng.randint(1, 256 << 10)
        ro, lo = rng.randrange(SIZE - n + 1), rng.randrange(SIZE - n + 1)
        conn.read(back_region, remote, n, lo, ro).wait(30)
        if not np.array_equal(back[lo:lo + n], model[ro:ro + n]):
            fail(f"read of {n} bytes at {ro} into {lo} differs")
    conn.notify(sha(model))
    conn.notify(b"done")
    print("integrity ok", flush=True)


def order(a, conn, remote) -> None:
    n = 64 << 10
    src = np.zeros(256 * n, np.uint8)
    for i in range(256):
        src[i * n:(i + 1) * n] = i
    local = a.register(src)
    handles = [conn.write(local, remote, n, i * n, 4096) for i in range(200)]
    for h in handles:
        h.wait(30)
    model = np.zeros(SIZE, np.uint8)
    model[4096:4096 + n] = 199
    ops = [(local, i * n, remote, 8192 + i, n) for i in range(200, 256)]
    for _, lo, _, ro, m in ops:
        model[ro:ro + m] = src[lo:lo + m]
    conn.batch_write(ops, notification=sha(model)).wait(30)
    conn.notify(b"done")
    print("order ok", flush=True)


def kill(a, conn, remote) -> None:
    src = np.full(SIZE, 0x5A, np.uint8)
    local = a.register(src)
    ops = [(local, 0, remote, 0, SIZE)] * 16
    started = time.monotonic()
    said = False
    try:
        for _ in range(100000):
            h = conn.batch_write(ops)
            if not said:
                print("issued", flush=True)
                said = True
            h.wait(30)
        fail("the target was not killed")
    except PeerLost as e:
        if "target" not in str(e):
            fail(f"PeerLost without the peer's name: {e}")
        print("lost:", e, flush=True)
    except MeshError as e:
        fail(f"{type(e).__name__}, not PeerLost: {e}")
    try:
        conn.write(local, remote, 4096).wait(30)
        fail("a write after the loss went through")
    except MeshError as e:
        print("after:", type(e).__name__, e, flush=True)
    print(f"kill ok ({time.monotonic() - started:.1f} s)", flush=True)


def main() -> None:
    if sys.argv[1] == "target":
        return target()
    if sys.argv[1] == "fuzz":
        return fuzz()
    if sys.argv[1] == "device-fake":
        return device_fake()
    a, conn, remote = connect()
    with a:
        {"integrity": integrity, "order": order, "kill": kill}[sys.argv[2]](a, conn, remote)



GUARD = 4096
N = 4096


def fuzz() -> None:
    """Two agents in this process: every byte of a ucx region's descriptor flipped, on a fresh
    region each time; each write and read either stays inside that region or is refused naming
    the peer (or the descriptor); the guards around every region never change."""
    from flagcx_mesh import InvalidArgument
    with Agent("target", SECRET, timeout=10) as b, Agent("initiator", SECRET, timeout=10) as a:
        conn = a.connect(b.metadata(), timeout=10)
        src = a.register(np.full(N, 0x55, np.uint8))
        back_arr = np.full(N + GUARD, 0xEE, np.uint8)
        back = a.register(back_arr[:N])
        regions = []

        def fresh():
            whole = np.full(GUARD + N + GUARD, 0xEE, np.uint8)
            whole[GUARD:GUARD + N] = 0x55
            regions.append(whole)
            return b.register(whole[GUARD:GUARD + N])

        first = fresh()
        conn.write(src, first, N).wait(10)
        if conn.path_to(first) != "ucx":
            fail(f"path {conn.path_to(first)!r}, not ucx")
        refused = 0
        for i in range(len(first.descriptor)):
            bad = bytearray(fresh().descriptor)
            bad[i] ^= 0xFF if i % 2 else 0x01
            for read in (False, True):
                try:
                    (conn.read if read else conn.write)(back if read else src, bytes(bad), N).wait(10)
                except MeshError as e:
                    refused += 1
                    if not isinstance(e, InvalidArgument) or not ("agent target" in str(e) or "region descriptor" in str(e)):
                        fail(f"byte {i}: {type(e).__name__}: {e}")
            if not (back_arr[N:] == 0xEE).all() or not set(np.unique(back_arr[:N])) <= {0x55, 0xEE}:
                fail(f"byte {i}: a read brought bytes from outside a region")
        for whole in regions:
            if not ((whole[:GUARD] == 0xEE).all() and (whole[GUARD + N:] == 0xEE).all() and (whole[GUARD:GUARD + N] == 0x55).all()):
                fail("a guard or region byte changed")
        if refused == 0:
            fail("no flipped descriptor was refused")
        conn.write(src, first, N).wait(10)
        print(f"fuzz ok: {len(first.descriptor)} bytes flipped, {refused} ops refused", flush=True)


def device_fake() -> None:
    import os

    from flagcx_mesh import InvalidArgument
    from gpu_prog import FakeDevice

    forced = os.environ.get("FLAGCX_MESH_TRANSPORT") == "ucx"
    dev = FakeDevice()
    with Agent("target", SECRET, timeout=10) as b, Agent("initiator", SECRET, timeout=10) as a:
        conn = a.connect(b.metadata(), timeout=10)
        remote = {"dev": b.register(dev.buffer(N)), "host": b.register(np.zeros(N, np.uint8))}
        local = {"dev": a.register(dev.buffer(N)), "host": a.register(np.zeros(N, np.uint8))}
        for lk, rk in (("dev", "dev"), ("host", "dev"), ("dev", "host"), ("host", "host")):
            try:
                path = conn.path_to(remote[rk], local[lk])
            except InvalidArgument as e:
                path = f"refused: {e}"
            print(f"{lk} -> {rk}: {path}", flush=True)
            if lk == rk == "host":
                if forced and path != "ucx":
                    fail(f"host -> host: {path}, not ucx")
            elif not forced and path != "cuda-self":
                fail(f"{lk} -> {rk}: {path}, not cuda-self (automatic selection keeps the cuda paths on one host)")
            elif forced:
                side = "the peer's window" if lk == "host" else "this rank's copy"
                if not path.startswith("refused") or "FLAGCX_MESH_TRANSPORT=ucx" not in path or \
                        f"{side} is device memory and UCX here offers no transport for CUDA memory" not in path:
                    fail(f"{lk} -> {rk}: {path} (a forced ucx must refuse naming why)")
        print("device-fake ok", flush=True)


if __name__ == "__main__":
    main()
