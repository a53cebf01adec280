"""Device (CUDA) memory over the ucx path between two agent processes on one GPU, for
scripts/test-gpu.sh (needs torch with CUDA and a libucx wheel built with CUDA: libucx-cu12/-cu13).

    ucx_device_prog.py all [--tls LIST ...] [--timeout S]
        for each UCX_TLS value (default "cuda_copy,cuda_ipc,sm,self" and "tcp,cuda_copy"): a
        target and an initiator process, both with FLAGCX_MESH_TRANSPORT=ucx and that UCX_TLS
        (with tcp: UCX_NET_DEVICES=lo unless set);
        prints "<tls>: ok" and the figures, exits non-zero when a run failed or hung
    ucx_device_prog.py target     registers CUDA tensors "small" (4 MiB, zeros) and "kv"
                                  (256 MiB, zeros) and a host array "host" (4 MiB, zeros),
                                  prints one JSON line (metadata, descriptors), then answers the
                                  initiator's notifications "sha:<region>:<hex>": the region's
                                  sha256 must be <hex> once the notification arrives (the data is
                                  ordered before it); exits non-zero on a mismatch, 0 after "done"
    ucx_device_prog.py initiator  reads the target's line from stdin, connects, and checks:
        path     path_to() is ucx for device -> device, device -> host and host -> device
        integrity random single writes (1 B .. 1 MiB at random offsets) and batches (2 .. 64
                 ops) from a CUDA tensor into "small", every byte read back into a CUDA tensor
                 and compared with a model, random reads, the target's sha256 after each phase;
                 the same into "host" from device memory
        stream   a batch on a side stream after a fill queued on that stream: the bytes written
                 are the fill's (the op waited for the stream)
        kv       write_blocks of 4096 x 64 KiB (local block i -> remote block 4095 - i) into "kv":
                 GB/s (best and median of 5), then every byte read back with read_blocks
Each prints "<check> ok" (and figures as "figure <name> <value>"); any failure exits non-zero.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import time

import numpy as np

SECRET = "ucx-device-prog"
SMALL = 4 << 20
BLOCK, BLOCKS = 64 << 10, 4096
TLS_DEFAULT = ("cuda_copy,cuda_ipc,sm,self", "tcp,cuda_copy")


def fail(msg: str) -> None:
    print("FAIL", msg, flush=True)
    sys.exit(1)


def host_bytes(buf) -> bytes:
    """The bytes of a CUDA tensor or a numpy array."""
    return buf.cpu().numpy().tobytes() if hasattr(buf, "cpu") else buf.tobytes()


def sha(buf) -> str:
    return hashlib.sha256(host_bytes(buf)).hexdigest()


# ---------------------------------------------------------------- target

def target() -> None:
    import torch

    from flagcx_mesh.agent import Agent

    bufs = {"small": torch.zeros(SMALL, dtype=torch.uint8, device="cuda"),
            "kv": torch.zeros(BLOCK * BLOCKS, dtype=torch.uint8, device="cuda"),
            "host": np.zeros(SMALL, np.uint8)}
    with Agent("target", SECRET, timeout=60) as a:
        regions = {k: a.register(b) for k, b in bufs.items()}
        print(json.dumps({"meta": a.metadata().hex(), **{k: r.descriptor.hex() for k, r in regions.items()}}),
              flush=True)
        checked = 0
        while True:
            n = a.wait_notification("initiator", timeout=300)
            if n.data == b"done":
                print(f"target ok {checked}", flush=True)
                return
            if not n.data.startswith(b"sha:"):
                continue
            _, name, want = n.data.decode().split(":")
            torch.cuda.synchronize()
            got = sha(bufs[name])
            if got != want:
                fail(f"target: region {name} after notification {checked}: sha256 {got}, not {want}")
            checked += 1


# ---------------------------------------------------------------- initiator

def random_ops(rng, n_max, size):
    n = rng.choice([1, 7, 4096, rng.randint(1, n_max)])
    return n, rng.randrange(size - n + 1), rng.randrange(size - n + 1)


def integrity(torch, a, conn, remote, name: str, remote_on_device: bool) -> None:
    rng = random.Random(37)
    src_host = np.frombuffer(rng.randbytes(SMALL), np.uint8).copy()
    src = torch.from_numpy(src_host).cuda()
    local = a.register(src)
    for pair, l_dev in (("device -> " + name, True), ("host -> " + name, False)):
        loc = local if l_dev else a.register(src_host)
        if conn.path_to(remote, loc) != "ucx":
            fail(f"{pair}: path {conn.path_to(remote, loc)!r}, not ucx")
    model = np.zeros(SMALL, np.uint8)
    for step in range(60):
        if step % 3 == 2:
            ops = []
            for _ in range(rng.randint(2, 64)):
                n = rng.randint(1, 64 << 10)
                lo, ro = rng.randrange(SMALL - n), rng.randrange(SMALL - n)
                ops.append((local, lo, remote, ro, n))
            for _, lo, _, ro, n in ops:  # later ops of a batch win where they overlap
                model[ro:ro + n] = src_host[lo:lo + n]
            conn.batch_write(ops).wait(60)
        else:
            n, lo, ro = random_ops(rng, 1 << 20, SMALL)
            conn.write(local, remote, n, lo, ro).wait(60)
            model[ro:ro + n] = src_host[lo:lo + n]
    conn.notify(f"sha:{name}:{hashlib.sha256(model.tobytes()).hexdigest()}".encode())
    back = torch.zeros(SMALL, dtype=torch.uint8, device="cuda")
    back_region = a.register(back)
    conn.read(back_region, remote, SMALL).wait(60)
    got = back.cpu().numpy()
    if not np.array_equal(got, model):
        bad = np.flatnonzero(got != model)
        fail(f"{name}: read back: {bad.size} bytes differ, first at {bad[0]}")
    for _ in range(40):
        n, ro, lo = random_ops(rng, 256 << 10, SMALL)
        conn.read(back_region, remote, n, lo, ro).wait(60)
        if not np.array_equal(back[lo:lo + n].cpu().numpy(), model[ro:ro + n]):
            fail(f"{name}: a read of {n} bytes at {ro} into {lo} differs")
    print(f"integrity {name} ok", flush=True)


def stream_order(torch, a, conn, remote) -> None:
    """The batch is issued before the fill ran; it must move the fill's bytes."""
    buf = torch.zeros(SMALL, dtype=torch.uint8, device="cuda")
    local = a.register(buf)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # keeps the stream busy while the batch is issued
        buf.fill_(0xA7)
    conn.batch_write([(local, 0, remote, 0, SMALL)], stream=s).wait(60)
    back = torch.zeros(SMALL, dtype=torch.uint8, device="cuda")
    conn.read(a.register(back), remote, SMALL).wait(60)
    if not bool((back == 0xA7).all()):
        fail("stream: the batch did not wait for the fill queued on its stream")
    print("stream ok", flush=True)


def kv(torch, a, conn, remote) -> None:
    src = torch.randint(0, 256, (BLOCK * BLOCKS,), dtype=torch.uint8, device="cuda")
    local = a.register(src)
    table = np.array([(i * BLOCK, (BLOCKS - 1 - i) * BLOCK, BLOCK) for i in range(BLOCKS)], np.int64)
    conn.write_blocks(local, remote, table).wait(120)  # paths chosen, first touch
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        conn.write_blocks(local, remote, table).wait(120)
        times.append(time.perf_counter() - t0)
    gb = BLOCK * BLOCKS / 1e9
    print(f"figure kv_write_blocks_4096x64K_best_GBps {gb / min(times):.2f}", flush=True)
    print(f"figure kv_write_blocks_4096x64K_median_GBps {gb / statistics.median(times):.2f}", flush=True)
    back = torch.zeros_like(src)
    back_table = np.array([(i * BLOCK, i * BLOCK, BLOCK) for i in range(BLOCKS)], np.int64)
    conn.read_blocks(a.register(back), remote, back_table).wait(120)
    want = src.view(BLOCKS, BLOCK).flip(0).reshape(-1)
    if not torch.equal(back, want):
        bad = int((back != want).nonzero()[0])
        fail(f"kv: read back differs, first at byte {bad}")
    conn.notify(f"sha:kv:{sha(want)}".encode())
    print("kv ok", flush=True)


def initiator() -> None:
    import torch

    from flagcx_mesh.agent import Agent

    line = json.loads(sys.stdin.readline())
    with Agent("initiator", SECRET, timeout=60) as a:
        conn = a.connect(bytes.fromhex(line["meta"]), timeout=60)
        small, host, kv_region = (bytes.fromhex(line[k]) for k in ("small", "host", "kv"))
        print("path ok", flush=True)
        integrity(torch, a, conn, small, "small", True)
        integrity(torch, a, conn, host, "host", False)
        stream_order(torch, a, conn, small)
        kv(torch, a, conn, kv_region)
        conn.notify(b"done")
        time.sleep(0.5)  # the notification leaves before the connection closes


# ---------------------------------------------------------------- driver

def one_run(tls: str, timeout: float) -> bool:
    env = {**os.environ, "FLAGCX_MESH_TRANSPORT": "ucx", "UCX_TLS": tls}
    if "tcp" in tls.split(","):  # both processes are on this host: UCX's tcp over loopback
        env.setdefault("UCX_NET_DEVICES", "lo")
    me = os.path.abspath(__file__)
    t = subprocess.Popen([sys.executable, me, "target"], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        first = t.stdout.readline()
        for _ in range(100):  # UCX writes its own warnings to stdout: the target's line is the JSON one
            if first.startswith("{") or not first:
                break
            first = t.stdout.readline()
        if not first.startswith("{"):
            print(f"{tls}: FAILED: the target said {first!r}\n{t.stderr.read()[-4000:]}", flush=True)
            return False
        try:
            p = subprocess.run([sys.executable, me, "initiator"], env=env, input=first, capture_output=True,
                               text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            print(f"{tls}: FAILED: the initiator hung for {timeout:.0f} s\n{e.stdout}\n{e.stderr}", flush=True)
            return False
        print(f"---- UCX_TLS={tls}\n{p.stdout.strip()}", flush=True)
        out, err = t.communicate(timeout=60)
        ok = p.returncode == 0 and "kv ok" in p.stdout and t.returncode == 0 and "target ok" in out
        if not ok:
            print(f"{tls}: FAILED\ninitiator stderr: {p.stderr[-4000:]}\ntarget: {out}\n{err[-4000:]}", flush=True)
        else:
            print(f"{tls}: ok", flush=True)
        return ok
    finally:
        if t.poll() is None:
            t.kill()
            t.communicate()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=("all", "target", "initiator"))
    p.add_argument("--tls", action="append", help="a UCX_TLS value to run with (repeatable)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds each initiator may take")
    a = p.parse_args()
    if a.role == "target":
        target()
        return 0
    if a.role == "initiator":
        initiator()
        return 0
    results = [one_run(tls, a.timeout) for tls in (a.tls or TLS_DEFAULT)]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
